// src/comm/world_factory.h — the comm layer's doors to communicators spanning processes.
//
// make_world_communicator (communicator.cpp) checks what every process passed, then
// reaches one of these: the hierarchical CPU communicator (src/comm/hier/) or the NCCL
// communicator over every GPU of the job (src/comm/nccl/; its stub throws in builds
// without CUDA). Both are collective over the processes of dp::dist and are called only
// when the job has more than one process. Internal header.
#pragma once

#include <memory>
#include <vector>

#include "dp/comm/communicator.h"

namespace dp::comm {

/// CPU devices of this process (the same count on every process, checked by the
/// caller): the local communicator among them, and one mpi-level group per local rank
/// between processes (Note [Hierarchical collectives]).
std::unique_ptr<Communicator> make_hierarchical_communicator(const std::vector<Device>& devices,
                                                             const CommOptions& options);

/// CUDA devices of this process (the same count on every process): one NCCL
/// communicator over every device of the job, world rank = process * local devices +
/// local index (the unique id made on process 0 and broadcast by dp::dist), with
/// local() and peers(j) split from it at construction (Note [NCCL across processes],
/// src/comm/nccl/nccl_world.cpp). Bad devices (not CUDA, out of range,
/// duplicated) or a failed initialisation throw dp::Error on every process. Any abort
/// of it ends the job (Note [NCCL failures]).
std::unique_ptr<Communicator> make_nccl_world_communicator(const std::vector<Device>& devices,
                                                           const CommOptions& options);

}  // namespace dp::comm
