// src/backend/cpu/cpu_lanes.h — a contiguous float reduction in independent lanes, shared
// by the reductions (cpu_reduce.cpp) and the fused LayerNorm's row sums (cpu_nn.cpp).
// Internal.
#pragma once

#include <cstdint>

namespace dp::backend::cpu {

/// Independent accumulators for a contiguous reduction: 16 floats = one AVX-512
/// register (two AVX2 ones), so the lane loop vectorises without reassociation.
inline constexpr int kLanes = 16;

struct SumOp {
  static constexpr float identity() { return 0.0f; }
  static float combine(float a, float b) { return a + b; }
};

/// Folds load(i) for i in [0, n) with Op into kLanes lanes (element i into lane i mod
/// kLanes, in order), then the lanes by a pairwise tree: an order fixed by n alone.
template <typename Op, typename Load>
[[gnu::always_inline]] inline float fold_lanes(std::int64_t n, Load load) {
  float lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) lanes[j] = Op::identity();
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] = Op::combine(lanes[j], load(i + j));
  for (int j = 0; i < n; ++i, ++j) lanes[j] = Op::combine(lanes[j], load(i));
  // Pairwise tree over the lanes: fixed, and more accurate than a running sum.
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] = Op::combine(lanes[j], lanes[j + width]);
  return lanes[0];
}

/// Σ f(r, i)[k] over `rows` rows of n values and each k < K, in one pass: kLanes
/// accumulators of out's type A a sum (element i of every row into lane i mod kLanes, in
/// order), then the lanes by fold_lanes' pairwise tree: an order fixed by (rows, n) alone.
/// A is float, or double where the caller sums in double (batch norm's statistics, as
/// PyTorch's CPU kernel); f returns K values convertible to A.
template <int K, typename F, typename A>
[[gnu::always_inline]] inline void sum_lanes_rows(std::int64_t rows, std::int64_t n, F f, A (&out)[K]) {
  A lanes[K][kLanes];
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < kLanes; ++j) lanes[k][j] = A(0);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const auto v = f(r, i + j);
        for (int k = 0; k < K; ++k) lanes[k][j] += v[k];
      }
    for (int j = 0; i < n; ++i, ++j) {
      const auto v = f(r, i);
      for (int k = 0; k < K; ++k) lanes[k][j] += v[k];
    }
  }
  for (int k = 0; k < K; ++k) {
    for (int width = kLanes / 2; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lanes[k][j] += lanes[k][j + width];
    out[k] = lanes[k][0];
  }
}

/// Σ f(i)[k] for i in [0, n) and each k < K, in one pass: sum_lanes_rows of one row, so
/// every float sum is folded as fold_lanes<SumOp> folds it alone (the same lanes, the
/// same tree, the same bits).
template <int K, typename F>
[[gnu::always_inline]] inline void sum_lanes(std::int64_t n, F f, float (&out)[K]) {
  sum_lanes_rows(1, n, [&](std::int64_t, std::int64_t i) { return f(i); }, out);
}

}  // namespace dp::backend::cpu
