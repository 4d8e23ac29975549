// dp/nn/pooling.h — pooling layers over NCHW inputs: max, average, global average.
//
// Parameter-free wrappers over dp::nn::max_pool2d / avg_pool2d /
// adaptive_avg_pool2d. Knows nothing of parameters or DataParallel.
//
//   auto pool = std::make_shared<dp::nn::MaxPool2d>(2);        // stride 2, (N,C,28,28) → (N,C,14,14)
//   auto gap = std::make_shared<dp::nn::AdaptiveAvgPool2d>(1);  // (N,C,H,W) → (N,C,1,1)
//   auto head = std::make_shared<dp::nn::AdaptiveAvgPool2d>(3, 2);  // (N,C,7,5) → (N,C,3,2)
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Max over kernel×kernel windows; stride ≤ 0 means stride = kernel (PyTorch's default).
class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(std::int64_t kernel_size, std::int64_t stride = 0, std::int64_t padding = 0);
  Tensor forward(const Tensor& x) override;
  /// "kernel_size=2, stride=2, padding=0".
  std::string extra_repr() const override;
  std::int64_t kernel_size() const { return kernel_; }
  /// As given: ≤ 0 means stride = kernel_size.
  std::int64_t stride() const { return stride_; }
  std::int64_t padding() const { return padding_; }

 private:
  std::int64_t kernel_, stride_, padding_;
};

/// Average over kernel×kernel windows counting padding; stride ≤ 0 means stride = kernel.
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(std::int64_t kernel_size, std::int64_t stride = 0, std::int64_t padding = 0);
  Tensor forward(const Tensor& x) override;
  /// "kernel_size=2, stride=2, padding=0".
  std::string extra_repr() const override;

 private:
  std::int64_t kernel_, stride_, padding_;
};

/// Adaptive average pooling to any output size with PyTorch's bins (see
/// dp::nn::adaptive_avg_pool2d): (N, C, H, W) → (N, C, P, Q) whatever H and W are.
class AdaptiveAvgPool2d : public Module {
 public:
  /// A square output size × size; 1 is global average pooling. Sizes must be >= 1.
  explicit AdaptiveAvgPool2d(std::int64_t output_size = 1);
  AdaptiveAvgPool2d(std::int64_t output_h, std::int64_t output_w);
  Tensor forward(const Tensor& x) override;
  /// "output_size=1", or "output_size=(3, 2)".
  std::string extra_repr() const override;
  std::int64_t output_h() const { return out_h_; }
  std::int64_t output_w() const { return out_w_; }

 private:
  std::int64_t out_h_, out_w_;
};

}  // namespace dp::nn
