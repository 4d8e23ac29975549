// CUDA backend: fills, casts, unary/binary elementwise ops, GELU, where, strided copies,
// random fills, the non-finite count, the gradient scaler's multiply with its
// non-finite flag and the fused optimizer updates.
//
// The per-element math comes from backend/functors.h, shared with the CPU backend, and
// the addresses from backend/elementwise_walk.h (packs of 16 bytes, 32-bit offsets by
// multiply-shift; Note [Packed elementwise access]); this file launches the grids.
// Where the CPU backend writes a formula inline (affine, axpy, the uniform range), the
// same formula is used here with explicit round-to-nearest intrinsics so nvcc cannot
// contract it into an FMA: results then match the CPU backend bitwise. The 16-bit
// dtypes run the same templates over __nv_bfloat16 and __half (Note [16-bit storage on
// CUDA] in cuda_half.cuh); kernels that only move elements (gather, strided copies,
// fills) move them as their 16 bits.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_half.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_register.h"
#include "backend/elementwise_walk.h"
#include "backend/functors.h"
#include "backend/kernel_plan.h"
#include "dp/core/error.h"

namespace dp::backend::cuda_kernels {
namespace {

using i64 = std::int64_t;

// ---- kernels ------------------------------------------------------------------------------

template <typename T>
__global__ void fill_kernel(T* __restrict__ y, i64 n, T value) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) y[i] = value;
}

__global__ void add_i64_kernel(i64* __restrict__ y, i64 n, i64 value) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) y[i] += value;
}

__global__ void arange_kernel(float* __restrict__ y, i64 n, float start, float step) {
  // start + float(i) * step, rounded like the CPU backend's loop (no FMA).
  for (i64 i = global_thread(); i < n; i += grid_stride())
    y[i] = __fadd_rn(start, __fmul_rn(static_cast<float>(i), step));
}

__global__ void arange_i64_kernel(i64* __restrict__ y, i64 n, i64 start, i64 step) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) y[i] = start + i * step;
}

// The CPU backend's conversions (convert_storage): float to integer truncates toward
// zero, int64 to int32 keeps the low 32 bits, a 16-bit float widens exactly and anything
// else goes through float and rounds once to a 16-bit float.
template <typename Dst>
struct ConvertTo {
  template <typename Src>
  DP_HD Dst operator()(Src x) const {
    return convert_storage<Dst>(x);
  }
};

// Offsets of element i (Note [Gather geometry] in ops.h): `xo` into x without the
// gathered dim, `io` into the index.
__device__ __forceinline__ void gather_offsets(const Indexer& ix, int dim, i64 i, i64& xo, i64& io) {
  xo = 0;
  io = 0;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const i64 c = i % ix.sizes[d];
    i /= ix.sizes[d];
    if (d != dim) xo += c * ix.strides_a[d];
    io += c * ix.strides_b[d];
  }
}

template <typename T>
__global__ void gather_kernel(const Indexer ix, int dim, const T* __restrict__ x,
                              const i64* __restrict__ index, T* __restrict__ out, i64 n) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    i64 xo, io;
    gather_offsets(ix, dim, i, xo, io);
    out[i] = x[xo + index[io] * ix.strides_a[dim]];
  }
}

// Note [16-bit atomic adds]
// scatter_add adds with atomics, so where indices repeat the order of the additions,
// and with it the rounding, depends on timing: float32 and 16-bit results alike are
// not bitwise deterministic (ScatterAddArgs in ops.h). Each 16-bit add rounds once to
// the 16-bit type: the native atomic rounds the exact sum, the CPU (and the fallback
// below) the float sum, which for two 16-bit values is exact unless one is so much
// smaller that both sums round back to the other: the same bits. The native 16-bit
// atomicAdd exists for __half from sm_70 and for __nv_bfloat16 from sm_80 in every
// toolkit dp builds with (CUDA 12 and later; meson_options.txt's sm_arch defaults to
// 80 and 90); an older architecture gets a compare-and-swap loop on the aligned 32-bit
// word that holds the element. The word's other half lies in the same block of the
// caching allocator (512-byte granules) and is written back unchanged.

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }

// The 16 bits of a __nv_bfloat16 or __half, and back.
template <typename T>
__device__ __forceinline__ unsigned short to_bits(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat16_as_ushort(v);
  } else {
    return __half_as_ushort(v);
  }
}
template <typename T>
__device__ __forceinline__ T from_bits(unsigned short b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __ushort_as_bfloat16(b);
  } else {
    return __ushort_as_half(b);
  }
}

/// *p = store_acc(load_acc(*p) + load_acc(v)) atomically, for a 16-bit T, with 32-bit
/// compare-and-swap only (Note [16-bit atomic adds]).
template <typename T>
__device__ __forceinline__ void atomic_add_cas(T* p, T v) {
  const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(p);
  unsigned int* word = reinterpret_cast<unsigned int*>(addr & ~std::uintptr_t{3});
  const unsigned int shift = (addr & 2u) != 0 ? 16u : 0u;
  const float add = load_acc(v);
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    const T cur = from_bits<T>(static_cast<unsigned short>(assumed >> shift));
    const unsigned int sum = to_bits(store_acc<T>(__fadd_rn(load_acc(cur), add)));
    old = atomicCAS(word, assumed, (assumed & ~(0xFFFFu << shift)) | (sum << shift));
  } while (old != assumed);
}

__device__ __forceinline__ void atomic_add(__half* p, __half v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  atomic_add_cas(p, v);
#else
  atomicAdd(p, v);
#endif
}
__device__ __forceinline__ void atomic_add(__nv_bfloat16* p, __nv_bfloat16 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  atomic_add_cas(p, v);
#else
  atomicAdd(p, v);
#endif
}

template <typename T>
__global__ void scatter_add_kernel(const Indexer ix, int dim, const T* __restrict__ src,
                                   const i64* __restrict__ index, T* y, i64 n) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    i64 xo, io;
    gather_offsets(ix, dim, i, xo, io);
    atomic_add(y + xo + index[io] * ix.strides_a[dim], src[i]);
  }
}

// Note [Row scatter-add in position order]
// index_add of whole rows along dim 0 — (n, cols) rows of src onto y's rows index[p],
// an embedding's backward — is where atomics hurt most: a GPT's batch repeats its
// common tokens hundreds of times, so their rows' sums would change run to run (and
// with them the tied output projection's gradient). So the float32 rows geometry sorts
// instead: the positions are radix-sorted by index (cub::DeviceRadixSort, stable, so
// a run of one index keeps its positions in order), and the warps of each run's first
// position, one per 32 columns, add the run's rows onto y's row in position order, a
// lane a column, with plain adds. That is the CPU's order (Note [Gather geometry]:
// whole rows in element order), so the sums are the CPU's bits and bitwise run to run;
// each element of y has one writer. Other geometries and 16-bit values keep the
// atomics (ScatterAddArgs).

__global__ void iota_i32_kernel(int* __restrict__ out, i64 n) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) out[i] = static_cast<int>(i);
}

/// keys: the n indices sorted; pos: their positions, stably sorted with them. A warp
/// per (position, 32 columns): the warps of a run's first position add the run, each
/// its 32 columns. One warp a run was too few when runs are long (a character
/// vocabulary: 128 runs for 8192 positions, 2 ms a call on an H200).
__global__ void row_runs_add_kernel(const i64* __restrict__ keys, const int* __restrict__ pos,
                                    const float* __restrict__ src, float* __restrict__ y, i64 n, i64 cols,
                                    i64 y_row) {
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const i64 warps = grid_stride() / kWarp, chunks = (cols + kWarp - 1) / kWarp;
  for (i64 w = global_thread() / kWarp; w < n * chunks; w += warps) {  // warp-uniform
    const i64 k = w / chunks, c = w % chunks * kWarp + lane;
    const i64 v = keys[k];
    if (k > 0 && keys[k - 1] == v) continue;  // inside a run: its first position's warps add it
    i64 end = k + 1;
    while (end < n && keys[end] == v) ++end;
    if (c >= cols) continue;
    float* dst = y + v * y_row;
    float acc = dst[c];
    for (i64 j = k; j < end; ++j) acc += src[static_cast<i64>(pos[j]) * cols + c];
    dst[c] = acc;
  }
}

// Each elementwise kernel is a template over the storage types, its math in float
// (Note [Storage types] in functors.h) and its walk elementwise_walk.h's: L elements a
// pack (1: one by one), Ix the strided index (walk::FastIndexer in 32 bits, Indexer in
// 64). f is an OnStorage<T, ...> functor or one of the storage functors below. The
// output may alias an input: no __restrict__.

/// x * y and x + y rounded to nearest on the device, never contracted into an FMA: the
/// CPU backend's bits. (Host code never runs these; its branch keeps them host-callable.)
DP_HD inline float mul_rn(float x, float y) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(x, y);
#else
  return x * y;
#endif
}
DP_HD inline float add_rn(float x, float y) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(x, y);
#else
  return x + y;
#endif
}

/// alpha * x + beta (Op::Affine).
template <typename T>
struct AffineOn {
  float alpha, beta;
  DP_HD T operator()(T x) const { return store_acc<T>(add_rn(mul_rn(alpha, load_acc(x)), beta)); }
};
/// y + alpha * x (Op::Axpy), called as f(y, x).
template <typename T>
struct AxpyOn {
  float alpha;
  DP_HD T operator()(T y, T x) const { return store_acc<T>(add_rn(load_acc(y), mul_rn(alpha, load_acc(x)))); }
};
/// gelu(x) and gy * gelu'(x), called as f(x, gy): the functors of Note [Fused GELU].
template <typename T, bool Tanh>
struct GeluOn {
  DP_HD T operator()(T x) const { return store_acc<T>(Gelu<Tanh>{}(load_acc(x))); }
};
template <typename T, bool Tanh>
struct GeluBackwardOn {
  DP_HD T operator()(T x, T gy) const { return store_acc<T>(GeluBackward<Tanh>{}(load_acc(x), load_acc(gy))); }
};

template <int L, typename F, typename In, typename Out>
__global__ void map1_kernel(F f, const In* x, Out* y, i64 n) {
  walk::map1_range<L>(f, x, y, n, global_thread(), grid_stride());
}

template <int L, typename F, typename A, typename B, typename Out>
__global__ void map2_kernel(F f, const A* a, const B* b, Out* y, i64 n) {
  walk::map2_range<L>(f, a, b, y, n, global_thread(), grid_stride());
}

template <int L, bool BBroadcast, typename F, typename T, typename Ix>
__global__ void binary_strided_kernel(F f, const Ix ix, const T* a, const T* b, T* out, i64 n) {
  walk::binary_strided_range<L, BBroadcast>(f, ix, a, b, out, n, global_thread(), grid_stride());
}

template <int L, typename T, typename Ix>
__global__ void strided_copy_kernel(const Ix ix, const T* __restrict__ a, T* __restrict__ out, i64 n) {
  walk::copy_strided_range<L>(ix, a, out, n, global_thread(), grid_stride());
}

template <typename Ix>
__global__ void eq_i64_kernel(const Ix ix, const i64* __restrict__ a, const i64* __restrict__ b,
                              float* __restrict__ out, i64 n) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    walk::index_t<Ix> oa, ob;
    walk::offsets(ix, static_cast<walk::index_t<Ix>>(i), oa, ob);
    out[i] = a[oa] == b[ob] ? 1.0f : 0.0f;
  }
}

/// out = cond != 0 ? a : b (WhereArgs); every index in int64 (three operands' offsets).
template <typename T>
__global__ void where_kernel(const WhereArgs w, i64 n) {
  const T* a = static_cast<const T*>(w.a);
  const T* b = static_cast<const T*>(w.b);
  T* out = static_cast<T*>(w.out);
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    i64 rest = i, oc = 0, oa = 0, ob = 0;
    for (int d = w.ix.ndim - 1; d >= 0; --d) {
      const i64 c = rest % w.ix.sizes[d];
      rest /= w.ix.sizes[d];
      oc += c * w.strides_cond[d];
      oa += c * w.ix.strides_a[d];
      ob += c * w.ix.strides_b[d];
    }
    out[i] = w.cond[oc] != 0.0f ? a[oa] : b[ob];
  }
}

__global__ void uniform_kernel(float* __restrict__ y, i64 n, float lo, float span,
                               std::uint64_t seed, std::uint64_t offset) {
  for (i64 i = global_thread(); i < n; i += grid_stride())
    y[i] = __fadd_rn(lo, __fmul_rn(span, uniform_from(seed, offset + static_cast<std::uint64_t>(i))));
}

__global__ void normal_kernel(float* __restrict__ y, i64 n, float mean, float std,
                              std::uint64_t seed, std::uint64_t offset) {
  for (i64 i = global_thread(); i < n; i += grid_stride())
    y[i] = __fadd_rn(mean, __fmul_rn(std, normal_from(seed, offset + static_cast<std::uint64_t>(i))));
}

__global__ void dropout_kernel(const float* x, float* y, float* mask, i64 n, float p,
                               float scale, std::uint64_t seed, std::uint64_t offset) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    // Same draw and comparison as the CPU backend: keep when u >= p.
    const bool keep = uniform_from(seed, offset + static_cast<std::uint64_t>(i)) >= p;
    const float m = keep ? scale : 0.0f;
    if (mask) mask[i] = m;
    y[i] = x[i] * m;
  }
}

__global__ void count_nonfinite_kernel(const float* __restrict__ x, i64 n,
                                       unsigned long long* count) {
  unsigned long long local = 0;
  for (i64 i = global_thread(); i < n; i += grid_stride()) local += isfinite(x[i]) ? 0 : 1;
  // One atomic per warp: integer adds commute, so the count is exact and deterministic.
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) local += __shfl_xor_sync(0xffffffffu, local, off);
  if (threadIdx.x % kWarp == 0 && local) atomicAdd(count, local);
}

// One pass over x: the multiply is the affine kernel's with beta 0 (Tensor::mul_'s
// bits), and a thread that saw a non-finite element stores 1 into the shared flag.
// Every such store writes the same value and nothing clears it, so no atomic is needed,
// and the flag is only touched when something overflowed.
__global__ void scale_find_nonfinite_kernel(float* __restrict__ x, i64 n, float scale,
                                            float* __restrict__ found) {
  bool bad = false;
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    const float v = x[i];
    bad = bad || !isfinite(v);
    x[i] = __fadd_rn(__fmul_rn(scale, v), 0.0f);
  }
  if (bad) *found = 1.0f;
}

__global__ void sgd_kernel(SgdUpdate upd, float* __restrict__ param, const float* __restrict__ grad,
                           float* __restrict__ buf, i64 n) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    float p = param[i];
    upd(p, grad[i], buf ? buf + i : nullptr);
    param[i] = p;
  }
}

__global__ void adam_kernel(AdamUpdate upd, float* __restrict__ param,
                            const float* __restrict__ grad, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, i64 n) {
  for (i64 i = global_thread(); i < n; i += grid_stride()) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    upd(p, grad[i], m, v);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

// ---- host helpers -------------------------------------------------------------------------

/// Calls f(ix') with ix' = walk::fast_indexer(ix, n) when the strided kernel's indices
/// over ix fit in 32 bits (kernel_plan::strided_fits_i32), else ix itself (64 bits).
template <typename F>
void with_indexer(const Indexer& ix, i64 n, F&& f) {
  if (kernel_plan::strided_fits_i32(ix, n)) {
    f(walk::fast_indexer(ix, n));
  } else {
    f(ix);
  }
}

/// Calls f(ix, lanes, b_broadcast, n) for the walk of collapsed `c` (c.numel > 0): the
/// Indexer itself, one element at a time, where its offsets need 64 bits; else the pack
/// plan of L lanes (Note [Packed elementwise access]) with its FastIndexer. lanes and
/// b_broadcast are compile-time constants (walk::with_pack_kind); n counts packs.
template <int L, typename F>
void with_walk(const walk::Collapsed& c, const void* a, const void* b, const void* out, std::size_t elem, bool uses_b,
               F&& f) {
  if (!kernel_plan::strided_fits_i32(c.ix, c.numel)) {
    f(c.ix, std::integral_constant<int, 1>{}, std::false_type{}, c.numel);
    return;
  }
  const walk::PackPlan p = walk::plan_packs(c, L, a, b, out, elem, uses_b);
  const walk::FastIndexer fx = walk::fast_indexer(p.ix, p.n);
  walk::with_pack_kind<L>(p, [&](auto lanes, auto b_broadcast) { f(fx, lanes, b_broadcast, p.n); });
}

/// y[i] = f(x[i]) over n contiguous elements, in packs where the pointers allow.
template <typename F, typename In, typename Out>
void launch_map1(cudaStream_t stream, const F& f, const In* x, Out* y, i64 n) {
  constexpr int L = walk::pack_lanes<In, Out>;
  if (walk::contiguous_lanes(L, x, static_cast<const Out*>(y)) == L) {
    map1_kernel<L><<<grid_for(n / L), kBlock, 0, stream>>>(f, x, y, n);
  } else {
    map1_kernel<1><<<grid_for(n), kBlock, 0, stream>>>(f, x, y, n);
  }
}
/// y[i] = f(a[i], b[i]) over n contiguous elements, in packs where the pointers allow.
template <typename F, typename A, typename B, typename Out>
void launch_map2(cudaStream_t stream, const F& f, const A* a, const B* b, Out* y, i64 n) {
  constexpr int L = walk::pack_lanes<A, B, Out>;
  if (walk::contiguous_lanes(L, a, b, static_cast<const Out*>(y)) == L) {
    map2_kernel<L><<<grid_for(n / L), kBlock, 0, stream>>>(f, a, b, y, n);
  } else {
    map2_kernel<1><<<grid_for(n), kBlock, 0, stream>>>(f, a, b, y, n);
  }
}

void check_count(i64 n, const char* op) {
  DP_CHECK(n >= 0, op, ": expected a non-negative element count, got ", n);
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------

void fill(cudaStream_t stream, float* y, i64 n, float value) {
  check_count(n, "fill");
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, value);
  DP_CUDA_CHECK_LAUNCH();
}

void fill_i64(cudaStream_t stream, i64* y, i64 n, i64 value) {
  check_count(n, "fill_i64");
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, value);
  DP_CUDA_CHECK_LAUNCH();
}

void fill_16bit(cudaStream_t stream, std::uint16_t* y, i64 n, std::uint16_t bits) {
  check_count(n, "fill_16bit");
  if (n == 0) return;
  fill_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, bits);
  DP_CUDA_CHECK_LAUNCH();
}

void add_i64(cudaStream_t stream, i64* y, i64 n, i64 value) {
  check_count(n, "add_i64");
  if (n == 0) return;
  add_i64_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, value);
  DP_CUDA_CHECK_LAUNCH();
}

void arange(cudaStream_t stream, float* y, i64 n, float start, float step) {
  check_count(n, "arange");
  if (n == 0) return;
  arange_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, start, step);
  DP_CUDA_CHECK_LAUNCH();
}

void arange_i64(cudaStream_t stream, i64* y, i64 n, i64 start, i64 step) {
  check_count(n, "arange_i64");
  if (n == 0) return;
  arange_i64_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, start, step);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename Src, typename Dst>
void cast(cudaStream_t stream, const Src* x, Dst* y, i64 n) {
  check_count(n, "cast");
  if (n == 0) return;
  launch_map1(stream, ConvertTo<Dst>{}, x, y, n);
  DP_CUDA_CHECK_LAUNCH();
}

void eq_i64(cudaStream_t stream, const Indexer& ix, const i64* a, const i64* b, float* out) {
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  check_count(n, "eq_i64");
  if (n == 0) return;
  with_indexer(ix, n, [&](const auto& wix) { eq_i64_kernel<<<grid_for(n), kBlock, 0, stream>>>(wix, a, b, out, n); });
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void gather(cudaStream_t stream, const Indexer& ix, int dim, const T* x, const i64* index, T* out) {
  DP_CHECK(dim >= 0 && dim < ix.ndim, "gather: expected a dim in [0, ", ix.ndim, "), got ", dim);
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  check_count(n, "gather");
  if (n == 0) return;
  gather_kernel<<<grid_for(n), kBlock, 0, stream>>>(ix, dim, x, index, out, n);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void scatter_add(cudaStream_t stream, const Indexer& ix, int dim, const T* src, const i64* index, T* y) {
  DP_CHECK(dim >= 0 && dim < ix.ndim, "scatter_add: expected a dim in [0, ", ix.ndim, "), got ", dim);
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  check_count(n, "scatter_add");
  if (n == 0) return;
  scatter_add_kernel<<<grid_for(n), kBlock, 0, stream>>>(ix, dim, src, index, y, n);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void unary(cudaStream_t stream, UnaryOp op, const T* x, T* y, i64 n) {
  check_count(n, "unary");
  DP_CHECK(op < UnaryOp::kCount, "unary: expected a UnaryOp below kCount, got ",
           static_cast<int>(op));
  if (n == 0) return;
  dispatch_unary(op, [&](auto f) {
    launch_map1(stream, OnStorage<T, decltype(f)>{f}, x, y, n);
  });
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void affine(cudaStream_t stream, const T* x, T* y, i64 n, float alpha, float beta) {
  check_count(n, "affine");
  if (n == 0) return;
  launch_map1(stream, AffineOn<T>{alpha, beta}, x, y, n);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void axpy(cudaStream_t stream, float alpha, const T* x, T* y, i64 n) {
  check_count(n, "axpy");
  if (n == 0) return;
  launch_map2(stream, AxpyOn<T>{alpha}, static_cast<const T*>(y), x, y, n);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void binary(cudaStream_t stream, BinaryOp op, const Indexer& ix, const T* a, const T* b, T* out) {
  DP_CHECK(op < BinaryOp::kCount, "binary: expected a BinaryOp below kCount, got ",
           static_cast<int>(op));
  const walk::Collapsed c = walk::collapse(ix);
  if (c.numel == 0) return;
  dispatch_binary(op, [&](auto f) {
    const OnStorage<T, decltype(f)> g{f};
    if (c.contiguous) return launch_map2(stream, g, a, b, out, c.numel);
    with_walk<walk::pack_lanes<T>>(c, a, b, out, sizeof(T), /*uses_b=*/true,
                                   [&](const auto& wix, auto lanes, auto b_broadcast, i64 n) {
                                     constexpr int kLanes = decltype(lanes)::value;
                                     constexpr bool kBroadcast = decltype(b_broadcast)::value;
                                     binary_strided_kernel<kLanes, kBroadcast>
                                         <<<grid_for(n), kBlock, 0, stream>>>(g, wix, a, b, out, n);
                                   });
  });
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void where(cudaStream_t stream, const WhereArgs& w) {
  DP_CHECK(w.ix.ndim >= 1 && w.ix.ndim <= kMaxDims, "where: expected 1 to ", kMaxDims, " dims, got ", w.ix.ndim);
  i64 n = 1;
  for (int d = 0; d < w.ix.ndim; ++d) n *= w.ix.sizes[d];
  check_count(n, "where");
  if (n == 0) return;
  where_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(w, n);
  DP_CUDA_CHECK_LAUNCH();
}

// The storage types registered in the kernel table (the end of this file); the other
// launcher templates are instantiated by the table's uses alone.
template void unary<float>(cudaStream_t, UnaryOp, const float*, float*, i64);
template void affine<float>(cudaStream_t, const float*, float*, i64, float, float);
template void axpy<float>(cudaStream_t, float, const float*, float*, i64);
template void binary<float>(cudaStream_t, BinaryOp, const Indexer&, const float*, const float*, float*);
template void unary<__nv_bfloat16>(cudaStream_t, UnaryOp, const __nv_bfloat16*, __nv_bfloat16*, i64);
template void affine<__nv_bfloat16>(cudaStream_t, const __nv_bfloat16*, __nv_bfloat16*, i64, float, float);
template void axpy<__nv_bfloat16>(cudaStream_t, float, const __nv_bfloat16*, __nv_bfloat16*, i64);
template void binary<__nv_bfloat16>(cudaStream_t, BinaryOp, const Indexer&, const __nv_bfloat16*,
                                    const __nv_bfloat16*, __nv_bfloat16*);
template void unary<__half>(cudaStream_t, UnaryOp, const __half*, __half*, i64);
template void affine<__half>(cudaStream_t, const __half*, __half*, i64, float, float);
template void axpy<__half>(cudaStream_t, float, const __half*, __half*, i64);
template void binary<__half>(cudaStream_t, BinaryOp, const Indexer&, const __half*, const __half*, __half*);

template <typename T>
void strided_copy(cudaStream_t stream, const Indexer& ix, const T* a, T* out) {
  Indexer only_a = ix;
  for (int d = 0; d < kMaxDims; ++d) only_a.strides_b[d] = 0;  // b unused: never blocks merging
  const walk::Collapsed c = walk::collapse(only_a);
  if (c.numel == 0) return;
  const i64 n = c.numel;
  if (c.ix.ndim == 1 && c.ix.strides_a[0] == 1) {
    DP_CUDA_CHECK(cudaMemcpyAsync(out, a, static_cast<std::size_t>(n) * sizeof(T),
                                  cudaMemcpyDeviceToDevice, stream));
    return;
  }
  with_walk<walk::pack_lanes<T>>(c, a, nullptr, out, sizeof(T), /*uses_b=*/false,
                                 [&](const auto& wix, auto lanes, auto, i64 packs) {
                                   strided_copy_kernel<decltype(lanes)::value>
                                       <<<grid_for(packs), kBlock, 0, stream>>>(wix, a, out, packs);
                                 });
  DP_CUDA_CHECK_LAUNCH();
}

void fill_uniform(cudaStream_t stream, float* y, i64 n, float lo, float hi, std::uint64_t seed,
                  std::uint64_t offset) {
  check_count(n, "fill_uniform");
  if (n == 0) return;
  uniform_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, lo, hi - lo, seed, offset);
  DP_CUDA_CHECK_LAUNCH();
}

void fill_normal(cudaStream_t stream, float* y, i64 n, float mean, float std, std::uint64_t seed,
                 std::uint64_t offset) {
  check_count(n, "fill_normal");
  if (n == 0) return;
  normal_kernel<<<grid_for(n), kBlock, 0, stream>>>(y, n, mean, std, seed, offset);
  DP_CUDA_CHECK_LAUNCH();
}

void dropout(cudaStream_t stream, const float* x, float* y, float* mask, i64 n, float p,
             std::uint64_t seed, std::uint64_t offset) {
  check_count(n, "dropout");
  DP_CHECK(p >= 0.0f && p <= 1.0f, "dropout: expected a probability p in [0, 1], got ", p);
  if (n == 0) return;
  // p == 1 drops everything; 1/(1-p) would be inf and 0 * inf NaN.
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  dropout_kernel<<<grid_for(n), kBlock, 0, stream>>>(x, y, mask, n, p, scale, seed, offset);
  DP_CUDA_CHECK_LAUNCH();
}

void count_nonfinite(cudaStream_t stream, const float* x, i64 n, unsigned long long* count) {
  check_count(n, "count_nonfinite");
  if (n == 0) return;
  count_nonfinite_kernel<<<grid_for(n), kBlock, 0, stream>>>(x, n, count);
  DP_CUDA_CHECK_LAUNCH();
}

void scale_find_nonfinite(cudaStream_t stream, float* x, i64 n, float scale, float* found) {
  check_count(n, "scale_find_nonfinite");
  DP_CHECK(found != nullptr, "scale_find_nonfinite: expected a device flag, got null");
  if (n == 0) return;
  scale_find_nonfinite_kernel<<<grid_for(n), kBlock, 0, stream>>>(x, n, scale, found);
  DP_CUDA_CHECK_LAUNCH();
}

void sgd_step(cudaStream_t stream, float* param, const float* grad, float* momentum_buf, i64 n,
              double lr, double momentum, double dampening, double weight_decay, bool nesterov,
              bool first_step) {
  check_count(n, "sgd_step");
  DP_CHECK(momentum == 0.0 || momentum_buf, "sgd_step: momentum ", momentum,
           " needs a momentum buffer, got null");
  if (n == 0) return;
  const SgdUpdate upd{make_sgd_params(lr, momentum, dampening, weight_decay, nesterov, first_step)};
  sgd_kernel<<<grid_for(n), kBlock, 0, stream>>>(upd, param, grad,
                                                 momentum != 0.0 ? momentum_buf : nullptr, n);
  DP_CUDA_CHECK_LAUNCH();
}

void adam_step(cudaStream_t stream, float* param, const float* grad, float* exp_avg,
               float* exp_avg_sq, i64 n, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool decoupled, i64 step) {
  check_count(n, "adam_step");
  DP_CHECK(step >= 1, "adam_step: expected a 1-based step, got ", step);
  if (n == 0) return;
  const AdamUpdate upd{make_adam_params(lr, beta1, beta2, eps, weight_decay, decoupled, step)};
  adam_kernel<<<grid_for(n), kBlock, 0, stream>>>(upd, param, grad, exp_avg, exp_avg_sq, n);
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace dp::backend::cuda_kernels

// ---- the kernel table's entries (Note [The op list] in ops.h) --------------------------------

namespace dp::backend::cuda_kernels {
namespace {
namespace k = dp::backend::cuda_kernels;  // the launchers above
namespace table {

using i64 = std::int64_t;

void fill_f32(CudaBackend& be, Device dev, const FillArgs& a) {
  k::fill(be.bind(dev), static_cast<float*>(a.y), a.n, a.value.as<float>());
}
void fill_i64(CudaBackend& be, Device dev, const FillArgs& a) {
  k::fill_i64(be.bind(dev), static_cast<i64*>(a.y), a.n, a.value.as<i64>());
}
/// H: dp::BFloat16 or dp::Float16. The host rounds the value (dp/core/half.h), so a fill
/// writes the CPU backend's bits, a NaN's included.
template <typename H>
void fill_16bit(CudaBackend& be, Device dev, const FillArgs& a) {
  k::fill_16bit(be.bind(dev), static_cast<std::uint16_t*>(a.y), a.n, a.value.as<H>().bits);
}
void add_scalar_i64(CudaBackend& be, Device dev, const AddScalarArgs& a) {
  k::add_i64(be.bind(dev), static_cast<i64*>(a.y), a.n, a.value.as<i64>());
}
void arange_f32(CudaBackend& be, Device dev, const ArangeArgs& a) {
  k::arange(be.bind(dev), static_cast<float*>(a.y), a.n, a.start.as<float>(), a.step.as<float>());
}
void arange_i64(CudaBackend& be, Device dev, const ArangeArgs& a) {
  k::arange_i64(be.bind(dev), static_cast<i64*>(a.y), a.n, a.start.as<i64>(), a.step.as<i64>());
}

/// Dst: the call's dtype as a kernel table C++ type (DTypeOf in ops.h); from any source
/// dtype, as the CPU backend casts.
template <typename Dst>
void cast_to(CudaBackend& be, Device dev, const CastArgs& a) {
  cudaStream_t s = be.bind(dev);
  visit_dtype(a.x_dtype, [&](auto src_zero) {
    using Src = device_t<decltype(src_zero)>;
    k::cast(s, static_cast<const Src*>(a.x), static_cast<device_t<Dst>*>(a.y), a.n);
  });
}

template <typename T>
void unary(CudaBackend& be, Device dev, const UnaryArgs& a) {
  k::unary<T>(be.bind(dev), a.op, static_cast<const T*>(a.x), static_cast<T*>(a.y), a.n);
}
template <typename T>
void affine(CudaBackend& be, Device dev, const AffineArgs& a) {
  k::affine<T>(be.bind(dev), static_cast<const T*>(a.x), static_cast<T*>(a.y), a.n, a.alpha, a.beta);
}
template <typename T>
void axpy(CudaBackend& be, Device dev, const AxpyArgs& a) {
  k::axpy<T>(be.bind(dev), a.alpha, static_cast<const T*>(a.x), static_cast<T*>(a.y), a.n);
}
template <typename T>
void binary(CudaBackend& be, Device dev, const BinaryArgs& a) {
  k::binary<T>(be.bind(dev), a.op, a.ix, static_cast<const T*>(a.a), static_cast<const T*>(a.b),
               static_cast<T*>(a.out));
}
template <typename T>
void where(CudaBackend& be, Device dev, const WhereArgs& a) {
  k::where<T>(be.bind(dev), a);
}
void binary_i64(CudaBackend& be, Device dev, const BinaryArgs& a) {
  DP_CHECK(a.op == BinaryOp::Eq, "binary on int64: only eq is implemented, got op ", static_cast<int>(a.op));
  k::eq_i64(be.bind(dev), a.ix, static_cast<const i64*>(a.a), static_cast<const i64*>(a.b),
            static_cast<float*>(a.out));
}
// Copies and gathers only move elements: the 16-bit dtypes share their std::uint16_t
// instances (the bits move unchanged, NaNs included).
template <typename T>
void strided_copy(CudaBackend& be, Device dev, const StridedCopyArgs& a) {
  k::strided_copy(be.bind(dev), a.ix, static_cast<const T*>(a.a), static_cast<T*>(a.out));
}
template <typename T>
void gather(CudaBackend& be, Device dev, const GatherArgs& a) {
  k::gather(be.bind(dev), a.ix, a.dim, static_cast<const T*>(a.x), a.index, static_cast<T*>(a.out));
}
/// Whole rows of src along dim 0 onto y's rows (Note [Row scatter-add in position order]).
bool row_geometry(const ScatterAddArgs& a) {
  const Indexer& ix = a.ix;
  // y's rows must not overlap (each has one writer): a fresh table, as every caller's.
  return a.dim == 0 && ix.ndim == 2 && ix.sizes[0] > 0 && ix.sizes[1] > 0 && ix.strides_a[1] == 1 &&
         ix.strides_a[0] >= ix.sizes[1] && ix.strides_b[0] == 1 && ix.strides_b[1] == 0;
}

std::size_t round_up_256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

void scatter_add_rows_sorted(CudaBackend& be, Device dev, const ScatterAddArgs& a) {
  const i64 n = a.ix.sizes[0], cols = a.ix.sizes[1], y_row = a.ix.strides_a[0];
  DP_CHECK(n <= std::numeric_limits<int>::max(), "scatter_add: expected at most 2^31 - 1 rows, got ", n);
  cudaStream_t s = be.bind(dev);
  const int items = static_cast<int>(n);
  constexpr int kKeyBits = 8 * sizeof(i64);
  std::size_t temp = 0;
  DP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const i64*>(nullptr),
                                                static_cast<i64*>(nullptr), static_cast<const int*>(nullptr),
                                                static_cast<int*>(nullptr), items, 0, kKeyBits, s));
  // One scratch block: the sorted indices, the positions before and after, cub's storage.
  const std::size_t keys_bytes = round_up_256(static_cast<std::size_t>(n) * sizeof(i64));
  const std::size_t pos_bytes = round_up_256(static_cast<std::size_t>(n) * sizeof(int));
  CudaBackend::Scratch scratch(be, dev.index, keys_bytes + 2 * pos_bytes + temp);
  char* base = static_cast<char*>(scratch.get());
  auto* keys = reinterpret_cast<i64*>(base);
  auto* pos_in = reinterpret_cast<int*>(base + keys_bytes);
  auto* pos_out = reinterpret_cast<int*>(base + keys_bytes + pos_bytes);
  iota_i32_kernel<<<grid_for(n), kBlock, 0, s>>>(pos_in, n);
  DP_CUDA_CHECK_LAUNCH();
  DP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + keys_bytes + 2 * pos_bytes, temp, a.index, keys, pos_in,
                                                pos_out, items, 0, kKeyBits, s));
  row_runs_add_kernel<<<grid_for(n * ((cols + kWarp - 1) / kWarp) * kWarp), kBlock, 0, s>>>(
      keys, pos_out, static_cast<const float*>(a.src), static_cast<float*>(a.y), n, cols, y_row);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename T>
void scatter_add(CudaBackend& be, Device dev, const ScatterAddArgs& a) {
  if constexpr (std::is_same_v<T, float>) {
    if (row_geometry(a)) return scatter_add_rows_sorted(be, dev, a);
  }
  k::scatter_add(be.bind(dev), a.ix, a.dim, static_cast<const T*>(a.src), a.index, static_cast<T*>(a.y));
}

void count_nonfinite_f32(CudaBackend& be, Device dev, const CountNonfiniteArgs& a) {
  cudaStream_t s = be.bind(dev);
  *a.count = 0;
  if (a.n == 0) return;
  CudaBackend::Scratch counter(be, dev.index, sizeof(unsigned long long));
  auto* c = static_cast<unsigned long long*>(counter.get());
  DP_CUDA_CHECK(cudaMemsetAsync(c, 0, sizeof(*c), s));
  k::count_nonfinite(s, static_cast<const float*>(a.x), a.n, c);
  unsigned long long host = 0;
  DP_CUDA_CHECK(cudaMemcpyAsync(&host, c, sizeof(host), cudaMemcpyDeviceToHost, s));
  DP_CUDA_CHECK(cudaStreamSynchronize(s));  // documented as synchronous
  *a.count = static_cast<i64>(host);
}

void scale_find_nonfinite_f32(CudaBackend& be, Device dev, const ScaleFindNonfiniteArgs& a) {
  k::scale_find_nonfinite(be.bind(dev), static_cast<float*>(a.x), a.n, a.scale, a.found);
}

/// Calls f(std::true_type) for GELU's tanh form, f(std::false_type) for the exact one.
template <typename F>
void with_gelu_form(bool tanh, F&& f) {
  if (tanh) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}
/// Op::Gelu and Op::GeluBackward over storage type T (Note [Fused GELU]).
template <typename T>
void gelu(CudaBackend& be, Device dev, const GeluArgs& a) {
  check_count(a.n, "gelu");
  if (a.n == 0) return;
  with_gelu_form(a.tanh, [&](auto form) {
    launch_map1(be.bind(dev), GeluOn<T, decltype(form)::value>{}, static_cast<const T*>(a.x), static_cast<T*>(a.y),
                a.n);
  });
  DP_CUDA_CHECK_LAUNCH();
}
template <typename T>
void gelu_backward(CudaBackend& be, Device dev, const GeluBackwardArgs& a) {
  check_count(a.n, "gelu_backward");
  if (a.n == 0) return;
  with_gelu_form(a.tanh, [&](auto form) {
    launch_map2(be.bind(dev), GeluBackwardOn<T, decltype(form)::value>{}, static_cast<const T*>(a.x),
                static_cast<const T*>(a.gy), static_cast<T*>(a.gx), a.n);
  });
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace table

/// The 16-bit dtype of H (dp::BFloat16 or dp::Float16): the ops the CPU backend has for
/// it, over its device storage type (Note [16-bit storage on CUDA]). Sums and products
/// have none: the tensor layer widens their inputs (Note [16-bit tensors] in
/// dp/tensor/tensor.h); the GEMM is cuda_blas_dnn.cpp's.
template <typename H>
void register_16bit(CudaBackend& be) {
  using T = device_t<H>;
  constexpr DType dt = dtype_of<H>;
  add<Op::Fill, &table::fill_16bit<H>>(be, dt);
  add<Op::Cast, &table::cast_to<H>>(be, dt);
  add<Op::Unary, &table::unary<T>>(be, dt);
  add<Op::Affine, &table::affine<T>>(be, dt);
  add<Op::Axpy, &table::axpy<T>>(be, dt);
  add<Op::Binary, &table::binary<T>>(be, dt);
  add<Op::StridedCopy, &table::strided_copy<std::uint16_t>>(be, dt);
  add<Op::Gather, &table::gather<std::uint16_t>>(be, dt);
  add<Op::ScatterAdd, &table::scatter_add<T>>(be, dt);
  add<Op::Where, &table::where<std::uint16_t>>(be, dt);  // a selection: the bits move as they are
  add<Op::Gelu, &table::gelu<T>>(be, dt);
  add<Op::GeluBackward, &table::gelu_backward<T>>(be, dt);
}

}  // namespace

void register_elementwise_kernels(CudaBackend& be) {
  add<Op::Fill, &table::fill_f32>(be, DType::F32);
  add<Op::Fill, &table::fill_i64>(be, DType::I64);
  add<Op::AddScalar, &table::add_scalar_i64>(be, DType::I64);
  add<Op::Arange, &table::arange_f32>(be, DType::F32);
  add<Op::Arange, &table::arange_i64>(be, DType::I64);
  add<Op::Cast, &table::cast_to<float>>(be, DType::F32);
  add<Op::Cast, &table::cast_to<i64>>(be, DType::I64);
  add<Op::Cast, &table::cast_to<std::int32_t>>(be, DType::I32);
  add<Op::Unary, &table::unary<float>>(be, DType::F32);
  add<Op::Affine, &table::affine<float>>(be, DType::F32);
  add<Op::Axpy, &table::axpy<float>>(be, DType::F32);
  add<Op::Binary, &table::binary<float>>(be, DType::F32);
  add<Op::Binary, &table::binary_i64>(be, DType::I64);
  add<Op::Where, &table::where<float>>(be, DType::F32);
  add<Op::StridedCopy, &table::strided_copy<float>>(be, DType::F32);
  add<Op::StridedCopy, &table::strided_copy<i64>>(be, DType::I64);  // an integer copy_ broadcast
  add<Op::Gather, &table::gather<float>>(be, DType::F32);
  add<Op::ScatterAdd, &table::scatter_add<float>>(be, DType::F32);
  add<Op::CountNonfinite, &table::count_nonfinite_f32>(be, DType::F32);
  add<Op::ScaleFindNonfinite, &table::scale_find_nonfinite_f32>(be, DType::F32);
  add<Op::Gelu, &table::gelu<float>>(be, DType::F32);
  add<Op::GeluBackward, &table::gelu_backward<float>>(be, DType::F32);
  register_16bit<BFloat16>(be);
  register_16bit<Float16>(be);
}

}  // namespace dp::backend::cuda_kernels
