// Tests of parameter groups (Note [Parameter groups] in dp/optim/optimizer.h): AdamW
// and SGD over two groups against PyTorch's formulas in double, on a parameter set
// and on loose tensors; ranges that never merge across groups; unset fields taking the
// optimizer's values; group lrs under set_lr and the schedulers; param_groups_state
// round trips; and the errors of bad groups.
#include <doctest/doctest.h>

#include "dp/optim/optim.h"
#include "optim_test_util.h"

using namespace optim_test;
namespace optim = dp::optim;

namespace {

/// tiny_net's parameters in two groups: the weights (0 and 2) and the biases (1 and 3).
/// In the flat buffer they alternate, so a range that merged across groups would step
/// a bias with the weights' hyper-parameters.
struct Split {
  dp::nn::ParameterList all, weights, biases;
  explicit Split(dp::nn::ParameterList params)
      : all(params),
        weights(params.filter([](const dp::Tensor& p) { return p.dim() >= 2; })),
        biases(params.filter([](const dp::Tensor& p) { return p.dim() < 2; })) {}
};

/// PyTorch's AdamW in double over the weights (ref_w) and the biases (ref_b) for three
/// of set_grads' steps; indices k are those of `all`.
std::vector<D> adamw_reference(const dp::nn::ParameterList& all, const AdamRef& ref_w, const AdamRef& ref_b) {
  std::vector<D> p;
  for (const auto& t : all) p.push_back(to_double(t.to_vector()));
  std::vector<D> m = p, v = p;
  for (auto* s : {&m, &v})
    for (D& d : *s) std::fill(d.begin(), d.end(), 0.0);
  for (int t = 0; t < 3; ++t)
    for (std::size_t k = 0; k < p.size(); ++k) {
      const AdamRef& ref = all[k].dim() >= 2 ? ref_w : ref_b;
      for (std::size_t i = 0; i < p[k].size(); ++i) ref.step(p[k][i], grad_value(k, i, t), m[k][i], v[k][i], t + 1);
    }
  return p;
}

void check_close(const dp::nn::ParameterList& all, const std::vector<D>& want) {
  for (std::size_t k = 0; k < all.size(); ++k) {
    CAPTURE(k);
    CHECK(max_rel_diff(all[k].to_vector(), want[k]) < 2e-6);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("AdamW over two groups (decay / no decay, different lr) matches PyTorch's formulas", Dev,
                   DP_OPTIM_TEST_DEVICES) {
  for (const bool loose : {false, true}) {
    CAPTURE(loose);
    auto net = tiny_net(Dev::device());
    Split s(net->parameters());
    const std::vector<D> want = adamw_reference(s.all, AdamRef{1e-2, 0.9, 0.95, 1e-8, 0.1, true},
                                                AdamRef{5e-3, 0.9, 0.95, 1e-8, 0.0, true});
    const optim::AdamGroupOptions no_decay{.lr = 5e-3, .weight_decay = 0.0};
    // Loose: the same tensors without their set, stepped one by one.
    std::vector<optim::AdamParamGroup> groups;
    if (loose) {
      groups = {{s.weights.tensors(), {.weight_decay = 0.1}}, {s.biases.tensors(), no_decay}};
    } else {
      groups = {{s.weights, {.weight_decay = 0.1}}, {s.biases, no_decay}};
    }
    optim::AdamW opt(groups, {.lr = 1e-2, .betas = {0.9, 0.95}});
    REQUIRE(opt.num_param_groups() == 2);
    CHECK(opt.parameters().set() == (loose ? nullptr : s.all.set()));
    for (int t = 0; t < 3; ++t) {
      opt.zero_grad();
      set_grads(s.all.tensors(), t);
      opt.step();
    }
    check_close(s.all, want);
  }
}

TEST_CASE("SGD over two groups: each group's momentum, dampening and weight decay") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  const SgdRef ref_w{0.1, 0.9, 0.0, 1e-2, true}, ref_b{0.3, 0.5, 0.25, 0.0, false};
  std::vector<D> p, buf;
  for (const auto& t : s.all) {
    p.push_back(to_double(t.to_vector()));
    buf.emplace_back(p.back().size(), 0.0);
  }
  optim::SGD opt({{s.biases, {.lr = 0.3, .momentum = 0.5, .dampening = 0.25}},
                  {s.weights, {.weight_decay = 1e-2, .nesterov = true}}},
                 {.lr = 0.1, .momentum = 0.9});
  CHECK(opt.options(0).nesterov == false);
  CHECK(opt.options(1).nesterov == true);
  CHECK(opt.options(1).momentum == 0.9);  // unset: the optimizer's
  CHECK(opt.options(0).weight_decay == 0.0);
  for (int t = 0; t < 3; ++t) {
    opt.zero_grad();
    set_grads(s.all.tensors(), t);
    opt.step();
    for (std::size_t k = 0; k < p.size(); ++k) {
      const SgdRef& ref = s.all[k].dim() >= 2 ? ref_w : ref_b;
      for (std::size_t i = 0; i < p[k].size(); ++i) ref.step(p[k][i], grad_value(k, i, t), buf[k][i], t == 0);
    }
  }
  check_close(s.all, p);
  // state_dict numbers the parameters across the groups in order: the biases first.
  const auto sd = opt.state_dict();
  REQUIRE(sd.size() == 5);
  CHECK(sd[1].first == "state.0.momentum_buffer");
  CHECK(sd[1].second.shape() == s.biases[0].shape());
  CHECK(sd[3].second.shape() == s.weights[0].shape());
}

TEST_CASE("SGD: a group that gains momentum later starts its own buffer then, as PyTorch's") {
  // The weights have momentum from the first step, so the momentum buffer exists; the
  // biases (dampening 0.5) get momentum at the third step. PyTorch starts a parameter's
  // buffer at its first step with momentum (buf = g, no dampening): the biases' buffer
  // must start then, not continue from zeros (0.5 g).
  for (const bool loose : {false, true}) {
    CAPTURE(loose);
    auto net = tiny_net(dp::cpu(0));
    Split s(net->parameters());
    std::vector<optim::SGDParamGroup> groups;
    const optim::SGDGroupOptions later{.lr = 0.3, .momentum = 0.0, .dampening = 0.5};
    if (loose) groups = {{s.weights.tensors()}, {s.biases.tensors(), later}};
    else groups = {{s.weights}, {s.biases, later}};
    optim::SGD opt(groups, {.lr = 0.1, .momentum = 0.9});
    std::vector<D> p, buf;
    for (const auto& t : s.all) {
      p.push_back(to_double(t.to_vector()));
      buf.emplace_back(p.back().size(), 0.0);
    }
    for (int t = 0; t < 4; ++t) {
      if (t == 2) opt.set_group_momentum(1, 0.8);
      opt.zero_grad();
      set_grads(s.all.tensors(), t);
      opt.step();
      for (std::size_t k = 0; k < p.size(); ++k) {
        const bool weight = s.all[k].dim() >= 2;
        const SgdRef ref = weight ? SgdRef{0.1, 0.9} : SgdRef{0.3, t >= 2 ? 0.8 : 0.0, 0.5};
        const bool first = weight ? t == 0 : t == 2;
        for (std::size_t i = 0; i < p[k].size(); ++i) ref.step(p[k][i], grad_value(k, i, t), buf[k][i], first);
      }
    }
    check_close(s.all, p);
  }
}

TEST_CASE("state_dict lists a group's state once it started; a resumed group without one starts it like PyTorch") {
  // The biases have no momentum for two steps: PyTorch's state_dict has no
  // momentum_buffer for them, and a run resumed from it starts their buffer at the
  // first step with momentum (buf = g), as the uninterrupted run does.
  for (const bool loose : {false, true}) {
    CAPTURE(loose);
    auto make = [&](const Split& sp) {
      const optim::SGDGroupOptions none{.momentum = 0.0, .dampening = 0.5};
      std::vector<optim::SGDParamGroup> groups;
      if (loose) groups = {{sp.weights.tensors()}, {sp.biases.tensors(), none}};
      else groups = {{sp.weights}, {sp.biases, none}};
      return std::make_unique<optim::SGD>(groups, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    };
    auto step = [](optim::SGD& opt, const Split& sp, int t) {
      if (t == 2) opt.set_group_momentum(1, 0.8);
      opt.zero_grad();
      set_grads(sp.all.tensors(), t);
      opt.step();
    };
    auto net_a = tiny_net(dp::cpu(0)), net_b = tiny_net(dp::cpu(0));
    Split a(net_a->parameters()), b(net_b->parameters());
    auto straight = make(a), first = make(b);
    for (int t = 0; t < 2; ++t) {
      step(*straight, a, t);
      step(*first, b, t);
    }
    const dp::nn::StateDict sd = first->state_dict();
    std::vector<std::string> names;
    for (const auto& [name, tensor] : sd) names.push_back(name);
    // The weights are parameters 0 and 2 of tiny_net, in group 0: numbered first.
    CHECK(names == std::vector<std::string>{"step", "state.0.momentum_buffer", "state.1.momentum_buffer"});
    // Resumed into a fresh optimizer over the same parameters, then two more steps.
    auto resumed = make(b);
    resumed->load_state_dict(sd);
    for (int t = 2; t < 4; ++t) {
      step(*straight, a, t);
      step(*resumed, b, t);
    }
    for (std::size_t k = 0; k < a.all.size(); ++k) {
      CAPTURE(k);
      CHECK(a.all[k].to_vector() == b.all[k].to_vector());
    }
    CHECK(resumed->state_dict().size() == 5);  // every group started now
    // A state for some of a group's entries loads, as PyTorch's: the others start afresh,
    // their buffer the gradient itself at their next step (undampened).
    dp::nn::StateDict partial = resumed->state_dict();
    REQUIRE(partial.back().first == "state.3.momentum_buffer");
    partial.pop_back();
    auto other = make(b);
    other->set_group_momentum(1, 0.8);
    other->load_state_dict(partial);
    step(*other, b, 4);
    std::vector<float> buf;
    for (const auto& [name, t] : other->state_dict())
      if (name == "state.3.momentum_buffer") buf = t.to_vector();
    CHECK(buf == b.all[3].grad().to_vector());
  }
}

TEST_CASE("a group's unset fields take the optimizer's options; lr, set_lr and the group setters") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  optim::AdamW opt({{s.weights}, {s.biases, {.betas = optim::AdamBetas{0.8, 0.9}, .eps = 1e-6}}},
                   {.lr = 3e-3, .weight_decay = 0.2});
  CHECK(opt.options(0).lr == 3e-3);
  CHECK(opt.options(0).weight_decay == 0.2);
  CHECK(opt.options(0).betas == optim::AdamBetas{0.9, 0.999});
  CHECK(opt.options(1).betas == optim::AdamBetas{0.8, 0.9});
  CHECK(opt.options(1).eps == 1e-6);
  CHECK(opt.options(1).weight_decay == 0.2);
  CHECK(opt.group_parameters(1).size() == 2);
  opt.set_group_lr(1, 1e-4);
  CHECK(opt.group_lr(0) == 3e-3);
  CHECK(opt.group_lr(1) == 1e-4);
  CHECK(opt.lr() == 3e-3);  // group 0's
  CHECK(*opt.group_momentum(1) == 0.8);
  opt.set_momentum(0.85);  // every group's, as set_lr
  CHECK(*opt.group_momentum(0) == 0.85);
  CHECK(*opt.group_momentum(1) == 0.85);
  opt.set_lr(2e-3);
  CHECK(opt.group_lr(0) == 2e-3);
  CHECK(opt.group_lr(1) == 2e-3);
  optim::AdamOptions o = opt.options(1);
  o.weight_decay = 0.0;
  opt.set_options(1, o);
  CHECK(opt.options(1).weight_decay == 0.0);
  CHECK(opt.options(0).weight_decay == 0.2);
  // A refused value names the group and changes nothing.
  CHECK(throws_with([&] { opt.set_group_lr(1, -1.0); }, {"AdamW param group 1", "lr >= 0", "-1"}));
  CHECK(opt.group_lr(1) == 2e-3);
  o.weight_decay = -0.5;
  CHECK(throws_with([&] { opt.set_options(1, o); }, {"AdamW param group 1", "weight_decay >= 0", "-0.5"}));
  CHECK(throws_with([&] { (void)opt.group_lr(2); }, {"AdamW.", "a param group index below 2", "got 2"}));
  // One list: one group, as before.
  optim::SGD one(s.all, {.lr = 0.5});
  CHECK(one.num_param_groups() == 1);
  CHECK(one.group_lr(0) == 0.5);
  CHECK(throws_with([&] { one.set_group_lr(0, -1.0); }, {"SGD: expected lr >= 0", "-1"}));
}

TEST_CASE("schedulers step every group from its own base lr") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  optim::SGD opt({{s.weights}, {s.biases, {.lr = 0.01}}}, {.lr = 0.1, .momentum = 0.9});
  optim::StepLR sched(opt, {.step_size = 2, .gamma = 0.5});
  CHECK(sched.base_lrs() == std::vector<double>{0.1, 0.01});
  CHECK(opt.initial_lr(0) == 0.1);
  CHECK(opt.initial_lr(1) == 0.01);
  for (int e = 1; e <= 5; ++e) {
    sched.step();
    // PyTorch's chainable StepLR: lr × gamma at each multiple of step_size, per group.
    double w = 0.1, b = 0.01;
    for (int k = 2; k <= e; k += 2) {
      w *= 0.5;
      b *= 0.5;
    }
    CHECK(opt.group_lr(0) == w);
    CHECK(opt.group_lr(1) == b);
    CHECK(sched.get_last_lr() == std::vector<double>{w, b});
  }
  // A second scheduler takes each group's initial lr as its base.
  optim::LambdaLR lambda(opt, [](std::int64_t epoch) { return 1.0 / static_cast<double>(epoch + 1); });
  CHECK(lambda.base_lrs() == std::vector<double>{0.1, 0.01});
  lambda.step();
  CHECK(opt.group_lr(0) == 0.1 * (1.0 / 2));
  CHECK(opt.group_lr(1) == 0.01 * (1.0 / 2));
  // A state of another number of groups is refused.
  optim::LRSchedulerState st = sched.state_dict();
  st.base_lrs.pop_back();
  st.last_lrs.pop_back();
  CHECK(throws_with([&] { sched.load_state_dict(st); }, {"StepLR", "expected 2 parameter group(s)", "got 1"}));
}

TEST_CASE("OneCycleLR sets every group's lr and momentum; a failed construction restores each group") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  optim::Adam opt({{s.weights}, {s.biases, {.lr = 0.5, .betas = optim::AdamBetas{0.7, 0.99}}}}, {.lr = 0.1});
  CHECK(throws_with([&] { optim::OneCycleLR(opt, {.max_lr = 1.0, .total_steps = 10, .max_momentum = 1.0}); },
                    {"beta1 in [0, 1)"}));
  CHECK(*opt.group_momentum(0) == 0.9);
  CHECK(*opt.group_momentum(1) == 0.7);
  CHECK(!opt.initial_lr(0).has_value());
  CHECK(!opt.initial_lr(1).has_value());
  optim::OneCycleLR sched(opt, {.max_lr = 1.0, .total_steps = 10});
  CHECK(opt.group_lr(0) == doctest::Approx(1.0 / 25).epsilon(1e-12));  // max_lr / div_factor
  CHECK(opt.group_lr(1) == opt.group_lr(0));
  CHECK(*opt.group_momentum(1) == 0.95);
  sched.step();
  CHECK(opt.group_lr(0) == opt.group_lr(1));
  CHECK(*opt.group_momentum(0) == *opt.group_momentum(1));
}

TEST_CASE("OneCycleLR's max_lrs and LambdaLR's functions per group: each group follows its own schedule") {
  // PyTorch's list forms: group g's lr sequence is the one the scalar form gives an
  // optimizer of one group with that value, bit for bit (the scalar forms are checked
  // against PyTorch in lr_scheduler_test.cpp).
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  const std::vector<double> max_lrs = {0.3, 0.02};
  const std::vector<optim::LambdaLR::Lambda> lambdas = {
      [](std::int64_t e) { return std::pow(0.9, static_cast<double>(e)); },
      [](std::int64_t e) { return 1.0 / static_cast<double>(e + 1); }};
  for (const bool one_cycle : {true, false}) {
    CAPTURE(one_cycle);
    optim::SGD both({{s.weights}, {s.biases, {.lr = 0.05}}}, {.lr = 0.1, .momentum = 0.9});
    std::vector<std::unique_ptr<optim::SGD>> alone;
    std::vector<std::unique_ptr<optim::LRScheduler>> scalar;
    std::unique_ptr<optim::LRScheduler> listed;
    const dp::nn::ParameterList* lists[] = {&s.weights, &s.biases};
    for (std::size_t g = 0; g < 2; ++g) {
      alone.push_back(std::make_unique<optim::SGD>(*lists[g], optim::SGDOptions{.lr = g == 0 ? 0.1 : 0.05,
                                                                                  .momentum = 0.9}));
      if (one_cycle)
        scalar.push_back(std::make_unique<optim::OneCycleLR>(
            *alone[g], optim::OneCycleLROptions{.max_lr = max_lrs[g], .total_steps = 12, .three_phase = true}));
      else
        scalar.push_back(std::make_unique<optim::LambdaLR>(*alone[g], lambdas[g]));
    }
    if (one_cycle)
      listed = std::make_unique<optim::OneCycleLR>(
          both, optim::OneCycleLROptions{.max_lrs = max_lrs, .total_steps = 12, .three_phase = true});
    else
      listed = std::make_unique<optim::LambdaLR>(both, lambdas);
    for (int e = 0; e <= 12; ++e) {
      CAPTURE(e);
      if (e > 0) {
        listed->step();
        for (auto& sc : scalar) sc->step();
      }
      for (std::size_t g = 0; g < 2; ++g) {
        CHECK(both.group_lr(g) == alone[g]->group_lr(0));
        CHECK(*both.group_momentum(g) == *alone[g]->group_momentum(0));
        CHECK(listed->get_last_lr()[g] == scalar[g]->get_last_lr()[0]);
      }
    }
    CHECK(both.group_lr(0) != both.group_lr(1));
  }
}

TEST_CASE("the list forms refuse another number of values than groups, bad values and both forms") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  optim::SGD opt({{s.weights}, {s.biases}}, {.lr = 0.1, .momentum = 0.9});
  CHECK(throws_with([&] { optim::OneCycleLR(opt, {.max_lrs = {0.1}, .total_steps = 10}); },
                    {"one max_lr per parameter group (2)", "got 1"}));
  CHECK(throws_with([&] { optim::OneCycleLR(opt, {.max_lrs = {0.1, -2.0}, .total_steps = 10}); },
                    {"max_lrs[1] > 0", "got -2"}));
  CHECK(throws_with([&] { optim::OneCycleLR(opt, {.max_lr = 0.1, .max_lrs = {0.1, 0.2}, .total_steps = 10}); },
                    {"max_lr or max_lrs, got both"}));
  const auto f = [](std::int64_t) { return 1.0; };
  CHECK(throws_with([&] { optim::LambdaLR(opt, std::vector<optim::LambdaLR::Lambda>{f}); },
                    {"one function per parameter group (2)", "got 1"}));
  CHECK(throws_with([&] { optim::LambdaLR(opt, std::vector<optim::LambdaLR::Lambda>{f, nullptr}); },
                    {"empty one for param group 1"}));
  // Nothing was changed by the refusals.
  CHECK(opt.group_lr(0) == 0.1);
  CHECK(!opt.initial_lr(0).has_value());
  CHECK(*opt.group_momentum(1) == 0.9);
}

TEST_CASE("param_groups_state: PyTorch's param_groups, restored by an optimizer over the same groups") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  optim::AdamW a({{s.weights, {.weight_decay = 0.1}}, {s.biases, {.lr = 2e-3, .weight_decay = 0.0}}}, {.lr = 1e-3});
  optim::LinearLR warmup(a, {.start_factor = 0.5, .total_iters = 4});
  const auto st = a.param_groups_state();
  REQUIRE(st.size() == 2);
  CHECK(st[0].params == std::vector<std::int64_t>{0, 1});
  CHECK(st[1].params == std::vector<std::int64_t>{2, 3});
  CHECK(st[1].options.at("lr") == std::vector<double>{1e-3});  // 2e-3 at the warm-up's start factor
  CHECK(st[1].options.at("initial_lr") == std::vector<double>{2e-3});
  CHECK(st[0].options.at("betas") == std::vector<double>{0.9, 0.999});
  CHECK(st[0].options.at("weight_decay") == std::vector<double>{0.1});
  CHECK(st[1].options.at("weight_decay") == std::vector<double>{0.0});

  auto net2 = tiny_net(dp::cpu(0), 2);
  Split s2(net2->parameters());
  optim::AdamW b({{s2.weights}, {s2.biases}}, {.lr = 0.5});
  b.load_param_groups_state(st);
  CHECK(b.group_lr(0) == a.group_lr(0));
  CHECK(b.group_lr(1) == a.group_lr(1));
  CHECK(b.options(0).weight_decay == 0.1);
  CHECK(b.options(1).weight_decay == 0.0);
  CHECK(b.initial_lr(1) == 2e-3);

  // Another group structure: dp::Error naming both, nothing changed.
  optim::AdamW one(s2.all, {.lr = 0.5});
  CHECK(throws_with([&] { one.load_param_groups_state(st); },
                    {"AdamW.load_param_groups_state", "expected 1 param group(s) of 4 parameter(s)",
                     "got 2 param group(s) of 2 parameter(s) (0..1), 2 parameter(s) (2..3)"}));
  CHECK(one.lr() == 0.5);
  // Another optimizer's hyper-parameters, or a refused value: dp::Error, nothing changed.
  optim::SGD sgd({{s2.weights}, {s2.biases}}, {.lr = 0.5});
  CHECK(throws_with([&] { sgd.load_param_groups_state(st); },
                    {"SGD param group 0", "missing: dampening, momentum, nesterov", "unexpected: betas, eps"}));
  auto bad = st;
  bad[1].options["weight_decay"] = {-1.0};
  CHECK(throws_with([&] { b.load_param_groups_state(bad); }, {"AdamW param group 1", "weight_decay >= 0", "-1"}));
  b.set_group_lr(0, 0.25);
  bad[0].options["lr"] = {0.125};
  CHECK_THROWS_AS(b.load_param_groups_state(bad), dp::Error);
  CHECK(b.group_lr(0) == 0.25);  // group 0 was written before group 1 failed: restored
}

TEST_CASE("bad groups: a parameter twice, an empty group, bad values, different sets") {
  auto net = tiny_net(dp::cpu(0));
  Split s(net->parameters());
  CHECK(throws_with([&] { optim::AdamW({{s.weights}, {s.all}}); },
                    {"AdamW", "expected each parameter in one group", "in param group 0 and again in param group 1"}));
  // A tied parameter is one parameter: the same tensor in two groups is refused.
  dp::nn::ParameterList first = s.all.filter([&](const dp::Tensor& p) { return p.is_same(s.all[0]); });
  CHECK(throws_with([&] { optim::SGD({{first}, {first, {.lr = 0.5}}}); },
                    {"SGD", "in param group 0 and again in param group 1"}));
  CHECK(throws_with([&] { optim::SGD({{s.weights}, {s.all.filter([](const dp::Tensor&) { return false; })}}); },
                    {"SGD", "expected at least one parameter in each group", "empty param group 1 (of 2)"}));
  CHECK(throws_with([&] { optim::SGD(std::vector<optim::SGDParamGroup>{}); },
                    {"SGD", "expected at least one parameter group, got none"}));
  CHECK(throws_with([&] { optim::AdamW({{s.weights}, {s.biases, {.lr = -1e-3}}}); },
                    {"AdamW param group 1", "expected lr >= 0", "-0.001"}));
  CHECK(throws_with([&] { optim::SGD({{s.weights, {.weight_decay = -0.1}}, {s.biases}}); },
                    {"SGD param group 0", "expected weight_decay >= 0", "-0.1"}));
  CHECK(throws_with([&] { optim::SGD({{s.weights, {.nesterov = true}}, {s.biases}}, {.momentum = 0.0}); },
                    {"SGD param group 0", "nesterov momentum requires momentum > 0"}));
  auto other = tiny_net(dp::cpu(0), 3);
  CHECK(throws_with([&] { optim::Adam({{s.weights}, {other->parameters()}}); },
                    {"Adam", "one parameter set", "param group 0 of a module's parameters and param group 1 of "
                     "another module's parameters"}));
  CHECK(throws_with([&] { optim::Adam({{s.weights}, {s.biases.tensors()}}); },
                    {"Adam", "param group 1 of loose tensors"}));
}
