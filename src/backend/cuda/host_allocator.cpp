#include "backend/cuda/host_allocator.h"

#include <bit>
#include <functional>

#include "backend/cuda/cuda_check.h"
#include "dp/core/error.h"

namespace dp::backend {
namespace {

// Power-of-two size classes from one page up: a DataLoader asks for the same few sizes
// every step (full batches, maybe one short last batch), so blocks are reused exactly
// and the rounding wastes at most half a block.
constexpr std::size_t kMinPinned = 4096;

std::size_t size_class(std::size_t nbytes) {
  return nbytes <= kMinPinned ? kMinPinned : std::bit_ceil(nbytes);
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

HostAllocator::~HostAllocator() {
  // Only allocators built by tests are destroyed (the backend's own lives for the
  // process: Note [Process-lifetime CUDA objects]). Wait for outstanding copies, then
  // free every block that is not handed out.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [base, block] : blocks_) {
    for (auto& [dev, ev] : block.events) {
      DP_CUDA_WARN(cudaEventSynchronize(ev));
      DP_CUDA_WARN(cudaEventDestroy(ev));
    }
    block.events.clear();
    if (!block.in_use) DP_CUDA_WARN(cudaFreeHost(const_cast<char*>(base)));
  }
  for (auto& pool : event_pool_) {
    for (cudaEvent_t ev : pool) DP_CUDA_WARN(cudaEventDestroy(ev));
  }
}

void* HostAllocator::allocate(std::size_t nbytes) {
  const std::size_t size = size_class(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  process_pending();
  if (auto it = free_.find(size); it != free_.end()) {
    char* p = it->second;
    free_.erase(it);
    Block& block = blocks_.at(p);
    block.in_use = true;
    block.requested = nbytes;
    allocated_ += nbytes;
    return p;
  }
  void* p = nullptr;
  cudaError_t err = cudaHostAlloc(&p, size, cudaHostAllocPortable);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // reset the thread's last error before retrying
    for (auto& [sz, block] : free_) {
      blocks_.erase(block);
      reserved_ -= sz;
      DP_CUDA_WARN(cudaFreeHost(block));
    }
    free_.clear();
    err = cudaHostAlloc(&p, size, cudaHostAllocPortable);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    DP_FAIL("pinned host memory: cudaHostAlloc of ", nbytes, " bytes (", mib(size),
            " MiB block) failed: ", cudaGetErrorString(err), "; ", mib(reserved_),
            " MiB already pinned, ", mib(allocated_),
            " MiB in use (pin smaller batches, or turn pin_memory off)");
  }
  Block& block = blocks_[static_cast<const char*>(p)];
  block.size = size;
  block.requested = nbytes;
  block.in_use = true;
  allocated_ += nbytes;
  reserved_ += size;
  return p;
}

void HostAllocator::deallocate(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(static_cast<const char*>(ptr));
  if (it == blocks_.end() || !it->second.in_use) {
    dp::detail::log_warning("pinned host memory: deallocate of a pointer that is not an "
                            "allocated pinned block (ignored)");
    return;
  }
  Block& block = it->second;
  block.in_use = false;
  allocated_ -= block.requested;
  char* base = static_cast<char*>(ptr);
  if (block.events.empty()) {
    free_.emplace(block.size, base);
  } else {
    pending_.push_back(base);  // Note [Pinned block reuse]
  }
}

bool HostAllocator::record_use(const void* ptr, int device, cudaStream_t stream) {
  const char* p = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.upper_bound(p);  // first block starting after p
  if (it == blocks_.begin()) return false;
  --it;
  if (!std::less_equal<const char*>()(p, it->first + it->second.size - 1)) return false;
  if (static_cast<std::size_t>(device) >= event_pool_.size()) {
    event_pool_.resize(static_cast<std::size_t>(device) + 1);
  }
  auto& pool = event_pool_[static_cast<std::size_t>(device)];
  cudaEvent_t ev = nullptr;
  if (pool.empty()) {
    // The caller has `device` current (CudaBackend::copy_from_host binds it).
    DP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  } else {
    ev = pool.back();
    pool.pop_back();
  }
  const cudaError_t err = cudaEventRecord(ev, stream);
  if (err != cudaSuccess) {
    pool.push_back(ev);
    DP_CUDA_CHECK(err);
  }
  it->second.events.emplace_back(device, ev);
  // A long-lived pinned tensor copied every step must not collect events forever.
  if (it->second.events.size() >= 16) release_completed(it->second);
  return true;
}

bool HostAllocator::release_completed(Block& block) {
  // Copies on different streams finish in any order: query every event, keep the
  // incomplete ones, recycle the rest.
  std::size_t kept = 0;
  for (auto& use : block.events) {
    const cudaError_t st = cudaEventQuery(use.second);
    if (st == cudaErrorNotReady) {
      block.events[kept++] = use;
      continue;
    }
    if (st != cudaSuccess) DP_CUDA_WARN(st);  // a failed copy: the device reports it
    event_pool_[static_cast<std::size_t>(use.first)].push_back(use.second);
  }
  block.events.resize(kept);
  return kept == 0;
}

void HostAllocator::process_pending() {
  std::size_t kept = 0;
  for (char* base : pending_) {
    Block& block = blocks_.at(base);
    if (release_completed(block)) {
      free_.emplace(block.size, base);
    } else {
      pending_[kept++] = base;
    }
  }
  pending_.resize(kept);
}

void HostAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  process_pending();
  for (auto& [sz, block] : free_) {
    blocks_.erase(block);
    reserved_ -= sz;
    DP_CUDA_WARN(cudaFreeHost(block));
  }
  free_.clear();
}

std::size_t HostAllocator::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}

std::size_t HostAllocator::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

}  // namespace dp::backend
