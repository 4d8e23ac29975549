// Mode::Sharded's gather units: stage 3 gathers each top-level child's parameters
// just before it runs (Note [Sharded parameters]); stages 1-2 with
// ShardGather::NextForward take the other owners' updated ranges of a unit just
// before the next forward first uses it (Note [Deferred gather]).
#include <algorithm>
#include <functional>
#include <map>
#include <optional>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "parallel/designs/sharded.h"
#include "parallel/phase_timer.h"

namespace dp::parallel {

// Note [Sharded parameters]
// ZeRO stage 3 (FSDP): each device keeps only its range of the parameters (Note
// [Sharded parameter sets]; Note [Sharded parameter buffers] in src/parallel/shard_store.h for the
// buffers). The gather units are the net's top-level children, each a contiguous run
// of the flat layout because parameters are flattened depth first in registration
// order (parameters registered on the root itself form units of their own; a net
// without children is one unit).
// Forward: the first time a worker's forward reads a parameter of unit u
// (Parameter::get, on the worker's thread), u is gathered for that device, every
// other gathered unit but u + 1 is released, and u + 1 is started on its way (the
// prefetch, ShardStore::gather_unit_ahead, Note [Copies ahead] in backend.h: on
// GPUs peer copies into staging blocks on the device's inbound stream, which start
// at once (Note [Copy fences]) and which the compute stream waits for only when u + 1
// becomes current and its pieces land in its buffer; so u's compute waits for u's
// transfers alone and overlaps u + 1's. On CPU virtual devices, whose copies are
// synchronous, the pieces are copied when they land). The worker also records the
// autograd sequence number at which u became current: every node made from then
// until the next unit belongs to u.
// Backward: autograd calls a hook before each node (BackwardNodeHook); when the node
// belongs to another unit than the one gathered, the device first waits until the
// gradients already complete were reduce-scattered (so that no more than one unit's
// gradients are held, the bound the memory test checks), releases the unit it leaves
// and gathers the node's unit — after the leaving unit's last gradient was made
// (FSDP's BACKWARD_POST order: one unit gathered at a time in backward, never two).
// The last unit of a forward stays gathered into a forward_backward's backward, which
// starts with it. Gradients take stage 2's detached path (Note [Detached gradients]),
// with buckets that never straddle a unit; each rank's units are released when its
// part of a step ends, failed or not.
// The gather is a pull from every owner's range (ShardStore::gather_unit): it needs
// no rendezvous, so a device with no rows, or one that failed, never leaves another
// waiting; a device copy per owner moves the bytes an all-gather would.
// Between steps every device holds only its ranges. Reading device 0's parameters
// gathers them (Module::parameters(), named_parameters(), state_dict(), or any access
// through a Parameter on a user thread), and they stay gathered until the next step
// begins; edits made through them then (load_state_dict, in-place writes) are
// written back into every device's range, so device 0's values win, as in the other
// modes. A tensor taken from them before that step and read after it is a clear
// dp::Error (Note [Released storage]). An optimizer step updates each range in place
// and gathers nothing; a failed one leaves the ranges it reached updated, the others
// not, which no replica can contradict (each element has one owner).


// Stage 3's layout: every device keeps only its ranges of the parameters, one unit
// per top-level child, gathered by the store's read hook.
void ShardedDesign::shard_params() {
  store_->shard_params(gather_units());
  unit_state_.resize(devices().size());
  store_->set_read_hook([this](int r, int u) { enter_unit(r, u); });
}

// Stages 1-2 with ShardGather::NextForward: the units tracked, every copy current.
void ShardedDesign::defer_gathers() {
  store_->track_units(gather_units());  // Note [Deferred gather]
  const std::size_t n = devices().size(), units = store_->units().size();
  stale_.assign(n, std::vector<char>(units, 0));
  store_->set_read_hook([this](int r, int u) { pull_unit(r, u); });
}

// Worker `rank`'s part of a step. Note [Sharded parameters]: a forward records which
// unit each node was made under; a backward gathers them again node by node; whatever
// happens, the rank's units are released when its part of the step ends.
void ShardedDesign::run_rank(int rank, const StepKind& kind, const std::function<void()>& body) {
  if (!params_sharded()) return Design::run_rank(rank, kind, body);
  struct Leave {
    ShardedDesign& design;
    int r;
    ~Leave() { design.leave_units(r); }
  } leave{*this, rank};
  if (kind.replicate)  // nodes made before the forward's first unit belong to none
    unit_state_[static_cast<std::size_t>(rank)].marks.push_back({autograd::peek_sequence_nr(), -1, forwards_});
  std::optional<autograd::BackwardNodeHook> hook;
  if (kind.backward) {
    hook.emplace([this, rank](const autograd::Node& node) { backward_unit(rank, node.sequence_nr); });
    reducer().begin(rank);
  }
  body();
}

void ShardedDesign::forward_connected(std::weak_ptr<const int> graph_alive) {
  if (params_sharded()) live_forwards_.emplace_back(forwards_, std::move(graph_alive));
}

std::vector<std::pair<std::int64_t, std::int64_t>> ShardedDesign::gather_units() const {
  // Owner of each slot: an id per top-level child and per module options().shard_unit
  // picks (outermost), or -1-i for the root's own parameter i (a unit of its own).
  // A module's units claim their slots before the module does; the first claim wins.
  std::map<const nn::Parameter::Slot*, int> owner;
  int next_id = 0;
  const auto& picks = options().shard_unit;
  std::function<void(const nn::Module&, int, bool)> claim = [&](const nn::Module& m, int who, bool in_unit) {
    for (auto& [name, c] : m.named_children()) {
      const bool unit = !in_unit && picks && picks(*c);
      claim(*c, unit ? next_id++ : who, in_unit || unit);
    }
    for (auto& s : const_cast<nn::Module&>(m).parameter_slots()) owner.emplace(s.get(), who);
  };
  for (auto& [name, c] : net().named_children()) {
    const bool unit = picks && picks(*c);
    claim(*c, next_id++, unit);
  }
  // Note [Sharded compute units]: a unit either computes in param_dtype or keeps
  // float32 throughout, so the parameters that keep float32 (a BatchNorm's) form runs
  // of their own, as FSDP gives a BatchNorm a float32 unit of its own.
  const auto& slots = set().slots();
  const std::vector<bool> computed = param_dtype() ? computed_slots() : std::vector<bool>(slots.size(), true);
  std::vector<std::pair<std::int64_t, std::int64_t>> units;
  int last = 0;
  bool last_computed = true;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    auto it = owner.find(slots[i].get());
    const int who = it != owner.end() ? it->second : -1 - static_cast<int>(i);
    const std::int64_t lo = slots[i]->offset, hi = lo + slots[i]->copies[0].numel();
    if (hi == lo) continue;
    if (!units.empty() && who == last && computed[i] == last_computed && units.back().second == lo) {
      units.back().second = hi;
    } else {
      units.emplace_back(lo, hi);
    }
    last = who;
    last_computed = computed[i];
  }
  return units;
}

// The read hook: worker `rank`'s forward reads a parameter of `unit`.
void ShardedDesign::enter_unit(int rank, int unit) {
  UnitState& st = unit_state_[static_cast<std::size_t>(rank)];
  if (st.forward == unit) return;
  st.marks.push_back({autograd::peek_sequence_nr(), unit, forwards_});
  st.forward = unit;
  PhaseTimer t(recorder(), rank, Phase::AllGather);
  backend::CopyFences::Scope fenced(fences());  // the owners' ranges predate the step (Note [Copy fences])
  const int n = static_cast<int>(store_->units().size());
  for (int u = 0; u < n; ++u)
    if (u != unit && u != unit + 1) store_->release_unit(rank, u);  // gathered or on its way
  store_->gather_unit(rank, unit);
  if (unit + 1 < n) store_->gather_unit_ahead(rank, unit + 1);  // the prefetch (Note [Copies ahead])
}

// The backward node hook of worker `rank`.
void ShardedDesign::backward_unit(int rank, std::uint64_t sequence_nr) {
  UnitState& st = unit_state_[static_cast<std::size_t>(rank)];
  auto it = std::upper_bound(st.marks.begin(), st.marks.end(), sequence_nr,
                             [](std::uint64_t nr, const UnitState::Mark& m) { return nr < m.sequence_nr; });
  if (it == st.marks.begin()) return;  // made before any parameter was read
  const int unit = std::prev(it)->unit;
  if (unit < 0 || unit == st.backward) return;
  if (st.backward >= 0) reducer().wait_combined(rank);
  PhaseTimer t(recorder(), rank, Phase::AllGather);
  backend::CopyFences::Scope fenced(fences());  // Note [Copy fences]
  for (int u = 0; u < static_cast<int>(store_->units().size()); ++u)
    if (u != unit) store_->release_unit(rank, u);  // gathered or on its way
  store_->gather_unit(rank, unit);
  st.backward = unit;
}

// Note [Forwards before a backward]
// A loop may run several forwards before one backward (a siamese or contrastive loss:
// loss(model(x1)) + loss(model(x2))), or backward each output separately, or keep
// evaluating between. Every pattern must give what one device gives.
// - DP: each backward through a gathered output (one per forward) reduces every
//   replica's gradient buffer onto device 0. So a replica's buffer must hold what
//   that backward brought and nothing older: it is zeroed on the worker at the start
//   of every step that runs backward (not at the forward, which a second backward
//   without a forward between would skip: the first one's gradient then reached
//   device 0 twice). DDP and Sharded need nothing more than Note [Accumulating after
//   a combined backward], which covers any second backward.
// - Sharded stage 3 finds a node's unit by its sequence number (Note [Sharded
//   parameters]). The marks of every forward whose graph can still be run are kept,
//   each starting with a mark of no unit (what a forward makes before its first
//   parameter belongs to no unit), so a backward through any earlier forward finds
//   its units. A forward's graph stays runnable while its gathered output's
//   GatherBackward lives and has not been run (graph_alive()); at the start of each
//   forward the marks of the others (forward_backward's, those under no_grad, those
//   already backpropagated) are dropped, so the marks stay bounded by the graphs the
//   user holds. FSDP offers two ways to serve such a backward: keep each unit gathered
//   while a graph needs it, or gather it again in the backward. Stage 3 gathers again,
//   as it already does for a single forward: the memory stays one unit gathered at a
//   time (the bound the memory test checks) whatever the number of forwards, and the
//   price is one more gather per unit and forward — the bytes a second forward's
//   gather moved anyway. Keeping the units instead would hold every unit of every
//   live forward: the whole model, which is what stage 3 exists to avoid.
void ShardedDesign::forget_dead_forwards() {
  std::erase_if(live_forwards_, [](const auto& f) { return f.second.expired(); });
  for (UnitState& st : unit_state_)
    std::erase_if(st.marks, [this](const UnitState::Mark& m) {
      return std::none_of(live_forwards_.begin(), live_forwards_.end(),
                          [&m](const auto& f) { return f.first == m.forward; });
    });
  ++forwards_;
}

void ShardedDesign::leave_units(int rank) {
  UnitState& st = unit_state_[static_cast<std::size_t>(rank)];
  st.forward = st.backward = -1;
  store_->release_units(rank);
}

// Note [Deferred gather]
// ShardGather::NextForward (stages 1 and 2, one process): the gather of the updated
// ranges moves, for every device but device 0, from the end of the optimizer step
// to the next forward, where each top-level child's ranges are taken just before the
// child first uses them — the gather of unit u + 1 then follows the compute of unit
// u instead of holding every device at the end of the step.
// - Device 0's copy is what the user reads: the module's parameters, tensors kept
//   from parameters() (the optimizer's own), state_dict(), checkpoints, clipping,
//   an evaluation through net->forward on the user's thread. Nothing can intercept a
//   read through a kept tensor, so device 0 never goes stale: when its own update is
//   done and every other device's too (the workers joined), opt.step() copies the
//   other ranges into device 0's copy (pull_primary) before it returns. Only the
//   other devices' copies — which only DataParallel's workers read — are deferred.
// - The units are the gather units of stage 3 (gather_units(): the net's top-level
//   children), tracked by the store without sharding the data (Note [Tracked units]):
//   Parameter::get() on worker r reports each access to unit u, and pull_unit(r, u)
//   copies, when stale_[r][u], every other owner's piece of u from the owner's copy
//   into copy r — a pull, as in stage 3, with no rendezvous: a device that fails, or
//   has no rows, or never reaches a unit, leaves no other waiting. The pieces are the
//   bytes the all-gather would have moved (the padding is zeros everywhere and never
//   written), so the parameters stay bitwise AfterStep's and DDP's.
// - The pull reads owner q's range of copy q while the owners only read it (in a
//   forward, backward or clipping no one writes parameters) and writes ranges of copy
//   r that only r reads; while an optimizer step runs (updating_) it takes nothing,
//   since the owners are writing and the update reads only owned ranges. A unit stays
//   stale until pulled, across any number of steps: a second step without a forward,
//   a forward that fails before reaching the unit, or a forward that never uses it
//   (its next user pulls the owners' latest values).
// - A broadcast of device 0's parameters (after a load, an in-place edit or a failed
//   step: Note [When replicas are refreshed]) makes every unit current. check_replicas()
//   compares what a replica holds as current: its own range always, a stale unit's
//   other pieces not.
// - Across processes the other processes' ranges are not in this one's memory:
//   NextForward is refused there.
// On CPU virtual devices the pull runs on the worker itself, so it overlaps only the
// other devices' compute; on GPUs the pull's peer copies run on the device's inbound
// stream (Note [Peer copies], after the owners' fences: Note [Copy fences]) and its
// compute stream waits for them where the unit is first read — nothing pulls ahead,
// so a unit's transfer overlaps only the compute already queued before it
// (docs/dp-vs-ddp.md has the CPU measurements).
void ShardedDesign::pull_unit(int rank, int unit) {
  std::vector<char>& stale = stale_[static_cast<std::size_t>(rank)];
  if (updating_ || !stale[static_cast<std::size_t>(unit)]) return;
  PhaseTimer t(recorder(), rank, Phase::AllGather);
  backend::CopyFences::Scope fenced(fences());  // the owners' ranges predate the step (Note [Copy fences])
  store_->pull_unit(rank, unit);
  const auto [lo, hi] = store_->units()[static_cast<std::size_t>(unit)];
  refresh_compute_range(rank, lo, hi);  // Note [Parameters in low precision]
  stale[static_cast<std::size_t>(unit)] = 0;
  // The next unit's pieces start now (Note [Copies ahead]): on GPUs they travel while
  // this unit computes.
  const auto next = static_cast<std::size_t>(unit) + 1;
  if (next < stale.size() && stale[next]) store_->pull_unit_ahead(rank, static_cast<int>(next));
}

// Device 0's copy of every other owner's range, on the calling thread (device 0's)
// once every update is done; the replicas go stale. Until it completes the copies
// count as unsynced: a failure in between makes the next step broadcast device 0's.
void ShardedDesign::pull_primary() {
  PhaseTimer t(recorder(), 0, Phase::AllGather);
  mark_unsynced();
  NoGradGuard no_grad;
  const Tensor& primary = set().copy(0).data;
  for (int q = 1; q < set().num_copies(); ++q) {
    const nn::CopySpan owner = store_->span(q);
    primary.narrow(0, owner.begin, owner.end - owner.begin).copy_(owner.data);
    gathered_bytes_[0] += (owner.end - owner.begin) * static_cast<std::int64_t>(sizeof(float));
  }
  mark_stale(true);
  end_replicate();
}

void ShardedDesign::mark_stale(bool stale) {
  store_->drop_pulls_ahead();  // what they carry may no longer be the owners' values
  for (std::size_t r = 1; r < stale_.size(); ++r) std::fill(stale_[r].begin(), stale_[r].end(), stale ? 1 : 0);
}

}  // namespace dp::parallel
