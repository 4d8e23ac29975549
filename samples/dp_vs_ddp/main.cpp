// samples/dp_vs_ddp — single device, DP and DDP side by side on 1..N devices.
//
// For each configuration the same model (same seed, same synthetic batches) trains
// `--warmup` untimed steps, then `--steps` timed ones. Reported: samples/s, speedup
// over one device without DataParallel, scaling efficiency (speedup / devices), the
// per-step phase breakdown from model.stats() (device 0 and the max over devices) and
// peak memory per device. Optional outputs: --json (one object per configuration and
// line), --csv FILE, --trace DIR (a Chrome/Perfetto trace per configuration, recorded
// over --trace-steps extra steps) and --plot DIR (PNG charts through gnuplot).
//
//   dp_vs_ddp --model cnn --devices 1,2 --batch 256 --steps 20
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"  // peak memory of the single-device run (no public API for it)
#include "common/models.h"
#include "common/options.h"
#include "common/util.h"
#include "dp/dp.h"

namespace {

using Clock = std::chrono::steady_clock;
using dp::parallel::Phase;
namespace fs = std::filesystem;

// Phases in report order, with their JSON / CSV / table names.
struct PhaseInfo {
  Phase phase;
  const char* key;
  const char* column;
};
constexpr PhaseInfo kPhases[] = {
    {Phase::Scatter, "scatter", "scatter"},
    {Phase::Replicate, "replicate", "repl/bcast"},
    {Phase::Forward, "forward", "fwd"},
    {Phase::Backward, "backward", "bwd"},
    {Phase::Reduce, "reduce", "reduce"},
    {Phase::AllReduceExposed, "allreduce_exposed", "AR exp"},
    {Phase::AllReduceHidden, "allreduce_hidden", "AR hid"},
    {Phase::Step, "step", "step"},
    {Phase::Gather, "gather", "gather"},
};
constexpr int kNumPhases = static_cast<int>(std::size(kPhases));

struct Args {
  std::string model = "cnn";
  std::string devices;
  int steps = 20;
  int warmup = 3;
  std::int64_t batch = 256;
  std::uint64_t seed = 1;
  double lr = 0.01;
  std::string path = "worker";
  bool json = false;
  std::string csv, trace_dir, plot_dir;
  int trace_steps = 2;
};

struct Result {
  std::string mode;  // "single", "DP", "DDP"
  int devices = 1;
  double seconds = 0;
  double samples_per_s = 0;
  double speedup = 0, efficiency = 0;
  double phase_dev0[kNumPhases] = {};
  double phase_max[kNumPhases] = {};
  std::vector<std::size_t> peak_memory;  // bytes per device
  double loss_first = 0, loss_last = 0;
  std::string trace_path;
};

dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); }

std::string trace_file(const Args& a, const std::string& mode, int n) {
  return (fs::path(a.trace_dir) / ("trace_" + a.model + "_" + mode + "_" + std::to_string(n) + ".json")).string();
}

// One device, no DataParallel: the baseline. Phases are timed here on the main thread.
Result run_single(const Args& a, const std::vector<dp::data::Batch>& batches) {
  Result r;
  r.mode = "single";
  dp::Device dev = dp::device(0);
  auto net = samples::make_model(a.model, a.seed);
  net->to(dev);
  dp::optim::SGD opt(net->parameters(), {.lr = a.lr, .momentum = 0.9});
  dp::parallel::Trace trace;
  double ms[kNumPhases] = {};
  auto since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto step = [&](int i, bool timed) {
    const auto& b = batches[i % batches.size()];
    auto t0 = Clock::now();
    dp::Tensor x = b.data.to(dev), y = b.target.to(dev);
    auto t1 = Clock::now();
    opt.zero_grad();
    dp::Tensor loss = loss_fn(net->forward(x), y);
    auto t2 = Clock::now();
    loss.backward();
    auto t3 = Clock::now();
    opt.step();
    auto t4 = Clock::now();
    if (timed) {
      ms[0] += std::chrono::duration<double, std::milli>(t1 - t0).count();
      ms[2] += std::chrono::duration<double, std::milli>(t2 - t1).count();
      ms[3] += std::chrono::duration<double, std::milli>(t3 - t2).count();
      ms[7] += std::chrono::duration<double, std::milli>(t4 - t3).count();
    }
    if (trace.enabled()) {
      trace.record("main", "scatter", t0, t1);
      trace.record("main", "forward", t1, t2);
      trace.record("main", "backward", t2, t3);
      trace.record("main", "step", t3, t4);
    }
    return loss;
  };
  for (int i = 0; i < a.warmup; ++i) step(i, false).item();
  dp::backend::get(dev).reset_peak_memory(dev);
  std::vector<dp::Tensor> losses;
  auto t0 = Clock::now();
  for (int i = 0; i < a.steps; ++i) losses.push_back(step(a.warmup + i, true));
  losses.back().item();  // waits for the device
  r.seconds = since(t0) / 1e3;
  r.peak_memory = {dp::backend::get(dev).max_memory_allocated(dev)};
  r.loss_first = losses.front().item();
  r.loss_last = losses.back().item();
  for (int p = 0; p < kNumPhases; ++p) r.phase_dev0[p] = r.phase_max[p] = ms[p] / a.steps;
  if (!a.trace_dir.empty()) {
    trace.enable(true);
    for (int i = 0; i < a.trace_steps; ++i) step(a.warmup + a.steps + i, false).item();
    r.trace_path = trace_file(a, "single", 1);
    trace.write_chrome_json(r.trace_path);
  }
  return r;
}

// DataParallel in `mode` over devices 0..n-1; phases from model.stats().
Result run_parallel(const Args& a, dp::Mode mode, int n, const std::vector<dp::data::Batch>& batches) {
  Result r;
  r.mode = mode == dp::Mode::DP ? "DP" : "DDP";
  r.devices = n;
  auto net = samples::make_model(a.model, a.seed);
  dp::DataParallel model(net, samples::first_devices(n), {.mode = mode});
  dp::optim::SGD opt(model.parameters(), {.lr = a.lr, .momentum = 0.9});
  int index = 0;
  auto step = [&](int i) {
    const auto& b = batches[i % batches.size()];
    auto t0 = Clock::now();
    opt.zero_grad();
    dp::Tensor loss;
    if (a.path == "worker") {
      loss = model.forward_backward(b.data, b.target, loss_fn);
    } else {
      loss = loss_fn(model(b.data), b.target);
      loss.backward();
    }
    opt.step();
    if (model.trace().enabled())
      model.trace().record("main", "iteration " + std::to_string(index), t0, Clock::now());
    ++index;
    return loss;
  };
  for (int i = 0; i < a.warmup; ++i) step(i).item();
  model.reset_stats();
  std::vector<dp::Tensor> losses;
  auto t0 = Clock::now();
  for (int i = 0; i < a.steps; ++i) losses.push_back(step(a.warmup + i));
  losses.back().item();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  dp::parallel::Stats s = model.stats();
  for (int p = 0; p < kNumPhases; ++p) {
    r.phase_dev0[p] = s.devices[0][kPhases[p].phase] / a.steps;
    for (auto& d : s.devices) r.phase_max[p] = std::max(r.phase_max[p], d[kPhases[p].phase] / a.steps);
  }
  for (auto& d : s.devices) r.peak_memory.push_back(d.peak_memory_bytes);
  r.loss_first = losses.front().item();
  r.loss_last = losses.back().item();
  if (!a.trace_dir.empty()) {
    model.trace().clear();
    model.trace().enable(true);
    index = 0;
    for (int i = 0; i < a.trace_steps; ++i) step(a.warmup + a.steps + i).item();
    model.trace().enable(false);
    r.trace_path = trace_file(a, r.mode, n);
    model.trace().write_chrome_json(r.trace_path);
  }
  return r;
}

nlohmann::json to_json(const Args& a, const Result& r) {
  nlohmann::json j;
  j["model"] = a.model;
  j["mode"] = r.mode;
  j["devices"] = r.devices;
  j["device_kind"] = samples::device_kind();
  j["global_batch"] = a.batch;
  j["steps"] = a.steps;
  j["warmup"] = a.warmup;
  j["path"] = a.path == "worker" ? "forward_backward" : "module";
  j["seconds"] = r.seconds;
  j["samples_per_s"] = r.samples_per_s;
  j["speedup"] = r.speedup;
  j["efficiency"] = r.efficiency;
  nlohmann::json d0, mx;
  for (int p = 0; p < kNumPhases; ++p) {
    d0[kPhases[p].key] = r.phase_dev0[p];
    mx[kPhases[p].key] = r.phase_max[p];
  }
  j["phase_ms_device0"] = d0;
  j["phase_ms_max"] = mx;
  j["peak_memory_bytes"] = r.peak_memory;
  j["loss_first"] = r.loss_first;
  j["loss_last"] = r.loss_last;
  j["trace"] = r.trace_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.trace_path);
  return j;
}

std::size_t max_other_memory(const Result& r) {
  std::size_t m = 0;
  for (std::size_t i = 1; i < r.peak_memory.size(); ++i) m = std::max(m, r.peak_memory[i]);
  return m;
}

void print_tables(const Args& a, const std::vector<Result>& results) {
  samples::Table t({"mode", "devices", "batch", "samples/s", "speedup", "efficiency", "ms/step",
                    "peak mem dev0", "peak mem max(others)"});
  for (auto& r : results)
    t.add({r.mode, std::to_string(r.devices), std::to_string(a.batch), samples::fmt(r.samples_per_s, 1),
           samples::fmt(r.speedup, 2) + "x", samples::fmt(100 * r.efficiency, 0) + "%",
           samples::fmt(1e3 * r.seconds / a.steps, 1), samples::format_bytes(r.peak_memory[0]),
           r.peak_memory.size() > 1 ? samples::format_bytes(max_other_memory(r)) : "-"});
  t.print(std::cout);
  std::cout << "\nper-step phases in ms, device 0 / max over devices "
               "(AR = DDP all-reduce: exp = exposed after backward, hid = hidden under backward)\n";
  std::vector<std::string> head{"mode", "devices"};
  for (auto& p : kPhases) head.push_back(p.column);
  samples::Table ph(head);
  for (auto& r : results) {
    std::vector<std::string> row{r.mode, std::to_string(r.devices)};
    for (int p = 0; p < kNumPhases; ++p)
      row.push_back(samples::fmt(r.phase_dev0[p], 1) + "/" + samples::fmt(r.phase_max[p], 1));
    ph.add(row);
  }
  ph.print(std::cout);
}

void write_csv(const Args& a, const std::vector<Result>& results) {
  std::ofstream f(a.csv);
  if (!f) throw std::runtime_error("--csv: cannot open '" + a.csv + "' for writing");
  f << "model,mode,devices,global_batch,steps,samples_per_s,speedup,efficiency";
  for (auto& p : kPhases) f << "," << p.key << "_ms_dev0," << p.key << "_ms_max";
  f << ",peak_mem_dev0_bytes,peak_mem_max_other_bytes,loss_first,loss_last\n";
  for (auto& r : results) {
    f << a.model << "," << r.mode << "," << r.devices << "," << a.batch << "," << a.steps << ","
      << r.samples_per_s << "," << r.speedup << "," << r.efficiency;
    for (int p = 0; p < kNumPhases; ++p) f << "," << r.phase_dev0[p] << "," << r.phase_max[p];
    f << "," << r.peak_memory[0] << "," << max_other_memory(r) << "," << r.loss_first << "," << r.loss_last
      << "\n";
  }
  if (!f) throw std::runtime_error("--csv: writing '" + a.csv + "' failed");
}

// Charts through gnuplot: throughput vs devices per mode, and stacked phase bars.
void write_plots(const Args& a, const std::vector<Result>& results) {
  fs::create_directories(a.plot_dir);
  fs::path dir(a.plot_dir);
  double single = 0;
  std::map<int, std::pair<double, double>> by_n;  // devices → (DP, DDP) samples/s
  for (auto& r : results) {
    if (r.mode == "single") single = r.samples_per_s;
    if (r.mode == "DP") by_n[r.devices].first = r.samples_per_s;
    if (r.mode == "DDP") by_n[r.devices].second = r.samples_per_s;
  }
  {
    std::ofstream f(dir / "throughput.dat");
    f << "# devices DP DDP single\n";
    for (auto& [n, v] : by_n) f << n << " " << v.first << " " << v.second << " " << single << "\n";
  }
  {
    // Critical-path phases only: the hidden all-reduce overlaps backward.
    std::ofstream f(dir / "phases.dat");
    f << "config";
    for (int p = 0; p < kNumPhases; ++p)
      if (kPhases[p].phase != Phase::AllReduceHidden) f << " " << kPhases[p].key;
    f << "\n";
    for (auto& r : results) {
      f << r.mode << "-" << r.devices;
      for (int p = 0; p < kNumPhases; ++p)
        if (kPhases[p].phase != Phase::AllReduceHidden) f << " " << r.phase_dev0[p];
      f << "\n";
    }
  }
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::cerr << "note: gnuplot is not installed, so no PNG charts were drawn; the data is in "
              << (dir / "throughput.dat") << " and " << (dir / "phases.dat")
              << " (apt-get install gnuplot to get the charts)\n";
    return;
  }
  std::string title = a.model + ", global batch " + std::to_string(a.batch) + ", " + samples::device_kind();
  fs::path script = dir / "charts.gp";
  {
    std::ofstream g(script);
    g << "set terminal pngcairo size 900,540 noenhanced\n"
      << "set datafile commentschars '#'\n"
      << "set output '" << (dir / "throughput.png").string() << "'\n"
      << "set title 'Throughput vs devices (" << title << ")'\n"
      << "set xlabel 'devices'\nset ylabel 'samples/s'\nset xtics 1\nset grid\nset key left top\n"
      << "set yrange [0:*]\n"
      << "plot '" << (dir / "throughput.dat").string() << "' using 1:2 with linespoints lw 2 pt 7 title 'DP', "
      << "'' using 1:3 with linespoints lw 2 pt 5 title 'DDP', "
      << "'' using 1:4 with lines dt 2 lw 2 title 'single device (no wrapper)'\n"
      << "set output '" << (dir / "phases.png").string() << "'\n"
      << "set title 'Per-step phases on device 0, critical path (" << title << ")'\n"
      << "unset xlabel\nset ylabel 'ms per step'\nset xtics rotate by -30\nset key outside right\n"
      << "set style data histograms\nset style histogram rowstacked\n"
      << "set style fill solid 0.85 border -1\nset boxwidth 0.7\n"
      << "plot for [i=2:" << kNumPhases << "] '" << (dir / "phases.dat").string()
      << "' using i:xtic(1) title columnheader(i)\n";
  }
  std::string cmd = "gnuplot '" + script.string() + "'";
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("gnuplot failed on " + script.string());
  if (!a.json) std::cout << "\ncharts: " << (dir / "throughput.png").string() << ", " << (dir / "phases.png").string() << "\n";
}

int run(const Args& a, const std::vector<int>& counts) {
  std::int64_t params = samples::make_model(a.model, a.seed)->parameters().set()->numel();
  if (!a.json) {
    std::cout << "dp_vs_ddp: model " << a.model << " (" << params << " parameters, "
              << samples::format_bytes(4.0 * params) << " of gradients), global batch " << a.batch << ", "
              << a.steps << " timed steps after " << a.warmup << " warm-up, "
              << (a.path == "worker" ? "model.forward_backward(x, y, loss)" : "loss(model(x)).backward()")
              << ", SGD(lr " << a.lr << ", momentum 0.9), seed " << a.seed << "\n"
              << "devices: " << samples::device_kind() << ", " << dp::hardware_concurrency()
              << " hardware threads\n\n";
  }
  auto batches = samples::synthetic_batches(samples::example_shape(a.model), a.batch, 4, a.seed);
  if (!a.trace_dir.empty()) fs::create_directories(a.trace_dir);
  std::vector<Result> results;
  auto finish = [&](Result r) {
    r.samples_per_s = a.batch * a.steps / r.seconds;
    double base = results.empty() ? r.samples_per_s : results.front().samples_per_s;
    r.speedup = r.samples_per_s / base;
    r.efficiency = r.speedup / r.devices;
    if (a.json) std::cout << to_json(a, r).dump() << std::endl;
    else std::cerr << "  done: " << r.mode << " on " << r.devices << " device(s), " << samples::fmt(r.samples_per_s, 1) << " samples/s\n";
    results.push_back(std::move(r));
  };
  finish(run_single(a, batches));
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP})
    for (int n : counts) finish(run_parallel(a, mode, n, batches));
  if (!a.json) print_tables(a, results);
  if (!a.csv.empty()) write_csv(a, results);
  if (!a.plot_dir.empty()) write_plots(a, results);
  if (!a.trace_dir.empty() && !a.json)
    std::cout << "\ntraces: " << a.trace_dir << "/trace_*.json (open in https://ui.perfetto.dev or chrome://tracing)\n";
  for (auto& r : results)
    if (!std::isfinite(r.loss_first) || !std::isfinite(r.loss_last)) {
      std::cerr << "error: non-finite loss in " << r.mode << " on " << r.devices << " device(s)\n";
      return 1;
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Single device, DP and DDP side by side on 1..N devices: throughput, scaling, "
               "phase breakdown, memory; synthetic data, fixed seeds."};
  Args a;
  app.add_option("--model", a.model, "cnn (Fashion-MNIST CNN), mlp (784-1024-1024-10) or resnet18 (CIFAR)")
      ->check(CLI::IsMember({"cnn", "mlp", "resnet18"}))
      ->capture_default_str();
  app.add_option("--devices", a.devices,
                 "N (device counts 1..N) or a list of counts like 1,2,4; default: every visible GPU, "
                 "or on CPU virtual devices min(4, max(2, cores))");
  app.add_option("--steps,--max-steps", a.steps, "timed steps per configuration")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed warm-up steps per configuration")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  app.add_option("--batch", a.batch, "global batch size (split over the devices)")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--seed", a.seed, "seed of the model and the data")->capture_default_str();
  app.add_option("--lr", a.lr, "SGD learning rate (momentum 0.9)")->check(CLI::Range(1e-9, 10.0))->capture_default_str();
  samples::add_path_option(app, a.path);
  app.add_flag("--json", a.json, "print one JSON object per configuration (one per line) instead of tables");
  app.add_option("--csv", a.csv, "also write the results as CSV to FILE");
  app.add_option("--trace", a.trace_dir, "write a Chrome/Perfetto trace per configuration into DIR");
  app.add_option("--trace-steps", a.trace_steps, "steps recorded in each trace (after the timed ones)")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--plot", a.plot_dir, "draw PNG charts into DIR (needs gnuplot)");
  CLI11_PARSE(app, argc, argv);

  try {
    int available = dp::device_count();
    std::vector<int> counts;
    if (a.devices.empty()) {
      int n = available;
      if (dp::default_device_type() == dp::DeviceType::CPU) {
        n = std::min({available, 4, std::max(2, dp::hardware_concurrency())});
        std::cerr << "note: no GPU visible: running on CPU virtual devices (each gets cores / devices "
                     "threads); default device counts 1.." << n << " (min(4, max(2, cores)) = " << n
                  << " on this machine with " << dp::hardware_concurrency()
                  << " hardware threads); pass --devices for others\n";
      }
      counts = samples::parse_device_counts(std::to_string(n), available);
    } else {
      counts = samples::parse_device_counts(a.devices, available);
    }
    if (a.batch < counts.back())
      throw std::invalid_argument("--batch " + std::to_string(a.batch) + " is smaller than " +
                                  std::to_string(counts.back()) + " devices; use a batch of at least one row per device");
    return run(a, counts);
  } catch (const std::invalid_argument& e) {
    std::cerr << "error: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
