// src/parallel/reducer.h — the gradient cycle of DataParallel (internal).
//
// The Reducer owns everything between "a parameter's gradient is ready" and "every
// rank holds the gradient the optimizer steps with": bucket assignment, readiness
// counting (the post-accumulate hook), the per-bucket collective on each rank's comm
// thread, and finalize() at the end of each worker's backward. WHICH collective a
// bucket runs is a GradSync strategy the reducer is given — a DP reduce to device 0,
// a DDP all-reduce, a sharded reduce-scatter, later a two-level reduce — so adding
// a design touches one strategy and its test, never DataParallel's step.
// Knows nothing of modules or optimizers: a rank's gradient is a flat float32 buffer.
//
//   Reducer red(devices, assign_buckets(sizes, first, cap), make_all_reduce_sync(comm), grad_of, rec);
//   red.prepare(true);                // calling thread, before the workers' backward
//   red.begin(r);                     // worker r, before its backward
//   /* hook */ red.mark_ready(r, i);  // worker r: parameter i's gradient is final
//   red.finalize(r);                  // worker r, after its backward; rethrows comm failures
//   red.end();                        // calling thread, after every worker returned
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "dp/core/error.h"
#include "dp/tensor/tensor.h"
#include "parallel/phase_timer.h"
#include "parallel/worker_pool.h"

namespace dp::comm {
class Communicator;
}

namespace dp::parallel {

class GradWire;

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
  /// For traces and errors: "allreduce", "reduce", "reduce_scatter".
  virtual const char* name() const = 0;
  /// True: each bucket's collective runs on its rank's comm thread as soon as the
  /// bucket is ready, overlapping backward. False: one collective over the whole
  /// buffer, on the worker, once its backward is done.
  virtual bool overlaps_backward() const = 0;
  /// The ranks whose gradients it combines: every device of the job when its
  /// communicator spans processes (Note [World ranks]).
  virtual int world_ranks() const = 0;
  /// The dtype its collectives move: float32, or DataParallelOptions' reduce_dtype
  /// (Note [Gradients on the wire] in grad_wire.h).
  virtual Dtype wire_dtype() const { return Dtype::Float32; }
  /// Combines rank's `grad` — elements [offset, offset + grad.numel()) of its flat
  /// gradient buffer: a bucket, or the whole buffer — with the other ranks'.
  virtual void sync(int rank, const Tensor& grad, std::int64_t offset) = 0;
  /// What rank holds of the combined gradient once the cycle is over: `grad` holds
  /// elements [offset, offset + grad.numel()) of the sum; undefined when nothing.
  struct Held {
    std::int64_t offset = 0;
    Tensor grad;
  };
  /// `buffer` is rank's flat gradient buffer.
  virtual Held held(int rank, const Tensor& buffer) const = 0;
  /// Worker `rank`, once its comm thread has issued every bucket: orders the rank's
  /// later work after the collectives (Note [Deferred collectives]).
  virtual void join(int /*rank*/) {}
  /// Device-timed busy and exposed milliseconds of earlier cycles (Note [Collective
  /// timing]), or nothing when the communicator finishes collectives on the host
  /// (then the reducer times its comm threads).
  virtual std::optional<std::pair<double, double>> device_times(int /*rank*/) { return std::nullopt; }
  /// Note [Detached gradients]: combines one parameter's gradient `grad`, a tensor of
  /// its own (no flat buffer behind it) holding elements [offset, offset +
  /// grad.numel()) of the flat layout, and hands rank's part of the result to where
  /// it is kept. Only strategies that keep no full gradient buffer take these.
  virtual void sync_detached(int /*rank*/, const Tensor& /*grad*/, std::int64_t /*offset*/) {
    DP_FAIL("gradient strategy '", name(), "' needs a flat gradient buffer; it got a detached gradient");
  }
  /// Worker `rank`, before its backward (synced or not).
  virtual void begin(int /*rank*/) {}
  /// Worker `rank`, after a synced cycle succeeded (collectives done, result checked).
  virtual void finish(int /*rank*/) {}
};

/// DDP: every rank ends with the sum of every rank's bucket. Every strategy takes an
/// optional `wire`: its collectives then move the wire's 16-bit dtype (Note [Gradients
/// on the wire] in grad_wire.h).
std::unique_ptr<GradSync> make_all_reduce_sync(comm::Communicator& comm, std::shared_ptr<const GradWire> wire = nullptr);
/// DP: rank `root` ends with the sum; the other ranks' gradients are left as they were.
/// Across processes, local rank `root` of every process (Note [DP across processes]).
std::unique_ptr<GradSync> make_reduce_to_root_sync(comm::Communicator& comm, int root,
                                                   std::shared_ptr<const GradWire> wire = nullptr);

/// Where the sharded strategy puts each rank's summed range, and its hooks.
struct ShardedGrads {
  /// World rank w owns [shards[w].first, shards[w].second) of the flat buffer (one
  /// entry per world rank: Note [World ranks]).
  std::vector<std::pair<std::int64_t, std::int64_t>> shards;
  /// Hybrid sharding (Note [Stage 3 across processes] in designs/sharded.cpp): `shards`
  /// has one entry per LOCAL rank, the ranges are replicated in every process, and a
  /// piece is reduced onto its local owner, which then all-reduces it with the owners
  /// of the same range in the other processes (comm.peers(owner)).
  bool hybrid = false;
  /// Stage 1: each rank zeroes the pieces it sent to their owners (its buffer then
  /// holds its own range's sum and zeros elsewhere). Stage 2 frees the buffer instead.
  bool zero_sent = true;
  /// Worker r, before every backward (synced or not): e.g. make its full gradient
  /// buffer exist again (stage 2). May be empty.
  std::function<void(int rank)> before_backward;
  /// Worker r, after its synced cycle: e.g. free its full gradient buffer (stage 2).
  /// May be empty.
  std::function<void(int rank)> after_sync;
  /// Detached gradients (Note [Detached gradients]): adds the summed `piece`,
  /// elements [offset, offset + piece.numel()) of rank's own range, into the gradient
  /// rank keeps for its range; runs on rank's comm thread, on the stream of its
  /// collectives (Note [Work after deferred collectives] in dp/comm/communicator.h).
  /// Needed for detached cycles.
  std::function<void(int rank, const Tensor& piece, std::int64_t offset)> deliver;
  /// Detached gradients, optional: called with each piece of rank's gradient before it
  /// is reduced onto `owner` (world rank), `offset` its first element in the flat
  /// buffer; may add into the piece (Note [Accumulating after a combined backward] in
  /// design.cpp). Runs on rank's comm thread.
  std::function<void(int rank, Tensor& piece, std::int64_t offset, int owner)> carry_in;
  /// Detached gradients: the gradient rank keeps for its own range (what held()
  /// returns when rank has no full buffer).
  std::function<Tensor(int rank)> owned;
};

/// Note [Sharded gradients]
/// Sharded data parallelism (ZeRO stages 1 and 2): rank r ends with the sum over
/// ranks of its own range only. A bucket [lo, hi) is cut at the shard boundaries into
/// pieces, and each piece is reduced onto the rank that owns it — a reduce-scatter
/// with per-rank counts, as one reduce per piece (NCCL would group them). The
/// Communicator's reduce_scatter takes equal counts, which a bucket of whole
/// parameters cut by element-exact shards (Note [Sharded parameter sets]) does not
/// have; padding every bucket to a multiple of the ranks (FSDP's layout) would give
/// each rank a strided, not contiguous, range. A backward makes #buckets + at most
/// N - 1 collectives (a bucket gains one piece per shard boundary inside it). Every
/// element is summed in the fixed rank order of the local all-reduce, so the sum is
/// bitwise DDP's. The owner's piece is reduced in place. The reduces are deferred
/// (Note [Deferred reduce-scatter] in reducer.cpp): the compute stream waits at join.
/// Stage 1 (zero_sent): every other rank zeroes its piece once it was sent, so each
/// rank's buffer holds the summed gradient on its own range and zeros elsewhere: a
/// next backward without zero_grad accumulates onto it and its reduction stays exact.
/// Stage 2: after the cycle after_sync moves the rank's range out of its buffer and
/// frees the buffer; before_backward brings it back (zeros, the range restored), so
/// gradients accumulate the same way.
std::unique_ptr<GradSync> make_reduce_scatter_sync(comm::Communicator& comm, ShardedGrads grads,
                                                   std::shared_ptr<const GradWire> wire = nullptr);

/// Note [Detached gradients]
/// ZeRO stage 2 keeps no full gradient buffer during a synced backward: a parameter's
/// gradient is the tensor its node's backward made, adopted as its .grad (Note
/// [Adopting a gradient] in src/autograd/node.cpp); the post-accumulate hook takes it
/// away from the parameter (grad_ready), and the rank's comm thread reduce-scatters
/// it, parameter by parameter in bucket order, straight into the owners' range
/// gradients (ShardedGrads::deliver adds the summed piece), then frees it. A rank
/// thus holds at most the gradients of the buckets not yet combined — bounded by
/// bucket_cap_mb, DeepSpeed's reduce_bucket_size — and never a buffer of the whole
/// model. Buckets still decide when a collective starts (a bucket is combined once
/// all its parameters are ready, in index order on every rank), so every rank makes
/// the same sequence of collectives. A parameter with no gradient on a rank (unused
/// in its forward, or no rows) sends zeros. Each element is still summed in the fixed
/// rank order, and the sum lands on a zeroed range gradient (0 + s == s), so the
/// result is bitwise what the flat-buffer path and DDP compute. A cycle is detached
/// when the rank's gradient buffer (GradOf) is undefined at begin(): a backward
/// after no_sync ones, which accumulated into a full buffer, takes the flat path.

/// The gradient cycle (see the file comment and Note [Gradient buckets]).
class Reducer {
 public:
  /// Rank r's flat gradient buffer.
  using GradOf = std::function<Tensor(int rank)>;
  /// Checks rank's gradient `grad`, elements [offset, offset + grad.numel()) of the
  /// flat buffer; throws to fail the step (the finite check).
  using Check = std::function<void(int rank, const Tensor& grad, std::int64_t offset)>;

  Reducer(std::vector<Device> devices, std::vector<Bucket> buckets, std::unique_ptr<GradSync> sync,
          GradOf grad_of, PhaseRecorder& recorder);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const GradSync& strategy() const { return *sync_; }
  /// Tasks handed to the comm threads since construction.
  std::int64_t handoffs() const;
  /// Bytes of gradient rank handed to its collectives since construction: each
  /// synced bucket's elements at the strategy's wire_dtype() (Stats::grad_bytes).
  std::int64_t grad_bytes(int rank) const;
  /// Runs before each bucket's collective on its rank, and after the cycle on every
  /// rank over what it holds of the result (GradSync::held). Unset: no check.
  void set_check(Check check) { check_ = std::move(check); }
  /// Called on a comm thread whose collective failed (e.g. to abort the communicator
  /// and the reducer, so that no other rank waits for this one).
  void set_failure_hook(ErrorHook hook);

  /// Calling thread, before the workers' backward. `sync` false (no_sync): the
  /// gradients only accumulate locally; hooks count nothing, finalize does nothing.
  void prepare(bool sync);
  /// Worker `rank`, before its backward (synced or not): the strategy's preparation;
  /// then, in a synced backward, the cycle is detached when rank has no gradient
  /// buffer (Note [Detached gradients]).
  void begin(int rank);
  /// The post-accumulate hook of parameter `param` on rank `rank`.
  void mark_ready(int rank, int param);
  /// Note [Detached gradients]: element [offset, offset + numel) of the flat layout per
  /// parameter, in registration order. Needed before any detached cycle.
  void set_param_layout(std::vector<std::pair<std::int64_t, std::int64_t>> params) {
    params_ = std::move(params);
  }
  /// The post-accumulate hook when gradients may be detached: in a detached cycle of
  /// rank (rank's gradient buffer, grad_of(rank), is undefined), takes `leaf`'s .grad
  /// away from it — the comm thread combines it and frees it — then marks it ready.
  void grad_ready(int rank, int param, const Tensor& leaf);
  /// Worker `rank`: waits until the buckets already complete on rank that the comm
  /// thread can take in order (the leading run of them) were combined (or the cycle was
  /// aborted), so that no more than the gradients still being made are held; never
  /// waits for work that needs this worker's further backward. A no-op when nothing
  /// runs on a comm thread.
  void wait_combined(int rank);
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
  void sync_bucket(int rank, const Bucket& bk, Tensor& grad);
  /// Counts `numel` gradient elements sent by rank; returns their bytes on the wire.
  std::int64_t count_bytes(int rank, std::int64_t numel);
  void finalize_inline(int rank);
  void sync_bucket_detached(int rank, const Bucket& bk);
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
  std::vector<std::pair<std::int64_t, std::int64_t>> params_;  // (offset, numel) per parameter
  std::unique_ptr<WorkerPool> comm_threads_;  // overlapping strategies with >1 rank
  std::atomic<bool> active_{false};           // hooks count only inside a synced backward
  std::atomic<bool> aborted_{false};
  bool armed_ = false;                        // comm threads launched for this backward
};

}  // namespace dp::parallel
