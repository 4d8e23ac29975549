// Stress: random DP/DDP/Sharded configurations with worker failures injected at random phases.
//
// Each configuration draws a device count (1-8), a mode (Sharded: stage 1, 2 or 3), a path (module(x) + backward
// on the caller, or forward_backward with the loss on the workers), a batch size
// (tiny, uneven, smaller than the device count), a small random layer stack
// (Linear/ReLU/Dropout or Conv2d/BatchNorm2d/ReLU/MaxPool2d/Dropout) and DDP bucket
// caps, then trains a few steps. Some steps fail on purpose, on one chosen device:
// in a replica's forward, in the loss function, in backward (a custom autograd op
// whose backward throws) or in the optimizer's update. Every step runs under a
// watchdog. After each failure:
//  - the error reaches the caller as dp::Error naming the failing device;
//  - a failure before the optimizer step left the parameters untouched;
//  - the next step is correct: a reference DataParallel that never failed, loaded
//    with the failed model's state, computes the same loss and parameters (and in
//    DDP and Sharded every replica holds the same parameters as device 0).
// DP_STRESS_CONFIGS overrides the number of configurations (the sanitizer runs use
// fewer); DP_STRESS_SEED the seed. Both are printed with every failure.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>

#include "dp/autograd/node.h"
#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;

constexpr int kDefaultConfigs = 300;
constexpr std::uint64_t kDefaultSeed = 20240611;
// Far above a step's real time (milliseconds) even under TSan on two cores; a step
// that takes this long is deadlocked.
constexpr auto kWatchdog = std::chrono::seconds(120);

long env_or(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : fallback;
}

enum class Fault { None, Forward, Loss, Backward, Optimizer };
const char* fault_name(Fault f) {
  switch (f) {
    case Fault::None: return "none";
    case Fault::Forward: return "forward";
    case Fault::Loss: return "loss";
    case Fault::Backward: return "backward";
    case Fault::Optimizer: return "optimizer";
  }
  return "?";
}

// Which fault is armed, and on which device index. Shared by every injection point
// of one model; a fault fires once (the first matching site disarms it).
struct Injector {
  std::atomic<int> armed{0};  // a Fault value; 0 = none
  std::atomic<int> device{-1};
  bool fire(Fault f, int dev) {
    if (armed.load() != static_cast<int>(f) || device.load() != dev) return false;
    int expect = static_cast<int>(f);
    return armed.compare_exchange_strong(expect, 0);
  }
};

// Identity in forward and backward, except when its fault is armed for this device.
struct FaultPoint : dp::nn::Module {
  explicit FaultPoint(std::shared_ptr<Injector> inj) : inj(std::move(inj)) {}
  std::string name() const override { return "FaultPoint"; }
  Tensor forward(const Tensor& x) override {
    int dev = x.device().index;
    if (inj->fire(Fault::Forward, dev)) throw dp::Error("injected forward failure");
    Tensor y;
    {
      dp::NoGradGuard no_grad;
      y = x.clone();
    }
    auto inj_copy = inj;
    dp::autograd::record("FaultPointBackward", {x}, y, {}, [inj_copy, dev](const std::vector<Tensor>& g) {
      if (inj_copy->fire(Fault::Backward, dev)) throw dp::Error("injected backward failure");
      return std::vector<Tensor>{g[0]};
    });
    return y;
  }
  std::shared_ptr<Injector> inj;
};

// Plain SGD whose update throws on the armed device (a failing optimizer kernel).
class InjectedSgd final : public dp::optim::Optimizer {
 public:
  InjectedSgd(dp::nn::ParameterList params, double lr, std::shared_ptr<Injector> inj)
      : Optimizer(std::move(params), "FaultySgd"), lr_(lr), inj_(std::move(inj)) {}
  double lr() const override { return lr_; }
  void set_lr(double lr) override { lr_ = lr; }

 protected:
  std::vector<std::string> state_names() const override { return {}; }
  void update(dp::Device dev, float* param, const float* grad, float* const*, std::int64_t n, bool,
              std::int64_t) override {
    // Update half the range first: a failure then leaves a partially stepped copy.
    std::int64_t half = n / 2;
    for (std::int64_t i = 0; i < half; ++i) param[i] -= static_cast<float>(lr_) * grad[i];
    if (inj_->fire(Fault::Optimizer, dev.index)) throw dp::Error("injected optimizer failure");
    for (std::int64_t i = half; i < n; ++i) param[i] -= static_cast<float>(lr_) * grad[i];
  }

 private:
  double lr_;
  std::shared_ptr<Injector> inj_;
};

struct Config {
  int devices = 1;
  dp::Mode mode = dp::Mode::DP;
  int shard_stage = 0;  // Sharded: 1, 2 or 3
  bool worker_loss = false;
  bool conv = false;
  int channels = 1, hw = 4, features = 4;
  int classes = 3;
  std::vector<std::int64_t> rows;  // batch rows per step
  std::vector<Fault> faults;       // per step
  std::vector<int> fault_device;   // per step
  double bucket_cap_mb = 25, first_bucket_mb = 1;
  std::uint64_t net_seed = 0;
  std::vector<int> layers;  // layer codes, see build_net
  std::string str() const {
    std::ostringstream os;
    os << devices << " devices, " << dp::mode_name(mode);
    if (mode == dp::Mode::Sharded) os << " stage " << shard_stage;
    os << ", "
       << (worker_loss ? "forward_backward" : "module(x)") << ", " << (conv ? "conv" : "mlp")
       << " layers [";
    for (int l : layers) os << l << ' ';
    os << "], buckets " << bucket_cap_mb << "/" << first_bucket_mb << " MiB, steps:";
    for (std::size_t s = 0; s < rows.size(); ++s)
      os << " (rows " << rows[s] << ", fault " << fault_name(faults[s]) << "@" << fault_device[s] << ")";
    return os.str();
  }
};

Config draw(std::mt19937_64& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Config c;
  c.devices = pick(1, 8);
  const int mode = pick(0, 4);  // DP, DDP, Sharded stage 1, 2 or 3
  c.mode = mode == 0 ? dp::Mode::DP : mode == 1 ? dp::Mode::DDP : dp::Mode::Sharded;
  if (c.mode == dp::Mode::Sharded) c.shard_stage = mode - 1;
  c.worker_loss = pick(0, 1);
  c.conv = pick(0, 2) == 0;  // convolutions cost more: a third of the configurations
  c.net_seed = rng();
  // Caps from one parameter per bucket (1e-6 MiB) to one bucket for everything.
  const double caps[] = {1e-6, 2e-5, 1e-4, 25};
  c.bucket_cap_mb = caps[pick(0, 3)];
  c.first_bucket_mb = caps[pick(0, 3)];
  if (c.conv) {
    c.channels = pick(1, 3);
    c.hw = pick(2, 3) * 2;  // 4 or 6: stays >= 2x2 after one 2x2 max-pool
    int n = pick(1, 3);
    for (int i = 0; i < n; ++i) c.layers.push_back(pick(0, 3));  // conv, bn, relu, dropout
    if (pick(0, 1)) c.layers.push_back(4);                       // maxpool (once)
  } else {
    c.features = pick(2, 6);
    int n = pick(1, 4);
    for (int i = 0; i < n; ++i) c.layers.push_back(pick(0, 2));  // linear, relu, dropout
  }
  c.classes = pick(2, 4);
  int steps = pick(3, 4);
  for (int s = 0; s < steps; ++s) {
    int kind = pick(0, 4);
    std::int64_t rows = kind == 0   ? pick(1, 3)                                      // tiny
                        : kind == 1 ? std::max(1, c.devices - 1)                      // < devices
                        : kind == 2 ? c.devices + 1                                   // uneven
                                    : pick(1, 4 * c.devices + 3);                     // anything
    c.rows.push_back(rows);
    // Never fail the last step: it checks that the model recovered.
    Fault f = s + 1 == steps ? Fault::None : static_cast<Fault>(pick(0, 4));
    if (f == Fault::Loss && !c.worker_loss) f = Fault::Forward;  // module(x): loss runs on the caller
    c.faults.push_back(f);
    c.fault_device.push_back(pick(0, c.devices - 1));
  }
  return c;
}

// The net: [FaultPoint] body... [FaultPoint] head. Every draw with the same config
// builds bitwise identical parameters.
std::shared_ptr<dp::nn::Sequential> build_net(const Config& c, const std::shared_ptr<Injector>& inj) {
  dp::Generator gen(c.net_seed);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<FaultPoint>(inj));
  if (c.conv) {
    std::int64_t ch = c.channels, hw = c.hw;
    for (int l : c.layers) {
      switch (l) {
        case 0: {
          net->push_back(std::make_shared<dp::nn::Conv2d>(ch, 3, 3, 1, 1, true, &gen));
          ch = 3;
          break;
        }
        case 1: net->push_back(std::make_shared<dp::nn::BatchNorm2d>(ch)); break;
        case 2: net->push_back(std::make_shared<dp::nn::ReLU>()); break;
        case 3: net->push_back(std::make_shared<dp::nn::Dropout>(0.3, 7)); break;
        case 4: {
          net->push_back(std::make_shared<dp::nn::MaxPool2d>(2));
          hw /= 2;
          break;
        }
      }
    }
    net->push_back(std::make_shared<dp::nn::Flatten>());
    net->push_back(std::make_shared<FaultPoint>(inj));
    net->push_back(std::make_shared<dp::nn::Linear>(ch * hw * hw, c.classes, true, &gen));
  } else {
    std::int64_t f = c.features;
    for (int l : c.layers) {
      switch (l) {
        case 0: {
          net->push_back(std::make_shared<dp::nn::Linear>(f, 5, true, &gen));
          f = 5;
          break;
        }
        case 1: net->push_back(std::make_shared<dp::nn::ReLU>()); break;
        case 2: net->push_back(std::make_shared<dp::nn::Dropout>(0.3, 7)); break;
      }
    }
    net->push_back(std::make_shared<FaultPoint>(inj));
    net->push_back(std::make_shared<dp::nn::Linear>(f, c.classes, true, &gen));
  }
  return net;
}

// One training setup: module, DataParallel, optimizer, injector.
struct Rig {
  std::shared_ptr<Injector> inj = std::make_shared<Injector>();
  std::shared_ptr<dp::nn::Sequential> net;
  std::unique_ptr<dp::DataParallel> model;
  std::unique_ptr<InjectedSgd> opt;
  const Config* cfg = nullptr;

  explicit Rig(const Config& c) : cfg(&c) {
    net = build_net(c, inj);
    std::vector<dp::Device> devs;
    for (int d = 0; d < c.devices; ++d) devs.push_back(dp::cpu(d));
    model = std::make_unique<dp::DataParallel>(
        net, devs,
        dp::DataParallelOptions{.mode = c.mode,
                                .shard_stage = c.mode == dp::Mode::Sharded ? std::optional<int>(c.shard_stage)
                                                                           : std::nullopt,
                                .bucket_cap_mb = c.bucket_cap_mb,
                                .first_bucket_mb = c.first_bucket_mb});
    opt = std::make_unique<InjectedSgd>(model->parameters(), 0.05, inj);
  }

  // Restarts every Dropout stream, so a step's masks do not depend on what a failed
  // step drew before it.
  void reseed(std::uint64_t seed) {
    for (auto& m : net->modules())
      if (auto* d = dynamic_cast<dp::nn::Dropout*>(m.get())) d->set_seed(seed);
  }

  // One training step; returns the loss.
  double step(const Tensor& x, const Tensor& y, Fault fault, int fault_device) {
    auto loss_fn = [this](const Tensor& out, const Tensor& tgt) {
      if (inj->fire(Fault::Loss, out.device().index)) throw dp::Error("injected loss failure");
      return dp::nn::cross_entropy(out, tgt);
    };
    inj->device = fault_device;
    inj->armed = static_cast<int>(fault);
    opt->zero_grad();
    Tensor loss;
    if (cfg->worker_loss) {
      loss = model->forward_backward(x, y, loss_fn);
    } else {
      loss = loss_fn((*model)(x), y);
      loss.backward();
    }
    opt->step();
    return loss.item();
  }
};

// Runs f under the watchdog; a hang ends the process with the reproduction line.
template <typename F>
auto guarded(const std::string& what, F&& f) {
  auto fut = std::async(std::launch::async, std::forward<F>(f));
  if (fut.wait_for(kWatchdog) != std::future_status::ready) {
    std::fprintf(stderr, "stress_test: HANG (> %lld s) in %s\n", static_cast<long long>(kWatchdog.count()),
                 what.c_str());
    std::fflush(stderr);
    std::_Exit(1);  // the hung worker cannot be joined
  }
  return fut.get();
}

std::vector<float> flat_params(const dp::DataParallel& m, int copy) {
  if (m.shard_stage() == 3 && m.devices().size() > 1) {  // no replicas: device 0's gathered parameters
    std::vector<float> out;
    for (const Tensor& t : m.module()->parameters()) {
      auto v = t.to_vector();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
  return m.module()->parameter_set()->copy(copy).data.to_vector();
}

struct Data {
  Tensor x, y;
};
Data make_data(const Config& c, std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  dp::Shape shape = c.conv ? dp::Shape{rows, c.channels, c.hw, c.hw} : dp::Shape{rows, c.features};
  std::vector<std::int64_t> labels(rows);
  for (std::int64_t i = 0; i < rows; ++i) labels[i] = static_cast<std::int64_t>((seed + 3 * i) % c.classes);
  return {dp::randn(shape, gen, dp::cpu(0)), dp::from_vector(labels, {rows}, dp::cpu(0))};
}

// Same arithmetic on both sides (same devices, mode, buckets, masks): the results
// should agree bit for bit; the tolerance only absorbs what no test should care about.
constexpr double kTolerance = 1e-6;

}  // namespace

TEST_CASE("random DP/DDP/Sharded configurations survive injected worker failures and stay correct") {
  const long configs = env_or("DP_STRESS_CONFIGS", kDefaultConfigs);
  const auto seed = static_cast<std::uint64_t>(env_or("DP_STRESS_SEED", static_cast<long>(kDefaultSeed)));
  std::mt19937_64 rng(seed);
  int failures_injected = 0, failures_seen = 0;
  for (long i = 0; i < configs; ++i) {
    const Config c = draw(rng);
    std::ostringstream where;
    where << "DP_STRESS_SEED=" << seed << " config #" << i << ": " << c.str();
    INFO(where.str());
    Rig rig(c);
    Rig ref(c);  // never fails
    for (std::size_t s = 0; s < c.rows.size(); ++s) {
      CAPTURE(s);
      Data d = make_data(c, c.rows[s], 1000 * i + s);
      const std::uint64_t mask_seed = 77 + s;
      if (c.faults[s] == Fault::None) {
        rig.reseed(mask_seed);
        ref.reseed(mask_seed);
        double l = guarded(where.str(), [&] { return rig.step(d.x, d.y, Fault::None, -1); });
        double lr = guarded(where.str(), [&] { return ref.step(d.x, d.y, Fault::None, -1); });
        CHECK(std::fabs(l - lr) <= kTolerance);
        CHECK(max_diff(flat_params(*rig.model, 0), flat_params(*ref.model, 0)) <= kTolerance);
        if (c.mode != dp::Mode::DP && c.shard_stage != 3)
          for (int r = 1; r < c.devices; ++r)
            CHECK(max_diff(flat_params(*rig.model, r), flat_params(*rig.model, 0)) == 0);
        continue;
      }
      ++failures_injected;
      rig.reseed(mask_seed);
      std::vector<float> before = flat_params(*rig.model, 0);
      std::string error = guarded(where.str(), [&]() -> std::string {
        try {
          rig.step(d.x, d.y, c.faults[s], c.fault_device[s]);
        } catch (const dp::Error& e) {
          return e.what();
        } catch (const std::exception& e) {
          return std::string("NOT a dp::Error: ") + e.what();
        }
        return "";
      });
      // A fault fires only where its device got rows (and, for backward, where the
      // point is on a gradient path); when it did not fire, the step simply succeeded.
      bool fired = rig.inj->armed.load() == 0;
      rig.inj->armed = 0;
      if (!fired) {
        CHECK(error.empty());
      } else {
        ++failures_seen;
        CHECK_MESSAGE(error.find("injected") != std::string::npos, error);
        CHECK_MESSAGE(error.find("NOT a dp::Error") == std::string::npos, error);
        CHECK_MESSAGE(error.find(dp::cpu(c.fault_device[s]).str()) != std::string::npos, error);
        if (c.faults[s] != Fault::Optimizer)
          CHECK(max_diff(flat_params(*rig.model, 0), before) == 0);  // nothing stepped
      }
      // The reference continues from wherever the failed model is now (parameters and
      // buffers; a failed optimizer step may have applied part of its update).
      {
        dp::NoGradGuard no_grad;
        ref.model->load_state_dict(rig.net->state_dict());
      }
      REQUIRE(max_diff(flat(rig.net->state_dict()), flat(ref.net->state_dict())) == 0);
    }
  }
  MESSAGE("stress: ", configs, " configurations, ", failures_injected, " failures armed, ", failures_seen,
          " fired, seed ", seed);
  CHECK(failures_seen > 0);
}
