// Frozen parameters (set_requires_grad(false): a frozen backbone, an embedding kept
// fixed) in an optimizer's step and in every design (Note [Frozen parameters] in
// src/nn/parameter_set.cpp, Note [Frozen parameters in a step] in dp/optim/optimizer.h).
// PyTorch gives a frozen parameter no gradient and its optimizers skip it: no weight
// decay, no momentum, no state; an Adam step count of its own from its first step with
// a gradient. Before, dp stepped it with the zeros of its gradient buffer (AdamW's decay
// and an earlier momentum moved it), and DataParallel's replicas computed a gradient
// for it (they require grad as runtime leaves), which the reduction summed into it.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "mlp_fixture.h"

namespace {

using dp::Tensor;

std::vector<float> values(const Tensor& t) { return t.to_vector(); }

bool bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void freeze(dp::nn::Module& layer, bool frozen) {
  for (Tensor p : layer.parameters()) p.set_requires_grad(!frozen);
}

// A schedule of which layer is frozen at step s: the first Linear for steps [0, 3), then
// none, then the last Linear from step 5 on (fine-tuning's freeze, unfreeze, freeze).
struct Schedule {
  bool first_frozen(int s) const { return s < 3; }
  bool last_frozen(int s) const { return s >= 5; }
};
constexpr int kSteps = 7;

struct Run {
  std::vector<float> params;
  std::vector<std::vector<float>> first_layer;  // its weight after each step
  std::vector<std::vector<float>> last_layer;
  bool frozen_grads_zero = true;
};

// 0 for an undefined .grad (Sharded stages 2 and 3 keep none on the caller's side: Note
// [Detached gradients]; their clip reads the owners' ranges, which the parameters check).
double max_abs(const Tensor& t) {
  if (!t.defined()) return 0;
  double m = 0;
  for (float v : t.to_vector()) m = std::max(m, static_cast<double>(std::abs(v)));
  return m;
}

// kSteps AdamW steps (weight decay on) of make_mlp under the schedule; devices == 0: the
// plain net on cpu(0). `freeze_before_wrap`: the first layer is frozen before
// DataParallel is built.
Run train(int devices, std::optional<dp::DataParallelOptions> options, bool freeze_before_wrap = true) {
  auto net = make_mlp(3);
  auto& first = *(*net)[0];
  auto& last = *(*net)[4];
  const Schedule plan;
  if (freeze_before_wrap) freeze(first, plan.first_frozen(0));
  std::optional<dp::DataParallel> model;
  if (options) model.emplace(net, cpus(devices), *options);
  dp::optim::AdamW opt(net->parameters(), {.lr = 0.05, .weight_decay = 0.1});
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    freeze(first, plan.first_frozen(s));
    freeze(last, plan.last_frozen(s));
    const Batch b = make_batch(9, static_cast<std::uint64_t>(s));
    opt.zero_grad();
    loss_fn(model ? (*model)(b.x) : net->forward(b.x), b.y).backward();
    // The total norm counts every .grad: a frozen one must hold zeros, as on one device
    // (a replica's gradient reduced into it would change the clipping of every layer).
    if (plan.first_frozen(s)) run.frozen_grads_zero = run.frozen_grads_zero && max_abs(first.parameters()[0].grad()) == 0;
    dp::nn::utils::clip_grad_norm_(net->parameters(), 0.5);
    opt.step();
    run.first_layer.push_back(values(first.parameters()[0]));
    run.last_layer.push_back(values(last.parameters()[0]));
  }
  run.params = flat(net->state_dict());
  return run;
}

}  // namespace

TEST_CASE("an optimizer leaves a frozen parameter alone: no weight decay, no momentum, no state") {
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    auto net = make_mlp(5);
    Tensor w = (*net)[0]->parameters()[0];
    std::optional<dp::optim::AdamW> adamw;
    std::optional<dp::optim::SGD> sgd;
    dp::optim::Optimizer* opt = nullptr;
    if (which == 0) opt = &adamw.emplace(net->parameters(), dp::optim::AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
    if (which == 1) opt = &sgd.emplace(net->parameters(), dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
    if (which == 2) opt = &sgd.emplace(net->parameters(), dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
    // One step trained, so momentum and moments exist; then frozen for three.
    const Batch b0 = make_batch(8, 1);
    opt->zero_grad();
    loss_fn(net->forward(b0.x), b0.y).backward();
    opt->step();
    const std::vector<float> at_freeze = values(w);
    w.set_requires_grad(false);
    for (int s = 0; s < 3; ++s) {
      const Batch b = make_batch(8, 2 + static_cast<std::uint64_t>(s));
      opt->zero_grad();
      loss_fn(net->forward(b.x), b.y).backward();
      opt->step();
      CHECK(bitwise(values(w), at_freeze));
    }
    // The other parameters still train.
    CHECK(max_diff(values((*net)[2]->parameters()[0]), values((*make_mlp(5))[2]->parameters()[0])) > 1e-3);
  }
}

TEST_CASE("a parameter unfrozen after frozen steps starts as PyTorch's does: its own Adam step count, fresh momentum") {
  // Reference: the same net with the frozen parameter left out of the optimizer, and a
  // second optimizer of its own built when it is unfrozen: PyTorch's per-parameter
  // state, which starts at the parameter's first step with a gradient.
  for (int which = 0; which < 2; ++which) {
    CAPTURE(which);
    auto make_opt = [which](dp::nn::ParameterList params) -> std::unique_ptr<dp::optim::Optimizer> {
      if (which == 0) return std::make_unique<dp::optim::Adam>(params, dp::optim::AdamOptions{.lr = 0.05, .weight_decay = 0.1});
      return std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .dampening = 0.5});
    };
    auto net = make_mlp(6), ref = make_mlp(6);
    auto is_first_weight = [&](dp::nn::Module& m) {
      Tensor w = (*dynamic_cast<dp::nn::Sequential&>(m)[0]).parameters()[0];
      return [w](const Tensor& p) { return p.impl() == w.impl(); };
    };
    auto opt = make_opt(net->parameters());
    const auto ref_first = is_first_weight(*ref);
    auto ref_rest = make_opt(ref->parameters().filter([&](const Tensor& p) { return !ref_first(p); }));
    std::unique_ptr<dp::optim::Optimizer> ref_late;
    Tensor w = (*net)[0]->parameters()[0], rw = (*ref)[0]->parameters()[0];
    w.set_requires_grad(false);
    rw.set_requires_grad(false);
    for (int s = 0; s < 6; ++s) {
      if (s == 3) {  // unfrozen
        w.set_requires_grad(true);
        rw.set_requires_grad(true);
        ref_late = make_opt(ref->parameters().filter(ref_first));
      }
      const Batch b = make_batch(8, 10 + static_cast<std::uint64_t>(s));
      opt->zero_grad();
      ref_rest->zero_grad();
      if (ref_late) ref_late->zero_grad();
      loss_fn(net->forward(b.x), b.y).backward();
      loss_fn(ref->forward(b.x), b.y).backward();
      opt->step();
      ref_rest->step();
      if (ref_late) ref_late->step();
      CAPTURE(s);
      CHECK(bitwise(flat(net->state_dict()), flat(ref->state_dict())));
    }
  }
}

TEST_CASE("an entry's own step count survives state_dict and load_state_dict; bad ones are refused") {
  auto net = make_mlp(7);
  dp::optim::Adam opt(net->parameters(), {.lr = 0.05});
  Tensor w = (*net)[0]->parameters()[0];
  auto steps = [&](dp::nn::Module& m, dp::optim::Optimizer& o, int first, int last) {
    for (int s = first; s < last; ++s) {
      const Batch b = make_batch(8, 20 + static_cast<std::uint64_t>(s));
      o.zero_grad();
      loss_fn(m.forward(b.x), b.y).backward();
      o.step();
    }
  };
  w.set_requires_grad(false);
  steps(*net, opt, 0, 2);
  w.set_requires_grad(true);
  steps(*net, opt, 2, 3);
  const dp::nn::StateDict sd = opt.state_dict();
  bool found = false;
  for (const auto& [name, t] : sd) {
    if (name != "state.0.step") continue;
    found = true;
    CHECK(t.item() == 1.0);  // one step of its own, of the optimizer's 3
  }
  CHECK(found);
  // A resumed copy continues bit for bit.
  auto resumed = make_mlp(7);
  resumed->load_state_dict(net->state_dict());
  dp::optim::Adam opt2(resumed->parameters(), {.lr = 0.05});
  opt2.load_state_dict(sd);
  steps(*net, opt, 3, 5);
  steps(*resumed, opt2, 3, 5);
  CHECK(bitwise(flat(net->state_dict()), flat(resumed->state_dict())));
  // Bad entries.
  auto with = [&](const char* name, Tensor value) {
    dp::nn::StateDict bad;
    for (const auto& [n, t] : sd) bad.emplace_back(n, n == name ? value : t);
    return bad;
  };
  dp::optim::Adam opt3(make_mlp(7)->parameters(), {.lr = 0.05});
  CHECK_THROWS_WITH_AS(opt3.load_state_dict(with("state.0.step", dp::full({}, 4.0, dp::TensorOptions{dp::Dtype::Int64, dp::Device{}}))),
                       doctest::Contains("expected 'state.0.step' to be a whole number in [0, 3]"), dp::Error);
  CHECK_THROWS_WITH_AS(opt3.load_state_dict(with("state.0.step", dp::zeros({2}))),
                       doctest::Contains("expected a scalar 'state.0.step'"), dp::Error);
}

TEST_CASE("a group frozen since the first step, saved and resumed before it is unfrozen, continues bit for bit") {
  // Its group has no state yet (Note [Optimizer state starts]); its entries' own step
  // counts (0) must still travel, or Adam's bias correction restarts from the
  // optimizer's count after the resume.
  auto make = [](dp::nn::Sequential& net) {
    auto params = net.parameters();
    Tensor w0 = params[0], b0 = params[1];
    auto first = params.filter([&](const Tensor& p) { return p.impl() == w0.impl() || p.impl() == b0.impl(); });
    auto rest = params.filter([&](const Tensor& p) { return p.impl() != w0.impl() && p.impl() != b0.impl(); });
    return std::make_unique<dp::optim::AdamW>(std::vector<dp::optim::AdamParamGroup>{{rest}, {first, {.lr = 0.02}}},
                                              dp::optim::AdamWOptions{.lr = 0.05});
  };
  auto steps = [](dp::nn::Sequential& net, dp::optim::Optimizer& o, int first, int last) {
    for (int s = first; s < last; ++s) {
      const Batch b = make_batch(8, 40 + static_cast<std::uint64_t>(s));
      o.zero_grad();
      loss_fn(net.forward(b.x), b.y).backward();
      o.step();
    }
  };
  auto net = make_mlp(8);
  auto opt = make(*net);
  freeze(*(*net)[0], true);
  steps(*net, *opt, 0, 3);
  const dp::nn::StateDict sd = opt->state_dict();
  auto resumed = make_mlp(8);
  resumed->load_state_dict(net->state_dict());
  auto opt2 = make(*resumed);
  opt2->load_state_dict(sd);
  freeze(*(*net)[0], false);
  steps(*net, *opt, 3, 5);
  steps(*resumed, *opt2, 3, 5);
  CHECK(bitwise(flat(net->state_dict()), flat(resumed->state_dict())));
}

TEST_CASE("entries' own step counts survive a resume of a resume, before any state exists") {
  // Every parameter frozen so far: no group's state has started, so state_dict() of an
  // optimizer just loaded has no buffers to show; the entries' step counts (0 of the
  // optimizer's 2) must still be in it, or a second resume restarts Adam's bias
  // correction from the optimizer's count (found by the optimizer fuzzer, program 552).
  auto steps = [](dp::nn::Sequential& net, dp::optim::Optimizer& o, int first, int last) {
    for (int s = first; s < last; ++s) {
      const Batch b = make_batch(8, 60 + static_cast<std::uint64_t>(s));
      o.zero_grad();
      const Tensor loss = loss_fn(net.forward(b.x), b.y);
      if (loss.requires_grad()) loss.backward();
      o.step();
    }
  };
  auto net = make_mlp(9);
  dp::optim::AdamW opt(net->parameters(), {.lr = 0.05});
  freeze(*net, true);
  steps(*net, opt, 0, 2);
  auto resumed = make_mlp(9);
  resumed->load_state_dict(net->state_dict());
  dp::optim::AdamW opt2(resumed->parameters(), {.lr = 0.05});
  opt2.load_state_dict(opt.state_dict());
  const dp::nn::StateDict again = opt2.state_dict();  // saved before opt2 steps
  int entries = 0;
  for (const auto& [name, t] : again) {
    if (name == "step") CHECK(t.item() == 2.0);
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".step") == 0) {
      ++entries;
      CHECK(t.item() == 0.0);
    }
  }
  CHECK(entries == static_cast<int>(net->parameters().size()));
  auto twice = make_mlp(9);
  twice->load_state_dict(net->state_dict());
  dp::optim::AdamW opt3(twice->parameters(), {.lr = 0.05});
  opt3.load_state_dict(again);
  freeze(*net, false);
  steps(*net, opt, 2, 4);
  steps(*resumed, opt2, 2, 4);
  steps(*twice, opt3, 2, 4);
  CHECK(bitwise(flat(net->state_dict()), flat(resumed->state_dict())));
  CHECK(bitwise(flat(net->state_dict()), flat(twice->state_dict())));
}

TEST_CASE("a frozen parameter gets no gradient on any device and is not stepped, in every design") {
  const Run single = train(0, std::nullopt);
  // The schedule freezes them: unchanged while frozen, moved while trained.
  CHECK(bitwise(single.first_layer[0], single.first_layer[2]));
  CHECK(!bitwise(single.first_layer[2], single.first_layer[3]));
  CHECK(!bitwise(single.last_layer[3], single.last_layer[4]));
  CHECK(bitwise(single.last_layer[4], single.last_layer[5]));
  CHECK(bitwise(single.last_layer[5], single.last_layer[6]));
  for (int n : {2, 3}) {
    std::optional<std::vector<float>> first;
    for (const auto& [name, options] : designs_and_tiny_buckets()) {
      for (bool before : {true, false}) {
        CAPTURE(n);
        CAPTURE(name);
        CAPTURE(before);
        const Run run = train(n, options, before);
        CHECK(run.frozen_grads_zero);
        CHECK(max_diff(run.params, single.params) < 2e-6);
        for (int s = 0; s < kSteps; ++s) {
          CAPTURE(s);
          // A frozen layer keeps its bits exactly, as on one device.
          if (Schedule{}.first_frozen(s)) CHECK(bitwise(run.first_layer[s], single.first_layer[s]));
          if (Schedule{}.last_frozen(s) && s > 0)
            CHECK(bitwise(run.last_layer[s], run.last_layer[static_cast<std::size_t>(s) - 1]));
        }
        if (!first) first = run.params;
        CHECK(bitwise(run.params, *first));  // the designs bit for bit
      }
    }
  }
}

TEST_CASE("a frozen parameter under param_dtype bf16 stays frozen in DDP and Sharded stage 3") {
  for (dp::DataParallelOptions o : {dp::DataParallelOptions{.mode = dp::Mode::DDP},
                                    dp::DataParallelOptions{.mode = dp::Mode::Sharded, .shard_stage = 3}}) {
    o.mixed_precision.param_dtype = dp::Dtype::BFloat16;
    const std::string mode = dp::mode_name(o.mode);
    CAPTURE(mode);
    const Run run = train(2, o);
    CHECK(bitwise(run.first_layer[0], run.first_layer[2]));
    CHECK(!bitwise(run.first_layer[2], run.first_layer[3]));
    CHECK(bitwise(run.last_layer[5], run.last_layer[6]));
  }
}
