// src/backend/mma_attention.h — the bfloat16 attention forward on mma.sync tensor-core
// instructions (Note [Attention on mma fragments]), written so that the host can run it:
// the CUDA backend's kernel calls these bodies, and tests/backend/mma_attention_test.cpp
// runs the same bodies for a simulated warp of 32 lanes. Internal; plain C++ with DP_HD
// bodies, no CUDA headers outside __CUDACC__.
//
//   mma_attention::WarpState st[kWarps];       // the host: every warp of a block
//   mma_attention::load_rows(q_s, q, i0, L, E, 0, 1);
//   mma_attention::warp_begin(st[w], q_s, w);
#pragma once

#include <cstdint>
#include <cstring>

#include "backend/functors.h"  // DP_HD, MaxOp's NaN rule in max_nan below

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif
#if !defined(__CUDA_ARCH__)
#include <cmath>

#include "dp/core/half.h"
#endif

namespace dp::backend::mma_attention {

// Note [Attention on mma fragments]
// The forward of a bfloat16 attention without mask or dropout (a GPT's under autocast)
// in FlashAttention-2's shape: a block of 4 warps owns 64 query rows, 16 a warp; the
// keys and values are walked in tiles of 64 through shared memory; and a warp's scores,
// weights and output accumulator never leave its registers. That is what the PTX
// instruction mma.sync.m16n8k16 allows and WMMA does not: its fragment layout is
// documented (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// With g = lane / 4 and t = lane % 4, a lane holds
//  - of A (16 × 16, row-major), in 4 registers of two bfloat16 each: rows g and g + 8,
//    columns 2t, 2t + 1 and 2t + 8, 2t + 9 (registers: (g, 2t), (g + 8, 2t), (g, 2t + 8),
//    (g + 8, 2t + 8), the lower column in the low half);
//  - of B (16 × 8, "col"), in 2 registers: column g, rows 2t, 2t + 1 and 2t + 8, 2t + 9;
//  - of C and D (16 × 8 float): rows g and g + 8, columns 2t and 2t + 1 (c0, c1 of row g,
//    c2, c3 of row g + 8).
// So a row of the scores S = q kᵀ (16 × 64 a warp: 8 tiles of 8 keys) lies on the 4
// lanes of one group, 16 values each: its maximum and sum take two xor-shuffles. And the
// accumulator layout of two adjacent key tiles is, register for register, the A layout
// of a 16 × 16 block of weights: P = exp(S − m) goes into the second product P·V
// without a trip through memory.
//  - Precision: P is an MMA operand and must be bfloat16. As in Note [Attention on tensor
//    cores], each weight is split into hi = bf16(w) and lo = bf16(w − hi) and both
//    products are accumulated (16 bits of each weight's mantissa).
//  - Order: each lane sums its 16 weights of a row in a fixed order, then the group adds
//    the four partial sums by xor-shuffles 1 and 2, which gives every lane of the group
//    the same bits ((a + b) + (c + d) in every order the shuffles produce, addition being
//    commutative). The tensor cores' own summation order is fixed by the hardware. So the
//    results are bitwise reproducible run to run; they differ from the WMMA kernels' in
//    the last bits.
//  - Shared memory: the query, key and value tiles, 64 rows of 72 bfloat16 (64 columns,
//    zero-padded past E or Ev, then 8 of padding so that the 8 groups' rows fall on
//    different banks): 27 KiB a block, where the WMMA forward needs 79.
//  - Simulation: a lane's values are Lanes<T>, one T on the device (the thread's own lane)
//    and 32 on the host; the cross-lane steps (mma, xor-shuffle) take Lanes of the whole
//    warp. The host runs a block's phases in the kernel's order — the tile loads for all
//    threads, then each warp's step — so the kernel's own arithmetic, indexing and
//    fragment bookkeeping are what the test checks against a reference. The host's mma
//    multiplies in float in k order; the hardware's order differs, within the tolerance.

using i64 = std::int64_t;

// The device's loops over fragments unroll, so that every fragment index is a constant
// and the fragments stay in registers; the host's need not.
#if defined(__CUDA_ARCH__)
#define DP_UNROLL _Pragma("unroll")
#else
#define DP_UNROLL
#endif

#if defined(__CUDA_ARCH__)
inline constexpr int kSimLanes = 1;  // a thread holds its own lane
#else
inline constexpr int kSimLanes = 32;  // the host holds the whole warp
#endif

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;              // a warp's query rows: one fragment's height
constexpr int kTile = kWarps * kRows;  // a block's query rows, and the key tile walked
constexpr int kD = 64;                 // head dims up to 64, zero-padded
constexpr int kLd = kD + 8;            // bfloat16 elements between rows of a shared tile
constexpr int kTileElems = kTile * kLd;
constexpr int kKeyTiles = kTile / 8;   // 8-key column tiles of a warp's scores
constexpr int kDimTiles = kD / 8;      // 8-column tiles of a warp's output
constexpr int kSteps = kD / 16;        // k-steps of 16 over the head dim
/// Dynamic shared memory of the forward: the query, key and value tiles.
constexpr std::size_t kForwardSmem = 3 * static_cast<std::size_t>(kTileElems) * 2;

/// The geometry of one call (the problems are B·H of them, each (L, E), (S, E), (S, Ev)).
struct Shape {
  i64 L, S;
  int E, Ev;
  float scale;
  bool causal;
};

/// Per-lane values of a warp: the thread's own on the device, all 32 on the host.
template <typename T>
struct Lanes {
  T v[kSimLanes];
  DP_HD T& operator[](int l) { return v[l]; }
  DP_HD const T& operator[](int l) const { return v[l]; }
};

/// The warp lane that slot l of a Lanes stands for.
DP_HD inline int lane_of(int l) {
#if defined(__CUDA_ARCH__)
  (void)l;
  return static_cast<int>(threadIdx.x) & 31;
#else
  return l;
#endif
}

// ---- bfloat16 bits --------------------------------------------------------------------------

/// x rounded to the nearest bfloat16, ties to even, as bits.
DP_HD inline std::uint16_t bf16_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  return dp::BFloat16(x).bits;
#endif
}
/// The value of bfloat16 bits (exact).
DP_HD inline float bf16_value(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
/// Two bfloat16 in one register, `lo` in the low half (the lower column or row).
DP_HD inline std::uint32_t pack(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}
/// The 32-bit word at p (two bfloat16; p 4-byte aligned).
DP_HD inline std::uint32_t load_word(const std::uint16_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const std::uint32_t*>(p);
#else
  std::uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
#endif
}

DP_HD inline float exp_f(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
DP_HD inline float log_f(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}
/// The larger of a and b, NaN winning (MaxOp's rule, as torch.max).
DP_HD inline float max_nan(float a, float b) { return (a != a || a > b) ? a : b; }
struct MaxNan {
  DP_HD float operator()(float a, float b) const { return max_nan(a, b); }
};
struct Plus {
  DP_HD float operator()(float a, float b) const { return a + b; }
};

constexpr float kNegInf = -__builtin_huge_valf();

// ---- the warp's cross-lane steps --------------------------------------------------------------

/// d += a · b over a warp: A 16 × 16 and B 16 × 8 bfloat16, C and D 16 × 8 float, in the
/// fragment layouts of Note [Attention on mma fragments].
DP_HD inline void mma(Lanes<float[4]>& d, const Lanes<std::uint32_t[4]>& a, const Lanes<std::uint32_t[2]>& b) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
      : "r"(a[0][0]), "r"(a[0][1]), "r"(a[0][2]), "r"(a[0][3]), "r"(b[0][0]), "r"(b[0][1]));
#else
  __trap();  // bfloat16 mma needs sm_80; never chosen below it
#endif
#else
  float A[16][16], B[16][8], C[16][8];
  auto lo = [](std::uint32_t w) { return bf16_value(static_cast<std::uint16_t>(w & 0xFFFFu)); };
  auto hi = [](std::uint32_t w) { return bf16_value(static_cast<std::uint16_t>(w >> 16)); };
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    A[g][2 * t] = lo(a[l][0]);
    A[g][2 * t + 1] = hi(a[l][0]);
    A[g + 8][2 * t] = lo(a[l][1]);
    A[g + 8][2 * t + 1] = hi(a[l][1]);
    A[g][2 * t + 8] = lo(a[l][2]);
    A[g][2 * t + 9] = hi(a[l][2]);
    A[g + 8][2 * t + 8] = lo(a[l][3]);
    A[g + 8][2 * t + 9] = hi(a[l][3]);
    B[2 * t][g] = lo(b[l][0]);
    B[2 * t + 1][g] = hi(b[l][0]);
    B[2 * t + 8][g] = lo(b[l][1]);
    B[2 * t + 9][g] = hi(b[l][1]);
    C[g][2 * t] = d[l][0];
    C[g][2 * t + 1] = d[l][1];
    C[g + 8][2 * t] = d[l][2];
    C[g + 8][2 * t + 1] = d[l][3];
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c) {
      float acc = C[r][c];
      for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][c];
      C[r][c] = acc;
    }
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    d[l][0] = C[g][2 * t];
    d[l][1] = C[g][2 * t + 1];
    d[l][2] = C[g + 8][2 * t];
    d[l][3] = C[g + 8][2 * t + 1];
  }
#endif
}

/// v = f(v, v of lane ^ mask) in every lane of the warp.
template <typename F>
DP_HD inline void xor_combine(Lanes<float>& v, int mask, F f) {
#if defined(__CUDA_ARCH__)
  v[0] = f(v[0], __shfl_xor_sync(0xffffffffu, v[0], mask));
#else
  const Lanes<float> old = v;
  for (int l = 0; l < 32; ++l) v[l] = f(old[l], old[l ^ mask]);
#endif
}

// ---- the block's tile loads (every thread of the block; the host: tid 0 of 1) ----------------

/// Rows [row0, row0 + kTile) of a row-major (n, width) bfloat16 matrix into dst, kLd
/// apart; zeros past row n and past column width. Thread tid of nthreads.
DP_HD inline void load_rows(std::uint16_t* dst, const std::uint16_t* src, i64 row0, i64 n, int width, int tid,
                            int nthreads) {
  if (width == kD) {  // whole rows: 8 pieces of 16 bytes each (src 16-byte aligned: checked by the caller)
    for (int at = tid; at < kTile * 8; at += nthreads) {
      const int r = at / 8, c = at % 8;
      const i64 row = row0 + r;
#if defined(__CUDA_ARCH__)
      uint4 piece = make_uint4(0u, 0u, 0u, 0u);
      if (row < n) piece = *reinterpret_cast<const uint4*>(src + row * kD + c * 8);
      *reinterpret_cast<uint4*>(dst + r * kLd + c * 8) = piece;  // 144-byte rows: 16-byte aligned
#else
      std::uint16_t piece[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (row < n) std::memcpy(piece, src + row * kD + c * 8, sizeof piece);
      std::memcpy(dst + r * kLd + c * 8, piece, sizeof piece);
#endif
    }
    return;
  }
  for (int at = tid; at < kTile * kD; at += nthreads) {
    const int r = at / kD, c = at % kD;
    const i64 row = row0 + r;
    dst[r * kLd + c] = row < n && c < width ? src[row * width + c] : std::uint16_t{0};
  }
}

// ---- a warp's part of the forward --------------------------------------------------------------

/// What a warp carries from one key tile to the next.
struct WarpState {
  Lanes<std::uint32_t[4]> q[kSteps];  // its 16 query rows as A fragments, by 16 columns
  Lanes<float[4]> o[kDimTiles];       // the output accumulator, by 8 columns
  Lanes<float> m[2], l[2];            // rows g and g + 8: running maximum and sum of weights
};

/// The warp's query fragments from the block's query tile, and an empty accumulator.
DP_HD inline void warp_begin(WarpState& st, const std::uint16_t* q_s, int warp) {
  for (int l = 0; l < kSimLanes; ++l) {
    const int g = lane_of(l) >> 2, t = lane_of(l) & 3;
    const std::uint16_t* r0 = q_s + (warp * kRows + g) * kLd;
    const std::uint16_t* r8 = r0 + 8 * kLd;
DP_UNROLL
    for (int ks = 0; ks < kSteps; ++ks) {
      st.q[ks][l][0] = load_word(r0 + ks * 16 + 2 * t);
      st.q[ks][l][1] = load_word(r8 + ks * 16 + 2 * t);
      st.q[ks][l][2] = load_word(r0 + ks * 16 + 2 * t + 8);
      st.q[ks][l][3] = load_word(r8 + ks * 16 + 2 * t + 8);
    }
DP_UNROLL
    for (int nt = 0; nt < kDimTiles; ++nt)
      for (int c = 0; c < 4; ++c) st.o[nt][l][c] = 0.0f;
    for (int h = 0; h < 2; ++h) {
      st.m[h][l] = kNegInf;
      st.l[h][l] = 0.0f;
    }
  }
}

/// One key tile (keys j0 .. j0 + 63: k_s and v_s, row-major, kLd apart) for the warp's
/// rows first .. first + 15: the scores, the online softmax, and o += P·V.
DP_HD inline void warp_tile(WarpState& st, const Shape& p, const std::uint16_t* k_s, const std::uint16_t* v_s,
                            i64 first, i64 j0) {
  // The scores: 8 key tiles of 8, over the head dim in steps of 16.
  Lanes<float[4]> s[kKeyTiles];
DP_UNROLL
  for (int nt = 0; nt < kKeyTiles; ++nt) {
    for (int l = 0; l < kSimLanes; ++l)
      for (int c = 0; c < 4; ++c) s[nt][l][c] = 0.0f;
DP_UNROLL
    for (int ks = 0; ks < kSteps; ++ks) {
      Lanes<std::uint32_t[2]> b;  // kᵀ: column g of the tile is key nt·8 + g
      for (int l = 0; l < kSimLanes; ++l) {
        const int g = lane_of(l) >> 2, t = lane_of(l) & 3;
        const std::uint16_t* kr = k_s + (nt * 8 + g) * kLd + ks * 16 + 2 * t;
        b[l][0] = load_word(kr);
        b[l][1] = load_word(kr + 8);
      }
      mma(s[nt], st.q[ks], b);
    }
  }
  // Scale and mask, each row's new maximum (its group's 4 lanes), the weights and their sum.
  Lanes<float> tile_max[2], m_new[2], sum[2];
  for (int l = 0; l < kSimLanes; ++l) {
    const int g = lane_of(l) >> 2, t = lane_of(l) & 3;
    for (int h = 0; h < 2; ++h) tile_max[h][l] = kNegInf;
DP_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
      for (int c = 0; c < 4; ++c) {
        const int h = c >> 1;
        const i64 i = first + g + 8 * h, j = j0 + nt * 8 + 2 * t + (c & 1);
        const bool attends = i < p.L && j < p.S && !(p.causal && j > i);
        const float x = attends ? p.scale * s[nt][l][c] : kNegInf;
        s[nt][l][c] = x;
        tile_max[h][l] = max_nan(tile_max[h][l], x);
      }
  }
  for (int h = 0; h < 2; ++h) {
    xor_combine(tile_max[h], 1, MaxNan{});
    xor_combine(tile_max[h], 2, MaxNan{});
  }
  for (int l = 0; l < kSimLanes; ++l) {
    for (int h = 0; h < 2; ++h) {
      m_new[h][l] = max_nan(tile_max[h][l], st.m[h][l]);
      sum[h][l] = 0.0f;
    }
DP_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
      for (int c = 0; c < 4; ++c) {
        const int h = c >> 1;
        // No key attended yet: no weight.
        const float w = m_new[h][l] == kNegInf ? 0.0f : exp_f(s[nt][l][c] - m_new[h][l]);
        s[nt][l][c] = w;
        sum[h][l] += w;
      }
  }
  for (int h = 0; h < 2; ++h) {
    xor_combine(sum[h], 1, Plus{});
    xor_combine(sum[h], 2, Plus{});
  }
  for (int l = 0; l < kSimLanes; ++l)
    for (int h = 0; h < 2; ++h) {
      if (m_new[h][l] == kNegInf) continue;
      const float correction = exp_f(st.m[h][l] - m_new[h][l]);  // 0 on the first tile attended
      st.l[h][l] = st.l[h][l] * correction + sum[h][l];
      st.m[h][l] = m_new[h][l];
      if (correction != 1.0f) {
DP_UNROLL
        for (int nt = 0; nt < kDimTiles; ++nt) {
          st.o[nt][l][2 * h] *= correction;
          st.o[nt][l][2 * h + 1] *= correction;
        }
      }
    }
  // o += P·V over the 64 keys in steps of 16: the weights of key tiles 2kk and 2kk + 1
  // are the A fragment, split in hi and lo; V's rows are the k dimension.
DP_UNROLL
  for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
    Lanes<std::uint32_t[4]> a_hi, a_lo;
    for (int l = 0; l < kSimLanes; ++l) {
      const float* w0 = s[2 * kk][l];
      const float* w1 = s[2 * kk + 1][l];
      const float w[8] = {w0[0], w0[1], w0[2], w0[3], w1[0], w1[1], w1[2], w1[3]};
      std::uint16_t h16[8], l16[8];
      for (int e = 0; e < 8; ++e) {
        h16[e] = bf16_bits(w[e]);
        l16[e] = bf16_bits(w[e] - bf16_value(h16[e]));
      }
      // Registers: (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8), each with its right neighbour.
      a_hi[l][0] = pack(h16[0], h16[1]);
      a_hi[l][1] = pack(h16[2], h16[3]);
      a_hi[l][2] = pack(h16[4], h16[5]);
      a_hi[l][3] = pack(h16[6], h16[7]);
      a_lo[l][0] = pack(l16[0], l16[1]);
      a_lo[l][1] = pack(l16[2], l16[3]);
      a_lo[l][2] = pack(l16[4], l16[5]);
      a_lo[l][3] = pack(l16[6], l16[7]);
    }
DP_UNROLL
    for (int nt = 0; nt < kDimTiles; ++nt) {
      Lanes<std::uint32_t[2]> b;  // V: rows (keys) 16kk + 2t, +1 and +8, +9 of column nt·8 + g
      for (int l = 0; l < kSimLanes; ++l) {
        const int g = lane_of(l) >> 2, t = lane_of(l) & 3;
        const std::uint16_t* vc = v_s + (kk * 16 + 2 * t) * kLd + nt * 8 + g;
        b[l][0] = pack(vc[0], vc[kLd]);
        b[l][1] = pack(vc[8 * kLd], vc[9 * kLd]);
      }
      mma(st.o[nt], a_hi, b);
      mma(st.o[nt], a_lo, b);
    }
  }
}

/// The warp's rows of out (row-major (L, Ev) of this problem, bfloat16) and lse: o / l
/// rounded once, and m + log l; a row with every key masked gets 0 and +inf.
DP_HD inline void warp_finish(const WarpState& st, const Shape& p, std::uint16_t* out, float* lse, i64 first) {
  for (int l = 0; l < kSimLanes; ++l) {
    const int g = lane_of(l) >> 2, t = lane_of(l) & 3;
    for (int h = 0; h < 2; ++h) {
      const i64 i = first + g + 8 * h;
      if (i >= p.L) continue;
      const float sum = st.l[h][l];
DP_UNROLL
      for (int nt = 0; nt < kDimTiles; ++nt)
        for (int e = 0; e < 2; ++e) {
          const int d = nt * 8 + 2 * t + e;
          if (d < p.Ev) out[i * p.Ev + d] = bf16_bits(sum == 0.0f ? 0.0f : st.o[nt][l][2 * h + e] / sum);
        }
      if (t == 0) lse[i] = sum == 0.0f ? __builtin_huge_valf() : st.m[h][l] + log_f(sum);
    }
  }
}

/// The key tiles a block of query rows i0 .. i0 + 63 walks: up to `end` keys.
DP_HD inline i64 keys_end(const Shape& p, i64 i0) {
  if (!p.causal) return p.S;
  const i64 last = i0 + kTile < p.L ? i0 + kTile : p.L;  // one past the block's last row
  return last < p.S ? last : p.S;
}

/// Whether the warp's rows first .. first + 15 attend to no key of the tile at j0.
DP_HD inline bool warp_skips(const Shape& p, i64 first, i64 j0) {
  return first >= p.L || (p.causal && j0 > first + kRows - 1);
}

}  // namespace dp::backend::mma_attention
