#include "dp/nn/conv2d.h"

#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/nn/init.h"

namespace dp::nn {

Conv2d::Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size,
               std::int64_t stride, std::int64_t padding, bool bias, Generator* gen)
    : in_(in_channels), out_(out_channels), kernel_(kernel_size), stride_(stride), padding_(padding) {
  DP_CHECK(in_ > 0 && out_ > 0, "Conv2d: expected positive in and out channels, got in=", in_,
           ", out=", out_);
  DP_CHECK(kernel_ > 0, "Conv2d: expected kernel_size > 0, got ", kernel_);
  DP_CHECK(stride_ > 0, "Conv2d: expected stride > 0, got ", stride_);
  DP_CHECK(padding_ >= 0, "Conv2d: expected padding >= 0, got ", padding_);
  Tensor w = empty({out_, in_, kernel_, kernel_});
  Tensor b = bias ? empty({out_}) : Tensor();
  init::default_linear_init_(w, b, gen ? *gen : default_generator());
  weight_ = register_parameter("weight", w);
  if (bias) bias_ = register_parameter("bias", b);
}

Conv2d::Conv2d(const Conv2dOptions& o, Generator* gen)
    : Conv2d(o.in_channels(), o.out_channels(), o.kernel_size(), o.stride(), o.padding(), o.bias(), gen) {}

Conv2dOptions Conv2d::options() const {
  return Conv2dOptions(in_, out_, kernel_).stride(stride_).padding(padding_).bias(bias_.defined());
}

Tensor Conv2d::forward(const Tensor& x) {
  return conv2d(x, weight_.get(), bias(), stride_, padding_);
}

Tensor Conv2d::forward_relu(const Tensor& x) {
  return conv2d_relu(x, weight_.get(), bias(), stride_, padding_);
}

std::string Conv2d::extra_repr() const {
  return detail::str_cat(in_, ", ", out_, ", kernel_size=", kernel_, ", stride=", stride_,
                         ", padding=", padding_, ", bias=", bias_.defined() ? "true" : "false");
}

}  // namespace dp::nn
