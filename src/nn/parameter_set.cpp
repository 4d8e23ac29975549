#include "dp/nn/parameter_set.h"

#include <algorithm>

#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"

namespace dp::nn {
namespace {

thread_local int t_bound_copy = 0;
thread_local bool t_bound = false;

// Points `impl` at element `offset` of `buffer` without changing its handle identity,
// so every existing Tensor handle of a parameter sees the flat storage.
void rebind(TensorImpl& impl, const Tensor& buffer, std::int64_t offset) {
  impl.storage = buffer.storage();
  impl.offset = buffer.storage_offset() + offset;
}

Tensor view_of(const Tensor& buffer, std::int64_t offset, const Shape& shape) {
  return buffer.detach().narrow(0, offset, shape_numel(shape)).reshape(shape);
}

}  // namespace

const Tensor& Parameter::get() const {
  DP_CHECK(slot_ != nullptr, "Parameter: expected a registered parameter, got an empty one");
  int r = t_bound_copy;
  if (!(r > 0 && r < static_cast<int>(slot_->copies.size()) && slot_->copies[r].defined())) r = 0;
  if (slot_->unit >= 0) {  // Note [View providers]
    if (auto set = slot_->set.lock(); set && set->view_provider() != nullptr)
      set->view_provider()->before_read(t_bound ? r : -1, slot_->unit);
  }
  return slot_->copies[r];
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
  }
  buffer_numel_ = numel_;
  ParameterCopy primary;
  primary.device = device;
  primary.data = empty({numel_}, device);
  primary.grad = zeros({numel_}, device);
  primary.end = numel_;
  for (auto& s : slots_) {
    Tensor& p = s->copies[0];
    primary.data.detach().narrow(0, s->offset, p.numel()).copy_(p.reshape({p.numel()}));
    rebind(*p.impl(), primary.data, s->offset);
    Tensor g = view_of(primary.grad, s->offset, p.shape());
    // A backward before the first flattening (or into a child's earlier set) left a
    // gradient on the leaf: it moves into the flat buffer instead of being dropped.
    if (Tensor before = p.grad(); before.defined()) g.copy_(before);
    p.set_grad(g);
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

Tensor ParameterCopy::owned_grad() const {
  if (shard_grad.defined()) return shard_grad;
  DP_CHECK(grad.defined(), "ParameterSet: copy on ", device, " has no gradient buffer");
  if (begin == 0 && end == grad.numel()) return grad;
  return grad.narrow(0, begin, end - begin);
}

Tensor ParameterCopy::owned_data() const {
  if (data.numel() == end - begin) return data;  // the whole buffer, or only the range
  return data.narrow(0, begin, end - begin);
}

void ParameterSet::bind_views(int r) {
  ParameterCopy& c = copies_[r];
  for (auto& s : slots_) {
    const Shape& shape = s->copies[0].shape();
    Tensor p = view_of(c.data, s->offset, shape);
    p.set_requires_grad(true);
    p.set_grad(view_of(c.grad, s->offset, shape));
    if (static_cast<int>(s->copies.size()) <= r) s->copies.resize(r + 1);
    s->copies[r] = p;
  }
}

void ParameterSet::bind_grad_views(int r) {
  const ParameterCopy& c = copies_[r];
  for (auto& s : slots_) {
    const Tensor& p = s->copies[r];
    p.set_grad(c.grad.defined() ? view_of(c.grad, s->offset, p.shape()) : Tensor());
  }
}

int ParameterSet::add_copy(Device device, bool transient) {
  DP_CHECK(!sharded_, "ParameterSet: cannot add a copy to a sharded set; add every copy before shard()");
  NoGradGuard no_grad;
  ParameterCopy c;
  c.device = device;
  c.data = empty({buffer_numel_}, device);
  c.grad = zeros({buffer_numel_}, device);
  c.transient = transient;
  c.end = buffer_numel_;
  c.data.copy_(copies_[0].data);
  copies_.push_back(std::move(c));
  int r = num_copies() - 1;
  bind_views(r);
  return r;
}

void ParameterSet::drop_copies() {
  unshard();
  copies_.resize(1);
  for (auto& s : slots_) s->copies.resize(1);
}

// Reallocates copy r's buffers with n elements (the tail zeros) and points every view
// of copy r at them in place, so that handles, autograd hooks and .grad handles held
// anywhere keep working.
void ParameterSet::grow_buffers(int r, std::int64_t n) {
  ParameterCopy& c = copies_[r];
  NoGradGuard no_grad;
  Tensor data = zeros({n}, c.device), grad = zeros({n}, c.device);
  data.narrow(0, 0, c.data.numel()).copy_(c.data);
  if (c.grad.defined()) grad.narrow(0, 0, c.grad.numel()).copy_(c.grad);
  for (auto& s : slots_) {
    const Tensor& p = s->copies[r];
    rebind(*p.impl(), data, s->offset);
    Tensor g = p.grad();
    if (g.defined()) rebind(*g.impl(), grad, s->offset);
  }
  c.data = data;
  c.grad = grad;
  c.end = n;
}

void ParameterSet::shard(bool shard_grads, int world, int first) {
  DP_CHECK(!sharded_, "ParameterSet: already sharded");
  const int local = num_copies();
  if (world == 0) world = local;
  DP_CHECK(first >= 0 && world >= first + local, "ParameterSet: shard: copies [", first, ", ", first + local,
           ") are not ranges of ", world, " in all");
  for (const auto& c : copies_)
    DP_CHECK(!c.transient, "ParameterSet: cannot shard a set with transient copies (DP mode's replicas)");
  // Note [Sharded parameter sets]: equal, aligned ranges over a zero-padded buffer.
  const int n = local;
  std::int64_t len = (numel_ + world - 1) / world;
  len = (len + kShardAlign - 1) / kShardAlign * kShardAlign;
  const std::int64_t padded = std::max<std::int64_t>(len * world, buffer_numel_);
  if (padded > buffer_numel_) {
    for (int r = 0; r < n; ++r) grow_buffers(r, padded);
    buffer_numel_ = padded;
  }
  NoGradGuard no_grad;
  for (int r = 0; r < n; ++r) {
    ParameterCopy& c = copies_[r];
    c.begin = len * (first + r);
    c.end = len * (first + r + 1);
  }
  sharded_ = true;
  shard_grads_ = shard_grads;
  shard_world_ = world;
  // Each copy's own range takes the gradient copy 0 holds there: the other copies'
  // buffers are zeros, so the sum over copies stays the gradient.
  ParameterCopy& c0 = copies_[0];
  for (int r = 1; r < n; ++r) {
    ParameterCopy& c = copies_[r];
    const std::int64_t len = c.end - c.begin;
    c.grad.narrow(0, c.begin, len).copy_(c0.grad.narrow(0, c.begin, len));
    c0.grad.narrow(0, c.begin, len).zero_();
  }
  if (shard_grads)
    for (int r = 0; r < n; ++r) release_grad(r);
}

// Note [Ranges across processes].
ProcessExchange& ParameterSet::process_exchange() const {
  DP_CHECK(process_exchange_ != nullptr, "ParameterSet: the set is sharded over ", shard_world_, " ranges, ",
           num_copies(), " of them in this process, and no exchange with the other processes was installed; "
           "shard across processes through dp::DataParallel");
  return *process_exchange_;
}

void ParameterSet::make_primary_readable() const {
  if (view_provider_ != nullptr) view_provider_->make_primary_readable();
}

void ParameterSet::rebind_view(int r, std::size_t i, const Tensor& buffer, std::int64_t offset) {
  rebind(*slots_.at(i)->copies.at(static_cast<std::size_t>(r)).impl(), buffer, offset);
}

void ParameterSet::unshard() {
  if (!sharded_) return;
  for (const ParameterCopy& c : copies_)
    DP_CHECK(c.data.numel() == buffer_numel_, "ParameterSet: unshard: copy on ", c.device, " holds only its range "
             "of the parameters; its view provider must give every copy its whole buffer first");
  NoGradGuard no_grad;
  const int n = num_copies();
  for (int r = 0; r < n; ++r) acquire_grad(r);  // no-op unless sharded gradients
  ParameterCopy& c0 = copies_[0];
  for (int r = 1; r < n; ++r) {
    const ParameterCopy& c = copies_[r];
    c0.grad.narrow(0, c.begin, c.end - c.begin).copy_(c.owned_grad());
  }
  for (auto& c : copies_) {
    c.begin = 0;
    c.end = buffer_numel_;
    c.shard_grad = Tensor();
  }
  sharded_ = false;
  shard_world_ = 0;
  shard_grads_ = false;
}

void ParameterSet::acquire_grad(int r) {
  ParameterCopy& c = copy(r);
  if (c.grad.defined()) return;
  NoGradGuard no_grad;
  c.grad = zeros({buffer_numel_}, c.device);
  if (c.shard_grad.defined()) c.grad.narrow(0, c.begin, c.end - c.begin).copy_(c.shard_grad);
  c.shard_grad = Tensor();  // in the buffer now: one copy of the range, not two
  bind_grad_views(r);
}

void ParameterSet::release_grad(int r) {
  ParameterCopy& c = copy(r);
  DP_CHECK(shard_grads_, "ParameterSet: release_grad needs a set sharded with shard_grads");
  if (!c.grad.defined()) return;
  NoGradGuard no_grad;
  c.shard_grad = c.grad.narrow(0, c.begin, c.end - c.begin).clone();
  c.grad = Tensor();
  bind_grad_views(r);
}

void ParameterSet::zero_grad() {
  for (auto& c : copies_) {
    if (c.grad.defined()) c.grad.zero_();
    if (c.shard_grad.defined()) c.shard_grad.zero_();
  }
  count_zero_grad();
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
  for (auto& s : slots_) {
    Tensor& p = s->copies[0];
    rebind(*p.impl(), data, s->offset);
    Tensor g = p.grad();
    if (g.defined()) rebind(*g.impl(), grad, s->offset);
  }
  c.device = device;
  c.data = data;
  c.grad = grad;
  if (c.shard_grad.defined()) c.shard_grad = c.shard_grad.to(device);
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

}  // namespace dp::nn
