// make_nccl_communicator for builds without the CUDA toolkit (see nccl_factory.h).
#include "comm/nccl_factory.h"
#include "comm/world_factory.h"

#include "dp/core/error.h"

namespace dp::comm {

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& /*options*/) {
  DP_FAIL("make_communicator: dp was built without NCCL, so a communicator over ",
          devices.size(), " CUDA device(s) cannot be made; rebuild with the CUDA toolkit ",
          "(meson setup -Dcuda=enabled) or use CPU virtual devices (dp::cpu(i))");
}

std::unique_ptr<Communicator> make_nccl_world_communicator(const std::vector<Device>& devices,
                                                           const CommOptions& /*options*/) {
  DP_FAIL("make_world_communicator: dp was built without NCCL, so ", devices.size(), " CUDA device(s) per ",
          "process cannot be joined across processes; rebuild with the CUDA toolkit (meson setup ",
          "-Dcuda=enabled) or use CPU virtual devices (dp::cpu(i))");
}

}  // namespace dp::comm
