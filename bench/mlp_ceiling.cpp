// mlp_ceiling — the GEMM ceiling of one MLP training step, and its SGD step against
// memory speed.
//
// The MLP of samples/common/models.h (784-1024-1024-10, batch B, SGD with momentum)
// issues eight GEMMs per step, all row-major with alpha 1, beta 0 (linear() and its
// backward in src/tensor/ops.cpp: the forwards through CpuBackend::linear_forward,
// which adds the bias and ReLU to each chunk's slab after the same GEMM, Note [Linear
// epilogue]; the backwards through CpuBackend::gemm; the first layer's input gradient
// is never computed: the input needs none):
//   fc1 forward     y = x Wᵀ     N,T  m=B     n=1024  k=784
//   fc2 forward     y = x Wᵀ     N,T  m=B     n=1024  k=1024
//   fc3 forward     y = x Wᵀ     N,T  m=B     n=10    k=1024
//   fc3 grad input  dX = dY W    N,N  m=B     n=1024  k=10
//   fc3 grad weight dW = dYᵀ X   T,N  m=10    n=1024  k=B
//   fc2 grad input  dX = dY W    N,N  m=B     n=1024  k=1024
//   fc2 grad weight dW = dYᵀ X   T,N  m=1024  n=1024  k=B
//   fc1 grad weight dW = dYᵀ X   T,N  m=1024  n=784   k=B
// Each is timed, in that order, several ways on the same threads:
//   dp         CpuBackend::gemm on cpu(0), whose arena has --threads threads: what a
//              step runs (Note [oneDNN in the device's arena]);
//   sgemm      one dnnl_sgemm call with oneDNN's own OpenMP threading, a team of
//              --threads;
//   matmul     the oneDNN matmul primitive (plain row-major memory, transposes as
//              strides), created once, the same team.
// The ways alternate batch by batch (dp, sgemm, matmul, then sgemm, matmul, dp, ...:
// each round starts one way later, so no way always follows the same one), each batch
// about kBatchMs of calls after one untimed call (so the caches hold the way's own data,
// not the last way's); a way's time is its best batch's mean per call (on a shared
// machine the minimum is the reproducible figure), and its median batch is shown too.
// Every way's output is checked against dp's before timing.
//   GFLOP/s  = 2·m·n·k / time
//   ceiling  = Σ 2·m·n·k / Σ (the least time of each GEMM over the ways): the step's
//              GEMMs if each ran as fast as the best of these libraries runs it here.
//              bench/side_by_side.py --compare mlp adds PyTorch's torch.mm to the best
//              of and sets dp's whole step against it.
//
// The SGD step: sgd_step over the MLP's parameters (one flat buffer, as the optimizer
// steps it) with momentum 0.9, not the first step, so it reads p, g and the momentum
// buffer and writes p and the buffer: 5 · 4 · n bytes. Alternating with it:
//   stream     a loop with the same access pattern (read p, g, buf; write p, buf) and
//              one add, over the same arrays in the same parallel_for, SSE or AVX2 as
//              the CPU allows: the memory roof of that pattern and footprint;
//   memcpy     memcpy of 10 · n bytes (the same 20 · n bytes read + written) in the
//              same parallel_for on the same threads; its footprint (8 · 2.5 · n bytes)
//              is larger than the update's (4 · 3 · n), which matters when the update's
//              fits in the last-level cache and the copy's does not;
//   memcpy 1t  one memcpy call on the calling thread.
//   GB/s     = bytes read + bytes written / time
//
//   mlp_ceiling                          all cores, about 300 ms per way and case
//   mlp_ceiling --threads 2 --min-ms 500 --batch 512
//   mlp_ceiling --json                   one JSON object instead of the tables
//   mlp_ceiling --only sgd               the SGD rows alone (--only gemm: the GEMMs)
//
// OpenMP's idle workers spin for a while after a team's call; those spins would fall on
// the next way's batch. So the program runs with OMP_WAIT_POLICY=PASSIVE unless it is
// set already (it re-executes itself once with it: libgomp reads it when it loads).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "dp/core/device.h"

namespace {

using i64 = std::int64_t;
using dp::backend::cpu::CpuBackend;
using dp::backend::cpu::kSerialGrain;

/// Length of one timed batch: long enough that the clock reads are noise, short
/// enough that many alternations fit in --min-ms.
constexpr double kBatchMs = 10.0;
/// Most calls in one batch.
constexpr int kMaxBatch = 10000;
/// Largest |difference| from dp's output, relative to the largest |element| of it, that
/// still counts as the same product: sums of up to 1024 products in another order.
constexpr double kRelTol = 1e-5;
/// The MLP's layers (samples/common/models.h).
constexpr i64 kLayers[3][2] = {{784, 1024}, {1024, 1024}, {1024, 10}};

struct Options {
  bool json = false;
  int threads = 0;  // 0: all cores
  i64 batch = 512;
  double min_ms = 300.0;  // timed milliseconds per way and case, at least
  bool gemms = true, sgd = true;  // --only gemm | sgd
};

struct Gemm {
  std::string name;
  bool ta, tb;
  i64 m, n, k;
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
};

/// The step's GEMMs in the order a step issues them (the top of the file).
std::vector<Gemm> step_gemms(i64 B) {
  std::vector<Gemm> g;
  const char* names[3] = {"fc1", "fc2", "fc3"};
  for (int l = 0; l < 3; ++l)
    g.push_back({std::string(names[l]) + " forward", false, true, B, kLayers[l][1], kLayers[l][0]});
  for (int l = 2; l >= 0; --l) {
    if (l > 0) g.push_back({std::string(names[l]) + " grad input", false, false, B, kLayers[l][0], kLayers[l][1]});
    g.push_back({std::string(names[l]) + " grad weight", true, false, kLayers[l][1], kLayers[l][0], B});
  }
  return g;
}

i64 parameter_count() {
  i64 n = 0;
  for (const auto& l : kLayers) n += l[0] * l[1] + l[1];
  return n;
}

struct WayTiming {
  explicit WayTiming(std::string name) : way(std::move(name)) {}
  std::string way;
  double best_ms = 1e30, median_ms = 0;
  double max_rel_err = 0;
  std::vector<double> batches;
};

/// Runs each way once (they must agree with the reference before timing), then in
/// alternating batches until every way has min_ms of timed calls; fills best/median.
void time_alternating(std::vector<WayTiming>& out, const std::vector<std::function<void()>>& ways,
                      double min_ms) {
  using clock = std::chrono::steady_clock;
  for (int rep = 0; rep < 2; ++rep)
    for (const auto& w : ways) w();  // first calls create primitives and pages
  auto t0 = clock::now();
  ways[0]();
  const double one = std::max(std::chrono::duration<double, std::milli>(clock::now() - t0).count(), 1e-4);
  const int iters = std::clamp(static_cast<int>(kBatchMs / one), 1, kMaxBatch);
  std::vector<double> total(ways.size(), 0.0);
  for (int round = 0; round < 3 || *std::min_element(total.begin(), total.end()) < min_ms; ++round) {
    for (std::size_t j = 0; j < ways.size(); ++j) {
      const std::size_t w = (static_cast<std::size_t>(round) + j) % ways.size();  // each way in every place
      ways[w]();  // untimed: the caches hold this way's data, not the last way's
      t0 = clock::now();
      for (int i = 0; i < iters; ++i) ways[w]();
      const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
      out[w].batches.push_back(ms / iters);
      total[w] += ms;
    }
  }
  for (WayTiming& t : out) {
    std::vector<double> b = t.batches;
    std::sort(b.begin(), b.end());
    t.best_ms = b.front();
    t.median_ms = b[b.size() / 2];
  }
}

double max_rel_diff(const std::vector<float>& ref, const float* got) {
  double amax = 0, dmax = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    amax = std::max(amax, static_cast<double>(std::fabs(ref[i])));
    dmax = std::max(dmax, static_cast<double>(std::fabs(ref[i] - got[i])));
  }
  return amax > 0 ? dmax / amax : dmax;
}

/// A buffer on cpu(0), from the backend's allocator as a step's tensors are.
struct DeviceBuffer {
  DeviceBuffer(CpuBackend& be, i64 n) : be_(be), n_(n) {
    p_ = static_cast<float*>(be.allocate(dp::cpu(0), static_cast<std::size_t>(n) * sizeof(float)));
  }
  ~DeviceBuffer() { be_.deallocate(dp::cpu(0), p_, static_cast<std::size_t>(n_) * sizeof(float)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  float* data() const { return p_; }

 private:
  CpuBackend& be_;
  i64 n_;
  float* p_;
};

void fill_uniform(float* p, i64 n, float lo, float hi, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  for (i64 i = 0; i < n; ++i) p[i] = u(gen);
}

struct GemmRow {
  Gemm g;
  std::vector<WayTiming> ways;
};

std::vector<GemmRow> run_gemms(CpuBackend& be, const Options& o) {
  const dp::Device dev = dp::cpu(0);
  std::vector<GemmRow> rows;
  for (const Gemm& g : step_gemms(o.batch)) {
    const i64 lda = g.ta ? g.m : g.k, ldb = g.tb ? g.k : g.n, ldc = g.n;
    DeviceBuffer a(be, g.m * g.k), b(be, g.k * g.n), c(be, g.m * g.n), c2(be, g.m * g.n);
    fill_uniform(a.data(), g.m * g.k, -1.0f, 1.0f, 1);
    fill_uniform(b.data(), g.k * g.n, -1.0f, 1.0f, 2);
    const char ta = g.ta ? 'T' : 'N', tb = g.tb ? 'T' : 'N';

    // The matmul primitive: A is (m, k), B (k, n), C (m, n); a transposed operand is the
    // same memory read with swapped strides.
    using dnnl::memory;
    dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    dnnl::stream strm(eng);
    const auto dt = memory::data_type::f32;
    const memory::desc a_md({g.m, g.k}, dt, g.ta ? memory::dims{1, lda} : memory::dims{lda, 1});
    const memory::desc b_md({g.k, g.n}, dt, g.tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
    const memory::desc c_md({g.m, g.n}, dt, memory::dims{ldc, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), eng);
    const dnnl::matmul mm(pd);
    memory am(a_md, eng, a.data()), bm(b_md, eng, b.data()), cm(c_md, eng, c2.data());

    const int t = be.threads_per_device(dev);
    auto dp_way = [&] {
      be.gemm(dev, g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc);
    };
    auto sgemm_way = [&] {
      omp_set_num_threads(t);  // dp's chunks set 1 on whichever thread ran them
      dnnl_sgemm(ta, tb, g.m, g.n, g.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c2.data(), ldc);
    };
    auto matmul_way = [&] {
      omp_set_num_threads(t);
      mm.execute(strm, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
      strm.wait();
    };
    GemmRow row{g, {WayTiming("dp"), WayTiming("sgemm"), WayTiming("matmul")}};
    dp_way();
    const std::vector<float> ref(c.data(), c.data() + g.m * g.n);
    sgemm_way();
    row.ways[1].max_rel_err = max_rel_diff(ref, c2.data());
    std::fill(c2.data(), c2.data() + g.m * g.n, 0.0f);
    matmul_way();
    row.ways[2].max_rel_err = max_rel_diff(ref, c2.data());
    time_alternating(row.ways, {dp_way, sgemm_way, matmul_way}, o.min_ms);
    rows.push_back(std::move(row));
  }
  return rows;
}

/// The update's access pattern with one add: p and buf swap, buf adds g (bounded values).
/// Built for AVX2 too, as sgd_step is (Note [Vectorised optimizer loops]).
__attribute__((target_clones("avx2", "default"))) void stream_range(float* __restrict p, const float* __restrict g,
                                                                      float* __restrict buf, i64 b, i64 e) {
  for (i64 i = b; i < e; ++i) {
    const float pi = p[i];
    p[i] = buf[i];
    buf[i] = pi + g[i];
  }
}

std::vector<WayTiming> run_sgd(CpuBackend& be, const Options& o, i64 n) {
  const dp::Device dev = dp::cpu(0);
  DeviceBuffer p(be, n), g(be, n), buf(be, n), src(be, 5 * n / 2), dst(be, 5 * n / 2);
  fill_uniform(p.data(), n, -0.05f, 0.05f, 3);
  fill_uniform(g.data(), n, -1e-3f, 1e-3f, 4);
  fill_uniform(buf.data(), n, -1e-3f, 1e-3f, 5);
  fill_uniform(src.data(), 5 * n / 2, -1.0f, 1.0f, 6);
  std::fill(dst.data(), dst.data() + 5 * n / 2, 0.0f);
  float* pp = p.data();
  const float* gp = g.data();
  float* bp = buf.data();
  auto sgd = [&] { be.sgd_step(dev, pp, gp, bp, n, 1e-4f, 0.9f, 0.0f, 0.0f, false, false); };
  auto stream = [&] {
    be.parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) { stream_range(pp, gp, bp, b, e); });
  };
  const i64 copy_n = 5 * n / 2;  // 10·n bytes
  float* s = src.data();
  float* d = dst.data();
  auto memcpy_t = [&] {
    be.parallel_for(dev, copy_n, kSerialGrain, [=](i64 b, i64 e) {
      std::memcpy(d + b, s + b, static_cast<std::size_t>(e - b) * sizeof(float));
    });
  };
  auto memcpy_1 = [&] { std::memcpy(d, s, static_cast<std::size_t>(copy_n) * sizeof(float)); };
  std::vector<WayTiming> ways{WayTiming("sgd_step"), WayTiming("stream"), WayTiming("memcpy"),
                              WayTiming("memcpy 1t")};
  time_alternating(ways, {sgd, stream, memcpy_t, memcpy_1}, o.min_ms);
  return ways;
}

struct Summary {
  double flops = 0, ceiling_ms = 0, dp_ms = 0;
  double ceiling_gflops() const { return ceiling_ms > 0 ? flops / (ceiling_ms * 1e6) : 0.0; }
  double dp_gflops() const { return dp_ms > 0 ? flops / (dp_ms * 1e6) : 0.0; }
};

Summary summarize(const std::vector<GemmRow>& rows) {
  Summary s;
  for (const GemmRow& r : rows) {
    s.flops += r.g.flops();
    double best = 1e30;
    for (const WayTiming& w : r.ways) best = std::min(best, w.best_ms);
    s.ceiling_ms += best;
    s.dp_ms += r.ways[0].best_ms;
  }
  return s;
}

std::string shape_of(const Gemm& g) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s,%s %lldx%lldx%lld", g.ta ? "T" : "N", g.tb ? "T" : "N",
                static_cast<long long>(g.m), static_cast<long long>(g.n), static_cast<long long>(g.k));
  return buf;
}

void print_json(const Options& o, int threads, const std::vector<GemmRow>& rows,
                const std::vector<WayTiming>& sgd, i64 n) {
  const Summary s = summarize(rows);
  std::printf("{\"threads\": %d, \"batch\": %lld, \"gemms\": [\n", threads, static_cast<long long>(o.batch));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Gemm& g = rows[i].g;
    std::printf("  {\"name\": \"%s\", \"ta\": %s, \"tb\": %s, \"m\": %lld, \"n\": %lld, \"k\": %lld, "
                "\"flops\": %.0f, \"ways\": {",
                g.name.c_str(), g.ta ? "true" : "false", g.tb ? "true" : "false", static_cast<long long>(g.m),
                static_cast<long long>(g.n), static_cast<long long>(g.k), g.flops());
    for (std::size_t w = 0; w < rows[i].ways.size(); ++w) {
      const WayTiming& t = rows[i].ways[w];
      std::printf("%s\"%s\": {\"ms\": %.6f, \"median_ms\": %.6f, \"gflops\": %.2f, \"max_rel_err\": %.3g}",
                  w ? ", " : "", t.way.c_str(), t.best_ms, t.median_ms, g.flops() / (t.best_ms * 1e6),
                  t.max_rel_err);
    }
    std::printf("}}%s\n", i + 1 < rows.size() ? "," : "");
  }
  const double bytes_sgd = 20.0 * static_cast<double>(n);
  std::printf("], \"flops\": %.0f, \"ceiling_gflops\": %.2f, \"dp_gemm_gflops\": %.2f,\n", s.flops,
              s.ceiling_gflops(), s.dp_gflops());
  std::printf("\"sgd\": {\"params\": %lld, \"bytes\": %.0f, \"ways\": {", static_cast<long long>(n), bytes_sgd);
  for (std::size_t w = 0; w < sgd.size(); ++w)
    std::printf("%s\"%s\": {\"ms\": %.6f, \"median_ms\": %.6f, \"gbps\": %.2f}", w ? ", " : "",
                sgd[w].way.c_str(), sgd[w].best_ms, sgd[w].median_ms, bytes_sgd / (sgd[w].best_ms * 1e6));
  std::printf("}}}\n");
}

void print_table(const Options& o, int threads, const std::vector<GemmRow>& rows,
                 const std::vector<WayTiming>& sgd, i64 n) {
  if (!rows.empty()) {
    std::printf("MLP 784-1024-1024-10, batch %lld: the step's GEMMs in order, %d threads "
                "(GFLOP/s of the best batch; median in brackets)\n",
                static_cast<long long>(o.batch), threads);
    std::printf("%-16s  %-22s  %17s  %17s  %17s  %9s\n", "gemm", "op shape (m x n x k)", "dp", "sgemm",
                "matmul", "max err");
    for (const GemmRow& r : rows) {
      std::printf("%-16s  %-22s", r.g.name.c_str(), shape_of(r.g).c_str());
      double err = 0;
      for (const WayTiming& t : r.ways) {
        std::printf("  %8.1f (%6.1f)", r.g.flops() / (t.best_ms * 1e6), r.g.flops() / (t.median_ms * 1e6));
        err = std::max(err, t.max_rel_err);
      }
      std::printf("  %9.2g\n", err);
    }
    const Summary s = summarize(rows);
    std::printf("\nstep GEMMs %.3f GFLOP: ceiling (best way per GEMM) %.1f GFLOP/s, %.3f ms; "
                "dp's way %.1f GFLOP/s, %.3f ms (%.3f of the ceiling)\n\n",
                s.flops / 1e9, s.ceiling_gflops(), s.ceiling_ms, s.dp_gflops(), s.dp_ms,
                s.ceiling_ms / s.dp_ms);
  }
  if (!sgd.empty()) {
    const double bytes = 20.0 * static_cast<double>(n);
    std::printf("SGD momentum step over %lld parameters, %.1f MB read + written per call, %d threads\n",
                static_cast<long long>(n), bytes / 1e6, threads);
    std::printf("%-10s  %10s  %10s  %8s  %8s\n", "way", "best ms", "median ms", "GB/s", "ratio");
    for (const WayTiming& t : sgd)
      std::printf("%-10s  %10.4f  %10.4f  %8.1f  %8.3f\n", t.way.c_str(), t.best_ms, t.median_ms,
                  bytes / (t.best_ms * 1e6), t.best_ms / sgd[0].best_ms);
    std::printf("(ratio: sgd_step's GB/s over the row's, i.e. the row's time / sgd_step's)\n");
  }
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--json") {
      o.json = true;
    } else if (a == "--threads" && has_value) {
      o.threads = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--batch" && has_value) {
      o.batch = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--only" && has_value) {
      const std::string v = argv[++i];
      if (v != "gemm" && v != "sgd") return false;
      o.gemms = v == "gemm";
      o.sgd = v == "sgd";
    } else if (a == "--min-ms" && has_value) {
      o.min_ms = std::max(0.0, std::atof(argv[++i]));
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (!std::getenv("OMP_WAIT_POLICY")) {  // see the top of the file
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);
    std::perror("mlp_ceiling: re-executing with OMP_WAIT_POLICY=PASSIVE");  // then run as is
  }
  Options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr, "usage: %s [--json] [--threads N] [--batch B] [--min-ms MS] [--only gemm|sgd]\n", argv[0]);
    return 2;
  }
  try {
    CpuBackend& be = dp::backend::cpu::cpu_backend_impl();
    const int hw = dp::hardware_concurrency();
    const int t = o.threads > 0 ? o.threads : hw;
    be.set_concurrent_devices(std::max(1, hw / t));  // cpu(0)'s arena: hw / (hw / t) threads
    const int threads = be.threads_per_device(dp::cpu(0));
    const std::vector<GemmRow> rows = o.gemms ? run_gemms(be, o) : std::vector<GemmRow>{};
    const i64 n = parameter_count();
    const std::vector<WayTiming> sgd = o.sgd ? run_sgd(be, o, n) : std::vector<WayTiming>{};
    if (o.json) {
      print_json(o, threads, rows, sgd, n);
    } else {
      print_table(o, threads, rows, sgd, n);
    }
    bool valid = true;
    for (const GemmRow& r : rows)
      for (const WayTiming& w : r.ways) valid = valid && w.max_rel_err <= kRelTol;
    if (!valid) std::fprintf(stderr, "mlp_ceiling: a way's output differs from dp's beyond %g\n", kRelTol);
    return valid ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_ceiling: %s\n", e.what());
    return 2;
  }
}
