// src/backend/cuda/caching_allocator.h — per-device caching allocator for CUDA memory.
//
// cudaMalloc/cudaFree synchronise the device and cost milliseconds; a training step
// allocates hundreds of activations. This allocator keeps freed blocks and hands them
// out again, so after the first step no cudaMalloc/cudaFree happens. Internal header.
//
//   CachingAllocator& a = backend.allocator(0);
//   void* p = a.allocate(nbytes, stream);   // device 0 must be the current device
//   a.deallocate(p);                        // reusable at once by later work on `stream`
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

namespace dp::backend {

// Note [Caching allocator streams]
// Every block belongs to the stream it was allocated on. A freed block returns to that
// stream's pool and is handed out again only for allocations on the same stream: work
// enqueued later on one stream runs after everything enqueued before, so the new owner
// can never overwrite data the old owner's kernels still read — without any host wait.
// A block that is used on ANOTHER stream (an NCCL stream, a side stream) must be
// declared with record_stream(ptr, stream), as with torch's Tensor.record_stream. On
// free, the allocator records an event on each such stream and keeps the block out of
// the pool until every event has completed; completion is polled with cudaEventQuery
// at later allocations, never waited for. Cross-DEVICE use needs no declaration when
// it goes through CudaBackend::copy, which orders the two devices' streams with events.

/// Caching allocator of one device. Thread-safe. Call allocate/record_stream with the
/// allocator's device current on the calling thread (CudaBackend does).
class CachingAllocator {
 public:
  explicit CachingAllocator(int device);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// A block of at least `nbytes` (rounded up to 512 bytes, 512-byte aligned) owned by
  /// `stream`. On cudaErrorMemoryAllocation frees the cached blocks and retries once
  /// when the device is idle (Note [Out of memory inside a step]), then throws
  /// dp::Error naming the device, the sizes and what is cached.
  void* allocate(std::size_t nbytes, cudaStream_t stream);
  /// Returns a block from allocate(); null is ignored. Never throws (logs misuse).
  void deallocate(void* ptr) noexcept;
  /// Declares that the block holding `ptr` is used on `stream` too (Note [Caching
  /// allocator streams]). `stream` must belong to this allocator's device.
  void record_stream(void* ptr, cudaStream_t stream);
  /// Frees every cached block that is not in use (synchronises the device: call it
  /// between steps, never while collectives may wait for other devices).
  void empty_cache();

  /// Bytes in blocks handed out now, their peak since reset, and bytes cudaMalloc'ed.
  std::size_t allocated() const;
  std::size_t max_allocated() const;
  std::size_t reserved() const;
  void reset_peak();
  /// Number of cudaMalloc calls so far (tests check that steady state adds none).
  std::size_t num_device_allocs() const;

 private:
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const;
  };
  using Pool = std::set<Block*, BlockLess>;

  Block* find_free_block(Pool& pool, std::size_t size, cudaStream_t stream);
  Block* malloc_segment(std::size_t segment_size, std::size_t request, cudaStream_t stream,
                        bool small);
  Block* split(Block* block, std::size_t size);
  void free_block(Block* block);
  void process_events();
  /// False (nothing freed) when may_sync is false and a stream still has work.
  bool release_cached_blocks(bool may_sync);
  void note_stream(cudaStream_t stream);
  cudaEvent_t get_event();

  const int device_;
  mutable std::mutex mu_;
  Pool small_pool_, large_pool_;
  std::unordered_map<void*, Block*> live_;
  // Blocks freed while used on other streams, and the events that guard them.
  std::vector<std::pair<cudaEvent_t, Block*>> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::vector<cudaStream_t> streams_;  // every stream that owned or used a block
  std::size_t allocated_ = 0, peak_ = 0, reserved_ = 0, num_allocs_ = 0;
};

}  // namespace dp::backend
