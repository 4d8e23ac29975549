// samples/common/options.h — the command-line options every sample spells the same way.
//
// One concept, one name, one set of values, one help text with the real default:
//   --devices  N (devices 0..N-1) or a list of ids "0,2,3"      (training samples)
//   --mode     single | dp | ddp | sharded (each sample lists the ones it runs)
//   --shard-stage 1 | 2                                           (with --mode sharded)
//   --path     worker (model.forward_backward) | module (loss(model(x)).backward())
//   --precision fp32 | bf16 [| fp16] (forward and loss under dp::amp::autocast; fp16 with a GradScaler)
//   --reduce-dtype fp32 | bf16 | fp16 (gradients on the wire: DataParallelOptions::mixed_precision)
//   --batch, --json
// (samples/dp_vs_ddp's --devices differs on purpose: it is the list of device COUNTS
// it compares, "N" meaning 1..N.)
//
//   samples::add_devices_option(app, devices_spec);
//   CLI11_PARSE(app, argc, argv);
//   auto ids = samples::parse_device_ids(devices_spec, dp::device_count());
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/util.h"
#include "dp/dp.h"

namespace samples {

/// The number of devices a sample uses when --devices is not given: every GPU, or
/// min(4, hardware threads, visible) CPU virtual devices — never more devices than
/// cores, so the default run does not oversubscribe the machine — and at least `min`.
inline int default_device_count(int min = 1) {
  const int available = dp::device_count();
  if (dp::default_device_type() == dp::DeviceType::CUDA) return available;
  return std::max(min, std::min({4, dp::hardware_concurrency(), available}));
}

/// Adds --devices (a count or a list of ids) with the default shown in --help.
inline CLI::Option* add_devices_option(CLI::App& app, std::string& spec, int min = 1) {
  if (spec.empty()) spec = std::to_string(default_device_count(min));
  return app
      .add_option("--devices", spec,
                  "N (devices 0..N-1) or a list of device ids such as 0,2; default: every GPU, or "
                  "min(4, hardware threads) CPU virtual devices")
      ->capture_default_str();
}

/// The device ids of a --devices value: "N" means 0..N-1, "a,b,c" exactly those ids
/// (distinct). Each must be a visible device; at least `min` of them. Throws
/// std::invalid_argument naming what was expected.
inline std::vector<int> parse_device_ids(const std::string& spec, int available, int min = 1) {
  auto number = [&](const std::string& item) {
    std::size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw std::invalid_argument("--devices: '" + item + "' is not a number (expected N or a list of ids like 0,1)");
    return v;
  };
  const std::string visible = std::to_string(available) + " " + device_kind() +
                              " device(s) are visible (set DP_CPU_DEVICES for more CPU virtual devices)";
  std::vector<int> ids;
  if (spec.find(',') == std::string::npos) {
    const int n = number(spec);
    if (n < min || n > available)
      throw std::invalid_argument("--devices " + spec + ": expected a count in [" + std::to_string(min) + ", " +
                                  std::to_string(available) + "]; " + visible);
    for (int i = 0; i < n; ++i) ids.push_back(i);
    return ids;
  }
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const int id = number(item);
    if (id < 0 || id >= available)
      throw std::invalid_argument("--devices: id " + item + " is out of range [0, " + std::to_string(available) +
                                  "); " + visible);
    if (std::find(ids.begin(), ids.end(), id) != ids.end())
      throw std::invalid_argument("--devices: id " + item + " appears twice in '" + spec + "'");
    ids.push_back(id);
  }
  if (static_cast<int>(ids.size()) < min)
    throw std::invalid_argument("--devices " + spec + ": expected at least " + std::to_string(min) +
                                " device(s), got " + std::to_string(ids.size()));
  return ids;
}

/// Adds --mode restricted to `allowed` (from single, dp, ddp, sharded).
inline CLI::Option* add_mode_option(CLI::App& app, std::string& mode, const std::vector<std::string>& allowed) {
  std::string list;
  for (auto& m : allowed) list += (list.empty() ? "" : ", ") + m;
  return app
      .add_option("--mode", mode,
                  "one of " + list +
                      " (single: no DataParallel; dp, ddp, sharded: dp::Mode::DP, DDP, Sharded)")
      ->check(CLI::IsMember(allowed))
      ->capture_default_str();
}

/// The DataParallel designs a --mode value names, and whether --shard-stage applies.
struct ModeEntry {
  const char* name;
  dp::Mode mode;
  bool takes_shard_stage;
};
inline constexpr ModeEntry kModes[] = {
    {"dp", dp::Mode::DP, false},
    {"ddp", dp::Mode::DDP, false},
    {"sharded", dp::Mode::Sharded, true},
};

/// The kModes entry of a --mode value other than "single".
inline const ModeEntry& mode_entry(const std::string& mode) {
  for (const ModeEntry& m : kModes)
    if (mode == m.name) return m;
  throw std::invalid_argument("--mode " + mode + " is not a DataParallel mode (expected dp, ddp or sharded)");
}

/// dp::Mode of a --mode value other than "single".
inline dp::Mode to_mode(const std::string& mode) { return mode_entry(mode).mode; }

/// DataParallelOptions for a --mode value and a --shard-stage (used in sharded mode only).
inline dp::DataParallelOptions mode_options(const std::string& mode, int shard_stage) {
  const ModeEntry& m = mode_entry(mode);
  dp::DataParallelOptions o{.mode = m.mode};
  if (m.takes_shard_stage) o.shard_stage = shard_stage;
  return o;
}

/// Adds --shard-stage (1 or 2; ZeRO stage of --mode sharded).
inline CLI::Option* add_shard_stage_option(CLI::App& app, int& stage) {
  return app
      .add_option("--shard-stage", stage,
                  "ZeRO stage of the sharded design: 1 (optimizer state sharded) or 2 (gradients too)")
      ->check(CLI::Range(1, 2))
      ->capture_default_str();
}

/// Adds --path: worker (model.forward_backward: every worker computes the loss of its
/// shard) or module (loss(model(x)).backward(): outputs gathered on the output device).
inline CLI::Option* add_path_option(CLI::App& app, std::string& path) {
  return app
      .add_option("--path", path,
                  "worker: model.forward_backward(x, y, loss), each worker computes its shard's loss; "
                  "module: loss(model(x)).backward(), the outputs gathered first")
      ->check(CLI::IsMember({"worker", "module"}))
      ->capture_default_str();
}

/// Adds --batch (the global batch, split over the devices).
template <typename Int>
CLI::Option* add_batch_option(CLI::App& app, Int& batch) {
  return app.add_option("--batch", batch, "global batch size (split over the devices)")
      ->check(CLI::Range(Int{1}, Int{1} << 24))
      ->capture_default_str();
}

/// Adds --precision: fp32; bf16 — the forward and the loss under
/// dp::amp::autocast(BFloat16) (Note [Autocast op policy] in dp/tensor/autocast.h); or
/// fp16 where the sample offers it — autocast(Float16) with a dp::amp::GradScaler.
/// Parameters, gradients and the optimizer stay float32.
inline CLI::Option* add_precision_option(CLI::App& app, std::string& precision, bool fp16 = false) {
  std::vector<std::string> values{"fp32", "bf16"};
  if (fp16) values.push_back("fp16");
  return app.add_option("--precision", precision,
                        fp16 ? "fp32; bf16: forward and loss under dp::amp::autocast(bfloat16); fp16: the same in "
                               "float16 with a dp::amp::GradScaler; float32 master weights"
                             : "fp32, or bf16: forward and loss under dp::amp::autocast(bfloat16), float32 master weights")
      ->check(CLI::IsMember(values))
      ->capture_default_str();
}

/// The autocast scope a --precision value asks for (off for fp32).
inline dp::amp::autocast precision_scope(const std::string& precision) {
  return dp::amp::autocast(precision == "fp16" ? dp::Dtype::Float16 : dp::Dtype::BFloat16, precision != "fp32");
}

/// The line a sample prints once for --precision bf16|fp16 on the CPU: how this CPU
/// computes 16-bit products (dp::cpu_bf16()), and what widens.
inline std::string cpu_16bit_note(const std::string& precision) {
  if (precision == "fp16")
    return "note: float16 on the CPU backend widens every product and convolution to float32 and rounds once "
           "(oneDNN 2.x has no CPU float16 matmul): it works, slower than float32 (Note [16-bit GEMMs on the CPU])";
  const dp::CpuBf16 kind = dp::cpu_bf16();
  return std::string("note: bfloat16 products and convolutions on this CPU: ") + dp::cpu_bf16_name(kind) +
         (kind == dp::CpuBf16::Native ? ""
                                      : "; bf16 works and gives the same bits, but is not faster than fp32 here") +
         " (Note [bf16 GEMMs through oneDNN], Note [bf16 convolutions through oneDNN])";
}

/// Adds --reduce-dtype: the dtype gradient collectives move (fp32, bf16 or fp16;
/// DataParallelOptions::mixed_precision.reduce_dtype).
inline CLI::Option* add_reduce_dtype_option(CLI::App& app, std::string& reduce_dtype) {
  return app.add_option("--reduce-dtype", reduce_dtype,
                        "dtype of the gradients on the wire: fp32, or bf16 / fp16 (half the bytes per gradient "
                        "collective; the sum is formed in float32 and rounded once)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
}

/// Adds --param-dtype: the dtype of every device's compute copy of the parameters (fp32,
/// bf16 or fp16; DataParallelOptions::mixed_precision.param_dtype).
inline CLI::Option* add_param_dtype_option(CLI::App& app, std::string& param_dtype) {
  return app.add_option("--param-dtype", param_dtype,
                        "dtype the devices compute with: fp32, or bf16 / fp16 (a 16-bit copy of the parameters "
                        "on every device; the float32 parameters stay the optimizer's master; the gradients go "
                        "on the wire in it unless --reduce-dtype is given)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
}

/// A --reduce-dtype / --param-dtype value as a Dtype (fp32, bf16, fp16).
inline dp::Dtype dtype_of_flag(const std::string& v) {
  return v == "bf16" ? dp::Dtype::BFloat16 : v == "fp16" ? dp::Dtype::Float16 : dp::Dtype::Float32;
}

/// DataParallelOptions::mixed_precision of a --reduce-dtype and a --param-dtype value;
/// with a 16-bit param_dtype the wire's dtype is set explicitly, float32 included.
inline dp::MixedPrecision mixed_precision_of(const std::string& reduce_dtype, const std::string& param_dtype = "fp32") {
  dp::MixedPrecision mp;
  if (param_dtype != "fp32") mp.param_dtype = dtype_of_flag(param_dtype);
  if (reduce_dtype != "fp32" || mp.param_dtype) mp.reduce_dtype = dtype_of_flag(reduce_dtype);
  return mp;
}

/// Adds --json with a sample-specific description.
inline CLI::Option* add_json_option(CLI::App& app, bool& json, const std::string& what) {
  return app.add_flag("--json", json, what);
}

}  // namespace samples
