// dp/nn/conv2d.h — the 2-d convolution layer over NCHW inputs.
//
// Holds weight (K, C, R, S) and bias (K) as Parameters (see Note [Parameter sets])
// initialised like PyTorch's torch.nn.Conv2d; forward calls dp::nn::conv2d on the
// calling thread's bound copy. Square kernels, one stride and padding for both dims,
// groups = 1, dilation = 1. Knows nothing of optimizers or DataParallel.
//
//   auto conv = std::make_shared<dp::nn::Conv2d>(1, 32, 3, /*stride=*/1, /*padding=*/1);
//   dp::Tensor y = (*conv)(x);             // (N, 1, 28, 28) → (N, 32, 28, 28)
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// y = conv(x, W) + b with a kernel×kernel window.
class Conv2d : public Module {
 public:
  /// weight (out, in, kernel, kernel), bias (out) unless !bias; initialised from `gen`
  /// (the default generator when null) as PyTorch does.
  Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size,
         std::int64_t stride = 1, std::int64_t padding = 0, bool bias = true,
         Generator* gen = nullptr);

  /// x: (N, in, H, W) → (N, out, P, Q), P = (H + 2·padding − kernel) / stride + 1.
  Tensor forward(const Tensor& x) override;
  /// "Conv2d(1, 32, kernel_size=3, stride=1, padding=1, bias=true)".
  std::string name() const override;

  const Tensor& weight() const { return weight_.get(); }
  Tensor bias() const { return bias_.defined() ? bias_.get() : Tensor(); }
  std::int64_t in_channels() const { return in_; }
  std::int64_t out_channels() const { return out_; }
  std::int64_t kernel_size() const { return kernel_; }
  std::int64_t stride() const { return stride_; }
  std::int64_t padding() const { return padding_; }

 private:
  std::int64_t in_, out_, kernel_, stride_, padding_;
  Parameter weight_, bias_;
};

}  // namespace dp::nn
