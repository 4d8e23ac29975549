// CPU backend: pooling, batch norm, log-softmax and NLL loss.
//
// Hand-written loops parallel over independent planes (N*C for pooling, C for batch
// norm, rows for softmax): every output is computed by one task in a fixed order, so
// results are bitwise reproducible (Note [Deterministic reductions] in cpu_reduce.cpp).
// Batch-norm statistics are accumulated in double: a channel of a large batch holds
// 10^5..10^6 values, where a float running sum loses several digits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

void check_pool_shape(const Pool2dShape& s, const char* op) {
  DP_CHECK(s.N >= 0 && s.C >= 0 && s.H > 0 && s.W > 0 && s.kernel_h > 0 && s.kernel_w > 0 &&
               s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 &&
               2 * s.pad_h <= s.kernel_h && 2 * s.pad_w <= s.kernel_w && s.P >= 0 && s.Q >= 0,
           op, ": expected positive sizes, kernel and stride, and padding at most half the "
           "kernel, got H=", s.H, " W=", s.W, " kernel=(", s.kernel_h, ",", s.kernel_w,
           ") stride=(", s.stride_h, ",", s.stride_w, ") pad=(", s.pad_h, ",", s.pad_w, ")");
  // P, Q come from the caller (floor or ceil mode); every window must start inside the
  // padded input.
  DP_CHECK((s.P - 1) * s.stride_h - s.pad_h < s.H + s.pad_h &&
               (s.Q - 1) * s.stride_w - s.pad_w < s.W + s.pad_w,
           op, ": output size (", s.P, ", ", s.Q, ") has windows outside the padded input ",
           s.H, "x", s.W);
}

/// Planes per task so a task holds at least ~kSerialGrain elements of work.
i64 plane_grain(i64 plane_work) { return std::max<i64>(1, kSerialGrain / std::max<i64>(1, plane_work)); }

}  // namespace

// ---- pooling ---------------------------------------------------------------------------

void CpuBackend::maxpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y,
                                   i64* indices) {
  check_pool_shape(s, "maxpool2d_forward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  // The 2×2, stride-2, unpadded window (every CNN's downsampling) is specialised: no
  // clipping, four fixed loads. It measured about 4× fewer instructions per element
  // than the general loop (callgrind, the Fashion-MNIST CNN's pools). Same rule: the
  // first maximum in row-major order wins; a NaN wins and stays.
  const bool two_by_two = s.kernel_h == 2 && s.kernel_w == 2 && s.stride_h == 2 && s.stride_w == 2 &&
                          s.pad_h == 0 && s.pad_w == 0;
  parallel_for(dev, planes, plane_grain(pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      const float* xp = x + pl * hw;
      float* yp = y + pl * pq;
      i64* ip = indices ? indices + pl * pq : nullptr;
      if (two_by_two) {
        for (i64 p = 0; p < s.P; ++p) {
          const float* r0 = xp + 2 * p * s.W;
          const float* r1 = r0 + s.W;
          for (i64 q = 0; q < s.Q; ++q) {
            const float v[4] = {r0[2 * q], r0[2 * q + 1], r1[2 * q], r1[2 * q + 1]};
            float best = v[0];
            int k = 0;
            for (int j = 1; j < 4; ++j) {
              if (v[j] > best || (v[j] != v[j] && best == best)) {
                best = v[j];
                k = j;
              }
            }
            yp[p * s.Q + q] = best;
            if (ip) ip[p * s.Q + q] = (2 * p + (k >> 1)) * s.W + 2 * q + (k & 1);
          }
        }
        continue;
      }
      for (i64 p = 0; p < s.P; ++p) {
        const i64 h0 = p * s.stride_h - s.pad_h;
        const i64 hs = std::max<i64>(h0, 0), he = std::min(h0 + s.kernel_h, s.H);
        for (i64 q = 0; q < s.Q; ++q) {
          const i64 w0 = q * s.stride_w - s.pad_w;
          const i64 ws = std::max<i64>(w0, 0), we = std::min(w0 + s.kernel_w, s.W);
          // Padding never wins: only real elements are candidates. Strict > keeps the
          // first maximum in row-major window order; a NaN wins and stays.
          float best = -std::numeric_limits<float>::infinity();
          i64 best_i = hs * s.W + ws;
          for (i64 h = hs; h < he; ++h)
            for (i64 w = ws; w < we; ++w) {
              const float v = xp[h * s.W + w];
              if (v > best || (v != v && best == best)) {
                best = v;
                best_i = h * s.W + w;
              }
            }
          yp[p * s.Q + q] = best;
          if (ip) ip[p * s.Q + q] = best_i;
        }
      }
    }
  });
}

void CpuBackend::maxpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                                    const i64* indices, float* gx) {
  check_pool_shape(s, "maxpool2d_backward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  parallel_for(dev, planes, plane_grain(hw + pq), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      float* gp = gx + pl * hw;
      std::memset(gp, 0, static_cast<std::size_t>(hw) * sizeof(float));
      const float* gyp = gy + pl * pq;
      const i64* ip = indices + pl * pq;
      for (i64 j = 0; j < pq; ++j) {
        DP_ASSERT(ip[j] >= 0 && ip[j] < hw, "maxpool index ", ip[j], " outside plane of ", hw);
        gp[ip[j]] += gyp[j];  // in output order within the plane: deterministic
      }
    }
  });
}

// Window [h0, h0 + kernel) clipped to the padded input [-pad, H + pad): PyTorch's divisor
// with count_include_pad=true (equal to kernel_h * kernel_w unless ceil mode clips it).
static inline i64 avg_divisor(const Pool2dShape& s, i64 h0, i64 w0) {
  const i64 he = std::min(h0 + s.kernel_h, s.H + s.pad_h), we = std::min(w0 + s.kernel_w, s.W + s.pad_w);
  return (he - h0) * (we - w0);
}

void CpuBackend::avgpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y) {
  check_pool_shape(s, "avgpool2d_forward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  parallel_for(dev, planes, plane_grain(pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      const float* xp = x + pl * hw;
      float* yp = y + pl * pq;
      for (i64 p = 0; p < s.P; ++p) {
        const i64 h0 = p * s.stride_h - s.pad_h;
        const i64 hs = std::max<i64>(h0, 0), he = std::min(h0 + s.kernel_h, s.H);
        for (i64 q = 0; q < s.Q; ++q) {
          const i64 w0 = q * s.stride_w - s.pad_w;
          const i64 ws = std::max<i64>(w0, 0), we = std::min(w0 + s.kernel_w, s.W);
          float sum = 0.0f;
          for (i64 h = hs; h < he; ++h)
            for (i64 w = ws; w < we; ++w) sum += xp[h * s.W + w];
          yp[p * s.Q + q] = sum / static_cast<float>(avg_divisor(s, h0, w0));
        }
      }
    }
  });
}

void CpuBackend::avgpool2d_backward(Device dev, const Pool2dShape& s, const float* gy, float* gx) {
  check_pool_shape(s, "avgpool2d_backward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  parallel_for(dev, planes, plane_grain(hw + pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      float* gp = gx + pl * hw;
      std::memset(gp, 0, static_cast<std::size_t>(hw) * sizeof(float));
      const float* gyp = gy + pl * pq;
      for (i64 p = 0; p < s.P; ++p) {
        const i64 h0 = p * s.stride_h - s.pad_h;
        const i64 hs = std::max<i64>(h0, 0), he = std::min(h0 + s.kernel_h, s.H);
        for (i64 q = 0; q < s.Q; ++q) {
          const i64 w0 = q * s.stride_w - s.pad_w;
          const i64 ws = std::max<i64>(w0, 0), we = std::min(w0 + s.kernel_w, s.W);
          const float g = gyp[p * s.Q + q] / static_cast<float>(avg_divisor(s, h0, w0));
          for (i64 h = hs; h < he; ++h)
            for (i64 w = ws; w < we; ++w) gp[h * s.W + w] += g;
        }
      }
    }
  });
}

// ---- batch norm over (N, C, HW) ------------------------------------------------------------

void CpuBackend::batchnorm_forward_train(Device dev, i64 N, i64 C, i64 HW, const float* x,
                                         const float* gamma, const float* beta, float eps,
                                         float momentum, float* running_mean, float* running_var,
                                         float* y, float* save_mean, float* save_invstd) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, "batchnorm_forward_train: expected non-negative sizes, got (",
           N, ", ", C, ", ", HW, ")");
  const i64 M = N * HW;  // values per channel
  DP_CHECK(M > 0 || C == 0, "batchnorm_forward_train: expected at least one value per channel, "
           "got N=", N, ", HW=", HW);
  parallel_for(dev, C, plane_grain(3 * M), [&](i64 b, i64 e) {
    for (i64 c = b; c < e; ++c) {
      double sum = 0.0;
      for (i64 n = 0; n < N; ++n) {
        const float* xp = x + (n * C + c) * HW;
        float part = 0.0f;  // one plane in float (<= a few thousand values), then double
        for (i64 i = 0; i < HW; ++i) part += xp[i];
        sum += part;
      }
      const double mean = sum / static_cast<double>(M);
      double sq = 0.0;  // two-pass variance: no cancellation for large means
      for (i64 n = 0; n < N; ++n) {
        const float* xp = x + (n * C + c) * HW;
        double part = 0.0;
        for (i64 i = 0; i < HW; ++i) {
          const double d = static_cast<double>(xp[i]) - mean;
          part += d * d;
        }
        sq += part;
      }
      const double var = sq / static_cast<double>(M);
      const double invstd = 1.0 / std::sqrt(var + static_cast<double>(eps));
      if (save_mean) save_mean[c] = static_cast<float>(mean);
      if (save_invstd) save_invstd[c] = static_cast<float>(invstd);
      if (running_mean) {
        // PyTorch: running stats use the unbiased variance (M - 1 denominator).
        const double unbiased = M > 1 ? sq / static_cast<double>(M - 1) : var;
        running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * mean);
        if (running_var)
          running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
      }
      const float g = gamma ? gamma[c] : 1.0f, bt = beta ? beta[c] : 0.0f;
      const float scale = g * static_cast<float>(invstd);
      const float shift = bt - static_cast<float>(mean) * scale;
      for (i64 n = 0; n < N; ++n) {
        const float* __restrict xp = x + (n * C + c) * HW;
        float* __restrict yp = y + (n * C + c) * HW;
        for (i64 i = 0; i < HW; ++i) yp[i] = xp[i] * scale + shift;
      }
    }
  });
}

void CpuBackend::batchnorm_forward_eval(Device dev, i64 N, i64 C, i64 HW, const float* x,
                                        const float* gamma, const float* beta, float eps,
                                        const float* running_mean, const float* running_var,
                                        float* y) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, "batchnorm_forward_eval: expected non-negative sizes, got (",
           N, ", ", C, ", ", HW, ")");
  DP_CHECK((running_mean && running_var) || N * HW == 0,
           "batchnorm_forward_eval: expected running_mean and running_var, got null");
  // Parallel over N*C planes: eval has no reduction, and C alone may be small.
  parallel_for(dev, N * C, plane_grain(HW), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      const i64 c = pl % C;
      const float invstd = 1.0f / std::sqrt(running_var[c] + eps);
      const float scale = (gamma ? gamma[c] : 1.0f) * invstd;
      const float shift = (beta ? beta[c] : 0.0f) - running_mean[c] * scale;
      const float* __restrict xp = x + pl * HW;
      float* __restrict yp = y + pl * HW;
      for (i64 i = 0; i < HW; ++i) yp[i] = xp[i] * scale + shift;
    }
  });
}

void CpuBackend::batchnorm_backward(Device dev, i64 N, i64 C, i64 HW, const float* gy,
                                    const float* x, const float* gamma, const float* save_mean,
                                    const float* save_invstd, float* gx, float* ggamma,
                                    float* gbeta) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, "batchnorm_backward: expected non-negative sizes, got (",
           N, ", ", C, ", ", HW, ")");
  const i64 M = N * HW;
  parallel_for(dev, C, plane_grain(3 * M), [&](i64 b, i64 e) {
    for (i64 c = b; c < e; ++c) {
      const float mean = save_mean[c], invstd = save_invstd[c];
      double sum_gy = 0.0, sum_gy_xc = 0.0;  // Σ gy and Σ gy * (x - mean)
      for (i64 n = 0; n < N; ++n) {
        const float* gp = gy + (n * C + c) * HW;
        const float* xp = x + (n * C + c) * HW;
        float s1 = 0.0f, s2 = 0.0f;
        for (i64 i = 0; i < HW; ++i) {
          s1 += gp[i];
          s2 += gp[i] * (xp[i] - mean);
        }
        sum_gy += s1;
        sum_gy_xc += s2;
      }
      if (gbeta) gbeta[c] = static_cast<float>(sum_gy);
      if (ggamma) ggamma[c] = static_cast<float>(sum_gy_xc * invstd);
      if (!gx || M == 0) continue;
      // gx = gamma * invstd * (gy - mean(gy) - xhat * mean(gy * xhat)).
      const float g = gamma ? gamma[c] : 1.0f;
      const float k = g * invstd;
      const float mean_gy = static_cast<float>(sum_gy / static_cast<double>(M));
      const float proj = static_cast<float>(sum_gy_xc / static_cast<double>(M)) * invstd * invstd;
      for (i64 n = 0; n < N; ++n) {
        const float* __restrict gp = gy + (n * C + c) * HW;
        const float* __restrict xp = x + (n * C + c) * HW;
        float* __restrict gxp = gx + (n * C + c) * HW;
        for (i64 i = 0; i < HW; ++i) gxp[i] = k * (gp[i] - mean_gy - (xp[i] - mean) * proj);
      }
    }
  });
}

// ---- log-softmax and NLL (rows × cols) ---------------------------------------------------

void CpuBackend::log_softmax(Device dev, const float* x, float* y, i64 rows, i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, "log_softmax: expected non-negative sizes, got ", rows, "x", cols);
  if (cols == 0) return;
  parallel_for(dev, rows, plane_grain(3 * cols), [&](i64 b, i64 e) {
    for (i64 r = b; r < e; ++r) {
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      float mx = -std::numeric_limits<float>::infinity();
      for (i64 j = 0; j < cols; ++j) mx = std::max(mx, xr[j]);
      // An all -inf row would give -inf - -inf = NaN; shifting by 0 keeps -inf outputs.
      if (std::isinf(mx) && mx < 0) mx = 0.0f;
      double sum = 0.0;
      for (i64 j = 0; j < cols; ++j) sum += std::exp(static_cast<double>(xr[j] - mx));
      const float lse = mx + static_cast<float>(std::log(sum));
      for (i64 j = 0; j < cols; ++j) yr[j] = xr[j] - lse;
    }
  });
}

void CpuBackend::log_softmax_backward(Device dev, const float* gy, const float* y, float* gx,
                                      i64 rows, i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, "log_softmax_backward: expected non-negative sizes, got ", rows,
           "x", cols);
  if (cols == 0) return;
  parallel_for(dev, rows, plane_grain(3 * cols), [&](i64 b, i64 e) {
    for (i64 r = b; r < e; ++r) {
      const float* gr = gy + r * cols;
      const float* yr = y + r * cols;
      float* gxr = gx + r * cols;
      double sum = 0.0;
      for (i64 j = 0; j < cols; ++j) sum += gr[j];
      const float s = static_cast<float>(sum);
      for (i64 j = 0; j < cols; ++j) gxr[j] = gr[j] - std::exp(yr[j]) * s;
    }
  });
}

namespace {
void check_targets(const i64* target, i64 rows, i64 cols, const char* op) {
  for (i64 r = 0; r < rows; ++r)
    DP_CHECK(target[r] >= 0 && target[r] < cols, op, ": expected class indices in [0, ", cols,
             "), got target[", r, "] = ", target[r], "; check the labels and the model's output size");
}
}  // namespace

void CpuBackend::nll_forward(Device dev, const float* logp, const i64* target, float* loss, i64 rows,
                             i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, "nll_forward: expected non-negative sizes, got ", rows, "x", cols);
  (void)state(dev);
  // Validate all targets before writing anything (a CUDA kernel would fault mid-way).
  check_targets(target, rows, cols, "nll_forward");
  for (i64 r = 0; r < rows; ++r) loss[r] = -logp[r * cols + target[r]];
}

void CpuBackend::nll_backward(Device dev, const float* gloss, const i64* target, float* gx, i64 rows,
                              i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, "nll_backward: expected non-negative sizes, got ", rows, "x", cols);
  check_targets(target, rows, cols, "nll_backward");
  fill(dev, gx, rows * cols, 0.0f);
  for (i64 r = 0; r < rows; ++r) gx[r * cols + target[r]] = -gloss[r];
}

}  // namespace dp::backend::cpu
