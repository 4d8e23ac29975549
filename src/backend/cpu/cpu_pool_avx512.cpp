// CPU backend: the 2x2 max-pool's forward and backward in AVX-512 registers, for
// bfloat16 and float32, and the choice between them and the portable loops (the ISA
// clones of cpu_pool_clones.cpp for bfloat16, cpu_nn.cpp's vectors for float32).
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
// DP_CPU_POOL_AVX512=0 makes the clones run on any CPU (for comparing the two;
// set_pool_avx512 does the same inside a process).
//
// Note [float32 max-pool in AVX-512]
// The float32 pool with byte places (Note [Max-pool winners in a byte]) runs four
// windows per 128-bit vector in cpu_nn.cpp (Note [Branch-free 2x2 max-pool]), the
// baseline x86-64 ISA, and perf put its forward and backward at 6.9 % of the
// Fashion-MNIST CNN's float32 step each. With AVX-512 a vector holds 16 windows: two
// 512-bit loads per input row (masked for a row's last windows, so the CNN's rows of 14
// and 7 windows are one vector each and nothing is read or written past a row's end),
// de-interleaved into the even and odd columns by one two-source permute each; the
// comparisons leave mask registers, and the places are selected as bytes in a 128-bit
// register and stored under the row's mask. Backward loads 16 gradients and places,
// turns each place into two 32-bit masks (one per input row: bit 2i for window i's left
// input, 2i + 1 for its right one) by comparing the places, each byte doubled, with
// 0,1 and 2,3, and writes each 16-input half of a row with one zero-masking permute
// that spreads the gradients out: every input element written once, the gradient at the
// winner and +0 elsewhere. The bits are those of cpu_nn.cpp's loops: a maximum is one
// of the inputs, moved and never computed (NaN payloads, -0 and +0 kept), chosen by the
// same rule in the same order (take v when !(v <= best) and best is not NaN: v larger,
// or v the first NaN; a tie keeps the earlier one), the ReLU's mask is relu_y > 0 (false
// for NaN) and a masked gradient +0. cpu_backend_test runs the pool cases on whichever
// path the CPU takes and compares the two paths on random planes through
// set_pool_avx512. Measured on an AMX Xeon (family 6 model 207; kernels_bench, 1 thread,
// N256, docs/benchmarks/kernel-notes.md, "float32 max-pool in AVX-512"): the forward
// 2.75x as fast at C32 28x28 and 2.63x at C64 14x14, the convolution's one pass with its
// ReLU and pool 1.93x, the backward 1.41x at 14x14 but 1.00x at 28x28, where writing
// the input gradient is bound by memory either way; the CNN's float32 step 3-7 % faster.
// Unlike the bfloat16 pool, the plain float32 forward gains too, so every float32 byte
// pool takes it.
#include <algorithm>
#include <atomic>
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

/// Windows [q, q + n) of one float32 output row, n <= 16, from input rows r0 and r1: y
/// and the places (Note [float32 max-pool in AVX-512]).
[[gnu::always_inline]] DP_AVX512_TARGET inline void pool_block_f32(const float* r0, const float* r1, float* y,
                                                                   std::uint8_t* where, i64 q, i64 n) {
  const __mmask32 in = lanes32(2 * n);
  const __mmask16 lo = static_cast<__mmask16>(in), hi = static_cast<__mmask16>(in >> 16);
  const __m512 t0 = _mm512_maskz_loadu_ps(lo, r0 + 2 * q), t1 = _mm512_maskz_loadu_ps(hi, r0 + 2 * q + 16);
  const __m512 b0 = _mm512_maskz_loadu_ps(lo, r1 + 2 * q), b1 = _mm512_maskz_loadu_ps(hi, r1 + 2 * q + 16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 w[4] = {_mm512_permutex2var_ps(t0, even, t1), _mm512_permutex2var_ps(t0, odd, t1),
                       _mm512_permutex2var_ps(b0, even, b1), _mm512_permutex2var_ps(b0, odd, b1)};  // tl, tr, bl, br
  __m512 best = w[0];
  __m128i place = _mm_setzero_si128();
  for (int k = 1; k < 4; ++k) {
    // cpu_nn.cpp's take(): (v > best) | ((v != v) & (best == best)), that is !(v <= best)
    // (true when either is NaN) where best is not NaN.
    const __mmask16 take =
        _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(best, best, _CMP_ORD_Q), w[k], best, _CMP_NLE_UQ);
    best = _mm512_mask_mov_ps(best, take, w[k]);
    place = _mm_mask_mov_epi8(place, take, _mm_set1_epi8(static_cast<char>(k)));
  }
  const __mmask16 out = lanes16(n);
  _mm512_mask_storeu_ps(y + q, out, best);
  _mm_mask_storeu_epi8(where + q, out, place);
}

/// Windows [q, q + n) of the float32 input gradient, n <= 16: each window's gradient
/// (+0 where kMask and not ry > 0) at its place in rows g0 and g1, +0 elsewhere.
template <bool kMask>
[[gnu::always_inline]] DP_AVX512_TARGET inline void backward_block_f32(const float* gy, const std::uint8_t* wp,
                                                                       const float* ry, float* g0, float* g1, i64 q,
                                                                       i64 n) {
  const __mmask16 in = lanes16(n);
  __m512 g = _mm512_maskz_loadu_ps(in, gy + q);
  if constexpr (kMask)  // ry > 0: false for NaN, as Binary<ReluBackward>
    g = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(in, ry + q), _mm512_setzero_ps(), _CMP_GT_OQ), g);
  // Each place twice, bytes 2i and 2i + 1 for window i's left and right inputs; equal to
  // 0,1 (top row) or 2,3 (bottom row) where that input won.
  const __m256i k16 = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(in, wp + q));
  const __m256i k = _mm256_or_si256(k16, _mm256_slli_epi16(k16, 8));
  const __mmask32 top = _mm256_cmpeq_epi8_mask(k, _mm256_set1_epi16(0x0100));
  const __mmask32 bottom = _mm256_cmpeq_epi8_mask(k, _mm256_set1_epi16(0x0302));
  const __m512i left = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // windows 0..7
  const __m512i right = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  const __mmask32 out = lanes32(2 * n);
  const __mmask16 lo = static_cast<__mmask16>(out), hi = static_cast<__mmask16>(out >> 16);
  _mm512_mask_storeu_ps(g0 + 2 * q, lo, _mm512_maskz_permutexvar_ps(static_cast<__mmask16>(top), left, g));
  _mm512_mask_storeu_ps(g0 + 2 * q + 16, hi, _mm512_maskz_permutexvar_ps(static_cast<__mmask16>(top >> 16), right, g));
  _mm512_mask_storeu_ps(g1 + 2 * q, lo, _mm512_maskz_permutexvar_ps(static_cast<__mmask16>(bottom), left, g));
  _mm512_mask_storeu_ps(g1 + 2 * q + 16, hi,
                        _mm512_maskz_permutexvar_ps(static_cast<__mmask16>(bottom >> 16), right, g));
}

/// Every output row of `planes` planes (H x W in, P x Q out, contiguous) of a 2x2 pool,
/// 16 windows at a time through Block (pool_block: bfloat16 bits after a ReLU;
/// pool_block_f32).
template <typename T, void (*Block)(const T*, const T*, T*, std::uint8_t*, i64, i64)>
DP_AVX512_TARGET void pool_planes(const T* x, T* y, std::uint8_t* where, i64 planes, i64 H, i64 W, i64 P, i64 Q) {
  for (i64 pl = 0; pl < planes; ++pl)
    for (i64 p = 0; p < P; ++p) {
      const T* r0 = x + pl * H * W + 2 * p * W;
      const i64 o = (pl * P + p) * Q;
      for (i64 q = 0; q < Q; q += 16) Block(r0, r0 + W, y + o, where + o, q, std::min<i64>(16, Q - q));
    }
}

/// The input gradient of those planes, every element written once: 16 windows at a time
/// through Block (backward_block<kMask>, backward_block_f32<kMask>), zeros in an odd last
/// column and row. ry (the mask) is read only when kMask.
template <typename T, bool kMask, void (*Block)(const T*, const std::uint8_t*, const T*, T*, T*, i64, i64)>
DP_AVX512_TARGET void backward_planes(const T* gy, const std::uint8_t* where, const T* ry, T* gx, i64 planes, i64 H,
                                      i64 W, i64 P, i64 Q) {
  for (i64 pl = 0; pl < planes; ++pl) {
    T* gp = gx + pl * H * W;
    for (i64 p = 0; p < P; ++p) {
      T* g0 = gp + 2 * p * W;
      T* g1 = g0 + W;
      const i64 o = (pl * P + p) * Q;
      for (i64 q = 0; q < Q; q += 16)
        Block(gy + o, where + o, kMask ? ry + o : nullptr, g0, g1, q, std::min<i64>(16, Q - q));
      for (i64 w = 2 * Q; w < W; ++w) g0[w] = g1[w] = T{};  // an odd last column: +0
    }
    for (i64 i = 2 * P * W; i < H * W; ++i) gp[i] = T{};  // an odd last row
  }
}

/// Whether this CPU has the AVX-512 subsets the pools use.
bool cpu_has_avx512() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}
#endif

/// Whether the AVX-512 paths are wanted: unless DP_CPU_POOL_AVX512=0, or set_pool_avx512(false).
std::atomic<bool>& avx512_wanted() {
  static std::atomic<bool> wanted = [] {
    const char* env = std::getenv("DP_CPU_POOL_AVX512");
    return !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return wanted;
}

/// Whether the pools run in AVX-512 (Note [bfloat16 max-pool in AVX-512], Note [float32
/// max-pool in AVX-512]).
bool use_avx512() {
#if defined(DP_POOL_AVX512)
  return avx512_wanted().load(std::memory_order_relaxed) && cpu_has_avx512();
#else
  return false;
#endif
}

}  // namespace

void maxpool_2x2_bf16(const std::uint16_t* x, std::uint16_t* y, std::uint8_t* where, std::int64_t planes,
                      std::int64_t H, std::int64_t W, std::int64_t P, std::int64_t Q, bool relu) {
#if defined(DP_POOL_AVX512)
  // The ReLU's pool is the convolution's one pass (Note [Convolution, ReLU and max-pool
  // in one pass]), over a group still in L2; a plain pool streams its planes from
  // memory, where the AVX-512 loop measured slower (Note [bfloat16 max-pool in AVX-512]).
  if (relu && use_avx512()) return pool_planes<u16, &pool_block>(x, y, where, planes, H, W, P, Q);
#endif
  maxpool_2x2_bf16_clones(x, y, where, planes, H, W, P, Q, relu);
}

void maxpool_2x2_backward_bf16(const std::uint16_t* gy, const std::uint8_t* where, const std::uint16_t* relu_y,
                               std::uint16_t* gx, std::int64_t planes, std::int64_t H, std::int64_t W, std::int64_t P,
                               std::int64_t Q) {
#if defined(DP_POOL_AVX512)
  if (use_avx512()) {
    if (relu_y) {
      backward_planes<u16, true, &backward_block<true>>(gy, where, relu_y, gx, planes, H, W, P, Q);
    } else {
      backward_planes<u16, false, &backward_block<false>>(gy, where, nullptr, gx, planes, H, W, P, Q);
    }
    return;
  }
#endif
  maxpool_2x2_backward_bf16_clones(gy, where, relu_y, gx, planes, H, W, P, Q);
}


bool maxpool_2x2_avx512(const float* x, float* y, std::uint8_t* where, std::int64_t planes, std::int64_t H,
                        std::int64_t W, std::int64_t P, std::int64_t Q) {
#if defined(DP_POOL_AVX512)
  if (use_avx512()) {
    pool_planes<float, &pool_block_f32>(x, y, where, planes, H, W, P, Q);
    return true;
  }
#endif
  return false;
}

bool maxpool_2x2_backward_avx512(const float* gy, const std::uint8_t* where, const float* relu_y, float* gx,
                                 std::int64_t planes, std::int64_t H, std::int64_t W, std::int64_t P,
                                 std::int64_t Q) {
#if defined(DP_POOL_AVX512)
  if (use_avx512()) {
    if (relu_y) {
      backward_planes<float, true, &backward_block_f32<true>>(gy, where, relu_y, gx, planes, H, W, P, Q);
    } else {
      backward_planes<float, false, &backward_block_f32<false>>(gy, where, nullptr, gx, planes, H, W, P, Q);
    }
    return true;
  }
#endif
  return false;
}

bool set_pool_avx512(bool on) { return avx512_wanted().exchange(on, std::memory_order_relaxed); }

bool pool_avx512() { return use_avx512(); }

}  // namespace dp::backend::cpu
