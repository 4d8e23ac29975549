// dp/data/dataloader.h — batches of a dataset, assembled ahead of time on worker threads.
//
// A DataLoader cuts one epoch's sampler indices into batches and has background
// worker threads (dedicated threads, not oneTBB's compute pool: Note [Loader threads])
// assemble them into a bounded prefetch window. Batch k of an epoch is always
// dataset.get_batch(indices[k*B, (k+1)*B)): order and content never depend on thread
// timing, the worker count or the prefetch depth. Leaving a loop early stops and joins
// the workers; an exception thrown while assembling batch k reaches the consumer as a
// dp::Error when it arrives at batch k. This header knows nothing about nn, optim,
// autograd or DataParallel: batches are host tensors on cpu(0). With pin_memory the
// workers also copy each batch into pinned host memory, so that its copies to CUDA
// devices (DataParallel copies each shard straight to its device) do not make the host
// wait. A resumed run starts mid-epoch with set_position(epoch, batch) and never
// assembles the batches it skips. A loader owns no random generator: a shuffled
// epoch's order is a pure function of (seed, epoch) (RandomSampler,
// DistributedSampler), so (epoch, batch) is all a checkpoint needs to resume it.
//
//   dp::data::DataLoader loader(dataset, {.batch_size = 128, .shuffle = true, .seed = 7});
//   for (std::uint64_t epoch = 0; epoch < 10; ++epoch) {
//     loader.set_epoch(epoch);
//     for (auto& [x, y] : loader) { /* x: (B, ...) float32, y: (B) int64 */ }
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>

#include "dp/data/dataset.h"
#include "dp/data/sampler.h"

namespace dp::data {

namespace detail {
class LoaderRun;
}  // namespace detail

/// Settings of a DataLoader.
struct DataLoaderOptions {
  std::int64_t batch_size = 64;  ///< examples per batch (the last one may be smaller)
  bool shuffle = false;          ///< visit a new permutation each epoch (RandomSampler)
  std::uint64_t seed = 0;        ///< permutation seed when shuffling
  bool drop_last = false;        ///< drop a last batch smaller than batch_size
  /// Background threads assembling batches; 0 assembles each batch on the consumer's
  /// thread when it is asked for (no threads, handy for debugging).
  int num_workers = 2;
  /// Depth of the bounded prefetch window: at most this many batches are assembled or
  /// waiting ahead of the one the consumer holds (so at most min(num_workers, prefetch)
  /// workers are busy at once, and memory stays bounded).
  int prefetch = 2;
  /// Copy every batch into pinned (page-locked) host memory on the worker thread
  /// (torch's pin_memory), so host→CUDA copies of it are asynchronous. On a machine
  /// without a CUDA device, pinned memory is ordinary host memory.
  bool pin_memory = false;
};

/// Iterates a Dataset in batches (see the file comment). Not thread-safe itself: one
/// thread iterates a loader at a time.
class DataLoader {
 public:
  /// Options of the loader (see DataLoaderOptions).
  using Options = DataLoaderOptions;
  class Iterator;

  /// Samples with SequentialSampler, or RandomSampler(size, seed) when shuffle is set.
  /// Throws dp::Error for a null dataset, batch_size < 1, num_workers < 0 or
  /// prefetch < 1.
  explicit DataLoader(std::shared_ptr<const Dataset> dataset, Options options = {});
  /// Samples with `sampler` (e.g. a DistributedSampler); options.shuffle and
  /// options.seed must be left at their defaults (the sampler decides the order).
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
             Options options = {});

  /// Not copyable (a pass in flight would be ambiguous); hold it by value or pointer.
  DataLoader(const DataLoader&) = delete;
  /// Not copyable.
  DataLoader& operator=(const DataLoader&) = delete;

  /// Number of batches per epoch.
  std::int64_t size() const;
  /// Sets the epoch the next begin() uses; each begin() then advances it by one, so a
  /// shuffled loader reshuffles every pass. The epoch reaches the sampler's set_epoch.
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The epoch the next begin() uses.
  std::uint64_t epoch() const { return epoch_; }
  /// Makes the next pass start at batch `batch` of epoch `epoch` — resuming from a
  /// checkpoint (TrainingState::epoch and ::batch). The skipped batches are never
  /// assembled, and Iterator::index() counts from `batch`; later passes start at 0.
  /// batch == size() is an epoch already finished (the pass yields nothing). Throws
  /// dp::Error unless 0 <= batch <= size().
  void set_position(std::uint64_t epoch, std::int64_t batch);
  /// The batch the next begin() starts at (0 unless set_position set it).
  std::int64_t start_batch() const { return start_batch_; }

  /// Starts a pass over the current epoch: snapshots the sampler's indices, starts the
  /// workers and waits for batch 0 (throws its dp::Error if assembling it failed).
  Iterator begin();
  /// The end of a pass.
  std::default_sentinel_t end() const { return {}; }

  /// The dataset read from.
  const std::shared_ptr<const Dataset>& dataset() const { return dataset_; }
  /// The sampler deciding the order.
  const std::shared_ptr<Sampler>& sampler() const { return sampler_; }
  /// The settings.
  const Options& options() const { return options_; }

 private:
  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<Sampler> sampler_;
  Options options_;
  std::uint64_t epoch_ = 0;
  std::int64_t start_batch_ = 0;
};

/// An input iterator over one pass; owns the pass's workers. Move-only. Destroying it
/// (e.g. leaving a range-for early) stops the workers and joins them.
class DataLoader::Iterator {
 public:
  using iterator_category = std::input_iterator_tag;  ///< single pass
  using value_type = Batch;                           ///< yields batches
  using difference_type = std::ptrdiff_t;             ///< required by the iterator concepts
  using pointer = Batch*;                             ///< see operator->
  using reference = Batch&;                           ///< see operator*

  /// An iterator already at the end.
  Iterator();
  /// Takes over the pass (and its workers).
  Iterator(Iterator&& other) noexcept;
  /// Ends this iterator's pass (joining its workers), then takes over other's.
  Iterator& operator=(Iterator&& other) noexcept;
  /// Stops and joins the pass's workers; never throws.
  ~Iterator();

  /// The current batch (the iterator owns it; moving it out is allowed).
  Batch& operator*() { return batch_; }
  /// Member access to the current batch.
  Batch* operator->() { return &batch_; }
  /// Advances to the next batch, waiting for it; throws dp::Error when assembling it
  /// failed (the iterator is then at the end).
  Iterator& operator++();
  /// Number of the current batch within the epoch (0-based).
  std::int64_t index() const { return index_; }
  /// True once the pass is over.
  friend bool operator==(const Iterator& it, std::default_sentinel_t) { return it.run_ == nullptr; }

 private:
  friend class DataLoader;
  explicit Iterator(std::unique_ptr<detail::LoaderRun> run);
  void advance();

  std::unique_ptr<detail::LoaderRun> run_;  // null at the end
  Batch batch_;
  std::int64_t index_ = -1;
};

}  // namespace dp::data
