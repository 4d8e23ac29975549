// src/tensor/autocast_policy.h — how an op applies Note [Autocast op policy] (internal;
// shared by the tensor and nn sources).
//
//   Tensor matmul(const Tensor& a, const Tensor& b) {
//     if (amp::detail::active()) {
//       const Dtype low = amp::detail::lower();
//       amp::detail::Suspend inner;  // the op's own calls see no autocast
//       return matmul(amp::detail::cast(a, low), amp::detail::cast(b, low));
//     }
//     ...
#pragma once

#include "dp/tensor/autocast.h"

namespace dp::amp::detail {

/// True inside an enabled autocast scope on this thread.
inline bool active() { return is_autocast_enabled(); }
/// The scope's lower-precision dtype.
inline Dtype lower() { return get_autocast_dtype(); }

/// RAII: autocast off while an op computes on the inputs it cast.
class Suspend {
 public:
  Suspend() : guard_(AutocastState{false, get_autocast_dtype()}) {}

 private:
  AutocastStateGuard guard_;
};

/// t converted to `dtype` (differentiably) when it is a defined floating tensor of
/// another dtype; otherwise t as it is (integers, undefined tensors).
Tensor cast(const Tensor& t, Dtype dtype);

inline bool is_16bit(const Tensor& t) {
  return t.defined() && (t.dtype() == Dtype::BFloat16 || t.dtype() == Dtype::Float16);
}

/// An op whose kernels are float32's, given 16-bit inputs: f on the inputs widened
/// (exactly), its result rounded once to the inputs' common dtype — the float32 math of
/// Note [16-bit tensors]: the 16-bit dtype when every floating input has it, float32
/// when any is float32 or they mix bfloat16 and float16 (PyTorch's promotion: a
/// bfloat16 prediction against a float32 target gives a float32 loss). Float32 inputs
/// go to f as they are.
template <typename F, typename... T>
Tensor in_float32(F f, const T&... ts) {
  bool any16 = false, widen = false;  // widen: a float32 input, or bfloat16 beside float16
  Dtype low = Dtype::Float32;
  auto see = [&](const Tensor& t) {
    if (!t.defined() || !is_floating_point(t.dtype())) return;
    if (!is_16bit(t)) {
      widen = true;
    } else if (!any16) {
      any16 = true;
      low = t.dtype();
    } else if (t.dtype() != low) {
      widen = true;
    }
  };
  (see(ts), ...);
  if (!any16) return f(ts...);
  const Tensor out = f(cast(ts, Dtype::Float32)...);
  return widen ? out : cast(out, low);
}

/// An op of the float32 list (Note [Autocast op policy]): inside a scope, f on its
/// inputs cast to float32, returning float32, with the scope suspended; outside one,
/// in_float32.
template <typename F, typename... T>
Tensor float32_op(F f, const T&... ts) {
  if (active()) {
    Suspend inner;
    return f(cast(ts, Dtype::Float32)...);
  }
  return in_float32(f, ts...);
}

/// An op of the lower-precision list inside a scope: f on its inputs cast to the
/// scope's dtype, with the scope suspended:
///   if (amp::detail::active()) return amp::detail::lower_op(conv, x, w, b);
template <typename F, typename... T>
Tensor lower_op(F f, const T&... ts) {
  const Dtype low = lower();
  Suspend inner;
  return f(cast(ts, low)...);
}

}  // namespace dp::amp::detail
