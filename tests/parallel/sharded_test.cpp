// DataParallel in Sharded mode (ZeRO stages 1 and 2) against DDP and plain training:
// bitwise-identical parameters, per-device memory by the allocator, checkpoints that
// load into any mode, gradient accumulation, options and failures.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;

enum class Path { Module, WorkerLoss };
enum class Opt { Adam, AdamW, SgdMomentum, SgdNesterov };

std::unique_ptr<dp::optim::Optimizer> make_opt(Opt kind, dp::nn::ParameterList params) {
  switch (kind) {
    case Opt::Adam: return std::make_unique<dp::optim::Adam>(std::move(params), dp::optim::AdamOptions{.lr = 1e-2});
    case Opt::AdamW:
      return std::make_unique<dp::optim::AdamW>(std::move(params),
                                                dp::optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
    case Opt::SgdMomentum:
      return std::make_unique<dp::optim::SGD>(std::move(params),
                                              dp::optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .dampening = 0.1,
                                                                    .weight_decay = 1e-3});
    case Opt::SgdNesterov:
      return std::make_unique<dp::optim::SGD>(std::move(params),
                                              dp::optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .nesterov = true});
  }
  return nullptr;
}

struct RunResult {
  std::vector<float> params, opt_state;
  std::vector<double> losses;
};

// Trains `steps` steps on n CPU devices (n = 0: plain single-device training).
RunResult train(int n, dp::DataParallelOptions opts, Path path, std::int64_t rows, int steps = 10,
                Opt kind = Opt::Adam) {
  auto net = make_mlp(42);
  std::unique_ptr<dp::DataParallel> model;
  if (n > 0) model = std::make_unique<dp::DataParallel>(net, cpus(n), opts);
  auto opt = make_opt(kind, model ? model->parameters() : net->parameters());
  RunResult res;
  for (int s = 0; s < steps; ++s) {
    Batch b = make_batch(rows, 100 + s);
    opt->zero_grad();
    Tensor loss;
    if (!model) {
      loss = loss_fn(net->forward(b.x), b.y);
      loss.backward();
    } else if (path == Path::Module) {
      loss = loss_fn((*model)(b.x), b.y);
      loss.backward();
    } else {
      loss = model->forward_backward(b.x, b.y, loss_fn);
    }
    res.losses.push_back(loss.item());
    opt->step();
  }
  res.params = flat(net->state_dict());
  res.opt_state = flat(opt->state_dict());
  return res;
}

dp::DataParallelOptions sharded(int stage, dp::DataParallelOptions o = {}) {
  o.mode = dp::Mode::Sharded;
  o.shard_stage = stage;
  return o;
}

// One device against several: per-shard GEMMs and a sum over devices round differently.
constexpr double kTolerance = 2e-5;

}  // namespace

TEST_CASE("stages 1 and 2 give DDP's parameters bit for bit after 10 Adam steps on 1-4 devices") {
  const dp::DataParallelOptions tiny{.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6};  // a bucket per parameter
  for (std::int64_t rows : {16, 10, 2}) {  // even, uneven (10 on 4), fewer rows than devices
    const RunResult single = train(0, {}, Path::Module, rows);
    for (int n = 1; n <= 4; ++n) {
      for (Path path : {Path::Module, Path::WorkerLoss}) {
        CAPTURE(rows);
        CAPTURE(n);
        CAPTURE(static_cast<int>(path));
        const RunResult ddp = train(n, {.mode = dp::Mode::DDP}, path, rows);
        const RunResult dp_res = train(n, {.mode = dp::Mode::DP}, path, rows);
        CHECK(ddp.params == dp_res.params);
        CHECK(max_diff(ddp.params, single.params) < kTolerance);
        for (int stage : {1, 2}) {
          CAPTURE(stage);
          for (const auto& buckets : {dp::DataParallelOptions{}, tiny}) {
            const RunResult sh = train(n, sharded(stage, buckets), path, rows);
            CHECK(sh.params == ddp.params);
            CHECK(sh.losses == ddp.losses);
            CHECK(sh.opt_state == ddp.opt_state);  // assembled from the shards: the same state
          }
        }
      }
    }
  }
}

TEST_CASE("SGD with momentum, Nesterov SGD, Adam and AdamW step a shard: bitwise DDP") {
  for (Opt kind : {Opt::Adam, Opt::AdamW, Opt::SgdMomentum, Opt::SgdNesterov}) {
    for (int n : {2, 3, 4}) {
      CAPTURE(static_cast<int>(kind));
      CAPTURE(n);
      const RunResult ddp = train(n, {.mode = dp::Mode::DDP}, Path::WorkerLoss, 11, 6, kind);
      for (int stage : {1, 2}) {
        CAPTURE(stage);
        const RunResult sh = train(n, sharded(stage, {.bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4}),
                                   Path::WorkerLoss, 11, 6, kind);
        CHECK(sh.params == ddp.params);
        CHECK(sh.opt_state == ddp.opt_state);
      }
    }
  }
}

TEST_CASE("every device owns an equal, aligned, contiguous range; the buckets are DDP's") {
  auto net = make_mlp(1);
  dp::DataParallel model(net, cpus(4), sharded(1, {.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6}));
  CHECK(model.shard_stage() == 1);
  const auto shards = model.shards();
  REQUIRE(shards.size() == 4);
  const std::int64_t numel = model.parameters().set()->numel();
  REQUIRE(numel == 275);
  for (std::size_t r = 0; r < shards.size(); ++r) {
    CHECK(shards[r].second - shards[r].first == 80);  // ceil(275 / 4) = 69, rounded up to 16
    CHECK(shards[r].first == static_cast<std::int64_t>(r) * 80);
  }
  CHECK(model.parameters().set()->buffer_numel() == 320);  // zero padding after the parameters
  CHECK(model.buckets().size() == 6);                      // one per parameter, as DDP's
  dp::DataParallel ddp(make_mlp(1), cpus(4), {.mode = dp::Mode::DDP, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6});
  CHECK(model.buckets() == ddp.buckets());
  CHECK(ddp.shards().empty());
  CHECK(ddp.shard_stage() == 0);
}

TEST_CASE("bad shard options are a clear dp::Error") {
  auto net = make_mlp(1);
  for (int stage : {0, 4, -1}) {
    CAPTURE(stage);
    CHECK_THROWS_WITH_AS(dp::DataParallel(net, cpus(2), sharded(stage)), doctest::Contains("expected shard_stage 1"),
                         dp::Error);
  }
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, cpus(2), {.mode = dp::Mode::DDP, .shard_stage = 1}),
                       doctest::Contains("Mode::Sharded only"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, cpus(2), {.shard_stage = 2}), doctest::Contains("mode DP"), dp::Error);
  // The module is untouched by the failed constructions and can still be wrapped.
  dp::DataParallel ok(net, cpus(2), {.mode = dp::Mode::Sharded});
  CHECK(ok.shard_stage() == 2);  // the default stage
}

namespace {

std::string scratch_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("dp_sharded_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

}  // namespace

TEST_CASE("state_dict and training checkpoints of a sharded run are full tensors and load into any mode") {
  const std::string path = scratch_file("ckpt.safetensors");
  auto net = make_mlp(8);
  std::vector<float> saved_params, saved_state;
  {
    dp::DataParallel model(net, cpus(3), sharded(2, {.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4}));
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    for (int s = 0; s < 3; ++s) {
      Batch b = make_batch(10, 7 + s);
      opt.zero_grad();
      model.forward_backward(b.x, b.y, loss_fn);
      opt.step();
    }
    // Full tensors under the module's names.
    auto sd = model.state_dict();
    auto ref = make_mlp(8)->state_dict();
    REQUIRE(sd.size() == ref.size());
    for (std::size_t i = 0; i < sd.size(); ++i) {
      CHECK(sd[i].first == ref[i].first);
      CHECK(sd[i].second.shape() == ref[i].second.shape());
    }
    auto osd = opt.state_dict();
    CHECK(osd.size() == 1 + 2 * sd.size());
    for (std::size_t i = 0; i < sd.size(); ++i)
      CHECK(osd[1 + 2 * i].second.shape() == sd[i].second.shape());
    saved_params = flat(sd);
    saved_state = flat(osd);
    dp::TrainingState st;
    st.step = 3;
    dp::save_training_checkpoint(path, *net, opt, st);
  }

  // Continue 3 more steps from the checkpoint in each mode; Sharded and DDP on the
  // same devices agree bit for bit, and everything agrees with one device.
  auto resume = [&](int n, dp::DataParallelOptions opts) {
    auto fresh = make_mlp(99);  // other values: everything comes from the file
    std::unique_ptr<dp::DataParallel> model;
    if (n > 0) model = std::make_unique<dp::DataParallel>(fresh, cpus(n), opts);
    dp::optim::Adam opt(model ? model->parameters() : fresh->parameters(), {.lr = 1e-2});
    dp::TrainingState st;
    dp::load_training_checkpoint(path, *fresh, opt, st);
    CHECK(st.step == 3);
    CHECK(flat(fresh->state_dict()) == saved_params);
    CHECK(flat(opt.state_dict()) == saved_state);
    for (int s = 3; s < 6; ++s) {
      Batch b = make_batch(10, 7 + s);
      opt.zero_grad();
      if (model) {
        model->forward_backward(b.x, b.y, loss_fn);
      } else {
        loss_fn(fresh->forward(b.x), b.y).backward();
      }
      opt.step();
    }
    return std::make_pair(flat(fresh->state_dict()), flat(opt.state_dict()));
  };
  const auto single = resume(0, {});
  const auto ddp3 = resume(3, {.mode = dp::Mode::DDP});
  const auto dp3 = resume(3, {.mode = dp::Mode::DP});
  const auto sh3 = resume(3, sharded(1));
  const auto sh2 = resume(2, sharded(2));
  const auto ddp2 = resume(2, {.mode = dp::Mode::DDP});
  CHECK(sh3.first == ddp3.first);
  CHECK(sh3.second == ddp3.second);
  CHECK(dp3.first == ddp3.first);
  CHECK(sh2.first == ddp2.first);
  CHECK(max_diff(sh3.first, single.first) < kTolerance);
  CHECK(max_diff(sh2.first, single.first) < kTolerance);
  std::filesystem::remove(path);
}

TEST_CASE("an optimizer built before wrapping hands each device its range of the state, and gets it back") {
  // Two steps on one device, four sharded, two on one device again: the same as DDP.
  auto run = [](dp::DataParallelOptions opts) {
    auto net = make_mlp(5);
    dp::optim::Adam opt(net->parameters(), {.lr = 1e-2});
    auto step = [&](auto&& fwd_bwd, int s) {
      Batch b = make_batch(9, 30 + s);
      opt.zero_grad();
      fwd_bwd(b);
      opt.step();
    };
    for (int s = 0; s < 2; ++s) step([&](const Batch& b) { loss_fn(net->forward(b.x), b.y).backward(); }, s);
    {
      dp::DataParallel model(net, cpus(4), opts);
      for (int s = 2; s < 4; ++s) step([&](const Batch& b) { model.forward_backward(b.x, b.y, loss_fn); }, s);
    }
    // Unwrapped: the primary's gradient is the full summed gradient again.
    auto set = net->parameters().set();
    auto grads = set->copy(0).grad.narrow(0, 0, set->numel()).to_vector();
    for (int s = 4; s < 6; ++s) step([&](const Batch& b) { loss_fn(net->forward(b.x), b.y).backward(); }, s);
    return std::make_tuple(flat(net->state_dict()), flat(opt.state_dict()), grads);
  };
  const auto ddp = run({.mode = dp::Mode::DDP});
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    const auto sh = run(sharded(stage));
    CHECK(std::get<0>(sh) == std::get<0>(ddp));
    CHECK(std::get<1>(sh) == std::get<1>(ddp));
    CHECK(std::get<2>(sh) == std::get<2>(ddp));
  }
}

TEST_CASE("gradient accumulation: no_sync, and backward twice without it, equal one big batch") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    Batch big = make_batch(16, 3);
    auto half_loss = [](const Tensor& o, const Tensor& y) { return dp::mul(loss_fn(o, y), 0.5); };
    auto run = [&](int how) {  // 0: one batch, 1: halves with no_sync, 2: halves both synced
      auto net = make_mlp(5);
      dp::DataParallel model(net, cpus(3), sharded(stage, {.bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4}));
      dp::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9});
      for (int s = 0; s < 2; ++s) {
        opt.zero_grad();
        if (how == 0) {
          model.forward_backward(big.x, big.y, loss_fn);
        } else {
          {
            std::optional<dp::DataParallel::NoSyncGuard> guard;
            if (how == 1) guard.emplace(model);
            model.forward_backward(big.x.narrow(0, 0, 8), big.y.narrow(0, 0, 8), half_loss);
          }
          model.forward_backward(big.x.narrow(0, 8, 8), big.y.narrow(0, 8, 8), half_loss);
        }
        opt.step();
      }
      return net->parameters().set()->copy(0).data.to_vector();
    };
    const auto one = run(0);
    CHECK(max_diff(run(1), one) < 1e-6);
    CHECK(max_diff(run(2), one) < 1e-6);
  }
}

TEST_CASE("stage 1 keeps each device's summed range in place; stage 2 keeps it apart and frees the rest") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = make_mlp(4), ref = make_mlp(4);
    dp::DataParallel model(net, cpus(4), sharded(stage));
    dp::DataParallel ddp(ref, cpus(4), {.mode = dp::Mode::DDP});
    Batch b = make_batch(13, 2);
    model.zero_grad();
    ddp.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    ddp.forward_backward(b.x, b.y, loss_fn);
    auto set = model.parameters().set();
    const auto full = ddp.parameters().set()->copy(0).grad.to_vector();
    for (int r = 0; r < 4; ++r) {
      const auto& c = set->copy(r);
      const auto s = dp::nn::copy_span(*set, r);
      const auto owned = s.owned_grad().to_vector();
      for (std::int64_t i = s.begin; i < std::min(s.end, set->numel()); ++i) CHECK(owned[i - s.begin] == full[i]);
      if (stage == 1) {
        // Zeros outside its own range: the sum over devices is the gradient.
        const auto g = c.grad.to_vector();
        for (std::int64_t i = 0; i < set->buffer_numel(); ++i)
          if (i < s.begin || i >= s.end) CHECK(g[i] == 0.0f);
      } else {
        CHECK_FALSE(c.grad.defined());
        for (const auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());
      }
    }
    model.zero_grad();  // works with released gradients too
    for (int r = 0; r < 4; ++r)
      for (float v : dp::nn::copy_span(*set, r).owned_grad().to_vector()) CHECK(v == 0.0f);
  }
}

TEST_CASE("a checked NaN in sharded mode names the parameter and the device") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = make_mlp(4);
    dp::DataParallel model(net, cpus(3), sharded(stage, {.check_finite_grads = true}));
    Batch b = make_batch(9, 1);
    // A NaN only in cpu:2's rows.
    std::vector<float> xs = b.x.to_vector();
    xs[8 * 6] = NAN;
    Tensor x = dp::from_vector(xs, b.x.shape(), dp::cpu(0));
    CHECK_THROWS_WITH_AS(model.forward_backward(x, b.y, loss_fn), doctest::Contains("cpu:2"), dp::Error);
    model.zero_grad();
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
    model.forward_backward(b.x, b.y, loss_fn);  // usable again
    opt.step();
  }
}

namespace {

// Throws in forward on one device, once, when armed.
struct Faulty : dp::nn::Module {
  Faulty() {
    dp::Generator gen(9);
    fc = register_module("fc", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    if (armed.load() && dp::nn::ReplicaBinding::current() == 2) {
      armed = false;
      throw dp::Error("injected failure");
    }
    return fc->forward(x);
  }
  std::atomic<bool> armed{false};
  std::shared_ptr<dp::nn::Linear> fc;
};

}  // namespace

TEST_CASE("a failure in a worker mid-step: the caller gets it, nothing hangs, the next step is correct") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = std::make_shared<Faulty>(), ref_net = std::make_shared<Faulty>();
    dp::DataParallel model(net, cpus(3), sharded(stage));
    dp::DataParallel ref(ref_net, cpus(3), sharded(stage));
    dp::optim::Adam opt(model.parameters(), {.lr = 0.1});
    dp::optim::Adam ref_opt(ref.parameters(), {.lr = 0.1});
    Batch b = make_batch(9, 11);
    net->armed = true;
    auto fut = std::async(std::launch::async, [&] {
      CHECK_THROWS_WITH_AS(model.forward_backward(b.x, b.y, loss_fn), doctest::Contains("cpu:2"), dp::Error);
    });
    REQUIRE(fut.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    fut.get();
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      ref_opt.zero_grad();
      model.forward_backward(b.x, b.y, loss_fn);
      ref.forward_backward(b.x, b.y, loss_fn);
      opt.step();
      ref_opt.step();
    }
    CHECK(dp::equal(model.parameters().set()->copy(0).data, ref.parameters().set()->copy(0).data));
    CHECK(flat(opt.state_dict()) == flat(ref_opt.state_dict()));
  }
}

TEST_CASE("a failed sharded optimizer step: device 0's parameters win, every copy continues from them") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = make_mlp(6);
    dp::DataParallel model(net, cpus(3), sharded(stage));
    FaultySgd opt(model.parameters());
    Batch b = make_batch(9, 11);
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    opt.armed = true;
    auto fut = std::async(std::launch::async, [&] {
      CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("cpu:1"), dp::Error);
    });
    REQUIRE(fut.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
    fut.get();
    // A reference continues from device 0's parameters as they are now.
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
    for (int r = 1; r < 3; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  }
}
