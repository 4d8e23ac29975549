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
//   auto slow = std::make_shared<dp::nn::BatchNorm2d>(dp::nn::BatchNorm2dOptions(32).momentum(0.01));
//   dp::Tensor y = (*bn)(x);               // x: (N, 32, H, W)
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Options of BatchNorm2d in libtorch's builder style:
/// BatchNorm2dOptions(32).eps(1e-3).momentum(0.01). The layer always has affine
/// parameters and tracks running statistics (PyTorch's defaults), so those two
/// switches are not offered.
class BatchNorm2dOptions {
 public:
  /// `num_features`: C, the channels of the (N, C, H, W) input.
  explicit BatchNorm2dOptions(std::int64_t num_features) : num_features_(num_features) {}

  BatchNorm2dOptions& eps(double v) { eps_ = v; return *this; }
  BatchNorm2dOptions& momentum(double v) { momentum_ = v; return *this; }

  std::int64_t num_features() const { return num_features_; }
  /// Added to the variance; default 1e-5.
  double eps() const { return eps_; }
  /// Weight of the batch statistic in the running update; default 0.1.
  double momentum() const { return momentum_; }

 private:
  std::int64_t num_features_;
  double eps_ = 1e-5, momentum_ = 0.1;
};

/// BatchNorm2d(C): per-channel normalisation, then gamma · x̂ + beta.
class BatchNorm2d : public Module {
 public:
  /// momentum: weight of the batch statistic in the running update,
  /// running = (1 − momentum) · running + momentum · batch (unbiased variance).
  explicit BatchNorm2d(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1);
  /// The same from options: BatchNorm2d(BatchNorm2dOptions(32).momentum(0.01)).
  explicit BatchNorm2d(const BatchNorm2dOptions& options);

  /// x: (N, C, H, W) → same shape. Training needs more than one value per channel.
  Tensor forward(const Tensor& x) override;
  /// "32, eps=1e-05, momentum=0.1": name() is "BatchNorm2d(32, eps=1e-05, momentum=0.1)".
  std::string extra_repr() const override;

  const Tensor& weight() const { return weight_.get(); }
  const Tensor& bias() const { return bias_.get(); }
  const Tensor& running_mean() const { return running_mean_.get(); }
  const Tensor& running_var() const { return running_var_.get(); }
  const Tensor& num_batches_tracked() const { return num_batches_tracked_.get(); }
  std::int64_t num_features() const { return C_; }
  double eps() const { return eps_; }
  double momentum() const { return momentum_; }
  BatchNorm2dOptions options() const { return BatchNorm2dOptions(C_).eps(eps_).momentum(momentum_); }

 private:
  std::int64_t C_;
  double eps_, momentum_;
  Parameter weight_, bias_, running_mean_, running_var_, num_batches_tracked_;
};

}  // namespace dp::nn
