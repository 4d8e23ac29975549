// dp/optim/optimizer.h — the base of every optimizer: fused updates over flat buffers.
//
// Note [Fused optimizer steps]
// An optimizer is built over a ParameterList (see Note [Parameter sets]). It groups the
// list's parameters into contiguous ranges of their set's flat buffers (adjacent
// parameters of one parameter group merge; the whole set in one group is one range;
// Note [Parameter groups]) and keeps its state (momentum buffers,
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
// layouts]). Every parameter in a set that requires grad is stepped, also one whose
// gradient stayed zero (PyTorch would skip a parameter whose .grad is None); one that
// does not (frozen) is left alone, values and state (Note [Frozen parameters in a step]).
// A list of loose tensors (no set) is stepped one tensor at a time; tensors without
// a gradient are skipped.
//
//   dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9});
//   opt.zero_grad();  loss.backward();  opt.step();
//
// Note [Parameter groups]
// As in PyTorch, an optimizer may be built over several parameter groups, each with
// its own hyper-parameters: a group is a list of parameters and the options it sets
// (SGDGroupOptions, AdamGroupOptions: every field optional); a field it leaves unset
// takes the value of the options passed beside the groups. nanoGPT's AdamW, weight
// decay on matrices only:
//
//   auto params = model.parameters();
//   auto matrices = params.filter([](const dp::Tensor& p) { return p.dim() >= 2; });
//   auto others = params.filter([](const dp::Tensor& p) { return p.dim() < 2; });
//   dp::optim::AdamW opt({{matrices, {.weight_decay = 0.1}}, {others, {.weight_decay = 0.0}}},
//                        {.lr = 6e-4, .betas = {0.9, 0.95}});
//   opt.set_group_lr(1, 3e-4);                        // opt.param_groups[1]['lr'] = 3e-4
//   dp::optim::AdamOptions o = opt.options(1);        // group 1's options, every field set
//
// An optimizer built over one list has one group. Parameters are numbered across the
// groups in order (group 0's first), as PyTorch numbers them in state_dict(); a
// parameter belongs to one group. Every group's parameters live in one parameter set
// (or are all loose tensors). Each range of the flat buffers belongs to one group:
// ranges merge only within a group, and the fused kernel of a range gets its group's
// hyper-parameters; a sharded copy's [begin, end) may cut through several groups and
// steps each piece with its own. lr() and momentum() read group 0's, set_lr() and
// set_momentum() write every group's (a manual schedule's `for g in param_groups:
// g['lr'] = lr`); the schedulers of dp/optim/lr_scheduler.h step every group from its
// own base lr. state_dict() holds the tensors (per parameter, whatever its group);
// param_groups_state() holds the groups (their parameters and hyper-parameters,
// PyTorch's state_dict()["param_groups"]); a training checkpoint saves both.
//
// Note [Optimizer state starts]
// PyTorch creates a parameter's state at its first step that uses it: SGD's
// momentum_buffer at the first step with momentum (buf = g, undampened), and none
// at all while the group has no momentum. dp's buffers cover every group, so it keeps
// per group and per copy whether the group's state has started (group_uses_state:
// SGD's momentum ≠ 0; Adam's always), and update()'s `first` is true until it has.
// A group given momentum after another group's buffer already exists thus starts its
// buffer as PyTorch does; and within a set each entry records its own start, so an
// entry frozen or unreached when its group's momentum began starts its buffer at its
// own first step with momentum, from the gradient itself. state_dict() lists the state
// of the entries that have started only (in a group started on any copy of any
// process), as PyTorch's lists the parameters that have state, and load_state_dict()
// starts exactly the entries it is given (each with every name of its state: a
// momentum_buffer, or exp_avg and exp_avg_sq), the others afresh. State dicts from
// before entries were listed on their own hold a started group whole and load as
// started where an entry has stepped, as they did (an entry that stepped only while
// its group had no momentum then reads as started, a zero buffer, where PyTorch has
// none); state dicts from before groups started on their own hold every group.
// A started state stays when the group's momentum is set to 0
// (PyTorch keeps the momentum_buffer in its state while unused, and takes it up again
// when momentum returns): SGD keeps its buffers, in its steps and in state_dict(), once
// any group has had momentum or a loaded state held a buffer. Before, a state_dict()
// saved while every group's momentum was 0 dropped them, so a resumed run restarted
// the buffers where the uninterrupted one (and PyTorch) continued them (found by the
// optimizer fuzzer, Note [Optimizer fuzzer]).
//
// Note [Frozen parameters in a step]
// A parameter that does not require grad (set_requires_grad(false): a frozen backbone or
// embedding) is not stepped: PyTorch leaves its .grad None, and its optimizers skip it,
// weight decay and momentum included. dp's gradient buffers hold zeros for it instead,
// so each step reads every entry's requires_grad (the module's parameter, what the user
// froze) and steps only the runs of the buffers whose entries require grad, on every
// copy (Note [Frozen parameters] in src/nn/parameter_set.cpp). PyTorch counts an Adam
// step per parameter, from its first step with a gradient; so does dp: each entry keeps
// the steps taken while it was frozen, and its own count (what Adam's bias correction
// uses) is the optimizer's minus those. An entry unfrozen after frozen steps starts its
// state as PyTorch does at its first step (SGD's momentum_buffer = g), and state_dict()
// gives it a "state.<i>.step" entry of its own count (PyTorch's per-parameter "step"),
// which load_state_dict() takes back; entries never frozen follow the optimizer's
// "step". Freeze the same parameters on every process of a job.
//
// Note [Parameters without a gradient]
// PyTorch's zero_grad() sets each .grad to None (set_to_none=True, its default since
// 2.0), and a backward that does not reach a parameter (a head of a multi-task model
// that this batch skipped, a branch not taken) leaves it None: its optimizers skip
// that parameter in that step, weight decay, momentum and Adam's step count included.
// dp's gradients live in flat buffers, so a .grad is never undefined; instead the
// engine marks a leaf when a gradient arrives in it (AccumulateGrad), and each
// parameter's slot keeps whether one arrived on any copy since zero_grad(true)
// (ParameterSet::collect_arrived_grads folds the marks in). A step skips every entry
// whose slot got none, as it skips a frozen one (Note [Frozen parameters in a step]):
// the entry's own step count stays put and its state starts at its first step with a
// gradient. zero_grad(false) keeps the marks, as PyTorch's set_to_none=False keeps a
// defined .grad: a parameter that once had a gradient is stepped, with zeros when no
// gradient came. Tensor::set_grad(g), PyTorch's `p.grad = g`, writes g into the view
// and marks it arrived (autograd::assign_pinned_grad). A value written into the .grad
// view in place does not count: after zero_grad(true) it is stepped only if a
// backward reached the parameter (PyTorch code cannot write into a None .grad either;
// zero_grad(false) steps it). In one process the step reads every copy's marks
// (DataParallel's replicas are copies of the set); across processes DataParallel takes
// their union after each synced backward (one host all-reduce of a flag per
// parameter), so that every replica and every shard owner skips the same parameters.
// Loose tensors (no parameter set) are PyTorch's case exactly: zero_grad(true) makes
// their .grad undefined, and a step skips those still undefined, counting the skip.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dp/nn/module.h"
#include "dp/nn/parameter_set.h"
#include "dp/tensor/tensor.h"

namespace dp::optim {

/// A parameter group given to an optimizer (Note [Parameter groups]): parameters and the
/// hyper-parameters they take instead of the optimizer's, `Overrides` being the
/// optimizer's struct of optional fields (SGDGroupOptions, AdamGroupOptions).
///   {matrices, {.weight_decay = 0.1}}
template <typename Overrides>
struct ParamGroup {
  /// Parameters of a module (a ParameterList or ParameterList::filter of one).
  ParamGroup(nn::ParameterList params, Overrides options = {})  // NOLINT: {params, {...}} reads as PyTorch's dict
      : params(std::move(params)), options(options) {}
  /// Loose tensors (no parameter set): stepped one by one, as a list of them is.
  ParamGroup(std::vector<Tensor> params, Overrides options = {})  // NOLINT
      : params(std::move(params), {}, nullptr), options(options) {}
  nn::ParameterList params;
  Overrides options;
};

/// One parameter group as PyTorch's optimizer.state_dict()["param_groups"] lists it
/// (Optimizer::param_groups_state): which parameters and their hyper-parameters.
struct ParamGroupState {
  /// The group's parameters: indices into the optimizer's parameters().
  std::vector<std::int64_t> params;
  /// Hyper-parameters by PyTorch's names, each a list of numbers: "lr" {1e-3}, "betas"
  /// {0.9, 0.999}, "nesterov" {0} or {1}; "initial_lr" once a scheduler recorded it.
  std::map<std::string, std::vector<double>> options;
};

/// Base class: range grouping, per-copy state, zero_grad, step driver, state_dict.
class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One update of every persistent copy of the parameters (see Note [Fused optimizer
  /// steps]). Throws dp::Error when the parameters were re-flattened since construction.
  void step();
  /// Zeroes the gradients of every copy (one call per flat range and copy). With
  /// `set_to_none` (PyTorch's default) the next step skips each of these parameters
  /// that no backward reaches before it, as PyTorch skips a None .grad; false: every
  /// parameter that had a gradient is stepped, with zeros if none came (Note
  /// [Parameters without a gradient]). A loose tensor's .grad becomes undefined.
  void zero_grad(bool set_to_none = true);

  /// Number of completed steps.
  std::int64_t step_count() const { return step_; }
  /// The learning rate (schedulers change it between steps): group 0's; set_lr sets
  /// every group's (Note [Parameter groups]).
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;
  /// The momentum a cyclic scheduler varies (OneCycleLR): SGD's momentum, Adam's and
  /// AdamW's beta1 — PyTorch's param_group['momentum'] or param_group['betas'][0].
  /// nullopt for an optimizer without one. Group 0's; set_momentum sets every group's.
  virtual std::optional<double> momentum() const { return std::nullopt; }
  /// Sets that momentum; throws dp::Error for an optimizer without one or a value its
  /// options reject.
  virtual void set_momentum(double momentum);
  /// The learning rate the first scheduler attached to this optimizer found (PyTorch's
  /// param_group['initial_lr']): later schedulers take it as their base lr. nullopt
  /// until a scheduler is attached. Per group; without a group: group 0's, and every
  /// group's for the setter.
  std::optional<double> initial_lr(std::size_t group = 0) const;
  void set_initial_lr(std::optional<double> lr);
  void set_initial_lr(std::size_t group, std::optional<double> lr);

  /// The parameters this optimizer updates: every group's, group 0's first.
  const nn::ParameterList& parameters() const { return params_; }

  // ---- parameter groups (Note [Parameter groups]) ----------------------------------
  /// Number of parameter groups (1 for an optimizer built over one list).
  std::size_t num_param_groups() const { return groups_.size(); }
  /// The parameters of group g, as given. Throws dp::Error for g out of range.
  const nn::ParameterList& group_parameters(std::size_t group) const;
  /// Group g's learning rate (PyTorch's param_groups[g]['lr']). The defaults serve an
  /// optimizer with one group: lr() and set_lr().
  virtual double group_lr(std::size_t group) const;
  /// Sets group g's learning rate; dp::Error for a value its options reject.
  virtual void set_group_lr(std::size_t group, double lr);
  /// Group g's momentum (as momentum()); the defaults call momentum() and set_momentum().
  virtual std::optional<double> group_momentum(std::size_t group) const;
  virtual void set_group_momentum(std::size_t group, double momentum);
  /// Every group's parameters (indices into parameters()) and hyper-parameters: PyTorch's
  /// state_dict()["param_groups"]. What state_dict() leaves out; a training checkpoint
  /// saves both.
  std::vector<ParamGroupState> param_groups_state() const;
  /// Restores param_groups_state() of an optimizer of the same kind over the same
  /// groups: every group's hyper-parameters (and initial_lr) become the saved ones.
  /// Throws dp::Error, changing nothing, for another number of groups, a group of other
  /// parameters, missing or unknown hyper-parameters, or a value the options reject.
  void load_param_groups_state(const std::vector<ParamGroupState>& groups);

  /// "step" (int64 scalar) and, once state exists, "state.<i>.<name>" for parameter i
  /// of parameters() (its shape; values of copy 0), e.g. "state.0.exp_avg"; the groups'
  /// hyper-parameters are in param_groups_state(). In a sharded
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
  /// Over parameter groups (Note [Parameter groups]): at least one, none empty, every
  /// group's parameters in one parameter set (or all loose), no parameter twice.
  Optimizer(std::vector<nn::ParameterList> groups, std::string kind);
  /// The parameter lists of `groups`, for the constructor above.
  template <typename Overrides>
  static std::vector<nn::ParameterList> lists_of(const std::vector<ParamGroup<Overrides>>& groups) {
    std::vector<nn::ParameterList> out;
    for (const ParamGroup<Overrides>& g : groups) out.push_back(g.params);
    return out;
  }

  /// Names of the per-element state buffers this optimizer keeps (may be empty).
  virtual std::vector<std::string> state_names() const = 0;
  /// Called by load_state_dict() before it reads state_names(): an optimizer whose state
  /// names depend on what it has seen (SGD's momentum_buffer) learns of the loaded ones.
  virtual void before_load(const nn::StateDict& /*state*/) {}
  /// Updates n elements in place on `dev`. state[k] points at state_names()[k]'s slice.
  /// first: the state of these elements' group was never stepped on this copy (it is
  /// zeros; see group_uses_state). step: 1-based step count.
  /// An optimizer with one group may override this one only.
  virtual void update(Device dev, float* param, const float* grad, float* const* state,
                      std::int64_t n, bool first, std::int64_t step);
  /// update() of n elements of group `group`, with that group's hyper-parameters. The
  /// default calls update() (one set of hyper-parameters).
  virtual void update_group(std::size_t group, Device dev, float* param, const float* grad, float* const* state,
                            std::int64_t n, bool first, std::int64_t step);
  /// Whether a step of group g reads and writes its state (SGD: only with momentum).
  /// A group's state starts (update's `first`) at its first step that does, as
  /// PyTorch's state entries appear then. The default: always.
  virtual bool group_uses_state(std::size_t /*group*/) const { return true; }
  /// Group g's hyper-parameters by PyTorch's names (ParamGroupState::options, without
  /// "initial_lr"). The default: "lr" and, when momentum() has a value, "momentum".
  virtual std::map<std::string, std::vector<double>> group_options(std::size_t group) const;
  /// Sets group g's hyper-parameters from group_options()' form: dp::Error naming what
  /// is missing, unknown or rejected (then nothing is changed).
  virtual void set_group_options(std::size_t group, const std::map<std::string, std::vector<double>>& options);
  /// "SGD" for an optimizer with one group, "SGD param group 1" with several: what a
  /// group's errors name.
  std::string group_name(std::size_t group) const;
  /// Throws dp::Error unless group < num_param_groups().
  void check_group(std::size_t group, const char* what) const;
  /// Throws dp::Error naming the hyper-parameters `given` lacks or has beyond `own`
  /// (group_options' names), or a wrong number of values: set_group_options' first check.
  void check_option_names(std::size_t group, const std::map<std::string, std::vector<double>>& own,
                          const std::map<std::string, std::vector<double>>& given) const;

  const std::string& kind() const { return kind_; }

 private:
  /// A contiguous range [offset, offset + numel) of the set's flat buffers; its state
  /// lives at [state_offset, state_offset + numel) of each state buffer.
  struct Range {
    std::int64_t offset = 0, numel = 0, state_offset = 0;
    std::size_t group = 0;  // the parameter group its elements belong to
  };
  /// A group: its parameters as given, their first index in params_, its initial_lr.
  struct Group {
    nn::ParameterList params;
    std::size_t first = 0;
    std::optional<double> initial_lr;
  };
  /// Per-copy state: one flat buffer per state name (empty until the first step) over
  /// the optimizer's ranges clipped to the copy's span (Note [Copy spans]).
  struct CopyState {
    std::vector<Tensor> buffers;
    std::vector<bool> started;        // per group: its state has started (Note [Optimizer state starts])
    std::weak_ptr<Storage> data;      // the copy's data buffer these states belong to
    std::int64_t begin = 0, end = 0;  // the copy's span they cover
    std::vector<Range> ranges;        // ranges_ clipped to it; state_offset into `buffers`
    std::int64_t numel = 0;           // elements of each buffer
  };

  void check_valid() const;
  /// params_ and groups_ from the groups given; checks them (Note [Parameter groups]).
  void join_groups(std::vector<nn::ParameterList> groups);
  /// ranges_ (each within one group), entry_state_offset_ and flat_ranges_ of a set.
  void build_ranges();
  /// The group of parameters() entry i.
  std::size_t group_of(std::size_t entry) const;
  /// Per group: whether its state has started on any copy of any process (Note
  /// [Optimizer state starts]). Collective across processes.
  std::vector<bool> groups_started();
  void prepare_states();
  /// Keeps the states of `old` whose copy is unchanged, rebuilds the others from
  /// `sources` (Note [Optimizer state layouts]).
  void rebuild_states(const std::vector<CopyState>& old, const std::vector<CopyState>& sources);
  CopyState layout(const nn::CopySpan& span) const;
  static void copy_state(CopyState& dst, const CopyState& src);
  void allocate_state(CopyState& st, Device dev, const Shape& shape);
  void step_copy(int r);
  void step_copies(nn::ParameterSet& set);
  /// Returns the skips per tensor it leaves (frozen_steps_'s loose meaning).
  std::vector<std::int64_t> step_loose();
  void add_entry_steps(nn::StateDict& sd) const;
  /// The full state buffer of name k in ranges_' layout: copy 0's when it holds all
  /// of it, else assembled from every copy's (null when no state exists yet).
  Tensor full_state(std::size_t k);
  /// full_state of a set sharded across processes: collective (Note [Optimizer state
  /// across processes]).
  Tensor gathered_state(std::size_t k);

  nn::ParameterList params_;
  std::string kind_;
  std::vector<Group> groups_;
  std::vector<Range> ranges_;
  std::vector<Range> flat_ranges_;  // ranges_ merged across groups: what zero_grad clears
  std::int64_t state_numel_ = 0;
  std::vector<std::int64_t> entry_state_offset_;  // per list entry (set case), in ranges_' layout
  std::vector<CopyState> states_;                 // per copy (set) or per tensor (loose)
  std::int64_t step_ = 0;
  /// Note [Frozen parameters in a step]: per list entry, the steps taken while it was
  /// frozen or had no gradient (Note [Parameters without a gradient]); its own step
  /// count is step_ minus them.
  std::vector<std::int64_t> frozen_steps_;
  /// Per list entry of a set: its state has started (it was stepped while its group used
  /// state; Note [Optimizer state starts]). PyTorch starts state per parameter: an entry
  /// frozen or unreached when its group's momentum began starts its buffer at its own
  /// first step with momentum.
  std::vector<bool> entry_started_;
  /// A run of the flat buffers stepped by this step, with its elements' step count;
  /// `fresh`: their state has not started (it starts now).
  struct Piece {
    std::int64_t begin = 0, end = 0, step = 0;
    bool fresh = false;
  };
  std::vector<Piece> pieces_;  // sorted, disjoint; frozen entries left out
  /// pieces_ for step_ (already counted) and the frozen_steps_ it leaves, from the
  /// entries' requires_grad now.
  std::vector<std::int64_t> plan_pieces();
};

}  // namespace dp::optim
