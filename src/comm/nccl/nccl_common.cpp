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
    // bf16 / fp16: ncclBfloat16 / ncclFloat16 here (and a Summand in summation.h).
  }
  DP_FAIL("nccl communicator: no NCCL type for dtype code ", static_cast<int>(dtype));
}

void warn_nccl(ncclResult_t res, const char* what, Device dev) {
  if (res != ncclSuccess && res != ncclInProgress)
    dp::detail::log_warning(dp::detail::str_cat(what, " on ", dev, " failed: ", ncclGetErrorString(res)));
}

void abort_comms(const CommList& comms) {
  if (comms.empty()) return;
  const bool grouped = comms.size() > 1 && ncclGroupStart() == ncclSuccess;
  for (const auto& [c, dev] : comms) {
    try {
      cuda().set_device(dev.index);
    } catch (const std::exception& e) {  // abort never throws: it runs on failure paths
      dp::detail::log_warning(dp::detail::str_cat("nccl abort: ", e.what()));
    }
    warn_nccl(ncclCommAbort(c), "ncclCommAbort", dev);
  }
  if (grouped) warn_nccl(ncclGroupEnd(), "ncclGroupEnd (abort)", comms.front().second);
  backend::CudaBackend::invalidate_device_cache();  // NCCL may have called cudaSetDevice
}

void destroy_comms(const CommList& comms) {
  if (comms.empty()) return;
  const bool grouped = comms.size() > 1 && ncclGroupStart() == ncclSuccess;
  for (const auto& [c, dev] : comms) {
    try {
      cuda().set_device(dev.index);
    } catch (const std::exception& e) {
      dp::detail::log_warning(dp::detail::str_cat("~NcclCommunicator: ", e.what()));
    }
    warn_nccl(ncclCommDestroy(c), "ncclCommDestroy", dev);
  }
  if (grouped) warn_nccl(ncclGroupEnd(), "ncclGroupEnd (destroy)", comms.front().second);
  backend::CudaBackend::invalidate_device_cache();
}

}  // namespace dp::comm::nccl
