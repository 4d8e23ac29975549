// tests/fuzz_replay.h — what the differential fuzzers' replays share (Note [Op fuzzer] in
// tests/tensor/op_fuzz_replay.cpp, Note [Optimizer fuzzer] in
// tests/optim/optim_fuzz_replay.cpp): the text helpers their programs are parsed with,
// and the driver that reads a corpus written by the Python side and runs every program.
//
//   int main(int argc, char** argv) {
//     return fuzz_replay::run_corpus(argc, argv, "op_fuzz_replay", run_case);
//   }
//
// The file holds metadata "cases" (the programs' names, c<seed>) and "program.<name>"
// (its lines separated by "; "), and the tensors each program reads. Exit status: 0 when
// every program agrees, 1 when one does not (run_case prints what differs), 2 on bad
// usage or an unreadable file, 77 when --device names a device that is not there.
#pragma once

#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/dp.h"

namespace fuzz_replay {

inline std::vector<std::string> split_on(const std::string& s, const std::string& sep) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (true) {
    const std::size_t next = s.find(sep, at);
    out.push_back(s.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) return out;
    at = next + sep.size();
  }
}

inline std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

/// One program's verdict, and what to print for it (empty when it agrees, unless verbose).
/// `skipped`: the program does not apply to what the options asked for (it is counted,
/// not run).
struct Outcome {
  bool ok = true;
  bool skipped = false;
  std::string report;
};

/// A replay's own options beside the shared ones: take(arg, next) consumes `arg` (and
/// `next`, nullptr past the end) and returns how many it took, 0 when `arg` is not its
/// own; it throws std::invalid_argument on a bad value. `usage` spells them. check(device),
/// once the device is known, returns why the options cannot run there (empty: they can).
struct ExtraOptions {
  std::string usage;
  std::function<int(const std::string& arg, const char* next)> take;
  std::function<std::string(dp::Device)> check;
};

/// Runs program `name` (its text `program`) on `device` against the file's tensors.
using Case = std::function<Outcome(const std::map<std::string, dp::Tensor>& file, const std::string& name,
                                   const std::string& program, dp::Device device, bool verbose)>;

/// The replay's main: `tool FILE [--device cpu:0|cuda:N] [--case c<seed>] [--verbose]`
/// and the replay's own options, if any.
inline int run_corpus(int argc, char** argv, const std::string& tool, const Case& run_case,
                      const ExtraOptions& extra = {}) {
  auto usage = [&](const std::string& why) {
    std::cerr << tool << ": " << why << "\nusage: " << tool
              << " FILE [--device cpu:0|cuda:N] [--case c<seed>] [--verbose]" << (extra.usage.empty() ? "" : " ")
              << extra.usage << "\n";
    return 2;
  };
  std::string path, only;
  std::string device_name = "cpu:0";
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--device" && i + 1 < argc) {
      device_name = argv[++i];
    } else if (arg == "--case" && i + 1 < argc) {
      only = argv[++i];
    } else if (arg == "--verbose") {
      verbose = true;
    } else if (!arg.empty() && arg[0] != '-' && path.empty()) {
      path = arg;
    } else {
      int took = 0;
      if (extra.take) {
        try {
          took = extra.take(arg, i + 1 < argc ? argv[i + 1] : nullptr);
        } catch (const std::invalid_argument& e) {
          return usage(e.what());
        }
      }
      if (took == 0) return usage("unexpected argument '" + arg + "'");
      i += took - 1;
    }
  }
  if (path.empty()) return usage("expected a file");
  if (device_name.rfind("cuda", 0) == 0 && dp::device_count(dp::DeviceType::CUDA) == 0) {
    std::cout << tool << ": no CUDA device here; " << device_name << " skipped\n";
    return 77;
  }
  dp::Device device = dp::cpu(0);
  try {
    device = dp::parse_device(device_name);
  } catch (const dp::Error& e) {
    return usage(e.what());
  }
  if (extra.check) {
    if (const std::string why = extra.check(device); !why.empty()) return usage(why);
  }
  dp::io::SafetensorsFile file;
  try {
    file = dp::io::read_safetensors(path);
  } catch (const dp::Error& e) {
    std::cerr << tool << ": cannot read " << path << ": " << e.what() << "\n";
    return 2;
  }
  std::map<std::string, dp::Tensor> tensors;
  for (auto& [n, t] : file.tensors) tensors[n] = t;
  auto meta = [&](const std::string& key) -> std::string {
    auto it = file.metadata.find(key);
    return it == file.metadata.end() ? std::string() : it->second;
  };
  const auto cases = words(meta("cases"));
  if (cases.empty()) {
    std::cerr << tool << ": " << path << " lists no programs (metadata 'cases'); write it with the fuzzer's "
              << "script (--write)\n";
    return 2;
  }
  int failed = 0, ran = 0, skipped = 0;
  for (const auto& c : cases) {
    if (!only.empty() && c != only) continue;
    const std::string program = meta("program." + c);
    if (program.empty()) {
      std::cerr << tool << ": no program for " << c << "\n";
      return 2;
    }
    ++ran;
    const Outcome o = run_case(tensors, c, program, device, verbose);
    std::cout << o.report;
    failed += o.ok ? 0 : 1;
    skipped += o.skipped ? 1 : 0;
  }
  if (ran == 0) return usage("no program named " + only);
  std::cout << tool << ": " << ran << " programs on " << device.str();
  if (skipped > 0) std::cout << " (" << skipped << " of them not applicable, not run)";
  std::cout << ", " << failed << (failed == 1 ? " differs" : " differ") << " from PyTorch\n";
  return failed == 0 ? 0 : 1;
}

}  // namespace fuzz_replay
