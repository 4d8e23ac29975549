// src/backend/cuda/cuda_check.h — one check macro per CUDA library.
//
// Every CUDA runtime, cuBLAS, cuDNN and NCCL call in dp goes through one of these. A
// failure throws dp::Error naming the statement, the calling thread's current device,
// the library's own error string and file:line. Destructors use DP_CUDA_WARN, which
// logs instead of throwing. Internal header: never included by public headers.
//
//   DP_CUDA_CHECK(cudaMemsetAsync(p, 0, nbytes, stream));
//   DP_CUBLAS_CHECK(cublasSgemm_64(handle, ...));
//   DP_CUDA_WARN(cudaEventDestroy(ev));      // in a destructor
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>

#include <string>

#include "dp/core/error.h"

namespace dp::backend::cuda_detail {

/// The calling thread's current CUDA device, or -1 when even that query fails.
int current_device_or_minus_one() noexcept;

/// Records the dp device the calling thread works for now and its physical GPU
/// (CudaBackend::set_device calls it), so that an error names the dp device — which,
/// with logical devices (Note [Logical CUDA devices]), is not the GPU's index.
void note_thread_device(int dp_device, int gpu) noexcept;

/// Builds "<lib> error <code> (<text>) in `<stmt>` on cuda:<dev> [file:line]", where
/// <dev> is the dp device last noted on this thread ("cuda:5 (GPU 1)" when it is a
/// logical device of another index than its GPU), else the runtime's current device.
std::string format_error(const char* lib, int code, const char* text, const char* stmt,
                         const char* file, int line);

[[noreturn]] void throw_cuda(cudaError_t err, const char* stmt, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t st, const char* stmt, const char* file, int line);
[[noreturn]] void throw_cudnn(cudnnStatus_t st, const char* stmt, const char* file, int line);
[[noreturn]] void throw_nccl(ncclResult_t r, const char* stmt, const char* file, int line);
/// Logs a CUDA runtime error (and clears the runtime's last error) without throwing.
void warn_cuda(cudaError_t err, const char* stmt, const char* file, int line) noexcept;

}  // namespace dp::backend::cuda_detail

/// Throws dp::Error when a CUDA runtime call does not return cudaSuccess.
#define DP_CUDA_CHECK(expr)                                                          \
  do {                                                                               \
    const cudaError_t dp_cuda_err_ = (expr);                                         \
    if (dp_cuda_err_ != cudaSuccess) [[unlikely]]                                    \
      ::dp::backend::cuda_detail::throw_cuda(dp_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Throws dp::Error when a cuBLAS call does not return CUBLAS_STATUS_SUCCESS.
#define DP_CUBLAS_CHECK(expr)                                                            \
  do {                                                                                   \
    const cublasStatus_t dp_cublas_st_ = (expr);                                         \
    if (dp_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                             \
      ::dp::backend::cuda_detail::throw_cublas(dp_cublas_st_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Throws dp::Error when a cuDNN call does not return CUDNN_STATUS_SUCCESS.
#define DP_CUDNN_CHECK(expr)                                                           \
  do {                                                                                 \
    const cudnnStatus_t dp_cudnn_st_ = (expr);                                         \
    if (dp_cudnn_st_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                             \
      ::dp::backend::cuda_detail::throw_cudnn(dp_cudnn_st_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Throws dp::Error when an NCCL call does not return ncclSuccess. (Communicators
/// created non-blocking must poll ncclInProgress themselves before using this.)
#define DP_NCCL_CHECK(expr)                                                          \
  do {                                                                               \
    const ncclResult_t dp_nccl_r_ = (expr);                                          \
    if (dp_nccl_r_ != ncclSuccess) [[unlikely]]                                      \
      ::dp::backend::cuda_detail::throw_nccl(dp_nccl_r_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Logs (never throws) when a CUDA runtime call fails: for destructors and cleanup.
#define DP_CUDA_WARN(expr)                                                          \
  do {                                                                              \
    const cudaError_t dp_cuda_err_ = (expr);                                        \
    if (dp_cuda_err_ != cudaSuccess) [[unlikely]]                                   \
      ::dp::backend::cuda_detail::warn_cuda(dp_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Checks the launch of the kernel just enqueued (bad configuration, no kernel image
/// for this GPU). Errors inside the kernel surface at the next synchronising call.
#define DP_CUDA_CHECK_LAUNCH() DP_CUDA_CHECK(cudaGetLastError())
