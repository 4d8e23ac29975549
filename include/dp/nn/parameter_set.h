// dp/nn/parameter_set.h — parameters of a module tree in one flat buffer per device.
//
// Note [Parameter sets]
// A module tree's parameters form one ParameterSet. The set owns, per *copy*, a flat
// data buffer and a flat gradient buffer on that copy's device; every parameter
// tensor is a view into them. Copy 0 is the primary (the module's own parameters).
// DataParallel's DDP mode adds one persistent copy per further device; DP mode's
// replicas are transient copies refreshed before each forward. Because a parameter
// is a slice of a buffer, replicate/broadcast, reduce, all-reduce, the optimizer
// step and checkpoints are each one call over a buffer, and a DDP bucket is a
// slice of the gradient buffer.
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

 private:
  int prev_;
};

/// What a for_each_copy() call does to the copies: an executor may treat an
/// optimizer update differently (DataParallel checks that every replica is about to
/// apply the same gradient).
enum class CopyWork { Update, Other };

/// The flat buffers of one copy of a parameter set.
struct ParameterCopy {
  Device device;
  Tensor data;  // (numel) float32, every parameter of this copy is a view into it
  Tensor grad;  // (numel) float32, every parameter's .grad is a view into it
  /// DP mode's replicas: refreshed from the primary before each forward, never
  /// stepped by an optimizer. DDP copies are persistent (transient = false).
  bool transient = false;
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

  std::int64_t numel() const { return numel_; }
  std::size_t size() const { return slots_.size(); }
  const std::vector<std::shared_ptr<Parameter::Slot>>& slots() const { return slots_; }

  int num_copies() const { return static_cast<int>(copies_.size()); }
  ParameterCopy& copy(int r);
  const ParameterCopy& copy(int r) const;
  /// Adds copy r on `device` with the primary's current values; returns r.
  int add_copy(Device device, bool transient);
  /// Drops every copy but the primary.
  void drop_copies();
  /// Moves the primary copy to `device` (data and grad; views rebound in place).
  void move_primary(Device device);

  /// Runs fn(r) for every persistent (non-transient) copy r — what an optimizer
  /// steps. Default: in order on the calling thread. DataParallel installs an
  /// executor that runs each copy on its device's worker thread.
  void for_each_copy(const std::function<void(int copy)>& fn, CopyWork work = CopyWork::Other);
  using Executor = std::function<void(int num_copies, CopyWork work, const std::function<void(int)>& fn)>;
  void set_executor(Executor executor) { executor_ = std::move(executor); }

  /// Increments when the primary data is written by an optimizer step or a load.
  std::uint64_t version() const { return version_; }
  void bump_version() { ++version_; }

  /// False once the module tree was flattened again into a newer set.
  bool valid() const { return valid_; }
  void invalidate() { valid_ = false; }

 private:
  void bind_views(int r);
  std::vector<std::shared_ptr<Parameter::Slot>> slots_;
  std::vector<ParameterCopy> copies_;
  std::int64_t numel_ = 0;
  std::uint64_t version_ = 0;
  bool valid_ = true;
  Executor executor_;
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
