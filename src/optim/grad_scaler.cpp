#include "dp/optim/grad_scaler.h"

#include <cmath>
#include <string>

#include "dp/core/error.h"
#include "dp/nn/utils.h"
#include "dp/tensor/ops.h"

namespace dp::amp {

namespace {

void check_options(double init_scale, double growth, double backoff, std::int64_t interval) {
  DP_CHECK(std::isfinite(init_scale) && init_scale > 0, "GradScaler: expected init_scale > 0, got ", init_scale);
  DP_CHECK(std::isfinite(growth) && growth > 1, "GradScaler: expected growth_factor > 1, got ", growth);
  DP_CHECK(backoff > 0 && backoff < 1, "GradScaler: expected backoff_factor in (0, 1), got ", backoff);
  DP_CHECK(interval >= 1, "GradScaler: expected growth_interval >= 1, got ", interval);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions o)
    : scale_(o.init_scale),
      growth_factor_(o.growth_factor),
      backoff_factor_(o.backoff_factor),
      growth_interval_(o.growth_interval),
      enabled_(o.enabled) {
  check_options(o.init_scale, o.growth_factor, o.backoff_factor, o.growth_interval);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  DP_CHECK(loss.defined(), "GradScaler::scale: expected a defined loss, got an undefined tensor");
  if (!enabled_) return loss;
  return mul(loss, scale_);
}

void GradScaler::unscale_(optim::Optimizer& opt) {
  if (!enabled_) return;
  PerOptimizer& st = per_opt_[&opt];
  DP_CHECK(!st.stepped, "GradScaler::unscale_: called after step() for this optimizer; unscale_ before step(), "
           "once per optimizer per step");
  DP_CHECK(!st.unscaled, "GradScaler::unscale_: already called for this optimizer since the last update(); "
           "unscale_ once per optimizer per step");
  // In float32, as PyTorch's inv_scale = scale.double().reciprocal().float().
  const double inv = static_cast<double>(static_cast<float>(1.0 / scale_));
  st.found_inf = nn::utils::scale_grads_find_nonfinite_(opt.parameters(), inv);
  st.unscaled = true;
}

bool GradScaler::step(optim::Optimizer& opt) {
  if (!enabled_) {
    opt.step();
    return true;
  }
  PerOptimizer& st = per_opt_[&opt];  // unscale_ finds the same entry
  // A second step before update() would step the optimizer twice on one gradient
  // (PyTorch raises too).
  DP_CHECK(!st.stepped, "GradScaler::step: already called for this optimizer since the last update(); "
           "call update() after each step");
  if (!st.unscaled) unscale_(opt);
  st.stepped = true;
  if (st.found_inf) return false;  // Note [One decision everywhere]
  opt.step();
  return true;
}

void GradScaler::update() {
  if (!enabled_) return;
  DP_CHECK(!per_opt_.empty(), "GradScaler::update: no step(optimizer) or unscale_(optimizer) since the last "
           "update(), so no check for infinities to decide the scale by; call update() once per step, after "
           "scaler.step(optimizer)");
  bool found = false;
  for (const auto& [opt, st] : per_opt_) found = found || st.found_inf;
  if (found) {
    scale_ *= backoff_factor_;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == growth_interval_) {
    const double grown = scale_ * growth_factor_;
    if (std::isfinite(static_cast<float>(grown))) scale_ = grown;  // PyTorch keeps a float32 scale finite
    growth_tracker_ = 0;
  }
  per_opt_.clear();
}

void GradScaler::update(double new_scale) {
  if (!enabled_) return;
  DP_CHECK(std::isfinite(new_scale) && new_scale > 0, "GradScaler::update: expected a new scale > 0, got ", new_scale);
  scale_ = new_scale;
  per_opt_.clear();
}

nn::StateDict GradScaler::state_dict() const {
  if (!enabled_) return {};
  auto f32 = [](double v) { return full({}, v, TensorOptions{Dtype::Float32}); };
  auto i64 = [](std::int64_t v) { return full({}, static_cast<double>(v), TensorOptions{Dtype::Int64}); };
  return {{"scale", f32(scale_)},
          {"growth_factor", f32(growth_factor_)},
          {"backoff_factor", f32(backoff_factor_)},
          {"growth_interval", i64(growth_interval_)},
          {"growth_tracker", i64(growth_tracker_)}};
}

void GradScaler::load_state_dict(const nn::StateDict& state) {
  DP_CHECK(enabled_ || state.empty(), "GradScaler::load_state_dict: this scaler is disabled; expected an empty "
           "state, got ", state.size(), " entries");
  if (!enabled_) return;
  auto find = [&](const char* name) -> const Tensor& {
    for (const auto& [k, t] : state)
      if (k == name) {
        DP_CHECK(t.defined() && t.numel() == 1, "GradScaler::load_state_dict: expected a scalar '", name, "', got ",
                 t.defined() ? t.str() : "an undefined tensor");
        return t;
      }
    DP_FAIL("GradScaler::load_state_dict: the state has no '", name,
            "' (expected scale, growth_factor, backoff_factor, growth_interval, growth_tracker)");
  };
  const double scale = find("scale").item(), growth = find("growth_factor").item();
  const double backoff = find("backoff_factor").item();
  const auto interval = find("growth_interval").item<std::int64_t>();
  const auto tracker = find("growth_tracker").item<std::int64_t>();
  check_options(scale, growth, backoff, interval);
  DP_CHECK(tracker >= 0 && tracker < interval, "GradScaler::load_state_dict: expected growth_tracker in [0, ",
           interval, "), got ", tracker);
  scale_ = scale;
  growth_factor_ = growth;
  backoff_factor_ = backoff;
  growth_interval_ = interval;
  growth_tracker_ = tracker;
  per_opt_.clear();
}

}  // namespace dp::amp
