// src/comm/mpi/mpi_communicator.h — the communicator among the processes of a job.
//
// Internal header of the comm layer (users reach it through make_mpi_communicator,
// dp/comm/mpi_communicator.h). One rank per process; each collective checks its
// tensors, then hands (pointer, count) buffers to a dp::dist process group on a
// channel of its own, which does the rendezvous, the rank-order reduction and the
// timeout (src/dist/process_group.h). This header knows nothing of MPI's types, of
// modules, optimizers or DataParallel.
//
//   dp::comm::MpiCommunicator comm(dp::cpu(0));          // on every process
//   comm.all_reduce(comm.process_rank(), g, g, dp::comm::ReduceOp::Sum);
#pragma once

#include <memory>
#include <string>
#include <vector>

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

  void all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void broadcast(int rank, const Tensor& data, int root) override;
  void reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override;
  void reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void all_gather(int rank, const Tensor& send, const Tensor& recv) override;
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

 private:
  struct Setup;
  /// Opens the group and learns every process's device (collective).
  static Setup open(Device device);
  explicit MpiCommunicator(Setup setup);
  /// "" when rank is this process's rank and t is a float32 tensor on this process's
  /// device; else what is wrong and how to fix it.
  std::string problem(int rank, const Tensor& t, const char* name) const;

  std::unique_ptr<dist::detail::ProcessGroup> group_;
};

/// A process group's timings as a communicator reports them (Note [Inter-process
/// time]): barriers and the exit-time rendezvous are left out.
Communicator::ProcessTimes process_times_of(const dist::detail::ProcessGroup& group);

}  // namespace dp::comm
