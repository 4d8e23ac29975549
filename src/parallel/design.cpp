#include "parallel/design.h"

#include <set>

#include "dp/autograd/grad_mode.h"
#include "dp/nn/batchnorm.h"
#include "dp/comm/communicator.h"
#include "dp/tensor/ops.h"
#include "parallel/designs/designs.h"
#include "parallel/phase_timer.h"

namespace dp::parallel {

namespace {

// The factory a ScopedDesignFactory installed on this thread; empty: the options decide.
thread_local DesignFactory scoped_factory;

}  // namespace

std::unique_ptr<Design> make_design(DataParallel& dp) {
  if (scoped_factory) return scoped_factory(dp);
  switch (dp.mode()) {
    case Mode::DP: return make_dp_design(dp);
    case Mode::DDP: return make_ddp_design(dp);
    case Mode::Sharded: return make_sharded_design(dp);
  }
  DP_FAIL("DataParallel: no design for mode ", static_cast<int>(dp.mode()));
}

ScopedDesignFactory::ScopedDesignFactory(DesignFactory factory) : previous_(std::exchange(scoped_factory, std::move(factory))) {}
ScopedDesignFactory::~ScopedDesignFactory() { scoped_factory = std::move(previous_); }

Dtype wire_dtype(const MixedPrecision& mp) {
  // FSDP's default: with param_dtype set and reduce_dtype not, gradients travel in param_dtype.
  return mp.reduce_dtype.value_or(mp.param_dtype.value_or(Dtype::Float32));
}

std::shared_ptr<const GradWire> Design::grad_wire() const {
  const Dtype wire = wire_dtype(options().mixed_precision);
  // One device of the whole job combines nothing: nothing goes on a wire.
  if (wire == Dtype::Float32 || world_devices() == 1) return nullptr;
  return std::make_shared<const GradWire>(devices(), wire, set().numel());
}

std::vector<Bucket> Design::parameter_buckets() const {
  std::vector<std::int64_t> numel;
  for (auto& s : set().slots()) numel.push_back(s->copies[0].numel());
  return assign_buckets(numel, mib_to_floats(options().first_bucket_mb), mib_to_floats(options().bucket_cap_mb));
}

void Design::run_rank(int rank, const StepKind& kind, const std::function<void()>& body) {
  if (kind.backward) {
    begin_backward(rank);
    reducer().begin(rank);
  }
  body();
}

void Design::run_update(int rank, const UpdatePlan& /*plan*/, bool /*sync_params*/,
                        const std::function<void()>& update) {
  PhaseTimer t(recorder(), rank, Phase::Step);
  update();
}

// ---- replicate -------------------------------------------------------------------------------

std::uint64_t Design::primary_version() const {
  // The set's version counts optimizer steps and loads; the storage's counts in-place
  // writes through parameter tensors. Both only grow, so their sum changes whenever
  // either does.
  return set().version() + set().copy(0).data.storage()->version();
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
// thread (Design::params_stale), so every rank makes the same collectives. A step reads
// the parameters too (weight decay, and so SGD's momentum and Adam's moments), so DDP
// refreshes the replicas before a step as before a forward (UpdatePlan::refresh_params),
// as a Sharded step does (Note [Sharded step]): an edit or a load between backward and
// step (p.mul_() under no_grad, load_state_dict) had every replica but device 0 step
// from its old parameters into state of its own, and the replicas drifted apart from
// then on, silently (found by the optimizer fuzzer, resumed into DDP).
bool Design::begin_replicate() {
  const bool sync = params_stale();
  synced_version_ = kUnsynced;  // stays so if the step fails half way
  return sync;
}

void Design::end_replicate() {
  synced_version_ = primary_version();
  storage_base_.resize(static_cast<std::size_t>(set().num_copies()));
  for (int r = 0; r < set().num_copies(); ++r) storage_base_[r] = set().copy(r).data.storage()->version();
}

std::uint64_t Design::moved_since_sync(int r) const {
  return set().copy(r).data.storage()->version() - storage_base_[static_cast<std::size_t>(r)];
}

bool Design::primary_ahead() const {
  if (synced_version_ == kUnsynced) return true;
  for (int r = 1; r < set().num_copies(); ++r)
    if (moved_since_sync(r) < moved_since_sync(0)) return true;
  return false;
}

bool Design::copies_written_unequally() const {
  if (synced_version_ == kUnsynced) return true;
  for (int r = 1; r < set().num_copies(); ++r)
    if (moved_since_sync(r) != moved_since_sync(0)) return true;
  return false;
}

// Note [Coalesced buffers]
// A ResNet-50 has ~160 BatchNorm buffers; broadcast one by one they would cost as
// many tiny collectives per step. So every device's float32 buffers live in one flat
// tensor, and replicate() broadcasts it once. Device 0's buffers move into theirs in
// place — the TensorImpl is pointed at the flat storage, as Module::to does — so every
// handle to them (the module's, the user's) follows; the other devices' copies are
// views into theirs. int64 counters (num_batches_tracked) stay apart: device 0's is
// the one read.
void Design::coalesce_buffers(std::vector<std::shared_ptr<nn::Parameter::Slot>>& buffers) {
  const int n = static_cast<int>(devices().size());
  NoGradGuard no_grad;
  std::int64_t total = 0;
  for (auto& b : buffers)
    if (b->copies[0].dtype() == Dtype::Float32) total += b->copies[0].numel();
  buffer_flat_.clear();
  for (int r = 0; r < n; ++r) {
    Tensor flat = zeros({total}, devices()[r]);
    std::int64_t offset = 0;
    for (auto& b : buffers) {
      b->copies.resize(static_cast<std::size_t>(n));
      const Tensor& src = b->copies[0];
      Tensor& dst = b->copies[static_cast<std::size_t>(r)];
      if (src.dtype() != Dtype::Float32) {
        if (r > 0) dst = src.to(devices()[r]).detach().clone();
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
void Design::replicate(int rank, bool sync_params) {
  set().forget_compute_reads(rank);  // this forward's reads make their own cast nodes
  if (world_devices() == 1) {
    refresh_compute(rank, false);
    return cast_buffers(rank);
  }
  PhaseTimer t(recorder(), rank, Phase::Replicate);
  bool moved = replicate_params(rank, sync_params);
  const Tensor& buffers = buffer_flat_[static_cast<std::size_t>(rank)];
  if (broadcasts_buffers() && buffers.numel() > 0) {
    comm().broadcast(rank, buffers, 0);  // Note [Coalesced buffers]
    moved = true;
  }
  cast_buffers(rank);
  if (!moved) return t.cancel();
  t.set_args(sync_params ? "\"parameters\": true" : "\"parameters\": false");
}

bool Design::replicate_params(int rank, bool sync_params) {
  if (sync_params) params_comm().broadcast(rank, set().copy(rank).data, 0);
  refresh_compute(rank, sync_params);  // a broadcast's write moves no storage version
  return sync_params;
}

// ---- parameters in param_dtype ---------------------------------------------------------------

// Note [Parameters in low precision]
// mixed_precision.param_dtype (FSDP's MixedPrecision.param_dtype) makes every device
// compute forward and backward with a 16-bit copy of the parameters, while the float32
// parameters stay the master: what the optimizer steps (each copy's `data`, or its
// range in Mode::Sharded), what parameters(), state_dict() and checkpoints show, and
// what the user's own thread reads. The seam is the parameter set's compute copies
// (Note [Compute copies] in dp/nn/parameter_set.h): each copy gets a compute buffer in
// param_dtype, and a worker's Parameter::get() hands out its view there, made a node of
// the graph at the first read of each forward, whose backward widens the 16-bit
// gradient into the float32 leaf's .grad. So gradients are computed in param_dtype,
// travel in reduce_dtype (param_dtype unless set otherwise, as in FSDP: Note [Gradients
// on the wire]) and land widened in the float32 gradient buffers the reducer, the
// clipping and the optimizers already use; nothing below the parameter set changes.
// Casts happen in three places:
//  - a copy's compute buffer is cast from its float32 data on the copy's own worker,
//    before a forward, when that data was written since the last cast (an optimizer
//    step, a load, an in-place edit: the storage version, Note [Storage versions]) or
//    was just broadcast (refresh_compute). DDP and Sharded stages 1-2 cast each replica
//    locally; DP casts device 0's and BROADCASTS THE COMPUTE BUFFER to its transient
//    replicas (half the bytes of a float32 replicate; the replicas' float32 data is
//    never read then), with the parameters that keep float32 packed beside it.
//    Across processes (mpirun) nothing changes: every process casts its own devices'
//    float32 parameters, which are bitwise alike on every process after every step.
//    With ShardGather::NextForward (stages 1-2) the cast at the forward's start finds
//    the other owners' ranges stale; each unit's pull (Note [Deferred gather]) casts the
//    unit's elements again once they landed, before the read that pulled them returns
//    its compute view. Stage 3 casts each owner's float32 range into a 16-bit range
//    (after its update on its worker, and on the calling thread before any step whose
//    workers gather, for ranges written since: an edit written back, a failed step), and
//    the gathers move those 16-bit ranges into 16-bit unit buffers, which the compute
//    views point into: half the bytes of a float32 gather, as FSDP's all-gather in
//    param_dtype (Note [Sharded compute units] in src/parallel/shard_store.h);
//  - the floating inputs of DataParallel's forward are cast to param_dtype on each
//    worker, after the scatter (FSDP's cast_forward_inputs): a Linear then sees a
//    16-bit input and a 16-bit weight and computes in 16 bits;
//  - the gradient of each parameter is widened once per backward, by its cast node.
// Which parameters stay float32: BatchNorm2d's, as FSDP keeps _BatchNorm in float32 by
// default; batch_norm computes its statistics in float32 anyway and needs float32
// running statistics, and under param_dtype BatchNorm2d returns its input's dtype (Note
// [Compute copies]) so the layers after it stay 16-bit. LayerNorm (and every other
// module) computes in param_dtype, as FSDP does by default: layer_norm accumulates its
// statistics in float32 whatever the dtype (Note [16-bit tensors]), it has no running
// statistics to lose precision in, and a float32 LayerNorm would hand float32 to the
// residual stream of a transformer (a 16-bit and a float32 operand compute in float32),
// turning the rest of the block back to float32 unless its output were cast back.
// Memory per device, for P parameters (besides the float32 masters each design
// already holds): DDP and Sharded stages 1-2 add 2P bytes (the compute copy); DP adds
// 2P on device 0 and 2P on each replica (whose float32 data is then dead weight);
// stage 3 on N devices adds 2P/N (the 16-bit range), and its gathered unit is 16-bit,
// half the float32 one it replaces. Everything stays a pure function of the float32
// parameters and the same fixed-order sums, so DP, DDP and Sharded 1-3 remain bitwise
// identical to one another on CPU virtual devices with param_dtype set.
std::optional<Dtype> Design::param_dtype() const {
  const std::optional<Dtype> d = options().mixed_precision.param_dtype;
  if (!d.has_value() || *d == Dtype::Float32) return std::nullopt;
  return d;
}

std::vector<bool> Design::computed_slots() const {
  std::set<const nn::Parameter::Slot*> kept;  // Note [Parameters in low precision]: norms stay float32
  for (const auto& m : net().modules())
    if (nn::is_module<nn::BatchNorm2d>(*m))
      for (const auto& s : m->parameter_slots()) kept.insert(s->tied ? s->tied.get() : s.get());
  std::vector<bool> computed;
  for (const auto& s : set().slots()) computed.push_back(kept.count(s.get()) == 0);
  return computed;
}

void Design::make_compute_copies() {
  const std::optional<Dtype> dtype = param_dtype();
  if (!dtype.has_value()) return;
  set().set_compute_dtype(dtype);
  const std::vector<bool> computed = computed_slots();
  const auto& slots = set().slots();
  compute_base_.assign(static_cast<std::size_t>(set().num_copies()), {});
  for (int r = 0; r < set().num_copies(); ++r) {
    nn::ParameterCopy& c = set().copy(r);
    c.compute = empty({c.data.numel()}, TensorOptions{*dtype, c.device});
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (computed[i]) set().set_compute_view(r, i, compute_view(r, i));
    refresh_compute(r, true);
  }
}

Tensor Design::compute_view(int rank, std::size_t i) const {
  const nn::Parameter::Slot& s = *set().slots().at(i);
  const Shape& shape = s.copies[0].shape();
  return set().copy(rank).compute.narrow(0, s.offset, shape_numel(shape)).reshape(shape);
}

void Design::refresh_compute(int rank, bool force) {
  const nn::ParameterCopy& c = set().copy(rank);
  if (!c.compute.defined()) return;
  ComputeBase& base = compute_base_.at(static_cast<std::size_t>(rank));
  const ComputeBase now{c.data.storage().get(), c.data.storage()->version()};
  if (!force && base.storage == now.storage && base.version == now.version) return;
  cast_into(c.data, c.compute);
  base = now;
}

void Design::refresh_compute_range(int rank, std::int64_t lo, std::int64_t hi) {
  const nn::ParameterCopy& c = set().copy(rank);
  if (!c.compute.defined() || hi <= lo) return;
  cast_into(c.data.narrow(0, lo, hi - lo), c.compute.narrow(0, lo, hi - lo));
}

// ---- buffers in buffer_dtype ------------------------------------------------------------------

// Note [Buffers in low precision]
// mixed_precision.buffer_dtype (FSDP's MixedPrecision.buffer_dtype) keeps the buffers
// of every module but BatchNorm2d in buffer_dtype where the workers compute: each
// device gets a copy of each of those float32 buffers in buffer_dtype (Slot::compute,
// as a parameter's compute view), and a worker's read of such a buffer
// (Parameter::get() on a bound thread) returns that copy, so that a module computing in param_dtype meets a 16-bit
// buffer and stays in 16 bits (a float32 operand would turn its result to float32).
// BatchNorm2d keeps float32 buffers, as FSDP keeps _BatchNorm out of mixed precision by
// default: its running statistics are accumulated in float32 (Note [Parameters in low
// precision]). The float32 buffers stay the master, as the float32 parameters do: what
// state_dict(), checkpoints, the buffer broadcast and the user's own thread read.
// - Before every forward, after the buffer broadcast (if any), each worker casts its
//   device's float32 buffers into their copies: a read-only buffer (a mask, a table)
//   computes as FSDP's cast one does, and its master keeps every bit.
// - A forward that writes into a buffer in place (a running statistic of a module of
//   one's own) writes the 16-bit copy, so the update is computed and rounded in
//   buffer_dtype, as in FSDP, where the buffer lives in buffer_dtype; right after the
//   forward the worker widens each copy whose storage version moved into its float32
//   buffer (after_forward; every copy has a storage of its own, so a read-only buffer
//   beside a written one is never rounded), so the master holds the 16-bit value
//   exactly, device 0's is what the next broadcast sends, and the next cast gives the
//   same bits back.
// Buffers that are not float32 (num_batches_tracked) are left as they are. Everything
// is a function of device 0's float32 buffers and each device's own forward, so the
// designs stay bitwise alike; buffer_dtype float32 changes nothing.
void Design::make_compute_buffers(const std::vector<std::shared_ptr<nn::Parameter::Slot>>& buffers) {
  const std::optional<Dtype> dtype = options().mixed_precision.buffer_dtype;
  if (!dtype.has_value() || *dtype == Dtype::Float32) return;
  std::set<const nn::Parameter::Slot*> kept;
  for (const auto& m : net().modules())
    if (nn::is_module<nn::BatchNorm2d>(*m))
      for (const auto& s : m->buffer_slots()) kept.insert(s.get());
  for (const auto& b : buffers)
    if (b->copies[0].dtype() == Dtype::Float32 && kept.count(b.get()) == 0) cast_buffers_.push_back(b);
  const auto n = devices().size();
  cast_versions_.assign(n, std::vector<std::uint64_t>(cast_buffers_.size(), 0));
  for (auto& b : cast_buffers_) {
    b->compute.clear();
    for (std::size_t r = 0; r < n; ++r) b->compute.push_back(empty(b->copies[0].shape(), TensorOptions{*dtype, devices()[r]}));
    b->compute_reads.assign(n, Tensor());
  }
}

void Design::cast_buffers(int rank) {
  NoGradGuard no_grad;
  const auto r = static_cast<std::size_t>(rank);
  for (std::size_t i = 0; i < cast_buffers_.size(); ++i) {
    const nn::Parameter::Slot& b = *cast_buffers_[i];
    cast_into(b.copies[r], b.compute[r]);
    cast_versions_[r][i] = b.compute[r].storage()->version();
  }
}

void Design::after_forward(int rank) {
  NoGradGuard no_grad;
  const auto r = static_cast<std::size_t>(rank);
  for (std::size_t i = 0; i < cast_buffers_.size(); ++i) {
    const nn::Parameter::Slot& b = *cast_buffers_[i];
    if (b.compute[r].storage()->version() == cast_versions_[r][i]) continue;
    cast_into(b.compute[r], b.copies[r]);
    b.copies[r].note_write();  // written behind the tensor's back: its range of the coalesced buffers
    cast_versions_[r][i] = b.compute[r].storage()->version();
  }
}

// ---- combined gradients ------------------------------------------------------------------------

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
void Design::after_backward() {
  combined_ = combines_grads();
  combined_zero_grad_count_ = set().zero_grad_count();
}

void Design::forget_combined_grads() {
  if (!combined_) return;
  combined_ = false;
  if (set().zero_grad_count() != combined_zero_grad_count_) return;
  NoGradGuard no_grad;
  forget_sums();
}

void Design::forget_sums() {
  // Across processes every process's device 0 holds the sum too (DP's as well, Note
  // [DP across processes]): process 0's alone keeps it.
  for (int r = process() == 0 ? 1 : 0; r < set().num_copies(); ++r) set().copy(r).grad.zero_();
}

// ---- gradient versions (Note [Gradient edits]) ------------------------------------------------

void Design::snapshot_grad_versions() {
  snapshot_zero_grad_count_ = set().zero_grad_count();
  grad_base_.resize(static_cast<std::size_t>(set().num_copies()));
  for (int r = 0; r < set().num_copies(); ++r) {
    const Tensor& g = set().copy(r).grad;  // undefined while released (Sharded stage 2)
    grad_base_[r] = g.defined() ? g.storage()->version() : 0;
  }
}

void Design::note_device0_edits() {
  const Tensor& g = set().copy(0).grad;  // undefined while released (Sharded stages 2 and 3)
  if (!g.defined() || grad_base_.empty() || g.storage()->version() == grad_base_[0]) return;
  if (set().zero_grad_count() != snapshot_zero_grad_count_) return;  // zeroed since: nothing edited stands
  device0_edited_ = true;
  device0_edited_count_ = set().zero_grad_count();
}

bool Design::device0_edited() const { return device0_edited_ && set().zero_grad_count() == device0_edited_count_; }

bool Design::carries_combined_grads() const {
  return combined_ && set().zero_grad_count() == combined_zero_grad_count_;
}

bool Design::grads_edited_unequally() const {
  const std::uint64_t moved0 = set().copy(0).grad.storage()->version() - grad_base_[0];
  for (int r = 1; r < set().num_copies(); ++r)
    if (set().copy(r).grad.storage()->version() - grad_base_[r] != moved0) return true;
  return false;
}

}  // namespace dp::parallel

namespace dp {

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::DP: return "DP";
    case Mode::DDP: return "DDP";
    case Mode::Sharded: return "Sharded";
  }
  return "?";
}

}  // namespace dp
