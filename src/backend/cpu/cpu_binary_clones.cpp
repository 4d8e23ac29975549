// CPU backend: the float32 loops of the binary ops +, -, *, / and of affine and axpy,
// with ISA clones.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
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
// compares them).

namespace {

using i64 = std::int64_t;

/// The binary kernel's inner loop, specialised on the common stride patterns (Note
/// [Collapsing strided dimensions] in cpu_elementwise.cpp). Always inlined: only code
/// inlined into a clone is compiled for the clone's ISA.
template <typename F>
[[gnu::always_inline]] inline void inner(F f, const float* a, i64 sa, const float* b, i64 sb, float* out, i64 len) {
  if (sa == 1 && sb == 1) {
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i], b[i]);
  } else if (sa == 1 && sb == 0) {
    const float bv = *b;
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i], bv);
  } else if (sa == 0 && sb == 1) {
    const float av = *a;
    for (i64 i = 0; i < len; ++i) out[i] = f(av, b[i]);
  } else {
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i * sa], b[i * sb]);
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES void binary_clone_f32(BinaryOp op, const float* a, i64 sa, const float* b, i64 sb, float* out,
                                          i64 len) {
  switch (op) {
    case BinaryOp::Add: inner(Binary<BinaryOp::Add>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::Sub: inner(Binary<BinaryOp::Sub>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::Mul: inner(Binary<BinaryOp::Mul>{}, a, sa, b, sb, out, len); return;
    case BinaryOp::Div: inner(Binary<BinaryOp::Div>{}, a, sa, b, sb, out, len); return;
    default: DP_ASSERT(false, "binary_clone_f32: no clone for BinaryOp ", static_cast<int>(op));
  }
}

DP_CPU_V4_V3_CLONES void affine_f32(const float* x, float* y, i64 n, float alpha, float beta) {
  for (i64 i = 0; i < n; ++i) y[i] = alpha * x[i] + beta;
}

DP_CPU_V4_V3_CLONES void axpy_f32(float alpha, const float* x, float* y, i64 n) {
  for (i64 i = 0; i < n; ++i) y[i] = y[i] + alpha * x[i];
}

}  // namespace dp::backend::cpu
