// src/parallel/reducer.h — the gradient cycle of DataParallel (internal).
//
// The Reducer owns everything between "a parameter's gradient is ready" and "every
// rank holds the gradient the optimizer steps with": bucket assignment, readiness
// counting (the post-accumulate hook), the per-bucket collective on each rank's comm
// thread, and finalize() at the end of each worker's backward. WHICH collective a
// bucket runs is a GradSync strategy the reducer is given — a DP reduce to device 0,
// a DDP all-reduce, and later a sharded reduce-scatter or a two-level reduce —
// so adding a design touches one strategy and its test, never DataParallel's step.
// Knows nothing of modules or optimizers: a rank's gradient is a flat float32 buffer.
//
//   Reducer red(devices, assign_buckets(sizes, first, cap), make_all_reduce(comm), grad_of, rec);
//   red.prepare(true);                // calling thread, before the workers' backward
//   /* hook */ red.mark_ready(r, i);  // worker r: parameter i's gradient is final
//   red.finalize(r);                  // worker r, after its backward; rethrows comm failures
//   red.end();                        // calling thread, after every worker returned
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dp/tensor/tensor.h"
#include "parallel/phase_timer.h"
#include "parallel/worker_pool.h"

namespace dp::comm {
class Communicator;
}

namespace dp::parallel {

/// A run of consecutive parameters: [lo, hi) of the flat gradient buffer.
struct Bucket {
  std::int64_t lo = 0, hi = 0;
  int first_param = 0, num_params = 0;
  bool operator==(const Bucket&) const = default;
};

/// Note [Gradient buckets]
/// Parameters are grouped in REVERSE registration order, because backward produces
/// the last layers' gradients first. The first bucket holds at most `first_cap`
/// elements so the first collective starts early; the others at most `cap`. A bucket
/// closes when the next parameter would push it past its cap; a parameter larger
/// than the cap gets a bucket of its own. The flat buffer holds parameters in
/// registration order, so every bucket is one contiguous slice (no packing copy).
/// Buckets are listed in the order they become ready (last parameters first).
/// Pure; throws dp::Error for caps <= 0 or a negative size.
std::vector<Bucket> assign_buckets(const std::vector<std::int64_t>& param_numel, std::int64_t first_cap,
                                   std::int64_t cap);

/// Elements of float32 in `mib` MiB (at least 1): bucket caps are given in MiB.
std::int64_t mib_to_floats(double mib);

/// How one bucket of gradients is combined across ranks (a design's strategy).
class GradSync {
 public:
  virtual ~GradSync() = default;
  /// For traces and errors: "allreduce", "reduce".
  virtual const char* name() const = 0;
  /// True: each bucket's collective runs on its rank's comm thread as soon as the
  /// bucket is ready, overlapping backward. False: one collective over the whole
  /// buffer, on the worker, once its backward is done.
  virtual bool overlaps_backward() const = 0;
  /// Combines rank's slice `grad` (a bucket, or the whole buffer) with the other ranks'.
  virtual void sync(int rank, const Tensor& grad) = 0;
  /// Whether `rank` holds the combined gradient afterwards.
  virtual bool holds_result(int rank) const = 0;
};

/// DDP: every rank ends with the sum of every rank's bucket.
std::unique_ptr<GradSync> make_all_reduce_sync(comm::Communicator& comm);
/// DP: rank `root` ends with the sum; the other ranks' gradients are left as they were.
std::unique_ptr<GradSync> make_reduce_to_root_sync(comm::Communicator& comm, int root);

/// The gradient cycle (see the file comment and Note [Gradient buckets]).
class Reducer {
 public:
  /// Rank r's flat gradient buffer.
  using GradOf = std::function<Tensor(int rank)>;
  /// Checks [lo, hi) of rank's gradient; throws to fail the step (the finite check).
  using Check = std::function<void(int rank, std::int64_t lo, std::int64_t hi)>;

  Reducer(std::vector<Device> devices, std::vector<Bucket> buckets, std::unique_ptr<GradSync> sync,
          GradOf grad_of, PhaseRecorder& recorder);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const GradSync& strategy() const { return *sync_; }
  /// Tasks handed to the comm threads since construction.
  std::int64_t handoffs() const;
  /// Runs before each bucket's collective on its rank, and after the cycle on every
  /// rank that holds the result (over the whole buffer). Unset: no check.
  void set_check(Check check) { check_ = std::move(check); }
  /// Called on a comm thread whose collective failed (e.g. to abort the communicator
  /// and the reducer, so that no other rank waits for this one).
  void set_failure_hook(ErrorHook hook);

  /// Calling thread, before the workers' backward. `sync` false (no_sync): the
  /// gradients only accumulate locally; hooks count nothing, finalize does nothing.
  void prepare(bool sync);
  /// The post-accumulate hook of parameter `param` on rank `rank`.
  void mark_ready(int rank, int param);
  /// Worker `rank`, after its backward: the buckets still pending (parameters that got
  /// no gradient) become ready, the rank waits for its comm thread (or runs the
  /// whole-buffer collective), and the result is checked. Rethrows a comm failure.
  void finalize(int rank);
  /// Releases every comm thread waiting for a bucket (a worker failed).
  void abort();
  /// Calling thread, after every worker returned: disarms the hooks and waits for the
  /// comm threads (released first), so that none outlives the step, failed or not.
  void end();

 private:
  struct RankState;
  void comm_loop(int rank);
  void finalize_overlapped(int rank);
  void release(int rank);

  std::vector<Device> devices_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_param_;
  std::unique_ptr<GradSync> sync_;
  GradOf grad_of_;
  PhaseRecorder& recorder_;
  Check check_;
  ErrorHook on_failure_;
  std::vector<RankState> ranks_;
  std::unique_ptr<WorkerPool> comm_threads_;  // overlapping strategies with >1 rank
  std::atomic<bool> active_{false};           // hooks count only inside a synced backward
  std::atomic<bool> aborted_{false};
  bool armed_ = false;                        // comm threads launched for this backward
};

}  // namespace dp::parallel
