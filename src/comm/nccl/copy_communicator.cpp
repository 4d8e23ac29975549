// The CUDA copy communicator (see copy_communicator.h and the Note below).
#include "comm/nccl/copy_communicator.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "comm/argument_checks.h"
#include "dp/core/error.h"

namespace dp::comm {

// Note [CUDA copy communicator]
// NCCL refuses two ranks of one communicator on one GPU ("duplicate GPU"), so dp
// devices that share a GPU (Note [Logical CUDA devices], cuda_backend.h) communicate
// through this communicator: device-to-device copies and one sum kernel, on a comm
// stream per device, ordered by events — the NCCL communicator's stream discipline
// (Note [NCCL stream ordering]) with the local communicator's arithmetic (Note [Fixed
// summation order]: element i is ((x_0 + x_1) + ...) + x_{N-1}, then * (1.0f / N) for
// Average), so a sum here is bitwise the sum the CPU local communicator computes on the
// same inputs, and every rank gets the same bits.
//
// Protocol. Every rank's thread calls each collective (the Communicator contract). A
// collective is a few phases separated by host rendezvous on a barrier (a mutex and a
// condition variable: this communicator tests, it does not race the local one's
// lock-free barrier); the rendezvous exchange pointers and order the host calls,
// never GPU work, and nothing waits on the host for the GPU:
//   phase 0  rank r records `ready` on its compute stream (its inputs are enqueued
//            there), makes its comm stream wait for it, publishes its slot (buffers,
//            count, root, op, scratch, or why its arguments are bad); rendezvous, where
//            every rank checks every slot and all throw alike on a mismatch;
//   phase 1  r's comm stream waits for the `ready` of the ranks it reads, then sums or
//            copies; records `e1`; rendezvous;
//   phase 2  (all_reduce only) r waits for every `e1`, copies the reduced slices of
//            the others into its recv; records `e2`; rendezvous;
//   end      r's comm stream waits for the last event of every rank that read r's
//            buffers, so r's comm stream is past every read of them; a plain
//            collective then makes r's compute stream wait for the comm stream, a
//            deferred one leaves that to join(r) (Note [Deferred collectives]).
// An event is recorded only by its rank and waited on only after the rendezvous that
// follows its record, and re-recorded only after the next rendezvous, which no rank
// passes before finishing its waits: cudaStreamWaitEvent always captures the record
// meant. A GPU stream therefore never waits for an event that is not yet recorded,
// so an abort (a failed worker) can strand host threads only, and the barrier's abort
// releases those; no GPU work can hang.
// All-reduce is reduce-scatter + all-gather, the bandwidth-optimal split: rank r sums
// slice r of every send into a scratch block of its own (allocated on its comm stream,
// freed at the end, so the allocator reuses it only after every rank has copied it),
// and every rank then copies every reduced slice into its recv — in place too, since
// the recv is written only after every rank has read every send (phase 2 waits for
// every `e1`). Slices start on multiples of 16 elements (64 bytes of float32) so that
// the sum kernel's float4 path applies to every slice of an aligned buffer. bfloat16
// and float16 buffers are summed in float and rounded once into the scratch (the
// summation of Note [Collective dtypes]); offsets and sizes count the call's elements.
// Memory: r's buffers are read by the other ranks' streams, but r's comm stream waits
// for those reads (end), so declaring r's buffers used on r's comm stream
// (record_stream) keeps them from reuse by later compute work, as in the NCCL
// communicator; a plain collective needs no declaration (the compute stream waits).
// Devices on different GPUs: the sum kernel reads peer memory, so every pair of GPUs
// involved must have peer access (checked at construction); copies between GPUs are
// cudaMemcpyPeerAsync. Across processes the NCCL world communicator stays the only
// one: make_world_communicator refuses devices that share a GPU.
// Timeout: a rank that waits in a rendezvous longer than CommOptions::timeout aborts
// the communicator, naming the ranks that never came (a peer that failed without
// DataParallel's abort, or a caller that skipped the collective): every waiting rank
// then throws dp::CollectiveAborted with that reason, as the NCCL communicator's
// watchdog ends a collective that never completes. Only host threads can wait here.
// Timing: times_on_device() is false; callers time collectives on the host, as for
// the local communicator. A collective costs 2 or 3 host rendezvous (microseconds),
// which is what the local communicator pays too; this communicator exists to test the
// multi-device runtime on one GPU, not to be fast.

namespace {

using backend::CudaBackend;
namespace ck = backend::cuda_kernels;

CudaBackend& cuda() { return CudaBackend::instance(); }

/// Slices start on multiples of 16 elements: see the Note.
constexpr std::int64_t kSliceAlign = 16;

struct Slice {
  std::int64_t off = 0;
  std::int64_t len = 0;
};

/// Slice r of `count` elements split into n slices (len may be 0).
Slice slice_of(std::int64_t count, int n, int r) {
  std::int64_t per = (count + n - 1) / n;
  per = (per + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const std::int64_t off = std::min(count, per * r);
  return {off, std::min(per, count - off)};
}

using Kind = Communicator::Collective;

/// A generation barrier that abort() releases: arrive_and_wait returns false once the
/// barrier is aborted (sticky until reset(), which is called with no rank inside), or
/// when the ranks it waits for have not all arrived within `timeout`: the waiter then
/// aborts it, naming the ranks that never came, which releases every other waiter too.
class Barrier {
 public:
  Barrier(int parties, std::chrono::milliseconds timeout)
      : parties_(parties), timeout_(timeout), here_(static_cast<std::size_t>(parties), false) {}
  [[nodiscard]] bool arrive_and_wait(int rank, const char* what, const Device& dev) {
    std::unique_lock<std::mutex> lock(mu_);
    if (aborted_) return false;
    const std::uint64_t gen = generation_;
    here_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      std::fill(here_.begin(), here_.end(), false);
      ++generation_;
      cv_.notify_all();
      return true;
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || aborted_; })) {
      std::string missing;
      for (int r = 0; r < parties_; ++r)
        if (!here_[static_cast<std::size_t>(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      abort_locked(dp::detail::str_cat("copy communicator: ", what, " timed out on ", dev, " after ",
                                       timeout_.count(), " ms waiting for rank(s) ", missing,
                                       " (did a peer fail, or never call it?)"));
      return false;
    }
    return generation_ != gen;  // released by the last arrival, even if an abort followed
  }
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    abort_locked(reason);
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = false;
    arrived_ = 0;
    std::fill(here_.begin(), here_.end(), false);
    reason_.clear();
  }
  bool aborted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }
  std::string reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

 private:
  void abort_locked(const std::string& reason) {
    if (!aborted_) reason_ = reason;
    aborted_ = true;
    cv_.notify_all();
  }

  const int parties_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::vector<bool> here_;  // which ranks arrived in the current round
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string reason_;
};

class CopyCommunicator final : public Communicator {
 public:
  CopyCommunicator(const std::vector<Device>& devices, const CommOptions& options)
      : Communicator(devices), barrier_(static_cast<int>(devices.size()), options.timeout), slots_(devices.size()),
        ranks_(devices.size()) {
    DP_CHECK(size() <= ck::kMaxSumInputs, "copy communicator: expected at most ", ck::kMaxSumInputs,
             " devices, got ", size());
    CudaBackend& cb = cuda();
    for (int a = 0; a < size(); ++a) {
      for (int b = 0; b < size(); ++b) {
        if (a == b) continue;
        const int da = devices_[a].index, db = devices_[b].index;
        DP_CHECK(cb.enable_peer_access(da, db), "copy communicator: ", devices_[a], " (GPU ",
                 cb.physical_device(da), ") cannot access the memory of ", devices_[b], " (GPU ",
                 cb.physical_device(db), "); with ", backend::kDevicesPerGpuEnv,
                 " > 1 every pair of GPUs used must support peer access — use devices of one GPU, ",
                 "or one device per GPU (NCCL)");
      }
    }
    for (int r = 0; r < size(); ++r) {
      Rank& rk = ranks_[static_cast<std::size_t>(r)];
      const int dev = devices_[r].index;
      cb.set_device(dev);
      int least = 0, greatest = 0;  // greatest = numerically lowest = runs first
      DP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      rk.stream = cb.create_stream(dev, greatest);
      for (cudaEvent_t* e : {&rk.ready, &rk.e1, &rk.e2, &rk.done})
        DP_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
  }

  ~CopyCommunicator() override {
    // Nothing enqueued here can wait for anything unrecorded (the Note): draining
    // always ends. Never throws.
    for (int r = 0; r < size(); ++r) {
      Rank& rk = ranks_[static_cast<std::size_t>(r)];
      try {
        cuda().set_device(devices_[r].index);
      } catch (const std::exception& e) {
        dp::detail::log_warning(e.what());
      }
      if (rk.stream != nullptr) DP_CUDA_WARN(cudaStreamSynchronize(rk.stream));
      for (cudaEvent_t e : {rk.ready, rk.e1, rk.e2, rk.done})
        if (e != nullptr) DP_CUDA_WARN(cudaEventDestroy(e));
      // The stream belongs to the backend (Note [Process-lifetime CUDA objects]).
    }
  }

  std::string backend_name() const override { return "cuda-copy"; }

  void synchronize(int rank) override {
    check_rank(rank, "synchronize");
    throw_if_aborted("synchronize", rank);
    cuda().set_device(devices_[rank].index);
    DP_CUDA_CHECK(cudaStreamSynchronize(ranks_[static_cast<std::size_t>(rank)].stream));
  }

  void abort(const std::string& reason) override { barrier_.abort(reason); }
  void reset() override {
    barrier_.reset();
    for (Rank& rk : ranks_) rk.deferred = false;
  }

 protected:
  void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    all_reduce_impl(rank, send, recv, op, false);
  }
  void do_all_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    all_reduce_impl(rank, send, recv, op, true);
  }
  void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
    reduce_impl(rank, send, recv, root, op, false);
  }
  void do_reduce_deferred(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override {
    reduce_impl(rank, send, recv, root, op, true);
  }

  /// Publishes the problem in phase 0: every rank throws dp::Error naming it.
  void refuse(int rank, Collective kind, const std::string& problem) override {
    Slot s;
    s.call.kind = kind;
    s.error = problem;
    (void)begin(rank, std::move(s), collective_name(kind), {});
  }

  void do_broadcast(int rank, const Tensor& data, int root) override {
    Slot s;
    s.call = {Kind::Broadcast, data.dtype(), ReduceOp::Sum, root, data.numel()};
    s.send = static_cast<const std::byte*>(data.raw_data());
    s.recv = static_cast<std::byte*>(data.raw_data());
    // Note [Profiler ranges].
    backend::ScopedRange range(devices_[rank], "cuda-copy", "broadcast", data.nbytes());
    Call c = begin(rank, std::move(s), "broadcast", {data});
    if (rank != root) {
      const Slot& src = c.slots[static_cast<std::size_t>(root)];
      wait(rank, root, &Rank::ready);
      copy_bytes(rank, root, c.me().recv, src.send, data.nbytes());
    }
    record(rank, &Rank::e1);
    sync(rank, "broadcast");
    if (rank == root)  // root's data was read by every rank
      for (int j = 0; j < size(); ++j) wait(rank, j, &Rank::e1);
    finish(rank, c, false);
  }

  void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override {
    Slot s;
    s.call = {Kind::ReduceScatter, send.dtype(), op, 0, recv.numel()};
    s.send = static_cast<const std::byte*>(send.raw_data());
    s.recv = static_cast<std::byte*>(recv.raw_data());
    // recv may be this rank's own block of send (in place), nothing else of it: the
    // other blocks are read by the other ranks while recv is written.
    const std::byte* own = s.send + rank * recv.nbytes();
    if (s.recv != own && overlaps(s.send, send.nbytes(), s.recv, recv.nbytes()))
      s.error = "recv overlaps send other than as this rank's block of it; pass that block or a separate buffer";
    // Note [Profiler ranges] (size: all blocks).
    backend::ScopedRange range(devices_[rank], "cuda-copy", "reduce_scatter", send.nbytes());
    Call c = begin(rank, std::move(s), "reduce_scatter", {send, recv});
    const std::int64_t n = c.me().call.count;
    const Dtype dt = c.me().call.dtype;
    ck::SumInputs in;
    in.count = size();
    for (int j = 0; j < size(); ++j) {
      wait(rank, j, &Rank::ready);
      in.ptr[j] = at(c.slots[static_cast<std::size_t>(j)].send, rank * n, dt);
    }
    sum(rank, in, c.me().recv, n, op, dt);
    record(rank, &Rank::e1);
    sync(rank, "reduce_scatter");
    for (int j = 0; j < size(); ++j) wait(rank, j, &Rank::e1);  // every rank read this send
    finish(rank, c, false);
  }

  void do_all_gather(int rank, const Tensor& send, const Tensor& recv) override {
    Slot s;
    s.call = {Kind::AllGather, send.dtype(), ReduceOp::Sum, 0, send.numel()};
    s.send = static_cast<const std::byte*>(send.raw_data());
    s.recv = static_cast<std::byte*>(recv.raw_data());
    // Note [Profiler ranges] (size: all blocks).
    backend::ScopedRange range(devices_[rank], "cuda-copy", "all_gather", recv.nbytes());
    Call c = begin(rank, std::move(s), "all_gather", {send, recv});
    const std::size_t block = send.nbytes();
    for (int k = 0; k < size(); ++k) {
      const int j = (rank + k) % size();  // start at different blocks: spread the reads
      wait(rank, j, &Rank::ready);
      copy_bytes(rank, j, c.me().recv + j * block, c.slots[static_cast<std::size_t>(j)].send, block);
    }
    record(rank, &Rank::e1);
    sync(rank, "all_gather");
    for (int j = 0; j < size(); ++j) wait(rank, j, &Rank::e1);  // every rank read this send
    finish(rank, c, false);
  }

 public:
  void join(int rank) override {
    check_rank(rank, "join");
    throw_if_aborted("join", rank);
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    if (!rk.deferred) return;
    rk.deferred = false;
    CudaBackend& cb = cuda();
    const int dev = devices_[rank].index;
    cb.set_device(dev);
    DP_CUDA_CHECK(cudaEventRecord(rk.done, rk.stream));
    DP_CUDA_CHECK(cudaStreamWaitEvent(cb.compute_stream(dev), rk.done, 0));
  }

  // Note [Work after deferred collectives] in communicator.h: on the comm stream, which
  // finish() left past every read of the rank's buffers.
  void after_deferred(int rank, const std::function<void()>& work) override {
    check_rank(rank, "after_deferred");
    throw_if_aborted("after_deferred", rank);
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    const int dev = devices_[rank].index;
    cuda().set_device(dev);
    {
      backend::CudaStreamGuard on_comm(dev, rk.stream);
      work();
    }
    rk.deferred = true;  // join() orders the compute stream after the work too
  }

 private:
  struct Rank {
    cudaStream_t stream = nullptr;  // comm stream (highest priority), the backend's
    cudaEvent_t ready = nullptr;    // phase 0: the inputs are enqueued
    cudaEvent_t e1 = nullptr;       // phase 1 done
    cudaEvent_t e2 = nullptr;       // phase 2 done (all_reduce)
    cudaEvent_t done = nullptr;     // the comm stream's end, for the compute stream
    bool deferred = false;          // deferred collectives since the last join
  };

  /// What one rank publishes (phase 0).
  struct Slot {
    CallShape call;  // count: all_reduce/reduce/broadcast: elements; RS: recv; AG: send
    const std::byte* send = nullptr;
    std::byte* recv = nullptr;
    std::byte* scratch = nullptr;  // elements of call.dtype
    std::string error;  // non-empty: this rank's arguments are bad
  };

  /// A scratch block of the comm stream, freed (stream-ordered, never throwing) when
  /// the collective ends — or leaves by an exception: an aborted collective's result
  /// is discarded, so a block reused while a peer still copies from it harms nothing.
  struct ScratchBlock {
    backend::CachingAllocator* alloc = nullptr;
    void* ptr = nullptr;
    ScratchBlock() = default;
    ScratchBlock(ScratchBlock&& o) noexcept : alloc(o.alloc), ptr(std::exchange(o.ptr, nullptr)) {}
    ScratchBlock& operator=(ScratchBlock&&) = delete;
    ~ScratchBlock() { release(); }
    void release() noexcept {
      if (ptr != nullptr) alloc->deallocate(std::exchange(ptr, nullptr));
    }
  };

  /// One collective on one rank: the snapshot of every slot and this rank's scratch.
  struct Call {
    int rank = 0;
    std::vector<Slot> slots;
    ScratchBlock scratch;
    std::vector<Tensor> buffers;  // this rank's buffers, declared when deferred
    const Slot& me() const { return slots[static_cast<std::size_t>(rank)]; }
  };

  void throw_if_aborted(const char* what, int rank) const {
    if (barrier_.aborted()) throw_aborted(what, rank, barrier_.reason());
  }

  /// Meets every rank; dp::CollectiveAborted when the communicator is (or becomes)
  /// aborted.
  void sync(int rank, const char* what) {
    if (!barrier_.arrive_and_wait(rank, what, devices_[rank])) throw_aborted(what, rank, barrier_.reason());
  }

  /// Phase 0: records `ready`, publishes `slot` (with a scratch block of
  /// `scratch_elements` of the call's dtype on the comm stream when asked) and checks
  /// every rank's slot; throws dp::Error on every rank alike when one is bad or the
  /// ranks disagree.
  Call begin(int rank, Slot slot, const char* what, std::vector<Tensor> buffers,
             std::int64_t scratch_elements = 0) {
    throw_if_aborted(what, rank);
    CudaBackend& cb = cuda();
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    const int dev = devices_[rank].index;
    Call c;
    c.rank = rank;
    c.buffers = std::move(buffers);
    if (slot.error.empty()) {
      try {
        cb.set_device(dev);
        DP_CUDA_CHECK(cudaEventRecord(rk.ready, cb.compute_stream(dev)));
        DP_CUDA_CHECK(cudaStreamWaitEvent(rk.stream, rk.ready, 0));
        if (scratch_elements > 0) {
          c.scratch.alloc = &cb.allocator(dev);
          c.scratch.ptr = c.scratch.alloc->allocate(
              static_cast<std::size_t>(scratch_elements) * element_size(slot.call.dtype), rk.stream);
          slot.scratch = static_cast<std::byte*>(c.scratch.ptr);
        }
      } catch (const std::exception& e) {
        slot.error = e.what();  // every rank must still meet: fail them all alike
      }
    }
    slots_[static_cast<std::size_t>(rank)] = std::move(slot);
    sync(rank, what);
    c.slots = slots_;
    // Every rank judges the same snapshot, so every rank reaches the same verdict.
    const std::string problem = rendezvous_problem(rank, c.slots, [&](int r) {
      return dp::detail::str_cat("rank ", r, " (", devices_[static_cast<std::size_t>(r)], ")");
    });
    if (!problem.empty()) {
      // Nobody leaves before everyone has read the slots (a rank entering its next
      // collective would overwrite one still being read).
      sync(rank, what);
      DP_FAIL(call_site(what, rank), ": ", problem);
    }
    return c;
  }

  /// End: the comm stream is past every read of this rank's buffers (the caller made
  /// it wait); frees the scratch, declares the buffers of a deferred collective and
  /// orders the compute stream (plain) or leaves that to join (deferred).
  void finish(int rank, Call& c, bool deferred) {
    CudaBackend& cb = cuda();
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    const int dev = devices_[rank].index;
    cb.set_device(dev);
    c.scratch.release();
    if (deferred) {
      for (const Tensor& t : c.buffers)
        if (t.defined()) cb.allocator(dev).record_stream(t.storage()->data(), rk.stream);
      rk.deferred = true;
      return;
    }
    DP_CUDA_CHECK(cudaEventRecord(rk.done, rk.stream));
    DP_CUDA_CHECK(cudaStreamWaitEvent(cb.compute_stream(dev), rk.done, 0));
  }

  /// rank's comm stream waits for rank j's event `which`. Its own events need no wait:
  /// `ready` was waited for in phase 0, and its own phases follow each other on its
  /// stream.
  void wait(int rank, int j, cudaEvent_t Rank::*which) {
    if (j == rank) return;
    DP_CUDA_CHECK(cudaStreamWaitEvent(ranks_[static_cast<std::size_t>(rank)].stream,
                                      ranks_[static_cast<std::size_t>(j)].*which, 0));
  }

  void record(int rank, cudaEvent_t Rank::*which) {
    Rank& rk = ranks_[static_cast<std::size_t>(rank)];
    cuda().set_device(devices_[rank].index);
    DP_CUDA_CHECK(cudaEventRecord(rk.*which, rk.stream));
  }

  /// `bytes` bytes from rank `from`'s memory to rank `rank`'s, on rank's comm stream.
  void copy_bytes(int rank, int from, std::byte* dst, const std::byte* src, std::size_t bytes) {
    if (bytes == 0 || dst == src) return;
    CudaBackend& cb = cuda();
    const int dev = devices_[rank].index, src_dev = devices_[from].index;
    cb.set_device(dev);
    cudaStream_t s = ranks_[static_cast<std::size_t>(rank)].stream;
    const int gpu = cb.physical_device(dev), src_gpu = cb.physical_device(src_dev);
    if (gpu == src_gpu) {
      DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    } else {
      DP_CUDA_CHECK(cudaMemcpyPeerAsync(dst, gpu, src, src_gpu, bytes, s));
    }
  }

  /// Element `i` of a buffer of `dtype`: a reduction takes float32, bfloat16 or float16
  /// (the default supports(), Note [Collective dtypes]), so offsets and sizes count
  /// elements of the call's dtype, never floats.
  template <typename Byte>  // std::byte or const std::byte
  static Byte* at(Byte* p, std::int64_t i, Dtype dtype) {
    return p + i * static_cast<std::int64_t>(element_size(dtype));
  }

  /// dst = fixed-order sum of `in` in float, rounded once to dtype (Average: * 1.0f / N,
  /// computed as the CPU does).
  void sum(int rank, const ck::SumInputs& in, void* dst, std::int64_t n, ReduceOp op, Dtype dtype) {
    if (n <= 0) return;
    cuda().set_device(devices_[rank].index);
    const float inv = 1.0f / static_cast<float>(in.count);
    ck::sum_inputs(ranks_[static_cast<std::size_t>(rank)].stream, in, dst, n, op == ReduceOp::Average, inv,
                   static_cast<backend::DType>(dtype));
  }

  void all_reduce_impl(int rank, const Tensor& send, const Tensor& recv, ReduceOp op, bool deferred) {
    Slot s;
    s.call = {Kind::AllReduce, send.dtype(), op, 0, send.numel()};
    s.send = static_cast<const std::byte*>(send.raw_data());
    s.recv = static_cast<std::byte*>(recv.raw_data());
    if (s.recv != s.send && overlaps(s.send, send.nbytes(), s.recv, recv.nbytes()))
      s.error = "recv partly overlaps send; pass the same tensor (in place) or a separate buffer";
    const std::int64_t slice = slice_of(s.call.count, size(), rank).len;
    // Note [Profiler ranges].
    backend::ScopedRange range(devices_[rank], "cuda-copy", "all_reduce", send.nbytes());
    Call c = begin(rank, std::move(s), "all_reduce", {send, recv}, slice);
    const std::int64_t count = c.me().call.count;
    const Dtype dt = c.me().call.dtype;
    // Phase 1: slice `rank` of every send, summed into this rank's scratch.
    const Slice mine = slice_of(count, size(), rank);
    ck::SumInputs in;
    in.count = size();
    for (int j = 0; j < size(); ++j) {
      wait(rank, j, &Rank::ready);
      in.ptr[j] = at(c.slots[static_cast<std::size_t>(j)].send, mine.off, dt);
    }
    sum(rank, in, c.me().scratch, mine.len, op, dt);
    record(rank, &Rank::e1);
    sync(rank, "all_reduce");
    // Phase 2: every reduced slice into recv (every send has been read: every e1).
    for (int k = 0; k < size(); ++k) {
      const int j = (rank + k) % size();  // start at different slices: spread the reads
      const Slice sl = slice_of(count, size(), j);
      wait(rank, j, &Rank::e1);
      copy_bytes(rank, j, at(c.me().recv, sl.off, dt), c.slots[static_cast<std::size_t>(j)].scratch,
                 static_cast<std::size_t>(sl.len) * element_size(dt));
    }
    record(rank, &Rank::e2);
    sync(rank, "all_reduce");
    for (int j = 0; j < size(); ++j) wait(rank, j, &Rank::e2);  // every rank copied this scratch
    finish(rank, c, deferred);
  }

  void reduce_impl(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op, bool deferred) {
    Slot s;
    s.call = {Kind::Reduce, send.dtype(), op, root, send.numel()};
    s.send = static_cast<const std::byte*>(send.raw_data());
    if (rank == root) {
      s.recv = static_cast<std::byte*>(recv.raw_data());
      // Each element is read by every input before it is written: recv may be send
      // (in place), but not a shifted view of it.
      if (s.recv != s.send && overlaps(s.send, send.nbytes(), s.recv, recv.nbytes()))
        s.error = "recv partly overlaps send; pass the same tensor (in place) or a separate buffer";
    }
    // Note [Profiler ranges].
    backend::ScopedRange range(devices_[rank], "cuda-copy", "reduce", send.nbytes());
    Call c = begin(rank, std::move(s), "reduce", {send, rank == root ? recv : Tensor()});
    if (rank == root) {
      ck::SumInputs in;
      in.count = size();
      for (int j = 0; j < size(); ++j) {
        wait(rank, j, &Rank::ready);
        in.ptr[j] = c.slots[static_cast<std::size_t>(j)].send;
      }
      sum(rank, in, c.me().recv, c.me().call.count, op, c.me().call.dtype);
    }
    record(rank, &Rank::e1);
    sync(rank, "reduce");
    if (rank != root) wait(rank, root, &Rank::e1);  // the root has read this send
    finish(rank, c, deferred);
  }

  Barrier barrier_;
  std::vector<Slot> slots_;   // slot r written by rank r before a rendezvous only
  std::vector<Rank> ranks_;   // rank r's entry used by rank r's thread only
};

}  // namespace

std::unique_ptr<Communicator> make_copy_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& options) {
  return std::make_unique<CopyCommunicator>(devices, options);
}

}  // namespace dp::comm
