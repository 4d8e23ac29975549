// Comparisons as operators (Note [Comparison results] in dp/tensor/ops.h) and
// item<T>(): the PyTorch accuracy idiom, broadcasting, NaN, integer exactness and the
// errors of mismatched shapes, devices and dtypes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "test_devices.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

using F = std::vector<float>;

dp::Tensor f(const F& v, dp::Device dev = dp::cpu(0)) {
  return dp::from_vector(v, {static_cast<std::int64_t>(v.size())}, dev);
}

}  // namespace

TEST_CASE_TEMPLATE("every comparison operator gives float32 0/1 elementwise", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor a = f({1, 2, 3, NAN}, dev), b = f({3, 2, 1, NAN}, dev);
  CHECK((a == b).to_vector() == F{0, 1, 0, 0});
  CHECK((a != b).to_vector() == F{1, 0, 1, 1});  // NaN != NaN
  CHECK((a > b).to_vector() == F{0, 0, 1, 0});
  CHECK((a < b).to_vector() == F{1, 0, 0, 0});
  CHECK((a >= b).to_vector() == F{0, 1, 1, 0});
  CHECK((a <= b).to_vector() == F{1, 1, 0, 0});
  dp::Tensor r = a > b;
  CHECK(r.dtype() == dp::Dtype::Float32);
  CHECK(r.device() == dev);
  CHECK_FALSE(r.requires_grad());
  // Scalars on either side, as members too.
  CHECK((a > 1.5).to_vector() == F{0, 1, 1, 0});
  CHECK((a <= 2.0).to_vector() == F{1, 1, 0, 0});
  CHECK((2.0 < a).to_vector() == F{0, 0, 1, 0});
  CHECK((2.0 >= a).to_vector() == F{1, 1, 0, 0});
  CHECK((a == 2.0).to_vector() == F{0, 1, 0, 0});
  CHECK((2.0 != a).to_vector() == F{1, 0, 1, 1});
  CHECK(a.gt(b).to_vector() == (a > b).to_vector());
  CHECK(a.le(2.0).to_vector() == (a <= 2.0).to_vector());
  CHECK(a.ne(b).to_vector() == (a != b).to_vector());
}

TEST_CASE("comparisons broadcast like add") {
  dp::Tensor col = dp::from_vector(F{1, 2, 3}, {3, 1});
  dp::Tensor row = dp::from_vector(F{2, 2}, {1, 2});
  dp::Tensor ge = col >= row;
  CHECK(ge.shape() == dp::Shape{3, 2});
  CHECK(ge.to_vector() == F{0, 0, 1, 1, 1, 1});
  CHECK((row < col).to_vector() == F{0, 0, 0, 0, 1, 1});
}

TEST_CASE("the accuracy idiom: (out.argmax(1) == y).sum().item<int64_t>()") {
  dp::Tensor out = dp::from_vector(F{0.1f, 0.9f, 0.8f, 0.2f, 0.3f, 0.7f}, {3, 2});
  for (dp::Dtype label_type : {dp::Dtype::Int64, dp::Dtype::Int32}) {
    dp::Tensor y = dp::from_vector(std::vector<std::int64_t>{1, 1, 1}, {3}).to(label_type);
    CHECK((out.argmax(1) == y).sum().item<std::int64_t>() == 2);
    CHECK((out.argmax(1) != y).sum().item<std::int64_t>() == 1);
    CHECK((out.argmax(1) == y).mean().item<float>() == doctest::Approx(2.0 / 3.0));
  }
}

TEST_CASE("integer tensors compare exactly for == and !=, and refuse an order") {
  const std::int64_t big = (std::int64_t{1} << 40) + 1;  // not a float32
  dp::Tensor a = dp::from_vector(std::vector<std::int64_t>{big, big - 1, 5}, {3});
  dp::Tensor b = dp::from_vector(std::vector<std::int64_t>{big, big, 5}, {3});
  CHECK((a == b).to_vector() == F{1, 0, 1});
  CHECK((a != b).to_vector() == F{0, 1, 0});
  CHECK((a == 5.0).to_vector() == F{0, 0, 1});
  CHECK((a == static_cast<double>(big - 1)).to_vector() == F{0, 1, 0});
  CHECK((a == 5.5).to_vector() == F{0, 0, 0});  // no integer equals it
  CHECK((a != 5.5).to_vector() == F{1, 1, 1});
  CHECK((a == 1e30).to_vector() == F{0, 0, 0});  // outside int64
  CHECK_THROWS_WITH_AS(a > b, doctest::Contains("expected floating tensors, got int64 and int64"), dp::Error);
  CHECK_THROWS_WITH_AS(a < 3.0, doctest::Contains("integer tensors compare with == and != only"), dp::Error);
  CHECK_THROWS_WITH_AS(a == f({1, 2, 3}), doctest::Contains("expected one dtype"), dp::Error);
}

TEST_CASE("comparisons of mismatched shapes, devices or undefined tensors are errors") {
  dp::Tensor a = f({1, 2, 3});
  CHECK_THROWS_WITH_AS(a == f({1, 2}), doctest::Contains("cannot be broadcast"), dp::Error);
  CHECK_THROWS_WITH_AS(a < f({1, 2}), doctest::Contains("shapes [3] and [2] cannot be broadcast"), dp::Error);
  CHECK_THROWS_WITH_AS(a <= f({1, 2}), doctest::Contains("shapes [3] and [2] cannot be broadcast"), dp::Error);
  CHECK_THROWS_WITH_AS(a >= f({1, 2}), doctest::Contains("cannot be broadcast"), dp::Error);
  CHECK_THROWS_WITH_AS(a > f({1, 2, 3}, dp::cpu(1)), doctest::Contains("cpu:0 and cpu:1"), dp::Error);
  CHECK_THROWS_WITH_AS(a != f({1, 2, 3}, dp::cpu(1)), doctest::Contains("cpu:0 and cpu:1"), dp::Error);
  CHECK_THROWS_AS(dp::Tensor() > 0.5, dp::Error);
  CHECK_THROWS_AS(dp::Tensor() == 0.5, dp::Error);
}

TEST_CASE("item<T>() converts the one element; several elements and lossy conversions are errors") {
  CHECK(dp::scalar_tensor(2.5).item<float>() == 2.5f);
  CHECK(dp::scalar_tensor(2.5).item<double>() == 2.5);
  CHECK(dp::scalar_tensor(-2.5).item<std::int64_t>() == -2);  // toward zero, as static_cast
  CHECK(dp::scalar_tensor(0.0).item<bool>() == false);
  CHECK(dp::scalar_tensor(NAN).item<bool>() == true);
  const std::int64_t big = (std::int64_t{1} << 62) + 1;  // not a double
  dp::Tensor i = dp::from_vector(std::vector<std::int64_t>{big}, {1});
  CHECK(i.item<std::int64_t>() == big);
  CHECK(dp::from_vector(std::vector<std::int32_t>{-7}, {1, 1}).item<std::int32_t>() == -7);
  CHECK(dp::from_vector(std::vector<std::int32_t>{-7}, {1}).item<std::int64_t>() == -7);
  CHECK(dp::ones({1}, dp::cpu(2)).item<float>() == 1.0f);

  CHECK_THROWS_WITH_AS(dp::ones({2}).item<float>(), doctest::Contains("expected a tensor with one element, got shape [2]"),
                       dp::Error);
  CHECK_THROWS_AS(dp::ones({2, 3}).item<std::int64_t>(), dp::Error);
  CHECK_THROWS_AS(dp::zeros({0}).item<bool>(), dp::Error);
  CHECK_THROWS_AS(dp::Tensor().item<double>(), dp::Error);
  CHECK_THROWS_WITH_AS(dp::scalar_tensor(NAN).item<std::int64_t>(), doctest::Contains("NaN, infinite or out of range"),
                       dp::Error);
  CHECK_THROWS_AS(dp::scalar_tensor(INFINITY).item<std::int32_t>(), dp::Error);
  CHECK_THROWS_AS(dp::scalar_tensor(3e9).item<std::int32_t>(), dp::Error);
  CHECK_THROWS_WITH_AS(i.item<std::int32_t>(), doctest::Contains("out of int32_t's range"), dp::Error);
}
