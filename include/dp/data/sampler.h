// dp/data/sampler.h — which dataset indices an epoch visits, and in what order.
//
// Samplers produce the index list of one epoch; a DataLoader cuts it into batches.
// DistributedSampler gives each of R replicas a disjoint (up to padding) 1/R share with
// PyTorch's semantics. It is for multi-process runs (one process per node under mpirun
// or srun, docs/multi-node.md): without explicit replicas it takes the partition from
// dp::dist (world_size() replicas, this process's rank(); 1 and 0 without a launcher).
// Within one process DataParallel already splits each batch over the local devices, so
// a single-process program needs none: DistributedSampler(n, 2, 0) there trains on half
// of the data. Without shuffling the per-rank lists are exactly PyTorch's; shuffling
// uses dp's own permutation (Fisher-Yates over a splitmix64 stream): deterministic for a
// (seed, epoch) on every machine and rank, but not the order PyTorch would draw. This
// header knows nothing about tensors, nn, optim or DataParallel.
//
//   dp::data::DistributedSampler s(60000, /*num_replicas=*/4, /*rank=*/1);
//   s.set_epoch(3);
//   std::vector<std::int64_t> mine = s.indices();   // 15000 indices for rank 1
//   dp::data::DistributedSampler per_process(60000);  // (world_size, rank) of dp::dist
#pragma once

#include <cstdint>
#include <vector>

namespace dp::data {

/// A random permutation of 0..n-1, a pure function of (n, seed).
std::vector<std::int64_t> random_permutation(std::int64_t n, std::uint64_t seed);

/// Produces the dataset indices of one epoch.
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// The indices of the current epoch, in visiting order.
  virtual std::vector<std::int64_t> indices() const = 0;
  /// Number of indices per epoch (indices().size()).
  virtual std::int64_t size() const = 0;
  /// Selects the epoch; shuffling samplers reseed from (seed, epoch).
  virtual void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The current epoch.
  std::uint64_t epoch() const { return epoch_; }

 protected:
  std::uint64_t epoch_ = 0;
};

/// 0, 1, ..., n-1 every epoch.
class SequentialSampler : public Sampler {
 public:
  /// Throws dp::Error for n < 0.
  explicit SequentialSampler(std::int64_t n);
  /// 0, 1, ..., n-1.
  std::vector<std::int64_t> indices() const override;
  /// n.
  std::int64_t size() const override { return n_; }

 private:
  std::int64_t n_;
};

/// A permutation of 0..n-1 drawn from (seed + epoch): a new order each epoch.
class RandomSampler : public Sampler {
 public:
  /// Throws dp::Error for n < 0.
  explicit RandomSampler(std::int64_t n, std::uint64_t seed = 0);
  /// random_permutation(n, seed + epoch()).
  std::vector<std::int64_t> indices() const override;
  /// n.
  std::int64_t size() const override { return n_; }

 private:
  std::int64_t n_;
  std::uint64_t seed_;
};

/// Settings of a DistributedSampler (PyTorch's names and defaults).
struct DistributedSamplerOptions {
  bool shuffle = true;       ///< permute with (seed + epoch) before splitting
  std::uint64_t seed = 0;    ///< must be the same on every rank
  bool drop_last = false;    ///< drop the tail instead of padding it
};

/// Rank `rank`'s share of an n-example dataset split over `num_replicas` replicas, with
/// torch.utils.data.DistributedSampler's semantics:
///   total = drop_last ? floor(n / R) * R : ceil(n / R) * R;
///   all = shuffle ? random_permutation(n, seed + epoch) : 0..n-1;
///   padded by repeating `all` from its start up to total, or truncated to total;
///   rank r takes all[r], all[r + R], ... (total / R indices).
class DistributedSampler : public Sampler {
 public:
  /// Options of the sampler (see DistributedSamplerOptions).
  using Options = DistributedSamplerOptions;

  /// Throws dp::Error for n < 0, num_replicas < 1, or rank outside [0, num_replicas).
  DistributedSampler(std::int64_t n, std::int64_t num_replicas, std::int64_t rank,
                     Options options = {});
  /// One replica per process of the job: num_replicas = dp::dist::world_size(), rank =
  /// dp::dist::rank() (1 and 0 when not launched by mpirun). Throws dp::Error for n < 0.
  explicit DistributedSampler(std::int64_t n, Options options = {});
  /// This rank's indices for the current epoch (size() of them).
  std::vector<std::int64_t> indices() const override;
  /// Indices per rank per epoch: total_size() / num_replicas().
  std::int64_t size() const override { return num_samples_; }
  /// Indices over all ranks per epoch (after padding or truncation).
  std::int64_t total_size() const { return num_samples_ * num_replicas_; }
  std::int64_t num_replicas() const { return num_replicas_; }  ///< R
  std::int64_t rank() const { return rank_; }                  ///< r
  const Options& options() const { return options_; }          ///< settings

 private:
  std::int64_t n_;
  std::int64_t num_replicas_;
  std::int64_t rank_;
  Options options_;
  std::int64_t num_samples_;
};

}  // namespace dp::data
