// Loops that run several forwards per backward, or several backwards per forward pair,
// in every design: the parameters after two SGD steps equal one device's to float
// rounding, and DP, DDP and Sharded stages 1-3 equal one another bit for bit (Note
// [Forwards before a backward]). The uneven batch (7 rows) splits 4+3 and 3+3+1.
#include <doctest/doctest.h>

#include <cmath>
#include <optional>
#include <string>

#include "mlp_fixture.h"

namespace {

enum class Pattern {
  TwoForwardsOneBackward,    // loss(model(x1)) + loss(model(x2)), one backward: a siamese loss
  TwoForwardsTwoBackwards,   // a = model(x1); b = model(x2); loss(a).backward(); loss(b).backward()
  ThreeForwardsOneBackward,  // three outputs summed into one loss
  BackwardsInReverse,        // two forwards, the second one's backward first
  EvalBetween,               // a forward, an evaluation forward under no_grad, then the backward
  OutputReused,              // one output in two losses, backward once
};

const char* name(Pattern p) {
  switch (p) {
    case Pattern::TwoForwardsOneBackward: return "two forwards, one backward";
    case Pattern::TwoForwardsTwoBackwards: return "two forwards, two backwards";
    case Pattern::ThreeForwardsOneBackward: return "three forwards, one backward";
    case Pattern::BackwardsInReverse: return "two forwards, backwards in reverse order";
    case Pattern::EvalBetween: return "forward, no_grad forward, backward";
    case Pattern::OutputReused: return "one output in two losses";
  }
  return "?";
}

using Forward = std::function<dp::Tensor(const dp::Tensor&)>;

// One step of the pattern's loop body through `forward` (the plain net or the wrapper).
void body(Pattern p, const Forward& forward, std::uint64_t seed) {
  const Batch b1 = make_batch(7, seed), b2 = make_batch(7, seed + 100), b3 = make_batch(7, seed + 200);
  switch (p) {
    case Pattern::TwoForwardsOneBackward: {
      dp::Tensor a = forward(b1.x), b = forward(b2.x);
      (loss_fn(a, b1.y) + loss_fn(b, b2.y)).backward();
      break;
    }
    case Pattern::TwoForwardsTwoBackwards: {
      dp::Tensor a = forward(b1.x), b = forward(b2.x);
      loss_fn(a, b1.y).backward();
      loss_fn(b, b2.y).backward();
      break;
    }
    case Pattern::ThreeForwardsOneBackward: {
      dp::Tensor a = forward(b1.x), b = forward(b2.x), c = forward(b3.x);
      (loss_fn(a, b1.y) + loss_fn(b, b2.y) + loss_fn(c, b3.y)).backward();
      break;
    }
    case Pattern::BackwardsInReverse: {
      dp::Tensor a = forward(b1.x), b = forward(b2.x);
      loss_fn(b, b2.y).backward();
      loss_fn(a, b1.y).backward();
      break;
    }
    case Pattern::EvalBetween: {
      dp::Tensor a = forward(b1.x);
      {
        dp::NoGradGuard no_grad;
        (void)forward(b2.x);
      }
      loss_fn(a, b1.y).backward();
      break;
    }
    case Pattern::OutputReused: {
      dp::Tensor a = forward(b1.x);
      (loss_fn(a, b1.y) + loss_fn(a, b2.y)).backward();
      break;
    }
  }
}

// Two SGD steps of `p`; devices == 0: the plain net on cpu(0), no wrapper.
std::vector<float> train(Pattern p, int devices, dp::DataParallelOptions options = {}) {
  auto net = std::make_shared<ThreeLinear>(11);
  std::optional<dp::DataParallel> model;
  Forward forward = [&net](const dp::Tensor& x) { return net->forward(x); };
  if (devices > 0) {
    model.emplace(net, cpus(devices), options);
    forward = [&model](const dp::Tensor& x) { return (*model)(x); };
  }
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (std::uint64_t step = 0; step < 2; ++step) {
    opt.zero_grad();
    body(p, forward, step);
    opt.step();
  }
  return flat(net->state_dict());
}

// One device against several: per-shard GEMMs and the sum over devices round
// differently. Parameters are O(0.5) and two momentum steps move them by O(0.1): a few
// float32 ulps of the gradients' sums, far below this.
constexpr double kTolerance = 2e-6;

}  // namespace

TEST_CASE("every loop pattern gives one device's parameters in every design, the designs bit for bit") {
  for (Pattern p : {Pattern::TwoForwardsOneBackward, Pattern::TwoForwardsTwoBackwards,
                    Pattern::ThreeForwardsOneBackward, Pattern::BackwardsInReverse, Pattern::EvalBetween,
                    Pattern::OutputReused}) {
    const std::vector<float> single = train(p, 0);
    for (int n : {2, 3}) {
      std::optional<std::vector<float>> first;
      for (const NamedDesign& d : designs_and_tiny_buckets()) {
        const std::string pattern = name(p);
        CAPTURE(pattern);
        CAPTURE(n);
        CAPTURE(d.name);
        const std::vector<float> got = train(p, n, d.options);
        CHECK(max_diff(got, single) < kTolerance);
        if (!first) first = got;
        // The README's promise: bitwise DP's, one backward per step or several (Note
        // [Accumulating after a combined backward]).
        CHECK(got == *first);
      }
    }
  }
}

TEST_CASE("stage 3 keeps a forward's units findable while its graph lives, and drops them after") {
  // Forwards whose outputs are dropped unused (an evaluation with grad enabled) must not
  // confuse a later backward, nor grow without bound.
  auto net = std::make_shared<ThreeLinear>(11);
  dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::Sharded, .shard_stage = 3});
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
  auto ref_net = std::make_shared<ThreeLinear>(11);
  dp::optim::SGD ref_opt(ref_net->parameters(), {.lr = 0.1});
  for (int step = 0; step < 3; ++step) {
    const Batch b = make_batch(7, static_cast<std::uint64_t>(step));
    opt.zero_grad();
    ref_opt.zero_grad();
    for (int i = 0; i < 20; ++i) (void)model(b.x);  // outputs dropped: their graphs die
    dp::Tensor kept = model(b.x);
    for (int i = 0; i < 5; ++i) (void)model(b.x);
    loss_fn(kept, b.y).backward();
    loss_fn(ref_net->forward(b.x), b.y).backward();
    opt.step();
    ref_opt.step();
  }
  CHECK(max_diff(flat(net->state_dict()), flat(ref_net->state_dict())) < kTolerance);
}

TEST_CASE("a second backward through the same output is a clear error in every design") {
  for (const NamedDesign& d : designs_and_tiny_buckets()) {
    CAPTURE(d.name);
    auto net = std::make_shared<ThreeLinear>(11);
    dp::DataParallel model(net, cpus(2), d.options);
    const Batch b = make_batch(7, 1);
    dp::Tensor loss = loss_fn(model(b.x), b.y);
    loss.backward();
    CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("a second time"), dp::Error);
  }
}

TEST_CASE("a device with no rows in the first of two backward passes keeps the combined sum") {
  // Note [Combined gradients are writes]: the device's .grad still carried zero_grad's
  // mark, and its second backward wrote over the sum the first pass left in it.
  auto two_passes = [](int devices, std::optional<dp::DataParallelOptions> options, std::int64_t first_rows,
                       std::int64_t second_rows) {
    auto net = std::make_shared<ThreeLinear>(5);
    std::optional<dp::DataParallel> model;
    if (options) model.emplace(net, cpus(devices), *options);
    dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
    auto forward = [&](const dp::Tensor& x) { return model ? (*model)(x) : net->forward(x); };
    opt.zero_grad();
    const Batch a = make_batch(first_rows, 1), b = make_batch(second_rows, 2);
    loss_fn(forward(a.x), a.y).backward();
    loss_fn(forward(b.x), b.y).backward();
    opt.step();
    return flat(net->state_dict());
  };
  for (const NamedDesign& d : designs_and_tiny_buckets()) {
    CAPTURE(d.name);
    // One row on two devices: device 1 has none in the first pass.
    CHECK(max_diff(two_passes(2, d.options, 1, 2), two_passes(1, std::nullopt, 1, 2)) < kTolerance);
    // Device 0 has none (explicit chunk sizes), three devices.
    dp::DataParallelOptions o = d.options;
    o.chunk_sizes = {0, 2, 1};
    CHECK(max_diff(two_passes(3, o, 3, 3), two_passes(1, std::nullopt, 3, 3)) < kTolerance);
  }
}

TEST_CASE("an edit of .grad by hand, then clip_grad_norm_: DDP's replicas apply it, Sharded refuses it") {
  // Note [Gradient edits]: the clip's update of every copy used to hide the edit from
  // the step, and DDP's replicas stepped their unedited gradients.
  auto edit_clip_step = [](std::optional<dp::DataParallelOptions> options) {
    auto net = std::make_shared<ThreeLinear>(3);
    std::optional<dp::DataParallel> model;
    if (options) model.emplace(net, cpus(2), *options);
    dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
    const Batch b = make_batch(8, 4);
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      loss_fn(model ? (*model)(b.x) : net->forward(b.x), b.y).backward();
      {
        dp::NoGradGuard no_grad;
        for (dp::Tensor p : net->parameters()) {
          dp::Tensor g = p.grad();
          g.mul_(0.25f);
        }
      }
      dp::nn::utils::clip_grad_norm_(net->parameters(), 0.05);  // clips: the norm is larger
      opt.step();
    }
    if (model && model->mode() == dp::Mode::DDP) model->check_replicas();  // throws on drift
    return flat(net->state_dict());
  };
  const std::vector<float> single = edit_clip_step(std::nullopt);
  CHECK(max_diff(edit_clip_step(dp::DataParallelOptions{.mode = dp::Mode::DDP}), single) < kTolerance);
  CHECK(max_diff(edit_clip_step(dp::DataParallelOptions{.mode = dp::Mode::DP}), single) < kTolerance);
  CHECK_THROWS_WITH_AS(edit_clip_step(dp::DataParallelOptions{.mode = dp::Mode::Sharded, .shard_stage = 1}),
                       doctest::Contains("edited through parameters() by hand"), dp::Error);
  // A zero_grad after the edit discards it: the next step is accepted.
  auto net = std::make_shared<ThreeLinear>(3);
  dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::Sharded, .shard_stage = 1});
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
  const Batch b = make_batch(8, 4);
  loss_fn(model(b.x), b.y).backward();
  {
    dp::NoGradGuard no_grad;
    dp::Tensor g = net->parameters()[0].grad();
    g.mul_(2.0f);
  }
  dp::nn::utils::clip_grad_norm_(net->parameters(), 0.05);
  opt.zero_grad();
  loss_fn(model(b.x), b.y).backward();
  CHECK_NOTHROW(opt.step());
}

// A forward through the module itself (net->forward(x), on device 0's parameters) whose
// loss joins the wrapper's: PyTorch's DataParallel adds its gradient to device 0's, and
// so do DP and DDP (DDP sends it to every replica as an edit by hand). Sharded reduces
// only its own backward's gradients: stage 1 found the write, but stages 2 and 3 dropped
// it, 0.09 off one device after one step. Now every stage refuses the step, and a
// zero_grad() clears the gradient it refused.
TEST_CASE("a forward through the module itself beside the wrapper's: DP and DDP count it, Sharded refuses") {
  auto train = [](std::optional<dp::DataParallelOptions> options) {
    auto net = std::make_shared<ThreeLinear>(13);
    std::optional<dp::DataParallel> model;
    if (options) model.emplace(net, cpus(2), *options);
    dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
    for (std::uint64_t step = 0; step < 2; ++step) {
      const Batch a = make_batch(7, step), b = make_batch(5, step + 50);
      opt.zero_grad();
      dp::Tensor out = model ? (*model)(a.x) : net->forward(a.x);
      (loss_fn(out, a.y) + loss_fn(net->forward(b.x), b.y)).backward();
      opt.step();
    }
    if (model && model->mode() == dp::Mode::DDP) model->check_replicas();  // throws on drift
    return flat(net->state_dict());
  };
  const std::vector<float> single = train(std::nullopt);
  for (const NamedDesign& d : designs_and_tiny_buckets()) {
    CAPTURE(d.name);
    if (d.options.mode != dp::Mode::Sharded) {
      CHECK(max_diff(train(d.options), single) < kTolerance);
      continue;
    }
    CHECK_THROWS_WITH_AS(train(d.options), doctest::Contains("the module itself"), dp::Error);
    // Refused, then cleared by zero_grad: the wrapper's own step runs and is one device's.
    auto net = std::make_shared<ThreeLinear>(13);
    dp::DataParallel model(net, cpus(2), d.options);
    dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
    const Batch a = make_batch(7, 1), b = make_batch(5, 2);
    // Stage 3 may refuse earlier: the module's own parameters are released between the
    // wrapper's uses (Note [Released storage]).
    std::string refusal;
    try {
      (loss_fn(model(a.x), a.y) + loss_fn(net->forward(b.x), b.y)).backward();
      opt.step();
    } catch (const dp::Error& e) {
      refusal = e.what();
    }
    CAPTURE(refusal);
    CHECK((refusal.find("the module itself") != std::string::npos ||
           (d.options.shard_stage == 3 && refusal.find("memory was released") != std::string::npos)));
    auto ref = std::make_shared<ThreeLinear>(13);
    dp::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1});
    opt.zero_grad();
    loss_fn(model(a.x), a.y).backward();
    CHECK_NOTHROW(opt.step());
    loss_fn(ref->forward(a.x), a.y).backward();
    ref_opt.step();
    CHECK(max_diff(flat(net->state_dict()), flat(ref->state_dict())) < kTolerance);
  }
}

// Note [Saved tensors and in-place writes]: an optimizer's step between a forward and
// its backward writes the weights that forward's graph saved, on every device. Without
// the check the backward would compute the earlier layers' gradients from the stepped
// weights; with it the backward throws, in every design, and the next step trains on.
TEST_CASE("a step between a forward and its backward is an error in every design, and training goes on") {
  for (const NamedDesign& d : designs_and_tiny_buckets()) {
    CAPTURE(d.name);
    auto net = std::make_shared<ThreeLinear>(11);
    dp::DataParallel model(net, cpus(3), d.options);
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
    const Batch b = make_batch(7, 5);
    opt.zero_grad();
    loss_fn(model(b.x), b.y).backward();
    opt.step();
    dp::Tensor stale = loss_fn(model(b.x), b.y);  // its graph saved the weights
    opt.step();
    CHECK_THROWS_WITH_AS(stale.backward(), doctest::Contains("modified by an in-place operation"), dp::Error);
    // A fresh forward after the step trains as a plain net does from the same weights.
    auto ref = std::make_shared<ThreeLinear>(11);
    ref->load_state_dict(net->state_dict());
    dp::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1});
    opt.zero_grad();
    loss_fn(model(b.x), b.y).backward();
    opt.step();
    ref_opt.zero_grad();
    loss_fn(ref->forward(b.x), b.y).backward();
    ref_opt.step();
    CHECK(max_diff(flat(net->state_dict()), flat(ref->state_dict())) < kTolerance);
  }
}

TEST_CASE("a write into the input batch between a forward and its backward is an error in every design") {
  // The first layer's weight gradient reads the input (x saved by LinearBackward): a
  // loader that refills its batch tensor in place before the backward would otherwise
  // give the gradient of the next batch.
  for (const NamedDesign& d : designs_and_tiny_buckets()) {
    CAPTURE(d.name);
    auto net = std::make_shared<ThreeLinear>(11);
    dp::DataParallel model(net, cpus(2), d.options);
    const Batch b = make_batch(6, 5);
    dp::Tensor x = b.x.clone();
    dp::Tensor loss = loss_fn(model(x), b.y);
    x.mul_(2.0f);
    bool threw = false;
    try {
      loss.backward();
    } catch (const dp::Error& e) {
      threw = true;
      CHECK(std::string(e.what()).find("modified by an in-place operation") != std::string::npos);
    }
    // Device 0's piece of the scattered batch is a view of x (the other devices' are
    // copies): its LinearBackward saved those rows, and sees the write.
    CHECK(threw);
  }
}

namespace {

std::vector<float> train_inplace_forward(const NamedDesign* d, int devices, bool bf16) {
  auto net = std::make_shared<InplaceForward>(5);
  std::optional<dp::DataParallel> model;
  if (d) model.emplace(net, cpus(devices), d->options);
  dp::optim::SGD opt(d ? model->parameters() : net->parameters(), {.lr = 0.1, .momentum = 0.9});
  for (int step = 0; step < 3; ++step) {
    const Batch b = make_batch(7, 30 + step);
    opt.zero_grad();
    dp::Tensor loss;
    {
      std::optional<dp::amp::autocast> cast;
      if (bf16) cast.emplace(dp::Dtype::BFloat16);
      loss = loss_fn(d ? (*model)(b.x) : net->forward(b.x), b.y);
    }
    loss.backward();
    opt.step();
  }
  return flat(d ? model->state_dict() : net->state_dict());
}

}  // namespace

TEST_CASE("a forward that writes in place trains alike in every design, float32 and under bfloat16 autocast") {
  for (const bool bf16 : {false, true}) {
    CAPTURE(bf16);
    const std::vector<float> one = train_inplace_forward(nullptr, 1, bf16);
    for (const int devices : {2, 3}) {
      CAPTURE(devices);
      const std::vector<NamedDesign> designs = designs_and_tiny_buckets();
      const std::vector<float> dp_run = train_inplace_forward(&designs[0], devices, bf16);
      // One device's to float rounding in float32; in bfloat16 each device rounds its
      // own rows' products, so the designs meet one device to bfloat16's rounding.
      CHECK(max_diff(dp_run, one) < (bf16 ? 5e-3 : kTolerance));
      for (const NamedDesign& d : designs) {
        CAPTURE(d.name);
        CHECK(max_diff(train_inplace_forward(&d, devices, bf16), dp_run) == 0.0);
      }
    }
  }
}
