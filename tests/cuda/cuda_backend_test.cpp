// tests/cuda/cuda_backend_test.cpp — every CUDA kernel against the CPU backend.
//
// The op cases are the backend op table (tests/backend/op_cases.h), the same list that
// op_table_test runs on CPU virtual devices and kernels_bench times: each case is
// built on cpu:0 (the oracle) and on cuda:0 from the same inputs, run once, and every
// output compared under the case's tolerance. The 16-bit convolutions are compared once
// more on the CNN's own layer shapes, with the path each pass took (Note [16-bit
// convolutions on CUDA]), scale_find_nonfinite over the CPU test's sizes and
// several calls on one flag, and the fused LayerNorm run twice for the same bits. The CUDA-only checks after them (caching allocator,
// pinned-block reuse, peer copies) are not op comparisons. Without a CUDA device the
// binary exits 77, which Meson reports as SKIP.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/core/half.h"
#include "op_cases.h"

namespace {

using dp::Device;
using dp::backend::Backend;
using i64 = std::int64_t;

/// Device memory of one backend, freed on scope exit.
struct Buf {
  Backend* b = nullptr;
  Device d;
  void* p = nullptr;
  std::size_t nbytes = 0;
  Buf(Backend& be, Device dev, std::size_t n) : b(&be), d(dev), p(be.allocate(dev, n)), nbytes(n) {}
  ~Buf() { b->deallocate(d, p, nbytes); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  float* f() const { return static_cast<float*>(p); }
};

/// A CUDA device with upload/download helpers.
struct Side {
  Backend& b;
  Device d;
  template <typename T>
  std::unique_ptr<Buf> up(const std::vector<T>& v) {
    auto buf = std::make_unique<Buf>(b, d, v.size() * sizeof(T) + 1);
    b.copy_from_host(buf->p, d, v.data(), v.size() * sizeof(T));
    return buf;
  }
  template <typename T = float>
  std::unique_ptr<Buf> zeros(std::size_t n) {
    auto buf = std::make_unique<Buf>(b, d, n * sizeof(T) + 1);
    b.memset_zero(buf->p, d, n * sizeof(T));
    return buf;
  }
  template <typename T = float>
  std::vector<T> down(const Buf& buf, std::size_t n) {
    std::vector<T> v(n);
    b.copy_to_host(v.data(), buf.p, d, n * sizeof(T));
    return v;
  }
};

Side cuda_side(int i = 0) {
  return {dp::backend::get(dp::DeviceType::CUDA), Device{dp::DeviceType::CUDA, i}};
}

std::vector<float> randn(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

}  // namespace

TEST_CASE("every op case on cuda:0 matches cpu:0 within its tolerance") {
  // The op table's tolerances are FP32's: pure FP32 math (Note [TF32 policy]).
  const bool mm = dp::allow_tf32_matmul(), conv = dp::allow_tf32_conv();
  dp::set_allow_tf32_matmul(false);
  dp::set_allow_tf32_conv(false);
  const auto cases = dp_test::op_cases(dp_test::Suite::Check);
  REQUIRE(!cases.empty());
  for (const dp_test::OpCase* c : cases) {
    if (!dp_test::runs_on(*c, dp::backend::get(dp::cuda(0)))) continue;  // a fusion this backend does not offer
    dp_test::OpRun cpu(*c, dp::cpu(0)), gpu(*c, dp::cuda(0));
    cpu.run();
    gpu.run();
    const dp_test::Comparison cmp = dp_test::compare(cpu.read(), gpu.read(), c->tol);
    INFO(c->full_name(), ": ", cmp.bad, " elements out of tolerance (rtol ", c->tol.rtol,
         ", atol ", c->tol.atol, "); first ", cmp.first_bad, "; max |error| ", cmp.max_abs_err);
    CHECK(cmp.ok);
  }
  dp::set_allow_tf32_matmul(mm);
  dp::set_allow_tf32_conv(conv);
}

// The fused LayerNorm has CUDA kernels (so nn::layer_norm runs fused there), and its
// weight and bias gradients are sums in an order fixed by the shape, without atomics
// (Note [Fused LayerNorm on CUDA]): two runs of every case give the same bits, the
// second's partial sums on the scratch block the first released, its stale values kept.
TEST_CASE("the fused LayerNorm on cuda:0 is registered and bitwise repeatable") {
  Backend& gpu_backend = dp::backend::get(dp::cuda(0));
  CHECK(gpu_backend.supports(dp::backend::Op::LayerNorm, dp::backend::DType::F32));
  CHECK(gpu_backend.supports(dp::backend::Op::LayerNormBackward, dp::backend::DType::F32));
  int runs = 0;
  for (const dp_test::OpCase* c : dp_test::op_cases(dp_test::Suite::Check)) {
    if (c->kernel != dp_test::Kernel::LayerNorm && c->kernel != dp_test::Kernel::LayerNormBackward) continue;
    dp_test::OpRun first(*c, dp::cuda(0));
    first.run();
    const auto want = first.read();
    dp_test::OpRun second(*c, dp::cuda(0));
    second.run();
    const auto got = second.read();
    const dp_test::Comparison cmp = dp_test::compare(want, got, dp_test::kExact);
    INFO(c->full_name(), ": ", cmp.bad, " elements differ between two runs; first ", cmp.first_bad);
    CHECK(dp_test::bitwise_equal(want, got));
    ++runs;
  }
  CHECK(runs > 0);
}

// Note [TF32 policy]: with the switch off a GEMM is FP32 (error ~1e-6 of the FP64
// product); on, tensor cores round the inputs to TF32 (error ~1e-3) — so the two
// settings must give clearly different errors on an Ampere-or-newer GPU.
TEST_CASE("TF32 policy: matmul is pure FP32 unless allowed, and TF32 when allowed") {
  Side g = cuda_side();
  const int n = 256;
  const std::vector<float> a = randn(n * n, 11), b = randn(n * n, 12);
  std::vector<double> ref(static_cast<std::size_t>(n) * n, 0.0);
  for (int i = 0; i < n; ++i)
    for (int k = 0; k < n; ++k)
      for (int j = 0; j < n; ++j) ref[i * n + j] += double(a[i * n + k]) * double(b[k * n + j]);
  auto run = [&](bool tf32) {
    dp::set_allow_tf32_matmul(tf32);
    auto A = g.up(a), B = g.up(b);
    auto C = g.zeros(static_cast<std::size_t>(n) * n);
    g.b.run<dp::backend::Op::Gemm>(g.d, dp::backend::DType::F32,
                                   {false, false, n, n, n, 1.0f, A->f(), n, B->f(), n, 0.0f, C->f(), n, {}});
    const std::vector<float> c = g.down(*C, static_cast<std::size_t>(n) * n);
    double err = 0;  // relative to the size of a typical entry, sqrt(n)
    for (std::size_t i = 0; i < c.size(); ++i) err = std::max(err, std::abs(c[i] - ref[i]) / std::sqrt(double(n)));
    return err;
  };
  const bool before = dp::allow_tf32_matmul();
  const double fp32 = run(false), tf32 = run(true);
  dp::set_allow_tf32_matmul(before);
  INFO("max error: FP32 ", fp32, ", TF32 ", tf32);
  CHECK(fp32 < 1e-5);
  CHECK(tf32 < 2e-2);
  CHECK(tf32 > 10 * fp32);  // the tensor cores really ran
}

// ---- 16-bit convolutions (Note [16-bit convolutions on CUDA], cuda_blas_dnn.cpp) --------------

namespace {

using dp::backend::Conv2dShape;
using dp::backend::ConvPass;
using dp::backend::DType;
using dp::backend::Op;

Conv2dShape conv_shape(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 stride, i64 pad) {
  Conv2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.K = K, s.R = R, s.S = R;
  s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad;
  s.P = (H + 2 * pad - R) / stride + 1;
  s.Q = (W + 2 * pad - R) / stride + 1;
  return s;
}

/// The bits of v rounded to the 16-bit dtype dt, and the values bits of dt stand for.
std::vector<std::uint16_t> to16(DType dt, const std::vector<float>& v) {
  std::vector<std::uint16_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    b[i] = dt == DType::BF16 ? dp::BFloat16(v[i]).bits : dp::Float16(v[i]).bits;
  return b;
}
std::vector<float> from16(DType dt, const std::vector<std::uint16_t>& b) {
  std::vector<float> v(b.size());
  for (std::size_t i = 0; i < b.size(); ++i)
    v[i] = dt == DType::BF16 ? static_cast<float>(dp::BFloat16::from_bits(b[i]))
                             : static_cast<float>(dp::Float16::from_bits(b[i]));
  return v;
}

std::vector<float> uniform(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

struct Conv16Inputs {
  std::vector<std::uint16_t> x, w, b, gy;
};
/// The values of every output of the three passes: y without and with its ReLU, gx, gw, gbias.
struct Conv16Outputs {
  std::vector<float> y, y_relu, gx, gw, gb;
};

/// The passes of `s` on g's device in the 16-bit dtype dt: its kernels for dt, or where
/// it has none (float16 on the CPU) what nn then runs — the operands widened, the
/// float32 passes, the outputs rounded once.
Conv16Outputs conv16(Side& g, DType dt, const Conv2dShape& s, const Conv16Inputs& in) {
  const auto nx = static_cast<std::size_t>(s.N * s.C * s.H * s.W), nw = static_cast<std::size_t>(s.K * s.C * s.R * s.S),
             ny = static_cast<std::size_t>(s.N * s.K * s.P * s.Q), nb = static_cast<std::size_t>(s.K);
  const bool native = g.b.supports(Op::Conv2d, dt);
  const DType kt = native ? dt : DType::F32;
  auto up = [&](const std::vector<std::uint16_t>& v) { return native ? g.up(v) : g.up(from16(dt, v)); };
  auto zeros = [&](std::size_t n) { return native ? g.zeros<std::uint16_t>(n) : g.zeros<float>(n); };
  auto down = [&](const Buf& buf, std::size_t n) {
    return native ? from16(dt, g.down<std::uint16_t>(buf, n)) : from16(dt, to16(dt, g.down<float>(buf, n)));
  };
  auto x = up(in.x), w = up(in.w), b = up(in.b), gy = up(in.gy);
  auto y = zeros(ny), yr = zeros(ny), gx = zeros(nx), gw = zeros(nw), gb = zeros(nb);
  g.b.run<Op::Conv2d>(g.d, kt, {s, x->p, w->p, b->p, y->p, false});
  g.b.run<Op::Conv2d>(g.d, kt, {s, x->p, w->p, b->p, yr->p, true});
  g.b.run<Op::Conv2dBackwardData>(g.d, kt, {s, gy->p, w->p, gx->p});
  g.b.run<Op::Conv2dBackwardWeight>(g.d, kt, {s, x->p, gy->p, gw->p, gb->p});
  return {down(*y, ny), down(*yr, ny), down(*gx, nx), down(*gw, nw), down(*gb, nb)};
}

/// Checks |got - want| <= ulp * |want| + tau * rms(want) elementwise; reports the first
/// element outside and how many.
void check_close16(const char* what, const std::vector<float>& got, const std::vector<float>& want, double ulp,
                   double tau) {
  REQUIRE(got.size() == want.size());
  double sq = 0;
  for (float v : want) sq += double(v) * v;
  const double atol = tau * std::sqrt(sq / static_cast<double>(std::max<std::size_t>(want.size(), 1)));
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::abs(double(got[i]) - want[i]) <= ulp * std::abs(double(want[i])) + atol) continue;
    if (bad++ == 0) first = i;
  }
  INFO(what, ": ", bad, " of ", got.size(), " elements out of tolerance (", ulp, " |want| + ", atol, "); first at ",
       first, ": got ", bad ? got[first] : 0.0f, ", want ", bad ? want[first] : 0.0f);
  CHECK(bad == 0);
}

const char* path_name(ConvPass::Path p) {
  switch (p) {
    case ConvPass::Path::Unknown: return "unknown";
    case ConvPass::Path::Native: return "native";
    case ConvPass::Path::Widened: return "widened";
  }
  return "?";
}

}  // namespace

// Each pass on cuda:0 against the CPU on the same 16-bit inputs: the CPU backend's
// bfloat16 kernels (Note [bf16 convolutions through oneDNN]), and for float16, which the
// CPU convolves by widening, the float32 passes rounded once. The tolerance:
//  - Both sides form float32 sums and round each output once (cuDNN's pseudo-16-bit
//    configurations; oneDNN, or the widened float32 pass), so two roundings of nearly
//    equal sums may land one unit in the last place apart: ulp · |want|, ulp = 2^-7
//    for bfloat16 and 2^-10 for float16 (one unit is at most that, relative).
//  - The float32 sums themselves differ by their rounding errors, which scale with the
//    partial sums, i.e. with the size of the outputs (rms(want)), not with the element
//    (an output near 0 is a cancellation of large partial sums). Summed in order with
//    round-to-nearest they stay near 2^-24 · sqrt(terms) · rms: below 3e-5 rms for the
//    largest sum here, the first layer's weight gradient of 256 · 28 · 28 = 200704
//    terms. Tensor cores may round their float32 accumulations toward zero, a bias that
//    adds up over the accumulation steps: about 2^-24.5 of each running sum, so for that
//    sum, were it not split, 12544 steps of 16 products, one standard deviation of
//    2^-24.5 · Σ of the running sums ≈ 12544 / sqrt(3) · 2^-24.5 · rms ≈ 3e-4 rms.
//    tau = 2^-9 ≈ 2e-3 holds both with room.
// A wrong result — a transposed layout, a lost bias, a missed term — is off by the size
// of the outputs, hundreds of times that. The rounding points themselves (the bias
// added before the one rounding) are the next case's, and the op table's with
// per-element tolerances on smaller shapes.
TEST_CASE("16-bit convolutions through cuDNN: the CNN's layers and a strided one against the CPU, each pass") {
  Side g = cuda_side(), c{dp::backend::get(dp::cpu(0)), dp::cpu(0)};
  const Conv2dShape shapes[] = {
      conv_shape(256, 1, 28, 28, 32, 3, 1, 1),   // the Fashion-MNIST CNN's first layer, a batch of 256
      conv_shape(256, 32, 14, 14, 64, 3, 1, 1),  // and its second
      conv_shape(16, 12, 17, 15, 24, 3, 2, 1),   // stride 2, H != W, odd sizes
  };
  constexpr double tau = 0x1.0p-9;
  for (DType dt : {DType::BF16, DType::F16}) {
    const double ulp = dt == DType::BF16 ? 0x1.0p-7 : 0x1.0p-10;
    for (const Conv2dShape& s : shapes) {
      CAPTURE(std::string(dp::backend::dtype_name(dt)));
      CAPTURE(s.N);
      CAPTURE(s.C);
      CAPTURE(s.K);
      CAPTURE(s.stride_h);
      const auto seed = static_cast<unsigned>(s.C * 100 + s.K);
      const Conv16Inputs in{to16(dt, uniform(static_cast<std::size_t>(s.N * s.C * s.H * s.W), seed)),
                            to16(dt, uniform(static_cast<std::size_t>(s.K * s.C * s.R * s.S), seed + 1)),
                            to16(dt, uniform(static_cast<std::size_t>(s.K), seed + 2)),
                            to16(dt, uniform(static_cast<std::size_t>(s.N * s.K * s.P * s.Q), seed + 3))};
      const Conv16Outputs want = conv16(c, dt, s, in), got = conv16(g, dt, s, in), again = conv16(g, dt, s, in);
      check_close16("forward", got.y, want.y, ulp, tau);
      check_close16("forward + ReLU", got.y_relu, want.y_relu, ulp, tau);
      check_close16("backward data", got.gx, want.gx, ulp, tau);
      check_close16("backward weight", got.gw, want.gw, ulp, tau);
      check_close16("bias gradient", got.gb, want.gb, ulp, tau);
      // Deterministic algorithms only (Note [cuDNN algorithm choice]): the same bits again.
      CHECK(got.y == again.y);
      CHECK(got.y_relu == again.y_relu);
      CHECK(got.gx == again.gx);
      CHECK(got.gw == again.gw);
      CHECK(got.gb == again.gb);
      // Each pass ran through a 16-bit cuDNN algorithm or widened, and says which.
      const std::array<ConvPass, 3> passes = g.b.conv_passes(g.d, s, dt);
      const char* names[] = {"forward", "backward data", "backward weight"};
      for (int i = 0; i < 3; ++i) {
        MESSAGE(std::string(dp::backend::dtype_name(dt)), " N=", s.N, " C=", s.C, " K=", s.K, " stride ",
                s.stride_h, ", ", std::string(names[i]), ": ", std::string(path_name(passes[i].path)), " (",
                passes[i].detail, ")");
        CHECK(passes[i].path != ConvPass::Path::Unknown);
      }
      // cuDNN's forward algorithms are all deterministic and take both 16-bit types: the
      // 32-channel layer must not have widened.
      if (s.C == 32) CHECK(passes[0].path == ConvPass::Path::Native);
    }
  }
}

// Note [16-bit convolutions on CUDA]: the bias is blended by cuDNN (y filled with it,
// beta = 1). Every output here sums to 1 + 2^-12 before a bias of -1: an algorithm that
// blends in float32 and rounds once gives 2^-12 exactly in both 16-bit types; one that
// rounds the sum first gives 1 (2^-12 is below half a unit at 1 in either), and then 0,
// as PyTorch's CUDA convolution does (it adds the bias to cuDNN's rounded output). On an
// H200 (cuDNN 9.14) the small shape rounded once and the tensor-op algorithms of the
// other two rounded twice. A lost bias gives 1, a bias added twice -1.
TEST_CASE("a 16-bit convolution adds its bias once: one rounding or PyTorch's two, per algorithm") {
  // cuDNN may pick another algorithm per shape, so the CNN's second layer at its batch
  // and a strided shape too (pad 1, so every output reads the centre tap).
  Side g = cuda_side();
  for (const Conv2dShape& s : {conv_shape(2, 8, 6, 6, 8, 3, 1, 1), conv_shape(256, 32, 14, 14, 64, 3, 1, 1),
                               conv_shape(8, 16, 11, 9, 24, 3, 2, 1)}) {
    CAPTURE(s.N); CAPTURE(s.C); CAPTURE(s.K); CAPTURE(s.stride_h);
    const auto nx = static_cast<std::size_t>(s.N * s.C * s.H * s.W), ny = static_cast<std::size_t>(s.N * s.K * s.P * s.Q);
    std::vector<float> x(nx, 0.0f), w(static_cast<std::size_t>(s.K * s.C * s.R * s.S), 0.0f);
    for (i64 n = 0; n < s.N; ++n)
      for (i64 i = 0; i < s.H * s.W; ++i) {
        x[static_cast<std::size_t>((n * s.C + 0) * s.H * s.W + i)] = 1.0f;
        x[static_cast<std::size_t>((n * s.C + 1) * s.H * s.W + i)] = 0x1.0p-12f;
      }
    for (i64 k = 0; k < s.K; ++k)  // the centre tap of input channels 0 and 1
      for (i64 ch = 0; ch < 2; ++ch) w[static_cast<std::size_t>(((k * s.C + ch) * s.R + 1) * s.S + 1)] = 1.0f;
    const std::vector<float> b(static_cast<std::size_t>(s.K), -1.0f);
    for (DType dt : {DType::BF16, DType::F16}) {
      CAPTURE(std::string(dp::backend::dtype_name(dt)));
      for (bool relu : {false, true}) {
        CAPTURE(relu);
        auto X = g.up(to16(dt, x)), W = g.up(to16(dt, w)), B = g.up(to16(dt, b));
        auto Y = g.zeros<std::uint16_t>(ny);
        g.b.run<Op::Conv2d>(g.d, dt, {s, X->p, W->p, B->p, Y->p, relu});
        const std::vector<float> y = from16(dt, g.down<std::uint16_t>(*Y, ny));
        const auto once = std::count(y.begin(), y.end(), 0x1.0p-12f), twice = std::count(y.begin(), y.end(), 0.0f);
        CHECK(once + twice == static_cast<std::ptrdiff_t>(ny));
        MESSAGE(std::string(dp::backend::dtype_name(dt)), " N=", s.N, " C=", s.C, std::string(relu ? " relu" : ""),
                ": ", once, " outputs rounded once, ", twice, " twice");
      }
      const ConvPass fwd = g.b.conv_passes(g.d, s, dt)[0];
      if (fwd.path != ConvPass::Path::Native)
        MESSAGE(std::string(dp::backend::dtype_name(dt)), ": the forward widened (", fwd.detail, "), so cuDNN's blend went untested");
    }
  }
}

// The op table compares one scale and size with the CPU; here the sizes of the CPU's
// own test, the flag's life over several calls, and the bits of the CUDA Affine that
// Tensor::mul_ runs: the scaler's unscale_ multiplies exactly as mul_ does.
TEST_CASE("scale_find_nonfinite: the CPU's bits and flag, mul_'s bits, a flag no finite call clears") {
  using dp::backend::DType;
  using dp::backend::Op;
  Side g = cuda_side(0);
  Backend& cpu = dp::backend::get(dp::DeviceType::CPU);
  const Device c0 = dp::cpu(0);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // Bit for bit, but any NaN for a NaN: a NaN times f keeps its payload on x86 and is
  // the canonical NaN on the GPU (seen on an H200), as PyTorch's CPU and CUDA differ.
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (std::isnan(a[i]) ? !std::isnan(b[i]) : std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return false;
    return true;
  };
  for (i64 n : {i64{0}, i64{1}, i64{7}, i64{97}, i64{100003}})
    for (float f : {1.0f / 65536.0f, 0.3f, 3.0f}) {
      CAPTURE(n);
      CAPTURE(f);
      const auto un = static_cast<std::size_t>(n);
      std::vector<float> x = randn(un, 51);
      for (float& v : x) v *= 1e3f;
      if (n > 1) x[un - 1] = std::numeric_limits<float>::max();  // finite before, infinite after 3.0
      if (n > 2) x[un / 2] = -0.0f;
      // Finite input: the CPU's bits, the CUDA Affine's bits, no flag.
      std::vector<float> want = x;
      float want_found = 0.0f;
      cpu.run<Op::ScaleFindNonfinite>(c0, DType::F32, {want.data(), n, f, &want_found});
      auto bx = g.up(x);
      auto found = g.zeros(1);
      g.b.run<Op::ScaleFindNonfinite>(g.d, DType::F32, {bx->f(), n, f, found->f()});
      auto ax = g.up(x);
      auto ay = g.zeros(un);
      g.b.run<Op::Affine>(g.d, DType::F32, {ax->f(), ay->f(), n, f, 0.0f});
      const std::vector<float> got = g.down(*bx, un);
      CHECK(same_bits(got, want));
      CHECK(same_bits(got, g.down(*ay, un)));
      CHECK(want_found == 0.0f);
      CHECK(g.down(*found, 1)[0] == 0.0f);
      if (n == 0) continue;
      // A NaN or infinity first, in the middle or last sets the flag; the next, finite
      // call on the same flag leaves it set.
      for (std::size_t at : {std::size_t{0}, un / 2, un - 1})
        for (float bad : {nan, inf, -inf}) {
          CAPTURE(at);
          CAPTURE(bad);
          std::vector<float> y = randn(un, 52);
          y[at] = bad;
          std::vector<float> want_y = y;
          float cpu_found = 0.0f;
          cpu.run<Op::ScaleFindNonfinite>(c0, DType::F32, {want_y.data(), n, f, &cpu_found});
          auto by = g.up(y);
          auto flag = g.zeros(1);
          g.b.run<Op::ScaleFindNonfinite>(g.d, DType::F32, {by->f(), n, f, flag->f()});
          auto bz = g.up(randn(un, 53));
          g.b.run<Op::ScaleFindNonfinite>(g.d, DType::F32, {bz->f(), n, f, flag->f()});
          REQUIRE(cpu_found == 1.0f);
          REQUIRE(g.down(*flag, 1)[0] == 1.0f);
          REQUIRE(same_bits(g.down(*by, un), want_y));
        }
    }
}

TEST_CASE("caching allocator reuses blocks and does not grow in a loop") {
  Side g = cuda_side();
  g.b.synchronize(g.d);
  void* p = g.b.allocate(g.d, 1 << 20);
  g.b.deallocate(g.d, p, 1 << 20);
  void* q = g.b.allocate(g.d, 1 << 20);
  CHECK(q == p);  // same stream, same size class: the cached block comes back
  g.b.deallocate(g.d, q, 1 << 20);
  const std::size_t base = g.b.memory_allocated(g.d);
  g.b.reset_peak_memory(g.d);
  for (int i = 0; i < 200; ++i) {
    void* a = g.b.allocate(g.d, 3000 + 17 * i);
    void* b = g.b.allocate(g.d, 5 << 20);
    g.b.deallocate(g.d, b, 5 << 20);
    g.b.deallocate(g.d, a, 3000 + 17 * i);
  }
  CHECK(g.b.memory_allocated(g.d) == base);
  CHECK(g.b.max_memory_allocated(g.d) <= base + (5u << 20) + 8192);
}

// Note [Out of memory inside a step]: an impossible request fails with a dp::Error
// that says what is in use and cached; the cache is released only on an idle device,
// and dp::empty_cache gives the cached blocks back.
TEST_CASE("out of memory is a clear dp::Error; empty_cache returns the cache") {
  Side g = cuda_side();
  void* p = g.b.allocate(g.d, 64 << 20);
  g.b.deallocate(g.d, p, 64 << 20);  // cached now
  g.b.synchronize(g.d);
  const std::size_t huge = std::size_t{1} << 50;  // 1 PiB
  CHECK_THROWS_WITH_AS(g.b.allocate(g.d, huge), doctest::Contains("out of memory allocating"), dp::Error);
  CHECK_THROWS_WITH_AS(g.b.allocate(g.d, huge), doctest::Contains("cached in free blocks"), dp::Error);
  dp::empty_cache(g.d);
  void* q = g.b.allocate(g.d, 1 << 20);  // the allocator still works afterwards
  g.b.deallocate(g.d, q, 1 << 20);
}

// Note [Pinned block reuse]: a pinned block freed right after a copy out of it was
// enqueued must not be handed out (and overwritten) before the copy has read it. The
// copy is queued behind ~1 GiB of fills so that it is still pending when the host
// frees and re-allocates; a block reused at once would deliver 2s instead of 1s.
TEST_CASE("pinned host blocks are reused only after the copies that read them") {
  Side g = cuda_side();
  Backend& cb = g.b;
  g.b.synchronize(g.d);
  const std::size_t count = std::size_t{1} << 20, nbytes = count * sizeof(float);
  const std::size_t pinned0 = cb.pinned_memory_allocated();
  const i64 big = i64{1} << 26;
  Buf slow(cb, g.d, static_cast<std::size_t>(big) * sizeof(float));
  for (int offset : {0, 4096}) {  // a whole block, and a view inside one (a shard)
    CAPTURE(offset);
    auto* h = static_cast<float*>(cb.allocate_pinned(nbytes + 4096 * sizeof(float)));
    CHECK(cb.pinned_memory_allocated() >= pinned0 + nbytes);
    for (std::size_t i = 0; i < count + 4096; ++i) h[i] = 1.0f;
    Buf dst(cb, g.d, nbytes);
    for (int k = 0; k < 4; ++k)
      cb.run<dp::backend::Op::Fill>(g.d, dp::backend::DType::F32, {slow.f(), big, static_cast<float>(k)});
    cb.copy_from_host(dst.p, g.d, h + offset, nbytes);  // queued behind the fills
    cb.deallocate_pinned(h, nbytes + 4096 * sizeof(float));
    auto* h2 = static_cast<float*>(cb.allocate_pinned(nbytes + 4096 * sizeof(float)));
    for (std::size_t i = 0; i < count + 4096; ++i) h2[i] = 2.0f;
    const std::vector<float> got = g.down(dst, count);
    CHECK(std::all_of(got.begin(), got.end(), [](float v) { return v == 1.0f; }));
    cb.deallocate_pinned(h2, nbytes + 4096 * sizeof(float));
  }
  CHECK(cb.pinned_memory_allocated() == pinned0);
  // Once the copies are done, a freed block is reused (the cache works).
  g.b.synchronize(g.d);
  void* a = cb.allocate_pinned(nbytes);
  cb.deallocate_pinned(a, nbytes);
  void* b = cb.allocate_pinned(nbytes);
  CHECK(b == a);
  cb.deallocate_pinned(b, nbytes);
}

TEST_CASE("peer copies between two devices") {
  Backend& cb = dp::backend::get(dp::DeviceType::CUDA);
  if (cb.device_count() < 2) {
    MESSAGE("only one CUDA device: peer copy not tested");
    return;
  }
  Side a = cuda_side(0), b = cuda_side(1);
  const auto x = randn(1 << 16, 31);
  auto bx = a.up(x);
  auto by = b.zeros(x.size());
  cb.copy(by->p, b.d, bx->p, a.d, x.size() * sizeof(float));
  auto back = a.zeros(x.size());
  cb.copy(back->p, a.d, by->p, b.d, x.size() * sizeof(float));
  CHECK(b.down(*by, x.size()) == x);
  CHECK(a.down(*back, x.size()) == x);
}

TEST_CASE("copy_rows: one 2-d copy moves each row to its pitch and leaves the gaps, as the CPU's") {
  Side g = cuda_side(0);
  for (const auto& [rows, row_bytes, src_pitch, dst_pitch] :
       {std::tuple<std::size_t, std::size_t, std::size_t, std::size_t>{2048, 512, 1536, 512}, {7, 6, 10, 9},
        {1, 4096, 4096, 4100}, {0, 8, 8, 8}}) {
    CAPTURE(rows); CAPTURE(row_bytes);
    std::vector<std::uint8_t> src(rows * src_pitch + 1), dst(rows * dst_pitch + 1, 0xAB);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 131 + 7);
    auto s = g.up(src);
    auto d = g.up(dst);
    g.b.copy_rows(d->p, dst_pitch, s->p, src_pitch, row_bytes, rows, g.d);
    std::vector<std::uint8_t> want = dst;
    dp::backend::get(dp::DeviceType::CPU).copy_rows(want.data(), dst_pitch, src.data(), src_pitch, row_bytes, rows,
                                                    Device{dp::DeviceType::CPU, 0});
    CHECK(g.down<std::uint8_t>(*d, dst.size()) == want);
  }
  // One row, pitches past cudaMemcpy2D's limit (2^31 - 1 bytes): a narrow's backward
  // along dim 0 of a large tensor passes the whole tensor's bytes as its pitch.
  std::vector<std::uint8_t> one(64);
  for (std::size_t i = 0; i < one.size(); ++i) one[i] = static_cast<std::uint8_t>(3 * i + 1);
  auto s1 = g.up(one);
  auto d1 = g.zeros<std::uint8_t>(one.size());
  g.b.copy_rows(d1->p, std::size_t{1} << 32, s1->p, std::size_t{1} << 32, one.size(), 1, g.d);
  CHECK(g.down<std::uint8_t>(*d1, one.size()) == one);
  std::vector<float> buf(64);
  auto d = g.up(buf);
  CHECK_THROWS_AS(g.b.copy_rows(d->p, 8, d->f() + 32, 16, 12, 2, g.d), dp::Error);
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_backend_test", argc, argv); }
