// src/backend/kernel_plan.h — launch decisions of the CUDA kernels that depend on sizes
// only: how many blocks share one channel's or one row's reduction, and whether index
// math fits in 32 bits.
//
// Internal to the backend layer; plain C++ (no CUDA headers), included by the .cu files
// of backend/cuda and tested on CPU (tests/backend/kernel_plan_test.cpp). Every
// decision is a pure function of the shape — never of the GPU it runs on — so a
// reduction's summation order, and with it every bit of its result, is the same run to
// run and GPU to GPU (Note [Split reductions], cuda_reduce.cu).
//
//   const int s = kernel_plan::bn_splits(N, C, HW);   // blocks per channel
//   if (kernel_plan::pool_fits_i32(shape)) launch<std::int32_t>(...);
#pragma once

#include <cstdint>
#include <cstdlib>

#include "backend/backend.h"

namespace dp::backend::kernel_plan {

/// Blocks a split reduction aims at: about two per SM of the largest GPUs dp targets
/// (132 SMs on an H100), a constant so that splits never depend on the GPU.
inline constexpr std::int64_t kTargetBlocks = 256;
/// Fewest elements a block of a split reduction takes: 512 threads x 8 elements each,
/// enough that the partial's second pass and the launch cost stay small beside it.
inline constexpr std::int64_t kMinPerSplit = 4096;
/// Most blocks one reduction is split over (the second pass is one warp per row).
inline constexpr int kMaxSplits = 64;
inline constexpr std::int64_t kI32Max = 0x7fffffff;

/// Blocks per item when `items` reductions of `len` elements each are spread over
/// about kTargetBlocks blocks: 1 when the items alone fill the GPU or are short.
inline int splits(std::int64_t items, std::int64_t len) {
  if (items <= 0 || len <= 0 || items >= kTargetBlocks) return 1;
  std::int64_t s = (kTargetBlocks + items - 1) / items;
  const std::int64_t by_len = len / kMinPerSplit;
  if (s > by_len) s = by_len;
  if (s > kMaxSplits) s = kMaxSplits;
  return s < 1 ? 1 : static_cast<int>(s);
}

/// Blocks per channel of the batch-norm statistics over x: (N, C, HW).
inline int bn_splits(std::int64_t N, std::int64_t C, std::int64_t HW) { return splits(C, N * HW); }

/// Blocks per row of a row reduction of `outer` rows of `r` elements.
inline int row_splits(std::int64_t outer, std::int64_t r) { return splits(outer, r); }

/// The part [begin, end) of split `s` of `splits` over `len` elements: equal parts
/// rounded up, the last one shorter (empty parts only when len < splits). constexpr,
/// so that kernels call it too (nvcc --expt-relaxed-constexpr).
struct Part {
  std::int64_t begin;
  std::int64_t end;
};
constexpr Part part_of(std::int64_t len, int splits, int s) {
  const std::int64_t per = (len + splits - 1) / splits;
  std::int64_t b = per * s;
  std::int64_t e = b + per;
  if (b > len) b = len;
  if (e > len) e = len;
  return {b, e};
}

// Note [Division by a runtime constant]
// A per-channel kernel finds an element's channel as (i / HW) % C. On a GPU a 64-bit
// division is a software routine of dozens of instructions and a 32-bit one about
// twenty, per element: enough to hold a memory-bound pass (batch norm's normalisation,
// a bias add) at a third of the memory's speed. FastDivider replaces the division by d
// with a multiply-high, an add and a shift (Granlund and Montgomery's method): with
// s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, which fits in 32 bits,
// n / d = (mulhi(n, m) + n) >> s for every 0 <= n < 2^31 (the sum then fits in 32
// bits). The host computes m and s once per launch; kernel_plan_test checks the
// identity against '/' on the host, where the same constexpr code runs.

/// n / d and n % d for 0 <= n <= INT32_MAX and 1 <= d <= INT32_MAX, without a division.
struct FastDivider {
  std::uint32_t d = 1, m = 1, s = 0;

  FastDivider() = default;
  constexpr explicit FastDivider(std::uint32_t divisor) : d(divisor) {
    while ((std::uint64_t{1} << s) < d) ++s;
    m = static_cast<std::uint32_t>(((std::uint64_t{1} << 32) * ((std::uint64_t{1} << s) - d)) / d + 1);
  }
  constexpr std::uint32_t div(std::uint32_t n) const {
    const auto hi = static_cast<std::uint32_t>((static_cast<std::uint64_t>(n) * m) >> 32);
    return (hi + n) >> s;
  }
  constexpr std::uint32_t mod(std::uint32_t n) const { return n - div(n) * d; }
};

/// True when a divisor and every dividend below `n` suit FastDivider.
inline bool fast_divisible(std::int64_t n, std::int64_t d) { return n >= 0 && n - 1 <= kI32Max && d >= 1 && d <= kI32Max; }

/// True when 0 <= n - 1 <= INT32_MAX: every index below n fits in an int32.
inline bool fits_i32(std::int64_t n) { return n >= 0 && n - 1 <= kI32Max; }

/// True when a strided kernel over `ix` (n elements) can do its index math in 32 bits:
/// n, and the largest offset reachable in a and in b, fit in an int32. Strides may be
/// zero (broadcast) or negative.
inline bool strided_fits_i32(const Indexer& ix, std::int64_t n) {
  if (!fits_i32(n)) return false;
  std::int64_t max_a = 0, max_b = 0;
  for (int d = 0; d < ix.ndim; ++d) {
    const std::int64_t extent = ix.sizes[d] > 0 ? ix.sizes[d] - 1 : 0;
    const std::int64_t sa = std::llabs(ix.strides_a[d]), sb = std::llabs(ix.strides_b[d]);
    if (sa > 0 && extent > (kI32Max - max_a) / sa) return false;
    if (sb > 0 && extent > (kI32Max - max_b) / sb) return false;
    max_a += extent * sa;
    max_b += extent * sb;
  }
  return true;
}

/// True when the pooling kernels over `s` can do their index math in 32 bits: every
/// input and output element index, and every padded coordinate, fits in an int32.
inline bool pool_fits_i32(const Pool2dShape& s) {
  const auto product_fits = [](std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
    if (a <= 0 || b <= 0 || c <= 0 || d <= 0) return true;  // nothing to index
    std::int64_t p = a;
    for (std::int64_t f : {b, c, d}) {
      if (p > kI32Max / f) return false;
      p *= f;
    }
    return true;
  };
  // Window coordinates reach p * stride + kernel (+ pad) and h + pad: bounded by the
  // output and input extents times the strides plus the kernel.
  const std::int64_t reach_h = (s.P + 1) * s.stride_h + s.kernel_h + s.pad_h + s.H;
  const std::int64_t reach_w = (s.Q + 1) * s.stride_w + s.kernel_w + s.pad_w + s.W;
  return product_fits(s.N, s.C, s.H, s.W) && product_fits(s.N, s.C, s.P, s.Q) && reach_h <= kI32Max &&
         reach_w <= kI32Max;
}

}  // namespace dp::backend::kernel_plan
