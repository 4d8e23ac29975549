// Gradient clipping (dp/nn/utils.h) in every design: Sharded stages 1 and 2 clip the
// range of the reduced gradient each device owns and compute the same total norm as
// DDP, bit for bit, so the parameters after several Adam steps are the same bits
// (Note [Clipping in blocks]; stage 3 in tests/parallel/sharded_clip_test.cpp); bad
// arguments are refused.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "dp/dp.h"

namespace {

using dp::Tensor;
using dp::nn::utils::kInfNorm;

// 10-33-7: 601 parameters, so that shards of 2, 3 and 4 devices cut parameters and
// blocks of 16 at different places, and the buffers get padding.
std::shared_ptr<dp::nn::Sequential> make_mlp() {
  dp::Generator gen(5);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(10, 33, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(33, 7, true, &gen));
  return net;
}

struct Batch {
  Tensor x, y;
};

Batch make_batch(std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  Tensor x = dp::randn({rows, 10}, gen, dp::cpu(0));
  std::vector<std::int64_t> labels(rows);
  for (std::int64_t i = 0; i < rows; ++i) labels[i] = (i * 3 + static_cast<std::int64_t>(seed)) % 7;
  return {dp::mul(x, 4.0), dp::from_vector(labels, {rows}, dp::cpu(0))};
}

std::vector<dp::Device> cpus(int n) {
  std::vector<dp::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(dp::cpu(i));
  return d;
}

// What runs between backward and step; returns a total norm (0 when none).
using Clip = std::function<double(const dp::nn::ParameterList&)>;

struct Run {
  Tensor params;              // device 0's parameters after the last step
  std::vector<double> norms;  // what the clip returned, per step
};

// Trains 4 Adam steps on n devices (batch 13: uneven shards) with `clip` between
// backward and step.
Run train(dp::DataParallelOptions options, int n, const Clip& clip) {
  auto net = make_mlp();
  dp::DataParallel model(net, cpus(n), options);
  dp::optim::Adam opt(model.parameters(), {.lr = 0.05});
  Run run;
  for (int s = 0; s < 4; ++s) {
    Batch b = make_batch(13, 11 + s);
    opt.zero_grad();
    dp::nn::cross_entropy(model(b.x), b.y).backward();
    run.norms.push_back(clip(model.parameters()));
    opt.step();
  }
  auto& set = *model.parameters().set();
  run.params = set.copy(0).data.narrow(0, 0, set.numel()).clone();
  return run;
}

dp::DataParallelOptions ddp() { return {.mode = dp::Mode::DDP}; }
dp::DataParallelOptions sharded(int stage) { return {.mode = dp::Mode::Sharded, .shard_stage = stage}; }

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) return false;
  return true;
}

}  // namespace

TEST_CASE("clip_grad_norm_ in Sharded stages 1 and 2 gives DDP's norms and parameters, bitwise") {
  for (double p : {2.0, 1.0, kInfNorm, 3.0}) {
    // A max_norm below every step's norm, so that every step clips.
    const double max_norm = std::isinf(p) ? 0.02 : 0.2;
    Clip clip = [&](const dp::nn::ParameterList& ps) { return dp::nn::utils::clip_grad_norm_(ps, max_norm, p); };
    for (int n : {2, 3, 4}) {
      CAPTURE(p);
      CAPTURE(n);
      Run want = train(ddp(), n, clip);
      for (double norm : want.norms) CHECK(norm > max_norm);
      // The clip changes the result: without it DDP trains to other parameters.
      CHECK_FALSE(dp::equal(want.params, train(ddp(), n, [](const dp::nn::ParameterList&) { return 0.0; }).params));
      for (int stage : {1, 2}) {
        CAPTURE(stage);
        Run got = train(sharded(stage), n, clip);
        CHECK(same_bits(got.norms, want.norms));
        CHECK(dp::equal(got.params, want.params));
      }
    }
  }
}

TEST_CASE("clip_grad_norm_ over part of the parameters: ranges that shards and blocks cut") {
  // The first layer's bias (offset 330, 33 elements) and the last layer's weight
  // (offset 363, 231 elements): neither starts on a 16-element block, and shard
  // boundaries (at multiples of 16) fall inside them for 2, 3 and 4 devices.
  Clip clip = [](const dp::nn::ParameterList& ps) {
    std::vector<Tensor> tensors{ps[1], ps[2]};
    std::vector<std::shared_ptr<dp::nn::Parameter::Slot>> slots{ps.slots()[1], ps.slots()[2]};
    return dp::nn::utils::clip_grad_norm_(dp::nn::ParameterList(tensors, slots, ps.set()), 0.1);
  };
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Run want = train(ddp(), n, clip);
    for (double norm : want.norms) CHECK(norm > 0.1);
    for (int stage : {1, 2}) {
      CAPTURE(stage);
      Run got = train(sharded(stage), n, clip);
      CHECK(same_bits(got.norms, want.norms));
      CHECK(dp::equal(got.params, want.params));
    }
  }
}

TEST_CASE("clip_grad_norm_ returns the norm of the whole gradient, summed in double as a reference") {
  // Reference: the full summed gradient that DDP's device 0 holds after backward.
  for (double p : {2.0, 1.0, kInfNorm, 3.0}) {
    CAPTURE(p);
    auto net = make_mlp();
    dp::DataParallel model(net, cpus(3), ddp());
    Batch b = make_batch(13, 2);
    dp::nn::cross_entropy(model(b.x), b.y).backward();
    auto& set = *model.parameters().set();
    double acc = 0;
    for (float v : set.copy(0).grad.narrow(0, 0, set.numel()).to_vector())
      acc = std::isinf(p) ? std::max(acc, std::fabs(static_cast<double>(v))) : acc + std::pow(std::fabs(v), p);
    const double want = std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
    CHECK(want > 0);
    // Nothing is clipped (max_norm above the norm): only the measurement is checked.
    CHECK(dp::nn::utils::clip_grad_norm_(model.parameters(), 1e9, p) == doctest::Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("clip_grad_value_ in Sharded stages 1 and 2 gives DDP's parameters, bitwise") {
  Clip clip = [](const dp::nn::ParameterList& ps) {
    dp::nn::utils::clip_grad_value_(ps, 0.01);
    return 0.0;
  };
  Clip none = [](const dp::nn::ParameterList&) { return 0.0; };
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Tensor want = train(ddp(), n, clip).params;
    CHECK_FALSE(dp::equal(want, train(ddp(), n, none).params));
    for (int stage : {1, 2}) {
      CAPTURE(stage);
      CHECK(dp::equal(train(sharded(stage), n, clip).params, want));
    }
  }
}

TEST_CASE("clip_grad_value_ clamps each device's owned range of the reduced gradient") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = make_mlp();
    dp::DataParallel model(net, cpus(3), sharded(stage));
    Batch b = make_batch(13, 4);
    dp::nn::cross_entropy(model(b.x), b.y).backward();
    auto& set = *model.parameters().set();
    std::vector<std::vector<float>> before;
    for (int r = 0; r < set.num_copies(); ++r) before.push_back(dp::nn::copy_span(set, r).owned_grad().to_vector());
    const float c = 0.003f;
    dp::nn::utils::clip_grad_value_(model.parameters(), c);
    int clamped = 0;
    for (int r = 0; r < set.num_copies(); ++r) {
      auto after = dp::nn::copy_span(set, r).owned_grad().to_vector();
      REQUIRE(after.size() == before[r].size());
      for (std::size_t i = 0; i < after.size(); ++i) {
        const float want = std::min(c, std::max(-c, before[r][i]));
        if (want != before[r][i]) ++clamped;
        CHECK(after[i] == want);
      }
    }
    CHECK(clamped > 0);
  }
}

TEST_CASE("gradient clipping rejects bad arguments, in every design") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (auto options : {dp::DataParallelOptions{}, ddp(), sharded(1), sharded(2), sharded(3)}) {
    auto net = make_mlp();
    dp::DataParallel model(net, cpus(2), options);
    Batch b = make_batch(6, 1);
    dp::nn::cross_entropy(model(b.x), b.y).backward();
    auto ps = model.parameters();
    CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(ps, -1.0), doctest::Contains("expected max_norm >= 0"),
                         dp::Error);
    CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(ps, nan), doctest::Contains("got nan"), dp::Error);
    for (double p : {0.0, -2.0, nan})
      CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(ps, 1.0, p), doctest::Contains("expected norm_type > 0"),
                           dp::Error);
    CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_value_(ps, -0.5), doctest::Contains("expected clip_value >= 0"),
                         dp::Error);
    CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_value_(ps, nan), doctest::Contains("expected clip_value >= 0"),
                         dp::Error);
    // max_norm = infinity measures without clipping.
    auto before = dp::nn::copy_span(*ps.set(), 0).owned_grad().to_vector();
    CHECK(dp::nn::utils::clip_grad_norm_(ps, std::numeric_limits<double>::infinity()) > 0);
    CHECK(dp::nn::copy_span(*ps.set(), 0).owned_grad().to_vector() == before);
  }
}

TEST_CASE("clip_grad_norm_ with error_if_nonfinite names a NaN gradient held by any device of a sharded set") {
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto net = make_mlp();
    dp::DataParallel model(net, cpus(3), sharded(stage));
    Batch b = make_batch(13, 4);
    dp::nn::cross_entropy(model(b.x), b.y).backward();
    auto& set = *model.parameters().set();
    // A NaN in the last device's range only: a norm over copy 0 would miss it.
    Tensor owned = dp::nn::copy_span(set, 2).owned_grad();
    owned.narrow(0, 0, 1).fill_(std::numeric_limits<float>::quiet_NaN());
    CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(model.parameters(), 1.0, 2.0, true),
                         doctest::Contains("total norm of the gradients is nan"), dp::Error);
    CHECK(std::isnan(dp::nn::utils::clip_grad_norm_(model.parameters(), 1.0)));
  }
}

TEST_CASE("clip_grad_norm_ of a NaN total makes every gradient NaN, as PyTorch's, in every design") {
  // PyTorch multiplies every gradient by clamp(max_norm / (total + 1e-6), max=1): NaN for
  // a NaN total, with max_norm = infinity too. An infinite total (no NaN) gives a factor
  // of 0: finite gradients become zeros, an infinite one NaN. The bad element goes where
  // a reduced gradient holds it: one owner's range when sharded, every replica else. A
  // sharded copy's range may hold padding between parameters, zeros no clip touches.
  for (auto options : {dp::DataParallelOptions{}, ddp(), sharded(1), sharded(2), sharded(3)}) {
    CAPTURE(static_cast<int>(options.mode));
    const bool shards = options.mode == dp::Mode::Sharded;
    auto run = [&](float bad, double max_norm) {
      auto net = make_mlp();
      auto model = std::make_unique<dp::DataParallel>(net, cpus(3), options);
      Batch b = make_batch(13, 4);
      dp::nn::cross_entropy((*model)(b.x), b.y).backward();
      auto& set = *model->parameters().set();
      std::size_t zeros = 0;
      for (int r = 0; r < set.num_copies(); ++r)
        if (!set.copy(r).transient)
          for (float x : dp::nn::copy_span(set, r).owned_grad().to_vector()) zeros += x == 0.0f ? 1 : 0;
      for (int r = 0; r < set.num_copies(); ++r)
        if (!set.copy(r).transient && (!shards || r == set.num_copies() - 1))
          dp::nn::copy_span(set, r).owned_grad().narrow(0, 0, 1).fill_(bad);
      const double total = dp::nn::utils::clip_grad_norm_(model->parameters(), max_norm);
      std::vector<std::vector<float>> grads;
      for (int r = 0; r < set.num_copies(); ++r)
        if (!set.copy(r).transient) grads.push_back(dp::nn::copy_span(set, r).owned_grad().to_vector());
      return std::tuple{total, grads, zeros};
    };
    for (const double max_norm : {1.0, std::numeric_limits<double>::infinity()}) {
      CAPTURE(max_norm);
      const auto [total, grads, zeros] = run(std::numeric_limits<float>::quiet_NaN(), max_norm);
      CHECK(std::isnan(total));
      std::size_t kept = 0, all = 0;
      for (const auto& g : grads)
        for (float x : g) {
          ++all;
          if (!std::isnan(x)) REQUIRE(x == 0.0f);
          kept += std::isnan(x) ? 0 : 1;
        }
      CHECK(kept <= zeros);
      CHECK(kept < all / 10);
    }
    const auto [total, grads, zeros] = run(std::numeric_limits<float>::infinity(), 1.0);
    CHECK(std::isinf(total));
    int nans = 0;
    for (const auto& g : grads)
      for (float x : g) {
        nans += std::isnan(x) ? 1 : 0;
        REQUIRE((std::isnan(x) || x == 0.0f));
      }
    CHECK(nans == (shards ? 1 : static_cast<int>(grads.size())));
  }
}

TEST_CASE("clipping and unscaling leave the gradients PyTorch would hold None for: frozen and unreached ones") {
  // Note [Gradients PyTorch would not see]. The first Linear frozen; a NaN in the second
  // Linear's weight gradient; unscale finds it, clip_grad_norm_ of the NaN total makes
  // the trainable gradients NaN and must leave the frozen ones zeros; new gradients for
  // the trainable parameters (no zero_grad) then scan clean, as PyTorch's unscale_ over
  // the parameters with a .grad does. The same for a parameter no backward reached.
  for (const int devices : {0, 2}) {
    for (const bool unreached : {false, true}) {
      CAPTURE(devices);
      CAPTURE(unreached);
      auto net = make_mlp();
      std::unique_ptr<dp::DataParallel> model;
      if (devices > 0) model = std::make_unique<dp::DataParallel>(net, cpus(devices), ddp());
      auto ps = devices > 0 ? model->parameters() : net->parameters();
      auto forward = [&](const Tensor& x) { return devices > 0 ? (*model)(x) : net->forward(x); };
      Batch b = make_batch(8, 3);
      if (unreached) {
        // zero_grad(true) after a backward, then gradients for the second Linear only:
        // no gradient reached the first since (PyTorch: its .grad is None).
        dp::nn::cross_entropy(forward(b.x), b.y).backward();
        dp::optim::SGD(ps, {.lr = 0.1}).zero_grad();
        for (std::size_t i = 2; i < 4; ++i) ps[i].set_grad(dp::ones(ps[i].shape(), ps[i].device()));
      } else {
        ps[0].set_requires_grad(false);
        ps[1].set_requires_grad(false);
        dp::nn::cross_entropy(forward(b.x), b.y).backward();
      }
      std::vector<float> w = ps[2].grad().to_vector();
      w[5] = std::numeric_limits<float>::quiet_NaN();
      ps[2].set_grad(dp::from_vector(w, ps[2].shape(), ps[2].device()));
      CHECK(dp::nn::utils::scale_grads_find_nonfinite_(ps, 0.5));
      CHECK(std::isnan(dp::nn::utils::clip_grad_norm_(ps, 1.0)));
      for (std::size_t i = 0; i < 2; ++i)
        for (float g : ps[i].grad().to_vector()) REQUIRE(g == 0.0f);
      for (float g : ps[3].grad().to_vector()) REQUIRE(std::isnan(g));
      for (std::size_t i = 2; i < 4; ++i) ps[i].set_grad(dp::ones(ps[i].shape(), ps[i].device()));
      CHECK_FALSE(dp::nn::utils::scale_grads_find_nonfinite_(ps, 0.5));
    }
  }
}
