#include "dp/parallel/data_parallel.h"

#include <algorithm>
#include <set>
#include <span>
#include <utility>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"
#include "dp/nn/dropout.h"
#include "dp/optim/grad_scaler.h"
#include "dp/tensor/autocast.h"
#include "dp/tensor/ops.h"
#include "parallel/copy_executor.h"
#include "parallel/design.h"
#include "parallel/gather_backward.h"
#include "parallel/phase_timer.h"
#include "parallel/reducer.h"
#include "parallel/scatter_gather.h"
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

}  // namespace

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
// What differs between the designs at each point is the design's (Note [Designs]).
class DataParallel::Step {
 public:
  Step(DataParallel& dp, const char* what, parallel::StepKind kind) : dp_(dp), kind_(kind) {
    DP_CHECK(!dp_.busy_, "DataParallel: ", what, " called while another step runs (from inside a worker?)");
    if (kind_.replicate || kind_.gather || kind_.refresh) sync_params_ = design().begin_replicate();
    if (kind_.replicate) dp_.set_->follow_primary_requires_grad();  // Note [Frozen parameters]
    if (kind_.backward && design().refuses_grad_edits()) {
      // Sharded refuses a backward after an edit it cannot take (Note [Refusals across
      // processes]).
      dp_.agree_across_processes("a backward", [&] { design().begin_step(kind_, sync_params_); });
    } else {
      design().begin_step(kind_, sync_params_);
    }
    // DP and DDP refuse one that would forget edits that differ between the processes.
    if (kind_.backward && design().carries_combined_grads()) dp_.check_grad_edits_agree("a backward");
    if (kind_.backward) {
      design().forget_combined_grads();
      dp_.reducer_->prepare(design().syncs_backward());
    }
    dp_.busy_ = true;
  }
  ~Step() {
    if (kind_.backward) dp_.reducer_->end();
    design().end_step();
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
      // Note [Autocast op policy] (dp/tensor/autocast.h): every worker computes under the
      // caller's autocast state, as the caller's own thread would.
      const amp::AutocastState autocast = amp::autocast_state();
      dp_.workers_->run(
          [&](int r) {
            nn::ReplicaBinding bind(r);
            nn::ComputeDtypeGuard compute(design().param_dtype());  // Note [Parameters in low precision]
            amp::AutocastStateGuard carried(autocast);
            design().run_rank(r, kind_, [&] { fn(r); });
          },
          [this](int r, const std::exception_ptr& e) { dp_.abort_step(r, e); }, ranks);
    } catch (...) {
      if (kind_.backward) dp_.reducer_->end();  // join the comm threads first
      dp_.comm_->reset();
      throw;
    }
    if (kind_.replicate || kind_.gather || kind_.refresh) design().end_replicate();
    if (kind_.replicate) dp_.recorder_->count_iteration();
    if (kind_.backward) {
      design().snapshot_grad_versions();
      design().after_backward();  // Note [Accumulating after a combined backward]
      dp_.merge_arrived_grads(design().syncs_backward());
    }
  }

 private:
  parallel::Design& design() const { return *dp_.design_; }

  DataParallel& dp_;
  parallel::StepKind kind_;
  bool sync_params_ = false;
};

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
  check_mixed_precision(options_.mixed_precision);
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
    DP_CHECK(!options_.shard_unit, "DataParallel: shard_unit was given with mode ", mode_name(options_.mode),
             "; it picks the gather units of Mode::Sharded only: pass .mode = dp::Mode::Sharded or drop shard_unit");
  }
}

// Note [Gradients on the wire] in src/parallel/grad_wire.h, Note [Parameters in low
// precision] in src/parallel/design.cpp.
void DataParallel::check_mixed_precision(const MixedPrecision& mp) {
  auto check_floating = [](const std::optional<Dtype>& d, const char* field) {
    DP_CHECK(!d.has_value() || is_floating_point(*d), "DataParallel: mixed_precision.", field,
             " expects a floating dtype (float32, bfloat16 or float16), got ", dtype_name(*d));
  };
  check_floating(mp.param_dtype, "param_dtype");
  check_floating(mp.reduce_dtype, "reduce_dtype");
  check_floating(mp.buffer_dtype, "buffer_dtype");
}

void DataParallel::init(std::vector<Device> devices) {
  DP_CHECK(net_ != nullptr, "DataParallel: expected a module, got null");
  check_device_list(devices);
  const int n = static_cast<int>(devices.size());
  check_options(n);
  devices_ = std::move(devices);

  // Before anything moves: a parameter already in a wrapper's set (this module, a child
  // wrapped first, or a parameter shared with one) would be flattened again here,
  // leaving the other wrapper's replicas on views this one rebinds.
  for (const auto& slot : net_->parameter_slots()) {
    const auto other = slot->set.lock();
    DP_CHECK(!other || !other->valid() || other->num_copies() == 1, "DataParallel: parameter '", slot->name,
             "' is already trained by another DataParallel (this module, a child of it, or a parameter it "
             "shares was wrapped first); wrap a module once, at the outermost module");
  }
  net_->to(devices_[0]);
  set_ = net_->parameter_set();
  DP_CHECK(set_ != nullptr, "DataParallel: the module has no parameters to train");
  buffers_ = net_->buffer_slots();
  for (auto& [name, t] : net_->named_parameters()) param_names_.push_back(name);

  // Note [Concurrent devices of live wrappers]: held from here, given back by the
  // destructor, or below if construction fails.
  backend::get(devices_[0]).hold_concurrent_devices(n);
  try {
    recorder_ = std::make_unique<parallel::PhaseRecorder>(devices_);
    const comm::CommOptions comm_options{.timeout = options_.collective_timeout};
    comm_ = options_.span_processes ? comm::make_world_communicator(devices_, comm_options)
                                    : comm::make_communicator(devices_, comm_options);
    processes_ = comm_->world_size() / n;
    process_ = comm_->first_rank() / n;
    workers_ = std::make_unique<parallel::WorkerPool>(devices_, "worker", /*caller_runs_rank0=*/true);
    fences_ = std::make_unique<backend::CopyFences>(devices_);
    sync_processes();
    design_ = parallel::make_design(*this);
    for (int r = 1; r < n; ++r) set_->add_copy(devices_[r], /*transient=*/!design_->persistent_replicas());
    design_->lay_out();
    design_->make_compute_copies();
    design_->coalesce_buffers(buffers_);
    design_->make_compute_buffers(buffers_);
    design_->end_replicate();
    design_->snapshot_grad_versions();
    make_reducer();
    grad_bytes_base_.assign(devices_.size(), 0);
    gather_bytes_base_.assign(devices_.size(), 0);
    executor_ = std::make_unique<Executor>(*this);
    set_->set_executor(executor_.get());
  } catch (...) {
    backend::get(devices_[0]).release_concurrent_devices(n);
    throw;
  }
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
//    (Note [Ranges across processes] in src/parallel/shard_store.h).
//  - Sharded stage 3: hybrid, sharded within each process and replicated across
//    processes (Note [Stage 3 across processes]).
// Every reduction sums a process's devices first, in device order, then the
// processes in process order, so the three designs are bitwise identical to one
// another for a given topology and every run of it is bitwise reproducible; against
// one process with all the devices they agree to float rounding (the sums group
// differently). A failure in one process ends the job (Note [Fault policy]).

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
  sync_dropout_streams(*across);
}

// Note [Dropout across processes]
// In one process, device r of a Dropout layer draws stream r of the layer's seed (Note
// [Dropout generators]). Across processes each process builds its own layer, so the
// seeds differ when the processes were seeded apart, and the masks repeat when they
// were seeded alike (every process's device 0 drawing stream 0 of one seed: the
// processes drop the same units). Construction therefore takes process 0's seed for
// every Dropout layer and gives device r of process p stream p * n + r, the stream
// world rank p * n + r has: the job's devices draw distinct masks, and a job of P
// processes of one device draws exactly the masks of one process with P devices.
// Each stream keeps the position process 0's layer holds for it (its copies 0..63
// hold streams first .. first + 63): a fresh layer's are all at counter 0, and a layer
// that process 0 loaded from a training checkpoint before this construction — the
// checkpoint holds the job's streams in the job's numbering, Note [Dropout streams in
// a checkpoint] in src/io/checkpoint.cpp — hands every process its own streams'
// positions, so the resumed run draws the uninterrupted run's masks. A stream process
// 0's layer does not hold starts at counter 0. The layer records the spread
// (Dropout::set_process_spread), which makes a training checkpoint gather it.
void DataParallel::sync_dropout_streams(comm::Communicator& across) {
  std::vector<std::shared_ptr<nn::Dropout>> layers;
  for (const auto& m : net_->modules()) {
    if (auto d = std::dynamic_pointer_cast<nn::Dropout>(m)) layers.push_back(std::move(d));
  }
  if (layers.empty()) return;
  // Per layer: seed, first stream, then (key, counter) of copies 0..kMaxCopies-1.
  constexpr int kCopies = nn::Dropout::kMaxCopies;
  constexpr std::size_t kPerLayer = 2 + 2 * kCopies;
  std::vector<std::int64_t> mine;
  mine.reserve(layers.size() * kPerLayer);
  for (const auto& d : layers) {
    mine.push_back(static_cast<std::int64_t>(d->seed()));
    mine.push_back(d->first_stream());
    for (int r = 0; r < kCopies; ++r) {
      mine.push_back(static_cast<std::int64_t>(d->generator(r).seed()));
      mine.push_back(static_cast<std::int64_t>(d->generator(r).offset()));
    }
  }
  Tensor states = from_vector(mine, {static_cast<std::int64_t>(mine.size())}, devices_[0]);
  across.broadcast(process_, states, 0);
  const std::vector<std::int64_t> got = states.to_vector_i64();
  const int n = static_cast<int>(devices_.size());
  const std::int64_t first = static_cast<std::int64_t>(process_) * n;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::int64_t* at = got.data() + i * kPerLayer;
    nn::Dropout& d = *layers[i];
    d.set_streams(static_cast<std::uint64_t>(at[0]), first);
    const std::int64_t held = at[1];  // process 0's copy 0 holds stream `held`
    for (int r = 0; r < kCopies; ++r) {
      const std::int64_t k = first + r - held;
      if (k < 0 || k >= kCopies) continue;
      d.generator(r).set_state(static_cast<std::uint64_t>(at[2 + 2 * k]), static_cast<std::uint64_t>(at[3 + 2 * k]));
    }
    d.set_process_spread(processes_, n);
  }
}

// Note [Parameters without a gradient] in dp/optim/optimizer.h: after a synced backward
// across processes, every device's marks into the slots and their union over the
// processes, so that every process steps the same parameters. In one process the
// optimizer's step collects the marks itself (the copies' leaves live as long as the
// set); a no_sync backward's marks stay on the leaves and join the next synced union.
void DataParallel::merge_arrived_grads(bool synced) {
  if (processes_ <= 1 || !synced) return;
  set_->collect_arrived_grads();
  const auto& slots = set_->slots();
  std::vector<std::int64_t> got(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) got[i] = slots[i]->got_grad ? 1 : 0;
  dist::all_reduce(std::span<std::int64_t>(got), dist::Op::Max);
  for (std::size_t i = 0; i < slots.size(); ++i) slots[i]->got_grad = got[i] != 0;
}

// The rows of the job's batch: this process's `rows` plus every other process's.
std::int64_t DataParallel::global_rows(std::int64_t rows) const {
  return processes_ > 1 ? dist::all_reduce(rows, dist::Op::Sum) : rows;
}

// Note [Refusals across processes]
// Every process of a job runs the same loop, so each reaches the same collectives in
// the same order. A refusal that one process makes alone, from its own state, breaks
// that: it leaves, and the others wait in the step's first collective until
// collective_timeout ends the job (an edit by hand in one process, refused by Sharded
// there only; or DDP broadcasting an edited gradient where one process saw an edit and
// another did not). So:
// - a check that may refuse on local state (Design::check_step, a Sharded backward's
//   begin_step) runs before any collective of the step, through
//   agree_across_processes: the processes exchange whether they refused (one host
//   all-reduce of an integer: at each Sharded step and backward), and if one did, every
//   one throws — its own error, or one naming the process that refused;
// - DDP sends an edited gradient to its replicas within the process only (Note
//   [Gradient edits]), a decision each process takes alone;
// - DP and DDP step every process's device 0 with the gradient it holds, equal in every
//   process after a backward. An edit since — by hand, or a forward through the module
//   itself whose backward added to device 0 — may differ between the processes: DP's
//   processes would step apart, silently, and a second backward without zero_grad()
//   would keep process 0's edit alone (Note [Accumulating after a combined backward]).
//   So an edit is noted before every update of every copy hides it in its snapshot
//   (Design::note_device0_edits), and at the step, and before such a backward, the
//   processes agree on whether any edited (one host all-reduce of an integer); if one
//   did, device 0's gradients are compared with process 0's (a broadcast, only then)
//   and differing ones are refused in every process, naming the cause. Equal edits (the same scaling everywhere) pass.
//   A whole zero_grad() clears the noted edit.
void DataParallel::agree_across_processes(const char* what, const std::function<void()>& check) {
  if (processes_ <= 1) {
    check();
    return;
  }
  std::exception_ptr refused;
  try {
    check();
  } catch (const Error&) {
    refused = std::current_exception();
  }
  const std::int64_t mine = refused ? process_ : processes_;
  const std::int64_t first = dist::all_reduce(mine, dist::Op::Min);
  if (refused) std::rethrow_exception(refused);
  DP_CHECK(first == processes_, "DataParallel: ", what, " refused by process ", first,
           " of the job (its error says why); every process refuses it, so that none waits in a collective the "
           "others left (Note [Refusals across processes])");
}

void DataParallel::check_grad_edits_agree(const char* what) {
  if (processes_ <= 1 || design_->refuses_grad_edits()) return;
  design_->note_device0_edits();
  const std::int64_t edited_here = design_->device0_edited() ? 1 : 0;
  const bool edited = dist::all_reduce(edited_here, dist::Op::Max) != 0;
  if (!edited) return;
  comm::Communicator* across = comm_->peers(0);
  DP_ASSERT(across != nullptr, "DataParallel: no communicator between the processes' device 0s");
  bool same;
  {
    NoGradGuard no_grad;
    const Tensor& mine = set_->copy(0).grad;
    Tensor first = mine.clone();
    across->broadcast(process_, first, 0);
    same = equal(first, mine);
  }
  const std::int64_t differ = dist::all_reduce(static_cast<std::int64_t>(same ? 0 : 1), dist::Op::Max);
  DP_CHECK(differ == 0, "DataParallel (", mode_name(options_.mode), "): ", what, " after device 0's gradients were "
           "edited since the backward — by hand through parameters(), or by a backward through the module itself "
           "(net->forward(x) rather than model(x)) — and differ between the processes now: each process would "
           "step other gradients", options_.mode == Mode::DP ? " and the processes' parameters would part" : "",
           ". Make the same edit in every process, edit before the backward (edits made then are summed over the "
           "processes), or run every forward through the DataParallel; zero_grad() discards the edit (Note "
           "[Refusals across processes])");
  design_->forget_device0_edits();  // equal everywhere: nothing left to check
}

// Note [Small work inline]
// Zeroing the gradients of a small model (the ToyModel's 165 parameters: 660 bytes a
// copy) takes far less than a hand-over to every worker and back. Such work comes as
// CopyWork::SmallGradients, and the calling thread does every copy's itself, as the
// workers would (no worker runs between steps; on CUDA each call enqueues on the
// copy's device's stream, the one its worker uses), under the same busy check. The
// gradient versions are snapshotted as after any update of every copy.
void DataParallel::run_on_copies(int copies, bool update, bool small, const std::function<void(int)>& fn) {
  if (processes_ > 1) design_->note_device0_edits();  // before this update's snapshot hides it
  if (update) {  // one host all-reduce of an integer across processes: Sharded's refusal or DP's and DDP's edits
    if (design_->refuses_grad_edits()) {
      agree_across_processes("opt.step()", [&] { design_->check_step(); });
    } else {
      design_->check_step();
      check_grad_edits_agree("opt.step()");
    }
  }
  const parallel::UpdatePlan plan = design_->plan_update(update);
  if (small && !plan.broadcast_grads && !plan.refresh_params) {
    DP_CHECK(!busy_, "DataParallel: an update of every copy called while another step runs (from inside a worker?)");
    for (int r = 0; r < copies; ++r) fn(r);
    design_->snapshot_grad_versions();
    return;
  }
  DP_CHECK(!(update && design_->persistent_replicas() && world_devices() > 1 && !require_sync_),
           "DataParallel: opt.step() inside no_sync(): each replica holds only its own accumulated "
           "gradient until the first backward after the guard combines them; step after that backward");
  int ranks = 0;
  for (int r = 0; r < copies; ++r)
    if (!set_->copy(r).transient) ranks = r + 1;
  {
    Step step(*this, update ? "the optimizer step" : "an update of every copy",
              {.gather = plan.gather, .refresh = plan.refresh_params});
    step.run([&](int r) { design_->run_update(r, plan, step.sync_params(), [&] { fn(r); }); }, ranks);
    design_->finish_update(plan);
  }
  design_->snapshot_grad_versions();
  if (update && options_.check_replicas_every > 0 && ++updates_ % options_.check_replicas_every == 0)
    check_replicas();
}

void DataParallel::check_replicas() const {
  // After a load or an in-place write through parameters() the replicas differ until
  // the next forward or step refreshes them (Note [When replicas are refreshed]): no
  // replica is read before, so there is nothing to compare.
  if (!design_->replicas_comparable() || design_->primary_ahead()) return;
  const auto& slots = set_->slots();
  const Tensor& primary = set_->copy(0).data;
  for (int r = 1; r < set_->num_copies(); ++r) {
    NoGradGuard no_grad;
    Tensor replica = set_->copy(r).data.to(devices_[0]);
    if (equal(replica, primary)) continue;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const auto [lo, hi] = design_->current_part(r, slots[i]->unit, slots[i]->offset,
                                                  slots[i]->offset + slots[i]->copies[0].numel());
      const std::int64_t n = hi - lo;
      if (!equal(replica.narrow(0, lo, n), primary.narrow(0, lo, n)))
        DP_FAIL("DataParallel: replica on ", devices_[r], " differs from ", devices_[0], " in parameter '",
                param_names_[i], "' — a replica's memory was written outside dp (a raw pointer, another "
                "module sharing the storage); load_state_dict() or an in-place write through parameters() "
                "re-synchronises every replica at the next forward");
    }
  }
}

// The design's buckets and strategy (DP reduces the whole gradient buffer onto device
// 0 after backward; DDP all-reduces buckets while backward runs, Note [Gradient
// buckets]; Sharded reduce-scatters them, Note [Sharded gradients]); an overlapping
// strategy gets every parameter's post-accumulate hook.
void DataParallel::make_reducer() {
  const auto& slots = set_->slots();
  std::unique_ptr<parallel::GradSync> sync = design_->make_grad_sync();
  const bool overlapping = sync->overlaps_backward();
  reducer_ = std::make_unique<parallel::Reducer>(
      devices_, design_->plan_buckets(), std::move(sync), [this](int r) { return set_->copy(r).grad; }, *recorder_);
  reducer_->set_failure_hook([this](int r, const std::exception_ptr& e) { abort_step(r, e); });
  if (options_.check_finite_grads)
    reducer_->set_check([this](int r, const Tensor& g, std::int64_t offset) { check_finite(r, g, offset); });
  if (!overlapping) return;
  std::vector<std::pair<std::int64_t, std::int64_t>> layout;
  for (auto& s : slots) layout.emplace_back(s->offset, s->copies[0].numel());
  reducer_->set_param_layout(std::move(layout));
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r)
    for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
      const std::uint64_t id = autograd::add_post_accumulate_hook(
          slots[i]->copies[r], [red = reducer_.get(), r, i](const Tensor& leaf) { red->grad_ready(r, i, leaf); });
      if (r == 0) grad_hooks_.push_back(id);  // the replicas' go with them
    }
}

DataParallel::~DataParallel() {
  // Hand the module back as a plain single-device module.
  try {
    set_->set_executor(nullptr);
    executor_.reset();
    design_->release();
    // Only the reducer's hooks (slot i's is grad_hooks_[i]): a user's own stay.
    const auto& slots = set_->slots();
    for (std::size_t i = 0; i < grad_hooks_.size() && i < slots.size(); ++i)
      autograd::remove_post_accumulate_hook(slots[i]->copies[0], grad_hooks_[i]);
    set_->drop_copies();
    for (auto& b : buffers_) {
      b->copies.resize(1);
      b->compute.clear();  // Note [Buffers in low precision]
      b->compute_reads.clear();
    }
    backend::get(devices_[0]).release_concurrent_devices(static_cast<int>(devices_.size()));
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
  for (std::size_t r = 0; r < s.devices.size(); ++r) {
    s.devices[r].grad_bytes = reducer_->grad_bytes(static_cast<int>(r)) - grad_bytes_base_[r];
    s.devices[r].gather_bytes = design_->gather_bytes(static_cast<int>(r)) - gather_bytes_base_[r];
  }
  return s;
}

void DataParallel::reset_stats() {
  recorder_->reset();
  handoff_base_ = workers_->handoffs() + reducer_->handoffs();
  for (std::size_t r = 0; r < devices_.size(); ++r) {
    grad_bytes_base_[r] = reducer_->grad_bytes(static_cast<int>(r));
    gather_bytes_base_[r] = design_->gather_bytes(static_cast<int>(r));
  }
  comm_->reset_process_times();
  for (auto& d : devices_) backend::get(d).reset_peak_memory(d);
}

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::buckets() const {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (reducer_->strategy().overlaps_backward())  // one bucket over everything is no bucket
    for (auto& b : reducer_->buckets()) out.emplace_back(b.lo, b.hi);
  return out;
}

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::shards() const { return design_->shards(); }

std::vector<std::pair<std::int64_t, std::int64_t>> DataParallel::units() const { return design_->units(); }

int DataParallel::shard_stage() const { return design_->shard_stage(); }

int DataParallel::shard_world() const { return design_->shard_world(); }

nn::LoadResult DataParallel::load_state_dict(const nn::StateDict& state, bool strict) {
  // The replicas pick the new values up at the next forward (primary_version changed).
  return net_->load_state_dict(state, strict);
}

// ---- the two forward paths -------------------------------------------------------------------

// The inputs that asked for gradients: each worker's piece of input k is a leaf of its
// graph (Note [Scatter backward]); GatherBackward returns their gradients.
struct DataParallel::InputGrads {
  std::vector<Tensor> inputs;               // the caller's tensors: the node's edges
  std::vector<bool> replicated;             // per entry of inputs
  std::vector<std::vector<Tensor>> leaves;  // [entry][rank]
};

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
    design_->replicate(r, step.sync_params());
    if (plan.sizes[r] == 0) return;
    std::vector<Tensor> xs;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      xs.push_back(scatter_input(r, inputs[k], plan, leaf_of[k] >= 0));
      if (leaf_of[k] >= 0) input_grads->leaves[leaf_of[k]][r] = xs.back();
      xs.back() = to_param_dtype(xs.back());
    }
    PhaseTimer t(*recorder_, r, Phase::Forward);
    outs[r] = xs.size() == 1 ? net_->forward(xs[0]) : net_->forward(xs);
    design_->after_forward(r);
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
                                            const nn::ShardableLoss& loss, const amp::GradScaler* scaler) {
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
  Tensor total = run_forward_backward("forward_backward", inputs, target, shard_loss, scaler);
  // The loss of the batch this process passed (its share of the job's, rescaled).
  return !add_up || mine == 0 ? total : mul(total, denominator / mine);
}

Tensor DataParallel::run_forward_backward(const char* what, const std::vector<DataParallelInput>& inputs,
                                          const Tensor& target, const ShardLoss& shard_loss,
                                          const amp::GradScaler* scaler) {
  const std::int64_t rows = check_inputs(what, inputs);
  DP_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == rows, "DataParallel::", what,
           ": expected a target with ", rows, " rows, got ", target.defined() ? target.str() : "an undefined tensor");
  const int n = static_cast<int>(devices_.size());
  const ShardPlan plan = plan_shards(rows);
  std::vector<DataParallelInput> detached(inputs);
  for (auto& in : detached) in.tensor = in.tensor.detach();
  const Tensor tgt = target.detach();
  // Note [Input gradients of forward_backward]
  // An input that requires grad (a leaf: adversarial training, saliency; or the output
  // of layers outside the wrapper: an embedding, an encoder on the host) gets its
  // gradient as from loss_fn(model(x), y).backward(): each worker's piece is a leaf,
  // their gradients are put together as a forward's are (Note [Scatter backward]) and
  // backward runs from the inputs on this thread once the step is over, into a leaf's
  // .grad or through the layers that made the input. Before, the inputs were detached
  // and those layers silently got no gradient.
  InputGrads input_grads;
  std::vector<int> leaf_of(inputs.size(), -1);
  if (is_grad_enabled())
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      if (!inputs[k].tensor.requires_grad()) continue;
      leaf_of[k] = static_cast<int>(input_grads.inputs.size());
      input_grads.inputs.push_back(inputs[k].tensor);
      input_grads.replicated.push_back(inputs[k].replicated);
      input_grads.leaves.emplace_back(n);
    }
  std::vector<Tensor> losses(n);
  {
    Step step(*this, what, {.replicate = true, .backward = true});
    step.run([&](int r) {
      GradModeGuard grad_guard(true);
      design_->replicate(r, step.sync_params());
      if (plan.sizes[r] > 0)
        losses[r] = worker_loss_backward(r, detached, tgt, plan, shard_loss, scaler, input_grads, leaf_of);
      reducer_->finalize(r);
    });
  }
  if (!input_grads.inputs.empty()) autograd::run_backward(input_grads.inputs, input_gradients(input_grads), false);
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

// One worker's shard of forward_backward; returns its weighted loss (unscaled: a
// scaler scales only what backward starts from, as scaler.scale(loss).backward()).
Tensor DataParallel::worker_loss_backward(int rank, const std::vector<DataParallelInput>& inputs,
                                          const Tensor& target, const ShardPlan& plan, const ShardLoss& shard_loss,
                                          const amp::GradScaler* scaler, InputGrads& input_grads,
                                          const std::vector<int>& leaf_of) {
  std::vector<Tensor> xs;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    // Note [Input gradients of forward_backward]: this rank's piece of an input that
    // asked for a gradient is a leaf of this worker's graph.
    const bool leaf = leaf_of[k] >= 0;
    xs.push_back(scatter_input(rank, inputs[k], plan, leaf));
    if (leaf) input_grads.leaves[static_cast<std::size_t>(leaf_of[k])][static_cast<std::size_t>(rank)] = xs.back();
    xs.back() = to_param_dtype(xs.back());
  }
  Tensor yr = scatter(rank, target, plan);
  Tensor loss;
  {
    PhaseTimer t(*recorder_, rank, Phase::Forward);
    Tensor out = xs.size() == 1 ? net_->forward(xs[0]) : net_->forward(xs);
    design_->after_forward(rank);
    loss = shard_loss(rank, out, yr);
    DP_CHECK(loss.numel() == 1, "DataParallel::forward_backward: the loss function must return a scalar, got ",
             loss.str());
  }
  PhaseTimer t(*recorder_, rank, Phase::Backward);
  (scaler ? scaler->scale(loss) : loss).backward();
  return loss.detach();
}

// Note [Parameters in low precision]: a worker's floating inputs enter the module in
// param_dtype (FSDP's cast_forward_inputs); differentiable, so an input's gradient comes
// back in its own dtype.
Tensor DataParallel::to_param_dtype(const Tensor& x) const {
  const std::optional<Dtype> dtype = design_->param_dtype();
  if (!dtype.has_value() || !x.defined() || !is_floating_point(x.dtype()) || x.dtype() == *dtype) return x;
  return x.to(*dtype);
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
  auto node = std::make_shared<parallel::GatherBackward>(
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
  design_->forward_connected(node->graph_alive());
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
  return input_gradients(input_grads);
}

std::vector<Tensor> DataParallel::input_gradients(const InputGrads& input_grads) {
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

DataParallel::NoSyncGuard::NoSyncGuard(DataParallel& dp) : dp_(dp), prev_(dp.require_sync_) {
  dp_.design_->check_no_sync();
  dp_.require_sync_ = false;
}
DataParallel::NoSyncGuard::~NoSyncGuard() { dp_.require_sync_ = prev_; }

}  // namespace dp
