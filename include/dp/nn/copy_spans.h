// dp/nn/copy_spans.h — which part of a parameter set's flat buffers each copy owns.
//
// Note [Copy spans]
// Work over every copy of a parameter set (Note [Parameter sets]) — an optimizer step,
// clipping, zeroing a released gradient — acts on each copy's *span*: the part
// [begin, end) of the flat buffers the copy owns, with the tensors that hold exactly
// that part of its parameters and of its gradient. Without a runtime every copy owns
// the whole buffers: the span is [0, buffer_numel()) and its tensors are the copy's
// `data` and `grad`. A runtime that cuts the buffers into ranges (Mode::Sharded's
// store, Note [Sharded parameter sets] in src/parallel/shard_store.h) keeps the ranges
// itself and answers through this interface, installed on the set
// (ParameterSet::set_spans); the set holds it and passes it on, never owns it. When
// the spans are cut across processes, the set holds only this process's, and the
// interface also answers how the others are reached (Note [Process exchange] in
// dp/nn/process_exchange.h). Such a
// runtime may keep a copy's gradient of its span outside the flat gradient buffer,
// which it releases between backward passes, and may keep in `data` only the span
// (Note [View providers] in dp/nn/view_provider.h): code over a span indexes only
// CopySpan::data and CopySpan::grad, relative to `begin`, never ParameterCopy::data or
// grad by flat index. nn declares the interface, the runtime implements it: no layer
// calls a function a higher one installed (Note [Copy executors] in
// dp/nn/copy_executor.h). This header knows nothing of sharding, processes or
// DataParallel.
//
//   const dp::nn::CopySpan s = dp::nn::copy_span(set, r);
//   float* p = s.data.data<float>();     // element i of the buffers at p[i - s.begin]
//   s.grad.mul_(0.5);                    // copy r's owned gradient only
#pragma once

#include <cstdint>

#include "dp/nn/process_exchange.h"
#include "dp/tensor/tensor.h"

namespace dp::nn {

class ParameterSet;

/// The part of the flat buffers one copy owns (Note [Copy spans]).
struct CopySpan {
  std::int64_t begin = 0, end = 0;  // [begin, end) of the flat buffers
  Tensor data;  // (end - begin) float32: element i of the buffers (begin <= i < end) at [i - begin]
  Tensor grad;  // (end - begin) float32, likewise; undefined when the copy holds no gradient
  /// `grad`; throws dp::Error naming the copy's device when it is undefined.
  const Tensor& owned_grad() const;
};

/// What a runtime that cuts a set's buffers answers for each copy (Note [Copy spans]).
class CopySpans {
 public:
  virtual ~CopySpans() = default;
  /// Copy r's span and its tensors, as they are now (the tensors change as the runtime
  /// acquires and releases buffers). Callable from any copy's worker concurrently.
  virtual CopySpan span(int copy) const = 0;
  /// The exchange with the processes that hold the other spans when this process holds
  /// only some of them (Note [Process exchange]), else null.
  virtual ProcessExchange* exchange() = 0;
};

/// Copy r's span: the answer of the set's CopySpans when one is installed, else the
/// whole buffers ([0, buffer_numel()), the copy's data and grad).
CopySpan copy_span(const ParameterSet& set, int copy);
/// True when some copy owns only part of the buffers (each copy then steps its own).
bool spans_cut(const ParameterSet& set);
/// The exchange with the other processes when the set holds only this process's spans:
/// a value over every span needs it (Note [Process exchange]). Null otherwise.
ProcessExchange* process_exchange(const ParameterSet& set);

}  // namespace dp::nn
