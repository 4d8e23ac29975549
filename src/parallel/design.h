// src/parallel/design.h — what differs between DataParallel's designs (internal).
//
// Note [Designs]
// DataParallel runs one loop for every design: a Step (Note [Step scope]) scatters
// the batch, runs the workers, gathers the outputs and fails in one way. Everything
// that differs between DP, DDP and Sharded (ZeRO 1-3) is a Design, one file each
// under src/parallel/designs/:
//  - the layout of the parameter set at construction (transient or persistent
//    replicas, ranges, gather units and their hooks);
//  - the replicate policy: when device 0's parameters go to the replicas and over
//    which communicator, whether buffers follow (Note [When replicas are refreshed]);
//  - the gradient cycle it hands the Reducer: buckets and a GradSync strategy;
//  - what each worker does around its part of a step (a DP replica's gradient zeroed,
//    stage 3's unit marks and backward hook), and what a backward leaves combined
//    (Note [Accumulating after a combined backward]);
//  - what an update of every copy (the optimizer's step, a clip, zero_grad) needs
//    before and after (DDP's broadcast of edited gradients, Sharded's all-gather);
//  - what the accessors report (shards, stage, shard world, which replicas compare).
// DataParallel holds no branch on the mode outside option validation and
// make_design(). A design reaches DataParallel's parts (the set, the communicator,
// the recorder, the reducer) through the accessors below and keeps its own state.
//
//   class MyDesign final : public parallel::Design { ... };   // see docs/architecture.md
//   parallel::ScopedDesignFactory use([](DataParallel& dp) { return std::make_unique<MyDesign>(dp); });
//   DataParallel model(net, {0, 1});                          // trains with MyDesign
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "dp/parallel/data_parallel.h"
#include "parallel/grad_wire.h"
#include "parallel/reducer.h"

namespace dp::backend {
class CopyFences;
}

namespace dp::parallel {

/// What one step of DataParallel does (Note [Step scope]).
struct StepKind {
  bool replicate = false;  // a forward: replicas must hold device 0's parameters
  bool backward = false;   // runs backward: the reducer's cycle is armed
  bool gather = false;     // an update after which every copy is whole again (Note [Sharded step])
  bool refresh = false;    // an update that reads every copy's parameters (Note [When replicas are refreshed])
};

/// What an update of every copy needs besides the update itself (Design::plan_update).
struct UpdatePlan {
  bool broadcast_grads = false;  // device 0's gradient goes to every replica first (Note [Gradient edits])
  bool gather = false;           // the updated ranges reach every copy after (Note [Sharded step])
  bool refresh_params = false;   // DDP: device 0's parameters reach every replica first if they moved apart
};

/// One data-parallel design (Note [Designs]). Every virtual runs on the calling thread
/// unless it says "worker".
class Design {
 public:
  explicit Design(DataParallel& dp) : dp_(dp) {}
  virtual ~Design() = default;
  Design(const Design&) = delete;
  Design& operator=(const Design&) = delete;

  /// For errors and traces: "DP", "DDP", "Sharded".
  virtual const char* name() const = 0;

  // ---- construction ------------------------------------------------------------------
  /// True: every replica is a copy of the set the optimizer steps; false: transient
  /// views refreshed from device 0 before a forward (DP).
  virtual bool persistent_replicas() const = 0;
  /// After the copies exist, before the reducer: the design's layout of the set.
  virtual void lay_out() {}
  /// The reducer's buckets, in the order they become ready (Note [Gradient buckets]).
  virtual std::vector<Bucket> plan_buckets() const = 0;
  /// The reducer's strategy; an overlapping one gets the post-accumulate hooks.
  virtual std::unique_ptr<GradSync> make_grad_sync() = 0;
  /// DataParallel's destructor: undoes what lay_out() installed on the set.
  virtual void release() {}

  // ---- replicate (Note [When replicas are refreshed]) --------------------------------
  /// Decides once, before a forward or a gathering update, whether device 0's
  /// parameters must go to the replicas; the copies count as unsynced until
  /// end_replicate().
  bool begin_replicate();
  /// The copies are equal again: remember the versions they were equal at.
  void end_replicate();
  /// At construction: every device's float32 buffers into one flat tensor each, device
  /// 0's moved in place (Note [Coalesced buffers]).
  void coalesce_buffers(std::vector<std::shared_ptr<nn::Parameter::Slot>>& buffers);
  /// Worker `rank`, before its forward: what the replica needs from device 0.
  void replicate(int rank, bool sync_params);
  /// At construction, after coalesce_buffers(): every device's copies in buffer_dtype of
  /// the buffers that take it (Note [Buffers in low precision]).
  void make_compute_buffers(const std::vector<std::shared_ptr<nn::Parameter::Slot>>& buffers);
  /// Worker `rank`, right after its module's forward: what the forward wrote into its
  /// buffers in buffer_dtype reaches its float32 buffers (Note [Buffers in low precision]).
  void after_forward(int rank);

  // ---- parameters in param_dtype (Note [Parameters in low precision]) -----------------
  /// mixed_precision.param_dtype when it is a 16-bit dtype, else nullopt.
  std::optional<Dtype> param_dtype() const;
  /// At construction, after lay_out(): every copy's compute copy, filled.
  virtual void make_compute_copies();
  /// What copy `rank`'s worker reads of slots()[i] in param_dtype: by default its place
  /// in the copy's compute buffer (Note [Compute copies]).
  virtual Tensor compute_view(int rank, std::size_t i) const;

  // ---- steps (Note [Step scope]) -----------------------------------------------------
  /// Before the step's workers run, after begin_replicate().
  virtual void begin_step(const StepKind& /*kind*/, bool /*sync_params*/) {}
  /// When the step ends, failed or not.
  virtual void end_step() {}
  /// Whether a backward starts the reducer's collectives (false inside no_sync()).
  virtual bool syncs_backward() const { return dp_.require_sync_; }
  /// Worker `rank`: its part of the step, `body`, with the design's preparation.
  virtual void run_rank(int rank, const StepKind& kind, const std::function<void()>& body);
  /// A forward's gathered output got a backward node; `graph_alive` expires when the
  /// replicas' graphs can no longer be run (Note [Forwards before a backward]).
  virtual void forward_connected(std::weak_ptr<const int> /*graph_alive*/) {}
  /// no_sync() is entered: throws when the design cannot accumulate without syncing.
  virtual void check_no_sync() const {}
  /// After a backward's workers all returned: remembers whether it left the sums
  /// combined (Note [Accumulating after a combined backward]).
  void after_backward();
  /// Before a backward: a second one after a combined backward must not add the sum
  /// again (Note [Accumulating after a combined backward]).
  void forget_combined_grads();

  // ---- updates of every copy (the optimizer's executor) ------------------------------
  /// Before an update of every copy (`step`: the optimizer's step); may not throw.
  virtual UpdatePlan plan_update(bool /*step*/) { return {}; }
  /// Before an optimizer step's workers run: throws when the step must be refused.
  virtual void check_step() {}
  /// Whether the design refuses edits of device 0's gradients itself (check_step, and a
  /// backward's begin_step) rather than taking them (Note [Refusals across processes]).
  virtual bool refuses_grad_edits() const { return false; }
  /// Worker `rank`: the optimizer's update of its copy, `update`, with what the plan adds.
  virtual void run_update(int rank, const UpdatePlan& plan, bool sync_params, const std::function<void()>& update);
  /// After every worker's update returned.
  virtual void finish_update(const UpdatePlan& /*plan*/) {}
  /// The gradients' storage versions now (Note [Gradient edits]).
  void snapshot_grad_versions();
  /// Notes an edit of device 0's gradients since the last snapshot (by hand, or a
  /// backward the wrapper did not run); it stands until a zero_grad of the whole set or
  /// forget_device0_edits() (Note [Refusals across processes]).
  void note_device0_edits();
  bool device0_edited() const;
  void forget_device0_edits() { device0_edited_ = false; }
  /// Whether the next backward starts from the last one's combined sum, which it
  /// forgets on every copy but one (Note [Accumulating after a combined backward]).
  bool carries_combined_grads() const;

  // ---- what the accessors report -----------------------------------------------------
  /// check_replicas(): whether copies r > 0 are meant to equal device 0's.
  virtual bool replicas_comparable() const { return persistent_replicas(); }
  /// check_replicas(): the part [lo, hi) of a parameter in `unit` that copy `rank`
  /// holds as current.
  virtual std::pair<std::int64_t, std::int64_t> current_part(int /*rank*/, int /*unit*/, std::int64_t lo,
                                                             std::int64_t hi) const {
    return {lo, hi};
  }
  virtual std::vector<std::pair<std::int64_t, std::int64_t>> shards() const { return {}; }
  virtual int shard_stage() const { return 0; }
  virtual int shard_world() const { return 0; }
  virtual std::vector<std::pair<std::int64_t, std::int64_t>> units() const { return {}; }
  /// Stats::gather_bytes: parameter bytes copy `rank` received from the other copies'
  /// ranges since construction (Mode::Sharded's gathers; 0 in the other designs).
  virtual std::int64_t gather_bytes(int /*rank*/) const { return 0; }
  /// Whether device 0's parameters were written since the replicas last took them (a
  /// load or an in-place write through parameters(), or a failed step): the next forward
  /// or step gives them to every replica, and until then they differ.
  bool primary_ahead() const;

 protected:
  /// begin_replicate()'s decision.
  virtual bool params_stale() const = 0;
  /// Whether the backward that just ended left every copy's gradient combined.
  virtual bool combines_grads() const = 0;
  /// Forgets the combined sum on every copy but one (gradients not zeroed since).
  virtual void forget_sums();
  /// Before worker `rank`'s backward (the default run_rank).
  virtual void begin_backward(int /*rank*/) {}
  /// The communicator device 0's parameters are broadcast over, and whether buffers
  /// are broadcast before every forward.
  virtual comm::Communicator& params_comm() const { return comm(); }
  /// Worker `rank` inside replicate(): device 0's parameters to the replica when
  /// `sync_params`, and the replica's compute copy current (Note [Parameters in low
  /// precision]). Returns whether parameters moved.
  virtual bool replicate_params(int rank, bool sync_params);
  /// Copy r's compute copy cast from its float32 parameters when those were written
  /// since the last cast (or always, `force`); copy r's device's work.
  void refresh_compute(int rank, bool force);
  /// Casts elements [lo, hi) of copy `rank`'s parameters into its compute buffer (a no-op
  /// without one): what a pull wrote there (Note [Parameters in low precision]).
  void refresh_compute_range(int rank, std::int64_t lo, std::int64_t hi);
  /// The slots whose parameters compute in param_dtype (a BatchNorm's stay float32).
  std::vector<bool> computed_slots() const;
  virtual bool broadcasts_buffers() const { return dp_.options_.broadcast_buffers; }

  // What a design reads of DataParallel.
  nn::ParameterSet& set() const { return *dp_.set_; }
  comm::Communicator& comm() const { return *dp_.comm_; }
  PhaseRecorder& recorder() const { return *dp_.recorder_; }
  Reducer& reducer() const { return *dp_.reducer_; }
  backend::CopyFences& fences() const { return *dp_.fences_; }
  nn::Module& net() const { return *dp_.net_; }
  const std::vector<Device>& devices() const { return dp_.devices_; }
  const DataParallelOptions& options() const { return dp_.options_; }
  int processes() const { return dp_.processes_; }
  int process() const { return dp_.process_; }
  int world_devices() const { return dp_.world_devices(); }
  bool require_sync() const { return dp_.require_sync_; }

  /// The 16-bit buffers the gradient strategy reduces through, or null when
  /// mixed_precision.reduce_dtype keeps float32 (Note [Gradients on the wire]).
  std::shared_ptr<const GradWire> grad_wire() const;
  /// The parameters' buckets by DataParallelOptions' caps (Note [Gradient buckets]).
  std::vector<Bucket> parameter_buckets() const;
  /// DP's test: device 0's parameters changed since the copies were last equal.
  bool primary_changed() const { return primary_version() != synced_version_; }
  /// The persistent designs' test: the copies were written unequally since.
  bool copies_written_unequally() const;
  /// How far copy r's storage version moved since the last sync (replicas synced).
  std::uint64_t moved_since_sync(int r) const;
  /// The gradients were written unequally since the last snapshot.
  bool grads_edited_unequally() const;
  /// Copy r's grad storage version at the last snapshot_grad_versions().
  std::uint64_t grad_base(int r) const { return grad_base_[static_cast<std::size_t>(r)]; }
  /// The set's zero_grad_count() at the last snapshot_grad_versions().
  std::uint64_t snapshot_zero_grad_count() const { return snapshot_zero_grad_count_; }
  /// A step that takes the copies out of sync until end_replicate().
  void mark_unsynced() { synced_version_ = kUnsynced; }

  DataParallel& dp_;

 private:
  std::uint64_t primary_version() const;

  static constexpr std::uint64_t kUnsynced = ~std::uint64_t{0};
  struct ComputeBase {
    const void* storage = nullptr;  // the float32 data the compute copy was cast from
    std::uint64_t version = 0;      // its storage version then
  };
  std::vector<ComputeBase> compute_base_;      // per copy (Note [Parameters in low precision])
  bool device0_edited_ = false;                // note_device0_edits(), while the set's
  std::uint64_t device0_edited_count_ = 0;     // zero_grad_count() is this
  std::vector<Tensor> buffer_flat_;            // per device: every float32 buffer (Note [Coalesced buffers])
  // Note [Buffers in low precision]: the buffers kept in buffer_dtype and, per device,
  // each one's storage version after the last cast (the copies are in Slot::compute).
  void cast_buffers(int rank);
  std::vector<std::shared_ptr<nn::Parameter::Slot>> cast_buffers_;
  std::vector<std::vector<std::uint64_t>> cast_versions_;  // [rank][buffer]
  std::uint64_t synced_version_ = kUnsynced;  // primary version the replicas hold
  std::vector<std::uint64_t> storage_base_;    // each copy's storage version at the last sync
  std::vector<std::uint64_t> grad_base_;       // each copy's grad version after the last sync
  std::uint64_t snapshot_zero_grad_count_ = 0;  // the set's zero_grad_count() at the snapshot
  bool combined_ = false;                       // the copies hold the combined sum
  std::uint64_t combined_zero_grad_count_ = 0;  // the set's zero_grad_count() when they did
};

/// The dtype gradients travel in: reduce_dtype, else param_dtype, else float32 (FSDP's
/// defaults; Note [Gradients on the wire]).
Dtype wire_dtype(const MixedPrecision& mp);

using DesignFactory = std::function<std::unique_ptr<Design>(DataParallel& dp)>;

/// The design of dp's validated options (designs/dp.cpp, ddp.cpp, sharded.cpp), or,
/// while a ScopedDesignFactory lives on this thread, the one it makes.
std::unique_ptr<Design> make_design(DataParallel& dp);

/// While it lives, DataParallels constructed on this thread take their design from
/// `factory` (a design of one's own through the seam: tests, experiments).
class ScopedDesignFactory {
 public:
  explicit ScopedDesignFactory(DesignFactory factory);
  ~ScopedDesignFactory();
  ScopedDesignFactory(const ScopedDesignFactory&) = delete;
  ScopedDesignFactory& operator=(const ScopedDesignFactory&) = delete;

 private:
  DesignFactory previous_;
};

}  // namespace dp::parallel
