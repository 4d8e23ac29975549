// dp/nn/module.h — the base of every layer and network.
//
// A Module registers parameters, buffers and child modules by name in its
// constructor; names join with dots into PyTorch's state_dict names
// ("features.0.weight"). Parameters are Parameter slots (see Note [Parameter sets]
// in parameter_set.h): the module's parameters live in one flat buffer per device,
// and which copy forward reads is chosen per thread, so one module object serves
// every DataParallel worker. forward() must therefore not mutate module members
// other than through its parameters and buffers. This header knows nothing of
// optimizers or DataParallel.
//
//   struct Net : dp::nn::Module {
//     Net() { fc = register_module("fc", std::make_shared<dp::nn::Linear>(784, 10)); }
//     dp::Tensor forward(const dp::Tensor& x) override { return fc->forward(x.flatten(1)); }
//     std::shared_ptr<dp::nn::Linear> fc;
//   };
//
// A module whose forward takes several tensors overrides the vector form instead
// (Note [Module inputs]) and is called as net(x, mask):
//
//   struct Masked : dp::nn::Module {
//     using Module::forward;   // keeps net->forward(x) visible beside the override
//     dp::Tensor forward(const std::vector<dp::Tensor>& in) override { return fc->forward(dp::mul(in[0], in[1])); }
//     ...
//   };
#pragma once

#include <concepts>
#include <cstdint>
#include <ostream>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dp/nn/parameter_set.h"
#include "dp/nn/state_dict.h"
#include "dp/tensor/tensor.h"

namespace dp::nn {

/// The base class of layers and networks.
class Module : public std::enable_shared_from_this<Module> {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Note [Module inputs]
  // A module implements ONE of the two forwards. A single-input module overrides
  // forward(const Tensor&) (every layer here); a module of several inputs overrides
  // forward(const std::vector<Tensor>&). The defaults connect them: the vector form
  // of a single-input module accepts exactly one input and calls forward(x); forward(x)
  // of a several-input module passes {x} to the vector form (which may accept or
  // refuse one input). A module that overrides neither throws dp::Error on its first
  // call. net(a) calls forward(a); net(a, b, ...) calls forward({a, b, ...}).

  /// The computation of a single-input module. x: on the bound copy's device.
  virtual Tensor forward(const Tensor& x);
  /// The computation of a module of several inputs, in order (e.g. {x, mask}). The
  /// default accepts one input and calls forward(inputs[0]); anything else is a
  /// dp::Error naming the module and the number of inputs.
  virtual Tensor forward(const std::vector<Tensor>& inputs);
  Tensor operator()(const Tensor& x) { return forward(x); }
  /// net(x, mask, ...): forward({x, mask, ...}).
  template <typename... Rest>
    requires(sizeof...(Rest) >= 1 && (std::convertible_to<const Rest&, const Tensor&> && ...))
  Tensor operator()(const Tensor& first, const Rest&... rest) {
    return forward(std::vector<Tensor>{first, rest...});
  }
  /// A one-line description, e.g. "Linear(in_features=784, out_features=10, bias=true)":
  /// by default type_name() + "(" + extra_repr() + ")". Error messages name modules by it.
  virtual std::string name() const;
  /// The class name without namespaces ("Linear", "Net"), from the dynamic type.
  virtual std::string type_name() const;
  /// The module's own settings as PyTorch's extra_repr() gives them, without its
  /// children: "in_features=784, out_features=10, bias=true"; empty by default.
  /// Override it to show a custom module's settings in name() and repr().
  virtual std::string extra_repr() const { return {}; }
  /// The module tree as PyTorch prints a module: name() for a module without children,
  /// else the type, then each child as "(name): repr" on its own line, indented:
  ///   Sequential(
  ///     (fc1): Linear(in_features=6, out_features=16, bias=true)
  ///     (act): ReLU()
  ///   )
  /// `std::cout << *net` prints the same.
  std::string repr() const;

  // ---- registration (call from constructors) ----------------------------------
  /// Registers a trainable parameter (float32); it becomes a leaf requiring grad.
  Parameter register_parameter(const std::string& name, Tensor value);
  /// Weight tying (PyTorch's `lm_head.weight = wte.weight`): the parameter `name` of
  /// this tree (dotted, "lm_head.weight") becomes `source`, one parameter that two
  /// modules use. See Note [Tied parameters] in src/nn/module.cpp. Call it before the
  /// parameters are flattened (the first parameters(), an optimizer or DataParallel).
  /// Throws dp::Error for an unknown name, a source that is not a parameter, another
  /// shape, or parameters already flattened.
  ///
  ///   gpt->share_parameter("lm_head.weight", gpt->parameter("wte.weight"));
  void share_parameter(const std::string& name, const Parameter& source);
  /// The registered parameter `name` of this tree (dotted: "h.0.attn.c_attn.weight").
  /// Throws dp::Error naming the parameters there are when there is none by that name.
  Parameter parameter(const std::string& name) const;
  /// Registers a buffer (saved in state_dict, not trained, e.g. running_mean).
  Parameter register_buffer(const std::string& name, Tensor value);
  /// Registers a random generator the module owns (a member, so it lives as long as
  /// the module), so that training checkpoints save and restore its stream without
  /// the user naming it (Note [Module generators]). Its name joins the tree's dotted
  /// names: "noise" in child "enc" is "enc.noise" in named_generators().
  void register_generator(const std::string& name, Generator& generator);
  /// Registers an array of generators as "<name>.0", "<name>.1", … (Dropout's per-copy
  /// streams: "generator.0" … "generator.63").
  void register_generators(const std::string& name, std::span<Generator> generators);
  /// Registers a child module under `name`. On a Sequential it also appends the child
  /// as its next layer (as torch.nn.Sequential.add_module does).
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    register_child(name, module);
    return module;
  }

  // ---- introspection -----------------------------------------------------------------
  /// All parameters of the tree (depth first, registration order, no duplicates), as
  /// views into the tree's flat buffer; flattens the tree on first use.
  ParameterList parameters();
  /// Elements in the tree's parameters (not its buffers), each parameter once: what
  /// PyTorch users write as sum(p.numel() for p in net.parameters()).
  std::int64_t num_parameters();
  StateDict named_parameters();
  StateDict named_buffers();
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const {
    return children_;
  }
  /// Every registered generator of the tree by dotted name ("features.3.generator.1"),
  /// depth first in registration order like state_dict(); a module or generator
  /// reached twice is listed once, under its first name.
  std::vector<std::pair<std::string, Generator*>> named_generators();
  /// Every module of the tree, depth first: this one first when it is owned by a
  /// shared_ptr, then every descendant once.
  std::vector<std::shared_ptr<Module>> modules();
  /// The flat parameter set (flattening on first use); null when there are no parameters.
  std::shared_ptr<ParameterSet> parameter_set();
  /// Every Parameter slot of the tree (parameters then buffers are separate calls).
  std::vector<std::shared_ptr<Parameter::Slot>> parameter_slots();
  std::vector<std::shared_ptr<Parameter::Slot>> buffer_slots();

  // ---- state -----------------------------------------------------------------------------
  /// Parameters and buffers by dotted name (no wrapper prefix), copy 0.
  StateDict state_dict();
  /// Copies values in by name (match_state_dict in state_dict.h). strict: every key
  /// must match both ways (else a dp::Error listing missing and unexpected keys).
  /// Shapes and dtypes must match; everything is checked before anything is written.
  LoadResult load_state_dict(const StateDict& state, bool strict = true);

  /// Training / evaluation mode for this module and all children.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  /// Moves parameters and buffers (copy 0) to `device`.
  void to(Device device);
  /// Device of the first parameter (or buffer); cpu(0) when there is none.
  Device device();
  /// Zeroes the gradients of every parameter (one call over the flat grad buffer).
  /// `set_to_none` (PyTorch's default) also forgets which parameters got a gradient: an
  /// optimizer step then skips each parameter no backward reaches before it (Note
  /// [Parameters without a gradient] in dp/optim/optimizer.h); false keeps them stepped.
  void zero_grad(bool set_to_none = true);

 protected:
  /// Adds a child under `name` (checked: non-empty, no '.', not taken). Virtual so that
  /// a container can also give the child a role (Sequential appends it as a layer).
  virtual void register_child(const std::string& name, std::shared_ptr<Module> module);

 private:
  void collect(const std::string& prefix, StateDict* params, StateDict* buffers,
               std::vector<std::shared_ptr<Parameter::Slot>>* pslots,
               std::vector<std::shared_ptr<Parameter::Slot>>* bslots);

  std::vector<std::pair<std::string, std::shared_ptr<Parameter::Slot>>> params_;
  std::vector<std::pair<std::string, std::shared_ptr<Parameter::Slot>>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<std::pair<std::string, Generator*>> generators_;
  std::shared_ptr<ParameterSet> set_;
  bool training_ = true;
};

/// True when `m` is a T or derives from one: a module predicate, such as the gather
/// units of DataParallel's Sharded design (`.shard_unit = is_module<TransformerBlock>`).
template <class T>
bool is_module(const Module& m) {
  return dynamic_cast<const T*>(&m) != nullptr;
}

/// Prints module.repr(): `std::cout << *net`.
std::ostream& operator<<(std::ostream& os, const Module& module);

}  // namespace dp::nn
