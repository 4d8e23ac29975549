// tests/optim/optim_test_util.h — a tiny model, deterministic gradients and double
// references of PyTorch's update formulas, shared by the optimizer tests.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "test_devices.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "test_errors.h"
#include "dp/nn/nn.h"
#include "dp/tensor/tensor.h"

namespace optim_test {

#define DP_OPTIM_TEST_DEVICES dp_test::Cpu0, dp_test::Cpu1

using D = std::vector<double>;

/// Linear(3, 2) → Linear(2, 2): 14 parameters in 4 tensors.
inline std::shared_ptr<dp::nn::Sequential> tiny_net(dp::Device dev, std::uint64_t seed = 1) {
  dp::Generator gen(seed);
  auto net = std::make_shared<dp::nn::Sequential>(std::make_shared<dp::nn::Linear>(3, 2, true, &gen),
                                                  std::make_shared<dp::nn::Linear>(2, 2, true, &gen));
  net->to(dev);
  return net;
}

/// A deterministic gradient for element i of parameter k at step t (values in ±1.5).
inline float grad_value(std::size_t k, std::size_t i, int t) {
  return static_cast<float>(1.5 * std::sin(0.7 * double(i) + 1.3 * double(k) + 2.1 * t + 0.4));
}

/// Gives every listed tensor grad_value as its .grad (PyTorch's `p.grad = g`: a module
/// parameter's is written into its place in the flat buffer and counts as a gradient).
inline void set_grads(const std::vector<dp::Tensor>& params, int t) {
  for (std::size_t k = 0; k < params.size(); ++k) {
    std::vector<float> g(static_cast<std::size_t>(params[k].numel()));
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(k, i, t);
    params[k].set_grad(dp::from_vector(g, params[k].shape(), params[k].device()));
  }
}

using dp_test::throws_with;  // tests/test_errors.h

inline D to_double(const std::vector<float>& v) { return D(v.begin(), v.end()); }

inline double max_rel_diff(const std::vector<float>& a, const D& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, std::fabs(a[i] - b[i]) / std::max(1.0, std::fabs(b[i])));
  }
  return m;
}

/// PyTorch's SGD on one element (double).
struct SgdRef {
  double lr, momentum = 0, dampening = 0, wd = 0;
  bool nesterov = false;
  void step(double& p, double g, double& buf, bool first) const {
    g += wd * p;
    if (momentum != 0) {
      buf = first ? g : momentum * buf + (1 - dampening) * g;
      g = nesterov ? g + momentum * buf : buf;
    }
    p -= lr * g;
  }
};

/// PyTorch's Adam / AdamW on one element (double), step t 1-based.
struct AdamRef {
  double lr, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0;
  bool decoupled = false;
  void step(double& p, double g, double& m, double& v, int t) const {
    if (decoupled) {
      p *= 1 - lr * wd;
    } else {
      g += wd * p;
    }
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    p -= (lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
  }
};

}  // namespace optim_test
