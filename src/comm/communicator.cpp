// make_communicator: picks the local or the NCCL communicator for a device list.
#include "dp/comm/communicator.h"

#include <sstream>
#include <unordered_set>

#include "comm/nccl_factory.h"
#include "dp/core/error.h"

namespace dp::comm {
namespace {

std::string list_str(const std::vector<Device>& devices) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < devices.size(); ++i) os << (i ? ", " : "") << devices[i];
  os << ']';
  return os.str();
}

}  // namespace

void Communicator::throw_aborted(const char* what, int rank, const std::string& reason) const {
  throw CollectiveAborted(
      dp::detail::str_cat(what, " on rank ", rank, " (", devices_[static_cast<std::size_t>(rank)],
                          ") of the ", backend_name(), " communicator: collective aborted: ",
                          reason, " (call reset() once every rank has left the collective)"),
      reason);
}

std::unique_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                const CommOptions& options) {
  DP_CHECK(!devices.empty(),
           "make_communicator: expected at least one device, got an empty list");
  DP_CHECK(options.timeout.count() > 0, "make_communicator: expected a positive timeout, got ",
           options.timeout.count(), " ms");
  std::unordered_set<Device> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.type == devices[0].type, "make_communicator: expected devices of one type, got ",
             list_str(devices), " (mixed CPU and CUDA); a communicator connects either CPU ",
             "virtual devices or CUDA devices");
    DP_CHECK(seen.insert(d).second, "make_communicator: device ", d, " appears twice in ",
             list_str(devices), "; each rank needs its own device");
  }
  if (devices[0].is_cuda()) return make_nccl_communicator(devices, options);
  return make_local_communicator(devices);
}

}  // namespace dp::comm
