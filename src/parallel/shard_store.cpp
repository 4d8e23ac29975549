#include "parallel/shard_store.h"

#include <algorithm>
#include <utility>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"
#include "dp/nn/utils.h"

namespace dp::parallel {

static_assert(ShardStore::kShardAlign % nn::utils::kNormBlock == 0,
              "Note [Clipping in blocks]: a range must never cut a block");

ShardStore::ShardStore(nn::ParameterSet& set, int processes, int process)
    : set_(set), processes_(processes), process_(process),
      received_bytes_(static_cast<std::size_t>(set.num_copies()), 0) {}

ShardStore::~ShardStore() {
  if (set_.spans() == this) set_.set_spans(nullptr);  // gone without unshard() (a failed construction)
}

ShardStore* ShardStore::of(const nn::ParameterSet& set) { return dynamic_cast<ShardStore*>(set.view_provider()); }

void ShardStore::install() { set_.set_view_provider(this); }

void ShardStore::release() {
  unshard();
  set_.set_view_provider(nullptr);
}

void ShardStore::shard(bool shard_grads, int world, int first) {
  DP_CHECK(!sharded_, "ShardStore: already sharded");
  const int n = set_.num_copies();
  if (world == 0) world = n;
  DP_CHECK(first >= 0 && world >= first + n, "ShardStore: shard: copies [", first, ", ", first + n,
           ") are not ranges of ", world, " in all");
  for (int r = 0; r < n; ++r)
    DP_CHECK(!set_.copy(r).transient, "ShardStore: cannot shard a set with transient copies (DP mode's replicas)");
  // Note [Sharded parameter sets]: equal, aligned ranges over a zero-padded buffer.
  std::int64_t len = (set_.numel() + world - 1) / world;
  len = (len + kShardAlign - 1) / kShardAlign * kShardAlign;
  set_.pad_buffers(std::max<std::int64_t>(len * world, set_.buffer_numel()));
  NoGradGuard no_grad;
  ranges_.clear();
  for (int r = 0; r < n; ++r) ranges_.push_back({.begin = len * (first + r), .end = len * (first + r + 1), .grad = {}});
  sharded_ = true;
  shard_grads_ = shard_grads;
  shard_world_ = world;
  set_.set_spans(this);
  // Each copy's own range takes the gradient copy 0 holds there: the other copies'
  // buffers are zeros, so the sum over copies stays the gradient.
  const nn::ParameterCopy& c0 = set_.copy(0);
  for (int r = 1; r < n; ++r) {
    const std::int64_t begin = ranges_[static_cast<std::size_t>(r)].begin;
    set_.copy(r).grad.narrow(0, begin, len).copy_(c0.grad.narrow(0, begin, len));
    c0.grad.narrow(0, begin, len).zero_();
  }
  if (shard_grads)
    for (int r = 0; r < n; ++r) release_grad(r);
}

void ShardStore::unshard() {
  if (!sharded_) return;
  unshard_params();
  NoGradGuard no_grad;
  const int n = set_.num_copies();
  for (int r = 0; r < n; ++r) acquire_grad(r);  // no-op unless sharded gradients
  const nn::ParameterCopy& c0 = set_.copy(0);
  for (int r = 1; r < n; ++r) {
    const nn::CopySpan s = span(r);
    c0.grad.narrow(0, s.begin, s.end - s.begin).copy_(s.owned_grad());
  }
  ranges_.clear();
  set_.set_spans(nullptr);
  sharded_ = false;
  shard_world_ = 0;
  shard_grads_ = false;
}

void ShardStore::acquire_grad(int r) {
  const nn::ParameterCopy& c = set_.copy(r);
  if (c.grad.defined()) return;
  NoGradGuard no_grad;
  Range& mine = ranges_.at(static_cast<std::size_t>(r));
  Tensor grad = zeros({set_.buffer_numel()}, c.device);
  if (mine.grad.defined()) grad.narrow(0, mine.begin, mine.end - mine.begin).copy_(mine.grad);
  mine.grad = Tensor();  // in the buffer now: one copy of the range, not two
  set_.set_grad_buffer(r, grad);
}

void ShardStore::release_grad(int r) {
  const nn::ParameterCopy& c = set_.copy(r);
  DP_CHECK(shard_grads_, "ShardStore: release_grad needs a set sharded with shard_grads");
  if (!c.grad.defined()) return;
  NoGradGuard no_grad;
  Range& mine = ranges_.at(static_cast<std::size_t>(r));
  mine.grad = c.grad.narrow(0, mine.begin, mine.end - mine.begin).clone();
  set_.set_grad_buffer(r, Tensor());
}

// Note [Copy spans]: the range; `data` is the whole buffer, or in stage 3 exactly the
// range (Note [Sharded parameter buffers]).
nn::CopySpan ShardStore::span(int copy) const {
  const nn::ParameterCopy& c = set_.copy(copy);
  const Range& mine = ranges_.at(static_cast<std::size_t>(copy));
  const std::int64_t n = mine.end - mine.begin;
  nn::CopySpan s{.begin = mine.begin, .end = mine.end, .data = c.data, .grad = mine.grad};
  if (c.data.numel() != n) s.data = c.data.narrow(0, mine.begin, n);
  if (!s.grad.defined() && c.grad.defined())
    s.grad = mine.begin == 0 && mine.end == c.grad.numel() ? c.grad : c.grad.narrow(0, mine.begin, n);
  return s;
}

// Note [Ranges across processes]: the set holds only this process's ranges.
nn::ProcessExchange* ShardStore::exchange() { return sharded_across_processes() ? this : nullptr; }

// Note [Ranges across processes]: every process's part, in process order.
std::vector<std::vector<float>> ShardStore::gather(const std::vector<float>& mine) {
  std::vector<std::vector<float>> out;
  for (int p = 0; p < processes_; ++p)
    out.push_back(dist::broadcast_object(p == process_ ? mine : std::vector<float>{}, p));
  return out;
}

// Note [Sharded parameter buffers].
void ShardStore::shard_params(Runs units) {
  DP_CHECK(sharded_ && shard_grads_, "ShardStore: shard_params needs a set sharded with shard_grads");
  DP_CHECK(!shards_params_, "ShardStore: parameters already sharded");
  DP_CHECK(units_.empty(), "ShardStore: shard_params on a set whose units are already tracked");
  assign_units(units);
  NoGradGuard no_grad;
  const auto& slots = set_.slots();
  copies_.assign(static_cast<std::size_t>(set_.num_copies()), Copy{});
  for (int r = 0; r < set_.num_copies(); ++r) {
    nn::ParameterCopy& c = set_.copy(r);
    Copy& mine = copies_[static_cast<std::size_t>(r)];
    const Range& range = ranges_[static_cast<std::size_t>(r)];
    Tensor own = c.data.narrow(0, range.begin, range.end - range.begin).clone();
    for (const auto& [lo, hi] : units) {
      Tensor t = empty({hi - lo}, c.device);
      t.storage()->release();
      mine.units.push_back(t);
    }
    mine.unit_versions.assign(units.size(), 0);
    mine.unit_sources.assign(units.size(), kNeverFilled);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const auto u = static_cast<std::size_t>(slots[i]->unit);
      set_.rebind_view(r, i, mine.units[u], slots[i]->offset - units[u].first);
    }
    c.data = own;  // the full buffer is freed here
  }
  units_ = std::move(units);
  shards_params_ = true;
}

// Each slot's unit: the one whose run holds it; an empty parameter, any (unit 0).
void ShardStore::assign_units(const Runs& units) {
  for (std::size_t u = 0; u < units.size(); ++u)
    DP_CHECK(units[u].first < units[u].second && (u == 0 || units[u - 1].second <= units[u].first),
             "ShardStore: gather unit ", u, " [", units[u].first, ", ", units[u].second,
             ") is empty or overlaps the previous one");
  for (const auto& s : set_.slots()) {
    const std::int64_t lo = s->offset, hi = s->offset + s->copies[0].numel();
    s->unit = -1;
    for (std::size_t u = 0; u < units.size(); ++u)
      if (units[u].first <= lo && hi <= units[u].second) s->unit = static_cast<int>(u);
    DP_CHECK(s->unit >= 0 || lo == hi, "ShardStore: the parameter at [", lo, ", ", hi, ") lies in no gather unit");
    if (s->unit < 0) s->unit = 0;  // an empty parameter: any unit holds it
  }
}

// Note [Tracked units].
void ShardStore::track_units(Runs units) {
  DP_CHECK(!shards_params_, "ShardStore: track_units on a set whose parameters are sharded (their units "
           "are tracked already)");
  if (units.empty()) {
    for (const auto& s : set_.slots()) s->unit = -1;
  } else {
    assign_units(units);
  }
  copies_.assign(static_cast<std::size_t>(set_.num_copies()), Copy{});
  for (Copy& c : copies_) c.ahead.assign(units.size(), {});
  units_ = std::move(units);
}

// Note [Deferred gather]: a pull into copy r's whole buffer, landing what went ahead.
//
// Note [Deferred gathers are not writes]
// The pull writes into unit u's range of copy r's flat buffer at the unit's first read
// in a forward, after that forward's graph saved the units read before it, as views of
// the same storage: to the check of Note [Saved tensors and in-place writes] (one
// version per storage) it would be a write into them, and every backward would throw.
// It writes only where no graph has read since the step that made the range stale, so
// it runs in a RefreshWriteScope, which leaves the storage's version for saved tensors
// alone. The writes that make a saved range stale are still seen: the optimizer's
// step moves the version of every copy it steps (Optimizer::step_copy), so a graph
// recorded before a step throws in its backward, here as with DDP's replicas.
void ShardStore::pull_unit(int r, int u) {
  NoGradGuard no_grad;
  autograd::RefreshWriteScope refresh;
  const auto [lo, hi] = units_.at(static_cast<std::size_t>(u));
  const Tensor& mine = set_.copy(r).data;
  auto& ahead = copies_.at(static_cast<std::size_t>(r)).ahead[static_cast<std::size_t>(u)];
  if (!ahead.empty()) {  // started by the previous unit's pull: it lands
    backend::Backend& be = backend::get(mine.device());
    for (const UnitPiece& p : std::exchange(ahead, {}))
      be.finish_copy(*p.copy, mine.data<float>() + p.at, mine.device());
    mine.storage()->bump_version();  // written behind the tensor's back: as copy_ would
    return;
  }
  for (int q = 0; q < set_.num_copies(); ++q) {
    if (q == r) continue;
    const nn::ParameterCopy& owner = set_.copy(q);
    const Range& range = ranges_[static_cast<std::size_t>(q)];
    const std::int64_t a = std::max(lo, range.begin), b = std::min(hi, range.end);
    if (a >= b) continue;
    mine.narrow(0, a, b - a).copy_(owner.data.narrow(0, a, b - a));
    count_received(r, q, b - a, mine.dtype());
  }
}

void ShardStore::pull_unit_ahead(int r, int u) {
  auto& ahead = copies_.at(static_cast<std::size_t>(r)).ahead[static_cast<std::size_t>(u)];
  if (!ahead.empty()) return;
  const auto [lo, hi] = units_.at(static_cast<std::size_t>(u));
  const nn::ParameterCopy& c = set_.copy(r);
  for (int q = 0; q < set_.num_copies(); ++q) {
    if (q == r) continue;
    const nn::ParameterCopy& owner = set_.copy(q);
    const Range& range = ranges_[static_cast<std::size_t>(q)];
    const std::int64_t a = std::max(lo, range.begin), b = std::min(hi, range.end);
    if (a >= b) continue;
    ahead.push_back({a, b - a,
                     backend::get(c.device).copy_ahead(c.device, owner.data.data<float>() + a, owner.device,
                                                       static_cast<std::size_t>(b - a) * sizeof(float))});
    count_received(r, q, b - a, Dtype::Float32);
  }
}

void ShardStore::drop_pulls_ahead() {
  if (shards_params_) return;  // stage 3's prefetches go with release_units
  for (Copy& c : copies_)
    for (auto& pieces : c.ahead) pieces.clear();
}

// Note [Sharded parameter buffers], Note [Sharded compute units]: what copy r's worker reads.
void ShardStore::gather_unit(int r, int u) {
  Tensor t = read_unit(r, u);  // a handle: the copy's buffer itself
  fill_unit(r, u, t);
}

void ShardStore::fill_unit(int r, int u, Tensor& t) {
  if (!t.storage()->released()) return;
  const nn::ParameterCopy& c = set_.copy(r);
  Copy& mine = copies_.at(static_cast<std::size_t>(r));
  const auto i = static_cast<std::size_t>(u);
  t.storage()->materialize();
  const auto [lo, hi] = units_[i];
  const bool read = t.storage() == read_unit(r, u).storage();  // only what workers read goes ahead
  if (read && mine.ahead.size() == mine.units.size() && !mine.ahead[i].empty()) {
    // Its pieces are on their way (gather_unit_ahead): they land now.
    std::vector<UnitPiece> pieces = std::move(mine.ahead[i]);
    mine.ahead[i].clear();
    backend::Backend& be = backend::get(c.device);
    auto* base = static_cast<char*>(t.raw_data());
    for (const UnitPiece& p : pieces)
      be.finish_copy(*p.copy, base + static_cast<std::size_t>(p.at) * element_size(t.dtype()), c.device);
    t.storage()->bump_version();  // written behind the tensor's back: as copy_ would
  } else {
    NoGradGuard no_grad;
    for (int q = 0; q < set_.num_copies(); ++q) {
      const Range& range = ranges_[static_cast<std::size_t>(q)];
      const std::int64_t a = std::max(lo, range.begin), b = std::min(hi, range.end);
      if (a >= b) continue;
      t.narrow(0, a - lo, b - a).copy_(source_range(q, t).narrow(0, a - range.begin, b - a));
      count_received(r, q, b - a, t.dtype());
    }
  }
  // Note [Refills are not writes].
  std::uint64_t& from = filled_from(r, u, t);
  const std::uint64_t now = sources_version(u, t);
  if (from == now) t.storage()->refilled_unchanged();
  from = now;
  if (t.storage() == mine.units[i].storage()) mine.unit_versions[i] = t.storage()->version();
}

// Note [Refills are not writes]
// Stage 3 releases a unit's buffer after the forward used it and fills it again for
// the backward. The refill writes into a storage that the forward's graph saved (a
// Linear's weight), which moves its version; to the check of Note [Saved tensors and
// in-place writes] in src/autograd/node.cpp that is a write between forward and
// backward, and the backward would throw. It is a write only when it brings other
// values: when an owner's range was written since the buffer's last fill (an
// optimizer's step between the forward and its backward, a scatter of the user's edit
// of copy 0). So each fill records the summed versions of the ranges it read, and a
// refill from unchanged ranges tells the storage that it holds again what it held
// (Storage::refilled_unchanged), which leaves its version for saved tensors where the
// forward saw it. Versions only grow, so an unchanged sum means no range was written.
std::uint64_t ShardStore::sources_version(int u, const Tensor& t) const {
  const auto [lo, hi] = units_.at(static_cast<std::size_t>(u));
  std::uint64_t v = 0;
  for (int q = 0; q < set_.num_copies(); ++q) {
    const Range& range = ranges_[static_cast<std::size_t>(q)];
    if (std::max(lo, range.begin) < std::min(hi, range.end)) v += source_range(q, t).storage()->version();
  }
  return v;
}

std::uint64_t& ShardStore::filled_from(int r, int u, const Tensor& t) {
  Copy& mine = copies_.at(static_cast<std::size_t>(r));
  const auto i = static_cast<std::size_t>(u);
  const bool compute = i < mine.compute_units.size() && mine.compute_units[i].defined() &&
                       t.storage() == mine.compute_units[i].storage();
  return compute ? mine.compute_sources.at(i) : mine.unit_sources.at(i);
}

void ShardStore::gather_unit_ahead(int r, int u) {
  const nn::ParameterCopy& c = set_.copy(r);
  Copy& mine = copies_.at(static_cast<std::size_t>(r));
  const auto i = static_cast<std::size_t>(u);
  const Tensor& t = read_unit(r, u);
  if (!t.storage()->released()) return;
  if (mine.ahead.size() != mine.units.size()) mine.ahead.assign(mine.units.size(), {});
  if (!mine.ahead[i].empty()) return;
  const auto [lo, hi] = units_[i];
  const std::size_t size = element_size(t.dtype());
  std::vector<UnitPiece> pieces;
  for (int q = 0; q < set_.num_copies(); ++q) {
    const nn::ParameterCopy& owner = set_.copy(q);
    const Range& range = ranges_[static_cast<std::size_t>(q)];
    const std::int64_t a = std::max(lo, range.begin), b = std::min(hi, range.end);
    if (a >= b) continue;
    const char* src = static_cast<const char*>(source_range(q, t).raw_data()) + static_cast<std::size_t>(a - range.begin) * size;
    pieces.push_back({a - lo, b - a,
                      backend::get(c.device).copy_ahead(c.device, src, owner.device,
                                                        static_cast<std::size_t>(b - a) * size)});
    count_received(r, q, b - a, t.dtype());
  }
  mine.ahead[i] = std::move(pieces);
}

void ShardStore::release_unit(int r, int u) {
  Copy& mine = copies_.at(static_cast<std::size_t>(r));
  const auto i = static_cast<std::size_t>(u);
  if (i < mine.ahead.size()) mine.ahead[i].clear();
  mine.units[i].storage()->release();
  if (i < mine.compute_units.size() && mine.compute_units[i].defined()) mine.compute_units[i].storage()->release();
}

void ShardStore::release_units(int r) {
  Copy& mine = copies_.at(static_cast<std::size_t>(r));
  mine.ahead.clear();
  for (auto& t : mine.units) t.storage()->release();
  for (auto& t : mine.compute_units)
    if (t.defined()) t.storage()->release();
}

bool ShardStore::unit_gathered(int r, int u) const {
  const Copy& mine = copies_.at(static_cast<std::size_t>(r));
  const auto i = static_cast<std::size_t>(u);
  const bool computed = i < mine.compute_units.size() && mine.compute_units[i].defined();
  return !mine.units.at(i).storage()->released() || (computed && !mine.compute_units[i].storage()->released());
}

// The float32 master of every unit of copy 0: what user code reads.
void ShardStore::gather_primary() {
  if (!shards_params_) return;
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) fill_unit(0, u, copies_[0].units[static_cast<std::size_t>(u)]);
}

void ShardStore::shard_compute(Dtype dtype, const std::vector<bool>& computed) {
  DP_CHECK(shards_params_, "ShardStore: shard_compute needs a set whose parameters are sharded");
  DP_CHECK(computed.size() == units_.size(), "ShardStore: shard_compute expects a flag per unit (", units_.size(),
           "), got ", computed.size());
  for (int r = 0; r < set_.num_copies(); ++r) {
    Copy& mine = copies_[static_cast<std::size_t>(r)];
    mine.compute_units.assign(units_.size(), Tensor());
    mine.compute_sources.assign(units_.size(), kNeverFilled);
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (!computed[u]) continue;
      Tensor t = empty({units_[u].second - units_[u].first}, TensorOptions{dtype, set_.copy(r).device});
      t.storage()->release();
      mine.compute_units[u] = t;
    }
  }
}

const Tensor& ShardStore::compute_unit(int r, int u) const {
  return copies_.at(static_cast<std::size_t>(r)).compute_units.at(static_cast<std::size_t>(u));
}

const Tensor& ShardStore::read_unit(int r, int u) const {
  const Copy& mine = copies_.at(static_cast<std::size_t>(r));
  const auto i = static_cast<std::size_t>(u);
  if (i < mine.compute_units.size() && mine.compute_units[i].defined()) return mine.compute_units[i];
  return mine.units.at(i);
}

const Tensor& ShardStore::source_range(int q, const Tensor& unit) const {
  const nn::ParameterCopy& owner = set_.copy(q);
  return unit.dtype() == owner.data.dtype() ? owner.data : owner.compute;
}

std::int64_t ShardStore::received_bytes(int r) const { return received_bytes_.at(static_cast<std::size_t>(r)); }

void ShardStore::count_received(int r, int q, std::int64_t numel, Dtype dtype) {
  if (q != r) received_bytes_[static_cast<std::size_t>(r)] += numel * static_cast<std::int64_t>(element_size(dtype));
}

bool ShardStore::scatter_primary() {
  if (!shards_params_) return false;
  Copy& c0 = copies_[0];
  bool wrote = false;
  NoGradGuard no_grad;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const Tensor& t = c0.units[u];
    if (t.storage()->released()) continue;
    if (t.storage()->version() != c0.unit_versions[u]) {
      const auto [lo, hi] = units_[u];
      for (int q = 0; q < set_.num_copies(); ++q) {
        const nn::ParameterCopy& owner = set_.copy(q);
        const Range& range = ranges_[static_cast<std::size_t>(q)];
        const std::int64_t a = std::max(lo, range.begin), b = std::min(hi, range.end);
        if (a < b) owner.data.narrow(0, a - range.begin, b - a).copy_(t.narrow(0, a - lo, b - a));
      }
      wrote = true;
    }
    t.storage()->release();
  }
  return wrote;
}

void ShardStore::before_read(int copy, int unit) {
  if (copy < 0) {
    if (shards_params_ && !unit_gathered(0, unit)) gather_primary();  // tracked units: copy 0 is whole
  } else if (read_hook_) {
    read_hook_(copy, unit);
  } else if (shards_params_) {
    gather_unit(copy, unit);
  }
}

// Every copy gets a full buffer again, assembled from every copy's range.
void ShardStore::unshard_params() {
  if (!shards_params_) {
    track_units({});
    return;
  }
  scatter_primary();  // edits made through copy 0 since it was gathered
  NoGradGuard no_grad;
  const int n = set_.num_copies();
  std::vector<Tensor> full;
  for (int r = 0; r < n; ++r) {
    Tensor t = zeros({set_.buffer_numel()}, set_.copy(r).device);
    for (int q = 0; q < n; ++q) {
      const nn::ParameterCopy& owner = set_.copy(q);
      const Range& range = ranges_[static_cast<std::size_t>(q)];
      t.narrow(0, range.begin, range.end - range.begin).copy_(owner.data);
    }
    full.push_back(t);
  }
  const auto& slots = set_.slots();
  for (int r = 0; r < n; ++r) {
    const Tensor& buffer = full[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < slots.size(); ++i) set_.rebind_view(r, i, buffer, slots[i]->offset);
    set_.copy(r).data = buffer;
  }
  copies_.clear();
  for (const auto& s : slots) s->unit = -1;
  units_.clear();
  shards_params_ = false;
}

}  // namespace dp::parallel
