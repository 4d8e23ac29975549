// src/comm/mpi/mpi_communicator.h — the communicator among the processes of a job.
//
// Internal header of the comm layer (users reach it through make_mpi_communicator,
// dp/comm/mpi_communicator.h). One rank per process; each collective, its arguments
// checked by Communicator's front (Note [Checked collectives]), hands (pointer, count)
// buffers to a dp::dist process group on a channel of its own, which does the
// rendezvous, the rank-order reduction and the timeout (src/dist/process_group.h).
// This header knows nothing of MPI's types, of modules, optimizers or DataParallel.
//
//   dp::comm::MpiCommunicator comm(dp::cpu(0));          // on every process
//   comm.all_reduce(comm.process_rank(), g, g, dp::comm::ReduceOp::Sum);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/summation.h"
#include "dp/comm/communicator.h"

namespace dp::dist::detail {
class ProcessGroup;
}

namespace dp::comm {

/// The process-level communicator (see the file comment).
class MpiCommunicator final : public Communicator {
 public:
  /// Collective over every process; `device` must be a CPU device (checked on every
  /// process: dp::Error on all when one is not).
  explicit MpiCommunicator(Device device);
  ~MpiCommunicator() override;

  std::string backend_name() const override { return "mpi"; }
  /// This process's rank (dp::dist::rank()): the `rank` argument of every collective.
  int process_rank() const;
  /// Broadcast: every dtype; all_gather and the reductions: the dtypes a process group
  /// carries (process_level_supports).
  bool supports(Collective kind, Dtype dtype) const override;

  /// No-op: every collective has finished when it returns.
  void synchronize(int rank) override;
  /// Ends the whole job (MPI_Abort) after printing `reason`: MPI cannot release the
  /// other processes from a collective (Note [Fault policy]). Never returns.
  void abort(const std::string& reason) override;
  /// No-op: a communicator that was not aborted is always usable.
  void reset() override;
  /// Time in this communicator's collectives (Note [Inter-process time]); `rank` is
  /// this process's rank.
  ProcessTimes process_times(int rank) const override;
  void reset_process_times() override;

  /// The process group underneath. The hierarchical communicator moves its slices
  /// through it directly, handing over its own checks' verdict so that every process
  /// fails alike (Note [Hierarchical collectives], src/comm/hier/).
  dist::detail::ProcessGroup& group() { return *group_; }

 protected:
  void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_broadcast(int rank, const Tensor& data, int root) override;
  void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override;
  void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_all_gather(int rank, const Tensor& send, const Tensor& recv) override;
  /// Makes the group's call carry the problem: every process throws dp::Error naming
  /// it (a bad rank too: this process's one rank is known).
  void refuse(int rank, Collective kind, const std::string& problem) override;

 private:
  struct Setup;
  /// Opens the group and learns every process's device (collective).
  static Setup open(Device device);
  explicit MpiCommunicator(Setup setup);

  std::unique_ptr<dist::detail::ProcessGroup> group_;
};

/// Calls f.template operator()<T>() with T the element type a process group carries
/// `dtype` as (float32: float, int64: std::int64_t, bfloat16 and float16: their 2-byte
/// storage types, moved as they are) and returns true; false when no process-group type
/// carries it (int32: all_gather refuses it rather than mix it up with float32 between
/// processes): int64 here, the floating ones as with_summand. A new dtype is a case in
/// one of the two and an instantiation in
/// src/dist/process_group.cpp (Note [Collective dtypes]).
template <typename F>
bool with_process_type(Dtype dtype, F&& f) {
  if (dtype != Dtype::Int64) return with_summand(dtype, f);  // the summable floating dtypes
  f.template operator()<std::int64_t>();
  return true;
}

/// Calls f.template operator()<T>() with T the element type a process group adds
/// `dtype` as and returns true; false for dtypes no reduction takes. Every summable
/// dtype (summation.h): float32, and bfloat16 and float16 — gradients on the wire
/// (Note [Gradients on the wire] in src/parallel/grad_wire.h) cross processes as 2-byte
/// elements, summed in float32 in rank order and rounded once (Note [Deterministic
/// process collectives]), as the local communicator adds them; all_gather moves them
/// as they are (with_process_type).
template <typename F>
bool with_process_summand(Dtype dtype, F&& f) {
  return with_summand(dtype, std::forward<F>(f));
}

/// What crosses processes through a process group: broadcast moves bytes (any dtype),
/// all_gather the process-group types, reductions those that are also summable. The
/// mpi and hierarchical communicators' supports().
bool process_level_supports(Communicator::Collective kind, Dtype dtype);

/// Makes `group` call `kind` carrying `problem` ("what" names the call): every process
/// throws dp::Error naming it; no data moves. Never returns.
[[noreturn]] void refuse_on_group(dist::detail::ProcessGroup& group, Communicator::Collective kind,
                                  const char* what, const std::string& problem);

/// A process group's timings as a communicator reports them (Note [Inter-process
/// time]): barriers and the exit-time rendezvous are left out.
Communicator::ProcessTimes process_times_of(const dist::detail::ProcessGroup& group);

}  // namespace dp::comm
