// samples/teach — a narrated walk through a DP step, a DDP step, a Sharded step
// (ZeRO stage 1 or 2) and a stage-3 step.
//
// The same model (the Fashion-MNIST CNN, or with --model gpt a GPT of 6 transformer
// blocks whose Sharded gather units are its blocks), the same batch, the same devices (min(4, hardware
// threads) CPU virtual devices, or the GPUs present): a few iterations in each design,
// traced, and the median one told phase by phase — what moves where (tensor names,
// shapes, bytes, device → device) and when (times from model.trace() and
// model.stats()) — and why each design moves the bytes it does. The byte counts are
// derived from first principles and checked against what the run reports (buckets,
// shard ranges, the bytes recorded with each collective; in stage 3 the gather units,
// the bytes each gather pulls and the allocator's count per device between steps).
// The designs end with identical parameters.
//
// With --precision bf16 every design's forward and loss run under dp::amp::autocast, and
// the DDP step is told once more for what is bfloat16 and what stays float32 in each
// phase, and why; with --reduce-dtype bf16|fp16 an extra DDP run puts the gradients on
// the wire in 16 bits, and the bytes it moved are set against the float32 wire's.
//
//   teach                          # narration on stdout
//   teach --iterations 9           # more iterations: a steadier median
//   teach --trace teach.json       # plus a Perfetto trace: one process per design
//   teach --precision bf16 --reduce-dtype bf16   # plus a bf16 DDP step, phase by phase
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/models.h"
#include "common/options.h"
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
  for (std::size_t i = from; i < devs.size(); ++i) {
    if (i > from) s += ',';
    s += i == from ? devs[i].str() : std::to_string(devs[i].index);
  }
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

// One traced iteration.
struct Iteration {
  Timeline tl;
  double loss = 0;
  double ms = 0;
  dp::parallel::Stats stats;
};

struct Run {
  dp::Mode mode = dp::Mode::DP;
  std::shared_ptr<dp::nn::Module> net;
  std::vector<Iteration> iters;
  std::size_t median = 0;  // index into iters of the median iteration
  std::vector<std::pair<std::int64_t, std::int64_t>> buckets;
  std::vector<std::pair<std::int64_t, std::int64_t>> shards;
  int stage = 0;
  std::vector<float> params;  // after the last iteration
  // Stage 3: the gather units ([lo, hi) of the flat buffers, one per top-level child
  // with parameters) and the allocator's counts per device, less what the device held
  // before the run was built: between steps (after the last iteration) and the peak
  // of the median iteration.
  std::vector<std::pair<std::int64_t, std::int64_t>> units;
  std::vector<double> between_bytes, peak_bytes;
  // What the loss function saw on the workers (every call of every traced iteration):
  // the dtypes of the logits it was given and of the loss it returned.
  std::set<std::string> logits_dtypes, loss_dtypes;
  int loss_calls = 0;
  // DDP: the optimizer's state after the last iteration, as state_dict() shows it (copy
  // 0): its dtypes and bytes; and, element by element in parameters() order, the
  // momentum the last step applied and the parameter it left (p_after = p_before - lr·m).
  std::set<std::string> state_dtypes;
  double state_bytes = 0;
  std::vector<float> momentum, params_after;

  const Iteration& med() const { return iters[median]; }
  std::vector<double> times() const {
    std::vector<double> t;
    for (auto& it : iters) t.push_back(it.ms);
    return t;
  }
};

// Cross-entropy; the GPT's (B, T, V) logits and (B, T) targets count every token.
dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) {
  if (out.dim() == 3) return dp::nn::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  return dp::nn::cross_entropy(out, y);
}

// One warm-up iteration (untraced: first touches of memory and threads), then
// `iterations` traced ones on the same batch; the median one is narrated.
// The learning rate of every run's SGD (momentum 0.9).
constexpr double kLr = 0.05;

// How a run computes: --precision (the autocast scope of its forward and loss) and
// --reduce-dtype (DataParallelOptions::mixed_precision).
struct Precision {
  std::string compute = "fp32";  // fp32 | bf16
  std::string wire = "fp32";     // fp32 | bf16 | fp16
};

Run run(const std::string& model_name, dp::Mode mode, int stage, const std::vector<dp::Device>& devs,
        const dp::data::Batch& warm, const dp::data::Batch& batch, int iterations, const Precision& precision) {
  Run r;
  r.mode = mode;
  std::vector<std::size_t> base;
  for (const dp::Device& d : devs) base.push_back(dp::memory_allocated(d));
  r.net = samples::make_model(model_name, /*seed=*/7);
  dp::DataParallelOptions opts{.mode = mode, .mixed_precision = samples::mixed_precision_of(precision.wire)};
  if (mode == dp::Mode::Sharded) {
    opts.shard_stage = stage;
    opts.shard_unit = samples::shard_unit(model_name);  // the GPT: a gather unit per transformer block
  }
  dp::DataParallel model(r.net, devs, opts);
  dp::optim::SGD opt(model.parameters(), {.lr = kLr, .momentum = 0.9});
  std::mutex seen_mu;  // the workers call the loss concurrently
  bool recording = false;
  auto loss = [&](const dp::Tensor& out, const dp::Tensor& y) {
    dp::Tensor l = loss_fn(out, y);
    if (recording) {
      std::lock_guard<std::mutex> lock(seen_mu);
      r.logits_dtypes.insert(dp::dtype_name(out.dtype()));
      r.loss_dtypes.insert(dp::dtype_name(l.dtype()));
      ++r.loss_calls;
    }
    return l;
  };
  auto step = [&](const dp::data::Batch& b) {
    opt.zero_grad();
    dp::Tensor l;
    {
      // DataParallel carries the autocast scope to every worker (Note [Autocast op policy]).
      const dp::amp::autocast scope = samples::precision_scope(precision.compute);
      l = model.forward_backward(b.data, b.target, loss);
    }
    opt.step();
    return l.item();
  };
  step(warm);
  recording = true;
  for (int k = 0; k < iterations; ++k) {
    Iteration it;
    model.reset_stats();
    model.trace().clear();
    model.trace().enable(true);
    auto t0 = dp::parallel::Trace::Clock::now();
    it.loss = step(batch);
    auto t1 = dp::parallel::Trace::Clock::now();
    model.trace().record("main", "iteration", t0, t1);
    model.trace().enable(false);
    it.ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    it.tl.events = model.trace().events();
    it.tl.origin_us = it.tl.find("main", "iteration")[0].start_us;
    it.stats = model.stats();
    r.iters.push_back(std::move(it));
  }
  std::vector<std::size_t> order(r.iters.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](auto a, auto b) { return r.iters[a].ms < r.iters[b].ms; });
  r.median = order[order.size() / 2];
  r.buckets = model.buckets();
  r.shards = model.shards();
  r.stage = model.shard_stage();
  // Read before anything touches the parameters: in stage 3 that gathers device 0's copy.
  for (std::size_t d = 0; d < devs.size(); ++d) {
    r.between_bytes.push_back(static_cast<double>(dp::memory_allocated(devs[d])) - static_cast<double>(base[d]));
    r.peak_bytes.push_back(static_cast<double>(r.med().stats.devices[d].peak_memory_bytes) -
                           static_cast<double>(base[d]));
  }
  r.units = model.units();
  if (mode == dp::Mode::DDP) {
    const auto params = r.net->parameters();
    for (auto& [name, t] : opt.state_dict()) {
      if (name.rfind("state.", 0) != 0) continue;  // "step" is a counter, not per-element state
      r.state_dtypes.insert(dp::dtype_name(t.dtype()));
      r.state_bytes += static_cast<double>(t.nbytes());
      // "state.<i>.momentum_buffer": parameter i's momentum.
      const std::size_t i = std::stoul(name.substr(6, name.find('.', 6) - 6));
      const std::vector<float> m = t.to_vector(), p = params[i].to_vector();
      r.momentum.insert(r.momentum.end(), m.begin(), m.end());
      r.params_after.insert(r.params_after.end(), p.begin(), p.end());
    }
  }
  for (auto& [name, t] : r.net->state_dict()) {
    if (t.dtype() != dp::Dtype::Float32) continue;
    auto v = t.to_vector();
    r.params.insert(r.params.end(), v.begin(), v.end());
  }
  return r;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// "12.3 ms (min 11.9, max 14.0 over 5)"
std::string spread(const std::vector<double>& v) {
  auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return fmt(median_of(v), 1) + " ms (min " + fmt(*lo, 1) + ", max " + fmt(*hi, 1) + " over " +
         std::to_string(v.size()) + ")";
}

// The bytes a comm event recorded ("\"bytes\": 4096"), 0 when none.
double recorded_bytes(const TraceEvent& e) {
  auto pos = e.args.find("\"bytes\":");
  return pos == std::string::npos ? 0.0 : std::stod(e.args.substr(pos + 8));
}

// The parameters (by name) that overlap [lo, hi) of the flat buffer, marking partial ones.
std::string params_in(const std::vector<ParamInfo>& params, std::int64_t lo, std::int64_t hi, bool reverse) {
  std::vector<std::string> names;
  for (auto& p : params) {
    std::int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
    if (a >= b) continue;
    bool whole = a == p.offset && b == p.offset + p.numel;
    names.push_back(whole ? p.name
                          : p.name + "[" + std::to_string(a - p.offset) + ":" + std::to_string(b - p.offset) + "]");
  }
  if (reverse) std::reverse(names.begin(), names.end());
  std::string list;
  for (auto& n : names) list += (list.empty() ? "" : ", ") + n;
  return list.empty() ? "padding only" : list;
}

// How one bucket's collective went on every device: a fast device's comm thread starts
// as soon as ITS gradients are ready, but the collective cannot finish before the
// slowest device has joined — so the span splits into waiting for the others and the
// collective's own work after the last device joined.
struct BucketTiming {
  bool found = true;
  double first_start = 1e300, last_start = 0, end = 0;  // ms since the iteration began
  double overlap = 1e300;  // least time any device's collective ran under its own backward
  double exposed = 0;      // most time any device's collective ran after its backward ended
  double waiting() const { return last_start - first_start; }
  double work() const { return end - last_start; }
};

BucketTiming bucket_timing(const Timeline& tl, const std::vector<dp::Device>& devs, const std::string& event) {
  BucketTiming t;
  for (auto& d : devs) {
    auto [s, e] = tl.when(comm(d), event);
    auto bwd_end = tl.when(worker(d), "backward").second;
    if (s < 0) return BucketTiming{.found = false};
    t.overlap = std::min(t.overlap, std::max(0.0, std::min(e, bwd_end) - s));
    t.exposed = std::max(t.exposed, std::max(0.0, e - std::max(s, bwd_end)));
    t.first_start = std::min(t.first_start, s);
    t.last_start = std::max(t.last_start, s);
    t.end = std::max(t.end, e);
  }
  return t;
}

std::string timing_text(const BucketTiming& t) {
  std::string when = t.overlap > 0 ? "under backward (overlap " + fmt(t.overlap, 1) + " ms" +
                                         (t.exposed > 0 ? ", then " + fmt(t.exposed, 1) + " ms after it" : "") + ")"
                                   : "after backward had finished (" + fmt(t.exposed, 1) + " ms exposed)";
  return when + ", +" + fmt(t.first_start, 1) + " → +" + fmt(t.end, 1) + " ms: " + fmt(t.waiting(), 1) +
         " ms waiting until the slowest device joined, " + fmt(t.work(), 1) + " ms of collective after that";
}

void narrate_dp(Narrator& n, const Run& r, const std::vector<ParamInfo>& params, const std::vector<dp::Device>& devs,
                const dp::data::Batch& batch, double P) {
  const std::size_t N = devs.size();
  const auto& tl = r.med().tl;
  n.say("== DP (dp::Mode::DP): the median of " + std::to_string(r.iters.size()) + " iterations on " +
        std::to_string(N) + " devices ==");
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
  n.say("   " + devs[0].str() + " copies nothing itself, yet shows a replicate time: it is the source, so it");
  n.say("   waits until every replica has arrived and finished reading its buffer (which must not change");
  n.say("   before then); its time is the slowest copy plus the latest arrival.");
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
  n.say("   Iteration: " + spread(r.times()) + "; loss of the last " + fmt(r.iters.back().loss, 4) + ".");
  n.say("");
}

void narrate_ddp(Narrator& n, const Run& r, const std::vector<ParamInfo>& params, const std::vector<dp::Device>& devs,
                 double P, bool has_buffers, nlohmann::json& jbuckets) {
  const std::size_t N = devs.size();
  const auto& tl = r.med().tl;
  n.say("== DDP (dp::Mode::DDP): the median of " + std::to_string(r.iters.size()) + " iterations on " +
        std::to_string(N) + " devices ==");
  n.say("Every device keeps its own persistent replica and its own optimizer state. Only gradients");
  n.say("move, and they move while backward is still running.");
  n.say("");
  n.say("0. once, at construction: " + device_list(devs, 1) + " each received a full copy (" + format_bytes(P) +
        ") — never again per step.");
  if (has_buffers)
    n.say("1. broadcast buffers — BatchNorm running statistics copied from " + devs[0].str() + ": " +
          per_device(tl, devs, "replicate"));
  else
    n.say("1. broadcast buffers — this model has no buffers (no BatchNorm), so nothing moves.");
  n.say("2. scatter, 3. forward — exactly as in DP: " + per_device(tl, devs, "forward") + " (forward)");
  n.say("4. backward — " + per_device(tl, devs, "backward"));
  n.say("   Gradients are grouped in " + std::to_string(r.buckets.size()) +
        " bucket(s): slices of the flat gradient buffer in REVERSE registration order (backward");
  n.say("   produces the last layer's gradients first), a small first bucket so communication starts");
  n.say("   early, then up to 25 MB each. A device's comm thread all-reduces a bucket as soon as every");
  n.say("   gradient in it is ready on that device, while its worker goes on with backward:");
  double recorded = 0;
  for (auto& e : tl.events)
    if (e.track == comm(devs[0]) && e.name.rfind("allreduce bucket ", 0) == 0) recorded += recorded_bytes(e);
  for (std::size_t b = 0; b < r.buckets.size(); ++b) {
    auto [lo, hi] = r.buckets[b];
    double bytes = 4.0 * (hi - lo);
    std::string head = "DDP bucket " + std::to_string(b) + " (params " + params_in(params, lo, hi, true) + "; " +
                       format_bytes(bytes) + ")";
    auto t = bucket_timing(tl, devs, "allreduce bucket " + std::to_string(b));
    if (!t.found) {
      n.say("   " + head + ": not all-reduced (one device)");
      continue;
    }
    n.say("   " + head + " all-reduced " + timing_text(t) + "; each device sent and received 2(N-1)/N × " +
          format_bytes(bytes) + " = " + format_bytes(2.0 * (N - 1) / N * bytes));
    jbuckets.push_back({{"index", b},
                        {"params", params_in(params, lo, hi, true)},
                        {"bytes", bytes},
                        {"start_ms", t.first_start},
                        {"last_join_ms", t.last_start},
                        {"end_ms", t.end},
                        {"waiting_ms", t.waiting()},
                        {"overlap_ms", t.overlap},
                        {"exposed_ms", t.exposed}});
  }
  n.say("   A long bucket span is mostly waiting: the collective completes only when the slowest device");
  n.say("   has produced that bucket's gradients, so a device that finished backward early sits in it.");
  n.say("   The run recorded " + format_bytes(recorded) + " of gradient buckets on " + devs[0].str() +
        " (P = " + format_bytes(P) + ": every gradient byte is in exactly one bucket).");
  double hidden = 0, exp = 0;
  for (auto& d : r.med().stats.devices) {
    hidden = std::max(hidden, d[dp::parallel::Phase::AllReduceHidden]);
    exp = std::max(exp, d[dp::parallel::Phase::AllReduceExposed]);
  }
  n.say("   stats(): all-reduce hidden under backward up to " + fmt(hidden, 1) + " ms, exposed (backward done,");
  n.say("   waiting for the last bucket — including waiting for slower devices) up to " + fmt(exp, 1) +
        " ms per device.");
  n.say("5. step — every device applies the same summed gradient to its own replica with its own momentum");
  n.say("   buffer, concurrently: " + per_device(tl, devs, "step") + ".");
  n.say("   Iteration: " + spread(r.times()) + "; loss of the last " + fmt(r.iters.back().loss, 4) + ".");
  n.say("");
}

// Per-device bytes of the Sharded collectives, from the ranges and the parameter count.
struct ShardBytes {
  std::vector<double> owned;     // elements of real parameters in device r's range
  std::vector<double> rs_recv;   // reduce-scatter: the other devices' gradients for r's range
  std::vector<double> rs_send;   // reduce-scatter: r's gradients for the other ranges
  std::vector<double> ag_recv;   // all-gather: the other ranges (padded: equal lengths)
  std::vector<double> ag_send;   // all-gather: r's range to each other device
};

ShardBytes shard_bytes(const std::vector<std::pair<std::int64_t, std::int64_t>>& shards, std::int64_t elems) {
  ShardBytes b;
  const double N = static_cast<double>(shards.size());
  for (auto [lo, hi] : shards) {
    double own = static_cast<double>(std::max<std::int64_t>(0, std::min(hi, elems) - lo));
    double len = static_cast<double>(hi - lo);
    b.owned.push_back(own);
    b.rs_recv.push_back(4.0 * (N - 1) * own);
    b.rs_send.push_back(4.0 * (static_cast<double>(elems) - own));
    b.ag_recv.push_back(4.0 * (N - 1) * len);
    b.ag_send.push_back(4.0 * (N - 1) * len);
  }
  return b;
}

// Each reduce-scatter bucket of a Sharded run: its pieces, cut at the range
// boundaries, and when it ran. Returns the bytes of buckets recorded on device 0.
double narrate_reduce_scatter(Narrator& n, const Run& r, const std::vector<dp::Device>& devs, nlohmann::json& jbuckets) {
  const auto& tl = r.med().tl;
  double recorded = 0;
  for (auto& e : tl.events)
    if (e.track == comm(devs[0]) && e.name.rfind("reduce_scatter bucket ", 0) == 0) recorded += recorded_bytes(e);
  for (std::size_t b = 0; b < r.buckets.size(); ++b) {
    auto [lo, hi] = r.buckets[b];
    std::string pieces;
    for (std::size_t d = 0; d < r.shards.size(); ++d) {
      std::int64_t a = std::max(lo, r.shards[d].first), z = std::min(hi, r.shards[d].second);
      if (a < z) pieces += (pieces.empty() ? "" : ", ") + format_bytes(4.0 * (z - a)) + " → " + devs[d].str();
    }
    auto t = bucket_timing(tl, devs, "reduce_scatter bucket " + std::to_string(b));
    std::string head = "   bucket " + std::to_string(b) + " (" + format_bytes(4.0 * (hi - lo)) + "): " + pieces;
    if (!t.found) {
      n.say(head + " (not recorded)");
      continue;
    }
    n.say(head + "; " + timing_text(t));
    jbuckets.push_back({{"index", b}, {"bytes", 4.0 * (hi - lo)}, {"waiting_ms", t.waiting()},
                        {"start_ms", t.first_start}, {"end_ms", t.end}});
  }
  return recorded;
}

void narrate_sharded(Narrator& n, const Run& r, const Run& ddp, const std::vector<ParamInfo>& params,
                     const std::vector<dp::Device>& devs, double P, nlohmann::json& js) {
  const std::size_t N = devs.size();
  const auto& tl = r.med().tl;
  const std::int64_t elems = static_cast<std::int64_t>(P / 4);
  const std::int64_t S = r.shards.empty() ? 0 : r.shards[0].second - r.shards[0].first;
  n.say("== Sharded (dp::Mode::Sharded, ZeRO stage " + std::to_string(r.stage) + "): the median of " +
        std::to_string(r.iters.size()) + " iterations on " + std::to_string(N) + " devices ==");
  n.say("Every device keeps a full replica of the parameters for forward and backward, as in DDP, but");
  n.say("OWNS only a 1/N range of the flat buffers: only the owner keeps that range's optimizer state,");
  n.say(std::string("steps it, and") + (r.stage >= 2 ? " (stage 2) keeps its summed gradient between steps."
                                                     : " (stage 1) holds its summed gradient; other devices zero theirs."));
  n.say("");
  n.say("0. ranges — P = " + std::to_string(elems) + " floats; S = ceil(P/N) rounded up to 16 floats = " +
        std::to_string(S) + "; the buffers are padded to N·S = " + std::to_string(S * static_cast<std::int64_t>(N)) +
        " floats. A range may cut a parameter in two:");
  for (std::size_t d = 0; d < r.shards.size(); ++d) {
    auto [lo, hi] = r.shards[d];
    n.say("     " + devs[d].str() + " owns [" + std::to_string(lo) + ", " + std::to_string(hi) +
          "): " + params_in(params, lo, std::min(hi, elems), false) +
          (hi > elems ? " + " + std::to_string(hi - std::max(lo, elems)) + " floats of padding" : ""));
  }
  n.say("1-3. scatter, forward, backward — as in DDP: " + per_device(tl, devs, "backward") + " (backward)");
  n.say("4. reduce-scatter — the same buckets as DDP; when a bucket is ready on a device, its comm thread cuts");
  n.say("   it at the range boundaries and each piece is REDUCED ONTO ITS OWNER (summed in device order):");
  nlohmann::json jbuckets = nlohmann::json::array();
  const double recorded = narrate_reduce_scatter(n, r, devs, jbuckets);
  auto sb = shard_bytes(r.shards, elems);
  n.say("   Per device: it receives the other N-1 devices' gradients for its range, (N-1) × its owned");
  n.say("   floats × 4 B, and sends its own gradients for every other range, (P - owned) × 4 B:");
  for (std::size_t d = 0; d < N; ++d)
    n.say("     " + devs[d].str() + ": receives " + format_bytes(sb.rs_recv[d]) + ", sends " +
          format_bytes(sb.rs_send[d]));
  n.say("   Checked against the run: the reduce-scatter buckets recorded on " + devs[0].str() + " hold " +
        format_bytes(recorded) + (std::abs(recorded - P) < 0.5 ? " = P, as they must." : " — NOT P: a mismatch."));
  n.say("5. step — each device steps only its S floats, with momentum state for those S floats only:");
  n.say("   4·S = " + format_bytes(4.0 * S) + " of state per device instead of DDP's " + format_bytes(P) + "; " +
        per_device(tl, devs, "step") + ".");
  n.say("6. all-gather — still inside opt.step(), every device sends its updated range to the N-1 others");
  n.say("   and receives theirs: (N-1)·S·4 B = " + format_bytes(sb.ag_recv.empty() ? 0 : sb.ag_recv[0]) +
        " in and as much out per device (padding included); " + per_device(tl, devs, "allgather") + ".");
  double total = sb.rs_recv.empty() ? 0 : sb.rs_recv[0] + sb.ag_recv[0];
  n.say("   Total into " + devs[0].str() + ": reduce-scatter + all-gather = " + format_bytes(total) +
        "; DDP's all-reduce moves 2(N-1)/N·P = " + format_bytes(2.0 * (N - 1) / N * P) +
        ": the same bytes — an all-reduce IS a reduce-scatter followed by an all-gather, and Sharded");
  n.say("   simply runs the optimizer step between the two halves, on 1/N of the parameters.");
  std::size_t d1 = N > 1 ? 1 : 0;
  double ddp_peak = static_cast<double>(ddp.med().stats.devices[d1].peak_memory_bytes);
  double sh_peak = static_cast<double>(r.med().stats.devices[d1].peak_memory_bytes);
  n.say("   Memory measured by the allocator, peak over the median iteration on " + devs[d1].str() + ": DDP " +
        format_bytes(ddp_peak) + ", Sharded " + format_bytes(sh_peak) + " (momentum, and in stage 2 the gradient");
  n.say("   between steps, shrink to 1/N; the full gradient buffer still exists during backward).");
  n.say("   Iteration: " + spread(r.times()) + "; loss of the last " + fmt(r.iters.back().loss, 4) + ".");
  n.say("");
  nlohmann::json jshards = nlohmann::json::array();
  for (auto [lo, hi] : r.shards) jshards.push_back({lo, hi});
  js = {{"stage", r.stage},
        {"shards", jshards},
        {"param_elems", elems},
        {"reduce_scatter_recv_bytes", sb.rs_recv},
        {"reduce_scatter_send_bytes", sb.rs_send},
        {"all_gather_recv_bytes", sb.ag_recv},
        {"recorded_bucket_bytes", recorded},
        {"buckets", jbuckets},
        {"peak_memory_bytes_device1", {{"ddp", ddp_peak}, {"sharded", sh_peak}}}};
}

// "1606144 B (1.5 MB)": exact, so that the narration can be checked to the byte.
std::string exact_bytes(double bytes) {
  return std::to_string(static_cast<std::int64_t>(bytes)) + " B (" + format_bytes(bytes) + ")";
}

// Elements of [lo, hi) that the range [a, b) holds.
std::int64_t overlap(std::int64_t lo, std::int64_t hi, std::int64_t a, std::int64_t b) {
  return std::max<std::int64_t>(0, std::min(hi, b) - std::max(lo, a));
}

// Per-device bytes of a stage-3 step, from the ranges and the gather units alone.
// A gather of unit u is a pull (ShardStore::gather_unit in src/parallel/shard_store.h): device r receives the
// pieces of u it does not own, 4·(|u| - own_r(u)) bytes, and sends its own piece to
// each of the N-1 others, 4·(N-1)·own_r(u). Summed over devices both are (N-1)·4|u|:
// on average (N-1)/N of the unit per device, what a ring all-gather moves.
struct Stage3Bytes {
  std::vector<double> fwd_recv, fwd_send;  // forward: every unit gathered once
  std::vector<double> bwd_recv, bwd_send;  // backward: every unit but the last again
  std::vector<double> rs_recv, rs_send;    // reduce-scatter of the gradients
  std::vector<double> total_recv, total_send;
};

Stage3Bytes stage3_bytes(const std::vector<std::pair<std::int64_t, std::int64_t>>& shards,
                         const std::vector<std::pair<std::int64_t, std::int64_t>>& units, std::int64_t elems) {
  Stage3Bytes b;
  const double N = static_cast<double>(shards.size());
  const auto sb = shard_bytes(shards, elems);
  for (std::size_t d = 0; d < shards.size(); ++d) {
    double fr = 0, fs = 0, br = 0, bs = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      const auto [lo, hi] = units[u];
      const double own = static_cast<double>(overlap(lo, hi, shards[d].first, shards[d].second));
      const double recv = 4.0 * (static_cast<double>(hi - lo) - own), send = 4.0 * (N - 1) * own;
      fr += recv;
      fs += send;
      if (u + 1 < units.size()) {
        br += recv;
        bs += send;
      }
    }
    b.fwd_recv.push_back(fr);
    b.fwd_send.push_back(fs);
    b.bwd_recv.push_back(br);
    b.bwd_send.push_back(bs);
    b.rs_recv.push_back(sb.rs_recv[d]);
    b.rs_send.push_back(sb.rs_send[d]);
    b.total_recv.push_back(fr + br + sb.rs_recv[d]);
    b.total_send.push_back(fs + bs + sb.rs_send[d]);
  }
  return b;
}

// The module that holds unit [lo, hi): the longest dotted prefix its parameters' names
// share ("7" for "7.weight" and "7.bias"; "transformer.h.0" for a GPT block picked by
// shard_unit), or the top-level child of its first parameter when they share none.
std::string child_of(const std::vector<ParamInfo>& params, std::int64_t lo, std::int64_t hi) {
  auto parts = [](const std::string& name) {  // the module path of a parameter: "a.b.w" -> {a, b}
    std::vector<std::string> out;
    std::size_t start = 0;
    for (std::size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
      out.push_back(name.substr(start, dot - start));
      start = dot + 1;
    }
    return out;
  };
  std::vector<std::string> common;
  bool first = true;
  for (auto& p : params) {
    if (p.offset < lo || p.offset >= hi) continue;
    const std::vector<std::string> mine = parts(p.name);
    if (first) {
      common = mine;
      first = false;
    }
    std::size_t n = 0;
    while (n < common.size() && n < mine.size() && common[n] == mine[n]) ++n;
    common.resize(n);
  }
  std::string out;
  for (auto& c : common) out += (out.empty() ? "" : ".") + c;
  if (!out.empty()) return out;
  for (auto& p : params)
    if (p.offset == lo) return p.name.substr(0, p.name.find('.'));
  return "?";
}

void narrate_stage3(Narrator& n, const Run& r, const Run& ddp, const std::vector<ParamInfo>& params,
                    const std::vector<dp::Device>& devs, double P, nlohmann::json& js) {
  const std::size_t N = devs.size();
  const auto& tl = r.med().tl;
  const std::int64_t elems = static_cast<std::int64_t>(P / 4);
  const std::int64_t S = r.shards.empty() ? 0 : r.shards[0].second - r.shards[0].first;
  const std::size_t U = r.units.size();
  n.say("== Sharded (dp::Mode::Sharded, ZeRO stage 3): the median of " + std::to_string(r.iters.size()) +
        " iterations on " + std::to_string(N) + " devices ==");
  n.say("Stage 3 shards the parameters too: between steps NO device holds them whole, each keeps only");
  n.say("its own range (with that range's gradient and momentum). A gather unit's parameters are");
  n.say("all-gathered on every device just before the unit runs, forward and again backward, then freed.");
  n.say("");
  n.say("0. ranges — as in stage 2 (S = " + std::to_string(S) + " floats); now the PARAMETERS too live only there:");
  std::vector<double> own;
  for (std::size_t d = 0; d < r.shards.size(); ++d) {
    auto [lo, hi] = r.shards[d];
    own.push_back(static_cast<double>(overlap(0, elems, lo, hi)));
    n.say("     " + devs[d].str() + " holds [" + std::to_string(lo) + ", " + std::to_string(hi) + "): 4·S = " +
          exact_bytes(4.0 * S) + " of parameters (DDP: all of P = " + format_bytes(P) + ")");
  }
  n.say("1. gather units — one per top-level child with parameters (for the GPT, shard_unit makes each");
  n.say("   transformer block one: FSDP's auto-wrap), each a contiguous run of the flat buffer:");
  double largest = 0, pair_peak = 0;
  std::size_t largest_unit = 0;
  nlohmann::json junits = nlohmann::json::array();
  for (std::size_t u = 0; u < U; ++u) {
    auto [lo, hi] = r.units[u];
    const double bytes = 4.0 * static_cast<double>(hi - lo);
    if (bytes > largest) {
      largest = bytes;
      largest_unit = u;
    }
    pair_peak = std::max(pair_peak, bytes + (u + 1 < U ? 4.0 * static_cast<double>(r.units[u + 1].second -
                                                                                       r.units[u + 1].first)
                                                        : 0.0));
    std::string owners;
    for (std::size_t d = 0; d < r.shards.size(); ++d) {
      const std::int64_t o = overlap(lo, hi, r.shards[d].first, r.shards[d].second);
      if (o > 0) owners += (owners.empty() ? "" : ", ") + devs[d].str() + " " + std::to_string(o) + " floats";
    }
    n.say("     unit " + std::to_string(u) + " = child '" + child_of(params, lo, hi) + "' (" +
          params_in(params, lo, hi, false) + ") [" + std::to_string(lo) + ", " + std::to_string(hi) + "), " +
          exact_bytes(bytes) + "; owned by " + owners);
    junits.push_back({{"child", child_of(params, lo, hi)}, {"lo", lo}, {"hi", hi}, {"bytes", bytes}});
  }
  const auto b = stage3_bytes(r.shards, r.units, elems);
  // The worker's gathers: before backward began on that worker they served the forward.
  std::vector<int> fwd_events, bwd_events;
  std::string fwd_ms, bwd_ms;
  for (auto& d : devs) {
    const double bwd_start = tl.when(worker(d), "backward").first;
    int f = 0, k = 0;
    double fm = 0, km = 0;
    for (auto& e : tl.find(worker(d), "allgather")) {
      if ((e.start_us - tl.origin_us) / 1e3 < bwd_start) {
        ++f;
        fm += e.dur_us / 1e3;
      } else {
        ++k;
        km += e.dur_us / 1e3;
      }
    }
    fwd_events.push_back(f);
    bwd_events.push_back(k);
    fwd_ms += (fwd_ms.empty() ? "" : ", ") + d.str() + " " + fmt(fm, 1) + " ms";
    bwd_ms += (bwd_ms.empty() ? "" : ", ") + d.str() + " " + fmt(km, 1) + " ms";
  }
  n.say("2. forward — when a worker first reads a parameter of unit u it gathers u (already there when it");
  n.say("   was prefetched), prefetches u+1 and releases u-1, so at most two units are held at once.");
  n.say("   Each gather pulls the pieces a device does not own from their owners: per unit, a device");
  n.say("   receives 4·(|u| - its piece) and sends its piece to the N-1 others; over all devices that is");
  n.say("   (N-1)·|u|, i.e. (N-1)/N of the unit per device on average — a ring all-gather's traffic:");
  for (std::size_t u = 0; u < U; ++u) {
    auto [lo, hi] = r.units[u];
    std::string per;
    for (std::size_t d = 0; d < N; ++d) {
      const double o = static_cast<double>(overlap(lo, hi, r.shards[d].first, r.shards[d].second));
      per += (per.empty() ? "" : ", ") + devs[d].str() + " in " + std::to_string(static_cast<std::int64_t>(4.0 * (hi - lo - o))) +
             " B";
    }
    const std::string before = u == 0 ? "first" : "prefetched with unit " + std::to_string(u - 1) + ";";
    n.say("   before child '" + child_of(params, lo, hi) + "': unit " + std::to_string(u) + " (" + before + " " +
          (u + 1 < U ? "prefetches unit " + std::to_string(u + 1) : "nothing left to prefetch") +
          (u > 0 ? ", releases unit " + std::to_string(u - 1) : "") + "): " + per + "; (N-1)/N·4|u| = " +
          exact_bytes(4.0 * static_cast<double>(hi - lo) * static_cast<double>(N - 1) / static_cast<double>(N)) +
          " on average");
  }
  n.say("   Forward gathers per device: " + fwd_ms + " (" + std::to_string(fwd_events[0]) +
        " gather calls on " + devs[0].str() + ").");
  n.say("3. backward — the units again, last first. The last unit is still held from the forward (the");
  n.say("   same worker goes straight on to backward), so units " +
        (U > 1 ? std::to_string(U - 2) + ".." + "0" : std::string("none")) + " are gathered again, one at a time:");
  n.say("   leaving a unit waits until its gradients were reduce-scattered, releases it, then gathers the");
  n.say("   next; the last one (unit 0) is released when the worker's part of the step ends. Same bytes per");
  n.say("   unit as in forward. Backward gathers per device: " + bwd_ms + " (" + std::to_string(bwd_events[0]) +
        " calls on " + devs[0].str() + ": the first finds the last unit still held and copies nothing).");
  n.say("4. reduce-scatter — buckets never straddle a unit; each piece is summed onto its owner, straight");
  n.say("   into the owner's range gradient; the full gradient buffer never exists:");
  nlohmann::json jbuckets = nlohmann::json::array();
  const double recorded = narrate_reduce_scatter(n, r, devs, jbuckets);
  n.say("   The reduce-scatter buckets recorded on " + devs[0].str() + " hold " + format_bytes(recorded) +
        (std::abs(recorded - P) < 0.5 ? " = P, as they must." : " — NOT P: a mismatch."));
  n.say("5. step — each device updates its range in place: " + per_device(tl, devs, "step") +
        ". Nothing is all-gathered after");
  n.say("   the step: the next forward gathers each unit when it needs it.");
  n.say("6. bytes per device in this step, from the ranges and units above (sent / received):");
  for (std::size_t d = 0; d < N; ++d)
    n.say("     " + devs[d].str() + ": forward gathers in " + exact_bytes(b.fwd_recv[d]) + ", out " +
          exact_bytes(b.fwd_send[d]) + "; backward gathers in " + exact_bytes(b.bwd_recv[d]) + ", out " +
          exact_bytes(b.bwd_send[d]) + "; reduce-scatter in " + exact_bytes(b.rs_recv[d]) + ", out " +
          exact_bytes(b.rs_send[d]) + "; total in " + exact_bytes(b.total_recv[d]) + ", out " +
          exact_bytes(b.total_send[d]));
  double mean_in = 0;
  for (double v : b.total_recv) mean_in += v / static_cast<double>(N);
  const double last_unit = U > 0 ? 4.0 * static_cast<double>(r.units[U - 1].second - r.units[U - 1].first) : 0.0;
  n.say("   Mean in per device " + exact_bytes(mean_in) + " = (N-1)/N·(P + (P - last unit) + P) = " +
        exact_bytes((N - 1.0) / N * (3 * P - last_unit)) + "; the ZeRO paper's");
  n.say("   3(N-1)/N·P = " + format_bytes(3.0 * (N - 1) / N * P) +
        " gathers the last unit a second time, which dp keeps from forward to backward;");
  n.say("   DDP's all-reduce moves 2(N-1)/N·P = " + format_bytes(2.0 * (N - 1) / N * P) +
        ": stage 3 trades 1.5 times DDP's traffic for holding 1/N of the parameters.");
  // Memory: what first principles predict between steps, against the allocator.
  std::vector<double> expect;
  for (std::size_t d = 0; d < N; ++d) expect.push_back(8.0 * S + 4.0 * own[d]);
  n.say("7. memory per device — parameters held 4·S = " + exact_bytes(4.0 * S) + " (P/N, padded), plus while a");
  n.say("   step runs the gathered units: the largest child is '" +
        child_of(params, U > 0 ? r.units[largest_unit].first : 0, U > 0 ? r.units[largest_unit].second : 0) + "' (unit " + std::to_string(largest_unit) +
        ", " + exact_bytes(largest) + "), held alone in backward; in forward");
  n.say("   a unit and its prefetched successor are held together: at most " + exact_bytes(pair_peak) +
        ". So parameters at most 4·S + " + format_bytes(pair_peak) + " = " + exact_bytes(4.0 * S + pair_peak) +
        " per device, against DDP's P = " + format_bytes(P) + ".");
  n.say("   Between steps, first principles: parameters 4·S + range gradient 4·S + momentum for the owned");
  n.say("   floats 4·own; the allocator (dp::memory_allocated, less what the device held before):");
  bool all_match = true;
  for (std::size_t d = 0; d < N; ++d) {
    const bool match = r.between_bytes[d] == expect[d];
    all_match = all_match && match;
    n.say("     " + devs[d].str() + ": expected " + exact_bytes(expect[d]) + ", allocator " +
          exact_bytes(r.between_bytes[d]) + (match ? " — equal" : " — DIFFERENT") + "; peak in the step " +
          format_bytes(r.peak_bytes[d]) + " (DDP: between steps " + format_bytes(ddp.between_bytes[d]) +
          ", peak " + format_bytes(ddp.peak_bytes[d]) + ")");
  }
  n.say("   On " + devs[0].str() + " the peak is " + format_bytes(r.peak_bytes[0] - r.between_bytes[0]) +
        " above the between-steps count: at most " + format_bytes(pair_peak) + " of it gathered parameters,");
  n.say("   the rest the activations of the device's rows and a unit's gradients until they are reduce-scattered.");
  n.say("   Iteration: " + spread(r.times()) + "; loss of the last " + fmt(r.iters.back().loss, 4) + ".");
  n.say("");
  nlohmann::json jshards = nlohmann::json::array();
  for (auto [lo, hi] : r.shards) jshards.push_back({lo, hi});
  js = {{"stage", r.stage},
        {"shards", jshards},
        {"units", junits},
        {"forward_gather_recv_bytes", b.fwd_recv},
        {"forward_gather_send_bytes", b.fwd_send},
        {"backward_gather_recv_bytes", b.bwd_recv},
        {"backward_gather_send_bytes", b.bwd_send},
        {"reduce_scatter_recv_bytes", b.rs_recv},
        {"reduce_scatter_send_bytes", b.rs_send},
        {"total_recv_bytes", b.total_recv},
        {"total_send_bytes", b.total_send},
        {"forward_gather_calls", fwd_events},
        {"backward_gather_calls", bwd_events},
        {"recorded_bucket_bytes", recorded},
        {"buckets", jbuckets},
        {"params_held_bytes", 4.0 * S},
        {"largest_unit_bytes", largest},
        {"forward_gathered_peak_bytes", pair_peak},
        {"between_steps_expected_bytes", expect},
        {"between_steps_bytes", r.between_bytes},
        {"between_steps_match", all_match},
        {"peak_bytes", r.peak_bytes},
        {"ddp_between_steps_bytes", ddp.between_bytes},
        {"ddp_peak_bytes", ddp.peak_bytes}};
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff = std::max(diff, double(std::abs(a[i] - b[i])));
  return diff;
}

// ---- mixed precision in the DDP step -----------------------------------------------

// One top-level child's output in a probe forward.
struct Activation {
  std::string child, type, dtype;
  dp::Shape shape;
  double bytes = 0;
};

// What a forward on device 0 makes of one device's shard of the batch under the run's
// autocast scope, outside autograd: each child's output for a Sequential (the CNN), the
// logits, the loss, and two float32-list ops on the logits.
struct Probe {
  std::vector<Activation> children;
  std::string logits_dtype, loss_dtype, softmax_dtype, layer_norm_dtype;
  dp::Shape logits_shape;
};

Probe probe_forward(dp::nn::Module& net, const dp::data::Batch& batch, std::int64_t rows, dp::Device dev,
                    const std::string& compute) {
  Probe pr;
  const dp::Tensor x = batch.data.narrow(0, 0, rows).to(dev), y = batch.target.narrow(0, 0, rows).to(dev);
  dp::NoGradGuard no_grad;
  const dp::amp::autocast scope = samples::precision_scope(compute);
  if (auto* seq = dynamic_cast<dp::nn::Sequential*>(&net)) {
    dp::Tensor h = x;
    for (auto& [name, child] : seq->named_children()) {
      h = child->forward(h);
      pr.children.push_back({name, child->type_name(), dp::dtype_name(h.dtype()), h.shape(),
                             static_cast<double>(h.nbytes())});
    }
  }
  const dp::Tensor logits = net.forward(x);
  pr.logits_dtype = dp::dtype_name(logits.dtype());
  pr.logits_shape = logits.shape();
  pr.loss_dtype = dp::dtype_name(loss_fn(logits, y).dtype());
  pr.softmax_dtype = dp::dtype_name(dp::nn::softmax(logits, -1).dtype());
  pr.layer_norm_dtype = dp::dtype_name(dp::nn::layer_norm(logits, {logits.size(-1)}).dtype());
  return pr;
}

// Float32 accumulation inside a bfloat16 product: K ones times K ones under autocast,
// against a running sum kept in bfloat16 (8 significant bits: 256 + 1 rounds to 256).
struct Accumulation {
  std::int64_t k = 1024;
  double product = 0;
  std::string product_dtype;
  double bf16_running_sum = 0;
};

Accumulation accumulation(dp::Device dev) {
  Accumulation a;
  const dp::Tensor ones = dp::ones({1, a.k}, dev);
  {
    dp::NoGradGuard no_grad;
    const dp::amp::autocast scope(dp::Dtype::BFloat16);
    const dp::Tensor y = dp::linear(ones, ones, dp::Tensor());  // (1, 1): the dot product
    a.product = y.item();
    a.product_dtype = dp::dtype_name(y.dtype());
  }
  dp::BFloat16 sum(0.0f);
  for (std::int64_t i = 0; i < a.k; ++i) sum = dp::BFloat16(static_cast<float>(sum) + 1.0f);
  a.bf16_running_sum = static_cast<float>(sum);
  return a;
}

// Elements of v that are not 0 but become 0 rounded to `dtype`.
std::int64_t flushed_to_zero(const std::vector<float>& v, dp::Dtype dtype) {
  const std::vector<float> r =
      dp::from_vector(v, {static_cast<std::int64_t>(v.size())}).to(dtype).to(dp::Dtype::Float32).to_vector();
  std::int64_t n = 0;
  for (std::size_t i = 0; i < v.size(); ++i) n += v[i] != 0 && r[i] == 0;
  return n;
}

// Updates of the last step that bfloat16 weights would have lost: p_before rounded to
// bfloat16, minus lr·m, rounds back to the same bfloat16 value.
std::int64_t lost_in_bf16_weights(const Run& r) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < r.momentum.size(); ++i) {
    const float update = static_cast<float>(kLr) * r.momentum[i];
    if (update == 0) continue;
    const dp::BFloat16 before(r.params_after[i] + update);
    n += dp::BFloat16(static_cast<float>(before) - update).bits == before.bits;
  }
  return n;
}

// The bytes of the all-reduce buckets recorded on device 0's comm thread.
double recorded_allreduce_bytes(const Run& r, dp::Device d0) {
  double bytes = 0;
  for (auto& e : r.med().tl.events)
    if (e.track == comm(d0) && e.name.rfind("allreduce bucket ", 0) == 0) bytes += recorded_bytes(e);
  return bytes;
}

// The DDP step told for what is 16-bit and what stays float32, phase by phase, from the
// DDP run (`wired`: the same run with --reduce-dtype's wire, when set).
void narrate_mixed(Narrator& n, const Run& r, const Run* wired, const std::vector<dp::Device>& devs,
                   const dp::data::Batch& batch, double P, const Precision& pr, nlohmann::json& jm) {
  const std::size_t N = devs.size();
  const bool bf16 = pr.compute == "bf16";
  const std::string c16 = bf16 ? "bfloat16" : "float32";
  const dp::Device d0 = devs[0];
  const std::int64_t rows = (batch.data.size(0) + static_cast<std::int64_t>(N) - 1) / static_cast<std::int64_t>(N);
  const Probe probe = probe_forward(*r.net, batch, rows, d0, pr.compute);
  const auto named = r.net->named_parameters();
  const std::string param_dtype = dp::dtype_name(named[0].second.dtype());
  const dp::Tensor grad = r.net->parameter_set()->copy(0).grad;
  const std::vector<float> g = grad.to_vector();
  const std::int64_t fp16_zero = flushed_to_zero(g, dp::Dtype::Float16);
  const std::int64_t bf16_zero = flushed_to_zero(g, dp::Dtype::BFloat16);
  const std::int64_t lost = lost_in_bf16_weights(r);
  auto join = [](const std::set<std::string>& s) {
    std::string out;
    for (auto& x : s) out += (out.empty() ? "" : ", ") + x;
    return out;
  };
  n.say("== Mixed precision in the DDP step (--precision " + pr.compute + ", --reduce-dtype " + pr.wire + ") ==");
  n.say("What is " + std::string(bf16 ? "bfloat16" : "16-bit") + " and what stays float32, phase by phase, measured on " +
        d0.str() + " in the DDP run above.");
  n.say("0. parameters — the master weights are " + param_dtype + " (" + named[0].first + " " +
        samples::shape_text(named[0].second.shape()) + "): P = " + format_bytes(P) + " per device, 4 B a parameter.");
  n.say("   autocast never converts a parameter: a product casts a transient " + c16 + " COPY of it, and that");
  n.say("   cast's backward brings the gradient back to float32.");
  n.say("   Why: an update lr·m is often smaller than half a bfloat16 step of the weight (2^-9 to 2^-8 of it): in the last");
  n.say("   step " + std::to_string(lost) + " of the " + std::to_string(r.momentum.size()) +
        " updates would have rounded away in bfloat16 weights; float32 weights keep every one.");
  n.say("1-2. scatter — the input shard arrives as " + std::string(dp::dtype_name(batch.data.dtype())) + " " +
        samples::shape_text(batch.data.narrow(0, 0, rows).shape()) + ": nothing is cast before an op needs it.");
  n.say("3. forward — " + std::string(bf16 ? "under dp::amp::autocast(bfloat16), which DataParallel carries to every "
                                             "worker thread:"
                                           : "float32 (no --precision bf16): no autocast scope."));
  if (bf16) {
    n.say("   products (conv2d, linear, matmul, attention) cast their float32 inputs and weights to bfloat16 and");
    n.say("   compute there; ops on neither list (ReLU, max-pool, reshape, and batch norm, whose statistics are");
    n.say("   float32 whatever its input) hand on their input's dtype:");
  }
  for (const Activation& a : probe.children)
    n.say("     '" + a.child + "' (" + a.type + ") → " + a.dtype + " " + samples::shape_text(a.shape) + ", " +
          std::to_string(static_cast<std::int64_t>(a.bytes)) + " B" +
          (a.dtype == "bfloat16" ? " (float32: " + std::to_string(static_cast<std::int64_t>(2 * a.bytes)) + " B)" : ""));
  if (probe.children.empty())  // not a Sequential (the GPT): its output alone
    n.say("     the logits of " + d0.str() + "'s shard → " + probe.logits_dtype + " " + samples::shape_text(probe.logits_shape));
  n.say("   The logits reached the loss as " + join(r.logits_dtypes) + " on every worker (" +
        std::to_string(r.loss_calls) + " calls over " + std::to_string(r.iters.size()) + " iteration(s) on " +
        std::to_string(N) + " devices).");
  Accumulation acc;
  if (bf16) {
    acc = accumulation(d0);
    n.say("   A bfloat16 product accumulates in float32 and rounds once: " + std::to_string(acc.k) + " ones times " +
          std::to_string(acc.k) + " ones");
    n.say("   under autocast gives " + fmt(acc.product, 0) + " (" + acc.product_dtype + ");");
    n.say("   a running sum kept in bfloat16 stops at " + fmt(acc.bf16_running_sum, 0) +
          " (8 significant bits: 256 + 1 rounds back to 256).");
  }
  n.say("4. loss — cross_entropy is on autocast's float32 list: it casts the logits to float32 and its log_softmax");
  n.say("   runs there: the loss is " + join(r.loss_dtypes) + ". softmax (" + probe.softmax_dtype +
        ") and the norms, layer_norm (" + probe.layer_norm_dtype + ") and batch_norm,");
  n.say("   are on that list too: exp, sums over many terms and a variance lose most in 8 bits.");
  n.say("5. backward — every node runs in its forward's dtype (autocast is off in backward): the activations'");
  n.say("   gradients are " + c16 + ", and each weight's cast node returns its gradient as float32: the leaves'");
  n.say("   .grad are " + std::string(dp::dtype_name(grad.dtype())) + ", views of the flat gradient buffer (" +
        format_bytes(static_cast<double>(grad.nbytes())) + " per device).");
  const double rec32 = recorded_allreduce_bytes(r, d0);
  const double bytes32 = static_cast<double>(r.med().stats.devices[0].grad_bytes);
  n.say("6. all-reduce — with a float32 wire the buckets move float32: " + devs[0].str() + " put " +
        std::to_string(static_cast<std::int64_t>(bytes32)) + " B into the gradient");
  n.say("   collectives (stats().grad_bytes); the buckets recorded " + std::to_string(static_cast<std::int64_t>(rec32)) +
        " B = P.");
  double rec16 = 0, bytes16 = 0, wire_diff = 0;
  if (wired != nullptr) {
    rec16 = recorded_allreduce_bytes(*wired, d0);
    bytes16 = static_cast<double>(wired->med().stats.devices[0].grad_bytes);
    wire_diff = max_diff(wired->params, r.params);
    const std::string w16 = pr.wire == "bf16" ? "bfloat16" : "float16";
    n.say("   --reduce-dtype " + pr.wire + " (the same step once more): each bucket is rounded to " + w16 +
          " into a wire buffer");
    n.say("   (2 B a parameter per device), the devices' " + w16 + " values are summed in float32 in device order");
    n.say("   and rounded once, and the sum is widened back into the float32 .grad: " + w16 + " on the wire,");
    n.say("   " + std::to_string(static_cast<std::int64_t>(bytes16)) + " B into the collectives on " + d0.str() + " and " +
          std::to_string(static_cast<std::int64_t>(rec16)) + " B of buckets, the bytes halved (" +
          std::to_string(static_cast<std::int64_t>(bytes32)) + " → " + std::to_string(static_cast<std::int64_t>(bytes16)) +
          " B).");
    n.say("   Its parameters differ from the float32 wire's by max " + fmt(wire_diff, 9) + ": the rounding.");
  } else {
    n.say("   (--reduce-dtype bf16 would round each bucket to bfloat16 on the wire: half these bytes.)");
  }
  n.say("7. step — SGD with momentum updates the float32 master weights with its momentum buffer (" +
        join(r.state_dtypes) + ", " + format_bytes(r.state_bytes) + " per device).");
  n.say("Why bfloat16 needs no GradScaler and float16 does: bfloat16 keeps float32's 8 exponent bits (smallest normal");
  n.say("1.2e-38), float16 has 5 (smallest subnormal 6.0e-8, largest 65504). Of this step's " +
        std::to_string(g.size()) + " parameter-gradient");
  n.say("elements " + std::to_string(fp16_zero) + " are too small for float16 (they round to 0), " +
        std::to_string(bf16_zero) + " for bfloat16.");
  n.say("dp::amp::GradScaler multiplies a float16 loss by 2^16 so that backward's float16 values stay in range, divides");
  n.say("the float32 gradients back before the step and skips a step that overflowed (samples/dp_vs_ddp --precision fp16).");
  n.say("");
  nlohmann::json jchildren = nlohmann::json::array();
  for (const Activation& a : probe.children)
    jchildren.push_back({{"child", a.child}, {"type", a.type}, {"dtype", a.dtype}, {"shape", a.shape}, {"bytes", a.bytes}});
  jm = {{"precision", pr.compute},
        {"reduce_dtype", pr.wire},
        {"param_dtype", param_dtype},
        {"grad_dtype", dp::dtype_name(grad.dtype())},
        {"optimizer_state_dtypes", std::vector<std::string>(r.state_dtypes.begin(), r.state_dtypes.end())},
        {"optimizer_state_bytes", r.state_bytes},
        {"logits_dtypes", std::vector<std::string>(r.logits_dtypes.begin(), r.logits_dtypes.end())},
        {"loss_dtypes", std::vector<std::string>(r.loss_dtypes.begin(), r.loss_dtypes.end())},
        {"loss_calls", r.loss_calls},
        {"activations", jchildren},
        {"probe_logits_dtype", probe.logits_dtype},
        {"probe_loss_dtype", probe.loss_dtype},
        {"softmax_dtype", probe.softmax_dtype},
        {"layer_norm_dtype", probe.layer_norm_dtype},
        {"updates", r.momentum.size()},
        {"updates_lost_in_bf16_weights", lost},
        {"grad_elems", g.size()},
        {"grad_zero_in_fp16", fp16_zero},
        {"grad_zero_in_bf16", bf16_zero},
        {"grad_bytes_fp32_wire", bytes32},
        {"recorded_bucket_bytes_fp32_wire", rec32}};
  if (bf16)
    jm["accumulation"] = {{"k", acc.k}, {"product", acc.product}, {"product_dtype", acc.product_dtype},
                          {"bf16_running_sum", acc.bf16_running_sum}};
  if (wired != nullptr) {
    jm["grad_bytes_wire"] = bytes16;
    jm["recorded_bucket_bytes_wire"] = rec16;
    jm["max_param_diff_wire"] = wire_diff;
  }
}

void write_trace(const std::string& path, const std::vector<const Run*>& runs) {
  nlohmann::json events = nlohmann::json::array();
  int pid = 1;
  for (const Run* r : runs) {
    events.push_back({{"ph", "M"}, {"pid", pid}, {"name", "process_name"},
                      {"args", {{"name", std::string(dp::mode_name(r->mode)) +
                                                      (r->stage > 0 ? " stage " + std::to_string(r->stage) : "") +
                                                      " iteration (median)"}}}});
    std::map<std::string, int> tids;
    const auto& tl = r->med().tl;
    for (auto& e : tl.events) tids.emplace(e.track, 0);
    int tid = 1;
    for (auto& [track, t] : tids) {
      t = tid++;
      events.push_back({{"ph", "M"}, {"pid", pid}, {"tid", t}, {"name", "thread_name"}, {"args", {{"name", track}}}});
    }
    for (auto& e : tl.events) {
      nlohmann::json args = nlohmann::json::object();
      if (!e.args.empty()) args = nlohmann::json::parse("{" + e.args + "}", nullptr, false);
      events.push_back({{"ph", "X"}, {"pid", pid}, {"tid", tids[e.track]}, {"name", e.name},
                        {"ts", e.start_us - tl.origin_us}, {"dur", e.dur_us}, {"args", args}});
    }
    ++pid;
  }
  std::ofstream f(path);
  f << nlohmann::json{{"displayTimeUnit", "ms"}, {"traceEvents", events}}.dump() << "\n";
  if (!f) throw std::runtime_error("--trace: cannot write '" + path + "'");
}

std::string diff_text(double diff) {
  return diff == 0 ? std::string("0 (bitwise identical)") : fmt(diff, 9);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A narrated walk through a DP, a DDP, a Sharded (stage 1 or 2) and a stage-3 step: what moves "
               "where, and when."};
  std::string devices_spec;
  std::int64_t batch_size = 64;
  int iterations = 5;
  int stage = 2;
  bool json = false;
  std::string trace_path;
  std::string model_name = "cnn";
  Precision precision;
  app.add_option("--model", model_name,
                 "cnn (the Fashion-MNIST CNN) or gpt (6 transformer blocks of width 256, 4.8 M parameters: where "
                 "sharding pays)")
      ->check(CLI::IsMember({"cnn", "gpt"}))
      ->capture_default_str();
  samples::add_devices_option(app, devices_spec, /*min=*/2);
  samples::add_batch_option(app, batch_size);
  app.add_option("--iterations", iterations, "traced iterations per design (the median one is narrated)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  samples::add_shard_stage_option(app, stage);
  samples::add_json_option(app, json, "print one JSON object (the narration and the figures) instead of text");
  app.add_option("--trace", trace_path, "write a Perfetto/Chrome trace of each design's median iteration to FILE");
  samples::add_precision_option(app, precision.compute);
  samples::add_reduce_dtype_option(app, precision.wire);
  CLI11_PARSE(app, argc, argv);

  try {
    auto ids = samples::parse_device_ids(devices_spec, dp::device_count(), /*min=*/2);
    const int ndev = static_cast<int>(ids.size());
    if (batch_size < ndev)
      throw std::invalid_argument("--batch " + std::to_string(batch_size) + " is smaller than " +
                                  std::to_string(ndev) + " devices");
    std::vector<dp::Device> devs;
    for (int id : ids) devs.push_back(dp::device(id));
    auto data = model_name == "gpt" ? samples::token_batches(batch_size, 2, /*seed=*/3)
                                    : samples::synthetic_batches({1, 28, 28}, batch_size, 2, /*seed=*/3);

    Narrator n;
    n.json = json;
    if (precision.compute != "fp32" && devs[0].is_cpu()) std::cerr << samples::cpu_16bit_note(precision.compute) << "\n";
    // The four designs compute in --precision on a float32 wire, so that their bytes are
    // told as float32's; --reduce-dtype adds a DDP run with the 16-bit wire.
    const Precision compute{.compute = precision.compute};
    Run dpr = run(model_name, dp::Mode::DP, 0, devs, data[0], data[1], iterations, compute);
    Run ddpr = run(model_name, dp::Mode::DDP, 0, devs, data[0], data[1], iterations, compute);
    Run shr = run(model_name, dp::Mode::Sharded, stage, devs, data[0], data[1], iterations, compute);
    Run sh3 = run(model_name, dp::Mode::Sharded, 3, devs, data[0], data[1], iterations, compute);
    std::optional<Run> wired;
    if (precision.wire != "fp32")
      wired = run(model_name, dp::Mode::DDP, 0, devs, data[0], data[1], iterations, precision);
    auto params = param_infos(*dpr.net);
    double P = 0;
    for (auto& p : params) P += 4.0 * p.numel;
    const double N = ndev;
    const bool cpu = samples::device_kind() == "cpu";
    const int cores = dp::hardware_concurrency();

    n.say("teach: " + std::string(model_name == "gpt" ? "a GPT (6 transformer blocks, tied embedding)"
                                                        : "the Fashion-MNIST CNN") +
          " on " + std::to_string(ndev) + " " +
          (cpu ? "CPU virtual devices (no GPU here: each has its own memory, worker thread and share of "
                 "the cores)"
               : "GPUs") +
          ", global batch " + std::to_string(batch_size) + ".");
    if (cpu && ndev > cores)
      n.say("Note: " + std::to_string(ndev) + " virtual devices on " + std::to_string(cores) +
            " hardware thread(s) oversubscribe the machine: each device still gets one thread, so the "
            "devices time-share the cores and every phase time below includes waiting for a core.");
    n.say("Its " + std::to_string(params.size()) + " parameter tensors live in ONE flat buffer per device: P = " +
          format_bytes(P) + " of parameters, and as much again of gradients.");
    n.say("Each design runs one warm-up iteration, then " + std::to_string(iterations) +
          " traced iterations from the same state on the same batch; the one with the median time is told.");
    n.say("Times are milliseconds since that iteration began (+t) or durations.");
    n.say("");
    narrate_dp(n, dpr, params, devs, data[1], P);
    bool has_buffers = !dpr.net->named_buffers().empty();
    nlohmann::json jbuckets = nlohmann::json::array();
    narrate_ddp(n, ddpr, params, devs, P, has_buffers, jbuckets);
    nlohmann::json jsharded;
    narrate_sharded(n, shr, ddpr, params, devs, P, jsharded);
    nlohmann::json jstage3;
    narrate_stage3(n, sh3, ddpr, params, devs, P, jstage3);
    nlohmann::json jmixed;  // null unless --precision or --reduce-dtype asks for 16 bits
    if (precision.compute != "fp32" || wired)
      narrate_mixed(n, ddpr, wired ? &*wired : nullptr, devs, data[1], P, precision, jmixed);

    double diff = max_diff(dpr.params, ddpr.params), diff_sh = max_diff(ddpr.params, shr.params);
    double diff_sh3 = max_diff(ddpr.params, sh3.params);
    double dp_bytes_dev0 = 2 * (N - 1) * P, dp_bytes_other = 2 * P, ddp_bytes_dev = 2 * (N - 1) / N * P;
    n.say("== Bytes moved per iteration, from first principles (N = " + std::to_string(ndev) +
          " devices, P = " + format_bytes(P) + ") ==");
    n.say("DP : device 0 sends N-1 parameter copies (replicate, (N-1)·P = " + format_bytes((N - 1) * P) +
          ") and receives N-1 gradient copies (reduce, (N-1)·P = " + format_bytes((N - 1) * P) + "): " +
          format_bytes(dp_bytes_dev0) + " through " + devs[0].str() + ",");
    n.say("     growing linearly with N, while every other device moves 2·P = " + format_bytes(dp_bytes_other) +
          " (one copy in, one gradient out). The hub is device 0; and the reduce starts only after the");
    n.say("     slowest backward.");
    n.say("DDP: no parameter broadcast (replicas persist and take identical steps); a ring all-reduce of the");
    n.say("     gradients: each device sends and receives 2(N-1)/N·P = " + format_bytes(ddp_bytes_dev) +
          " (reduce-scatter: N-1 chunks of P/N, then all-gather: N-1 chunks), nearly constant in N,");
    n.say("     the same on every device (no hub), and bucket by bucket while backward is still running.");
    n.say("     (A tree reduce plus broadcast moves ~2P per link instead; either way no device carries N·P.)");
    n.say("Sharded: the same 2(N-1)/N·P per device as DDP, split around the optimizer step (above).");
    n.say("Stage 3: about 3(N-1)/N·P per device (" + format_bytes(3.0 * (N - 1) / N * P) +
          "): the parameters are gathered for forward and again for backward, and");
    n.say("     the gradients reduce-scattered; no device ever holds all of them between steps.");
    n.say("Measured here, per iteration: DP " + spread(dpr.times()) + ", DDP " + spread(ddpr.times()) +
          ", Sharded stage " + std::to_string(stage) + " " + spread(shr.times()) + ", stage 3 " +
          spread(sh3.times()) + ".");
    auto range = [](const Run& r) {
      auto t = r.times();
      auto [lo, hi] = std::minmax_element(t.begin(), t.end());
      return std::pair{*lo, *hi};
    };
    auto [dlo, dhi] = range(dpr);
    auto [ulo, uhi] = range(ddpr);
    if (dhi < ulo || uhi < dlo)
      n.say("DP and DDP times do not overlap in these " + std::to_string(iterations) + " iterations: " +
            (dhi < ulo ? std::string("DP") : std::string("DDP")) +
            " was faster in every one of them — on this machine, this model and this batch only.");
    else
      n.say("DP's and DDP's times overlap: these " + std::to_string(iterations) +
            " iterations do not say which design is faster here. Run more (--iterations) on a quiet machine, "
            "or samples/dp_vs_ddp for throughput over many steps.");
    n.say("Same result: every design scales each shard's loss so the SUM over devices is the full-batch mean");
    n.say("and sums in the same device order, so the parameters agree: max |DP − DDP| = " + diff_text(diff) +
          ", max |DDP − Sharded| = " + diff_text(diff_sh) + ", max |DDP − stage 3| = " + diff_text(diff_sh3) +
          ".");
    if (!trace_path.empty()) {
      write_trace(trace_path, {&dpr, &ddpr, &shr, &sh3});
      n.say("Trace: " + trace_path + " (open in https://ui.perfetto.dev: one track per worker and comm thread).");
    }
    if (json) {
      auto phases = [&](const Run& r) {
        nlohmann::json j = nlohmann::json::array();
        for (auto& d : r.med().stats.devices) {
          nlohmann::json pd{{"device", d.device.str()}, {"peak_memory_bytes", d.peak_memory_bytes}};
          for (int p = 0; p < static_cast<int>(dp::parallel::Phase::kCount); ++p)
            pd[dp::parallel::phase_name(static_cast<dp::parallel::Phase>(p))] = d.ms[p];
          j.push_back(pd);
        }
        return j;
      };
      auto timing = [&](const Run& r) {
        auto t = r.times();
        return nlohmann::json{{"median_ms", median_of(t)},
                              {"min_ms", *std::min_element(t.begin(), t.end())},
                              {"max_ms", *std::max_element(t.begin(), t.end())},
                              {"all_ms", t}};
      };
      jsharded["loss"] = shr.iters.back().loss;
      jsharded["iteration"] = timing(shr);
      jsharded["phase_ms"] = phases(shr);
      jstage3["loss"] = sh3.iters.back().loss;
      jstage3["iteration"] = timing(sh3);
      jstage3["phase_ms"] = phases(sh3);
      nlohmann::json out{{"sample", "teach"},
                         {"devices", ndev},
                         {"hardware_threads", cores},
                         {"global_batch", batch_size},
                         {"iterations", iterations},
                         {"param_bytes", P},
                         {"dp", {{"loss", dpr.iters.back().loss},
                                 {"iteration", timing(dpr)},
                                 {"bytes_through_device0", dp_bytes_dev0},
                                 {"bytes_other_device", dp_bytes_other},
                                 {"phase_ms", phases(dpr)}}},
                         {"ddp", {{"loss", ddpr.iters.back().loss},
                                  {"iteration", timing(ddpr)},
                                  {"bytes_per_device", ddp_bytes_dev},
                                  {"buckets", jbuckets},
                                  {"phase_ms", phases(ddpr)}}},
                         {"sharded", jsharded},
                         {"stage3", jstage3},
                         {"mixed_precision", jmixed},
                         {"max_param_diff_stage3", diff_sh3},
                         {"max_param_diff", diff},
                         {"max_param_diff_sharded", diff_sh},
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
