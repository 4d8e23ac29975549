// dp/autograd/node.h — nodes of the backward graph and the helpers ops use to record them.
//
// Each differentiable op that runs with grad mode on and an input that requires a
// gradient records a Node: it holds what backward needs (saved tensors) and an edge
// per input to the node that made that input (or to the input's gradient
// accumulator when the input is a leaf). This header knows nothing of modules.
//
//   Tensor y = ...forward...;
//   autograd::record("ReluBackward", {x}, y, /*saved=*/{x},
//       [x](const std::vector<Tensor>& g) { return std::vector<Tensor>{relu_backward(g[0], x)}; });
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dp/tensor/tensor.h"

namespace dp::autograd {

class Node;

/// Where a gradient flows: input `input_nr` of node `fn`.
struct Edge {
  std::shared_ptr<Node> fn;
  int input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

/// A function in the backward graph.
class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// Name for errors and traces, e.g. "Conv2dBackward".
  virtual std::string name() const = 0;
  /// Gradients w.r.t. the forward outputs in, one gradient per next edge out
  /// (undefined where an input needs none).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) = 0;
  /// Frees saved tensors once backward has run (unless retain_graph).
  virtual void release_saved() {
    release_saved_versions();
    released_ = true;
  }
  bool released() const { return released_; }

  std::vector<Edge> next_edges;
  /// Creation order on this thread; backward runs later nodes first.
  std::uint64_t sequence_nr;

  /// Remembers the storage versions of the tensors this node's backward reads, so that
  /// an in-place write into one of them before backward is an error, not a gradient
  /// computed from the new values (Note [Saved tensors and in-place writes]). Call once,
  /// when the node is made; undefined tensors are skipped.
  void save_versions(std::initializer_list<Tensor> saved);
  /// Throws a dp::Error naming this node and the saved tensor when any was written in
  /// place since save_versions. Every node's apply calls it before reading them.
  void check_saved_versions() const;

 protected:
  void release_saved_versions() { saved_versions_.clear(); }
  bool released_ = false;

 private:
  struct SavedVersion {
    std::shared_ptr<Storage> storage;
    std::uint64_t version;
    std::size_t begin, end;  // the tensor's bytes in the storage
    int index;               // position in the saved list, for the message
    Dtype dtype;
  };
  std::vector<SavedVersion> saved_versions_;
};

/// A node whose backward is a function object capturing what it saved.
class LambdaNode final : public Node {
 public:
  using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grad_outputs)>;
  LambdaNode(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  std::string name() const override { return name_; }
  /// name() == n, without a copy of the name.
  bool is(const char* n) const { return name_ == n; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) override;
  void release_saved() override;

 private:
  std::string name_;
  Fn fn_;
};

/// A leaf's .grad lent to the node that computes the leaf's gradient, which adds the
/// gradient into it in place and returns it (Note [Gradients added in place]). Holds
/// the leaf's accumulation lock while it lives. Empty when the node must return a
/// fresh gradient as usual.
class GradSink {
 public:
  GradSink() = default;
  explicit operator bool() const { return grad_.defined(); }
  /// The leaf's .grad: add the gradient into it (beta = 1), or, when zeros(), write
  /// the gradient over it (beta = 0). Write under a GradientWriteScope.
  const Tensor& grad() const { return grad_; }
  /// True when the .grad is known to hold only +0: zero_grad filled it and nothing has
  /// written into its storage since but the engine's writes into other leaves' .grad
  /// (Note [Gradients written over zeros]).
  bool zeros() const { return zeros_; }

 private:
  friend class AccumulateGrad;
  Tensor grad_;
  bool zeros_ = false;
  std::unique_lock<std::mutex> lock_;
};

/// A flag of this thread, set while a scope of its Kind is alive. Scopes nest; the
/// outermost one clears the flag. `active()` reads it. The two kinds below are the
/// only instances (defined in node.cpp); not for other code.
template <class Kind>
class ThreadFlagScope {
 public:
  ThreadFlagScope();
  ~ThreadFlagScope();
  ThreadFlagScope(const ThreadFlagScope&) = delete;
  ThreadFlagScope& operator=(const ThreadFlagScope&) = delete;
  /// True while a scope of this Kind is open on this thread.
  static bool active();

 private:
  bool outer_;
};

struct GradientWriteKind;
struct RefreshWriteKind;
extern template class ThreadFlagScope<GradientWriteKind>;
extern template class ThreadFlagScope<RefreshWriteKind>;

/// While alive, in-place writes made on this thread leave Storage::write_epoch() where
/// it is: for the engine's writes into a leaf's .grad, which it tracks per leaf (Note
/// [Gradients written over zeros]).
using GradientWriteScope = ThreadFlagScope<GradientWriteKind>;

/// While alive, in-place writes made on this thread move Storage::version() (what
/// DataParallel compares) but are not counted by Storage::written_since (what
/// autograd's saved tensors ask): for a runtime's writes into ranges of a flat buffer
/// that no graph has read since they were last written, during a forward that has saved
/// other ranges of it (Note [Deferred gathers are not writes] in
/// src/parallel/shard_store.cpp).
using RefreshWriteScope = ThreadFlagScope<RefreshWriteKind>;

/// Accumulates the incoming gradient into a leaf's .grad (in place when it exists,
/// so a .grad that views a flat gradient buffer stays a view), then runs the leaf's
/// post-accumulate hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::weak_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) override;
  void release_saved() override {}  // nothing saved; reusable across backwards
  /// The leaf's .grad to add the gradient into, when it is known to hold only +0 (Note
  /// [Gradients added in place]); empty otherwise.
  GradSink sink();

 private:
  std::weak_ptr<TensorImpl> leaf_;
  int lent_ = 0;  // sinks lent whose gradient apply has not seen back (under the leaf's lock)
};

/// Per-tensor autograd state.
struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;
  int output_nr = 0;
  std::weak_ptr<Node> grad_accumulator;
  /// Called after backward accumulated into this leaf's .grad (DDP's bucket hooks, a
  /// user's), in the order added, each with the id add_post_accumulate_hook gave it.
  struct PostAccumulateHook {
    std::uint64_t id;
    std::function<void(const Tensor& leaf)> fn;
  };
  std::vector<PostAccumulateHook> post_accumulate_hooks;
  /// .grad holds only +0 since a zero_grad (Note [Gradients added in place]), unless
  /// its storage's write epoch has moved from zeroed_epoch (Note [Gradients written
  /// over zeros]).
  bool grad_zeroed = false;
  std::uint64_t zeroed_epoch = 0;
  /// A backward accumulated a gradient into this leaf since take_grad_arrived() last
  /// read it (Note [Parameters without a gradient] in include/dp/optim/optimizer.h).
  bool grad_arrived = false;
  /// .grad is this parameter's place in its set's flat gradient buffer (bind_grad):
  /// Tensor::set_grad writes into it instead of replacing it.
  bool grad_pinned = false;
  /// The parameter's set holds its gradient sharded (Sharded stages 2 and 3): there is
  /// no whole .grad for Tensor::set_grad to write into, and it refuses.
  bool grad_released = false;
};

/// True when grad mode is on and any defined input requires a gradient.
bool needs_grad(std::initializer_list<Tensor> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);

/// The edge a gradient for `t` should flow along (invalid when t needs none).
Edge gradient_edge(const Tensor& t);

/// Connects `node` to the inputs and makes it the grad_fn of `outputs` (output i gets
/// output_nr i). Call only when needs_grad(inputs).
void connect(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
             const std::vector<Tensor*>& outputs);

/// Shorthand: when needs_grad(inputs), records a LambdaNode named `name` as the
/// grad_fn of `output`. `fn` returns one gradient per input. `saved` lists every tensor
/// of the caller's that `fn` reads (or one sharing its storage: the forward's input or
/// output), as PyTorch's save_for_backward does; an in-place write into one before
/// backward makes backward throw (Note [Saved tensors and in-place writes]). Tensors
/// the op made for itself and hands to nobody need not be listed.
void record(const char* name, const std::vector<Tensor>& inputs, Tensor& output,
            std::initializer_list<Tensor> saved, LambdaNode::Fn fn);

/// Called by a node's backward function while the engine runs it on this thread: the
/// .grad of the leaf that the node's input `input_nr` is, lent for the node to add its
/// gradient into and return (Note [Gradients added in place]); empty unless this
/// edge is the leaf's only one in the graph and its .grad is known to be all +0.
GradSink grad_sink(int input_nr);

/// Records that leaf `t`'s .grad was just filled with +0 (zero_grad).
void mark_grad_zeroed(const Tensor& t);

/// Whether a backward accumulated a gradient into leaf `t` since the last call, which
/// clears the mark (Note [Parameters without a gradient] in include/dp/optim/optimizer.h).
/// False for an undefined tensor or one that never took part in autograd.
bool take_grad_arrived(const Tensor& t);

/// Whether a gradient arrived in leaf `t` since take_grad_arrived() last read it (the
/// mark stays), and whether its .grad is pinned (bind_grad).
bool grad_arrived(const Tensor& t);
bool grad_pinned(const Tensor& t);

/// A runtime's own binding of leaf `t`'s .grad to `g` (a parameter set's flat-buffer
/// view: `pinned`), where Tensor::set_grad would write into a pinned one. `pinned` with
/// an undefined g: the set keeps the gradient elsewhere (released, sharded), and
/// Tensor::set_grad is a dp::Error until a view is bound again.
void bind_grad(const Tensor& t, const Tensor& g, bool pinned);

/// Tensor::set_grad(g) of a leaf whose .grad is pinned (a parameter of a set): writes g
/// into the view, as PyTorch's `p.grad = g` gives the optimizer g, and counts it as a
/// gradient that arrived (Note [Parameters without a gradient]). Returns false, doing
/// nothing, for a leaf that is not pinned. An undefined g is a dp::Error, and so is any
/// g while the set holds the gradient released (bind_grad).
bool assign_pinned_grad(const Tensor& t, const Tensor& g);

/// Registers a hook run after a gradient is accumulated into leaf `t` (PyTorch's
/// register_post_accumulate_grad_hook) and returns its id, which
/// remove_post_accumulate_hook takes, as PyTorch's handle.remove(). A leaf that does not
/// require grad gets no gradient: its hooks run once it does (a frozen parameter
/// unfrozen, Note [Frozen parameters] in src/nn/parameter_set.cpp).
std::uint64_t add_post_accumulate_hook(const Tensor& t, std::function<void(const Tensor&)> hook);
/// Removes the hook `id` of leaf `t`; false (nothing done) when t has no such hook.
bool remove_post_accumulate_hook(const Tensor& t, std::uint64_t id);
/// Removes every post-accumulate hook of `t`, the ones others added included.
void clear_post_accumulate_hooks(const Tensor& t);

/// The sequence number the next node made (on any thread) will get: nodes made after
/// this call have numbers >= the result.
std::uint64_t peek_sequence_nr();

/// Called on the calling thread before each node a backward on that thread runs
/// (DataParallel's sharded parameters gather a module's parameters there). RAII;
/// nests, restoring the previous hook.
class BackwardNodeHook {
 public:
  using Fn = std::function<void(const Node& node)>;
  explicit BackwardNodeHook(Fn fn);
  ~BackwardNodeHook();
  BackwardNodeHook(const BackwardNodeHook&) = delete;
  BackwardNodeHook& operator=(const BackwardNodeHook&) = delete;
  /// The calling thread's hook (null when none).
  static const Fn* current();

 private:
  Fn fn_;
  const Fn* prev_;
};

/// Runs backward from `roots` seeded with `grads` (undefined = ones for scalars) on
/// the calling thread. Throws dp::Error on a second backward through a freed graph.
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                  bool retain_graph);

}  // namespace dp::autograd
