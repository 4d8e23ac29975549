// tests/nn/attention_test.cpp — MultiheadAttention against torch.nn.MultiheadAttention with
// the same weights (attention_reference.h): causal self-attention, cross-attention with a
// key padding mask and the attention weights, causal with padding, a per-head additive
// mask; every gradient; batch_first false; PyTorch's names and initialisation; bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "attention_reference.h"
#include "dp/core/error.h"
#include "dp/nn/attention.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"
#include "test_errors.h"

namespace {

using dp::Shape;
using dp::Tensor;
using dp::nn::MultiheadAttention;
using dp::nn::MultiheadAttentionOptions;
namespace ref = attention_reference;

constexpr std::int64_t E = 8, H = 2, N = 2, T = 5, S = 6;

double max_diff(const Tensor& t, const std::vector<float>& want) { return nn_test::max_diff(t.to_vector(), want); }

Tensor leaf(const std::vector<float>& v, const Shape& s) { return dp::from_vector(v, s).set_requires_grad(true); }

/// PyTorch's module with the reference weights.
std::shared_ptr<MultiheadAttention> reference_mha(bool batch_first = true) {
  auto mha = std::make_shared<MultiheadAttention>(MultiheadAttentionOptions(E, H).batch_first(batch_first));
  mha->load_state_dict({{"in_proj_weight", dp::from_vector(ref::kMha_in_proj_weight, {3 * E, E})},
                        {"in_proj_bias", dp::from_vector(ref::kMha_in_proj_bias, {3 * E})},
                        {"out_proj.weight", dp::from_vector(ref::kMha_out_proj_weight, {E, E})},
                        {"out_proj.bias", dp::from_vector(ref::kMha_out_proj_bias, {E})}});
  return mha;
}

/// Every parameter's gradient against PyTorch's, by state-dict name.
void check_grads(MultiheadAttention& mha, const std::map<std::string, const std::vector<float>*>& want, double tol) {
  const auto named = mha.named_parameters();
  REQUIRE(named.size() == want.size());
  for (const auto& [name, p] : named) {
    CAPTURE(name);
    REQUIRE(p.grad().defined());
    CHECK(max_diff(p.grad(), *want.at(name)) < tol);
  }
}

/// PyTorch's bool mask (1 = masked) as the float mask dp takes (Note [Attention masks]).
Tensor additive(const std::vector<float>& bool_mask, const Shape& s) {
  return dp::zeros(s).masked_fill(dp::from_vector(bool_mask, s), -INFINITY);
}

}  // namespace

TEST_CASE("MultiheadAttention matches PyTorch: causal self-attention, its output and every gradient") {
  auto mha = reference_mha();
  Tensor x = leaf(ref::kMhaX, {N, T, E});
  Tensor y = mha->forward(x, x, x, Tensor(), Tensor(), /*is_causal=*/true);
  CHECK(y.shape() == Shape{N, T, E});
  CHECK(max_diff(y, ref::kMhaCausalOut) < 2e-6);
  dp::sum(dp::mul(y, dp::from_vector(ref::kMhaUp, {N, T, E}))).backward();
  CHECK(max_diff(x.grad(), ref::kMhaCausalGradX) < 1e-5);
  check_grads(*mha, {{"in_proj_weight", &ref::kMhaCausal_grad_in_proj_weight},
                     {"in_proj_bias", &ref::kMhaCausal_grad_in_proj_bias},
                     {"out_proj.weight", &ref::kMhaCausal_grad_out_proj_weight},
                     {"out_proj.bias", &ref::kMhaCausal_grad_out_proj_bias}},
              1e-5);

  // The same through an explicit causal float mask, and through the weights path.
  Tensor xd = x.detach();
  Tensor future = additive(dp::triu(dp::ones({T, T}), 1).to_vector(), {T, T});
  CHECK(max_diff(mha->forward(xd, xd, xd, Tensor(), future), ref::kMhaCausalOut) < 2e-6);
  CHECK(max_diff(mha->forward_with_weights(xd, xd, xd, Tensor(), Tensor(), true, true).first, ref::kMhaCausalOut) <
        2e-6);

  // batch_first = false: (T, N, E) in and out, the same numbers transposed.
  auto tn = reference_mha(false);
  Tensor yt = tn->forward(xd.transpose(0, 1), xd.transpose(0, 1), xd.transpose(0, 1), Tensor(), Tensor(), true);
  CHECK(yt.shape() == Shape{T, N, E});
  CHECK(max_diff(yt.transpose(0, 1), ref::kMhaCausalOut) < 2e-6);
  // Self-attention as a one-input module (what DataParallel and Sequential call).
  CHECK(dp::max_abs_diff((*mha)(xd), mha->forward(xd, xd, xd)) == 0);
}

TEST_CASE("MultiheadAttention matches PyTorch: cross-attention with a key padding mask, weights and gradients") {
  auto mha = reference_mha();
  Tensor q = leaf(ref::kMhaCrossQ, {N, T, E}), k = leaf(ref::kMhaCrossK, {N, S, E}),
         v = leaf(ref::kMhaCrossV, {N, S, E});
  Tensor pad = additive(ref::kMhaCrossPad, {N, S});
  auto [y, w] = mha->forward_with_weights(q, k, v, pad);
  CHECK(w.shape() == Shape{N, T, S});
  CHECK(max_diff(y, ref::kMhaCrossOut) < 2e-6);
  CHECK(max_diff(w, ref::kMhaCrossWeights) < 1e-6);
  dp::Tensor loss = dp::add(dp::sum(dp::mul(y, dp::from_vector(ref::kMhaUp, {N, T, E}))),
                            dp::sum(dp::mul(w, dp::from_vector(ref::kMhaCrossUpW, {N, T, S}))));
  loss.backward();
  CHECK(max_diff(q.grad(), ref::kMhaCrossGradQ) < 1e-5);
  CHECK(max_diff(k.grad(), ref::kMhaCrossGradK) < 1e-5);
  CHECK(max_diff(v.grad(), ref::kMhaCrossGradV) < 1e-5);
  check_grads(*mha, {{"in_proj_weight", &ref::kMhaCross_grad_in_proj_weight},
                     {"in_proj_bias", &ref::kMhaCross_grad_in_proj_bias},
                     {"out_proj.weight", &ref::kMhaCross_grad_out_proj_weight},
                     {"out_proj.bias", &ref::kMhaCross_grad_out_proj_bias}},
              1e-5);
  // Per-head weights; the sdpa path's output equals the weights path's.
  Tensor qd = q.detach(), kd = k.detach(), vd = v.detach();
  CHECK(max_diff(mha->forward_with_weights(qd, kd, vd, pad, Tensor(), false).second, ref::kMhaCrossHeadWeights) <
        1e-6);
  CHECK(max_diff(mha->forward(qd, kd, vd, pad), ref::kMhaCrossOut) < 2e-6);
  // Padded keys get weight 0 exactly.
  const std::vector<float> wv = w.to_vector();
  CHECK(wv[static_cast<std::size_t>(T * S + S - 1)] == 0.0f);
  // {query, key, value, key_padding_mask} as a several-input module.
  CHECK(dp::max_abs_diff((*mha)(qd, kd, vd, pad), mha->forward(qd, kd, vd, pad)) == 0);
}

TEST_CASE("MultiheadAttention matches PyTorch: causal with padding, and a per-head additive mask") {
  auto mha = reference_mha();
  Tensor x = dp::from_vector(ref::kMhaX, {N, T, E});
  CHECK(max_diff(mha->forward(x, x, x, additive(ref::kMhaPadT, {N, T}), Tensor(), true), ref::kMhaCausalPadOut) <
        2e-6);
  CHECK(max_diff(mha->forward(x, x, x, Tensor(), dp::from_vector(ref::kMhaHeadMask, {N * H, T, T})),
                 ref::kMhaHeadMaskOut) < 2e-6);
}

TEST_CASE("MultiheadAttention: a sequence that is all padding attends to nothing; the others are untouched") {
  // Note [Rows with every key masked]: as PyTorch 2.15's training path (need_weights=False,
  // through scaled_dot_product_attention), its queries' outputs are out_proj's bias and
  // nothing flows back through them; before, they and every gradient of the batch were NaN.
  // forward_with_weights keeps PyTorch's need_weights path: softmax, NaN there.
  auto mha = reference_mha();
  Tensor q = leaf(ref::kMhaCrossQ, {N, T, E}), k = leaf(ref::kMhaCrossK, {N, S, E}),
         v = leaf(ref::kMhaCrossV, {N, S, E});
  std::vector<float> pad_bits(ref::kMhaCrossPad);
  for (std::int64_t j = 0; j < S; ++j) pad_bits[static_cast<std::size_t>(S + j)] = 1.0f;  // sequence 1: all padding
  const Tensor pad = additive(pad_bits, {N, S});
  const Tensor y = mha->forward(q, k, v, pad);
  dp::sum(dp::mul(y, dp::from_vector(ref::kMhaUp, {N, T, E}))).backward();
  const std::vector<float> out = y.to_vector();
  for (std::int64_t i = 0; i < T * E; ++i)  // sequence 1: the bias
    CHECK(out[static_cast<std::size_t>(T * E + i)] == ref::kMha_out_proj_bias[static_cast<std::size_t>(i % E)]);
  // Sequence 0 is as with its own mask alone (the reference's first row).
  const std::vector<float> alone = mha->forward(q.detach(), k.detach(), v.detach(), additive(ref::kMhaCrossPad, {N, S}))
                                       .to_vector();
  CHECK(nn_test::max_diff(std::vector<float>(out.begin(), out.begin() + T * E),
                          std::vector<float>(alone.begin(), alone.begin() + T * E)) == 0);
  // Every gradient is finite; sequence 1's queries, keys and values get none.
  for (const Tensor& g : {q.grad(), k.grad(), v.grad()}) {
    const std::vector<float> gv = g.to_vector();
    for (float x : gv) CHECK(std::isfinite(x));
    const std::size_t half = gv.size() / 2;
    for (std::size_t i = half; i < gv.size(); ++i) CHECK(gv[i] == 0.0f);
  }
  for (const auto& [name, p] : mha->named_parameters()) {
    CAPTURE(name);
    for (float x : p.grad().to_vector()) CHECK(std::isfinite(x));
  }
  const auto [yw, w] = mha->forward_with_weights(q.detach(), k.detach(), v.detach(), pad);
  CHECK(std::isnan(w.to_vector()[static_cast<std::size_t>(T * S)]));
}

TEST_CASE("MultiheadAttention: PyTorch's parameter names and initialisation; bias(false); dropout") {
  dp::Generator gen(3);
  MultiheadAttention mha(MultiheadAttentionOptions(E, H), &gen);
  const auto sd = mha.state_dict();
  REQUIRE(sd.size() == 4);
  CHECK(sd[0].first == "in_proj_weight");
  CHECK(sd[0].second.shape() == Shape{3 * E, E});
  CHECK(sd[1].first == "in_proj_bias");
  CHECK(sd[2].first == "out_proj.weight");
  CHECK(sd[3].first == "out_proj.bias");
  CHECK(dp::sum(dp::abs(mha.in_proj_bias())).item() == 0.0);
  CHECK(dp::sum(dp::abs(mha.out_proj()->bias())).item() == 0.0);
  // xavier_uniform on (3E, E): bound sqrt(6 / (E + 3E)); out_proj as a Linear: 1 / sqrt(E).
  const double xavier = std::sqrt(6.0 / (4 * E)), linear = 1.0 / std::sqrt(double(E));
  CHECK(dp::max(dp::abs(mha.in_proj_weight()).flatten(), 0).item() <= xavier);
  CHECK(dp::max(dp::abs(mha.in_proj_weight()).flatten(), 0).item() > 0.8 * xavier);  // not the narrower Linear bound
  CHECK(dp::max(dp::abs(mha.out_proj()->weight()).flatten(), 0).item() <= linear);
  CHECK(mha.name() == "MultiheadAttention(embed_dim=8, num_heads=2, dropout=0, bias=true, batch_first=false)");

  MultiheadAttention nob(MultiheadAttentionOptions(E, H).bias(false).batch_first(true));
  const auto nsd = nob.state_dict();
  REQUIRE(nsd.size() == 2);
  CHECK(nsd[0].first == "in_proj_weight");
  CHECK(nsd[1].first == "out_proj.weight");
  Tensor x = dp::randn({N, T, E});
  CHECK(nob(x).shape() == Shape{N, T, E});

  // Dropout on the attention weights while training only; p = 1 drops every weight, so
  // only out_proj's bias (zero) is left.
  auto drop = std::make_shared<MultiheadAttention>(MultiheadAttentionOptions(E, H).dropout(1.0).batch_first(true));
  CHECK(drop->named_children().size() == 2);  // out_proj, dropout
  CHECK(dp::sum(dp::abs((*drop)(x))).item() == 0.0);
  drop->eval();
  CHECK(dp::sum(dp::abs((*drop)(x))).item() > 0.0);
}

TEST_CASE("MultiheadAttention: bad input names what was expected and what came") {
  using dp_test::throws_with;
  CHECK(throws_with([] { MultiheadAttention(10, 3); }, {"embed_dim divisible by num_heads", "embed_dim=10",
                                                        "num_heads=3"}));
  CHECK(throws_with([] { MultiheadAttention(0, 1); }, {"positive embed_dim"}));
  CHECK(throws_with([] { MultiheadAttention(MultiheadAttentionOptions(8, 2).dropout(1.5)); }, {"dropout in [0, 1]"}));
  auto mha = reference_mha();
  Tensor x = dp::randn({N, T, E}), kv = dp::randn({N, S, E});
  CHECK(throws_with([&] { (void)(*mha)(dp::randn({N, T, 7})); }, {"query (N, L, E=8)", "[2, 5, 7]"}));
  CHECK(throws_with([&] { (void)(*mha)(dp::randn({T, E})); }, {"query", "[5, 8]", "unsqueeze"}));
  CHECK(throws_with([&] { (void)mha->forward(x, kv, dp::randn({N, S, 4})); }, {"value (N, L, E=8)", "[2, 6, 4]"}));
  CHECK(throws_with([&] { (void)mha->forward(x, dp::randn({3, S, E}), dp::randn({3, S, E})); },
                    {"query's batch size", "key [3, 6, 8]"}));
  CHECK(throws_with([&] { (void)mha->forward(x, kv, dp::randn({N, S + 1, E})); },
                    {"one sequence length", "value [2, 7, 8]"}));
  CHECK(throws_with([&] { (void)mha->forward(x, kv, kv, dp::zeros({N, T})); },
                    {"key_padding_mask of shape (N, S) = [2, 6]", "[2, 5]"}));
  CHECK(throws_with([&] { (void)mha->forward(x, kv, kv, dp::zeros({N, S}, dp::TensorOptions{dp::Dtype::Int64})); },
                    {"float32 key_padding_mask", "int64"}));
  CHECK(throws_with([&] { (void)mha->forward(x, kv, kv, Tensor(), dp::zeros({S, T})); },
                    {"attn_mask of shape (L, S) = [5, 6]", "(N * num_heads, L, S) = [4, 5, 6]", "[6, 5]"}));
  CHECK(throws_with([&] { (void)(*mha)(x, kv); }, {"{query, key, value}", "got 2 inputs"}));
}
