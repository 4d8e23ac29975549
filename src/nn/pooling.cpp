#include "dp/nn/pooling.h"

#include "dp/core/error.h"
#include "dp/nn/functional.h"

namespace dp::nn {

MaxPool2d::MaxPool2d(std::int64_t kernel_size, std::int64_t stride, std::int64_t padding)
    : kernel_(kernel_size), stride_(stride <= 0 ? kernel_size : stride), padding_(padding) {
  DP_CHECK(kernel_ > 0, "MaxPool2d: expected kernel_size > 0, got ", kernel_);
  DP_CHECK(padding_ >= 0 && 2 * padding_ <= kernel_,
           "MaxPool2d: expected padding between 0 and half the kernel, got ", padding_);
}

Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, kernel_, stride_, padding_); }

std::string MaxPool2d::extra_repr() const {
  return detail::str_cat("kernel_size=", kernel_, ", stride=", stride_, ", padding=", padding_);
}

AvgPool2d::AvgPool2d(std::int64_t kernel_size, std::int64_t stride, std::int64_t padding)
    : kernel_(kernel_size), stride_(stride <= 0 ? kernel_size : stride), padding_(padding) {
  DP_CHECK(kernel_ > 0, "AvgPool2d: expected kernel_size > 0, got ", kernel_);
  DP_CHECK(padding_ >= 0 && 2 * padding_ <= kernel_,
           "AvgPool2d: expected padding between 0 and half the kernel, got ", padding_);
}

Tensor AvgPool2d::forward(const Tensor& x) { return avg_pool2d(x, kernel_, stride_, padding_); }

std::string AvgPool2d::extra_repr() const {
  return detail::str_cat("kernel_size=", kernel_, ", stride=", stride_, ", padding=", padding_);
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::int64_t output_size)
    : AdaptiveAvgPool2d(output_size, output_size) {}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(std::int64_t output_h, std::int64_t output_w)
    : out_h_(output_h), out_w_(output_w) {
  DP_CHECK(out_h_ >= 1 && out_w_ >= 1, "AdaptiveAvgPool2d: expected an output size >= 1, got ", out_h_, "x",
           out_w_);
}

Tensor AdaptiveAvgPool2d::forward(const Tensor& x) { return adaptive_avg_pool2d(x, out_h_, out_w_); }

std::string AdaptiveAvgPool2d::extra_repr() const {
  if (out_h_ == out_w_) return detail::str_cat("output_size=", out_h_);
  return detail::str_cat("output_size=(", out_h_, ", ", out_w_, ")");
}

}  // namespace dp::nn
