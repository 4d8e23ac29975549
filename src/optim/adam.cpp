#include "dp/optim/adam.h"

#include "backend/backend.h"
#include "dp/core/error.h"

namespace dp::optim {
namespace {

const AdamOptions& checked(const AdamOptions& o, const char* kind) {
  DP_CHECK(o.lr >= 0, kind, ": expected lr >= 0, got ", o.lr);
  DP_CHECK(o.eps >= 0, kind, ": expected eps >= 0, got ", o.eps);
  const auto [beta1, beta2] = o.betas;
  // Written so that NaN fails too.
  DP_CHECK(beta1 >= 0 && beta1 < 1, kind, ": expected betas[0] (beta1) in [0, 1), got betas = {", beta1, ", ",
           beta2, "}");
  DP_CHECK(beta2 >= 0 && beta2 < 1, kind, ": expected betas[1] (beta2) in [0, 1), got betas = {", beta1, ", ",
           beta2, "}");
  DP_CHECK(o.weight_decay >= 0, kind, ": expected weight_decay >= 0, got ", o.weight_decay);
  return o;
}

}  // namespace

Adam::Adam(nn::ParameterList params, AdamOptions options)
    : Adam(std::move(params), options, false, "Adam") {}

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(nn::ParameterList(std::move(params), {}, nullptr), options, false, "Adam") {}

Adam::Adam(nn::ParameterList params, AdamOptions options, bool decoupled, const char* kind)
    : Optimizer(std::move(params), kind), options_(checked(options, kind)), decoupled_(decoupled) {}

void Adam::set_lr(double lr) {
  DP_CHECK(lr >= 0, kind(), ": expected lr >= 0, got ", lr);
  options_.lr = lr;
}

void Adam::set_momentum(double beta1) {
  DP_CHECK(beta1 >= 0 && beta1 < 1, kind(), ": expected beta1 in [0, 1), got ", beta1);
  std::get<0>(options_.betas) = beta1;
}

std::vector<std::string> Adam::state_names() const { return {"exp_avg", "exp_avg_sq"}; }

void Adam::update(Device dev, float* param, const float* grad, float* const* state,
                  std::int64_t n, bool /*first*/, std::int64_t step) {
  backend::get(dev).adam_step(dev, param, grad, state[0], state[1], n,
                              static_cast<float>(options_.lr), static_cast<float>(std::get<0>(options_.betas)),
                              static_cast<float>(std::get<1>(options_.betas)), static_cast<float>(options_.eps),
                              static_cast<float>(options_.weight_decay), decoupled_, step);
}

}  // namespace dp::optim
