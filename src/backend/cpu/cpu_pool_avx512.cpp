// CPU backend: the bfloat16 2x2 max-pool's forward and backward in AVX-512 registers,
// and the choice between them and the ISA clones of cpu_pool_clones.cpp.
//
// Note [bfloat16 max-pool in AVX-512]
// The clones of Note [bfloat16 max-pool on its bits] run a row in vectors of 8 windows
// (4 on a narrower row), the last one moved back to end at the row's end: the CNN's
// rows of 14 and 7 windows take two vectors each, and every comparison and select is
// a vector of its own. With AVX-512BW a row of up to 16 windows is one masked load of
// each input row (masked lanes do not touch memory, so no read or write passes the
// row's end), the ReLU runs on the 16-bit lanes before they are widened, and the
// comparisons leave mask registers that the selects take directly: the CNN's rows are
// one vector each, at about half the instructions per window. Each result is narrowed
// in a register and then stored under its mask: GCC fuses a narrowing and a masked
// store into one narrowing store to memory (vpmovdw/vpmovdb m{k}), microcoded on Zen 4,
// which took 14 % of the forward's samples. Measured on a Zen 4 EPYC (kernels_bench, 1
// thread, N256 C32 28x28): the backward 1.86x as fast (1.86x with the ReLU's mask), the
// convolution's one pass with its ReLU and pool 1.06x; a plain forward streaming its
// planes from memory 0.93x, so that one keeps the clones. The bits are the
// clones': the same widening (exact), the same comparisons in the same window order
// (the first maximum in row-major order wins, a NaN over numbers, the first NaN
// stays), the same ReLU (a negative number +0, a NaN 0xFFFF, -0 kept) and the same
// stored NaN (0xFFFF); cpu_backend_test's bfloat16 pool cases, which compare with the
// float32 kernels on the widened planes, run whichever path the CPU takes, and
// DP_CPU_POOL_AVX512=0 makes the clones run on any CPU (for comparing the two).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "backend/cpu/cpu_backend.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DP_POOL_AVX512 1
#endif

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;
using u16 = std::uint16_t;

#if defined(DP_POOL_AVX512)
// GCC 12's intrinsics start some results from _mm512_undefined_*(), which its own
// -Wuninitialized then reports at -O3 (a false positive of the headers, not of this code).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define DP_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/// Lanes [0, n) of a 16-lane mask.
DP_AVX512_TARGET inline __mmask16 lanes16(i64 n) { return static_cast<__mmask16>((1u << n) - 1u); }
DP_AVX512_TARGET inline __mmask32 lanes32(i64 n) {
  return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
}

/// Windows [q, q + n) of one output row, n <= 16 (rows r0, r1 of the input), each input
/// after the convolution's ReLU (the only forward that runs here).
[[gnu::always_inline]] DP_AVX512_TARGET inline void pool_block(const u16* r0, const u16* r1, u16* y,
                                                               std::uint8_t* where, i64 q, i64 n) {
  const __mmask32 in = lanes32(2 * n);
  __m512i top = _mm512_maskz_loadu_epi16(in, r0 + 2 * q);
  __m512i bottom = _mm512_maskz_loadu_epi16(in, r1 + 2 * q);
  // relu_in_place's bits: a NaN 0xFFFF, a negative number (0x8001..0xFF80) +0.
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80);
  const __m512i negative_zero = _mm512_set1_epi16(static_cast<short>(0x8000));
  const __m512i ones = _mm512_set1_epi16(-1);
  for (__m512i* v : {&top, &bottom}) {
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(*v, magnitude), inf);
    const __mmask32 negative = _mm512_cmpgt_epu16_mask(*v, negative_zero);
    *v = _mm512_mask_mov_epi16(_mm512_maskz_mov_epi16(~negative, *v), nan, ones);
  }
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 w[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(top, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(top, high)),
                       _mm512_castsi512_ps(_mm512_slli_epi32(bottom, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(bottom, high))};  // tl, tr, bl, br
  __m512 best = w[0];
  __m512i place = _mm512_setzero_si512();
  for (int k = 1; k < 4; ++k) {
    // Larger, or the first NaN: as the clones' (v > b) | ((v != v) & (b == b)).
    const __mmask16 take = _mm512_cmp_ps_mask(w[k], best, _CMP_GT_OQ) |
                           (_mm512_cmp_ps_mask(w[k], w[k], _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
    best = _mm512_mask_mov_ps(best, take, w[k]);
    place = _mm512_mask_mov_epi32(place, take, _mm512_set1_epi32(k));
  }
  const __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_srli_epi32(_mm512_castps_si512(best), 16), nan,
                                             _mm512_set1_epi32(0xFFFF));
  const __mmask16 out = lanes16(n);
  __m256i y16 = _mm512_cvtepi32_epi16(bits);
  __m128i places = _mm512_cvtepi32_epi8(place);
  // Narrowed in registers, then stored: GCC would fuse each pair into a narrowing store
  // to memory (vpmovdw/vpmovdb m{k}), microcoded and several times slower on Zen 4.
  asm("" : "+v"(y16), "+v"(places));
  _mm256_mask_storeu_epi16(y + q, out, y16);
  _mm_mask_storeu_epi8(where + q, out, places);
}

DP_AVX512_TARGET void relu_pool_planes_avx512(const u16* x, u16* y, std::uint8_t* where, i64 planes, i64 H, i64 W,
                                              i64 P, i64 Q) {
  for (i64 pl = 0; pl < planes; ++pl)
    for (i64 p = 0; p < P; ++p) {
      const u16* r0 = x + pl * H * W + 2 * p * W;
      const i64 o = (pl * P + p) * Q;
      for (i64 q = 0; q < Q; q += 16) pool_block(r0, r0 + W, y + o, where + o, q, std::min<i64>(16, Q - q));
    }
}

/// Windows [q, q + n) of the input gradient, n <= 16: each window's gradient (masked by
/// ry > 0 when kMask) at its place in rows g0 and g1, +0 elsewhere, a NaN as 0xFFFF.
template <bool kMask>
[[gnu::always_inline]] DP_AVX512_TARGET inline void backward_block(const u16* gy, const std::uint8_t* wp,
                                                                   const u16* ry, u16* g0, u16* g1, i64 q, i64 n) {
  const __mmask16 in = lanes16(n);
  __m512i g = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, gy + q));
  if constexpr (kMask) {
    const __m512i y = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, ry + q));
    // y > 0: the bits 0x0001..0x7F80.
    const __mmask16 keep = _mm512_cmpge_epu32_mask(y, _mm512_set1_epi32(1)) &
                           _mm512_cmple_epu32_mask(y, _mm512_set1_epi32(0x7F80));
    g = _mm512_maskz_mov_epi32(keep, g);
  }
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(g, _mm512_set1_epi32(0x7FFF)),
                                                _mm512_set1_epi32(0x7F80));
  g = _mm512_mask_mov_epi32(g, nan, _mm512_set1_epi32(0xFFFF));
  const __m512i k = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(in, wp + q));
  __m512i at[4];  // g where the window's winner is place k, +0 elsewhere (no lambda: it would lose the target)
  for (int place = 0; place < 4; ++place)
    at[place] = _mm512_maskz_mov_epi32(_mm512_cmpeq_epi32_mask(k, _mm512_set1_epi32(place)), g);
  // The left column in the low half of each 32-bit word.
  const __m512i top = _mm512_or_si512(at[0], _mm512_slli_epi32(at[1], 16));
  const __m512i bottom = _mm512_or_si512(at[2], _mm512_slli_epi32(at[3], 16));
  const __mmask32 out = lanes32(2 * n);
  _mm512_mask_storeu_epi16(g0 + 2 * q, out, top);
  _mm512_mask_storeu_epi16(g1 + 2 * q, out, bottom);
}

template <bool kMask>
DP_AVX512_TARGET void backward_planes_avx512(const u16* gy, const std::uint8_t* where, const u16* ry, u16* gx,
                                             i64 planes, i64 H, i64 W, i64 P, i64 Q) {
  for (i64 pl = 0; pl < planes; ++pl) {
    u16* gp = gx + pl * H * W;
    for (i64 p = 0; p < P; ++p) {
      u16* g0 = gp + 2 * p * W;
      u16* g1 = g0 + W;
      const i64 o = (pl * P + p) * Q;
      for (i64 q = 0; q < Q; q += 16)
        backward_block<kMask>(gy + o, where + o, kMask ? ry + o : nullptr, g0, g1, q, std::min<i64>(16, Q - q));
      for (i64 w = 2 * Q; w < W; ++w) g0[w] = g1[w] = 0;  // an odd last column
    }
    for (i64 i = 2 * P * W; i < H * W; ++i) gp[i] = 0;  // an odd last row
  }
}

/// Whether this CPU runs the AVX-512 path (Note [bfloat16 max-pool in AVX-512]).
bool use_avx512() {
  static const bool yes = [] {
    const char* env = std::getenv("DP_CPU_POOL_AVX512");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}
#endif

}  // namespace

void maxpool_2x2_bf16(const std::uint16_t* x, std::uint16_t* y, std::uint8_t* where, std::int64_t planes,
                      std::int64_t H, std::int64_t W, std::int64_t P, std::int64_t Q, bool relu) {
#if defined(DP_POOL_AVX512)
  // The ReLU's pool is the convolution's one pass (Note [Convolution, ReLU and max-pool
  // in one pass]), over a group still in L2; a plain pool streams its planes from
  // memory, where the AVX-512 loop measured slower (Note [bfloat16 max-pool in AVX-512]).
  if (relu && use_avx512()) return relu_pool_planes_avx512(x, y, where, planes, H, W, P, Q);
#endif
  maxpool_2x2_bf16_clones(x, y, where, planes, H, W, P, Q, relu);
}

void maxpool_2x2_backward_bf16(const std::uint16_t* gy, const std::uint8_t* where, const std::uint16_t* relu_y,
                               std::uint16_t* gx, std::int64_t planes, std::int64_t H, std::int64_t W, std::int64_t P,
                               std::int64_t Q) {
#if defined(DP_POOL_AVX512)
  if (use_avx512()) {
    if (relu_y) {
      backward_planes_avx512<true>(gy, where, relu_y, gx, planes, H, W, P, Q);
    } else {
      backward_planes_avx512<false>(gy, where, nullptr, gx, planes, H, W, P, Q);
    }
    return;
  }
#endif
  maxpool_2x2_backward_bf16_clones(gy, where, relu_y, gx, planes, H, W, P, Q);
}

}  // namespace dp::backend::cpu
