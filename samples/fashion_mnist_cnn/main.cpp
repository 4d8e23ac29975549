// samples/fashion_mnist_cnn — the classic small CNN on Fashion-MNIST, on one device or
// data-parallel (DP or DDP) over several.
//
//   fashion_mnist_cnn --epochs 3                                  # one device
//   fashion_mnist_cnn --mode ddp --devices 0,1 --json             # DDP, one JSON object a line
//
// Recipe (the same as bench/pytorch/fashion_cnn_torch.py): Conv 1→32 3×3 pad 1, ReLU,
// MaxPool 2; Conv 32→64 3×3 pad 1, ReLU, MaxPool 2; Flatten; Linear 3136→128, ReLU;
// Linear 128→10; cross-entropy; Adam lr 1e-3; batch 256; pixels / 255.
//
// Output: a progress bar on a terminal, one line per epoch and a summary line; with
// --json instead one object a line: {"type":"step"} every --log-every steps,
// {"type":"epoch"} per epoch and {"type":"summary"} at the end. Exit codes: 0 success,
// 1 a dp::Error (bad data directory, unavailable device, …), 2 bad flags.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/options.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "dp/data/dataloader.h"
#include "dp/data/idx.h"
#include "dp/dp.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Config {
  int epochs = 3;
  std::int64_t batch = 256;
  double lr = 1e-3;
  std::uint64_t seed = 0;
  std::string device = "auto";  // auto | cpu | cuda
  std::int64_t max_steps = 0;   // 0 = no limit
  std::string data;
  bool json = false;
  std::string devices_spec = "1";     // --devices: N or a list of ids (samples/common/options.h)
  std::vector<int> devices;           // the ids it names
  std::string mode = "single";        // single | dp | ddp | sharded
  int shard_stage = 2;                // --mode sharded: ZeRO stage
  std::string path = "worker";        // worker | module
  std::string precision = "fp32";     // fp32 | bf16 | fp16
  std::int64_t log_every = 10;
  std::int64_t eval_batch = 1000;
  bool no_eval = false;  // benchmarks: time training only
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string join(const std::vector<int>& v, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

// The network of the file comment. Every layer draws its initial values from `gen`,
// in registration order, so one seed gives one set of parameters.
std::shared_ptr<dp::nn::Sequential> make_cnn(dp::Generator& gen) {
  using namespace dp::nn;
  auto net = std::make_shared<Sequential>();
  net->push_back(std::make_shared<Conv2d>(1, 32, 3, /*stride=*/1, /*padding=*/1, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(2));  // (N, 32, 28, 28) → (N, 32, 14, 14)
  net->push_back(std::make_shared<Conv2d>(32, 64, 3, 1, 1, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(2));  // (N, 64, 14, 14) → (N, 64, 7, 7)
  net->push_back(std::make_shared<Flatten>());     // → (N, 3136)
  net->push_back(std::make_shared<Linear>(64 * 7 * 7, 128, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(128, 10, true, &gen));
  return net;
}

dp::Device make_device(const std::string& kind, int index) {
  if (kind == "cpu") return dp::cpu(index);
  if (kind == "cuda") return dp::cuda(index);
  return dp::device(index);
}

// Fraction of `loader`'s examples the plain network classifies correctly, on `dev`.
double evaluate(dp::nn::Module& net, dp::data::DataLoader& loader, dp::Device dev) {
  dp::NoGradGuard no_grad;
  net.eval();
  std::int64_t correct = 0, total = 0;
  for (auto& [x, y] : loader) {
    dp::Tensor pred = net.forward(x.to(dev)).argmax(1);
    correct += static_cast<std::int64_t>(dp::eq(pred, y.to(dev)).sum().item());
    total += y.size(0);
  }
  net.train();
  return total ? static_cast<double>(correct) / static_cast<double>(total) : 0.0;
}

// A one-line progress bar redrawn in place on a terminal.
class ProgressBar {
 public:
  ProgressBar(bool on, int epoch, int epochs, std::int64_t total)
      : on_(on), epoch_(epoch), epochs_(epochs), total_(total) {}
  void update(std::int64_t done, double loss, double samples_per_sec) {
    if (!on_) return;
    constexpr int kWidth = 30;  // characters of bar; fits an 80-column terminal with the text
    int filled = total_ > 0 ? static_cast<int>(kWidth * std::min(done, total_) / total_) : 0;
    std::printf("\repoch %d/%d [%s%s] %lld/%lld loss %.4f %.0f samples/s ", epoch_, epochs_,
                std::string(filled, '#').c_str(), std::string(kWidth - filled, '.').c_str(),
                static_cast<long long>(done), static_cast<long long>(total_), loss,
                samples_per_sec);
    std::fflush(stdout);
  }
  void finish() {
    if (!on_) return;
    std::printf("\r%*s\r", 100, "");  // clear the bar; the epoch line replaces it
    std::fflush(stdout);
  }

 private:
  bool on_;
  int epoch_, epochs_;
  std::int64_t total_;
};

// Everything a run trains with: its devices, data, network, wrapper and optimizer.
struct Session {
  std::vector<dp::Device> devices;
  std::shared_ptr<dp::data::MnistDataset> train_set, test_set;
  std::unique_ptr<dp::data::DataLoader> train_loader, test_loader;
  std::shared_ptr<dp::nn::Sequential> net;
  std::unique_ptr<dp::DataParallel> model;  // null in single mode
  std::unique_ptr<dp::optim::Adam> opt;
  dp::amp::GradScaler scaler{{.enabled = false}};  // --precision fp16: enabled
};

Session make_session(const Config& cfg) {
  Session s;
  for (int id : cfg.devices) s.devices.push_back(make_device(cfg.device, id));
  const dp::Device dev0 = s.devices.front();
  s.train_set = std::make_shared<dp::data::MnistDataset>(cfg.data, dp::data::Split::Train);
  s.test_set = std::make_shared<dp::data::MnistDataset>(cfg.data, dp::data::Split::Test);
  // One assembling thread: batches are cheap to build (784 bytes → floats per image),
  // and on a small machine a second one would only take cores from the training.
  // On GPUs the batches are pinned, so each shard's host→device copy is asynchronous.
  const bool pin = dev0.is_cuda();
  // Under mpirun each process reads its own part of every epoch (a DistributedSampler
  // over the processes) and --batch stays the global batch: each process takes
  // batch / processes rows of it, and DataParallel splits those over its devices.
  const int procs = dp::dist::world_size();
  if (procs == 1) {
    s.train_loader = std::make_unique<dp::data::DataLoader>(
        s.train_set, dp::data::DataLoader::Options{.batch_size = cfg.batch, .shuffle = true, .seed = cfg.seed,
                                                   .num_workers = 1, .pin_memory = pin});
  } else {
    DP_CHECK(cfg.batch % procs == 0, "fashion_mnist_cnn: --batch ", cfg.batch, " is the global batch and must be a "
             "multiple of the ", procs, " processes");
    DP_CHECK(cfg.mode != "single", "fashion_mnist_cnn: --mode single under mpirun would train ", procs,
             " separate models; pick dp, ddp or sharded");
    auto sampler = std::make_shared<dp::data::DistributedSampler>(
        s.train_set->size(), dp::data::DistributedSampler::Options{.shuffle = true, .seed = cfg.seed});
    s.train_loader = std::make_unique<dp::data::DataLoader>(
        s.train_set, sampler,
        dp::data::DataLoader::Options{.batch_size = cfg.batch / procs, .num_workers = 1, .pin_memory = pin});
  }
  s.test_loader = std::make_unique<dp::data::DataLoader>(
      s.test_set, dp::data::DataLoader::Options{.batch_size = cfg.eval_batch, .num_workers = 1, .pin_memory = pin});

  dp::manual_seed(cfg.seed);
  dp::Generator gen(cfg.seed);
  s.net = make_cnn(gen);
  s.net->to(dev0);
  if (cfg.mode != "single") {
    s.model = std::make_unique<dp::DataParallel>(
        s.net, s.devices, samples::mode_options(cfg.mode, cfg.shard_stage));
  }
  s.opt = std::make_unique<dp::optim::Adam>(s.model ? s.model->parameters() : s.net->parameters(),
                                            dp::optim::AdamOptions{.lr = cfg.lr});
  if (cfg.precision == "fp16") s.scaler = dp::amp::GradScaler();  // PyTorch's defaults
  return s;
}

dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); }

// One optimizer step on batch (x, y); returns its loss (reading it synchronises the step).
double train_step(Session& s, const Config& cfg, const dp::Tensor& x, const dp::Tensor& y) {
  s.opt->zero_grad();
  dp::Tensor loss;
  {
    const dp::amp::autocast precision = samples::precision_scope(cfg.precision);
    if (!s.model) {
      const dp::Device dev0 = s.devices.front();
      loss = loss_fn(s.net->forward(x.to(dev0)), y.to(dev0));
    } else if (cfg.path == "module") {
      loss = loss_fn((*s.model)(x), y);
    } else {
      // Backward runs inside, in the forward's dtypes; fp16 scales each shard's loss.
      loss = s.model->forward_backward(x, y, [&](const dp::Tensor& out, const dp::Tensor& t) {
        return s.scaler.scale(loss_fn(out, t));
      });
      if (s.scaler.is_enabled()) loss = dp::mul(loss, 1.0 / s.scaler.get_scale());  // report the true loss
    }
  }
  if (!s.model || cfg.path == "module") s.scaler.scale(loss).backward();
  s.scaler.step(*s.opt);  // skipped when a float16 gradient overflowed
  s.scaler.update();
  return loss.item();
}

// What the whole run has done so far.
struct Totals {
  std::int64_t step = 0;
  double train_time = 0.0;  // seconds spent in training steps (no evaluation)
  std::int64_t train_samples = 0;
  double last_accuracy = 0.0, first_loss = NAN, last_loss = NAN;
  int epochs_run = 0;
};

// What one epoch's training did.
struct EpochStats {
  double loss_sum = 0.0;  // loss × rows, summed over the steps
  double time = 0.0;      // seconds of training
  std::int64_t samples = 0, steps = 0;
};

// The "mode" and "devices" keys every JSON record carries.
json tags(const Config& cfg) { return {{"mode", cfg.mode}, {"devices", cfg.devices}, {"precision", cfg.precision}}; }

void report_start(const Config& cfg, const Session& s) {
  if (cfg.json) return;
  std::cout << "fashion_mnist_cnn: " << s.train_set->size() << " train / " << s.test_set->size()
            << " test images from " << cfg.data << "; mode " << cfg.mode << " on";
  for (auto d : s.devices) std::cout << ' ' << d.str();
  std::cout << "; batch " << cfg.batch << ", Adam lr " << cfg.lr << ", seed " << cfg.seed << std::endl;
}

void report_step(const Config& cfg, int epoch, std::int64_t step, double loss, double time_s, double sps) {
  json rec = {{"type", "step"}, {"epoch", epoch},      {"step", step},
              {"loss", loss},   {"time_s", time_s},    {"samples_per_sec", sps}};
  rec.update(tags(cfg));
  std::cout << rec.dump() << std::endl;
}

// Trains one epoch (up to --max-steps in all), logging steps and drawing the bar.
EpochStats train_epoch(const Config& cfg, Session& s, int epoch, bool bar, Totals& tot) {
  s.train_loader->set_epoch(static_cast<std::uint64_t>(epoch - 1));
  std::int64_t epoch_total = s.train_loader->size();
  if (cfg.max_steps > 0) epoch_total = std::min(epoch_total, cfg.max_steps - tot.step);
  ProgressBar progress(bar, epoch, cfg.epochs, epoch_total);
  EpochStats ep;
  auto window_start = Clock::now();  // samples/s is measured over the steps since the last log
  std::int64_t window_samples = 0;
  const auto t_epoch = Clock::now();
  for (auto& [x, y] : *s.train_loader) {
    if (cfg.max_steps > 0 && tot.step >= cfg.max_steps) break;
    const double l = train_step(s, cfg, x, y);
    const std::int64_t rows = x.size(0);
    ++tot.step;
    ++ep.steps;
    ep.loss_sum += l * static_cast<double>(rows);
    ep.samples += rows;
    window_samples += rows;
    if (std::isnan(tot.first_loss)) tot.first_loss = l;
    tot.last_loss = l;
    ep.time = seconds_since(t_epoch);

    const bool log_now = tot.step == 1 || tot.step % cfg.log_every == 0;
    if (!log_now && !bar) continue;
    const double window_s = seconds_since(window_start);
    const double sps = window_s > 0 ? static_cast<double>(window_samples) / window_s : 0.0;
    if (cfg.json && log_now) report_step(cfg, epoch, tot.step, l, tot.train_time + ep.time, sps);
    progress.update(ep.steps, l, sps);
    if (log_now) {
      window_start = Clock::now();
      window_samples = 0;
    }
  }
  progress.finish();
  tot.train_time += ep.time;
  tot.train_samples += ep.samples;
  return ep;
}

void report_epoch(const Config& cfg, int epoch, const EpochStats& ep, double accuracy, double eval_s) {
  const double train_loss = ep.samples ? ep.loss_sum / static_cast<double>(ep.samples) : NAN;
  const double sps = ep.time > 0 ? static_cast<double>(ep.samples) / ep.time : 0.0;
  if (cfg.json) {
    json rec = {{"type", "epoch"},      {"epoch", epoch},
                {"steps", ep.steps},    {"train_loss", train_loss},
                {"samples_per_sec", sps}, {"train_s", ep.time}};
    if (!cfg.no_eval) {
      rec["test_accuracy"] = accuracy;
      rec["eval_s"] = eval_s;
    }
    rec.update(tags(cfg));
    std::cout << rec.dump() << std::endl;
  } else {
    std::printf("epoch %d/%d: train_loss %.4f  test_accuracy %s  %.0f samples/s  (%lld steps, %.1f s train, %.1f s eval)\n",
                epoch, cfg.epochs, train_loss, cfg.no_eval ? "-" : std::to_string(accuracy).c_str(), sps,
                static_cast<long long>(ep.steps), ep.time, eval_s);
    std::fflush(stdout);
  }
}

// Mean milliseconds per iteration and phase, per device (see dp/parallel/stats.h).
json phase_breakdown(const dp::DataParallel& model) {
  dp::parallel::Stats st = model.stats();
  json per_dev = json::array();
  for (const auto& d : st.devices) {
    json phases = json::object();
    for (int p = 0; p < static_cast<int>(dp::parallel::Phase::kCount); ++p) {
      phases[dp::parallel::phase_name(static_cast<dp::parallel::Phase>(p))] =
          st.iterations ? d.ms[p] / static_cast<double>(st.iterations) : 0.0;
    }
    per_dev.push_back({{"device", d.device.str()}, {"ms_per_step", phases}});
  }
  return per_dev;
}

void report_summary(const Config& cfg, const Totals& tot, const dp::DataParallel* model) {
  const double mean_sps = tot.train_time > 0 ? static_cast<double>(tot.train_samples) / tot.train_time : 0.0;
  if (cfg.json) {
    json rec = {{"type", "summary"},           {"epochs", tot.epochs_run},
                {"steps", tot.step},           {"first_loss", tot.first_loss},
                {"final_loss", tot.last_loss},
                {"samples_per_sec", mean_sps}, {"train_s", tot.train_time},
                {"batch", cfg.batch},          {"lr", cfg.lr},
                {"seed", cfg.seed},            {"path", cfg.path}};
    if (!cfg.no_eval) rec["test_accuracy"] = tot.last_accuracy;
    rec.update(tags(cfg));
    if (model) rec["phases"] = phase_breakdown(*model);
    std::cout << rec.dump() << std::endl;
  } else {
    std::printf("summary: mode %s devices %s: %d epoch(s), %lld steps, final test_accuracy %s, "
                "%.0f samples/s over %.1f s of training\n",
                cfg.mode.c_str(), join(cfg.devices, ",").c_str(), tot.epochs_run,
                static_cast<long long>(tot.step),
                cfg.no_eval ? "-" : std::to_string(tot.last_accuracy).c_str(), mean_sps, tot.train_time);
  }
}

int run(const Config& cfg) {
  const bool bar = !cfg.json && isatty(STDOUT_FILENO);
  Session s = make_session(cfg);
  report_start(cfg, s);
  Totals tot;
  for (int epoch = 1; epoch <= cfg.epochs; ++epoch) {
    if (cfg.max_steps > 0 && tot.step >= cfg.max_steps) break;
    const EpochStats ep = train_epoch(cfg, s, epoch, bar, tot);
    const auto t_eval = Clock::now();
    if (!cfg.no_eval) tot.last_accuracy = evaluate(*s.net, *s.test_loader, s.devices.front());
    const double eval_s = seconds_since(t_eval);
    ++tot.epochs_run;
    report_epoch(cfg, epoch, ep, tot.last_accuracy, eval_s);
  }
  report_summary(cfg, tot, s.model.get());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"Train the classic small CNN on Fashion-MNIST with dp (one device, DP or DDP)."};
  app.add_option("--epochs", cfg.epochs, "Passes over the training set")
      ->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--batch", cfg.batch, "Global batch size (split over the devices)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24))->capture_default_str();
  app.add_option("--lr", cfg.lr, "Adam learning rate")
      ->check(CLI::Range(1e-12, 10.0))->capture_default_str();
  app.add_option("--seed", cfg.seed, "Seed of the initial parameters and the shuffling")
      ->capture_default_str();
  app.add_option("--device", cfg.device,
                 "Device type: cpu (virtual devices), cuda, or auto (CUDA when visible)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))->capture_default_str();
  app.add_option("--max-steps", cfg.max_steps, "Stop after this many training steps (0 = no limit)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40))->capture_default_str();
  app.add_option("--data", cfg.data, "Directory with the four Fashion-MNIST IDX files")
      ->default_str(dp::data::default_fashion_mnist_dir().string());
  app.add_flag("--json", cfg.json, "Print one JSON object per line instead of text");
  samples::add_devices_option(app, cfg.devices_spec)->default_str("1");
  samples::add_mode_option(app, cfg.mode, {"single", "dp", "ddp", "sharded"});
  samples::add_shard_stage_option(app, cfg.shard_stage);
  samples::add_path_option(app, cfg.path);
  samples::add_precision_option(app, cfg.precision, /*fp16=*/true);
  app.add_option("--log-every", cfg.log_every, "JSON step record every N steps (and at step 1)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))->capture_default_str();
  app.add_option("--eval-batch", cfg.eval_batch, "Batch size of the test-set evaluation")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24))->capture_default_str();
  app.add_flag("--no-eval", cfg.no_eval, "Skip the test-set evaluation (timing runs)");
  // Under mpirun every process trains; process 0 alone reports.
  if (!dp::dist::is_main() && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // app.exit prints help or the error; CLI11's own codes (100+) become the usual 2.
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  if (cfg.data.empty()) cfg.data = dp::data::default_fashion_mnist_dir().string();
  try {
    const dp::DeviceType type = cfg.device == "cpu"    ? dp::DeviceType::CPU
                                : cfg.device == "cuda" ? dp::DeviceType::CUDA
                                                       : dp::default_device_type();
    cfg.devices = samples::parse_device_ids(cfg.devices_spec, dp::device_count(type));
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  if (cfg.mode == "single" && cfg.devices.size() != 1) {
    std::cerr << "--mode single trains on one device, got --devices " << cfg.devices_spec
              << "; pass 1 or use --mode dp|ddp|sharded\n";
    return 2;
  }
  if (cfg.precision != "fp32" && dp::default_device_type() == dp::DeviceType::CPU && cfg.device != "cuda")
    std::cerr << samples::cpu_16bit_note(cfg.precision) << "\n";
  try {
    return run(cfg);
  } catch (const dp::Error& e) {
    std::cerr << "fashion_mnist_cnn: " << e.what() << '\n';
    return 1;
  }
}
