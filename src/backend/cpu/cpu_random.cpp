// CPU backend: the loops of the random fills and of dropout.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand, and without FMA
// contraction.
#include <algorithm>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"

namespace dp::backend::cpu {

// Note [Vectorised random fills]
// Every element of a random fill or a dropout mask costs one Philox4x32-10 block (Note
// [Counter-based random numbers]): twenty 32x32->64-bit multiplies in a dependent
// chain, slow for the x86-64 baseline. Blocks of different elements are independent,
// so a tile of counters is run through the rounds side by side in vector lanes
// (vpmuludq multiplies 8 lanes of 32 bits into 64 with AVX-512), in an x86-64-v4 clone
// (AVX-512 F/BW/CD/DQ/VL) and an x86-64-v3 one (AVX2) (figures: docs/BENCHMARKS.md,
// section "Random fills and dropout"). The words are integers and the float steps after them are the
// scalar functors' own (uniform_open1, normal_from_words, no contraction: this file is
// built with -ffp-contract=off; logf and cosf stay glibc's scalar calls), so every
// clone writes the bits that uniform_from and normal_from give (cpu_backend_test checks
// element by element, across a 2^32 counter boundary).

namespace {

/// Elements per tile: the words of one tile stay in L1 between the rounds and their use.
constexpr int kTile = 256;

/// Runs body(t, count, w0, w1) for the tiles of [begin, end): w0 (and w1 when kTwoWords)
/// hold lanes 0 (and 1) of the Philox blocks of elements t .. t + count - 1. Always
/// inlined: only code inlined into a clone is compiled for the clone's ISA.
template <bool kTwoWords, typename Body>
[[gnu::always_inline]] inline void for_each_tile(std::int64_t begin, std::int64_t end, std::uint64_t seed,
                                                 std::uint64_t offset, Body body) {
  std::uint32_t w0[kTile], w1[kTwoWords ? kTile : 1];  // w1 unused unless kTwoWords
  for (std::int64_t t = begin; t < end; t += kTile) {
    const int count = static_cast<int>(std::min<std::int64_t>(kTile, end - t));
    const std::uint64_t first = offset + static_cast<std::uint64_t>(t);
    for (int j = 0; j < count; ++j) {
      const Philox4 r = philox_block(seed, first + static_cast<std::uint64_t>(j));
      w0[j] = r.v[0];
      if constexpr (kTwoWords) w1[j] = r.v[1];
    }
    body(t, count, w0, w1);
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES void uniform_range(float* y, std::int64_t begin, std::int64_t end, float lo, float hi,
                                    std::uint64_t seed, std::uint64_t offset) {
  const float span = hi - lo;
  for_each_tile<false>(begin, end, seed, offset, [=](std::int64_t t, int count, const std::uint32_t* w0, auto) {
    for (int j = 0; j < count; ++j) y[t + j] = lo + span * uniform_open1(w0[j]);
  });
}

DP_CPU_V4_V3_CLONES void normal_range(float* y, std::int64_t begin, std::int64_t end, float mean, float std,
                                   std::uint64_t seed, std::uint64_t offset) {
  for_each_tile<true>(begin, end, seed, offset, [=](std::int64_t t, int count, const std::uint32_t* w0,
                                                     const std::uint32_t* w1) {
    for (int j = 0; j < count; ++j) y[t + j] = mean + std * normal_from_words(w0[j], w1[j]);
  });
}

DP_CPU_V4_V3_CLONES void dropout_range(const float* x, float* y, float* mask, std::int64_t begin, std::int64_t end,
                                    float p, float scale, std::uint64_t seed, std::uint64_t offset) {
  for_each_tile<false>(begin, end, seed, offset, [=](std::int64_t t, int count, const std::uint32_t* w0, auto) {
    for (int j = 0; j < count; ++j) {
      const float m = uniform_open1(w0[j]) >= p ? scale : 0.0f;
      if (mask) mask[t + j] = m;
      y[t + j] = x[t + j] * m;
    }
  });
}

}  // namespace dp::backend::cpu
