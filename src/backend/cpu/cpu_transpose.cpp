// CPU backend: a float matrix copied transposed, in 8x8 blocks transposed in registers
// (Note [GEMM: the forward's weight slab transposed]).
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_backend.h"

namespace dp::backend::cpu {

namespace {

using V8 = float __attribute__((vector_size(32)));

/// dst's rows [0, 8) (ldd apart) = columns [0, 8) of src's rows [0, 8) (lds apart).
/// Always inlined (only code inlined into a clone is compiled for the clone's ISA).
[[gnu::always_inline]] inline void transpose8x8(const float* src, std::int64_t lds, float* dst, std::int64_t ldd) {
  V8 a[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&a[i], src + i * lds, sizeof(V8));
  // Pairs of rows interleaved, then pairs of pairs, then the halves swapped across.
  V8 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 2; ++i) {
      s[4 * h + 2 * i] = __builtin_shufflevector(t[4 * h + i], t[4 * h + i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      s[4 * h + 2 * i + 1] = __builtin_shufflevector(t[4 * h + i], t[4 * h + i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 4; ++i) {
    const V8 lo = __builtin_shufflevector(s[i], s[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const V8 hi = __builtin_shufflevector(s[i], s[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(dst + i * ldd, &lo, sizeof(V8));
    std::memcpy(dst + (i + 4) * ldd, &hi, sizeof(V8));
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES
void transpose_copy(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, float* dst,
                    std::int64_t ldd) {
  const std::int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (std::int64_t r = 0; r < rows8; r += 8) {
    for (std::int64_t c = 0; c < cols8; c += 8) transpose8x8(src + r * lds + c, lds, dst + c * ldd + r, ldd);
    for (std::int64_t c = cols8; c < cols; ++c)
      for (std::int64_t i = r; i < r + 8; ++i) dst[c * ldd + i] = src[i * lds + c];
  }
  for (std::int64_t r = rows8; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

}  // namespace dp::backend::cpu
