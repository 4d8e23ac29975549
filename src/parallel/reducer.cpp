#include "parallel/reducer.h"

#include <algorithm>
#include <string>

#include "backend/backend.h"
#include "dp/autograd/node.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "parallel/grad_wire.h"

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
  AllReduceSync(comm::Communicator& comm, std::shared_ptr<const GradWire> wire)
      : comm_(comm), wire_(std::move(wire)) {}
  const char* name() const override { return "allreduce"; }
  bool overlaps_backward() const override { return true; }
  int world_ranks() const override { return comm_.world_size(); }
  // The compute stream waits for the buckets once, at join (Note [Deferred collectives]).
  void sync(int rank, const Tensor& grad, std::int64_t offset) override {
    if (!wire_) {
      comm_.all_reduce_deferred(rank, grad, grad, comm::ReduceOp::Sum);
      return;
    }
    // Note [Gradients on the wire]: the sum comes back after the collective, on its stream.
    Tensor w = wire_->pack(rank, grad, offset);
    comm_.all_reduce_deferred(rank, w, w, comm::ReduceOp::Sum);
    comm_.after_deferred(rank, [&] { GradWire::unpack(w, grad); });
  }
  Dtype wire_dtype() const override { return wire_ ? wire_->dtype() : Dtype::Float32; }
  void join(int rank) override { comm_.join(rank); }
  std::optional<std::pair<double, double>> device_times(int rank) override {
    if (!comm_.times_on_device()) return std::nullopt;
    const comm::Communicator::StreamTimes t = comm_.take_times(rank);
    return std::make_pair(t.busy_ms, t.exposed_ms);
  }
  Held held(int, const Tensor& buffer) const override { return {0, buffer}; }

 private:
  comm::Communicator& comm_;
  std::shared_ptr<const GradWire> wire_;
};

// Note [DP across processes]
// DP's root is local rank `root` of EVERY process: the devices of a process reduce
// onto it, and the roots of all processes then all-reduce the sum among themselves
// (comm.peers(root)), so each process's root holds the sum over every device of the
// job and steps its own optimizer with it — the same update everywhere, with no
// parameter broadcast between processes. Each element is summed over a process's
// devices in device order, then over processes in process order: the order of the
// hierarchical all-reduce (Note [Hierarchical collectives]), so DP stays bitwise DDP.
class ReduceToRootSync final : public GradSync {
 public:
  ReduceToRootSync(comm::Communicator& comm, int root, std::shared_ptr<const GradWire> wire)
      : comm_(comm), root_(root), wire_(std::move(wire)) {}
  const char* name() const override { return "reduce"; }
  bool overlaps_backward() const override { return false; }
  int world_ranks() const override { return comm_.world_size(); }
  void sync(int rank, const Tensor& grad, std::int64_t offset) override {
    // Note [Gradients on the wire]: only the root's result comes back from the wire.
    const Tensor w = wire_ ? wire_->pack(rank, grad, offset) : grad;
    comm_.local().reduce(rank, w, rank == root_ ? w : Tensor(), root_, comm::ReduceOp::Sum);
    if (rank != root_) return;
    if (comm::Communicator* across = comm_.peers(rank))
      across->all_reduce(comm_.first_rank() / comm_.size(), w, w, comm::ReduceOp::Sum);
    if (wire_) GradWire::unpack(w, grad);
  }
  Dtype wire_dtype() const override { return wire_ ? wire_->dtype() : Dtype::Float32; }
  Held held(int rank, const Tensor& buffer) const override {
    return rank == root_ ? Held{0, buffer} : Held{};
  }

 private:
  comm::Communicator& comm_;
  int root_;
  std::shared_ptr<const GradWire> wire_;
};

// Note [Sharded gradients].
class ReduceScatterSync final : public GradSync {
 public:
  ReduceScatterSync(comm::Communicator& comm, ShardedGrads grads, std::shared_ptr<const GradWire> wire)
      : comm_(comm), g_(std::move(grads)), wire_(std::move(wire)) {}
  const char* name() const override { return "reduce_scatter"; }
  bool overlaps_backward() const override { return true; }
  int world_ranks() const override { return comm_.world_size(); }
  Dtype wire_dtype() const override { return wire_ ? wire_->dtype() : Dtype::Float32; }

  void sync(int rank, const Tensor& grad, std::int64_t offset) override { reduce_pieces(rank, grad, offset, false); }

  // Note [Detached gradients].
  void sync_detached(int rank, const Tensor& grad, std::int64_t offset) override {
    DP_ASSERT(g_.deliver != nullptr, "detached gradients without ShardedGrads::deliver");
    reduce_pieces(rank, grad, offset, true);
  }

  Held held(int rank, const Tensor& buffer) const override {
    const auto [begin, end] = g_.shards[static_cast<std::size_t>(me(rank))];
    if (!buffer.defined()) {  // a detached cycle: the range's gradient is kept apart
      DP_ASSERT(g_.owned != nullptr, "detached gradients without ShardedGrads::owned");
      return {begin, g_.owned(rank)};
    }
    return {begin, buffer.narrow(0, begin, end - begin)};
  }

  void begin(int rank) override {
    if (g_.before_backward) g_.before_backward(rank);
  }
  void finish(int rank) override {
    if (g_.after_sync) g_.after_sync(rank);
  }
  // Note [Deferred reduce-scatter]: the compute stream waits here, once.
  void join(int rank) override { (g_.hybrid ? comm_.local() : comm_).join(rank); }
  std::optional<std::pair<double, double>> device_times(int rank) override {
    if (g_.hybrid || !comm_.times_on_device()) return std::nullopt;  // hybrid: plain reduces
    const comm::Communicator::StreamTimes t = comm_.take_times(rank);
    return std::make_pair(t.busy_ms, t.exposed_ms);
  }

 private:
  // The shard index of local rank `rank`: its world rank (Note [World ranks]), or,
  // hybrid, the local rank itself.
  int me(int rank) const { return g_.hybrid ? rank : comm_.first_rank() + rank; }

  // Cuts [offset, offset + grad.numel()) at the shard boundaries and reduces each
  // piece onto its owner; a detached piece is then delivered to the owner's range.
  // Owners are world ranks (Note [World ranks]), or local ranks when hybrid: the
  // local reduce then the owners' all-reduce across processes add a process's devices
  // in device order, then the processes in process order — the hierarchical reduce's
  // order (Note [Hierarchical collectives]), so the sum is bitwise the world designs'.
  // Note [Deferred reduce-scatter]
  // The reduces are deferred, like DDP's all-reduce,
  // and what follows them (delivery, zeroing) runs after them on the comm stream, so
  // the compute stream waits once, at join, not after every bucket. Hybrid sharding
  // keeps plain reduces: its all-reduce across processes runs on another communicator,
  // which a deferred reduce's result would reach unordered.
  void reduce_pieces(int rank, const Tensor& grad, std::int64_t offset, bool detached) {
    const std::int64_t lo = offset, hi = offset + grad.numel();
    const int me = this->me(rank);
    comm::Communicator& comm = g_.hybrid ? comm_.local() : comm_;
    // One group for the bucket's reduces: one launch on NCCL, not one per piece (Note
    // [Grouped collectives]). Nothing may touch a piece until the group ends, so what
    // follows a piece's reduce (across processes, delivery, zeroing) comes after it.
    struct Piece {
      Tensor t;     // the float32 piece of grad
      Tensor wire;  // what the collective reduces: t, or its 16-bit copy (Note [Gradients on the wire])
      std::int64_t a;
      int owner;
    };
    std::vector<Piece> pieces;
    for (int owner = 0; owner < static_cast<int>(g_.shards.size()); ++owner) {
      const auto [begin, end] = g_.shards[static_cast<std::size_t>(owner)];
      const std::int64_t a = std::max(lo, begin), b = std::min(hi, end);
      if (a >= b) continue;
      Tensor piece = grad.narrow(0, a - lo, b - a);
      if (detached && g_.carry_in) g_.carry_in(rank, piece, a, owner);
      // Note [Gradients on the wire]: rounded before the group opens (no compute work inside it).
      Tensor wire = wire_ ? wire_->pack(rank, piece, a) : piece;
      pieces.push_back({std::move(piece), std::move(wire), a, owner});
    }
    comm::CollectiveGroup group(comm, rank);
    for (const Piece& p : pieces) {
      const Tensor& recv = me == p.owner ? p.wire : Tensor();
      if (g_.hybrid) {
        comm.reduce(rank, p.wire, recv, p.owner, comm::ReduceOp::Sum);
      } else {
        comm.reduce_deferred(rank, p.wire, recv, p.owner, comm::ReduceOp::Sum);
      }
    }
    group.end();
    auto follow_up = [&] {
      for (const auto& [piece, wire, a, owner] : pieces) {
        if (g_.hybrid && me == owner)
          if (comm::Communicator* across = comm_.peers(rank))
            across->all_reduce(comm_.first_rank() / comm_.size(), wire, wire, comm::ReduceOp::Sum);
        if (wire_ && me == owner && detached) {
          // A detached piece is a view of a gradient the host frees when sync_detached
          // returns, while this runs on the collectives' stream: unpacked into it, the sum
          // would race whatever the compute stream allocates there next. So the sum lands
          // in memory allocated here, on the collectives' stream, reused only after these
          // reads (Note [Work after deferred collectives]). Without a wire the piece is
          // the collective's own buffer, declared to that stream.
          const Tensor landed = empty({piece.numel()}, TensorOptions{Dtype::Float32, piece.device()});
          GradWire::unpack(wire, landed);
          g_.deliver(rank, landed, a);
          continue;
        }
        if (wire_ && me == owner) GradWire::unpack(wire, piece);
        if (detached) {
          if (me == owner) g_.deliver(rank, piece, a);
          continue;  // the other ranks' pieces are freed with the gradient
        }
        // Stage 1: the piece was sent and belongs to another rank: zeros from now on.
        // Through the backend, not Tensor::zero_(): that bumps the buffer's storage
        // version, which the worker's backward bumps concurrently.
        if (me != owner && g_.zero_sent) {
          const Device dev = piece.device();
          backend::get(dev).memset_zero(piece.data<float>(), dev,
                                        static_cast<std::size_t>(piece.numel()) * sizeof(float));
        }
      }
    };
    if (g_.hybrid) {
      follow_up();
    } else {
      comm.after_deferred(rank, follow_up);  // Note [Work after deferred collectives]
    }
  }

  comm::Communicator& comm_;
  ShardedGrads g_;
  std::shared_ptr<const GradWire> wire_;
};

}  // namespace

std::unique_ptr<GradSync> make_all_reduce_sync(comm::Communicator& comm, std::shared_ptr<const GradWire> wire) {
  return std::make_unique<AllReduceSync>(comm, std::move(wire));
}

std::unique_ptr<GradSync> make_reduce_to_root_sync(comm::Communicator& comm, int root,
                                                   std::shared_ptr<const GradWire> wire) {
  DP_CHECK(root >= 0 && root < comm.size(), "reduce: root ", root, " is not a rank of ", comm.size());
  return std::make_unique<ReduceToRootSync>(comm, root, std::move(wire));
}

std::unique_ptr<GradSync> make_reduce_scatter_sync(comm::Communicator& comm, ShardedGrads grads,
                                                   std::shared_ptr<const GradWire> wire) {
  const int ranks = grads.hybrid ? comm.size() : comm.world_size();
  DP_CHECK(static_cast<int>(grads.shards.size()) == ranks, "reduce_scatter: ", grads.shards.size(), " shards for ",
           ranks, " ranks; expected one per ", grads.hybrid ? "local rank (hybrid sharding)" : "(world) rank");
  for (std::size_t r = 0; r < grads.shards.size(); ++r) {
    const auto [begin, end] = grads.shards[r];
    DP_CHECK(0 <= begin && begin <= end && (r == 0 || grads.shards[r - 1].second <= begin),
             "reduce_scatter: shard ", r, " [", begin, ", ", end, ") is inverted or overlaps the previous one");
  }
  return std::make_unique<ReduceScatterSync>(comm, std::move(grads), std::move(wire));
}

// ---- the cycle -------------------------------------------------------------------------------

struct Reducer::RankState {
  std::unique_ptr<std::atomic<int>[]> pending;  // parameters still to come, per bucket
  std::unique_ptr<std::atomic<int>[]> ready;    // 1 once the bucket may be combined
  double comm_ms = 0;  // written by the comm thread, read by the worker after wait()
  bool detached = false;       // Note [Detached gradients]: set by the worker in begin()
  std::vector<Tensor> stash;   // detached: gradients taken from the parameters, per parameter
  std::atomic<int> combined{0};  // buckets the comm thread has combined this cycle
  std::atomic<std::int64_t> grad_bytes{0};  // Reducer::grad_bytes
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
  // communication stream. A single rank of the whole job has nothing to combine (one
  // device per process still combines with the other processes), and a single bucket
  // nothing to overlap (Note [One bucket, no comm thread]): no thread at all.
  if (sync_->overlaps_backward() && sync_->world_ranks() > 1 && buckets_.size() > 1)
    comm_threads_ = std::make_unique<WorkerPool>(devices_, "comm");
}

Reducer::~Reducer() = default;

std::int64_t Reducer::handoffs() const { return comm_threads_ ? comm_threads_->handoffs() : 0; }

std::int64_t Reducer::grad_bytes(int rank) const {
  return ranks_[static_cast<std::size_t>(rank)].grad_bytes.load(std::memory_order_relaxed);
}

std::int64_t Reducer::count_bytes(int rank, std::int64_t numel) {
  const auto bytes = numel * static_cast<std::int64_t>(element_size(sync_->wire_dtype()));
  ranks_[static_cast<std::size_t>(rank)].grad_bytes.fetch_add(bytes, std::memory_order_relaxed);
  return bytes;
}

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
    r.combined.store(0, std::memory_order_relaxed);
  }
  active_.store(sync, std::memory_order_release);
  if (sync && comm_threads_) {
    comm_threads_->launch([this](int r) { comm_loop(r); }, on_failure_);
    armed_ = true;
  }
}

void Reducer::begin(int rank) {
  sync_->begin(rank);
  RankState& st = ranks_[rank];
  st.detached = active_.load(std::memory_order_acquire) && !grad_of_(rank).defined();
  if (!st.detached) return;
  DP_ASSERT(sync_->overlaps_backward() && params_.size() == bucket_of_param_.size(),
            "a detached gradient cycle needs an overlapping strategy and the parameter layout");
  st.stash.assign(params_.size(), Tensor());
}

void Reducer::grad_ready(int rank, int param, const Tensor& leaf) {
  if (!active_.load(std::memory_order_acquire)) return;
  RankState& st = ranks_[rank];
  if (st.detached) {
    st.stash[static_cast<std::size_t>(param)] = leaf.grad();
    autograd::bind_grad(leaf, Tensor(), /*pinned=*/true);  // stashed: set_grad is refused
  }
  mark_ready(rank, param);
}

void Reducer::wait_combined(int rank) {
  if (!armed_) return;
  RankState& st = ranks_[rank];
  // The comm thread combines buckets strictly in index order (Note [Comm threads]), so
  // only the run of ready buckets from the first one can be combined without more of
  // this worker's backward: a later ready bucket behind one still pending (a forward
  // that used the top-level children out of registration order) waits for the worker,
  // and waiting for it here would wait forever.
  int need = 0;
  while (need < static_cast<int>(buckets_.size()) && st.ready[static_cast<std::size_t>(need)].load(std::memory_order_acquire) != 0)
    ++need;
  for (int c = st.combined.load(std::memory_order_acquire); c < need; c = st.combined.load(std::memory_order_acquire)) {
    if (aborted_.load(std::memory_order_acquire)) return;
    st.combined.wait(c, std::memory_order_acquire);
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
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    release(r);
    ranks_[r].combined.store(static_cast<int>(buckets_.size()), std::memory_order_release);
    ranks_[r].combined.notify_all();
  }
}

// Note [Comm threads]
// Each rank's comm thread takes the buckets strictly in index order, waits until a
// bucket is complete on its rank and runs the strategy's collective on it while
// the rank's worker goes on with backward. Every rank therefore issues the same
// sequence of collectives. The finite check runs before a bucket's collective, so
// the error names the device the NaN came from before the sum spreads it.
void Reducer::comm_loop(int rank) {
  Tensor grad;  // read once the worker's begin() has run: after the first bucket is ready
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    ranks_[rank].ready[b].wait(0, std::memory_order_acquire);
    if (aborted_.load(std::memory_order_acquire)) return;
    const Bucket& bk = buckets_[b];
    auto t0 = Clock::now();
    sync_bucket(rank, bk, grad);
    const std::int64_t bytes = count_bytes(rank, bk.hi - bk.lo);
    ranks_[rank].combined.store(static_cast<int>(b) + 1, std::memory_order_release);
    ranks_[rank].combined.notify_all();
    auto t1 = Clock::now();
    ranks_[rank].comm_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    if (recorder_.trace().enabled())
      recorder_.comm_event(rank, std::string(sync_->name()) + " bucket " + std::to_string(b), t0, t1,
                           "\"bytes\": " + std::to_string(bytes));
  }
}

/// One bucket's finite check and collective; `grad` caches rank's flat gradient buffer.
void Reducer::sync_bucket(int rank, const Bucket& bk, Tensor& grad) {
  if (ranks_[rank].detached) {
    sync_bucket_detached(rank, bk);
    return;
  }
  if (!grad.defined()) grad = grad_of_(rank);
  Tensor slice = grad.narrow(0, bk.lo, bk.hi - bk.lo);
  if (check_) check_(rank, slice, bk.lo);
  sync_->sync(rank, slice, bk.lo);
}

// Note [Detached gradients]: each parameter of the bucket on its own, in index order
// on every rank; each gradient is freed once combined.
void Reducer::sync_bucket_detached(int rank, const Bucket& bk) {
  RankState& st = ranks_[rank];
  for (int i = bk.first_param; i < bk.first_param + bk.num_params; ++i) {
    const auto [offset, numel] = params_[static_cast<std::size_t>(i)];
    Tensor g = std::move(st.stash[static_cast<std::size_t>(i)]);
    g = g.defined() ? g.reshape({numel}) : zeros({numel}, devices_[static_cast<std::size_t>(rank)]);
    if (check_) check_(rank, g, offset);
    try {
      sync_->sync_detached(rank, g, offset);
    } catch (...) {
      // Communicator::abort: another rank may still read g; end() frees it, once every
      // comm thread has returned.
      st.stash[static_cast<std::size_t>(i)] = std::move(g);
      throw;
    }
  }
}

// Note [Combined gradients are writes]
// The collectives write the combined sums into the gradient buffers through raw
// pointers (a reduce into the owner's range, an all-reduce in place, stage 1's zeroing
// of the pieces sent), which move neither the buffer's version nor its write epoch. A
// device whose own backward wrote nothing into a .grad (no rows in this pass, or a
// parameter its forward did not use) still carries the mark zero_grad left, with the
// epoch it recorded: its next backward would then write its product OVER the sum
// instead of adding to it (Note [Gradients written over zeros]) — a silent loss of the
// earlier passes' gradient, found by the loop fuzzer (stage 1, a device with no rows
// in the first of two backward passes). So once a pass is combined each rank declares
// its buffer written, on its own worker, after its collectives completed.
void Reducer::finalize(int rank) {
  if (!active_.load(std::memory_order_acquire)) return;  // no_sync: accumulate only
  // Several ranks of the whole job: one device per process still combines across processes.
  const bool several = sync_->world_ranks() > 1;
  auto written = [&] {
    if (!several) return;
    const Tensor g = grad_of_(rank);  // undefined while released (stage 2)
    if (g.defined()) g.storage()->bump_version();
  };
  if (comm_threads_) {
    finalize_overlapped(rank);
  } else if (sync_->overlaps_backward() && several) {
    finalize_inline(rank);
  } else if (sync_->overlaps_backward()) {
    // One rank: nothing to combine, but the check sees the buckets as with several.
    if (check_) {
      Tensor grad = grad_of_(rank);
      for (const Bucket& bk : buckets_) check_(rank, grad.narrow(0, bk.lo, bk.hi - bk.lo), bk.lo);
    }
  } else {
    Tensor grad = grad_of_(rank);
    if (check_) check_(rank, grad, 0);
    if (several) {
      PhaseTimer t(recorder_, rank, Phase::Reduce);
      sync_->sync(rank, grad, 0);
      count_bytes(rank, grad.numel());
    }
    if (!several || !sync_->held(rank, grad).grad.defined()) {  // nothing new to check
      written();
      sync_->finish(rank);
      return;
    }
  }
  if (check_) {
    GradSync::Held h = sync_->held(rank, grad_of_(rank));
    if (h.grad.defined()) check_(rank, h.grad, h.offset);
  }
  written();
  sync_->finish(rank);
}

// Exposed time is what the worker waits for its comm thread after its own backward;
// the rest of the comm thread's time was hidden behind backward.
void Reducer::finalize_overlapped(int rank) {
  std::exception_ptr error;
  double hidden_ms = 0;
  std::optional<std::pair<double, double>> device;  // busy, exposed (earlier cycles)
  {
    PhaseTimer exposed(recorder_, rank, Phase::AllReduceExposed);
    release(rank);
    error = comm_threads_->wait(rank);
    if (!error) sync_->join(rank);
    device = sync_->device_times(rank);
    if (device) exposed.cancel();  // the host saw only the enqueueing
    hidden_ms = std::max(0.0, ranks_[rank].comm_ms - exposed.elapsed_ms());
  }
  if (device) {  // Note [Collective timing]
    recorder_.add_ms(rank, Phase::AllReduceExposed, device->second);
    hidden_ms = std::max(0.0, device->first - device->second);
  }
  recorder_.add_ms(rank, Phase::AllReduceHidden, hidden_ms);
  if (error) std::rethrow_exception(error);
}

// Note [One bucket, no comm thread]
// A comm thread earns its hand-overs (a launch per backward, a wake-up per bucket, a
// wait at the end) by running a bucket's collective while backward computes the next
// buckets. With one bucket there is no next bucket: it is complete only when backward
// is, and the worker would wait for its comm thread anyway. So a reducer with one
// bucket makes no comm threads, and each worker runs the bucket's check and
// collective itself in finalize: the same collectives in the same order on the same
// data, hence the same bits, without the hand-overs (a small model's DDP step).
void Reducer::finalize_inline(int rank) {
  PhaseTimer exposed(recorder_, rank, Phase::AllReduceExposed);
  try {
    Tensor grad;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const auto t0 = Clock::now();
      sync_bucket(rank, buckets_[b], grad);
      const std::int64_t bytes = count_bytes(rank, buckets_[b].hi - buckets_[b].lo);
      if (recorder_.trace().enabled())  // on the comm track, as a comm thread's would be
        recorder_.comm_event(rank, std::string(sync_->name()) + " bucket " + std::to_string(b), t0,
                             Clock::now(), "\"bytes\": " + std::to_string(bytes));
    }
    sync_->join(rank);
  } catch (...) {
    // As a failed comm thread does: the other ranks must not wait in a collective.
    if (on_failure_) on_failure_(rank, std::current_exception());
    throw;
  }
  if (auto device = sync_->device_times(rank)) {  // Note [Collective timing]
    exposed.cancel();
    recorder_.add_ms(rank, Phase::AllReduceExposed, device->second);
    recorder_.add_ms(rank, Phase::AllReduceHidden, std::max(0.0, device->first - device->second));
  }
}

void Reducer::end() {
  if (armed_) {
    abort();  // after a success every comm thread is done already: no wait
    for (int r = 0; r < static_cast<int>(devices_.size()); ++r) comm_threads_->wait(r);
  }
  armed_ = false;
  active_.store(false, std::memory_order_release);
  for (auto& r : ranks_) r.stash.clear();  // a failed detached cycle's gradients
}

}  // namespace dp::parallel
