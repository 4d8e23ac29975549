#include "dp/nn/copy_spans.h"

#include "dp/core/error.h"
#include "dp/nn/parameter_set.h"

namespace dp::nn {

const Tensor& CopySpan::owned_grad() const {
  DP_CHECK(grad.defined(), "ParameterSet: copy on ", data.device(), " has no gradient buffer");
  return grad;
}

CopySpan copy_span(const ParameterSet& set, int copy) {
  if (const CopySpans* spans = set.spans()) return spans->span(copy);
  const ParameterCopy& c = set.copy(copy);
  return {.begin = 0, .end = set.buffer_numel(), .data = c.data, .grad = c.grad};
}

ProcessExchange* process_exchange(const ParameterSet& set) {
  CopySpans* spans = set.spans();
  return spans != nullptr ? spans->exchange() : nullptr;
}

bool spans_cut(const ParameterSet& set) {
  if (set.spans() == nullptr) return false;
  for (int r = 0; r < set.num_copies(); ++r) {
    const CopySpan s = copy_span(set, r);
    if (s.begin != 0 || s.end != set.buffer_numel()) return true;
  }
  return false;
}

}  // namespace dp::nn
