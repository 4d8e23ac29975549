// tests/cuda/cuda_data_parallel_test.cpp — DataParallel end to end on CUDA devices.
//
// The DP/DDP/Sharded runtime is tested in depth on CPU virtual devices (tests/parallel);
// this binary checks the CUDA-specific paths on real GPUs: pinned batches from a
// DataLoader scattered straight to every device, peer copies (DP replicate and reduce),
// the NCCL communicator (DDP all-reduce; Sharded reduce per bucket piece and
// all-gather), the caching allocators' steady state, and agreement with the same run on
// CPU virtual devices. It uses every visible device (up to 8): with
// DP_CUDA_DEVICES_PER_GPU=k (meson registers a run with k = 4) one GPU carries several
// dp devices and the collectives go through the CUDA copy communicator (Note [Logical
// CUDA devices]). Without a CUDA device the binary exits 77, which Meson reports as SKIP.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "dp/dp.h"

namespace {

using dp::Tensor;

using dp_test::cuda_devices;

// A CNN with BatchNorm (buffers broadcast in DDP) and every layer kind the CUDA
// backend implements.
std::shared_ptr<dp::nn::Sequential> make_cnn(std::uint64_t seed) {
  dp::Generator gen(seed);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Conv2d>(3, 8, 3, 1, 1, true, &gen));
  net->push_back(std::make_shared<dp::nn::BatchNorm2d>(8));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::MaxPool2d>(2));
  net->push_back(std::make_shared<dp::nn::Flatten>());
  net->push_back(std::make_shared<dp::nn::Linear>(8 * 4 * 4, 10, true, &gen));
  return net;
}

Tensor loss_fn(const Tensor& out, const Tensor& y) { return dp::nn::cross_entropy(out, y); }

std::shared_ptr<dp::data::SyntheticDataset> dataset() {
  return std::make_shared<dp::data::SyntheticDataset>(
      dp::data::SyntheticOptions{.size = 600, .example_shape = {3, 8, 8}, .seed = 11});
}

std::vector<float> flat_params(dp::nn::Module& net) {
  std::vector<float> out;
  for (auto& [name, t] : net.state_dict()) {
    if (t.dtype() != dp::Dtype::Float32) continue;
    const auto v = t.to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

constexpr int kSteps = 8;
constexpr std::int64_t kBatch = 64;

// The comparisons with the CPU runs are of FP32 arithmetic: TF32, which convolutions
// may use by default (dp::allow_tf32_conv, like torch.backends.cudnn.allow_tf32),
// rounds their products to 10 mantissa bits (on an H100 the CNN below then ends 1.4e-4
// from the CPU run after kSteps). The guard sets the TF32 policy for its life, then
// restores it; Tf32Policy(false, false) is FP32 throughout.
struct Tf32Policy {
  bool matmul = dp::allow_tf32_matmul(), conv = dp::allow_tf32_conv();
  Tf32Policy(bool allow_matmul, bool allow_conv) {
    dp::set_allow_tf32_matmul(allow_matmul);
    dp::set_allow_tf32_conv(allow_conv);
  }
  ~Tf32Policy() {
    dp::set_allow_tf32_matmul(matmul);
    dp::set_allow_tf32_conv(conv);
  }
  Tf32Policy(const Tf32Policy&) = delete;
  Tf32Policy& operator=(const Tf32Policy&) = delete;
};

struct Run {
  std::vector<float> params;
  std::vector<std::vector<float>> replicas;  // DDP, Sharded 1-2: every copy's flat data
  // Sharded stage 3 keeps no replicas, each copy only its range of the flat buffer:
  // the copies whose range differs from the gathered parameters' (-1: not stage 3).
  int ranges_differing = -1;
  std::vector<std::size_t> memory_step3, memory_end;
  std::size_t pinned_before = 0, pinned_after = 0;
  bool all_pinned = true;
};

// Trains kSteps SGD-momentum steps with DataParallel over `devs` from a pinned loader.
// SGD rather than Adam: its update is continuous in the gradient, so the CPU and CUDA
// runs, whose float sums differ in order, stay within a tight tolerance.
Run train(const std::vector<dp::Device>& devs, const dp::DataParallelOptions& options, bool worker_loss) {
  Run run;
  auto net = make_cnn(3);
  dp::DataParallel model(net, devs, options);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
  dp::data::DataLoader loader(dataset(), {.batch_size = kBatch, .shuffle = true, .seed = 5,
                                          .pin_memory = true});
  run.pinned_before = dp::pinned_memory_allocated();
  int step = 0;
  for (auto& [x, y] : loader) {
    if (step == kSteps) break;
    run.all_pinned = run.all_pinned && x.is_pinned() && y.is_pinned();
    opt.zero_grad();
    if (worker_loss) {
      model.forward_backward(x, y, loss_fn);
    } else {
      loss_fn(model(x), y.to(model.output_device())).backward();
    }
    opt.step();
    if (++step == 3) {
      for (const dp::Device& d : devs) run.memory_step3.push_back(dp::memory_allocated(d));
    }
  }
  for (const dp::Device& d : devs) run.memory_end.push_back(dp::memory_allocated(d));
  run.pinned_after = dp::pinned_memory_allocated();
  run.params = flat_params(*net);
  const auto set = model.parameters().set();
  if (!model.units().empty()) {  // stage 3: the parameters are sharded
    // The flat layout is the parameters end to end, padded with zeros to the ranges.
    std::vector<float> flat;
    for (const Tensor& t : net->parameters()) {
      const auto v = t.to_vector();
      flat.insert(flat.end(), v.begin(), v.end());
    }
    run.ranges_differing = 0;
    for (int r = 0; r < set->num_copies(); ++r) {
      const auto c = dp::nn::copy_span(*set, r);
      std::vector<float> want(static_cast<std::size_t>(c.end - c.begin), 0.0f);
      for (std::int64_t i = c.begin; i < std::min<std::int64_t>(c.end, static_cast<std::int64_t>(flat.size())); ++i)
        want[static_cast<std::size_t>(i - c.begin)] = flat[static_cast<std::size_t>(i)];
      run.ranges_differing += c.data.to_vector() != want;
    }
  } else if (options.mode != dp::Mode::DP) {
    for (int r = 0; r < set->num_copies(); ++r) run.replicas.push_back(set->copy(r).data.to_vector());
  }
  return run;
}

}  // namespace

TEST_CASE("DP, DDP and Sharded on every GPU match the same run on CPU virtual devices") {
  // The oracle is the CPU runtime with as many virtual devices: BatchNorm normalises
  // each device's shard, so the comparison needs the same shards, not one device.
  const auto gpus = cuda_devices();
  const std::vector<dp::Device> cpus = dp_test::cpu_devices(gpus.size());
  Tf32Policy fp32(false, false);
  const dp::DataParallelOptions modes[] = {{.mode = dp::Mode::DP},
                                           {.mode = dp::Mode::DDP},
                                           {.mode = dp::Mode::Sharded, .shard_stage = 1},
                                           {.mode = dp::Mode::Sharded, .shard_stage = 2},
                                           {.mode = dp::Mode::Sharded, .shard_stage = 3}};
  for (const auto& options : modes) {
    for (bool worker_loss : {false, true}) {
      CAPTURE(dp::mode_name(options.mode));
      CAPTURE(options.shard_stage.value_or(0));
      CAPTURE(worker_loss);
      const Run ref = train(cpus, options, worker_loss);
      const Run got = train(gpus, options, worker_loss);
      CHECK(got.all_pinned);
      CHECK(max_diff(got.params, ref.params) < 1e-4);
      // Steady state: after step 3 no device holds more memory (no per-step leak).
      for (std::size_t r = 0; r < gpus.size(); ++r) {
        CAPTURE(r);
        CHECK(got.memory_end[r] == got.memory_step3[r]);
      }
      // DDP replicas apply the same all-reduced gradient, Sharded replicas gather the
      // same ranges: bitwise equal to device 0. Stage 3 keeps ranges, not replicas:
      // each is bitwise the gathered parameters' slice.
      for (std::size_t r = 1; r < got.replicas.size(); ++r) {
        CAPTURE(r);
        CHECK(max_diff(got.replicas[r], got.replicas[0]) == 0.0);
      }
      const bool ranges = options.shard_stage == 3 && gpus.size() > 1;
      CHECK(got.ranges_differing == (ranges ? 0 : -1));
      CHECK(got.replicas.size() == (ranges || options.mode == dp::Mode::DP ? 0 : gpus.size()));
      // Every pinned batch was handed back (blocks a copy still reads wait in the cache).
      CHECK(got.pinned_after == got.pinned_before);
    }
  }
}

// Sharded stages 2-3 free each parameter's gradient on the host as soon as its
// pieces are handed to the collectives (Note [Detached gradients]); with 16-bit
// gradients on the wire the owner's sum comes back on the collectives' stream after
// that. A deep MLP of equal layers makes the backward allocate the next gradient of
// the same size at once, on the compute stream: had the sum landed in the freed
// gradient, the two streams would race over that block, and the owner's range would
// take another tensor's values, differently from run to run.
std::vector<float> train_equal_layers(const std::vector<dp::Device>& devs, const dp::DataParallelOptions& options) {
  dp::Generator gen(21);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Flatten>());
  net->push_back(std::make_shared<dp::nn::Linear>(3 * 8 * 8, 256, true, &gen));
  for (int i = 0; i < 8; ++i) {
    net->push_back(std::make_shared<dp::nn::ReLU>());
    net->push_back(std::make_shared<dp::nn::Linear>(256, 256, true, &gen));
  }
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(256, 10, true, &gen));
  dp::DataParallel model(net, devs, options);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
  dp::data::DataLoader loader(dataset(), {.batch_size = kBatch, .shuffle = true, .seed = 5});
  int step = 0;
  for (auto& [x, y] : loader) {
    if (step++ == 4) break;
    opt.zero_grad();
    model.forward_backward(x, y, loss_fn);
    opt.step();
  }
  return flat_params(*net);
}

TEST_CASE("Sharded 2 and 3 with bfloat16 gradients on the wire: each owner's sum lands whole, as DDP's") {
  const auto gpus = cuda_devices();
  if (gpus.size() < 2) {
    MESSAGE("one dp device: no collective (DP_CUDA_DEVICES_PER_GPU=4 runs it on one GPU)");
    return;
  }
  const std::vector<dp::Device> cpus = dp_test::cpu_devices(gpus.size());
  Tf32Policy fp32(false, false);
  // Buckets of one or two 256x256 weights: a collective per layer, in flight while the
  // backward goes on.
  dp::DataParallelOptions ddp{.mode = dp::Mode::DDP, .bucket_cap_mb = 0.3, .first_bucket_mb = 0.3};
  ddp.mixed_precision.reduce_dtype = dp::Dtype::BFloat16;
  const std::vector<float> want = train_equal_layers(gpus, ddp);
  // On one GPU shared by several dp devices the copy communicator adds in rank order
  // and rounds once in every collective, as the CPU's local communicator does, so the
  // designs agree bitwise; NCCL's reduce and all-reduce may add in different orders.
  const char* k = std::getenv("DP_CUDA_DEVICES_PER_GPU");
  const bool shared = k != nullptr && std::atoi(k) > 1;
  for (int stage : {2, 3}) {
    CAPTURE(stage);
    dp::DataParallelOptions sharded = ddp;
    sharded.mode = dp::Mode::Sharded;
    sharded.shard_stage = stage;
    const std::vector<float> got = train_equal_layers(gpus, sharded);
    const std::vector<float> again = train_equal_layers(gpus, sharded);
    const std::vector<float> cpu = train_equal_layers(cpus, sharded);
    CHECK(max_diff(got, cpu) < 1e-2);  // bf16's resolution over four steps; a lost sum is far outside
    if (shared) {
      CHECK(max_diff(got, again) == 0.0);  // run to run
      CHECK(max_diff(got, want) == 0.0);   // and DDP's bits
    } else {
      // NCCL picks its algorithm and order from the topology and the sizes, so the same
      // run twice in one process gives the same bits; a raced sum (one gradient of a
      // layer swapped for another's) moves the parameters by far less than bf16's
      // tolerance to the CPU run, so only this comparison would show it.
      CHECK(max_diff(got, again) == 0.0);
      CHECK(max_diff(got, want) < 1e-2);
    }
  }
}

TEST_CASE("with TF32 convolutions (the default) DDP ends near the FP32 run") {
  // TF32's unit roundoff is 2^-11 (FP32's 2^-24): a few steps of SGD end within a
  // few 1e-4 of the FP32 oracle, far inside 5e-3; a wrong algorithm or a math mode
  // applied to the wrong tensor would not.
  const auto gpus = cuda_devices();
  const std::vector<dp::Device> cpus = dp_test::cpu_devices(gpus.size());
  const dp::DataParallelOptions ddp{.mode = dp::Mode::DDP};
  const Run ref = train(cpus, ddp, false);
  const Tf32Policy tf32(/*allow_matmul=*/false, /*allow_conv=*/true);  // PyTorch's defaults
  const Run got = train(gpus, ddp, false);
  CHECK(max_diff(got.params, ref.params) < 5e-3);
}

TEST_CASE("a batch on the CPU and one already on device 0 train the same") {
  const auto devs = cuda_devices();
  auto run = [&](bool on_device) {
    auto net = make_cnn(9);
    dp::DataParallel model(net, devs, {.mode = dp::Mode::DDP});
    dp::optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
    dp::Generator gen(4);
    for (int s = 0; s < 4; ++s) {
      Tensor x = dp::randn({kBatch, 3, 8, 8}, gen, dp::cpu(0));
      std::vector<std::int64_t> labels(static_cast<std::size_t>(kBatch));
      for (std::int64_t i = 0; i < kBatch; ++i) labels[static_cast<std::size_t>(i)] = (i * 3 + s) % 10;
      Tensor y = dp::from_vector(labels, {kBatch});
      if (on_device) {
        x = x.to(devs[0]);
        y = y.to(devs[0]);
      }
      opt.zero_grad();
      model.forward_backward(x, y, loss_fn);
      opt.step();
    }
    return flat_params(*net);
  };
  CHECK(max_diff(run(false), run(true)) == 0.0);
}

namespace {
// Its workers on devices other than device 0 sleep before their forward reads a
// parameter, so that device 0 has enqueued its whole forward, backward and the wait
// for its collectives before any other device copies a parameter range from it.
struct LateStarter : dp::nn::Module {
  LateStarter() {
    dp::Generator gen(21);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(3 * 8 * 8, 32, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(32, 10, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    if (late && x.device() != first) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return fc2->forward(dp::relu(fc1->forward(x.reshape({x.size(0), 3 * 8 * 8}))));
  }
  bool late = false;
  dp::Device first = dp::cuda(0);
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};
}  // namespace

// Note [Copy fences]: a worker that copies from device 0 (a batch on device 0, a
// stage 3 unit, a deferred gather's pull) once device 0's stream already waits for a
// collective that needs that worker must not order its copy after that wait — on
// NCCL that was a hang until the watchdog's timeout. Here device 0 always finishes
// enqueueing its step first; a hang fails the step after collective_timeout.
TEST_CASE("a worker that starts late never deadlocks a step on device 0's collectives") {
  const auto devs = cuda_devices();
  if (devs.size() < 2) return;  // nothing to copy between
  std::vector<dp::Device> cpus;
  for (std::size_t i = 0; i < devs.size(); ++i) cpus.push_back(dp::cpu(static_cast<int>(i)));
  const dp::DataParallelOptions modes[] = {
      {.mode = dp::Mode::DDP},
      {.mode = dp::Mode::Sharded, .shard_stage = 1},
      {.mode = dp::Mode::Sharded, .shard_stage = 1, .shard_gather = dp::ShardGather::NextForward},
      {.mode = dp::Mode::Sharded, .shard_stage = 3}};
  for (dp::DataParallelOptions options : modes) {
    CAPTURE(dp::mode_name(options.mode));
    CAPTURE(options.shard_stage.value_or(0));
    options.bucket_cap_mb = 0.004;  // several buckets: comm threads, deferred collectives
    options.first_bucket_mb = 0.001;
    options.collective_timeout = std::chrono::seconds(20);
    auto run = [&](const std::vector<dp::Device>& on, bool late) {
      auto net = std::make_shared<LateStarter>();
      net->first = on[0];
      dp::DataParallel model(net, on, options);
      net->late = late;
      dp::optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
      dp::Generator gen(6);
      for (int s = 0; s < 3; ++s) {
        Tensor x = dp::randn({kBatch, 3, 8, 8}, gen, dp::cpu(0)).to(on[0]);
        std::vector<std::int64_t> labels(static_cast<std::size_t>(kBatch));
        for (std::int64_t i = 0; i < kBatch; ++i) labels[static_cast<std::size_t>(i)] = (i * 7 + s) % 10;
        Tensor y = dp::from_vector(labels, {kBatch}).to(on[0]);
        opt.zero_grad();
        if (s % 2 == 0) {
          model.forward_backward(x, y, loss_fn);
        } else {
          loss_fn(model(x), y).backward();
        }
        opt.step();
      }
      return flat_params(*net);
    };
    const std::vector<float> ref = run(cpus, false);
    std::vector<float> got;
    REQUIRE_NOTHROW(got = run(devs, true));
    CHECK(max_diff(got, ref) < 1e-4);
  }
}

// Note [Collective timing]: the reducer's hidden time is the collectives' device time
// (NCCL: events on the comm stream) less the compute stream's wait for them at join().
// If every bucket's collective started only after the last backward kernel, the compute
// stream would wait for all of them and nothing would be hidden: hidden > 0 on the
// device timeline proves that some bucket's all-reduce ran while backward still did.
// DDP's all-reduce and Sharded's reduce-scatter (deferred, its delivery and zeroing
// after it on the comm stream: Note [Deferred reduce-scatter]) both leave the compute
// stream running until join.
TEST_CASE("DDP's all-reduce and Sharded's reduce-scatter overlap backward on the device timeline") {
  const auto devs = cuda_devices();
  if (devs.size() < 2) return;
  const std::vector<dp::DataParallelOptions> configs = {
      {.mode = dp::Mode::DDP, .bucket_cap_mb = 4.0},
      {.mode = dp::Mode::Sharded, .shard_stage = 1, .bucket_cap_mb = 4.0},
      {.mode = dp::Mode::Sharded, .shard_stage = 2, .bucket_cap_mb = 4.0}};
  for (const dp::DataParallelOptions& options : configs) {
    CAPTURE(static_cast<int>(options.mode));
    CAPTURE(options.shard_stage.value_or(0));
    dp::Generator gen(5);
    auto net = std::make_shared<dp::nn::Sequential>();
    net->push_back(std::make_shared<dp::nn::Linear>(512, 2048, true, &gen));
    for (int i = 0; i < 6; ++i) {  // 6 x 16 MiB of gradients: many 4 MiB buckets
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Linear>(2048, 2048, true, &gen));
    }
    net->push_back(std::make_shared<dp::nn::ReLU>());
    net->push_back(std::make_shared<dp::nn::Linear>(2048, 10, true, &gen));
    dp::DataParallel model(net, devs, options);
    REQUIRE(model.buckets().size() >= 4);
    dp::optim::SGD opt(model.parameters(), {.lr = 1e-3});
    const std::int64_t rows = 256 * static_cast<std::int64_t>(devs.size());
    Tensor x = dp::randn({rows, 512}, gen, devs[0]);
    std::vector<std::int64_t> labels(static_cast<std::size_t>(rows));
    for (std::int64_t i = 0; i < rows; ++i) labels[static_cast<std::size_t>(i)] = i % 10;
    Tensor y = dp::from_vector(labels, {rows}, devs[0]);
    auto step = [&] {
      opt.zero_grad();
      model.forward_backward(x, y, [](const Tensor& o, const Tensor& t) { return dp::nn::cross_entropy(o, t); });
      opt.step();
    };
    for (int i = 0; i < 3; ++i) step();
    for (const auto& d : devs) dp::backend::get(d).synchronize(d);
    model.reset_stats();
    for (int i = 0; i < 10; ++i) step();
    for (const auto& d : devs) dp::backend::get(d).synchronize(d);
    step();  // device times are read one step late, without waiting
    const dp::parallel::Stats st = model.stats();
    const bool device_timed = model.communicator().times_on_device();
    INFO("communicator: " << model.communicator().backend_name() << (device_timed ? " (device-timed)" : " (host-timed)"));
    for (const auto& d : st.devices) {
      CAPTURE(d.device);
      CHECK(d[dp::parallel::Phase::Backward] > 0.0);
      CHECK(d[dp::parallel::Phase::AllReduceHidden] > 0.0);
      if (device_timed) {
        // Most of the collective time is hidden: the exposed tail is less than the hidden part.
        CHECK(d[dp::parallel::Phase::AllReduceExposed] < d[dp::parallel::Phase::AllReduceHidden]);
      }
    }
  }
}

TEST_CASE("pin_memory of a device tensor is a dp::Error naming the device") {
  Tensor on_gpu = dp::zeros({4}, dp::cuda(0));
  CHECK_THROWS_WITH_AS(on_gpu.pin_memory(), doctest::Contains("cuda:0"), dp::Error);
  CHECK_FALSE(dp::zeros({4}).is_pinned());
  CHECK(dp::zeros({4}).pin_memory().is_pinned());
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_data_parallel_test", argc, argv); }
