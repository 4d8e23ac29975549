// dp against PyTorch on a small CNN with BatchNorm (as llm.c checks train_gpt2.c
// against its PyTorch reference). tests/nn/golden_cnn.safetensors holds PyTorch's
// batch, initial state and results, written by scripts/make_golden.py (see its
// docstring for every tensor); meson passes its path in DP_GOLDEN_CNN. Compared:
// logits, loss, every gradient and the BatchNorm buffers after one train-mode forward;
// the state after 3 steps of Adam, AdamW and SGD with momentum on cpu(0); and
// gradients and 3 Adam steps under DataParallel on 2 devices (DP and DDP, both
// forward paths) against PyTorch run shard by shard. Regenerate the file with
// `/usr/bin/python3 scripts/make_golden.py`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../io/io_test_util.h"
#include "dp/dp.h"
#include "golden_file.h"

namespace {

namespace nn = dp::nn;
namespace optim = dp::optim;
using dp::Tensor;

constexpr const char* kRegenerate = "regenerate it with `/usr/bin/python3 scripts/make_golden.py`";
constexpr int kSteps = 3;  // the script's STEPS

// The script's hyperparameters (checked against the file's metadata).
const optim::AdamOptions kAdam{.lr = 1e-3, .betas = {0.9, 0.999}, .eps = 1e-8, .weight_decay = 0.0};
const optim::AdamWOptions kAdamW{.lr = 1e-3, .betas = {0.9, 0.999}, .eps = 1e-8, .weight_decay = 0.1};
const optim::SGDOptions kSgd{.lr = 0.1, .momentum = 0.9, .dampening = 0.0, .weight_decay = 1e-2, .nesterov = false};

// Note [Golden tolerances]
// dp and PyTorch both compute in float32 but sum in different orders (dp's
// convolution is a GEMM over unfolded patches with its own blocking; BatchNorm's mean
// and variance, the softmax and the gradient reductions are blocked differently too),
// so results agree to a few units in the last place of the terms summed, not bit for
// bit. That error is absolute and set by the size of the terms, which the tensor's
// largest values show: a gradient entry that is small because its terms cancel carries
// the same error as its large neighbours. So each tensor is compared normwise,
//   |dp − torch| ≤ rtol · (|torch| + max |torch| over the tensor),
// with rtol = 1e-5 for logits, loss, running statistics and gradients: ~100 float32
// ulps (2^-23 ≈ 1.2e-7) of the tensor's largest value, room for the rounding of sums
// of a few hundred terms, and far below what a bug moves (a wrong formula, a missed
// term, a swapped hyperparameter: 1e-4 to 1 of the values). Parameters after the
// optimizer steps get rtol = 2e-6: a step moves them by ~1e-3 (Adam: ~lr) to ~1e-2
// (SGD), so the tolerance is a few ulps of the parameters and under 1e-3 of one step.
// The observed maxima are in the test log (MESSAGE lines): at most 0.15 of the
// tolerance. The script checks that no ReLU input or max-pool runner-up lies within
// 2e-5 of its kink, so rounding never flips a branch (and with it a gradient).
constexpr double kForwardRtol = 1e-5;
constexpr double kGradRtol = 1e-5;
constexpr double kStepRtol = 2e-6;

using Golden = golden::File;
using golden::expect_close;
using golden::report;
using golden::Worst;

const Golden& golden_file() {
  static const Golden g = Golden::from_env("DP_GOLDEN_CNN", kRegenerate);
  return g;
}

void expect_meta(const Golden& g, const std::string& key, double value) { g.expect_meta(key, value); }

void expect_adam_meta(const Golden& g, const std::string& prefix, double lr, const optim::AdamBetas& betas,
                      double eps, double weight_decay) {
  expect_meta(g, prefix + ".lr", lr);
  expect_meta(g, prefix + ".beta1", std::get<0>(betas));
  expect_meta(g, prefix + ".beta2", std::get<1>(betas));
  expect_meta(g, prefix + ".eps", eps);
  expect_meta(g, prefix + ".weight_decay", weight_decay);
}

/// The script's network, built with dp::nn: the Sequential's children are named "0",
/// "1", ... and BatchNorm2d's buffers as PyTorch's, so the state_dict names match.
std::shared_ptr<nn::Sequential> make_net() {
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, /*bias=*/false));  // 0
  net->push_back(std::make_shared<nn::BatchNorm2d>(4));                          // 1
  net->push_back(std::make_shared<nn::ReLU>());                                  // 2
  net->push_back(std::make_shared<nn::MaxPool2d>(2));                            // 3
  net->push_back(std::make_shared<nn::Conv2d>(4, 8, 3, 1, 1, /*bias=*/false));  // 4
  net->push_back(std::make_shared<nn::BatchNorm2d>(8));                          // 5
  net->push_back(std::make_shared<nn::ReLU>());                                  // 6
  net->push_back(std::make_shared<nn::MaxPool2d>(2));                            // 7
  net->push_back(std::make_shared<nn::Flatten>());                               // 8
  net->push_back(std::make_shared<nn::Linear>(8 * 3 * 3, 10));                   // 9
  return net;
}

/// make_net() holding the file's initial parameters and buffers (a strict load: the
/// names must match PyTorch's both ways).
std::shared_ptr<nn::Sequential> make_initialised_net(const Golden& g) {
  auto net = make_net();
  net->load_state_dict(g.state("init"), /*strict=*/true);
  return net;
}

/// Checks every tensor of the file named "<prefix>.<name>" against net's state_dict
/// entry <name> (parameters with kStepRtol, running statistics with kForwardRtol,
/// num_batches_tracked exactly) and reports both groups under `label`.
void expect_state_close(const std::string& label, const std::string& prefix, nn::Module& net, const Golden& g) {
  std::map<std::string, Tensor> got;
  for (auto& [name, t] : net.state_dict()) got[name] = t;
  nn::StateDict want = g.state(prefix);
  CHECK_MESSAGE(want.size() == got.size(), "the golden file has ", want.size(), " '", prefix,
                ".*' tensors, the net's state_dict ", got.size());
  Worst params, buffers;
  for (auto& [name, t] : want) {
    auto it = got.find(name);
    REQUIRE_MESSAGE(it != got.end(), "the net has no '", name, "' (golden '", prefix, ".", name, "')");
    if (name.ends_with("running_mean") || name.ends_with("running_var") || name.ends_with("num_batches_tracked"))
      expect_close(prefix + "." + name, it->second, t, kForwardRtol, buffers);
    else
      expect_close(prefix + "." + name, it->second, t, kStepRtol, params);
  }
  report(label + ": parameters", params);
  report(label + ": BatchNorm buffers", buffers);
}

/// One training step as the script takes it: zero_grad, a train-mode forward of the
/// whole batch, mean cross-entropy, backward, step.
void train_step(nn::Module& net, optim::Optimizer& opt, const Tensor& x, const Tensor& y) {
  opt.zero_grad();
  nn::cross_entropy(net(x), y).backward();
  opt.step();
}

}  // namespace

TEST_CASE("golden: the script's network has PyTorch's state_dict names") {
  const Golden& g = golden_file();
  std::vector<std::string> want, got;
  for (auto& [name, t] : g.state("init")) want.push_back(name);
  for (auto& [name, t] : make_net()->state_dict()) got.push_back(name);
  CHECK(got == want);
}

TEST_CASE("golden: logits, loss, gradients and BatchNorm buffers after one forward match PyTorch") {
  const Golden& g = golden_file();
  auto net = make_initialised_net(g);
  const Tensor& x = g.tensor("input");
  const Tensor& y = g.tensor("target");

  Tensor logits = (*net)(x);
  Tensor loss = nn::cross_entropy(logits, y);
  loss.backward();

  Worst forward, grads, buffers;
  expect_close("logits", logits, g.tensor("logits"), kForwardRtol, forward);
  expect_close("loss", loss, g.tensor("loss"), kForwardRtol, forward);
  for (auto& [name, p] : net->named_parameters())
    expect_close("grad." + name, p.grad(), g.tensor("grad." + name), kGradRtol, grads);
  for (auto& [name, b] : net->named_buffers())
    expect_close("forward." + name, b, g.tensor("forward." + name), kForwardRtol, buffers);
  report("logits and loss", forward);
  report("gradients", grads);
  report("BatchNorm buffers after the forward", buffers);
}

TEST_CASE("golden: 3 optimizer steps on cpu(0) match PyTorch") {
  const Golden& g = golden_file();
  const Tensor& x = g.tensor("input");
  const Tensor& y = g.tensor("target");
  auto net = make_initialised_net(g);

  SUBCASE("Adam") {
    expect_adam_meta(g, "adam", kAdam.lr, kAdam.betas, kAdam.eps, kAdam.weight_decay);
    optim::Adam opt(net->parameters(), kAdam);
    for (int s = 0; s < kSteps; ++s) train_step(*net, opt, x, y);
    expect_state_close("Adam, 3 steps", "adam", *net, g);
  }
  SUBCASE("AdamW") {
    expect_adam_meta(g, "adamw", kAdamW.lr, kAdamW.betas, kAdamW.eps, kAdamW.weight_decay);
    optim::AdamW opt(net->parameters(), kAdamW);
    for (int s = 0; s < kSteps; ++s) train_step(*net, opt, x, y);
    expect_state_close("AdamW, 3 steps", "adamw", *net, g);
  }
  SUBCASE("SGD with momentum and weight decay") {
    expect_meta(g, "sgd.lr", kSgd.lr);
    expect_meta(g, "sgd.momentum", kSgd.momentum);
    expect_meta(g, "sgd.dampening", kSgd.dampening);
    expect_meta(g, "sgd.weight_decay", kSgd.weight_decay);
    CHECK(g.meta("sgd.nesterov") == (kSgd.nesterov ? "true" : "false"));
    optim::SGD opt(net->parameters(), kSgd);
    for (int s = 0; s < kSteps; ++s) train_step(*net, opt, x, y);
    expect_state_close("SGD, 3 steps", "sgd", *net, g);
  }
}

// DataParallel on 2 devices splits the batch in 2 shards of 4 and, as PyTorch's
// DataParallel, normalises each shard with its own BatchNorm statistics; device 0's
// running statistics are updated from shard 0 only (DP copies device 0's buffers to
// the replicas before each forward; DDP broadcasts them). So the reference is the
// script's "dp2.*" run, not the full-batch one. Gradients are compared as well as
// parameters because Adam's update barely depends on the gradient's scale: a
// reduction that doubled every gradient would pass a parameter-only check.
TEST_CASE("golden: DataParallel on 2 devices matches PyTorch with per-shard BatchNorm") {
  const Golden& g = golden_file();
  expect_meta(g, "dp2.shards", 2);
  expect_adam_meta(g, "adam", kAdam.lr, kAdam.betas, kAdam.eps, kAdam.weight_decay);
  const Tensor& x = g.tensor("input");
  const Tensor& y = g.tensor("target");
  auto loss_fn = [](const Tensor& out, const Tensor& target) { return nn::cross_entropy(out, target); };

  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    for (bool worker_loss : {false, true}) {
      const std::string label = std::string(mode == dp::Mode::DP ? "DP" : "DDP") +
                                (worker_loss ? ", forward_backward" : ", forward + backward");
      CAPTURE(label);
      auto net = make_initialised_net(g);
      dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = mode});
      optim::Adam opt(model.parameters(), kAdam);
      Worst first;
      for (int s = 0; s < kSteps; ++s) {
        opt.zero_grad();
        Tensor loss;
        if (worker_loss) {
          loss = model.forward_backward(x, y, loss_fn);
        } else {
          Tensor logits = model(x);
          loss = nn::cross_entropy(logits, y);
          loss.backward();
          if (s == 0) expect_close("dp2.logits", logits, g.tensor("dp2.logits"), kForwardRtol, first);
        }
        if (s == 0) {
          expect_close("dp2.loss", loss, g.tensor("dp2.loss"), kForwardRtol, first);
          for (auto& [name, p] : net->named_parameters())
            expect_close("dp2.grad." + name, p.grad(), g.tensor("dp2.grad." + name), kGradRtol, first);
        }
        opt.step();
      }
      report(label + ": first step (loss, gradients)", first);
      expect_state_close(label + ": Adam, 3 steps", "dp2.adam", *net, g);
    }
  }
}

TEST_CASE("golden: a missing file or tensor fails with a message naming it") {
  io_test::ScratchDir dir;
  const std::string missing = dir.file("nowhere.safetensors");
  CHECK_THROWS_WITH_AS(Golden{missing}, doctest::Contains((missing + " is missing").c_str()), std::runtime_error);

  const std::string partial = dir.file("partial.safetensors");
  dp::io::write_safetensors(partial, {{"input", dp::zeros({2, 1, 12, 12})}});
  Golden g(partial);
  CHECK_THROWS_WITH_AS(g.tensor("grad.9.bias"), doctest::Contains("has no tensor 'grad.9.bias'"),
                       std::runtime_error);
  CHECK_THROWS_WITH_AS(g.state("adam"), doctest::Contains("has no tensors named 'adam.*'"), std::runtime_error);
  CHECK_THROWS_WITH_AS(g.meta("adam.lr"), doctest::Contains("has no metadata 'adam.lr'"), std::runtime_error);
}
