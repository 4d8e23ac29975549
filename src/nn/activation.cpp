#include "dp/nn/activation.h"

#include <utility>

#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"

namespace dp::nn {

Tensor ReLU::forward(const Tensor& x) { return relu(x); }
Tensor Sigmoid::forward(const Tensor& x) { return sigmoid(x); }
Tensor Tanh::forward(const Tensor& x) { return tanh(x); }

GELU::GELU(std::string approximate) : approximate_(std::move(approximate)) {
  DP_CHECK(approximate_ == "none" || approximate_ == "tanh", "GELU: expected approximate \"none\" or \"tanh\", got \"",
           approximate_, "\"");
}

Tensor GELU::forward(const Tensor& x) { return gelu(x, approximate_); }

std::string GELU::extra_repr() const { return approximate_ == "none" ? "" : "approximate='tanh'"; }

}  // namespace dp::nn
