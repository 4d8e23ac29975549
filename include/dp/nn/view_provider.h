// dp/nn/view_provider.h — what keeps a parameter's views readable when their storage
// comes and goes.
//
// Note [View providers]
// A runtime may keep a copy's parameter views in storage it releases between uses
// (Note [Released storage] in dp/tensor/tensor.h): Mode::Sharded stage 3 keeps each
// device's range of the parameters only and gathers a group of parameters — a gather
// unit, one top-level child — just before it is read (Note [Sharded parameters] in
// src/parallel/designs/sharded_units.cpp). The runtime marks each parameter with its
// group (Parameter::Slot::unit) and installs itself on the set as its ViewProvider;
// Parameter::get() then reports every read of a marked parameter to it, which may
// gather the group first, and Module's parameters(), named_parameters() and
// state_dict() ask it to make every view of the primary readable. nn declares the
// interface and calls it; the runtime (dp::parallel::ShardStore) implements it: no
// layer calls a function a higher one installed (Note [Copy executors] in
// dp/nn/copy_executor.h). This header knows nothing of sharding, devices or threads.
//
//   const Tensor& w = linear->weight;   // Parameter::get(): provider->before_read(copy, unit)
#pragma once

namespace dp::nn {

/// Makes a set's parameter views readable before they are read (Note [View providers]).
class ViewProvider {
 public:
  virtual ~ViewProvider() = default;
  /// Parameter::get() of a parameter of group `unit`: on a thread bound to copy
  /// `copy` (a worker), or, with copy < 0, on an unbound thread (user code, which
  /// reads the primary). Runs on the reading thread.
  virtual void before_read(int copy, int unit) = 0;
  /// Every view of the primary copy is about to be read (user access to the module's
  /// parameters between steps).
  virtual void make_primary_readable() = 0;
};

}  // namespace dp::nn
