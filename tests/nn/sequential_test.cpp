// Tests for dp/nn/sequential.h and whole models: PyTorch-style names, state_dict round
// trips, a residual block written by a user, gradients through a small CNN.
#include <doctest/doctest.h>

#include <memory>
#include <set>

#include "../autograd/gradcheck.h"
#include "dp/autograd/node.h"
#include "dp/nn/nn.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using dp_test::uniform_values;
using nn_test::F;
using nn_test::max_diff;
namespace nn = dp::nn;

namespace {

std::shared_ptr<nn::Sequential> small_cnn(dp::Generator* gen) {
  return std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(1, 4, 3, 1, 1, true, gen), std::make_shared<nn::BatchNorm2d>(4),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(4 * 3 * 3, 5, true, gen));
}

/// out = relu(bn(conv(x)) + shortcut(x)), shortcut a 1×1 conv.
struct ResidualBlock : nn::Module {
  ResidualBlock(std::int64_t in, std::int64_t out) {
    conv = register_module("conv", std::make_shared<nn::Conv2d>(in, out, 3, 1, 1, false));
    bn = register_module("bn", std::make_shared<nn::BatchNorm2d>(out));
    shortcut = register_module("shortcut", std::make_shared<nn::Conv2d>(in, out, 1, 1, 0, false));
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    return dp::relu((*bn)((*conv)(x)) + (*shortcut)(x));
  }
  std::shared_ptr<nn::Conv2d> conv;
  std::shared_ptr<nn::BatchNorm2d> bn;
  std::shared_ptr<nn::Conv2d> shortcut;
};

}  // namespace

TEST_CASE("Sequential names children 0, 1, ... like PyTorch") {
  dp::Generator gen(1);
  auto net = small_cnn(&gen);
  CHECK(net->size() == 6);
  std::vector<std::string> names;
  for (const auto& [n, t] : net->state_dict()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                          "1.running_var", "1.num_batches_tracked", "5.weight",
                                          "5.bias"});
  CHECK(net->name().rfind("Sequential(Conv2d(1, 4", 0) == 0);
  CHECK(dynamic_cast<nn::ReLU*>((*net)[2].get()) != nullptr);
  CHECK_THROWS_AS((*net)[6], dp::Error);

  nn::Sequential built;
  auto fc = built.push_back(std::make_shared<nn::Linear>(3, 2));
  built.push_back(std::make_shared<nn::ReLU>());
  CHECK(built.named_children()[1].first == "1");
  CHECK(fc->in_features() == 3);
  nn::Sequential listed{std::make_shared<nn::Linear>(3, 2), std::make_shared<nn::Tanh>()};
  CHECK(listed.size() == 2);
  CHECK(listed.forward(dp::zeros({4, 3})).shape() == dp::Shape{4, 2});
  CHECK_THROWS_AS(built.push_back(std::shared_ptr<nn::Module>()), dp::Error);
}

TEST_CASE_TEMPLATE("a small CNN: forward, backward and a state_dict round trip", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  dp::Generator g1(1), g2(2);
  auto a = small_cnn(&g1), b = small_cnn(&g2);
  a->to(dev);
  b->to(dev);
  dp::Tensor x = dp::from_vector(uniform_values(3 * 1 * 6 * 6, -1, 1, 3), {3, 1, 6, 6}, dev);
  dp::Tensor y = dp::from_vector(std::vector<std::int64_t>{0, 4, 2}, {3}, dev);
  dp::Tensor loss = nn::cross_entropy((*a)(x), y);
  loss.backward();
  for (const auto& [n, p] : a->named_parameters()) {
    INFO(n);
    CHECK(p.grad().defined());
  }
  // Load a's state into b: same outputs in eval mode, same buffers.
  b->load_state_dict(a->state_dict());
  a->eval();
  b->eval();
  CHECK(max_diff((*a)(x).to_vector(), (*b)(x).to_vector()) == 0);
  auto sa = a->state_dict(), sb = b->state_dict();
  for (std::size_t i = 0; i < sa.size(); ++i) {
    INFO(sa[i].first);
    CHECK(dp::equal(sa[i].second, sb[i].second));
  }
}

namespace {

// The output and parameter gradients of net's forward (y_fused, computed from x) equal
// bit for bit those of calling its modules one by one, which fuses nothing.
void check_same_as_one_by_one(nn::Sequential& net, const dp::Tensor& x, const dp::Tensor& y_fused) {
  dp::sum(y_fused).backward();
  std::vector<F> fused_grads;
  for (auto& p : net.parameters()) fused_grads.push_back(p.grad().to_vector());
  net.zero_grad();
  dp::Tensor y = x;
  for (const auto& m : net) y = m->forward(y);
  dp::sum(y).backward();
  CHECK(nn_test::bitwise_equal(y.to_vector(), y_fused.to_vector()));
  std::size_t i = 0;
  for (auto& p : net.parameters()) CHECK(nn_test::bitwise_equal(p.grad().to_vector(), fused_grads[i++]));
}

}  // namespace

TEST_CASE("Sequential runs Conv2d + ReLU as one op with the pair's bits") {
  // Note [Convolution + ReLU]: Sequential fuses the pair; calling the modules one by
  // one does not. Both must give the same output and gradients, bit for bit.
  dp::Generator gen(7);
  auto net = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(1, 8, 3, 1, 1, true, &gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Conv2d>(8, 16, 3, 1, 1, false, &gen),
      std::make_shared<nn::ReLU>(), std::make_shared<nn::Flatten>(),
      std::make_shared<nn::Linear>(16 * 14 * 14, 3, true, &gen));
  dp::Tensor x = dp::from_vector(uniform_values(4 * 28 * 28, -1, 1, 9), {4, 1, 28, 28});
  dp::Tensor y_fused = net->forward(x);
  check_same_as_one_by_one(*net, x, y_fused);
}

TEST_CASE("Sequential runs Linear + ReLU as one op with the pair's bits") {
  // Note [Linear epilogue]: the MLP's hidden layers run as linear_relu; a ReLU after a
  // ReLU runs alone. Same output and gradients.
  dp::Generator gen(8);
  auto net = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(784, 64, true, &gen), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(64, 32, false, &gen), std::make_shared<nn::ReLU>(), std::make_shared<nn::ReLU>(),
      std::make_shared<nn::Linear>(32, 10, true, &gen), std::make_shared<nn::ReLU>());
  dp::Tensor x = dp::from_vector(uniform_values(16 * 28 * 28, -1, 1, 10), {16, 1, 28, 28});
  dp::Tensor y_fused = net->forward(x);
  REQUIRE(y_fused.grad_fn() != nullptr);
  CHECK(y_fused.grad_fn()->name() == "LinearReluBackward");
  check_same_as_one_by_one(*net, x, y_fused);
}

TEST_CASE("a user-written residual block trains end to end") {
  auto block = std::make_shared<ResidualBlock>(2, 3);
  std::set<std::string> names;
  for (const auto& [n, t] : block->state_dict()) names.insert(n);
  CHECK(names.count("conv.weight"));
  CHECK(names.count("bn.running_var"));
  CHECK(names.count("shortcut.weight"));
  dp::Tensor x = dp::from_vector(uniform_values(2 * 2 * 4 * 4, -1, 1, 4), {2, 2, 4, 4});
  dp::Tensor out = (*block)(x);
  CHECK(out.shape() == dp::Shape{2, 3, 4, 4});
  dp::sum(out).backward();
  for (const auto& [n, p] : block->named_parameters()) {
    INFO(n);
    REQUIRE(p.grad().defined());
    CHECK(dp::max_abs_diff(p.grad(), dp::zeros_like(p.grad())) > 0);
  }
}

TEST_CASE("gradients from a backward before the first parameters() survive the flattening") {
  // Two identical trees: one flattened before backward, one only after it; then the
  // outer tree is flattened again after its child was (re-flattening keeps them too).
  auto make = [] {
    dp::Generator gen(4);
    return std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(3, 4, true, &gen), std::make_shared<nn::ReLU>(),
                                            std::make_shared<nn::Linear>(4, 2, true, &gen));
  };
  auto early = make(), late = make();
  early->parameters();
  const dp::Tensor x = dp::from_vector(uniform_values(5 * 3, -1, 1, 8), {5, 3});
  dp::sum((*early)(x)).backward();
  dp::sum((*late)(x)).backward();
  auto a = early->parameters(), b = late->parameters();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    REQUIRE(b[i].grad().defined());
    CHECK(dp::equal(a[i].grad(), b[i].grad()));
    CHECK(dp::max_abs_diff(b[i].grad(), dp::zeros_like(b[i].grad())) > 0);
  }
  auto child = std::make_shared<nn::Linear>(3, 2);
  child->parameters();
  dp::sum((*child)(x)).backward();
  const dp::Tensor g = child->weight().grad().clone();
  auto parent = std::make_shared<nn::Sequential>(child);
  parent->parameters();  // a new set over the child's parameters
  CHECK(dp::equal(child->weight().grad(), g));
}

TEST_CASE("Sequential with names: state_dict keys by name, layers run in order") {
  dp::Generator gen(4);
  auto fc1 = std::make_shared<nn::Linear>(6, 16, true, &gen);
  auto fc2 = std::make_shared<nn::Linear>(16, 3, true, &gen);
  auto net = std::make_shared<nn::Sequential>(
      nn::Sequential::Named{{"fc1", fc1}, {"act", std::make_shared<nn::ReLU>()}, {"fc2", fc2}});
  CHECK(net->size() == 3);
  std::vector<std::string> names;
  for (const auto& [n, t] : net->state_dict()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"});
  // A braced list of pairs reads as the named constructor too.
  nn::Sequential braced({{"a", std::make_shared<nn::ReLU>()}, {"b", std::make_shared<nn::Tanh>()}});
  CHECK(braced.named_children()[1].first == "b");
  dp::Tensor x = dp::randn({4, 6}, gen);
  CHECK(dp::equal((*net)(x), (*fc2)(dp::relu((*fc1)(x)))));
  // push_back with a name appends after the named layers.
  net->push_back("out", std::make_shared<nn::Sigmoid>());
  CHECK(net->named_children().back().first == "out");
  CHECK(dp::equal((*net)(x), dp::sigmoid((*fc2)(dp::relu((*fc1)(x))))));
}

TEST_CASE("Sequential refuses bad names and null layers") {
  auto relu = [] { return std::make_shared<nn::ReLU>(); };
  CHECK_THROWS_WITH_AS(nn::Sequential(nn::Sequential::Named{{"a", relu()}, {"a", relu()}}),
                       doctest::Contains("'a' is already registered"), dp::Error);
  CHECK_THROWS_WITH_AS(nn::Sequential(nn::Sequential::Named{{"a.b", relu()}}), doctest::Contains("without '.'"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(nn::Sequential(nn::Sequential::Named{{"", relu()}}), doctest::Contains("non-empty name"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(nn::Sequential(nn::Sequential::Named{{"fc", nullptr}}),
                       doctest::Contains("null pointer for layer 0 ('fc')"), dp::Error);
  nn::Sequential s;
  CHECK_THROWS_AS(s.push_back(std::shared_ptr<nn::Linear>()), dp::Error);
  CHECK(s.empty());
}

TEST_CASE("register_module on a Sequential appends a layer that forward runs") {
  // torch.nn.Sequential.add_module appends a layer; a registered child that forward
  // skipped would be trained by nothing.
  dp::Generator gen(6);
  auto net = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(4, 5, true, &gen));
  auto extra = net->register_module("extra", std::make_shared<nn::Linear>(5, 2, true, &gen));
  CHECK(net->size() == 2);
  CHECK((*net)[1] == extra);
  dp::Tensor x = dp::randn({3, 4}, gen);
  dp::Tensor y = (*net)(x);
  CHECK(y.shape() == dp::Shape{3, 2});
  CHECK(dp::equal(y, (*extra)((*(*net)[0])(x))));
  // Its parameters get gradients.
  y.sum().backward();
  CHECK(extra->weight().grad().defined());
  // A subclass that registers its layers in its constructor gets them run too.
  struct Stack : nn::Sequential {
    Stack() {
      register_module("first", std::make_shared<nn::Linear>(4, 4));
      register_module("act", std::make_shared<nn::ReLU>());
    }
  };
  Stack st;
  CHECK(st.size() == 2);
  CHECK(st.forward(x).shape() == dp::Shape{3, 4});
  CHECK((st.forward(x) < 0.0).sum().item<float>() == 0.0f);  // the ReLU ran last
}
