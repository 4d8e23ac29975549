#include "dp/nn/sequential.h"

#include <string>
#include <typeinfo>

#include "dp/core/error.h"
#include "dp/nn/activation.h"
#include "dp/nn/conv2d.h"
#include "dp/nn/functional.h"
#include "dp/nn/linear.h"
#include "dp/nn/pooling.h"

namespace dp::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules) {
  for (const auto& m : modules) push_back(m);
}

Sequential::Sequential(Named modules) {
  for (const auto& [name, m] : modules) push_back(name, m);
}

// Every child is a layer: a child registered through Module::register_module that
// forward skipped would hold parameters that are trained by nothing but weight decay.
void Sequential::register_child(const std::string& name, std::shared_ptr<Module> module) {
  DP_CHECK(module != nullptr, "Sequential: expected a module, got a null pointer for layer ", modules_.size(),
           " ('", name, "')");
  Module::register_child(name, module);
  modules_.push_back(std::move(module));
}

// A Conv2d followed by a ReLU runs as one op, Conv2d::forward_relu (Note [Convolution +
// ReLU] in src/backend/cpu/cpu_conv.cpp), and with a MaxPool2d after them as
// conv2d_relu_max_pool2d (Note [ReLU mask through max-pool] in src/nn/functional.cpp);
// a Linear followed by a ReLU as Linear::forward_relu (Note [Linear epilogue]): the
// same bits without the ReLU's passes. Only the exact types qualify: a subclass may
// override forward.
Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  const std::size_t n = modules_.size();
  auto is = [&](std::size_t i, const std::type_info& t) { return i < n && typeid(*modules_[i]) == t; };
  for (std::size_t i = 0; i < n; ++i) {
    if (is(i, typeid(Conv2d)) && is(i + 1, typeid(ReLU))) {
      auto& conv = static_cast<Conv2d&>(*modules_[i]);
      if (is(i + 2, typeid(MaxPool2d))) {
        const auto& pool = static_cast<const MaxPool2d&>(*modules_[i + 2]);
        y = conv2d_relu_max_pool2d(y, conv.weight(), conv.bias(), conv.stride(), conv.padding(),
                                   pool.kernel_size(), pool.stride(), pool.padding());
        i += 2;
      } else {
        y = conv.forward_relu(y);
        ++i;
      }
      continue;
    }
    if (is(i, typeid(Linear)) && is(i + 1, typeid(ReLU))) {
      y = static_cast<Linear&>(*modules_[i]).forward_relu(y);
      ++i;
      continue;
    }
    y = modules_[i]->forward(y);
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
