// The hierarchical communicator (see src/comm/world_factory.h).
#include "comm/world_factory.h"

#include "dp/core/error.h"

namespace dp::comm {

std::unique_ptr<Communicator> make_hierarchical_communicator(const std::vector<Device>& devices,
                                                             const CommOptions& /*options*/) {
  DP_FAIL("make_world_communicator: a communicator over the CPU devices of several processes is not "
          "available yet (", devices.size(), " device(s) per process)");
}

}  // namespace dp::comm
