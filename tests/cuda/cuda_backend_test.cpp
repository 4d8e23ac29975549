// tests/cuda/cuda_backend_test.cpp — every CUDA kernel against the CPU backend.
//
// The op cases are the backend op table (tests/backend/op_cases.h), the same list that
// op_table_test runs on CPU virtual devices and kernels_bench times: each case is
// built on cpu:0 (the oracle) and on cuda:0 from the same inputs, run once, and every
// output compared under the case's tolerance. The CUDA-only checks after it (caching
// allocator, pinned-block reuse, peer copies) are not op comparisons. Without a CUDA
// device the binary exits 77, which Meson reports as SKIP.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
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
  std::vector<float> buf(64);
  auto d = g.up(buf);
  CHECK_THROWS_AS(g.b.copy_rows(d->p, 8, d->f() + 32, 16, 12, 2, g.d), dp::Error);
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_backend_test", argc, argv); }
