// CPU backend: virtual devices, task arenas, memory and copies.
#include "backend/cpu/cpu_backend.h"

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>

#include "backend/method_kernels.h"
#include "dp/core/error.h"

namespace dp::backend {

Backend& cpu_backend() { return cpu::cpu_backend_impl(); }

namespace cpu {
namespace {

/// Alignment of every allocation: one cache line, and the widest (AVX-512) vector.
constexpr std::size_t kAlignment = 64;

/// On CPU every call has finished when it returns, so events order nothing.
class CpuEvent final : public Event {};

// Note [DP_CPU_THREADS]
// DP_CPU_THREADS=<n> caps every device's arena and OpenMP team at n threads. With 1,
// every kernel runs on the thread that calls it (parallel_for/parallel_chunks take
// their serial path and oneDNN gets a team of one), so the only threads touching
// tensor memory are dp's own workers. ThreadSanitizer cannot see the synchronisation
// inside oneTBB and libgomp (they are not instrumented); scripts/sanitize.sh runs
// the TSan suites with DP_CPU_THREADS=1 so that every report is about dp's code.
// Also useful to pin a run to a fixed thread budget. Unset or empty: no cap.
constexpr int kMaxCpuThreads = 4096;  // far above any host; rejects typos like 1e9

int thread_cap_from_env() {
  const char* env = std::getenv("DP_CPU_THREADS");
  if (!env || !*env) return kMaxCpuThreads;
  char* end = nullptr;
  long n = std::strtol(env, &end, 10);
  DP_CHECK(end && *end == '\0' && n >= 1 && n <= kMaxCpuThreads,
           "DP_CPU_THREADS: expected an integer in [1, ", kMaxCpuThreads, "], got '", env, "'");
  return static_cast<int>(n);
}

}  // namespace

CpuBackend& cpu_backend_impl() {
  static CpuBackend backend;
  return backend;
}

CpuBackend::CpuBackend() : conv_layout_(ConvLayout::Auto) {
  const int n = dp::device_count(DeviceType::CPU);
  devices_.reserve(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    devices_.push_back(std::make_unique<DeviceState>());
    devices_.back()->conv.reset(new_conv_cache());
  }
  // Default: one device works at a time and gets every core (docs/architecture.md, "CPU virtual devices").
  resize_arenas(dp::hardware_concurrency());
  register_method_kernels();  // first: the convolution's and the pools' are replaced below
  register_elementwise_kernels();
  register_reduce_kernels();
  register_gemm_kernels();
  register_conv_kernels();
  register_pool_kernels();
  register_layer_norm_kernels();
  register_batch_norm_kernels();
  register_attention_kernels();
}

void CpuBackend::register_method_kernels() {
  for (const MethodKernel& k : method_kernels<CpuBackend>()) register_kernel(k.op, DType::F32, k.fn);
}

CpuBackend::~CpuBackend() = default;

int CpuBackend::device_count() { return static_cast<int>(devices_.size()); }

DeviceState& CpuBackend::state(Device dev) {
  DP_CHECK(dev.is_cpu() && dev.index >= 0 && dev.index < static_cast<int>(devices_.size()),
           "cpu backend: expected a CPU device cpu:0..cpu:", devices_.size() - 1, ", got ",
           dev.str());
  return *devices_[static_cast<std::size_t>(dev.index)];
}

void CpuBackend::resize_arenas(int threads) {
  static const int cap = thread_cap_from_env();  // Note [DP_CPU_THREADS]
  threads = std::min(threads, cap);
  for (auto& d : devices_) {
    // A fresh arena rather than terminate()+initialize(): cheap, and never touches an
    // arena some other thread might still hold a reference to between kernels.
    d->arena = std::make_unique<tbb::task_arena>(threads);
    d->threads.store(threads);
  }
}

void CpuBackend::set_current_device(Device dev) { (void)state(dev); }

void CpuBackend::set_concurrent_devices(int count) {
  DP_CHECK(count >= 1, "set_concurrent_devices: expected a device count >= 1, got ", count);
  std::lock_guard<std::mutex> lock(config_mu_);
  resize_arenas(std::max(1, dp::hardware_concurrency() / count));
}

int CpuBackend::threads_per_device(Device dev) { return state(dev).threads.load(); }

void CpuBackend::host_parallel_for(Device dev, std::int64_t n, RangeFn f) {
  parallel_for(dev, n, kSerialGrain, f);
}

void CpuBackend::synchronize(Device dev) { (void)state(dev); }

std::unique_ptr<Event> CpuBackend::create_event(Device dev) {
  (void)state(dev);
  return std::make_unique<CpuEvent>();
}
void CpuBackend::record_event(Event&, Device dev) { (void)state(dev); }
void CpuBackend::wait_event(Event&, Device dev) { (void)state(dev); }

// ---- memory -------------------------------------------------------------------------

// Note [CPU caching allocator]
// A training step allocates the same activations and gradients every step: for the
// Fashion-MNIST CNN at batch 256, a dozen blocks of 6-26 MB. glibc serves blocks above
// its mmap threshold with mmap and gives them back with munmap, so every step paid a
// page fault and a kernel zero-fill per 4 KiB page of every activation (about 50k
// faults per step), and whether it did depended on glibc's dynamic threshold and on
// MALLOC_* environment variables. Like the CUDA backend's caching allocator, each
// device therefore keeps its freed blocks of at least kCacheMinBytes in free lists by
// size class and hands them out again: a block reused from the cache is already
// mapped and resident. Size classes are 8 per power of two (at most 12.5% slack), so
// shapes that differ a little (the last, smaller batch) still reuse blocks. Blocks
// below kCacheMinBytes go to malloc, whose heap already reuses them without faults.
// The counters (memory_allocated, peak) count the bytes asked for by live tensors,
// not the cache, as torch.cuda.memory_allocated does. Bounds: a device caches at most
// kMaxCachedBytes (a freed block beyond it goes back to the system), an allocation
// that fails empties every device's cache and retries once, and empty_cache() gives
// everything back. AddressSanitizer builds cache nothing, so a use after free of a
// large tensor is still reported.
namespace {

/// Blocks at least this large are cached: twice glibc's initial mmap threshold (128 KiB),
/// where malloc stops reusing freed memory by itself.
constexpr std::size_t kCacheMinBytes = std::size_t{256} << 10;
/// Most bytes one device keeps in its cache: far above a training step's working set
/// of the models here (~300 MB for the CNN at batch 256), far below the host's memory.
constexpr std::size_t kMaxCachedBytes = std::size_t{1} << 30;

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kCacheBlocks = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kCacheBlocks = false;
#else
constexpr bool kCacheBlocks = true;
#endif
#else
constexpr bool kCacheBlocks = true;
#endif

/// The bytes a request of `nbytes` really allocates: one cache line for tiny ones,
/// a multiple of the alignment, and for cached sizes the next of 8 classes per power
/// of two.
std::size_t block_size(std::size_t nbytes) {
  std::size_t r = std::max(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
  if (!kCacheBlocks || r < kCacheMinBytes) return r;
  const std::size_t step = std::bit_floor(r) / 8;
  return (r + step - 1) / step * step;
}

// Note [Huge pages for large blocks]
// Debian's kernels back anonymous memory with 2 MiB pages only where a program asks
// (transparent_hugepage=madvise). A step's large blocks are streamed whole, again and
// again: 4 KiB pages cost a TLB miss every 4 KiB (the L2 TLB reaches 12 MiB on the
// EPYCs here; the MLP 784-1024-1024-10 at batch 512 keeps ~40 MiB live). So a block of
// at least one huge page is aligned to 2 MiB and its whole huge pages are marked
// MADV_HUGEPAGE. Nothing else changes: the size is not rounded up (the tail past the
// last whole huge page keeps small pages), the cache keeps the block, and where the
// kernel has THP off or no huge page free, madvise changes nothing or fails, and the
// block simply keeps small pages. The MLP's step gains a little, the CNN's nothing
// (figures: docs/benchmarks/kernel-notes.md, "Huge pages for large blocks").
constexpr std::size_t kHugePage = std::size_t{2} << 20;

void* system_alloc(std::size_t size) {
  if (size < kHugePage) return std::aligned_alloc(kAlignment, size);
  void* p = nullptr;  // posix_memalign: no size-multiple rule, unlike aligned_alloc
  if (::posix_memalign(&p, kHugePage, size) != 0) return nullptr;
  (void)::madvise(p, size / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice only
  return p;
}

}  // namespace

BlockCache::~BlockCache() { release(); }

std::size_t BlockCache::release() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [size, blocks] : free)
    for (void* p : blocks) std::free(p);
  free.clear();
  const std::size_t released = cached_bytes;
  cached_bytes = 0;
  return released;
}

void* CpuBackend::allocate(Device dev, std::size_t nbytes) {
  DeviceState& st = state(dev);
  // aligned_alloc needs a size that is a multiple of the alignment; a zero-byte request
  // still gets one line, so every allocation is a unique non-null pointer.
  const std::size_t size = block_size(nbytes);
  DP_CHECK(size >= nbytes, "allocate on ", dev.str(), ": size ", nbytes, " bytes overflows");
  void* p = nullptr;
  if (size >= kCacheMinBytes && kCacheBlocks) {
    std::lock_guard<std::mutex> lock(st.blocks.mu);
    auto it = st.blocks.free.find(size);
    if (it != st.blocks.free.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      st.blocks.cached_bytes -= size;
    }
  }
  if (!p) p = system_alloc(size);
  if (!p && kCacheBlocks) {  // the caches may hold what the system lacks
    empty_cache();
    p = system_alloc(size);
  }
  DP_CHECK(p != nullptr, "allocate on ", dev.str(), ": out of memory allocating ", nbytes,
           " bytes (", st.allocated.load(), " bytes in use on this device); free tensors or "
           "use a smaller batch");
  if (poison_memory() && nbytes > 0) std::memset(p, 0xff, nbytes);  // Note [Poisoned memory]
  const std::size_t now = st.allocated.fetch_add(nbytes) + nbytes;
  std::size_t peak = st.peak.load();
  while (now > peak && !st.peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void CpuBackend::deallocate(Device dev, void* ptr, std::size_t nbytes) noexcept {
  if (!ptr) return;
  if (!(dev.is_cpu() && dev.index >= 0 && dev.index < static_cast<int>(devices_.size()))) {
    std::free(ptr);
    dp::detail::log_warning(dp::detail::str_cat("cpu backend: deallocate on invalid device ",
                                                dev.str(), " (", nbytes, " bytes)"));
    return;
  }
  DeviceState& st = *devices_[static_cast<std::size_t>(dev.index)];
  st.allocated.fetch_sub(nbytes);
  const std::size_t size = block_size(nbytes);
  if (size >= kCacheMinBytes && kCacheBlocks) {
    try {
      std::lock_guard<std::mutex> lock(st.blocks.mu);
      if (st.blocks.cached_bytes + size <= kMaxCachedBytes) {
        st.blocks.free[size].push_back(ptr);  // may throw bad_alloc: then free below
        st.blocks.cached_bytes += size;
        return;
      }
    } catch (...) {
    }
  }
  std::free(ptr);
}

std::size_t CpuBackend::cached_bytes(Device dev) {
  DeviceState& st = state(dev);
  std::lock_guard<std::mutex> lock(st.blocks.mu);
  return st.blocks.cached_bytes;
}

void CpuBackend::empty_cache() {
  for (auto& d : devices_) d->blocks.release();
}

std::size_t CpuBackend::memory_allocated(Device dev) { return state(dev).allocated.load(); }
std::size_t CpuBackend::max_memory_allocated(Device dev) { return state(dev).peak.load(); }
void CpuBackend::reset_peak_memory(Device dev) {
  DeviceState& st = state(dev);
  st.peak.store(st.allocated.load());
}

// Pinned host memory: virtual devices read host memory directly, so "pinned" memory is
// ordinary aligned host memory. It is counted apart from every device's allocations,
// as page-locked host memory is apart from GPU memory: a batch pinned by a DataLoader
// is on the host, not on cpu(0).
void* CpuBackend::allocate_pinned(std::size_t nbytes) {
  const std::size_t rounded = std::max(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
  DP_CHECK(rounded >= nbytes, "pinned host memory: size ", nbytes, " bytes overflows");
  void* p = std::aligned_alloc(kAlignment, rounded);
  DP_CHECK(p != nullptr, "pinned host memory: out of memory allocating ", nbytes, " bytes (",
           pinned_allocated_.load(), " bytes pinned now)");
  pinned_allocated_.fetch_add(nbytes);
  return p;
}

void CpuBackend::deallocate_pinned(void* ptr, std::size_t nbytes) noexcept {
  if (!ptr) return;
  std::free(ptr);
  pinned_allocated_.fetch_sub(nbytes);
}

std::size_t CpuBackend::pinned_memory_allocated() { return pinned_allocated_.load(); }

// ---- copies ---------------------------------------------------------------------------
// Virtual devices share the host's memory, but a copy between them really copies, as a
// peer copy between GPUs would. memmove: a copy within one device may overlap.

void CpuBackend::copy(void* dst, Device dst_dev, const void* src, Device src_dev,
                      std::size_t nbytes) {
  (void)state(dst_dev);
  (void)state(src_dev);
  if (nbytes == 0 || dst == src) return;
  std::memmove(dst, src, nbytes);
}

void CpuBackend::copy_from_host(void* dst, Device dev, const void* host_src, std::size_t nbytes) {
  (void)state(dev);
  if (nbytes) std::memcpy(dst, host_src, nbytes);
}

void CpuBackend::copy_to_host(void* host_dst, const void* src, Device dev, std::size_t nbytes) {
  (void)state(dev);
  if (nbytes) std::memcpy(host_dst, src, nbytes);
}

void CpuBackend::copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                           std::size_t row_bytes, std::size_t rows, Device dev) {
  check_copy_rows(dev, dst_pitch, src_pitch, row_bytes);
  (void)state(dev);
  if (rows == 0 || row_bytes == 0) return;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // About 64 KiB per task: small copies stay on the calling thread.
  const auto grain = static_cast<std::int64_t>(std::max<std::size_t>(1, (std::size_t{64} << 10) / row_bytes));
  parallel_for(dev, static_cast<std::int64_t>(rows), grain, [=](std::int64_t b, std::int64_t e) {
    for (std::int64_t r = b; r < e; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      std::memcpy(d + ru * dst_pitch, s + ru * src_pitch, row_bytes);
    }
  });
}

void CpuBackend::memset_zero(void* ptr, Device dev, std::size_t nbytes) {
  // Large blocks (a model's gradients in zero_grad: 7.5 MB for the MLP 784-1024-1024-10)
  // in pieces over the device's threads: one core's stores do not reach the memory's
  // write bandwidth, and the other threads would idle meanwhile.
  constexpr std::size_t kPiece = std::size_t{256} << 10;
  if (nbytes < 4 * kPiece) {
    (void)state(dev);
    if (nbytes) std::memset(ptr, 0, nbytes);
    return;
  }
  char* p = static_cast<char*>(ptr);
  const auto pieces = static_cast<std::int64_t>((nbytes + kPiece - 1) / kPiece);
  parallel_for(dev, pieces, 1, [=](std::int64_t b, std::int64_t e) {
    const std::size_t lo = static_cast<std::size_t>(b) * kPiece;
    const std::size_t hi = std::min(nbytes, static_cast<std::size_t>(e) * kPiece);
    std::memset(p + lo, 0, hi - lo);
  });
}

}  // namespace cpu
}  // namespace dp::backend
