// Mode::DDP: every device keeps a persistent replica with its own optimizer state;
// gradients are all-reduced in buckets while backward still runs, and every replica
// applies the same gradient (Note [Designs]).
#include "dp/comm/communicator.h"
#include "parallel/designs/designs.h"
#include "parallel/phase_timer.h"

namespace dp::parallel {

namespace {

// Note [Gradient edits]
// After a DDP backward every replica holds the same all-reduced gradient. A user who
// edits gradients through parameters() — device 0's copy — between backward() and
// step() (scaling, zeroing a layer, clipping by hand) edits copy 0 alone.
// dp::nn::utils::clip_grad_norm_ / clip_grad_value_ act on every copy, so they need
// nothing more; any other edit is caught by the grad buffers' storage versions: when
// copy 0's moved by a different amount than a replica's since the gradients were
// last synchronised, the next update of every copy — the optimizer step, or a clip or
// zero_grad before it — first broadcasts device 0's gradient buffer to every replica
// of its process (one call over the buffer, only then), so every replica applies the
// gradient the user sees; across processes the edits must be equal (Note [Refusals
// across processes] in src/parallel/data_parallel.cpp). (Only at the step, as it once was, an edit followed by clip_grad_norm_
// escaped: the clip scaled each copy's own gradient, and the versions it snapshotted
// after its update moved equally from then on — replicas drifted, silently.) A step inside no_sync() would apply unequal
// local gradients: it is refused.
// In Sharded mode every device keeps the summed gradient of its own range alone
// (stage 1 in place, zeros elsewhere; stages 2 and 3 keep no .grad at all), so what
// device 0's .grad shows is the sum on device 0's range and zeros on the others: an
// edit through it could not reach the owners of those ranges. A step after such an
// edit (the grad buffer's version moved since backward, clipping's own writes aside)
// is refused, naming the two clip functions, which act on every range.
class DDPDesign final : public Design {
 public:
  using Design::Design;
  const char* name() const override { return "DDP"; }
  bool persistent_replicas() const override { return true; }
  std::vector<Bucket> plan_buckets() const override { return parameter_buckets(); }
  std::unique_ptr<GradSync> make_grad_sync() override { return make_all_reduce_sync(comm(), grad_wire()); }

  UpdatePlan plan_update(bool step) override {
    // Note [Gradient edits]: before ANY update of every copy, not just the step — a clip
    // after an edit by hand would otherwise scale unequal gradients, and its snapshot
    // would then hide the edit from the step (the replicas drifted: the loop fuzzer).
    // Note [When replicas are refreshed]: a step reads every replica's parameters.
    return {.broadcast_grads = world_devices() > 1 && require_sync() && grads_edited_unequally(),
            .gather = false,
            .refresh_params = step && world_devices() > 1};
  }
  void run_update(int rank, const UpdatePlan& plan, bool sync_params,
                  const std::function<void()>& update) override {
    if (plan.refresh_params && sync_params) {
      PhaseTimer t(recorder(), rank, Phase::Replicate);
      params_comm().broadcast(rank, set().copy(rank).data, 0);
    }
    PhaseTimer t(recorder(), rank, Phase::Step);
    // Within the process: each process decides alone (Note [Refusals across processes]).
    if (plan.broadcast_grads) comm().local().broadcast(rank, set().copy(rank).grad, 0);
    update();
  }

 protected:
  bool params_stale() const override { return copies_written_unequally(); }
  bool combines_grads() const override { return require_sync() && world_devices() > 1; }
};

}  // namespace

std::unique_ptr<Design> make_ddp_design(DataParallel& dp) { return std::make_unique<DDPDesign>(dp); }

}  // namespace dp::parallel
