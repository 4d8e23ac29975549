// dp/nn/normalization.h — layer normalisation: torch.nn.LayerNorm.
//
// Normalises each row over its trailing dims `normalized_shape` (mean and biased
// variance), then applies an elementwise weight (ones) and bias (zeros) when
// elementwise_affine. Parameter names match PyTorch's, so state dicts load either way.
//
//   auto ln = std::make_shared<dp::nn::LayerNorm>(dp::Shape{128});
//   dp::Tensor h = (*ln)(x);                                    // x (B, T, 128)
//   auto no_bias = dp::nn::LayerNorm(dp::nn::LayerNormOptions({128}).bias(false));
#pragma once

#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Options of LayerNorm in libtorch's builder style: LayerNormOptions({768}).eps(1e-6).
class LayerNormOptions {
 public:
  explicit LayerNormOptions(Shape normalized_shape) : shape_(std::move(normalized_shape)) {}
  LayerNormOptions& eps(double v) { eps_ = v; return *this; }
  LayerNormOptions& elementwise_affine(bool v) { affine_ = v; return *this; }
  /// Whether the affine part has a bias (PyTorch 2.1's `bias`; default true).
  LayerNormOptions& bias(bool v) { bias_ = v; return *this; }

  const Shape& normalized_shape() const { return shape_; }
  double eps() const { return eps_; }
  bool elementwise_affine() const { return affine_; }
  bool bias() const { return bias_; }

 private:
  Shape shape_;
  double eps_ = 1e-5;
  bool affine_ = true;
  bool bias_ = true;
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(const LayerNormOptions& options);
  explicit LayerNorm(Shape normalized_shape, double eps = 1e-5) : LayerNorm(LayerNormOptions(std::move(normalized_shape)).eps(eps)) {}

  /// x (..., normalized_shape...) -> the same shape.
  Tensor forward(const Tensor& x) override;
  /// "[128], eps=1e-05, elementwise_affine=true".
  std::string extra_repr() const override;

  /// The bound copy's weight and bias (undefined without them).
  Tensor weight() const { return weight_.defined() ? weight_.get() : Tensor(); }
  Tensor bias() const { return bias_.defined() ? bias_.get() : Tensor(); }
  const LayerNormOptions& options() const { return options_; }

 private:
  LayerNormOptions options_;
  Parameter weight_, bias_;
};

}  // namespace dp::nn
