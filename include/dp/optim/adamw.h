// dp/optim/adamw.h — AdamW (Loshchilov & Hutter): Adam with decoupled weight decay,
// PyTorch's torch.optim.AdamW formulas (p *= 1 − lr·wd before the Adam update).
//
//   dp::optim::AdamW opt(net->parameters(), {.lr = 1e-3});   // weight_decay 1e-2
//   dp::optim::AdamW opt(net->parameters(), {.lr = 3e-4, .betas = {0.9, 0.95}, .weight_decay = 0.1});
//   dp::optim::AdamW opt({{matrices}, {others, {.weight_decay = 0.0}}}, {.lr = 6e-4, .weight_decay = 0.1});
#pragma once

#include <vector>

#include "dp/optim/adam.h"

namespace dp::optim {

/// Hyper-parameters of AdamW: Adam's, with PyTorch's default weight_decay = 1e-2.
struct AdamWOptions {
  double lr = 1e-3;
  /// (β1, β2) as in AdamOptions.
  AdamBetas betas = {0.9, 0.999};
  /// Deprecated, removed after 0.2: as in AdamOptions.
  DeprecatedBeta beta1 = {};
  DeprecatedBeta beta2 = {};
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

/// Adam with decoupled weight decay.
class AdamW : public Adam {
 public:
  AdamW(nn::ParameterList params, AdamWOptions options = {});
  AdamW(std::vector<Tensor> params, AdamWOptions options = {});
  /// Over parameter groups (AdamGroupOptions), as Adam's.
  AdamW(std::vector<AdamParamGroup> groups, AdamWOptions defaults = {});
};

}  // namespace dp::optim
