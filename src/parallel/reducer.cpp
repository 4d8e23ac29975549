#include "parallel/reducer.h"

#include <algorithm>
#include <string>

#include "dp/comm/communicator.h"
#include "dp/core/error.h"

namespace dp::parallel {

// ---- bucket assignment (Note [Gradient buckets]) ---------------------------------------------

std::vector<Bucket> assign_buckets(const std::vector<std::int64_t>& param_numel, std::int64_t first_cap,
                                   std::int64_t cap) {
  DP_CHECK(first_cap > 0 && cap > 0, "assign_buckets: expected bucket caps > 0 elements, got first ", first_cap,
           " and ", cap);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < param_numel.size(); ++i) {
    DP_CHECK(param_numel[i] >= 0, "assign_buckets: parameter ", i, " has ", param_numel[i],
             " elements; expected >= 0");
    total += param_numel[i];
  }
  const int n = static_cast<int>(param_numel.size());
  std::vector<Bucket> buckets;
  Bucket cur{total, total, n, 0};
  std::int64_t limit = first_cap;
  for (int i = n - 1; i >= 0; --i) {
    if (cur.num_params > 0 && (cur.hi - cur.lo) + param_numel[i] > limit) {
      buckets.push_back(cur);
      limit = cap;
      cur = Bucket{cur.lo, cur.lo, i + 1, 0};
    }
    cur.lo -= param_numel[i];
    cur.first_param = i;
    ++cur.num_params;
  }
  if (cur.num_params > 0) buckets.push_back(cur);
  return buckets;
}

std::int64_t mib_to_floats(double mib) {
  constexpr double kMiB = 1024.0 * 1024.0;
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(mib * kMiB / sizeof(float)));
}

// ---- strategies ------------------------------------------------------------------------------

namespace {

class AllReduceSync final : public GradSync {
 public:
  explicit AllReduceSync(comm::Communicator& comm) : comm_(comm) {}
  const char* name() const override { return "allreduce"; }
  bool overlaps_backward() const override { return true; }
  void sync(int rank, const Tensor& grad) override { comm_.all_reduce(rank, grad, grad, comm::ReduceOp::Sum); }
  bool holds_result(int) const override { return true; }

 private:
  comm::Communicator& comm_;
};

class ReduceToRootSync final : public GradSync {
 public:
  ReduceToRootSync(comm::Communicator& comm, int root) : comm_(comm), root_(root) {}
  const char* name() const override { return "reduce"; }
  bool overlaps_backward() const override { return false; }
  void sync(int rank, const Tensor& grad) override {
    comm_.reduce(rank, grad, rank == root_ ? grad : Tensor(), root_, comm::ReduceOp::Sum);
  }
  bool holds_result(int rank) const override { return rank == root_; }

 private:
  comm::Communicator& comm_;
  int root_;
};

}  // namespace

std::unique_ptr<GradSync> make_all_reduce_sync(comm::Communicator& comm) {
  return std::make_unique<AllReduceSync>(comm);
}

std::unique_ptr<GradSync> make_reduce_to_root_sync(comm::Communicator& comm, int root) {
  DP_CHECK(root >= 0 && root < comm.size(), "reduce: root ", root, " is not a rank of ", comm.size());
  return std::make_unique<ReduceToRootSync>(comm, root);
}

// ---- the cycle -------------------------------------------------------------------------------

struct Reducer::RankState {
  std::unique_ptr<std::atomic<int>[]> pending;  // parameters still to come, per bucket
  std::unique_ptr<std::atomic<int>[]> ready;    // 1 once the bucket may be combined
  double comm_ms = 0;  // written by the comm thread, read by the worker after wait()
};

Reducer::Reducer(std::vector<Device> devices, std::vector<Bucket> buckets, std::unique_ptr<GradSync> sync,
                 GradOf grad_of, PhaseRecorder& recorder)
    : devices_(std::move(devices)), buckets_(std::move(buckets)), sync_(std::move(sync)),
      grad_of_(std::move(grad_of)), recorder_(recorder), ranks_(devices_.size()) {
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bk = buckets_[b];
    bucket_of_param_.resize(std::max<std::size_t>(bucket_of_param_.size(), bk.first_param + bk.num_params));
    for (int i = bk.first_param; i < bk.first_param + bk.num_params; ++i) bucket_of_param_[i] = static_cast<int>(b);
  }
  for (auto& r : ranks_) {
    r.pending = std::make_unique<std::atomic<int>[]>(buckets_.size());
    r.ready = std::make_unique<std::atomic<int>[]>(buckets_.size());
  }
  // Note [Comm threads]: each device's comm thread is the CPU model of a CUDA
  // communication stream. A single rank has nothing to combine: no thread at all.
  if (sync_->overlaps_backward() && devices_.size() > 1)
    comm_threads_ = std::make_unique<WorkerPool>(devices_, "comm");
}

Reducer::~Reducer() = default;

std::int64_t Reducer::handoffs() const { return comm_threads_ ? comm_threads_->handoffs() : 0; }

void Reducer::set_failure_hook(ErrorHook hook) { on_failure_ = std::move(hook); }

void Reducer::prepare(bool sync) {
  DP_ASSERT(!armed_, "prepare() while the previous backward's comm threads still run");
  aborted_.store(false, std::memory_order_relaxed);
  for (auto& r : ranks_) {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      r.pending[b].store(buckets_[b].num_params, std::memory_order_relaxed);
      r.ready[b].store(0, std::memory_order_relaxed);
    }
    r.comm_ms = 0;
  }
  active_.store(sync, std::memory_order_release);
  if (sync && comm_threads_) {
    comm_threads_->launch([this](int r) { comm_loop(r); }, on_failure_);
    armed_ = true;
  }
}

void Reducer::mark_ready(int rank, int param) {
  if (!active_.load(std::memory_order_acquire)) return;
  auto& st = ranks_[rank];
  int b = bucket_of_param_[param];
  if (st.pending[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
    st.ready[b].store(1, std::memory_order_release);
    st.ready[b].notify_all();
  }
}

void Reducer::release(int rank) {
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (ranks_[rank].ready[b].exchange(1, std::memory_order_acq_rel) == 0) ranks_[rank].ready[b].notify_all();
}

void Reducer::abort() {
  aborted_.store(true, std::memory_order_release);
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) release(r);
}

// Note [Comm threads]
// Each rank's comm thread takes the buckets strictly in index order, waits until a
// bucket is complete on its rank and runs the strategy's collective on it while
// the rank's worker goes on with backward. Every rank therefore issues the same
// sequence of collectives. The finite check runs before a bucket's collective, so
// the error names the device the NaN came from before the sum spreads it.
void Reducer::comm_loop(int rank) {
  Tensor grad = grad_of_(rank);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    ranks_[rank].ready[b].wait(0, std::memory_order_acquire);
    if (aborted_.load(std::memory_order_acquire)) return;
    const Bucket& bk = buckets_[b];
    auto t0 = Clock::now();
    if (check_) check_(rank, bk.lo, bk.hi);
    sync_->sync(rank, grad.narrow(0, bk.lo, bk.hi - bk.lo));
    auto t1 = Clock::now();
    ranks_[rank].comm_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    if (recorder_.trace().enabled())
      recorder_.comm_event(rank, std::string(sync_->name()) + " bucket " + std::to_string(b), t0, t1,
                           "\"bytes\": " + std::to_string((bk.hi - bk.lo) * 4));
  }
}

void Reducer::finalize(int rank) {
  if (!active_.load(std::memory_order_acquire)) return;  // no_sync: accumulate only
  const std::int64_t numel = grad_of_(rank).numel();
  const bool several = devices_.size() > 1;
  if (comm_threads_) {
    finalize_overlapped(rank);
  } else if (sync_->overlaps_backward()) {
    // One rank: nothing to combine, but the check sees the buckets as with several.
    if (check_)
      for (const Bucket& bk : buckets_) check_(rank, bk.lo, bk.hi);
  } else {
    if (check_) check_(rank, 0, numel);
    if (several) {
      PhaseTimer t(recorder_, rank, Phase::Reduce);
      sync_->sync(rank, grad_of_(rank));
    }
    if (!several || !sync_->holds_result(rank)) return;  // nothing new to check
  }
  if (check_ && sync_->holds_result(rank)) check_(rank, 0, numel);
}

// Exposed time is what the worker waits for its comm thread after its own backward;
// the rest of the comm thread's time was hidden behind backward.
void Reducer::finalize_overlapped(int rank) {
  std::exception_ptr error;
  double hidden_ms = 0;
  {
    PhaseTimer exposed(recorder_, rank, Phase::AllReduceExposed);
    release(rank);
    error = comm_threads_->wait(rank);
    hidden_ms = std::max(0.0, ranks_[rank].comm_ms - exposed.elapsed_ms());
  }
  recorder_.add_ms(rank, Phase::AllReduceHidden, hidden_ms);
  if (error) std::rethrow_exception(error);
}

void Reducer::end() {
  if (armed_) {
    abort();  // after a success every comm thread is done already: no wait
    for (int r = 0; r < static_cast<int>(devices_.size()); ++r) comm_threads_->wait(r);
  }
  armed_ = false;
  active_.store(false, std::memory_order_release);
}

}  // namespace dp::parallel
