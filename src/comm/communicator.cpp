// make_communicator: picks the local or the NCCL communicator for a device list.
#include "dp/comm/communicator.h"

#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <unordered_set>

#include "comm/nccl_factory.h"
#include "comm/world_factory.h"
#include "dp/dist/dist.h"
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

CollectiveGroup::~CollectiveGroup() {
  if (comm_ == nullptr) return;
  try {  // a failure path: the group must still close (Note [Grouped collectives])
    comm_->group_end(rank_);
  } catch (const std::exception& e) {  // destructors never throw
    detail::log_warning(detail::str_cat("group_end on rank ", rank_, " while unwinding: ", e.what()));
  }
}

const char* Communicator::collective_name(Collective c) {
  switch (c) {
    case Collective::AllReduce: return "all_reduce";
    case Collective::Broadcast: return "broadcast";
    case Collective::Reduce: return "reduce";
    case Collective::ReduceScatter: return "reduce_scatter";
    case Collective::AllGather: return "all_gather";
    case Collective::kCount: break;
  }
  return "?";
}

static void make_communicator_checks(const std::vector<Device>& devices, const CommOptions& options) {
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
}

std::unique_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                const CommOptions& options) {
  make_communicator_checks(devices, options);
  if (devices[0].is_cuda()) return make_nccl_communicator(devices, options);
  return make_local_communicator(devices);
}

std::unique_ptr<Communicator> make_world_communicator(const std::vector<Device>& devices,
                                                      const CommOptions& options) {
  if (!dist::is_distributed()) return make_communicator(devices, options);
  // Every process learns what the others passed before anything is built, so a bad
  // list fails on every process alike instead of leaving the others waiting.
  std::string mine;
  try {
    make_communicator_checks(devices, options);
  } catch (const Error& e) {
    mine = e.what();
  }
  const std::int64_t count = static_cast<std::int64_t>(devices.size());
  const std::int64_t type = devices.empty() ? -1 : static_cast<std::int64_t>(devices[0].type);
  std::int64_t facts[] = {count, -count, type, -type, mine.empty() ? 0 : 1};
  dist::all_reduce(std::span<std::int64_t>(facts), dist::Op::Max);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(facts[4] == 0, "make_world_communicator: another process of the job passed a bad device list "
           "(its own error says which); this process (rank ", dist::rank(), ") passed ", list_str(devices));
  DP_CHECK(facts[0] == -facts[1], "make_world_communicator: every process must use the same number of devices "
           "(world rank = process * local devices + local index), but the processes passed between ", -facts[1],
           " and ", facts[0], " (this process, rank ", dist::rank(), ": ", count, ")");
  DP_CHECK(facts[2] == -facts[3], "make_world_communicator: every process must use devices of one type, but "
           "some passed CPU devices and others CUDA devices (this process, rank ", dist::rank(), ": ",
           list_str(devices), ")");
  if (devices[0].is_cuda()) return make_nccl_world_communicator(devices, options);
  return make_hierarchical_communicator(devices, options);
}

}  // namespace dp::comm
