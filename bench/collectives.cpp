// Collective benchmark in nccl-tests' format: for each op and size, out-of-place and
// in-place time, algbw, busbw and #wrong. Each rank is driven by its own thread, as in
// DataParallel. Every size is validated first (exact small-integer data), then warmed
// up, then timed.
//
//   collectives_bench                                  # 2 CPU virtual devices, all ops
//   collectives_bench --devices 4 --op all_reduce --minbytes 1K --maxbytes 256M
//   collectives_bench --device cuda --devices 8 --json
//
// Across processes: started by mpirun (or srun) with several processes, every process
// drives --devices local devices and the communicator is make_world_communicator's
// (hierarchical for CPU virtual devices: Note [Hierarchical collectives]); the ranks,
// roots and blocks are world ranks, N below is the world size (processes x devices),
// and process 0 prints. On one machine (quick; the processes share the cores):
//
//   mpirun --oversubscribe --bind-to none -np 2 -x DP_CPU_DEVICES=8
//          build/bench/collectives_bench --devices 2 --maxbytes 4M --iters 10
//   (one command line). Processes sharing a few cores measure the protocol's costs,
//   not a network: the waits between processes yield and then sleep (Note [Waiting with
//   a deadline]), so rows vary from run to run there.
//
// Note [Bus bandwidth]
// The figures, after nccl-tests' doc/PERFORMANCE.md:
//   size  = bytes of the whole buffer: all_reduce/broadcast/reduce: the buffer of one
//           rank; reduce_scatter: the send buffer (N blocks); all_gather: the recv
//           buffer (N blocks). count = elements per call (per-rank block for RS/AG).
//   time  = mean wall time of one call, the slowest rank of every process (host
//           clock; on CUDA the timed loop ends with synchronize()).
//   algbw = size / time.
//   busbw = algbw * factor, the bandwidth each link needs under the optimal
//           algorithm, comparable across ops and device counts:
//             all_reduce                  2 (N-1) / N   (reduce-scatter + all-gather)
//             reduce_scatter, all_gather  (N-1) / N
//             broadcast, reduce           1
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"
#include "dp/tensor/tensor.h"

namespace {

using dp::comm::Communicator;
using dp::comm::ReduceOp;

constexpr const char* kUsage =
    "usage: collectives_bench [options]\n"
    "  --devices N        number of ranks (default 2)\n"
    "  --device cpu|cuda  device type (default cpu: CPU virtual devices)\n"
    "  --op NAME          all_reduce | broadcast | reduce | reduce_scatter | all_gather | all\n"
    "                     (default all)\n"
    "  --minbytes SIZE    smallest size (default 8; suffixes K, M, G)\n"
    "  --maxbytes SIZE    largest size (default 64M)\n"
    "  --stepfactor F     size multiplier between rows (default 4)\n"
    "  --iters N          timed iterations per size (default 20)\n"
    "  --warmup N         untimed iterations per size (default 5)\n"
    "  --json             one JSON document on stdout instead of the table\n";

const char* kOps[] = {"all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather"};

struct Options {
  int devices = 2;
  dp::DeviceType type = dp::DeviceType::CPU;
  std::string op = "all";
  std::int64_t minbytes = 8;
  std::int64_t maxbytes = 64 << 20;
  std::int64_t step = 4;
  int iters = 20;
  int warmup = 5;
  bool json = false;
};

std::int64_t parse_int(const std::string& flag, const std::string& text, bool size_suffix) {
  std::size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &pos);
  } catch (const std::exception&) {
    DP_FAIL(flag, ": expected a number, got '", text, "'");
  }
  std::int64_t mult = 1;
  if (pos < text.size() && size_suffix) {
    const std::string suf = text.substr(pos);
    if (suf == "K" || suf == "k") mult = 1LL << 10;
    else if (suf == "M" || suf == "m") mult = 1LL << 20;
    else if (suf == "G" || suf == "g") mult = 1LL << 30;
    else DP_FAIL(flag, ": unknown size suffix '", suf, "' in '", text, "' (use K, M or G)");
    pos = text.size();
  }
  DP_CHECK(pos == text.size(), flag, ": expected a number, got '", text, "'");
  return static_cast<std::int64_t>(v) * mult;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      DP_CHECK(i + 1 < argc, a, " needs a value");
      return argv[++i];
    };
    if (a == "--devices") o.devices = static_cast<int>(parse_int(a, value(), false));
    else if (a == "--device") {
      const std::string v = value();
      DP_CHECK(v == "cpu" || v == "cuda", "--device: expected cpu or cuda, got '", v, "'");
      o.type = v == "cpu" ? dp::DeviceType::CPU : dp::DeviceType::CUDA;
    } else if (a == "--op") o.op = value();
    else if (a == "--minbytes") o.minbytes = parse_int(a, value(), true);
    else if (a == "--maxbytes") o.maxbytes = parse_int(a, value(), true);
    else if (a == "--stepfactor") o.step = parse_int(a, value(), false);
    else if (a == "--iters") o.iters = static_cast<int>(parse_int(a, value(), false));
    else if (a == "--warmup") o.warmup = static_cast<int>(parse_int(a, value(), false));
    else if (a == "--json") o.json = true;
    else if (a == "--help" || a == "-h") { std::cout << kUsage; std::exit(0); }
    else DP_FAIL("unknown flag '", a, "'");
  }
  DP_CHECK(o.devices >= 1, "--devices: expected at least 1, got ", o.devices);
  const int available = dp::device_count(o.type);
  DP_CHECK(o.devices <= available, "--devices ", o.devices, ": only ", available, " ",
           o.type == dp::DeviceType::CPU ? "CPU virtual devices (set DP_CPU_DEVICES)"
                                         : "CUDA devices visible");
  bool known = o.op == "all";
  for (const char* op : kOps) known = known || o.op == op;
  DP_CHECK(known, "--op: expected all_reduce, broadcast, reduce, reduce_scatter, all_gather "
           "or all, got '", o.op, "'");
  DP_CHECK(o.minbytes >= 0 && o.maxbytes >= o.minbytes, "--minbytes/--maxbytes: expected ",
           "0 <= min <= max, got ", o.minbytes, " and ", o.maxbytes);
  DP_CHECK(o.step >= 2, "--stepfactor: expected at least 2, got ", o.step);
  DP_CHECK(o.iters >= 1 && o.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");
  return o;
}

/// Small integers in [-6, 6]: sums over up to 64 ranks are exact in float.
float value(int rank, std::int64_t i) {
  return static_cast<float>((i * 7 + rank * 3 + (i >> 7)) % 13) - 6.0f;
}

std::vector<float> rank_values(int rank, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = value(rank, i);
  return v;
}

double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "reduce_scatter" || op == "all_gather") return static_cast<double>(n - 1) / n;
  return 1.0;  // broadcast, reduce
}

struct Measure {
  double time_us = 0;
  double algbw = 0;  // GB/s
  double busbw = 0;  // GB/s
  std::int64_t wrong = 0;
};

/// One rank's buffers for an op: `send` and `recv` as the collective takes them.
struct Buffers {
  dp::Tensor send, recv;
};

class Bench {
 public:
  /// n_ counts world ranks: every local rank's buffers are laid out for all of them.
  Bench(const Options& o, Communicator& comm) : o_(o), comm_(comm), n_(comm.world_size()) {}

  /// Runs `op` on `count` elements (per-rank block for RS/AG), in place or not.
  Measure run(const std::string& op, std::int64_t count, bool in_place) {
    const int local = comm_.size();
    std::vector<double> seconds(static_cast<std::size_t>(local), 0.0);
    std::atomic<std::int64_t> wrong{0};
    std::vector<std::string> errors(static_cast<std::size_t>(local));
    std::vector<std::thread> threads;
    for (int r = 0; r < local; ++r) {
      threads.emplace_back([&, r] {
        try {
          const dp::Device dev = comm_.devices()[r];
          dp::backend::get(dev).set_current_device(dev);
          Buffers b = make_buffers(op, r, count, in_place);
          call(op, r, b);  // validate
          comm_.synchronize(r);
          wrong += count_wrong(op, r, count, b);
          for (int i = 0; i < o_.warmup; ++i) call(op, r, b);
          comm_.synchronize(r);
          // Align the ranks' start with one more collective, then time.
          call(op, r, b);
          comm_.synchronize(r);
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < o_.iters; ++i) call(op, r, b);
          comm_.synchronize(r);
          dp::backend::get(dev).synchronize(dev);
          seconds[static_cast<std::size_t>(r)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
          comm_.abort(std::string("rank ") + std::to_string(r) + " failed");
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < local; ++r)
      DP_CHECK(errors[static_cast<std::size_t>(r)].empty(), op, " rank ", r, ": ",
               errors[static_cast<std::size_t>(r)]);
    Measure m;
    // The slowest rank of the job (one process: the values themselves).
    const double t = dp::dist::all_reduce(*std::max_element(seconds.begin(), seconds.end()),
                                          dp::dist::Op::Max) / o_.iters;
    m.time_us = t * 1e6;
    const double bytes = static_cast<double>(size_bytes(op, count));
    m.algbw = t > 0 ? bytes / t / 1e9 : 0.0;
    m.busbw = m.algbw * bus_factor(op, n_);
    m.wrong = dp::dist::all_reduce(wrong.load(), dp::dist::Op::Sum);
    return m;
  }

  /// Bytes a row reports for `count` (see the file comment).
  std::int64_t size_bytes(const std::string& op, std::int64_t count) const {
    const std::int64_t per = count * static_cast<std::int64_t>(sizeof(float));
    return (op == "reduce_scatter" || op == "all_gather") ? per * n_ : per;
  }

 private:
  /// Local rank r's buffers; values and blocks are those of its world rank.
  Buffers make_buffers(const std::string& op, int local_rank, std::int64_t count, bool in_place) {
    const dp::Device dev = comm_.devices()[local_rank];
    const int r = comm_.first_rank() + local_rank;
    Buffers b;
    if (op == "reduce_scatter") {
      b.send = dp::from_vector(rank_values(r, count * n_), {count * n_}, dev);
      b.recv = in_place ? b.send.narrow(0, r * count, count) : dp::zeros({count}, dev);
    } else if (op == "all_gather") {
      if (in_place) {
        b.recv = dp::from_vector(rank_values(r, count * n_), {count * n_}, dev);
        b.send = b.recv.narrow(0, r * count, count);
      } else {
        std::vector<float> all = rank_values(r, count * n_);
        std::vector<float> own(all.begin() + r * count, all.begin() + (r + 1) * count);
        b.send = dp::from_vector(own, {count}, dev);
        b.recv = dp::zeros({count * n_}, dev);
      }
    } else {
      b.send = dp::from_vector(rank_values(r, count), {count}, dev);
      if (op == "broadcast") b.recv = b.send;
      else if (op == "reduce" && r != 0) b.recv = dp::Tensor();
      else b.recv = in_place ? b.send : dp::zeros({count}, dev);
    }
    return b;
  }

  /// r: the local rank (roots are world rank 0).
  void call(const std::string& op, int r, const Buffers& b) {
    if (op == "all_reduce") comm_.all_reduce(r, b.send, b.recv, ReduceOp::Sum);
    else if (op == "broadcast") comm_.broadcast(r, b.send, 0);
    else if (op == "reduce") comm_.reduce(r, b.send, b.recv, 0, ReduceOp::Sum);
    else if (op == "reduce_scatter") comm_.reduce_scatter(r, b.send, b.recv, ReduceOp::Sum);
    else comm_.all_gather(r, b.send, b.recv);
  }

  /// Elements of this rank's result that differ from the exact expected values.
  std::int64_t count_wrong(const std::string& op, int local_rank, std::int64_t count, const Buffers& b) {
    const int r = comm_.first_rank() + local_rank;
    auto sum_at = [&](std::int64_t i) {
      float s = 0;
      for (int q = 0; q < n_; ++q) s += value(q, i);
      return s;
    };
    std::int64_t bad = 0;
    if (op == "all_reduce" || (op == "reduce" && r == 0)) {
      const std::vector<float> got = b.recv.to_vector();
      for (std::int64_t i = 0; i < count; ++i) bad += got[static_cast<std::size_t>(i)] != sum_at(i);
    } else if (op == "broadcast") {
      const std::vector<float> got = b.send.to_vector();
      for (std::int64_t i = 0; i < count; ++i) bad += got[static_cast<std::size_t>(i)] != value(0, i);
    } else if (op == "reduce_scatter") {
      const std::vector<float> got = b.recv.to_vector();
      for (std::int64_t i = 0; i < count; ++i)
        bad += got[static_cast<std::size_t>(i)] != sum_at(r * count + i);
    } else if (op == "all_gather") {
      const std::vector<float> got = b.recv.to_vector();
      for (std::int64_t i = 0; i < count * n_; ++i)
        bad += got[static_cast<std::size_t>(i)] != value(static_cast<int>(i / std::max<std::int64_t>(count, 1)), i);
    }
    return bad;
  }

  const Options& o_;
  Communicator& comm_;
  const int n_;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

int run(const Options& o) {
  std::vector<dp::Device> devices;
  for (int i = 0; i < o.devices; ++i)
    devices.push_back(o.type == dp::DeviceType::CPU ? dp::cpu(i) : dp::cuda(i));
  // The ranks work concurrently: give each CPU virtual device its share of the cores.
  dp::backend::get(devices[0]).set_concurrent_devices(o.devices);
  // Under mpirun with several processes, the communicator over every process's devices;
  // otherwise make_communicator's.
  auto comm = dp::comm::make_world_communicator(devices);
  const int world = comm->world_size();
  const bool prints = dp::dist::is_main();
  Bench bench(o, *comm);

  std::vector<std::string> ops;
  for (const char* op : kOps)
    if (o.op == "all" || o.op == op) ops.push_back(op);

  std::ostringstream json;
  json << "{\"backend\": \"" << comm->backend_name() << "\", \"processes\": "
       << dp::dist::world_size() << ", \"devices\": " << o.devices
       << ", \"threads_per_device\": " << dp::backend::get(devices[0]).threads_per_device(devices[0])
       << ", \"iters\": " << o.iters << ", \"warmup\": " << o.warmup << ", \"results\": [";
  bool first_json = true;
  std::int64_t total_wrong = 0;
  double busbw_sum = 0;
  int busbw_rows = 0;
  if (!o.json && prints) {
    std::printf("# dp collectives: backend %s, %d process(es) x %d devices (%s), %d thread(s) "
                "per device, iters %d, warmup %d\n",
                comm->backend_name().c_str(), dp::dist::world_size(), o.devices,
                o.type == dp::DeviceType::CPU ? "cpu" : "cuda",
                dp::backend::get(devices[0]).threads_per_device(devices[0]), o.iters, o.warmup);
  }
  for (const std::string& op : ops) {
    const bool blocked = op == "reduce_scatter" || op == "all_gather";
    const bool reduces = op == "all_reduce" || op == "reduce" || op == "reduce_scatter";
    const bool rooted = op == "broadcast" || op == "reduce";
    if (!o.json && prints) {
      std::printf("#\n# %s\n", op.c_str());
      std::printf("# %10s %12s %7s %6s %5s   %9s %8s %8s %6s   %9s %8s %8s %6s\n", "", "", "",
                  "", "", "out-of-place", "", "", "", "in-place", "", "", "");
      std::printf("# %10s %12s %7s %6s %5s   %9s %8s %8s %6s   %9s %8s %8s %6s\n", "size",
                  "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                  "algbw", "busbw", "#wrong");
      std::printf("# %10s %12s %7s %6s %5s   %9s %8s %8s %6s   %9s %8s %8s %6s\n", "(B)",
                  "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                  "(GB/s)", "");
    }
    for (std::int64_t bytes = o.minbytes; bytes <= o.maxbytes; bytes *= o.step) {
      std::int64_t count = bytes / static_cast<std::int64_t>(sizeof(float));
      if (blocked) count /= world;  // per-rank block; the row shows the rounded size
      const Measure oop = bench.run(op, count, false);
      const Measure ip = bench.run(op, count, true);
      total_wrong += oop.wrong + ip.wrong;
      busbw_sum += oop.busbw + ip.busbw;
      busbw_rows += 2;
      const std::int64_t size = bench.size_bytes(op, count);
      const char* redop = reduces ? "sum" : "none";
      const int root = rooted ? 0 : -1;
      if (o.json) {
        json << (first_json ? "" : ",") << "\n  {\"op\": \"" << op << "\", \"size\": " << size
             << ", \"count\": " << count << ", \"type\": \"float\", \"redop\": \"" << redop
             << "\", \"root\": " << root;
        for (const auto& [name, m] : {std::pair{"out_of_place", oop}, std::pair{"in_place", ip}})
          json << ", \"" << name << "\": {\"time_us\": " << m.time_us
               << ", \"algbw_gbs\": " << m.algbw << ", \"busbw_gbs\": " << m.busbw
               << ", \"wrong\": " << m.wrong << "}";
        json << "}";
        first_json = false;
      } else if (prints) {
        std::printf("  %10lld %12lld %7s %6s %5d   %9s %8s %8s %6lld   %9s %8s %8s %6lld\n",
                    static_cast<long long>(size), static_cast<long long>(count), "float", redop,
                    root, fmt("%.2f", oop.time_us).c_str(), fmt("%.2f", oop.algbw).c_str(),
                    fmt("%.2f", oop.busbw).c_str(), static_cast<long long>(oop.wrong),
                    fmt("%.2f", ip.time_us).c_str(), fmt("%.2f", ip.algbw).c_str(),
                    fmt("%.2f", ip.busbw).c_str(), static_cast<long long>(ip.wrong));
      }
      std::fflush(stdout);
      if (bytes == 0) break;  // 0 * step stays 0
    }
  }
  if (!prints) {
    // Only process 0 reports.
  } else if (o.json) {
    json << "\n], \"wrong\": " << total_wrong << ", \"avg_busbw_gbs\": "
         << (busbw_rows ? busbw_sum / busbw_rows : 0.0) << "}\n";
    std::cout << json.str();
  } else {
    std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong),
                total_wrong == 0 ? "OK" : "FAILED");
    std::printf("# Avg bus bandwidth    : %.3f GB/s\n", busbw_rows ? busbw_sum / busbw_rows : 0.0);
  }
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const dp::Error& e) {
    std::cerr << "collectives_bench: " << e.what() << "\n\n" << kUsage;
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "collectives_bench: " << e.what() << "\n";
    return 1;
  }
}
