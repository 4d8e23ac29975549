// Tests for Dtype::Int32 across the library: creation, host access and conversions
// between all three dtypes (dp/tensor/tensor.h), and every label consumer taking int32
// labels with results identical to int64 ones (cross_entropy and nll_loss on all their
// paths, eq against argmax, one_hot, TensorDataset, DataParallel's scatter of targets);
// ops without an int32 path refuse it naming the dtype.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "test_devices.h"
#include "dp/core/error.h"
#include "dp/data/tensor_dataset.h"
#include "dp/nn/functional.h"
#include "dp/nn/linear.h"
#include "dp/nn/loss.h"
#include "dp/parallel/data_parallel.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

using F = std::vector<float>;
using I = std::vector<std::int64_t>;
using I32 = std::vector<std::int32_t>;
using dp::Dtype;
using dp::Shape;
using dp::TensorOptions;

}  // namespace

TEST_CASE_TEMPLATE("int32 tensors: creation, host access, printing", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  CHECK(dp::element_size(Dtype::Int32) == 4);
  CHECK(std::string(dp::dtype_name(Dtype::Int32)) == "int32");
  dp::Tensor t = dp::from_vector(I32{3, -1, 7, 2147483647, -2147483647 - 1, 0}, {2, 3}, dev);
  CHECK(t.dtype() == Dtype::Int32);
  CHECK(t.nbytes() == 24);
  CHECK(t.to_vector_i32() == I32{3, -1, 7, 2147483647, -2147483647 - 1, 0});
  CHECK(t.narrow(0, 1, 1).narrow(1, 0, 1).item() == 2147483647.0);
  CHECK(t.str().find("int32") != std::string::npos);
  CHECK(dp::zeros({4}, TensorOptions{Dtype::Int32, dev}).to_vector_i32() == I32{0, 0, 0, 0});
  CHECK(dp::ones({2}, TensorOptions{Dtype::Int32, dev}).to_vector_i32() == I32{1, 1});
  CHECK(dp::full({3}, -5, TensorOptions{Dtype::Int32, dev}).to_vector_i32() == I32{-5, -5, -5});
  CHECK(dp::arange(4, TensorOptions{Dtype::Int32, dev}).to_vector_i32() == I32{0, 1, 2, 3});
  dp::Tensor c = t.clone();
  c.add_(2.0);
  CHECK(c.to_vector_i32() == I32{5, 1, 9, -2147483647, -2147483647 + 1, 2});  // wraps like int32
  c.fill_(9);
  CHECK(c.to_vector_i32() == I32(6, 9));
  CHECK(t.to_vector_i32()[0] == 3);  // the clone was a copy
  CHECK(dp::cat({t, t}).shape() == Shape{4, 3});
  CHECK(dp::cat({t, t}).to_vector_i32()[6] == 3);
  CHECK(t.reshape({3, 2}).to_vector_i32() == t.to_vector_i32());
  CHECK(t.to(dp::cpu(2)).to_vector_i32() == t.to_vector_i32());
}

TEST_CASE_TEMPLATE("to(Dtype) converts between float32, int64 and int32 on the device", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor f = dp::from_vector(F{-2.75f, -0.5f, 0.0f, 1.9f, 16777217.0f, 3e9f}, {6}, dev);
  dp::Tensor fi = f.narrow(0, 0, 5).to(Dtype::Int32);  // truncation toward zero
  CHECK(fi.device() == dev);
  CHECK(fi.to_vector_i32() == I32{-2, 0, 0, 1, 16777216});
  dp::Tensor l = dp::from_vector(I{5, -3, (std::int64_t{1} << 32) + 7, -(std::int64_t{1} << 31) - 1}, {4}, dev);
  // int64 -> int32 keeps the low 32 bits (PyTorch's .int()).
  CHECK(l.to(Dtype::Int32).to_vector_i32() == I32{5, -3, 7, 2147483647});
  dp::Tensor i = dp::from_vector(I32{16777217, -9, 2147483647}, {3}, dev);
  CHECK(i.to(Dtype::Int64).to_vector_i64() == I{16777217, -9, 2147483647});
  // int32 -> float32 rounds to nearest like a direct cast.
  CHECK(i.to(Dtype::Float32).to_vector() ==
        F{static_cast<float>(16777217), -9.0f, static_cast<float>(2147483647)});
  CHECK(i.to(Dtype::Int32).is_same(i));
  CHECK(i.to(Dtype::Int64).to(Dtype::Int32).to_vector_i32() == i.to_vector_i32());
}

TEST_CASE("int32 host access checks the dtype; ops without an int32 path name it") {
  dp::Tensor i = dp::from_vector(I32{1, 2}, {2});
  CHECK_THROWS_WITH_AS(i.to_vector(), doctest::Contains("expected a float32 tensor, got int32"), dp::Error);
  CHECK_THROWS_WITH_AS(i.to_vector_i64(), doctest::Contains("expected an int64 tensor, got int32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::zeros({2}).to_vector_i32(), doctest::Contains("expected an int32 tensor, got float32"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(i.set_requires_grad(true), doctest::Contains("int32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::add(i, i), doctest::Contains("int32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::sum(i), doctest::Contains("int32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::matmul(i.reshape({1, 2}), i.reshape({2, 1})), doctest::Contains("int32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::argmax(i, 0), doctest::Contains("int32"), dp::Error);
  CHECK_THROWS_WITH_AS(i.mul_(2.0f), doctest::Contains("int32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::from_vector(I32{1, 2, 3}, {2}), doctest::Contains("needs 2 elements, got 3"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::eq(i, dp::zeros({2})), doctest::Contains("int32 and float32"), dp::Error);
}

TEST_CASE_TEMPLATE("eq compares int32 labels with int64 predictions exactly", D, DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Tensor logits = dp::from_vector(F{0.1f, 2.0f, -1.0f, 3.0f, 0.0f, 1.0f, -2.0f, -1.0f, -0.5f}, {3, 3}, dev);
  dp::Tensor pred = dp::argmax(logits, 1);  // int64 {1, 0, 2}
  dp::Tensor y32 = dp::from_vector(I32{1, 2, 2}, {3}, dev);
  CHECK(dp::eq(pred, y32).to_vector() == F{1, 0, 1});
  CHECK(dp::eq(y32, pred).to_vector() == F{1, 0, 1});
  CHECK(dp::mean(dp::eq(pred, y32)).item() == doctest::Approx(2.0 / 3.0));  // accuracy
  CHECK(dp::eq(y32, y32).to_vector() == F{1, 1, 1});
  // Beyond 2^24: compared as integers, never through float.
  dp::Tensor big32 = dp::from_vector(I32{16777217}, {1}, dev);
  CHECK(dp::eq(big32, dp::from_vector(I{16777216}, {1}, dev)).to_vector() == F{0});
}

TEST_CASE_TEMPLATE("cross_entropy and nll_loss give int32 labels the int64 results bit for bit", D,
                   DP_TEST_DEVICES) {
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  dp::Generator gen(7);
  const dp::Tensor logits0 = dp::randn({6, 5}, gen, dev);
  const I y64{4, 0, 2, 2, -100, 1};
  const I32 y32v(y64.begin(), y64.end());
  const dp::Tensor w = dp::from_vector(F{0.5f, 1.0f, 2.0f, 1.5f, 0.25f}, {5}, dev);
  struct Case {
    bool weighted;
    double smoothing;
    dp::nn::Reduction reduction;
  };
  for (const Case& c : {Case{false, 0.0, dp::nn::Reduction::Mean}, Case{true, 0.0, dp::nn::Reduction::Mean},
                        Case{false, 0.1, dp::nn::Reduction::Sum}, Case{true, 0.2, dp::nn::Reduction::None}}) {
    CAPTURE(c.weighted);
    CAPTURE(c.smoothing);
    auto run = [&](const dp::Tensor& y, bool nll) {
      dp::Tensor x = logits0.detach().clone().set_requires_grad(true);
      dp::Tensor loss;
      if (nll) {
        loss = dp::nn::nll_loss(dp::nn::log_softmax(x), y,
                                dp::nn::NLLLossOptions{.weight = c.weighted ? w : dp::Tensor(), .reduction = c.reduction});
      } else {
        loss = dp::nn::cross_entropy(x, y, dp::nn::CrossEntropyOptions{.weight = c.weighted ? w : dp::Tensor(),
                                                                       .reduction = c.reduction,
                                                                       .label_smoothing = c.smoothing});
      }
      dp::sum(loss).backward();
      return std::make_pair(loss, x.grad());
    };
    for (bool nll : {false, true}) {
      CAPTURE(nll);
      auto [l64, g64] = run(dp::from_vector(y64, {6}, dev), nll);
      auto [l32, g32] = run(dp::from_vector(y32v, {6}, dev), nll);
      CHECK(dp::equal(l32, l64));
      CHECK(dp::equal(g32, g64));
    }
  }
  // The plain path (no option, no ignored row) too.
  const dp::Tensor ok64 = dp::from_vector(I{4, 0, 2, 2, 3, 1}, {6}, dev);
  CHECK(dp::equal(dp::nn::cross_entropy(logits0, ok64.to(Dtype::Int32)), dp::nn::cross_entropy(logits0, ok64)));
  CHECK(dp::equal(dp::nn::nll_loss(logits0, ok64.to(Dtype::Int32)), dp::nn::nll_loss(logits0, ok64)));
}

TEST_CASE("class-index losses name a bad int32 label and refuse float labels") {
  dp::Tensor logits = dp::zeros({2, 3});
  CHECK_THROWS_WITH_AS(dp::nn::cross_entropy(logits, dp::from_vector(I32{0, 3}, {2})),
                       doctest::Contains("target[1] = 3"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::nn::nll_loss(logits, dp::from_vector(I32{-2, 0}, {2})),
                       doctest::Contains("target[0] = -2"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::nn::cross_entropy(logits, dp::zeros({2})),
                       doctest::Contains("expected int64 or int32 class indices as target, got float32"), dp::Error);
}

TEST_CASE("TensorDataset takes int32 targets and batches them as int64") {
  dp::Tensor x = dp::from_vector(F{0, 1, 2, 3, 4, 5}, {3, 2});
  dp::data::TensorDataset ds(x, dp::from_vector(I32{2, 0, 1}, {3}));
  auto batch = ds.get_batch(std::vector<std::int64_t>{2, 0});
  CHECK(batch.target.dtype() == Dtype::Int64);
  CHECK(batch.target.to_vector_i64() == I{1, 2});
  CHECK(batch.data.to_vector() == F{4, 5, 0, 1});
  CHECK_THROWS_WITH_AS(dp::data::TensorDataset(x, dp::zeros({3})),
                       doctest::Contains("expected int64 or int32 targets"), dp::Error);
}

TEST_CASE("DataParallel scatters int32 targets: the same loss and gradients as int64") {
  auto run = [](const dp::Tensor& y) {
    dp::Generator gen(11);
    auto net = std::make_shared<dp::nn::Linear>(4, 3, true, &gen);
    dp::DataParallel model(net, {0, 1, 2});
    dp::Generator data(3);
    dp::Tensor x = dp::randn({7, 4}, data);
    auto loss_fn = [](const dp::Tensor& out, const dp::Tensor& t) { return dp::nn::cross_entropy(out, t); };
    dp::Tensor fb = model.forward_backward(x, y, loss_fn);
    // A loss descriptor computes its denominator from the whole target first.
    const dp::nn::CrossEntropyLoss weighted{.weight = dp::from_vector(std::vector<float>{1, 2, 0.5f}, {3}),
                                            .ignore_index = 1};
    fb = fb + model.forward_backward(x, y, weighted);
    std::vector<float> grads;
    const dp::nn::StateDict params = net->named_parameters();
    for (const auto& [name, p] : params) {
      auto g = p.grad().to_vector();
      grads.insert(grads.end(), g.begin(), g.end());
    }
    dp::Tensor full = loss_fn(model(x), y);
    return std::make_tuple(fb.item(), full.item(), grads);
  };
  const I y{2, 0, 1, 1, 2, 0, 2};
  auto [fb64, full64, g64] = run(dp::from_vector(y, {7}));
  auto [fb32, full32, g32] = run(dp::from_vector(I32(y.begin(), y.end()), {7}));
  CHECK(fb32 == fb64);
  CHECK(full32 == full64);
  CHECK(g32 == g64);
}

TEST_CASE_TEMPLATE("copy_ broadcasts and converts int32 sources and destinations exactly", D, DP_TEST_DEVICES) {
  // Note [Sources of in-place writes]: an int32 source broadcast goes through int64,
  // exact both ways, values beyond float32's 24-bit mantissa included.
  DP_SKIP_UNLESS_AVAILABLE(D);
  const dp::Device dev = D::device();
  const dp::Tensor row = dp::from_vector(I32{16777217, -9, 2147483647}, {3}, dev);
  dp::Tensor i32 = dp::zeros({2, 3}, dp::TensorOptions{dp::Dtype::Int32, dev});
  i32.copy_(row);
  CHECK(i32.to_vector_i32() == I32{16777217, -9, 2147483647, 16777217, -9, 2147483647});
  dp::Tensor i64 = dp::zeros({2, 3}, dp::TensorOptions{dp::Dtype::Int64, dev});
  i64.copy_(row);
  CHECK(i64.to_vector_i64() == I{16777217, -9, 2147483647, 16777217, -9, 2147483647});
  dp::Tensor f = dp::zeros({2, 3}, dev);
  f.copy_(dp::from_vector(I32{7}, {1}, dev));
  CHECK(f.to_vector() == F(6, 7.0f));
  f.add_(dp::from_vector(I32{1, 2, 3}, {3}, dev), 2.0f);
  CHECK(f.to_vector() == F{9, 11, 13, 9, 11, 13});
  CHECK_THROWS_WITH_AS(i32.copy_(dp::from_vector(I32{1, 2}, {2}, dev)), doctest::Contains("[2, 3]"), dp::Error);
}
