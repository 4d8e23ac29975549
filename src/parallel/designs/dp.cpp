// Mode::DP: device 0 holds the only trained parameters; the replicas are transient
// views refreshed from it before a forward, and every replica's gradient is summed
// onto device 0 in a fixed device order after backward (Note [Designs]).
#include <utility>
#include <vector>

#include "dp/autograd/grad_mode.h"
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
  // Note [Parameters in low precision]: device 0 casts, the replicas receive its
  // compute copy (half the bytes of the float32 parameters) and, packed in one float32
  // buffer, the parameters that keep float32 (a BatchNorm's); their float32 data is
  // then never read.
  void make_compute_copies() override {
    Design::make_compute_copies();
    if (!param_dtype().has_value()) return;
    const std::vector<bool> computed = computed_slots();
    const auto& slots = set().slots();
    std::int64_t numel = 0;
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (!computed[i]) {
        kept_slots_.emplace_back(i, numel);
        numel += slots[i]->copies[0].numel();
      }
    if (kept_slots_.empty()) return;
    for (int r = 0; r < set().num_copies(); ++r) kept_.push_back(zeros({numel}, set().copy(r).device));
    for (int r = 1; r < set().num_copies(); ++r)
      for (const auto& [i, at] : kept_slots_) {
        const Shape& shape = slots[i]->copies[0].shape();
        set().set_compute_view(r, i, kept_[r].narrow(0, at, shape_numel(shape)).reshape(shape));
      }
    pack_kept();
    for (int r = 1; r < set().num_copies(); ++r) kept_[r].copy_(kept_[0].to(set().copy(r).device));
  }
  bool replicate_params(int rank, bool sync_params) override {
    if (!param_dtype().has_value()) return Design::replicate_params(rank, sync_params);
    if (rank == 0) refresh_compute(0, false);
    if (!sync_params) return false;
    params_comm().broadcast(rank, set().copy(rank).compute, 0);
    if (!kept_.empty()) {
      if (rank == 0) pack_kept();
      params_comm().broadcast(rank, kept_[static_cast<std::size_t>(rank)], 0);
    }
    return true;
  }
  bool broadcasts_buffers() const override { return true; }
  // Across processes every process's device 0 holds the sum (Note [DP across processes]).
  bool combines_grads() const override { return processes() > 1; }
  void begin_backward(int rank) override {
    // Note [Forwards before a backward]: a DP replica's gradient is what this backward
    // alone brings; the last one's was reduced onto device 0.
    if (rank > 0) set().copy(rank).grad.zero_();
  }

 private:
  // Device 0's float32 parameters that keep float32, into its packed buffer.
  void pack_kept() {
    NoGradGuard no_grad;
    const Tensor& data = set().copy(0).data;
    for (const auto& [i, at] : kept_slots_) {
      const std::int64_t n = set().slots()[i]->copies[0].numel();
      kept_[0].narrow(0, at, n).copy_(data.narrow(0, set().slots()[i]->offset, n));
    }
  }

  std::vector<std::pair<std::size_t, std::int64_t>> kept_slots_;  // (slot, offset in kept_[r])
  std::vector<Tensor> kept_;  // per device: the float32 parameters of kept_slots_, packed
};

}  // namespace

std::unique_ptr<Design> make_dp_design(DataParallel& dp) { return std::make_unique<DPDesign>(dp); }

}  // namespace dp::parallel
