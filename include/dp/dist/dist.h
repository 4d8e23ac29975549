// dp/dist/dist.h — the processes of a multi-process job: who am I, how many are we, and
// small host-side collectives among the processes.
//
// One process per node owns that node's devices (docs/multi-node.md); Open MPI's mpirun
// (or srun) starts the processes. dp::dist initialises MPI on first use when the
// process was started by such a launcher, and finalises it at exit. Started any other
// way, or built without MPI, the world is this one process: world_size() == 1,
// rank() == 0 and every collective returns its input. Every collective is deterministic
// (Note [Deterministic process collectives], src/dist/process_group.cpp) and bounded by
// timeout() (Note [Fault policy], src/dist/dist.cpp). This header knows nothing of
// tensors, devices or MPI's own types.
//
//   if (dp::dist::is_main()) std::cout << dp::dist::world_size() << " processes\n";
//   double loss = dp::dist::all_reduce(local_loss, dp::dist::Op::Mean);
//   std::uint64_t seed = dp::dist::broadcast_object(local_seed, /*root=*/0);
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace dp::dist {

/// How all_reduce combines the processes' values.
enum class Op { Sum, Mean, Max, Min };

/// Starts the process group. Under a launcher (mpirun, srun: detected from
/// OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK) it calls MPI_Init_thread asking for
/// MPI_THREAD_MULTIPLE (Note [Thread level], src/dist/dist.cpp) unless the program
/// initialised MPI itself; otherwise, or without MPI support, the world is this process.
/// Idempotent and thread-safe; every function below calls it on first use. Throws
/// dp::Error when MPI provides less than MPI_THREAD_SERIALIZED, or after finalize().
void init();
/// True once init() has run (explicitly or on first use).
bool is_initialized();
/// True when dp was built with MPI (meson -Dmpi); says nothing about how it was started.
bool built_with_mpi();
/// True when this process is one of several processes joined by MPI: world_size() > 1.
bool is_distributed();

/// This process's rank in [0, world_size()).
int rank();
/// Number of processes in the job (1 when not launched by mpirun/srun).
int world_size();
/// Rank among the processes sharing this node (MPI_COMM_TYPE_SHARED).
int local_rank();
/// Number of processes sharing this node.
int local_size();
/// rank() == 0: the process that prints, writes checkpoints and downloads data.
bool is_main();
/// The node name of a rank (MPI_Get_processor_name) — for messages and logs.
std::string host_name(int rank);

/// Returns once every process has called it.
void barrier();

/// The combination of every process's value, the same bits on every process: Sum and
/// Mean add in rank order 0, 1, ..., world_size() - 1 (Mean then divides by
/// world_size()); Max and Min propagate NaN. All processes must pass the same op.
double all_reduce(double value, Op op = Op::Sum);
/// Integer version: Sum, Max, Min. Mean throws dp::Error (it would round; reduce a
/// double instead). Sum wraps around on overflow like unsigned arithmetic.
std::int64_t all_reduce(std::int64_t value, Op op = Op::Sum);
/// Other integer types go through the int64 version.
template <std::integral T>
  requires(!std::same_as<T, std::int64_t> && !std::same_as<T, bool>)
T all_reduce(T value, Op op = Op::Sum) {
  return static_cast<T>(all_reduce(static_cast<std::int64_t>(value), op));
}
/// Element-wise, in place; every process must pass the same number of values
/// (checked: dp::Error on every process otherwise).
void all_reduce(std::span<double> values, Op op = Op::Sum);
/// Element-wise integer version, in place (see the scalar one).
void all_reduce(std::span<std::int64_t> values, Op op = Op::Sum);

namespace detail {
/// Root's `bytes` bytes replace every process's; all must pass the same size (checked).
void broadcast_fixed(void* data, std::size_t bytes, int root);
/// Root's `bytes` bytes (a whole number of `elem_size` elements) replace every
/// process's: on the others `resize(root_bytes)` is called and returns where to write.
void broadcast_sized(void* data, std::size_t bytes, std::size_t elem_size, int root,
                     const std::function<void*(std::size_t)>& resize);
}  // namespace detail

/// Root's value, on every process (a trivially copyable value: a number, a POD struct).
template <typename T>
  requires std::is_trivially_copyable_v<T>
T broadcast_object(T value, int root = 0) {
  detail::broadcast_fixed(&value, sizeof(T), root);
  return value;
}
/// Root's string, on every process (the others' may have any length).
std::string broadcast_object(std::string value, int root = 0);
/// Root's vector, on every process (the others' may have any length).
template <typename T>
  requires std::is_trivially_copyable_v<T>
std::vector<T> broadcast_object(std::vector<T> value, int root = 0) {
  detail::broadcast_sized(value.data(), value.size() * sizeof(T), sizeof(T), root,
                          [&value](std::size_t bytes) -> void* {
                            value.resize(bytes / sizeof(T));
                            return value.data();
                          });
  return value;
}

/// Names what the calling thread is doing while it makes process collectives, for
/// their error messages: a collective that times out or finds the processes at odds
/// says "inside <what>" on this process, and the others' messages say what this
/// process was inside. For a call that is collective without looking it, e.g. a
/// checkpoint save that gathers every process's optimizer shards. Thread-local,
/// nestable (the innermost names the call); does not start the process group.
///
///   dp::dist::CollectiveScope scope("save_training_checkpoint (collective: …)");
class CollectiveScope {
 public:
  explicit CollectiveScope(std::string what);
  ~CollectiveScope();
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;
  /// The innermost scope's text on this thread; "" outside any scope.
  static const std::string& current();

 private:
  std::string what_;
  const CollectiveScope* outer_;
};

/// How long a process waits in a collective for the others before it prints which
/// ranks are missing and ends the job (Note [Fault policy]). 0 waits forever. Default:
/// DP_DIST_TIMEOUT or 600 s, PyTorch's NCCL default. DP_DIST_TIMEOUT is a number of
/// seconds: digits with an optional fraction ("600", "0.5"), from 0.001 to 1e9, or 0
/// to wait forever; any other value ("10s", "-5", "1e3", "abc") is a dp::Error at the
/// first use of dp::dist, and an empty one counts as unset. Raise
/// it when one rank legitimately works alone for long (e.g. writes a large checkpoint)
/// while the others wait in a collective.
void set_timeout(std::chrono::milliseconds timeout);
/// The current timeout (0: none).
std::chrono::milliseconds timeout();

/// Prints "dp::dist: rank R (host): reason" on stderr and ends the whole job
/// (MPI_Abort(exit_code)); a single process just exits with exit_code. Never returns.
[[noreturn]] void abort(const std::string& reason, int exit_code = 1);

/// Leaves the process group: a last rendezvous of every process (not bounded by
/// timeout(): a process may finish long after the others), then MPI_Finalize when dp
/// initialised MPI. Optional — it runs at exit otherwise.
/// Idempotent; safe when init() never ran. Collectives afterwards throw dp::Error.
void finalize();

}  // namespace dp::dist
