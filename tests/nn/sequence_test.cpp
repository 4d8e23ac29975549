// tests/nn/sequence_test.cpp — the sequence-model ops and layers against PyTorch
// (sequence_reference.h): softmax / log_softmax along a dim, layer_norm, embedding with
// padding_idx, Linear over (B, T, C); the layers' parameters and state-dict names; bad
// input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/nn/activation.h"
#include "dp/nn/embedding.h"
#include "dp/nn/functional.h"
#include "dp/nn/linear.h"
#include "dp/nn/normalization.h"
#include "dp/tensor/autocast.h"
#include "dp/tensor/ops.h"
#include "nn/embedding_rows.h"
#include "sequence_reference.h"
#include "nn_test_util.h"
#include "test_errors.h"

namespace {

using dp::Shape;
using dp::Tensor;
namespace ref = sequence_reference;

double max_diff(const Tensor& t, const std::vector<float>& want) { return nn_test::max_diff(t.to_vector(), want); }

// sum(f(x) * up) backward; returns f(x) and x's gradient.
std::pair<Tensor, Tensor> run(const std::vector<float>& x, const Shape& shape, const std::vector<float>& up,
                              const auto& f) {
  Tensor leaf = dp::from_vector(x, shape).set_requires_grad(true);
  Tensor y = f(leaf);
  dp::sum(dp::mul(y, dp::from_vector(up, y.shape()))).backward();
  return {y, leaf.grad()};
}

}  // namespace

TEST_CASE("softmax and log_softmax along any dim match PyTorch") {
  auto [s1, g1] = run(ref::kSoftmaxX, {2, 3, 4}, ref::kSoftmaxUp, [](const Tensor& x) { return dp::nn::softmax(x, 1); });
  CHECK(max_diff(s1, ref::kSoftmax1Out) < 1e-6);
  CHECK(max_diff(g1, ref::kSoftmax1Grad) < 1e-6);
  auto [l0, h0] = run(ref::kSoftmaxX, {2, 3, 4}, ref::kSoftmaxUp, [](const Tensor& x) { return dp::nn::log_softmax(x, 0); });
  CHECK(max_diff(l0, ref::kLogSoftmax0Out) < 1e-5);
  CHECK(max_diff(h0, ref::kLogSoftmax0Grad) < 1e-5);
  auto [sl, gl] = run(ref::kSoftmaxX, {2, 3, 4}, ref::kSoftmaxUp, [](const Tensor& x) { return dp::nn::softmax(x, -1); });
  CHECK(max_diff(sl, ref::kSoftmaxLastOut) < 1e-6);
  CHECK(max_diff(gl, ref::kSoftmaxLastGrad) < 1e-6);
  // Rows sum to one; huge logits stay finite (max subtracted).
  Tensor big = dp::from_vector(std::vector<float>{1000, 1001, 999, -1000}, {2, 2});
  Tensor p = dp::nn::softmax(big, 1);
  const std::vector<float> pv = p.to_vector();
  CHECK(std::isfinite(pv[0]));
  CHECK(std::fabs(pv[0] + pv[1] - 1.0f) < 1e-6);
  CHECK(dp::nn::softmax(big, 0).shape() == Shape{2, 2});
}

TEST_CASE("layer_norm matches PyTorch: output and the gradients of input, weight and bias") {
  Tensor w = dp::from_vector(ref::kLayerNormW, {8}).set_requires_grad(true);
  Tensor b = dp::from_vector(ref::kLayerNormB, {8}).set_requires_grad(true);
  auto [y, gx] = run(ref::kLayerNormX, {2, 3, 8}, ref::kLayerNormUp,
                     [&](const Tensor& x) { return dp::nn::layer_norm(x, {8}, w, b, 1e-5); });
  CHECK(max_diff(y, ref::kLayerNormOut) < 2e-6);
  CHECK(max_diff(gx, ref::kLayerNormGradX) < 1e-5);
  CHECK(max_diff(w.grad(), ref::kLayerNormGradW) < 1e-5);
  CHECK(max_diff(b.grad(), ref::kLayerNormGradB) < 1e-5);

  // The module: PyTorch's parameter names, ones and zeros to start, the same output.
  dp::nn::LayerNorm ln(Shape{8});
  const auto sd = ln.state_dict();
  REQUIRE(sd.size() == 2);
  CHECK(sd[0].first == "weight");
  CHECK(sd[1].first == "bias");
  CHECK(dp::sum(ln.weight()).item() == 8.0f);
  CHECK(dp::sum(dp::abs(ln.bias())).item() == 0.0f);
  {
    dp::NoGradGuard no_grad;  // parameters are written as in PyTorch, without grad mode
    ln.weight().copy_(dp::from_vector(ref::kLayerNormW, {8}));
    ln.bias().copy_(dp::from_vector(ref::kLayerNormB, {8}));
  }
  CHECK(max_diff(ln(dp::from_vector(ref::kLayerNormX, {2, 3, 8})), ref::kLayerNormOut) < 2e-6);
  CHECK(dp::nn::LayerNorm(dp::nn::LayerNormOptions({8}).bias(false)).state_dict().size() == 1);
  CHECK(dp::nn::LayerNorm(dp::nn::LayerNormOptions({8}).elementwise_affine(false)).state_dict().empty());
  CHECK(ln.name() == "LayerNorm([8], eps=1e-05, elementwise_affine=true)");
}

TEST_CASE("layer_norm is one op each way (float32): the composed formula's values and gradients, every shape") {
  // The composed formula layer_norm ran before Note [Fused LayerNorm], in tensor ops.
  auto composed = [](const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
    const std::int64_t cols = x.size(x.dim() - 1);
    Tensor xr = x.reshape({x.numel() / cols, cols});
    Tensor c = dp::sub(xr, dp::mean(xr, 1, true));
    Tensor y = dp::div(c, dp::sqrt(dp::add(dp::mean(dp::mul(c, c), 1, true), eps)));
    if (w.defined()) y = dp::mul(y, w);
    if (b.defined()) y = dp::add(y, b);
    return y.reshape(x.shape());
  };
  auto max_abs = [](const Tensor& a, const Tensor& b) { return static_cast<float>(max_diff(a, b.to_vector())); };
  dp::Generator gen(11);
  struct Case {
    Shape shape;
    bool weight, bias;
  };
  // Rows past one backward block of 64 and several; widths with a lane tail; no rows.
  for (const Case& c : {Case{{300, 127}, true, true}, Case{{4, 50, 48}, true, false}, Case{{129, 16}, false, true},
                        Case{{70, 33}, false, false}, Case{{5, 1}, true, true}, Case{{0, 8}, true, true}}) {
    const std::int64_t cols = c.shape.back();
    INFO("shape ", dp::shape_str(c.shape), " weight ", c.weight, " bias ", c.bias);
    Tensor x0 = dp::add(dp::mul(dp::randn(c.shape, gen), 3.0), 0.5);
    Tensor up = dp::randn(c.shape, gen);
    Tensor w0 = c.weight ? dp::add(dp::randn({cols}, gen), 1.0) : Tensor();
    Tensor b0 = c.bias ? dp::randn({cols}, gen) : Tensor();
    auto run = [&](bool fused) {
      Tensor x = x0.detach().clone().set_requires_grad(true);
      Tensor w = w0.defined() ? w0.detach().clone().set_requires_grad(true) : Tensor();
      Tensor b = b0.defined() ? b0.detach().clone().set_requires_grad(true) : Tensor();
      Tensor y = fused ? dp::nn::layer_norm(x, {cols}, w, b, 1e-5) : composed(x, w, b, 1e-5);
      if (fused && x.dim() == 2) CHECK(y.grad_fn()->name() == "NativeLayerNormBackward");
      dp::sum(dp::mul(y, up)).backward();
      return std::vector<Tensor>{y, x.grad(), w.defined() ? w.grad() : Tensor(), b.defined() ? b.grad() : Tensor()};
    };
    const auto f = run(true), r = run(false);
    if (c.shape[0] == 0) {
      CHECK(f[0].numel() == 0);
      if (c.weight) CHECK(dp::sum(dp::abs(f[2])).item() == 0.0f);
      continue;
    }
    CHECK(max_abs(f[0], r[0]) < 2e-6f * 4);   // |y| up to ~4: a few float32 roundings
    CHECK(max_abs(f[1], r[1]) < 2e-5f);
    if (c.weight) CHECK(max_abs(f[2], r[2]) < 1e-4f);  // sums over up to 300 rows
    if (c.bias) CHECK(max_abs(f[3], r[3]) < 1e-4f);
    // The same call twice gives the same bits (a fixed summation order).
    const auto again = run(true);
    CHECK(max_abs(f[1], again[1]) == 0.0f);
    if (c.weight) CHECK(max_abs(f[2], again[2]) == 0.0f);
  }
}

TEST_CASE("embedding rows gathered on the device: in-range rows bit for bit, NaN rows for bad ids, no host read") {
  // Note [Embedding ids without a host read]: the path a GPU's ids take, run here on the
  // CPU (embedding() itself reads CPU ids on the host and throws on a bad one).
  Tensor w = dp::from_vector(ref::kEmbeddingWeight, {7, 3});
  CHECK_FALSE(dp::nn::detail::embedding_ids_on_device(dp::zeros({4}, dp::TensorOptions{dp::Dtype::Int64}), 7));
  const std::vector<std::int64_t> ids{3, -1, 6, 7, 0, std::int64_t{1} << 40, 2, -(std::int64_t{1} << 50)};
  for (const dp::Dtype dtype : {dp::Dtype::Float32, dp::Dtype::BFloat16}) {
    CAPTURE(dp::dtype_name(dtype));
    const Tensor wd = w.to(dtype);
    Tensor gathered;
    const Tensor rows =
        dp::nn::detail::embedding_rows_on_device(wd, dp::from_vector(ids, {8}), gathered).to(dp::Dtype::Float32);
    CHECK(rows.shape() == Shape{8, 3});
    CHECK(gathered.to_vector_i64() == std::vector<std::int64_t>{3, 0, 6, 0, 0, 0, 2, 0});
    const Tensor table = wd.to(dp::Dtype::Float32);
    for (std::int64_t i = 0; i < 8; ++i) {
      const std::int64_t id = ids[static_cast<std::size_t>(i)];
      const std::vector<float> got = rows.narrow(0, i, 1).to_vector();
      if (id >= 0 && id < 7) {
        CHECK(got == table.narrow(0, id, 1).to_vector());
      } else {
        for (float v : got) CHECK(std::isnan(v));
      }
    }
  }
  // Ids on another device than the table: refused before any gather, on every path.
  CHECK(dp_test::throws_with([&] { (void)dp::nn::embedding(dp::zeros({2}, dp::TensorOptions{dp::Dtype::Int64, dp::cpu(1)}), w); },
                             {"embedding: expected ids on the weight's device cpu:0", "cpu:1"}));
  // An empty table gathers nothing on the device; embedding() refuses its ids on the host.
  CHECK_FALSE(dp::nn::detail::embedding_ids_on_device(dp::zeros({1}, dp::TensorOptions{dp::Dtype::Int64}), 0));
  CHECK(dp_test::throws_with([] { (void)dp::nn::embedding(dp::zeros({1}, dp::TensorOptions{dp::Dtype::Int64}), dp::zeros({0, 3})); },
                             {"out of bounds"}));
  // A table too tall for float32 ids is refused (embedding() reads those on the host).
  Tensor gathered;
  CHECK(dp_test::throws_with(
      [&] { (void)dp::nn::detail::embedding_rows_on_device(dp::zeros({(1 << 24) + 1, 1}), dp::zeros({1}, dp::TensorOptions{dp::Dtype::Int64}), gathered); },
      {"16777217 rows", "float32"}));
  CHECK(dp_test::throws_with(
      [&] { (void)dp::nn::detail::embedding_rows_on_device(dp::zeros({0, 3}), dp::zeros({1}, dp::TensorOptions{dp::Dtype::Int64}), gathered); },
      {"got 0 rows"}));
}

TEST_CASE("embedding matches PyTorch; the padding row gets no gradient") {
  Tensor w = dp::from_vector(ref::kEmbeddingWeight, {7, 3}).set_requires_grad(true);
  Tensor ids = dp::from_vector(ref::kEmbeddingIds, {2, 3});
  Tensor y = dp::nn::embedding(ids, w, 2);
  CHECK(y.shape() == Shape{2, 3, 3});
  CHECK(max_diff(y, ref::kEmbeddingOut) == 0);
  dp::sum(dp::mul(y, dp::from_vector(ref::kEmbeddingUp, {2, 3, 3}))).backward();
  CHECK(max_diff(w.grad(), ref::kEmbeddingGrad) == 0);  // sums of the same values in the same order
  // Without padding_idx row 2 gets its gradient; a negative padding_idx counts from the end.
  Tensor w2 = dp::from_vector(ref::kEmbeddingWeight, {7, 3}).set_requires_grad(true);
  dp::sum(dp::nn::embedding(ids, w2)).backward();
  CHECK(w2.grad().narrow(0, 2, 1).sum().item() == 3.0f);
  Tensor w3 = dp::from_vector(ref::kEmbeddingWeight, {7, 3}).set_requires_grad(true);
  dp::sum(dp::nn::embedding(ids, w3, -2)).backward();  // row 5
  CHECK(w3.grad().narrow(0, 5, 1).sum().item() == 0.0f);
  CHECK(w3.grad().narrow(0, 2, 1).sum().item() == 3.0f);

  // The module: N(0, 1) rows, the padding row zeroed, PyTorch's parameter name.
  dp::Generator gen(7);
  dp::nn::Embedding emb(dp::nn::EmbeddingOptions(50, 16).padding_idx(0), &gen);
  REQUIRE(emb.state_dict().size() == 1);
  CHECK(emb.state_dict()[0].first == "weight");
  CHECK(emb.weight().shape() == Shape{50, 16});
  CHECK(dp::sum(dp::abs(emb.weight().narrow(0, 0, 1))).item() == 0.0f);
  const std::vector<float> wv = emb.weight().to_vector();
  double mean = 0, sq = 0;
  for (std::size_t i = 16; i < wv.size(); ++i) {
    mean += wv[i];
    sq += double(wv[i]) * wv[i];
  }
  mean /= double(wv.size() - 16);
  CHECK(std::fabs(mean) < 0.15);
  CHECK(std::fabs(sq / double(wv.size() - 16) - 1.0) < 0.2);
  CHECK(emb(dp::from_vector(std::vector<std::int64_t>{3, 0}, {2})).shape() == Shape{2, 16});
  CHECK(emb.name() == "Embedding(50, 16, padding_idx=0)");
}

TEST_CASE("Linear applies over the last dim of (B, T, C), as PyTorch's") {
  dp::nn::Linear lin(4, 5);
  Tensor weight = lin.weight();  // a handle: copy_ writes the parameter
  {
    dp::NoGradGuard no_grad;
    weight.copy_(dp::from_vector(ref::kLinear3dW, {5, 4}));
    lin.bias().copy_(dp::from_vector(ref::kLinear3dB, {5}));
  }
  auto [y, gx] = run(ref::kLinear3dX, {2, 3, 4}, ref::kLinear3dUp, [&](const Tensor& x) { return lin(x); });
  CHECK(y.shape() == Shape{2, 3, 5});
  CHECK(max_diff(y, ref::kLinear3dOut) < 1e-6);
  CHECK(max_diff(gx, ref::kLinear3dGradX) < 1e-6);
  CHECK(max_diff(lin.weight().grad(), ref::kLinear3dGradW) < 1e-5);
  CHECK(max_diff(lin.bias().grad(), ref::kLinear3dGradB) < 1e-5);
  CHECK(lin(dp::zeros({4})).shape() == Shape{5});
}

TEST_CASE("sequence ops: bad input") {
  Tensor x = dp::zeros({2, 3});
  CHECK(dp_test::throws_with([&] { (void)dp::nn::softmax(x, 2); }, {"softmax: expected a dim in [-2, 2), got 2"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::layer_norm(x, {4}); }, {"trailing dims are normalized_shape [4]"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::layer_norm(x, {3}, dp::ones({4})); }, {"weight of shape [3]"}));
  Tensor w = dp::zeros({5, 2});
  CHECK(dp_test::throws_with([&] { (void)dp::nn::embedding(x, w); }, {"int64 or int32 ids"}));
  Tensor ids = dp::from_vector(std::vector<std::int64_t>{1, 5}, {2});
  CHECK(dp_test::throws_with([&] { (void)dp::nn::embedding(ids, w); }, {"5"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::embedding(ids.narrow(0, 0, 1), w, 5); }, {"padding_idx in [-5, 5), got 5"}));
  CHECK(dp_test::throws_with([] { dp::nn::Embedding e(0, 3); }, {"positive num_embeddings"}));
  CHECK(dp_test::throws_with([] { dp::nn::LayerNorm l(Shape{}); }, {"non-empty normalized_shape"}));
  dp::nn::Linear lin(4, 5);
  CHECK(dp_test::throws_with([&] { (void)lin(dp::zeros({2, 3, 5})); }, {"(..., in=4)"}));
}

TEST_CASE("scaled_dot_product_attention matches PyTorch: causal with gradients, masks, cross-attention") {
  Tensor q = dp::from_vector(ref::kSdpaQ, {2, 3, 5, 4}).set_requires_grad(true);
  Tensor k = dp::from_vector(ref::kSdpaK, {2, 3, 5, 4}).set_requires_grad(true);
  Tensor v = dp::from_vector(ref::kSdpaV, {2, 3, 5, 6}).set_requires_grad(true);
  Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), 0.0, /*is_causal=*/true);
  CHECK(y.shape() == Shape{2, 3, 5, 6});
  CHECK(max_diff(y, ref::kSdpaCausalOut) < 2e-6);
  dp::sum(dp::mul(y, dp::from_vector(ref::kSdpaUp, {2, 3, 5, 6}))).backward();
  CHECK(max_diff(q.grad(), ref::kSdpaCausalGradQ) < 1e-5);
  CHECK(max_diff(k.grad(), ref::kSdpaCausalGradK) < 1e-5);
  CHECK(max_diff(v.grad(), ref::kSdpaCausalGradV) < 1e-5);

  Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  Tensor keep = dp::from_vector(ref::kSdpaKeep, {5, 5});
  CHECK(max_diff(dp::nn::scaled_dot_product_attention(qd, kd, vd, keep, 0.0, false, std::nullopt, true),
                 ref::kSdpaKeepOut) < 2e-6);
  Tensor add = dp::from_vector(ref::kSdpaAdd, {3, 5, 5});
  CHECK(max_diff(dp::nn::scaled_dot_product_attention(qd, kd, vd, add), ref::kSdpaAddOut) < 2e-6);
  CHECK(max_diff(dp::nn::scaled_dot_product_attention(qd.narrow(2, 0, 3), kd, vd, Tensor(), 0.0, false, 0.3),
                 ref::kSdpaCrossOut) < 2e-6);
  // Causal equals the explicit keep-mask of the lower triangle.
  std::vector<float> tril(25, 0.0f);
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j <= i; ++j) tril[static_cast<std::size_t>(i * 5 + j)] = 1.0f;
  CHECK(dp::nn::scaled_dot_product_attention(qd, kd, vd, dp::from_vector(tril, {5, 5}), 0.0, false, std::nullopt, true)
            .to_vector() == dp::nn::scaled_dot_product_attention(qd, kd, vd, Tensor(), 0.0, true).to_vector());
  // Dropout of every weight leaves zeros; of none, the plain result.
  dp::Generator gen(1);
  CHECK(dp::sum(dp::abs(dp::nn::scaled_dot_product_attention(qd, kd, vd, Tensor(), 1.0, true, std::nullopt, false, &gen)))
            .item() == 0.0f);
}

TEST_CASE("scaled_dot_product_attention: bad input") {
  Tensor q = dp::zeros({2, 5, 4}), k = dp::zeros({2, 5, 4}), v = dp::zeros({2, 5, 3});
  CHECK(dp_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(q, dp::zeros({2, 5, 3}), v); }, {"same last dim E"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(q, k, dp::zeros({2, 4, 3})); }, {"same number of keys S"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(q, k, v, dp::zeros({5, 5}), 0.0, true); }, {"either attn_mask or is_causal"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), 1.5); }, {"dropout_p in [0, 1], got 1.5"}));
  CHECK(dp_test::throws_with([&] { (void)dp::nn::scaled_dot_product_attention(dp::zeros({4}), k, v); }, {"at least 2 dims"}));
}

namespace {

/// gelu as the tensor ops it once was: each intermediate rounded to float.
Tensor composed_gelu(const Tensor& x, bool tanh) {
  using dp::add, dp::mul;
  if (!tanh) return mul(mul(x, 0.5), add(dp::erf(mul(x, 0.7071067811865476)), 1.0));
  Tensor inner = mul(add(x, mul(mul(mul(x, x), x), 0.044715)), 0.7978845608028654);
  return mul(mul(x, 0.5), add(dp::tanh(inner), 1.0));
}

double max_abs(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
  return worst;
}

}  // namespace

TEST_CASE("gelu is one op each way: the composed ops' values and gradients; 16-bit rounded once; input dtype") {
  // Note [Fused GELU]: 4001 points over [-8, 8], where every form of the formula is
  // exercised (both tails, the tanh polynomial and exp ranges).
  std::vector<float> xs, up;
  for (int i = 0; i <= 4000; ++i) {
    xs.push_back(-8.0f + 0.004f * static_cast<float>(i));
    up.push_back(std::sin(0.37f * static_cast<float>(i)));
  }
  const Shape shape{4001};
  for (bool tanh : {true, false}) {
    CAPTURE(tanh);
    const std::string form = tanh ? "tanh" : "none";
    auto [y, g] = run(xs, shape, up, [&](const Tensor& x) { return dp::nn::gelu(x, form); });
    auto [yc, gc] = run(xs, shape, up, [&](const Tensor& x) { return composed_gelu(x, tanh); });
    // Values up to 8 (float spacing 1e-6 there), gradients up to 1.13: a few roundings
    // apart at most (the forward rounds as the composed ops did, in the same order).
    CHECK(max_abs(y.to_vector(), yc.to_vector()) < 2e-6);
    CHECK(max_abs(g.to_vector(), gc.to_vector()) < 2e-6);
    Tensor leaf = dp::from_vector(xs, shape).set_requires_grad(true);
    CHECK(dp::nn::gelu(leaf, form).grad_fn()->name() == "GeluBackward");
    // bfloat16 and float16: the float32 op's value at the widened input, rounded once.
    for (dp::Dtype dt : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
      Tensor xh = dp::from_vector(xs, shape).to(dt);
      Tensor yh = dp::nn::gelu(xh, form);
      CHECK(yh.dtype() == dt);
      CHECK(yh.to(dp::Dtype::Float32).to_vector() ==
            dp::nn::gelu(xh.to(dp::Dtype::Float32), form).to(dt).to(dp::Dtype::Float32).to_vector());
    }
    // Autocast leaves it in its input's dtype, as PyTorch's policy does (on neither list).
    dp::amp::autocast scope(dp::Dtype::BFloat16);
    CHECK(dp::nn::gelu(dp::from_vector(xs, shape), form).dtype() == dp::Dtype::Float32);
    CHECK(dp::nn::gelu(dp::from_vector(xs, shape).to(dp::Dtype::BFloat16), form).dtype() == dp::Dtype::BFloat16);
  }
  CHECK(dp_test::throws_with([] { (void)dp::nn::gelu(dp::zeros({2}).to(dp::Dtype::Int64)); }, {"gelu", "floating"}));
}

TEST_CASE("exact gelu's left tail keeps its relative accuracy: values and gradients against erfc in double") {
  // Below x = -3, 1 + erf(x / sqrt 2) cancels to erff's own absolute error: the values
  // were 15-30 % off near x = -5 and 0 from x = -6 on (CPU and CUDA differing), the
  // gradients' Phi(x) likewise. Every point here is a normal float.
  std::vector<float> xs, up;
  for (int i = 0; i <= 900; ++i) {
    xs.push_back(-12.0f + 0.01f * static_cast<float>(i));
    up.push_back(1.0f);
  }
  auto [y, g] = run(xs, {901}, up, [](const Tensor& x) { return dp::nn::gelu(x); });
  const std::vector<float> yv = y.to_vector(), gv = g.to_vector();
  double worst_y = 0, worst_g = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double x = xs[i], cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * 3.14159265358979323846);
    // In units of what float32 owes: erfc(z) moves 2z² = x² times as much, relatively, as
    // its argument z = -x / sqrt 2, which is off by its product's rounding and the float
    // 1/sqrt 2's (1.5 · 2^-24 together); a few roundings besides.
    const double owed = (1.5 * x * x + 8) * 0x1p-24;
    worst_y = std::max(worst_y, std::fabs(yv[i] - x * cdf) / std::fabs(x * cdf) / owed);
    worst_g = std::max(worst_g, std::fabs(gv[i] - (cdf + x * pdf)) / std::fabs(cdf + x * pdf) / owed);
  }
  CHECK(worst_y < 1.0);
  CHECK(worst_g < 1.0);
}

TEST_CASE("logsigmoid matches PyTorch 2.15: finite tails, the gradient sigma(-x); 16-bit rounded once") {
  const std::vector<float> x{-100, -30, -5, -1, -0.25f, 0, 0.25f, 1, 5, 30, 100};
  // F.logsigmoid(x) and its gradient for an upstream 0.5, float32 and bfloat16.
  const std::vector<float> want{-100.0f, -30.0f, -5.0067153f, -1.31326175f, -0.825939417f, -0.693147182f,
                                -0.575939417f, -0.313261688f, -0.00671534846f, -9.35762291e-14f, -3.9236357e-44f};
  const std::vector<float> want_grad{0.5f, 0.5f, 0.496653587f, 0.365529299f, 0.281088233f, 0.25f,
                                     0.218911752f, 0.134470716f, 0.00334642548f, 4.67881146e-14f, 1.96181785e-44f};
  const std::vector<float> want16{-100.0f, -30.0f, -5.0f, -1.3125f, -0.82421875f, -0.69140625f,
                                  -0.57421875f, -0.3125f, -0.00671386719f, -9.37028233e-14f, -0.0f};
  const std::vector<float> want16_grad{0.5f, 0.5f, 0.49609375f, 0.365234375f, 0.28125f, 0.25f,
                                       0.21875f, 0.134765625f, 0.00335693359f, 4.68514116e-14f, 0.0f};
  // Relative however small (the tails are the point) down to the normal floats; below,
  // where float32 keeps a few bits (x = 100), absolute.
  auto rel = [](const std::vector<float>& got, const std::vector<float>& ref) {
    REQUIRE(got.size() == ref.size());
    double m = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      m = std::max(m, std::fabs(double(got[i]) - ref[i]) / std::max(std::fabs(double(ref[i])), 1.2e-38));
    return m;
  };
  Tensor xs = dp::from_vector(x, {11}).set_requires_grad(true);
  Tensor y = dp::nn::logsigmoid(xs);
  y.backward(dp::full({11}, 0.5));
  CHECK(rel(y.to_vector(), want) < 2e-6);
  CHECK(rel(xs.grad().to_vector(), want_grad) < 2e-6);
  Tensor xb = dp::from_vector(x, {11}).to(dp::Dtype::BFloat16).set_requires_grad(true);
  Tensor yb = dp::nn::logsigmoid(xb);
  CHECK(yb.dtype() == dp::Dtype::BFloat16);
  yb.backward(dp::full({11}, 0.5).to(dp::Dtype::BFloat16));
  CHECK(rel(yb.to(dp::Dtype::Float32).to_vector(), want16) < 8e-3);  // a bfloat16 unit in the last place
  CHECK(rel(xb.grad().to(dp::Dtype::Float32).to_vector(), want16_grad) < 8e-3);
  CHECK(nn_test::throws_with([] { (void)dp::nn::logsigmoid(Tensor()); }, {"logsigmoid", "undefined"}));
  CHECK(nn_test::throws_with([] { (void)dp::nn::logsigmoid(dp::zeros({2}, dp::TensorOptions{dp::Dtype::Int64})); },
                             {"logsigmoid", "int64"}));
}

TEST_CASE("gelu, exact and tanh-approximated, matches PyTorch with gradients; the GELU layer") {
  auto [ye, ge] = run(ref::kGeluX, {49}, ref::kGeluUp, [](const Tensor& x) { return dp::nn::gelu(x); });
  CHECK(max_diff(ye, ref::kGeluExactOut) < 2e-6);
  CHECK(max_diff(ge, ref::kGeluExactGrad) < 2e-6);
  auto [yt, gt] = run(ref::kGeluX, {49}, ref::kGeluUp, [](const Tensor& x) { return dp::nn::gelu(x, "tanh"); });
  CHECK(max_diff(yt, ref::kGeluTanhOut) < 2e-6);
  CHECK(max_diff(gt, ref::kGeluTanhGrad) < 2e-6);
  dp::nn::GELU layer("tanh");
  CHECK(layer(dp::from_vector(ref::kGeluX, {49})).to_vector() == yt.to_vector());
  CHECK(layer.name() == "GELU(approximate='tanh')");
  CHECK(dp::nn::GELU().name() == "GELU()");
  CHECK(dp_test::throws_with([] { dp::nn::GELU g("fast"); }, {"\"none\" or \"tanh\", got \"fast\""}));
  CHECK(dp_test::throws_with([] { (void)dp::nn::gelu(dp::zeros({2}), "erf"); }, {"got \"erf\""}));
}

TEST_CASE("layer_norm's input gradient where it nearly cancels (Note [Layer norm's input gradient, centred])") {
  // The op fuzzer's program 45790: a row of two values whose output barely moves with
  // them. Its gradient in double is ∓0.012496803; the x̂ of the rounded mean gave
  // −0.0124753 and 0.0124692 (a sum of −6e-6 where the gradient's is 0).
  const Tensor x = dp::from_vector(std::vector<float>{1.9056989f, 1.82531095f}, {1, 2}).set_requires_grad(true);
  const Tensor w = dp::from_vector(std::vector<float>{1.2247135639190674f, 1.3162065744400024f}, {2});
  const Tensor up = dp::from_vector(std::vector<float>{0.4661974608898163f, 0.5582444071769714f}, {1, 2});
  dp::sum(dp::mul(dp::nn::layer_norm(x, {2}, w, dp::Tensor(), 1e-5), up)).backward();
  const std::vector<float> g = x.grad().to_vector();
  CHECK(std::fabs(g[0] - (-0.012496803)) < 2e-6);
  CHECK(std::fabs(g[1] - 0.012496803) < 2e-6);
  CHECK(std::fabs(g[0] + g[1]) < 1e-6);
  // Rows of 768 values with a large offset: the gradient within 2e-6 of its largest
  // element against the same formula in double.
  dp::Generator gen(3);
  const std::int64_t rows = 16, cols = 768;
  const Tensor xs = dp::add(dp::mul(dp::randn({rows, cols}, gen), 0.05), 30.0).set_requires_grad(true);
  const Tensor ws = dp::randn({cols}, gen), us = dp::randn({rows, cols}, gen);
  dp::sum(dp::mul(dp::nn::layer_norm(xs, {cols}, ws, dp::Tensor(), 1e-5), us)).backward();
  const std::vector<float> xv = xs.to_vector(), wv = ws.to_vector(), uv = us.to_vector(), gv = xs.grad().to_vector();
  double worst = 0, peak = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0, gm = 0, gxm = 0;
    for (std::int64_t j = 0; j < cols; ++j) m += xv[static_cast<std::size_t>(r * cols + j)];
    m /= cols;
    for (std::int64_t j = 0; j < cols; ++j) v += std::pow(xv[static_cast<std::size_t>(r * cols + j)] - m, 2);
    const double rs = 1.0 / std::sqrt(v / cols + 1e-5);
    auto at = [&](const std::vector<float>& a, std::int64_t j) {
      return double(a[static_cast<std::size_t>(r * cols + j)]);
    };
    for (std::int64_t j = 0; j < cols; ++j) {
      const double gj = at(uv, j) * wv[static_cast<std::size_t>(j)];
      gm += gj / cols;
      gxm += gj * (at(xv, j) - m) * rs / cols;
    }
    for (std::int64_t j = 0; j < cols; ++j) {
      const double want = rs * (at(uv, j) * wv[static_cast<std::size_t>(j)] - gm - (at(xv, j) - m) * rs * gxm);
      worst = std::max(worst, std::fabs(at(gv, j) - want));
      peak = std::max(peak, std::fabs(want));
    }
  }
  CHECK(worst < 2e-6 * peak);
}

TEST_CASE("layer_norm of a constant row is exactly the bias, as PyTorch's (Note [An exact mean for a constant row])") {
  // One mean rounding off the row's value made (x - mean) * rstd = 1e-5 / sqrt(eps)-sized
  // noise: 0.01 where PyTorch gives the bias exactly. Values and widths whose plain mean
  // sum(x) / cols does round off c (checked below for the first few).
  int rounded_off = 0;
  for (std::int64_t cols : {3, 7, 100, 128, 384, 768, 1000}) {
    for (float c : {0.1f, -0.7f, 3.3f, 1e-3f, 123.456f}) {
      CAPTURE(cols);
      CAPTURE(c);
      std::vector<float> row(static_cast<std::size_t>(2 * cols), c);
      Tensor x = dp::from_vector(row, {2, cols});
      Tensor bias = dp::full({cols}, 0.25);
      Tensor y = dp::nn::layer_norm(x, {cols}, dp::full({cols}, 2.0), bias, 1e-5);
      for (float v : y.to_vector()) REQUIRE(v == 0.25f);
      // The plain mean, to show the case is a real one.
      const float plain = dp::sum(dp::from_vector(std::vector<float>(static_cast<std::size_t>(cols), c), {cols})).item() /
                          static_cast<float>(cols);
      if (plain != c) ++rounded_off;
      // The gradient through a constant row: rstd (g - mean(g)) with x̂ = 0, finite.
      Tensor xg = x.clone().set_requires_grad(true);
      Tensor up = dp::from_vector(std::vector<float>(static_cast<std::size_t>(2 * cols), 1.0f), {2, cols});
      dp::sum(dp::nn::layer_norm(xg, {cols}) * up).backward();
      for (float g : xg.grad().to_vector()) REQUIRE(std::fabs(g) < 1e-3f);
    }
  }
  CHECK(rounded_off > 0);
}
