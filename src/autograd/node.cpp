#include "dp/autograd/node.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"

namespace dp::autograd {
namespace {

// Sequence numbers order nodes within one graph: a node made later runs earlier in
// backward. One counter for all threads keeps them unique; only the order among the
// nodes of one graph (made by one thread) matters.
std::atomic<std::uint64_t> g_next_sequence_nr{0};

// Note [Concurrent accumulation]
// DataParallel workers run backward on their own graphs at the same time, but graphs
// that copy one master leaf to each worker's device (to(device)) all end in that leaf's
// AccumulateGrad, and their forwards all ask for its accumulator. Both are serialized per
// leaf by a mutex picked from the leaf's address. Hooks run outside it: a DDP hook may
// wait for other workers, which may be waiting for this mutex.

std::mutex& leaf_mutex(const void* leaf) {
  static std::mutex stripes[64];  // more stripes than concurrent workers; collisions only slow down
  return stripes[(reinterpret_cast<std::uintptr_t>(leaf) / alignof(std::max_align_t)) % 64];
}

AutogradMeta& meta(const Tensor& t) {
  auto* impl = t.impl();
  if (!impl->autograd) impl->autograd = std::make_unique<AutogradMeta>();
  return *impl->autograd;
}

// Note [Adopting a gradient]
// A leaf without a .grad takes the incoming gradient as its .grad. Usually that
// gradient is a fresh tensor the engine holds alone (a weight's gradient made by its
// node's backward): it becomes the .grad as it is, without the copy that would for a
// moment hold the gradient twice — the peak that sharded gradients (ZeRO stage 2,
// whose parameters have no .grad between passes) exist to lower. A gradient that
// anything else may still read (another edge's, a view into a larger block) is
// copied, so that accumulating into the .grad later never writes into it.
bool sole_owner(const Tensor& g) {
  return g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.storage_offset() == 0 &&
         g.storage()->nbytes() == g.nbytes() && !g.impl()->autograd;
}

}  // namespace

namespace {
thread_local const BackwardNodeHook::Fn* t_node_hook = nullptr;
}  // namespace

std::uint64_t peek_sequence_nr() { return g_next_sequence_nr.load(std::memory_order_relaxed); }

BackwardNodeHook::BackwardNodeHook(Fn fn) : fn_(std::move(fn)), prev_(t_node_hook) { t_node_hook = &fn_; }
BackwardNodeHook::~BackwardNodeHook() { t_node_hook = prev_; }
const BackwardNodeHook::Fn* BackwardNodeHook::current() { return t_node_hook; }

Node::Node() : sequence_nr(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)) {}

// Note [Saved tensors and in-place writes]
// A node's backward reads tensors of the forward: its inputs (MulBackward reads a and
// b), its output (ExpBackward reads exp(x)), or both. An in-place write into one of
// them between the forward and the backward (y.mul_(2) after y = x.exp(); an
// optimizer's step between a forward and its backward; an input buffer refilled with
// the next batch) would make backward compute the gradient from the new values: a
// wrong gradient, silently. PyTorch checks this with a version counter per tensor.
// dp's storages count their writes already (Note [Storage versions], moved by every
// in-place write through any view), and each node remembers, for each tensor it saved,
// the storage's version when it was made and the tensor's bytes in it. Before reading
// them, backward asks the storage whether a write into those bytes came since
// (Storage::written_since); one did: a dp::Error naming the node and the tensor, as
// PyTorch's "modified by an inplace operation" is. Bytes, not the whole storage:
// DataParallel keeps every parameter, and every buffer, of a device in one flat
// storage, and a BatchNorm's update of its running statistics during the forward
// must not count as a write into a buffer saved by a mul before it. The storage keeps
// its latest writes' ranges (the older ones only as "some range was written", so a
// long-lived graph may be told of a write into bytes that were not written: an error,
// never a missed write).
// What a node saves is said where it is made (record's `saved`), not guessed from its
// inputs: an op whose backward needs only shapes (add, sum, views) saves nothing, and
// an input of it may be written afterwards, as in PyTorch.
// A runtime's writes that put back values no graph has read do not count: the
// re-gather of a ZeRO stage-3 unit released between forward and backward, from shards
// unwritten since (Note [Refills are not writes] in src/parallel/shard_store.cpp),
// and the deferred gathers of stages 1 and 2 (Note [Deferred gathers are not
// writes]).
// Note [Saved tensors and moved parameters]
// A module's parameters live in storages of their own until something flattens them
// (Note [Parameter sets]: the first parameters(), DataParallel, a move to a device),
// which copies each into one flat buffer and points the parameter's handle there
// (rebind). A node saved before that remembers the old storage and version, and backward
// reads the saved handle, now on the new storage: a write after the flattening — a
// weight scaled under NoGradGuard, an optimizer built on the new parameters() and
// stepped — changed the values backward read, and the old storage, asked as above, had
// seen no write. A Linear's input gradient came from twice its weight, silently, where
// PyTorch says "modified by an inplace operation". So a rebinding tells the old storage
// where those bytes went (Storage::note_move: the new storage and its version once the
// whole flattening's copies are made, so that those copies, one per parameter and maybe
// more than the writes a storage keeps exactly, never read as writes), and
// written_since follows the bytes there. The move takes a version of the old storage,
// so a view left on it and saved after the move is asked about the old bytes only.
void Node::save_versions(std::initializer_list<Tensor> saved) {
  int i = 0;
  for (const Tensor& t : saved) {
    if (t.defined() && t.storage()) {
      const std::size_t begin = static_cast<std::size_t>(t.storage_offset()) * element_size(t.dtype());
      saved_versions_.push_back({t.storage(), t.storage()->version(), begin, begin + t.nbytes(), i, t.dtype()});
    }
    ++i;
  }
}

void Node::check_saved_versions() const {
  for (const SavedVersion& s : saved_versions_) {
    const Storage::WriteSince w = s.storage->find_write_since(s.version, s.begin, s.end);
    if (!w.storage) continue;
    // Where the bytes were moved (a module's parameters flattened after the forward), the
    // versions that tell are the new storage's.
    const std::string where =
        w.storage == s.storage.get()
            ? detail::str_cat("its storage was at version ", s.version, " then and is at version ",
                              s.storage->version(), " now")
            : detail::str_cat("its bytes have since been moved into another storage (a module's parameters "
                              "flattened after the forward; Note [Saved tensors and moved parameters]), "
                              "which was at version ", w.since, " after the move and is at version ",
                              w.storage->version(), " now");
    DP_FAIL(name(), ": saved tensor ", s.index, " (", dtype_name(s.dtype), ", ",
             (s.end - s.begin) / element_size(s.dtype), " elements on ", s.storage->device(),
             "; an input or output of the forward, which its backward reads) was modified by an in-place "
             "operation after the forward: ", where, ". The gradient would be computed from the new values. "
             "Make that write out of place (y = y * 2 for y.mul_(2)), move it after backward(), or write into a "
             "clone() (Note [Saved tensors and in-place writes])");
  }
}

std::vector<Tensor> LambdaNode::apply(std::vector<Tensor>&& grad_outputs) {
  DP_CHECK(!released_, "backward through ", name_,
           " a second time: its saved tensors were freed by the first backward. Pass "
           "retain_graph=true to the first backward() if you need to run it twice");
  check_saved_versions();
  std::vector<Tensor> grads = fn_(grad_outputs);
  DP_ASSERT(grads.size() == next_edges.size(), name_, " returned ", grads.size(),
            " gradients for ", next_edges.size(), " inputs");
  return grads;
}

void LambdaNode::release_saved() {
  fn_ = nullptr;  // frees every captured tensor
  release_saved_versions();
  released_ = true;
}

// Note [Gradients added in place]
// After zero_grad a weight's .grad (a view into the flat gradient buffer) holds +0
// everywhere, and backward used to compute the weight's gradient into a fresh tensor
// only for AccumulateGrad to add it to those zeros: a temporary as large as the
// weights (7.5 MB for the MLP 784-1024-1024-10) written, then read with the .grad
// and the .grad written again. Instead the node that computes it may ask the engine
// for a sink (grad_sink): when its edge is the leaf's only one in this graph (no other
// gradient will be summed with it) and the .grad is known to hold only +0 since a
// zero_grad, the node gets the .grad itself, adds its product into it (a GEMM with
// beta = 1) and returns it; AccumulateGrad recognises it and adds nothing. Adding a
// product to +0 inside the GEMM gives the bits of adding the finished product to +0
// after it: +0 leaves every other value as it is and turns -0 into +0, wherever in
// the sum it enters (tested bit for bit against the separate add, -0 included). The
// sink holds the leaf's accumulation lock while the node writes (Note [Concurrent
// accumulation]). The mark is set by zero_grad and cleared when the .grad is lent or
// accumulated into; a write through other paths between a zero_grad and a backward
// (rare: an edit of .grad by hand) would leave it set, and then the product is still
// added to what is there — the right sum, rounded as one GEMM with beta = 1 rounds it.
// Measured in docs/benchmarks/log.md, "A fifth look".

// Note [Gradients written over zeros]
// Adding into a .grad of +0 (beta = 1) still reads the .grad: zero_grad wrote it at
// the start of the step, the forward has pushed it out of the caches since, and the
// GEMM reads it back from memory — 7.5 MB per MLP step, most of the difference between
// the weight gradients' time in a step and alone. When the .grad is known to hold only
// +0 the node writes its product over it (beta = 0) instead. Known, not assumed: the
// per-leaf mark above is cleared by the engine's own writes into that leaf, but a write
// made through another tensor on the same storage (an edit by hand of this or another
// .grad in a flat buffer, a second optimizer's zero_grad of other parameters, a
// reallocation) would not clear it. So every in-place write moves its storage's write
// epoch (Storage::bump_version, reached through mutable_data), except the engine's
// writes into a leaf's .grad, made under a GradientWriteScope and tracked by the mark:
// zero_grad records the epoch with the mark, and the sink writes over the .grad only
// when the epoch is still the recorded one; otherwise it adds, as before. (A write
// through data() into a tensor others hold breaks Note [Storage versions] and is not
// seen.) The bits are those of the addition: the GEMMs start their sums from +0
// (oneDNN's kernels and the small-k products on the CPU, cuBLAS on CUDA), so a product
// is never -0 and +0 + product == product; engine_test checks this bit for bit with -0
// products, through oneDNN's kernels and the small-k loop. Measured in
// docs/benchmarks/log.md, "A seventh look".

// One flag per kind and thread: GradientWriteScope for the engine's writes into a leaf's
// .grad (Note [Gradients written over zeros]), RefreshWriteScope for ranges no graph has
// read (Note [Deferred gathers are not writes]).
namespace {
template <class Kind>
thread_local bool t_flag = false;
}  // namespace

template <class Kind>
ThreadFlagScope<Kind>::ThreadFlagScope() : outer_(!t_flag<Kind>) {
  t_flag<Kind> = true;
}
template <class Kind>
ThreadFlagScope<Kind>::~ThreadFlagScope() {
  if (outer_) t_flag<Kind> = false;
}
template <class Kind>
bool ThreadFlagScope<Kind>::active() {
  return t_flag<Kind>;
}
template class ThreadFlagScope<GradientWriteKind>;
template class ThreadFlagScope<RefreshWriteKind>;

GradSink AccumulateGrad::sink() {
  GradSink s;
  auto leaf_impl = leaf_.lock();
  if (!leaf_impl || !leaf_impl->autograd) return s;
  AutogradMeta& m = *leaf_impl->autograd;
  std::unique_lock<std::mutex> lock(leaf_mutex(leaf_impl.get()));  // Note [Concurrent accumulation]
  if (!m.grad_zeroed || !m.grad.defined() || m.grad.dtype() != Dtype::Float32)
    return s;
  m.grad_zeroed = false;  // written from here on
  ++lent_;
  s.zeros_ = m.grad.storage()->write_epoch() == m.zeroed_epoch;  // Note [Gradients written over zeros]
  s.grad_ = m.grad;
  s.lock_ = std::move(lock);
  return s;
}

void mark_grad_zeroed(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return;
  std::lock_guard<std::mutex> lock(leaf_mutex(t.impl()));  // Note [Concurrent accumulation]
  AutogradMeta& m = *t.impl()->autograd;
  m.grad_zeroed = m.grad.defined();
  if (m.grad_zeroed) m.zeroed_epoch = m.grad.storage()->write_epoch();  // Note [Gradients written over zeros]
}

bool take_grad_arrived(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return false;
  std::lock_guard<std::mutex> lock(leaf_mutex(t.impl()));  // Note [Concurrent accumulation]
  AutogradMeta& m = *t.impl()->autograd;
  const bool arrived = m.grad_arrived;
  m.grad_arrived = false;
  return arrived;
}

bool grad_arrived(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return false;
  std::lock_guard<std::mutex> lock(leaf_mutex(t.impl()));  // Note [Concurrent accumulation]
  return t.impl()->autograd->grad_arrived;
}

bool grad_pinned(const Tensor& t) {
  return t.defined() && t.impl()->autograd && t.impl()->autograd->grad_pinned && t.impl()->autograd->grad.defined();
}

void bind_grad(const Tensor& t, const Tensor& g, bool pinned) {
  DP_CHECK(t.defined(), "bind_grad: an undefined tensor");
  if (!t.impl()->autograd) t.impl()->autograd = std::make_unique<AutogradMeta>();
  AutogradMeta& m = *t.impl()->autograd;
  m.grad = g;
  m.grad_pinned = pinned && g.defined();
  m.grad_released = pinned && !g.defined();
}

bool assign_pinned_grad(const Tensor& t, const Tensor& g) {
  if (!t.impl()->autograd) return false;
  AutogradMeta& m = *t.impl()->autograd;
  // Replacing the leaf's .grad here would hand the step nothing: it reads the owners'
  // ranges (Note [Gradient edits] in src/parallel/designs/ddp.cpp).
  DP_CHECK(!m.grad_released, "set_grad: this parameter's gradient is sharded over the devices (DataParallel's "
           "Sharded stages 2 and 3 keep each device's range of the summed gradient only), so there is no whole "
           ".grad to write into and the step would never read it; use dp::nn::utils::clip_grad_norm_ / "
           "clip_grad_value_ (they act on every range), scale the loss, or use shard_stage 1 or Mode::DDP");
  if (!m.grad_pinned || !m.grad.defined()) return false;
  DP_CHECK(g.defined(), "set_grad: this parameter's .grad is its place in the module's flat gradient buffer and "
           "cannot become undefined; zero_grad() sets the gradients to none (Note [Parameters without a gradient])");
  {
    NoGradGuard no_grad;
    Tensor view = m.grad;
    view.copy_(g);
  }
  std::lock_guard<std::mutex> lock(leaf_mutex(t.impl()));  // Note [Concurrent accumulation]
  m.grad_arrived = true;
  return true;
}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grad_outputs) {
  auto leaf_impl = leaf_.lock();
  if (!leaf_impl || grad_outputs.empty() || !grad_outputs[0].defined()) return {};
  Tensor leaf(leaf_impl);
  const Tensor& g = grad_outputs[0];
  DP_CHECK(g.shape() == leaf.shape() && g.device() == leaf.device(),
           "AccumulateGrad: gradient of shape ", shape_str(g.shape()), " on ", g.device(),
           " does not match the leaf's ", shape_str(leaf.shape()), " on ", leaf.device());
  AutogradMeta& m = meta(leaf);
  {
    std::lock_guard<std::mutex> lock(leaf_mutex(leaf_impl.get()));  // Note [Concurrent accumulation]
    // The .grad itself coming back from a lent sink (other threads' graphs may end here
    // too, with gradients of their own, in any order: Note [Concurrent accumulation]).
    const bool added_in_place = lent_ > 0 && m.grad.defined() && g.impl() == m.grad.impl();
    if (added_in_place) --lent_;
    m.grad_zeroed = false;
    m.grad_arrived = true;  // Note [Parameters without a gradient] in dp/optim/optimizer.h
    if (added_in_place) {
      // Note [Gradients added in place]: the node already added it into .grad.
    } else if (m.grad.defined()) {
      GradientWriteScope scope;  // tracked by this leaf's mark (Note [Gradients written over zeros])
      m.grad.add_(g);            // in place: a .grad that views a flat buffer stays a view
    } else if (sole_owner(g)) {
      m.grad = g;  // Note [Adopting a gradient]
      m.grad.impl()->copied_view = nullptr;  // dp's own now (Note [Writes into materialised views])
    } else {
      NoGradGuard no_grad;
      m.grad = g.detach().clone();  // own storage: g may be shared with other edges
    }
  }
  for (auto& hook : m.post_accumulate_hooks) hook.fn(leaf);
  return {};
}

bool needs_grad(std::initializer_list<Tensor> inputs) {
  if (!is_grad_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!is_grad_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return {};
  AutogradMeta& m = *t.impl()->autograd;
  if (m.grad_fn) return {m.grad_fn, m.output_nr};
  if (!m.requires_grad) return {};
  std::lock_guard<std::mutex> lock(leaf_mutex(t.impl()));  // Note [Concurrent accumulation]
  auto acc = m.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(std::weak_ptr<TensorImpl>(t.impl_ptr()));
    m.grad_accumulator = acc;
  }
  return {acc, 0};
}

void connect(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
             const std::vector<Tensor*>& outputs) {
  node->next_edges.clear();
  node->next_edges.reserve(inputs.size());
  for (const auto& t : inputs) node->next_edges.push_back(gradient_edge(t));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    AutogradMeta& m = meta(*outputs[i]);
    m.grad_fn = node;
    m.output_nr = static_cast<int>(i);
    m.requires_grad = true;
  }
}

void record(const char* name, const std::vector<Tensor>& inputs, Tensor& output,
            std::initializer_list<Tensor> saved, LambdaNode::Fn fn) {
  if (!needs_grad(inputs)) return;
  auto node = std::make_shared<LambdaNode>(name, std::move(fn));
  node->save_versions(saved);
  connect(node, inputs, {&output});
}

std::uint64_t add_post_accumulate_hook(const Tensor& t, std::function<void(const Tensor&)> hook) {
  DP_CHECK(t.defined() && t.is_leaf(), "post-accumulate hooks need a leaf tensor, got ",
           t.defined() ? t.str() : "an undefined tensor");
  static std::atomic<std::uint64_t> next_id{1};
  const std::uint64_t id = next_id.fetch_add(1, std::memory_order_relaxed);
  meta(t).post_accumulate_hooks.push_back({id, std::move(hook)});
  return id;
}

bool remove_post_accumulate_hook(const Tensor& t, std::uint64_t id) {
  if (!t.defined() || !t.impl()->autograd) return false;
  auto& hooks = t.impl()->autograd->post_accumulate_hooks;
  return std::erase_if(hooks, [id](const AutogradMeta::PostAccumulateHook& h) { return h.id == id; }) > 0;
}

void clear_post_accumulate_hooks(const Tensor& t) {
  if (t.impl()->autograd) t.impl()->autograd->post_accumulate_hooks.clear();
}

}  // namespace dp::autograd
