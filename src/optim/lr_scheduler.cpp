// Learning-rate schedulers. Every formula below is PyTorch 1.13's
// torch/optim/lr_scheduler.py, with the operations in the same order and in double (a
// Python float), so that the lr sequence is bitwise the one PyTorch prints; see Note
// [Scheduler steps] in dp/optim/lr_scheduler.h. The reference sequences come from
// scripts/make_lr_reference.py.
#include "dp/optim/lr_scheduler.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <utility>

#include "dp/core/error.h"

namespace dp::optim {

// ---- LRScheduler ---------------------------------------------------------------------------

LRScheduler::LRScheduler(Optimizer& optimizer, std::string kind)
    : optimizer_(optimizer), kind_(std::move(kind)) {}

LRScheduler::~LRScheduler() = default;

void LRScheduler::initial_step() {
  // PyTorch, per group: group.setdefault('initial_lr', group['lr']); base_lrs = initial_lr.
  const std::size_t groups = optimizer_.num_param_groups();
  std::vector<std::size_t> recorded;
  base_lrs_.clear();
  for (std::size_t g = 0; g < groups; ++g) {
    if (!optimizer_.initial_lr(g).has_value()) {
      optimizer_.set_initial_lr(g, optimizer_.group_lr(g));
      recorded.push_back(g);
    }
    base_lrs_.push_back(*optimizer_.initial_lr(g));
  }
  try {
    step();
  } catch (...) {
    for (std::size_t g : recorded) optimizer_.set_initial_lr(g, std::nullopt);
    throw;
  }
}

// Note [Learning rates below zero by rounding]
// A schedule that reaches zero can land just below it: PyTorch's chainable LinearLR
// with end_factor = 0 multiplies the lr at its last step by
// 1 + (0 - s) / (N·s + (N - 1)·(0 - s)), which rounds to -2.2e-16 rather than 0 (start
// factor 1/3, 5 iterations: lr -7.4e-19 from a base lr of 0.05). PyTorch sets that lr;
// dp refused it as a negative lr, so a run decaying linearly to zero failed at its
// last step (the optimizer fuzzer found it, Note [Optimizer fuzzer]). An lr below zero
// by at most 2^-40 of the larger of the base lr and the current lr is the rounding of
// a zero and is set as 0, which differs from PyTorch's value by less than 1e-12 of the
// lr; a schedule clearly below zero (CosineAnnealingLR's chainable form with eta_min
// above the base lr, a LambdaLR past its zero) is still refused.
constexpr double kZeroByRounding = 0x1p-40;

void LRScheduler::step() {
  // Every group from its own lr and base lr (Note [Scheduler steps]); all checked first.
  const std::int64_t epoch = last_epoch_ + 1;
  const std::size_t groups = optimizer_.num_param_groups();
  std::vector<double> old_lrs, lrs;
  for (std::size_t g = 0; g < groups; ++g) {
    old_lrs.push_back(optimizer_.group_lr(g));
    double lr = get_lr(epoch, g, old_lrs.back(), base_lrs_[g]);
    if (lr < 0 && lr >= -kZeroByRounding * std::max(base_lrs_[g], old_lrs.back())) lr = 0.0;
    DP_CHECK(std::isfinite(lr) && lr >= 0, kind_, ": step ", epoch, " gives the learning rate ", lr, " (base lr ",
             base_lrs_[g], groups > 1 ? detail::str_cat(", param group ", g) : std::string(),
             "); expected a finite lr >= 0 — check the schedule's options");
    lrs.push_back(lr);
  }
  try {
    for (std::size_t g = 0; g < groups; ++g) optimizer_.set_group_lr(g, lrs[g]);
    after_step(epoch);
  } catch (...) {
    for (std::size_t g = 0; g < groups; ++g) optimizer_.set_group_lr(g, old_lrs[g]);
    throw;
  }
  last_epoch_ = epoch;
  last_lrs_ = std::move(lrs);
}

LRSchedulerState LRScheduler::state_dict() const {
  return LRSchedulerState{kind_, last_epoch_, base_lrs_, last_lrs_};
}

void LRScheduler::load_state_dict(const LRSchedulerState& state) {
  DP_CHECK(state.kind == kind_, kind_, ".load_state_dict: expected a state saved by ", kind_, ", got one saved by ",
           state.kind.empty() ? std::string("no scheduler (empty kind)") : state.kind,
           "; build the same scheduler as the saved run");
  DP_CHECK(state.base_lrs.size() == base_lrs_.size() && state.last_lrs.size() == base_lrs_.size(), kind_,
           ".load_state_dict: expected ", base_lrs_.size(), " parameter group(s), got ", state.base_lrs.size(),
           " base lr(s) and ", state.last_lrs.size(), " last lr(s)");
  DP_CHECK(state.last_epoch >= 0, kind_, ".load_state_dict: expected last_epoch >= 0, got ", state.last_epoch);
  last_epoch_ = state.last_epoch;
  base_lrs_ = state.base_lrs;
  last_lrs_ = state.last_lrs;
}

namespace {

void check_gamma(const char* kind, double gamma) {
  DP_CHECK(std::isfinite(gamma) && gamma >= 0, kind, ": expected gamma >= 0 (the factor applied to the lr), got ",
           gamma);
}

}  // namespace

// ---- StepLR ----------------------------------------------------------------------------------

StepLR::StepLR(Optimizer& optimizer, StepLROptions options) : LRScheduler(optimizer, "StepLR"), options_(options) {
  DP_CHECK(options_.step_size >= 1, "StepLR: expected step_size >= 1 (steps between decays), got ",
           options_.step_size);
  check_gamma("StepLR", options_.gamma);
  initial_step();
}

double StepLR::get_lr(std::int64_t epoch, std::size_t /*group*/, double lr, double /*base_lr*/) {
  if (epoch == 0 || epoch % options_.step_size != 0) return lr;
  return lr * options_.gamma;
}

// ---- MultiStepLR -------------------------------------------------------------------------------

MultiStepLR::MultiStepLR(Optimizer& optimizer, MultiStepLROptions options)
    : LRScheduler(optimizer, "MultiStepLR"), options_(std::move(options)) {
  const auto& m = options_.milestones;
  for (std::size_t i = 0; i < m.size(); ++i) {
    DP_CHECK(m[i] >= 0, "MultiStepLR: expected milestones >= 0, got milestones[", i, "] = ", m[i]);
    DP_CHECK(i == 0 || m[i] > m[i - 1], "MultiStepLR: expected strictly increasing milestones, got milestones[",
             i - 1, "] = ", m[i - 1], " then milestones[", i, "] = ", m[i]);
  }
  check_gamma("MultiStepLR", options_.gamma);
  initial_step();
}

double MultiStepLR::get_lr(std::int64_t epoch, std::size_t /*group*/, double lr, double /*base_lr*/) {
  // PyTorch multiplies by gamma ** (times the milestone is listed): once here, and
  // gamma ** 1 == gamma exactly.
  for (std::int64_t m : options_.milestones)
    if (m == epoch) return lr * options_.gamma;
  return lr;
}

// ---- ExponentialLR -------------------------------------------------------------------------------

ExponentialLR::ExponentialLR(Optimizer& optimizer, ExponentialLROptions options)
    : LRScheduler(optimizer, "ExponentialLR"), options_(options) {
  check_gamma("ExponentialLR", options_.gamma);
  initial_step();
}

double ExponentialLR::get_lr(std::int64_t epoch, std::size_t /*group*/, double lr, double /*base_lr*/) {
  return epoch == 0 ? lr : lr * options_.gamma;
}

// ---- CosineAnnealingLR ----------------------------------------------------------------------------

CosineAnnealingLR::CosineAnnealingLR(Optimizer& optimizer, CosineAnnealingLROptions options)
    : LRScheduler(optimizer, "CosineAnnealingLR"), options_(options) {
  DP_CHECK(options_.T_max >= 1, "CosineAnnealingLR: expected T_max >= 1 (steps of half a cosine period), got ",
           options_.T_max);
  DP_CHECK(std::isfinite(options_.eta_min) && options_.eta_min >= 0,
           "CosineAnnealingLR: expected eta_min >= 0 (the lowest lr), got ", options_.eta_min);
  initial_step();
}

double CosineAnnealingLR::get_lr(std::int64_t epoch, std::size_t /*group*/, double lr, double base_lr) {
  constexpr double pi = std::numbers::pi;  // == Python's math.pi
  const double T = static_cast<double>(options_.T_max), eta_min = options_.eta_min;
  const double e = static_cast<double>(epoch);
  if (epoch == 0) return lr;
  // PyTorch's `_step_count == 1 and last_epoch > 0` branch needs a scheduler built
  // with last_epoch > -1, which dp resumes through load_state_dict instead.
  if ((epoch - 1 - options_.T_max) % (2 * options_.T_max) == 0) {
    // The trough, where the recursive ratio below would divide by 1 + cos(π) = 0.
    return lr + (base_lr - eta_min) * (1 - std::cos(pi / T)) / 2;
  }
  return (1 + std::cos(pi * e / T)) / (1 + std::cos(pi * (e - 1) / T)) * (lr - eta_min) + eta_min;
}

// ---- LinearLR ---------------------------------------------------------------------------------------

LinearLR::LinearLR(Optimizer& optimizer, LinearLROptions options)
    : LRScheduler(optimizer, "LinearLR"), options_(options) {
  DP_CHECK(options_.start_factor > 0 && options_.start_factor <= 1,
           "LinearLR: expected start_factor in (0, 1] (it multiplies the lr at step 0), got ",
           options_.start_factor);
  DP_CHECK(options_.end_factor >= 0 && options_.end_factor <= 1, "LinearLR: expected end_factor in [0, 1], got ",
           options_.end_factor);
  DP_CHECK(options_.total_iters >= 1, "LinearLR: expected total_iters >= 1 (steps to reach end_factor), got ",
           options_.total_iters);
  initial_step();
}

double LinearLR::get_lr(std::int64_t epoch, std::size_t /*group*/, double lr, double /*base_lr*/) {
  const double sf = options_.start_factor, ef = options_.end_factor;
  if (epoch == 0) return lr * sf;
  if (epoch > options_.total_iters) return lr;
  return lr * (1. + (ef - sf) / (static_cast<double>(options_.total_iters) * sf +
                                 static_cast<double>(epoch - 1) * (ef - sf)));
}

// ---- OneCycleLR -------------------------------------------------------------------------------------

namespace {

/// Each group's max_lr: max_lrs (checked against the groups) or max_lr for every group.
std::vector<double> max_lrs_of(const OneCycleLROptions& o, std::size_t groups) {
  if (o.max_lrs.empty()) {
    DP_CHECK(std::isfinite(o.max_lr) && o.max_lr > 0, "OneCycleLR: expected max_lr > 0, got ", o.max_lr);
    return std::vector<double>(groups, o.max_lr);
  }
  DP_CHECK(o.max_lr == 0, "OneCycleLR: expected max_lr or max_lrs, got both (max_lr = ", o.max_lr,
           " and ", o.max_lrs.size(), " max_lrs); give one");
  DP_CHECK(o.max_lrs.size() == groups, "OneCycleLR: expected one max_lr per parameter group (", groups,
           ") in max_lrs, got ", o.max_lrs.size());
  for (std::size_t g = 0; g < groups; ++g)
    DP_CHECK(std::isfinite(o.max_lrs[g]) && o.max_lrs[g] > 0, "OneCycleLR: expected max_lrs[", g, "] > 0, got ",
             o.max_lrs[g]);
  return o.max_lrs;
}

}  // namespace

// PyTorch stores these in each parameter group: initial_lr, max_lr, min_lr.
std::vector<OneCycleLR::Phase> OneCycleLR::phases_for(const OneCycleLROptions& o, double max_lr, double total) {
  const double initial_lr = max_lr / o.div_factor;
  const double min_lr = initial_lr / o.final_div_factor;
  const double hi = o.max_momentum, lo = o.base_momentum;
  if (o.three_phase)
    return {{o.pct_start * total - 1, initial_lr, max_lr, hi, lo},
            {2 * o.pct_start * total - 2, max_lr, initial_lr, lo, hi},
            {total - 1, initial_lr, min_lr, hi, hi}};
  return {{o.pct_start * total - 1, initial_lr, max_lr, hi, lo}, {total - 1, max_lr, min_lr, lo, hi}};
}

OneCycleLR::OneCycleLR(Optimizer& optimizer, OneCycleLROptions options)
    : LRScheduler(optimizer, "OneCycleLR"), options_(options) {
  const OneCycleLROptions& o = options_;
  if (o.total_steps != 0) {
    DP_CHECK(o.total_steps > 0, "OneCycleLR: expected total_steps > 0, got ", o.total_steps);
    total_steps_ = o.total_steps;
  } else {
    DP_CHECK(o.epochs > 0 && o.steps_per_epoch > 0,
             "OneCycleLR: expected total_steps > 0, or epochs > 0 and steps_per_epoch > 0; got total_steps = 0, "
             "epochs = ", o.epochs, ", steps_per_epoch = ", o.steps_per_epoch);
    total_steps_ = o.epochs * o.steps_per_epoch;
  }
  const std::size_t groups = optimizer.num_param_groups();
  const std::vector<double> max_lrs = max_lrs_of(o, groups);
  DP_CHECK(o.pct_start >= 0 && o.pct_start <= 1, "OneCycleLR: expected pct_start in [0, 1], got ", o.pct_start);
  DP_CHECK(o.div_factor > 0 && o.final_div_factor > 0,
           "OneCycleLR: expected div_factor > 0 and final_div_factor > 0, got ", o.div_factor, " and ",
           o.final_div_factor);
  for (double max_lr : max_lrs) phases_.push_back(phases_for(o, max_lr, static_cast<double>(total_steps_)));

  std::vector<double> old_momenta;  // per group, when cycling
  auto restore_momenta = [&] {
    for (std::size_t g = 0; g < old_momenta.size(); ++g) optimizer.set_group_momentum(g, old_momenta[g]);
  };
  if (o.cycle_momentum) {
    for (std::size_t g = 0; g < groups; ++g) {
      const std::optional<double> m = optimizer.group_momentum(g);
      DP_CHECK(m.has_value(), "OneCycleLR: cycle_momentum needs an optimizer with a momentum (SGD's "
               "momentum, Adam's beta1), got one without; pass cycle_momentum = false");
      old_momenta.push_back(*m);
    }
    const double hi = o.max_momentum, lo = o.base_momentum;
    DP_CHECK(lo >= 0 && hi >= 0, "OneCycleLR: expected base_momentum >= 0 and max_momentum >= 0, got ", lo,
             " and ", hi);
    // Let the optimizer check both ends now (Adam wants beta1 < 1), not mid-run.
    try {
      optimizer.set_momentum(lo);
      optimizer.set_momentum(hi);
    } catch (...) {
      restore_momenta();
      throw;
    }
  }
  // OneCycleLR overrides any initial lr (PyTorch sets each group's 'initial_lr' itself).
  std::vector<std::optional<double>> old_initial;
  for (std::size_t g = 0; g < groups; ++g) old_initial.push_back(optimizer.initial_lr(g));
  for (std::size_t g = 0; g < groups; ++g) optimizer.set_initial_lr(g, phases_[g].front().start_lr);
  try {
    initial_step();
  } catch (...) {
    for (std::size_t g = 0; g < groups; ++g) optimizer.set_initial_lr(g, old_initial[g]);
    restore_momenta();
    throw;
  }
}

const OneCycleLR::Phase& OneCycleLR::phase_of(std::int64_t epoch, std::size_t group, double* pct) const {
  DP_CHECK(epoch <= total_steps_, "OneCycleLR: tried to step ", epoch + 1, " times; the schedule has total_steps = ",
           total_steps_, " (steps 0 … ", total_steps_, " after construction); build it with more total_steps, or "
           "stop stepping");
  double start = 0;
  const double step = static_cast<double>(epoch);
  const std::vector<Phase>& phases = phases_[group];
  for (std::size_t i = 0; i < phases.size(); ++i) {
    const Phase& ph = phases[i];
    if (step <= ph.end_step || i + 1 == phases.size()) {
      DP_CHECK(ph.end_step != start, "OneCycleLR: step ", epoch, " falls in phase ", i + 1, " of ", phases.size(),
               ", which has zero length (pct_start = ", options_.pct_start, ", total_steps = ", total_steps_,
               "); change pct_start or total_steps");
      *pct = (step - start) / (ph.end_step - start);
      return ph;
    }
    start = ph.end_step;
  }
  DP_ASSERT(false, "OneCycleLR: no phase for step ", epoch);
  return phases.back();
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (options_.anneal_strategy == AnnealStrategy::Linear) return (end - start) * pct + start;
  const double cos_out = std::cos(std::numbers::pi * pct) + 1;
  return end + (start - end) / 2.0 * cos_out;
}

// Note [OneCycleLR's last step]
// PyTorch accepts step() up to last_epoch == total_steps, one step past the last phase's
// end (total_steps − 1), and extrapolates the anneal there. A loop that calls step()
// after each of its total_steps batches reaches that step after the last batch. The
// cosine comes back up symmetrically and stays inside the phase's range, but the
// linear anneal overshoots: below zero for the lr (which dp's optimizers refuse) and
// past max_momentum (above 1 for Adam's beta1 with a max_momentum near 1). At that one
// step dp holds both within the last phase's range, which changes only the overshooting
// linear values; every value inside the schedule is PyTorch's, bit for bit.
double OneCycleLR::annealed(std::int64_t epoch, std::size_t group, bool momentum) const {
  double pct = 0;
  const Phase& ph = phase_of(epoch, group, &pct);
  const double start = momentum ? ph.start_momentum : ph.start_lr;
  const double end = momentum ? ph.end_momentum : ph.end_lr;
  const double v = anneal(start, end, pct);
  if (epoch < total_steps_) return v;
  return std::clamp(v, std::min(start, end), std::max(start, end));
}

double OneCycleLR::get_lr(std::int64_t epoch, std::size_t group, double /*lr*/, double /*base_lr*/) {
  return annealed(epoch, group, false);
}

void OneCycleLR::after_step(std::int64_t epoch) {
  // The momentum phases are the same in every group (scalar base and max momentum).
  if (options_.cycle_momentum) optimizer().set_momentum(annealed(epoch, 0, true));
}

// ---- LambdaLR ---------------------------------------------------------------------------------------

LambdaLR::LambdaLR(Optimizer& optimizer, Lambda lr_lambda)
    : LambdaLR(optimizer, std::vector<Lambda>(optimizer.num_param_groups(), lr_lambda)) {}

LambdaLR::LambdaLR(Optimizer& optimizer, std::vector<Lambda> lr_lambdas)
    : LRScheduler(optimizer, "LambdaLR"), lr_lambdas_(std::move(lr_lambdas)) {
  const std::size_t groups = optimizer.num_param_groups();
  DP_CHECK(lr_lambdas_.size() == groups, "LambdaLR: expected one function per parameter group (", groups,
           "), got ", lr_lambdas_.size());
  for (std::size_t g = 0; g < groups; ++g)
    DP_CHECK(static_cast<bool>(lr_lambdas_[g]), "LambdaLR: expected a function of the epoch, got an empty one",
             groups > 1 ? detail::str_cat(" for param group ", g) : std::string());
  initial_step();
}

double LambdaLR::get_lr(std::int64_t epoch, std::size_t group, double /*lr*/, double base_lr) {
  return base_lr * lr_lambdas_[group](epoch);
}

}  // namespace dp::optim
