#include "backend/cuda/caching_allocator.h"

#include <algorithm>

#include <cstdint>
#include <functional>
#include <utility>

#include "backend/cuda/cuda_check.h"
#include "dp/core/error.h"

namespace dp::backend {
namespace {

// Sizes of Note [Caching allocator streams] (PyTorch's CUDACachingAllocator uses the
// same classes): requests are rounded to 512 bytes, enough alignment for any vector
// load and small enough to waste little. Requests up to 1 MiB share 2 MiB segments
// (the GPU's large-page size, so a segment never straddles a page), requests up to
// 10 MiB share 20 MiB segments, larger ones get a segment of their own rounded to 2 MiB.
constexpr std::size_t kMinBlock = 512;
constexpr std::size_t kSmallRequest = std::size_t{1} << 20;
constexpr std::size_t kSmallSegment = std::size_t{2} << 20;
constexpr std::size_t kMidRequest = std::size_t{10} << 20;
constexpr std::size_t kLargeSegment = std::size_t{20} << 20;
constexpr std::size_t kSegmentRound = std::size_t{2} << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::size_t segment_size_for(std::size_t size) {
  if (size <= kSmallRequest) return kSmallSegment;
  if (size <= kMidRequest) return kLargeSegment;
  return round_up(size, kSegmentRound);
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

}  // namespace

struct CachingAllocator::Block {
  char* ptr = nullptr;
  std::size_t size = 0;
  cudaStream_t stream = nullptr;
  bool small = false;
  bool allocated = false;
  int pending_events = 0;  // events still to complete before the block may be reused
  Block* prev = nullptr;   // neighbours inside the same cudaMalloc segment
  Block* next = nullptr;
  std::vector<cudaStream_t> stream_uses;  // other streams that used the block
};

bool CachingAllocator::BlockLess::operator()(const Block* a, const Block* b) const {
  const auto sa = reinterpret_cast<std::uintptr_t>(a->stream);
  const auto sb = reinterpret_cast<std::uintptr_t>(b->stream);
  if (sa != sb) return sa < sb;
  if (a->size != b->size) return a->size < b->size;
  return std::less<const char*>()(a->ptr, b->ptr);
}

CachingAllocator::CachingAllocator(int device) : device_(device) {}

CachingAllocator::~CachingAllocator() {
  // The backend lives for the whole process (Note [Process-lifetime CUDA objects]), so
  // this only runs in tests that build their own allocator: free what is cached.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [ev, block] : pending_) DP_CUDA_WARN(cudaEventSynchronize(ev));
  for (auto& [ev, block] : pending_) {
    DP_CUDA_WARN(cudaEventDestroy(ev));
    --block->pending_events;
  }
  pending_.clear();
  for (cudaEvent_t ev : free_events_) DP_CUDA_WARN(cudaEventDestroy(ev));
  if (!live_.empty()) {
    dp::detail::log_warning(dp::detail::str_cat("cuda:", device_, ": ", live_.size(),
                                                " blocks still allocated at allocator exit"));
  }
  for (Pool* pool : {&small_pool_, &large_pool_}) {
    for (Block* b : *pool) {
      if (!b->prev && !b->next) {
        DP_CUDA_WARN(cudaFree(b->ptr));
        delete b;
      }
    }
  }
}

void* CachingAllocator::allocate(std::size_t nbytes, cudaStream_t stream) {
  const std::size_t size = nbytes < kMinBlock ? kMinBlock : round_up(nbytes, kMinBlock);
  const bool small = size <= kSmallRequest;
  std::lock_guard<std::mutex> lock(mu_);
  process_events();
  Pool& pool = small ? small_pool_ : large_pool_;
  Block* block = find_free_block(pool, size, stream);
  if (block) {
    pool.erase(block);
  } else {
    block = malloc_segment(segment_size_for(size), nbytes, stream, small);
  }
  block = split(block, size);
  block->allocated = true;
  live_.emplace(block->ptr, block);
  allocated_ += block->size;
  if (allocated_ > peak_) peak_ = allocated_;
  return block->ptr;
}

CachingAllocator::Block* CachingAllocator::find_free_block(Pool& pool, std::size_t size,
                                                           cudaStream_t stream) {
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = pool.lower_bound(&key);
  // Best fit: the smallest cached block of this stream that holds `size`.
  if (it == pool.end() || (*it)->stream != stream) return nullptr;
  return *it;
}

CachingAllocator::Block* CachingAllocator::malloc_segment(std::size_t segment_size,
                                                          std::size_t request,
                                                          cudaStream_t stream, bool small) {
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, segment_size);
  bool busy = false;  // cached blocks were kept because the device was not idle
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // clear it: the retry decides
    busy = !release_cached_blocks(/*may_sync=*/false);
    if (!busy) err = cudaMalloc(&ptr, segment_size);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
    const std::size_t cached = reserved_ - allocated_;
    DP_FAIL("cuda:", device_, ": out of memory allocating ", request, " bytes (a ",
            mib(segment_size), " MiB segment): ", cudaGetErrorString(err), "; ",
            mib(allocated_), " MiB in use by tensors, ", mib(reserved_), " MiB reserved by dp (",
            mib(cached), " MiB of it cached in free blocks", busy ?
            ", not released because work is still running on the device: freeing them "
            "synchronises the device, which can hang while collectives wait for other "
            "devices — call dp::empty_cache(dev) between steps" : "",
            "), ", mib(free_b), " MiB free of ", mib(total_b),
            " MiB. Reduce the batch size per device or free tensors you keep");
  }
  reserved_ += segment_size;
  ++num_allocs_;
  note_stream(stream);
  auto* block = new Block;
  block->ptr = static_cast<char*>(ptr);
  block->size = segment_size;
  block->stream = stream;
  block->small = small;
  return block;
}

CachingAllocator::Block* CachingAllocator::split(Block* block, std::size_t size) {
  const std::size_t rest = block->size - size;
  // Small pool: any 512-byte remainder is useful. Large pool: keep remainders above the
  // small class only, so a large segment is never shredded into small blocks.
  const bool worth = block->small ? rest >= kMinBlock : rest > kSmallRequest;
  if (!worth) return block;
  auto* tail = new Block;
  tail->ptr = block->ptr + size;
  tail->size = rest;
  tail->stream = block->stream;
  tail->small = block->small;
  tail->prev = block;
  tail->next = block->next;
  if (block->next) block->next->prev = tail;
  block->next = tail;
  block->size = size;
  (block->small ? small_pool_ : large_pool_).insert(tail);
  return block;
}

void CachingAllocator::deallocate(void* ptr) noexcept {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    dp::detail::log_warning(dp::detail::str_cat(
        "cuda:", device_, ": deallocate of a pointer this allocator did not hand out "
        "(double free?) — ignored"));
    return;
  }
  Block* block = it->second;
  live_.erase(it);
  block->allocated = false;
  allocated_ -= block->size;
  if (block->stream_uses.empty()) {
    free_block(block);
    return;
  }
  for (cudaStream_t s : block->stream_uses) {
    cudaEvent_t ev = get_event();
    if (!ev) {
      // Cannot order the reuse without an event: leak the block rather than risk a race.
      dp::detail::log_warning(dp::detail::str_cat("cuda:", device_, ": leaking ", block->size,
                                                  " bytes: no event for a cross-stream free"));
      ++block->pending_events;  // never reaches zero: never reused
      continue;
    }
    const cudaError_t err = cudaEventRecord(ev, s);
    if (err != cudaSuccess) {
      DP_CUDA_WARN(err);
      ++block->pending_events;
      continue;
    }
    ++block->pending_events;
    pending_.emplace_back(ev, block);
  }
  block->stream_uses.clear();
  if (block->pending_events == 0) free_block(block);
}

void CachingAllocator::record_stream(void* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  DP_CHECK(it != live_.end(), "cuda:", device_,
           ": record_stream: expected a pointer returned by allocate() on this device");
  Block* block = it->second;
  if (stream == block->stream) return;
  for (cudaStream_t s : block->stream_uses)
    if (s == stream) return;
  block->stream_uses.push_back(stream);
  note_stream(stream);
}

void CachingAllocator::note_stream(cudaStream_t stream) {
  if (std::find(streams_.begin(), streams_.end(), stream) == streams_.end()) streams_.push_back(stream);
}

void CachingAllocator::free_block(Block* block) {
  Pool& pool = block->small ? small_pool_ : large_pool_;
  // Merge with free neighbours of the same segment (they are in the pool exactly when
  // not allocated and not waiting for events).
  auto mergeable = [](Block* b) { return b && !b->allocated && b->pending_events == 0; };
  if (mergeable(block->prev)) {
    Block* p = block->prev;
    pool.erase(p);
    p->size += block->size;
    p->next = block->next;
    if (block->next) block->next->prev = p;
    delete block;
    block = p;
  }
  if (mergeable(block->next)) {
    Block* n = block->next;
    pool.erase(n);
    block->size += n->size;
    block->next = n->next;
    if (n->next) n->next->prev = block;
    delete n;
  }
  pool.insert(block);
}

void CachingAllocator::process_events() {
  if (pending_.empty()) return;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    auto [ev, block] = pending_[i];
    const cudaError_t err = cudaEventQuery(ev);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: keep waiting (without blocking)
      pending_[kept++] = pending_[i];
      continue;
    }
    DP_CUDA_CHECK(err);
    free_events_.push_back(ev);
    if (--block->pending_events == 0) free_block(block);
  }
  pending_.resize(kept);
}

// Note [Out of memory inside a step]
// cudaFree synchronises the whole device. Inside a step an NCCL kernel may be waiting
// for a peer device whose thread is itself about to launch its part; a device-wide
// wait under this allocator's lock is then a known way to hang. So on out-of-memory
// the cache is released only when every stream that used this allocator's blocks is
// idle (cudaStreamQuery; no wait), and otherwise the allocation fails with a
// dp::Error that says how much is cached and why it was kept. empty_cache(), called
// by the user between steps, may synchronise.
bool CachingAllocator::release_cached_blocks(bool may_sync) {
  if (may_sync) {
    DP_CUDA_CHECK(cudaDeviceSynchronize());  // pending blocks can be returned too
  } else {
    for (cudaStream_t s : streams_) {
      const cudaError_t state = cudaStreamQuery(s);
      if (state == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return false;
      }
      DP_CUDA_CHECK(state);
    }
  }
  process_events();
  for (Pool* pool : {&small_pool_, &large_pool_}) {
    for (auto it = pool->begin(); it != pool->end();) {
      Block* b = *it;
      if (!b->prev && !b->next) {
        DP_CUDA_CHECK(cudaFree(b->ptr));
        reserved_ -= b->size;
        delete b;
        it = pool->erase(it);
      } else {
        ++it;
      }
    }
  }
  return true;
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_blocks(/*may_sync=*/true);
}

cudaEvent_t CachingAllocator::get_event() {
  if (!free_events_.empty()) {
    cudaEvent_t ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  cudaEvent_t ev = nullptr;
  const cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    DP_CUDA_WARN(err);
    return nullptr;
  }
  return ev;
}

std::size_t CachingAllocator::allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocated_;
}
std::size_t CachingAllocator::max_allocated() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}
std::size_t CachingAllocator::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}
void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = allocated_;
}
std::size_t CachingAllocator::num_device_allocs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_allocs_;
}

}  // namespace dp::backend
