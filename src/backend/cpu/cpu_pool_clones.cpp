// CPU backend: the bfloat16 2x2 max-pool on the dtype's bits, forward (with the ReLU
// of a convolution before it) and backward (with the ReLU's mask), with ISA clones.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_backend.h"

namespace dp::backend::cpu {

// Note [bfloat16 max-pool on its bits]
// A 2x2 window's maximum is one of its four inputs, and its gradient is the output's
// gradient or zero: neither needs float32 storage. Widening each plane into a float32
// block, pooling it there and rounding it back (Note [16-bit max-pool]) cost a
// bfloat16 CNN step as much time in the widening and rounding loops as in the pool
// itself, and made the bfloat16 pool slower than the float32 one on half the bytes
// (figures: docs/benchmarks/kernel-notes.md, "bfloat16 max-pool on its bits"). Here
// each element is widened in a register (the bits shifted up: exact), compared as the
// float32 kernels compare (Note [Branch-free 2x2 max-pool]: the first maximum in
// row-major window order wins, a NaN wins over numbers and the first NaN stays), and
// the winner's own bits are stored — what rounding the widened winner gives back, but
// for a NaN, which rounding turns into 0xFFFF (Note [16-bit NaNs] in dp/core/half.h)
// and so is stored as 0xFFFF here too. The ReLU of a convolution's output (Note
// [Convolution, ReLU and max-pool in one pass]) is applied to each input as it is
// loaded, as relu_in_place writes it: a negative number becomes +0, a NaN 0xFFFF,
// everything else (-0 included) stays. Backward writes each window's gradient, masked
// by the pool's output > 0 when asked (Binary<ReluBackward> on the widened values: the
// bits 0x0001..0x7F80), at its place and +0 elsewhere, a NaN as 0xFFFF. So forward,
// winners and backward are the bits the float32 kernels give on the widened planes,
// rounded (cpu_backend_test and nn's functional_test compare them). A row runs in
// vectors of 8 windows (4 on a row narrower than 8; the CNN's rows are 14 and 7
// windows wide, too narrow for a compiler's loop over them to reach its vector body),
// the last vector moved back to end at the row's end as in Note [Branch-free 2x2
// max-pool]; the x86-64-v3 and -v4 clones run them in AVX2 registers, the baseline in
// SSE pairs, all with the same bits (integer selects and exact compares). Where the
// CPU has AVX-512BW, cpu_pool_avx512.cpp runs them instead, with the same bits (Note
// [bfloat16 max-pool in AVX-512]).

namespace {

// The helpers below pass 256-bit vectors by value; they are always inlined into the
// clones, so no call of theirs has an ABI for GCC to warn about in the baseline clone.
#pragma GCC diagnostic ignored "-Wpsabi"

using i64 = std::int64_t;
using u16 = std::uint16_t;

/// V lanes of 32-bit words, floats, 16-bit words and bytes (GCC/Clang vector extensions,
/// as the float32 kernels' f32x4: each clone compiles them for its ISA). Spelled out
/// per width: GCC 12's __builtin_convertvector rejects vector types whose size depends
/// on a template parameter.
template <int V>
struct Lanes;
template <>
struct Lanes<8> {
  using u32 = std::uint32_t __attribute__((vector_size(32)));
  using i32 = std::int32_t __attribute__((vector_size(32)));
  using f32 = float __attribute__((vector_size(32)));
  using h16 = std::uint16_t __attribute__((vector_size(16)));
  using u8 = std::uint8_t __attribute__((vector_size(8)));
};
template <>
struct Lanes<4> {
  using u32 = std::uint32_t __attribute__((vector_size(16)));
  using i32 = std::int32_t __attribute__((vector_size(16)));
  using f32 = float __attribute__((vector_size(16)));
  using h16 = std::uint16_t __attribute__((vector_size(8)));
  using u8 = std::uint8_t __attribute__((vector_size(4)));
};

template <typename To, typename From>
[[gnu::always_inline]] inline To bit_cast_vec(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}

template <typename T>
[[gnu::always_inline]] inline T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// Lanes where the widened bfloat16 bits w (the 16 bits above 16 zeros) are a NaN.
template <int V>
[[gnu::always_inline]] inline typename Lanes<V>::i32 nan_lanes(typename Lanes<V>::u32 w) {
  using L = Lanes<V>;
  return bit_cast_vec<typename L::i32>(w & 0x7FFFFFFFu) > 0x7F800000;
}

/// relu_in_place's value of widened bfloat16 bits, in integers (Note [bfloat16 max-pool
/// on its bits]): a negative number +0, a NaN 0xFFFF, everything else (-0 too) kept.
template <int V>
[[gnu::always_inline]] inline typename Lanes<V>::u32 relu_lanes(typename Lanes<V>::u32 w) {
  using L = Lanes<V>;
  const typename L::i32 s = bit_cast_vec<typename L::i32>(w);
  const typename L::u32 negative = bit_cast_vec<typename L::u32>((s < 0) & ((s & 0x7FFFFFFF) != 0));
  const typename L::u32 nan = bit_cast_vec<typename L::u32>(nan_lanes<V>(w));
  return (nan & 0xFFFF0000u) | (~nan & ~negative & w);
}

/// V windows from q on of one output row (rows r0, r1 of the input): the winners'
/// bits in y, their places in `where`. Each 32-bit load holds a window's two columns
/// of one row, the left one in its low half (little-endian), so widening is a shift or
/// a mask and no shuffle is needed.
template <int V, bool kRelu>
[[gnu::always_inline]] inline void pool_windows(const u16* r0, const u16* r1, u16* y, std::uint8_t* where, i64 q) {
  using L = Lanes<V>;
  using u32 = typename L::u32;
  using i32 = typename L::i32;
  using f32 = typename L::f32;
  const u32 top = load<u32>(r0 + 2 * q), bottom = load<u32>(r1 + 2 * q);
  u32 w[4] = {top << 16, top & 0xFFFF0000u, bottom << 16, bottom & 0xFFFF0000u};  // tl, tr, bl, br
  if constexpr (kRelu)
    for (u32& v : w) v = relu_lanes<V>(v);
  u32 best = w[0];
  i32 place = {};
  for (int k = 1; k < 4; ++k) {
    const f32 v = bit_cast_vec<f32>(w[k]), b = bit_cast_vec<f32>(best);
    const i32 take = (v > b) | ((v != v) & (b == b));  // larger, or the first NaN
    const u32 t = bit_cast_vec<u32>(take);
    best = (t & w[k]) | (~t & best);
    place = (take & k) | (~take & place);
  }
  const u32 nan = bit_cast_vec<u32>(nan_lanes<V>(best));
  const u32 out = (nan & 0xFFFFu) | (~nan & (best >> 16));
  const typename L::h16 bits = __builtin_convertvector(out, typename L::h16);
  const typename L::u8 places = __builtin_convertvector(place, typename L::u8);
  std::memcpy(y + q, &bits, sizeof bits);
  std::memcpy(where + q, &places, sizeof places);
}

/// V windows from q on of the input gradient: each window's gradient (masked by ry > 0
/// when kMask) at its place in rows g0 and g1, +0 elsewhere, a NaN as 0xFFFF.
template <int V, bool kMask>
[[gnu::always_inline]] inline void backward_windows(const u16* gy, const std::uint8_t* wp, const u16* ry, u16* g0,
                                                    u16* g1, i64 q) {
  using L = Lanes<V>;
  using u32 = typename L::u32;
  using i32 = typename L::i32;
  u32 g = __builtin_convertvector(load<typename L::h16>(gy + q), u32);
  if constexpr (kMask) {
    const i32 y = __builtin_convertvector(load<typename L::h16>(ry + q), i32);
    g &= bit_cast_vec<u32>((y >= 1) & (y <= 0x7F80));  // y > 0: the bits 0x0001..0x7F80
  }
  const i32 nan = bit_cast_vec<i32>(g & 0x7FFFu) > 0x7F80;
  g = (bit_cast_vec<u32>(nan) & 0xFFFFu) | (~bit_cast_vec<u32>(nan) & g);
  const i32 k = __builtin_convertvector(load<typename L::u8>(wp + q), i32);
  // The left column in the low half of each 32-bit word.
  const u32 top = (bit_cast_vec<u32>(k == 0) & g) | ((bit_cast_vec<u32>(k == 1) & g) << 16);
  const u32 bottom = (bit_cast_vec<u32>(k == 2) & g) | ((bit_cast_vec<u32>(k == 3) & g) << 16);
  std::memcpy(g0 + 2 * q, &top, sizeof top);
  std::memcpy(g1 + 2 * q, &bottom, sizeof bottom);
}

/// One window q, as pool_windows computes it: rows narrower than four windows.
template <bool kRelu>
[[gnu::always_inline]] inline void pool_window(const u16* r0, const u16* r1, u16* y, std::uint8_t* where, i64 q) {
  std::uint32_t w[4] = {std::uint32_t{r0[2 * q]} << 16, std::uint32_t{r0[2 * q + 1]} << 16,
                        std::uint32_t{r1[2 * q]} << 16, std::uint32_t{r1[2 * q + 1]} << 16};
  auto is_nan = [](std::uint32_t v) { return (v & 0x7FFFFFFFu) > 0x7F800000u; };
  if constexpr (kRelu)
    for (std::uint32_t& v : w) v = is_nan(v) ? 0xFFFF0000u : (v >> 31) && (v & 0x7FFFFFFFu) ? 0u : v;
  std::uint32_t best = w[0];
  std::uint8_t place = 0;
  for (std::uint8_t k = 1; k < 4; ++k) {
    const float v = bit_cast_vec<float>(w[k]), b = bit_cast_vec<float>(best);
    if (v > b || (v != v && b == b)) {  // larger, or the first NaN
      best = w[k];
      place = k;
    }
  }
  y[q] = is_nan(best) ? u16{0xFFFF} : static_cast<u16>(best >> 16);
  where[q] = place;
}

/// One window q, as backward_windows computes it.
template <bool kMask>
[[gnu::always_inline]] inline void backward_window(const u16* gy, const std::uint8_t* wp, const u16* ry, u16* g0,
                                                   u16* g1, i64 q) {
  u16 g = gy[q];
  if constexpr (kMask) g = ry[q] >= 1 && ry[q] <= 0x7F80 ? g : u16{0};
  g = (g & 0x7FFFu) > 0x7F80u ? u16{0xFFFF} : g;
  const std::uint8_t k = wp[q];
  g0[2 * q] = k == 0 ? g : u16{0};
  g0[2 * q + 1] = k == 1 ? g : u16{0};
  g1[2 * q] = k == 2 ? g : u16{0};
  g1[2 * q + 1] = k == 3 ? g : u16{0};
}

/// Windows [0, Q) of a row: vectors of 8 windows, or of 4 on a narrower row,
/// the last vector moved back to end at Q (overlapping: the same values written twice),
/// one window at a time on a row narrower than 4.
template <typename F8, typename F4, typename F1>
[[gnu::always_inline]] inline void over_row(i64 Q, F8 eight, F4 four, F1 one) {
  if (Q >= 8) {
    i64 q = 0;
    for (; q + 8 <= Q; q += 8) eight(q);
    if (q < Q) eight(Q - 8);
  } else if (Q >= 4) {
    four(0);
    if (Q > 4) four(Q - 4);
  } else {
    for (i64 q = 0; q < Q; ++q) one(q);
  }
}

template <bool kRelu>
[[gnu::always_inline]] inline void pool_planes(const u16* x, u16* y, std::uint8_t* where, i64 planes, i64 H, i64 W,
                                               i64 P, i64 Q) {
  for (i64 pl = 0; pl < planes; ++pl)
    for (i64 p = 0; p < P; ++p) {
      const u16* r0 = x + pl * H * W + 2 * p * W;
      const u16* r1 = r0 + W;
      const i64 o = (pl * P + p) * Q;
      over_row(
          Q, [&](i64 q) { pool_windows<8, kRelu>(r0, r1, y + o, where + o, q); },
          [&](i64 q) { pool_windows<4, kRelu>(r0, r1, y + o, where + o, q); },
          [&](i64 q) { pool_window<kRelu>(r0, r1, y + o, where + o, q); });
    }
}

template <bool kMask>
[[gnu::always_inline]] inline void backward_planes(const u16* gy, const std::uint8_t* where, const u16* ry, u16* gx,
                                                   i64 planes, i64 H, i64 W, i64 P, i64 Q) {
  for (i64 pl = 0; pl < planes; ++pl) {
    u16* gp = gx + pl * H * W;
    for (i64 p = 0; p < P; ++p) {
      u16* g0 = gp + 2 * p * W;
      u16* g1 = g0 + W;
      const i64 o = (pl * P + p) * Q;
      const u16* rr = kMask ? ry + o : nullptr;
      over_row(
          Q, [&](i64 q) { backward_windows<8, kMask>(gy + o, where + o, rr, g0, g1, q); },
          [&](i64 q) { backward_windows<4, kMask>(gy + o, where + o, rr, g0, g1, q); },
          [&](i64 q) { backward_window<kMask>(gy + o, where + o, rr, g0, g1, q); });
      for (i64 w = 2 * Q; w < W; ++w) g0[w] = g1[w] = 0;  // an odd last column
    }
    for (i64 i = 2 * P * W; i < H * W; ++i) gp[i] = 0;  // an odd last row
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES void maxpool_2x2_bf16_clones(const std::uint16_t* x, std::uint16_t* y, std::uint8_t* where,
                                          std::int64_t planes, std::int64_t H, std::int64_t W, std::int64_t P,
                                                 std::int64_t Q, bool relu) {
  if (relu) {
    pool_planes<true>(x, y, where, planes, H, W, P, Q);
  } else {
    pool_planes<false>(x, y, where, planes, H, W, P, Q);
  }
}

DP_CPU_V4_V3_CLONES void maxpool_2x2_backward_bf16_clones(const std::uint16_t* gy, const std::uint8_t* where,
                                                   const std::uint16_t* relu_y, std::uint16_t* gx,
                                                   std::int64_t planes, std::int64_t H, std::int64_t W,
                                                   std::int64_t P, std::int64_t Q) {
  if (relu_y) {
    backward_planes<true>(gy, where, relu_y, gx, planes, H, W, P, Q);
  } else {
    backward_planes<false>(gy, where, nullptr, gx, planes, H, W, P, Q);
  }
}

}  // namespace dp::backend::cpu
