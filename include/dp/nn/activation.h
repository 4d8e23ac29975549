// dp/nn/activation.h — parameter-free elementwise activation layers.
//
// Thin Module wrappers over the differentiable ops of dp/tensor/ops.h, for use inside
// Sequential. Knows nothing of parameters or DataParallel.
//
//   dp::nn::Sequential net(std::make_shared<dp::nn::Linear>(4, 8),
//                          std::make_shared<dp::nn::ReLU>());
#pragma once

#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// max(x, 0) elementwise.
class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

/// 1 / (1 + exp(−x)) elementwise.
class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

/// tanh(x) elementwise.
class Tanh : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

/// x * Phi(x) elementwise (nn::gelu): exact by default, or GELU("tanh") for the tanh
/// approximation (GPT-2's).
class GELU : public Module {
 public:
  explicit GELU(std::string approximate = "none");
  Tensor forward(const Tensor& x) override;
  /// "approximate='tanh'" when approximate, else nothing (PyTorch's repr).
  std::string extra_repr() const override;
  const std::string& approximate() const { return approximate_; }

 private:
  std::string approximate_;
};

}  // namespace dp::nn
