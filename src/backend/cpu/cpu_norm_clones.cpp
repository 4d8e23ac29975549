// CPU backend: the sums behind batch norm's statistics (Note [Batch norm's sums in
// lanes] in cpu_nn.cpp), sum_lanes_rows over a channel's planes, with ISA clones.
//
// Built with the optimizer loops (src/backend/cpu/meson.build): with ISA clones where
// the build allows them, chosen by the loader for the CPU at hand. The file is built
// with -ffp-contract=off, so no clone forms an FMA and every clone adds the same values
// in the same order: the bits do not depend on the CPU.
#include <array>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_lanes.h"
#include "dp/core/error.h"
#include "dp/core/half.h"

namespace dp::backend::cpu {

namespace {

using i64 = std::int64_t;

template <typename T>
[[gnu::always_inline]] inline float wide(T v) {
  return static_cast<float>(v);
}

template <typename T>
[[gnu::always_inline]] inline void stats(const T* x, i64 N, i64 HW, i64 stride, double* sum, double* sq) {
  double s[1], q[1];
  sum_lanes_rows<1>(N, HW, [&](i64 n, i64 i) { return std::array<double, 1>{wide(x[n * stride + i])}; }, s);
  const double mean = s[0] / static_cast<double>(N * HW);
  sum_lanes_rows<1>(N, HW, [&](i64 n, i64 i) {
    const double d = static_cast<double>(wide(x[n * stride + i])) - mean;
    return std::array<double, 1>{d * d};
  }, q);
  *sum = s[0];
  *sq = q[0];
}

template <typename T>
[[gnu::always_inline]] inline void grad_sums(const T* gy, const T* x, i64 N, i64 HW, i64 stride, float mean,
                                             double* sum_gy, double* sum_gy_xc) {
  double s[2];
  sum_lanes_rows<2>(N, HW, [&](i64 n, i64 i) {
    const float g = wide(gy[n * stride + i]);
    return std::array<double, 2>{g, g * (wide(x[n * stride + i]) - mean)};
  }, s);
  *sum_gy = s[0];
  *sum_gy_xc = s[1];
}

}  // namespace

DP_CPU_V4_V3_CLONES void batch_norm_stats(DType dt, const void* x, std::int64_t N, std::int64_t HW,
                                          std::int64_t stride, double* sum, double* sq) {
  switch (dt) {
    case DType::F32: stats(static_cast<const float*>(x), N, HW, stride, sum, sq); return;
    case DType::BF16: stats(static_cast<const BFloat16*>(x), N, HW, stride, sum, sq); return;
    case DType::F16: stats(static_cast<const Float16*>(x), N, HW, stride, sum, sq); return;
    default: DP_ASSERT(false, "batch_norm_stats: no kernel for dtype ", static_cast<int>(dt));
  }
}

DP_CPU_V4_V3_CLONES void batch_norm_grad_sums(DType dt, const void* gy, const void* x, std::int64_t N,
                                              std::int64_t HW, std::int64_t stride, float mean, double* sum_gy,
                                              double* sum_gy_xc) {
  switch (dt) {
    case DType::F32:
      grad_sums(static_cast<const float*>(gy), static_cast<const float*>(x), N, HW, stride, mean, sum_gy, sum_gy_xc);
      return;
    case DType::BF16:
      grad_sums(static_cast<const BFloat16*>(gy), static_cast<const BFloat16*>(x), N, HW, stride, mean, sum_gy,
                sum_gy_xc);
      return;
    case DType::F16:
      grad_sums(static_cast<const Float16*>(gy), static_cast<const Float16*>(x), N, HW, stride, mean, sum_gy,
                sum_gy_xc);
      return;
    default: DP_ASSERT(false, "batch_norm_grad_sums: no kernel for dtype ", static_cast<int>(dt));
  }
}

}  // namespace dp::backend::cpu
