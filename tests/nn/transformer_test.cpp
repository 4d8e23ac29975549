// tests/nn/transformer_test.cpp — TransformerBlock against a nanoGPT Block in PyTorch with
// the same weights (attention_reference.h): output and every gradient; nanoGPT's names;
// causality; options; bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attention_reference.h"
#include "dp/core/error.h"
#include "dp/nn/transformer.h"
#include "dp/tensor/autocast.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"
#include "test_errors.h"

namespace {

using dp::Shape;
using dp::Tensor;
using dp::nn::TransformerBlock;
using dp::nn::TransformerBlockOptions;
namespace ref = attention_reference;

constexpr std::int64_t E = 8, H = 2, N = 2, T = 5;

double max_diff(const Tensor& t, const std::vector<float>& want) { return nn_test::max_diff(t.to_vector(), want); }

/// The block with PyTorch's weights, loaded by nanoGPT's state-dict names.
std::shared_ptr<TransformerBlock> reference_block() {
  auto block = std::make_shared<TransformerBlock>(TransformerBlockOptions(E, H));
  dp::nn::StateDict sd;
  for (const auto& [name, t] : block->state_dict()) {
    for (const ref::Param& p : ref::kBlockParams)
      if (name == p.name) sd.emplace_back(name, dp::from_vector(*p.value, t.shape()));
  }
  block->load_state_dict(sd);  // strict: every name matched
  return block;
}

}  // namespace

TEST_CASE("TransformerBlock matches nanoGPT's Block: output, input gradient and every parameter's gradient") {
  auto block = reference_block();
  Tensor x = dp::from_vector(ref::kBlockX, {N, T, E}).set_requires_grad(true);
  Tensor y = (*block)(x);
  CHECK(y.shape() == Shape{N, T, E});
  CHECK(max_diff(y, ref::kBlockOut) < 4e-6);
  dp::sum(dp::mul(y, dp::from_vector(ref::kBlockUp, {N, T, E}))).backward();
  CHECK(max_diff(x.grad(), ref::kBlockGradX) < 2e-5);
  const auto named = block->named_parameters();
  REQUIRE(named.size() == ref::kBlockParams.size());
  for (std::size_t i = 0; i < named.size(); ++i) {
    CAPTURE(named[i].first);
    CHECK(named[i].first == ref::kBlockParams[i].name);  // nanoGPT's names, in its order
    REQUIRE(named[i].second.grad().defined());
    CHECK(max_diff(named[i].second.grad(), *ref::kBlockParams[i].grad) < 2e-5);
  }
}

TEST_CASE("TransformerBlock: causal, nanoGPT's submodules, options") {
  dp::Generator gen(5);
  TransformerBlock block(TransformerBlockOptions(E, H), &gen);
  std::vector<std::string> children;
  for (const auto& [name, m] : block.named_children()) children.push_back(name);
  CHECK(children == std::vector<std::string>{"ln_1", "attn", "ln_2", "mlp"});
  CHECK(block.attn->c_attn->weight().shape() == Shape{3 * E, E});
  CHECK(block.mlp->c_fc->weight().shape() == Shape{4 * E, E});
  CHECK(block.mlp->gelu->approximate() == "tanh");
  CHECK(block.attn->name() == "CausalSelfAttention(n_embd=8, n_head=2)");

  // A position never sees a later one: changing the last token leaves the others' outputs.
  Tensor x = dp::randn({N, T, E}, gen);
  Tensor last = dp::from_vector(std::vector<float>{0, 0, 0, 0, 1}, {1, T, 1});
  Tensor x2 = dp::where(last, 3.0, x);
  const std::vector<float> a = block(x).narrow(1, 0, T - 1).to_vector(), b = block(x2).narrow(1, 0, T - 1).to_vector();
  CHECK(nn_test::bitwise_equal(a, b));
  CHECK(dp::max_abs_diff(block(x), block(x2)) > 0);

  // No biases anywhere with bias(false); the exact GELU; dropout while training only.
  TransformerBlock nob(TransformerBlockOptions(E, H).bias(false));
  for (const auto& [name, t] : nob.named_parameters()) CHECK(name.find("bias") == std::string::npos);
  CHECK(nob.named_parameters().size() == 6);
  auto exact = reference_block();
  TransformerBlock other(TransformerBlockOptions(E, H).gelu_approximate("none"));
  other.load_state_dict(exact->state_dict());
  CHECK(dp::max_abs_diff(other(x), (*exact)(x)) > 0);
  CHECK(dp::max_abs_diff(other(x), (*exact)(x)) < 1e-2);  // the two GELUs differ a little
  TransformerBlock drop(TransformerBlockOptions(E, H).dropout(0.5), &gen);
  CHECK(dp::max_abs_diff(drop(x), drop(x)) > 0);  // fresh masks each call
  drop.eval();
  CHECK(dp::max_abs_diff(drop(x), drop(x)) == 0);
}

TEST_CASE("TransformerBlock under bfloat16 autocast: the causal attention in bfloat16, float32 gradients") {
  auto block = reference_block();
  Tensor x = dp::from_vector(ref::kBlockX, {N, T, E}).set_requires_grad(true);
  Tensor y;
  {
    dp::amp::autocast guard(dp::Dtype::BFloat16);
    y = (*block)(x);
  }
  CHECK(nn_test::max_diff(y.to(dp::Dtype::Float32).to_vector(), ref::kBlockOut) < 0.1);  // bf16: 8 bits
  dp::sum(dp::mul(y.to(dp::Dtype::Float32), dp::from_vector(ref::kBlockUp, {N, T, E}))).backward();
  CHECK(x.grad().dtype() == dp::Dtype::Float32);
  for (const auto& [name, p] : block->named_parameters()) {
    CAPTURE(name);
    CHECK(p.grad().dtype() == dp::Dtype::Float32);
  }
}

TEST_CASE("TransformerBlock: bad input names what was expected and what came") {
  using dp_test::throws_with;
  CHECK(throws_with([] { TransformerBlock(TransformerBlockOptions(10, 4)); },
                    {"n_embd divisible by n_head", "n_embd=10", "n_head=4"}));
  CHECK(throws_with([] { TransformerBlock(TransformerBlockOptions(8, 2).dropout(-0.1)); }, {"dropout in [0, 1]"}));
  CHECK(throws_with([] { TransformerBlock(TransformerBlockOptions(8, 2).gelu_approximate("fast")); },
                    {"GELU", "\"none\" or \"tanh\"", "fast"}));
  TransformerBlock block(TransformerBlockOptions(E, H));
  CHECK(throws_with([&] { (void)block(dp::zeros({N, T, 6})); }, {"TransformerBlock", "(B, T, C=8)", "[2, 5, 6]"}));
  CHECK(throws_with([&] { (void)block.attn->forward(dp::zeros({T, E})); },
                    {"CausalSelfAttention", "(B, T, C=8)", "[5, 8]"}));
}
