// DataParallel across the processes of a job (Note [Across processes] in
// src/parallel/data_parallel.cpp), run under mpirun with 2 and 3 processes of 2 CPU
// virtual devices each (tests/dist/run_mpi.py), and as one process (a world of one).
// Every process trains the same net on its own rows of each global batch; each
// process also trains a plain single-device net on the whole global batch itself —
// the reference every design must match to float rounding. Within one topology the
// designs must agree bit for bit with each other and from run to run, and every
// process must end with the same parameters (so saving on rank 0 alone is safe).
// `dp_mpi_test --fault=MODE` runs one failure scenario instead: the last process
// throws inside a worker or is killed mid-step, and the whole job must end, non-zero,
// in seconds.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../parallel/mlp_fixture.h"
#include "dp/dp.h"

namespace dist = dp::dist;
using dp::Tensor;

namespace {

constexpr int kLocal = 2;  // devices per process
constexpr int kSteps = 10;
constexpr std::uint64_t kSeed = 1234;

std::vector<dp::Device> local_devices(int n = kLocal) {
  std::vector<dp::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(dp::cpu(i));
  return d;
}

/// Rows of global batch `step`: varies, and never divides evenly by the devices.
std::int64_t global_rows(int step) { return 4 * dist::world_size() * kLocal + 3 + step % 3; }

/// This process's rows of a batch of `rows`: torch.chunk-like, so processes differ.
std::pair<std::int64_t, std::int64_t> my_rows(std::int64_t rows) {
  const int p = dist::world_size(), r = dist::rank();
  const std::int64_t base = rows / p, extra = rows % p;
  const std::int64_t lo = r * base + std::min<std::int64_t>(r, extra);
  return {lo, base + (r < extra ? 1 : 0)};
}

std::vector<float> flat(const dp::nn::StateDict& sd) {
  std::vector<float> out;
  for (auto& [name, t] : sd) {
    if (t.dtype() != dp::Dtype::Float32) continue;
    auto v = t.to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

enum class Path { ForwardBackward, Module };

struct Design {
  const char* name;
  dp::DataParallelOptions options;
};

std::vector<Design> designs() {
  // Tiny buckets: many collectives per backward, pieces cut by the shard boundaries.
  const dp::DataParallelOptions base{.bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
  std::vector<Design> out;
  dp::DataParallelOptions o = base;
  o.mode = dp::Mode::DP;
  out.push_back({"DP", o});
  o.mode = dp::Mode::DDP;
  out.push_back({"DDP", o});
  o.mode = dp::Mode::Sharded;
  o.shard_stage = 1;
  out.push_back({"Sharded stage 1", o});
  o.shard_stage = 2;
  out.push_back({"Sharded stage 2", o});
  return out;
}

struct Run {
  std::vector<float> params;
  std::vector<double> losses;  // the loss of this process's rows, per step
};

/// Trains kSteps Adam steps. `options` null: one plain device on the global batch.
/// The net starts from a seed that differs per process: DataParallel must start every
/// process from process 0's parameters.
Run train(const dp::DataParallelOptions* options, Path path, int accumulate = 1) {
  const bool wrapped = options != nullptr;
  auto net = make_mlp(wrapped ? kSeed + static_cast<std::uint64_t>(dist::rank()) : kSeed);
  std::unique_ptr<dp::DataParallel> model;
  if (wrapped) model = std::make_unique<dp::DataParallel>(net, local_devices(), *options);
  dp::optim::Adam opt(wrapped ? model->parameters() : net->parameters(), {.lr = 1e-2});
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    double loss_sum = 0;
    for (int a = 0; a < accumulate; ++a) {
      const std::int64_t rows = global_rows(s + a);
      Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s * 7 + a));
      if (!wrapped) {
        Tensor loss = loss_fn(net->forward(b.x), b.y);
        loss.backward();
        loss_sum += loss.item();
        continue;
      }
      const auto [lo, n] = my_rows(rows);
      Tensor x = b.x.narrow(0, lo, n), y = b.y.narrow(0, lo, n);
      // Accumulation: every backward but the last under no_sync (DP has nothing to skip).
      const bool skip = a + 1 < accumulate && options->mode == dp::Mode::DDP;
      std::optional<dp::DataParallel::NoSyncGuard> guard;
      if (skip) guard.emplace(*model);
      Tensor loss;
      if (path == Path::Module) {
        loss = loss_fn((*model)(x), y);
        loss.backward();
      } else {
        loss = model->forward_backward(x, y, loss_fn);
      }
      loss_sum += loss.item();
    }
    run.losses.push_back(loss_sum);
    opt.step();
  }
  run.params = flat(net->state_dict());
  return run;
}

/// True when every process holds bitwise the same values as process 0.
bool same_everywhere(const std::vector<float>& v) {
  const std::vector<float> root = dist::broadcast_object(v, 0);
  const std::int64_t differs = (root.size() != v.size() || std::memcmp(root.data(), v.data(), v.size() * 4) != 0) ? 1 : 0;
  return dist::all_reduce(differs, dist::Op::Max) == 0;
}

}  // namespace

TEST_CASE("the job spans every process: world_devices, processes, the shards over every device") {
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::Sharded, .shard_stage = 1});
  CHECK(model.processes() == dist::world_size());
  CHECK(model.world_devices() == dist::world_size() * kLocal);
  // This process's devices own world ranges first_rank .. first_rank + kLocal - 1.
  const auto shards = model.shards();
  REQUIRE(shards.size() == static_cast<std::size_t>(kLocal));
  const std::int64_t len = shards[0].second - shards[0].first;
  for (int i = 0; i < kLocal; ++i) {
    const std::int64_t w = dist::rank() * kLocal + i;
    CHECK(shards[static_cast<std::size_t>(i)].first == len * w);
    CHECK(shards[static_cast<std::size_t>(i)].second == len * (w + 1));
  }
  CHECK(len * model.world_devices() >= net->parameter_set()->numel());
}

TEST_CASE("every process starts from process 0's parameters") {
  auto net = make_mlp(kSeed + static_cast<std::uint64_t>(dist::rank()));
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::DDP});
  const std::vector<float> p = flat(net->state_dict());
  CHECK(same_everywhere(p));
  CHECK(max_diff(p, flat(make_mlp(kSeed)->state_dict())) == 0.0);
}

TEST_CASE("DP, DDP and Sharded across processes match one device on the global batch") {
  const Run ref = train(nullptr, Path::ForwardBackward);
  for (Path path : {Path::ForwardBackward, Path::Module}) {
    std::vector<float> first;
    for (const Design& d : designs()) {
      CAPTURE(d.name);
      CAPTURE(path == Path::Module ? "model(x) + backward" : "forward_backward");
      const Run run = train(&d.options, path);
      // Sums group by process here, by device in the reference: float rounding only.
      CHECK(max_diff(run.params, ref.params) < 2e-5);
      // Every process holds the same parameters: rank 0 may save them alone.
      CHECK(same_everywhere(run.params));
      // The designs sum in the same order (devices of a process, then processes).
      if (first.empty()) first = run.params;
      CHECK(max_diff(run.params, first) == 0.0);
      // The loss each process reports is its own rows' mean; weighted by rows they
      // make the global batch's mean.
      for (int s = 0; s < kSteps; ++s) {
        const std::int64_t rows = global_rows(s);
        const double mine = run.losses[static_cast<std::size_t>(s)] * static_cast<double>(my_rows(rows).second);
        const double global = dist::all_reduce(mine, dist::Op::Sum) / static_cast<double>(rows);
        CHECK(std::abs(global - ref.losses[static_cast<std::size_t>(s)]) < 1e-4);
      }
    }
  }
}

TEST_CASE("a run across processes is bitwise reproducible") {
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    const Run a = train(&d.options, Path::ForwardBackward);
    const Run b = train(&d.options, Path::ForwardBackward);
    CHECK(max_diff(a.params, b.params) == 0.0);
  }
}

TEST_CASE("gradient accumulation with no_sync across processes") {
  const Run ref = train(nullptr, Path::ForwardBackward, /*accumulate=*/2);
  for (const Design& d : designs()) {
    if (d.options.mode == dp::Mode::Sharded) continue;  // stage 2 accumulates without no_sync; covered above
    CAPTURE(d.name);
    const Run run = train(&d.options, Path::ForwardBackward, 2);
    CHECK(max_diff(run.params, ref.params) < 2e-5);
    CHECK(same_everywhere(run.params));
  }
}

namespace {

/// Steps [first, last) of the global batches on `model`: across processes each passes
/// its own rows; a model within one process (processes() == 1) takes every row.
void steps(dp::DataParallel& model, dp::optim::Optimizer& opt, int first, int last) {
  for (int s = first; s < last; ++s) {
    const std::int64_t rows = global_rows(s);
    Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s * 7));
    const auto [lo, n] = model.processes() > 1 ? my_rows(rows) : std::pair<std::int64_t, std::int64_t>{0, rows};
    opt.zero_grad();
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    opt.step();
  }
}

std::string checkpoint_path(const char* what) {
  // One file per job: process 0's pid names it, and every process learns it.
  const std::string mine = dp::detail::str_cat("/tmp/dp_mpi_test_", ::getpid(), "_", what, ".ckpt");
  return dist::broadcast_object(mine, 0);
}

}  // namespace

TEST_CASE("a training checkpoint resumes on another topology: P x 2 devices <-> 1 x 2P") {
  if (!dist::is_distributed()) return;
  const int world = dist::world_size() * kLocal;
  const dp::DataParallelOptions ddp{.mode = dp::Mode::DDP};
  dp::DataParallelOptions alone = ddp;
  alone.span_processes = false;
  // The run without a break, across processes.
  std::vector<float> straight;
  {
    auto net = make_mlp(kSeed);
    dp::DataParallel model(net, local_devices(), ddp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    steps(model, opt, 0, kSteps);
    straight = flat(net->state_dict());
  }
  const int half = kSteps / 2;
  SUBCASE("P processes save, one process of 2P devices resumes") {
    const std::string path = checkpoint_path("across");
    auto net = make_mlp(kSeed);
    dp::DataParallel model(net, local_devices(), ddp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    steps(model, opt, 0, half);
    if (dist::is_main()) dp::save_training_checkpoint(path, *net, opt, {.step = half});
    dist::barrier();
    if (dist::is_main()) {
      auto fresh = make_mlp(kSeed + 99);
      dp::DataParallel single(fresh, local_devices(world), alone);
      CHECK(single.processes() == 1);
      dp::optim::Adam opt2(single.parameters(), {.lr = 1e-2});
      dp::TrainingState st;
      dp::load_training_checkpoint(path, *fresh, opt2, st);
      CHECK(st.step == half);
      steps(single, opt2, half, kSteps);
      CHECK(max_diff(flat(fresh->state_dict()), straight) < 2e-5);
      std::remove(path.c_str());
    }
    dist::barrier();
  }
  SUBCASE("one process of 2P devices saves, P processes resume") {
    const std::string path = checkpoint_path("alone");
    if (dist::is_main()) {
      auto net = make_mlp(kSeed);
      dp::DataParallel single(net, local_devices(world), alone);
      dp::optim::Adam opt(single.parameters(), {.lr = 1e-2});
      steps(single, opt, 0, half);
      dp::save_training_checkpoint(path, *net, opt, {.step = half});
    }
    dist::barrier();
    auto fresh = make_mlp(kSeed + 7);
    dp::DataParallel model(fresh, local_devices(), ddp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    dp::TrainingState st;
    dp::load_training_checkpoint(path, *fresh, opt, st);
    CHECK(st.step == half);
    steps(model, opt, half, kSteps);
    const std::vector<float> p = flat(fresh->state_dict());
    CHECK(max_diff(p, straight) < 2e-5);
    CHECK(same_everywhere(p));
    dist::barrier();
    if (dist::is_main()) std::remove(path.c_str());
  }
}

TEST_CASE("a different device count on one process fails on every process") {
  if (!dist::is_distributed()) return;
  auto net = make_mlp(kSeed);
  const int n = dist::rank() == dist::world_size() - 1 ? 1 : kLocal;
  std::string what;
  try {
    dp::DataParallel model(net, local_devices(n), {.mode = dp::Mode::DDP});
  } catch (const dp::Error& e) {
    what = e.what();
  }
  CHECK(what.find("same number of devices") != std::string::npos);
  INFO(what);
}

TEST_CASE("clip_grad_norm_ of a Sharded run across processes is refused clearly") {
  if (!dist::is_distributed()) return;
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::Sharded, .shard_stage = 1});
  auto params = model.parameters();
  CHECK_THROWS_WITH_AS(dp::nn::utils::clip_grad_norm_(params, 1.0), doctest::Contains("several processes"),
                       dp::Error);
  CHECK_NOTHROW(dp::nn::utils::clip_grad_value_(params, 1.0));
}

TEST_CASE("shard_stage 3 across processes is refused clearly") {
  if (!dist::is_distributed()) return;
  auto net = make_mlp(kSeed);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, local_devices(), {.mode = dp::Mode::Sharded, .shard_stage = 3}),
                       doctest::Contains("shard_stage 3 within one process only"), dp::Error);
}

// ---- failure scenarios (one per job, see run_mpi.py) --------------------------------

namespace {

/// Throws on cpu(1) of the last process once armed.
struct Bomb : dp::nn::Module {
  bool armed = false;
  Tensor forward(const Tensor& x) override {
    if (armed && dist::rank() == dist::world_size() - 1 && x.device() == dp::cpu(1))
      throw dp::Error("boom: a worker of the last process failed");
    return x;
  }
};

int run_fault(const std::string& mode) {
  auto net = make_mlp(kSeed);
  auto bomb = std::make_shared<Bomb>();
  net->push_back(bomb);
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::DDP});
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  const bool victim = dist::rank() == dist::world_size() - 1;
  for (int s = 0; s < 6; ++s) {
    if (s == 3) {
      if (mode == "throw") bomb->armed = true;
      if (mode == "kill" && victim) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the others are in the step
        std::raise(SIGKILL);
      }
    }
    const std::int64_t rows = global_rows(s);
    Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s));
    const auto [lo, n] = my_rows(rows);
    opt.zero_grad();
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    opt.step();
  }
  std::cout << "FAULT-TEST: rank " << dist::rank() << " got through the steps\n" << std::flush;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--fault=", 0) == 0) return run_fault(arg.substr(8));
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  if (dist::rank() != 0) ctx.setOption("minimal", true);
  if (dist::is_distributed()) ctx.setOption("no-colors", true);
  return ctx.run();
}
