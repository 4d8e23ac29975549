// Mode::DP: device 0 holds the only trained parameters; the replicas are transient
// views refreshed from it before a forward, and every replica's gradient is summed
// onto device 0 in a fixed device order after backward (Note [Designs]).
#include "dp/comm/communicator.h"
#include "parallel/designs/designs.h"

namespace dp::parallel {

namespace {

class DPDesign final : public Design {
 public:
  using Design::Design;
  const char* name() const override { return "DP"; }
  bool persistent_replicas() const override { return false; }

  std::vector<Bucket> plan_buckets() const override {
    // One collective over the whole buffer, once backward is done.
    return {Bucket{0, set().numel(), 0, static_cast<int>(set().slots().size())}};
  }
  std::unique_ptr<GradSync> make_grad_sync() override { return make_reduce_to_root_sync(comm(), 0, grad_wire()); }

  // DP accumulates on device 0 anyway: no_sync() changes nothing.
  bool syncs_backward() const override { return true; }

 protected:
  bool params_stale() const override { return primary_changed(); }
  // DP's device 0s hold the same parameters in every process (Note [Across
  // processes]): its replicas are refreshed within the process.
  comm::Communicator& params_comm() const override { return comm().local(); }
  bool broadcasts_buffers() const override { return true; }
  // Across processes every process's device 0 holds the sum (Note [DP across processes]).
  bool combines_grads() const override { return processes() > 1; }
  void begin_backward(int rank) override {
    // Note [Forwards before a backward]: a DP replica's gradient is what this backward
    // alone brings; the last one's was reduced onto device 0.
    if (rank > 0) set().copy(rank).grad.zero_();
  }
};

}  // namespace

std::unique_ptr<Design> make_dp_design(DataParallel& dp) { return std::make_unique<DPDesign>(dp); }

}  // namespace dp::parallel
