// src/comm/hier/hierarchical_communicator.h — collectives over the CPU virtual devices
// of every process of a job: shared memory within a process, dp::dist between processes.
//
// Internal header of the comm layer (users reach it through make_world_communicator).
// Each of the P processes owns L devices; world rank p * L + j is local rank j of
// process p (Note [World ranks]). Every collective runs on two levels (Note
// [Hierarchical collectives], hierarchical_communicator.cpp): the local communicator
// among this process's L devices (`local()`), and one process-level communicator per
// local index j (`peers(j)`: local rank j of every process), so the L slices of a
// buffer cross processes in parallel, each on its own rank's thread. Every reduction
// adds over the local devices in local-rank order first, then over the processes in
// process order: results are bitwise the same on every rank, from run to run, and
// between all_reduce, reduce and reduce_scatter. This header knows nothing of MPI's
// types, of modules, optimizers or DataParallel.
//
//   auto comm = dp::comm::make_world_communicator({dp::cpu(0), dp::cpu(1)});  // every process
//   // on local rank j's thread (world rank comm->first_rank() + j):
//   comm->all_reduce(j, grad, grad, dp::comm::ReduceOp::Average);
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/argument_checks.h"
#include "comm/local/local_communicator.h"
#include "dp/comm/communicator.h"

namespace dp::dist::detail {
class ProcessGroup;
}

namespace dp::comm {

class MpiCommunicator;

/// The two-level communicator over the processes of a job (see the file comment).
class HierarchicalCommunicator final : public Communicator {
 public:
  /// Collective over every process of dp::dist: `devices` are this process's distinct
  /// CPU virtual devices, the same number on every process. Throws dp::Error on every
  /// process when one process's devices are bad, or when L > 1 and MPI does not provide
  /// MPI_THREAD_MULTIPLE (the L ranks cross processes concurrently).
  /// `timeout` (0: none) bounds the waits between processes together with
  /// dp::dist::timeout(), the stricter winning (Note [Communicator timeouts]).
  HierarchicalCommunicator(const std::vector<Device>& devices, std::chrono::milliseconds timeout);
  ~HierarchicalCommunicator() override;

  std::string backend_name() const override { return "hierarchical"; }
  /// The local communicator among this process's devices.
  Communicator& local() override { return *local_; }
  /// The mpi communicator of local index `rank` (local rank `rank` of every process,
  /// ranked by process). Throws dp::Error for a rank out of range.
  Communicator* peers(int rank) override;

  /// Broadcast: every dtype; all_gather and the reductions: what crosses processes
  /// (process_level_supports, src/comm/mpi/mpi_communicator.h).
  bool supports(Collective kind, Dtype dtype) const override;
  /// Waits for nothing: every collective has finished when it returns.
  void synchronize(int rank) override;
  /// Releases the local ranks (the local communicator's abort), then ends the whole
  /// job naming `reason` (Note [Fault policy]): a process blocked in another process's
  /// collective cannot be released. Never returns.
  void abort(const std::string& reason) override;
  /// Resets the local communicator (a job whose communicator was aborted has ended).
  void reset() override;
  /// Local rank `rank`'s process-level steps (Note [Inter-process time]).
  ProcessTimes process_times(int rank) const override;
  void reset_process_times() override;

  /// What one local rank publishes for a collective (public only for the .cpp's helpers).
  using Kind = Collective;
  struct Slot {
    CallShape call;          // count: all_reduce/reduce/broadcast: elements; RS: recv; AG: send
    const std::byte* send = nullptr;
    std::byte* recv = nullptr;   // broadcast: data
    std::string error;       // why this rank's arguments are bad ("" when they are fine)
  };

 protected:
  /// `rank` is the local rank; roots and blocks are world ranks (Note [World ranks]).
  /// Bad arguments on any rank of any process: dp::Error on every rank of every process
  /// (except a `rank` out of range, which throws on the calling thread alone: it has no
  /// slot to report through). recv's contents are unspecified after an error.
  void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_broadcast(int rank, const Tensor& data, int root) override;
  void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override;
  void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_all_gather(int rank, const Tensor& send, const Tensor& recv) override;
  /// Publishes the problem in agree: every rank of every process throws naming it.
  void refuse(int rank, Collective kind, const std::string& problem) override;

 private:
  /// Publishes `slot`, meets the other local ranks and checks that all called the same
  /// collective with valid arguments. Returns every local rank's slot; otherwise every
  /// local rank hands the problem to its process-level group (so every process throws
  /// too) and throws dp::Error.
  std::vector<Slot> agree(int rank, Slot slot, const char* what);
  /// Runs rank's process-level step `step`, then meets the other local ranks: when the
  /// step threw on any of them, every local rank throws (the failed one its own
  /// exception), so none goes on into a local phase the others will not join.
  template <typename Step>
  void between_processes(int rank, const char* what, Step&& step);
  /// The data paths, for storage type T (Note [Collective dtypes]).
  template <typename T>
  void all_reduce_as(int rank, const std::vector<Slot>& slots, ReduceOp op, const char* what);
  template <typename T>
  void reduce_as(int rank, const std::vector<Slot>& slots, const Tensor& send, ReduceOp op, const char* what);
  template <typename T>
  void reduce_scatter_as(int rank, const Slot& me, ReduceOp op, const char* what);
  template <typename T>
  void all_gather_as(int rank, const Slot& me, const char* what);
  /// Meets the other local ranks; throws dp::CollectiveAborted when aborted.
  void sync(int rank, const char* what);
  /// Rank's scratch of at least `bytes` bytes (only rank's thread touches it between calls).
  std::byte* scratch(int rank, std::size_t bytes) { return scratch_[static_cast<std::size_t>(rank)].reserve(bytes); }
  dist::detail::ProcessGroup& group(int rank);

  const int processes_;     // P
  const int process_rank_;  // p
  std::unique_ptr<Communicator> local_;
  std::vector<std::unique_ptr<MpiCommunicator>> peers_;  // one per local index
  detail::Barrier barrier_;       // the local ranks' own rendezvous (agree, settle)
  std::vector<Slot> slots_;       // per local rank, read after agree's barrier
  std::vector<std::string> outcomes_;  // per local rank: its process-level step's error
  std::vector<detail::ScratchBuffer> scratch_;  // per local rank
};

}  // namespace dp::comm
