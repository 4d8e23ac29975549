// Tests for dp::Tensor (src/tensor/tensor.cpp): creation, shapes, views, devices,
// dtype casts, in-place ops, host access and the errors each of them raises.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "test_devices.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"
#include "tensor/tensor_util.h"

namespace {


using F = std::vector<float>;
using I = std::vector<std::int64_t>;

}  // namespace

TEST_CASE_TEMPLATE("creation functions give the requested shape, dtype, device and values", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();

  dp::Tensor z = dp::zeros({2, 3}, dev);
  CHECK(z.shape() == dp::Shape{2, 3});
  CHECK(z.dtype() == dp::Dtype::Float32);
  CHECK(z.device() == dev);
  CHECK(z.numel() == 6);
  CHECK(z.nbytes() == 24);
  CHECK(z.to_vector() == F(6, 0.0f));

  CHECK(dp::ones({3}, dev).to_vector() == F{1, 1, 1});
  CHECK(dp::full({2, 2}, 2.5, dp::TensorOptions{dp::Dtype::Float32, dev}).to_vector() == F(4, 2.5f));
  dp::Tensor fi = dp::full({3}, -7, dp::TensorOptions{dp::Dtype::Int64, dev});
  CHECK(fi.dtype() == dp::Dtype::Int64);
  CHECK(fi.nbytes() == 24);
  CHECK(fi.to_vector_i64() == I{-7, -7, -7});
  CHECK(dp::zeros({2}, dp::TensorOptions{dp::Dtype::Int64, dev}).to_vector_i64() == I{0, 0});

  CHECK(dp::arange(4, dp::TensorOptions{dp::Dtype::Float32, dev}).to_vector() == F{0, 1, 2, 3});
  CHECK(dp::arange(3, dp::TensorOptions{dp::Dtype::Int64, dev}).to_vector_i64() == I{0, 1, 2});
  CHECK(dp::arange(0, dp::TensorOptions{dp::Dtype::Int64, dev}).numel() == 0);

  dp::Tensor v = dp::from_vector(F{1, 2, 3, 4, 5, 6}, {3, 2}, dev);
  CHECK(v.shape() == dp::Shape{3, 2});
  CHECK(v.to_vector() == F{1, 2, 3, 4, 5, 6});
  dp::Tensor vi = dp::from_vector(I{5, -1}, {2}, dev);
  CHECK(vi.dtype() == dp::Dtype::Int64);
  CHECK(vi.to_vector_i64() == I{5, -1});

  dp::Tensor s = dp::scalar_tensor(3.25, dev);
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.item() == 3.25);

  dp::Tensor like = dp::ones_like(vi);
  CHECK(like.dtype() == dp::Dtype::Int64);
  CHECK(like.device() == dev);
  CHECK(like.to_vector_i64() == I{1, 1});
  CHECK(dp::zeros_like(v).to_vector() == F(6, 0.0f));
  CHECK(dp::empty_like(v).shape() == v.shape());

  // Size-0 tensors are valid everywhere.
  dp::Tensor e = dp::zeros({0, 4}, dev);
  CHECK(e.numel() == 0);
  CHECK(e.to_vector().empty());
  CHECK(dp::from_vector(F{}, {0}, dev).numel() == 0);
}

TEST_CASE("creation rejects bad shapes and sizes") {
  CHECK_THROWS_WITH_AS(dp::zeros({2, -3}), doctest::Contains("[2, -3]"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::from_vector(F{1, 2, 3}, {2, 2}), doctest::Contains("[2, 2]"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::from_vector(F{1, 2, 3}, {2, 2}), doctest::Contains("got 3"), dp::Error);
  CHECK_THROWS_AS(dp::arange(-1), dp::Error);
  dp::Generator gen(1);
  CHECK_THROWS_AS(dp::uniform({2}, 1.0, 0.0, gen), dp::Error);
}

TEST_CASE("random creation is reproducible from the seed on every device") {
  dp::Generator g1(42), g2(42);
  dp::Tensor a = dp::randn({100}, g1, dp::cpu(0));
  dp::Tensor b = dp::randn({100}, g2, dp::cpu(3));
  CHECK(b.device() == dp::cpu(3));
  CHECK(a.to_vector() == b.to_vector());
  CHECK(g1.offset() == 100);
  // The next draw continues the stream: it differs from the first.
  dp::Tensor c = dp::randn({100}, g1, dp::cpu(0));
  CHECK(c.to_vector() != a.to_vector());

  dp::Generator g3(7);
  auto u = dp::uniform({1000}, -2.0, 3.0, g3).to_vector();
  double mean = 0;
  for (float x : u) {
    CHECK(x >= -2.0f);
    CHECK(x < 3.0f);
    mean += x;
  }
  CHECK(mean / 1000 == doctest::Approx(0.5).epsilon(0.1));

  dp::manual_seed(9);
  dp::Tensor m1 = dp::randn({8}, dp::default_generator());
  dp::manual_seed(9);
  dp::Tensor m2 = dp::randn({8}, dp::default_generator());
  CHECK(dp::equal(m1, m2));
}

TEST_CASE("shape accessors, negative dims and printing") {
  dp::Tensor t = dp::zeros({2, 3, 4});
  CHECK(t.dim() == 3);
  CHECK(t.size(0) == 2);
  CHECK(t.size(-1) == 4);
  CHECK(t.size(-3) == 2);
  CHECK_THROWS_WITH_AS(t.size(3), doctest::Contains("[2, 3, 4]"), dp::Error);
  CHECK_THROWS_AS(t.size(-4), dp::Error);
  CHECK(t.str() == "Tensor[2, 3, 4] float32 cpu:0");
  CHECK(dp::Tensor().str() == "Tensor(undefined)");
  CHECK(dp::shape_str({}) == "[]");
  CHECK(dp::shape_numel({}) == 1);
  CHECK(dp::shape_numel({3, 0}) == 0);
  CHECK(std::string(dp::dtype_name(dp::Dtype::Int64)) == "int64");
  CHECK(dp::element_size(dp::Dtype::Float32) == 4);
  CHECK(dp::element_size(dp::Dtype::Int64) == 8);

  dp::Tensor undefined;
  CHECK_FALSE(undefined.defined());
  CHECK_THROWS_WITH_AS(undefined.shape(), doctest::Contains("undefined"), dp::Error);
  CHECK_THROWS_AS(undefined.numel(), dp::Error);
}

TEST_CASE_TEMPLATE("reshape, flatten, unsqueeze and squeeze are views of the same storage", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor a = dp::from_vector(F{0, 1, 2, 3, 4, 5}, {2, 3}, dev);

  dp::Tensor r = a.reshape({3, -1});
  CHECK(r.shape() == dp::Shape{3, 2});
  CHECK(r.storage() == a.storage());
  CHECK(r.to_vector() == a.to_vector());
  r.fill_(7);  // writes through the view are seen by the base
  CHECK(a.to_vector() == F(6, 7.0f));

  CHECK(a.view({6}).shape() == dp::Shape{6});
  CHECK(a.reshape({-1}).shape() == dp::Shape{6});
  CHECK(a.reshape({1, 2, 1, 3}).shape() == dp::Shape{1, 2, 1, 3});

  dp::Tensor b = dp::zeros({2, 3, 4, 5}, dev);
  CHECK(b.flatten().shape() == dp::Shape{120});
  CHECK(b.flatten(1).shape() == dp::Shape{2, 60});
  CHECK(b.flatten(1, 2).shape() == dp::Shape{2, 12, 5});
  CHECK(b.flatten(-2, -1).shape() == dp::Shape{2, 3, 20});
  CHECK(dp::scalar_tensor(1, dev).flatten().shape() == dp::Shape{1});
  CHECK_THROWS_AS(b.flatten(2, 1), dp::Error);
  CHECK_THROWS_AS(b.flatten(0, 4), dp::Error);

  CHECK(a.unsqueeze(0).shape() == dp::Shape{1, 2, 3});
  CHECK(a.unsqueeze(2).shape() == dp::Shape{2, 3, 1});
  CHECK(a.unsqueeze(-1).shape() == dp::Shape{2, 3, 1});
  CHECK(a.unsqueeze(1).squeeze(1).shape() == dp::Shape{2, 3});
  CHECK(a.unsqueeze(-1).squeeze(-1).shape() == dp::Shape{2, 3});
  CHECK_THROWS_WITH_AS(a.squeeze(0), doctest::Contains("[2, 3]"), dp::Error);
  CHECK_THROWS_AS(a.unsqueeze(4), dp::Error);
  CHECK_THROWS_AS(a.squeeze(5), dp::Error);

  // Size-0 reshape.
  CHECK(dp::zeros({0, 3}, dev).reshape({3, 0}).shape() == dp::Shape{3, 0});
}

TEST_CASE("bad reshapes name the source shape and the requested one") {
  dp::Tensor a = dp::zeros({2, 3});
  CHECK_THROWS_WITH_AS(a.reshape({4, 2}), doctest::Contains("[2, 3]"), dp::Error);
  CHECK_THROWS_WITH_AS(a.reshape({4, 2}), doctest::Contains("[4, 2]"), dp::Error);
  CHECK_THROWS_WITH_AS(a.reshape({4, -1}), doctest::Contains("[4, -1]"), dp::Error);
  CHECK_THROWS_WITH_AS(a.reshape({4, -1}), doctest::Contains("[2, 3]"), dp::Error);
  CHECK_THROWS_WITH_AS(a.reshape({-1, -1}), doctest::Contains("-1"), dp::Error);
  CHECK_THROWS_AS(a.reshape({-2, -3}), dp::Error);
  CHECK_THROWS_AS(a.reshape({0, -1}), dp::Error);
}

TEST_CASE_TEMPLATE("narrow is a view of rows; out-of-range rows and dims are rejected", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor a = dp::from_vector(F{0, 1, 2, 3, 4, 5, 6, 7}, {4, 2}, dev);
  dp::Tensor n = a.narrow(0, 1, 2);
  CHECK(n.shape() == dp::Shape{2, 2});
  CHECK(n.storage() == a.storage());
  CHECK(n.storage_offset() == 2);
  CHECK(n.to_vector() == F{2, 3, 4, 5});
  // Narrow of a narrow adds offsets.
  dp::Tensor nn = n.narrow(0, 1, 1);
  CHECK(nn.storage_offset() == 4);
  CHECK(nn.to_vector() == F{4, 5});
  n.zero_();
  CHECK(a.to_vector() == F{0, 1, 0, 0, 0, 0, 6, 7});
  CHECK(a.narrow(0, 4, 0).numel() == 0);
  CHECK(a.narrow(0, 0, 4).to_vector() == a.to_vector());

  CHECK_THROWS_WITH_AS(a.narrow(0, 3, 2), doctest::Contains("[4, 2]"), dp::Error);
  CHECK_THROWS_WITH_AS(a.narrow(0, 3, 2), doctest::Contains("[3, 5)"), dp::Error);
  // A negative start counts from the end, as torch.narrow; other dims are covered in
  // indexing_test.
  CHECK(a.narrow(0, -1, 1).to_vector() == F{6, 7});
  CHECK_THROWS_AS(a.narrow(0, -5, 1), dp::Error);
  CHECK_THROWS_AS(a.narrow(0, 0, -1), dp::Error);
  CHECK_THROWS_WITH_AS(a.narrow(2, 0, 1), doctest::Contains("got 2"), dp::Error);
  CHECK_THROWS_AS(dp::scalar_tensor(1, dev).narrow(0, 0, 1), dp::Error);
}

TEST_CASE_TEMPLATE("t() transposes into new storage", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor a = dp::from_vector(F{1, 2, 3, 4, 5, 6}, {2, 3}, dev);
  dp::Tensor t = a.t();
  CHECK(t.shape() == dp::Shape{3, 2});
  CHECK(t.to_vector() == F{1, 4, 2, 5, 3, 6});
  CHECK(t.storage() != a.storage());
  CHECK(t.t().to_vector() == a.to_vector());
  CHECK(dp::zeros({0, 3}, dev).t().shape() == dp::Shape{3, 0});
  CHECK_THROWS_WITH_AS(dp::zeros({2}, dev).t(), doctest::Contains("[2]"), dp::Error);
  CHECK_THROWS_AS(dp::from_vector(I{1, 2}, {1, 2}, dev).t(), dp::Error);
}

TEST_CASE("to(device) copies across CPU virtual devices; the same device is a no-op") {
  dp::Tensor a = dp::from_vector(F{1, 2, 3}, {3}, dp::cpu(0));
  dp::Tensor b = a.to(dp::cpu(1));
  CHECK(b.device() == dp::cpu(1));
  CHECK(b.storage() != a.storage());
  CHECK(b.to_vector() == F{1, 2, 3});
  CHECK(a.to(dp::cpu(0)).is_same(a));
  b.fill_(0);
  CHECK(a.to_vector() == F{1, 2, 3});  // a real copy

  dp::Tensor i = dp::from_vector(I{4, 5}, {2}, dp::cpu(2));
  CHECK(i.to(dp::cpu(5)).to_vector_i64() == I{4, 5});
  CHECK(i.to(dp::cpu(5)).dtype() == dp::Dtype::Int64);
  CHECK(dp::zeros({0}, dp::cpu(0)).to(dp::cpu(1)).numel() == 0);
}

TEST_CASE_TEMPLATE("dtype casts truncate toward zero and keep the device", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor f = dp::from_vector(F{2.7f, -2.7f, 0.0f, 5.0f}, {2, 2}, dev);
  dp::Tensor i = f.to(dp::Dtype::Int64);
  CHECK(i.dtype() == dp::Dtype::Int64);
  CHECK(i.device() == dev);
  CHECK(i.shape() == dp::Shape{2, 2});
  CHECK(i.to_vector_i64() == I{2, -2, 0, 5});
  dp::Tensor back = i.to(dp::Dtype::Float32);
  CHECK(back.to_vector() == F{2, -2, 0, 5});
  CHECK(f.to(dp::Dtype::Float32).is_same(f));
}

TEST_CASE_TEMPLATE("in-place ops write through, bump the storage version and check inputs", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor a = dp::from_vector(F{1, 2, 3, 4}, {4}, dev);
  std::uint64_t v0 = a.storage()->version();
  a.mul_(2.0f);
  CHECK(a.to_vector() == F{2, 4, 6, 8});
  CHECK(a.storage()->version() == v0 + 1);
  a.add_(dp::from_vector(F{1, 1, 1, 1}, {4}, dev), -0.5f);
  CHECK(a.to_vector() == F{1.5f, 3.5f, 5.5f, 7.5f});
  a.fill_(3);
  CHECK(a.to_vector() == F(4, 3.0f));
  a.zero_();
  CHECK(a.to_vector() == F(4, 0.0f));
  CHECK(a.storage()->version() == v0 + 4);

  // copy_ from another device, into a view.
  dp::Tensor src = dp::from_vector(F{9, 8}, {2}, dp::cpu(4));
  a.narrow(0, 1, 2).copy_(src);
  CHECK(a.to_vector() == F{0, 9, 8, 0});
  CHECK(a.storage()->version() == v0 + 5);

  dp::Tensor i = dp::from_vector(I{1, 2}, {2}, dev);
  i.fill_(-4);
  CHECK(i.to_vector_i64() == I{-4, -4});
  i.zero_();
  CHECK(i.to_vector_i64() == I{0, 0});

  // A source that does not broadcast to the destination's shape (Note [Sources of
  // in-place writes]): named with both shapes, nothing written.
  const std::uint64_t v1 = a.storage()->version();
  for (const dp::Shape& bad : {dp::Shape{3}, dp::Shape{2, 4}, dp::Shape{1, 4}}) {
    CAPTURE(dp::shape_str(bad));
    CHECK_THROWS_WITH_AS(a.copy_(dp::zeros(bad, dev)), doctest::Contains("broadcasts to the destination's [4]"),
                         dp::Error);
    CHECK_THROWS_WITH_AS(a.copy_(dp::zeros(bad, dev)), doctest::Contains(dp::shape_str(bad).c_str()), dp::Error);
    CHECK_THROWS_WITH_AS(a.add_(dp::zeros(bad, dev)), doctest::Contains(dp::shape_str(bad).c_str()), dp::Error);
  }
  CHECK_THROWS_WITH_AS(a.copy_(dp::Tensor()), doctest::Contains("undefined"), dp::Error);
  CHECK_THROWS_WITH_AS(a.add_(dp::Tensor()), doctest::Contains("undefined"), dp::Error);
  CHECK_THROWS_AS(i.mul_(2.0f), dp::Error);
  CHECK_THROWS_WITH_AS(i.add_(dp::ones({2}, dev)), doctest::Contains("floating"), dp::Error);
  CHECK(a.storage()->version() == v1);
  CHECK(a.to_vector() == F{0, 9, 8, 0});

  // As PyTorch's: a source broadcast, and converted to the destination's dtype.
  a.copy_(dp::from_vector(F{5}, {1}, dev));
  CHECK(a.to_vector() == F{5, 5, 5, 5});
  a.copy_(dp::from_vector(I{1, -2, 3, 4}, {4}, dev));
  CHECK(a.to_vector() == F{1, -2, 3, 4});
  a.add_(dp::from_vector(I{10}, {}, dev), 0.5f);
  CHECK(a.to_vector() == F{6, 3, 8, 9});
  dp::Tensor m = dp::zeros({2, 3}, dev);
  m.add_(dp::from_vector(F{1, 2, 3}, {3}, dev));
  m.add_(dp::from_vector(F{10, 20}, {2, 1}, dev), 2.0f);
  CHECK(m.to_vector() == F{21, 22, 23, 41, 42, 43});
  dp::Tensor n = dp::zeros({3}, dp::TensorOptions{dp::Dtype::Int64, dev});
  n.copy_(dp::from_vector(F{1.75f, -2.5f, 3}, {3}, dev));  // truncated toward zero
  CHECK(n.to_vector_i64() == I{1, -2, 3});
}

TEST_CASE_TEMPLATE("a write through mutable_data bumps the storage version; data does not", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor a = dp::from_vector(F{1, 2, 3, 4}, {4}, dev);
  dp::Tensor view = a.narrow(0, 2, 2);  // shares a's storage, and so its version
  const std::uint64_t v0 = a.storage()->version();

  // Reads (and the host copies built on them) leave the version alone.
  CHECK(a.data<float>() != nullptr);
  CHECK(a.data<const float>() == a.data<float>());
  CHECK(a.raw_data() == static_cast<void*>(a.data<float>()));
  CHECK(a.to_vector() == F{1, 2, 3, 4});
  CHECK(a.storage()->version() == v0);

  // A write through the mutable pointer of a view: one bump, seen by every view.
  float* p = view.mutable_data<float>();
  CHECK(p == a.data<float>() + 2);
  CHECK(a.storage()->version() == v0 + 1);
  dp::Tensor src = dp::from_vector(F{7, 9}, {2}, dev);
  dp::detail::copy_bytes(p, dev, src.data<float>(), dev, 2 * sizeof(float));
  CHECK(a.to_vector() == F{1, 2, 7, 9});
  CHECK(view.storage()->version() == v0 + 1);

  CHECK(a.mutable_raw_data() == static_cast<void*>(a.data<float>()));
  CHECK(a.storage()->version() == v0 + 2);

  // A rejected dtype moves nothing; int64 tensors have their own mutable pointer.
  CHECK_THROWS_AS(a.mutable_data<std::int64_t>(), dp::Error);
  CHECK(a.storage()->version() == v0 + 2);
  dp::Tensor i = dp::from_vector(I{1, 2}, {2}, dev);
  const std::uint64_t vi = i.storage()->version();
  CHECK(i.mutable_data<std::int64_t>() == i.data<std::int64_t>());
  CHECK(i.storage()->version() == vi + 1);
}

TEST_CASE("add_ across devices names both devices") {
  dp::Tensor a = dp::zeros({2}, dp::cpu(0));
  dp::Tensor b = dp::zeros({2}, dp::cpu(1));
  CHECK_THROWS_WITH_AS(a.add_(b), doctest::Contains("cpu:0"), dp::Error);
  CHECK_THROWS_WITH_AS(a.add_(b), doctest::Contains("cpu:1"), dp::Error);
}

TEST_CASE_TEMPLATE("host access checks dtype and element count", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor f = dp::from_vector(F{1.5f}, {1, 1}, dev);
  CHECK(f.item() == 1.5);
  dp::Tensor i = dp::from_vector(I{-3}, {1}, dev);
  CHECK(i.item() == -3.0);
  CHECK_THROWS_WITH_AS(dp::zeros({2}, dev).item(), doctest::Contains("[2]"), dp::Error);
  CHECK_THROWS_AS(dp::zeros({0}, dev).item(), dp::Error);
  CHECK_THROWS_WITH_AS(i.to_vector(), doctest::Contains("int64"), dp::Error);
  CHECK_THROWS_WITH_AS(f.to_vector_i64(), doctest::Contains("float32"), dp::Error);
  CHECK_THROWS_AS(i.data<float>(), dp::Error);
  CHECK_THROWS_AS(f.data<std::int64_t>(), dp::Error);
  CHECK(f.data<float>() != nullptr);
}

TEST_CASE("host pointers of a CPU tensor address its elements") {
  dp::Tensor a = dp::from_vector(F{1, 2, 3, 4}, {4});
  dp::Tensor v = a.narrow(0, 2, 2);
  CHECK(v.data<float>() == a.data<float>() + 2);
  v.data<float>()[0] = 10.0f;
  CHECK(a.to_vector() == F{1, 2, 10, 4});
  CHECK(v.raw_data() == static_cast<void*>(a.data<float>() + 2));
}

TEST_CASE("clone copies; detach shares; copies of a handle share") {
  dp::Tensor a = dp::from_vector(F{1, 2}, {2});
  dp::Tensor c = a.clone();
  CHECK(c.storage() != a.storage());
  c.fill_(0);
  CHECK(a.to_vector() == F{1, 2});

  dp::Tensor d = a.detach();
  CHECK(d.storage() == a.storage());
  CHECK_FALSE(d.is_same(a));
  d.fill_(5);
  CHECK(a.to_vector() == F{5, 5});

  dp::Tensor h = a;
  CHECK(h.is_same(a));
}

TEST_CASE("equal and max_abs_diff compare values") {
  dp::Tensor a = dp::from_vector(F{1, 2, 3}, {3});
  dp::Tensor b = dp::from_vector(F{1, 2.5f, 3}, {3}, dp::cpu(1));
  CHECK(dp::equal(a, a.clone()));
  CHECK_FALSE(dp::equal(a, b));
  CHECK_FALSE(dp::equal(a, a.reshape({1, 3})));
  CHECK_FALSE(dp::equal(a, a.to(dp::Dtype::Int64)));
  CHECK(dp::max_abs_diff(a, b) == doctest::Approx(0.5));
  CHECK_THROWS_WITH_AS(dp::max_abs_diff(a, dp::zeros({2})), doctest::Contains("[2]"), dp::Error);
}

TEST_CASE_TEMPLATE("add_(scalar) adds in place for float32 and int64", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor f = dp::from_vector(F{1.5f, -2, 0}, {3}, dev);
  const std::uint64_t v0 = f.storage()->version();
  f.add_(2.0);
  CHECK(f.to_vector() == F{3.5f, 0, 2});
  CHECK(f.storage()->version() == v0 + 1);
  // int64 beyond float32's exact range: the add is done in int64.
  dp::Tensor i = dp::from_vector(I{(std::int64_t{1} << 40) + 1, -3}, {2}, dev);
  i.add_(1.0);
  i.add_(-7.0);
  CHECK(i.to_vector_i64() == I{(std::int64_t{1} << 40) - 5, -9});
  dp::Tensor scalar = dp::zeros({}, dp::TensorOptions{dp::Dtype::Int64, dev});
  for (int k = 0; k < 5; ++k) scalar.add_(1.0);
  CHECK(scalar.item() == 5);
}

TEST_CASE_TEMPLATE("pin_memory copies into pinned host memory that copies to any device",
                   D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  const std::size_t pinned0 = dp::pinned_memory_allocated();
  const std::size_t host0 = dp::memory_allocated(dp::cpu(0));
  {
    dp::Tensor a = dp::from_vector(F{1, 2, 3, 4, 5, 6}, {3, 2});
    CHECK_FALSE(a.is_pinned());
    dp::Tensor p = a.pin_memory();
    CHECK(p.is_pinned());
    CHECK(p.device() == dp::cpu(0));
    CHECK(p.shape() == a.shape());
    CHECK(p.storage() != a.storage());
    CHECK(p.to_vector() == a.to_vector());
    CHECK(p.pin_memory().is_same(p));  // already pinned: no copy
    // Pinned memory is host memory, not cpu(0)'s: only the pinned counter moves.
    CHECK(dp::pinned_memory_allocated() == pinned0 + p.nbytes());
    CHECK(dp::memory_allocated(dp::cpu(0)) == host0 + a.nbytes());

    // A view pins only its rows; copies from a pinned view reach the device intact.
    dp::Tensor rows = a.narrow(0, 1, 2).pin_memory();
    CHECK(rows.to_vector() == F{3, 4, 5, 6});
    CHECK(p.narrow(0, 1, 2).to(dev).to_vector() == F{3, 4, 5, 6});
    dp::Tensor i = dp::from_vector(I{7, -8}, {2}).pin_memory();
    CHECK(i.dtype() == dp::Dtype::Int64);
    CHECK(i.to(dev).to_vector_i64() == I{7, -8});
  }
  CHECK(dp::pinned_memory_allocated() == pinned0);
}

TEST_CASE_TEMPLATE("a pinned buffer freed right after its copy is not overwritten under it",
                   D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  // CUDA: the copy is asynchronous; the freed block must not be handed to the next
  // pin_memory (and filled) before the copy has read it (Note [Pinned block reuse]).
  const std::int64_t n = 1 << 20;
  std::vector<dp::Tensor> on_device;
  for (int k = 0; k < 6; ++k) {
    dp::Tensor host = dp::full({n}, static_cast<double>(k)).pin_memory();
    on_device.push_back(host.to(dev));
  }  // each pinned batch is freed at the end of its iteration
  for (int k = 0; k < 6; ++k) {
    CAPTURE(k);
    std::vector<float> v = on_device[static_cast<std::size_t>(k)].to_vector();
    CHECK(std::all_of(v.begin(), v.end(), [k](float x) { return x == static_cast<float>(k); }));
  }
}

TEST_CASE("memory statistics name bad devices") {
  CHECK_THROWS_AS(dp::memory_allocated(dp::Device{dp::DeviceType::CPU, 99}), dp::Error);
  const std::size_t before = dp::memory_allocated(dp::cpu(3));
  dp::reset_peak_memory(dp::cpu(3));
  {
    dp::Tensor t = dp::zeros({1000}, dp::cpu(3));
    CHECK(dp::memory_allocated(dp::cpu(3)) == before + 4000);
  }
  CHECK(dp::memory_allocated(dp::cpu(3)) == before);
  CHECK(dp::max_memory_allocated(dp::cpu(3)) == before + 4000);
}
