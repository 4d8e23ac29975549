// CUDA backend: devices, streams, events, memory and copies, and the thin overrides that
// hand each kernel call to its launcher (cuda_kernels.h) on the current stream.
// GEMM and convolution live in cuda_blas_dnn.cpp.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include <nvtx3/nvToolsExt.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_kernels.h"
#include "backend/method_kernels.h"
#include "dp/core/error.h"

namespace dp::backend {

/// Lazily initialised state of one device (Note [CUDA streams of dp]).
struct CudaBackend::DeviceState {
  std::once_flag init;
  cudaStream_t stream = nullptr;   // default compute stream
  cudaStream_t inbound = nullptr;  // copies from other devices (Note [Peer copies])
  std::mutex handle_mu;           // guards the handles' bound stream during a call
  cublasHandle_t cublas = nullptr;
  cudnnHandle_t cudnn = nullptr;
  std::unique_ptr<CachingAllocator> allocator;
  std::mutex event_mu;
  std::vector<cudaEvent_t> events;  // reusable events for cross-device ordering
};

namespace {

// The calling thread's current device as dp last set it (-1: unknown) and its current
// stream per device (null: the device's default compute stream). Threads are few (one
// worker per device plus the caller), devices at most a few dozen.
thread_local int tl_device = -1;
thread_local std::vector<cudaStream_t> tl_streams;

int probe_device_count() {
  int n = 0;
  // Any error (no driver, driver too old, CUDA_VISIBLE_DEVICES empty, no permission)
  // means no usable device: dp then runs on CPU virtual devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n < 0 ? 0 : n;
}

}  // namespace

// ---- CudaEvent / CudaStreamGuard ------------------------------------------------------------

CudaEvent::CudaEvent(int device) : device_(device) {
  CudaBackend::instance().set_device(device);
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

CudaEvent::~CudaEvent() {
  // Destroying an event that is still pending is allowed: the driver frees it later.
  if (event_) DP_CUDA_WARN(cudaEventDestroy(event_));
}

CudaStreamGuard::CudaStreamGuard(int device, cudaStream_t stream) : device_(device) {
  DP_CHECK(device >= 0, "CudaStreamGuard: expected a device id >= 0, got ", device);
  if (tl_streams.size() <= static_cast<std::size_t>(device)) tl_streams.resize(device + 1, nullptr);
  previous_ = tl_streams[device];
  tl_streams[device] = stream;
}

CudaStreamGuard::~CudaStreamGuard() { tl_streams[device_] = previous_; }

// ---- CudaBackend: devices, streams, handles -------------------------------------------------

CudaBackend& CudaBackend::instance() {
  // Never destroyed: Note [Process-lifetime CUDA objects].
  static CudaBackend* backend = new CudaBackend();
  return *backend;
}

CudaBackend::CudaBackend()
    : map_(LogicalDeviceMap::from_env(probe_device_count())), device_count_(map_.count()) {
  devices_ = std::make_unique<DeviceState[]>(device_count_ > 0 ? device_count_ : 1);
  const int gpus = map_.physical_count();
  const int pairs = gpus * gpus;
  peer_once_ = std::make_unique<std::once_flag[]>(pairs > 0 ? pairs : 1);
  peer_ok_ = std::make_unique<bool[]>(pairs > 0 ? pairs : 1);
  if (map_.logical() && gpus > 0)
    dp::detail::log_warning(dp::detail::str_cat(
        kDevicesPerGpuEnv, "=", map_.per_gpu(), ": ", device_count_, " dp CUDA devices on ", gpus,
        " GPU(s), cuda:i on GPU i / ", map_.per_gpu(),
        "; collectives use the CUDA copy communicator, not NCCL (Note [Logical CUDA devices])"));
  register_kernels();
}

void CudaBackend::check_device(Device dev) const {
  DP_CHECK(dev.type == DeviceType::CUDA, "CUDA backend: expected a CUDA device, got ", dev);
  DP_CHECK(dev.index >= 0 && dev.index < device_count_, "CUDA backend: device ", dev,
           " out of range: ", device_count_, " CUDA device(s) visible");
}

void CudaBackend::set_device(int device) {
  const int gpu = map_.physical(device);  // checks the range
  cuda_detail::note_thread_device(device, gpu);  // errors name the dp device
  if (tl_device == gpu) return;
  DP_CUDA_CHECK(cudaSetDevice(gpu));
  tl_device = gpu;
}

void CudaBackend::invalidate_device_cache() { tl_device = -1; }

CudaBackend::DeviceState& CudaBackend::state(int device) {
  DeviceState& st = devices_[device];
  std::call_once(st.init, [&] {
    set_device(device);
    DP_CUDA_CHECK(cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking));
    DP_CUDA_CHECK(cudaStreamCreateWithFlags(&st.inbound, cudaStreamNonBlocking));
    DP_CUBLAS_CHECK(cublasCreate(&st.cublas));
    // The math mode is set per GEMM from dp::allow_tf32_matmul() (Note [TF32 policy]).
    DP_CUDNN_CHECK(cudnnCreate(&st.cudnn));
    st.allocator = std::make_unique<CachingAllocator>(device);
  });
  return st;
}

cudaStream_t CudaBackend::default_stream(int device) {
  DP_CHECK(device >= 0 && device < device_count_, "CUDA backend: device cuda:", device,
           " out of range: ", device_count_, " CUDA device(s) visible");
  return state(device).stream;
}

cudaStream_t CudaBackend::compute_stream(int device) {
  if (static_cast<std::size_t>(device) < tl_streams.size() && tl_streams[device])
    return tl_streams[device];
  return default_stream(device);
}

cudaStream_t CudaBackend::bind(Device dev) {
  check_device(dev);
  set_device(dev.index);
  return compute_stream(dev.index);
}

cudaStream_t CudaBackend::create_stream(int device, int priority) {
  DP_CHECK(device >= 0 && device < device_count_, "create_stream: device cuda:", device,
           " out of range");
  state(device);
  set_device(device);
  cudaStream_t s = nullptr;
  DP_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  std::lock_guard<std::mutex> lock(streams_mu_);
  extra_streams_.emplace_back(device, s);
  return s;
}

HandleLease<cublasHandle_t> CudaBackend::cublas(int device) {
  cudaStream_t s = compute_stream(device);
  DeviceState& st = state(device);
  std::unique_lock<std::mutex> lock(st.handle_mu);
  DP_CUBLAS_CHECK(cublasSetStream(st.cublas, s));
  return HandleLease<cublasHandle_t>(std::move(lock), st.cublas);
}

HandleLease<cudnnHandle_t> CudaBackend::cudnn(int device) {
  cudaStream_t s = compute_stream(device);
  DeviceState& st = state(device);
  std::unique_lock<std::mutex> lock(st.handle_mu);
  DP_CUDNN_CHECK(cudnnSetStream(st.cudnn, s));
  return HandleLease<cudnnHandle_t>(std::move(lock), st.cudnn);
}

CachingAllocator& CudaBackend::allocator(int device) {
  DP_CHECK(device >= 0 && device < device_count_, "allocator: device cuda:", device,
           " out of range");
  return *state(device).allocator;
}

CudaBackend::Scratch::Scratch(CudaBackend& b, int device, std::size_t nbytes)
    : alloc_(&b.allocator(device)), ptr_(alloc_->allocate(nbytes, b.compute_stream(device))) {}

CudaBackend::Scratch::~Scratch() { alloc_->deallocate(ptr_); }

cudaEvent_t CudaBackend::acquire_event(int device) {
  DeviceState& st = state(device);
  {
    std::lock_guard<std::mutex> lock(st.event_mu);
    if (!st.events.empty()) {
      cudaEvent_t ev = st.events.back();
      st.events.pop_back();
      return ev;
    }
  }
  set_device(device);
  cudaEvent_t ev = nullptr;
  DP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}

void CudaBackend::release_event(int device, cudaEvent_t ev) {
  DeviceState& st = devices_[device];
  std::lock_guard<std::mutex> lock(st.event_mu);
  st.events.push_back(ev);
}

bool CudaBackend::enable_peer_access(int a, int b) {
  const int pa = map_.physical(a), pb = map_.physical(b);
  if (pa == pb) return true;  // two dp devices of one GPU (Note [Logical CUDA devices])
  const int pair = pa * map_.physical_count() + pb;
  std::call_once(peer_once_[pair], [&] {
    int can = 0;
    DP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, pa, pb));
    if (!can) return;  // cudaMemcpyPeerAsync still works, staged through the host
    set_device(a);
    const cudaError_t err = cudaDeviceEnablePeerAccess(pb, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled || err == cudaSuccess) {
      (void)cudaGetLastError();
      peer_ok_[pair] = true;
    } else {
      // Too many peers (a limit of 8 per device on some systems) is not fatal: the copy
      // falls back to staging. Say so once.
      (void)cudaGetLastError();
      dp::detail::log_warning(dp::detail::str_cat("GPU ", pa, " cannot enable peer access to GPU ", pb, " (",
                                                  cudaGetErrorString(err),
                                                  "); copies between them go through the host"));
    }
  });
  return peer_ok_[pair];
}

// ---- Backend: threads and streams ------------------------------------------------------------

void CudaBackend::set_current_device(Device dev) {
  check_device(dev);
  set_device(dev.index);
}

// Each GPU computes on its own SMs: there are no host cores to share out.
void CudaBackend::set_concurrent_devices(int) {}
int CudaBackend::threads_per_device(Device) { return 0; }

// Host work on a GPU's behalf runs on the thread that drives the GPU: no host cores
// are set aside per CUDA device.
void CudaBackend::host_parallel_for(Device dev, std::int64_t n, RangeFn f) {
  check_device(dev);
  if (n > 0) f(0, n);
}

void CudaBackend::synchronize(Device dev) {
  check_device(dev);
  set_device(dev.index);
  if (!map_.logical()) {
    DP_CUDA_CHECK(cudaDeviceSynchronize());
    return;
  }
  // A GPU shared by several dp devices: only this device's streams (Note [Logical CUDA
  // devices]); the legacy stream is not used by dp.
  DeviceState& st = state(dev.index);
  DP_CUDA_CHECK(cudaStreamSynchronize(st.stream));
  DP_CUDA_CHECK(cudaStreamSynchronize(st.inbound));
  std::vector<cudaStream_t> mine;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    for (const auto& [d, s] : extra_streams_)
      if (d == dev.index) mine.push_back(s);
  }
  for (cudaStream_t s : mine) DP_CUDA_CHECK(cudaStreamSynchronize(s));
}

std::unique_ptr<Event> CudaBackend::create_event(Device dev) {
  check_device(dev);
  return std::make_unique<CudaEvent>(dev.index);
}

void CudaBackend::record_event(Event& ev, Device dev) {
  auto* ce = dynamic_cast<CudaEvent*>(&ev);
  DP_CHECK(ce, "record_event: expected an event created by the CUDA backend");
  DP_CHECK(ce->device() == dev.index, "record_event: the event belongs to cuda:", ce->device(),
           ", not to ", dev, " (an event is recorded on its own device's stream)");
  cudaStream_t s = bind(dev);
  DP_CUDA_CHECK(cudaEventRecord(ce->get(), s));
}

void CudaBackend::wait_event(Event& ev, Device dev) {
  auto* ce = dynamic_cast<CudaEvent*>(&ev);
  DP_CHECK(ce, "wait_event: expected an event created by the CUDA backend");
  cudaStream_t s = bind(dev);  // may wait on another device's event: no host wait
  DP_CUDA_CHECK(cudaStreamWaitEvent(s, ce->get(), 0));
}

// Note [Profiler ranges]: dp's ranges live in an NVTX domain of their own, "dp", so
// `nsys profile --nvtx-domain-include=dp` (or the report's domain filter) separates
// them from cuDNN's and NCCL's own. The domain is created on the first range, by
// whichever thread opens it (nvtxDomainCreateA is thread-safe). NVTX calls return the
// nesting depth, or a negative value when no tool is attached or the tool does not
// track depth: no result signals a failure, so there is nothing to check.
namespace {
nvtxDomainHandle_t dp_domain() {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("dp");
  return domain;
}
}  // namespace

void CudaBackend::range_push(Device /*dev*/, const char* name) {
  nvtxEventAttributes_t attr{};
  attr.version = NVTX_VERSION;
  attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
  attr.message.ascii = name;
  (void)nvtxDomainRangePushEx(dp_domain(), &attr);
}

void CudaBackend::range_pop(Device /*dev*/) noexcept { (void)nvtxDomainRangePop(dp_domain()); }

// ---- Backend: memory ------------------------------------------------------------------------------

void* CudaBackend::allocate(Device dev, std::size_t nbytes) {
  cudaStream_t s = bind(dev);
  void* p = state(dev.index).allocator->allocate(nbytes, s);
  if (poison_memory() && nbytes > 0) {  // Note [Poisoned memory]
    const cudaError_t err = cudaMemsetAsync(p, 0xff, nbytes, s);
    if (err != cudaSuccess) state(dev.index).allocator->deallocate(p);
    DP_CUDA_CHECK(err);
  }
  return p;
}

void CudaBackend::deallocate(Device dev, void* ptr, std::size_t) noexcept {
  if (!ptr) return;
  if (dev.type != DeviceType::CUDA || dev.index < 0 || dev.index >= device_count_) {
    dp::detail::log_warning(dp::detail::str_cat("deallocate: bad device ", dev, " — ignored"));
    return;
  }
  try {
    set_device(dev.index);
  } catch (const std::exception& e) {
    dp::detail::log_warning(e.what());
  }
  devices_[dev.index].allocator->deallocate(ptr);
}

std::size_t CudaBackend::memory_allocated(Device dev) {
  check_device(dev);
  return state(dev.index).allocator->allocated();
}

std::size_t CudaBackend::max_memory_allocated(Device dev) {
  check_device(dev);
  return state(dev.index).allocator->max_allocated();
}

void CudaBackend::reset_peak_memory(Device dev) {
  check_device(dev);
  state(dev.index).allocator->reset_peak();
}

void CudaBackend::empty_cache(Device dev) {
  check_device(dev);
  set_device(dev.index);
  state(dev.index).allocator->empty_cache();
}

void* CudaBackend::allocate_pinned(std::size_t nbytes) {
  DP_CHECK(device_count_ > 0, "pinned host memory: expected a visible CUDA device, found none");
  return host_alloc_.allocate(nbytes);
}

void CudaBackend::deallocate_pinned(void* ptr, std::size_t) noexcept { host_alloc_.deallocate(ptr); }

std::size_t CudaBackend::pinned_memory_allocated() { return host_alloc_.allocated(); }

// Note [Peer copies]
// A copy between two devices is pulled by the destination, on its inbound stream, and
// never makes either device's compute stream wait for the other's earlier work:
//   1. `src_ready` is recorded on the source's current stream (the producer of the
//      bytes, e.g. the H2D copy of a batch, is enqueued there) and the destination's
//      inbound stream waits for it; inside a CopyFences::Scope the inbound stream
//      waits for the source's fence instead, recorded when the step began (Note
//      [Copy fences] in backend.h: the current position may wait for a collective
//      that needs the destination, a deadlock);
//   2. the bytes are copied on the inbound stream into a staging block allocated on
//      that stream — not into `dst`: `dst` was allocated on the destination's compute
//      stream and may be a block that the destination's previous step still reads, so
//      writing it directly would have to wait for that step first;
//   3. `copied` is recorded on the inbound stream; the source's stream waits for it
//      (later source work may overwrite or free the bytes only after they were read:
//      the wait covers this copy and earlier inbound copies, which depend on nothing
//      but their own sources), and so does the destination's compute stream, which
//      then copies staging → dst (device-local bandwidth, a few percent of the peer
//      copy) in its own order, after its own earlier work;
//   4. the staging block is declared used by the compute stream and freed: the
//      allocator reuses it only after that copy (Note [Caching allocator streams]).
// So scattering a batch on cuda:0 to seven devices runs seven copies concurrently on
// seven inbound streams, and cuda:0's stream waits for the copies alone — never for
// another device's previous step, which the earlier scheme (copy on the source
// stream after waiting for an event on the destination stream, PyTorch's copy_
// barrier) made it do. The same holds the other way for gathers to cuda:0. Two
// devices of one GPU (Note [Logical CUDA devices]) take the same path with a plain
// device-to-device cudaMemcpyAsync. No host wait anywhere.
void CudaBackend::copy(void* dst, Device dst_dev, const void* src, Device src_dev,
                       std::size_t nbytes) {
  check_device(dst_dev);
  check_device(src_dev);
  if (nbytes == 0) return;
  if (dst_dev == src_dev) {
    cudaStream_t s = bind(dst_dev);
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  land_peer_copy(dst, dst_dev, start_peer_copy(dst_dev, src, src_dev, nbytes), nbytes);
}

void CudaBackend::copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                            std::size_t row_bytes, std::size_t rows, Device dev) {
  check_device(dev);
  check_copy_rows(dev, dst_pitch, src_pitch, row_bytes);
  if (rows == 0 || row_bytes == 0) return;
  cudaStream_t s = bind(dev);
  if (rows == 1 || (dst_pitch == row_bytes && src_pitch == row_bytes)) {  // one contiguous block
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, src, rows * row_bytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  // cudaMemcpy2DAsync refuses pitches above the device's cudaDevAttrMaxPitch (2^31 - 1
  // bytes on current GPUs): rows that far apart go one copy each.
  if (std::max(dst_pitch, src_pitch) > static_cast<std::size_t>(INT_MAX)) {
    int max_pitch = 0;
    DP_CUDA_CHECK(cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, map_.physical(dev.index)));
    if (std::max(dst_pitch, src_pitch) > static_cast<std::size_t>(max_pitch)) {
      Backend::copy_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows, dev);
      return;
    }
  }
  DP_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDeviceToDevice, s));
}

CudaBackend::InFlight CudaBackend::start_peer_copy(Device dst_dev, const void* src, Device src_dev,
                                                   std::size_t nbytes) {
  const int d = dst_dev.index, sdev = src_dev.index;
  const int dst_gpu = map_.physical(d), src_gpu = map_.physical(sdev);
  if (dst_gpu != src_gpu) enable_peer_access(d, sdev);
  cudaStream_t src_stream = bind(src_dev);
  // Note [Copy fences]: inside a DataParallel step, after the fence recorded when the
  // step began, not after the source's current position (which may wait for a
  // collective that needs this destination's later work).
  Event* fence = CopyFences::current(src_dev);
  cudaEvent_t src_ready = nullptr;
  if (fence != nullptr) {
    auto* ce = dynamic_cast<CudaEvent*>(fence);
    DP_CHECK(ce != nullptr && ce->device() == sdev, "copy: the copy fence of ", src_dev,
             " is not a CUDA event of that device");
    src_ready = ce->get();
  } else {
    src_ready = acquire_event(sdev);
    DP_CUDA_CHECK(cudaEventRecord(src_ready, src_stream));
  }
  DeviceState& dst_state = state(d);
  (void)bind(dst_dev);  // the destination initialised and current
  cudaStream_t inbound = dst_state.inbound;
  DP_CUDA_CHECK(cudaStreamWaitEvent(inbound, src_ready, 0));
  if (fence == nullptr) release_event(sdev, src_ready);  // the wait captured the record: reusable
  CachingAllocator& alloc = *dst_state.allocator;
  InFlight f;
  f.staging = alloc.allocate(nbytes, inbound);
  // From here the staging block must be given back on every path: the allocator's
  // deallocate never throws, and the stream declarations only add uses.
  try {
    if (dst_gpu == src_gpu) {
      DP_CUDA_CHECK(cudaMemcpyAsync(f.staging, src, nbytes, cudaMemcpyDeviceToDevice, inbound));
    } else {
      DP_CUDA_CHECK(cudaMemcpyPeerAsync(f.staging, dst_gpu, src, src_gpu, nbytes, inbound));
    }
    f.copied = acquire_event(d);
    DP_CUDA_CHECK(cudaEventRecord(f.copied, inbound));
    DP_CUDA_CHECK(cudaStreamWaitEvent(src_stream, f.copied, 0));
  } catch (...) {
    drop_peer_copy(dst_dev, f);
    throw;
  }
  return f;
}

void CudaBackend::land_peer_copy(void* dst, Device dst_dev, InFlight f, std::size_t nbytes) {
  const int d = dst_dev.index;
  CachingAllocator& alloc = *state(d).allocator;
  try {
    cudaStream_t dst_stream = bind(dst_dev);
    DP_CUDA_CHECK(cudaStreamWaitEvent(dst_stream, f.copied, 0));
    DP_CUDA_CHECK(cudaMemcpyAsync(dst, f.staging, nbytes, cudaMemcpyDeviceToDevice, dst_stream));
    alloc.record_stream(f.staging, dst_stream);
  } catch (...) {
    drop_peer_copy(dst_dev, f);
    throw;
  }
  drop_peer_copy(dst_dev, f);  // the waits captured `copied`; the block's uses are declared
}

void CudaBackend::drop_peer_copy(Device dst_dev, InFlight f) noexcept {
  const int d = dst_dev.index;
  // The staging block was written on the inbound stream only (and read on the
  // destination's stream once landed, declared): stream-ordered reuse is safe.
  state(d).allocator->deallocate(f.staging);
  if (f.copied == nullptr) return;
  try {
    release_event(d, f.copied);
  } catch (const std::exception& e) {  // only the pool's growth can fail: the event leaks
    dp::detail::log_warning(
        dp::detail::str_cat("copy to ", dst_dev, ": an event could not go back to its pool: ", e.what()));
  }
}

// Note [Copies ahead] in backend.h: the transfer starts now; the destination's stream
// waits for it, and the staging → dst copy is enqueued there, only at finish_copy.
// Within one device there is no transfer to overlap: the copy is made at finish_copy.
struct CudaBackend::AheadCopy final : PendingCopy {
  CudaBackend* backend = nullptr;
  Device dst_dev;
  const void* src = nullptr;  // one device: the source, copied at finish_copy
  std::size_t nbytes = 0;
  InFlight f;                 // two devices: the transfer under way
  bool finished = false;
  ~AheadCopy() override {
    if (!finished && f.staging != nullptr) backend->drop_peer_copy(dst_dev, f);
  }
};

std::unique_ptr<PendingCopy> CudaBackend::copy_ahead(Device dst_dev, const void* src, Device src_dev,
                                                     std::size_t nbytes) {
  check_device(dst_dev);
  check_device(src_dev);
  auto p = std::make_unique<AheadCopy>();
  p->backend = this;
  p->dst_dev = dst_dev;
  p->nbytes = nbytes;
  if (dst_dev == src_dev || nbytes == 0) {
    p->src = src;
  } else {
    p->f = start_peer_copy(dst_dev, src, src_dev, nbytes);
  }
  return p;
}

void CudaBackend::finish_copy(PendingCopy& pending, void* dst, Device dst_dev) {
  auto* p = dynamic_cast<AheadCopy*>(&pending);
  DP_CHECK(p != nullptr && p->backend == this, "finish_copy: the copy was not started by copy_ahead of the CUDA backend");
  DP_CHECK(p->dst_dev == dst_dev, "finish_copy: the copy was started towards ", p->dst_dev, ", not ", dst_dev);
  DP_CHECK(!p->finished, "finish_copy: the copy to ", dst_dev, " was finished already");
  p->finished = true;  // from here the transfer is given back by land_peer_copy, whatever happens
  if (p->f.staging == nullptr) {
    if (p->nbytes > 0) DP_CUDA_CHECK(cudaMemcpyAsync(dst, p->src, p->nbytes, cudaMemcpyDeviceToDevice, bind(dst_dev)));
    return;
  }
  land_peer_copy(dst, dst_dev, std::exchange(p->f, InFlight{}), p->nbytes);
}

void CudaBackend::copy_from_host(void* dst, Device dev, const void* host_src, std::size_t nbytes) {
  if (nbytes == 0) return;
  cudaStream_t s = bind(dev);
  // Pinned source: truly asynchronous; the event recorded after the copy keeps the
  // block from reuse until the copy has read it (Note [Pinned block reuse]). Pageable
  // source: the runtime stages it before returning, so it may be reused at once.
  DP_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, nbytes, cudaMemcpyHostToDevice, s));
  host_alloc_.record_use(host_src, dev.index, s);
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, Device dev, std::size_t nbytes) {
  if (nbytes == 0) return;
  cudaStream_t s = bind(dev);
  DP_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, nbytes, cudaMemcpyDeviceToHost, s));
  DP_CUDA_CHECK(cudaStreamSynchronize(s));  // the contract: data is on the host at return
}

void CudaBackend::memset_zero(void* ptr, Device dev, std::size_t nbytes) {
  if (nbytes == 0) return;
  cudaStream_t s = bind(dev);
  DP_CUDA_CHECK(cudaMemsetAsync(ptr, 0, nbytes, s));
}

// ---- Backend: kernels (launchers in cuda_kernels.h) ------------------------------------------------

namespace k = cuda_kernels;

void CudaBackend::fill_uniform(Device dev, float* y, std::int64_t n, float lo, float hi,
                               std::uint64_t seed, std::uint64_t offset) {
  k::fill_uniform(bind(dev), y, n, lo, hi, seed, offset);
}
void CudaBackend::fill_normal(Device dev, float* y, std::int64_t n, float mean, float std,
                              std::uint64_t seed, std::uint64_t offset) {
  k::fill_normal(bind(dev), y, n, mean, std, seed, offset);
}
void CudaBackend::dropout(Device dev, const float* x, float* y, float* mask, std::int64_t n,
                          float p, std::uint64_t seed, std::uint64_t offset) {
  k::dropout(bind(dev), x, y, mask, n, p, seed, offset);
}

void CudaBackend::log_softmax(Device dev, const float* x, float* y, std::int64_t rows,
                              std::int64_t cols) {
  k::log_softmax(bind(dev), x, y, rows, cols);
}
void CudaBackend::log_softmax_backward(Device dev, const float* gy, const float* y, float* gx,
                                       std::int64_t rows, std::int64_t cols) {
  k::log_softmax_backward(bind(dev), gy, y, gx, rows, cols);
}
void CudaBackend::nll_forward(Device dev, const float* logp, const std::int64_t* target,
                              float* loss, std::int64_t rows, std::int64_t cols, std::int64_t ignore_index) {
  k::nll_forward(bind(dev), logp, target, loss, rows, cols, ignore_index);
}
void CudaBackend::nll_backward(Device dev, const float* gloss, const std::int64_t* target,
                               float* gx, std::int64_t rows, std::int64_t cols, std::int64_t ignore_index) {
  k::nll_backward(bind(dev), gloss, target, gx, rows, cols, ignore_index);
}

void CudaBackend::maxpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y,
                                    std::int64_t* indices) {
  k::maxpool2d_forward(bind(dev), s, x, y, indices);
}
void CudaBackend::maxpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                                     const std::int64_t* indices, float* gx) {
  k::maxpool2d_backward(bind(dev), s, gy, indices, gx);
}
void CudaBackend::avgpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y) {
  k::avgpool2d_forward(bind(dev), s, x, y);
}
void CudaBackend::avgpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                                     float* gx) {
  k::avgpool2d_backward(bind(dev), s, gy, gx);
}

void CudaBackend::batchnorm_forward_train(Device dev, std::int64_t N, std::int64_t C,
                                          std::int64_t HW, const float* x, const float* gamma,
                                          const float* beta, float eps, float momentum,
                                          float* running_mean, float* running_var, float* y,
                                          float* save_mean, float* save_invstd) {
  k::batch_norm_train(*this, dev,
                      {N, C, HW, x, gamma, beta, eps, momentum, running_mean, running_var, y, save_mean, save_invstd},
                      DType::F32);
}
void CudaBackend::batchnorm_forward_eval(Device dev, std::int64_t N, std::int64_t C,
                                         std::int64_t HW, const float* x, const float* gamma,
                                         const float* beta, float eps, const float* running_mean,
                                         const float* running_var, float* y) {
  k::batch_norm_eval(*this, dev, {N, C, HW, x, gamma, beta, eps, running_mean, running_var, y}, DType::F32);
}
void CudaBackend::batchnorm_backward(Device dev, std::int64_t N, std::int64_t C, std::int64_t HW,
                                     const float* gy, const float* x, const float* gamma,
                                     const float* save_mean, const float* save_invstd, float* gx,
                                     float* ggamma, float* gbeta) {
  k::batch_norm_backward(*this, dev, {N, C, HW, gy, x, gamma, save_mean, save_invstd, gx, ggamma, gbeta},
                         DType::F32);
}

void CudaBackend::sgd_step(Device dev, float* param, const float* grad, float* momentum_buf,
                           std::int64_t n, double lr, double momentum, double dampening,
                           double weight_decay, bool nesterov, bool first_step) {
  k::sgd_step(bind(dev), param, grad, momentum_buf, n, lr, momentum, dampening, weight_decay,
              nesterov, first_step);
}
void CudaBackend::adam_step(Device dev, float* param, const float* grad, float* exp_avg,
                            float* exp_avg_sq, std::int64_t n, double lr, double beta1,
                            double beta2, double eps, double weight_decay, bool decoupled,
                            std::int64_t step) {
  k::adam_step(bind(dev), param, grad, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps,
               weight_decay, decoupled, step);
}

std::string CudaBackend::attention_shape_misfit(Device dev, const AttentionShape& s) const {
  check_device(dev);
  return k::attention_misfit(s, physical_device(dev.index));
}

// ---- the kernel table (Note [The op list] in ops.h) -----------------------------------------

void CudaBackend::register_kernels() {
  cuda_kernels::register_elementwise_kernels(*this);  // cuda_elementwise.cu
  cuda_kernels::register_reduce_kernels(*this);       // cuda_reduce.cu
  cuda_kernels::register_nn_kernels(*this);           // cuda_nn.cu: the fused layer norm
  cuda_kernels::register_attention_kernels(*this);    // cuda_attention.cu
  cuda_kernels::register_blas_kernels(*this);         // cuda_blas_dnn.cpp: the 16-bit GEMMs and convolutions
  for (const MethodKernel& m : method_kernels<CudaBackend>()) register_kernel(m.op, DType::F32, m.fn);
}

// Declared in backend/backend.cpp.
Backend& cuda_backend() { return CudaBackend::instance(); }

}  // namespace dp::backend
