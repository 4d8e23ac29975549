// Random tensors as libtorch makes them (dp/tensor/tensor.h): randn, rand, randint and
// normal from dp::default_generator() (which dp::manual_seed seeds) or a Generator,
// on any device, and the errors of bad arguments.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

TEST_CASE("randn, rand, randint and normal draw from the default generator that manual_seed seeds") {
  dp::manual_seed(3);
  dp::Tensor a = dp::randn({20, 10});
  dp::Tensor u = dp::rand({50});
  dp::Tensor k = dp::randint(0, 10, {30});
  dp::Tensor n = dp::normal(5.0, 2.0, {40});
  CHECK(a.shape() == dp::Shape{20, 10});
  CHECK(a.dtype() == dp::Dtype::Float32);
  CHECK(a.device() == dp::cpu(0));
  CHECK(k.dtype() == dp::Dtype::Int64);
  dp::manual_seed(3);
  CHECK(dp::equal(dp::randn({20, 10}), a));
  CHECK(dp::equal(dp::rand({50}), u));
  CHECK(dp::equal(dp::randint(0, 10, {30}), k));
  CHECK(dp::equal(dp::normal(5.0, 2.0, {40}), n));
  // The same stream as the explicit-generator forms.
  dp::Generator g(3);
  CHECK(dp::equal(dp::randn({20, 10}, g), a));
  CHECK(dp::equal(dp::rand({50}, g), u));
  CHECK(dp::equal(dp::randint(0, 10, {30}, g), k));
  CHECK(dp::equal(dp::normal(5.0, 2.0, {40}, g), n));
  // Successive draws differ.
  CHECK_FALSE(dp::equal(dp::randn({20, 10}), a));
}

TEST_CASE("random tensors land on the device asked for, with the same values as on cpu:0") {
  dp::manual_seed(11);
  dp::Tensor a0 = dp::randn({8});
  dp::Tensor r0 = dp::randint(5, {8});
  dp::manual_seed(11);
  dp::Tensor a2 = dp::randn({8}, dp::cpu(2));
  dp::Tensor r2 = dp::randint(5, {8}, dp::cpu(2));
  CHECK(a2.device() == dp::cpu(2));
  CHECK(r2.device() == dp::cpu(2));
  CHECK(a2.to_vector() == a0.to_vector());
  CHECK(r2.to_vector_i64() == r0.to_vector_i64());
}

TEST_CASE("values lie in their ranges with the expected moments") {
  dp::Generator g(5);
  const auto u = dp::rand({20000}, g).to_vector();
  double mean = 0;
  for (float x : u) {
    REQUIRE(x >= 0.0f);
    REQUIRE(x < 1.0f);
    mean += x;
  }
  CHECK(mean / u.size() == doctest::Approx(0.5).epsilon(0.02));

  const auto n = dp::normal(5.0, 2.0, {20000}, g).to_vector();
  double m = 0, sq = 0;
  for (float x : n) m += x;
  m /= n.size();
  for (float x : n) sq += (x - m) * (x - m);
  CHECK(m == doctest::Approx(5.0).epsilon(0.02));
  CHECK(std::sqrt(sq / n.size()) == doctest::Approx(2.0).epsilon(0.03));
  CHECK(dp::normal(1.5, 0.0, {3}).to_vector() == std::vector<float>(3, 1.5f));

  const auto k = dp::randint(-3, 4, {5000}, g).to_vector_i64();
  std::set<std::int64_t> seen(k.begin(), k.end());
  CHECK(seen == std::set<std::int64_t>{-3, -2, -1, 0, 1, 2, 3});
  // The widest span (2^24 values): every draw inside, the top of the range reached.
  const std::int64_t span = std::int64_t{1} << 24;
  const auto w = dp::randint(100, 100 + span, {200000}, g).to_vector_i64();
  std::int64_t lo = w[0], hi = w[0];
  for (std::int64_t x : w) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  CHECK(lo >= 100);
  CHECK(hi < 100 + span);
  CHECK(hi > 100 + span - span / 1000);
  // One value only.
  CHECK(dp::randint(7, 8, {4}).to_vector_i64() == std::vector<std::int64_t>(4, 7));
}

TEST_CASE("bad arguments of the random functions are errors") {
  CHECK_THROWS_WITH_AS(dp::randint(5, 5, {3}), doctest::Contains("expected low < high"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::randint(0, {3}), doctest::Contains("got [0, 0)"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::randint(0, (std::int64_t{1} << 24) + 1, {3}), doctest::Contains("high - low <= 2^24"),
                       dp::Error);
  CHECK_THROWS_AS(dp::randint(std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(), {1}),
                  dp::Error);
  CHECK_THROWS_WITH_AS(dp::randint(std::int64_t{1} << 60, (std::int64_t{1} << 60) + 2, {1}),
                       doctest::Contains("|low| <= 2^53"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::normal(0.0, -1.0, {3}), doctest::Contains("std >= 0"), dp::Error);
  CHECK_THROWS_AS(dp::normal(NAN, 1.0, {3}), dp::Error);
  CHECK_THROWS_AS(dp::normal(0.0, INFINITY, {3}), dp::Error);
  CHECK_THROWS_WITH_AS(dp::randn({2, -1}), doctest::Contains("non-negative sizes"), dp::Error);
  CHECK_THROWS_AS(dp::rand({3}, dp::cpu(99)), dp::Error);
}
