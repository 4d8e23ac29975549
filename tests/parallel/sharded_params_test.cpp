// DataParallel in Sharded mode, ZeRO stage 3 (sharded parameters): bitwise DDP's
// parameters, gather units, what the user reads between steps, checkpoints that
// resume in any device count, gradient accumulation and failures.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include "dp/dp.h"
#include "mlp_fixture.h"
#include "parallel/shard_store.h"

namespace {

using dp::Tensor;

dp::DataParallelOptions sharded(int stage, dp::DataParallelOptions o = {}) {
  o.mode = dp::Mode::Sharded;
  o.shard_stage = stage;
  return o;
}

enum class Path { Module, WorkerLoss };

struct RunResult {
  std::vector<float> params, opt_state;
  std::vector<double> losses;
};

RunResult train(int n, dp::DataParallelOptions opts, Path path, std::int64_t rows, int steps = 10) {
  auto net = make_mlp(42);
  dp::DataParallel model(net, cpus(n), opts);
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  RunResult res;
  for (int s = 0; s < steps; ++s) {
    Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    Tensor loss;
    if (path == Path::Module) {
      loss = loss_fn(model(b.x), b.y);
      loss.backward();
    } else {
      loss = model.forward_backward(b.x, b.y, loss_fn);
    }
    res.losses.push_back(loss.item());
    opt.step();
  }
  res.params = flat(net->state_dict());
  res.opt_state = flat(opt.state_dict());
  return res;
}

std::string scratch_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("dp_sharded_params_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

}  // namespace

TEST_CASE("stages 1, 2 and 3 give DDP's parameters bit for bit after 10 Adam steps on 1-4 devices") {
  const dp::DataParallelOptions tiny{.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6};  // a bucket per parameter
  for (std::int64_t rows : {16, 10, 2}) {  // even, uneven (10 on 4), fewer rows than devices
    for (int n = 1; n <= 4; ++n) {
      for (Path path : {Path::Module, Path::WorkerLoss}) {
        CAPTURE(rows);
        CAPTURE(n);
        CAPTURE(static_cast<int>(path));
        const RunResult ddp = train(n, {.mode = dp::Mode::DDP}, path, rows);
        for (int stage : {1, 2, 3}) {
          CAPTURE(stage);
          const RunResult sh = train(n, sharded(stage), path, rows);
          CHECK(sh.params == ddp.params);
          CHECK(sh.opt_state == ddp.opt_state);
          CHECK(sh.losses == ddp.losses);
        }
        const RunResult small = train(n, sharded(3, tiny), path, rows);
        CHECK(small.params == ddp.params);
      }
    }
  }
}

TEST_CASE("stage 3: a unit per top-level child, only the owned range kept between steps") {
  auto net = make_mlp(1);
  dp::DataParallel model(net, cpus(4), sharded(3));
  CHECK(model.shard_stage() == 3);
  auto set = net->parameters().set();
  const auto* store = dp::parallel::ShardStore::of(*set);
  REQUIRE((store != nullptr && store->shards_params()));
  const auto& units = store->units();
  REQUIRE(units.size() == 3);  // the three Linear layers; the ReLUs have no parameters
  CHECK(units[0] == std::make_pair<std::int64_t, std::int64_t>(0, 6 * 16 + 16));
  CHECK(units[1] == std::make_pair<std::int64_t, std::int64_t>(112, 112 + 16 * 8 + 8));
  CHECK(units[2] == std::make_pair<std::int64_t, std::int64_t>(248, 275));
  // The buckets never straddle a unit.
  for (auto [lo, hi] : model.buckets()) {
    bool inside = false;
    for (auto [a, b] : units) inside = inside || (a <= lo && hi <= b);
    CHECK(inside);
  }
  Batch b = make_batch(8, 3);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  // After a step every device holds its range only: no unit is gathered.
  for (int r = 0; r < 4; ++r) {
    CHECK(set->copy(r).data.numel() == dp::nn::copy_span(*set, r).end - dp::nn::copy_span(*set, r).begin);
    for (int u = 0; u < 3; ++u) CHECK_FALSE(store->unit_gathered(r, u));
  }
}

TEST_CASE("stage 3 between steps: reading gathers device 0's copy; a stale tensor is a clear error") {
  auto net = make_mlp(2), ref = make_mlp(2);
  dp::DataParallel model(net, cpus(3), sharded(3));
  dp::DataParallel ddp(ref, cpus(3), {.mode = dp::Mode::DDP});
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  dp::optim::Adam ref_opt(ddp.parameters(), {.lr = 1e-2});
  Batch b = make_batch(9, 4);
  for (auto* o : {static_cast<dp::optim::Optimizer*>(&opt), static_cast<dp::optim::Optimizer*>(&ref_opt)})
    o->zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  ddp.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  ref_opt.step();
  // parameters(), named_parameters() and state_dict() gather: full tensors, DDP's values.
  auto params = model.parameters();
  auto ref_params = ddp.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) CHECK(dp::equal(params[i], ref_params[i]));
  CHECK(flat(model.state_dict()) == flat(ddp.state_dict()));
  CHECK(flat(net->named_parameters()) == flat(ref->named_parameters()));
  // The next step releases them: a tensor kept from before is an error, not garbage.
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  CHECK_THROWS_WITH_AS(params[0].to_vector(), doctest::Contains("released"), dp::Error);
  CHECK_THROWS_WITH_AS(params[0].to_vector(), doctest::Contains("called again after each step"), dp::Error);
  // An edit through the gathered copy reaches every device's range.
  {
    dp::NoGradGuard no_grad;
    Tensor(net->parameters()[2]).fill_(0.5);
    Tensor(ref->parameters()[2]).fill_(0.5);
  }
  ref_opt.zero_grad();
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  ddp.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  ref_opt.step();
  CHECK(flat(net->state_dict()) == flat(ref->state_dict()));
  // Unwrapping hands back a plain module with the trained values.
  const auto before = flat(net->state_dict());
  { dp::DataParallel gone(make_mlp(0), cpus(2), sharded(3)); }
  CHECK(flat(net->state_dict()) == before);
}

TEST_CASE("stage 3 checkpoints are full tensors and resume bit for bit in the same or another device count") {
  const std::string path = scratch_file("ckpt.safetensors");
  auto run = [&](int n, dp::DataParallelOptions opts, int from, int to, bool load, bool save) {
    auto net = make_mlp(load ? 99 : 8);
    dp::DataParallel model(net, cpus(n), opts);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    if (load) {
      dp::TrainingState st;
      dp::load_training_checkpoint(path, *net, opt, st);
      CHECK(st.step == from);
    }
    for (int s = from; s < to; ++s) {
      Batch b = make_batch(10, 7 + static_cast<std::uint64_t>(s));
      opt.zero_grad();
      model.forward_backward(b.x, b.y, loss_fn);
      opt.step();
    }
    if (save) {
      dp::TrainingState st;
      st.step = to;
      dp::save_training_checkpoint(path, *net, opt, st);
    }
    return std::make_pair(flat(net->state_dict()), flat(opt.state_dict()));
  };
  for (int n : {3, 2, 4}) {
    CAPTURE(n);
    const auto straight = run(n, sharded(3), 0, 6, false, false);
    const auto ddp = run(n, {.mode = dp::Mode::DDP}, 0, 6, false, false);
    CHECK(straight.first == ddp.first);
    run(3, sharded(3), 0, 3, false, true);                    // saved by stage 3 on 3 devices
    const auto resumed = run(n, sharded(3), 3, 6, true, false);  // resumed on n devices
    // The file holds full tensors under the module's names: it loads into DDP too, and
    // both continue bit for bit alike.
    const auto into_ddp = run(n, {.mode = dp::Mode::DDP}, 3, 6, true, false);
    CHECK(resumed.first == into_ddp.first);
    CHECK(resumed.second == into_ddp.second);
    // On the device count it was saved with, the resumed run is the uninterrupted one
    // (other counts round the per-device GEMMs differently from step 3 on).
    if (n == 3) {
      CHECK(resumed.first == straight.first);
      CHECK(resumed.second == straight.second);
    }
  }
  std::filesystem::remove(path);
}

TEST_CASE("stage 3 gradient accumulation: backward twice adds up; no_sync is refused clearly") {
  Batch big = make_batch(16, 3);
  auto half_loss = [](const Tensor& o, const Tensor& y) { return dp::mul(loss_fn(o, y), 0.5); };
  auto run = [&](bool halves) {
    auto net = make_mlp(5);
    dp::DataParallel model(net, cpus(3), sharded(3, {.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4}));
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      if (!halves) {
        model.forward_backward(big.x, big.y, loss_fn);
      } else {
        model.forward_backward(big.x.narrow(0, 0, 8), big.y.narrow(0, 0, 8), half_loss);
        model.forward_backward(big.x.narrow(0, 8, 8), big.y.narrow(0, 8, 8), half_loss);
      }
      opt.step();
    }
    return flat(net->state_dict());
  };
  const auto one = run(false), two = run(true);
  REQUIRE(one.size() == two.size());
  for (std::size_t i = 0; i < one.size(); ++i) CHECK(std::fabs(one[i] - two[i]) < 1e-6);
  auto net = make_mlp(5);
  dp::DataParallel model(net, cpus(2), sharded(3));
  CHECK_THROWS_WITH_AS(model.no_sync(), doctest::Contains("no_sync() with shard_stage 3"), dp::Error);
}

namespace {

// Throws in forward on one device, once, when armed — after its first layer ran, so
// that a unit is gathered when it fails.
struct Faulty : dp::nn::Module {
  Faulty() {
    dp::Generator gen(9);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 5, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(5, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = fc1->forward(x).relu();
    if (armed.load() && dp::nn::ReplicaBinding::current() == 2) {
      armed = false;
      throw dp::Error("injected failure");
    }
    return fc2->forward(h);
  }
  std::atomic<bool> armed{false};
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};

}  // namespace

TEST_CASE("stage 3: a failure in a worker mid-step reaches the caller, nothing hangs, the next step is correct") {
  auto net = std::make_shared<Faulty>(), ref_net = std::make_shared<Faulty>();
  dp::DataParallel model(net, cpus(3), sharded(3));
  dp::DataParallel ref(ref_net, cpus(3), {.mode = dp::Mode::DDP});
  dp::optim::Adam opt(model.parameters(), {.lr = 0.1});
  dp::optim::Adam ref_opt(ref.parameters(), {.lr = 0.1});
  Batch b = make_batch(9, 11);
  auto set = net->parameters().set();
  const auto* store = dp::parallel::ShardStore::of(*set);
  for (Path path : {Path::WorkerLoss, Path::Module}) {
    CAPTURE(static_cast<int>(path));
    net->armed = true;
    auto fut = std::async(std::launch::async, [&] {
      if (path == Path::WorkerLoss) {
        CHECK_THROWS_WITH_AS(model.forward_backward(b.x, b.y, loss_fn), doctest::Contains("cpu:2"), dp::Error);
      } else {
        CHECK_THROWS_WITH_AS(model(b.x), doctest::Contains("cpu:2"), dp::Error);
      }
    });
    REQUIRE(fut.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    fut.get();
    for (int r = 0; r < 3; ++r) {
      for (int u = 0; u < 2; ++u) CHECK_FALSE(store->unit_gathered(r, u));  // released on failure too
      CHECK(store->ahead(r).empty());  // and fc2's prefetch dropped (Note [Copies ahead])
    }
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      ref_opt.zero_grad();
      model.forward_backward(b.x, b.y, loss_fn);
      ref.forward_backward(b.x, b.y, loss_fn);
      opt.step();
      ref_opt.step();
    }
    CHECK(flat(net->state_dict()) == flat(ref_net->state_dict()));
    CHECK(flat(opt.state_dict()) == flat(ref_opt.state_dict()));
  }
}

TEST_CASE("stage 3: a child the forward skips — its prefetch is dropped, the results stay DDP's") {
  // The prefetch of mid, started when fc1 became current, is dropped when fc3 does
  // (Note [Copies ahead]).
  auto net = std::make_shared<ThreeLinear>(5), ref_net = std::make_shared<ThreeLinear>(5);
  net->use_mid = ref_net->use_mid = false;
  dp::DataParallel model(net, cpus(3), sharded(3));
  dp::DataParallel ref(ref_net, cpus(3), {.mode = dp::Mode::DDP});
  auto set = net->parameters().set();  // not inside forward: parameters() gathers copy 0
  const auto* store = dp::parallel::ShardStore::of(*set);
  REQUIRE(store->units().size() == 3);
  std::mutex mu;
  int seen_pending_mid = 0, seen_mid_gathered = 0, forwards = 0;
  net->after_forward = [&] {
    const int r = dp::nn::ReplicaBinding::current();
    if (r < 0) return;
    const auto& ahead = store->ahead(r);
    std::lock_guard<std::mutex> lock(mu);
    seen_pending_mid += ahead.size() > 1 && !ahead[1].empty() ? 1 : 0;
    seen_mid_gathered += store->unit_gathered(r, 1) ? 1 : 0;
    ++forwards;
  };
  dp::optim::Adam opt(model.parameters(), {.lr = 0.1});
  dp::optim::Adam ref_opt(ref.parameters(), {.lr = 0.1});
  for (int s = 0; s < 3; ++s) {
    Batch b = make_batch(9, 20 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    ref_opt.zero_grad();
    loss_fn(model(b.x), b.y).backward();
    loss_fn(ref(b.x), b.y).backward();
    opt.step();
    ref_opt.step();
  }
  CHECK(forwards == 9);
  CHECK(seen_pending_mid == 0);
  CHECK(seen_mid_gathered == 0);
  CHECK(flat(net->state_dict()) == flat(ref_net->state_dict()));
  CHECK(flat(opt.state_dict()) == flat(ref_opt.state_dict()));
}
