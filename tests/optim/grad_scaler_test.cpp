// tests/optim/grad_scaler_test.cpp — dp::amp::GradScaler: PyTorch's defaults and
// schedule, skipped steps that leave parameters and optimizer state untouched, one
// decision on every device of every design when a single device overflows (Note [One
// decision everywhere]), state_dict and training checkpoints, and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "../parallel/mlp_fixture.h"
#include "../test_errors.h"
#include "dp/autograd/node.h"
#include "dp/dp.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// 6-16-3 plus a last parameter `tail` added to the output. While `poison_device` >= 0,
/// tail's gradient on that device becomes infinite and every other gradient stays
/// finite. tail is the last of the flat layout: in Sharded mode on 3 devices its range
/// belongs to device 2, so only that copy's owned gradient holds the overflow (device
/// 1's) — a check of one copy alone would miss it.
struct Tail : dp::nn::Module {
  Tail() { value = register_parameter("value", dp::zeros({3})); }
  dp::nn::Parameter value;
};

struct Poisonable : dp::nn::Module {
  explicit Poisonable(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(16, 3, true, &gen));
    tail = register_module("tail", std::make_shared<Tail>());  // a child: a gather unit of stage 3
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    // tail is read after fc1 and fc2 have run: stage 3 releases a unit's memory when the
    // forward moves on to another unit, so a handle must not be held across units.
    const dp::Tensor out = fc2->forward(fc1->forward(x).relu());
    dp::Tensor t = tail->value;
    if (poison_device >= 0 && t.device().index == poison_device) {
      dp::Tensor y = dp::mul(t, 1.0).detach();
      dp::autograd::record("Poison", {t}, y, {}, [](const std::vector<dp::Tensor>& g) {
        return std::vector<dp::Tensor>{dp::mul(g[0], static_cast<double>(kInf))};
      });
      t = y;
    }
    return dp::add(out, t);
  }
  std::shared_ptr<Tail> tail;
  int poison_device = -1;
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};

/// A copy of the values (a state_dict's tensors are the parameters themselves).
dp::nn::StateDict snapshot(const dp::nn::StateDict& sd) {
  dp::nn::StateDict out;
  for (const auto& [k, t] : sd) out.emplace_back(k, t.clone());
  return out;
}

bool same(const dp::nn::StateDict& a, const dp::nn::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || a[i].second.dtype() != b[i].second.dtype()) return false;
    if (a[i].second.dtype() == dp::Dtype::Float32 && a[i].second.to_vector() != b[i].second.to_vector()) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("GradScaler has PyTorch's defaults, scales the loss and grows and backs off on schedule") {
  dp::amp::GradScaler defaults;
  CHECK(defaults.get_scale() == 65536.0);
  CHECK(defaults.is_enabled());
  auto net = std::make_shared<Poisonable>(1);
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
  dp::amp::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 2});
  const Batch b = make_batch(8, 1);
  auto one_step = [&](bool poison) {
    net->poison_device = poison ? 0 : -1;
    opt.zero_grad();
    const dp::Tensor loss = loss_fn(net->forward(b.x), b.y);
    const dp::Tensor scaled = scaler.scale(loss);
    CHECK(scaled.item<float>() == loss.item<float>() * static_cast<float>(scaler.get_scale()));
    scaled.backward();
    const bool stepped = scaler.step(opt);
    scaler.update();
    return stepped;
  };
  // The gradients the optimizer sees are the true ones: the same step as without scaling.
  auto ref = std::make_shared<Poisonable>(1);
  dp::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1});
  ref_opt.zero_grad();
  loss_fn(ref->forward(b.x), b.y).backward();
  ref_opt.step();
  CHECK(one_step(false));
  CHECK(max_diff(flat(net->state_dict()), flat(ref->state_dict())) < 1e-6);
  CHECK(scaler.get_scale() == 1024.0);
  CHECK(scaler.growth_tracker() == 1);
  CHECK(one_step(false));
  CHECK(scaler.get_scale() == 2048.0);  // growth_interval good steps: doubled
  CHECK(scaler.growth_tracker() == 0);
  CHECK(one_step(false));
  // An overflow: the step is skipped, parameters and momentum untouched, the scale halves.
  const dp::nn::StateDict params = snapshot(net->state_dict());
  const dp::nn::StateDict state = snapshot(opt.state_dict());
  CHECK_FALSE(one_step(true));
  CHECK(same(net->state_dict(), params));
  CHECK(same(opt.state_dict(), state));
  CHECK(scaler.get_scale() == 1024.0);
  CHECK(scaler.growth_tracker() == 0);
  CHECK(one_step(false));
  CHECK_FALSE(same(net->state_dict(), params));
}

TEST_CASE("unscale_ before clipping; a second unscale_ or step, or an update with nothing to go by, is an error") {
  auto net = std::make_shared<Poisonable>(2);
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
  dp::amp::GradScaler scaler({.init_scale = 256.0});
  const Batch b = make_batch(8, 2);
  opt.zero_grad();
  scaler.scale(loss_fn(net->forward(b.x), b.y)).backward();
  const float scaled = net->fc2->weight().grad().to_vector()[0];
  scaler.unscale_(opt);
  CHECK(net->fc2->weight().grad().to_vector()[0] == scaled / 256.0f);
  CHECK(dp_test::throws_with([&] { scaler.unscale_(opt); }, {"unscale_: already called for this optimizer"}));
  const std::vector<float> before = flat(net->state_dict());
  CHECK(scaler.step(opt));  // does not unscale again
  const std::vector<float> once = flat(net->state_dict());
  CHECK(once != before);
  // A second step on the same gradients would move the parameters again (PyTorch raises).
  CHECK(dp_test::throws_with([&] { scaler.step(opt); }, {"step: already called for this optimizer"}));
  CHECK(flat(net->state_dict()) == once);
  CHECK(dp_test::throws_with([&] { scaler.unscale_(opt); }, {"unscale_: called after step()"}));
  scaler.update();
  const double scale = scaler.get_scale();
  const std::int64_t tracker = scaler.growth_tracker();
  // No step or unscale_ since: nothing to decide the scale by (PyTorch asserts).
  CHECK(dp_test::throws_with([&] { scaler.update(); }, {"update: no step(optimizer) or unscale_(optimizer)"}));
  CHECK(scaler.get_scale() == scale);
  CHECK(scaler.growth_tracker() == tracker);
  // The next step goes on as usual.
  opt.zero_grad();
  scaler.scale(loss_fn(net->forward(b.x), b.y)).backward();
  CHECK(scaler.step(opt));
  scaler.update();
}

namespace {

/// Four SGD-with-momentum steps under a GradScaler, on `model` (null: `net` on cpu(0)),
/// the second with an overflow on device `poison` only; checks that step is skipped
/// with parameters and momentum untouched; returns the parameters after the last.
std::vector<float> scaled_run(Poisonable& net, dp::DataParallel* model, int poison) {
  dp::optim::SGD opt(model ? model->parameters() : net.parameters(), {.lr = 0.1, .momentum = 0.9});
  dp::amp::GradScaler scaler({.init_scale = 4096.0});
  auto loss = [&](const dp::Tensor& out, const dp::Tensor& y) { return scaler.scale(loss_fn(out, y)); };
  auto step = [&](int s, int poisoned) {
    net.poison_device = poisoned;
    const Batch b = make_batch(11, 10 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    if (model) {
      model->forward_backward(b.x, b.y, loss);
    } else {
      loss(net.forward(b.x), b.y).backward();
    }
    const bool stepped = scaler.step(opt);
    scaler.update();
    return stepped;
  };
  CHECK(step(0, -1));
  const dp::nn::StateDict params = snapshot(net.state_dict());
  const dp::nn::StateDict state = snapshot(opt.state_dict());
  CHECK_FALSE(step(1, poison));  // one device's gradient only
  CHECK(scaler.get_scale() == 2048.0);
  CHECK(same(net.state_dict(), params));
  CHECK(same(opt.state_dict(), state));
  CHECK(step(2, -1));
  CHECK(step(3, -1));
  return flat(net.state_dict());
}

}  // namespace

TEST_CASE("one device's overflow skips the step on every device, in every design on 1-3 devices") {
  Poisonable alone(3);
  const std::vector<float> single = scaled_run(alone, nullptr, 0);
  CHECK(max_diff(single, flat(Poisonable(3).state_dict())) > 1e-3);  // the good steps moved it
  for (int devices = 1; devices <= 3; ++devices) {
    std::vector<float> dp_params;
    for (const NamedDesign& d : every_design()) {
      CAPTURE(d.name);
      CAPTURE(devices);
      auto net = std::make_shared<Poisonable>(3);
      dp::DataParallel model(net, cpus(devices), d.options);
      // Device 1 on 2 and 3 devices (on 3, tail's Sharded range is device 2's).
      const std::vector<float> got = scaled_run(*net, &model, devices == 1 ? 0 : 1);
      CHECK(max_diff(got, single) < 1e-5);  // as one device, to float rounding
      if (dp_params.empty()) {
        dp_params = got;
      } else {
        CHECK(max_diff(got, dp_params) == 0.0);  // the designs stay bitwise alike
      }
    }
  }
}

TEST_CASE("forward_backward with a loss descriptor and a GradScaler: the scaled exact gradients, the loss unscaled") {
  // A Sum, an ignore_index mean and a class-weighted, smoothed mean: the reductions a
  // loss function cannot split by rows. With a power-of-two scale, scaling and unscaling
  // are exact, so the scaled run must match the unscaled descriptor run bit for bit:
  // its gradients (where DP and DDP keep them whole) are 1024 times those, its loss is
  // that loss, and its parameters after scaler.step equal those after opt.step, in
  // every design on 1-3 devices. A disabled scaler scales nothing.
  const dp::Tensor weight = dp::from_vector(std::vector<float>{1.0f, 2.0f, 0.5f}, {3}, dp::cpu(0));
  const dp::nn::CrossEntropyLoss losses[] = {
      {.reduction = dp::nn::Reduction::Sum}, {.ignore_index = 1}, {.weight = weight, .label_smoothing = 0.1}};
  const Batch b = make_batch(7, 41);
  for (int devices = 1; devices <= 3; ++devices)
    for (const NamedDesign& d : every_design())
      for (std::size_t l = 0; l < std::size(losses); ++l)
        for (bool enabled : {true, false}) {
          CAPTURE(devices);
          CAPTURE(d.name);
          CAPTURE(l);
          CAPTURE(enabled);
          auto plain_net = std::make_shared<Poisonable>(4), scaled_net = std::make_shared<Poisonable>(4);
          dp::DataParallel plain(plain_net, cpus(devices), d.options), scaled(scaled_net, cpus(devices), d.options);
          dp::optim::SGD plain_opt(plain.parameters(), {.lr = 0.1}), scaled_opt(scaled.parameters(), {.lr = 0.1});
          dp::amp::GradScaler scaler({.init_scale = 1024.0, .enabled = enabled});
          const dp::Tensor want = plain.forward_backward(b.x, b.y, losses[l]);
          const dp::Tensor got = scaled.forward_backward(b.x, b.y, losses[l], scaler);
          CHECK(got.item() == want.item());
          const bool whole = d.options.mode != dp::Mode::Sharded || devices == 1;
          if (whole) {
            const dp::nn::ParameterList pp = plain.parameters(), sp = scaled.parameters();
            const float factor = enabled ? 1024.0f : 1.0f;
            for (std::size_t i = 0; i < pp.size(); ++i) {
              std::vector<float> g = pp[i].grad().to_vector();
              for (float& v : g) v *= factor;
              CHECK(sp[i].grad().to_vector() == g);
            }
          }
          plain_opt.step();
          CHECK(scaler.step(scaled_opt));
          scaler.update();
          CHECK(flat(scaled_net->state_dict()) == flat(plain_net->state_dict()));
          CHECK(max_diff(flat(scaled_net->state_dict()), flat(Poisonable(4).state_dict())) > 1e-4);  // it stepped
        }
}

TEST_CASE("GradScaler state: state_dict round trip, training checkpoints, bad input") {
  dp::amp::GradScaler a({.init_scale = 512.0, .growth_interval = 7});
  auto net = std::make_shared<Poisonable>(4);
  dp::optim::SGD opt(net->parameters(), {.lr = 0.1});
  for (int i = 0; i < 2; ++i) {  // two good steps
    const Batch bt = make_batch(8, 30 + static_cast<std::uint64_t>(i));
    opt.zero_grad();
    a.scale(loss_fn(net->forward(bt.x), bt.y)).backward();
    CHECK(a.step(opt));
    a.update();
  }
  dp::amp::GradScaler b;
  b.load_state_dict(a.state_dict());
  CHECK(b.get_scale() == 512.0);
  CHECK(b.growth_tracker() == 2);
  CHECK(dp::amp::GradScaler({.enabled = false}).state_dict().empty());

  const std::string path = (std::filesystem::temp_directory_path() / "dp_grad_scaler_ckpt.safetensors").string();
  dp::TrainingState st;
  st.scaler = &a;
  dp::save_training_checkpoint(path, *net, opt, st);
  dp::amp::GradScaler restored;
  dp::TrainingState back;
  back.scaler = &restored;
  dp::load_training_checkpoint(path, *net, opt, back);
  CHECK(restored.get_scale() == 512.0);
  CHECK(restored.growth_tracker() == 2);
  CHECK(dp::load(net, path).unexpected_keys.empty());  // the scaler's tensors are not the module's
  // A file saved without a scaler cannot restore one.
  dp::save_training_checkpoint(path, *net, opt, dp::TrainingState{});
  CHECK(dp_test::throws_with([&] { dp::load_training_checkpoint(path, *net, opt, back); },
                             {"has no GradScaler state"}));
  std::filesystem::remove(path);

  CHECK(dp_test::throws_with([] { dp::amp::GradScaler s({.init_scale = 0.0}); }, {"expected init_scale > 0, got 0"}));
  CHECK(dp_test::throws_with([] { dp::amp::GradScaler s({.growth_factor = 1.0}); }, {"expected growth_factor > 1"}));
  CHECK(dp_test::throws_with([] { dp::amp::GradScaler s({.backoff_factor = 1.5}); }, {"expected backoff_factor in (0, 1)"}));
  CHECK(dp_test::throws_with([] { dp::amp::GradScaler s({.growth_interval = 0}); }, {"expected growth_interval >= 1"}));
  dp::nn::StateDict bad = a.state_dict();
  bad.erase(bad.begin());
  CHECK(dp_test::throws_with([&] { b.load_state_dict(bad); }, {"the state has no 'scale'"}));
  CHECK(b.get_scale() == 512.0);  // unchanged
  CHECK(dp_test::throws_with([&] { b.update(-1.0); }, {"expected a new scale > 0"}));
}
