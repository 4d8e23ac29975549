// DataParallelOptions::mixed_precision.reduce_dtype: gradients on the wire in bfloat16
// and float16 in every design (Note [Gradients on the wire] in src/parallel/grad_wire.h)
// — the summed gradient against an explicit reference, the designs bitwise equal to one
// another, half the bytes, and the options that are refused.
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Dtype;
using dp::Tensor;

constexpr std::int64_t kRows = 10;  // uneven on 3 devices (4, 4, 2)

dp::DataParallelOptions with_wire(dp::DataParallelOptions o, std::optional<Dtype> wire) {
  o.mixed_precision.reduce_dtype = wire;
  return o;
}

/// x rounded to `dtype` and widened back, element by element (Tensor::to's bits).
std::vector<float> rounded(const std::vector<float>& x, Dtype dtype) {
  return dp::from_vector(x, {static_cast<std::int64_t>(x.size())}).to(dtype).to(Dtype::Float32).to_vector();
}

/// Each device's own gradient of one forward_backward on the batch (a DDP backward
/// inside no_sync: every replica keeps what its worker computed).
std::vector<std::vector<float>> local_grads(int n, const Batch& b) {
  auto net = make_mlp(42);
  dp::DataParallel model(net, cpus(n), {.mode = dp::Mode::DDP});
  auto guard = model.no_sync();
  model.forward_backward(b.x, b.y, loss_fn);
  std::vector<std::vector<float>> out;
  for (int r = 0; r < n; ++r) out.push_back(model.parameters().set()->copy(r).grad.to(dp::cpu(0)).to_vector());
  return out;
}

/// The reference of the note: every device's gradient rounded to `wire`, added in float32
/// in device order, the sum rounded once (nothing is rounded on one device: no wire).
std::vector<float> reference_sum(const std::vector<std::vector<float>>& g, Dtype wire) {
  if (g.size() == 1) return g[0];
  std::vector<float> acc = rounded(g[0], wire);
  for (std::size_t r = 1; r < g.size(); ++r) {
    const std::vector<float> gr = rounded(g[r], wire);
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += gr[i];
  }
  return rounded(acc, wire);
}

struct Result {
  std::vector<float> params;     // after one SGD step with lr 1: p - g, exactly
  std::int64_t grad_bytes = 0;   // device 0's, for the one backward
};

/// One zero_grad, forward_backward and SGD(lr = 1) step in `opts` on n devices.
Result step_once(int n, const dp::DataParallelOptions& opts, const Batch& b) {
  auto net = make_mlp(42);
  dp::DataParallel model(net, cpus(n), opts);
  dp::optim::SGD opt(model.parameters(), {.lr = 1.0});
  model.reset_stats();
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  const std::int64_t bytes = model.stats().devices[0].grad_bytes;
  opt.step();
  if (opts.mode != dp::Mode::DP) model.check_replicas();  // replicas bitwise equal (throws otherwise)
  return {flat(net->state_dict()), bytes};
}

std::int64_t numel_of(const std::shared_ptr<dp::nn::Sequential>& net) {
  std::int64_t n = 0;
  for (auto& p : net->parameters()) n += p.numel();
  return n;
}

}  // namespace

TEST_CASE("reduce_dtype bf16 / fp16: every design on 1-3 devices sums the rounded gradients as the reference does") {
  const Batch b = make_batch(kRows, 7);
  const std::vector<float> p0 = flat(make_mlp(42)->state_dict());
  const std::int64_t numel = numel_of(make_mlp(42));
  for (int n = 1; n <= 3; ++n) {
    const auto local = local_grads(n, b);
    for (Dtype wire : {Dtype::BFloat16, Dtype::Float16}) {
      // p - 1 * g with g the reference: SGD's update with lr 1 is exact.
      const std::vector<float> g = reference_sum(local, wire);
      std::vector<float> expected(p0.size());
      for (std::size_t i = 0; i < p0.size(); ++i) expected[i] = p0[i] - g[i];
      for (const NamedDesign& d : every_design()) {
        CAPTURE(n);
        CAPTURE(dp::dtype_name(wire));
        CAPTURE(d.name);
        const Result r16 = step_once(n, with_wire(d.options, wire), b);
        CHECK(r16.params == expected);
        const Result r32 = step_once(n, d.options, b);
        // Half the bytes of float32's, every synced element once; nothing on one device.
        CHECK(r32.grad_bytes == (n > 1 ? numel * 4 : 0));
        CHECK(r16.grad_bytes == (n > 1 ? numel * 2 : 0));
        if (n > 1) CHECK(r16.params != r32.params);  // the wire did round
      }
    }
  }
}

TEST_CASE("reduce_dtype float32 is the float32 wire: the same bits as unset") {
  const Batch b = make_batch(kRows, 7);
  for (const NamedDesign& d : every_design()) {
    CAPTURE(d.name);
    const Result unset = step_once(3, d.options, b);
    const Result f32 = step_once(3, with_wire(d.options, Dtype::Float32), b);
    CHECK(f32.params == unset.params);
    CHECK(f32.grad_bytes == unset.grad_bytes);
  }
}

// Several steps of Adam with two backward passes per step (the second adds to the
// combined sum: Note [Accumulating after a combined backward]) and uneven rows: the
// designs stay bitwise equal to one another with a 16-bit wire.
TEST_CASE("reduce_dtype bf16 / fp16: DP, DDP and Sharded 1-3 stay bitwise equal over accumulating Adam steps") {
  for (Dtype wire : {Dtype::BFloat16, Dtype::Float16}) {
    for (int n : {2, 3}) {
      std::optional<std::vector<float>> first;
      for (const NamedDesign& d : every_design()) {
        CAPTURE(dp::dtype_name(wire));
        CAPTURE(n);
        CAPTURE(d.name);
        auto net = make_mlp(42);
        dp::DataParallel model(net, cpus(n), with_wire(d.options, wire));
        dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
        for (int s = 0; s < 4; ++s) {
          opt.zero_grad();
          for (int pass = 0; pass < 2; ++pass) {
            const Batch b = make_batch(kRows - pass, 100 + 2 * s + pass);
            model.forward_backward(b.x, b.y, loss_fn);
          }
          opt.step();
        }
        const std::vector<float> params = flat(net->state_dict());
        if (!first) {
          first = params;
        } else {
          CHECK(params == *first);
        }
      }
    }
  }
}

TEST_CASE("bad mixed_precision options are a clear dp::Error") {
  auto make = [](dp::MixedPrecision mp) {
    dp::DataParallel model(make_mlp(42), cpus(2), {.mode = dp::Mode::DDP, .mixed_precision = mp});
  };
  CHECK_THROWS_WITH_AS(make({.reduce_dtype = Dtype::Int64}),
                       doctest::Contains("mixed_precision.reduce_dtype expects a floating dtype"), dp::Error);
  CHECK_THROWS_WITH_AS(make({.reduce_dtype = Dtype::Int32}), doctest::Contains("got int32"), dp::Error);
  CHECK_NOTHROW(make({.param_dtype = Dtype::BFloat16}));  // param_dtype_test.cpp
  CHECK_NOTHROW(make({.buffer_dtype = Dtype::Float16}));  // buffer_dtype_test.cpp
  CHECK_THROWS_WITH_AS(make({.buffer_dtype = Dtype::Int64}),
                       doctest::Contains("mixed_precision.buffer_dtype expects a floating dtype"), dp::Error);
  CHECK_NOTHROW(make({.reduce_dtype = Dtype::BFloat16}));
  CHECK_NOTHROW(make({.reduce_dtype = Dtype::Float32}));
}
