// dp/optim/optimizer.h — the base of every optimizer: fused updates over flat buffers.
//
// Note [Fused optimizer steps]
// An optimizer is built over a ParameterList (see Note [Parameter sets]). It groups the
// list's parameters into contiguous ranges of their set's flat buffers (adjacent
// parameters merge; the whole set is one range) and keeps its state (momentum buffers,
// exp_avg, …) flat, one buffer per state name and per copy of the set, laid out like
// the ranges back to back. A step then calls ONE fused backend kernel per range and
// copy on slices of the copy's span (nn::copy_span: Note [Copy spans] in
// dp/nn/copy_spans.h), through the set's StepExecutor (Note [Copy executors] in
// dp/nn/copy_executor.h) — so under DataParallel's DDP mode each device's worker steps
// its own copy with its own state, and no optimizer knows about DataParallel. A copy
// steps only the part of the ranges inside its span: all of the buffers, except where
// a runtime cut them (Mode::Sharded, Note [Sharded parameter sets]), where each copy
// steps its range and keeps state for it alone.
// State is allocated lazily on the copy's device at its first step. Whenever a copy's
// range or buffers change (DDP wrapping after some steps, sharding, unsharding, the
// primary moving to another device, a load), its state is rebuilt from the states
// that exist, element by element, the primary's first (Note [Optimizer state
// layouts]). Every parameter in a set is stepped, also one whose gradient stayed zero
// (PyTorch would skip a parameter whose .grad is None).
// A list of loose tensors (no set) is stepped one tensor at a time; tensors without
// a gradient are skipped.
//
//   dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
//   opt.zero_grad();  loss.backward();  opt.step();
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/nn/module.h"
#include "dp/nn/parameter_set.h"
#include "dp/tensor/tensor.h"

namespace dp::optim {

/// Base class: range grouping, per-copy state, zero_grad, step driver, state_dict.
class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One update of every persistent copy of the parameters (see Note [Fused optimizer
  /// steps]). Throws dp::Error when the parameters were re-flattened since construction.
  void step();
  /// Zeroes the gradients of every copy (one call per flat range and copy).
  void zero_grad();

  /// Number of completed steps.
  std::int64_t step_count() const { return step_; }
  /// The learning rate (schedulers change it between steps).
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
  /// The momentum a cyclic scheduler varies (OneCycleLR): SGD's momentum, Adam's and
  /// AdamW's beta1 — PyTorch's param_group['momentum'] or param_group['betas'][0].
  /// nullopt for an optimizer without one.
  virtual std::optional<double> momentum() const { return std::nullopt; }
  /// Sets that momentum; throws dp::Error for an optimizer without one or a value its
  /// options reject.
  virtual void set_momentum(double momentum);
  /// The learning rate the first scheduler attached to this optimizer found (PyTorch's
  /// param_group['initial_lr']): later schedulers take it as their base lr. nullopt
  /// until a scheduler is attached.
  std::optional<double> initial_lr() const { return initial_lr_; }
  void set_initial_lr(std::optional<double> lr) { initial_lr_ = lr; }

  /// The parameters this optimizer updates.
  const nn::ParameterList& parameters() const { return params_; }

  /// "step" (int64 scalar) and, once state exists, "state.<i>.<name>" for parameter i
  /// of the list (its shape; values of copy 0), e.g. "state.0.exp_avg". In a sharded
  /// set the full tensors are assembled from every copy's shard (on copy 0's device).
  /// A set sharded across processes (Mode::Sharded stages 1 and 2 under mpirun) holds
  /// only this process's shards: the call is then COLLECTIVE — every process must make
  /// it (or the checkpoint save that makes it), and each gets the whole state, the same
  /// bits a single process holding every shard would assemble (Note [Optimizer state
  /// across processes]). A process that never calls it leaves the others waiting until
  /// dp::dist::timeout() ends the job.
  nn::StateDict state_dict();
  /// Restores a state_dict() of an optimizer of the same kind over parameters of the
  /// same shapes: every copy gets the values of its range (all of it, except sharded;
  /// across processes each process's copies take their ranges, nothing is exchanged).
  /// Throws dp::Error naming missing/unexpected keys or a wrong shape, before anything
  /// is written (match_state_dict in dp/nn/state_dict.h).
  void load_state_dict(const nn::StateDict& state);

 protected:
  /// `kind` names the optimizer in errors ("SGD", "Adam").
  Optimizer(nn::ParameterList params, std::string kind);

  /// Names of the per-element state buffers this optimizer keeps (may be empty).
  virtual std::vector<std::string> state_names() const = 0;
  /// Updates n elements in place on `dev`. state[k] points at state_names()[k]'s slice.
  /// first: the state was just allocated (zeros) for this copy. step: 1-based step count.
  virtual void update(Device dev, float* param, const float* grad, float* const* state,
                      std::int64_t n, bool first, std::int64_t step) = 0;

  const std::string& kind() const { return kind_; }

 private:
  /// A contiguous range [offset, offset + numel) of the set's flat buffers; its state
  /// lives at [state_offset, state_offset + numel) of each state buffer.
  struct Range {
    std::int64_t offset = 0, numel = 0, state_offset = 0;
  };
  /// Per-copy state: one flat buffer per state name (empty until the first step) over
  /// the optimizer's ranges clipped to the copy's span (Note [Copy spans]).
  struct CopyState {
    std::vector<Tensor> buffers;
    bool fresh = true;                // allocated as zeros and not stepped yet
    std::weak_ptr<Storage> data;      // the copy's data buffer these states belong to
    std::int64_t begin = 0, end = 0;  // the copy's span they cover
    std::vector<Range> ranges;        // ranges_ clipped to it; state_offset into `buffers`
    std::int64_t numel = 0;           // elements of each buffer
  };

  void check_valid() const;
  void prepare_states();
  /// Keeps the states of `old` whose copy is unchanged, rebuilds the others from
  /// `sources` (Note [Optimizer state layouts]).
  void rebuild_states(const std::vector<CopyState>& old, const std::vector<CopyState>& sources);
  CopyState layout(const nn::CopySpan& span) const;
  static void copy_state(CopyState& dst, const CopyState& src);
  void allocate_state(CopyState& st, Device dev, const Shape& shape);
  void step_copy(int r);
  void step_copies(nn::ParameterSet& set);
  void step_loose();
  /// The full state buffer of name k in ranges_' layout: copy 0's when it holds all
  /// of it, else assembled from every copy's (null when no state exists yet).
  Tensor full_state(std::size_t k);
  /// full_state of a set sharded across processes: collective (Note [Optimizer state
  /// across processes]).
  Tensor gathered_state(std::size_t k);

  nn::ParameterList params_;
  std::string kind_;
  std::vector<Range> ranges_;
  std::int64_t state_numel_ = 0;
  std::vector<std::int64_t> entry_state_offset_;  // per list entry (set case), in ranges_' layout
  std::vector<CopyState> states_;                 // per copy (set) or per tensor (loose)
  std::int64_t step_ = 0;
  std::optional<double> initial_lr_;
};

}  // namespace dp::optim
