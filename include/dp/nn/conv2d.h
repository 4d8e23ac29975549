// dp/nn/conv2d.h — the 2-d convolution layer over NCHW inputs.
//
// Holds weight (K, C, R, S) and bias (K) as Parameters (see Note [Parameter sets])
// initialised like PyTorch's torch.nn.Conv2d; forward calls dp::nn::conv2d on the
// calling thread's bound copy. Square kernels, one stride and padding for both dims,
// groups = 1, dilation = 1. Knows nothing of optimizers or DataParallel.
//
//   auto conv = std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(1, 32, 3).padding(1));
//   dp::Tensor y = (*conv)(x);             // (N, 1, 28, 28) → (N, 32, 28, 28)
//   auto down = std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(32, 64, 3).stride(2).bias(false));
#pragma once

#include <cstdint>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Options of Conv2d in libtorch's builder style: the required arguments in the
/// constructor, the rest by chained setters (each returns *this); a getter of the same
/// name without argument reads it. Only what the layer supports is offered: one square
/// kernel, one stride and one zero padding for both dims, dilation 1, groups 1.
///
///   dp::nn::Conv2dOptions(1, 32, 3).stride(1).padding(1).bias(false)
class Conv2dOptions {
 public:
  Conv2dOptions(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}

  Conv2dOptions& stride(std::int64_t v) { stride_ = v; return *this; }
  Conv2dOptions& padding(std::int64_t v) { padding_ = v; return *this; }
  Conv2dOptions& bias(bool v) { bias_ = v; return *this; }

  std::int64_t in_channels() const { return in_channels_; }
  std::int64_t out_channels() const { return out_channels_; }
  std::int64_t kernel_size() const { return kernel_size_; }
  /// Default 1.
  std::int64_t stride() const { return stride_; }
  /// Zero padding on every side; default 0.
  std::int64_t padding() const { return padding_; }
  /// The options this layer was built with.
  Conv2dOptions options() const;
  /// Default true.
  bool bias() const { return bias_; }

 private:
  std::int64_t in_channels_, out_channels_, kernel_size_;
  std::int64_t stride_ = 1, padding_ = 0;
  bool bias_ = true;
};

/// y = conv(x, W) + b with a kernel×kernel window.
class Conv2d : public Module {
 public:
  /// The recommended form: Conv2d(Conv2dOptions(in, out, kernel).padding(1)). weight
  /// (out, in, kernel, kernel), bias (out) unless !bias(); initialised from `gen` (the
  /// default generator when null) as PyTorch does.
  explicit Conv2d(const Conv2dOptions& options, Generator* gen = nullptr);
  /// Positional form, in the order of PyTorch's Python torch.nn.Conv2d: the 4th
  /// argument is the STRIDE and the 5th the padding (Conv2d(1, 32, 3, 1, 1) is
  /// stride 1, padding 1). Prefer Conv2dOptions, which names them.
  Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size,
         std::int64_t stride = 1, std::int64_t padding = 0, bool bias = true,
         Generator* gen = nullptr);

  /// x: (N, in, H, W) → (N, out, P, Q), P = (H + 2·padding − kernel) / stride + 1.
  Tensor forward(const Tensor& x) override;
  /// relu(forward(x)) as one op (nn::conv2d_relu): what Sequential runs for a Conv2d
  /// followed by a ReLU.
  Tensor forward_relu(const Tensor& x);
  /// "1, 32, kernel_size=3, stride=1, padding=1, bias=true": name() is
  /// "Conv2d(1, 32, kernel_size=3, stride=1, padding=1, bias=true)".
  std::string extra_repr() const override;

  const Tensor& weight() const { return weight_.get(); }
  Tensor bias() const { return bias_.defined() ? bias_.get() : Tensor(); }
  std::int64_t in_channels() const { return in_; }
  std::int64_t out_channels() const { return out_; }
  std::int64_t kernel_size() const { return kernel_; }
  std::int64_t stride() const { return stride_; }
  std::int64_t padding() const { return padding_; }
  /// The options this layer was built with.
  Conv2dOptions options() const;

 private:
  std::int64_t in_, out_, kernel_, stride_, padding_;
  Parameter weight_, bias_;
};

}  // namespace dp::nn
