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
// is a slice of the gradient buffer. A sharded set gives each copy a contiguous
// range of the buffers to step (Note [Sharded parameter sets]).
//
// Which copy a module's forward uses is chosen per thread (ReplicaBinding): a worker
// thread for device i binds copy i, so one module object serves every worker
// without cloning its structure. This header knows nothing of DataParallel, comm or
// optimizers.
//
//   auto params = net->parameters();            // flattens on first use
//   auto& set = *params.set();                  // one data + one grad buffer per copy
//   set.copy(0).grad.zero_();                   // zero_grad in one call
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dp/nn/copy_executor.h"
#include "dp/nn/process_exchange.h"
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
  std::int64_t offset = 0;          // element offset in the flat buffers
  int unit = -1;                    // its group in the set's view provider, else -1 (Note [View providers])
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
                // undefined while released (sharded gradients, between backward passes)
  /// DP mode's replicas: refreshed from the primary before each forward, never
  /// stepped by an optimizer. DDP and Sharded copies are persistent (transient = false).
  bool transient = false;
  /// [begin, end): the range of the flat buffers an optimizer step of this copy
  /// updates — all of them, except in a sharded set, where it is the copy's shard.
  std::int64_t begin = 0, end = 0;
  /// Sharded gradients: the summed gradient of [begin, end) ((end - begin) float32)
  /// while `grad` is released (between backward passes). Undefined otherwise.
  Tensor shard_grad;
  /// The gradient an optimizer step of this copy reads: element i of the flat buffers
  /// (begin <= i < end) is owned_grad()[i - begin]. shard_grad when defined, else grad.
  Tensor owned_grad() const;
  /// The parameters an optimizer step of this copy writes: element i (begin <= i <
  /// end) is owned_data()[i - begin]. `data` is the whole flat buffer, or, when a
  /// runtime keeps only the copy's range (Note [View providers]), exactly [begin, end).
  Tensor owned_data() const;
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
  /// dp::Error on a sharded set (add every copy first).
  int add_copy(Device device, bool transient);
  /// Drops every copy but the primary (unsharding first).
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

  /// Note [Sharded parameter sets]
  /// shard() splits the flat buffers into num_copies() contiguous ranges of equal
  /// length S, copy r owning [r*S, (r+1)*S) (clipped to the padded buffer): an
  /// optimizer step of copy r updates only that range and keeps optimizer state only
  /// for it. Ranges are element-exact, not whole parameters: one parameter may span
  /// two copies, and every copy owns the same number of elements, however unequal the
  /// parameters are (whole-parameter ranges would give one copy the MLP's 1024x1024
  /// weight, 56% of the model). S is rounded up to kShardAlign elements (a cache
  /// line, and aligned vector loads on a GPU), and the buffers are padded with zeros
  /// to num_copies() * S, so that every range has the same length and an equal-count
  /// all-gather reassembles the parameters. The padding belongs to no parameter: no
  /// optimizer steps it and no gradient reaches it.
  /// Whatever gradient copy 0 holds is handed out by range: copy r's buffer holds
  /// copy 0's values on its own range and zeros elsewhere, so the sum over copies is
  /// unchanged. With `shard_grads` (ZeRO stage 2) each copy keeps between backward
  /// passes only the gradient of its range, in shard_grad, and a full gradient buffer
  /// only while a backward needs it: acquire_grad before the backward, release_grad
  /// once its buckets were reduced; the parameters' .grad are undefined between.
  /// Across processes (Note [World ranks] in dp/comm/communicator.h) the ranges are
  /// cut for `world` copies in all, this set's copy r owning world range `first` + r;
  /// 0 (the default) means this set's copies are all there are.
  /// Throws dp::Error when already sharded or when a copy is transient.
  void shard(bool shard_grads, int world = 0, int first = 0);
  /// The ranges the buffers were cut into: num_copies(), or more when the other
  /// ranges belong to copies in other processes.
  int shard_world() const { return shard_world_; }
  /// True when shard() gave ranges to copies in other processes: this process holds
  /// only its own copies' ranges (Note [Ranges across processes]).
  bool sharded_across_processes() const { return sharded_ && shard_world_ > num_copies(); }

  /// Note [Ranges across processes]
  /// A set sharded across processes keeps here only world ranges [first, first +
  /// num_copies()); the other ranges (their optimizer state, their gradients) live in
  /// the other processes, process p owning the contiguous world ranges [p *
  /// num_copies(), (p + 1) * num_copies()). Code of this layer and above it that
  /// needs a value of every range — an optimizer's state_dict, the total norm of
  /// clip_grad_norm_ — reaches the other processes through the set's process exchange
  /// (Note [Process exchange] in dp/nn/process_exchange.h): this layer does not speak
  /// to processes; the runtime that sharded the set across them installs it
  /// (DataParallel: dp::dist broadcasts, one per process, bounded by
  /// dp::dist::timeout(), Note [Fault policy]).
  /// The set holds the exchange and never owns it (the runtime clears it before it goes).
  void set_process_exchange(ProcessExchange* exchange) { process_exchange_ = exchange; }
  /// The exchange with the other processes of a set sharded across processes. Throws
  /// dp::Error when none is installed.
  ProcessExchange& process_exchange() const;
  /// Undoes shard(): every copy steps all of the buffers again and has a full
  /// gradient buffer; copy 0's gradient receives every other copy's range of its
  /// owned gradient, so after a synced backward it holds the whole summed gradient.
  void unshard();
  bool sharded() const { return sharded_; }
  bool shards_grads() const { return shard_grads_; }
  static constexpr std::int64_t kShardAlign = 16;  // floats: 64 bytes
  /// Sharded gradients: gives copy r a full gradient buffer — zeros, its own range
  /// taking over shard_grad (freed), so that gradients keep accumulating — and points
  /// copy r's .grad views at it. A no-op when copy r has one.
  void acquire_grad(int r);
  /// Sharded gradients: moves copy r's own range of its gradient buffer into
  /// shard_grad and frees the buffer (copy r's .grad become undefined).
  void release_grad(int r);
  /// Code that works on a copy's range (an optimizer step, clipping) indexes only
  /// owned_data() and owned_grad(), relative to `begin`: a runtime may keep in `data`
  /// only [begin, end) (stage 3, Note [View providers]), and `grad` is released
  /// between backward passes, so a flat index into either is out of range.

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

  /// Zeroes every copy's gradients: full buffers that exist and shard gradients.
  void zero_grad();
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
  void grow_buffers(int r, std::int64_t n);
  std::vector<std::shared_ptr<Parameter::Slot>> slots_;
  std::vector<ParameterCopy> copies_;
  std::int64_t numel_ = 0;
  std::int64_t buffer_numel_ = 0;
  bool sharded_ = false;
  std::uint64_t zero_grad_count_ = 0;
  bool shard_grads_ = false;
  int shard_world_ = 0;
  ViewProvider* view_provider_ = nullptr;
  std::uint64_t version_ = 0;
  bool valid_ = true;
  CopyExecutor* executor_ = nullptr;
  ProcessExchange* process_exchange_ = nullptr;
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

 private:
  std::vector<Tensor> tensors_;
  std::vector<std::shared_ptr<Parameter::Slot>> slots_;
  std::shared_ptr<ParameterSet> set_;
};

}  // namespace dp::nn
