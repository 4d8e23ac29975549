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
