// Tests of the CPU backend: every kernel against a naive double-precision reference
// written here, on random inputs including edge sizes (0, 1, primes, above the
// parallel grain), plus memory, copies, devices used concurrently and bad input.
#include <doctest/doctest.h>

#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"
#include "backend/method_kernels.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "test_errors.h"
#include "test_scale.h"

namespace {

using namespace dp::backend;
using cpu::CpuBackend;
using i64 = std::int64_t;
using dp::Device;

CpuBackend& be() { return cpu::cpu_backend_impl(); }
Device dev0() { return dp::cpu(0); }

std::vector<float> random_vec(i64 n, unsigned seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

/// Pooling input that stresses the winner rule: values in steps of 0.5 (many ties),
/// with NaN, -inf and +inf sprinkled at fixed strides.
std::vector<float> pool_input(i64 n, unsigned seed) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto x = random_vec(n, seed);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = std::round(x[i] * 2.0f);  // many ties
    if (i % 11 == 3) x[i] = nan;
    if (i % 13 == 5) x[i] = -inf;
    if (i % 17 == 7) x[i] = inf;
  }
  return x;
}

/// Checks |got - want| <= atol + rtol * |want| elementwise; reports the first failure.
void check_close(const std::vector<float>& got, const std::vector<double>& want, double rtol,
                 double atol, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= atol + rtol * std::abs(want[i]))) {
      INFO(what, ": index ", i, " got ", got[i], " want ", want[i]);
      CHECK(false);
      return;
    }
  }
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

const i64 kSizes[] = {0, 1, 7, 97, 100003};  // empty, one, small prime, prime, > grain

}  // namespace

// ---- random numbers ------------------------------------------------------------------------

TEST_CASE("philox4x32-10 known answer (Random123 kat_vectors)") {
  const Philox4 out = philox4x32(Philox4{{0, 0, 0, 0}}, 0, 0);
  CHECK(out.v[0] == 0x6627e8d5u);
  CHECK(out.v[1] == 0xe169c58du);
  CHECK(out.v[2] == 0xbc57ac4cu);
  CHECK(out.v[3] == 0x9b00dbd8u);
  // Second Random123 vector: all-ones counter and key.
  const Philox4 ones = philox4x32(Philox4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                                  0xffffffffu, 0xffffffffu);
  CHECK(ones.v[0] == 0x408f276du);
  CHECK(ones.v[1] == 0x41c83b0eu);
  CHECK(ones.v[2] == 0xa20bc7c6u);
  CHECK(ones.v[3] == 0x6d5451fdu);
}

TEST_CASE("uniform and normal fills: range, moments, counter addressing") {
  const i64 n = 200000;
  std::vector<float> u(n), z(n);
  be().fill_uniform(dev0(), u.data(), n, 0.0f, 1.0f, 1234, 0);
  be().fill_normal(dev0(), z.data(), n, 0.0f, 1.0f, 1234, 0);
  double su = 0, sz = 0, szz = 0;
  for (i64 i = 0; i < n; ++i) {
    REQUIRE(u[i] >= 0.0f);
    REQUIRE(u[i] < 1.0f);
    REQUIRE(std::isfinite(z[i]));
    su += u[i];
    sz += z[i];
    szz += double(z[i]) * z[i];
  }
  CHECK(su / n == doctest::Approx(0.5).epsilon(0.01));
  CHECK(std::abs(sz / n) < 0.01);
  CHECK(std::sqrt(szz / n - (sz / n) * (sz / n)) == doctest::Approx(1.0).epsilon(0.01));
  // Element i depends only on (seed, offset + i): a fill at offset 10 is a shifted view.
  std::vector<float> shifted(100);
  be().fill_uniform(dev0(), shifted.data(), 100, 0.0f, 1.0f, 1234, 10);
  CHECK(std::memcmp(shifted.data(), u.data() + 10, 100 * sizeof(float)) == 0);
  CHECK(u[5] == uniform_from(1234, 5));
  // A different seed gives different numbers; lo/hi rescale.
  std::vector<float> other(100);
  be().fill_uniform(dev0(), other.data(), 100, -2.0f, 2.0f, 99, 0);
  CHECK(std::memcmp(other.data(), u.data(), 100 * sizeof(float)) != 0);
  for (float v : other) CHECK((v >= -2.0f && v < 2.0f));
}

TEST_CASE("random fills and dropout: every element is the scalar functor's, bit for bit") {
  // Note [Vectorised random fills]: the tiled, vectorised loops (whichever ISA clone the
  // loader picked) against uniform_from / normal_from one element at a time, from an
  // offset whose counters cross 2^32 (the counter's high word changes mid-tile), over
  // lengths that end inside a tile, on one thread and on all cores.
  const int hw = dp::hardware_concurrency();
  const std::uint64_t offset = (std::uint64_t{1} << 32) - 300;
  for (int devices : {hw, 1})
    for (i64 n : {i64{1}, i64{255}, i64{257}, i64{70001}}) {
      CAPTURE(devices);
      CAPTURE(n);
      be().set_concurrent_devices(devices);
      std::vector<float> u(n), z(n), y(n), mask(n);
      const auto x = random_vec(n, 5);
      be().fill_uniform(dev0(), u.data(), n, -1.5f, 2.5f, 77, offset);
      be().fill_normal(dev0(), z.data(), n, 0.25f, 3.0f, 78, offset);
      be().dropout(dev0(), x.data(), y.data(), mask.data(), n, 0.4f, 79, offset);
      be().set_concurrent_devices(1);
      const float scale = 1.0f / (1.0f - 0.4f);
      i64 bad_u = 0, bad_z = 0, bad_d = 0;
      for (i64 i = 0; i < n; ++i) {
        const std::uint64_t c = offset + static_cast<std::uint64_t>(i);
        const float want_u = -1.5f + 4.0f * uniform_from(77, c);
        const float want_z = 0.25f + 3.0f * normal_from(78, c);
        const float m = uniform_from(79, c) >= 0.4f ? scale : 0.0f;
        bad_u += std::memcmp(&u[i], &want_u, sizeof(float)) != 0;
        bad_z += std::memcmp(&z[i], &want_z, sizeof(float)) != 0;
        const float want_y = x[i] * m;
        bad_d += mask[i] != m || std::memcmp(&y[i], &want_y, sizeof(float)) != 0;
      }
      CHECK(bad_u == 0);
      CHECK(bad_z == 0);
      CHECK(bad_d == 0);
    }
}

TEST_CASE("dropout keeps 1-p of the elements, scaled") {
  const i64 n = 100003;
  auto x = random_vec(n, 1);
  std::vector<float> y(n), mask(n);
  be().dropout(dev0(), x.data(), y.data(), mask.data(), n, 0.25f, 7, 0);
  i64 kept = 0;
  for (i64 i = 0; i < n; ++i) {
    const bool keep = uniform_from(7, i) >= 0.25f;
    REQUIRE(mask[i] == (keep ? 1.0f / 0.75f : 0.0f));
    REQUIRE(y[i] == x[i] * mask[i]);
    kept += keep;
  }
  CHECK(double(kept) / n == doctest::Approx(0.75).epsilon(0.01));
  be().dropout(dev0(), x.data(), y.data(), mask.data(), n, 1.0f, 7, 0);
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 0.0f; }));
  CHECK_THROWS_AS(be().dropout(dev0(), x.data(), y.data(), mask.data(), n, 1.5f, 7, 0), dp::Error);
}

// ---- memory and copies ------------------------------------------------------------------------

TEST_CASE("allocation: alignment, counters, peak, zero size, out of memory") {
  const Device d = dp::cpu(1);
  const std::size_t base = be().memory_allocated(d);
  be().reset_peak_memory(d);
  void* a = be().allocate(d, 1000);
  void* b = be().allocate(d, 3);
  void* z1 = be().allocate(d, 0);
  void* z2 = be().allocate(d, 0);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 64 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % 64 == 0);
  CHECK(z1 != nullptr);
  CHECK(z1 != z2);
  CHECK(be().memory_allocated(d) == base + 1003);
  CHECK(be().memory_allocated(dp::cpu(2)) == 0);  // counters are per device
  be().deallocate(d, a, 1000);
  CHECK(be().memory_allocated(d) == base + 3);
  CHECK(be().max_memory_allocated(d) == base + 1003);
  be().reset_peak_memory(d);
  CHECK(be().max_memory_allocated(d) == base + 3);
  be().deallocate(d, b, 3);
  be().deallocate(d, z1, 0);
  be().deallocate(d, z2, 0);
  be().deallocate(d, nullptr, 0);
  CHECK(be().memory_allocated(d) == base);
  try {
    (void)be().allocate(d, std::size_t{1} << 62);
    FAIL("expected out of memory");
  } catch (const dp::Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("cpu:1") != std::string::npos);
    CHECK(msg.find(std::to_string(std::size_t{1} << 62)) != std::string::npos);
  }
  CHECK(be().memory_allocated(d) == base);
}

TEST_CASE("poisoned memory: an allocation reads as NaN while it is on, and is not filled when it is off") {
  // Note [Poisoned memory]: with it on, every allocation, fresh or a cached block again,
  // is filled with 0xFF bytes.
  const Device d = dp::cpu(1);
  const bool was = dp::backend::Backend::poison_memory();
  const std::size_t n = 1 << 16;  // large enough for the block cache
  dp::backend::Backend::set_poison_memory(true);
  for (int round = 0; round < 2; ++round) {  // a new block, then the cached one
    auto* p = static_cast<float*>(be().allocate(d, n * sizeof(float)));
    bool all_nan = true;
    for (std::size_t i = 0; i < n; ++i) all_nan = all_nan && std::isnan(p[i]);
    CHECK(all_nan);
    std::fill(p, p + n, 1.0f);
    be().deallocate(d, p, n * sizeof(float));
  }
  dp::backend::Backend::set_poison_memory(false);
  auto* q = static_cast<float*>(be().allocate(d, n * sizeof(float)));  // not filled (the cached block's 1s here)
  CHECK(std::count_if(q, q + n, [](float v) { return std::isnan(v); }) == 0);
  be().deallocate(d, q, n * sizeof(float));
  dp::backend::Backend::set_poison_memory(was);
}

TEST_CASE("copies ahead: the bytes of the start land at finish_copy; finishing twice or a foreign copy is an error") {
  // Note [Copies ahead]: the bytes are taken when the copy starts, held by the
  // destination until they land.
  const Device src_dev = dp::cpu(1), dst_dev = dp::cpu(2);
  std::vector<float> src(1000), dst(1000, -1.0f);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) * 0.5f;
  const std::vector<float> at_start = src;
  const std::size_t before = be().memory_allocated(dst_dev);
  std::unique_ptr<PendingCopy> p = be().copy_ahead(dst_dev, src.data(), src_dev, 600 * sizeof(float));
  REQUIRE(p != nullptr);
  CHECK(be().memory_allocated(dst_dev) == before + 600 * sizeof(float));
  std::fill(src.begin(), src.end(), 9.0f);  // later writes to the source do not travel
  be().finish_copy(*p, dst.data() + 100, dst_dev);
  CHECK(be().memory_allocated(dst_dev) == before);
  for (std::size_t i = 0; i < dst.size(); ++i) {
    CAPTURE(i);
    CHECK(dst[i] == (i >= 100 && i < 700 ? at_start[i - 100] : -1.0f));
  }
  CHECK_THROWS_AS(be().finish_copy(*p, dst.data(), dp::cpu(3)), dp::Error);  // not its destination
  CHECK_THROWS_AS(be().finish_copy(*p, dst.data(), dst_dev), dp::Error);
  struct Foreign final : PendingCopy {};
  Foreign f;
  CHECK_THROWS_AS(be().finish_copy(f, dst.data(), dst_dev), dp::Error);
  // Dropped unfinished: what it held is given back.
  {
    std::unique_ptr<PendingCopy> q = be().copy_ahead(dst_dev, src.data(), src_dev, 10 * sizeof(float));
    CHECK(be().memory_allocated(dst_dev) == before + 10 * sizeof(float));
  }
  CHECK(be().memory_allocated(dst_dev) == before);
}

TEST_CASE("caching allocator: large blocks are reused per device, counted as live bytes, emptied") {
  // Note [CPU caching allocator]: 1 MiB is above the caching threshold.
  const Device d = dp::cpu(3);
  const std::size_t big = std::size_t{1} << 20, base = be().memory_allocated(d);
  be().empty_cache();
  CHECK(be().cached_bytes(d) == 0);
  void* a = be().allocate(d, big);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 64 == 0);
  std::memset(a, 1, big);
  be().deallocate(d, a, big);
  CHECK(be().memory_allocated(d) == base);  // the cache is not counted as allocated
  const std::size_t cached = be().cached_bytes(d);
  if (cached == 0) return;  // an AddressSanitizer build caches nothing
  CHECK(cached >= big);
  CHECK(be().cached_bytes(dp::cpu(4)) == 0);  // caches are per device
  void* other = be().allocate(dp::cpu(4), big);  // another device never gets d's block
  CHECK(other != a);
  void* b = be().allocate(d, big - 100);  // same size class: the cached block again
  CHECK(b == a);
  CHECK(be().cached_bytes(d) == 0);  // its only block is in use again
  CHECK(be().memory_allocated(d) == base + big - 100);
  be().deallocate(d, b, big - 100);
  be().deallocate(dp::cpu(4), other, big);
  be().empty_cache();
  CHECK(be().cached_bytes(d) == 0);
  CHECK(be().cached_bytes(dp::cpu(4)) == 0);
  CHECK(be().memory_allocated(d) == base);
}

TEST_CASE("huge pages: blocks of 2 MiB and more start on a 2 MiB boundary, smaller ones on a line") {
  // Note [Huge pages for large blocks]: the alignment is what lets the kernel back the
  // block's whole 2 MiB pages with huge pages; whether it does is the kernel's choice.
  const Device d = dp::cpu(5);
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  for (const std::size_t bytes : {kHuge, kHuge + 12345, 3 * kHuge + 64, kHuge - 64, std::size_t{300} << 10}) {
    CAPTURE(bytes);
    void* p = be().allocate(d, bytes);
    REQUIRE(p != nullptr);
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    CHECK(addr % 64 == 0);
    if (bytes >= kHuge) CHECK(addr % kHuge == 0);
    std::memset(p, 0x5a, bytes);  // every byte of the block is the caller's
    CHECK(static_cast<unsigned char*>(p)[bytes - 1] == 0x5a);
    be().deallocate(d, p, bytes);
  }
  be().empty_cache();
  CHECK(be().memory_allocated(d) == 0);
}

TEST_CASE("copies between devices and to/from host really copy") {
  const i64 n = 1000;
  auto host = random_vec(n, 3);
  const std::size_t bytes = n * sizeof(float);
  auto* a = static_cast<float*>(be().allocate(dp::cpu(0), bytes));
  auto* b = static_cast<float*>(be().allocate(dp::cpu(1), bytes));
  be().copy_from_host(a, dp::cpu(0), host.data(), bytes);
  be().copy(b, dp::cpu(1), a, dp::cpu(0), bytes);
  CHECK(a != b);
  a[0] = 42.0f;  // b is independent memory
  std::vector<float> back(n);
  be().copy_to_host(back.data(), b, dp::cpu(1), bytes);
  CHECK(bitwise_equal(back, host));
  be().memset_zero(b, dp::cpu(1), bytes);
  be().copy_to_host(back.data(), b, dp::cpu(1), bytes);
  CHECK(std::all_of(back.begin(), back.end(), [](float v) { return v == 0.0f; }));
  be().deallocate(dp::cpu(0), a, bytes);
  be().deallocate(dp::cpu(1), b, bytes);
}

TEST_CASE("devices: count, bad ids, threads per device, events") {
  CHECK(be().device_count() == dp::device_count(dp::DeviceType::CPU));
  CHECK_THROWS_AS((be().run<Op::Fill>(Device{dp::DeviceType::CPU, 1000}, DType::F32, {nullptr, 0, 0.0f})), dp::Error);
  CHECK_THROWS_AS(be().threads_per_device(Device{dp::DeviceType::CUDA, 0}), dp::Error);
  CHECK(be().threads_per_device(dev0()) == dp::hardware_concurrency());
  auto ev = be().create_event(dev0());
  be().record_event(*ev, dev0());
  be().wait_event(*ev, dev0());
  be().synchronize(dev0());
  CHECK_THROWS_AS(be().set_concurrent_devices(0), dp::Error);
}

// ---- elementwise ------------------------------------------------------------------------------

TEST_CASE("copy_rows: each row to its pitch, the gaps left alone, at every size; bad pitches throw") {
  // Row sizes below and above the threaded grain (64 KiB a task), odd byte counts.
  for (const auto& [rows, row_bytes, gap_src, gap_dst] :
       {std::tuple<std::size_t, std::size_t, std::size_t, std::size_t>{1, 7, 0, 3}, {5, 12, 4, 0}, {300, 1000, 24, 8},
        {9, 70000, 5, 11}, {0, 16, 0, 0}, {4, 0, 2, 2}}) {
    CAPTURE(rows); CAPTURE(row_bytes);
    const std::size_t sp = row_bytes + gap_src, dp_ = row_bytes + gap_dst;
    std::vector<unsigned char> src(rows * sp + 1), dst(rows * dp_ + 1, 0xAB);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
    be().copy_rows(dst.data(), dp_, src.data(), sp, row_bytes, rows, dev0());
    std::size_t bad = 0;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < dp_; ++c)
        bad += dst[r * dp_ + c] != (c < row_bytes ? src[r * sp + c] : 0xAB);
    CHECK(bad == 0);
    CHECK(dst.back() == 0xAB);
  }
  std::vector<float> buf(64);
  CHECK_THROWS_WITH_AS(be().copy_rows(buf.data(), 8, buf.data() + 32, 16, 12, 2, dev0()),
                       doctest::Contains("pitches of at least 12 bytes"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::backend::get(dp::DeviceType::CPU).copy_rows(buf.data(), 16, buf.data() + 32, 8, 12, 2, dev0()),
                       doctest::Contains("got 16 (dst) and 8 (src)"), dp::Error);
}

TEST_CASE("memset_zero: every byte of small and of large (threaded) blocks, nothing beyond") {
  // Blocks of 1 MiB and more are cleared in 256 KiB pieces over the device's threads;
  // odd lengths and an unaligned start leave a partial last piece.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{1000}, (std::size_t{1} << 20) - 1,
                        std::size_t{1} << 20, (std::size_t{3} << 20) + 12345}) {
    for (int devices : {1, dp::hardware_concurrency()}) {
      CAPTURE(n);
      CAPTURE(devices);
      std::vector<unsigned char> buf(n + 64, 0xAB);
      be().set_concurrent_devices(devices);
      be().memset_zero(buf.data() + 3, dev0(), n);
      be().set_concurrent_devices(1);
      REQUIRE(std::all_of(buf.begin(), buf.begin() + 3, [](unsigned char v) { return v == 0xAB; }));
      REQUIRE(std::all_of(buf.begin() + 3, buf.begin() + 3 + static_cast<std::ptrdiff_t>(n),
                          [](unsigned char v) { return v == 0; }));
      REQUIRE(std::all_of(buf.begin() + 3 + static_cast<std::ptrdiff_t>(n), buf.end(),
                          [](unsigned char v) { return v == 0xAB; }));
    }
  }
}

TEST_CASE("fill, arange, casts") {
  for (i64 n : kSizes) {
    std::vector<float> y(n + 1, -7.0f);
    be().run<Op::Fill>(dev0(), DType::F32, {y.data(), n, 2.5f});
    for (i64 i = 0; i < n; ++i) REQUIRE(y[i] == 2.5f);
    CHECK(y[n] == -7.0f);  // no write past n
    be().run<Op::Arange>(dev0(), DType::F32, {y.data(), n, 1.0f, 0.5f});
    for (i64 i = 0; i < n; ++i) REQUIRE(y[i] == 1.0f + float(i) * 0.5f);
    std::vector<i64> yi(n + 1, -1);
    be().run<Op::Arange>(dev0(), DType::I64, {yi.data(), n, std::int64_t{5}, std::int64_t{3}});
    for (i64 i = 0; i < n; ++i) REQUIRE(yi[i] == 5 + 3 * i);
    be().run<Op::Fill>(dev0(), DType::I64, {yi.data(), n, std::int64_t{9}});
    for (i64 i = 0; i < n; ++i) REQUIRE(yi[i] == 9);
    CHECK(yi[n] == -1);
    auto x = random_vec(n, 4, -100.0f, 100.0f);
    be().run<Op::Cast>(dev0(), DType::I64, {x.data(), DType::F32, yi.data(), n});
    for (i64 i = 0; i < n; ++i) REQUIRE(yi[i] == static_cast<i64>(x[i]));
    be().run<Op::Cast>(dev0(), DType::F32, {yi.data(), DType::I64, y.data(), n});
    for (i64 i = 0; i < n; ++i) REQUIRE(y[i] == static_cast<float>(yi[i]));
  }
}

TEST_CASE("unary ops against std:: math") {
  struct Case {
    UnaryOp op;
    double (*ref)(double);
    float lo, hi;
  };
  const Case cases[] = {
      {UnaryOp::Neg, [](double x) { return -x; }, -3, 3},
      {UnaryOp::Exp, [](double x) { return std::exp(x); }, -5, 5},
      {UnaryOp::Log, [](double x) { return std::log(x); }, 0.01f, 10},
      {UnaryOp::Sqrt, [](double x) { return std::sqrt(x); }, 0, 10},
      {UnaryOp::Rsqrt, [](double x) { return 1 / std::sqrt(x); }, 0.01f, 10},
      {UnaryOp::Abs, [](double x) { return std::abs(x); }, -3, 3},
      {UnaryOp::Square, [](double x) { return x * x; }, -3, 3},
      {UnaryOp::Reciprocal, [](double x) { return 1 / x; }, 0.1f, 3},
      {UnaryOp::Relu, [](double x) { return x > 0 ? x : 0.0; }, -3, 3},
      {UnaryOp::Sigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }, -8, 8},
      {UnaryOp::Tanh, [](double x) { return std::tanh(x); }, -4, 4},
      {UnaryOp::Sign, [](double x) { return double((x > 0) - (x < 0)); }, -3, 3},
      {UnaryOp::Erf, [](double x) { return std::erf(x); }, -4, 4},
      {UnaryOp::LogSigmoid, [](double x) { return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x))); }, -30, 30},
  };
  for (const Case& c : cases) {
    for (i64 n : kSizes) {
      auto x = random_vec(n, 5, c.lo, c.hi);
      std::vector<float> y(n);
      be().run<Op::Unary>(dev0(), DType::F32, {c.op, x.data(), y.data(), n});
      std::vector<double> want(n);
      for (i64 i = 0; i < n; ++i) want[i] = c.ref(x[i]);
      check_close(y, want, 1e-6, 1e-7, "unary op " + std::to_string(int(c.op)));
      // In place (y aliases x) gives the same.
      be().run<Op::Unary>(dev0(), DType::F32, {c.op, x.data(), x.data(), n});
      CHECK(bitwise_equal(x, y));
    }
  }
  CHECK(apply_unary(UnaryOp::Relu, std::numeric_limits<float>::quiet_NaN()) !=
        apply_unary(UnaryOp::Relu, std::numeric_limits<float>::quiet_NaN()));  // NaN kept
}

namespace {

/// |got - want| in units of the float spacing at want (for want in the denormals, the
/// denormal spacing); 0 when both are the same infinity, and infinite when got is NaN,
/// the wrong infinity or finite where want overflows.
double ulp_error(float got, double want) {
  const float w = static_cast<float>(want);
  if (std::isinf(w)) return got == w ? 0.0 : std::numeric_limits<double>::infinity();
  if (std::isnan(got) || std::isinf(got)) return std::numeric_limits<double>::infinity();
  const float a = std::fabs(w);
  const double spacing = static_cast<double>(std::nextafter(a, std::numeric_limits<float>::infinity())) - a;
  return std::fabs(static_cast<double>(got) - want) / spacing;
}

/// Floats to try a function of one float on: every 997th bit pattern (every sign,
/// exponent and denormal range), then the edges of exp's range and the specials.
std::vector<float> float_sweep() {
  std::vector<float> xs;
  for (std::uint64_t b = 0; b < (std::uint64_t{1} << 32); b += 997) {
    const auto u = static_cast<std::uint32_t>(b);
    float x;
    std::memcpy(&x, &u, sizeof x);
    xs.push_back(x);
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min(), 1e-40f,
                  88.72283f, 88.7228394f, 88.8f, -87.33654f, -103.972076f, -103.97208f, -104.0f, 0.625f, -0.625f,
                  0.62499994f, 9.0f, 44.0f})
    xs.push_back(x);
  return xs;
}

}  // namespace

TEST_CASE("exp_approx and tanh_approx: within their ulp bounds over the float range, specials exact") {
  // Note [Vectorisable exp and tanh]: the bounds it states, checked against double.
  const std::vector<float> xs = float_sweep();
  double worst_exp = 0, worst_tanh = 0;
  float worst_exp_x = 0, worst_tanh_x = 0;
  i64 nan_kept = 0, nans = 0;
  for (float x : xs) {  // one check at the end: millions of doctest assertions are slow
    if (std::isnan(x)) {
      ++nans;
      nan_kept += std::isnan(exp_approx(x)) && std::isnan(tanh_approx(x));
      continue;
    }
    const double e = ulp_error(exp_approx(x), std::exp(static_cast<double>(x)));
    const double t = ulp_error(tanh_approx(x), std::tanh(static_cast<double>(x)));
    if (!(e <= worst_exp)) worst_exp = e, worst_exp_x = x;  // `!(<=)` records a NaN error
    if (!(t <= worst_tanh)) worst_tanh = t, worst_tanh_x = x;
  }
  CAPTURE(worst_exp_x);
  CAPTURE(worst_tanh_x);
  CHECK(worst_exp <= 1.5);
  CHECK(worst_tanh <= 2.0);
  CHECK(nans > 0);
  CHECK(nan_kept == nans);
  MESSAGE("worst exp_approx error ", worst_exp, " ulp, tanh_approx ", worst_tanh, " ulp");
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(exp_approx(-inf) == 0.0f);
  CHECK(exp_approx(inf) == inf);
  CHECK(exp_approx(0.0f) == 1.0f);
  CHECK(exp_approx(-0.0f) == 1.0f);
  CHECK(exp_approx(89.0f) == inf);
  CHECK(exp_approx(-200.0f) == 0.0f);
  CHECK(tanh_approx(inf) == 1.0f);
  CHECK(tanh_approx(-inf) == -1.0f);
  CHECK(tanh_approx(100.0f) == 1.0f);
  CHECK(std::signbit(tanh_approx(-0.0f)));
  CHECK(tanh_approx(-0.0f) == 0.0f);
  CHECK(tanh_approx(1e-40f) == 1e-40f);  // denormal in, the same out (tanh x = x there)
}

TEST_CASE("unary clones: exp, tanh and sigmoid give the functors' bits at every width and start") {
  // Note [Unary clones]: the loop the loader picked for this CPU must write what the
  // functors write, element by element: every length 0..40 (each vector tail), a start
  // one float in (unaligned), in place, and values of every class.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special{nan, inf, -inf, 0.0f, -0.0f, 1e-40f, -1e-40f, 88.72f, 89.0f, -104.0f, -87.5f,
                                   0.625f, -0.625f, 20.0f, -20.0f};
  std::mt19937 rng(11);
  auto value = [&] {  // a special value one time in three
    return rng() % 3 == 0 ? special[rng() % special.size()] : std::uniform_real_distribution<float>(-30, 30)(rng);
  };
  for (UnaryOp op : {UnaryOp::Exp, UnaryOp::Tanh, UnaryOp::Sigmoid}) {
    CHECK(cpu::has_unary_clone(op));
    for (i64 n = 0; n <= 40; ++n)
      for (i64 start : {i64{0}, i64{1}}) {
        CAPTURE(static_cast<int>(op));
        CAPTURE(n);
        CAPTURE(start);
        std::vector<float> x(static_cast<std::size_t>(start + n)), y(x.size(), 7.0f);
        for (float& v : x) v = value();
        std::vector<float> want = y;
        for (i64 i = start; i < start + n; ++i) want[i] = apply_unary(op, x[i]);
        cpu::unary_clone_f32(op, x.data() + start, y.data() + start, n);
        REQUIRE(bitwise_equal(want, y));
        cpu::unary_clone_f32(op, x.data() + start, x.data() + start, n);  // in place
        for (i64 i = 0; i < start; ++i) x[i] = want[i];
        REQUIRE(bitwise_equal(want, x));
      }
  }
  CHECK_FALSE(cpu::has_unary_clone(UnaryOp::Log));
  // bfloat16 ReLU: the float functor on the widened value, rounded once (NaN included).
  CHECK(cpu::has_unary_clone_bf16(UnaryOp::Relu));
  CHECK_FALSE(cpu::has_unary_clone_bf16(UnaryOp::Exp));
  for (i64 n = 0; n <= 40; ++n)
    for (i64 start : {i64{0}, i64{1}}) {
      CAPTURE(n);
      CAPTURE(start);
      std::vector<dp::BFloat16> x(static_cast<std::size_t>(start + n)), y(x.size(), dp::BFloat16(7.0f));
      for (auto& v : x) v = dp::BFloat16(value());
      x.push_back(dp::BFloat16::from_bits(0xFF81));  // a negative NaN's bits, past the values: no effect on n
      auto want = y;
      for (i64 i = start; i < start + n; ++i) want[i] = dp::BFloat16(apply_unary(UnaryOp::Relu, float(x[i])));
      cpu::unary_clone_bf16(UnaryOp::Relu, x.data() + start, y.data() + start, n);
      for (std::size_t i = 0; i < y.size(); ++i) REQUIRE(y[i].bits == want[i].bits);
    }
  {  // every bfloat16 bit pattern once
    std::vector<dp::BFloat16> x(65536), y(65536);
    for (std::uint32_t b = 0; b < 65536; ++b) x[b] = dp::BFloat16::from_bits(static_cast<std::uint16_t>(b));
    cpu::unary_clone_bf16(UnaryOp::Relu, x.data(), y.data(), 65536);
    for (std::uint32_t b = 0; b < 65536; ++b)
      REQUIRE(y[b].bits == dp::BFloat16(apply_unary(UnaryOp::Relu, float(x[b]))).bits);
  }
}

TEST_CASE("binary, affine, axpy and cast clones: the functors' bits at every width, start and stride pattern") {
  // Note [Binary clones]: whichever loop the loader picked for this CPU writes what the
  // functors write, element by element: every length 0..40 (each vector tail), a start
  // one float in (unaligned), the four stride patterns, in place, and every value class.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special{nan, inf, -inf, 0.0f, -0.0f, 1e-40f, -1e-40f, 3e38f, -3e38f, 1e-30f};
  std::mt19937 rng(12);
  auto value = [&] {  // a special value one time in three
    return rng() % 3 == 0 ? special[rng() % special.size()] : std::uniform_real_distribution<float>(-30, 30)(rng);
  };
  for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::ReluBackward}) {
    CHECK(cpu::has_binary_clone(op));
    for (i64 n = 0; n <= 40; ++n)
      for (i64 start : {i64{0}, i64{1}})
        for (auto [sa, sb] : {std::pair<i64, i64>{1, 1}, {1, 0}, {0, 1}, {2, 3}}) {
          CAPTURE(static_cast<int>(op));
          CAPTURE(n);
          CAPTURE(start);
          CAPTURE(sa);
          CAPTURE(sb);
          std::vector<float> a(static_cast<std::size_t>(start + 3 * n + 1)), b(a.size()), y(a.size(), 7.0f);
          for (float& v : a) v = value();
          for (float& v : b) v = value();
          std::vector<float> want = y;
          for (i64 i = 0; i < n; ++i) want[start + i] = apply_binary(op, a[start + i * sa], b[start + i * sb]);
          cpu::binary_clone_f32(op, a.data() + start, sa, b.data() + start, sb, y.data() + start, n);
          REQUIRE(bitwise_equal(want, y));
          if (sa == 1) {  // in place over a
            cpu::binary_clone_f32(op, a.data() + start, sa, b.data() + start, sb, a.data() + start, n);
            for (i64 i = 0; i < n; ++i) REQUIRE(bitwise_equal({a[start + i]}, {want[start + i]}));
          }
        }
  }
  CHECK_FALSE(cpu::has_binary_clone(BinaryOp::Pow));
  // bfloat16: the float functors on the widened values, rounded once; and the casts.
  auto bf16_of = [](const std::vector<float>& v) {
    std::vector<dp::BFloat16> h(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) h[i] = dp::BFloat16(v[i]);
    return h;
  };
  auto same_bits = [](const std::vector<dp::BFloat16>& a, const std::vector<dp::BFloat16>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 2) == 0);
  };
  for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::ReluBackward})
    for (i64 n = 0; n <= 40; ++n)
      for (auto [sa, sb] : {std::pair<i64, i64>{1, 1}, {1, 0}, {0, 1}, {2, 3}}) {
        CAPTURE(static_cast<int>(op));
        CAPTURE(n);
        std::vector<float> af(static_cast<std::size_t>(1 + 3 * n + 1)), bf(af.size());
        for (float& v : af) v = value();
        for (float& v : bf) v = value();
        const auto a = bf16_of(af), b = bf16_of(bf);
        std::vector<dp::BFloat16> y(a.size(), dp::BFloat16(7.0f)), want = y;
        for (i64 i = 0; i < n; ++i)
          want[1 + i] = dp::BFloat16(apply_binary(op, static_cast<float>(a[1 + i * sa]), static_cast<float>(b[1 + i * sb])));
        cpu::binary_clone_bf16(op, a.data() + 1, sa, b.data() + 1, sb, y.data() + 1, n);
        REQUIRE(same_bits(want, y));
      }
  for (i64 n = 0; n <= 40; ++n) {
    CAPTURE(n);
    std::vector<float> xf(static_cast<std::size_t>(n + 1));
    for (float& v : xf) v = value();
    const auto xh = bf16_of(xf);
    std::vector<dp::BFloat16> yh(xh.size(), dp::BFloat16(7.0f)), want_h = yh, cast_h = yh;
    std::vector<float> widened(xh.size(), 7.0f), want_w = widened;
    for (i64 i = 1; i <= n; ++i) {
      want_h[i] = dp::BFloat16(1.5f * static_cast<float>(xh[i]) + -0.25f);
      want_w[i] = static_cast<float>(xh[i]);
    }
    cpu::affine_bf16(xh.data() + 1, yh.data() + 1, n, 1.5f, -0.25f);
    REQUIRE(same_bits(want_h, yh));
    cpu::cast_f32_to_bf16(xf.data() + 1, cast_h.data() + 1, n);
    for (i64 i = 0; i <= n; ++i) REQUIRE(cast_h[i].bits == (i == 0 ? dp::BFloat16(7.0f) : xh[i]).bits);
    cpu::cast_bf16_to_f32(xh.data() + 1, widened.data() + 1, n);
    REQUIRE(bitwise_equal(want_w, widened));
  }
  for (i64 n = 0; n <= 40; ++n)
    for (i64 start : {i64{0}, i64{1}}) {
      CAPTURE(n);
      CAPTURE(start);
      std::vector<float> x(static_cast<std::size_t>(start + n)), y0(x.size());
      for (float& v : x) v = value();
      for (float& v : y0) v = value();
      std::vector<float> y = y0, want_affine = y0, want_axpy = y0;
      for (i64 i = start; i < start + n; ++i) {
        want_affine[i] = 1.5f * x[i] + -0.25f;
        want_axpy[i] = y0[i] + -0.75f * x[i];
      }
      cpu::affine_f32(x.data() + start, y.data() + start, n, 1.5f, -0.25f);
      REQUIRE(bitwise_equal(want_affine, y));
      y = y0;
      cpu::axpy_f32(-0.75f, x.data() + start, y.data() + start, n);
      REQUIRE(bitwise_equal(want_axpy, y));
    }
}

TEST_CASE("gelu clones: Gelu and GeluBackward's bits at every width and start, both forms, through the kernels") {
  // Note [Fused GELU]: the cloned loops against the functors, element by element, in
  // place too; then the float32 and 16-bit kernels on more than one task's elements.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special{nan, inf, -inf, 0.0f, -0.0f, 1e-40f, -1e-40f, 10.0f, -10.0f, 30.0f, -30.0f};
  std::mt19937 rng(13);
  auto value = [&] {
    return rng() % 3 == 0 ? special[rng() % special.size()] : std::uniform_real_distribution<float>(-8, 8)(rng);
  };
  for (bool tanh : {true, false}) {
    auto fwd = [tanh](float x) { return tanh ? Gelu<true>{}(x) : Gelu<false>{}(x); };
    auto bwd = [tanh](float x, float g) { return tanh ? GeluBackward<true>{}(x, g) : GeluBackward<false>{}(x, g); };
    for (i64 n = 0; n <= 40; ++n)
      for (i64 start : {i64{0}, i64{1}}) {
        CAPTURE(tanh);
        CAPTURE(n);
        CAPTURE(start);
        std::vector<float> x(static_cast<std::size_t>(start + n)), g(x.size()), y(x.size(), 7.0f);
        for (float& v : x) v = value();
        for (float& v : g) v = value();
        std::vector<float> want_y = y, want_g = g;
        for (i64 i = start; i < start + n; ++i) {
          want_y[i] = fwd(x[i]);
          want_g[i] = bwd(x[i], g[i]);
        }
        cpu::gelu_f32(tanh, x.data() + start, y.data() + start, n);
        REQUIRE(bitwise_equal(want_y, y));
        cpu::gelu_backward_f32(tanh, x.data() + start, g.data() + start, g.data() + start, n);  // in place
        REQUIRE(bitwise_equal(want_g, g));
      }
    const i64 n = 100003;  // above the parallel grain: several tasks
    const auto x = random_vec(n, 14, -6.0f, 6.0f), gy = random_vec(n, 15);
    std::vector<float> y(n), gx(n);
    be().run<Op::Gelu>(dev0(), DType::F32, {x.data(), y.data(), n, tanh});
    be().run<Op::GeluBackward>(dev0(), DType::F32, {x.data(), gy.data(), gx.data(), n, tanh});
    std::vector<dp::BFloat16> xb(n), gb(n), yb(n), gxb(n);
    for (i64 i = 0; i < n; ++i) {
      xb[i] = dp::BFloat16(x[i]);
      gb[i] = dp::BFloat16(gy[i]);
    }
    be().run<Op::Gelu>(dev0(), DType::BF16, {xb.data(), yb.data(), n, tanh});
    be().run<Op::GeluBackward>(dev0(), DType::BF16, {xb.data(), gb.data(), gxb.data(), n, tanh});
    for (i64 i = 0; i < n; ++i) {
      REQUIRE(bitwise_equal({y[i]}, {fwd(x[i])}));
      REQUIRE(bitwise_equal({gx[i]}, {bwd(x[i], gy[i])}));
      // bfloat16: the float math of the widened values, rounded once.
      const float xw = static_cast<float>(xb[i]), gw = static_cast<float>(gb[i]);
      REQUIRE(yb[i].bits == dp::BFloat16(fwd(xw)).bits);
      REQUIRE(gxb[i].bits == dp::BFloat16(bwd(xw, gw)).bits);
    }
  }
}

TEST_CASE("affine and axpy") {
  for (i64 n : kSizes) {
    auto x = random_vec(n, 6), y0 = random_vec(n, 7);
    std::vector<float> y(n);
    be().run<Op::Affine>(dev0(), DType::F32, {x.data(), y.data(), n, 2.0f, -1.0f});
    for (i64 i = 0; i < n; ++i) REQUIRE(y[i] == 2.0f * x[i] + -1.0f);
    y = y0;
    be().run<Op::Axpy>(dev0(), DType::F32, {0.5f, x.data(), y.data(), n});
    for (i64 i = 0; i < n; ++i) REQUIRE(y[i] == y0[i] + 0.5f * x[i]);
  }
}

namespace {

double ref_binary(BinaryOp op, double a, double b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Maximum: return std::max(a, b);
    case BinaryOp::Minimum: return std::min(a, b);
    case BinaryOp::Pow: return std::pow(a, b);
    case BinaryOp::Eq: return a == b ? 1.0 : 0.0;
    case BinaryOp::Gt: return a > b ? 1.0 : 0.0;
    case BinaryOp::ReluBackward: return b > 0 ? a : 0.0;
    case BinaryOp::kCount: break;
  }
  return 0;
}

/// Runs binary over `sizes` with the given strides and checks every element against a
/// naive multi-index walk.
void check_binary(BinaryOp op, std::vector<i64> sizes, std::vector<i64> sa, std::vector<i64> sb,
                  const std::vector<float>& a, const std::vector<float>& b) {
  Indexer ix;
  ix.ndim = static_cast<int>(sizes.size());
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) {
    ix.sizes[d] = sizes[d];
    ix.strides_a[d] = sa[d];
    ix.strides_b[d] = sb[d];
    n *= sizes[d];
  }
  std::vector<float> out(n);
  be().run<Op::Binary>(dev0(), DType::F32, {op, ix, a.data(), b.data(), out.data()});
  std::vector<double> want(n);
  for (i64 flat = 0; flat < n; ++flat) {
    i64 rem = flat, oa = 0, ob = 0;
    for (int d = ix.ndim - 1; d >= 0; --d) {
      const i64 c = rem % sizes[d];
      rem /= sizes[d];
      oa += c * sa[d];
      ob += c * sb[d];
    }
    want[flat] = ref_binary(op, a[oa], b[ob]);
  }
  check_close(out, want, 1e-6, 1e-7, "binary op " + std::to_string(int(op)));
}

}  // namespace

TEST_CASE("binary: contiguous, scalar, row and channel broadcast, strided") {
  const BinaryOp ops[] = {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div,
                          BinaryOp::Maximum, BinaryOp::Minimum, BinaryOp::Pow, BinaryOp::Eq,
                          BinaryOp::Gt, BinaryOp::ReluBackward};
  for (BinaryOp op : ops) {
    CAPTURE(int(op));
    // Positive a for pow; b with repeats so Eq sees equal values.
    auto a = random_vec(300000, 8, 0.1f, 2.0f);
    auto b = random_vec(300000, 9, -2.0f, 2.0f);
    for (i64 i = 0; i < 300000; i += 3) b[i] = a[i];
    for (i64 n : kSizes) check_binary(op, {n}, {1}, {1}, a, b);             // same shape
    check_binary(op, {100003}, {1}, {0}, a, b);                           // b scalar
    check_binary(op, {100003}, {0}, {1}, a, b);                           // a scalar
    check_binary(op, {}, {}, {}, a, b);                                   // 0-d
    check_binary(op, {997, 101}, {101, 1}, {0, 1}, a, b);                 // bias add
    check_binary(op, {16, 32, 196}, {32 * 196, 196, 1}, {0, 1, 0}, a, b); // per channel
    check_binary(op, {301, 211}, {1, 301}, {211, 1}, a, b);               // a transposed
    check_binary(op, {3, 1, 5, 7, 11}, {385, 385, 77, 11, 1}, {0, 0, 1, 5, 0}, a, b);
    check_binary(op, {4, 0, 3}, {0, 3, 1}, {3, 3, 1}, a, b);              // empty
    // 8 dims with broadcasting on both sides.
    check_binary(op, {2, 3, 2, 3, 2, 3, 2, 3}, {0, 72, 36, 12, 6, 2, 1, 0},
                 {108, 36, 0, 12, 0, 4, 0, 1}, a, b);
  }
}

TEST_CASE("scatter_add: each element's additions in element order, by rows and element by element, bit for bit") {
  // index_select's backward over (outer, m, inner) along dim 1, a row of `inner` per
  // index (the row path), and along the last dim (the element path); repeated indices.
  for (int dim : {1, 2}) {
    CAPTURE(dim);
    // 9 indices into 4 slices: source (5, 9, 37) into y (5, 4, 37), or (5, 4, 9) into (5, 4, 4).
    const i64 sizes[3] = {5, dim == 1 ? 9 : 4, dim == 1 ? 37 : 9};
    const i64 ysizes[3] = {5, 4, dim == 1 ? 37 : 4};
    Indexer ix;
    ix.ndim = 3;
    for (int d = 0; d < 3; ++d) ix.sizes[d] = sizes[d];
    ix.strides_a[0] = ysizes[1] * ysizes[2];
    ix.strides_a[1] = ysizes[2];
    ix.strides_a[2] = 1;
    ix.strides_b[dim] = 1;  // a 1-d index along dim
    const std::vector<i64> index{3, 0, 3, 1, 1, 2, 3, 0, 3};
    const i64 n = sizes[0] * sizes[1] * sizes[2];
    const auto src = random_vec(n, 21, -3.0f, 3.0f);
    const auto y0 = random_vec(ysizes[0] * ysizes[1] * ysizes[2], 22, -3.0f, 3.0f);
    std::vector<float> want = y0, got = y0;
    for (i64 i = 0; i < n; ++i) {  // element order
      const i64 c0 = i / (sizes[1] * sizes[2]), c1 = i / sizes[2] % sizes[1], c2 = i % sizes[2];
      const i64 c[3] = {c0, c1, c2};
      i64 off = 0;
      for (int d = 0; d < 3; ++d) off += (d == dim ? index[static_cast<std::size_t>(c[d])] : c[d]) * ix.strides_a[d];
      want[static_cast<std::size_t>(off)] += src[static_cast<std::size_t>(i)];
    }
    be().run<Op::ScatterAdd>(dev0(), DType::F32, {ix, dim, src.data(), index.data(), got.data()});
    CHECK(bitwise_equal(want, got));
  }
}

TEST_CASE("strided_copy gathers a transposed view") {
  const i64 R = 517, C = 263;
  auto a = random_vec(R * C, 10);
  Indexer ix;
  ix.ndim = 2;
  ix.sizes[0] = C;
  ix.sizes[1] = R;
  ix.strides_a[0] = 1;
  ix.strides_a[1] = C;
  std::vector<float> out(R * C);
  be().run<Op::StridedCopy>(dev0(), DType::F32, {ix, a.data(), out.data()});
  for (i64 c = 0; c < C; ++c)
    for (i64 r = 0; r < R; ++r) REQUIRE(out[c * R + r] == a[r * C + c]);
}

// ---- reductions -----------------------------------------------------------------------------

TEST_CASE("reduce sum/max/min over (outer, r, inner) against double references") {
  const i64 shapes[][3] = {{1, 0, 1},    {3, 0, 4},   {1, 1, 1},      {1, 100003, 1},
                           {5, 97, 1},   {3, 1000, 50}, {1, 256, 6400}, {1, 200000, 3},
                           {2, 70001, 1}, {4096, 10, 1}, {7, 13, 1031}};
  for (auto& sh : shapes) {
    const i64 outer = sh[0], r = sh[1], inner = sh[2];
    CAPTURE(outer);
    CAPTURE(r);
    CAPTURE(inner);
    auto x = random_vec(outer * r * inner, 11, -1.0f, 2.0f);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
      if (r == 0 && op != ReduceOp::Sum) {
        std::vector<float> y(outer * inner);
        CHECK_THROWS_AS((be().run<Op::Reduce>(dev0(), DType::F32, {op, x.data(), y.data(), outer, r, inner})),
                        dp::Error);
        continue;
      }
      std::vector<float> y(outer * inner, 123.0f), y2(outer * inner);
      be().run<Op::Reduce>(dev0(), DType::F32, {op, x.data(), y.data(), outer, r, inner});
      be().run<Op::Reduce>(dev0(), DType::F32, {op, x.data(), y2.data(), outer, r, inner});
      CHECK(bitwise_equal(y, y2));  // deterministic run to run
      std::vector<double> want(outer * inner);
      double abs_sum_max = 0;
      for (i64 o = 0; o < outer; ++o)
        for (i64 i = 0; i < inner; ++i) {
          double acc = op == ReduceOp::Sum ? 0.0 : x[o * r * inner + i], abs_sum = 0;
          for (i64 k = 0; k < r; ++k) {
            const double v = x[(o * r + k) * inner + i];
            abs_sum += std::abs(v);
            acc = op == ReduceOp::Sum ? acc + v : op == ReduceOp::Max ? std::max(acc, v) : std::min(acc, v);
          }
          want[o * inner + i] = acc;
          abs_sum_max = std::max(abs_sum_max, abs_sum);
        }
      // A float sum of r terms errs by ~log2(r) ulps of the absolute sum (pairwise lanes).
      check_close(y, want, 0, op == ReduceOp::Sum ? 1e-6 * abs_sum_max + 1e-6 : 0.0, "reduce");
    }
  }
}

TEST_CASE("reduce gives identical bits for 1 and for all threads") {
  auto x = random_vec(1 * 300007 * 1, 12);
  std::vector<float> all(1), one(1);
  be().run<Op::Reduce>(dev0(), DType::F32, {ReduceOp::Sum, x.data(), all.data(), 1, 300007, 1});
  be().set_concurrent_devices(64);  // one thread per device
  be().run<Op::Reduce>(dev0(), DType::F32, {ReduceOp::Sum, x.data(), one.data(), 1, 300007, 1});
  be().set_concurrent_devices(1);
  CHECK(bitwise_equal(all, one));
}

TEST_CASE("argmax: first maximum on ties") {
  const i64 outer = 3, r = 50, inner = 2001;
  auto x = random_vec(outer * r * inner, 13);
  for (auto& v : x) v = std::round(v * 3.0f);  // many ties
  std::vector<i64> y(outer * inner);
  be().run<Op::Argmax>(dev0(), DType::F32, {x.data(), y.data(), outer, r, inner});
  for (i64 o = 0; o < outer; ++o)
    for (i64 i = 0; i < inner; ++i) {
      i64 best = 0;
      for (i64 k = 1; k < r; ++k)
        if (x[(o * r + k) * inner + i] > x[(o * r + best) * inner + i]) best = k;
      REQUIRE(y[o * inner + i] == best);
    }
  const float row[] = {1, 5, 2, 5, 5};
  i64 idx = -1;
  be().run<Op::Argmax>(dev0(), DType::F32, {row, &idx, 1, 5, 1});
  CHECK(idx == 1);
  be().run<Op::Argmax>(dev0(), DType::F32, {row, &idx, 0, 5, 1});  // outer 0: nothing written
  CHECK(idx == 1);
}

TEST_CASE("count_nonfinite") {
  for (i64 n : kSizes) {
    auto x = random_vec(n, 14);
    i64 want = 0;
    for (i64 i = 0; i < n; i += 1009) {
      x[i] = (i % 2) ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
      ++want;
    }
    if (n > 1) {
      x[n - 1] = -std::numeric_limits<float>::infinity();
      want += ((n - 1) % 1009) != 0;
    }
    CHECK(be().count_nonfinite(dev0(), x.data(), n) == want);
  }
}

TEST_CASE("scale_find_nonfinite: mul_'s bits in one pass, and a flag only non-finite input sets") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float big = std::numeric_limits<float>::max(), tiny = std::numeric_limits<float>::denorm_min();
  auto scale = [](std::vector<float>& x, float f, float& found) {
    be().run<Op::ScaleFindNonfinite>(dev0(), DType::F32, {x.data(), static_cast<i64>(x.size()), f, &found});
  };
  auto mul_bits = [](const std::vector<float>& x, float f) {  // Tensor::mul_ is Affine with beta 0
    std::vector<float> y(x.size());
    be().run<Op::Affine>(dev0(), DType::F32, {x.data(), y.data(), static_cast<i64>(x.size()), f, 0.0f});
    return y;
  };
  for (i64 n : kSizes)
    for (float f : {1.0f / 65536.0f, 0.3f, 3.0f}) {
      CAPTURE(n);
      CAPTURE(f);
      // Finite input, extremes included: -0, a subnormal, +-FLT_MAX (which 3.0 turns
      // into infinities: only what x held before the multiply counts).
      auto x = random_vec(n, 41, -1e4f, 1e4f);
      const float extremes[] = {-0.0f, tiny, big, -big};
      for (std::size_t k = 0; k < std::size(extremes) && k < x.size(); ++k)
        x[static_cast<std::size_t>((static_cast<i64>(k) * 7919 + n - 1) % n)] = extremes[k];
      std::vector<float> want = mul_bits(x, f);
      float found = 0.0f;
      scale(x, f, found);
      CHECK(bitwise_equal(x, want));
      CHECK(found == 0.0f);
      if (n == 0) continue;
      // One NaN or infinity anywhere — first, middle, last — sets the flag; every element
      // is still multiplied.
      for (i64 at : {i64{0}, n / 2, n - 1})
        for (float bad : {nan, inf, -inf}) {
          CAPTURE(at);
          CAPTURE(bad);
          auto y = random_vec(n, 42);
          y[static_cast<std::size_t>(at)] = bad;
          want = mul_bits(y, f);
          found = 0.0f;
          scale(y, f, found);
          REQUIRE(bitwise_equal(y, want));
          REQUIRE(found == 1.0f);
          // Shared by the next tensor: a finite one leaves it set.
          auto z = random_vec(n, 43);
          scale(z, f, found);
          REQUIRE(found == 1.0f);
        }
    }
}

// ---- GEMM ---------------------------------------------------------------------------------------

TEST_CASE("gemm: all transposition combinations with padded leading dimensions") {
  const i64 m = 37, n = 53, k = 71;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      const i64 lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 7;
      auto a = random_vec((ta ? k : m) * lda, 15), b = random_vec((tb ? n : k) * ldb, 16);
      auto c = random_vec(m * ldc, 17);
      std::vector<double> want(c.begin(), c.end());
      const float alpha = 1.5f, beta = -0.5f;
      for (i64 i = 0; i < m; ++i)
        for (i64 j = 0; j < n; ++j) {
          double s = 0;
          for (i64 p = 0; p < k; ++p)
            s += double(ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
          want[i * ldc + j] = alpha * s + beta * c[i * ldc + j];
        }
      be().gemm(dev0(), ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
      check_close(c, want, 1e-5, 1e-5, "gemm");
    }
}

TEST_CASE("gemm edge sizes: k = 0 scales C, m = 0 is a no-op, bad ld throws") {
  std::vector<float> c = {1, 2, std::numeric_limits<float>::quiet_NaN(), 4};
  be().gemm(dev0(), false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, c.data(), 2);
  CHECK(c == std::vector<float>{0, 0, 0, 0});
  c = {1, 2, 3, 4};
  be().gemm(dev0(), false, false, 2, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 2.0f, c.data(), 2);
  CHECK(c == std::vector<float>{2, 4, 6, 8});
  be().gemm(dev0(), false, false, 0, 2, 3, 1.0f, nullptr, 3, nullptr, 2, 0.0f, c.data(), 2);
  CHECK(c == std::vector<float>{2, 4, 6, 8});
  CHECK_THROWS_AS(be().gemm(dev0(), false, false, 2, 2, 3, 1.0f, c.data(), 2, c.data(), 2, 0.0f,
                            c.data(), 2),
                  dp::Error);
}

TEST_CASE("a 16-bit gemm's epilogue is a bias alone, over a contiguous C it writes: anything else refused by name") {
  // Note [16-bit Linear: the bias in the one rounding]: the bias joins the product's one
  // rounding; a ReLU (which commutes with it) stays a separate op.
  for (const DType dt : {DType::BF16, DType::F16}) {
    CAPTURE(dp::backend::dtype_name(dt));
    const std::uint16_t one = dt == DType::BF16 ? dp::BFloat16(1.0f).bits : dp::Float16(1.0f).bits;
    const std::uint16_t half = dt == DType::BF16 ? dp::BFloat16(-0.5f).bits : dp::Float16(-0.5f).bits;
    std::vector<std::uint16_t> a(8, one), b(8, one), bias{half, one}, c(8, 0);
    auto args = [&] {
      return GemmArgs{false, false, 2, 2, 2, 1.0f, a.data(), 2, b.data(), 2, 0.0f, c.data(), 2, {bias.data()}};
    };
    be().run<Op::Gemm>(dev0(), dt, args());  // 2 + bias
    auto value = [dt](std::uint16_t bits) {
      return dt == DType::BF16 ? static_cast<float>(dp::BFloat16::from_bits(bits))
                               : static_cast<float>(dp::Float16::from_bits(bits));
    };
    const float got[] = {value(c[0]), value(c[1]), value(c[3])};
    CHECK(got[0] == 1.5f);
    CHECK(got[1] == 3.0f);
    CHECK(got[2] == 3.0f);
    GemmArgs k0 = args();  // k = 0: the bias alone
    k0.k = 0;
    be().run<Op::Gemm>(dev0(), dt, k0);
    CHECK(c[0] == half);
    CHECK(c[1] == one);
    GemmArgs bad = args();
    bad.epilogue.relu = true;
    CHECK(dp_test::throws_with([&] { be().run<Op::Gemm>(dev0(), dt, bad); },
                      {"gemm: a ", dp::backend::dtype_name(dt), " product's epilogue is a bias only", "a ReLU"}));
    bad = args();
    bad.epilogue.relu_y = c.data();
    CHECK(dp_test::throws_with([&] { be().run<Op::Gemm>(dev0(), dt, bad); },
                               {"epilogue is a bias only", "a ReLU mask"}));
    bad = args();
    bad.ldc = 3;
    CHECK(dp_test::throws_with([&] { be().run<Op::Gemm>(dev0(), dt, bad); },
                      {"an epilogue needs a contiguous C (ldc == n), got ldc=3 for n=2"}));
    bad = args();
    bad.beta = 0.5f;
    CHECK(dp_test::throws_with([&] { be().run<Op::Gemm>(dev0(), dt, bad); },
                               {"with a bias writes C (beta 0), got beta=0.5"}));
  }
}

TEST_CASE("batched gemm: each product's bits as its own call, shared B, gaps untouched; bad batches throw") {
  // GemmArgs::batch: C_i = op(A_i) op(B_i) + 0.5 C_i, matrices `gap` elements apart. The
  // matrices run in parallel (Note [Batched GEMMs on the CPU]): small ones of one chunk
  // each, and 256 x 96 x 128 ones that a call of their own cuts into several.
  struct Dims {
    i64 batch, m, n, k;
  };
  const i64 gap = 5;
  for (const Dims d : {Dims{4, 9, 16, 21}, Dims{3, 256, 96, 128}})
    for (const DType dt : {DType::F32, DType::BF16, DType::F16})
      for (bool ta : {false, true})
        for (bool shared_b : {false, true}) {
          const i64 batch = d.batch, m = d.m, n = d.n, k = d.k;
          CAPTURE(m); CAPTURE(dp::backend::dtype_name(dt)); CAPTURE(ta); CAPTURE(shared_b);
          const std::size_t es = dt == DType::F32 ? 4 : 2;
          const i64 lda = ta ? m : k, sa = m * k + gap, sb = shared_b ? 0 : k * n + gap, sc = m * n + gap;
          // Bytes of random floats, or of their 16-bit roundings.
          const auto bytes = [&](i64 count, unsigned seed) {
            const std::vector<float> f = random_vec(count, seed, -1.0f, 1.0f);
            std::vector<unsigned char> out(static_cast<std::size_t>(count) * es);
            for (i64 i = 0; i < count; ++i) {
              const float v = f[static_cast<std::size_t>(i)];
              if (dt == DType::F32) {
                std::memcpy(out.data() + i * 4, &v, 4);
              } else {
                const std::uint16_t bits = dt == DType::BF16 ? dp::BFloat16(v).bits : dp::Float16(v).bits;
                std::memcpy(out.data() + i * 2, &bits, 2);
              }
            }
            return out;
          };
          const auto a = bytes(batch * sa, 7), b = bytes(shared_b ? k * n : batch * sb, 8);
          auto c = bytes(batch * sc, 9);
          auto want = c;
          GemmArgs args{ta, false, m, n, k, 1.0f, a.data(), lda, b.data(), n, 0.5f, c.data(), n, {}};
          args.batch = batch;
          args.stride_a = sa;
          args.stride_b = sb;
          args.stride_c = sc;
          be().run<Op::Gemm>(dev0(), dt, args);
          for (i64 i = 0; i < batch; ++i)
            be().run<Op::Gemm>(dev0(), dt, {ta, false, m, n, k, 1.0f, a.data() + i * sa * es, lda,
                                            b.data() + i * sb * es, n, 0.5f, want.data() + i * sc * es, n, {}});
          CHECK(c == want);  // the gaps included: written by neither
          const auto rest = bytes(batch * sc, 9);
          for (i64 i = 0; i < batch; ++i)
            CHECK(std::memcmp(c.data() + (i * sc + m * n) * es, rest.data() + (i * sc + m * n) * es, gap * es) == 0);
        }
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  GemmArgs bad{false, false, 2, 2, 2, 1.0f, a.data(), 2, b.data(), 2, 0.0f, c.data(), 2, {}};
  bad.batch = -1;
  CHECK_THROWS_AS(be().run<Op::Gemm>(dev0(), DType::F32, bad), dp::Error);
  bad.batch = 3;
  bad.stride_c = 3;  // C_1 would overlap C_0 (4 elements)
  CHECK_THROWS_AS(be().run<Op::Gemm>(dev0(), DType::F32, bad), dp::Error);
  bad.stride_c = 4;
  bad.stride_a = -4;
  CHECK_THROWS_AS(be().run<Op::Gemm>(dev0(), DType::BF16, bad), dp::Error);
  bad.stride_a = 4;
  bad.epilogue.relu = true;
  CHECK_THROWS_AS(be().run<Op::Gemm>(dev0(), DType::F32, bad), dp::Error);
  bad.epilogue.relu = false;
  bad.batch = 0;  // nothing to do
  be().run<Op::Gemm>(dev0(), DType::F32, bad);
  CHECK(c == std::vector<float>(64, 0.0f));
}

TEST_CASE("gemm large (1x1-thread vs parallel paths) against reference rows") {
  const i64 m = 256, n = 300, k = 513;
  auto a = random_vec(m * k, 18), b = random_vec(k * n, 19);
  std::vector<float> c(m * n);
  be().gemm(dev0(), false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  for (i64 i = 0; i < m; i += 17)
    for (i64 j = 0; j < n; ++j) {
      double s = 0;
      for (i64 p = 0; p < k; ++p) s += double(a[i * k + p]) * b[p * n + j];
      REQUIRE(std::abs(c[i * n + j] - s) <= 1e-4 * (1 + std::abs(s)));
    }
}

TEST_CASE("gemm split into per-thread slabs: every transpose, row and column splits, alpha, beta, ld") {
  // Note [oneDNN in the device's arena]: large GEMMs run as slabs of C's rows (m >= n) or
  // columns; both against a double reference, and equal to the one-thread call to float
  // rounding. Odd sizes leave a slab edge off the 16-wide alignment.
  const int hw = dp::hardware_concurrency();
  for (auto [m, n] : {std::pair<i64, i64>{301, 67}, {67, 301}, {1, 4099}, {4099, 1}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const i64 k = 2100;
        const i64 lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(ta);
        CAPTURE(tb);
        auto a = random_vec((ta ? k : m) * lda, 60), b = random_vec((tb ? n : k) * ldb, 61);
        auto c0 = random_vec(m * ldc, 62);
        std::vector<float> c = c0, c1 = c0;
        be().set_concurrent_devices(1);  // all cores: the split path where the work allows
        be().gemm(dev0(), ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, c.data(), ldc);
        be().set_concurrent_devices(hw);  // one thread: one call
        be().gemm(dev0(), ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, c1.data(), ldc);
        be().set_concurrent_devices(1);
        for (i64 i = 0; i < m; ++i)
          for (i64 j = 0; j < ldc; ++j) {
            const float got = c[i * ldc + j];
            if (j >= n) {  // padding columns of C are never written
              REQUIRE(got == c0[i * ldc + j]);
              continue;
            }
            double acc = 0;
            for (i64 p = 0; p < k; ++p)
              acc += double(ta ? a[p * lda + i] : a[i * lda + p]) * double(tb ? b[j * ldb + p] : b[p * ldb + j]);
            const double want = 0.5 * acc + 2.0 * c0[i * ldc + j];
            REQUIRE(std::abs(got - want) <= 1e-4 * (1 + std::abs(want)));
            REQUIRE(std::abs(got - c1[i * ldc + j]) <= 1e-5 * (1 + std::abs(want)));
          }
      }
  }
}

TEST_CASE("gemm with a small k: products summed by fma in k order, at any split") {
  // Note [GEMMs with a small k]: for k <= kSmallK, B not transposed, alpha 1, beta 0,
  // each element of C is fma(a[i,k-1], b[k-1,j], ... fma(a[i,0], b[0,j], +0)) — the
  // same at one thread and at all cores, with padded leading dimensions, every width
  // (vector blocks and tails) and a transposed A; where the CPU has no FMA oneDNN runs
  // it and only the tolerance check applies. The ReLU mask on the same pass:
  // linear_backward_input's test (its 512x1024x10 and 4099x1x5).
  const int hw = dp::hardware_concurrency();
  const bool fma_loop = __builtin_cpu_supports("fma");
  for (i64 k : {i64{1}, i64{2}, i64{5}, i64{10}, cpu::kSmallK})
    for (auto [m, n] : {std::pair<i64, i64>{512, 1024}, {7, 1}, {33, 15}, {65, 16}, {3, 17}, {130, 63}, {1, 64},
                        {9, 65}, {300, 1000}})
      for (bool ta : {false, true})
        for (int devices : {1, hw}) {
          CAPTURE(k);
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(ta);
          CAPTURE(devices);
          const i64 lda = (ta ? m : k) + 3, ldb = n + 5, ldc = n + 2;
          auto a = random_vec((ta ? k : m) * lda, 60), b = random_vec(k * ldb, 61);
          std::vector<float> c(static_cast<std::size_t>(m * ldc), 9.0f);
          be().set_concurrent_devices(devices);
          be().gemm(dev0(), ta, false, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc);
          be().set_concurrent_devices(1);
          i64 padding_touched = 0, far = 0, other_bits = 0;
          for (i64 i = 0; i < m; ++i)
            for (i64 j = 0; j < ldc; ++j) {
              const float got = c[static_cast<std::size_t>(i * ldc + j)];
              if (j >= n) {  // the padding between rows is left alone
                padding_touched += got != 9.0f;
                continue;
              }
              float want = 0.0f;
              double exact = 0.0;
              for (i64 p = 0; p < k; ++p) {
                const float av = ta ? a[static_cast<std::size_t>(p * lda + i)] : a[static_cast<std::size_t>(i * lda + p)];
                want = std::fma(av, b[static_cast<std::size_t>(p * ldb + j)], want);
                exact += double(av) * double(b[static_cast<std::size_t>(p * ldb + j)]);
              }
              far += !(std::abs(got - exact) <= 1e-5 * (1 + std::abs(exact)));
              other_bits += fma_loop && std::memcmp(&got, &want, sizeof got) != 0;
            }
          CHECK(padding_touched == 0);
          CHECK(far == 0);
          CHECK(other_bits == 0);
        }
}

TEST_CASE("gemm cut into column slabs that fit L2: within rounding of one call, its bits where oneDNN runs both alike") {
  // Note [GEMM: column slabs that fit L2]: a wide C (m < n) runs as several slabs per
  // thread, each element still one oneDNN dot product over all of k — for every
  // transpose, aliasing strides (copied slabs) and padded ones, odd widths included.
  // Where oneDNN runs the whole C and every slab with the same kernels
  // (cpu::gemm_slabs_keep_bits; here B always reaches it untransposed at an unaliased
  // stride, m >= 128) those are the single call's bits: with AVX-512 for all but
  // 768x1536x1024, with AVX2 for m <= 263 only. Everywhere they are within 16 u·Σ|a·b|
  // (u = 2^-24) of the single call's: oneDNN's two drivers' orders were measured at
  // most 2.5 u·Σ|a·b| apart on these shapes and 5.2 over a survey down to k = 156
  // (docs/benchmarks/kernel-notes.md) — two arbitrary orders may differ by up to
  // 2γ_k·Σ|a·b|, about 2k u, far looser — while one term of k left out puts over 99 %
  // of the checked elements outside it.
  const int hw = dp::hardware_concurrency();
  constexpr double u = 0x1p-24;
  for (auto [m, n, k] : {std::tuple<i64, i64, i64>{512, 1024, 1024}, {512, 1024, 784}, {256, 2000, 700},
                         {200, 1030, 2048}, {768, 1536, 1024}}) {
    const bool same_bits = cpu::gemm_slabs_keep_bits(m, n);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (i64 pad : {0, 3}) {
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(ta);
          CAPTURE(tb);
          CAPTURE(pad);
          CAPTURE(same_bits);
          const i64 a_rows = ta ? k : m, a_w = ta ? m : k, b_rows = tb ? n : k, b_w = tb ? k : n;
          const i64 lda = a_w + pad, ldb = b_w + pad;
          auto a = random_vec(a_rows * lda, 80), b = random_vec(b_rows * ldb, 81);
          std::vector<float> c(m * n, 7.0f), c1(m * n, -7.0f);
          be().set_concurrent_devices(1);  // all cores: several column slabs per thread
          be().gemm(dev0(), ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), n);
          be().set_concurrent_devices(hw);  // one thread: one call
          be().gemm(dev0(), ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c1.data(), n);
          be().set_concurrent_devices(1);
          if (same_bits) REQUIRE(std::memcmp(c.data(), c1.data(), c.size() * sizeof(float)) == 0);
          std::vector<i64> rows;  // every 17th row, and the last
          for (i64 i = 0; i < m; i += 17) rows.push_back(i);
          if (rows.back() != m - 1) rows.push_back(m - 1);
          std::vector<double> abs_b(static_cast<std::size_t>(k * n));  // |op(B)|, k rows of n
          for (i64 p = 0; p < k; ++p)
            for (i64 j = 0; j < n; ++j) abs_b[p * n + j] = std::abs(double(tb ? b[j * ldb + p] : b[p * ldb + j]));
          i64 far = 0;
          std::vector<double> sum_abs(static_cast<std::size_t>(n));  // Σ_p |a[i,p]·b[p,j]| of row i
          for (i64 i : rows) {
            std::fill(sum_abs.begin(), sum_abs.end(), 0.0);
            for (i64 p = 0; p < k; ++p) {
              const double ap = std::abs(double(ta ? a[p * lda + i] : a[i * lda + p]));
              for (i64 j = 0; j < n; ++j) sum_abs[j] += ap * abs_b[p * n + j];
            }
            for (i64 j = 0; j < n; ++j)
              far += !(std::abs(double(c[i * n + j]) - double(c1[i * n + j])) <= 16 * u * sum_abs[j]);
          }
          CHECK(far == 0);
        }
  }
}

TEST_CASE("gemm with operand rows 2 KiB apart: the copied slabs give the same bits as unaliased operands") {
  // Note [GEMM: operand rows 4 KiB apart]: lda, ldb = 512·j copy the slab of B (split by
  // columns) or of a transposed A (split by rows) before the call; the same values with
  // lda, ldb + 16 (never copied) must give every element bit for bit, for every transpose,
  // at one thread and at all cores, by rows and by columns.
  const int hw = dp::hardware_concurrency();
  for (auto [m, n, k] : {std::tuple<i64, i64, i64>{512, 1024, 1024}, {1024, 512, 300}, {512, 1024, 10},
                         {1024, 300, 257}, {130, 512, 64}, {300, 1024, 130}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (int devices : {1, hw}) {
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(ta);
          CAPTURE(tb);
          CAPTURE(devices);
          const i64 a_rows = ta ? k : m, a_w = ta ? m : k, b_rows = tb ? n : k, b_w = tb ? k : n;
          const i64 lda = (a_w + 511) / 512 * 512, ldb = (b_w + 511) / 512 * 512;
          auto a = random_vec(a_rows * lda, 70), b = random_vec(b_rows * ldb, 71);
          // The same values at strides that never alias.
          auto restride = [](const std::vector<float>& v, i64 rows, i64 w, i64 ld, i64 ld2) {
            std::vector<float> out(static_cast<std::size_t>(rows * ld2));
            for (i64 r = 0; r < rows; ++r) std::copy_n(v.begin() + r * ld, w, out.begin() + r * ld2);
            return out;
          };
          const auto a2 = restride(a, a_rows, a_w, lda, lda + 16), b2 = restride(b, b_rows, b_w, ldb, ldb + 16);
          std::vector<float> c(m * n), c2(m * n);
          be().set_concurrent_devices(devices);
          be().gemm(dev0(), ta, tb, m, n, k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), n);
          be().gemm(dev0(), ta, tb, m, n, k, 1.0f, a2.data(), lda + 16, b2.data(), ldb + 16, 0.0f, c2.data(), n);
          be().set_concurrent_devices(1);
          REQUIRE(std::memcmp(c.data(), c2.data(), c.size() * sizeof(float)) == 0);
          for (i64 i : {i64{0}, m - 1})  // and it is the product
            for (i64 j = 0; j < n; j += 37) {
              double s = 0;
              for (i64 p = 0; p < k; ++p)
                s += double(ta ? a[p * lda + i] : a[i * lda + p]) * double(tb ? b[j * ldb + p] : b[p * ldb + j]);
              REQUIRE(std::abs(c[i * n + j] - s) <= 1e-4 * (1 + std::abs(s)));
            }
        }
  }
}

/// transpose_copy of a rows x cols block of src (rows lds apart, filled by fill(i)) into
/// dst (rows ldd apart, pre-set to `pad`): every element moved bit for bit, and the
/// padding rows of dst left alone, for each size given.
template <typename T, typename Fill>
void check_transpose(std::initializer_list<i64> rows_list, std::initializer_list<i64> cols_list, Fill fill, T pad) {
  for (i64 rows : rows_list)
    for (i64 cols : cols_list) {
      CAPTURE(rows);
      CAPTURE(cols);
      const i64 lds = cols + 3, ldd = rows + 5;
      std::vector<T> src(static_cast<std::size_t>(rows * lds));
      for (std::size_t i = 0; i < src.size(); ++i) src[i] = fill(i);
      std::vector<T> dst(static_cast<std::size_t>(cols * ldd), pad);
      cpu::transpose_copy(src.data(), lds, rows, cols, dst.data(), ldd);
      i64 wrong = 0, padding_touched = 0;
      for (i64 c = 0; c < cols; ++c)
        for (i64 r = 0; r < ldd; ++r) {
          const T got = dst[static_cast<std::size_t>(c * ldd + r)];
          if (r >= rows) padding_touched += std::memcmp(&got, &pad, sizeof got) != 0;
          else wrong += std::memcmp(&got, &src[static_cast<std::size_t>(r * lds + c)], sizeof got) != 0;
        }
      CHECK(wrong == 0);
      CHECK(padding_touched == 0);
    }
}

TEST_CASE("transpose_copy: every element moved, the padding left alone, at every block and tail") {
  // cpu_transpose.cpp: 8x8 blocks transposed in registers, then the columns and rows
  // that do not fill a block one by one.
  check_transpose<float>({1, 7, 8, 9, 16, 33, 130}, {1, 5, 8, 13, 64, 785}, [](std::size_t i) {
    return static_cast<float>(static_cast<double>(i * 2654435761u % 100003) / 100003.0 - 0.5);
  }, 42.0f);
}

TEST_CASE("transpose_copy of 16-bit elements: every element moved, the padding left alone, at every block and tail") {
  // cpu_transpose.cpp: 16x16 blocks transposed in registers, then the columns and rows
  // that do not fill a block one by one.
  check_transpose<std::uint16_t>({1, 15, 16, 17, 32, 196, 785}, {1, 9, 16, 31, 64, 196},
                                 [](std::size_t i) { return static_cast<std::uint16_t>(i * 40503u >> 3); },
                                 std::uint16_t{0x2a2a});
}

TEST_CASE("gemm with a transposed B: the bits of the untransposed product, at one thread and at all cores") {
  // Note [GEMM: a transposed B multiplied untransposed]: with m >= 256 and n, k >= 32,
  // C = A Bᵀ is computed as A times an untransposed copy of Bᵀ, so it must be, bit for
  // bit, what gemm gives for the same values stored untransposed — by rows (m >= n: one
  // copy shared by the chunks) and by columns (a copy per slab), with padded, aliasing
  // and odd strides, tails that fill no 8x8 block. Where oneDNN's N,T kernels sum in
  // another order than its N,N ones (556x585x1280 and 806x127x1024 on an AVX-512 EPYC)
  // the old path gave other bits; and it is the product.
  const int hw = dp::hardware_concurrency();
  for (auto [m, n, k] : {std::tuple<i64, i64, i64>{556, 585, 1280}, {806, 127, 1024}, {512, 1024, 784},
                         {300, 37, 45}, {256, 33, 1000}, {1030, 1024, 131}}) {
    for (i64 ldb : {k, k + 3, (k + 511) / 512 * 512})
      for (int devices : {1, hw}) {
        CAPTURE(m);
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(ldb);
        CAPTURE(devices);
        const auto a = random_vec(m * k, 91), b = random_vec(n * ldb, 92);
        std::vector<float> bt(static_cast<std::size_t>(k * n));  // the same values, k rows of n
        for (i64 j = 0; j < n; ++j)
          for (i64 p = 0; p < k; ++p) bt[static_cast<std::size_t>(p * n + j)] = b[static_cast<std::size_t>(j * ldb + p)];
        std::vector<float> c(static_cast<std::size_t>(m * n), 5.0f), c_nn(static_cast<std::size_t>(m * n), -5.0f);
        be().set_concurrent_devices(devices);
        be().gemm(dev0(), false, true, m, n, k, 1.0f, a.data(), k, b.data(), ldb, 0.0f, c.data(), n);
        be().gemm(dev0(), false, false, m, n, k, 1.0f, a.data(), k, bt.data(), n, 0.0f, c_nn.data(), n);
        be().set_concurrent_devices(1);
        REQUIRE(std::memcmp(c.data(), c_nn.data(), c.size() * sizeof(float)) == 0);
        for (i64 i : {i64{0}, m - 1})
          for (i64 j = 0; j < n; j += 13) {
            double s = 0;
            for (i64 p = 0; p < k; ++p)
              s += double(a[static_cast<std::size_t>(i * k + p)]) * double(b[static_cast<std::size_t>(j * ldb + p)]);
            REQUIRE(std::abs(c[static_cast<std::size_t>(i * n + j)] - s) <= 1e-4 * (1 + std::abs(s)));
          }
      }
  }
}

TEST_CASE("gemm copies of an operand stay under 32 MiB: a larger B is read where it lies") {
  // kMaxOperandCopyFloats (Note [GEMM: a transposed B multiplied untransposed]): the
  // copies a GEMM makes come from the device's allocator, which counts them; a B of 4
  // MiB split by rows is copied (one untransposed copy, all of it), one of 32.5 MiB
  // (8.5 M floats) is not, nor is one of 8.6 M floats that one thread would copy whole
  // — while the same product on all cores copies slabs of it, each far under the bound. Each result is checked
  // against the product where it is cheap to.
  const int hw = dp::hardware_concurrency();
  auto peak_of = [&](int devices, i64 m, i64 n, i64 k) {
    const auto a = random_vec(m * k, 93), b = random_vec(n * k, 94);
    std::vector<float> c(static_cast<std::size_t>(m * n));
    be().set_concurrent_devices(devices);
    const std::size_t before = dp::memory_allocated(dev0());
    dp::reset_peak_memory(dev0());
    be().gemm(dev0(), false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(), n);
    const std::size_t peak = dp::max_memory_allocated(dev0()) - before;
    be().set_concurrent_devices(1);
    for (i64 i : {i64{0}, m - 1})
      for (i64 j : {i64{0}, n / 2, n - 1}) {
        double s = 0;
        for (i64 p = 0; p < k; ++p) s += double(a[static_cast<std::size_t>(i * k + p)]) * double(b[static_cast<std::size_t>(j * k + p)]);
        CHECK(std::abs(c[static_cast<std::size_t>(i * n + j)] - s) <= 1e-4 * (1 + std::abs(s)));
      }
    return peak;
  };
  CHECK(peak_of(1, 2048, 1024, 1024) >= std::size_t{1024} * 1024 * sizeof(float));  // copied
  CHECK(peak_of(1, 2304, 2048, 4160) == 0);   // by rows, B = 8.5 M floats: not copied
  CHECK(peak_of(hw, 512, 4096, 2100) == 0);   // one thread, one slab of 8.6 M floats: not copied
  if (hw > 1) {
    const std::size_t slabs = peak_of(1, 512, 4096, 2100);  // all cores: slabs of it are
    CHECK(slabs > 0);
    CHECK(slabs <= std::size_t(hw) * 2100 * 512 * sizeof(float));
  }
}

TEST_CASE("linear_forward: gemm, the bias add and the ReLU, bit for bit, NaN and infinity included") {
  // Note [Linear epilogue]: each chunk of the GEMM adds the bias and clips its slab in
  // place; y must be what gemm, then Binary<Add> with the bias broadcast over rows, then
  // Unary<Relu> give — the backend's own kernels (Backend's default linear_forward) and
  // the functors — for row and column splits, at one thread and at all cores.
  const int hw = dp::hardware_concurrency();
  const Binary<BinaryOp::Add> add;
  const Unary<UnaryOp::Relu> relu;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (auto [m, n, k] : {std::tuple<i64, i64, i64>{512, 1024, 784}, {512, 10, 1024}, {67, 301, 130},
                         {301, 67, 2100}, {1, 4099, 33}, {4099, 1, 5}, {3, 5, 0}}) {
    for (int poison = 0; poison < 4; ++poison)  // none, NaN in x, +inf in w, NaN in the bias
      for (bool with_bias : {true, false})
        for (bool with_relu : {true, false})
          for (int devices : {1, hw}) {
            CAPTURE(m);
            CAPTURE(n);
            CAPTURE(k);
            CAPTURE(poison);
            CAPTURE(with_bias);
            CAPTURE(with_relu);
            CAPTURE(devices);
            auto x = random_vec(m * k, 80), w = random_vec(n * k, 81), b = random_vec(n, 82);
            if (poison == 1 && k > 0) x[static_cast<std::size_t>((m / 2) * k)] = nan;
            if (poison == 2 && k > 0) w[static_cast<std::size_t>((n - 1) * k)] = inf;
            if (poison == 3) b[static_cast<std::size_t>(n / 2)] = nan;
            const float* bp = with_bias ? b.data() : nullptr;
            std::vector<float> want(m * n, 7.0f), by_kernels(m * n, 7.0f), got(m * n, 7.0f);
            be().set_concurrent_devices(devices);
            be().gemm(dev0(), false, true, m, n, k, 1.0f, x.data(), std::max<i64>(1, k), w.data(),
                      std::max<i64>(1, k), 0.0f, want.data(), n);
            for (i64 i = 0; i < m; ++i)
              for (i64 j = 0; j < n; ++j) {
                float& v = want[static_cast<std::size_t>(i * n + j)];
                if (with_bias) v = add(v, b[static_cast<std::size_t>(j)]);
                if (with_relu) v = relu(v);
              }
            be().gemm_epilogue_by_ops(dev0(), {false,
                                               true,
                                               m,
                                               n,
                                               k,
                                               1.0f,
                                               x.data(),
                                               std::max<i64>(1, k),
                                               w.data(),
                                               std::max<i64>(1, k),
                                               0.0f,
                                               by_kernels.data(),
                                               std::max<i64>(1, n),
                                               {bp, with_relu, nullptr}});
            be().linear_forward(dev0(), m, n, k, x.data(), w.data(), bp, got.data(), with_relu);
            be().set_concurrent_devices(1);
            REQUIRE(bitwise_equal(want, by_kernels));
            REQUIRE(bitwise_equal(want, got));
            if ((poison == 1 && k > 0) || (poison == 3 && with_bias))  // a NaN survives the ReLU
              CHECK(std::any_of(got.begin(), got.end(), [](float v) { return std::isnan(v); }));
          }
  }
}

TEST_CASE("linear_epilogue: every variant, width and start against the functors, element by element") {
  // Note [Epilogue clones]: the loop the loader picked for this CPU (AVX-512, AVX2 or
  // the baseline) must give what the separate ops give: every row width 0..40 (each
  // vector tail), a slab starting one float past C's row (unaligned), rows wider
  // apart than the slab (ldc > cols, the columns between left alone), and values
  // that tell the ops apart: NaN, ±infinity, ±0, the bias's -0 on a -0.
  const Binary<BinaryOp::Add> add;
  const Unary<UnaryOp::Relu> relu;
  const Binary<BinaryOp::ReluBackward> mask;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special{nan, inf, -inf, 0.0f, -0.0f, 1.5f, -2.5f, 1e-40f, -1e-40f};
  std::mt19937 rng(7);
  auto value = [&] {  // a special value one time in three
    return rng() % 3 == 0 ? special[rng() % special.size()] : std::uniform_real_distribution<float>(-2, 2)(rng);
  };
  const i64 rows = 3;
  for (i64 cols = 0; cols <= 40; ++cols)
    for (i64 start : {i64{0}, i64{1}})
      for (int variant = 0; variant < 5; ++variant) {  // bias+relu, bias, relu, mask, mask+bias+relu
        CAPTURE(cols);
        CAPTURE(start);
        CAPTURE(variant);
        const bool with_bias = variant == 0 || variant == 1 || variant == 4;
        const bool with_relu = variant == 0 || variant == 2 || variant == 4;
        const bool with_mask = variant >= 3;
        const i64 ldc = start + cols + 5;
        std::vector<float> c(static_cast<std::size_t>(rows * ldc)), y(c.size()), bias(static_cast<std::size_t>(cols + 1));
        for (float& v : c) v = value();
        for (float& v : y) v = value();
        for (float& v : bias) v = value();
        std::vector<float> want = c;
        for (i64 i = 0; i < rows; ++i)
          for (i64 j = start; j < start + cols; ++j) {
            float& v = want[static_cast<std::size_t>(i * ldc + j)];
            if (with_mask) v = mask(v, y[static_cast<std::size_t>(i * ldc + j)]);
            if (with_bias) v = add(v, bias[static_cast<std::size_t>(j - start)]);
            if (with_relu) v = relu(v);
          }
        cpu::linear_epilogue(c.data() + start, ldc, rows, cols, with_bias ? bias.data() : nullptr, with_relu,
                             with_mask ? y.data() + start : nullptr);
        REQUIRE(bitwise_equal(want, c));
      }
}

TEST_CASE("linear_backward_input: gemm, then the ReLU's mask, bit for bit, NaN and infinity included") {
  // Note [ReLU mask in the input gradient]: each chunk of dY W masks its slab by the ReLU
  // output y; gx must be what gemm, then Binary<ReluBackward>(gx, y) give — the
  // backend's own kernels (Backend's default) and the functor — for row and column
  // splits, at one thread and at all cores, with and without a mask.
  const int hw = dp::hardware_concurrency();
  const Binary<BinaryOp::ReluBackward> mask;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (auto [m, n, k] : {std::tuple<i64, i64, i64>{512, 1024, 1024}, {512, 1024, 10}, {67, 301, 130},
                         {301, 67, 2100}, {1, 4099, 33}, {4099, 1, 5}, {3, 5, 0}}) {
    for (int poison = 0; poison < 4; ++poison)  // none, NaN in gy, +inf in w, NaN in y
      for (bool with_mask : {true, false})
        for (int devices : {1, hw}) {
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(poison);
          CAPTURE(with_mask);
          CAPTURE(devices);
          auto gy = random_vec(m * k, 90), w = random_vec(k * n, 91), y = random_vec(m * n, 92);
          for (float& v : y) v = v < 0.3f ? 0.0f : v;  // a ReLU's output: zeros and positives, some negatives
          if (poison == 1 && k > 0) gy[static_cast<std::size_t>((m / 2) * k)] = nan;
          if (poison == 2 && k > 0) w[static_cast<std::size_t>(n - 1)] = inf;
          if (poison == 3) y[static_cast<std::size_t>((m / 2) * n)] = nan;
          const float* yp = with_mask ? y.data() : nullptr;
          std::vector<float> want(m * n, 7.0f), by_kernels(m * n, 7.0f), got(m * n, 7.0f);
          be().set_concurrent_devices(devices);
          be().gemm(dev0(), false, false, m, n, k, 1.0f, gy.data(), std::max<i64>(1, k), w.data(), n, 0.0f,
                    want.data(), n);
          if (with_mask)
            for (std::size_t i = 0; i < want.size(); ++i) want[i] = mask(want[i], y[i]);
          be().gemm_epilogue_by_ops(dev0(), {false,
                                             false,
                                             m,
                                             n,
                                             k,
                                             1.0f,
                                             gy.data(),
                                             std::max<i64>(1, k),
                                             w.data(),
                                             std::max<i64>(1, n),
                                             0.0f,
                                             by_kernels.data(),
                                             std::max<i64>(1, n),
                                             {nullptr, false, yp}});
          be().linear_backward_input(dev0(), m, n, k, gy.data(), w.data(), yp, got.data());
          be().set_concurrent_devices(1);
          REQUIRE(bitwise_equal(want, by_kernels));
          REQUIRE(bitwise_equal(want, got));
          if (with_mask && k > 0) {  // the mask zeroes where y <= 0 or NaN, keeps NaN from gy elsewhere
            for (std::size_t i = 0; i < got.size(); ++i)
              if (!(y[i] > 0.0f)) REQUIRE(got[i] == 0.0f);
          }
        }
  }
}

// ---- convolution -----------------------------------------------------------------------------

namespace {

Conv2dShape conv_shape(i64 N, i64 C, i64 H, i64 W, i64 K, i64 R, i64 S, i64 sh, i64 sw, i64 ph, i64 pw) {
  Conv2dShape s{N, C, H, W, K, R, S, sh, sw, ph, pw, 0, 0};
  s.P = (H + 2 * ph - R) / sh + 1;
  s.Q = (W + 2 * pw - S) / sw + 1;
  return s;
}

/// Convolution `s` in double by naive loops: y (with the bias when given), and the
/// gradients of gy; each with the same sums over the terms' magnitudes (abs).
struct NaiveConv {
  std::vector<double> y, gx, gw, gb, y_abs, gx_abs, gw_abs, gb_abs;
};
NaiveConv naive_conv(const Conv2dShape& s, const std::vector<float>& x, const std::vector<float>& w,
                     const std::vector<float>* bias, const std::vector<float>& gy) {
  auto at_x = [&](i64 n, i64 c, i64 h, i64 ww) { return ((n * s.C + c) * s.H + h) * s.W + ww; };
  auto at_w = [&](i64 k, i64 c, i64 r, i64 q) { return ((k * s.C + c) * s.R + r) * s.S + q; };
  auto at_y = [&](i64 n, i64 k, i64 p, i64 q) { return ((n * s.K + k) * s.P + p) * s.Q + q; };
  NaiveConv r{std::vector<double>(gy.size()), std::vector<double>(x.size()), std::vector<double>(w.size()),
              std::vector<double>(s.K), std::vector<double>(gy.size()), std::vector<double>(x.size()),
              std::vector<double>(w.size()), std::vector<double>(s.K)};
  for (i64 n = 0; n < s.N; ++n)
    for (i64 k = 0; k < s.K; ++k)
      for (i64 p = 0; p < s.P; ++p)
        for (i64 q = 0; q < s.Q; ++q) {
          double acc = bias ? (*bias)[k] : 0.0, acc_abs = bias ? std::fabs((*bias)[k]) : 0.0;
          const double g = gy[at_y(n, k, p, q)];
          r.gb[k] += g;
          r.gb_abs[k] += std::fabs(g);
          for (i64 c = 0; c < s.C; ++c)
            for (i64 t = 0; t < s.R; ++t)
              for (i64 u = 0; u < s.S; ++u) {
                const i64 h = p * s.stride_h - s.pad_h + t, ww = q * s.stride_w - s.pad_w + u;
                if (h < 0 || h >= s.H || ww < 0 || ww >= s.W) continue;
                const double xv = x[at_x(n, c, h, ww)], wv = w[at_w(k, c, t, u)];
                acc += xv * wv;
                acc_abs += std::fabs(xv * wv);
                r.gx[at_x(n, c, h, ww)] += g * wv;
                r.gx_abs[at_x(n, c, h, ww)] += std::fabs(g * wv);
                r.gw[at_w(k, c, t, u)] += g * xv;
                r.gw_abs[at_w(k, c, t, u)] += std::fabs(g * xv);
              }
          r.y[at_y(n, k, p, q)] = acc;
          r.y_abs[at_y(n, k, p, q)] = acc_abs;
        }
  return r;
}

void check_conv(const Conv2dShape& s, bool with_bias) {
  auto x = random_vec(s.N * s.C * s.H * s.W, 20), w = random_vec(s.K * s.C * s.R * s.S, 21),
       bias = random_vec(s.K, 22), gy = random_vec(s.N * s.K * s.P * s.Q, 23);
  const NaiveConv ref = naive_conv(s, x, w, with_bias ? &bias : nullptr, gy);
  const std::vector<double> &y_ref = ref.y, &gx_ref = ref.gx, &gw_ref = ref.gw, &gb_ref = ref.gb;
  std::vector<float> y(gy.size()), gx(x.size(), 9.0f), gw(w.size(), 9.0f), gb(s.K, 9.0f);
  be().conv2d_forward(dev0(), s, x.data(), w.data(), with_bias ? bias.data() : nullptr, y.data());
  be().conv2d_backward_data(dev0(), s, gy.data(), w.data(), gx.data());
  be().conv2d_backward_weight(dev0(), s, x.data(), gy.data(), gw.data(), with_bias ? gb.data() : nullptr);
  check_close(y, y_ref, 1e-4, 1e-4, "conv forward");
  check_close(gx, gx_ref, 1e-4, 1e-4, "conv backward data");
  check_close(gw, gw_ref, 1e-4, 1e-3, "conv backward weight");
  if (with_bias) check_close(gb, gb_ref, 1e-4, 1e-3, "conv backward bias");
  // Deterministic run to run.
  std::vector<float> gw2(w.size());
  be().conv2d_backward_weight(dev0(), s, x.data(), gy.data(), gw2.data(), nullptr);
  CHECK(bitwise_equal(gw, gw2));
}

}  // namespace

TEST_CASE("conv2d: the measured layout choice is made once and computes what that layout computes") {
  // Note [CPU convolution: measured choice]: Auto must give the bits of the layout it
  // chose, on every call and every device, so results do not depend on when or where
  // the choice was measured.
  be().set_conv_layout(cpu::ConvLayout::Auto);
  for (const Conv2dShape& s : {conv_shape(4, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1),
                               conv_shape(3, 16, 10, 10, 24, 3, 3, 1, 1, 1, 1)}) {
    auto x = random_vec(s.N * s.C * s.H * s.W, 50), w = random_vec(s.K * s.C * s.R * s.S, 51);
    auto b = random_vec(s.K, 52), gy = random_vec(s.N * s.K * s.P * s.Q, 53);
    auto run = [&](Device d, std::vector<float>& y, std::vector<float>& gx, std::vector<float>& gw,
                   std::vector<float>& gb) {
      y.assign(gy.size(), 0.0f);
      gx.assign(x.size(), 0.0f);
      gw.assign(w.size(), 0.0f);
      gb.assign(b.size(), 0.0f);
      be().conv2d_forward(d, s, x.data(), w.data(), b.data(), y.data());
      be().conv2d_backward_data(d, s, gy.data(), w.data(), gx.data());
      be().conv2d_backward_weight(d, s, x.data(), gy.data(), gw.data(), gb.data());
    };
    std::vector<float> y, gx, gw, gb, y2, gx2, gw2, gb2;
    run(dev0(), y, gx, gw, gb);
    const cpu::ConvLayout fwd = be().chosen_conv_layout(dev0(), s, cpu::ConvPass::Forward, true);
    const cpu::ConvLayout bwd_data = be().chosen_conv_layout(dev0(), s, cpu::ConvPass::BackwardData, false);
    const cpu::ConvLayout bwd_weight = be().chosen_conv_layout(dev0(), s, cpu::ConvPass::BackwardWeight, true);
    for (cpu::ConvLayout l : {fwd, bwd_data, bwd_weight})
      CHECK((l == cpu::ConvLayout::Plain || l == cpu::ConvLayout::Blocked));
    run(dp::cpu(1), y2, gx2, gw2, gb2);  // another device: the same choice, the same bits
    CHECK(bitwise_equal(y, y2));
    CHECK(bitwise_equal(gx, gx2));
    CHECK(bitwise_equal(gw, gw2));
    CHECK(bitwise_equal(gb, gb2));
    CHECK(be().chosen_conv_layout(dp::cpu(1), s, cpu::ConvPass::Forward, true) == fwd);
    // Each pass forced to its chosen layout reproduces Auto's bits.
    std::vector<float> ye(y.size()), gxe(gx.size()), gwe(gw.size()), gbe(gb.size());
    be().set_conv_layout(fwd);
    be().conv2d_forward(dev0(), s, x.data(), w.data(), b.data(), ye.data());
    be().set_conv_layout(bwd_data);
    be().conv2d_backward_data(dev0(), s, gy.data(), w.data(), gxe.data());
    be().set_conv_layout(bwd_weight);
    be().conv2d_backward_weight(dev0(), s, x.data(), gy.data(), gwe.data(), gbe.data());
    be().set_conv_layout(cpu::ConvLayout::Auto);
    CHECK(bitwise_equal(y, ye));
    CHECK(bitwise_equal(gx, gxe));
    CHECK(bitwise_equal(gw, gwe));
    CHECK(bitwise_equal(gb, gbe));
    // The recorded choice survives a cleared primitive cache (a new process reads it).
    CHECK(be().chosen_conv_layout(dev0(), s, cpu::ConvPass::Forward, true) == fwd);
  }
}

TEST_CASE("conv2d forward / backward data / backward weight against naive loops") {
  for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Auto}) {
    CAPTURE(int(layout));
    be().set_conv_layout(layout);
    check_conv(conv_shape(2, 3, 7, 9, 4, 3, 2, 2, 2, 1, 1), true);     // stride 2, non-square
    check_conv(conv_shape(3, 5, 11, 8, 6, 3, 3, 1, 1, 1, 0), false);   // asymmetric padding
    check_conv(conv_shape(4, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), true);  // CNN layer 1 (small N)
    check_conv(conv_shape(2, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1), true); // CNN layer 2 (small N)
    check_conv(conv_shape(1, 2, 5, 5, 3, 1, 1, 1, 1, 0, 0), true);     // 1x1
    // Enough work to run as batch chunks on a multi-thread device (Note [oneDNN in the
    // device's arena]); 5 images split unevenly, backward-weight sums partials.
    check_conv(conv_shape(5, 16, 14, 14, 32, 3, 3, 1, 1, 1, 1), true);
    check_conv(conv_shape(7, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), false);
  }
  Conv2dShape bad = conv_shape(1, 1, 5, 5, 1, 3, 3, 1, 1, 0, 0);
  bad.P = 5;
  std::vector<float> buf(100);
  CHECK_THROWS_AS(be().conv2d_forward(dev0(), bad, buf.data(), buf.data(), nullptr, buf.data()), dp::Error);
}

namespace {

using dp::BFloat16;

std::vector<BFloat16> to_bf16(const std::vector<float>& v) {
  std::vector<BFloat16> out;
  for (float f : v) out.push_back(BFloat16(f));
  return out;
}
std::vector<float> widen(const std::vector<BFloat16>& v) {
  std::vector<float> out;
  for (BFloat16 b : v) out.push_back(static_cast<float>(b));
  return out;
}
std::vector<float> abs_of(std::vector<float> v) {
  for (float& f : v) f = std::fabs(f);
  return v;
}

/// The three bfloat16 passes of `s`, through the op table (x, w, b, gy rounded to
/// bfloat16 from float32 draws): y and y_relu, gx, gw and gb, widened back to float32.
struct Bf16Conv {
  std::vector<float> y, y_relu, gx, gw, gb;
};
Bf16Conv run_bf16_conv(const Conv2dShape& s, const std::vector<BFloat16>& x, const std::vector<BFloat16>& w,
                       const std::vector<BFloat16>& b, const std::vector<BFloat16>& gy) {
  std::vector<BFloat16> y(gy.size()), y_relu(gy.size()), gx(x.size()), gw(w.size()), gb(b.size());
  const DType dt = DType::BF16;
  be().run<Op::Conv2d>(dev0(), dt, {s, x.data(), w.data(), b.data(), y.data(), false});
  be().run<Op::Conv2d>(dev0(), dt, {s, x.data(), w.data(), b.data(), y_relu.data(), true});
  be().run<Op::Conv2dBackwardData>(dev0(), dt, {s, gy.data(), w.data(), gx.data()});
  be().run<Op::Conv2dBackwardWeight>(dev0(), dt, {s, x.data(), gy.data(), gw.data(), gb.data()});
  return {widen(y), widen(y_relu), widen(gx), widen(gw), widen(gb)};
}

/// N images of C x HW values moved from NCHW into N x HW x C (`to_nhwc`) or back: the
/// bytes of a channels-last call (Conv2dShape::channels_last).
template <typename T>
std::vector<T> relayout(const std::vector<T>& v, i64 N, i64 C, i64 HW, bool to_nhwc) {
  std::vector<T> out(v.size());
  for (i64 n = 0; n < N; ++n)
    for (i64 c = 0; c < C; ++c)
      for (i64 i = 0; i < HW; ++i) {
        const auto nchw = static_cast<std::size_t>((n * C + c) * HW + i);
        const auto nhwc = static_cast<std::size_t>((n * HW + i) * C + c);
        if (to_nhwc) {
          out[nhwc] = v[nchw];
        } else {
          out[nchw] = v[nhwc];
        }
      }
  return out;
}

/// The float32 passes of `s` on the given (widened) values.
Bf16Conv run_f32_conv(const Conv2dShape& s, const std::vector<float>& x, const std::vector<float>& w,
                      const std::vector<float>& b, const std::vector<float>& gy) {
  Bf16Conv r{std::vector<float>(gy.size()), std::vector<float>(gy.size()), std::vector<float>(x.size()),
             std::vector<float>(w.size()), std::vector<float>(b.size())};
  be().conv2d_forward(dev0(), s, x.data(), w.data(), b.data(), r.y.data());
  be().conv2d_relu_forward(dev0(), s, x.data(), w.data(), b.data(), r.y_relu.data());
  be().conv2d_backward_data(dev0(), s, gy.data(), w.data(), r.gx.data());
  be().conv2d_backward_weight(dev0(), s, x.data(), gy.data(), r.gw.data(), r.gb.data());
  return r;
}

/// got within one rounding to bfloat16 of want plus two float32 sums of `terms` terms in
/// other orders: |got − want| <= 2^-8 |want| + 4 (terms + 2) 2^-24 abs_sum, abs_sum being
/// the same sum over |terms| (the float32 error of a sum of n terms is at most about
/// n 2^-24 times it; the rounding, half a bfloat16 ulp, at most 2^-8 relative).
void check_bf16_sum(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& abs_sum,
                    double terms, const char* what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = std::ldexp(std::fabs(double(want[i])), -8) + 4 * (terms + 2) * std::ldexp(double(abs_sum[i]), -24);
    const double err = std::fabs(double(got[i]) - double(want[i]));
    worst = std::max(worst, tol > 0 ? err / tol : err);
    bad += !(err <= tol);
  }
  INFO(what, ": worst error / tolerance ", worst);
  CHECK(bad == 0);
}

void check_bf16_conv(const Conv2dShape& s, unsigned seed) {
  CAPTURE(s.N); CAPTURE(s.C); CAPTURE(s.H); CAPTURE(s.W); CAPTURE(s.K); CAPTURE(s.stride_h); CAPTURE(s.pad_w);
  const auto x = to_bf16(random_vec(s.N * s.C * s.H * s.W, seed)), w = to_bf16(random_vec(s.K * s.C * s.R * s.S, seed + 1));
  const auto b = to_bf16(random_vec(s.K, seed + 2)), gy = to_bf16(random_vec(s.N * s.K * s.P * s.Q, seed + 3));
  const Bf16Conv ref = run_f32_conv(s, widen(x), widen(w), widen(b), widen(gy));
  // The widening path: the float32 passes rounded once, bit for bit.
  be().set_native_bf16_conv(false);
  CHECK_FALSE(be().native_bf16_conv());
  const Bf16Conv wide = run_bf16_conv(s, x, w, b, gy);
  be().set_native_bf16_conv(true);
  auto rounded = [](const std::vector<float>& v) { return widen(to_bf16(v)); };
  CHECK(bitwise_equal(wide.y, rounded(ref.y)));
  CHECK(bitwise_equal(wide.y_relu, rounded(ref.y_relu)));
  CHECK(bitwise_equal(wide.gx, rounded(ref.gx)));
  CHECK(bitwise_equal(wide.gw, rounded(ref.gw)));
  CHECK(bitwise_equal(wide.gb, rounded(ref.gb)));
  if (!be().native_bf16_conv()) {
    MESSAGE("no bfloat16 instructions on this CPU: the bfloat16 convolutions widen (checked above)");
    return;
  }
  // oneDNN's bfloat16 passes: the float32 ones up to the order of the sums and one
  // rounding (the sums of |terms| come from the float32 passes on absolute values).
  const Bf16Conv abs = run_f32_conv(s, abs_of(widen(x)), abs_of(widen(w)), abs_of(widen(b)), abs_of(widen(gy)));
  const Bf16Conv got = run_bf16_conv(s, x, w, b, gy);
  check_bf16_sum(got.y, ref.y, abs.y, double(s.C * s.R * s.S + 1), "forward");
  check_bf16_sum(got.y_relu, ref.y_relu, abs.y, double(s.C * s.R * s.S + 1), "forward + relu");
  check_bf16_sum(got.gx, ref.gx, abs.gx, double(s.K * s.R * s.S), "backward data");
  check_bf16_sum(got.gw, ref.gw, abs.gw, double(s.N * s.P * s.Q), "backward weight");
  check_bf16_sum(got.gb, ref.gb, abs.gb, double(s.N * s.P * s.Q), "backward bias");
  for (float v : got.y_relu) CHECK(!(v < 0.0f));
  // The same passes on channels-last bytes (Note [Channels-last tensors]), read back as NCHW.
  Conv2dShape cs = s;
  cs.channels_last = true;
  const i64 HW = s.H * s.W, PQ = s.P * s.Q;
  const Bf16Conv cl = run_bf16_conv(cs, relayout(x, s.N, s.C, HW, true), w, b, relayout(gy, s.N, s.K, PQ, true));
  check_bf16_sum(relayout(cl.y, s.N, s.K, PQ, false), ref.y, abs.y, double(s.C * s.R * s.S + 1),
                 "channels-last forward");
  check_bf16_sum(relayout(cl.y_relu, s.N, s.K, PQ, false), ref.y_relu, abs.y, double(s.C * s.R * s.S + 1),
                 "channels-last forward + relu");
  check_bf16_sum(relayout(cl.gx, s.N, s.C, HW, false), ref.gx, abs.gx, double(s.K * s.R * s.S),
                 "channels-last backward data");
  check_bf16_sum(cl.gw, ref.gw, abs.gw, double(s.N * s.P * s.Q), "channels-last backward weight");
  check_bf16_sum(cl.gb, ref.gb, abs.gb, double(s.N * s.P * s.Q), "channels-last backward bias");
  // Deterministic run to run.
  const Bf16Conv again = run_bf16_conv(s, x, w, b, gy);
  CHECK(bitwise_equal(got.y, again.y));
  CHECK(bitwise_equal(got.gx, again.gx));
  CHECK(bitwise_equal(got.gw, again.gw));
}

}  // namespace

TEST_CASE("bf16 conv2d: oneDNN's bfloat16 passes within one rounding of float32's; the widening path bit for bit") {
  // Note [bf16 convolutions through oneDNN]; Gemm: the channels-last backward-weight
  // passes as one product (Note [Backward weight as one product]).
  for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Auto,
                                 cpu::ConvLayout::Gemm}) {
    CAPTURE(int(layout));
    be().set_conv_layout(layout);
    check_bf16_conv(conv_shape(2, 3, 7, 9, 4, 3, 2, 2, 2, 1, 1), 60);      // stride 2, non-square
    check_bf16_conv(conv_shape(3, 5, 11, 8, 6, 3, 3, 1, 2, 1, 0), 61);     // strides and padding per axis
    check_bf16_conv(conv_shape(4, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), 62);   // CNN layer 1
    check_bf16_conv(conv_shape(2, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1), 63);  // CNN layer 2
    check_bf16_conv(conv_shape(1, 2, 5, 5, 3, 1, 1, 1, 1, 0, 0), 64);      // 1x1
    // Batch chunks on a multi-thread device; backward-weight sums float32 partials.
    check_bf16_conv(conv_shape(5, 16, 14, 14, 32, 3, 3, 1, 1, 1, 1), 65);
    // Images narrower than their horizontal stride (Note [bf16 backward-weight on an image
    // narrower than its stride]): the op fuzzer's 1x1 image, and two of the scan's shapes.
    check_bf16_conv(conv_shape(3, 3, 1, 1, 3, 3, 3, 2, 2, 1, 1), 66);
    check_bf16_conv(conv_shape(2, 16, 3, 1, 16, 3, 3, 2, 2, 1, 1), 67);
    check_bf16_conv(conv_shape(2, 16, 4, 2, 16, 3, 3, 3, 3, 1, 1), 68);
  }
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

TEST_CASE("bf16 conv2d: images narrower than the stride, unwritten memory poisoned, within one rounding of float32") {
  // Note [bf16 backward-weight on an image narrower than its stride]: with the primitives'
  // scratchpads and outputs filled with NaN first, a pass that reads memory it never wrote
  // fails here on every run. A sweep of narrow images around W < stride_w, both layouts.
  dp::backend::Backend::set_poison_memory(true);
  for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Gemm}) {
    CAPTURE(int(layout));
    be().set_conv_layout(layout);
    unsigned seed = 100;
    for (i64 W = 1; W <= 5; ++W)
      for (i64 S = 1; S <= 5; ++S)
        for (i64 sw = 1; sw <= 4; ++sw)
          for (i64 pw = 0; pw < S; ++pw) {
            if (W + 2 * pw < S) continue;
            CAPTURE(W); CAPTURE(S); CAPTURE(sw); CAPTURE(pw);
            check_bf16_conv(conv_shape(2, 4, 2, W, 16, 1, S, 1, sw, 0, pw), seed++);
          }
  }
  dp::backend::Backend::set_poison_memory(false);
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

TEST_CASE("bf16 conv2d: a vertical stride above the kernel's height, Blocked asked for, every pass within a rounding") {
  // Note [Blocked forward with a stride above the kernel]: shapes whose Blocked forward
  // wrote past oneDNN's input-row buffer on the AMX Xeon (wrong outputs, or a corrupted
  // heap), with unwritten memory poisoned; they run in the Plain layout now.
  dp::backend::Backend::set_poison_memory(true);
  be().set_conv_layout(cpu::ConvLayout::Blocked);
  struct Geometry {
    i64 C, R, S, sh, sw, ph, pw;
  };
  unsigned seed = 300;
  for (const Geometry g : {Geometry{128, 1, 3, 2, 2, 0, 1}, Geometry{128, 1, 7, 3, 3, 0, 1}, Geometry{128, 1, 3, 4, 3, 0, 1},
                           Geometry{128, 2, 1, 3, 3, 0, 0}, Geometry{128, 2, 7, 4, 3, 1, 1}, Geometry{64, 1, 7, 3, 3, 0, 1},
                           Geometry{64, 1, 3, 4, 3, 0, 1}, Geometry{128, 1, 1, 2, 2, 0, 0}}) {
    CAPTURE(g.C); CAPTURE(g.R); CAPTURE(g.S); CAPTURE(g.sh); CAPTURE(g.sw);
    check_bf16_conv(conv_shape(4, g.C, 14, 20, g.C, g.R, g.S, g.sh, g.sw, g.ph, g.pw), seed++);
  }
  dp::backend::Backend::set_poison_memory(false);
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

namespace {

/// Note [Convolution scans]
/// oneDNN's convolution kernels are picked by shape, ISA and layout, and two of them were
/// wrong at geometries no fixed case had (Note [bf16 backward-weight on an image narrower
/// than its stride], Note [Blocked forward with a stride above the kernel]). The scans
/// below draw random geometries (1-128 channels, kernels 1-7, strides 1-4, padding 0-3,
/// each way) and run every pass in both layouts with unwritten memory poisoned: bfloat16
/// against float32 within a rounding, float32 against double. DP_CONV_SCAN sets how many
/// geometries each draws (default 300, 30 under a sanitizer) and DP_CONV_SCAN_SEED the
/// seed (default 1); `scripts/fuzz.sh --conv-scan N` runs N of each on this CPU.
int conv_scan_count() {
  const char* env = std::getenv("DP_CONV_SCAN");
  return env ? std::atoi(env) : dp_test::kSanitized ? 30 : 300;
}
unsigned conv_scan_seed() {
  const char* env = std::getenv("DP_CONV_SCAN_SEED");
  return env ? static_cast<unsigned>(std::atoi(env)) : 1u;
}

/// A random convolution of the scans: `wide` draws 16-128 channels, else 1-32.
Conv2dShape scan_geometry(std::mt19937& rng, bool wide) {
  auto pick = [&](std::initializer_list<int> v) { return static_cast<i64>(*(v.begin() + rng() % v.size())); };
  while (true) {
    const i64 N = pick({1, 2, 3, 4});
    const i64 C = wide ? pick({16, 32, 48, 64, 96, 128}) : pick({1, 2, 3, 4, 8, 16, 17, 32});
    const i64 K = wide ? pick({16, 32, 48, 64, 96, 128}) : pick({1, 3, 8, 16, 17, 32});
    const i64 H = pick({1, 2, 3, 4, 5, 7, 8, 9, 13, 14}), W = pick({1, 2, 3, 4, 5, 7, 8, 9, 13, 14});
    const i64 R = pick({1, 2, 3, 4, 5, 7}), S = pick({1, 2, 3, 4, 5, 7});
    const i64 sh = pick({1, 1, 2, 3, 4}), sw = pick({1, 1, 2, 3, 4});
    const i64 ph = pick({0, 0, 1, 2, 3}), pw = pick({0, 0, 1, 2, 3});
    if (H + 2 * ph >= R && W + 2 * pw >= S) return conv_shape(N, C, H, W, K, R, S, sh, sw, ph, pw);
  }
}

}  // namespace

TEST_CASE("conv scan: random bfloat16 convolutions, both layouts, memory poisoned, within a rounding of float32") {
  // Note [Convolution scans].
  if (!be().native_bf16_conv()) {
    MESSAGE("no bfloat16 instructions on this CPU: the bfloat16 convolutions widen (checked elsewhere)");
    return;
  }
  dp::backend::Backend::set_poison_memory(true);
  std::mt19937 rng(conv_scan_seed());
  const int count = conv_scan_count();
  for (int i = 0; i < count; ++i) {
    const Conv2dShape s = scan_geometry(rng, i % 2 == 1);
    for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Gemm}) {
      CAPTURE(int(layout)); CAPTURE(s.N); CAPTURE(s.C); CAPTURE(s.H); CAPTURE(s.W); CAPTURE(s.K); CAPTURE(s.R);
      CAPTURE(s.S); CAPTURE(s.stride_h); CAPTURE(s.stride_w); CAPTURE(s.pad_h); CAPTURE(s.pad_w);
      be().set_conv_layout(layout);
      check_bf16_conv(s, 1000u + static_cast<unsigned>(i));
    }
  }
  dp::backend::Backend::set_poison_memory(false);
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

TEST_CASE("conv scan: random float32 convolutions, both layouts, memory poisoned, against double") {
  // Note [Convolution scans]: each pass within float32's error bound of a sum in another
  // order, 4 (terms + 2) 2^-24 times the sum of its terms' magnitudes.
  auto check = [](const std::vector<float>& got, const std::vector<double>& want, const std::vector<double>& abs_sum,
                  double terms, const char* what) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < got.size(); ++i)
      bad += !(std::fabs(double(got[i]) - want[i]) <= 4 * (terms + 2) * std::ldexp(abs_sum[i], -24));
    INFO(what);
    CHECK(bad == 0);
  };
  dp::backend::Backend::set_poison_memory(true);
  std::mt19937 rng(conv_scan_seed() + 7919u);
  const int count = conv_scan_count();
  for (int i = 0; i < count; ++i) {
    const Conv2dShape s = scan_geometry(rng, i % 2 == 1);
    const unsigned seed = 2000u + 4u * static_cast<unsigned>(i);
    const auto x = random_vec(s.N * s.C * s.H * s.W, seed), w = random_vec(s.K * s.C * s.R * s.S, seed + 1);
    const auto bias = random_vec(s.K, seed + 2), gy = random_vec(s.N * s.K * s.P * s.Q, seed + 3);
    const NaiveConv ref = naive_conv(s, x, w, &bias, gy);
    for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Gemm}) {
      CAPTURE(int(layout)); CAPTURE(s.N); CAPTURE(s.C); CAPTURE(s.H); CAPTURE(s.W); CAPTURE(s.K); CAPTURE(s.R);
      CAPTURE(s.S); CAPTURE(s.stride_h); CAPTURE(s.stride_w); CAPTURE(s.pad_h); CAPTURE(s.pad_w);
      be().set_conv_layout(layout);
      for (bool channels_last : {false, true}) {  // Note [Channels-last tensors]
        CAPTURE(channels_last);
        Conv2dShape cs = s;
        cs.channels_last = channels_last;
        const i64 HW = s.H * s.W, PQ = s.P * s.Q;
        auto in = [&](const std::vector<float>& v, i64 C, i64 hw) {
          return channels_last ? relayout(v, s.N, C, hw, true) : v;
        };
        auto out = [&](const std::vector<float>& v, i64 C, i64 hw) {
          return channels_last ? relayout(v, s.N, C, hw, false) : v;
        };
        const auto xs = in(x, s.C, HW), gys = in(gy, s.K, PQ);
        std::vector<float> y(gy.size()), gx(x.size()), gw(w.size()), gb(s.K);
        be().conv2d_forward(dev0(), cs, xs.data(), w.data(), bias.data(), y.data());
        be().conv2d_backward_data(dev0(), cs, gys.data(), w.data(), gx.data());
        be().conv2d_backward_weight(dev0(), cs, xs.data(), gys.data(), gw.data(), gb.data());
        check(out(y, s.K, PQ), ref.y, ref.y_abs, double(s.C * s.R * s.S + 1), "forward");
        check(out(gx, s.C, HW), ref.gx, ref.gx_abs, double(s.K * s.R * s.S), "backward data");
        check(gw, ref.gw, ref.gw_abs, double(s.N * s.P * s.Q), "backward weight");
        check(gb, ref.gb, ref.gb_abs, double(s.N * s.P * s.Q), "backward bias");
      }
    }
  }
  dp::backend::Backend::set_poison_memory(false);
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

TEST_CASE("bf16 conv2d: transpose_copy's reorders give oneDNN's reorders' bits in every pass") {
  // Note [bfloat16 blocked reorders]: the primitives must see the same operands and
  // write the same outputs, whichever layout oneDNN picks on this CPU (nChw16c on
  // AVX-512, NHWC on AMX) and whether C is a multiple of 16 or HW of the 16x16 blocks.
  if (!be().native_bf16_conv()) {
    MESSAGE("no bfloat16 instructions on this CPU: the bfloat16 convolutions widen, nothing is reordered");
    return;
  }
  be().set_conv_layout(cpu::ConvLayout::Blocked);
  unsigned seed = 90;
  for (const Conv2dShape& s : {conv_shape(4, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1),     // CNN layer 1
                               conv_shape(3, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1),    // CNN layer 2: HW = 196
                               conv_shape(2, 16, 7, 9, 48, 3, 3, 1, 1, 1, 1),      // HW = 63, under one block
                               conv_shape(2, 24, 10, 10, 20, 3, 3, 2, 2, 1, 1)}) {  // C, K not multiples of 16
    CAPTURE(s.N); CAPTURE(s.C); CAPTURE(s.H); CAPTURE(s.W); CAPTURE(s.K);
    const auto x = to_bf16(random_vec(s.N * s.C * s.H * s.W, seed)), w = to_bf16(random_vec(s.K * s.C * s.R * s.S, seed + 1));
    const auto b = to_bf16(random_vec(s.K, seed + 2)), gy = to_bf16(random_vec(s.N * s.K * s.P * s.Q, seed + 3));
    seed += 8;
    // transpose_copy's first: the primitives' layout buffers are shared, so a value its
    // reorders missed is then a stale one, not the one oneDNN's reorder would leave there.
    CpuBackend::set_own_conv_reorders(true);
    const Bf16Conv own = run_bf16_conv(s, x, w, b, gy);
    CpuBackend::set_own_conv_reorders(false);
    const Bf16Conv onednn = run_bf16_conv(s, x, w, b, gy);
    CHECK(bitwise_equal(own.y, onednn.y));
    CHECK(bitwise_equal(own.y_relu, onednn.y_relu));
    CHECK(bitwise_equal(own.gx, onednn.gx));
    CHECK(bitwise_equal(own.gw, onednn.gw));
    CHECK(bitwise_equal(own.gb, onednn.gb));
    // Not vacuous: the outputs are the convolution's, not a buffer left as it was.
    CHECK(std::any_of(own.y.begin(), own.y.end(), [](float v) { return v != 0.0f; }));
    CHECK(std::any_of(own.gx.begin(), own.gx.end(), [](float v) { return v != 0.0f; }));
  }
  CpuBackend::set_own_conv_reorders(true);
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

namespace {

/// Conv2dBackward of one convolution in T (float or BFloat16; with pool.on, of the
/// ReLU'd, pooled one) in one call and as the separate ops; every output of the two bit
/// for bit.
template <typename T>
void check_conv_backward_in_one_call(const Conv2dShape& s, bool pool, bool want_gx, bool want_gw, bool bias,
                                     unsigned seed, bool own_reorders = true) {
  CAPTURE(s.N); CAPTURE(s.C); CAPTURE(s.H); CAPTURE(s.K); CAPTURE(s.P); CAPTURE(s.Q);
  CAPTURE(pool); CAPTURE(want_gx); CAPTURE(want_gw); CAPTURE(bias);
  constexpr bool f32 = std::is_same_v<T, float>;
  const DType dt = f32 ? DType::F32 : DType::BF16;
  CAPTURE(f32);
  auto draw = [](i64 n, unsigned sd) {
    const std::vector<float> v = random_vec(n, sd);
    return std::vector<T>(v.begin(), v.end());
  };
  auto wide = [](const std::vector<T>& v) { return std::vector<float>(v.begin(), v.end()); };
  const auto x = draw(s.N * s.C * s.H * s.W, seed), w = draw(s.K * s.C * s.R * s.S, seed + 1), b = draw(s.K, seed + 2);
  ConvPoolBackward prologue;
  std::vector<T> pooled;
  std::vector<std::int32_t> winners;
  i64 ny = s.N * s.K * s.P * s.Q;
  if (pool) {
    const Pool2dShape ps{s.N, s.K, s.P, s.Q, 2, 2, 2, 2, 0, 0, s.P / 2, s.Q / 2};
    pooled.resize(static_cast<std::size_t>(s.N * s.K * ps.P * ps.Q));
    winners.resize(static_cast<std::size_t>((max_pool2d_winner_bytes(be(), ps) + 3) / 4));
    be().run<Op::Conv2d>(dev0(), dt, {s, x.data(), w.data(), b.data(), pooled.data(), true,
                                      ConvPool{.on = true, .s = ps, .winners = winners.data()}});
    prologue = {.on = true, .s = ps, .winners = winners.data(), .relu_y = pooled.data()};
    ny = static_cast<i64>(pooled.size());
  }
  const auto gy = draw(ny, seed + 3);
  struct Grads {
    std::vector<T> gx, gw, gb;
  };
  const T nan(std::numeric_limits<float>::quiet_NaN());
  auto outputs = [&] {
    return Grads{std::vector<T>(want_gx ? x.size() : 0, nan), std::vector<T>(want_gw ? w.size() : 0, nan),
                 std::vector<T>(want_gw && bias ? b.size() : 0, nan)};
  };
  auto ptr = [](std::vector<T>& v) -> void* { return v.empty() ? nullptr : v.data(); };
  Grads one = outputs(), ops = outputs();
  const std::uint64_t before = CpuBackend::shared_conv_backwards();
  be().run<Op::Conv2dBackward>(dev0(), dt, {s, gy.data(), x.data(), w.data(), ptr(one.gx), ptr(one.gw), ptr(one.gb),
                                            prologue});
  const bool shared = CpuBackend::shared_conv_backwards() > before;
  std::vector<T> routed(static_cast<std::size_t>(s.N * s.K * s.P * s.Q));
  const void* g = gy.data();
  if (pool) {
    be().run<Op::MaxPool2dBackward>(dev0(), dt, {prologue.s, gy.data(), winners.data(), pooled.data(), routed.data()});
    g = routed.data();
  }
  if (want_gx) be().run<Op::Conv2dBackwardData>(dev0(), dt, {s, g, w.data(), ops.gx.data()});
  if (want_gw) be().run<Op::Conv2dBackwardWeight>(dev0(), dt, {s, x.data(), g, ptr(ops.gw), ptr(ops.gb)});
  CHECK(bitwise_equal(wide(one.gx), wide(ops.gx)));
  CHECK(bitwise_equal(wide(one.gw), wide(ops.gw)));
  CHECK(bitwise_equal(wide(one.gb), wide(ops.gb)));
  // Not vacuous: the gradients were written (no output left at its NaN fill).
  for (const auto* v : {&one.gx, &one.gw, &one.gb}) {
    CHECK(std::none_of(v->begin(), v->end(), [](T e) { return std::isnan(static_cast<float>(e)); }));
    CHECK((v->empty() || std::any_of(v->begin(), v->end(), [](T e) { return static_cast<float>(e) != 0.0f; })));
  }
  // Where the pass reads gy in a layout transpose_copy moves, it was built once: the
  // blocked layouts of AVX-512 (nChw16c) and AMX (NHWC); AVX2's nChw8c is not one.
  const bool avx512 = __builtin_cpu_supports("avx512f") && std::getenv("DNNL_MAX_CPU_ISA") == nullptr &&
                      std::getenv("ONEDNN_MAX_CPU_ISA") == nullptr;
  // Both passes share it where they agree on the layout: float32's AVX-512 kernels all
  // take nChw16c.
  if (own_reorders && avx512 && (f32 || be().native_bf16_conv()) && be().conv_layout() == cpu::ConvLayout::Blocked &&
      s.K % 16 == 0 &&
      (!want_gx || (f32 && s.C % 16 == 0)))
    CHECK(shared);
  if (shared) MESSAGE("shared gy: ", std::string(f32 ? "f32" : "bf16"), " N=", s.N, " C=", s.C, " K=", s.K, " pool ", pool, " gx ", want_gx);
}

template <typename T>
void check_conv_backwards_in_one_call() {
  for (cpu::ConvLayout layout : {cpu::ConvLayout::Blocked, cpu::ConvLayout::Plain, cpu::ConvLayout::Auto}) {
    CAPTURE(int(layout));
    be().set_conv_layout(layout);
    unsigned seed = 300;
    for (bool pool : {true, false}) {
      for (bool bias : {true, false}) {
        check_conv_backward_in_one_call<T>(conv_shape(5, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), pool, false, true, bias,
                                           seed++);  // CNN layer 1: the weight pass only
        check_conv_backward_in_one_call<T>(conv_shape(5, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1), pool, true, true, bias,
                                           seed++);  // CNN layer 2
      }
      check_conv_backward_in_one_call<T>(conv_shape(3, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1), pool, true, false, true,
                                         seed++);  // the data pass only
      check_conv_backward_in_one_call<T>(conv_shape(3, 16, 7, 9, 48, 3, 3, 1, 1, 1, 1), pool, true, true, true,
                                         seed++);  // an odd pool: the last row and column route nothing
      check_conv_backward_in_one_call<T>(conv_shape(2, 24, 10, 10, 20, 3, 3, 1, 1, 1, 1), pool, true, true, true,
                                         seed++);  // K not a multiple of 16
      // Chunks of several groups of the pool's backward (512 KiB of gy each), the last
      // one short.
      check_conv_backward_in_one_call<T>(conv_shape(23, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1), pool, false, true, true,
                                         seed++);
      check_conv_backward_in_one_call<T>(conv_shape(45, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1), pool, true, true, true,
                                         seed++);
    }
    // oneDNN's reorders (tests): the call runs as the separate ops.
    CpuBackend::set_own_conv_reorders(false);
    const std::uint64_t before = CpuBackend::shared_conv_backwards();
    check_conv_backward_in_one_call<T>(conv_shape(3, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1), true, true, true, true, 399,
                                       /*own_reorders=*/false);
    CHECK(CpuBackend::shared_conv_backwards() == before);
    CpuBackend::set_own_conv_reorders(true);
  }
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

}  // namespace

TEST_CASE("conv2d backward in one call: the separate ops' bits, gy built once where the passes share it") {
  // Note [Convolution backward in one call].
  SUBCASE("float32") { check_conv_backwards_in_one_call<float>(); }
  SUBCASE("bfloat16") { check_conv_backwards_in_one_call<BFloat16>(); }
  SUBCASE("bad arguments: a pool over another shape, a bias gradient without the weight's, no winners") {
    const Conv2dShape s = conv_shape(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1);
    std::vector<float> x(2 * 3 * 64, 1.0f), w(4 * 3 * 9, 1.0f), gy(2 * 4 * 64, 1.0f), gx(x.size()), gw(w.size()),
        gb(4), winners(2 * 4 * 16 * 2), ry(2 * 4 * 16, 1.0f);
    const Pool2dShape other{2, 4, 6, 6, 2, 2, 2, 2, 0, 0, 3, 3};  // over a 6x6 output, not 8x8
    for (DType dt : {DType::F32, DType::BF16}) {
      CAPTURE(int(dt));
      CHECK_THROWS_WITH_AS(be().run<Op::Conv2dBackward>(dev0(), dt, {s, gy.data(), x.data(), w.data(), gx.data(),
                                                                     gw.data(), gb.data(),
                                                                     ConvPoolBackward{.on = true, .s = other,
                                                                                      .winners = winners.data(),
                                                                                      .relu_y = ry.data()}}),
                           doctest::Contains("expected a max-pool over the convolution's output"), dp::Error);
      const Pool2dShape ps{2, 4, 8, 8, 2, 2, 2, 2, 0, 0, 4, 4};
      CHECK_THROWS_WITH_AS(be().run<Op::Conv2dBackward>(dev0(), dt, {s, gy.data(), x.data(), w.data(), gx.data(),
                                                                     gw.data(), gb.data(),
                                                                     ConvPoolBackward{.on = true, .s = ps,
                                                                                      .relu_y = ry.data()}}),
                           doctest::Contains("expected the max-pool's winners"), dp::Error);
      CHECK_THROWS_WITH_AS(be().run<Op::Conv2dBackward>(dev0(), dt, {s, gy.data(), x.data(), w.data(), gx.data(),
                                                                     nullptr, gb.data()}),
                           doctest::Contains("gbias needs gw"), dp::Error);
    }
  }
}

TEST_CASE("bf16 gemm: every transposition, padded, in slabs, within one rounding of float32; a transposed A "
          "copied untransposed gives the untransposed product's bits") {
  // Note [bf16 GEMMs through oneDNN], Note [bf16 GEMMs: a transposed A copied untransposed].
  struct Shape { i64 m, n, k, pad; };
  unsigned seed = 120;
  for (const Shape sh : {Shape{128, 3136, 256, 0}, Shape{64, 40, 96, 3}, Shape{33, 17, 70, 5}, Shape{16, 8, 16, 0}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        CAPTURE(sh.m); CAPTURE(sh.n); CAPTURE(sh.k); CAPTURE(ta); CAPTURE(tb);
        const i64 lda = (ta ? sh.m : sh.k) + sh.pad, ldb = (tb ? sh.k : sh.n) + sh.pad, ldc = sh.n + sh.pad;
        // Positive operands: no cancellation, so any order of the float32 sums rounds to
        // the reference's bfloat16 or its neighbour.
        const auto a = to_bf16(random_vec((ta ? sh.k : sh.m) * lda, seed, 0.5f, 1.0f));
        const auto b = to_bf16(random_vec((tb ? sh.n : sh.k) * ldb, seed + 1, 0.5f, 1.0f));
        seed += 2;
        std::vector<BFloat16> c(sh.m * ldc, BFloat16(-7.0f));
        be().run<Op::Gemm>(dev0(), DType::BF16, {ta, tb, sh.m, sh.n, sh.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                                                  c.data(), ldc, {}});
        const auto af = widen(a), bf = widen(b);
        std::vector<float> want(sh.m * ldc, 0.0f);
        be().gemm(dev0(), ta, tb, sh.m, sh.n, sh.k, 1.0f, af.data(), lda, bf.data(), ldb, 0.0f, want.data(), ldc);
        i64 bad = 0;
        for (i64 i = 0; i < sh.m; ++i)
          for (i64 j = 0; j < ldc; ++j) {
            const float got = static_cast<float>(c[i * ldc + j]);
            if (j >= sh.n) {
              bad += got != -7.0f;  // the padding left alone
              continue;
            }
            int e = 0;
            std::frexp(want[i * ldc + j], &e);
            bad += !(std::fabs(got - want[i * ldc + j]) <= std::ldexp(1.0f, e - 8));
          }
        CHECK(bad == 0);
        if (!ta) continue;
        // One slab (one thread per device): the product of A copied untransposed by hand.
        const std::string kernel = cpu::bf16_gemm_kernel(sh.m, sh.n, sh.k, lda, ldb, ldc, true, tb);
        CAPTURE(kernel);
        if (kernel.find("untransposed") == std::string::npos) continue;
        std::vector<BFloat16> at(sh.m * sh.k);
        for (i64 i = 0; i < sh.m; ++i)
          for (i64 p = 0; p < sh.k; ++p) at[i * sh.k + p] = a[p * lda + i];
        std::vector<BFloat16> c1(sh.m * ldc), c2(sh.m * ldc);
        be().set_concurrent_devices(dp::hardware_concurrency());
        be().run<Op::Gemm>(dev0(), DType::BF16, {true, tb, sh.m, sh.n, sh.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f,
                                                  c1.data(), ldc, {}});
        be().run<Op::Gemm>(dev0(), DType::BF16, {false, tb, sh.m, sh.n, sh.k, 1.0f, at.data(), sh.k, b.data(), ldb,
                                                  0.0f, c2.data(), ldc, {}});
        be().set_concurrent_devices(1);
        CHECK(bitwise_equal(widen(c1), widen(c2)));
      }
  }
  // The CNN's fc1 weight gradient on a CPU with a bfloat16 matmul: the case the copy is for.
  const std::string fc1 = cpu::bf16_gemm_kernel(64, 3136, 256, 128, 3136, 3136, true, false);
  MESSAGE("bfloat16 dW = dY^T X of 64 x 3136 x 256 runs on: ", fc1.empty() ? "the widening path" : fc1);
}

TEST_CASE("max_abs_bits: the largest |v| as bits, infinity above numbers and NaN above that, any length") {
  // Note [Scan clones]: whichever clone the CPU runs, the value of the plain loop.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto bits_of = [](float v) {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u & 0x7fffffffu;
  };
  auto v = random_vec(310, 90, -2.0f, 2.0f);  // room for the largest start + n
  for (i64 n : {0, 1, 7, 15, 16, 17, 33, 64, 100, 299}) {
    for (i64 start : {0, 1, 3}) {
      CAPTURE(n);
      CAPTURE(start);
      for (int poison = 0; poison < 5; ++poison) {
        std::vector<float> x(v.begin() + start, v.begin() + start + n);
        if (n > 0) {
          const std::size_t at = static_cast<std::size_t>(n - 1 - (n / 3));
          if (poison == 1) x[at] = -inf;
          if (poison == 2) x[at] = -nan;
          if (poison == 3) x[at] = -5.0f;  // the largest |v|, negative
          if (poison == 4) std::fill(x.begin(), x.end(), -0.0f);
        }
        std::uint32_t want = 0;
        for (float f : x) want = std::max(want, bits_of(f));
        CHECK(cpu::max_abs_bits(x.data(), n) == want);
        if (n > 0 && poison == 1) CHECK(want == 0x7f800000u);
        if (n > 0 && poison == 2) CHECK(want > 0x7f800000u);
        if (n > 0 && poison == 3) CHECK(want == bits_of(5.0f));
        if (n > 0 && poison == 4) CHECK(want == 0u);
      }
    }
  }
}

TEST_CASE("conv2d_relu_forward: conv2d_forward then Unary<Relu>, bit for bit, NaN and infinity included") {
  // Note [Convolution + ReLU]: the fused post-op must store exactly what the separate
  // ReLU pass stores; a NaN or an infinity in the input, weight or bias runs unfused,
  // so a NaN still propagates. Poison 4 makes products overflow both ways in one sum:
  // kernels that round each product (no FMA) then make a NaN, which the fused op must
  // keep too; with FMA (the product is never rounded alone) the sum stays +-inf. Either
  // way fused and unfused agree bit for bit.
  const Unary<UnaryOp::Relu> relu;
  for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Auto}) {
    CAPTURE(int(layout));
    be().set_conv_layout(layout);
    for (const Conv2dShape& s : {conv_shape(9, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1),    // CNN layer 1
                                 conv_shape(6, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1),   // CNN layer 2
                                 conv_shape(2, 3, 7, 9, 4, 3, 2, 2, 2, 1, 1)}) {    // stride 2
      for (int poison = 0; poison < 5; ++poison) {  // none, NaN in x, +inf in w, NaN in bias, overflow
        for (bool with_bias : {true, false}) {
          CAPTURE(s.C);
          CAPTURE(poison);
          CAPTURE(with_bias);
          auto x = random_vec(s.N * s.C * s.H * s.W, 60), w = random_vec(s.K * s.C * s.R * s.S, 61);
          auto b = random_vec(s.K, 62);
          // A sample of zeros: sums of signed zero products, without bias.
          std::fill(x.begin(), x.begin() + s.C * s.H * s.W, 0.0f);
          if (poison == 1) x[x.size() - 3] = std::numeric_limits<float>::quiet_NaN();
          if (poison == 2) w[1] = std::numeric_limits<float>::infinity();
          if (poison == 3 && with_bias) b[0] = std::numeric_limits<float>::quiet_NaN();
          if (poison == 4) {
            // The last image all 3e38 (finite); output channel 0's weights +-2 alternating
            // over its terms: products of 6e38 of both signs in each of its sums.
            std::fill(x.end() - s.C * s.H * s.W, x.end(), 3e38f);
            for (i64 i = 0; i < s.C * s.R * s.S; ++i) w[static_cast<std::size_t>(i)] = i % 2 == 0 ? 2.0f : -2.0f;
          }
          const float* bp = with_bias ? b.data() : nullptr;
          std::vector<float> y(s.N * s.K * s.P * s.Q, 7.0f), y_fused(y.size(), 7.0f);
          be().conv2d_forward(dev0(), s, x.data(), w.data(), bp, y.data());
          for (float& v : y) v = relu(v);
          be().conv2d_relu_forward(dev0(), s, x.data(), w.data(), bp, y_fused.data());
          CHECK(bitwise_equal(y, y_fused));
          if (poison == 1 || poison == 2 || (poison == 3 && with_bias))
            CHECK(std::any_of(y_fused.begin(), y_fused.end(), [](float v) { return std::isnan(v); }));
        }
      }
    }
  }
  be().set_conv_layout(cpu::ConvLayout::Auto);
}

TEST_CASE("conv2d_relu_maxpool2x2_forward: conv2d_relu_forward then the 2x2 max-pool, bit for bit") {
  // Note [Convolution, ReLU and max-pool in one pass]: groups of images are convolved
  // and pooled one after another; the pooled output and the winners' places must be
  // those of the two ops over the whole batch, for every layout, at one thread and at
  // all cores, with groups smaller than a chunk (64 images of 100 KB), an odd output
  // (its last row and column unpooled) and the poisons that keep a chunk unfused.
  const int hw = dp::hardware_concurrency();
  for (cpu::ConvLayout layout : {cpu::ConvLayout::Plain, cpu::ConvLayout::Blocked, cpu::ConvLayout::Auto}) {
    be().set_conv_layout(layout);
    for (const Conv2dShape& s : {conv_shape(64, 1, 28, 28, 32, 3, 3, 1, 1, 1, 1),   // CNN layer 1
                                 conv_shape(9, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1),   // CNN layer 2
                                 conv_shape(5, 3, 13, 11, 8, 3, 3, 1, 1, 1, 1)}) {  // odd P and Q
      for (int poison = 0; poison < 3; ++poison) {  // none, NaN in x, +inf in the bias
        for (int devices : {1, hw}) {
          CAPTURE(int(layout));
          CAPTURE(s.N);
          CAPTURE(s.C);
          CAPTURE(poison);
          CAPTURE(devices);
          auto x = random_vec(s.N * s.C * s.H * s.W, 63), w = random_vec(s.K * s.C * s.R * s.S, 64);
          auto b = random_vec(s.K, 65);
          if (poison == 1) x[x.size() / 2 + 5] = std::numeric_limits<float>::quiet_NaN();
          if (poison == 2) b[1] = std::numeric_limits<float>::infinity();
          const Pool2dShape ps{s.N, s.K, s.P, s.Q, 2, 2, 2, 2, 0, 0, s.P / 2, s.Q / 2};
          const std::size_t outputs = static_cast<std::size_t>(ps.N * ps.C * ps.P * ps.Q);
          std::vector<float> conv(static_cast<std::size_t>(s.N * s.K * s.P * s.Q)), y(outputs, 7.0f),
              y_fused(outputs, 7.0f);
          std::vector<std::uint8_t> where(outputs, 0xff), where_fused(outputs, 0xee);
          be().set_concurrent_devices(devices);
          be().conv2d_relu_forward(dev0(), s, x.data(), w.data(), b.data(), conv.data());
          be().maxpool2d_2x2_forward(dev0(), ps, conv.data(), y.data(), where.data());
          be().conv2d_relu_maxpool2x2_forward(dev0(), s, x.data(), w.data(), b.data(), y_fused.data(),
                                              where_fused.data());
          be().set_concurrent_devices(1);
          REQUIRE(bitwise_equal(y, y_fused));
          REQUIRE(where == where_fused);
          if (poison > 0) CHECK(std::any_of(y_fused.begin(), y_fused.end(), [](float v) { return !std::isfinite(v); }));
        }
      }
    }
  }
  be().set_conv_layout(cpu::ConvLayout::Auto);
  std::vector<float> buf(1024);
  std::vector<std::uint8_t> where(64);
  const Conv2dShape too_small = conv_shape(1, 1, 3, 3, 1, 3, 3, 1, 1, 0, 0);  // a 1x1 output
  CHECK_THROWS_WITH_AS(be().conv2d_relu_maxpool2x2_forward(dev0(), too_small, buf.data(), buf.data(), nullptr,
                                                           buf.data(), where.data()),
                       doctest::Contains("1x1"), dp::Error);
  // Another backend runs a Conv2d call's pool as the ops it fuses, with int64 winners
  // (Note [Fusions are the backend's]): the bytes are this backend's own.
  const Pool2dShape ok{1, 1, 4, 4, 2, 2, 2, 2, 0, 0, 2, 2};
  CHECK(be().max_pool2d_byte_winners(ok));
  CHECK_FALSE(dp::backend::get(dp::DeviceType::CUDA).max_pool2d_byte_winners(ok));
}

// ---- pooling --------------------------------------------------------------------------------------

namespace {
Pool2dShape pool_shape(i64 N, i64 C, i64 H, i64 W, i64 k, i64 st, i64 pad) {
  Pool2dShape s{N, C, H, W, k, k, st, st, pad, pad, 0, 0};
  s.P = (H + 2 * pad - k) / st + 1;
  s.Q = (W + 2 * pad - k) / st + 1;
  return s;
}
}  // namespace

TEST_CASE("max pooling with padding: forward, indices, ties, backward") {
  for (const Pool2dShape& s : {pool_shape(2, 3, 7, 9, 3, 2, 1), pool_shape(8, 32, 28, 28, 2, 2, 0),
                               pool_shape(1, 1, 5, 5, 2, 1, 1), pool_shape(2, 3, 7, 9, 2, 2, 0)}) {
    auto x = random_vec(s.N * s.C * s.H * s.W, 24, -1.0f, 0.0f);  // negative: padding must not win
    for (auto& v : x) v = std::round(v * 4.0f);                    // ties
    std::vector<float> y(s.N * s.C * s.P * s.Q);
    std::vector<i64> idx(y.size());
    be().maxpool2d_forward(dev0(), s, x.data(), y.data(), idx.data());
    auto gy = random_vec(y.size(), 25);
    std::vector<double> gx_ref(x.size());
    for (i64 pl = 0; pl < s.N * s.C; ++pl)
      for (i64 p = 0; p < s.P; ++p)
        for (i64 q = 0; q < s.Q; ++q) {
          float best = -INFINITY;
          i64 bi = -1;
          for (i64 r = 0; r < s.kernel_h; ++r)
            for (i64 t = 0; t < s.kernel_w; ++t) {
              const i64 h = p * s.stride_h - s.pad_h + r, w = q * s.stride_w - s.pad_w + t;
              if (h < 0 || h >= s.H || w < 0 || w >= s.W) continue;
              if (x[pl * s.H * s.W + h * s.W + w] > best) {
                best = x[pl * s.H * s.W + h * s.W + w];
                bi = h * s.W + w;
              }
            }
          const i64 o = (pl * s.P + p) * s.Q + q;
          REQUIRE(y[o] == best);
          REQUIRE(idx[o] == bi);
          gx_ref[pl * s.H * s.W + bi] += gy[o];
        }
    std::vector<float> gx(x.size(), 5.0f);
    be().maxpool2d_backward(dev0(), s, gy.data(), idx.data(), gx.data());
    check_close(gx, gx_ref, 1e-6, 1e-6, "maxpool backward");
  }
}

TEST_CASE("2x2 max-pool fast path: NaN, infinities, ties, odd sizes, ceil mode, foreign indices") {
  // Note [Branch-free 2x2 max-pool]: the vectorised path against a naive loop with the
  // same rule (first maximum in row-major order; a NaN wins and the first NaN stays),
  // for widths that exercise whole vectors, the overlapping last vector of a row (Q = 5,
  // 7, 9, 14) and rows narrower than a vector.
  const float inf = std::numeric_limits<float>::infinity();
  for (i64 W : {2, 5, 8, 9, 14, 16, 17, 28}) {
    for (i64 H : {2, 3, 6}) {
      for (bool ceil_mode : {false, true}) {
        Pool2dShape s = pool_shape(2, 3, H, W, 2, 2, 0);
        if (ceil_mode) {  // a last window hanging over the edge when H or W is odd
          s.P = (H + 1) / 2;
          s.Q = (W + 1) / 2;
        }
        CAPTURE(H);
        CAPTURE(W);
        CAPTURE(ceil_mode);
        auto x = pool_input(s.N * s.C * H * W, 40 + static_cast<unsigned>(W * 7 + H));
        std::vector<float> y(s.N * s.C * s.P * s.Q);
        std::vector<i64> idx(y.size());
        be().maxpool2d_forward(dev0(), s, x.data(), y.data(), idx.data());
        std::vector<float> y_noidx(y.size());
        be().maxpool2d_forward(dev0(), s, x.data(), y_noidx.data(), nullptr);
        auto gy = random_vec(y.size(), 41);
        std::vector<double> gx_ref(x.size());
        for (i64 pl = 0; pl < s.N * s.C; ++pl)
          for (i64 p = 0; p < s.P; ++p)
            for (i64 q = 0; q < s.Q; ++q) {
              float best = -inf;
              i64 bi = std::min(2 * p, H - 1) * W + std::min(2 * q, W - 1);
              for (i64 h = 2 * p; h < std::min(2 * p + 2, H); ++h)
                for (i64 w = 2 * q; w < std::min(2 * q + 2, W); ++w) {
                  const float v = x[pl * H * W + h * W + w];
                  if (v > best || (std::isnan(v) && !std::isnan(best))) {
                    best = v;
                    bi = h * W + w;
                  }
                }
              const i64 o = (pl * s.P + p) * s.Q + q;
              REQUIRE(std::memcmp(&y[o], &best, sizeof best) == 0);
              REQUIRE(std::memcmp(&y_noidx[o], &best, sizeof best) == 0);
              REQUIRE(idx[o] == bi);
              gx_ref[pl * H * W + bi] += gy[o];
            }
        std::vector<float> gx(x.size(), 5.0f);  // every element is overwritten
        be().maxpool2d_backward(dev0(), s, gy.data(), idx.data(), gx.data());
        check_close(gx, gx_ref, 0, 0, "maxpool 2x2 backward");
        if (ceil_mode) continue;
        // Indices outside their own window (not from maxpool2d_forward, but valid plane
        // positions) take the general scatter and still land where they point.
        idx[0] = H * W - 1;
        std::vector<double> gx_ref2(x.size());
        for (i64 o = 0; o < static_cast<i64>(idx.size()); ++o)
          gx_ref2[(o / (s.P * s.Q)) * H * W + idx[o]] += gy[o];
        be().maxpool2d_backward(dev0(), s, gy.data(), idx.data(), gx.data());
        check_close(gx, gx_ref2, 1e-6, 1e-6, "maxpool 2x2 backward, foreign index");
      }
    }
  }
}

TEST_CASE("2x2 max-pool with byte places: the int64 path's output and gradient bit for bit; other shapes throw") {
  // Note [Max-pool winners in a byte]: place k of a window is flat index
  // row0 + 2q + (k / 2) * W + k % 2; y and gx equal maxpool2d_forward/backward's, for
  // whole vectors, the overlapping last vector and rows narrower than a vector, with
  // NaN, infinities and ties, at one thread and at all cores.
  const int hw = dp::hardware_concurrency();
  for (i64 W : {2, 3, 5, 8, 9, 14, 16, 17, 28}) {
    for (i64 H : {2, 3, 6, 14}) {
      for (int devices : {1, hw}) {
        const Pool2dShape s = pool_shape(3, 5, H, W, 2, 2, 0);
        CAPTURE(H);
        CAPTURE(W);
        CAPTURE(devices);
        auto x = pool_input(s.N * s.C * H * W, 50 + static_cast<unsigned>(W * 7 + H));
        const std::size_t outputs = static_cast<std::size_t>(s.N * s.C * s.P * s.Q);
        std::vector<float> y(outputs, 7.0f), y_bytes(outputs, 7.0f);
        std::vector<i64> idx(outputs);
        std::vector<std::uint8_t> where(outputs, 0xff);
        auto gy = random_vec(static_cast<i64>(outputs), 51);
        if (outputs > 2) gy[1] = std::numeric_limits<float>::quiet_NaN();  // a NaN gradient, masked or not
        std::vector<float> gx(x.size(), 7.0f), gx_bytes(x.size(), 7.0f), gx_masked(x.size(), 7.0f);
        be().set_concurrent_devices(devices);
        be().maxpool2d_forward(dev0(), s, x.data(), y.data(), idx.data());
        be().maxpool2d_2x2_forward(dev0(), s, x.data(), y_bytes.data(), where.data());
        be().maxpool2d_backward(dev0(), s, gy.data(), idx.data(), gx.data());
        be().maxpool2d_2x2_backward(dev0(), s, gy.data(), where.data(), nullptr, gx_bytes.data());
        // With a ReLU's mask (the pool's outputs hold negatives, zeros, NaN and
        // infinities): the binary ReluBackward, then the unmasked backward.
        be().maxpool2d_2x2_backward(dev0(), s, gy.data(), where.data(), y_bytes.data(), gx_masked.data());
        be().set_concurrent_devices(1);
        REQUIRE(bitwise_equal(y, y_bytes));
        REQUIRE(bitwise_equal(gx, gx_bytes));
        std::vector<float> gy_masked(outputs), gx_want(x.size(), 7.0f);
        Indexer flat;
        flat.ndim = 1;
        flat.sizes[0] = static_cast<i64>(outputs);
        flat.strides_a[0] = flat.strides_b[0] = 1;
        be().run<Op::Binary>(dev0(), DType::F32,
                             {BinaryOp::ReluBackward, flat, gy.data(), y_bytes.data(), gy_masked.data()});
        be().maxpool2d_2x2_backward(dev0(), s, gy_masked.data(), where.data(), nullptr, gx_want.data());
        REQUIRE(bitwise_equal(gx_masked, gx_want));
        REQUIRE(std::count_if(y_bytes.begin(), y_bytes.end(), [](float v) { return !(v > 0.0f); }) > 0);
        for (i64 o = 0; o < static_cast<i64>(outputs); ++o) {
          const i64 q = o % s.Q, p = (o / s.Q) % s.P;
          const std::uint8_t k = where[static_cast<std::size_t>(o)];
          REQUIRE(k < 4);
          REQUIRE(idx[static_cast<std::size_t>(o)] == 2 * p * W + 2 * q + (k / 2) * W + k % 2);
        }
      }
    }
  }
  std::vector<float> buf(64);
  std::vector<std::uint8_t> where(64);
  Pool2dShape padded = pool_shape(1, 1, 6, 6, 2, 2, 1);
  CHECK_THROWS_WITH_AS(be().maxpool2d_2x2_forward(dev0(), padded, buf.data(), buf.data(), where.data()),
                       doctest::Contains("padding 1x1"), dp::Error);
  Pool2dShape three = pool_shape(1, 1, 6, 6, 3, 3, 0);
  CHECK_THROWS_WITH_AS(be().maxpool2d_2x2_backward(dev0(), three, buf.data(), where.data(), nullptr, buf.data()),
                       doctest::Contains("kernel 3x3"), dp::Error);
  Pool2dShape ceil_mode = pool_shape(1, 1, 5, 5, 2, 2, 0);
  ceil_mode.P = ceil_mode.Q = 3;  // a last window hanging over the edge
  CHECK_THROWS_AS(be().maxpool2d_2x2_forward(dev0(), ceil_mode, buf.data(), buf.data(), where.data()), dp::Error);
  // Another backend keeps int64 winners (Note [Max-pool winners]).
  const Pool2dShape ok = pool_shape(1, 1, 4, 4, 2, 2, 0);
  CHECK(be().max_pool2d_byte_winners(ok));
  CHECK_FALSE(dp::backend::get(dp::DeviceType::CUDA).max_pool2d_byte_winners(ok));
}

TEST_CASE("2x2 max-pool in AVX-512: the portable loops' outputs, places and gradients bit for bit") {
  // Note [float32 max-pool in AVX-512]: both paths on the same planes, switched by
  // set_pool_avx512, for every width 1..40 (rows of 0..20 windows: none, a partial
  // vector, a whole one and one and a partial), odd and even heights, inputs drawn from
  // a few values (ties, -0 against +0) and NaNs of several payloads and signs, and
  // gradients and ReLU masks with NaN, -0 and infinities.
  const bool was = cpu::set_pool_avx512(true);
  if (!cpu::pool_avx512()) MESSAGE("no AVX-512 on this CPU: both runs take the portable loops");
  auto from_bits = [](std::uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float values[] = {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 2.0f, inf, -inf,
                          from_bits(0x7FC00000u), from_bits(0xFFC00000u), from_bits(0x7FC12345u),
                          from_bits(0xFF800001u), from_bits(0x00000001u), from_bits(0x80000001u)};
  std::mt19937 gen(2024);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(std::size(values)) - 1);
  std::uniform_int_distribution<int> common(0, 5);  // the numbers, most of the time
  auto draw = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = gen() % 4 == 0 ? values[pick(gen)] : values[common(gen)];
    return v;
  };
  for (i64 W = 1; W <= 40; ++W) {
    for (i64 H : {2, 3, 4, 7}) {
      CAPTURE(W);
      CAPTURE(H);
      Pool2dShape s = pool_shape(2, 3, H, W, 2, 2, 0);
      s.Q = W / 2;  // no window where W is 1
      const std::size_t nx = static_cast<std::size_t>(s.N * s.C * H * W);
      const std::size_t ny = static_cast<std::size_t>(s.N * s.C * s.P * s.Q);
      const auto x = draw(nx), gy = draw(ny), ry = draw(ny);
      std::vector<float> y[2], gx[2], gx_pool_mask[2], gx_mask[2];
      std::vector<std::uint8_t> where[2];
      for (int avx512 : {0, 1}) {
        cpu::set_pool_avx512(avx512 == 1);
        y[avx512].assign(ny, 7.0f);
        where[avx512].assign(ny, 0xee);
        // 7.0 is no value either path writes: every element must be written.
        gx[avx512].assign(nx, 7.0f);
        gx_pool_mask[avx512].assign(nx, 7.0f);
        gx_mask[avx512].assign(nx, 7.0f);
        be().maxpool2d_2x2_forward(dev0(), s, x.data(), y[avx512].data(), where[avx512].data());
        be().maxpool2d_2x2_backward(dev0(), s, gy.data(), where[avx512].data(), nullptr, gx[avx512].data());
        // The pool's own output as the mask (MaxPool2d after a ReLU), and one with NaN,
        // -0 and infinities in other places.
        be().maxpool2d_2x2_backward(dev0(), s, gy.data(), where[avx512].data(), y[avx512].data(),
                                    gx_pool_mask[avx512].data());
        be().maxpool2d_2x2_backward(dev0(), s, gy.data(), where[avx512].data(), ry.data(), gx_mask[avx512].data());
      }
      CHECK(bitwise_equal(y[1], y[0]));
      CHECK(where[1] == where[0]);
      CHECK(bitwise_equal(gx[1], gx[0]));
      CHECK(bitwise_equal(gx_pool_mask[1], gx_pool_mask[0]));
      CHECK(bitwise_equal(gx_mask[1], gx_mask[0]));
    }
  }
  cpu::set_pool_avx512(was);
}

TEST_CASE("MaxPool2d's kernels with the ReLU mask and a convolution's pool: the ops they fuse, bit for bit") {
  // Note [Fusions are the backend's]: MaxPool2dBackward with relu_y equals
  // max_pool2d_backward_by_ops (the mask, then the backward), and a Conv2d call with a
  // pool equals conv2d_pool_by_ops, for byte and int64 winners.
  for (const Pool2dShape& s : {pool_shape(3, 5, 14, 9, 2, 2, 0), pool_shape(2, 3, 7, 9, 3, 2, 1)}) {
    CAPTURE(s.kernel_h);
    const std::size_t outputs = static_cast<std::size_t>(s.N * s.C * s.P * s.Q);
    const std::size_t nwin = static_cast<std::size_t>(dp::backend::max_pool2d_winner_bytes(be(), s));
    CHECK(nwin == (s.kernel_h == 2 ? outputs : 8 * outputs));
    auto x = pool_input(s.N * s.C * s.H * s.W, 70);
    std::vector<float> y(outputs), gx(x.size(), 7.0f), gx_ops(x.size(), 7.0f);
    std::vector<std::uint8_t> winners(nwin, 0xee);
    auto gy = random_vec(static_cast<i64>(outputs), 71);
    be().run<Op::MaxPool2d>(dev0(), DType::F32, {s, x.data(), y.data(), winners.data()});
    const dp::backend::MaxPool2dBackwardArgs a{s, gy.data(), winners.data(), y.data(), gx.data()};
    be().run<Op::MaxPool2dBackward>(dev0(), DType::F32, a);
    dp::backend::MaxPool2dBackwardArgs by_ops = a;
    by_ops.gx = gx_ops.data();
    be().max_pool2d_backward_by_ops(dev0(), DType::F32, by_ops);
    REQUIRE(bitwise_equal(gx, gx_ops));
  }
  const Conv2dShape c = conv_shape(5, 3, 13, 11, 8, 3, 3, 1, 1, 1, 1);
  for (const Pool2dShape& ps : {Pool2dShape{c.N, c.K, c.P, c.Q, 2, 2, 2, 2, 0, 0, c.P / 2, c.Q / 2},
                                pool_shape(c.N, c.K, c.P, c.Q, 3, 2, 1)}) {
    CAPTURE(ps.kernel_h);
    auto x = random_vec(c.N * c.C * c.H * c.W, 72), w = random_vec(c.K * c.C * c.R * c.S, 73), b = random_vec(c.K, 74);
    const std::size_t outputs = static_cast<std::size_t>(ps.N * ps.C * ps.P * ps.Q);
    const std::size_t nwin = static_cast<std::size_t>(dp::backend::max_pool2d_winner_bytes(be(), ps));
    std::vector<float> y(outputs, 7.0f), y_ops(outputs, 5.0f);
    std::vector<std::uint8_t> winners(nwin, 0xee), winners_ops(nwin, 0xdd);
    dp::backend::Conv2dArgs a{c, x.data(), w.data(), b.data(), y.data(), true,
                              dp::backend::ConvPool{.on = true, .s = ps, .winners = winners.data()}};
    be().run<Op::Conv2d>(dev0(), DType::F32, a);
    a.y = y_ops.data();
    a.pool.winners = winners_ops.data();
    be().conv2d_pool_by_ops(dev0(), DType::F32, a);
    REQUIRE(bitwise_equal(y, y_ops));
    REQUIRE(winners == winners_ops);
  }
}

TEST_CASE("bfloat16 and float16 max-pool kernels: the float32 kernels on the widened values, rounded") {
  // Note [16-bit max-pool], with NaN, infinities, -0 and ties in x, gy and the mask.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (DType dt : {DType::BF16, DType::F16}) {
    // Widths of 3, 5, 14, 17 and 66 windows: rows narrower than a vector, whole vectors
    // and an overlapping last one, and rows of several vectors and a remainder.
    for (const Pool2dShape& s : {pool_shape(2, 3, 5, 7, 2, 2, 0), pool_shape(3, 5, 9, 11, 2, 2, 0),
                                 pool_shape(2, 3, 6, 28, 2, 2, 0), pool_shape(1, 2, 5, 35, 2, 2, 0),
                                 pool_shape(1, 2, 4, 132, 2, 2, 0), pool_shape(2, 3, 7, 9, 3, 2, 1)}) {
      for (bool masked : {false, true}) {
        CAPTURE(int(dt));
        CAPTURE(s.kernel_h);
        CAPTURE(masked);
        const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P * s.Q;
        auto round16 = [dt](std::vector<float> v) {  // values the dtype holds, and their bits
          std::vector<std::uint16_t> bits(v.size());
          for (std::size_t i = 0; i < v.size(); ++i)
            bits[i] = dt == DType::BF16 ? dp::BFloat16(v[i]).bits : dp::Float16(v[i]).bits;
          return bits;
        };
        auto widen16 = [dt](const std::vector<std::uint16_t>& b) {
          std::vector<float> v(b.size());
          for (std::size_t i = 0; i < b.size(); ++i)
            v[i] = dt == DType::BF16 ? float(dp::BFloat16::from_bits(b[i])) : dp::Float16::to_float(b[i]);
          return v;
        };
        std::vector<float> xv = pool_input(nx, 80), gv = random_vec(ny, 81), rv = random_vec(ny, 82);
        gv[1] = nan;
        gv[2] = -0.0f;
        rv[3] = nan;
        rv[4] = -0.0f;
        rv[5] = inf;
        rv[6] = -inf;
        rv[8] = 0.0f;
        auto x16 = round16(xv), g16 = round16(gv), r16 = round16(rv);
        // NaNs of other bits than rounding makes (a kernel's output may hold them):
        // rounding the widened winner or gradient makes them the dtype's NaN.
        const std::uint16_t other_nan = dt == DType::BF16 ? 0x7FC1 : 0x7E01;
        x16[5] = x16[22] = g16[3] = r16[7] = other_nan;
        const auto xf = widen16(x16), gf = widen16(g16), rf = widen16(r16);
        const std::size_t nwin = static_cast<std::size_t>(dp::backend::max_pool2d_winner_bytes(be(), s));
        std::vector<std::uint8_t> w16(nwin, 0xee), wf(nwin, 0xdd);
        // gx16 starts with bits no kernel writes: every element must be written.
        std::vector<std::uint16_t> y16(static_cast<std::size_t>(ny)), gx16(static_cast<std::size_t>(nx), 0x7777);
        std::vector<float> yf(static_cast<std::size_t>(ny)), gxf(static_cast<std::size_t>(nx));
        be().run<Op::MaxPool2d>(dev0(), dt, {s, x16.data(), y16.data(), w16.data()});
        be().run<Op::MaxPool2d>(dev0(), DType::F32, {s, xf.data(), yf.data(), wf.data()});
        be().run<Op::MaxPool2dBackward>(dev0(), dt, {s, g16.data(), w16.data(), masked ? r16.data() : nullptr, gx16.data()});
        be().run<Op::MaxPool2dBackward>(dev0(), DType::F32,
                                        {s, gf.data(), wf.data(), masked ? rf.data() : nullptr, gxf.data()});
        CHECK(w16 == wf);
        CHECK(y16 == round16(yf));
        CHECK(gx16 == round16(gxf));
      }
    }
  }
}

TEST_CASE("bfloat16 2x2 max-pool with a ReLU on load: the ReLU's bits, then the pool") {
  // Note [bfloat16 max-pool on its bits]: the one-pass convolution's pool applies the
  // ReLU (a negative number +0, a NaN 0xFFFF, -0 kept) as it loads each input.
  for (const Pool2dShape& s : {pool_shape(2, 3, 5, 7, 2, 2, 0), pool_shape(3, 5, 9, 11, 2, 2, 0),
                               pool_shape(2, 3, 6, 28, 2, 2, 0), pool_shape(1, 2, 4, 132, 2, 2, 0)}) {
    CAPTURE(s.W);
    const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P * s.Q;
    std::vector<dp::BFloat16> x(static_cast<std::size_t>(nx)), relu_x(x.size());
    const std::vector<float> v = pool_input(nx, 90);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = dp::BFloat16(v[i]);
    x[1] = dp::BFloat16::from_bits(0x8000);  // -0
    x[2] = dp::BFloat16::from_bits(0x8001);  // the negative subnormal nearest 0
    x[9] = dp::BFloat16::from_bits(0x7FC1);  // a NaN rounding would not make
    x[10] = dp::BFloat16::from_bits(0xFFC1);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const std::uint16_t b = x[i].bits, mag = b & 0x7FFF;
      relu_x[i] = dp::BFloat16::from_bits(mag > 0x7F80 ? 0xFFFF : (b & 0x8000) && mag != 0 ? 0 : b);
    }
    std::vector<dp::BFloat16> y(static_cast<std::size_t>(ny)), y_want(y.size());
    std::vector<std::uint8_t> where(y.size(), 0xee), where_want(y.size(), 0xdd);
    cpu::maxpool_2x2_planes(s, x.data(), y.data(), where.data(), 0, s.N * s.C, /*relu=*/true);
    cpu::maxpool_2x2_planes(s, relu_x.data(), y_want.data(), where_want.data(), 0, s.N * s.C);
    CHECK(where == where_want);
    bool same = true;
    for (std::size_t i = 0; i < y.size(); ++i) same &= y[i].bits == y_want[i].bits;
    CHECK(same);
  }
}

TEST_CASE("average pooling counting padding: forward and backward") {
  for (const Pool2dShape& s : {pool_shape(2, 3, 7, 9, 3, 2, 1), pool_shape(4, 16, 14, 14, 2, 2, 0)}) {
    auto x = random_vec(s.N * s.C * s.H * s.W, 26);
    auto gy = random_vec(s.N * s.C * s.P * s.Q, 27);
    std::vector<double> y_ref(gy.size()), gx_ref(x.size());
    const double div = double(s.kernel_h * s.kernel_w);
    for (i64 pl = 0; pl < s.N * s.C; ++pl)
      for (i64 p = 0; p < s.P; ++p)
        for (i64 q = 0; q < s.Q; ++q) {
          const i64 o = (pl * s.P + p) * s.Q + q;
          for (i64 r = 0; r < s.kernel_h; ++r)
            for (i64 t = 0; t < s.kernel_w; ++t) {
              const i64 h = p * s.stride_h - s.pad_h + r, w = q * s.stride_w - s.pad_w + t;
              if (h < 0 || h >= s.H || w < 0 || w >= s.W) continue;
              y_ref[o] += x[pl * s.H * s.W + h * s.W + w] / div;
              gx_ref[pl * s.H * s.W + h * s.W + w] += gy[o] / div;
            }
        }
    std::vector<float> y(gy.size()), gx(x.size(), 3.0f);
    be().avgpool2d_forward(dev0(), s, x.data(), y.data());
    be().avgpool2d_backward(dev0(), s, gy.data(), gx.data());
    check_close(y, y_ref, 1e-5, 1e-6, "avgpool forward");
    check_close(gx, gx_ref, 1e-5, 1e-6, "avgpool backward");
  }
}

// ---- batch norm ------------------------------------------------------------------------------------

TEST_CASE("batchnorm train / eval / backward against double references") {
  const i64 N = 16, C = 5, HW = 49, M = N * HW;
  auto x = random_vec(N * C * HW, 28, 1.0f, 3.0f);  // mean far from 0
  auto gamma = random_vec(C, 29, 0.5f, 1.5f), beta = random_vec(C, 30);
  auto gy = random_vec(x.size(), 31);
  std::vector<float> rm(C, 0.1f), rv(C, 2.0f), y(x.size()), mean(C), invstd(C);
  const float eps = 1e-5f, mom = 0.1f;
  be().batchnorm_forward_train(dev0(), N, C, HW, x.data(), gamma.data(), beta.data(), eps, mom,
                               rm.data(), rv.data(), y.data(), mean.data(), invstd.data());
  std::vector<double> y_ref(x.size()), gx_ref(x.size()), mean_ref(C), invstd_ref(C), rm_ref(C),
      rv_ref(C), gg_ref(C), gb_ref(C);
  for (i64 c = 0; c < C; ++c) {
    double s = 0, sq = 0;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) s += x[(n * C + c) * HW + i];
    const double mu = s / M;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) sq += std::pow(x[(n * C + c) * HW + i] - mu, 2);
    const double var = sq / M, is = 1 / std::sqrt(var + eps);
    mean_ref[c] = mu;
    invstd_ref[c] = is;
    rm_ref[c] = 0.9 * 0.1 + 0.1 * mu;
    rv_ref[c] = 0.9 * 2.0 + 0.1 * sq / (M - 1);
    double sg = 0, sgx = 0;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) {
        const i64 j = (n * C + c) * HW + i;
        const double xh = (x[j] - mu) * is;
        y_ref[j] = gamma[c] * xh + beta[c];
        sg += gy[j];
        sgx += gy[j] * xh;
      }
    gb_ref[c] = sg;
    gg_ref[c] = sgx;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) {
        const i64 j = (n * C + c) * HW + i;
        const double xh = (x[j] - mu) * is;
        gx_ref[j] = gamma[c] * is * (gy[j] - sg / M - xh * sgx / M);
      }
  }
  check_close(y, y_ref, 1e-5, 1e-5, "bn train y");
  check_close(mean, mean_ref, 1e-6, 0, "bn save_mean");
  check_close(invstd, invstd_ref, 1e-6, 0, "bn save_invstd");
  check_close(rm, rm_ref, 1e-6, 0, "bn running_mean");
  check_close(rv, rv_ref, 1e-6, 0, "bn running_var");

  std::vector<float> gx(x.size()), gg(C), gb(C);
  be().batchnorm_backward(dev0(), N, C, HW, gy.data(), x.data(), gamma.data(), mean.data(),
                          invstd.data(), gx.data(), gg.data(), gb.data());
  check_close(gx, gx_ref, 1e-4, 1e-5, "bn backward gx");
  check_close(gg, gg_ref, 1e-4, 1e-4, "bn backward ggamma");
  check_close(gb, gb_ref, 1e-5, 1e-4, "bn backward gbeta");

  std::vector<float> ye(x.size());
  be().batchnorm_forward_eval(dev0(), N, C, HW, x.data(), gamma.data(), beta.data(), eps, rm.data(),
                              rv.data(), ye.data());
  std::vector<double> ye_ref(x.size());
  for (i64 n = 0; n < N; ++n)
    for (i64 c = 0; c < C; ++c)
      for (i64 i = 0; i < HW; ++i) {
        const i64 j = (n * C + c) * HW + i;
        ye_ref[j] = gamma[c] * (x[j] - double(rm[c])) / std::sqrt(double(rv[c]) + eps) + beta[c];
      }
  check_close(ye, ye_ref, 1e-5, 1e-5, "bn eval");
}

TEST_CASE("channels-last batchnorm: the CPU's kernels and the N*HW-images reading agree with double references") {
  // Note [Channels-last batch norm]: the CPU's own kernels, and as_nchw_rows (what the
  // method kernels run), on the same N x HW x C bytes, every pass against double.
  const i64 N = 6, C = 12, HW = 35, M = N * HW;
  auto x = random_vec(N * C * HW, 40, 1.0f, 3.0f);  // laid out N x HW x C
  auto gamma = random_vec(C, 41, 0.5f, 1.5f), beta = random_vec(C, 42), gy = random_vec(x.size(), 43);
  const float eps = 1e-5f, mom = 0.1f;
  auto at = [&](i64 n, i64 c, i64 i) { return static_cast<std::size_t>((n * HW + i) * C + c); };
  std::vector<double> y_ref(x.size()), gx_ref(x.size()), ye_ref(x.size()), gg_ref(C), gb_ref(C), rm_ref(C), rv_ref(C);
  for (i64 c = 0; c < C; ++c) {
    double s = 0, sq = 0, sg = 0, sgx = 0;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) s += x[at(n, c, i)];
    const double mu = s / M;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) sq += std::pow(x[at(n, c, i)] - mu, 2);
    const double is = 1 / std::sqrt(sq / M + eps);
    rm_ref[c] = 0.9 * 0.1 + 0.1 * mu;
    rv_ref[c] = 0.9 * 2.0 + 0.1 * sq / (M - 1);
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) {
        const double xh = (x[at(n, c, i)] - mu) * is;
        y_ref[at(n, c, i)] = gamma[c] * xh + beta[c];
        sg += gy[at(n, c, i)];
        sgx += gy[at(n, c, i)] * xh;
      }
    gb_ref[c] = sg;
    gg_ref[c] = sgx;
    for (i64 n = 0; n < N; ++n)
      for (i64 i = 0; i < HW; ++i) {
        const double xh = (x[at(n, c, i)] - mu) * is;
        gx_ref[at(n, c, i)] = gamma[c] * is * (gy[at(n, c, i)] - sg / M - xh * sgx / M);
        ye_ref[at(n, c, i)] = gamma[c] * (x[at(n, c, i)] - rm_ref[c]) / std::sqrt(rv_ref[c] + eps) + beta[c];
      }
  }
  const auto table = method_kernels<CpuBackend>();
  auto method = [&](Op op) {
    for (const MethodKernel& k : table)
      if (k.op == op) return k.fn;
    FAIL("no method kernel for ", op_name(op));
    return Backend::KernelFn{};
  };
  for (bool own : {true, false}) {
    CAPTURE(own);
    auto call = [&](Op op, const void* args) {  // the CPU's own kernel, or the method kernel's N*HW reading
      if (own) {
        be().launch(op, DType::F32, dev0(), args);
      } else {
        method(op)(be(), dev0(), DType::F32, args);
      }
    };
    std::vector<float> rm(C, 0.1f), rv(C, 2.0f), y(x.size()), mean(C), invstd(C);
    const BatchNormTrainArgs train{N, C, HW, x.data(), gamma.data(), beta.data(), eps, mom, rm.data(), rv.data(),
                                   y.data(), mean.data(), invstd.data(), true};
    call(Op::BatchNormTrain, &train);
    check_close(y, y_ref, 1e-5, 1e-5, "channels-last bn train y");
    check_close(rm, rm_ref, 1e-6, 0, "channels-last bn running_mean");
    check_close(rv, rv_ref, 1e-6, 0, "channels-last bn running_var");
    std::vector<float> gx(x.size()), gg(C), gb(C);
    const BatchNormBackwardArgs backward{N, C, HW, gy.data(), x.data(), gamma.data(), mean.data(), invstd.data(),
                                         gx.data(), gg.data(), gb.data(), true};
    call(Op::BatchNormBackward, &backward);
    check_close(gx, gx_ref, 1e-4, 1e-5, "channels-last bn backward gx");
    check_close(gg, gg_ref, 1e-4, 1e-4, "channels-last bn backward ggamma");
    check_close(gb, gb_ref, 1e-5, 1e-4, "channels-last bn backward gbeta");
    std::vector<float> ye(x.size());
    const BatchNormEvalArgs eval{N, C, HW, x.data(), gamma.data(), beta.data(), eps, rm.data(), rv.data(), ye.data(),
                                 true};
    call(Op::BatchNormEval, &eval);
    check_close(ye, ye_ref, 1e-5, 1e-5, "channels-last bn eval");
  }
}

// ---- softmax and NLL --------------------------------------------------------------------------------

TEST_CASE("log_softmax forward/backward and nll") {
  for (i64 cols : {1, 10, 1001}) {
    const i64 rows = 67;
    auto x = random_vec(rows * cols, 32, -20.0f, 20.0f);
    auto gy = random_vec(rows * cols, 33);
    std::vector<float> y(x.size()), gx(x.size());
    be().log_softmax(dev0(), x.data(), y.data(), rows, cols);
    be().log_softmax_backward(dev0(), gy.data(), y.data(), gx.data(), rows, cols);
    std::vector<double> y_ref(x.size()), gx_ref(x.size());
    for (i64 r = 0; r < rows; ++r) {
      double mx = -INFINITY, s = 0, sg = 0;
      for (i64 j = 0; j < cols; ++j) mx = std::max(mx, double(x[r * cols + j]));
      for (i64 j = 0; j < cols; ++j) s += std::exp(x[r * cols + j] - mx);
      for (i64 j = 0; j < cols; ++j) {
        y_ref[r * cols + j] = x[r * cols + j] - mx - std::log(s);
        sg += gy[r * cols + j];
      }
      for (i64 j = 0; j < cols; ++j)
        gx_ref[r * cols + j] = gy[r * cols + j] - std::exp(y_ref[r * cols + j]) * sg;
    }
    check_close(y, y_ref, 1e-5, 1e-5, "log_softmax");
    check_close(gx, gx_ref, 1e-4, 1e-5, "log_softmax backward");

    std::vector<i64> target(rows);
    for (i64 r = 0; r < rows; ++r) target[r] = (r * 7) % cols;
    std::vector<float> loss(rows), gloss = random_vec(rows, 34), gxn(x.size(), 4.0f);
    be().nll_forward(dev0(), y.data(), target.data(), loss.data(), rows, cols);
    be().nll_backward(dev0(), gloss.data(), target.data(), gxn.data(), rows, cols);
    for (i64 r = 0; r < rows; ++r) {
      REQUIRE(loss[r] == -y[r * cols + target[r]]);
      for (i64 j = 0; j < cols; ++j)
        REQUIRE(gxn[r * cols + j] == (j == target[r] ? -gloss[r] : 0.0f));
    }
    // ignore_index: a class in range and PyTorch's -100 out of range, on every other row.
    for (const i64 ignore : {i64{1} % cols, i64{-100}}) {
      std::vector<i64> t2 = target;
      for (i64 r = 0; r < rows; r += 2) t2[r] = ignore;
      std::fill(gxn.begin(), gxn.end(), 4.0f);
      be().nll_forward(dev0(), y.data(), t2.data(), loss.data(), rows, cols, ignore);
      be().nll_backward(dev0(), gloss.data(), t2.data(), gxn.data(), rows, cols, ignore);
      for (i64 r = 0; r < rows; ++r) {
        const bool skip = t2[r] == ignore;
        REQUIRE(loss[r] == (skip ? 0.0f : -y[r * cols + t2[r]]));
        for (i64 j = 0; j < cols; ++j)
          REQUIRE(gxn[r * cols + j] == (!skip && j == t2[r] ? -gloss[r] : 0.0f));
      }
    }
  }
}

TEST_CASE("nll with a target out of range throws naming the row and value") {
  const std::vector<float> logp(3 * 4, -1.0f);
  std::vector<float> loss(3);
  for (i64 bad : {4, -1}) {
    const std::vector<i64> target = {0, bad, 2};
    try {
      be().nll_forward(dev0(), logp.data(), target.data(), loss.data(), 3, 4);
      FAIL("expected dp::Error");
    } catch (const dp::Error& e) {
      const std::string msg = e.what();
      CHECK(msg.find("target[1] = " + std::to_string(bad)) != std::string::npos);
      CHECK(msg.find("[0, 4)") != std::string::npos);
    }
    std::vector<float> gx(12);
    CHECK_THROWS_AS(be().nll_backward(dev0(), loss.data(), target.data(), gx.data(), 3, 4), dp::Error);
    // Another ignore_index does not excuse it.
    CHECK_THROWS_AS(be().nll_forward(dev0(), logp.data(), target.data(), loss.data(), 3, 4, bad + 1), dp::Error);
    CHECK_NOTHROW(be().nll_forward(dev0(), logp.data(), target.data(), loss.data(), 3, 4, bad));
  }
}

// ---- optimizers -----------------------------------------------------------------------------

TEST_CASE("sgd: the vectorised loops equal the shared functor bit for bit, every flag combination") {
  // Note [Vectorised optimizer loops]: 16 instantiations against SgdUpdate applied one
  // element at a time, over a length with a vector body, a remainder, and (at 2^17) a
  // parallel split; NaN and infinities included.
  for (i64 n : {i64{1037}, i64{1} << 17}) {
    auto p0 = random_vec(n, 70), g = random_vec(n, 71), m0 = random_vec(n, 72);
    p0[5] = std::numeric_limits<float>::quiet_NaN();
    g[7] = std::numeric_limits<float>::infinity();
    for (float momentum : {0.0f, 0.9f})
      for (float wd : {0.0f, 0.01f})
        for (bool nesterov : {false, true})
          for (bool first : {false, true}) {
            CAPTURE(n);
            CAPTURE(momentum);
            CAPTURE(wd);
            CAPTURE(nesterov);
            CAPTURE(first);
            std::vector<float> p = p0, m = m0, pw = p0, mw = m0;
            be().sgd_step(dev0(), p.data(), g.data(), momentum != 0 ? m.data() : nullptr, n, 0.05f,
                          momentum, 0.1f, wd, nesterov, first);
            const SgdUpdate upd{make_sgd_params(0.05f, momentum, 0.1f, wd, nesterov, first)};
            for (i64 i = 0; i < n; ++i) upd(pw[i], g[i], momentum != 0 ? &mw[i] : nullptr);
            CHECK(bitwise_equal(p, pw));
            CHECK(bitwise_equal(m, mw));  // untouched without momentum
          }
  }
}

TEST_CASE("adam: the vectorised loops equal the shared functor bit for bit, every flag combination") {
  // Note [Vectorised optimizer loops]: Adam, AdamW and Adam with weight decay, several
  // steps (bias corrections) and beta1 on both sides of lerp's 0.5 switch, against
  // AdamUpdate applied one element at a time; sizes around the vector width and above
  // the parallel grain, a NaN and infinities included.
  for (i64 n : {i64{1}, i64{7}, i64{33}, i64{70001}}) {
    const auto p0 = random_vec(n, 80, -2.0f, 2.0f), m0 = random_vec(n, 81), v0 = random_vec(n, 82, 0.0f, 1.0f);
    auto g = random_vec(n, 83);
    if (n > 7) {
      g[3] = std::numeric_limits<float>::quiet_NaN();
      g[5] = std::numeric_limits<float>::infinity();
      g[6] = -std::numeric_limits<float>::infinity();
    }
    for (bool decoupled : {false, true})
      for (float wd : {0.0f, 0.01f})
        for (float beta1 : {0.9f, 0.3f})
          for (i64 step : {i64{1}, i64{2}, i64{1000}}) {
            CAPTURE(n);
            CAPTURE(decoupled);
            CAPTURE(wd);
            CAPTURE(beta1);
            CAPTURE(step);
            std::vector<float> p = p0, m = m0, v = v0, pw = p0, mw = m0, vw = v0;
            be().adam_step(dev0(), p.data(), g.data(), m.data(), v.data(), n, 1e-3f, beta1, 0.999f, 1e-8f,
                           wd, decoupled, step);
            const AdamUpdate upd{make_adam_params(1e-3f, beta1, 0.999f, 1e-8f, wd, decoupled, step)};
            for (i64 i = 0; i < n; ++i) upd(pw[i], g[i], mw[i], vw[i]);
            CHECK(bitwise_equal(p, pw));
            CHECK(bitwise_equal(m, mw));
            CHECK(bitwise_equal(v, vw));
          }
  }
}

TEST_CASE("sgd: hand-computed values for momentum, nesterov, dampening, weight decay") {
  // p = 1, constant grad 0.5, lr = 0.1; values worked out by hand from torch.optim.SGD.
  auto run = [](float momentum, float dampening, float wd, bool nesterov, int steps) {
    float p = 1.0f, g = 0.5f, buf = 0.0f;
    for (int s = 0; s < steps; ++s)
      be().sgd_step(dev0(), &p, &g, momentum != 0 ? &buf : nullptr, 1, 0.1f, momentum, dampening,
                    wd, nesterov, s == 0);
    return p;
  };
  CHECK(run(0.0f, 0.0f, 0.0f, false, 2) == doctest::Approx(0.9).epsilon(1e-6));
  CHECK(run(0.9f, 0.0f, 0.1f, false, 1) == doctest::Approx(0.94).epsilon(1e-6));
  CHECK(run(0.9f, 0.0f, 0.1f, false, 2) == doctest::Approx(0.8266).epsilon(1e-6));
  CHECK(run(0.9f, 0.0f, 0.1f, false, 3) == doctest::Approx(0.666274).epsilon(1e-6));
  CHECK(run(0.9f, 0.0f, 0.1f, true, 1) == doctest::Approx(0.886).epsilon(1e-6));
  CHECK(run(0.9f, 0.0f, 0.1f, true, 2) == doctest::Approx(0.725566).epsilon(1e-6));
  CHECK(run(0.9f, 0.5f, 0.0f, false, 1) == doctest::Approx(0.95).epsilon(1e-6));  // no dampening at step 1
  CHECK(run(0.9f, 0.5f, 0.0f, false, 2) == doctest::Approx(0.88).epsilon(1e-6));
  // A large buffer runs the parallel path and agrees with the scalar functor.
  const i64 n = 100003;
  auto p = random_vec(n, 35), g = random_vec(n, 36), buf = random_vec(n, 37);
  auto p0 = p, buf0 = buf;
  be().sgd_step(dev0(), p.data(), g.data(), buf.data(), n, 0.01f, 0.9f, 0.1f, 1e-4f, true, false);
  const SgdUpdate upd{make_sgd_params(0.01f, 0.9f, 0.1f, 1e-4f, true, false)};
  for (i64 i = 0; i < n; ++i) {
    upd(p0[i], g[i], &buf0[i]);
    REQUIRE(p[i] == p0[i]);
    REQUIRE(buf[i] == buf0[i]);
  }
  CHECK_THROWS_AS(be().sgd_step(dev0(), p.data(), g.data(), nullptr, n, 0.1f, 0.9f, 0, 0, false, true),
                  dp::Error);
}

TEST_CASE("adam and adamw: hand-computed values for three steps") {
  // p = 1, constant grad 0.5, lr = 0.1, betas (0.9, 0.999): with a constant gradient the
  // bias-corrected step is exactly lr, so Adam gives 0.9, 0.8, 0.7; AdamW (wd = 0.1)
  // first scales p by 1 - lr*wd = 0.99: 0.89, 0.7811, 0.673289.
  auto run = [](float wd, bool decoupled, int steps) {
    float p = 1.0f, g = 0.5f, m = 0.0f, v = 0.0f;
    for (int s = 1; s <= steps; ++s)
      be().adam_step(dev0(), &p, &g, &m, &v, 1, 0.1f, 0.9f, 0.999f, 1e-8f, wd, decoupled, s);
    return p;
  };
  CHECK(run(0.0f, false, 1) == doctest::Approx(0.9).epsilon(1e-5));
  CHECK(run(0.0f, false, 2) == doctest::Approx(0.8).epsilon(1e-5));
  CHECK(run(0.0f, false, 3) == doctest::Approx(0.7).epsilon(1e-5));
  CHECK(run(0.1f, true, 1) == doctest::Approx(0.89).epsilon(1e-5));
  CHECK(run(0.1f, true, 2) == doctest::Approx(0.7811).epsilon(1e-5));
  CHECK(run(0.1f, true, 3) == doctest::Approx(0.673289).epsilon(1e-5));
  // Adam with L2 weight decay (g += wd * p), against a double evaluation of the formula.
  double p = 1, m = 0, v = 0;
  float pf = 1, gf = 0.5f, mf = 0, vf = 0;
  for (int s = 1; s <= 3; ++s) {
    const double g = 0.5 + 0.1 * p;
    m = 0.9 * m + 0.1 * g;
    v = 0.999 * v + 0.001 * g * g;
    const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(0.999, s)) + 1e-8;
    p -= 0.1 / (1 - std::pow(0.9, s)) * m / denom;
    be().adam_step(dev0(), &pf, &gf, &mf, &vf, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.1f, false, s);
    CHECK(pf == doctest::Approx(p).epsilon(1e-5));
  }
  CHECK(p == doctest::Approx(0.7).epsilon(1e-3));  // sanity: the step stays ~lr
  CHECK_THROWS_AS(be().adam_step(dev0(), &pf, &gf, &mf, &vf, 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0, false, 0),
                  dp::Error);
}

// ---- devices used concurrently ----------------------------------------------------------------

TEST_CASE("two devices used from two threads concurrently: correct and not oversubscribed") {
  const int hw = dp::hardware_concurrency();
  be().set_concurrent_devices(2);
  const int per = std::max(1, hw / 2);
  CHECK(be().threads_per_device(dp::cpu(0)) == per);
  CHECK(be().threads_per_device(dp::cpu(1)) == per);

  const i64 m = 128, n = 256, k = 192;
  auto a = random_vec(m * k, 40), b = random_vec(k * n, 41);
  const Conv2dShape cs = conv_shape(8, 16, 14, 14, 32, 3, 3, 1, 1, 1, 1);
  auto x = random_vec(cs.N * cs.C * cs.H * cs.W, 42), w = random_vec(cs.K * cs.C * 9, 43);
  auto big = random_vec(500000, 44);

  struct Result {
    std::vector<float> c, y;
    float sum = 0;
    int arena_conc = 0, loop_conc = 0;
  };
  auto work = [&](Device d, Result& res) {
    res.c.assign(m * n, 0.0f);
    res.y.assign(cs.N * cs.K * cs.P * cs.Q, 0.0f);
    for (int it = 0; it < 5; ++it) {
      be().gemm(d, false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, res.c.data(), n);
      be().conv2d_forward(d, cs, x.data(), w.data(), nullptr, res.y.data());
      be().run<Op::Reduce>(d, DType::F32, {ReduceOp::Sum, big.data(), &res.sum, 1, 500000, 1});
    }
    // oneDNN runs as single-threaded chunks inside the arena (Note [oneDNN in the
    // device's arena]): the arena is the only source of parallelism to check.
    res.arena_conc = be().state(d).arena->max_concurrency();
    // With one thread the loop runs on the calling thread; otherwise inside the arena.
    be().parallel_for(d, 1 << 20, 1, [&](i64, i64) {
      res.loop_conc = tbb::this_task_arena::max_concurrency();
    });
  };
  Result serial, r0, r1;
  be().set_concurrent_devices(1);
  work(dp::cpu(0), serial);
  be().set_concurrent_devices(2);
  std::thread t0([&] { work(dp::cpu(0), r0); });
  std::thread t1([&] { work(dp::cpu(1), r1); });
  t0.join();
  t1.join();
  for (const Result* r : {&r0, &r1}) {
    CHECK(r->arena_conc == per);
    if (per > 1) CHECK(r->loop_conc == per);
    check_close(r->c, std::vector<double>(serial.c.begin(), serial.c.end()), 1e-5, 1e-5, "gemm");
    check_close(r->y, std::vector<double>(serial.y.begin(), serial.y.end()), 1e-5, 1e-5, "conv");
    CHECK(r->sum == serial.sum);  // reduction order is fixed by shape, not threads
  }
  be().set_concurrent_devices(1);
  CHECK(be().threads_per_device(dp::cpu(0)) == hw);  // one device gets every core
  Result alone;
  work(dp::cpu(0), alone);
  CHECK(alone.arena_conc == hw);
  CHECK(alone.loop_conc == hw);
}

TEST_CASE("exp_shifted: within 2 ulp of expf where e^x is normal, 0 below, NaN kept (Note [Attention exponentials])") {
  // x - shift over [-100, 88.3] in steps that hit many exponents and fractions, and the
  // edges; the shift moves the reduction's input.
  std::vector<float> x;
  for (float v = -100.0f; v <= 88.3f; v += 0.0137f) x.push_back(v);
  for (float v : {0.0f, -0.0f, 1e-30f, -1e-30f, -87.33f, -87.34f, 88.37f, -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()})
    x.push_back(v);
  for (float shift : {0.0f, 2.5f}) {
    std::vector<float> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] + shift;
    cpu::exp_shifted(y.data(), static_cast<i64>(y.size()), shift);
    int bad = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float t = (x[i] + shift) - shift;
      const float want = std::exp(t);
      if (std::isnan(t)) {
        bad += !std::isnan(y[i]);
      } else if (t < -87.33654f) {
        bad += y[i] != 0.0f;
      } else {
        bad += !(std::fabs(y[i] - want) <= 2.0f * std::numeric_limits<float>::epsilon() * want);
      }
    }
    CHECK(bad == 0);
  }
}
