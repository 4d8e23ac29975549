#include "dp/data/sampler.h"

#include <numeric>
#include <utility>

#include "dp/core/error.h"
#include "dp/dist/dist.h"

namespace dp::data {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): a tiny, well-mixed 64-bit stream.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) without modulo bias (Lemire's multiply-and-reject).
  std::uint64_t below(std::uint64_t bound) {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * bound;
    std::uint64_t low = static_cast<std::uint64_t>(m);
    if (low < bound) {
      const std::uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * bound;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }
};

}  // namespace

std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed) {
  DP_CHECK(n >= 0, "random_permutation: expected n >= 0, got ", n);
  std::vector<std::int64_t> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), std::int64_t{0});
  // The seed goes through one mixing round so that seeds 0, 1, 2 give unrelated streams.
  SplitMix64 rng{SplitMix64{seed}.next()};
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(i) + 1));
    std::swap(p[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(j)]);
  }
  return p;
}

SequentialSampler::SequentialSampler(std::int64_t n) : n_(n) {
  DP_CHECK(n >= 0, "SequentialSampler: expected a dataset size >= 0, got ", n);
}

std::vector<std::int64_t> SequentialSampler::indices() const {
  std::vector<std::int64_t> out(static_cast<std::size_t>(n_));
  std::iota(out.begin(), out.end(), std::int64_t{0});
  return out;
}

RandomSampler::RandomSampler(std::int64_t n, std::uint64_t seed) : n_(n), seed_(seed) {
  DP_CHECK(n >= 0, "RandomSampler: expected a dataset size >= 0, got ", n);
}

std::vector<std::int64_t> RandomSampler::indices() const {
  return random_permutation(n_, seed_ + epoch_);
}

DistributedSampler::DistributedSampler(std::int64_t n, std::int64_t num_replicas,
                                       std::int64_t rank, Options options)
    : n_(n), num_replicas_(num_replicas), rank_(rank), options_(options) {
  DP_CHECK(n >= 0, "DistributedSampler: expected a dataset size >= 0, got ", n);
  DP_CHECK(num_replicas >= 1, "DistributedSampler: expected num_replicas >= 1, got ",
           num_replicas);
  DP_CHECK(rank >= 0 && rank < num_replicas, "DistributedSampler: expected a rank in [0, ",
           num_replicas, ") for ", num_replicas, " replicas, got ", rank);
  num_samples_ = options_.drop_last ? n / num_replicas : (n + num_replicas - 1) / num_replicas;
}

DistributedSampler::DistributedSampler(std::int64_t n, Options options)
    : DistributedSampler(n, dist::world_size(), dist::rank(), options) {}

std::vector<std::int64_t> DistributedSampler::indices() const {
  std::vector<std::int64_t> all;
  if (options_.shuffle) {
    all = random_permutation(n_, options_.seed + epoch_);
  } else {
    all.resize(static_cast<std::size_t>(n_));
    std::iota(all.begin(), all.end(), std::int64_t{0});
  }
  // Position k of the padded list is all[k % n] (wrapping as often as needed); with
  // drop_last the list is only ever truncated, so k < n always holds.
  std::vector<std::int64_t> mine;
  mine.reserve(static_cast<std::size_t>(num_samples_));
  for (std::int64_t k = rank_; k < total_size(); k += num_replicas_) {
    mine.push_back(all[static_cast<std::size_t>(k % n_)]);
  }
  return mine;
}

}  // namespace dp::data
