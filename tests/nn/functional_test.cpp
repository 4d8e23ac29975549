// Tests for dp/nn/functional.h: every op's forward against a naive host reference,
// its backward against central differences, and the errors for bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../autograd/gradcheck.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using dp_test::away_from_zero;
using dp_test::distinct_values;
using dp_test::gradcheck;
using dp_test::GradcheckOptions;
using dp_test::uniform_values;
using nn_test::F;
using nn_test::I;
using nn_test::max_diff;
using nn_test::throws_with;
namespace nn = dp::nn;

// ---- conv2d ---------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("conv2d matches a naive convolution", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  struct Cfg { std::int64_t N, C, H, W, K, R, stride, pad; bool bias; };
  for (Cfg c : {Cfg{2, 3, 7, 6, 4, 3, 1, 0, true}, Cfg{1, 2, 8, 8, 3, 3, 2, 1, false},
                Cfg{3, 1, 5, 5, 2, 1, 1, 0, true}, Cfg{2, 2, 6, 7, 5, 5, 3, 2, true}}) {
    CAPTURE(c.stride);
    CAPTURE(c.pad);
    F x = uniform_values(c.N * c.C * c.H * c.W, -1, 1, 1);
    F w = uniform_values(c.K * c.C * c.R * c.R, -1, 1, 2);
    F b = uniform_values(c.K, -1, 1, 3);
    std::int64_t P, Q;
    F ref = nn_test::ref_conv2d(x, w, c.bias ? &b : nullptr, c.N, c.C, c.H, c.W, c.K, c.R, c.R,
                                c.stride, c.pad, &P, &Q);
    dp::Tensor y = nn::conv2d(dp::from_vector(x, {c.N, c.C, c.H, c.W}, dev),
                              dp::from_vector(w, {c.K, c.C, c.R, c.R}, dev),
                              c.bias ? dp::from_vector(b, {c.K}, dev) : dp::Tensor(), c.stride, c.pad);
    CHECK(y.shape() == dp::Shape{c.N, c.K, P, Q});
    CHECK(y.device() == dev);
    CHECK(max_diff(y.to_vector(), ref) < 1e-4);
  }
}

TEST_CASE_TEMPLATE("conv2d gradients match central differences", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  dp::Tensor x = dp::from_vector(uniform_values(2 * 2 * 5 * 5, -1, 1, 4), {2, 2, 5, 5}, dev);
  dp::Tensor w = dp::from_vector(uniform_values(3 * 2 * 3 * 3, -1, 1, 5), {3, 2, 3, 3}, dev);
  dp::Tensor b = dp::from_vector(uniform_values(3, -1, 1, 6), {3}, dev);
  GradcheckOptions opt{.eps = 1e-2, .atol = 3e-3, .rtol = 1e-2};
  gradcheck([](const auto& in) { return nn::conv2d(in[0], in[1], in[2], 2, 1); }, {x, w, b}, opt);
  gradcheck([](const auto& in) { return nn::conv2d(in[0], in[1], dp::Tensor(), 1, 0); }, {x, w}, opt);
}

TEST_CASE("conv2d gives gradients only to inputs that need one") {
  dp::Tensor x = dp::from_vector(uniform_values(1 * 2 * 4 * 4, -1, 1, 7), {1, 2, 4, 4});
  dp::Tensor w = dp::from_vector(uniform_values(2 * 2 * 3 * 3, -1, 1, 8), {2, 2, 3, 3});
  w.set_requires_grad(true);
  dp::sum(nn::conv2d(x, w)).backward();
  CHECK_FALSE(x.grad().defined());
  REQUIRE(w.grad().defined());
  CHECK(w.grad().shape() == w.shape());
}

TEST_CASE_TEMPLATE("conv2d_relu: relu(conv2d) bit for bit, forward and every gradient", D, DP_NN_TEST_DEVICES) {
  // Note [Convolution + ReLU]: the fused op replaces the pair, so it must compute the
  // pair's bits, its gradients included (the mask is the output > 0 in both).
  const dp::Device dev = D::device();
  struct Cfg { std::int64_t N, C, H, K, stride, pad; bool bias; };
  for (Cfg c : {Cfg{5, 1, 28, 32, 1, 1, true}, Cfg{3, 32, 14, 64, 1, 1, true}, Cfg{2, 3, 9, 4, 2, 0, false}}) {
    CAPTURE(c.C);
    auto make = [&](std::uint64_t seed, dp::Shape shape) {
      std::int64_t n = 1;
      for (auto d : shape) n *= d;
      dp::Tensor t = dp::from_vector(uniform_values(n, -1, 1, seed), shape, dev);
      t.set_requires_grad(true);
      return t;
    };
    dp::Tensor x = make(20, {c.N, c.C, c.H, c.H}), w = make(21, {c.K, c.C, 3, 3});
    dp::Tensor b = c.bias ? make(22, {c.K}) : dp::Tensor();
    dp::Tensor x2 = make(20, {c.N, c.C, c.H, c.H}), w2 = make(21, {c.K, c.C, 3, 3});
    dp::Tensor b2 = c.bias ? make(22, {c.K}) : dp::Tensor();
    dp::Tensor y = dp::relu(nn::conv2d(x, w, b, c.stride, c.pad));
    dp::Tensor y2 = nn::conv2d_relu(x2, w2, b2, c.stride, c.pad);
    REQUIRE(y.shape() == y2.shape());
    CHECK(nn_test::bitwise_equal(y.to_vector(), y2.to_vector()));
    // A weighted sum, so that every output's gradient differs.
    dp::Tensor gw = dp::from_vector(uniform_values(y.numel(), -1, 1, 23), y.shape(), dev);
    dp::sum(dp::mul(y, gw)).backward();
    dp::sum(dp::mul(y2, gw)).backward();
    CHECK(nn_test::bitwise_equal(x.grad().to_vector(), x2.grad().to_vector()));
    CHECK(nn_test::bitwise_equal(w.grad().to_vector(), w2.grad().to_vector()));
    if (c.bias) CHECK(nn_test::bitwise_equal(b.grad().to_vector(), b2.grad().to_vector()));
  }
}

TEST_CASE_TEMPLATE("linear_relu: relu(linear) bit for bit, forward and every gradient, NaN included", D,
                   DP_NN_TEST_DEVICES) {
  // Note [Linear epilogue]: the fused op replaces the pair, so it must compute the
  // pair's bits and gradients (the mask is the output > 0 in both). The shapes split
  // the GEMM by rows and by columns; k = 0 gives relu(bias); a NaN must propagate.
  const dp::Device dev = D::device();
  struct Cfg { std::int64_t m, k, n; bool bias; int nan_at; };
  for (Cfg c : {Cfg{64, 784, 256, true, -1}, Cfg{256, 64, 10, true, 5}, Cfg{7, 33, 300, false, 0},
                Cfg{5, 0, 4, true, -1}, Cfg{0, 6, 3, true, -1}}) {
    CAPTURE(c.m);
    CAPTURE(c.k);
    CAPTURE(c.n);
    auto make = [&](std::uint64_t seed, dp::Shape shape, int nan_at = -1) {
      std::int64_t n = 1;
      for (auto d : shape) n *= d;
      auto v = uniform_values(n, -1, 1, seed);
      if (nan_at >= 0 && nan_at < n) v[static_cast<std::size_t>(nan_at)] = std::numeric_limits<float>::quiet_NaN();
      dp::Tensor t = dp::from_vector(v, shape, dev);
      t.set_requires_grad(true);
      return t;
    };
    dp::Tensor x = make(30, {c.m, c.k}, c.nan_at), w = make(31, {c.n, c.k});
    dp::Tensor b = c.bias ? make(32, {c.n}) : dp::Tensor();
    dp::Tensor x2 = make(30, {c.m, c.k}, c.nan_at), w2 = make(31, {c.n, c.k});
    dp::Tensor b2 = c.bias ? make(32, {c.n}) : dp::Tensor();
    dp::Tensor y = dp::relu(dp::linear(x, w, b));
    dp::Tensor y2 = dp::linear_relu(x2, w2, b2);
    REQUIRE(y.shape() == y2.shape());
    const auto yv = y2.to_vector();
    CHECK(nn_test::bitwise_equal(y.to_vector(), yv));
    if (c.nan_at >= 0) CHECK(std::any_of(yv.begin(), yv.end(), [](float v) { return std::isnan(v); }));
    dp::Tensor gw = dp::from_vector(uniform_values(y.numel(), -1, 1, 33), y.shape(), dev);
    dp::sum(dp::mul(y, gw)).backward();
    dp::sum(dp::mul(y2, gw)).backward();
    REQUIRE(x2.grad().defined());
    CHECK(nn_test::bitwise_equal(x.grad().to_vector(), x2.grad().to_vector()));
    CHECK(nn_test::bitwise_equal(w.grad().to_vector(), w2.grad().to_vector()));
    if (c.bias) CHECK(nn_test::bitwise_equal(b.grad().to_vector(), b2.grad().to_vector()));
  }
}

TEST_CASE_TEMPLATE("a Linear after linear_relu masks its input gradient itself: the unfused bits", D,
                   DP_NN_TEST_DEVICES) {
  // Note [ReLU mask in the input gradient]: linear_relu -> linear and linear_relu ->
  // linear_relu against relu(linear) -> linear, every gradient bit for bit; also when
  // the ReLU's output feeds a second path (its gradient is a sum: the note is missed and
  // the mask applied as before) and with a NaN in the input.
  const dp::Device dev = D::device();
  for (int variant = 0; variant < 4; ++variant) {  // plain, second path, NaN in x, linear_relu on top
    CAPTURE(variant);
    const std::int64_t m = 96, k = 200, h = 300, n = 40;
    auto make = [&](std::uint64_t seed, dp::Shape shape, bool nan = false) {
      std::int64_t count = 1;
      for (auto d : shape) count *= d;
      auto v = uniform_values(count, -1, 1, seed);
      if (nan) v[static_cast<std::size_t>(3 * shape[1] + 1)] = std::numeric_limits<float>::quiet_NaN();
      dp::Tensor t = dp::from_vector(v, shape, dev);
      t.set_requires_grad(true);
      return t;
    };
    struct Net { dp::Tensor x, w1, b1, w2, b2; };
    auto net = [&] {
      return Net{make(40, {m, k}, variant == 2), make(41, {h, k}), make(42, {h}), make(43, {n, h}), make(44, {n})};
    };
    Net a = net(), f = net();
    const dp::Tensor gout = dp::from_vector(uniform_values(m * n, -1, 1, 45), {m, n}, dev);
    const dp::Tensor gside = dp::from_vector(uniform_values(m * h, -1, 1, 46), {m, h}, dev);
    auto loss = [&](const Net& p, bool fused) {
      const dp::Tensor hidden = fused ? dp::linear_relu(p.x, p.w1, p.b1) : dp::relu(dp::linear(p.x, p.w1, p.b1));
      const dp::Tensor out = variant == 3 ? (fused ? dp::linear_relu(hidden, p.w2, p.b2)
                                                   : dp::relu(dp::linear(hidden, p.w2, p.b2)))
                                          : dp::linear(hidden, p.w2, p.b2);
      dp::Tensor l = dp::sum(dp::mul(out, gout));
      if (variant == 1) l = l + dp::sum(dp::mul(hidden, gside));
      return l;
    };
    loss(a, false).backward();
    loss(f, true).backward();
    for (auto [u, v] : {std::pair{a.x, f.x}, {a.w1, f.w1}, {a.b1, f.b1}, {a.w2, f.w2}, {a.b2, f.b2}}) {
      REQUIRE(v.grad().defined());
      CHECK(nn_test::bitwise_equal(u.grad().to_vector(), v.grad().to_vector()));
    }
  }
}

TEST_CASE("linear_relu rejects what linear rejects, naming itself") {
  dp::Tensor x = dp::zeros({4, 3}), w = dp::zeros({5, 3});
  CHECK_THROWS_WITH_AS(dp::linear_relu(x, dp::zeros({5, 2}), dp::Tensor()), doctest::Contains("linear_relu"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(dp::linear_relu(x, dp::zeros({5, 2}), dp::Tensor()), doctest::Contains("[5, 2]"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(dp::linear_relu(x, w, dp::zeros({4})), doctest::Contains("[4]"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::linear_relu(dp::zeros({2, 2, 4}), w, dp::Tensor()), doctest::Contains("[2, 2, 4]"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(dp::linear_relu(dp::zeros({2, 2, 4}), w, dp::Tensor()), doctest::Contains("linear_relu"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(dp::linear_relu(x.to(dp::Dtype::Int64), w, dp::Tensor()), doctest::Contains("int64"),
                       dp::Error);
  CHECK_THROWS_AS(dp::linear_relu(dp::Tensor(), w, dp::Tensor()), dp::Error);
}

TEST_CASE_TEMPLATE("conv2d_relu_max_pool2d: the three ops bit for bit, overlapping windows and NaN included", D,
                   DP_NN_TEST_DEVICES) {
  // Note [ReLU mask through max-pool]: the mask applied to the pooled gradient must
  // give the unfused gradients exactly, also where windows overlap (sums) and where a
  // NaN wins a window. The 2x2 pools run as one op where the backend has it (Note
  // [Convolution, ReLU and max-pool in one pass]), in groups of images smaller than a
  // thread's share of the batch (the 64- and 37-image cases, with a last group of
  // another size), an odd output leaving its last row and column unpooled.
  const dp::Device dev = D::device();
  struct Cfg { std::int64_t N, C, H, K, pk, ps, pp; bool nan; };
  for (Cfg c : {Cfg{4, 1, 28, 32, 2, 0, 0, false}, Cfg{3, 32, 14, 64, 2, 2, 0, false},
                Cfg{64, 1, 28, 32, 2, 2, 0, true}, Cfg{37, 8, 13, 48, 2, 0, 0, true},
                Cfg{2, 3, 11, 5, 3, 2, 1, false}, Cfg{2, 3, 11, 5, 3, 1, 1, true}}) {
    CAPTURE(c.N);
    CAPTURE(c.C);
    CAPTURE(c.pk);
    CAPTURE(c.nan);
    auto make = [&](std::uint64_t seed, dp::Shape shape, bool nan) {
      std::int64_t n = 1;
      for (auto d : shape) n *= d;
      auto v = uniform_values(n, -1, 1, seed);
      if (nan) v[v.size() / 2] = std::nanf("");
      dp::Tensor t = dp::from_vector(v, shape, dev);
      t.set_requires_grad(true);
      return t;
    };
    dp::Tensor x = make(30, {c.N, c.C, c.H, c.H}, c.nan), w = make(31, {c.K, c.C, 3, 3}, false);
    dp::Tensor b = make(32, {c.K}, false);
    dp::Tensor x2 = make(30, {c.N, c.C, c.H, c.H}, c.nan), w2 = make(31, {c.K, c.C, 3, 3}, false);
    dp::Tensor b2 = make(32, {c.K}, false);
    dp::Tensor y = nn::max_pool2d(dp::relu(nn::conv2d(x, w, b, 1, 1)), c.pk, c.ps, c.pp);
    dp::Tensor y2 = nn::conv2d_relu_max_pool2d(x2, w2, b2, 1, 1, c.pk, c.ps, c.pp);
    REQUIRE(y.shape() == y2.shape());
    REQUIRE(y2.grad_fn() != nullptr);
    if (c.pk == 2 && dev.is_cpu()) CHECK(y2.grad_fn()->name() == "Conv2dReluMaxPool2dBackward");
    CHECK(nn_test::bitwise_equal(y.to_vector(), y2.to_vector()));
    dp::Tensor gw = dp::from_vector(uniform_values(y.numel(), -1, 1, 33), y.shape(), dev);
    dp::sum(dp::mul(y, gw)).backward();
    dp::sum(dp::mul(y2, gw)).backward();
    CHECK(nn_test::bitwise_equal(x.grad().to_vector(), x2.grad().to_vector()));
    CHECK(nn_test::bitwise_equal(w.grad().to_vector(), w2.grad().to_vector()));
    CHECK(nn_test::bitwise_equal(b.grad().to_vector(), b2.grad().to_vector()));
  }
}

TEST_CASE_TEMPLATE("16-bit max-pool and conv2d_relu_max_pool2d: the widened float32 ops' bits, both passes", D,
                   DP_NN_TEST_DEVICES) {
  // Note [16-bit max-pool]: a bfloat16 or float16 pool is the float32 pool of the
  // widened input, rounded, forward and backward (NaN winners, overlapping windows);
  // the bfloat16 convolution with its ReLU and pool in one call is those ops in turn.
  const dp::Device dev = D::device();
  for (dp::Dtype dt : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    for (std::int64_t k : {2, 3}) {
      CAPTURE(dp::dtype_name(dt));
      CAPTURE(k);
      auto v = uniform_values(3 * 4 * 7 * 9, -1, 1, 40);
      v[17] = std::nanf("");
      dp::Tensor x = dp::from_vector(v, {3, 4, 7, 9}, dev).to(dt);
      x.set_requires_grad(true);
      dp::Tensor xf = x.detach().to(dp::Dtype::Float32);
      xf.set_requires_grad(true);
      const std::int64_t stride = k == 2 ? 2 : 1, pad = k == 2 ? 0 : 1;
      dp::Tensor y = nn::max_pool2d(x, k, stride, pad);
      dp::Tensor yf = nn::max_pool2d(xf, k, stride, pad);
      REQUIRE(y.dtype() == dt);
      CHECK(nn_test::bitwise_equal(y.to_vector(), yf.to(dt).to_vector()));
      dp::Tensor g = dp::from_vector(uniform_values(y.numel(), -1, 1, 41), y.shape(), dev).to(dt);
      dp::sum(dp::mul(y, g)).backward();
      dp::sum(dp::mul(yf, g.to(dp::Dtype::Float32))).backward();
      REQUIRE(x.grad().dtype() == dt);
      CHECK(nn_test::bitwise_equal(x.grad().to_vector(), xf.grad().to(dt).to_vector()));
    }
  }
  auto make = [&](std::uint64_t seed, dp::Shape shape) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    dp::Tensor t = dp::from_vector(uniform_values(n, -1, 1, seed), shape, dev).to(dp::Dtype::BFloat16);
    t.set_requires_grad(true);
    return t;
  };
  for (std::int64_t pk : {2, 3}) {
    CAPTURE(pk);
    dp::Tensor x = make(42, {37, 3, 13, 13}), w = make(43, {8, 3, 3, 3}), b = make(44, {8});
    dp::Tensor x2 = make(42, {37, 3, 13, 13}), w2 = make(43, {8, 3, 3, 3}), b2 = make(44, {8});
    dp::Tensor y = nn::max_pool2d(dp::relu(nn::conv2d(x, w, b, 1, 1)), pk, 2, pk == 3 ? 1 : 0);
    dp::Tensor y2 = nn::conv2d_relu_max_pool2d(x2, w2, b2, 1, 1, pk, 2, pk == 3 ? 1 : 0);
    REQUIRE(y2.dtype() == dp::Dtype::BFloat16);
    CHECK(nn_test::bitwise_equal(y.to_vector(), y2.to_vector()));
    dp::Tensor g = dp::from_vector(uniform_values(y.numel(), -1, 1, 45), y.shape(), dev).to(dp::Dtype::BFloat16);
    dp::sum(dp::mul(y, g)).backward();
    dp::sum(dp::mul(y2, g)).backward();
    CHECK(nn_test::bitwise_equal(x.grad().to_vector(), x2.grad().to_vector()));
    CHECK(nn_test::bitwise_equal(w.grad().to_vector(), w2.grad().to_vector()));
    CHECK(nn_test::bitwise_equal(b.grad().to_vector(), b2.grad().to_vector()));
  }
}

TEST_CASE("conv2d rejects bad input with clear messages") {
  dp::Tensor x = dp::zeros({8, 1, 28, 28});
  dp::Tensor w = dp::zeros({4, 3, 3, 3});
  CHECK(throws_with([&] { nn::conv2d(x, w); }, {"conv2d", "C=3", "[8, 1, 28, 28]"}));
  dp::Tensor w1 = dp::zeros({4, 1, 3, 3}, dp::cpu(0));
  dp::Tensor x1 = dp::zeros({2, 1, 5, 5}, dp::cpu(1));
  CHECK(throws_with([&] { nn::conv2d(x1, w1); }, {"input is on cpu:1", "weight is on cpu:0"}));
  CHECK(throws_with([&] { nn::conv2d(dp::zeros({1, 5, 5}), w1); }, {"4-d input"}));
  CHECK(throws_with([&] { nn::conv2d(dp::zeros({2, 1, 5, 5}, {dp::Dtype::Int64, dp::cpu(0)}), w1); },
                    {"float32", "int64"}));
  CHECK(throws_with([&] { nn::conv2d(dp::zeros({2, 1, 5, 5}), w1, dp::zeros({3})); }, {"bias", "[4]"}));
  CHECK(throws_with([&] { nn::conv2d(dp::zeros({2, 1, 2, 2}), w1); }, {"larger than the padded input"}));
  CHECK(throws_with([&] { nn::conv2d(dp::zeros({2, 1, 5, 5}), w1, {}, 0); }, {"stride"}));
}

// ---- pooling --------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("max_pool2d and avg_pool2d match naive pooling", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  struct Cfg { std::int64_t k, stride, pad; };
  const std::int64_t N = 2, C = 3, H = 7, W = 6;
  F x = uniform_values(N * C * H * W, -2, 2, 9);
  for (Cfg c : {Cfg{2, 2, 0}, Cfg{3, 1, 1}, Cfg{3, 2, 1}, Cfg{2, 1, 0}}) {
    CAPTURE(c.k);
    CAPTURE(c.stride);
    CAPTURE(c.pad);
    dp::Tensor xt = dp::from_vector(x, {N, C, H, W}, dev);
    const std::int64_t P = (H + 2 * c.pad - c.k) / c.stride + 1, Q = (W + 2 * c.pad - c.k) / c.stride + 1;
    dp::Tensor ym = nn::max_pool2d(xt, c.k, c.stride, c.pad);
    dp::Tensor ya = nn::avg_pool2d(xt, c.k, c.stride, c.pad);
    CHECK(ym.shape() == dp::Shape{N, C, P, Q});
    CHECK(ya.shape() == dp::Shape{N, C, P, Q});
    CHECK(max_diff(ym.to_vector(), nn_test::ref_pool2d(x, N * C, H, W, c.k, c.stride, c.pad, true)) == 0);
    CHECK(max_diff(ya.to_vector(), nn_test::ref_pool2d(x, N * C, H, W, c.k, c.stride, c.pad, false)) < 1e-5);
  }
  // stride defaults to the kernel size
  dp::Tensor xt = dp::from_vector(x, {N, C, H, W}, dev);
  CHECK(nn::max_pool2d(xt, 2).shape() == dp::Shape{N, C, 3, 3});
}

TEST_CASE_TEMPLATE("pooling gradients match central differences", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  // Distinct values 0.1 apart: an eps of 1e-2 never changes which element is the max.
  dp::Tensor x = dp::from_vector(distinct_values(2 * 2 * 5 * 5, 10), {2, 2, 5, 5}, dev);
  GradcheckOptions opt{.eps = 1e-2, .atol = 1e-3, .rtol = 1e-2};
  gradcheck([](const auto& in) { return nn::max_pool2d(in[0], 2, 2, 0); }, {x}, opt);
  gradcheck([](const auto& in) { return nn::max_pool2d(in[0], 3, 1, 1); }, {x}, opt);  // overlapping
  gradcheck([](const auto& in) { return nn::avg_pool2d(in[0], 3, 2, 1); }, {x}, opt);
  gradcheck([](const auto& in) { return nn::adaptive_avg_pool2d_1x1(in[0]); }, {x}, opt);
}

TEST_CASE_TEMPLATE("adaptive_avg_pool2d_1x1 is the mean over H and W", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  F x = uniform_values(2 * 3 * 4 * 5, -1, 1, 11);
  dp::Tensor y = nn::adaptive_avg_pool2d_1x1(dp::from_vector(x, {2, 3, 4, 5}, dev));
  CHECK(y.shape() == dp::Shape{2, 3, 1, 1});
  F ref(6);
  for (int p = 0; p < 6; ++p) {
    double acc = 0;
    for (int i = 0; i < 20; ++i) acc += x[p * 20 + i];
    ref[p] = static_cast<float>(acc / 20);
  }
  CHECK(max_diff(y.to_vector(), ref) < 1e-6);
}

TEST_CASE("pooling rejects bad geometry") {
  CHECK(throws_with([] { nn::max_pool2d(dp::zeros({1, 1, 4, 4}), 2, 2, 2); }, {"padding"}));
  CHECK(throws_with([] { nn::avg_pool2d(dp::zeros({1, 4, 4}), 2); }, {"4-d input"}));
  CHECK(throws_with([] { nn::max_pool2d(dp::zeros({1, 1, 2, 2}), 3); }, {"larger than the padded input"}));
  CHECK(throws_with([] { nn::adaptive_avg_pool2d_1x1(dp::zeros({2, 3})); }, {"4-d input"}));
}

// ---- softmax and losses -----------------------------------------------------------------------

namespace {

F ref_log_softmax(const F& x, std::int64_t B, std::int64_t C) {
  F y(x.size());
  for (std::int64_t r = 0; r < B; ++r) {
    double m = -INFINITY;
    for (std::int64_t c = 0; c < C; ++c) m = std::max(m, double(x[r * C + c]));
    double s = 0;
    for (std::int64_t c = 0; c < C; ++c) s += std::exp(double(x[r * C + c]) - m);
    for (std::int64_t c = 0; c < C; ++c) y[r * C + c] = static_cast<float>(x[r * C + c] - m - std::log(s));
  }
  return y;
}

}  // namespace

TEST_CASE_TEMPLATE("log_softmax matches the reference and is stable", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  F x = uniform_values(4 * 5, -3, 3, 12);
  dp::Tensor y = nn::log_softmax(dp::from_vector(x, {4, 5}, dev));
  CHECK(max_diff(y.to_vector(), ref_log_softmax(x, 4, 5)) < 1e-5);
  F big{1000.f, -1000.f, 0.f, 1000.f, 999.f, 998.f};
  F yb = nn::log_softmax(dp::from_vector(big, {2, 3}, dev)).to_vector();
  for (float v : yb) CHECK(std::isfinite(v));
  CHECK(max_diff(yb, ref_log_softmax(big, 2, 3)) < 1e-4);
  gradcheck([](const auto& in) { return nn::log_softmax(in[0]); }, {dp::from_vector(x, {4, 5}, dev)},
            {.eps = 1e-2, .atol = 2e-3, .rtol = 1e-2});
}

TEST_CASE_TEMPLATE("cross_entropy matches a hand computation", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  const std::int64_t B = 4, C = 3;
  F x = uniform_values(B * C, -2, 2, 13);
  I t{2, 0, 1, 2};
  F lp = ref_log_softmax(x, B, C);
  double sum = 0;
  F per(B);
  for (std::int64_t r = 0; r < B; ++r) {
    per[r] = -lp[r * C + t[r]];
    sum += per[r];
  }
  dp::Tensor xt = dp::from_vector(x, {B, C}, dev);
  dp::Tensor tt = dp::from_vector(t, {B}, dev);
  dp::Tensor mean = nn::cross_entropy(xt, tt);
  CHECK(mean.numel() == 1);
  CHECK(mean.item() == doctest::Approx(sum / B).epsilon(1e-5));
  CHECK(nn::cross_entropy(xt, tt, nn::Reduction::Sum).item() == doctest::Approx(sum).epsilon(1e-5));
  CHECK(nn::cross_entropy(xt, tt, nn::Reduction::Sum, 1.0 / 16).item() ==
        doctest::Approx(sum / 16).epsilon(1e-5));
  dp::Tensor none = nn::cross_entropy(xt, tt, nn::Reduction::None);
  CHECK(none.shape() == dp::Shape{B});
  CHECK(max_diff(none.to_vector(), per) < 1e-5);
  CHECK(nn::nll_loss(nn::log_softmax(xt), tt).item() == doctest::Approx(sum / B).epsilon(1e-5));

  // Large logits: finite and exact where a naive exp would overflow.
  dp::Tensor big = dp::from_vector(F{1000.f, -1000.f, 0.f, 0.f, 500.f, 1000.f}, {2, 3}, dev);
  dp::Tensor l = nn::cross_entropy(big, dp::from_vector(I{0, 1}, {2}, dev));
  CHECK(std::isfinite(l.item()));
  CHECK(l.item() == doctest::Approx((0.0 + 500.0) / 2).epsilon(1e-5));
}

TEST_CASE_TEMPLATE("cross_entropy gradients: central differences and softmax - onehot", D,
                   DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  const std::int64_t B = 3, C = 4;
  F x = uniform_values(B * C, -2, 2, 14);
  dp::Tensor tt = dp::from_vector(I{3, 0, 1}, {B}, dev);
  GradcheckOptions opt{.eps = 1e-2, .atol = 1e-3, .rtol = 1e-2};
  for (auto red : {nn::Reduction::Mean, nn::Reduction::Sum, nn::Reduction::None}) {
    gradcheck([&](const auto& in) { return nn::cross_entropy(in[0], tt, red, 0.5); },
              {dp::from_vector(x, {B, C}, dev)}, opt);
  }
  // Mean: d/dx = (softmax - onehot) / B.
  dp::Tensor xt = dp::from_vector(x, {B, C}, dev);
  xt.set_requires_grad(true);
  nn::cross_entropy(xt, tt).backward();
  F lp = ref_log_softmax(x, B, C);
  I t = tt.to_vector_i64();
  F ref(B * C);
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t c = 0; c < C; ++c)
      ref[r * C + c] = static_cast<float>((std::exp(lp[r * C + c]) - (c == t[r] ? 1.0 : 0.0)) / B);
  CHECK(max_diff(xt.grad().to_vector(), ref) < 1e-6);
}

TEST_CASE("cross_entropy rejects bad targets") {
  dp::Tensor x = dp::zeros({2, 3});
  CHECK_THROWS_AS(nn::cross_entropy(x, dp::from_vector(I{0, 3}, {2})), dp::Error);
  CHECK_THROWS_AS(nn::cross_entropy(x, dp::from_vector(I{-1, 0}, {2})), dp::Error);
  CHECK(throws_with([&] { nn::cross_entropy(x, dp::from_vector(F{0, 1}, {2})); }, {"int64", "float32"}));
  CHECK(throws_with([&] { nn::cross_entropy(x, dp::from_vector(I{0, 1, 2}, {3})); }, {"[2]", "[3]"}));
  CHECK(throws_with([&] { nn::cross_entropy(x, dp::from_vector(I{0, 1}, {2}, dp::cpu(1))); },
                    {"cpu:0", "cpu:1"}));
  CHECK(throws_with([&] { nn::cross_entropy(dp::zeros({2, 3, 1}), dp::from_vector(I{0, 1}, {2})); },
                    {"(B, C)"}));
}

TEST_CASE_TEMPLATE("mse_loss forward and gradients", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  F a = uniform_values(6, -1, 1, 15), b = uniform_values(6, -1, 1, 16);
  double s = 0;
  for (int i = 0; i < 6; ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  dp::Tensor at = dp::from_vector(a, {2, 3}, dev), bt = dp::from_vector(b, {2, 3}, dev);
  CHECK(nn::mse_loss(at, bt).item() == doctest::Approx(s / 6).epsilon(1e-5));
  CHECK(nn::mse_loss(at, bt, nn::Reduction::Sum).item() == doctest::Approx(s).epsilon(1e-5));
  CHECK(nn::mse_loss(at, bt, nn::Reduction::Sum, 0.25).item() == doctest::Approx(s / 4).epsilon(1e-5));
  CHECK(nn::mse_loss(at, bt, nn::Reduction::None).shape() == dp::Shape{2, 3});
  gradcheck([](const auto& in) { return nn::mse_loss(in[0], in[1]); }, {at, bt});
  CHECK(throws_with([&] { nn::mse_loss(at, dp::zeros({3, 2}, dev)); }, {"[2, 3]", "[3, 2]"}));
}

// ---- batch norm -------------------------------------------------------------------------------

namespace {

struct BnRef {
  F y, mean, var_biased, var_unbiased;
};

BnRef ref_batch_norm_train(const F& x, const F& g, const F& b, std::int64_t N, std::int64_t C,
                           std::int64_t HW, double eps) {
  BnRef r{F(x.size()), F(C), F(C), F(C)};
  for (std::int64_t c = 0; c < C; ++c) {
    double m = 0, v = 0;
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t i = 0; i < HW; ++i) m += x[(n * C + c) * HW + i];
    m /= double(N * HW);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t i = 0; i < HW; ++i) v += (x[(n * C + c) * HW + i] - m) * (x[(n * C + c) * HW + i] - m);
    r.mean[c] = float(m);
    r.var_biased[c] = float(v / double(N * HW));
    r.var_unbiased[c] = float(v / double(N * HW - 1));
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t i = 0; i < HW; ++i) {
        std::size_t k = (n * C + c) * HW + i;
        r.y[k] = float(g[c] * (x[k] - m) / std::sqrt(v / double(N * HW) + eps) + b[c]);
      }
  }
  return r;
}

}  // namespace

TEST_CASE_TEMPLATE("batch_norm training: batch statistics and running updates", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  const std::int64_t N = 3, C = 2, H = 2, W = 3, HW = H * W;
  F x = uniform_values(N * C * HW, -2, 3, 17), g = {1.5f, -0.5f}, b = {0.25f, 1.0f};
  F rm0 = {0.1f, -0.2f}, rv0 = {1.0f, 2.0f};
  dp::Tensor rm = dp::from_vector(rm0, {C}, dev), rv = dp::from_vector(rv0, {C}, dev);
  dp::Tensor y = nn::batch_norm(dp::from_vector(x, {N, C, H, W}, dev), dp::from_vector(g, {C}, dev),
                                dp::from_vector(b, {C}, dev), rm, rv, true, 0.1, 1e-5);
  BnRef ref = ref_batch_norm_train(x, g, b, N, C, HW, 1e-5);
  CHECK(max_diff(y.to_vector(), ref.y) < 1e-5);
  F rm_ref(C), rv_ref(C);
  for (int c = 0; c < C; ++c) {
    rm_ref[c] = 0.9f * rm0[c] + 0.1f * ref.mean[c];
    rv_ref[c] = 0.9f * rv0[c] + 0.1f * ref.var_unbiased[c];  // unbiased, like PyTorch
  }
  CHECK(max_diff(rm.to_vector(), rm_ref) < 1e-6);
  CHECK(max_diff(rv.to_vector(), rv_ref) < 1e-5);

  // 2-d input (N, C): HW = 1.
  F x2 = uniform_values(4 * 3, -1, 1, 18);
  dp::Tensor y2 = nn::batch_norm(dp::from_vector(x2, {4, 3}, dev), {}, {}, {}, {}, true);
  CHECK(max_diff(y2.to_vector(), ref_batch_norm_train(x2, F(3, 1.f), F(3, 0.f), 4, 3, 1, 1e-5).y) < 1e-5);
}

TEST_CASE_TEMPLATE("batch_norm gradients match central differences", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  dp::Tensor x = dp::from_vector(uniform_values(3 * 2 * 2 * 2, -2, 2, 19), {3, 2, 2, 2}, dev);
  dp::Tensor g = dp::from_vector(F{1.5f, 0.7f}, {2}, dev), b = dp::from_vector(F{0.1f, -0.3f}, {2}, dev);
  GradcheckOptions opt{.eps = 1e-2, .atol = 5e-3, .rtol = 2e-2};
  gradcheck([](const auto& in) { return nn::batch_norm(in[0], in[1], in[2], {}, {}, true); }, {x, g, b}, opt);
  dp::Tensor rm = dp::from_vector(F{0.2f, -0.1f}, {2}, dev), rv = dp::from_vector(F{0.5f, 2.0f}, {2}, dev);
  gradcheck([&](const auto& in) { return nn::batch_norm(in[0], in[1], in[2], rm, rv, false); },
            {x, g, b}, opt);
}

TEST_CASE_TEMPLATE("batch_norm eval normalises with the running statistics", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  F x = uniform_values(2 * 2 * 3, -1, 1, 20), g{2.f, 0.5f}, b{0.f, 1.f}, rm{0.3f, -0.2f}, rv{0.5f, 4.f};
  dp::Tensor rmt = dp::from_vector(rm, {2}, dev), rvt = dp::from_vector(rv, {2}, dev);
  dp::Tensor y = nn::batch_norm(dp::from_vector(x, {2, 2, 3}, dev), dp::from_vector(g, {2}, dev),
                                dp::from_vector(b, {2}, dev), rmt, rvt, false, 0.1, 1e-5);
  F ref(x.size());
  for (int n = 0; n < 2; ++n)
    for (int c = 0; c < 2; ++c)
      for (int i = 0; i < 3; ++i) {
        int k = (n * 2 + c) * 3 + i;
        ref[k] = float(g[c] * (x[k] - rm[c]) / std::sqrt(rv[c] + 1e-5) + b[c]);
      }
  CHECK(max_diff(y.to_vector(), ref) < 1e-5);
  CHECK(rmt.to_vector() == rm);  // untouched
  CHECK(rvt.to_vector() == rv);
}

TEST_CASE_TEMPLATE("batch_norm in 16 bits is the float32 op on the widened input, rounded once", D,
                   DP_NN_TEST_DEVICES) {
  // Note [Batch norm in 16 bits]: the statistics, parameters and running statistics
  // float32; x, y, gy and gx 16-bit; every value the float32 op's on the widened input
  // and gradient, rounded once — bit for bit, including the running statistics and the
  // parameters' gradients. HW = 323 crosses the CPU kernel's 256-value chunks.
  const dp::Device dev = D::device();
  struct Cfg { dp::Shape shape; bool affine; };
  for (dp::Dtype dt : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    for (const Cfg& cfg : {Cfg{{3, 4, 17, 19}, true}, Cfg{{5, 3}, false}, Cfg{{2, 3, 7}, true}}) {
      CAPTURE(dt);
      CAPTURE(dp::shape_str(cfg.shape));
      const std::int64_t C = cfg.shape[1];
      std::int64_t numel = 1;
      for (std::int64_t d : cfg.shape) numel *= d;
      const dp::Tensor x16 = dp::from_vector(uniform_values(numel, -3, 5, 61), cfg.shape, dev).to(dt);
      const dp::Tensor gy16 = dp::from_vector(uniform_values(numel, -1, 1, 62), cfg.shape, dev).to(dt);
      const F gv = uniform_values(C, 0.5f, 1.5f, 63), bv = uniform_values(C, -1, 1, 64);
      for (bool training : {true, false}) {
        CAPTURE(training);
        // Each side: its own parameters, running statistics and input leaf.
        auto run = [&](const dp::Tensor& x0) {
          dp::Tensor x = x0.detach().set_requires_grad(true);
          dp::Tensor g, b;
          if (cfg.affine) {
            g = dp::from_vector(gv, {C}, dev).set_requires_grad(true);
            b = dp::from_vector(bv, {C}, dev).set_requires_grad(true);
          }
          dp::Tensor rm = dp::from_vector(uniform_values(C, -0.5f, 0.5f, 65), {C}, dev);
          dp::Tensor rv = dp::from_vector(uniform_values(C, 0.5f, 2.0f, 66), {C}, dev);
          dp::Tensor y = nn::batch_norm(x, g, b, rm, rv, training, 0.1, 1e-5);
          return std::tuple{x, g, b, rm, rv, y};
        };
        auto [x, g, b, rm, rv, y] = run(x16);
        auto [xf, gf, bf, rmf, rvf, yf] = run(x16.to(dp::Dtype::Float32));
        REQUIRE(y.dtype() == dt);
        CHECK(dp::equal(y, yf.to(dt)));
        CHECK(dp::equal(rm, rmf));
        CHECK(dp::equal(rv, rvf));
        y.backward(gy16);
        yf.backward(gy16.to(dp::Dtype::Float32));
        REQUIRE(x.grad().dtype() == dt);
        CHECK(dp::equal(x.grad(), xf.grad().to(dt)));
        if (cfg.affine) {
          CHECK(g.grad().dtype() == dp::Dtype::Float32);
          CHECK(dp::equal(g.grad(), gf.grad()));
          CHECK(dp::equal(b.grad(), bf.grad()));
        }
      }
    }
  }
}

TEST_CASE("batch_norm in 16 bits keeps its 16-bit input for the backward, not a float32 copy") {
  // What a training batch norm holds once it returns: y and the saved float32 mean and
  // inverse standard deviation (C each); its input is the caller's tensor. A float32
  // copy of a bfloat16 input would be another 4 bytes an element.
  const dp::Device dev = dp::cpu(0);
  const std::int64_t N = 4, C = 8, HW = 36;
  const dp::Tensor x = dp::from_vector(uniform_values(N * C * HW, -1, 1, 67), {N, C, 6, 6}, dev)
                           .to(dp::Dtype::BFloat16)
                           .set_requires_grad(true);
  const dp::Tensor g = dp::ones({C}, dev).set_requires_grad(true), b = dp::zeros({C}, dev).set_requires_grad(true);
  const std::size_t before = dp::memory_allocated(dev);
  dp::Tensor y = nn::batch_norm(x, g, b, {}, {}, true, 0.1, 1e-5);
  const std::size_t held = dp::memory_allocated(dev) - before;
  CHECK(held == y.nbytes() + 2 * C * sizeof(float));
  dp::sum(y).backward();
  CHECK(x.grad().dtype() == dp::Dtype::BFloat16);
}

TEST_CASE("batch_norm rejects bad input") {
  dp::Tensor x = dp::zeros({2, 3, 2, 2});
  CHECK(throws_with([&] { nn::batch_norm(x, dp::ones({2}), {}, {}, {}, true); }, {"[3]", "[2]"}));
  CHECK(throws_with([&] { nn::batch_norm(dp::zeros({1, 3, 1, 1}), {}, {}, {}, {}, true); },
                    {"more than 1 value per channel"}));
  CHECK(throws_with([&] { nn::batch_norm(x, {}, {}, {}, {}, false); }, {"running_mean"}));
  CHECK(throws_with([&] { nn::batch_norm(x, dp::ones({3}, dp::cpu(1)), {}, {}, {}, true); },
                    {"cpu:0", "cpu:1"}));
  // 16-bit inputs take float32 parameters and running statistics; integers are refused.
  const dp::Tensor x16 = x.to(dp::Dtype::BFloat16);
  CHECK(throws_with([&] { nn::batch_norm(x16, dp::ones({3}).to(dp::Dtype::BFloat16), {}, {}, {}, true); },
                    {"weight (gamma)", "float32", "bfloat16"}));
  CHECK(throws_with([&] { nn::batch_norm(x16, {}, {}, dp::zeros({3}).to(dp::Dtype::Float16), dp::ones({3}), true); },
                    {"running_mean", "float32", "float16"}));
  CHECK(throws_with([&] { nn::batch_norm(x.to(dp::Dtype::Int64), {}, {}, {}, {}, true); },
                    {"float32, bfloat16 or float16", "int64"}));
}

// ---- dropout --------------------------------------------------------------------------------

TEST_CASE_TEMPLATE("dropout: deterministic per seed, scaled by 1/(1-p), identity in eval", D,
                   DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  const std::int64_t n = 4000;
  dp::Tensor x = dp::from_vector(uniform_values(n, 0.5f, 1.5f, 21), {40, 100}, dev);
  F xv = x.to_vector();
  dp::Generator g1(42), g2(42), g3(43);
  F a = nn::dropout(x, 0.3, true, g1).to_vector();
  F b = nn::dropout(x, 0.3, true, g2).to_vector();
  F c = nn::dropout(x, 0.3, true, g3).to_vector();
  CHECK(a == b);
  CHECK(a != c);
  CHECK(g1.offset() == static_cast<std::uint64_t>(n));
  int zeros = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (a[i] == 0) {
      ++zeros;
    } else {
      CHECK(a[i] == doctest::Approx(xv[i] / 0.7).epsilon(1e-6));
    }
  }
  CHECK(zeros / double(n) == doctest::Approx(0.3).epsilon(0.1));  // ± 10% of p
  // A second call continues the stream: a new mask.
  CHECK(nn::dropout(x, 0.3, true, g1).to_vector() != a);

  CHECK(nn::dropout(x, 0.3, false, g1).is_same(x));
  CHECK(nn::dropout(x, 0.0, true, g1).is_same(x));
  for (float v : nn::dropout(x, 1.0, true, g1).to_vector()) CHECK(v == 0.0f);
  CHECK_THROWS_AS(nn::dropout(x, 1.5, true, g1), dp::Error);
  CHECK_THROWS_AS(nn::dropout(x, -0.1, true, g1), dp::Error);

  // Gradient = mask · upstream.
  dp::Tensor xl = x.detach().clone();
  xl.set_requires_grad(true);
  dp::Generator g4(42);
  dp::Tensor y = nn::dropout(xl, 0.3, true, g4);
  y.backward(dp::ones_like(y));
  F gr = xl.grad().to_vector();
  for (std::int64_t i = 0; i < n; ++i) CHECK(gr[i] == doctest::Approx(a[i] == 0 ? 0.0 : 1.0 / 0.7));
}

// An input with no channels: the sums of no products would be the bias, but PyTorch's CPU
// convolution returns an empty (N, 0, P, Q); dp refuses with a message saying so, where
// its backend once failed with a message about kernel sizes (found by the op fuzzer,
// Note [Op fuzzer]).
TEST_CASE("conv2d refuses an input with zero channels, naming it") {
  const dp::Tensor x = dp::zeros({2, 0, 4, 3});
  const dp::Tensor w = dp::zeros({3, 0, 2, 2});
  for (bool relu : {false, true}) {
    CAPTURE(relu);
    auto call = [&] { return relu ? dp::nn::conv2d_relu(x, w, dp::zeros({3}), 1, 1) : dp::nn::conv2d(x, w); };
    CHECK_THROWS_WITH_AS(call(), doctest::Contains("at least one channel"), dp::Error);
    CHECK_THROWS_WITH_AS(call(), doctest::Contains("[2, 0, 4, 3]"), dp::Error);
  }
  // An empty batch is fine: (0, K, P, Q).
  CHECK(dp::nn::conv2d(dp::zeros({0, 2, 4, 3}), dp::zeros({3, 2, 2, 2}), dp::Tensor(), 1, 1).shape() ==
        dp::Shape{0, 3, 5, 4});
}
