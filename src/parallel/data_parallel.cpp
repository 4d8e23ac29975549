#include "dp/parallel/data_parallel.h"

#include <algorithm>
#include <climits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"
#include "dp/tensor/ops.h"
#include "parallel/phase_timer.h"
#include "parallel/reducer.h"
#include "parallel/worker_pool.h"

namespace dp {

using parallel::Phase;
using parallel::PhaseTimer;

namespace {

std::vector<Device> devices_from_ids(const std::vector<int>& ids) {
  DeviceType type = default_device_type();
  int n = device_count(type);
  std::vector<Device> out;
  if (ids.empty()) {
    for (int i = 0; i < n; ++i) out.push_back(Device{type, i});
    return out;
  }
  for (int id : ids) {
    DP_CHECK(id >= 0 && id < n, "DataParallel: device id ", id, " is out of range: expected [0, ", n,
             ") ", type, " devices");
    out.push_back(Device{type, id});
  }
  return out;
}

void check_device_list(const std::vector<Device>& devices) {
  DP_CHECK(!devices.empty(), "DataParallel: expected at least one device, got an empty list");
  std::set<int> seen;
  for (const Device& d : devices) {
    DP_CHECK(d.type == devices[0].type, "DataParallel: expected devices of one type, got ", devices[0],
             " and ", d);
    int n = device_count(d.type);
    DP_CHECK(d.index >= 0 && d.index < n, "DataParallel: device ", d, " is out of range: ", n, " ",
             d.type, " devices exist");
    DP_CHECK(seen.insert(d.index).second, "DataParallel: device ", d,
             " appears twice in the device list; each device may be listed once");
  }
}

// Note [Gather backward]
// The gathered output's grad_fn is this node. It has no edges into the replicas'
// graphs: each replica's graph was recorded by its own worker thread and is run by
// that worker. apply() splits the incoming gradient by shard and hands each piece
// to its device's worker, which runs backward on its own tape concurrently; the
// gradients are then reduced (DP) or have been all-reduced during backward (DDP).
class GatherBackward final : public autograd::Node {
 public:
  /// Returns the gradients of the node's inputs (those of DataParallel's inputs that
  /// required one), in order.
  using Run = std::function<std::vector<Tensor>(const std::vector<Tensor>& roots, const std::vector<Tensor>& pieces)>;
  GatherBackward(std::vector<Tensor> outputs, std::vector<std::int64_t> sizes, Run run)
      : outputs_(std::move(outputs)), sizes_(std::move(sizes)), run_(std::move(run)) {}
  /// Expires when the replicas' graphs can no longer be run: the node was destroyed,
  /// or a backward through it released them (Note [Forwards before a backward]).
  std::weak_ptr<const int> graph_alive() const { return graph_alive_; }
  std::string name() const override { return "DataParallelGatherBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    DP_CHECK(!released_, "backward through DataParallel's output a second time: the replicas' graphs "
             "were freed by the first backward");
    std::vector<Tensor> input_grads = run_(outputs_, split(grads[0].detach(), sizes_));
    if (next_edges.empty()) return {};
    return input_grads;
  }
  void release_saved() override {
    outputs_.clear();
    graph_alive_.reset();
    released_ = true;
  }

 private:
  std::shared_ptr<const int> graph_alive_ = std::make_shared<const int>(0);
  std::vector<Tensor> outputs_;
  std::vector<std::int64_t> sizes_;
  Run run_;
};

}  // namespace

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::DP: return "DP";
    case Mode::DDP: return "DDP";
    case Mode::Sharded: return "Sharded";
  }
  return "?";
}

// Note [Sharded parameters], Note [Forwards before a backward]
struct DataParallel::UnitState {
  struct Mark {
    std::uint64_t sequence_nr;  // the first node made under `unit`
    int unit;                   // -1: a forward starts, no unit yet
    std::uint64_t forward;      // the forward that made it (DataParallel::forwards_)
  };
  std::vector<Mark> marks;          // ascending sequence numbers
  int forward = -1, backward = -1;  // the unit current in each pass
};

struct DataParallel::ShardPlan {
  std::int64_t rows = 0;
  std::vector<std::int64_t> sizes, offsets;  // per rank; a rank may get 0 rows
};

// Note [Step scope]
// Everything that runs the workers — forward, forward_backward, the backward through
// a gathered output, and the optimizer's executor — is one Step. It owns the busy
// flag (a second step from inside a worker would deadlock: it is an error instead),
// the replicate bookkeeping (Note [When replicas are refreshed]; a Sharded optimizer
// step ends with every copy equal again, Note [Sharded step]), the reducer's
// cycle for steps that run backward, and the one failure path: the first worker to
// fail aborts the communicator and the reducer, so every other worker and comm
// thread is released (Note [Root cause]); once all have returned, the comm threads
// are joined, the communicator is re-armed and the exception reaches the caller.
// The DataParallel is then usable again: the next step re-synchronises the replicas.
class DataParallel::Step {
 public:
  struct Options {
    bool replicate = false;  // a forward: replicas must hold device 0's parameters
    bool backward = false;   // runs backward: the reducer's cycle is armed
    bool gather = false;     // a Sharded optimizer step: copies equal again afterwards
  };
  Step(DataParallel& dp, const char* what, Options options) : dp_(dp), options_(options) {
    DP_CHECK(!dp_.busy_, "DataParallel: ", what, " called while another step runs (from inside a worker?)");
    // Note [Sharded parameters]: device 0's parameters gathered for the user since the
    // last step go back (written back to every range when they were edited).
    dp_.set_->scatter_primary();
    if (options_.replicate || options_.gather) sync_params_ = dp_.begin_replicate();
    if (options_.replicate && dp_.params_sharded()) dp_.forget_dead_forwards();
    // Note [Deferred gather]: a broadcast of device 0's parameters makes every unit current.
    if (sync_params_ && dp_.deferred_gather()) dp_.mark_stale(false);
    if (options_.backward) {
      dp_.check_sharded_grads_unedited("a backward");
      dp_.forget_combined_grads();
      dp_.reducer_->prepare(dp_.options_.mode == Mode::DP || dp_.require_sync_);
    }
    dp_.updating_ = options_.gather;  // with busy_: the destructor resets both
    dp_.busy_ = true;
  }
  ~Step() {
    if (options_.backward) dp_.reducer_->end();
    dp_.carry_sums_ = false;  // Note [Accumulating after a combined backward]
    dp_.drop_pulls_ahead();  // a unit the forward never reached: pulled afresh when it is
    dp_.updating_ = false;
    dp_.busy_ = false;
  }
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;

  bool sync_params() const { return sync_params_; }

  /// Runs fn(rank) for rank in [0, ranks) (default: every device), each bound to its
  /// replica, rank 0 on the calling thread; one failure path.
  void run(const std::function<void(int rank)>& fn, int ranks = -1) {
    try {
      // Note [Copy fences]: every worker is idle and what its copies read is enqueued.
      dp_.fences_->record();
      dp_.workers_->run(
          [&](int r) {
            nn::ReplicaBinding bind(r);
            if (!dp_.params_sharded()) {
              if (options_.backward) {
                // Note [Forwards before a backward]: a DP replica's gradient is what this
                // backward alone brings; the last one's was reduced onto device 0.
                if (dp_.options_.mode == Mode::DP && r > 0) dp_.set_->copy(r).grad.zero_();
                dp_.reducer_->begin(r);
              }
              fn(r);
              return;
            }
            // Note [Sharded parameters]: a forward records which unit each node was made
            // under; a backward gathers them again node by node; whatever happens, the
            // rank's units are released when its part of the step ends.
            struct Leave {
              DataParallel& dp;
              int r;
              ~Leave() { dp.leave_units(r); }
            } leave{dp_, r};
            if (options_.replicate)  // nodes made before the forward's first unit belong to none
              dp_.unit_state_[r].marks.push_back({autograd::peek_sequence_nr(), -1, dp_.forwards_});
            std::optional<autograd::BackwardNodeHook> hook;
            if (options_.backward)
              hook.emplace([this, r](const autograd::Node& node) { dp_.backward_unit(r, node.sequence_nr); });
            if (options_.backward) dp_.reducer_->begin(r);
            fn(r);
          },
          [this](int r, const std::exception_ptr& e) { dp_.abort_step(r, e); }, ranks);
    } catch (...) {
      if (options_.backward) dp_.reducer_->end();  // join the comm threads first
      dp_.comm_->reset();
      throw;
    }
    if (options_.replicate || options_.gather) dp_.end_replicate();
    if (options_.replicate) dp_.recorder_->count_iteration();
    if (options_.backward) {
      dp_.snapshot_grad_versions();
      // Combined gradients (Note [Accumulating after a combined backward]).
      dp_.grads_combined_ = (dp_.options_.mode == Mode::DDP && dp_.require_sync_ && dp_.world_devices() > 1) ||
                            (dp_.options_.mode == Mode::DP && dp_.processes_ > 1) || dp_.sharded_sums_in_dp_order();
      dp_.zero_grad_count_ = dp_.set_->zero_grad_count();
    }
  }

 private:
  DataParallel& dp_;
  Options options_;
  bool sync_params_ = false;
};

// Note [Sharded parameters]
// ZeRO stage 3 (FSDP): each device keeps only its range of the parameters (Note
// [Sharded parameter sets]; Note [Sharded parameter buffers] in dp/nn/parameter_set.h for the
// buffers). The gather units are the net's top-level children, each a contiguous run
// of the flat layout because parameters are flattened depth first in registration
// order (parameters registered on the root itself form units of their own; a net
// without children is one unit).
// Forward: the first time a worker's forward reads a parameter of unit u
// (Parameter::get, on the worker's thread), u is gathered for that device, every
// other gathered unit but u + 1 is released, and u + 1 is started on its way (the
// prefetch, ParameterSet::gather_unit_ahead, Note [Copies ahead] in backend.h: on
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
// The gather is a pull from every owner's range (ParameterSet::gather_unit): it needs
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

bool DataParallel::params_sharded() const { return set_->shards_params(); }

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::gather_units() const {
  // Owner of each slot: the index of the top-level child that holds it, or -1-i for
  // the root's own parameter i (a unit of its own).
  std::map<const nn::Parameter::Slot*, int> owner;
  int child = 0;
  for (auto& [name, c] : net_->named_children()) {
    for (auto& s : c->parameter_slots()) owner.emplace(s.get(), child);
    ++child;
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> units;
  int last = 0;
  const auto& slots = set_->slots();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    auto it = owner.find(slots[i].get());
    const int who = it != owner.end() ? it->second : -1 - static_cast<int>(i);
    const std::int64_t lo = slots[i]->offset, hi = lo + slots[i]->copies[0].numel();
    if (hi == lo) continue;
    if (!units.empty() && who == last && units.back().second == lo) {
      units.back().second = hi;
    } else {
      units.emplace_back(lo, hi);
    }
    last = who;
  }
  return units;
}

// The unit hook: worker `rank`'s forward reads a parameter of `unit`.
void DataParallel::enter_unit(int rank, int unit) {
  UnitState& st = unit_state_[static_cast<std::size_t>(rank)];
  if (st.forward == unit) return;
  st.marks.push_back({autograd::peek_sequence_nr(), unit, forwards_});
  st.forward = unit;
  PhaseTimer t(*recorder_, rank, Phase::AllGather);
  backend::CopyFences::Scope fenced(*fences_);  // the owners' ranges predate the step (Note [Copy fences])
  const int n = static_cast<int>(set_->units().size());
  for (int u = 0; u < n; ++u)
    if (u != unit && u != unit + 1) set_->release_unit(rank, u);  // gathered or on its way
  set_->gather_unit(rank, unit);
  if (unit + 1 < n) set_->gather_unit_ahead(rank, unit + 1);  // the prefetch (Note [Copies ahead])
}

// The backward node hook of worker `rank`.
void DataParallel::backward_unit(int rank, std::uint64_t sequence_nr) {
  UnitState& st = unit_state_[static_cast<std::size_t>(rank)];
  auto it = std::upper_bound(st.marks.begin(), st.marks.end(), sequence_nr,
                             [](std::uint64_t nr, const UnitState::Mark& m) { return nr < m.sequence_nr; });
  if (it == st.marks.begin()) return;  // made before any parameter was read
  const int unit = std::prev(it)->unit;
  if (unit < 0 || unit == st.backward) return;
  if (st.backward >= 0) reducer_->wait_combined(rank);
  PhaseTimer t(*recorder_, rank, Phase::AllGather);
  backend::CopyFences::Scope fenced(*fences_);  // Note [Copy fences]
  for (int u = 0; u < static_cast<int>(set_->units().size()); ++u)
    if (u != unit) set_->release_unit(rank, u);  // gathered or on its way
  set_->gather_unit(rank, unit);
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
void DataParallel::forget_dead_forwards() {
  std::erase_if(live_forwards_, [](const auto& f) { return f.second.expired(); });
  for (UnitState& st : unit_state_)
    std::erase_if(st.marks, [this](const UnitState::Mark& m) {
      return std::none_of(live_forwards_.begin(), live_forwards_.end(),
                          [&m](const auto& f) { return f.first == m.forward; });
    });
  ++forwards_;
}

void DataParallel::leave_units(int rank) {
  UnitState& st = unit_state_[static_cast<std::size_t>(rank)];
  st.forward = st.backward = -1;
  set_->release_units(rank);
}

// ---- construction -------------------------------------------------------------------------

DataParallel::DataParallel(std::shared_ptr<nn::Module> net, std::vector<int> device_ids,
                           DataParallelOptions options)
    : net_(std::move(net)), options_(std::move(options)) {
  init(devices_from_ids(device_ids));
}

DataParallel::DataParallel(std::shared_ptr<nn::Module> net, std::vector<Device> devices,
                           DataParallelOptions options)
    : net_(std::move(net)), options_(std::move(options)) {
  init(std::move(devices));
}

// Bad options fail before anything is built, each naming what was expected.
void DataParallel::check_options(int n) {
  DP_CHECK(options_.output_device >= 0 && options_.output_device < n, "DataParallel: output_device ",
           options_.output_device, " is not an index into the ", n, " devices");
  DP_CHECK(options_.check_replicas_every >= 0, "DataParallel: expected check_replicas_every >= 0 (0 = never), got ",
           options_.check_replicas_every);
  DP_CHECK(options_.collective_timeout.count() > 0, "DataParallel: expected a positive collective_timeout, got ",
           options_.collective_timeout.count(), " ms");
  DP_CHECK(options_.bucket_cap_mb > 0 && options_.first_bucket_mb > 0,
           "DataParallel: expected bucket_cap_mb and first_bucket_mb > 0, got ", options_.bucket_cap_mb, " and ",
           options_.first_bucket_mb);
  if (options_.mode == Mode::Sharded) {
    const int stage = options_.shard_stage.value_or(2);
    DP_CHECK(stage >= 1 && stage <= 3, "DataParallel: expected shard_stage 1 (optimizer state), 2 (and "
             "gradients) or 3 (and parameters), got ", stage);
    options_.shard_stage = stage;
    DP_CHECK(!(options_.shard_gather.has_value() && stage == 3), "DataParallel: shard_gather was given with "
             "shard_stage 3, which gathers each top-level child's parameters just before it runs anyway; drop "
             "shard_gather or use shard_stage 1 or 2");
  } else {
    DP_CHECK(!options_.shard_stage.has_value(), "DataParallel: shard_stage = ", *options_.shard_stage,
             " was given with mode ", mode_name(options_.mode), "; it applies to Mode::Sharded only: pass "
             ".mode = dp::Mode::Sharded or drop shard_stage");
    DP_CHECK(!options_.shard_gather.has_value(), "DataParallel: shard_gather was given with mode ",
             mode_name(options_.mode), "; it applies to Mode::Sharded stages 1 and 2 only: pass .mode = "
             "dp::Mode::Sharded or drop shard_gather");
  }
}

void DataParallel::init(std::vector<Device> devices) {
  DP_CHECK(net_ != nullptr, "DataParallel: expected a module, got null");
  check_device_list(devices);
  const int n = static_cast<int>(devices.size());
  check_options(n);
  devices_ = std::move(devices);

  net_->to(devices_[0]);
  set_ = net_->parameter_set();
  DP_CHECK(set_ != nullptr, "DataParallel: the module has no parameters to train");
  DP_CHECK(set_->num_copies() == 1, "DataParallel: this module is already wrapped by another "
           "DataParallel; wrap a module once");
  buffers_ = net_->buffer_slots();
  for (auto& [name, t] : net_->named_parameters()) param_names_.push_back(name);

  backend::get(devices_[0]).set_concurrent_devices(n);
  recorder_ = std::make_unique<parallel::PhaseRecorder>(devices_);
  const comm::CommOptions comm_options{.timeout = options_.collective_timeout};
  comm_ = options_.span_processes ? comm::make_world_communicator(devices_, comm_options)
                                  : comm::make_communicator(devices_, comm_options);
  processes_ = comm_->world_size() / n;
  process_ = comm_->first_rank() / n;
  const int world = processes_ * n;
  workers_ = std::make_unique<parallel::WorkerPool>(devices_, "worker", /*caller_runs_rank0=*/true);
  fences_ = std::make_unique<backend::CopyFences>(devices_);
  sync_processes();
  const bool persistent = options_.mode != Mode::DP;
  for (int r = 1; r < n; ++r) set_->add_copy(devices_[r], /*transient=*/!persistent);
  // Stage 3 shards over this process's devices only (Note [Stage 3 across
  // processes]); one device per process has nothing to shard parameters over, and
  // stage 3 then runs as stage 2 (as stage 1 in one process: one device owns
  // everything, and stage 2's separate gradient would only add memory).
  const bool shard_params = options_.mode == Mode::Sharded && shard_stage() == 3 && n > 1;
  if (shard_params)
    set_->shard(/*shard_grads=*/true, n, 0);
  else if (options_.mode == Mode::Sharded)
    set_->shard(/*shard_grads=*/shard_stage() >= 2 && world > 1, world, comm_->first_rank());
  if (set_->sharded_across_processes())  // Note [Ranges across processes]
    set_->set_process_gather([this](const std::vector<float>& mine) { return gather_processes(mine); });
  if (options_.mode == Mode::Sharded && !shard_params && n > 1 &&
      options_.shard_gather.value_or(ShardGather::AfterStep) == ShardGather::NextForward) {
    DP_CHECK(processes_ == 1, "DataParallel: shard_gather = NextForward across ", processes_, " processes: "
             "a device takes the ranges it lacks from the other devices' memory, and the other processes' "
             "ranges are not in this one; use ShardGather::AfterStep (the default) across processes");
    set_->track_units(gather_units());  // Note [Deferred gather]
    stale_.assign(static_cast<std::size_t>(n), std::vector<char>(set_->units().size(), 0));
    pull_ahead_.assign(static_cast<std::size_t>(n), std::vector<std::vector<nn::ParameterCopy::UnitPiece>>(set_->units().size()));
    set_->set_unit_hook([this](int r, int u) { pull_unit(r, u); });
  }
  if (shard_params) {
    set_->shard_params(gather_units());
    unit_state_.resize(static_cast<std::size_t>(n));
    set_->set_unit_hook([this](int r, int u) { enter_unit(r, u); });
  }
  coalesce_buffers();
  storage_base_.assign(n, 0);
  grad_base_.assign(n, 0);
  end_replicate();
  snapshot_grad_versions();
  make_reducer();

  set_->set_executor([this](int copies, const std::function<void(int)>& fn, nn::CopyWork work) {
    run_on_copies(copies, work, fn);
  });
}

// Note [Across processes]
// Launched by mpirun, DataParallel spans every process of the job: the communicator
// is a world communicator (Note [World ranks]) and world rank p * n + i is device i
// of process p. Every process must construct it, in the same order, with the same
// number of devices and the same module; construction then makes every process start
// from process 0's parameters and buffers (sync_processes), as PyTorch's DDP does.
// Each process passes its own batch (a DistributedSampler gives each its part), and
// the loss keeps its meaning: gradients are scaled by each device's rows over the
// GLOBAL batch's rows (one host all-reduce of the row count per step), so the sum over
// every device of the job is the mean over the global batch — exact for batches that
// differ between processes too. Per design:
//  - DDP: the buckets' all-reduce runs over every device of the job (hierarchical:
//    within the process, then across processes, then within again); buffers come
//    from world rank 0 before each forward.
//  - DP: each process reduces onto its device 0, the device 0s all-reduce among
//    themselves (Note [DP across processes]) and each steps its own optimizer with
//    the same sum: no parameter crosses a process boundary after construction; the
//    replicas of a process are refreshed from its device 0 as in one process.
//  - Sharded (stages 1 and 2): the flat buffers are cut into world-many ranges; each
//    bucket's pieces are reduced onto their owners wherever they live, and the step
//    ends with a world all-gather. What needs every range — an optimizer's
//    state_dict(), clip_grad_norm_'s total — exchanges the other processes' parts
//    (Note [Ranges across processes] in dp/nn/parameter_set.h).
//  - Sharded stage 3: hybrid, sharded within each process and replicated across
//    processes (Note [Stage 3 across processes]).
// Every reduction sums a process's devices first, in device order, then the
// processes in process order, so the three designs are bitwise identical to one
// another for a given topology and every run of it is bitwise reproducible; against
// one process with all the devices they agree to float rounding (the sums group
// differently). A failure in one process ends the job (Note [Fault policy]).

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
// ParameterSet::shard_world()) is n: everything that needs every range — an
// optimizer's state_dict(), clip_grad_norm_ — finds all of them in each process.
// Edits through device 0's gathered parameters (a load) are written back into this
// process's ranges only: as in DDP across processes (Note [When replicas are
// refreshed]), every process must make them (each loads the checkpoint).

// Every process's part of a set sharded across processes, in process order (Note
// [Ranges across processes]): one dp::dist broadcast per process, on the calling
// thread, bounded by dp::dist::timeout() (Note [Fault policy]).
std::vector<std::vector<float>> DataParallel::gather_processes(const std::vector<float>& mine) const {
  std::vector<std::vector<float>> out;
  for (int p = 0; p < processes_; ++p) out.push_back(dist::broadcast_object(p == process_ ? mine : std::vector<float>{}, p));
  return out;
}

int DataParallel::shard_world() const { return options_.mode == Mode::Sharded ? set_->shard_world() : 0; }

// Process 0's parameters and buffers, everywhere (Note [Across processes]); runs at
// construction, before the replicas are made, on the calling thread (device 0's).
void DataParallel::sync_processes() {
  comm::Communicator* across = comm_->peers(0);
  if (across == nullptr) return;
  NoGradGuard no_grad;
  across->broadcast(process_, set_->copy(0).data, 0);
  for (auto& b : buffers_) {
    Tensor t = b->copies[0];
    if (t.dtype() != Dtype::Float32) continue;
    across->broadcast(process_, t.reshape({t.numel()}), 0);  // a view: t receives it
  }
}

// The rows of the job's batch: this process's `rows` plus every other process's.
std::int64_t DataParallel::global_rows(std::int64_t rows) const {
  return processes_ > 1 ? dist::all_reduce(rows, dist::Op::Sum) : rows;
}

// Note [Gradient edits]
// After a DDP backward every replica holds the same all-reduced gradient. A user who
// edits gradients through parameters() — device 0's copy — between backward() and
// step() (scaling, zeroing a layer, clipping by hand) edits copy 0 alone.
// dp::nn::utils::clip_grad_norm_ / clip_grad_value_ act on every copy, so they need
// nothing more; any other edit is caught by the grad buffers' storage versions: when
// copy 0's moved by a different amount than a replica's since the gradients were
// last synchronised, the next update of every copy — the optimizer step, or a clip or
// zero_grad before it — first broadcasts device 0's gradient buffer to every replica
// (one call over the buffer, only then), so every replica applies the gradient the
// user sees. (Only at the step, as it once was, an edit followed by clip_grad_norm_
// escaped: the clip scaled each copy's own gradient, and the versions it snapshotted
// after its update moved equally from then on — replicas drifted, silently.) A step inside no_sync() would apply unequal
// local gradients: it is refused.
// In Sharded mode every device keeps the summed gradient of its own range alone
// (stage 1 in place, zeros elsewhere; stages 2 and 3 keep no .grad at all), so what
// device 0's .grad shows is the sum on device 0's range and zeros on the others: an
// edit through it could not reach the owners of those ranges. A step after such an
// edit (the grad buffer's version moved since backward, clipping's own writes aside)
// is refused, naming the two clip functions, which act on every range.

// The optimizer's executor: each persistent copy on its own device's worker; DP's
// transient replicas are never stepped, so DP's step stays on rank 0. A Sharded step
// then gathers every device's updated range (Note [Sharded step]), or device 0's
// alone (Note [Deferred gather]).
// Note [Small work inline]
// Zeroing the gradients of a small model (the ToyModel's 165 parameters: 660 bytes a
// copy) takes far less than a hand-over to every worker and back. Such work comes as
// CopyWork::SmallGradients, and the calling thread does every copy's itself, as the
// workers would (no worker runs between steps; on CUDA each call enqueues on the
// copy's device's stream, the one its worker uses), under the same busy check. The
// gradient versions are snapshotted as after any update of every copy.
void DataParallel::run_on_copies(int copies, nn::CopyWork work, const std::function<void(int)>& fn) {
  const bool replicas = options_.mode != Mode::DP && world_devices() > 1;
  // Note [Gradient edits]: before ANY update of every copy, not just the step — a clip
  // after an edit by hand would otherwise scale unequal gradients, and its snapshot
  // would then hide the edit from the step (the replicas drifted: the loop fuzzer).
  const bool sync_grads = replicas && options_.mode == Mode::DDP && require_sync_ && grads_edited_unequally();
  note_sharded_grad_edits();
  if (work == nn::CopyWork::SmallGradients && !sync_grads) {
    DP_CHECK(!busy_, "DataParallel: an update of every copy called while another step runs (from inside a worker?)");
    for (int r = 0; r < copies; ++r) fn(r);
    snapshot_grad_versions();
    return;
  }
  const bool update = work == nn::CopyWork::Step;
  DP_CHECK(!(update && replicas && !require_sync_),
           "DataParallel: opt.step() inside no_sync(): each replica holds only its own accumulated "
           "gradient until the first backward after the guard combines them; step after that backward");
  if (update) check_sharded_grads_unedited("opt.step()");
  const bool gather = update && replicas && options_.mode == Mode::Sharded && !params_sharded();
  int ranks = 0;
  for (int r = 0; r < copies; ++r)
    if (!set_->copy(r).transient) ranks = r + 1;
  {
    Step step(*this, update ? "the optimizer step" : "an update of every copy", {.gather = gather});
    step.run(
        [&](int r) {
          if (gather && step.sync_params()) {
            PhaseTimer t(*recorder_, r, Phase::Replicate);
            comm_->broadcast(r, set_->copy(r).data, 0);
          }
          {
            PhaseTimer t(*recorder_, r, Phase::Step);
            if (sync_grads) comm_->broadcast(r, set_->copy(r).grad, 0);
            fn(r);
          }
          if (gather && !deferred_gather()) gather_params(r);
        },
        ranks);
    if (gather && deferred_gather()) pull_primary();
  }
  snapshot_grad_versions();
  if (update && options_.check_replicas_every > 0 && ++updates_ % options_.check_replicas_every == 0)
    check_replicas();
}

// Note [Accumulating after a combined backward]
// After a synced DDP backward every replica holds the SUM over devices (across
// processes, so does every process's device 0 in DP mode). A second
// backward without zero_grad() (gradient accumulation without no_sync) adds each
// device's new local gradient to it, and a second all-reduce would then sum the old
// sum N times. Before such a backward, every replica but device 0's forgets the
// combined sum (zeroes its gradient), so the next all-reduce adds the old sum once:
// the same numbers, in the same order, as DP's accumulation on device 0. Skipped
// when the gradients were zeroed since (the usual loop), so it costs nothing there.
// Sharded (one process, CPU devices: where the sums are in device order and the
// designs promise each other's bits) keeps the sum of each range on its owner, and a
// second reduce-scatter would add it at the owner's place in the order: the owner's
// piece, not device 0's first. So the earlier sum moves to where DP has it, the start
// of device 0's contribution: stage 1 copies every other owner's summed range into
// device 0's gradient buffer (zeros there until now) and zeroes the owner's, which is
// then DDP's state exactly; stages 2 and 3, whose synced passes keep no full buffer
// (Note [Detached gradients]), carry it instead — device 0 adds the owner's sum into
// each piece it sends (piece + S == S + piece, as device 0's accumulation adds), and
// the owner's range takes the result in place of adding it. Every element then sums
// (S + g_0) + g_1 + ... + g_{N-1}, DP's and DDP's order, bit for bit. The price is a
// copy of the other owners' ranges (stage 1) or a read of them piece by piece
// (stages 2, 3), in a backward that follows a combined one without zero_grad only.
bool DataParallel::sharded_sums_in_dp_order() const {
  return options_.mode == Mode::Sharded && require_sync_ && processes_ == 1 && devices_.size() > 1 &&
         devices_[0].is_cpu();
}

void DataParallel::forget_combined_grads() {
  if (!grads_combined_) return;
  grads_combined_ = false;
  if (set_->zero_grad_count() != zero_grad_count_) return;
  NoGradGuard no_grad;
  if (options_.mode == Mode::Sharded) {
    if (set_->shards_grads()) {
      carry_sums_ = require_sync_;  // a no_sync pass accumulates into the owners' buffers instead
      return;
    }
    const Tensor& grad0 = set_->copy(0).grad;
    for (int r = 1; r < set_->num_copies(); ++r) {
      const nn::ParameterCopy& c = set_->copy(r);
      const std::int64_t lo = std::min(c.begin, set_->numel()), n = std::min(c.end, set_->numel()) - lo;
      if (n <= 0) continue;
      grad0.narrow(0, lo, n).copy_(c.grad.narrow(0, lo, n));
      c.grad.narrow(0, lo, n).zero_();
    }
    return;
  }
  // Across processes every process's device 0 holds the sum too (DP's as well, Note
  // [DP across processes]): process 0's alone keeps it.
  for (int r = process_ == 0 ? 1 : 0; r < set_->num_copies(); ++r) set_->copy(r).grad.zero_();
}

// Note [Gradient edits]: Sharded ranges cannot take an edit made through device 0's
// .grad. An edit is noticed at the next update of every copy or backward (whichever
// comes first: a clip's snapshot would hide it from the step) and stands until a
// zero_grad of the whole set.
void DataParallel::note_sharded_grad_edits() {
  if (options_.mode != Mode::Sharded || world_devices() == 1) return;
  const Tensor& grad0 = set_->copy(0).grad;  // undefined in stages 2 and 3 between steps
  if (!grad0.defined() || grad0.storage()->version() == grad_base_[0]) return;
  // A zero_grad of the whole set since (module.zero_grad() does not come through here)
  // leaves every range zero everywhere: device 0's later edits then travel with its
  // piece of the next reduce, as DDP's do.
  if (set_->zero_grad_count() != snapshot_zero_grad_count_) return;
  grads_edited_by_hand_ = true;
  edited_zero_grad_count_ = set_->zero_grad_count();
}

void DataParallel::check_sharded_grads_unedited(const char* what) {
  note_sharded_grad_edits();
  if (grads_edited_by_hand_ && set_->zero_grad_count() != edited_zero_grad_count_) grads_edited_by_hand_ = false;
  DP_CHECK(!grads_edited_by_hand_, "DataParallel (Sharded): ", what,
           " after the gradients were edited through parameters() by hand: device 0 holds the summed "
           "gradient of its own range only (zeros elsewhere), so the edit cannot reach the ranges the other "
           "devices own; use dp::nn::utils::clip_grad_norm_ / clip_grad_value_ (they act on every range), "
           "scale the loss instead, or use Mode::DDP");
}

bool DataParallel::grads_edited_unequally() const {
  const std::uint64_t moved0 = set_->copy(0).grad.storage()->version() - grad_base_[0];
  for (int r = 1; r < set_->num_copies(); ++r)
    if (set_->copy(r).grad.storage()->version() - grad_base_[r] != moved0) return true;
  return false;
}

void DataParallel::snapshot_grad_versions() {
  snapshot_zero_grad_count_ = set_->zero_grad_count();
  for (int r = 0; r < set_->num_copies(); ++r) {
    const Tensor& g = set_->copy(r).grad;  // undefined while released (Sharded stage 2)
    grad_base_[r] = g.defined() ? g.storage()->version() : 0;
  }
}

void DataParallel::check_replicas() const {
  if (options_.mode == Mode::DP || params_sharded()) return;
  const auto& slots = set_->slots();
  const Tensor& primary = set_->copy(0).data;
  for (int r = 1; r < set_->num_copies(); ++r) {
    NoGradGuard no_grad;
    Tensor replica = set_->copy(r).data.to(devices_[0]);
    if (equal(replica, primary)) continue;
    const nn::ParameterCopy& c = set_->copy(r);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      std::int64_t lo = slots[i]->offset, hi = lo + slots[i]->copies[0].numel();
      // Note [Deferred gather]: of a stale unit, only the replica's own range is current.
      if (deferred_gather() && stale_[static_cast<std::size_t>(r)][static_cast<std::size_t>(slots[i]->unit)]) {
        lo = std::max(lo, c.begin);
        hi = std::max(lo, std::min(hi, c.end));
      }
      const std::int64_t n = hi - lo;
      if (!equal(replica.narrow(0, lo, n), primary.narrow(0, lo, n)))
        DP_FAIL("DataParallel: replica on ", devices_[r], " differs from ", devices_[0], " in parameter '",
                param_names_[i], "' — a replica's memory was written outside dp (a raw pointer, another "
                "module sharing the storage); load_state_dict() or an in-place write through parameters() "
                "re-synchronises every replica at the next forward");
    }
  }
}

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
void DataParallel::gather_params(int rank) {
  PhaseTimer t(*recorder_, rank, Phase::AllGather);
  const nn::ParameterCopy& c = set_->copy(rank);
  const std::int64_t len = c.end - c.begin;
  comm_->all_gather(rank, c.data.narrow(0, c.begin, len), c.data.narrow(0, 0, len * comm_->world_size()));
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
//   children), tracked by the set without sharding the data (Note [Tracked units]):
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
void DataParallel::pull_unit(int rank, int unit) {
  std::vector<char>& stale = stale_[static_cast<std::size_t>(rank)];
  if (updating_ || !stale[static_cast<std::size_t>(unit)]) return;
  PhaseTimer t(*recorder_, rank, Phase::AllGather);
  backend::CopyFences::Scope fenced(*fences_);  // the owners' ranges predate the step (Note [Copy fences])
  NoGradGuard no_grad;
  const auto [lo, hi] = set_->units()[static_cast<std::size_t>(unit)];
  const Tensor& mine = set_->copy(rank).data;
  auto& ahead = pull_ahead_[static_cast<std::size_t>(rank)];
  if (!ahead[static_cast<std::size_t>(unit)].empty()) {  // started by the previous unit's pull: it lands
    backend::Backend& be = backend::get(mine.device());
    for (const nn::ParameterCopy::UnitPiece& p : std::exchange(ahead[static_cast<std::size_t>(unit)], {}))
      be.finish_copy(*p.copy, mine.data<float>() + p.at, mine.device());
    mine.storage()->bump_version();  // written behind the tensor's back: as copy_ would
  } else {
    for (int q = 0; q < set_->num_copies(); ++q) {
      if (q == rank) continue;
      const nn::ParameterCopy& owner = set_->copy(q);
      const std::int64_t a = std::max(lo, owner.begin), b = std::min(hi, owner.end);
      if (a < b) mine.narrow(0, a, b - a).copy_(owner.data.narrow(0, a, b - a));
    }
  }
  stale[static_cast<std::size_t>(unit)] = 0;
  // The next unit's pieces start now (Note [Copies ahead]): on GPUs they travel while
  // this unit computes.
  const auto next = static_cast<std::size_t>(unit) + 1;
  if (next >= stale.size() || !stale[next] || !ahead[next].empty()) return;
  const auto [nlo, nhi] = set_->units()[next];
  for (int q = 0; q < set_->num_copies(); ++q) {
    if (q == rank) continue;
    const nn::ParameterCopy& owner = set_->copy(q);
    const std::int64_t a = std::max(nlo, owner.begin), b = std::min(nhi, owner.end);
    if (a >= b) continue;
    ahead[next].push_back({a, b - a,
                           backend::get(mine.device())
                               .copy_ahead(mine.device(), owner.data.data<float>() + a, owner.device,
                                           static_cast<std::size_t>(b - a) * sizeof(float))});
  }
}

void DataParallel::drop_pulls_ahead() {
  for (auto& units : pull_ahead_)
    for (auto& pieces : units) pieces.clear();
}

// Device 0's copy of every other owner's range, on the calling thread (device 0's)
// once every update is done; the replicas go stale. Until it completes the copies
// count as unsynced: a failure in between makes the next step broadcast device 0's.
void DataParallel::pull_primary() {
  PhaseTimer t(*recorder_, 0, Phase::AllGather);
  synced_version_ = kUnsynced;
  NoGradGuard no_grad;
  const Tensor& primary = set_->copy(0).data;
  for (int q = 1; q < set_->num_copies(); ++q) {
    const nn::ParameterCopy& owner = set_->copy(q);
    primary.narrow(0, owner.begin, owner.end - owner.begin)
        .copy_(owner.data.narrow(0, owner.begin, owner.end - owner.begin));
  }
  mark_stale(true);
  end_replicate();
}

void DataParallel::mark_stale(bool stale) {
  drop_pulls_ahead();  // what they carry may no longer be the owners' values
  for (std::size_t r = 1; r < stale_.size(); ++r) std::fill(stale_[r].begin(), stale_[r].end(), stale ? 1 : 0);
}

// DP reduces the whole gradient buffer onto device 0 after backward; DDP all-reduces
// buckets while backward runs (Note [Gradient buckets]); Sharded reduce-scatters
// them (Note [Sharded gradients]). All go through the reducer.
void DataParallel::make_reducer() {
  const auto& slots = set_->slots();
  std::vector<parallel::Bucket> buckets;
  std::unique_ptr<parallel::GradSync> sync;
  const bool overlapping = options_.mode != Mode::DP;
  if (overlapping && params_sharded()) {
    // Note [Sharded parameters]: buckets never straddle a unit; the last unit first.
    const auto& units = set_->units();
    std::int64_t first_cap = parallel::mib_to_floats(options_.first_bucket_mb);
    for (std::size_t u = units.size(); u-- > 0;) {
      std::vector<std::int64_t> numel;
      int first = -1;
      for (int i = 0; i < static_cast<int>(slots.size()); ++i)
        if (slots[i]->unit == static_cast<int>(u)) {
          if (first < 0) first = i;
          numel.push_back(slots[i]->copies[0].numel());
        }
      if (first < 0) continue;
      for (parallel::Bucket b : parallel::assign_buckets(numel, first_cap, parallel::mib_to_floats(options_.bucket_cap_mb))) {
        b.lo += slots[first]->offset;
        b.hi += slots[first]->offset;
        b.first_param += first;
        buckets.push_back(b);
      }
      first_cap = parallel::mib_to_floats(options_.bucket_cap_mb);
    }
  } else if (overlapping) {
    std::vector<std::int64_t> numel;
    for (auto& s : slots) numel.push_back(s->copies[0].numel());
    buckets = parallel::assign_buckets(numel, parallel::mib_to_floats(options_.first_bucket_mb),
                                       parallel::mib_to_floats(options_.bucket_cap_mb));
  }
  if (options_.mode == Mode::DDP) {
    sync = parallel::make_all_reduce_sync(*comm_);
  } else if (options_.mode == Mode::Sharded) {
    parallel::ShardedGrads g;
    // Every world rank's range (Note [World ranks]): equal lengths, world rank w's at w * len;
    // stage 3 across processes: every local rank's (Note [Stage 3 across processes]).
    const std::int64_t len = set_->copy(0).end - set_->copy(0).begin;
    g.hybrid = set_->shard_world() < comm_->world_size();
    for (int w = 0; w < set_->shard_world(); ++w) g.shards.emplace_back(len * w, len * (w + 1));
    if (set_->shards_grads()) {
      // Note [Detached gradients]: a synced backward reduce-scatters each parameter's
      // gradient straight into its owners' range gradients; only no_sync passes
      // accumulate into a full buffer, which the next synced backward combines and frees.
      g.zero_sent = false;
      g.before_backward = [this](int r) {
        if (!require_sync_) set_->acquire_grad(r);
      };
      g.after_sync = [this](int r) { set_->release_grad(r); };
      g.deliver = [this](int r, const Tensor& piece, std::int64_t offset) {
        const nn::ParameterCopy& c = set_->copy(r);
        NoGradGuard no_grad;
        Tensor range = c.shard_grad.narrow(0, offset - c.begin, piece.numel());
        if (carry_sums_) {
          range.copy_(piece);  // the sum carried the earlier one (Note [Accumulating after a combined backward])
        } else {
          range.add_(piece);
        }
      };
      g.carry_in = [this](int r, Tensor& piece, std::int64_t offset, int owner) {
        if (!carry_sums_ || r != 0) return;  // Note [Accumulating after a combined backward]
        const nn::ParameterCopy& c = set_->copy(owner);
        NoGradGuard no_grad;
        piece.add_(c.shard_grad.narrow(0, offset - c.begin, piece.numel()).to(piece.device()));
      };
      g.owned = [this](int r) { return set_->copy(r).owned_grad(); };
    }
    sync = parallel::make_reduce_scatter_sync(*comm_, std::move(g));
  } else {
    buckets = {parallel::Bucket{0, set_->numel(), 0, static_cast<int>(slots.size())}};
    sync = parallel::make_reduce_to_root_sync(*comm_, 0);
  }
  reducer_ = std::make_unique<parallel::Reducer>(
      devices_, std::move(buckets), std::move(sync), [this](int r) { return set_->copy(r).grad; }, *recorder_);
  reducer_->set_failure_hook([this](int r, const std::exception_ptr& e) { abort_step(r, e); });
  if (options_.check_finite_grads)
    reducer_->set_check([this](int r, const Tensor& g, std::int64_t offset) { check_finite(r, g, offset); });
  if (!overlapping) return;
  std::vector<std::pair<std::int64_t, std::int64_t>> layout;
  for (auto& s : slots) layout.emplace_back(s->offset, s->copies[0].numel());
  reducer_->set_param_layout(std::move(layout));
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r)
    for (int i = 0; i < static_cast<int>(slots.size()); ++i)
      autograd::add_post_accumulate_hook(
          slots[i]->copies[r], [red = reducer_.get(), r, i](const Tensor& leaf) { red->grad_ready(r, i, leaf); });
}

DataParallel::~DataParallel() {
  // Hand the module back as a plain single-device module.
  try {
    set_->set_executor(nullptr);
    set_->set_unit_hook(nullptr);
    set_->set_process_gather(nullptr);
    for (auto& s : set_->slots()) autograd::clear_post_accumulate_hooks(s->copies[0]);
    set_->drop_copies();
    for (auto& b : buffers_) b->copies.resize(1);
    backend::get(devices_[0]).set_concurrent_devices(1);
  } catch (const std::exception& e) {
    detail::log_warning(detail::str_cat("DataParallel: cleanup failed: ", e.what()));
  }
}

// ---- accessors -------------------------------------------------------------------------------

parallel::Trace& DataParallel::trace() { return recorder_->trace(); }

parallel::Stats DataParallel::stats() const {
  parallel::Stats s = recorder_->snapshot();
  s.handoffs = workers_->handoffs() + reducer_->handoffs() - handoff_base_;
  for (auto& d : s.devices) d.peak_memory_bytes = backend::get(d.device).max_memory_allocated(d.device);
  return s;
}

void DataParallel::reset_stats() {
  recorder_->reset();
  handoff_base_ = workers_->handoffs() + reducer_->handoffs();
  comm_->reset_process_times();
  for (auto& d : devices_) backend::get(d).reset_peak_memory(d);
}

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::buckets() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (options_.mode != Mode::DP)
    for (auto& b : reducer_->buckets()) out.emplace_back(b.lo, b.hi);
  return out;
}

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::shards() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (options_.mode == Mode::Sharded)
    for (int r = 0; r < set_->num_copies(); ++r) out.emplace_back(set_->copy(r).begin, set_->copy(r).end);
  return out;
}

int DataParallel::shard_stage() const { return options_.mode == Mode::Sharded ? *options_.shard_stage : 0; }

nn::LoadResult DataParallel::load_state_dict(const nn::StateDict& state, bool strict) {
  // The replicas pick the new values up at the next forward (primary_version changed).
  return net_->load_state_dict(state, strict);
}

// ---- scatter, replicate, gather --------------------------------------------------------------

DataParallel::ShardPlan DataParallel::plan_shards(std::int64_t rows) const {
  const int n = static_cast<int>(devices_.size());
  ShardPlan plan{rows, {}, std::vector<std::int64_t>(n, 0)};
  if (!options_.chunk_sizes.empty()) {
    const auto& cs = options_.chunk_sizes;
    DP_CHECK(static_cast<int>(cs.size()) <= n, "DataParallel: ", cs.size(), " chunk_sizes for ", n,
             " devices; expected at most one per device");
    std::int64_t total = 0;
    for (auto c : cs) {
      DP_CHECK(c >= 0, "DataParallel: chunk_sizes must be >= 0, got ", c);
      total += c;
    }
    DP_CHECK(total == rows, "DataParallel: chunk_sizes sum to ", total, " but the batch has ", rows, " rows");
    plan.sizes = cs;
  } else {
    std::int64_t step = (rows + n - 1) / n;  // torch.chunk: ceil-sized chunks
    for (std::int64_t at = 0; at < rows; at += step) plan.sizes.push_back(std::min(step, rows - at));
  }
  plan.sizes.resize(n, 0);
  for (int r = 1; r < n; ++r) plan.offsets[r] = plan.offsets[r - 1] + plan.sizes[r - 1];
  return plan;
}

// Note [Scatter backward]
// When the input needs a gradient, each worker's shard is a
// leaf of that worker's graph; after the workers' backward, GatherBackward returns
// the leaves' gradients, concatenated on the input's device, along its edge.
Tensor DataParallel::scatter(int rank, const Tensor& src, const ShardPlan& plan, bool as_leaf) {
  PhaseTimer t(*recorder_, rank, Phase::Scatter);
  backend::CopyFences::Scope fenced(*fences_);  // the batch predates the step (Note [Copy fences])
  Tensor shard = src.narrow(0, plan.offsets[rank], plan.sizes[rank]).to(devices_[rank]);
  if (as_leaf) {
    if (shard.storage() == src.storage()) shard = shard.clone();  // the leaf owns its storage
    shard.set_requires_grad(true);
  }
  return shard;
}

// A split input's rows for `rank`, or a replicated input whole on its device.
Tensor DataParallel::scatter_input(int rank, const DataParallelInput& in, const ShardPlan& plan, bool as_leaf) {
  if (!in.replicated) return scatter(rank, in.tensor, plan, as_leaf);
  PhaseTimer t(*recorder_, rank, Phase::Scatter);
  backend::CopyFences::Scope fenced(*fences_);  // Note [Copy fences]
  Tensor copy = in.tensor.to(devices_[rank]);
  if (as_leaf) {
    if (copy.storage() == in.tensor.storage()) copy = copy.clone();  // the leaf owns its storage
    copy.set_requires_grad(true);
  }
  return copy;
}

// Note [Coalesced buffers]
// A ResNet-50 has ~160 BatchNorm buffers; broadcast one by one they would cost as
// many tiny collectives per step. So every device's float32 buffers live in one flat
// tensor, and replicate() broadcasts it once. Device 0's buffers move into theirs in
// place — the TensorImpl is pointed at the flat storage, as Module::to does — so every
// handle to them (the module's, the user's) follows; the other devices' copies are
// views into theirs. int64 counters (num_batches_tracked) stay apart: device 0's is
// the one read.
void DataParallel::coalesce_buffers() {
  const int n = static_cast<int>(devices_.size());
  NoGradGuard no_grad;
  std::int64_t total = 0;
  for (auto& b : buffers_)
    if (b->copies[0].dtype() == Dtype::Float32) total += b->copies[0].numel();
  buffer_flat_.clear();
  for (int r = 0; r < n; ++r) {
    Tensor flat = zeros({total}, devices_[r]);
    std::int64_t offset = 0;
    for (auto& b : buffers_) {
      b->copies.resize(static_cast<std::size_t>(n));
      const Tensor& src = b->copies[0];
      Tensor& dst = b->copies[static_cast<std::size_t>(r)];
      if (src.dtype() != Dtype::Float32) {
        if (r > 0) dst = src.to(devices_[r]).detach().clone();
        continue;
      }
      const std::int64_t numel = src.numel();
      Tensor slice = flat.narrow(0, offset, numel);
      slice.copy_(src.reshape({numel}));
      if (r > 0) {
        dst = slice.reshape(src.shape());
      } else {  // device 0's tensor itself moves into the flat buffer
        dst.impl()->storage = flat.storage();
        dst.impl()->offset = slice.storage_offset();
      }
      offset += numel;
    }
    buffer_flat_.push_back(flat);
  }
}

// Copies what replica `rank` needs from device 0 before its forward. Runs on every
// worker (collectives need every rank); the Step decided once what to copy, so every
// rank makes the same sequence of collectives.
void DataParallel::replicate(int rank, bool sync_params) {
  if (world_devices() == 1) return;
  PhaseTimer t(*recorder_, rank, Phase::Replicate);
  // DP's device 0s hold the same parameters in every process (Note [Across
  // processes]): its replicas are refreshed within the process.
  if (sync_params) (options_.mode == Mode::DP ? comm_->local() : *comm_).broadcast(rank, set_->copy(rank).data, 0);
  bool moved = sync_params;
  const Tensor& buffers = buffer_flat_[static_cast<std::size_t>(rank)];
  if ((options_.mode == Mode::DP || options_.broadcast_buffers) && buffers.numel() > 0) {
    comm_->broadcast(rank, buffers, 0);  // Note [Coalesced buffers]
    moved = true;
  }
  if (!moved) return t.cancel();
  t.set_args(sync_params ? "\"parameters\": true" : "\"parameters\": false");
}

// Copies the outputs onto the output device without recording: the replicas' graphs
// stay with their workers (Note [Gather backward]).
Tensor DataParallel::gather(const std::vector<Tensor>& outs, const ShardPlan& plan) {
  PhaseTimer t(*recorder_, options_.output_device, Phase::Gather);
  NoGradGuard no_grad;
  std::vector<Tensor> moved;
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r) {
    if (plan.sizes[r] == 0) continue;
    DP_CHECK(outs[r].defined() && outs[r].dim() >= 1 && outs[r].size(0) == plan.sizes[r],
             "DataParallel: the module's output on ", devices_[r], " must keep the batch in dim 0 (",
             plan.sizes[r], " rows), got ", outs[r].str());
    moved.push_back(outs[r].detach().to(output_device()));
  }
  return moved.size() == 1 ? moved[0].clone() : cat(moved);
}

// ---- the two forward paths -------------------------------------------------------------------

// The inputs that asked for gradients: each worker's piece of input k is a leaf of its
// graph (Note [Scatter backward]); GatherBackward returns their gradients.
struct DataParallel::InputGrads {
  std::vector<Tensor> inputs;               // the caller's tensors: the node's edges
  std::vector<bool> replicated;             // per entry of inputs
  std::vector<std::vector<Tensor>> leaves;  // [entry][rank]
};

// Checks a forward's inputs; returns the batch's rows (the split inputs' size(0)).
std::int64_t DataParallel::check_inputs(const char* what, const std::vector<DataParallelInput>& inputs) const {
  DP_CHECK(!inputs.empty(), "DataParallel::", what, ": expected at least one input, got none");
  std::int64_t rows = -1;
  std::size_t first = 0;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& t = inputs[k].tensor;
    DP_CHECK(t.defined(), "DataParallel::", what, ": input ", k, " is an undefined tensor");
    if (inputs[k].replicated) continue;
    DP_CHECK(t.dim() >= 1 && t.size(0) >= 1, "DataParallel::", what, ": input ", k,
             " must be batched (N, ...) with N >= 1, got ", t.str(),
             "; wrap an input that every device needs whole in dp::replicated(t)");
    if (rows < 0) {
      rows = t.size(0);
      first = k;
    }
    DP_CHECK(t.size(0) == rows, "DataParallel::", what, ": every split input must have the same size(0), "
             "input ", first, " has ", rows, " rows and input ", k, " has ", t.size(0), " (", t.str(),
             "); wrap an input that every device needs whole in dp::replicated(t)");
  }
  DP_CHECK(rows >= 1, "DataParallel::", what, ": every input is replicated (0-d or dp::replicated), so "
           "there is no batch to split; pass at least one batched input (N, ...)");
  return rows;
}

Tensor DataParallel::forward(const Tensor& x) {
  DP_CHECK(x.defined() && x.dim() >= 1 && x.size(0) >= 1,
           "DataParallel: expected a batched input (N, ...) with N >= 1, got ",
           x.defined() ? x.str() : "an undefined tensor");
  return forward(std::vector<DataParallelInput>{x});
}

Tensor DataParallel::forward(const std::vector<DataParallelInput>& in) {
  const std::int64_t rows = check_inputs("forward", in);
  Step step(*this, "forward", {.replicate = true});
  const int n = static_cast<int>(devices_.size());
  const ShardPlan plan = plan_shards(rows);
  const bool grad_mode = is_grad_enabled();
  auto input_grads = std::make_shared<InputGrads>();
  std::vector<DataParallelInput> inputs;
  std::vector<int> leaf_of(in.size(), -1);  // input k's entry in input_grads
  for (std::size_t k = 0; k < in.size(); ++k) {
    inputs.push_back(in[k]);
    inputs.back().tensor = in[k].tensor.detach();
    if (!grad_mode || !in[k].tensor.requires_grad()) continue;
    leaf_of[k] = static_cast<int>(input_grads->inputs.size());
    input_grads->inputs.push_back(in[k].tensor);
    input_grads->replicated.push_back(in[k].replicated);
    input_grads->leaves.emplace_back(n);
  }
  // Note [Across processes]: this process's share of the job's batch scales the
  // gradient its backward brings.
  // No gradient, no scale: a forward under no_grad makes no collective for it.
  const double grad_scale = processes_ > 1 && grad_mode
                                ? static_cast<double>(rows) / static_cast<double>(global_rows(rows))
                                : 1.0;
  std::vector<Tensor> outs(n);
  step.run([&](int r) {
    GradModeGuard grad_guard(grad_mode);
    replicate(r, step.sync_params());
    if (plan.sizes[r] == 0) return;
    std::vector<Tensor> xs;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      xs.push_back(scatter_input(r, inputs[k], plan, leaf_of[k] >= 0));
      if (leaf_of[k] >= 0) input_grads->leaves[leaf_of[k]][r] = xs.back();
    }
    PhaseTimer t(*recorder_, r, Phase::Forward);
    outs[r] = xs.size() == 1 ? net_->forward(xs[0]) : net_->forward(xs);
  });
  Tensor out = gather(outs, plan);
  bool needs_grad = std::any_of(outs.begin(), outs.end(), [](const Tensor& o) { return o.defined() && o.requires_grad(); });
  if (grad_mode && needs_grad) connect_gather_backward(out, outs, plan, std::move(input_grads), grad_scale);
  return out;
}

Tensor DataParallel::forward_backward(const Tensor& x, const Tensor& target, const LossFn& loss_fn) {
  DP_CHECK(x.defined() && x.dim() >= 1 && x.size(0) >= 1,
           "DataParallel::forward_backward: expected a batched input (N, ...), got ",
           x.defined() ? x.str() : "an undefined tensor");
  return forward_backward(std::vector<DataParallelInput>{x}, target, loss_fn);
}

Tensor DataParallel::forward_backward(const std::vector<DataParallelInput>& inputs, const Tensor& target,
                                      const LossFn& loss_fn) {
  DP_CHECK(loss_fn != nullptr, "DataParallel::forward_backward: expected a loss function");
  const std::int64_t rows = check_inputs("forward_backward", inputs);
  // Note [Loss scaling]
  // Each shard's mean loss is weighted by its share of the batch,
  // so the SUM over devices is the full-batch mean — exact for uneven shards, and the
  // same arithmetic in DP and DDP.
  // Across processes the batch is the job's (Note [Across processes]).
  const std::int64_t total = global_rows(rows);
  ShardLoss shard_loss = [&loss_fn, total](int, const Tensor& out, const Tensor& y) {
    return mul(loss_fn(out, y), static_cast<double>(y.size(0)) / static_cast<double>(total));
  };
  Tensor loss = run_forward_backward("forward_backward", inputs, target, shard_loss);
  // The loss of the batch this process passed (its share of the job's, rescaled).
  return total == rows ? loss : mul(loss, static_cast<double>(total) / static_cast<double>(rows));
}

// Note [Exact shard losses]: the whole batch's denominator comes from the full target
// here, before the scatter; each shard adds its rows' sum over it.
Tensor DataParallel::forward_backward_exact(const std::vector<DataParallelInput>& inputs, const Tensor& target,
                                            const nn::ShardableLoss& loss) {
  const std::int64_t rows = check_inputs("forward_backward", inputs);
  DP_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == rows,
           "DataParallel::forward_backward: expected a target with ", rows, " rows, got ",
           target.defined() ? target.str() : "an undefined tensor");
  // inf when every target is ignored: NaN loss. Across processes, the job's batch.
  // Sum's D is 1 whatever the batch; a Mean's adds up over the processes' batches.
  const double mine = loss.denominator(target);
  const bool add_up = processes_ > 1 && loss.reduction() != nn::Reduction::Sum;
  const double denominator = add_up ? dist::all_reduce(mine, dist::Op::Sum) : mine;
  const double scale = 1.0 / denominator;
  ShardLoss shard_loss = [&loss, scale](int, const Tensor& out, const Tensor& y) {
    return loss.shard_loss(out, y, scale);
  };
  Tensor total = run_forward_backward("forward_backward", inputs, target, shard_loss);
  // The loss of the batch this process passed (its share of the job's, rescaled).
  return !add_up || mine == 0 ? total : mul(total, denominator / mine);
}

Tensor DataParallel::run_forward_backward(const char* what, const std::vector<DataParallelInput>& inputs,
                                          const Tensor& target, const ShardLoss& shard_loss) {
  const std::int64_t rows = check_inputs(what, inputs);
  DP_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == rows, "DataParallel::", what,
           ": expected a target with ", rows, " rows, got ", target.defined() ? target.str() : "an undefined tensor");
  Step step(*this, what, {.replicate = true, .backward = true});
  const int n = static_cast<int>(devices_.size());
  const ShardPlan plan = plan_shards(rows);
  std::vector<DataParallelInput> detached(inputs);
  for (auto& in : detached) in.tensor = in.tensor.detach();
  const Tensor tgt = target.detach();
  std::vector<Tensor> losses(n);
  step.run([&](int r) {
    GradModeGuard grad_guard(true);
    replicate(r, step.sync_params());
    if (plan.sizes[r] > 0) losses[r] = worker_loss_backward(r, detached, tgt, plan, shard_loss);
    reducer_->finalize(r);
  });
  // The batch loss: the weighted shard losses summed in device order.
  NoGradGuard no_grad;
  Tensor total;
  for (const Tensor& l : losses) {
    if (!l.defined()) continue;
    Tensor v = l.reshape({}).to(output_device());
    total = total.defined() ? add(total, v) : v;
  }
  return total;
}

// One worker's shard of forward_backward; returns its weighted loss.
Tensor DataParallel::worker_loss_backward(int rank, const std::vector<DataParallelInput>& inputs,
                                          const Tensor& target, const ShardPlan& plan, const ShardLoss& shard_loss) {
  std::vector<Tensor> xs;
  for (const auto& in : inputs) xs.push_back(scatter_input(rank, in, plan, false));
  Tensor yr = scatter(rank, target, plan);
  Tensor loss;
  {
    PhaseTimer t(*recorder_, rank, Phase::Forward);
    Tensor out = xs.size() == 1 ? net_->forward(xs[0]) : net_->forward(xs);
    loss = shard_loss(rank, out, yr);
    DP_CHECK(loss.numel() == 1, "DataParallel::forward_backward: the loss function must return a scalar, got ",
             loss.str());
  }
  PhaseTimer t(*recorder_, rank, Phase::Backward);
  loss.backward();
  return loss.detach();
}

// ---- backward through a gathered output ------------------------------------------------------

void DataParallel::connect_gather_backward(Tensor& out, const std::vector<Tensor>& outs, const ShardPlan& plan,
                                           std::shared_ptr<InputGrads> input_grads, double grad_scale) {
  std::vector<Tensor> live;
  std::vector<std::int64_t> live_sizes;
  for (std::size_t r = 0; r < outs.size(); ++r)
    if (plan.sizes[r] > 0) {
      live.push_back(outs[r]);
      live_sizes.push_back(plan.sizes[r]);
    }
  std::vector<Tensor> node_inputs = input_grads->inputs;
  auto node = std::make_shared<GatherBackward>(
      std::move(live), live_sizes,
      [this, alive = std::weak_ptr<int>(alive_), sizes = plan.sizes, input_grads = std::move(input_grads),
       grad_scale](const std::vector<Tensor>& live_roots, const std::vector<Tensor>& pieces) {
        DP_CHECK(!alive.expired(), "backward through an output of a DataParallel that was destroyed; "
                 "keep the DataParallel alive until backward() has run");
        std::vector<Tensor> roots(sizes.size()), grads(sizes.size());
        for (std::size_t r = 0, k = 0; r < sizes.size(); ++r)
          if (sizes[r] > 0) {
            roots[r] = live_roots[k];
            grads[r] = pieces[k++];
          }
        return backward_from_gather(roots, grads, *input_grads, grad_scale);
      });
  if (params_sharded()) live_forwards_.emplace_back(forwards_, node->graph_alive());
  autograd::connect(node, node_inputs, {&out});
}

// Runs each rank's part of backward on its own worker, then returns the gradients of
// the inputs that asked for one (Note [Scatter backward]): a split input's is its
// pieces concatenated, a replicated input's the sum of every device's, in device order.
std::vector<Tensor> DataParallel::backward_from_gather(const std::vector<Tensor>& roots,
                                                       const std::vector<Tensor>& grads,
                                                       const InputGrads& input_grads, double grad_scale) {
  {
    Step step(*this, "backward", {.backward = true});
    step.run([&](int r) {
      if (roots[r].defined()) {
        PhaseTimer t(*recorder_, r, Phase::Backward);
        GradModeGuard grad_guard(true);
        Tensor g;
        {
          backend::CopyFences::Scope fenced(*fences_);  // made before the step (Note [Copy fences])
          g = grads[r].to(devices_[r]);
        }
        if (grad_scale != 1.0) g = mul(g, grad_scale);
        autograd::run_backward({roots[r]}, {g}, false);
      }
      reducer_->finalize(r);
    });
  }
  std::vector<Tensor> out;
  for (std::size_t k = 0; k < input_grads.inputs.size(); ++k) {
    const Device dev = input_grads.inputs[k].device();
    std::vector<Tensor> pieces;
    for (const Tensor& leaf : input_grads.leaves[k]) {
      if (!leaf.defined()) continue;
      Tensor g = leaf.grad();
      pieces.push_back(g.defined() ? g.to(dev) : zeros(leaf.shape(), dev));
    }
    Tensor g;
    if (input_grads.replicated[k]) {
      for (const Tensor& p : pieces) g = g.defined() ? add(g, p) : p;
    } else {
      g = pieces.size() == 1 ? pieces[0] : cat(pieces);
    }
    out.push_back(g);
  }
  return out;
}

// ---- failures and checks ---------------------------------------------------------------------

// The first failure on any worker or comm thread releases everyone else (Note [Step scope]).
void DataParallel::abort_step(int rank, const std::exception_ptr& error) {
  comm_->abort(detail::str_cat(devices_[rank], " failed: ", parallel::describe(error)));
  reducer_->abort();
}

// Note [Finite gradient check]
// Each device's own gradient is checked before it is combined (DP: before the reduce;
// DDP and Sharded: each bucket before its collective), so the error names the device
// the NaN or Inf came from; the combined result is checked again (a sum of finite
// values can overflow): all of it, or in Sharded mode the device's own range, which
// may cut parameters (so a parameter is checked where it overlaps the range).
void DataParallel::check_finite(int rank, const Tensor& grad, std::int64_t offset) {
  auto& be = backend::get(devices_[rank]);
  const float* g = grad.data<float>();
  const std::int64_t lo = offset, hi = offset + grad.numel();
  if (be.count_nonfinite(devices_[rank], g, hi - lo) == 0) return;
  const auto& slots = set_->slots();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const std::int64_t a = std::max(lo, slots[i]->offset);
    const std::int64_t b = std::min(hi, slots[i]->offset + slots[i]->copies[0].numel());
    if (a >= b) continue;
    if (be.count_nonfinite(devices_[rank], g + (a - lo), b - a) > 0)
      DP_FAIL("non-finite gradient (NaN or Inf) in parameter '", param_names_[i], "' on ", devices_[rank],
              " — lower the learning rate, check the loss for log(0) or the data for NaN");
  }
}

// ---- replica bookkeeping ---------------------------------------------------------------------

std::uint64_t DataParallel::primary_version() const {
  // The set's version counts optimizer steps and loads; the storage's counts in-place
  // writes through parameter tensors. Both only grow, so their sum changes whenever
  // either does.
  return set_->version() + set_->copy(0).data.storage()->version();
}

// Note [When replicas are refreshed]
// DP: the replicas are transient, so they need device 0's parameters whenever those
// changed since the last forward (an optimizer step, a load, an in-place write).
// DDP and Sharded: every replica is stepped by the optimizer along with device 0 (a
// Sharded step ends with an all-gather), so they stay equal without any copy; they
// need device 0's parameters only when the copies were written unequally — a load or
// an in-place write into device 0's parameters, or a failed step that updated some
// copies and not others (or, Sharded, did not gather them: such a step leaves the
// replicas marked unsynced). Every write through a tensor or an optimizer step bumps
// the written buffer's storage version, so "written unequally" is "storage versions
// moved by different amounts since the last sync". Decided once on the calling
// thread, so every rank makes the same collectives.
bool DataParallel::begin_replicate() {
  if (params_sharded()) {  // no replicas: each range has one owner (Note [Sharded parameters])
    synced_version_ = kUnsynced;
    return false;
  }
  bool sync;
  if (options_.mode == Mode::DP) {
    sync = primary_version() != synced_version_;
  } else {
    sync = synced_version_ == kUnsynced;
    std::uint64_t moved0 = set_->copy(0).data.storage()->version() - storage_base_[0];
    for (int r = 1; r < set_->num_copies(); ++r)
      sync = sync || set_->copy(r).data.storage()->version() - storage_base_[r] != moved0;
  }
  synced_version_ = kUnsynced;  // stays so if the step fails half way
  return sync;
}

void DataParallel::end_replicate() {
  synced_version_ = primary_version();
  for (int r = 0; r < set_->num_copies(); ++r) storage_base_[r] = set_->copy(r).data.storage()->version();
}

DataParallel::NoSyncGuard::NoSyncGuard(DataParallel& dp) : dp_(dp), prev_(dp.require_sync_) {
  DP_CHECK(!dp.params_sharded(), "DataParallel: no_sync() with shard_stage 3: the sharded parameters keep no "
           "full gradient to accumulate into; accumulate by calling backward several times between "
           "zero_grad() and step() instead (each backward adds its reduce-scattered gradient to the "
           "owners' ranges), or use shard_stage 2");
  dp_.require_sync_ = false;
}
DataParallel::NoSyncGuard::~NoSyncGuard() { dp_.require_sync_ = prev_; }

}  // namespace dp
