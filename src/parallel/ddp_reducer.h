// src/parallel/ddp_reducer.h — DDP's gradient buckets (internal to DataParallel).
//
// Note [Gradient buckets]
// Parameters are grouped into buckets in REVERSE registration order, because
// backward produces the gradients of the last layers first. The first bucket is
// small (first_bucket_mb) so the first all-reduce starts early; the rest are capped
// at bucket_cap_mb. The flat gradient buffer holds parameters in registration
// order, so a bucket — a run of consecutive parameters — is one contiguous slice:
// its all-reduce is one call with no packing copy. A post-accumulate hook on every
// replica's parameters counts down its bucket; when a bucket is complete on a
// device, that device's comm thread all-reduces it while the worker goes on with
// backward. Comm threads take buckets strictly in index order, so every device
// issues the same sequence of collectives. Parameters that got no gradient (unused
// this step) are marked ready when backward ends, contributing their current
// gradient (zero after zero_grad), identically on every device.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace dp::parallel {

struct DdpBucket {
  std::int64_t lo = 0, hi = 0;  // element range in the flat gradient buffer
  int num_params = 0;
};

/// Per-device readiness state of every bucket.
struct DdpRankState {
  std::unique_ptr<std::atomic<int>[]> pending;  // params still to come, per bucket
  std::unique_ptr<std::atomic<int>[]> ready;    // 1 once the bucket may be reduced
  std::atomic<double> comm_ms{0.0};             // all-reduce time spent by the comm thread
};

struct DdpReducer {
  std::vector<DdpBucket> buckets;
  std::vector<int> bucket_of_param;  // slot index -> bucket
  std::vector<DdpRankState> ranks;
  std::atomic<bool> active{false};   // hooks count only inside a DataParallel backward
  std::atomic<bool> aborted{false};

  /// Builds buckets over params with the given element sizes (registration order).
  DdpReducer(const std::vector<std::int64_t>& param_numel, int num_ranks, double cap_mb,
             double first_mb);
  /// Resets the counters for a new backward.
  void prepare();
  /// Hook body: param `i` of rank `r` got its gradient.
  void mark_ready(int r, int i);
  /// Marks every bucket of rank r ready (end of backward, or abort).
  void finish(int r);
  /// Blocks the comm thread of rank r until bucket b is ready (false when aborted).
  bool wait_ready(int r, int b);
  void abort();
};

}  // namespace dp::parallel
