// The CUDA attention forward on mma fragments (src/backend/mma_attention.h, Note
// [Attention on mma fragments]), tested without a GPU: the kernel's own bodies run here
// for every block, warp and simulated lane, in the kernel's order, against attention
// computed in double from the same bfloat16 inputs.
#include "backend/mma_attention.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "dp/core/half.h"

namespace {

namespace ma = dp::backend::mma_attention;
using i64 = std::int64_t;

struct Problem {
  i64 BH, L, S;
  int E, Ev;
  bool causal;
  float spread;  // inputs uniform in [-spread, spread]: large spreads move the running maximum
};

std::vector<std::uint16_t> random_bf16(i64 n, float spread, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-spread, spread);
  std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dp::BFloat16(u(rng)).bits;
  return v;
}

float value(std::uint16_t b) { return static_cast<float>(dp::BFloat16::from_bits(b)); }

using Bits = std::vector<std::uint16_t>;

/// What a GPU's shared memory and registers hold before a kernel writes them: anything.
/// The host fills the simulated ones with NaN (0xFFFF in bfloat16, all ones in float),
/// so a read of a tile's or a state's element that the kernel never wrote shows in the
/// results instead of reading as the zero a fresh std::vector holds (a load that left a
/// partial tile's padding unwritten passes with zeros and fails with this).
constexpr std::uint16_t kPoison = 0xFFFF;
template <typename State>
void poison(std::vector<State>& states) {
  static_assert(std::is_trivially_copyable_v<State>);
  std::memset(static_cast<void*>(states.data()), 0xFF, states.size() * sizeof(State));
}

/// A query-side grid of one problem, block by block, as the kernels run it: for each
/// block of 64 queries from i0, begin(i0); for each key tile its K and V rows in k_s and
/// v_s and step(w, first, j0) for each warp whose rows attend to some of its keys; then
/// finish(w, first).
template <typename Begin, typename Step, typename Finish>
void walk_query_blocks(const ma::Shape& p, const std::uint16_t* kb, const std::uint16_t* vb, std::uint16_t* k_s,
                       std::uint16_t* v_s, Begin begin, Step step, Finish finish) {
  for (i64 i0 = 0; i0 < p.L; i0 += ma::kTile) {
    begin(i0);
    const i64 end = ma::keys_end(p, i0);
    for (i64 j0 = 0; j0 < end; j0 += ma::kTile) {
      ma::load_rows(k_s, kb, j0, end, p.E, 0, 1);
      ma::load_rows(v_s, vb, j0, end, p.Ev, 0, 1);
      for (int w = 0; w < ma::kWarps; ++w)
        if (!ma::warp_skips(p, i0 + w * ma::kRows, j0)) step(w, i0 + w * ma::kRows, j0);
    }
    for (int w = 0; w < ma::kWarps; ++w) finish(w, i0 + w * ma::kRows);
  }
}

/// The forward's grid: what attention_forward_mma_kernel does on a GPU.
void run_forward(const Problem& pb, const ma::Shape& p, const Bits& q, const Bits& k, const Bits& v, Bits& out,
                 std::vector<float>& lse) {
  std::vector<std::uint16_t> smem(3 * ma::kTileElems, kPoison);
  std::uint16_t* q_s = smem.data();
  std::uint16_t* k_s = q_s + ma::kTileElems;
  std::uint16_t* v_s = k_s + ma::kTileElems;
  std::vector<ma::WarpState> st(ma::kWarps);
  poison(st);
  for (i64 bh = 0; bh < pb.BH; ++bh) {
    walk_query_blocks(
        p, k.data() + bh * p.S * p.E, v.data() + bh * p.S * p.Ev, k_s, v_s,
        [&](i64 i0) {
          ma::load_rows(q_s, q.data() + bh * p.L * p.E, i0, p.L, p.E, 0, 1);
          for (int w = 0; w < ma::kWarps; ++w) ma::warp_begin(st[static_cast<std::size_t>(w)], q_s, w);
        },
        [&](int w, i64 first, i64 j0) { ma::warp_tile(st[static_cast<std::size_t>(w)], p, k_s, v_s, first, j0); },
        [&](int w, i64 first) {
          ma::warp_finish(st[static_cast<std::size_t>(w)], p, out.data() + bh * p.L * p.Ev, lse.data() + bh * p.L,
                          first);
        });
  }
}

void check_problem(const Problem& pb) {
  CAPTURE(pb.BH);
  CAPTURE(pb.L);
  CAPTURE(pb.S);
  CAPTURE(pb.E);
  CAPTURE(pb.Ev);
  CAPTURE(pb.causal);
  CAPTURE(pb.spread);
  const ma::Shape p{pb.L, pb.S, pb.E, pb.Ev, 1.0f / std::sqrt(static_cast<float>(pb.E)), pb.causal};
  const auto q = random_bf16(pb.BH * pb.L * pb.E, pb.spread, 1);
  const auto k = random_bf16(pb.BH * pb.S * pb.E, pb.spread, 2);
  const auto v = random_bf16(pb.BH * pb.S * pb.Ev, 1.0f, 3);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(pb.BH * pb.L * pb.Ev), 0x7FC0);  // NaN: unwritten
  std::vector<float> lse(static_cast<std::size_t>(pb.BH * pb.L), std::nanf(""));
  run_forward(pb, p, q, k, v, out, lse);

  int bad = 0;
  for (i64 bh = 0; bh < pb.BH; ++bh)
    for (i64 i = 0; i < pb.L; ++i) {
      std::vector<double> s(static_cast<std::size_t>(pb.S));
      double mx = -std::numeric_limits<double>::infinity();
      for (i64 j = 0; j < pb.S; ++j) {
        double dot = 0;
        for (int e = 0; e < pb.E; ++e)
          dot += double(value(q[static_cast<std::size_t>((bh * pb.L + i) * pb.E + e)])) *
                 value(k[static_cast<std::size_t>((bh * pb.S + j) * pb.E + e)]);
        const bool attends = !(pb.causal && j > i);
        s[static_cast<std::size_t>(j)] = attends ? double(p.scale) * dot : -std::numeric_limits<double>::infinity();
        mx = std::max(mx, s[static_cast<std::size_t>(j)]);
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      const double want_lse = mx + std::log(sum);
      const float got_lse = lse[static_cast<std::size_t>(bh * pb.L + i)];
      if (!(std::fabs(got_lse - want_lse) <= 1e-5 * std::max(1.0, std::fabs(want_lse)))) {
        if (++bad <= 5) FAIL_CHECK("lse of (", bh, ", ", i, "): got ", got_lse, ", want ", want_lse);
      }
      for (int d = 0; d < pb.Ev; ++d) {
        double o = 0;
        for (i64 j = 0; j < pb.S; ++j)
          o += s[static_cast<std::size_t>(j)] * value(v[static_cast<std::size_t>((bh * pb.S + j) * pb.Ev + d)]);
        o /= sum;
        const float got = value(out[static_cast<std::size_t>((bh * pb.L + i) * pb.Ev + d)]);
        // One bfloat16 rounding of the output (half a unit, 2^-9 relative) and the float32
        // sums and 16-bit-mantissa weights before it.
        if (!(std::fabs(got - o) <= 0x1.0p-8 * std::fabs(o) + 1e-4)) {
          if (++bad <= 5) FAIL_CHECK("out of (", bh, ", ", i, ", ", d, "): got ", got, ", want ", o);
        }
      }
    }
  CHECK(bad == 0);
}

}  // namespace

/// The backward's two grids, block by block: attention_keys_mma_kernel's (gk, gv) and
/// attention_queries_mma_kernel's (gq).
void run_backward(const Problem& pb, const ma::Shape& p, const Bits& q, const Bits& k, const Bits& v, const Bits& g,
                  const std::vector<float>& lse, const std::vector<float>& delta, Bits& gq, Bits& gk, Bits& gv) {
  std::vector<std::uint16_t> smem(4 * ma::kTileElems, kPoison);
  std::uint16_t* t0 = smem.data();
  std::uint16_t* t1 = t0 + ma::kTileElems;
  std::uint16_t* t2 = t1 + ma::kTileElems;
  std::uint16_t* t3 = t2 + ma::kTileElems;
  std::vector<float> lse_s(ma::kTile, std::nanf("")), delta_s(ma::kTile, std::nanf(""));
  for (i64 bh = 0; bh < pb.BH; ++bh) {
    const std::uint16_t* qb = q.data() + bh * p.L * p.E;
    const std::uint16_t* kb = k.data() + bh * p.S * p.E;
    const std::uint16_t* vb = v.data() + bh * p.S * p.Ev;
    const std::uint16_t* gb = g.data() + bh * p.L * p.Ev;
    // dK and dV: a block per 64 keys, walking the query tiles.
    for (i64 j0 = 0; j0 < p.S; j0 += ma::kTile) {
      std::vector<ma::KeysState> st(ma::kWarps);
      poison(st);
      ma::load_rows(t0, kb, j0, p.S, p.E, 0, 1);
      ma::load_rows(t1, vb, j0, p.S, p.Ev, 0, 1);
      for (int w = 0; w < ma::kWarps; ++w) ma::keys_begin(st[static_cast<std::size_t>(w)], t0, t1, w);
      for (i64 i0 = p.causal ? j0 : 0; i0 < p.L; i0 += ma::kTile) {
        ma::load_rows(t2, qb, i0, p.L, p.E, 0, 1);
        ma::load_rows(t3, gb, i0, p.L, p.Ev, 0, 1);
        ma::load_row_stats(lse_s.data(), delta_s.data(), lse.data() + bh * p.L, delta.data() + bh * p.L, i0, p.L, 0,
                           1);
        for (int w = 0; w < ma::kWarps; ++w) {
          const i64 first = j0 + w * ma::kRows;
          if (!ma::keys_skip(p, first, i0))
            ma::keys_tile(st[static_cast<std::size_t>(w)], p, t2, t3, lse_s.data(), delta_s.data(), first, i0);
        }
      }
      for (int w = 0; w < ma::kWarps; ++w) {
        const i64 first = j0 + w * ma::kRows;
        ma::store_rows(gk.data() + bh * p.S * p.E, st[static_cast<std::size_t>(w)].dk, first, p.S, p.E, p.scale);
        ma::store_rows(gv.data() + bh * p.S * p.Ev, st[static_cast<std::size_t>(w)].dv, first, p.S, p.Ev, 1.0f);
      }
    }
    // dQ: a block per 64 queries, walking the key tiles.
    std::vector<ma::QueriesState> st(ma::kWarps);
    poison(st);
    walk_query_blocks(
        p, kb, vb, t2, t3,
        [&](i64 i0) {
          ma::load_rows(t0, qb, i0, p.L, p.E, 0, 1);
          ma::load_rows(t1, gb, i0, p.L, p.Ev, 0, 1);
          for (int w = 0; w < ma::kWarps; ++w)
            ma::queries_begin(st[static_cast<std::size_t>(w)], p, t0, t1, lse.data() + bh * p.L,
                              delta.data() + bh * p.L, w, i0 + w * ma::kRows);
        },
        [&](int w, i64 first, i64 j0) { ma::queries_tile(st[static_cast<std::size_t>(w)], p, t2, t3, first, j0); },
        [&](int w, i64 first) {
          ma::store_rows(gq.data() + bh * p.L * p.E, st[static_cast<std::size_t>(w)].dq, first, p.L, p.E, p.scale);
        });
  }
}

/// Each of got (bfloat16) within one bfloat16 rounding and the float32 sums of want
/// (double), relative to want's largest magnitude where the sums cancel.
int count_bad(const char* what, const Bits& got, const std::vector<double>& want) {
  double peak = 0;
  for (double w : want) peak = std::max(peak, std::fabs(w));
  int bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double gv = value(got[i]);
    if (!(std::fabs(gv - want[i]) <= 0x1.0p-8 * std::fabs(want[i]) + 2e-3 * peak)) {
      if (++bad <= 5) FAIL_CHECK(what, "[", i, "]: got ", gv, ", want ", want[i], " (largest ", peak, ")");
    }
  }
  return bad;
}

void check_backward(const Problem& pb) {
  CAPTURE(pb.BH);
  CAPTURE(pb.L);
  CAPTURE(pb.S);
  CAPTURE(pb.E);
  CAPTURE(pb.Ev);
  CAPTURE(pb.causal);
  const ma::Shape p{pb.L, pb.S, pb.E, pb.Ev, 1.0f / std::sqrt(static_cast<float>(pb.E)), pb.causal};
  const Bits q = random_bf16(pb.BH * pb.L * pb.E, pb.spread, 11), k = random_bf16(pb.BH * pb.S * pb.E, pb.spread, 12);
  const Bits v = random_bf16(pb.BH * pb.S * pb.Ev, 1.0f, 13), g = random_bf16(pb.BH * pb.L * pb.Ev, 1.0f, 14);
  auto at = [](const Bits& x, i64 i) { return static_cast<double>(value(x[static_cast<std::size_t>(i)])); };
  // The reference in double; lse and Δ (gout · out) handed to the kernels as float32.
  std::vector<float> lse(static_cast<std::size_t>(pb.BH * pb.L)), delta(lse.size());
  std::vector<double> wq(q.size()), wk(k.size()), wv(v.size());
  for (i64 bh = 0; bh < pb.BH; ++bh)
    for (i64 i = 0; i < pb.L; ++i) {
      std::vector<double> pr(static_cast<std::size_t>(pb.S));
      double mx = -std::numeric_limits<double>::infinity();
      for (i64 j = 0; j < pb.S; ++j) {
        double dot = 0;
        for (int e = 0; e < pb.E; ++e) dot += at(q, (bh * pb.L + i) * pb.E + e) * at(k, (bh * pb.S + j) * pb.E + e);
        pr[static_cast<std::size_t>(j)] =
            pb.causal && j > i ? -std::numeric_limits<double>::infinity() : double(p.scale) * dot;
        mx = std::max(mx, pr[static_cast<std::size_t>(j)]);
      }
      double sum = 0;
      for (double& x : pr) sum += (x = std::exp(x - mx));
      for (double& x : pr) x /= sum;
      const i64 row = bh * pb.L + i;
      lse[static_cast<std::size_t>(row)] = static_cast<float>(mx + std::log(sum));
      double d = 0;
      for (int c = 0; c < pb.Ev; ++c) {
        double o = 0;
        for (i64 j = 0; j < pb.S; ++j) o += pr[static_cast<std::size_t>(j)] * at(v, (bh * pb.S + j) * pb.Ev + c);
        d += at(g, row * pb.Ev + c) * o;
      }
      delta[static_cast<std::size_t>(row)] = static_cast<float>(d);
      for (i64 j = 0; j < pb.S; ++j) {
        const double pij = pr[static_cast<std::size_t>(j)];
        double dp = 0;
        for (int c = 0; c < pb.Ev; ++c) {
          dp += at(g, row * pb.Ev + c) * at(v, (bh * pb.S + j) * pb.Ev + c);
          wv[static_cast<std::size_t>((bh * pb.S + j) * pb.Ev + c)] += pij * at(g, row * pb.Ev + c);
        }
        const double ds = pij * (dp - double(delta[static_cast<std::size_t>(row)])) * double(p.scale);
        for (int e = 0; e < pb.E; ++e) {
          wq[static_cast<std::size_t>(row * pb.E + e)] += ds * at(k, (bh * pb.S + j) * pb.E + e);
          wk[static_cast<std::size_t>((bh * pb.S + j) * pb.E + e)] += ds * at(q, row * pb.E + e);
        }
      }
    }
  Bits gq(q.size(), 0x7FC0), gk(k.size(), 0x7FC0), gv(v.size(), 0x7FC0);  // NaN: unwritten
  run_backward(pb, p, q, k, v, g, lse, delta, gq, gk, gv);
  CHECK(count_bad("gq", gq, wq) == 0);
  CHECK(count_bad("gk", gk, wk) == 0);
  CHECK(count_bad("gv", gv, wv) == 0);
}

TEST_CASE("the mma attention forward matches attention in double: partial tiles, padding, causal") {
  // 70 queries and 67 keys: partial 64-row tiles on both sides; E = 40 and Ev = 24: the
  // element-wise tile load and zero padding; 130 rows causal: warps that skip tiles.
  for (const Problem& pb : {Problem{2, 70, 67, 64, 64, false, 1.0f}, Problem{1, 130, 130, 64, 64, true, 1.0f},
                            Problem{3, 70, 45, 40, 24, false, 1.0f}, Problem{1, 129, 129, 40, 48, true, 1.0f},
                            Problem{1, 5, 200, 64, 64, false, 1.0f}, Problem{1, 100, 300, 16, 16, true, 1.0f}}) {
    check_problem(pb);
  }
}

TEST_CASE("the mma attention forward rescales its running sums when a later tile holds the maximum") {
  // Scores spread over ±60: the running maximum moves from tile to tile, and weights far
  // below the maximum underflow to 0 as in the reference.
  check_problem(Problem{1, 64, 256, 64, 64, false, 4.0f});
  check_problem(Problem{2, 80, 200, 32, 64, true, 4.0f});
}

TEST_CASE("the simulated mma is the documented fragment layout") {
  // A and B with distinct small integers (exact in bfloat16 and in every sum): lane l's
  // registers filled from the layout, the product read back from the C layout.
  ma::Lanes<std::uint32_t[4]> a{};
  ma::Lanes<std::uint32_t[2]> b{};
  ma::Lanes<float[4]> d{};
  auto A = [](int r, int c) { return static_cast<float>((r * 3 + c * 5) % 7 - 3); };
  auto B = [](int r, int c) { return static_cast<float>((r * 2 + c * 7) % 5 - 2); };
  auto bits = [](float x) { return dp::BFloat16(x).bits; };
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    a[l][0] = ma::pack(bits(A(g, 2 * t)), bits(A(g, 2 * t + 1)));
    a[l][1] = ma::pack(bits(A(g + 8, 2 * t)), bits(A(g + 8, 2 * t + 1)));
    a[l][2] = ma::pack(bits(A(g, 2 * t + 8)), bits(A(g, 2 * t + 9)));
    a[l][3] = ma::pack(bits(A(g + 8, 2 * t + 8)), bits(A(g + 8, 2 * t + 9)));
    b[l][0] = ma::pack(bits(B(2 * t, g)), bits(B(2 * t + 1, g)));
    b[l][1] = ma::pack(bits(B(2 * t + 8, g)), bits(B(2 * t + 9, g)));
    for (int c = 0; c < 4; ++c) d[l][c] = 1.0f;
  }
  ma::mma(d, a, b);
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int c = 0; c < 4; ++c) {
      const int r = g + 8 * (c / 2), col = 2 * t + c % 2;
      float want = 1.0f;
      for (int kk = 0; kk < 16; ++kk) want += A(r, kk) * B(kk, col);
      CHECK(d[l][c] == want);
    }
  }
}

TEST_CASE("the mma attention backward matches gradients in double: partial tiles, padding, causal") {
  for (const Problem& pb : {Problem{2, 70, 67, 64, 64, false, 1.0f}, Problem{1, 130, 130, 64, 64, true, 1.0f},
                            Problem{2, 70, 45, 40, 24, false, 1.0f}, Problem{1, 129, 140, 40, 48, true, 1.0f},
                            Problem{1, 100, 64, 16, 16, true, 3.0f}}) {
    check_backward(pb);
  }
}
