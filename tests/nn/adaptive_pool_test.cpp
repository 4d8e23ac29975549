// Tests for adaptive average pooling to any output size (dp::nn::adaptive_avg_pool2d
// and AdaptiveAvgPool2d) against PyTorch 1.13's F.adaptive_avg_pool2d, forward and
// backward, written by scripts/make_pool_reference.py: sizes that do not divide the
// input, outputs larger than the input, uniform bins and global pooling; central
// differences; names; bad input.
#include <doctest/doctest.h>

#include <span>
#include <utility>
#include <vector>

#include "../autograd/gradcheck.h"
#include "dp/nn/functional.h"
#include "dp/nn/pooling.h"
#include "dp/tensor/autocast.h"
#include "nn_test_util.h"
#include "pool_reference.h"

using nn_test::F;
using nn_test::max_diff;
using nn_test::throws_with;
namespace nn = dp::nn;
namespace ref = pool_reference;

namespace {

struct Case {
  const char* name;
  std::span<const std::int64_t> shape;  // N, C, H, W, P, Q
  std::span<const float> x, gy, y, gx;
};

#define DP_POOL_CASE(k) Case{#k, ref::k##Shape, ref::k##X, ref::k##Gy, ref::k##Y, ref::k##Gx}
const Case kCases[] = {DP_POOL_CASE(k7x5To3x2), DP_POOL_CASE(k5x5To3),    DP_POOL_CASE(k3x4To5x7),
                       DP_POOL_CASE(k6x4To3x2), DP_POOL_CASE(k5x7To1x1), DP_POOL_CASE(k10x9To4x4)};
#undef DP_POOL_CASE

F vec(std::span<const float> s) { return F(s.begin(), s.end()); }

}  // namespace

TEST_CASE_TEMPLATE("adaptive_avg_pool2d matches PyTorch forward and backward", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  for (const Case& c : kCases) {
    CAPTURE(c.name);
    const auto& s = c.shape;
    dp::Tensor x = dp::from_vector(vec(c.x), {s[0], s[1], s[2], s[3]}, dev);
    x.set_requires_grad(true);
    nn::AdaptiveAvgPool2d pool(s[4], s[5]);
    dp::Tensor y = pool(x);
    REQUIRE(y.shape() == dp::Shape{s[0], s[1], s[4], s[5]});
    // float rounding only: the bins are means of at most 12 values of |v| <= 1
    CHECK(max_diff(y.to_vector(), vec(c.y)) < 1e-6);
    y.backward(dp::from_vector(vec(c.gy), y.shape(), dev));
    REQUIRE(x.grad().defined());
    CHECK(max_diff(x.grad().to_vector(), vec(c.gx)) < 1e-6);
  }
}

TEST_CASE("adaptive_avg_pool2d: central differences on uneven and overlapping bins") {
  dp_test::GradcheckOptions opt;
  for (auto [P, Q] : {std::pair<std::int64_t, std::int64_t>{3, 2}, {4, 6}, {2, 2}}) {
    CAPTURE(P);
    CAPTURE(Q);
    dp::Tensor x = dp::from_vector(dp_test::uniform_values(2 * 2 * 5 * 3, -1, 1, 5), {2, 2, 5, 3});
    dp_test::gradcheck([P, Q](const auto& in) { return nn::adaptive_avg_pool2d(in[0], P, Q); }, {x}, opt);
  }
}

TEST_CASE("AdaptiveAvgPool2d: name prints the real output size") {
  CHECK(nn::AdaptiveAvgPool2d(1).name() == "AdaptiveAvgPool2d(output_size=1)");
  CHECK(nn::AdaptiveAvgPool2d(3).name() == "AdaptiveAvgPool2d(output_size=3)");
  CHECK(nn::AdaptiveAvgPool2d(3, 2).name() == "AdaptiveAvgPool2d(output_size=(3, 2))");
  CHECK(nn::AdaptiveAvgPool2d(3, 2).output_h() == 3);
  CHECK(nn::AdaptiveAvgPool2d(3, 2).output_w() == 2);
}

TEST_CASE("adaptive_avg_pool2d: bad input") {
  CHECK(throws_with([] { nn::adaptive_avg_pool2d(dp::zeros({2, 3, 4}), 2, 2); }, {"4-d input", "[2, 3, 4]"}));
  CHECK(throws_with([] { nn::adaptive_avg_pool2d(dp::zeros({1, 1, 4, 4}), 0, 2); }, {"output size >= 1", "0x2"}));
  CHECK(throws_with([] { nn::adaptive_avg_pool2d(dp::zeros({1, 1, 0, 4}), 2, 2); }, {"H, W > 0"}));
  CHECK(throws_with([] { nn::adaptive_avg_pool2d(dp::Tensor(), 2, 2); }, {"adaptive_avg_pool2d"}));
  CHECK(throws_with([] { nn::AdaptiveAvgPool2d(2)(dp::zeros({4, 4})); }, {"4-d input"}));
}

// Pooling is on neither of autocast's lists: under autocast a float32 input pools in
// float32, also where uneven bins make it a product (Note [Adaptive pooling]), which once
// took autocast's bfloat16 (found by the op fuzzer, Note [Op fuzzer]).
TEST_CASE("adaptive_avg_pool2d under bfloat16 autocast keeps float32, with its bits outside the scope") {
  dp::Generator gen(3);
  const dp::Tensor x = dp::randn({2, 3, 5, 7}, gen);
  for (auto [P, Q] : {std::pair<std::int64_t, std::int64_t>{2, 3}, {5, 7}, {1, 1}, {3, 2}}) {
    CAPTURE(P);
    CAPTURE(Q);
    const dp::Tensor plain = nn::adaptive_avg_pool2d(x, P, Q);
    dp::amp::autocast scope(dp::Dtype::BFloat16);
    const dp::Tensor inside = nn::adaptive_avg_pool2d(x, P, Q);
    CHECK(inside.dtype() == dp::Dtype::Float32);
    CHECK(inside.to_vector() == plain.to_vector());
  }
}
