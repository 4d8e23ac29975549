// CPU backend: fused optimizer updates over flat parameter buffers.
//
// The per-element formulas live in backend/functors.h (SgdUpdate, AdamUpdate) so the
// CUDA backend applies exactly the same arithmetic.
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {

void CpuBackend::sgd_step(Device dev, float* param, const float* grad, float* momentum_buf,
                          std::int64_t n, float lr, float momentum, float dampening,
                          float weight_decay, bool nesterov, bool first_step) {
  DP_CHECK(momentum == 0.0f || momentum_buf != nullptr,
           "sgd_step: expected a momentum buffer when momentum != 0 (momentum = ", momentum, ")");
  const SgdUpdate upd{SgdParams{lr, momentum, dampening, weight_decay, nesterov, first_step}};
  parallel_for(dev, n, kSerialGrain, [=](std::int64_t b, std::int64_t e) {
    if (momentum_buf) {
      for (std::int64_t i = b; i < e; ++i) upd(param[i], grad[i], momentum_buf + i);
    } else {
      for (std::int64_t i = b; i < e; ++i) upd(param[i], grad[i], nullptr);
    }
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
