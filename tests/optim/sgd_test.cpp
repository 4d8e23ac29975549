// Tests for dp/optim/sgd.h: three steps against PyTorch's formulas computed in double,
// for plain SGD, momentum, dampening, Nesterov and weight decay; option checks.
#include <algorithm>
#include <doctest/doctest.h>

#include "dp/optim/sgd.h"
#include "optim_test_util.h"

using namespace optim_test;

namespace {

void check_sgd(dp::Device dev, dp::optim::SGDOptions o) {
  CAPTURE(o.momentum);
  CAPTURE(o.dampening);
  CAPTURE(o.weight_decay);
  CAPTURE(o.nesterov);
  auto net = tiny_net(dev);
  auto params = net->parameters();
  std::vector<D> p, buf;
  for (const auto& t : params) {
    p.push_back(to_double(t.to_vector()));
    buf.emplace_back(static_cast<std::size_t>(t.numel()), 0.0);
  }
  dp::optim::SGD opt(params, o);
  SgdRef ref{o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov};
  for (int t = 0; t < 3; ++t) {
    opt.zero_grad();
    set_grads(params, t);
    opt.step();
    for (std::size_t k = 0; k < params.size(); ++k)
      for (std::size_t i = 0; i < p[k].size(); ++i) ref.step(p[k][i], grad_value(k, i, t), buf[k][i], t == 0);
  }
  CHECK(opt.step_count() == 3);
  for (std::size_t k = 0; k < params.size(); ++k) {
    CAPTURE(k);
    CHECK(params[k].device() == dev);
    CHECK(max_rel_diff(params[k].to_vector(), p[k]) < 2e-6);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("SGD matches PyTorch's formulas over 3 steps", Dev, DP_OPTIM_TEST_DEVICES) {
  const dp::Device dev = Dev::device();
  check_sgd(dev, {.lr = 0.1});
  check_sgd(dev, {.lr = 0.1, .momentum = 0.9});
  check_sgd(dev, {.lr = 0.05, .momentum = 0.8, .dampening = 0.3});
  check_sgd(dev, {.lr = 0.1, .momentum = 0.9, .nesterov = true});
  check_sgd(dev, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true});
  check_sgd(dev, {.lr = 0.2, .weight_decay = 0.1});
  check_sgd(dev, {.lr = 0.05, .momentum = 0.5, .dampening = 0.5, .weight_decay = 0.2});
}

TEST_CASE("SGD's 1 - dampening is computed in double from the option and rounded once, as PyTorch's") {
  // Note [Optimizer scalars in double]: buf = momentum·buf + float(1 - dampening)·g.
  for (const double dampening : {0.6, 0.9, 0.99}) {
    CAPTURE(dampening);
    const float d1 = static_cast<float>(1.0 - dampening), m = 0.9f;
    CHECK(d1 != 1.0f - static_cast<float>(dampening));  // the two roundings differ for each
    dp::Tensor p = dp::from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}, dp::cpu(0)).set_requires_grad(true);
    dp::optim::SGD opt(std::vector<dp::Tensor>{p}, {.lr = 0.1, .momentum = 0.9, .dampening = dampening});
    const std::vector<float> g1{0.3f, -1.7f, 2.9f}, g2{1.1f, 0.45f, -3.3f};
    p.set_grad(dp::from_vector(g1, {3}, dp::cpu(0)));
    opt.step();  // buf = g1 (PyTorch's first step takes the gradient undampened)
    p.set_grad(dp::from_vector(g2, {3}, dp::cpu(0)));
    opt.step();
    std::vector<float> buf;
    for (const auto& [name, t] : opt.state_dict())
      if (name == "state.0.momentum_buffer") buf = t.to_vector();
    REQUIRE(buf.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) CHECK(buf[i] == m * g1[i] + d1 * g2[i]);
  }
}

TEST_CASE("SGD keeps a momentum buffer while momentum is 0, in state_dict too, and takes it up again") {
  // Note [Optimizer state starts]. PyTorch 2.15, SGD(lr = 0.1) with momentum 0.9, 0, 0.9
  // over three steps of gradients (0.3, -1.7, 2.9) · t: the parameters end at
  // (0.793, -0.827, -1.501) and the buffer at (1.17, -6.63, 11.31); the second step leaves
  // the buffer (0.3, -1.7, 2.9) in its state_dict. A run saved and resumed at that point
  // continues bit for bit (before, the state dict had no buffer and the resumed run
  // restarted it from the third gradient).
  for (const bool module : {false, true}) {
    CAPTURE(module);
    auto run = [&](bool resume) {
      auto net = tiny_net(dp::cpu(0));
      std::vector<dp::Tensor> loose{dp::from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}, dp::cpu(0))
                                        .set_requires_grad(true)};
      auto params = module ? net->parameters().tensors() : loose;
      auto opt = std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
      if (module) opt = std::make_unique<dp::optim::SGD>(net->parameters(), dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
      std::optional<std::vector<float>> saved_buffer;
      int t = 0;
      for (const double m : {0.9, 0.0, 0.9}) {
        ++t;
        auto o = opt->options(0);
        o.momentum = m;
        opt->set_options(0, o);
        for (auto& p : params) {
          std::vector<float> g(static_cast<std::size_t>(p.numel()));
          for (std::size_t i = 0; i < g.size(); ++i) g[i] = std::vector<float>{0.3f, -1.7f, 2.9f}[i % 3] * float(t);
          p.set_grad(dp::from_vector(g, p.shape(), dp::cpu(0)));
        }
        opt->step();
        if (t == 2) {
          const auto sd = opt->state_dict();
          for (const auto& [name, v] : sd)
            if (name == "state.0.momentum_buffer") saved_buffer = v.to_vector();
          if (resume) {
            const auto groups = opt->param_groups_state();
            opt = module ? std::make_unique<dp::optim::SGD>(net->parameters(), dp::optim::SGDOptions{.lr = 0.1})
                         : std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1});
            opt->load_state_dict(sd);
            opt->load_param_groups_state(groups);
          }
        }
      }
      std::vector<float> out;
      for (const auto& p : params)
        for (float x : p.to_vector()) out.push_back(x);
      REQUIRE(saved_buffer.has_value());
      CHECK(saved_buffer->at(0) == 0.3f);
      return out;
    };
    const auto plain = run(false), resumed = run(true);
    CHECK(plain == resumed);
    if (!module) {
      CHECK(plain[0] == doctest::Approx(0.793).epsilon(1e-6));
      CHECK(plain[1] == doctest::Approx(-0.827).epsilon(1e-6));
      CHECK(plain[2] == doctest::Approx(-1.501).epsilon(1e-6));
    }
  }
}

TEST_CASE("a parameter frozen when its group's momentum began starts its buffer at its own first step with it") {
  // PyTorch keeps state per parameter: the buffer starts as the gradient itself
  // (undampened) at the parameter's first step with momentum, here after the group's.
  // Before, dp started it per group and dampened the new gradient into a zero buffer:
  // half of PyTorch's with dampening 0.5 (the optimizer fuzzer, program 4228).
  auto net = tiny_net(dp::cpu(0));
  auto params = net->parameters();
  dp::optim::SGD opt(params, {.lr = 0.1, .momentum = 0.0, .dampening = 0.5});
  auto grads = [&](float scale) {
    for (std::size_t k = 0; k < params.size(); ++k) {
      std::vector<float> g(static_cast<std::size_t>(params[k].numel()), scale * float(k + 1));
      params[k].set_grad(dp::from_vector(g, params[k].shape(), dp::cpu(0)));
    }
  };
  grads(1.0f);
  opt.step();  // no momentum yet: no buffer anywhere
  opt.zero_grad();
  params[0].set_requires_grad(false);
  auto o = opt.options(0);
  o.momentum = 0.9;
  opt.set_options(0, o);
  grads(2.0f);
  opt.step();  // every parameter but the first starts its buffer: 2·(k + 1)
  opt.zero_grad();
  params[0].set_requires_grad(true);
  grads(3.0f);
  opt.step();  // the first starts now: 3·1; the others 0.9·2(k + 1) + 0.5·3(k + 1)
  std::vector<float> buf;
  for (const auto& [name, t] : opt.state_dict())
    if (name == "state.0.momentum_buffer") buf = t.to_vector();
  REQUIRE(!buf.empty());
  for (float b : buf) CHECK(b == 3.0f);
  for (const auto& [name, t] : opt.state_dict())
    if (name == "state.1.momentum_buffer")
      for (float b : t.to_vector()) CHECK(b == 0.9f * 4.0f + 0.5f * 6.0f);
}

TEST_CASE("a state_dict lists the entries whose state has started, as PyTorch's: a resume starts the others afresh") {
  // The first parameter steps while the group has no momentum and is frozen at the step
  // momentum begins: its buffer has not started, and PyTorch's state has none for it.
  // A resume must not start it as a zero buffer (its next gradient would be dampened
  // into zeros, half of PyTorch's buffer with dampening 0.5).
  auto run = [](bool resume) {
    auto net = tiny_net(dp::cpu(0));
    auto params = net->parameters();
    auto opt = std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1, .dampening = 0.5});
    auto grads = [&](float scale) {
      for (std::size_t k = 0; k < params.size(); ++k) {
        std::vector<float> g(static_cast<std::size_t>(params[k].numel()), scale * float(k + 1));
        params[k].set_grad(dp::from_vector(g, params[k].shape(), dp::cpu(0)));
      }
    };
    grads(1.0f);
    opt->step();  // no momentum yet: no buffer anywhere
    params[0].set_requires_grad(false);
    auto o = opt->options(0);
    o.momentum = 0.9;
    opt->set_options(0, o);
    grads(2.0f);
    opt->step();  // every parameter but the first starts its buffer
    const dp::nn::StateDict state = opt->state_dict();
    for (const auto& [name, t] : state) CHECK(name != "state.0.momentum_buffer");  // PyTorch: none in state[p0]
    CHECK(std::count_if(state.begin(), state.end(), [](const auto& e) { return e.first.find("momentum_buffer") !=
                                                                                std::string::npos; }) ==
          static_cast<std::ptrdiff_t>(params.size() - 1));
    if (resume) {
      opt = std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1, .dampening = 0.5});
      opt->set_options(0, o);
      opt->load_state_dict(state);
    }
    params[0].set_requires_grad(true);
    grads(3.0f);
    opt->step();  // the first starts now, from its gradient: 3·1
    std::vector<float> buf;
    for (const auto& [name, t] : opt->state_dict())
      if (name == "state.0.momentum_buffer") buf = t.to_vector();
    return buf;
  };
  for (bool resume : {false, true}) {
    CAPTURE(resume);
    const std::vector<float> buf = run(resume);
    REQUIRE(!buf.empty());
    for (float b : buf) CHECK(b == 3.0f);
  }
}

TEST_CASE("SGD rejects bad options") {
  auto net = tiny_net(dp::cpu(0));
  CHECK_THROWS_AS(dp::optim::SGD(net->parameters(), {.lr = -1}), dp::Error);
  CHECK_THROWS_AS(dp::optim::SGD(net->parameters(), {.lr = 0.1, .momentum = -0.1}), dp::Error);
  CHECK_THROWS_AS(dp::optim::SGD(net->parameters(), {.lr = 0.1, .weight_decay = -1}), dp::Error);
  CHECK_THROWS_AS(dp::optim::SGD(net->parameters(), {.lr = 0.1, .nesterov = true}), dp::Error);
  CHECK_THROWS_AS(dp::optim::SGD(net->parameters(), {.lr = 0.1, .momentum = 0.9, .dampening = 0.1,
                                                     .nesterov = true}),
                  dp::Error);
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
  opt.set_lr(0.5);
  CHECK(opt.lr() == 0.5);
  CHECK_THROWS_AS(opt.set_lr(-0.1), dp::Error);
}
