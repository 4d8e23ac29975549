// Tests for dp/optim/adam.h and adamw.h: three steps against PyTorch's formulas computed
// in double (with and without weight decay, coupled and decoupled); option checks.
#include <doctest/doctest.h>

#include "dp/optim/adam.h"
#include "dp/optim/adamw.h"
#include "optim_test_util.h"

using namespace optim_test;

namespace {

template <typename Opt, typename Options>
void check_adam(dp::Device dev, Options o, bool decoupled) {
  CAPTURE(o.weight_decay);
  CAPTURE(decoupled);
  auto net = tiny_net(dev);
  auto params = net->parameters();
  std::vector<D> p, m, v;
  for (const auto& t : params) {
    p.push_back(to_double(t.to_vector()));
    m.emplace_back(static_cast<std::size_t>(t.numel()), 0.0);
    v.emplace_back(static_cast<std::size_t>(t.numel()), 0.0);
  }
  Opt opt(params, o);
  AdamRef ref{o.lr, std::get<0>(o.betas), std::get<1>(o.betas), o.eps, o.weight_decay, decoupled};
  for (int t = 0; t < 3; ++t) {
    opt.zero_grad();
    set_grads(params, t);
    opt.step();
    for (std::size_t k = 0; k < params.size(); ++k)
      for (std::size_t i = 0; i < p[k].size(); ++i) ref.step(p[k][i], grad_value(k, i, t), m[k][i], v[k][i], t + 1);
  }
  for (std::size_t k = 0; k < params.size(); ++k) {
    CAPTURE(k);
    CHECK(max_rel_diff(params[k].to_vector(), p[k]) < 2e-6);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("Adam and AdamW match PyTorch's formulas over 3 steps", Dev, DP_OPTIM_TEST_DEVICES) {
  const dp::Device dev = Dev::device();
  check_adam<dp::optim::Adam>(dev, dp::optim::AdamOptions{.lr = 1e-2}, false);
  check_adam<dp::optim::Adam>(dev, dp::optim::AdamOptions{.lr = 1e-2, .betas = {0.8, 0.99},
                                                          .eps = 1e-6, .weight_decay = 0.1},
                              false);
  check_adam<dp::optim::AdamW>(dev, dp::optim::AdamWOptions{.lr = 1e-2}, true);  // wd 1e-2
  check_adam<dp::optim::AdamW>(dev, dp::optim::AdamWOptions{.lr = 5e-2, .weight_decay = 0.3}, true);
}

TEST_CASE("the per-step scalars are PyTorch's: computed in double from the options, rounded once") {
  // Note [Optimizer scalars in double] (src/backend/functors.h). One step from zero state:
  // exp_avg = w1·g and exp_avg_sq = w2·g·g with w1 = float(1 - beta1), w2 = float(1 - beta2)
  // as PyTorch's lerp_ and addcmul_ get them from Python floats; AdamW first scales p by
  // float(1 - lr·wd). Rounding beta2 = 0.999 to float before subtracting makes w2
  // 0.00099998713, 1.3e-5 away (every exp_avg_sq off by that much).
  for (const auto& [beta1, beta2] : {std::pair{0.9, 0.999}, std::pair{0.8, 0.95}, std::pair{0.3, 0.98}}) {
    CAPTURE(beta1);
    CAPTURE(beta2);
    const float w1 = static_cast<float>(1.0 - beta1), w2 = static_cast<float>(1.0 - beta2);
    CHECK(w2 != 1.0f - static_cast<float>(beta2));  // the two roundings differ for each pair
    const std::vector<float> g{0.5f, -1.25f, 3.0f, 1e-3f, -7.5f};
    const std::vector<float> p0{1.0f, -2.0f, 0.5f, 0.25f, 3.0f};
    dp::Tensor p = dp::from_vector(p0, {5}, dp::cpu(0)).set_requires_grad(true);
    const double lr = 0.01, wd = 0.3;
    dp::optim::AdamW opt(std::vector<dp::Tensor>{p}, {.lr = lr, .betas = {beta1, beta2}, .weight_decay = wd});
    p.set_grad(dp::from_vector(g, {5}, dp::cpu(0)));
    opt.step();
    std::vector<float> m, v;
    for (const auto& [name, t] : opt.state_dict()) {
      if (name == "state.0.exp_avg") m = t.to_vector();
      if (name == "state.0.exp_avg_sq") v = t.to_vector();
    }
    REQUIRE(m.size() == 5);
    REQUIRE(v.size() == 5);
    const float decay = static_cast<float>(1.0 - lr * wd);
    const float step_size = static_cast<float>(lr / (1.0 - beta1));
    const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - beta2));
    const auto got = p.to_vector();
    for (std::size_t i = 0; i < g.size(); ++i) {
      CAPTURE(i);
      CHECK(m[i] == w1 * g[i]);
      CHECK(v[i] == w2 * g[i] * g[i]);
      const float denom = std::sqrt(v[i]) / bc2_sqrt + 1e-8f;
      CHECK(got[i] == p0[i] * decay - step_size * (m[i] / denom));
    }
  }
}

TEST_CASE("Adam options: PyTorch defaults and range checks") {
  CHECK(dp::optim::AdamOptions{}.lr == 1e-3);
  CHECK(dp::optim::AdamOptions{}.weight_decay == 0);
  CHECK(dp::optim::AdamWOptions{}.weight_decay == 1e-2);
  auto net = tiny_net(dp::cpu(0));
  CHECK_THROWS_AS(dp::optim::Adam(net->parameters(), {.lr = -1e-3}), dp::Error);
  CHECK(throws_with([&] { dp::optim::Adam(net->parameters(), {.betas = {1.0, 0.999}}); },
                    {"Adam", "betas[0] (beta1) in [0, 1)", "{1, 0.999}"}));
  CHECK(throws_with([&] { dp::optim::Adam(net->parameters(), {.betas = {0.9, -0.1}}); },
                    {"Adam", "betas[1] (beta2) in [0, 1)", "{0.9, -0.1}"}));
  CHECK(throws_with([&] { dp::optim::AdamW(net->parameters(), {.betas = {0.9, 1.0}}); },
                    {"AdamW", "betas[1] (beta2)"}));
  CHECK(throws_with([&] { dp::optim::AdamW(net->parameters(), {.betas = {std::nan(""), 0.9}}); },
                    {"AdamW", "betas[0] (beta1)"}));
  CHECK_THROWS_AS(dp::optim::Adam(net->parameters(), {.eps = -1}), dp::Error);
  CHECK_THROWS_AS(dp::optim::AdamW(net->parameters(), {.weight_decay = -1}), dp::Error);
  dp::optim::AdamW w(net->parameters());
  CHECK(w.options().weight_decay == 1e-2);
}

namespace {

// Parameters of tiny_net after three steps of `Opt` with `o` and set_grads' gradients.
template <typename Opt, typename Options>
std::vector<std::vector<float>> after_three_steps(Options o) {
  auto net = tiny_net(dp::cpu(0));
  auto params = net->parameters();
  Opt opt(params, o);
  for (int t = 0; t < 3; ++t) {
    opt.zero_grad();
    set_grads(params, t);
    opt.step();
  }
  std::vector<std::vector<float>> out;
  for (const auto& p : params) out.push_back(p.to_vector());
  return out;
}

}  // namespace

// dp 0.1's spelling, kept for the 0.2 release (Note [Deprecated beta1 and beta2]): this
// test uses it on purpose, so the deprecation warning is silenced here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST_CASE("Adam and AdamW: the deprecated beta1/beta2 train as betas does, and a conflict is an error") {
  using dp::optim::Adam;
  using dp::optim::AdamOptions;
  using dp::optim::AdamW;
  using dp::optim::AdamWOptions;
  // Bitwise the same parameters: the old fields become betas before the first step.
  CHECK(after_three_steps<Adam>(AdamOptions{.lr = 1e-2, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6}) ==
        after_three_steps<Adam>(AdamOptions{.lr = 1e-2, .betas = {0.8, 0.99}, .eps = 1e-6}));
  CHECK(after_three_steps<AdamW>(AdamWOptions{.lr = 1e-2, .beta1 = 0.7, .beta2 = 0.95, .weight_decay = 0.1}) ==
        after_three_steps<AdamW>(AdamWOptions{.lr = 1e-2, .betas = {0.7, 0.95}, .weight_decay = 0.1}));
  // One old field alone replaces its half; the other keeps its default.
  CHECK(after_three_steps<Adam>(AdamOptions{.lr = 1e-2, .beta1 = 0.5}) ==
        after_three_steps<Adam>(AdamOptions{.lr = 1e-2, .betas = {0.5, 0.999}}));
  // And it does change the training (the comparisons above could not pass by ignoring it).
  CHECK(after_three_steps<Adam>(AdamOptions{.lr = 1e-2, .beta1 = 0.5}) !=
        after_three_steps<Adam>(AdamOptions{.lr = 1e-2}));

  auto net = tiny_net(dp::cpu(0));
  // The optimizer keeps betas only: momentum() and options() read the given value.
  Adam adam(net->parameters(), {.lr = 1e-3, .beta1 = 0.8, .beta2 = 0.99});
  CHECK(adam.options().betas == dp::optim::AdamBetas{0.8, 0.99});
  CHECK(adam.momentum() == 0.8);
  CHECK_FALSE(adam.options().beta1.value.has_value());
  CHECK_FALSE(adam.options().beta2.value.has_value());
  // Assigned as a member, as 0.1's code could.
  AdamWOptions o;
  o.beta2 = 0.9;
  AdamW adamw(net->parameters(), o);
  CHECK(adamw.options().betas == dp::optim::AdamBetas{0.9, 0.9});
  CHECK(adamw.options().weight_decay == 1e-2);

  // Both spellings given: the same values are accepted, different ones refused.
  CHECK_NOTHROW(Adam(net->parameters(), {.betas = {0.8, 0.99}, .beta1 = 0.8, .beta2 = 0.99}));
  CHECK(throws_with([&] { Adam(net->parameters(), {.betas = {0.7, 0.999}, .beta1 = 0.8}); },
                    {"Adam", "deprecated beta1", "betas[0]", "0.8", "0.7", "give betas = {beta1, beta2} only"}));
  CHECK(throws_with([&] { AdamW(net->parameters(), {.betas = {0.9, 0.99}, .beta2 = 0.95}); },
                    {"AdamW", "deprecated beta2", "betas[1]", "0.95", "0.99"}));
  // A value out of range is refused as for betas.
  CHECK(throws_with([&] { Adam(net->parameters(), {.beta1 = 1.0}); }, {"Adam", "betas[0] (beta1) in [0, 1)"}));
  CHECK(throws_with([&] { AdamW(net->parameters(), {.beta2 = -0.5}); }, {"AdamW", "betas[1] (beta2) in [0, 1)"}));
}
#pragma GCC diagnostic pop
