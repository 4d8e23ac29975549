// dp/optim/sgd.h — stochastic gradient descent with momentum, dampening, Nesterov and
// (coupled) weight decay, PyTorch's torch.optim.SGD formulas.
//
// One fused backend call per flat range and copy (see Note [Fused optimizer steps]).
//
//   dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9, .nesterov = true});
#pragma once

#include <vector>

#include "dp/optim/optimizer.h"

namespace dp::optim {

/// Hyper-parameters of SGD.
struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

/// g = grad + wd·p; buf = g on the first step, else momentum·buf + (1 − dampening)·g;
/// g = nesterov ? g + momentum·buf : buf (when momentum ≠ 0); p −= lr·g.
class SGD : public Optimizer {
 public:
  /// Throws dp::Error on lr, momentum or weight_decay < 0, on nesterov without
  /// momentum or with dampening, and on an empty parameter list.
  SGD(nn::ParameterList params, SGDOptions options = {});
  SGD(std::vector<Tensor> params, SGDOptions options = {});

  double lr() const override { return options_.lr; }
  void set_lr(double lr) override;
  /// SGD's momentum. Setting a non-zero momentum on an SGD built without one starts
  /// momentum buffers at the next step (from that step's gradient, as PyTorch does);
  /// nesterov keeps requiring momentum > 0.
  std::optional<double> momentum() const override { return options_.momentum; }
  void set_momentum(double momentum) override;
  const SGDOptions& options() const { return options_; }

 protected:
  std::vector<std::string> state_names() const override;
  void update(Device dev, float* param, const float* grad, float* const* state, std::int64_t n,
              bool first, std::int64_t step) override;

 private:
  SGDOptions options_;
};

}  // namespace dp::optim
