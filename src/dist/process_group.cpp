// Deterministic collectives among the processes of a job (see process_group.h).
#include "dist/process_group.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "dp/core/error.h"
#include "dp/core/half.h"
#include "dp/dist/dist.h"

namespace dp::dist::detail {

// Note [Process collective protocol]
// Every collective starts with a rendezvous: each process sends a Header (its call:
// kind, element type, count, root, op, its sequence number on this group, and whether
// its own arguments were bad) to every other process and receives theirs. Every
// process then evaluates the same set of headers, so all reach the same verdict: all
// go on, or all throw dp::Error — a process whose arguments were bad, processes that
// called different collectives or different sizes, or processes out of step (one
// skipped a call) are reported on every process, naming the calls, instead of hanging
// or reading out of bounds. The data phases follow with tags of their own, so a
// header can never be taken for data. The rendezvous is also the barrier.
//
// Messages go directly between every pair (no tree, no ring): a process sends P - 1
// headers per collective and each data phase moves the bandwidth-optimal
// 2 (P - 1) / P of the buffer. That suits the process counts dp targets (one process
// per node: 2..64 nodes); a tree for the headers is the step beyond that.

// Note [Deterministic process collectives]
// MPI_Allreduce's summation order is implementation-defined (it may differ with the
// algorithm MPI picks for the size, and between ranks), so dp does not use it. Element
// i of a reduction is always ((x_0[i] ⊕ x_1[i]) ⊕ x_2[i]) ⊕ ... ⊕ x_{P-1}[i] in rank
// order, computed once by the process that owns the element's slice and copied to the
// others. Mean is then x * (1.0f / P) for float32 — the same expression as the local
// communicator's Average (Note [Fixed summation order]) — and x / P for double. So for
// a fixed number of processes the result is bitwise the same on every process and from
// run to run, whatever MPI's transport, the network, or the timing; it does not depend
// on how the buffer is sliced (small buffers take a one-phase path with the same
// order). A different process count is a different sum.
//
// bfloat16 and float16 (gradients on the wire, Note [Gradients on the wire] in
// src/parallel/grad_wire.h) travel as 2-byte elements — MPI has no bfloat16 type, and
// dp never asks MPI to add anyway — and are folded by the same code in float32: every
// input widens exactly, element i is ((x_0[i] + x_1[i]) + x_2[i]) + ... in rank order in
// float32 (Mean: then * (1.0f / P)), and the result rounds to 16 bits once, to nearest
// even. That is the local communicator's 16-bit sum (src/comm/summation.h), so a
// process-level sum over P processes is bitwise the shared-memory sum over P devices,
// in 16 bits as in float32, and every process gets the same bits.
//
// All-reduce of a large buffer (> kSmallBytes): a reduce-scatter (process s receives
// slice s of every process's buffer and reduces it in rank order) then an all-gather of
// the reduced slices. A small one: an all-gather of the whole inputs, then every
// process reduces all of it in rank order (one round of messages instead of two).

namespace {

/// Tags of the three message kinds of a collective (Note [Process collective protocol]).
constexpr int kHeaderTag = 1;
constexpr int kPhase1Tag = 2;
constexpr int kPhase2Tag = 3;
/// Buffers up to this size take the one-round all-reduce: at 64 KiB a second round of
/// messages costs more than receiving P - 1 whole inputs.
constexpr std::int64_t kSmallBytes = 64 * 1024;

using Header = ProcessGroup::Header;

/// memcpy of n values; nothing (not even a null pointer) is touched when n is 0.
template <typename T>
void copy_n(T* dst, const T* src, std::int64_t n) {
  if (n > 0 && dst != src) std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T));
}

enum class Elem : std::int32_t { Byte, Float32, Float64, Int64, BFloat16, Float16 };

/// The 16-bit floating types: moved as 2 bytes, folded in float32 (Note [Deterministic
/// process collectives]).
template <typename T>
constexpr bool kIs16Bit = std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;

template <typename T>
constexpr Elem elem_of() {
  if constexpr (std::is_same_v<T, float>) return Elem::Float32;
  else if constexpr (std::is_same_v<T, double>) return Elem::Float64;
  else if constexpr (std::is_same_v<T, BFloat16>) return Elem::BFloat16;
  else if constexpr (std::is_same_v<T, Float16>) return Elem::Float16;
  else return Elem::Int64;
}

const char* elem_name(std::int32_t e) {
  switch (static_cast<Elem>(e)) {
    case Elem::Byte: return "bytes";
    case Elem::Float32: return "float32";
    case Elem::Float64: return "float64";
    case Elem::Int64: return "int64";
    case Elem::BFloat16: return "bfloat16";
    case Elem::Float16: return "float16";
  }
  return "?";
}

const char* kind_name(std::int32_t k) {
  switch (static_cast<Kind>(k)) {
    case Kind::Barrier: return "barrier";
    case Kind::Broadcast: return "broadcast";
    case Kind::AllReduce: return "all_reduce";
    case Kind::Reduce: return "reduce";
    case Kind::ReduceScatter: return "reduce_scatter";
    case Kind::AllGather: return "all_gather";
    case Kind::Finalize: return "finalize (the process is exiting)";
    case Kind::Custom: return "a collective";
  }
  return "?";
}

const char* op_name(std::int32_t op) {
  switch (static_cast<Reduction>(op)) {
    case Reduction::Sum: return "sum";
    case Reduction::Mean: return "mean";
    case Reduction::Max: return "max";
    case Reduction::Min: return "min";
  }
  return "?";
}

bool has_root(std::int32_t k) {
  return k == static_cast<std::int32_t>(Kind::Broadcast) ||
         k == static_cast<std::int32_t>(Kind::Reduce);
}
bool has_op(std::int32_t k) {
  return k == static_cast<std::int32_t>(Kind::AllReduce) ||
         k == static_cast<std::int32_t>(Kind::Reduce) ||
         k == static_cast<std::int32_t>(Kind::ReduceScatter);
}
bool has_count(std::int32_t k) {
  return k != static_cast<std::int32_t>(Kind::Barrier) &&
         k != static_cast<std::int32_t>(Kind::Finalize);
}

/// "all_reduce(count 10, float32, sum)".
std::string describe(const Header& h) {
  std::string s = kind_name(h.kind);
  if (!has_count(h.kind)) return s;
  s += "(count ";
  s += h.count < 0 ? std::string("root's") : std::to_string(h.count);
  s += h.kind == static_cast<std::int32_t>(Kind::Broadcast)
           ? dp::detail::str_cat(" bytes of ", h.aux, "-byte elements")
           : dp::detail::str_cat(", ", elem_name(h.elem));
  if (has_op(h.kind)) s += dp::detail::str_cat(", ", op_name(h.op));
  if (has_root(h.kind)) s += dp::detail::str_cat(", root ", h.root);
  s += ")";
  if (h.context[0] != '\0') s += dp::detail::str_cat(" inside ", h.context);
  return s;
}

/// " inside <scope>" for this thread's CollectiveScope, "" outside one.
std::string local_context() {
  const std::string& c = CollectiveScope::current();
  return c.empty() ? std::string() : " inside " + c;
}

/// Copies `text` into a fixed field, NUL-terminated, "..." marking a cut.
template <std::size_t N>
void put_text(char (&field)[N], const std::string& text) {
  const std::size_t n = std::min(text.size(), N - 1);
  std::memcpy(field, text.data(), n);
  if (n < text.size()) std::memcpy(field + n - 3, "...", 3);
}

Header make_header(Kind kind, Elem elem, std::int64_t count, Reduction op, int root,
                   const std::string& error) {
  Header h;
  h.kind = static_cast<std::int32_t>(kind);
  h.elem = static_cast<std::int32_t>(elem);
  h.count = count;
  h.op = static_cast<std::int32_t>(op);
  h.root = root;
  if (!error.empty()) {
    h.failed = 1;
    put_text(h.error, error);
  }
  put_text(h.context, CollectiveScope::current());
  return h;
}

// ---- the element-wise reductions, in rank order -------------------------------------

/// Integer sums wrap around (two's complement) instead of overflowing.
template <typename T>
T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(a) +
                          static_cast<std::make_unsigned_t<T>>(b));
  } else {
    return a + b;
  }
}

/// Max / Min that propagate NaN (a diverged metric on any process shows everywhere).
template <typename T>
T pick(T a, T b, bool want_max) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return want_max ? (b > a ? b : a) : (b < a ? b : a);
}

template <typename T>
T mean_of(T sum, int p) {
  if constexpr (std::is_same_v<T, float>) {
    return sum * (1.0f / static_cast<float>(p));  // as LocalCommunicator's Average
  } else {
    return sum / static_cast<T>(p);
  }
}

/// out[i] = out[i] ⊕ src[i]: one step of a fold in rank order.
template <typename T>
void combine(T* __restrict out, const T* __restrict src, std::int64_t n, Reduction op) {
  switch (op) {
    case Reduction::Sum:
    case Reduction::Mean:
      for (std::int64_t i = 0; i < n; ++i) out[i] = add(out[i], src[i]);
      break;
    case Reduction::Max:
      for (std::int64_t i = 0; i < n; ++i) out[i] = pick(out[i], src[i], true);
      break;
    case Reduction::Min:
      for (std::int64_t i = 0; i < n; ++i) out[i] = pick(out[i], src[i], false);
      break;
  }
}

/// dst[i] = rows[0][i] ⊕ rows[1][i] ⊕ ... ⊕ rows[P-1][i] (Note [Deterministic process
/// collectives]). dst may alias no row.
template <typename T>
void fold(const std::vector<const T*>& rows, T* dst, std::int64_t n, Reduction op) {
  if (n <= 0) return;
  const int p = static_cast<int>(rows.size());
  copy_n(dst, rows[0], n);
  for (int k = 1; k < p; ++k) combine(dst, rows[static_cast<std::size_t>(k)], n, op);
  if (op == Reduction::Mean) {
    if constexpr (std::is_floating_point_v<T>) {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = mean_of(dst[i], p);
    }
  }
}

/// fold of 16-bit rows: each block widened to float32, folded there in rank order as a
/// float32 fold, and rounded to T once (Note [Deterministic process collectives]).
template <typename T>
  requires kIs16Bit<T>
void fold(const std::vector<const T*>& rows, T* dst, std::int64_t n, Reduction op) {
  // 2 x 4 KiB of float32 on the stack: a block stays in L1 while every row is added.
  constexpr std::int64_t kBlock = 1024;
  float acc[kBlock];
  float next[kBlock];
  const int p = static_cast<int>(rows.size());
  for (std::int64_t b = 0; b < n; b += kBlock) {
    const std::int64_t m = std::min(kBlock, n - b);
    for (std::int64_t i = 0; i < m; ++i) acc[i] = static_cast<float>(rows[0][b + i]);
    for (int k = 1; k < p; ++k) {
      const T* src = rows[static_cast<std::size_t>(k)] + b;
      for (std::int64_t i = 0; i < m; ++i) next[i] = static_cast<float>(src[i]);
      combine(acc, next, m, op);
    }
    if (op == Reduction::Mean)
      for (std::int64_t i = 0; i < m; ++i) acc[i] = mean_of(acc[i], p);
    for (std::int64_t i = 0; i < m; ++i) dst[b + i] = T(acc[i]);
  }
}

/// Slice r of a count split into P: ceil(count / P) elements each, the last ones
/// shorter or empty.
struct Slice {
  std::int64_t off;
  std::int64_t len;
};
Slice slice_of(std::int64_t count, int p, int r) {
  const std::int64_t chunk = (count + p - 1) / p;
  const std::int64_t off = std::min(count, chunk * r);
  return {off, std::min(chunk, count - off)};
}

template <typename T>
Transfer xfer(int peer, const T* data, std::int64_t n) {
  return {peer, const_cast<T*>(data), static_cast<std::size_t>(n) * sizeof(T)};
}

bool overlaps(const void* a, std::size_t na, const void* b, std::size_t nb) {
  if (na == 0 || nb == 0 || a == nullptr || b == nullptr) return false;
  const auto* pa = static_cast<const unsigned char*>(a);
  const auto* pb = static_cast<const unsigned char*>(b);
  return pa < pb + nb && pb < pa + na;
}

}  // namespace

ProcessGroup::ProcessGroup(WorldInfo world, ChannelPtr channel, std::string name)
    : world_(std::move(world)), channel_(std::move(channel)), name_(std::move(name)) {
  DP_ASSERT(channel_ != nullptr || world_.size == 1, "a group of several processes needs a channel");
}

std::string ProcessGroup::who(int r) const {
  if (r < 0 || r >= size()) return dp::detail::str_cat("rank ", r);
  if (size() == 1) return "rank 0";
  const auto i = static_cast<std::size_t>(r);
  return dp::detail::str_cat("rank ", r, " (", world_.hosts[i], ", pid ", world_.pids[i], ")");
}

void ProcessGroup::check_usable(const char* what) const {
  DP_CHECK(!finalized(), what, ": dp::dist::finalize() has run (explicitly or at exit); ",
           "no collective can be made afterwards");
}

void* ProcessGroup::scratch(std::size_t bytes) {
  const std::size_t n = (bytes + sizeof(double) - 1) / sizeof(double);
  // Grows geometrically so that buffers of changing sizes settle after a few calls.
  if (scratch_.size() < n) scratch_.resize(std::max(n, scratch_.size() * 2));
  return scratch_.data();
}

// Note [Communicator timeouts]
// A group's waits are bounded by dp::dist::timeout() (DP_DIST_TIMEOUT: the job's limit,
// set by whoever launches it) and, when its owner set one, by the group's own limit
// (a world communicator's CommOptions::timeout, which DataParallel fills from
// DataParallelOptions::collective_timeout): a wait gives up at the stricter of the two,
// 0 meaning "none" for either. Not "the communicator's replaces the job's": every
// DataParallel passes a timeout (10 minutes unless told), so DP_DIST_TIMEOUT would then
// bound none of their waits, and a job script could no longer tighten fault detection
// for the whole program. So a communicator can only shorten the job's limit; to wait
// longer than DP_DIST_TIMEOUT somewhere, raise DP_DIST_TIMEOUT. The message of a
// timeout names the limit that fired and where it was set.

void ProcessGroup::set_timeout(std::chrono::milliseconds timeout, std::string owner) {
  DP_CHECK(timeout.count() >= 0, name_, ": expected a timeout >= 0 (0: none), got ", timeout.count(), " ms");
  std::lock_guard<std::mutex> lock(mu_);
  own_timeout_ = timeout;
  timeout_owner_ = std::move(owner);
}

std::chrono::milliseconds ProcessGroup::timeout() const {
  const std::chrono::milliseconds job = dp::dist::timeout();
  if (own_timeout_.count() == 0) return job;
  if (job.count() == 0) return own_timeout_;
  return std::min(job, own_timeout_);
}

void ProcessGroup::record(Kind kind, std::chrono::steady_clock::time_point start, std::int64_t bytes) {
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard<std::mutex> lock(timing_mu_);
  Timing& t = timings_[static_cast<std::size_t>(kind)];
  t.ms += ms;
  t.calls += 1;
  t.bytes += bytes;
}

ProcessGroup::Timings ProcessGroup::timings() const {
  std::lock_guard<std::mutex> lock(timing_mu_);
  return timings_;
}

void ProcessGroup::reset_timings() {
  std::lock_guard<std::mutex> lock(timing_mu_);
  timings_ = {};
}

void ProcessGroup::run(int tag, const std::vector<Transfer>& sends,
                       const std::vector<Transfer>& recvs, const char* what, std::int64_t seq,
                       bool bounded) {
  if (sends.empty() && recvs.empty()) return;
  const auto limit = bounded ? timeout() : std::chrono::milliseconds(0);
  std::vector<int> missing;
  try {
    missing = exchange(*channel_, tag, sends, recvs, limit);
  } catch (const std::exception& e) {
    // Receives may still be posted into the caller's buffers: this process cannot go
    // on, and the others wait for its messages. End the job (Note [Fault policy]).
    dp::dist::abort(dp::detail::str_cat(what, " (collective #", seq, " on ", name_, ")", local_context(), ": ",
                                        e.what(), "; ending the job"));
  }
  if (missing.empty()) return;
  std::string names;
  for (std::size_t i = 0; i < missing.size(); ++i)
    names += (i ? ", " : "") + who(missing[i]);
  // Note [Communicator timeouts]: name the limit that fired.
  const bool own = own_timeout_.count() > 0 && limit == own_timeout_ && limit != dp::dist::timeout();
  const std::string raise =
      own ? dp::detail::str_cat(timeout_owner_, ", ", static_cast<double>(limit.count()) / 1000.0,
                                " s; the job's DP_DIST_TIMEOUT bounds it from above")
          : std::string("DP_DIST_TIMEOUT seconds, or dp::dist::set_timeout");
  dp::dist::abort(
      dp::detail::str_cat(
          what, " (collective #", seq, " on ", name_, ")", local_context(), " timed out: nothing came from ", names,
          " for ", static_cast<double>(limit.count()) / 1000.0,
          " s — it crashed, hangs, left (returned from main: its exit-time rendezvous is on "
          "dp::dist's own group), or is in a different collective. Ending the job; if the "
          "wait was legitimate (one process working alone for long), raise the timeout (",
          raise, ")"),
      kTimeoutExitCode);
}

std::vector<Header> ProcessGroup::rendezvous(Header mine, const char* what, bool bounded) {
  mine.seq = seq_++;
  const int p = size();
  const int me = rank();
  std::vector<Header> all(static_cast<std::size_t>(p));
  all[static_cast<std::size_t>(me)] = mine;
  std::vector<Transfer> sends;
  std::vector<Transfer> recvs;
  for (int r = 0; r < p; ++r) {
    if (r == me) continue;
    sends.push_back({r, &all[static_cast<std::size_t>(me)], sizeof(Header)});
    recvs.push_back({r, &all[static_cast<std::size_t>(r)], sizeof(Header)});
  }
  run(kHeaderTag, sends, recvs, what, mine.seq, bounded);
  for (Header& h : all) {
    h.error[sizeof(h.error) - 1] = '\0';
    h.context[sizeof(h.context) - 1] = '\0';
  }

  // Every process evaluates the same headers, so every process reaches the same verdict.
  std::string problem;
  if (mine.failed) {
    problem = mine.error;
  } else {
    for (int r = 0; r < p && problem.empty(); ++r) {
      const Header& h = all[static_cast<std::size_t>(r)];
      if (h.failed)
        problem = dp::detail::str_cat(who(r), " failed in ", kind_name(h.kind), ": ", h.error);
    }
  }
  const Header& ref = all[0];
  for (int r = 1; r < p && problem.empty(); ++r) {
    const Header& h = all[static_cast<std::size_t>(r)];
    const auto finalize = static_cast<std::int32_t>(Kind::Finalize);
    if ((h.kind == finalize) != (ref.kind == finalize)) {
      // Note [Uneven data]: the usual cause is a process that ran out of batches.
      const int gone = h.kind == finalize ? r : 0;
      const int stayed = h.kind == finalize ? 0 : r;
      const Header& call = h.kind == finalize ? ref : h;
      problem = dp::detail::str_cat(
          who(gone), " has left the job: it called finalize (the process is exiting) while ",
          who(stayed), " called ", describe(call), ". Did one process run out of data and "
          "stop early? Every process must make the same collective calls, so every process "
          "must run the same number of steps: give each the same number of batches "
          "(DistributedSampler pads or drop_last cuts every share to one length), or agree "
          "on the count first (dp::dist::all_reduce(steps, dp::dist::Op::Min))");
      break;
    }
    if (h.seq != ref.seq) {
      problem = dp::detail::str_cat(
          "processes are out of step: ", who(0), " is at its collective #", ref.seq, " (",
          describe(ref), ") but ", who(r), " is at #", h.seq, " (", describe(h),
          "); every process must make the same collective calls in the same order");
      break;
    }
    const bool counts_agree = h.count == ref.count || h.count < 0 || ref.count < 0;
    const bool same = h.kind == ref.kind && h.elem == ref.elem && counts_agree &&
                      h.aux == ref.aux && (!has_root(h.kind) || h.root == ref.root) &&
                      (!has_op(h.kind) || h.op == ref.op);
    if (!same) {
      problem = dp::detail::str_cat(
          "processes disagree: ", who(0), " called ", describe(ref), " but ", who(r),
          " called ", describe(h), "; every process must make the same collective calls, in "
          "the same order, with the same sizes");
    }
  }
  if (!problem.empty()) {
    // This process's scope, unless the problem already shows it with this call.
    const std::string scope = local_context();
    DP_FAIL(what, problem.find(scope) == std::string::npos ? scope : std::string(), " on ", who(me), ": ", problem);
  }
  return all;
}

namespace {

/// Records one call into its group's timings on every path out of the call (Note
/// [Process-level timings], process_group.h).
struct CallTimer {
  ProcessGroup* group;
  void (ProcessGroup::*record)(Kind, std::chrono::steady_clock::time_point, std::int64_t);
  Kind kind;
  std::int64_t bytes = 0;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~CallTimer() { (group->*record)(kind, start, bytes); }
};

}  // namespace

void ProcessGroup::barrier(const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  CallTimer timer{this, &ProcessGroup::record, Kind::Barrier};
  check_usable(what);
  rendezvous(make_header(Kind::Barrier, Elem::Byte, 0, Reduction::Sum, 0, {}), what);
}

void ProcessGroup::finalize_rendezvous(const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  rendezvous(make_header(Kind::Finalize, Elem::Byte, 0, Reduction::Sum, 0, {}), what,
             /*bounded=*/false);
}

template <typename T>
void ProcessGroup::reduce_impl(Kind kind, const T* send, T* recv, std::int64_t count, int root,
                               Reduction op, const char* what, const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  CallTimer timer{this, &ProcessGroup::record, kind};
  check_usable(what);
  std::string problem = error;
  if (problem.empty() && count < 0) problem = dp::detail::str_cat("count is ", count, "; expected >= 0");
  if (problem.empty() && kind == Kind::Reduce && (root < 0 || root >= size()))
    problem = dp::detail::str_cat("root ", root, " is out of range (expected 0..", size() - 1, ")");
  if (problem.empty() && std::is_integral_v<T> && op == Reduction::Mean)
    problem = "Mean of integers would round; reduce a floating-point value, or Sum and divide";
  const std::vector<Header> all = rendezvous(
      make_header(kind, elem_of<T>(), problem.empty() ? count : 0, op, root, problem), what);
  timer.bytes = count * static_cast<std::int64_t>(sizeof(T)) * (kind == Kind::ReduceScatter ? size() : 1);
  const std::int64_t seq = all[static_cast<std::size_t>(rank())].seq;
  const int p = size();
  const int me = rank();

  if (kind == Kind::AllReduce &&
      count * static_cast<std::int64_t>(sizeof(T)) <= kSmallBytes) {
    // One round: every process gets every input and folds them all (same order).
    T* rows = static_cast<T*>(scratch(static_cast<std::size_t>(count * p) * sizeof(T)));
    copy_n(rows + count * me, send, count);
    std::vector<Transfer> sends, recvs;
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      sends.push_back(xfer(r, send, count));
      recvs.push_back(xfer(r, rows + count * r, count));
    }
    run(kPhase1Tag, sends, recvs, what, seq);
    std::vector<const T*> in;
    for (int r = 0; r < p; ++r) in.push_back(rows + count * r);
    fold(in, recv, count, op);
    return;
  }

  // Phase 1, reduce-scatter: this process receives its slice of every process's send
  // (rows, in rank order) and folds them. For reduce_scatter a slice is a block of
  // `count` (= recv_count) values; otherwise the count is cut into P slices.
  const bool blocks = kind == Kind::ReduceScatter;
  auto slice = [&](int r) -> Slice {
    return blocks ? Slice{count * r, count} : slice_of(count, p, r);
  };
  const Slice mine = slice(me);
  const std::int64_t row = blocks ? count : slice_of(count, p, 0).len;
  T* rows = static_cast<T*>(scratch(static_cast<std::size_t>(row * (p + 1)) * sizeof(T)));
  T* out = rows + row * p;  // the reduced slice, when it has nowhere else to go
  copy_n(rows + row * me, send + mine.off, mine.len);
  {
    std::vector<Transfer> sends, recvs;
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      const Slice s = slice(r);
      sends.push_back(xfer(r, send + s.off, s.len));
      recvs.push_back(xfer(r, rows + row * r, mine.len));
    }
    run(kPhase1Tag, sends, recvs, what, seq);
  }
  std::vector<const T*> in;
  for (int r = 0; r < p; ++r) in.push_back(rows + row * r);
  // Every send of phase 1 has completed: recv may be written even where it is send.
  T* dst = kind == Kind::ReduceScatter                    ? recv
           : (kind == Kind::AllReduce || me == root)      ? recv + mine.off
                                                          : out;
  fold(in, dst, mine.len, op);
  if (kind == Kind::ReduceScatter) return;

  // Phase 2: the reduced slices go to every process (all_reduce) or to root (reduce).
  std::vector<Transfer> sends, recvs;
  for (int r = 0; r < p; ++r) {
    if (r == me) continue;
    if (kind == Kind::AllReduce || r == root) sends.push_back(xfer(r, dst, mine.len));
    if (kind == Kind::AllReduce || me == root) {
      const Slice s = slice(r);
      recvs.push_back(xfer(r, recv + s.off, s.len));
    }
  }
  run(kPhase2Tag, sends, recvs, what, seq);
}

template <typename T>
void ProcessGroup::all_reduce(const T* send, T* recv, std::int64_t count, Reduction op,
                              const char* what, const std::string& error) {
  reduce_impl<T>(Kind::AllReduce, send, recv, count, 0, op, what, error);
}

template <typename T>
void ProcessGroup::reduce(const T* send, T* recv, std::int64_t count, int root, Reduction op,
                          const char* what, const std::string& error) {
  reduce_impl<T>(Kind::Reduce, send, recv, count, root, op, what, error);
}

template <typename T>
void ProcessGroup::reduce_scatter(const T* send, T* recv, std::int64_t recv_count,
                                  Reduction op, const char* what, const std::string& error) {
  reduce_impl<T>(Kind::ReduceScatter, send, recv, recv_count, 0, op, what, error);
}

template <typename T>
void ProcessGroup::all_gather(const T* send, T* recv, std::int64_t count, const char* what,
                              const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  CallTimer timer{this, &ProcessGroup::record, Kind::AllGather};
  check_usable(what);
  std::string problem = error;
  if (problem.empty() && count < 0) problem = dp::detail::str_cat("count is ", count, "; expected >= 0");
  const int p = size();
  const int me = rank();
  T* own = recv + count * me;
  if (problem.empty() && send != own &&
      overlaps(send, static_cast<std::size_t>(count) * sizeof(T), recv,
               static_cast<std::size_t>(count * p) * sizeof(T)))
    problem = dp::detail::str_cat("send overlaps recv but is not recv's block ", me,
                                  "; in place, pass recv's block ", me, " as send");
  const std::vector<Header> all = rendezvous(
      make_header(Kind::AllGather, elem_of<T>(), problem.empty() ? count : 0, Reduction::Sum,
                  0, problem),
      what);
  timer.bytes = count * static_cast<std::int64_t>(sizeof(T)) * p;
  copy_n(own, send, count);
  std::vector<Transfer> sends, recvs;
  for (int r = 0; r < p; ++r) {
    if (r == me) continue;
    sends.push_back(xfer(r, own, count));
    recvs.push_back(xfer(r, recv + count * r, count));
  }
  run(kPhase1Tag, sends, recvs, what, all[static_cast<std::size_t>(me)].seq);
}

void ProcessGroup::broadcast(void* data, std::int64_t bytes, int root, const char* what,
                             std::int64_t elem_size,
                             const std::function<void*(std::size_t)>& resize,
                             const std::string& error) {
  std::lock_guard<std::mutex> lock(mu_);
  CallTimer timer{this, &ProcessGroup::record, Kind::Broadcast};
  check_usable(what);
  const int p = size();
  const int me = rank();
  std::string problem = error;
  if (problem.empty() && (root < 0 || root >= p))
    problem = dp::detail::str_cat("root ", root, " is out of range (expected 0..", p - 1, ")");
  const bool sized = static_cast<bool>(resize);
  Header h = make_header(Kind::Broadcast, Elem::Byte,
                         !problem.empty() ? 0 : (sized && me != root) ? -1 : bytes,
                         Reduction::Sum, root, problem);
  h.aux = elem_size;
  const std::vector<Header> all = rendezvous(h, what);
  const std::int64_t root_bytes = all[static_cast<std::size_t>(root)].count;
  timer.bytes = root_bytes;
  std::vector<Transfer> sends, recvs;
  if (me == root) {
    for (int r = 0; r < p; ++r)
      if (r != me) sends.push_back({r, data, static_cast<std::size_t>(root_bytes)});
  } else {
    void* dst = sized ? resize(static_cast<std::size_t>(root_bytes)) : data;
    recvs.push_back({root, dst, static_cast<std::size_t>(root_bytes)});
  }
  run(kPhase1Tag, sends, recvs, what, all[static_cast<std::size_t>(me)].seq);
}

#define DP_INSTANTIATE_GROUP(T)                                                               \
  template void ProcessGroup::all_reduce<T>(const T*, T*, std::int64_t, Reduction,            \
                                            const char*, const std::string&);                 \
  template void ProcessGroup::reduce<T>(const T*, T*, std::int64_t, int, Reduction,           \
                                        const char*, const std::string&);                     \
  template void ProcessGroup::reduce_scatter<T>(const T*, T*, std::int64_t, Reduction,        \
                                                const char*, const std::string&);             \
  template void ProcessGroup::all_gather<T>(const T*, T*, std::int64_t, const char*,          \
                                            const std::string&);
DP_INSTANTIATE_GROUP(float)
DP_INSTANTIATE_GROUP(double)
DP_INSTANTIATE_GROUP(std::int64_t)
DP_INSTANTIATE_GROUP(BFloat16)
DP_INSTANTIATE_GROUP(Float16)
#undef DP_INSTANTIATE_GROUP

}  // namespace dp::dist::detail
