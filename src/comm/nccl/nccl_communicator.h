// src/comm/nccl/nccl_communicator.h — the NCCL communicator: collectives among CUDA
// devices, within one process or across the processes of a job.
//
// Internal to src/comm/nccl/ (the comm layer reaches it through nccl_factory.h and
// world_factory.h only; it includes NCCL and CUDA headers). Rank i of this process is
// devices[i]; one non-blocking ncclComm per device, created together
// (ncclCommInitRankConfig inside one group); every rank is driven by its own thread
// (one thread per GPU, like Caffe's P2PSync or Marian's thread pool). Nothing here
// waits on the host in a step: see Note [NCCL stream ordering]. A watchdog
// (watchdog.h) turns a collective that never completes into an abort of every rank:
// see Note [NCCL failures]. Across processes, one communicator spans every GPU of the
// job, with local() and peers(j) split from it: see Note [NCCL across processes]
// (nccl_world.cpp). The class lives in four rooms:
//   nccl_communicator.cpp  the collectives, join/after_deferred, timing, synchronize
//   nccl_launch.cpp        how a call reaches NCCL: enqueue, groups, issue polling
//   nccl_family.cpp        the error path: abort, reset, the watchdog's probes
//   nccl_world.cpp         making communicators (one process; every GPU of a job)
// with nccl_common.h (NCCL helpers) and nccl_bootstrap.h (creating comms).
// Built only with the CUDA backend (src/comm/nccl/meson.build); nccl_stub.cpp
// stands in otherwise.
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "comm/nccl/nccl_common.h"
#include "comm/nccl/watchdog.h"
#include "dp/comm/communicator.h"

namespace dp::comm::nccl {

// Note [NCCL stream ordering]
// Each device has a communication stream of the highest priority, so a gradient
// bucket's all-reduce overtakes queued backward kernels. A collective called on rank r
// (by the thread that drives device r):
//   1. records `ready` on the device's compute stream (the point where the producer
//      of `send` — e.g. backward — has been enqueued);
//   2. makes the comm stream wait for `ready`, then enqueues the NCCL call on it;
//   3. all_reduce() and the other plain collectives then record `joined` on the comm
//      stream and make the compute stream wait for it, so whatever the thread
//      enqueues next runs after the collective. The deferred ones (Note [Deferred
//      collectives] in communicator.h: a DDP bucket's all-reduce) skip step 3, and
//      join(r) does it once for all of them before the optimizer step — the compute
//      stream never stalls behind a bucket while backward still has kernels to run.
// Memory: a plain collective's buffers are safe for the caching allocator without
// declarations, because the compute stream (their owner) waits for the collective
// before anything enqueued later can reuse them. A deferred collective's buffers
// may be freed by compute work before join() — a bucket view of a gradient buffer
// that a Sharded step releases, say — so the communicator declares both buffers
// with CachingAllocator::record_stream(comm stream): the allocator keeps a freed
// block out of its pool until the comm stream has passed the point of the free. The
// declaration is a map lookup per buffer, and it covers persistent buffers too,
// so no caller has to know which of its buffers are transient.
// One `ready`/`joined` pair per rank suffices: cudaStreamWaitEvent captures the
// event's latest record at call time, and only rank r's thread records them.
// The communicators of one family (a world communicator, its local() and its
// peers(j): Note [NCCL across processes]) share the comm stream of each device.
// NCCL kernels of different communicators running concurrently on one device can
// deadlock when two ranks order them differently (NCCL's "Using multiple NCCL
// communicators concurrently"); on one stream they run in the order the device's
// thread enqueued them, which is the same on every rank because every rank calls the
// family's collectives in the same order (the contract of Communicator, applied to
// the family as a whole).

// Note [NCCL failures]
// A failure must never hang the process. Four rules:
//   - Communicators are non-blocking (config.blocking = 0): a call returns at once,
//     possibly with ncclInProgress, and the rank's thread polls
//     ncclCommGetAsyncError until the call is issued, watching for an abort and for
//     the timeout. With NCCL's lazy connection set-up (>= 2.22) a blocking call
//     would wait inside NCCL for peers that may never come. Initialisation and
//     ncclCommSplit are polled the same way, bounded by the timeout.
//   - No lock that abort() needs is held across an NCCL call. A rank's mutex guards
//     its comm pointer and a `busy` flag; abort() aborts the idle ranks' comms itself
//     (grouped: one thread, several communicators) and leaves a busy rank's comm to
//     that rank's thread, which sees the abort in its poll loop and aborts its own
//     comm before returning — a comm is never aborted under a thread that uses it.
//   - A watchdog (watchdog.h, one thread per family) is told of every collective
//     enqueued, with a CUDA event recorded after it, and polls them with
//     cudaEventQuery and each idle comm with ncclCommGetAsyncError. A collective
//     still running `timeout` after it was enqueued (a peer failed before calling
//     it), a failed one, or an asynchronous NCCL error aborts every rank of every
//     communicator of the family with a reason naming the device, its world rank and
//     the collective; kernels waiting for the missing peer are released by
//     ncclCommAbort, and every later call throws dp::CollectiveAborted until reset().
//     Its decisions are a CUDA-free unit tested on CPU (tests/comm/watchdog_test.cpp);
//     this file only supplies the probes.
//   - A family spanning processes cannot be released or rebuilt by one process: its
//     peers in other processes wait in collectives that this process will never
//     join, and making communicators again is a job-wide collective. So any abort of
//     such a family — the watchdog's, a worker's failure through abort(), a timeout
//     while issuing, a destructor that cannot drain — aborts every local comm of the
//     family (grouped; busy ranks get a moment to abort their own), then ends the
//     job with dp::dist::abort naming the reason: the other processes are killed by
//     the launcher instead of each waiting for its own timeout (Note [Fault policy],
//     src/dist/dist.cpp; the mpi communicator does the same). abort() then never
//     returns, and reset() is never needed.

/// Where a communicator's ranks sit (Note [World ranks]).
struct Layout {
  std::vector<Device> devices;  // devices(): the device of each `rank` argument
  int world_size = 0;
  int first_rank = 0;
  int first_arg = 0;            // the `rank` argument of this process's first comm
  int slots = 0;                // this process's comms: devices[first_arg .. first_arg + slots)
  int first_nccl = 0;           // NCCL rank of slot s: first_nccl + s
  std::vector<int> world_rank;  // world rank (of the job) of each slot, for messages
  std::string name;             // "world", "local" or "peers(j)", for messages
  std::string rank_hint;        // how to pass `rank`, for the out-of-range message
};

class NcclCommunicator;

/// The communicators made from one initialisation — a world communicator and the
/// local() and peers(j) split from it, or one single-process communicator. They share
/// the comm stream of each device (Note [NCCL stream ordering]), one watchdog and one
/// fate (Note [NCCL failures]).
struct Family {
  bool spans_processes = false;
  std::string description;  // "the nccl communicator over 16 GPUs of 2 processes"
  /// Watchdog rank → (member, slot), in add_rank order.
  std::vector<std::pair<NcclCommunicator*, int>> watched;
  std::unique_ptr<Watchdog> watchdog;
  std::once_flag ended;  // the job is ended once
};

/// Aborts `ids` (watchdog ranks) of the family for `reason`; ends the job when the
/// family spans processes. Never throws.
void abort_family(Family& family, const std::vector<int>& ids, const std::string& reason);

/// The NCCL communicator (see the file comment).
class NcclCommunicator final : public Communicator {
 public:
  /// Streams and events for every slot; no comm yet (install() adds them). `streams`:
  /// the comm stream of each slot, or empty to create them.
  NcclCommunicator(Layout layout, const CommOptions& options, std::shared_ptr<Family> family,
                   std::vector<cudaStream_t> streams);
  ~NcclCommunicator() override;

  /// Makes this the family's owner: it stops the watchdog and destroys every comm of
  /// the family, and owns the split communicators.
  void adopt(std::unique_ptr<NcclCommunicator> local, std::vector<std::unique_ptr<NcclCommunicator>> peers);
  /// Gives every slot its comm (ready, made by init_ranks or split_ranks).
  void install(const std::vector<ncclComm_t>& comms);
  std::vector<ncclComm_t> comms();
  std::vector<cudaStream_t> streams() const;
  const Layout& layout() const { return layout_; }
  Device slot_device(int s) const { return devices_[static_cast<std::size_t>(layout_.first_arg + s)]; }
  /// "cuda:3 (world rank 11 of 16)", "cuda:3 (rank 1 of 2 of peers(3); world rank 11)".
  std::string label(int s) const;
  /// Starts the family's watchdog (owner only, once every member is registered).
  void start_watchdog();

  std::string backend_name() const override { return "nccl"; }
  Communicator& local() override { return local_ ? static_cast<Communicator&>(*local_) : *this; }
  Communicator* peers(int rank) override;

  void join(int rank) override;
  // Note [Work after deferred collectives] in communicator.h: on the comm stream, timed
  // as a span of the open window, so the window's exposed time reaches its end.
  void after_deferred(int rank, const std::function<void()>& work) override;
  // Note [Grouped collectives] in communicator.h; Note [NCCL groups] for how.
  void group_start(int rank) override;
  void group_end(int rank) override;
  bool times_on_device() const override { return true; }
  StreamTimes take_times(int rank) override;
  void synchronize(int rank) override;
  void abort(const std::string& reason) override;
  void reset() override;

  // --- the family's side (abort_family and the watchdog's probes; nccl_family.cpp) ---

  /// Marks this communicator aborted (the first reason stays).
  void mark_aborted(const std::string& reason);
  /// Slot s's comm when its thread is not inside an NCCL call (taken: the caller aborts
  /// it); null when busy (its thread aborts it on leaving) or already gone.
  ncclComm_t take_idle(int s);
  /// True once slot s's comm is gone (aborted by abort_family or by its own thread).
  bool released(int s);
  Watchdog::Probe query(int s, Watchdog::Token token);
  std::string async_error(int s);
  void release(int s, Watchdog::Token token);
  /// Waits (polling, bounded by the timeout) until slot s's comm stream is idle.
  /// False on timeout or a CUDA error; never throws.
  bool drain(int s);

 protected:
  void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override;
  void do_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override;
  void do_broadcast(int rank, const Tensor& data, int root) override;
  void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_all_gather(int rank, const Tensor& send, const Tensor& recv) override;

 private:
  /// Note [Collective timing]
  /// Host clocks see only how long enqueueing took. A deferred collective is timed on
  /// the device instead: timing events before and after it on the comm stream, and at
  /// join() one on the compute stream where it starts to wait. busy = the sum of the
  /// collectives' spans; exposed = how long the compute stream waited at join (the
  /// last span's end minus the arrival, when positive); hidden = busy - exposed. A
  /// window is read with cudaEventQuery once complete, never waited for: a step's
  /// figures arrive in a later step.
  struct Window {
    std::vector<std::pair<cudaEvent_t, cudaEvent_t>> spans;
    cudaEvent_t arrived = nullptr;  // compute stream at join()
  };

  // Note [NCCL groups]
  // Between group_start and group_end (Note [Grouped collectives]) the NCCL calls only
  // join the thread's group: NCCL launches them all at ncclGroupEnd, which on a
  // non-blocking communicator may return ncclInProgress and is then polled like any
  // call (wait_issued, Note [NCCL failures]). So the per-call steps of enqueue that
  // must follow the launch move to group_end: the `done` event handed to the watchdog
  // (one for the group, named after its first collective, counting all its elements),
  // the compute stream's wait after plain collectives, and the end of the timing span
  // of deferred ones (one span from the first deferred call to the launch). The steps
  // before the call stay per call: each records `ready` on the compute stream and
  // makes the comm stream wait for it, and since NCCL enqueues the group's kernel on
  // the comm stream only at ncclGroupEnd, that kernel follows every one of those
  // waits. The rank is `busy` from group_start to group_end, so abort() never aborts
  // the comm under a thread whose group holds it; an abort meanwhile is seen by
  // group_end's polling, and leave() then aborts the comm.
  struct Group {
    int depth = 0;                 // open group_start calls; 0 = not grouping
    int calls = 0;                 // collectives issued in the group (count > 0)
    const char* what = nullptr;    // the first one's name (a string literal)
    std::size_t count = 0;         // their elements
    std::size_t bytes = 0;         // their nccl-tests sizes, for the profiler range
    bool any_deferred = false, any_plain = false;
    cudaEvent_t span_end = nullptr;  // the open timing span's end, when deferred
  };

  struct Rank {
    ncclComm_t comm = nullptr;      // null once aborted
    cudaStream_t stream = nullptr;  // owned by the backend, shared by the family
    cudaEvent_t ready = nullptr;    // compute stream → comm stream
    cudaEvent_t joined = nullptr;   // comm stream → compute stream
    // Guards comm, busy, deferred and free_events. Never held across an NCCL call
    // that can wait, so abort() (or the watchdog) can always take it (Note [NCCL
    // failures]); never held while calling into the watchdog.
    std::mutex mu;
    bool busy = false;              // the rank's thread is inside an NCCL call
    bool deferred = false;          // deferred collectives enqueued since the last join
    std::vector<cudaEvent_t> free_events;  // `done` events the watchdog released
    // Timing of deferred collectives (Note [Collective timing]); the rank's threads only.
    Window open;                    // the window since the last join
    std::deque<Window> closed;      // joined, not yet read
    std::vector<cudaEvent_t> free_timing;
    StreamTimes done_times;         // figures of windows already read
    Group group;                    // Note [NCCL groups]; the rank's thread only
  };

  /// What enqueue needs to know of a collective: the NCCL call itself (issue() makes
  /// it) and what surrounds it. group_end's call (the group's `done` event) has no
  /// NCCL call of its own: only what, count and deferred matter there.
  struct Call {
    const char* what;
    Collective kind;
    const void* send;
    void* recv;
    std::size_t count;  // elements; 0 enqueues nothing (the same on every rank)
    Dtype dtype;
    ReduceOp op;
    int root;
    bool deferred;
    Tensor a, b;        // the buffers the collective reads or writes (may be undefined)
    int blocks = 1;     // count x blocks = nccl-tests' size (reduce_scatter, all_gather)
  };

  Rank& slot(int rank) { return ranks_[static_cast<std::size_t>(rank - layout_.first_arg)]; }
  int nccl_rank(int rank) const { return layout_.first_nccl + (rank - layout_.first_arg); }
  std::string abort_reason() const;
  void throw_if_aborted(const char* what, int rank) const;

  // Timing (Note [Collective timing]).
  cudaEvent_t take_event(Rank& rk);  // rk.mu held
  /// A timing-enabled event; the rank's threads only.
  static cudaEvent_t timing_event(Rank& rk);
  static void recycle(Rank& rk, const Window& w);
  static bool complete(cudaEvent_t e);
  static double elapsed_ms(cudaEvent_t from, cudaEvent_t to);

  static Call all_reduce_call(const Tensor& send, const Tensor& recv, ReduceOp op, bool deferred);
  Call reduce_call(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op, bool deferred) const;

  // Launching (nccl_launch.cpp).
  /// ncclAllReduce, ncclBroadcast, ... for `c` on `comm`'s stream `s`.
  static ncclResult_t issue(const Call& c, ncclComm_t comm, cudaStream_t s);
  /// Issues `c` for rank (Note [NCCL stream ordering]) and waits, without any lock,
  /// until NCCL has issued it (Note [NCCL failures]).
  void enqueue(int rank, const Call& c);
  /// Orders rank's comm stream after its compute stream (Note [NCCL stream ordering]);
  /// for a deferred call also declares its buffers to the comm stream and opens its
  /// timing span (one per group). Returns the span to close after the launch, or nulls.
  std::pair<cudaEvent_t, cudaEvent_t> after_compute(int rank, const Call& c, bool grouped);
  /// Polls a non-blocking comm until the call that returned `res` is issued, an abort
  /// came, or the timeout passed (which aborts every rank).
  ncclResult_t wait_issued(ncclComm_t comm, ncclResult_t res, int rank, const char* what);
  /// The rank's thread leaves its NCCL call; if an abort came meanwhile, it aborts its
  /// own comm now (abort() left it alone while busy). Never throws.
  void leave(int rank);
  /// Hands the collective to the watchdog and orders the compute stream after a plain
  /// one.
  void after_issue(int rank, const Call& c);

  const Layout layout_;
  const CommOptions options_;
  const std::shared_ptr<Family> family_;
  std::vector<Rank> ranks_;      // one per slot
  std::vector<int> watch_ids_;   // slot → the family watchdog's rank
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mu_;  // guards reason_
  std::string reason_;
  bool owner_ = false;            // stops the watchdog and destroys the family's comms
  std::unique_ptr<NcclCommunicator> local_;              // world communicators only
  std::vector<std::unique_ptr<NcclCommunicator>> peers_;  // slot j → peers(j)
};

/// The family's watchdog: its probes and its abort go to the members' ranks.
std::unique_ptr<Watchdog> make_watchdog(Family& family, std::chrono::milliseconds timeout);

/// Aborts every comm the family has made so far, grouped, without ending the job: a
/// failed construction, agreed by every process. Never throws.
void discard(Family& family);

}  // namespace dp::comm::nccl
