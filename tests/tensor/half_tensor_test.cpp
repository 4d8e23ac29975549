// tests/tensor/half_tensor_test.cpp — bfloat16 and float16 tensors (Note [16-bit tensors]).
//
// Witnesses: PyTorch's bits for ~4500 floats converted by a tensor's to(dtype)
// (tests/core/half_reference.h), and for arithmetic the definition — the float32 result
// of the widened operands, rounded once by the scalar conversion, which tests/core/
// half_test.cpp checks bitwise against PyTorch.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "../core/half_reference.h"
#include "half_ops_reference.h"
#include "half_safetensors_reference.h"
#include "../test_errors.h"
#include "dp/io/safetensors.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

using dp::Dtype;

constexpr Dtype kHalfDtypes[] = {Dtype::BFloat16, Dtype::Float16};

std::vector<float> reference_inputs() {
  std::vector<float> v;
  for (std::uint32_t b : kHalfInputs) v.push_back(std::bit_cast<float>(b));
  return v;
}

/// The bits of a 16-bit tensor, read on the host.
std::vector<std::uint16_t> bits_of(const dp::Tensor& t) {
  std::vector<std::uint16_t> out;
  if (t.dtype() == Dtype::BFloat16) {
    const auto* p = t.data<dp::BFloat16>();
    for (std::int64_t i = 0; i < t.numel(); ++i) out.push_back(p[i].bits);
  } else {
    const auto* p = t.data<dp::Float16>();
    for (std::int64_t i = 0; i < t.numel(); ++i) out.push_back(p[i].bits);
  }
  return out;
}

/// f rounded once to `dtype` and widened back: the definition of a 16-bit op's result.
float round16(float f, Dtype dtype) {
  return dtype == Dtype::BFloat16 ? static_cast<float>(dp::BFloat16(f)) : static_cast<float>(dp::Float16(f));
}

/// Values that are exact in both 16-bit formats' ranges, spread over [-lo, lo).
std::vector<float> values16(std::size_t n, float scale, Dtype dtype, std::uint32_t seed) {
  std::vector<float> v(n);
  std::uint32_t s = seed;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = round16(scale * (static_cast<float>(s >> 8) / 16777216.0f * 2.0f - 1.0f), dtype);
  }
  return v;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<std::uint32_t>(a[i]) != std::bit_cast<std::uint32_t>(b[i]) && !(std::isnan(a[i]) && std::isnan(b[i])))
      return false;
  return true;
}

/// Products: a 16-bit GEMM rounds its float32 sum once, but may add in another order
/// than the float32 reference (oneDNN's kernels, Note [bf16 GEMMs through oneDNN]), so
/// each element is the reference's rounding or its neighbour: within one unit in the
/// last place of the 16-bit dtype.
bool within_one_ulp(const std::vector<float>& got, const std::vector<float>& want, Dtype dtype) {
  if (got.size() != want.size()) return false;
  const int bits = dtype == Dtype::BFloat16 ? 8 : dtype == Dtype::Float16 ? 11 : 24;  // significand bits
  for (std::size_t i = 0; i < got.size(); ++i) {
    int e = 0;
    std::frexp(want[i], &e);
    const float ulp = std::ldexp(1.0f, e - bits);
    if (!(std::fabs(got[i] - want[i]) <= ulp)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("to(bfloat16) and to(float16) give PyTorch's bits, and widen back exactly") {
  const std::vector<float> in = reference_inputs();
  const dp::Tensor x = dp::from_vector(in, {static_cast<std::int64_t>(in.size())});
  const std::vector<std::uint16_t> bf = bits_of(x.to(Dtype::BFloat16));
  const std::vector<std::uint16_t> hf = bits_of(x.to(Dtype::Float16));
  int bad_bf = 0, bad_hf = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    bad_bf += bf[i] != kTorchBFloat16[i];
    bad_hf += hf[i] != kTorchFloat16[i];
  }
  CHECK(bad_bf == 0);
  CHECK(bad_hf == 0);
  for (Dtype dt : kHalfDtypes) {
    CAPTURE(std::string(dp::dtype_name(dt)));
    const dp::Tensor h = x.to(dt);
    CHECK(h.dtype() == dt);
    CHECK(h.nbytes() == 2 * in.size());
    // Widening is exact: the 16-bit values back, as floats.
    const std::vector<float> back = h.to(Dtype::Float32).to_vector();
    std::vector<float> want;
    for (float f : in) want.push_back(round16(f, dt));
    CHECK(same_floats(back, want));
    CHECK(same_floats(h.to_vector(), want));
    // bfloat16 <-> float16 rounds once from the exact value.
    const Dtype other = dt == Dtype::BFloat16 ? Dtype::Float16 : Dtype::BFloat16;
    std::vector<float> cross;
    for (float f : want) cross.push_back(round16(f, other));
    CHECK(same_floats(h.to(other).to_vector(), cross));
  }
}

TEST_CASE("16-bit tensors convert to and from integers through float32") {
  const dp::Tensor i = dp::from_vector(std::vector<std::int64_t>{-3, 0, 257, 70000}, {4});
  CHECK(i.to(Dtype::BFloat16).to_vector() == std::vector<float>{-3, 0, 256, 70144});  // 8 significant bits
  CHECK(i.to(Dtype::Float16).to_vector() == std::vector<float>{-3, 0, 257, INFINITY});  // above 65504
  const dp::Tensor h = dp::from_vector(std::vector<float>{-2.75f, 0.5f, 3.0f}, {3}).to(Dtype::BFloat16);
  CHECK(h.to(Dtype::Int64).to_vector_i64() == std::vector<std::int64_t>{-2, 0, 3});  // truncation toward 0
  CHECK(h.to(Dtype::Int32).to_vector_i32() == std::vector<std::int32_t>{-2, 0, 3});
  const dp::Tensor i32 = dp::from_vector(std::vector<std::int32_t>{7, -9}, {2});
  CHECK(i32.to(Dtype::Float16).to_vector() == std::vector<float>{7, -9});
}

TEST_CASE("item, from_vector, printing and element access of 16-bit tensors") {
  const dp::Tensor b = dp::from_vector(std::vector<dp::BFloat16>{dp::BFloat16(1.5f), dp::BFloat16(-2.0f)}, {2});
  CHECK(b.dtype() == Dtype::BFloat16);
  CHECK(b.narrow(0, 1, 1).item() == -2.0);
  CHECK(b.narrow(0, 0, 1).item<float>() == 1.5f);
  CHECK(b.narrow(0, 1, 1).item<std::int64_t>() == -2);
  CHECK(dp::full({}, 3.14159, {.dtype = Dtype::BFloat16}).item<float>() == 3.140625f);
  CHECK(dp::zeros({3}, {.dtype = Dtype::Float16}).to_vector() == std::vector<float>{0, 0, 0});
  CHECK(dp::ones({2}, {.dtype = Dtype::Float16}).to_vector() == std::vector<float>{1, 1});
  std::ostringstream os;
  os << b;
  CHECK(os.str().find("[ CPUBFloat16Type{2} ]") != std::string::npos);
  std::ostringstream oh;
  oh << b.to(Dtype::Float16);
  CHECK(oh.str().find("[ CPUHalfType{2} ]") != std::string::npos);
  CHECK(b.str() == "Tensor[2] bfloat16 cpu:0");
  CHECK(dp_test::throws_with([&] { (void)b.data<float>(); }, {"expected a float32 tensor, got bfloat16"}));
  CHECK(dp_test::throws_with([&] { (void)b.data<dp::Float16>(); }, {"expected a float16 tensor, got bfloat16"}));
}

TEST_CASE("elementwise ops on 16-bit tensors compute in float32 and round once") {
  for (Dtype dt : kHalfDtypes) {
    CAPTURE(std::string(dp::dtype_name(dt)));
    const std::vector<float> va = values16(3000, 8.0f, dt, 1), vb = values16(3000, 8.0f, dt, 2);
    const dp::Tensor a = dp::from_vector(va, {30, 100}).to(dt), b = dp::from_vector(vb, {30, 100}).to(dt);
    const dp::Tensor row = dp::from_vector(std::vector<float>(vb.begin(), vb.begin() + 100), {100}).to(dt);
    auto each = [&](auto f) {
      std::vector<float> out;
      for (std::size_t i = 0; i < va.size(); ++i) out.push_back(round16(f(va[i], vb[i], vb[i % 100]), dt));
      return out;
    };
    CHECK(dp::add(a, b).dtype() == dt);
    CHECK(same_floats(dp::add(a, b).to_vector(), each([](float x, float y, float) { return x + y; })));
    CHECK(same_floats(dp::mul(a, b).to_vector(), each([](float x, float y, float) { return x * y; })));
    CHECK(same_floats(dp::div(a, b).to_vector(), each([](float x, float y, float) { return x / y; })));
    CHECK(same_floats(dp::sub(a, row).to_vector(), each([](float x, float, float r) { return x - r; })));
    CHECK(same_floats(dp::exp(a).to_vector(), each([](float x, float, float) { return std::exp(x); })));
    CHECK(same_floats(dp::relu(a).to_vector(), each([](float x, float, float) { return x > 0 ? x : 0.0f; })));
    CHECK(same_floats(dp::mul(a, 0.1).to_vector(), each([](float x, float, float) { return 0.1f * x; })));
    CHECK(same_floats(dp::pow(a, 2.5).to_vector(),
                      each([](float x, float, float) { return static_cast<float>(std::pow(x, 2.5f)); })));
    CHECK(same_floats(a.t().contiguous().t().to_vector(), a.to_vector()));
    CHECK(same_floats(a.permute({1, 0}).to(Dtype::Float32).to_vector(),
                      dp::from_vector(va, {30, 100}).permute({1, 0}).to(dt).to(Dtype::Float32).to_vector()));
    dp::Tensor c = a.clone();
    c.add_(b, 2.0f);
    CHECK(same_floats(c.to_vector(), each([](float x, float y, float) { return x + 2.0f * y; })));
  }
}

TEST_CASE("mixed floating operands compute in float32 and return float32") {
  const dp::Tensor f = dp::from_vector(std::vector<float>{1.0f, 1.0f / 3.0f}, {2});
  const dp::Tensor b = dp::from_vector(std::vector<float>{1.0f / 3.0f, 2.0f}, {2}).to(Dtype::BFloat16);
  const dp::Tensor h = dp::from_vector(std::vector<float>{0.1f, 3.0f}, {2}).to(Dtype::Float16);
  const dp::Tensor fb = dp::add(f, b);
  CHECK(fb.dtype() == Dtype::Float32);
  CHECK(fb.to_vector() == std::vector<float>{1.0f + static_cast<float>(dp::BFloat16(1.0f / 3.0f)), 1.0f / 3.0f + 2.0f});
  const dp::Tensor bh = dp::mul(b, h);
  CHECK(bh.dtype() == Dtype::Float32);
  CHECK(bh.to_vector()[0] == static_cast<float>(dp::BFloat16(1.0f / 3.0f)) * static_cast<float>(dp::Float16(0.1f)));
  // Gradients reach each operand in its own dtype.
  const dp::Tensor fr = f.clone().set_requires_grad(true);
  const dp::Tensor br = b.clone().set_requires_grad(true);
  dp::sum(dp::mul(fr, br)).backward();
  REQUIRE(br.grad().defined());
  CHECK(br.grad().dtype() == Dtype::BFloat16);
  CHECK(fr.grad().dtype() == Dtype::Float32);
  CHECK(br.grad().to_vector() == std::vector<float>{1.0f, round16(1.0f / 3.0f, Dtype::BFloat16)});
}

// The pairwise losses widen 16-bit inputs to float32 kernels; their result once took the
// first 16-bit input's dtype even beside a float32 target, where PyTorch promotes to
// float32 (found by the op fuzzer, Note [Op fuzzer]): a bfloat16 prediction's loss
// against a float32 target lost 8 bits.
TEST_CASE("losses of a 16-bit input and a float32 target are float32, the float32 math's value") {
  const std::vector<float> pv{0.3f, -1.7f, 2.2f, 0.9f}, tv{0.25f, -1.1f, 1.9f, 3.3f};
  const dp::Tensor pred16 = dp::from_vector(pv, {4}).to(Dtype::BFloat16);
  const dp::Tensor pred32 = pred16.to(Dtype::Float32);  // the same values, exactly
  const dp::Tensor target = dp::from_vector(tv, {4});
  using LossFn = std::function<dp::Tensor(const dp::Tensor&, const dp::Tensor&)>;
  const std::vector<std::pair<const char*, LossFn>> losses{
      {"mse_loss", [](const dp::Tensor& a, const dp::Tensor& b) { return dp::nn::mse_loss(a, b); }},
      {"l1_loss", [](const dp::Tensor& a, const dp::Tensor& b) { return dp::nn::l1_loss(a, b); }},
      {"smooth_l1_loss",
       [](const dp::Tensor& a, const dp::Tensor& b) { return dp::nn::smooth_l1_loss(a, b, dp::nn::Reduction::Sum); }},
      {"mse_loss none",
       [](const dp::Tensor& a, const dp::Tensor& b) { return dp::nn::mse_loss(a, b, dp::nn::Reduction::None); }},
  };
  for (const auto& [name, loss] : losses) {
    CAPTURE(name);
    const dp::Tensor mixed = loss(pred16, target), reversed = loss(target, pred16), wide = loss(pred32, target);
    CHECK(mixed.dtype() == Dtype::Float32);
    CHECK(reversed.dtype() == Dtype::Float32);
    CHECK(mixed.to_vector() == wide.to_vector());
    // Both 16-bit: the loss is rounded once to their dtype, as before.
    const dp::Tensor both = loss(pred16, target.to(Dtype::BFloat16));
    CHECK(both.dtype() == Dtype::BFloat16);
    // bfloat16 beside float16: float32, as PyTorch promotes them.
    CHECK(loss(pred16, target.to(Dtype::Float16)).dtype() == Dtype::Float32);
  }
  const std::vector<float> mse = dp::nn::mse_loss(pred16, target).to_vector();
  CHECK(mse[0] != static_cast<float>(dp::BFloat16(mse[0])));  // not a bfloat16 value: 8 more bits kept
  // Gradients return in each input's dtype.
  const dp::Tensor p = pred16.clone().set_requires_grad(true);
  dp::nn::mse_loss(p, target).backward();
  REQUIRE(p.grad().defined());
  CHECK(p.grad().dtype() == Dtype::BFloat16);
}

// index_select's and gather's backward sum a repeated index's gradients; in 16 bits they
// once added into the 16-bit result one by one, rounding each time (found by the op
// fuzzer, Note [Op fuzzer]): 1 + 2^-8 rounds back to 1 in bfloat16, so four of them
// vanished where the float32 sum, rounded once, is 1 + 2^-6.
TEST_CASE("a repeated index's 16-bit gradients are summed in float32 and rounded once") {
  const std::vector<float> up{1.0f, 0x1p-8f, 0x1p-8f, 0x1p-8f, 0x1p-8f};
  const dp::Tensor w = dp::from_vector(up, {5}).to(Dtype::BFloat16);
  const dp::Tensor idx = dp::from_vector(std::vector<std::int64_t>{0, 0, 0, 0, 0}, {5});
  for (bool use_gather : {false, true}) {
    CAPTURE(use_gather);
    const dp::Tensor x = dp::from_vector(std::vector<float>{0.5f}, {1}).to(Dtype::BFloat16).set_requires_grad(true);
    const dp::Tensor y = use_gather ? dp::gather(x, 0, idx) : dp::index_select(x, 0, idx);
    dp::sum(dp::mul(y, w)).backward();
    REQUIRE(x.grad().defined());
    CHECK(x.grad().dtype() == Dtype::BFloat16);
    CHECK(x.grad().to_vector() == std::vector<float>{1.0f + 0x1p-6f});
  }
}

// Note [16-bit backward formulas]: tanh's and sigmoid's backward on 16-bit tensors is
// PyTorch's fused kernel's, g·(1 − y²) and g·y·(1 − y) in float32 rounded once; op by op
// it rounded after each op and differed from PyTorch by a unit in the last place.
TEST_CASE("tanh and sigmoid backward in 16 bits: the float32 formula rounded once") {
  std::vector<float> xv, gv;
  for (int i = 0; i < 512; ++i) {
    xv.push_back(-4.0f + 8.0f * static_cast<float>(i) / 511.0f);
    gv.push_back(static_cast<float>((i * 37) % 101) / 25.0f - 2.0f);
  }
  for (Dtype dt : {Dtype::BFloat16, Dtype::Float16}) {
    for (bool is_tanh : {true, false}) {
      CAPTURE(is_tanh);
      const dp::Tensor x = dp::from_vector(xv, {512}).to(dt).set_requires_grad(true);
      const dp::Tensor g = dp::from_vector(gv, {512}).to(dt);
      const dp::Tensor y = is_tanh ? dp::tanh(x) : dp::sigmoid(x);
      y.backward(g);
      REQUIRE(x.grad().dtype() == dt);
      const std::vector<float> yv = y.to_vector(), gr = g.to_vector(), got = x.grad().to_vector();
      int wrong = 0;
      for (std::size_t i = 0; i < yv.size(); ++i) {
        const float want = round16(is_tanh ? gr[i] * (1.0f - yv[i] * yv[i]) : gr[i] * (yv[i] * (1.0f - yv[i])), dt);
        wrong += got[i] != want;
      }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("cat of floating tensors of different dtypes gives float32, as torch.cat promotes") {
  const dp::Tensor b = dp::from_vector(std::vector<float>{1.0f / 3.0f, 2.0f}, {2, 1}).to(Dtype::BFloat16);
  const dp::Tensor f = dp::from_vector(std::vector<float>{0.1f, 0.2f}, {2, 1});
  const dp::Tensor c = dp::cat({b, f}, 1);
  CHECK(c.dtype() == Dtype::Float32);
  CHECK(c.to_vector() == std::vector<float>{static_cast<float>(dp::BFloat16(1.0f / 3.0f)), 0.1f, 2.0f, 0.2f});
  CHECK(dp::cat({b, b}, 0).dtype() == Dtype::BFloat16);
  CHECK(dp::cat({b, f.to(Dtype::Float16)}, 0).dtype() == Dtype::Float32);
  const dp::Tensor br = b.clone().set_requires_grad(true);
  dp::sum(dp::cat({br, f}, 0)).backward();
  REQUIRE(br.grad().defined());
  CHECK(br.grad().dtype() == Dtype::BFloat16);
  CHECK(dp_test::throws_with([&] { (void)dp::cat({f, dp::zeros({2, 1}, dp::TensorOptions{Dtype::Int64})}); },
                             {"cat", "int64", "integers do not"}));
}

TEST_CASE("sums, means and products of 16-bit tensors accumulate in float32 and round once") {
  for (Dtype dt : kHalfDtypes) {
    CAPTURE(std::string(dp::dtype_name(dt)));
    const std::vector<float> v = values16(4096, 1.0f, dt, 3);
    const dp::Tensor x32 = dp::from_vector(v, {64, 64});
    const dp::Tensor x = x32.to(dt);
    // The float32 reduction of the same (exact) values, rounded once.
    CHECK(dp::sum(x).dtype() == dt);
    CHECK(dp::sum(x).item<float>() == round16(dp::sum(x32).item<float>(), dt));
    CHECK(same_floats(dp::sum(x, 1).to_vector(), dp::sum(x32, 1).to(dt).to_vector()));
    CHECK(same_floats(dp::mean(x, 0).to_vector(), dp::mean(x32, 0).to(dt).to_vector()));
    CHECK(dp::mean(x).item<float>() == round16(dp::mean(x32).item<float>(), dt));
    CHECK(same_floats(dp::max(x, 1).to_vector(), dp::max(x32, 1).to_vector()));  // exact both ways
    CHECK(dp::argmax(x, 1).to_vector_i64() == dp::argmax(x32, 1).to_vector_i64());
    // A rounded-per-step sum would drift: 4096 values of ~1 in bfloat16 lose the small
    // ones entirely. The float32 sum does not.
    const dp::Tensor many = dp::full({4096}, 1.0, {.dtype = dt});
    CHECK(dp::sum(many).item<float>() == 4096.0f);
    // Products: the float32 GEMM of the widened operands, rounded once.
    const dp::Tensor a32 = dp::from_vector(values16(33 * 47, 1.0f, dt, 4), {33, 47});
    const dp::Tensor b32 = dp::from_vector(values16(47 * 29, 1.0f, dt, 5), {47, 29});
    const dp::Tensor p = dp::matmul(a32.to(dt), b32.to(dt));
    CHECK(p.dtype() == dt);
    CHECK(within_one_ulp(p.to_vector(), dp::matmul(a32, b32).to(dt).to_vector(), dt));
    const dp::Tensor ba = dp::from_vector(values16(3 * 5 * 7, 1.0f, dt, 6), {3, 5, 7});
    const dp::Tensor bb = dp::from_vector(values16(3 * 7 * 4, 1.0f, dt, 7), {3, 7, 4});
    CHECK(within_one_ulp(dp::matmul(ba.to(dt), bb.to(dt)).to_vector(), dp::matmul(ba, bb).to(dt).to_vector(), dt));
  }
}

TEST_CASE("to(dtype) is differentiable between floating dtypes") {
  const dp::Tensor w = dp::from_vector(std::vector<float>{0.1f, -2.5f, 3.0f}, {3}).set_requires_grad(true);
  const dp::Tensor h = w.to(Dtype::BFloat16);
  CHECK(h.requires_grad());
  const dp::Tensor y = dp::sum(dp::mul(dp::mul(h, h), 0.5));  // d/dh = h, in bfloat16
  y.backward();
  REQUIRE(w.grad().defined());
  CHECK(w.grad().dtype() == Dtype::Float32);
  std::vector<float> want;
  for (float f : {0.1f, -2.5f, 3.0f}) want.push_back(round16(f, Dtype::BFloat16));
  CHECK(w.grad().to_vector() == want);
  // Integers are not differentiable: no gradient path through them.
  const dp::Tensor i = w.to(Dtype::Int64);
  CHECK_FALSE(i.requires_grad());
}

TEST_CASE("a 16-bit linear layer's forward and gradients") {
  for (Dtype dt : kHalfDtypes) {
    CAPTURE(std::string(dp::dtype_name(dt)));
    const dp::Tensor x32 = dp::from_vector(values16(5 * 7, 1.0f, dt, 8), {5, 7});
    const dp::Tensor w32 = dp::from_vector(values16(3 * 7, 1.0f, dt, 9), {3, 7});
    const dp::Tensor b32 = dp::from_vector(values16(3, 1.0f, dt, 10), {3});
    const dp::Tensor x = x32.to(dt).set_requires_grad(true), w = w32.to(dt).set_requires_grad(true);
    const dp::Tensor b = b32.to(dt).set_requires_grad(true);
    const dp::Tensor y = dp::linear(x, w, b);
    CHECK(y.dtype() == dt);
    // The product plus the bias, rounded once (Note [16-bit Linear: the bias in the one
    // rounding]).
    const dp::Tensor want = dp::add(dp::matmul(x32, w32.t()), b32).to(dt);
    CHECK(within_one_ulp(y.to_vector(), want.to_vector(), dt));
    dp::sum(y).backward();
    CHECK(w.grad().dtype() == dt);
    CHECK(within_one_ulp(w.grad().to_vector(), dp::matmul(dp::ones({3, 5}), x32).to(dt).to_vector(),
                         dt));  // column sums of x
    CHECK(same_floats(b.grad().to_vector(), std::vector<float>{5, 5, 5}));
    CHECK(within_one_ulp(x.grad().to_vector(), dp::matmul(dp::ones({5, 3}), w32).to(dt).to_vector(), dt));
  }
}

TEST_CASE("a 16-bit linear adds its bias before its one rounding, as PyTorch's addmm; linear_relu clips that") {
  // Note [16-bit Linear: the bias in the one rounding]. x = (1, 1), w = (1, u/2), b = -1,
  // u the dtype's unit at 1: 1 + u/2 is a tie that rounds to 1, so rounding the product
  // before the bias gives 0, rounding once gives u/2 (PyTorch 2.15's F.linear: 0.00390625
  // in bfloat16, 0.00048828125 in float16).
  for (Dtype dt : kHalfDtypes) {
    CAPTURE(std::string(dp::dtype_name(dt)));
    const float half_unit = dt == Dtype::BFloat16 ? 0x1p-8f : 0x1p-11f;
    const dp::Tensor x = dp::from_vector(std::vector<float>{1, 1}, {1, 2}).to(dt);
    const dp::Tensor w = dp::from_vector(std::vector<float>{1, half_unit}, {1, 2}).to(dt);
    CHECK(same_floats(dp::linear(x, w, dp::from_vector(std::vector<float>{-1}, {1}).to(dt)).to_vector(),
                      std::vector<float>{half_unit}));
    CHECK(same_floats(dp::linear_relu(x, w, dp::from_vector(std::vector<float>{-1}, {1}).to(dt)).to_vector(),
                      std::vector<float>{half_unit}));
    CHECK(same_floats(dp::linear(x, dp::neg(w), dp::from_vector(std::vector<float>{1}, {1}).to(dt)).to_vector(),
                      std::vector<float>{-half_unit}));
    CHECK(same_floats(dp::linear_relu(x, dp::neg(w), dp::from_vector(std::vector<float>{1}, {1}).to(dt)).to_vector(),
                      std::vector<float>{0}));
  }
  // Larger, on values whose float32 sums are exact in any order (x in eighths, w in
  // sixteenths of [-4, 4), b in sixteenths of [-8, 8): every partial sum a multiple of
  // 2^-7 below 2^10), so the sum plus the bias rounded once is one value, bit for bit:
  // 40 x 63 times 63 x 80 runs in two slabs of rows and, on an AMX CPU, through the
  // odd-k padding (Note [bf16 GEMMs with an odd k on AMX]); 5 x 16 times 16 x 24 in one.
  for (Dtype dt : kHalfDtypes) {
    for (const auto& [m, n, k] : {std::array<std::int64_t, 3>{40, 80, 63}, std::array<std::int64_t, 3>{5, 24, 16}}) {
      CAPTURE(std::string(dp::dtype_name(dt)));
      CAPTURE(k);
      std::uint32_t seed = static_cast<std::uint32_t>(m * 7 + k);
      auto grid = [&seed](std::int64_t count, int span, float unit) {
        std::vector<float> v(static_cast<std::size_t>(count));
        for (float& e : v) {
          seed = seed * 1664525u + 1013904223u;
          e = static_cast<float>(static_cast<int>(seed >> 8) % (2 * span) - span) * unit;
        }
        return v;
      };
      const std::vector<float> xs = grid(m * k, 32, 0x1p-3f), ws = grid(n * k, 64, 0x1p-4f), bs = grid(n, 128, 0x1p-4f);
      std::vector<float> want(static_cast<std::size_t>(m * n)), want_relu(want.size());
      int moved = 0;  // outputs where rounding the product first gives another value
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          float sum = 0;  // exact
          for (std::int64_t e = 0; e < k; ++e)
            sum += xs[static_cast<std::size_t>(i * k + e)] * ws[static_cast<std::size_t>(j * k + e)];
          const auto at = static_cast<std::size_t>(i * n + j);
          want[at] = round16(sum + bs[static_cast<std::size_t>(j)], dt);
          want_relu[at] = std::max(want[at], 0.0f);
          moved += round16(round16(sum, dt) + bs[static_cast<std::size_t>(j)], dt) != want[at];
        }
      CHECK(moved > 0);  // the case tells the two apart (bfloat16: a third of the outputs)
      const dp::Tensor x = dp::from_vector(xs, {m, k}).to(dt).set_requires_grad(true);
      const dp::Tensor w = dp::from_vector(ws, {n, k}).to(dt).set_requires_grad(true);
      const dp::Tensor b = dp::from_vector(bs, {n}).to(dt).set_requires_grad(true);
      const dp::Tensor y = dp::linear(x, w, b);
      CHECK(same_floats(y.to_vector(), want));
      CHECK(same_floats(dp::linear_relu(x, w, b).to_vector(), want_relu));
      // The bias's gradient is the column sums of gy, as a broadcast add's backward
      // takes them; x's and w's are the 16-bit products of gy.
      const dp::Tensor gy = dp::from_vector(grid(m * n, 8, 0.25f), {m, n}).to(dt);
      dp::sum(dp::mul(y, gy)).backward();
      CHECK(same_floats(b.grad().to_vector(), dp::sum(gy, 0, false).to_vector()));
      CHECK(same_floats(x.grad().to_vector(), dp::matmul(gy, w.detach()).to_vector()));
      CHECK(same_floats(w.grad().to_vector(), dp::matmul(gy.t(), x.detach()).to_vector()));
    }
  }
}

TEST_CASE("sums, products, norms and losses in 16 bits and float32: PyTorch's bits, or rounded once") {
  // Inputs on grids whose float32 sums are exact in any order (half_ops_reference.h):
  // an op that accumulates in float32 and rounds once has one right answer, so dp's
  // order of summation cannot hide behind a tolerance (a Linear that rounded before its
  // bias did: Note [16-bit Linear: the bias in the one rounding]). Each op's output, and
  // the gradients of sum(out * g) for g a grid in the output's dtype. Where PyTorch rounds
  // an intermediate, dp's value is the float64 one rounded once.
  // ((i * 37 + salt * 11) mod 2 span - span) * unit, as the script's grid().
  auto grid = [](dp::Shape shape, int salt, float unit, int span, Dtype d) {
    std::vector<float> v(static_cast<std::size_t>(dp::shape_numel(shape)));
    for (std::size_t i = 0; i < v.size(); ++i) {
      const auto at = static_cast<int>((i * 37 + static_cast<std::size_t>(salt) * 11) % (2 * span));
      v[i] = static_cast<float>(at - span) * unit;
    }
    return dp::from_vector(v, shape).to(d);
  };
  auto want = [](const std::string& name) {
    const std::vector<float>* v = dp_test::half_ops::find(name.c_str());
    REQUIRE_MESSAGE(v != nullptr, name);
    return *v;
  };
  for (Dtype dt : {Dtype::BFloat16, Dtype::Float16, Dtype::Float32}) {
    const std::string tag = dt == Dtype::BFloat16 ? "bf16_" : dt == Dtype::Float16 ? "f16_" : "f32_";
    CAPTURE(tag);
    auto leaf = [](dp::Tensor t) { return t.set_requires_grad(true); };
    const dp::Tensor a = leaf(grid({6, 10}, 1, 0.125f, 32, dt)), b = leaf(grid({6, 10}, 2, 0.0625f, 64, dt));
    const dp::Tensor c = leaf(grid({10}, 3, 0.25f, 16, dt));
    const dp::Tensor d = leaf(dp::add(grid({6, 10}, 4, 0.5f, 3, dt), 3.0));
    const dp::Tensor w = leaf(grid({4, 10}, 5, 0.0625f, 64, dt)), bias = leaf(grid({4}, 6, 0.0625f, 128, dt));
    const dp::Tensor x4 = leaf(grid({2, 3, 5, 5}, 7, 0.125f, 32, dt));
    const dp::Tensor w4 = leaf(grid({4, 3, 3, 3}, 8, 0.0625f, 64, dt)), b4 = leaf(grid({4}, 9, 0.0625f, 128, dt));
    const dp::Tensor lw = leaf(grid({10}, 10, 0.0625f, 64, dt)), lb = leaf(grid({10}, 11, 0.0625f, 64, dt));
    const dp::Tensor gamma = leaf(grid({3}, 12, 0.0625f, 64, Dtype::Float32));
    const dp::Tensor beta = leaf(grid({3}, 13, 0.0625f, 64, Dtype::Float32));
    const dp::Tensor target = dp::from_vector(std::vector<std::int64_t>{1, 3, 5, 7, 9, 0}, {6});
    // Per input, the gradient's reference: 'P' PyTorch's bits; 'O' the float64 gradient
    // rounded once, where PyTorch's formula rounds intermediates (softmax, layer norm,
    // mse_loss and float16's tanh-gelu: 12-38 of 60 of its values off that, dp's none);
    // 'U' within a unit of it, where both compose rounded ops (a divisor's gradient,
    // -g a / d^2) or sum a float32 gradient in another order (batch norm's weight).
    // In float32 only exact sums are one value: where exp, erf, tanh or a square root
    // enter (`approx`) float32's own roundings of them differ between libraries and
    // cancel in outputs near 0, so float32 checks the other ops here, bit for bit, and
    // leaves those to the golden tests' tolerances (and mse_loss, whose 16-bit gradients
    // are held to the float64 ones here, to loss_test's PyTorch bits).
    struct Case {
      const char* name;
      std::function<dp::Tensor()> op;
      std::vector<dp::Tensor> inputs;
      const char* refs = "PPP";
      bool approx = false;
    };
    const Case pytorch[] = {
        {"mean", [&] { return dp::mean(a); }, {a}},
        {"mean0", [&] { return dp::mean(a, 0); }, {a}},
        {"mean1", [&] { return dp::mean(a, 1); }, {a}},
        {"sum", [&] { return dp::sum(a); }, {a}},
        {"sum1", [&] { return dp::sum(a, 1); }, {a}},
        {"mul", [&] { return dp::mul(a, b); }, {a, b}},
        {"div", [&] { return dp::div(a, d); }, {a, d}, "PU"},
        {"mul_scalar", [&] { return dp::mul(a, 0.3); }, {a}},
        {"div_scalar", [&] { return dp::div(a, 3.0); }, {a}},
        {"bias_add", [&] { return dp::add(a, c); }, {a, c}},
        {"linear", [&] { return dp::linear(a, w, bias); }, {a, w, bias}},
        {"matmul", [&] { return dp::matmul(a, w.t()); }, {a, w}},
        {"conv2d", [&] { return dp::nn::conv2d(x4, w4, b4, 1, 1); }, {x4, w4, b4}},
        {"softmax", [&] { return dp::nn::softmax(a, 1); }, {a}, "O", true},
        {"layer_norm", [&] { return dp::nn::layer_norm(a, {10}, lw, lb); }, {a, lw, lb}, "OOP", true},
        {"gelu_tanh", [&] { return dp::nn::gelu(a, "tanh"); }, {a}, "O", true},
        {"mse_loss", [&] { return dp::nn::mse_loss(a, b); }, {a, b}, "OO", true},
        {"exp", [&] { return dp::exp(a); }, {a}, "P", true},
        {"batch_norm", [&] { return dp::nn::batch_norm(x4, gamma, beta, dp::Tensor(), dp::Tensor(), true); },
         {x4, gamma, beta},
         "PUP",
         true},
    };
    const bool wide = dt == Dtype::Float32;
    for (const Case& k : pytorch) {
      if (wide && k.approx) continue;
      CAPTURE(std::string(k.name));
      for (const dp::Tensor& t : k.inputs) t.set_grad(dp::Tensor());
      const dp::Tensor out = k.op();
      CHECK(out.dtype() == dt);
      CHECK(same_floats(out.to_vector(), want(tag + k.name)));
      dp::sum(dp::mul(out, grid(out.shape(), 14, 0.125f, 16, dt))).backward();
      for (std::size_t i = 0; i < k.inputs.size(); ++i) {
        CAPTURE(i);
        const dp::Tensor grad = k.inputs[i].grad();
        REQUIRE(grad.defined());
        const std::string ref = tag + k.name + "_grad" + std::to_string(i);
        switch (k.refs[i]) {
          case 'P': CHECK(same_floats(grad.to_vector(), want(ref))); break;
          case 'O': CHECK(same_floats(grad.to_vector(), want(ref + "_once"))); break;
          default: CHECK(within_one_ulp(grad.to_vector(), want(ref + "_once"), grad.dtype()));
        }
      }
    }
    const std::pair<const char*, std::function<dp::Tensor()>> once[] = {
        {"add_scalar", [&] { return dp::add(a, 0.3); }},
        {"log_softmax", [&] { return dp::nn::log_softmax(a, 1); }},
        {"cross_entropy", [&] { return dp::nn::cross_entropy(a, target); }},
        {"gelu", [&] { return dp::nn::gelu(a); }},
    };
    if (wide) continue;  // each of these is a transcendental op
    for (const auto& [name, op] : once) {
      CAPTURE(std::string(name));
      CHECK(same_floats(op().to_vector(), want(tag + name + "_once")));
    }
  }
}

TEST_CASE("copy_ and add_ across dtypes: converted as PyTorch's, a mixed sum rounded once, gradients in the source's dtype") {
  // Note [Sources of in-place writes]. 1 + (2^-8 + 2^-20) in bfloat16: rounded once it
  // is 1 + 2^-7 (PyTorch's 1.0078125); rounding the source to bfloat16 first (2^-8) makes
  // a tie that rounds to 1. 3 - (2^-7 + 2^-20): 2.984375 rounded once, 3 twice.
  const float tiny = 0x1p-8f + 0x1p-20f, tiny2 = 0x1p-7f + 0x1p-20f;
  dp::Tensor d = dp::from_vector(std::vector<float>{1, 3}, {2}).to(Dtype::BFloat16);
  d.add_(dp::from_vector(std::vector<float>{tiny}, {1}));
  CHECK(same_floats(d.to_vector(), std::vector<float>{1.0078125f, 3.0f}));
  d.copy_(dp::from_vector(std::vector<float>{1, 3}, {2}));
  d.add_(dp::from_vector(std::vector<float>{tiny, tiny2}, {2}), -1.0f);
  CHECK(same_floats(d.to_vector(), std::vector<float>{0.99609375f, 2.984375f}));
  // copy_ rounds as to(): PyTorch's bits.
  const dp::Tensor src = dp::from_vector(std::vector<float>{tiny, 1.00390625f, -7.3f, 1e-30f}, {4});
  dp::Tensor h = dp::zeros({4}, {.dtype = Dtype::Float16});
  h.copy_(src);
  CHECK(same_floats(h.to_vector(), src.to(Dtype::Float16).to_vector()));
  // bfloat16 into float16: the float32 sum, rounded once into float16.
  const dp::Tensor bf = dp::from_vector(std::vector<float>{0.1f, -3.3f, 250.f, 1e-3f}, {4}).to(Dtype::BFloat16);
  const dp::Tensor h0 = h.clone();
  h.add_(bf, 0.75f);
  CHECK(same_floats(h.to_vector(),
                    dp::add(h0.to(Dtype::Float32), dp::mul(bf.to(Dtype::Float32), 0.75)).to(Dtype::Float16).to_vector()));
  // A float32 source added into a bfloat16 result: its gradient is float32, alpha times
  // the output's; the destination's old values get the output's (PyTorch: 3, 3 and 1, 1).
  dp::Tensor x = dp::from_vector(std::vector<float>{1, 2}, {2}).to(Dtype::BFloat16);
  x.set_requires_grad(true);
  dp::Tensor s = dp::from_vector(std::vector<float>{0.5f, 0.25f}, {2});
  s.set_requires_grad(true);
  dp::Tensor u = dp::mul(x, 1.0);
  u.add_(s, 3.0f);
  CHECK(u.dtype() == Dtype::BFloat16);
  dp::sum(u).backward();
  REQUIRE(s.grad().defined());
  CHECK(s.grad().dtype() == Dtype::Float32);
  CHECK(same_floats(s.grad().to_vector(), std::vector<float>{3, 3}));
  CHECK(x.grad().dtype() == Dtype::BFloat16);
  CHECK(same_floats(x.grad().to_vector(), std::vector<float>{1, 1}));
  // copy_ of a float32 source into a bfloat16 buffer, broadcast: the gradient summed
  // over the broadcast rows and widened to float32 (PyTorch: 2 * the rounded values, twice).
  dp::Tensor w = dp::from_vector(std::vector<float>{1.00390625f, -7.3f}, {2});
  w.set_requires_grad(true);
  dp::Tensor buf = dp::zeros({3, 2}, {.dtype = Dtype::BFloat16});
  buf.copy_(dp::mul(w, 1.0));
  const dp::Tensor b32 = buf.to(Dtype::Float32);
  dp::sum(dp::mul(b32, b32)).backward();
  REQUIRE(w.grad().defined());
  CHECK(w.grad().dtype() == Dtype::Float32);
  CHECK(same_floats(w.grad().to_vector(), std::vector<float>{6.0f, -43.875f}));  // 3 rows of 2 * bf16(w)
}

TEST_CASE("bad 16-bit input is a dp::Error naming what was expected") {
  const dp::Tensor b = dp::ones({2, 3}, {.dtype = Dtype::BFloat16});
  const dp::Tensor f = dp::ones({3, 2});
  CHECK(dp_test::throws_with([&] { (void)dp::matmul(b, f); },
                             {"matmul: expected operands of one dtype, got bfloat16 and float32"}));
  CHECK(dp_test::throws_with([&] { (void)dp::linear(b, f.t(), dp::Tensor()); },
                             {"linear: expected input, weight and bias of one dtype, got bfloat16, float32"}));
  const dp::Tensor h = dp::ones({3}, {.dtype = Dtype::Float16});
  CHECK(dp_test::throws_with([&] { dp::Tensor c = b.clone(); c.add_(dp::ones({2, 2}, {.dtype = Dtype::Float16})); },
                             {"add_: expected a tensor to add whose shape broadcasts to the destination's [2, 3], got [2, 2]"}));
  CHECK(dp_test::throws_with([&] { (void)dp::from_vector(std::vector<dp::Float16>(2), {3}); },
                             {"from_vector: shape [3] needs 3 elements, got 2"}));
  (void)h;
}

TEST_CASE("safetensors keep 16-bit bits, and a file PyTorch wrote loads bitwise") {
  const std::vector<float> in = reference_inputs();
  const dp::Tensor x = dp::from_vector(in, {static_cast<std::int64_t>(in.size())});
  const dp::nn::StateDict mine{{"b", x.to(Dtype::BFloat16)}, {"h", x.to(Dtype::Float16).narrow(0, 10, 100)}};
  const std::vector<std::uint8_t> bytes = dp::io::serialize_safetensors(mine);
  const dp::nn::StateDict back = dp::io::parse_safetensors(bytes.data(), bytes.size()).tensors;
  REQUIRE(back.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(back[i].first == mine[i].first);
    CHECK(back[i].second.dtype() == mine[i].second.dtype());
    CHECK(back[i].second.shape() == mine[i].second.shape());
    CHECK(bits_of(back[i].second) == bits_of(mine[i].second));
  }
  // PyTorch's file: its conversions of kHalfFileInputs, which dp's must equal bit for bit.
  std::vector<float> file_in;
  for (std::uint32_t b : kHalfFileInputs) file_in.push_back(std::bit_cast<float>(b));
  const dp::Tensor src = dp::from_vector(file_in, {static_cast<std::int64_t>(file_in.size())});
  const dp::nn::StateDict theirs = dp::io::parse_safetensors(kHalfFileBytes, sizeof kHalfFileBytes, "torch").tensors;
  REQUIRE(theirs.size() == 2);
  for (const auto& [name, t] : theirs) {
    CAPTURE(name);
    const bool bf = name == "weight.bf16";
    CHECK(t.dtype() == (bf ? Dtype::BFloat16 : Dtype::Float16));
    CHECK(t.shape() == (bf ? dp::Shape{6, 8} : dp::Shape{48}));
    CHECK(bits_of(t) == bits_of(src.to(t.dtype())));
  }
}
