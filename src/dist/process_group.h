// src/dist/process_group.h — deterministic collectives among the processes of a job.
//
// Internal header of dp::dist, used by dist.cpp (host scalars) and by the mpi
// communicator (src/comm/mpi/, CPU tensors). A ProcessGroup is every process of the job
// on a private channel (transport.h); each collective starts with a rendezvous that
// checks every process made the same call (Note [Process collective protocol]), sums in
// rank order (Note [Deterministic process collectives]) and never waits longer than
// dp::dist::timeout() without progress (Note [Fault policy], dist.cpp). It knows nothing
// of tensors or devices: buffers are (pointer, count) pairs of float, double, int64,
// dp::BFloat16 or dp::Float16 (2-byte elements, summed in float32 and rounded once).
//
//   auto group = dp::dist::detail::new_world_group("my communicator");
//   group->all_reduce<float>(grad, grad, n, Reduction::Sum, "all_reduce");  // in place
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/transport.h"

namespace dp::dist::detail {

/// What a collective combines values with (Mean of int64 is refused by callers).
enum class Reduction : std::int32_t { Sum, Mean, Max, Min };

/// The collective calls a rendezvous compares across processes.
enum class Kind : std::int32_t {
  Barrier, Broadcast, AllReduce, Reduce, ReduceScatter, AllGather, Finalize, Custom
};

/// Exit code of a job ended by a timeout (as coreutils' timeout(1)).
constexpr int kTimeoutExitCode = 124;

/// The timeout a DP_DIST_TIMEOUT value asks for (Note [DP_DIST_TIMEOUT] in dist.cpp);
/// 0 for "0" (wait forever). Throws dp::Error naming the value for any other form.
std::chrono::milliseconds parse_timeout_seconds(const std::string& text);

/// The collective kinds a group times (indices of ProcessGroup::Timings).
constexpr int kNumKinds = static_cast<int>(Kind::Custom) + 1;

/// Every process of the job on one private channel (see the file comment). One
/// collective at a time per group: calls from several threads are serialised, but
/// their order must still be the same on every process.
class ProcessGroup {
 public:
  /// `channel` may be null only for a world of one process (no exchange ever happens).
  ProcessGroup(WorldInfo world, ChannelPtr channel, std::string name);

  int rank() const { return world_.rank; }
  int size() const { return world_.size; }
  /// "rank 2 (node07, pid 1234)".
  std::string who(int rank) const;

  /// This group's own limit on a wait without progress, besides dp::dist::timeout():
  /// a wait gives up at the stricter of the two (Note [Communicator timeouts]). 0 (the
  /// default) leaves dp::dist::timeout() alone. `owner` names where the limit was set,
  /// for the timeout's message ("CommOptions::timeout"). Call before any collective.
  void set_timeout(std::chrono::milliseconds timeout, std::string owner);
  /// The limit a wait of this group has now (0: none).
  std::chrono::milliseconds timeout() const;

  /// Note [Process-level timings]
  /// Wall time spent in this group's collectives, per Kind, from the moment a call
  /// holds the group until it returns or throws: the rendezvous (which waits for the
  /// slowest process), the transfers and the folds. bytes is the payload as
  /// nccl-tests counts it (all_reduce, reduce: the buffer; reduce_scatter: send;
  /// all_gather: recv; broadcast: root's bytes). Thread-safe; read while a collective
  /// runs, it leaves that one out.
  struct Timing {
    double ms = 0;
    std::int64_t calls = 0;
    std::int64_t bytes = 0;
  };
  using Timings = std::array<Timing, kNumKinds>;
  Timings timings() const;
  void reset_timings();

  /// Returns once every process has called it.
  void barrier(const char* what);
  /// The last rendezvous before MPI_Finalize: a process that exits while the others
  /// are still in collectives makes them all fail with a message saying so. It waits
  /// without a timeout: a process may legitimately finish long after the others
  /// (rank 0 writing the final checkpoint), and one that is stuck in another
  /// collective times out there and ends the job.
  void finalize_rendezvous(const char* what);

  /// recv[i] = send[i] of rank 0 ⊕ rank 1 ⊕ ... in rank order, on every process. recv
  /// may equal send. `error`, when not empty, says this process's arguments are bad:
  /// every process then throws dp::Error naming it (no data moves).
  template <typename T>
  void all_reduce(const T* send, T* recv, std::int64_t count, Reduction op, const char* what,
                  const std::string& error = {});
  /// As all_reduce, but only `root` receives (recv is ignored elsewhere).
  template <typename T>
  void reduce(const T* send, T* recv, std::int64_t count, int root, Reduction op,
              const char* what, const std::string& error = {});
  /// recv (recv_count values) on rank r = reduction of block r of every rank's send
  /// (size() * recv_count values).
  template <typename T>
  void reduce_scatter(const T* send, T* recv, std::int64_t recv_count, Reduction op,
                      const char* what, const std::string& error = {});
  /// recv block r (count values) = rank r's send, on every process. send may be recv's
  /// own block; any other overlap is the caller's to refuse.
  template <typename T>
  void all_gather(const T* send, T* recv, std::int64_t count, const char* what,
                  const std::string& error = {});

  /// Root's `bytes` bytes at `data` replace every process's. Fixed size (`resize`
  /// empty): every process passes the same `bytes` (checked). Sized: processes other
  /// than root pass any `bytes`, and `resize(root's bytes)` returns where to write them.
  /// `elem_size` must agree on every process (it stands for the element type).
  void broadcast(void* data, std::int64_t bytes, int root, const char* what,
                 std::int64_t elem_size = 1,
                 const std::function<void*(std::size_t)>& resize = {},
                 const std::string& error = {});

  /// The fixed-size record every process sends at the start of a collective.
  struct Header {
    std::int64_t seq = 0;    // collectives this process made on this group before
    std::int64_t count = 0;  // elements (bytes for broadcast); -1: "whatever root has"
    std::int64_t aux = 0;    // broadcast: element size
    std::int32_t kind = 0;
    std::int32_t elem = 0;   // element type (an Elem)
    std::int32_t op = 0;
    std::int32_t root = 0;
    std::int32_t failed = 0;
    std::int32_t reserved = 0;
    char error[208] = {};    // why this process's arguments are bad (truncated)
    char context[160] = {};  // the caller's CollectiveScope, if any (truncated)
  };

 private:
  /// Sends `mine` to every process, receives theirs, and throws dp::Error on every
  /// process alike when one failed or they disagree. Returns every process's header.
  /// `bounded` false waits without dp::dist::timeout() (the exit-time rendezvous).
  std::vector<Header> rendezvous(Header mine, const char* what, bool bounded = true);
  /// One data phase: posts the transfers and waits; ends the job on a timeout or an
  /// MPI error (Note [Fault policy]).
  void run(int tag, const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs,
           const char* what, std::int64_t seq, bool bounded = true);
  /// A scratch buffer of at least `bytes` bytes, 8-byte aligned, reused across calls.
  void* scratch(std::size_t bytes);
  void check_usable(const char* what) const;

  /// Adds one call of `kind` that started at `start` to the timings.
  void record(Kind kind, std::chrono::steady_clock::time_point start, std::int64_t bytes);

  template <typename T>
  void reduce_impl(Kind kind, const T* send, T* recv, std::int64_t count, int root,
                   Reduction op, const char* what, const std::string& error);

  WorldInfo world_;
  ChannelPtr channel_;
  std::string name_;
  std::mutex mu_;  // one collective at a time (guards seq_ and scratch_)
  std::int64_t seq_ = 0;
  std::vector<double> scratch_;
  std::chrono::milliseconds own_timeout_{0};
  std::string timeout_owner_;
  mutable std::mutex timing_mu_;  // guards timings_ (taken briefly, never around a wait)
  Timings timings_{};
};

/// A new group of every process on its own channel (collective: every process must
/// call it, in the same order as its other collectives). Calls dp::dist::init().
std::unique_ptr<ProcessGroup> new_world_group(const std::string& name);

/// True once dp::dist::finalize() has run (collectives are refused from then on).
bool finalized();

/// The job's facts as the transport found them at init: ranks, nodes, and the thread
/// level MPI provides (Note [Thread level]). Calls dp::dist::init().
const WorldInfo& world_info();

}  // namespace dp::dist::detail
