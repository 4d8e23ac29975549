// CUDA backend: reductions over the middle axis of an (outer, r, inner) view, and argmax.
//
// Two layouts, two kernels each. inner == 1 (rows, the common case of a last-dim
// reduction): a warp per row for short rows, a block per row for long ones. inner > 1
// (columns): a 32-wide tile of inner positions per block, reads coalesced along inner,
// the r axis split across the block's 8 rows of threads and combined in shared memory.
// Every launch reduces in a fixed order, so results are deterministic run to run.
//
// Note [Split reductions]
// One block per row (or per BatchNorm channel) leaves most of the GPU idle when there
// are few rows: a sum over a whole tensor ran on one SM of 132. Such a reduction is
// split over S blocks per row (kernel_plan::row_splits / bn_splits: about 256 blocks
// in all, at least 4096 elements each, at most 64 per row), each writing the partial
// of its contiguous part of the row; a second pass combines the S partials of a row
// in index order. No float atomics: the order of every addition depends only on the
// shape (S is a function of the sizes, never of the GPU or of timing), so results are
// bitwise the same run to run. They differ from the one-block order in the last bits,
// which the CPU oracle tests' tolerances cover.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_half.cuh"
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/cuda_register.h"
#include "backend/kernel_plan.h"
#include "dp/core/error.h"

namespace dp::backend::cuda_kernels {
namespace {

using i64 = std::int64_t;

// Rows up to this length use a warp per row: a block per row would idle most threads.
constexpr i64 kWarpRowMax = 1024;
constexpr int kRowsPerBlock = 8;   // warps per block in the warp-per-row kernels
constexpr int kColSplit = 8;       // threads along r per column in the column kernel
// ... and 32 where the grid is too small to fill the GPU (a bias gradient: one outer
// slice, cols / 32 blocks): four times the threads on each column. On an H200, a GPT-2
// small step's 45 column sums of (8192, 768 or 3072) took 141 µs each with 8.
constexpr int kColSplitWide = 32;
constexpr i64 kFewColumnBlocks = 256;
constexpr unsigned kMaxGridY = 65535;

// ---- kernels ------------------------------------------------------------------------------

template <typename Op>
__global__ void reduce_rows_warp_kernel(Op op, const float* __restrict__ x, float* __restrict__ y,
                                        i64 rows, i64 r) {
  const i64 warps_total = static_cast<i64>(gridDim.x) * kRowsPerBlock;
  for (i64 row = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.y; row < rows;
       row += warps_total) {
    const float* xr = x + row * r;
    float acc = Op::kIdentity;
    for (i64 k = threadIdx.x; k < r; k += kWarp) acc = op(acc, xr[k]);
    acc = warp_reduce(acc, op);
    if (threadIdx.x == 0) y[row] = acc;
  }
}

template <typename Op>
__global__ void reduce_rows_block_kernel(Op op, const float* __restrict__ x, float* __restrict__ y,
                                         i64 rows, i64 r) {
  __shared__ float smem[kWarp];
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* xr = x + row * r;
    float acc = Op::kIdentity;
    for (i64 k = threadIdx.x; k < r; k += blockDim.x) acc = op(acc, xr[k]);
    acc = block_reduce(acc, op, smem);
    if (threadIdx.x == 0) y[row] = acc;
  }
}

// The first pass of a split row reduction (Note [Split reductions]): grid (S, rows),
// block (s, row) reduces part s of the row into part[row * S + s].
template <typename Op>
__global__ void reduce_rows_split_kernel(Op op, const float* __restrict__ x, float* __restrict__ part,
                                         i64 r) {
  __shared__ float smem[kWarp];
  const int S = static_cast<int>(gridDim.x), sp = static_cast<int>(blockIdx.x);
  const i64 row = blockIdx.y;
  const kernel_plan::Part pt = kernel_plan::part_of(r, S, sp);
  const float* xr = x + row * r;
  float acc = Op::kIdentity;
  for (i64 k = pt.begin + threadIdx.x; k < pt.end; k += blockDim.x) acc = op(acc, xr[k]);
  acc = block_reduce(acc, op, smem);
  if (threadIdx.x == 0) part[row * S + sp] = acc;
}

// Block (32, Split); grid.x tiles inner, grid.y strides over outer.
template <int Split, typename Op>
__global__ void reduce_cols_kernel(Op op, const float* __restrict__ x, float* __restrict__ y,
                                   i64 outer, i64 r, i64 inner) {
  __shared__ float smem[Split][kWarp + 1];  // +1: no bank conflicts on the transpose read
  const i64 i = static_cast<i64>(blockIdx.x) * kWarp + threadIdx.x;
  for (i64 o = blockIdx.y; o < outer; o += gridDim.y) {
    float acc = Op::kIdentity;
    if (i < inner) {
      const float* xo = x + o * r * inner + i;
      for (i64 k = threadIdx.y; k < r; k += Split) acc = op(acc, xo[k * inner]);
    }
    smem[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && i < inner) {
      float v = smem[0][threadIdx.x];
#pragma unroll
      for (int s = 1; s < Split; ++s) v = op(v, smem[s][threadIdx.x]);
      y[o * inner + i] = v;
    }
    __syncthreads();
  }
}

/// (value, index) with "a beats b" of torch.argmax: larger value, NaN beats numbers,
/// the smaller index on ties.
__device__ __forceinline__ bool arg_better(float va, i64 ia, float vb, i64 ib) {
  const bool na = va != va, nb = vb != vb;
  if (na != nb) return na;
  if (na || va == vb) return ia < ib;
  return va > vb;
}

__global__ void argmax_rows_kernel(const float* __restrict__ x, i64* __restrict__ y, i64 rows,
                                   i64 r) {
  const i64 warps_total = static_cast<i64>(gridDim.x) * kRowsPerBlock;
  for (i64 row = static_cast<i64>(blockIdx.x) * kRowsPerBlock + threadIdx.y; row < rows;
       row += warps_total) {
    const float* xr = x + row * r;
    float best = -__builtin_huge_valf();
    i64 best_i = r;  // sentinel: loses every tie against a real index
    for (i64 k = threadIdx.x; k < r; k += kWarp) {
      if (arg_better(xr[k], k, best, best_i)) {
        best = xr[k];
        best_i = k;
      }
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, off);
      const i64 oi = __shfl_xor_sync(0xffffffffu, best_i, off);
      if (arg_better(ov, oi, best, best_i)) {
        best = ov;
        best_i = oi;
      }
    }
    if (threadIdx.x == 0) y[row] = best_i;
  }
}

__global__ void argmax_cols_kernel(const float* __restrict__ x, i64* __restrict__ y, i64 outer,
                                   i64 r, i64 inner) {
  const i64 total = outer * inner;
  for (i64 t = global_thread(); t < total; t += grid_stride()) {
    const i64 o = t / inner, i = t - o * inner;
    const float* xo = x + o * r * inner + i;
    float best = xo[0];
    i64 best_i = 0;
    for (i64 k = 1; k < r; ++k) {
      const float v = xo[k * inner];
      if (arg_better(v, k, best, best_i)) {
        best = v;
        best_i = k;
      }
    }
    y[t] = best_i;
  }
}

// The copy communicator's sum (Note [CUDA copy communicator]): element i in the fixed
// order of Note [Fixed summation order]; a float4 per thread when every pointer is
// 16-byte aligned. No __restrict__: dst may be one of the inputs.
__global__ void sum_inputs_vec4_kernel(SumInputs in, float* dst, i64 n4, bool average, float inv) {
  for (i64 t = global_thread(); t < n4; t += grid_stride()) {
    float4 acc = static_cast<const float4*>(in.ptr[0])[t];
    for (int k = 1; k < in.count; ++k) {
      const float4 v = static_cast<const float4*>(in.ptr[k])[t];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    if (average) {
      acc.x *= inv;
      acc.y *= inv;
      acc.z *= inv;
      acc.w *= inv;
    }
    reinterpret_cast<float4*>(dst)[t] = acc;
  }
}

// T: float, or a 16-bit storage type widened, summed in float and rounded once (Note
// [Collective dtypes]: the order and the float accumulation of the CPU's summation).
template <typename T>
__global__ void sum_inputs_kernel(SumInputs in, T* dst, i64 begin, i64 n, bool average, float inv) {
  for (i64 i = begin + global_thread(); i < n; i += grid_stride()) {
    float acc = load_acc(static_cast<const T*>(in.ptr[0])[i]);
    for (int k = 1; k < in.count; ++k) acc += load_acc(static_cast<const T*>(in.ptr[k])[i]);
    if (average) acc *= inv;
    dst[i] = store_acc<T>(acc);
  }
}

// ---- host helpers -------------------------------------------------------------------------

/// sum_inputs_kernel over elements [begin, n).
template <typename T>
void launch_sum_inputs(cudaStream_t stream, const SumInputs& in, T* dst, i64 begin, i64 n, bool average, float inv) {
  if (begin >= n) return;
  sum_inputs_kernel<<<grid_for(n - begin), kBlock, 0, stream>>>(in, dst, begin, n, average, inv);
  DP_CUDA_CHECK_LAUNCH();
}

template <typename Op>
void launch_reduce(cudaStream_t stream, Op op, const float* x, float* y, i64 outer, i64 r,
                   i64 inner, float* scratch) {
  if (r == 0) {  // empty sum: 0 (reduce() rejects empty Max/Min, as the CPU backend)
    fill(stream, y, outer * inner, Op::kIdentity);
    return;
  }
  if (inner == 1) {
    if (r <= kWarpRowMax) {
      const unsigned blocks = grid_for(outer, kRowsPerBlock);
      reduce_rows_warp_kernel<<<blocks, dim3(kWarp, kRowsPerBlock), 0, stream>>>(op, x, y, outer, r);
    } else if (const int S = kernel_plan::row_splits(outer, r); S > 1) {
      DP_CHECK(scratch != nullptr, "reduce: expected scratch of ", outer * S, " floats");
      // outer < kTargetBlocks when S > 1: the rows fit in grid.y.
      reduce_rows_split_kernel<<<dim3(static_cast<unsigned>(S), static_cast<unsigned>(outer)), kBlock, 0,
                                 stream>>>(op, x, scratch, r);
      DP_CUDA_CHECK_LAUNCH();
      reduce_rows_warp_kernel<<<grid_for(outer, kRowsPerBlock), dim3(kWarp, kRowsPerBlock), 0, stream>>>(
          op, scratch, y, outer, S);
    } else {
      const unsigned blocks = outer < kMaxBlocks ? static_cast<unsigned>(outer) : kMaxBlocks;
      reduce_rows_block_kernel<<<blocks, kBlock, 0, stream>>>(op, x, y, outer, r);
    }
  } else {
    const i64 tiles = (inner + kWarp - 1) / kWarp;
    DP_CHECK(tiles <= 0x7fffffff, "reduce: inner size ", inner, " too large");
    const dim3 grid(static_cast<unsigned>(tiles),
                    static_cast<unsigned>(outer < kMaxGridY ? outer : kMaxGridY));
    if (tiles * std::min<i64>(outer, kMaxGridY) < kFewColumnBlocks && r >= 4 * kColSplitWide)
      reduce_cols_kernel<kColSplitWide><<<grid, dim3(kWarp, kColSplitWide), 0, stream>>>(op, x, y, outer, r, inner);
    else
      reduce_cols_kernel<kColSplit><<<grid, dim3(kWarp, kColSplit), 0, stream>>>(op, x, y, outer, r, inner);
  }
  DP_CUDA_CHECK_LAUNCH();
}

void check_shape(const char* op, i64 outer, i64 r, i64 inner) {
  DP_CHECK(outer >= 0 && r >= 0 && inner >= 0, op, ": expected non-negative (outer, r, inner), got (",
           outer, ", ", r, ", ", inner, ")");
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------

i64 reduce_scratch(i64 outer, i64 r, i64 inner) {
  if (inner != 1 || r <= kWarpRowMax || outer <= 0) return 0;
  const int S = kernel_plan::row_splits(outer, r);
  return S > 1 ? outer * S : 0;
}

void reduce(cudaStream_t stream, ReduceOp op, const float* x, float* y, i64 outer, i64 r,
            i64 inner, float* scratch) {
  check_shape("reduce", outer, r, inner);
  DP_CHECK(r > 0 || op == ReduceOp::Sum,
           "reduce: max/min over an empty dimension has no identity; expected r > 0, got r = 0");
  if (outer == 0 || inner == 0) return;
  switch (op) {
    case ReduceOp::Sum: launch_reduce(stream, SumOp{}, x, y, outer, r, inner, scratch); return;
    case ReduceOp::Max: launch_reduce(stream, MaxOp{}, x, y, outer, r, inner, scratch); return;
    case ReduceOp::Min: launch_reduce(stream, MinOp{}, x, y, outer, r, inner, scratch); return;
    case ReduceOp::kCount: break;
  }
  DP_FAIL("reduce: expected a ReduceOp below kCount, got ", static_cast<int>(op));
}

void sum_inputs(cudaStream_t stream, const SumInputs& in, void* dst_bytes, i64 n, bool average, float inv,
                DType dtype) {
  DP_CHECK(in.count >= 1 && in.count <= kMaxSumInputs, "sum_inputs: expected 1 to ", kMaxSumInputs,
           " inputs, got ", in.count);
  DP_CHECK(n >= 0, "sum_inputs: expected n >= 0, got ", n);
  DP_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "sum_inputs: expected float32, bfloat16 or float16 elements, got dtype ", static_cast<int>(dtype));
  if (n == 0) return;
  if (dtype == DType::BF16) {
    launch_sum_inputs(stream, in, static_cast<__nv_bfloat16*>(dst_bytes), 0, n, average, inv);
    return;
  }
  if (dtype == DType::F16) {
    launch_sum_inputs(stream, in, static_cast<__half*>(dst_bytes), 0, n, average, inv);
    return;
  }
  auto* dst = static_cast<float*>(dst_bytes);
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  bool vec = aligned(dst);
  for (int k = 0; k < in.count; ++k) vec = vec && aligned(in.ptr[k]);
  i64 done = 0;
  if (vec && n >= 4) {
    const i64 n4 = n / 4;
    sum_inputs_vec4_kernel<<<grid_for(n4), kBlock, 0, stream>>>(in, dst, n4, average, inv);
    DP_CUDA_CHECK_LAUNCH();
    done = n4 * 4;
  }
  launch_sum_inputs(stream, in, dst, done, n, average, inv);
}

void argmax(cudaStream_t stream, const float* x, i64* y, i64 outer, i64 r, i64 inner) {
  check_shape("argmax", outer, r, inner);
  DP_CHECK(r > 0, "argmax: expected a non-empty reduced dimension, got size 0");
  if (outer == 0 || inner == 0) return;
  if (inner == 1) {
    argmax_rows_kernel<<<grid_for(outer, kRowsPerBlock), dim3(kWarp, kRowsPerBlock), 0, stream>>>(
        x, y, outer, r);
  } else {
    argmax_cols_kernel<<<grid_for(outer * inner), kBlock, 0, stream>>>(x, y, outer, r, inner);
  }
  DP_CUDA_CHECK_LAUNCH();
}

}  // namespace dp::backend::cuda_kernels

// ---- the kernel table's entries (Note [The op list] in ops.h) --------------------------------

namespace dp::backend::cuda_kernels {
namespace {
namespace k = dp::backend::cuda_kernels;  // the launchers above
namespace table {

using i64 = std::int64_t;

void reduce_f32(CudaBackend& be, Device dev, const ReduceArgs& a) {
  cudaStream_t s = be.bind(dev);
  const float* x = static_cast<const float*>(a.x);
  float* y = static_cast<float*>(a.y);
  const i64 floats = a.outer >= 0 && a.r >= 0 && a.inner >= 0 ? k::reduce_scratch(a.outer, a.r, a.inner) : 0;
  if (floats == 0) {
    k::reduce(s, a.op, x, y, a.outer, a.r, a.inner, nullptr);
    return;
  }
  CudaBackend::Scratch parts(be, dev.index, static_cast<std::size_t>(floats) * sizeof(float));
  k::reduce(s, a.op, x, y, a.outer, a.r, a.inner, static_cast<float*>(parts.get()));
}
void argmax_f32(CudaBackend& be, Device dev, const ArgmaxArgs& a) {
  k::argmax(be.bind(dev), static_cast<const float*>(a.x), a.y, a.outer, a.r, a.inner);
}

}  // namespace table
}  // namespace

void register_reduce_kernels(CudaBackend& be) {
  add<Op::Reduce, &table::reduce_f32>(be, DType::F32);
  add<Op::Argmax, &table::argmax_f32>(be, DType::F32);
}

}  // namespace dp::backend::cuda_kernels
