#include "dp/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string_view>
#include <map>
#include <set>
#include <utility>

#include "backend/backend.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/optim/step_executor.h"

namespace dp::optim {

namespace {

// i when `name` is "state.<i>.step" with i < n (an entry's own step count, Note [Frozen
// parameters in a step]), else nullopt.
std::optional<std::size_t> entry_step_index(const std::string& name, std::size_t n) {
  constexpr std::string_view prefix = "state.", suffix = ".step";
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  const auto i = static_cast<std::size_t>(std::stoul(digits));
  return i < n ? std::optional<std::size_t>(i) : std::nullopt;
}

}  // namespace

Optimizer::Optimizer(nn::ParameterList params, std::string kind) : kind_(std::move(kind)) {
  DP_CHECK(!params.empty(), kind_, ": expected at least one parameter, got an empty list; pass "
           "net->parameters() of a module that has parameters");
  std::vector<nn::ParameterList> groups;
  groups.push_back(std::move(params));
  join_groups(std::move(groups));
}

Optimizer::Optimizer(std::vector<nn::ParameterList> groups, std::string kind) : kind_(std::move(kind)) {
  DP_CHECK(!groups.empty(), kind_, ": expected at least one parameter group, got none; pass {{params, {...}}, ...} "
           "or a parameter list");
  join_groups(std::move(groups));
}

// Note [Parameter groups] in optimizer.h: the groups' parameters concatenated in group
// order are the optimizer's parameters(); a set's ranges come from build_ranges.
void Optimizer::join_groups(std::vector<nn::ParameterList> groups) {
  const auto& set0 = groups.front().set();
  std::vector<Tensor> tensors;
  std::vector<std::shared_ptr<nn::Parameter::Slot>> slots;
  std::map<const TensorImpl*, std::size_t> group_of_tensor;  // a parameter twice: which groups
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const nn::ParameterList& list = groups[g];
    const std::string where = groups.size() > 1 ? detail::str_cat(" of param group ", g) : std::string();
    DP_CHECK(!list.empty(), kind_, ": expected at least one parameter in each group, got an empty param group ", g,
             " (of ", groups.size(), "); leave the group out or give it parameters");
    DP_CHECK(list.set() == set0, kind_, ": expected every group's parameters from one parameter set (one module's "
             "parameters()) or every group of loose tensors, got param group 0 of ",
             set0 ? "a module's parameters" : "loose tensors", " and param group ", g, " of ",
             !list.set() ? "loose tensors" : set0 ? "another module's parameters" : "a module's parameters",
             "; build one optimizer per module, its groups with parameters().filter(...)");
    DP_CHECK(!set0 || list.slots().size() == list.size(), kind_, ": param group ", g, " has ", list.size(),
             " tensors but ", list.slots().size(), " slots");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Tensor& t = list[i];
      const std::size_t index = tensors.size();
      DP_CHECK(t.defined(), kind_, ": parameter ", index, where, " is an undefined tensor");
      DP_CHECK(t.dtype() == Dtype::Float32, kind_, ": expected float32 parameters, got ", dtype_name(t.dtype()),
               " for parameter ", index, where, " (", t.str(), ")");
      auto [it, fresh] = group_of_tensor.emplace(t.impl(), g);
      DP_CHECK(fresh || groups.size() == 1, kind_, ": expected each parameter in one group, got parameter ", index,
               " (", t.str(), ") in param group ", it->second, " and again in param group ", g,
               " (a tied parameter is one parameter); pass each parameter once");
      DP_CHECK(fresh || set0, kind_, ": parameter ", index, " appears twice in the list; pass each tensor once");
      tensors.push_back(t);
      if (set0) slots.push_back(list.slots()[i]);
    }
    groups_.push_back(Group{list, tensors.size() - list.size(), std::nullopt});
  }
  params_ = nn::ParameterList(std::move(tensors), std::move(slots), set0);
  if (!set0) {
    states_.resize(params_.size());
    return;
  }
  check_valid();
  build_ranges();
}

std::size_t Optimizer::group_of(std::size_t entry) const {
  std::size_t g = groups_.size() - 1;
  while (groups_[g].first > entry) --g;
  return g;
}

void Optimizer::build_ranges() {
  const auto& set = params_.set();
  const auto& slots = params_.slots();
  // Each entry's [offset, offset + numel) in the set's flat buffers, and its group.
  struct Span {
    std::int64_t offset, numel;
    std::size_t group;
    bool operator<(const Span& o) const { return offset < o.offset; }
  };
  std::vector<Span> spans;
  std::set<const nn::Parameter::Slot*> seen;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto& slot = slots[i];
    DP_CHECK(slot && slot->set.lock() == set && !slot->is_buffer, kind_, ": parameter ", i,
             " does not belong to the list's parameter set");
    DP_CHECK(seen.insert(slot.get()).second, kind_, ": parameter '", slot->name,
             "' appears twice in the list; pass each parameter once");
    spans.push_back(Span{slot->offset, params_[i].numel(), group_of(i)});
  }

  entry_state_offset_.resize(slots.size());
  if (seen.size() == set->size() && groups_.size() == 1) {
    // The whole set: one range over the flat buffer (gaps for alignment, if any, hold
    // zeros in data and grad and stay zero under every update we run).
    ranges_.push_back(Range{0, set->numel(), 0});
    state_numel_ = set->numel();
    for (std::size_t i = 0; i < spans.size(); ++i) entry_state_offset_[i] = spans[i].offset;
  } else {
    std::vector<Span> sorted = spans;
    std::sort(sorted.begin(), sorted.end());
    for (const Span& sp : sorted) {
      const bool adjacent = !ranges_.empty() && ranges_.back().offset + ranges_.back().numel == sp.offset;
      if (adjacent && ranges_.back().group == sp.group) {
        ranges_.back().numel += sp.numel;  // adjacent in the flat buffer, one group: one kernel call
      } else {
        ranges_.push_back(Range{sp.offset, sp.numel, state_numel_, sp.group});
      }
      state_numel_ += sp.numel;
    }
    for (std::size_t i = 0; i < spans.size(); ++i) {
      const std::int64_t off = spans[i].offset;
      auto it = std::upper_bound(ranges_.begin(), ranges_.end(), off,
                                 [](std::int64_t o, const Range& r) { return o < r.offset; });
      DP_ASSERT(it != ranges_.begin());
      --it;
      entry_state_offset_[i] = it->state_offset + (off - it->offset);
    }
  }
  for (const Range& r : ranges_) {
    DP_ASSERT(r.offset >= 0 && r.offset + r.numel <= set->numel(), "range [", r.offset, ", ",
              r.offset + r.numel, ") outside the flat buffer of ", set->numel());
    if (!flat_ranges_.empty() && flat_ranges_.back().offset + flat_ranges_.back().numel == r.offset) {
      flat_ranges_.back().numel += r.numel;
    } else {
      flat_ranges_.push_back(Range{r.offset, r.numel, 0});
    }
  }
}

Optimizer::~Optimizer() = default;

void Optimizer::set_momentum(double momentum) {
  DP_FAIL(kind_, ": this optimizer has no momentum to set (got ", momentum,
          "); use SGD, Adam or AdamW, or turn momentum cycling off in the scheduler");
}

void Optimizer::update(Device /*dev*/, float* /*param*/, const float* /*grad*/, float* const* /*state*/,
                       std::int64_t /*n*/, bool /*first*/, std::int64_t /*step*/) {
  DP_FAIL(kind_, ": an optimizer must override update() or update_group()");
}

void Optimizer::update_group(std::size_t /*group*/, Device dev, float* param, const float* grad, float* const* state,
                             std::int64_t n, bool first, std::int64_t step) {
  update(dev, param, grad, state, n, first, step);
}

// ---- parameter groups (Note [Parameter groups]) ------------------------------------------

std::string Optimizer::group_name(std::size_t group) const {
  return groups_.size() == 1 ? kind_ : detail::str_cat(kind_, " param group ", group);
}

void Optimizer::check_group(std::size_t group, const char* what) const {
  DP_CHECK(group < groups_.size(), kind_, ".", what, ": expected a param group index below ", groups_.size(), ", got ",
           group);
}

const nn::ParameterList& Optimizer::group_parameters(std::size_t group) const {
  check_group(group, "group_parameters");
  return groups_[group].params;
}

std::optional<double> Optimizer::initial_lr(std::size_t group) const {
  check_group(group, "initial_lr");
  return groups_[group].initial_lr;
}

void Optimizer::set_initial_lr(std::optional<double> lr) {
  for (Group& g : groups_) g.initial_lr = lr;
}

void Optimizer::set_initial_lr(std::size_t group, std::optional<double> lr) {
  check_group(group, "set_initial_lr");
  groups_[group].initial_lr = lr;
}

// The defaults of an optimizer with one group: its lr() and momentum().
double Optimizer::group_lr(std::size_t group) const {
  check_group(group, "group_lr");
  return lr();
}

void Optimizer::set_group_lr(std::size_t group, double lr) {
  check_group(group, "set_group_lr");
  set_lr(lr);
}

std::optional<double> Optimizer::group_momentum(std::size_t group) const {
  check_group(group, "group_momentum");
  return momentum();
}

void Optimizer::set_group_momentum(std::size_t group, double momentum) {
  check_group(group, "set_group_momentum");
  set_momentum(momentum);
}

std::map<std::string, std::vector<double>> Optimizer::group_options(std::size_t group) const {
  std::map<std::string, std::vector<double>> out{{"lr", {group_lr(group)}}};
  if (const auto m = group_momentum(group)) out["momentum"] = {*m};
  return out;
}

void Optimizer::set_group_options(std::size_t group, const std::map<std::string, std::vector<double>>& options) {
  const auto own = group_options(group);
  check_option_names(group, own, options);
  set_group_lr(group, options.at("lr")[0]);
  if (options.count("momentum")) set_group_momentum(group, options.at("momentum")[0]);
}

void Optimizer::check_option_names(std::size_t group, const std::map<std::string, std::vector<double>>& own,
                                   const std::map<std::string, std::vector<double>>& given) const {
  std::string missing, unexpected;
  for (const auto& [name, v] : own) {
    auto it = given.find(name);
    if (it == given.end()) {
      missing += detail::str_cat(missing.empty() ? "" : ", ", name);
    } else {
      DP_CHECK(it->second.size() == v.size(), group_name(group), ": expected ", v.size(), " value(s) for '", name,
               "', got ", it->second.size());
    }
  }
  for (const auto& [name, v] : given)
    if (!own.count(name)) unexpected += detail::str_cat(unexpected.empty() ? "" : ", ", name);
  DP_CHECK(missing.empty() && unexpected.empty(), group_name(group), ": expected the hyper-parameters of ", kind_,
           missing.empty() ? "" : detail::str_cat("; missing: ", missing),
           unexpected.empty() ? "" : detail::str_cat("; unexpected: ", unexpected),
           ". Was the state saved by another optimizer type?");
}

std::vector<ParamGroupState> Optimizer::param_groups_state() const {
  std::vector<ParamGroupState> out;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    ParamGroupState st;
    for (std::size_t i = 0; i < groups_[g].params.size(); ++i)
      st.params.push_back(static_cast<std::int64_t>(groups_[g].first + i));
    st.options = group_options(g);
    if (groups_[g].initial_lr) st.options["initial_lr"] = {*groups_[g].initial_lr};
    out.push_back(std::move(st));
  }
  return out;
}

namespace {

std::string describe_groups(const std::vector<std::vector<std::int64_t>>& groups) {
  std::string s = detail::str_cat(groups.size(), " param group(s) of ");
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& p = groups[g];
    s += detail::str_cat(g ? ", " : "", p.size(), " parameter(s)");
    if (!p.empty()) s += detail::str_cat(" (", p.front(), p.size() > 1 ? detail::str_cat("..", p.back()) : "", ")");
  }
  return s;
}

}  // namespace

void Optimizer::load_param_groups_state(const std::vector<ParamGroupState>& groups) {
  std::vector<std::vector<std::int64_t>> want, got;
  for (const ParamGroupState& st : param_groups_state()) want.push_back(st.params);
  for (const ParamGroupState& st : groups) got.push_back(st.params);
  DP_CHECK(want == got, kind_, ".load_param_groups_state: expected ", describe_groups(want), ", got ",
           describe_groups(got), "; build the optimizer with the param groups of the saved run");
  // All or nothing: a group whose options are refused restores every group's.
  std::vector<std::map<std::string, std::vector<double>>> old;
  std::vector<std::optional<double>> old_initial;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    old.push_back(group_options(g));
    old_initial.push_back(groups_[g].initial_lr);
  }
  try {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto options = groups[g].options;
      std::optional<double> initial;
      if (auto it = options.find("initial_lr"); it != options.end()) {
        DP_CHECK(it->second.size() == 1, group_name(g), ": expected one value for 'initial_lr', got ",
                 it->second.size());
        initial = it->second[0];
        options.erase(it);
      }
      set_group_options(g, options);
      groups_[g].initial_lr = initial;
    }
  } catch (...) {
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      set_group_options(g, old[g]);
      groups_[g].initial_lr = old_initial[g];
    }
    throw;
  }
}

void Optimizer::check_valid() const {
  const auto& set = params_.set();
  DP_CHECK(!set || set->valid(), kind_,
           ": parameters were re-flattened after this optimizer was built; build the "
           "optimizer after wrapping the model (e.g. on model.parameters() of the "
           "DataParallel wrapper)");
}

void Optimizer::allocate_state(CopyState& st, Device dev, const Shape& shape) {
  const std::size_t k = state_names().size();
  st.buffers.clear();
  for (std::size_t i = 0; i < k; ++i) st.buffers.push_back(zeros(shape, dev));
  st.started.assign(groups_.size(), false);
}

Optimizer::CopyState Optimizer::layout(const nn::CopySpan& span) const {
  CopyState st;
  st.data = span.data.storage();
  st.begin = span.begin;
  st.end = span.end;
  for (const Range& r : ranges_) {
    const std::int64_t lo = std::max(r.offset, span.begin), hi = std::min(r.offset + r.numel, span.end);
    if (lo >= hi) continue;
    st.ranges.push_back(Range{lo, hi - lo, st.numel, r.group});
    st.numel += hi - lo;
  }
  return st;
}

// Copies every element both states cover from src into dst (any devices).
void Optimizer::copy_state(CopyState& dst, const CopyState& src) {
  for (const Range& d : dst.ranges) {
    for (const Range& s : src.ranges) {
      const std::int64_t lo = std::max(d.offset, s.offset), hi = std::min(d.offset + d.numel, s.offset + s.numel);
      if (lo >= hi) continue;
      for (std::size_t k = 0; k < dst.buffers.size(); ++k) {
        dst.buffers[k]
            .narrow(0, d.state_offset + (lo - d.offset), hi - lo)
            .copy_(src.buffers[k].narrow(0, s.state_offset + (lo - s.offset), hi - lo));
      }
    }
  }
}

// Note [Optimizer state layouts]
// A copy's state covers the optimizer's ranges clipped to the copy's span and
// belongs to one data buffer. Before each step (on the calling thread, never inside
// the executor: building one copy's state reads others') every copy whose buffer or
// range changed gets a new state, filled element by element from the states that
// exist: the primary's where it has them (DDP wrapping after some steps: each new
// copy starts from the primary's state), else the copy that held them (sharding
// hands each copy its range of the primary's state; unsharding gathers every range
// back into the primary; a load hands each copy its range of the loaded state).
void Optimizer::rebuild_states(const std::vector<CopyState>& old, const std::vector<CopyState>& sources) {
  nn::ParameterSet& set = *params_.set();
  const int nc = set.num_copies();
  const std::size_t k = state_names().size();
  std::vector<CopyState> next(static_cast<std::size_t>(nc));
  std::vector<int> rebuilt;
  for (int r = 0; r < nc; ++r) {
    const nn::ParameterCopy& copy = set.copy(r);
    if (copy.transient) continue;
    CopyState want = layout(nn::copy_span(set, r));
    if (static_cast<std::size_t>(r) < old.size()) {
      const CopyState& o = old[static_cast<std::size_t>(r)];
      const bool same = o.data.lock() == copy.data.storage() && o.begin == want.begin && o.end == want.end &&
                        (o.buffers.empty() || o.buffers[0].device() == copy.device);
      if (same) {
        next[static_cast<std::size_t>(r)] = o;
        continue;
      }
    }
    next[static_cast<std::size_t>(r)] = std::move(want);
    rebuilt.push_back(r);
  }
  const bool any = std::any_of(sources.begin(), sources.end(), [](const CopyState& s) { return !s.buffers.empty(); });
  if (k > 0 && any) {
    for (int r : rebuilt) {
      CopyState& st = next[static_cast<std::size_t>(r)];
      allocate_state(st, set.copy(r).device, {st.numel});
      // The primary (sources[0]) last: its values win where it has them.
      for (std::size_t i = sources.size(); i-- > 0;) {
        if (sources[i].buffers.empty()) continue;
        copy_state(st, sources[i]);
        for (std::size_t g = 0; g < st.started.size(); ++g) st.started[g] = st.started[g] || sources[i].started[g];
      }
    }
  }
  states_ = std::move(next);
}

// Runs on the calling thread before the copies step concurrently (Note [Optimizer
// state layouts]).
void Optimizer::prepare_states() {
  const std::vector<CopyState> old = states_;
  rebuild_states(old, old);
}

// Note [Frozen parameters in a step]: runs on the calling thread before the copies step.
// An entry no gradient reached since zero_grad(true) is skipped the same way (Note
// [Parameters without a gradient]).
std::vector<std::int64_t> Optimizer::plan_pieces() {
  const auto& slots = params_.slots();
  params_.set()->collect_arrived_grads();
  std::vector<std::int64_t> frozen = frozen_steps_;
  frozen.resize(params_.size(), 0);
  std::vector<Piece> pieces;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad() || !slots[i]->got_grad) {
      ++frozen[i];
      continue;
    }
    const std::int64_t begin = slots[i]->offset;
    const bool fresh = i >= entry_started_.size() || !entry_started_[i];
    pieces.push_back(Piece{begin, begin + params_[i].numel(), step_ - frozen[i], fresh});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
  pieces_.clear();
  for (const Piece& piece : pieces) {
    Piece* last = pieces_.empty() ? nullptr : &pieces_.back();
    if (last && last->end == piece.begin && last->step == piece.step && last->fresh == piece.fresh) {
      last->end = piece.end;
    } else {
      pieces_.push_back(piece);
    }
  }
  return frozen;
}

void Optimizer::step_copy(int r) {
  nn::ParameterSet& set = *params_.set();
  nn::ParameterCopy& copy = set.copy(r);
  CopyState& st = states_[static_cast<std::size_t>(r)];
  const std::size_t k = state_names().size();
  if (k > 0 && st.buffers.empty()) allocate_state(st, copy.device, {st.numel});
  const nn::CopySpan span = nn::copy_span(set, r);  // element i of the buffers at [i - span.begin]
  float* p = span.data.data<float>();
  const float* g = span.owned_grad().data<float>();
  std::vector<float*> sp(k);
  const std::vector<bool> started = st.started;  // a group may hold several ranges
  for (const Range& range : st.ranges) {
    const std::int64_t end = range.offset + range.numel;
    // The pieces of this step inside the range (Note [Frozen parameters in a step]).
    auto it = std::upper_bound(pieces_.begin(), pieces_.end(), range.offset,
                               [](std::int64_t at, const Piece& piece) { return at < piece.end; });
    bool stepped = false;
    for (; it != pieces_.end() && it->begin < end; ++it) {
      const std::int64_t lo = std::max(it->begin, range.offset), hi = std::min(it->end, end);
      for (std::size_t j = 0; j < k; ++j) sp[j] = st.buffers[j].data<float>() + range.state_offset + (lo - range.offset);
      const bool first = k > 0 && (!started[range.group] || it->fresh);
      update_group(range.group, copy.device, p + (lo - span.begin), g + (lo - span.begin), sp.data(), hi - lo, first,
                   it->step);
      stepped = true;
    }
    if (stepped && k > 0 && group_uses_state(range.group)) st.started[range.group] = true;
  }
  // Moved by hand, once every range is stepped, not by mutable_data before: a copy whose
  // update threw keeps its version, so DataParallel sees the copies were written
  // unequally and re-syncs them (Note [Storage versions]).
  copy.data.storage()->bump_version();
}

// Returns the skips this step leaves per tensor (Note [Parameters without a gradient]).
std::vector<std::int64_t> Optimizer::step_loose() {
  const std::size_t k = state_names().size();
  std::vector<float*> sp(k);
  std::vector<std::int64_t> skipped = frozen_steps_;
  skipped.resize(params_.size(), 0);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor& t = params_[i];
    Tensor g = t.grad();
    // Like PyTorch: a tensor without a gradient is skipped, its count too; a module's
    // parameter listed loose has none until one arrives or set_grad gives it one.
    if (!g.defined() || (autograd::grad_pinned(t) && !autograd::grad_arrived(t))) {
      ++skipped[i];
      continue;
    }
    DP_CHECK(g.shape() == t.shape() && g.device() == t.device() && g.dtype() == Dtype::Float32,
             kind_, ": parameter ", i, " (", t.str(), ") has a gradient ", g.str(),
             " of another shape, device or dtype");
    CopyState& st = states_[i];
    if (k > 0 && (st.buffers.empty() || st.buffers[0].device() != t.device())) {
      allocate_state(st, t.device(), t.shape());
    }
    for (std::size_t j = 0; j < k; ++j) sp[j] = st.buffers[j].data<float>();
    const float* gp = g.data<float>();
    const std::size_t group = group_of(i);
    const bool first = k > 0 && !st.started[group];
    update_group(group, t.device(), t.mutable_data<float>(), gp, sp.data(), t.numel(), first, step_ - skipped[i]);
    if (k > 0 && group_uses_state(group)) st.started[group] = true;
  }
  return skipped;
}

// Every persistent copy's step: through the set's executor when it has one (Note
// [Copy executors] in dp/nn/copy_executor.h), else in order on this thread.
void Optimizer::step_copies(nn::ParameterSet& set) {
  auto run = [this, &set](int r) {
    if (!set.copy(r).transient) step_copy(r);
  };
  if (nn::CopyExecutor* executor = set.executor()) {
    auto* stepper = dynamic_cast<StepExecutor*>(executor);
    DP_CHECK(stepper != nullptr, kind_, ".step: the parameters' copies are run by an executor that cannot "
             "step them (a dp::nn::CopyExecutor, not a dp::optim::StepExecutor)");
    stepper->step_copies(set.num_copies(), run);
  } else {
    for (int r = 0; r < set.num_copies(); ++r) run(r);
  }
}

void Optimizer::step() {
  check_valid();
  ++step_;
  try {
    if (const auto& set = params_.set()) {
      prepare_states();
      std::vector<std::int64_t> frozen = plan_pieces();
      step_copies(*set);
      entry_started_.resize(params_.size(), false);
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (frozen[i] == (i < frozen_steps_.size() ? frozen_steps_[i] : 0) && group_uses_state(group_of(i)))
          entry_started_[i] = true;  // stepped now, with state
      frozen_steps_ = std::move(frozen);
      set->bump_version();
    } else {
      frozen_steps_ = step_loose();
    }
  } catch (...) {
    --step_;
    // Some copies may have been updated (in part) before the failure: count it as a
    // change, so DataParallel re-broadcasts device 0's parameters to the other
    // replicas before the next forward instead of running on diverged copies. Their
    // optimizer state follows device 0's too: forgetting every other copy's state
    // makes the next prepare_states() copy it from the primary, so all replicas
    // continue from one parameter vector AND one state. A set whose copies own parts
    // keeps every copy's state: it is the only state of that copy's span.
    if (const auto& set = params_.set()) {
      set->bump_version();
      if (!nn::spans_cut(*set))
        for (std::size_t r = 1; r < states_.size(); ++r) states_[r] = CopyState{};
    }
    throw;
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  check_valid();
  const auto& set = params_.set();
  if (!set) {
    for (const Tensor& t : params_) {
      Tensor g = t.grad();
      if (!g.defined()) continue;
      if (set_to_none && !autograd::grad_pinned(t)) {
        t.set_grad(Tensor());
        continue;
      }
      // A module's parameter listed loose keeps its place in the flat buffer: zeroed,
      // and with set_to_none its mark forgotten (Note [Parameters without a gradient]).
      g.zero_();
      autograd::mark_grad_zeroed(t);
      if (set_to_none) autograd::take_grad_arrived(t);
    }
    return;
  }
  auto zero_copy = [this, &set](int r) {
    nn::ParameterCopy& copy = set->copy(r);
    auto& b = backend::get(copy.device);
    if (copy.grad.defined()) {
      float* g = copy.grad.mutable_data<float>();
      for (const Range& range : flat_ranges_) {
        b.memset_zero(g + range.offset, copy.device, static_cast<std::size_t>(range.numel) * sizeof(float));
      }
    } else if (const nn::CopySpan span = nn::copy_span(*set, r); span.grad.defined()) {
      // A released buffer: the gradient of the copy's span kept by the runtime (Note [Copy spans]).
      float* g = span.grad.mutable_data<float>();
      for (const Range& range : flat_ranges_) {
        const std::int64_t lo = std::max(range.offset, span.begin);
        const std::int64_t hi = std::min(range.offset + range.numel, span.end);
        if (lo < hi)
          b.memset_zero(g + (lo - span.begin), copy.device, static_cast<std::size_t>(hi - lo) * sizeof(float));
      }
    }
  };
  // Note [Small work inline]: below this, one thread zeroes every copy's gradients in
  // less time than a hand-over to every worker (about 5 us; memset writes ~10 GB/s).
  constexpr std::size_t kInlineZeroBytes = 64 * 1024;
  std::size_t bytes = 0;
  for (const Range& range : flat_ranges_) bytes += static_cast<std::size_t>(range.numel) * sizeof(float);
  bytes *= static_cast<std::size_t>(set->num_copies());
  set->for_each_copy(zero_copy, bytes <= kInlineZeroBytes ? nn::CopyWork::SmallGradients : nn::CopyWork::Gradients);
  // DP mode's transient replicas are not run by for_each_copy; no worker runs now.
  for (int r = 0; r < set->num_copies(); ++r) {
    if (set->copy(r).transient) zero_copy(r);
  }
  std::int64_t zeroed = 0;
  for (const Range& range : flat_ranges_) zeroed += range.numel;
  if (zeroed == set->numel()) set->count_zero_grad();
  set->drop_stray_grads(params_.slots());
  if (set_to_none) {  // Note [Parameters without a gradient]
    set->collect_arrived_grads();  // marks of earlier backwards are spent too
    for (const auto& slot : params_.slots()) slot->got_grad = false;
  }
}

Tensor Optimizer::full_state(std::size_t k) {
  if (states_.empty()) return Tensor();
  const nn::ParameterSet& set = *params_.set();
  // Across processes the exchange comes first, whatever this process's copies hold: a
  // process whose copy 0 owns every range (a set smaller than the devices) or whose
  // copies own none must make the same collective calls as the others.
  if (nn::process_exchange(set) != nullptr) return gathered_state(k);
  const CopyState& s0 = states_[0];
  if (!s0.buffers.empty() && s0.numel == state_numel_) return s0.buffers[k];  // ranges_' layout
  if (std::all_of(states_.begin(), states_.end(), [](const CopyState& s) { return s.buffers.empty(); }))
    return Tensor();
  // Sharded: every copy holds its range; assemble them on the primary's device.
  Tensor out = zeros({state_numel_}, params_.set()->copy(0).device);
  for (const CopyState& st : states_) {
    if (st.buffers.empty()) continue;
    for (const Range& r : st.ranges) {
      auto it = std::upper_bound(ranges_.begin(), ranges_.end(), r.offset,
                                 [](std::int64_t o, const Range& g) { return o < g.offset; });
      DP_ASSERT(it != ranges_.begin());
      --it;
      out.narrow(0, it->state_offset + (r.offset - it->offset), r.numel)
          .copy_(st.buffers[k].narrow(0, r.state_offset, r.numel));
    }
  }
  return out;
}

// Note [Optimizer state across processes]
// A set sharded across processes (Note [Ranges across processes] in
// src/parallel/shard_store.h) holds here the state of this process's copies only. Each
// copy's state is its ranges' slice of ranges_' layout, and ranges_' layout is the
// flat order restricted to the ranges; copies own ascending ranges and processes own
// ascending runs of copies. So this process's part is its copies' states
// concatenated in copy order, and every process's part concatenated in process order
// is the whole state in ranges_' layout — exactly the buffer one process holding
// every range would assemble, bit for bit (values are copied, never combined). The
// exchange is collective: every process calls state_dict() (or a checkpoint save
// that calls it), each then holds the whole state.
Tensor Optimizer::gathered_state(std::size_t k) {
  const nn::ParameterSet& set = *params_.set();
  std::vector<float> mine;
  for (const CopyState& st : states_) {
    if (st.buffers.empty()) {  // not stepped yet: the state it would start from
      mine.insert(mine.end(), static_cast<std::size_t>(st.numel), 0.0f);
      continue;
    }
    const std::vector<float> v = st.buffers[k].narrow(0, 0, st.numel).to_vector();
    mine.insert(mine.end(), v.begin(), v.end());
  }
  std::vector<float> all;
  for (const std::vector<float>& part : nn::process_exchange(set)->gather(mine))
    all.insert(all.end(), part.begin(), part.end());
  DP_CHECK(static_cast<std::int64_t>(all.size()) == state_numel_, kind_, ".state_dict: the processes' optimizer "
           "states add up to ", all.size(), " elements, expected ", state_numel_, ": was the optimizer built over "
           "other parameters on another process?");
  return from_vector(all, {state_numel_}, set.copy(0).device);
}

std::vector<bool> Optimizer::groups_started() {
  std::vector<bool> started(groups_.size(), false);
  for (const CopyState& st : states_)
    for (std::size_t g = 0; g < st.started.size(); ++g) started[g] = started[g] || st.started[g];
  // Across processes each holds the copies of its devices, some of which may hold no
  // range of a group: every process must list the same entries.
  if (nn::ProcessExchange* ex = nn::process_exchange(*params_.set())) {
    std::vector<float> mine(started.size());
    for (std::size_t g = 0; g < started.size(); ++g) mine[g] = started[g] ? 1.0f : 0.0f;
    for (const std::vector<float>& theirs : ex->gather(mine))
      for (std::size_t g = 0; g < started.size() && g < theirs.size(); ++g) started[g] = started[g] || theirs[g] != 0;
  }
  return started;
}

nn::StateDict Optimizer::state_dict() {
  nn::StateDict sd;
  sd.emplace_back("step", full({}, static_cast<double>(step_), TensorOptions{Dtype::Int64, Device{}}));
  const auto names = state_names();
  if (names.empty()) return sd;
  // Only the parameters whose group's state has started (Note [Optimizer state
  // starts]), as PyTorch keeps no momentum_buffer for a group without momentum.
  if (!params_.set()) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const CopyState& st = states_[i];
      if (st.buffers.empty() || !st.started[group_of(i)]) continue;
      for (std::size_t k = 0; k < names.size(); ++k)
        sd.emplace_back(detail::str_cat("state.", i, ".", names[k]), st.buffers[k]);
    }
    add_entry_steps(sd);
    return sd;
  }
  std::vector<Tensor> buffers;
  for (std::size_t k = 0; k < names.size(); ++k) buffers.push_back(full_state(k));
  if (!buffers[0].defined()) {  // no state since construction or a load (allocated at the next step)
    add_entry_steps(sd);          // but the entries' own step counts may be there already
    return sd;
  }
  const std::vector<bool> started = groups_started();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    // An entry of a started group whose own state has not (frozen or unreached since the
    // group began) has none, as in PyTorch.
    if (!started[group_of(i)] || i >= entry_started_.size() || !entry_started_[i]) continue;
    const Tensor& p = params_[i];
    for (std::size_t k = 0; k < names.size(); ++k) {
      sd.emplace_back(detail::str_cat("state.", i, ".", names[k]),
                      buffers[k].narrow(0, entry_state_offset_[i], p.numel()).reshape(p.shape()));
    }
  }
  add_entry_steps(sd);
  return sd;
}

// Note [Frozen parameters in a step]: an entry's own count where it differs, also for
// an entry whose group has not started (frozen since the first step); a loose tensor's
// where steps skipped it (Note [Parameters without a gradient]).
void Optimizer::add_entry_steps(nn::StateDict& sd) const {
  for (std::size_t i = 0; i < frozen_steps_.size(); ++i)
    if (frozen_steps_[i] > 0)
      sd.emplace_back(detail::str_cat("state.", i, ".step"),
                      full({}, static_cast<double>(step_ - frozen_steps_[i]), TensorOptions{Dtype::Int64, Device{}}));
}

void Optimizer::load_state_dict(const nn::StateDict& state) {
  check_valid();
  before_load(state);
  const auto names = state_names();
  const Tensor* step_entry = nullptr;
  nn::StateDict given;  // every entry but "step" and the entries' own steps
  std::vector<std::pair<std::size_t, const Tensor*>> entry_steps;  // Note [Frozen parameters in a step]
  for (const auto& [name, t] : state) {
    if (name == "step") {
      step_entry = &t;
    } else if (const std::optional<std::size_t> i = entry_step_index(name, params_.size())) {
      entry_steps.emplace_back(*i, &t);
    } else {
      given.emplace_back(name, t);
    }
  }
  DP_CHECK(step_entry && step_entry->defined() && step_entry->numel() == 1, kind_,
           ".load_state_dict: expected a scalar 'step' entry; is this an optimizer state_dict?");
  const std::int64_t step = static_cast<std::int64_t>(step_entry->item());
  DP_CHECK(step >= 0, kind_, ".load_state_dict: expected step >= 0, got ", step);
  std::vector<std::int64_t> frozen(params_.size(), 0);
  for (const auto& [i, t] : entry_steps) {
    DP_CHECK(t->defined() && t->numel() == 1, kind_, ".load_state_dict: expected a scalar 'state.", i,
             ".step', got ", t->defined() ? t->str() : "an undefined tensor");
    const double own = t->item();
    DP_CHECK(own >= 0 && own <= static_cast<double>(step) && own == std::floor(own), kind_,
             ".load_state_dict: expected 'state.", i, ".step' to be a whole number in [0, ", step,
             "] (the optimizer's step), got ", own);
    frozen[i] = step - static_cast<std::int64_t>(own);
  }

  // Which parameters the state covers: those with any entry (Note [Optimizer state
  // starts]: an entry whose state has not started has none). A state with entries but
  // none of ours covers every parameter, so that the error names what this optimizer
  // would have read.
  const bool loose = !params_.set();
  std::set<std::string> given_names;
  for (const auto& [name, t] : given) given_names.insert(name);
  std::vector<bool> has(params_.size(), false);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    for (const auto& n : names) has[i] = has[i] || given_names.count(detail::str_cat("state.", i, ".", n));
  }
  const std::size_t with_state = static_cast<std::size_t>(std::count(has.begin(), has.end(), true));
  const bool foreign = with_state == 0 && !given.empty();
  std::vector<bool> group_has(groups_.size(), false);  // the groups whose state has started
  for (std::size_t i = 0; i < params_.size(); ++i) group_has[group_of(i)] = group_has[group_of(i)] || has[i];
  nn::StateDict expected;  // (name, the parameter whose shape and dtype it must have)
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const bool covered = has[i] || foreign;
    if (!covered) continue;
    for (const auto& n : names) expected.emplace_back(detail::str_cat("state.", i, ".", n), params_[i]);
  }
  nn::StateDictMatch m = nn::match_state_dict(
      expected, given, /*strict=*/true,
      {.what = kind_ + ".load_state_dict",
       .target = "this optimizer",
       .source = "the state dict",
       .fix_names = detail::str_cat("Was it saved by another optimizer type, or for other parameters than "
                                    "these ", params_.size(), "?"),
       .fix_shapes = "Was it saved for another model?"});
  std::map<std::string, Tensor> by_name(m.matched.begin(), m.matched.end());

  // Validated: now write.
  step_ = step;
  frozen_steps_ = std::move(frozen);
  // A loaded entry's state has started when it has state and has stepped (state dicts
  // from before entries were listed on their own list a started group whole, zeros for
  // an entry that never stepped with state).
  entry_started_.assign(params_.size(), false);
  for (std::size_t i = 0; i < params_.size(); ++i) entry_started_[i] = has[i] && step - frozen_steps_[i] > 0;
  if (loose) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      states_[i] = CopyState{};
      if (!has[i]) continue;
      allocate_state(states_[i], params_[i].device(), params_[i].shape());
      for (std::size_t k = 0; k < names.size(); ++k) {
        states_[i].buffers[k].copy_(by_name.at(detail::str_cat("state.", i, ".", names[k])));
      }
      states_[i].started[group_of(i)] = true;
    }
    return;
  }
  nn::ParameterSet& set = *params_.set();
  if (with_state == 0 || names.empty()) {
    rebuild_states({}, {});  // every copy starts afresh, allocated lazily
    return;
  }
  // The loaded state in ranges_' layout on the primary's device; every copy takes
  // its range of it (Note [Optimizer state layouts]).
  CopyState loaded;
  loaded.begin = 0;
  loaded.end = set.buffer_numel();
  loaded.ranges = ranges_;
  loaded.numel = state_numel_;
  allocate_state(loaded, set.copy(0).device, {state_numel_});
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (!has[i]) continue;  // not started: zeros
    const Tensor& p = params_[i];
    for (std::size_t k = 0; k < names.size(); ++k) {
      loaded.buffers[k]
          .narrow(0, entry_state_offset_[i], p.numel())
          .reshape(p.shape())
          .copy_(by_name.at(detail::str_cat("state.", i, ".", names[k])));
    }
  }
  loaded.started = group_has;
  rebuild_states({}, {loaded});
}

}  // namespace dp::optim
