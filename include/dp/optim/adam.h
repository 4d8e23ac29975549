// dp/optim/adam.h — Adam (Kingma & Ba) with PyTorch's torch.optim.Adam formulas:
// coupled L2 weight decay (g += wd·p) and bias correction.
//
// One fused backend call per flat range and copy (see Note [Fused optimizer steps]).
// AdamW (decoupled weight decay) is in dp/optim/adamw.h.
//
//   dp::optim::Adam opt(model.parameters(), {.lr = 1e-3});
//   dp::optim::Adam opt(model.parameters(), {.lr = 1e-3, .betas = {0.9, 0.98}});
#pragma once

#include <tuple>
#include <vector>

#include "dp/optim/optimizer.h"

namespace dp::optim {

/// (β1, β2) of Adam and AdamW, spelled as libtorch spells them: `.betas = {0.9, 0.98}`;
/// read with std::get<0>(o.betas). Each must lie in [0, 1).
using AdamBetas = std::tuple<double, double>;

/// Hyper-parameters of Adam (designated-initialiser friendly, libtorch's names).
struct AdamOptions {
  double lr = 1e-3;
  /// (β1, β2): the decay rates of the first and second moments.
  AdamBetas betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
};

/// m = β1·m + (1 − β1)·g; v = β2·v + (1 − β2)·g²;
/// p −= lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + eps).
class Adam : public Optimizer {
 public:
  /// Throws dp::Error on lr, eps or weight_decay < 0, either beta outside [0, 1) (the
  /// message names which), and on an empty parameter list.
  Adam(nn::ParameterList params, AdamOptions options = {});
  Adam(std::vector<Tensor> params, AdamOptions options = {});

  double lr() const override { return options_.lr; }
  void set_lr(double lr) override;
  /// β1, the momentum of the first moment (PyTorch's betas[0]).
  std::optional<double> momentum() const override { return std::get<0>(options_.betas); }
  void set_momentum(double beta1) override;
  const AdamOptions& options() const { return options_; }

 protected:
  /// For AdamW: decoupled = true applies p *= 1 − lr·wd instead of g += wd·p.
  Adam(nn::ParameterList params, AdamOptions options, bool decoupled, const char* kind);

  std::vector<std::string> state_names() const override;
  void update(Device dev, float* param, const float* grad, float* const* state, std::int64_t n,
              bool first, std::int64_t step) override;

 private:
  AdamOptions options_;
  bool decoupled_ = false;
};

}  // namespace dp::optim
