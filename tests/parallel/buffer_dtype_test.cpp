// tests/parallel/buffer_dtype_test.cpp — DataParallelOptions::mixed_precision.buffer_dtype
// (Note [Buffers in low precision] in src/parallel/design.cpp): a worker reads the
// buffers of its own modules in buffer_dtype (BatchNorm2d's stay float32), an in-place
// update of one is made in buffer_dtype and reaches the float32 buffer the user reads,
// the designs stay bitwise alike, and one device agrees bit for bit with the same
// arithmetic written by hand.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Dtype;
using dp::Tensor;

constexpr int kDevices = 3;
constexpr std::int64_t kRows = 10;  // uneven on 3 devices (4, 4, 2)

/// 6-16-3 with a buffer `scale` multiplied into the hidden layer (values no 16-bit
/// dtype holds exactly), a buffer `running` that keeps a running mean of the hidden
/// layer in training (in place, under no_grad), and a BatchNorm2d over the hidden layer.
/// Records what device 1's forward read (another's when record_device says).
struct Buffered : dp::nn::Module {
  explicit Buffered(std::uint64_t seed, bool update_running = true) : update_running_(update_running) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
    bn = register_module("bn", std::make_shared<dp::nn::BatchNorm2d>(16));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(16, 3, true, &gen));
    std::vector<float> s(16);
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = 1.0f + static_cast<float>(i) / 7.0f;
    scale_ = register_buffer("scale", dp::from_vector(s, {16}, dp::cpu(0)));
    running_ = register_buffer("running", dp::zeros({16}, dp::cpu(0)));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = dp::mul(fc1->forward(x), scale_.get());
    if (is_training() && update_running_) {
      dp::NoGradGuard no_grad;
      Tensor running = running_.get();
      running.mul_(0.5f);
      running.add_(h.detach().mean(0).to(running.dtype()), 0.5f);
    }
    const std::int64_t b = h.size(0);
    Tensor n = bn->forward(h.reshape({b, 16, 1, 1})).reshape({b, 16});
    if (record_device < 0 || x.device().index == record_device) {
      std::lock_guard<std::mutex> lock(mu);
      seen = {true, scale_.get().dtype(), running_.get().dtype(), h.dtype(), bn->running_mean().dtype()};
    }
    return fc2->forward(n.relu());
  }
  struct Seen {
    bool ran = false;
    Dtype scale = Dtype::Float32, running = Dtype::Float32, scaled = Dtype::Float32, bn_running = Dtype::Float32;
  };
  std::mutex mu;
  Seen seen;
  int record_device = 1;  // the device whose forward `seen` records; -1: any device's
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
  std::shared_ptr<dp::nn::BatchNorm2d> bn;

 private:
  bool update_running_;
  dp::nn::Parameter scale_, running_;
};

dp::DataParallelOptions with(dp::DataParallelOptions o, std::optional<Dtype> params, std::optional<Dtype> buffers) {
  o.mixed_precision.param_dtype = params;
  o.mixed_precision.buffer_dtype = buffers;
  return o;
}

/// 3 Adam steps of two accumulated backward passes (uneven rows) on n devices.
void train_net(const std::shared_ptr<Buffered>& net, int n, const dp::DataParallelOptions& opts) {
  dp::DataParallel model(net, cpus(n), opts);
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    for (int pass = 0; pass < 2; ++pass) {
      const Batch b = make_batch(kRows - pass, 100 + 2 * static_cast<std::uint64_t>(s) + static_cast<std::uint64_t>(pass));
      model.forward_backward(b.x, b.y, loss_fn);
    }
    opt.step();
  }
}

/// train_net on a fresh net: the parameters and buffers after it.
std::vector<float> train(bool update_running, int n, const dp::DataParallelOptions& opts) {
  auto net = std::make_shared<Buffered>(42, update_running);
  train_net(net, n, opts);
  return flat(net->state_dict());
}

/// The buffer `name` of net (its float32 master, what the user reads).
Tensor buffer(Buffered& net, const std::string& name) {
  for (auto& [n, t] : net.named_buffers())
    if (n == name) return t;
  FAIL("no buffer ", name);
  return {};
}

/// Every value of t exactly representable in `dtype`.
bool holds_exactly(const Tensor& t, Dtype dtype) {
  return t.to_vector() == t.to(dtype).to(Dtype::Float32).to_vector();
}

}  // namespace

TEST_CASE("buffer_dtype bf16: a worker reads its own module's buffers in bfloat16, BatchNorm's in float32, in every design") {
  for (const NamedDesign& d : every_design()) {
    CAPTURE(d.name);
    auto net = std::make_shared<Buffered>(42);
    dp::DataParallel model(net, cpus(kDevices), with(d.options, Dtype::BFloat16, Dtype::BFloat16));
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
    const Batch b = make_batch(kRows, 7);
    model.forward_backward(b.x, b.y, loss_fn);
    opt.step();
    REQUIRE(net->seen.ran);
    CHECK(net->seen.scale == Dtype::BFloat16);
    CHECK(net->seen.running == Dtype::BFloat16);
    CHECK(net->seen.scaled == Dtype::BFloat16);  // a bfloat16 weight times a bfloat16 buffer
    CHECK(net->seen.bn_running == Dtype::Float32);
    // What the user reads: float32 buffers, the running mean updated in bfloat16.
    const Tensor running = buffer(*net, "running");
    CHECK(running.dtype() == Dtype::Float32);
    CHECK(running.abs().sum().item() > 0);
    CHECK(holds_exactly(running, Dtype::BFloat16));
    CHECK(buffer(*net, "scale").dtype() == Dtype::Float32);
    CHECK_FALSE(holds_exactly(buffer(*net, "scale"), Dtype::BFloat16));  // the master keeps its bits
    CHECK(buffer(*net, "bn.running_mean").dtype() == Dtype::Float32);
  }
}

TEST_CASE("param_dtype bf16 without buffer_dtype: a float32 buffer turns the layer it meets float32") {
  // The reason for buffer_dtype: a bfloat16 activation times a float32 buffer is float32,
  // and the next Linear (bfloat16 weights) refuses a float32 input.
  auto net = std::make_shared<Buffered>(42);
  // Any device's forward (they read the same dtypes): the step stops at the first
  // device's error, and the other's forward may not have come as far by then.
  net->record_device = -1;
  dp::DataParallel model(net, cpus(2), with({.mode = dp::Mode::DDP}, Dtype::BFloat16, std::nullopt));
  const Batch b = make_batch(kRows, 7);
  CHECK_THROWS_WITH_AS(model.forward_backward(b.x, b.y, loss_fn),
                       doctest::Contains("expected input, weight and bias of one dtype, got float32, bfloat16"),
                       dp::Error);
  REQUIRE(net->seen.ran);
  CHECK(net->seen.scale == Dtype::Float32);
  CHECK(net->seen.scaled == Dtype::Float32);
}

TEST_CASE("buffer_dtype bf16 / fp16: DP, DDP and Sharded 1-3 stay bitwise alike, parameters and buffers") {
  for (Dtype dtype : {Dtype::BFloat16, Dtype::Float16}) {
    for (std::optional<Dtype> params : {std::optional<Dtype>{}, std::optional<Dtype>{dtype}}) {
      const std::vector<float> fp32 = train(true, 1, {.mode = dp::Mode::DDP});
      for (int n : {2, 3}) {
        std::optional<std::vector<float>> first;
        for (const NamedDesign& d : every_design()) {
          CAPTURE(dp::dtype_name(dtype));
          CAPTURE(params.has_value());
          CAPTURE(n);
          CAPTURE(d.name);
          const std::vector<float> state = train(true, n, with(d.options, params, dtype));
          if (!first) {
            first = state;
            CHECK(state != fp32);  // the buffers did live in 16 bits
          } else {
            CHECK(state == *first);
          }
        }
      }
    }
  }
}

TEST_CASE("buffer_dtype bf16 on one device: read-only buffers compute as buffers rounded by hand, updates as 16-bit arithmetic by hand") {
  const dp::DataParallelOptions ddp{.mode = dp::Mode::DDP};
  // A read-only buffer: training with buffer_dtype is training with its values rounded
  // by hand, and the master buffer keeps its own bits.
  {
    auto params_after = [](const std::shared_ptr<Buffered>& net, const dp::DataParallelOptions& o) {
      train_net(net, 1, o);
      return flat(net->named_parameters());
    };
    auto cast = std::make_shared<Buffered>(42, false);
    const std::vector<float> scale = buffer(*cast, "scale").to_vector();
    const std::vector<float> with_cast = params_after(cast, with(ddp, std::nullopt, Dtype::BFloat16));
    auto rounded = std::make_shared<Buffered>(42, false);
    {
      dp::NoGradGuard no_grad;
      Tensor s = buffer(*rounded, "scale");
      s.copy_(s.to(Dtype::BFloat16).to(Dtype::Float32));
    }
    CHECK(with_cast == params_after(rounded, ddp));
    CHECK(with_cast != params_after(std::make_shared<Buffered>(42, false), ddp));  // the rounding mattered
    CHECK(buffer(*cast, "scale").to_vector() == scale);
  }
  // An update in place: the running mean after one forward is the hand-made bfloat16 one.
  {
    auto net = std::make_shared<Buffered>(42);
    const Batch b = make_batch(kRows, 7);
    Tensor expected;
    {
      dp::NoGradGuard no_grad;
      const Tensor h = dp::mul(net->fc1->forward(b.x), buffer(*net, "scale").to(Dtype::BFloat16));
      Tensor running = buffer(*net, "running").to(Dtype::BFloat16);
      running.mul_(0.5f);
      running.add_(h.mean(0).to(Dtype::BFloat16), 0.5f);
      expected = running.to(Dtype::Float32);
    }
    dp::DataParallel model(net, cpus(1), with(ddp, std::nullopt, Dtype::BFloat16));
    model.forward_backward(b.x, b.y, loss_fn);
    CHECK(buffer(*net, "running").to_vector() == expected.to_vector());
  }
}

TEST_CASE("buffer_dtype float32 is float32: the same bits as unset") {
  for (const NamedDesign& d : every_design()) {
    CAPTURE(d.name);
    CHECK(train(true, 2, with(d.options, std::nullopt, Dtype::Float32)) == train(true, 2, d.options));
  }
}

TEST_CASE("bad buffer_dtype options are a clear dp::Error") {
  for (Dtype bad : {Dtype::Int64, Dtype::Int32}) {
    const std::string expected = "mixed_precision.buffer_dtype expects a floating dtype (float32, bfloat16 or "
                                 "float16), got " + std::string(dp::dtype_name(bad));
    CHECK_THROWS_WITH_AS(dp::DataParallel(std::make_shared<Buffered>(1), cpus(2),
                                          {.mode = dp::Mode::DDP, .mixed_precision = {.buffer_dtype = bad}}),
                         doctest::Contains(expected.c_str()), dp::Error);
  }
}
