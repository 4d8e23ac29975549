#include "dp/nn/batchnorm.h"

#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/nn/parameter_set.h"

namespace dp::nn {

BatchNorm2d::BatchNorm2d(std::int64_t num_features, double eps, double momentum)
    : C_(num_features), eps_(eps), momentum_(momentum) {
  DP_CHECK(C_ > 0, "BatchNorm2d: expected num_features > 0, got ", C_);
  DP_CHECK(eps_ > 0, "BatchNorm2d: expected eps > 0, got ", eps_);
  DP_CHECK(momentum_ >= 0 && momentum_ <= 1, "BatchNorm2d: expected momentum in [0, 1], got ", momentum_);
  weight_ = register_parameter("weight", ones({C_}));
  bias_ = register_parameter("bias", zeros({C_}));
  running_mean_ = register_buffer("running_mean", zeros({C_}));
  running_var_ = register_buffer("running_var", ones({C_}));
  num_batches_tracked_ =
      register_buffer("num_batches_tracked", zeros({}, TensorOptions{Dtype::Int64, Device{}}));
}

BatchNorm2d::BatchNorm2d(const BatchNorm2dOptions& o) : BatchNorm2d(o.num_features(), o.eps(), o.momentum()) {}

Tensor BatchNorm2d::forward(const Tensor& x) {
  DP_CHECK(x.defined(), "BatchNorm2d: expected a defined input, got an undefined tensor");
  DP_CHECK(x.dim() == 4 && x.size(1) == C_, "BatchNorm2d: expected input (N, C=", C_, ", H, W), got ",
           shape_str(x.shape()));
  const bool training = is_training();
  Tensor y = batch_norm(x, weight_.get(), bias_.get(), running_mean_.get(), running_var_.get(),
                        training, momentum_, eps_);
  if (training) {
    // Counted like PyTorch (only used there when momentum is None, kept for
    // state_dict compatibility), on the device: no host sync per layer per step.
    Tensor count = num_batches_tracked_.get();  // a handle: add_ writes the bound copy
    count.add_(1.0);
  }
  // Note [Compute copies]: the parameters stay float32 under a compute dtype, and the
  // output goes on in the input's dtype (FSDP casts a BatchNorm's output back).
  if (const auto dtype = compute_dtype(); dtype && x.dtype() == *dtype && y.dtype() != *dtype) return y.to(*dtype);
  return y;
}

std::string BatchNorm2d::extra_repr() const {
  return detail::str_cat(C_, ", eps=", eps_, ", momentum=", momentum_);
}

}  // namespace dp::nn
