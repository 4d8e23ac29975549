// Parameter groups (Note [Parameter groups] in dp/optim/optimizer.h) under every
// DataParallel design: AdamW with weight decay on matrices only and another lr for the
// rest, and SGD with a momentum per group, on 1-3 devices, bitwise equal to one device
// — also where a Sharded copy's range cuts through several groups, and with a tied
// parameter in a group.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;
namespace optim = dp::optim;

/// nanoGPT's groups: weight decay on matrices, none (and half the lr) on the rest.
std::unique_ptr<optim::Optimizer> adamw_groups(const dp::nn::ParameterList& params) {
  auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
  auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
  return std::make_unique<optim::AdamW>(
      std::vector<optim::AdamParamGroup>{{matrices, {.weight_decay = 0.1}}, {others, {.lr = 5e-3, .weight_decay = 0.0}}},
      optim::AdamWOptions{.lr = 1e-2, .betas = {0.9, 0.95}});
}

/// SGD with the biases first, their own momentum and dampening.
std::unique_ptr<optim::Optimizer> sgd_groups(const dp::nn::ParameterList& params) {
  auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
  auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
  return std::make_unique<optim::SGD>(
      std::vector<optim::SGDParamGroup>{{others, {.lr = 0.02, .momentum = 0.5, .dampening = 0.1}},
                                        {matrices, {.weight_decay = 1e-3, .nesterov = true}}},
      optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
}

using MakeOpt = std::function<std::unique_ptr<optim::Optimizer>(const dp::nn::ParameterList&)>;

struct Result {
  std::vector<float> params, state;
};

/// 5 steps of the MLP on n devices (0: one device, no DataParallel).
Result train_mlp(int n, const dp::DataParallelOptions& o, const MakeOpt& make) {
  auto net = make_mlp(7);
  std::unique_ptr<dp::DataParallel> model;
  if (n > 0) model = std::make_unique<dp::DataParallel>(net, cpus(n), o);
  auto opt = make(model ? model->parameters() : net->parameters());
  for (int s = 0; s < 5; ++s) {
    const Batch b = make_batch(12, 30 + s);
    opt->zero_grad();
    if (model) {
      model->forward_backward(b.x, b.y, loss_fn);
    } else {
      loss_fn(net->forward(b.x), b.y).backward();
    }
    opt->step();
  }
  return {flat(net->state_dict()), flat(opt->state_dict())};
}

/// 4 steps of the tied GPT (its embedding, in the matrices' group, is also the head).
Result train_gpt(int n, const dp::DataParallelOptions& o) {
  auto net = std::make_shared<TiedGPT>(5);
  std::unique_ptr<dp::DataParallel> model;
  if (n > 0) model = std::make_unique<dp::DataParallel>(net, cpus(n), o);
  auto opt = adamw_groups(model ? model->parameters() : net->parameters());
  for (int s = 0; s < 4; ++s) {
    const Batch b = make_token_batch(6, 50 + s);
    opt->zero_grad();
    if (model) {
      model->forward_backward(b.x, b.y, token_loss);
    } else {
      token_loss(net->forward(b.x), b.y).backward();
    }
    opt->step();
  }
  return {flat(net->state_dict()), flat(opt->state_dict())};
}

// One device against several: per-shard GEMMs and a sum over devices round differently
// (the designs agree with each other bit for bit, and with one device to this).
constexpr double kTolerance = 2e-5;

/// Every design on n devices: bitwise the same as each other; on 1 device bitwise as
/// plain training, on more within `tolerance` of it when given.
void check_designs(const Result& single, int n, const std::function<Result(const dp::DataParallelOptions&)>& run,
                   std::optional<double> tolerance = kTolerance) {
  std::optional<Result> first;
  for (const NamedDesign& d : every_design()) {
    CAPTURE(d.name);
    CAPTURE(n);
    const Result r = run(d.options);
    if (!first) first = r;
    CHECK(r.params == first->params);
    CHECK(r.state == first->state);
    if (n == 1) {
      CHECK(r.params == single.params);
      CHECK(r.state == single.state);
    } else if (tolerance) {
      CHECK(max_diff(r.params, single.params) < *tolerance);
    }
  }
}

}  // namespace

TEST_CASE("param groups: every design on 1-3 devices steps as one device (bitwise on one, alike across designs)") {
  for (const auto& [name, make] : std::vector<std::pair<std::string, MakeOpt>>{{"AdamW", adamw_groups},
                                                                              {"SGD", sgd_groups}}) {
    CAPTURE(name);
    const Result single = train_mlp(0, {}, make);
    for (int n = 1; n <= 3; ++n) {
      check_designs(single, n, [&, make = make](const dp::DataParallelOptions& o) { return train_mlp(n, o, make); });
    }
  }
}

TEST_CASE("param groups: a tied parameter in a group, every design on 1-3 devices") {
  // Against one device only on one device: Adam divides by sqrt(v), so the attention's
  // near-zero gradients (rounding noise, which several devices round differently)
  // become steps of either sign (scripts/make_golden_gpt.py says more).
  const Result single = train_gpt(0, {});
  for (int n = 1; n <= 3; ++n)
    check_designs(single, n, [&](const dp::DataParallelOptions& o) { return train_gpt(n, o); }, std::nullopt);
}

TEST_CASE("param groups: the groups' hyper-parameters reach the step (one group differs, the result differs)") {
  // The same run with one group's weight decay changed moves the parameters: the
  // designs above compare runs that each use their groups' values.
  const Result a = train_mlp(3, every_design().back().options, adamw_groups);
  const Result b = train_mlp(3, every_design().back().options, [](const dp::nn::ParameterList& params) {
    auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
    auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
    return std::make_unique<optim::AdamW>(
        std::vector<optim::AdamParamGroup>{{matrices, {.weight_decay = 0.1}}, {others, {.lr = 5e-3, .weight_decay = 0.5}}},
        optim::AdamWOptions{.lr = 1e-2, .betas = {0.9, 0.95}});
  });
  CHECK(a.params != b.params);
}

TEST_CASE("param groups: a tied parameter given in two groups (under both its names) is refused") {
  auto net = std::make_shared<TiedGPT>(5);
  dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::DDP});
  const auto params = model.parameters();
  const Tensor wte = net->parameter("wte.weight"), head = net->parameter("lm_head.weight");
  auto as_wte = params.filter([&](const Tensor& p) { return p.is_same(wte); });
  auto as_head = params.filter([&](const Tensor& p) { return p.is_same(head); });
  REQUIRE(as_wte.size() == 1);
  REQUIRE(as_head.size() == 1);
  try {
    optim::AdamW opt({{as_wte, {.weight_decay = 0.1}}, {as_head, {.weight_decay = 0.0}}});
    FAIL("a parameter in two groups was accepted");
  } catch (const dp::Error& e) {
    const std::string m = e.what();
    CHECK_MESSAGE(m.find("expected each parameter in one group") != std::string::npos, m);
    CHECK_MESSAGE(m.find("in param group 0 and again in param group 1") != std::string::npos, m);
  }
}
