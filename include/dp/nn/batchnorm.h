// dp/nn/batchnorm.h — batch normalisation over the channels of NCHW inputs.
//
// Parameters weight (gamma, ones) and bias (beta, zeros); buffers running_mean (zeros),
// running_var (ones) and num_batches_tracked (int64 scalar) — PyTorch's names, so
// state_dicts match. In training mode forward normalises with the batch statistics
// and updates the running statistics of the copy bound on the calling thread (each
// DataParallel replica its own; DDP broadcasts device 0's before each forward); in
// eval mode it normalises with the running statistics. Knows nothing of DataParallel.
//
//   auto bn = std::make_shared<dp::nn::BatchNorm2d>(32);
//   dp::Tensor y = (*bn)(x);               // x: (N, 32, H, W)
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// BatchNorm2d(C): per-channel normalisation, then gamma · x̂ + beta.
class BatchNorm2d : public Module {
 public:
  /// momentum: weight of the batch statistic in the running update,
  /// running = (1 − momentum) · running + momentum · batch (unbiased variance).
  explicit BatchNorm2d(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1);

  /// x: (N, C, H, W) → same shape. Training needs more than one value per channel.
  Tensor forward(const Tensor& x) override;
  /// "BatchNorm2d(32, eps=1e-05, momentum=0.1)".
  std::string name() const override;

  const Tensor& weight() const { return weight_.get(); }
  const Tensor& bias() const { return bias_.get(); }
  const Tensor& running_mean() const { return running_mean_.get(); }
  const Tensor& running_var() const { return running_var_.get(); }
  const Tensor& num_batches_tracked() const { return num_batches_tracked_.get(); }
  std::int64_t num_features() const { return C_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }

 private:
  std::int64_t C_;
  double eps_, momentum_;
  Parameter weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
};

}  // namespace dp::nn
