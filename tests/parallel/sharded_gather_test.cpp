// DataParallel in Sharded mode, stages 1 and 2: the two places of the parameter
// gather (ShardGather::AfterStep inside opt.step(), ShardGather::NextForward before
// each top-level child's next use, Note [Deferred gather]) give DDP's parameters bit
// for bit, whatever reads or writes the parameters between a step and the next
// forward, and survive failures.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include "dp/dp.h"
#include "mlp_fixture.h"
#include "parallel/shard_store.h"

namespace {

using dp::Tensor;

dp::DataParallelOptions sharded(int stage, dp::ShardGather gather, dp::DataParallelOptions o = {}) {
  o.mode = dp::Mode::Sharded;
  o.shard_stage = stage;
  o.shard_gather = gather;
  return o;
}

std::string scratch_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("dp_sharded_gather_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

enum class Path { Module, WorkerLoss };

// What a training loop does with the parameters between a step and the next forward.
enum class Reader {
  None,
  StateDict,      // net->state_dict() after every step
  KeptTensors,    // tensors taken from model.parameters() before the loop, read after every step
  CheckReplicas,  // model.check_replicas() after every step, and check_replicas_every = 1
  Clip,           // clip_grad_norm_ between backward and step
  Checkpoint,     // dp::save after a step, dp::load into a fresh net and back into the model
  Eval,           // model(x) under no_grad after every step
  UserForward,    // net->forward(x) on the user's thread under no_grad after every step
  SecondStep,     // opt.step() twice in a row every other step
  NoSync,         // a micro-batch under no_sync() before the synced one
  Load,           // load_state_dict of other values half way
};

const Reader kReaders[] = {Reader::None,       Reader::StateDict, Reader::KeptTensors, Reader::CheckReplicas,
                           Reader::Clip,       Reader::Checkpoint, Reader::Eval,       Reader::UserForward,
                           Reader::SecondStep, Reader::NoSync,     Reader::Load};

struct RunResult {
  std::vector<float> params, opt_state;
  std::vector<double> losses;
  std::vector<std::vector<float>> seen;  // what the reader read, step by step
};

RunResult train(int n, dp::DataParallelOptions opts, Path path, std::int64_t rows, Reader reader,
                int steps = 10) {
  if (reader == Reader::CheckReplicas) opts.check_replicas_every = 1;
  auto net = make_mlp(42);
  dp::DataParallel model(net, cpus(n), opts);
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  const auto kept = model.parameters();
  const Batch eval = make_batch(7, 999);
  const std::string file = scratch_file("ckpt.safetensors");
  RunResult res;
  for (int s = 0; s < steps; ++s) {
    Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    if (reader == Reader::NoSync) {
      dp::DataParallel::NoSyncGuard guard(model);
      Batch micro = make_batch(rows, 500 + static_cast<std::uint64_t>(s));
      model.forward_backward(micro.x, micro.y, loss_fn);
    }
    Tensor loss;
    if (path == Path::Module) {
      loss = loss_fn(model(b.x), b.y);
      loss.backward();
    } else {
      loss = model.forward_backward(b.x, b.y, loss_fn);
    }
    res.losses.push_back(loss.item());
    if (reader == Reader::Clip)
      res.seen.push_back({static_cast<float>(dp::nn::utils::clip_grad_norm_(model.parameters(), 0.05))});
    opt.step();
    switch (reader) {
      case Reader::StateDict: res.seen.push_back(flat(net->state_dict())); break;
      case Reader::KeptTensors: {
        std::vector<float> v;
        for (const Tensor& t : kept) {
          auto x = t.to_vector();
          v.insert(v.end(), x.begin(), x.end());
        }
        res.seen.push_back(v);
        break;
      }
      case Reader::CheckReplicas: model.check_replicas(); break;
      case Reader::Checkpoint:
        if (s % 3 == 1) {
          dp::save(net, file);
          auto fresh = make_mlp(7);
          dp::load(fresh, file);
          res.seen.push_back(flat(fresh->state_dict()));
          dp::load(net, file);  // the same values, written into device 0's copy
        }
        break;
      case Reader::Eval: {
        dp::NoGradGuard no_grad;
        res.seen.push_back(model(eval.x).to_vector());
        break;
      }
      case Reader::UserForward: {
        dp::NoGradGuard no_grad;
        res.seen.push_back(net->forward(eval.x).to_vector());
        break;
      }
      case Reader::SecondStep:
        if (s % 2 == 0) opt.step();
        break;
      case Reader::Load:
        if (s == 4) {
          dp::NoGradGuard no_grad;
          model.load_state_dict(make_mlp(77)->state_dict());
        }
        break;
      default: break;
    }
  }
  std::filesystem::remove(file);
  res.params = flat(net->state_dict());
  res.opt_state = flat(opt.state_dict());
  return res;
}

void check_same(const RunResult& a, const RunResult& b) {
  CHECK(a.params == b.params);
  CHECK(a.opt_state == b.opt_state);
  CHECK(a.losses == b.losses);
  CHECK(a.seen == b.seen);
}

}  // namespace

TEST_CASE("both gathers give DDP's parameters bit for bit after 10 Adam steps on 1-4 devices, uneven shards") {
  for (std::int64_t rows : {16, 10, 2}) {  // even, uneven (10 on 4), fewer rows than devices
    for (int n = 1; n <= 4; ++n) {
      for (Path path : {Path::Module, Path::WorkerLoss}) {
        CAPTURE(rows);
        CAPTURE(n);
        CAPTURE(static_cast<int>(path));
        const RunResult ddp = train(n, {.mode = dp::Mode::DDP}, path, rows, Reader::None);
        for (int stage : {1, 2})
          for (dp::ShardGather g : {dp::ShardGather::AfterStep, dp::ShardGather::NextForward}) {
            CAPTURE(stage);
            CAPTURE(static_cast<int>(g));
            check_same(train(n, sharded(stage, g), path, rows, Reader::None), ddp);
          }
      }
    }
  }
}

TEST_CASE("whatever reads or writes the parameters between a step and the next forward sees DDP's values") {
  for (Reader reader : kReaders) {
    for (int n : {2, 3}) {
      CAPTURE(static_cast<int>(reader));
      CAPTURE(n);
      const RunResult ddp = train(n, {.mode = dp::Mode::DDP}, Path::WorkerLoss, 10, reader);
      for (int stage : {1, 2}) {
        CAPTURE(stage);
        check_same(train(n, sharded(stage, dp::ShardGather::NextForward), Path::WorkerLoss, 10, reader), ddp);
        check_same(train(n, sharded(stage, dp::ShardGather::AfterStep), Path::Module, 10, reader),
                   train(n, {.mode = dp::Mode::DDP}, Path::Module, 10, reader));
      }
    }
  }
}

TEST_CASE("NextForward: device 0 is whole when step() returns, the others once their forward used each unit") {
  auto net = make_mlp(3);
  dp::DataParallel model(net, cpus(4), sharded(2, dp::ShardGather::NextForward));
  dp::optim::Adam opt(model.parameters(), {.lr = 0.1});
  auto set = net->parameters().set();
  const auto* store = dp::parallel::ShardStore::of(*set);
  REQUIRE(store->units().size() == 3);  // the three Linear layers
  Batch b = make_batch(8, 1);
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  const auto before = set->copy(0).data.to_vector();
  opt.step();
  const auto after = set->copy(0).data.to_vector();
  for (int r = 1; r < 4; ++r) {
    CAPTURE(r);
    const auto mine = set->copy(r).data.to_vector();
    const auto c = dp::nn::copy_span(*set, r);
    bool others_old = true, own_new = true;
    for (std::int64_t i = 0; i < set->numel(); ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (i >= c.begin && i < c.end) {
        own_new = own_new && mine[k] == after[k];
      } else {
        others_old = others_old && mine[k] == before[k];
      }
    }
    CHECK(own_new);
    CHECK(others_old);  // deferred: nothing was gathered into the other devices
    CHECK_FALSE(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  }
  CHECK(after != before);
  model.check_replicas();  // a stale unit's other pieces are not compared
  {
    dp::NoGradGuard no_grad;
    model(b.x);
  }
  for (int r = 1; r < 4; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  // A replica's own range written behind dp's back is still caught while the unit is stale.
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  {
    dp::NoGradGuard no_grad;
    dp::nn::copy_span(*set, 1).data.narrow(0, 0, 1).add_(1.0);
  }
  CHECK_THROWS_WITH_AS(model.check_replicas(), doctest::Contains("replica on cpu:1 differs"), dp::Error);
}

TEST_CASE("Stats::gather_bytes: AfterStep's all-gather brings the other ranges, NextForward's pulls the other owners' parameters") {
  constexpr int n = 3;
  for (dp::ShardGather gather : {dp::ShardGather::AfterStep, dp::ShardGather::NextForward}) {
    CAPTURE(static_cast<int>(gather));
    auto net = make_mlp(3);
    dp::DataParallel model(net, cpus(n), sharded(1, gather));
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
    const std::int64_t numel = net->parameters().set()->numel();
    const auto shards = model.shards();
    const Batch b = make_batch(8, 1);
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    model.reset_stats();
    opt.step();
    model.forward_backward(b.x, b.y, loss_fn);  // NextForward: the pulls
    const auto stats = model.stats();
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto [lo, hi] = shards[static_cast<std::size_t>(r)];
      const std::int64_t len = hi - lo, own = std::max<std::int64_t>(0, std::min(hi, numel) - lo);
      // AfterStep: every other range, padding included; NextForward: device 0 copies the
      // other ranges when the step ends, every other device pulls the other owners'
      // parameters as its forward uses them.
      std::int64_t elements = (n - 1) * len;
      if (gather == dp::ShardGather::NextForward && r > 0) elements = numel - own;
      CHECK(stats.devices[static_cast<std::size_t>(r)].gather_bytes == elements * 4);
    }
  }
}

TEST_CASE("shard_gather is checked: another mode, stage 3, across processes") {
  auto net = make_mlp(5);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, cpus(2), {.mode = dp::Mode::DDP,
                                                       .shard_gather = dp::ShardGather::NextForward}),
                       doctest::Contains("applies to Mode::Sharded stages 1 and 2"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, cpus(2), sharded(3, dp::ShardGather::AfterStep)),
                       doctest::Contains("shard_gather was given with shard_stage 3"), dp::Error);
  dp::DataParallel ok(net, cpus(2), sharded(1, dp::ShardGather::NextForward));
  CHECK(ok.shard_stage() == 1);
}

namespace {

// Throws in forward on cpu:2, once, when armed: before any parameter was read
// (`early`), or after its first child ran, with the second child not yet gathered.
struct Faulty : dp::nn::Module {
  Faulty() {
    dp::Generator gen(9);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 5, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(5, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    if (armed.load() && early && dp::nn::ReplicaBinding::current() == 2) {
      armed = false;
      throw dp::Error("injected failure");
    }
    Tensor h = fc1->forward(x).relu();
    if (armed.load() && dp::nn::ReplicaBinding::current() == 2) {
      armed = false;
      throw dp::Error("injected failure");
    }
    return fc2->forward(h);
  }
  std::atomic<bool> armed{false};
  bool early = false;
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};

}  // namespace

TEST_CASE("NextForward: a worker failing mid-forward with units still to gather; nothing hangs, the next steps "
          "are DDP's") {
  for (int stage : {1, 2}) {
    for (bool early : {false, true}) {
      for (Path path : {Path::WorkerLoss, Path::Module}) {
        CAPTURE(stage);
        CAPTURE(early);
        CAPTURE(static_cast<int>(path));
        auto net = std::make_shared<Faulty>(), ref_net = std::make_shared<Faulty>();
        net->early = early;
        dp::DataParallel model(net, cpus(3), sharded(stage, dp::ShardGather::NextForward));
        dp::DataParallel ref(ref_net, cpus(3), {.mode = dp::Mode::DDP});
        dp::optim::Adam opt(model.parameters(), {.lr = 0.1});
        dp::optim::Adam ref_opt(ref.parameters(), {.lr = 0.1});
        Batch b = make_batch(9, 11);
        auto step = [&](bool both) {
          opt.zero_grad();
          model.forward_backward(b.x, b.y, loss_fn);
          opt.step();
          if (!both) return;
          ref_opt.zero_grad();
          ref.forward_backward(b.x, b.y, loss_fn);
          ref_opt.step();
        };
        step(true);  // every other device's copy is now stale
        net->armed = true;
        opt.zero_grad();
        auto fut = std::async(std::launch::async, [&] {
          if (path == Path::WorkerLoss) {
            CHECK_THROWS_WITH_AS(model.forward_backward(b.x, b.y, loss_fn), doctest::Contains("cpu:2"), dp::Error);
          } else {
            CHECK_THROWS_WITH_AS(model(b.x), doctest::Contains("cpu:2"), dp::Error);
          }
        });
        REQUIRE(fut.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
        fut.get();
        for (int s = 0; s < 2; ++s) step(true);
        CHECK(flat(net->state_dict()) == flat(ref_net->state_dict()));
        CHECK(flat(opt.state_dict()) == flat(ref_opt.state_dict()));
        model.check_replicas();
      }
    }
  }
}

TEST_CASE("NextForward: a failed optimizer step; device 0's parameters win, every copy continues from them") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = make_mlp(6);
    dp::DataParallel model(net, cpus(3), sharded(stage, dp::ShardGather::NextForward));
    FaultySgd opt(model.parameters());
    Batch b = make_batch(9, 11);
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    opt.step();  // the replicas are stale from here
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    opt.armed = true;
    auto fut = std::async(std::launch::async, [&] {
      CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("cpu:1"), dp::Error);
    });
    REQUIRE(fut.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    fut.get();
    auto ref_net = make_mlp(0);
    {
      dp::NoGradGuard no_grad;
      ref_net->load_state_dict(net->state_dict());
    }
    dp::DataParallel ref(ref_net, cpus(3), {.mode = dp::Mode::DDP});
    FaultySgd ref_opt(ref.parameters());
    for (auto* o : {static_cast<dp::optim::Optimizer*>(&opt), static_cast<dp::optim::Optimizer*>(&ref_opt)})
      o->zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    ref.forward_backward(b.x, b.y, loss_fn);
    opt.step();
    ref_opt.step();
    auto set = model.parameters().set();
    CHECK(dp::equal(set->copy(0).data.narrow(0, 0, set->numel()), ref.parameters().set()->copy(0).data));
    {
      dp::NoGradGuard no_grad;
      model(b.x);  // every unit used: every copy whole again
    }
    for (int r = 1; r < 3; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  }
}

TEST_CASE("NextForward: a child skipped by some forwards never receives pieces taken before an update") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    // A step that skips mid leaves its pieces started ahead (Note [Copies ahead], taken
    // when fc1 was pulled); they must never land after the owners updated the range.
    auto net = std::make_shared<ThreeLinear>(13), ref_net = std::make_shared<ThreeLinear>(13);
    dp::DataParallel model(net, cpus(3), sharded(stage, dp::ShardGather::NextForward));
    dp::DataParallel ref(ref_net, cpus(3), {.mode = dp::Mode::DDP});
    dp::optim::Adam opt(model.parameters(), {.lr = 0.05});
    dp::optim::Adam ref_opt(ref.parameters(), {.lr = 0.05});
    for (int s = 0; s < 6; ++s) {
      CAPTURE(s);
      net->use_mid = ref_net->use_mid = s % 3 == 0;  // used, skipped twice, used, ...
      step_both(model, opt, ref, ref_opt, make_batch(9, 40 + static_cast<std::uint64_t>(s)));
      CHECK(flat(net->state_dict()) == flat(ref_net->state_dict()));
    }
    CHECK(flat(opt.state_dict()) == flat(ref_opt.state_dict()));
    // Every replica holds device 0's values once each unit was used: a full forward.
    net->use_mid = ref_net->use_mid = true;
    Batch b = make_batch(9, 99);
    CHECK(model(b.x).to_vector() == ref(b.x).to_vector());
  }
}
