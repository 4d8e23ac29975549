// The design seam (Note [Designs] in src/parallel/design.h) is real: a design written
// outside the library — DDP whose optimizer steps with the SUM of the devices'
// gradients instead of their mean — is built through parallel::Design alone, trains,
// and gives its own, predictable result: N times DDP's update from the same start.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"
#include "parallel/design.h"

namespace {

using dp::parallel::Bucket;
using dp::parallel::GradSync;

// DDP's all-reduce, each rank's piece scaled by the number of ranks first: the sum
// over ranks of N * g_r is N times the batch-mean gradient DDP steps with.
class SumOfDevicesSync final : public GradSync {
 public:
  SumOfDevicesSync(std::unique_ptr<GradSync> inner, std::atomic<int>& calls)
      : inner_(std::move(inner)), calls_(calls) {}
  const char* name() const override { return "allreduce_sum"; }
  bool overlaps_backward() const override { return inner_->overlaps_backward(); }
  int world_ranks() const override { return inner_->world_ranks(); }
  void sync(int rank, const dp::Tensor& grad, std::int64_t offset) override {
    ++calls_;
    dp::NoGradGuard no_grad;
    dp::Tensor g = grad;  // a view of the rank's flat gradient buffer
    g.mul_(static_cast<float>(world_ranks()));
    inner_->sync(rank, grad, offset);
  }
  Held held(int rank, const dp::Tensor& buffer) const override { return inner_->held(rank, buffer); }
  void join(int rank) override { inner_->join(rank); }
  void begin(int rank) override { inner_->begin(rank); }
  void finish(int rank) override { inner_->finish(rank); }

 private:
  std::unique_ptr<GradSync> inner_;
  std::atomic<int>& calls_;
};

// A fourth design, through the seam only: DDP's layout and replicate policy, its
// own gradient strategy.
class SumOfDevicesDesign final : public dp::parallel::Design {
 public:
  SumOfDevicesDesign(dp::DataParallel& dp, std::atomic<int>& calls) : Design(dp), calls_(calls) {}
  const char* name() const override { return "DDP (sum of devices)"; }
  bool persistent_replicas() const override { return true; }
  std::vector<Bucket> plan_buckets() const override { return parameter_buckets(); }
  std::unique_ptr<GradSync> make_grad_sync() override {
    return std::make_unique<SumOfDevicesSync>(dp::parallel::make_all_reduce_sync(comm()), calls_);
  }

 protected:
  bool params_stale() const override { return copies_written_unequally(); }
  bool combines_grads() const override { return require_sync() && world_devices() > 1; }

 private:
  std::atomic<int>& calls_;
};

constexpr float kLr = 0.05f;
constexpr std::uint64_t kSeed = 7;

// The flat parameters after one SGD step of `model` on a fixed batch.
std::vector<float> one_step(dp::DataParallel& model) {
  dp::optim::SGD opt(model.parameters(), {.lr = kLr});
  Batch b = make_batch(12, 3);
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  return flat(model.state_dict());
}

}  // namespace

TEST_CASE("a design of its own trains through the seam and gives its own result") {
  const std::vector<int> devices = {0, 1, 2};
  const float n = static_cast<float>(devices.size());
  const dp::DataParallelOptions options{.mode = dp::Mode::DDP, .bucket_cap_mb = 1e-4, .first_bucket_mb = 1e-4};
  const std::vector<float> start = flat(make_mlp(kSeed)->state_dict());

  std::vector<float> ddp;
  {
    dp::DataParallel model(make_mlp(kSeed), devices, options);
    ddp = one_step(model);
  }
  std::atomic<int> calls{0};
  std::vector<float> summed;
  std::size_t buckets = 0;
  {
    dp::parallel::ScopedDesignFactory use(
        [&calls](dp::DataParallel& dp) { return std::make_unique<SumOfDevicesDesign>(dp, calls); });
    dp::DataParallel model(make_mlp(kSeed), devices, options);
    buckets = model.buckets().size();
    summed = one_step(model);
    model.check_replicas();  // every replica applied the same summed gradient
  }
  // Its own code path ran: one sync per bucket and device.
  CHECK(buckets > 1);
  CHECK(calls.load() == static_cast<int>(buckets * devices.size()));

  // Its update is N times DDP's, and so not DDP's.
  REQUIRE(ddp.size() == start.size());
  REQUIRE(summed.size() == start.size());
  double largest = 0, off = 0;
  for (std::size_t i = 0; i < start.size(); ++i) {
    const double d_ddp = ddp[i] - start[i], d_sum = summed[i] - start[i];
    largest = std::max(largest, std::abs(d_ddp));
    off = std::max(off, std::abs(d_sum - n * d_ddp));
  }
  REQUIRE(largest > 1e-4);  // the step moved the parameters
  CHECK(off < 1e-5);
  CHECK(max_diff(summed, ddp) > 0.5 * largest);
}

TEST_CASE("the factory scope ends with its guard") {
  std::atomic<int> calls{0};
  {
    dp::parallel::ScopedDesignFactory use(
        [&calls](dp::DataParallel& dp) { return std::make_unique<SumOfDevicesDesign>(dp, calls); });
  }
  dp::DataParallel model(make_mlp(kSeed), {0, 1}, dp::DataParallelOptions{.mode = dp::Mode::DDP});
  one_step(model);
  CHECK(calls.load() == 0);  // the options' DDP, not the scoped design
}
