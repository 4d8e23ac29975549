#include "dp/nn/loss.h"

#include <cmath>
#include <limits>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"

namespace dp::nn {
namespace {

Tensor on(const Tensor& t, Device dev) { return t.defined() && t.device() != dev ? t.to(dev) : t; }

void check_target(const char* name, const Tensor& target) {
  DP_CHECK(target.defined(), name, ": expected a defined target, got an undefined tensor");
}

/// D of a class-index loss's Mean: Σ_r w_r over the rows not ignored (Note [Class-index
/// losses]), from the whole batch's target, in float32 as the losses sum it.
double class_denominator(const char* name, const Tensor& labels, const Tensor& weight, std::int64_t ignore_index) {
  check_target(name, labels);
  DP_CHECK((labels.dtype() == Dtype::Int64 || labels.dtype() == Dtype::Int32) && labels.dim() == 1, name,
           ": expected int64 or int32 class indices of shape [B] as target, got ", labels.str());
  NoGradGuard no_grad;
  const Tensor target = labels.dtype() == Dtype::Int64 ? labels : labels.to(Dtype::Int64);
  const Device dev = target.device();
  const std::int64_t B = target.size(0);
  Tensor ignored = eq(target, from_vector(std::vector<std::int64_t>{ignore_index}, {}, dev));  // (B): 1 or 0
  if (!weight.defined()) return static_cast<double>(B) - sum(ignored).item();
  DP_CHECK(weight.dim() == 1, name, ": expected weight of shape [C], got ", weight.str());
  const std::int64_t C = weight.size(0);
  Tensor onehot = eq(target.reshape({B, 1}), arange(C, TensorOptions{Dtype::Int64, dev}).reshape({1, C}));
  Tensor keep = add(mul(ignored, -1.0), 1.0).reshape({B, 1});
  return sum(mul(mul(onehot, keep), on(weight, dev).reshape({1, C}))).item();
}

double element_denominator(const char* name, const Tensor& target) {
  check_target(name, target);
  return static_cast<double>(target.numel());
}

}  // namespace

// ---- descriptors on a whole batch -------------------------------------------------------------

Tensor CrossEntropyLoss::operator()(const Tensor& logits, const Tensor& target) const {
  return cross_entropy(logits, target,
                       CrossEntropyOptions{.weight = on(weight, logits.device()), .ignore_index = ignore_index,
                                           .reduction = reduction, .label_smoothing = label_smoothing});
}

Tensor NLLLoss::operator()(const Tensor& logp, const Tensor& target) const {
  return nll_loss(logp, target,
                  NLLLossOptions{.weight = on(weight, logp.device()), .ignore_index = ignore_index, .reduction = reduction});
}

Tensor MSELoss::operator()(const Tensor& input, const Tensor& target) const { return mse_loss(input, target, reduction); }

Tensor L1Loss::operator()(const Tensor& input, const Tensor& target) const { return l1_loss(input, target, reduction); }

Tensor SmoothL1Loss::operator()(const Tensor& input, const Tensor& target) const {
  return smooth_l1_loss(input, target, reduction, beta);
}

Tensor BCEWithLogitsLoss::operator()(const Tensor& input, const Tensor& target) const {
  return binary_cross_entropy_with_logits(
      input, target,
      BCEWithLogitsOptions{.weight = on(weight, input.device()), .pos_weight = on(pos_weight, input.device()),
                           .reduction = reduction});
}

// ---- ShardableLoss ------------------------------------------------------------------------------

ShardableLoss::ShardableLoss(const CrossEntropyLoss& l) : name_("CrossEntropyLoss"), reduction_(l.reduction) {
  mean_denominator_ = [l](const Tensor& t) { return class_denominator("CrossEntropyLoss", t, l.weight, l.ignore_index); };
  scaled_sum_ = [l](const Tensor& out, const Tensor& t, double scale) {
    return cross_entropy(out, t,
                         CrossEntropyOptions{.weight = on(l.weight, out.device()), .ignore_index = l.ignore_index,
                                             .reduction = Reduction::Sum, .label_smoothing = l.label_smoothing,
                                             .scale = scale});
  };
  whole_ = l;
}

ShardableLoss::ShardableLoss(const NLLLoss& l) : name_("NLLLoss"), reduction_(l.reduction) {
  mean_denominator_ = [l](const Tensor& t) { return class_denominator("NLLLoss", t, l.weight, l.ignore_index); };
  scaled_sum_ = [l](const Tensor& out, const Tensor& t, double scale) {
    return nll_loss(out, t,
                    NLLLossOptions{.weight = on(l.weight, out.device()), .ignore_index = l.ignore_index,
                                   .reduction = Reduction::Sum, .scale = scale});
  };
  whole_ = l;
}

ShardableLoss::ShardableLoss(const MSELoss& l) : name_("MSELoss"), reduction_(l.reduction) {
  mean_denominator_ = [](const Tensor& t) { return element_denominator("MSELoss", t); };
  scaled_sum_ = [](const Tensor& out, const Tensor& t, double scale) { return mse_loss(out, t, Reduction::Sum, scale); };
  whole_ = l;
}

ShardableLoss::ShardableLoss(const L1Loss& l) : name_("L1Loss"), reduction_(l.reduction) {
  mean_denominator_ = [](const Tensor& t) { return element_denominator("L1Loss", t); };
  scaled_sum_ = [](const Tensor& out, const Tensor& t, double scale) { return l1_loss(out, t, Reduction::Sum, scale); };
  whole_ = l;
}

ShardableLoss::ShardableLoss(const SmoothL1Loss& l) : name_("SmoothL1Loss"), reduction_(l.reduction) {
  mean_denominator_ = [](const Tensor& t) { return element_denominator("SmoothL1Loss", t); };
  scaled_sum_ = [beta = l.beta](const Tensor& out, const Tensor& t, double scale) {
    return smooth_l1_loss(out, t, Reduction::Sum, beta, scale);
  };
  whole_ = l;
}

ShardableLoss::ShardableLoss(const BCEWithLogitsLoss& l) : name_("BCEWithLogitsLoss"), reduction_(l.reduction) {
  mean_denominator_ = [](const Tensor& t) { return element_denominator("BCEWithLogitsLoss", t); };
  scaled_sum_ = [l](const Tensor& out, const Tensor& t, double scale) {
    return binary_cross_entropy_with_logits(
        out, t,
        BCEWithLogitsOptions{.weight = on(l.weight, out.device()), .pos_weight = on(l.pos_weight, out.device()),
                             .reduction = Reduction::Sum, .scale = scale});
  };
  whole_ = l;
  const Tensor& w = l.weight;
  split_check_ = [w](const Tensor& t) {
    DP_CHECK(!w.defined() || w.dim() < t.dim() || w.size(0) == 1,
             "BCEWithLogitsLoss: a weight of shape ", shape_str(w.shape()), " spans the batch (dim 0) of the target ",
             shape_str(t.shape()), ", so it cannot be split by rows; give it size 1 in dim 0 or fewer dims, or "
             "compute the loss on model(x)'s gathered output");
  };
}

double ShardableLoss::denominator(const Tensor& target) const {
  DP_CHECK(reduction_ != Reduction::None, name_, " with Reduction::None gives one loss per row, and a split "
           "forward and backward needs one scalar to differentiate; use Reduction::Sum or Reduction::Mean, or "
           "compute the per-row losses on model(x)'s gathered output");
  check_target(name_.c_str(), target);
  if (split_check_) split_check_(target);
  return reduction_ == Reduction::Sum ? 1.0 : mean_denominator_(target);
}

Tensor ShardableLoss::shard_loss(const Tensor& output, const Tensor& target, double scale) const {
  if (std::isfinite(scale)) return scaled_sum_(output, target, scale);
  // D = 0: every target of the batch is ignored; PyTorch's mean is 0 / 0 = NaN.
  return mul(scaled_sum_(output, target, 1.0), std::numeric_limits<double>::quiet_NaN());
}

}  // namespace dp::nn
