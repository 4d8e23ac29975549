// Tests for dp/optim/lr_scheduler.h: every schedule's lr sequence (and OneCycleLR's
// momentum) against what PyTorch prints — bit for bit, from lr_reference.h, which
// scripts/make_lr_reference.py generates —, bad options, and a resume from a training
// checkpoint that continues the sequence exactly.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "dp/io/checkpoint.h"
#include "dp/optim/optim.h"
#include "dp/tensor/ops.h"
#include "lr_reference.h"
#include "optim_test_util.h"

namespace optim = dp::optim;
using optim_test::D;

namespace {

/// An optimizer over one loose tensor: the schedules only read and write its lr.
struct Opt {
  std::vector<dp::Tensor> params{dp::zeros({1})};
};

/// The optimizer's lr (and momentum) after construction and after each of `steps`
/// step()s; get_last_lr() must agree with the optimizer every time.
struct Seq {
  D lr, momentum;
};
Seq run(optim::LRScheduler& s, int steps) {
  Seq out;
  auto read = [&] {
    REQUIRE(s.get_last_lr().size() == 1);
    CHECK(s.get_last_lr()[0] == s.optimizer().lr());
    out.lr.push_back(s.optimizer().lr());
    out.momentum.push_back(s.optimizer().momentum().value_or(NAN));
  };
  read();
  for (int i = 0; i < steps; ++i) {
    s.step();
    CHECK(s.last_epoch() == i + 1);
    read();
  }
  return out;
}

template <std::size_t N>
D ref(const double (&a)[N]) {
  return D(a, a + N);
}

/// Bitwise equality of two sequences, reporting the largest relative difference.
void check_exact(const D& got, const D& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == want[i]);
    worst = std::max(worst, std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), 1e-300));
  }
  if (worst > 0) MESSAGE("max relative difference to PyTorch: ", worst);
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const dp::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  if (s.find(part) != std::string::npos) return true;
  MESSAGE("'", part, "' is not in: '", s, "'");
  return false;
}

}  // namespace

// ---- the sequences PyTorch prints ------------------------------------------------------------------

TEST_CASE("StepLR, MultiStepLR and ExponentialLR match PyTorch bit for bit") {
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::StepLR s(opt, {.step_size = 3, .gamma = 0.5});
    check_exact(run(s, 12).lr, ref(lr_reference::kStepLR));
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::MultiStepLR s(opt, {.milestones = {2, 5, 9}, .gamma = 0.1});
    check_exact(run(s, 12).lr, ref(lr_reference::kMultiStepLR));
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.05});
    optim::ExponentialLR s(opt, {.gamma = 0.9});
    check_exact(run(s, 20).lr, ref(lr_reference::kExponentialLR));
  }
}

TEST_CASE("CosineAnnealingLR matches PyTorch's recursive form past T_max") {
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::CosineAnnealingLR s(opt, {.T_max = 10, .eta_min = 0.001});
    check_exact(run(s, 35).lr, ref(lr_reference::kCosineAnnealingLR));
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.2});
    optim::CosineAnnealingLR s(opt, {.T_max = 7});
    check_exact(run(s, 20).lr, ref(lr_reference::kCosineAnnealingLRZeroMin));
  }
}

TEST_CASE("LinearLR warms up and decays like PyTorch; LambdaLR applies the function") {
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::LinearLR s(opt, {.start_factor = 0.25, .end_factor = 1.0, .total_iters = 4});
    CHECK(opt.lr() == 0.025);  // construction is the first step
    check_exact(run(s, 8).lr, ref(lr_reference::kLinearLRWarmup));
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::LinearLR s(opt, {.start_factor = 1.0, .end_factor = 0.1, .total_iters = 5});
    check_exact(run(s, 8).lr, ref(lr_reference::kLinearLRDecay));
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::LambdaLR s(opt, [](std::int64_t e) { return std::pow(0.95, static_cast<double>(e)); });
    check_exact(run(s, 10).lr, ref(lr_reference::kLambdaLRPow));
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::LambdaLR s(opt, [](std::int64_t e) { return 1.0 / static_cast<double>(e + 1); });
    check_exact(run(s, 10).lr, ref(lr_reference::kLambdaLRInverse));
  }
}

TEST_CASE("LinearLR decays to zero and stays there; an lr below zero by rounding is zero") {
  // Note [Learning rates below zero by rounding]. PyTorch 2.15 prints, for SGD(lr = 0.05)
  // and LinearLR(start_factor = 1/3, end_factor = 0, total_iters = 5):
  //   0.016666666666666666 0.013333333333333334 0.01 0.006666666666666666
  //   0.0033333333333333322 -7.401486830834375e-19 -7.401486830834375e-19
  // where the last two are dp's 0 (a negative lr dp refused before, at step 5).
  Opt o;
  optim::SGD opt(o.params, {.lr = 0.05});
  optim::LinearLR s(opt, {.start_factor = 1.0 / 3, .end_factor = 0.0, .total_iters = 5});
  check_exact(run(s, 6).lr, D{0.016666666666666666, 0.013333333333333334, 0.01, 0.006666666666666666,
                              0.0033333333333333322, 0.0, 0.0});
  CHECK(!std::signbit(opt.lr()));
  CHECK(s.get_last_lr() == D{0.0});
}

TEST_CASE("two schedulers on one optimizer chain like PyTorch's (warm-up, then cosine)") {
  Opt o;
  optim::SGD opt(o.params, {.lr = 0.1});
  optim::LinearLR warm(opt, {.start_factor = 0.1, .total_iters = 5});
  optim::CosineAnnealingLR cos(opt, {.T_max = 20});
  // The second scheduler's base lr is the optimizer's initial lr, not the warm-up's.
  CHECK(opt.initial_lr() == 0.1);
  CHECK(cos.base_lrs() == D{0.1});
  D got{opt.lr()};
  for (int i = 0; i < 15; ++i) {
    warm.step();
    cos.step();
    got.push_back(opt.lr());
  }
  check_exact(got, ref(lr_reference::kChainedWarmupCosine));
}

TEST_CASE("OneCycleLR: cos and linear anneal, three phases, momentum and beta1 cycling") {
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1, .momentum = 0.9});
    optim::OneCycleLR s(opt, {.max_lr = 0.1, .total_steps = 20});
    Seq seq = run(s, 20);
    check_exact(seq.lr, ref(lr_reference::kOneCycleCosLR));
    check_exact(seq.momentum, ref(lr_reference::kOneCycleCosMomentum));
    // PyTorch's message for the same step: "Tried to step 22 times. The specified number
    // of total steps is 20" (see lr_reference.h); nothing changes.
    const double lr = opt.lr(), m = *opt.momentum();
    CHECK(contains(error_of([&] { s.step(); }), "tried to step 22 times"));
    CHECK(contains(error_of([&] { s.step(); }), "total_steps = 20"));
    CHECK(s.last_epoch() == 20);
    CHECK(opt.lr() == lr);
    CHECK(*opt.momentum() == m);
  }
  {
    Opt o;
    optim::Adam opt(o.params, {.lr = 1e-3});
    optim::OneCycleLR s(opt, {.max_lr = 0.01, .total_steps = 30, .pct_start = 0.25,
                              .anneal_strategy = optim::AnnealStrategy::Linear, .three_phase = true});
    Seq seq = run(s, 30);
    // PyTorch lets the linear anneal overshoot below zero at step total_steps, one step
    // past the schedule's end; dp holds it at the end value, min_lr (Note [OneCycleLR's
    // last step]). Every other value is PyTorch's.
    D want = ref(lr_reference::kOneCycleLinear3LR);
    REQUIRE(want.back() < 0);
    want.back() = 0.01 / 25.0 / 1e4;
    check_exact(seq.lr, want);
    check_exact(seq.momentum, ref(lr_reference::kOneCycleLinear3Beta1));
    CHECK(std::get<1>(opt.options().betas) == 0.999);  // only beta1 cycles
  }
  {
    Opt o;
    optim::SGD opt(o.params, {.lr = 0.1});
    optim::OneCycleLR s(opt, {.max_lr = 0.5, .epochs = 3, .steps_per_epoch = 7, .cycle_momentum = false,
                              .div_factor = 10.0, .final_div_factor = 100.0});
    CHECK(s.total_steps() == 21);
    Seq seq = run(s, 21);
    check_exact(seq.lr, ref(lr_reference::kOneCycleEpochsLR));
    CHECK(*opt.momentum() == 0.0);  // untouched without cycle_momentum
  }
  {
    // The linear anneal past the end would push beta1 above 1; held at max_momentum.
    Opt o;
    optim::Adam opt(o.params, {.lr = 1e-3});
    optim::OneCycleLR s(opt, {.max_lr = 0.01, .total_steps = 5, .anneal_strategy = optim::AnnealStrategy::Linear,
                              .max_momentum = 0.999});
    Seq seq = run(s, 5);
    CHECK(seq.momentum.back() == 0.999);
    CHECK(seq.lr.back() == 0.01 / 25.0 / 1e4);
  }
}

TEST_CASE("SGD built without momentum takes OneCycleLR's and starts its buffer then") {
  auto net = optim_test::tiny_net(dp::cpu(0));
  auto params = net->parameters();
  optim::SGD opt(params, {.lr = 0.1});
  CHECK(opt.state_dict().size() == 1);  // "step" only: no buffer without momentum
  optim::OneCycleLR s(opt, {.max_lr = 0.1, .total_steps = 10});
  CHECK(*opt.momentum() == 0.95);
  opt.zero_grad();
  optim_test::set_grads(params.tensors(), 0);
  opt.step();
  CHECK(opt.state_dict().size() == 1 + params.size());  // one momentum_buffer per parameter
}

// ---- bad options --------------------------------------------------------------------------------------

TEST_CASE("bad options name what was expected and what came") {
  Opt o;
  optim::SGD opt(o.params, {.lr = 0.1});
  CHECK(contains(error_of([&] { optim::StepLR(opt, {.step_size = 0}); }), "expected step_size >= 1"));
  CHECK(contains(error_of([&] { optim::StepLR(opt, {.step_size = -2}); }), "got -2"));
  CHECK(contains(error_of([&] { optim::StepLR(opt, {.step_size = 2, .gamma = -0.5}); }), "expected gamma >= 0"));
  CHECK(contains(error_of([&] { optim::ExponentialLR(opt, {.gamma = -1}); }), "got -1"));
  std::string e = error_of([&] { optim::MultiStepLR(opt, {.milestones = {3, 8, 8}}); });
  CHECK(contains(e, "strictly increasing"));
  CHECK(contains(e, "milestones[1] = 8 then milestones[2] = 8"));
  CHECK(contains(error_of([&] { optim::MultiStepLR(opt, {.milestones = {5, 2}}); }), "milestones[0] = 5"));
  CHECK(contains(error_of([&] { optim::MultiStepLR(opt, {.milestones = {-1}}); }), "milestones >= 0"));
  CHECK(contains(error_of([&] { optim::CosineAnnealingLR(opt, {.T_max = 0}); }), "T_max >= 1"));
  CHECK(contains(error_of([&] { optim::CosineAnnealingLR(opt, {.T_max = 5, .eta_min = -1}); }), "eta_min >= 0"));
  CHECK(contains(error_of([&] { optim::LinearLR(opt, {.start_factor = 0}); }), "start_factor in (0, 1]"));
  CHECK(contains(error_of([&] { optim::LinearLR(opt, {.end_factor = 1.5}); }), "end_factor in [0, 1]"));
  CHECK(contains(error_of([&] { optim::LinearLR(opt, {.total_iters = 0}); }), "total_iters >= 1"));
  CHECK(contains(error_of([&] { optim::LambdaLR(opt, nullptr); }), "empty"));
  CHECK(contains(error_of([&] { optim::OneCycleLR(opt, {.max_lr = 0.1}); }), "expected total_steps > 0"));
  CHECK(contains(error_of([&] { optim::OneCycleLR(opt, {.max_lr = 0.1, .total_steps = -5}); }), "got -5"));
  CHECK(contains(error_of([&] { optim::OneCycleLR(opt, {.max_lr = 0.1, .epochs = 2}); }), "steps_per_epoch = 0"));
  CHECK(contains(error_of([&] { optim::OneCycleLR(opt, {.max_lr = 0, .total_steps = 5}); }), "max_lr > 0"));
  CHECK(contains(error_of([&] { optim::OneCycleLR(opt, {.max_lr = 1, .total_steps = 5, .pct_start = 1.5}); }),
                 "pct_start in [0, 1]"));
  // pct_start · total_steps = 1: the first phase has zero length (PyTorch: ZeroDivisionError).
  CHECK(contains(error_of([&] { optim::OneCycleLR(opt, {.max_lr = 1, .total_steps = 10, .pct_start = 0.1}); }),
                 "zero length"));
  // A failed construction leaves the optimizer as it was.
  CHECK(opt.lr() == 0.1);
  CHECK(*opt.momentum() == 0.0);
  CHECK(!opt.initial_lr().has_value());

  // Adam's beta1 must stay below 1: checked when the scheduler is built, not mid-run.
  optim::Adam adam(o.params, {.lr = 1e-3});
  CHECK(contains(error_of([&] { optim::OneCycleLR(adam, {.max_lr = 0.1, .total_steps = 10, .max_momentum = 1.0}); }),
                 "beta1 in [0, 1)"));
  CHECK(std::get<0>(adam.options().betas) == 0.9);

  // A schedule that gives a negative lr fails at that step and changes nothing.
  optim::LambdaLR neg(opt, [](std::int64_t e) { return 1.0 - 0.5 * static_cast<double>(e); });
  neg.step();
  neg.step();  // factor 0
  CHECK(contains(error_of([&] { neg.step(); }), "expected a finite lr >= 0"));
  CHECK(neg.last_epoch() == 2);
  CHECK(opt.lr() == 0.0);
}

TEST_CASE("load_state_dict restores the position; another kind is refused") {
  Opt o;
  optim::SGD opt(o.params, {.lr = 0.1});
  optim::StepLR a(opt, {.step_size = 2, .gamma = 0.5});
  for (int i = 0; i < 5; ++i) a.step();
  optim::LRSchedulerState st = a.state_dict();
  CHECK(st.kind == "StepLR");
  CHECK(st.last_epoch == 5);
  CHECK(st.base_lrs == D{0.1});
  CHECK(st.last_lrs == D{0.025});

  Opt o2;
  optim::SGD opt2(o2.params, {.lr = 0.1});
  optim::StepLR b(opt2, {.step_size = 2, .gamma = 0.5});
  b.load_state_dict(st);
  opt2.set_lr(opt.lr());  // the optimizer's own state; a checkpoint restores both
  a.step();
  b.step();
  CHECK(b.last_epoch() == 6);
  CHECK(opt2.lr() == opt.lr());

  optim::ExponentialLR c(opt2, {.gamma = 0.9});
  CHECK(contains(error_of([&] { c.load_state_dict(st); }),
                 "expected a state saved by ExponentialLR, got one saved by StepLR"));
  st.base_lrs = {0.1, 0.2};
  CHECK(contains(error_of([&] { b.load_state_dict(st); }), "expected 1 parameter group(s)"));
}

// ---- resume from a training checkpoint -------------------------------------------------------------------

namespace {

/// A tiny training run with deterministic gradients: SGD (momentum from the schedule)
/// under a linear OneCycleLR stepped per batch.
struct Run {
  std::shared_ptr<dp::nn::Sequential> net = optim_test::tiny_net(dp::cpu(0), 3);
  optim::SGD opt{net->parameters(), {.lr = 0.1}};
  optim::OneCycleLR one_cycle{
      opt, {.max_lr = 0.2, .total_steps = 12, .anneal_strategy = optim::AnnealStrategy::Linear}};
  dp::TrainingState state;
  D lrs, momenta;

  Run() { state.schedulers = {{"one_cycle", &one_cycle}}; }
  void train(int steps) {
    auto params = net->parameters();
    for (int i = 0; i < steps; ++i) {
      opt.zero_grad();
      optim_test::set_grads(params.tensors(), static_cast<int>(state.step));
      opt.step();
      one_cycle.step();
      ++state.step;
      lrs.push_back(opt.lr());
      momenta.push_back(*opt.momentum());
    }
  }
};

/// Adam under a LinearLR warm-up and a CosineAnnealingLR stepped together once per
/// "epoch" of 3 batches: two named schedulers in one checkpoint.
struct ChainRun {
  std::shared_ptr<dp::nn::Sequential> net = optim_test::tiny_net(dp::cpu(0), 4);
  optim::Adam opt{net->parameters(), {.lr = 0.01}};
  optim::LinearLR warmup{opt, {.start_factor = 0.2, .total_iters = 3}};
  optim::CosineAnnealingLR cosine{opt, {.T_max = 6, .eta_min = 1e-4}};
  dp::TrainingState state;
  D lrs;

  ChainRun() { state.schedulers = {{"warmup", &warmup}, {"cosine", &cosine}}; }
  void train(int epochs) {
    auto params = net->parameters();
    for (int e = 0; e < epochs; ++e, ++state.epoch) {
      for (int b = 0; b < 3; ++b, ++state.step) {
        opt.zero_grad();
        optim_test::set_grads(params.tensors(), static_cast<int>(state.step));
        opt.step();
      }
      warmup.step();
      cosine.step();
      lrs.push_back(opt.lr());
    }
  }
};

struct ScratchFile {
  std::string path = (std::filesystem::temp_directory_path() /
                      ("dp_lr_scheduler_test." + std::to_string(::getpid()) + ".ckpt")).string();
  ~ScratchFile() { std::remove(path.c_str()); }
};

}  // namespace

TEST_CASE("a training checkpoint carries the scheduler: the resumed lr sequence is exact") {
  ScratchFile file;
  Run straight;
  straight.train(12);

  Run first;
  first.train(5);
  dp::save_training_checkpoint(file.path, *first.net, first.opt, first.state);

  Run second;  // fresh: its scheduler is at step 0, SGD's momentum at max_momentum
  CHECK(second.one_cycle.last_epoch() == 0);
  dp::load_training_checkpoint(file.path, *second.net, second.opt, second.state);
  CHECK(second.state.step == 5);
  CHECK(second.one_cycle.last_epoch() == 5);
  CHECK(second.one_cycle.get_last_lr() == first.one_cycle.get_last_lr());
  CHECK(second.opt.lr() == first.opt.lr());
  CHECK(*second.opt.momentum() == *first.opt.momentum());
  second.train(7);

  D lrs = first.lrs, momenta = first.momenta;
  lrs.insert(lrs.end(), second.lrs.begin(), second.lrs.end());
  momenta.insert(momenta.end(), second.momenta.begin(), second.momenta.end());
  check_exact(lrs, straight.lrs);
  check_exact(momenta, straight.momenta);
  auto want = straight.net->parameters(), got = second.net->parameters();
  for (std::size_t k = 0; k < want.size(); ++k) CHECK(dp::equal(got[k], want[k]));
  CHECK(contains(error_of([&] { second.one_cycle.step(); }), "tried to step"));
}

TEST_CASE("two schedulers stepped per epoch resume exactly from one checkpoint (Adam)") {
  ScratchFile file;
  ChainRun straight;
  straight.train(8);

  ChainRun first;
  first.train(3);
  dp::save_training_checkpoint(file.path, *first.net, first.opt, first.state);
  ChainRun second;
  dp::load_training_checkpoint(file.path, *second.net, second.opt, second.state);
  CHECK(second.state.epoch == 3);
  CHECK(second.warmup.last_epoch() == 3);
  CHECK(second.cosine.last_epoch() == 3);
  CHECK(second.opt.step_count() == 9);
  second.train(5);

  D lrs = first.lrs;
  lrs.insert(lrs.end(), second.lrs.begin(), second.lrs.end());
  check_exact(lrs, straight.lrs);
  auto want = straight.net->parameters(), got = second.net->parameters();
  for (std::size_t k = 0; k < want.size(); ++k) CHECK(dp::equal(got[k], want[k]));
}

TEST_CASE("a checkpoint without the scheduler, or with another kind, is refused and changes nothing") {
  ScratchFile file;
  Run first;
  first.train(3);
  dp::TrainingState plain;
  dp::save_training_checkpoint(file.path, *first.net, first.opt, plain);

  Run second;
  const double lr = second.opt.lr();
  CHECK(contains(error_of([&] { dp::load_training_checkpoint(file.path, *second.net, second.opt, second.state); }),
                 "no scheduler named 'one_cycle'"));
  CHECK(second.opt.lr() == lr);
  CHECK(second.one_cycle.last_epoch() == 0);

  dp::save_training_checkpoint(file.path, *first.net, first.opt, first.state);
  optim::StepLR step(second.opt, {.step_size = 2});
  second.state.schedulers = {{"one_cycle", &step}};
  CHECK(contains(error_of([&] { dp::load_training_checkpoint(file.path, *second.net, second.opt, second.state); }),
                 "got one saved by OneCycleLR"));
  CHECK(second.opt.lr() == lr);
  CHECK(second.opt.step_count() == 0);
  CHECK(step.last_epoch() == 0);
}
