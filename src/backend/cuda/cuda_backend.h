// src/backend/cuda/cuda_backend.h — the CUDA implementation of backend::Backend.
//
// Internal to backend/cuda and to other CUDA code of dp (the NCCL communicator): it
// includes CUDA headers, so no public header may include it. Besides the Backend
// interface it exposes what such code needs: the calling thread's current stream per
// device, a guard to change it, the cuBLAS/cuDNN handles and the caching allocator.
//
//   CudaBackend& cb = CudaBackend::instance();
//   CudaStreamGuard guard(dev, comm_stream);   // this thread's ops on dev go to comm_stream
//   cb.allocator(dev).record_stream(buf, comm_stream);
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/caching_allocator.h"
#include "backend/cuda/host_allocator.h"
#include "backend/logical_devices.h"

namespace dp::backend {

// Note [Process-lifetime CUDA objects]
// The backend, its streams, handles and cached memory live until the process exits and
// are never destroyed: static destructors run after the CUDA runtime may have begun to
// unload, and cudaFree/cublasDestroy then fail or hang. The driver reclaims everything
// at exit. (PyTorch makes the same choice for its streams and caching allocator.)

// Note [CUDA streams of dp]
// Each device has one default compute stream, created non-blocking (it never
// synchronises with the legacy NULL stream) when the device is first used. Every
// thread's current stream of a device is that default stream unless a CudaStreamGuard
// on that thread says otherwise; every Backend call enqueues on the calling thread's
// current stream of its device. DataParallel's main thread and the device's worker
// therefore share one stream per device and need no events between them; a
// communicator that runs collectives on its own stream orders them with events and
// declares cross-stream buffers with CachingAllocator::record_stream.

// Note [Logical CUDA devices]
// DP_CUDA_DEVICES_PER_GPU=k makes every physical GPU carry k dp devices: cuda:i runs
// on GPU i / k (backend/logical_devices.h, tested on CPU), so the whole multi-device
// runtime — DP, DDP, Sharded, with their streams, events, peer copies and collectives
// — runs on a machine with one GPU. A logical device owns everything a GPU would
// give it alone: its compute stream and the inbound stream of Note [Peer copies],
// its cuBLAS and cuDNN handles (so k workers never serialise on one handle mutex),
// its caching allocator (so memory_allocated(cuda:i) counts cuda:i's tensors alone)
// and its event pool. What it shares is the GPU itself: SMs, memory capacity (the
// allocators' cudaMalloc draw on one pool; an out-of-memory message names the GPU's
// free memory) and the current-device state of a thread, which set_device keeps as
// the physical id. Differences from k real GPUs, each deliberate:
//   - synchronize(cuda:i) waits for cuda:i's own streams, not for the whole GPU
//     (cudaDeviceSynchronize would also wait for its k-1 siblings);
//   - a copy between two devices of one GPU is a device-to-device cudaMemcpyAsync
//     ordered like a peer copy (Note [Peer copies]);
//   - NCCL refuses two ranks on one GPU in a communicator ("duplicate GPU"), so a
//     device list that shares a GPU gets the CUDA copy communicator instead
//     (Note [CUDA copy communicator], src/comm/nccl/copy_communicator.cpp).
// Timings on logical devices measure k workers contending for one GPU: they test
// correctness and ordering, not scaling. k = 1 (the default) changes nothing.

/// Event that orders work across streams and devices (timing disabled: cheaper).
class CudaEvent final : public Event {
 public:
  /// Creates the event on `device` (which becomes the calling thread's current device).
  explicit CudaEvent(int device);
  ~CudaEvent() override;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
};

/// Makes `stream` the calling thread's current stream of `device` for the guard's
/// lifetime (nullptr selects the default compute stream), then restores the previous one.
class CudaStreamGuard {
 public:
  CudaStreamGuard(int device, cudaStream_t stream);
  CudaStreamGuard(Device device, cudaStream_t stream) : CudaStreamGuard(device.index, stream) {}
  ~CudaStreamGuard();
  CudaStreamGuard(const CudaStreamGuard&) = delete;
  CudaStreamGuard& operator=(const CudaStreamGuard&) = delete;

 private:
  int device_;
  cudaStream_t previous_;
};

/// Exclusive use of a library handle of one device, already bound to the calling
/// thread's current stream of that device. Holds the device's handle mutex.
template <typename Handle>
class HandleLease {
 public:
  HandleLease(std::unique_lock<std::mutex> lock, Handle h) : lock_(std::move(lock)), h_(h) {}
  Handle get() const { return h_; }

 private:
  std::unique_lock<std::mutex> lock_;
  Handle h_;
};

/// The CUDA backend: one per process (Note [Process-lifetime CUDA objects]).
class CudaBackend final : public Backend {
 public:
  /// The process-wide instance; the same object as backend::get(DeviceType::CUDA) when
  /// dp is built with CUDA.
  static CudaBackend& instance();

  // ---- CUDA-specific accessors (for backend/cuda and comm/nccl) -------------------
  /// Makes `device`'s GPU current on the calling thread; cudaSetDevice runs only when
  /// the thread's cached GPU differs. All dp code switches devices through this, with
  /// dp device indices (Note [Logical CUDA devices]).
  void set_device(int device);
  /// How dp devices map onto physical GPUs (DP_CUDA_DEVICES_PER_GPU).
  const LogicalDeviceMap& device_map() const { return map_; }
  /// The physical GPU of dp device `device` (what CUDA calls take as a device id).
  int physical_device(int device) const { return map_.physical(device); }
  /// Enables direct access from `a`'s GPU to `b`'s memory (dp device indices) once;
  /// true when kernels on `a` may read `b`'s memory (always for one GPU), false when
  /// the GPUs cannot peer (copies between them are then staged by the driver).
  bool enable_peer_access(int a, int b);
  /// Forgets the thread's cached device: call after foreign code that may have called
  /// cudaSetDevice (e.g. library initialisation).
  static void invalidate_device_cache();
  /// The calling thread's current stream of `device` (Note [CUDA streams of dp]).
  cudaStream_t compute_stream(int device);
  /// The device's default compute stream.
  cudaStream_t default_stream(int device);
  /// A new non-blocking stream on `device` owned by the backend until process exit
  /// (lower `priority` numbers run first; 0 is the default priority).
  cudaStream_t create_stream(int device, int priority = 0);
  /// Handles bound to compute_stream(device); hold the lease for the duration of the call.
  HandleLease<cublasHandle_t> cublas(int device);
  HandleLease<cudnnHandle_t> cudnn(int device);
  CachingAllocator& allocator(int device);
  /// Scratch memory for the duration of one enqueued op: freed at scope exit, which is
  /// safe because the block is only reused by later work on the same stream.
  class Scratch {
   public:
    Scratch(CudaBackend& b, int device, std::size_t nbytes);
    ~Scratch();
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
    void* get() const { return ptr_; }

   private:
    CachingAllocator* alloc_;
    void* ptr_;
  };

  // ---- Backend ---------------------------------------------------------------------
  DeviceType type() const override { return DeviceType::CUDA; }
  int device_count() override { return device_count_; }

  void set_current_device(Device dev) override;
  void set_concurrent_devices(int count) override;
  int threads_per_device(Device dev) override;
  void host_parallel_for(Device dev, std::int64_t n, RangeFn f) override;
  void synchronize(Device dev) override;
  std::unique_ptr<Event> create_event(Device dev) override;
  void record_event(Event& ev, Device dev) override;
  void wait_event(Event& ev, Device dev) override;
  void range_push(Device dev, const char* name) override;
  void range_pop(Device dev) noexcept override;

  void* allocate(Device dev, std::size_t nbytes) override;
  void deallocate(Device dev, void* ptr, std::size_t nbytes) noexcept override;
  std::size_t memory_allocated(Device dev) override;
  std::size_t max_memory_allocated(Device dev) override;
  void reset_peak_memory(Device dev) override;
  void empty_cache(Device dev) override;
  void* allocate_pinned(std::size_t nbytes) override;
  void deallocate_pinned(void* ptr, std::size_t nbytes) noexcept override;
  std::size_t pinned_memory_allocated() override;
  void copy(void* dst, Device dst_dev, const void* src, Device src_dev,
            std::size_t nbytes) override;
  std::unique_ptr<PendingCopy> copy_ahead(Device dst_dev, const void* src, Device src_dev,
                                          std::size_t nbytes) override;
  void finish_copy(PendingCopy& p, void* dst, Device dst_dev) override;
  void copy_from_host(void* dst, Device dev, const void* host_src, std::size_t nbytes) override;
  void copy_to_host(void* host_dst, const void* src, Device dev, std::size_t nbytes) override;
  void memset_zero(void* ptr, Device dev, std::size_t nbytes) override;
  void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t row_bytes,
                 std::size_t rows, Device dev) override;
  /// The fused attention kernels' limits: head dims up to 128, the GPU's shared memory
  /// (Note [Fused attention on CUDA], cuda_attention.cu).
  std::string attention_shape_misfit(Device dev, const AttentionShape& s) const override;
  /// The cuDNN algorithm each pass of the convolution chose, or the widening of Note
  /// [16-bit convolutions on CUDA] (cuda_blas_dnn.cpp).
  std::array<ConvPass, 3> conv_passes(Device dev, const Conv2dShape& s, DType dt) override;

  // The float32 kernels of these ops (Note [The op list] in ops.h) are these members,
  // registered through method_kernels.h.
  void fill_uniform(Device dev, float* y, std::int64_t n, float lo, float hi,
                    std::uint64_t seed, std::uint64_t offset);
  void fill_normal(Device dev, float* y, std::int64_t n, float mean, float std,
                   std::uint64_t seed, std::uint64_t offset);
  void dropout(Device dev, const float* x, float* y, float* mask, std::int64_t n, float p,
               std::uint64_t seed, std::uint64_t offset);

  void gemm(Device dev, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
            std::int64_t k, float alpha, const float* a, std::int64_t lda, const float* b,
            std::int64_t ldb, float beta, float* c, std::int64_t ldc);
  /// The Gemm op: gemm, then the epilogue as the separate ops (GemmEpilogue in ops.h).
  void gemm_with_epilogue(Device dev, const GemmArgs& a);

  void log_softmax(Device dev, const float* x, float* y, std::int64_t rows,
                   std::int64_t cols);
  void log_softmax_backward(Device dev, const float* gy, const float* y, float* gx,
                            std::int64_t rows, std::int64_t cols);
  void nll_forward(Device dev, const float* logp, const std::int64_t* target, float* loss,
                   std::int64_t rows, std::int64_t cols, std::int64_t ignore_index = kNoIgnoreIndex);
  void nll_backward(Device dev, const float* gloss, const std::int64_t* target, float* gx,
                    std::int64_t rows, std::int64_t cols, std::int64_t ignore_index = kNoIgnoreIndex);

  void conv2d_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                      const float* bias, float* y);
  void conv2d_relu_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                           const float* bias, float* y);
  void conv2d_backward_data(Device dev, const Conv2dShape& s, const float* gy, const float* w,
                            float* gx);
  void conv2d_backward_weight(Device dev, const Conv2dShape& s, const float* x,
                              const float* gy, float* gw, float* gbias);
  void maxpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y,
                         std::int64_t* indices);
  void maxpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                          const std::int64_t* indices, float* gx);
  void avgpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y);
  void avgpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                          float* gx);

  void batchnorm_forward_train(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                               const float* x, const float* gamma, const float* beta,
                               float eps, float momentum, float* running_mean,
                               float* running_var, float* y, float* save_mean,
                               float* save_invstd);
  void batchnorm_forward_eval(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                              const float* x, const float* gamma, const float* beta, float eps,
                              const float* running_mean, const float* running_var,
                              float* y);
  void batchnorm_backward(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                          const float* gy, const float* x, const float* gamma,
                          const float* save_mean, const float* save_invstd, float* gx,
                          float* ggamma, float* gbeta);

  void sgd_step(Device dev, float* param, const float* grad, float* momentum_buf,
                std::int64_t n, double lr, double momentum, double dampening, double weight_decay,
                bool nesterov, bool first_step);
  void adam_step(Device dev, float* param, const float* grad, float* exp_avg,
                 float* exp_avg_sq, std::int64_t n, double lr, double beta1, double beta2,
                 double eps, double weight_decay, bool decoupled, std::int64_t step);

  /// Checks the device, makes it current, initialises it on first use; returns its
  /// current stream for the calling thread. Every kernel of the table starts here.
  cudaStream_t bind(Device dev);
  /// Puts fn in the kernel table for (op, dt): for this backend's kernel files, which
  /// register their own ops (cuda_register.h) when the backend is built.
  void add_kernel(Op op, DType dt, KernelFn fn) { register_kernel(op, dt, fn); }

 private:
  CudaBackend();
  struct DeviceState;
  /// Fills the kernel table (Note [The op list] in ops.h); the constructor calls it.
  void register_kernels();
  /// conv2d_forward, and conv2d_relu_forward when `relu`.
  void conv_forward(Device dev, const Conv2dShape& s, const float* x, const float* w, const float* bias, float* y,
                    bool relu);
  DeviceState& state(int device);
  void check_device(Device dev) const;
  cudaEvent_t acquire_event(int device);
  void release_event(int device, cudaEvent_t ev);
  /// Steps 1-3 of Note [Peer copies] up to the destination's wait: the bytes in a
  /// staging block of the inbound stream, `copied` recorded after them.
  struct InFlight {
    void* staging = nullptr;
    cudaEvent_t copied = nullptr;
  };
  InFlight start_peer_copy(Device dst_dev, const void* src, Device src_dev, std::size_t nbytes);
  /// The rest: the destination's stream waits for `copied` and copies staging → dst;
  /// the staging block and the event are given back on every path.
  void land_peer_copy(void* dst, Device dst_dev, InFlight f, std::size_t nbytes);
  /// Gives back an in-flight copy that will not land. Never throws.
  void drop_peer_copy(Device dst_dev, InFlight f) noexcept;
  struct AheadCopy;  // Note [Copies ahead]

  const LogicalDeviceMap map_;
  const int device_count_ = 0;                   // dp devices: map_.count()
  std::unique_ptr<DeviceState[]> devices_;
  std::unique_ptr<std::once_flag[]> peer_once_;  // physical GPUs × physical GPUs
  std::unique_ptr<bool[]> peer_ok_;              // written once under peer_once_
  std::mutex streams_mu_;
  std::vector<std::pair<int, cudaStream_t>> extra_streams_;  // (dp device, stream)
  HostAllocator host_alloc_;
};

}  // namespace dp::backend
