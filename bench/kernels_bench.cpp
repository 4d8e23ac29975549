// kernels_bench — the backend op table (tests/backend/op_cases.h) timed on one device.
//
// The cases are the ones the tests run (ggml's test-backend-ops in perf mode): each is
// built on the device, validated against the oracle, warmed up, then timed. Calls are
// timed in batches of about kBatchMs with one synchronize per batch (so CUDA launches
// queue up as in training), and the best batch's mean per call is reported: on a
// shared machine the minimum is the reproducible figure.
//   GFLOP/s = flops / time, flops = 2·m·n·k for GEMM and 2·N·K·P·Q·C·R·S for each
//             convolution pass (forward, backward data and backward weight do the same
//             multiply-adds); shown for those two only.
//   cpu ms  = the least process CPU time per call over the batches (all threads): the
//             figure to compare on a loaded machine, for 1-thread rows; equal to the
//             wall time in a T-thread row, it says the threads shared one core.
//   GB/s    = bytes / time, bytes = every input read once + every output written once:
//             the least memory traffic of the call, so it is comparable with the
//             memory bandwidth.
// The oracle is the CPU backend on cpu(0). Against a CUDA device it runs on all cores
// (the comparison of cuda_backend_test, at training sizes). Against the CPU it runs at
// one thread per device with plain oneDNN layouts, so validation checks the parallel
// paths and the blocked layouts against the serial, plain ones; the CPU kernels
// themselves are checked against naive references by tests/backend/cpu_backend_test.
//
//   kernels_bench                        Perf cases on cpu:0, at 1 thread and all cores
//   kernels_bench --json                 one JSON array instead of the table
//   kernels_bench --filter gemm,conv2d   cases whose name contains either text
//   kernels_bench --device cuda:0        the same cases on a GPU, in FP32 (TF32 off)
//   kernels_bench --device cuda:0 --tf32 matrix products and convolutions may use TF32
//                                        (PyTorch's allow_tf32); they are then validated
//                                        with tolerances 2^13 wider (TF32 keeps 10 of
//                                        FP32's 23 mantissa bits)
//   kernels_bench --conv-layouts         CPU convolutions in each oneDNN layout too
//                                        (Note [CPU convolution: measured choice])
//   kernels_bench --onednn-reorders      16-bit convolutions reorder through oneDNN, not
//                                        transpose_copy (Note [bfloat16 blocked reorders])
//   kernels_bench --suite check|perf|all the tests' small cases are a quick smoke run
//   kernels_bench --threads 1,2 --min-ms 300 --list
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "dp/core/device.h"
#include "op_cases.h"

namespace {

using dp::backend::cpu::ConvLayout;
using dp::backend::cpu::CpuBackend;
using dp_test::Kernel;
using dp_test::OpCase;
using dp_test::OpRun;

/// Length of one timed batch: long enough that one synchronize and the clock reads
/// are noise, short enough that several batches fit in --min-ms.
constexpr double kBatchMs = 10.0;
/// Most calls in one batch (a sub-microsecond call would otherwise run 10^5 times).
constexpr int kMaxBatch = 10000;

struct Options {
  bool json = false;
  bool list = false;
  bool conv_layouts = false;
  bool tf32 = false;
  bool onednn_reorders = false;
  std::vector<std::string> filters;
  std::string device = "cpu:0";
  std::string suite = "perf";
  std::vector<int> threads;  // empty: 1 and all cores (CPU)
  double min_ms = 300.0;     // timed milliseconds per row, at least
};

struct Row {
  std::string name, shape, variant;
  int threads = 0;  // 0: not a CPU row
  double ms = 0, cpu_ms = 0, gflops = 0, gbps = 0, max_abs_err = 0;
  bool valid = false;
  std::string first_bad;
};

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--json] [--list] [--filter TEXT[,TEXT...]] [--device cpu:0|cuda:0]\n"
               "          [--suite perf|check|all] [--threads N[,N...]] [--conv-layouts]\n"
               "          [--min-ms MS] [--tf32] [--onednn-reorders]\n",
               argv0);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');)
    if (!part.empty()) out.push_back(part);
  return out;
}

/// Parses argv into `o`; false on a bad argument.
bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= argc) return false;
      out = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--json") {
      o.json = true;
    } else if (a == "--list") {
      o.list = true;
    } else if (a == "--conv-layouts") {
      o.conv_layouts = true;
    } else if (a == "--tf32") {
      o.tf32 = true;
    } else if (a == "--onednn-reorders") {
      o.onednn_reorders = true;
    } else if (a == "--filter" && value(v)) {
      for (auto& f : split(v)) o.filters.push_back(f);
    } else if (a == "--device" && value(v)) {
      o.device = v;
    } else if (a == "--suite" && value(v) && (v == "perf" || v == "check" || v == "all")) {
      o.suite = v;
    } else if (a == "--threads" && value(v)) {
      for (auto& t : split(v)) o.threads.push_back(std::max(1, std::atoi(t.c_str())));
    } else if (a == "--min-ms" && value(v)) {
      o.min_ms = std::max(0.0, std::atof(v.c_str()));
    } else {
      return false;
    }
  }
  return true;
}

bool selected(const OpCase& c, const Options& o) {
  if (o.suite == "perf" && c.suite != dp_test::Suite::Perf) return false;
  if (o.suite == "check" && c.suite != dp_test::Suite::Check) return false;
  if (o.filters.empty()) return true;
  const std::string name = c.full_name();
  return std::any_of(o.filters.begin(), o.filters.end(),
                     [&](const std::string& f) { return name.find(f) != std::string::npos; });
}

/// CPU time of the whole process in ms: on a machine shared with builds, wall time
/// measures the scheduler as much as the kernel, while a 1-thread kernel's CPU time per
/// call barely moves with the load.
double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

struct Timing {
  double ms = 0;      // best wall-clock mean per call
  double cpu_ms = 0;  // best process CPU time per call (all threads together)
};

/// Warm up, then the best mean per call over batches, in ms (see the top of the file).
Timing time_ms(OpRun& run, dp::backend::Backend& be, dp::Device dev, double min_ms) {
  using clock = std::chrono::steady_clock;
  auto since = [](clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  };
  for (int i = 0; i < 2; ++i) {  // first calls build oneDNN primitives and cuDNN plans
    run.run();
    be.synchronize(dev);
  }
  auto t0 = clock::now();
  run.run();
  be.synchronize(dev);
  const double one = std::max(since(t0), 1e-4);
  const int iters = std::clamp(static_cast<int>(kBatchMs / one), 1, kMaxBatch);
  double best = 1e30, best_cpu = 1e30, total = 0;
  for (int batches = 0; batches < 3 || total < min_ms; ++batches) {
    const double c0 = process_cpu_ms();
    t0 = clock::now();
    for (int i = 0; i < iters; ++i) run.run();
    be.synchronize(dev);
    const double ms = since(t0);
    best = std::min(best, ms / iters);
    best_cpu = std::min(best_cpu, (process_cpu_ms() - c0) / iters);
    total += ms;
  }
  return {best, best_cpu};
}

const char* layout_name(ConvLayout layout) {
  switch (layout) {
    case ConvLayout::Plain: return "onednn-nchw";
    case ConvLayout::Blocked: return "onednn-blocked";
    case ConvLayout::Auto: return "auto (default)";
    case ConvLayout::Gemm: return "im2col-product";
  }
  return "?";
}

bool is_conv(Kernel k) {
  return k == Kernel::Conv2d || k == Kernel::Conv2dBackwardData || k == Kernel::Conv2dBackwardWeight;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

void print_json(const std::vector<Row>& rows, const std::string& device) {
  std::printf("[\n");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    char gflops[32] = "null";
    if (r.gflops > 0) std::snprintf(gflops, sizeof gflops, "%.2f", r.gflops);
    std::printf("  {\"kernel\": %s, \"shape\": %s, \"variant\": %s, \"device\": %s, "
                "\"threads\": %d, \"ms\": %.6f, \"cpu_ms\": %.6f, \"gflops\": %s, \"gbps\": %.2f, "
                "\"max_abs_err\": %.3g, \"valid\": %s}%s\n",
                json_string(r.name).c_str(), json_string(r.shape).c_str(),
                json_string(r.variant).c_str(), json_string(device).c_str(), r.threads, r.ms, r.cpu_ms,
                gflops, r.gbps, r.max_abs_err, r.valid ? "true" : "false",
                i + 1 < rows.size() ? "," : "");
  }
  std::printf("]\n");
}

void print_table(const std::vector<Row>& rows) {
  std::size_t wn = 4, ws = 5, wv = 7;  // widths of "case", "shape", "variant"
  for (const Row& r : rows) {
    wn = std::max(wn, r.name.size());
    ws = std::max(ws, r.shape.size());
    wv = std::max(wv, r.variant.size());
  }
  const int n = static_cast<int>(wn), s = static_cast<int>(ws), v = static_cast<int>(wv);
  std::printf("%-*s  %-*s  %-*s  %7s  %10s  %10s  %8s  %8s  %9s  %5s\n", n, "case", s, "shape", v,
              "variant", "threads", "best ms", "cpu ms", "GFLOP/s", "GB/s", "max err", "valid");
  for (const Row& r : rows) {
    char threads[16] = "-", gflops[32] = "-";
    if (r.threads > 0) std::snprintf(threads, sizeof threads, "%d", r.threads);
    if (r.gflops > 0) std::snprintf(gflops, sizeof gflops, "%.1f", r.gflops);
    std::printf("%-*s  %-*s  %-*s  %7s  %10.4f  %10.4f  %8s  %8.1f  %9.2g  %5s\n", n, r.name.c_str(), s,
                r.shape.c_str(), v, r.variant.empty() ? "-" : r.variant.c_str(), threads, r.ms, r.cpu_ms,
                gflops, r.gbps, r.max_abs_err, r.valid ? "yes" : "NO");
  }
  for (const Row& r : rows)
    if (!r.valid)
      std::fprintf(stderr, "invalid: %s %s [%s]: %s\n", r.name.c_str(), r.shape.c_str(),
                   r.variant.c_str(), r.first_bad.c_str());
}

int run(const Options& o) {
  const dp::Device dev = dp::parse_device(o.device);
  dp::backend::Backend& be = dp::backend::get(dev);
  CpuBackend& cpu = dp::backend::cpu::cpu_backend_impl();
  const bool on_cpu = dev.type == dp::DeviceType::CPU;
  const int hw = dp::hardware_concurrency();
  // The table times FP32 kernels against an FP32 oracle: TF32 only when asked for.
  const bool tf32_matmul = dp::allow_tf32_matmul(), tf32_conv = dp::allow_tf32_conv();
  dp::set_allow_tf32_matmul(o.tf32);
  dp::set_allow_tf32_conv(o.tf32);
  CpuBackend::set_own_conv_reorders(!o.onednn_reorders);

  std::vector<const OpCase*> cases;
  for (const OpCase& c : dp_test::op_cases())
    if (selected(c, o) && dp_test::runs_on(c, be)) cases.push_back(&c);
  if (o.list) {
    for (const OpCase* c : cases) std::printf("%s\n", c->full_name().c_str());
    return 0;
  }
  std::vector<int> threads = o.threads;
  if (threads.empty()) threads = hw > 1 ? std::vector<int>{1, hw} : std::vector<int>{1};
  if (!on_cpu) threads = {0};

  std::vector<Row> rows;
  for (const OpCase* c : cases) {
    // The oracle's outputs (see the top of the file).
    cpu.set_concurrent_devices(on_cpu ? hw : 1);
    cpu.set_conv_layout(on_cpu ? ConvLayout::Plain : ConvLayout::Auto);
    dp_test::Outputs want;
    {
      OpRun oracle(*c, dp::cpu(0));
      oracle.run();
      want = oracle.read();
    }
    std::vector<ConvLayout> layouts{ConvLayout::Auto};
    if (on_cpu && o.conv_layouts && is_conv(c->kernel))
      layouts = {ConvLayout::Plain, ConvLayout::Blocked, ConvLayout::Auto};
    for (int t : threads) {
      for (ConvLayout layout : layouts) {
        // k concurrent devices get hw / k threads each; device 0 alone runs the case.
        if (on_cpu) cpu.set_concurrent_devices(std::max(1, hw / t));
        cpu.set_conv_layout(layout);
        OpRun run(*c, be, dev);
        run.run();
        dp_test::Tolerance tol = c->tol;
        if (o.tf32 && (is_conv(c->kernel) || c->kernel == Kernel::Gemm)) {
          tol.rtol *= 8192;  // 2^(23 - 10): the unit roundoff of TF32 over FP32's
          tol.atol *= 8192;
        }
        const dp_test::Comparison cmp = dp_test::compare(want, run.read(), tol);
        const Timing tm = time_ms(run, be, dev, o.min_ms);
        const double ms = tm.ms;
        rows.push_back(Row{c->name, c->shape, layouts.size() > 1 ? layout_name(layout) : "",
                           on_cpu ? be.threads_per_device(dev) : 0, ms, tm.cpu_ms,
                           c->flops / (ms * 1e6), c->bytes / (ms * 1e6), cmp.max_abs_err, cmp.ok,
                           cmp.first_bad});
      }
    }
  }
  cpu.set_concurrent_devices(1);
  cpu.set_conv_layout(ConvLayout::Auto);
  dp::set_allow_tf32_matmul(tf32_matmul);
  dp::set_allow_tf32_conv(tf32_conv);

  if (o.json) {
    print_json(rows, o.device);
  } else {
    print_table(rows);
  }
  const bool all_valid =
      std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.valid; });
  return all_valid ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    usage(argv[0]);
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernels_bench: %s\n", e.what());
    return 2;
  }
}
