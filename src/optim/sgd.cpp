#include "dp/optim/sgd.h"

#include "backend/backend.h"
#include "dp/core/error.h"

namespace dp::optim {
namespace {

const SGDOptions& checked(const SGDOptions& o) {
  DP_CHECK(o.lr >= 0, "SGD: expected lr >= 0, got ", o.lr);
  DP_CHECK(o.momentum >= 0, "SGD: expected momentum >= 0, got ", o.momentum);
  DP_CHECK(o.weight_decay >= 0, "SGD: expected weight_decay >= 0, got ", o.weight_decay);
  DP_CHECK(o.dampening >= 0 && o.dampening <= 1, "SGD: expected dampening in [0, 1], got ", o.dampening);
  DP_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
           "SGD: nesterov momentum requires momentum > 0 and dampening = 0, got momentum=",
           o.momentum, ", dampening=", o.dampening);
  return o;
}

}  // namespace

SGD::SGD(nn::ParameterList params, SGDOptions options)
    : Optimizer(std::move(params), "SGD"), options_(checked(options)) {}

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : SGD(nn::ParameterList(std::move(params), {}, nullptr), options) {}

void SGD::set_lr(double lr) {
  DP_CHECK(lr >= 0, "SGD: expected lr >= 0, got ", lr);
  options_.lr = lr;
}

void SGD::set_momentum(double momentum) {
  DP_CHECK(momentum >= 0, "SGD: expected momentum >= 0, got ", momentum);
  DP_CHECK(!options_.nesterov || momentum > 0, "SGD: nesterov momentum requires momentum > 0, got ",
           momentum);
  options_.momentum = momentum;
}

std::vector<std::string> SGD::state_names() const {
  if (options_.momentum == 0) return {};
  return {"momentum_buffer"};
}

void SGD::update(Device dev, float* param, const float* grad, float* const* state,
                 std::int64_t n, bool first, std::int64_t /*step*/) {
  backend::get(dev).run<backend::Op::SgdStep>(
      dev, backend::DType::F32,
      {param, grad, options_.momentum != 0 ? state[0] : nullptr, n, static_cast<float>(options_.lr),
       static_cast<float>(options_.momentum), static_cast<float>(options_.dampening),
       static_cast<float>(options_.weight_decay), options_.nesterov, first});
}

}  // namespace dp::optim
