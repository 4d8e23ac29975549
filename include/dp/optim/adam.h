// dp/optim/adam.h — Adam (Kingma & Ba) with PyTorch's torch.optim.Adam formulas:
// coupled L2 weight decay (g += wd·p) and bias correction.
//
// One fused backend call per flat range and copy (see Note [Fused optimizer steps]).
// AdamW (decoupled weight decay) is in dp/optim/adamw.h.
//
//   dp::optim::Adam opt(model.parameters(), {.lr = 1e-3});
//   dp::optim::Adam opt(model.parameters(), {.lr = 1e-3, .betas = {0.9, 0.98}});
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "dp/optim/optimizer.h"

namespace dp::optim {

/// (β1, β2) of Adam and AdamW, spelled as libtorch spells them: `.betas = {0.9, 0.98}`;
/// read with std::get<0>(o.betas). Each must lie in [0, 1).
using AdamBetas = std::tuple<double, double>;

/// The type of AdamOptions' deprecated beta1 and beta2, dp 0.1's spelling of betas,
/// kept for the 0.2 release only so that `{.lr = 1e-3, .beta1 = 0.8}` still compiles
/// and takes effect. Giving it a number is what is deprecated (the compiler's warning
/// says "use betas"); options that leave it out compile without a warning. The
/// attribute sits on the constructor, not the field: on a field, GCC and Clang warn at
/// every brace-initialised AdamOptions and every copy (Note [Deprecated beta1 and
/// beta2] in src/optim/adam.cpp).
struct DeprecatedBeta {
  constexpr DeprecatedBeta() = default;
  [[deprecated("use betas = {beta1, beta2}")]] constexpr DeprecatedBeta(double v) : value(v) {}
  /// The number given, if any.
  std::optional<double> value;
};

/// Hyper-parameters of Adam (designated-initialiser friendly, libtorch's names).
struct AdamOptions {
  double lr = 1e-3;
  /// (β1, β2): the decay rates of the first and second moments.
  AdamBetas betas = {0.9, 0.999};
  /// Deprecated, removed after 0.2: betas' halves as dp 0.1 spelled them. A given one
  /// replaces its half of betas when the optimizer is built; a half of betas set to
  /// another value than both its default and this one is a dp::Error. An optimizer's
  /// options() hold betas only (these read back unset).
  DeprecatedBeta beta1 = {};
  DeprecatedBeta beta2 = {};
  double eps = 1e-8;
  double weight_decay = 0.0;
};

/// What a parameter group of Adam or AdamW sets instead of the optimizer's options
/// (Note [Parameter groups] in dp/optim/optimizer.h): each field left unset takes their
/// value. Betas are spelled `.betas = dp::optim::AdamBetas{0.9, 0.95}`.
struct AdamGroupOptions {
  std::optional<double> lr = {};
  std::optional<AdamBetas> betas = {};
  std::optional<double> eps = {};
  std::optional<double> weight_decay = {};
};
using AdamParamGroup = ParamGroup<AdamGroupOptions>;

/// m = β1·m + (1 − β1)·g; v = β2·v + (1 − β2)·g²;
/// p −= lr · (m / (1 − β1ᵗ)) / (sqrt(v / (1 − β2ᵗ)) + eps).
class Adam : public Optimizer {
 public:
  /// Throws dp::Error on lr, eps or weight_decay < 0, either beta outside [0, 1) (the
  /// message names which), a deprecated beta1/beta2 that disagrees with betas, and on an
  /// empty parameter list.
  Adam(nn::ParameterList params, AdamOptions options = {});
  Adam(std::vector<Tensor> params, AdamOptions options = {});
  /// Over parameter groups, each group's unset fields taken from `defaults` (Note
  /// [Parameter groups]). Also throws dp::Error naming the group for an empty group, a
  /// parameter in two groups, groups of different parameter sets and each bad value above.
  Adam(std::vector<AdamParamGroup> groups, AdamOptions defaults = {});

  double lr() const override { return options_[0].lr; }
  void set_lr(double lr) override;
  /// β1, the momentum of the first moment (PyTorch's betas[0]).
  std::optional<double> momentum() const override { return std::get<0>(options_[0].betas); }
  void set_momentum(double beta1) override;
  double group_lr(std::size_t group) const override;
  void set_group_lr(std::size_t group, double lr) override;
  std::optional<double> group_momentum(std::size_t group) const override;
  void set_group_momentum(std::size_t group, double beta1) override;
  /// Group g's options, every field set (group 0's without an index).
  const AdamOptions& options(std::size_t group = 0) const;
  /// Replaces group g's options; dp::Error naming the group and the value, changing
  /// nothing, for a value the constructor would refuse.
  void set_options(std::size_t group, const AdamOptions& options);

 protected:
  /// For AdamW: decoupled = true applies p *= 1 − lr·wd instead of g += wd·p.
  Adam(nn::ParameterList params, AdamOptions options, bool decoupled, const char* kind);
  /// Over groups, each with its options resolved but not yet checked.
  Adam(std::vector<AdamParamGroup> groups, AdamOptions defaults, bool decoupled, const char* kind);

  std::vector<std::string> state_names() const override;
  void update_group(std::size_t group, Device dev, float* param, const float* grad, float* const* state,
                    std::int64_t n, bool first, std::int64_t step) override;
  std::map<std::string, std::vector<double>> group_options(std::size_t group) const override;
  void set_group_options(std::size_t group, const std::map<std::string, std::vector<double>>& options) override;

 private:
  std::vector<AdamOptions> options_;  // per group
  bool decoupled_ = false;
};

}  // namespace dp::optim
