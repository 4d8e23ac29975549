// Tests for the builder-style layer options (Conv2dOptions, LinearOptions,
// BatchNorm2dOptions, DropoutOptions): each builds the same layer as the positional
// constructor, the setters reach the layer, options() reads them back, and bad values
// are refused as from the positional form.
#include <doctest/doctest.h>

#include <memory>

#include "../autograd/gradcheck.h"
#include "dp/nn/batchnorm.h"
#include "dp/nn/conv2d.h"
#include "dp/nn/dropout.h"
#include "dp/nn/linear.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using nn_test::throws_with;
namespace nn = dp::nn;

TEST_CASE("Conv2dOptions: chained setters, the same layer as the positional form") {
  const auto o = nn::Conv2dOptions(1, 4, 3).stride(2).padding(1).bias(false);
  CHECK(o.in_channels() == 1);
  CHECK(o.out_channels() == 4);
  CHECK(o.kernel_size() == 3);
  CHECK(o.stride() == 2);
  CHECK(o.padding() == 1);
  CHECK(!o.bias());
  const auto d = nn::Conv2dOptions(2, 3, 5);
  CHECK(d.stride() == 1);
  CHECK(d.padding() == 0);
  CHECK(d.bias());

  dp::Generator g1(7), g2(7);
  nn::Conv2d a(nn::Conv2dOptions(3, 4, 3).stride(2).padding(1), &g1);
  nn::Conv2d b(3, 4, 3, 2, 1, true, &g2);
  CHECK(a.name() == b.name());
  CHECK(a.name() == "Conv2d(3, 4, kernel_size=3, stride=2, padding=1, bias=true)");
  CHECK(dp::equal(a.weight(), b.weight()));
  CHECK(dp::equal(a.bias(), b.bias()));
  dp::Tensor x = dp::from_vector(dp_test::uniform_values(2 * 3 * 7 * 7, -1, 1, 3), {2, 3, 7, 7});
  dp::Tensor ya = a(x);
  CHECK(ya.shape() == dp::Shape{2, 4, 4, 4});  // (7 + 2 − 3) / 2 + 1
  CHECK(dp::equal(ya, b(x)));

  nn::Conv2d nb(nn::Conv2dOptions(3, 4, 3).bias(false));
  CHECK(!nb.bias().defined());
  CHECK(nb.named_parameters().size() == 1);
  const auto back = a.options();
  CHECK(back.stride() == 2);
  CHECK(back.padding() == 1);
  CHECK(back.bias());
  CHECK(!nb.options().bias());
}

TEST_CASE("Conv2d's 4th positional argument is the stride, as in PyTorch's Python") {
  nn::Conv2d c(1, 2, 3, 2);
  CHECK(c.stride() == 2);
  CHECK(c.padding() == 0);
  CHECK(c(dp::zeros({1, 1, 8, 8})).shape() == dp::Shape{1, 2, 3, 3});
}

TEST_CASE("Conv2dOptions: bad values are refused by the layer") {
  CHECK(throws_with([] { nn::Conv2d(nn::Conv2dOptions(1, 2, 3).stride(0)); }, {"stride > 0", "0"}));
  CHECK(throws_with([] { nn::Conv2d(nn::Conv2dOptions(1, 2, 3).padding(-1)); }, {"padding >= 0", "-1"}));
  CHECK(throws_with([] { nn::Conv2d(nn::Conv2dOptions(1, 2, 0)); }, {"kernel_size > 0"}));
  CHECK(throws_with([] { nn::Conv2d(nn::Conv2dOptions(0, 2, 3)); }, {"positive in and out channels"}));
}

TEST_CASE("LinearOptions: bias(false) and the same layer as the positional form") {
  const auto o = nn::LinearOptions(784, 10).bias(false);
  CHECK(o.in_features() == 784);
  CHECK(o.out_features() == 10);
  CHECK(!o.bias());
  CHECK(nn::LinearOptions(3, 2).bias());

  nn::Linear nb(nn::LinearOptions(6, 5).bias(false));
  CHECK(!nb.bias().defined());
  CHECK(nb.named_parameters().size() == 1);
  CHECK(nb.name() == "Linear(in_features=6, out_features=5, bias=false)");
  CHECK(!nb.options().bias());
  CHECK(nb.options().in_features() == 6);

  dp::Generator g1(3), g2(3);
  nn::Linear a(nn::LinearOptions(6, 5), &g1);
  nn::Linear b(6, 5, true, &g2);
  CHECK(dp::equal(a.weight(), b.weight()));
  CHECK(dp::equal(a.bias(), b.bias()));
  CHECK(throws_with([] { nn::Linear(nn::LinearOptions(0, 5)); }, {"positive in and out features", "in=0"}));
}

TEST_CASE("BatchNorm2dOptions and DropoutOptions reach the layer") {
  const auto o = nn::BatchNorm2dOptions(8).eps(1e-3).momentum(0.01);
  CHECK(o.num_features() == 8);
  nn::BatchNorm2d bn(o);
  CHECK(bn.num_features() == 8);
  CHECK(bn.eps() == 1e-3);
  CHECK(bn.momentum() == 0.01);
  CHECK(bn.options().momentum() == 0.01);
  nn::BatchNorm2d dflt(nn::BatchNorm2dOptions(4));
  CHECK(dflt.eps() == 1e-5);
  CHECK(dflt.momentum() == 0.1);
  CHECK(throws_with([] { nn::BatchNorm2d(nn::BatchNorm2dOptions(4).momentum(1.5)); }, {"momentum in [0, 1]", "1.5"}));
  CHECK(throws_with([] { nn::BatchNorm2d(nn::BatchNorm2dOptions(4).eps(0)); }, {"eps > 0"}));

  CHECK(nn::DropoutOptions().p() == 0.5);
  nn::Dropout d(nn::DropoutOptions().p(0.2), 11);
  CHECK(d.p() == 0.2);
  CHECK(d.seed() == 11);
  CHECK(nn::Dropout(nn::DropoutOptions(0.3)).p() == 0.3);
  CHECK_THROWS_AS(nn::Dropout(nn::DropoutOptions().p(1.5)), dp::Error);
}
