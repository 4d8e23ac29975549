// The NCCL communicator: collectives among CUDA devices, within one process or across
// the processes of a job.
//
// Rank i of this process is devices[i]; one non-blocking ncclComm per device, created
// together (ncclCommInitRankConfig inside one group); every rank is driven by its own
// thread (one thread per GPU, like Caffe's P2PSync or Marian's thread pool). Nothing
// here waits on the host in a step: see Note [NCCL stream ordering]. A watchdog
// (watchdog.h) turns a collective that never completes into an abort of every rank:
// see Note [NCCL failures]. Across processes, one communicator spans every GPU of the
// job, with local() and peers(j) split from it: see Note [NCCL across processes].
// Built only with the CUDA backend (src/comm/nccl/meson.build), whose internal headers
// it uses for streams, devices and the allocator; nccl_stub.cpp stands in otherwise.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "comm/nccl/copy_communicator.h"
#include "comm/nccl/watchdog.h"
#include "comm/nccl_factory.h"
#include "comm/world_factory.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0),
              "dp needs NCCL >= 2.18 (non-blocking communicators, ncclAvg, ncclCommSplit)");

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

// Note [NCCL across processes]
// make_world_communicator over CUDA devices (one process per node, L GPUs each, P
// processes): ONE NCCL communicator over the P * L GPUs, world rank = process * L +
// local index, built like the single-process one (ncclCommInitRankConfig of every
// local rank inside one group) from a unique id made on process 0 and broadcast with
// dp::dist. Collectives keep NCCL's own semantics, which are Note [World ranks]'s:
// roots are world ranks, reduce_scatter/all_gather blocks are world-rank blocks, a sum
// covers every GPU of the job.
// local() (this process's GPUs; color = process rank, key = local index) and peers(j)
// (local index j of every process; color = j, key = process rank, so its NCCL rank is
// the process rank and its `rank` argument is dp::dist::rank(), like the mpi
// communicator's) are split from the world communicators with ncclCommSplit — once,
// at construction, grouped per split, polled like the initialisation. A split is a
// collective of every rank of the job; made lazily it would be a job-wide rendezvous
// inside whichever step first asked for it, hanging (until the timeout) when one
// process's code path differs. At construction it fails, or succeeds, with the rest of
// make_world_communicator. The price, two more communicators per GPU, is mostly
// bootstrap state: with NCCL's runtime connection (the default since 2.22) a
// communicator allocates its channel buffers only for the peers and algorithms it
// actually uses, so unused splits cost little memory. splitShare stays off: a child
// sharing its parent's resources may not be used concurrently with it, and would tie
// their failures together in ways NCCL documents per version.
// Which communicator the DDP all-reduce uses — the decision: the world communicator,
// one ncclAllReduce per bucket, not a hand-made hierarchy (local reduce-scatter,
// inter-process all-reduce of each slice over peers(j), local all-gather). Reasons
// from NCCL's documented behaviour: within one communicator NCCL already detects the
// topology (NVLink/NVSwitch inside a node, which NIC is close to which GPU across
// nodes) and builds hierarchical rings and trees over it — inter-node traffic goes
// over the NICs once per ring step while intra-node steps use NVLink, the tree
// algorithm gives logarithmic latency across nodes, and NVLS/CollNet (SHARP) apply
// where the fabric has them; NCCL pipelines these phases in one kernel, where a
// hand-made hierarchy serialises three collectives (three launches and three
// synchronisation points per bucket, ruinous for the small first bucket) and cannot
// use NVLS or the tree. Horovod's hierarchical all-reduce predates NCCL's trees
// (2.4). The bytes crossing the network are the same in both (2 (N-1)/N of the bucket
// per GPU for the ring). local() and peers(j) remain for strategies that need the two
// levels apart (e.g. sharding within a node only, or the CPU design's symmetry).
// What must be measured on a real cluster (2+ nodes, 8 GPUs each, InfiniBand or
// RoCE): all_reduce busbw of the world communicator against the three-phase path over
// local()/peers(j), for bucket sizes 64 KiB (the first bucket) to 25 MiB and beyond
// (bench/collectives_bench, nccl-tests' all_reduce_perf), with NCCL_ALGO=Ring and Tree
// forced and free; the DDP step's exposed communication (take_times) both ways;
// NCCL_DEBUG=INFO to confirm the topology NCCL saw (GPUDirect RDMA, NIC affinity);
// the memory and init time that the two split communicators per GPU cost at scale.
// If the hierarchy ever wins, it is a reducer strategy over local()/peers(j), and
// nothing here changes.

namespace {

using Clock = std::chrono::steady_clock;
using detail::Watchdog;

/// How often the watchdog polls: a hang is reported within timeout + this; frequent
/// enough to be prompt, rare enough that its cudaEventQuery calls cost nothing.
constexpr std::chrono::milliseconds kWatchInterval{100};
/// How long an abort of a family spanning processes waits for busy ranks to abort
/// their own comms before ending the job: their poll loops sleep at most 1 ms
/// (Backoff), so this only matters when a thread is stuck elsewhere.
constexpr std::chrono::milliseconds kAbortGrace{2000};

ncclRedOp_t to_nccl(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclAvg; }

/// The NCCL type of a dtype (Note [Collective dtypes]): every dtype dp has. Reductions
/// take only the summable ones, which the front checks before any call comes here.
ncclDataType_t to_nccl(Dtype dtype) {
  switch (dtype) {
    case Dtype::Float32: return ncclFloat32;
    case Dtype::Int64: return ncclInt64;
    case Dtype::Int32: return ncclInt32;
    // bf16 / fp16: ncclBfloat16 / ncclFloat16 here (and a Summand in summation.h).
  }
  DP_FAIL("nccl communicator: no NCCL type for dtype code ", static_cast<int>(dtype));
}

backend::CudaBackend& cuda() { return backend::CudaBackend::instance(); }

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

using CommList = std::vector<std::pair<ncclComm_t, Device>>;

/// Aborts several comms from one thread: grouped, as NCCL requires. Never throws.
void abort_comms(const CommList& comms) {
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
  backend::CudaBackend::invalidate_device_cache();  // NCCL may have called cudaSetDevice
}

/// Destroys several comms from one thread, grouped. Never throws.
void destroy_comms(const CommList& comms) {
  if (comms.empty()) return;
  const bool grouped = comms.size() > 1 && ncclGroupStart() == ncclSuccess;
  for (const auto& [c, dev] : comms) {
    try {
      cuda().set_device(dev.index);
    } catch (const std::exception& e) {
      dp::detail::log_warning(dp::detail::str_cat("~NcclCommunicator: ", e.what()));
    }
    warn_nccl(ncclCommDestroy(c), "ncclCommDestroy", dev);
  }
  if (grouped) warn_nccl(ncclGroupEnd(), "ncclGroupEnd (destroy)", comms.front().second);
  backend::CudaBackend::invalidate_device_cache();
}

/// Comms being made by one grouped call: the comms, or why they could not be made.
struct Made {
  std::vector<ncclComm_t> comms;  // empty when `error` is set
  std::string error;
};

/// Finishes a grouped creation: polls every non-blocking comm (bounded by `timeout`)
/// until it is ready; on any failure aborts every comm made and says why. Never throws.
Made finish_creation(std::vector<ncclComm_t> comms, const std::vector<Device>& devices, ncclResult_t error,
                     const char* what, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  bool timed_out = false;
  for (std::size_t i = 0; i < comms.size() && error == ncclSuccess; ++i) {
    ncclComm_t c = comms[i];
    if (c == nullptr) {
      error = ncclInternalError;
      break;
    }
    ncclResult_t state = ncclInProgress;
    Backoff backoff;
    while (state == ncclInProgress) {
      const ncclResult_t res = ncclCommGetAsyncError(c, &state);
      if (res != ncclSuccess) state = res;
      if (state == ncclInProgress && Clock::now() > deadline) {
        timed_out = true;
        state = ncclSystemError;
      }
      if (state == ncclInProgress) backoff.pause();
    }
    error = state;
  }
  if (error == ncclSuccess) return {std::move(comms), {}};
  CommList made;
  for (std::size_t i = 0; i < comms.size(); ++i)
    if (comms[i] != nullptr) made.emplace_back(comms[i], devices[i]);
  abort_comms(made);
  return {{},
          timed_out ? dp::detail::str_cat(what, " did not complete within the timeout of ", timeout.count(),
                                          " ms (a process of the job is missing or failed; NCCL_DEBUG=WARN ",
                                          "prints NCCL's view)")
                    : dp::detail::str_cat(what, " failed: ", ncclGetErrorString(error),
                                          " (NCCL_DEBUG=WARN prints NCCL's reason)")};
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Note [NCCL failures]
  return config;
}

/// Makes ranks first .. first + devices.size() - 1 of `nranks`, one per device, from
/// `id` — one group, as one thread creates them all (the calls would otherwise wait
/// for peers that the same thread has not created yet). Never throws.
Made init_ranks(const std::vector<Device>& devices, int nranks, int first, const ncclUniqueId& id,
                std::chrono::milliseconds timeout) {
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ncclConfig_t config = nonblocking_config();
  ncclResult_t error = ncclGroupStart();
  if (error != ncclSuccess)
    return {{}, dp::detail::str_cat("ncclGroupStart failed: ", ncclGetErrorString(error))};
  for (std::size_t i = 0; i < devices.size() && error == ncclSuccess; ++i) {
    try {
      cuda().set_device(devices[i].index);
    } catch (const std::exception&) {
      error = ncclUnhandledCudaError;  // the group must still be closed below
      break;
    }
    const ncclResult_t res =
        ncclCommInitRankConfig(&comms[i], nranks, id, first + static_cast<int>(i), &config);
    if (res != ncclSuccess && res != ncclInProgress) error = res;
  }
  const ncclResult_t ended = ncclGroupEnd();
  backend::CudaBackend::invalidate_device_cache();  // NCCL called cudaSetDevice
  if (error == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) error = ended;
  return finish_creation(std::move(comms), devices, error, "ncclCommInitRankConfig", timeout);
}

/// Splits every parent (parents[i] on devices[i]) with colors[i] and keys[i], grouped.
/// Every rank of the parents' communicator must call it. Never throws.
Made split_ranks(const std::vector<ncclComm_t>& parents, const std::vector<Device>& devices,
                 const std::vector<int>& colors, const std::vector<int>& keys,
                 std::chrono::milliseconds timeout) {
  std::vector<ncclComm_t> comms(parents.size(), nullptr);
  ncclConfig_t config = nonblocking_config();
  ncclResult_t error = ncclGroupStart();
  if (error != ncclSuccess)
    return {{}, dp::detail::str_cat("ncclGroupStart failed: ", ncclGetErrorString(error))};
  for (std::size_t i = 0; i < parents.size() && error == ncclSuccess; ++i) {
    try {
      cuda().set_device(devices[i].index);
    } catch (const std::exception&) {
      error = ncclUnhandledCudaError;
      break;
    }
    const ncclResult_t res = ncclCommSplit(parents[i], colors[i], keys[i], &comms[i], &config);
    if (res != ncclSuccess && res != ncclInProgress) error = res;
  }
  const ncclResult_t ended = ncclGroupEnd();
  backend::CudaBackend::invalidate_device_cache();
  if (error == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) error = ended;
  return finish_creation(std::move(comms), devices, error, "ncclCommSplit", timeout);
}

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

class NcclCommunicator final : public Communicator {
 public:
  /// Streams and events for every slot; no comm yet (install() adds them). `streams`:
  /// the comm stream of each slot, or empty to create them.
  NcclCommunicator(Layout layout, const CommOptions& options, std::shared_ptr<Family> family,
                   std::vector<cudaStream_t> streams)
      : Communicator(layout.devices, layout.world_size, layout.first_rank),
        layout_(std::move(layout)),
        options_(options),
        family_(std::move(family)),
        ranks_(static_cast<std::size_t>(layout_.slots)) {
    set_rank_range({layout_.first_arg, layout_.slots, layout_.first_nccl, layout_.rank_hint, false});
    backend::CudaBackend& cb = cuda();
    for (int s = 0; s < layout_.slots; ++s) {
      Rank& rk = ranks_[static_cast<std::size_t>(s)];
      const int dev = slot_device(s).index;
      cb.set_device(dev);
      if (streams.empty()) {
        int least = 0, greatest = 0;  // greatest = numerically lowest = runs first
        DP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
        rk.stream = cb.create_stream(dev, greatest);
      } else {
        rk.stream = streams[static_cast<std::size_t>(s)];
      }
      DP_CUDA_CHECK(cudaEventCreateWithFlags(&rk.ready, cudaEventDisableTiming));
      DP_CUDA_CHECK(cudaEventCreateWithFlags(&rk.joined, cudaEventDisableTiming));
    }
    watch_ids_.resize(ranks_.size());
    for (int s = 0; s < layout_.slots; ++s) {
      watch_ids_[static_cast<std::size_t>(s)] = family_->watchdog->add_rank(label(s));
      family_->watched.emplace_back(this, s);
    }
  }

  ~NcclCommunicator() override {
    if (owner_) {
      family_->watchdog->stop();
      // Finish what was enqueued, unless that cannot end (then abort: in a family
      // spanning processes that ends the job, Note [NCCL failures]); never throw.
      for (const auto& [member, s] : family_->watched) {
        if (member->aborted_.load(std::memory_order_acquire)) break;
        if (!member->drain(s)) {
          abort("the communicator was destroyed while a collective could not finish");
          break;
        }
      }
      family_->watchdog->clear();  // pending events back to their ranks
      CommList live;
      for (const auto& [member, s] : family_->watched) {
        Rank& rk = member->ranks_[static_cast<std::size_t>(s)];
        std::lock_guard<std::mutex> lock(rk.mu);
        if (rk.comm != nullptr) live.emplace_back(rk.comm, member->slot_device(s));
        rk.comm = nullptr;
      }
      destroy_comms(live);  // every comm of the family in one group
    }
    for (Rank& rk : ranks_) {
      for (cudaEvent_t e : rk.free_events) DP_CUDA_WARN(cudaEventDestroy(e));
      for (const Window& w : rk.closed) recycle(rk, w);
      recycle(rk, rk.open);
      for (cudaEvent_t e : rk.free_timing) DP_CUDA_WARN(cudaEventDestroy(e));
      if (rk.ready != nullptr) DP_CUDA_WARN(cudaEventDestroy(rk.ready));
      if (rk.joined != nullptr) DP_CUDA_WARN(cudaEventDestroy(rk.joined));
      // The stream belongs to the backend (Note [Process-lifetime CUDA objects]).
    }
  }

  /// Makes this the family's owner: it stops the watchdog and destroys every comm of
  /// the family, and owns the split communicators.
  void adopt(std::unique_ptr<NcclCommunicator> local, std::vector<std::unique_ptr<NcclCommunicator>> peers) {
    owner_ = true;
    local_ = std::move(local);
    peers_ = std::move(peers);
  }

  /// Gives every slot its comm (ready, made by init_ranks or split_ranks).
  void install(const std::vector<ncclComm_t>& comms) {
    DP_ASSERT(comms.size() == ranks_.size(), "install: ", comms.size(), " comms for ", ranks_.size(), " ranks");
    for (std::size_t s = 0; s < ranks_.size(); ++s) {
      std::lock_guard<std::mutex> lock(ranks_[s].mu);
      ranks_[s].comm = comms[s];
    }
  }
  std::vector<ncclComm_t> comms() {
    std::vector<ncclComm_t> out;
    for (Rank& rk : ranks_) {
      std::lock_guard<std::mutex> lock(rk.mu);
      out.push_back(rk.comm);
    }
    return out;
  }
  std::vector<cudaStream_t> streams() const {
    std::vector<cudaStream_t> out;
    for (const Rank& rk : ranks_) out.push_back(rk.stream);
    return out;
  }
  const Layout& layout() const { return layout_; }
  Device slot_device(int s) const { return devices_[static_cast<std::size_t>(layout_.first_arg + s)]; }
  /// "cuda:3 (world rank 11 of 16)", "cuda:3 (rank 1 of 2 of peers(3); world rank 11)".
  std::string label(int s) const {
    const int world = layout_.world_rank[static_cast<std::size_t>(s)];
    if (layout_.name == "world")
      return dp::detail::str_cat(slot_device(s), " (world rank ", world, " of ", world_size_, ")");
    return dp::detail::str_cat(slot_device(s), " (rank ", layout_.first_nccl + s, " of ", world_size_, " of ",
                               layout_.name, "; world rank ", world, ")");
  }

  /// Starts the family's watchdog (owner only, once every member is registered).
  void start_watchdog() {
    DP_ASSERT(owner_, "start_watchdog: not the family's owner");
    family_->watchdog->start(kWatchInterval);
  }

  std::string backend_name() const override { return "nccl"; }

  Communicator& local() override { return local_ ? static_cast<Communicator&>(*local_) : *this; }
  Communicator* peers(int rank) override {
    if (peers_.empty()) return nullptr;
    check_rank(rank, "peers");
    return peers_[static_cast<std::size_t>(rank - layout_.first_arg)].get();
  }

  void join(int rank) override {
    check_rank(rank, "join");
    Rank& rk = slot(rank);
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

  // Note [Work after deferred collectives] in communicator.h: on the comm stream, timed
  // as a span of the open window, so the window's exposed time reaches its end.
  void after_deferred(int rank, const std::function<void()>& work) override {
    check_rank(rank, "after_deferred");
    Rank& rk = slot(rank);
    DP_ASSERT(rk.group.depth == 0, "after_deferred on ", label(rank - layout_.first_arg),
              " inside a collective group: the group's collectives are not enqueued yet");
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      throw_if_aborted("after_deferred", rank);
    }
    backend::CudaBackend& cb = cuda();
    const int dev = devices_[rank].index;
    cb.set_device(dev);
    const std::pair<cudaEvent_t, cudaEvent_t> span{timing_event(rk), timing_event(rk)};
    rk.open.spans.push_back(span);  // recycled with the window, whatever happens
    DP_CUDA_CHECK(cudaEventRecord(span.first, rk.stream));
    {
      backend::CudaStreamGuard on_comm(dev, rk.stream);
      work();
    }
    DP_CUDA_CHECK(cudaEventRecord(span.second, rk.stream));
    std::lock_guard<std::mutex> lock(rk.mu);
    rk.deferred = true;  // join() orders the compute stream after the work too
  }

  // Note [Grouped collectives] in communicator.h; Note [NCCL groups] for how.
  void group_start(int rank) override {
    check_rank(rank, "group_start");
    Rank& rk = slot(rank);
    if (rk.group.depth > 0) {  // nested: the outermost pair launches
      ++rk.group.depth;
      return;
    }
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      throw_if_aborted("group_start", rank);
      rk.busy = true;
    }
    const ncclResult_t res = ncclGroupStart();
    if (res != ncclSuccess) {
      leave(rank);
      DP_FAIL("ncclGroupStart on ", label(rank - layout_.first_arg), " failed: ", ncclGetErrorString(res));
    }
    rk.group = Group{};
    rk.group.depth = 1;
  }

  void group_end(int rank) override {
    check_rank(rank, "group_end");
    Rank& rk = slot(rank);
    DP_CHECK(rk.group.depth > 0, "group_end on ", label(rank - layout_.first_arg), " without a group_start");
    if (--rk.group.depth > 0) return;
    const Group g = std::exchange(rk.group, Group{});
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      comm = rk.comm;  // busy since group_start: abort() left it alone
    }
    ncclResult_t result = ncclSuccess;
    try {
      backend::ScopedRange range(devices_[rank], "nccl", "group_end", g.bytes);  // Note [Profiler ranges]
      result = wait_issued(comm, ncclGroupEnd(), rank, "group_end");
      if (g.span_end != nullptr && result == ncclSuccess) DP_CUDA_CHECK(cudaEventRecord(g.span_end, rk.stream));
    } catch (...) {
      leave(rank);
      throw;
    }
    leave(rank);
    throw_if_aborted("group_end", rank);
    DP_CHECK(result == ncclSuccess, "a group of ", g.calls, " collectives (", g.what == nullptr ? "none" : g.what,
             ", ", g.count, " elements) on ", label(rank - layout_.first_arg),
             " failed: ", ncclGetErrorString(result), " (NCCL_DEBUG=WARN prints NCCL's reason)");
    if (g.calls == 0) return;
    if (g.any_deferred && g.any_plain) {  // the plain ones join the compute stream anyway
      std::lock_guard<std::mutex> lock(rk.mu);
      rk.deferred = true;  // so join() closes the timing window the deferred ones opened
    }
    after_issue(rank, Call{g.what, g.count, Dtype::Float32, /*deferred=*/!g.any_plain, Tensor(), Tensor()});
  }

  bool times_on_device() const override { return true; }

  StreamTimes take_times(int rank) override {
    check_rank(rank, "take_times");
    Rank& rk = slot(rank);
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
    Rank& rk = slot(rank);
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
    // Every rank of the family: in one process the family is this communicator alone;
    // across processes nothing short of the whole family (and the job) can go.
    std::vector<int> all(family_->watched.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    abort_family(*family_, all, reason);
  }

  void reset() override {
    if (!aborted_.load(std::memory_order_acquire)) return;
    // Unreachable across processes (an abort ended the job), but say so if it happens.
    DP_CHECK(!family_->spans_processes, "reset: ", family_->description, " was aborted (",
             abort_reason(), "); a communicator spanning processes cannot be rebuilt by one process");
    // Every rank has left its collective (the contract of reset), so every comm was
    // aborted by abort() or by its own rank; what remains are events to recycle.
    for (int s = 0; s < layout_.slots; ++s) {
      Rank& rk = ranks_[static_cast<std::size_t>(s)];
      std::lock_guard<std::mutex> lock(rk.mu);
      DP_CHECK(!rk.busy && rk.comm == nullptr, "reset: rank ", layout_.first_arg + s, " (", slot_device(s),
               ") is still inside a collective; call reset() once every rank has left it");
    }
    family_->watchdog->clear();  // pending events back to their ranks; armed again
    for (Rank& rk : ranks_) {
      std::lock_guard<std::mutex> lock(rk.mu);
      rk.deferred = false;
      for (const Window& w : rk.closed) recycle(rk, w);
      recycle(rk, rk.open);
      rk.closed.clear();
      rk.open = Window{};
    }
    std::vector<Device> local(devices_.begin() + layout_.first_arg,
                              devices_.begin() + layout_.first_arg + layout_.slots);
    ncclUniqueId id;
    DP_NCCL_CHECK(ncclGetUniqueId(&id));
    const Made made = init_ranks(local, layout_.world_size, layout_.first_nccl, id, options_.timeout);
    DP_CHECK(made.error.empty(), "reset of the nccl communicator over ", layout_.slots, " devices: ",
             made.error);
    install(made.comms);
    std::lock_guard<std::mutex> lock(reason_mu_);
    reason_.clear();
    aborted_.store(false, std::memory_order_release);
  }

  // --- the family's side (abort_family and the watchdog's probes) ---

  /// Marks this communicator aborted (the first reason stays).
  void mark_aborted(const std::string& reason) {
    std::lock_guard<std::mutex> lock(reason_mu_);
    if (!aborted_.load(std::memory_order_relaxed)) reason_ = reason;
    aborted_.store(true, std::memory_order_release);
  }
  /// Slot s's comm when its thread is not inside an NCCL call (taken: the caller aborts
  /// it); null when busy (its thread aborts it on leaving) or already gone.
  ncclComm_t take_idle(int s) {
    Rank& rk = ranks_[static_cast<std::size_t>(s)];
    std::lock_guard<std::mutex> lock(rk.mu);
    if (rk.comm == nullptr || rk.busy) return nullptr;
    return std::exchange(rk.comm, nullptr);
  }
  /// True once slot s's comm is gone (aborted by abort_family or by its own thread).
  bool released(int s) {
    Rank& rk = ranks_[static_cast<std::size_t>(s)];
    std::lock_guard<std::mutex> lock(rk.mu);
    return rk.comm == nullptr;
  }

  Watchdog::Probe query(int s, Watchdog::Token token) {
    cuda().set_device(slot_device(s).index);
    const cudaError_t state = cudaEventQuery(static_cast<cudaEvent_t>(const_cast<void*>(token)));
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return {Watchdog::Progress::Running, {}};
    }
    if (state == cudaSuccess) return {Watchdog::Progress::Complete, {}};
    (void)cudaGetLastError();
    return {Watchdog::Progress::Failed, cudaGetErrorString(state)};
  }
  std::string async_error(int s) {
    Rank& rk = ranks_[static_cast<std::size_t>(s)];
    std::lock_guard<std::mutex> lock(rk.mu);
    // A busy rank's thread polls its own comm (wait_issued); an aborted one has none.
    if (rk.comm == nullptr || rk.busy) return {};
    ncclResult_t async = ncclSuccess;
    const ncclResult_t res = ncclCommGetAsyncError(rk.comm, &async);
    const ncclResult_t bad = res != ncclSuccess ? res : async;
    if (bad == ncclSuccess || bad == ncclInProgress) return {};
    return dp::detail::str_cat("NCCL reported ", ncclGetErrorString(bad), " (NCCL_DEBUG=WARN prints NCCL's reason)");
  }
  void release(int s, Watchdog::Token token) {
    Rank& rk = ranks_[static_cast<std::size_t>(s)];
    std::lock_guard<std::mutex> lock(rk.mu);
    rk.free_events.push_back(static_cast<cudaEvent_t>(const_cast<void*>(token)));
  }

 protected:
  void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    all_reduce_impl(rank, send, recv, op, /*deferred=*/false);
  }
  void do_all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    all_reduce_impl(rank, send, recv, op, /*deferred=*/true);
  }
  void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
    reduce_impl(rank, send, recv, root, op, /*deferred=*/false);
  }
  void do_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
    reduce_impl(rank, send, recv, root, op, /*deferred=*/true);
  }

  void do_broadcast(int rank, const Tensor& data, int root) override {
    const std::size_t count = static_cast<std::size_t>(data.numel());
    void* p = data.raw_data();
    const ncclDataType_t type = to_nccl(data.dtype());
    enqueue(rank, {"broadcast", count, data.dtype(), false, data, Tensor()}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(p, p, count, type, root, c, s);
    });
  }

  void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    // World-rank blocks (Note [World ranks]): NCCL's own layout.
    const std::size_t recv_count = static_cast<std::size_t>(recv.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    const ncclDataType_t type = to_nccl(send.dtype());
    enqueue(rank, {"reduce_scatter", recv_count, send.dtype(), false, send, recv, world_size()},
            [&](ncclComm_t c, cudaStream_t s) { return ncclReduceScatter(sp, rp, recv_count, type, to_nccl(op), c, s); });
  }

  void do_all_gather(int rank, const Tensor& send, const Tensor& recv) override {
    const std::size_t send_count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    const ncclDataType_t type = to_nccl(send.dtype());
    enqueue(rank, {"all_gather", send_count, send.dtype(), false, send, recv, world_size()},
            [&](ncclComm_t c, cudaStream_t s) { return ncclAllGather(sp, rp, send_count, type, c, s); });
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

  /// What enqueue needs to know of a collective besides the NCCL call itself.
  struct Call {
    const char* what;
    std::size_t count;  // elements; 0 enqueues nothing (the same on every rank)
    Dtype dtype;
    bool deferred;
    Tensor a, b;        // the buffers the collective reads or writes (may be undefined)
    int blocks = 1;     // count x blocks = nccl-tests' size (reduce_scatter, all_gather)
  };

  Rank& slot(int rank) { return ranks_[static_cast<std::size_t>(rank - layout_.first_arg)]; }
  int nccl_rank(int rank) const { return layout_.first_nccl + (rank - layout_.first_arg); }

  void all_reduce_impl(int rank, const Tensor& send, const Tensor& recv, ReduceOp op, bool deferred) {
    const std::size_t count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    const ncclDataType_t type = to_nccl(send.dtype());
    enqueue(rank, {"all_reduce", count, send.dtype(), deferred, send, recv}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(sp, rp, count, type, to_nccl(op), c, s);
    });
  }

  void reduce_impl(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op, bool deferred) {
    const bool is_root = nccl_rank(rank) == root;  // roots are world ranks
    void* rp = is_root ? recv.raw_data() : nullptr;  // NCCL ignores recvbuff on non-root ranks
    const std::size_t count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    const ncclDataType_t type = to_nccl(send.dtype());
    enqueue(rank, {"reduce", count, send.dtype(), deferred, send, is_root ? recv : Tensor()},
            [&](ncclComm_t c, cudaStream_t s) { return ncclReduce(sp, rp, count, type, to_nccl(op), root, c, s); });
  }

  /// Waits (polling, bounded by the timeout) until slot s's comm stream is idle.
  /// False on timeout or a CUDA error; never throws.
  bool drain(int s) {
    Rank& rk = ranks_[static_cast<std::size_t>(s)];
    try {
      cuda().set_device(slot_device(s).index);
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

  std::string abort_reason() const {
    std::lock_guard<std::mutex> lock(reason_mu_);
    return reason_;
  }
  void throw_if_aborted(const char* what, int rank) const {
    if (!aborted_.load(std::memory_order_acquire)) return;
    throw_aborted(what, rank, abort_reason());  // dp::CollectiveAborted
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
    Rank& rk = slot(rank);
    const bool grouped = rk.group.depth > 0;  // Note [NCCL groups]
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      throw_if_aborted(c.what, rank);
      if (c.count == 0) return;
      comm = rk.comm;
      rk.busy = true;  // already, in a group
    }
    const std::size_t bytes = c.count * element_size(c.dtype) * static_cast<std::size_t>(c.blocks);
    backend::ScopedRange range(devices_[rank], "nccl", c.what, bytes);  // Note [Profiler ranges]
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
        if (!grouped || rk.group.span_end == nullptr) {  // a group has one span
          span = {timing_event(rk), timing_event(rk)};
          rk.open.spans.push_back(span);  // recycled with the window, whatever happens
          DP_CUDA_CHECK(cudaEventRecord(span.first, rk.stream));
          if (grouped) rk.group.span_end = span.second;
        }
      }
      result = call(comm, rk.stream);
      if (grouped) {
        // Queued in the thread's group; group_end polls the launch.
        if (result == ncclInProgress) result = ncclSuccess;
      } else {
        result = wait_issued(comm, result, rank, c.what);
        if (span.second != nullptr && result == ncclSuccess) DP_CUDA_CHECK(cudaEventRecord(span.second, rk.stream));
      }
    } catch (...) {
      if (!grouped) leave(rank);  // in a group the rank stays busy until group_end
      throw;
    }
    if (!grouped) leave(rank);
    throw_if_aborted(c.what, rank);
    DP_CHECK(result == ncclSuccess, c.what, " on ", label(rank - layout_.first_arg), " (", c.count,
             " elements) failed: ", ncclGetErrorString(result), " (NCCL_DEBUG=WARN prints NCCL's reason)");
    if (grouped) {
      Group& g = rk.group;
      if (g.calls++ == 0) g.what = c.what;
      g.count += c.count;
      g.bytes += bytes;
      (c.deferred ? g.any_deferred : g.any_plain) = true;
      return;
    }
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
        abort(dp::detail::str_cat("NCCL did not issue ", what, " on ", label(rank - layout_.first_arg),
                                  " within ", options_.timeout.count(), " ms (a peer is missing?)"));
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
    Rank& rk = slot(rank);
    ncclComm_t orphan = nullptr;
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      rk.busy = false;
      if (aborted_.load(std::memory_order_acquire) && rk.comm != nullptr) orphan = std::exchange(rk.comm, nullptr);
    }
    if (orphan != nullptr) abort_comms({{orphan, devices_[rank]}});
  }

  /// Hands the collective to the watchdog and orders the compute stream after a plain
  /// one.
  void after_issue(int rank, const Call& c) {
    Rank& rk = slot(rank);
    backend::CudaBackend& cb = cuda();
    const int dev = devices_[rank].index;
    cudaEvent_t done = nullptr;
    {
      std::lock_guard<std::mutex> lock(rk.mu);
      done = take_event(rk);
      const cudaError_t recorded = cudaEventRecord(done, rk.stream);
      if (recorded != cudaSuccess) rk.free_events.push_back(done);
      DP_CUDA_CHECK(recorded);
      if (c.deferred) rk.deferred = true;
    }
    family_->watchdog->enqueued(watch_ids_[static_cast<std::size_t>(rank - layout_.first_arg)], done, c.what,
                                c.count);
    if (!c.deferred) DP_CUDA_CHECK(cudaStreamWaitEvent(cb.compute_stream(dev), done, 0));
  }

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

void abort_family(Family& family, const std::vector<int>& ids, const std::string& reason) {
  family.watchdog->disarm();  // an abort came: nothing more to judge until reset()
  std::vector<NcclCommunicator*> marked;
  CommList idle;
  for (int id : ids) {
    auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    if (std::find(marked.begin(), marked.end(), member) == marked.end()) {
      member->mark_aborted(reason);
      marked.push_back(member);
    }
    // Idle ranks' comms are aborted here, together; a busy rank aborts its own when
    // its poll loop sees the flag (Note [NCCL failures]). ncclCommAbort stops the
    // kernels of its rank, so a stream waiting for a peer that never came is released.
    if (ncclComm_t c = member->take_idle(s)) idle.emplace_back(c, member->slot_device(s));
  }
  abort_comms(idle);
  if (!family.spans_processes) return;

  // Note [NCCL failures]: the other processes cannot be released from here.
  const Clock::time_point grace = Clock::now() + kAbortGrace;
  for (int id : ids) {
    auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    while (!member->released(s) && Clock::now() < grace) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::call_once(family.ended, [&] {
    try {
      dist::abort(dp::detail::str_cat(family.description, " was aborted: ", reason,
                                      "; ending the job, since the ranks of the other processes cannot be "
                                      "released otherwise"));
    } catch (...) {  // dist could not end the job: ending this process makes the launcher do it
    }
    std::abort();
  });
  std::abort();  // another thread is ending the job (call_once returned only by an exception)
}

/// The family's watchdog: its probes and its abort go to the members' ranks.
std::unique_ptr<Watchdog> make_watchdog(Family& family, std::chrono::milliseconds timeout) {
  Watchdog::Hooks hooks;
  // family.watched is complete before the watchdog starts, and fixed from then on.
  hooks.query = [&family](int id, Watchdog::Token token) {
    const auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    return member->query(s, token);
  };
  hooks.async_error = [&family](int id) {
    const auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    return member->async_error(s);
  };
  hooks.release = [&family](int id, Watchdog::Token token) {
    const auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    member->release(s, token);
  };
  hooks.abort = [&family](const std::vector<int>& ids, const Watchdog::Failure& failure) {
    abort_family(family, ids, failure.reason);
  };
  return std::make_unique<Watchdog>(timeout, std::move(hooks));
}

/// Aborts every comm the family has made so far, grouped, without ending the job: a
/// failed construction, agreed by every process. Never throws.
void discard(Family& family) {
  family.watchdog->disarm();
  CommList comms;
  for (const auto& [member, s] : family.watched)
    if (ncclComm_t c = member->take_idle(s)) comms.emplace_back(c, member->slot_device(s));
  abort_comms(comms);
}

/// Throws dp::Error unless `devices` are distinct CUDA devices visible to this process.
void check_nccl_devices(const std::vector<Device>& devices, const char* who) {
  const int available = cuda().device_count();
  DP_CHECK(available > 0, who, ": no CUDA device is visible, so an NCCL communicator cannot be made; use CPU ",
           "virtual devices (dp::cpu(i))");
  std::unordered_set<Device> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.is_cuda(), who, ": the nccl communicator needs CUDA devices, got ", d);
    DP_CHECK(d.index >= 0 && d.index < available, who, ": ", d, " is out of range (", available,
             " CUDA devices visible to this process)");
    DP_CHECK(seen.insert(d).second, who, ": device ", d, " appears twice; each rank needs its own device");
  }
}

/// True when two of `devices` (checked CUDA devices) run on one GPU (Note [Logical
/// CUDA devices]): NCCL would refuse them ("duplicate GPU").
bool shares_gpu(const std::vector<Device>& devices) {
  std::vector<int> ids;
  for (const Device& d : devices) ids.push_back(d.index);
  return cuda().device_map().shares_gpu(ids);
}

/// Every process learns whether every process got through `step`; throws dp::Error
/// on every process otherwise (its own error where it failed). Collective.
void agree(const std::string& mine, const char* step) {
  const std::int64_t failed = dist::all_reduce(static_cast<std::int64_t>(mine.empty() ? 0 : 1), dist::Op::Max);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(failed == 0, "make_world_communicator (nccl): another process of the job failed to ", step,
           " (its own error says why); this process (rank ", dist::rank(), ") stops too");
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& options) {
  check_nccl_devices(devices, "make_communicator");
  if (shares_gpu(devices)) return make_copy_communicator(devices, options);  // Note [CUDA copy communicator]
  const int n = static_cast<int>(devices.size());
  auto family = std::make_shared<Family>();
  family->description = dp::detail::str_cat("the nccl communicator over ", n, " devices");
  family->watchdog = make_watchdog(*family, options.timeout);
  Layout layout{devices, n, 0, 0, n, 0, {}, "world", {}};
  for (int s = 0; s < n; ++s) layout.world_rank.push_back(s);
  auto comm = std::make_unique<NcclCommunicator>(std::move(layout), options, family, std::vector<cudaStream_t>{});
  ncclUniqueId id;
  DP_NCCL_CHECK(ncclGetUniqueId(&id));
  const Made made = init_ranks(devices, n, 0, id, options.timeout);
  DP_CHECK(made.error.empty(), family->description, ": initialisation failed: ", made.error);
  comm->install(made.comms);
  comm->adopt(nullptr, {});
  comm->start_watchdog();
  return comm;
}

std::unique_ptr<Communicator> make_nccl_world_communicator(const std::vector<Device>& devices,
                                                           const CommOptions& options) {
  // Every step that can fail on one process is agreed on by all (agree) before the
  // next collective one, so a failure throws on every process instead of leaving the
  // others in an NCCL initialisation that waits for it (Note [NCCL across processes]).
  const int processes = dist::world_size();
  const int process = dist::rank();
  const int n = static_cast<int>(devices.size());  // the same on every process (checked by the caller)
  const int world = processes * n;
  std::string mine;
  try {
    check_nccl_devices(devices, "make_world_communicator");
    DP_CHECK(!shares_gpu(devices), "make_world_communicator: devices ", devices.front(), " .. ",
             devices.back(), " share GPUs (", backend::kDevicesPerGpuEnv, "=",
             cuda().device_map().per_gpu(), "); across processes only NCCL is used, which needs one rank per GPU: ",
             "unset ", backend::kDevicesPerGpuEnv, " or run one process (Note [CUDA copy communicator])");
  } catch (const std::exception& e) {
    mine = e.what();
  }
  agree(mine, "check its CUDA devices");

  // Every process's device indices: devices() of peers(j), and messages.
  std::vector<std::int64_t> index(static_cast<std::size_t>(world), 0);
  for (int s = 0; s < n; ++s) index[static_cast<std::size_t>(process * n + s)] = devices[static_cast<std::size_t>(s)].index;
  dist::all_reduce(std::span<std::int64_t>(index), dist::Op::Sum);

  auto family = std::make_shared<Family>();
  family->spans_processes = processes > 1;
  family->description = dp::detail::str_cat("the nccl communicator over ", world, " GPUs of ", processes,
                                            " processes (", n, " per process)");
  family->watchdog = make_watchdog(*family, options.timeout);
  Layout layout{devices, world, process * n, 0, n, process * n, {}, "world", {}};
  for (int s = 0; s < n; ++s) layout.world_rank.push_back(process * n + s);
  std::unique_ptr<NcclCommunicator> comm;
  try {
    comm = std::make_unique<NcclCommunicator>(std::move(layout), options, family, std::vector<cudaStream_t>{});
  } catch (const std::exception& e) {
    mine = e.what();
  }
  agree(mine, "create its communication streams and events");

  // The unique id, made on process 0. A failure there travels with it (ok = 0).
  struct IdMessage {
    std::int32_t ok;
    ncclUniqueId id;
  };
  IdMessage message;
  std::memset(&message, 0, sizeof(message));  // every process broadcasts the same bytes' shape
  if (process == 0) {
    const ncclResult_t res = ncclGetUniqueId(&message.id);
    message.ok = res == ncclSuccess ? 1 : 0;
    if (res != ncclSuccess)
      mine = dp::detail::str_cat("make_world_communicator: ncclGetUniqueId failed on process 0: ",
                                 ncclGetErrorString(res), " (NCCL_DEBUG=WARN prints NCCL's reason; NCCL_SOCKET_IFNAME ",
                                 "picks the network interface)");
  }
  message = dist::broadcast_object(message, 0);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(message.ok == 1, "make_world_communicator: process 0 could not make the NCCL unique id (its own error ",
           "says why); this process (rank ", process, ") stops too");

  {
    // Installed before agreeing, so that a failure elsewhere aborts them (discard).
    const Made made = init_ranks(devices, world, process * n, message.id, options.timeout);
    if (made.error.empty()) comm->install(made.comms);
    try {
      agree(made.error.empty() ? std::string() : dp::detail::str_cat(family->description, ": ", made.error),
            "initialise its NCCL ranks");
    } catch (...) {
      discard(*family);
      throw;
    }
  }

  // Split at construction (Note [NCCL across processes]). The members are declared
  // here so that a failure can abort their comms before they are destroyed.
  std::unique_ptr<NcclCommunicator> local;
  std::vector<std::unique_ptr<NcclCommunicator>> peers;
  try {
    const std::vector<ncclComm_t> parents = comm->comms();
    const std::vector<cudaStream_t> streams = comm->streams();

    Layout local_layout{devices, n, 0, 0, n, 0, {}, "local", {}};
    for (int s = 0; s < n; ++s) local_layout.world_rank.push_back(process * n + s);
    mine.clear();
    try {
      local = std::make_unique<NcclCommunicator>(std::move(local_layout), options, family, streams);
      for (int s = 0; s < n; ++s) {
        Layout peer_layout{{}, processes, 0, process, 1, process, {process * n + s},
                           dp::detail::str_cat("peers(", s, ")"),
                           "; peers(j) has one rank per process: pass dp::dist::rank()"};
        for (int q = 0; q < processes; ++q)
          peer_layout.devices.push_back(dp::cuda(static_cast<int>(index[static_cast<std::size_t>(q * n + s)])));
        peers.push_back(std::make_unique<NcclCommunicator>(std::move(peer_layout), options, family,
                                                           std::vector<cudaStream_t>{streams[static_cast<std::size_t>(s)]}));
      }
    } catch (const std::exception& e) {
      mine = e.what();
    }
    agree(mine, "create the events of its split communicators");

    const std::vector<int> by_process(static_cast<std::size_t>(n), process);
    std::vector<int> by_slot(static_cast<std::size_t>(n));
    for (int s = 0; s < n; ++s) by_slot[static_cast<std::size_t>(s)] = s;
    {
      // local(): this process's ranks, in local order.
      const Made made = split_ranks(parents, devices, /*colors=*/by_process, /*keys=*/by_slot, options.timeout);
      if (made.error.empty()) local->install(made.comms);
      agree(made.error.empty() ? std::string() : dp::detail::str_cat(family->description, ", local(): ", made.error),
            "split its local communicator");
    }
    {
      // peers(j): local rank j of every process, in process order.
      const Made made = split_ranks(parents, devices, /*colors=*/by_slot, /*keys=*/by_process, options.timeout);
      if (made.error.empty())
        for (int s = 0; s < n; ++s) peers[static_cast<std::size_t>(s)]->install({made.comms[static_cast<std::size_t>(s)]});
      agree(made.error.empty() ? std::string() : dp::detail::str_cat(family->description, ", peers(j): ", made.error),
            "split its peers communicators");
    }
  } catch (...) {
    discard(*family);
    throw;
  }
  comm->adopt(std::move(local), std::move(peers));
  comm->start_watchdog();
  return comm;
}

}  // namespace dp::comm
