// Gradient clipping in Sharded mode, ZeRO stage 3 (sharded parameters): each device
// holds only its range of the parameters and of the reduced gradient between
// backward and step, and clip_grad_norm_ / clip_grad_value_ work on exactly that
// range. The returned total norm and the parameters after 10 Adam steps are DDP's,
// bit for bit, on 2, 3 and 4 devices with uneven shards (Note [Clipping in blocks]).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"
#include "parallel/shard_store.h"

namespace {

using dp::Tensor;
using dp::nn::utils::kInfNorm;

dp::DataParallelOptions ddp() { return {.mode = dp::Mode::DDP}; }
dp::DataParallelOptions stage3() { return {.mode = dp::Mode::Sharded, .shard_stage = 3}; }

// What runs between backward and step; returns a total norm (0 when none).
using Clip = std::function<double(const dp::nn::ParameterList&)>;

enum class Path { Module, WorkerLoss };

struct Run {
  std::vector<float> params;  // every parameter after the last step, flat
  std::vector<double> norms;  // what the clip returned, per step
};

// 10 Adam steps of the shared 6-16-8-3 MLP on n devices with `clip` between backward
// and step. 11 rows: uneven shards on 2, 3 and 4 devices (6+5, 4+4+3, 3+3+3+2). The
// clip gets model.parameters() each step (which in stage 3 gathers device 0's copy),
// or with `held` the list taken once before the loop (which gathers nothing).
Run train(dp::DataParallelOptions options, int n, Path path, const Clip& clip, bool held = false) {
  auto net = make_mlp(7);
  dp::DataParallel model(net, cpus(n), options);
  const dp::nn::ParameterList params = model.parameters();
  dp::optim::Adam opt(params, {.lr = 0.02});
  Run run;
  for (int s = 0; s < 10; ++s) {
    Batch b = make_batch(11, 30 + static_cast<std::uint64_t>(s));
    b.x = dp::mul(b.x, 3.0);  // larger gradients: every step's norm is well above max_norm
    opt.zero_grad();
    if (path == Path::Module) {
      loss_fn(model(b.x), b.y).backward();
    } else {
      model.forward_backward(b.x, b.y, loss_fn);
    }
    run.norms.push_back(clip(held ? params : model.parameters()));
    opt.step();
  }
  for (auto& [name, t] : net->state_dict()) {
    auto v = t.to_vector();
    run.params.insert(run.params.end(), v.begin(), v.end());
  }
  return run;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) return false;
  return true;
}

const Clip kNone = [](const dp::nn::ParameterList&) { return 0.0; };

}  // namespace

TEST_CASE("stage 3 clip_grad_norm_: DDP's total norms and parameters, bitwise, on 2-4 devices") {
  for (double p : {2.0, 1.0, kInfNorm, 3.0}) {
    // Below the gradients' norms, so that clipping really happens.
    const double max_norm = std::isinf(p) ? 0.05 : 0.3;
    Clip clip = [&](const dp::nn::ParameterList& ps) { return dp::nn::utils::clip_grad_norm_(ps, max_norm, p); };
    for (int n : {2, 3, 4}) {
      for (Path path : {Path::Module, Path::WorkerLoss}) {
        CAPTURE(p);
        CAPTURE(n);
        CAPTURE(static_cast<int>(path));
        const Run want = train(ddp(), n, path, clip);
        int clipped = 0;
        for (double norm : want.norms) clipped += norm > max_norm ? 1 : 0;
        CHECK(clipped > 0);  // clipping really happens
        // The clip matters: without it the parameters differ.
        CHECK(train(ddp(), n, path, kNone).params != want.params);
        const Run got = train(stage3(), n, path, clip);
        CHECK(same_bits(got.norms, want.norms));
        CHECK(got.params == want.params);
        const Run kept = train(stage3(), n, path, clip, /*held=*/true);
        CHECK(same_bits(kept.norms, want.norms));
        CHECK(kept.params == want.params);
      }
    }
  }
}

TEST_CASE("stage 3 clip_grad_value_: DDP's parameters, bitwise, on 2-4 devices") {
  Clip clip = [](const dp::nn::ParameterList& ps) {
    dp::nn::utils::clip_grad_value_(ps, 0.01);
    return 0.0;
  };
  for (int n : {2, 3, 4}) {
    for (Path path : {Path::Module, Path::WorkerLoss}) {
      CAPTURE(n);
      CAPTURE(static_cast<int>(path));
      const Run want = train(ddp(), n, path, clip);
      CHECK(train(ddp(), n, path, kNone).params != want.params);
      CHECK(train(stage3(), n, path, clip).params == want.params);
    }
  }
}

TEST_CASE("stage 3 clipping over part of the parameters: ranges cut by shards and blocks") {
  // The middle layer's weight ([112, 240)) and the last layer's weight ([248, 272)):
  // two runs with a gap between them; the shard boundaries (144 on 2 devices; 96 and
  // 192 on 3; 80, 160 and 240 on 4) cut the first, and the second starts inside a
  // 16-element block.
  Clip clip = [](const dp::nn::ParameterList& ps) {
    std::vector<Tensor> tensors{ps[2], ps[4]};
    std::vector<std::shared_ptr<dp::nn::Parameter::Slot>> slots{ps.slots()[2], ps.slots()[4]};
    return dp::nn::utils::clip_grad_norm_(dp::nn::ParameterList(tensors, slots, ps.set()), 0.05);
  };
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const Run want = train(ddp(), n, Path::Module, clip);
    for (double norm : want.norms) CHECK(norm > 0.05);
    const Run got = train(stage3(), n, Path::Module, clip);
    CHECK(same_bits(got.norms, want.norms));
    CHECK(got.params == want.params);
  }
}

TEST_CASE("stage 3 clipping edits each device's own range of the reduced gradient and gathers nothing") {
  auto net = make_mlp(3);
  dp::DataParallel model(net, cpus(3), stage3());
  const dp::nn::ParameterList params = model.parameters();
  auto set = params.set();
  Batch b = make_batch(11, 4);
  b.x = dp::mul(b.x, 3.0);
  loss_fn(model(b.x), b.y).backward();
  std::vector<std::vector<float>> before;
  for (int r = 0; r < 3; ++r) {
    REQUIRE_FALSE(set->copy(r).grad.defined());  // stage 3 keeps only the range gradient
    before.push_back(dp::nn::copy_span(*set, r).owned_grad().to_vector());
  }
  const float c = 0.004f;
  dp::nn::utils::clip_grad_value_(params, c);
  CHECK(dp::nn::utils::clip_grad_norm_(params, 1e9) > 0);
  int clamped = 0;
  for (int r = 0; r < 3; ++r) {
    auto after = dp::nn::copy_span(*set, r).owned_grad().to_vector();
    REQUIRE(after.size() == before[static_cast<std::size_t>(r)].size());
    for (std::size_t i = 0; i < after.size(); ++i) {
      const float want = std::min(c, std::max(-c, before[static_cast<std::size_t>(r)][i]));
      clamped += want != before[static_cast<std::size_t>(r)][i] ? 1 : 0;
      CHECK(after[i] == want);
    }
    // The clips read no parameter: no device, device 0 included, gathered a unit.
    const auto* store = dp::parallel::ShardStore::of(*set);
    for (int u = 0; u < static_cast<int>(store->units().size()); ++u) CHECK_FALSE(store->unit_gathered(r, u));
  }
  CHECK(clamped > 0);
  // A NaN held by the last device only: the norm sees it, and error_if_nonfinite names it.
  dp::nn::copy_span(*set, 2).owned_grad().narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
  CHECK(std::isnan(dp::nn::utils::clip_grad_norm_(net->parameters(), 1.0)));
  CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(net->parameters(), 1.0, 2.0, true),
                       doctest::Contains("total norm of the gradients is nan"), dp::Error);
}
