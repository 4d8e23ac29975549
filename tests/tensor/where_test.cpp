// tests/tensor/where_test.cpp — where, masked_fill, tril and triu against PyTorch
// (where_reference.h): values, gradients, broadcasting of all three operands, what a
// condition holds for (Note [Conditions are float32]), and bad input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"
#include "test_devices.h"
#include "test_errors.h"
#include "where_reference.h"

namespace {

using dp::Shape;
using dp::Tensor;
using F = std::vector<float>;
namespace ref = where_reference;

// Max |t - want|; NaN when either has one (dp::max_abs_diff), so no check passes on NaN.
double max_diff(const Tensor& t, const F& want) { return dp::max_abs_diff(t, dp::from_vector(want, t.shape(), t.device())); }

Tensor leaf(const F& v, const Shape& s, dp::Device dev) { return dp::from_vector(v, s, dev).set_requires_grad(true); }

}  // namespace

TEST_CASE_TEMPLATE("where matches PyTorch with cond, a and b all broadcast, and its gradients", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor cond = dp::from_vector(ref::kWhereCond, {1, 4}, dev);
  Tensor a = leaf(ref::kWhereA, {2, 3, 4}, dev), b = leaf(ref::kWhereB, {3, 1}, dev);
  Tensor y = dp::where(cond, a, b);
  CHECK(y.shape() == Shape{2, 3, 4});
  CHECK(y.device() == dev);
  CHECK(max_diff(y, ref::kWhereOut) == 0);  // a selection: exact
  dp::sum(dp::mul(y, dp::from_vector(ref::kWhereUp, {2, 3, 4}, dev))).backward();
  CHECK(max_diff(a.grad(), ref::kWhereGradA) == 0);
  CHECK(max_diff(b.grad(), ref::kWhereGradB) < 1e-6);  // summed over the broadcast dims
}

TEST_CASE("where: any nonzero condition holds, NaN included; the side not chosen never leaks") {
  Tensor cond = dp::from_vector(F{0, 1, 2, -0.5f, NAN, 0}, {6});
  Tensor a = dp::from_vector(F{1, 2, 3, 4, 5, INFINITY}, {6}).set_requires_grad(true);
  Tensor b = dp::from_vector(F{-1, NAN, -INFINITY, -4, -5, -6}, {6}).set_requires_grad(true);
  Tensor y = dp::where(cond, a, b);
  CHECK(y.to_vector() == F{-1, 2, 3, 4, 5, -6});
  dp::sum(y).backward();
  CHECK(a.grad().to_vector() == F{0, 1, 1, 1, 1, 0});
  CHECK(b.grad().to_vector() == F{1, 0, 0, 0, 0, 1});
  // Scalars on either side; the comparisons' 0/1 as conditions.
  Tensor x = dp::from_vector(F{-2, -1, 0, 1, 2}, {5});
  CHECK(dp::where(x > 0, x, 0.0).to_vector() == F{0, 0, 0, 1, 2});
  CHECK(dp::where(x > 0, 7.0, x).to_vector() == F{-2, -1, 0, 7, 7});
  CHECK(dp::where(x >= 0, x, dp::mul(x, 0.5)).to_vector() == F{-1, -0.5f, 0, 1, 2});  // leaky
  // A scalar condition, and an empty result.
  CHECK(dp::where(dp::scalar_tensor(1.0), x, 3.0).to_vector() == x.to_vector());
  CHECK(dp::where(dp::zeros({0}), dp::zeros({0}), 1.0).shape() == Shape{0});
  // Long rows above the CPU's parallel grain, the mask transposed against the values.
  const std::int64_t R = 300, C = 257;
  Tensor big = dp::randn({R, C});
  Tensor m = dp::gt(dp::randn({C, R}), 0.0).t();
  const F bv = big.to_vector(), mv = m.to_vector(), got = dp::where(m, big, -1.0).to_vector();
  bool same = true;
  for (std::size_t i = 0; i < bv.size(); ++i) same = same && got[i] == (mv[i] != 0 ? bv[i] : -1.0f);
  CHECK(same);
}

TEST_CASE("where, masked_fill and tril keep a 16-bit dtype; mixed values promote to float32") {
  for (dp::Dtype dt : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dt));
    Tensor cond = dp::from_vector(ref::kWhereCond, {1, 4});
    Tensor a = dp::from_vector(ref::kWhereA, {2, 3, 4}).to(dt).set_requires_grad(true);
    Tensor b = dp::from_vector(ref::kWhereB, {3, 1}).to(dt);
    Tensor y = dp::where(cond, a, b);
    CHECK(y.dtype() == dt);
    // A selection of 16-bit values: exactly PyTorch's float32 result rounded once.
    CHECK(dp::equal(y, dp::from_vector(ref::kWhereOut, {2, 3, 4}).to(dt)));
    dp::sum(y.to(dp::Dtype::Float32)).backward();
    CHECK(a.grad().dtype() == dt);
    CHECK(dp::sum(a.grad().to(dp::Dtype::Float32)).item() == 12.0);  // half the 24 places chose a
    CHECK(dp::where(cond.to(dt), a.detach(), b).dtype() == dt);       // a 16-bit condition
    CHECK(dp::where(cond, a.detach(), b.to(dp::Dtype::Float32)).dtype() == dp::Dtype::Float32);
    Tensor filled = a.detach().masked_fill(dp::from_vector(ref::kMaskedFillMask, {3, 4}), -INFINITY);
    CHECK(filled.dtype() == dt);
    CHECK(dp::tril(a.detach()).dtype() == dt);
  }
}

TEST_CASE_TEMPLATE("masked_fill matches PyTorch; filled places get no gradient", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor x = leaf(ref::kMaskedFillX, {2, 3, 4}, dev);
  Tensor mask = dp::from_vector(ref::kMaskedFillMask, {3, 4}, dev);
  Tensor y = x.masked_fill(mask, -1.5);
  CHECK(max_diff(y, ref::kMaskedFillOut) == 0);
  dp::sum(dp::mul(y, dp::from_vector(ref::kWhereUp, {2, 3, 4}, dev))).backward();
  CHECK(max_diff(x.grad(), ref::kMaskedFillGrad) == 0);
  // -inf, as attention masks use it: exactly -inf where masked, x elsewhere.
  const F inf = dp::masked_fill(x.detach(), mask, -INFINITY).to_vector(), xv = x.to_vector();
  const F mv = ref::kMaskedFillMask;
  bool ok = true;
  for (std::size_t i = 0; i < inf.size(); ++i) ok = ok && inf[i] == (mv[i % 12] != 0 ? -INFINITY : xv[i]);
  CHECK(ok);
}

TEST_CASE_TEMPLATE("tril and triu match PyTorch for every diagonal over batch dims, and tril's gradient", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  Tensor x = leaf(ref::kTriX, {2, 3, 4, 5}, dev);
  CHECK(max_diff(dp::tril(x, -1), ref::kTrilM1) == 0);
  CHECK(max_diff(dp::triu(x, -1), ref::kTriuM1) == 0);
  CHECK(max_diff(dp::tril(x), ref::kTril0) == 0);
  CHECK(max_diff(dp::triu(x), ref::kTriu0) == 0);
  CHECK(max_diff(dp::tril(x, 2), ref::kTril2) == 0);
  CHECK(max_diff(dp::triu(x, 2), ref::kTriu2) == 0);
  dp::sum(dp::mul(dp::tril(x, 1), dp::from_vector(ref::kTriUp, {2, 3, 4, 5}, dev))).backward();
  CHECK(max_diff(x.grad(), ref::kTril1Grad) == 0);
}

TEST_CASE("tril and triu: zeros (not inf * 0) outside the triangle, a 2-d input, the causal mask") {
  Tensor inf = dp::full({3, 3}, INFINITY);
  CHECK(dp::tril(inf).to_vector() == F{INFINITY, 0, 0, INFINITY, INFINITY, 0, INFINITY, INFINITY, INFINITY});
  // triu(ones, 1) is what a causal query must not see; masked_fill turns it into -inf.
  Tensor future = dp::triu(dp::ones({3, 3}), 1);
  CHECK(future.to_vector() == F{0, 1, 1, 0, 0, 1, 0, 0, 0});
  CHECK(dp::zeros({3, 3}).masked_fill(future, -INFINITY).to_vector() ==
        F{0, -INFINITY, -INFINITY, 0, 0, -INFINITY, 0, 0, 0});
  // Diagonals past the matrix keep all or nothing.
  CHECK(dp::sum(dp::tril(dp::ones({2, 4}), 10)).item() == 8.0);
  CHECK(dp::sum(dp::triu(dp::ones({2, 4}), 10)).item() == 0.0);
  CHECK(dp::sum(dp::tril(dp::ones({2, 4}), -2)).item() == 0.0);
}

TEST_CASE("where, masked_fill, tril and triu: bad input names what was expected and what came") {
  Tensor a = dp::zeros({2, 3}), c = dp::ones({2, 3});
  using dp_test::throws_with;
  CHECK(throws_with([&] { (void)dp::where(dp::ones({4}), a, a); },
                    {"where", "broadcast together", "[4]", "[2, 3]"}));
  CHECK(throws_with([&] { (void)dp::where(c, a, dp::zeros({3, 2})); }, {"where", "[2, 3]", "[3, 2]"}));
  CHECK(throws_with([&] { (void)dp::where(c.to(dp::Dtype::Int64), a, a); },
                    {"where", "expected a float32 condition", "got int64"}));
  CHECK(throws_with([&] { (void)dp::where(c, a.to(dp::Dtype::Int64), a); }, {"where", "float32", "got int64"}));
  CHECK(throws_with([&] { (void)dp::where(c, a, dp::zeros({2, 3}, dp::cpu(1))); }, {"where", "cpu:0 and cpu:1"}));
  CHECK(throws_with([&] { (void)dp::where(Tensor(), a, a); }, {"where", "defined"}));
  CHECK(throws_with([&] { (void)a.masked_fill(dp::ones({2, 2, 3}), 1.0); },
                    {"masked_fill", "broadcasts to the input's shape [2, 3]", "got mask [2, 2, 3]"}));
  CHECK(throws_with([&] { (void)a.masked_fill(dp::ones({4}), 1.0); }, {"masked_fill", "[2, 3]", "[4]"}));
  CHECK(throws_with([&] { (void)a.masked_fill(c.to(dp::Dtype::Int32), 1.0); }, {"float32 condition", "int32"}));
  CHECK(throws_with([&] { (void)dp::tril(dp::zeros({4})); }, {"tril", "at least 2 dims", "[4]"}));
  CHECK(throws_with([&] { (void)dp::triu(dp::zeros({4, 4}, dp::TensorOptions{dp::Dtype::Int64})); },
                    {"triu", "float32", "int64"}));
}
