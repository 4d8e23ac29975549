// Mode::Sharded (ZeRO): every device keeps a persistent replica but owns 1/N of the
// flat buffers; gradients are reduce-scattered in buckets while backward runs, each
// device steps only its range, and the updated ranges are gathered (Note [Designs];
// the gather units are in sharded_units.cpp).
#include "parallel/designs/sharded.h"

#include <algorithm>

#include "dp/autograd/grad_mode.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "parallel/phase_timer.h"

namespace dp::parallel {

ShardedDesign::ShardedDesign(DataParallel& dp)
    : Design(dp), stage_(*dp.options().shard_stage), gathered_bytes_(dp.devices().size(), 0) {}

std::unique_ptr<Design> make_sharded_design(DataParallel& dp) { return std::make_unique<ShardedDesign>(dp); }

// Note [Stage 3 across processes]
// Stage 3's gathers are pulls from the other local devices' memory, with no rendezvous
// (Note [Sharded parameters]): a device with no rows, or one that failed, never leaves
// another waiting. Another process's memory cannot be pulled, and a world all-gather
// per unit, in forward and again in backward, would put the whole model on the
// network twice per step, on the critical path of every layer, with every device of
// the job in lockstep at each unit. So across processes stage 3 is HYBRID sharding
// (PyTorch FSDP's HYBRID_SHARD, ZeRO++'s hpZ): parameters, gradients and optimizer
// state are sharded over the n devices of each process — device i of EVERY process
// owns the same range i of n — and replicated across the processes:
//  - gradients: each bucket's pieces are reduced onto their local owner (the local
//    communicator), and the owner all-reduces its piece with the owners of the same
//    range in the other processes (comm.peers(i), one rank per process): a local
//    reduce-scatter, then an inter-process all-reduce per slice, as the hierarchical
//    all-reduce does without its final local all-gather (ShardedGrads::hybrid);
//  - the step: the owners of range i in every process step it with the same summed
//    gradient and the same state, so the ranges stay equal without any exchange;
//  - the gathers stay process-local pulls, exactly as in one process.
// The price is memory: each device holds P/n of the parameters, gradients and state
// instead of P/(K n) for K processes (plus, as in one process, the units gathered at
// a time). The network carries per step what DDP's all-reduce carries (each process's
// gradient once, split over its n devices' links), never a parameter.
// Sums: each element is added over a process's devices in device order (the local
// reduce), then over the processes in process order (the process-level all-reduce,
// Note [Deterministic process collectives]) — the order of the hierarchical
// collectives behind DDP, DP and stages 1-2 across processes (Note [Hierarchical
// collectives]). So stage 3 across processes is bitwise equal to them, as stage 3 is
// to DDP within one process. The shard world (DataParallel::shard_world(),
// ShardStore::shard_world()) is n: everything that needs every range — an
// optimizer's state_dict(), clip_grad_norm_ — finds all of them in each process.
// Edits through device 0's gathered parameters (a load) are written back into this
// process's ranges only: as in DDP across processes (Note [When replicas are
// refreshed]), every process must make them (each loads the checkpoint).
void ShardedDesign::lay_out() {
  const int n = static_cast<int>(devices().size());
  // Stage 3 shards over this process's devices only (Note [Stage 3 across
  // processes]); one device per process has nothing to shard parameters over, and
  // stage 3 then runs as stage 2 (as stage 1 in one process: one device owns
  // everything, and stage 2's separate gradient would only add memory).
  const bool by_unit = stage_ == 3 && n > 1;
  store_ = std::make_unique<ShardStore>(set(), processes(), process());
  if (by_unit) {
    store_->shard(/*shard_grads=*/true, n, 0);
  } else {
    store_->shard(/*shard_grads=*/stage_ >= 2 && world_devices() > 1, world_devices(), comm().first_rank());
  }
  store_->install();
  if (by_unit) {
    shard_params();
  } else if (n > 1 && options().shard_gather.value_or(ShardGather::AfterStep) == ShardGather::NextForward) {
    DP_CHECK(processes() == 1, "DataParallel: shard_gather = NextForward across ", processes(), " processes: "
             "a device takes the ranges it lacks from the other devices' memory, and the other processes' "
             "ranges are not in this one; use ShardGather::AfterStep (the default) across processes");
    defer_gathers();
  }
}

void ShardedDesign::release() {
  if (store_) store_->release();
}

// Note [Sharded compute units]: stage 3's compute copies are each copy's range in
// param_dtype (ParameterCopy::compute, cast from its float32 range) and the 16-bit
// unit buffers the workers' compute views point into.
void ShardedDesign::make_compute_copies() {
  if (params_sharded() && param_dtype().has_value()) {
    const std::vector<bool> computed = computed_slots();
    std::vector<bool> units(store_->units().size(), false);
    const auto& slots = set().slots();
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (computed[i] && slots[i]->copies[0].numel() > 0) units[static_cast<std::size_t>(slots[i]->unit)] = true;
    store_->shard_compute(*param_dtype(), units);
  }
  Design::make_compute_copies();
}

Tensor ShardedDesign::compute_view(int rank, std::size_t i) const {
  if (!params_sharded()) return Design::compute_view(rank, i);
  const nn::Parameter::Slot& s = *set().slots().at(i);
  const Shape& shape = s.copies[0].shape();
  const Tensor& unit = store_->compute_unit(rank, s.unit);
  if (!unit.defined()) return empty(shape, TensorOptions{*param_dtype(), devices()[static_cast<std::size_t>(rank)]});
  const std::int64_t lo = store_->units()[static_cast<std::size_t>(s.unit)].first;
  return unit.narrow(0, s.offset - lo, shape_numel(shape)).reshape(shape);
}

// Stage 3 casts every range before the workers start (begin_step): a worker casting
// its own range at its forward's start would race the other workers' gathers of it.
bool ShardedDesign::replicate_params(int rank, bool sync_params) {
  if (params_sharded()) return false;  // never stale (Note [Sharded parameters])
  return Design::replicate_params(rank, sync_params);
}

// Note [Sharded compute units]: every range written since its last cast (an edit written
// back, a step that failed before its own cast) cast again, on the calling thread.
void ShardedDesign::refresh_compute_ranges() {
  for (int r = 0; r < set().num_copies(); ++r) refresh_compute(r, false);
}

std::int64_t ShardedDesign::gather_bytes(int rank) const {
  const std::int64_t pieces = store_ ? store_->received_bytes(rank) : 0;
  return pieces + gathered_bytes_.at(static_cast<std::size_t>(rank));
}

std::vector<std::pair<std::int64_t, std::int64_t>> ShardedDesign::shards() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (int r = 0; r < set().num_copies(); ++r) {
    const nn::CopySpan s = store_->span(r);
    out.emplace_back(s.begin, s.end);
  }
  return out;
}

// ---- the gradient cycle (Note [Sharded gradients]) -------------------------------------------

std::vector<Bucket> ShardedDesign::plan_buckets() const {
  if (!params_sharded()) return parameter_buckets();
  // Note [Sharded parameters]: buckets never straddle a unit; the last unit first.
  const auto& slots = set().slots();
  const auto& units = store_->units();
  std::vector<Bucket> buckets;
  std::int64_t first_cap = mib_to_floats(options().first_bucket_mb);
  for (std::size_t u = units.size(); u-- > 0;) {
    std::vector<std::int64_t> numel;
    int first = -1;
    for (int i = 0; i < static_cast<int>(slots.size()); ++i)
      if (slots[i]->unit == static_cast<int>(u)) {
        if (first < 0) first = i;
        numel.push_back(slots[i]->copies[0].numel());
      }
    if (first < 0) continue;
    for (Bucket b : assign_buckets(numel, first_cap, mib_to_floats(options().bucket_cap_mb))) {
      b.lo += slots[first]->offset;
      b.hi += slots[first]->offset;
      b.first_param += first;
      buckets.push_back(b);
    }
    first_cap = mib_to_floats(options().bucket_cap_mb);
  }
  return buckets;
}

std::unique_ptr<GradSync> ShardedDesign::make_grad_sync() {
  ShardedGrads g;
  // Every world rank's range (Note [World ranks]): equal lengths, world rank w's at w * len;
  // stage 3 across processes: every local rank's (Note [Stage 3 across processes]).
  const nn::CopySpan first = store_->span(0);
  const std::int64_t len = first.end - first.begin;
  g.hybrid = store_->shard_world() < comm().world_size();
  for (int w = 0; w < store_->shard_world(); ++w) g.shards.emplace_back(len * w, len * (w + 1));
  if (store_->shards_grads()) {
    // Note [Detached gradients]: a synced backward reduce-scatters each parameter's
    // gradient straight into its owners' range gradients; only no_sync passes
    // accumulate into a full buffer, which the next synced backward combines and frees.
    g.zero_sent = false;
    g.before_backward = [this](int r) {
      if (!require_sync()) store_->acquire_grad(r);
    };
    g.after_sync = [this](int r) { store_->release_grad(r); };
    g.deliver = [this](int r, const Tensor& piece, std::int64_t offset) {
      const nn::CopySpan c = store_->span(r);  // its range gradient: a detached cycle has no buffer
      NoGradGuard no_grad;
      Tensor range = c.grad.narrow(0, offset - c.begin, piece.numel());
      if (carry_sums_) {
        range.copy_(piece);  // the sum carried the earlier one (Note [Accumulating after a combined backward])
      } else {
        range.add_(piece);
      }
    };
    g.carry_in = [this](int r, Tensor& piece, std::int64_t offset, int owner) {
      if (!carry_sums_ || r != 0) return;  // Note [Accumulating after a combined backward]
      const nn::CopySpan c = store_->span(owner);
      NoGradGuard no_grad;
      piece.add_(c.grad.narrow(0, offset - c.begin, piece.numel()).to(piece.device()));
    };
    g.owned = [this](int r) { return store_->span(r).owned_grad(); };
  }
  return make_reduce_scatter_sync(comm(), std::move(g), grad_wire());
}

// Note [Accumulating after a combined backward]: where the sums are in device order.
bool ShardedDesign::sums_in_dp_order() const {
  return require_sync() && processes() == 1 && devices().size() > 1 && devices()[0].is_cpu();
}

void ShardedDesign::forget_sums() {
  if (store_->shards_grads()) {
    carry_sums_ = require_sync();  // a no_sync pass accumulates into the owners' buffers instead
    return;
  }
  const Tensor& grad0 = set().copy(0).grad;
  for (int r = 1; r < set().num_copies(); ++r) {
    const nn::CopySpan s = store_->span(r);
    const std::int64_t lo = std::min(s.begin, set().numel()), n = std::min(s.end, set().numel()) - lo;
    if (n <= 0) continue;
    const Tensor& grad = set().copy(r).grad;
    grad0.narrow(0, lo, n).copy_(grad.narrow(0, lo, n));
    grad.narrow(0, lo, n).zero_();
  }
}

// ---- steps -----------------------------------------------------------------------------------

void ShardedDesign::begin_step(const StepKind& kind, bool sync_params) {
  // Note [Sharded parameters]: device 0's parameters gathered for the user since the
  // last step go back (written back to every range when they were edited).
  if (store_) store_->scatter_primary();
  if (params_sharded()) refresh_compute_ranges();
  if (kind.replicate && params_sharded()) forget_dead_forwards();
  // Note [Deferred gather]: a broadcast of device 0's parameters makes every unit current.
  if (sync_params && deferred_gather()) mark_stale(false);
  if (kind.backward) check_grads_unedited("a backward");
  updating_ = kind.gather;  // end_step resets it
}

void ShardedDesign::end_step() {
  carry_sums_ = false;  // Note [Accumulating after a combined backward]
  store_->drop_pulls_ahead();  // a unit the forward never reached: pulled afresh when it is
  updating_ = false;
}

void ShardedDesign::check_no_sync() const {
  DP_CHECK(!params_sharded(), "DataParallel: no_sync() with shard_stage 3: the sharded parameters keep no "
           "full gradient to accumulate into; accumulate by calling backward several times between "
           "zero_grad() and step() instead (each backward adds its reduce-scattered gradient to the "
           "owners' ranges), or use shard_stage 2");
}

// ---- hand edits (Note [Gradient edits]) ------------------------------------------------------

// Sharded ranges cannot take an edit made through device 0's .grad. An edit is
// noticed at the next update of every copy or backward (whichever comes first: a
// clip's snapshot would hide it from the step) and stands until a zero_grad of the
// whole set.
void ShardedDesign::note_grad_edits() {
  if (world_devices() == 1) return;
  const Tensor& grad0 = set().copy(0).grad;  // undefined in stages 2 and 3 between steps
  if (!grad0.defined() || grad0.storage()->version() == grad_base(0)) return;
  // A zero_grad of the whole set since (module.zero_grad() does not come through here)
  // leaves every range zero everywhere: device 0's later edits then travel with its
  // piece of the next reduce, as DDP's do.
  if (set().zero_grad_count() != snapshot_zero_grad_count()) return;
  grads_edited_by_hand_ = true;
  edited_zero_grad_count_ = set().zero_grad_count();
}

// Stages 2 and 3 keep no gradient on device 0's parameters outside a no_sync pass's
// buffer (Note [Detached gradients]): the workers' backward sends each one straight to
// its owners. A .grad there came from a backward the wrapper did not run — a forward
// through the module itself (net->forward(x), not model(x)) whose loss joined the
// wrapper's — and no range would ever take it: the step would drop it, silently. DP
// and DDP add it to device 0's gradient as PyTorch's DataParallel does (DDP sends it
// to every replica as an edit by hand, Note [Gradient edits]).
void ShardedDesign::check_no_stray_grads(const char* what) const {
  if (!store_ || !store_->shards_grads() || set().copy(0).grad.defined()) return;
  for (const auto& slot : set().slots()) {
    if (slot->is_buffer || slot->tied || slot->copies.empty()) continue;
    DP_CHECK(!slot->copies[0].grad().defined(), "DataParallel (Sharded stage ", stage_, "): ", what,
             " with a gradient on parameter '", slot->name, "' that DataParallel's backward did not make: a "
             "forward through the module itself (net->forward(x) rather than model(x)) reached backward. The "
             "sharded gradients are the reduced sums of the wrapper's own backward, so it would be dropped. Run "
             "every forward through the DataParallel, or use Mode::DP or Mode::DDP (they add it to device 0's "
             "gradient); opt.zero_grad() clears it");
  }
}

void ShardedDesign::check_grads_unedited(const char* what) {
  check_no_stray_grads(what);
  note_grad_edits();
  if (grads_edited_by_hand_ && set().zero_grad_count() != edited_zero_grad_count_) grads_edited_by_hand_ = false;
  DP_CHECK(!grads_edited_by_hand_, "DataParallel (Sharded): ", what,
           " after the gradients were edited through parameters() by hand, or written by a backward through "
           "the module itself (net->forward(x) rather than model(x)): device 0 holds the summed "
           "gradient of its own range only (zeros elsewhere), so the edit cannot reach the ranges the other "
           "devices own; use dp::nn::utils::clip_grad_norm_ / clip_grad_value_ (they act on every range), "
           "scale the loss instead, run every forward through the DataParallel, or use Mode::DDP");
}

// ---- the optimizer step (Note [Sharded step]) ------------------------------------------------

// Note [Sharded step]
// The optimizer updates each device's own range of its copy (Note [Sharded parameter
// sets]); then, with ShardGather::AfterStep (the default), every device all-gathers
// the updated ranges, still inside the optimizer's step, so that when opt.step()
// returns every copy — device 0's, which the module, state_dict() and checkpoints
// read — holds the new parameters. The ranges have equal lengths (padded), so the
// gather is one all_gather in place over each copy's data buffer. ShardGather::
// NextForward leaves the other devices' copies to their next forward (Note [Deferred
// gather]). If the copies were written unequally since the last step (a load into
// device 0, a failed step), device 0's parameters are broadcast first, as before a
// forward (Note [When replicas are refreshed]). A failed step leaves the copies
// marked unsynced: device 0's parameters win at the next forward, as in DDP.
UpdatePlan ShardedDesign::plan_update(bool step) {
  note_grad_edits();
  return {.broadcast_grads = false, .gather = step && world_devices() > 1 && !params_sharded()};
}

void ShardedDesign::run_update(int rank, const UpdatePlan& plan, bool sync_params,
                               const std::function<void()>& update) {
  if (plan.gather && sync_params) {
    PhaseTimer t(recorder(), rank, Phase::Replicate);
    comm().broadcast(rank, set().copy(rank).data, 0);
  }
  {
    PhaseTimer t(recorder(), rank, Phase::Step);
    update();
  }
  if (params_sharded()) refresh_compute(rank, false);  // its own range, which no one gathers now
  if (plan.gather && !deferred_gather()) {
    gather_params(rank);
    refresh_compute(rank, true);  // a collective's write moves no storage version
  }
}

void ShardedDesign::finish_update(const UpdatePlan& plan) {
  if (plan.gather && deferred_gather()) pull_primary();
}

void ShardedDesign::gather_params(int rank) {
  PhaseTimer t(recorder(), rank, Phase::AllGather);
  const nn::CopySpan s = store_->span(rank);
  comm().all_gather(rank, s.data, set().copy(rank).data.narrow(0, 0, (s.end - s.begin) * comm().world_size()));
  gathered_bytes_[static_cast<std::size_t>(rank)] +=
      (comm().world_size() - 1) * (s.end - s.begin) * static_cast<std::int64_t>(sizeof(float));
}

std::pair<std::int64_t, std::int64_t> ShardedDesign::current_part(int rank, int unit, std::int64_t lo,
                                                                  std::int64_t hi) const {
  // Note [Deferred gather]: of a stale unit, only the replica's own range is current.
  if (!deferred_gather() || !stale_[static_cast<std::size_t>(rank)][static_cast<std::size_t>(unit)]) return {lo, hi};
  const nn::CopySpan s = store_->span(rank);
  lo = std::max(lo, s.begin);
  return {lo, std::max(lo, std::min(hi, s.end))};
}

}  // namespace dp::parallel
