#include "dp/nn/normalization.h"

#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"

namespace dp::nn {

LayerNorm::LayerNorm(const LayerNormOptions& o) : options_(o) {
  DP_CHECK(!o.normalized_shape().empty(), "LayerNorm: expected a non-empty normalized_shape, got []");
  for (std::int64_t s : o.normalized_shape())
    DP_CHECK(s > 0, "LayerNorm: expected positive sizes in normalized_shape, got ", shape_str(o.normalized_shape()));
  DP_CHECK(o.eps() >= 0, "LayerNorm: expected eps >= 0, got ", o.eps());
  if (o.elementwise_affine()) {
    weight_ = register_parameter("weight", ones(o.normalized_shape()));
    if (o.bias()) bias_ = register_parameter("bias", zeros(o.normalized_shape()));
  }
}

Tensor LayerNorm::forward(const Tensor& x) {
  DP_CHECK(x.defined(), "LayerNorm: expected a defined input, got an undefined tensor");
  return layer_norm(x, options_.normalized_shape(), weight(), bias(), options_.eps());
}

std::string LayerNorm::extra_repr() const {
  return detail::str_cat(shape_str(options_.normalized_shape()), ", eps=", options_.eps(),
                         ", elementwise_affine=", options_.elementwise_affine() ? "true" : "false");
}

}  // namespace dp::nn
