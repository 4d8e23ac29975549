#include "dp/optim/sgd.h"

#include <algorithm>

#include "backend/backend.h"
#include "dp/core/error.h"

namespace dp::optim {
namespace {

// `who` names the optimizer, or the group, in the messages: "SGD", "SGD param group 1".
const SGDOptions& checked(const SGDOptions& o, const std::string& who) {
  DP_CHECK(o.lr >= 0, who, ": expected lr >= 0, got ", o.lr);
  DP_CHECK(o.momentum >= 0, who, ": expected momentum >= 0, got ", o.momentum);
  DP_CHECK(o.weight_decay >= 0, who, ": expected weight_decay >= 0, got ", o.weight_decay);
  DP_CHECK(o.dampening >= 0 && o.dampening <= 1, who, ": expected dampening in [0, 1], got ", o.dampening);
  DP_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), who,
           ": nesterov momentum requires momentum > 0 and dampening = 0, got momentum=", o.momentum,
           ", dampening=", o.dampening);
  return o;
}

SGDOptions with(SGDOptions o, const SGDGroupOptions& g) {
  if (g.lr) o.lr = *g.lr;
  if (g.momentum) o.momentum = *g.momentum;
  if (g.dampening) o.dampening = *g.dampening;
  if (g.weight_decay) o.weight_decay = *g.weight_decay;
  if (g.nesterov) o.nesterov = *g.nesterov;
  return o;
}

}  // namespace

SGD::SGD(nn::ParameterList params, SGDOptions options)
    : Optimizer(std::move(params), "SGD"), options_{checked(options, "SGD")} {
  note_momentum();
}

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : SGD(nn::ParameterList(std::move(params), {}, nullptr), options) {}

SGD::SGD(std::vector<SGDParamGroup> groups, SGDOptions defaults) : Optimizer(lists_of(groups), "SGD") {
  checked(defaults, "SGD");
  for (std::size_t g = 0; g < groups.size(); ++g) options_.push_back(checked(with(defaults, groups[g].options), group_name(g)));
  note_momentum();
}

void SGD::note_momentum() {
  had_momentum_ = had_momentum_ || std::any_of(options_.begin(), options_.end(),
                                               [](const SGDOptions& o) { return o.momentum != 0; });
}

void SGD::before_load(const nn::StateDict& state) {
  const std::string suffix = ".momentum_buffer";
  for (const auto& [name, t] : state)
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      had_momentum_ = true;
}

const SGDOptions& SGD::options(std::size_t group) const {
  check_group(group, "options");
  return options_[group];
}

void SGD::set_options(std::size_t group, const SGDOptions& options) {
  check_group(group, "set_options");
  options_[group] = checked(options, group_name(group));
  note_momentum();
}

void SGD::set_lr(double lr) {
  DP_CHECK(lr >= 0, "SGD: expected lr >= 0, got ", lr);
  for (SGDOptions& o : options_) o.lr = lr;
}

double SGD::group_lr(std::size_t group) const { return options(group).lr; }

void SGD::set_group_lr(std::size_t group, double lr) {
  SGDOptions o = options(group);
  o.lr = lr;
  set_options(group, o);
}

void SGD::set_momentum(double momentum) {
  DP_CHECK(momentum >= 0, "SGD: expected momentum >= 0, got ", momentum);
  for (std::size_t g = 0; g < options_.size(); ++g) {
    DP_CHECK(!options_[g].nesterov || momentum > 0, group_name(g), ": nesterov momentum requires momentum > 0, got ",
             momentum);
  }
  for (SGDOptions& o : options_) o.momentum = momentum;
  note_momentum();
}

std::optional<double> SGD::group_momentum(std::size_t group) const { return options(group).momentum; }

void SGD::set_group_momentum(std::size_t group, double momentum) {
  SGDOptions o = options(group);
  o.momentum = momentum;
  set_options(group, o);
}

std::map<std::string, std::vector<double>> SGD::group_options(std::size_t group) const {
  const SGDOptions& o = options(group);
  return {{"lr", {o.lr}},
          {"momentum", {o.momentum}},
          {"dampening", {o.dampening}},
          {"weight_decay", {o.weight_decay}},
          {"nesterov", {o.nesterov ? 1.0 : 0.0}}};
}

void SGD::set_group_options(std::size_t group, const std::map<std::string, std::vector<double>>& options) {
  check_option_names(group, group_options(group), options);
  const double nesterov = options.at("nesterov")[0];
  DP_CHECK(nesterov == 0 || nesterov == 1, group_name(group), ": expected nesterov 0 or 1, got ", nesterov);
  set_options(group, SGDOptions{.lr = options.at("lr")[0],
                                .momentum = options.at("momentum")[0],
                                .dampening = options.at("dampening")[0],
                                .weight_decay = options.at("weight_decay")[0],
                                .nesterov = nesterov == 1});
}

std::vector<std::string> SGD::state_names() const {
  // One momentum buffer over every group's parameters once any group has had momentum.
  if (!had_momentum_) return {};
  return {"momentum_buffer"};
}

bool SGD::group_uses_state(std::size_t group) const { return options_[group].momentum != 0; }

void SGD::update_group(std::size_t group, Device dev, float* param, const float* grad, float* const* state,
                       std::int64_t n, bool first, std::int64_t /*step*/) {
  const SGDOptions& o = options_[group];
  backend::get(dev).run<backend::Op::SgdStep>(
      dev, backend::DType::F32,
      {param, grad, o.momentum != 0 ? state[0] : nullptr, n, o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov,
       first});
}

}  // namespace dp::optim
