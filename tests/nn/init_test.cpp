// Tests for dp/nn/init.h: fan computation and bounds as PyTorch computes them, the
// Linear/Conv2d defaults, reproducibility from a generator.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "dp/nn/conv2d.h"
#include "dp/nn/init.h"
#include "dp/nn/linear.h"
#include "nn_test_util.h"

namespace init = dp::nn::init;
using nn_test::F;

namespace {

/// min, max, mean, variance of v.
struct Stats {
  double lo, hi, mean, var;
};
Stats stats(const F& v) {
  Stats s{1e30, -1e30, 0, 0};
  for (float x : v) {
    s.lo = std::min(s.lo, double(x));
    s.hi = std::max(s.hi, double(x));
    s.mean += x;
  }
  s.mean /= double(v.size());
  for (float x : v) s.var += (x - s.mean) * (x - s.mean);
  s.var /= double(v.size());
  return s;
}

/// Checks v looks like U(-bound, bound): inside, reaching near both ends, variance bound²/3.
void check_uniform(const F& v, double bound) {
  Stats s = stats(v);
  CHECK(s.lo >= -bound);
  CHECK(s.hi <= bound);
  CHECK(s.hi > 0.9 * bound);
  CHECK(s.lo < -0.9 * bound);
  CHECK(s.var == doctest::Approx(bound * bound / 3).epsilon(0.1));
}

}  // namespace

TEST_CASE("fan in and fan out follow PyTorch") {
  CHECK(init::fan_in(dp::zeros({10, 20})) == 20);
  CHECK(init::fan_out(dp::zeros({10, 20})) == 10);
  CHECK(init::fan_in(dp::zeros({8, 3, 5, 5})) == 75);
  CHECK(init::fan_out(dp::zeros({8, 3, 5, 5})) == 200);
  CHECK_THROWS_AS(init::fan_in(dp::zeros({10})), dp::Error);
  CHECK(init::leaky_relu_gain(0) == doctest::Approx(std::sqrt(2.0)));
  CHECK(init::leaky_relu_gain(std::sqrt(5.0)) == doctest::Approx(std::sqrt(1.0 / 3.0)));
}

TEST_CASE("kaiming_uniform_ bound = sqrt(3) * gain / sqrt(fan_in)") {
  dp::Generator gen(1);
  dp::Tensor w = dp::empty({64, 200});
  init::kaiming_uniform_(w, 0.0, gen);  // ReLU gain: bound = sqrt(6 / 200)
  check_uniform(w.to_vector(), std::sqrt(6.0 / 200));
  init::kaiming_uniform_(w, std::sqrt(5.0), gen);  // PyTorch's Linear default: 1/sqrt(fan_in)
  check_uniform(w.to_vector(), 1.0 / std::sqrt(200.0));
  dp::Tensor x = dp::empty({100, 150});
  init::xavier_uniform_(x, 1.0, gen);
  check_uniform(x.to_vector(), std::sqrt(6.0 / 250));
  Stats n = stats(init::kaiming_normal_(x, 0.0, gen).to_vector());
  CHECK(n.mean == doctest::Approx(0).epsilon(0.01).scale(1));
  CHECK(n.var == doctest::Approx(2.0 / 150).epsilon(0.1));
  CHECK_THROWS_AS(init::kaiming_uniform_(w = dp::empty({5}), 0.0, gen), dp::Error);
}

TEST_CASE("uniform_, constant_, zeros_, ones_ and reproducibility") {
  dp::Generator a(99), b(99);
  dp::Tensor t = dp::empty({1000}), u = dp::empty({1000});
  init::uniform_(t, -2, 3, a);
  init::uniform_(u, -2, 3, b);
  CHECK(t.to_vector() == u.to_vector());
  Stats s = stats(t.to_vector());
  CHECK(s.lo >= -2);
  CHECK(s.hi < 3);
  CHECK(a.offset() == 1000);
  for (float v : init::zeros_(t).to_vector()) CHECK(v == 0);
  for (float v : init::ones_(t).to_vector()) CHECK(v == 1);
  for (float v : init::constant_(t, 0.5).to_vector()) CHECK(v == 0.5f);
  dp::Tensor i64 = dp::zeros({3}, {dp::Dtype::Int64, dp::cpu(0)});
  CHECK_THROWS_AS(init::uniform_(i64, 0, 1, a), dp::Error);
}

TEST_CASE("Linear and Conv2d defaults match PyTorch's bounds") {
  dp::Generator gen(5);
  dp::nn::Linear fc(400, 300, true, &gen);
  check_uniform(fc.weight().to_vector(), 1.0 / std::sqrt(400.0));
  Stats sb = stats(fc.bias().to_vector());
  CHECK(sb.lo >= -1.0 / 20);
  CHECK(sb.hi <= 1.0 / 20);
  dp::nn::Conv2d conv(16, 32, 3, 1, 0, true, &gen);  // fan_in = 16·3·3 = 144
  check_uniform(conv.weight().to_vector(), 1.0 / 12);
  Stats cb = stats(conv.bias().to_vector());
  CHECK(cb.lo >= -1.0 / 12);
  CHECK(cb.hi <= 1.0 / 12);
}

TEST_CASE("layers draw from the default generator after manual_seed") {
  dp::manual_seed(123);
  dp::nn::Linear a(8, 4);
  dp::manual_seed(123);
  dp::nn::Linear b(8, 4);
  CHECK(a.weight().to_vector() == b.weight().to_vector());
  CHECK(a.bias().to_vector() == b.bias().to_vector());
}
