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
// maximum). n = floor(x·log2e + 1/2) is rounded by adding and subtracting 1.5·2^23
// (round to nearest, exact for |v| < 2^22, as every v here is) and stepping down where
// that went up: std::floor's bits, but GCC 12 vectorises std::floor only under
// -fno-trapping-math and kept the whole loop scalar (one exponential in 1.2 ns, where a
// vector of 16 takes a few). A caller whose rows end short of a multiple of 16 may
// pass the longer row when the values past its end are thrown away (the causal rows of
// cpu_attention.cpp): no scalar tail.

DP_CPU_V4_V3_CLONES
void exp_shifted(float* x, std::int64_t n, float shift) {
  // kHi: the largest x whose 2^n stays finite (n = 127).
  constexpr float kLo = -87.33654f, kHi = 88.3762626647949f;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: v + kRound - kRound rounds v to an integer
  for (std::int64_t i = 0; i < n; ++i) {
    const float t = x[i] - shift;
    const float c = std::min(std::max(t, kLo), kHi);  // NaN stays NaN
    const float v = c * kLog2e + 0.5f;
    const float near = (v + kRound) - kRound;
    const float fn = near > v ? near - 1.0f : near;  // floor(v)
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
