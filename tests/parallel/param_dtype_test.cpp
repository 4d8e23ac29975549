// tests/parallel/param_dtype_test.cpp — DataParallelOptions::mixed_precision.param_dtype
// (Note [Parameters in low precision] in src/parallel/design.cpp): the forward on a
// worker sees 16-bit parameters and activations while the optimizer's parameters and
// gradients stay float32; the designs stay bitwise equal to one another; one device
// agrees bit for bit with a forward written by hand on parameters cast by hand; a
// BatchNorm keeps float32 parameters; stage 3 gathers the 16-bit compute copy (half
// the bytes); bad options are a clear dp::Error.
#include <doctest/doctest.h>

#include <algorithm>
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

/// Every design, and stages 1-2 with the deferred gather (each unit's pull casts what
/// it brought).
std::vector<NamedDesign> designs() {
  std::vector<NamedDesign> out = every_design();
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

TEST_CASE("param_dtype bf16 / fp16: DP, DDP and Sharded 1-3 stay bitwise equal over accumulating Adam steps") {
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
  CHECK_NOTHROW(make(stage3));
  CHECK_NOTHROW(make({.mode = dp::Mode::DDP, .mixed_precision = {.buffer_dtype = Dtype::BFloat16}}));
  CHECK_NOTHROW(make({.mode = dp::Mode::DDP, .mixed_precision = {.param_dtype = Dtype::BFloat16}}));
  CHECK_NOTHROW(make({.mode = dp::Mode::DP, .mixed_precision = {.param_dtype = Dtype::Float16}}));
}

namespace {

struct Gathered {
  std::vector<std::int64_t> bytes;      // Stats::gather_bytes per device
  std::vector<std::int64_t> elements;   // what the units' pieces from other owners hold, per device
};

/// One forward_backward of stage 3 on 3 devices (after a first step): the bytes every
/// device gathered, and the elements it must have received — each unit in forward,
/// every unit but the last again in backward (Note [Sharded parameters]), less its own
/// range.
Gathered stage3_gathers(std::optional<Dtype> param_dtype) {
  auto net = make_mlp(42);
  dp::DataParallelOptions o{.mode = dp::Mode::Sharded, .shard_stage = 3};
  o.mixed_precision.param_dtype = param_dtype;
  dp::DataParallel model(net, cpus(kDevices), o);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  const Batch b = make_batch(kRows, 7);
  model.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  model.reset_stats();
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  Gathered g;
  for (const auto& d : model.stats().devices) g.bytes.push_back(d.gather_bytes);
  const auto units = model.units();
  const auto shards = model.shards();
  for (const auto& [own_lo, own_hi] : shards) {
    std::int64_t n = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      const auto [lo, hi] = units[u];
      const std::int64_t own = std::max<std::int64_t>(0, std::min(hi, own_hi) - std::max(lo, own_lo));
      n += (u + 1 < units.size() ? 2 : 1) * (hi - lo - own);
    }
    g.elements.push_back(n);
  }
  return g;
}

}  // namespace

TEST_CASE("param_dtype bf16 / fp16 with stage 3: the units are gathered in 16 bits, exactly half float32's bytes") {
  const Gathered fp32 = stage3_gathers(std::nullopt);
  REQUIRE(fp32.bytes.size() == static_cast<std::size_t>(kDevices));
  for (Dtype dtype : {Dtype::BFloat16, Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dtype));
    const Gathered low = stage3_gathers(dtype);
    REQUIRE(low.bytes.size() == fp32.bytes.size());
    CHECK(low.elements == fp32.elements);  // the same units and ranges
    for (std::size_t r = 0; r < fp32.bytes.size(); ++r) {
      CAPTURE(r);
      CHECK(fp32.elements[r] > 0);
      CHECK(fp32.bytes[r] == 4 * fp32.elements[r]);
      CHECK(low.bytes[r] == 2 * fp32.elements[r]);
    }
  }
}

TEST_CASE("param_dtype bf16 with stage 3: a BatchNorm is a float32 unit of its own, the designs alike") {
  // One top-level child holds a Conv2d and a BatchNorm2d: one gather unit in float32,
  // three under param_dtype (conv and fc in bfloat16, bn in float32).
  auto make = [] {
    dp::Generator gen(5);
    auto block = std::make_shared<dp::nn::Sequential>();
    block->push_back(std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(2, 4, 3).padding(1), &gen));
    block->push_back(std::make_shared<dp::nn::BatchNorm2d>(4));
    block->push_back(std::make_shared<dp::nn::ReLU>());
    auto net = std::make_shared<dp::nn::Sequential>();
    net->push_back(block);
    net->push_back(std::make_shared<dp::nn::Flatten>());
    net->push_back(std::make_shared<dp::nn::Linear>(4 * 4 * 4, 3, true, &gen));
    return net;
  };
  const dp::DataParallelOptions stage3{.mode = dp::Mode::Sharded, .shard_stage = 3};
  {
    dp::DataParallel fp32(make(), cpus(kDevices), stage3);
    CHECK(fp32.units().size() == 2);
    dp::DataParallel bf16(make(), cpus(kDevices), with_params(stage3, Dtype::BFloat16));
    const auto units = bf16.units();
    REQUIRE(units.size() == 3);
    CHECK(units[1].second - units[1].first == 2 * 4);  // bn's weight and bias
  }
  auto images = [](std::int64_t rows, std::uint64_t seed) { return make_image_batch(rows, seed); };
  const std::vector<float> ddp =
      train(make, images, loss_fn, kDevices, with_params({.mode = dp::Mode::DDP}, Dtype::BFloat16));
  CHECK(train(make, images, loss_fn, kDevices, with_params(stage3, Dtype::BFloat16)) == ddp);
}

TEST_CASE("param_dtype bf16 with stage 3: edits through device 0's parameters reach the 16-bit gathers, as in DDP") {
  auto run = [](const dp::DataParallelOptions& base) {
    auto net = make_mlp(42);
    dp::DataParallel model(net, cpus(kDevices), with_params(base, Dtype::BFloat16));
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    const auto other = make_mlp(7)->state_dict();
    for (int s = 0; s < 4; ++s) {
      if (s == 2) net->load_state_dict(other);  // written back into every range, cast again
      if (s == 3)
        for (auto& p : net->parameters()) {
          dp::NoGradGuard no_grad;
          p.mul_(0.5);  // an in-place edit
        }
      opt.zero_grad();
      const Batch b = make_batch(kRows, 100 + static_cast<std::uint64_t>(s));
      model.forward_backward(b.x, b.y, loss_fn);
      opt.step();
    }
    return flat(net->state_dict());
  };
  const std::vector<float> ddp = run({.mode = dp::Mode::DDP});
  CHECK(run({.mode = dp::Mode::Sharded, .shard_stage = 3}) == ddp);
}
