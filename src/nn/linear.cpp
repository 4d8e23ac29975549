#include "dp/nn/linear.h"

#include "dp/core/error.h"
#include "dp/nn/init.h"
#include "dp/tensor/ops.h"

namespace dp::nn {

Linear::Linear(std::int64_t in_features, std::int64_t out_features, bool bias, Generator* gen)
    : in_(in_features), out_(out_features) {
  DP_CHECK(in_features > 0 && out_features > 0, "Linear: expected positive in and out features, got in=",
           in_features, ", out=", out_features);
  Tensor w = empty({out_, in_});
  Tensor b = bias ? empty({out_}) : Tensor();
  init::default_linear_init_(w, b, gen ? *gen : default_generator());
  weight_ = register_parameter("weight", w);
  if (bias) bias_ = register_parameter("bias", b);
}

Linear::Linear(const LinearOptions& o, Generator* gen)
    : Linear(o.in_features(), o.out_features(), o.bias(), gen) {}

void Linear::check_input(const Tensor& x) const {
  DP_CHECK(x.defined(), "Linear: expected a defined input, got an undefined tensor");
  DP_CHECK(x.dim() >= 1 && x.size(x.dim() - 1) == in_, "Linear: expected input (..., in=", in_, "), got ",
           shape_str(x.shape()), x.dim() == 4 ? "; an (N, C, H, W) input wants a Flatten before this layer" : "");
}

namespace {

// Over the last dim of any input, as torch.nn.Linear: (..., in) is viewed as rows
// (n, in), one GEMM, and viewed back as (..., out).
template <class F>
Tensor over_rows(const Tensor& x, std::int64_t in, std::int64_t out, F&& f) {
  if (x.dim() == 2) return f(x);
  Shape shape = x.shape();
  shape.back() = out;
  return f(x.reshape({x.numel() / in, in})).reshape(shape);
}

}  // namespace

Tensor Linear::forward(const Tensor& x) {
  check_input(x);
  return over_rows(x, in_, out_, [&](const Tensor& rows) { return linear(rows, weight_.get(), bias()); });
}

Tensor Linear::forward_relu(const Tensor& x) {
  check_input(x);
  return over_rows(x, in_, out_, [&](const Tensor& rows) { return linear_relu(rows, weight_.get(), bias()); });
}

std::string Linear::extra_repr() const {
  return detail::str_cat("in_features=", in_, ", out_features=", out_,
                         ", bias=", bias_.defined() ? "true" : "false");
}

}  // namespace dp::nn
