// dp/nn/parameter_set.h — parameters of a module tree in one flat buffer per device.
//
// Note [Parameter sets]
// A module tree's parameters form one ParameterSet. The set owns, per *copy*, a flat
// data buffer and a flat gradient buffer on that copy's device; every parameter
// tensor is a view into them. Copy 0 is the primary (the module's own parameters).
// DataParallel's DDP and Sharded modes add one persistent copy per further device;
// DP mode's replicas are transient copies refreshed before each forward. Because a
// parameter is a slice of a buffer, replicate/broadcast, reduce, all-reduce, the
// optimizer step and checkpoints are each one call over a buffer, and a DDP bucket
// is a slice of the gradient buffer. The set keeps the buffers, the views and the
// replica binding, nothing more: which part of the buffers each copy owns and how the
// processes holding the other parts are reached (Note [Copy spans]), where the work
// over every copy runs and how the views stay readable are a runtime's (DataParallel;
// Mode::Sharded's store, Note [Sharded parameter sets] in src/parallel/shard_store.h),
// which the set holds only as interfaces declared in nn — CopySpans, CopyExecutor,
// ViewProvider — and passes on.
//
// Which copy a module's forward uses is chosen per thread (ReplicaBinding): a worker
// thread for device i binds copy i, so one module object serves every worker
// without cloning its structure. This header knows nothing of DataParallel, comm,
// processes or optimizers.
//
//   auto params = net->parameters();            // flattens on first use
//   auto& set = *params.set();                  // one data + one grad buffer per copy
//   set.copy(0).grad.zero_();                   // zero_grad in one call
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/nn/copy_executor.h"
#include "dp/nn/copy_spans.h"
#include "dp/nn/view_provider.h"
#include "dp/tensor/tensor.h"

namespace dp::nn {

class ParameterSet;

/// One parameter of a module: a stable slot whose tensor depends on the calling
/// thread's replica binding. Converts implicitly to the bound Tensor.
class Parameter {
 public:
  Parameter() = default;
  /// The tensor of the copy bound on this thread (copy 0 when unbound).
  const Tensor& get() const;
  operator const Tensor&() const { return get(); }  // NOLINT: by design
  const Tensor* operator->() const { return &get(); }
  bool defined() const { return slot_ != nullptr; }

  struct Slot;
  explicit Parameter(std::shared_ptr<Slot> slot) : slot_(std::move(slot)) {}
  const std::shared_ptr<Slot>& slot() const { return slot_; }

 private:
  std::shared_ptr<Slot> slot_;
};

/// Per-parameter state behind a Parameter (internal).
struct Parameter::Slot {
  std::string name;                 // registration name within its module
  std::vector<Tensor> copies;       // copies[r] = view in copy r's flat buffer; [0] primary
  bool is_buffer = false;           // buffers are per-copy tensors, not in the flat buffer
  std::weak_ptr<ParameterSet> set;  // owning set (parameters only)
  /// A backward reached this parameter on some copy since the gradients were last set
  /// to none (Note [Parameters without a gradient] in dp/optim/optimizer.h).
  bool got_grad = false;
  std::int64_t offset = 0;          // element offset in the flat buffers
  int unit = -1;                    // its group in the set's view provider, else -1 (Note [View providers])
  /// Set when the parameter was tied to another (Module::share_parameter): a handle to
  /// this slot then reads that one's, and this slot holds no tensor of its own.
  std::shared_ptr<Slot> tied;
  /// Note [Compute copies]: compute[r] views copy r's compute buffer (undefined: the
  /// copy computes with copies[r] itself); compute_reads[r] is what get() handed copy
  /// r's worker since ParameterSet::forget_compute_reads(r), with its cast node. A
  /// buffer's compute[r] is a runtime's copy of it in another dtype, read the same way
  /// on a bound thread (DataParallel's buffer_dtype).
  std::vector<Tensor> compute;
  std::vector<Tensor> compute_reads;
};

/// Selects, for the calling thread, which copy Parameter::get() returns. RAII.
class ReplicaBinding {
 public:
  explicit ReplicaBinding(int copy);
  ~ReplicaBinding();
  ReplicaBinding(const ReplicaBinding&) = delete;
  ReplicaBinding& operator=(const ReplicaBinding&) = delete;
  /// The calling thread's bound copy (0 when none).
  static int current();
  /// True inside a binding (a DataParallel worker), false on the user's threads.
  static bool bound();

 private:
  int prev_;
  bool prev_bound_;
};

/// The flat buffers of one copy of a parameter set.
struct ParameterCopy {
  Device device;
  Tensor data;  // (buffer_numel) float32, every parameter of this copy is a view into it
  Tensor grad;  // (buffer_numel) float32, every parameter's .grad is a view into it;
                // undefined while a runtime released it (Note [Copy spans])
  /// DP mode's replicas: refreshed from the primary before each forward, never
  /// stepped by an optimizer. DDP and Sharded copies are persistent (transient = false).
  bool transient = false;
  /// The parameters as the copy's worker computes with them, in the set's
  /// compute_dtype() (Note [Compute copies]); undefined when they compute in float32.
  /// Mode::Sharded stage 3 keeps here the copy's own range only (like `data`), which the
  /// other copies gather from (Note [Sharded compute units] in src/parallel/shard_store.h).
  Tensor compute;
};

/// Note [Compute copies]
/// A runtime may give every copy a second, lower-precision copy of its parameters to
/// compute with (DataParallel's mixed_precision.param_dtype, FSDP's MixedPrecision):
/// the float32 `data` stays the master that optimizers step and the user reads, and on
/// a bound thread (ReplicaBinding) Parameter::get() returns the parameter's view of the
/// copy's compute buffer instead. The first read of a parameter since
/// forget_compute_reads(r) makes that view a node of the graph (ComputeCastBackward):
/// its gradient, computed in the compute dtype, comes back widened into the float32
/// leaf's .grad, so post-accumulate hooks, gradient buffers and optimizers see float32
/// as always. The node is made at the first read (not once for good), so backward meets
/// it right after the ops that used the parameter, and the gradient is ready as early
/// as a float32 parameter's; reads of one parameter in one forward share it, so their
/// gradients add up in the compute dtype first, as a 16-bit parameter's would. Which
/// parameters compute in the dtype (a BatchNorm's stay float32) and how each copy's
/// compute buffer is filled (cast locally, broadcast, gathered per unit) is the
/// runtime's; the set keeps the views and hands them out. Threads that are not bound
/// (the user's) always read the float32 master.
///
///   set.set_compute_dtype(dp::Dtype::BFloat16);
///   set.set_compute_view(r, i, buffer16.narrow(0, offset, numel).reshape(shape));
///   { dp::nn::ReplicaBinding bind(r); net->forward(x); }   // reads the bf16 views

/// The dtype the calling thread's bound copy computes in (Note [Compute copies]), set by
/// the runtime around its workers' forward; nullopt when parameters are read as stored.
/// A module whose parameters stay float32 under it (BatchNorm2d) returns its input's
/// dtype, as FSDP casts such a module's output back.
std::optional<Dtype> compute_dtype();
/// RAII: sets compute_dtype() on this thread for its lifetime.
class ComputeDtypeGuard {
 public:
  explicit ComputeDtypeGuard(std::optional<Dtype> dtype);
  ~ComputeDtypeGuard();
  ComputeDtypeGuard(const ComputeDtypeGuard&) = delete;
  ComputeDtypeGuard& operator=(const ComputeDtypeGuard&) = delete;

 private:
  std::optional<Dtype> prev_;
};

/// All parameters of a module tree, flattened (see Note [Parameter sets]).
class ParameterSet : public std::enable_shared_from_this<ParameterSet> {
 public:
  /// Builds the set over `slots` (registration order): allocates the flat buffers on
  /// `device`, copies each parameter in and rebinds it (in place: existing Tensor
  /// handles see the flat storage). Gradients become zero views of the grad buffer.
  /// Use ParameterSet::create (the set must be owned by a shared_ptr).
  static std::shared_ptr<ParameterSet> create(std::vector<std::shared_ptr<Parameter::Slot>> slots,
                                              Device device);
  ParameterSet(std::vector<std::shared_ptr<Parameter::Slot>> slots, Device device);
  ~ParameterSet();
  ParameterSet(const ParameterSet&) = delete;
  ParameterSet& operator=(const ParameterSet&) = delete;

  /// Elements of all parameters.
  std::int64_t numel() const { return numel_; }
  /// Elements of every copy's flat buffers: numel(), or more once sharded (padding).
  std::int64_t buffer_numel() const { return buffer_numel_; }
  std::size_t size() const { return slots_.size(); }
  const std::vector<std::shared_ptr<Parameter::Slot>>& slots() const { return slots_; }

  int num_copies() const { return static_cast<int>(copies_.size()); }
  ParameterCopy& copy(int r);
  const ParameterCopy& copy(int r) const;
  /// Adds copy r on `device` with the primary's current values; returns r. Throws
  /// dp::Error while the copies own parts of the buffers (spans_cut; add every copy first).
  int add_copy(Device device, bool transient);
  /// Drops every copy but the primary. Throws dp::Error while the copies own parts.
  void drop_copies();
  /// Moves the primary copy to `device` (data and grad; views rebound in place).
  void move_primary(Device device);

  /// Runs fn(r) for every persistent (non-transient) copy r: gradient work (zero_grad,
  /// clipping). Through the executor when one is set (Note [Copy executors]), else in
  /// order on the calling thread.
  void for_each_copy(const std::function<void(int copy)>& fn, CopyWork work = CopyWork::Gradients);
  /// The runtime that runs work on every copy (DataParallel), or null: the set holds
  /// it and passes it on, never owns it (the runtime clears it before it goes).
  void set_executor(CopyExecutor* executor) { executor_ = executor; }
  CopyExecutor* executor() const { return executor_; }

  /// The runtime that says which part of the buffers each copy owns (Note [Copy
  /// spans]; read it through copy_span()), or null: every copy owns all of them. The
  /// set holds it and never owns it (the runtime clears it before it goes).
  void set_spans(CopySpans* spans) { spans_ = spans; }
  CopySpans* spans() const { return spans_; }
  /// Pads every copy's buffers with zeros to n elements (views rebound in place).
  /// Throws dp::Error when n < buffer_numel().
  void pad_buffers(std::int64_t n);
  /// Makes `grad` copy r's gradient buffer (undefined: none) and points copy r's
  /// .grad views at it.
  void set_grad_buffer(int r, Tensor grad);

  /// The runtime that keeps the parameter views readable (Note [View providers]), or
  /// null. The set holds it and never owns it (the runtime clears it before it goes).
  void set_view_provider(ViewProvider* provider) { view_provider_ = provider; }
  ViewProvider* view_provider() const { return view_provider_; }
  /// Every view of the primary readable (Module's parameters(), state_dict()): asks the
  /// view provider, if any.
  void make_primary_readable() const;
  /// Points copy r's view of slots()[i] at element `offset` of `buffer`, in place, so
  /// that handles held anywhere (autograd's saved tensors too) see the new storage.
  void rebind_view(int r, std::size_t i, const Tensor& buffer, std::int64_t offset);

  /// Note [Compute copies]: the dtype the copies compute in (nullopt: their own).
  std::optional<Dtype> compute_dtype() const { return compute_dtype_; }
  void set_compute_dtype(std::optional<Dtype> dtype) { compute_dtype_ = dtype; }
  /// Makes `view` (of compute_dtype(), or of the parameter's own dtype for one that keeps
  /// it, and of slots()[i]'s shape) what copy r's worker reads of slots()[i]; an
  /// undefined view: the copy computes with the float32 parameter itself.
  void set_compute_view(int r, std::size_t i, Tensor view);
  /// Copy r's next reads make fresh cast nodes (call before each forward of copy r).
  void forget_compute_reads(int r);
  /// Every copy computes with its float32 parameters again: views and buffers dropped.
  void drop_compute();

  /// Every copy's parameters require grad as the primary's do (Note [Frozen
  /// parameters]): a runtime calls it before its workers' forward, so a parameter frozen
  /// or unfrozen through parameters() is frozen or unfrozen on every device.
  void follow_primary_requires_grad();

  /// Zeroes every copy's gradients: its gradient buffer, or while a runtime released it,
  /// the gradient of its span the runtime keeps (Note [Copy spans]). `set_to_none`
  /// also clears every slot's got_grad (Note [Parameters without a gradient]).
  void zero_grad(bool set_to_none = true);
  /// Drops the .grad a backward gave a parameter of `slots` on a copy whose gradient
  /// buffer a runtime released (Sharded stages 2 and 3): no range takes such a gradient
  /// (a forward through the module itself, outside the runtime), and the runtime refuses
  /// a step or backward while one is there; zero_grad clears it.
  void drop_stray_grads(const std::vector<std::shared_ptr<Parameter::Slot>>& slots);
  /// Moves the marks of the gradients that arrived in every copy's leaves since the last
  /// call into their slots' got_grad (Note [Parameters without a gradient]).
  void collect_arrived_grads();
  /// Counts the calls that zeroed every gradient of every copy (zero_grad(), an
  /// optimizer's zero_grad over the whole set): a runtime can tell that gradients
  /// it combined were cleared since.
  std::uint64_t zero_grad_count() const { return zero_grad_count_; }
  /// Also marks every copy's parameters' .grad as all +0 (Note [Gradients added in place]).
  void count_zero_grad();

  /// Increments when the primary data is written by an optimizer step or a load.
  std::uint64_t version() const { return version_; }
  void bump_version() { ++version_; }

  /// False once the module tree was flattened again into a newer set.
  bool valid() const { return valid_; }
  void invalidate() { valid_ = false; }

 private:
  void bind_views(int r);
  void bind_grad_views(int r);
  std::vector<std::shared_ptr<Parameter::Slot>> slots_;
  std::vector<ParameterCopy> copies_;
  std::int64_t numel_ = 0;
  std::int64_t buffer_numel_ = 0;
  std::uint64_t zero_grad_count_ = 0;
  ViewProvider* view_provider_ = nullptr;
  std::uint64_t version_ = 0;
  bool valid_ = true;
  CopyExecutor* executor_ = nullptr;
  CopySpans* spans_ = nullptr;
  std::optional<Dtype> compute_dtype_;
};

/// The parameters of a module tree: the primary copy's tensors plus their set.
/// Behaves like a std::vector<Tensor> for iteration and indexing.
class ParameterList {
 public:
  ParameterList() = default;
  ParameterList(std::vector<Tensor> tensors, std::vector<std::shared_ptr<Parameter::Slot>> slots,
                std::shared_ptr<ParameterSet> set)
      : tensors_(std::move(tensors)), slots_(std::move(slots)), set_(std::move(set)) {}

  std::size_t size() const { return tensors_.size(); }
  bool empty() const { return tensors_.empty(); }
  const Tensor& operator[](std::size_t i) const { return tensors_[i]; }
  auto begin() const { return tensors_.begin(); }
  auto end() const { return tensors_.end(); }
  /// Mutable elements, so that `for (auto& p : net->parameters()) p.fill_(0.0);` compiles
  /// as in libtorch: an in-place op writes into the module's parameter. Assigning
  /// another tensor to an element changes this list only, never the module.
  Tensor& operator[](std::size_t i) { return tensors_[i]; }
  auto begin() { return tensors_.begin(); }
  auto end() { return tensors_.end(); }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  operator const std::vector<Tensor>&() const { return tensors_; }  // NOLINT
  const std::vector<std::shared_ptr<Parameter::Slot>>& slots() const { return slots_; }
  /// The set these parameters live in (null for a list of loose tensors).
  const std::shared_ptr<ParameterSet>& set() const { return set_; }
  /// The entries for which keep(tensor) is true, in order, with their slots and set: a
  /// parameter group of an optimizer (Note [Parameter groups] in dp/optim/optimizer.h).
  ///   auto matrices = net->parameters().filter([](const Tensor& p) { return p.dim() >= 2; });
  ParameterList filter(const std::function<bool(const Tensor&)>& keep) const;

 private:
  std::vector<Tensor> tensors_;
  std::vector<std::shared_ptr<Parameter::Slot>> slots_;
  std::shared_ptr<ParameterSet> set_;
};

}  // namespace dp::nn
