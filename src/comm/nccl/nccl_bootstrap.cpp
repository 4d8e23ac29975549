// Making NCCL comms (see nccl_bootstrap.h).
#include "comm/nccl/nccl_bootstrap.h"

#include <exception>
#include <utility>

#include "comm/nccl/nccl_common.h"
#include "dp/core/error.h"

namespace dp::comm::nccl {
namespace {

/// Finishes a grouped creation: polls every non-blocking comm (bounded by `timeout`)
/// until it is ready; on any failure aborts every comm made and says why. Never throws.
Made finish_creation(std::vector<ncclComm_t> comms, const std::vector<Device>& devices, ncclResult_t error,
                     const char* what, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  bool timed_out = false;
  for (std::size_t i = 0; i < comms.size() && error == ncclSuccess; ++i) {
    ncclComm_t c = comms[i];
    if (c == nullptr) {
      error = ncclInternalError;
      break;
    }
    ncclResult_t state = ncclInProgress;
    Backoff backoff;
    while (state == ncclInProgress) {
      const ncclResult_t res = ncclCommGetAsyncError(c, &state);
      if (res != ncclSuccess) state = res;
      if (state == ncclInProgress && Clock::now() > deadline) {
        timed_out = true;
        state = ncclSystemError;
      }
      if (state == ncclInProgress) backoff.pause();
    }
    error = state;
  }
  if (error == ncclSuccess) return {std::move(comms), {}};
  CommList made;
  for (std::size_t i = 0; i < comms.size(); ++i)
    if (comms[i] != nullptr) made.emplace_back(comms[i], devices[i]);
  abort_comms(made);
  return {{},
          timed_out ? dp::detail::str_cat(what, " did not complete within the timeout of ", timeout.count(),
                                          " ms (a process of the job is missing or failed; NCCL_DEBUG=WARN ",
                                          "prints NCCL's view)")
                    : dp::detail::str_cat(what, " failed: ", ncclGetErrorString(error),
                                          " (NCCL_DEBUG=WARN prints NCCL's reason)")};
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Note [NCCL failures]
  return config;
}

}  // namespace

/// Makes ranks first .. first + devices.size() - 1 of `nranks`, one per device, from
/// `id` — one group, as one thread creates them all (the calls would otherwise wait
/// for peers that the same thread has not created yet). Never throws.
Made init_ranks(const std::vector<Device>& devices, int nranks, int first, const ncclUniqueId& id,
                std::chrono::milliseconds timeout) {
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ncclConfig_t config = nonblocking_config();
  ncclResult_t error = ncclGroupStart();
  if (error != ncclSuccess)
    return {{}, dp::detail::str_cat("ncclGroupStart failed: ", ncclGetErrorString(error))};
  for (std::size_t i = 0; i < devices.size() && error == ncclSuccess; ++i) {
    try {
      cuda().set_device(devices[i].index);
    } catch (const std::exception&) {
      error = ncclUnhandledCudaError;  // the group must still be closed below
      break;
    }
    const ncclResult_t res =
        ncclCommInitRankConfig(&comms[i], nranks, id, first + static_cast<int>(i), &config);
    if (res != ncclSuccess && res != ncclInProgress) error = res;
  }
  const ncclResult_t ended = ncclGroupEnd();
  backend::CudaBackend::invalidate_device_cache();  // NCCL called cudaSetDevice
  if (error == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) error = ended;
  return finish_creation(std::move(comms), devices, error, "ncclCommInitRankConfig", timeout);
}

/// Splits every parent (parents[i] on devices[i]) with colors[i] and keys[i], grouped.
/// Every rank of the parents' communicator must call it. Never throws.
Made split_ranks(const std::vector<ncclComm_t>& parents, const std::vector<Device>& devices,
                 const std::vector<int>& colors, const std::vector<int>& keys,
                 std::chrono::milliseconds timeout) {
  std::vector<ncclComm_t> comms(parents.size(), nullptr);
  ncclConfig_t config = nonblocking_config();
  ncclResult_t error = ncclGroupStart();
  if (error != ncclSuccess)
    return {{}, dp::detail::str_cat("ncclGroupStart failed: ", ncclGetErrorString(error))};
  for (std::size_t i = 0; i < parents.size() && error == ncclSuccess; ++i) {
    try {
      cuda().set_device(devices[i].index);
    } catch (const std::exception&) {
      error = ncclUnhandledCudaError;
      break;
    }
    const ncclResult_t res = ncclCommSplit(parents[i], colors[i], keys[i], &comms[i], &config);
    if (res != ncclSuccess && res != ncclInProgress) error = res;
  }
  const ncclResult_t ended = ncclGroupEnd();
  backend::CudaBackend::invalidate_device_cache();
  if (error == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) error = ended;
  return finish_creation(std::move(comms), devices, error, "ncclCommSplit", timeout);
}

}  // namespace dp::comm::nccl
