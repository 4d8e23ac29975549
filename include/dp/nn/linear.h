// dp/nn/linear.h — the fully connected layer y = x·Wᵀ + b.
//
// Holds weight (out, in) and bias (out) as Parameters (views into the module tree's
// flat buffer once flattened; see Note [Parameter sets]) initialised like PyTorch's
// torch.nn.Linear. forward reads the calling thread's bound copy. Knows nothing of
// optimizers or DataParallel.
//
//   auto fc = std::make_shared<dp::nn::Linear>(784, 10);
//   dp::Tensor logits = (*fc)(x);          // x: (B, 784) → (B, 10)
//   auto proj = std::make_shared<dp::nn::Linear>(dp::nn::LinearOptions(784, 10).bias(false));
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Options of Linear in libtorch's builder style: LinearOptions(784, 10).bias(false).
class LinearOptions {
 public:
  LinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}

  LinearOptions& bias(bool v) { bias_ = v; return *this; }

  std::int64_t in_features() const { return in_features_; }
  std::int64_t out_features() const { return out_features_; }
  /// Default true.
  bool bias() const { return bias_; }

 private:
  std::int64_t in_features_, out_features_;
  bool bias_ = true;
};

/// y = x·Wᵀ + b over the last dim of the input: (B, in), or (..., in) as torch.nn.Linear.
class Linear : public Module {
 public:
  /// weight (out, in), bias (out) unless !bias; initialised from `gen` (the default
  /// generator when null) as PyTorch does: kaiming_uniform(a = sqrt(5)), bias ±1/sqrt(in).
  /// The same from options: Linear(LinearOptions(784, 10).bias(false)).
  explicit Linear(const LinearOptions& options, Generator* gen = nullptr);
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true,
         Generator* gen = nullptr);

  /// x: (B, in) → (B, out); (..., in) → (..., out).
  Tensor forward(const Tensor& x) override;
  /// relu(forward(x)) as one op (linear_relu): what Sequential runs for a Linear
  /// followed by a ReLU.
  Tensor forward_relu(const Tensor& x);
  /// "in_features=784, out_features=10, bias=true": name() is
  /// "Linear(in_features=784, out_features=10, bias=true)".
  std::string extra_repr() const override;

  /// The bound copy's weight (out, in) and bias (out; undefined without bias).
  const Tensor& weight() const { return weight_.get(); }
  Tensor bias() const { return bias_.defined() ? bias_.get() : Tensor(); }
  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }
  /// The options this layer was built with.
  LinearOptions options() const { return LinearOptions(in_, out_).bias(bias_.defined()); }

 private:
  void check_input(const Tensor& x) const;

  std::int64_t in_, out_;
  Parameter weight_, bias_;
};

}  // namespace dp::nn
