// tests/parallel/sequence_model_test.cpp — the sequence layers (Embedding, LayerNorm,
// Linear over (B, T, C), scaled_dot_product_attention, GELU) trained by every design:
// DP, DDP and Sharded stages 1-3 on 1-3 CPU devices, through forward_backward and
// model(x), against one plain device to float rounding, and the designs bit for bit
// against DP's; the same for a 2-block GPT of TransformerBlocks on 2 devices. Across
// processes: tests/dist/dp_mpi_test.cpp.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

constexpr int kSteps = 3;
constexpr std::uint64_t kSeed = 77;

/// Rows of step s: never a multiple of every device count, so shards are uneven.
std::int64_t rows_of(int s) { return 7 + s; }

/// A tiny GPT: token and position embeddings, two pre-norm blocks (TransformerBlock:
/// LayerNorm, causal self-attention, LayerNorm, GELU MLP, residuals), a final LayerNorm
/// and a head over TinyLM's vocabulary. Six top-level children: six gather units in
/// stage 3. ids (B, T <= 5) int64 -> logits (B, T, V).
struct TinyGPT : dp::nn::Module {
  static constexpr std::int64_t V = TinyLM::V, C = 8, H = 2, kMaxT = 5;
  explicit TinyGPT(std::uint64_t seed) {
    dp::Generator gen(seed);
    const auto block = dp::nn::TransformerBlockOptions(C, H);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    wpe = register_module("wpe", std::make_shared<dp::nn::Embedding>(kMaxT, C, &gen));
    h0 = register_module("h0", std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    h1 = register_module("h1", std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    ln_f = register_module("ln_f", std::make_shared<dp::nn::LayerNorm>(dp::Shape{C}));
    lm_head = register_module("lm_head", std::make_shared<dp::nn::Linear>(C, V, false, &gen));
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    dp::Tensor pos = dp::arange(ids.size(1), dp::TensorOptions{dp::Dtype::Int64, ids.device()});
    // In registration order (wte, then wpe) unless `positions_first`: the test below
    // runs them the other way round, which stage 3 must survive (Reducer::wait_combined).
    dp::Tensor h;
    if (positions_first) {
      dp::Tensor p = wpe->forward(pos);
      h = dp::add(wte->forward(ids), p);
    } else {
      dp::Tensor tok = wte->forward(ids);
      h = dp::add(tok, wpe->forward(pos));
    }
    return lm_head->forward(ln_f->forward(h1->forward(h0->forward(h))));
  }
  bool positions_first = false;
  std::shared_ptr<dp::nn::Embedding> wte, wpe;
  std::shared_ptr<dp::nn::TransformerBlock> h0, h1;
  std::shared_ptr<dp::nn::LayerNorm> ln_f;
  std::shared_ptr<dp::nn::Linear> lm_head;
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

struct Design {
  std::string name;
  dp::DataParallelOptions options;
};

std::vector<Design> designs() {
  const dp::DataParallelOptions tiny{.bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};  // many buckets
  std::vector<Design> out;
  dp::DataParallelOptions o = tiny;
  o.mode = dp::Mode::DP;
  out.push_back({"DP", o});
  o.mode = dp::Mode::DDP;
  out.push_back({"DDP", o});
  o.mode = dp::Mode::Sharded;
  for (int stage = 1; stage <= 3; ++stage) {
    o.shard_stage = stage;
    out.push_back({"Sharded stage " + std::to_string(stage), o});
  }
  return out;
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
      for (const Design& d : designs()) {
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

TEST_CASE("a 2-block GPT (TransformerBlock) trains the same in every design on 2 devices as on one device") {
  const std::vector<float> single = train<TinyGPT>(nullptr, 1, false);
  REQUIRE(!single.empty());
  CHECK(max_diff(single, flat(TinyGPT(kSeed).state_dict())) > 1e-3);  // the steps moved the parameters
  for (bool module_path : {false, true}) {
    std::vector<float> dp_params;
    for (const Design& d : designs()) {
      CAPTURE(d.name);
      CAPTURE(module_path);
      const std::vector<float> got = train<TinyGPT>(&d.options, 2, module_path);
      CHECK(max_diff(got, single) < 2e-5);
      if (dp_params.empty()) dp_params = got;
      else CHECK(max_diff(got, dp_params) == 0);  // bitwise DP's
    }
  }
}

TEST_CASE("a forward that runs top-level children out of registration order trains in every design") {
  // wpe before wte: in stage 3 the backward reaches wte's unit (and its complete
  // bucket) while wpe's earlier bucket still waits for gradients; the worker must not
  // wait for the comm thread to combine wte's bucket first. It hung before.
  const std::vector<float> single = train<TinyGPT>(nullptr, 1, false, true);
  for (bool module_path : {false, true}) {
    std::vector<float> dp_params;
    for (const Design& d : designs()) {
      CAPTURE(d.name);
      CAPTURE(module_path);
      const std::vector<float> got = train<TinyGPT>(&d.options, 2, module_path, true);
      CHECK(max_diff(got, single) < 2e-5);
      if (dp_params.empty()) dp_params = got;
      else CHECK(max_diff(got, dp_params) == 0);
    }
  }
}
