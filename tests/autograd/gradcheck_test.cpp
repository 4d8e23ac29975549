// Gradients of every differentiable op in dp/tensor (ops.h and the Tensor view methods)
// checked against central differences (tests/autograd/gradcheck.h).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "gradcheck.h"
#include "test_devices.h"
#include "dp/autograd/node.h"
#include "dp/core/device.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {


using dp::Shape;
using dp::Tensor;
using dp_test::GradcheckOptions;
using dp_test::gradcheck;
using Inputs = std::vector<Tensor>;

Tensor uni(const Shape& s, float lo, float hi, unsigned seed, dp::Device dev) {
  return dp::from_vector(dp_test::uniform_values(dp::shape_numel(s), lo, hi, seed), s, dev);
}

struct BroadcastCase {
  Shape a, b;
};
// (B,C)+(C), (B,1)*(1,C), scalar tensors on either side, different ranks.
const std::vector<BroadcastCase> kCases = {
    {{2, 3}, {2, 3}}, {{2, 3}, {3}}, {{3}, {2, 3}},       {{2, 1}, {1, 3}}, {{2, 3}, {}},
    {{}, {2, 3}},     {{}, {}},      {{2, 1, 3}, {2, 1}}, {{4, 1}, {1}},
};

}  // namespace

TEST_CASE_TEMPLATE("add, sub, mul, div: gradients including broadcasting backward", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  unsigned seed = 100;
  for (const auto& c : kCases) {
    INFO("shapes ", dp::shape_str(c.a), " and ", dp::shape_str(c.b));
    Tensor a = uni(c.a, -1.5f, 1.5f, seed++, dev);
    Tensor b = uni(c.b, 0.5f, 2.0f, seed++, dev);  // away from 0 for div
    gradcheck([](const Inputs& x) { return dp::add(x[0], x[1]); }, {a, b});
    gradcheck([](const Inputs& x) { return x[0] - x[1]; }, {a, b});
    gradcheck([](const Inputs& x) { return dp::mul(x[0], x[1]); }, {a, b});
    gradcheck([](const Inputs& x) { return dp::div(x[0], x[1]); }, {a, b}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  }
}

TEST_CASE_TEMPLATE("maximum: gradient goes to the larger input, broadcasting back", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  unsigned seed = 200;
  for (const auto& c : kCases) {
    INFO("shapes ", dp::shape_str(c.a), " and ", dp::shape_str(c.b));
    // a on the grid k/2 + 1/4, b on k/2: every pair differs by at least 1/4 (no ties).
    auto grid = [&](const Shape& s, float shift) {
      auto v = dp_test::uniform_values(dp::shape_numel(s), -3.0f, 3.0f, seed++);
      for (auto& x : v) x = std::floor(x) * 0.5f + shift;
      return dp::from_vector(v, s, dev);
    };
    gradcheck([](const Inputs& x) { return dp::maximum(x[0], x[1]); }, {grid(c.a, 0.25f), grid(c.b, 0.0f)});
  }
  // On a tie the whole gradient goes to one side (b); together they get exactly g.
  Tensor a = dp::from_vector(std::vector<float>{1, 2}, {2}, dev).set_requires_grad(true);
  Tensor b = dp::from_vector(std::vector<float>{1, 3}, {2}, dev).set_requires_grad(true);
  dp::sum(dp::maximum(a, b)).backward();
  auto ga = a.grad().to_vector(), gb = b.grad().to_vector();
  CHECK(ga[0] + gb[0] == 1.0f);
  CHECK(ga[1] == 0.0f);
  CHECK(gb[1] == 1.0f);
}

TEST_CASE_TEMPLATE("scalar add, scalar mul and pow", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor a = uni({2, 3}, -1.5f, 1.5f, 300, dev);
  Tensor p = uni({2, 3}, 0.5f, 2.0f, 301, dev);
  gradcheck([](const Inputs& x) { return dp::add(x[0], 2.5); }, {a});
  gradcheck([](const Inputs& x) { return x[0] - 1.0; }, {a});
  gradcheck([](const Inputs& x) { return dp::mul(x[0], -3.0); }, {a});
  gradcheck([](const Inputs& x) { return 0.5 * x[0] / 4.0; }, {a});
  for (double e : {2.0, 3.0, 1.0, 0.5, -1.5}) {
    CAPTURE(e);
    gradcheck([e](const Inputs& x) { return dp::pow(x[0], e); }, {p}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  }
  gradcheck([](const Inputs& x) { return dp::pow(x[0], 2.0); }, {a});
}

TEST_CASE_TEMPLATE("unary ops", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor any = uni({3, 4}, -2.0f, 2.0f, 400, dev);
  Tensor pos = uni({3, 4}, 0.5f, 3.0f, 401, dev);
  Tensor off0 = dp::from_vector(dp_test::away_from_zero(12, 402), {3, 4}, dev);
  gradcheck([](const Inputs& x) { return dp::neg(x[0]); }, {any});
  gradcheck([](const Inputs& x) { return -x[0]; }, {any});
  gradcheck([](const Inputs& x) { return dp::exp(x[0]); }, {any}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  gradcheck([](const Inputs& x) { return x[0].exp(); }, {any}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  gradcheck([](const Inputs& x) { return dp::log(x[0]); }, {pos}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  gradcheck([](const Inputs& x) { return x[0].log(); }, {pos}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  gradcheck([](const Inputs& x) { return dp::sqrt(x[0]); }, {pos}, GradcheckOptions{1e-3, 2e-3, 1e-2});
  gradcheck([](const Inputs& x) { return dp::abs(x[0]); }, {off0});
  gradcheck([](const Inputs& x) { return dp::square(x[0]); }, {any});
  gradcheck([](const Inputs& x) { return dp::relu(x[0]); }, {off0});
  gradcheck([](const Inputs& x) { return x[0].relu(); }, {off0});
  gradcheck([](const Inputs& x) { return dp::sigmoid(x[0]); }, {any});
  gradcheck([](const Inputs& x) { return dp::tanh(x[0]); }, {any});
}

TEST_CASE_TEMPLATE("sum, mean and max over every dim with keepdim, and sum_to", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor x = uni({2, 3, 4}, -1.0f, 1.0f, 500, dev);
  Tensor distinct = dp::from_vector(dp_test::distinct_values(24, 501), {2, 3, 4}, dev);
  gradcheck([](const Inputs& t) { return dp::sum(t[0]); }, {x});
  gradcheck([](const Inputs& t) { return t[0].sum(); }, {x});
  gradcheck([](const Inputs& t) { return dp::mean(t[0]); }, {x});
  for (std::int64_t d : {0, 1, 2, -1}) {
    for (bool keepdim : {false, true}) {
      CAPTURE(d);
      CAPTURE(keepdim);
      gradcheck([=](const Inputs& t) { return dp::sum(t[0], d, keepdim); }, {x});
      gradcheck([=](const Inputs& t) { return dp::mean(t[0], d, keepdim); }, {x});
      // Distinct values 0.1 apart: eps = 1e-2 never changes which element is the max.
      gradcheck([=](const Inputs& t) { return dp::max(t[0], d, keepdim); }, {distinct});
      gradcheck([=](const Inputs& t) { return t[0].max(d, keepdim); }, {distinct});
    }
  }
  for (const Shape& target : {Shape{3, 4}, Shape{4}, Shape{2, 1, 4}, Shape{3, 1}, Shape{}, Shape{1, 1, 1}}) {
    INFO("sum_to ", dp::shape_str(target));
    gradcheck([=](const Inputs& t) { return dp::sum_to(t[0], target); }, {x});
  }
}

TEST_CASE("max(dim) sends the gradient to the first maximum on ties") {
  Tensor x = dp::from_vector(std::vector<float>{1, 3, 3, 2, 5, 5}, {2, 3}).set_requires_grad(true);
  dp::sum(dp::max(x, 1)).backward();
  CHECK(x.grad().to_vector() == std::vector<float>{0, 1, 0, 0, 1, 0});
}

TEST_CASE_TEMPLATE("matmul, linear and t()", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor a = uni({3, 4}, -1, 1, 600, dev), b = uni({4, 2}, -1, 1, 601, dev);
  gradcheck([](const Inputs& t) { return dp::matmul(t[0], t[1]); }, {a, b});
  gradcheck([](const Inputs& t) { return dp::matmul(t[0], t[1]); }, {uni({1, 1}, -1, 1, 602, dev),
                                                                    uni({1, 5}, -1, 1, 603, dev)});
  Tensor x = uni({5, 3}, -1, 1, 604, dev), w = uni({2, 3}, -1, 1, 605, dev), bias = uni({2}, -1, 1, 606, dev);
  gradcheck([](const Inputs& t) { return dp::linear(t[0], t[1], t[2]); }, {x, w, bias});
  gradcheck([](const Inputs& t) { return dp::linear(t[0], t[1], Tensor()); }, {x, w});
  gradcheck([](const Inputs& t) { return t[0].t(); }, {a});
  // Only some inputs need a gradient: the others stay undefined.
  Tensor wl = w.detach().clone().set_requires_grad(true);
  dp::sum(dp::linear(x, wl, bias)).backward();
  CHECK(wl.grad().defined());
  CHECK_FALSE(x.grad().defined());
  CHECK_FALSE(bias.grad().defined());
}

TEST_CASE_TEMPLATE("views and copies: reshape, flatten, unsqueeze, squeeze, narrow, clone", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor x = uni({4, 3}, -1, 1, 700, dev);
  gradcheck([](const Inputs& t) { return t[0].reshape({2, -1}) * 2.0; }, {x});
  gradcheck([](const Inputs& t) { return t[0].view({12}); }, {x});
  gradcheck([](const Inputs& t) { return t[0].flatten(); }, {x});
  gradcheck([](const Inputs& t) { return t[0].unsqueeze(1); }, {x});
  gradcheck([](const Inputs& t) { return t[0].unsqueeze(0).squeeze(0); }, {x});
  gradcheck([](const Inputs& t) { return t[0].narrow(0, 1, 2); }, {x});
  gradcheck([](const Inputs& t) { return t[0].narrow(0, 0, 0); }, {x});  // no rows: zero gradient
  gradcheck([](const Inputs& t) { return dp::square(t[0].narrow(0, 3, 1)); }, {x});
  gradcheck([](const Inputs& t) { return t[0].clone(); }, {x});
  // Overlapping narrows of one tensor sum their gradients.
  gradcheck([](const Inputs& t) { return t[0].narrow(0, 0, 3) * t[0].narrow(0, 1, 3); }, {x});
}

TEST_CASE_TEMPLATE("cat, chunk and split", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor a = uni({2, 3}, -1, 1, 800, dev), b = uni({1, 3}, -1, 1, 801, dev), c = uni({3, 3}, -1, 1, 802, dev);
  gradcheck([](const Inputs& t) { return dp::cat({t[0], t[1], t[2]}); }, {a, b, c});
  gradcheck([](const Inputs& t) { return dp::cat({dp::square(t[0]), t[1] * 3.0, t[0]}); }, {a, b});
  Tensor x = uni({10, 2}, -1, 1, 803, dev);
  gradcheck(
      [](const Inputs& t) {
        auto p = dp::chunk(t[0], 4);  // 3, 3, 3, 1 rows
        return dp::cat({p[3] * 4.0, dp::square(p[1]), p[0] * -1.0});
      },
      {x});
  gradcheck(
      [](const Inputs& t) {
        auto p = dp::split(t[0], {1, 6, 3});
        return dp::cat({p[2], p[0] * 2.0});
      },
      {x});
}

TEST_CASE("to(device) is differentiable: cpu(0) -> cpu(1) and back") {
  Tensor x = uni({2, 3}, -1, 1, 900, dp::cpu(0));
  Tensor w1 = uni({2, 3}, -1, 1, 901, dp::cpu(1));
  gradcheck([](const Inputs& t) { return t[0].to(dp::cpu(1)); }, {x});
  gradcheck([w1](const Inputs& t) { return dp::mul(t[0].to(dp::cpu(1)), w1).to(dp::cpu(2)); }, {x});

  Tensor leaf = x.detach().clone().set_requires_grad(true);
  Tensor y = leaf.to(dp::cpu(1));
  CHECK(y.device() == dp::cpu(1));
  CHECK(y.requires_grad());
  dp::sum(y * w1).backward();
  CHECK(leaf.grad().device() == dp::cpu(0));
  CHECK(dp::max_abs_diff(leaf.grad(), w1.to(dp::cpu(0))) == 0.0);
  // to(dtype) is not differentiable: the result does not require a gradient.
  CHECK_FALSE(leaf.to(dp::Dtype::Int64).requires_grad());
}

TEST_CASE_TEMPLATE("composite expressions: a small MLP loss", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor x = uni({4, 3}, -1, 1, 1000, dev);
  Tensor w1 = uni({5, 3}, -1, 1, 1001, dev), b1 = uni({5}, -0.1f, 0.1f, 1002, dev);
  Tensor w2 = uni({5, 2}, -1, 1, 1003, dev), b2 = uni({2}, -1, 1, 1004, dev);
  gradcheck(
      [](const Inputs& t) {
        Tensor h = dp::tanh(dp::linear(t[0], t[1], t[2]));
        Tensor z = dp::matmul(h, t[3]) + t[4];
        return dp::mean(dp::square(dp::sigmoid(z) - 0.5), 1);
      },
      {x, w1, b1, w2, b2});
}

TEST_CASE("gradcheck itself fails on a wrong gradient") {
  // A node whose backward is off by a factor of 2: gradcheck must notice every element.
  auto doubled_square = [](const Inputs& t) {
    Tensor y = dp::square(t[0].detach());
    dp::autograd::record("WrongBackward", {t[0]}, y, {t[0]}, [x = t[0].detach()](const std::vector<Tensor>& g) {
      return std::vector<Tensor>{dp::mul(dp::mul(g[0], x), 4.0)};  // should be 2x
    });
    return y;
  };
  Tensor x = uni({2, 3}, 0.5f, 1.5f, 1100, dp::cpu(0));
  CHECK(dp_test::gradcheck_mismatches(doubled_square, {x}).size() == 6);
  // A missing gradient is reported too.
  CHECK(dp_test::gradcheck_mismatches([](const Inputs& t) { return t[0] * 2.0 + t[1].detach(); },
                                      {x, x})
            .size() == 1);
  CHECK(dp_test::gradcheck_mismatches([](const Inputs& t) { return dp::square(t[0]); }, {x}).empty());
}
