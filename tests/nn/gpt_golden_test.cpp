// samples::GPT (samples/gpt/gpt.h) against PyTorch, float32, as llm.c checks its GPT-2
// against a PyTorch state file. tests/nn/golden_gpt.safetensors holds a nanoGPT-shaped
// model's initial state, batches and results, written by scripts/make_golden_gpt.py (its
// docstring lists every tensor); meson passes its path in DP_GOLDEN_GPT. Compared: the
// logits, the loss and every gradient of one batch; the gradient norms clipping saw
// and the parameters after 10 AdamW steps with two parameter groups and clipping — on
// cpu(0) and under DP, DDP and Sharded stages 1-3 on 2 and 3 devices, whose parameters
// must also be bitwise alike. Tolerances: Note [Golden tolerances] in golden_test.cpp.
#include <doctest/doctest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "golden_file.h"
#include "gpt/gpt.h"

namespace {

namespace nn = dp::nn;
using dp::Tensor;

// Logits, loss and gradients: rtol 1e-5 as the CNN's (Note [Golden tolerances]): the sums
// here are over at most 64 terms (the MLP's width) and 32 rows.
constexpr double kForwardRtol = 1e-5;
constexpr double kGradRtol = 1e-5;
// The clip norms: one sum of squares over every gradient, each within kGradRtol.
constexpr double kNormRtol = 1e-5;
// Parameters after 10 steps: each AdamW step moves a parameter by up to ~lr (3e-3) in
// the direction of m / sqrt(v), which for an element with a small gradient carries
// that gradient's relative rounding (1e-4 and more, where kGradRtol is relative to its
// tensor's largest); measured, the worst element is 2.4e-7 off, 3× an rtol of 1e-6.
// 1e-5 (8e-7 at these weights' scale) is still ~75× below what a wrong group's
// hyper-parameter moves in 10 steps (lr·0.1·|p| ≈ 6e-6 a step on a 0.02 weight for
// weight decay on the wrong group; the other group's halved lr moves the norms' weights
// by ~1e-2).
constexpr double kStepRtol = 1e-5;

const golden::File& file() {
  static const golden::File g =
      golden::File::from_env("DP_GOLDEN_GPT", "regenerate it with `python3 scripts/make_golden_gpt.py`");
  return g;
}

samples::GPTConfig config() {
  const golden::File& g = file();
  samples::GPTConfig c;
  c.vocab_size = std::stoll(g.meta("vocab_size"));
  c.block_size = std::stoll(g.meta("block_size"));
  c.n_layer = std::stoll(g.meta("n_layer"));
  c.n_head = std::stoll(g.meta("n_head"));
  c.n_embd = std::stoll(g.meta("n_embd"));
  c.bias = g.meta("bias") == "true";
  return c;
}

/// The GPT with the file's initial state (a strict load: names as PyTorch's state_dict,
/// the tied weight under both).
std::shared_ptr<samples::GPT> make_gpt() {
  dp::Generator gen(0);
  auto gpt = std::make_shared<samples::GPT>(config(), gen);
  gpt->load_state_dict(file().state("init"), /*strict=*/true);
  return gpt;
}

Tensor token_loss(const Tensor& logits, const Tensor& y) {
  return nn::cross_entropy(logits.reshape({-1, logits.size(-1)}), y.reshape({-1}));
}

}  // namespace

TEST_CASE("gpt golden: logits, loss and every gradient of one batch match PyTorch's") {
  const golden::File& g = file();
  auto gpt = make_gpt();
  CHECK(gpt->config().tie);
  const Tensor logits = gpt->forward(g["input"]);
  const Tensor loss = token_loss(logits, g["target"]);
  loss.backward();
  golden::Worst forward, grads;
  golden::expect_close("logits", logits, g["logits"], kForwardRtol, forward);
  golden::expect_close("loss", loss.reshape({1}), g["loss"], kForwardRtol, forward);
  const nn::StateDict want = g.state("grad");
  const nn::StateDict params = gpt->named_parameters();
  CHECK(want.size() == params.size());  // the tied weight once on both sides
  for (auto& [name, p] : params) {
    const Tensor* w = nullptr;
    for (auto& [n, t] : want)
      if (n == name) w = &t;
    REQUIRE_MESSAGE(w != nullptr, "the golden file has no gradient of '", name, "'");
    golden::expect_close("grad." + name, p.grad(), *w, kGradRtol, grads);
  }
  golden::report("gpt: logits and loss", forward);
  golden::report("gpt: gradients", grads);
}

namespace {

/// The script's AdamW over two groups: matrices with weight decay, the rest (the
/// LayerNorms' weights) without and at lr · lr2_factor.
std::unique_ptr<dp::optim::AdamW> golden_adamw(const nn::ParameterList& params) {
  const golden::File& g = file();
  const double lr = std::stod(g.meta("lr")), lr2 = std::stod(g.meta("lr2_factor"));
  auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
  auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
  return std::make_unique<dp::optim::AdamW>(
      std::vector<dp::optim::AdamParamGroup>{{matrices, {.weight_decay = std::stod(g.meta("weight_decay"))}},
                                             {others, {.lr = lr * lr2, .weight_decay = 0.0}}},
      dp::optim::AdamWOptions{.lr = lr,
                              .betas = {std::stod(g.meta("beta1")), std::stod(g.meta("beta2"))},
                              .eps = std::stod(g.meta("eps"))});
}

/// The file's 10 steps (zero_grad, loss, backward, clip, step) on one device (n = 0) or
/// under `o` on n devices; returns the state_dict after them.
nn::StateDict golden_steps(int n, const dp::DataParallelOptions& o, golden::Worst& norms) {
  const golden::File& g = file();
  auto gpt = make_gpt();
  std::unique_ptr<dp::DataParallel> model;
  std::vector<dp::Device> devices;
  for (int i = 0; i < n; ++i) devices.push_back(dp::cpu(i));
  if (n > 0) model = std::make_unique<dp::DataParallel>(gpt, devices, o);
  const nn::ParameterList params = model ? model->parameters() : gpt->parameters();
  auto opt = golden_adamw(params);
  const double clip = std::stod(g.meta("clip"));
  const Tensor& xs = g["steps.input"];
  const Tensor& ys = g["steps.target"];
  std::vector<float> got_norms;
  for (std::int64_t s = 0; s < xs.size(0); ++s) {
    const Tensor x = xs.narrow(0, s, 1).reshape({xs.size(1), xs.size(2)});
    const Tensor y = ys.narrow(0, s, 1).reshape({ys.size(1), ys.size(2)});
    opt->zero_grad();
    if (model) {
      model->forward_backward(x, y, token_loss);
    } else {
      token_loss(gpt->forward(x), y).backward();
    }
    got_norms.push_back(static_cast<float>(nn::utils::clip_grad_norm_(params, clip)));
    opt->step();
  }
  golden::expect_close("steps.norm", dp::from_vector(got_norms, {xs.size(0)}, dp::cpu(0)), g["steps.norm"],
                       kNormRtol, norms);
  return gpt->state_dict();
}

}  // namespace

TEST_CASE("gpt golden: 10 AdamW steps with two param groups and clipping match PyTorch's, in every design") {
  const golden::File& g = file();
  const nn::StateDict want = g.state("adamw");
  golden::Worst norms, params;
  const nn::StateDict single = golden_steps(0, {}, norms);
  REQUIRE(single.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    CHECK(single[i].first == want[i].first);
    golden::expect_close("adamw." + want[i].first, single[i].second, want[i].second, kStepRtol, params);
  }
  golden::report("gpt: clip norms", norms);
  golden::report("gpt: parameters after 10 AdamW steps (two groups)", params);
  // Every design on 2 and 3 devices: PyTorch's values to the same tolerance, and
  // bitwise the same parameters as each other.
  dp::DataParallelOptions o;
  for (int n : {2, 3}) {
    std::optional<nn::StateDict> first;
    for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP, dp::Mode::Sharded}) {
      for (int stage = 1; stage <= (mode == dp::Mode::Sharded ? 3 : 1); ++stage) {
        o.mode = mode;
        o.shard_stage = mode == dp::Mode::Sharded ? std::optional<int>(stage) : std::nullopt;
        CAPTURE(static_cast<int>(mode));
        CAPTURE(stage);
        CAPTURE(n);
        golden::Worst ignored;
        const nn::StateDict got = golden_steps(n, o, ignored);
        REQUIRE(got.size() == want.size());
        if (!first) first = got;
        for (std::size_t i = 0; i < got.size(); ++i) {
          CAPTURE(got[i].first);
          golden::expect_close("adamw." + want[i].first, got[i].second, want[i].second, kStepRtol, ignored);
          CHECK(got[i].second.to_vector() == (*first)[i].second.to_vector());
        }
      }
    }
  }
}
