// dp/comm/mpi_communicator.h — a communicator whose ranks are the processes of a job.
//
// The mpi communicator connects every process started by mpirun (or srun), one rank
// per process: rank = dp::dist::rank(), size() = dp::dist::world_size(), devices()[r] =
// the CPU device process r named. It moves CPU tensors with the collectives of
// dp/comm/communicator.h (every dtype for broadcast, float32 and int64 for all_gather,
// float32, bfloat16 and float16 for the reductions — the 16-bit ones move 2 bytes an
// element and are summed in float32, rounded once: Note [Collective dtypes]); each process calls them from
// one thread at a time with its own rank. Sums run in rank order, so results are bitwise identical on every process
// and from run to run for a fixed process count (Note [Deterministic process
// collectives]). abort() ends the whole job (Note [Fault policy], src/dist/dist.cpp).
// Not launched by mpirun, or built without MPI, it is a communicator of one rank whose
// collectives copy their input. This header knows nothing of MPI's types.
//
//   auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));  // on every process
//   comm->all_reduce(dp::dist::rank(), grad, grad, dp::comm::ReduceOp::Average);
#pragma once

#include <memory>

#include "dp/comm/communicator.h"

namespace dp::comm {

/// The process-level communicator over `device` (a CPU device) of this process.
/// Collective: every process must create it, in the same order as its other
/// collectives. Throws dp::Error on every process when one passes a non-CPU device.
std::unique_ptr<Communicator> make_mpi_communicator(Device device);

}  // namespace dp::comm
