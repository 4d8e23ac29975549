// The NCCL communicator: collectives among the local CUDA devices of one process.
//
// Rank i is devices[i]; one ncclComm per device from ncclCommInitAll; every rank is
// driven by its own thread (one thread per GPU, like Caffe's P2PSync or Marian's
// thread pool). Nothing here waits on the host: see Note [NCCL stream ordering].
// Built only with the CUDA backend (src/comm/nccl/meson.build), whose internal headers
// it uses for streams and devices; nccl_stub.cpp stands in otherwise.
#include <nccl.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "comm/nccl_factory.h"
#include "dp/core/error.h"

static_assert(NCCL_VERSION_CODE >= 21000, "dp needs NCCL >= 2.10 (ncclAvg)");

namespace dp::comm {

// Note [NCCL stream ordering]
// Each device has a communication stream of the highest priority, so a gradient
// bucket's all-reduce overtakes queued backward kernels. A collective called on rank r
// (by the thread that drives device r):
//   1. records `ready` on the thread's current compute stream of the device (it marks
//      the point where the producer of `send` — e.g. backward — has been enqueued);
//   2. makes the comm stream wait for `ready`, then enqueues the NCCL call on it;
//   3. records `done` on the comm stream and makes the compute stream wait for it,
//      so whatever the thread enqueues next (the optimizer step) runs after the
//      collective. The host never waits; synchronize(r) is the explicit host wait.
// Memory: the buffers are allocated on the compute stream, which waits for `done`
// before anything enqueued later, so the caching allocator can hand a freed buffer to
// later compute work without CachingAllocator::record_stream. One `ready`/`done` pair
// per rank suffices: cudaStreamWaitEvent captures the event's latest record at call
// time, and only rank r's thread records them.

namespace {

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

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::vector<Device> devices)
      : Communicator(std::move(devices)), ranks_(devices_.size()) {
    backend::CudaBackend& cb = cuda();
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const int dev = devices_[r].index;
      cb.set_device(dev);
      int least = 0, greatest = 0;  // greatest = numerically lowest = runs first
      DP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      ranks_[r].stream = cb.create_stream(dev, greatest);
      DP_CUDA_CHECK(cudaEventCreateWithFlags(&ranks_[r].ready, cudaEventDisableTiming));
      DP_CUDA_CHECK(cudaEventCreateWithFlags(&ranks_[r].done, cudaEventDisableTiming));
    }
    init_comms();
  }

  ~NcclCommunicator() override {
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rk = ranks_[r];
      try {
        cuda().set_device(devices_[r].index);
      } catch (const std::exception& e) {
        dp::detail::log_warning(dp::detail::str_cat("~NcclCommunicator: ", e.what()));
      }
      if (rk.comm != nullptr) {
        // Finish what was enqueued before the communicator goes; never throw here.
        DP_CUDA_WARN(cudaStreamSynchronize(rk.stream));
        const ncclResult_t res = ncclCommDestroy(rk.comm);
        if (res != ncclSuccess)
          dp::detail::log_warning(dp::detail::str_cat("ncclCommDestroy on ", devices_[r],
                                                      " failed: ", ncclGetErrorString(res)));
      }
      if (rk.ready != nullptr) DP_CUDA_WARN(cudaEventDestroy(rk.ready));
      if (rk.done != nullptr) DP_CUDA_WARN(cudaEventDestroy(rk.done));
      // The stream belongs to the backend (Note [Process-lifetime CUDA objects]).
    }
  }

  std::string backend_name() const override { return "nccl"; }

  void all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    check_rank(rank, "all_reduce");
    const Device dev = devices_[rank];
    check_tensor(send, "send", dev, "all_reduce");
    check_tensor(recv, "recv", dev, "all_reduce");
    DP_CHECK(recv.numel() == send.numel(), "all_reduce on ", dev, ": recv has ", recv.numel(),
             " elements but send has ", send.numel(), "; they must match");
    const std::size_t count = static_cast<std::size_t>(send.numel());
    const void* sp = send.raw_data();
    void* rp = recv.raw_data();
    enqueue(rank, "all_reduce", count, [&](ncclComm_t c, cudaStream_t s) {
      DP_NCCL_CHECK(ncclAllReduce(sp, rp, count, ncclFloat, to_nccl(op), c, s));
    });
  }

  void broadcast(int rank, const Tensor& data, int root) override {
    check_rank(rank, "broadcast");
    check_root(root, "broadcast");
    check_tensor(data, "data", devices_[rank], "broadcast");
    const std::size_t count = static_cast<std::size_t>(data.numel());
    void* p = data.raw_data();
    enqueue(rank, "broadcast", count, [&](ncclComm_t c, cudaStream_t s) {
      DP_NCCL_CHECK(ncclBroadcast(p, p, count, ncclFloat, root, c, s));
    });
  }

  void reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
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
    enqueue(rank, "reduce", count, [&](ncclComm_t c, cudaStream_t s) {
      DP_NCCL_CHECK(ncclReduce(sp, rp, count, ncclFloat, to_nccl(op), root, c, s));
    });
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
    enqueue(rank, "reduce_scatter", recv_count, [&](ncclComm_t c, cudaStream_t s) {
      DP_NCCL_CHECK(ncclReduceScatter(sp, rp, recv_count, ncclFloat, to_nccl(op), c, s));
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
    enqueue(rank, "all_gather", send_count, [&](ncclComm_t c, cudaStream_t s) {
      DP_NCCL_CHECK(ncclAllGather(sp, rp, send_count, ncclFloat, c, s));
    });
  }

  void synchronize(int rank) override {
    check_rank(rank, "synchronize");
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    cuda().set_device(devices_[rank].index);
    // No lock while waiting: abort() must be able to take it and release this wait.
    const cudaError_t waited = cudaStreamSynchronize(rk.stream);
    std::lock_guard<std::mutex> lock(rk.mu);
    throw_if_aborted("synchronize", rank);  // an abort explains a failed wait best
    DP_CUDA_CHECK(waited);
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
    // ncclCommAbort stops the kernels of every rank, so a rank waiting in
    // synchronize() (or a stream waiting for a peer that never came) is released.
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      Rank& rk = ranks_[r];
      std::lock_guard<std::mutex> lock(rk.mu);
      if (rk.comm == nullptr) continue;
      try {
        cuda().set_device(devices_[r].index);
      } catch (const std::exception& e) {  // abort never throws: it runs on failure paths
        dp::detail::log_warning(dp::detail::str_cat("nccl abort: ", e.what()));
      }
      const ncclResult_t res = ncclCommAbort(rk.comm);
      if (res != ncclSuccess)
        dp::detail::log_warning(dp::detail::str_cat("ncclCommAbort on ", devices_[r],
                                                    " failed: ", ncclGetErrorString(res)));
      rk.comm = nullptr;
    }
  }

  void reset() override {
    if (!aborted_.load(std::memory_order_acquire)) return;
    std::vector<std::unique_lock<std::mutex>> locks;
    for (Rank& rk : ranks_) locks.emplace_back(rk.mu);
    init_comms();
    std::lock_guard<std::mutex> lock(reason_mu_);
    reason_.clear();
    aborted_.store(false, std::memory_order_release);
  }

 private:
  struct Rank {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;  // owned by the backend
    cudaEvent_t ready = nullptr;    // compute stream → comm stream
    cudaEvent_t done = nullptr;     // comm stream → compute stream
    // Serialises this rank's enqueues with abort()/reset(); only the rank's own thread
    // takes it otherwise, so it is never contended on the hot path.
    std::mutex mu;
  };

  void init_comms() {
    std::vector<ncclComm_t> comms(ranks_.size(), nullptr);
    std::vector<int> ids;
    for (const Device& d : devices_) ids.push_back(d.index);
    DP_NCCL_CHECK(ncclCommInitAll(comms.data(), size(), ids.data()));
    backend::CudaBackend::invalidate_device_cache();  // NCCL called cudaSetDevice
    for (std::size_t r = 0; r < ranks_.size(); ++r) ranks_[r].comm = comms[r];
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

  /// Orders `call` after the compute stream and the compute stream after it (Note
  /// [NCCL stream ordering]). Counts are elements; count 0 enqueues nothing (the same
  /// on every rank, since every rank passes the same count).
  template <typename F>
  void enqueue(int rank, const char* what, std::size_t count, F&& call) {
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    std::lock_guard<std::mutex> lock(rk.mu);
    throw_if_aborted(what, rank);
    if (count == 0) return;
    backend::CudaBackend& cb = cuda();
    const int dev = devices_[rank].index;
    cb.set_device(dev);
    cudaStream_t compute = cb.compute_stream(dev);
    DP_CUDA_CHECK(cudaEventRecord(rk.ready, compute));
    DP_CUDA_CHECK(cudaStreamWaitEvent(rk.stream, rk.ready, 0));
    call(rk.comm, rk.stream);
    DP_CUDA_CHECK(cudaEventRecord(rk.done, rk.stream));
    DP_CUDA_CHECK(cudaStreamWaitEvent(compute, rk.done, 0));
  }

  std::vector<Rank> ranks_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mu_;  // guards reason_
  std::string reason_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device>& devices) {
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
  return std::make_unique<NcclCommunicator>(devices);
}

}  // namespace dp::comm
