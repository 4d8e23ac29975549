// CPU backend: GEMMs with a small inner dimension, and the ReLU mask of an input
// gradient in the same pass (Note [GEMMs with a small k]).
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand, and without FMA
// contraction (every multiply-add below is an explicit std::fma).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"

namespace dp::backend::cpu {

// Note [GEMMs with a small k]
// A product whose inner dimension is a handful of values is a broadcast, not a
// GEMM: the MLP 784-1024-1024-10's last input gradient dX = dY W (512x1024, k = 10)
// does 10 multiply-adds per element it writes. oneDNN's sgemm still writes C tile by
// tile, a dozen rows 4 KiB apart at a time, which the prefetchers do not follow, and
// the ReLU's mask then read them back: several times the same call warm in cache
// (figures: docs/benchmarks/kernel-notes.md, "GEMMs with a small k"). Here each thread writes whole rows of C in order, every element
// finished in registers — the products summed in k order, then the ReLU's mask when
// the product is an input gradient (Note [ReLU mask in the input gradient]) — so C
// is written once, as a stream, and never read back.
// Every element is the same sum wherever a split puts it: fma(a[i,k-1], b[k-1,j],
// ... fma(a[i,0], b[0,j], +0)), each fma rounded once (std::fma: exact in every clone,
// a libm call where the CPU has no FMA — CpuBackend::gemm sends those CPUs to oneDNN,
// see small_k_gemm_fits). So any chunking gives the bits of one call on one thread;
// the bits are this loop's, not oneDNN's (cpu_backend_test checks both against a
// double-precision product and the chunkings against each other).

namespace {

/// Columns [j0, j0 + w) of one row of C: the sums in k order, then the mask by yrow.
/// Always inlined (only code inlined into a clone is compiled for the clone's ISA).
/// kWidth: the block's width, fixed for the vectorised blocks; 0 for the tail, whose
/// width is w (at most 16).
template <std::int64_t kWidth>
[[gnu::always_inline]] inline void row_block(const float* ai, std::int64_t k, const float* b, std::int64_t ldb,
                                             std::int64_t j0, std::int64_t w, float* __restrict crow,
                                             const float* yrow) {
  constexpr std::int64_t kMax = kWidth > 0 ? kWidth : 16;
  const std::int64_t width = kWidth > 0 ? kWidth : w;
  float acc[kMax];
  for (std::int64_t jj = 0; jj < width; ++jj) acc[jj] = 0.0f;
  for (std::int64_t p = 0; p < k; ++p) {
    const float ap = ai[p];
    const float* __restrict brow = b + p * ldb + j0;
    for (std::int64_t jj = 0; jj < width; ++jj) acc[jj] = std::fma(ap, brow[jj], acc[jj]);
  }
  const Binary<BinaryOp::ReluBackward> mask;
  if (yrow) {
    for (std::int64_t jj = 0; jj < width; ++jj) crow[j0 + jj] = mask(acc[jj], yrow[j0 + jj]);
  } else {
    for (std::int64_t jj = 0; jj < width; ++jj) crow[j0 + jj] = acc[jj];
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES void small_k_gemm(bool trans_a, std::int64_t rows, std::int64_t n, std::int64_t k,
                                    const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                                    std::int64_t ldc, const float* relu_y) {
  constexpr std::int64_t kBlock = 64;  // four AVX-512 accumulators
  float ai[kSmallK];
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t p = 0; p < k; ++p) ai[p] = trans_a ? a[p * lda + i] : a[i * lda + p];
    float* crow = c + i * ldc;
    const float* yrow = relu_y ? relu_y + i * ldc : nullptr;
    std::int64_t j = 0;
    for (; j + kBlock <= n; j += kBlock) row_block<kBlock>(ai, k, b, ldb, j, kBlock, crow, yrow);
    for (; j < n; j += 16) row_block<0>(ai, k, b, ldb, j, std::min<std::int64_t>(16, n - j), crow, yrow);
  }
}

}  // namespace dp::backend::cpu
