// dp/nn/dropout.h — inverted dropout with one random stream per parameter-set copy.
//
// Note [Dropout generators]
// A Generator is not thread-safe, and DataParallel runs one module object on several
// worker threads at once, each bound to its own copy (ReplicaBinding). Dropout
// therefore owns a fixed array of kMaxCopies generators and forward draws from
// generators_[ReplicaBinding::current()], so concurrent workers never share one.
// Generator r is seeded with mix(seed, r) (a SplitMix64 step), so every copy's stream
// is deterministic for a given seed, and copies never repeat each other's masks. The
// seed is taken from dp::default_generator() at construction (so dp::manual_seed
// makes a run reproducible) unless given explicitly. Consequence: under
// DataParallel each shard's mask comes from its device's stream, so masks differ
// from single-device training with the same seed (as in PyTorch). Two threads bound
// to the SAME copy must not run forward concurrently. Copy r's stream is number
// first_stream() + r, first_stream() 0 unless set_streams() moves it: DataParallel
// across processes gives process p's copies the streams p * n + r of process 0's
// seed (Note [Dropout across processes] in src/parallel/data_parallel.cpp), so every
// device of the job draws its own masks, as the devices of one process do. The generators are registered
// as "generator.0" … "generator.63" (Note [Module generators] in module.cpp), so a
// training checkpoint restores every copy's stream by itself ("drop.generator.1").
//
//   auto drop = std::make_shared<dp::nn::Dropout>(0.5);   // or Dropout(DropoutOptions().p(0.5))
//   dp::Tensor y = (*drop)(x);          // training: zeros ~half, scales the rest by 2
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "dp/nn/module.h"

namespace dp::nn {

/// Options of Dropout in libtorch's builder style: DropoutOptions().p(0.2), or
/// DropoutOptions(0.2). (libtorch's `inplace` is not offered: dp's dropout always
/// writes a new tensor.)
class DropoutOptions {
 public:
  explicit DropoutOptions(double p = 0.5) : p_(p) {}

  DropoutOptions& p(double v) { p_ = v; return *this; }
  /// Probability of zeroing an element, in [0, 1]; default 0.5.
  double p() const { return p_; }

 private:
  double p_;
};

/// Zeroes elements with probability p while training and scales the rest by 1/(1 − p);
/// identity in eval mode.
class Dropout : public Module {
 public:
  /// Most copies (devices) a Dropout layer serves; see Note [Dropout generators].
  static constexpr int kMaxCopies = 64;

  /// p in [0, 1]. Without `seed`, one is drawn from dp::default_generator().
  explicit Dropout(double p = 0.5, std::optional<std::uint64_t> seed = std::nullopt);
  /// The same from options: Dropout(DropoutOptions().p(0.2)).
  explicit Dropout(const DropoutOptions& options, std::optional<std::uint64_t> seed = std::nullopt)
      : Dropout(options.p(), seed) {}

  Tensor forward(const Tensor& x) override;
  /// "Dropout(p=0.5)".
  std::string name() const override;

  double p() const { return p_; }
  std::uint64_t seed() const { return seed_; }
  /// Reseeds every copy's generator from `seed` (restarting their streams).
  void set_seed(std::uint64_t seed);
  /// Reseeds copy r's generator as stream `first + r` of `seed` (restarting it); first
  /// ≥ 0. set_seed(seed) keeps first_stream().
  void set_streams(std::uint64_t seed, std::int64_t first);
  /// The stream number of copy 0 (0 unless set_streams moved it).
  std::int64_t first_stream() const { return first_stream_; }
  /// The Philox key of stream s (s >= 0) of this layer's seed: the key set_streams gives
  /// the copy that draws stream s, at counter 0.
  std::uint64_t stream_key(std::int64_t s) const;
  /// Records that DataParallel spread the streams over `processes` processes of
  /// `copies` devices each, this process's copies drawing streams first_stream() ..
  /// first_stream() + copies - 1 (Note [Dropout streams in a checkpoint] in
  /// src/io/checkpoint.cpp: a training checkpoint then gathers them); copies in
  /// [1, kMaxCopies]. One process (the default) says the layer is this process's alone
  /// (copies is then ignored and spread_copies() is 0).
  void set_process_spread(int processes, int copies);
  int spread_processes() const { return spread_processes_; }
  int spread_copies() const { return spread_copies_; }
  /// The generator copy r draws from (0 ≤ r < kMaxCopies).
  Generator& generator(int copy);

 private:
  double p_;
  std::uint64_t seed_ = 0;
  std::int64_t first_stream_ = 0;
  int spread_processes_ = 1;
  int spread_copies_ = 0;
  std::array<Generator, kMaxCopies> generators_;
};

}  // namespace dp::nn
