// samples/dp_vs_ddp — the three designs side by side on 1..N devices: single device,
// DP, DDP and Sharded (one row per ZeRO stage in --stages).
//
// For each configuration the same model (same seed, same synthetic batches) trains
// `--warmup` untimed steps, then `--steps` timed ones. Reported: samples/s, speedup
// over one device without DataParallel, scaling efficiency (speedup / devices), the
// per-step phase breakdown from model.stats() (device 0 and the max over devices) and
// peak memory per device, split into parameters, gradients, optimizer state and
// activations (Note [Memory split]). Optional outputs: --json (one object per
// configuration and line), --csv FILE, --trace DIR (a Chrome/Perfetto trace per
// configuration, recorded over --trace-steps extra steps) and --plot DIR (PNG charts
// through gnuplot: throughput, phases, memory). Runs unchanged under mpirun (Note
// [Across processes in the benchmark]).
//
//   dp_vs_ddp --model mlp --devices 1,2,4 --optimizer adam --stages 1,2,3
//   dp_vs_ddp --model gpt --devices 4 --optimizer adamw     # where ZeRO pays: parameters and state dominate
//   mpirun -np 2 --bind-to none dp_vs_ddp --model mlp --devices 1,2 --batch 256
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/models.h"
#include "common/options.h"
#include "common/util.h"
#include "dp/dp.h"

namespace {

using Clock = std::chrono::steady_clock;
using dp::parallel::Phase;
namespace fs = std::filesystem;
namespace dist = dp::dist;
using Collective = dp::comm::Communicator::Collective;
constexpr int kCollectives = dp::comm::Communicator::ProcessTimes::kKinds;

// Note [Across processes in the benchmark]
// Under `mpirun -np K` --batch is the GLOBAL batch, as in fashion_mnist_cnn: process p
// trains on rows [p B/K, (p+1) B/K) of every synthetic batch (its own part of the data)
// and DataParallel splits those over its n devices: K x n devices in all, the same
// global batches as one process would train. Each process times its own steps: its
// samples/s = its rows x steps / its seconds, and the global figure is the sum over the
// processes (they step in lockstep, so their times agree to the skew of the last
// collective). The single-device baseline (speedup, and efficiency = speedup / world
// devices) is process 0's device 0 alone on the whole global batch, while the others
// wait for it. Phases: device 0 of process 0 / the max over every device of the job.
// "x-proc" is the time the collectives spent crossing processes (Note [Inter-process
// time], dp/comm/communicator.h): the DDP all-reduce's and Sharded's reduce-scatter and
// all-gather's process-level steps, DP's all-reduce of device 0's sum, the buffer
// broadcast — a part of the AR/RS, AG, reduce and repl/bcast columns, not added to
// them (and, like them, including the wait for the slowest process). Process 0 prints
// and writes the CSV and charts (its devices' memory split); every process writes its
// own trace (suffix _p<rank>).

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
    {Phase::AllReduceExposed, "allreduce_exposed", "AR/RS exp"},
    {Phase::AllReduceHidden, "allreduce_hidden", "AR/RS hid"},
    {Phase::Step, "step", "step"},
    {Phase::AllGather, "allgather", "AG"},
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
  std::string optimizer = "sgd";
  std::string stages = "1,2,3";
  std::string path = "worker";
  std::string precision = "fp32";  // fp32 | bf16 | fp16 (with a GradScaler)
  bool channels_last = false;       // image batches laid out N x H x W x C (Note [Channels-last tensors])
  std::string reduce_dtype = "fp32";  // fp32 | bf16 | fp16: gradients on the wire
  bool reduce_given = false;          // --reduce-dtype was passed (else it follows --param-dtype)
  std::string param_dtype = "fp32";   // fp32 | bf16 | fp16: the devices' compute copy of the parameters
  bool json = false;
  std::string csv, trace_dir, plot_dir;
  int trace_steps = 2;
};

// Note [Memory split]
// The allocator counts every byte a device holds (dp::memory_allocated), not what the
// bytes are for. The split attributes the known sizes and leaves the rest:
//  - parameters: the bytes of the device's flat data buffer (its copy in the
//    parameter set; DP's replicas too, they are kept between steps);
//  - gradients: its flat gradient buffer, or, where a sharded set keeps only its
//    range's gradient (stages 2 and 3), that range: the per-parameter gradients a
//    backward produces live only until their bucket is reduce-scattered, and count
//    with the transient bytes below;
//  - parameters in stage 3: the device's range; the gathered unit is transient;
//  - optimizer state: (state tensors per parameter, read from the optimizer's
//    state_dict) x (parameter elements the device steps: all of them, its shard in
//    Sharded mode, none on DP's replicas) x 4 bytes;
//  - activations = peak - the three above: saved activations, outputs, the input
//    shard, the collectives' workspace, and in stages 2 and 3 the gradients in
//    flight and the gathered parameters of a unit.
// Peak and between-steps figures are counted from what the device held before the
// configuration started (the sample's input batches live on device 0).
struct Memory {
  std::size_t params = 0, grads = 0, state = 0, activations = 0;
  std::size_t peak = 0;           // max_memory_allocated over the timed steps
  std::size_t between_steps = 0;  // memory_allocated after the last timed step
};

// A design as the tables name it: "single", "DP", "DDP", "Sharded-1", ...
struct Design {
  dp::Mode mode = dp::Mode::DP;
  int stage = 0;  // Sharded's ZeRO stage; 0 for the designs without stages
  std::string name() const {
    return stage > 0 ? std::string(dp::mode_name(mode)) + "-" + std::to_string(stage) : dp::mode_name(mode);
  }
};

struct Result {
  std::string mode;  // "single", "DP", "DDP", "Sharded-<stage>"
  int stage = 0;     // the ZeRO stage of a Sharded row, else 0
  int devices = 1;   // per process
  int processes = 1;
  std::int64_t rows = 0;  // per process and step
  double seconds = 0;     // this process's timed steps
  double samples_per_s = 0;               // global: the sum of per_process
  std::vector<double> per_process;        // samples/s of each process (Note [Across processes in the benchmark])
  double xproc_dev0 = 0, xproc_max = 0;   // ms per step crossing processes
  double xproc_ms[kCollectives] = {};     // device 0 of process 0, per collective, per step
  double xproc_calls[kCollectives] = {};
  double xproc_bytes[kCollectives] = {};
  std::size_t peak_other = 0;             // peak memory, max over the job's devices but process 0's device 0
  double speedup = 0, efficiency = 0;
  double phase_dev0[kNumPhases] = {};
  double phase_max[kNumPhases] = {};
  std::vector<std::size_t> peak_memory;  // bytes per device
  std::vector<Memory> memory;            // per device (Note [Memory split])
  double loss_first = 0, loss_last = 0;
  double grad_bytes_dev0 = 0;  // per step: gradient bytes device 0 put into collectives (Stats::grad_bytes)
  std::string trace_path;
};

// Cross-entropy; a language model's (B, T, V) logits and (B, T) targets count every token.
dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) {
  if (out.dim() == 3) return dp::nn::cross_entropy(out.reshape({-1, out.size(-1)}), y.reshape({-1}));
  return dp::nn::cross_entropy(out, y);
}

std::string trace_file(const Args& a, const std::string& mode, int n, int processes) {
  const std::string rank = processes > 1 ? "_p" + std::to_string(dist::rank()) : "";
  return (fs::path(a.trace_dir) / ("trace_" + a.model + "_" + mode + "_" + std::to_string(n) + rank + ".json"))
      .string();
}

std::unique_ptr<dp::optim::Optimizer> make_optimizer(const Args& a, const dp::nn::ParameterList& params) {
  if (a.optimizer == "adam") return std::make_unique<dp::optim::Adam>(params, dp::optim::AdamOptions{.lr = a.lr});
  if (a.optimizer == "adamw")
    return std::make_unique<dp::optim::AdamW>(params, dp::optim::AdamWOptions{.lr = a.lr, .weight_decay = 0.1});
  return std::make_unique<dp::optim::SGD>(params, dp::optim::SGDOptions{.lr = a.lr, .momentum = 0.9});
}

std::string optimizer_label(const Args& a) {
  if (a.optimizer == "adamw") return "AdamW(lr " + samples::fmt(a.lr, 4) + ", weight decay 0.1)";
  return a.optimizer == "adam" ? "Adam(lr " + samples::fmt(a.lr, 4) + ")"
                               : "SGD(lr " + samples::fmt(a.lr, 4) + ", momentum 0.9)";
}

// State tensors the optimizer keeps per parameter (SGD with momentum 1, Adam 2): the
// names of parameter 0's entries in its state_dict ("state.0.exp_avg", ...).
// A Sharded optimizer's state_dict is collective across processes (every process calls
// this at the same point); should it fail there, the count the optimizer is known to keep.
int state_tensors_per_parameter(const Args& a, dp::optim::Optimizer& opt) {
  try {
    int k = 0;
    for (const auto& [name, t] : opt.state_dict())
      if (name.rfind("state.0.", 0) == 0) ++k;
    return k;
  } catch (const dp::Error&) {
    if (!dist::is_distributed()) throw;
    return a.optimizer == "sgd" ? 1 : 2;
  }
}

std::size_t used_since(std::size_t now, std::size_t base) { return now > base ? now - base : 0; }

// Note [Memory split] for the device of copy `r` of `set`.
Memory split_memory(const dp::nn::ParameterSet& set, int r, int state_tensors, std::size_t peak,
                    std::size_t between_steps) {
  const dp::nn::ParameterCopy& c = set.copy(r);
  const dp::nn::CopySpan span = dp::nn::copy_span(set, r);  // what its optimizer step owns
  Memory m;
  m.peak = peak;
  m.between_steps = between_steps;
  m.params = c.data.defined() ? 4 * static_cast<std::size_t>(c.data.numel()) : 0;
  if (c.grad.defined()) m.grads = 4 * static_cast<std::size_t>(c.grad.numel());
  else if (span.grad.defined()) m.grads = 4 * static_cast<std::size_t>(span.grad.numel());
  const std::int64_t stepped = c.transient ? 0 : std::max<std::int64_t>(0, std::min(span.end, set.numel()) - span.begin);
  m.state = 4 * static_cast<std::size_t>(state_tensors) * static_cast<std::size_t>(stepped);
  const std::size_t known = m.params + m.grads + m.state;
  m.activations = peak > known ? peak - known : 0;
  return m;
}

// One device, no DataParallel: the baseline. Phases are timed here on the main thread.
Result run_single(const Args& a, const std::vector<dp::data::Batch>& batches) {
  Result r;
  r.mode = "single";
  dp::Device dev = dp::device(0);
  const std::size_t base = dp::memory_allocated(dev);
  auto net = samples::make_model(a.model, a.seed);
  net->to(dev);
  auto optimizer = make_optimizer(a, net->parameters());
  auto& opt = *optimizer;
  dp::parallel::Trace trace;
  double ms[kNumPhases] = {};
  auto since = [](Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  dp::amp::GradScaler scaler({.enabled = a.precision == "fp16"});  // PyTorch's defaults in fp16
  auto step = [&](int i, bool timed) {
    const auto& b = batches[i % batches.size()];
    auto t0 = Clock::now();
    dp::Tensor x = b.data.to(dev), y = b.target.to(dev);
    auto t1 = Clock::now();
    opt.zero_grad();
    dp::Tensor loss;
    {
      const dp::amp::autocast precision = samples::precision_scope(a.precision);
      loss = loss_fn(net->forward(x), y);
    }
    auto t2 = Clock::now();
    scaler.scale(loss).backward();  // --precision fp16: the loss scaled; else loss itself
    auto t3 = Clock::now();
    scaler.step(opt);  // skipped when a float16 gradient overflowed
    scaler.update();
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
  dp::reset_peak_memory(dev);
  std::vector<dp::Tensor> losses;
  auto t0 = Clock::now();
  for (int i = 0; i < a.steps; ++i) losses.push_back(step(a.warmup + i, true));
  losses.back().item();  // waits for the device
  r.seconds = since(t0) / 1e3;
  r.rows = a.batch;
  r.per_process = {static_cast<double>(a.batch) * a.steps / r.seconds};
  r.samples_per_s = r.per_process[0];
  const std::size_t peak = used_since(dp::max_memory_allocated(dev), base);
  r.peak_memory = {peak};
  r.memory = {split_memory(*net->parameters().set(), 0, state_tensors_per_parameter(a, opt), peak,
                           used_since(dp::memory_allocated(dev), base))};
  r.loss_first = losses.front().item();
  r.loss_last = losses.back().item();
  for (int p = 0; p < kNumPhases; ++p) r.phase_dev0[p] = r.phase_max[p] = ms[p] / a.steps;
  if (!a.trace_dir.empty()) {
    trace.enable(true);
    for (int i = 0; i < a.trace_steps; ++i) step(a.warmup + a.steps + i, false).item();
    r.trace_path = trace_file(a, "single", 1, 1);
    trace.write_chrome_json(r.trace_path);
  }
  return r;
}

// The dtype of the gradients on the wire, as a flag value: --reduce-dtype, or
// --param-dtype's when only that was given.
std::string wire_flag(const Args& a) {
  return a.reduce_given || a.param_dtype == "fp32" ? a.reduce_dtype : a.param_dtype;
}

// DataParallel in `design` over devices 0..n-1; phases from model.stats().
Result run_parallel(const Args& a, const Design& design, int n, const std::vector<dp::data::Batch>& batches) {
  Result r;
  r.mode = design.name();
  r.stage = design.stage;
  r.devices = n;
  const std::vector<dp::Device> devices = samples::first_devices(n);
  std::vector<std::size_t> base;
  for (const dp::Device& d : devices) base.push_back(dp::memory_allocated(d));
  auto net = samples::make_model(a.model, a.seed);
  dp::DataParallelOptions options{.mode = design.mode};
  if (design.stage > 0) {
    options.shard_stage = design.stage;
    options.shard_unit = samples::shard_unit(a.model);  // the GPT: a gather unit per block
  }
  options.mixed_precision = samples::mixed_precision_of(wire_flag(a), a.param_dtype);
  dp::DataParallel model(net, devices, options);
  r.processes = model.processes();
  r.rows = batches.front().data.size(0);
  auto optimizer = make_optimizer(a, model.parameters());
  auto& opt = *optimizer;
  int index = 0;
  dp::amp::GradScaler scaler({.enabled = a.precision == "fp16"});  // PyTorch's defaults in fp16
  auto scaled_loss = [&](const dp::Tensor& out, const dp::Tensor& y) { return scaler.scale(loss_fn(out, y)); };
  auto step = [&](int i) {
    const auto& b = batches[i % batches.size()];
    auto t0 = Clock::now();
    opt.zero_grad();
    dp::Tensor loss;
    {
      const dp::amp::autocast precision = samples::precision_scope(a.precision);
      if (a.path == "worker") {
        // Backward runs inside, from each shard's scaled loss; report the true loss.
        loss = model.forward_backward(b.data, b.target, scaled_loss);
        if (scaler.is_enabled()) loss = dp::mul(loss, 1.0 / scaler.get_scale());
      } else {
        loss = loss_fn(model(b.data), b.target);
      }
    }
    if (a.path != "worker") scaler.scale(loss).backward();
    scaler.step(opt);  // skipped when a float16 gradient overflowed, on every device
    scaler.update();
    if (model.trace().enabled())
      model.trace().record("main", "iteration " + std::to_string(index), t0, Clock::now());
    ++index;
    return loss;
  };
  for (int i = 0; i < a.warmup; ++i) step(i).item();
  model.reset_stats();
  dp::comm::Communicator& comm = model.communicator();
  comm.reset_process_times();
  std::vector<dp::Tensor> losses;
  auto t0 = Clock::now();
  for (int i = 0; i < a.steps; ++i) losses.push_back(step(a.warmup + i));
  losses.back().item();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  dp::parallel::Stats s = model.stats();
  r.grad_bytes_dev0 = static_cast<double>(s.devices[0].grad_bytes) / a.steps;
  for (int p = 0; p < kNumPhases; ++p) {
    r.phase_dev0[p] = s.devices[0][kPhases[p].phase] / a.steps;
    for (auto& d : s.devices) r.phase_max[p] = std::max(r.phase_max[p], d[kPhases[p].phase] / a.steps);
  }
  // Note [Across processes in the benchmark]: every process's figure, and the job's maxima.
  const int procs = r.processes;
  r.per_process.assign(static_cast<std::size_t>(procs), 0.0);
  r.per_process[static_cast<std::size_t>(model.processes() > 1 ? dist::rank() : 0)] =
      static_cast<double>(r.rows) * a.steps / r.seconds;
  for (int i = 0; i < n; ++i) {
    const dp::comm::Communicator::ProcessTimes t = comm.process_times(i);
    r.xproc_max = std::max(r.xproc_max, t.total_ms() / a.steps);
    if (i > 0) continue;
    r.xproc_dev0 = t.total_ms() / a.steps;
    for (int k = 0; k < kCollectives; ++k) {
      r.xproc_ms[k] = t.ms[k] / a.steps;
      r.xproc_calls[k] = static_cast<double>(t.calls[k]) / a.steps;
      r.xproc_bytes[k] = static_cast<double>(t.bytes[k]) / a.steps;
    }
  }
  const auto& set = *model.parameters().set();
  std::vector<std::size_t> between;
  for (int i = 0; i < n; ++i) between.push_back(used_since(dp::memory_allocated(devices[i]), base[i]));
  const int state_tensors = state_tensors_per_parameter(a, opt);
  for (int i = 0; i < n; ++i) {
    const std::size_t peak = used_since(s.devices[i].peak_memory_bytes, base[i]);
    int copy = -1;
    for (int c = 0; c < set.num_copies(); ++c)
      if (set.copy(c).device == s.devices[i].device) copy = c;
    r.peak_memory.push_back(peak);
    if (copy >= 0) {
      r.memory.push_back(split_memory(set, copy, state_tensors, peak, between[i]));
    } else {  // a device without a copy of the parameters (none today): all activations
      r.memory.push_back({.activations = peak, .peak = peak, .between_steps = between[i]});
    }
  }
  r.loss_first = losses.front().item();
  r.loss_last = losses.back().item();
  // This process's devices but (on process 0) device 0: the "others" of the job.
  for (int i = dist::rank() == 0 ? 1 : 0; i < n; ++i) r.peak_other = std::max(r.peak_other, r.peak_memory[i]);
  if (procs > 1) {
    dist::all_reduce(std::span<double>(r.per_process), dist::Op::Sum);
    std::vector<double> maxima(r.phase_max, r.phase_max + kNumPhases);
    maxima.push_back(r.xproc_max);
    maxima.push_back(static_cast<double>(r.peak_other));
    dist::all_reduce(std::span<double>(maxima), dist::Op::Max);
    std::copy(maxima.begin(), maxima.begin() + kNumPhases, r.phase_max);
    r.xproc_max = maxima[kNumPhases];
    r.peak_other = static_cast<std::size_t>(maxima[kNumPhases + 1]);
    // The losses of the global batch: each process's rows weighted, over the job's rows.
    double sums[] = {r.loss_first * static_cast<double>(r.rows), r.loss_last * static_cast<double>(r.rows)};
    dist::all_reduce(std::span<double>(sums), dist::Op::Sum);
    r.loss_first = sums[0] / static_cast<double>(a.batch);
    r.loss_last = sums[1] / static_cast<double>(a.batch);
  }
  r.samples_per_s = 0;
  for (double v : r.per_process) r.samples_per_s += v;
  if (!a.trace_dir.empty()) {
    model.trace().clear();
    model.trace().enable(true);
    index = 0;
    for (int i = 0; i < a.trace_steps; ++i) step(a.warmup + a.steps + i).item();
    model.trace().enable(false);
    r.trace_path = trace_file(a, r.mode, n, procs);
    model.trace().write_chrome_json(r.trace_path);
  }
  return r;
}

nlohmann::json to_json(const Args& a, const Result& r) {
  nlohmann::json j;
  j["model"] = a.model;
  j["mode"] = r.stage > 0 ? "Sharded" : r.mode;
  j["shard_stage"] = r.stage;
  j["devices"] = r.devices;
  j["processes"] = r.processes;
  j["world_devices"] = r.devices * r.processes;
  j["per_process_batch"] = r.rows;
  j["optimizer"] = a.optimizer;
  j["device_kind"] = samples::device_kind();
  j["global_batch"] = a.batch;
  j["steps"] = a.steps;
  j["warmup"] = a.warmup;
  j["path"] = a.path == "worker" ? "forward_backward" : "module";
  j["precision"] = a.precision;
  j["channels_last"] = a.channels_last;
  j["reduce_dtype"] = wire_flag(a);
  j["param_dtype"] = a.param_dtype;
  j["grad_bytes_per_step_device0"] = r.grad_bytes_dev0;
  j["seconds"] = r.seconds;
  j["samples_per_s"] = r.samples_per_s;
  j["samples_per_s_per_process"] = r.per_process;
  j["speedup"] = r.speedup;
  j["efficiency"] = r.efficiency;
  nlohmann::json d0, mx;
  for (int p = 0; p < kNumPhases; ++p) {
    d0[kPhases[p].key] = r.phase_dev0[p];
    mx[kPhases[p].key] = r.phase_max[p];
  }
  j["phase_ms_device0"] = d0;
  j["phase_ms_max"] = mx;
  j["interprocess_ms_device0"] = r.xproc_dev0;
  j["interprocess_ms_max"] = r.xproc_max;
  nlohmann::json by;
  for (int k = 0; k < kCollectives; ++k)
    by[dp::comm::Communicator::collective_name(static_cast<Collective>(k))] = {
        {"ms", r.xproc_ms[k]}, {"calls", r.xproc_calls[k]}, {"bytes", r.xproc_bytes[k]}};
  j["interprocess_per_step_device0"] = by;
  j["peak_memory_bytes"] = r.peak_memory;
  nlohmann::json mem;
  auto field = [&](const char* key, std::size_t Memory::*f) {
    std::vector<std::size_t> v;
    for (const Memory& m : r.memory) v.push_back(m.*f);
    mem[key] = v;
  };
  field("parameters", &Memory::params);
  field("gradients", &Memory::grads);
  field("optimizer_state", &Memory::state);
  field("activations", &Memory::activations);
  field("between_steps", &Memory::between_steps);
  j["memory_bytes"] = mem;
  j["loss_first"] = r.loss_first;
  j["loss_last"] = r.loss_last;
  j["trace"] = r.trace_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.trace_path);
  return j;
}

std::size_t max_other_memory(const Result& r) { return r.peak_other; }

std::string mb(std::size_t bytes) { return samples::fmt(bytes / 1e6, 2); }

// The memory split of every design at the largest device count, one row per device.
void print_memory(const std::vector<Result>& results) {
  int n = 0;
  for (auto& r : results) n = std::max(n, r.devices);
  std::cout << "\npeak memory per device in MB (1 MB = 10^6 bytes) at " << n << " device(s)"
            << (dist::world_size() > 1 ? " (process 0's)" : "")
            << ", and the single device; what the device held between steps in the last column\n";
  samples::Table t({"mode", "device", "parameters", "gradients", "optim state", "activations", "peak",
                    "between steps"});
  for (auto& r : results) {
    if (r.devices != n && r.mode != "single") continue;
    for (std::size_t i = 0; i < r.memory.size(); ++i) {
      const Memory& m = r.memory[i];
      t.add({r.mode, std::to_string(i), mb(m.params), mb(m.grads), mb(m.state), mb(m.activations), mb(m.peak),
             mb(m.between_steps)});
    }
  }
  t.print(std::cout);
  std::cout << "method: the allocator's peak (dp::max_memory_allocated over the timed steps) and its count "
               "after the last step (dp::memory_allocated), less what the device held before the "
               "configuration was built; parameters = the device's flat parameter buffer (Sharded stage 3: its "
               "range); gradients = its flat gradient buffer (Sharded stages 2 and 3: its range's gradient); "
               "optimizer state = state tensors per parameter in the "
               "optimizer's state_dict x elements the device steps (all; its 1/N shard in Sharded; none on "
               "DP's replicas) x 4 bytes; activations = peak - the three (saved activations, outputs, the "
               "input shard, collective workspace; in stages 2 and 3 also the gradients in flight and the "
               "gathered unit).\n";
}

void print_tables(const Args& a, const std::vector<Result>& results) {
  const int procs = dist::world_size();
  std::vector<std::string> head{"mode", "devices"};
  if (procs > 1) head.insert(head.end(), {"processes", "world devices"});
  head.insert(head.end(), {"batch", "samples/s", "speedup", "efficiency", "ms/step", "grad wire/step",
                           "peak mem dev0", "peak mem max(others)"});
  samples::Table t(head);
  for (auto& r : results) {
    std::vector<std::string> row{r.mode, std::to_string(r.devices)};
    if (procs > 1) row.insert(row.end(), {std::to_string(r.processes), std::to_string(r.devices * r.processes)});
    row.insert(row.end(), {std::to_string(a.batch), samples::fmt(r.samples_per_s, 1),
                           samples::fmt(r.speedup, 2) + "x", samples::fmt(100 * r.efficiency, 0) + "%",
                           samples::fmt(1e3 * r.seconds / a.steps, 1),
                           r.grad_bytes_dev0 > 0 ? samples::format_bytes(r.grad_bytes_dev0) : "-",
                           samples::format_bytes(r.peak_memory[0]),
                           r.devices * r.processes > 1 ? samples::format_bytes(max_other_memory(r)) : "-"});
    t.add(row);
  }
  t.print(std::cout);
  if (procs > 1) {
    // The per-process table (Note [Across processes in the benchmark]).
    std::cout << "\nsamples/s per process (" << procs << " processes, " << a.batch / procs
              << " rows each per step; each process's rows x steps / its own time) and global = their sum; "
                 "the single device is process 0's alone on the global batch of "
              << a.batch << "\n";
    std::vector<std::string> ph{"mode", "devices"};
    for (int p = 0; p < procs; ++p) ph.push_back("process " + std::to_string(p));
    ph.push_back("global");
    samples::Table pt(ph);
    for (auto& r : results) {
      std::vector<std::string> row{r.mode, std::to_string(r.devices)};
      for (int p = 0; p < procs; ++p)
        row.push_back(r.processes == procs ? samples::fmt(r.per_process[static_cast<std::size_t>(p)], 1)
                      : p == 0        ? samples::fmt(r.per_process[0], 1)
                                      : "-");
      row.push_back(samples::fmt(r.samples_per_s, 1));
      pt.add(row);
    }
    pt.print(std::cout);
  }
  std::cout << "\nper-step phases in ms, device 0" << (procs > 1 ? " of process 0" : "")
            << " / max over devices" << (procs > 1 ? " of every process" : "")
            << " (AR/RS = DDP's all-reduce or "
               "Sharded's reduce-scatter: exp = exposed after backward, hid = hidden under backward; "
               "AG = Sharded's all-gather of the updated ranges"
            << (procs > 1 ? "; x-proc = the part of AR/RS, AG, reduce and repl/bcast spent crossing processes, "
                            "its own wait for the slowest process included: not added to them"
                          : "")
            << ")\n";
  std::vector<std::string> phead{"mode", "devices"};
  for (auto& p : kPhases) phead.push_back(p.column);
  if (procs > 1) phead.push_back("x-proc");
  samples::Table ph(phead);
  for (auto& r : results) {
    std::vector<std::string> row{r.mode, std::to_string(r.devices)};
    for (int p = 0; p < kNumPhases; ++p)
      row.push_back(samples::fmt(r.phase_dev0[p], 1) + "/" + samples::fmt(r.phase_max[p], 1));
    if (procs > 1) row.push_back(samples::fmt(r.xproc_dev0, 1) + "/" + samples::fmt(r.xproc_max, 1));
    ph.add(row);
  }
  ph.print(std::cout);
  if (procs > 1) {
    std::cout << "\ncrossing processes per step on device 0 of process 0, by collective: ms / calls / MB "
                 "(payload as nccl-tests' size, 1 MB = 10^6 bytes)\n";
    std::vector<std::string> chead{"mode", "devices"};
    for (int k = 0; k < kCollectives; ++k) chead.push_back(dp::comm::Communicator::collective_name(static_cast<Collective>(k)));
    samples::Table ct(chead);
    for (auto& r : results) {
      if (r.processes == 1) continue;
      std::vector<std::string> row{r.mode, std::to_string(r.devices)};
      for (int k = 0; k < kCollectives; ++k)
        row.push_back(r.xproc_calls[k] == 0 ? "-"
                                            : samples::fmt(r.xproc_ms[k], 2) + " / " + samples::fmt(r.xproc_calls[k], 0) +
                                                  " / " + samples::fmt(r.xproc_bytes[k] / 1e6, 2));
      ct.add(row);
    }
    ct.print(std::cout);
  }
  print_memory(results);
}

void write_csv(const Args& a, const std::vector<Result>& results) {
  std::ofstream f(a.csv);
  if (!f) throw std::runtime_error("--csv: cannot open '" + a.csv + "' for writing");
  f << "model,mode,shard_stage,devices,global_batch,steps,optimizer,samples_per_s,speedup,efficiency";
  for (auto& p : kPhases) f << "," << p.key << "_ms_dev0," << p.key << "_ms_max";
  f << ",peak_mem_dev0_bytes,peak_mem_max_other_bytes,params_dev0_bytes,grads_dev0_bytes,"
       "optimizer_state_dev0_bytes,activations_dev0_bytes,between_steps_dev0_bytes,loss_first,loss_last,"
       "processes,world_devices,per_process_batch,interprocess_ms_dev0,interprocess_ms_max\n";
  for (auto& r : results) {
    const Memory& m = r.memory[0];
    f << a.model << "," << (r.stage > 0 ? "Sharded" : r.mode) << "," << r.stage << "," << r.devices << ","
      << a.batch << "," << a.steps << "," << a.optimizer << "," << r.samples_per_s << "," << r.speedup << ","
      << r.efficiency;
    for (int p = 0; p < kNumPhases; ++p) f << "," << r.phase_dev0[p] << "," << r.phase_max[p];
    f << "," << r.peak_memory[0] << "," << max_other_memory(r) << "," << m.params << "," << m.grads << ","
      << m.state << "," << m.activations << "," << m.between_steps << "," << r.loss_first << "," << r.loss_last
      << "," << r.processes << "," << r.devices * r.processes << "," << r.rows << "," << r.xproc_dev0 << ","
      << r.xproc_max << "\n";
  }
  if (!f) throw std::runtime_error("--csv: writing '" + a.csv + "' failed");
}

// Charts through gnuplot: throughput vs devices per design, stacked phase bars, and
// stacked memory bars per design and device (at the largest device count).
void write_plots(const Args& a, const std::vector<Result>& results) {
  fs::create_directories(a.plot_dir);
  fs::path dir(a.plot_dir);
  double single = 0;
  std::vector<std::string> designs;                    // in run order, "single" left out
  std::map<int, std::map<std::string, double>> by_n;  // devices → design → samples/s
  int n_max = 1;
  for (auto& r : results) {
    n_max = std::max(n_max, r.devices);
    if (r.mode == "single") {
      single = r.samples_per_s;
      continue;
    }
    if (std::find(designs.begin(), designs.end(), r.mode) == designs.end()) designs.push_back(r.mode);
    by_n[r.devices][r.mode] = r.samples_per_s;
  }
  {
    std::ofstream f(dir / "throughput.dat");
    f << "# devices";
    for (auto& d : designs) f << " " << d;
    f << " single\n";
    for (auto& [n, v] : by_n) {
      f << n;
      for (auto& d : designs) {
        if (v.count(d)) f << " " << v.at(d);
        else f << " NaN";
      }
      f << " " << single << "\n";
    }
  }
  {
    // Critical-path phases only: the hidden all-reduce / reduce-scatter overlaps backward.
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
  {
    std::ofstream f(dir / "memory.dat");
    f << "config parameters gradients optimizer_state activations\n";
    for (auto& r : results) {
      if (r.devices != n_max && r.mode != "single") continue;
      for (std::size_t i = 0; i < r.memory.size(); ++i) {
        const Memory& m = r.memory[i];
        f << r.mode << ":d" << i << " " << m.params / 1e6 << " " << m.grads / 1e6 << " " << m.state / 1e6 << " "
          << m.activations / 1e6 << "\n";
      }
    }
  }
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::cerr << "note: gnuplot is not installed, so no PNG charts were drawn; the data is in "
              << (dir / "throughput.dat") << ", " << (dir / "phases.dat") << " and " << (dir / "memory.dat")
              << " (apt-get install gnuplot to get the charts)\n";
    return;
  }
  std::string title = a.model + ", global batch " + std::to_string(a.batch) + ", " + samples::device_kind();
  fs::path script = dir / "charts.gp";
  {
    std::ofstream g(script);
    g << "set terminal pngcairo size 900,540 noenhanced\n"
      << "set datafile commentschars '#'\n"
      << "set datafile missing 'NaN'\n"
      << "set output '" << (dir / "throughput.png").string() << "'\n"
      << "set title 'Throughput vs devices (" << title << ")'\n"
      << "set xlabel 'devices'\nset ylabel 'samples/s'\nset xtics 1\nset grid\nset key left top\n"
      << "set yrange [0:*]\n"
      << "plot ";
    for (std::size_t d = 0; d < designs.size(); ++d)
      g << (d == 0 ? "'" + (dir / "throughput.dat").string() + "'" : std::string("''")) << " using 1:" << d + 2
        << " with linespoints lw 2 pt " << 5 + 2 * d << " title '" << designs[d] << "', ";
    g << "'" << (dir / "throughput.dat").string() << "' using 1:" << designs.size() + 2
      << " with lines dt 2 lw 2 title 'single device (no wrapper)'\n"
      << "set output '" << (dir / "phases.png").string() << "'\n"
      << "set title 'Per-step phases on device 0, critical path (" << title << ")'\n"
      << "unset xlabel\nset ylabel 'ms per step'\nset xtics rotate by -30\nset key outside right\n"
      << "set style data histograms\nset style histogram rowstacked\n"
      << "set style fill solid 0.85 border -1\nset boxwidth 0.7\n"
      << "plot for [i=2:" << kNumPhases << "] '" << (dir / "phases.dat").string()
      << "' using i:xtic(1) title columnheader(i)\n"
      << "set terminal pngcairo size 1100,540 noenhanced\n"
      << "set output '" << (dir / "memory.png").string() << "'\n"
      << "set title 'Peak memory per device, " << n_max << " devices (" << title << ", " << optimizer_label(a)
      << ")'\n"
      << "set ylabel 'MB (10^6 bytes)'\nset xtics rotate by -45 font ',9'\n"
      << "plot for [i=2:5] '" << (dir / "memory.dat").string() << "' using i:xtic(1) title columnheader(i)\n";
  }
  std::string cmd = "gnuplot '" + script.string() + "'";
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("gnuplot failed on " + script.string());
  if (!a.json)
    std::cout << "\ncharts: " << (dir / "throughput.png").string() << ", " << (dir / "phases.png").string() << ", "
              << (dir / "memory.png").string() << "\n";
}

// The Sharded stages of --stages: a comma-separated list of 1..3, no repeats.
std::vector<int> parse_stages(const std::string& text) {
  std::vector<int> stages;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    if (item.size() != 1 || item[0] < '1' || item[0] > '3')
      throw std::invalid_argument("--stages: expected ZeRO stages from 1 to 3 separated by commas (e.g. 1,2,3), "
                                  "got '" + text + "'");
    const int stage = item[0] - '0';
    if (std::find(stages.begin(), stages.end(), stage) != stages.end())
      throw std::invalid_argument("--stages: stage " + item + " appears twice in '" + text + "'");
    stages.push_back(stage);
    at = comma + 1;
  }
  return stages;
}

// True when DataParallel takes this design; a stage it reports as not implemented is
// skipped with a note, any other refusal is an error.
// Across processes (the probe is then collective and refuses alike on every process)
// any refusal is a skip: a design may exist within a process only.
bool design_available(const Design& design) {
  if (design.stage == 0) return true;
  try {
    dp::DataParallel probe(samples::make_model("mlp", 1), samples::first_devices(1),
                           {.mode = design.mode, .shard_stage = design.stage});
    return true;
  } catch (const dp::Error& e) {
    if (std::string(e.what()).find("not implemented") == std::string::npos && !dist::is_distributed()) throw;
    if (dist::is_main()) std::cerr << "note: skipping " << design.name() << ": DataParallel says: " << e.what() << "\n";
    return false;
  }
}

int run(const Args& a, const std::vector<int>& counts, const std::vector<int>& stages) {
  std::int64_t params = samples::make_model(a.model, a.seed)->parameters().set()->numel();
  std::vector<Design> designs{{dp::Mode::DP, 0}, {dp::Mode::DDP, 0}};
  for (int stage : stages) designs.push_back({dp::Mode::Sharded, stage});
  std::erase_if(designs, [](const Design& d) { return !design_available(d); });
  const int procs = dist::world_size();
  if (!a.json) {
    std::cout << "dp_vs_ddp: model " << a.model << " (" << params << " parameters, "
              << samples::format_bytes(4.0 * params) << " of gradients), global batch " << a.batch;
    if (procs > 1)
      std::cout << " (" << procs << " processes x " << a.batch / procs << " rows, each process its own rows)";
    std::cout << ", "
              << a.steps << " timed steps after " << a.warmup << " warm-up, "
              << (a.path == "worker" ? "model.forward_backward(x, y, loss)" : "loss(model(x)).backward()")
              << ", " << optimizer_label(a) << ", " << a.precision << (a.channels_last ? ", channels-last" : "")
              << (a.param_dtype != "fp32" ? ", parameters computed in " + a.param_dtype : std::string())
              << ", gradients on the wire in " << wire_flag(a) << ", seed " << a.seed << "\n"
              << "devices: " << samples::device_kind() << ", " << dp::hardware_concurrency()
              << " hardware threads\n\n";
  }
  // Note [Across processes in the benchmark]: the global batches, and this process's rows of them.
  auto batches = a.model == "gpt" ? samples::token_batches(a.batch, 4, a.seed)
                                  : samples::synthetic_batches(samples::example_shape(a.model), a.batch, 4, a.seed);
  if (a.channels_last)
    for (auto& b : batches)
      if (b.data.dim() == 4) b.data = b.data.contiguous(dp::MemoryFormat::ChannelsLast);
  std::vector<dp::data::Batch> mine = batches;
  if (procs > 1) {
    const std::int64_t rows = a.batch / procs;
    for (auto& b : mine) {
      b.data = b.data.narrow(0, dist::rank() * rows, rows).clone();
      b.target = b.target.narrow(0, dist::rank() * rows, rows).clone();
    }
  }
  if (!a.trace_dir.empty()) fs::create_directories(a.trace_dir);
  std::vector<Result> results;
  auto finish = [&](Result r) {
    double base = results.empty() ? r.samples_per_s : results.front().samples_per_s;
    r.speedup = r.samples_per_s / base;
    r.efficiency = r.speedup / (r.devices * r.processes);
    if (dist::is_main()) {
      if (a.json) std::cout << to_json(a, r).dump() << std::endl;
      else std::cerr << "  done: " << r.mode << " on " << r.devices << " device(s)"
                     << (r.processes > 1 ? " x " + std::to_string(r.processes) + " processes" : "") << ", "
                     << samples::fmt(r.samples_per_s, 1) << " samples/s\n";
    }
    results.push_back(std::move(r));
  };
  if (dist::is_main()) {
    finish(run_single(a, batches));
  } else {
    // Process 0's device alone is the baseline; its figure reaches every process below.
    Result r;
    r.mode = "single";
    results.push_back(r);
  }
  if (procs > 1) results.front().samples_per_s = dist::broadcast_object(results.front().samples_per_s, 0);
  for (const Design& design : designs)
    for (int n : counts) finish(run_parallel(a, design, n, mine));
  if (!dist::is_main()) return 0;
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
  CLI::App app{"Single device, DP, DDP and Sharded (ZeRO stages) side by side on 1..N devices: "
               "throughput, scaling, phase breakdown, memory split; synthetic data, fixed seeds."};
  Args a;
  app.add_option("--model", a.model,
                 "cnn (Fashion-MNIST CNN), mlp (784-1024-1024-10), resnet18 (CIFAR) or gpt (6 blocks, width 256, "
                 "context 64: 4.8 M parameters; batch 16 unless --batch)")
      ->check(CLI::IsMember({"cnn", "mlp", "resnet18", "gpt"}))
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
  app.add_option("--batch", a.batch,
                 "global batch size (split over the devices; under mpirun over the processes first, each "
                 "taking batch / processes rows)")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--seed", a.seed, "seed of the model and the data")->capture_default_str();
  app.add_option("--lr", a.lr, "learning rate")->check(CLI::Range(1e-9, 10.0))->capture_default_str();
  app.add_option("--optimizer", a.optimizer,
                 "sgd (momentum 0.9: one state tensor per parameter), adam or adamw (weight decay 0.1; two)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->capture_default_str();
  app.add_option("--stages", a.stages,
                 "ZeRO stages of the Sharded rows, e.g. 1,2,3; a stage this build does not implement is "
                 "skipped with a note")
      ->capture_default_str();
  samples::add_path_option(app, a.path);
  samples::add_precision_option(app, a.precision, /*fp16=*/true);
  app.add_flag("--channels-last", a.channels_last,
               "lay image batches out channels-last (N x H x W x C): convolutions, batch norms and elementwise ops "
               "then compute in that layout, as PyTorch's torch.channels_last");
  samples::add_reduce_dtype_option(app, a.reduce_dtype);
  samples::add_param_dtype_option(app, a.param_dtype);
  app.add_flag("--json", a.json, "print one JSON object per configuration (one per line) instead of tables");
  app.add_option("--csv", a.csv, "also write the results as CSV to FILE");
  app.add_option("--trace", a.trace_dir, "write a Chrome/Perfetto trace per configuration into DIR");
  app.add_option("--trace-steps", a.trace_steps, "steps recorded in each trace (after the timed ones)")
      ->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--plot", a.plot_dir, "draw PNG charts into DIR (needs gnuplot)");
  CLI11_PARSE(app, argc, argv);
  if (a.model == "gpt" && app.count("--batch") == 0) a.batch = 16;  // 16 sequences of 64 tokens
  a.reduce_given = app.count("--reduce-dtype") > 0;
  // Under mpirun process 0 reports (Note [Across processes in the benchmark]).
  if (!dist::is_main() && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;

  try {
    int available = dp::device_count();
    std::vector<int> counts;
    if (a.devices.empty()) {
      int n = available;
      if (dp::default_device_type() == dp::DeviceType::CPU) {
        n = std::min({available, 4, std::max(2, dp::hardware_concurrency())});
        if (dist::is_main())
          std::cerr << "note: no GPU visible: running on CPU virtual devices (each gets cores / devices "
                     "threads); default device counts 1.." << n << " (min(4, max(2, cores)) = " << n
                  << " on this machine with " << dp::hardware_concurrency()
                  << " hardware threads); pass --devices for others\n";
      }
      counts = samples::parse_device_counts(std::to_string(n), available);
    } else {
      counts = samples::parse_device_counts(a.devices, available);
    }
    const int procs = dist::world_size();
    if (a.batch % procs != 0)
      throw std::invalid_argument("--batch " + std::to_string(a.batch) + " is the global batch and must be a multiple "
                                  "of the " + std::to_string(procs) + " processes");
    if (a.batch / procs < counts.back())
      throw std::invalid_argument("--batch " + std::to_string(a.batch) + " gives " +
                                  (procs > 1 ? "each of the " + std::to_string(procs) + " processes " +
                                                   std::to_string(a.batch / procs) + " rows, fewer than "
                                             : std::string("fewer rows than ")) +
                                  std::to_string(counts.back()) + " devices; use a batch of at least one row per device");
    const std::vector<int> stages = a.stages.empty() ? std::vector<int>{} : parse_stages(a.stages);
    if (a.precision != "fp32" && dp::default_device_type() == dp::DeviceType::CPU && dist::is_main())
      std::cerr << samples::cpu_16bit_note(a.precision) << "\n";
    return run(a, counts, stages);
  } catch (const std::invalid_argument& e) {
    std::cerr << "error: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
