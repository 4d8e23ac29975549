// src/parallel/gather_backward.h — the backward node of DataParallel's gathered
// output (internal).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"

namespace dp::parallel {

// Note [Gather backward]
// The gathered output's grad_fn is this node. It has no edges into the replicas'
// graphs: each replica's graph was recorded by its own worker thread and is run by
// that worker. apply() splits the incoming gradient by shard and hands each piece
// to its device's worker, which runs backward on its own tape concurrently; the
// gradients are then reduced (DP) or have been all-reduced during backward (DDP).
class GatherBackward final : public autograd::Node {
 public:
  /// Returns the gradients of the node's inputs (those of DataParallel's inputs that
  /// required one), in order.
  using Run = std::function<std::vector<Tensor>(const std::vector<Tensor>& roots, const std::vector<Tensor>& pieces)>;
  GatherBackward(std::vector<Tensor> outputs, std::vector<std::int64_t> sizes, Run run)
      : outputs_(std::move(outputs)), sizes_(std::move(sizes)), run_(std::move(run)) {}
  /// Expires when the replicas' graphs can no longer be run: the node was destroyed,
  /// or a backward through it released them (Note [Forwards before a backward]).
  std::weak_ptr<const int> graph_alive() const { return graph_alive_; }
  std::string name() const override { return "DataParallelGatherBackward"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    DP_CHECK(!released_, "backward through DataParallel's output a second time: the replicas' graphs "
             "were freed by the first backward");
    std::vector<Tensor> input_grads = run_(outputs_, split(grads[0].detach(), sizes_));
    if (next_edges.empty()) return {};
    return input_grads;
  }
  void release_saved() override {
    outputs_.clear();
    graph_alive_.reset();
    released_ = true;
  }

 private:
  std::shared_ptr<const int> graph_alive_ = std::make_shared<const int>(0);
  std::vector<Tensor> outputs_;
  std::vector<std::int64_t> sizes_;
  Run run_;
};

}  // namespace dp::parallel
