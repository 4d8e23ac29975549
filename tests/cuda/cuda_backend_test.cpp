// tests/cuda/cuda_backend_test.cpp — every CUDA kernel against the CPU backend.
//
// Each test runs one op on the CPU backend (cpu:0, the oracle) and on cuda:0 with the
// same random inputs and compares with a per-op tolerance. Without a CUDA device the
// binary exits 77, which Meson reports as SKIP.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "dp/core/device.h"
#include "dp/core/error.h"

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
  i64* l() const { return static_cast<i64*>(p); }
};

/// One side of a comparison: a backend and its device, with upload/download helpers.
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

Side cpu_side() { return {dp::backend::get(dp::DeviceType::CPU), dp::cpu(0)}; }
Side cuda_side(int i = 0) {
  return {dp::backend::get(dp::DeviceType::CUDA), Device{dp::DeviceType::CUDA, i}};
}

std::vector<float> randn(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

std::vector<float> rand_pos(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(0.1f, 2.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

/// Runs `op` on both sides; it returns the outputs to compare (flattened).
using Outs = std::vector<std::vector<float>>;
using Op = std::function<Outs(Side&)>;

void compare(const Op& op, float rtol, float atol, const char* what) {
  Side c = cpu_side(), g = cuda_side();
  const auto want = op(c);
  const auto got = op(g);
  REQUIRE(want.size() == got.size());
  for (std::size_t k = 0; k < want.size(); ++k) {
    REQUIRE(want[k].size() == got[k].size());
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < want[k].size(); ++i) {
      const float a = want[k][i], b = got[k][i];
      const bool both_nan = std::isnan(a) && std::isnan(b);
      const bool same_inf = std::isinf(a) && a == b;
      if (!both_nan && !same_inf && !(std::fabs(a - b) <= atol + rtol * std::fabs(a))) {
        if (bad++ == 0) first = i;
      }
    }
    INFO(what, " output ", k, ": ", bad, " of ", want[k].size(), " differ; first at ", first,
         ": cpu ", want[k].empty() ? 0.0f : want[k][first], " cuda ",
         got[k].empty() ? 0.0f : got[k][first]);
    CHECK(bad == 0);
  }
}

std::vector<float> as_float(const std::vector<i64>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("fill, arange and casts") {
  compare([](Side& s) {
    const i64 n = 1000;
    auto a = s.zeros(n), b = s.zeros(n), c = s.zeros<i64>(n), d = s.zeros<i64>(n), e = s.zeros(n);
    s.b.fill(s.d, a->f(), n, 3.5f);
    s.b.arange(s.d, b->f(), n, -2.0f, 0.25f);
    s.b.arange_i64(s.d, c->l(), n, -7, 3);
    s.b.cast_f32_to_i64(s.d, b->f(), d->l(), n);
    s.b.cast_i64_to_f32(s.d, c->l(), e->f(), n);
    return Outs{s.down(*a, n), s.down(*b, n), as_float(s.down<i64>(*c, n)),
                       as_float(s.down<i64>(*d, n)), s.down(*e, n)};
  }, 0.0f, 0.0f, "fill/arange/cast");
}

TEST_CASE("unary ops") {
  using dp::backend::UnaryOp;
  for (UnaryOp op : {UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Log, UnaryOp::Sqrt, UnaryOp::Rsqrt,
                     UnaryOp::Abs, UnaryOp::Square, UnaryOp::Reciprocal, UnaryOp::Relu,
                     UnaryOp::Sigmoid, UnaryOp::Tanh, UnaryOp::Sign}) {
    const bool positive = op == UnaryOp::Log || op == UnaryOp::Sqrt || op == UnaryOp::Rsqrt;
    const auto x = positive ? rand_pos(4099, 1) : randn(4099, 1);
    compare([&](Side& s) {
      auto bx = s.up(x), by = s.zeros(x.size());
      s.b.unary(s.d, op, bx->f(), by->f(), static_cast<i64>(x.size()));
      s.b.unary(s.d, op, bx->f(), bx->f(), static_cast<i64>(x.size()));  // in place
      return Outs{s.down(*by, x.size()), s.down(*bx, x.size())};
    }, 2e-6f, 1e-7f, "unary");
  }
}

TEST_CASE("affine, axpy, binary with broadcast, strided copy") {
  const i64 R = 37, C = 53;
  const auto a = randn(R * C, 2), apos = rand_pos(R * C, 1), b = rand_pos(C, 3);
  const auto col = randn(R, 4);
  compare([&](Side& s) {
    auto ba = s.up(a), bap = s.up(apos), bb = s.up(b), bc = s.up(col), y = s.zeros(R * C);
    auto z = s.up(a);
    std::vector<std::vector<float>> out;
    s.b.affine(s.d, ba->f(), y->f(), R * C, 1.5f, -0.25f);
    out.push_back(s.down(*y, R * C));
    s.b.axpy(s.d, -0.75f, ba->f(), z->f(), R * C);
    out.push_back(s.down(*z, R * C));
    using dp::backend::BinaryOp;
    for (BinaryOp op : {BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div,
                        BinaryOp::Maximum, BinaryOp::Minimum, BinaryOp::Pow, BinaryOp::Eq,
                        BinaryOp::Gt, BinaryOp::ReluBackward}) {
      dp::backend::Indexer ix;  // (R, C) op (C,) row broadcast
      ix.ndim = 2;
      ix.sizes[0] = R; ix.sizes[1] = C;
      ix.strides_a[0] = C; ix.strides_a[1] = 1;
      ix.strides_b[0] = 0; ix.strides_b[1] = 1;
      // Pow gets positive bases: a negative base with a fractional exponent is NaN.
      s.b.binary(s.d, op, ix, op == BinaryOp::Pow ? bap->f() : ba->f(), bb->f(), y->f());
      out.push_back(s.down(*y, R * C));
      dp::backend::Indexer jx = ix;  // (R, C) op (R, 1) column broadcast
      jx.strides_b[0] = 1; jx.strides_b[1] = 0;
      if (op == BinaryOp::Pow) continue;
      s.b.binary(s.d, op, jx, ba->f(), bc->f(), y->f());
      out.push_back(s.down(*y, R * C));
    }
    dp::backend::Indexer tx;  // transpose: out (C, R) from a (R, C)
    tx.ndim = 2;
    tx.sizes[0] = C; tx.sizes[1] = R;
    tx.strides_a[0] = 1; tx.strides_a[1] = C;
    s.b.strided_copy(s.d, tx, ba->f(), y->f());
    out.push_back(s.down(*y, R * C));
    return out;
  }, 2e-6f, 1e-6f, "elementwise");
}

TEST_CASE("philox fills and dropout match the CPU backend") {
  const i64 n = 100003;
  const auto x = randn(n, 5);
  // Uniform and dropout are bitwise equal; normal may differ by a few ulps (logf/cosf).
  compare([&](Side& s) {
    auto u = s.zeros(n), bx = s.up(x), y = s.zeros(n), m = s.zeros(n);
    s.b.fill_uniform(s.d, u->f(), n, -1.0f, 3.0f, 1234, 77);
    s.b.dropout(s.d, bx->f(), y->f(), m->f(), n, 0.3f, 99, 5);
    return Outs{s.down(*u, n), s.down(*y, n), s.down(*m, n)};
  }, 0.0f, 0.0f, "uniform/dropout");
  compare([&](Side& s) {
    auto v = s.zeros(n);
    s.b.fill_normal(s.d, v->f(), n, 0.5f, 2.0f, 42, 0);
    return Outs{s.down(*v, n)};
  }, 4e-6f, 4e-6f, "normal");
}

TEST_CASE("reduce and argmax over rows and columns") {
  using dp::backend::ReduceOp;
  for (auto [outer, r, inner] : {std::array<i64, 3>{64, 10, 1}, {3, 5000, 1}, {8, 33, 70},
                                 {1, 1000, 3}, {5, 0, 4}}) {
    const auto x = randn(static_cast<std::size_t>(outer * r * inner), 6);
    compare([&, outer = outer, r = r, inner = inner](Side& s) {
      auto bx = s.up(x), y = s.zeros(outer * inner), idx = s.zeros<i64>(outer * inner);
      std::vector<std::vector<float>> out;
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
        if (r == 0 && op != ReduceOp::Sum) continue;  // no identity: both backends throw
        s.b.reduce(s.d, op, bx->f(), y->f(), outer, r, inner);
        out.push_back(s.down(*y, outer * inner));
      }
      if (r > 0) {
        s.b.argmax(s.d, bx->f(), idx->l(), outer, r, inner);
        out.push_back(as_float(s.down<i64>(*idx, outer * inner)));
      }
      return out;
    }, 1e-5f, 1e-4f, "reduce");
  }
}

TEST_CASE("gemm with every transpose combination and strides") {
  const i64 m = 33, n = 47, k = 29, pad = 3;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const i64 lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
      const auto a = randn((ta ? k : m) * lda, 7), b = randn((tb ? n : k) * ldb, 8);
      const auto c0 = randn(m * ldc, 9);
      compare([&](Side& s) {
        auto ba = s.up(a), bb = s.up(b), bc = s.up(c0);
        s.b.gemm(s.d, ta, tb, m, n, k, 0.5f, ba->f(), lda, bb->f(), ldb, -1.25f, bc->f(), ldc);
        return Outs{s.down(*bc, m * ldc)};
      }, 1e-4f, 1e-4f, "gemm");
    }
  }
}

TEST_CASE("log_softmax, nll forward and backward") {
  const i64 rows = 67, cols = 13;
  const auto x = randn(rows * cols, 10, 3.0f), gy = randn(rows * cols, 11), gl = randn(rows, 12);
  std::vector<i64> t(rows);
  for (i64 r = 0; r < rows; ++r) t[r] = (r * 7) % cols;
  compare([&](Side& s) {
    auto bx = s.up(x), y = s.zeros(rows * cols), bgy = s.up(gy), gx = s.zeros(rows * cols);
    auto bt = s.up(t), loss = s.zeros(rows), bgl = s.up(gl), gn = s.zeros(rows * cols);
    s.b.log_softmax(s.d, bx->f(), y->f(), rows, cols);
    s.b.log_softmax_backward(s.d, bgy->f(), y->f(), gx->f(), rows, cols);
    s.b.nll_forward(s.d, y->f(), bt->l(), loss->f(), rows, cols);
    s.b.nll_backward(s.d, bgl->f(), bt->l(), gn->f(), rows, cols);
    return Outs{s.down(*y, rows * cols), s.down(*gx, rows * cols), s.down(*loss, rows),
                       s.down(*gn, rows * cols)};
  }, 1e-5f, 1e-5f, "softmax/nll");
}

TEST_CASE("conv2d forward, backward data, backward weight") {
  dp::backend::Conv2dShape s{.N = 3, .C = 5, .H = 11, .W = 9, .K = 7, .R = 3, .S = 2,
                             .stride_h = 2, .stride_w = 1, .pad_h = 1, .pad_w = 1};
  s.P = (s.H + 2 * s.pad_h - s.R) / s.stride_h + 1;
  s.Q = (s.W + 2 * s.pad_w - s.S) / s.stride_w + 1;
  const i64 nx = s.N * s.C * s.H * s.W, nw = s.K * s.C * s.R * s.S, ny = s.N * s.K * s.P * s.Q;
  const auto x = randn(nx, 13), w = randn(nw, 14), bias = randn(s.K, 15), gy = randn(ny, 16);
  compare([&](Side& d) {
    auto bx = d.up(x), bw = d.up(w), bb = d.up(bias), y = d.zeros(ny), bgy = d.up(gy);
    auto gx = d.zeros(nx), gw = d.zeros(nw), gb = d.zeros(s.K);
    d.b.conv2d_forward(d.d, s, bx->f(), bw->f(), bb->f(), y->f());
    d.b.conv2d_backward_data(d.d, s, bgy->f(), bw->f(), gx->f());
    d.b.conv2d_backward_weight(d.d, s, bx->f(), bgy->f(), gw->f(), gb->f());
    return Outs{d.down(*y, ny), d.down(*gx, nx), d.down(*gw, nw), d.down(*gb, s.K)};
  }, 1e-4f, 1e-4f, "conv2d");
}

TEST_CASE("max and average pooling forward and backward") {
  dp::backend::Pool2dShape s{.N = 2, .C = 3, .H = 9, .W = 8, .kernel_h = 3, .kernel_w = 2,
                             .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1};
  s.P = (s.H + 2 * s.pad_h - s.kernel_h) / s.stride_h + 1;
  s.Q = (s.W + 2 * s.pad_w - s.kernel_w) / s.stride_w + 1;
  const i64 nx = s.N * s.C * s.H * s.W, ny = s.N * s.C * s.P * s.Q;
  const auto x = randn(nx, 17), gy = randn(ny, 18);
  compare([&](Side& d) {
    auto bx = d.up(x), y = d.zeros(ny), idx = d.zeros<i64>(ny), bgy = d.up(gy);
    auto gx = d.zeros(nx), ay = d.zeros(ny), agx = d.zeros(nx);
    d.b.maxpool2d_forward(d.d, s, bx->f(), y->f(), idx->l());
    d.b.maxpool2d_backward(d.d, s, bgy->f(), idx->l(), gx->f());
    d.b.avgpool2d_forward(d.d, s, bx->f(), ay->f());
    d.b.avgpool2d_backward(d.d, s, bgy->f(), agx->f());
    return Outs{d.down(*y, ny), as_float(d.down<i64>(*idx, ny)), d.down(*gx, nx),
                       d.down(*ay, ny), d.down(*agx, nx)};
  }, 1e-6f, 1e-6f, "pooling");
}

TEST_CASE("batch norm train, eval, backward") {
  const i64 N = 6, C = 5, HW = 49;
  const auto x = randn(N * C * HW, 19, 2.0f), gy = randn(N * C * HW, 20);
  const auto gamma = rand_pos(C, 21), beta = randn(C, 22), rm = randn(C, 23), rv = rand_pos(C, 24);
  compare([&](Side& d) {
    auto bx = d.up(x), bgy = d.up(gy), bg = d.up(gamma), bb = d.up(beta), brm = d.up(rm), brv = d.up(rv);
    auto y = d.zeros(N * C * HW), sm = d.zeros(C), si = d.zeros(C), ye = d.zeros(N * C * HW);
    auto gx = d.zeros(N * C * HW), gg = d.zeros(C), gbt = d.zeros(C);
    d.b.batchnorm_forward_train(d.d, N, C, HW, bx->f(), bg->f(), bb->f(), 1e-5f, 0.1f, brm->f(),
                                brv->f(), y->f(), sm->f(), si->f());
    d.b.batchnorm_forward_eval(d.d, N, C, HW, bx->f(), bg->f(), bb->f(), 1e-5f, brm->f(), brv->f(),
                               ye->f());
    d.b.batchnorm_backward(d.d, N, C, HW, bgy->f(), bx->f(), bg->f(), sm->f(), si->f(), gx->f(),
                           gg->f(), gbt->f());
    return Outs{d.down(*y, N * C * HW), d.down(*sm, C), d.down(*si, C), d.down(*brm, C),
                       d.down(*brv, C), d.down(*ye, N * C * HW), d.down(*gx, N * C * HW),
                       d.down(*gg, C), d.down(*gbt, C)};
  }, 1e-4f, 1e-5f, "batchnorm");
}

TEST_CASE("fused SGD and Adam steps") {
  const i64 n = 5000;
  const auto p = randn(n, 25), g = randn(n, 26), buf = randn(n, 27), m = randn(n, 28);
  const auto v = rand_pos(n, 29);
  for (bool nesterov : {false, true}) {
    compare([&](Side& d) {
      auto bp = d.up(p), bgr = d.up(g), bbuf = d.up(buf);
      d.b.sgd_step(d.d, bp->f(), bgr->f(), bbuf->f(), n, 0.1f, 0.9f, 0.1f, 1e-4f, nesterov, true);
      d.b.sgd_step(d.d, bp->f(), bgr->f(), bbuf->f(), n, 0.1f, 0.9f, 0.1f, 1e-4f, nesterov, false);
      return Outs{d.down(*bp, n), d.down(*bbuf, n)};
    }, 1e-5f, 1e-6f, "sgd");
  }
  for (bool decoupled : {false, true}) {
    compare([&](Side& d) {
      auto bp = d.up(p), bgr = d.up(g), bm = d.up(m), bv = d.up(v);
      for (i64 step = 1; step <= 3; ++step)
        d.b.adam_step(d.d, bp->f(), bgr->f(), bm->f(), bv->f(), n, 1e-3f, 0.9f, 0.999f, 1e-8f,
                      0.01f, decoupled, step);
      return Outs{d.down(*bp, n), d.down(*bm, n), d.down(*bv, n)};
    }, 1e-5f, 1e-6f, "adam");
  }
}

TEST_CASE("count_nonfinite") {
  auto x = randn(10007, 30);
  x[5] = NAN;
  x[900] = INFINITY;
  x[10006] = -INFINITY;
  Side g = cuda_side();
  auto bx = g.up(x);
  CHECK(g.b.count_nonfinite(g.d, bx->f(), static_cast<i64>(x.size())) == 3);
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

TEST_CASE("add_i64 adds in place exactly") {
  compare([](Side& s) {
    const i64 n = 70000;
    std::vector<i64> v(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = (i64{1} << 40) + i * 3 - 5;
    auto a = s.up(v);
    s.b.add_i64(s.d, a->l(), n, 7);
    s.b.add_i64(s.d, a->l(), n, -(i64{1} << 35));
    // Compared as exact int64 differences from the input (float would round them).
    std::vector<i64> got = s.down<i64>(*a, static_cast<std::size_t>(n));
    std::vector<float> diff(got.size());
    for (std::size_t i = 0; i < got.size(); ++i) diff[i] = static_cast<float>(got[i] - v[i] + (i64{1} << 35));
    return Outs{diff};
  }, 0.0f, 0.0f, "add_i64");
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
    for (int k = 0; k < 4; ++k) cb.fill(g.d, slow.f(), big, static_cast<float>(k));
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

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_backend_test", argc, argv); }
