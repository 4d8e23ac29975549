// dp/nn/process_exchange.h — how code over a parameter set reaches the other processes.
//
// Note [Process exchange]
// A set sharded across processes (Note [Ranges across processes] in
// src/parallel/shard_store.h) holds only this process's ranges. What needs a value of every
// range — clip_grad_norm_'s total (nn), an optimizer's state_dict (optim) — hands its
// own part, in flat order, to the set's ProcessExchange, which returns every
// process's part in process order, i.e. in flat order again. The interface is
// declared here, in nn, the lowest layer that calls it, and implemented by the
// runtime that sharded the set (DataParallel's Sharded design, over dp::dist), which
// hands it out with the set's spans (CopySpans::exchange, read through
// nn::process_exchange(set): Note [Copy spans] in dp/nn/copy_spans.h), since it is the
// spans that span processes, not the set's buffers. Why not call dp::dist
// from nn and optim directly: WHICH processes hold the set's ranges, and in which
// order, is the runtime's knowledge, not the set's (every process of the job for
// stages 1 and 2, none for stage 3's hybrid sharding, Note [Stage 3 across
// processes]), and nn and optim stay free of the job of processes. Why not core:
// the contract speaks of a set's ranges in flat order, which core knows nothing of.
// This header knows nothing of DataParallel, comm or dist.
//
//   std::vector<float> every;
//   for (const auto& part : dp::nn::process_exchange(set)->gather(mine))
//     every.insert(every.end(), part.begin(), part.end());
#pragma once

#include <vector>

namespace dp::nn {

/// Every process's part of a value over a set's ranges (Note [Process exchange]).
class ProcessExchange {
 public:
  virtual ~ProcessExchange() = default;
  /// Every process's part, in process order (this process's is `mine`); the parts may
  /// differ in length. Collective: every process of the set must call it the same
  /// number of times, in the same order. Throws dp::Error when another process fails
  /// or does not call it in time.
  virtual std::vector<std::vector<float>> gather(const std::vector<float>& mine) = 0;
};

}  // namespace dp::nn
