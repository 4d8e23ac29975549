// src/backend/cuda/cuda_common.cuh — launch geometry and warp/block reductions shared
// by the .cu files of backend/cuda. Device code only; internal.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"

namespace dp::backend::cuda_kernels {

/// Threads per block of the 1-d elementwise kernels: a multiple of the warp size that
/// keeps 8 blocks resident per SM on sm_80/sm_90.
inline constexpr int kBlock = 256;
/// Cap on blocks of a grid-stride loop: beyond ~32 blocks per SM (132 SMs on H100)
/// more blocks only add scheduling overhead; each thread then loops.
inline constexpr std::int64_t kMaxBlocks = 4096;
inline constexpr int kWarp = 32;

/// Blocks for n elements with `block` threads each, at least 1, at most kMaxBlocks.
inline unsigned grid_for(std::int64_t n, int block = kBlock) {
  std::int64_t g = (n + block - 1) / block;
  if (g < 1) g = 1;
  if (g > kMaxBlocks) g = kMaxBlocks;
  return static_cast<unsigned>(g);
}

/// First index and stride of a 1-d grid-stride loop, in 64 bits.
__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  static constexpr float kIdentity = 0.0f;
};
struct MaxOp {
  // NaN wins, as in torch.max.
  __device__ __forceinline__ float operator()(float a, float b) const {
    return (a != a || a > b) ? a : b;
  }
  static constexpr float kIdentity = -__builtin_huge_valf();
};
struct MinOp {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return (a != a || a < b) ? a : b;
  }
  static constexpr float kIdentity = __builtin_huge_valf();
};

/// Reduces v over the 32 lanes of a warp; every lane gets the result.
template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

/// Reduces v over a 1-d block (blockDim.x a multiple of 32, at most 1024); every thread
/// gets the result. `smem` holds 32 floats. Ends with a barrier, so it can be called
/// again with the same smem.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, Op op, float* smem) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  v = warp_reduce(v, op);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < warps ? smem[lane] : Op::kIdentity;
  v = warp_reduce(v, op);
  __syncthreads();
  return v;
}

}  // namespace dp::backend::cuda_kernels
