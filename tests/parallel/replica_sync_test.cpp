// DDP replicas never drift silently: gradient clipping and hand edits through
// model.parameters() reach every replica, a step inside no_sync() is refused, and
// check_replicas() names what differs (Note [Gradient edits]).
#include <doctest/doctest.h>

#include <cmath>
#include <functional>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;

std::shared_ptr<dp::nn::Sequential> make_mlp() {
  dp::Generator gen(42);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(16, 3, true, &gen));
  return net;
}

Batch make_scaled_batch(std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  Tensor x = dp::randn({rows, 6}, gen, dp::cpu(0));
  std::vector<std::int64_t> labels(rows);
  for (std::int64_t i = 0; i < rows; ++i) labels[i] = (i * 5 + static_cast<std::int64_t>(seed)) % 3;
  return {mul(x, 3.0), dp::from_vector(labels, {rows}, dp::cpu(0))};
}

// Every replica's flat parameter buffer equals device 0's, bit for bit.
void check_replicas_equal(dp::DataParallel& model) {
  auto& set = *model.parameters().set();
  for (int r = 1; r < set.num_copies(); ++r)
    CHECK(dp::equal(set.copy(r).data.to(dp::cpu(0)), set.copy(0).data));
}

using Edit = std::function<void(dp::nn::ParameterList)>;

// Trains 5 SGD-momentum steps of `mode` on n devices with `edit` between backward and
// step; returns device 0's parameters.
Tensor train(dp::Mode mode, int n, const Edit& edit, bool check_each_step = true, double weight_decay = 0.0) {
  auto net = make_mlp();
  dp::DataParallel model(net, cpus(n), {.mode = mode});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = weight_decay});
  for (int s = 0; s < 5; ++s) {
    Batch b = make_scaled_batch(10, 7 + s);
    opt.zero_grad();
    loss_fn(model(b.x), b.y).backward();
    edit(model.parameters());
    opt.step();
    if (check_each_step && mode == dp::Mode::DDP) check_replicas_equal(model);
  }
  return model.parameters().set()->copy(0).data.clone();
}

}  // namespace

TEST_CASE("clip_grad_norm_ clips every replica with one factor: DDP == DP, bitwise") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    Edit clip = [](dp::nn::ParameterList p) { dp::nn::utils::clip_grad_norm_(p, 0.05); };
    Tensor ddp = train(dp::Mode::DDP, n, clip);
    Tensor dp_ = train(dp::Mode::DP, n, clip);
    CHECK(dp::equal(ddp, dp_));
    // The clip did something: without it the parameters differ.
    CHECK_FALSE(dp::equal(ddp, train(dp::Mode::DDP, n, [](dp::nn::ParameterList) {})));
  }
}

TEST_CASE("clip_grad_value_ clips every replica") {
  for (int n : {2, 4}) {
    Edit clip = [](dp::nn::ParameterList p) { dp::nn::utils::clip_grad_value_(p, 0.01); };
    CHECK(dp::equal(train(dp::Mode::DDP, n, clip), train(dp::Mode::DP, n, clip)));
  }
}

TEST_CASE("hand edits of .grad through model.parameters() reach every replica") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    SUBCASE("scale one layer") {
      Edit e = [](dp::nn::ParameterList p) { p[0].grad().mul_(0.25f); };
      CHECK(dp::equal(train(dp::Mode::DDP, n, e), train(dp::Mode::DP, n, e)));
    }
    SUBCASE("zero the last layer's bias") {
      Edit e = [](dp::nn::ParameterList p) { p[3].grad().zero_(); };
      CHECK(dp::equal(train(dp::Mode::DDP, n, e), train(dp::Mode::DP, n, e)));
    }
    SUBCASE("clip by hand, as a script written for one device would") {
      Edit e = [](dp::nn::ParameterList p) {
        for (const Tensor& t : p) {
          Tensor g = t.grad();
          g.copy_(dp::mul(g, 0.5));
        }
      };
      CHECK(dp::equal(train(dp::Mode::DDP, n, e), train(dp::Mode::DP, n, e)));
    }
  }
}

TEST_CASE("parameters edited or loaded between backward and step: every replica steps from device 0's") {
  // Weight decay puts the parameters into SGD's momentum buffer. A replica that stepped
  // from its old parameters kept a buffer of its own, and the replicas drifted apart
  // from then on (the forward after refreshed the parameters, not the buffers).
  const Edit halve = [](dp::nn::ParameterList p) {
    dp::NoGradGuard no_grad;
    for (Tensor t : p) t.mul_(0.5f);
  };
  for (int n : {2, 4}) {
    CAPTURE(n);
    CHECK(dp::equal(train(dp::Mode::DDP, n, halve, true, 0.1), train(dp::Mode::DP, n, halve, true, 0.1)));
  }
  // The same through load_state_dict; check_replicas() between the load and the step
  // does not take the replicas waiting for device 0's parameters for a fault.
  auto run = [](dp::Mode mode) {
    auto net = make_mlp();
    dp::DataParallel model(net, cpus(3), {.mode = mode});
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.1});
    for (int s = 0; s < 4; ++s) {
      Batch b = make_scaled_batch(9, 11 + s);
      opt.zero_grad();
      loss_fn(model(b.x), b.y).backward();
      if (s == 1) {
        dp::nn::StateDict halved;
        for (const auto& [name, t] : model.state_dict()) halved.emplace_back(name, dp::mul(t, 0.5));
        model.load_state_dict(halved);
        model.check_replicas();
      }
      opt.step();
      model.check_replicas();
    }
    return model.parameters().set()->copy(0).data.clone();
  };
  CHECK(dp::equal(run(dp::Mode::DDP), run(dp::Mode::DP)));
}

TEST_CASE("an unedited DDP step broadcasts no gradient") {
  auto net = make_mlp();
  dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::DDP});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  Batch b = make_scaled_batch(8, 3);
  auto& set = *model.parameters().set();
  opt.zero_grad();
  loss_fn(model(b.x), b.y).backward();
  // Poison the replica's gradient without a version bump (a raw write): an edit
  // detector that broadcast anyway would repair it and hide the poison.
  set.copy(1).grad.data<float>()[0] += 1.0f;
  opt.step();
  CHECK_THROWS_WITH_AS(model.check_replicas(), doctest::Contains("on cpu:1"), dp::Error);
}

TEST_CASE("opt.step() inside a DDP no_sync guard is refused and changes nothing") {
  auto net = make_mlp();
  dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::DDP});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  Batch b = make_scaled_batch(8, 3);
  opt.zero_grad();
  Tensor before = model.parameters().set()->copy(0).data.clone();
  {
    auto guard = model.no_sync();
    loss_fn(model(b.x), b.y).backward();
    CHECK_THROWS_WITH_AS(opt.step(), doctest::Contains("no_sync"), dp::Error);
    opt.zero_grad();  // zeroing inside the guard is fine
  }
  CHECK(dp::equal(model.parameters().set()->copy(0).data, before));
  check_replicas_equal(model);
  // After the guard the usual loop works again.
  loss_fn(model(b.x), b.y).backward();
  opt.step();
  check_replicas_equal(model);
  // DP keeps no replicas to diverge: a step inside no_sync is allowed there.
  auto net2 = make_mlp();
  dp::DataParallel dp_model(net2, cpus(2));
  dp::optim::SGD opt2(dp_model.parameters(), {.lr = 0.1});
  auto guard = dp_model.no_sync();
  loss_fn(dp_model(b.x), b.y).backward();
  CHECK_NOTHROW(opt2.step());
}

TEST_CASE("check_replicas names the first parameter and device that differ") {
  auto net = make_mlp();
  dp::DataParallel model(net, cpus(3), {.mode = dp::Mode::DDP});
  CHECK_NOTHROW(model.check_replicas());
  auto& set = *model.parameters().set();
  // Parameter "2.bias" (the last one) of the replica on cpu:2, written behind dp's back.
  std::int64_t last = set.numel() - 1;
  set.copy(2).data.data<float>()[last] += 1e-3f;
  CHECK_THROWS_WITH_AS(model.check_replicas(), doctest::Contains("'2.bias'"), dp::Error);
  CHECK_THROWS_WITH_AS(model.check_replicas(), doctest::Contains("on cpu:2"), dp::Error);
}

TEST_CASE("check_replicas_every checks after every N optimizer steps") {
  auto net = make_mlp();
  dp::DataParallel model(net, cpus(2), {.mode = dp::Mode::DDP, .check_replicas_every = 2});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  Batch b = make_scaled_batch(8, 3);
  auto step = [&] {
    opt.zero_grad();
    loss_fn(model(b.x), b.y).backward();
    opt.step();
  };
  step();
  step();  // checked: equal
  step();
  model.parameters().set()->copy(1).data.data<float>()[0] += 1.0f;  // raw write: no resync
  CHECK_THROWS_WITH_AS(step(), doctest::Contains("'0.weight'"), dp::Error);
  CHECK_THROWS_AS(dp::DataParallel(make_mlp(), cpus(2), {.check_replicas_every = -1}), dp::Error);
  CHECK_THROWS_WITH_AS(dp::DataParallel(make_mlp(), cpus(2), {.collective_timeout = std::chrono::milliseconds(-5)}),
                       doctest::Contains("expected a positive collective_timeout, got -5 ms"), dp::Error);
}

TEST_CASE("clip_grad_norm_ follows PyTorch's formula and rejects bad arguments") {
  auto net = make_mlp();
  auto params = net->parameters();
  Batch b = make_scaled_batch(10, 1);
  loss_fn(net->forward(b.x), b.y).backward();
  for (double p : {1.0, 2.0, 3.0, dp::nn::utils::kInfNorm}) {
    CAPTURE(p);
    // Expected: the p-norm of the per-parameter p-norms, in double.
    std::vector<double> norms;
    for (const Tensor& t : params) {
      double acc = 0;
      for (float v : t.grad().to_vector())
        acc = std::isinf(p) ? std::max(acc, std::fabs(static_cast<double>(v))) : acc + std::pow(std::fabs(v), p);
      norms.push_back(std::isinf(p) ? acc : std::pow(acc, 1.0 / p));
    }
    double total = 0;
    for (double n : norms) total = std::isinf(p) ? std::max(total, n) : total + std::pow(n, p);
    if (!std::isinf(p)) total = std::pow(total, 1.0 / p);
    auto before = params[0].grad().to_vector();
    CHECK(dp::nn::utils::clip_grad_norm_(params, 1e9, p) == doctest::Approx(total).epsilon(1e-5));
    CHECK(params[0].grad().to_vector() == before);
  }
  double total = dp::nn::utils::clip_grad_norm_(params, 0.5);
  REQUIRE(total > 0.5);
  CHECK(dp::nn::utils::clip_grad_norm_(params, 1e9) == doctest::Approx(0.5).epsilon(1e-5));
  CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(params, -1.0), doctest::Contains("max_norm >= 0"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(params, 1.0, 0.0), doctest::Contains("norm_type > 0"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_value_(params, -0.1), doctest::Contains("clip_value >= 0"),
                       dp::Error);
  params[1].grad().fill_(std::nan(""));
  CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(params, 1.0, 2.0, true), doctest::Contains("NaN/Inf"),
                       dp::Error);
  dp::nn::utils::clip_grad_value_(params, 0.01);
  for (float v : params[0].grad().to_vector()) CHECK(std::fabs(v) <= 0.01f);
}

TEST_CASE("two synced backward passes without zero_grad accumulate as DP does (bitwise)") {
  // Gradient accumulation without no_sync: each backward all-reduces, and the second
  // must not sum the first's sum once per device.
  for (int n : {2, 3}) {
    CAPTURE(n);
    auto run = [&](dp::Mode mode, bool no_sync_between) {
      auto net = make_mlp();
      dp::DataParallel model(net, cpus(n), {.mode = mode});
      dp::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9});
      for (int s = 0; s < 3; ++s) {
        opt.zero_grad();
        Batch a = make_scaled_batch(9, 11 + s), b = make_scaled_batch(9, 21 + s), c = make_scaled_batch(9, 31 + s);
        loss_fn(model(a.x), a.y).backward();
        if (no_sync_between) {
          auto guard = model.no_sync();
          loss_fn(model(b.x), b.y).backward();
        } else {
          loss_fn(model(b.x), b.y).backward();
        }
        model.forward_backward(c.x, c.y, loss_fn);
        opt.step();
      }
      if (mode == dp::Mode::DDP) check_replicas_equal(model);
      return model.parameters().set()->copy(0).data.clone();
    };
    Tensor dp_ = run(dp::Mode::DP, false);
    CHECK(dp::equal(run(dp::Mode::DDP, false), dp_));
    // With a no_sync backward in between, DDP sums in another order than DP: equal
    // to float tolerance, and the replicas bitwise equal.
    Tensor mixed = run(dp::Mode::DDP, true);
    auto a = mixed.to_vector(), b = dp_.to_vector();
    for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-5));
  }
}
