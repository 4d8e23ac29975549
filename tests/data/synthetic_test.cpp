// Tests for dp/data/synthetic.h: determinism, labels, statistics, and learnability.
#include "dp/data/synthetic.h"

#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "dp/core/error.h"

using dp::data::SyntheticDataset;

TEST_CASE("SyntheticDataset is a pure function of (seed, index)") {
  const SyntheticDataset a({.size = 100, .example_shape = {3, 5}, .num_classes = 4, .seed = 7});
  const SyntheticDataset b({.size = 100, .example_shape = {3, 5}, .num_classes = 4, .seed = 7});
  const SyntheticDataset c({.size = 100, .example_shape = {3, 5}, .num_classes = 4, .seed = 8});
  const std::vector<std::int64_t> idx = {5, 99, 0, 5};
  const auto [xa, ya] = a.get_batch(idx);
  CHECK(xa.shape() == dp::Shape{4, 3, 5});
  CHECK(ya.to_vector_i64() == std::vector<std::int64_t>{1, 3, 0, 1});
  const std::vector<float> va = xa.to_vector();
  CHECK(va == b.get_batch(idx).data.to_vector());
  CHECK(va != c.get_batch(idx).data.to_vector());
  // The same example is the same wherever it sits in a batch.
  CHECK(std::equal(va.begin(), va.begin() + 15, va.begin() + 45));
  // Odd example sizes (15) keep the pairs of normals aligned per example.
  const std::vector<std::int64_t> one = {99};
  const std::vector<float> alone = a.get_batch(one).data.to_vector();
  CHECK(std::equal(alone.begin(), alone.end(), va.begin() + 15));
}

TEST_CASE("SyntheticDataset has the requested statistics and is learnable") {
  constexpr std::int64_t n = 2000, d = 64;
  const SyntheticDataset ds({.size = n, .example_shape = {d}, .num_classes = 2, .seed = 1,
                             .separation = 4.0f, .noise = 1.0f});
  std::vector<std::int64_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  const auto [x, y] = ds.get_batch(idx);
  const std::vector<float> v = x.to_vector();
  const std::vector<std::int64_t> t = y.to_vector_i64();
  // Noise around the class centers: mean ~0, variance ~1.
  double sum = 0, sq = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto center = ds.center(t[static_cast<std::size_t>(i)]);
    for (std::int64_t j = 0; j < d; ++j) {
      const double e = v[static_cast<std::size_t>(i * d + j)] - center[static_cast<std::size_t>(j)];
      sum += e;
      sq += e * e;
    }
  }
  const double m = sum / (n * d), var = sq / (n * d) - m * m;
  CHECK(std::abs(m) < 0.02);
  CHECK(std::abs(var - 1.0) < 0.03);
  // Nearest-center classification gets most examples right (a linear rule: learnable).
  std::int64_t right = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double dist[2] = {0, 0};
    for (int c = 0; c < 2; ++c) {
      const auto center = ds.center(c);
      for (std::int64_t j = 0; j < d; ++j) {
        const double e = v[static_cast<std::size_t>(i * d + j)] - center[static_cast<std::size_t>(j)];
        dist[c] += e * e;
      }
    }
    right += (dist[1] < dist[0] ? 1 : 0) == t[static_cast<std::size_t>(i)];
  }
  CHECK(right > n * 0.9);   // separation 4: ~97.7% expected
  CHECK(right < n);         // yet not trivially separable
}

TEST_CASE("SyntheticDataset validates its options") {
  CHECK_THROWS_AS(SyntheticDataset({.size = -1}), dp::Error);
  CHECK_THROWS_AS(SyntheticDataset({.num_classes = 0}), dp::Error);
  CHECK_THROWS_AS(SyntheticDataset({.example_shape = {}}), dp::Error);
  CHECK_THROWS_AS(SyntheticDataset({.example_shape = {3, 0}}), dp::Error);
  CHECK_THROWS_AS(SyntheticDataset({.noise = -1.0f}), dp::Error);
  const SyntheticDataset ds({.size = 10});
  const std::vector<std::int64_t> bad = {10};
  CHECK_THROWS_WITH_AS(ds.get_batch(bad), doctest::Contains("out of range"), dp::Error);
}
