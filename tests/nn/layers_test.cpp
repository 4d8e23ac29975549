// Tests for the parameterised and parameter-free layers: Linear, Conv2d, ReLU, pooling
// layers and Flatten — forward against host references, parameter registration and
// names, gradients reaching the parameters, errors.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>

#include "../autograd/gradcheck.h"
#include "dp/nn/activation.h"
#include "dp/nn/conv2d.h"
#include "dp/nn/flatten.h"
#include "dp/nn/functional.h"
#include "dp/nn/linear.h"
#include "dp/nn/pooling.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using dp_test::uniform_values;
using nn_test::F;
using nn_test::max_diff;
using nn_test::throws_with;
namespace nn = dp::nn;

TEST_CASE_TEMPLATE("Linear computes x·Wᵀ + b and registers weight and bias", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  auto fc = std::make_shared<nn::Linear>(4, 3);
  fc->to(dev);
  auto named = fc->named_parameters();
  REQUIRE(named.size() == 2);
  CHECK(named[0].first == "weight");
  CHECK(named[0].second.shape() == dp::Shape{3, 4});
  CHECK(named[1].first == "bias");
  CHECK(named[1].second.shape() == dp::Shape{3});
  CHECK(fc->name() == "Linear(in_features=4, out_features=3, bias=true)");

  F x = uniform_values(2 * 4, -1, 1, 1);
  F w = fc->weight().to_vector(), b = fc->bias().to_vector();
  dp::Tensor y = (*fc)(dp::from_vector(x, {2, 4}, dev));
  CHECK(y.shape() == dp::Shape{2, 3});
  CHECK(y.device() == dev);
  F ref(6);
  for (int n = 0; n < 2; ++n)
    for (int o = 0; o < 3; ++o) {
      double acc = b[o];
      for (int i = 0; i < 4; ++i) acc += double(x[n * 4 + i]) * w[o * 4 + i];
      ref[n * 3 + o] = float(acc);
    }
  CHECK(max_diff(y.to_vector(), ref) < 1e-5);

  // Gradients land in the parameters' .grad.
  dp::sum(y).backward();
  F gb = fc->bias().grad().to_vector();
  for (float v : gb) CHECK(v == doctest::Approx(2.0));
  F gw = fc->weight().grad().to_vector();
  for (int o = 0; o < 3; ++o)
    for (int i = 0; i < 4; ++i) CHECK(gw[o * 4 + i] == doctest::Approx(x[i] + x[4 + i]).epsilon(1e-5));
}

TEST_CASE("Linear without bias, and its errors") {
  auto fc = std::make_shared<nn::Linear>(5, 2, false);
  CHECK(fc->named_parameters().size() == 1);
  CHECK_FALSE(fc->bias().defined());
  CHECK(fc->forward(dp::zeros({3, 5})).shape() == dp::Shape{3, 2});
  CHECK(throws_with([&] { fc->forward(dp::zeros({3, 4})); }, {"in=5", "[3, 4]"}));
  CHECK(throws_with([&] { fc->forward(dp::zeros({3, 5, 1, 1})); }, {"Flatten"}));
  CHECK_THROWS_AS(nn::Linear(0, 3), dp::Error);
}

TEST_CASE_TEMPLATE("Conv2d forward equals the functional op on its parameters", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  auto conv = std::make_shared<nn::Conv2d>(2, 4, 3, 2, 1);
  conv->to(dev);
  CHECK(conv->weight().shape() == dp::Shape{4, 2, 3, 3});
  CHECK(conv->bias().shape() == dp::Shape{4});
  CHECK(conv->name() == "Conv2d(2, 4, kernel_size=3, stride=2, padding=1, bias=true)");
  F x = uniform_values(2 * 2 * 7 * 7, -1, 1, 2);
  F w = conv->weight().to_vector(), b = conv->bias().to_vector();
  dp::Tensor y = (*conv)(dp::from_vector(x, {2, 2, 7, 7}, dev));
  CHECK(y.shape() == dp::Shape{2, 4, 4, 4});
  CHECK(max_diff(y.to_vector(), nn_test::ref_conv2d(x, w, &b, 2, 2, 7, 7, 4, 3, 3, 2, 1)) < 1e-5);
  dp::sum(y).backward();
  CHECK(conv->weight().grad().defined());
  for (float v : conv->bias().grad().to_vector()) CHECK(v == doctest::Approx(2 * 16));
  CHECK_THROWS_AS(nn::Conv2d(1, 1, 0), dp::Error);
  CHECK(throws_with([&] { (*conv)(dp::zeros({1, 3, 7, 7}, dev)); }, {"C=2"}));
}

TEST_CASE("Conv2d and Linear initialise reproducibly from a generator") {
  dp::Generator g1(7), g2(7);
  nn::Conv2d a(3, 4, 3, 1, 0, true, &g1), b(3, 4, 3, 1, 0, true, &g2);
  CHECK(a.weight().to_vector() == b.weight().to_vector());
  CHECK(a.bias().to_vector() == b.bias().to_vector());
  nn::Linear c(10, 5, true, &g1), d(10, 5, true, &g1);
  CHECK(c.weight().to_vector() != d.weight().to_vector());  // the stream moved on
}

TEST_CASE_TEMPLATE("ReLU, Sigmoid, Tanh, Flatten and pooling layers", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  F x = uniform_values(2 * 3 * 4 * 4, -1, 1, 3);
  dp::Tensor xt = dp::from_vector(x, {2, 3, 4, 4}, dev);
  F r = nn::ReLU()(xt).to_vector();
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(r[i] == std::max(x[i], 0.0f));
  F s = nn::Sigmoid()(xt).to_vector(), t = nn::Tanh()(xt).to_vector();
  for (std::size_t i = 0; i < x.size(); ++i) {
    CHECK(s[i] == doctest::Approx(1 / (1 + std::exp(-x[i]))).epsilon(1e-5));
    CHECK(t[i] == doctest::Approx(std::tanh(x[i])).epsilon(1e-5));
  }
  CHECK(nn::Flatten()(xt).shape() == dp::Shape{2, 48});
  CHECK(nn::Flatten(2)(xt).shape() == dp::Shape{2, 3, 16});
  CHECK(nn::Flatten()(xt).to_vector() == x);

  CHECK(max_diff(nn::MaxPool2d(2)(xt).to_vector(), nn_test::ref_pool2d(x, 6, 4, 4, 2, 2, 0, true)) == 0);
  CHECK(max_diff(nn::AvgPool2d(3, 1, 1)(xt).to_vector(), nn_test::ref_pool2d(x, 6, 4, 4, 3, 1, 1, false)) < 1e-6);
  dp::Tensor gap = nn::AdaptiveAvgPool2d(1)(xt);
  CHECK(gap.shape() == dp::Shape{2, 3, 1, 1});
  CHECK(gap.to_vector()[0] == doctest::Approx(nn_test::ref_pool2d(x, 6, 4, 4, 4, 4, 0, false)[0]));
  CHECK(throws_with([] { nn::AdaptiveAvgPool2d(0); }, {"output size >= 1", "0x0"}));
  CHECK(throws_with([] { nn::AdaptiveAvgPool2d(1, -3); }, {"output size >= 1", "1x-3"}));
  CHECK_THROWS_AS(nn::MaxPool2d(2, 2, 2), dp::Error);
  CHECK(nn::MaxPool2d(2).name() == "MaxPool2d(kernel_size=2, stride=2, padding=0)");
}
