// dp::dist: the process group's life (init, finalise, abort) and its host-side
// collectives (see dp/dist/dist.h).
#include "dp/dist/dist.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "dist/process_group.h"
#include "dist/transport.h"
#include "dp/core/error.h"

namespace dp::dist {

// Note [Thread level]
// dp asks MPI for MPI_THREAD_MULTIPLE and accepts MPI_THREAD_SERIALIZED. MULTIPLE,
// because dp's runtime calls collectives from more than one thread: the DDP reducer
// all-reduces buckets on per-device communication threads while the workers run
// backward, and the hierarchical design (docs/multi-node.md) reduces each local device's
// slice across processes in parallel, each on its own group. Open MPI 4.1 (Debian's)
// provides MULTIPLE. SERIALIZED is enough for correctness as long as no two threads
// are inside MPI at once: with it, dp's transport takes a mutex around each of its MPI
// calls (never around a whole collective, so concurrent collectives still progress);
// a program that also calls MPI itself must then not do so while dp runs a
// collective. SINGLE and FUNNELED are refused with dp::Error: dp's collectives do not
// run on the main thread only. A program that calls MPI_Init itself gets SINGLE from
// Open MPI: it should call MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) instead, or
// leave MPI's initialisation to dp.

// Note [Fault policy]
// A process that throws, or dies, must not leave the others hanging: the failing rank
// prints its error and the job ends (MPI_Abort), or the others time out with a message
// naming the missing rank. In detail:
//  - A process killed by a signal, or exiting without MPI_Finalize (std::abort,
//    _exit): mpirun (or srun) sees it and kills the other processes; the job's exit
//    status is non-zero.
//  - An exception that leaves main: dp's std::terminate handler (installed when the
//    world has several processes) prints it with the rank and calls MPI_Abort.
//  - Bad arguments to a collective (sizes, roots, different calls on different
//    processes): dp::Error on every process, through the rendezvous (Note [Process
//    collective protocol]); nothing has moved, the group stays usable.
//  - A process that returns from main while the others are still in collectives: its
//    exit-time rendezvous (finalize()) meets their collective and every process
//    reports the mismatch; or, when they wait on another group, they time out. That
//    rendezvous itself waits without a timeout: finishing long after the others (rank
//    0 writing the final checkpoint) is legitimate.
//  - A process that hangs, or waits in a different collective: the others give up
//    after timeout() without progress, print which ranks were missing (node, pid), and
//    end the job with MPI_Abort (exit status 124).
//  - Communicator::abort() on the mpi communicator ends the job: MPI cannot release a
//    process blocked in another process's collective, and nothing dp posted can be
//    cancelled safely (its receives write into the caller's buffers).
// dp never blocks inside MPI (Note [Waiting with a deadline], mpi_transport.cpp), which
// is what makes the timeout possible.

// Note [Uneven data]
// dp does not shadow a process that has run out of batches (PyTorch's Join context
// manager does, at the price of a collective per step to learn who is still there):
// every process must run the same number of steps. What happens when one does not, say
// process 1 runs one step fewer and returns from main:
//  - its objects are destroyed (a DataParallel frees its communicator's channels), then
//    its exit-time rendezvous (finalize()) waits on dp::dist's own group;
//  - a training step of the others starts with a host all-reduce of the batch's rows on
//    that same group (Note [Across processes], data_parallel.cpp), which meets the
//    rendezvous: every process fails there alike with "rank 1 ... has left the job: it
//    called finalize (the process is exiting) while rank 0 ... called all_reduce(...)"
//    (process_group.cpp), the leaving one ends the job (MPI_Abort), within one
//    exchange of messages, whatever the timeout;
//  - a step whose first inter-process call is on a communicator's group instead (a
//    forward under no_grad broadcasting buffers) waits there for the leaving process,
//    which never comes: after the timeout it ends the job naming it ("timed out:
//    nothing came from rank 1").
// Never a hang, always the missing rank named; tests/dist/dp_uneven_mpi_test.cpp runs
// both. The cure is in the data: DistributedSampler pads every share to one length (or
// drop_last cuts them), or the processes agree on the step count first
// (dp::dist::all_reduce(steps, dp::dist::Op::Min)).

namespace {

/// Timeout when DP_DIST_TIMEOUT is unset: 600 s, PyTorch's default for NCCL.
constexpr std::chrono::milliseconds kDefaultTimeout{600'000};

struct State {
  std::mutex mu;  // init / finalize
  std::atomic<bool> initialized{false};
  std::atomic<bool> finalized{false};
  bool uses_mpi = false;  // MPI initialised (by dp or the program) for this job
  detail::WorldInfo info;
  std::unique_ptr<detail::ProcessGroup> world;  // dp::dist's own collectives
  std::terminate_handler previous_terminate = nullptr;
};

/// init() without the check that finalize() has not run: what the accessors call, so
/// that rank() and world_size() still answer after finalize().
void ensure_initialized();

/// Never destroyed: collectives may run from other static destructors and from atexit.
State& state() {
  static State* s = new State;
  return *s;
}

std::chrono::milliseconds timeout_from_env() {
  const char* text = std::getenv("DP_DIST_TIMEOUT");
  if (text == nullptr || *text == '\0') return kDefaultTimeout;  // empty is unset, as for DP_CPU_DEVICES
  return detail::parse_timeout_seconds(text);
}

}  // namespace

// Note [DP_DIST_TIMEOUT]
// The job's timeout in seconds: digits, optionally a '.' and more digits ("600",
// "0.5", "1.25"), from 0.001 to 10^9; "0" waits forever (as set_timeout(0)). Anything
// else is a dp::Error at the first use of dp::dist (or of a DataParallel, which asks
// for the timeout), as an invalid DP_CPU_DEVICES is: a typo such as "10s", "10m",
// "-5", "1e3" or " 60" must not leave a job on a limit nobody chose (it used to fall
// back to 600 s with a warning that scrolls away on a cluster's stderr). Units and
// exponents are refused rather than guessed. The bounds: below 1 ms the value would
// round to 0, which means "no timeout", the opposite of what a tiny value asks for;
// above 10^9 s (31 years) is past any job, and deadlines of now + timeout in
// steady_clock nanoseconds stay far inside int64 (2^63 ns is 292 years). An empty
// value counts as unset (600 s), as an empty DP_CPU_DEVICES does.
std::chrono::milliseconds detail::parse_timeout_seconds(const std::string& text) {
  constexpr double kMaxSeconds = 1e9;
  auto refuse = [&text](const char* why) {
    DP_FAIL("DP_DIST_TIMEOUT: expected a number of seconds such as 600 or 0.5 (digits, an optional fraction, "
            "no unit; 0 waits forever), from 0.001 to 1e9, got '",
            text, "' (", why, ")");
  };
  std::size_t i = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
  const std::size_t whole_digits = i;
  std::size_t fraction_digits = 0;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i, ++fraction_digits;
    if (fraction_digits == 0) refuse("no digit after the '.'");
  }
  if (whole_digits == 0) refuse("not a number of seconds >= 0");
  if (i != text.size()) refuse("unexpected characters");
  const double seconds = std::strtod(text.c_str(), nullptr);  // the checked form parses whole
  if (seconds == 0.0) return std::chrono::milliseconds(0);
  if (seconds > kMaxSeconds) refuse("too long");
  const auto ms = static_cast<std::int64_t>(std::llround(seconds * 1000.0));
  if (ms == 0) refuse("below 1 ms, which would mean no timeout");
  return std::chrono::milliseconds(ms);
}

namespace {

std::atomic<std::int64_t>& timeout_ms() {
  static std::atomic<std::int64_t> ms{timeout_from_env().count()};
  return ms;
}

/// True when a launcher started this process as part of a job: Open MPI's mpirun
/// (OMPI_COMM_WORLD_SIZE), PMIx launchers such as srun --mpi=pmix or prterun
/// (PMIX_RANK), and PMI-1/2 launchers such as MPICH's hydra or srun --mpi=pmi2
/// (PMI_RANK). A plain `./train` is not (MPI would start as a singleton, slowly, for a
/// world of one), so dp does not initialise MPI then.
bool launched_by_launcher() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

std::string who_am_i() {
  State& st = state();
  if (st.info.size == 1) return "rank 0";  // st.info is set before anything can fail
  const auto r = static_cast<std::size_t>(st.info.rank);
  return dp::detail::str_cat("rank ", st.info.rank, " (", st.info.hosts[r], ", pid ",
                             st.info.pids[r], ")");
}

void on_terminate() {
  std::string what = "std::terminate was called";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = std::string("uncaught exception: ") + ex.what();
    } catch (...) {
      what = "uncaught exception of a type not derived from std::exception";
    }
  }
  dp::dist::abort(what + "; ending the job");
}

void finalize_at_exit() {
  try {
    finalize();
  } catch (const std::exception& e) {
    dp::dist::abort(std::string("at exit: ") + e.what());
  }
}

detail::ProcessGroup& world_group(const char* what) {
  ensure_initialized();
  State& st = state();
  DP_CHECK(!st.finalized.load(std::memory_order_acquire) && st.world != nullptr, what,
           ": dp::dist::finalize() has run (explicitly or at exit); no collective can be "
           "made afterwards");
  return *st.world;
}

detail::Reduction reduction_of(Op op) {
  switch (op) {
    case Op::Sum: return detail::Reduction::Sum;
    case Op::Mean: return detail::Reduction::Mean;
    case Op::Max: return detail::Reduction::Max;
    case Op::Min: return detail::Reduction::Min;
  }
  DP_FAIL("dp::dist: unknown Op ", static_cast<int>(op));
}

void ensure_initialized() {
  State& st = state();
  if (st.initialized.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.initialized.load(std::memory_order_relaxed)) return;
  DP_CHECK(!st.finalized.load(), "dp::dist: used for the first time after dp::dist::finalize()");
  timeout_ms();  // parse DP_DIST_TIMEOUT now: a bad value is reported at start-up
  detail::ChannelPtr channel;
  if (!st.uses_mpi && detail::transport_available() && launched_by_launcher()) {
    st.info = detail::transport_init();
    st.uses_mpi = true;
    // Registered after MPI_Init, so it runs before the destructors of statics built
    // earlier (none of which holds MPI state) and after those built later (which may).
    std::atexit(finalize_at_exit);
  }
  if (st.uses_mpi) {
    DP_CHECK(st.info.thread_serialized, "dp::dist::init: MPI provides ", st.info.thread_level,
             " but dp needs at least MPI_THREAD_SERIALIZED (its collectives run on "
             "communication threads, Note [Thread level]); call MPI_Init_thread with "
             "MPI_THREAD_MULTIPLE instead of MPI_Init, or let dp initialise MPI");
    channel = detail::open_channel(timeout());
    if (channel == nullptr)
      dp::dist::abort("dp::dist::init: the other processes did not join within the timeout",
                      detail::kTimeoutExitCode);
  }
  st.world = std::make_unique<detail::ProcessGroup>(st.info, channel, "dp::dist's world");
  if (st.info.size > 1) st.previous_terminate = std::set_terminate(on_terminate);
  st.initialized.store(true, std::memory_order_release);
}

}  // namespace

void init() {
  State& st = state();
  DP_CHECK(!st.finalized.load(std::memory_order_acquire), "dp::dist::init: called after ",
           "dp::dist::finalize(); a process joins the job once");
  ensure_initialized();
}

bool is_initialized() { return state().initialized.load(std::memory_order_acquire); }
bool built_with_mpi() { return detail::transport_available(); }
bool is_distributed() { return world_size() > 1; }

int rank() {
  ensure_initialized();
  return state().info.rank;
}
int world_size() {
  ensure_initialized();
  return state().info.size;
}
int local_rank() {
  ensure_initialized();
  return state().info.local_rank;
}
int local_size() {
  ensure_initialized();
  return state().info.local_size;
}
bool is_main() { return rank() == 0; }

std::string host_name(int r) {
  ensure_initialized();
  const detail::WorldInfo& info = state().info;
  DP_CHECK(r >= 0 && r < info.size, "dp::dist::host_name: expected a rank in [0, ", info.size,
           "), got ", r);
  return info.hosts[static_cast<std::size_t>(r)];
}

void barrier() { world_group("dp::dist::barrier").barrier("dp::dist::barrier"); }

double all_reduce(double value, Op op) {
  all_reduce(std::span<double>(&value, 1), op);
  return value;
}

std::int64_t all_reduce(std::int64_t value, Op op) {
  all_reduce(std::span<std::int64_t>(&value, 1), op);
  return value;
}

void all_reduce(std::span<double> values, Op op) {
  const auto n = static_cast<std::int64_t>(values.size());
  world_group("dp::dist::all_reduce")
      .all_reduce<double>(values.data(), values.data(), n, reduction_of(op), "dp::dist::all_reduce");
}

void all_reduce(std::span<std::int64_t> values, Op op) {
  const auto n = static_cast<std::int64_t>(values.size());
  // Refused inside the collective so every process throws, not only the one that asked.
  const std::string error =
      op == Op::Mean ? "Op::Mean of int64 values would round; all_reduce a double with "
                       "Op::Mean, or use Op::Sum and divide by world_size()"
                     : "";
  world_group("dp::dist::all_reduce")
      .all_reduce<std::int64_t>(values.data(), values.data(), n, reduction_of(op),
                                "dp::dist::all_reduce", error);
}

namespace detail {

void broadcast_fixed(void* data, std::size_t bytes, int root) {
  // The size stands for the type in the rendezvous: a double broadcast against an int
  // is "processes disagree".
  world_group("dp::dist::broadcast_object")
      .broadcast(data, static_cast<std::int64_t>(bytes), root, "dp::dist::broadcast_object",
                 static_cast<std::int64_t>(bytes));
}

void broadcast_sized(void* data, std::size_t bytes, std::size_t elem_size, int root,
                     const std::function<void*(std::size_t)>& resize) {
  world_group("dp::dist::broadcast_object")
      .broadcast(data, static_cast<std::int64_t>(bytes), root, "dp::dist::broadcast_object",
                 static_cast<std::int64_t>(elem_size), resize);
}

std::unique_ptr<ProcessGroup> new_world_group(const std::string& name) {
  ensure_initialized();
  State& st = state();
  DP_CHECK(!st.finalized.load(), "dp::dist: cannot create ", name, " after dp::dist::finalize()");
  ChannelPtr channel;
  if (st.uses_mpi) {
    channel = open_channel(dp::dist::timeout());
    if (channel == nullptr)
      dp::dist::abort(dp::detail::str_cat("creating ", name, ": the other processes did not take part ",
                              "within the timeout (every process must create it)"),
                      kTimeoutExitCode);
  }
  return std::make_unique<ProcessGroup>(st.info, std::move(channel), name);
}

bool finalized() { return state().finalized.load(std::memory_order_acquire); }

const WorldInfo& world_info() {
  ensure_initialized();
  return state().info;  // written once, before `initialized` is published
}

}  // namespace detail

std::string broadcast_object(std::string value, int root) {
  detail::broadcast_sized(value.data(), value.size(), 1, root, [&value](std::size_t bytes) -> void* {
    value.resize(bytes);
    return value.data();
  });
  return value;
}

namespace {
thread_local const CollectiveScope* t_collective_scope = nullptr;
}  // namespace

CollectiveScope::CollectiveScope(std::string what) : what_(std::move(what)), outer_(t_collective_scope) {
  t_collective_scope = this;
}

CollectiveScope::~CollectiveScope() { t_collective_scope = outer_; }

const std::string& CollectiveScope::current() {
  static const std::string none;
  return t_collective_scope ? t_collective_scope->what_ : none;
}

void set_timeout(std::chrono::milliseconds t) {
  DP_CHECK(t.count() >= 0, "dp::dist::set_timeout: expected a timeout >= 0 (0: none), got ",
           t.count(), " ms");
  timeout_ms().store(t.count(), std::memory_order_relaxed);
}

std::chrono::milliseconds timeout() {
  return std::chrono::milliseconds(timeout_ms().load(std::memory_order_relaxed));
}

void abort(const std::string& reason, int exit_code) {
  // No lock and no init: abort is reached from init, finalize and the wait loop.
  const std::string line = "dp::dist: " + who_am_i() + ": " + reason + "\n";
  std::fflush(stdout);
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  detail::transport_abort(exit_code);
}

void finalize() {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  // Nothing to do when init never ran; MPI still needs finalising when init started it
  // but then failed (thread level).
  if (st.finalized.load() || (!st.initialized.load() && !st.uses_mpi)) return;
  st.finalized.store(true, std::memory_order_release);
  if (st.world != nullptr && st.info.size > 1 && !detail::transport_finalized()) {
    try {
      st.world->finalize_rendezvous("dp::dist::finalize");
    } catch (const std::exception& e) {
      // The processes are out of step: MPI_Finalize would wait for ever.
      dp::dist::abort(e.what());
    }
  }
  st.world.reset();
  if (st.uses_mpi) detail::transport_finalize(st.info.owns_mpi);
  if (st.info.size > 1) std::set_terminate(st.previous_terminate);
}

}  // namespace dp::dist
