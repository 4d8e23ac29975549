// dp/optim/sgd.h — stochastic gradient descent with momentum, dampening, Nesterov and
// (coupled) weight decay, PyTorch's torch.optim.SGD formulas.
//
// One fused backend call per flat range and copy (see Note [Fused optimizer steps]).
//
//   dp::optim::SGD opt(net->parameters(), {.lr = 0.1, .momentum = 0.9, .nesterov = true});
//   dp::optim::SGD opt({{weights, {.weight_decay = 5e-4}}, {biases}}, {.lr = 0.1, .momentum = 0.9});
#pragma once

#include <optional>
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

/// What a parameter group sets instead of the optimizer's SGDOptions (Note [Parameter
/// groups] in dp/optim/optimizer.h): each field left unset takes their value.
struct SGDGroupOptions {
  std::optional<double> lr = {};
  std::optional<double> momentum = {};
  std::optional<double> dampening = {};
  std::optional<double> weight_decay = {};
  std::optional<bool> nesterov = {};
};
using SGDParamGroup = ParamGroup<SGDGroupOptions>;

/// g = grad + wd·p; buf = g on the first step, else momentum·buf + (1 − dampening)·g;
/// g = nesterov ? g + momentum·buf : buf (when momentum ≠ 0); p −= lr·g.
class SGD : public Optimizer {
 public:
  /// Throws dp::Error on lr, momentum or weight_decay < 0, on nesterov without
  /// momentum or with dampening, and on an empty parameter list.
  SGD(nn::ParameterList params, SGDOptions options = {});
  SGD(std::vector<Tensor> params, SGDOptions options = {});
  /// Over parameter groups, each group's unset fields taken from `defaults` (Note
  /// [Parameter groups]). Also throws dp::Error naming the group for an empty group, a
  /// parameter in two groups, groups of different parameter sets and each bad value above.
  SGD(std::vector<SGDParamGroup> groups, SGDOptions defaults = {});

  double lr() const override { return options_[0].lr; }
  void set_lr(double lr) override;
  /// SGD's momentum. Setting a non-zero momentum on an SGD built without one starts
  /// momentum buffers at the next step (from that step's gradient, as PyTorch does);
  /// nesterov keeps requiring momentum > 0.
  std::optional<double> momentum() const override { return options_[0].momentum; }
  void set_momentum(double momentum) override;
  double group_lr(std::size_t group) const override;
  void set_group_lr(std::size_t group, double lr) override;
  std::optional<double> group_momentum(std::size_t group) const override;
  void set_group_momentum(std::size_t group, double momentum) override;
  /// Group g's options, every field set (group 0's without an index).
  const SGDOptions& options(std::size_t group = 0) const;
  /// Replaces group g's options; dp::Error naming the group and the value, changing
  /// nothing, for a value the constructor would refuse.
  void set_options(std::size_t group, const SGDOptions& options);

 protected:
  /// {"momentum_buffer"} once any group has had momentum (Note [Optimizer state starts]).
  std::vector<std::string> state_names() const override;
  void before_load(const nn::StateDict& state) override;
  /// A group's momentum buffer starts at its first step with momentum, as PyTorch's.
  bool group_uses_state(std::size_t group) const override;
  void update_group(std::size_t group, Device dev, float* param, const float* grad, float* const* state,
                    std::int64_t n, bool first, std::int64_t step) override;
  std::map<std::string, std::vector<double>> group_options(std::size_t group) const override;
  void set_group_options(std::size_t group, const std::map<std::string, std::vector<double>>& options) override;

 private:
  /// Records whether a group has momentum now: had_momentum_ never goes back to false.
  void note_momentum();

  std::vector<SGDOptions> options_;  // per group
  bool had_momentum_ = false;        // some group has had momentum, or a loaded state a buffer
};

}  // namespace dp::optim
