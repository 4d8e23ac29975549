// samples/teach — a narrated walk through one DP step and one DDP step.
//
// The same Fashion-MNIST CNN, the same batch, the same devices (4 CPU virtual devices,
// or the GPUs present): one iteration in each design, traced, then told phase by
// phase — what moves where (tensor names, shapes, bytes, device → device) and when
// (times from model.trace() and model.stats()) — and why the two designs move the
// bytes they do. Both designs end with identical parameters.
//
//   teach                    # narration on stdout
//   teach --trace teach.json # plus a Perfetto trace: DP and DDP as two processes
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/models.h"
#include "common/util.h"
#include "dp/dp.h"

namespace {

using dp::parallel::TraceEvent;
using samples::fmt;
using samples::format_bytes;

struct ParamInfo {
  std::string name;
  dp::Shape shape;
  std::int64_t offset = 0, numel = 0;
};

// Parameters in flat-buffer order: name, shape, element offset.
std::vector<ParamInfo> param_infos(dp::nn::Module& net) {
  auto named = net.named_parameters();
  auto set = net.parameter_set();
  std::vector<ParamInfo> out;
  for (std::size_t i = 0; i < named.size(); ++i)
    out.push_back({named[i].first, named[i].second.shape(), set->slots()[i]->offset, named[i].second.numel()});
  return out;
}

// What one traced iteration recorded, per track.
struct Timeline {
  std::vector<TraceEvent> events;
  double origin_us = 0;  // the iteration's start
  // Events on `track` named `name` (exact) or starting with `name` when prefix.
  std::vector<TraceEvent> find(const std::string& track, const std::string& name, bool prefix = false) const {
    std::vector<TraceEvent> out;
    for (auto& e : events)
      if (e.track == track && (prefix ? e.name.rfind(name, 0) == 0 : e.name == name)) out.push_back(e);
    return out;
  }
  double ms(const std::string& track, const std::string& name) const {
    double t = 0;
    for (auto& e : find(track, name)) t += e.dur_us;
    return t / 1e3;
  }
  // Start and end of the first such event, in ms since the iteration began (-1: none).
  std::pair<double, double> when(const std::string& track, const std::string& name) const {
    auto ev = find(track, name);
    if (ev.empty()) return {-1, -1};
    return {(ev[0].start_us - origin_us) / 1e3, (ev[0].start_us + ev[0].dur_us - origin_us) / 1e3};
  }
};

struct Narrator {
  bool json = false;
  std::vector<std::string> lines;
  void say(const std::string& s) {
    lines.push_back(s);
    if (!json) std::cout << s << "\n";
  }
};

std::string device_list(const std::vector<dp::Device>& devs, std::size_t from = 0) {
  // "cpu:1,2,3"
  std::string s;
  for (std::size_t i = from; i < devs.size(); ++i)
    s += (i == from ? devs[i].str() : "," + std::to_string(devs[i].index));
  return s;
}

std::string worker(const dp::Device& d) { return "worker " + d.str(); }
std::string comm(const dp::Device& d) { return "comm " + d.str(); }

// "cpu:0 12.1 ms, cpu:1 11.8 ms, ..." for one phase on every worker.
std::string per_device(const Timeline& tl, const std::vector<dp::Device>& devs, const std::string& phase) {
  std::string s;
  for (auto& d : devs) s += (s.empty() ? "" : ", ") + d.str() + " " + fmt(tl.ms(worker(d), phase), 1) + " ms";
  return s;
}

struct Run {
  std::shared_ptr<dp::nn::Module> net;
  Timeline tl;
  double loss = 0;
  double iteration_ms = 0;
  dp::parallel::Stats stats;
  std::vector<std::pair<std::int64_t, std::int64_t>> buckets;
  std::vector<float> params;  // after the traced step
};

dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); }

// One warm-up iteration (untraced: first touches of memory and threads), then one
// traced iteration.
Run run(dp::Mode mode, const std::vector<dp::Device>& devs, const dp::data::Batch& warm,
        const dp::data::Batch& batch) {
  Run r;
  r.net = samples::fashion_cnn(/*seed=*/7);
  dp::DataParallel model(r.net, devs, {.mode = mode});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.05, .momentum = 0.9});
  auto step = [&](const dp::data::Batch& b) {
    opt.zero_grad();
    dp::Tensor loss = model.forward_backward(b.data, b.target, loss_fn);
    opt.step();
    return loss.item();
  };
  step(warm);
  model.reset_stats();
  model.trace().clear();
  model.trace().enable(true);
  auto t0 = dp::parallel::Trace::Clock::now();
  r.loss = step(batch);
  auto t1 = dp::parallel::Trace::Clock::now();
  model.trace().record("main", "iteration", t0, t1);
  model.trace().enable(false);
  r.iteration_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  r.tl.events = model.trace().events();
  r.tl.origin_us = r.tl.find("main", "iteration")[0].start_us;
  r.stats = model.stats();
  r.buckets = model.buckets();
  for (auto& [name, t] : r.net->state_dict()) {
    if (t.dtype() != dp::Dtype::Float32) continue;
    auto v = t.to_vector();
    r.params.insert(r.params.end(), v.begin(), v.end());
  }
  return r;
}

void narrate_dp(Narrator& n, const Run& r, const std::vector<ParamInfo>& params, const std::vector<dp::Device>& devs,
                const dp::data::Batch& batch, double P) {
  const std::size_t N = devs.size();
  const auto& tl = r.tl;
  n.say("== DP (dp::Mode::DP): one iteration on " + std::to_string(N) + " devices ==");
  n.say("Device 0 owns the only trained copy of the parameters. Each iteration it lends them out,");
  n.say("collects the gradients back, and steps alone.");
  n.say("");
  n.say("1. replicate — device 0's parameters changed at the last optimizer step, so they are copied");
  n.say("   to every replica again: ONE broadcast of the flat parameter buffer (" + format_bytes(P) +
        "), whose views are:");
  for (auto& p : params)
    n.say("     replicate: " + p.name + " " + samples::shape_text(p.shape) + " " + std::to_string(p.numel * 4) +
          " B " + devs[0].str() + " → " + device_list(devs, 1));
  n.say("   " + std::to_string(N - 1) + " copies × " + format_bytes(P) + " = " + format_bytes((N - 1) * P) +
        " out of " + devs[0].str() + "; time per worker: " + per_device(tl, devs, "replicate"));
  auto x = batch.data;
  std::int64_t rows = x.size(0), shard = (rows + N - 1) / N;
  dp::Shape sshape = x.shape();
  sshape[0] = shard;
  n.say("2. scatter — x " + samples::shape_text(x.shape()) + " (" + format_bytes(x.nbytes()) +
        ") split along dim 0 into " + std::to_string(N) + " shards " + samples::shape_text(sshape) + " (" +
        format_bytes(x.nbytes() / double(N)) + " each), labels likewise: " + devs[0].str() + " → " +
        device_list(devs) + "; " + per_device(tl, devs, "scatter"));
  n.say("3. forward + loss — every worker thread runs the module on its shard at the same time, reading");
  n.say("   its replica's parameters (same module object, per-thread binding): " + per_device(tl, devs, "forward"));
  n.say("4. backward — each worker walks its own autograd tape; each replica's gradient lands in that");
  n.say("   device's flat gradient buffer: " + per_device(tl, devs, "backward"));
  auto [bwd0_start, bwd0_end] = tl.when(worker(devs[0]), "backward");
  auto [red_start, red_end] = tl.when(worker(devs[0]), "reduce");
  double last_bwd_end = 0;
  for (auto& d : devs) last_bwd_end = std::max(last_bwd_end, tl.when(worker(d), "backward").second);
  if (N > 1) {
    std::string order;
    for (auto& d : devs) order += (order.empty() ? "" : " + ") + d.str();
    n.say("5. DP reduce: " + std::to_string(N) + " gradient buffers (" + format_bytes(P) + " each) summed onto " +
          devs[0].str() + " in device order (" + order + "), so the sum is bitwise the same every run.");
    n.say("   It needs EVERY replica's gradient: backward ended on " + devs[0].str() + " at +" + fmt(bwd0_end, 1) +
          " ms and on the slowest device at +" + fmt(last_bwd_end, 1) + " ms; the reduce on " + devs[0].str() +
          " began at +" + fmt(red_start, 1) + " ms, waited for the others and ended at +" + fmt(red_end, 1) +
          " ms. No gradient moved while backward ran.");
    n.say("   " + std::to_string(N - 1) + " gradient buffers × " + format_bytes(P) + " = " +
          format_bytes((N - 1) * P) + " into " + devs[0].str() + ".");
  }
  n.say("6. step — the optimizer updates " + devs[0].str() + "'s parameters only (" +
        fmt(tl.ms(worker(devs[0]), "step"), 2) + " ms); replicas hold nothing worth keeping: they are");
  n.say("   refreshed by step 1 of the next iteration.");
  n.say("   Whole iteration: " + fmt(r.iteration_ms, 1) + " ms, loss " + fmt(r.loss, 4) + ".");
  n.say("");
}

void narrate_ddp(Narrator& n, const Run& r, const std::vector<ParamInfo>& params, const std::vector<dp::Device>& devs,
                 double P, bool has_buffers, nlohmann::json& jbuckets) {
  const std::size_t N = devs.size();
  const auto& tl = r.tl;
  n.say("== DDP (dp::Mode::DDP): one iteration on " + std::to_string(N) + " devices ==");
  n.say("Every device keeps its own persistent replica and its own optimizer state. Only gradients");
  n.say("move, and they move while backward is still running.");
  n.say("");
  n.say("0. once, at construction: " + device_list(devs, 1) + " each received a full copy (" + format_bytes(P) +
        ") — never again per step.");
  if (has_buffers)
    n.say("1. broadcast buffers — BatchNorm running statistics copied from " + devs[0].str() + ": " +
          per_device(tl, devs, "replicate"));
  else
    n.say("1. broadcast buffers — this model has no buffers (no BatchNorm), so by design nothing moves.");
  double repl = 0;
  for (auto& d : devs) repl = std::max(repl, tl.ms(worker(d), "replicate"));
  if (!has_buffers && repl > 0)
    n.say("   (Measured: this build of dp still broadcast " + devs[0].str() + "'s parameters to the replicas (up to " +
          fmt(repl, 1) + " ms per worker) — the optimizer step bumps the parameter version and DataParallel\n"
          "   re-syncs on it; DDP needs no such copy: its replicas took identical steps. A library issue.)");
  n.say("2. scatter, 3. forward — exactly as in DP: " + per_device(tl, devs, "forward") + " (forward)");
  n.say("4. backward — " + per_device(tl, devs, "backward"));
  n.say("   Gradients are grouped in " + std::to_string(r.buckets.size()) +
        " bucket(s): slices of the flat gradient buffer in REVERSE registration order (backward");
  n.say("   produces the last layer's gradients first), a small first bucket so communication starts");
  n.say("   early, then up to 25 MB each. A device's comm thread all-reduces a bucket as soon as every");
  n.say("   gradient in it is ready, while its worker goes on with backward:");
  for (std::size_t b = 0; b < r.buckets.size(); ++b) {
    auto [lo, hi] = r.buckets[b];
    std::vector<std::string> names;
    for (auto it = params.rbegin(); it != params.rend(); ++it)
      if (it->offset >= lo && it->offset + it->numel <= hi) names.push_back(it->name);
    std::string list;
    for (auto& s : names) list += (list.empty() ? "" : ", ") + s;
    double bytes = 4.0 * (hi - lo);
    // Per device: how much of the bucket's all-reduce ran before that device's backward ended.
    double overlap = 1e300, exposed = 0, start = 1e300, end = 0;
    bool found = true;
    for (auto& d : devs) {
      auto [s, e] = tl.when(comm(d), "allreduce bucket " + std::to_string(b));
      auto bwd_end = tl.when(worker(d), "backward").second;
      if (s < 0) {
        found = false;
        break;
      }
      overlap = std::min(overlap, std::max(0.0, std::min(e, bwd_end) - s));
      exposed = std::max(exposed, std::max(0.0, e - std::max(s, bwd_end)));
      start = std::min(start, s);
      end = std::max(end, e);
    }
    std::string head = "DDP bucket " + std::to_string(b) + " (params " + list + "; " + format_bytes(bytes) + ")";
    if (!found) {
      n.say("   " + head + ": not all-reduced (one device)");
      continue;
    }
    std::string when = overlap > 0 ? "while backward still ran (overlap " + fmt(overlap, 1) + " ms" +
                                         (exposed > 0 ? ", then " + fmt(exposed, 1) + " ms after it" : "") + ")"
                                   : "after backward had finished (" + fmt(exposed, 1) + " ms exposed)";
    n.say("   " + head + " all-reduced on all " + std::to_string(N) + " devices " + when + ", +" + fmt(start, 1) +
          " → +" + fmt(end, 1) + " ms; each device sent and received 2(N-1)/N × " + format_bytes(bytes) + " = " +
          format_bytes(2.0 * (N - 1) / N * bytes));
    jbuckets.push_back({{"index", b},
                        {"params", names},
                        {"bytes", bytes},
                        {"start_ms", start},
                        {"end_ms", end},
                        {"overlap_ms", overlap},
                        {"exposed_ms", exposed}});
  }
  double hidden = 0, exp = 0;
  for (auto& d : r.stats.devices) {
    hidden = std::max(hidden, d[dp::parallel::Phase::AllReduceHidden]);
    exp = std::max(exp, d[dp::parallel::Phase::AllReduceExposed]);
  }
  n.say("   stats(): all-reduce hidden under backward up to " + fmt(hidden, 1) + " ms, exposed (backward done,");
  n.say("   waiting for the last bucket) up to " + fmt(exp, 1) + " ms per device.");
  n.say("5. step — every device applies the same summed gradient to its own replica with its own momentum");
  n.say("   buffer, concurrently: " + per_device(tl, devs, "step") + ".");
  n.say("   Whole iteration: " + fmt(r.iteration_ms, 1) + " ms, loss " + fmt(r.loss, 4) + ".");
  n.say("");
}

void write_trace(const std::string& path, const Run& dpr, const Run& ddpr) {
  nlohmann::json events = nlohmann::json::array();
  int pid = 1;
  for (const Run* r : {&dpr, &ddpr}) {
    events.push_back({{"ph", "M"}, {"pid", pid}, {"name", "process_name"},
                      {"args", {{"name", pid == 1 ? "DP iteration" : "DDP iteration"}}}});
    std::map<std::string, int> tids;
    for (auto& e : r->tl.events) tids.emplace(e.track, 0);
    int tid = 1;
    for (auto& [track, t] : tids) {
      t = tid++;
      events.push_back({{"ph", "M"}, {"pid", pid}, {"tid", t}, {"name", "thread_name"}, {"args", {{"name", track}}}});
    }
    for (auto& e : r->tl.events) {
      nlohmann::json args = nlohmann::json::object();
      if (!e.args.empty()) args = nlohmann::json::parse("{" + e.args + "}", nullptr, false);
      events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", tids[e.track]}, {"name", e.name},
                        {"ts", e.start_us - r->tl.origin_us}, {"dur", e.dur_us}, {"args", args}});
    }
    ++pid;
  }
  std::ofstream f(path);
  f << nlohmann::json{{"displayTimeUnit", "ms"}, {"traceEvents", events}}.dump() << "\n";
  if (!f) throw std::runtime_error("--trace: cannot write '" + path + "'");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A narrated walk through one DP step and one DDP step: what moves where, and when."};
  int ndev = 0;
  std::int64_t batch_size = 64;
  bool json = false;
  std::string trace_path;
  app.add_option("--devices", ndev, "number of devices (default: 4 CPU virtual devices, or every GPU)")
      ->check(CLI::Range(2, 1024));
  app.add_option("--batch", batch_size, "global batch size")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_flag("--json", json, "print one JSON object (the narration and the figures) instead of text");
  app.add_option("--trace", trace_path, "write a Perfetto/Chrome trace of both iterations to FILE");
  CLI11_PARSE(app, argc, argv);

  try {
    int available = dp::device_count();
    if (ndev == 0) ndev = dp::default_device_type() == dp::DeviceType::CUDA ? available : std::min(4, available);
    if (ndev > available || ndev < 2)
      throw std::invalid_argument("--devices " + std::to_string(ndev) + ": " + std::to_string(available) + " " +
                                  samples::device_kind() + " device(s) visible, at least 2 needed");
    if (batch_size < ndev)
      throw std::invalid_argument("--batch " + std::to_string(batch_size) + " is smaller than " +
                                  std::to_string(ndev) + " devices");
    auto devs = samples::first_devices(ndev);
    auto data = samples::synthetic_batches({1, 28, 28}, batch_size, 2, /*seed=*/3);

    Narrator n;
    n.json = json;
    Run dpr = run(dp::Mode::DP, devs, data[0], data[1]);
    Run ddpr = run(dp::Mode::DDP, devs, data[0], data[1]);
    auto params = param_infos(*dpr.net);
    double P = 0;
    for (auto& p : params) P += 4.0 * p.numel;
    const double N = ndev;

    n.say("teach: the Fashion-MNIST CNN on " + std::to_string(ndev) + " " +
          (samples::device_kind() == "cpu" ? "CPU virtual devices (no GPU here: each has its own memory, worker "
                                             "thread and share of the cores)"
                                           : "GPUs") +
          ", global batch " + std::to_string(batch_size) + ".");
    n.say("Its " + std::to_string(params.size()) + " parameter tensors live in ONE flat buffer per device: P = " +
          format_bytes(P) + " of parameters, and as much again of gradients.");
    n.say("Each design runs one warm-up iteration, then one traced iteration from the same state on the");
    n.say("same batch. Times are milliseconds since the traced iteration began (+t) or durations.");
    n.say("");
    narrate_dp(n, dpr, params, devs, data[1], P);
    bool has_buffers = !dpr.net->named_buffers().empty();
    nlohmann::json jbuckets = nlohmann::json::array();
    narrate_ddp(n, ddpr, params, devs, P, has_buffers, jbuckets);

    double diff = 0;
    for (std::size_t i = 0; i < dpr.params.size(); ++i)
      diff = std::max(diff, double(std::abs(dpr.params[i] - ddpr.params[i])));
    double dp_bytes_dev0 = 2 * (N - 1) * P, ddp_bytes_dev = 2 * (N - 1) / N * P;
    n.say("== Bytes moved per iteration, from first principles (N = " + std::to_string(ndev) +
          " devices, P = " + format_bytes(P) + ") ==");
    n.say("DP : broadcast parameters (N-1)·P = " + format_bytes((N - 1) * P) + " + reduce gradients (N-1)·P = " +
          format_bytes((N - 1) * P) + ", ALL through " + devs[0].str() + ": " + format_bytes(dp_bytes_dev0) +
          " per iteration on one device's link,");
    n.say("     growing linearly with N; and the reduce can only start after the slowest backward.");
    n.say("DDP: no parameter broadcast (replicas persist and take identical steps); ring all-reduce of the");
    n.say("     gradients: each device sends (and receives) 2(N-1)/N·P = " + format_bytes(ddp_bytes_dev) +
          ": reduce-scatter (N-1 chunks of P/N) then all-gather (N-1 chunks), nearly constant in N and spread");
    n.say("     evenly over all devices — no hub — and bucket by bucket while backward is still running.");
    n.say("Measured here: DP iteration " + fmt(dpr.iteration_ms, 1) + " ms, DDP iteration " +
          fmt(ddpr.iteration_ms, 1) + " ms.");
    n.say("Same result: both designs scale each shard's loss so the SUM over devices is the full-batch mean");
    n.say("and sum in the same device order, so after the step the parameters agree: max |DP − DDP| = " +
          (diff == 0 ? std::string("0 (bitwise identical)") : fmt(diff, 9)) + ".");
    if (!trace_path.empty()) {
      write_trace(trace_path, dpr, ddpr);
      n.say("Trace: " + trace_path + " (open in https://ui.perfetto.dev: one track per worker and comm thread).");
    }
    if (json) {
      auto phases = [&](const Run& r) {
        nlohmann::json j = nlohmann::json::array();
        for (auto& d : r.stats.devices) {
          nlohmann::json pd{{"device", d.device.str()}, {"peak_memory_bytes", d.peak_memory_bytes}};
          for (int p = 0; p < static_cast<int>(dp::parallel::Phase::kCount); ++p)
            pd[dp::parallel::phase_name(static_cast<dp::parallel::Phase>(p))] = d.ms[p];
          j.push_back(pd);
        }
        return j;
      };
      nlohmann::json out{{"sample", "teach"},
                         {"devices", ndev},
                         {"global_batch", batch_size},
                         {"param_bytes", P},
                         {"dp", {{"loss", dpr.loss},
                                 {"iteration_ms", dpr.iteration_ms},
                                 {"bytes_through_device0", dp_bytes_dev0},
                                 {"phase_ms", phases(dpr)}}},
                         {"ddp", {{"loss", ddpr.loss},
                                  {"iteration_ms", ddpr.iteration_ms},
                                  {"bytes_per_device", ddp_bytes_dev},
                                  {"buckets", jbuckets},
                                  {"phase_ms", phases(ddpr)}}},
                         {"max_param_diff", diff},
                         {"trace", trace_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(trace_path)},
                         {"narration", n.lines}};
      std::cout << out.dump() << "\n";
    }
  } catch (const std::invalid_argument& e) {
    std::cerr << "error: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
