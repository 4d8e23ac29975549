// CPU backend: scans over activations and weights that other kernels decide on.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "backend/cpu/cpu_backend.h"

namespace dp::backend::cpu {

// Note [Scan clones]
// max_abs_bits runs over every input chunk of a fused convolution (Note [Convolution
// + ReLU]) and over its weights. Built for the x86-64 baseline its unsigned 32-bit max
// has no instruction (SSE4.1 brought pmaxud): GCC emulates it with a compare and three
// logic operations per vector, and the scan took about as long as the ReLU pass it lets
// the convolution skip. The AVX2 and AVX-512 clones do it in one instruction per 8 or
// 16 values (figures: docs/benchmarks/kernel-notes.md, "Scan clones"). Integers only: every clone returns the same value.
#if defined(DP_CPU_TARGET_CLONES)
#define DP_SCAN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DP_SCAN_CLONES
#endif

DP_SCAN_CLONES std::uint32_t max_abs_bits(const float* p, std::int64_t n) {
  std::uint32_t m = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, p + i, sizeof u);
    m = std::max(m, u & 0x7fffffffu);
  }
  return m;
}

}  // namespace dp::backend::cpu
