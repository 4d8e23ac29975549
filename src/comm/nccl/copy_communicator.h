// src/comm/nccl/copy_communicator.h — the CUDA copy communicator: collectives among dp
// CUDA devices that share GPUs (DP_CUDA_DEVICES_PER_GPU > 1), where NCCL cannot go.
//
// Internal to the comm layer; declared without CUDA types so that the factory in
// nccl_world.cpp reaches it through one function. make_communicator picks it
// for a CUDA device list in which two devices share a GPU (Note [CUDA copy
// communicator], copy_communicator.cpp).
#pragma once

#include <memory>
#include <vector>

#include "dp/comm/communicator.h"

namespace dp::comm {

/// A communicator over `devices` (distinct, valid CUDA devices, checked by the caller)
/// made of device-to-device copies and a sum kernel in a fixed order. Throws dp::Error
/// when the devices span GPUs that cannot access each other's memory.
std::unique_ptr<Communicator> make_copy_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& options);

}  // namespace dp::comm
