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

// Channels-last rows (Note [Channels-last batch norm] in cpu_nn.cpp): each channel its
// own accumulator, a row at a time, so the loop over a row's channels vectorises and
// every clone adds the same values in the same order.
template <typename T>
[[gnu::always_inline]] inline void rows_sums(int what, const T* __restrict x, const T* __restrict gy, i64 r0, i64 r1,
                                             i64 C, const double* __restrict mean_d, const float* __restrict mean_f,
                                             double* __restrict acc) {
  double* __restrict acc2 = acc + C;
  for (i64 r = r0; r < r1; ++r) {
    const T* __restrict xr = x + r * C;
    if (what == 0) {
      for (i64 c = 0; c < C; ++c) acc[c] += static_cast<double>(wide(xr[c]));
    } else if (what == 1) {
      for (i64 c = 0; c < C; ++c) {
        const double d = static_cast<double>(wide(xr[c])) - mean_d[c];
        acc[c] += d * d;
      }
    } else {
      const T* __restrict gr = gy + r * C;
      for (i64 c = 0; c < C; ++c) {
        const float g = wide(gr[c]);
        acc[c] += static_cast<double>(g);
        acc2[c] += static_cast<double>(g) * static_cast<double>(wide(xr[c]) - mean_f[c]);
      }
    }
  }
}

template <typename T>
[[gnu::always_inline]] inline T narrow_to(float v) {
  return T(v);
}

template <typename T>
[[gnu::always_inline]] inline void rows_apply(int what, const T* __restrict x, const T* __restrict gy, i64 r0, i64 r1,
                                              i64 C, const float* __restrict a, const float* __restrict b,
                                              const float* __restrict m, const float* __restrict p, T* __restrict out) {
  for (i64 r = r0; r < r1; ++r) {
    const T* __restrict xr = x + r * C;
    T* __restrict o = out + r * C;
    if (what == 0) {
      for (i64 c = 0; c < C; ++c) o[c] = narrow_to<T>(wide(xr[c]) * a[c] + b[c]);
    } else {
      const T* __restrict gr = gy + r * C;
      for (i64 c = 0; c < C; ++c) o[c] = narrow_to<T>(a[c] * (wide(gr[c]) - b[c] - (wide(xr[c]) - m[c]) * p[c]));
    }
  }
}

}  // namespace

DP_CPU_V4_V3_CLONES void batch_norm_rows_sums(DType dt, int what, const void* x, const void* gy, std::int64_t r0,
                                              std::int64_t r1, std::int64_t C, const double* mean_d,
                                              const float* mean_f, double* acc) {
  switch (dt) {
    case DType::F32:
      rows_sums(what, static_cast<const float*>(x), static_cast<const float*>(gy), r0, r1, C, mean_d, mean_f, acc);
      return;
    case DType::BF16:
      rows_sums(what, static_cast<const BFloat16*>(x), static_cast<const BFloat16*>(gy), r0, r1, C, mean_d, mean_f,
                acc);
      return;
    case DType::F16:
      rows_sums(what, static_cast<const Float16*>(x), static_cast<const Float16*>(gy), r0, r1, C, mean_d, mean_f, acc);
      return;
    default: DP_ASSERT(false, "batch_norm_rows_sums: no kernel for dtype ", static_cast<int>(dt));
  }
}

DP_CPU_V4_V3_CLONES void batch_norm_rows_apply(DType dt, int what, const void* x, const void* gy, std::int64_t r0,
                                               std::int64_t r1, std::int64_t C, const float* a, const float* b,
                                               const float* m, const float* p, void* out) {
  switch (dt) {
    case DType::F32:
      rows_apply(what, static_cast<const float*>(x), static_cast<const float*>(gy), r0, r1, C, a, b, m, p,
                 static_cast<float*>(out));
      return;
    case DType::BF16:
      rows_apply(what, static_cast<const BFloat16*>(x), static_cast<const BFloat16*>(gy), r0, r1, C, a, b, m, p,
                 static_cast<BFloat16*>(out));
      return;
    case DType::F16:
      rows_apply(what, static_cast<const Float16*>(x), static_cast<const Float16*>(gy), r0, r1, C, a, b, m, p,
                 static_cast<Float16*>(out));
      return;
    default: DP_ASSERT(false, "batch_norm_rows_apply: no kernel for dtype ", static_cast<int>(dt));
  }
}

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
