// fma_peak — the fp32 multiply-add throughput this machine delivers, measured.
//
// A fraction of "the FMA peak" needs the peak, and the nominal one (FMA pipes × lanes
// × 2 flop × clock) needs a clock that a virtual machine does not tell: the TSC runs
// at the base clock while the cores may boost well above it. This program measures
// the peak instead: each thread runs independent chains of vector multiply-adds
// (enough chains to cover the FMA latency on two pipes) with no memory traffic, for
// --ms milliseconds after a warm-up, and the threads start together. The widest
// instruction set the CPU has is used: AVX-512F (16 lanes), AVX2 + FMA (8 lanes), or
// SSE (4 lanes, a separate multiply and add: 2 flop per lane all the same).
//
//   fma_peak                 every core (one thread each), the best of 5 runs
//   fma_peak --threads 2 --ms 300 --runs 5
//   fma_peak --json          one JSON object
//
// GFLOP/s = threads × chains × lanes × 2 × iterations / seconds; "GHz if 2 pipes" is
// that per core over 2 × lanes × 2 flop per cycle: the clock the cores would run at if
// they issue two full-width FMAs per cycle (Zen 4/5 and Intel server cores with two
// 512-bit FMA units, or any AVX2 core with two FMA pipes), a plausibility check.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kChains = 16;  // independent accumulators: >= latency (4) × pipes (2)

/// Runs `iters` rounds of kChains independent FMAs; returns a value that depends on
/// every accumulator so that nothing is optimised away.
__attribute__((target("avx512f"))) float run_avx512(std::int64_t iters, float seed) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(seed + 0.001f * static_cast<float>(c));
  const __m512 mul = _mm512_set1_ps(0.9999999f), add = _mm512_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], mul, add);
  }
  __m512 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_ps(s, acc[c]);
  alignas(64) float out[16];
  _mm512_store_ps(out, s);
  float r = 0;
  for (float v : out) r += v;
  return r;
}

__attribute__((target("avx2,fma"))) float run_avx2(std::int64_t iters, float seed) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(seed + 0.001f * static_cast<float>(c));
  const __m256 mul = _mm256_set1_ps(0.9999999f), add = _mm256_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], mul, add);
  }
  __m256 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, acc[c]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  float r = 0;
  for (float v : out) r += v;
  return r;
}

float run_sse(std::int64_t iters, float seed) {
  __m128 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm_set1_ps(seed + 0.001f * static_cast<float>(c));
  const __m128 mul = _mm_set1_ps(0.9999999f), add = _mm_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm_add_ps(_mm_mul_ps(acc[c], mul), add);
  }
  __m128 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm_add_ps(s, acc[c]);
  alignas(16) float out[4];
  _mm_store_ps(out, s);
  return out[0] + out[1] + out[2] + out[3];
}

struct Isa {
  const char* name;
  int lanes;
  float (*run)(std::int64_t, float);
};

Isa pick_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return {"avx512f", 16, &run_avx512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {"avx2+fma", 8, &run_avx2};
  return {"sse", 4, &run_sse};
}

/// Seconds for `threads` threads, started together, each running `iters` rounds.
double timed_run(const Isa& isa, int threads, std::int64_t iters, float* sink) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<float> results(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      results[static_cast<std::size_t>(t)] = isa.run(iters, 1.0f + static_cast<float>(t));
    });
  }
  while (ready.load() < threads) {
  }
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (float r : results) *sink += r;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double ms = 300;
  int runs = 5;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--threads" && has_value) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--ms" && has_value) {
      ms = std::atof(argv[++i]);
    } else if (a == "--runs" && has_value) {
      runs = std::atoi(argv[++i]);
    } else if (a == "--json") {
      json = true;
    } else {
      std::fprintf(stderr, "usage: %s [--threads N] [--ms MS] [--runs R] [--json]\n", argv[0]);
      return 2;
    }
  }
  if (threads < 1 || threads > 4096 || ms <= 0 || ms > 60000 || runs < 1 || runs > 1000) {
    std::fprintf(stderr,
                 "fma_peak: expected --threads in [1, 4096], --ms in (0, 60000], --runs in [1, 1000]; got "
                 "%d, %g, %d\n",
                 threads, ms, runs);
    return 2;
  }
  const Isa isa = pick_isa();
  float sink = 0;
  // Calibrate on one thread: the rounds that take about --ms.
  std::int64_t iters = 1 << 16;
  for (;;) {
    const double s = timed_run(isa, 1, iters, &sink);
    if (s >= ms / 4000.0 || iters > (std::int64_t{1} << 40)) {
      iters = std::max<std::int64_t>(1, static_cast<std::int64_t>(static_cast<double>(iters) * (ms / 1000.0) / s));
      break;
    }
    iters *= 4;
  }
  const double flop_per_thread = static_cast<double>(iters) * kChains * isa.lanes * 2.0;
  double best = 0;
  std::vector<double> all;
  for (int r = 0; r < runs; ++r) {
    const double s = timed_run(isa, threads, iters, &sink);
    const double gflops = flop_per_thread * threads / s / 1e9;
    all.push_back(gflops);
    best = std::max(best, gflops);
  }
  const double per_core = best / threads;
  const double ghz_if_two_pipes = per_core / (2.0 * isa.lanes * 2.0);
  if (json) {
    std::printf("{\"isa\": \"%s\", \"lanes\": %d, \"threads\": %d, \"gflops\": %.1f, \"gflops_per_core\": %.1f, "
                "\"ghz_if_two_pipes\": %.3f, \"runs\": [",
                isa.name, isa.lanes, threads, best, per_core, ghz_if_two_pipes);
    for (std::size_t i = 0; i < all.size(); ++i) std::printf("%s%.1f", i ? ", " : "", all[i]);
    std::printf("], \"sink\": %g}\n", static_cast<double>(sink));
  } else {
    std::printf("fp32 multiply-add throughput, %s (%d lanes), %d threads, best of %d runs of %.0f ms:\n", isa.name,
                isa.lanes, threads, runs, ms);
    std::printf("  %.1f GFLOP/s in all, %.1f per core; %.2f GHz if each core issues two %d-lane FMAs per cycle\n",
                best, per_core, ghz_if_two_pipes, isa.lanes);
    std::printf("  runs:");
    for (double g : all) std::printf(" %.1f", g);
    std::printf("  (checksum %g)\n", static_cast<double>(sink));
  }
  return 0;
}
