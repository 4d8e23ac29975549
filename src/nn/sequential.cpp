#include "dp/nn/sequential.h"

#include <string>

#include "dp/core/error.h"

namespace dp::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const auto& m : modules) push_back_module(m);
}

void Sequential::push_back_module(std::shared_ptr<Module> module) {
  DP_CHECK(module != nullptr, "Sequential: expected a module, got a null pointer at index ",
           modules_.size());
  register_child(std::to_string(modules_.size()), module);
  modules_.push_back(std::move(module));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& m : modules_) y = m->forward(y);
  return y;
}

const std::shared_ptr<Module>& Sequential::operator[](std::size_t i) const {
  DP_CHECK(i < modules_.size(), "Sequential: index ", i, " is out of range; it holds ",
           modules_.size(), " modules");
  return modules_[i];
}

std::string Sequential::name() const {
  std::string s = "Sequential(";
  for (std::size_t i = 0; i < modules_.size(); ++i) {
    if (i > 0) s += ", ";
    s += modules_[i]->name();
  }
  return s + ")";
}

}  // namespace dp::nn
