// Tests for the loss descriptors of dp/nn/loss.h: each computes what the functional op
// computes with the same options (whose values are checked against PyTorch in
// loss_test), option tensors on another device are moved, and ShardableLoss's
// denominator and shard losses follow Note [Exact shard losses].
#include <doctest/doctest.h>

#include <cmath>

#include "dp/nn/loss.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using dp::Tensor;
using nn_test::throws_with;
namespace nn = dp::nn;
using R = nn::Reduction;

namespace {

const std::vector<float> kLogits = {0.2f, -1.0f, 0.5f, 1.5f, 0.0f, 0.3f, -0.7f, 2.0f, 1.1f,
                                    -0.4f, 0.9f, 0.1f, -2.0f, 0.6f, 0.8f};  // (5, 3)
const std::vector<std::int64_t> kTargets = {2, 0, -1, 1, 0};
const std::vector<float> kWeight = {0.5f, 2.0f, 3.0f};

}  // namespace

TEST_CASE("loss descriptors compute the functional ops with the same options") {
  const Tensor x = dp::from_vector(kLogits, {5, 3});
  const Tensor y = dp::from_vector(kTargets, {5});
  const Tensor w = dp::from_vector(kWeight, {3});
  for (R r : {R::Mean, R::Sum, R::None}) {
    CAPTURE(static_cast<int>(r));
    const nn::CrossEntropyLoss ce{.weight = w, .ignore_index = -1, .reduction = r, .label_smoothing = 0.1};
    CHECK(dp::equal(ce(x, y), nn::cross_entropy(x, y, {.weight = w, .ignore_index = -1, .reduction = r,
                                                        .label_smoothing = 0.1})));
    const nn::NLLLoss nll{.weight = w, .ignore_index = -1, .reduction = r};
    CHECK(dp::equal(nll(x, y), nn::nll_loss(x, y, {.weight = w, .ignore_index = -1, .reduction = r})));
    const Tensor t = dp::mul(x, 0.5);
    CHECK(dp::equal(nn::MSELoss{.reduction = r}(x, t), nn::mse_loss(x, t, r)));
    CHECK(dp::equal(nn::L1Loss{.reduction = r}(x, t), nn::l1_loss(x, t, r)));
    CHECK(dp::equal(nn::SmoothL1Loss{.reduction = r, .beta = 0.3}(x, t), nn::smooth_l1_loss(x, t, r, 0.3)));
    const Tensor p = dp::sigmoid(t);
    CHECK(dp::equal(nn::BCEWithLogitsLoss{.pos_weight = w, .reduction = r}(x, p),
                    nn::binary_cross_entropy_with_logits(x, p, {.pos_weight = w, .reduction = r})));
  }
  // Option tensors on another device than the input are moved to it.
  const nn::CrossEntropyLoss moved{.weight = w.to(dp::cpu(1)), .ignore_index = -1};
  CHECK(dp::equal(moved(x, y), nn::cross_entropy(x, y, {.weight = w, .ignore_index = -1})));
}

TEST_CASE("ShardableLoss: the whole batch's denominator and shard sums") {
  const Tensor y = dp::from_vector(kTargets, {5});
  const Tensor w = dp::from_vector(kWeight, {3});
  // Mean without weights: the rows not ignored.
  CHECK(nn::ShardableLoss(nn::CrossEntropyLoss{.ignore_index = -1}).denominator(y) == 4.0);
  CHECK(nn::ShardableLoss(nn::CrossEntropyLoss{}).denominator(dp::from_vector(std::vector<std::int64_t>{0, 1, 2}, {3})) ==
        3.0);
  // Weighted: w[2] + w[0] + w[1] + w[0] (row 2 ignored).
  CHECK(nn::ShardableLoss(nn::CrossEntropyLoss{.weight = w, .ignore_index = -1}).denominator(y) == 6.0);
  // ignore_index inside the class range: the two rows of class 0 drop out.
  CHECK(nn::ShardableLoss(nn::NLLLoss{.weight = w, .ignore_index = 0}).denominator(
            dp::from_vector(std::vector<std::int64_t>{2, 0, 1, 1, 0}, {5})) == 7.0);
  CHECK(nn::ShardableLoss(nn::CrossEntropyLoss{.reduction = R::Sum}).denominator(y) == 1.0);
  CHECK(nn::ShardableLoss(nn::MSELoss{}).denominator(dp::zeros({5, 3})) == 15.0);
  CHECK(nn::ShardableLoss(nn::BCEWithLogitsLoss{.reduction = R::Sum}).denominator(dp::zeros({5, 3})) == 1.0);
  CHECK(nn::ShardableLoss(nn::L1Loss{}).name() == "L1Loss");

  // A shard's share is its Sum times the scale; 1 / D over the shards adds to the Mean.
  const Tensor x = dp::from_vector(kLogits, {5, 3});
  const nn::CrossEntropyLoss ce{.weight = w, .ignore_index = -1};
  const nn::ShardableLoss s(ce);
  const double scale = 1.0 / s.denominator(y);
  const Tensor a = s.shard_loss(x.narrow(0, 0, 3), y.narrow(0, 0, 3), scale);
  const Tensor b = s.shard_loss(x.narrow(0, 3, 2), y.narrow(0, 3, 2), scale);
  CHECK(std::fabs(a.item() + b.item() - ce(x, y).item()) < 1e-6);
  CHECK(dp::equal(a, nn::cross_entropy(x.narrow(0, 0, 3), y.narrow(0, 0, 3),
                                       {.weight = w, .ignore_index = -1, .reduction = R::Sum, .scale = scale})));
  // D = 0 (every target ignored): NaN, as PyTorch's mean of nothing.
  CHECK(std::isnan(s.shard_loss(x, dp::full({5}, -1.0, dp::TensorOptions{dp::Dtype::Int64, dp::cpu(0)}),
                                1.0 / 0.0)
                       .item()));
}

TEST_CASE("ShardableLoss: refused reductions and targets") {
  const Tensor y = dp::from_vector(kTargets, {5});
  CHECK(throws_with([&] { nn::ShardableLoss(nn::MSELoss{.reduction = R::None}).denominator(dp::zeros({5})); },
                    {"MSELoss", "Reduction::None"}));
  CHECK(throws_with([&] { nn::ShardableLoss(nn::CrossEntropyLoss{}).denominator(Tensor()); },
                    {"CrossEntropyLoss", "defined target"}));
  CHECK(throws_with([&] { nn::ShardableLoss(nn::CrossEntropyLoss{}).denominator(dp::zeros({5})); },
                    {"CrossEntropyLoss", "int64 or int32 class indices"}));
  CHECK(throws_with([&] { nn::ShardableLoss(nn::BCEWithLogitsLoss{.weight = dp::ones({5, 3})}).denominator(dp::zeros({5, 3})); },
                    {"BCEWithLogitsLoss", "spans the batch"}));
  // A weight with size 1 in dim 0 or fewer dims splits fine.
  CHECK(nn::ShardableLoss(nn::BCEWithLogitsLoss{.weight = dp::ones({1, 3})}).denominator(dp::zeros({5, 3})) == 15.0);
}
