// dp/nn/copy_executor.h — what runs gradient work on every copy of a parameter set.
//
// Note [Copy executors]
// A parameter set's copies (Note [Parameter sets]) may live on several devices, each
// served by a worker thread of the runtime that made them (DataParallel). Work over
// every copy then has to run where the runtime wants it, with what the runtime adds
// before and after. Each layer that does such work declares the interface it needs,
// and the runtime implements it:
//  - nn's gradient work (clip_grad_norm_, clip_grad_value_, an optimizer's zero_grad):
//    CopyExecutor, here — it touches gradients only and writes no parameter;
//  - optim's step, which writes each copy's parameters and after which a runtime may
//    have to make the copies whole again (a sharded set's gather): dp::optim::
//    StepExecutor (dp/optim/step_executor.h), a CopyExecutor that can also step.
// The set holds its executor as a CopyExecutor (ParameterSet::set_executor) and only
// passes it on: an optimizer finds its StepExecutor there (a dynamic_cast), so nn
// never names optim, and no layer calls a function another layer above installed
// (the runtime implements interfaces declared below it). Without an executor every
// copy runs in order on the calling thread. The executor says WHERE each copy's work
// runs; WHAT part of the buffers it covers — the copy's span — a runtime that cuts the
// buffers answers through the sibling interface nn::CopySpans (Note [Copy spans] in
// dp/nn/copy_spans.h), which the set holds likewise; a step or a clip reads it there.
// This header knows nothing of optimizers, DataParallel or threads.
//
//   struct Inline final : dp::nn::CopyExecutor {
//     void for_each_copy(int n, const std::function<void(int)>& fn, dp::nn::CopyWork) override {
//       for (int r = 0; r < n; ++r) fn(r); } };
#pragma once

#include <functional>

namespace dp::nn {

/// What the work given to CopyExecutor::for_each_copy does to each copy.
enum class CopyWork {
  Gradients,  // zero_grad, clipping and the like: touches gradients (or state) only
  // Gradients, and so little work (zeroing a few KiB) that one thread does every
  // copy's in less time than waking the copies' workers: an executor may run it on
  // the calling thread (Note [Small work inline] in src/parallel/data_parallel.cpp).
  SmallGradients,
};

/// Runs gradient work on every copy of a parameter set (Note [Copy executors]).
class CopyExecutor {
 public:
  virtual ~CopyExecutor() = default;
  /// Calls fn(r) for r in [0, num_copies), each on copy r's device (its worker), and
  /// returns once every call returned; rethrows a call's exception. fn skips the
  /// copies it has nothing to do for.
  virtual void for_each_copy(int num_copies, const std::function<void(int copy)>& fn, CopyWork work) = 0;
};

}  // namespace dp::nn
