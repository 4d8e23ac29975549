// tests/nn/nn_test_util.h — devices and plain host references shared by the nn tests.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

#include "test_devices.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "test_errors.h"
#include "dp/tensor/tensor.h"

namespace nn_test {

#define DP_NN_TEST_DEVICES dp_test::Cpu0, dp_test::Cpu1

using F = std::vector<float>;
using I = std::vector<std::int64_t>;

/// Max |a[i] - b[i]| (sizes must match); infinity when a NaN appears on either side
/// (std::max would skip it, and a tolerance check would then pass).
inline double max_diff(const F& a, const F& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= m)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}

/// True when a and b hold the same floats bit for bit (NaN payloads and signed zeros
/// included).
inline bool bitwise_equal(const F& a, const F& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

using dp_test::throws_with;  // tests/test_errors.h

// ---- naive NCHW references ------------------------------------------------------------------

/// Convolution (N, C, H, W) x (K, C, R, S) + b → (N, K, P, Q), zero padding.
inline F ref_conv2d(const F& x, const F& w, const F* b, std::int64_t N, std::int64_t C, std::int64_t H,
                    std::int64_t W, std::int64_t K, std::int64_t R, std::int64_t S, std::int64_t stride,
                    std::int64_t pad, std::int64_t* P_out = nullptr, std::int64_t* Q_out = nullptr) {
  const std::int64_t P = (H + 2 * pad - R) / stride + 1, Q = (W + 2 * pad - S) / stride + 1;
  if (P_out) *P_out = P;
  if (Q_out) *Q_out = Q;
  F y(static_cast<std::size_t>(N * K * P * Q));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t k = 0; k < K; ++k)
      for (std::int64_t p = 0; p < P; ++p)
        for (std::int64_t q = 0; q < Q; ++q) {
          double acc = b ? (*b)[k] : 0.0;
          for (std::int64_t c = 0; c < C; ++c)
            for (std::int64_t r = 0; r < R; ++r)
              for (std::int64_t s = 0; s < S; ++s) {
                std::int64_t h = p * stride - pad + r, ww = q * stride - pad + s;
                if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                acc += double(x[((n * C + c) * H + h) * W + ww]) * w[((k * C + c) * R + r) * S + s];
              }
          y[((n * K + k) * P + p) * Q + q] = static_cast<float>(acc);
        }
  return y;
}

/// Max (is_max) or average (count_include_pad) pooling over (N·C) planes.
inline F ref_pool2d(const F& x, std::int64_t NC, std::int64_t H, std::int64_t W, std::int64_t k,
                    std::int64_t stride, std::int64_t pad, bool is_max) {
  const std::int64_t P = (H + 2 * pad - k) / stride + 1, Q = (W + 2 * pad - k) / stride + 1;
  F y(static_cast<std::size_t>(NC * P * Q));
  for (std::int64_t c = 0; c < NC; ++c)
    for (std::int64_t p = 0; p < P; ++p)
      for (std::int64_t q = 0; q < Q; ++q) {
        double acc = is_max ? -INFINITY : 0.0;
        for (std::int64_t r = 0; r < k; ++r)
          for (std::int64_t s = 0; s < k; ++s) {
            std::int64_t h = p * stride - pad + r, w = q * stride - pad + s;
            if (h < 0 || h >= H || w < 0 || w >= W) continue;
            double v = x[(c * H + h) * W + w];
            acc = is_max ? std::max(acc, v) : acc + v;
          }
        y[(c * P + p) * Q + q] = static_cast<float>(is_max ? acc : acc / double(k * k));
      }
  return y;
}

}  // namespace nn_test
