// tests/tensor/channels_last_test.cpp — channels-last tensors (Note [Channels-last
// tensors]): the bytes lie N x H x W x C, every op gives the values it gives for the
// NCHW tensor, and the ops that keep the layout keep it.
//
// Witness: the NCHW tensor itself. Every result below is compared bit for bit with the
// same op on the contiguous tensor of the same values; the layout is read from the
// storage's bytes directly.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "../test_errors.h"
#include "dp/autograd/grad_mode.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

using dp::Dtype;
using dp::MemoryFormat;
using dp::Tensor;

constexpr MemoryFormat kCL = MemoryFormat::ChannelsLast;

/// The bits of a tensor's values (read as NCHW), whatever its dtype.
std::vector<std::uint32_t> bits(const Tensor& t) {
  std::vector<std::uint32_t> out;
  if (t.dtype() == Dtype::Int64) {
    for (auto v : t.to_vector_i64()) out.push_back(static_cast<std::uint32_t>(v));
  } else if (t.dtype() == Dtype::Int32) {
    for (auto v : t.to_vector_i32()) out.push_back(static_cast<std::uint32_t>(v));
  } else {
    for (float v : t.to_vector()) out.push_back(std::bit_cast<std::uint32_t>(v));
  }
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && bits(a) == bits(b); }

/// Element (n, c, h, w) of a CPU float32 tensor as its storage holds it, in `format`.
float stored(const Tensor& t, MemoryFormat format, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w) {
  const std::int64_t C = t.size(1), H = t.size(2), W = t.size(3);
  const std::int64_t i = format == kCL ? ((n * H + h) * W + w) * C + c : ((n * C + c) * H + h) * W + w;
  float v;
  std::memcpy(&v, static_cast<const char*>(t.storage()->data()) + (t.storage_offset() + i) * 4, 4);
  return v;
}

Tensor sample(const dp::Shape& shape, std::uint64_t seed = 7) {
  dp::Generator gen(seed);
  return dp::randn(shape, gen);
}

}  // namespace

TEST_CASE("channels_last: the bytes lie N x H x W x C and the values are the NCHW tensor's") {
  const Tensor x = sample({2, 3, 4, 5});
  const Tensor cl = x.contiguous(kCL);
  CHECK(x.suggest_memory_format() == MemoryFormat::Contiguous);
  CHECK(cl.suggest_memory_format() == kCL);
  CHECK(cl.is_contiguous(kCL));
  CHECK_FALSE(cl.is_contiguous());
  CHECK_FALSE(x.is_contiguous(kCL));
  CHECK(x.is_contiguous());
  CHECK(cl.shape() == x.shape());
  const auto xs = x.to_vector();
  int wrong = 0;
  for (std::int64_t n = 0; n < 2; ++n)
    for (std::int64_t c = 0; c < 3; ++c)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t w = 0; w < 5; ++w)
          wrong += stored(cl, kCL, n, c, h, w) != xs[static_cast<std::size_t>(((n * 3 + c) * 4 + h) * 5 + w)];
  CHECK(wrong == 0);
  CHECK(same_bits(cl, x));
  const Tensor back = cl.contiguous();
  CHECK(back.suggest_memory_format() == MemoryFormat::Contiguous);
  CHECK(same_bits(back, x));
  CHECK(stored(back, MemoryFormat::Contiguous, 1, 2, 3, 4) == xs.back());
  CHECK(cl.contiguous(kCL).is_same(cl));  // already laid out so
  CHECK(x.contiguous(MemoryFormat::Contiguous).is_same(x));
  CHECK(std::string(dp::memory_format_name(kCL)) == "channels_last");
}

TEST_CASE("channels_last: every dtype round-trips bit for bit") {
  const Tensor x = sample({3, 4, 2, 3});
  for (Dtype dt : {Dtype::Float32, Dtype::BFloat16, Dtype::Float16, Dtype::Int64, Dtype::Int32}) {
    CAPTURE(dp::dtype_name(dt));
    const Tensor t = dt == Dtype::Int64 || dt == Dtype::Int32 ? (x * 100.0).to(dt) : x.to(dt);
    const Tensor cl = t.contiguous(kCL);
    CHECK(cl.suggest_memory_format() == kCL);
    CHECK(same_bits(cl, t));
    CHECK(same_bits(cl.contiguous(), t));
  }
}

TEST_CASE("channels_last: a shape whose two layouts are the same bytes stays Contiguous") {
  for (const dp::Shape& s : {dp::Shape{2, 1, 4, 5}, dp::Shape{2, 3, 1, 1}, dp::Shape{0, 3, 2, 2}}) {
    CAPTURE(dp::shape_str(s));
    const Tensor x = dp::zeros(s);
    const Tensor cl = x.contiguous(kCL);
    if (dp::shape_numel(s) == 0) {
      CHECK(cl.shape() == s);
      CHECK(same_bits(cl.contiguous(), x));
      continue;
    }
    CHECK(cl.is_same(x));
    CHECK(x.is_contiguous(kCL));
    CHECK(x.is_contiguous());
  }
}

TEST_CASE("channels_last: a tensor that is not 4-d is refused by name") {
  const Tensor x = dp::zeros({2, 3, 4});
  CHECK(dp_test::throws_with([&] { (void)x.contiguous(kCL); }, {"channels_last", "4-d", "[2, 3, 4]"}));
  CHECK_FALSE(x.is_contiguous(kCL));
  CHECK(x.is_contiguous());
}

TEST_CASE("channels_last: elementwise ops, casts, clone, detach and to(device) keep the layout") {
  const Tensor x = sample({2, 5, 3, 4}), y = sample({2, 5, 3, 4}, 11);
  const Tensor cx = x.contiguous(kCL), cy = y.contiguous(kCL);
  const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&, const Tensor&)>>> ops = {
      {"relu", [](const Tensor& a, const Tensor&) { return dp::relu(a); }},
      {"exp", [](const Tensor& a, const Tensor&) { return dp::exp(a); }},
      {"neg", [](const Tensor& a, const Tensor&) { return -a; }},
      {"x * 0.7", [](const Tensor& a, const Tensor&) { return a * 0.7; }},
      {"x + 1.5", [](const Tensor& a, const Tensor&) { return a + 1.5; }},
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }},
      {"maximum", [](const Tensor& a, const Tensor& b) { return dp::maximum(a, b); }},
      {"to(bf16)", [](const Tensor& a, const Tensor&) { return a.to(Dtype::BFloat16); }},
      {"to(f16) to(f32)", [](const Tensor& a, const Tensor&) { return a.to(Dtype::Float16).to(Dtype::Float32); }},
      {"bf16 add", [](const Tensor& a, const Tensor& b) { return a.to(Dtype::BFloat16) + b.to(Dtype::BFloat16); }},
      {"clone", [](const Tensor& a, const Tensor&) { return a.clone(); }},
      {"detach", [](const Tensor& a, const Tensor&) { return a.detach(); }},
      {"to(cpu:1)", [](const Tensor& a, const Tensor&) { return a.to(dp::cpu(1)); }},
      {"narrow(0)", [](const Tensor& a, const Tensor&) { return a.narrow(0, 1, 1); }},
  };
  for (const auto& [name, f] : ops) {
    CAPTURE(name);
    const Tensor want = f(x, y), got = f(cx, cy);
    CHECK(got.suggest_memory_format() == kCL);
    CHECK(same_bits(got, want));
  }
}

TEST_CASE("channels_last: every other op reads the NCHW values and gives the NCHW tensor's results") {
  const Tensor x = sample({2, 4, 5, 6});
  const Tensor cx = x.contiguous(kCL);
  const Tensor w = sample({3, 4, 3, 3}, 3);
  const Tensor bias = sample({1, 4, 1, 1}, 5);
  const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&)>>> ops = {
      {"sum", [](const Tensor& a) { return dp::sum(a); }},
      {"mean(1)", [](const Tensor& a) { return dp::mean(a, 1); }},
      {"max(3)", [](const Tensor& a) { return dp::max(a, 3); }},
      {"softmax(1)", [](const Tensor& a) { return dp::nn::softmax(a, 1); }},
      {"reshape", [](const Tensor& a) { return a.reshape({8, 30}); }},
      {"flatten(1)", [](const Tensor& a) { return a.flatten(1); }},
      {"unsqueeze", [](const Tensor& a) { return a.unsqueeze(0); }},
      {"narrow(1)", [](const Tensor& a) { return a.narrow(1, 1, 2); }},
      {"narrow(2)", [](const Tensor& a) { return a.narrow(2, 1, 3); }},
      {"permute", [](const Tensor& a) { return a.permute({0, 2, 3, 1}); }},
      {"transpose", [](const Tensor& a) { return a.transpose(1, 3); }},
      {"bias add (broadcast)", [&bias](const Tensor& a) { return a + bias; }},
      {"add with NCHW", [&x](const Tensor& a) { return a + x; }},
      {"matmul", [](const Tensor& a) { return dp::matmul(a, a.transpose(2, 3)); }},
      {"conv2d_relu_max_pool2d", [&w](const Tensor& a) {
         return dp::nn::conv2d_relu_max_pool2d(a, w, Tensor(), 1, 1, 2, 2, 0);
       }},
      {"max_pool2d", [](const Tensor& a) { return dp::nn::max_pool2d(a, 2); }},
      {"adaptive_avg_pool2d_1x1", [](const Tensor& a) { return dp::nn::adaptive_avg_pool2d_1x1(a); }},
      // Ops that copy their input and write into the copy (index_add lost its writes to
      // the copy's NCHW reading until it made its output contiguous).
      {"index_add", [](const Tensor& a) {
         const Tensor idx = dp::from_vector(std::vector<std::int64_t>{2, 0, 2}, {3});
         return dp::index_add(a, 1, idx, dp::ones({2, 3, 5, 6}));
       }},
      {"index_select", [](const Tensor& a) {
         return dp::index_select(a, 3, dp::from_vector(std::vector<std::int64_t>{5, 1}, {2}));
       }},
      {"masked_fill", [](const Tensor& a) { return dp::masked_fill(a, dp::gt(a, 0.5), -2.0); }},
      {"where", [](const Tensor& a) { return dp::where(dp::gt(a, 0.0), a, -a); }},
      {"clamp", [](const Tensor& a) { return dp::clamp(a, -0.5, 0.5); }},
      {"cat", [&x](const Tensor& a) { return dp::cat({a, x}, 1); }},
  };
  for (const auto& [name, f] : ops) {
    CAPTURE(name);
    const Tensor got = f(cx), want = f(x);
    CHECK(same_bits(got, want));
    // An op that keeps the layout reads the bytes as they lie: they hold the values too.
    CHECK(same_bits(got * 1.0, want));
  }
  CHECK(x.sum().item() == cx.sum().item());
  CHECK(cx.str() == x.str());
}

TEST_CASE("channels_last: gradients are the NCHW tensor's, through the layout and back") {
  auto run = [](bool channels_last) {
    Tensor leaf = sample({2, 4, 5, 6}).set_requires_grad(true);
    Tensor h = channels_last ? leaf.contiguous(kCL) : leaf;
    Tensor a = dp::relu(h * 1.5) + h;           // kept channels-last
    Tensor y = dp::nn::max_pool2d(a, 2) * 0.5;  // read as NCHW
    (y * y).sum().backward();
    return leaf.grad();
  };
  const Tensor want = run(false), got = run(true);
  CHECK(same_bits(got, want));
}

TEST_CASE("channels_last: in-place writes write the layout") {
  const Tensor x = sample({2, 3, 4, 5}), y = sample({2, 3, 4, 5}, 9);
  const Tensor row = sample({5}, 13);
  struct Write {
    const char* name;
    std::function<void(Tensor&)> f;
  };
  const std::vector<Write> writes = {
      {"zero_", [](Tensor& t) { t.zero_(); }},
      {"fill_", [](Tensor& t) { t.fill_(2.5); }},
      {"add_(scalar)", [](Tensor& t) { t.add_(0.25); }},
      {"mul_(scalar)", [](Tensor& t) { t.mul_(3.0f); }},
      {"add_(NCHW)", [&y](Tensor& t) { t.add_(y, 0.5f); }},
      {"add_(channels-last)", [&y](Tensor& t) { t.add_(y.contiguous(kCL)); }},
      {"add_(broadcast row)", [&row](Tensor& t) { t.add_(row); }},
      {"copy_(NCHW)", [&y](Tensor& t) { t.copy_(y); }},
      {"mul_(tensor)", [&y](Tensor& t) { t.mul_(y); }},
      {"div_(scalar)", [](Tensor& t) { t.div_(4.0); }},
      {"relu_", [](Tensor& t) { t.relu_(); }},
      {"clamp_", [](Tensor& t) { t.clamp_(-0.5, 0.5); }},
  };
  for (const auto& [name, f] : writes) {
    CAPTURE(name);
    dp::NoGradGuard no_grad;
    Tensor want = x.clone();
    f(want);
    Tensor got = x.contiguous(kCL);
    (void)got.to_vector();  // its NCHW copy exists before the write, and must not outlive it
    f(got);
    CHECK(got.suggest_memory_format() == kCL);
    CHECK(same_bits(got, want));
  }
}

TEST_CASE("channels_last: a write that would miss the layout is refused") {
  Tensor cl = sample({2, 3, 4, 5}).contiguous(kCL);
  CHECK(dp_test::throws_with([&] { (void)cl.mutable_data<float>(); }, {"channels_last", ".contiguous()"}));
  CHECK(dp_test::throws_with([&] { (void)cl.mutable_raw_data(); }, {"channels_last", "[2, 3, 4, 5]"}));
}

TEST_CASE("channels_last: a view of the same storage sees a write") {
  Tensor cl = sample({3, 2, 4, 4}).contiguous(kCL);
  const Tensor part = cl.narrow(0, 1, 2);
  CHECK(part.suggest_memory_format() == kCL);
  CHECK(same_bits(part, cl.contiguous().narrow(0, 1, 2)));
  {
    dp::NoGradGuard no_grad;
    cl.fill_(-1.0);
  }
  for (float v : part.to_vector()) CHECK(v == -1.0f);
}

TEST_CASE("channels_last: threads that read one tensor as NCHW at once agree") {
  const Tensor x = sample({4, 8, 6, 6});
  const Tensor cl = x.contiguous(kCL);
  std::vector<std::vector<std::uint32_t>> seen(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { seen[static_cast<std::size_t>(i)] = bits(cl.sum(1)); });
  for (auto& t : threads) t.join();
  for (const auto& s : seen) CHECK(s == bits(x.sum(1)));
}

namespace {

/// max |a - b| over max(1, max |b|): a relative distance on the scale of the values.
double scaled_distance(const Tensor& a, const Tensor& b) {
  const auto x = a.to_vector(), y = b.to_vector();
  REQUIRE(x.size() == y.size());
  double worst = 0.0, scale = 1.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(x[i]) - y[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(y[i])));
  }
  return worst / scale;
}

}  // namespace

TEST_CASE("channels_last: conv2d computes in the layout, within rounding of the NCHW convolution") {
  struct Geometry {
    dp::Shape x, w;
    std::int64_t stride, padding;
  };
  const std::vector<Geometry> geometries = {
      {{2, 16, 9, 7}, {8, 16, 3, 3}, 1, 1},   // "same" 3x3
      {{3, 32, 8, 8}, {16, 32, 1, 1}, 2, 0},  // a strided 1x1 shortcut
      {{2, 3, 11, 10}, {5, 3, 5, 5}, 2, 2},   // few channels, a large kernel
  };
  for (Dtype dt : {Dtype::Float32, Dtype::BFloat16}) {
    // float32: sums of up to 144 products in another order; bfloat16: the output and
    // the gradients round to 8 bits.
    const double tol = dt == Dtype::Float32 ? 1e-5 : 1.0 / 64;
    for (const auto& g : geometries) {
      for (bool relu : {false, true}) {
        CAPTURE(dp::dtype_name(dt));
        CAPTURE(dp::shape_str(g.x));
        CAPTURE(relu);
        auto run = [&](bool channels_last) {
          Tensor x = sample(g.x, 21).to(dt).set_requires_grad(true);
          Tensor w = (sample(g.w, 22) * 0.3).to(dt).set_requires_grad(true);
          Tensor b = sample({g.w[0]}, 23).to(dt).set_requires_grad(true);
          Tensor in = channels_last ? x.contiguous(kCL) : x;
          Tensor y = relu ? dp::nn::conv2d_relu(in, w, b, g.stride, g.padding)
                          : dp::nn::conv2d(in, w, b, g.stride, g.padding);
          const MemoryFormat format = y.suggest_memory_format();
          Tensor weights = sample(y.shape(), 24).to(dt);
          (y * weights).to(Dtype::Float32).sum().backward();
          return std::make_tuple(y, format, x.grad(), w.grad(), b.grad());
        };
        const auto [y0, f0, gx0, gw0, gb0] = run(false);
        const auto [y1, f1, gx1, gw1, gb1] = run(true);
        CHECK(f0 == MemoryFormat::Contiguous);
        CHECK(f1 == kCL);
        CHECK(y1.dtype() == dt);
        CHECK(scaled_distance(y1, y0) <= tol);
        CHECK(scaled_distance(gx1, gx0) <= tol);
        CHECK(scaled_distance(gw1, gw0) <= tol);
        CHECK(scaled_distance(gb1, gb0) <= tol);
      }
    }
  }
}

TEST_CASE("channels_last: batch_norm normalises in the layout, within rounding of the NCHW one") {
  for (Dtype dt : {Dtype::Float32, Dtype::BFloat16, Dtype::Float16}) {
    // Statistics summed in another order (float32: ~1e-6 of the values' scale); a 16-bit
    // output or gradient may round the other way.
    const double tol = dt == Dtype::Float32 ? 1e-5 : dt == Dtype::BFloat16 ? 1.0 / 64 : 1.0 / 512;
    for (const dp::Shape& shape : {dp::Shape{4, 24, 7, 7}, dp::Shape{2, 3, 65, 67}, dp::Shape{3, 64, 2, 3}}) {
      for (bool training : {true, false}) {
        CAPTURE(dp::dtype_name(dt));
        CAPTURE(dp::shape_str(shape));
        CAPTURE(training);
        auto run = [&](bool channels_last) {
          const std::int64_t C = shape[1];
          Tensor x = (sample(shape, 31) * 3.0 + 1.0).to(dt).set_requires_grad(true);
          Tensor gamma = (sample({C}, 32) * 0.5 + 1.0).set_requires_grad(true);
          Tensor beta = sample({C}, 33).set_requires_grad(true);
          Tensor rm = sample({C}, 34), rv = sample({C}, 35).abs() + 0.5;
          Tensor in = channels_last ? x.contiguous(kCL) : x;
          Tensor y = dp::nn::batch_norm(in, gamma, beta, rm, rv, training, 0.1, 1e-5);
          const MemoryFormat format = y.suggest_memory_format();
          (y.to(Dtype::Float32) * sample(shape, 36)).sum().backward();
          return std::make_tuple(y, format, x.grad(), gamma.grad(), beta.grad(), rm, rv);
        };
        const auto [y0, f0, gx0, gg0, gb0, rm0, rv0] = run(false);
        const auto [y1, f1, gx1, gg1, gb1, rm1, rv1] = run(true);
        CHECK(f0 == MemoryFormat::Contiguous);
        CHECK(f1 == kCL);
        CHECK(y1.dtype() == dt);
        CHECK(scaled_distance(y1, y0) <= tol);
        CHECK(scaled_distance(gx1, gx0) <= tol);
        CHECK(scaled_distance(gg1, gg0) <= 1e-5);  // float32 sums
        CHECK(scaled_distance(gb1, gb0) <= 1e-5);
        CHECK(scaled_distance(rm1, rm0) <= 1e-6);
        CHECK(scaled_distance(rv1, rv0) <= 1e-6);
      }
    }
  }
}
