#include "dp/nn/parameter_set.h"

#include <algorithm>

#include "backend/backend.h"
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
  if (slot_->unit >= 0) {  // Note [Sharded parameter buffers]
    if (auto set = slot_->set.lock()) set->on_unit_access(t_bound ? r : -1, slot_->unit);
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
  if (sharded_data || (begin == 0 && end == data.numel())) return data;
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

// Note [Sharded parameter buffers].
void ParameterSet::shard_params(std::vector<std::pair<std::int64_t, std::int64_t>> units) {
  DP_CHECK(sharded_ && shard_grads_, "ParameterSet: shard_params needs a set sharded with shard_grads");
  DP_CHECK(!shards_params_, "ParameterSet: parameters already sharded");
  DP_CHECK(units_.empty(), "ParameterSet: shard_params on a set whose units are already tracked");
  assign_units(units);
  NoGradGuard no_grad;
  for (int r = 0; r < num_copies(); ++r) {
    ParameterCopy& c = copies_[r];
    Tensor own = c.data.narrow(0, c.begin, c.end - c.begin).clone();
    c.units.clear();
    c.ahead.clear();
    for (const auto& [lo, hi] : units) {
      Tensor t = empty({hi - lo}, c.device);
      t.storage()->release();
      c.units.push_back(t);
    }
    c.unit_versions.assign(units.size(), 0);
    for (auto& s : slots_) rebind(*s->copies[r].impl(), c.units[s->unit], s->offset - units[s->unit].first);
    c.data = own;  // the full buffer is freed here
    c.sharded_data = true;
  }
  units_ = std::move(units);
  shards_params_ = true;
}

// Each slot's unit: the one whose run holds it; an empty parameter, any (unit 0).
void ParameterSet::assign_units(const std::vector<std::pair<std::int64_t, std::int64_t>>& units) {
  for (std::size_t u = 0; u < units.size(); ++u)
    DP_CHECK(units[u].first < units[u].second && (u == 0 || units[u - 1].second <= units[u].first),
             "ParameterSet: gather unit ", u, " [", units[u].first, ", ", units[u].second,
             ") is empty or overlaps the previous one");
  for (auto& s : slots_) {
    const std::int64_t lo = s->offset, hi = s->offset + s->copies[0].numel();
    s->unit = -1;
    for (std::size_t u = 0; u < units.size(); ++u)
      if (units[u].first <= lo && hi <= units[u].second) s->unit = static_cast<int>(u);
    DP_CHECK(s->unit >= 0 || lo == hi, "ParameterSet: the parameter at [", lo, ", ", hi, ") lies in no gather unit");
    if (s->unit < 0) s->unit = 0;  // an empty parameter: any unit holds it
  }
}

// Note [Tracked units].
void ParameterSet::track_units(std::vector<std::pair<std::int64_t, std::int64_t>> units) {
  DP_CHECK(!shards_params_, "ParameterSet: track_units on a set whose parameters are sharded (their units "
           "are tracked already)");
  if (units.empty()) {
    for (auto& s : slots_) s->unit = -1;
  } else {
    assign_units(units);
  }
  units_ = std::move(units);
}

void ParameterSet::gather_unit(int r, int u) {
  ParameterCopy& c = copy(r);
  Tensor& t = c.units[static_cast<std::size_t>(u)];
  if (!t.storage()->released()) return;
  t.storage()->materialize();
  const auto [lo, hi] = units_[static_cast<std::size_t>(u)];
  if (c.ahead.size() == c.units.size() && !c.ahead[static_cast<std::size_t>(u)].empty()) {
    // Its pieces are on their way (gather_unit_ahead): they land now.
    std::vector<ParameterCopy::UnitPiece> pieces = std::move(c.ahead[static_cast<std::size_t>(u)]);
    c.ahead[static_cast<std::size_t>(u)].clear();
    backend::Backend& be = backend::get(c.device);
    for (const ParameterCopy::UnitPiece& p : pieces)
      be.finish_copy(*p.copy, t.data<float>() + p.at, c.device);
    t.storage()->bump_version();  // written behind the tensor's back: as copy_ would
  } else {
    NoGradGuard no_grad;
    for (const ParameterCopy& q : copies_) {
      const std::int64_t a = std::max(lo, q.begin), b = std::min(hi, q.end);
      if (a < b) t.narrow(0, a - lo, b - a).copy_(q.data.narrow(0, a - q.begin, b - a));
    }
  }
  c.unit_versions[static_cast<std::size_t>(u)] = t.storage()->version();
}

void ParameterSet::gather_unit_ahead(int r, int u) {
  ParameterCopy& c = copy(r);
  const auto i = static_cast<std::size_t>(u);
  if (!c.units[i].storage()->released()) return;
  if (c.ahead.size() != c.units.size()) c.ahead.assign(c.units.size(), {});
  if (!c.ahead[i].empty()) return;
  const auto [lo, hi] = units_[i];
  std::vector<ParameterCopy::UnitPiece> pieces;
  for (const ParameterCopy& q : copies_) {
    const std::int64_t a = std::max(lo, q.begin), b = std::min(hi, q.end);
    if (a >= b) continue;
    const float* src = q.data.data<float>() + (a - q.begin);
    pieces.push_back({a - lo, b - a,
                      backend::get(c.device).copy_ahead(c.device, src, q.device,
                                                        static_cast<std::size_t>(b - a) * sizeof(float))});
  }
  c.ahead[i] = std::move(pieces);
}

void ParameterSet::release_unit(int r, int u) {
  ParameterCopy& c = copy(r);
  if (static_cast<std::size_t>(u) < c.ahead.size()) c.ahead[static_cast<std::size_t>(u)].clear();
  c.units[static_cast<std::size_t>(u)].storage()->release();
}

void ParameterSet::release_units(int r) {
  ParameterCopy& c = copy(r);
  c.ahead.clear();
  for (auto& t : c.units) t.storage()->release();
}

bool ParameterSet::unit_gathered(int r, int u) const {
  return !copy(r).units[static_cast<std::size_t>(u)].storage()->released();
}

void ParameterSet::gather_primary() {
  if (!shards_params_) return;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) gather_unit(0, u);
}

bool ParameterSet::scatter_primary() {
  if (!shards_params_) return false;
  ParameterCopy& c0 = copies_[0];
  bool wrote = false;
  NoGradGuard no_grad;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const Tensor& t = c0.units[u];
    if (t.storage()->released()) continue;
    if (t.storage()->version() != c0.unit_versions[u]) {
      const auto [lo, hi] = units_[u];
      for (ParameterCopy& q : copies_) {
        const std::int64_t a = std::max(lo, q.begin), b = std::min(hi, q.end);
        if (a < b) q.data.narrow(0, a - q.begin, b - a).copy_(t.narrow(0, a - lo, b - a));
      }
      wrote = true;
    }
    t.storage()->release();
  }
  return wrote;
}

void ParameterSet::on_unit_access(int copy, int unit) {
  if (copy < 0) {
    if (shards_params_ && !unit_gathered(0, unit)) gather_primary();  // tracked units: copy 0 is whole
  } else if (unit_hook_) {
    unit_hook_(copy, unit);
  } else if (shards_params_) {
    gather_unit(copy, unit);
  }
}

// Every copy gets a full buffer again, assembled from every copy's range.
void ParameterSet::unshard_params() {
  if (!shards_params_) {
    track_units({});
    return;
  }
  scatter_primary();  // edits made through copy 0 since it was gathered
  NoGradGuard no_grad;
  std::vector<Tensor> full;
  for (ParameterCopy& c : copies_) {
    Tensor t = zeros({buffer_numel_}, c.device);
    for (const ParameterCopy& q : copies_) t.narrow(0, q.begin, q.end - q.begin).copy_(q.data);
    full.push_back(t);
  }
  for (int r = 0; r < num_copies(); ++r) {
    ParameterCopy& c = copies_[r];
    for (auto& s : slots_) rebind(*s->copies[r].impl(), full[r], s->offset);
    c.data = full[r];
    c.units.clear();
    c.ahead.clear();
    c.unit_versions.clear();
    c.sharded_data = false;
  }
  for (auto& s : slots_) s->unit = -1;
  units_.clear();
  shards_params_ = false;
}

void ParameterSet::unshard() {
  if (!sharded_) return;
  unshard_params();
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
