// tests/tensor/shape_ops_test.cpp — permute, transpose, expand, contiguous, and chunk /
// split along any dim: values against index arithmetic, gradients against central
// differences, and every bad input.
#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "../autograd/gradcheck.h"
#include "dp/core/error.h"
#include "dp/nn/init.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"
#include "test_errors.h"

namespace {

using dp::Shape;
using dp::Tensor;

// 0, 1, 2, ... in a tensor of `shape`: each value is its own row-major index.
Tensor iota(const Shape& shape) {
  std::vector<float> v(static_cast<std::size_t>(dp::shape_numel(shape)));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  return dp::from_vector(v, shape);
}

}  // namespace

TEST_CASE("permute: element [i0, i1, ...] of the result is the source at the permuted index") {
  const Shape shape{2, 3, 4, 5};
  Tensor x = iota(shape);
  for (const std::vector<std::int64_t>& perm :
       std::vector<std::vector<std::int64_t>>{{0, 2, 1, 3}, {3, 2, 1, 0}, {1, 3, 0, 2}, {0, 1, 2, 3}, {0, 1, 3, 2}}) {
    CAPTURE(perm[0] * 1000 + perm[1] * 100 + perm[2] * 10 + perm[3]);
    Tensor y = x.permute(perm);
    Shape want;
    for (auto d : perm) want.push_back(shape[static_cast<std::size_t>(d)]);
    REQUIRE(y.shape() == want);
    const std::vector<float> out = y.to_vector();
    std::size_t k = 0;
    std::int64_t idx[4];
    for (idx[0] = 0; idx[0] < want[0]; ++idx[0])
      for (idx[1] = 0; idx[1] < want[1]; ++idx[1])
        for (idx[2] = 0; idx[2] < want[2]; ++idx[2])
          for (idx[3] = 0; idx[3] < want[3]; ++idx[3], ++k) {
            std::int64_t src[4];
            for (int i = 0; i < 4; ++i) src[perm[static_cast<std::size_t>(i)]] = idx[i];
            const std::int64_t flat = ((src[0] * 3 + src[1]) * 4 + src[2]) * 5 + src[3];
            REQUIRE(out[k] == static_cast<float>(flat));
          }
  }
  // Negative dims, size-1 dims, a scalar's empty permutation, an empty tensor.
  CHECK(x.permute({-4, -2, -3, -1}).to_vector() == x.permute({0, 2, 1, 3}).to_vector());
  Tensor ones = iota({1, 3, 1, 2});
  CHECK(ones.permute({3, 1, 2, 0}).shape() == Shape{2, 3, 1, 1});
  CHECK(ones.permute({3, 1, 2, 0}).to_vector() == std::vector<float>{0, 2, 4, 1, 3, 5});
  CHECK(dp::from_vector(std::vector<float>{7}, {}).permute({}).item() == 7.0f);
  CHECK(dp::zeros({0, 3}).permute({1, 0}).shape() == Shape{3, 0});
  // A copy (Note [Contiguous tensors]): contiguous() writes into it alone, the source stays.
  Tensor y = x.permute({1, 0, 2, 3}).contiguous();
  y.fill_(-1);
  CHECK(x.to_vector()[1] == 1.0f);
  CHECK(y.to_vector()[1] == -1.0f);
}

TEST_CASE("transpose(d0, d1) swaps two dims; t() and contiguous() agree") {
  Tensor x = iota({2, 3, 4});
  Tensor y = x.transpose(1, 2);
  CHECK(y.shape() == Shape{2, 4, 3});
  CHECK(y.to_vector() == x.permute({0, 2, 1}).to_vector());
  CHECK(x.transpose(-1, 0).to_vector() == x.permute({2, 1, 0}).to_vector());
  CHECK(x.transpose(1, 1).to_vector() == x.to_vector());
  Tensor m = iota({3, 5});
  CHECK(m.transpose(0, 1).to_vector() == m.t().to_vector());
  CHECK(x.contiguous().impl() == x.impl());
  CHECK(y.contiguous().impl() != y.impl());  // the writable handle on the copy
  CHECK(y.contiguous().to_vector() == y.to_vector());
}

TEST_CASE("expand broadcasts size-1 and new leading dims; its gradient sums them back") {
  Tensor x = dp::from_vector(std::vector<float>{1, 2, 3}, {3, 1});
  Tensor y = x.expand({2, 3, 4});
  CHECK(y.shape() == Shape{2, 3, 4});
  const std::vector<float> v = y.to_vector();
  for (std::size_t b = 0; b < 2; ++b)
    for (std::size_t i = 0; i < 3; ++i)
      for (std::size_t j = 0; j < 4; ++j) CHECK(v[(b * 3 + i) * 4 + j] == static_cast<float>(i + 1));
  CHECK(x.expand({-1, 2}).shape() == Shape{3, 2});
  CHECK(x.expand({3, 1}).to_vector() == x.to_vector());

  x.set_requires_grad(true);
  Tensor w = iota({2, 3, 4});
  dp::sum(dp::mul(x.expand({2, 3, 4}), w)).backward();
  // d/dx_i = sum over b, j of w[b, i, j]
  std::vector<float> want(3, 0.0f);
  const std::vector<float> wv = w.to_vector();
  for (std::size_t b = 0; b < 2; ++b)
    for (std::size_t i = 0; i < 3; ++i)
      for (std::size_t j = 0; j < 4; ++j) want[i] += wv[(b * 3 + i) * 4 + j];
  CHECK(x.grad().to_vector() == want);
  // Expanding to the same shape gives a new handle, so its graph node is not the source's.
  Tensor same = x.expand({3, 1});
  CHECK(same.impl() != x.impl());
}

TEST_CASE("gradients of permute, transpose and expand match central differences") {
  const auto v = dp_test::away_from_zero(24, 5);
  Tensor x = dp::from_vector(v, {2, 3, 4});
  CHECK(dp_test::gradcheck_mismatches([](const auto& in) { return in[0].permute({2, 0, 1}); }, {x}).empty());
  CHECK(dp_test::gradcheck_mismatches([](const auto& in) { return in[0].transpose(0, 2).tanh(); }, {x}).empty());
  Tensor s = dp::from_vector(dp_test::away_from_zero(4, 6), {1, 4});
  CHECK(dp_test::gradcheck_mismatches([](const auto& in) { return in[0].expand({3, 2, 4}); }, {s}).empty());
}

TEST_CASE("chunk and split along any dim, with gradients") {
  Tensor x = iota({2, 7, 3});
  std::vector<Tensor> c = dp::chunk(x, 3, 1);
  REQUIRE(c.size() == 3);
  CHECK(c[0].shape() == Shape{2, 3, 3});
  CHECK(c[2].shape() == Shape{2, 1, 3});
  CHECK(c[1].to_vector() == x.narrow(1, 3, 3).to_vector());
  CHECK(dp::chunk(x, 2, -1).size() == 2);
  CHECK(dp::chunk(x, 2, -1)[1].shape() == Shape{2, 7, 1});
  std::vector<Tensor> s = dp::split(x, {4, 0, 3}, 1);
  REQUIRE(s.size() == 3);
  CHECK(s[1].numel() == 0);
  CHECK(s[2].to_vector() == x.narrow(1, 4, 3).to_vector());
  std::vector<Tensor> q = dp::split(iota({2, 4, 9}), 3, 2);  // q, k, v of a fused projection
  REQUIRE(q.size() == 3);
  CHECK(q[2].to_vector() == iota({2, 4, 9}).narrow(2, 6, 3).to_vector());
  CHECK(dp::split(iota({2, 5}), 2, 1).back().shape() == Shape{2, 1});
  // Along dim 0 the old spellings keep their meaning.
  CHECK(dp::chunk(x, 2).size() == 2);
  CHECK(dp::split(x, std::vector<std::int64_t>{1, 1}).size() == 2);

  Tensor g = dp::from_vector(dp_test::away_from_zero(24, 7), {2, 4, 3});
  CHECK(dp_test::gradcheck_mismatches(
            [](const auto& in) {
              auto parts = dp::split(in[0], 2, 1);
              return dp::add(dp::mul(parts[0], 2.0), parts[1].tanh());
            },
            {g})
            .empty());
}

TEST_CASE("shape ops: bad input names what was expected and what came") {
  Tensor x = iota({2, 3, 4});
  CHECK(dp_test::throws_with([&] { (void)x.permute({0, 1}); }, {"expected 3 dims"}));
  CHECK(dp_test::throws_with([&] { (void)x.permute({0, 1, 1}); }, {"appears twice"}));
  CHECK(dp_test::throws_with([&] { (void)x.permute({0, 1, 3}); }, {"dim 3 at position 2 is out of range"}));
  CHECK(dp_test::throws_with([&] { (void)dp::arange(4, {dp::Dtype::Int64}).permute({0}); }, {"expected a floating input"}));
  CHECK(dp_test::throws_with([&] { (void)x.transpose(0, 3); }, {"expected dims in [-3, 3)"}));
  CHECK(dp_test::throws_with([&] { (void)x.expand({3, 4}); }, {"at least 3 sizes"}));
  CHECK(dp_test::throws_with([&] { (void)x.expand({2, 5, 4}); }, {"dim 1 has size 3, expected it to be 1 or 5"}));
  CHECK(dp_test::throws_with([&] { (void)x.expand({-1, 2, 3, 4}); }, {"-1 at new leading dim 0"}));
  CHECK(dp_test::throws_with([&] { (void)dp::chunk(x, 2, 3); }, {"chunk: expected a dim in [-3, 3), got 3"}));
  CHECK(dp_test::throws_with([&] { (void)dp::split(x, {1, 1}, 1); }, {"sum to 2 but dim 1 has 3"}));
  CHECK(dp_test::throws_with([&] { (void)dp::split(x, 0, 1); }, {"split_size >= 1, got 0"}));
}

TEST_CASE("index_add adds source's slices at index along dim, repeats summed; gradients; bad input") {
  Tensor base = iota({4, 2});
  Tensor src = dp::from_vector(std::vector<float>{10, 20, 30, 40, 50, 60}, {3, 2});
  Tensor idx = dp::from_vector(std::vector<std::int64_t>{3, 0, 3}, {3});
  CHECK(dp::index_add(base, 0, idx, src).to_vector() == std::vector<float>{30, 41, 2, 3, 4, 5, 66, 87});
  CHECK(base.to_vector() == iota({4, 2}).to_vector());  // a copy: the input is unchanged
  Tensor cols = dp::index_add(iota({2, 3}), 1, dp::from_vector(std::vector<std::int64_t>{2}, {1}),
                              dp::from_vector(std::vector<float>{7, 8}, {2, 1}));
  CHECK(cols.to_vector() == std::vector<float>{0, 1, 9, 3, 4, 13});
  CHECK(dp_test::gradcheck_mismatches([&](const auto& in) { return dp::index_add(in[0], 0, idx, in[1]); },
                                      {dp::from_vector(dp_test::away_from_zero(8, 3), {4, 2}),
                                       dp::from_vector(dp_test::away_from_zero(6, 4), {3, 2})})
            .empty());
  CHECK(dp_test::throws_with([&] { (void)dp::index_add(base, 0, idx, dp::zeros({2, 2})); },
                             {"source of shape [3, 2]", "got [2, 2]"}));
  CHECK(dp_test::throws_with(
      [&] { (void)dp::index_add(base, 0, dp::from_vector(std::vector<std::int64_t>{0, 4, 1}, {3}), src); }, {"4"}));
  CHECK(dp_test::throws_with([&] { (void)dp::index_add(dp::arange(4, {dp::Dtype::Int64}), 0, idx, src); },
                             {"int64"}));
  CHECK(dp_test::throws_with([&] { (void)dp::index_add(base, 2, idx, src); }, {"index_add: expected a dim"}));
}

// Note [Writes into materialised views]: where PyTorch returns a view and dp a copy, a
// write into the result would silently miss the source, so every in-place write into it
// is refused, naming the op; contiguous() writes into the copy alone.
TEST_CASE("writes into a copy that PyTorch would return as a view are refused, naming the op") {
  const Tensor x = iota({2, 3, 4});
  const Tensor before = x.clone();
  struct Made {
    const char* name;
    std::function<Tensor()> make;
  };
  const std::vector<Made> made{
      {"permute()", [&] { return x.permute({2, 0, 1}); }},
      {"transpose()", [&] { return x.transpose(0, 2); }},
      {"t()", [&] { return x.reshape({6, 4}).t(); }},
      {"expand()", [&] { return x.narrow(1, 0, 1).expand({2, 5, 4}); }},
      {"narrow() along a later dim", [&] { return x.narrow(1, 1, 2); }},
      {"narrow() along a later dim", [&] { return x.narrow(-1, 0, 3); }},
      // Views of such a copy carry the mark: in PyTorch they view the source too.
      {"permute()", [&] { return x.permute({1, 0, 2}).reshape({-1}); }},
      {"transpose()", [&] { return x.transpose(1, 2).unsqueeze(0).squeeze(0).flatten(); }},
      {"t()", [&] { return x.reshape({6, 4}).t().narrow(0, 1, 2); }},
      {"narrow() along a later dim", [&] { return x.narrow(2, 1, 2).detach().view({2, 6}); }},
  };
  for (const Made& m : made) {
    CAPTURE(m.name);
    Tensor y = m.make();
    const Tensor same_shape = dp::zeros(y.shape());
    const std::vector<std::pair<const char*, std::function<void()>>> writes{
        {"Tensor::zero_", [&] { y.zero_(); }},
        {"Tensor::fill_", [&] { y.fill_(3.0); }},
        {"Tensor::copy_", [&] { y.copy_(same_shape); }},
        {"Tensor::add_", [&] { y.add_(same_shape, 2.0f); }},
        {"Tensor::add_", [&] { y.add_(1.0); }},
        {"Tensor::mul_", [&] { y.mul_(2.0f); }},
        {"init::normal_", [&] { dp::nn::init::normal_(y, 0.0, 1.0); }},
        {"init::uniform_", [&] { dp::nn::init::uniform_(y, -1.0, 1.0); }},
        {"init::constant_", [&] { dp::nn::init::constant_(y, 5.0); }},
        {"init::zeros_", [&] { dp::nn::init::zeros_(y); }},
    };
    const std::vector<float> copy_before = y.to_vector();
    for (const auto& [op, write] : writes) {
      CAPTURE(op);
      CHECK(dp_test::throws_with(write, {op, m.name, "view", ".contiguous()"}));
    }
    CHECK(y.to_vector() == copy_before);  // refused before any write
    // The copy alone through contiguous(): written, and the source untouched.
    Tensor own = y.contiguous();
    own.fill_(-7.0);
    own.add_(1.0);
    CHECK(own.to_vector() == std::vector<float>(static_cast<std::size_t>(own.numel()), -6.0f));
    CHECK(own.contiguous().impl() == own.impl());
    CHECK(x.to_vector() == before.to_vector());
  }
  // Real views keep writing through to their source, as in PyTorch.
  Tensor base = iota({4, 3});
  base.narrow(0, 1, 2).fill_(0.0);
  base.reshape({2, 6}).narrow(0, 1, 1).add_(10.0);
  base.unsqueeze(0).squeeze(0).detach().mul_(2.0f);
  const std::vector<float> v = base.to_vector();
  CHECK(v[0] == 0.0f);   // row 0: 0 * 2
  CHECK(v[3] == 0.0f);   // row 1: zeroed, then * 2
  CHECK(v[6] == 20.0f);  // row 2: zeroed, + 10, * 2
  CHECK(v[11] == 2.0f * (11.0f + 10.0f));
  // Out-of-place ops on a marked copy make tensors of their own.
  Tensor sum = x.permute({2, 0, 1}) + 1.0;
  sum.mul_(2.0f);
  CHECK(sum.to_vector()[0] == 2.0f);
  // expand to its own shape is a handle on the source, as PyTorch's view.
  Tensor same = x.expand({2, 3, 4});
  same.add_(1.0);
  CHECK(x.to_vector()[0] == 1.0f);
}

TEST_CASE("contiguous() of a marked copy passes gradients through; a gradient adopted as .grad is writable") {
  Tensor w = iota({3, 4});
  w.set_requires_grad(true);
  Tensor y = w.t().contiguous();
  (y * 2.0).sum().backward();
  CHECK(w.grad().to_vector() == std::vector<float>(12, 2.0f));
  // A .grad made by TransposeBackward's t() is the leaf's own: it accumulates in place
  // and may be zeroed or scaled by hand.
  Tensor v = iota({4, 3});
  v.set_requires_grad(true);
  (v.t() * 3.0).sum().backward();
  (v.t() * 3.0).sum().backward();
  CHECK(v.grad().to_vector() == std::vector<float>(12, 6.0f));
  v.grad().mul_(0.5f);
  CHECK(v.grad().to_vector() == std::vector<float>(12, 3.0f));
  v.grad().zero_();
  CHECK(v.grad().to_vector() == std::vector<float>(12, 0.0f));
}
