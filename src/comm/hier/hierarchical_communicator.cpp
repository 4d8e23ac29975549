// The hierarchical communicator (see hierarchical_communicator.h and
// src/comm/world_factory.h).
#include "comm/hier/hierarchical_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "backend/backend.h"
#include "comm/argument_checks.h"
#include "comm/summation.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/world_factory.h"
#include "dist/process_group.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"

namespace dp::comm {

// Note [Hierarchical collectives]
// P processes, L CPU virtual devices each, W = P * L world ranks; world rank p * L + j
// is local rank j of process p. Two levels: `local` (shared memory among the L devices
// of a process, Note [Local collective protocol]) and, per local index j, the
// process-level group of peers(j) (local rank j of every process, Note [Process
// collective protocol]). Local rank j's thread alone drives peers(j), so the L groups
// cross processes concurrently: that needs MPI_THREAD_MULTIPLE when L > 1 (Note
// [Thread level]); the constructor refuses less, on every process. n = elements.
//
// What moves where (per process; "net" = between processes):
//  - all_reduce (Horovod's): local reduce-scatter of the body (q = floor(n / L)
//    elements per rank, rank j's block reduced straight into block j of its recv),
//    process-level all-reduce of each block on peers(j), all in parallel, then a local
//    all-gather in place. Uneven sizes: per-rank counts, no padding — the t = n mod L
//    (< L) trailing elements ride with the last block: local rank L-1 sums them from
//    every local rank's send (their pointers are in the agree slots) and all-reduces
//    q + t elements on its peers; after the process-level step every rank copies them
//    from rank L-1's recv. Net: 2 (P-1)/P * n/L per device, 2 (P-1)/P * n per process —
//    each element crosses once, on one of L parallel links. No scratch, no copy of the
//    whole buffer.
//  - broadcast from world root w (process w / L, index w % L): peers(w % L) broadcasts
//    over processes, then a local broadcast from index w % L. Net: n from the root.
//  - reduce to world root w: local reduce onto index w % L (into the root's recv, or
//    that rank's scratch on the other processes), then a process-level reduce on
//    peers(w % L) to process w / L. Net: (P-1)/P * n per process (the group's
//    reduce-scatter + gather).
//  - reduce_scatter (m = recv elements): send's W blocks are reordered so that local
//    rank j's chunk holds the blocks of world ranks q * L + j, q = 0..P-1 (a copy of
//    send into scratch); local reduce-scatter of chunks (P m each); process-level
//    reduce-scatter of the chunk on peers(j): process p keeps block p, the one of world
//    rank p * L + j. Net: (P-1) m per device.
//  - all_gather (m = send elements): process-level all-gather on peers(j) (P blocks:
//    world ranks q * L + j), written as chunk j of a scratch; local all-gather of the
//    chunks in place; then the P L blocks are copied into recv in world order. Net:
//    (P-1) m per device — never the whole recv per device.
// With L = 1 the local levels are identities and are skipped: the collective is the
// process-level one straight on the caller's buffers.
//
// Order of sums: element i of every reduction is
//   S_i = (...((s_0 + s_1) + s_2) + ... + s_{P-1}),  s_p = (...(x_{p,0} + x_{p,1}) + ...) + x_{p,L-1}
// — over the local devices in local-rank order (the local communicator's order, Note
// [Fixed summation order]; the tail of all_reduce is summed by hand in that same
// order), then over processes in process order (Note [Deterministic process
// collectives]). Both levels add with ReduceOp::Sum; Average is then S_i * (1.0f / W),
// the same expression as the local and mpi communicators' Average, applied once by
// whoever holds the finished sum. So all_reduce, a reduce of each piece onto its owner
// and reduce_scatter give the same bits for the same topology (P, L), run after run; a
// different topology is a different sum.
//
// Checks (every process fails alike): each rank's arguments are checked by the front
// (Note [Checked collectives]), which hands a bad call to refuse(); every collective,
// refused or not, starts with `agree`, a rendezvous of the L local ranks on the
// communicator's own barrier in which each publishes its call (collective, dtype,
// count, root, op) or its arguments' problem; all evaluate the same slots. Every
// collective then makes exactly one call on every peers(j) — a zero-sized one on the
// indices a broadcast or reduce does not route through — so every process-level group
// sees every call and its rendezvous compares kind, sizes, root and op across
// processes. When `agree` fails, each local rank makes that call carry the problem, so
// the other processes throw naming it instead of waiting. A mismatch across processes
// may show on some groups only (two sizes that split into the same first blocks): after
// the process-level step the local ranks meet again (`between_processes`) and all throw
// when any of them did. No data moves past a failed check; recv is unspecified. The
// price: two barriers of this communicator's own per collective (besides the local
// collectives'), and, on the indices a broadcast or reduce does not route through, a
// header exchange and empty messages, concurrent with the carrying index's transfer.
//
// Failures: abort() aborts the local communicator and the barrier (releasing local
// threads), then ends the job with dp::dist::abort (Note [Fault policy]): a rank
// blocked in another process's collective cannot be released. A process that dies or
// hangs makes the others time out in their process-level step (dp::dist::timeout()),
// which ends the job with a message naming it. The timeout there is the stricter of
// dp::dist::timeout() and this communicator's CommOptions::timeout (Note [Communicator
// timeouts]); the local levels need none, abort() releases them.
//
// Timing (Note [Inter-process time]): each peers(j) group records the wall time of its
// calls, so process_times(j) is local rank j's time between processes — DDP's bucket
// all-reduce, Sharded's reduce-scatter and all-gather, the buffer broadcast, and DP's
// all-reduce of device 0's sum (which the reducer makes on peers(0) itself).

namespace {

using dist::detail::ProcessGroup;
using dist::detail::Reduction;

backend::Backend& cpu() { return backend::get(DeviceType::CPU); }

/// memcpy of n elements of `size` bytes on `dev`'s share of the cores.
void copy_elements(Device dev, std::byte* dst, const std::byte* src, std::int64_t n, std::size_t size) {
  if (n <= 0 || dst == src) return;
  cpu().host_parallel_for(dev, n, [&](std::int64_t b, std::int64_t e) {
    std::memcpy(dst + static_cast<std::size_t>(b) * size, src + static_cast<std::size_t>(b) * size,
                static_cast<std::size_t>(e - b) * size);
  });
}

/// p[i] *= s in T's accumulation type: Average's last step (Note [Hierarchical collectives]).
template <typename T>
void scale(Device dev, T* p, std::int64_t n, typename Summand<T>::Acc s) {
  if (n <= 0) return;
  cpu().host_parallel_for(dev, n, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t i = b; i < e; ++i) p[i] = Summand<T>::store(Summand<T>::load(p[i]) * s);
  });
}

/// 1 / W in T's accumulation type: the factor of an Average over W world ranks.
template <typename T>
typename Summand<T>::Acc inverse(int w) {
  using Acc = typename Summand<T>::Acc;
  return Acc(1) / static_cast<Acc>(w);
}

/// n elements of `dtype` at p as a tensor of `dev` (not owning them), for the local
/// communicator.
Tensor view_of(const std::byte* p, std::int64_t n, Dtype dtype, Device dev) {
  if (n == 0) return empty({0}, {.dtype = dtype, .device = dev});
  return from_blob(const_cast<std::byte*>(p), {n}, dtype, dev);
}

template <typename T>
T* typed(std::byte* p) {
  return reinterpret_cast<T*>(p);
}
template <typename T>
const T* typed(const std::byte* p) {
  return reinterpret_cast<const T*>(p);
}

/// Every process's verdict on a step of the constructor that may fail on some only:
/// dp::Error on every process when any failed (its own message where it failed).
void agree_across_processes(const std::string& mine, const char* what) {
  const std::int64_t failed = dist::all_reduce(std::int64_t{mine.empty() ? 0 : 1}, dist::Op::Max);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(failed == 0, what, ": another process failed (its own error says why); this process, rank ",
           dist::rank(), ", was fine");
}

}  // namespace

HierarchicalCommunicator::HierarchicalCommunicator(const std::vector<Device>& devices,
                                                   std::chrono::milliseconds timeout)
    : Communicator(devices, dist::world_size() * static_cast<int>(devices.size()),
                   dist::rank() * static_cast<int>(devices.size())),
      processes_(dist::world_size()),
      process_rank_(dist::rank()),
      barrier_(static_cast<int>(devices.size())),
      slots_(devices.size()),
      outcomes_(devices.size()),
      scratch_(devices.size()) {
  const int l = size();
  set_rank_range({0, l, first_rank(), "; the rank argument is the local rank, the same range on each process, "
                  "not the world rank", false});
  std::string problem;
  try {
    local_ = make_local_communicator(devices);
  } catch (const Error& e) {
    problem = e.what();
  }
  const dist::detail::WorldInfo& info = dist::detail::world_info();
  if (problem.empty() && l > 1 && !info.thread_multiple)
    problem = dp::detail::str_cat(
        "make_world_communicator: MPI provides ", info.thread_level, " but ", l,
        " local devices per process cross processes concurrently, one thread each, which "
        "needs MPI_THREAD_MULTIPLE (Note [Thread level]); let dp initialise MPI (it asks "
        "for MPI_THREAD_MULTIPLE), or call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) "
        "with an MPI built with thread support, or use one device per process");
  agree_across_processes(problem, "make_world_communicator");
  // Every process creates its L groups in the same order (each is collective).
  for (int j = 0; j < l; ++j) {
    peers_.push_back(std::make_unique<MpiCommunicator>(devices_[static_cast<std::size_t>(j)]));
    peers_.back()->group().set_timeout(
        timeout, "the world communicator's CommOptions::timeout (a DataParallel's collective_timeout)");
  }
}

Communicator::ProcessTimes HierarchicalCommunicator::process_times(int rank) const {
  check_rank(rank, "process_times (hierarchical)");
  return process_times_of(peers_[static_cast<std::size_t>(rank)]->group());
}

void HierarchicalCommunicator::reset_process_times() {
  for (auto& p : peers_) p->group().reset_timings();
}

HierarchicalCommunicator::~HierarchicalCommunicator() = default;

bool HierarchicalCommunicator::supports(Collective kind, Dtype dtype) const {
  return process_level_supports(kind, dtype);
}

Communicator* HierarchicalCommunicator::peers(int rank) {
  check_rank(rank, "peers");
  return peers_[static_cast<std::size_t>(rank)].get();
}

ProcessGroup& HierarchicalCommunicator::group(int rank) {
  return peers_[static_cast<std::size_t>(rank)]->group();
}

void HierarchicalCommunicator::sync(int rank, const char* what) {
  if (!barrier_.arrive_and_wait()) throw_aborted(what, rank, barrier_.reason());
}

std::vector<HierarchicalCommunicator::Slot> HierarchicalCommunicator::agree(int rank, Slot slot,
                                                                            const char* what) {
  const Kind kind = slot.call.kind;
  slots_[static_cast<std::size_t>(rank)] = std::move(slot);
  sync(rank, what);
  std::vector<Slot> snap = slots_;
  // Every local rank evaluates the same snapshot, so every one reaches the same verdict.
  const std::string problem = rendezvous_problem(
      rank, snap, [&](int r) {
        return dp::detail::str_cat("local rank ", r, " (", devices_[static_cast<std::size_t>(r)], ", world rank ",
                                   first_rank() + r, ")");
      });
  if (problem.empty()) return snap;
  // Nobody leaves before everyone has read the slots: a rank that threw and entered
  // its next collective would otherwise overwrite a slot still being read.
  sync(rank, what);
  // The same kind of call the other processes' rank `rank` makes, carrying the
  // problem: every process throws naming it.
  refuse_on_group(group(rank), kind, what, problem);
}

void HierarchicalCommunicator::refuse(int rank, Collective kind, const std::string& problem) {
  Slot s;
  s.call.kind = kind;
  s.error = problem;
  (void)agree(rank, std::move(s), dp::detail::str_cat(collective_name(kind), " (hierarchical)").c_str());
}

template <typename Step>
void HierarchicalCommunicator::between_processes(int rank, const char* what, Step&& step) {
  std::exception_ptr failure;
  std::string message;
  try {
    step();
  } catch (const std::exception& e) {
    failure = std::current_exception();
    message = e.what();
  } catch (...) {
    failure = std::current_exception();
    message = "an exception of a type not derived from std::exception";
  }
  outcomes_[static_cast<std::size_t>(rank)] = message;
  sync(rank, what);
  // outcomes_ is written again only after the next collective's agree barrier, which
  // every rank reaches after reading it here.
  if (failure) std::rethrow_exception(failure);
  for (int r = 0; r < size(); ++r) {
    const std::string& m = outcomes_[static_cast<std::size_t>(r)];
    DP_CHECK(m.empty(), what, " on local rank ", rank, " (", devices_[static_cast<std::size_t>(rank)],
             "): local rank ", r, " (", devices_[static_cast<std::size_t>(r)],
             ") failed between processes: ", m);
  }
}

// ---- collectives (Note [Hierarchical collectives]) ------------------------------------
// Each do_* publishes its call in agree, then runs the data path of its dtype's storage
// type (Note [Collective dtypes]); the front admitted only dtypes that cross processes.

void HierarchicalCommunicator::do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  const char* what = "all_reduce (hierarchical)";
  Slot s;
  s.call = {Kind::AllReduce, send.dtype(), op, 0, send.numel()};
  s.send = static_cast<const std::byte*>(send.raw_data());
  s.recv = static_cast<std::byte*>(recv.raw_data());
  const std::vector<Slot> slots = agree(rank, std::move(s), what);
  with_process_summand(send.dtype(), [&]<typename T>() { all_reduce_as<T>(rank, slots, op, what); });
}

template <typename T>
void HierarchicalCommunicator::all_reduce_as(int rank, const std::vector<Slot>& slots, ReduceOp op,
                                             const char* what) {
  using Acc = typename Summand<T>::Acc;
  const Device dev = devices_[static_cast<std::size_t>(rank)];
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  const Dtype dtype = me.call.dtype;
  const int l = size();
  const std::int64_t n = me.call.count;
  const std::int64_t q = n / l;      // body block per local rank
  const std::int64_t t = n - q * l;  // tail (< l), carried by the last rank
  const bool last = rank == l - 1;
  T* recv = typed<T>(me.recv);
  T* mine = recv + q * rank;  // this rank's reduced block (and the tail, when last)
  const std::int64_t len = q + (last ? t : 0);

  if (l > 1) {
    if (last && t > 0) {
      // The tail in the local communicator's order. Each element is read before it is
      // written (in place, recv's tail is send's); no other rank reads this tail now,
      // and none writes its own before the process-level step below is over.
      for (std::int64_t i = q * l; i < n; ++i) {
        Acc acc = Summand<T>::load(typed<T>(slots[0].send)[i]);
        for (int r = 1; r < l; ++r) acc += Summand<T>::load(typed<T>(slots[static_cast<std::size_t>(r)].send)[i]);
        recv[i] = Summand<T>::store(acc);
      }
    }
    if (q > 0)
      local_->reduce_scatter(rank, view_of(me.send, q * l, dtype, dev),
                             view_of(reinterpret_cast<std::byte*>(mine), q, dtype, dev), ReduceOp::Sum);
  }
  between_processes(rank, what, [&] {
    group(rank).all_reduce<T>(l == 1 ? typed<T>(me.send) : mine, mine, len, Reduction::Sum, what);
    if (op == ReduceOp::Average) scale<T>(dev, mine, len, inverse<T>(world_size()));
  });
  if (l == 1) return;
  if (!last) {
    const T* tail = typed<T>(slots[static_cast<std::size_t>(l - 1)].recv) + q * l;
    std::copy(tail, tail + t, recv + q * l);
  }
  if (q > 0) {
    // In place: send is recv's block `rank`. Its rendezvous also orders every rank's
    // tail copy above before rank l-1 may return and reuse its recv.
    local_->all_gather(rank, view_of(reinterpret_cast<std::byte*>(mine), q, dtype, dev),
                       view_of(me.recv, q * l, dtype, dev));
  } else {
    sync(rank, what);  // rank l-1's tail has been copied by every rank
  }
}

void HierarchicalCommunicator::do_broadcast(int rank, const Tensor& data, int root) {
  const char* what = "broadcast (hierarchical)";
  Slot s;
  s.call = {Kind::Broadcast, data.dtype(), ReduceOp::Sum, root, data.numel()};
  s.recv = static_cast<std::byte*>(data.raw_data());
  s.send = s.recv;
  const std::vector<Slot> slots = agree(rank, std::move(s), what);
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  const int l = size();
  const int index = root % l;      // the root's local index
  const int process = root / l;    // the root's process
  const bool carrier = rank == index;
  const auto elem = static_cast<std::int64_t>(element_size(me.call.dtype));
  between_processes(rank, what, [&] {
    // Zero bytes on the other indices: their groups still see (and check) the call.
    group(rank).broadcast(carrier ? me.recv : nullptr, carrier ? me.call.count * elem : 0, process, what, elem);
  });
  if (l > 1) local_->broadcast(rank, data, index);
}

void HierarchicalCommunicator::do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) {
  const char* what = "reduce (hierarchical)";
  Slot s;
  s.call = {Kind::Reduce, send.dtype(), op, root, send.numel()};
  s.send = static_cast<const std::byte*>(send.raw_data());
  if (root == first_rank() + rank) s.recv = static_cast<std::byte*>(recv.raw_data());
  const std::vector<Slot> slots = agree(rank, std::move(s), what);
  with_process_summand(send.dtype(), [&]<typename T>() { reduce_as<T>(rank, slots, send, op, what); });
}

template <typename T>
void HierarchicalCommunicator::reduce_as(int rank, const std::vector<Slot>& slots, const Tensor& send, ReduceOp op,
                                         const char* what) {
  const Device dev = devices_[static_cast<std::size_t>(rank)];
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  const int root = me.call.root;
  const bool world_root = root == first_rank() + rank;
  const int l = size();
  const int index = root % l;
  const int process = root / l;
  const bool carrier = rank == index;
  const std::int64_t n = me.call.count;
  // The carrier's partial sum over the local devices: the root's recv, or scratch on the
  // other processes (send is never written). With one device it is send itself.
  const T* partial = typed<T>(me.send);
  if (l > 1) {
    std::byte* into = nullptr;
    if (carrier) into = world_root ? me.recv : scratch(rank, static_cast<std::size_t>(n) * sizeof(T));
    local_->reduce(rank, send, carrier ? view_of(into, n, me.call.dtype, dev) : Tensor(), index, ReduceOp::Sum);
    partial = typed<T>(static_cast<const std::byte*>(into));
  }
  between_processes(rank, what, [&] {
    ProcessGroup& g = group(rank);
    if (!carrier) {
      g.reduce<T>(nullptr, nullptr, 0, process, Reduction::Sum, what);
      return;
    }
    T* out = world_root ? typed<T>(me.recv) : nullptr;
    g.reduce<T>(partial, out, n, process, Reduction::Sum, what);
    if (world_root && op == ReduceOp::Average) scale<T>(dev, out, n, inverse<T>(world_size()));
  });
}

void HierarchicalCommunicator::do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) {
  const char* what = "reduce_scatter (hierarchical)";
  Slot s;
  s.call = {Kind::ReduceScatter, send.dtype(), op, 0, recv.numel()};
  s.send = static_cast<const std::byte*>(send.raw_data());
  s.recv = static_cast<std::byte*>(recv.raw_data());
  const std::vector<Slot> slots = agree(rank, std::move(s), what);
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  with_process_summand(send.dtype(), [&]<typename T>() { reduce_scatter_as<T>(rank, me, op, what); });
}

template <typename T>
void HierarchicalCommunicator::reduce_scatter_as(int rank, const Slot& me, ReduceOp op, const char* what) {
  const Device dev = devices_[static_cast<std::size_t>(rank)];
  const int w = world_size();
  const int l = size();
  const int p = processes_;
  const std::int64_t m = me.call.count;
  // The P blocks this rank reduces across processes: world ranks q * L + rank.
  const T* chunk = typed<T>(me.send);
  if (l > 1) {
    T* x = typed<T>(scratch(rank, static_cast<std::size_t>((static_cast<std::int64_t>(w) + p) * m) * sizeof(T)));
    T* y = x + static_cast<std::int64_t>(w) * m;
    // x: send reordered so that chunk j (P blocks) holds world ranks q * L + j, q = 0..P-1.
    for (int j = 0; j < l; ++j)
      for (int q = 0; q < p; ++q)
        copy_elements(dev, reinterpret_cast<std::byte*>(x + (static_cast<std::int64_t>(j) * p + q) * m),
                      reinterpret_cast<const std::byte*>(chunk + (static_cast<std::int64_t>(q) * l + j) * m), m,
                      sizeof(T));
    local_->reduce_scatter(rank, view_of(reinterpret_cast<std::byte*>(x), static_cast<std::int64_t>(w) * m,
                                         me.call.dtype, dev),
                           view_of(reinterpret_cast<std::byte*>(y), static_cast<std::int64_t>(p) * m, me.call.dtype,
                                   dev),
                           ReduceOp::Sum);
    chunk = y;
  }
  between_processes(rank, what, [&] {
    group(rank).reduce_scatter<T>(chunk, typed<T>(me.recv), m, Reduction::Sum, what);
    if (op == ReduceOp::Average) scale<T>(dev, typed<T>(me.recv), m, inverse<T>(w));
  });
}

void HierarchicalCommunicator::do_all_gather(int rank, const Tensor& send, const Tensor& recv) {
  const char* what = "all_gather (hierarchical)";
  Slot s;
  s.call = {Kind::AllGather, send.dtype(), ReduceOp::Sum, 0, send.numel()};
  s.send = static_cast<const std::byte*>(send.raw_data());
  s.recv = static_cast<std::byte*>(recv.raw_data());
  const std::vector<Slot> slots = agree(rank, std::move(s), what);
  const Slot& me = slots[static_cast<std::size_t>(rank)];
  with_process_type(send.dtype(), [&]<typename T>() { all_gather_as<T>(rank, me, what); });
}

template <typename T>
void HierarchicalCommunicator::all_gather_as(int rank, const Slot& me, const char* what) {
  const Device dev = devices_[static_cast<std::size_t>(rank)];
  const int l = size();
  const int p = processes_;
  const std::int64_t m = me.call.count;
  if (l == 1) {
    // World rank q is process q: the process-level layout is the world layout.
    between_processes(rank, what, [&] { group(rank).all_gather<T>(typed<T>(me.send), typed<T>(me.recv), m, what); });
    return;
  }
  // z: chunk j (P blocks) = world ranks q * L + j, q = 0..P-1. This rank's own chunk
  // comes from its peers; the local all-gather (in place) brings the other chunks.
  const std::int64_t chunk = static_cast<std::int64_t>(p) * m;
  std::byte* zb = scratch(rank, static_cast<std::size_t>(chunk * l) * sizeof(T));
  T* z = typed<T>(zb);
  T* own = z + chunk * rank;
  between_processes(rank, what, [&] { group(rank).all_gather<T>(typed<T>(me.send), own, m, what); });
  local_->all_gather(rank, view_of(reinterpret_cast<std::byte*>(own), chunk, me.call.dtype, dev),
                     view_of(zb, chunk * l, me.call.dtype, dev));
  for (int j = 0; j < l; ++j)
    for (int q = 0; q < p; ++q)
      copy_elements(dev, me.recv + static_cast<std::size_t>((static_cast<std::int64_t>(q) * l + j) * m) * sizeof(T),
                    reinterpret_cast<const std::byte*>(z + (static_cast<std::int64_t>(j) * p + q) * m), m, sizeof(T));
}

void HierarchicalCommunicator::synchronize(int rank) {
  check_rank(rank, "synchronize (hierarchical)");
  if (barrier_.aborted()) throw_aborted("synchronize", rank, barrier_.reason());
}

void HierarchicalCommunicator::abort(const std::string& reason) {
  // Release this process's ranks first (a dying job should not leave them spinning
  // while MPI tears down), then end the job: MPI cannot release the other processes.
  if (local_) local_->abort(reason);
  barrier_.abort(reason);
  dist::abort("the hierarchical communicator was aborted: " + reason + "; ending the job");
}

void HierarchicalCommunicator::reset() {
  local_->reset();
  barrier_.reset();
}

std::unique_ptr<Communicator> make_hierarchical_communicator(const std::vector<Device>& devices,
                                                             const CommOptions& options) {
  // The process-level steps give up at the stricter of options.timeout and
  // dp::dist::timeout() (Note [Communicator timeouts]); the local levels are released
  // by abort() (Note [Fault policy]).
  return std::make_unique<HierarchicalCommunicator>(devices, options.timeout);
}

}  // namespace dp::comm
