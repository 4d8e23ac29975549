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

/// One grouped creation of n comms — comms[i] on devices[i], made by create(i,
/// &comms[i]) — polled to the end (finish_creation); `what` names the NCCL call. One
/// group, as one thread creates them all (the calls would otherwise wait for peers that
/// the same thread has not created yet). Never throws.
template <typename Create>
Made create_grouped(std::size_t n, const std::vector<Device>& devices, const char* what,
                    std::chrono::milliseconds timeout, Create&& create) {
  std::vector<ncclComm_t> comms(n, nullptr);
  ncclResult_t error = ncclGroupStart();
  if (error != ncclSuccess)
    return {{}, dp::detail::str_cat("ncclGroupStart failed: ", ncclGetErrorString(error))};
  for (std::size_t i = 0; i < n && error == ncclSuccess; ++i) {
    try {
      cuda().set_device(devices[i].index);
    } catch (const std::exception&) {
      error = ncclUnhandledCudaError;  // the group must still be closed below
      break;
    }
    const ncclResult_t res = create(i, &comms[i]);
    if (res != ncclSuccess && res != ncclInProgress) error = res;
  }
  const ncclResult_t ended = ncclGroupEnd();
  backend::CudaBackend::invalidate_device_cache();  // NCCL called cudaSetDevice
  if (error == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) error = ended;
  return finish_creation(std::move(comms), devices, error, what, timeout);
}

}  // namespace

Made init_ranks(const std::vector<Device>& devices, int nranks, int first, const ncclUniqueId& id,
                std::chrono::milliseconds timeout) {
  ncclConfig_t config = nonblocking_config();
  return create_grouped(devices.size(), devices, "ncclCommInitRankConfig", timeout,
                        [&](std::size_t i, ncclComm_t* comm) {
                          return ncclCommInitRankConfig(comm, nranks, id, first + static_cast<int>(i), &config);
                        });
}

Made split_ranks(const std::vector<ncclComm_t>& parents, const std::vector<Device>& devices,
                 const std::vector<int>& colors, const std::vector<int>& keys,
                 std::chrono::milliseconds timeout) {
  ncclConfig_t config = nonblocking_config();
  return create_grouped(parents.size(), devices, "ncclCommSplit", timeout, [&](std::size_t i, ncclComm_t* comm) {
    return ncclCommSplit(parents[i], colors[i], keys[i], comm, &config);
  });
}

}  // namespace dp::comm::nccl
