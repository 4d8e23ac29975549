// dp/optim/lr_scheduler.h — learning-rate schedules with torch.optim.lr_scheduler's
// formulas: StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR, OneCycleLR
// and LambdaLR.
//
// Note [Scheduler steps]
// A scheduler writes the optimizer's learning rate (Optimizer::set_lr) and nothing else,
// except OneCycleLR, which also cycles the momentum (Optimizer::set_momentum: SGD's
// momentum, Adam's beta1). As in PyTorch:
// - constructing a scheduler is its first step: last_epoch() becomes 0 and the
//   optimizer gets the schedule's first lr (LinearLR's start_factor·lr, OneCycleLR's
//   max_lr / div_factor, the unchanged lr for the others);
// - each step() advances last_epoch() by one and sets the lr for it; call it once per
//   epoch or once per batch, after opt.step() — the schedule counts calls, not epochs;
// - the first scheduler built on an optimizer records its lr as the optimizer's
//   initial_lr(); every scheduler takes that as its base lr (base_lrs()), so two
//   schedulers stepped together chain like PyTorch's ChainedScheduler;
// - the chainable forms multiply the optimizer's CURRENT lr (StepLR, MultiStepLR,
//   ExponentialLR, CosineAnnealingLR, LinearLR), with PyTorch's double arithmetic in
//   PyTorch's order, so the lr sequence is the one PyTorch prints, bit for bit;
//   LambdaLR and OneCycleLR are closed forms of last_epoch().
// - every parameter group (Note [Parameter groups] in dp/optim/optimizer.h) is
//   scheduled from its own lr and its own initial_lr: get_last_lr() and base_lrs()
//   hold one value per group. OneCycleLR's max_lr and LambdaLR's function apply to
//   every group (PyTorch's scalar forms) or, given as lists (OneCycleLROptions::max_lrs,
//   LambdaLR's vector of functions), one per group in the optimizer's group order
//   (PyTorch's list forms); OneCycleLR cycles every group's momentum.
// A step that cannot be taken (OneCycleLR past total_steps) throws dp::Error and
// changes nothing, neither the scheduler nor the optimizer.
//
//   dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
//   dp::optim::CosineAnnealingLR sched(opt, {.T_max = 90});
//   for (int epoch = 0; epoch < 90; ++epoch) { train_one_epoch(opt); sched.step(); }
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dp/optim/optimizer.h"

namespace dp::optim {

/// What a scheduler must save for a resumed run to continue its lr sequence exactly
/// (PyTorch's scheduler.state_dict() without the hyper-parameters, which the resumed
/// run passes to the constructor again). Training checkpoints store it; see
/// dp/io/checkpoint.h.
struct LRSchedulerState {
  std::string kind;               ///< "StepLR", "OneCycleLR", … (checked on load)
  std::int64_t last_epoch = 0;    ///< steps taken, the first (construction) counting 0
  std::vector<double> base_lrs;   ///< one per parameter group
  std::vector<double> last_lrs;   ///< get_last_lr()
};

/// Base class (PyTorch's _LRScheduler). See Note [Scheduler steps]. It refers to its
/// optimizer, which must outlive it.
class LRScheduler {
 public:
  virtual ~LRScheduler();
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  /// Advances last_epoch() by one and sets the optimizer's lr (and OneCycleLR's
  /// momentum) for it. Throws dp::Error, changing nothing, when the schedule has no
  /// value there or gives a negative or non-finite lr.
  void step();
  /// The lr per parameter group that the last step (or the constructor) set.
  const std::vector<double>& get_last_lr() const { return last_lrs_; }
  /// Steps taken since construction; 0 right after it.
  std::int64_t last_epoch() const { return last_epoch_; }
  /// The lr per parameter group the schedule starts from (PyTorch's base_lrs).
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  /// "StepLR", "CosineAnnealingLR", …
  const std::string& kind() const { return kind_; }
  Optimizer& optimizer() const { return optimizer_; }

  LRSchedulerState state_dict() const;
  /// Restores a state_dict() of a scheduler of the same kind. The optimizer's lr is not
  /// touched: restore the optimizer too (a training checkpoint does both). Throws
  /// dp::Error naming the mismatch for another kind, another number of parameter
  /// groups or a negative last_epoch.
  void load_state_dict(const LRSchedulerState& state);

 protected:
  /// `kind` names the scheduler in errors and in its state.
  LRScheduler(Optimizer& optimizer, std::string kind);
  /// Sets base_lrs() from the optimizer's initial_lr() (recording it first when unset)
  /// and takes the step to epoch 0. Called last by each derived constructor, once its
  /// options are checked (a virtual call from the base constructor would not dispatch).
  void initial_step();
  /// The lr of parameter group `group` at `epoch`: `lr` is the group's current lr,
  /// `base_lr` its base lr. Throws dp::Error when `epoch` is outside the schedule.
  virtual double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) = 0;
  /// Runs after the new lrs are set, for what else a step changes (momentum).
  virtual void after_step(std::int64_t /*epoch*/) {}

 private:
  Optimizer& optimizer_;
  std::string kind_;
  std::int64_t last_epoch_ = -1;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
};

// ---- schedules ---------------------------------------------------------------------------

/// StepLR: lr × gamma every step_size steps.
struct StepLROptions {
  std::int64_t step_size = 1;  ///< >= 1
  double gamma = 0.1;          ///< >= 0
};
class StepLR : public LRScheduler {
 public:
  /// Throws dp::Error for step_size < 1 or gamma < 0.
  StepLR(Optimizer& optimizer, StepLROptions options);
  const StepLROptions& options() const { return options_; }

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;

 private:
  StepLROptions options_;
};

/// MultiStepLR: lr × gamma at each milestone.
struct MultiStepLROptions {
  std::vector<std::int64_t> milestones;  ///< strictly increasing, >= 0
  double gamma = 0.1;                    ///< >= 0
};
class MultiStepLR : public LRScheduler {
 public:
  /// Throws dp::Error for milestones that are negative or not strictly increasing
  /// (naming the first offending pair) and for gamma < 0.
  MultiStepLR(Optimizer& optimizer, MultiStepLROptions options);
  const MultiStepLROptions& options() const { return options_; }

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;

 private:
  MultiStepLROptions options_;
};

/// ExponentialLR: lr × gamma every step.
struct ExponentialLROptions {
  double gamma = 0.1;  ///< >= 0 (PyTorch has no default; pass it)
};
class ExponentialLR : public LRScheduler {
 public:
  /// Throws dp::Error for gamma < 0.
  ExponentialLR(Optimizer& optimizer, ExponentialLROptions options);
  const ExponentialLROptions& options() const { return options_; }

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;

 private:
  ExponentialLROptions options_;
};

/// CosineAnnealingLR: η = eta_min + (base_lr − eta_min)(1 + cos(π·t / T_max)) / 2, in
/// PyTorch's recursive (chainable) form, which keeps following the cosine past T_max
/// (back up to base_lr at 2·T_max) — SGDR's annealing without restarts.
struct CosineAnnealingLROptions {
  std::int64_t T_max = 1;  ///< >= 1: steps of half a cosine period
  double eta_min = 0.0;    ///< >= 0
};
class CosineAnnealingLR : public LRScheduler {
 public:
  /// Throws dp::Error for T_max < 1 or eta_min < 0.
  CosineAnnealingLR(Optimizer& optimizer, CosineAnnealingLROptions options);
  const CosineAnnealingLROptions& options() const { return options_; }

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;

 private:
  CosineAnnealingLROptions options_;
};

/// LinearLR (warm-up): the factor on the lr goes linearly from start_factor at step 0
/// to end_factor at step total_iters, then stays.
struct LinearLROptions {
  double start_factor = 1.0 / 3;  ///< in (0, 1]
  double end_factor = 1.0;        ///< in [0, 1]
  std::int64_t total_iters = 5;   ///< >= 1
};
class LinearLR : public LRScheduler {
 public:
  /// Throws dp::Error for start_factor outside (0, 1] (0 would divide by zero at step
  /// 1, as in PyTorch), end_factor outside [0, 1] or total_iters < 1.
  LinearLR(Optimizer& optimizer, LinearLROptions options = {});
  const LinearLROptions& options() const { return options_; }

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;

 private:
  LinearLROptions options_;
};

/// OneCycleLR (Smith's 1cycle policy), stepped once per batch: the lr rises from
/// max_lr / div_factor to max_lr over the first pct_start of total_steps, then anneals
/// to max_lr / (div_factor · final_div_factor); three_phase comes back down to the
/// initial lr symmetrically before the final anneal. With cycle_momentum the
/// optimizer's momentum (SGD's momentum, Adam's beta1) moves inversely between
/// max_momentum and base_momentum. As in PyTorch, steps 0 … total_steps have a value
/// (the last one past the schedule's end; see Note [OneCycleLR's last step] in
/// lr_scheduler.cpp) and one more step() throws.
enum class AnnealStrategy : std::uint8_t { Cos, Linear };
struct OneCycleLROptions {
  double max_lr = 0.0;               ///< > 0, required unless max_lrs is given
  /// PyTorch's list form of max_lr: one value > 0 per parameter group, in the
  /// optimizer's group order. Empty: max_lr for every group. Given: max_lr must be 0.
  std::vector<double> max_lrs = {};
  std::int64_t total_steps = 0;      ///< > 0; or 0 and epochs · steps_per_epoch
  std::int64_t epochs = 0;
  std::int64_t steps_per_epoch = 0;
  double pct_start = 0.3;            ///< in [0, 1]
  AnnealStrategy anneal_strategy = AnnealStrategy::Cos;
  bool cycle_momentum = true;
  double base_momentum = 0.85;
  double max_momentum = 0.95;
  double div_factor = 25.0;          ///< > 0
  double final_div_factor = 1e4;     ///< > 0
  bool three_phase = false;
};
class OneCycleLR : public LRScheduler {
 public:
  /// Throws dp::Error for max_lr <= 0 (or max_lrs of another length than the
  /// optimizer's groups, a value <= 0 in it, or both forms given), total_steps <= 0 (or, without it, epochs or
  /// steps_per_epoch <= 0), pct_start outside [0, 1], div factors <= 0, negative
  /// momenta or ones the optimizer refuses (Adam: beta1 >= 1), cycle_momentum on an
  /// optimizer without momentum, and when step 0 falls in a phase of zero length
  /// (pct_start · total_steps == 1; PyTorch divides by zero there, and so would a
  /// later step() in such a phase: dp::Error then too).
  OneCycleLR(Optimizer& optimizer, OneCycleLROptions options);
  const OneCycleLROptions& options() const { return options_; }
  /// The schedule's length (total_steps, or epochs · steps_per_epoch).
  std::int64_t total_steps() const { return total_steps_; }

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;
  void after_step(std::int64_t epoch) override;

 private:
  struct Phase {
    double end_step;
    double start_lr, end_lr, start_momentum, end_momentum;
  };
  /// One group's phases for its max_lr over `total` steps.
  static std::vector<Phase> phases_for(const OneCycleLROptions& o, double max_lr, double total);
  /// pct of group `group`'s phase holding `epoch`, and the phase.
  const Phase& phase_of(std::int64_t epoch, std::size_t group, double* pct) const;
  double anneal(double start, double end, double pct) const;
  /// Group `group`'s lr (momentum = false), or the momentum, at `epoch`; see Note
  /// [OneCycleLR's last step].
  double annealed(std::int64_t epoch, std::size_t group, bool momentum) const;

  OneCycleLROptions options_;
  std::int64_t total_steps_ = 0;
  std::vector<std::vector<Phase>> phases_;  ///< per parameter group
};

/// LambdaLR: lr = base_lr × lr_lambda(epoch), one function for every group or one per
/// group (PyTorch's list form, in the optimizer's group order). Functions are not
/// saved in state dicts: pass the same ones when resuming.
class LambdaLR : public LRScheduler {
 public:
  using Lambda = std::function<double(std::int64_t epoch)>;
  /// Throws dp::Error for an empty function.
  LambdaLR(Optimizer& optimizer, Lambda lr_lambda);
  /// Throws dp::Error for another number of functions than the optimizer's groups, or
  /// an empty one.
  LambdaLR(Optimizer& optimizer, std::vector<Lambda> lr_lambdas);

 protected:
  double get_lr(std::int64_t epoch, std::size_t group, double lr, double base_lr) override;

 private:
  std::vector<Lambda> lr_lambdas_;  ///< one per group
};

}  // namespace dp::optim
