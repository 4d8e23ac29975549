// src/backend/mma_attention.h — the bfloat16 attention forward on mma.sync tensor-core
// instructions (Note [Attention on mma fragments]), written so that the host can run it:
// the CUDA backend's kernel calls these bodies, and tests/backend/mma_attention_test.cpp
// runs the same bodies for a simulated warp of 32 lanes. Internal; plain C++ with DP_HD
// bodies and no CUDA headers (the device's few instructions are inline PTX).
//
//   mma_attention::WarpState st[kWarps];       // the host: every warp of a block
//   mma_attention::load_rows(q_s, q, i0, L, E, 0, 1);
//   mma_attention::warp_begin(st[w], q_s, w);
#pragma once

#include <cstdint>
#include <cstring>

#include "backend/functors.h"  // DP_HD, MaxOp's NaN rule in max_nan below

#include <cmath>  // expf, logf: the host's, and on the device CUDA's

#if !defined(__CUDA_ARCH__)
#include "dp/core/half.h"
#endif

namespace dp::backend::mma_attention {

// Note [Attention on mma fragments]
// The forward (and, below, the backward) of a bfloat16 attention without mask or dropout
// (a GPT's under autocast) in FlashAttention-2's shape: a block of 4 warps owns 64 query
// rows, 16 a warp; the keys and values are walked in tiles of 64 through shared memory;
// and a warp's scores, weights and output accumulator never leave its registers. That is what the PTX
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
//    zero-padded past E or Ev, then 8 of padding so that the 8 rows an ldmatrix phase
//    reads fall on different banks): 27 KiB a block, where the WMMA forward needs 79.
//    The second operands come from the tiles by ldmatrix.x4, four 8 × 8 matrices an
//    instruction: untransposed for a tile whose rows are the product's n (kᵀ in q kᵀ),
//    transposed for one whose rows are its k (v in P·V), which hands each lane exactly
//    its B fragment's pairs.
//  - Simulation: a lane's values are Lanes<T>, one T on the device (the thread's own lane)
//    and 32 on the host; the cross-lane steps (mma, xor-shuffle) take Lanes of the whole
//    warp. The host runs a block's phases in the kernel's order — the tile loads for all
//    threads, then each warp's step — so the kernel's own arithmetic, indexing and
//    fragment bookkeeping are what the test checks against a reference. The host's mma
//    multiplies in float in k order; the hardware's order differs, within the tolerance.
//    The host's mma and ldmatrix follow the PTX ISA's layouts; they are the one part a
//    GPU has to confirm (cuda_attention_test).

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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint16_t r;  // the instruction __float2bfloat16_rn is, without the CUDA headers here
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
#elif defined(__CUDA_ARCH__)
  __trap();  // bfloat16 conversions need sm_80; never chosen below it
  return 0;
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

/// r[i] = lane's part of four 8 × 8 bfloat16 matrices in shared memory, as ldmatrix.x4
/// loads them: lane l names row l % 8 of matrix l / 8 (row(l): a pointer to its 8
/// elements, 16-byte aligned). Without `trans`, lane l receives row l / 4, elements
/// 2(l % 4) and 2(l % 4) + 1 of each matrix (an A or C row pair); with `trans`, rows
/// 2(l % 4) and 2(l % 4) + 1 of column l / 4 (a B fragment's pair from a row-major
/// matrix whose rows are its k).
template <bool kTrans, typename Row>
DP_HD inline void ldmatrix_x4(Lanes<std::uint32_t[4]>& r, Row row) {
#if defined(__CUDA_ARCH__)
  const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row(lane_of(0))));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0][0]), "=r"(r[0][1]), "=r"(r[0][2]), "=r"(r[0][3])
                 : "r"(at));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0][0]), "=r"(r[0][1]), "=r"(r[0][2]), "=r"(r[0][3])
                 : "r"(at));
  }
#else
  for (int i = 0; i < 4; ++i)
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l & 3;
      if constexpr (kTrans) {
        r[l][i] = pack(row(8 * i + 2 * t)[g], row(8 * i + 2 * t + 1)[g]);
      } else {
        r[l][i] = pack(row(8 * i + g)[2 * t], row(8 * i + g)[2 * t + 1]);
      }
    }
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

// ---- a warp's fragment steps ---------------------------------------------------------------

using FragA = Lanes<std::uint32_t[4]>;  // 16 × 16 bfloat16
using FragB = Lanes<std::uint32_t[2]>;  // 16 × 8 bfloat16
using FragC = Lanes<float[4]>;          // 16 × 8 float

/// a[ks] = the warp's 16 rows row0 .. row0 + 15 of a shared tile (kLd apart), columns
/// 16ks .. 16ks + 15, as A fragments.
DP_HD inline void load_a(FragA (&a)[kSteps], const std::uint16_t* tile, int row0) {
  for (int l = 0; l < kSimLanes; ++l) {
    const int g = lane_of(l) >> 2, t = lane_of(l) & 3;
    const std::uint16_t* r0 = tile + (row0 + g) * kLd;
    const std::uint16_t* r8 = r0 + 8 * kLd;
    DP_UNROLL
    for (int ks = 0; ks < kSteps; ++ks) {
      a[ks][l][0] = load_word(r0 + ks * 16 + 2 * t);
      a[ks][l][1] = load_word(r8 + ks * 16 + 2 * t);
      a[ks][l][2] = load_word(r0 + ks * 16 + 2 * t + 8);
      a[ks][l][3] = load_word(r8 + ks * 16 + 2 * t + 8);
    }
  }
}

DP_HD inline void zero(FragC (&c)[kKeyTiles]) {
  DP_UNROLL
  for (int nt = 0; nt < kKeyTiles; ++nt)
    for (int l = 0; l < kSimLanes; ++l)
      for (int e = 0; e < 4; ++e) c[nt][l][e] = 0.0f;
}

/// c = a · bᵀ: the warp's 16 rows (A fragments over the head dim) against the 64 rows of
/// the shared tile b, one 16 × 8 block of dot products per 8 rows of b.
DP_HD inline void dots(FragC (&c)[kKeyTiles], const FragA (&a)[kSteps], const std::uint16_t* b_tile) {
  zero(c);
  DP_UNROLL
  for (int nt = 0; nt < kKeyTiles; nt += 2) {
    DP_UNROLL
    for (int ks = 0; ks < kSteps; ++ks) {
      // bᵀ of column blocks nt and nt + 1: column g of block n is row n·8 + g of the tile,
      // its k the tile's columns 16ks .. 16ks + 15 — four 8 × 8 matrices, untransposed.
      Lanes<std::uint32_t[4]> r;
      ldmatrix_x4<false>(r, [&](int lane) {
        const int m = lane >> 3;
        return b_tile + ((nt + (m >> 1)) * 8 + (lane & 7)) * kLd + ks * 16 + (m & 1) * 8;
      });
      FragB b0, b1;
      for (int l = 0; l < kSimLanes; ++l) {
        b0[l][0] = r[l][0];
        b0[l][1] = r[l][1];
        b1[l][0] = r[l][2];
        b1[l][1] = r[l][3];
      }
      mma(c[nt], a[ks], b0);
      mma(c[nt + 1], a[ks], b1);
    }
  }
}

/// acc += w · x: the warp's 16 × 64 weights w (in the C layout of dots) times the 64 rows
/// of the shared tile x, each weight split in hi = bf16(w) and lo = bf16(w − hi) (Note
/// [Attention on mma fragments]). Weights of column blocks 2kk and 2kk + 1 are, register
/// for register, the A fragment of k-step kk.
DP_HD inline void weights_times(FragC (&acc)[kDimTiles], const FragC (&w)[kKeyTiles], const std::uint16_t* x_tile) {
  DP_UNROLL
  for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
    FragA a_hi, a_lo;
    for (int l = 0; l < kSimLanes; ++l) {
      const float* w0 = w[2 * kk][l];
      const float* w1 = w[2 * kk + 1][l];
      const float v[8] = {w0[0], w0[1], w0[2], w0[3], w1[0], w1[1], w1[2], w1[3]};
      std::uint16_t h16[8], l16[8];
      for (int e = 0; e < 8; ++e) {
        h16[e] = bf16_bits(v[e]);
        l16[e] = bf16_bits(v[e] - bf16_value(h16[e]));
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
    for (int nt = 0; nt < kDimTiles; nt += 2) {
      // x's rows 16kk .. 16kk + 15 (the k) of column blocks nt and nt + 1: four 8 × 8
      // matrices, transposed into B fragments (rows 2t, 2t + 1 and 2t + 8, 2t + 9 of
      // column g).
      Lanes<std::uint32_t[4]> r;
      ldmatrix_x4<true>(r, [&](int lane) {
        const int m = lane >> 3;
        return x_tile + (kk * 16 + (m & 1) * 8 + (lane & 7)) * kLd + (nt + (m >> 1)) * 8;
      });
      FragB b0, b1;
      for (int l = 0; l < kSimLanes; ++l) {
        b0[l][0] = r[l][0];
        b0[l][1] = r[l][1];
        b1[l][0] = r[l][2];
        b1[l][1] = r[l][3];
      }
      mma(acc[nt], a_hi, b0);
      mma(acc[nt], a_lo, b0);
      mma(acc[nt + 1], a_hi, b1);
      mma(acc[nt + 1], a_lo, b1);
    }
  }
}

/// Element e of a lane's C fragment of column block nt lies at row g + 8 (e / 2) and
/// column nt·8 + 2t + e % 2 of the warp's 16 × 64 block.
DP_HD inline int c_row(int l, int e) { return (lane_of(l) >> 2) + 8 * (e >> 1); }
DP_HD inline int c_col(int l, int nt, int e) { return nt * 8 + 2 * (lane_of(l) & 3) + (e & 1); }

/// Whether query i attends to key j: both exist and, when causal, j <= i.
DP_HD inline bool attends(const Shape& p, i64 i, i64 j) { return i < p.L && j < p.S && !(p.causal && j > i); }

/// rows (row-major, `width` apart, n of them) first .. first + 15 = factor · acc, rounded
/// once; columns past `width` are the padding.
DP_HD inline void store_rows(std::uint16_t* dst, const FragC (&acc)[kDimTiles], i64 first, i64 n, int width,
                             float factor) {
  for (int l = 0; l < kSimLanes; ++l) {
    DP_UNROLL
    for (int nt = 0; nt < kDimTiles; ++nt)
      for (int e = 0; e < 4; ++e) {
        const i64 r = first + c_row(l, e);
        const int c = c_col(l, nt, e);
        if (r < n && c < width) dst[r * width + c] = bf16_bits(factor * acc[nt][l][e]);
      }
  }
}

// ---- a warp's part of the forward --------------------------------------------------------------

/// What a warp carries from one key tile to the next.
struct WarpState {
  FragA q[kSteps];      // its 16 query rows as A fragments, by 16 columns
  FragC o[kDimTiles];   // the output accumulator, by 8 columns
  Lanes<float> m[2], l[2];  // rows g and g + 8: running maximum and sum of weights
};

/// The warp's query fragments from the block's query tile, and an empty accumulator.
DP_HD inline void warp_begin(WarpState& st, const std::uint16_t* q_s, int warp) {
  load_a(st.q, q_s, warp * kRows);
  zero(st.o);
  for (int l = 0; l < kSimLanes; ++l)
    for (int h = 0; h < 2; ++h) {
      st.m[h][l] = kNegInf;
      st.l[h][l] = 0.0f;
    }
}

/// One key tile (keys j0 .. j0 + 63: k_s and v_s, row-major, kLd apart) for the warp's
/// rows first .. first + 15: the scores, the online softmax, and o += P·V.
DP_HD inline void warp_tile(WarpState& st, const Shape& p, const std::uint16_t* k_s, const std::uint16_t* v_s,
                            i64 first, i64 j0) {
  FragC s[kKeyTiles];
  dots(s, st.q, k_s);
  // Scale and mask, each row's new maximum (its group's 4 lanes), the weights and their sum.
  Lanes<float> tile_max[2], m_new[2], sum[2];
  for (int l = 0; l < kSimLanes; ++l) {
    for (int h = 0; h < 2; ++h) tile_max[h][l] = kNegInf;
    DP_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
      for (int e = 0; e < 4; ++e) {
        const float x = attends(p, first + c_row(l, e), j0 + c_col(l, nt, e)) ? p.scale * s[nt][l][e] : kNegInf;
        s[nt][l][e] = x;
        tile_max[e >> 1][l] = max_nan(tile_max[e >> 1][l], x);
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
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        // No key attended yet: no weight.
        const float w = m_new[h][l] == kNegInf ? 0.0f : expf(s[nt][l][e] - m_new[h][l]);
        s[nt][l][e] = w;
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
      const float correction = expf(st.m[h][l] - m_new[h][l]);  // 0 on the first tile attended
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
  weights_times(st.o, s, v_s);  // o += P·V
}

/// The warp's rows of out (row-major (L, Ev) of this problem, bfloat16) and lse: o / l
/// rounded once, and m + log l; a row with every key masked gets 0 and +inf.
DP_HD inline void warp_finish(const WarpState& st, const Shape& p, std::uint16_t* out, float* lse, i64 first) {
  for (int l = 0; l < kSimLanes; ++l) {
    const int t = lane_of(l) & 3;
    for (int h = 0; h < 2; ++h) {
      const i64 i = first + c_row(l, 2 * h);
      if (i >= p.L) continue;
      const float sum = st.l[h][l];
      DP_UNROLL
      for (int nt = 0; nt < kDimTiles; ++nt)
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          const int d = c_col(l, nt, e);
          if (d < p.Ev) out[i * p.Ev + d] = bf16_bits(sum == 0.0f ? 0.0f : st.o[nt][l][e] / sum);
        }
      if (t == 0) lse[i] = sum == 0.0f ? __builtin_huge_valf() : st.m[h][l] + logf(sum);
    }
  }
}

// ---- the backward: a warp's part of dK and dV, and of dQ ----------------------------------------
// The backward of Note [Attention on mma fragments], in the outline of the WMMA kernels
// (Note [Attention on tensor cores]): Δ_i = gout_i · out_i is given, P = exp(scale·s −
// lse), dS = P ∘ (dP − Δ) with dP = gout · vᵀ, and
//  - a block of 64 keys walks the query tiles: Sᵀ = k qᵀ and dPᵀ = v goutᵀ (the warp's 16
//    keys as A fragments), dV += Pᵀ gout and dK += dSᵀ q (the weights split in hi and lo);
//  - a block of 64 queries walks the key tiles: S = q kᵀ, dP = gout vᵀ, dQ += dS k.
// Each sum runs in a fixed order (no atomics), and dK and dQ are scaled once as stored.

/// What a warp carries across the walk of the dK/dV kernel (its 16 keys).
struct KeysState {
  FragA k[kSteps], v[kSteps];
  FragC dk[kDimTiles], dv[kDimTiles];
};

DP_HD inline void keys_begin(KeysState& st, const std::uint16_t* k_s, const std::uint16_t* v_s, int warp) {
  load_a(st.k, k_s, warp * kRows);
  load_a(st.v, v_s, warp * kRows);
  zero(st.dk);
  zero(st.dv);
}

/// One query tile (queries i0 .. i0 + 63: q_s and g_s, their lse and Δ in lse_s and
/// delta_s) for the warp's keys first .. first + 15.
DP_HD inline void keys_tile(KeysState& st, const Shape& p, const std::uint16_t* q_s, const std::uint16_t* g_s,
                            const float* lse_s, const float* delta_s, i64 first, i64 i0) {
  FragC w[kKeyTiles], dp[kKeyTiles];
  dots(w, st.k, q_s);  // Sᵀ: the warp's keys × the tile's queries
  for (int l = 0; l < kSimLanes; ++l) {
    DP_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int col = c_col(l, nt, e);
        w[nt][l][e] = attends(p, i0 + col, first + c_row(l, e)) ? expf(p.scale * w[nt][l][e] - lse_s[col]) : 0.0f;
      }
  }
  weights_times(st.dv, w, g_s);  // dV += Pᵀ gout
  dots(dp, st.v, g_s);           // dPᵀ = v goutᵀ
  for (int l = 0; l < kSimLanes; ++l) {
    DP_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int col = c_col(l, nt, e);
        // P is 0 where query i does not attend (and dP − Δ is finite there): dS is 0.
        dp[nt][l][e] = attends(p, i0 + col, first + c_row(l, e)) ? w[nt][l][e] * (dp[nt][l][e] - delta_s[col]) : 0.0f;
      }
  }
  weights_times(st.dk, dp, q_s);  // dK += dSᵀ q (unscaled)
}

/// What a warp carries across the walk of the dQ kernel (its 16 queries).
struct QueriesState {
  FragA q[kSteps], g[kSteps];
  FragC dq[kDimTiles];
  Lanes<float> lse[2], delta[2];  // rows g and g + 8
};

DP_HD inline void queries_begin(QueriesState& st, const Shape& p, const std::uint16_t* q_s, const std::uint16_t* g_s,
                                const float* lse, const float* delta, int warp, i64 first) {
  load_a(st.q, q_s, warp * kRows);
  load_a(st.g, g_s, warp * kRows);
  zero(st.dq);
  for (int l = 0; l < kSimLanes; ++l)
    for (int h = 0; h < 2; ++h) {
      const i64 i = first + c_row(l, 2 * h);
      st.lse[h][l] = i < p.L ? lse[i] : 0.0f;
      st.delta[h][l] = i < p.L ? delta[i] : 0.0f;
    }
}

/// One key tile (keys j0 .. j0 + 63: k_s and v_s) for the warp's queries first .. first + 15.
DP_HD inline void queries_tile(QueriesState& st, const Shape& p, const std::uint16_t* k_s, const std::uint16_t* v_s,
                               i64 first, i64 j0) {
  FragC w[kKeyTiles], dp[kKeyTiles];
  dots(w, st.q, k_s);  // S
  dots(dp, st.g, v_s);  // dP = gout vᵀ
  for (int l = 0; l < kSimLanes; ++l) {
    DP_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1;
        const bool on = attends(p, first + c_row(l, e), j0 + c_col(l, nt, e));
        const float pw = on ? expf(p.scale * w[nt][l][e] - st.lse[h][l]) : 0.0f;
        w[nt][l][e] = on ? pw * (dp[nt][l][e] - st.delta[h][l]) : 0.0f;
      }
  }
  weights_times(st.dq, w, k_s);  // dQ += dS k (unscaled)
}

/// lse_s and delta_s (kTile each) = the rows i0 .. i0 + 63 of lse and Δ, 0 past row L.
/// Thread tid of nthreads.
DP_HD inline void load_row_stats(float* lse_s, float* delta_s, const float* lse, const float* delta, i64 i0, i64 L,
                                 int tid, int nthreads) {
  for (int r = tid; r < kTile; r += nthreads) {
    lse_s[r] = i0 + r < L ? lse[i0 + r] : 0.0f;
    delta_s[r] = i0 + r < L ? delta[i0 + r] : 0.0f;
  }
}

/// Whether the warp's keys first .. first + 15 are attended by no query of the tile at i0.
DP_HD inline bool keys_skip(const Shape& p, i64 first, i64 i0) {
  return first >= p.S || (p.causal && first > i0 + kTile - 1);
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
