// The fixed cost of a training step: PyTorch's ToyModel (Linear 10->10, ReLU, Linear
// 10->5; batch 20; MSE; SGD) is so small that its step time is almost all runtime
// overhead — thread hand-overs, collectives, bookkeeping. Timed: the unwrapped module
// on one device, then DataParallel in DP and DDP mode on 1, 2 and 4 devices, through
// both paths (model(x) + loss.backward() on the caller, and forward_backward with the
// loss on the workers). Each configuration is validated (the loss falls), warmed up,
// then timed in rounds; the median round is reported.
//
//   overhead                      # aligned table
//   overhead --json               # one JSON object per configuration
//   overhead --steps 2000 --rounds 7 --devices 1,2
//
// Figures: us/step = median round time / steps; steps/s = 1e6 / us/step; "vs unwrapped"
// = us/step / the unwrapped us/step of the same run; hand-overs/step = tasks handed to
// worker and comm threads per step (DataParallel::stats().handoffs), the number of
// thread wake-ups a step costs at most.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "dp/dp.h"

namespace {

constexpr const char* kUsage =
    "usage: overhead [--steps N] [--rounds R] [--warmup W] [--devices 1,2,4] [--json]\n";

struct Options {
  int steps = 1000;
  int rounds = 5;
  int warmup = 200;
  std::vector<int> devices = {1, 2, 4};
  bool json = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: missing value\n%s", a.c_str(), kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--rounds") o.rounds = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--json") o.json = true;
    else if (a == "--devices") {
      o.devices.clear();
      std::stringstream ss(next());
      for (std::string tok; std::getline(ss, tok, ',');) o.devices.push_back(std::stoi(tok));
    } else {
      std::fprintf(stderr, "unknown option %s\n%s", a.c_str(), kUsage);
      std::exit(a == "--help" ? 0 : 2);
    }
  }
  if (o.steps < 1 || o.rounds < 1 || o.warmup < 0 || o.devices.empty()) {
    std::fprintf(stderr, "expected --steps >= 1, --rounds >= 1, --warmup >= 0 and devices\n%s", kUsage);
    std::exit(2);
  }
  return o;
}

std::shared_ptr<dp::nn::Sequential> toy_model() {
  dp::Generator gen(0);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(10, 10, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(10, 5, true, &gen));
  return net;
}

struct Result {
  std::string name;
  int devices = 0;
  double us_per_step = 0;
  double handoffs_per_step = 0;
  double first_loss = 0, last_loss = 0;
};

// Times `step` (which returns the loss) and validates that training makes progress.
Result time_steps(const Options& o, const std::function<dp::Tensor()>& step,
                  const std::function<std::int64_t()>& handoffs) {
  Result r;
  r.first_loss = step().item();
  for (int i = 0; i < o.warmup; ++i) step();
  std::vector<double> rounds;
  std::int64_t h0 = handoffs();
  dp::Tensor loss;
  for (int k = 0; k < o.rounds; ++k) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.steps; ++i) loss = step();
    auto t1 = std::chrono::steady_clock::now();
    rounds.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / o.steps);
  }
  r.last_loss = loss.item();
  r.handoffs_per_step = static_cast<double>(handoffs() - h0) / (static_cast<double>(o.steps) * o.rounds);
  std::sort(rounds.begin(), rounds.end());
  r.us_per_step = rounds[rounds.size() / 2];
  return r;
}

Result run_unwrapped(const Options& o, const dp::Tensor& x, const dp::Tensor& y) {
  auto net = toy_model();
  dp::optim::SGD opt(net->parameters(), {.lr = 1e-3});
  Result r = time_steps(
      o,
      [&] {
        opt.zero_grad();
        dp::Tensor loss = dp::nn::mse_loss(net->forward(x), y);
        loss.backward();
        opt.step();
        return loss;
      },
      [] { return std::int64_t{0}; });
  r.name = "unwrapped";
  r.devices = 1;
  return r;
}

Result run_wrapped(const Options& o, dp::Mode mode, int n, bool worker_loss, const dp::Tensor& x,
                   const dp::Tensor& y) {
  auto net = toy_model();
  std::vector<dp::Device> devs;
  for (int i = 0; i < n; ++i) devs.push_back(dp::cpu(i));
  dp::DataParallel model(net, devs, {.mode = mode});
  dp::optim::SGD opt(model.parameters(), {.lr = 1e-3});
  auto loss_fn = [](const dp::Tensor& out, const dp::Tensor& t) { return dp::nn::mse_loss(out, t); };
  Result r = time_steps(
      o,
      [&] {
        opt.zero_grad();
        dp::Tensor loss;
        if (worker_loss) {
          loss = model.forward_backward(x, y, loss_fn);
        } else {
          loss = loss_fn(model(x), y);
          loss.backward();
        }
        opt.step();
        return loss;
      },
      [&] { return model.stats().handoffs; });
  r.name = std::string(mode == dp::Mode::DP ? "DP" : "DDP") + (worker_loss ? " forward_backward" : " model(x)");
  r.devices = n;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  int max_devices = *std::max_element(o.devices.begin(), o.devices.end());
  if (max_devices > dp::device_count(dp::DeviceType::CPU)) {
    std::fprintf(stderr, "overhead: %d CPU virtual devices requested, %d exist (set DP_CPU_DEVICES)\n",
                 max_devices, dp::device_count(dp::DeviceType::CPU));
    return 2;
  }
  dp::Generator gen(1);
  dp::Tensor x = dp::randn({20, 10}, gen, dp::cpu(0));
  dp::Tensor y = dp::randn({20, 5}, gen, dp::cpu(0));

  std::vector<Result> results = {run_unwrapped(o, x, y)};
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP})
    for (bool worker_loss : {false, true})
      for (int n : o.devices) results.push_back(run_wrapped(o, mode, n, worker_loss, x, y));

  const double base = results[0].us_per_step;
  int bad = 0;
  if (!o.json) {
    std::printf("%-22s %7s %10s %10s %12s %16s\n", "configuration", "devices", "us/step", "steps/s",
                "vs unwrapped", "hand-overs/step");
  }
  for (const Result& r : results) {
    bool learned = r.last_loss < r.first_loss;  // validation: the same SGD run makes progress
    bad += learned ? 0 : 1;
    if (o.json) {
      std::printf("{\"configuration\": \"%s\", \"devices\": %d, \"us_per_step\": %.3f, \"steps_per_s\": %.1f, "
                  "\"vs_unwrapped\": %.3f, \"handoffs_per_step\": %.2f, \"loss_first\": %.6f, "
                  "\"loss_last\": %.6f}\n",
                  r.name.c_str(), r.devices, r.us_per_step, 1e6 / r.us_per_step, r.us_per_step / base,
                  r.handoffs_per_step, r.first_loss, r.last_loss);
    } else {
      std::printf("%-22s %7d %10.1f %10.0f %11.2fx %16.2f%s\n", r.name.c_str(), r.devices, r.us_per_step,
                  1e6 / r.us_per_step, r.us_per_step / base, r.handoffs_per_step,
                  learned ? "" : "  (loss did not fall!)");
    }
  }
  return bad ? 1 : 0;
}
