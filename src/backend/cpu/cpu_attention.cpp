// CPU backend: fused (blockwise, "flash") scaled-dot-product attention, forward and
// backward, float32, bfloat16 and float16, with dropout, in the device's arena.
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
//    block wholly above the diagonal is never computed, and in a block on it each row
//    takes the exponentials of its attended keys only (the rest weigh 0).
//  - Backward recomputes each block's probabilities from lse, P = exp(s - lse), with
//    Δ_i = Σ_e gout[i, e] · out[i, e] (= Σ_j P_ij dP_ij): dP = gout vᵀ, dS = P ∘ (dP − Δ),
//    dV = Pᵀ gout, dK = scale · dSᵀ q, dQ = scale · dS k. Two passes keep every sum in a
//    fixed order on one thread: one task per (b, h, key block) sums that block's dK and
//    dV over the query blocks, one task per (b, h, query block) sums its dQ over the key
//    blocks. Results therefore never depend on the thread count or the schedule (the DP,
//    DDP and sharded designs stay bitwise equal), at the price of computing the scores
//    and dP twice: 7 block GEMMs per block pair instead of 5.
//  - Dropout (p < 1) multiplies each probability by Z_ij = keep_ij / (1 - p) after the
//    softmax, as the math path's dropout op does: the forward adds exp(s - m) · Z into
//    acc (the sum l stays the undropped one), the backward takes dP ∘ Z for dS and P ∘ Z
//    for dV; Δ = gout · out holds as it is (Σ_j P_ij Z_ij dP_ij = gout_i · out_i). Z is
//    never stored: keep_ij is the dropout op's draw for counter offset + ((b·H + h)·L +
//    i)·S + j (Note [Counter-based random numbers]; dropout_range computes it), a pure
//    function of the generator's (seed, offset) and the index, so the backward's two
//    passes regenerate each block's Z bit for bit, on any thread. Those are the very
//    keep bits the dropout op draws over the math path's (B, H, L, S) weights from the
//    same generator state, and the caller advances the generator by B·H·L·S as that op
//    does: the two paths drop the same weights and leave the generator alike, so they
//    agree to rounding with dropout too (not bit for bit: see below). Another backend's
//    kernel may draw its own way (then it would not equal the math path's bits with
//    dropout, only its distribution), as long as its forward and backward agree and
//    the draws depend on nothing but (seed, offset) and the index; the CUDA kernel draws
//    these very bits (Note [Fused attention on CUDA]). The price here: one
//    Philox block per score in the forward and two in the backward (vectorised, Note
//    [Vectorised random fills]).
//  - 16-bit storage (bfloat16, float16): q, k, v (and gout in the backward) are widened
//    to float32 a block at a time (exact), every GEMM, the scores, m, l, lse, Δ and the
//    output, dQ, dK and dV accumulators are float32, and out, gq, gk, gv are rounded to
//    the storage type once, when stored. A mask is float32 or of the call's dtype. The
//    math path in those dtypes rounds more: its scores, weights and products are each
//    stored in 16 bits (tests/nn/attention_fused_test.cpp bounds both against float32).
// Memory: besides the inputs and outputs, the forward keeps lse (B·H·L floats) and the
// backward Δ (B·H·L floats, freed when it returns) — O(L) per (b, h), both from the
// device's allocator — and each running task holds O(kBlockQ · (kBlockK + E + Ev))
// floats of heap scratch (one set per thread at a time, not counted by
// memory_allocated), whatever L and S are; the math path holds the (B, H, L, S) weights
// (and with dropout its mask and the dropped weights too). Every block product is a
// single-threaded dnnl_sgemm (float32 accumulation; Note [oneDNN in the device's arena]
// in cpu_backend.h), the exponentials a vectorised loop over a block's row (Note
// [Attention exponentials] in cpu_attention_exp.cpp), the masking plain loops.
// The order of the sums differs from the math path's (the softmax is reassociated over
// key blocks, the GEMMs are cut differently), so the two agree to float32 rounding, not
// bit for bit: tests/nn/attention_fused_test.cpp compares them.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <oneapi/dnnl/dnnl.h>

#include "backend/cpu/cpu_backend.h"
#include "dp/core/error.h"
#include "dp/core/half.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

// 64 x 64 blocks: a block's scores (16 KiB), its dP and the q, k, v rows it reads stay
// in L2 while a task works on them, and T = 128 already gives two query blocks per (b, h).
constexpr i64 kBlockQ = 64;
constexpr i64 kBlockK = 64;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

i64 blocks(i64 n, i64 block) { return (n + block - 1) / block; }

std::size_t sz(i64 n) { return static_cast<std::size_t>(n); }

void sgemm(char ta, char tb, i64 m, i64 n, i64 k, float alpha, const float* a, i64 lda, const float* b, i64 ldb,
           float beta, float* c, i64 ldc) {
  const dnnl_status_t status = dnnl_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  DP_CHECK(status == dnnl_success, "attention: dnnl_sgemm failed with status ", static_cast<int>(status), " for m=",
           m, " n=", n, " k=", k);
}

/// Rows [r0, r0 + n) of a row-major matrix of T with `width` columns, as float32: the
/// rows themselves for float32, else widened (exactly) into buf.
template <typename T>
const float* rows_f32(const T* matrix, i64 r0, i64 n, i64 width, std::vector<float>& buf) {
  const T* from = matrix + r0 * width;
  if constexpr (std::is_same_v<T, float>) {
    return from;
  } else {
    buf.resize(sz(n * width));
    for (i64 i = 0; i < n * width; ++i) buf[sz(i)] = static_cast<float>(from[i]);
    return buf.data();
  }
}

/// A float32 accumulator over `count` elements of an output of T, zeroed: the output
/// itself for float32; for 16-bit storage a buffer that store() rounds into it once.
template <typename T>
class Accumulator {
 public:
  Accumulator(T* out, i64 count) : out_(out), count_(count) {
    if constexpr (std::is_same_v<T, float>) std::fill(out, out + count, 0.0f);
    else buf_.assign(sz(count), 0.0f);
  }
  float* data() {
    if constexpr (std::is_same_v<T, float>) return out_;
    else return buf_.data();
  }
  void store() {
    if constexpr (!std::is_same_v<T, float>)
      for (i64 i = 0; i < count_; ++i) out_[i] = T(buf_[sz(i)]);
  }

 private:
  T* out_;
  i64 count_;
  std::vector<float> buf_;
};

/// One (b, h) problem of a call: its q (L, E), k (S, E), v (S, Ev) rows, its mask and
/// its dropout.
template <typename T>
struct Problem {
  const AttentionShape& s;
  const T* q;
  const T* k;
  const T* v;
  const void* mask;  // null, or the mask's first element (at (b, h) add mask_at)
  DType mask_dtype;
  i64 mask_at, msl, mss;
  bool keep;
  bool causal;
  float scale;
  float drop_p;      // 0: no dropout
  float drop_scale;  // 1 / (1 - p), as the dropout op's
  std::uint64_t seed;
  std::uint64_t counter;  // of the weight (b, h, 0, 0): Note [Fused attention]
};

template <typename T>
Problem<T> problem(const AttentionShape& s, const void* q, const void* k, const void* v, const AttentionMask& mask,
                   bool causal, float scale, const AttentionDropout& drop, i64 bh) {
  const i64 b = bh / s.H, h = bh % s.H;
  return {.s = s,
          .q = static_cast<const T*>(q) + bh * s.L * s.E,
          .k = static_cast<const T*>(k) + bh * s.S * s.E,
          .v = static_cast<const T*>(v) + bh * s.S * s.Ev,
          .mask = mask.p,
          .mask_dtype = mask.dtype,
          .mask_at = b * mask.sb + h * mask.sh,
          .msl = mask.sl,
          .mss = mask.ss,
          .keep = mask.keep,
          .causal = causal,
          .scale = scale,
          .drop_p = drop.p,
          .drop_scale = drop.p > 0.0f ? 1.0f / (1.0f - drop.p) : 1.0f,
          .seed = drop.seed,
          .counter = drop.offset + static_cast<std::uint64_t>(bh * s.L * s.S)};
}

/// The mask of M over rows [i0, i0 + m) and keys [j0, j0 + n) applied to sc.
template <typename M, typename T>
void apply_mask(const Problem<T>& p, i64 i0, i64 m, i64 j0, i64 n, float* sc) {
  const M* mask = static_cast<const M*>(p.mask) + p.mask_at;
  for (i64 r = 0; r < m; ++r) {
    const M* mr = mask + (i0 + r) * p.msl + j0 * p.mss;
    float* row = sc + r * n;
    if (p.keep) {
      for (i64 c = 0; c < n; ++c) row[c] = static_cast<float>(mr[c * p.mss]) != 0.0f ? row[c] : kNegInf;
    } else {
      for (i64 c = 0; c < n; ++c) row[c] += static_cast<float>(mr[c * p.mss]);
    }
  }
}

/// sc (m × n, rows n apart) = the masked scores of queries [i0, i0 + m) (their rows qf,
/// float32) against keys [j0, j0 + n) (kf): scale · q kᵀ, then + mask or where(keep, ·,
/// -inf), then -inf for key j > query i when causal — the math path's steps, in its order.
template <typename T>
void block_scores(const Problem<T>& p, const float* qf, i64 i0, i64 m, const float* kf, i64 j0, i64 n, float* sc) {
  const i64 E = p.s.E;
  sgemm('N', 'T', m, n, E, p.scale, qf, E, kf, E, 0.0f, sc, n);
  if (p.mask) {
    if (p.mask_dtype == DType::F32) apply_mask<float>(p, i0, m, j0, n, sc);
    else apply_mask<T>(p, i0, m, j0, n, sc);
  }
  if (p.causal) {
    for (i64 r = 0; r < m; ++r) {
      float* row = sc + r * n;
      for (i64 c = std::max<i64>(0, i0 + r - j0 + 1); c < n; ++c) row[c] = kNegInf;
    }
  }
}

/// x[c] *= Z_ij for the n weights (i, j0 .. j0 + n - 1) of a problem with dropout, and
/// z[c] = Z_ij unless z is null (Note [Fused attention]: the dropout op's draws).
template <typename T>
void drop_row(const Problem<T>& p, float* x, float* z, i64 i, i64 j0, i64 n) {
  const std::uint64_t first = p.counter + static_cast<std::uint64_t>(i * p.s.S + j0);
  dropout_range(x, x, z, 0, n, p.drop_p, p.drop_scale, p.seed, first);
}

/// How many of the keys [j0, j0 + n) query i may attend to: all n, or under the causal
/// mask those j <= i, a prefix (the rest score -inf and weigh exactly 0: exp_shifted of
/// -inf is +0, so filling them with 0 is the same bits without their exponentials).
template <typename T>
i64 attended(const Problem<T>& p, i64 i, i64 j0, i64 n) {
  return p.causal ? std::clamp<i64>(i - j0 + 1, 0, n) : n;
}

/// The length of a block row to take exponentials over when its first `live` of n
/// weights are attended: live rounded up to a multiple of 16 within n, so that
/// exp_shifted runs whole vectors (Note [Attention exponentials]). The weights past
/// `live` are overwritten with 0 afterwards, whatever their exponentials gave.
inline i64 exp_span(i64 live, i64 n) { return std::min(n, (live + 15) / 16 * 16); }

/// The keys a block of queries [i0, i0 + m) attends to: [0, end).
template <typename T>
i64 key_end(const Problem<T>& p, i64 i0, i64 m) {
  return p.causal ? std::min(p.s.S, i0 + m) : p.s.S;
}

/// Forward of queries [i0, i0 + m) of one problem (Note [Fused attention]).
template <typename T>
void forward_block(const Problem<T>& p, i64 i0, i64 m, T* out, float* lse) {
  const i64 E = p.s.E, Ev = p.s.Ev;
  std::vector<float> qb, kb, vb;
  const float* qf = rows_f32(p.q, i0, m, E, qb);
  std::vector<float> sc(sz(m * kBlockK));
  std::vector<float> acc(sz(m * Ev), 0.0f);
  std::vector<float> mx(sz(m), kNegInf), sum(sz(m), 0.0f);
  const i64 end = key_end(p, i0, m);
  for (i64 j0 = 0; j0 < end; j0 += kBlockK) {
    const i64 n = std::min(kBlockK, end - j0);
    const float* kf = rows_f32(p.k, j0, n, E, kb);
    const float* vf = rows_f32(p.v, j0, n, Ev, vb);
    block_scores(p, qf, i0, m, kf, j0, n, sc.data());
    for (i64 r = 0; r < m; ++r) {
      float* row = sc.data() + r * n;
      const i64 live = attended(p, i0 + r, j0, n);
      float block_max = kNegInf;
      for (i64 c = 0; c < live; ++c) block_max = std::max(block_max, row[c]);
      const auto ri = sz(r);
      const float m_new = std::max(mx[ri], block_max);
      if (m_new == kNegInf) {  // nothing attended yet: no weight, no rescale
        std::fill(row, row + n, 0.0f);
        continue;
      }
      exp_shifted(row, exp_span(live, n), m_new);  // Note [Attention exponentials]
      std::fill(row + live, row + n, 0.0f);
      float row_sum = 0.0f;
      for (i64 c = 0; c < live; ++c) row_sum += row[c];
      if (p.drop_p > 0.0f) drop_row(p, row, nullptr, i0 + r, j0, n);  // after the sum: l is undropped
      const float correction = std::exp(mx[ri] - m_new);  // 0 on the first block attended
      sum[ri] = sum[ri] * correction + row_sum;
      mx[ri] = m_new;
      if (correction != 1.0f) {
        float* a = acc.data() + r * Ev;
        for (i64 e = 0; e < Ev; ++e) a[e] *= correction;
      }
    }
    sgemm('N', 'N', m, Ev, n, 1.0f, sc.data(), n, vf, Ev, 1.0f, acc.data(), Ev);
  }
  // A row with every key masked has sum 0 (and acc 0): out = 0, and lse = +inf, so that
  // the backward's probabilities exp(s - lse) are 0 on it (Note [Rows with every key
  // masked] in src/nn/functional_sequence.cpp). A NaN score makes the sum NaN, not 0.
  for (i64 r = 0; r < m; ++r) {
    const auto ri = sz(r);
    const float l = sum[ri];
    const float* a = acc.data() + r * Ev;
    T* o = out + (i0 + r) * Ev;
    if (l == 0.0f) {
      for (i64 e = 0; e < Ev; ++e) o[e] = T(0.0f);
      lse[i0 + r] = std::numeric_limits<float>::infinity();
      continue;
    }
    for (i64 e = 0; e < Ev; ++e) o[e] = T(a[e] / l);
    lse[i0 + r] = mx[ri] + std::log(l);
  }
}

/// The float32 rows of one block pair in the backward: queries [i0, i0 + m) (q, gout
/// and their lse and Δ) against keys [j0, j0 + n) (k, v).
struct BlockRows {
  const float* q;
  const float* gout;
  const float* lse;
  const float* delta;
  i64 i0, m;
  const float* k;
  const float* v;
  i64 j0, n;
};

/// The backward's block pair: dS into ds (m × n), and into sc the weights dV takes: P,
/// or P ∘ Z with dropout (then z, m × n, holds Z). z may be null where only dS is
/// wanted (Note [Fused attention]).
template <typename T>
void block_probs_and_grads(const Problem<T>& p, const BlockRows& b, float* sc, float* ds, float* z) {
  const i64 Ev = p.s.Ev, m = b.m, n = b.n;
  block_scores(p, b.q, b.i0, m, b.k, b.j0, n, sc);
  for (i64 r = 0; r < m; ++r) {
    float* row = sc + r * n;
    const i64 live = attended(p, b.i0 + r, b.j0, n);
    exp_shifted(row, exp_span(live, n), b.lse[r]);
    std::fill(row + live, row + n, 0.0f);
  }
  sgemm('N', 'T', m, n, Ev, 1.0f, b.gout, Ev, b.v, Ev, 0.0f, ds, n);  // dP of the weights v saw
  const bool drop = p.drop_p > 0.0f;
  for (i64 r = 0; r < m; ++r) {
    float* dr = ds + r * n;
    float* zr = drop && z ? z + r * n : nullptr;
    if (drop) drop_row(p, dr, zr, b.i0 + r, b.j0, n);  // dP ∘ Z: the gradient of P
    const float d = b.delta[r];
    const float* pr = sc + r * n;
    // Keys past the causal window take no gradient, whatever their dP: a weight of 0
    // times an infinite value row's dP would be a NaN in gk (the CUDA kernel skips them).
    const i64 live = attended(p, b.i0 + r, b.j0, n);
    for (i64 c = 0; c < live; ++c) dr[c] = pr[c] * (dr[c] - d);
    std::fill(dr + live, dr + n, 0.0f);
  }
  if (drop && z)
    for (i64 i = 0; i < m * n; ++i) sc[i] *= z[i];
}

/// dK and dV of keys [j0, j0 + n), summed over the query blocks in order.
template <typename T>
void backward_keys(const Problem<T>& p, const float* lse, const float* delta, const T* gout, i64 j0, i64 n, T* gk,
                   T* gv) {
  const i64 E = p.s.E, Ev = p.s.Ev;
  std::vector<float> kb, vb, qb, gb;
  Accumulator<T> gk_acc(gk + j0 * E, n * E), gv_acc(gv + j0 * Ev, n * Ev);
  BlockRows b{.q = nullptr, .gout = nullptr, .lse = nullptr, .delta = nullptr, .i0 = 0, .m = 0,
              .k = rows_f32(p.k, j0, n, E, kb), .v = rows_f32(p.v, j0, n, Ev, vb), .j0 = j0, .n = n};
  std::vector<float> sc(sz(kBlockQ * n)), ds(sz(kBlockQ * n));
  std::vector<float> z(p.drop_p > 0.0f ? sz(kBlockQ * n) : 0);
  // Causal: a query i < j0 attends to no key of this block.
  for (i64 i0 = p.causal ? j0 : 0; i0 < p.s.L; i0 += kBlockQ) {
    const i64 m = std::min(kBlockQ, p.s.L - i0);
    b.i0 = i0;
    b.m = m;
    b.q = rows_f32(p.q, i0, m, E, qb);
    b.gout = rows_f32(gout, i0, m, Ev, gb);
    b.lse = lse + i0;
    b.delta = delta + i0;
    block_probs_and_grads(p, b, sc.data(), ds.data(), z.empty() ? nullptr : z.data());
    sgemm('T', 'N', n, Ev, m, 1.0f, sc.data(), n, b.gout, Ev, 1.0f, gv_acc.data(), Ev);
    sgemm('T', 'N', n, E, m, p.scale, ds.data(), n, b.q, E, 1.0f, gk_acc.data(), E);
  }
  gk_acc.store();
  gv_acc.store();
}

/// dQ of queries [i0, i0 + m), summed over the key blocks in order.
template <typename T>
void backward_queries(const Problem<T>& p, const float* lse, const float* delta, const T* gout, i64 i0, i64 m,
                      T* gq) {
  const i64 E = p.s.E, Ev = p.s.Ev;
  std::vector<float> qb, gb, kb, vb;
  Accumulator<T> gq_acc(gq + i0 * E, m * E);
  BlockRows b{.q = rows_f32(p.q, i0, m, E, qb), .gout = rows_f32(gout, i0, m, Ev, gb), .lse = lse + i0,
              .delta = delta + i0, .i0 = i0, .m = m, .k = nullptr, .v = nullptr, .j0 = 0, .n = 0};
  std::vector<float> sc(sz(m * kBlockK)), ds(sz(m * kBlockK));
  const i64 end = key_end(p, i0, m);
  for (i64 j0 = 0; j0 < end; j0 += kBlockK) {
    const i64 n = std::min(kBlockK, end - j0);
    b.j0 = j0;
    b.n = n;
    b.k = rows_f32(p.k, j0, n, E, kb);
    b.v = rows_f32(p.v, j0, n, Ev, vb);
    block_probs_and_grads(p, b, sc.data(), ds.data(), nullptr);
    sgemm('N', 'N', m, E, n, p.scale, ds.data(), n, b.k, E, 1.0f, gq_acc.data(), E);
  }
  gq_acc.store();
}

/// Runs f(p, bh, start, size) for every (b, h) problem p and every block [start, start +
/// size) of `block` rows of [0, extent), one task each, in the device's arena.
template <typename T, typename Args, typename F>
void for_each_block(CpuBackend& be, Device dev, const Args& a, i64 extent, i64 block, F&& f) {
  const i64 nb = blocks(extent, block);
  be.parallel_chunks(dev, a.s.B * a.s.H * nb, [&](i64 task) {
    omp_set_num_threads(1);  // per thread: its oneDNN calls make no team
    const i64 bh = task / nb, start = task % nb * block;
    f(problem<T>(a.s, a.q, a.k, a.v, a.mask, a.causal, a.scale, a.dropout, bh), bh, start,
      std::min(block, extent - start));
  });
}

template <typename T>
void attention_forward(CpuBackend& be, Device dev, const AttentionForwardArgs& a) {
  const AttentionShape& s = a.s;
  check_attention_args("attention_forward", dtype_of<T>, s, a.mask, a.dropout);
  auto* out = static_cast<T*>(a.out);
  for_each_block<T>(be, dev, a, s.L, kBlockQ, [&](const Problem<T>& p, i64 bh, i64 i0, i64 m) {
    forward_block(p, i0, m, out + bh * s.L * s.Ev, a.lse + bh * s.L);
  });
}

template <typename T>
void attention_backward(CpuBackend& be, Device dev, const AttentionBackwardArgs& a) {
  const AttentionShape& s = a.s;
  check_attention_args("attention_backward", dtype_of<T>, s, a.mask, a.dropout);
  const i64 rows = s.B * s.H * s.L;
  const auto* out = static_cast<const T*>(a.out);
  const auto* gout = static_cast<const T*>(a.gout);
  // Δ_i = gout_i · out_i, one float per query row (Note [Fused attention]), in the
  // device's memory so that memory_allocated counts it.
  const std::size_t delta_bytes = sz(rows) * sizeof(float);
  auto free_delta = [&](float* p) { be.deallocate(dev, p, delta_bytes); };
  std::unique_ptr<float, decltype(free_delta)> delta(static_cast<float*>(be.allocate(dev, delta_bytes)), free_delta);
  float* d = delta.get();
  be.parallel_for(dev, rows, std::max<i64>(1, kSerialGrain / s.Ev), [&](i64 b, i64 e) {
    for (i64 r = b; r < e; ++r) {
      float sum = 0.0f;
      for (i64 c = 0; c < s.Ev; ++c) sum += static_cast<float>(gout[r * s.Ev + c]) * static_cast<float>(out[r * s.Ev + c]);
      d[r] = sum;
    }
  });
  for_each_block<T>(be, dev, a, s.S, kBlockK, [&](const Problem<T>& p, i64 bh, i64 j0, i64 n) {
    backward_keys(p, a.lse + bh * s.L, d + bh * s.L, gout + bh * s.L * s.Ev, j0, n,
                  static_cast<T*>(a.gk) + bh * s.S * s.E, static_cast<T*>(a.gv) + bh * s.S * s.Ev);
  });
  for_each_block<T>(be, dev, a, s.L, kBlockQ, [&](const Problem<T>& p, i64 bh, i64 i0, i64 m) {
    backward_queries(p, a.lse + bh * s.L, d + bh * s.L, gout + bh * s.L * s.Ev, i0, m,
                     static_cast<T*>(a.gq) + bh * s.L * s.E);
  });
}

}  // namespace

void CpuBackend::register_attention_kernels() {
  register_typed<Op::AttentionForward, CpuBackend, &attention_forward<float>>(DType::F32);
  register_typed<Op::AttentionBackward, CpuBackend, &attention_backward<float>>(DType::F32);
  register_typed<Op::AttentionForward, CpuBackend, &attention_forward<BFloat16>>(DType::BF16);
  register_typed<Op::AttentionBackward, CpuBackend, &attention_backward<BFloat16>>(DType::BF16);
  register_typed<Op::AttentionForward, CpuBackend, &attention_forward<Float16>>(DType::F16);
  register_typed<Op::AttentionBackward, CpuBackend, &attention_backward<Float16>>(DType::F16);
}

}  // namespace dp::backend::cpu
