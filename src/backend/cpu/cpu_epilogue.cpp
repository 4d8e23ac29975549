// CPU backend: the loops a Linear's GEMM chunk runs over its own slab of C (Note
// [Linear epilogue], Note [ReLU mask in the input gradient]).
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"

namespace dp::backend::cpu {

// Note [Epilogue clones]
// The epilogues read and write a slab the GEMM has just left in its core's L2: an add
// and a clip per element (the forward), or a select by the ReLU's output (the input
// gradient). Built for the x86-64 baseline they ran in SSE's four lanes, as long as the
// copies that feed the GEMM. The x86-64-v3 and -v4 clones run the same loops in 8 and
// 16 lanes (figures: docs/benchmarks/kernel-notes.md, "Epilogue clones"). Each element goes through the functors
// of the separate ops (Binary<Add>, Unary<Relu>, Binary<ReluBackward>): one IEEE add,
// a compare and a select, which every width computes alike (no FMA can form: one
// operation per element, and this file is built with -ffp-contract=off), so every
// clone writes the bits of the others (cpu_backend_test compares the epilogues with
// the separate ops element by element, NaN and infinities included).

namespace {

/// Rows of C += bias (per column), then relu: the element ops of Binary<Add> and
/// Unary<Relu>, branch-free per variant. Always inlined: only code inlined into a clone
/// is compiled for the clone's ISA.
template <bool kBias, bool kRelu>
[[gnu::always_inline]] inline void bias_relu_rows(float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols,
                                                  const float* __restrict bias) {
  const Binary<BinaryOp::Add> add;
  const Unary<UnaryOp::Relu> relu;
  for (std::int64_t i = 0; i < rows; ++i) {
    float* __restrict row = c + i * ldc;
    for (std::int64_t j = 0; j < cols; ++j) {
      float v = row[j];
      if constexpr (kBias) v = add(v, bias[j]);
      if constexpr (kRelu) v = relu(v);
      row[j] = v;
    }
  }
}

/// Rows of C masked by the ReLU output y (laid out as C): Binary<ReluBackward>.
[[gnu::always_inline]] inline void mask_rows(float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols,
                                             const float* y) {
  const Binary<BinaryOp::ReluBackward> mask;
  for (std::int64_t i = 0; i < rows; ++i) {
    float* __restrict row = c + i * ldc;
    const float* __restrict yrow = y + i * ldc;
    for (std::int64_t j = 0; j < cols; ++j) row[j] = mask(row[j], yrow[j]);
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES void linear_epilogue(float* c, std::int64_t ldc, std::int64_t rows, std::int64_t cols,
                                        const float* bias, bool relu, const float* relu_y) {
  if (relu_y) mask_rows(c, ldc, rows, cols, relu_y);
  if (bias) {
    if (relu) {
      bias_relu_rows<true, true>(c, ldc, rows, cols, bias);
    } else {
      bias_relu_rows<true, false>(c, ldc, rows, cols, bias);
    }
  } else if (relu) {
    bias_relu_rows<false, true>(c, ldc, rows, cols, nullptr);
  }
}

}  // namespace dp::backend::cpu
