// The CUDA attention forward on mma fragments (src/backend/mma_attention.h, Note
// [Attention on mma fragments]), tested without a GPU: the kernel's own bodies run here
// for every block, warp and simulated lane, in the kernel's order, against attention
// computed in double from the same bfloat16 inputs.
#include "backend/mma_attention.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
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

/// The kernel's grid, run block by block: what attention_forward_mma_kernel does on a GPU.
void run_forward(const Problem& pb, const ma::Shape& p, const std::vector<std::uint16_t>& q,
                 const std::vector<std::uint16_t>& k, const std::vector<std::uint16_t>& v, std::vector<std::uint16_t>& out,
                 std::vector<float>& lse) {
  std::vector<std::uint16_t> smem(3 * ma::kTileElems);
  std::uint16_t* q_s = smem.data();
  std::uint16_t* k_s = q_s + ma::kTileElems;
  std::uint16_t* v_s = k_s + ma::kTileElems;
  const i64 tiles = (p.L + ma::kTile - 1) / ma::kTile;
  std::vector<ma::WarpState> st(ma::kWarps);
  for (i64 bh = 0; bh < pb.BH; ++bh) {
    const std::uint16_t* qb = q.data() + bh * p.L * p.E;
    const std::uint16_t* kb = k.data() + bh * p.S * p.E;
    const std::uint16_t* vb = v.data() + bh * p.S * p.Ev;
    for (i64 tile = 0; tile < tiles; ++tile) {
      const i64 i0 = tile * ma::kTile;
      ma::load_rows(q_s, qb, i0, p.L, p.E, 0, 1);
      for (int w = 0; w < ma::kWarps; ++w) ma::warp_begin(st[static_cast<std::size_t>(w)], q_s, w);
      const i64 end = ma::keys_end(p, i0);
      for (i64 j0 = 0; j0 < end; j0 += ma::kTile) {
        ma::load_rows(k_s, kb, j0, end, p.E, 0, 1);
        ma::load_rows(v_s, vb, j0, end, p.Ev, 0, 1);
        for (int w = 0; w < ma::kWarps; ++w) {
          const i64 first = i0 + w * ma::kRows;
          if (!ma::warp_skips(p, first, j0)) ma::warp_tile(st[static_cast<std::size_t>(w)], p, k_s, v_s, first, j0);
        }
      }
      for (int w = 0; w < ma::kWarps; ++w)
        ma::warp_finish(st[static_cast<std::size_t>(w)], p, out.data() + bh * p.L * p.Ev, lse.data() + bh * p.L,
                        i0 + w * ma::kRows);
    }
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
