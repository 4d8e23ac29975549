// CPU backend: the float32 loops of the unary ops whose functors are polynomials (Exp,
// Tanh, Sigmoid; Note [Vectorisable exp and tanh] in functors.h) and of the fused GELU
// (Note [Fused GELU]), with ISA clones.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {

// Note [Unary clones]
// exp_approx and tanh_approx vectorise at any width, and at the baseline's four SSE
// lanes a GELU's tanh still cost a tenth of a transformer's CPU step. The x86-64-v3 and
// -v4 clones run the same loop in 8 and 16 lanes. bfloat16 ReLU has them too: with
// ReLU's backward (Note [Binary clones]) it was 7 % of ResNet-18's bfloat16 CPU step. This file is built with
// -ffp-contract=off, so no clone forms an FMA and every clone writes the bits the
// baseline loop in cpu_elementwise.cpp writes (cpu_backend_test compares them on
// every input class: tiny, huge, infinities, NaN, denormals).

namespace {

/// y[i] = f(x[i]); y may alias x. Always inlined: only code inlined into a clone is
/// compiled for the clone's ISA.
template <typename F>
[[gnu::always_inline]] inline void apply(F f, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
}

/// gx[i] = f(x[i], gy[i]); gx may alias gy.
template <typename F>
[[gnu::always_inline]] inline void apply2(F f, const float* x, const float* gy, float* gx, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) gx[i] = f(x[i], gy[i]);
}

}  // namespace

DP_CPU_V4_V3_CLONES void unary_clone_f32(UnaryOp op, const float* x, float* y, std::int64_t n) {
  switch (op) {
    case UnaryOp::Exp: apply(Unary<UnaryOp::Exp>{}, x, y, n); return;
    case UnaryOp::Tanh: apply(Unary<UnaryOp::Tanh>{}, x, y, n); return;
    case UnaryOp::Sigmoid: apply(Unary<UnaryOp::Sigmoid>{}, x, y, n); return;
    default: DP_ASSERT(false, "unary_clone_f32: no clone for UnaryOp ", static_cast<int>(op));
  }
}

// bfloat16 ReLU (a CNN's under autocast): the float functor on the widened value and
// BFloat16's integer rounding, which the baseline runs at four SSE lanes and scalar
// conversions; the same code in every clone, the same bits.
DP_CPU_V4_V3_CLONES void unary_clone_bf16(UnaryOp op, const BFloat16* x, BFloat16* y, std::int64_t n) {
  switch (op) {
    case UnaryOp::Relu: {
      const OnStorage<BFloat16, Unary<UnaryOp::Relu>> f{};
      for (std::int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
      return;
    }
    default: DP_ASSERT(false, "unary_clone_bf16: no clone for UnaryOp ", static_cast<int>(op));
  }
}

// The GELU's loops get the same clones: the tanh form vectorises (Note [Fused GELU]); the
// exact one calls erff or erfcf per element in every clone.
DP_CPU_V4_V3_CLONES void gelu_f32(bool tanh, const float* x, float* y, std::int64_t n) {
  if (tanh) {
    apply(Gelu<true>{}, x, y, n);
  } else {
    apply(Gelu<false>{}, x, y, n);
  }
}

DP_CPU_V4_V3_CLONES void gelu_backward_f32(bool tanh, const float* x, const float* gy, float* gx, std::int64_t n) {
  if (tanh) {
    apply2(GeluBackward<true>{}, x, gy, gx, n);
  } else {
    apply2(GeluBackward<false>{}, x, gy, gx, n);
  }
}

}  // namespace dp::backend::cpu
