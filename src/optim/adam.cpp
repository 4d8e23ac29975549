#include "dp/optim/adam.h"

#include "backend/backend.h"
#include "dp/core/error.h"

namespace dp::optim {
namespace {

// Note [Deprecated beta1 and beta2]
// dp 0.1 spelled Adam's decay rates as two fields, beta1 and beta2; 0.2 has libtorch's
// betas tuple and keeps the old names for one release, so that code written for 0.1
// compiles (with a warning) and trains the same. Old code gives the old fields and
// leaves betas at its default, so a given old field replaces its half of betas here,
// once, and the options the optimizer keeps hold betas only: options(), set_momentum
// and the schedulers see one value. betas cannot tell "left at its default" from "set
// to it", so a half at its default yields; a half set to anything else that disagrees
// with the old field is an error, not a silent choice.
//
// The deprecation is on DeprecatedBeta's constructor from double, not on the fields:
// GCC 12 warns of a [[deprecated]] field at every braced AdamOptions passed to a
// function (`Adam opt(params, {.lr = 1e-3})`, where the field is only defaulted), and
// Clang at every implicit copy, so every user would see the warning. On the
// constructor it fires exactly where a number is given to beta1 or beta2.
AdamOptions resolved(AdamOptions o, const std::string& kind) {
  const AdamBetas defaults = AdamOptions{}.betas;
  const auto take = [&](const DeprecatedBeta& old, double& half, double def, const char* name, int index) {
    if (!old.value) return;
    DP_CHECK(half == def || half == *old.value, kind, ": expected the deprecated ", name,
             " to agree with betas[", index, "], got ", name, " = ", *old.value, " and betas[", index,
             "] = ", half, "; give betas = {beta1, beta2} only");
    half = *old.value;
  };
  take(o.beta1, std::get<0>(o.betas), std::get<0>(defaults), "beta1", 0);
  take(o.beta2, std::get<1>(o.betas), std::get<1>(defaults), "beta2", 1);
  o.beta1 = DeprecatedBeta{};
  o.beta2 = DeprecatedBeta{};
  return o;
}

// `kind` names the optimizer, or the group, in the messages: "Adam", "AdamW param group 1".
const AdamOptions& checked(const AdamOptions& o, const std::string& kind) {
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


AdamOptions with(AdamOptions o, const AdamGroupOptions& g) {
  if (g.lr) o.lr = *g.lr;
  if (g.betas) o.betas = *g.betas;
  if (g.eps) o.eps = *g.eps;
  if (g.weight_decay) o.weight_decay = *g.weight_decay;
  return o;
}

}  // namespace

Adam::Adam(nn::ParameterList params, AdamOptions options)
    : Adam(std::move(params), options, false, "Adam") {}

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(nn::ParameterList(std::move(params), {}, nullptr), options, false, "Adam") {}

Adam::Adam(std::vector<AdamParamGroup> groups, AdamOptions defaults)
    : Adam(std::move(groups), defaults, false, "Adam") {}

Adam::Adam(nn::ParameterList params, AdamOptions options, bool decoupled, const char* kind)
    : Optimizer(std::move(params), kind),
      options_{checked(resolved(options, kind), kind)},
      decoupled_(decoupled) {}

Adam::Adam(std::vector<AdamParamGroup> groups, AdamOptions defaults, bool decoupled, const char* kind)
    : Optimizer(lists_of(groups), kind), decoupled_(decoupled) {
  defaults = checked(resolved(defaults, kind), kind);
  for (std::size_t g = 0; g < groups.size(); ++g)
    options_.push_back(checked(with(defaults, groups[g].options), group_name(g)));
}

const AdamOptions& Adam::options(std::size_t group) const {
  check_group(group, "options");
  return options_[group];
}

void Adam::set_options(std::size_t group, const AdamOptions& options) {
  check_group(group, "set_options");
  options_[group] = checked(resolved(options, group_name(group)), group_name(group));
}

void Adam::set_lr(double lr) {
  DP_CHECK(lr >= 0, kind(), ": expected lr >= 0, got ", lr);
  for (AdamOptions& o : options_) o.lr = lr;
}

double Adam::group_lr(std::size_t group) const { return options(group).lr; }

void Adam::set_group_lr(std::size_t group, double lr) {
  AdamOptions o = options(group);
  o.lr = lr;
  set_options(group, o);
}

void Adam::set_momentum(double beta1) {
  DP_CHECK(beta1 >= 0 && beta1 < 1, kind(), ": expected beta1 in [0, 1), got ", beta1);
  for (AdamOptions& o : options_) std::get<0>(o.betas) = beta1;
}

std::optional<double> Adam::group_momentum(std::size_t group) const { return std::get<0>(options(group).betas); }

void Adam::set_group_momentum(std::size_t group, double beta1) {
  AdamOptions o = options(group);
  std::get<0>(o.betas) = beta1;
  set_options(group, o);
}

std::map<std::string, std::vector<double>> Adam::group_options(std::size_t group) const {
  const AdamOptions& o = options(group);
  return {{"lr", {o.lr}},
          {"betas", {std::get<0>(o.betas), std::get<1>(o.betas)}},
          {"eps", {o.eps}},
          {"weight_decay", {o.weight_decay}}};
}

void Adam::set_group_options(std::size_t group, const std::map<std::string, std::vector<double>>& options) {
  check_option_names(group, group_options(group), options);
  const std::vector<double>& betas = options.at("betas");
  set_options(group, AdamOptions{.lr = options.at("lr")[0],
                                 .betas = {betas[0], betas[1]},
                                 .eps = options.at("eps")[0],
                                 .weight_decay = options.at("weight_decay")[0]});
}

std::vector<std::string> Adam::state_names() const { return {"exp_avg", "exp_avg_sq"}; }

void Adam::update_group(std::size_t group, Device dev, float* param, const float* grad, float* const* state,
                        std::int64_t n, bool /*first*/, std::int64_t step) {
  const AdamOptions& o = options_[group];
  backend::get(dev).run<backend::Op::AdamStep>(
      dev, backend::DType::F32,
      {param, grad, state[0], state[1], n, o.lr, std::get<0>(o.betas), std::get<1>(o.betas), o.eps, o.weight_decay,
       decoupled_, step});
}

}  // namespace dp::optim
