// tests/parallel/sequence_model_test.cpp — the sequence layers (Embedding, LayerNorm,
// Linear over (B, T, C), scaled_dot_product_attention, GELU) trained by every design:
// DP, DDP and Sharded stages 1-3 on 1-3 CPU devices, through forward_backward and
// model(x), against one plain device to float rounding, and the designs bit for bit
// against DP's; the same for a 2-block GPT of TransformerBlocks on 2 devices. Across
// processes: tests/dist/dp_mpi_test.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

constexpr int kSteps = 3;
constexpr std::uint64_t kSeed = 77;

/// Rows of step s: never a multiple of every device count, so shards are uneven.
std::int64_t rows_of(int s) { return 7 + s; }

/// Token embedding, causal nn::MultiheadAttention (batch_first) with a residual, and a
/// head: the attention layer in a training loop. Three top-level children.
struct TinyMHA : dp::nn::Module {
  static constexpr std::int64_t V = TinyLM::V, C = 8, H = 2;
  explicit TinyMHA(std::uint64_t seed) {
    dp::Generator gen(seed);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    attn = register_module("attn", std::make_shared<dp::nn::MultiheadAttention>(
                                       dp::nn::MultiheadAttentionOptions(C, H).batch_first(true), &gen));
    head = register_module("head", std::make_shared<dp::nn::Linear>(C, V, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    const dp::Tensor x = wte->forward(ids);
    const dp::Tensor a = attn->forward(x, x, x, dp::Tensor(), dp::Tensor(), /*is_causal=*/true);
    return head->forward(dp::add(x, a));
  }
  std::shared_ptr<dp::nn::Embedding> wte;
  std::shared_ptr<dp::nn::MultiheadAttention> attn;
  std::shared_ptr<dp::nn::Linear> head;
};

template <class Net = TinyLM>
std::vector<float> train(const dp::DataParallelOptions* options, int devices, bool module_path,
                         bool positions_first = false) {
  auto net = std::make_shared<Net>(kSeed);
  if constexpr (requires { net->positions_first; }) net->positions_first = positions_first;
  std::unique_ptr<dp::DataParallel> model;
  if (options) model = std::make_unique<dp::DataParallel>(net, cpus(devices), *options);
  // SGD: the parameters move by the gradients themselves. (Adam divides each gradient by
  // its own magnitude, so components that are zero in exact arithmetic — a causal row's
  // single attention weight has none — but come out as rounding noise of either sign
  // would step by up to lr in a direction the rounding picks, on one device as on many.)
  dp::optim::SGD opt(model ? model->parameters() : net->parameters(), {.lr = 0.1});
  for (int s = 0; s < kSteps; ++s) {
    Batch b = make_token_batch(rows_of(s), 300 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    if (!model) {
      token_loss(net->forward(b.x), b.y).backward();
    } else if (module_path) {
      token_loss((*model)(b.x), b.y).backward();
    } else {
      model->forward_backward(b.x, b.y, token_loss);
    }
    opt.step();
  }
  return flat(net->state_dict());
}

/// Trains Net in every design on 1-3 devices through both forward paths: each within
/// float rounding of one plain device, and bitwise DP's.
template <class Net>
void check_every_design() {
  const std::vector<float> single = train<Net>(nullptr, 1, false);
  REQUIRE(!single.empty());
  CHECK(max_diff(single, flat(Net(kSeed).state_dict())) > 1e-3);  // the steps moved the parameters
  for (int devices = 1; devices <= 3; ++devices) {
    for (bool module_path : {false, true}) {
      std::vector<float> dp_params;
      for (const NamedDesign& d : every_design()) {
        CAPTURE(d.name);
        CAPTURE(devices);
        CAPTURE(module_path);
        const std::vector<float> got = train<Net>(&d.options, devices, module_path);
        CHECK(max_diff(got, single) < 2e-5);
        if (dp_params.empty()) dp_params = got;
        else CHECK(max_diff(got, dp_params) == 0);  // bitwise DP's, as every design promises on CPU
      }
    }
  }
}

}  // namespace

TEST_CASE("a tiny causal LM trains the same in every design on 1-3 devices as on one device") {
  const std::vector<float> single = train(nullptr, 1, false);
  REQUIRE(!single.empty());
  const std::vector<float> start = flat(TinyLM(kSeed).state_dict());
  CHECK(max_diff(single, start) > 1e-3);  // the steps moved the parameters
  for (bool module_path : {false, true}) {
    for (int devices = 1; devices <= 3; ++devices) {
      std::vector<float> dp_params;
      for (const NamedDesign& d : every_design()) {
        CAPTURE(d.name);
        CAPTURE(devices);
        CAPTURE(module_path);
        const std::vector<float> got = train(&d.options, devices, module_path);
        CHECK(max_diff(got, single) < 2e-5);
        if (dp_params.empty()) dp_params = got;
        else CHECK(max_diff(got, dp_params) == 0);  // bitwise DP's, as every design promises on CPU
      }
    }
  }
}

TEST_CASE("a 2-block GPT (TransformerBlock) trains the same in every design on 1-3 devices as on one device") {
  check_every_design<TinyGPT>();
}

TEST_CASE("a forward that runs top-level children out of registration order trains in every design") {
  // wpe before wte: in stage 3 the backward reaches wte's unit (and its complete
  // bucket) while wpe's earlier bucket still waits for gradients; the worker must not
  // wait for the comm thread to combine wte's bucket first. It hung before.
  const std::vector<float> single = train<TinyGPT>(nullptr, 1, false, true);
  for (bool module_path : {false, true}) {
    std::vector<float> dp_params;
    for (const NamedDesign& d : every_design()) {
      CAPTURE(d.name);
      CAPTURE(module_path);
      const std::vector<float> got = train<TinyGPT>(&d.options, 2, module_path, true);
      CHECK(max_diff(got, single) < 2e-5);
      if (dp_params.empty()) dp_params = got;
      else CHECK(max_diff(got, dp_params) == 0);
    }
  }
}

TEST_CASE("causal MultiheadAttention trains the same in every design on 1-3 devices as on one device") {
  check_every_design<TinyMHA>();
}

TEST_CASE("attention with whole sequences of padding trains the same in every design on 1-3 devices as on one device") {
  // Note [Rows with every key masked]: such a sequence's queries attend to nothing. Before,
  // their NaN reached every key's and value's gradient, on one device as on many.
  int dead = 0, rows = 0;
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = make_token_batch(rows_of(s), 300 + static_cast<std::uint64_t>(s));
    const std::vector<float> pad = PaddedMHA::padding(b.x).to_vector();
    for (std::int64_t r = 0; r < b.x.size(0); ++r, ++rows)
      dead += std::all_of(pad.begin() + r * 5, pad.begin() + (r + 1) * 5, [](float v) { return std::isinf(v); });
  }
  CHECK(dead > 0);  // the batches hold such sequences, and others
  CHECK(dead < rows);
  check_every_design<PaddedMHA>();
}

TEST_CASE("a tied parameter is one parameter: counted, flattened and stepped once, its gradient both uses' sum") {
  TinyGPT untied(kSeed);
  TiedGPT tied(kSeed);
  const std::int64_t vc = TinyGPT::V * TinyGPT::C;
  CHECK(tied.num_parameters() == untied.num_parameters() - vc);
  CHECK(tied.parameters().set()->copy(0).data.numel() == untied.parameters().set()->copy(0).data.numel() - vc);
  const auto has = [](const dp::nn::StateDict& sd, const std::string& k) {
    return std::any_of(sd.begin(), sd.end(), [&](const auto& e) { return e.first == k; });
  };
  const dp::nn::StateDict named = tied.named_parameters(), sd = tied.state_dict();
  CHECK(has(named, "wte.weight"));
  CHECK_FALSE(has(named, "lm_head.weight"));  // one parameter, under its first name
  CHECK(has(sd, "wte.weight"));
  CHECK(has(sd, "lm_head.weight"));  // as PyTorch's state_dict: both names
  CHECK(tied.lm_head->weight().raw_data() == tied.wte->weight().raw_data());

  // The same values untied: the tied gradient is the sum of the embedding's and the head's.
  untied.lm_head->load_state_dict({{"weight", untied.wte->weight()}});
  Batch b = make_token_batch(6, 31);
  token_loss(untied.forward(b.x), b.y).backward();
  token_loss(tied.forward(b.x), b.y).backward();
  const std::vector<float> want =
      dp::add(untied.wte->weight().grad(), untied.lm_head->weight().grad()).to_vector();
  const std::vector<float> got = tied.wte->weight().grad().to_vector();
  CHECK(max_diff(got, want) < 1e-6);
  CHECK(max_diff(untied.wte->weight().grad().to_vector(), want) > 1e-4);  // the head's part counts

  // One SGD step moves it once, by lr times that sum.
  const std::vector<float> before = tied.wte->weight().to_vector();
  dp::optim::SGD opt(tied.parameters(), {.lr = 0.5});
  opt.step();
  const std::vector<float> after = tied.lm_head->weight().to_vector();
  for (std::size_t i = 0; i < after.size(); ++i) REQUIRE(after[i] == doctest::Approx(before[i] - 0.5f * got[i]));
}

TEST_CASE("a GPT with tied embedding and head trains the same in every design on 1-3 devices as on one device") {
  check_every_design<TiedGPT>();
}

namespace {

/// nanoGPT's layout: the blocks inside one container child, so that the top-level
/// children alone would make the whole stack one gather unit.
struct NestedGPT : dp::nn::Module {
  static constexpr std::int64_t V = TinyLM::V, C = 8, H = 2;
  explicit NestedGPT(std::uint64_t seed) {
    dp::Generator gen(seed);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    h = register_module("h", std::make_shared<dp::nn::Sequential>());
    for (int i = 0; i < 2; ++i)
      h->push_back(std::make_shared<dp::nn::TransformerBlock>(dp::nn::TransformerBlockOptions(C, H), &gen));
    ln_f = register_module("ln_f", std::make_shared<dp::nn::LayerNorm>(dp::Shape{C}));
    lm_head = register_module("lm_head", std::make_shared<dp::nn::Linear>(C, V, false, &gen));
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    return lm_head->forward(ln_f->forward(h->forward(wte->forward(ids))));
  }
  std::shared_ptr<dp::nn::Embedding> wte;
  std::shared_ptr<dp::nn::Sequential> h;
  std::shared_ptr<dp::nn::LayerNorm> ln_f;
  std::shared_ptr<dp::nn::Linear> lm_head;
};

dp::DataParallelOptions per_block(int stage) {
  return {.mode = dp::Mode::Sharded, .shard_stage = stage, .shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>,
          .bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
}

}  // namespace

TEST_CASE("shard_unit makes each picked module a gather unit, and trains as DP does") {
  const auto units = [](const dp::DataParallelOptions& o) {
    auto net = std::make_shared<NestedGPT>(kSeed);
    dp::DataParallel model(net, cpus(3), o);
    return model.units();
  };
  dp::DataParallelOptions top = per_block(3);
  top.shard_unit = nullptr;
  CHECK(units(top).size() == 4);  // wte, h (both blocks), ln_f, lm_head
  const auto blocks = units(per_block(3));
  REQUIRE(blocks.size() == 5);  // wte, h.0, h.1, ln_f, lm_head
  NestedGPT probe(kSeed);
  const std::int64_t block = probe.h->named_children()[0].second->num_parameters();
  CHECK(blocks[1].second - blocks[1].first == block);
  CHECK(blocks[2].second - blocks[2].first == block);
  CHECK(blocks[2].first == blocks[1].second);

  const std::vector<float> single = train<NestedGPT>(nullptr, 1, false);
  for (bool module_path : {false, true}) {
    CAPTURE(module_path);
    const std::vector<float> dp_params = train<NestedGPT>(&every_design().front().options, 3, module_path);  // DP
    CHECK(max_diff(dp_params, single) < 2e-5);
    for (int stage = 1; stage <= 3; ++stage) {
      CAPTURE(stage);
      const dp::DataParallelOptions o = per_block(stage);
      CHECK(max_diff(train<NestedGPT>(&o, 3, module_path), dp_params) == 0);
    }
  }
}

TEST_CASE("shard_unit with another mode than Sharded is a dp::Error naming it") {
  auto net = std::make_shared<NestedGPT>(kSeed);
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    CHECK_THROWS_WITH_AS(dp::DataParallel(net, cpus(2), {.mode = mode, .shard_unit = dp::nn::is_module<dp::nn::Linear>}),
                         doctest::Contains("shard_unit was given with mode"), dp::Error);
  }
}
