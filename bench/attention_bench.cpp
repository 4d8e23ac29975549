// scaled_dot_product_attention's fused path against its math path (Note [Fused attention
// paths] in src/nn/fused_attention.cpp) on cpu:0, or on cuda:0 with --device cuda:0 (Note
// [Fused attention on CUDA]): causal self-attention, forward and backward, B·H = 64
// problems of T queries and keys, head dim 64, T = 128, 512, 1024, in float32 and
// bfloat16, without dropout and with p = 0.1 (both paths draw the same keep
// bits from the same generator state). Each (T, dtype, p, path) is validated (the fused
// output and q's gradient equal the math path's to 1e-4 of their scale in float32, 16
// bfloat16 unit roundoffs in bfloat16: tests/nn/attention_fused_test.cpp derives the
// bounds), warmed up once, then the rounds alternate the two paths, so that a change in
// the machine's load reaches both alike.
//
//   attention_bench                       # aligned table
//   attention_bench --json                # one JSON object per (T, dtype, p, path)
//   attention_bench --t 256,2048 --rounds 3 --batch 4 --heads 16 --head-dim 32
//   attention_bench --dtype bf16 --dropout 0.1
//   attention_bench --device cuda:0 --t 1024,4096   # the CUDA kernel against the GPU's math path
//
// Figures: ms = median over rounds of one forward + backward; GFLOP/s = the causal
// attention's 4·B·H·T²·E/2 forward multiply-adds ×2 (FLOPs) plus the backward's 2.5 times
// that, over the median (reading back q's gradient included); peak MiB = max_memory_allocated above the inputs in that call.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "dp/dp.h"

namespace {

constexpr const char* kUsage =
    "usage: attention_bench [--t 128,512,1024] [--batch 8] [--heads 8] [--head-dim 64] [--rounds 5]\n"
    "                       [--dtype f32,bf16] [--dropout 0,0.1] [--device cpu:0|cuda:0] [--json]\n";

struct Options {
  std::vector<std::int64_t> t = {128, 512, 1024};
  std::int64_t batch = 8, heads = 8, head_dim = 64;
  int rounds = 5;
  std::vector<dp::Dtype> dtypes = {dp::Dtype::Float32, dp::Dtype::BFloat16};
  std::vector<double> dropout = {0.0, 0.1};
  std::string device = "cpu:0";
  bool json = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(item);
  return v;
}

dp::Dtype parse_dtype(const std::string& s) {
  if (s == "f32") return dp::Dtype::Float32;
  if (s == "bf16") return dp::Dtype::BFloat16;
  if (s == "f16") return dp::Dtype::Float16;
  std::fprintf(stderr, "unknown dtype %s (f32, bf16, f16)\n%s", s.c_str(), kUsage);
  std::exit(2);
}

std::vector<std::int64_t> parse_list(const std::string& s) {
  std::vector<std::int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoll(item));
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s: missing value\n%s", a.c_str(), kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--t") o.t = parse_list(next());
    else if (a == "--batch") o.batch = std::stoll(next());
    else if (a == "--heads") o.heads = std::stoll(next());
    else if (a == "--head-dim") o.head_dim = std::stoll(next());
    else if (a == "--rounds") o.rounds = std::stoi(next());
    else if (a == "--dtype") {
      o.dtypes.clear();
      for (const std::string& d : split(next())) o.dtypes.push_back(parse_dtype(d));
    } else if (a == "--dropout") {
      o.dropout.clear();
      for (const std::string& d : split(next())) o.dropout.push_back(std::stod(d));
    } else if (a == "--device") o.device = next();
    else if (a == "--json") o.json = true;
    else {
      std::fprintf(stderr, "unknown argument %s\n%s", a.c_str(), kUsage);
      std::exit(2);
    }
  }
  return o;
}

struct Run {
  std::vector<float> out, gq;
  double ms = 0;
  double peak_mib = 0;
};

/// One forward + backward by `path`; q0, k0, v0, up in the case's dtype; dropout p from
/// a generator seeded 7 (the same masks in every call).
Run step(dp::nn::AttentionPath path, dp::Device dev, const dp::Tensor& q0, const dp::Tensor& k0,
         const dp::Tensor& v0, const dp::Tensor& up, double p) {
  dp::nn::set_attention_path(path);
  dp::Tensor q = q0.detach().set_requires_grad(true), k = k0.detach().set_requires_grad(true),
             v = v0.detach().set_requires_grad(true);
  dp::Generator gen(7);
  const std::size_t before = dp::memory_allocated(dev);
  dp::reset_peak_memory(dev);
  const auto t0 = std::chrono::steady_clock::now();
  dp::Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, dp::Tensor(), p, true, std::nullopt, false, &gen);
  dp::sum(dp::mul(y, up)).backward();
  Run r;
  r.gq = q.grad().to(dp::Dtype::Float32).to_vector();  // waits for the device (both paths alike)
  const auto t1 = std::chrono::steady_clock::now();
  r.ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  r.peak_mib = static_cast<double>(dp::max_memory_allocated(dev) - before) / (1 << 20);
  r.out = y.to(dp::Dtype::Float32).to_vector();
  dp::nn::set_attention_path(dp::nn::AttentionPath::Auto);
  return r;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
    s = std::max(s, std::fabs(static_cast<double>(b[i])));
  }
  return d / std::max(s, 1e-30);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run(const Options& o) {
  const dp::Device dev = dp::parse_device(o.device);
  const std::int64_t B = o.batch, H = o.heads, E = o.head_dim;
  using dp::nn::AttentionPath;
  if (!o.json)
    std::printf("%6s %6s %6s %6s %5s %7s %10s %10s %10s\n", "B*H", "T", "E", "dtype", "p", "path", "ms", "GFLOP/s",
                "peak MiB");
  for (std::int64_t T : o.t) {
    for (dp::Dtype dtype : o.dtypes) {
      for (double p : o.dropout) {
        dp::Generator gen(static_cast<std::uint64_t>(T));
        auto input = [&] { return dp::randn({B, H, T, E}, gen, dev).to(dtype); };
        const dp::Tensor q = input(), k = input(), v = input(), up = input();
        const Run math = step(AttentionPath::Math, dev, q, k, v, up, p),
                  fused = step(AttentionPath::Fused, dev, q, k, v, up, p);
        const double err = std::max(rel_diff(fused.out, math.out), rel_diff(fused.gq, math.gq));
        const double tol = dtype == dp::Dtype::Float32 ? 1e-4 : 16 * 0x1p-8;
        if (!(err < tol)) {
          std::fprintf(stderr, "T=%lld %s p=%g: the fused path differs from the math path by %g of the scale\n",
                       static_cast<long long>(T), dp::dtype_name(dtype), p, err);
          return 1;
        }
        std::vector<double> ms[2];
        double peak[2] = {math.peak_mib, fused.peak_mib};
        for (int r = 0; r < o.rounds; ++r) {
          ms[0].push_back(step(AttentionPath::Math, dev, q, k, v, up, p).ms);
          ms[1].push_back(step(AttentionPath::Fused, dev, q, k, v, up, p).ms);
        }
        const double flops = 3.5 * 4.0 * static_cast<double>(B * H) * T * T * E / 2;
        for (int i = 0; i < 2; ++i) {
          const double m = median(ms[i]);
          const char* name = i == 0 ? "math" : "fused";
          if (o.json)
            std::printf("{\"bh\": %lld, \"t\": %lld, \"e\": %lld, \"dtype\": \"%s\", \"dropout\": %g, \"path\": "
                        "\"%s\", \"ms\": %.3f, \"gflops\": %.2f, \"peak_mib\": %.2f}\n",
                        static_cast<long long>(B * H), static_cast<long long>(T), static_cast<long long>(E),
                        dp::dtype_name(dtype), p, name, m, flops / m / 1e6, peak[i]);
          else
            std::printf("%6lld %6lld %6lld %6s %5g %7s %10.2f %10.2f %10.2f\n", static_cast<long long>(B * H),
                        static_cast<long long>(T), static_cast<long long>(E), dp::dtype_name(dtype), p, name, m,
                        flops / m / 1e6, peak[i]);
        }
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 2;
  }
}
