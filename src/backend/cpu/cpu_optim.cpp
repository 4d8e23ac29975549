// CPU backend: fused optimizer updates over flat parameter buffers.
//
// The per-element formulas live in backend/functors.h (SgdUpdate, AdamUpdate) so the
// CUDA backend applies exactly the same arithmetic.
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {

namespace {

// Note [Vectorised optimizer loops]
// The functors test their flags (weight decay, momentum, first step, nesterov) per
// element; with those tests in the loop and three pointers that may alias, GCC
// vectorised neither update (-fopt-info-vec: "control flow in loop"), and the SGD step
// ran at half of memcpy's bandwidth. Each loop below is instantiated per combination
// of flags, with the flags passed to the functor as constants (a disabled term's
// scalar as a literal zero, so its test folds away) and __restrict pointers: the same
// functor, the same arithmetic in the same order, now in SIMD lanes.
template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
void sgd_range(const SgdParams& in, float* __restrict p, const float* __restrict g,
               float* __restrict buf, std::int64_t b, std::int64_t e) {
  const SgdUpdate upd{SgdParams{in.lr, kMomentum ? in.momentum : 0.0f, in.dampening,
                                kDecay ? in.weight_decay : 0.0f, kNesterov, kFirst}};
  for (std::int64_t i = b; i < e; ++i) {
    float pi = p[i];
    float bi = kMomentum && !kFirst ? buf[i] : 0.0f;
    upd(pi, g[i], &bi);
    p[i] = pi;
    if constexpr (kMomentum) buf[i] = bi;
  }
}

using SgdRange = void (*)(const SgdParams&, float*, const float*, float*, std::int64_t, std::int64_t);

template <bool kDecay, bool kMomentum, bool kFirst>
SgdRange pick_sgd(bool nesterov) {
  return nesterov ? &sgd_range<kDecay, kMomentum, kFirst, true> : &sgd_range<kDecay, kMomentum, kFirst, false>;
}

template <bool kDecay, bool kMomentum>
SgdRange pick_sgd(bool first, bool nesterov) {
  return first ? pick_sgd<kDecay, kMomentum, true>(nesterov) : pick_sgd<kDecay, kMomentum, false>(nesterov);
}

template <bool kDecay>
SgdRange pick_sgd(bool momentum, bool first, bool nesterov) {
  return momentum ? pick_sgd<kDecay, true>(first, nesterov) : pick_sgd<kDecay, false>(false, false);
}

}  // namespace

void CpuBackend::sgd_step(Device dev, float* param, const float* grad, float* momentum_buf,
                          std::int64_t n, float lr, float momentum, float dampening,
                          float weight_decay, bool nesterov, bool first_step) {
  DP_CHECK(momentum == 0.0f || momentum_buf != nullptr,
           "sgd_step: expected a momentum buffer when momentum != 0 (momentum = ", momentum, ")");
  const SgdParams sp{lr, momentum, dampening, weight_decay, nesterov, first_step};
  // Note [Vectorised optimizer loops]. Momentum 0 never reads or writes the buffer.
  const bool decay = weight_decay != 0.0f, mom = momentum != 0.0f;
  const SgdRange range = decay ? pick_sgd<true>(mom, first_step, nesterov)
                               : pick_sgd<false>(mom, first_step, nesterov);
  parallel_for(dev, n, kSerialGrain, [=](std::int64_t b, std::int64_t e) {
    range(sp, param, grad, momentum_buf, b, e);
  });
}

void CpuBackend::adam_step(Device dev, float* param, const float* grad, float* exp_avg,
                           float* exp_avg_sq, std::int64_t n, float lr, float beta1, float beta2,
                           float eps, float weight_decay, bool decoupled, std::int64_t step) {
  DP_CHECK(step >= 1, "adam_step: expected a 1-based step count, got ", step);
  const AdamUpdate upd{make_adam_params(lr, beta1, beta2, eps, weight_decay, decoupled, step)};
  // ~4x the memory traffic of an axpy per element: a quarter of the serial grain.
  parallel_for(dev, n, kSerialGrain / 4, [=](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) upd(param[i], grad[i], exp_avg[i], exp_avg_sq[i]);
  });
}

}  // namespace dp::backend::cpu
