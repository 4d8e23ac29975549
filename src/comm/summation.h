// src/comm/summation.h — the dtypes a reduction can add, and how (Note [Collective
// dtypes] in dp/comm/communicator.h).
//
// Internal header of the comm layer, shared by the host-side communicators (local,
// hierarchical, mpi) and the checking front. A dtype takes part in all_reduce, reduce
// and reduce_scatter when it has a row here: its storage type and a Summand saying how
// an element is loaded into the accumulation type and stored back. Every other dtype
// is only moved. Knows nothing of devices, threads or communicators.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dp/tensor/tensor.h"

namespace dp::comm {

/// Every dp::Dtype, in the order messages list them ("it takes float32, int64, int32").
inline constexpr Dtype kEveryDtype[] = {Dtype::Float32, Dtype::Int64, Dtype::Int32, Dtype::BFloat16,
                                        Dtype::Float16};

/// How a reduction adds storage type T: elements are loaded into Acc, added in the
/// fixed order of Note [Fixed summation order], scaled (Average) and stored back.
/// Floating types accumulate in float. Only types with a specialisation are summable.
template <typename T>
struct Summand {
  static constexpr bool kSummable = false;
};

template <>
struct Summand<float> {
  static constexpr bool kSummable = true;
  using Acc = float;
  static Acc load(float x) { return x; }
  static float store(Acc a) { return a; }
};
/// bfloat16 and float16 add in float: each input widens exactly, the sum of every input
/// is formed in float32, and the result rounds once to nearest even.
template <typename T>
struct Summand16 {
  static constexpr bool kSummable = true;
  using Acc = float;
  static Acc load(T x) { return static_cast<float>(x); }
  static T store(Acc a) { return T(a); }
};
template <>
struct Summand<BFloat16> : Summand16<BFloat16> {};
template <>
struct Summand<Float16> : Summand16<Float16> {};

/// Calls f.template operator()<T>() with T the storage type of `dtype` and returns true
/// when `dtype` is summable; returns false (calling nothing) otherwise.
template <typename F>
bool with_summand(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::Float32:
      f.template operator()<float>();
      return true;
    case Dtype::BFloat16:
      f.template operator()<BFloat16>();
      return true;
    case Dtype::Float16:
      f.template operator()<Float16>();
      return true;
    default:
      return false;  // integers are moved, never reduced (Note [Collective dtypes])
  }
}

/// True when all_reduce, reduce and reduce_scatter can add `dtype`.
inline bool summable(Dtype dtype) {
  return with_summand(dtype, []<typename T>() {});
}

/// dst[i] = src[i] over a block, read as the accumulation type: the first input of a
/// fixed-order sum. In place on Acc storage (float32: a copy), so a float32 sum keeps
/// the exact operations it always had.
template <typename T>
void sum_first(typename Summand<T>::Acc* __restrict acc, const T* __restrict src, std::int64_t n) {
  if constexpr (std::is_same_v<typename Summand<T>::Acc, T>) {
    std::memcpy(acc, src, static_cast<std::size_t>(n) * sizeof(T));
  } else {
    for (std::int64_t i = 0; i < n; ++i) acc[i] = Summand<T>::load(src[i]);
  }
}

/// acc[i] += src[i]: the next input of a fixed-order sum.
template <typename T>
void sum_add(typename Summand<T>::Acc* __restrict acc, const T* __restrict src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] += Summand<T>::load(src[i]);
}

/// acc[i] *= s: Average's last step.
template <typename T>
void sum_scale(typename Summand<T>::Acc* __restrict acc, typename Summand<T>::Acc s, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] *= s;
}

/// dst[i] = acc[i] in storage type T (nothing to do where Acc is T and acc is dst).
template <typename T>
void sum_store(T* dst, const typename Summand<T>::Acc* acc, std::int64_t n) {
  if constexpr (std::is_same_v<typename Summand<T>::Acc, T>) {
    if (dst != acc) std::memcpy(dst, acc, static_cast<std::size_t>(n) * sizeof(T));
  } else {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = Summand<T>::store(acc[i]);
  }
}

}  // namespace dp::comm
