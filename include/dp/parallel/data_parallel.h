// dp/parallel/data_parallel.h — the one-line change: train a module on every device.
//
// DataParallel splits each batch along dim 0 over its devices and runs forward and
// backward on one persistent worker thread per device. Three designs, one switch:
//  - Mode::DP (default): device 0 holds the only trained parameters; before a
//    forward they are copied to transient replicas (only when they changed), and
//    after backward every replica's gradient is summed onto device 0 in a fixed
//    device order. The optimizer steps device 0.
//  - Mode::DDP: every device keeps a persistent replica with its own optimizer
//    state; gradients are all-reduced in buckets while backward still runs, and
//    every replica applies the same gradient. No parameters are broadcast.
//  - Mode::Sharded (ZeRO): every device keeps a persistent replica but owns 1/N of
//    the flat buffers; gradients are reduce-scattered in buckets while backward
//    runs, each device steps only its range with only its range's optimizer state
//    (stage 1), keeping only its range's gradient between steps (stage 2), and the
//    updated ranges are all-gathered at the end of the optimizer step. Stage 3 also
//    keeps only its range of the parameters: each top-level child's parameters are
//    gathered just before it runs forward (the next child's prefetched) and again
//    for its backward, and released after use (see shard_stage below).
// An optimizer built on model.parameters() (or net->parameters()) steps every
// replica that needs it — see Note [Parameter sets] and docs/architecture.md.
// Gradients are scaled so that the SUM over devices is the full-batch mean, so
// uneven shards are weighted exactly and the three designs agree bit for bit on CPU.
// Launched by mpirun, the same program spans every process of the job: each process
// passes its own batch and its own devices (the same number everywhere), and the
// designs run over all of them (Note [Across processes], docs/multi-node.md).
//
//   dp::DataParallel model(net, {0, 1, 2, 3});   // or {.mode = dp::Mode::DDP}, or
//                                                // {.mode = dp::Mode::Sharded, .shard_stage = 2}
//   dp::optim::Adam opt(model.parameters(), {.lr = 1e-3});
//   opt.zero_grad(); dp::nn::cross_entropy(model(x), y).backward(); opt.step();
//   dp::Tensor out = model(x, mask);              // a module of two inputs: both split by rows
//
// Note [Errors keep their type]
// An exception thrown on a worker (the module's forward, the loss, backward, an
// optimizer step run per device) reaches the caller of model(x), backward(),
// forward_backward or opt.step() as the exception the worker threw, so a handler for
// its type fires, as PyTorch re-raises a worker's exception type:
//  - your own types, std:: types (std::bad_alloc, std::out_of_range ...), subclasses
//    of dp::Error (dp::CollectiveAborted) and non-std values (`throw 42`) arrive as
//    the very object thrown (std::rethrow_exception);
//  - a plain dp::Error (dp's own checks: a shape, a dtype, a device) arrives as a
//    dp::Error whose what() starts with the device, "worker on cpu:1: linear:
//    expected ...", the original nested inside it (std::rethrow_if_nested).
// Either way dp::failed_device() names the device inside the handler. When several
// devices fail, the error reported is the root cause: the lowest device whose
// exception is not a dp::CollectiveAborted, never a device that was only released
// from a collective because another one failed (Note [Root cause] in
// src/parallel/worker_pool.cpp). The other workers stop cleanly and the DataParallel
// is usable for the next step.
//   try { model.forward_backward(x, y, loss_fn); }
//   catch (const MyError& e) { std::cerr << e.what() << " on " << dp::failed_device().value() << "\n"; }
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
#include <string>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "dp/nn/loss.h"
#include "dp/nn/module.h"
#include "dp/parallel/stats.h"
#include "dp/tensor/tensor.h"

namespace dp {

namespace amp {
class GradScaler;
}
namespace backend {
class CopyFences;
}
namespace comm {
class Communicator;
}
namespace parallel {
class Design;
class PhaseRecorder;
class Reducer;
class WorkerPool;
}  // namespace parallel

/// Inside a catch block: the device whose worker threw the exception being handled, when
/// a DataParallel step rethrew it from that worker (Note [Errors keep their type]);
/// std::nullopt for an exception that did not come from a worker, or outside a catch
/// block. The exception is matched by identity, so any
/// handler of it works, `catch (MyError&)`, `catch (int)` or `catch (...)`.
std::optional<Device> failed_device();
/// The same for a stored exception (std::current_exception() kept for later). The last
/// 64 failures rethrown by the process are remembered; an older one gives std::nullopt.
std::optional<Device> failed_device(const std::exception_ptr& error);

/// Which data-parallel design DataParallel runs.
enum class Mode { DP, DDP, Sharded };
/// "DP", "DDP", "Sharded".
const char* mode_name(Mode mode);

/// Sharded stages 1 and 2: when the ranges each device stepped reach the other
/// devices (Note [Sharded step], Note [Deferred gather]).
enum class ShardGather {
  /// Inside opt.step(), right after the update: one all-gather over each copy.
  AfterStep,
  /// Device 0 takes every range inside opt.step() (what the user reads is whole when
  /// it returns); each other device takes each top-level child's ranges just before
  /// its next forward first uses them, overlapping the forward of the children before.
  NextForward,
};

/// What runs in low precision where (PyTorch FSDP's MixedPrecision vocabulary). Unset
/// fields keep float32. Only floating dtypes are accepted.
///
///   dp::DataParallel model(net, {0, 1, 2, 3},
///                          {.mode = dp::Mode::DDP, .mixed_precision = {.reduce_dtype = dp::Dtype::BFloat16}});
struct MixedPrecision {
  /// Parameters in forward and backward: BFloat16 or Float16 makes every worker compute
  /// with a 16-bit copy of the parameters (floating inputs cast on entry), while the
  /// float32 parameters stay the master the optimizer steps and parameters() shows; the
  /// gradients come back widened into the float32 .grad (Note [Parameters in low
  /// precision] in src/parallel/design.cpp). BatchNorm2d keeps float32 parameters.
  /// Sets reduce_dtype's default. Every design (DP, DDP, Sharded stages 1-3, either
  /// ShardGather), in one process and across processes; stage 3 gathers each unit's
  /// 16-bit copy, half the bytes of a float32 gather (Stats::gather_bytes).
  std::optional<Dtype> param_dtype = std::nullopt;
  /// Gradients on the wire: BFloat16 or Float16 halves the bytes every gradient
  /// collective moves, in every design (DP's reduce, DDP's all-reduce, Sharded's
  /// reduce-scatter). Each device's float32 gradient is rounded to it, the sum over
  /// devices is formed in float32 and rounded once, and the result is widened back into
  /// the float32 gradient the optimizer steps (Note [Gradients on the wire] in
  /// src/parallel/grad_wire.h). Float32 (or unset) keeps float32 on the wire. Costs
  /// 2 bytes per parameter per device. Across processes (mpirun) the processes' sums
  /// cross in it too, as 2-byte elements summed in float32 in process order and
  /// rounded once: one rounding per hop, the same bits on every process.
  /// Unset: param_dtype when that is set (as in FSDP), else float32.
  std::optional<Dtype> reduce_dtype = std::nullopt;
  /// Buffers of every module but BatchNorm2d (whose running statistics stay float32, as
  /// FSDP keeps batch norm): BFloat16 or Float16 makes every worker read a copy of them in
  /// it, cast from the float32 buffers before each forward, so a module computing in
  /// param_dtype stays 16-bit where it meets its buffer; a forward's in-place write into
  /// such a buffer (a running statistic) is made in it and widened into the float32
  /// buffer, which state_dict() and checkpoints show (Note [Buffers in low precision] in
  /// src/parallel/design.cpp). Independent of param_dtype, as in FSDP. Unset or Float32:
  /// buffers as registered.
  std::optional<Dtype> buffer_dtype = std::nullopt;
};

/// Options of DataParallel (designated-initialiser friendly).
struct DataParallelOptions {
  Mode mode = Mode::DP;
  /// Index into the device list of the device that receives gathered outputs.
  int output_device = 0;
  /// Explicit rows per device (must sum to the batch size); empty = torch.chunk split.
  std::vector<std::int64_t> chunk_sizes = {};
  /// Sharded: the ZeRO stage. 1: optimizer state sharded (each device keeps state
  /// for its 1/N of the parameters); 2: gradients too (each device keeps only its
  /// range's summed gradient between steps; the parameters' .grad are undefined
  /// then, and set_grad on them is a dp::Error); in stage 1 the .grad of device 0's
  /// parameters (what parameters() shows) hold the summed gradient on device 0's range
  /// and zeros on the others', so read
  /// gradients through clip_grad_norm_'s return value, not by hand, and an
  /// optimizer step after an edit of .grad by hand is a dp::Error (Note [Gradient
  /// edits]); 3: parameters too (FSDP): each device keeps its 1/N of the parameters;
  /// a top-level child's parameters are gathered on every device just before the
  /// child's forward and again for its backward, and released after. Unset means 2.
  /// Setting it with another mode is an error. On one device stage 3 runs as stage 1.
  /// Across processes (mpirun) stages 1 and 2 cut the buffers over every device of
  /// the job; stage 3 is hybrid: sharded over each process's devices, replicated
  /// across processes, so a device keeps 1/N of the parameters for its process's N
  /// devices (with one device per process it runs as stage 2; Note [Stage 3 across
  /// processes], shard_world()).
  ///
  /// What the user sees of the parameters in stage 3 (Note [Sharded parameters] in
  /// src/parallel/designs/sharded_units.cpp): between steps no device holds them whole.
  /// net->parameters(), model.parameters(), named_parameters() and state_dict()
  /// (and so dp::save and training checkpoints) gather device 0's copy and return
  /// full tensors, readable until DataParallel next runs (a forward, backward,
  /// zero_grad or optimizer step), which first writes edits made through them (a
  /// load, an in-place write) back into every device's range and then releases
  /// them; a tensor kept from before and read after that is a dp::Error naming the
  /// released memory, never stale values. So: take tensors from these calls when you
  /// read them, not once for the whole run. A parameter used outside the unit that
  /// owns it (a GPT's embedding tied to its head, Module::share_parameter) is
  /// gathered again where it is read. The units are the top-level children unless
  /// shard_unit says otherwise.
  /// no_sync() is refused in stage 3 (it would need the full gradient the stage
  /// exists to avoid): accumulate by running backward several times between
  /// zero_grad() and step(), each adds to the owners' ranges.
  std::optional<int> shard_stage = std::nullopt;
  /// Sharded stages 1 and 2: when the updated ranges are gathered (ShardGather;
  /// docs/dp-vs-ddp.md has the measurements behind the default). Unset means
  /// AfterStep. Whichever is chosen, what the user reads (parameters(),
  /// state_dict(), checkpoints) is whole when opt.step() returns, and the parameters
  /// are bitwise the same. Setting it with another mode or stage 3 (which gathers
  /// per top-level child anyway) is an error, as is NextForward across processes
  /// (the other processes' ranges are not in this one's memory to take).
  std::optional<ShardGather> shard_gather = std::nullopt;
  /// Sharded: which modules are gather units (FSDP's auto_wrap_policy). Unset: each
  /// top-level child of the net (and each parameter the root registers itself). Set:
  /// also every module for which it returns true — the outermost where they nest —
  /// is a unit of its own; the parameters of a top-level child outside those form
  /// that child's units, one per contiguous run. Stage 3 gathers one unit at a time,
  /// so a GPT whose blocks sit in one container wants each block a unit:
  ///   .shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>
  /// Setting it with another mode is an error.
  std::function<bool(const nn::Module&)> shard_unit = nullptr;
  /// DDP and Sharded: bucket size cap in MiB (PyTorch's bucket_cap_mb) and the
  /// smaller first bucket. Sharded stage 2 holds no full gradient buffer during a
  /// synced backward: the cap also bounds the gradients a device holds before they
  /// are reduce-scattered into their owners' ranges (DeepSpeed's reduce_bucket_size).
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  /// DDP and Sharded: copy device 0's buffers (BatchNorm running stats) to every
  /// replica before each forward.
  bool broadcast_buffers = true;
  /// Opt-in: check gradients for NaN/Inf (each device's own gradient before it is
  /// reduced, all-reduced or reduce-scattered, and the result after) and throw
  /// dp::Error naming the parameter and the device.
  bool check_finite_grads = false;
  /// Opt-in (DDP): every N optimizer steps compare every replica's parameters with
  /// device 0's, bitwise, and throw naming the first parameter and device that
  /// differ (see check_replicas()). 0 = never.
  int check_replicas_every = 0;
  /// CUDA (NCCL): a collective not completed this long after it was enqueued aborts
  /// every device's communicator with an error naming the device and the collective
  /// (Note [NCCL failures]); the next step then throws dp::CollectiveAborted instead
  /// of hanging. CPU virtual devices are released at once by the failing worker.
  std::chrono::milliseconds collective_timeout = std::chrono::minutes(10);
  /// Launched by mpirun (or srun), DataParallel spans every process of the job
  /// (Note [Across processes]): construction is then collective, every process
  /// passing the same number of devices. false keeps it within this process — a
  /// model one process trains or evaluates alone (rank 0 resuming a checkpoint on
  /// its own devices, say) — and nothing it does waits for the other processes.
  bool span_processes = true;
  /// Low precision where (MixedPrecision); today its reduce_dtype.
  MixedPrecision mixed_precision = {};
};

/// Marks an input of DataParallel::forward that every device receives whole instead of
/// a slice of its rows: a mask shared by every sample, a lookup table. A 0-d tensor is
/// replicated without the mark.
///
///   model(x, dp::replicated(causal_mask));   // x split by rows, the (T, T) mask whole
struct Replicated {
  Tensor tensor;
};
inline Replicated replicated(Tensor t) { return Replicated{std::move(t)}; }

/// One input of a several-input DataParallel forward: a tensor split along dim 0 like
/// the batch (the default), or one replicated to every device (a 0-d tensor, or
/// dp::replicated(t)).
struct DataParallelInput {
  DataParallelInput(Tensor t) : tensor(std::move(t)), replicated(tensor.defined() && tensor.dim() == 0) {}  // NOLINT
  DataParallelInput(Replicated r) : tensor(std::move(r.tensor)), replicated(true) {}  // NOLINT
  Tensor tensor;
  bool replicated;
};

/// A loss of (output, target) that MUST return the mean over its rows (e.g.
/// cross_entropy with its defaults). forward_backward cannot see its reduction: it weighs
/// each shard's value by the shard's share of the rows, which is the batch's mean only
/// for a plain mean over rows. A Sum, a class-weighted or ignore_index mean, or a mean
/// over elements of rows of unequal size come back WRONG (a Sum on 2 devices returns
/// about half the sum). For those pass a loss descriptor (dp/nn/loss.h) instead.
using LossFn = std::function<Tensor(const Tensor& output, const Tensor& target)>;

/// Data-parallel training of one module over several devices (see the file comment).
class DataParallel {
 public:
  /// Devices by integer id of the default type (CUDA when visible, else CPU virtual
  /// devices); empty = every device of that type.
  DataParallel(std::shared_ptr<nn::Module> net, std::vector<int> device_ids = {},
               DataParallelOptions options = {});
  DataParallel(std::shared_ptr<nn::Module> net, std::vector<int> device_ids, Mode mode)
      : DataParallel(std::move(net), std::move(device_ids), DataParallelOptions{.mode = mode}) {}
  /// Explicit devices, e.g. {dp::cpu(0), dp::cpu(1)}.
  DataParallel(std::shared_ptr<nn::Module> net, std::vector<Device> devices,
               DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// Scatters x over the devices, runs forward on every worker and gathers the
  /// outputs onto the output device. Gradients flow back to x when it requires them.
  /// Backward through the result runs each device's part on its own worker and then
  /// reduces (DP), all-reduces (DDP) or reduce-scatters (Sharded) the gradients.
  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  /// A module of several inputs (Note [Module inputs] in dp/nn/module.h): every input
  /// is split along dim 0 with the same rows per device — all must have the same
  /// size(0), else dp::Error — except replicated ones (0-d, or dp::replicated(t)),
  /// which every device receives whole. Gradients flow back to every input that
  /// requires them (a replicated input's is the sum over devices, in device order).
  ///
  ///   dp::Tensor out = model(x, mask);                       // both (N, ...)
  ///   dp::Tensor out = model.forward({x, dp::replicated(table)});
  Tensor forward(const std::vector<DataParallelInput>& inputs);
  template <typename... Rest>
    requires(sizeof...(Rest) >= 1 && (std::constructible_from<DataParallelInput, const Rest&> && ...))
  Tensor forward(const DataParallelInput& first, const Rest&... rest) {
    return forward(std::vector<DataParallelInput>{first, DataParallelInput(rest)...});
  }
  template <typename... Rest>
    requires(sizeof...(Rest) >= 1 && (std::constructible_from<DataParallelInput, const Rest&> && ...))
  Tensor operator()(const DataParallelInput& first, const Rest&... rest) {
    return forward(std::vector<DataParallelInput>{first, DataParallelInput(rest)...});
  }

  /// The faster path: every worker computes loss_fn on its own shard and runs
  /// backward; no outputs are gathered. Returns the batch's mean loss (a scalar on
  /// the output device, without autograd history). loss_fn must return its shard's
  /// mean over rows (see LossFn); prefer a loss descriptor, which is exact always. An
  /// input that requires grad (with grad mode on) gets its gradient as from
  /// loss_fn(model(x), y).backward(): into its .grad, or through the layers that made it
  /// (Note [Input gradients of forward_backward] in src/parallel/data_parallel.cpp).
  Tensor forward_backward(const Tensor& x, const Tensor& target, const LossFn& loss_fn);

  /// forward_backward with a loss descriptor of dp/nn/loss.h, whose reduction is known:
  /// returns the whole batch's loss and leaves its gradients, for Mean, Sum, class
  /// weights, ignore_index and label smoothing alike (Note [Exact shard losses]; equal
  /// to one device's up to float rounding of the sums). Reduction::None is refused.
  ///
  ///   model.forward_backward(x, y, dp::nn::CrossEntropyLoss{.weight = w, .ignore_index = 0});
  ///   model.forward_backward(x, y, dp::nn::MSELoss{.reduction = dp::nn::Reduction::Sum});
  template <typename L>
    requires std::constructible_from<nn::ShardableLoss, const L&>
  Tensor forward_backward(const Tensor& x, const Tensor& target, const L& loss) {
    return forward_backward_exact(std::vector<DataParallelInput>{x}, target, nn::ShardableLoss(loss));
  }
  /// The same for a module of several inputs: model.forward_backward({x, mask}, y, ce).
  template <typename L>
    requires std::constructible_from<nn::ShardableLoss, const L&>
  Tensor forward_backward(const std::vector<DataParallelInput>& inputs, const Tensor& target, const L& loss) {
    return forward_backward_exact(inputs, target, nn::ShardableLoss(loss));
  }
  /// forward_backward with a loss descriptor under a loss scaler (float16 training): each
  /// shard backpropagates scaler.scale() of its exact share, so the gradients are those
  /// of scaler.scale(loss).backward() on the whole batch, for every reduction and option
  /// as above; returns the batch's loss unscaled. A disabled scaler scales nothing.
  ///
  ///   model.forward_backward(x, y, dp::nn::CrossEntropyLoss{.ignore_index = 0}, scaler);
  ///   scaler.step(opt);
  ///   scaler.update();
  template <typename L>
    requires std::constructible_from<nn::ShardableLoss, const L&>
  Tensor forward_backward(const Tensor& x, const Tensor& target, const L& loss, const amp::GradScaler& scaler) {
    return forward_backward_exact(std::vector<DataParallelInput>{x}, target, nn::ShardableLoss(loss), &scaler);
  }
  template <typename L>
    requires std::constructible_from<nn::ShardableLoss, const L&>
  Tensor forward_backward(const std::vector<DataParallelInput>& inputs, const Tensor& target, const L& loss,
                          const amp::GradScaler& scaler) {
    return forward_backward_exact(inputs, target, nn::ShardableLoss(loss), &scaler);
  }
  /// The same for a module of several inputs, split as forward(inputs) splits them:
  /// model.forward_backward({x, mask}, y, loss_fn).
  Tensor forward_backward(const std::vector<DataParallelInput>& inputs, const Tensor& target,
                          const LossFn& loss_fn);

  /// RAII guard for gradient accumulation (refused with shard_stage 3, which
  /// accumulates without it): in DDP and Sharded modes backward passes
  /// inside it accumulate locally (Sharded stage 2 keeps the full gradient buffers
  /// until then) and start no collective; the first backward after it ends combines
  /// the accumulated sum (PyTorch's no_sync). DP mode accumulates on device 0
  /// anyway, so the guard changes nothing there.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DataParallel& dp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DataParallel& dp_;
    bool prev_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// DDP and Sharded: throws dp::Error naming the first parameter and device whose replica differs
  /// (bitwise) from device 0's. Replicas never drift in normal use — an optimizer
  /// step inside no_sync() is refused, and gradient edits through parameters() reach
  /// every replica (Note [Gradient edits]) — so a difference means memory was written
  /// behind dp's back. After load_state_dict() or an in-place write through
  /// parameters() the replicas take device 0's parameters at the next forward or step,
  /// and are not compared until then. DP keeps no persistent replicas: nothing to compare.
  void check_replicas() const;

  /// The wrapped module's parameters (device 0's copy; optimizers step every copy,
  /// in Sharded mode each its own range).
  nn::ParameterList parameters() { return net_->parameters(); }
  /// Same names as the wrapped module (no "module." prefix). Full tensors in every
  /// mode: a Sharded step all-gathers the parameters before it returns.
  nn::StateDict state_dict() { return net_->state_dict(); }
  nn::LoadResult load_state_dict(const nn::StateDict& state, bool strict = true);
  const std::shared_ptr<nn::Module>& module() const { return net_; }
  void train(bool on = true) { net_->train(on); }
  void eval() { net_->train(false); }
  /// The module's zero_grad (Note [Parameters without a gradient] in dp/optim/optimizer.h).
  void zero_grad(bool set_to_none = true) { net_->zero_grad(set_to_none); }

  Mode mode() const { return options_.mode; }
  const std::vector<Device>& devices() const { return devices_; }
  Device output_device() const { return devices_[options_.output_device]; }
  const DataParallelOptions& options() const { return options_; }
  /// DDP and Sharded: the buckets as [first, last) element ranges of the flat
  /// gradient buffer (empty in DP mode).
  std::vector<std::pair<std::int64_t, std::int64_t>> buckets() const;
  /// Sharded: the range [first, last) of the flat buffers each device owns (padded
  /// to equal lengths, Note [Sharded parameter sets]); empty in the other modes.
  std::vector<std::pair<std::int64_t, std::int64_t>> shards() const;
  /// Sharded stage 3: the gather units, [first, last) runs of the flat buffers, one per
  /// top-level child (Note [Sharded parameters]); empty otherwise.
  std::vector<std::pair<std::int64_t, std::int64_t>> units() const;
  /// The ZeRO stage in Sharded mode, 0 in the others.
  int shard_stage() const;
  /// Sharded: the devices the flat buffers are cut over, one range each —
  /// world_devices() for stages 1 and 2 (across processes too), devices().size() for
  /// stage 3, which across processes shards within each process and replicates across
  /// them (hybrid sharding, Note [Stage 3 across processes]); 0 in the other modes.
  int shard_world() const;

  /// Processes the model spans (Note [Across processes]): dp::dist::world_size() when
  /// launched by mpirun, else 1; devices() are this process's.
  int processes() const { return processes_; }
  /// Replicas of the whole job: processes() * devices().size().
  int world_devices() const { return processes_ * static_cast<int>(devices_.size()); }

  /// The communicator among the devices (of every process, when it spans processes:
  /// Note [World ranks], dp/comm/communicator.h). For reading: its process_times(i)
  /// say how long device i's thread spent crossing processes (Note [Inter-process
  /// time]), which stats() counts inside the all-reduce, reduce-scatter, all-gather,
  /// reduce and replicate phases; reset_stats() resets them too. Calling its
  /// collectives during a step is an error nothing checks.
  comm::Communicator& communicator() const { return *comm_; }

  /// Phase timers per device since construction or reset_stats().
  parallel::Stats stats() const;
  void reset_stats();
  /// The timeline recorder (enable it to record a Chrome/Perfetto trace).
  parallel::Trace& trace();

 private:
  class Step;       // one step's scope: busy flag, replicate, reducer, failure path
  class Executor;   // the set's executor: run_on_copies (Note [Copy executors])
  struct ShardPlan;  // rows per device and where each starts
  friend class parallel::Design;  // what differs between the designs (src/parallel/design.h)

  void init(std::vector<Device> devices);
  void check_options(int n);
  static void check_mixed_precision(const MixedPrecision& mp);
  void make_reducer();
  ShardPlan plan_shards(std::int64_t rows) const;
  using ShardLoss = std::function<Tensor(int rank, const Tensor& output, const Tensor& target)>;
  struct InputGrads;  // the inputs that asked for gradients and their per-rank leaves

  std::int64_t check_inputs(const char* what, const std::vector<DataParallelInput>& inputs) const;
  std::int64_t global_rows(std::int64_t rows) const;
  /// After a synced backward across processes: which parameters got a gradient on any
  /// device of any process (Note [Parameters without a gradient] in dp/optim/optimizer.h).
  void merge_arrived_grads(bool synced);
  void sync_processes();
  void sync_dropout_streams(comm::Communicator& across);
  Tensor scatter(int rank, const Tensor& src, const ShardPlan& plan, bool as_leaf = false);
  Tensor scatter_input(int rank, const DataParallelInput& in, const ShardPlan& plan, bool as_leaf);
  Tensor to_param_dtype(const Tensor& x) const;
  Tensor gather(const std::vector<Tensor>& outs, const ShardPlan& plan);
  void connect_gather_backward(Tensor& out, const std::vector<Tensor>& outs, const ShardPlan& plan,
                               std::shared_ptr<InputGrads> input_grads, double grad_scale);
  std::vector<Tensor> backward_from_gather(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                                           const InputGrads& input_grads, double grad_scale);
  Tensor forward_backward_exact(const std::vector<DataParallelInput>& inputs, const Tensor& target,
                                const nn::ShardableLoss& loss, const amp::GradScaler* scaler = nullptr);
  Tensor run_forward_backward(const char* what, const std::vector<DataParallelInput>& inputs,
                              const Tensor& target, const ShardLoss& shard_loss,
                              const amp::GradScaler* scaler = nullptr);
  Tensor worker_loss_backward(int rank, const std::vector<DataParallelInput>& inputs, const Tensor& target,
                              const ShardPlan& plan, const ShardLoss& shard_loss, const amp::GradScaler* scaler,
                              InputGrads& input_grads, const std::vector<int>& leaf_of);
  /// The gradient of every input in `input_grads`, from its per-rank leaves (Note
  /// [Scatter backward]).
  static std::vector<Tensor> input_gradients(const InputGrads& input_grads);
  void run_on_copies(int copies, bool update, bool small, const std::function<void(int)>& fn);
  /// Runs `check` (which may refuse `what` on this process's own state) so that every
  /// process refuses if one does (Note [Refusals across processes]).
  void agree_across_processes(const char* what, const std::function<void()>& check);
  /// Across processes: refuses `what` when device 0's gradients were edited since the
  /// backward and differ between the processes (Note [Refusals across processes]).
  void check_grad_edits_agree(const char* what);
  void abort_step(int rank, const std::exception_ptr& error);
  void check_finite(int rank, const Tensor& grad, std::int64_t offset);

  std::shared_ptr<nn::Module> net_;
  std::shared_ptr<nn::ParameterSet> set_;
  std::vector<std::shared_ptr<nn::Parameter::Slot>> buffers_;
  std::vector<Device> devices_;
  int processes_ = 1;  // processes of the job the model spans (Note [Across processes])
  int process_ = 0;    // this one's rank among them
  DataParallelOptions options_;
  std::vector<std::string> param_names_;  // dotted names, in slot order
  // Destroyed bottom up: the reducer's comm threads go before the communicator, the
  // recorder and the design they use.
  std::unique_ptr<parallel::Design> design_;  // DP, DDP or Sharded (Note [Designs])
  std::unique_ptr<parallel::PhaseRecorder> recorder_;
  std::unique_ptr<comm::Communicator> comm_;
  std::unique_ptr<parallel::WorkerPool> workers_;
  std::unique_ptr<parallel::Reducer> reducer_;
  std::vector<std::uint64_t> grad_hooks_;  // the reducer's post-accumulate hooks on device 0's parameters
  // Recorded at the start of every step's run; the workers' copies between devices
  // order after them (Note [Copy fences] in src/backend/backend.h).
  std::unique_ptr<backend::CopyFences> fences_;
  std::unique_ptr<Executor> executor_;
  std::int64_t updates_ = 0;  // optimizer steps run (check_replicas_every)
  bool require_sync_ = true;
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // outputs' grad_fns check it
  bool busy_ = false;
  std::int64_t handoff_base_ = 0;  // stats().handoffs counts from reset_stats()
  std::vector<std::int64_t> grad_bytes_base_;    // stats()' grad_bytes count from reset_stats()
  std::vector<std::int64_t> gather_bytes_base_;  // and its gather_bytes
};

}  // namespace dp
