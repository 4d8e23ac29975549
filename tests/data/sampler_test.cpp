// Tests for dp/data/sampler.h: exact DistributedSampler index lists (PyTorch semantics),
// shuffling determinism, and argument validation.
#include "dp/data/sampler.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "dp/core/error.h"

using dp::data::DistributedSampler;
using Idx = std::vector<std::int64_t>;

namespace {

Idx range(std::int64_t first, std::int64_t last, std::int64_t step) {
  Idx out;
  for (std::int64_t i = first; i <= last; i += step) out.push_back(i);
  return out;
}

Idx sorted(Idx v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("random_permutation is a deterministic permutation") {
  const Idx a = dp::data::random_permutation(1000, 42);
  CHECK(a == dp::data::random_permutation(1000, 42));
  CHECK(a != dp::data::random_permutation(1000, 43));
  CHECK(sorted(a) == range(0, 999, 1));
  CHECK(a != range(0, 999, 1));
  CHECK(dp::data::random_permutation(0, 1).empty());
  CHECK(dp::data::random_permutation(1, 1) == Idx{0});
  // Unbiased enough: over many seeds, each value lands in position 0 about equally often.
  std::vector<int> first(4, 0);
  for (std::uint64_t s = 0; s < 4000; ++s) ++first[static_cast<std::size_t>(dp::data::random_permutation(4, s)[0])];
  for (int c : first) CHECK(c > 850);  // expected 1000 each; 850 is > 5 sigma below
}

TEST_CASE("SequentialSampler and RandomSampler") {
  dp::data::SequentialSampler seq(5);
  CHECK(seq.indices() == Idx{0, 1, 2, 3, 4});
  CHECK(seq.size() == 5);
  dp::data::RandomSampler rnd(50, 9);
  const Idx e0 = rnd.indices();
  CHECK(e0 == rnd.indices());
  CHECK(sorted(e0) == range(0, 49, 1));
  rnd.set_epoch(1);
  CHECK(rnd.epoch() == 1);
  CHECK(rnd.indices() != e0);
  rnd.set_epoch(0);
  CHECK(rnd.indices() == e0);
  CHECK_THROWS_AS(dp::data::RandomSampler(-1), dp::Error);
  CHECK_THROWS_AS(dp::data::SequentialSampler(-1), dp::Error);
}

TEST_CASE("DistributedSampler without shuffling: exact index lists") {
  const DistributedSampler::Options plain{.shuffle = false};
  SUBCASE("20 items on 2 replicas") {
    DistributedSampler r0(20, 2, 0, plain), r1(20, 2, 1, plain);
    CHECK(r0.indices() == range(0, 18, 2));
    CHECK(r1.indices() == range(1, 19, 2));
    CHECK(r0.size() == 10);
    CHECK(r0.total_size() == 20);
  }
  SUBCASE("21 items on 2 replicas pad by wrapping") {
    DistributedSampler r0(21, 2, 0, plain), r1(21, 2, 1, plain);
    Idx want1 = range(1, 19, 2);
    want1.push_back(0);
    CHECK(r0.indices() == range(0, 20, 2));
    CHECK(r1.indices() == want1);
    CHECK(r0.size() == 11);
    CHECK(r1.size() == 11);
    CHECK(r1.indices().back() == 0);
  }
  SUBCASE("21 items on 2 replicas with drop_last") {
    const DistributedSampler::Options drop{.shuffle = false, .drop_last = true};
    DistributedSampler r0(21, 2, 0, drop), r1(21, 2, 1, drop);
    CHECK(r0.indices() == range(0, 18, 2));
    CHECK(r1.indices() == range(1, 19, 2));
    CHECK(r0.total_size() == 20);
  }
  SUBCASE("padding longer than the dataset repeats it") {
    // 3 items on 8 replicas: total 8 = [0 1 2 0 1 2 0 1].
    const Idx want = {0, 1, 2, 0, 1, 2, 0, 1};
    for (std::int64_t r = 0; r < 8; ++r) {
      CHECK(DistributedSampler(3, 8, r, plain).indices() == Idx{want[static_cast<std::size_t>(r)]});
    }
    // With drop_last nobody gets anything.
    const DistributedSampler::Options drop{.shuffle = false, .drop_last = true};
    CHECK(DistributedSampler(3, 8, 5, drop).indices().empty());
    CHECK(DistributedSampler(3, 8, 5, drop).size() == 0);
  }
  SUBCASE("10 items on 3 replicas") {
    CHECK(DistributedSampler(10, 3, 0, plain).indices() == Idx{0, 3, 6, 9});
    CHECK(DistributedSampler(10, 3, 1, plain).indices() == Idx{1, 4, 7, 0});
    CHECK(DistributedSampler(10, 3, 2, plain).indices() == Idx{2, 5, 8, 1});
    const DistributedSampler::Options drop{.shuffle = false, .drop_last = true};
    CHECK(DistributedSampler(10, 3, 0, drop).indices() == Idx{0, 3, 6});
    CHECK(DistributedSampler(10, 3, 2, drop).indices() == Idx{2, 5, 8});
  }
  SUBCASE("empty dataset") {
    CHECK(DistributedSampler(0, 2, 1, plain).indices().empty());
  }
}

TEST_CASE("DistributedSampler with shuffling") {
  constexpr std::int64_t n = 103, R = 4;
  const DistributedSampler::Options opts{.shuffle = true, .seed = 5};
  auto all_ranks = [&](std::uint64_t epoch) {
    std::vector<Idx> out;
    for (std::int64_t r = 0; r < R; ++r) {
      DistributedSampler s(n, R, r, opts);
      s.set_epoch(epoch);
      out.push_back(s.indices());
    }
    return out;
  };
  const std::vector<Idx> e0 = all_ranks(0);
  // Same seed and epoch: the same lists, on a fresh sampler too.
  CHECK(e0 == all_ranks(0));
  // A partition up to padding: 26 each (104 total), every item at least once, exactly
  // one item twice.
  std::map<std::int64_t, int> seen;
  for (const Idx& part : e0) {
    CHECK(part.size() == 26);
    for (std::int64_t i : part) ++seen[i];
  }
  CHECK(seen.size() == static_cast<std::size_t>(n));
  int twice = 0;
  for (auto [i, c] : seen) {
    CHECK(i >= 0);
    CHECK(i < n);
    CHECK(c <= 2);
    twice += c == 2;
  }
  CHECK(twice == 1);
  // The padded item is the first of the epoch's permutation (rank 0's first index).
  CHECK(seen[e0[0][0]] == 2);
  // A new epoch gives a new order; drop_last gives a true partition of 100.
  CHECK(all_ranks(1) != e0);
  const DistributedSampler::Options drop{.shuffle = true, .seed = 5, .drop_last = true};
  std::set<std::int64_t> uniq;
  std::size_t total = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    const Idx part = DistributedSampler(n, R, r, drop).indices();
    total += part.size();
    uniq.insert(part.begin(), part.end());
  }
  CHECK(total == 100);
  CHECK(uniq.size() == 100);
}

TEST_CASE("DistributedSampler validates its arguments") {
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 0, 0), doctest::Contains("num_replicas >= 1"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 2, 2), doctest::Contains("rank in [0, 2)"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 2, -1), doctest::Contains("got -1"), dp::Error);
  CHECK_THROWS_AS(DistributedSampler(-1, 2, 0), dp::Error);
}
