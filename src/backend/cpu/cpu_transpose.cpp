// CPU backend: a float matrix copied transposed, in 8x8 blocks transposed in AVX2
// registers where the CPU has them (Note [GEMM: a transposed B multiplied
// untransposed]); a 16-bit one in 16x16 blocks (Note [bfloat16 blocked reorders] in
// cpu_conv.cpp).
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backend/cpu/cpu_backend.h"

namespace dp::backend::cpu {

namespace {

/// dst[c * ldd + r] = src[r * lds + c] for r, c in [r0, r1) x [c0, c1), one by one.
template <typename T>
void transpose_scalar(const T* src, std::int64_t lds, std::int64_t r0, std::int64_t r1, std::int64_t c0,
                      std::int64_t c1, T* dst, std::int64_t ldd) {
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t c = c0; c < c1; ++c) dst[c * ldd + r] = src[r * lds + c];
}

#if defined(__x86_64__)
/// dst's rows [0, 8) (ldd apart) = columns [0, 8) of src's rows [0, 8) (lds apart):
/// pairs of rows interleaved, then pairs of pairs, then the 128-bit halves exchanged.
/// Intrinsics, not vector extensions: GCC 12 compiled the generic shuffles of the same
/// steps into spills through the stack, much slower.
[[gnu::target("avx2"), gnu::always_inline]] inline void transpose8x8_avx2(const float* src, std::int64_t lds,
                                                                          float* dst, std::int64_t ldd) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + i * lds);
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  __m256 s[8];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 2; ++i) {
      s[4 * h + 2 * i] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + i + 2], 0x44);
      s[4 * h + 2 * i + 1] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + i + 2], 0xEE);
    }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
  }
}

[[gnu::target("avx2")]] void transpose_avx2(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols,
                                            float* dst, std::int64_t ldd) {
  const std::int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (std::int64_t r = 0; r < rows8; r += 8)
    for (std::int64_t c = 0; c < cols8; c += 8) transpose8x8_avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  transpose_scalar(src, lds, 0, rows8, cols8, cols, dst, ldd);
  transpose_scalar(src, lds, rows8, rows, 0, cols, dst, ldd);
}

// Note [Transposes: the short side innermost]
// A 16-bit activation moved between NCHW and NHWC (Note [bfloat16 blocked reorders] in
// cpu_conv.cpp) is a transpose of a short, wide matrix (C rows of H*W, C = 32 or 64)
// or of a tall, narrow one. Walked row block by row block, the short-by-wide one
// writes each destination row (a pixel's C channels, 64-128 bytes) a 32-byte piece at a
// time, one piece per pass over all H*W pixels: each line leaves the L1 cache between
// its pieces and comes back to be completed. Walking the blocks of the short side
// innermost finishes a 16-pixel strip of destination lines in one go, and the source
// lines it reads in part (C of them) stay in L1 for the next strip. The moved bits are
// the same either way. AMX Xeon, the bfloat16 CNN step (perf, 80 steps): the
// transposes took 17 % of the samples walked row-major (figures: docs/benchmarks/
// kernel-notes.md, "bfloat16 blocked reorders").

/// dst's rows [0, 16) (ldd apart) = columns [0, 16) of src's 16-bit rows [0, 16) (lds
/// apart): rows interleaved in pairs of 16, 32 and 64 bits within each 128-bit half,
/// then the halves exchanged. After the three interleaves, t[8 * o + j'] holds column
/// j (j' its place in the interleave order) of rows 8o..8o+7 in its low half and
/// column j + 8 in its high half.
[[gnu::target("avx2"), gnu::always_inline]] inline void transpose16x16_avx2(const std::uint16_t* src,
                                                                            std::int64_t lds, std::uint16_t* dst,
                                                                            std::int64_t ldd) {
  __m256i a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * lds));
  __m256i b[16];  // b[2p + h]: rows 2p, 2p+1 interleaved; h = 0: columns 0-3 | 8-11, h = 1: 4-7 | 12-15
  for (int p = 0; p < 8; ++p) {
    b[2 * p] = _mm256_unpacklo_epi16(a[2 * p], a[2 * p + 1]);
    b[2 * p + 1] = _mm256_unpackhi_epi16(a[2 * p], a[2 * p + 1]);
  }
  __m256i c[16];  // c[4q + 2h + k]: rows 4q..4q+3, columns 4h + 2k, 4h + 2k + 1 (| + 8)
  for (int q = 0; q < 4; ++q)
    for (int h = 0; h < 2; ++h) {
      c[4 * q + 2 * h] = _mm256_unpacklo_epi32(b[4 * q + h], b[4 * q + 2 + h]);
      c[4 * q + 2 * h + 1] = _mm256_unpackhi_epi32(b[4 * q + h], b[4 * q + 2 + h]);
    }
  __m256i d[16];  // d[8o + j]: rows 8o..8o+7, column j (| j + 8), j = 4h + 2k + m
  for (int o = 0; o < 2; ++o)
    for (int hk = 0; hk < 4; ++hk) {
      d[8 * o + 2 * hk] = _mm256_unpacklo_epi64(c[8 * o + hk], c[8 * o + 4 + hk]);
      d[8 * o + 2 * hk + 1] = _mm256_unpackhi_epi64(c[8 * o + hk], c[8 * o + 4 + hk]);
    }
  for (int j = 0; j < 8; ++j) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * ldd), _mm256_permute2x128_si256(d[j], d[8 + j], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (j + 8) * ldd),
                        _mm256_permute2x128_si256(d[j], d[8 + j], 0x31));
  }
}

[[gnu::target("avx2")]] void transpose_avx2(const std::uint16_t* src, std::int64_t lds, std::int64_t rows,
                                            std::int64_t cols, std::uint16_t* dst, std::int64_t ldd) {
  const std::int64_t rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
  // The blocks along the shorter side innermost: a 16-wide strip of the long side is
  // then finished whole (Note [Transposes: the short side innermost]).
  if (rows < cols) {
    for (std::int64_t c = 0; c < cols16; c += 16)
      for (std::int64_t r = 0; r < rows16; r += 16)
        transpose16x16_avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  } else {
    for (std::int64_t r = 0; r < rows16; r += 16)
      for (std::int64_t c = 0; c < cols16; c += 16)
        transpose16x16_avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
  }
  transpose_scalar(src, lds, 0, rows16, cols16, cols, dst, ldd);
  transpose_scalar(src, lds, rows16, rows, 0, cols, dst, ldd);
}
#endif

}  // namespace

void transpose_copy(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, float* dst,
                    std::int64_t ldd) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return transpose_avx2(src, lds, rows, cols, dst, ldd);
#endif
  transpose_scalar(src, lds, 0, rows, 0, cols, dst, ldd);
}

void transpose_copy(const std::uint16_t* src, std::int64_t lds, std::int64_t rows, std::int64_t cols,
                    std::uint16_t* dst, std::int64_t ldd) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return transpose_avx2(src, lds, rows, cols, dst, ldd);
#endif
  transpose_scalar(src, lds, 0, rows, 0, cols, dst, ldd);
}

}  // namespace dp::backend::cpu
