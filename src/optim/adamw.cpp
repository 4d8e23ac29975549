#include "dp/optim/adamw.h"

namespace dp::optim {
namespace {

AdamOptions as_adam(const AdamWOptions& o) {
  return AdamOptions{.lr = o.lr, .betas = o.betas, .beta1 = o.beta1, .beta2 = o.beta2,
                     .eps = o.eps, .weight_decay = o.weight_decay};
}

}  // namespace

AdamW::AdamW(nn::ParameterList params, AdamWOptions options)
    : Adam(std::move(params), as_adam(options), true, "AdamW") {}

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options)
    : Adam(nn::ParameterList(std::move(params), {}, nullptr), as_adam(options), true, "AdamW") {}

AdamW::AdamW(std::vector<AdamParamGroup> groups, AdamWOptions defaults)
    : Adam(std::move(groups), as_adam(defaults), true, "AdamW") {}

}  // namespace dp::optim
