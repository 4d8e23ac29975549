// src/comm/nccl_factory.h — the comm layer's one door to the NCCL communicator.
//
// make_communicator reaches NCCL only through this declaration, so the comm layer
// compiles without CUDA headers. It is defined in src/comm/nccl/nccl_world.cpp
// when dp is built with CUDA, and in src/comm/nccl/nccl_stub.cpp (which throws)
// otherwise; src/comm/nccl/meson.build picks one. Internal header.
#pragma once

#include <memory>
#include <vector>

#include "dp/comm/communicator.h"

namespace dp::comm {

/// An NCCL communicator over distinct CUDA devices (rank i = devices[i]). Throws
/// dp::Error when dp was built without NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& options);

}  // namespace dp::comm
