// tests/autograd/gradcheck.h — central-difference gradient checks for dp ops (test-only).
//
// gradcheck(f, inputs) differentiates L = Σ f(inputs) ⊙ w for fixed pseudo-random weights
// w (so every output element gets a different upstream gradient) by autograd, then
// compares each input element's gradient with (L(x + e) - L(x - e)) / (x+e - (x-e)),
// where L is accumulated in double on the host from the float32 outputs. Inputs should
// be small and kept away from kinks (ReLU at 0, ties of max) by more than eps.
//
//   gradcheck([](const auto& x) { return dp::tanh(x[0]); }, {dp::from_vector(v, {2, 3})});
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace dp_test {

struct GradcheckOptions {
  double eps = 1e-2;   // step; float32 inputs make much smaller steps lose digits
  double atol = 1e-3;  // |analytic - numeric| <= atol + rtol * |numeric|
  double rtol = 1e-2;
};

using Fn = std::function<dp::Tensor(const std::vector<dp::Tensor>&)>;

/// Values in [lo, hi) from a fixed seed.
inline std::vector<float> uniform_values(std::int64_t n, float lo, float hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

/// Values with |x| in [0.2, 1.2): at least 0.2 away from 0, the kink of relu and abs.
inline std::vector<float> away_from_zero(std::int64_t n, unsigned seed) {
  std::vector<float> v = uniform_values(n, -1.0f, 1.0f, seed);
  for (auto& x : v) x = x < 0 ? x - 0.2f : x + 0.2f;
  return v;
}

/// Distinct values 0.1 apart in a shuffled order (no ties for max).
inline std::vector<float> distinct_values(std::int64_t n, unsigned seed) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = -1.0f + 0.1f * static_cast<float>(i);
  std::mt19937 rng(seed);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

/// Compares autograd's gradient of every input of f with central differences; returns
/// one line per element that disagrees (empty when all agree).
inline std::vector<std::string> gradcheck_mismatches(const Fn& f, const std::vector<dp::Tensor>& inputs,
                                                     GradcheckOptions opt = {}) {
  std::vector<std::string> bad;
  // Analytic gradients through fresh leaves.
  std::vector<dp::Tensor> leaves;
  for (const auto& x : inputs) {
    dp::Tensor leaf = x.detach().clone();
    leaf.set_requires_grad(true);
    leaves.push_back(leaf);
  }
  dp::Tensor out = f(leaves);
  if (!out.requires_grad()) return {"the output does not require grad"};
  std::vector<float> w = uniform_values(out.numel(), 0.5f, 1.5f, 1234);
  for (std::size_t k = 0; k < w.size(); k += 2) w[k] = -w[k];
  dp::Tensor wt = dp::from_vector(w, out.shape(), out.device());
  dp::sum(dp::mul(out, wt)).backward();

  auto loss = [&](const std::vector<dp::Tensor>& xs) {
    dp::NoGradGuard no_grad;
    std::vector<float> o = f(xs).to_vector();
    double acc = 0;
    for (std::size_t k = 0; k < o.size(); ++k) acc += static_cast<double>(o[k]) * w[k];
    return acc;
  };

  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::string where = "input " + std::to_string(i) + " " + dp::shape_str(inputs[i].shape());
    dp::Tensor g = leaves[i].grad();
    if (!g.defined()) {
      bad.push_back(where + ": no gradient");
      continue;
    }
    if (g.shape() != inputs[i].shape() || g.device() != inputs[i].device()) {
      bad.push_back(where + ": gradient " + g.str());
      continue;
    }
    std::vector<float> analytic = g.to_vector();
    std::vector<float> host = inputs[i].to_vector();
    std::vector<dp::Tensor> xs;
    for (const auto& x : inputs) xs.push_back(x.detach());
    for (std::size_t j = 0; j < host.size(); ++j) {
      std::vector<float> p = host;
      p[j] = static_cast<float>(host[j] + opt.eps);
      const double hi = p[j];
      xs[i] = dp::from_vector(p, inputs[i].shape(), inputs[i].device());
      const double lp = loss(xs);
      p[j] = static_cast<float>(host[j] - opt.eps);
      const double lo = p[j];
      xs[i] = dp::from_vector(p, inputs[i].shape(), inputs[i].device());
      const double lm = loss(xs);
      const double numeric = (lp - lm) / (hi - lo);  // the float32 step actually taken
      if (!(std::fabs(analytic[j] - numeric) <= opt.atol + opt.rtol * std::fabs(numeric)))
        bad.push_back(where + " element " + std::to_string(j) + " at x = " + std::to_string(host[j]) +
                      ": autograd " + std::to_string(analytic[j]) + ", numeric " + std::to_string(numeric));
    }
    xs[i] = inputs[i].detach();
  }
  return bad;
}

/// Checks autograd's gradient of every input of f against central differences.
inline void gradcheck(const Fn& f, const std::vector<dp::Tensor>& inputs, GradcheckOptions opt = {}) {
  std::vector<std::string> bad = gradcheck_mismatches(f, inputs, opt);
  for (std::size_t k = 0; k < bad.size() && k < 5; ++k) MESSAGE(bad[k]);  // the first few
  CHECK(bad.empty());
}

}  // namespace dp_test
