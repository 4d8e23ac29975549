// Tests for the backward engine and gradient accumulation (src/autograd/engine.cpp,
// src/autograd/node.cpp): accumulation across backwards and into views, retain_graph,
// implicit gradients, diamonds, long chains and post-accumulate hooks.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

using F = std::vector<float>;
using dp::Tensor;

Tensor leaf(const F& v, const dp::Shape& s, dp::Device dev = dp::cpu(0)) {
  Tensor t = dp::from_vector(v, s, dev);
  t.set_requires_grad(true);
  return t;
}

}  // namespace

TEST_CASE("leaves, recorded results and requires_grad") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor c = dp::from_vector(F{4, 5, 6}, {3});
  CHECK(x.requires_grad());
  CHECK(x.is_leaf());
  CHECK(x.grad_fn() == nullptr);
  CHECK_FALSE(x.grad().defined());
  CHECK_FALSE(c.requires_grad());

  Tensor y = x * c;
  CHECK(y.requires_grad());
  CHECK_FALSE(y.is_leaf());
  REQUIRE(y.grad_fn() != nullptr);
  CHECK(y.grad_fn()->name() == "MulBackward");
  CHECK_FALSE((c * c).requires_grad());  // no input needs a gradient: nothing recorded
  CHECK((c * c).grad_fn() == nullptr);

  Tensor d = y.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.is_leaf());

  x.set_requires_grad(false);
  CHECK_FALSE(x.requires_grad());
  CHECK_THROWS_WITH_AS(y.set_requires_grad(false), doctest::Contains("MulBackward"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::zeros({2}, dp::TensorOptions{dp::Dtype::Int64, {}}).set_requires_grad(true),
                       doctest::Contains("int64"), dp::Error);
}

TEST_CASE("gradients accumulate into .grad over two backwards") {
  Tensor x = leaf({1, -2, 3}, {3});
  for (int i = 0; i < 2; ++i) dp::sum(dp::square(x)).backward();
  CHECK(x.grad().to_vector() == F{4, -8, 12});  // 2 * (2x)
  // The first backward owns a fresh .grad, not a view of some engine buffer.
  Tensor g = x.grad();
  dp::sum(x * 3.0).backward();
  CHECK(x.grad().is_same(g));  // accumulated in place, same tensor
  CHECK(g.to_vector() == F{7, -5, 15});
  x.grad().zero_();
  dp::sum(x).backward();
  CHECK(x.grad().to_vector() == F{1, 1, 1});
}

TEST_CASE("a .grad that views a flat buffer is accumulated in place") {
  Tensor buffer = dp::zeros({10});
  Tensor x = leaf({1, 2, 3, 4}, {2, 2});
  Tensor view = buffer.narrow(0, 3, 4).reshape({2, 2});
  view.fill_(0.5);
  x.set_grad(view);
  dp::sum(x * x).backward();
  CHECK(x.grad().storage() == buffer.storage());
  CHECK(x.grad().storage_offset() == 3);
  CHECK(buffer.to_vector() == F{0, 0, 0, 2.5f, 4.5f, 6.5f, 8.5f, 0, 0, 0});
  dp::sum(x).backward();
  CHECK(buffer.to_vector() == F{0, 0, 0, 3.5f, 5.5f, 7.5f, 9.5f, 0, 0, 0});

  // The same on another virtual device, through a device copy in the graph.
  Tensor buffer1 = dp::zeros({6}, dp::cpu(1));
  Tensor w = leaf({1, 2}, {2}, dp::cpu(1));
  w.set_grad(buffer1.narrow(0, 2, 2));
  dp::sum(w.to(dp::cpu(0)) * dp::from_vector(F{3, 4}, {2})).backward();
  CHECK(buffer1.to_vector() == F{0, 0, 3, 4, 0, 0});

  CHECK_THROWS_WITH_AS(x.set_grad(dp::zeros({4})), doctest::Contains("[4]"), dp::Error);
  CHECK_THROWS_WITH_AS(x.set_grad(dp::zeros({4})), doctest::Contains("[2, 2]"), dp::Error);
  CHECK_THROWS_WITH_AS(x.set_grad(dp::zeros({2, 2}, dp::cpu(1))), doctest::Contains("cpu:1"), dp::Error);
  x.set_grad(Tensor());
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("a weight's gradient is added in place into a zeroed .grad: the same bits, no temporary") {
  // Note [Gradients added in place], Note [Gradients written over zeros]. x has an
  // all-zero column and the upstream gradient is negative, so that column of dW sums -0
  // products: added to +0, or written over +0, it must be +0. A batch of 8 makes dW a
  // product with a small k (the CPU's own loop), 64 one of oneDNN's kernels.
  for (const std::int64_t B : {std::int64_t{8}, std::int64_t{64}}) {
  CAPTURE(B);
  const std::int64_t in = 512, out = 512;
  dp::Generator gen(5);
  Tensor x = dp::randn({B, in}, gen);
  {
    F xv = x.to_vector();
    for (std::int64_t r = 0; r < B; ++r) xv[static_cast<std::size_t>(r * in + 7)] = 0.0f;
    x = dp::from_vector(xv, {B, in});
  }
  Tensor w = dp::randn({out, in}, gen), b = dp::randn({out}, gen);
  w.set_requires_grad(true);
  b.set_requires_grad(true);
  const Tensor c = dp::mul(dp::abs(dp::randn({B, out}, gen)), -1.0) + (-0.5);  // negative
  Tensor buffer = dp::zeros({out * in + out + 16});
  w.set_grad(buffer.narrow(0, 16, out * in).reshape({out, in}));
  b.set_grad(buffer.narrow(0, 16 + out * in, out));
  auto loss = [&] { return dp::sum(dp::linear(x, w, b) * c); };
  auto bits = [](const Tensor& t) {
    std::vector<std::uint32_t> v(static_cast<std::size_t>(t.numel()));
    std::memcpy(v.data(), t.data<float>(), v.size() * sizeof(float));
    return v;
  };

  // The usual path: zeroed but not marked, so backward makes dW and adds it.
  buffer.zero_();
  dp::reset_peak_memory(dp::cpu(0));
  std::size_t before = dp::memory_allocated(dp::cpu(0));
  loss().backward();
  const std::size_t usual_peak = dp::max_memory_allocated(dp::cpu(0)) - before;
  const auto usual = bits(w.grad());
  CHECK(usual_peak >= w.nbytes());  // the fresh dW

  // Marked as zeroed (zero_grad does this): the GEMM adds into the .grad itself.
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  dp::autograd::mark_grad_zeroed(b);
  Tensor l = loss();
  dp::reset_peak_memory(dp::cpu(0));
  before = dp::memory_allocated(dp::cpu(0));
  l.backward();
  // No dW beside .grad: what else backward holds (dY, B x out; the GEMM's operand
  // copies) stays under half of it.
  CHECK(dp::max_memory_allocated(dp::cpu(0)) - before < w.nbytes() / 2);
  CHECK(w.grad().storage() == buffer.storage());
  CHECK(w.grad().storage_offset() == 16);
  const auto in_place = bits(w.grad());
  CHECK(in_place == usual);
  for (std::int64_t o = 0; o < out; ++o) CHECK(in_place[static_cast<std::size_t>(o * in + 7)] == 0u);  // +0

  // The .grad against the usual path's dW, element by element.
  auto grad_vs_usual = [&](auto ok) {
    const F got = w.grad().to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) {
      float once;
      std::memcpy(&once, &usual[i], sizeof once);
      if (!ok(got[i], once)) return false;
    }
    return true;
  };

  // A .grad edited by hand after zero_grad: the product is added to what is there.
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  w.grad().fill_(1.0);
  loss().backward();
  CHECK(grad_vs_usual([](float got, float once) { return std::abs(got - (1.0f + once)) <= 1e-6f * (1.0f + std::abs(once)); }));

  // A second backward without zero_grad accumulates as usual: dW + dW.
  buffer.zero_();
  loss().backward();
  loss().backward();
  CHECK(grad_vs_usual([](float got, float once) { return got == once + once; }));

  // A weight used twice in one graph: the two gradients are summed first, then added.
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  (loss() + loss()).backward();
  CHECK(grad_vs_usual([](float got, float once) { return got == once + once; }));

  // Written after zero_grad through another view of the flat buffer (the .grad's own
  // mark cannot see it; the storage's write epoch does): the product is added to it,
  // not written over it.
  auto first_added = [&](float first) {
    const F got = w.grad().to_vector();
    float once0;
    std::memcpy(&once0, &usual[0], sizeof once0);
    bool rest = true;
    for (std::size_t i = 1; i < got.size(); ++i) {
      float once;
      std::memcpy(&once, &usual[i], sizeof once);
      rest = rest && got[i] == once;
    }
    return rest && got[0] == first + once0;
  };
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  dp::autograd::mark_grad_zeroed(b);
  buffer.narrow(0, 16, 1).fill_(2.0);
  loss().backward();
  CHECK(first_added(2.0f));

  // The same edit, then another leaf on the buffer zeroed and marked after it (a second
  // optimizer's zero_grad): w's zeros are still not known, the edit is kept.
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  buffer.narrow(0, 16, 1).fill_(3.0);
  b.grad().zero_();
  dp::autograd::mark_grad_zeroed(b);
  loss().backward();
  CHECK(first_added(3.0f));

  // Known zeros are written over: a value put into the .grad without the API (a raw
  // pointer, which moves no version and no epoch: outside the contract of Note [Storage
  // versions]) is gone afterwards, where the addition would have kept it. Writes the
  // engine makes into another leaf's .grad on the same buffer (b's, by a backward of
  // its own) leave w's zeros known.
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  dp::autograd::mark_grad_zeroed(b);
  buffer.data<float>()[16] = 5.0f;
  loss().backward();
  CHECK(first_added(0.0f));
  buffer.zero_();
  dp::autograd::mark_grad_zeroed(w);
  dp::autograd::mark_grad_zeroed(b);
  dp::sum(b * 2.0).backward();
  CHECK(b.grad().to_vector() == F(static_cast<std::size_t>(out), 2.0f));
  buffer.data<float>()[16] = 5.0f;
  loss().backward();
  CHECK(first_added(0.0f));
  }
}

TEST_CASE("a .grad lent on one thread while other threads' graphs accumulate into the same leaf") {
  // Note [Gradients added in place] with Note [Concurrent accumulation]: the graph on
  // the leaf's own device multiplies by the leaf itself (its edge reaches the
  // accumulator: a sink, held through a long GEMM), the others through copies (their
  // gradients are added as they arrive, while the sink is out). Small integers keep every
  // sum exact in any order: .grad must be the sum of all of them.
  constexpr int kThreads = 4, kReps = 20;
  const std::int64_t in = 64, out = 48;
  std::vector<Tensor> xs;
  for (int t = 0; t < kThreads; ++t) {
    const std::int64_t rows = t == 0 ? 8192 : 16;
    F v(static_cast<std::size_t>(rows * in));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(t) * 3) % 5);
    xs.push_back(dp::from_vector(v, {rows, in}, dp::cpu(t)));
  }
  F want(static_cast<std::size_t>(out * in), 0.0f);  // d sum(x wᵀ) / dw: x's column sums in every row
  for (const Tensor& x : xs) {
    const F xv = x.to_vector();
    for (std::int64_t b = 0; b < x.size(0); ++b)
      for (std::int64_t j = 0; j < in; ++j)
        for (std::int64_t o = 0; o < out; ++o)
          want[static_cast<std::size_t>(o * in + j)] += xv[static_cast<std::size_t>(b * in + j)];
  }
  Tensor w = dp::zeros({out, in});
  w.set_requires_grad(true);
  w.set_grad(dp::zeros({out, in}));
  for (int rep = 0; rep < kReps; ++rep) {
    w.grad().zero_();
    dp::autograd::mark_grad_zeroed(w);
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        const Tensor wt = t == 0 ? w : w.to(dp::cpu(t));
        if (t != 0)
          while (!go.load()) std::this_thread::yield();
        const Tensor loss = dp::sum(dp::linear(xs[static_cast<std::size_t>(t)], wt, Tensor()));
        if (t == 0) go.store(true);  // the others run while thread 0's backward holds the sink
        loss.backward();
      });
    for (auto& th : threads) th.join();
    REQUIRE(w.grad().to_vector() == want);
  }
}

TEST_CASE("a second backward through a freed graph names retain_graph; retain_graph keeps it") {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = dp::sum(dp::exp(x) * x);
  y.backward();
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("retain_graph"), dp::Error);

  Tensor z = dp::sum(dp::square(x));
  x.grad().zero_();
  z.backward(Tensor(), /*retain_graph=*/true);
  z.backward(Tensor(), true);
  z.backward();  // the last may free it
  CHECK(x.grad().to_vector() == F{6, 12});
  CHECK_THROWS_WITH_AS(z.backward(), doctest::Contains("retain_graph"), dp::Error);

  // A freed subgraph reached from a new root also fails loudly.
  Tensor h = dp::exp(x);
  dp::sum(h).backward();
  CHECK_THROWS_WITH_AS(dp::sum(h * 2.0).backward(), doctest::Contains("retain_graph"), dp::Error);
}

TEST_CASE("backward on a non-scalar needs an explicit gradient") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = x * 2.0;
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("[3]"), dp::Error);
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("scalar"), dp::Error);
  y.backward(dp::from_vector(F{1, 10, 100}, {3}));
  CHECK(x.grad().to_vector() == F{2, 20, 200});
  CHECK_THROWS_WITH_AS(y.backward(dp::ones({2})), doctest::Contains("[2]"), dp::Error);
  CHECK_THROWS_AS(y.backward(dp::ones({3}, dp::cpu(1))), dp::Error);

  // A one-element non-0-d tensor is a scalar too.
  Tensor s = dp::sum(x, 0, true);
  CHECK(s.shape() == dp::Shape{1});
  x.grad().zero_();
  s.backward();
  CHECK(x.grad().to_vector() == F{1, 1, 1});

  Tensor c = dp::ones({1});
  CHECK_THROWS_WITH_AS(c.backward(), doctest::Contains("does not require grad"), dp::Error);
  CHECK_THROWS_AS(Tensor().backward(), dp::Error);
}

TEST_CASE("backward from a leaf accumulates the seed into its own .grad") {
  Tensor x = leaf({1, 2}, {2});
  Tensor seed = dp::from_vector(F{3, 4}, {2});
  x.backward(seed);
  CHECK(x.grad().to_vector() == F{3, 4});
  CHECK(x.grad().storage() != seed.storage());  // .grad never aliases the caller's seed
  seed.fill_(0);
  CHECK(x.grad().to_vector() == F{3, 4});
}

TEST_CASE("a diamond graph sums the gradients of both paths") {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor a = x * 2.0;
  Tensor b = dp::exp(x);
  Tensor y = dp::sum(a * b + a);  // y = Σ 2x e^x + 2x
  y.backward();
  auto g = x.grad().to_vector();
  const F xs{1, 2, 3};
  for (int i = 0; i < 3; ++i)
    CHECK(g[i] == doctest::Approx(2 * std::exp(xs[i]) * (1 + xs[i]) + 2).epsilon(1e-5));

  // x used twice by one op: mul(x, x) gives 2x; add(x, x) gives 2.
  Tensor u = leaf({1, -3}, {2});
  dp::sum(u * u + (u + u)).backward();
  CHECK(u.grad().to_vector() == F{4, -4});

  // Paths that meet only at the leaf, through different devices.
  Tensor v = leaf({1, 2}, {2});
  Tensor p1 = v.to(dp::cpu(1)) * 3.0;
  Tensor p2 = v * 5.0;
  dp::sum(p1.to(dp::cpu(0)) + p2).backward();
  CHECK(v.grad().to_vector() == F{8, 8});
}

TEST_CASE("gradients do not flow through detach or into tensors that need none") {
  Tensor x = leaf({1, 2}, {2});
  Tensor w = dp::from_vector(F{3, 4}, {2});
  dp::sum(x * w + x.detach() * x.detach()).backward();
  CHECK(x.grad().to_vector() == F{3, 4});
  CHECK_FALSE(w.grad().defined());
}

TEST_CASE("a long chain of 10k ops runs backward and frees without overflowing the stack") {
  auto run = [] {
    Tensor x = leaf({1, 2}, {2});
    Tensor one = dp::ones({2});
    Tensor y = x;
    for (int i = 0; i < 10000; ++i) y = (i % 2 == 0) ? y * one : y + 0.0;  // mul saves y: a deep chain
    dp::sum(y).backward();
    CHECK(x.grad().to_vector() == F{1, 1});

    Tensor z = x;
    for (int i = 0; i < 10000; ++i) z = z * one;
    // Dropped without a backward: the whole unreleased chain is destroyed here.
  };
  run();
  std::thread t(run);  // and on a worker thread, as DataParallel runs it
  t.join();
}

TEST_CASE("post-accumulate hooks fire once per accumulation, after .grad is updated") {
  Tensor x = leaf({1, 2}, {2});
  Tensor other = leaf({5}, {1});
  int calls = 0;
  std::vector<F> seen;
  dp::autograd::add_post_accumulate_hook(x, [&](const Tensor& t) {
    ++calls;
    CHECK(t.is_same(x));
    seen.push_back(t.grad().to_vector());
  });
  // x reaches the loss along three paths: still one accumulation per backward.
  dp::sum(x * 2.0 + x * x + dp::exp(x) * 0.0 + other).backward();
  CHECK(calls == 1);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0] == F{4, 6});
  dp::sum(x).backward();
  CHECK(calls == 2);
  CHECK(seen[1] == F{5, 7});
  // A backward that does not reach x does not fire its hook.
  dp::sum(other * 2.0).backward();
  CHECK(calls == 2);

  // One hook removed by its id, the other kept; a second removal does nothing.
  int second = 0;
  const std::uint64_t id = dp::autograd::add_post_accumulate_hook(x, [&second](const Tensor&) { ++second; });
  dp::sum(x).backward();
  CHECK(calls == 3);
  CHECK(second == 1);
  CHECK(dp::autograd::remove_post_accumulate_hook(x, id));
  CHECK_FALSE(dp::autograd::remove_post_accumulate_hook(x, id));
  CHECK_FALSE(dp::autograd::remove_post_accumulate_hook(other, id));
  CHECK_FALSE(dp::autograd::remove_post_accumulate_hook(Tensor(), id));
  dp::sum(x).backward();
  CHECK(calls == 4);
  CHECK(second == 1);

  dp::autograd::clear_post_accumulate_hooks(x);
  dp::sum(x).backward();
  CHECK(calls == 4);

  Tensor y = x * 2.0;
  CHECK_THROWS_AS(dp::autograd::add_post_accumulate_hook(y, [](const Tensor&) {}), dp::Error);
  CHECK_THROWS_AS(dp::autograd::add_post_accumulate_hook(Tensor(), [](const Tensor&) {}), dp::Error);
  // A leaf that does not require grad (a frozen parameter) takes a hook, which fires once
  // it does (Note [Frozen parameters]).
  Tensor frozen = dp::ones({1});
  int frozen_calls = 0;
  dp::autograd::add_post_accumulate_hook(frozen, [&frozen_calls](const Tensor&) { ++frozen_calls; });
  dp::sum(frozen * 2.0 + x).backward();
  CHECK(frozen_calls == 0);
  frozen.set_requires_grad(true);
  dp::sum(frozen * 2.0).backward();
  CHECK(frozen_calls == 1);
}

TEST_CASE("a node runs only after every path into it has delivered its gradient") {
  // y = (x * 2) feeds both a short path and a long one; y's node must see the sum.
  Tensor x = leaf({1}, {1});
  Tensor y = x * 2.0;
  Tensor longp = y;
  for (int i = 0; i < 50; ++i) longp = longp * 1.0;
  dp::sum(y + longp * 3.0).backward();
  CHECK(x.grad().item() == 8.0);
}

TEST_CASE("run_backward with several roots") {
  Tensor x = leaf({1, 2}, {2});
  Tensor a = dp::sum(x * 2.0), b = dp::sum(x * x);
  dp::autograd::run_backward({a, b}, {Tensor(), Tensor()}, false);
  CHECK(x.grad().to_vector() == F{4, 6});
  CHECK_THROWS_AS(dp::autograd::run_backward({a}, {}, false), dp::Error);
}

TEST_CASE("concurrent backwards from worker threads into one shared leaf all accumulate") {
  // DataParallel's shape: the master parameter on cpu(0) is copied to each worker's device;
  // every worker runs backward on its own graph, and all of them reach the same leaf.
  constexpr int kWorkers = 4, kReps = 25;
  constexpr std::int64_t kN = 1 << 16;  // large enough that a lost update would show
  Tensor w = dp::zeros({kN});
  w.set_requires_grad(true);
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < kReps; ++rep) dp::sum(w.to(dp::cpu(i + 1)) * 1.0).backward();
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE(w.grad().defined());
  F g = w.grad().to_vector();
  bool all = true;
  for (float v : g) all = all && v == static_cast<float>(kWorkers * kReps);
  CHECK(all);
}
