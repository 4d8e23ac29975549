#include "dp/nn/activation.h"

#include "dp/tensor/ops.h"

namespace dp::nn {

Tensor ReLU::forward(const Tensor& x) { return relu(x); }
Tensor Sigmoid::forward(const Tensor& x) { return sigmoid(x); }
Tensor Tanh::forward(const Tensor& x) { return tanh(x); }

}  // namespace dp::nn
