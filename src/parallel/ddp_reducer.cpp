#include "parallel/ddp_reducer.h"

#include <algorithm>

#include "dp/core/error.h"

namespace dp::parallel {

DdpReducer::DdpReducer(const std::vector<std::int64_t>& param_numel, int num_ranks, double cap_mb,
                       double first_mb)
    : bucket_of_param(param_numel.size()), ranks(num_ranks) {
  DP_CHECK(cap_mb > 0 && first_mb > 0, "DataParallel: expected bucket_cap_mb and first_bucket_mb > 0, got ",
           cap_mb, " and ", first_mb);
  constexpr double kMiB = 1024.0 * 1024.0;
  // Walk parameters from the last registered to the first; a bucket closes when the
  // next parameter would push it past its cap (a parameter larger than the cap gets
  // a bucket of its own).
  std::int64_t hi = 0;
  for (auto n : param_numel) hi += n;
  std::int64_t cap = static_cast<std::int64_t>(first_mb * kMiB / sizeof(float));
  DdpBucket cur{hi, hi, 0};
  for (int i = static_cast<int>(param_numel.size()) - 1; i >= 0; --i) {
    std::int64_t n = param_numel[i];
    if (cur.num_params > 0 && (cur.hi - cur.lo) + n > cap) {
      buckets.push_back(cur);
      cap = static_cast<std::int64_t>(cap_mb * kMiB / sizeof(float));
      cur = DdpBucket{cur.lo, cur.lo, 0};
    }
    cur.lo -= n;
    ++cur.num_params;
    bucket_of_param[i] = static_cast<int>(buckets.size());
  }
  if (cur.num_params > 0) buckets.push_back(cur);
  for (auto& r : ranks) {
    r.pending = std::make_unique<std::atomic<int>[]>(buckets.size());
    r.ready = std::make_unique<std::atomic<int>[]>(buckets.size());
  }
  prepare();
}

void DdpReducer::prepare() {
  aborted.store(false);
  for (auto& r : ranks) {
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      r.pending[b].store(buckets[b].num_params, std::memory_order_relaxed);
      r.ready[b].store(0, std::memory_order_relaxed);
    }
    r.comm_ms.store(0.0);
  }
}

void DdpReducer::mark_ready(int r, int i) {
  if (!active.load(std::memory_order_acquire)) return;
  int b = bucket_of_param[i];
  if (ranks[r].pending[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    ranks[r].ready[b].store(1, std::memory_order_release);
    ranks[r].ready[b].notify_all();
  }
}

void DdpReducer::finish(int r) {
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    if (ranks[r].ready[b].exchange(1, std::memory_order_acq_rel) == 0) ranks[r].ready[b].notify_all();
  }
}

bool DdpReducer::wait_ready(int r, int b) {
  ranks[r].ready[b].wait(0, std::memory_order_acquire);
  return !aborted.load(std::memory_order_acquire);
}

void DdpReducer::abort() {
  aborted.store(true, std::memory_order_release);
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) finish(r);
}

}  // namespace dp::parallel
