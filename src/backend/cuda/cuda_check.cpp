#include "backend/cuda/cuda_check.h"

#include <cstring>

namespace dp::backend::cuda_detail {
namespace {

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

thread_local int tl_dp_device = -1;
thread_local int tl_gpu = -1;

}  // namespace

void note_thread_device(int dp_device, int gpu) noexcept {
  tl_dp_device = dp_device;
  tl_gpu = gpu;
}

int current_device_or_minus_one() noexcept {
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) return -1;
  return dev;
}

std::string format_error(const char* lib, int code, const char* text, const char* stmt,
                         const char* file, int line) {
  std::string where;
  const int gpu = current_device_or_minus_one();
  if (tl_dp_device >= 0 && tl_gpu == gpu) {
    where = dp::detail::str_cat("cuda:", tl_dp_device);
    if (tl_dp_device != gpu) where += dp::detail::str_cat(" (GPU ", gpu, ")");
  } else {
    where = gpu >= 0 ? dp::detail::str_cat("cuda:", gpu) : std::string("cuda:?");
  }
  return dp::detail::str_cat(lib, " error ", code, " (", text ? text : "unknown", ") in `",
                             stmt, "` on ", where, " [", base_name(file), ":", line, "]");
}

void throw_cuda(cudaError_t err, const char* stmt, const char* file, int line) {
  // Clear the runtime's non-sticky last error, so the next unrelated
  // cudaGetLastError() launch check does not report this failure a second time.
  (void)cudaGetLastError();
  std::string msg = format_error("CUDA", static_cast<int>(err), cudaGetErrorString(err), stmt,
                                 file, line);
  if (err == cudaErrorMemoryAllocation) {
    msg += " — out of device memory: reduce the batch size per device";
  } else if (err == cudaErrorNoKernelImageForDevice) {
    msg += " — dp was compiled for other GPUs: add this GPU's SM to -Dcuda_arch";
  } else if (err == cudaErrorIllegalAddress || err == cudaErrorLaunchFailure) {
    msg += " — a kernel faulted earlier on this device (the context is now unusable); rerun "
           "with CUDA_LAUNCH_BLOCKING=1 to find it";
  }
  throw Error(msg);
}

void throw_cublas(cublasStatus_t st, const char* stmt, const char* file, int line) {
  throw Error(format_error("cuBLAS", static_cast<int>(st), cublasGetStatusString(st), stmt,
                           file, line));
}

void throw_cudnn(cudnnStatus_t st, const char* stmt, const char* file, int line) {
  throw Error(format_error("cuDNN", static_cast<int>(st), cudnnGetErrorString(st), stmt, file,
                           line));
}

void throw_nccl(ncclResult_t r, const char* stmt, const char* file, int line) {
  throw Error(format_error("NCCL", static_cast<int>(r), ncclGetErrorString(r), stmt, file,
                           line));
}

void warn_cuda(cudaError_t err, const char* stmt, const char* file, int line) noexcept {
  (void)cudaGetLastError();
  // At process exit the runtime may already be gone; nothing useful can be said then.
  if (err == cudaErrorCudartUnloading) return;
  try {
    dp::detail::log_warning(format_error("CUDA", static_cast<int>(err),
                                         cudaGetErrorString(err), stmt, file, line));
  } catch (...) {
    // Logging must not throw out of a destructor; losing the message is the lesser harm.
  }
}

}  // namespace dp::backend::cuda_detail
