// Tests for modules of several inputs (Note [Module inputs]): net(a, b) reaches
// forward(const std::vector<Tensor>&), single-input modules keep forward(x) and refuse
// more inputs, forward(x) of a several-input module passes {x}, and a module that
// overrides neither forward says so.
#include <doctest/doctest.h>

#include <memory>

#include "dp/nn/linear.h"
#include "dp/nn/module.h"
#include "dp/nn/sequential.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using dp::Tensor;
using nn_test::throws_with;
namespace nn = dp::nn;

namespace {

// out = fc(x * mask); a missing mask means all ones.
struct Masked : nn::Module {
  Masked() { fc = register_module("fc", std::make_shared<nn::Linear>(4, 2)); }
  using Module::forward;
  Tensor forward(const std::vector<Tensor>& in) override {
    DP_CHECK(in.size() == 1 || in.size() == 2, "Masked: expected (x) or (x, mask), got ", in.size(), " inputs");
    ++calls;
    return fc->forward(in.size() == 2 ? dp::mul(in[0], in[1]) : in[0]);
  }
  std::string name() const override { return "Masked"; }
  std::shared_ptr<nn::Linear> fc;
  int calls = 0;
};

struct Neither : nn::Module {
  std::string name() const override { return "Neither"; }
};

}  // namespace

TEST_CASE("net(x, mask) calls the vector forward; forward(x) passes {x}") {
  auto net = std::make_shared<Masked>();
  Tensor x = dp::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  Tensor mask = dp::from_vector(std::vector<float>{1, 0, 1, 0, 0, 1, 0, 1}, {2, 4});
  Tensor y = (*net)(x, mask);
  CHECK(net->calls == 1);
  CHECK(dp::equal(y, net->fc->forward(dp::mul(x, mask))));
  CHECK(dp::equal(net->forward(std::vector<Tensor>{x, mask}), y));
  // One input through either door reaches the vector forward.
  CHECK(dp::equal((*net)(x), net->fc->forward(x)));
  CHECK(dp::equal(net->forward(x), net->fc->forward(x)));
  CHECK(net->calls == 4);
  // Inside a Sequential, whose forward(x) calls each child's forward(x).
  auto seq = std::make_shared<nn::Sequential>(std::make_shared<Masked>());
  CHECK(seq->forward(x).shape() == dp::Shape{2, 2});
  CHECK(throws_with([&] { (*net)(x, mask, mask); }, {"Masked", "(x) or (x, mask)", "3 inputs"}));
}

TEST_CASE("single-input modules keep forward(x) and refuse several inputs") {
  auto fc = std::make_shared<nn::Linear>(4, 2);
  Tensor x = dp::ones({3, 4});
  const Tensor y = fc->forward(x);
  nn::Module& m = *fc;
  CHECK(dp::equal(m.forward(std::vector<Tensor>{x}), y));
  CHECK(dp::equal(m(x), y));
  CHECK(throws_with([&] { m(x, x); }, {"Linear(in_features=4, out_features=2, bias=true)", "expected 1 input",
                                       "got 2 inputs"}));
  CHECK(throws_with([&] { m.forward(std::vector<Tensor>{}); }, {"expected 1 input", "got 0 inputs"}));
}

TEST_CASE("a module that overrides neither forward is a clear error, not a recursion") {
  Neither n;
  CHECK(throws_with([&] { n(dp::ones({1})); }, {"Neither", "overrides neither forward"}));
  CHECK(throws_with([&] { n.forward(std::vector<Tensor>{dp::ones({1})}); }, {"Neither", "overrides neither"}));
  CHECK(throws_with([&] { n(dp::ones({1}), dp::ones({1})); }, {"Neither", "expected 1 input", "got 2"}));
}
