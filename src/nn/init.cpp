#include "dp/nn/init.h"

#include <cmath>
#include <string>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "tensor/tensor_util.h"

namespace dp::nn::init {
namespace {

void check_fillable(const char* fn, const Tensor& t) {
  DP_CHECK(t.defined(), "init::", fn, ": expected a defined tensor, got an undefined one");
  DP_CHECK(t.dtype() == Dtype::Float32, "init::", fn, ": expected a float32 tensor, got ",
           dtype_name(t.dtype()), " (", t.str(), ")");
  detail::check_writable((std::string("init::") + fn).c_str(), t);
}

std::int64_t receptive_field(const Tensor& t, const char* fn) {
  DP_CHECK(t.dim() >= 2, "init::", fn, ": fan in and fan out need a tensor with at least 2 dims, got ",
           shape_str(t.shape()));
  std::int64_t r = 1;
  for (std::int64_t d = 2; d < t.dim(); ++d) r *= t.size(d);
  return r;
}

}  // namespace

std::int64_t fan_in(const Tensor& t) { return t.size(1) * receptive_field(t, "fan_in"); }
std::int64_t fan_out(const Tensor& t) { return t.size(0) * receptive_field(t, "fan_out"); }

double leaky_relu_gain(double a) { return std::sqrt(2.0 / (1.0 + a * a)); }

Tensor& uniform_(Tensor& t, double lo, double hi, Generator& gen) {
  check_fillable("uniform_", t);
  DP_CHECK(lo <= hi, "init::uniform_: expected lo <= hi, got [", lo, ", ", hi, ")");
  const std::int64_t n = t.numel();
  // Reserve the counters even for an empty tensor's zero draws: the stream position
  // depends only on the sizes drawn, never on the device.
  const std::uint64_t offset = gen.advance(static_cast<std::uint64_t>(n));
  float* p = t.mutable_data<float>();
  if (n > 0) {
    backend::get(t.device())
        .run<backend::Op::FillUniform>(t.device(), backend::DType::F32,
                                       {p, n, static_cast<float>(lo), static_cast<float>(hi), gen.seed(), offset});
  }
  return t;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator& gen) {
  check_fillable("normal_", t);
  DP_CHECK(std >= 0, "init::normal_: expected std >= 0, got ", std);
  const std::int64_t n = t.numel();
  const std::uint64_t offset = gen.advance(static_cast<std::uint64_t>(n));
  float* p = t.mutable_data<float>();
  if (n > 0) {
    backend::get(t.device())
        .run<backend::Op::FillNormal>(t.device(), backend::DType::F32,
                                      {p, n, static_cast<float>(mean), static_cast<float>(std), gen.seed(), offset});
  }
  return t;
}

Tensor& constant_(Tensor& t, double value) {
  check_fillable("constant_", t);
  NoGradGuard no_grad;  // an initialisation, as PyTorch's init functions (Note [In-place writes and autograd])
  t.fill_(value);
  return t;
}

Tensor& zeros_(Tensor& t) {
  check_fillable("zeros_", t);
  return constant_(t, 0.0);
}
Tensor& ones_(Tensor& t) {
  check_fillable("ones_", t);
  return constant_(t, 1.0);
}

Tensor& kaiming_uniform_(Tensor& t, double a, Generator& gen) {
  check_fillable("kaiming_uniform_", t);
  const std::int64_t fan = fan_in(t);
  DP_CHECK(fan > 0, "init::kaiming_uniform_: fan in is 0 for ", shape_str(t.shape()));
  // PyTorch: std = gain / sqrt(fan_in); a uniform in ±sqrt(3)·std has that std.
  const double std = leaky_relu_gain(a) / std::sqrt(static_cast<double>(fan));
  const double bound = std::sqrt(3.0) * std;
  return uniform_(t, -bound, bound, gen);
}

Tensor& kaiming_normal_(Tensor& t, double a, Generator& gen) {
  check_fillable("kaiming_normal_", t);
  const std::int64_t fan = fan_in(t);
  DP_CHECK(fan > 0, "init::kaiming_normal_: fan in is 0 for ", shape_str(t.shape()));
  return normal_(t, 0.0, leaky_relu_gain(a) / std::sqrt(static_cast<double>(fan)), gen);
}

Tensor& xavier_uniform_(Tensor& t, double gain, Generator& gen) {
  check_fillable("xavier_uniform_", t);
  const std::int64_t fans = fan_in(t) + fan_out(t);
  DP_CHECK(fans > 0, "init::xavier_uniform_: fan in + fan out is 0 for ", shape_str(t.shape()));
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(fans));
  return uniform_(t, -bound, bound, gen);
}

void default_linear_init_(Tensor& weight, Tensor& bias, Generator& gen) {
  kaiming_uniform_(weight, std::sqrt(5.0), gen);
  if (bias.defined()) {
    const std::int64_t fan = fan_in(weight);
    const double bound = fan > 0 ? 1.0 / std::sqrt(static_cast<double>(fan)) : 0.0;
    uniform_(bias, -bound, bound, gen);
  }
}

}  // namespace dp::nn::init
