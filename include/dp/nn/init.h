// dp/nn/init.h — parameter initialisation, with PyTorch's formulas (torch.nn.init).
//
// Every function fills a float32 tensor in place (no autograd record, storage version
// bumped) with numbers drawn from a Generator (dp::default_generator() unless one is
// given), so the same seed gives the same parameters on every device and backend.
// This header knows nothing of modules or optimizers.
//
//   dp::nn::init::kaiming_uniform_(w, std::sqrt(5.0));   // Linear/Conv2d default weight
//   double b = 1.0 / std::sqrt(dp::nn::init::fan_in(w));
//   dp::nn::init::uniform_(bias, -b, b);
#pragma once

#include <cstdint>

#include "dp/tensor/tensor.h"

namespace dp::nn::init {

/// Fan-in as PyTorch computes it: size(1) × (product of the dims after 1) — in for a
/// Linear weight (out, in), C·R·S for a Conv2d weight (K, C, R, S). Needs dim() ≥ 2.
std::int64_t fan_in(const Tensor& t);
/// Fan-out: size(0) × (product of the dims after 1). Needs dim() ≥ 2.
std::int64_t fan_out(const Tensor& t);

/// PyTorch's calculate_gain('leaky_relu', a) = sqrt(2 / (1 + a²)) (a = 0: ReLU's sqrt(2)).
double leaky_relu_gain(double a);

/// Uniform values in [lo, hi).
Tensor& uniform_(Tensor& t, double lo, double hi, Generator& gen = default_generator());
/// Normal values with the given mean and standard deviation.
Tensor& normal_(Tensor& t, double mean, double std, Generator& gen = default_generator());
Tensor& constant_(Tensor& t, double value);
Tensor& zeros_(Tensor& t);
Tensor& ones_(Tensor& t);

/// He/Kaiming uniform (fan-in mode, leaky-ReLU gain with slope a): uniform in
/// [-bound, bound], bound = sqrt(3) · gain / sqrt(fan_in), gain = sqrt(2 / (1 + a²)).
/// a = sqrt(5) (PyTorch's Linear/Conv2d default) gives bound = 1 / sqrt(fan_in).
Tensor& kaiming_uniform_(Tensor& t, double a = 0.0, Generator& gen = default_generator());
/// He/Kaiming normal (fan-in mode): std = gain / sqrt(fan_in).
Tensor& kaiming_normal_(Tensor& t, double a = 0.0, Generator& gen = default_generator());
/// Glorot/Xavier uniform: bound = gain · sqrt(6 / (fan_in + fan_out)).
Tensor& xavier_uniform_(Tensor& t, double gain = 1.0, Generator& gen = default_generator());

/// PyTorch's default for Linear and Conv2d (reset_parameters): weight
/// kaiming_uniform_(a = sqrt(5)), then bias (if defined) uniform in ±1/sqrt(fan_in)
/// — drawn in that order from `gen`.
void default_linear_init_(Tensor& weight, Tensor& bias, Generator& gen = default_generator());

}  // namespace dp::nn::init
