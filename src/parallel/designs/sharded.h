// src/parallel/designs/sharded.h — Mode::Sharded, ZeRO stages 1-3 (internal; Note
// [Designs]). sharded.cpp: the ranges, the reduce-scatter, the step's gather and the
// hand edits; sharded_units.cpp: the gather units — stage 3's parameters gathered per
// top-level child (Note [Sharded parameters]) and stages 1-2's deferred gather (Note
// [Deferred gather]).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "dp/nn/parameter_set.h"
#include "parallel/design.h"
#include "parallel/shard_store.h"

namespace dp::parallel {

class ShardedDesign final : public Design {
 public:
  explicit ShardedDesign(DataParallel& dp);
  const char* name() const override { return "Sharded"; }
  bool persistent_replicas() const override { return true; }
  void lay_out() override;
  std::vector<Bucket> plan_buckets() const override;
  std::unique_ptr<GradSync> make_grad_sync() override;
  void release() override;
  void make_compute_copies() override;
  Tensor compute_view(int rank, std::size_t i) const override;

  void begin_step(const StepKind& kind, bool sync_params) override;
  void end_step() override;
  void run_rank(int rank, const StepKind& kind, const std::function<void()>& body) override;
  void forward_connected(std::weak_ptr<const int> graph_alive) override;
  void check_no_sync() const override;

  UpdatePlan plan_update(bool step) override;
  void check_step() override { check_grads_unedited("opt.step()"); }
  bool refuses_grad_edits() const override { return true; }
  void run_update(int rank, const UpdatePlan& plan, bool sync_params, const std::function<void()>& update) override;
  void finish_update(const UpdatePlan& plan) override;

  bool replicas_comparable() const override { return !params_sharded(); }
  std::pair<std::int64_t, std::int64_t> current_part(int rank, int unit, std::int64_t lo,
                                                     std::int64_t hi) const override;
  std::vector<std::pair<std::int64_t, std::int64_t>> shards() const override;
  int shard_stage() const override { return stage_; }
  int shard_world() const override { return store_ ? store_->shard_world() : 0; }
  std::vector<std::pair<std::int64_t, std::int64_t>> units() const override {
    return params_sharded() ? store_->units() : Runs{};
  }
  std::int64_t gather_bytes(int rank) const override;

 protected:
  bool params_stale() const override { return !params_sharded() && copies_written_unequally(); }
  bool combines_grads() const override { return sums_in_dp_order(); }
  void forget_sums() override;
  bool replicate_params(int rank, bool sync_params) override;

 private:
  // Note [Sharded parameters], Note [Forwards before a backward]: per rank.
  struct UnitState {
    struct Mark {
      std::uint64_t sequence_nr;  // the first node made under `unit`
      int unit;                   // -1: a forward starts, no unit yet
      std::uint64_t forward;      // the forward that made it (forwards_)
    };
    std::vector<Mark> marks;          // ascending sequence numbers
    int forward = -1, backward = -1;  // the unit current in each pass
  };

  bool params_sharded() const { return store_ && store_->shards_params(); }
  bool sums_in_dp_order() const;
  void note_grad_edits();
  void check_grads_unedited(const char* what);
  void check_no_stray_grads(const char* what) const;
  void gather_params(int rank);
  void refresh_compute_ranges();

  // sharded_units.cpp
  std::vector<std::pair<std::int64_t, std::int64_t>> gather_units() const;
  void shard_params();
  void defer_gathers();
  void enter_unit(int rank, int unit);
  void backward_unit(int rank, std::uint64_t sequence_nr);
  void leave_units(int rank);
  void forget_dead_forwards();
  bool deferred_gather() const { return !stale_.empty(); }
  void pull_unit(int rank, int unit);
  void pull_primary();
  void mark_stale(bool stale);

  int stage_;
  // The units, their buffers and prefetches, the process exchange (made by lay_out).
  std::unique_ptr<ShardStore> store_;
  // Stages 2 and 3: this backward's pieces carry the owners' earlier sums (Note
  // [Accumulating after a combined backward]); set before the step's workers run.
  bool carry_sums_ = false;
  // Device 0's .grad was edited by hand, noticed while the set's zero_grad_count()
  // was this (Note [Gradient edits]).
  bool grads_edited_by_hand_ = false;
  std::uint64_t edited_zero_grad_count_ = 0;
  bool updating_ = false;  // an optimizer step runs: the owners' ranges are being written
  std::vector<UnitState> unit_state_;
  // Stage 3 (Note [Forwards before a backward]): the forward running or last run, and
  // the forwards whose graphs can still be run backward, each with its node's token.
  std::uint64_t forwards_ = 0;
  std::vector<std::pair<std::uint64_t, std::weak_ptr<const int>>> live_forwards_;
  // Stages 1-2 with ShardGather::NextForward (Note [Deferred gather]):
  // stale_[r][u] when copy r's unit u may hold other owners' old values; empty otherwise.
  std::vector<std::vector<char>> stale_;
  // Per rank: parameter bytes received by the step's all-gather and pull_primary
  // (the store counts the unit gathers and pulls); each counted on its rank's thread.
  std::vector<std::int64_t> gathered_bytes_;
};

}  // namespace dp::parallel
