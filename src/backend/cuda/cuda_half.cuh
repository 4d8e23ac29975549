// src/backend/cuda/cuda_half.cuh — the 16-bit floating storage types on the device:
// __nv_bfloat16 for DType::BF16, __half for DType::F16, with the conversions of Note
// [Storage types] (functors.h), so that the templated kernels of backend/cuda instantiate
// for them. For the .cu files of backend/cuda only; internal.
//
//   using T = device_t<dp::BFloat16>;            // __nv_bfloat16
//   y[i] = store_acc<T>(2.0f * load_acc(x[i]));  // widen, compute in float, round once
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "backend/functors.h"
#include "backend/ops.h"

namespace dp::backend {

// Note [16-bit storage on CUDA]
// A bfloat16 tensor's bytes are read as __nv_bfloat16 and a float16 tensor's as __half:
// each is the 16 bits of dp::BFloat16 / dp::Float16 (dp/core/half.h) and nothing else,
// and the kernel table passes untyped pointers, so nothing converts at the boundary.
// Widening to float is exact (__bfloat162float, __half2float); narrowing rounds to
// nearest even, keeps subnormals and overflows to infinity (__float2bfloat16_rn,
// __float2half_rn), as dp's own conversions do, so every finite or infinite result has
// the CPU backend's bits. A NaN stays a NaN but its bits may differ from the CPU's
// (Note [16-bit NaNs] in dp/core/half.h: __float2bfloat16_rn writes 0x7FFF where the CPU
// writes 0xFFFF, and __float2half_rn need not keep the payload bits the CPU keeps). The
// conversions are the intrinsics, never the types' conversion operators, which
// __CUDA_NO_BFLOAT16_CONVERSIONS__ / __CUDA_NO_HALF_CONVERSIONS__ would remove.

static_assert(sizeof(__nv_bfloat16) == sizeof(BFloat16) && alignof(__nv_bfloat16) == alignof(BFloat16),
              "__nv_bfloat16 must have dp::BFloat16's layout (Note [16-bit storage on CUDA])");
static_assert(sizeof(__half) == sizeof(Float16) && alignof(__half) == alignof(Float16),
              "__half must have dp::Float16's layout (Note [16-bit storage on CUDA])");

template <>
DP_HD inline float load_acc<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
DP_HD inline __nv_bfloat16 store_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
DP_HD inline float load_acc<__half>(__half v) {
  return __half2float(v);
}
template <>
DP_HD inline __half store_acc<__half>(float v) {
  return __float2half_rn(v);
}

/// The device storage type of a kernel table's C++ type (DTypeOf in ops.h): itself,
/// except the 16-bit floats (Note [16-bit storage on CUDA]).
template <typename T>
struct DeviceStorage {
  using type = T;
};
template <>
struct DeviceStorage<BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct DeviceStorage<Float16> {
  using type = __half;
};
template <typename T>
using device_t = typename DeviceStorage<T>::type;

/// True for the 16-bit device storage types.
template <typename T>
inline constexpr bool is_device_16bit = std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>;

/// x converted to Dst as functors.h's convert does on the CPU (through float when either
/// side is a 16-bit float: exact when widening, one rounding when narrowing), with the
/// 16-bit types converted by load_acc/store_acc.
template <typename Dst, typename Src>
DP_HD inline Dst convert_storage(Src x) {
  if constexpr (is_device_16bit<Src>) {
    return convert_storage<Dst>(load_acc(x));
  } else if constexpr (is_device_16bit<Dst>) {
    return store_acc<Dst>(convert<float>(x));
  } else {
    return convert<Dst>(x);
  }
}

}  // namespace dp::backend
