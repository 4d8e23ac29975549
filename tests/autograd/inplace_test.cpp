// Tests for in-place writes and autograd (Note [In-place writes and autograd] in
// src/tensor/tensor.cpp, Note [Saved tensors and in-place writes] in
// src/autograd/node.cpp): in-place writes into tensors that require grad are refused
// with grad mode on; a write into a tensor an op saved for backward makes that
// backward throw instead of computing a gradient from the new values; writes into
// tensors nothing saved stay allowed, as in PyTorch.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/nn/init.h"
#include "dp/nn/linear.h"
#include "dp/nn/module.h"
#include "dp/nn/sequential.h"
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

TEST_CASE("parameters flattened after a forward: a write then is still caught, no write is still right") {
  // Note [Saved tensors and moved parameters]: a module's first parameters() moves its
  // parameters into one flat buffer. A forward before that saved them in their old
  // storage; a write after it lands in the new one, and backward read the new values
  // without a word (x's gradient from twice the weight).
  auto run = [](bool write) {
    dp::Generator gen(4);
    dp::nn::Linear lin(3, 2, true, &gen);
    Tensor x = dp::from_vector(F{1, 2, 3, -1, 0, 2}, {2, 3});
    x.set_requires_grad(true);
    Tensor loss = lin.forward(x).sum();
    dp::nn::ParameterList params = lin.parameters();  // the first call: flattens
    if (write) {
      dp::NoGradGuard no_grad;
      params[0].mul_(2.0f);
    }
    loss.backward();
    return x.grad().to_vector();
  };
  dp::Generator gen(4);
  dp::nn::Linear plain(3, 2, true, &gen);
  (void)plain.parameters();  // flattened before the forward
  Tensor x = dp::from_vector(F{1, 2, 3, -1, 0, 2}, {2, 3});
  x.set_requires_grad(true);
  plain.forward(x).sum().backward();
  CHECK(run(false) == x.grad().to_vector());
  CHECK_THROWS_WITH_AS(run(true), doctest::Contains("LinearBackward"), dp::Error);
  // The message tells the move and quotes the versions of the storage that was written.
  CHECK_THROWS_WITH_AS(run(true), doctest::Contains("moved into another storage"), dp::Error);
  // A write into a storage that was not moved is told in that storage's versions.
  dp::Generator gen2(4);
  dp::nn::Linear kept(3, 2, true, &gen2);
  (void)kept.parameters();
  Tensor loss = kept.forward(x).sum();
  {
    dp::NoGradGuard no_grad;
    kept.parameters()[0].mul_(2.0f);
  }
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("its storage was at version"), dp::Error);
}

TEST_CASE("a flattening after a forward is not a write: many parameters, and a view left on the old storage") {
  // The flat buffer's own copies (one per parameter: more than a storage keeps exactly)
  // come before the version the saved tensors are asked from, so none reads as a write.
  dp::Generator gen(5);
  std::vector<std::shared_ptr<dp::nn::Linear>> layers;
  for (int i = 0; i < 40; ++i) layers.push_back(std::make_shared<dp::nn::Linear>(3, 3, true, &gen));
  auto net = std::make_shared<dp::nn::Sequential>();
  for (auto& l : layers) net->push_back(l);
  Tensor x = dp::from_vector(F{1, 2, 3, -1, 0, 2}, {2, 3});
  x.set_requires_grad(true);
  Tensor loss = dp::sum(dp::exp(dp::mul(net->forward(x), 0.01)));
  Tensor unwritten = dp::sum(net->forward(x));
  // A view of the first weight's old storage, taken before the flattening and saved by
  // an op after it: writes into the moved weight are not writes into it.
  Tensor old_view = layers[0]->parameters()[0].detach();
  CHECK(net->parameters().size() == 80);  // flattens all 80 into one buffer
  unwritten.backward();                   // nothing written since its forward
  Tensor side = dp::sum(dp::mul(old_view, x.narrow(0, 0, 1).expand({3, 3})));
  {
    dp::NoGradGuard no_grad;
    layers[0]->parameters()[0].add_(1.0f);  // the new storage: not old_view's
  }
  side.backward();
  CHECK(x.grad().defined());
  // The graph through the net saved every weight before the flattening: the write into
  // layer 0's weight is caught; without it, backward runs (checked by the test above).
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("LinearBackward"), dp::Error);
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

TEST_CASE("sub_, mul_, div_, masked_fill_ and relu_ give the out-of-place build's values and gradients, bit for bit") {
  // Note [In-place writes as out-of-place ops]. Each chain writes into an op's result
  // h = x * 1.5; its twin builds the same values out of place.
  const F xv{0.5f, -1.25f, 2.0f, 3.0f, -0.75f, 1.0f}, wv{1.5f, -0.5f, 0.25f}, dv{2.0f, -3.0f, 0.75f};
  const Tensor mask = dp::from_vector(std::vector<float>{0.0f, 1.0f, 0.0f}, {3});
  for (int which = 0; which < 7; ++which) {
    CAPTURE(which);
    Tensor x1 = leaf(xv, {2, 3}), w1 = leaf(wv, {3}), d1 = leaf(dv, {3});
    Tensor x2 = leaf(xv, {2, 3}), w2 = leaf(wv, {3}), d2 = leaf(dv, {3});
    Tensor h = dp::mul(x1, 1.5);
    Tensor y = dp::mul(x2, 1.5);
    switch (which) {
      case 0: h.sub_(w1, 0.5f); y = dp::add(y, dp::mul(w2, -0.5)); break;
      case 1: h.sub_(0.25); y = dp::add(y, -0.25); break;
      case 2: h.mul_(w1); y = dp::mul(y, w2); break;
      case 3: h.div_(d1); y = dp::div(y, d2); break;
      case 4: h.div_(3.0); y = dp::div(y, 3.0); break;
      case 5: h.masked_fill_(mask, -2.0); y = dp::masked_fill(y, mask, -2.0); break;
      case 6: h.relu_(); y = dp::relu(y); break;
    }
    // A second write on top, so that the first one's result is read by an op that saves it.
    h.mul_(w1);
    y = dp::mul(y, w2);
    CHECK(values(h) == values(y));
    dp::mul(h, h).sum().backward();
    dp::mul(y, y).sum().backward();
    CHECK(values(x1.grad()) == values(x2.grad()));
    CHECK(values(w1.grad()) == values(w2.grad()));
    if (which == 3) CHECK(values(d1.grad()) == values(d2.grad()));
  }
}

TEST_CASE("mul_ and div_ of another dtype compute in float32 and round once into a bfloat16 tensor") {
  const Tensor a = dp::from_vector(std::vector<float>{1.0f + 1.0f / 128, 3.0f, -7.0f}, {3}).to(dp::Dtype::BFloat16);
  const Tensor b = dp::from_vector(std::vector<float>{1.0f + 1.0f / 256 + 1.0f / 4096, 1.0f / 3, 0.1f}, {3});
  Tensor m = a.clone(), d = a.clone();
  m.mul_(b);
  d.div_(b);
  CHECK(m.dtype() == dp::Dtype::BFloat16);
  CHECK(values(m) == values(dp::mul(a.to(dp::Dtype::Float32), b).to(dp::Dtype::BFloat16)));
  CHECK(values(d) == values(dp::div(a.to(dp::Dtype::Float32), b).to(dp::Dtype::BFloat16)));
}

TEST_CASE("sub_, mul_, div_, masked_fill_ and relu_ refuse bad input before writing anything") {
  Tensor t = dp::from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2});
  const auto version = t.storage()->version();
  CHECK(error_of([&] { t.mul_(dp::ones({3})); }).find("[3]") != std::string::npos);
  CHECK(error_of([&] { t.div_(dp::ones({2, 2, 2})); }).find("[2, 2, 2]") != std::string::npos);
  CHECK(error_of([&] { t.masked_fill_(dp::ones({4}), 0.0); }).find("[4]") != std::string::npos);
  CHECK(error_of([&] { t.mul_(Tensor()); }).find("undefined") != std::string::npos);
  CHECK(error_of([&] { t.mul_(dp::ones({2}, dp::cpu(1))); }).find("cpu:1") != std::string::npos);
  Tensor i = dp::from_vector(std::vector<std::int64_t>{1, 2}, {2});
  CHECK(error_of([&] { i.div_(2.0); }).find("int64") != std::string::npos);
  CHECK(error_of([&] { i.relu_(); }).find("int64") != std::string::npos);
  CHECK(t.storage()->version() == version);
  CHECK(values(t) == F{1, 2, 3, 4});
  // A leaf that requires grad, with grad mode on: refused, as by every in-place write.
  Tensor w = leaf({1, -2}, {2});
  CHECK(error_of([&] { w.relu_(); }).find("leaf that requires grad") != std::string::npos);
  CHECK(error_of([&] { w.mul_(dp::ones({2})); }).find("leaf that requires grad") != std::string::npos);
  {
    dp::NoGradGuard no_grad;
    w.relu_();
    w.div_(2.0);
  }
  CHECK(values(w) == F{0.5f, 0.0f});
}
