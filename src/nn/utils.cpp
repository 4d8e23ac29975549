#include "dp/nn/utils.h"

#include <algorithm>
#include <cmath>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"

namespace dp::nn::utils {
namespace {

// The `p`-norm of every element of g, as a 1-element tensor on g's device.
Tensor norm_of(const Tensor& g, double p) {
  Tensor flat = g.reshape({g.numel()});
  if (std::isinf(p)) return max(abs(flat), 0, /*keepdim=*/true);
  if (p == 2.0) return sqrt(sum(square(flat))).reshape({1});
  if (p == 1.0) return sum(abs(flat)).reshape({1});
  return pow(sum(pow(abs(flat), p)), 1.0 / p).reshape({1});
}

// The runs of the set's flat buffers that the list's parameters cover, merged: a
// whole model's parameters are one run, so every copy is clipped in one call.
std::vector<std::pair<std::int64_t, std::int64_t>> flat_ranges(const ParameterList& params) {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (const auto& slot : params.slots()) ranges.emplace_back(slot->offset, slot->offset + slot->copies[0].numel());
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second) merged.back().second = std::max(merged.back().second, r.second);
    else merged.push_back(r);
  }
  return merged;
}

// Applies edit(view) to the list's gradients on every copy that an optimizer steps.
void edit_every_copy(const ParameterList& params, const std::function<void(Tensor&)>& edit) {
  NoGradGuard no_grad;
  const auto& set = params.set();
  if (!set) {
    for (const Tensor& p : params) {
      Tensor g = p.grad();
      if (g.defined()) edit(g);
    }
    return;
  }
  // Each device of a sharded set holds only its range's gradient: a norm over copy 0
  // would miss the others, and stage 2 holds no full gradient buffer at all.
  DP_CHECK(!set->sharded(), "gradient clipping of a Sharded DataParallel's parameters is not supported yet; "
           "use Mode::DDP (same result, bitwise) to clip gradients");
  auto ranges = flat_ranges(params);
  set->for_each_copy([&](int r) {
    for (const auto& [lo, hi] : ranges) {
      Tensor view = set->copy(r).grad.narrow(0, lo, hi - lo);
      edit(view);
    }
  });
}

}  // namespace

double clip_grad_norm_(const ParameterList& params, double max_norm, double norm_type, bool error_if_nonfinite) {
  DP_CHECK(max_norm >= 0, "clip_grad_norm_: expected max_norm >= 0, got ", max_norm);
  DP_CHECK(norm_type > 0, "clip_grad_norm_: expected norm_type > 0 (2 for the Euclidean norm, "
           "dp::nn::utils::kInfNorm for the largest element), got ", norm_type);
  NoGradGuard no_grad;
  DP_CHECK(!params.set() || !params.set()->sharded(), "clip_grad_norm_: gradient clipping of a Sharded "
           "DataParallel's parameters is not supported yet; use Mode::DDP (same result, bitwise)");
  std::vector<Tensor> norms;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (g.defined() && g.numel() > 0) norms.push_back(norm_of(g.detach(), norm_type).to(params[0].device()));
  }
  if (norms.empty()) return 0.0;
  // As PyTorch: the norm of the per-parameter norms (the max of them for the inf-norm).
  const double total = norm_of(cat(norms), norm_type).item();
  DP_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm_: the total norm of the gradients is ",
           total, "; check the loss and the data for NaN/Inf, or pass error_if_nonfinite = false");
  // In float32, as PyTorch computes clip_coef from a float32 total.
  const float coef = static_cast<float>(max_norm) / (static_cast<float>(total) + 1e-6f);
  if (coef < 1.0f) edit_every_copy(params, [coef](Tensor& g) { g.mul_(coef); });
  return total;
}

void clip_grad_value_(const ParameterList& params, double clip_value) {
  DP_CHECK(clip_value >= 0, "clip_grad_value_: expected clip_value >= 0, got ", clip_value);
  edit_every_copy(params, [clip_value](Tensor& g) {
    Tensor lo = full({}, -clip_value, {.device = g.device()});
    // clamp(g, -c, c) = max(-max(-g, -c), -c)
    g.copy_(maximum(neg(maximum(neg(g), lo)), lo));
  });
}

}  // namespace dp::nn::utils
