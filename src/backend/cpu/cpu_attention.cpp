// CPU backend: fused (blockwise, "flash") scaled-dot-product attention, forward and
// backward, float32, in the device's arena.
//
// Note [Fused attention]
// softmax(q kᵀ · scale + mask) v for B·H independent (b, h) problems, without the
// (L, S) score matrix of the math path (scaled_dot_product_attention in
// src/nn/functional_sequence.cpp), after FlashAttention (Dao et al., 2022) as PyTorch's
// CPU flash kernel runs it:
//  - Forward, one task per (b, h, block of kBlockQ queries): the keys are walked in
//    blocks of kBlockK. Each block's scores (kBlockQ × kBlockK) are one GEMM, masked
//    (causal: key j > query i; an additive or 0/1 keep-mask) and folded into an online
//    softmax: per row the running maximum m and sum l of exp(s - m), the output
//    accumulator rescaled by exp(m_old - m_new) whenever the maximum grows, then
//    acc += exp(s - m) · v_block (a second GEMM). At the end out = acc / l and the row's
//    log-sum-exp lse = m + log(l) is kept: the only thing saved besides out. A causal
//    block wholly above the diagonal is never computed.
//  - Backward recomputes each block's probabilities from lse, P = exp(s - lse), with
//    Δ_i = Σ_e gout[i, e] · out[i, e] (= Σ_j P_ij dP_ij): dP = gout vᵀ, dS = P ∘ (dP − Δ),
//    dV = Pᵀ gout, dK = scale · dSᵀ q, dQ = scale · dS k. Two passes keep every sum in a
//    fixed order on one thread: one task per (b, h, key block) sums that block's dK and
//    dV over the query blocks, one task per (b, h, query block) sums its dQ over the key
//    blocks. Results therefore never depend on the thread count or the schedule (the DP,
//    DDP and sharded designs stay bitwise equal), at the price of computing the scores
//    and dP twice: 7 block GEMMs per block pair instead of 5.
// Memory: besides the inputs and outputs, the forward keeps lse (B·H·L floats) and the
// backward Δ (B·H·L floats, freed when it returns) — O(L) per (b, h), both from the
// device's allocator — and each running task holds O(kBlockQ · (kBlockK + E + Ev))
// floats of heap scratch (one set per thread at a time, not counted by
// memory_allocated), whatever L and S are; the math path holds the (B, H, L, S) weights. Every block product is a single-threaded
// dnnl_sgemm (float32 accumulation; Note [oneDNN in the device's arena] in
// cpu_backend.h), the exponentials a vectorised loop over a block's row (Note [Attention
// exponentials] in cpu_attention_exp.cpp), the masking plain loops.
// The order of the sums differs from the math path's (the softmax is reassociated over
// key blocks, the GEMMs are cut differently), so the two agree to float32 rounding, not
// bit for bit: tests/nn/attention_fused_test.cpp compares them.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include <oneapi/dnnl/dnnl.h>

#include "backend/cpu/cpu_backend.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

// 64 x 64 blocks: a block's scores (16 KiB), its dP and the q, k, v rows it reads stay
// in L2 while a task works on them, and T = 128 already gives two query blocks per (b, h).
constexpr i64 kBlockQ = 64;
constexpr i64 kBlockK = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

i64 blocks(i64 n, i64 block) { return (n + block - 1) / block; }

void sgemm(char ta, char tb, i64 m, i64 n, i64 k, float alpha, const float* a, i64 lda, const float* b, i64 ldb,
           float beta, float* c, i64 ldc) {
  const dnnl_status_t status = dnnl_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  DP_CHECK(status == dnnl_success, "attention: dnnl_sgemm failed with status ", static_cast<int>(status), " for m=",
           m, " n=", n, " k=", k);
}

/// One (b, h) problem of a call: its q (L, E), k (S, E), v (S, Ev) rows and its mask.
struct Problem {
  const AttentionShape& s;
  const float* q;
  const float* k;
  const float* v;
  const float* mask;  // at (b, h), or null
  i64 msl, mss;
  bool keep;
  bool causal;
  float scale;
};

Problem problem(const AttentionShape& s, const void* q, const void* k, const void* v, const AttentionMask& mask,
                bool causal, float scale, i64 bh) {
  const i64 b = bh / s.H, h = bh % s.H;
  return {s,
          static_cast<const float*>(q) + bh * s.L * s.E,
          static_cast<const float*>(k) + bh * s.S * s.E,
          static_cast<const float*>(v) + bh * s.S * s.Ev,
          mask.p ? mask.p + b * mask.sb + h * mask.sh : nullptr,
          mask.sl,
          mask.ss,
          mask.keep,
          causal,
          scale};
}

/// sc (m × n, rows n apart) = the masked scores of queries [i0, i0 + m) against keys
/// [j0, j0 + n): scale · q kᵀ, then + mask or where(keep, ·, -inf), then -inf for
/// key j > query i when causal — the math path's steps, in its order.
void block_scores(const Problem& p, i64 i0, i64 m, i64 j0, i64 n, float* sc) {
  const i64 E = p.s.E;
  sgemm('N', 'T', m, n, E, p.scale, p.q + i0 * E, E, p.k + j0 * E, E, 0.0f, sc, n);
  if (p.mask) {
    for (i64 r = 0; r < m; ++r) {
      const float* mr = p.mask + (i0 + r) * p.msl + j0 * p.mss;
      float* row = sc + r * n;
      if (p.keep) {
        for (i64 c = 0; c < n; ++c) row[c] = mr[c * p.mss] != 0.0f ? row[c] : kNegInf;
      } else {
        for (i64 c = 0; c < n; ++c) row[c] += mr[c * p.mss];
      }
    }
  }
  if (p.causal) {
    for (i64 r = 0; r < m; ++r) {
      float* row = sc + r * n;
      for (i64 c = std::max<i64>(0, i0 + r - j0 + 1); c < n; ++c) row[c] = kNegInf;
    }
  }
}

/// The keys a block of queries [i0, i0 + m) attends to: [0, end).
i64 key_end(const Problem& p, i64 i0, i64 m) { return p.causal ? std::min(p.s.S, i0 + m) : p.s.S; }

/// Forward of queries [i0, i0 + m) of one problem (Note [Fused attention]).
void forward_block(const Problem& p, i64 i0, i64 m, float* out, float* lse) {
  const i64 Ev = p.s.Ev;
  std::vector<float> sc(static_cast<std::size_t>(m * kBlockK));
  std::vector<float> acc(static_cast<std::size_t>(m * Ev), 0.0f);
  std::vector<float> mx(static_cast<std::size_t>(m), kNegInf), sum(static_cast<std::size_t>(m), 0.0f);
  const i64 end = key_end(p, i0, m);
  for (i64 j0 = 0; j0 < end; j0 += kBlockK) {
    const i64 n = std::min(kBlockK, end - j0);
    block_scores(p, i0, m, j0, n, sc.data());
    for (i64 r = 0; r < m; ++r) {
      float* row = sc.data() + r * n;
      float block_max = kNegInf;
      for (i64 c = 0; c < n; ++c) block_max = std::max(block_max, row[c]);
      const auto ri = static_cast<std::size_t>(r);
      const float m_new = std::max(mx[ri], block_max);
      if (m_new == kNegInf) {  // nothing attended yet: no weight, no rescale
        std::fill(row, row + n, 0.0f);
        continue;
      }
      exp_shifted(row, n, m_new);  // Note [Attention exponentials]
      float row_sum = 0.0f;
      for (i64 c = 0; c < n; ++c) row_sum += row[c];
      const float correction = std::exp(mx[ri] - m_new);  // 0 on the first block attended
      sum[ri] = sum[ri] * correction + row_sum;
      mx[ri] = m_new;
      if (correction != 1.0f) {
        float* a = acc.data() + r * Ev;
        for (i64 e = 0; e < Ev; ++e) a[e] *= correction;
      }
    }
    sgemm('N', 'N', m, Ev, n, 1.0f, sc.data(), n, p.v + j0 * Ev, Ev, 1.0f, acc.data(), Ev);
  }
  // A row with every key masked has sum 0: out = 0 / 0 = NaN and lse = -inf, whose
  // probabilities exp(-inf - -inf) are NaN in the backward too, as the math path's.
  for (i64 r = 0; r < m; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    const float l = sum[ri];
    const float* a = acc.data() + r * Ev;
    float* o = out + (i0 + r) * Ev;
    for (i64 e = 0; e < Ev; ++e) o[e] = a[e] / l;
    lse[i0 + r] = mx[ri] + std::log(l);
  }
}

/// The backward's block of queries [i0, i0 + m) against keys [j0, j0 + n): P into sc
/// and dS into ds (m × n each).
void block_probs_and_grads(const Problem& p, const float* lse, const float* delta, const float* gout, i64 i0,
                           i64 m, i64 j0, i64 n, float* sc, float* ds) {
  const i64 Ev = p.s.Ev;
  block_scores(p, i0, m, j0, n, sc);
  for (i64 r = 0; r < m; ++r) {
    exp_shifted(sc + r * n, n, lse[i0 + r]);
  }
  sgemm('N', 'T', m, n, Ev, 1.0f, gout + i0 * Ev, Ev, p.v + j0 * Ev, Ev, 0.0f, ds, n);  // dP
  for (i64 r = 0; r < m; ++r) {
    const float d = delta[i0 + r];
    const float* pr = sc + r * n;
    float* dr = ds + r * n;
    for (i64 c = 0; c < n; ++c) dr[c] = pr[c] * (dr[c] - d);
  }
}

/// dK and dV of keys [j0, j0 + n), summed over the query blocks in order.
void backward_keys(const Problem& p, const float* lse, const float* delta, const float* gout, i64 j0, i64 n,
                   float* gk, float* gv) {
  const i64 E = p.s.E, Ev = p.s.Ev;
  std::fill(gk + j0 * E, gk + (j0 + n) * E, 0.0f);
  std::fill(gv + j0 * Ev, gv + (j0 + n) * Ev, 0.0f);
  std::vector<float> sc(static_cast<std::size_t>(kBlockQ * n)), ds(static_cast<std::size_t>(kBlockQ * n));
  // Causal: a query i < j0 attends to no key of this block.
  for (i64 i0 = p.causal ? j0 : 0; i0 < p.s.L; i0 += kBlockQ) {
    const i64 m = std::min(kBlockQ, p.s.L - i0);
    block_probs_and_grads(p, lse, delta, gout, i0, m, j0, n, sc.data(), ds.data());
    sgemm('T', 'N', n, Ev, m, 1.0f, sc.data(), n, gout + i0 * Ev, Ev, 1.0f, gv + j0 * Ev, Ev);
    sgemm('T', 'N', n, E, m, p.scale, ds.data(), n, p.q + i0 * E, E, 1.0f, gk + j0 * E, E);
  }
}

/// dQ of queries [i0, i0 + m), summed over the key blocks in order.
void backward_queries(const Problem& p, const float* lse, const float* delta, const float* gout, i64 i0, i64 m,
                      float* gq) {
  const i64 E = p.s.E;
  std::fill(gq + i0 * E, gq + (i0 + m) * E, 0.0f);
  std::vector<float> sc(static_cast<std::size_t>(m * kBlockK)), ds(static_cast<std::size_t>(m * kBlockK));
  const i64 end = key_end(p, i0, m);
  for (i64 j0 = 0; j0 < end; j0 += kBlockK) {
    const i64 n = std::min(kBlockK, end - j0);
    block_probs_and_grads(p, lse, delta, gout, i0, m, j0, n, sc.data(), ds.data());
    sgemm('N', 'N', m, E, n, p.scale, ds.data(), n, p.k + j0 * E, E, 1.0f, gq + i0 * E, E);
  }
}

void check_shape(const char* op, const AttentionShape& s) {
  DP_CHECK(s.B >= 0 && s.H >= 1 && s.L >= 0 && s.S >= 0 && s.E >= 1 && s.Ev >= 1, op,
           ": expected B >= 0, H >= 1, L >= 0, S >= 0, E >= 1 and Ev >= 1, got B=", s.B, " H=", s.H, " L=", s.L,
           " S=", s.S, " E=", s.E, " Ev=", s.Ev);
}

/// Runs f(p, start, size) for every (b, h) problem p and every block [start, start + size)
/// of `block` rows of [0, extent), one task each, in the device's arena.
template <typename F>
void for_each_block(CpuBackend& be, Device dev, const AttentionShape& s, const void* q, const void* k, const void* v,
                    const AttentionMask& mask, bool causal, float scale, i64 extent, i64 block, F&& f) {
  const i64 nb = blocks(extent, block);
  be.parallel_chunks(dev, s.B * s.H * nb, [&](i64 task) {
    omp_set_num_threads(1);  // per thread: its oneDNN calls make no team
    const i64 bh = task / nb, start = task % nb * block;
    f(problem(s, q, k, v, mask, causal, scale, bh), bh, start, std::min(block, extent - start));
  });
}

void attention_forward(CpuBackend& be, Device dev, const AttentionForwardArgs& a) {
  const AttentionShape& s = a.s;
  check_shape("attention_forward", s);
  auto* out = static_cast<float*>(a.out);
  for_each_block(be, dev, s, a.q, a.k, a.v, a.mask, a.causal, a.scale, s.L, kBlockQ,
                 [&](const Problem& p, i64 bh, i64 i0, i64 m) {
                   forward_block(p, i0, m, out + bh * s.L * s.Ev, a.lse + bh * s.L);
                 });
}

void attention_backward(CpuBackend& be, Device dev, const AttentionBackwardArgs& a) {
  const AttentionShape& s = a.s;
  check_shape("attention_backward", s);
  const i64 rows = s.B * s.H * s.L;
  const auto* out = static_cast<const float*>(a.out);
  const auto* gout = static_cast<const float*>(a.gout);
  // Δ_i = gout_i · out_i, one float per query row (Note [Fused attention]), in the
  // device's memory so that memory_allocated counts it.
  const std::size_t delta_bytes = static_cast<std::size_t>(rows) * sizeof(float);
  auto free_delta = [&](float* p) { be.deallocate(dev, p, delta_bytes); };
  std::unique_ptr<float, decltype(free_delta)> delta(static_cast<float*>(be.allocate(dev, delta_bytes)), free_delta);
  float* d = delta.get();
  be.parallel_for(dev, rows, std::max<i64>(1, kSerialGrain / s.Ev), [&](i64 b, i64 e) {
    for (i64 r = b; r < e; ++r) {
      float sum = 0.0f;
      for (i64 c = 0; c < s.Ev; ++c) sum += gout[r * s.Ev + c] * out[r * s.Ev + c];
      d[r] = sum;
    }
  });
  for_each_block(be, dev, s, a.q, a.k, a.v, a.mask, a.causal, a.scale, s.S, kBlockK,
                 [&](const Problem& p, i64 bh, i64 j0, i64 n) {
                   backward_keys(p, a.lse + bh * s.L, d + bh * s.L, gout + bh * s.L * s.Ev, j0, n,
                                 static_cast<float*>(a.gk) + bh * s.S * s.E,
                                 static_cast<float*>(a.gv) + bh * s.S * s.Ev);
                 });
  for_each_block(be, dev, s, a.q, a.k, a.v, a.mask, a.causal, a.scale, s.L, kBlockQ,
                 [&](const Problem& p, i64 bh, i64 i0, i64 m) {
                   backward_queries(p, a.lse + bh * s.L, d + bh * s.L, gout + bh * s.L * s.Ev, i0, m,
                                    static_cast<float*>(a.gq) + bh * s.L * s.E);
                 });
}

}  // namespace

void CpuBackend::register_attention_kernels() {
  register_typed<Op::AttentionForward, CpuBackend, &attention_forward>(DType::F32);
  register_typed<Op::AttentionBackward, CpuBackend, &attention_backward>(DType::F32);
}

}  // namespace dp::backend::cpu
