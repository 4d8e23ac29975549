// DataParallel's scatter and gather (src/parallel/scatter_gather.h).
#include "parallel/scatter_gather.h"

#include <algorithm>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "parallel/phase_timer.h"

namespace dp {

using parallel::Phase;
using parallel::PhaseTimer;

// Checks a forward's inputs; returns the batch's rows (the split inputs' size(0)).
std::int64_t DataParallel::check_inputs(const char* what, const std::vector<DataParallelInput>& inputs) const {
  DP_CHECK(!inputs.empty(), "DataParallel::", what, ": expected at least one input, got none");
  std::int64_t rows = -1;
  std::size_t first = 0;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& t = inputs[k].tensor;
    DP_CHECK(t.defined(), "DataParallel::", what, ": input ", k, " is an undefined tensor");
    if (inputs[k].replicated) continue;
    DP_CHECK(t.dim() >= 1 && t.size(0) >= 1, "DataParallel::", what, ": input ", k,
             " must be batched (N, ...) with N >= 1, got ", t.str(),
             "; wrap an input that every device needs whole in dp::replicated(t)");
    if (rows < 0) {
      rows = t.size(0);
      first = k;
    }
    DP_CHECK(t.size(0) == rows, "DataParallel::", what, ": every split input must have the same size(0), "
             "input ", first, " has ", rows, " rows and input ", k, " has ", t.size(0), " (", t.str(),
             "); wrap an input that every device needs whole in dp::replicated(t)");
  }
  DP_CHECK(rows >= 1, "DataParallel::", what, ": every input is replicated (0-d or dp::replicated), so "
           "there is no batch to split; pass at least one batched input (N, ...)");
  return rows;
}

DataParallel::ShardPlan DataParallel::plan_shards(std::int64_t rows) const {
  const int n = static_cast<int>(devices_.size());
  ShardPlan plan{rows, {}, std::vector<std::int64_t>(n, 0)};
  if (!options_.chunk_sizes.empty()) {
    const auto& cs = options_.chunk_sizes;
    DP_CHECK(static_cast<int>(cs.size()) <= n, "DataParallel: ", cs.size(), " chunk_sizes for ", n,
             " devices; expected at most one per device");
    std::int64_t total = 0;
    for (auto c : cs) {
      DP_CHECK(c >= 0, "DataParallel: chunk_sizes must be >= 0, got ", c);
      total += c;
    }
    DP_CHECK(total == rows, "DataParallel: chunk_sizes sum to ", total, " but the batch has ", rows, " rows");
    plan.sizes = cs;
  } else {
    std::int64_t step = (rows + n - 1) / n;  // torch.chunk: ceil-sized chunks
    for (std::int64_t at = 0; at < rows; at += step) plan.sizes.push_back(std::min(step, rows - at));
  }
  plan.sizes.resize(n, 0);
  for (int r = 1; r < n; ++r) plan.offsets[r] = plan.offsets[r - 1] + plan.sizes[r - 1];
  return plan;
}

// Note [Scatter backward]
// When the input needs a gradient, each worker's shard is a
// leaf of that worker's graph; after the workers' backward, GatherBackward returns
// the leaves' gradients, concatenated on the input's device, along its edge.
Tensor DataParallel::scatter(int rank, const Tensor& src, const ShardPlan& plan, bool as_leaf) {
  PhaseTimer t(*recorder_, rank, Phase::Scatter);
  backend::CopyFences::Scope fenced(*fences_);  // the batch predates the step (Note [Copy fences])
  Tensor shard = src.narrow(0, plan.offsets[rank], plan.sizes[rank]).to(devices_[rank]);
  if (as_leaf) {
    if (shard.storage() == src.storage()) shard = shard.clone();  // the leaf owns its storage
    shard.set_requires_grad(true);
  }
  return shard;
}

// A split input's rows for `rank`, or a replicated input whole on its device.
Tensor DataParallel::scatter_input(int rank, const DataParallelInput& in, const ShardPlan& plan, bool as_leaf) {
  if (!in.replicated) return scatter(rank, in.tensor, plan, as_leaf);
  PhaseTimer t(*recorder_, rank, Phase::Scatter);
  backend::CopyFences::Scope fenced(*fences_);  // Note [Copy fences]
  Tensor copy = in.tensor.to(devices_[rank]);
  if (as_leaf) {
    if (copy.storage() == in.tensor.storage()) copy = copy.clone();  // the leaf owns its storage
    copy.set_requires_grad(true);
  }
  return copy;
}

// Copies the outputs onto the output device without recording: the replicas' graphs
// stay with their workers (Note [Gather backward]).
Tensor DataParallel::gather(const std::vector<Tensor>& outs, const ShardPlan& plan) {
  PhaseTimer t(*recorder_, options_.output_device, Phase::Gather);
  NoGradGuard no_grad;
  std::vector<Tensor> moved;
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r) {
    if (plan.sizes[r] == 0) continue;
    DP_CHECK(outs[r].defined() && outs[r].dim() >= 1 && outs[r].size(0) == plan.sizes[r],
             "DataParallel: the module's output on ", devices_[r], " must keep the batch in dim 0 (",
             plan.sizes[r], " rows), got ", outs[r].str());
    moved.push_back(outs[r].detach().to(output_device()));
  }
  return moved.size() == 1 ? moved[0].clone() : cat(moved);
}

}  // namespace dp
