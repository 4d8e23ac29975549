// bench/shard_gather.cpp — Sharded stages 1-2: the parameter gather inside opt.step()
// (ShardGather::AfterStep) against the gather deferred to the next forward
// (ShardGather::NextForward, Note [Deferred gather]), in one run, alternating.
//
// For each model and device count, every repetition times both gathers back to back,
// in alternating order (AB, BA, AB, ...) so that a drift in the machine's load hits
// both alike. Each timed configuration is built fresh, first checked (its parameters
// after the warm-up steps bitwise equal to the other gather's), then warmed up, then
// timed. Reported per gather: the median and the minimum of ms/step over the
// repetitions, the all-gather phase (max over devices, ms/step) and the median of the
// per-repetition ratio NextForward / AfterStep (< 1: NextForward faster).
//
//   shard_gather_bench --model mlp --devices 2,4 --reps 7 --steps 20
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "common/models.h"
#include "common/util.h"
#include "dp/dp.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<std::string> models = {"mlp", "cnn"};
  std::vector<int> devices = {2, 4};
  int stage = 2;
  int reps = 7;
  int steps = 20;
  int warmup = 3;
  std::int64_t batch = 256;
  std::string path = "worker";
};

struct Timing {
  double ms_per_step = 0, all_gather_ms = 0;
  std::vector<float> params;  // after the warm-up (the check)
};

dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); }

Timing run(const Args& a, const std::string& model_name, int n, dp::ShardGather gather,
           const std::vector<dp::data::Batch>& batches) {
  auto net = samples::make_model(model_name, 1);
  dp::DataParallel model(net, samples::first_devices(n),
                         {.mode = dp::Mode::Sharded, .shard_stage = a.stage, .shard_gather = gather});
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-3});
  auto step = [&](int i) {
    const auto& b = batches[static_cast<std::size_t>(i) % batches.size()];
    opt.zero_grad();
    dp::Tensor loss;
    if (a.path == "worker") {
      loss = model.forward_backward(b.data, b.target, loss_fn);
    } else {
      loss = loss_fn(model(b.data), b.target);
      loss.backward();
    }
    opt.step();
    return loss;
  };
  Timing t;
  for (int i = 0; i < a.warmup; ++i) step(i).item();
  t.params = net->parameters().set()->copy(0).data.to_vector();
  model.reset_stats();
  dp::Tensor last;
  const auto t0 = Clock::now();
  for (int i = 0; i < a.steps; ++i) last = step(a.warmup + i);
  last.item();
  t.ms_per_step = std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / a.steps;
  for (const auto& d : model.stats().devices)
    t.all_gather_ms = std::max(t.all_gather_ms, d[dp::parallel::Phase::AllGather] / a.steps);
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Sharded stages 1-2: parameter gather after the step vs before the next forward"};
  app.add_option("--model", a.models, "mlp (784-1024-1024-10), cnn (Fashion-MNIST CNN), resnet18")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--devices", a.devices, "device counts")->delimiter(',')->capture_default_str();
  app.add_option("--stage", a.stage, "ZeRO stage (1 or 2)")->check(CLI::Range(1, 2))->capture_default_str();
  app.add_option("--reps", a.reps, "repetitions (each times both gathers)")->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps", a.steps, "timed steps per repetition")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch", a.batch, "global batch")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--path", a.path, "worker (forward_backward) or module (model(x) then backward)")
      ->check(CLI::IsMember({"worker", "module"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::printf("%-6s %3s %-12s %10s %10s %12s %14s\n", "model", "n", "gather", "median_ms", "min_ms",
              "allgather_ms", "ratio_NF/AS");
  int wrong = 0;
  for (const std::string& m : a.models) {
    const auto batches = samples::synthetic_batches(samples::example_shape(m), a.batch, 4, 7);
    for (int n : a.devices) {
      std::vector<double> ms[2], ag[2], ratio;
      for (int rep = 0; rep < a.reps; ++rep) {
        Timing t[2];
        const int first = rep % 2;  // alternate which gather runs first
        for (int k = 0; k < 2; ++k) {
          const int g = (first + k) % 2;
          t[g] = run(a, m, n, g == 0 ? dp::ShardGather::AfterStep : dp::ShardGather::NextForward, batches);
        }
        if (t[0].params != t[1].params) ++wrong;  // validate: the gathers move the same bytes
        for (int g = 0; g < 2; ++g) {
          ms[g].push_back(t[g].ms_per_step);
          ag[g].push_back(t[g].all_gather_ms);
        }
        ratio.push_back(t[1].ms_per_step / t[0].ms_per_step);
      }
      for (int g = 0; g < 2; ++g)
        std::printf("%-6s %3d %-12s %10.2f %10.2f %12.3f %14s\n", m.c_str(), n, g == 0 ? "AfterStep" : "NextForward",
                    median(ms[g]), *std::min_element(ms[g].begin(), ms[g].end()), median(ag[g]),
                    g == 1 ? std::to_string(median(ratio)).substr(0, 5).c_str() : "");
      std::fflush(stdout);
    }
  }
  std::printf("#wrong: %d (repetitions whose two gathers' parameters differ)\n", wrong);
  return wrong == 0 ? 0 : 1;
}
