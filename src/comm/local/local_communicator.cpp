// The shared-memory communicator for CPU virtual devices (see local_communicator.h).
#include "comm/local/local_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <new>
#include <type_traits>
#include <thread>
#include <unordered_set>

#include "backend/backend.h"
#include "comm/argument_checks.h"
#include "comm/summation.h"
#include "dp/core/error.h"


namespace dp::comm {

// Note [Fixed summation order]
// Element i of a reduction is always ((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{N-1}[i],
// then (Average only) multiplied by 1.0f / N, in the dtype's accumulation type (float
// for floating dtypes; the result is rounded to the storage type once) — whichever rank computes it and however
// the slice is split among threads. Each element is computed independently, so the
// partition of the buffer into per-rank slices and per-thread ranges never changes a
// bit of the result: all ranks get the same bits, run after run. DataParallel relies on
// it to keep DP (which sums on device 0 in the same order) and DDP bitwise identical.

// Note [Local collective protocol]
// Every collective starts with a rendezvous: each rank writes its Slot (buffer
// pointers and its CallShape: collective, dtype, count, root, op — or the problem the
// front found in its arguments, Note [Checked collectives]), arrives at the barrier
// and snapshots every slot; all ranks then check that they called the same collective
// with the same dtype and count (so a mismatch is an error on every rank, never a hang
// or an out-of-bounds read). Buffers are bytes, elements element_size(dtype) of them,
// and reductions add through the dtype's Summand (Note [Collective dtypes]). The data
// phases follow, each ended by a barrier, and a collective returns only once no other
// rank can still read this rank's buffers (its inputs, recv or scratch). A rank never
// writes into a buffer another rank may still read: when recv overlaps send (in
// place), the reduced slice goes to the rank's scratch first.
//
// All-reduce, large: rank r reduces slice r (ceil(count / N) elements rounded up to a
// cache line, so neighbouring writers never share a line) into its recv (out of
// place) or scratch (in place); barrier; every rank copies the N reduced slices into
// its recv; barrier. Each rank reads count/N of every input and copies count (N-1)/N:
// the bandwidth-optimal reduce-scatter + all-gather.
// All-reduce, small (at most kSmallBytes): every rank reduces the whole buffer in the
// same fixed order (same bits, see above) into recv or scratch; barrier; copy scratch.
// Two barriers instead of three: at these sizes the barriers are the cost.

namespace {

/// Spins of the barrier before parking (Note [Parking]): a few microseconds, enough
/// for ranks that arrive together, short enough not to steal a core from a rank that
/// still works when virtual devices share the cores.
constexpr int kBarrierSpins = 256;
/// Elements per block of the fused reduction: 2048 floats (8 KiB) keep the block of
/// the output in L1 while the N inputs stream through it.
constexpr std::int64_t kReduceBlock = 2048;
/// All-reduce sizes (bytes) that take the two-barrier path (Note [Local collective
/// protocol]): 64 KiB (16K floats), about where N full reductions of the buffer stop
/// costing less than one more barrier round; bench/collectives_bench's all_reduce rows
/// on both sides of it are what to rerun when tuning it.
constexpr std::size_t kSmallBytes = 64 * 1024;
/// Slices start on cache lines (64 bytes = 16 floats).
constexpr std::int64_t kSliceAlignBytes = 64;

/// The CPU backend, through the narrow interface: host loops run in a device's arena.
backend::Backend& cpu() { return backend::get(DeviceType::CPU); }

/// dst[i] = (src[0][off+i] + ... + src[N-1][off+i]) (* 1/N for Average) for i < n, in
/// the fixed order of Note [Fixed summation order], accumulated as Summand<T> says, on
/// `dev`'s share of the cores (split as the backend likes: every element is computed
/// independently of the split). dst never aliases an input.
template <typename T>
void reduce_typed(Device dev, const std::vector<const std::byte*>& srcs, std::int64_t off, T* dst,
                  std::int64_t n, ReduceOp op) {
  using Acc = typename Summand<T>::Acc;
  const Acc inv = Acc(1) / static_cast<Acc>(srcs.size());
  auto src = [&](std::size_t k, std::int64_t i) { return reinterpret_cast<const T*>(srcs[k]) + off + i; };
  cpu().host_parallel_for(dev, n, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i0 = b; i0 < e; i0 += kReduceBlock) {
      const std::int64_t len = std::min(kReduceBlock, e - i0);
      auto block = [&](Acc* acc) {
        sum_first<T>(acc, src(0, i0), len);
        for (std::size_t k = 1; k < srcs.size(); ++k) sum_add<T>(acc, src(k, i0), len);
        if (op == ReduceOp::Average) sum_scale<T>(acc, inv, len);
        sum_store<T>(dst + i0, acc, len);
      };
      if constexpr (std::is_same_v<Acc, T>) {
        block(dst + i0);  // accumulates in place: float32's exact operations
      } else {
        Acc acc[kReduceBlock];
        block(acc);
      }
    }
  });
}

/// reduce_typed for `dtype` (summable: the front admits nothing else).
void reduce_into(Device dev, Dtype dtype, const std::vector<const std::byte*>& srcs, std::int64_t off,
                 std::byte* dst, std::int64_t n, ReduceOp op) {
  if (n <= 0) return;
  const bool summed = with_summand(dtype, [&]<typename T>() {
    reduce_typed<T>(dev, srcs, off, reinterpret_cast<T*>(dst), n, op);
  });
  DP_ASSERT(summed, "local communicator: no summation for ", dtype_name(dtype));
}

/// memcpy of n elements of `size` bytes on `dev`'s share of the cores (a no-op when
/// dst == src).
void copy_elements(Device dev, std::byte* dst, const std::byte* src, std::int64_t n, std::size_t size) {
  if (n <= 0 || dst == src) return;
  cpu().host_parallel_for(dev, n, [&](std::int64_t b, std::int64_t e) {
    std::memcpy(dst + static_cast<std::size_t>(b) * size, src + static_cast<std::size_t>(b) * size,
                static_cast<std::size_t>(e - b) * size);
  });
}

/// Slice [off, off + len) of a count split into N fixed slices (len may be 0), in
/// elements of `size` bytes; slices start on cache lines.
struct SliceRange {
  std::int64_t off;
  std::int64_t len;
};
SliceRange slice_of(std::int64_t count, int n, int r, std::size_t size) {
  const std::int64_t align = std::max<std::int64_t>(1, kSliceAlignBytes / static_cast<std::int64_t>(size));
  std::int64_t chunk = (count + n - 1) / n;
  chunk = (chunk + align - 1) / align * align;
  const std::int64_t off = std::min(count, chunk * r);
  return {off, std::min(chunk, count - off)};
}

std::vector<const std::byte*> sends_of(const std::vector<LocalCommunicator::Slot>& slots) {
  std::vector<const std::byte*> v;
  v.reserve(slots.size());
  for (const auto& s : slots) v.push_back(s.send);
  return v;
}

/// The bytes of n elements of the call's dtype.
std::size_t bytes_of(const CallShape& c, std::int64_t n) {
  return static_cast<std::size_t>(n) * element_size(c.dtype);
}

}  // namespace

// ---- barrier ---------------------------------------------------------------------

namespace detail {

std::string Barrier::reason() const {
  std::lock_guard<std::mutex> lock(reason_mu_);
  return reason_;
}

std::byte* ScratchBuffer::reserve(std::size_t bytes) {
  if (capacity_ < bytes) {
    const std::size_t cap = std::max(bytes, capacity_ * 2);
    data_.reset();  // free first: lowers the peak
    data_ = std::unique_ptr<std::byte[]>(new std::byte[cap]);
    capacity_ = cap;
  }
  return data_.get();
}

bool Barrier::arrive_and_wait() {
  // Read the generation before arriving: the last arriver bumps it only after our
  // fetch_add, so we can never miss the bump of our own round. Look for an abort only
  // after that read: an abort that came before it is seen here (its flag is stored
  // before its bump), one that comes after it bumps the generation away from `gen` and
  // ends the wait. Looked for before the read, an abort landing between the two went
  // unseen and its bump was already in `gen`: the rank parked for good (a sharded
  // test's injected failure hung that way under ASan).
  const std::uint32_t gen = generation_.load(std::memory_order_acquire);
  if (aborted()) return false;
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == parties_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);  // published by the bump
    generation_.bump(INT_MAX);
    return !aborted();
  }
  generation_.await_change(gen, kBarrierSpins);
  return !aborted();
}

void Barrier::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(reason_mu_);
    if (!aborted_.load(std::memory_order_relaxed)) reason_ = reason;
  }
  aborted_.store(true, std::memory_order_release);
  generation_.bump(INT_MAX);
}

void Barrier::reset() {
  std::lock_guard<std::mutex> lock(reason_mu_);
  arrived_.store(0, std::memory_order_relaxed);
  reason_.clear();
  aborted_.store(false, std::memory_order_release);
}

}  // namespace detail

// ---- communicator ----------------------------------------------------------------

LocalCommunicator::LocalCommunicator(std::vector<Device> devices)
    : Communicator(std::move(devices)),
      barrier_(static_cast<int>(devices_.size())),
      slots_(devices_.size()),
      scratch_(devices_.size()),
      in_(devices_.size(), 0) {
  DP_CHECK(!devices_.empty(), "local communicator: expected at least one device, got none");
  std::unordered_set<Device> seen;
  const int available = dp::device_count(DeviceType::CPU);
  for (const Device& d : devices_) {
    DP_CHECK(d.is_cpu(), "local communicator: expected CPU virtual devices, got ", d,
             "; use make_communicator for CUDA devices (NCCL)");
    DP_CHECK(d.index >= 0 && d.index < available, "local communicator: ", d,
             " is out of range (", available, " CPU virtual devices; set DP_CPU_DEVICES)");
    DP_CHECK(seen.insert(d).second, "local communicator: device ", d,
             " appears twice; each rank needs its own device");
  }
}

LocalCommunicator::~LocalCommunicator() = default;

std::vector<LocalCommunicator::Slot> LocalCommunicator::rendezvous(int rank, Slot slot,
                                                                   const char* what) {
  slots_[static_cast<std::size_t>(rank)] = std::move(slot);
  sync(rank, what);
  std::vector<Slot> snap = slots_;
  // Every rank evaluates the same snapshot, so every rank reaches the same verdict.
  const std::string problem = rendezvous_problem(rank, snap, [&](int r) {
    return dp::detail::str_cat("rank ", r, " (", devices_[static_cast<std::size_t>(r)], ")");
  });
  if (!problem.empty()) {
    // Nobody leaves before everyone has read the slots: a rank that threw and entered
    // its next collective would otherwise overwrite a slot still being read.
    sync(rank, what);
    DP_FAIL(call_site(what, rank), ": ", problem);
  }
  return snap;
}

void LocalCommunicator::refuse(int rank, Collective kind, const std::string& problem) {
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  Slot s;
  s.call.kind = kind;
  s.error = problem;
  (void)rendezvous(rank, std::move(s), collective_name(kind));  // throws on every rank
}

void LocalCommunicator::do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.call = {Kind::AllReduce, send.dtype(), op, 0, send.numel()};
  const std::int64_t count = s.call.count;
  const std::size_t bytes = bytes_of(s.call, count);
  const std::size_t es = element_size(s.call.dtype);
  s.send = static_cast<const std::byte*>(send.raw_data());
  s.recv = static_cast<std::byte*>(recv.raw_data());
  const bool small = bytes <= kSmallBytes;
  if (overlaps(s.send, bytes, s.recv, bytes))  // in place
    s.scratch = scratch(rank, small ? bytes : bytes_of(s.call, slice_of(count, n, 0, es).len));
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "all_reduce");
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  const std::vector<const std::byte*> sends = sends_of(slots);

  if (small) {
    std::byte* dst = me.scratch != nullptr ? me.scratch : me.recv;
    reduce_into(dev, me.call.dtype, sends, 0, dst, count, op);
    sync(rank, "all_reduce");  // every rank has finished reading every input
    if (dst != me.recv) copy_elements(dev, me.recv, dst, count, es);
    return;
  }
  // Reduce-scatter: slice `rank`, written where the other ranks will read it.
  auto result_of = [&](int r) -> std::byte* {
    const Slot& sr = slots[static_cast<std::size_t>(r)];
    return sr.scratch != nullptr ? sr.scratch : sr.recv + slice_of(count, n, r, es).off * es;
  };
  const SliceRange mine = slice_of(count, n, rank, es);
  reduce_into(dev, me.call.dtype, sends, mine.off, result_of(rank), mine.len, op);
  sync(rank, "all_reduce");
  // All-gather of the reduced slices (one's own too, when it went to scratch).
  for (int k = 0; k < n; ++k) {
    const int r = (rank + k) % n;  // start at different slices: spread the reads
    const SliceRange sl = slice_of(count, n, r, es);
    copy_elements(dev, me.recv + sl.off * es, result_of(r), sl.len, es);
  }
  sync(rank, "all_reduce");  // no rank still reads this rank's recv or scratch
}

void LocalCommunicator::do_broadcast(int rank, const Tensor& data, int root) {
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  Slot s;
  s.call = {Kind::Broadcast, data.dtype(), ReduceOp::Sum, root, data.numel()};
  s.send = static_cast<const std::byte*>(data.raw_data());
  s.recv = static_cast<std::byte*>(data.raw_data());
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "broadcast");
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  if (rank != root)
    copy_elements(dev, me.recv, slots[static_cast<std::size_t>(root)].send, me.call.count,
                  element_size(me.call.dtype));
  sync(rank, "broadcast");  // root's data is no longer read
}

void LocalCommunicator::do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.call = {Kind::Reduce, send.dtype(), op, root, send.numel()};
  const std::int64_t count = s.call.count;
  const std::size_t es = element_size(s.call.dtype);
  s.send = static_cast<const std::byte*>(send.raw_data());
  if (rank == root) s.recv = static_cast<std::byte*>(recv.raw_data());
  s.scratch = scratch(rank, bytes_of(s.call, slice_of(count, n, 0, es).len));
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "reduce");
  const Slot& rs = slots[static_cast<std::size_t>(root)];
  const std::size_t bytes = bytes_of(rs.call, count);
  // Each rank reduces its slice straight into root's recv, unless root works in place
  // (its recv is its send, still read by the others): then into scratch first.
  const bool via_scratch = overlaps(rs.send, bytes, rs.recv, bytes);
  const SliceRange mine = slice_of(count, n, rank, es);
  std::byte* dst = via_scratch ? slots[static_cast<std::size_t>(rank)].scratch : rs.recv + mine.off * es;
  reduce_into(dev, rs.call.dtype, sends_of(slots), mine.off, dst, mine.len, op);
  sync(rank, "reduce");
  if (!via_scratch) return;
  if (rank == root) {
    for (int r = 0; r < n; ++r) {
      const SliceRange sl = slice_of(count, n, r, es);
      copy_elements(dev, rs.recv + sl.off * es, slots[static_cast<std::size_t>(r)].scratch, sl.len, es);
    }
  }
  sync(rank, "reduce");  // root has read every scratch
}

void LocalCommunicator::do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  Slot s;
  s.call = {Kind::ReduceScatter, send.dtype(), op, 0, send.numel()};
  const std::int64_t recv_count = recv.numel();
  const std::size_t es = element_size(s.call.dtype);
  s.send = static_cast<const std::byte*>(send.raw_data());
  s.recv = static_cast<std::byte*>(recv.raw_data());
  if (overlaps(s.send, send.nbytes(), s.recv, recv.nbytes())) s.scratch = scratch(rank, recv.nbytes());
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "reduce_scatter");
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  std::byte* dst = me.scratch != nullptr ? me.scratch : me.recv;
  reduce_into(dev, me.call.dtype, sends_of(slots), recv_count * rank, dst, recv_count, op);
  sync(rank, "reduce_scatter");  // every input has been read
  if (dst != me.recv) copy_elements(dev, me.recv, dst, recv_count, es);
}

void LocalCommunicator::do_all_gather(int rank, const Tensor& send, const Tensor& recv) {
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.call = {Kind::AllGather, send.dtype(), ReduceOp::Sum, 0, send.numel()};
  s.send = static_cast<const std::byte*>(send.raw_data());
  s.recv = static_cast<std::byte*>(recv.raw_data());
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "all_gather");
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  const std::int64_t count = me.call.count;
  const std::size_t es = element_size(me.call.dtype);
  for (int k = 0; k < n; ++k) {
    const int r = (rank + k) % n;
    copy_elements(dev, me.recv + static_cast<std::size_t>(count * r) * es, slots[static_cast<std::size_t>(r)].send,
                  count, es);
  }
  sync(rank, "all_gather");  // no rank still reads this rank's send
}

// Note [Leaving an aborted collective]
// An abort releases every rank waiting at the barrier, but another rank may be past
// its last barrier and still in a data phase, reading this rank's send or writing its
// recv. A released rank that returned at once would let its caller free those buffers
// under that reader (the stress test's injected failures did, under ThreadSanitizer).
// So every rank counts itself in `inside_` for the whole collective call, and an
// aborted rank counts itself out and waits until the count is zero: every rank still
// inside is in a bounded data phase or at a barrier, which the abort releases, so the
// wait ends — no rank that never came (a failed worker) is waited for.
LocalCommunicator::Inside::Inside(LocalCommunicator& c, int rank) : c_(c), rank_(rank) {
  c_.inside_.fetch_add(1, std::memory_order_acq_rel);
  c_.in_[static_cast<std::size_t>(rank)] = 1;
}

void LocalCommunicator::Inside::leave() noexcept { c_.count_out(rank_); }

void LocalCommunicator::count_out(int rank) noexcept {
  char& in = in_[static_cast<std::size_t>(rank)];
  if (in == 0) return;
  in = 0;
  inside_.fetch_sub(1, std::memory_order_acq_rel);  // releases this rank's reads and writes
}

void LocalCommunicator::sync(int rank, const char* what) {
  if (barrier_.arrive_and_wait()) return;
  count_out(rank);
  while (inside_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  throw_aborted(what, rank, barrier_.reason());
}

void LocalCommunicator::synchronize(int rank) {
  check_rank(rank, "synchronize");
  // Nothing is ever pending, but an aborted communicator says so here too, as NCCL's does.
  if (barrier_.aborted()) throw_aborted("synchronize", rank, barrier_.reason());
}

void LocalCommunicator::abort(const std::string& reason) { barrier_.abort(reason); }

void LocalCommunicator::reset() { barrier_.reset(); }

std::unique_ptr<Communicator> make_local_communicator(const std::vector<Device>& devices) {
  return std::make_unique<LocalCommunicator>(devices);
}

}  // namespace dp::comm
