#include "dp/data/dataloader.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "dp/core/error.h"

namespace dp::data {
namespace detail {

// Note [Loader threads]
// The assembling workers are dedicated std::threads, not oneTBB tasks. A worker spends
// most of its life blocked: waiting for room in the prefetch window while the devices
// compute. oneTBB's pool has cores − 1 threads shared by every task arena, and the CPU
// backend's device arenas draw their kernel threads from it; a TBB thread parked in a
// loader wait is one the kernels cannot have (on 2 cores, the only one: a one-device
// run would lose half its cores while the window is full). TBB tasks handing batches
// across threads would also hide their synchronisation from ThreadSanitizer, which
// checks this file. So the workers are plain threads that sleep on a condition
// variable, and the kernels a dataset runs inside get_batch still use the arenas.

// Note [Deterministic prefetch]
// Workers claim batch numbers from one counter, in increasing order, and only while the
// claimed number stays inside the window [next_consume_, next_consume_ + prefetch). A
// finished batch k goes to slot k % prefetch, which no other in-window batch shares, and
// the consumer takes slot next_consume_ only. So batch k is always
// get_batch(indices[k*B, (k+1)*B)), whatever the timing, and at most `prefetch` batches
// exist ahead of the consumer. Claims in increasing order also mean that when batch e
// fails, every batch before e was already claimed and will still be delivered; only
// new claims stop.
class LoaderRun {
 public:
  LoaderRun(std::shared_ptr<const Dataset> dataset, std::vector<std::int64_t> indices,
            const DataLoaderOptions& options, std::uint64_t epoch, std::int64_t start)
      : dataset_(std::move(dataset)),
        indices_(std::move(indices)),
        batch_size_(options.batch_size),
        epoch_(epoch),
        window_(options.prefetch),
        pin_memory_(options.pin_memory),
        start_(start),
        next_claim_(start),
        next_consume_(start) {
    const auto n = static_cast<std::int64_t>(indices_.size());
    num_batches_ = options.drop_last ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
    const int workers = static_cast<int>(std::min<std::int64_t>(
        options.num_workers, std::min<std::int64_t>(window_, num_batches_ - start)));
    if (workers == 0) return;
    slots_.resize(static_cast<std::size_t>(window_));
    try {
      for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
    } catch (const std::system_error& e) {
      shutdown();
      DP_FAIL("DataLoader: could not start worker thread ", threads_.size() + 1, " of ", workers,
              ": ", e.what(), " (use fewer num_workers, or 0)");
    }
  }

  ~LoaderRun() { shutdown(); }

  LoaderRun(const LoaderRun&) = delete;
  LoaderRun& operator=(const LoaderRun&) = delete;

  // The batch the pass started at.
  std::int64_t start() const { return start_; }

  // Stores the next batch in `out` and returns true, or returns false at the end of the
  // pass. Throws dp::Error when assembling the batch failed.
  bool next(Batch& out) {
    if (next_consume_ >= num_batches_) return false;
    const std::int64_t k = next_consume_;
    if (threads_.empty()) {  // num_workers == 0: assemble on this thread
      std::exception_ptr error;
      try {
        out = assemble(k);
      } catch (...) {
        error = std::current_exception();
      }
      if (error) fail(k, error);
      ++next_consume_;
      return true;
    }
    Slot taken;
    {
      std::unique_lock<std::mutex> lock(mu_);
      Slot& slot = slots_[static_cast<std::size_t>(k % window_)];
      ready_cv_.wait(lock, [&] { return slot.ready; });
      taken = std::move(slot);
      slot = Slot{};
      ++next_consume_;
    }
    work_cv_.notify_all();  // the window moved: a worker may claim one more batch
    if (taken.error) fail(k, taken.error);
    out = std::move(taken.batch);
    return true;
  }

 private:
  struct Slot {
    bool ready = false;
    Batch batch;
    std::exception_ptr error;
  };

  Batch assemble(std::int64_t k) const {
    const std::int64_t first = k * batch_size_;
    const std::int64_t count =
        std::min<std::int64_t>(batch_size_, static_cast<std::int64_t>(indices_.size()) - first);
    Batch batch = dataset_->get_batch(std::span<const std::int64_t>(
        indices_.data() + first, static_cast<std::size_t>(count)));
    if (pin_memory_) {  // on this worker thread, off the consumer's critical path
      batch.data = batch.data.pin_memory();
      batch.target = batch.target.pin_memory();
    }
    return batch;
  }

  [[noreturn]] void fail(std::int64_t k, const std::exception_ptr& error) const {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      DP_FAIL("DataLoader: assembling batch ", k, " of ", num_batches_, " (epoch ", epoch_,
              ") failed: ", e.what());
    } catch (...) {
      DP_FAIL("DataLoader: assembling batch ", k, " of ", num_batches_, " (epoch ", epoch_,
              ") failed with an exception that is not a std::exception");
    }
  }

  void work() {
    for (;;) {
      std::int64_t k = 0;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] {
          return stop_ || next_claim_ >= num_batches_ || next_claim_ < next_consume_ + window_;
        });
        if (stop_ || next_claim_ >= num_batches_) return;
        k = next_claim_++;
      }
      Slot done;
      try {
        done.batch = assemble(k);
      } catch (...) {
        done.error = std::current_exception();
      }
      done.ready = true;
      const bool failed = done.error != nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (failed) stop_ = true;  // no new claims; earlier batches still arrive
        slots_[static_cast<std::size_t>(k % window_)] = std::move(done);
      }
      ready_cv_.notify_one();  // only the consumer waits on ready_cv_
      if (failed) work_cv_.notify_all();  // idle workers exit
    }
  }

  // Stops new claims and joins the workers; each finishes at most the batch in hand.
  void shutdown() noexcept {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }

  std::shared_ptr<const Dataset> dataset_;
  std::vector<std::int64_t> indices_;
  std::int64_t batch_size_;
  std::uint64_t epoch_;
  std::int64_t window_;
  bool pin_memory_;
  std::int64_t start_;
  std::int64_t num_batches_ = 0;

  std::mutex mu_;
  std::condition_variable work_cv_;   // workers wait for room in the window
  std::condition_variable ready_cv_;  // the consumer waits for its slot
  std::vector<Slot> slots_;           // window_ slots, batch k in k % window_
  std::int64_t next_claim_;           // guarded by mu_
  std::int64_t next_consume_;         // written by the consumer under mu_
  bool stop_ = false;                 // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace detail

namespace {

void check_options(const DataLoaderOptions& o) {
  DP_CHECK(o.batch_size >= 1, "DataLoader: expected batch_size >= 1, got ", o.batch_size);
  DP_CHECK(o.num_workers >= 0, "DataLoader: expected num_workers >= 0 (0 = load on the "
           "consumer's thread), got ", o.num_workers);
  DP_CHECK(o.prefetch >= 1, "DataLoader: expected prefetch >= 1 (batches assembled ahead), got ",
           o.prefetch);
}

}  // namespace

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, Options options)
    : dataset_(std::move(dataset)), options_(options) {
  DP_CHECK(dataset_ != nullptr, "DataLoader: expected a dataset, got a null pointer");
  check_options(options_);
  if (options_.shuffle) {
    sampler_ = std::make_shared<RandomSampler>(dataset_->size(), options_.seed);
  } else {
    sampler_ = std::make_shared<SequentialSampler>(dataset_->size());
  }
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
                       Options options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(options) {
  DP_CHECK(dataset_ != nullptr, "DataLoader: expected a dataset, got a null pointer");
  DP_CHECK(sampler_ != nullptr, "DataLoader: expected a sampler, got a null pointer");
  DP_CHECK(!options_.shuffle && options_.seed == 0,
           "DataLoader: shuffle and seed are set by the sampler when one is given; expected "
           "shuffle = false and seed = 0, got shuffle = ", options_.shuffle, ", seed = ",
           options_.seed, " (configure the sampler instead)");
  check_options(options_);
}

std::int64_t DataLoader::size() const {
  const std::int64_t n = sampler_->size();
  const std::int64_t b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

void DataLoader::set_position(std::uint64_t epoch, std::int64_t batch) {
  const std::int64_t n = size();
  DP_CHECK(batch >= 0 && batch <= n, "DataLoader::set_position: expected a batch in [0, ", n,
           "] (", n, " batches per epoch), got ", batch);
  epoch_ = epoch;
  start_batch_ = batch;
}

DataLoader::Iterator DataLoader::begin() {
  const std::uint64_t epoch = epoch_++;
  const std::int64_t start = start_batch_;
  start_batch_ = 0;
  sampler_->set_epoch(epoch);
  std::vector<std::int64_t> indices = sampler_->indices();
  return Iterator(std::make_unique<detail::LoaderRun>(dataset_, std::move(indices), options_,
                                                      epoch, start));
}

DataLoader::Iterator::Iterator() = default;
DataLoader::Iterator::Iterator(Iterator&& other) noexcept = default;
DataLoader::Iterator& DataLoader::Iterator::operator=(Iterator&& other) noexcept = default;
DataLoader::Iterator::~Iterator() = default;

DataLoader::Iterator::Iterator(std::unique_ptr<detail::LoaderRun> run)
    : run_(std::move(run)), index_(run_->start() - 1) {
  advance();
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  DP_CHECK(run_ != nullptr, "DataLoader::Iterator: cannot advance past the end of a pass");
  advance();
  return *this;
}

void DataLoader::Iterator::advance() {
  batch_ = Batch{};
  bool more = false;
  try {
    more = run_->next(batch_);
  } catch (...) {
    run_.reset();  // stop and join the workers before the error leaves the loop
    throw;
  }
  if (more) {
    ++index_;
  } else {
    run_.reset();
  }
}

}  // namespace dp::data
