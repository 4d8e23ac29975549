// The NCCL communicator's collectives, deferred work, timing and synchronize (see
// nccl_communicator.h for the class and its Notes).
#include "comm/nccl/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <utility>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "dp/core/error.h"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0),
              "dp needs NCCL >= 2.18 (non-blocking communicators, ncclAvg, ncclCommSplit)");

namespace dp::comm::nccl {

NcclCommunicator::NcclCommunicator(Layout layout, const CommOptions& options, std::shared_ptr<Family> family,
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

NcclCommunicator::~NcclCommunicator() {
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

void NcclCommunicator::adopt(std::unique_ptr<NcclCommunicator> local,
                             std::vector<std::unique_ptr<NcclCommunicator>> peers) {
  owner_ = true;
  local_ = std::move(local);
  peers_ = std::move(peers);
}

void NcclCommunicator::install(const std::vector<ncclComm_t>& comms) {
  DP_ASSERT(comms.size() == ranks_.size(), "install: ", comms.size(), " comms for ", ranks_.size(), " ranks");
  for (std::size_t s = 0; s < ranks_.size(); ++s) {
    std::lock_guard<std::mutex> lock(ranks_[s].mu);
    ranks_[s].comm = comms[s];
  }
}

std::vector<ncclComm_t> NcclCommunicator::comms() {
  std::vector<ncclComm_t> out;
  for (Rank& rk : ranks_) {
    std::lock_guard<std::mutex> lock(rk.mu);
    out.push_back(rk.comm);
  }
  return out;
}

std::vector<cudaStream_t> NcclCommunicator::streams() const {
  std::vector<cudaStream_t> out;
  for (const Rank& rk : ranks_) out.push_back(rk.stream);
  return out;
}

std::string NcclCommunicator::label(int s) const {
  const int world = layout_.world_rank[static_cast<std::size_t>(s)];
  if (layout_.name == "world")
    return dp::detail::str_cat(slot_device(s), " (world rank ", world, " of ", world_size_, ")");
  return dp::detail::str_cat(slot_device(s), " (rank ", layout_.first_nccl + s, " of ", world_size_, " of ",
                             layout_.name, "; world rank ", world, ")");
}

void NcclCommunicator::start_watchdog() {
  DP_ASSERT(owner_, "start_watchdog: not the family's owner");
  family_->watchdog->start(kWatchInterval);
}

Communicator* NcclCommunicator::peers(int rank) {
  if (peers_.empty()) return nullptr;
  check_rank(rank, "peers");
  return peers_[static_cast<std::size_t>(rank - layout_.first_arg)].get();
}

// ---- collectives (checked by the front: Note [Checked collectives]) ---------------

NcclCommunicator::Call NcclCommunicator::all_reduce_call(const Tensor& send, const Tensor& recv, ReduceOp op,
                                                         bool deferred) {
  return Call{.what = "all_reduce", .kind = Collective::AllReduce, .send = send.raw_data(), .recv = recv.raw_data(),
              .count = static_cast<std::size_t>(send.numel()), .dtype = send.dtype(), .op = op, .root = 0,
              .deferred = deferred, .a = send, .b = recv, .blocks = 1};
}

NcclCommunicator::Call NcclCommunicator::reduce_call(int rank, const Tensor& send, const Tensor& recv, int root,
                                                     ReduceOp op, bool deferred) const {
  const bool is_root = nccl_rank(rank) == root;  // roots are world ranks
  return Call{.what = "reduce", .kind = Collective::Reduce, .send = send.raw_data(),
              .recv = is_root ? recv.raw_data() : nullptr,  // NCCL ignores recvbuff on non-root ranks
              .count = static_cast<std::size_t>(send.numel()), .dtype = send.dtype(), .op = op, .root = root,
              .deferred = deferred, .a = send, .b = is_root ? recv : Tensor(), .blocks = 1};
}

void NcclCommunicator::do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  enqueue(rank, all_reduce_call(send, recv, op, /*deferred=*/false));
}

void NcclCommunicator::do_all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  enqueue(rank, all_reduce_call(send, recv, op, /*deferred=*/true));
}

void NcclCommunicator::do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  enqueue(rank, reduce_call(rank, send, recv, root, op, /*deferred=*/false));
}

void NcclCommunicator::do_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  enqueue(rank, reduce_call(rank, send, recv, root, op, /*deferred=*/true));
}

void NcclCommunicator::do_broadcast(int rank, const Tensor& data, int root) {
  void* p = data.raw_data();
  enqueue(rank, Call{.what = "broadcast", .kind = Collective::Broadcast, .send = p, .recv = p,
                     .count = static_cast<std::size_t>(data.numel()), .dtype = data.dtype(), .op = ReduceOp::Sum,
                     .root = root, .deferred = false, .a = data, .b = Tensor(), .blocks = 1});
}

void NcclCommunicator::do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  // World-rank blocks (Note [World ranks]): NCCL's own layout.
  enqueue(rank, Call{.what = "reduce_scatter", .kind = Collective::ReduceScatter, .send = send.raw_data(),
                     .recv = recv.raw_data(), .count = static_cast<std::size_t>(recv.numel()), .dtype = send.dtype(),
                     .op = op, .root = 0, .deferred = false, .a = send, .b = recv, .blocks = world_size()});
}

void NcclCommunicator::do_all_gather(int rank, const Tensor& send, const Tensor& recv) {
  enqueue(rank, Call{.what = "all_gather", .kind = Collective::AllGather, .send = send.raw_data(),
                     .recv = recv.raw_data(), .count = static_cast<std::size_t>(send.numel()), .dtype = send.dtype(),
                     .op = ReduceOp::Sum, .root = 0, .deferred = false, .a = send, .b = recv, .blocks = world_size()});
}

// ---- after the collectives: join, deferred work, timing, synchronize ---------------

void NcclCommunicator::join(int rank) {
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

void NcclCommunicator::after_deferred(int rank, const std::function<void()>& work) {
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

Communicator::StreamTimes NcclCommunicator::take_times(int rank) {
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

void NcclCommunicator::synchronize(int rank) {
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

cudaEvent_t NcclCommunicator::take_event(Rank& rk) {  // rk.mu held
  if (!rk.free_events.empty()) {
    cudaEvent_t e = rk.free_events.back();
    rk.free_events.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

cudaEvent_t NcclCommunicator::timing_event(Rank& rk) {
  if (!rk.free_timing.empty()) {
    cudaEvent_t e = rk.free_timing.back();
    rk.free_timing.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  DP_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

void NcclCommunicator::recycle(Rank& rk, const Window& w) {
  for (const auto& [a, b] : w.spans) rk.free_timing.insert(rk.free_timing.end(), {a, b});
  if (w.arrived != nullptr) rk.free_timing.push_back(w.arrived);
}

bool NcclCommunicator::complete(cudaEvent_t e) {
  const cudaError_t state = cudaEventQuery(e);
  if (state == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  DP_CUDA_CHECK(state);
  return true;
}

double NcclCommunicator::elapsed_ms(cudaEvent_t from, cudaEvent_t to) {
  float ms = 0;  // a span whose call failed has no end record: it counts 0
  if (cudaEventElapsedTime(&ms, from, to) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return ms;
}

}  // namespace dp::comm::nccl
