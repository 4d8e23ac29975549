// NCCL helpers shared by the NCCL communicator's files (see nccl_common.h).
#include "comm/nccl/nccl_common.h"

#include <exception>

#include "dp/core/error.h"

namespace dp::comm::nccl {

ncclDataType_t to_nccl(Dtype dtype) {
  switch (dtype) {
    case Dtype::Float32: return ncclFloat32;
    case Dtype::Int64: return ncclInt64;
    case Dtype::Int32: return ncclInt32;
    case Dtype::BFloat16: return ncclBfloat16;
    case Dtype::Float16: return ncclFloat16;
  }
  DP_FAIL("nccl communicator: no NCCL type for dtype code ", static_cast<int>(dtype));
}

void warn_nccl(ncclResult_t res, const char* what, Device dev) {
  if (res != ncclSuccess && res != ncclInProgress)
    dp::detail::log_warning(dp::detail::str_cat(what, " on ", dev, " failed: ", ncclGetErrorString(res)));
}

namespace {

/// Calls `call` (ncclCommAbort, ncclCommDestroy) on every comm from one thread,
/// grouped as NCCL requires; `name` for the logs. Never throws: it runs on failure
/// and cleanup paths.
template <typename Call>
void on_every_comm(const CommList& comms, const char* name, const char* group_name, Call&& call) {
  if (comms.empty()) return;
  const bool grouped = comms.size() > 1 && ncclGroupStart() == ncclSuccess;
  for (const auto& [c, dev] : comms) {
    try {
      cuda().set_device(dev.index);
    } catch (const std::exception& e) {
      dp::detail::log_warning(dp::detail::str_cat(name, " on ", dev, ": ", e.what()));
    }
    warn_nccl(call(c), name, dev);
  }
  if (grouped) warn_nccl(ncclGroupEnd(), group_name, comms.front().second);
  backend::CudaBackend::invalidate_device_cache();  // NCCL may have called cudaSetDevice
}

}  // namespace

void abort_comms(const CommList& comms) {
  on_every_comm(comms, "ncclCommAbort", "ncclGroupEnd (abort)", [](ncclComm_t c) { return ncclCommAbort(c); });
}

void destroy_comms(const CommList& comms) {
  on_every_comm(comms, "ncclCommDestroy", "ncclGroupEnd (destroy)", [](ncclComm_t c) { return ncclCommDestroy(c); });
}

}  // namespace dp::comm::nccl
