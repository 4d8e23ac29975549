// tests/parallel/param_dtype_gpt_test.cpp — a small GPT (samples/gpt/gpt.h: tied
// embedding and head, TransformerBlocks of LayerNorm, causal attention and an MLP)
// trained with mixed_precision.param_dtype = BFloat16 (Note [Parameters in low
// precision] in src/parallel/design.cpp): the forward runs in bfloat16 end to end, DP,
// DDP and Sharded stages 1-3 stay bitwise identical to one another, and the losses stay
// within bfloat16's rounding of the float32 run's; MultiheadAttention with float32
// masks takes a bfloat16 query the same way.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "dp/dp.h"
#include "gpt/gpt.h"
#include "mlp_fixture.h"

namespace {

using dp::Dtype;
using dp::Tensor;

constexpr int kDevices = 3;
constexpr int kSteps = 6;

samples::GPTConfig config() {
  samples::GPTConfig c;
  c.vocab_size = 16;
  c.block_size = 8;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  return c;  // tied embedding and head, biases: GPT-2's layout
}

Tensor token_loss_3d(const Tensor& logits, const Tensor& y) {
  return dp::nn::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

struct Run {
  std::vector<float> params;  // after the last step
  std::vector<double> losses;
};

/// kSteps AdamW steps on one batch of 7 sequences (uneven on 3 devices) in `o`: the
/// loss falls as the model learns the batch.
Run train(dp::DataParallelOptions o, std::optional<Dtype> param_dtype) {
  o.mixed_precision.param_dtype = param_dtype;
  dp::Generator gen(5);
  auto gpt = std::make_shared<samples::GPT>(config(), gen);
  dp::DataParallel model(gpt, cpus(kDevices), o);
  dp::optim::AdamW opt(model.parameters(), {.lr = 1e-2});
  dp::Generator data(9);
  const Tensor ids = dp::randint(0, config().vocab_size, {7, config().block_size + 1}, data, dp::cpu(0));
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    const Tensor loss = model.forward_backward(ids.narrow(1, 0, config().block_size).clone(),
                                               ids.narrow(1, 1, config().block_size).clone(), token_loss_3d);
    run.losses.push_back(loss.to(Dtype::Float32).item());
    opt.step();
  }
  run.params = flat(gpt->state_dict());
  return run;
}

/// Every design, and stage 3 with a gather unit per TransformerBlock (shard_unit).
std::vector<NamedDesign> designs() {
  std::vector<NamedDesign> out = every_design();
  NamedDesign per_block = out.back();
  per_block.name += ", a unit per block";
  per_block.options.shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>;
  out.push_back(per_block);
  return out;
}

}  // namespace

TEST_CASE("a tied GPT forward under param_dtype bf16 computes in bfloat16 end to end") {
  dp::Generator gen(5);
  auto gpt = std::make_shared<samples::GPT>(config(), gen);
  dp::DataParallel model(gpt, cpus(2), {.mode = dp::Mode::DDP, .mixed_precision = {.param_dtype = Dtype::BFloat16}});
  dp::Generator data(9);
  const Tensor ids = dp::randint(0, config().vocab_size, {4, config().block_size}, data, dp::cpu(0));
  const Tensor logits = model(ids);
  CHECK(logits.dtype() == Dtype::BFloat16);  // the head's output, gathered as computed
  CHECK(std::isfinite(logits.to(Dtype::Float32).abs().sum().item()));
}

TEST_CASE("a tied GPT with param_dtype bf16: DP, DDP, Sharded 1-3 bitwise alike, losses within bfloat16 of float32's") {
  const Run fp32 = train({.mode = dp::Mode::DDP}, std::nullopt);
  std::optional<Run> first;
  for (const NamedDesign& d : designs()) {
    CAPTURE(d.name);
    const Run bf16 = train(d.options, Dtype::BFloat16);
    if (!first) {
      first = bf16;
      REQUIRE(bf16.losses.size() == fp32.losses.size());
      for (std::size_t s = 0; s < fp32.losses.size(); ++s) {
        CAPTURE(s);
        // The bf16 loss is itself rounded to 8 significant bits (steps of 1/64 between 2
        // and 4, 0.6 % of ~2.5); the forward's roundings and six steps trained on them
        // keep it within about one step of float32's (seen: 0.019 at most).
        CHECK(std::abs(bf16.losses[s] - fp32.losses[s]) < 0.02 * fp32.losses[s]);
      }
      CHECK(bf16.params != fp32.params);  // it did compute in bfloat16
      CHECK(bf16.losses.back() < bf16.losses.front());  // and it trains
    } else {
      CHECK(bf16.params == first->params);
      CHECK(bf16.losses == first->losses);
    }
  }
}

namespace {

/// Token embedding, MultiheadAttention (batch_first) with a float32 key padding mask and
/// a causal mask, a residual and a head.
struct MaskedMHA : dp::nn::Module {
  static constexpr std::int64_t V = 12, C = 8, H = 2, T = 6;
  explicit MaskedMHA(std::uint64_t seed) {
    dp::Generator gen(seed);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    attn = register_module("attn", std::make_shared<dp::nn::MultiheadAttention>(
                                       dp::nn::MultiheadAttentionOptions(C, H).batch_first(true), &gen));
    head = register_module("head", std::make_shared<dp::nn::Linear>(C, V, true, &gen));
  }
  Tensor forward(const Tensor& ids) override {
    const Tensor x = wte->forward(ids);
    // The last key of every sequence is padding: -inf there, 0 elsewhere, in float32.
    std::vector<float> pad(static_cast<std::size_t>(ids.size(0) * T), 0.0f);
    for (std::int64_t b = 0; b < ids.size(0); ++b) pad[static_cast<std::size_t>(b * T + T - 1)] = -INFINITY;
    const Tensor mask = dp::from_vector(pad, {ids.size(0), T}, ids.device());
    const Tensor a = attn->forward(x, x, x, mask, Tensor(), /*is_causal=*/true);
    if (ids.device().index == 1) {
      std::lock_guard<std::mutex> lock(mu);
      out_dtype = a.dtype();
    }
    return head->forward(dp::add(x, a));
  }
  std::mutex mu;
  Dtype out_dtype = Dtype::Float32;  // device 1's attention output
  std::shared_ptr<dp::nn::Embedding> wte;
  std::shared_ptr<dp::nn::MultiheadAttention> attn;
  std::shared_ptr<dp::nn::Linear> head;
};

}  // namespace

TEST_CASE("MultiheadAttention with float32 masks under param_dtype bf16: bfloat16 attention, the designs bitwise alike") {
  std::optional<std::vector<float>> first;
  for (const NamedDesign& d : every_design()) {
    CAPTURE(d.name);
    auto net = std::make_shared<MaskedMHA>(3);
    dp::DataParallelOptions o = d.options;
    o.mixed_precision.param_dtype = Dtype::BFloat16;
    dp::DataParallel model(net, cpus(kDevices), o);
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
    dp::Generator data(4);
    for (int s = 0; s < 3; ++s) {
      const Tensor ids = dp::randint(0, MaskedMHA::V, {7, MaskedMHA::T + 1}, data, dp::cpu(0));
      opt.zero_grad();
      model.forward_backward(ids.narrow(1, 0, MaskedMHA::T).clone(), ids.narrow(1, 1, MaskedMHA::T).clone(),
                             token_loss_3d);
      opt.step();
    }
    CHECK(net->out_dtype == Dtype::BFloat16);
    const std::vector<float> params = flat(net->state_dict());
    if (!first) {
      first = params;
    } else {
      CHECK(params == *first);
    }
  }
}
