#include "dp/nn/parameter_set.h"

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"

namespace dp::nn {
namespace {

thread_local int t_bound_copy = 0;

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
  if (r > 0 && r < static_cast<int>(slot_->copies.size()) && slot_->copies[r].defined())
    return slot_->copies[r];
  return slot_->copies[0];
}

ReplicaBinding::ReplicaBinding(int copy) : prev_(t_bound_copy) { t_bound_copy = copy; }
ReplicaBinding::~ReplicaBinding() { t_bound_copy = prev_; }
int ReplicaBinding::current() { return t_bound_copy; }

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
  ParameterCopy primary{device, empty({numel_}, device), zeros({numel_}, device)};
  for (auto& s : slots_) {
    Tensor& p = s->copies[0];
    primary.data.detach().narrow(0, s->offset, p.numel()).copy_(p.reshape({p.numel()}));
    rebind(*p.impl(), primary.data, s->offset);
    Tensor g = view_of(primary.grad, s->offset, p.shape());
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

int ParameterSet::add_copy(Device device, bool transient) {
  NoGradGuard no_grad;
  ParameterCopy c{device, empty({numel_}, device), zeros({numel_}, device), transient};
  c.data.copy_(copies_[0].data);
  copies_.push_back(std::move(c));
  int r = num_copies() - 1;
  bind_views(r);
  return r;
}

void ParameterSet::drop_copies() {
  copies_.resize(1);
  for (auto& s : slots_) s->copies.resize(1);
}

void ParameterSet::move_primary(Device device) {
  ParameterCopy& c = copies_[0];
  if (c.device == device) return;
  NoGradGuard no_grad;
  Tensor data = c.data.to(device), grad = c.grad.to(device);
  for (auto& s : slots_) {
    Tensor& p = s->copies[0];
    rebind(*p.impl(), data, s->offset);
    Tensor g = p.grad();
    if (g.defined()) rebind(*g.impl(), grad, s->offset);
  }
  c = ParameterCopy{device, data, grad, false};
  bump_version();
}

void ParameterSet::for_each_copy(const std::function<void(int)>& fn, CopyWork work) {
  auto run = [&](int r) {
    if (!copies_[r].transient) fn(r);
  };
  if (executor_) {
    executor_(num_copies(), work, run);
  } else {
    for (int r = 0; r < num_copies(); ++r) run(r);
  }
}

}  // namespace dp::nn
