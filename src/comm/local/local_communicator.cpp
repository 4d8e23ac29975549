// The shared-memory communicator for CPU virtual devices (see local_communicator.h).
#include "comm/local/local_communicator.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <new>
#include <thread>
#include <unordered_set>

#include "backend/backend.h"
#include "comm/argument_checks.h"
#include "dp/core/error.h"


namespace dp::comm {

// Note [Fixed summation order]
// Element i of a reduction is always ((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{N-1}[i],
// then (Average only) multiplied by 1.0f / N — whichever rank computes it and however
// the slice is split among threads. Each element is computed independently, so the
// partition of the buffer into per-rank slices and per-thread ranges never changes a
// bit of the result: all ranks get the same bits, run after run. DataParallel relies on
// it to keep DP (which sums on device 0 in the same order) and DDP bitwise identical.

// Note [Local collective protocol]
// Every collective starts with a rendezvous: each rank writes its Slot (buffer
// pointers, count, root, op), arrives at the barrier and snapshots every slot; all
// ranks then check that they called the same collective with the same count (so a
// mismatch is an error on every rank, never a hang or an out-of-bounds read). The data
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
// All-reduce, small (count <= kSmallCount): every rank reduces the whole buffer in the
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
/// All-reduce sizes (elements) that take the two-barrier path (Note [Local collective
/// protocol]): 16K floats (64 KiB) is where N full reductions stop costing less than a
/// barrier round on the 2-core host.
constexpr std::int64_t kSmallCount = 16384;
/// Slices start on cache lines (64 bytes = 16 floats).
constexpr std::int64_t kSliceAlign = 16;

const char* kind_name(LocalCommunicator::Kind k) { return Communicator::collective_name(k); }

/// The CPU backend, through the narrow interface: host loops run in a device's arena.
backend::Backend& cpu() { return backend::get(DeviceType::CPU); }

void add_block(float* __restrict dst, const float* __restrict src, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void scale_block(float* __restrict dst, float s, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] *= s;
}

/// dst[i] = (src[0][off+i] + ... + src[N-1][off+i]) (* 1/N for Average) for i < n, in
/// the fixed order of Note [Fixed summation order], on `dev`'s share of the cores (split
/// as the backend likes: every element is computed independently of the split). dst
/// never aliases an input.
void reduce_into(Device dev, const std::vector<const float*>& srcs, std::int64_t off,
                 float* dst, std::int64_t n, ReduceOp op) {
  if (n <= 0) return;
  const float inv = 1.0f / static_cast<float>(srcs.size());
  cpu().host_parallel_for(dev, n, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i0 = b; i0 < e; i0 += kReduceBlock) {
      const std::int64_t len = std::min(kReduceBlock, e - i0);
      std::memcpy(dst + i0, srcs[0] + off + i0, static_cast<std::size_t>(len) * sizeof(float));
      for (std::size_t k = 1; k < srcs.size(); ++k) add_block(dst + i0, srcs[k] + off + i0, len);
      if (op == ReduceOp::Average) scale_block(dst + i0, inv, len);
    }
  });
}

/// memcpy of n floats on `dev`'s share of the cores (a no-op when dst == src).
void copy_floats(Device dev, float* dst, const float* src, std::int64_t n) {
  if (n <= 0 || dst == src) return;
  cpu().host_parallel_for(dev, n, [&](std::int64_t b, std::int64_t e) {
    std::memcpy(dst + b, src + b, static_cast<std::size_t>(e - b) * sizeof(float));
  });
}

/// Slice [off, off + len) of a count split into N fixed slices (len may be 0).
struct SliceRange {
  std::int64_t off;
  std::int64_t len;
};
SliceRange slice_of(std::int64_t count, int n, int r) {
  std::int64_t chunk = (count + n - 1) / n;
  chunk = (chunk + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const std::int64_t off = std::min(count, chunk * r);
  return {off, std::min(chunk, count - off)};
}

std::vector<const float*> sends_of(const std::vector<LocalCommunicator::Slot>& slots) {
  std::vector<const float*> v;
  v.reserve(slots.size());
  for (const auto& s : slots) v.push_back(s.send);
  return v;
}

}  // namespace

// ---- barrier ---------------------------------------------------------------------

namespace detail {

std::string Barrier::reason() const {
  std::lock_guard<std::mutex> lock(reason_mu_);
  return reason_;
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

void LocalCommunicator::check_rank(int rank, const char* what) const {
  DP_CHECK(rank >= 0 && rank < size(), what, ": rank ", rank, " is out of range for a ",
           "communicator of ", size(), " ranks (expected 0..", size() - 1, ")");
}

float* LocalCommunicator::scratch(int rank, std::int64_t n) {
  Scratch& s = scratch_[static_cast<std::size_t>(rank)];
  if (s.capacity < n) {
    // Grows geometrically so buckets of changing sizes settle after a few calls. Only
    // this rank's thread touches its scratch between collectives: the previous one
    // ended with no other rank still reading it (Note [Local collective protocol]).
    const std::int64_t cap = std::max(n, s.capacity * 2);
    s.data.reset();  // free first: lowers the peak
    s.data = std::unique_ptr<float[]>(new float[static_cast<std::size_t>(cap)]);
    s.capacity = cap;
  }
  return s.data.get();
}

std::vector<LocalCommunicator::Slot> LocalCommunicator::rendezvous(int rank, Slot slot,
                                                                   const char* what) {
  slots_[static_cast<std::size_t>(rank)] = std::move(slot);
  sync(rank, what);
  std::vector<Slot> snap = slots_;

  // Every rank evaluates the same snapshot, so every rank reaches the same verdict.
  std::string problem;
  const Slot& mine = snap[static_cast<std::size_t>(rank)];
  if (mine.failed) {
    problem = mine.error;
  } else {
    for (int r = 0; r < size() && problem.empty(); ++r) {
      const Slot& s = snap[static_cast<std::size_t>(r)];
      if (s.failed) problem = dp::detail::str_cat("rank ", r, " (", devices_[r], ") failed: ", s.error);
    }
  }
  if (problem.empty()) {
    const Slot& ref = snap[0];
    for (int r = 1; r < size() && problem.empty(); ++r) {
      const Slot& s = snap[static_cast<std::size_t>(r)];
      const bool same_root = !(ref.kind == Kind::Broadcast || ref.kind == Kind::Reduce) ||
                             s.root == ref.root;
      const bool same_op = ref.kind == Kind::Broadcast || ref.kind == Kind::AllGather ||
                           s.op == ref.op;
      if (s.kind != ref.kind || s.count != ref.count || !same_root || !same_op) {
        problem = dp::detail::str_cat(
            "ranks disagree: rank 0 called ", kind_name(ref.kind), "(count ", ref.count,
            ", root ", ref.root, ", op ", op_name(ref.op), "), rank ", r, " called ",
            kind_name(s.kind), "(count ", s.count, ", root ", s.root, ", op ", op_name(s.op),
            "); every rank must make the same collective calls in the same order with the "
            "same sizes");
      }
    }
  }
  if (!problem.empty()) {
    // Nobody leaves before everyone has read the slots: a rank that threw and entered
    // its next collective would otherwise overwrite a slot still being read.
    sync(rank, what);
    DP_FAIL(what, " on rank ", rank, " (", devices_[rank], "): ", problem);
  }
  return snap;
}

void LocalCommunicator::all_reduce(int rank, const Tensor& send, const Tensor& recv,
                                   ReduceOp op) {
  check_rank(rank, "all_reduce");
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.kind = Kind::AllReduce;
  s.op = op;
  s.error = tensor_problem(send, "send", dev);
  if (s.error.empty()) s.error = tensor_problem(recv, "recv", dev);
  if (s.error.empty() && recv.numel() != send.numel())
    s.error = dp::detail::str_cat("recv has ", recv.numel(), " elements but send has ",
                              send.numel(), "; they must match");
  s.failed = !s.error.empty();
  std::int64_t count = 0;
  if (!s.failed) {
    count = send.numel();
    s.count = count;
    s.send = send.data<const float>();
    s.recv = recv.data<float>();
    const bool in_place = overlaps(s.send, count, s.recv, count);
    const bool small = count <= kSmallCount;
    if (in_place) s.scratch = scratch(rank, small ? count : slice_of(count, n, 0).len);
  }
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "all_reduce");
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  const std::vector<const float*> sends = sends_of(slots);

  if (count <= kSmallCount) {
    float* dst = me.scratch != nullptr ? me.scratch : me.recv;
    reduce_into(dev, sends, 0, dst, count, op);
    sync(rank, "all_reduce");  // every rank has finished reading every input
    if (dst != me.recv) copy_floats(dev, me.recv, dst, count);
    return;
  }
  // Reduce-scatter: slice `rank`, written where the other ranks will read it.
  auto result_of = [&](int r) -> float* {
    const Slot& sr = slots[static_cast<std::size_t>(r)];
    return sr.scratch != nullptr ? sr.scratch : sr.recv + slice_of(count, n, r).off;
  };
  const SliceRange mine = slice_of(count, n, rank);
  reduce_into(dev, sends, mine.off, result_of(rank), mine.len, op);
  sync(rank, "all_reduce");
  // All-gather of the reduced slices (one's own too, when it went to scratch).
  for (int k = 0; k < n; ++k) {
    const int r = (rank + k) % n;  // start at different slices: spread the reads
    const SliceRange sl = slice_of(count, n, r);
    copy_floats(dev, me.recv + sl.off, result_of(r), sl.len);
  }
  sync(rank, "all_reduce");  // no rank still reads this rank's recv or scratch
}

void LocalCommunicator::broadcast(int rank, const Tensor& data, int root) {
  check_rank(rank, "broadcast");
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  Slot s;
  s.kind = Kind::Broadcast;
  s.root = root;
  if (root < 0 || root >= size())
    s.error = dp::detail::str_cat("root ", root, " is out of range (expected 0..", size() - 1, ")");
  if (s.error.empty()) s.error = tensor_problem(data, "data", dev);
  s.failed = !s.error.empty();
  if (!s.failed) {
    s.count = data.numel();
    s.send = data.data<const float>();
    s.recv = data.data<float>();
  }
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "broadcast");
  if (rank != root)
    copy_floats(dev, slots[static_cast<std::size_t>(rank)].recv,
                slots[static_cast<std::size_t>(root)].send, slots[0].count);
  sync(rank, "broadcast");  // root's data is no longer read
}

void LocalCommunicator::reduce(int rank, const Tensor& send, const Tensor& recv, int root,
                               ReduceOp op) {
  check_rank(rank, "reduce");
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.kind = Kind::Reduce;
  s.op = op;
  s.root = root;
  if (root < 0 || root >= n)
    s.error = dp::detail::str_cat("root ", root, " is out of range (expected 0..", n - 1, ")");
  if (s.error.empty()) s.error = tensor_problem(send, "send", dev);
  if (s.error.empty() && rank == root) {
    s.error = tensor_problem(recv, "recv (on the root)", dev);
    if (s.error.empty() && recv.numel() != send.numel())
      s.error = dp::detail::str_cat("recv has ", recv.numel(), " elements but send has ",
                                send.numel(), "; they must match");
  }
  s.failed = !s.error.empty();
  std::int64_t count = 0;
  if (!s.failed) {
    count = send.numel();
    s.count = count;
    s.send = send.data<const float>();
    if (rank == root) s.recv = recv.data<float>();
    s.scratch = scratch(rank, slice_of(count, n, 0).len);
  }
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "reduce");
  const Slot& rs = slots[static_cast<std::size_t>(root)];
  // Each rank reduces its slice straight into root's recv, unless root works in place
  // (its recv is its send, still read by the others): then into scratch first.
  const bool via_scratch = overlaps(rs.send, count, rs.recv, count);
  const SliceRange mine = slice_of(count, n, rank);
  float* dst = via_scratch ? slots[static_cast<std::size_t>(rank)].scratch : rs.recv + mine.off;
  reduce_into(dev, sends_of(slots), mine.off, dst, mine.len, op);
  sync(rank, "reduce");
  if (!via_scratch) return;
  if (rank == root) {
    for (int r = 0; r < n; ++r) {
      const SliceRange sl = slice_of(count, n, r);
      copy_floats(dev, rs.recv + sl.off, slots[static_cast<std::size_t>(r)].scratch, sl.len);
    }
  }
  sync(rank, "reduce");  // root has read every scratch
}

void LocalCommunicator::reduce_scatter(int rank, const Tensor& send, const Tensor& recv,
                                       ReduceOp op) {
  check_rank(rank, "reduce_scatter");
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.kind = Kind::ReduceScatter;
  s.op = op;
  s.error = tensor_problem(send, "send", dev);
  if (s.error.empty()) s.error = tensor_problem(recv, "recv", dev);
  if (s.error.empty() && send.numel() != recv.numel() * n)
    s.error = dp::detail::str_cat("recv has ", recv.numel(), " elements and send ", send.numel(),
                              "; reduce_scatter needs send = ", n, " x recv (one recv-sized ",
                              "block per rank)");
  s.failed = !s.error.empty();
  std::int64_t recv_count = 0;
  if (!s.failed) {
    recv_count = recv.numel();
    s.count = send.numel();
    s.send = send.data<const float>();
    s.recv = recv.data<float>();
    if (overlaps(s.send, s.count, s.recv, recv_count)) s.scratch = scratch(rank, recv_count);
  }
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "reduce_scatter");
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  float* dst = me.scratch != nullptr ? me.scratch : me.recv;
  reduce_into(dev, sends_of(slots), recv_count * rank, dst, recv_count, op);
  sync(rank, "reduce_scatter");  // every input has been read
  if (dst != me.recv) copy_floats(dev, me.recv, dst, recv_count);
}

void LocalCommunicator::all_gather(int rank, const Tensor& send, const Tensor& recv) {
  check_rank(rank, "all_gather");
  Inside inside(*this, rank);  // Note [Leaving an aborted collective]
  const Device dev = devices_[rank];
  const int n = size();
  Slot s;
  s.kind = Kind::AllGather;
  s.error = tensor_problem(send, "send", dev);
  if (s.error.empty()) s.error = tensor_problem(recv, "recv", dev);
  if (s.error.empty() && recv.numel() != send.numel() * n)
    s.error = dp::detail::str_cat("recv has ", recv.numel(), " elements and send ", send.numel(),
                              "; all_gather needs recv = ", n, " x send");
  if (s.error.empty()) {
    const float* sp = send.data<const float>();
    const float* rp = recv.data<const float>();
    if (overlaps(sp, send.numel(), rp, recv.numel()) && sp != rp + send.numel() * rank)
      s.error = dp::detail::str_cat("send overlaps recv but is not recv's block ", rank,
                                "; in place, pass send = recv.narrow(0, ", rank, " * n, n)");
  }
  s.failed = !s.error.empty();
  if (!s.failed) {
    s.count = send.numel();
    s.send = send.data<const float>();
    s.recv = recv.data<float>();
  }
  const std::vector<Slot> slots = rendezvous(rank, std::move(s), "all_gather");
  const std::int64_t count = slots[0].count;
  float* out = slots[static_cast<std::size_t>(rank)].recv;
  for (int k = 0; k < n; ++k) {
    const int r = (rank + k) % n;
    copy_floats(dev, out + count * r, slots[static_cast<std::size_t>(r)].send, count);
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
