// src/backend/cuda/host_allocator.h — caching allocator for pinned (page-locked) host
// memory, the source of asynchronous host→device copies.
//
// cudaHostAlloc pins pages with the driver and costs milliseconds; cudaFreeHost
// synchronises every device. A DataLoader pins one batch per step, so blocks are cached
// and handed out again, like device memory in CachingAllocator. Internal header.
//
//   HostAllocator h;                   // CudaBackend owns one for the process
//   void* p = h.allocate(nbytes);
//   cudaMemcpyAsync(dev_ptr, p, nbytes, cudaMemcpyHostToDevice, stream);
//   h.record_use(p, device, stream);   // p is not reused before this copy has finished
//   h.deallocate(p);                   // fine at once: reuse waits for the copy
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace dp::backend {

// Note [Pinned block reuse]
// A copy from pinned memory is truly asynchronous: cudaMemcpyAsync returns before the
// DMA engine has read the source. The host may free the batch tensor right after
// enqueueing its shards' copies, and the next batch must not be written into that
// block while a copy still reads it. So every copy out of a pinned block records an
// event on the copying stream (record_use); a freed block with recorded events waits
// in `pending_` and returns to the free pool only when cudaEventQuery reports every
// event complete. Completion is polled at later allocations, never waited for — the
// host never blocks on the device to reuse pinned memory. A block still in use when
// the allocator is destroyed (process exit) is left to the driver.

/// Thread-safe caching allocator of pinned host memory shared by all CUDA devices
/// (cudaHostAllocPortable: any device's stream may copy from any block).
class HostAllocator {
 public:
  HostAllocator() = default;
  ~HostAllocator();
  HostAllocator(const HostAllocator&) = delete;
  HostAllocator& operator=(const HostAllocator&) = delete;

  /// A pinned block of at least `nbytes` (rounded up to a power of two, at least 4 KiB).
  /// Throws dp::Error naming the size when the driver cannot pin it (after freeing the
  /// cached blocks and retrying once).
  void* allocate(std::size_t nbytes);
  /// Returns a block from allocate(); null is ignored. Never throws.
  void deallocate(void* ptr) noexcept;
  /// If `ptr` lies inside a pinned block (any offset: a shard is a view into a batch),
  /// records an event on `stream` of `device` so the block is not reused before the
  /// work enqueued on `stream` so far has finished. Returns false, doing nothing, for
  /// memory this allocator does not own (pageable memory needs no record).
  bool record_use(const void* ptr, int device, cudaStream_t stream);
  /// Frees every cached block that no copy still reads.
  void empty_cache();

  /// Bytes requested by the owners of the blocks handed out now (as the CPU backend
  /// counts them), and bytes pinned in total (size classes, incl. cached blocks).
  std::size_t allocated() const;
  std::size_t reserved() const;

 private:
  struct Block {
    std::size_t size = 0;       // the size class, what cudaHostAlloc pinned
    std::size_t requested = 0;  // bytes asked for by the current owner
    bool in_use = false;
    std::vector<std::pair<int, cudaEvent_t>> events;  // (device, event) per recorded use
  };

  void process_pending();  // mu_ held
  bool release_completed(Block& block);  // mu_ held; true when no event is outstanding

  mutable std::mutex mu_;
  std::map<const char*, Block> blocks_;                 // every block by base address
  std::multimap<std::size_t, char*> free_;              // size → free block
  std::vector<char*> pending_;                          // freed, events outstanding
  std::vector<std::vector<cudaEvent_t>> event_pool_;    // per device, reusable events
  std::size_t allocated_ = 0;
  std::size_t reserved_ = 0;
};

}  // namespace dp::backend
