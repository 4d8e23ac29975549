// The fixed cost of a training step: PyTorch's ToyModel (Linear 10->10, ReLU, Linear
// 10->5; batch 20; MSE; SGD) is so small that its step time is almost all runtime
// overhead — thread hand-overs, collectives, bookkeeping. Timed: the unwrapped module
// on one device, then DataParallel in DP and DDP mode on 1, 2 and 4 devices, through
// both paths (model(x) + loss.backward() on the caller, and forward_backward with the
// loss on the workers). Each configuration is validated (the loss falls) and warmed
// up; then the rounds alternate the configurations (round r times each in turn), so
// that the machine's load changing between rounds reaches every configuration alike.
//
//   overhead                      # aligned table
//   overhead --json               # one JSON object per configuration
//   overhead --steps 2000 --rounds 7 --devices 1,2
//
// Figures: us/step = median over rounds of round time / steps; steps/s = 1e6 / us/step;
// "vs unwrapped" = median over rounds of us/step / the unwrapped us/step of the same
// round, with its smallest and largest round in brackets; hand-overs/step = tasks handed to
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
    "usage: overhead [--steps N] [--rounds R] [--warmup W] [--devices 1,2,4] [--only NAME] [--json]\n"
    "  --only NAME   time the unwrapped step and the configuration NAME alone (e.g.\n"
    "                \"DP model(x)\"), for strace -c -f or perf stat on one design\n";

struct Options {
  int steps = 1000;
  int rounds = 5;
  int warmup = 200;
  std::vector<int> devices = {1, 2, 4};
  bool json = false;
  std::string only;
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
    else if (a == "--only") o.only = next();
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
  std::vector<double> rounds;  // us/step of each round
  std::vector<double> ratios;  // us/step / the unwrapped us/step of the same round
  double handoffs_per_step = 0;
  double first_loss = 0, last_loss = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// One configuration: a step (returning the loss) and the count of hand-overs so far.
struct Config {
  std::string name;
  int devices = 1;
  std::function<dp::Tensor()> step;
  std::function<std::int64_t()> handoffs;
  std::shared_ptr<void> keep;  // the model and optimizer the step uses
};

Config unwrapped(const dp::Tensor& x, const dp::Tensor& y) {
  struct State {
    std::shared_ptr<dp::nn::Sequential> net = toy_model();
    dp::optim::SGD opt{net->parameters(), {.lr = 1e-3}};
  };
  auto st = std::make_shared<State>();
  Config c{"unwrapped", 1, nullptr, [] { return std::int64_t{0}; }, st};
  c.step = [s = st.get(), x, y] {
    s->opt.zero_grad();
    dp::Tensor loss = dp::nn::mse_loss(s->net->forward(x), y);
    loss.backward();
    s->opt.step();
    return loss;
  };
  return c;
}

std::string config_name(dp::Mode mode, bool worker_loss) {
  return std::string(mode == dp::Mode::DP ? "DP" : "DDP") + (worker_loss ? " forward_backward" : " model(x)");
}

Config wrapped(dp::Mode mode, int n, bool worker_loss, const dp::Tensor& x, const dp::Tensor& y) {
  struct State {
    dp::DataParallel model;
    dp::optim::SGD opt;
    State(dp::Mode mode, const std::vector<dp::Device>& devs)
        : model(toy_model(), devs, {.mode = mode}), opt(model.parameters(), {.lr = 1e-3}) {}
  };
  std::vector<dp::Device> devs;
  for (int i = 0; i < n; ++i) devs.push_back(dp::cpu(i));
  auto st = std::make_shared<State>(mode, devs);
  Config c;
  c.name = config_name(mode, worker_loss);
  c.devices = n;
  c.keep = st;
  c.handoffs = [s = st.get()] { return s->model.stats().handoffs; };
  c.step = [s = st.get(), worker_loss, x, y] {
    auto loss_fn = [](const dp::Tensor& out, const dp::Tensor& t) { return dp::nn::mse_loss(out, t); };
    s->opt.zero_grad();
    dp::Tensor loss;
    if (worker_loss) {
      loss = s->model.forward_backward(x, y, loss_fn);
    } else {
      loss = loss_fn(s->model(x), y);
      loss.backward();
    }
    s->opt.step();
    return loss;
  };
  return c;
}

// Every configuration is validated (its first loss), warmed up, then timed in rounds
// that alternate the configurations, so that a change in the machine's load between
// rounds reaches all of them alike; a ratio is taken within each round.
std::vector<Result> run(const Options& o, std::vector<Config>& configs) {
  std::vector<Result> results(configs.size());
  std::vector<std::int64_t> h0(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) {
    results[i].name = configs[i].name;
    results[i].devices = configs[i].devices;
    results[i].first_loss = configs[i].step().item();
    for (int k = 0; k < o.warmup; ++k) configs[i].step();
    h0[i] = configs[i].handoffs();
  }
  for (int r = 0; r < o.rounds; ++r) {
    for (std::size_t i = 0; i < configs.size(); ++i) {
      dp::Tensor loss;
      auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < o.steps; ++k) loss = configs[i].step();
      auto t1 = std::chrono::steady_clock::now();
      results[i].rounds.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / o.steps);
      results[i].last_loss = loss.item();
    }
    for (Result& res : results) res.ratios.push_back(res.rounds.back() / results[0].rounds.back());
  }
  for (std::size_t i = 0; i < configs.size(); ++i) {
    results[i].handoffs_per_step =
        static_cast<double>(configs[i].handoffs() - h0[i]) / (static_cast<double>(o.steps) * o.rounds);
  }
  return results;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  std::string names;  // every configuration's name, for --only
  bool known = o.only.empty();
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP})
    for (bool worker_loss : {false, true}) {
      names += (names.empty() ? "\"" : ", \"") + config_name(mode, worker_loss) + "\"";
      known = known || o.only == config_name(mode, worker_loss);
    }
  if (!known) {
    std::fprintf(stderr, "--only: expected one of %s, got \"%s\"\n%s", names.c_str(), o.only.c_str(), kUsage);
    return 2;
  }
  int max_devices = *std::max_element(o.devices.begin(), o.devices.end());
  if (max_devices > dp::device_count(dp::DeviceType::CPU)) {
    std::fprintf(stderr, "overhead: %d CPU virtual devices requested, %d exist (set DP_CPU_DEVICES)\n",
                 max_devices, dp::device_count(dp::DeviceType::CPU));
    return 2;
  }
  dp::Generator gen(1);
  dp::Tensor x = dp::randn({20, 10}, gen, dp::cpu(0));
  dp::Tensor y = dp::randn({20, 5}, gen, dp::cpu(0));

  std::vector<Config> configs = {unwrapped(x, y)};
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP})
    for (bool worker_loss : {false, true})
      for (int n : o.devices)
        if (o.only.empty() || o.only == config_name(mode, worker_loss))
          configs.push_back(wrapped(mode, n, worker_loss, x, y));
  std::vector<Result> results = run(o, configs);

  int bad = 0;
  if (!o.json) {
    std::printf("%-22s %7s %10s %10s %12s %12s %16s\n", "configuration", "devices", "us/step", "steps/s",
                "vs unwrapped", "(min..max)", "hand-overs/step");
  }
  for (const Result& r : results) {
    bool learned = r.last_loss < r.first_loss;  // validation: the same SGD run makes progress
    bad += learned ? 0 : 1;
    const double us = median(r.rounds), ratio = median(r.ratios);
    const auto [lo, hi] = std::minmax_element(r.ratios.begin(), r.ratios.end());
    if (o.json) {
      std::printf("{\"configuration\": \"%s\", \"devices\": %d, \"us_per_step\": %.3f, \"steps_per_s\": %.1f, "
                  "\"vs_unwrapped\": %.3f, \"vs_unwrapped_min\": %.3f, \"vs_unwrapped_max\": %.3f, "
                  "\"handoffs_per_step\": %.2f, \"loss_first\": %.6f, \"loss_last\": %.6f}\n",
                  r.name.c_str(), r.devices, us, 1e6 / us, ratio, *lo, *hi, r.handoffs_per_step, r.first_loss,
                  r.last_loss);
    } else {
      std::printf("%-22s %7d %10.1f %10.0f %11.2fx %5.2f..%-5.2f %16.2f%s\n", r.name.c_str(), r.devices, us, 1e6 / us,
                  ratio, *lo, *hi, r.handoffs_per_step, learned ? "" : "  (loss did not fall!)");
    }
  }
  return bad ? 1 : 0;
}
