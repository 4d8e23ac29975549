// CUDA backend: log-softmax and NLL, max/avg pooling, batch norm, the fused layer norm
// (Note [Fused LayerNorm on CUDA]).
//
// Pooling backward passes GATHER (each input element sums the outputs whose window
// holds it) instead of scattering with atomicAdd: the sum order is fixed, so gradients
// are bitwise reproducible run to run, which DP's fixed-order reduction relies on.
// Batch norm computes per-channel statistics (two passes over the data: mean, then
// centred variance, which does not cancel catastrophically) in one block per channel
// when the channels fill the GPU, else in S blocks per channel whose partials a second
// pass adds in a fixed order (Note [Split reductions], cuda_reduce.cu); then it applies
// the normalisation in a separate grid over all elements.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_half.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_register.h"
#include "backend/channels_last_sums.h"
#include "backend/elementwise_walk.h"
#include "backend/functors.h"
#include "backend/kernel_plan.h"
#include "dp/core/error.h"

namespace dp::backend::cuda_kernels {
namespace {

using i64 = std::int64_t;

constexpr int kRowsPerBlock = 8;  // warps (rows) per block of the softmax kernels
constexpr int kStatBlock = 512;   // threads per channel in the batch-norm statistics

// ---- kernels: softmax and NLL ------------------------------------------------------------

// A warp per row: classification heads have 10–1000 columns, where a block per row
// would leave most threads idle.
__global__ void log_softmax_kernel(const float* __restrict__ x, float* __restrict__ y, i64 rows,
                                   i64 cols) {
  const i64 warps_total = static_cast<i64>(gridDim.x) * kRowsPerBlock;
  for (i64 row = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.y; row < rows;
       row += warps_total) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;
    float mx = MaxOp::kIdentity;
    for (i64 c = threadIdx.x; c < cols; c += kWarp) mx = MaxOp{}(mx, xr[c]);
    mx = warp_reduce(mx, MaxOp{});
    // A row of -inf (or an all-masked row) would give -inf - -inf = NaN; shift by 0. A
    // +inf maximum shifts by itself, as on the CPU: inf - inf = NaN makes the row NaN, as
    // PyTorch's (shifting it by 0 gave NaN for the +inf and -inf for the rest).
    const float shift = isinf(mx) && mx < 0.0f ? 0.0f : mx;
    float sum = 0.0f;
    for (i64 c = threadIdx.x; c < cols; c += kWarp) sum += expf(xr[c] - shift);
    sum = warp_reduce(sum, SumOp{});
    // (x - max) - log(sum), as the CPU kernel (large logits keep log(sum)'s low bits).
    const float log_sum = logf(sum);
    for (i64 c = threadIdx.x; c < cols; c += kWarp) yr[c] = (xr[c] - shift) - log_sum;
  }
}

__global__ void log_softmax_backward_kernel(const float* __restrict__ gy, const float* __restrict__ y,
                                            float* __restrict__ gx, i64 rows, i64 cols) {
  const i64 warps_total = static_cast<i64>(gridDim.x) * kRowsPerBlock;
  for (i64 row = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.y; row < rows;
       row += warps_total) {
    const i64 base = row * cols;
    float sum = 0.0f;
    for (i64 c = threadIdx.x; c < cols; c += kWarp) sum += gy[base + c];
    sum = warp_reduce(sum, SumOp{});
    for (i64 c = threadIdx.x; c < cols; c += kWarp)
      gx[base + c] = gy[base + c] - expf(y[base + c]) * sum;
  }
}

__global__ void nll_forward_kernel(const float* __restrict__ logp, const i64* __restrict__ target,
                                   float* __restrict__ loss, i64 rows, i64 cols, i64 ignore_index) {
  for (i64 r = global_thread(); r < rows; r += grid_stride()) {
    const i64 t = target[r];
    // An out-of-range target cannot throw from a kernel without a host sync: NaN
    // poisons the loss, and the opt-in non-finite check names it.
    loss[r] = t == ignore_index ? 0.0f : (t >= 0 && t < cols) ? -logp[r * cols + t] : __int_as_float(0x7fc00000);
  }
}

__global__ void nll_backward_kernel(const float* __restrict__ gloss, const i64* __restrict__ target,
                                    float* __restrict__ gx, i64 rows, i64 cols, i64 ignore_index) {
  const i64 n = rows * cols;
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    const i64 r = i / cols, c = i - r * cols;
    const i64 t = target[r];
    float v = 0.0f;
    if (t == ignore_index) v = 0.0f;
    else if (t < 0 || t >= cols) v = __int_as_float(0x7fc00000);
    else if (c == t) v = -gloss[r];
    gx[i] = v;
  }
}

// ---- kernels: pooling ------------------------------------------------------------------------
// Index math in I: int32 where kernel_plan::pool_fits_i32 says every index fits (64-bit
// division costs several times a 32-bit one, and these kernels are mostly index
// math), int64 otherwise. PoolDims<I> is the shape in I. The loop counter stays i64:
// its last step may pass INT32_MAX before the test ends the loop.

template <typename I>
struct PoolDims {
  I N, C, H, W, P, Q, kh, kw, sh, sw, ph, pw;
  explicit PoolDims(const Pool2dShape& s)
      : N(static_cast<I>(s.N)), C(static_cast<I>(s.C)), H(static_cast<I>(s.H)), W(static_cast<I>(s.W)),
        P(static_cast<I>(s.P)), Q(static_cast<I>(s.Q)), kh(static_cast<I>(s.kernel_h)),
        kw(static_cast<I>(s.kernel_w)), sh(static_cast<I>(s.stride_h)), sw(static_cast<I>(s.stride_w)),
        ph(static_cast<I>(s.pad_h)), pw(static_cast<I>(s.pad_w)) {}
};

/// First index and stride of a grid-stride loop in I (the loop bound fits in I).
template <typename I>
__device__ __forceinline__ I first_index() {
  return static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
}
template <typename I>
__device__ __forceinline__ I index_stride() {
  return static_cast<I>(gridDim.x) * static_cast<I>(blockDim.x);
}

template <typename I>
__global__ void maxpool_forward_kernel(const PoolDims<I> s, const float* __restrict__ x,
                                       float* __restrict__ y, i64* __restrict__ indices) {
  const I total = s.N * s.C * s.P * s.Q;
  for (i64 t64 = first_index<I>(); t64 < total; t64 += index_stride<I>()) {
    const I t = static_cast<I>(t64);
    const I q = t % s.Q, p = (t / s.Q) % s.P, nc = t / (s.P * s.Q);
    const float* xp = x + static_cast<i64>(nc) * s.H * s.W;
    const I h0 = p * s.sh - s.ph, w0 = q * s.sw - s.pw;
    float best = MaxOp::kIdentity;
    I best_i = -1;
    for (I kh = 0; kh < s.kh; ++kh) {
      const I h = h0 + kh;
      if (h < 0 || h >= s.H) continue;  // padding never wins
      for (I kw = 0; kw < s.kw; ++kw) {
        const I w = w0 + kw;
        if (w < 0 || w >= s.W) continue;
        const float v = xp[h * s.W + w];
        // First maximum in window order; NaN wins (and stays), as in PyTorch.
        if (best_i < 0 || v > best || (v != v && best == best)) {
          best = v;
          best_i = h * s.W + w;
        }
      }
    }
    y[t] = best;
    indices[t] = best_i;
  }
}

/// Output rows/cols whose window covers input coordinate h: [lo, hi).
template <typename I>
__device__ __forceinline__ void covering(I h, I pad, I kernel, I stride, I out, I& lo, I& hi) {
  const I hp = h + pad;  // coordinate in the padded input
  lo = hp < kernel ? 0 : (hp - kernel) / stride + 1;
  hi = hp / stride + 1;
  if (hi > out) hi = out;
}

template <typename I>
__global__ void maxpool_backward_kernel(const PoolDims<I> s, const float* __restrict__ gy,
                                        const i64* __restrict__ indices, float* __restrict__ gx) {
  const I total = s.N * s.C * s.H * s.W;
  for (i64 t64 = first_index<I>(); t64 < total; t64 += index_stride<I>()) {
    const I t = static_cast<I>(t64);
    const I w = t % s.W, h = (t / s.W) % s.H, nc = t / (s.H * s.W);
    I p0, p1, q0, q1;
    covering(h, s.ph, s.kh, s.sh, s.P, p0, p1);
    covering(w, s.pw, s.kw, s.sw, s.Q, q0, q1);
    const i64 self = h * s.W + w;
    const I base = nc * s.P * s.Q;
    float acc = 0.0f;
    for (I p = p0; p < p1; ++p)
      for (I q = q0; q < q1; ++q)
        if (indices[base + p * s.Q + q] == self) acc += gy[base + p * s.Q + q];
    gx[t] = acc;
  }
}

// Note [Max-pool backward on a tiling]
// When the windows tile the input exactly (stride = kernel, no padding, H = P kh,
// W = Q kw: MaxPool2d(2) on even sizes, the CNN's pools), every input element lies in
// one window: a thread per window writes its kh x kw cells, the winner 0 + gy (the sum
// the general kernel forms, so -0 becomes +0 there as well) and the rest 0. It reads
// each index and gradient once instead of once per cell, with no division per cell: the
// general kernel above ran conv1's pool gradient (25.7 MB) far below the memory's speed
// (figures: docs/benchmarks/kernel-notes.md, "GPU
// divisions per element").
template <typename I>
__global__ void maxpool_backward_tiled_kernel(const PoolDims<I> s, const float* __restrict__ gy,
                                              const i64* __restrict__ indices, float* __restrict__ gx) {
  const I total = s.N * s.C * s.P * s.Q;
  for (i64 t64 = first_index<I>(); t64 < total; t64 += index_stride<I>()) {
    const I t = static_cast<I>(t64);
    const I q = t % s.Q, p = (t / s.Q) % s.P, nc = t / (s.P * s.Q);
    const i64 winner = indices[t];
    const float g = 0.0f + gy[t];
    float* plane = gx + static_cast<i64>(nc) * s.H * s.W;
    for (I dh = 0; dh < s.kh; ++dh) {
      const I h = p * s.kh + dh;
      for (I dw = 0; dw < s.kw; ++dw) {
        const I w = q * s.kw + dw;
        const I cell = h * s.W + w;
        plane[cell] = cell == winner ? g : 0.0f;
      }
    }
  }
}

/// PyTorch's divisor with count_include_pad: the window clipped to the padded input.
template <typename I>
__device__ __forceinline__ I avg_divisor(const PoolDims<I>& s, I p, I q) {
  const I h0 = p * s.sh - s.ph, w0 = q * s.sw - s.pw;
  const I h1 = min(h0 + s.kh, s.H + s.ph), w1 = min(w0 + s.kw, s.W + s.pw);
  return (h1 - h0) * (w1 - w0);
}

template <typename I>
__global__ void avgpool_forward_kernel(const PoolDims<I> s, const float* __restrict__ x,
                                       float* __restrict__ y) {
  const I total = s.N * s.C * s.P * s.Q;
  for (i64 t64 = first_index<I>(); t64 < total; t64 += index_stride<I>()) {
    const I t = static_cast<I>(t64);
    const I q = t % s.Q, p = (t / s.Q) % s.P, nc = t / (s.P * s.Q);
    const float* xp = x + static_cast<i64>(nc) * s.H * s.W;
    const I h0 = p * s.sh - s.ph, w0 = q * s.sw - s.pw;
    float acc = 0.0f;
    for (I h = max(h0, I{0}); h < min(h0 + s.kh, s.H); ++h)
      for (I w = max(w0, I{0}); w < min(w0 + s.kw, s.W); ++w) acc += xp[h * s.W + w];
    y[t] = acc / static_cast<float>(avg_divisor(s, p, q));
  }
}

template <typename I>
__global__ void avgpool_backward_kernel(const PoolDims<I> s, const float* __restrict__ gy,
                                        float* __restrict__ gx) {
  const I total = s.N * s.C * s.H * s.W;
  for (i64 t64 = first_index<I>(); t64 < total; t64 += index_stride<I>()) {
    const I t = static_cast<I>(t64);
    const I w = t % s.W, h = (t / s.W) % s.H, nc = t / (s.H * s.W);
    I p0, p1, q0, q1;
    covering(h, s.ph, s.kh, s.sh, s.P, p0, p1);
    covering(w, s.pw, s.kw, s.sw, s.Q, q0, q1);
    const I base = nc * s.P * s.Q;
    float acc = 0.0f;
    for (I p = p0; p < p1; ++p)
      for (I q = q0; q < q1; ++q)
        acc += gy[base + p * s.Q + q] / static_cast<float>(avg_divisor(s, p, q));
    gx[t] = acc;
  }
}

// ---- kernels: batch norm ----------------------------------------------------------------------
// x: (N, C, HW). Channel c's elements are N runs of HW contiguous floats.

/// Sum of f(flat index) over elements [b, e) of channel c's N * HW (in (n, k) order) with
/// the block's threads; every thread gets the result. The order is fixed by the block
/// size and the part: bitwise reproducible.
/// The thread's position (n, k) advances by blockDim.x elements a step without a
/// division (a 64-bit division per element held these sums far below the memory's speed:
/// docs/benchmarks/kernel-notes.md); it visits the same elements in the same order as j / HW would.
template <typename F>
__device__ float channel_part_sum(F f, i64 C, i64 HW, i64 c, i64 b, i64 e, float* smem) {
  float acc = 0.0f;
  i64 j = b + threadIdx.x;
  if (j < e) {
    const i64 step = blockDim.x, step_n = step / HW, step_k = step - step_n * HW;
    i64 n = j / HW, k = j - n * HW;
    const i64 plane = C * HW;
    const i64 base = c * HW;
    for (; j < e; j += step) {
      acc += f(n * plane + base + k);
      n += step_n;
      k += step_k;
      if (k >= HW) {
        k -= HW;
        ++n;
      }
    }
  }
  return block_reduce(acc, SumOp{}, smem);
}

/// Sum over all of channel c (one block per channel).
template <typename F>
__device__ float channel_sum(F f, i64 N, i64 C, i64 HW, i64 c, float* smem) {
  return channel_part_sum(f, C, HW, c, 0, N * HW, smem);
}

/// The S partials of a split reduction, added in index order (the second pass of
/// Note [Split reductions]); every thread that calls it gets the same bits.
__device__ __forceinline__ float sum_parts(const float* __restrict__ parts, int S) {
  float acc = parts[0];
  for (int s = 1; s < S; ++s) acc += parts[s];
  return acc;
}

template <typename T>
__global__ void bn_stats_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ x, float eps,
                                float momentum, float* running_mean, float* running_var,
                                float* __restrict__ save_mean, float* __restrict__ save_invstd) {
  __shared__ float smem[kWarp];
  const i64 c = blockIdx.x;
  const float count = static_cast<float>(N * HW);
  const float mean = channel_sum([&](i64 i) { return load_acc(x[i]); }, N, C, HW, c, smem) / count;
  const float var =
      channel_sum([&](i64 i) { const float d = load_acc(x[i]) - mean; return d * d; }, N, C, HW, c, smem) /
      count;  // biased: used to normalise
  if (threadIdx.x == 0) {
    save_mean[c] = mean;
    save_invstd[c] = rsqrtf(var + eps);
    if (running_mean) {
      // Unbiased variance for the running estimate, as PyTorch.
      const float unbiased = count > 1.0f ? var * count / (count - 1.0f) : var;
      running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mean;
      running_var[c] = (1.0f - momentum) * running_var[c] + momentum * unbiased;
    }
  }
}

// The split statistics (Note [Split reductions]): grid (S, C), block (s, c) takes
// part s of channel c. Pass 1: sums of x. Pass 2: every block recomputes the mean from
// the S partials (same order, same bits) and sums (x - mean)^2. Then bn_finalize.
// Over storage type T (float, or a 16-bit type widened as it is loaded: a 16-bit batch
// norm, Note [Batch norm in 16 bits] in cpu_nn.cpp, or a convolution's bias gradient,
// Note [Convolution bias gradient]); the sums are float's either way.
template <typename T>
__global__ void bn_partial_sum_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ x,
                                      float* __restrict__ part_sum) {
  __shared__ float smem[kWarp];
  const int S = static_cast<int>(gridDim.x), sp = static_cast<int>(blockIdx.x);
  const i64 c = blockIdx.y;
  const kernel_plan::Part pt = kernel_plan::part_of(N * HW, S, sp);
  const float v = channel_part_sum([&](i64 i) { return load_acc(x[i]); }, C, HW, c, pt.begin, pt.end, smem);
  if (threadIdx.x == 0) part_sum[c * S + sp] = v;
}

template <typename T>
__global__ void bn_partial_var_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ x,
                                      const float* __restrict__ part_sum, float* __restrict__ part_sq) {
  __shared__ float smem[kWarp];
  const int S = static_cast<int>(gridDim.x), sp = static_cast<int>(blockIdx.x);
  const i64 c = blockIdx.y;
  const float mean = sum_parts(part_sum + c * S, S) / static_cast<float>(N * HW);
  const kernel_plan::Part pt = kernel_plan::part_of(N * HW, S, sp);
  const float v = channel_part_sum([&](i64 i) { const float d = load_acc(x[i]) - mean; return d * d; }, C, HW, c,
                                   pt.begin, pt.end, smem);
  if (threadIdx.x == 0) part_sq[c * S + sp] = v;
}

__global__ void bn_finalize_kernel(i64 N, i64 C, i64 HW, int S, const float* __restrict__ part_sum,
                                   const float* __restrict__ part_sq, float eps, float momentum,
                                   float* running_mean, float* running_var, float* __restrict__ save_mean,
                                   float* __restrict__ save_invstd) {
  const float count = static_cast<float>(N * HW);
  for (i64 c = global_thread(); c < C; c += grid_stride()) {
    const float mean = sum_parts(part_sum + c * S, S) / count;
    const float var = sum_parts(part_sq + c * S, S) / count;  // biased: used to normalise
    save_mean[c] = mean;
    save_invstd[c] = rsqrtf(var + eps);
    if (running_mean) {
      const float unbiased = count > 1.0f ? var * count / (count - 1.0f) : var;
      running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mean;
      running_var[c] = (1.0f - momentum) * running_var[c] + momentum * unbiased;
    }
  }
}

// ---- kernels: per-channel maps ---------------------------------------------------------
// Note [Per-channel maps]
// Batch norm's normalisation and input gradient, and a convolution's bias (+ ReLU),
// touch each element of an (N, C, HW) tensor once with constants of its channel.
// Finding the channel as (i / HW) % C in 64 bits, a software division per element,
// held batch norm's forward far below the memory's speed (figures in
// docs/benchmarks/kernel-notes.md). channel_map_kernel takes V consecutive elements as one
// 16-byte pack (4 floats, or 8 of a 16-bit type: Note [Packed elementwise access]) when
// HW % V == 0 and every pointer is 16-byte aligned (the V share a channel), else V = 1,
// and finds the channel of item t as (t / (HW / V)) % C with FastDivider
// (Note [Division by a runtime constant] in kernel_plan.h). Tensors of 2^31 items or
// more take a 64-bit grid-stride loop with the same Op, so each element goes through
// one float expression whichever kernel runs. A 16-bit element is widened as it is
// loaded and the result rounded once as it is stored (Note [Batch norm in 16 bits]).

struct ChannelIndex {
  kernel_plan::FastDivider plane;     // items per (n, c) plane: HW / V
  kernel_plan::FastDivider channels;  // C
  __device__ __forceinline__ std::uint32_t channel(std::uint32_t item) const {
    return channels.mod(plane.div(item));
  }
};

/// out = op.at(c)(a, b) elementwise over storage E (float math); b is read only when
/// Op::kInputs == 2; out may be a.
template <int V, typename E, typename Op>
__global__ void channel_map_kernel(std::uint32_t items, ChannelIndex ix, const E* a, const E* __restrict__ b,
                                   E* out, Op op) {
  const std::uint32_t stride = gridDim.x * blockDim.x;  // items + stride < 2^32: items < 2^31
  for (std::uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < items; t += stride) {
    const auto f = op.at(ix.channel(t));
    const walk::Pack<E, V> pa = walk::load_pack<V>(a, t);
    walk::Pack<E, V> pb{};
    if constexpr (Op::kInputs == 2) pb = walk::load_pack<V>(b, t);
    walk::Pack<E, V> r;
#pragma unroll
    for (int l = 0; l < V; ++l) {
      r.v[l] = store_acc<E>(f(load_acc(pa.v[l]), Op::kInputs == 2 ? load_acc(pb.v[l]) : 0.0f));
    }
    walk::store_pack<V>(out, t, r);
  }
}

/// channel_map_kernel for tensors of 2^31 items or more: 64-bit indices, one element a
/// thread, the channel by division.
template <typename E, typename Op>
__global__ void channel_map_wide_kernel(i64 total, i64 HW, i64 C, const E* a, const E* __restrict__ b, E* out,
                                        Op op) {
  for (i64 i = global_thread(); i < total; i += grid_stride()) {
    const float vb = Op::kInputs == 2 ? load_acc(b[i]) : 0.0f;
    out[i] = store_acc<E>(op.at((i / HW) % C)(load_acc(a[i]), vb));
  }
}

/// out = op.at(c)(a, b) over the (N, C, HW) tensor of storage E (Note [Per-channel maps]).
template <typename E, typename Op>
void channel_map(cudaStream_t stream, i64 N, i64 C, i64 HW, const E* a, const E* b, E* out, const Op& op) {
  constexpr int kLanes = walk::pack_lanes<E>;
  const bool vec = HW % kLanes == 0 && walk::contiguous_lanes(kLanes, a, out) == kLanes &&
                   (Op::kInputs == 1 || walk::contiguous_lanes(kLanes, b) == kLanes);
  const int V = vec ? kLanes : 1;
  const i64 items = N * C * HW / V;
  if (!kernel_plan::fast_divisible(items, HW / V) || !kernel_plan::fast_divisible(items, C)) {
    channel_map_wide_kernel<<<grid_for(N * C * HW), kBlock, 0, stream>>>(N * C * HW, HW, C, a, b, out, op);
  } else {
    const ChannelIndex ix{kernel_plan::FastDivider(static_cast<std::uint32_t>(HW / V)),
                          kernel_plan::FastDivider(static_cast<std::uint32_t>(C))};
    const auto n = static_cast<std::uint32_t>(items);
    if (vec) {
      channel_map_kernel<kLanes><<<grid_for(items), kBlock, 0, stream>>>(n, ix, a, b, out, op);
    } else {
      channel_map_kernel<1><<<grid_for(items), kBlock, 0, stream>>>(n, ix, a, b, out, op);
    }
  }
  DP_CUDA_CHECK_LAUNCH();
}

/// y = (x - mean[c]) * invstd[c] * gamma[c] + beta[c]; gamma/beta may be null (1, 0).
/// `var_mode`: scale holds a variance and eps is added (eval), else invstd directly.
struct BnApplyOp {
  static constexpr int kInputs = 1;
  const float* mean;
  const float* scale;  // invstd, or the variance when var_mode
  bool var_mode;
  float eps;
  const float* gamma;
  const float* beta;
  struct At {
    float mean, invstd, g, b;
    __device__ __forceinline__ float operator()(float x, float) const { return (x - mean) * invstd * g + b; }
  };
  __device__ __forceinline__ At at(i64 c) const {
    return {mean[c], var_mode ? rsqrtf(scale[c] + eps) : scale[c], gamma ? gamma[c] : 1.0f, beta ? beta[c] : 0.0f};
  }
};

/// gx = gamma * invstd / M * (M * gy - Σgy - xhat * Σ(gy * xhat)) (a = gy, b = x, M = N * HW;
/// sums[c] = Σgy, sums[C + c] = Σ(gy * xhat)).
struct BnBackwardApplyOp {
  static constexpr int kInputs = 2;
  i64 C;
  float m;  // N * HW
  const float* gamma;
  const float* save_mean;
  const float* save_invstd;
  const float* sums;
  struct At {
    float g, invstd, mean, m, sum_gy, sum_gy_xhat;
    __device__ __forceinline__ float operator()(float gy, float x) const {
      const float xhat = (x - mean) * invstd;
      return g * invstd / m * (m * gy - sum_gy - xhat * sum_gy_xhat);
    }
  };
  __device__ __forceinline__ At at(i64 c) const {
    return {gamma ? gamma[c] : 1.0f, save_invstd[c], save_mean[c], m, sums[c], sums[C + c]};
  }
};

/// y = y + bias[c] (Binary<Add>, what cudnnAddTensor with alpha = beta = 1 computes),
/// then Unary<Relu> when `relu`; no bias: the ReLU alone.
struct BiasReluOp {
  static constexpr int kInputs = 1;
  const float* bias;
  bool relu;
  struct At {
    float b;
    bool has_bias, relu;
    __device__ __forceinline__ float operator()(float y, float) const {
      float v = has_bias ? Binary<BinaryOp::Add>{}(y, b) : y;
      return relu ? Unary<UnaryOp::Relu>{}(v) : v;
    }
  };
  __device__ __forceinline__ At at(i64 c) const { return {bias ? bias[c] : 0.0f, bias != nullptr, relu}; }
};

// sums[c] = Σ gy, sums[C + c] = Σ gy * xhat; also ggamma/gbeta when requested.
template <typename T>
__global__ void bn_backward_reduce_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ gy,
                                          const T* __restrict__ x,
                                          const float* __restrict__ save_mean,
                                          const float* __restrict__ save_invstd,
                                          float* __restrict__ sums, float* ggamma, float* gbeta) {
  __shared__ float smem[kWarp];
  const i64 c = blockIdx.x;
  const float mean = save_mean[c], invstd = save_invstd[c];
  const float sum_gy = channel_sum([&](i64 i) { return load_acc(gy[i]); }, N, C, HW, c, smem);
  const float sum_gy_xhat =
      channel_sum([&](i64 i) { return load_acc(gy[i]) * (load_acc(x[i]) - mean) * invstd; }, N, C, HW, c, smem);
  if (threadIdx.x == 0) {
    sums[c] = sum_gy;
    sums[C + c] = sum_gy_xhat;
    if (gbeta) gbeta[c] = sum_gy;
    if (ggamma) ggamma[c] = sum_gy_xhat;
  }
}

// The split backward reduction: grid (S, C); part[c * S + s] = Σ gy and
// part[C * S + c * S + s] = Σ gy * xhat over part s of channel c; then
// bn_backward_finalize adds the S partials in order.
template <typename T>
__global__ void bn_backward_partial_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ gy,
                                           const T* __restrict__ x, const float* __restrict__ save_mean,
                                           const float* __restrict__ save_invstd, float* __restrict__ part) {
  __shared__ float smem[kWarp];
  const int S = static_cast<int>(gridDim.x), sp = static_cast<int>(blockIdx.x);
  const i64 c = blockIdx.y;
  const float mean = save_mean[c], invstd = save_invstd[c];
  const kernel_plan::Part pt = kernel_plan::part_of(N * HW, S, sp);
  const float a = channel_part_sum([&](i64 i) { return load_acc(gy[i]); }, C, HW, c, pt.begin, pt.end, smem);
  const float b = channel_part_sum([&](i64 i) { return load_acc(gy[i]) * (load_acc(x[i]) - mean) * invstd; }, C,
                                   HW, c, pt.begin, pt.end, smem);
  if (threadIdx.x == 0) {
    part[c * S + sp] = a;
    part[C * S + c * S + sp] = b;
  }
}

__global__ void bn_backward_finalize_kernel(i64 C, int S, const float* __restrict__ part,
                                            float* __restrict__ sums, float* ggamma, float* gbeta) {
  for (i64 c = global_thread(); c < C; c += grid_stride()) {
    const float sum_gy = sum_parts(part + c * S, S);
    const float sum_gy_xhat = sum_parts(part + C * S + c * S, S);
    sums[c] = sum_gy;
    sums[C + c] = sum_gy_xhat;
    if (gbeta) gbeta[c] = sum_gy;
    if (ggamma) ggamma[c] = sum_gy_xhat;
  }
}

// ---- kernels: channels-last batch norm (Note [Channels-last sums] in channels_last_sums.h) ----

/// load_acc as a functor: a stored element widened to float.
struct Widen {
  template <typename T>
  __device__ __forceinline__ float operator()(T v) const { return load_acc(v); }
};

/// Block (s, t) of plan p: part[k·C·S + c·S + s] = sum k of channel c over split s, for
/// tile t's channels (K = 1: Σ x or Σ (x - mean)²; K = 2: Σ gy and Σ gy·xhat). `mean` and
/// `invstd` (per channel) as the sums need them.
template <nhwc::Sums S, int V, typename T>
__global__ void __launch_bounds__(nhwc::kThreads)
    bn_nhwc_partial_kernel(nhwc::Plan p, const T* __restrict__ x, const T* __restrict__ gy, bool packed,
                           const float* __restrict__ mean, const float* __restrict__ invstd, float* __restrict__ part) {
  constexpr int K = nhwc::kSums<S>;
  __shared__ float shared[K][nhwc::kThreads * V];
  const int split = static_cast<int>(blockIdx.x), g = static_cast<int>(threadIdx.x), r = static_cast<int>(threadIdx.y);
  const i64 t = blockIdx.y;
  const i64 c0 = p.first_channel(t, g);
  nhwc::RowTerms<S, V, T, Widen> terms{x, gy, p.C, packed, {}, {}, Widen{}};
  if constexpr (S != nhwc::Sums::X) {
#pragma unroll
    for (int l = 0; l < V; ++l) {
      terms.mean[l] = c0 + l < p.C ? mean[c0 + l] : 0.0f;
      if constexpr (S == nhwc::Sums::Backward) terms.invstd[l] = c0 + l < p.C ? invstd[c0 + l] : 0.0f;
    }
  }
  float acc[K][V];
  nhwc::thread_sums(p, split, t, g, r, terms, acc);
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int l = 0; l < V; ++l) shared[k][nhwc::slot(p, g, r, l)] = acc[k][l];
  __syncthreads();
  const int j = r * p.cols + g;  // this thread adds column j of the tile
  const i64 c = t * p.width() + j;
  if (j < p.width() && c < p.C) {
#pragma unroll
    for (int k = 0; k < K; ++k) part[k * p.C * p.splits + c * p.splits + split] = nhwc::block_column(p, shared[k], j);
  }
}

/// mean[c] = the S partial sums of channel c added in order, over `count` values: the
/// bits bn_finalize_kernel then computes again.
__global__ void bn_mean_kernel(i64 C, int S, float count, const float* __restrict__ part_sum,
                               float* __restrict__ mean) {
  for (i64 c = global_thread(); c < C; c += grid_stride()) mean[c] = sum_parts(part_sum + c * S, S) / count;
}

/// channel_map_kernel over a channels-last tensor: a pack of V adjacent elements holds V
/// channels, (t mod C/V)·V onwards (C % V == 0), each lane its own channel's constants.
template <int V, typename E, typename Op>
__global__ void nhwc_channel_map_kernel(std::uint32_t packs, kernel_plan::FastDivider groups, const E* a,
                                        const E* __restrict__ b, E* out, Op op) {
  const std::uint32_t stride = gridDim.x * blockDim.x;  // packs + stride < 2^32: packs < 2^31
  for (std::uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < packs; t += stride) {
    const std::uint32_t c0 = groups.mod(t) * V;
    const walk::Pack<E, V> pa = walk::load_pack<V>(a, t);
    walk::Pack<E, V> pb{};
    if constexpr (Op::kInputs == 2) pb = walk::load_pack<V>(b, t);
    walk::Pack<E, V> r;
#pragma unroll
    for (int l = 0; l < V; ++l) {
      r.v[l] = store_acc<E>(op.at(c0 + l)(load_acc(pa.v[l]), Op::kInputs == 2 ? load_acc(pb.v[l]) : 0.0f));
    }
    walk::store_pack<V>(out, t, r);
  }
}

// ---- kernels: per-channel sums (a convolution's bias gradient) ----------------------------
// Note [Convolution bias gradient]
// gbias[c] = Σ_n Σ_hw gy[n, c, hw]: the batch-norm reduction's shape, so the same plan
// (bn_splits) and the same fixed-order block sums. cuDNN's cudnnConvolutionBackwardBias
// took longer for the CNN's conv1 gradient (256 x 32 x 28 x 28, 25.7 MB) than the
// convolution's own three passes; this reads the gradient once, at about the memory's
// speed (figures: docs/benchmarks/kernel-notes.md, "Convolution bias gradient").
// A 16-bit gradient is widened as it is loaded and each sum rounded once as it is
// stored: the float32 sums of the widened values, in the same order, rounded.
template <typename T>
__global__ void channel_sum_kernel(i64 N, i64 C, i64 HW, const T* __restrict__ x, T* __restrict__ out) {
  __shared__ float smem[kWarp];
  const i64 c = blockIdx.x;
  const float v = channel_sum([&](i64 i) { return load_acc(x[i]); }, N, C, HW, c, smem);
  if (threadIdx.x == 0) out[c] = store_acc<T>(v);
}

template <typename T>
__global__ void channel_sum_finalize_kernel(i64 C, int S, const float* __restrict__ part, T* __restrict__ out) {
  for (i64 c = global_thread(); c < C; c += grid_stride()) out[c] = store_acc<T>(sum_parts(part + c * S, S));
}

// ---- kernels: per-channel fill (a 16-bit convolution's bias, Note [16-bit convolutions on CUDA]) ----

/// y[n, c, k] = bias[c]: the bias's bits, whatever their type E. A thread writes one word
/// W of sizeof(W) / sizeof(E) elements of one channel (Note [Per-channel maps]).
template <typename E, typename W>
__global__ void channel_fill_kernel(std::uint32_t items, ChannelIndex ix, const E* __restrict__ bias,
                                    W* __restrict__ y) {
  constexpr int V = sizeof(W) / sizeof(E);
  const std::uint32_t stride = gridDim.x * blockDim.x;  // items + stride < 2^32: items < 2^31
  for (std::uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < items; t += stride) {
    E v[V];
    const E b = bias[ix.channel(t)];
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = b;
    W w;
    memcpy(&w, v, sizeof(W));
    y[t] = w;
  }
}

/// channel_fill_kernel for tensors of 2^31 items or more: 64-bit indices, the channel by
/// division.
template <typename E>
__global__ void channel_fill_wide_kernel(i64 total, i64 HW, i64 C, const E* __restrict__ bias, E* __restrict__ y) {
  for (i64 i = global_thread(); i < total; i += grid_stride()) y[i] = bias[(i / HW) % C];
}

// ---- kernels: layer norm ------------------------------------------------------------------
// Note [Fused LayerNorm on CUDA]
// Op::LayerNorm and Op::LayerNormBackward in float32 with the CPU kernel's formulas
// (Note [Fused LayerNorm] in cpu_nn.cpp): mean, corrected by the residuals' mean (Note
// [An exact mean for a constant row] there), then the centred sum of squares over
// the row held in registers (two passes, never E[x^2] - mean^2, which cancels), rstd =
// 1 / sqrt(var + eps) correctly rounded; backward gx = rstd (g - mean(g) - x̂ mean(g x̂)).
//
// Who takes a row. A row of at most kLnWarpCols = 512 columns is one warp's, eight rows
// a block (a block per 128-wide row of a small GPT would leave most of it idle); wider
// rows (GPT-2's 768..1600) take a block of kLnThreads = 256 threads. Thread t of the row's team (a warp or the
// block, T threads) owns columns t, t + T, t + 2T, ...: consecutive threads read
// consecutive floats, and it holds them in V registers, V the power of two with T V >=
// cols (at most 16, so the backward's four arrays stay within 255 registers at 256
// threads). Rows over 16 x 256 = 4096 columns do not fit: there V = 0 and each pass
// reads the row again, mostly from the caches. The forward walks rows with a
// grid-stride loop (at most kMaxBlocks blocks, any number of rows).
//
// Sum orders. A thread adds its columns in column order, then the team combines: the
// warp by xor shuffles (every lane ends with the same bits, as a + b = b + a), a block
// its warps' sums by a fixed xor tree (block_reduce). The order depends on cols alone (which
// team, its stride), never on V, the grid or the GPU.
//
// The weight and bias gradients: no float atomics. The rows are cut into tiles,
// ln_tiles(rows): min(ceil(rows / 16), 1024) tiles of equal length (the last shorter),
// one block each. A thread adds gy x̂ and gy of its columns over its rows in row order in
// registers (V = 0: in the tile's partial row, which only it touches); in a warp-per-row
// block the eight warps' sums are then added in warp order through shared memory. Each
// tile writes its partial row (cols for gw, then cols for gb) to scratch, and
// ln_param_sums_kernel adds a column's partials: 8 slices of consecutive tiles, each in
// tile order, then the slices in slice order. Every order is fixed by (rows, cols), so
// gw and gb are bitwise the same run to run and on any GPU: DP's and DDP's gradients
// stay bitwise alike only if each device's are. The scratch is 2 tiles cols floats
// (about an eighth of x's size, 16-row tiles) from the caching allocator on the compute
// stream, released once the kernels are enqueued (Note [Caching allocator streams]).
// Zero rows write gw = gb = 0, the sums over nothing, as the CPU does.
//
// Against the CPU. The CPU adds a row in 16 lanes and then a pairwise tree (fold_lanes)
// and gw/gb per block of 64 rows; here each thread's strided columns and a tree, and
// 16-row tiles; nvcc also contracts products and sums into FMAs. The results differ in
// the last bits of each sum: the rounding errors of n terms grow like sqrt(n) ulps of
// the partial sums, ~1e-7 relative for mean and rstd over a row, and ~5e-6 absolute for
// gw and gb over the op table's 331 rows of gradients in [-1, 1] (sums of size ~10).
// kLayerNormTol (tests/backend/op_cases.cpp) allows 1e-5 + 1e-4 |want|, the backward's
// absolute part grown as sqrt(rows / 64) past 64 rows (sum_tol), as those errors grow.

constexpr int kLnRowsPerBlock = 8;   // warps (rows) per block when a warp takes a row
constexpr int kLnWarpCols = 512;     // widest row a warp takes: 16 registers a lane
constexpr int kLnThreads = 256;      // threads of a block that takes a row
constexpr int kLnMaxValues = 16;     // most columns a thread holds in registers
constexpr i64 kLnMinTileRows = 16;   // most rows in a backward tile below the tile cap
constexpr i64 kLnMaxTiles = 1024;    // most tiles: about 8 blocks per SM on 132 SMs
constexpr int kLnSumSlices = 8;      // warps of ln_param_sums_kernel, each a slice of the tiles

static_assert(kLnWarpCols == kWarp * kLnMaxValues, "a warp holds a whole row of kLnWarpCols");
static_assert(kLnRowsPerBlock * kWarp == kLnThreads, "both kinds of block have kLnThreads threads");

/// The sum of v over the row's team (a warp, or the whole block when kTeam > kWarp);
/// every thread of the team gets the same bits. A block's call ends with a barrier.
template <int kTeam>
__device__ __forceinline__ float team_sum(float v, float* smem) {
  if constexpr (kTeam == kWarp) {
    return warp_reduce(v, SumOp{});
  } else {
    return block_reduce(v, SumOp{}, smem);
  }
}

/// y = (x - mean) rstd w + b per row; mean and rstd written. Block (32, 8) when kTeam
/// is a warp, (kLnThreads) otherwise; V: columns a thread holds (0: none, re-read).
template <int kTeam, int V>
__global__ void __launch_bounds__(kLnThreads)
    layer_norm_kernel(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                      float* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, i64 rows,
                      i64 cols, float inv_cols, float eps) {
  __shared__ float smem[kWarp];
  constexpr int R = V > 0 ? V : 1;
  const int t = threadIdx.x;
  const i64 teams = static_cast<i64>(gridDim.x) * blockDim.y;
  // The loop's bound is uniform over the team: every lane reaches the shuffles, every
  // thread of a block its barriers.
  for (i64 row = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += teams) {
    const float* xr = x + row * cols;
    float* yr = y + row * cols;
    float v[R];
    float s = 0.0f;
    if constexpr (V > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const i64 j = t + static_cast<i64>(k) * kTeam;
        v[k] = j < cols ? xr[j] : 0.0f;
        if (j < cols) s += v[k];
      }
    } else {
      for (i64 j = t; j < cols; j += kTeam) s += xr[j];
    }
    const float mu0 = team_sum<kTeam>(s, smem) * inv_cols;
    // Note [An exact mean for a constant row] in cpu_nn.cpp: the residuals' mean added.
    float c = 0.0f;
    if constexpr (V > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const i64 j = t + static_cast<i64>(k) * kTeam;
        if (j < cols) c += v[k] - mu0;
      }
    } else {
      for (i64 j = t; j < cols; j += kTeam) c += xr[j] - mu0;
    }
    const float mu = __fadd_rn(mu0, __fmul_rn(team_sum<kTeam>(c, smem), inv_cols));
    float q = 0.0f;
    if constexpr (V > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const i64 j = t + static_cast<i64>(k) * kTeam;
        const float d = v[k] - mu;
        if (j < cols) q += d * d;
      }
    } else {
      for (i64 j = t; j < cols; j += kTeam) {
        const float d = xr[j] - mu;
        q += d * d;
      }
    }
    const float var = team_sum<kTeam>(q, smem) * inv_cols;  // biased, as the CPU's
    const float rs = 1.0f / sqrtf(var + eps);
    if (t == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
    auto out = [&](i64 j, float xv) {
      float o = (xv - mu) * rs;
      if (w) o *= w[j];
      if (b) o += b[j];
      yr[j] = o;
    };
    if constexpr (V > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const i64 j = t + static_cast<i64>(k) * kTeam;
        if (j < cols) out(j, v[k]);
      }
    } else {
      for (i64 j = t; j < cols; j += kTeam) out(j, xr[j]);
    }
  }
}

/// gx of rows [blockIdx.x tile_rows, + tile_rows), and when `part` is not null the tile's
/// partial sums of gy x̂ (part[tile][0, cols)) and gy (part[tile][cols, 2 cols)). Block
/// shapes and V as layer_norm_kernel's; one block per tile.
template <int kTeam, int V>
__global__ void __launch_bounds__(kLnThreads)
    layer_norm_backward_kernel(const float* __restrict__ x, const float* __restrict__ w,
                               const float* __restrict__ mean, const float* __restrict__ rstd,
                               const float* __restrict__ gy, float* __restrict__ gx, float* __restrict__ part,
                               i64 rows, i64 cols, i64 tile_rows, float inv_cols) {
  __shared__ float smem[kWarp];
  // A warp-per-row block adds its warps' sums here: gw's in [0, kWarp V), gb's after.
  constexpr int kAcc = kTeam == kWarp && V > 0 ? 2 * kWarp * V : 1;
  __shared__ float acc[kAcc];
  constexpr int R = V > 0 ? V : 1;
  const int t = threadIdx.x;
  const i64 begin = static_cast<i64>(blockIdx.x) * tile_rows;
  const i64 end = rows - begin < tile_rows ? rows : begin + tile_rows;
  float* pw = part ? part + static_cast<i64>(blockIdx.x) * 2 * cols : nullptr;
  float* pb = part ? pw + cols : nullptr;
  float dw[R], db[R];
#pragma unroll
  for (int k = 0; k < R; ++k) dw[k] = db[k] = 0.0f;
  for (i64 row = begin + threadIdx.y; row < end; row += blockDim.y) {
    const float* xr = x + row * cols;
    const float* gr = gy + row * cols;
    float* gxr = gx + row * cols;
    const float mu = mean[row], rs = rstd[row];
    float xv[R], gv[R];
    float sg = 0.0f, sgx = 0.0f, sx = 0.0f;
    if constexpr (V > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const i64 j = t + static_cast<i64>(k) * kTeam;
        xv[k] = j < cols ? xr[j] : 0.0f;
        gv[k] = j < cols ? gr[j] : 0.0f;
        if (j < cols) {
          const float g = w ? gv[k] * w[j] : gv[k];
          const float xh = (xv[k] - mu) * rs;
          sg += g;
          sgx += g * xh;
          sx += xh;
        }
      }
    } else {
      for (i64 j = t; j < cols; j += kTeam) {
        const float g = w ? gr[j] * w[j] : gr[j];
        const float xh = (xr[j] - mu) * rs;
        sg += g;
        sgx += g * xh;
        sx += xh;
      }
    }
    // Note [Layer norm's input gradient, centred] (cpu_nn.cpp): x̂ less its mean c.
    const float g_mean = team_sum<kTeam>(sg, smem) * inv_cols;
    const float c = team_sum<kTeam>(sx, smem) * inv_cols;
    const float gx_mean = team_sum<kTeam>(sgx, smem) * inv_cols - c * g_mean;
    if constexpr (V > 0) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const i64 j = t + static_cast<i64>(k) * kTeam;
        if (j < cols) {
          const float xh = (xv[k] - mu) * rs;
          const float g = w ? gv[k] * w[j] : gv[k];
          gxr[j] = rs * (g - g_mean - (xh - c) * gx_mean);
          dw[k] += gv[k] * xh;
          db[k] += gv[k];
        }
      }
    } else {
      for (i64 j = t; j < cols; j += kTeam) {
        const float xh = (xr[j] - mu) * rs;
        const float gj = gr[j];
        const float g = w ? gj * w[j] : gj;
        gxr[j] = rs * (g - g_mean - (xh - c) * gx_mean);
        if (pw) {  // this thread's columns: no other thread reads or writes them
          pw[j] = (row == begin ? 0.0f : pw[j]) + gj * xh;
          pb[j] = (row == begin ? 0.0f : pb[j]) + gj;
        }
      }
    }
  }
  if (!pw) return;  // uniform over the block: no barrier is skipped by some threads only
  if constexpr (kTeam == kWarp) {
    // The warps' sums in warp order, one warp at a time.
    for (int wi = 0; wi < static_cast<int>(blockDim.y); ++wi) {
      if (static_cast<int>(threadIdx.y) == wi) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int j = t + k * kWarp;
          if (j < cols) {
            acc[j] = wi == 0 ? dw[k] : acc[j] + dw[k];
            acc[kWarp * V + j] = wi == 0 ? db[k] : acc[kWarp * V + j] + db[k];
          }
        }
      }
      __syncthreads();
    }
    for (int j = static_cast<int>(threadIdx.y) * kWarp + t; j < cols; j += kLnThreads) {
      pw[j] = acc[j];
      pb[j] = acc[kWarp * V + j];
    }
  } else if constexpr (V > 0) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const i64 j = t + static_cast<i64>(k) * kTeam;
      if (j < cols) {
        pw[j] = dw[k];
        pb[j] = db[k];
      }
    }
  }
}

/// gw[j] and gb[j] (either may be null) from the `tiles` partial rows of
/// layer_norm_backward_kernel, in the order of Note [Fused LayerNorm on CUDA]. Block
/// (kWarp, kLnSumSlices): 32 columns, thread row s adds slice s of the tiles.
__global__ void ln_param_sums_kernel(const float* __restrict__ part, float* __restrict__ gw,
                                     float* __restrict__ gb, i64 tiles, i64 cols) {
  __shared__ float sw[kLnSumSlices][kWarp], sb[kLnSumSlices][kWarp];
  const int t = threadIdx.x, s = threadIdx.y;
  const kernel_plan::Part pt = kernel_plan::part_of(tiles, kLnSumSlices, s);
  for (i64 c0 = static_cast<i64>(blockIdx.x) * kWarp; c0 < cols; c0 += static_cast<i64>(gridDim.x) * kWarp) {
    const i64 j = c0 + t;
    float aw = 0.0f, ab = 0.0f;
    if (j < cols) {
      for (i64 i = pt.begin; i < pt.end; ++i) {
        aw += part[i * 2 * cols + j];
        ab += part[i * 2 * cols + cols + j];
      }
    }
    sw[s][t] = aw;
    sb[s][t] = ab;
    __syncthreads();
    if (s == 0 && j < cols) {
      float vw = sw[0][t], vb = sb[0][t];
      for (int k = 1; k < kLnSumSlices; ++k) {
        vw += sw[k][t];
        vb += sb[k][t];
      }
      if (gw) gw[j] = vw;
      if (gb) gb[j] = vb;
    }
    __syncthreads();  // before the next columns overwrite sw and sb
  }
}

// ---- host helpers --------------------------------------------------------------------------

void check_pool(const char* op, const Pool2dShape& s) {
  DP_CHECK(s.N >= 0 && s.C >= 0 && s.H >= 0 && s.W >= 0 && s.P >= 0 && s.Q >= 0 &&
               s.kernel_h > 0 && s.kernel_w > 0 && s.stride_h > 0 && s.stride_w > 0 &&
               s.pad_h >= 0 && s.pad_w >= 0,
           op, ": expected positive kernel and stride, non-negative sizes and padding; got N=",
           s.N, " C=", s.C, " H=", s.H, " W=", s.W, " kernel=", s.kernel_h, "x", s.kernel_w,
           " stride=", s.stride_h, "x", s.stride_w, " pad=", s.pad_h, "x", s.pad_w);
}

/// Calls f(I{}) with I = int32 when the pooling shape's indices fit (kernel_plan), else
/// int64.
template <typename F>
void with_pool_index(const Pool2dShape& s, F&& f) {
  if (kernel_plan::pool_fits_i32(s)) {
    f(std::int32_t{0});
  } else {
    f(i64{0});
  }
}

void check_bn(const char* op, i64 N, i64 C, i64 HW) {
  DP_CHECK(N > 0 && C > 0 && HW > 0, op, ": expected positive (N, C, HW), got (", N, ", ", C,
           ", ", HW, ")");
  DP_CHECK(C <= 0x7fffffff, op, ": ", C, " channels exceed a grid");
}

void check_float_dtype(const char* op, DType dtype) {
  DP_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, op,
           ": expected float32, bfloat16 or float16 elements, got ", dtype_name(dtype));
}

/// Bytes of one element of a floating dtype.
std::size_t float_bytes(DType dtype) { return dtype == DType::F32 ? sizeof(float) : sizeof(std::uint16_t); }

void check_rows(const char* op, i64 rows, i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, op, ": expected rows >= 0 and cols >= 0, got (", rows, ", ",
           cols, ")");
}

/// Calls f(team, values) with std::integral_constants for a row of `cols` (Note [Fused
/// LayerNorm on CUDA]): a warp and the fewest of 1..16 registers a lane that hold the
/// row, a block of kLnThreads and 4..16 a thread, or the block with none (0).
template <typename F>
void with_ln_shape(i64 cols, F&& f) {
  using std::integral_constant;
  if (cols <= kWarp) {
    f(integral_constant<int, kWarp>{}, integral_constant<int, 1>{});
  } else if (cols <= 2 * kWarp) {
    f(integral_constant<int, kWarp>{}, integral_constant<int, 2>{});
  } else if (cols <= 4 * kWarp) {
    f(integral_constant<int, kWarp>{}, integral_constant<int, 4>{});
  } else if (cols <= 8 * kWarp) {
    f(integral_constant<int, kWarp>{}, integral_constant<int, 8>{});
  } else if (cols <= kLnWarpCols) {
    f(integral_constant<int, kWarp>{}, integral_constant<int, kLnMaxValues>{});
  } else if (cols <= 4 * kLnThreads) {
    f(integral_constant<int, kLnThreads>{}, integral_constant<int, 4>{});
  } else if (cols <= 8 * kLnThreads) {
    f(integral_constant<int, kLnThreads>{}, integral_constant<int, 8>{});
  } else if (cols <= kLnMaxValues * kLnThreads) {
    f(integral_constant<int, kLnThreads>{}, integral_constant<int, kLnMaxValues>{});
  } else {
    f(integral_constant<int, kLnThreads>{}, integral_constant<int, 0>{});
  }
}

/// The block shape of a layer-norm kernel whose row team has `team` threads.
dim3 ln_block(int team) { return team == kWarp ? dim3(kWarp, kLnRowsPerBlock) : dim3(kLnThreads); }

/// The backward's tiles of rows (Note [Fused LayerNorm on CUDA]): a function of rows
/// alone. rows > 0.
struct LnTiles {
  i64 rows_per_tile;
  i64 count;
};
LnTiles ln_tiles(i64 rows) {
  i64 count = (rows + kLnMinTileRows - 1) / kLnMinTileRows;
  if (count > kLnMaxTiles) count = kLnMaxTiles;
  const i64 per = (rows + count - 1) / count;
  return {per, (rows + per - 1) / per};  // no empty tile
}

void check_layer_norm(const char* op, i64 rows, i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, op, ": expected rows >= 0 and cols >= 0, got (", rows, ", ", cols, ")");
}

}  // namespace

// ---- launchers -----------------------------------------------------------------------------

void log_softmax(cudaStream_t stream, const float* x, float* y, i64 rows, i64 cols) {
  check_rows("log_softmax", rows, cols);
  if (rows == 0 || cols == 0) return;  // as the CPU: nothing to write
  log_softmax_kernel<<<grid_for(rows, kRowsPerBlock), dim3(kWarp, kRowsPerBlock), 0, stream>>>(
      x, y, rows, cols);
  DP_CUDA_CHECK_LAUNCH();
}

void log_softmax_backward(cudaStream_t stream, const float* gy, const float* y, float* gx,
                          i64 rows, i64 cols) {
  check_rows("log_softmax_backward", rows, cols);
  if (rows == 0 || cols == 0) return;
  log_softmax_backward_kernel<<<grid_for(rows, kRowsPerBlock), dim3(kWarp, kRowsPerBlock), 0,
                                stream>>>(gy, y, gx, rows, cols);
  DP_CUDA_CHECK_LAUNCH();
}

void nll_forward(cudaStream_t stream, const float* logp, const i64* target, float* loss, i64 rows,
                 i64 cols, i64 ignore_index) {
  check_rows("nll_forward", rows, cols);
  if (rows == 0) return;  // cols == 0: every row's target is ignored or out of range (NaN)
  nll_forward_kernel<<<grid_for(rows), kBlock, 0, stream>>>(logp, target, loss, rows, cols, ignore_index);
  DP_CUDA_CHECK_LAUNCH();
}

void nll_backward(cudaStream_t stream, const float* gloss, const i64* target, float* gx, i64 rows,
                  i64 cols, i64 ignore_index) {
  check_rows("nll_backward", rows, cols);
  if (rows == 0 || cols == 0) return;
  nll_backward_kernel<<<grid_for(rows * cols), kBlock, 0, stream>>>(gloss, target, gx, rows, cols, ignore_index);
  DP_CUDA_CHECK_LAUNCH();
}

void maxpool2d_forward(cudaStream_t stream, const Pool2dShape& s, const float* x, float* y,
                       i64* indices) {
  check_pool("maxpool2d_forward", s);
  const i64 total = s.N * s.C * s.P * s.Q;
  if (total == 0) return;
  with_pool_index(s, [&](auto zero) {
    using I = decltype(zero);
    maxpool_forward_kernel<I><<<grid_for(total), kBlock, 0, stream>>>(PoolDims<I>(s), x, y, indices);
  });
  DP_CUDA_CHECK_LAUNCH();
}

void maxpool2d_backward(cudaStream_t stream, const Pool2dShape& s, const float* gy,
                        const i64* indices, float* gx) {
  check_pool("maxpool2d_backward", s);
  const i64 total = s.N * s.C * s.H * s.W;
  if (total == 0) return;
  const bool tiling = s.stride_h == s.kernel_h && s.stride_w == s.kernel_w && s.pad_h == 0 && s.pad_w == 0 &&
                      s.H == s.P * s.kernel_h && s.W == s.Q * s.kernel_w;
  with_pool_index(s, [&](auto zero) {
    using I = decltype(zero);
    if (tiling) {  // Note [Max-pool backward on a tiling]
      maxpool_backward_tiled_kernel<I>
          <<<grid_for(s.N * s.C * s.P * s.Q), kBlock, 0, stream>>>(PoolDims<I>(s), gy, indices, gx);
    } else {
      maxpool_backward_kernel<I><<<grid_for(total), kBlock, 0, stream>>>(PoolDims<I>(s), gy, indices, gx);
    }
  });
  DP_CUDA_CHECK_LAUNCH();
}

void avgpool2d_forward(cudaStream_t stream, const Pool2dShape& s, const float* x, float* y) {
  check_pool("avgpool2d_forward", s);
  const i64 total = s.N * s.C * s.P * s.Q;
  if (total == 0) return;
  with_pool_index(s, [&](auto zero) {
    using I = decltype(zero);
    avgpool_forward_kernel<I><<<grid_for(total), kBlock, 0, stream>>>(PoolDims<I>(s), x, y);
  });
  DP_CUDA_CHECK_LAUNCH();
}

void avgpool2d_backward(cudaStream_t stream, const Pool2dShape& s, const float* gy, float* gx) {
  check_pool("avgpool2d_backward", s);
  const i64 total = s.N * s.C * s.H * s.W;
  if (total == 0) return;
  with_pool_index(s, [&](auto zero) {
    using I = decltype(zero);
    avgpool_backward_kernel<I><<<grid_for(total), kBlock, 0, stream>>>(PoolDims<I>(s), gy, gx);
  });
  DP_CUDA_CHECK_LAUNCH();
}

/// f(T{}) with T the device storage type of a batch norm's x and y: float, __nv_bfloat16
/// or __half (Note [Batch norm in 16 bits] in cpu_nn.cpp); any other dtype is an error.
template <typename F>
void with_bn_storage(const char* op, DType dtype, F&& f) {
  DP_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, op,
           ": expected float32, bfloat16 or float16 data, got ", dtype_name(dtype));
  visit_dtype(dtype, [&](auto zero) {
    using T = device_t<decltype(zero)>;
    if constexpr (std::is_same_v<T, float> || is_device_16bit<T>) f(T{});
  });
}

// ---- channels-last batch norm: M = N·H·W rows of C channels (Note [Channels-last sums]) ----
namespace {

/// The plan of a channels-last reduction over storage T: the dtype's pack width of lanes.
template <typename T>
nhwc::Plan nhwc_plan_for(i64 M, i64 C) {
  const nhwc::Plan p = nhwc::plan(M, C, walk::pack_lanes<T>);
  DP_CHECK(p.tiles <= 65535, "channels-last sums: ", C, " channels exceed a grid of tiles");
  return p;
}

/// Launches the partial sums `S` of plan p into part (K·C·splits floats).
template <nhwc::Sums S, typename T>
void nhwc_partials(cudaStream_t stream, const nhwc::Plan& p, const T* x, const T* gy, const float* mean,
                   const float* invstd, float* part) {
  constexpr int V = walk::pack_lanes<T>;
  const bool packed = p.C % V == 0 && walk::contiguous_lanes(V, x) == V &&
                      (S != nhwc::Sums::Backward || walk::contiguous_lanes(V, gy) == V);
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.tiles));
  const dim3 block(static_cast<unsigned>(p.cols), static_cast<unsigned>(p.rows));
  bn_nhwc_partial_kernel<S, V, T><<<grid, block, 0, stream>>>(p, x, gy, packed, mean, invstd, part);
  DP_CUDA_CHECK_LAUNCH();
}

/// out = op.at(c)(a, b) over M rows of C channels: packs of the dtype's lanes where C and
/// the pointers allow, else channel_map's one element a thread (M images of 1 x C).
template <typename E, typename Op>
void nhwc_channel_map(cudaStream_t stream, i64 M, i64 C, const E* a, const E* b, E* out, const Op& op) {
  constexpr int V = walk::pack_lanes<E>;
  const bool vec = C % V == 0 && walk::contiguous_lanes(V, a, out) == V &&
                   (Op::kInputs == 1 || walk::contiguous_lanes(V, b) == V);
  const i64 packs = M * C / V;
  if (!vec || !kernel_plan::fast_divisible(packs, C / V)) {
    channel_map(stream, M, C, 1, a, b, out, op);
    return;
  }
  const auto n = static_cast<std::uint32_t>(packs);
  nhwc_channel_map_kernel<V><<<grid_for(packs), kBlock, 0, stream>>>(
      n, kernel_plan::FastDivider(static_cast<std::uint32_t>(C / V)), a, b, out, op);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
i64 nhwc_forward_scratch(i64 M, i64 C) {
  return 2 * C * nhwc_plan_for<T>(M, C).splits;
}
template <typename T>
i64 nhwc_backward_scratch(i64 M, i64 C) {
  return 2 * C + 2 * C * nhwc_plan_for<T>(M, C).splits;
}

/// The statistics (Σ x, then Σ (x - mean)² about the mean of the first sums) and y, as
/// batchnorm_forward_train's split path: bn_finalize_kernel over the partials.
template <typename T>
void nhwc_forward_train(cudaStream_t stream, i64 M, i64 C, const T* x, const float* gamma, const float* beta,
                        float eps, float momentum, float* running_mean, float* running_var, T* y, float* save_mean,
                        float* save_invstd, float* scratch) {
  const nhwc::Plan p = nhwc_plan_for<T>(M, C);
  float* part_sum = scratch;
  float* part_sq = scratch + C * p.splits;
  nhwc_partials<nhwc::Sums::X>(stream, p, x, static_cast<const T*>(nullptr), nullptr, nullptr, part_sum);
  bn_mean_kernel<<<grid_for(C), kBlock, 0, stream>>>(C, p.splits, static_cast<float>(M), part_sum, save_mean);
  DP_CUDA_CHECK_LAUNCH();
  nhwc_partials<nhwc::Sums::Centered>(stream, p, x, static_cast<const T*>(nullptr), save_mean, nullptr, part_sq);
  bn_finalize_kernel<<<grid_for(C), kBlock, 0, stream>>>(M, C, 1, p.splits, part_sum, part_sq, eps, momentum,
                                                         running_mean, running_var, save_mean, save_invstd);
  DP_CUDA_CHECK_LAUNCH();
  nhwc_channel_map(stream, M, C, x, static_cast<const T*>(nullptr), y,
                   BnApplyOp{save_mean, save_invstd, false, eps, gamma, beta});
}

/// Σ gy and Σ gy·xhat per channel (ggamma, gbeta), then gx, as batchnorm_backward.
template <typename T>
void nhwc_backward(cudaStream_t stream, i64 M, i64 C, const T* gy, const T* x, const float* gamma,
                   const float* save_mean, const float* save_invstd, T* gx, float* ggamma, float* gbeta,
                   float* scratch) {
  const nhwc::Plan p = nhwc_plan_for<T>(M, C);
  float* part = scratch + 2 * C;
  nhwc_partials<nhwc::Sums::Backward>(stream, p, x, gy, save_mean, save_invstd, part);
  bn_backward_finalize_kernel<<<grid_for(C), kBlock, 0, stream>>>(C, p.splits, part, scratch, ggamma, gbeta);
  DP_CUDA_CHECK_LAUNCH();
  if (!gx) return;
  nhwc_channel_map(stream, M, C, gy, x, gx,
                   BnBackwardApplyOp{C, static_cast<float>(M), gamma, save_mean, save_invstd, scratch});
}

}  // namespace

void batchnorm_forward_train(cudaStream_t stream, i64 N, i64 C, i64 HW, const void* x_raw,
                             const float* gamma, const float* beta, float eps, float momentum,
                             float* running_mean, float* running_var, void* y_raw, float* save_mean,
                             float* save_invstd, float* scratch, DType dtype) {
  check_bn("batchnorm_forward_train", N, C, HW);
  DP_CHECK(save_mean && save_invstd, "batchnorm_forward_train: save_mean and save_invstd are required");
  DP_CHECK(!running_mean == !running_var,
           "batchnorm_forward_train: expected both running_mean and running_var, or neither");
  with_bn_storage("batchnorm_forward_train", dtype, [&](auto zero) {
    using T = decltype(zero);
    const auto* x = static_cast<const T*>(x_raw);
    const int S = kernel_plan::bn_splits(N, C, HW);
    if (S == 1) {
      bn_stats_kernel<<<static_cast<unsigned>(C), kStatBlock, 0, stream>>>(
          N, C, HW, x, eps, momentum, running_mean, running_var, save_mean, save_invstd);
      DP_CUDA_CHECK_LAUNCH();
    } else {
      DP_CHECK(scratch != nullptr, "batchnorm_forward_train: expected scratch of 2 * C * ", S, " floats");
      float* part_sum = scratch;
      float* part_sq = scratch + C * S;
      const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(C));  // C < kTargetBlocks when S > 1
      bn_partial_sum_kernel<<<grid, kStatBlock, 0, stream>>>(N, C, HW, x, part_sum);
      DP_CUDA_CHECK_LAUNCH();
      bn_partial_var_kernel<<<grid, kStatBlock, 0, stream>>>(N, C, HW, x, part_sum, part_sq);
      DP_CUDA_CHECK_LAUNCH();
      bn_finalize_kernel<<<grid_for(C), kBlock, 0, stream>>>(N, C, HW, S, part_sum, part_sq, eps, momentum,
                                                             running_mean, running_var, save_mean, save_invstd);
      DP_CUDA_CHECK_LAUNCH();
    }
    channel_map(stream, N, C, HW, x, static_cast<const T*>(nullptr), static_cast<T*>(y_raw),
                BnApplyOp{save_mean, save_invstd, false, eps, gamma, beta});
  });
}

i64 batchnorm_forward_scratch(i64 N, i64 C, i64 HW) {
  const int S = kernel_plan::bn_splits(N, C, HW);
  return S == 1 ? 0 : 2 * C * S;
}

i64 channel_sums_scratch(i64 N, i64 C, i64 HW) {
  if (HW == 1) {  // rows of C (Note [Channels-last sums]): the larger of the dtypes' plans
    const i64 S = std::max(nhwc::plan(N, C, 4).splits, nhwc::plan(N, C, 8).splits);
    return C * S;
  }
  const int S = kernel_plan::bn_splits(N, C, HW);
  return S == 1 ? 0 : C * S;
}

void channel_sums(cudaStream_t stream, i64 N, i64 C, i64 HW, const void* x, void* out, float* scratch,
                  DType dtype) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, "channel_sums: expected (N, C, HW) >= 0, got (", N, ", ", C, ", ", HW, ")");
  check_float_dtype("channel_sums", dtype);
  if (C == 0) return;
  if (N == 0 || HW == 0) {  // sums over nothing: +0 in every floating dtype
    DP_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<std::size_t>(C) * float_bytes(dtype), stream));
    return;
  }
  check_bn("channel_sums", N, C, HW);
  const int S = kernel_plan::bn_splits(N, C, HW);
  DP_CHECK(S == 1 || HW == 1 || scratch, "channel_sums: expected scratch of ", C * S, " floats for (N, C, HW) = (",
           N, ", ", C, ", ", HW, "), got none");
  visit_dtype(dtype, [&](auto zero) {
    using T = device_t<decltype(zero)>;
    if constexpr (std::is_same_v<T, float> || is_device_16bit<T>) {
      const auto* xt = static_cast<const T*>(x);
      auto* ot = static_cast<T*>(out);
      if (HW == 1) {  // N rows of C: a channels-last convolution's bias gradient (Note [Channels-last sums])
        DP_CHECK(scratch, "channel_sums: expected scratch of ", channel_sums_scratch(N, C, HW),
                 " floats for (N, C, HW) = (", N, ", ", C, ", 1), got none");
        const nhwc::Plan p = nhwc_plan_for<T>(N, C);
        nhwc_partials<nhwc::Sums::X>(stream, p, xt, static_cast<const T*>(nullptr), nullptr, nullptr, scratch);
        channel_sum_finalize_kernel<<<grid_for(C), kBlock, 0, stream>>>(C, p.splits, scratch, ot);
        DP_CUDA_CHECK_LAUNCH();
        return;
      }
      if (S == 1) {
        channel_sum_kernel<<<static_cast<unsigned>(C), kStatBlock, 0, stream>>>(N, C, HW, xt, ot);
        DP_CUDA_CHECK_LAUNCH();
        return;
      }
      const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(C));  // C < kTargetBlocks when S > 1
      bn_partial_sum_kernel<<<grid, kStatBlock, 0, stream>>>(N, C, HW, xt, scratch);
      DP_CUDA_CHECK_LAUNCH();
      channel_sum_finalize_kernel<<<grid_for(C), kBlock, 0, stream>>>(C, S, scratch, ot);
      DP_CUDA_CHECK_LAUNCH();
    }
  });
}

void channel_fill(cudaStream_t stream, i64 N, i64 C, i64 HW, const void* bias, void* y, DType dtype) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, "channel_fill: expected (N, C, HW) >= 0, got (", N, ", ", C, ", ", HW, ")");
  check_float_dtype("channel_fill", dtype);
  if (N == 0 || C == 0 || HW == 0) return;
  // The bits move as they are: a 16-bit dtype's as std::uint16_t, four at a time as a
  // uint2 where they can; float32's as float, four at a time as a uint4.
  auto launch = [&](auto e_zero, auto w4_zero) {
    using E = decltype(e_zero);
    using W4 = decltype(w4_zero);
    const auto* b = static_cast<const E*>(bias);
    auto* out = static_cast<E*>(y);
    const bool vec = HW % 4 == 0 && reinterpret_cast<std::uintptr_t>(y) % sizeof(W4) == 0;
    const i64 V = vec ? 4 : 1;
    const i64 items = N * C * HW / V;
    if (!kernel_plan::fast_divisible(items, HW / V) || !kernel_plan::fast_divisible(items, C)) {
      channel_fill_wide_kernel<<<grid_for(N * C * HW), kBlock, 0, stream>>>(N * C * HW, HW, C, b, out);
    } else {
      const ChannelIndex ix{kernel_plan::FastDivider(static_cast<std::uint32_t>(HW / V)),
                            kernel_plan::FastDivider(static_cast<std::uint32_t>(C))};
      const auto n = static_cast<std::uint32_t>(items);
      if (vec) {
        channel_fill_kernel<E, W4><<<grid_for(items), kBlock, 0, stream>>>(n, ix, b, reinterpret_cast<W4*>(out));
      } else {
        channel_fill_kernel<E, E><<<grid_for(items), kBlock, 0, stream>>>(n, ix, b, out);
      }
    }
    DP_CUDA_CHECK_LAUNCH();
  };
  if (dtype == DType::F32) {
    launch(float{}, uint4{});
  } else {
    launch(std::uint16_t{}, uint2{});
  }
}

i64 batchnorm_backward_scratch(i64 N, i64 C, i64 HW) {
  const int S = kernel_plan::bn_splits(N, C, HW);
  return 2 * C + (S == 1 ? 0 : 2 * C * S);
}

void batchnorm_forward_eval(cudaStream_t stream, i64 N, i64 C, i64 HW, const void* x,
                            const float* gamma, const float* beta, float eps,
                            const float* running_mean, const float* running_var, void* y, DType dtype) {
  check_bn("batchnorm_forward_eval", N, C, HW);
  DP_CHECK(running_mean && running_var, "batchnorm_forward_eval: running statistics are required");
  with_bn_storage("batchnorm_forward_eval", dtype, [&](auto zero) {
    using T = decltype(zero);
    channel_map(stream, N, C, HW, static_cast<const T*>(x), static_cast<const T*>(nullptr), static_cast<T*>(y),
                BnApplyOp{running_mean, running_var, true, eps, gamma, beta});
  });
}

void batchnorm_backward(cudaStream_t stream, i64 N, i64 C, i64 HW, const void* gy_raw,
                        const void* x_raw, const float* gamma, const float* save_mean,
                        const float* save_invstd, void* gx, float* ggamma, float* gbeta,
                        float* scratch, DType dtype) {
  check_bn("batchnorm_backward", N, C, HW);
  with_bn_storage("batchnorm_backward", dtype, [&](auto zero) {
    using T = decltype(zero);
    const auto* gy = static_cast<const T*>(gy_raw);
    const auto* x = static_cast<const T*>(x_raw);
    const int S = kernel_plan::bn_splits(N, C, HW);
    if (S == 1) {
      bn_backward_reduce_kernel<<<static_cast<unsigned>(C), kStatBlock, 0, stream>>>(
          N, C, HW, gy, x, save_mean, save_invstd, scratch, ggamma, gbeta);
      DP_CUDA_CHECK_LAUNCH();
    } else {
      float* part = scratch + 2 * C;
      const dim3 grid(static_cast<unsigned>(S), static_cast<unsigned>(C));  // C < kTargetBlocks when S > 1
      bn_backward_partial_kernel<<<grid, kStatBlock, 0, stream>>>(N, C, HW, gy, x, save_mean, save_invstd, part);
      DP_CUDA_CHECK_LAUNCH();
      bn_backward_finalize_kernel<<<grid_for(C), kBlock, 0, stream>>>(C, S, part, scratch, ggamma, gbeta);
      DP_CUDA_CHECK_LAUNCH();
    }
    if (!gx) return;
    channel_map(stream, N, C, HW, gy, x, static_cast<T*>(gx),
                BnBackwardApplyOp{C, static_cast<float>(N * HW), gamma, save_mean, save_invstd, scratch});
  });
}

void bias_relu(cudaStream_t stream, i64 N, i64 C, i64 HW, const float* bias, bool relu, float* y) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, "bias_relu: expected (N, C, HW) >= 0, got (", N, ", ", C, ", ", HW, ")");
  if (N == 0 || C == 0 || HW == 0 || (!bias && !relu)) return;
  channel_map(stream, N, C, HW, y, static_cast<const float*>(nullptr), y, BiasReluOp{bias, relu});
}

void layer_norm(cudaStream_t stream, const float* x, const float* w, const float* b, float* y, float* mean,
                float* rstd, i64 rows, i64 cols, float eps) {
  check_layer_norm("layer_norm", rows, cols);
  if (rows == 0) return;
  DP_CHECK(mean && rstd && (cols == 0 || (x && y)), "layer_norm: expected x, y, mean and rstd, got a null pointer");
  const float inv_cols = cols > 0 ? 1.0f / static_cast<float>(cols) : 0.0f;  // the CPU's factor
  with_ln_shape(cols, [&](auto team, auto values) {
    constexpr int T = decltype(team)::value, V = decltype(values)::value;
    const int rows_per_block = T == kWarp ? kLnRowsPerBlock : 1;
    layer_norm_kernel<T, V><<<grid_for(rows, rows_per_block), ln_block(T), 0, stream>>>(x, w, b, y, mean, rstd,
                                                                                        rows, cols, inv_cols, eps);
  });
  DP_CUDA_CHECK_LAUNCH();
}

i64 layer_norm_backward_scratch(i64 rows, i64 cols, bool params) {
  if (!params || rows <= 0 || cols <= 0) return 0;
  return 2 * ln_tiles(rows).count * cols;
}

void layer_norm_backward(cudaStream_t stream, const float* x, const float* w, const float* mean, const float* rstd,
                         const float* gy, float* gx, float* gw, float* gb, i64 rows, i64 cols, float* scratch) {
  check_layer_norm("layer_norm_backward", rows, cols);
  if (cols == 0) return;
  if (rows == 0) {  // sums over no rows
    if (gw) DP_CUDA_CHECK(cudaMemsetAsync(gw, 0, static_cast<std::size_t>(cols) * sizeof(float), stream));
    if (gb) DP_CUDA_CHECK(cudaMemsetAsync(gb, 0, static_cast<std::size_t>(cols) * sizeof(float), stream));
    return;
  }
  DP_CHECK(x && mean && rstd && gy && gx, "layer_norm_backward: expected x, mean, rstd, gy and gx, got a null pointer");
  const bool params = gw || gb;
  DP_CHECK(!params || scratch, "layer_norm_backward: expected scratch of ",
           layer_norm_backward_scratch(rows, cols, true), " floats for (rows, cols) = (", rows, ", ", cols,
           "), got none");
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const LnTiles tiles = ln_tiles(rows);  // count <= kLnMaxTiles: one block each
  float* part = params ? scratch : nullptr;
  with_ln_shape(cols, [&](auto team, auto values) {
    constexpr int T = decltype(team)::value, V = decltype(values)::value;
    layer_norm_backward_kernel<T, V><<<static_cast<unsigned>(tiles.count), ln_block(T), 0, stream>>>(
        x, w, mean, rstd, gy, gx, part, rows, cols, tiles.rows_per_tile, inv_cols);
  });
  DP_CUDA_CHECK_LAUNCH();
  if (!params) return;
  ln_param_sums_kernel<<<grid_for(cols, kWarp), dim3(kWarp, kLnSumSlices), 0, stream>>>(part, gw, gb, tiles.count,
                                                                                        cols);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace dp::backend::cuda_kernels

// ---- the kernel table's entries (Note [The op list] in ops.h) --------------------------------

namespace dp::backend::cuda_kernels {
namespace {
namespace table {

using i64 = std::int64_t;

void layer_norm_f32(CudaBackend& be, Device dev, const LayerNormArgs& a) {
  layer_norm(be.bind(dev), static_cast<const float*>(a.x), static_cast<const float*>(a.w),
             static_cast<const float*>(a.b), static_cast<float*>(a.y), a.mean, a.rstd, a.rows, a.cols, a.eps);
}

void layer_norm_backward_f32(CudaBackend& be, Device dev, const LayerNormBackwardArgs& a) {
  cudaStream_t s = be.bind(dev);
  const auto* x = static_cast<const float*>(a.x);
  const auto* w = static_cast<const float*>(a.w);
  const auto* gy = static_cast<const float*>(a.gy);
  auto* gx = static_cast<float*>(a.gx);
  const i64 floats = layer_norm_backward_scratch(a.rows, a.cols, a.gw || a.gb);
  if (floats == 0) {
    layer_norm_backward(s, x, w, a.mean, a.rstd, gy, gx, a.gw, a.gb, a.rows, a.cols, nullptr);
    return;
  }
  // The tiles' partial sums, on the stream bind() made current (Note [Caching allocator
  // streams]): released after the two kernels are enqueued, reused only by later work.
  CudaBackend::Scratch parts(be, dev.index, static_cast<std::size_t>(floats) * sizeof(float));
  layer_norm_backward(s, x, w, a.mean, a.rstd, gy, gx, a.gw, a.gb, a.rows, a.cols, static_cast<float*>(parts.get()));
}

}  // namespace table
}  // namespace

namespace {

/// f(T{}, stream, M, scratch) for a channels-last batch norm `op` over storage T, with a
/// float scratch block of scratch_floats(T{}) from the device's caching allocator,
/// released once the kernels are enqueued (Note [Caching allocator streams]).
template <typename Floats, typename F>
void with_nhwc_scratch(CudaBackend& be, Device dev, const char* op, DType dtype, i64 N, i64 C, i64 HW,
                       Floats&& scratch_floats, F&& f) {
  check_bn(op, N, C, HW);
  cudaStream_t s = be.bind(dev);
  with_bn_storage(op, dtype, [&](auto zero) {
    const auto bytes = static_cast<std::size_t>(scratch_floats(zero)) * sizeof(float);
    CudaBackend::Scratch scratch(be, dev.index, bytes);
    f(zero, s, N * HW, static_cast<float*>(scratch.get()));
  });
}

const float* f32_in(const void* p) { return static_cast<const float*>(p); }
float* f32_out(void* p) { return static_cast<float*>(p); }

void batch_norm_train_nhwc(CudaBackend& be, Device dev, const BatchNormTrainArgs& a, DType dtype) {
  DP_CHECK(a.save_mean && a.save_invstd, "batchnorm_forward_train: save_mean and save_invstd are required");
  DP_CHECK(!a.running_mean == !a.running_var,
           "batchnorm_forward_train: expected both running_mean and running_var, or neither");
  const i64 M = a.N * a.HW;
  with_nhwc_scratch(
      be, dev, "batchnorm_forward_train", dtype, a.N, a.C, a.HW,
      [&](auto zero) { return nhwc_forward_scratch<decltype(zero)>(M, a.C); },
      [&](auto zero, cudaStream_t s, i64 rows, float* scratch) {
        using T = decltype(zero);
        nhwc_forward_train(s, rows, a.C, static_cast<const T*>(a.x), f32_in(a.gamma), f32_in(a.beta), a.eps,
                           a.momentum, f32_out(a.running_mean), f32_out(a.running_var), static_cast<T*>(a.y),
                           f32_out(a.save_mean), f32_out(a.save_invstd), scratch);
      });
}

void batch_norm_backward_nhwc(CudaBackend& be, Device dev, const BatchNormBackwardArgs& a, DType dtype) {
  const i64 M = a.N * a.HW;
  with_nhwc_scratch(
      be, dev, "batchnorm_backward", dtype, a.N, a.C, a.HW,
      [&](auto zero) { return nhwc_backward_scratch<decltype(zero)>(M, a.C); },
      [&](auto zero, cudaStream_t s, i64 rows, float* scratch) {
        using T = decltype(zero);
        nhwc_backward(s, rows, a.C, static_cast<const T*>(a.gy), static_cast<const T*>(a.x), f32_in(a.gamma),
                      f32_in(a.save_mean), f32_in(a.save_invstd), static_cast<T*>(a.gx), f32_out(a.ggamma),
                      f32_out(a.gbeta), scratch);
      });
}

}  // namespace

// A channels-last batch norm, or one of (N, C) (HW = 1: the same bytes), sums the columns
// of its M = N·HW rows (Note [Channels-last sums]); an NCHW one its channels' planes.
void batch_norm_train(CudaBackend& be, Device dev, const BatchNormTrainArgs& args, DType dtype) {
  if (args.channels_last || args.HW == 1) {
    batch_norm_train_nhwc(be, dev, args, dtype);
    return;
  }
  const BatchNormTrainArgs& a = args;
  cudaStream_t s = be.bind(dev);
  DP_CHECK(a.N > 0 && a.C > 0 && a.HW > 0, "batchnorm_forward_train: expected positive (N, C, HW), got (", a.N,
           ", ", a.C, ", ", a.HW, ")");
  const auto f = [](const void* p) { return static_cast<const float*>(p); };
  const auto m = [](void* p) { return static_cast<float*>(p); };
  const i64 floats = batchnorm_forward_scratch(a.N, a.C, a.HW);
  // The split statistics' partial sums, released once the kernels are enqueued (Note
  // [Caching allocator streams]).
  std::optional<CudaBackend::Scratch> parts;
  if (floats > 0) parts.emplace(be, dev.index, static_cast<std::size_t>(floats) * sizeof(float));
  batchnorm_forward_train(s, a.N, a.C, a.HW, a.x, f(a.gamma), f(a.beta), a.eps, a.momentum, m(a.running_mean),
                          m(a.running_var), a.y, m(a.save_mean), m(a.save_invstd), parts ? m(parts->get()) : nullptr,
                          dtype);
}

void batch_norm_eval(CudaBackend& be, Device dev, const BatchNormEvalArgs& args, DType dtype) {
  const auto f = [](const void* p) { return static_cast<const float*>(p); };
  if (args.channels_last || args.HW == 1) {
    const BatchNormEvalArgs& a = args;
    check_bn("batchnorm_forward_eval", a.N, a.C, a.HW);
    DP_CHECK(a.running_mean && a.running_var, "batchnorm_forward_eval: running statistics are required");
    with_bn_storage("batchnorm_forward_eval", dtype, [&](auto zero) {
      using T = decltype(zero);
      nhwc_channel_map(be.bind(dev), a.N * a.HW, a.C, static_cast<const T*>(a.x), static_cast<const T*>(nullptr),
                       static_cast<T*>(a.y), BnApplyOp{f(a.running_mean), f(a.running_var), true, a.eps, f(a.gamma),
                                                       f(a.beta)});
    });
    return;
  }
  const BatchNormEvalArgs& a = args;
  batchnorm_forward_eval(be.bind(dev), a.N, a.C, a.HW, a.x, f(a.gamma), f(a.beta), a.eps, f(a.running_mean),
                         f(a.running_var), a.y, dtype);
}

void batch_norm_backward(CudaBackend& be, Device dev, const BatchNormBackwardArgs& args, DType dtype) {
  if (args.channels_last || args.HW == 1) {
    batch_norm_backward_nhwc(be, dev, args, dtype);
    return;
  }
  const BatchNormBackwardArgs& a = args;
  cudaStream_t s = be.bind(dev);
  DP_CHECK(a.N > 0 && a.C > 0 && a.HW > 0, "batchnorm_backward: expected positive (N, C, HW), got (", a.N, ", ",
           a.C, ", ", a.HW, ")");
  const auto f = [](const void* p) { return static_cast<const float*>(p); };
  const auto m = [](void* p) { return static_cast<float*>(p); };
  CudaBackend::Scratch sums(be, dev.index,
                            static_cast<std::size_t>(batchnorm_backward_scratch(a.N, a.C, a.HW)) * sizeof(float));
  batchnorm_backward(s, a.N, a.C, a.HW, a.gy, a.x, f(a.gamma), f(a.save_mean), f(a.save_invstd), a.gx, m(a.ggamma),
                     m(a.gbeta), static_cast<float*>(sums.get()), dtype);
}

namespace {
namespace table {

/// The 16-bit batch norms' entries (float32's are method kernels: method_kernels.h).
template <DType dt>
void batch_norm_train_entry(CudaBackend& be, Device dev, const BatchNormTrainArgs& a) {
  batch_norm_train(be, dev, a, dt);
}
template <DType dt>
void batch_norm_eval_entry(CudaBackend& be, Device dev, const BatchNormEvalArgs& a) {
  batch_norm_eval(be, dev, a, dt);
}
template <DType dt>
void batch_norm_backward_entry(CudaBackend& be, Device dev, const BatchNormBackwardArgs& a) {
  batch_norm_backward(be, dev, a, dt);
}

}  // namespace table
}  // namespace

void register_nn_kernels(CudaBackend& be) {
  add<Op::LayerNorm, &table::layer_norm_f32>(be, DType::F32);
  add<Op::LayerNormBackward, &table::layer_norm_backward_f32>(be, DType::F32);
  add<Op::BatchNormTrain, &table::batch_norm_train_entry<DType::BF16>>(be, DType::BF16);
  add<Op::BatchNormEval, &table::batch_norm_eval_entry<DType::BF16>>(be, DType::BF16);
  add<Op::BatchNormBackward, &table::batch_norm_backward_entry<DType::BF16>>(be, DType::BF16);
  add<Op::BatchNormTrain, &table::batch_norm_train_entry<DType::F16>>(be, DType::F16);
  add<Op::BatchNormEval, &table::batch_norm_eval_entry<DType::F16>>(be, DType::F16);
  add<Op::BatchNormBackward, &table::batch_norm_backward_entry<DType::F16>>(be, DType::F16);
}

}  // namespace dp::backend::cuda_kernels
