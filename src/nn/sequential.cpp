#include "dp/nn/sequential.h"

#include <string>
#include <typeinfo>

#include "dp/core/error.h"
#include "dp/nn/activation.h"
#include "dp/nn/conv2d.h"

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

// A Conv2d followed by a ReLU runs as one op, Conv2d::forward_relu (Note [Convolution +
// ReLU] in src/backend/cpu/cpu_gemm_conv.cpp): the same bits without the ReLU's pass.
// Only the exact types qualify: a subclass may override forward.
Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (std::size_t i = 0; i < modules_.size(); ++i) {
    Module& m = *modules_[i];
    if (i + 1 < modules_.size() && typeid(m) == typeid(Conv2d) &&
        typeid(*modules_[i + 1]) == typeid(ReLU)) {
      y = static_cast<Conv2d&>(m).forward_relu(y);
      ++i;
      continue;
    }
    y = m.forward(y);
  }
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
