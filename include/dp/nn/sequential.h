// dp/nn/sequential.h — a chain of modules applied in order.
//
// Children are registered as "0", "1", … like torch.nn.Sequential, so state_dict names
// match PyTorch's ("0.weight", "1.running_mean"). Knows nothing of DataParallel.
//
//   auto net = std::make_shared<dp::nn::Sequential>(
//       std::make_shared<dp::nn::Conv2d>(1, 8, 3), std::make_shared<dp::nn::ReLU>(),
//       std::make_shared<dp::nn::Flatten>(), std::make_shared<dp::nn::Linear>(8 * 26 * 26, 10));
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "dp/nn/module.h"

namespace dp::nn {

/// forward(x) = m_{n−1}(… m_1(m_0(x))).
class Sequential : public Module {
 public:
  Sequential() = default;
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  /// Sequential(std::make_shared<A>(...), std::make_shared<B>(...), ...).
  template <typename... Ms>
    requires(sizeof...(Ms) > 0 && (std::is_base_of_v<Module, Ms> && ...))
  explicit Sequential(std::shared_ptr<Ms>... modules) {
    (push_back(std::move(modules)), ...);
  }

  /// Appends a module, registered under the next index ("0", "1", …). Returns it.
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> module) {
    push_back_module(module);
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

 private:
  void push_back_module(std::shared_ptr<Module> module);
  std::vector<std::shared_ptr<Module>> modules_;
};

}  // namespace dp::nn
