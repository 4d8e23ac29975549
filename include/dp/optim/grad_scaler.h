// dp/optim/grad_scaler.h — loss scaling for float16 training (PyTorch's
// torch.amp.GradScaler).
//
// float16 keeps 10 bits and no value below 2^-24: small gradients of a float16 forward
// underflow to zero. Scaling the loss by S before backward scales every gradient by S;
// unscale_ divides them back (in float32, on the master weights' gradients) before the
// optimizer sees them. When S was too large some gradient overflowed: the step is
// skipped and S halves; after growth_interval good steps in a row S doubles.
//
//   dp::amp::GradScaler scaler;
//   for (auto& [x, y] : loader) {
//     opt.zero_grad();
//     dp::Tensor loss;
//     { dp::amp::autocast guard(dp::Dtype::Float16); loss = loss_fn(model(x), y); }
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt);                                  // optional: before clipping
//     dp::nn::utils::clip_grad_norm_(model.parameters(), 1.0);
//     scaler.step(opt);                                      // skipped on inf/NaN
//     scaler.update();
//   }
//   // forward_backward: pass the scaler beside a loss descriptor (exact for every
//   // reduction, class weights and ignore_index; returns the unscaled loss):
//   model.forward_backward(x, y, dp::nn::CrossEntropyLoss{.ignore_index = 0}, scaler);
//   // or scale inside a loss function (scale() is const, thread-safe; a plain mean only,
//   // see DataParallel's LossFn):
//   model.forward_backward(x, y, [&](auto& out, auto& t) { return scaler.scale(loss_fn(out, t)); });
//
// Note [One decision everywhere]
// Whether a step is skipped must be decided the same way on every device and every
// process, or replicas drift apart, and a process that skips a collective its peers
// make waits on them forever (the bugs of early sharded scalers). unscale_ checks every
// copy an optimizer steps (DDP's replicas hold the same all-reduced gradient; a Sharded
// copy holds its own range, so an overflow on one device reaches the copy owning that
// range) and combines the copies' answers on the host, and a set sharded across
// processes combines the processes' answers with one exchange every process makes
// (nn::utils::scale_grads_find_nonfinite_). step() then skips, or steps, everywhere; and
// since a skipped step makes no collective at all, no rank can wait on another.
#pragma once

#include <cstdint>
#include <map>

#include "dp/nn/state_dict.h"
#include "dp/optim/optimizer.h"
#include "dp/tensor/tensor.h"

namespace dp::amp {

/// PyTorch's defaults.
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  bool enabled = true;
};

class GradScaler {
 public:
  /// Throws dp::Error for init_scale <= 0, growth_factor <= 1, backoff_factor outside
  /// (0, 1) or growth_interval < 1.
  explicit GradScaler(GradScalerOptions options = {});

  /// loss times the current scale (loss itself when disabled). Differentiable.
  Tensor scale(const Tensor& loss) const;
  /// Divides the gradients `opt` will step by the scale, once per step (a second call
  /// before update(), or one after step(), is a dp::Error, as in PyTorch), and records
  /// whether any was infinite or NaN (Note [One decision everywhere]).
  void unscale_(optim::Optimizer& opt);
  /// unscale_ (unless done), then opt.step() unless a gradient was infinite or NaN.
  /// Returns whether it stepped. Once per optimizer per update(): a second call before
  /// update() is a dp::Error (it would step the same gradients twice), as in PyTorch.
  bool step(optim::Optimizer& opt);
  /// Ends the step: halves the scale (backoff_factor) when any optimizer's gradients
  /// overflowed, else counts a good step and grows the scale every growth_interval of
  /// them. Forgets which optimizers were unscaled and stepped. With no step() or
  /// unscale_() since the last update() there is nothing to decide by: a dp::Error, as
  /// PyTorch's assertion.
  void update();
  /// Sets the scale (> 0) instead, as update(new_scale).
  void update(double new_scale);

  double get_scale() const { return enabled_ ? scale_ : 1.0; }
  bool is_enabled() const { return enabled_; }
  /// Steps in a row without an overflow since the scale last changed.
  std::int64_t growth_tracker() const { return growth_tracker_; }

  /// "scale", "growth_factor", "backoff_factor" (float64 values as float32 tensors
  /// hold them exactly for the powers of two they are by default), "growth_interval",
  /// "growth_tracker" (int64); empty when disabled, as PyTorch's.
  nn::StateDict state_dict() const;
  /// Restores a state_dict(); throws dp::Error naming a missing entry or a bad value,
  /// before changing anything.
  void load_state_dict(const nn::StateDict& state);

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool found_inf = false;
    bool stepped = false;  // step() ran (or skipped) since the last update()
  };
  double scale_;
  double growth_factor_, backoff_factor_;
  std::int64_t growth_interval_;
  bool enabled_;
  std::int64_t growth_tracker_ = 0;
  std::map<const optim::Optimizer*, PerOptimizer> per_opt_;
};

}  // namespace dp::amp
