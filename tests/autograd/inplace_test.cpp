// Tests for in-place writes and autograd (Note [In-place writes and autograd] in
// src/tensor/tensor.cpp, Note [Saved tensors and in-place writes] in
// src/autograd/node.cpp): in-place writes into tensors that require grad are refused
// with grad mode on; a write into a tensor an op saved for backward makes that
// backward throw instead of computing a gradient from the new values; writes into
// tensors nothing saved stay allowed, as in PyTorch.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/nn/init.h"
#include "dp/nn/linear.h"
#include "dp/optim/sgd.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

using F = std::vector<float>;
using dp::Tensor;

Tensor leaf(const F& v, const dp::Shape& s) {
  Tensor t = dp::from_vector(v, s);
  t.set_requires_grad(true);
  return t;
}

std::vector<float> values(const Tensor& t) { return t.to_vector(); }

// The message of the dp::Error that f throws; empty when it throws none.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dp::Error& e) {
    return e.what();
  }
  return {};
}

// Every in-place method, applied to t.
const std::vector<std::pair<const char*, std::function<void(Tensor&)>>>& writes() {
  static const std::vector<std::pair<const char*, std::function<void(Tensor&)>>> w{
      {"zero_", [](Tensor& t) { t.zero_(); }},
      {"fill_", [](Tensor& t) { t.fill_(2.0); }},
      {"add_(scalar)", [](Tensor& t) { t.add_(1.0); }},
      {"add_(tensor)", [](Tensor& t) { t.add_(dp::ones(t.shape()), 0.5f); }},
      {"mul_", [](Tensor& t) { t.mul_(2.0f); }},
      {"copy_", [](Tensor& t) { t.copy_(dp::ones(t.shape())); }},
  };
  return w;
}

}  // namespace

TEST_CASE("an in-place write into a leaf that requires grad is refused with grad mode on") {
  for (const auto& [name, write] : writes()) {
    CAPTURE(name);
    Tensor x = leaf({1, 2, 3}, {3});
    const auto version = x.storage()->version();
    CHECK_THROWS_WITH_AS(write(x), doctest::Contains("a leaf that requires grad"), dp::Error);
    CHECK(x.storage()->version() == version);  // refused before it wrote
    CHECK(values(x) == F{1, 2, 3});
    {
      dp::NoGradGuard no_grad;  // a hand-written update: allowed, as in PyTorch
      write(x);
    }
    CHECK(x.storage()->version() > version);
  }
}

TEST_CASE("an in-place write into a tensor made by an op is recorded: the out-of-place op's gradient") {
  // PyTorch's gradients of y = x * 3; <write into y>; (y * 2).sum(): the write's part of
  // the history (Note [In-place writes and autograd]).
  const std::vector<std::pair<const char*, float>> expected{
      {"zero_", 0.0f}, {"fill_", 0.0f}, {"add_(scalar)", 6.0f}, {"add_(tensor)", 6.0f}, {"mul_", 12.0f}, {"copy_", 0.0f}};
  for (std::size_t i = 0; i < writes().size(); ++i) {
    const auto& [name, write] = writes()[i];
    const std::string op = name;
    CAPTURE(op);
    REQUIRE(std::string(expected[i].first) == op);
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor y = x * 3.0;
    Tensor alias = y;  // another handle of the same tensor follows the new history
    write(y);
    CHECK(y.grad_fn() != nullptr);
    CHECK(alias.grad_fn() == y.grad_fn());
    (alias * 2.0).sum().backward();
    REQUIRE(x.grad().defined());
    const float g = expected[i].second;
    CHECK(values(x.grad()) == F{g, g, g});
  }
  // Chains of writes, and a write that reads another tensor that requires grad.
  Tensor x = leaf({1, 2}, {2}), w = leaf({5, 7}, {2});
  Tensor h = x * 2.0;
  h.mul_(3.0f);
  h.add_(w * 1.0, 2.0f);
  h.add_(1.0);
  h.sum().backward();
  CHECK(values(x.grad()) == F{6, 6});
  CHECK(values(w.grad()) == F{2, 2});
  // A tensor whose storage a view shares is refused: the view's history would miss the
  // write (PyTorch rewrites it; dp names the out-of-place op).
  Tensor base = leaf({1, 2, 3, 4}, {2, 2}) * 1.0;
  Tensor v = base.reshape({4});
  const auto version = base.storage()->version();
  CHECK_THROWS_WITH_AS(v.mul_(2.0f), doctest::Contains("whose storage other tensors share"), dp::Error);
  CHECK_THROWS_WITH_AS(base.mul_(2.0f), doctest::Contains("out of place"), dp::Error);
  CHECK(base.storage()->version() == version);  // refused before it wrote
  // Tensors that need no gradient are written as before, and record nothing.
  Tensor c = dp::from_vector(F{1, 2}, {2});
  c.mul_(3.0f);
  CHECK(values(c) == F{3, 6});
  CHECK(c.grad_fn() == nullptr);
  // Initialisers write under their own no-grad scope, as PyTorch's do.
  Tensor p = leaf({1, 2, 3, 4}, {2, 2});
  dp::nn::init::constant_(p, 0.5);
  dp::nn::init::zeros_(p);
  CHECK(values(p) == F{0, 0, 0, 0});
}

TEST_CASE("a write into a tensor a backward node saved is refused at once") {
  // PyTorch records it and that node's backward throws; dp refuses it before writing.
  Tensor x = leaf({0, 1}, {2});
  Tensor y = dp::exp(x);  // ExpBackward keeps y: a second tensor of y's storage
  CHECK_THROWS_WITH_AS(y.mul_(2.0f), doctest::Contains("one a backward node saved"), dp::Error);
  Tensor a = x * 1.0;
  Tensor sq = a * a;  // MulBackward keeps a
  const auto version = a.storage()->version();
  CHECK_THROWS_WITH_AS(a.add_(1.0), doctest::Contains("one a backward node saved"), dp::Error);
  CHECK(a.storage()->version() == version);
  sq.sum().backward();  // the graph is intact
  CHECK(values(x.grad()) == F{0, 2});
  x.set_grad(Tensor());
  // Multiplying by a scalar saves nothing: writing its result stays exact.
  Tensor z = x * 3.0;
  z.mul_(2.0f);
  z.sum().backward();
  CHECK(values(x.grad()) == F{6, 6});
}

TEST_CASE("a write of a source that requires grad is recorded; into a view it is refused") {
  // buf.copy_(x * 2); (buf + x).sum().backward() gave x.grad = 1 where PyTorch gives 3:
  // the write carried the values and dropped their gradient (Note [In-place writes and
  // autograd]).
  {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor buf = dp::zeros({3});
    buf.copy_(x * 2.0);
    CHECK(buf.requires_grad());
    (buf + x).sum().backward();
    CHECK(values(x.grad()) == F{3, 3, 3});
  }
  {
    Tensor x = leaf({1, 2, 3}, {3});
    Tensor acc = dp::zeros({3});
    acc.add_(x * 2.0, 0.5f);  // acc = 0.5 * 2x
    acc.add_(x);              // a leaf source
    (acc + x).sum().backward();
    CHECK(values(x.grad()) == F{3, 3, 3});
  }
  // A slice filled in place is a view of the buffer: refused, naming dp::cat, before it writes.
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor buf = dp::zeros({3});
  const auto version = buf.storage()->version();
  const std::string made = error_of([&] { buf.narrow(0, 1, 2).copy_((x * 2.0).narrow(0, 0, 2)); });
  CHECK(made.find("a source that requires grad") != std::string::npos);
  CHECK(made.find("NarrowBackward") != std::string::npos);
  CHECK(made.find("dp::cat") != std::string::npos);
  CHECK(buf.storage()->version() == version);
  CHECK(values(buf) == F{0, 0, 0});
  // Allowed where no gradient is asked for: a detached source, or grad mode off.
  buf.narrow(0, 1, 2).copy_((x * 2.0).detach().narrow(0, 0, 2));
  {
    dp::NoGradGuard no_grad;
    buf.narrow(0, 1, 2).copy_((x * 2.0).narrow(0, 0, 2));
  }
  CHECK_FALSE(buf.requires_grad());
  // The out-of-place build gives PyTorch's gradient.
  Tensor built = dp::cat({dp::zeros({1}), (x * 2.0).narrow(0, 0, 2)});
  (built + x).sum().backward();
  CHECK(values(x.grad()) == F{3, 3, 1});
}

TEST_CASE("a broadcast source's gradient is summed back to its shape, as PyTorch's") {
  // Note [Sources of in-place writes] in src/tensor/tensor.cpp; PyTorch 2.15 gives
  // b.grad = [32, 56], x.grad = [[6, 12], [10, 16]] for the first, b.grad = [4, 8] and
  // x.grad all zeros for the second.
  {
    Tensor x = leaf({1, 2, 3, 4}, {2, 2}), b = leaf({1, 2}, {2});
    Tensor u = x * 1.0;
    u.add_(b, 2.0f);
    CHECK(values(u) == F{3, 6, 5, 8});
    (u * u).sum().backward();
    CHECK(values(b.grad()) == F{32, 56});
    CHECK(values(x.grad()) == F{6, 12, 10, 16});
  }
  {
    Tensor x = leaf({1, 2, 3, 4}, {2, 2}), b = leaf({1, 2}, {2});
    Tensor u = x * 1.0;
    u.copy_(b);
    CHECK(values(u) == F{1, 2, 1, 2});
    (u * u).sum().backward();
    CHECK(values(b.grad()) == F{4, 8});
    CHECK(values(x.grad()) == F{0, 0, 0, 0});
  }
  {
    // A column and a scalar into a buffer that needs no gradient of its own.
    Tensor c = leaf({1, 2}, {2, 1}), s = leaf({3}, {});
    Tensor buf = dp::zeros({2, 3});
    buf.copy_(c * 2.0);
    buf.add_(s, -1.0f);
    CHECK(values(buf) == F{-1, -1, -1, 1, 1, 1});
    (buf * buf).sum().backward();
    CHECK(values(c.grad()) == F{-12, 12});  // 3 columns of 2 * buf * 2
    CHECK(values(s.grad()) == F{0});        // -(sum of 2 * buf)
  }
}

TEST_CASE("a write into a tensor saved for backward makes that backward throw, naming the node") {
  struct Case {
    const char* node;
    // Runs the forward on x (requires grad) and c (does not), returns the output
    // and the saved tensor the test writes into afterwards.
    std::function<std::pair<Tensor, Tensor>(const Tensor& x, const Tensor& c)> run;
  };
  const std::vector<Case> cases{
      {"ExpBackward", [](const Tensor& x, const Tensor&) { Tensor y = dp::exp(x); return std::pair{y, y}; }},
      {"TanhBackward", [](const Tensor& x, const Tensor&) { Tensor y = dp::tanh(x); return std::pair{y, y}; }},
      {"SigmoidBackward", [](const Tensor& x, const Tensor&) { Tensor y = dp::sigmoid(x); return std::pair{y, y}; }},
      {"ReluBackward", [](const Tensor& x, const Tensor&) { Tensor y = dp::relu(x); return std::pair{y, y}; }},
      {"MulBackward", [](const Tensor& x, const Tensor& c) { return std::pair{x * c, c}; }},
      {"DivBackward", [](const Tensor& x, const Tensor& c) { return std::pair{x / c, c}; }},
      {"MaximumBackward", [](const Tensor& x, const Tensor& c) { return std::pair{dp::maximum(x, c), c}; }},
      {"PowBackward", [](const Tensor& x, const Tensor&) {
         Tensor a = x * 1.0;  // x itself is a leaf: write into an op's result, saved by pow
         return std::pair{dp::pow(a, 3.0), a};
       }},
      {"LogBackward", [](const Tensor& x, const Tensor&) {
         Tensor a = dp::exp(x);
         return std::pair{dp::log(a), a};
       }},
      {"MatmulBackward", [](const Tensor& x, const Tensor& c) {
         return std::pair{dp::matmul(x.reshape({1, 4}), c.reshape({4, 1})), c};
       }},
      {"LinearBackward", [](const Tensor& x, const Tensor& c) {
         return std::pair{dp::linear(x.reshape({1, 4}), c.reshape({1, 4}), Tensor()), c};
       }},
      {"GeluBackward", [](const Tensor& x, const Tensor&) {
         Tensor a = x * 1.0;
         return std::pair{dp::nn::gelu(a), a};
       }},
      {"NativeLayerNormBackward", [](const Tensor& x, const Tensor& c) {
         return std::pair{dp::nn::layer_norm(x, {4}, c), c};  // the weight is saved
       }},
      {"LogSoftmaxBackward", [](const Tensor& x, const Tensor&) {
         Tensor y = dp::nn::log_softmax(x.reshape({1, 4}));
         return std::pair{y, y};
       }},
      {"WhereBackward", [](const Tensor& x, const Tensor& c) {
         Tensor cond = dp::gt(c, 2.5);
         return std::pair{dp::where(cond, x, 0.0), cond};
       }},
      {"GatherBackward", [](const Tensor& x, const Tensor&) {
         Tensor idx = dp::from_vector(std::vector<std::int64_t>{3, 0}, {2});
         return std::pair{dp::gather(x, 0, idx), idx};
       }},
      {"EmbeddingBackward", [](const Tensor& x, const Tensor&) {
         Tensor ids = dp::from_vector(std::vector<std::int64_t>{1, 0, 1}, {3});
         return std::pair{dp::nn::embedding(ids, x.reshape({2, 2})), ids};
       }},
      {"NllLossBackward", [](const Tensor& x, const Tensor&) {
         Tensor target = dp::from_vector(std::vector<std::int64_t>{1, 0}, {2});
         return std::pair{dp::nn::nll_loss(x.reshape({2, 2}), target, dp::nn::Reduction::Sum), target};
       }},
  };
  for (const Case& k : cases) {
    CAPTURE(k.node);
    Tensor x = leaf({0.5f, -1.0f, 2.0f, 1.5f}, {4});
    Tensor c = dp::from_vector(F{2, 3, 0.25f, 4}, {4});
    auto [y, saved] = k.run(x, c);
    REQUIRE(y.grad_fn() != nullptr);
    // The backward without a write works.
    {
      Tensor xr = leaf({0.5f, -1.0f, 2.0f, 1.5f}, {4});
      Tensor cr = dp::from_vector(F{2, 3, 0.25f, 4}, {4});
      k.run(xr, cr).first.sum().backward();
      CHECK(xr.grad().defined());
    }
    {
      dp::NoGradGuard no_grad;
      if (saved.dtype() == dp::Dtype::Int64 || saved.dtype() == dp::Dtype::Int32) {
        saved.fill_(0.0);
      } else {
        saved.add_(1.0);
      }
    }
    const std::string message = error_of([&] { y.sum().backward(); });
    CHECK(message.find(k.node) != std::string::npos);
    CHECK(message.find("modified by an in-place operation") != std::string::npos);
  }
}

TEST_CASE("a write through another view of a saved tensor's storage is seen") {
  Tensor x = leaf({0.5f, -1.0f, 2.0f, 1.5f}, {4});
  Tensor y = dp::exp(x);
  Tensor alias = y.detach().reshape({2, 2}).narrow(0, 1, 1);  // shares y's storage
  alias.mul_(2.0f);
  const std::string message = error_of([&] { y.sum().backward(); });
  CHECK(message.find("ExpBackward: saved tensor 0 (float32, 4 elements on cpu:0") != std::string::npos);
}

TEST_CASE("writes into tensors that no backward reads stay allowed and the gradients right") {
  // add, sub, sum and views save nothing: their inputs may be written afterwards, as in
  // PyTorch, and the gradients are those of the forward.
  Tensor x = leaf({1, 2, 3, 4}, {4});
  Tensor c = dp::from_vector(F{1, 1, 1, 1}, {4});
  Tensor y = (x + c) - c;
  Tensor s = dp::sum(y.reshape({2, 2}) * 2.0);
  c.add_(5.0);
  s.backward();
  CHECK(values(x.grad()) == F{2, 2, 2, 2});
  // x * c needs c only for x's gradient: with x alone requiring one, a write into x
  // (under no_grad) is not read by the backward.
  Tensor a = leaf({1, 2}, {2});
  Tensor b = dp::from_vector(F{3, 4}, {2});
  Tensor p = a * b;
  {
    dp::NoGradGuard no_grad;
    a.add_(10.0);
  }
  p.sum().backward();
  CHECK(values(a.grad()) == F{3, 4});
}

TEST_CASE("an optimizer step between a forward and its backward is an error, not a stale gradient") {
  dp::Generator gen(3);
  dp::nn::Linear lin(3, 2, true, &gen);
  dp::optim::SGD opt(lin.parameters(), dp::optim::SGDOptions{.lr = 0.1});
  Tensor x = dp::from_vector(F{1, 2, 3, -1, 0, 2}, {2, 3});
  x.set_requires_grad(true);  // so that the weight is saved for x's gradient
  Tensor loss = lin.forward(x).sum();
  lin.forward(x).sum().backward();  // another step's backward fills .grad
  opt.step();                       // writes the weight that `loss` saved
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("LinearBackward"), dp::Error);
  // After zero_grad and a fresh forward, training goes on.
  opt.zero_grad();
  lin.forward(x).sum().backward();
  CHECK(lin.parameters()[0].grad().defined());
}

TEST_CASE("retain_graph: a write between two backwards is caught by the second") {
  Tensor x = leaf({0.5f, 1.0f}, {2});
  Tensor y = dp::exp(x);
  Tensor s = y.sum();
  s.backward(Tensor(), /*retain_graph=*/true);
  const F first = values(x.grad());
  {
    dp::NoGradGuard no_grad;
    y.mul_(2.0f);
  }
  CHECK_THROWS_AS(s.backward(), dp::Error);
  CHECK(values(x.grad()) == first);  // nothing accumulated by the refused backward
}
