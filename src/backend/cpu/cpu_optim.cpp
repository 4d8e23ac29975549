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
//
// The library is built for the x86-64 baseline, so those lanes were SSE's four. With the
// MLP's parameters resident in the last-level cache, the update then ran well below a
// loop with its access pattern and no arithmetic (bench/mlp_ceiling; figures:
// docs/benchmarks/kernel-notes.md, "Vectorised optimizer loops"): the
// multiplies, not the memory, set the pace. The SGD loop is
// therefore also compiled for AVX2 (target_clones: the loader picks the clone the CPU
// runs). Eight lanes do the same IEEE multiplies and adds as four, and AVX2 brings no
// FMA (that is the separate "fma" target, and this file is built with
// -ffp-contract=off besides), so every clone computes the same bits. Sanitizer builds
// have no clones (src/backend/cpu/meson.build says why).
#if defined(DP_CPU_TARGET_CLONES)
#define DP_SGD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DP_SGD_CLONES
#endif
template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov>
DP_SGD_CLONES void sgd_range(const SgdParams& in, float* __restrict p, const float* __restrict g,
               float* __restrict buf, std::int64_t b, std::int64_t e) {
  const SgdUpdate upd{SgdParams{in.lr, kMomentum ? in.momentum : 0.0f, in.one_minus_dampening,
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

// Adam (Note [Vectorised optimizer loops]): one loop per mode, decoupled (AdamW: p is
// always scaled, as AdamUpdate does), coupled with weight decay, or coupled without.
// The square root is what kept this loop scalar: under -fmath-errno GCC must call
// sqrtf for a negative argument to set errno, so it emits a test and a call per
// element. errno means nothing to an optimizer step (v >= 0 unless it is NaN), and
// this file alone is built with -fno-math-errno (src/backend/cpu/meson.build); sqrtps
// and divps round exactly as sqrtf and '/' do, so the bits are the functor's.
template <bool kDecoupled, bool kDecay>
void adam_range(const AdamParams& in, float* __restrict p, const float* __restrict g,
                float* __restrict m, float* __restrict v, std::int64_t b, std::int64_t e) {
  AdamParams s = in;
  s.decoupled = kDecoupled;
  s.weight_decay = kDecay ? in.weight_decay : 0.0f;
  const AdamUpdate upd{s};
  for (std::int64_t i = b; i < e; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    upd(pi, g[i], mi, vi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

using AdamRange = void (*)(const AdamParams&, float*, const float*, float*, float*, std::int64_t,
                           std::int64_t);

}  // namespace

void CpuBackend::sgd_step(Device dev, float* param, const float* grad, float* momentum_buf,
                          std::int64_t n, double lr, double momentum, double dampening,
                          double weight_decay, bool nesterov, bool first_step) {
  DP_CHECK(momentum == 0.0 || momentum_buf != nullptr,
           "sgd_step: expected a momentum buffer when momentum != 0 (momentum = ", momentum, ")");
  const SgdParams sp = make_sgd_params(lr, momentum, dampening, weight_decay, nesterov, first_step);
  // Note [Vectorised optimizer loops]. Momentum 0 never reads or writes the buffer.
  const bool decay = weight_decay != 0.0, mom = momentum != 0.0;
  const SgdRange range = decay ? pick_sgd<true>(mom, first_step, nesterov)
                               : pick_sgd<false>(mom, first_step, nesterov);
  parallel_for(dev, n, kSerialGrain, [=](std::int64_t b, std::int64_t e) {
    range(sp, param, grad, momentum_buf, b, e);
  });
}

void CpuBackend::adam_step(Device dev, float* param, const float* grad, float* exp_avg,
                           float* exp_avg_sq, std::int64_t n, double lr, double beta1, double beta2,
                           double eps, double weight_decay, bool decoupled, std::int64_t step) {
  DP_CHECK(step >= 1, "adam_step: expected a 1-based step count, got ", step);
  const AdamParams ap = make_adam_params(lr, beta1, beta2, eps, weight_decay, decoupled, step);
  const AdamRange range = decoupled              ? &adam_range<true, true>
                          : weight_decay != 0.0  ? &adam_range<false, true>
                                                 : &adam_range<false, false>;
  // ~4x the memory traffic of an axpy per element: a quarter of the serial grain.
  parallel_for(dev, n, kSerialGrain / 4, [=](std::int64_t b, std::int64_t e) {
    range(ap, param, grad, exp_avg, exp_avg_sq, b, e);
  });
}

}  // namespace dp::backend::cpu
