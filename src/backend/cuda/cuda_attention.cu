// CUDA backend: fused (blockwise, "flash") scaled-dot-product attention, forward and
// backward, float32, bfloat16 and float16, with masks and dropout.
//
// Note [Fused attention on CUDA]
// The op is the CPU kernel's (AttentionForwardArgs in ops.h, Note [Fused attention] in
// src/backend/cpu/cpu_attention.cpp): the same inputs, the same lse saved for the
// backward, the same masks, the same dropped weights, the same values to rounding. The
// kernels follow FlashAttention-2's outline (Dao, 2023) on CUDA cores:
//  - Geometry. A block is 4 warps and owns 32 rows of one (b, h) problem — queries in
//    the forward and in dQ, keys in dK/dV — 8 per warp; it walks the other side in
//    tiles of 32, one row per lane. The tiles sit in shared memory widened to float32,
//    each row padded to kD + 4 floats (kD: 64 or 128, the head dims E and Ev rounded
//    up): 16-byte aligned for float4 reads, and a lane reading its own row with them
//    hits 4 banks no other lane of its quarter-warp does. Each float4 a lane reads
//    from its own row feeds the FMAs of its warp's 8 rows, read from shared memory as
//    broadcasts; the products are plain float32 FMAs, no tensor cores (TF32 would round
//    float32 inputs to 10 bits, and P·V in 16 bits would round P, which the CPU kernel
//    keeps in float32). Head dims above 128 are refused (Backend::attention_shape_misfit):
//    scaled_dot_product_attention then runs the math path.
//  - Forward: per key tile, lane j scores its key against its warp's 8 queries (scale
//    q·k, the mask, causal: the CPU's order), the warp reduces each row's maximum and
//    sum of exp(s − m) with shuffles (so m and l are the same on every lane), rescales
//    the output accumulator by exp(m_old − m_new), drops (after the sum: l is undropped),
//    writes the row's weights to the warp's shared row, and adds P·V, each lane owning
//    the output dims lane + 32c. out = acc / l and lse = m + log l. A NaN score wins
//    the row's maximum, as the reduction lets it, so it reaches out and lse as on the
//    CPU. Causal: key tiles past the block's last query are never loaded, the rows of
//    the last tile past it load as zeros (a weight of 0 times an infinite key or value
//    nobody attends would be a NaN), and a warp whose 8 queries all precede a tile
//    skips it; blocks are launched longest rows first.
//  - Backward: Δ_i = gout_i · out_i (a warp per row) into scratch; then two kernels
//    that recompute the tile's probabilities P = exp(s − lse) and dP = gout vᵀ and form
//    dS = P ∘ (dP ∘ Z − Δ): one block per 32 keys walks the query tiles (from its first
//    key on when causal) summing dV += (P ∘ Z)ᵀ gout and dK += dSᵀ q, one block per 32
//    queries walks the key tiles summing dQ += dS k. Each gradient element is summed by
//    one thread in a fixed order — no atomics — so gradients are bitwise reproducible
//    run to run and independent of the launch, as the CPU kernel's (which the DP, DDP
//    and sharded designs' equality relies on); the price is the scores and dP computed
//    twice, as on the CPU. A float32 atomicAdd of each tile's dQ (FlashAttention-2's
//    choice) would save that but add in the order the blocks happen to finish.
//  - Dropout: weight (b, h, i, j) is kept when uniform_from(seed, offset + ((b·H + h)·L
//    + i)·S + j) >= p — the dropout op's draw (Note [Counter-based random numbers]),
//    which the CPU fused kernel and the dropout op on either backend make too: the same
//    keep bits, bit for bit, across CPU and CUDA, the math path and the fused one. The
//    forward and both backward kernels draw it again where they need it; nothing stored.
//  - 16-bit storage: q, k, v, gout (and a mask of the call's dtype) are widened when
//    loaded; scores, m, l, lse, Δ and every accumulator are float32; out, gq, gk, gv
//    are rounded once, when stored. A row whose every key is masked gives out = 0 and
//    lse = +inf, and no gradient, as the CPU kernel and the math path (Note [Rows with
//    every key masked] in src/nn/functional_sequence.cpp).
//  - Memory: lse (B·H·L floats) is the forward's only saving besides out, Δ (B·H·L
//    floats) the backward's scratch. Shared memory per block: 53.5 KiB (forward), 74.25
//    (dK/dV) and 70 (dQ) at kD = 128, 29.5, 42.25 and 38 at kD = 64; above the 48 KiB a
//    block gets by default the launch opts in (cudaFuncSetAttribute), and a GPU that
//    allows less (Turing: 64 KiB) is refused for kD = 128, which then runs the math path.
// The sums run in other orders than the CPU kernel's (warp trees, tiles of 32, FMAs),
// so the two agree to float32 rounding, not bit for bit (tests/cuda/cuda_attention_test.cpp).
// bfloat16 calls with no mask and no dropout and head dims up to 64 (a GPT's under
// autocast) take tensor-core kernels instead: Note [Attention on tensor cores] below.
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_half.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_register.h"
#include "backend/functors.h"
#include "backend/mma_attention.h"
#include "dp/core/error.h"

namespace dp::backend::cuda_kernels {
namespace {

using i64 = std::int64_t;

// ---- kernels ------------------------------------------------------------------------------

constexpr int kWarps = 4;  // per block: 128 threads
constexpr int kThreads = kWarps * kWarp;
// The rows a warp owns: each float4 a lane reads feeds 8 rows' FMAs (32 FMAs per 9
// shared loads), and 8 rows' accumulators (8 · kD / 32 floats a lane, twice in dK/dV)
// stay in registers.
constexpr int kRowsPerWarp = 8;
constexpr int kTile = kWarps * kRowsPerWarp;  // rows a block owns; the other side's tile
static_assert(kTile == kWarp, "a tile of the other side has one row per lane");
constexpr int kMaxHeadDim = 128;
constexpr float kNegInf = -__builtin_huge_valf();

/// Floats between rows of a shared tile of kD columns (Note [Fused attention on CUDA]).
constexpr int row_stride(int kD) { return kD + 4; }

/// n rounded up to a multiple of 4: the dot products read float4s of zero-padded rows.
__device__ __forceinline__ int round4(int n) { return (n + 3) / 4 * 4; }

__device__ __forceinline__ i64 min64(i64 a, i64 b) { return a < b ? a : b; }

/// One call's geometry and options, by value into every kernel.
struct Params {
  i64 H, L, S;
  int E, Ev;
  i64 tiles;  // row tiles of kTile per (b, h): the grid has B·H·tiles blocks
  float scale;
  bool causal;
  const void* mask;  // null, or (B, H, L, S) strided by msb, msh, msl, mss elements
  bool mask_f32;     // float32, else the call's dtype
  bool keep;         // a 0/1 keep-mask, else additive
  i64 msb, msh, msl, mss;
  float drop_p;      // 0: no dropout
  float drop_scale;  // 1 / (1 - p), the dropout op's
  std::uint64_t seed, offset;
};

/// The block's dynamic shared memory as floats (16-byte aligned: float4 reads).
__device__ __forceinline__ float* shared_floats() {
  extern __shared__ float4 attention_shared[];
  return reinterpret_cast<float*>(attention_shared);
}

/// Whether query i attends to key j at all: both exist and, when causal, j <= i. The
/// weight of a pair that does not is exactly 0 (the CPU kernel's zero fill), never
/// exp(-inf - lse) of a masked score (NaN were lse -inf).
__device__ __forceinline__ bool attends(const Params& p, i64 i, i64 j) {
  return i < p.L && j < p.S && !(p.causal && j > i);
}

/// The score of query i and key j of problem bh from dot = q_i · k_j: scale · dot, then
/// the mask (added, or -inf where a keep-mask is 0), as the CPU's block_scores.
template <typename T>
__device__ __forceinline__ float masked_score(const Params& p, i64 bh, i64 i, i64 j, float dot) {
  float x = p.scale * dot;
  if (p.mask) {
    const i64 at = bh / p.H * p.msb + bh % p.H * p.msh + i * p.msl + j * p.mss;
    const float m = p.mask_f32 ? static_cast<const float*>(p.mask)[at] : load_acc(static_cast<const T*>(p.mask)[at]);
    x = p.keep ? (m != 0.0f ? x : kNegInf) : x + m;
  }
  return x;
}

/// Z of weight (bh, i, j): 1 / (1 - p) where the dropout op's draw keeps it, else 0.
__device__ __forceinline__ float drop_factor(const Params& p, i64 bh, i64 i, i64 j) {
  const std::uint64_t at = p.offset + static_cast<std::uint64_t>((bh * p.L + i) * p.S + j);
  return uniform_from(p.seed, at) >= p.drop_p ? p.drop_scale : 0.0f;
}

/// Rows [row0, row0 + kTile) of a row-major (n, width) matrix into dst, rows
/// row_stride(kD) apart, widened to float32; zeros past row n and past column width.
template <int kD, typename T>
__device__ void load_tile(float* dst, const T* src, i64 row0, i64 n, int width) {
  for (int at = threadIdx.x; at < kTile * kD; at += kThreads) {
    const int r = at / kD, c = at % kD;
    const i64 row = row0 + r;
    dst[r * row_stride(kD) + c] = row < n && c < width ? load_acc(src[row * width + c]) : 0.0f;
  }
}

/// acc[r] += a_r · b over the first n4 floats (a multiple of 4): a holds the warp's
/// kRowsPerWarp rows (broadcast reads), b is the lane's own row.
template <int kD>
__device__ __forceinline__ void dots(const float* a, const float* b, int n4, float (&acc)[kRowsPerWarp]) {
  for (int d = 0; d < n4; d += 4) {
    const float4 y = *reinterpret_cast<const float4*>(b + d);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float4 x = *reinterpret_cast<const float4*>(a + r * row_stride(kD) + d);
      acc[r] = fmaf(x.x, y.x, acc[r]);
      acc[r] = fmaf(x.y, y.y, acc[r]);
      acc[r] = fmaf(x.z, y.z, acc[r]);
      acc[r] = fmaf(x.w, y.w, acc[r]);
    }
  }
}

/// acc[r][c] += Σ_{t < n} w[r][t] · x[t][lane + 32c]: the warp's weights w
/// (kRowsPerWarp rows of kTile floats, broadcast reads) times the rows of a tile x,
/// each lane its own columns. Reads t up to n rounded up to 4: callers keep those
/// weights 0 and those rows finite.
template <int kD>
__device__ __forceinline__ void accumulate(const float* w, const float* x, int n,
                                           float (&acc)[kRowsPerWarp][kD / kWarp]) {
  const int lane = threadIdx.x % kWarp;
  constexpr int kS = row_stride(kD);
  for (int t = 0; t < n; t += 4) {
    float4 wt[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) wt[r] = *reinterpret_cast<const float4*>(w + r * kTile + t);
#pragma unroll
    for (int c = 0; c < kD / kWarp; ++c) {
      const float* xc = x + t * kS + c * kWarp + lane;
      const float x0 = xc[0], x1 = xc[kS], x2 = xc[2 * kS], x3 = xc[3 * kS];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        acc[r][c] = fmaf(wt[r].x, x0, acc[r][c]);
        acc[r][c] = fmaf(wt[r].y, x1, acc[r][c]);
        acc[r][c] = fmaf(wt[r].z, x2, acc[r][c]);
        acc[r][c] = fmaf(wt[r].w, x3, acc[r][c]);
      }
    }
  }
}

/// Reduces each v[r] over the warp's lanes; every lane gets the results (the same bits:
/// each step combines the same two values on both lanes of a pair).
template <typename Op>
__device__ __forceinline__ void warp_reduce_rows(float (&v)[kRowsPerWarp], Op op) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) v[r] = op(v[r], __shfl_xor_sync(0xffffffffu, v[r], offset));
  }
}

template <int kD>
__device__ __forceinline__ void zero(float (&acc)[kRowsPerWarp][kD / kWarp]) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int c = 0; c < kD / kWarp; ++c) acc[r][c] = 0.0f;
  }
}

/// Running state of a warp's queries in the forward: maximum m and sum l of each row
/// (the same on every lane) and the output accumulator (the lane's columns).
template <int kD>
struct RowState {
  float m[kRowsPerWarp], l[kRowsPerWarp];
  float acc[kRowsPerWarp][kD / kWarp];
};

/// The forward's step over one key tile [j0, j0 + kTile) for the warp's queries
/// [first, first + kRowsPerWarp) (rows q_w of the block's query tile); p_w: the warp's
/// weight rows; n: the tile's keys below the block's end (Note [Fused attention on CUDA]).
template <typename T, int kD>
__device__ __forceinline__ void forward_tile(const Params& p, i64 bh, i64 first, i64 j0, int n, const float* q_w,
                                             const float* k_s, const float* v_s, float* p_w, RowState<kD>& st) {
  const int lane = threadIdx.x % kWarp;
  const i64 j = j0 + lane;
  float s[kRowsPerWarp] = {};
  dots<kD>(q_w, k_s + lane * row_stride(kD), round4(p.E), s);
  float tile_max[kRowsPerWarp], w[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    s[r] = attends(p, first + r, j) ? masked_score<T>(p, bh, first + r, j, s[r]) : kNegInf;
    tile_max[r] = s[r];
  }
  warp_reduce_rows(tile_max, MaxOp{});
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    // Now the row's new maximum, NaN winning as in the reduction: fmaxf would drop a NaN
    // score of the row's first attended tile (m = -inf), and its output would be finite.
    tile_max[r] = MaxOp{}(tile_max[r], st.m[r]);
    // Nothing attended yet (m = -inf): no weight, no rescale. Else exp(-inf - m) = 0
    // for the masked keys.
    w[r] = tile_max[r] == kNegInf ? 0.0f : expf(s[r] - tile_max[r]);
    s[r] = w[r];
  }
  warp_reduce_rows(s, SumOp{});  // each row's sum over the tile
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (tile_max[r] != kNegInf) {  // the same on every lane
      const float correction = expf(st.m[r] - tile_max[r]);  // 0 on the first tile attended
      st.l[r] = st.l[r] * correction + s[r];
      st.m[r] = tile_max[r];
      if (correction != 1.0f) {
#pragma unroll
        for (int c = 0; c < kD / kWarp; ++c) st.acc[r][c] *= correction;
      }
      if (p.drop_p > 0.0f && w[r] != 0.0f) w[r] *= drop_factor(p, bh, first + r, j);  // after the sum
    }
    p_w[r * kTile + lane] = w[r];
  }
  __syncwarp();
  accumulate<kD>(p_w, v_s, n, st.acc);
  __syncwarp();  // p_w is written again by the next tile
}

/// out (B, H, L, Ev) and lse (B, H, L): a block per kTile queries of one (b, h).
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(Params p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             T* __restrict__ out, float* __restrict__ lse) {
  constexpr int kS = row_stride(kD);
  float* q_s = shared_floats();  // the block's queries
  float* k_s = q_s + kTile * kS;  // the key tile
  float* v_s = k_s + kTile * kS;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* p_w = v_s + kTile * kS + warp * kRowsPerWarp * kTile;  // the warp's weights
  const i64 bh = blockIdx.x / p.tiles;
  const i64 i0 = (p.tiles - 1 - blockIdx.x % p.tiles) * kTile;  // the longest causal rows first
  const i64 first = i0 + warp * kRowsPerWarp;                      // the warp's first query
  load_tile<kD>(q_s, q + bh * p.L * p.E, i0, p.L, p.E);
  RowState<kD> st;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    st.m[r] = kNegInf;
    st.l[r] = 0.0f;
  }
  zero<kD>(st.acc);
  // Causal: no query of the block attends past its last one.
  const i64 end = p.causal ? min64(p.S, min64(p.L, i0 + kTile)) : p.S;
  for (i64 j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the previous tile is read (and the queries are loaded)
    // Rows from `end` on are zeros, not keys: accumulate reads up to a multiple of 4 rows,
    // and a weight of 0 times an infinite value row nobody attends to would be a NaN.
    load_tile<kD>(k_s, k + bh * p.S * p.E, j0, end, p.E);
    load_tile<kD>(v_s, v + bh * p.S * p.Ev, j0, end, p.Ev);
    __syncthreads();
    if (first >= p.L || (p.causal && j0 > first + kRowsPerWarp - 1)) continue;  // the warp's rows attend to none
    forward_tile<T, kD>(p, bh, first, j0, static_cast<int>(min64(kTile, end - j0)), q_s + warp * kRowsPerWarp * kS,
                        k_s, v_s, p_w, st);
  }
  // A row with every key masked has l = 0 (and acc 0): out = 0, and lse = +inf, so that
  // the backward's probabilities exp(s - lse) are 0 on it, as on the CPU (Note [Rows
  // with every key masked] in src/nn/functional_sequence.cpp). A NaN score makes l NaN.
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const i64 i = first + r;
    if (i >= p.L) break;
    T* o = out + (bh * p.L + i) * p.Ev;
    const bool dead = st.l[r] == 0.0f;
#pragma unroll
    for (int c = 0; c < kD / kWarp; ++c) {
      const int d = c * kWarp + lane;
      if (d < p.Ev) o[d] = store_acc<T>(dead ? 0.0f : st.acc[r][c] / st.l[r]);
    }
    if (lane == 0) lse[bh * p.L + i] = dead ? INFINITY : st.m[r] + logf(st.l[r]);
  }
}

/// Δ_i = Σ_e gout[i, e] · out[i, e] for `rows` rows of Ev: a warp per row.
template <typename T>
__global__ void attention_delta_kernel(const T* __restrict__ out, const T* __restrict__ gout,
                                       float* __restrict__ delta, i64 rows, int Ev) {
  const int lane = threadIdx.x % kWarp;
  const i64 warps = grid_stride() / kWarp;
  for (i64 row = global_thread() / kWarp; row < rows; row += warps) {  // the same on every lane
    float sum = 0.0f;
    for (int c = lane; c < Ev; c += kWarp) sum = fmaf(load_acc(gout[row * Ev + c]), load_acc(out[row * Ev + c]), sum);
    sum = warp_reduce(sum, SumOp{});
    if (lane == 0) delta[row] = sum;
  }
}

/// The backward's weight (i, j) from its dot products qk = q_i · k_j and gv = gout_i ·
/// v_j: pz = P ∘ Z (what dV takes) and ds = P ∘ (dP ∘ Z − Δ) (dK's and dQ's), both 0
/// where query i does not attend to key j.
template <typename T>
__device__ __forceinline__ void weight_grads(const Params& p, i64 bh, i64 i, i64 j, float qk, float gv, float lse_i,
                                             float delta_i, float& pz, float& ds) {
  pz = 0.0f;
  ds = 0.0f;
  if (!attends(p, i, j)) return;
  const float prob = expf(masked_score<T>(p, bh, i, j, qk) - lse_i);
  const float z = p.drop_p > 0.0f ? drop_factor(p, bh, i, j) : 1.0f;
  pz = prob * z;
  ds = prob * (gv * z - delta_i);
}

/// Rows [first, first + kRowsPerWarp) of a row-major (n, width) gradient of T, each
/// lane its columns: factor · acc, rounded once.
template <int kD, typename T>
__device__ __forceinline__ void store_rows(T* dst, const float (&acc)[kRowsPerWarp][kD / kWarp], i64 first, i64 n,
                                           int width, float factor) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    if (first + r >= n) break;
#pragma unroll
    for (int c = 0; c < kD / kWarp; ++c) {
      const int d = c * kWarp + lane;
      if (d < width) dst[(first + r) * width + d] = store_acc<T>(factor * acc[r][c]);
    }
  }
}

/// lse and Δ of the query tile [i0, i0 + n) of one (b, h) into shared memory (0 past row L):
/// the keys kernels' per-tile statistics, one thread a row.
__device__ __forceinline__ void load_row_stats(int n, const float* lse, const float* delta, i64 i0, i64 L,
                                               float* lse_s, float* delta_s) {
  if (static_cast<int>(threadIdx.x) < n) {
    const i64 i = i0 + threadIdx.x;
    lse_s[threadIdx.x] = i < L ? lse[i] : 0.0f;
    delta_s[threadIdx.x] = i < L ? delta[i] : 0.0f;
  }
}

/// Row pointers of the backward kernels' tiles: the block's own kTile rows (two
/// matrices) and the tile of the other side it walks (two more), in shared memory.
struct BackwardTiles {
  float* own_a;
  float* own_b;
  float* walk_a;
  float* walk_b;
};

template <int kD>
__device__ __forceinline__ BackwardTiles backward_tiles() {
  float* s = shared_floats();
  constexpr int kSize = kTile * row_stride(kD);
  return {s, s + kSize, s + 2 * kSize, s + 3 * kSize};
}

/// dK (unscaled) and dV of the warp's keys [first, first + kRowsPerWarp) (rows k_w,
/// v_w) from the query tile [i0, i0 + kTile) (q_s, g_s: its rows of q and gout, lse_s
/// and delta_s its lse and Δ); pz_w, ds_w: the warp's weight rows.
template <typename T, int kD>
__device__ __forceinline__ void keys_tile(const Params& p, i64 bh, i64 first, i64 i0, const float* k_w,
                                          const float* v_w, const float* q_s, const float* g_s, const float* lse_s,
                                          const float* delta_s, float* pz_w, float* ds_w,
                                          float (&dk)[kRowsPerWarp][kD / kWarp],
                                          float (&dv)[kRowsPerWarp][kD / kWarp]) {
  const int lane = threadIdx.x % kWarp;
  const i64 i = i0 + lane;  // the lane's query
  float qk[kRowsPerWarp] = {}, gv[kRowsPerWarp] = {};
  dots<kD>(k_w, q_s + lane * row_stride(kD), round4(p.E), qk);
  dots<kD>(v_w, g_s + lane * row_stride(kD), round4(p.Ev), gv);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    weight_grads<T>(p, bh, i, first + r, qk[r], gv[r], lse_s[lane], delta_s[lane], pz_w[r * kTile + lane],
                    ds_w[r * kTile + lane]);
  __syncwarp();
  const int n = static_cast<int>(min64(kTile, p.L - i0));
  accumulate<kD>(pz_w, g_s, n, dv);
  accumulate<kD>(ds_w, q_s, n, dk);
  __syncwarp();  // the weights are written again by the next tile
}

/// gk and gv: a block per kTile keys of one (b, h), walking the query tiles.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads)
    attention_keys_kernel(Params p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          const T* __restrict__ gout, const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ gk, T* __restrict__ gv) {
  constexpr int kS = row_stride(kD);
  const BackwardTiles t = backward_tiles<kD>();  // own: k, v; walked: q, gout
  float* lse_s = t.walk_b + kTile * kS;
  float* delta_s = lse_s + kTile;
  const int warp = threadIdx.x / kWarp;
  float* pz_w = delta_s + kTile + warp * 2 * kRowsPerWarp * kTile;
  float* ds_w = pz_w + kRowsPerWarp * kTile;
  const i64 bh = blockIdx.x / p.tiles, j0 = blockIdx.x % p.tiles * kTile;
  const i64 first = j0 + warp * kRowsPerWarp;  // the warp's first key
  load_tile<kD>(t.own_a, k + bh * p.S * p.E, j0, p.S, p.E);
  load_tile<kD>(t.own_b, v + bh * p.S * p.Ev, j0, p.S, p.Ev);
  float dk[kRowsPerWarp][kD / kWarp], dv[kRowsPerWarp][kD / kWarp];
  zero<kD>(dk);
  zero<kD>(dv);
  // Causal: a query i < j0 attends to no key of the block.
  for (i64 i0 = p.causal ? j0 : 0; i0 < p.L; i0 += kTile) {
    __syncthreads();  // the previous tile is read (and the keys are loaded)
    load_tile<kD>(t.walk_a, q + bh * p.L * p.E, i0, p.L, p.E);
    load_tile<kD>(t.walk_b, gout + bh * p.L * p.Ev, i0, p.L, p.Ev);
    load_row_stats(kTile, lse + bh * p.L, delta + bh * p.L, i0, p.L, lse_s, delta_s);
    __syncthreads();
    if (first >= p.S || (p.causal && first > i0 + kTile - 1)) continue;  // the warp's keys attended by none
    keys_tile<T, kD>(p, bh, first, i0, t.own_a + warp * kRowsPerWarp * kS, t.own_b + warp * kRowsPerWarp * kS,
                     t.walk_a, t.walk_b, lse_s, delta_s, pz_w, ds_w, dk, dv);
  }
  store_rows<kD>(gk + bh * p.S * p.E, dk, first, p.S, p.E, p.scale);
  store_rows<kD>(gv + bh * p.S * p.Ev, dv, first, p.S, p.Ev, 1.0f);
}

/// gq: a block per kTile queries of one (b, h), walking the key tiles.
template <typename T, int kD>
__global__ void __launch_bounds__(kThreads)
    attention_queries_kernel(Params p, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const T* __restrict__ gout, const float* __restrict__ lse,
                             const float* __restrict__ delta, T* __restrict__ gq) {
  constexpr int kS = row_stride(kD);
  const BackwardTiles t = backward_tiles<kD>();  // own: q, gout; walked: k, v
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float* ds_w = t.walk_b + kTile * kS + warp * kRowsPerWarp * kTile;
  const i64 bh = blockIdx.x / p.tiles;
  const i64 i0 = (p.tiles - 1 - blockIdx.x % p.tiles) * kTile;  // the longest causal rows first
  const i64 first = i0 + warp * kRowsPerWarp;                      // the warp's first query
  load_tile<kD>(t.own_a, q + bh * p.L * p.E, i0, p.L, p.E);
  load_tile<kD>(t.own_b, gout + bh * p.L * p.Ev, i0, p.L, p.Ev);
  float lse_r[kRowsPerWarp], delta_r[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const i64 i = first + r;
    lse_r[r] = i < p.L ? lse[bh * p.L + i] : 0.0f;
    delta_r[r] = i < p.L ? delta[bh * p.L + i] : 0.0f;
  }
  float dq[kRowsPerWarp][kD / kWarp];
  zero<kD>(dq);
  const i64 end = p.causal ? min64(p.S, min64(p.L, i0 + kTile)) : p.S;
  for (i64 j0 = 0; j0 < end; j0 += kTile) {
    __syncthreads();  // the previous tile is read (and the queries are loaded)
    load_tile<kD>(t.walk_a, k + bh * p.S * p.E, j0, end, p.E);  // zeros from `end` on, as in the forward
    load_tile<kD>(t.walk_b, v + bh * p.S * p.Ev, j0, end, p.Ev);
    __syncthreads();
    if (first >= p.L || (p.causal && j0 > first + kRowsPerWarp - 1)) continue;  // the warp's rows attend to none
    const i64 j = j0 + lane;  // the lane's key
    float qk[kRowsPerWarp] = {}, gv[kRowsPerWarp] = {};
    dots<kD>(t.own_a + warp * kRowsPerWarp * kS, t.walk_a + lane * kS, round4(p.E), qk);
    dots<kD>(t.own_b + warp * kRowsPerWarp * kS, t.walk_b + lane * kS, round4(p.Ev), gv);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      float pz = 0.0f;  // dQ takes dS only
      weight_grads<T>(p, bh, first + r, j, qk[r], gv[r], lse_r[r], delta_r[r], pz, ds_w[r * kTile + lane]);
    }
    __syncwarp();
    accumulate<kD>(ds_w, t.walk_a, static_cast<int>(min64(kTile, end - j0)), dq);
    __syncwarp();  // the weights are written again by the next tile
  }
  store_rows<kD>(gq + bh * p.L * p.E, dq, first, p.L, p.E, p.scale);
}

// ---- tensor-core kernels (Note [Attention on tensor cores]) -------------------------------
//
// Note [Attention on tensor cores]
// A bfloat16 call with no mask, no dropout and head dims up to 64 — a GPT's attention
// under autocast — runs these kernels instead: the same outline, the same lse, the
// same fixed summation orders (no atomics: bitwise reproducible), with the products on
// the tensor cores through WMMA (16×16×16 bfloat16 fragments, float32 accumulators).
// On an H200 the CUDA-core kernels above took 1.06 ms forward and 2.75 ms backward per
// layer of GPT-2 small at batch 8 × 1024 (56 % of the step), where tensor cores do the
// same products in a tenth of that.
//  - Geometry: a block is 4 warps owning 64 rows (16 a warp: one fragment's height); the
//    other side is walked in tiles of 64. Tiles stay bfloat16 in shared memory, rows
//    kTcLd = 72 elements apart (144 bytes: 16-byte vector stores, 32-byte fragment
//    pointers); head dims below 64 are zero-padded (exact in every dot product).
//  - Scores S = q kᵀ come out of the MMA as float32 into the warp's 16 × 64 block; a
//    lane pair owns a row (32 columns each, interleaved), so a row's maximum and sum take one
//    shuffle, and both lanes hold the same bits. Scale, causal mask, online softmax,
//    P = exp(s − lse) and dS = P ∘ (dP − Δ) are the CUDA-core kernels' float32 steps.
//  - Interleaved columns: the two lanes of a row take its even and its odd columns,
//    step c column 2c + half (tc_col). With each lane on 32 contiguous columns, rows 68
//    floats apart put rows r and r + 8 and both lanes of a row on one bank: every step
//    of the scalar passes was a 4-way conflict; interleaved, both lanes of a row share
//    a bank of neither the float block nor (one 32-bit word) the bfloat16 operand rows,
//    and only rows r and r + 8 meet: 2-way. The addresses stay a lane's base plus a
//    constant per step (no registers held across the passes). A row's sum of weights is
//    taken in the lane's column order, then across the pair: fixed, so bitwise
//    reproducible still. The outputs are stored a row a step, a column a lane:
//    contiguous bytes per store.
//  - The second products (P·V, Pᵀ·dO, dSᵀ·q, dS·k) take P and dS as MMA operands, which
//    must be bfloat16. Rounding them would cost 8 bits of every weight (FlashAttention
//    does; PyTorch's flash kernels do). Here each is split into hi = bf16(x) and lo =
//    bf16(x − hi), and both products are accumulated: 16 bits of mantissa, an error of
//    2^-17 relative per term, well inside the float32 tolerance the CPU comparison
//    allows (Note [CUDA attention tolerances] in tests/cuda/cuda_attention_test.cpp),
//    for twice those products — the MMAs are not what bounds these kernels.
//  - The forward keeps each warp's output accumulator in shared memory (the online
//    softmax rescales rows, and a fragment's element-to-row map is unspecified); the
//    backward keeps dK, dV and dQ in fragments across the walk and stages them through
//    shared memory to store, each rounded once.
//  - float16 stays on the CUDA-core kernels: its dS (GradScaler-scaled gradients) can
//    exceed float16's range as an operand, and bfloat16 has float32's.
// Shared memory: 79 KiB (forward), 71.5 (dK/dV) and 71 (dQ) per block, opted into; a
// GPU that allows less, or a pointer that is not 16-byte aligned, takes the kernels
// above.
//  - The kernels these calls take by default are the ones on mma fragments (Note
//    [Attention on mma fragments] in backend/mma_attention.h): the same preconditions,
//    outline and outputs, the scores, weights and accumulators in registers.
//    DP_CUDA_ATTENTION_KERNELS=wmma chooses the WMMA kernels below instead.

constexpr int kTcRows = 16;                   // a warp's rows: one fragment's height
constexpr int kTcTile = kWarps * kTcRows;     // 64: a block's rows, and the walked tile
constexpr int kTcD = 64;                      // head dims up to 64, zero-padded
constexpr int kTcLd = kTcD + 8;               // bfloat16 elements between rows of a tile
constexpr int kTcLdF = kTcTile + 4;           // floats between rows of a warp's 16 × 64 block
constexpr int kTcTileBytes = kTcTile * kTcLd * 2;       // a bfloat16 tile
constexpr int kTcBlockBytes = kTcRows * kTcLdF * 4;     // a warp's float block
constexpr int kTcSplitBytes = 2 * kTcRows * kTcLd * 2;  // a warp's hi and lo operand rows
using Bf = __nv_bfloat16;

/// The tensor-core kernels' shared memory (dynamic; 128-byte aligned).
__device__ __forceinline__ unsigned char* tc_shared() {
  extern __shared__ __align__(128) unsigned char attention_tc_shared[];
  return attention_tc_shared;
}

/// Rows [row0, row0 + kTcTile) of a row-major (n, width) bfloat16 matrix into dst,
/// kTcLd apart; zeros past row n and past column width.
__device__ void tc_load(Bf* dst, const Bf* src, i64 row0, i64 n, int width) {
  if (width == kTcD) {  // whole rows: 8 16-byte pieces each (src 16-byte aligned: checked)
    for (int at = threadIdx.x; at < kTcTile * 8; at += kThreads) {
      const int r = at / 8, c = at % 8;
      const i64 row = row0 + r;
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (row < n) x = reinterpret_cast<const uint4*>(src + row * kTcD)[c];
      *reinterpret_cast<uint4*>(dst + r * kTcLd + c * 8) = x;
    }
  } else {
    for (int at = threadIdx.x; at < kTcTile * kTcD; at += kThreads) {
      const int r = at / kTcD, c = at % kTcD;
      const i64 row = row0 + r;
      dst[r * kTcLd + c] = row < n && c < width ? src[row * width + c] : __float2bfloat16(0.0f);
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DP_TC_ATTENTION 0  // bfloat16 fragments need sm_80: these kernels trap (never chosen there)
#else
#define DP_TC_ATTENTION 1
#endif

#if DP_TC_ATTENTION
namespace wmma = nvcuda::wmma;
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

/// c (16 × 64 floats, kTcLdF apart) = a_w bᵀ: the dot products of the warp's 16 rows
/// a_w with the 64 rows of the tile b, over kTcD columns.
__device__ __forceinline__ void tc_dots(const Bf* a_w, const Bf* b, float* c) {
#pragma unroll
  for (int nb = 0; nb < 4; ++nb) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      FragA fa;
      FragBCol fb;  // element (k, n) = b[(16 nb + n) kTcLd + 16 kk + k]: bᵀ's block
      wmma::load_matrix_sync(fa, a_w + kk * 16, kTcLd);
      wmma::load_matrix_sync(fb, b + nb * 16 * kTcLd + kk * 16, kTcLd);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(c + nb * 16, acc, kTcLdF, wmma::mem_row_major);
  }
}

/// acc[nb] += (hi + lo) x: the warp's 16 × 64 weights, split in two bfloat16 rows
/// (hi, lo: kTcLd apart), times the 64 × 64 tile x, column block nb of the result.
__device__ __forceinline__ void tc_weights_times(const Bf* hi, const Bf* lo, const Bf* x, FragC (&acc)[4]) {
#pragma unroll
  for (int nb = 0; nb < 4; ++nb) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      FragA fa;
      FragBRow fb;  // element (k, n) = x[(16 kk + k) kTcLd + 16 nb + n]
      wmma::load_matrix_sync(fb, x + kk * 16 * kTcLd + nb * 16, kTcLd);
      wmma::load_matrix_sync(fa, hi + kk * 16, kTcLd);
      wmma::mma_sync(acc[nb], fa, fb, acc[nb]);
      wmma::load_matrix_sync(fa, lo + kk * 16, kTcLd);
      wmma::mma_sync(acc[nb], fa, fb, acc[nb]);
    }
  }
}
#endif

/// Writes w as hi = bf16(w) and lo = bf16(w − hi) (Note [Attention on tensor cores]).
__device__ __forceinline__ void split(float w, Bf& hi, Bf& lo) {
  hi = __float2bfloat16(w);
  lo = __float2bfloat16(w - __bfloat162float(hi));
}

/// The column of its row a lane takes at step c of its 32 (Note [Attention on tensor
/// cores]: interleaved columns): lane pair r owns row r, lane `half` its columns of
/// parity `half`.
__device__ __forceinline__ int tc_col(int c, int half) { return 2 * c + half; }

/// A warp's 16 × 64 float block (kTcLdF apart) scaled, rows [first, first + 16) of a
/// row-major (n, width) bfloat16 matrix: a row a step, a column a lane, so that each
/// store is one row's contiguous bytes and each read a bank a lane.
__device__ __forceinline__ void tc_store_rows(Bf* dst, const float* block, i64 first, i64 n, int width,
                                              float factor) {
  const int lane = threadIdx.x % kWarp;
  for (int rr = 0; rr < kTcRows && first + rr < n; ++rr) {
    for (int d = lane; d < width; d += kWarp)
      dst[(first + rr) * width + d] = __float2bfloat16(factor * block[rr * kTcLdF + d]);
  }
}

#if DP_TC_ATTENTION
/// The warp's 16 × 64 result in fragments, staged through its float block, stored as
/// tc_store_rows does.
__device__ __forceinline__ void tc_store_fragments(Bf* dst, const FragC (&acc)[4], float* block, i64 first, i64 n,
                                                   int width, float factor) {
  __syncwarp();  // the block's last readers are done
#pragma unroll
  for (int nb = 0; nb < 4; ++nb) wmma::store_matrix_sync(block + nb * 16, acc[nb], kTcLdF, wmma::mem_row_major);
  __syncwarp();
  tc_store_rows(dst, block, first, n, width, factor);
}
#endif

/// out (B, H, L, Ev) and lse: a block per 64 queries of one (b, h).
__global__ void __launch_bounds__(kThreads)
    attention_forward_tc_kernel(Params p, const Bf* __restrict__ q, const Bf* __restrict__ k,
                                const Bf* __restrict__ v, Bf* __restrict__ out, float* __restrict__ lse) {
#if DP_TC_ATTENTION
  unsigned char* sm = tc_shared();
  Bf* q_s = reinterpret_cast<Bf*>(sm);
  Bf* k_s = q_s + kTcTile * kTcLd;
  Bf* v_s = k_s + kTcTile * kTcLd;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  unsigned char* warp_sm = sm + 3 * kTcTileBytes + warp * (2 * kTcBlockBytes + kTcSplitBytes);
  float* s_w = reinterpret_cast<float*>(warp_sm);                      // scores, then weights
  float* o_w = reinterpret_cast<float*>(warp_sm + kTcBlockBytes);      // the output accumulator
  Bf* hi_w = reinterpret_cast<Bf*>(warp_sm + 2 * kTcBlockBytes);
  Bf* lo_w = hi_w + kTcRows * kTcLd;
  const i64 bh = blockIdx.x / p.tiles;
  const i64 i0 = (p.tiles - 1 - blockIdx.x % p.tiles) * kTcTile;  // the longest causal rows first
  const i64 first = i0 + warp * kTcRows;
  const int r = lane / 2, half = lane % 2;  // the lane's row and its 32 columns
  const i64 i = first + r;
  tc_load(q_s, q + bh * p.L * p.E, i0, p.L, p.E);
  for (int at = lane; at < kTcRows * kTcLdF; at += kWarp) o_w[at] = 0.0f;
  float m = kNegInf, l = 0.0f;  // the row's running maximum and sum, the same on both lanes
  const i64 end = p.causal ? min64(p.S, min64(p.L, i0 + kTcTile)) : p.S;
  for (i64 j0 = 0; j0 < end; j0 += kTcTile) {
    __syncthreads();  // the previous tile is read (and the queries are loaded)
    tc_load(k_s, k + bh * p.S * p.E, j0, end, p.E);  // zeros from `end` on, as the CUDA-core kernel
    tc_load(v_s, v + bh * p.S * p.Ev, j0, end, p.Ev);
    __syncthreads();
    if (first >= p.L || (p.causal && j0 > first + kTcRows - 1)) continue;  // the warp's rows attend to none
    tc_dots(q_s + warp * kTcRows * kTcLd, k_s, s_w);
    __syncwarp();
    float* srow = s_w + r * kTcLdF;
    float tile_max = kNegInf;
    for (int c = 0; c < 32; ++c) {
      const int col = tc_col(c, half);
      const float x = attends(p, i, j0 + col) ? p.scale * srow[col] : kNegInf;
      srow[col] = x;
      tile_max = MaxOp{}(tile_max, x);
    }
    // The row's new maximum, NaN winning (Note [Fused attention on CUDA]).
    const float m_new = MaxOp{}(MaxOp{}(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1)), m);
    float sum = 0.0f;
    Bf* hr = hi_w + r * kTcLd;
    Bf* lr = lo_w + r * kTcLd;
    for (int c = 0; c < 32; ++c) {
      const int col = tc_col(c, half);
      const float w = m_new == kNegInf ? 0.0f : expf(srow[col] - m_new);  // nothing attended yet: no weight
      sum += w;
      split(w, hr[col], lr[col]);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // both lanes add the same two values
    if (m_new != kNegInf) {
      const float correction = expf(m - m_new);  // 0 on the first tile attended
      l = l * correction + sum;
      m = m_new;
      if (correction != 1.0f)
        for (int c = 0; c < 32; ++c) o_w[r * kTcLdF + tc_col(c, half)] *= correction;
    }
    __syncwarp();
    FragC acc[4];
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) wmma::load_matrix_sync(acc[nb], o_w + nb * 16, kTcLdF, wmma::mem_row_major);
    tc_weights_times(hi_w, lo_w, v_s, acc);
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) wmma::store_matrix_sync(o_w + nb * 16, acc[nb], kTcLdF, wmma::mem_row_major);
    __syncwarp();  // the scores and weights are written again by the next tile
  }
  __syncwarp();
  // A row with every key masked: out = 0 and lse = +inf, as the CUDA-core kernel. The
  // rows are stored as tc_store_rows does, each row's sum from its lane pair.
  for (int rr = 0; rr < kTcRows; ++rr) {
    const float l_r = __shfl_sync(0xffffffffu, l, 2 * rr);
    if (first + rr >= p.L) break;  // warp-uniform
    Bf* o = out + (bh * p.L + first + rr) * p.Ev;
    for (int d = lane; d < p.Ev; d += kWarp) o[d] = __float2bfloat16(l_r == 0.0f ? 0.0f : o_w[rr * kTcLdF + d] / l_r);
  }
  if (i < p.L && half == 0) lse[bh * p.L + i] = l == 0.0f ? INFINITY : m + logf(l);
#else
  __trap();
#endif
}

/// Where a block of the query-side mma kernels works: its problem bh, its 64 query rows
/// from i0 (the longest causal rows first) and its warp's 16 from `first`.
struct MmaQueryBlock {
  mma_attention::Shape s;
  int warp, tid;
  i64 bh, i0, first;
};
__device__ __forceinline__ MmaQueryBlock mma_query_block(const Params& p) {
  MmaQueryBlock b;
  b.s = mma_attention::Shape{p.L, p.S, p.E, p.Ev, p.scale, p.causal};
  b.warp = static_cast<int>(threadIdx.x) / kWarp;
  b.tid = static_cast<int>(threadIdx.x);
  b.bh = blockIdx.x / p.tiles;
  b.i0 = (p.tiles - 1 - blockIdx.x % p.tiles) * mma_attention::kTile;
  b.first = b.i0 + b.warp * mma_attention::kRows;
  return b;
}
/// The bits of a bfloat16 array, as the mma kernels' bodies read them.
__device__ __forceinline__ const std::uint16_t* bits(const Bf* x) { return reinterpret_cast<const std::uint16_t*>(x); }

/// The key tiles block b walks, each loaded into k_s and v_s by the whole block, then
/// step(j0) for its warp unless the warp's rows attend to none of the tile's keys
/// (warp-uniform, so every lane of a warp calls the same mma instructions).
template <typename Step>
__device__ __forceinline__ void walk_key_tiles(const Params& p, const MmaQueryBlock& b, const Bf* k, const Bf* v,
                                               std::uint16_t* k_s, std::uint16_t* v_s, Step step) {
  namespace ma = mma_attention;
  const i64 end = ma::keys_end(b.s, b.i0);
  for (i64 j0 = 0; j0 < end; j0 += ma::kTile) {
    __syncthreads();  // every warp is done with the previous tile (and the query tiles are loaded)
    ma::load_rows(k_s, bits(k) + b.bh * p.S * p.E, j0, end, p.E, b.tid, ma::kThreads);
    ma::load_rows(v_s, bits(v) + b.bh * p.S * p.Ev, j0, end, p.Ev, b.tid, ma::kThreads);
    __syncthreads();
    if (!ma::warp_skips(b.s, b.first, j0)) step(j0);
  }
}

/// out (B, H, L, Ev) and lse: a block per 64 queries of one (b, h), its warps' scores,
/// weights and outputs in registers (Note [Attention on mma fragments] in
/// backend/mma_attention.h). The same preconditions as the WMMA forward above.
__global__ void __launch_bounds__(mma_attention::kThreads)
    attention_forward_mma_kernel(Params p, const Bf* __restrict__ q, const Bf* __restrict__ k,
                                 const Bf* __restrict__ v, Bf* __restrict__ out, float* __restrict__ lse) {
#if DP_TC_ATTENTION
  namespace ma = mma_attention;
  auto* q_s = reinterpret_cast<std::uint16_t*>(tc_shared());
  std::uint16_t* k_s = q_s + ma::kTileElems;
  std::uint16_t* v_s = k_s + ma::kTileElems;
  const MmaQueryBlock b = mma_query_block(p);
  ma::load_rows(q_s, bits(q) + b.bh * p.L * p.E, b.i0, p.L, p.E, b.tid, ma::kThreads);
  __syncthreads();
  ma::WarpState st;
  ma::warp_begin(st, q_s, b.warp);
  walk_key_tiles(p, b, k, v, k_s, v_s, [&](i64 j0) { ma::warp_tile(st, b.s, k_s, v_s, b.first, j0); });
  ma::warp_finish(st, b.s, reinterpret_cast<std::uint16_t*>(out) + b.bh * p.L * p.Ev, lse + b.bh * p.L, b.first);
#else
  __trap();
#endif
}

/// gk and gv: a block per 64 keys of one (b, h), walking the query tiles.
__global__ void __launch_bounds__(kThreads)
    attention_keys_tc_kernel(Params p, const Bf* __restrict__ q, const Bf* __restrict__ k,
                             const Bf* __restrict__ v, const Bf* __restrict__ gout, const float* __restrict__ lse,
                             const float* __restrict__ delta, Bf* __restrict__ gk, Bf* __restrict__ gv) {
#if DP_TC_ATTENTION
  unsigned char* sm = tc_shared();
  Bf* k_s = reinterpret_cast<Bf*>(sm);
  Bf* v_s = k_s + kTcTile * kTcLd;
  Bf* q_s = v_s + kTcTile * kTcLd;
  Bf* g_s = q_s + kTcTile * kTcLd;
  float* lse_s = reinterpret_cast<float*>(sm + 4 * kTcTileBytes);
  float* delta_s = lse_s + kTcTile;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  unsigned char* warp_sm = sm + 4 * kTcTileBytes + 2 * kTcTile * 4 + warp * (kTcBlockBytes + kTcSplitBytes);
  float* s_w = reinterpret_cast<float*>(warp_sm);
  Bf* hi_w = reinterpret_cast<Bf*>(warp_sm + kTcBlockBytes);
  Bf* lo_w = hi_w + kTcRows * kTcLd;
  const i64 bh = blockIdx.x / p.tiles, j0 = blockIdx.x % p.tiles * kTcTile;
  const i64 first = j0 + warp * kTcRows;  // the warp's first key
  const int r = lane / 2, half = lane % 2;
  const i64 j = first + r;  // the lane's key
  tc_load(k_s, k + bh * p.S * p.E, j0, p.S, p.E);
  tc_load(v_s, v + bh * p.S * p.Ev, j0, p.S, p.Ev);
  FragC dk[4], dv[4];
#pragma unroll
  for (int nb = 0; nb < 4; ++nb) {
    wmma::fill_fragment(dk[nb], 0.0f);
    wmma::fill_fragment(dv[nb], 0.0f);
  }
  // Causal: a query i < j0 attends to no key of the block.
  for (i64 i0 = p.causal ? j0 : 0; i0 < p.L; i0 += kTcTile) {
    __syncthreads();  // the previous tile is read (and the keys are loaded)
    tc_load(q_s, q + bh * p.L * p.E, i0, p.L, p.E);
    tc_load(g_s, gout + bh * p.L * p.Ev, i0, p.L, p.Ev);
    load_row_stats(kTcTile, lse + bh * p.L, delta + bh * p.L, i0, p.L, lse_s, delta_s);
    __syncthreads();
    if (first >= p.S || (p.causal && first > i0 + kTcTile - 1)) continue;  // the warp's keys attended by none
    tc_dots(k_s + warp * kTcRows * kTcLd, q_s, s_w);  // Sᵀ: the warp's keys × the tile's queries
    __syncwarp();
    const float* srow = s_w + r * kTcLdF;
    Bf* hr = hi_w + r * kTcLd;
    Bf* lr = lo_w + r * kTcLd;
    float pr[32];
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = tc_col(c, half);
      pr[c] = attends(p, i0 + col, j) ? expf(p.scale * srow[col] - lse_s[col]) : 0.0f;
      split(pr[c], hr[col], lr[col]);
    }
    __syncwarp();
    tc_weights_times(hi_w, lo_w, g_s, dv);                     // dV += Pᵀ gout
    tc_dots(v_s + warp * kTcRows * kTcLd, g_s, s_w);         // dPᵀ = v goutᵀ
    __syncwarp();
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = tc_col(c, half);
      const float ds = attends(p, i0 + col, j) ? pr[c] * (srow[col] - delta_s[col]) : 0.0f;
      split(ds, hr[col], lr[col]);
    }
    __syncwarp();
    tc_weights_times(hi_w, lo_w, q_s, dk);  // dK += dSᵀ q (unscaled)
    __syncwarp();
  }
  tc_store_fragments(gk + bh * p.S * p.E, dk, s_w, first, p.S, p.E, p.scale);
  tc_store_fragments(gv + bh * p.S * p.Ev, dv, s_w, first, p.S, p.Ev, 1.0f);
#else
  __trap();
#endif
}

/// gq: a block per 64 queries of one (b, h), walking the key tiles.
__global__ void __launch_bounds__(kThreads)
    attention_queries_tc_kernel(Params p, const Bf* __restrict__ q, const Bf* __restrict__ k,
                                const Bf* __restrict__ v, const Bf* __restrict__ gout,
                                const float* __restrict__ lse, const float* __restrict__ delta,
                                Bf* __restrict__ gq) {
#if DP_TC_ATTENTION
  unsigned char* sm = tc_shared();
  Bf* q_s = reinterpret_cast<Bf*>(sm);
  Bf* g_s = q_s + kTcTile * kTcLd;
  Bf* k_s = g_s + kTcTile * kTcLd;
  Bf* v_s = k_s + kTcTile * kTcLd;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  unsigned char* warp_sm = sm + 4 * kTcTileBytes + warp * (kTcBlockBytes + kTcSplitBytes);
  float* s_w = reinterpret_cast<float*>(warp_sm);
  Bf* hi_w = reinterpret_cast<Bf*>(warp_sm + kTcBlockBytes);
  Bf* lo_w = hi_w + kTcRows * kTcLd;
  const i64 bh = blockIdx.x / p.tiles;
  const i64 i0 = (p.tiles - 1 - blockIdx.x % p.tiles) * kTcTile;  // the longest causal rows first
  const i64 first = i0 + warp * kTcRows;
  const int r = lane / 2, half = lane % 2;
  const i64 i = first + r;  // the lane's query
  tc_load(q_s, q + bh * p.L * p.E, i0, p.L, p.E);
  tc_load(g_s, gout + bh * p.L * p.Ev, i0, p.L, p.Ev);
  const float lse_i = i < p.L ? lse[bh * p.L + i] : 0.0f;
  const float delta_i = i < p.L ? delta[bh * p.L + i] : 0.0f;
  FragC dq[4];
#pragma unroll
  for (int nb = 0; nb < 4; ++nb) wmma::fill_fragment(dq[nb], 0.0f);
  const i64 end = p.causal ? min64(p.S, min64(p.L, i0 + kTcTile)) : p.S;
  for (i64 j0 = 0; j0 < end; j0 += kTcTile) {
    __syncthreads();  // the previous tile is read (and the queries are loaded)
    tc_load(k_s, k + bh * p.S * p.E, j0, end, p.E);  // zeros from `end` on, as in the forward
    tc_load(v_s, v + bh * p.S * p.Ev, j0, end, p.Ev);
    __syncthreads();
    if (first >= p.L || (p.causal && j0 > first + kTcRows - 1)) continue;  // the warp's rows attend to none
    tc_dots(q_s + warp * kTcRows * kTcLd, k_s, s_w);
    __syncwarp();
    const float* srow = s_w + r * kTcLdF;
    float pr[32];
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = tc_col(c, half);
      pr[c] = attends(p, i, j0 + col) ? expf(p.scale * srow[col] - lse_i) : 0.0f;
    }
    __syncwarp();  // the scores are read: dP goes where they were
    tc_dots(g_s + warp * kTcRows * kTcLd, v_s, s_w);  // dP = gout vᵀ
    __syncwarp();
    Bf* hr = hi_w + r * kTcLd;
    Bf* lr = lo_w + r * kTcLd;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = tc_col(c, half);
      const float ds = attends(p, i, j0 + col) ? pr[c] * (srow[col] - delta_i) : 0.0f;
      split(ds, hr[col], lr[col]);
    }
    __syncwarp();
    tc_weights_times(hi_w, lo_w, k_s, dq);  // dQ += dS k (unscaled)
    __syncwarp();
  }
  tc_store_fragments(gq + bh * p.L * p.E, dq, s_w, first, p.L, p.E, p.scale);
#else
  __trap();
#endif
}

/// gk and gv: a block per 64 keys of one (b, h), walking the query tiles, on mma
/// fragments (the backward of Note [Attention on mma fragments]).
__global__ void __launch_bounds__(mma_attention::kThreads)
    attention_keys_mma_kernel(Params p, const Bf* __restrict__ q, const Bf* __restrict__ k, const Bf* __restrict__ v,
                              const Bf* __restrict__ gout, const float* __restrict__ lse,
                              const float* __restrict__ delta, Bf* __restrict__ gk, Bf* __restrict__ gv) {
#if DP_TC_ATTENTION
  namespace ma = mma_attention;
  auto* k_s = reinterpret_cast<std::uint16_t*>(tc_shared());
  std::uint16_t* v_s = k_s + ma::kTileElems;
  std::uint16_t* q_s = v_s + ma::kTileElems;
  std::uint16_t* g_s = q_s + ma::kTileElems;
  float* lse_s = reinterpret_cast<float*>(g_s + ma::kTileElems);
  float* delta_s = lse_s + ma::kTile;
  const ma::Shape s{p.L, p.S, p.E, p.Ev, p.scale, p.causal};
  const int warp = static_cast<int>(threadIdx.x) / kWarp, tid = static_cast<int>(threadIdx.x);
  const i64 bh = blockIdx.x / p.tiles, j0 = blockIdx.x % p.tiles * ma::kTile;
  const i64 first = j0 + warp * ma::kRows;  // the warp's first key
  ma::load_rows(k_s, bits(k) + bh * p.S * p.E, j0, p.S, p.E, tid, ma::kThreads);
  ma::load_rows(v_s, bits(v) + bh * p.S * p.Ev, j0, p.S, p.Ev, tid, ma::kThreads);
  __syncthreads();
  ma::KeysState st;
  ma::keys_begin(st, k_s, v_s, warp);
  for (i64 i0 = p.causal ? j0 : 0; i0 < p.L; i0 += ma::kTile) {  // causal: no query before j0 attends
    __syncthreads();  // every warp is done with the previous tile
    ma::load_rows(q_s, bits(q) + bh * p.L * p.E, i0, p.L, p.E, tid, ma::kThreads);
    ma::load_rows(g_s, bits(gout) + bh * p.L * p.Ev, i0, p.L, p.Ev, tid, ma::kThreads);
    ma::load_row_stats(lse_s, delta_s, lse + bh * p.L, delta + bh * p.L, i0, p.L, tid, ma::kThreads);
    __syncthreads();
    if (!ma::keys_skip(s, first, i0)) ma::keys_tile(st, s, q_s, g_s, lse_s, delta_s, first, i0);  // warp-uniform
  }
  ma::store_rows(reinterpret_cast<std::uint16_t*>(gk) + bh * p.S * p.E, st.dk, first, p.S, p.E, p.scale);
  ma::store_rows(reinterpret_cast<std::uint16_t*>(gv) + bh * p.S * p.Ev, st.dv, first, p.S, p.Ev, 1.0f);
#else
  __trap();
#endif
}

/// gq: a block per 64 queries of one (b, h), walking the key tiles, on mma fragments.
__global__ void __launch_bounds__(mma_attention::kThreads)
    attention_queries_mma_kernel(Params p, const Bf* __restrict__ q, const Bf* __restrict__ k,
                                 const Bf* __restrict__ v, const Bf* __restrict__ gout, const float* __restrict__ lse,
                                 const float* __restrict__ delta, Bf* __restrict__ gq) {
#if DP_TC_ATTENTION
  namespace ma = mma_attention;
  auto* q_s = reinterpret_cast<std::uint16_t*>(tc_shared());
  std::uint16_t* g_s = q_s + ma::kTileElems;
  std::uint16_t* k_s = g_s + ma::kTileElems;
  std::uint16_t* v_s = k_s + ma::kTileElems;
  const MmaQueryBlock b = mma_query_block(p);
  ma::load_rows(q_s, bits(q) + b.bh * p.L * p.E, b.i0, p.L, p.E, b.tid, ma::kThreads);
  ma::load_rows(g_s, bits(gout) + b.bh * p.L * p.Ev, b.i0, p.L, p.Ev, b.tid, ma::kThreads);
  __syncthreads();
  ma::QueriesState st;
  ma::queries_begin(st, b.s, q_s, g_s, lse + b.bh * p.L, delta + b.bh * p.L, b.warp, b.first);
  walk_key_tiles(p, b, k, v, k_s, v_s, [&](i64 j0) { ma::queries_tile(st, b.s, k_s, v_s, b.first, j0); });
  ma::store_rows(reinterpret_cast<std::uint16_t*>(gq) + b.bh * p.L * p.E, st.dq, b.first, p.L, p.E, p.scale);
#else
  __trap();
#endif
}

// Shared memory of each tensor-core kernel: tiles (and lse, Δ), then the warps' blocks.
constexpr std::size_t tc_forward_smem() {
  return 3 * kTcTileBytes + kWarps * (2 * kTcBlockBytes + kTcSplitBytes);
}
constexpr std::size_t tc_keys_smem() {
  return 4 * kTcTileBytes + 2 * kTcTile * 4 + kWarps * (kTcBlockBytes + kTcSplitBytes);
}
constexpr std::size_t tc_queries_smem() { return 4 * kTcTileBytes + kWarps * (kTcBlockBytes + kTcSplitBytes); }
static_assert(kTcTileBytes % 32 == 0 && kTcBlockBytes % 32 == 0 && kTcSplitBytes % 32 == 0 &&
                  (2 * kTcTile * 4) % 32 == 0,
              "fragment pointers stay 32-byte aligned");
constexpr std::size_t tc_smem_needed() {
  return std::max(tc_forward_smem(), std::max(tc_keys_smem(), tc_queries_smem()));
}

// ---- launchers ----------------------------------------------------------------------------

/// The kernels' Params of a call (tiles: each launcher's own).
Params params(const AttentionShape& s, const AttentionMask& mask, bool causal, float scale,
              const AttentionDropout& drop) {
  return {.H = s.H,
          .L = s.L,
          .S = s.S,
          .E = static_cast<int>(s.E),
          .Ev = static_cast<int>(s.Ev),
          .tiles = 0,
          .scale = scale,
          .causal = causal,
          .mask = mask.p,
          .mask_f32 = mask.dtype == DType::F32,
          .keep = mask.keep,
          .msb = mask.sb,
          .msh = mask.sh,
          .msl = mask.sl,
          .mss = mask.ss,
          .drop_p = drop.p,
          .drop_scale = drop.p > 0.0f ? 1.0f / (1.0f - drop.p) : 1.0f,
          .seed = drop.seed,
          .offset = drop.offset};
}

/// kD of a call: its head dims rounded up to 64 or 128 (at most kMaxHeadDim: callers check).
int head_dim_tier(int E, int Ev) { return std::max(E, Ev) <= 64 ? 64 : 128; }

/// Calls f(std::integral_constant<int, kD>) for the call's kD.
template <typename F>
void with_head_dims(const Params& p, F&& f) {
  if (head_dim_tier(p.E, p.Ev) == 64) {
    f(std::integral_constant<int, 64>{});
  } else {
    f(std::integral_constant<int, 128>{});
  }
}

// Shared memory of each kernel (Note [Fused attention on CUDA]): tiles, then the warps'
// weight rows (and the keys kernel's lse and Δ of its query tile).
constexpr std::size_t forward_smem(int kD) {
  return (3 * kTile * row_stride(kD) + kWarps * kRowsPerWarp * kTile) * sizeof(float);
}
constexpr std::size_t keys_smem(int kD) {
  return (4 * kTile * row_stride(kD) + 2 * kTile + 2 * kWarps * kRowsPerWarp * kTile) * sizeof(float);
}
constexpr std::size_t queries_smem(int kD) {
  return (4 * kTile * row_stride(kD) + kWarps * kRowsPerWarp * kTile) * sizeof(float);
}
/// The most any of them takes at kD: what a GPU must allow a block.
constexpr std::size_t smem_needed(int kD) {
  return std::max(forward_smem(kD), std::max(keys_smem(kD), queries_smem(kD)));
}
/// Shared memory a block may use without opting in, on every GPU CUDA 13 supports.
constexpr std::size_t kDefaultSmem = 48 * 1024;
static_assert(smem_needed(64) <= kDefaultSmem, "kD = 64 runs on any GPU without opting in");

i64 tiles(i64 n) { return (n + kTile - 1) / kTile; }

/// Launches kernel over `blocks` blocks of kThreads with `smem` bytes of dynamic shared
/// memory, opting in above the default (cudaFuncSetAttribute: a host-side setting of the
/// current device, no synchronisation).
template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), i64 blocks, std::size_t smem, cudaStream_t stream, Args... args) {
  DP_CHECK(blocks <= INT_MAX, "attention: ", blocks, " blocks exceed a CUDA grid's ", INT_MAX);
  if (smem > kDefaultSmem)
    DP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(args...);
  DP_CUDA_CHECK_LAUNCH();
}

/// Whether the tensor-core calls take the WMMA kernels (DP_CUDA_ATTENTION_KERNELS=wmma)
/// rather than those on mma fragments (Note [Attention on mma fragments]): read once.
bool wmma_kernels() {
  static const bool wmma = [] {
    const char* env = std::getenv("DP_CUDA_ATTENTION_KERNELS");
    return env != nullptr && std::string(env) == "wmma";
  }();
  return wmma;
}
/// Dynamic shared memory of the backward kernels on mma fragments: four tiles (and the
/// keys kernel's lse and Δ of its query tile).
constexpr std::size_t kMmaBackwardSmem = mma_attention::kForwardSmem / 3 * 4 + 2 * mma_attention::kTile * sizeof(float);

/// out and lse of BH problems with p's geometry.
template <typename T>
void attention_forward(cudaStream_t stream, Params p, i64 BH, const T* q, const T* k, const T* v, T* out,
                       float* lse, bool tc) {
  if constexpr (std::is_same_v<T, Bf>) {
    if (tc) {  // Note [Attention on tensor cores], Note [Attention on mma fragments]
      static_assert(mma_attention::kTile == kTcTile && mma_attention::kThreads == kThreads, "one grid, one block");
      p.tiles = (p.L + kTcTile - 1) / kTcTile;
      if (BH > 0 && p.tiles > 0) {
        if (wmma_kernels()) {
          launch(attention_forward_tc_kernel, BH * p.tiles, tc_forward_smem(), stream, p, q, k, v, out, lse);
        } else {
          launch(attention_forward_mma_kernel, BH * p.tiles, mma_attention::kForwardSmem, stream, p, q, k, v, out,
                 lse);
        }
      }
      return;
    }
  }
  p.tiles = tiles(p.L);
  if (BH == 0 || p.tiles == 0) return;
  with_head_dims(p, [&](auto kd) {
    constexpr int kD = decltype(kd)::value;
    launch(attention_forward_kernel<T, kD>, BH * p.tiles, forward_smem(kD), stream, p, q, k, v, out, lse);
  });
}

/// gq, gk, gv of BH problems with p's geometry; delta: scratch of BH·L floats.
template <typename T>
void attention_backward(cudaStream_t stream, Params p, i64 BH, const T* q, const T* k, const T* v, const T* out,
                        const float* lse, const T* gout, float* delta, T* gq, T* gk, T* gv, bool tc) {
  const i64 rows = BH * p.L;
  if (rows > 0) {
    const i64 blocks = std::min<i64>((rows + kBlock / kWarp - 1) / (kBlock / kWarp), kMaxBlocks);
    attention_delta_kernel<T><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(out, gout, delta, rows, p.Ev);
    DP_CUDA_CHECK_LAUNCH();
  }
  if constexpr (std::is_same_v<T, Bf>) {
    if (tc) {  // Note [Attention on tensor cores], Note [Attention on mma fragments]
      Params keys = p, queries = p;
      keys.tiles = (p.S + kTcTile - 1) / kTcTile;
      queries.tiles = (p.L + kTcTile - 1) / kTcTile;
      const bool wmma = wmma_kernels();
      if (BH > 0 && keys.tiles > 0) {
        if (wmma) {
          launch(attention_keys_tc_kernel, BH * keys.tiles, tc_keys_smem(), stream, keys, q, k, v, gout, lse, delta,
                 gk, gv);
        } else {
          launch(attention_keys_mma_kernel, BH * keys.tiles, kMmaBackwardSmem, stream, keys, q, k, v, gout, lse, delta,
                 gk, gv);
        }
      }
      if (BH > 0 && queries.tiles > 0) {
        if (wmma) {
          launch(attention_queries_tc_kernel, BH * queries.tiles, tc_queries_smem(), stream, queries, q, k, v, gout,
                 lse, delta, gq);
        } else {
          launch(attention_queries_mma_kernel, BH * queries.tiles, mma_attention::kForwardSmem / 3 * 4, stream,
                 queries, q, k, v, gout, lse, delta, gq);
        }
      }
      return;
    }
  }
  with_head_dims(p, [&](auto kd) {
    constexpr int kD = decltype(kd)::value;
    Params keys = p, queries = p;
    keys.tiles = tiles(p.S);
    queries.tiles = tiles(p.L);
    if (BH > 0 && keys.tiles > 0)
      launch(attention_keys_kernel<T, kD>, BH * keys.tiles, keys_smem(kD), stream, keys, q, k, v, gout, lse, delta,
             gk, gv);
    if (BH > 0 && queries.tiles > 0)
      launch(attention_queries_kernel<T, kD>, BH * queries.tiles, queries_smem(kD), stream, queries, q, k, v, gout,
             lse, delta, gq);
  });
}

}  // namespace

// ---- the kernel table's entries (Note [The op list] in ops.h) -------------------------------

std::string attention_misfit(const AttentionShape& s, int gpu) {
  if (s.E > kMaxHeadDim || s.Ev > kMaxHeadDim)
    return ::dp::detail::str_cat("head dims E = ", s.E, " and Ev = ", s.Ev, " exceed the CUDA kernel's ", kMaxHeadDim);
  int limit = 0;
  DP_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, gpu));
  const std::size_t need = smem_needed(head_dim_tier(static_cast<int>(s.E), static_cast<int>(s.Ev)));
  if (need > static_cast<std::size_t>(limit))
    return ::dp::detail::str_cat("the CUDA kernel needs ", need,
                                 " bytes of shared memory per block for head dims above 64, GPU ", gpu, " allows ",
                                 limit);
  const i64 blocks = s.B * s.H * tiles(std::max(s.L, s.S));
  if (blocks > INT_MAX)
    return ::dp::detail::str_cat("B·H·ceil(max(L, S) / ", kTile, ") = ", blocks, " blocks exceed a CUDA grid's ",
                                 INT_MAX);
  return "";
}

namespace {
namespace table {

/// The checks of every attention kernel, then the CUDA kernel's own limits.
template <typename H>
cudaStream_t start(const char* op, CudaBackend& be, Device dev, const AttentionShape& s, const AttentionMask& mask,
                   const AttentionDropout& drop) {
  check_attention_args(op, dtype_of<H>, s, mask, drop);
  cudaStream_t stream = be.bind(dev);
  const std::string misfit = attention_misfit(s, be.physical_device(dev.index));
  DP_CHECK(misfit.empty(), op, " on ", dev.str(), ": expected a shape the CUDA kernel takes, got one where ", misfit,
           " (scaled_dot_product_attention runs the math path for such calls)");
  return stream;
}

/// Whether a call of T takes the tensor-core kernels (Note [Attention on tensor cores]):
/// bfloat16, no mask, no dropout, head dims up to 64, 16-byte aligned rows, and a GPU
/// with bfloat16 fragments (sm_80 on) that allows their shared memory.
template <typename T>
bool takes_tensor_cores(const Params& p, int gpu, std::initializer_list<const void*> pointers) {
  if constexpr (!std::is_same_v<T, Bf>) {
    return false;
  } else {
    if (p.mask || p.drop_p > 0.0f || p.E > kTcD || p.Ev > kTcD) return false;
    for (const void* x : pointers)
      if (reinterpret_cast<std::uintptr_t>(x) % 16 != 0) return false;
    int major = 0, limit = 0;
    DP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, gpu));
    DP_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, gpu));
    // The kernels that will run: on mma fragments at most 37 KiB, the WMMA ones 79 KiB.
    const std::size_t need =
        wmma_kernels() ? tc_smem_needed() : std::max(mma_attention::kForwardSmem, kMmaBackwardSmem);
    return major >= 8 && need <= static_cast<std::size_t>(limit);
  }
}

template <typename H>
void forward(CudaBackend& be, Device dev, const AttentionForwardArgs& a) {
  using T = device_t<H>;
  cudaStream_t stream = start<H>("attention_forward", be, dev, a.s, a.mask, a.dropout);
  const Params p = params(a.s, a.mask, a.causal, a.scale, a.dropout);
  const bool tc = takes_tensor_cores<T>(p, be.physical_device(dev.index), {a.q, a.k, a.v});
  attention_forward<T>(stream, p, a.s.B * a.s.H, static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                       static_cast<const T*>(a.v), static_cast<T*>(a.out), a.lse, tc);
}

template <typename H>
void backward(CudaBackend& be, Device dev, const AttentionBackwardArgs& a) {
  using T = device_t<H>;
  cudaStream_t stream = start<H>("attention_backward", be, dev, a.s, a.mask, a.dropout);
  const i64 rows = a.s.B * a.s.H * a.s.L;
  CudaBackend::Scratch delta(be, dev.index, static_cast<std::size_t>(std::max<i64>(rows, 1)) * sizeof(float));
  const Params p = params(a.s, a.mask, a.causal, a.scale, a.dropout);
  const bool tc = takes_tensor_cores<T>(p, be.physical_device(dev.index), {a.q, a.k, a.v, a.gout});
  attention_backward<T>(stream, p, a.s.B * a.s.H, static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                        static_cast<const T*>(a.v), static_cast<const T*>(a.out), a.lse,
                        static_cast<const T*>(a.gout), static_cast<float*>(delta.get()), static_cast<T*>(a.gq),
                        static_cast<T*>(a.gk), static_cast<T*>(a.gv), tc);
}

}  // namespace table

/// AttentionForward and AttentionBackward for the dtype of H (float, BFloat16, Float16).
template <typename H>
void register_dtype(CudaBackend& be) {
  add<Op::AttentionForward, &table::forward<H>>(be, dtype_of<H>);
  add<Op::AttentionBackward, &table::backward<H>>(be, dtype_of<H>);
}

}  // namespace

void register_attention_kernels(CudaBackend& be) {
  register_dtype<float>(be);
  register_dtype<BFloat16>(be);
  register_dtype<Float16>(be);
}

}  // namespace dp::backend::cuda_kernels
