// Parameters that a backward does not reach (Note [Parameters without a gradient] in
// dp/optim/optimizer.h): a head that a batch skips, a branch not taken. PyTorch's
// zero_grad() sets every .grad to None and its optimizers skip a parameter whose .grad
// is still None at the step: no weight decay, no momentum, no Adam step. Before, dp
// stepped such a parameter with the zeros of its gradient buffer (PyTorch's
// set_to_none=False behaviour), so AdamW's decay and an earlier momentum moved it.
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

// The optimizer's per-entry step count "state.<i>.step", or nullopt when it has none
// (its count is the optimizer's "step").
std::optional<double> own_step(dp::optim::Optimizer& opt, std::size_t i) {
  for (const auto& [name, t] : opt.state_dict())
    if (name == "state." + std::to_string(i) + ".step") return t.item();
  return std::nullopt;
}

// Loads `from`'s state into `to` without the per-entry step counts.
void nn_state_without_step(dp::optim::Optimizer& from, dp::optim::Optimizer& to) {
  dp::nn::StateDict sd;
  for (const auto& [name, t] : from.state_dict())
    if (name == "step" || name.size() < 5 || name.compare(name.size() - 5, 5, ".step") != 0) sd.emplace_back(name, t);
  to.load_state_dict(sd);
}

// Two parameters: q is used at every step, p at steps 0 and 2 only.
struct TwoParams : dp::nn::Module {
  TwoParams() {
    p = register_parameter("p", dp::from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}, dp::cpu(0)));
    q = register_parameter("q", dp::from_vector(std::vector<float>{0.25f, 3.0f}, {2}, dp::cpu(0)));
  }
  dp::nn::Parameter p, q;
};

Tensor two_params_loss(const Tensor& p, const Tensor& q, int s) {
  const Tensor x = dp::from_vector(std::vector<float>{0.5f + static_cast<float>(s), -1.0f + 0.25f * static_cast<float>(s)}, {2}, dp::cpu(0));
  const Tensor sq = dp::mul(q, x).sum();
  Tensor loss = dp::mul(sq, sq);
  if (s != 1) loss = dp::add(loss, dp::mul(dp::mul(p, p), static_cast<double>(s + 1)).sum());
  return loss;
}

// PyTorch 2.15 (torch.optim.AdamW(lr=0.1, weight_decay=0.1) and SGD(lr=0.1,
// momentum=0.9, weight_decay=0.01), zero_grad() before each backward) on the same
// values and losses: p and q after each of the three steps.
struct Expected {
  std::vector<std::vector<float>> p, q;
};
const Expected kAdamW{{{0.890000045f, -1.88f, 0.395000011f},
                       {0.890000045f, -1.88f, 0.395000011f},
                       {0.787918091f, -1.76867688f, 0.296446741f}},
                      {{0.347499996f, 2.87000012f}, {0.4421224f, 2.75049949f}, {0.526258886f, 2.6501112f}}};
const Expected kSgd{{{0.799000025f, -1.59800005f, 0.399500012f},
                     {0.799000025f, -1.59800005f, 0.399500012f},
                     {0.137901008f, -0.275802016f, 0.0689505041f}},
                    {{0.537249982f, 2.42199993f}, {1.09842527f, 1.74778414f}, {0.666298926f, 1.32645929f}}};

void check_close(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(2e-6));
}

template <class Params>
std::unique_ptr<dp::optim::Optimizer> make_opt(bool adamw, Params params) {
  if (adamw) return std::make_unique<dp::optim::AdamW>(params, dp::optim::AdamWOptions{.lr = 0.1, .weight_decay = 0.1});
  return std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
}

// A schedule of the steps that use ThreeLinear's middle layer.
bool mid_used(int s) { return s == 0 || s == 3 || s == 4; }
constexpr int kSteps = 6;

}  // namespace

TEST_CASE("a parameter no backward reached is skipped as PyTorch skips a None .grad: PyTorch's numbers") {
  for (bool adamw : {true, false}) {
    for (bool loose : {false, true}) {
      CAPTURE(adamw);
      CAPTURE(loose);
      const Expected& want = adamw ? kAdamW : kSgd;
      TwoParams m;
      // Loose tensors (no parameter set) take PyTorch's path exactly: .grad undefined.
      Tensor p = loose ? dp::from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}, dp::cpu(0)).set_requires_grad(true)
                       : Tensor(m.p);
      Tensor q = loose ? dp::from_vector(std::vector<float>{0.25f, 3.0f}, {2}, dp::cpu(0)).set_requires_grad(true)
                       : Tensor(m.q);
      auto opt = loose ? make_opt(adamw, std::vector<Tensor>{p, q}) : make_opt(adamw, m.parameters());
      for (int s = 0; s < 3; ++s) {
        CAPTURE(s);
        opt->zero_grad();
        if (loose) CHECK(!p.grad().defined());  // PyTorch's None
        two_params_loss(p, q, s).backward();
        opt->step();
        check_close(values(p), want.p[static_cast<std::size_t>(s)]);
        check_close(values(q), want.q[static_cast<std::size_t>(s)]);
      }
      // PyTorch's per-parameter "step": p was stepped twice, q three times.
      if (adamw) {
        CHECK(own_step(*opt, 0) == std::optional<double>(2.0));
        CHECK(own_step(*opt, 1) == std::nullopt);
      }
    }
  }
}

TEST_CASE("a step skips a parameter no backward reached exactly as if it were frozen for that step") {
  // The reference freezes the middle layer in the steps that skip it: frozen parameters
  // are PyTorch's None .grad already (frozen_params_test).
  for (int which = 0; which < 3; ++which) {
    CAPTURE(which);
    auto make = [which](dp::nn::ParameterList params) -> std::unique_ptr<dp::optim::Optimizer> {
      if (which == 0) return std::make_unique<dp::optim::AdamW>(params, dp::optim::AdamWOptions{.lr = 0.05, .weight_decay = 0.1});
      if (which == 1) return std::make_unique<dp::optim::Adam>(params, dp::optim::AdamOptions{.lr = 0.05});
      return std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
    };
    auto net = std::make_shared<ThreeLinear>(7), ref = std::make_shared<ThreeLinear>(7);
    auto opt = make(net->parameters()), ref_opt = make(ref->parameters());
    for (int s = 0; s < kSteps; ++s) {
      CAPTURE(s);
      net->use_mid = ref->use_mid = mid_used(s);
      for (Tensor t : ref->mid->parameters()) t.set_requires_grad(mid_used(s));
      const std::vector<float> mid_before = values(net->mid->parameters()[0]);
      const Batch b = make_batch(8, 10 + static_cast<std::uint64_t>(s));
      opt->zero_grad();
      ref_opt->zero_grad();
      loss_fn(net->forward(b.x), b.y).backward();
      loss_fn(ref->forward(b.x), b.y).backward();
      opt->step();
      ref_opt->step();
      CHECK(bitwise(flat(net->state_dict()), flat(ref->state_dict())));
      CHECK(bitwise(flat(opt->state_dict()), flat(ref_opt->state_dict())));
      if (!mid_used(s)) CHECK(bitwise(values(net->mid->parameters()[0]), mid_before));
    }
    // The middle layer's weight (entry 2) was stepped three times of six.
    if (which < 2) CHECK(own_step(*opt, 2) == std::optional<double>(3.0));
  }
}

TEST_CASE("zero_grad(false) keeps PyTorch's set_to_none=False: a parameter that had a gradient is stepped with zeros") {
  auto net = std::make_shared<ThreeLinear>(8);
  dp::optim::AdamW opt(net->parameters(), {.lr = 0.05, .weight_decay = 0.1});
  Tensor w = net->mid->parameters()[0];
  // Never reached yet: its .grad is "None" and stays so under zero_grad(false).
  net->use_mid = false;
  Batch b = make_batch(8, 1);
  opt.zero_grad(false);
  loss_fn(net->forward(b.x), b.y).backward();
  std::vector<float> before = values(w);
  opt.step();
  CHECK(bitwise(values(w), before));
  // Reached once: from then on zero_grad(false) steps it, weight decay and moments.
  net->use_mid = true;
  opt.zero_grad(false);
  loss_fn(net->forward(b.x), b.y).backward();
  opt.step();
  net->use_mid = false;
  for (int s = 0; s < 2; ++s) {
    before = values(w);
    opt.zero_grad(false);
    loss_fn(net->forward(b.x), b.y).backward();
    opt.step();
    CHECK(!bitwise(values(w), before));
  }
  CHECK(own_step(opt, 2) == std::optional<double>(3.0));  // steps 2-4 of 4
  // zero_grad() forgets: the next step leaves it alone.
  before = values(w);
  opt.zero_grad();
  loss_fn(net->forward(b.x), b.y).backward();
  opt.step();
  CHECK(bitwise(values(w), before));
  // Module::zero_grad() forgets as well; an optimizer's zero_grad() only its own parameters'.
  net->use_mid = true;
  opt.zero_grad();
  loss_fn(net->forward(b.x), b.y).backward();
  net->zero_grad();
  before = values(w);
  opt.step();
  CHECK(bitwise(values(w), before));
}

TEST_CASE("an optimizer's zero_grad forgets only its own parameters' gradients") {
  auto net = std::make_shared<ThreeLinear>(9);
  dp::optim::SGD head(net->fc3->parameters(), {.lr = 0.1, .weight_decay = 0.1});
  dp::optim::SGD body(net->mid->parameters(), {.lr = 0.1, .weight_decay = 0.1});
  const Batch b = make_batch(8, 2);
  body.zero_grad();
  head.zero_grad();
  loss_fn(net->forward(b.x), b.y).backward();
  head.zero_grad();  // the middle layer's gradient is kept
  const std::vector<float> before = values(net->mid->parameters()[0]);
  body.step();
  CHECK(!bitwise(values(net->mid->parameters()[0]), before));
}

TEST_CASE("a loose tensor's own step count survives state_dict and load_state_dict") {
  // p skips every third step (two_params_loss at s % 3 == 1); a run resumed from a
  // checkpoint after two steps continues bit for bit, p's own count included.
  struct Loose {
    Tensor p = dp::from_vector(std::vector<float>{1.0f, -2.0f, 0.5f}, {3}, dp::cpu(0)).set_requires_grad(true);
    Tensor q = dp::from_vector(std::vector<float>{0.25f, 3.0f}, {2}, dp::cpu(0)).set_requires_grad(true);
    dp::optim::Adam opt{std::vector<Tensor>{p, q}, dp::optim::AdamOptions{.lr = 0.1}};
    void train(int from, int to) {
      for (int s = from; s < to; ++s) {
        opt.zero_grad();
        two_params_loss(p, q, s % 3).backward();
        opt.step();
      }
    }
  };
  Loose whole;
  whole.train(0, 5);
  CHECK(own_step(whole.opt, 0) == std::optional<double>(3.0));
  Loose first, resumed;
  first.train(0, 2);
  CHECK(own_step(first.opt, 0) == std::optional<double>(1.0));
  resumed.opt.load_state_dict(first.opt.state_dict());
  {
    dp::NoGradGuard no_grad;
    resumed.p.copy_(first.p);
    resumed.q.copy_(first.q);
  }
  resumed.train(2, 5);
  CHECK(bitwise(values(resumed.p), values(whole.p)));
  CHECK(bitwise(values(resumed.q), values(whole.q)));
  CHECK(own_step(resumed.opt, 0) == own_step(whole.opt, 0));
  // Without the entry p would take the optimizer's count: a different bias correction.
  Loose forgetful;
  nn_state_without_step(first.opt, forgetful.opt);
  {
    dp::NoGradGuard no_grad;
    forgetful.p.copy_(first.p);
    forgetful.q.copy_(first.q);
  }
  forgetful.train(2, 5);
  CHECK(!bitwise(values(forgetful.p), values(whole.p)));
}

namespace {

// kSteps AdamW steps of ThreeLinear under the mid_used schedule; devices == 0: the plain
// net. `accumulate`: each step is two micro-batches, the first using the middle layer as
// scheduled (NoSync: inside no_sync), the second never: it is stepped when the first
// used it.
struct Run {
  std::vector<float> params;
  std::vector<std::vector<float>> mid;  // its weight after each step
};

enum class Accumulate { No, Backwards, NoSync };

Run train(int devices, std::optional<dp::DataParallelOptions> options, Accumulate accumulate) {
  auto net = std::make_shared<ThreeLinear>(11);
  std::optional<dp::DataParallel> model;
  if (options) model.emplace(net, cpus(devices), *options);
  dp::optim::AdamW opt(net->parameters(), {.lr = 0.05, .weight_decay = 0.1});
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    const Batch b = make_batch(9, 20 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    net->use_mid = mid_used(s);
    if (accumulate != Accumulate::No) {
      const Batch a = make_batch(9, 50 + static_cast<std::uint64_t>(s));
      if (model && accumulate == Accumulate::NoSync) {
        auto guard = model->no_sync();
        dp::mul(loss_fn((*model)(a.x), a.y), 0.5).backward();
      } else {
        dp::mul(loss_fn(model ? (*model)(a.x) : net->forward(a.x), a.y), 0.5).backward();
      }
      net->use_mid = false;
    }
    Tensor loss = loss_fn(model ? (*model)(b.x) : net->forward(b.x), b.y);
    (accumulate != Accumulate::No ? dp::mul(loss, 0.5) : loss).backward();
    opt.step();
    run.mid.push_back(values(net->mid->parameters()[0]));
  }
  run.params = flat(net->state_dict());
  return run;
}

// Uses its middle layer only when its batch has an odd number of rows: on several
// devices, only the replicas whose shard is odd reach it.
struct OddRowsUseMid : ThreeLinear {
  explicit OddRowsUseMid(std::uint64_t seed) : ThreeLinear(seed) {}
  Tensor forward(const Tensor& x) override {
    Tensor h = fc1->forward(x).relu();
    if (x.size(0) % 2 == 1) h = mid->forward(h).relu();
    return fc3->forward(h);
  }
};

}  // namespace

TEST_CASE("every design skips a parameter no device reached, and steps one that some device reached") {
  for (Accumulate accumulate : {Accumulate::No, Accumulate::Backwards, Accumulate::NoSync}) {
    CAPTURE(static_cast<int>(accumulate));
    const Run single = train(0, std::nullopt, accumulate);
    for (int s = 1; s < kSteps; ++s) {
      CAPTURE(s);
      const bool stepped = mid_used(s);  // the first micro-batch follows the schedule
      CHECK(bitwise(single.mid[static_cast<std::size_t>(s)], single.mid[static_cast<std::size_t>(s) - 1]) == !stepped);
    }
    for (int n : {1, 2, 3}) {
      std::optional<std::vector<float>> first;
      for (const auto& [name, options] : designs_and_tiny_buckets()) {
        // no_sync: DP sums onto device 0 after every backward anyway (another order of
        // the sums), and stage 3 keeps no full gradient to accumulate into.
        if (accumulate == Accumulate::NoSync && (options.mode == dp::Mode::DP || options.shard_stage == 3)) continue;
        CAPTURE(n);
        CAPTURE(name);
        const Run run = train(n, options, accumulate);
        CHECK(max_diff(run.params, single.params) < 2e-6);
        for (int s = 1; s < kSteps; ++s) {
          CAPTURE(s);
          if (!mid_used(s))
            CHECK(bitwise(run.mid[static_cast<std::size_t>(s)], run.mid[static_cast<std::size_t>(s) - 1]));
        }
        if (!first) first = run.params;
        CHECK(bitwise(run.params, *first));  // the designs bit for bit
      }
    }
  }
  // Reached on some devices only: 9 rows on 2 devices are shards of 5 and 4, so only
  // device 0's replica uses the middle layer; 8 rows (4 and 4) reach it nowhere.
  std::optional<std::vector<float>> first;
  for (const auto& [name, options] : designs_and_tiny_buckets()) {
    CAPTURE(name);
    auto net = std::make_shared<OddRowsUseMid>(12);
    dp::DataParallel model(net, cpus(2), options);
    dp::optim::AdamW opt(net->parameters(), {.lr = 0.05, .weight_decay = 0.1});
    for (std::int64_t rows : {9, 8, 9}) {
      CAPTURE(rows);
      const std::vector<float> before = values(net->mid->parameters()[0]);
      const Batch b = make_batch(rows, static_cast<std::uint64_t>(rows));
      opt.zero_grad();
      loss_fn(model(b.x), b.y).backward();
      opt.step();
      CHECK(bitwise(values(net->mid->parameters()[0]), before) == (rows == 8));
    }
    const std::vector<float> got = flat(net->state_dict());
    if (!first) first = got;
    CHECK(bitwise(got, *first));
    // Every replica holds device 0's values: a forward on 3 rows per device (all reach
    // the middle layer) equals one device's.
    const Batch b = make_batch(6, 77);
    auto ref = std::make_shared<OddRowsUseMid>(12);
    ref->load_state_dict(net->state_dict());
    const std::vector<float> want = values(ref->forward(b.x.narrow(0, 0, 3)));
    const std::vector<float> out = values(model(b.x));
    CHECK(max_diff(std::vector<float>(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(want.size())), want) < 1e-6);
  }
}

TEST_CASE("set_grad on a module's parameter is PyTorch's p.grad = g: the step uses it, and it counts as a gradient") {
  // Before, set_grad replaced the leaf's view of the flat buffer, which the optimizer
  // reads: the given gradient was silently ignored.
  auto net = std::make_shared<ThreeLinear>(13);
  dp::optim::SGD opt(net->parameters(), {.lr = 0.5});
  Tensor w = net->mid->parameters()[0];
  const std::vector<float> before = values(w);
  opt.zero_grad();
  w.set_grad(dp::full(w.shape(), 2.0));  // no backward reached it: given by hand
  CHECK(w.grad().to_vector() == std::vector<float>(before.size(), 2.0f));
  opt.step();
  const std::vector<float> after = values(w);
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(after[i] == before[i] - 1.0f);
  // The other layers had no gradient: not stepped.
  CHECK(bitwise(values(net->fc1->parameters()[0]), values(std::make_shared<ThreeLinear>(13)->fc1->parameters()[0])));
  // A parameter's .grad cannot become undefined (zero_grad() is the way); bad shapes are refused.
  CHECK_THROWS_WITH_AS(w.set_grad(Tensor()), doctest::Contains("zero_grad()"), dp::Error);
  CHECK_THROWS_WITH_AS(w.set_grad(dp::zeros({2})), doctest::Contains("[2]"), dp::Error);
  // Under DataParallel the edit of device 0's gradient reaches every replica (DDP).
  auto net2 = std::make_shared<ThreeLinear>(13);
  dp::DataParallel model(net2, cpus(2), {.mode = dp::Mode::DDP});
  dp::optim::SGD opt2(model.parameters(), {.lr = 0.5});
  const Batch b = make_batch(6, 3);
  opt2.zero_grad();
  loss_fn(model(b.x), b.y).backward();
  Tensor w2 = net2->mid->parameters()[0];
  const std::vector<float> before2 = values(w2);
  w2.set_grad(dp::full(w2.shape(), 2.0));
  opt2.step();
  const std::vector<float> after2 = values(w2);
  for (std::size_t i = 0; i < before2.size(); ++i) CHECK(after2[i] == before2[i] - 1.0f);
  CHECK_NOTHROW(model.check_replicas());  // throws when a replica differs
}

TEST_CASE("set_grad under Sharded stages 2 and 3 is refused: the gradient lives in the owners' ranges") {
  // Before, the leaf's .grad was replaced while the step read the owners' ranges: the
  // given gradient was silently ignored (a zero gradient still moved the parameters).
  // Stage 1 keeps device 0's view, and its step after the edit is refused instead.
  for (int stage = 2; stage <= 3; ++stage) {
    CAPTURE(stage);
    auto net = std::make_shared<ThreeLinear>(13);
    auto ref_net = std::make_shared<ThreeLinear>(13);
    dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::Sharded, .shard_stage = stage});
    dp::DataParallel ref(ref_net, cpus(2), {.mode = dp::Mode::DDP});
    dp::optim::SGD opt(model.parameters(), {.lr = 0.5});
    dp::optim::SGD ref_opt(ref.parameters(), {.lr = 0.5});
    const Batch b = make_batch(6, 3);
    Tensor w = model.parameters()[2];
    // Before any backward, and between backward and step.
    CHECK_THROWS_WITH_AS(w.set_grad(dp::zeros(w.shape())), doctest::Contains("sharded over the devices"), dp::Error);
    opt.zero_grad();
    ref_opt.zero_grad();
    loss_fn(model(b.x), b.y).backward();
    loss_fn(ref(b.x), b.y).backward();
    w = model.parameters()[2];
    CHECK_FALSE(w.grad().defined());
    CHECK_THROWS_WITH_AS(w.set_grad(dp::zeros(w.shape())), doctest::Contains("clip_grad_norm_"), dp::Error);
    // Nothing was half done: the step applies the summed gradient, as DDP's does.
    opt.step();
    ref_opt.step();
    const auto got = model.parameters(), want = ref.parameters();
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(bitwise(values(got[i]), values(want[i])));
  }
}
