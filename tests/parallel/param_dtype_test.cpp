// tests/parallel/param_dtype_test.cpp — DataParallelOptions::mixed_precision.param_dtype
// (Note [Parameters in low precision] in src/parallel/design.cpp): the forward on a
// worker sees 16-bit parameters and activations while the optimizer's parameters and
// gradients stay float32; the designs stay bitwise equal to one another; one device
// agrees bit for bit with a forward written by hand on parameters cast by hand; a
// BatchNorm keeps float32 parameters; bad options are a clear dp::Error.
#include <doctest/doctest.h>

#include <array>
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

dp::DataParallelOptions with_params(dp::DataParallelOptions o, Dtype dtype) {
  o.mixed_precision.param_dtype = dtype;
  return o;
}

/// The designs that take param_dtype (stage 3 is refused for now), and stages 1-2 with
/// the deferred gather (each unit's pull casts what it brought).
std::vector<NamedDesign> designs() {
  std::vector<NamedDesign> out;
  for (NamedDesign& d : every_design())
    if (d.options.shard_stage.value_or(0) != 3) out.push_back(d);
  for (int stage : {1, 2}) {
    NamedDesign d = out[1 + static_cast<std::size_t>(stage)];
    d.name += ", NextForward";
    d.options.shard_gather = dp::ShardGather::NextForward;
    out.push_back(d);
  }
  return out;
}

/// 6-16-3; records, per device, the dtype of its hidden activation and of fc1's weight
/// as the forward read them.
struct Probed : dp::nn::Module {
  explicit Probed(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(16, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = fc1->forward(x);
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto d = static_cast<std::size_t>(h.device().index);
      if (d < seen.size()) seen[d] = {true, h.dtype(), fc1->weight().dtype()};
    }
    return fc2->forward(h.relu());
  }
  struct Seen {
    bool ran = false;
    Dtype activation = Dtype::Float32;
    Dtype weight = Dtype::Float32;
  };
  std::mutex mu;
  std::array<Seen, kDevices> seen{};
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};

/// Conv, BatchNorm, ReLU, pooling, a Linear head; records what device 1's forward saw.
struct SmallCNN : dp::nn::Module {
  explicit SmallCNN(std::uint64_t seed) {
    dp::Generator gen(seed);
    conv = register_module("conv", std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(2, 4, 3).padding(1), &gen));
    bn = register_module("bn", std::make_shared<dp::nn::BatchNorm2d>(4));
    fc = register_module("fc", std::make_shared<dp::nn::Linear>(4 * 4 * 4, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = bn->forward(conv->forward(x));
    if (x.device().index == 1) {
      std::lock_guard<std::mutex> lock(mu);
      conv_weight = conv->weight().dtype();
      bn_weight = bn->parameter("weight")->dtype();
      bn_out = h.dtype();
    }
    return fc->forward(h.relu().flatten(1));
  }
  std::mutex mu;
  Dtype conv_weight = Dtype::Float32, bn_weight = Dtype::Float32, bn_out = Dtype::Float32;
  std::shared_ptr<dp::nn::Conv2d> conv;
  std::shared_ptr<dp::nn::BatchNorm2d> bn;
  std::shared_ptr<dp::nn::Linear> fc;
};

Batch make_image_batch(std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  Tensor x = dp::randn({rows, 2, 4, 4}, gen, dp::cpu(0));
  std::vector<std::int64_t> labels(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i) labels[static_cast<std::size_t>(i)] = (i * 5 + static_cast<std::int64_t>(seed)) % 3;
  return {x, dp::from_vector(labels, {rows}, dp::cpu(0))};
}

/// Every parameter's float32 gradient on device 0 (what the optimizer reads), concatenated.
std::vector<float> grads_of(dp::nn::Module& net) {
  std::vector<float> out;
  for (auto& p : net.parameters()) {
    REQUIRE(p.grad().defined());
    auto v = p.grad().to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

/// `steps` accumulating Adam steps (two backward passes each, uneven rows); the
/// parameters and buffers after them.
template <typename MakeNet, typename MakeBatch, typename Loss>
std::vector<float> train(MakeNet make_net, MakeBatch make, Loss loss, int n, const dp::DataParallelOptions& opts,
                         int steps = 3) {
  auto net = make_net();
  dp::DataParallel model(net, cpus(n), opts);
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    for (int pass = 0; pass < 2; ++pass) {
      const Batch b = make(kRows - pass, 100 + 2 * static_cast<std::uint64_t>(s) + static_cast<std::uint64_t>(pass));
      model.forward_backward(b.x, b.y, loss);
    }
    opt.step();
  }
  return flat(net->state_dict());
}

}  // namespace

TEST_CASE("param_dtype bf16: a worker's forward reads bfloat16, the optimizer float32, in every design") {
  for (const NamedDesign& d : designs()) {
    CAPTURE(d.name);
    auto net = std::make_shared<Probed>(42);
    dp::DataParallel model(net, cpus(kDevices), with_params(d.options, Dtype::BFloat16));
    for (int path = 0; path < 2; ++path) {  // forward_backward, then the module path
      CAPTURE(path);
      net->seen = {};
      model.zero_grad();
      const Batch b = make_batch(kRows, 7);
      if (path == 0) {
        model.forward_backward(b.x, b.y, loss_fn);
      } else {
        Tensor out = model(b.x);
        CHECK(out.dtype() == Dtype::BFloat16);  // the module's output, gathered as computed
        loss_fn(out, b.y).backward();
      }
      REQUIRE(net->seen[1].ran);
      CHECK(net->seen[1].activation == Dtype::BFloat16);
      CHECK(net->seen[1].weight == Dtype::BFloat16);
      CHECK(net->seen[0].weight == Dtype::BFloat16);
      // What the user and the optimizer see: float32 parameters with float32 gradients.
      for (auto& p : model.parameters()) {
        CHECK(p.dtype() == Dtype::Float32);
        if (d.options.mode == dp::Mode::DP || d.options.mode == dp::Mode::DDP) {
          REQUIRE(p.grad().defined());
          CHECK(p.grad().dtype() == Dtype::Float32);
        }
      }
      // The user's own thread reads the float32 master.
      CHECK(net->fc1->weight().dtype() == Dtype::Float32);
    }
  }
}

TEST_CASE("param_dtype: one device agrees bit for bit with a forward by hand on parameters cast by hand") {
  for (Dtype dtype : {Dtype::BFloat16, Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dtype));
    const Batch b = make_batch(kRows, 7);
    // By hand: every parameter cast to dtype as a leaf, the input cast, the gradients
    // (in dtype) widened.
    auto ref = make_mlp(42);
    std::vector<Tensor> leaves;
    for (auto& p : ref->parameters()) {
      Tensor l = p.to(dtype).detach();
      l.set_requires_grad(true);
      leaves.push_back(l);
    }
    Tensor x = b.x.to(dtype);
    Tensor h = dp::linear(x, leaves[0], leaves[1]).relu();
    h = dp::linear(h, leaves[2], leaves[3]).relu();
    Tensor y = dp::linear(h, leaves[4], leaves[5]);
    CHECK(y.dtype() == dtype);
    loss_fn(y, b.y).backward();
    std::vector<float> expected;
    for (auto& l : leaves) {
      REQUIRE(l.grad().dtype() == dtype);
      auto v = l.grad().to(Dtype::Float32).to_vector();
      expected.insert(expected.end(), v.begin(), v.end());
    }
    for (const NamedDesign& d : designs()) {
      CAPTURE(d.name);
      auto net = make_mlp(42);
      dp::DataParallel model(net, cpus(1), with_params(d.options, dtype));
      model.forward_backward(b.x, b.y, loss_fn);
      CHECK(grads_of(*net) == expected);
    }
  }
}

TEST_CASE("param_dtype bf16 / fp16: DP, DDP and Sharded 1-2 stay bitwise equal over accumulating Adam steps") {
  auto mlp = [] { return make_mlp(42); };
  auto batch = [](std::int64_t rows, std::uint64_t seed) { return make_batch(rows, seed); };
  for (Dtype dtype : {Dtype::BFloat16, Dtype::Float16}) {
    const std::vector<float> one = train(mlp, batch, loss_fn, 1, with_params({.mode = dp::Mode::DDP}, dtype));
    const std::vector<float> fp32 = train(mlp, batch, loss_fn, 1, {.mode = dp::Mode::DDP});
    CHECK(one != fp32);  // the parameters did compute in 16 bits
    for (int n : {2, 3}) {
      std::optional<std::vector<float>> first;
      for (const NamedDesign& d : designs()) {
        CAPTURE(dp::dtype_name(dtype));
        CAPTURE(n);
        CAPTURE(d.name);
        const std::vector<float> params = train(mlp, batch, loss_fn, n, with_params(d.options, dtype));
        if (!first) {
          first = params;
          // Against one device: the same training to 16-bit rounding of the sums.
          CHECK(max_diff(params, one) < 2e-2);
        } else {
          CHECK(params == *first);
        }
      }
    }
  }
}

TEST_CASE("param_dtype bf16 with reduce_dtype float32: gradients reduced in float32, the designs alike") {
  auto mlp = [] { return make_mlp(42); };
  auto batch = [](std::int64_t rows, std::uint64_t seed) { return make_batch(rows, seed); };
  std::optional<std::vector<float>> first;
  std::vector<float> bf16_wire;
  for (const NamedDesign& d : designs()) {
    CAPTURE(d.name);
    dp::DataParallelOptions o = with_params(d.options, Dtype::BFloat16);
    o.mixed_precision.reduce_dtype = Dtype::Float32;
    const std::vector<float> params = train(mlp, batch, loss_fn, 3, o);
    if (!first) {
      first = params;
      bf16_wire = train(mlp, batch, loss_fn, 3, with_params(d.options, Dtype::BFloat16));
      CHECK(params != bf16_wire);  // unset reduce_dtype follows param_dtype: a different wire
    } else {
      CHECK(params == *first);
    }
  }
}

TEST_CASE("param_dtype bf16: a BatchNorm keeps float32 parameters, its output goes on in bfloat16") {
  auto cnn = [] { return std::make_shared<SmallCNN>(5); };
  auto images = [](std::int64_t rows, std::uint64_t seed) { return make_image_batch(rows, seed); };
  std::optional<std::vector<float>> first;
  for (const NamedDesign& d : designs()) {
    CAPTURE(d.name);
    auto net = cnn();
    dp::DataParallel model(net, cpus(kDevices), with_params(d.options, Dtype::BFloat16));
    const Batch b = make_image_batch(kRows, 3);
    model.forward_backward(b.x, b.y, loss_fn);
    CHECK(net->conv_weight == Dtype::BFloat16);
    CHECK(net->bn_weight == Dtype::Float32);
    CHECK(net->bn_out == Dtype::BFloat16);
    const std::vector<float> params = train(cnn, images, loss_fn, kDevices, with_params(d.options, Dtype::BFloat16));
    if (!first) {
      first = params;
    } else {
      CHECK(params == *first);  // parameters and running statistics
    }
  }
}

TEST_CASE("param_dtype float32 is float32: the same bits as unset") {
  auto mlp = [] { return make_mlp(42); };
  auto batch = [](std::int64_t rows, std::uint64_t seed) { return make_batch(rows, seed); };
  for (const NamedDesign& d : designs()) {
    CAPTURE(d.name);
    CHECK(train(mlp, batch, loss_fn, 2, with_params(d.options, Dtype::Float32)) == train(mlp, batch, loss_fn, 2, d.options));
  }
}

TEST_CASE("bad param_dtype options are a clear dp::Error") {
  auto make = [](dp::DataParallelOptions o) { dp::DataParallel model(make_mlp(42), cpus(2), o); };
  for (Dtype bad : {Dtype::Int64, Dtype::Int32}) {
    const std::string expected = "mixed_precision.param_dtype expects a floating dtype (float32, bfloat16 or "
                                 "float16), got " + std::string(dp::dtype_name(bad));
    CHECK_THROWS_WITH_AS(make({.mode = dp::Mode::DDP, .mixed_precision = {.param_dtype = bad}}),
                         doctest::Contains(expected.c_str()), dp::Error);
  }
  dp::DataParallelOptions stage3{.mode = dp::Mode::Sharded, .shard_stage = 3};
  stage3.mixed_precision.param_dtype = Dtype::BFloat16;
  CHECK_THROWS_WITH_AS(make(stage3), doctest::Contains("param_dtype with shard_stage 3 is not supported yet"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(make({.mode = dp::Mode::DDP, .mixed_precision = {.buffer_dtype = Dtype::BFloat16}}),
                       doctest::Contains("mixed_precision.buffer_dtype = bfloat16 is not supported yet"), dp::Error);
  CHECK_NOTHROW(make({.mode = dp::Mode::DDP, .mixed_precision = {.param_dtype = Dtype::BFloat16}}));
  CHECK_NOTHROW(make({.mode = dp::Mode::DP, .mixed_precision = {.param_dtype = Dtype::Float16}}));
}
