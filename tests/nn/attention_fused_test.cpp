// tests/nn/attention_fused_test.cpp — scaled_dot_product_attention's fused path (Note
// [Fused attention paths] in src/nn/fused_attention.cpp, Note [Fused attention] in
// src/backend/cpu/cpu_attention.cpp) against its math path and against PyTorch: the
// output and every input gradient, causal and not, partial blocks, cross-attention, odd
// head dims, masks; its O(L) memory; the calls it leaves to the math path; bfloat16 and
// float16 against float32 and the math path (Note [16-bit attention tolerances]); and
// dropout: the dropout op's keep bits and rate, the math path's values, reproducibility
// and the backward against central differences.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "attention_reference.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/device.h"
#include "dp/nn/functional.h"
#include "dp/tensor/autocast.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

namespace {

using dp::Shape;
using dp::Tensor;
using dp::nn::AttentionPath;
using nn_test::max_diff;
namespace ref = attention_reference;

/// The attention path for a scope; Auto again after.
struct PathGuard {
  explicit PathGuard(AttentionPath path) { dp::nn::set_attention_path(path); }
  ~PathGuard() { dp::nn::set_attention_path(AttentionPath::Auto); }
  PathGuard(const PathGuard&) = delete;
  PathGuard& operator=(const PathGuard&) = delete;
};

struct Inputs {
  Tensor q, k, v, up, mask;
  bool keep = false;
  bool causal = false;
  std::optional<double> scale;
};

struct Result {
  std::vector<float> out, gq, gk, gv;
};

Tensor leaf(const Tensor& t) { return dp::from_vector(t.to_vector(), t.shape(), t.device()).set_requires_grad(true); }

/// The output and the gradients of q, k, v for the loss sum(out * up), by `path`.
Result attend(AttentionPath path, const Inputs& in) {
  PathGuard guard(path);
  Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, in.mask, 0.0, in.causal, in.scale, in.keep);
  dp::sum(dp::mul(y, in.up)).backward();
  return {y.to_vector(), q.grad().to_vector(), k.grad().to_vector(), v.grad().to_vector()};
}

/// max |a - b| / max |b|: the error normwise, relative to the values' scale.
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double scale = 0;
  for (float x : b) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  return max_diff(a, b) / std::max(scale, 1e-30);
}

// The two paths sum the same products in different orders: the fused one reassociates the
// softmax over 64-key blocks (a running maximum and sum, rescaled by exp(m_old - m_new))
// and its block GEMMs, and forms the backward from Δ = gout·out instead of the softmax
// backward's row sums. Each value is a sum of at most S + E products of O(1) terms, so the
// float32 rounding of the two differs by about (S + E)·2^-24 ≈ 1e-5 of the values' scale
// in the worst case (S = 130 here) and less typically (measured: at most 1.5e-6; the
// check fails at 3e-7).
constexpr double kPathTol = 1e-5;

Tensor cpu_randn(const Shape& shape, dp::Generator& gen) { return dp::randn(shape, gen, dp::cpu(0)); }

Inputs make_inputs(std::int64_t B, std::int64_t H, std::int64_t L, std::int64_t S, std::int64_t E, std::int64_t Ev,
                   bool causal, std::uint64_t seed) {
  dp::Generator gen(seed);
  Shape lead = H > 0 ? Shape{B, H} : Shape{B};  // H = 0: 3-d inputs (B, L, E)
  auto shape = [&](std::int64_t rows, std::int64_t cols) {
    Shape s = lead;
    s.push_back(rows);
    s.push_back(cols);
    return s;
  };
  Inputs in;
  in.q = cpu_randn(shape(L, E), gen);
  in.k = cpu_randn(shape(S, E), gen);
  in.v = cpu_randn(shape(S, Ev), gen);
  in.up = cpu_randn(shape(L, Ev), gen);
  in.causal = causal;
  return in;
}

/// in (B = 2, H = 2, L = 67, S = 90) with a 0/1 keep-mask (B, 1, L, S) drawn from `seed`:
/// about a third of the keys masked, key 0 always kept.
Inputs with_keep_mask(Inputs in, std::uint64_t seed) {
  dp::Generator gen(seed);
  std::vector<float> keep = dp::rand({2, 1, 67, 90}, gen, dp::cpu(0)).to_vector();
  for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = (keep[i] > 0.33f || i % 90 == 0) ? 1.0f : 0.0f;
  in.mask = dp::from_vector(keep, {2, 1, 67, 90}, dp::cpu(0));
  in.keep = true;
  return in;
}

void check_paths_agree(const Inputs& in) {
  const Result math = attend(AttentionPath::Math, in);
  const Result fused = attend(AttentionPath::Fused, in);
  CHECK(rel_diff(fused.out, math.out) < kPathTol);
  CHECK(rel_diff(fused.gq, math.gq) < kPathTol);
  CHECK(rel_diff(fused.gk, math.gk) < kPathTol);
  CHECK(rel_diff(fused.gv, math.gv) < kPathTol);
}

}  // namespace

TEST_CASE("fused attention equals the math path: output and every input gradient") {
  SUBCASE("causal, 130 = 2 blocks + 2 rows, batch and heads > 1") {
    check_paths_agree(make_inputs(2, 3, 130, 130, 8, 8, true, 1));
  }
  SUBCASE("cross-attention: 70 queries, 45 keys, odd head dims E = 5, Ev = 7") {
    check_paths_agree(make_inputs(2, 3, 70, 45, 5, 7, false, 2));
  }
  SUBCASE("causal with fewer queries than keys, and more") {
    check_paths_agree(make_inputs(1, 2, 50, 130, 6, 3, true, 3));
    check_paths_agree(make_inputs(1, 2, 130, 50, 6, 3, true, 4));
  }
  SUBCASE("3-d inputs (B, L, E), one query, an explicit scale") {
    Inputs in = make_inputs(3, 0, 100, 77, 9, 4, false, 5);
    in.scale = 0.3;
    check_paths_agree(in);
    check_paths_agree(make_inputs(2, 0, 1, 65, 3, 2, true, 6));
  }
  SUBCASE("an additive (L, S) mask broadcast over batch and heads") {
    Inputs in = make_inputs(2, 2, 67, 90, 3, 5, false, 7);
    dp::Generator gen(8);
    in.mask = dp::mul(dp::rand({67, 90}, gen, dp::cpu(0)), -3.0);
    check_paths_agree(in);
  }
  SUBCASE("a keep-mask (B, 1, L, S), about a third of the keys masked") {
    check_paths_agree(with_keep_mask(make_inputs(2, 2, 67, 90, 4, 4, false, 9), 10));
  }
}

TEST_CASE("a query whose every key is masked attends to nothing on both paths: zeros, no gradient, PyTorch's numbers") {
  // Note [Rows with every key masked]. Before, its row was NaN, and so was every key's
  // and value's gradient. PyTorch 2.15's F.scaled_dot_product_attention (flash and math
  // alike) of q, k, v (1, 1, 3, 4) = torch.randn after manual_seed(0), the bool mask
  // [[F, F, F], [T, T, F], [T, T, T]], loss out.sum():
  const std::vector<float> q{1.54099607f, -0.29342890f, -2.17878938f, 0.56843126f, -1.08452237f, -1.39859545f,
                             0.40334684f, 0.83802634f, -0.71925759f, -0.40334353f, -0.59663534f, 0.18203649f};
  const std::vector<float> k{-0.85667461f, 1.10060418f, -1.07118738f, 0.12270124f, -0.56631750f, 0.37311465f,
                             -0.89199531f, -1.50910771f, 0.37039354f, 1.45650256f, 0.93980992f, 0.77484882f};
  const std::vector<float> v{0.19186942f, 1.26379478f, -1.29043508f, -0.79110271f, -0.02087947f, -0.71848005f,
                             0.51863676f, -1.31252193f, 0.19199507f, 0.54277134f, -2.21877933f, 0.25898454f};
  const std::vector<float> want_out{0, 0, 0, 0, 1.01141550e-01f, 4.18443382e-01f, -5.18947005e-01f, -1.01346457e+00f,
                                    1.09498352e-01f, 3.81904930e-01f, -7.36896813e-01f, -8.26688230e-01f};
  const std::vector<float> want_gq{0, 0, 0, 0, -3.22201923e-02f, 8.07276666e-02f, -1.98844895e-02f, 1.81077704e-01f,
                                   -4.07774709e-02f, 6.06399402e-02f, -4.03432958e-02f, 1.37788981e-01f};
  const std::vector<float> want_gk{-1.93267733e-01f, -1.96091071e-01f, -1.57307573e-02f, 1.11449204e-01f,
                                   1.84560299e-01f,  1.91208139e-01f,  8.50780308e-03f,  -1.09245442e-01f,
                                   8.70745722e-03f,  4.88294661e-03f,  7.22297095e-03f,  -2.20376533e-03f};
  const std::vector<float> want_gv{1.02786672f, 1.02786672f, 1.02786672f, 1.02786672f, 0.813723862f, 0.813723862f,
                                   0.813723862f, 0.813723862f, 0.158409491f, 0.158409491f, 0.158409491f, 0.158409491f};
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> keep{0, 0, 0, 1, 1, 0, 1, 1, 1};
  const std::vector<float> additive{-inf, -inf, -inf, 0, 0, -inf, 0, 0, 0};  // the same mask, added
  for (const bool is_keep : {true, false}) {
    for (AttentionPath path : {AttentionPath::Math, AttentionPath::Fused}) {
      CAPTURE(is_keep);
      CAPTURE(static_cast<int>(path));
      Inputs in;
      in.q = dp::from_vector(q, {1, 1, 3, 4});
      in.k = dp::from_vector(k, {1, 1, 3, 4});
      in.v = dp::from_vector(v, {1, 1, 3, 4});
      in.up = dp::ones({1, 1, 3, 4});
      in.mask = dp::from_vector(is_keep ? keep : additive, {3, 3});
      in.keep = is_keep;
      const Result r = attend(path, in);
      for (std::size_t i = 0; i < 4; ++i) {
        CHECK(r.out[i] == 0.0f);  // exactly: the row weighs every value 0
        CHECK(r.gq[i] == 0.0f);   // and no gradient flows through it
      }
      CHECK(max_diff(r.out, want_out) < 1e-6);
      CHECK(max_diff(r.gq, want_gq) < 1e-6);
      CHECK(max_diff(r.gk, want_gk) < 1e-6);
      CHECK(max_diff(r.gv, want_gv) < 1e-6);
    }
  }
  // 16-bit calls on the fused kernel too: the row is zeros, the gradients finite.
  for (const dp::Dtype dt : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dt));
    PathGuard guard(AttentionPath::Fused);
    Tensor q16 = dp::from_vector(q, {1, 1, 3, 4}).to(dt).set_requires_grad(true);
    Tensor k16 = dp::from_vector(k, {1, 1, 3, 4}).to(dt).set_requires_grad(true);
    Tensor v16 = dp::from_vector(v, {1, 1, 3, 4}).to(dt).set_requires_grad(true);
    Tensor y = dp::nn::scaled_dot_product_attention(q16, k16, v16, dp::from_vector(keep, {3, 3}), 0.0, false,
                                                    std::nullopt, true);
    dp::sum(y.to(dp::Dtype::Float32)).backward();
    const std::vector<float> out = y.to(dp::Dtype::Float32).to_vector();
    for (std::size_t i = 0; i < 4; ++i) CHECK(out[i] == 0.0f);
    for (const Tensor& g : {q16.grad(), k16.grad(), v16.grad()})
      for (float x : g.to(dp::Dtype::Float32).to_vector()) CHECK(std::isfinite(x));
  }
}

TEST_CASE("fused attention, causal with fewer queries than keys: keys past every query's window take no gradient") {
  // L = 33 < S = 70: query 32 attends keys 0..32, and keys 33.. are attended by none.
  // They hold infinities here; the backward's dS for them was 0 · (dP - delta) with an
  // infinite dP, a NaN in their gk (the CUDA kernel, which skips them, gave 0).
  dp::Generator gen(21);
  Tensor k = cpu_randn({1, 2, 70, 8}, gen), v = cpu_randn({1, 2, 70, 8}, gen);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> kv = k.to_vector(), vv = v.to_vector();
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t j = 33; j < 36; ++j)
      for (std::size_t e = 0; e < 8; ++e) kv[(h * 70 + j) * 8 + e] = vv[(h * 70 + j) * 8 + e] = inf;
  Inputs in;
  in.q = cpu_randn({1, 2, 33, 8}, gen);
  in.k = dp::from_vector(kv, {1, 2, 70, 8});
  in.v = dp::from_vector(vv, {1, 2, 70, 8});
  in.up = cpu_randn({1, 2, 33, 8}, gen);
  in.causal = true;
  const Result r = attend(AttentionPath::Fused, in);
  for (float x : r.out) REQUIRE(std::isfinite(x));
  for (float x : r.gq) CHECK(std::isfinite(x));
  for (std::size_t h = 0; h < 2; ++h)
    for (std::size_t j = 33; j < 70; ++j)
      for (std::size_t e = 0; e < 8; ++e) {
        CHECK(r.gk[(h * 70 + j) * 8 + e] == 0.0f);
        CHECK(r.gv[(h * 70 + j) * 8 + e] == 0.0f);
      }
  // The attended keys' gradients are those of the same call with the unattended keys finite.
  Inputs finite = in;
  finite.k = dp::from_vector(k.to_vector(), {1, 2, 70, 8});
  finite.v = dp::from_vector(v.to_vector(), {1, 2, 70, 8});
  const Result f = attend(AttentionPath::Fused, finite);
  CHECK(r.out == f.out);
  CHECK(r.gq == f.gq);
  CHECK(r.gk == f.gk);
  CHECK(r.gv == f.gv);
}

TEST_CASE("fused attention matches PyTorch's scaled_dot_product_attention across blocks") {
  dp::Device dev = dp::cpu(0);
  auto run = [&](const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                 const std::vector<float>& up, const Shape& qs, const Shape& ks, const Shape& vs, const Tensor& mask,
                 bool causal, std::optional<double> scale) {
    Inputs in{dp::from_vector(q, qs, dev), dp::from_vector(k, ks, dev), dp::from_vector(v, vs, dev),
              dp::from_vector(up, {qs[0], qs[1], qs[2], vs[3]}, dev), mask, false, causal, scale};
    return attend(AttentionPath::Fused, in);
  };
  SUBCASE("causal self-attention, 72 = a block + 8 rows, E = 5") {
    const Shape s{2, 1, 72, 5};
    const Result r = run(ref::kSdpaBlocksQ, ref::kSdpaBlocksK, ref::kSdpaBlocksV, ref::kSdpaBlocksUp, s, s, s,
                         Tensor(), true, std::nullopt);
    CHECK(max_diff(r.out, ref::kSdpaBlocksOut) < 2e-6);
    CHECK(max_diff(r.gq, ref::kSdpaBlocksGradQ) < 1e-5);
    CHECK(max_diff(r.gk, ref::kSdpaBlocksGradK) < 1e-5);
    CHECK(max_diff(r.gv, ref::kSdpaBlocksGradV) < 1e-5);
  }
  SUBCASE("cross-attention, 70 queries over 66 keys, an additive mask, scale 0.4") {
    std::vector<float> mask(70 * 66);
    for (int i = 0; i < 70; ++i)
      for (int j = 0; j < 66; ++j) mask[static_cast<std::size_t>(i * 66 + j)] = -0.5f * static_cast<float>((7 * i + 3 * j) % 5);
    const Result r = run(ref::kSdpaCrossQ, ref::kSdpaCrossK, ref::kSdpaCrossV, ref::kSdpaCrossUp, {1, 1, 70, 3},
                         {1, 1, 66, 3}, {1, 1, 66, 7}, dp::from_vector(mask, {70, 66}, dev), false, 0.4);
    CHECK(max_diff(r.out, ref::kSdpaCrossOut) < 2e-6);
    CHECK(max_diff(r.gq, ref::kSdpaCrossGradQ) < 1e-5);
    CHECK(max_diff(r.gk, ref::kSdpaCrossGradK) < 1e-5);
    CHECK(max_diff(r.gv, ref::kSdpaCrossGradV) < 1e-5);
  }
}

TEST_CASE("fused attention holds O(T) memory: T = 1024 stays far below the (B, H, T, T) weights") {
  const dp::Device dev = dp::cpu(0);
  const std::int64_t B = 1, H = 2, T = 1024, E = 8;
  const Inputs in = make_inputs(B, H, T, T, E, E, true, 12);
  const double weights_bytes = static_cast<double>(B * H * T * T) * sizeof(float);  // 8 MiB
  auto peak_bytes = [&](AttentionPath path) {
    PathGuard guard(path);
    Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
    const std::size_t before = dp::memory_allocated(dev);
    dp::reset_peak_memory(dev);
    Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), 0.0, true);
    dp::sum(dp::mul(y, in.up)).backward();
    return static_cast<double>(dp::max_memory_allocated(dev) - before);
  };
  const double math = peak_bytes(AttentionPath::Math);
  const double fused = peak_bytes(AttentionPath::Fused);
  MESSAGE("peak bytes above the inputs: math path ", math, ", fused ", fused, ", (B, H, T, T) weights ", weights_bytes);
  CHECK(math >= weights_bytes);  // the measure sees the math path's weights
  // The fused path's own: out, lse, the upstream gradient and gq, gk, gv, all O(T).
  CHECK(fused < weights_bytes / 8);
}

// An additive mask that requires a gradient (a learned position bias) takes the math
// path, whose add differentiates it; the fused kernels differentiate q, k and v only and
// once gave such a mask silently no gradient (found by the op fuzzer, Note [Op fuzzer]).
TEST_CASE("fused attention: a mask that requires a gradient takes the math path and gets its gradient") {
  Inputs in = make_inputs(2, 2, 5, 6, 4, 4, false, 21);
  dp::Generator gen(5);
  const Tensor bias = cpu_randn({5, 6}, gen);
  auto run = [&](AttentionPath path, bool learn) {
    PathGuard guard(path);
    Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
    Tensor m = learn ? leaf(bias) : bias;
    Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, m);
    dp::sum(dp::mul(y, in.up)).backward();
    return std::pair<Result, Tensor>{{y.to_vector(), q.grad().to_vector(), k.grad().to_vector(), v.grad().to_vector()},
                                     learn ? m.grad() : Tensor()};
  };
  const auto [math, math_gm] = run(AttentionPath::Math, true);
  const auto [autop, auto_gm] = run(AttentionPath::Auto, true);
  REQUIRE(math_gm.defined());
  REQUIRE(auto_gm.defined());
  CHECK(auto_gm.shape() == Shape{5, 6});
  CHECK(auto_gm.to_vector() == math_gm.to_vector());  // the same path, the same bits
  CHECK(autop.out == math.out);
  // The mask's gradient is the scores' gradient summed over batch and heads: not zero.
  CHECK(nn_test::max_diff(auto_gm.to_vector(), std::vector<float>(30, 0.0f)) > 1e-3);
  {
    PathGuard guard(AttentionPath::Fused);
    Tensor m = leaf(bias);
    CHECK(nn_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, m); },
                               {"set_attention_path", "attn_mask requires a gradient"}));
    dp::NoGradGuard no_grad;  // no gradient wanted: the fused kernel fits
    CHECK(dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, m).to_vector().size() == math.out.size());
  }
  // A mask without a gradient keeps the fused kernel under Auto, to the paths' tolerance.
  const auto [fused, none] = run(AttentionPath::Auto, false);
  CHECK(!none.defined());
  CHECK(rel_diff(fused.gq, math.gq) < kPathTol);
}

TEST_CASE("fused attention: the calls it leaves to the math path, and forcing it on them") {
  Inputs in = make_inputs(2, 2, 5, 6, 4, 4, true, 13);
  auto call = [&](double dropout_p) {
    dp::Generator gen(1);
    return dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, Tensor(), dropout_p, true, std::nullopt, false,
                                                &gen);
  };
  // dropout_p = 1, mixed dtypes, an additive float32 mask over 16-bit q (promoted to a
  // float32 result by the math path) and broadcast batch dims: Fused refuses them.
  {
    PathGuard guard(AttentionPath::Fused);
    CHECK(nn_test::throws_with([&] { (void)call(1.0); }, {"set_attention_path", "dropout_p is 1"}));
    const Tensor qb = in.q.to(dp::Dtype::BFloat16), kb = in.k.to(dp::Dtype::BFloat16);
    CHECK(nn_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(qb, kb, in.v); },
                               {"one floating dtype"}));
    CHECK(nn_test::throws_with(
              [&] {
                (void)dp::nn::scaled_dot_product_attention(qb, kb, in.v.to(dp::Dtype::BFloat16), dp::zeros({5, 6}));
              },
              {"additive float32 mask over 16-bit q"}));
    CHECK(nn_test::throws_with(
              [&] { (void)dp::nn::scaled_dot_product_attention(in.q, in.k.narrow(0, 0, 1), in.v.narrow(0, 0, 1)); },
              {"different batch dims"}));
  }
  // Dropout: Auto runs the fused kernel, which drops the math path's weights and advances
  // the generator as much (Note [Fused attention paths]).
  {
    PathGuard guard(AttentionPath::Auto);
    dp::Generator g1(1), g2(1);
    Tensor a = dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, Tensor(), 0.5, true, std::nullopt, false, &g1);
    dp::nn::set_attention_path(AttentionPath::Math);
    Tensor b = dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, Tensor(), 0.5, true, std::nullopt, false, &g2);
    CHECK(rel_diff(a.to_vector(), b.to_vector()) < kPathTol);
    CHECK(g1.offset() == g2.offset());
  }
  // Bad input gets the math path's errors whichever path is asked for.
  for (AttentionPath path : {AttentionPath::Auto, AttentionPath::Fused}) {
    PathGuard guard(path);
    Tensor q = dp::zeros({2, 5, 4}), k = dp::zeros({2, 5, 4}), v = dp::zeros({2, 5, 3});
    CHECK(nn_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(q, dp::zeros({2, 5, 3}), v); },
                               {"same last dim E"}));
    CHECK(nn_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(q, k, dp::zeros({2, 4, 3})); },
                               {"same number of keys S"}));
    CHECK(nn_test::throws_with(
              [&] { (void)dp::nn::scaled_dot_product_attention(q, k, v, dp::zeros({5, 5}), 0.0, true); },
              {"either attn_mask or is_causal"}));
  }
  // A mask that does not broadcast: Auto gives the math path's broadcast error.
  CHECK_THROWS_AS((void)dp::nn::scaled_dot_product_attention(dp::zeros({2, 5, 4}), dp::zeros({2, 5, 4}),
                                                             dp::zeros({2, 5, 3}), dp::zeros({3, 5, 5})),
                  dp::Error);
}

// ---- 16-bit storage and dropout (Note [Fused attention]) ---------------------------------

namespace {

std::vector<float> values(const Tensor& t) { return t.to(dp::Dtype::Float32).to_vector(); }

/// attend() with q, k, v, up (and a mask of q's dtype unless it is a float32 keep-mask)
/// in `dtype`, and dropout_p drawn from a generator seeded `seed`; every result widened.
Result attend_as(AttentionPath path, const Inputs& in, dp::Dtype dtype, double dropout_p = 0.0,
                 std::uint64_t seed = 0) {
  PathGuard guard(path);
  auto leaf_as = [&](const Tensor& t) { return leaf(t).detach().to(dtype).set_requires_grad(true); };
  Tensor q = leaf_as(in.q), k = leaf_as(in.k), v = leaf_as(in.v);
  Tensor mask = in.mask.defined() && !in.keep ? in.mask.to(dtype) : in.mask;
  dp::Generator gen(seed);
  Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, mask, dropout_p, in.causal, in.scale, in.keep, &gen);
  REQUIRE(y.dtype() == dtype);
  dp::sum(dp::mul(y, in.up.to(dtype))).backward();
  REQUIRE(q.grad().dtype() == dtype);
  return {values(y), values(q.grad()), values(k.grad()), values(v.grad())};
}

/// in with q, k, v, up and an additive mask rounded to `dtype` (kept float32): the values
/// both a 16-bit and a float32 call see exactly.
Inputs representable(Inputs in, dp::Dtype dtype) {
  for (Tensor* t : {&in.q, &in.k, &in.v, &in.up}) *t = t->to(dtype).to(dp::Dtype::Float32);
  if (in.mask.defined() && !in.keep) in.mask = in.mask.to(dtype).to(dp::Dtype::Float32);
  return in;
}

double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float x : a) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

/// The unit roundoff of a 16-bit dtype, half the spacing of its values in [1, 2):
/// bfloat16 keeps 8 significant bits (spacing 2^-7, u = 2^-8), float16 11 (2^-10, 2^-11).
double unit_roundoff(dp::Dtype dtype) { return dtype == dp::Dtype::BFloat16 ? 0x1p-8 : 0x1p-11; }

/// The weights P (B..., L, S) of a float32 call by the math path: attention over the
/// identity matrix as v.
Tensor weights_of(const Inputs& in) {
  PathGuard guard(AttentionPath::Math);
  const std::int64_t S = in.k.size(-2);
  std::vector<float> eye(static_cast<std::size_t>(S * S), 0.0f);
  for (std::int64_t j = 0; j < S; ++j) eye[static_cast<std::size_t>(j * S + j)] = 1.0f;
  Shape vs = in.k.shape();
  vs.back() = S;
  Tensor v = dp::add(dp::zeros(vs), dp::from_vector(eye, {S, S}));
  return dp::nn::scaled_dot_product_attention(in.q, in.k, v, in.mask, 0.0, in.causal, in.scale, in.keep);
}

// Note [16-bit attention tolerances]
// On inputs that `dtype` represents exactly, the fused kernel in 16 bits computes what it
// computes in float32 (the same float32 operations on the same widened values) except:
// (1) out, gq, gk, gv are rounded once when stored: at most u·|x| each (u: unit
//     roundoff); (2) the backward's Δ_i = Σ_e gout_ie·out_ie reads the rounded out, off
//     by at most u·D_i with D_i = Σ_e |gout_ie·out_ie|. Δ enters dS_ij = P_ij (dP_ij − Δ_i),
//     so dQ_i = scale·Σ_j dS_ij k_j moves by at most scale·u·D_i·max|k| (the P_ij of a row
//     sum to 1) and dK_j = scale·Σ_i dS_ij q_i by at most scale·u·max D·max|q|·Σ_i P_ij;
//     out and dV do not read Δ. Normwise (relative to the float32 result's largest
//     element) the bounds are u plus those terms over max|x|, plus kPathTol for float32's
//     own reassociation noise between the two runs' GEMMs.
void check_16bit(const Inputs& raw, dp::Dtype dtype) {
  const Inputs in = representable(raw, dtype);
  const double u = unit_roundoff(dtype);
  const Result f32 = attend(AttentionPath::Fused, in);
  const Result fused = attend_as(AttentionPath::Fused, in, dtype);
  const Result math = attend_as(AttentionPath::Math, in, dtype);
  const double scale = in.scale ? *in.scale : 1.0 / std::sqrt(static_cast<double>(in.q.size(-1)));
  double max_d = 0;
  for (std::size_t r = 0; r * static_cast<std::size_t>(in.v.size(-1)) < f32.out.size(); ++r) {
    double d = 0;
    const std::vector<float> up = in.up.to_vector();
    for (std::size_t e = 0; e < static_cast<std::size_t>(in.v.size(-1)); ++e) {
      const std::size_t at = r * static_cast<std::size_t>(in.v.size(-1)) + e;
      d += std::fabs(static_cast<double>(up[at]) * f32.out[at]);
    }
    max_d = std::max(max_d, d);
  }
  const double max_col = max_abs(dp::sum(weights_of(in), -2).to_vector());  // max_j Σ_i P_ij
  const double tol_out = u + kPathTol;
  const double tol_gq = u + scale * u * max_d * max_abs(in.k.to_vector()) / max_abs(f32.gq) + kPathTol;
  const double tol_gk = u + scale * u * max_d * max_abs(in.q.to_vector()) * max_col / max_abs(f32.gk) + kPathTol;
  const std::string name = dp::dtype_name(dtype);
  CAPTURE(name);
  CHECK(rel_diff(fused.out, f32.out) <= tol_out);
  CHECK(rel_diff(fused.gv, f32.gv) <= tol_out);
  CHECK(rel_diff(fused.gq, f32.gq) <= tol_gq);
  CHECK(rel_diff(fused.gk, f32.gk) <= tol_gk);
  // The math path in 16 bits also stores its scores (|s| up to ~4 here, so exp(s - m)
  // moves by up to ~8u), its weights and dP in 16 bits, besides the final rounding: it
  // stays within ~10u of float32 in the output (measured: up to 2.6u) and the fused
  // kernel within u; the gradients take one more rounded product each. 16u and 32u
  // bound the distance between the two with room, and fail when either path is off by
  // more than rounding (a dropped mask, a wrong block, a gradient lost: ~1 of the scale).
  MESSAGE(name, ": fused ", rel_diff(fused.out, f32.out), " ", rel_diff(fused.gq, f32.gq), ", math ",
          rel_diff(math.out, f32.out), " ", rel_diff(math.gq, f32.gq), " of the float32 scale");
  CHECK(rel_diff(math.out, fused.out) < 16 * u);
  CHECK(rel_diff(math.gq, fused.gq) < 32 * u);
  CHECK(rel_diff(math.gk, fused.gk) < 32 * u);
  CHECK(rel_diff(math.gv, fused.gv) < 16 * u);
}

}  // namespace

TEST_CASE("fused attention in bfloat16 and float16: float32 inside, one rounding on store") {
  const dp::Dtype dtypes[] = {dp::Dtype::BFloat16, dp::Dtype::Float16};
  SUBCASE("causal, 130 = 2 blocks + 2 rows") {
    for (dp::Dtype dtype : dtypes) check_16bit(make_inputs(2, 3, 130, 130, 8, 8, true, 21), dtype);
  }
  SUBCASE("cross-attention 70 x 45, odd head dims") {
    for (dp::Dtype dtype : dtypes) check_16bit(make_inputs(2, 3, 70, 45, 5, 7, false, 22), dtype);
  }
  SUBCASE("causal with fewer queries than keys") {
    for (dp::Dtype dtype : dtypes) check_16bit(make_inputs(1, 2, 50, 130, 6, 3, true, 29), dtype);
  }
  SUBCASE("an additive mask of q's dtype, (L, S) broadcast") {
    Inputs in = make_inputs(2, 2, 67, 90, 3, 5, false, 23);
    dp::Generator gen(24);
    in.mask = dp::mul(dp::rand({67, 90}, gen, dp::cpu(0)), -3.0);
    for (dp::Dtype dtype : dtypes) check_16bit(in, dtype);
  }
  SUBCASE("a float32 keep-mask (B, 1, L, S)") {
    const Inputs in = with_keep_mask(make_inputs(2, 2, 67, 90, 4, 4, false, 25), 26);
    for (dp::Dtype dtype : dtypes) check_16bit(in, dtype);
  }
}

TEST_CASE("fused attention under bfloat16 autocast takes the fused kernel, also with a mask") {
  Inputs in = make_inputs(2, 2, 70, 70, 8, 8, false, 27);
  dp::Generator mask_gen(28);
  in.mask = dp::mul(dp::rand({70, 70}, mask_gen, dp::cpu(0)), -2.0);
  PathGuard guard(AttentionPath::Fused);  // throws if the call does not fit the kernel
  Tensor q = leaf(in.q);
  Tensor y;
  {
    dp::amp::autocast cast(dp::Dtype::BFloat16);
    y = dp::nn::scaled_dot_product_attention(q, in.k, in.v, in.mask);
  }
  CHECK(y.dtype() == dp::Dtype::BFloat16);
  dp::sum(dp::mul(y.to(dp::Dtype::Float32), in.up)).backward();
  CHECK(q.grad().dtype() == dp::Dtype::Float32);
  const Result f32 = attend(AttentionPath::Fused, in);
  CHECK(rel_diff(values(y), f32.out) < 4 * unit_roundoff(dp::Dtype::BFloat16));  // inputs rounded, then out
}

TEST_CASE("fused attention with dropout: the dropout op's keep bits, regenerated in the backward") {
  const double p = 0.3;
  SUBCASE("each weight kept with probability 1 - p, the bits the dropout op draws") {
    // q = 0 gives every key the weight 1/S, and v = I (Ev = S) copies the weights out:
    // out[i, j] = Z_ij / S with Z_ij = keep_ij / (1 - p).
    const std::int64_t B = 2, H = 2, L = 100, S = 70;
    dp::Generator key_gen(3);
    Tensor q = dp::zeros({B, H, L, 4}), k = dp::randn({B, H, S, 4}, key_gen);
    std::vector<float> eye(static_cast<std::size_t>(S * S), 0.0f);
    for (std::int64_t j = 0; j < S; ++j) eye[static_cast<std::size_t>(j * S + j)] = 1.0f;
    Tensor v = dp::add(dp::zeros({B, H, S, S}), dp::from_vector(eye, {S, S}));
    PathGuard guard(AttentionPath::Fused);
    dp::Generator gen(41);
    gen.advance(12345);  // a generator in the middle of its stream
    dp::Generator same = gen;
    const std::vector<float> out = dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), p, false, std::nullopt,
                                                                       false, &gen)
                                       .to_vector();
    const std::vector<float> drop = dp::nn::dropout(dp::ones({B, H, L, S}), p, true, same).to_vector();
    CHECK(gen.offset() == same.offset());  // advanced by B·H·L·S, as the dropout op
    std::size_t kept = 0, wrong = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const bool keep = out[i] != 0.0f;
      kept += keep;
      wrong += keep != (drop[i] != 0.0f);
      if (keep) CHECK(std::fabs(out[i] * S * (1 - p) - 1.0) < 1e-5);
    }
    CHECK(wrong == 0);
    // Binomial(n, 1 - p): the kept fraction within 5 standard deviations of 1 - p.
    const double n = static_cast<double>(out.size()), rate = static_cast<double>(kept) / n;
    CHECK(std::fabs(rate - (1 - p)) < 5 * std::sqrt(p * (1 - p) / n));
  }
  SUBCASE("the math path given the same generator drops the same weights: output and gradients agree") {
    for (const Inputs& in : {make_inputs(2, 3, 130, 130, 8, 8, true, 31), make_inputs(2, 2, 70, 45, 5, 7, false, 32)}) {
      for (dp::Dtype dtype : {dp::Dtype::Float32, dp::Dtype::BFloat16}) {
        const std::string name = dp::dtype_name(dtype);
        CAPTURE(name);
        const Result math = attend_as(AttentionPath::Math, in, dtype, p, 99);
        const Result fused = attend_as(AttentionPath::Fused, in, dtype, p, 99);
        const Result plain = attend_as(AttentionPath::Fused, in, dtype, 0.0, 99);
        // float32: the paths' reassociation only; bfloat16: as check_16bit's math-vs-fused bound.
        const double tol = dtype == dp::Dtype::Float32 ? kPathTol : 32 * unit_roundoff(dtype);
        CHECK(rel_diff(fused.out, math.out) < tol);
        CHECK(rel_diff(fused.gq, math.gq) < tol);
        CHECK(rel_diff(fused.gk, math.gk) < tol);
        CHECK(rel_diff(fused.gv, math.gv) < tol);
        CHECK(rel_diff(fused.out, plain.out) > 0.05);  // dropout did drop
        const Result again = attend_as(AttentionPath::Fused, in, dtype, p, 99);  // reproducible
        CHECK(nn_test::bitwise_equal(again.out, fused.out));
        CHECK(nn_test::bitwise_equal(again.gq, fused.gq));
        CHECK(nn_test::bitwise_equal(again.gk, fused.gk));
        CHECK(nn_test::bitwise_equal(again.gv, fused.gv));
        const Result other = attend_as(AttentionPath::Fused, in, dtype, p, 100);
        CHECK(rel_diff(other.out, fused.out) > 0.05);  // another seed, other masks
      }
    }
  }
  SUBCASE("the backward is the forward's gradient: central differences under a fixed generator state") {
    const Inputs in = make_inputs(1, 2, 70, 66, 3, 4, true, 33);
    const Result fused = attend_as(AttentionPath::Fused, in, dp::Dtype::Float32, p, 7);
    PathGuard guard(AttentionPath::Fused);
    auto loss = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      dp::Generator gen(7);  // the same masks in every evaluation
      Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), p, true, std::nullopt, false, &gen);
      return static_cast<double>(dp::sum(dp::mul(y, in.up)).item());
    };
    const double h = 1e-2;  // float32 loss of ~1e2: rounding 1e-5 over 2h, truncation h²·f''' ~ 1e-4
    for (int which = 0; which < 3; ++which) {
      const Tensor& base = which == 0 ? in.q : which == 1 ? in.k : in.v;
      const std::vector<float>& grad = which == 0 ? fused.gq : which == 1 ? fused.gk : fused.gv;
      for (std::size_t at : {std::size_t{0}, std::size_t{77}, grad.size() - 5}) {
        std::vector<float> plus = base.to_vector(), minus = plus;
        plus[at] += static_cast<float>(h);
        minus[at] -= static_cast<float>(h);
        auto with = [&](const std::vector<float>& x) {
          const Tensor t = dp::from_vector(x, base.shape());
          return loss(which == 0 ? t : in.q, which == 1 ? t : in.k, which == 2 ? t : in.v);
        };
        const double fd = (with(plus) - with(minus)) / (2 * h);
        CAPTURE(which);
        CAPTURE(at);
        CHECK(std::fabs(fd - grad[at]) < 2e-2 * std::max(1.0, std::fabs(fd)));
      }
    }
  }
}
