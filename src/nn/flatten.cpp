#include "dp/nn/flatten.h"

#include "dp/core/error.h"

namespace dp::nn {

std::string Flatten::extra_repr() const {
  return detail::str_cat("start_dim=", start_, ", end_dim=", end_);
}

}  // namespace dp::nn
