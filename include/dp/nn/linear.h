// dp/nn/linear.h — the fully connected layer y = x·Wᵀ + b.
//
// Holds weight (out, in) and bias (out) as Parameters (views into the module tree's
// flat buffer once flattened; see Note [Parameter sets]) initialised like PyTorch's
// torch.nn.Linear. forward reads the calling thread's bound copy. Knows nothing of
// optimizers or DataParallel.
//
//   auto fc = std::make_shared<dp::nn::Linear>(784, 10);
//   dp::Tensor logits = (*fc)(x);          // x: (B, 784) → (B, 10)
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// y = x·Wᵀ + b over the last dim of a 2-d input (B, in).
class Linear : public Module {
 public:
  /// weight (out, in), bias (out) unless !bias; initialised from `gen` (the default
  /// generator when null) as PyTorch does: kaiming_uniform(a = sqrt(5)), bias ±1/sqrt(in).
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true,
         Generator* gen = nullptr);

  /// x: (B, in) → (B, out).
  Tensor forward(const Tensor& x) override;
  /// "Linear(in_features=784, out_features=10, bias=true)".
  std::string name() const override;

  /// The bound copy's weight (out, in) and bias (out; undefined without bias).
  const Tensor& weight() const { return weight_.get(); }
  Tensor bias() const { return bias_.defined() ? bias_.get() : Tensor(); }
  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }

 private:
  std::int64_t in_, out_;
  Parameter weight_, bias_;
};

}  // namespace dp::nn
