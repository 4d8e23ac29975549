// dp/nn/sequential.h — a chain of modules applied in order.
//
// Children are registered as "0", "1", … like torch.nn.Sequential, so state_dict names
// match PyTorch's ("0.weight", "1.running_mean"), or under names given with them
// (an OrderedDict in PyTorch): "fc1.weight". Every registered child is a layer that
// forward runs, in registration order: push_back, register_module and the
// constructors all append. Knows nothing of DataParallel.
//
//   auto net = std::make_shared<dp::nn::Sequential>(
//       std::make_shared<dp::nn::Conv2d>(1, 8, 3), std::make_shared<dp::nn::ReLU>(),
//       std::make_shared<dp::nn::Flatten>(), std::make_shared<dp::nn::Linear>(8 * 26 * 26, 10));
//   auto mlp = std::make_shared<dp::nn::Sequential>(dp::nn::Sequential::Named{
//       {"fc1", std::make_shared<dp::nn::Linear>(6, 16)}, {"act", std::make_shared<dp::nn::ReLU>()}});
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dp/nn/module.h"

namespace dp::nn {

/// forward(x) = m_{n−1}(… m_1(m_0(x))).
class Sequential : public Module {
 public:
  /// A layer with its name, for the named constructor.
  using NamedModule = std::pair<std::string, std::shared_ptr<Module>>;
  /// The named constructor's argument: {{"fc1", fc1}, {"act", act}}.
  using Named = std::initializer_list<NamedModule>;

  Sequential() = default;
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  /// Layers registered under the given names, in order:
  /// Sequential({{"fc1", std::make_shared<Linear>(6, 16)}, {"act", std::make_shared<ReLU>()}})
  /// gives the state_dict keys "fc1.weight", "fc1.bias". Names must be non-empty,
  /// without '.', and distinct (else dp::Error).
  Sequential(Named modules);
  /// Sequential(std::make_shared<A>(...), std::make_shared<B>(...), ...).
  template <typename... Ms>
    requires(sizeof...(Ms) > 0 && (std::is_base_of_v<Module, Ms> && ...))
  explicit Sequential(std::shared_ptr<Ms>... modules) {
    (push_back(std::move(modules)), ...);
  }

  /// Appends a module, registered under the next index ("0", "1", …). Returns it.
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    register_child(std::to_string(modules_.size()), module);
    return module;
  }
  /// Appends a module under `name` (libtorch's push_back(name, module)). Returns it.
  template <typename M>
  std::shared_ptr<M> push_back(const std::string& name, std::shared_ptr<M> module) {
    register_child(name, module);
    return module;
  }

  Tensor forward(const Tensor& x) override;
  /// "Sequential(Linear(...), ReLU(), ...)".
  std::string name() const override;

  std::size_t size() const { return modules_.size(); }
  bool empty() const { return modules_.empty(); }
  /// The i-th module (range-checked).
  const std::shared_ptr<Module>& operator[](std::size_t i) const;
  const std::shared_ptr<Module>& at(std::size_t i) const { return (*this)[i]; }
  auto begin() const { return modules_.begin(); }
  auto end() const { return modules_.end(); }

 protected:
  /// Registers the child and appends it as the next layer.
  void register_child(const std::string& name, std::shared_ptr<Module> module) override;

 private:
  std::vector<std::shared_ptr<Module>> modules_;
};

}  // namespace dp::nn
