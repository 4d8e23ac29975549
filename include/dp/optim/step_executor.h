// dp/optim/step_executor.h — what runs an optimizer's step on every copy of a set.
//
// The interface an optimizer needs from the runtime that holds a parameter set's
// copies on several devices (Note [Copy executors] in dp/nn/copy_executor.h): step
// each copy's range of the flat buffers on the copy's device, and leave the copies
// as the runtime needs them afterwards. DataParallel implements it; an optimizer
// finds it through the set (ParameterSet::executor()). Knows nothing of
// DataParallel or threads.
//
//   if (auto* ex = dynamic_cast<dp::optim::StepExecutor*>(set.executor()))
//     ex->step_copies(set.num_copies(), [&](int r) { step_copy(r); });
#pragma once

#include <functional>

#include "dp/nn/copy_executor.h"

namespace dp::optim {

/// Runs an optimizer's step and gradient work on every copy (Note [Copy executors]).
class StepExecutor : public nn::CopyExecutor {
 public:
  /// Calls step(r) for r in [0, num_copies), each on copy r's device (its worker), where
  /// step(r) updates the parameters of copy r's span from its gradient (Note [Copy
  /// spans] in dp/nn/copy_spans.h); returns once every call returned and the copies are as the runtime
  /// keeps them between steps (e.g. every range gathered into every copy). Rethrows a
  /// call's exception. step skips the copies an optimizer does not step.
  virtual void step_copies(int num_copies, const std::function<void(int copy)>& step) = 0;
};

}  // namespace dp::optim
