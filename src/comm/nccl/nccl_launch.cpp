// How the NCCL communicator's calls reach NCCL: enqueue on the comm stream, groups,
// polling until issued (Note [NCCL stream ordering], Note [NCCL groups], Note [NCCL
// failures] in nccl_communicator.h).
#include "comm/nccl/nccl_communicator.h"

#include <utility>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "dp/core/error.h"

namespace dp::comm::nccl {

ncclResult_t NcclCommunicator::issue(const Call& c, ncclComm_t comm, cudaStream_t s) {
  using Kind = Collective;
  const ncclDataType_t type = to_nccl(c.dtype);
  switch (c.kind) {
    case Kind::AllReduce: return ncclAllReduce(c.send, c.recv, c.count, type, to_nccl(c.op), comm, s);
    case Kind::Broadcast: return ncclBroadcast(c.send, c.recv, c.count, type, c.root, comm, s);
    case Kind::Reduce: return ncclReduce(c.send, c.recv, c.count, type, to_nccl(c.op), c.root, comm, s);
    case Kind::ReduceScatter: return ncclReduceScatter(c.send, c.recv, c.count, type, to_nccl(c.op), comm, s);
    case Kind::AllGather: return ncclAllGather(c.send, c.recv, c.count, type, comm, s);
    case Kind::kCount: break;
  }
  DP_FAIL("nccl communicator: ", c.what, " is not a collective");
}

void NcclCommunicator::group_start(int rank) {
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

void NcclCommunicator::group_end(int rank) {
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
  after_issue(rank, Call{.what = g.what, .kind = Collective::AllReduce, .send = nullptr, .recv = nullptr,
                         .count = g.count, .dtype = Dtype::Float32, .op = ReduceOp::Sum, .root = 0,
                         .deferred = !g.any_plain, .a = Tensor(), .b = Tensor(), .blocks = 1});
}

void NcclCommunicator::enqueue(int rank, const Call& c) {
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
    const std::pair<cudaEvent_t, cudaEvent_t> span = after_compute(rank, c, grouped);
    result = issue(c, comm, rk.stream);
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
    Group& g = rk.group;  // group_end finishes what after_issue does (Note [NCCL groups])
    if (g.calls++ == 0) g.what = c.what;
    g.count += c.count;
    g.bytes += bytes;
    (c.deferred ? g.any_deferred : g.any_plain) = true;
    return;
  }
  after_issue(rank, c);
}

std::pair<cudaEvent_t, cudaEvent_t> NcclCommunicator::after_compute(int rank, const Call& c, bool grouped) {
  Rank& rk = slot(rank);
  backend::CudaBackend& cb = cuda();
  const int dev = devices_[rank].index;
  cb.set_device(dev);
  cudaStream_t compute = cb.compute_stream(dev);
  DP_CUDA_CHECK(cudaEventRecord(rk.ready, compute));
  DP_CUDA_CHECK(cudaStreamWaitEvent(rk.stream, rk.ready, 0));
  std::pair<cudaEvent_t, cudaEvent_t> span{nullptr, nullptr};
  if (!c.deferred) return span;
  for (const Tensor* t : {&c.a, &c.b})
    if (t->defined()) cb.allocator(dev).record_stream(t->storage()->data(), rk.stream);
  if (!grouped || rk.group.span_end == nullptr) {  // a group has one span
    span = {timing_event(rk), timing_event(rk)};
    rk.open.spans.push_back(span);  // recycled with the window, whatever happens
    DP_CUDA_CHECK(cudaEventRecord(span.first, rk.stream));
    if (grouped) rk.group.span_end = span.second;
  }
  return span;
}

ncclResult_t NcclCommunicator::wait_issued(ncclComm_t comm, ncclResult_t res, int rank, const char* what) {
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

void NcclCommunicator::leave(int rank) {
  Rank& rk = slot(rank);
  ncclComm_t orphan = nullptr;
  {
    std::lock_guard<std::mutex> lock(rk.mu);
    rk.busy = false;
    if (aborted_.load(std::memory_order_acquire) && rk.comm != nullptr) orphan = std::exchange(rk.comm, nullptr);
  }
  if (orphan != nullptr) abort_comms({{orphan, devices_[rank]}});
}

void NcclCommunicator::after_issue(int rank, const Call& c) {
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

}  // namespace dp::comm::nccl
