#include "dp/nn/dropout.h"

#include "dp/core/error.h"
#include "dp/nn/functional.h"

namespace dp::nn {
namespace {

/// SplitMix64's finaliser: spreads (seed, copy) pairs over unrelated Philox keys.
std::uint64_t mix(std::uint64_t seed, std::uint64_t copy) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (copy + 1);  // golden-ratio increment
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

Dropout::Dropout(double p, std::optional<std::uint64_t> seed) : p_(p) {
  DP_CHECK(p >= 0.0 && p <= 1.0, "Dropout: expected a probability p in [0, 1], got ", p);
  register_generators("generator", generators_);
  if (seed) {
    set_seed(*seed);
  } else {
    // Derived from the default generator's seed and position, so dp::manual_seed makes
    // the masks reproducible and two Dropout layers get different streams.
    Generator& g = default_generator();
    set_seed(mix(g.seed(), g.advance(1)));
  }
}

void Dropout::set_seed(std::uint64_t seed) { set_streams(seed, first_stream_); }

void Dropout::set_streams(std::uint64_t seed, std::int64_t first) {
  DP_CHECK(first >= 0, "Dropout::set_streams: expected a first stream >= 0, got ", first);
  seed_ = seed;
  first_stream_ = first;
  for (int r = 0; r < kMaxCopies; ++r) {
    generators_[r].set_state(stream_key(first + r), 0);
  }
}

std::uint64_t Dropout::stream_key(std::int64_t s) const {
  DP_CHECK(s >= 0, "Dropout::stream_key: expected a stream >= 0, got ", s);
  return mix(seed_, static_cast<std::uint64_t>(s));
}

void Dropout::set_process_spread(int processes, int copies) {
  DP_CHECK(processes >= 1, "Dropout::set_process_spread: expected processes >= 1, got ", processes);
  DP_CHECK(processes == 1 || (copies >= 1 && copies <= kMaxCopies),
           "Dropout::set_process_spread: expected copies in [1, ", kMaxCopies, "], got ", copies);
  spread_processes_ = processes;
  spread_copies_ = processes == 1 ? 0 : copies;  // one process: the layer is its own
}

Generator& Dropout::generator(int copy) {
  DP_CHECK(copy >= 0 && copy < kMaxCopies, "Dropout: copy ", copy, " is out of range [0, ", kMaxCopies,
           "); a Dropout layer serves at most ", kMaxCopies, " devices");
  return generators_[copy];
}

Tensor Dropout::forward(const Tensor& x) {
  if (!is_training() || p_ == 0.0) return x;
  // See Note [Dropout generators]: each bound copy draws from its own stream.
  return dropout(x, p_, true, generator(ReplicaBinding::current()));
}

std::string Dropout::name() const { return detail::str_cat("Dropout(p=", p_, ")"); }

}  // namespace dp::nn
