// tests/nn/attention_fused_test.cpp — scaled_dot_product_attention's fused path (Note
// [Fused attention paths] in src/nn/fused_attention.cpp, Note [Fused attention] in
// src/backend/cpu/cpu_attention.cpp) against its math path and against PyTorch: the
// output and every input gradient, causal and not, partial blocks, cross-attention, odd
// head dims, masks; its O(L) memory; and the calls it leaves to the math path.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attention_reference.h"
#include "dp/core/device.h"
#include "dp/nn/functional.h"
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
    Inputs in = make_inputs(2, 2, 67, 90, 4, 4, false, 9);
    dp::Generator gen(10);
    std::vector<float> keep = dp::rand({2, 1, 67, 90}, gen, dp::cpu(0)).to_vector();
    for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = (keep[i] > 0.33f || i % 90 == 0) ? 1.0f : 0.0f;
    in.mask = dp::from_vector(keep, {2, 1, 67, 90}, dp::cpu(0));
    in.keep = true;
    check_paths_agree(in);
  }
}

TEST_CASE("fused attention: a query whose every key is masked gives NaN, as the math path") {
  Inputs in = make_inputs(1, 1, 3, 4, 2, 2, false, 11);
  std::vector<float> keep(12, 1.0f);
  for (int j = 0; j < 4; ++j) keep[static_cast<std::size_t>(4 + j)] = 0.0f;  // query 1 attends to nothing
  in.mask = dp::from_vector(keep, {3, 4}, dp::cpu(0));
  in.keep = true;
  for (AttentionPath path : {AttentionPath::Math, AttentionPath::Fused}) {
    const Result r = attend(path, in);
    CHECK(std::isnan(r.out[2]));
    CHECK(std::isnan(r.out[3]));
    CHECK(std::isfinite(r.out[0]));
    CHECK(std::isfinite(r.out[5]));
  }
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

TEST_CASE("fused attention: the calls it leaves to the math path, and forcing it on them") {
  Inputs in = make_inputs(2, 2, 5, 6, 4, 4, true, 13);
  auto call = [&](double dropout_p) {
    dp::Generator gen(1);
    return dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, Tensor(), dropout_p, true, std::nullopt, false,
                                                &gen);
  };
  // Dropout: Auto runs the math path (its generator use unchanged); Fused refuses it.
  {
    PathGuard guard(AttentionPath::Fused);
    CHECK(nn_test::throws_with([&] { (void)call(0.5); }, {"set_attention_path", "dropout_p is not 0"}));
    CHECK(nn_test::throws_with(
              [&] {
                (void)dp::nn::scaled_dot_product_attention(in.q.to(dp::Dtype::BFloat16), in.k.to(dp::Dtype::BFloat16),
                                                           in.v.to(dp::Dtype::BFloat16));
              },
              {"not all float32"}));
    CHECK(nn_test::throws_with(
              [&] { (void)dp::nn::scaled_dot_product_attention(in.q, in.k.narrow(0, 0, 1), in.v.narrow(0, 0, 1)); },
              {"different batch dims"}));
  }
  {
    PathGuard guard(AttentionPath::Auto);
    dp::Generator g1(1), g2(1);
    Tensor a = dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, Tensor(), 0.5, true, std::nullopt, false, &g1);
    dp::nn::set_attention_path(AttentionPath::Math);
    Tensor b = dp::nn::scaled_dot_product_attention(in.q, in.k, in.v, Tensor(), 0.5, true, std::nullopt, false, &g2);
    CHECK(nn_test::bitwise_equal(a.to_vector(), b.to_vector()));
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
