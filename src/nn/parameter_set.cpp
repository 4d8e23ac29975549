#include "dp/nn/parameter_set.h"

#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"

namespace dp::nn {
namespace {

thread_local int t_bound_copy = 0;
thread_local bool t_bound = false;
thread_local std::optional<Dtype> t_compute_dtype;

// Note [Compute copies]: the gradient of a compute view, widened into the float32
// leaf's. Saves nothing.
class ComputeCastBackward final : public autograd::Node {
 public:
  explicit ComputeCastBackward(Dtype leaf_dtype) : leaf_dtype_(leaf_dtype) {}
  std::string name() const override { return "ComputeCastBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    return {grads.at(0).defined() ? grads[0].to(leaf_dtype_) : Tensor()};
  }

 private:
  Dtype leaf_dtype_;
};

// What copy r's worker reads of `slot`: its compute view, a node of the graph from the
// first read since forget_compute_reads (Note [Compute copies]).
const Tensor& compute_read(Parameter::Slot& slot, int r) {
  Tensor& read = slot.compute_reads[static_cast<std::size_t>(r)];
  if (read.defined()) return read;
  read = slot.compute[static_cast<std::size_t>(r)].detach();
  const Tensor& leaf = slot.copies[static_cast<std::size_t>(r)];
  if (autograd::needs_grad({leaf}))
    autograd::connect(std::make_shared<ComputeCastBackward>(leaf.dtype()), {leaf}, {&read});
  return read;
}

// A parameter's bytes moved to another storage by rebind: told to the old storage once
// every copy into the new one is made (Moves::~Moves).
struct Move {
  std::shared_ptr<Storage> from;
  std::size_t begin, end;
  std::shared_ptr<Storage> to;
  std::size_t to_begin;
};

// The moves of one rebinding pass. Note [Saved tensors and moved parameters] in
// src/autograd/node.cpp: the new storage's version is taken after the pass's last copy,
// so that its own copies (into other parameters' bytes, maybe past the writes a storage
// keeps exactly) never count as writes.
class Moves {
 public:
  Moves() = default;
  Moves(const Moves&) = delete;
  Moves& operator=(const Moves&) = delete;
  ~Moves() {
    for (Move& m : moves_) m.from->note_move(m.begin, m.end, m.to, m.to_begin, m.to->version());
  }
  void add(Move m) { moves_.push_back(std::move(m)); }

 private:
  std::vector<Move> moves_;
};

// Points `impl` at element `offset` of `buffer` without changing its handle identity,
// so every existing Tensor handle of a parameter sees the flat storage; the move goes
// into `moves` (null: a gradient's, which no graph saves).
void rebind(TensorImpl& impl, const Tensor& buffer, std::int64_t offset, Moves* moves = nullptr) {
  const std::size_t esize = element_size(impl.dtype), bytes = static_cast<std::size_t>(shape_numel(impl.shape)) * esize;
  if (moves != nullptr && impl.storage != nullptr && impl.storage != buffer.storage()) {
    const std::size_t begin = static_cast<std::size_t>(impl.offset) * esize;
    moves->add({impl.storage, begin, begin + bytes, buffer.storage(),
                static_cast<std::size_t>(buffer.storage_offset() + offset) * esize});
  }
  impl.storage = buffer.storage();
  impl.offset = buffer.storage_offset() + offset;
}

Tensor view_of(const Tensor& buffer, std::int64_t offset, const Shape& shape) {
  return buffer.detach().narrow(0, offset, shape_numel(shape)).reshape(shape);
}

}  // namespace

const Tensor& Parameter::get() const {
  DP_CHECK(slot_ != nullptr, "Parameter: expected a registered parameter, got an empty one");
  Slot& slot = slot_->tied ? *slot_->tied : *slot_;  // Note [Tied parameters] in module.cpp
  int r = t_bound_copy;
  if (!(r > 0 && r < static_cast<int>(slot.copies.size()) && slot.copies[r].defined())) r = 0;
  if (slot.unit >= 0) {  // Note [View providers]
    if (auto set = slot.set.lock(); set && set->view_provider() != nullptr)
      set->view_provider()->before_read(t_bound ? r : -1, slot.unit);
  }
  if (t_bound && r < static_cast<int>(slot.compute.size()) && slot.compute[r].defined()) return compute_read(slot, r);
  return slot.copies[r];
}

ReplicaBinding::ReplicaBinding(int copy) : prev_(t_bound_copy), prev_bound_(t_bound) {
  t_bound_copy = copy;
  t_bound = true;
}
ReplicaBinding::~ReplicaBinding() {
  t_bound_copy = prev_;
  t_bound = prev_bound_;
}
int ReplicaBinding::current() { return t_bound_copy; }
bool ReplicaBinding::bound() { return t_bound; }

std::optional<Dtype> compute_dtype() { return t_compute_dtype; }
ComputeDtypeGuard::ComputeDtypeGuard(std::optional<Dtype> dtype) : prev_(t_compute_dtype) { t_compute_dtype = dtype; }
ComputeDtypeGuard::~ComputeDtypeGuard() { t_compute_dtype = prev_; }

std::shared_ptr<ParameterSet> ParameterSet::create(std::vector<std::shared_ptr<Parameter::Slot>> slots,
                                                   Device device) {
  auto set = std::make_shared<ParameterSet>(std::move(slots), device);
  for (auto& s : set->slots_) s->set = set;
  return set;
}

ParameterSet::ParameterSet(std::vector<std::shared_ptr<Parameter::Slot>> slots, Device device)
    : slots_(std::move(slots)) {
  NoGradGuard no_grad;
  for (auto& s : slots_) {
    DP_ASSERT(!s->is_buffer && !s->copies.empty());
    if (auto old = s->set.lock()) old->invalidate();
    s->offset = numel_;
    numel_ += s->copies[0].numel();
    s->copies.resize(1);  // any earlier copies belonged to the old set
    s->compute.clear();
    s->compute_reads.clear();
  }
  buffer_numel_ = numel_;
  ParameterCopy primary;
  primary.device = device;
  primary.data = empty({numel_}, device);
  primary.grad = zeros({numel_}, device);
  Moves moves;
  for (auto& s : slots_) {
    Tensor& p = s->copies[0];
    primary.data.detach().narrow(0, s->offset, p.numel()).copy_(p.reshape({p.numel()}));
    rebind(*p.impl(), primary.data, s->offset, &moves);
    Tensor g = view_of(primary.grad, s->offset, p.shape());
    // A backward before the first flattening (or into a child's earlier set) left a
    // gradient on the leaf: it moves into the flat buffer instead of being dropped.
    if (Tensor before = p.grad(); before.defined()) g.copy_(before);
    autograd::bind_grad(p, g, /*pinned=*/true);
  }
  copies_.push_back(std::move(primary));
}

ParameterSet::~ParameterSet() = default;

ParameterCopy& ParameterSet::copy(int r) {
  DP_CHECK(r >= 0 && r < num_copies(), "ParameterSet: copy ", r, " out of range [0, ", num_copies(), ")");
  return copies_[r];
}
const ParameterCopy& ParameterSet::copy(int r) const {
  DP_CHECK(r >= 0 && r < num_copies(), "ParameterSet: copy ", r, " out of range [0, ", num_copies(), ")");
  return copies_[r];
}

void ParameterSet::bind_views(int r) {
  ParameterCopy& c = copies_[r];
  for (auto& s : slots_) {
    const Shape& shape = s->copies[0].shape();
    Tensor p = view_of(c.data, s->offset, shape);
    p.set_requires_grad(true);
    autograd::bind_grad(p, view_of(c.grad, s->offset, shape), /*pinned=*/true);
    if (static_cast<int>(s->copies.size()) <= r) s->copies.resize(r + 1);
    s->copies[r] = p;
  }
}

void ParameterSet::bind_grad_views(int r) {
  const ParameterCopy& c = copies_[r];
  for (auto& s : slots_) {
    const Tensor& p = s->copies[r];
    autograd::bind_grad(p, c.grad.defined() ? view_of(c.grad, s->offset, p.shape()) : Tensor(), /*pinned=*/true);
  }
}

int ParameterSet::add_copy(Device device, bool transient) {
  DP_CHECK(!spans_cut(*this), "ParameterSet: cannot add a copy to a sharded set; add every copy before sharding it");
  NoGradGuard no_grad;
  ParameterCopy c;
  c.device = device;
  c.data = empty({buffer_numel_}, device);
  c.grad = zeros({buffer_numel_}, device);
  c.transient = transient;
  c.data.copy_(copies_[0].data);
  copies_.push_back(std::move(c));
  int r = num_copies() - 1;
  bind_views(r);
  return r;
}

void ParameterSet::set_grad_buffer(int r, Tensor grad) {
  copy(r).grad = std::move(grad);
  bind_grad_views(r);
}

void ParameterSet::drop_copies() {
  DP_CHECK(!spans_cut(*this), "ParameterSet: drop_copies on a sharded set; unshard it first");
  drop_compute();
  copies_.resize(1);
  for (auto& s : slots_) s->copies.resize(1);
}

// Reallocates every copy's buffers with n elements (the tail zeros) and points every
// view at them in place, so that handles, autograd hooks and .grad handles held
// anywhere keep working.
void ParameterSet::pad_buffers(std::int64_t n) {
  DP_CHECK(n >= buffer_numel_, "ParameterSet: pad_buffers to ", n, " elements, fewer than the ", buffer_numel_,
           " the buffers hold");
  if (n == buffer_numel_) return;
  NoGradGuard no_grad;
  for (ParameterCopy& c : copies_) {
    const int r = static_cast<int>(&c - copies_.data());
    Tensor data = zeros({n}, c.device), grad = zeros({n}, c.device);
    data.narrow(0, 0, c.data.numel()).copy_(c.data);
    if (c.grad.defined()) grad.narrow(0, 0, c.grad.numel()).copy_(c.grad);
    Moves moves;
    for (auto& s : slots_) {
      const Tensor& p = s->copies[r];
      rebind(*p.impl(), data, s->offset, &moves);
      Tensor g = p.grad();
      if (g.defined()) rebind(*g.impl(), grad, s->offset);
    }
    c.data = data;
    c.grad = grad;
  }
  buffer_numel_ = n;
}

void ParameterSet::make_primary_readable() const {
  if (view_provider_ != nullptr) view_provider_->make_primary_readable();
}

void ParameterSet::rebind_view(int r, std::size_t i, const Tensor& buffer, std::int64_t offset) {
  rebind(*slots_.at(i)->copies.at(static_cast<std::size_t>(r)).impl(), buffer, offset);
}

void ParameterSet::set_compute_view(int r, std::size_t i, Tensor view) {
  DP_CHECK(r >= 0 && r < num_copies(), "ParameterSet: copy ", r, " out of range [0, ", num_copies(), ")");
  Parameter::Slot& s = *slots_.at(i);
  const bool dtype_ok = view.defined() && (compute_dtype_ == view.dtype() || view.dtype() == s.copies[0].dtype());
  DP_CHECK(!view.defined() || (dtype_ok && view.shape() == s.copies[0].shape()),
           "ParameterSet: a compute view of '", s.name, "' must have the set's compute dtype (or the parameter's) "
           "and shape ",
           shape_str(s.copies[0].shape()), ", got ", view.defined() ? view.str() : "an undefined tensor");
  const auto n = static_cast<std::size_t>(num_copies());
  s.compute.resize(n);
  s.compute_reads.resize(n);
  s.compute[static_cast<std::size_t>(r)] = std::move(view);
  s.compute_reads[static_cast<std::size_t>(r)] = Tensor();
}

void ParameterSet::forget_compute_reads(int r) {
  for (auto& s : slots_)
    if (static_cast<std::size_t>(r) < s->compute_reads.size()) s->compute_reads[static_cast<std::size_t>(r)] = Tensor();
}

void ParameterSet::drop_compute() {
  for (auto& s : slots_) {
    s->compute.clear();
    s->compute_reads.clear();
  }
  for (ParameterCopy& c : copies_) c.compute = Tensor();
  compute_dtype_.reset();
}

// Note [Frozen parameters]
// A parameter frozen with set_requires_grad(false) (fine-tuning with a frozen backbone or
// embedding) gets no gradient and is not stepped: PyTorch leaves its .grad None and
// every optimizer skips it. What the user freezes is the primary, the module's own
// parameter; the other copies are the runtime's leaves, made requiring grad. So before
// every forward of its workers DataParallel makes each copy's leaf require grad as the
// primary's does (follow_primary_requires_grad): no device computes a gradient for a
// frozen parameter, whichever design runs and whenever it was frozen or unfrozen, and
// its .grad stays what zero_grad left (zeros in every copy's buffer, so every reduction
// sums zeros there). The optimizers read the primary's flag at each step and leave a
// frozen parameter's values and state alone (Note [Fused optimizer steps] in
// dp/optim/optimizer.h). The copies' post-accumulate hooks stay registered while frozen:
// they fire again once the parameter is unfrozen.
void ParameterSet::follow_primary_requires_grad() {
  for (auto& s : slots_) {
    const bool on = s->copies[0].requires_grad();
    for (std::size_t r = 1; r < s->copies.size(); ++r) {
      const Tensor& p = s->copies[r];
      if (p.defined() && p.requires_grad() != on) Tensor(p).set_requires_grad(on);
    }
  }
}

void ParameterSet::zero_grad(bool set_to_none) {
  for (int r = 0; r < num_copies(); ++r) {
    if (copies_[r].grad.defined()) {
      copies_[r].grad.zero_();
    } else if (Tensor kept = copy_span(*this, r).grad; kept.defined()) {  // Note [Copy spans]
      kept.zero_();
    }
  }
  count_zero_grad();
  drop_stray_grads(slots_);
  if (set_to_none) {
    collect_arrived_grads();  // marks of earlier backwards are spent too
    for (const auto& slot : slots_) slot->got_grad = false;
  }
}

void ParameterSet::drop_stray_grads(const std::vector<std::shared_ptr<Parameter::Slot>>& slots) {
  for (const auto& slot : slots) {
    if (slot->is_buffer || slot->tied) continue;
    for (std::size_t r = 0; r < slot->copies.size() && r < copies_.size(); ++r) {
      const Tensor& p = slot->copies[r];
      if (copies_[r].grad.defined() || !p.defined() || !p.grad().defined()) continue;
      if (!autograd::grad_pinned(p)) autograd::bind_grad(p, Tensor(), /*pinned=*/true);
    }
  }
}

// Note [Parameters without a gradient] in dp/optim/optimizer.h.
void ParameterSet::collect_arrived_grads() {
  for (const auto& slot : slots_)
    for (const Tensor& p : slot->copies)
      if (autograd::take_grad_arrived(p)) slot->got_grad = true;
}

void ParameterSet::count_zero_grad() {
  ++zero_grad_count_;
  // Only a .grad that still views its copy's flat buffer was zeroed with it.
  for (const auto& slot : slots_)
    for (std::size_t r = 0; r < slot->copies.size() && r < copies_.size(); ++r) {
      const Tensor& p = slot->copies[r];
      if (!p.defined() || !copies_[r].grad.defined()) continue;
      const Tensor g = p.grad();
      if (g.defined() && g.storage() == copies_[r].grad.storage()) autograd::mark_grad_zeroed(p);
    }
}

void ParameterSet::move_primary(Device device) {
  ParameterCopy& c = copies_[0];
  if (c.device == device) return;
  NoGradGuard no_grad;
  Tensor data = c.data.to(device);
  Tensor grad = c.grad.defined() ? c.grad.to(device) : Tensor();
  Moves moves;
  for (auto& s : slots_) {
    Tensor& p = s->copies[0];
    rebind(*p.impl(), data, s->offset, &moves);
    Tensor g = p.grad();
    if (g.defined()) rebind(*g.impl(), grad, s->offset);
  }
  c.device = device;
  c.data = data;
  c.grad = grad;
  bump_version();
}

void ParameterSet::for_each_copy(const std::function<void(int)>& fn, CopyWork work) {
  auto run = [&](int r) {
    if (!copies_[r].transient) fn(r);
  };
  if (executor_ != nullptr) {
    executor_->for_each_copy(num_copies(), run, work);
  } else {
    for (int r = 0; r < num_copies(); ++r) run(r);
  }
}

ParameterList ParameterList::filter(const std::function<bool(const Tensor&)>& keep) const {
  std::vector<Tensor> tensors;
  std::vector<std::shared_ptr<Parameter::Slot>> slots;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (!keep(tensors_[i])) continue;
    tensors.push_back(tensors_[i]);
    if (i < slots_.size()) slots.push_back(slots_[i]);
  }
  return ParameterList(std::move(tensors), std::move(slots), set_);
}

}  // namespace dp::nn
