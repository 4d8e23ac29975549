// dp/nn/pooling.h — pooling layers over NCHW inputs: max, average, global average.
//
// Parameter-free wrappers over dp::nn::max_pool2d / avg_pool2d /
// adaptive_avg_pool2d_1x1. Knows nothing of parameters or DataParallel.
//
//   auto pool = std::make_shared<dp::nn::MaxPool2d>(2);        // stride 2, (N,C,28,28) → (N,C,14,14)
//   auto gap = std::make_shared<dp::nn::AdaptiveAvgPool2d>(1);  // (N,C,H,W) → (N,C,1,1)
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
  std::string name() const override;

 private:
  std::int64_t kernel_, stride_, padding_;
};

/// Average over kernel×kernel windows counting padding; stride ≤ 0 means stride = kernel.
class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(std::int64_t kernel_size, std::int64_t stride = 0, std::int64_t padding = 0);
  Tensor forward(const Tensor& x) override;
  std::string name() const override;

 private:
  std::int64_t kernel_, stride_, padding_;
};

/// Adaptive average pooling. Only output size 1 (global average pooling, (N, C, 1, 1))
/// is supported; other sizes throw dp::Error at construction.
class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(std::int64_t output_size = 1);
  AdaptiveAvgPool2d(std::int64_t output_h, std::int64_t output_w);
  Tensor forward(const Tensor& x) override;
  std::string name() const override { return "AdaptiveAvgPool2d(output_size=1)"; }
};

}  // namespace dp::nn
