// Tests for dp/nn/batchnorm.h: PyTorch's parameter and buffer names, training vs eval
// semantics, running statistics (unbiased variance) against a hand computation, and
// updates landing in the copy bound on the calling thread.
#include <doctest/doctest.h>

#include <cmath>
#include <memory>

#include "../autograd/gradcheck.h"
#include "dp/nn/batchnorm.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using dp_test::uniform_values;
using nn_test::F;
using nn_test::max_diff;
namespace nn = dp::nn;

namespace {

/// Per-channel mean and biased / unbiased variance of x (N, C, HW).
void channel_stats(const F& x, int N, int C, int HW, F& mean, F& var_b, F& var_u) {
  mean.assign(C, 0);
  var_b.assign(C, 0);
  var_u.assign(C, 0);
  for (int c = 0; c < C; ++c) {
    double m = 0, v = 0;
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < HW; ++i) m += x[(n * C + c) * HW + i];
    m /= N * HW;
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < HW; ++i) v += (x[(n * C + c) * HW + i] - m) * (x[(n * C + c) * HW + i] - m);
    mean[c] = float(m);
    var_b[c] = float(v / (N * HW));
    var_u[c] = float(v / (N * HW - 1));
  }
}

}  // namespace

TEST_CASE("BatchNorm2d registers PyTorch's names") {
  nn::BatchNorm2d bn(3);
  auto p = bn.named_parameters();
  auto b = bn.named_buffers();
  REQUIRE(p.size() == 2);
  CHECK(p[0].first == "weight");
  CHECK(p[1].first == "bias");
  REQUIRE(b.size() == 3);
  CHECK(b[0].first == "running_mean");
  CHECK(b[1].first == "running_var");
  CHECK(b[2].first == "num_batches_tracked");
  CHECK(b[2].second.dtype() == dp::Dtype::Int64);
  CHECK(b[2].second.numel() == 1);
  CHECK(bn.weight().to_vector() == F{1, 1, 1});
  CHECK(bn.bias().to_vector() == F{0, 0, 0});
  CHECK(bn.running_mean().to_vector() == F{0, 0, 0});
  CHECK(bn.running_var().to_vector() == F{1, 1, 1});
  CHECK(bn.name() == "BatchNorm2d(3, eps=1e-05, momentum=0.1)");
  CHECK_THROWS_AS(nn::BatchNorm2d(0), dp::Error);
  CHECK_THROWS_AS(nn::BatchNorm2d(2, 1e-5, 1.5), dp::Error);
}

TEST_CASE_TEMPLATE("BatchNorm2d training updates running stats; eval uses them", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  const int N = 4, C = 2, H = 3, W = 2, HW = H * W;
  auto bn = std::make_shared<nn::BatchNorm2d>(C, 1e-5, 0.2);
  bn->to(dev);
  F rm{0, 0}, rv{1, 1};
  for (int step = 0; step < 2; ++step) {
    F x = uniform_values(N * C * HW, -1.f + step, 2.f + 2 * step, 30 + step);
    dp::Tensor y = (*bn)(dp::from_vector(x, {N, C, H, W}, dev));
    F mean, vb, vu;
    channel_stats(x, N, C, HW, mean, vb, vu);
    F ref(x.size());
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < HW; ++i) {
          int k = (n * C + c) * HW + i;
          ref[k] = float((x[k] - mean[c]) / std::sqrt(vb[c] + 1e-5));
        }
    CHECK(max_diff(y.to_vector(), ref) < 1e-5);
    for (int c = 0; c < C; ++c) {
      rm[c] = 0.8f * rm[c] + 0.2f * mean[c];
      rv[c] = 0.8f * rv[c] + 0.2f * vu[c];
    }
    CHECK(max_diff(bn->running_mean().to_vector(), rm) < 1e-5);
    CHECK(max_diff(bn->running_var().to_vector(), rv) < 1e-5);
    CHECK(bn->num_batches_tracked().item() == step + 1);
  }

  bn->eval();
  F x = uniform_values(N * C * HW, -1, 1, 40);
  dp::Tensor y = (*bn)(dp::from_vector(x, {N, C, H, W}, dev));
  F ref(x.size());
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < HW; ++i) {
        int k = (n * C + c) * HW + i;
        ref[k] = float((x[k] - rm[c]) / std::sqrt(rv[c] + 1e-5));
      }
  CHECK(max_diff(y.to_vector(), ref) < 1e-5);
  CHECK(max_diff(bn->running_mean().to_vector(), rm) < 1e-6);  // eval never updates
  CHECK(bn->num_batches_tracked().item() == 2);
  // eval with a batch of one is fine
  CHECK((*bn)(dp::zeros({1, C, 1, 1}, dev)).shape() == dp::Shape{1, C, 1, 1});
  bn->train();
  CHECK_THROWS_AS((*bn)(dp::zeros({1, C, 1, 1}, dev)), dp::Error);
  CHECK_THROWS_AS((*bn)(dp::zeros({2, C + 1, 2, 2}, dev)), dp::Error);
}

TEST_CASE("BatchNorm2d gradients reach gamma and beta") {
  auto bn = std::make_shared<nn::BatchNorm2d>(2);
  dp::Tensor x = dp::from_vector(uniform_values(3 * 2 * 2 * 2, -1, 1, 50), {3, 2, 2, 2});
  dp::Tensor w = dp::from_vector(uniform_values(3 * 2 * 2 * 2, -1, 1, 51), {3, 2, 2, 2});
  dp::sum(dp::mul((*bn)(x), w)).backward();
  REQUIRE(bn->weight().grad().defined());
  F gb = bn->bias().grad().to_vector();
  F wv = w.to_vector();
  for (int c = 0; c < 2; ++c) {
    double s = 0;
    for (int n = 0; n < 3; ++n)
      for (int i = 0; i < 4; ++i) s += wv[(n * 2 + c) * 4 + i];
    CHECK(gb[c] == doctest::Approx(s).epsilon(1e-5));
  }
}

TEST_CASE("BatchNorm2d training updates the running stats of the bound copy only") {
  auto bn = std::make_shared<nn::BatchNorm2d>(2);
  // A second copy of the buffers, as DataParallel makes per replica.
  for (const auto& slot : bn->buffer_slots()) slot->copies.push_back(slot->copies[0].clone());
  dp::Tensor x = dp::from_vector(uniform_values(4 * 2 * 2 * 2, 1, 3, 60), {4, 2, 2, 2});
  {
    nn::ReplicaBinding bind(1);
    (*bn)(x);
    CHECK(bn->running_mean().to_vector() != F{0, 0});
    CHECK(bn->num_batches_tracked().item() == 1);
  }
  CHECK(bn->running_mean().to_vector() == F{0, 0});
  CHECK(bn->running_var().to_vector() == F{1, 1});
  CHECK(bn->num_batches_tracked().item() == 0);
}
