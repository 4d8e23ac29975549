// DataParallel with a module of several inputs: model(x, mask) and
// forward_backward({x, mask}, y, loss) split every batched input with the same rows,
// replicate 0-d and dp::replicated inputs, and give the unwrapped module's outputs,
// losses, parameters and input gradients (forward_backward's too) in DP, DDP and Sharded
// modes on 1-4 devices (the three modes bitwise alike); bad inputs are clear errors.
#include <doctest/doctest.h>

#include <cmath>
#include <string>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;

// out = fc2(relu(fc1(x * mask) * scale)); mask (N, 6) per sample, scale (8) shared
// (or 0-d), optional.
struct MaskedNet : dp::nn::Module {
  explicit MaskedNet(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 8, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(8, 3, true, &gen));
  }
  using Module::forward;
  Tensor forward(const std::vector<Tensor>& in) override {
    DP_CHECK(in.size() == 2 || in.size() == 3, "MaskedNet: expected (x, mask[, scale]), got ", in.size());
    DP_CHECK(in[0].size(0) == in[1].size(0), "MaskedNet: x and mask rows differ");
    Tensor h = fc1->forward(dp::mul(in[0], in[1]));
    if (in.size() == 3) h = dp::mul(h, in[2]);
    return fc2->forward(dp::relu(h));
  }
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};

struct MaskedBatch {
  Tensor x, mask, y;
};

MaskedBatch make_masked_batch(std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  Tensor x = dp::randn({rows, 6}, gen, dp::cpu(0));
  std::vector<float> m(static_cast<std::size_t>(rows * 6));
  for (std::size_t i = 0; i < m.size(); ++i) m[i] = (i * 5 + seed) % 3 == 0 ? 0.0f : 1.0f;
  std::vector<std::int64_t> labels(rows);
  for (std::int64_t i = 0; i < rows; ++i) labels[i] = (i * 7 + static_cast<std::int64_t>(seed)) % 3;
  return {x, dp::from_vector(m, {rows, 6}, dp::cpu(0)), dp::from_vector(labels, {rows}, dp::cpu(0))};
}

// Per-shard GEMMs and the sum over devices round differently from one GEMM over the
// batch: agreement to float rounding, a little amplified by 4 SGD steps.
constexpr double kTolerance = 2e-5;

struct Run {
  std::vector<float> params, out0, x_grad0, mask_grad0;
  std::vector<double> losses;
};

enum class Path { Module, WorkerLoss };

std::vector<float> flat_grads(dp::nn::Module& m) {
  std::vector<float> out;
  for (const Tensor& p : m.parameters()) {
    const std::vector<float> g = p.grad().to_vector();
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

// 4 SGD steps; n == 0 is the unwrapped module on cpu(0). The first step's output and
// input gradients are recorded (Module path).
Run train(int n, dp::Mode mode, Path path, std::int64_t rows) {
  auto net = std::make_shared<MaskedNet>(42);
  std::unique_ptr<dp::DataParallel> model;
  if (n > 0) {
    std::vector<dp::Device> devs;
    for (int d = 0; d < n; ++d) devs.push_back(dp::cpu(d));
    model = std::make_unique<dp::DataParallel>(net, devs, dp::DataParallelOptions{.mode = mode});
  }
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
  Run res;
  for (int s = 0; s < 4; ++s) {
    MaskedBatch b = make_masked_batch(rows, 10 + s);
    opt.zero_grad();
    Tensor x = b.x.clone().set_requires_grad(true), mask = b.mask.clone().set_requires_grad(true);
    Tensor loss;
    if (path == Path::WorkerLoss && model) {
      // Inputs that require grad get it (Note [Input gradients of forward_backward]).
      loss = model->forward_backward({x, mask}, b.y, loss_fn);
    } else {
      Tensor out = model ? (*model)(x, mask) : (*net)(x, mask);
      loss = loss_fn(out, b.y);
      loss.backward();
      if (s == 0) res.out0 = out.to_vector();
    }
    if (s == 0) {
      REQUIRE(x.grad().defined());
      REQUIRE(mask.grad().defined());
      res.x_grad0 = x.grad().to_vector();
      res.mask_grad0 = mask.grad().to_vector();
    }
    res.losses.push_back(loss.item());
    opt.step();
  }
  res.params = flat(net->state_dict());
  return res;
}

}  // namespace

TEST_CASE("model(x, mask) and forward_backward({x, mask}, y, loss) match the unwrapped module, 1-4 devices") {
  for (std::int64_t rows : {12, 7, 3}) {  // even, uneven, fewer rows than 4 devices
    const Run ref = train(0, dp::Mode::DP, Path::Module, rows);
    for (int n = 1; n <= 4; ++n) {
      for (Path path : {Path::Module, Path::WorkerLoss}) {
        CAPTURE(rows);
        CAPTURE(n);
        CAPTURE(static_cast<int>(path));
        const Run a = train(n, dp::Mode::DP, path, rows);
        const Run b = train(n, dp::Mode::DDP, path, rows);
        const Run c = train(n, dp::Mode::Sharded, path, rows);
        CHECK(max_diff(a.params, ref.params) < kTolerance);
        for (int s = 0; s < 4; ++s) CHECK(std::fabs(a.losses[s] - ref.losses[s]) < kTolerance);
        if (path == Path::Module) {
          // Each row's output comes from that row alone, but a GEMM's rounding may depend
          // on how many rows it gets: equal to float rounding, bitwise across modes.
          CHECK(max_diff(a.out0, ref.out0) < 1e-6);
          CHECK(a.out0 == b.out0);
          CHECK(a.out0 == c.out0);
        }
        CHECK(max_diff(a.x_grad0, ref.x_grad0) < 1e-6);
        CHECK(max_diff(a.mask_grad0, ref.mask_grad0) < 1e-6);
        CHECK(a.x_grad0 == b.x_grad0);
        CHECK(a.mask_grad0 == c.mask_grad0);
        // One arithmetic in every design: bitwise identical on CPU devices.
        CHECK(a.params == b.params);
        CHECK(a.params == c.params);
        CHECK(a.losses == b.losses);
        CHECK(a.losses == c.losses);
        if (n == 1) {
          CHECK(a.params == ref.params);
          if (path == Path::Module) CHECK(a.out0 == ref.out0);
        }
      }
    }
  }
}

TEST_CASE("replicated inputs: every device gets them whole; their gradient is summed over devices") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP, dp::Mode::Sharded}) {
    CAPTURE(mode_name(mode));
    auto net = std::make_shared<MaskedNet>(7), ref_net = std::make_shared<MaskedNet>(7);
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
    MaskedBatch b = make_masked_batch(8, 3);
    dp::Generator gen(5);
    Tensor scale_host = dp::randn({8}, gen, dp::cpu(0));
    Tensor scale = scale_host.clone().set_requires_grad(true);
    Tensor scale_ref = scale_host.clone().set_requires_grad(true);
    Tensor out = model(b.x, b.mask, dp::replicated(scale));
    Tensor out_ref = (*ref_net)(b.x, b.mask, scale_ref);
    CHECK(dp::max_abs_diff(out, out_ref) < 1e-6);
    loss_fn(out, b.y).backward();
    loss_fn(out_ref, b.y).backward();
    REQUIRE(scale.grad().defined());
    CHECK(dp::max_abs_diff(scale.grad(), scale_ref.grad()) < 1e-6);

    // forward_backward sums a replicated input's gradient over the devices too.
    Tensor scale_fb = scale_host.clone().set_requires_grad(true);
    (void)model.forward_backward({b.x, b.mask, dp::replicated(scale_fb)}, b.y, loss_fn);
    REQUIRE(scale_fb.grad().defined());
    CHECK(dp::max_abs_diff(scale_fb.grad(), scale_ref.grad()) < 1e-6);

    // A 0-d input is replicated without the mark; forward_backward takes it too.
    Tensor two = dp::scalar_tensor(2.0f);
    CHECK(dp::max_abs_diff(model(b.x, b.mask, two), (*ref_net)(b.x, b.mask, two)) < 1e-6);
    Tensor l = model.forward_backward({b.x, b.mask, two}, b.y, loss_fn);
    CHECK(std::fabs(l.item() - loss_fn((*ref_net)(b.x, b.mask, two), b.y).item()) < 1e-6);
  }
}

TEST_CASE("forward_backward sends an input's gradient into the layers that made it, as backward() does") {
  // An encoder outside the wrapper: before, forward_backward detached its output and the
  // encoder silently got no gradient (Note [Input gradients of forward_backward]).
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP, dp::Mode::Sharded}) {
    const std::string name = mode_name(mode);
    CAPTURE(name);
    for (bool descriptor : {false, true}) {
      CAPTURE(descriptor);
      dp::Generator gen(11), ref_gen(11);
      auto enc = std::make_shared<dp::nn::Linear>(6, 6, true, &gen);
      auto enc_ref = std::make_shared<dp::nn::Linear>(6, 6, true, &ref_gen);
      auto net = std::make_shared<MaskedNet>(3), ref_net = std::make_shared<MaskedNet>(3);
      dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
      const MaskedBatch b = make_masked_batch(7, 4);
      Tensor h = enc->forward(b.x);
      if (descriptor) {
        (void)model.forward_backward({h, b.mask}, b.y, dp::nn::CrossEntropyLoss{});
      } else {
        (void)model.forward_backward({h, b.mask}, b.y, loss_fn);
      }
      loss_fn((*ref_net)(enc_ref->forward(b.x), b.mask), b.y).backward();
      for (std::size_t i = 0; i < 2; ++i) {
        CAPTURE(i);
        REQUIRE(enc->parameters()[i].grad().defined());
        CHECK(dp::max_abs_diff(enc->parameters()[i].grad(), enc_ref->parameters()[i].grad()) < 1e-6);
      }
      // Sharded keeps the summed gradients on their owners (no whole .grad to compare).
      if (mode != dp::Mode::Sharded) CHECK(max_diff(flat_grads(*net), flat_grads(*ref_net)) < 1e-6);
    }
    // Under no_grad the caller asked for no input gradient, as model(x) then gives none.
    auto net = std::make_shared<MaskedNet>(3);
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = mode});
    const MaskedBatch b = make_masked_batch(5, 4);
    Tensor x = b.x.clone().set_requires_grad(true);
    {
      dp::NoGradGuard no_grad;
      (void)model.forward_backward({x, b.mask}, b.y, loss_fn);
    }
    CHECK_FALSE(x.grad().defined());
  }
}

TEST_CASE("several inputs: bad cases are clear errors and the model stays usable") {
  auto net = std::make_shared<MaskedNet>(1);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)});
  MaskedBatch b = make_masked_batch(6, 1);
  auto throws_with = [](auto&& fn, std::initializer_list<std::string> parts) {
    try {
      fn();
    } catch (const dp::Error& e) {
      const std::string msg = e.what();
      for (const auto& p : parts)
        if (msg.find(p) == std::string::npos) {
          MESSAGE("message lacks '", p, "': ", msg);
          return false;
        }
      return true;
    }
    return false;
  };
  Tensor short_mask = b.mask.narrow(0, 0, 5);
  CHECK(throws_with([&] { model(b.x, short_mask); }, {"same size(0)", "input 0 has 6 rows", "input 1 has 5",
                                                       "dp::replicated"}));
  CHECK(throws_with([&] { model.forward_backward({b.x, short_mask}, b.y, loss_fn); },
                    {"forward_backward", "same size(0)"}));
  CHECK(throws_with([&] { model(dp::replicated(b.x), dp::replicated(b.mask)); }, {"no batch to split"}));
  CHECK(throws_with([&] { model(b.x, Tensor()); }, {"input 1 is an undefined tensor"}));
  CHECK(throws_with([&] { model.forward(std::vector<dp::DataParallelInput>{}); }, {"at least one input"}));
  CHECK(throws_with([&] { model.forward_backward({b.x, b.mask}, b.y.narrow(0, 0, 4), loss_fn); },
                    {"target with 6 rows"}));
  // A single-input module given two inputs names itself.
  auto fc = std::make_shared<dp::nn::Linear>(6, 3);
  dp::DataParallel single(fc, {dp::cpu(0), dp::cpu(1)});
  CHECK(throws_with([&] { single(b.x, b.mask); }, {"Linear", "expected 1 input", "got 2 inputs"}));
  // Still usable after the failures.
  CHECK(model(b.x, b.mask).shape() == dp::Shape{6, 3});
  CHECK(single(b.x).shape() == dp::Shape{6, 3});
}
