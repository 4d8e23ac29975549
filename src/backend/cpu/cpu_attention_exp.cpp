// CPU backend: the exponentials of fused attention's blocks (Note [Attention
// exponentials]), built with the optimizer loops (src/backend/cpu/meson.build): ISA
// clones where the build allows them, no FMA contraction.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"

namespace dp::backend::cpu {

// Note [Attention exponentials]
// A fused attention's block (Note [Fused attention] in cpu_attention.cpp) takes one
// exponential per score, as many as its GEMMs take multiply-adds per head-dim element:
// libm's expf, one call per value, would cost about as much as the GEMMs. This loop is
// Cephes' expf (the range reduction x = n·ln2 + r in two parts, a degree-6 polynomial
// for e^r, 2^n from the exponent bits), branch-free so that the compiler vectorises it
// for each clone; it is within 2 ulp of expf over the range where e^x is a normal float
// (cpu_backend_test compares). Below -87.33 (where e^x leaves the normal floats) it gives
// 0, so a masked score (-inf) weighs exactly nothing; a NaN stays NaN; above 88.37 it
// saturates at e^88.37 (attention only takes e^x of x <= 0: a score less its row's
// maximum).

DP_CPU_V4_V3_CLONES
void exp_shifted(float* x, std::int64_t n, float shift) {
  // kHi: the largest x whose 2^n stays finite (n = 127).
  constexpr float kLo = -87.33654f, kHi = 88.3762626647949f;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  for (std::int64_t i = 0; i < n; ++i) {
    const float t = x[i] - shift;
    const float c = std::min(std::max(t, kLo), kHi);  // NaN stays NaN
    const float fn = std::floor(c * kLog2e + 0.5f);
    const float r = (c - fn * kLn2Hi) - fn * kLn2Lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e_r = p * (r * r) + r + 1.0f;
    const float two_n = std::bit_cast<float>((static_cast<std::int32_t>(fn) + 127) << 23);
    x[i] = t < kLo ? 0.0f : e_r * two_n;
  }
}

}  // namespace dp::backend::cpu
