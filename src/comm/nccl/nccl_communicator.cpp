// The NCCL communicator: collectives among the local CUDA devices of one process.
//
// Rank i is devices[i]; one non-blocking ncclComm per device, created together
// (ncclCommInitRankConfig inside one group); every rank is driven by its own thread
// (one thread per GPU, like Caffe's P2PSync or Marian's thread pool). Nothing here
// waits on the host in a step: see Note [NCCL stream ordering]. A watchdog thread
// turns a collective that never completes into an abort of every rank: see Note
// [NCCL failures]. Built only with the CUDA backend (src/comm/nccl/meson.build), whose
// internal headers it uses for streams, devices and the allocator; nccl_stub.cpp
// stands in otherwise.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "comm/nccl_factory.h"
#include "comm/world_factory.h"
#include "dp/core/error.h"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0),
              "dp needs NCCL >= 2.14 (non-blocking communicators, ncclAvg)");

namespace dp::comm {

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

// Note [NCCL failures]
// A failure must never hang the process. Three rules:
//   - Communicators are non-blocking (config.blocking = 0): a call returns at once,
//     possibly with ncclInProgress, and the rank's thread polls
//     ncclCommGetAsyncError until the call is issued, watching for an abort and for
//     the timeout. With NCCL's lazy connection set-up (>= 2.22) a blocking call
//     would wait inside NCCL for peers that may never come.
//   - No lock that abort() needs is held across an NCCL call. A rank's mutex guards
//     its comm pointer and a `busy` flag; abort() aborts the idle ranks' comms itself
//     (grouped: one thread, several communicators) and leaves a busy rank's comm to
//     that rank's thread, which sees the abort in its poll loop and aborts its own
//     comm before returning — a comm is never aborted under a thread that uses it.
//   - A watchdog thread polls each rank's pending collectives with cudaEventQuery
//     and each idle comm with ncclCommGetAsyncError. A collective still running
//     `timeout` after it was enqueued (a peer failed before calling it), or an
//     asynchronous NCCL error, aborts every rank with a reason naming the device and
//     the collective; kernels waiting for the missing peer are released by
//     ncclCommAbort, and every later call throws dp::CollectiveAborted until reset().

namespace {

using Clock = std::chrono::steady_clock;

ncclRedOp_t to_nccl(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclAvg; }

backend::CudaBackend& cuda() { return backend::CudaBackend::instance(); }

/// "" when t is a defined float32 tensor on `dev`, else why not.
std::string tensor_problem(const Tensor& t, const char* name, Device dev) {
  if (!t.defined()) return dp::detail::str_cat(name, " is undefined; pass a float32 tensor on ", dev);
  if (t.dtype() != Dtype::Float32)
    return dp::detail::str_cat(name, " has dtype ", dtype_name(t.dtype()),
                               "; collectives take float32 tensors");
  if (t.device() != dev)
    return dp::detail::str_cat(name, " lives on ", t.device(), " but this rank's device is ",
                               dev, "; move it with .to(", dev, ")");
  return {};
}

/// Logs a failed NCCL call on a cleanup path (never throws).
void warn_nccl(ncclResult_t res, const char* what, Device dev) {
  if (res != ncclSuccess && res != ncclInProgress)
    dp::detail::log_warning(dp::detail::str_cat(what, " on ", dev, " failed: ", ncclGetErrorString(res)));
}

/// Sleeps a little longer each round, up to 1 ms: polling loops stay cheap when a
/// call is issued at once and never burn a core while waiting for a slow peer.
class Backoff {
 public:
  void pause() {
    if (spins_ < 64) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    delay_us_ = std::min(delay_us_ * 2, 1000);
  }

 private:
  int spins_ = 0;
  int delay_us_ = 10;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::vector<Device> devices, const CommOptions& options)
      : Communicator(std::move(devices)), options_(options), ranks_(devices_.size()) {
    backend::CudaBackend& cb = cuda();
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const int dev = devices_[r].index;
      cb.set_device(dev);
      int least = 0, greatest = 0;  // greatest = numerically lowest = runs first
      DP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      ranks_[r].stream = cb.create_stream(dev, greatest);
      DP_CUDA_CHECK(cudaEventCreateWithFlags(&ranks_[r].ready, cudaEventDisableTiming));
      DP_CUDA_CHECK(cudaEventCreateWithFlags(&ranks_[r].joined, cudaEventDisableTiming));
    }
    init_comms();
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      stop_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
    // Finish what was enqueued, unless that cannot end (then abort); never throw.
    if (!aborted_.load(std::memory_order_acquire)) {
      for (int r = 0; r < size(); ++r) {
        if (!drain(r)) {
          abort("the communicator was destroyed while a collective could not finish");
          break;
        }
      }
    }
    destroy_comms();
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rk = ranks_[r];
      for (const Pending& p : rk.pending) release_event(rk, p);
      for (cudaEvent_t e : rk.free_events) DP_CUDA_WARN(cudaEventDestroy(e));
      for (const Window& w : rk.closed) recycle(rk, w);
      recycle(rk, rk.open);
      for (cudaEvent_t e : rk.free_timing) DP_CUDA_WARN(cudaEventDestroy(e));
      if (rk.ready != nullptr) DP_CUDA_WARN(cudaEventDestroy(rk.ready));
      if (rk.joined != nullptr) DP_CUDA_WARN(cudaEventDestroy(rk.joined));
      // The stream belongs to the backend (Note [Process-lifetime CUDA objects]).
    }
  }

  std::string backend_name() const override { return "nccl"; }

  void all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    all_reduce_impl(rank, send, recv, op, /*deferred=*/false);
  }
  void all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    all_reduce_impl(rank, send, recv, op, /*deferred=*/true);
  }

  void broadcast(int rank, const Tensor& data, int root) override {
    check_rank(rank, "broadcast");
    check_root(root, "broadcast");
    check_tensor(data, "data", devices_[rank], "broadcast");
    const std::size_t count = static_cast<std::size_t>(data.numel());
    void* p = data.raw_data();
    enqueue(rank, {"broadcast", count, false, data, Tensor()}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(p, p, count, ncclFloat, root, c, s);
    });
  }

  void reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
    reduce_impl(rank, send, recv, root, op, /*deferred=*/false);
  }
  void reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
    reduce_impl(rank, send, recv, root, op, /*deferred=*/true);
  }

  void reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    check_rank(rank, "reduce_scatter");
    const Device dev = devices_[rank];
    check_tensor(send, "send", dev, "reduce_scatter");
    check_tensor(recv, "recv", dev, "reduce_scatter");
    DP_CHECK(send.numel() == recv.numel() * size(), "reduce_scatter on ", dev, ": recv has ",
             recv.numel(), " elements and send ", send.numel(), "; reduce_scatter needs send = ",
             size(), " x recv");
    const std::size_t recv_count = static_cast<std::size_t>(recv.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    enqueue(rank, {"reduce_scatter", recv_count, false, send, recv}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(sp, rp, recv_count, ncclFloat, to_nccl(op), c, s);
    });
  }

  void all_gather(int rank, const Tensor& send, const Tensor& recv) override {
    check_rank(rank, "all_gather");
    const Device dev = devices_[rank];
    check_tensor(send, "send", dev, "all_gather");
    check_tensor(recv, "recv", dev, "all_gather");
    DP_CHECK(recv.numel() == send.numel() * size(), "all_gather on ", dev, ": recv has ",
             recv.numel(), " elements and send ", send.numel(), "; all_gather needs recv = ",
             size(), " x send");
    const std::size_t send_count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    enqueue(rank, {"all_gather", send_count, false, send, recv}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(sp, rp, send_count, ncclFloat, c, s);
    });
  }

  void join(int rank) override {
    check_rank(rank, "join");
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      throw_if_aborted("join", rank);
      if (!rk.deferred) return;
      rk.deferred = false;
    }
    backend::CudaBackend& cb = cuda();
    const int dev = devices_[rank].index;
    cb.set_device(dev);
    cudaStream_t compute = cb.compute_stream(dev);
    DP_CUDA_CHECK(cudaEventRecord(rk.joined, rk.stream));
    if (!rk.open.spans.empty()) {
      rk.open.arrived = timing_event(rk);
      DP_CUDA_CHECK(cudaEventRecord(rk.open.arrived, compute));
      rk.closed.push_back(std::move(rk.open));
      rk.open = Window{};
    }
    DP_CUDA_CHECK(cudaStreamWaitEvent(compute, rk.joined, 0));
  }

  bool times_on_device() const override { return true; }

  StreamTimes take_times(int rank) override {
    check_rank(rank, "take_times");
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    cuda().set_device(devices_[rank].index);
    while (!rk.closed.empty()) {
      Window& w = rk.closed.front();
      const cudaEvent_t last = w.spans.back().second;
      if (!complete(w.arrived) || !complete(last)) break;
      double busy = 0;
      for (const auto& [a, b] : w.spans) busy += elapsed_ms(a, b);
      rk.done_times.busy_ms += busy;
      rk.done_times.exposed_ms += std::max(0.0, elapsed_ms(w.arrived, last));
      ++rk.done_times.windows;
      recycle(rk, w);
      rk.closed.pop_front();
    }
    return std::exchange(rk.done_times, StreamTimes{});
  }

  void synchronize(int rank) override {
    check_rank(rank, "synchronize");
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    cuda().set_device(devices_[rank].index);
    // Polled, not cudaStreamSynchronize: an abort (by the watchdog or another rank's
    // failure) must be able to end the wait.
    DP_CUDA_CHECK(cudaEventRecord(rk.joined, rk.stream));
    Backoff backoff;
    cudaError_t state = cudaEventQuery(rk.joined);
    while (state == cudaErrorNotReady && !aborted_.load(std::memory_order_acquire)) {
      backoff.pause();
      state = cudaEventQuery(rk.joined);
    }
    if (state == cudaErrorNotReady) (void)cudaGetLastError();
    std::lock_guard<std::mutex> lock(rk.mu);
    throw_if_aborted("synchronize", rank);  // an abort explains a failed wait best
    DP_CUDA_CHECK(state);
    ncclResult_t async = ncclSuccess;
    DP_NCCL_CHECK(ncclCommGetAsyncError(rk.comm, &async));
    DP_NCCL_CHECK(async);
  }

  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(reason_mu_);
      if (!aborted_.load(std::memory_order_relaxed)) reason_ = reason;
      aborted_.store(true, std::memory_order_release);
    }
    // Idle ranks' comms are aborted here, together; a busy rank aborts its own when
    // its poll loop sees the flag (Note [NCCL failures]). ncclCommAbort stops the
    // kernels of its rank, so a stream waiting for a peer that never came is released.
    std::vector<std::pair<ncclComm_t, Device>> idle;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rk = ranks_[r];
      std::lock_guard<std::mutex> lock(rk.mu);
      if (rk.comm == nullptr || rk.busy) continue;
      idle.emplace_back(rk.comm, devices_[r]);
      rk.comm = nullptr;
    }
    abort_comms(idle);
  }

  void reset() override {
    if (!aborted_.load(std::memory_order_acquire)) return;
    // Every rank has left its collective (the contract of reset), so every comm was
    // aborted by abort() or by its own rank; what remains are events to recycle.
    for (int r = 0; r < size(); ++r) {
      Rank& rk = ranks_[static_cast<std::size_t>(r)];
      std::lock_guard<std::mutex> lock(rk.mu);
      DP_CHECK(!rk.busy && rk.comm == nullptr, "reset: rank ", r, " (", devices_[r],
               ") is still inside a collective; call reset() once every rank has left it");
      for (const Pending& p : rk.pending) release_event(rk, p);
      rk.pending.clear();
      rk.deferred = false;
      for (const Window& w : rk.closed) recycle(rk, w);
      recycle(rk, rk.open);
      rk.closed.clear();
      rk.open = Window{};
    }
    init_comms();
    std::lock_guard<std::mutex> lock(reason_mu_);
    reason_.clear();
    aborted_.store(false, std::memory_order_release);
  }

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

  /// One collective the watchdog watches until its `done` event completes.
  struct Pending {
    cudaEvent_t done = nullptr;
    const char* what = "";
    std::size_t count = 0;
    Clock::time_point enqueued;
  };

  struct Rank {
    ncclComm_t comm = nullptr;      // null once aborted
    cudaStream_t stream = nullptr;  // owned by the backend
    cudaEvent_t ready = nullptr;    // compute stream → comm stream
    cudaEvent_t joined = nullptr;   // comm stream → compute stream
    // Guards comm, busy, deferred, pending and free_events. Never held across an NCCL
    // call, so abort() (or the watchdog) can always take it (Note [NCCL failures]).
    std::mutex mu;
    bool busy = false;              // the rank's thread is inside an NCCL call
    bool deferred = false;          // deferred collectives enqueued since the last join
    std::deque<Pending> pending;    // in enqueue order
    std::vector<cudaEvent_t> free_events;
    // Timing of deferred collectives (Note [Collective timing]); the rank's threads only.
    Window open;                    // the window since the last join
    std::deque<Window> closed;      // joined, not yet read
    std::vector<cudaEvent_t> free_timing;
    StreamTimes done_times;         // figures of windows already read
  };

  /// What enqueue needs to know of a collective besides the NCCL call itself.
  struct Call {
    const char* what;
    std::size_t count;  // elements; 0 enqueues nothing (the same on every rank)
    bool deferred;
    Tensor a, b;        // the buffers the collective reads or writes (may be undefined)
  };

  void all_reduce_impl(int rank, const Tensor& send, const Tensor& recv, ReduceOp op, bool deferred) {
    check_rank(rank, "all_reduce");
    const Device dev = devices_[rank];
    check_tensor(send, "send", dev, "all_reduce");
    check_tensor(recv, "recv", dev, "all_reduce");
    DP_CHECK(recv.numel() == send.numel(), "all_reduce on ", dev, ": recv has ", recv.numel(),
             " elements but send has ", send.numel(), "; they must match");
    const std::size_t count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    enqueue(rank, {"all_reduce", count, deferred, send, recv}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(sp, rp, count, ncclFloat, to_nccl(op), c, s);
    });
  }

  void reduce_impl(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op, bool deferred) {
    check_rank(rank, "reduce");
    check_root(root, "reduce");
    const Device dev = devices_[rank];
    check_tensor(send, "send", dev, "reduce");
    void* rp = nullptr;  // NCCL ignores recvbuff on non-root ranks
    if (rank == root) {
      check_tensor(recv, "recv (on the root)", dev, "reduce");
      DP_CHECK(recv.numel() == send.numel(), "reduce on ", dev, ": recv has ", recv.numel(),
               " elements but send has ", send.numel(), "; they must match");
      rp = recv.raw_data();
    }
    const std::size_t count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    enqueue(rank, {"reduce", count, deferred, send, rank == root ? recv : Tensor()},
            [&](ncclComm_t c, cudaStream_t s) {
              return ncclReduce(sp, rp, count, ncclFloat, to_nccl(op), root, c, s);
            });
  }

  void init_comms() {
    const int n = size();
    std::vector<ncclComm_t> comms(static_cast<std::size_t>(n), nullptr);
    ncclUniqueId id;
    DP_NCCL_CHECK(ncclGetUniqueId(&id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    backend::CudaBackend& cb = cuda();
    // One thread creates every rank's comm: the calls must be grouped, or the first
    // would wait for peers that the same thread has not created yet.
    DP_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first_error = ncclSuccess;
    for (int r = 0; r < n; ++r) {
      cb.set_device(devices_[static_cast<std::size_t>(r)].index);
      const ncclResult_t res = ncclCommInitRankConfig(&comms[static_cast<std::size_t>(r)], n, id, r, &config);
      if (res != ncclSuccess && res != ncclInProgress && first_error == ncclSuccess) first_error = res;
    }
    const ncclResult_t ended = ncclGroupEnd();
    backend::CudaBackend::invalidate_device_cache();  // NCCL called cudaSetDevice
    if (first_error == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) first_error = ended;
    // Non-blocking: wait (bounded by the timeout) until every comm is ready.
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    for (int r = 0; r < n && first_error == ncclSuccess; ++r) {
      ncclComm_t c = comms[static_cast<std::size_t>(r)];
      ncclResult_t state = ncclInProgress;
      Backoff backoff;
      while (c != nullptr && state == ncclInProgress) {
        const ncclResult_t res = ncclCommGetAsyncError(c, &state);
        if (res != ncclSuccess) state = res;
        if (state == ncclInProgress && Clock::now() > deadline) state = ncclSystemError;
        if (state == ncclInProgress) backoff.pause();
      }
      if (state != ncclSuccess) first_error = state;
    }
    if (first_error != ncclSuccess) {
      std::vector<std::pair<ncclComm_t, Device>> made;
      for (int r = 0; r < n; ++r)
        if (comms[static_cast<std::size_t>(r)] != nullptr)
          made.emplace_back(comms[static_cast<std::size_t>(r)], devices_[static_cast<std::size_t>(r)]);
      abort_comms(made);
      DP_FAIL("nccl communicator over ", n, " devices: initialisation failed: ",
              ncclGetErrorString(first_error), " (a timeout of ", options_.timeout.count(),
              " ms applies; NCCL_DEBUG=WARN prints NCCL's reason)");
    }
    for (int r = 0; r < n; ++r) {
      Rank& rk = ranks_[static_cast<std::size_t>(r)];
      std::lock_guard<std::mutex> lock(rk.mu);
      rk.comm = comms[static_cast<std::size_t>(r)];
    }
  }

  /// Aborts several comms from one thread: grouped, as NCCL requires. Never throws.
  static void abort_comms(const std::vector<std::pair<ncclComm_t, Device>>& comms) {
    if (comms.empty()) return;
    const bool grouped = comms.size() > 1 && ncclGroupStart() == ncclSuccess;
    for (const auto& [c, dev] : comms) {
      try {
        cuda().set_device(dev.index);
      } catch (const std::exception& e) {  // abort never throws: it runs on failure paths
        dp::detail::log_warning(dp::detail::str_cat("nccl abort: ", e.what()));
      }
      warn_nccl(ncclCommAbort(c), "ncclCommAbort", dev);
    }
    if (grouped) warn_nccl(ncclGroupEnd(), "ncclGroupEnd (abort)", comms.front().second);
  }

  /// Destroys every remaining comm, grouped. Never throws.
  void destroy_comms() {
    std::vector<std::pair<ncclComm_t, Device>> live;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rk = ranks_[r];
      std::lock_guard<std::mutex> lock(rk.mu);
      if (rk.comm != nullptr) live.emplace_back(rk.comm, devices_[r]);
      rk.comm = nullptr;
    }
    if (live.empty()) return;
    const bool grouped = live.size() > 1 && ncclGroupStart() == ncclSuccess;
    for (const auto& [c, dev] : live) {
      try {
        cuda().set_device(dev.index);
      } catch (const std::exception& e) {
        dp::detail::log_warning(dp::detail::str_cat("~NcclCommunicator: ", e.what()));
      }
      warn_nccl(ncclCommDestroy(c), "ncclCommDestroy", dev);
    }
    if (grouped) warn_nccl(ncclGroupEnd(), "ncclGroupEnd (destroy)", live.front().second);
  }

  /// Waits (polling, bounded by the timeout) until rank r's comm stream is idle.
  /// False on timeout or a CUDA error; never throws.
  bool drain(int r) {
    Rank& rk = ranks_[static_cast<std::size_t>(r)];
    try {
      cuda().set_device(devices_[static_cast<std::size_t>(r)].index);
    } catch (const std::exception&) {
      return false;
    }
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    Backoff backoff;
    cudaError_t state = cudaStreamQuery(rk.stream);
    while (state == cudaErrorNotReady && Clock::now() < deadline) {
      backoff.pause();
      state = cudaStreamQuery(rk.stream);
    }
    if (state != cudaSuccess) (void)cudaGetLastError();
    return state == cudaSuccess;
  }

  void check_rank(int rank, const char* what) const {
    DP_CHECK(rank >= 0 && rank < size(), what, ": rank ", rank, " is out of range for a ",
             "communicator of ", size(), " ranks (expected 0..", size() - 1, ")");
  }
  void check_root(int root, const char* what) const {
    DP_CHECK(root >= 0 && root < size(), what, ": root ", root, " is out of range (expected 0..",
             size() - 1, ")");
  }
  static void check_tensor(const Tensor& t, const char* name, Device dev, const char* what) {
    const std::string problem = tensor_problem(t, name, dev);
    DP_CHECK(problem.empty(), what, " on ", dev, ": ", problem);
  }
  void throw_if_aborted(const char* what, int rank) const {
    if (!aborted_.load(std::memory_order_acquire)) return;
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(reason_mu_);
      reason = reason_;
    }
    throw_aborted(what, rank, reason);  // dp::CollectiveAborted
  }

  cudaEvent_t take_event(Rank& rk) {  // rk.mu held
    if (!rk.free_events.empty()) {
      cudaEvent_t e = rk.free_events.back();
      rk.free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    DP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  static void release_event(Rank& rk, const Pending& p) { rk.free_events.push_back(p.done); }

  /// A timing-enabled event (Note [Collective timing]); the rank's threads only.
  static cudaEvent_t timing_event(Rank& rk) {
    if (!rk.free_timing.empty()) {
      cudaEvent_t e = rk.free_timing.back();
      rk.free_timing.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    DP_CUDA_CHECK(cudaEventCreate(&e));
    return e;
  }
  static void recycle(Rank& rk, const Window& w) {
    for (const auto& [a, b] : w.spans) rk.free_timing.insert(rk.free_timing.end(), {a, b});
    if (w.arrived != nullptr) rk.free_timing.push_back(w.arrived);
  }
  static bool complete(cudaEvent_t e) {
    const cudaError_t state = cudaEventQuery(e);
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    DP_CUDA_CHECK(state);
    return true;
  }
  static double elapsed_ms(cudaEvent_t from, cudaEvent_t to) {
    float ms = 0;  // a span whose call failed has no end record: it counts 0
    if (cudaEventElapsedTime(&ms, from, to) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return ms;
  }

  /// Issues `call` for rank (Note [NCCL stream ordering]) and waits, without any lock,
  /// until NCCL has issued it (Note [NCCL failures]).
  template <typename F>
  void enqueue(int rank, Call c, F&& call) {
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      throw_if_aborted(c.what, rank);
      if (c.count == 0) return;
      comm = rk.comm;
      rk.busy = true;
    }
    ncclResult_t result = ncclSuccess;
    try {
      backend::CudaBackend& cb = cuda();
      const int dev = devices_[rank].index;
      cb.set_device(dev);
      cudaStream_t compute = cb.compute_stream(dev);
      DP_CUDA_CHECK(cudaEventRecord(rk.ready, compute));
      DP_CUDA_CHECK(cudaStreamWaitEvent(rk.stream, rk.ready, 0));
      std::pair<cudaEvent_t, cudaEvent_t> span{nullptr, nullptr};
      if (c.deferred) {
        for (const Tensor* t : {&c.a, &c.b})
          if (t->defined()) cb.allocator(dev).record_stream(t->storage()->data(), rk.stream);
        span = {timing_event(rk), timing_event(rk)};
        rk.open.spans.push_back(span);  // recycled with the window, whatever happens
        DP_CUDA_CHECK(cudaEventRecord(span.first, rk.stream));
      }
      result = wait_issued(comm, call(comm, rk.stream), rank, c.what);
      if (span.second != nullptr && result == ncclSuccess) DP_CUDA_CHECK(cudaEventRecord(span.second, rk.stream));
    } catch (...) {
      leave(rank);
      throw;
    }
    leave(rank);
    throw_if_aborted(c.what, rank);
    DP_CHECK(result == ncclSuccess, c.what, " on ", devices_[rank], " (", c.count,
             " floats) failed: ", ncclGetErrorString(result), " (NCCL_DEBUG=WARN prints NCCL's reason)");
    after_issue(rank, c);
  }

  /// Polls a non-blocking comm until the call that returned `res` is issued, an abort
  /// came, or the timeout passed (which aborts every rank).
  ncclResult_t wait_issued(ncclComm_t comm, ncclResult_t res, int rank, const char* what) {
    const Clock::time_point deadline = Clock::now() + options_.timeout;
    Backoff backoff;
    while (res == ncclInProgress) {
      if (aborted_.load(std::memory_order_acquire)) return res;
      if (Clock::now() > deadline) {
        abort(dp::detail::str_cat("NCCL did not issue ", what, " on ", devices_[rank], " within ",
                                  options_.timeout.count(), " ms (a peer is missing?)"));
        return res;
      }
      backoff.pause();
      ncclResult_t state = ncclInProgress;
      const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
      res = got != ncclSuccess ? got : state;
    }
    return res;
  }

  /// The rank's thread leaves its NCCL call; if an abort came meanwhile, it aborts its
  /// own comm now (abort() left it alone while busy). Never throws.
  void leave(int rank) {
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    ncclComm_t orphan = nullptr;
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      rk.busy = false;
      if (aborted_.load(std::memory_order_acquire) && rk.comm != nullptr) {
        orphan = rk.comm;
        rk.comm = nullptr;
      }
    }
    if (orphan != nullptr) abort_comms({{orphan, devices_[rank]}});
  }

  /// Orders the compute stream after a plain collective and hands it to the watchdog.
  void after_issue(int rank, const Call& c) {
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    backend::CudaBackend& cb = cuda();
    const int dev = devices_[rank].index;
    std::lock_guard<std::mutex> lock(rk.mu);
    Pending p{take_event(rk), c.what, c.count, Clock::now()};
    DP_CUDA_CHECK(cudaEventRecord(p.done, rk.stream));
    rk.pending.push_back(p);
    if (c.deferred) {
      rk.deferred = true;
    } else {
      DP_CUDA_CHECK(cudaStreamWaitEvent(cb.compute_stream(dev), p.done, 0));
    }
  }

  /// Note [NCCL failures]: the watchdog.
  void watchdog_loop() {
    std::unique_lock<std::mutex> lock(watch_mu_);
    while (!stop_) {
      watch_cv_.wait_for(lock, std::chrono::milliseconds(100));
      if (stop_) break;
      lock.unlock();
      std::string reason;
      try {
        reason = watch_once();
      } catch (const std::exception& e) {
        reason = dp::detail::str_cat("the NCCL watchdog failed: ", e.what());
      }
      if (!reason.empty() && !aborted_.load(std::memory_order_acquire)) abort(reason);
      lock.lock();
    }
  }

  /// One pass over every rank; the reason to abort, or "".
  std::string watch_once() {
    if (aborted_.load(std::memory_order_acquire)) return {};
    const Clock::time_point now = Clock::now();
    for (int r = 0; r < size(); ++r) {
      Rank& rk = ranks_[static_cast<std::size_t>(r)];
      std::lock_guard<std::mutex> lock(rk.mu);
      if (rk.comm == nullptr) continue;
      if (!rk.pending.empty()) cuda().set_device(devices_[static_cast<std::size_t>(r)].index);
      while (!rk.pending.empty()) {
        const Pending& p = rk.pending.front();
        const cudaError_t state = cudaEventQuery(p.done);
        if (state == cudaErrorNotReady) {
          (void)cudaGetLastError();
          if (now - p.enqueued > options_.timeout)
            return dp::detail::str_cat(p.what, " of ", p.count, " floats on ", devices_[r],
                                       " has not completed ", options_.timeout.count(),
                                       " ms after it was enqueued: a peer failed or never called it");
          break;
        }
        if (state != cudaSuccess)
          return dp::detail::str_cat(p.what, " on ", devices_[r], ": ", cudaGetErrorString(state));
        release_event(rk, p);
        rk.pending.pop_front();
      }
      if (!rk.busy) {
        ncclResult_t async = ncclSuccess;
        const ncclResult_t res = ncclCommGetAsyncError(rk.comm, &async);
        const ncclResult_t bad = res != ncclSuccess ? res : async;
        if (bad != ncclSuccess && bad != ncclInProgress)
          return dp::detail::str_cat("NCCL reported an error on ", devices_[r], ": ", ncclGetErrorString(bad));
      }
    }
    return {};
  }

  const CommOptions options_;
  std::vector<Rank> ranks_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mu_;  // guards reason_
  std::string reason_;
  std::mutex watch_mu_;           // guards stop_
  std::condition_variable watch_cv_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& options) {
  const int available = cuda().device_count();
  DP_CHECK(available > 0, "make_communicator: no CUDA device is visible, so an NCCL ",
           "communicator cannot be made; use CPU virtual devices (dp::cpu(i))");
  std::unordered_set<Device> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.is_cuda(), "nccl communicator: expected CUDA devices, got ", d);
    DP_CHECK(d.index >= 0 && d.index < available, "nccl communicator: ", d,
             " is out of range (", available, " CUDA devices visible)");
    DP_CHECK(seen.insert(d).second, "nccl communicator: device ", d, " appears twice");
  }
  return std::make_unique<NcclCommunicator>(devices, options);
}

std::unique_ptr<Communicator> make_nccl_world_communicator(const std::vector<Device>& devices,
                                                           const CommOptions& /*options*/) {
  DP_FAIL("make_world_communicator: NCCL across processes is not available yet (", devices.size(),
          " CUDA device(s) per process)");
}

}  // namespace dp::comm
