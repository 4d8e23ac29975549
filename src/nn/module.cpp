#include "dp/nn/module.h"

#include <cxxabi.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <typeinfo>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"

namespace dp::nn {
namespace {

void check_name(const std::string& kind, const std::string& name) {
  DP_CHECK(!name.empty() && name.find('.') == std::string::npos,
           "register_", kind, ": expected a non-empty name without '.', got '", name, "'");
}

// The module whose default vector forward is calling its forward(x) on this thread:
// when that forward(x) is the default too, the module overrides neither.
thread_local const Module* t_single_input_call = nullptr;

}  // namespace

std::string Module::name() const { return type_name() + "(" + extra_repr() + ")"; }

std::string Module::type_name() const {
  const char* mangled = typeid(*this).name();
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(mangled, nullptr, nullptr, &status),
                                                  std::free);
  std::string full = status == 0 && demangled ? demangled.get() : mangled;
  // "dp::nn::Linear" -> "Linear", "(anonymous namespace)::Net" -> "Net"; qualifiers
  // inside template arguments stay ("Block<dp::nn::ReLU>").
  const std::size_t args = full.find('<');
  const std::size_t colons = full.rfind("::", args);
  return colons == std::string::npos ? full : full.substr(colons + 2);
}

std::string Module::repr() const {
  if (children_.empty()) return name();
  // PyTorch's layout: the settings, then one "(name): child" line per child, each of
  // the child's own lines indented two more spaces.
  std::ostringstream os;
  os << type_name() << "(\n";
  auto put_indented = [&os](const std::string& text) {
    for (char c : text) {
      os << c;
      if (c == '\n') os << "  ";
    }
  };
  if (std::string extra = extra_repr(); !extra.empty()) {
    os << "  ";
    put_indented(extra);
    os << "\n";
  }
  for (const auto& [n, child] : children_) {
    os << "  (" << n << "): ";
    put_indented(child->repr());
    os << "\n";
  }
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Module& module) { return os << module.repr(); }

Tensor Module::forward(const Tensor& x) {
  DP_CHECK(t_single_input_call != this, name(), ": the module overrides neither forward(const Tensor&) nor "
           "forward(const std::vector<Tensor>&); override the one that fits its inputs");
  return forward(std::vector<Tensor>{x});
}

Tensor Module::forward(const std::vector<Tensor>& inputs) {
  DP_CHECK(inputs.size() == 1, name(), ": expected 1 input (its forward takes one tensor), got ", inputs.size(),
           " inputs; a module of several inputs overrides forward(const std::vector<Tensor>&)");
  const Module* outer = t_single_input_call;
  t_single_input_call = this;
  struct Restore {
    const Module* prev;
    ~Restore() { t_single_input_call = prev; }
  } restore{outer};
  return forward(inputs[0]);
}

Parameter Module::register_parameter(const std::string& name, Tensor value) {
  check_name("parameter", name);
  DP_CHECK(value.defined(), "register_parameter('", name, "'): expected a defined tensor");
  DP_CHECK(value.dtype() == Dtype::Float32, "register_parameter('", name, "'): expected float32, got ",
           dtype_name(value.dtype()));
  for (auto& [n, s] : params_) DP_CHECK(n != name, "register_parameter: '", name, "' is already registered");
  DP_CHECK(set_ == nullptr, "register_parameter('", name,
           "'): the module's parameters were already flattened; register every parameter in the "
           "constructor");
  Tensor leaf = value.detach();
  leaf.set_requires_grad(true);
  auto slot = std::make_shared<Parameter::Slot>();
  slot->name = name;
  slot->copies.push_back(leaf);
  params_.emplace_back(name, slot);
  return Parameter(slot);
}

Parameter Module::register_buffer(const std::string& name, Tensor value) {
  check_name("buffer", name);
  DP_CHECK(value.defined(), "register_buffer('", name, "'): expected a defined tensor");
  for (auto& [n, s] : buffers_) DP_CHECK(n != name, "register_buffer: '", name, "' is already registered");
  auto slot = std::make_shared<Parameter::Slot>();
  slot->name = name;
  slot->is_buffer = true;
  slot->copies.push_back(value.detach());
  buffers_.emplace_back(name, slot);
  return Parameter(slot);
}

// Note [Module generators]
// A module that draws random numbers in forward (Dropout, a noise layer) owns its
// Generators, and a bitwise resume must restore their states, not only the weights.
// Modules register them by name like buffers (register_generator), so whoever walks
// the tree (a training checkpoint: Note [Training checkpoint layout] in
// src/io/checkpoint.cpp) finds every stream under a stable dotted name, without the
// user listing them. A Generator is two integers (Philox: seed and counter), so it is
// kept out of state_dict(): state_dict holds tensors that travel between devices and
// frameworks, and a module checkpoint (dp::save) stays the file PyTorch writes. The
// registry keeps pointers to members; a Module is neither copyable nor movable, so
// they stay valid for the module's life.

void Module::register_generator(const std::string& name, Generator& generator) {
  check_name("generator", name);
  for (auto& [n, g] : generators_) {
    DP_CHECK(n != name, "register_generator: '", name, "' is already registered");
    DP_CHECK(g != &generator, "register_generator('", name, "'): this generator is already registered as '", n,
             "'");
  }
  generators_.emplace_back(name, &generator);
}

void Module::register_generators(const std::string& name, std::span<Generator> generators) {
  check_name("generator", name);
  const std::string prefix = name + ".";
  for (auto& [n, g] : generators_) {
    DP_CHECK(n != name && n.compare(0, prefix.size(), prefix) != 0, "register_generators: '", name,
             "' is already registered");
  }
  for (std::size_t i = 0; i < generators.size(); ++i) generators_.emplace_back(prefix + std::to_string(i), &generators[i]);
}

std::vector<std::pair<std::string, Generator*>> Module::named_generators() {
  std::vector<std::pair<std::string, Generator*>> out;
  std::set<const Generator*> seen;
  std::set<const Module*> visited;
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& pre) {
    if (!visited.insert(&m).second) return;
    for (auto& [n, g] : m.generators_)
      if (seen.insert(g).second) out.emplace_back(pre + n, g);
    for (auto& [n, c] : m.children_) walk(*c, pre + n + ".");
  };
  walk(*this, "");
  return out;
}

// Note [Tied parameters]
// A GPT's token embedding is also its output projection: one parameter, two modules.
// share_parameter puts the source's slot in the module's list under the tied name and
// points the module's own slot at it (Slot::tied), so the module's Parameter handle —
// the member its forward reads — reads the source, and the slot's own tensor is
// dropped. parameters(), named_parameters() and the flat set meet the shared slot
// twice and keep it once, under its first name depth first, as PyTorch's
// named_parameters does; so it is counted once, flattened once, reduced once and
// stepped once in every design. state_dict() lists it under both names, as PyTorch's
// does (a load writes the same tensor twice). Its gradient is the sum of both uses:
// the autograd engine adds them before the parameter's gradient is final, which is
// when the runtime's hook counts it ready. Ties are made before flattening: the flat
// set lays out slots, not names.

namespace {

/// The module that holds dotted `name`'s last part, and that part ("h.0.attn.w" →
/// module h.0.attn, "w"). Throws dp::Error naming the missing child.
std::pair<const Module*, std::string> owner_of(const Module& root, const std::string& name, const char* what) {
  const Module* m = &root;
  std::size_t start = 0;
  for (std::size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
    const std::string child = name.substr(start, dot - start);
    const Module* next = nullptr;
    for (auto& [n, c] : m->named_children())
      if (n == child) next = c.get();
    DP_CHECK(next != nullptr, what, "('", name, "'): expected a child module '", child, "' in ", m->name(),
             ", got none");
    m = next;
    start = dot + 1;
  }
  return {m, name.substr(start)};
}

}  // namespace

Parameter Module::parameter(const std::string& name) const {
  auto [m, leaf] = owner_of(*this, name, "parameter");
  std::string have;
  for (auto& [n, s] : m->params_) {
    if (n == leaf) return Parameter(s);
    have += (have.empty() ? "" : ", ") + n;
  }
  DP_FAIL("parameter('", name, "'): expected a parameter '", leaf, "' in ", m->name(), ", which has ",
          have.empty() ? std::string("none") : have);
}

void Module::share_parameter(const std::string& name, const Parameter& source) {
  DP_CHECK(source.defined(), "share_parameter('", name, "'): expected a registered parameter as the source, got an "
           "empty one");
  auto [owner, leaf] = owner_of(*this, name, "share_parameter");
  auto& m = const_cast<Module&>(*owner);
  const std::shared_ptr<Parameter::Slot> target = parameter(name).slot();
  std::shared_ptr<Parameter::Slot> src = source.slot()->tied ? source.slot()->tied : source.slot();
  DP_CHECK(!src->is_buffer, "share_parameter('", name, "'): expected a parameter as the source, got a buffer");
  if (src == target || target->tied == src) return;  // tied already
  DP_CHECK(target->set.expired() && src->set.expired() && m.set_ == nullptr && set_ == nullptr,
           "share_parameter('", name, "'): the parameters were already flattened (by parameters(), an optimizer "
           "or DataParallel); tie them before, e.g. in the model's constructor");
  const Tensor& from = src->copies.at(0);
  const Tensor& to = target->copies.at(0);
  DP_CHECK(from.shape() == to.shape(), "share_parameter('", name, "'): expected a source of shape ",
           shape_str(to.shape()), ", got ", shape_str(from.shape()));
  DP_CHECK(from.device() == to.device(), "share_parameter('", name, "'): expected a source on ", to.device().str(),
           ", got one on ", from.device().str());
  // The slot given up must be this one module's alone: were it another's source too,
  // that module would read a slot with no tensor.
  int holders = 0;
  std::set<const Module*> visited;
  std::function<void(const Module&)> count = [&](const Module& x) {
    if (!visited.insert(&x).second) return;
    for (auto& [n, s] : x.params_) holders += s == target ? 1 : 0;
    for (auto& [n, c] : x.children_) count(*c);
  };
  count(*this);
  DP_CHECK(holders == 1, "share_parameter('", name, "'): that parameter is already the source of another tie; "
           "tie the other way round (make '", name, "' the source)");
  for (auto& [n, s] : m.params_)
    if (s == target) s = src;
  target->tied = src;
  target->copies.clear();
}

void Module::register_child(const std::string& name, std::shared_ptr<Module> module) {
  check_name("module", name);
  DP_CHECK(module != nullptr, "register_module('", name, "'): expected a module, got null");
  DP_CHECK(module.get() != this, "register_module('", name, "'): a module cannot be its own child");
  for (auto& [n, m] : children_) DP_CHECK(n != name, "register_module: '", name, "' is already registered");
  children_.emplace_back(name, std::move(module));
}

void Module::collect(const std::string& prefix, StateDict* params, StateDict* buffers,
                     std::vector<std::shared_ptr<Parameter::Slot>>* pslots,
                     std::vector<std::shared_ptr<Parameter::Slot>>* bslots) {
  // Depth first in registration order; a module shared twice is visited once (its
  // first name wins, like PyTorch's named_parameters with remove_duplicate).
  std::set<const Parameter::Slot*> seen;
  std::set<const Module*> visited;
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& pre) {
    if (!visited.insert(&m).second) return;
    for (auto& [n, s] : m.params_) {
      if (!seen.insert(s.get()).second) continue;
      if (params) params->emplace_back(pre + n, s->copies[0]);
      if (pslots) pslots->push_back(s);
    }
    for (auto& [n, s] : m.buffers_) {
      if (!seen.insert(s.get()).second) continue;
      if (buffers) buffers->emplace_back(pre + n, s->copies[0]);
      if (bslots) bslots->push_back(s);
    }
    for (auto& [n, c] : m.children_) walk(*c, pre + n + ".");
  };
  walk(*this, prefix);
}

std::vector<std::shared_ptr<Parameter::Slot>> Module::parameter_slots() {
  std::vector<std::shared_ptr<Parameter::Slot>> slots;
  collect("", nullptr, nullptr, &slots, nullptr);
  return slots;
}

std::vector<std::shared_ptr<Parameter::Slot>> Module::buffer_slots() {
  std::vector<std::shared_ptr<Parameter::Slot>> slots;
  collect("", nullptr, nullptr, nullptr, &slots);
  return slots;
}

std::shared_ptr<ParameterSet> Module::parameter_set() {
  auto slots = parameter_slots();
  if (slots.empty()) return nullptr;
  // Reuse the set these parameters already share (ours, or an ancestor's that was
  // flattened first); otherwise flatten them into a new one.
  auto shared = slots[0]->set.lock();
  bool all_in = shared && shared->valid();
  for (auto& s : slots) all_in = all_in && s->set.lock() == shared;
  if (all_in) return shared;
  set_ = ParameterSet::create(slots, slots[0]->copies[0].device());
  return set_;
}

ParameterList Module::parameters() {
  auto set = parameter_set();
  if (set) set->make_primary_readable();  // Note [View providers]: readable until the next step
  auto slots = parameter_slots();
  std::vector<Tensor> tensors;
  tensors.reserve(slots.size());
  for (auto& s : slots) tensors.push_back(s->copies[0]);
  return ParameterList(std::move(tensors), std::move(slots), std::move(set));
}

std::int64_t Module::num_parameters() {
  // Shapes alone: nothing is gathered or flattened to count.
  std::int64_t n = 0;
  for (const auto& s : parameter_slots()) n += s->copies[0].numel();
  return n;
}

StateDict Module::named_parameters() {
  if (auto set = parameter_set()) set->make_primary_readable();  // Note [View providers]
  StateDict out;
  collect("", &out, nullptr, nullptr, nullptr);
  return out;
}

StateDict Module::named_buffers() {
  StateDict out;
  collect("", nullptr, &out, nullptr, nullptr);
  return out;
}

std::vector<std::shared_ptr<Module>> Module::modules() {
  // The root may live on the stack (not owned by a shared_ptr): it is returned only
  // when it is shared; children always are.
  std::vector<std::shared_ptr<Module>> out;
  if (auto self = weak_from_this().lock()) out.push_back(self);
  std::set<const Module*> visited{this};
  std::function<void(Module&)> walk = [&](Module& m) {
    for (auto& [n, c] : m.children_) {
      if (!visited.insert(c.get()).second) continue;
      out.push_back(c);
      walk(*c);
    }
  };
  walk(*this);
  return out;
}

StateDict Module::state_dict() {
  if (auto set = parameter_set()) set->make_primary_readable();  // Note [View providers]
  StateDict params, buffers;
  collect("", &params, &buffers, nullptr, nullptr);
  // PyTorch's order: per module, parameters then buffers. Reproduce it by a walk that
  // interleaves per module.
  StateDict out;
  std::set<const Module*> visited;
  std::function<void(Module&, const std::string&)> walk = [&](Module& m, const std::string& pre) {
    if (!visited.insert(&m).second) return;
    for (auto& [n, s] : m.params_) out.emplace_back(pre + n, s->copies[0]);
    for (auto& [n, s] : m.buffers_) out.emplace_back(pre + n, s->copies[0]);
    for (auto& [n, c] : m.children_) walk(*c, pre + n + ".");
  };
  walk(*this, "");
  return out;
}

LoadResult Module::load_state_dict(const StateDict& state, bool strict) {
  auto own = state_dict();
  // Validates every name, shape and dtype before writing anything: a failed load
  // leaves the module untouched.
  StateDictMatch m = match_state_dict(own, state, strict);
  std::map<std::string, Tensor> dst(own.begin(), own.end());
  NoGradGuard no_grad;
  for (auto& [k, src] : m.matched) dst.at(k).copy_(src);
  if (auto set = parameter_set()) set->bump_version();
  return m.keys;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& m : modules()) m->training_ = on;
}

void Module::to(Device device) {
  if (auto set = parameter_set()) set->move_primary(device);
  NoGradGuard no_grad;
  for (auto& s : buffer_slots()) {
    Tensor& b = s->copies[0];
    if (b.device() == device) continue;
    Tensor moved = b.to(device);
    b.impl()->storage = moved.storage();
    b.impl()->offset = moved.storage_offset();
  }
}

Device Module::device() {
  auto p = parameter_slots();
  if (!p.empty()) return p[0]->copies[0].device();
  auto b = buffer_slots();
  if (!b.empty()) return b[0]->copies[0].device();
  return Device{};
}

void Module::zero_grad(bool set_to_none) {
  if (auto set = parameter_set()) set->zero_grad(set_to_none);
}

}  // namespace dp::nn
