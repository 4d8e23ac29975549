// dp/nn/loss.h — PyTorch's loss modules as values (CrossEntropyLoss, NLLLoss, MSELoss,
// L1Loss, SmoothL1Loss, BCEWithLogitsLoss) and ShardableLoss, which knows how a loss's
// reduction splits over row shards of a batch.
//
// Each descriptor holds PyTorch's options and computes the loss of a whole batch with
// dp::nn's functional ops. ShardableLoss is what DataParallel::forward_backward needs to
// give the whole batch's loss and gradients exactly for every reduction (Note [Exact
// shard losses]); this header knows nothing of DataParallel itself.
//
//   dp::nn::CrossEntropyLoss ce{.weight = w, .ignore_index = 0, .label_smoothing = 0.1};
//   dp::Tensor loss = ce(net->forward(x), y);                 // one device
//   dp::Tensor same = model.forward_backward(x, y, ce);        // DataParallel: the same number
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "dp/nn/functional.h"
#include "dp/tensor/tensor.h"

namespace dp::nn {

/// torch.nn.CrossEntropyLoss: logits (B, C), int64 class indices (B).
struct CrossEntropyLoss {
  /// (C) float32: a weight per class; undefined = all 1. Any device: moved as needed.
  Tensor weight{};
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double label_smoothing = 0.0;
  Tensor operator()(const Tensor& logits, const Tensor& target) const;
};

/// torch.nn.NLLLoss: log-probabilities (B, C), int64 class indices (B).
struct NLLLoss {
  Tensor weight{};
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  Tensor operator()(const Tensor& logp, const Tensor& target) const;
};

/// torch.nn.MSELoss: (a − b)², input and target of one shape; Mean over every element.
struct MSELoss {
  Reduction reduction = Reduction::Mean;
  Tensor operator()(const Tensor& input, const Tensor& target) const;
};

/// torch.nn.L1Loss: |a − b|; Mean over every element.
struct L1Loss {
  Reduction reduction = Reduction::Mean;
  Tensor operator()(const Tensor& input, const Tensor& target) const;
};

/// torch.nn.SmoothL1Loss with PyTorch's beta; Mean over every element.
struct SmoothL1Loss {
  Reduction reduction = Reduction::Mean;
  double beta = 1.0;
  Tensor operator()(const Tensor& input, const Tensor& target) const;
};

/// torch.nn.BCEWithLogitsLoss; Mean over every element (weighted elements count once).
struct BCEWithLogitsLoss {
  /// Per element, broadcast to the input's shape; undefined = 1. Under DataParallel it
  /// must not span the batch (its dim 0 of size 1, or fewer dims than the input).
  Tensor weight{};
  /// Per class, along the input's last dim; undefined = 1.
  Tensor pos_weight{};
  Reduction reduction = Reduction::Mean;
  Tensor operator()(const Tensor& input, const Tensor& target) const;
};

// Note [Exact shard losses]
// A batch split into row shards gives the whole batch's loss and gradients when each
// shard computes the SUM of its rows' losses times 1 / D, where D is the whole batch's
// denominator, and the shard losses are added: Sum has D = 1; Mean of an elementwise
// loss has D = the target's element count; Mean of a class-index loss has D = Σ_r w_r
// over the WHOLE batch (the class weights of the targets not ignored; their count
// without weights; Note [Class-index losses]). D comes from the full target, known
// before the scatter, so no shard needs another's numbers and no collective is
// needed (a class-weighted or ignoring Mean reads D back to the host: one small
// reduction over the target, a synchronisation when the target is on a GPU). Each shard's gradient is then exactly its part of the full gradient; the
// sums differ from one device's only by float rounding (sums in another order). When
// every target is ignored D = 0 and the loss is NaN, as in PyTorch. Reduction::None has
// no scalar to differentiate: refused.

/// A loss whose reduction over a whole batch is known, so that row shards of the
/// batch compute it exactly (Note [Exact shard losses]). Made implicitly from any
/// descriptor above.
class ShardableLoss {
 public:
  ShardableLoss(const CrossEntropyLoss& loss);   // NOLINT: implicit by design
  ShardableLoss(const NLLLoss& loss);            // NOLINT
  ShardableLoss(const MSELoss& loss);            // NOLINT
  ShardableLoss(const L1Loss& loss);             // NOLINT
  ShardableLoss(const SmoothL1Loss& loss);       // NOLINT
  ShardableLoss(const BCEWithLogitsLoss& loss);  // NOLINT

  /// E.g. "CrossEntropyLoss".
  const std::string& name() const { return name_; }
  Reduction reduction() const { return reduction_; }
  /// D of Note [Exact shard losses] from the whole batch's target (1 for Sum). Throws
  /// dp::Error for Reduction::None and for options that cannot be split by rows.
  double denominator(const Tensor& target) const;
  /// One shard's share: the sum of its rows' losses times `scale` (= 1 / D), with the
  /// options' tensors moved to the output's device.
  Tensor shard_loss(const Tensor& output, const Tensor& target, double scale) const;
  /// The whole batch's loss, as the descriptor computes it.
  Tensor operator()(const Tensor& output, const Tensor& target) const { return whole_(output, target); }

 private:
  std::string name_;
  Reduction reduction_;
  std::function<double(const Tensor& target)> mean_denominator_;
  std::function<Tensor(const Tensor& output, const Tensor& target, double scale)> scaled_sum_;
  std::function<Tensor(const Tensor& output, const Tensor& target)> whole_;
  std::function<void(const Tensor& target)> split_check_;  // options that rows cannot split
};

}  // namespace dp::nn
