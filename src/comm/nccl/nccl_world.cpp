// Making NCCL communicators: over this process's devices (make_nccl_communicator) and
// over every GPU of a job (make_nccl_world_communicator), the latter step by step,
// every step agreed on by every process.
#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "comm/nccl/copy_communicator.h"
#include "comm/nccl/nccl_bootstrap.h"
#include "comm/nccl/nccl_communicator.h"
#include "comm/nccl_factory.h"
#include "comm/world_factory.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"

namespace dp::comm {

// Note [NCCL across processes]
// make_world_communicator over CUDA devices (one process per node, L GPUs each, P
// processes): ONE NCCL communicator over the P * L GPUs, world rank = process * L +
// local index, built like the single-process one (ncclCommInitRankConfig of every
// local rank inside one group) from a unique id made on process 0 and broadcast with
// dp::dist. Collectives keep NCCL's own semantics, which are Note [World ranks]'s:
// roots are world ranks, reduce_scatter/all_gather blocks are world-rank blocks, a sum
// covers every GPU of the job.
// local() (this process's GPUs; color = process rank, key = local index) and peers(j)
// (local index j of every process; color = j, key = process rank, so its NCCL rank is
// the process rank and its `rank` argument is dp::dist::rank(), like the mpi
// communicator's) are split from the world communicators with ncclCommSplit — once,
// at construction, grouped per split, polled like the initialisation. A split is a
// collective of every rank of the job; made lazily it would be a job-wide rendezvous
// inside whichever step first asked for it, hanging (until the timeout) when one
// process's code path differs. At construction it fails, or succeeds, with the rest of
// make_world_communicator. The price, two more communicators per GPU, is mostly
// bootstrap state: with NCCL's runtime connection (the default since 2.22) a
// communicator allocates its channel buffers only for the peers and algorithms it
// actually uses, so unused splits cost little memory. splitShare stays off: a child
// sharing its parent's resources may not be used concurrently with it, and would tie
// their failures together in ways NCCL documents per version.
// Which communicator the DDP all-reduce uses — the decision: the world communicator,
// one ncclAllReduce per bucket, not a hand-made hierarchy (local reduce-scatter,
// inter-process all-reduce of each slice over peers(j), local all-gather). Reasons
// from NCCL's documented behaviour: within one communicator NCCL already detects the
// topology (NVLink/NVSwitch inside a node, which NIC is close to which GPU across
// nodes) and builds hierarchical rings and trees over it — inter-node traffic goes
// over the NICs once per ring step while intra-node steps use NVLink, the tree
// algorithm gives logarithmic latency across nodes, and NVLS/CollNet (SHARP) apply
// where the fabric has them; NCCL pipelines these phases in one kernel, where a
// hand-made hierarchy serialises three collectives (three launches and three
// synchronisation points per bucket, ruinous for the small first bucket) and cannot
// use NVLS or the tree. Horovod's hierarchical all-reduce predates NCCL's trees
// (2.4). The bytes crossing the network are the same in both (2 (N-1)/N of the bucket
// per GPU for the ring). local() and peers(j) remain for strategies that need the two
// levels apart (e.g. sharding within a node only, or the CPU design's symmetry).
// What must be measured on a real cluster (2+ nodes, 8 GPUs each, InfiniBand or
// RoCE): all_reduce busbw of the world communicator against the three-phase path over
// local()/peers(j), for bucket sizes 64 KiB (the first bucket) to 25 MiB and beyond
// (bench/collectives_bench, nccl-tests' all_reduce_perf), with NCCL_ALGO=Ring and Tree
// forced and free; the DDP step's exposed communication (take_times) both ways;
// NCCL_DEBUG=INFO to confirm the topology NCCL saw (GPUDirect RDMA, NIC affinity);
// the memory and init time that the two split communicators per GPU cost at scale.
// If the hierarchy ever wins, it is a reducer strategy over local()/peers(j), and
// nothing here changes.

namespace nccl {
namespace {

/// Throws dp::Error unless `devices` are distinct CUDA devices visible to this process.
void check_nccl_devices(const std::vector<Device>& devices, const char* who) {
  const int available = cuda().device_count();
  DP_CHECK(available > 0, who, ": no CUDA device is visible, so an NCCL communicator cannot be made; use CPU ",
           "virtual devices (dp::cpu(i))");
  std::unordered_set<Device> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.is_cuda(), who, ": the nccl communicator needs CUDA devices, got ", d);
    DP_CHECK(d.index >= 0 && d.index < available, who, ": ", d, " is out of range (", available,
             " CUDA devices visible to this process)");
    DP_CHECK(seen.insert(d).second, who, ": device ", d, " appears twice; each rank needs its own device");
  }
}

/// True when two of `devices` (checked CUDA devices) run on one GPU (Note [Logical
/// CUDA devices]): NCCL would refuse them ("duplicate GPU").
bool shares_gpu(const std::vector<Device>& devices) {
  std::vector<int> ids;
  for (const Device& d : devices) ids.push_back(d.index);
  return cuda().device_map().shares_gpu(ids);
}

/// Every process learns whether every process got through `step`; throws dp::Error
/// on every process otherwise (its own error where it failed). Collective.
void agree(const std::string& mine, const char* step) {
  const std::int64_t failed = dist::all_reduce(static_cast<std::int64_t>(mine.empty() ? 0 : 1), dist::Op::Max);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(failed == 0, "make_world_communicator (nccl): another process of the job failed to ", step,
           " (its own error says why); this process (rank ", dist::rank(), ") stops too");
}

/// Step 1: every process checks its devices; all agree before anything is made.
void check_world_devices(const std::vector<Device>& devices) {
  std::string mine;
  try {
    check_nccl_devices(devices, "make_world_communicator");
    DP_CHECK(!shares_gpu(devices), "make_world_communicator: devices ", devices.front(), " .. ",
             devices.back(), " share GPUs (", backend::kDevicesPerGpuEnv, "=",
             cuda().device_map().per_gpu(), "); across processes only NCCL is used, which needs one rank per GPU: ",
             "unset ", backend::kDevicesPerGpuEnv, " or run one process (Note [CUDA copy communicator])");
  } catch (const std::exception& e) {
    mine = e.what();
  }
  agree(mine, "check its CUDA devices");
}

/// Every process's device indices, world rank order: devices() of peers(j), and messages.
std::vector<std::int64_t> world_device_indices(const std::vector<Device>& devices, int process, int world) {
  const int n = static_cast<int>(devices.size());
  std::vector<std::int64_t> index(static_cast<std::size_t>(world), 0);
  for (int s = 0; s < n; ++s)
    index[static_cast<std::size_t>(process * n + s)] = devices[static_cast<std::size_t>(s)].index;
  dist::all_reduce(std::span<std::int64_t>(index), dist::Op::Sum);
  return index;
}

/// Step 2: the world communicator's streams and events (no comm yet), agreed on.
std::unique_ptr<NcclCommunicator> make_world_member(const std::vector<Device>& devices, const CommOptions& options,
                                                    const std::shared_ptr<Family>& family, int process) {
  const int n = static_cast<int>(devices.size());
  Layout layout{devices, dist::world_size() * n, process * n, 0, n, process * n, {}, "world", {}};
  for (int s = 0; s < n; ++s) layout.world_rank.push_back(process * n + s);
  std::unique_ptr<NcclCommunicator> comm;
  std::string mine;
  try {
    comm = std::make_unique<NcclCommunicator>(std::move(layout), options, family, std::vector<cudaStream_t>{});
  } catch (const std::exception& e) {
    mine = e.what();
  }
  agree(mine, "create its communication streams and events");
  return comm;
}

/// Step 3: the unique id, made on process 0 and broadcast; a failure there travels with
/// it (ok = 0) so that every process stops.
ncclUniqueId world_unique_id(int process) {
  struct IdMessage {
    std::int32_t ok;
    ncclUniqueId id;
  };
  IdMessage message;
  std::memset(&message, 0, sizeof(message));  // every process broadcasts the same bytes' shape
  std::string mine;
  if (process == 0) {
    const ncclResult_t res = ncclGetUniqueId(&message.id);
    message.ok = res == ncclSuccess ? 1 : 0;
    if (res != ncclSuccess)
      mine = dp::detail::str_cat("make_world_communicator: ncclGetUniqueId failed on process 0: ",
                                 ncclGetErrorString(res), " (NCCL_DEBUG=WARN prints NCCL's reason; NCCL_SOCKET_IFNAME ",
                                 "picks the network interface)");
  }
  message = dist::broadcast_object(message, 0);
  DP_CHECK(mine.empty(), mine);
  DP_CHECK(message.ok == 1, "make_world_communicator: process 0 could not make the NCCL unique id (its own error ",
           "says why); this process (rank ", process, ") stops too");
  return message.id;
}

/// Step 4: this process's ranks of the world communicator, agreed on. Installed before
/// agreeing, so that a failure elsewhere aborts them (discard).
void init_world_ranks(NcclCommunicator& comm, Family& family, const std::vector<Device>& devices,
                      const ncclUniqueId& id, const CommOptions& options) {
  const Layout& layout = comm.layout();
  const Made made = init_ranks(devices, layout.world_size, layout.first_nccl, id, options.timeout);
  if (made.error.empty()) comm.install(made.comms);
  try {
    agree(made.error.empty() ? std::string() : dp::detail::str_cat(family.description, ": ", made.error),
          "initialise its NCCL ranks");
  } catch (...) {
    discard(family);
    throw;
  }
}

/// The split communicators of a world communicator (Note [NCCL across processes]).
struct Splits {
  std::unique_ptr<NcclCommunicator> local;
  std::vector<std::unique_ptr<NcclCommunicator>> peers;
};

/// Step 5a: the events of local() and peers(j), on the world communicator's streams.
Splits make_split_members(const std::vector<Device>& devices, const std::vector<std::int64_t>& index,
                          const CommOptions& options, const std::shared_ptr<Family>& family,
                          const std::vector<cudaStream_t>& streams, int process) {
  const int processes = dist::world_size();
  const int n = static_cast<int>(devices.size());
  Splits out;
  Layout local_layout{devices, n, 0, 0, n, 0, {}, "local", {}};
  for (int s = 0; s < n; ++s) local_layout.world_rank.push_back(process * n + s);
  std::string mine;
  try {
    out.local = std::make_unique<NcclCommunicator>(std::move(local_layout), options, family, streams);
    for (int s = 0; s < n; ++s) {
      Layout peer_layout{{}, processes, 0, process, 1, process, {process * n + s},
                         dp::detail::str_cat("peers(", s, ")"),
                         "; peers(j) has one rank per process: pass dp::dist::rank()"};
      for (int q = 0; q < processes; ++q)
        peer_layout.devices.push_back(dp::cuda(static_cast<int>(index[static_cast<std::size_t>(q * n + s)])));
      const std::vector<cudaStream_t> stream{streams[static_cast<std::size_t>(s)]};
      out.peers.push_back(std::make_unique<NcclCommunicator>(std::move(peer_layout), options, family, stream));
    }
  } catch (const std::exception& e) {
    mine = e.what();
  }
  agree(mine, "create the events of its split communicators");
  return out;
}

/// Step 5b: split local() (this process's ranks, in local order) and peers(j) (local
/// rank j of every process, in process order) from the world comms, each agreed on.
void split_world(const std::vector<ncclComm_t>& parents, const std::vector<Device>& devices, Splits& splits,
                 const Family& family, const CommOptions& options, int process) {
  const int n = static_cast<int>(devices.size());
  const std::vector<int> by_process(static_cast<std::size_t>(n), process);
  std::vector<int> by_slot(static_cast<std::size_t>(n));
  for (int s = 0; s < n; ++s) by_slot[static_cast<std::size_t>(s)] = s;
  {
    const Made made = split_ranks(parents, devices, /*colors=*/by_process, /*keys=*/by_slot, options.timeout);
    if (made.error.empty()) splits.local->install(made.comms);
    agree(made.error.empty() ? std::string() : dp::detail::str_cat(family.description, ", local(): ", made.error),
          "split its local communicator");
  }
  {
    const Made made = split_ranks(parents, devices, /*colors=*/by_slot, /*keys=*/by_process, options.timeout);
    if (made.error.empty())
      for (int s = 0; s < n; ++s)
        splits.peers[static_cast<std::size_t>(s)]->install({made.comms[static_cast<std::size_t>(s)]});
    agree(made.error.empty() ? std::string() : dp::detail::str_cat(family.description, ", peers(j): ", made.error),
          "split its peers communicators");
  }
}

}  // namespace

}  // namespace nccl

std::unique_ptr<Communicator> make_nccl_communicator(const std::vector<Device>& devices,
                                                     const CommOptions& options) {
  using namespace nccl;  // this file's helpers and the class
  check_nccl_devices(devices, "make_communicator");
  if (shares_gpu(devices)) return make_copy_communicator(devices, options);  // Note [CUDA copy communicator]
  const int n = static_cast<int>(devices.size());
  auto family = std::make_shared<Family>();
  family->description = dp::detail::str_cat("the nccl communicator over ", n, " devices");
  family->watchdog = make_watchdog(*family, options.timeout);
  Layout layout{devices, n, 0, 0, n, 0, {}, "world", {}};
  for (int s = 0; s < n; ++s) layout.world_rank.push_back(s);
  auto comm = std::make_unique<NcclCommunicator>(std::move(layout), options, family, std::vector<cudaStream_t>{});
  ncclUniqueId id;
  DP_NCCL_CHECK(ncclGetUniqueId(&id));
  const Made made = init_ranks(devices, n, 0, id, options.timeout);
  DP_CHECK(made.error.empty(), family->description, ": initialisation failed: ", made.error);
  comm->install(made.comms);
  comm->adopt(nullptr, {});
  comm->start_watchdog();
  return comm;
}

std::unique_ptr<Communicator> make_nccl_world_communicator(const std::vector<Device>& devices,
                                                           const CommOptions& options) {
  using namespace nccl;  // this file's steps and the class
  // Every step that can fail on one process is agreed on by all (agree) before the
  // next collective one, so a failure throws on every process instead of leaving the
  // others in an NCCL initialisation that waits for it (Note [NCCL across processes]).
  const int processes = dist::world_size();
  const int process = dist::rank();
  const int n = static_cast<int>(devices.size());  // the same on every process (checked by the caller)
  check_world_devices(devices);
  const std::vector<std::int64_t> index = world_device_indices(devices, process, processes * n);

  auto family = std::make_shared<Family>();
  family->spans_processes = processes > 1;
  family->description = dp::detail::str_cat("the nccl communicator over ", processes * n, " GPUs of ", processes,
                                            " processes (", n, " per process)");
  family->watchdog = make_watchdog(*family, options.timeout);
  std::unique_ptr<NcclCommunicator> comm = make_world_member(devices, options, family, process);
  init_world_ranks(*comm, *family, devices, world_unique_id(process), options);

  // Split at construction (Note [NCCL across processes]). The members are made before
  // the splits so that a failure can abort their comms before they are destroyed.
  Splits splits;
  try {
    splits = make_split_members(devices, index, options, family, comm->streams(), process);
    split_world(comm->comms(), devices, splits, *family, options, process);
  } catch (...) {
    discard(*family);
    throw;
  }
  comm->adopt(std::move(splits.local), std::move(splits.peers));
  comm->start_watchdog();
  return comm;
}

}  // namespace dp::comm
