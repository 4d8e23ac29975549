// CPU backend: the float32 and bfloat16 loops of the binary ops +, -, *, /, ReLU's
// backward and of
// affine and axpy, the float32 <-> bfloat16 casts, and the gradient scaler's multiply
// with its non-finite check, with ISA clones.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_inner_loop.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {

// Note [Binary clones]
// A transformer's step runs many elementwise passes over activations (residual adds,
// layer norm's scale and shift, the scalar multiplies of its backward), memory-bound
// but not only: at the baseline's four SSE lanes the loads, the op and the stores of a
// cache-resident row still cost a few percent of the GPT's CPU step each. The x86-64-v3
// and -v4 clones run the same loops in 8 and 16 lanes. Each element is one IEEE
// operation (+, -, *, / correctly rounded at any width) or, for affine and axpy, two;
// this file is built with -ffp-contract=off, so no clone forms an FMA, and every clone
// writes the bits of the baseline loops in cpu_elementwise.cpp (cpu_backend_test
// compares them). bfloat16 (autocast's activations) runs the same loops widened and
// rounded by BFloat16's integer arithmetic (dp/core/half.h), exact at any width.

namespace {

using i64 = std::int64_t;

/// The op's functor over storage type T (Note [Storage types] in functors.h).
template <typename T>
[[gnu::always_inline]] inline void binary_loop(BinaryOp op, const T* a, i64 sa, const T* b, i64 sb, T* out, i64 len) {
  switch (op) {
    case BinaryOp::Add: inner_loop(OnStorage<T, Binary<BinaryOp::Add>>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::Sub: inner_loop(OnStorage<T, Binary<BinaryOp::Sub>>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::Mul: inner_loop(OnStorage<T, Binary<BinaryOp::Mul>>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::Div: inner_loop(OnStorage<T, Binary<BinaryOp::Div>>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::ReluBackward:
      inner_loop(OnStorage<T, Binary<BinaryOp::ReluBackward>>{}, a, sa, b, sb, out, len);
      return;
    default: DP_ASSERT(false, "binary_clone: no clone for BinaryOp ", static_cast<int>(op));
  }
}

template <typename T>
[[gnu::always_inline]] inline void affine_loop(const T* x, T* y, i64 n, float alpha, float beta) {
  for (i64 i = 0; i < n; ++i) y[i] = store_acc<T>(alpha * load_acc(x[i]) + beta);
}

}  // namespace

DP_CPU_V4_V3_CLONES void binary_clone_f32(BinaryOp op, const float* a, i64 sa, const float* b, i64 sb, float* out,
                                          i64 len) {
  binary_loop(op, a, sa, b, sb, out, len);
}

DP_CPU_V4_V3_CLONES void binary_clone_bf16(BinaryOp op, const BFloat16* a, i64 sa, const BFloat16* b, i64 sb,
                                           BFloat16* out, i64 len) {
  binary_loop(op, a, sa, b, sb, out, len);
}

DP_CPU_V4_V3_CLONES void affine_f32(const float* x, float* y, i64 n, float alpha, float beta) {
  affine_loop(x, y, n, alpha, beta);
}

DP_CPU_V4_V3_CLONES void affine_bf16(const BFloat16* x, BFloat16* y, i64 n, float alpha, float beta) {
  affine_loop(x, y, n, alpha, beta);
}

DP_CPU_V4_V3_CLONES void cast_f32_to_bf16(const float* x, BFloat16* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = BFloat16(x[i]);
}

DP_CPU_V4_V3_CLONES void cast_bf16_to_f32(const BFloat16* x, float* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
}

DP_CPU_V4_V3_CLONES void axpy_f32(float alpha, const float* x, float* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = y[i] + alpha * x[i];
}

DP_CPU_V4_V3_CLONES bool scale_find_nonfinite_f32(float* x, i64 n, float scale) {
  std::uint32_t bad = 0;
  for (i64 i = 0; i < n; ++i) {
    // Exponent all ones <=> Inf or NaN, as count_nonfinite tests it: an integer OR
    // vectorises, std::isfinite may not.
    std::uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    bad |= static_cast<std::uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    x[i] = scale * x[i] + 0.0f;  // affine_loop's formula: the bits of Tensor::mul_
  }
  return bad != 0;
}

}  // namespace dp::backend::cpu
