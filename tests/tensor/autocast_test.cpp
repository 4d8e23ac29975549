// tests/tensor/autocast_test.cpp — Note [Autocast op policy]: which dtype each op computes
// in inside a dp::amp::autocast scope, master weights staying float32, nesting, and
// backward running in the forward's dtypes.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../test_errors.h"
#include "dp/autograd/node.h"
#include "dp/dp.h"

namespace {

using dp::Dtype;

dp::Tensor param(const dp::Shape& shape, std::uint64_t seed) {
  dp::Generator gen(seed);
  return dp::randn(shape, gen).set_requires_grad(true);
}

float round_bf16(float f) { return static_cast<float>(dp::BFloat16(f)); }

}  // namespace

TEST_CASE("autocast scopes nest, restore and refuse a dtype ops cannot run in") {
  CHECK_FALSE(dp::amp::is_autocast_enabled());
  {
    dp::amp::autocast outer(Dtype::BFloat16);
    CHECK(dp::amp::is_autocast_enabled());
    CHECK(dp::amp::get_autocast_dtype() == Dtype::BFloat16);
    {
      dp::amp::autocast inner(Dtype::Float16);
      CHECK(dp::amp::get_autocast_dtype() == Dtype::Float16);
      {
        dp::amp::autocast off(Dtype::BFloat16, false);
        CHECK_FALSE(dp::amp::is_autocast_enabled());
      }
      CHECK(dp::amp::is_autocast_enabled());
    }
    CHECK(dp::amp::get_autocast_dtype() == Dtype::BFloat16);
  }
  CHECK_FALSE(dp::amp::is_autocast_enabled());
  CHECK(dp_test::throws_with([] { dp::amp::autocast bad(Dtype::Int64); },
                             {"autocast: expected dtype bfloat16 or float16", "got int64"}));
  CHECK(dp_test::throws_with([] { dp::amp::autocast bad(Dtype::Float32); }, {"got float32"}));
  CHECK_FALSE(dp::amp::is_autocast_enabled());
}

TEST_CASE("inside autocast, products run in the low dtype and the float32 list in float32") {
  for (Dtype low : {Dtype::BFloat16, Dtype::Float16}) {
    CAPTURE(std::string(dp::dtype_name(low)));
    const dp::Tensor x = param({4, 6}, 1), w = param({5, 6}, 2), b = param({5}, 3);
    dp::amp::autocast guard(low);
    const dp::Tensor y = dp::linear(x, w, b);
    CHECK(y.dtype() == low);
    CHECK(dp::matmul(x, w.t()).dtype() == low);
    CHECK(dp::matmul(x.reshape({2, 2, 6}), w.t()).dtype() == low);
    const dp::Tensor img = param({2, 3, 6, 6}, 4), k = param({4, 3, 3, 3}, 5);
    const dp::Tensor c = dp::nn::conv2d(img, k, dp::Tensor(), 1, 1);
    CHECK(c.dtype() == low);
    CHECK(dp::nn::max_pool2d(c, 2, 2).dtype() == low);                  // the input's dtype
    // batch_norm is on neither list (PyTorch's policy): the input's dtype out, statistics
    // in float32 — the float32 op on the input widened, its output rounded once.
    const dp::Tensor gamma = param({4}, 9), beta = param({4}, 10);
    const dp::Tensor bn = dp::nn::batch_norm(c, gamma, beta, {}, {}, true, 0.1, 1e-5);
    CHECK(bn.dtype() == low);
    {
      dp::amp::autocast off(low, false);
      const dp::Tensor want = dp::nn::batch_norm(c.to(Dtype::Float32), gamma, beta, {}, {}, true, 0.1, 1e-5).to(low);
      CHECK(dp::equal(bn, want));
    }
    dp::sum(bn).backward();  // the parameters' gradients float32, the convolution's input reached
    CHECK(gamma.grad().dtype() == Dtype::Float32);
    CHECK(beta.grad().dtype() == Dtype::Float32);
    CHECK(k.grad().dtype() == Dtype::Float32);
    CHECK(dp::nn::batch_norm(img, gamma.narrow(0, 0, 3), {}, {}, {}, true, 0.1, 1e-5).dtype() == Dtype::Float32);
    CHECK(dp::relu(y).dtype() == low);
    CHECK(dp::nn::log_softmax(y).dtype() == Dtype::Float32);
    CHECK(dp::nn::softmax(y, 1).dtype() == Dtype::Float32);
    CHECK(dp::nn::layer_norm(y, {5}, {}, {}, 1e-5).dtype() == Dtype::Float32);
    CHECK(dp::exp(y).dtype() == Dtype::Float32);
    CHECK(dp::sum(y).dtype() == Dtype::Float32);
    CHECK(dp::mean(y, 0).dtype() == Dtype::Float32);
    const dp::Tensor labels = dp::from_vector(std::vector<std::int64_t>{0, 4, 2, 1}, {4});
    CHECK(dp::nn::cross_entropy(y, labels).dtype() == Dtype::Float32);
    CHECK(dp::nn::mse_loss(y, dp::zeros({4, 5})).dtype() == Dtype::Float32);
    CHECK(dp::add(y, x.narrow(1, 0, 5)).dtype() == Dtype::Float32);     // mixed: the wider
  }
}

TEST_CASE("autocast's linear is the product of the rounded operands, rounded; master weights get float32 gradients") {
  const dp::Tensor x = param({3, 7}, 6), w = param({4, 7}, 7), b = param({4}, 8);
  dp::Tensor y, loss;
  {
    dp::amp::autocast guard;
    y = dp::linear(x, w, b);
    loss = dp::nn::cross_entropy(y, dp::from_vector(std::vector<std::int64_t>{1, 0, 3}, {3}));
  }
  // The definition, spelled out without autocast.
  const dp::Tensor xb = x.detach().to(Dtype::BFloat16), wb = w.detach().to(Dtype::BFloat16);
  const dp::Tensor want = dp::add(dp::matmul(xb, wb.t()), b.detach().to(Dtype::BFloat16));
  // Equal, or (where the two products add in different orders) one bfloat16 ulp apart.
  const std::vector<float> got = y.to_vector(), ref = want.to_vector();
  for (std::size_t i = 0; i < got.size(); ++i) {
    int e = 0;
    std::frexp(ref[i], &e);
    CHECK(std::fabs(got[i] - ref[i]) <= std::ldexp(1.0f, e - 8));
  }
  CHECK(loss.dtype() == Dtype::Float32);
  loss.backward();  // outside the scope, as PyTorch recommends; inside gives the same
  for (const dp::Tensor& p : {x, w, b}) {
    REQUIRE(p.grad().defined());
    CHECK(p.grad().dtype() == Dtype::Float32);  // the parameter's dtype
    // Each gradient came through a bfloat16 op: its values are bfloat16 values.
    for (float g : p.grad().to_vector()) CHECK(g == round_bf16(g));
  }
}

TEST_CASE("backward computes in the forward's dtypes even when called inside the scope") {
  auto grads = [](bool backward_inside) {
    // The bias's gradient is the column sum of a bfloat16 gradient (the add's backward):
    // under autocast a sum would run in float32 and not round to bfloat16.
    const dp::Tensor x = param({64, 7}, 9), w = param({4, 7}, 10), b = param({4}, 12);
    dp::Tensor loss;
    {
      dp::amp::autocast guard;
      loss = dp::sum(dp::exp(dp::linear(x, w, b)));
      if (backward_inside) loss.backward();
    }
    if (!backward_inside) loss.backward();
    for (float g : b.grad().to_vector()) CHECK(g == round_bf16(g));
    return std::vector<std::vector<float>>{x.grad().to_vector(), w.grad().to_vector(), b.grad().to_vector()};
  };
  CHECK(grads(true) == grads(false));
  // What a backward function sees: autocast off, whatever the caller's scope.
  const dp::Tensor x = param({3}, 13);
  dp::Tensor y = dp::mul(x, 2.0).detach();
  bool seen_enabled = true;
  dp::autograd::record("Probe", {x}, y, {}, [&seen_enabled](const std::vector<dp::Tensor>& g) {
    seen_enabled = dp::amp::is_autocast_enabled();
    return std::vector<dp::Tensor>{g[0]};
  });
  {
    dp::amp::autocast guard;
    dp::sum(y).backward();
    CHECK(dp::amp::is_autocast_enabled());  // restored after backward
  }
  CHECK_FALSE(seen_enabled);
}

TEST_CASE("a network under autocast: forward in the low dtype, float32 loss, float32 gradients") {
  dp::Generator gen(11);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(1, 4, 3).padding(1), &gen));
  net->push_back(std::make_shared<dp::nn::BatchNorm2d>(4));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::MaxPool2d>(2));
  net->push_back(std::make_shared<dp::nn::Flatten>());
  net->push_back(std::make_shared<dp::nn::Linear>(4 * 4 * 4, 10, true, &gen));
  const dp::Tensor x = dp::randn({5, 1, 8, 8}, gen);
  const dp::Tensor y = dp::from_vector(std::vector<std::int64_t>{1, 2, 3, 4, 5}, {5});
  dp::Tensor loss32 = dp::nn::cross_entropy(net->forward(x), y);
  dp::Tensor out, loss;
  {
    dp::amp::autocast guard;
    out = net->forward(x);
    loss = dp::nn::cross_entropy(out, y);
  }
  CHECK(out.dtype() == Dtype::BFloat16);
  CHECK(loss.dtype() == Dtype::Float32);
  // bfloat16 keeps 8 bits: the loss agrees with float32's to a few parts in a hundred.
  CHECK(std::abs(loss.item<float>() - loss32.item<float>()) < 0.05 * std::abs(loss32.item<float>()) + 0.02);
  loss.backward();
  for (const auto& [name, p] : net->named_parameters()) {
    CAPTURE(name);
    CHECK(p.dtype() == Dtype::Float32);
    REQUIRE(p.grad().defined());
    CHECK(p.grad().dtype() == Dtype::Float32);
  }
}
