// src/parallel/copy_executor.h — DataParallel as its set's executor (internal).
//
// The set's executor (Note [Copy executors] in dp/nn/copy_executor.h): the optimizer's
// step and every copy's gradient work (zero_grad, clipping) each run as one update of
// every copy, DataParallel::run_on_copies: each persistent copy on its own device's
// worker (DP's transient replicas are never stepped, so DP's step stays on rank 0),
// with what the design adds before and after (DDP: Note [Gradient edits]; Sharded:
// Note [Sharded step]).
#pragma once

#include <functional>

#include "dp/optim/step_executor.h"
#include "dp/parallel/data_parallel.h"

namespace dp {

class DataParallel::Executor final : public optim::StepExecutor {
 public:
  explicit Executor(DataParallel& dp) : dp_(dp) {}
  void for_each_copy(int copies, const std::function<void(int)>& fn, nn::CopyWork work) override {
    dp_.run_on_copies(copies, /*update=*/false, work == nn::CopyWork::SmallGradients, fn);
  }
  void step_copies(int copies, const std::function<void(int)>& step) override {
    dp_.run_on_copies(copies, /*update=*/true, /*small=*/false, step);
  }

 private:
  DataParallel& dp_;
};

}  // namespace dp
