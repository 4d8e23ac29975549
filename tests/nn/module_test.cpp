// Module's introspection habits from PyTorch (dp/nn/module.h): the module tree printed
// as PyTorch's repr, extra_repr, type_name, num_parameters, and writing into every
// parameter through the list parameters() returns.
#include <doctest/doctest.h>

#include <memory>
#include <vector>
#include <sstream>
#include <string>

#include "dp/nn/nn.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"

namespace nn = dp::nn;

namespace {

/// A user module with its own settings and children.
struct Block : nn::Module {
  explicit Block(std::int64_t width) : width(width) {
    fc = register_module("fc", std::make_shared<nn::Linear>(width, width));
    inner = register_module("inner", std::make_shared<nn::Sequential>(std::make_shared<nn::ReLU>(),
                                                                       std::make_shared<nn::Flatten>()));
  }
  dp::Tensor forward(const dp::Tensor& x) override { return (*inner)((*fc)(x)); }
  std::string extra_repr() const override { return "width=" + std::to_string(width); }
  std::int64_t width;
  std::shared_ptr<nn::Linear> fc;
  std::shared_ptr<nn::Sequential> inner;
};

struct Plain : nn::Module {
  dp::Tensor forward(const dp::Tensor& x) override { return x; }
};

}  // namespace

TEST_CASE("std::cout << *net prints the module tree as PyTorch's repr") {
  auto net = std::make_shared<nn::Sequential>(nn::Sequential::Named{
      {"fc1", std::make_shared<nn::Linear>(6, 16)},
      {"act", std::make_shared<nn::ReLU>()},
      {"fc2", std::make_shared<nn::Linear>(nn::LinearOptions(16, 3).bias(false))}});
  std::ostringstream os;
  os << *net;
  CHECK(os.str() ==
        "Sequential(\n"
        "  (fc1): Linear(in_features=6, out_features=16, bias=true)\n"
        "  (act): ReLU()\n"
        "  (fc2): Linear(in_features=16, out_features=3, bias=false)\n"
        ")");
  CHECK(net->repr() == os.str());
}

TEST_CASE("nested modules indent; a user module's extra_repr comes first") {
  auto net = std::make_shared<nn::Sequential>(
      std::make_shared<nn::Conv2d>(1, 8, 3), std::make_shared<nn::BatchNorm2d>(8), std::make_shared<nn::MaxPool2d>(2),
      std::make_shared<nn::AvgPool2d>(2), std::make_shared<nn::AdaptiveAvgPool2d>(1), std::make_shared<Block>(4),
      std::make_shared<nn::Dropout>(0.25), std::make_shared<nn::Sigmoid>(), std::make_shared<nn::Tanh>());
  CHECK(net->repr() ==
        "Sequential(\n"
        "  (0): Conv2d(1, 8, kernel_size=3, stride=1, padding=0, bias=true)\n"
        "  (1): BatchNorm2d(8, eps=1e-05, momentum=0.1)\n"
        "  (2): MaxPool2d(kernel_size=2, stride=2, padding=0)\n"
        "  (3): AvgPool2d(kernel_size=2, stride=2, padding=0)\n"
        "  (4): AdaptiveAvgPool2d(output_size=1)\n"
        "  (5): Block(\n"
        "    width=4\n"
        "    (fc): Linear(in_features=4, out_features=4, bias=true)\n"
        "    (inner): Sequential(\n"
        "      (0): ReLU()\n"
        "      (1): Flatten(start_dim=1, end_dim=-1)\n"
        "    )\n"
        "  )\n"
        "  (6): Dropout(p=0.25)\n"
        "  (7): Sigmoid()\n"
        "  (8): Tanh()\n"
        ")");
}

TEST_CASE("name() is type_name() and extra_repr(); layers keep their one-line names") {
  Plain p;
  CHECK(p.type_name() == "Plain");
  CHECK(p.name() == "Plain()");
  CHECK(p.repr() == "Plain()");
  Block b(2);
  CHECK(b.name() == "Block(width=2)");
  nn::Linear fc(3, 2);
  CHECK(fc.type_name() == "Linear");
  CHECK(fc.extra_repr() == "in_features=3, out_features=2, bias=true");
  CHECK(fc.name() == "Linear(in_features=3, out_features=2, bias=true)");
  CHECK(nn::ReLU().name() == "ReLU()");
  CHECK(nn::Flatten().name() == "Flatten(start_dim=1, end_dim=-1)");
}

TEST_CASE("num_parameters counts the elements of every parameter once, not buffers") {
  auto fc = std::make_shared<nn::Linear>(6, 16);
  auto net = std::make_shared<nn::Sequential>(fc, std::make_shared<nn::BatchNorm2d>(16),
                                              std::make_shared<nn::Linear>(16, 3, false));
  CHECK(net->num_parameters() == 6 * 16 + 16 + 2 * 16 + 16 * 3);
  // A module shared twice counts once, as parameters() lists it once.
  auto twice = std::make_shared<nn::Sequential>(fc, fc);
  CHECK(twice->num_parameters() == 6 * 16 + 16);
  std::int64_t listed = 0;
  for (const auto& p : twice->parameters()) listed += p.numel();
  CHECK(listed == twice->num_parameters());
  CHECK(Plain().num_parameters() == 0);
}

TEST_CASE("for (auto& p : net->parameters()) p.fill_(...) writes into the module") {
  auto net = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(3, 2), std::make_shared<nn::ReLU>(),
                                              std::make_shared<nn::Linear>(2, 1));
  // With grad mode on a parameter is a leaf that requires grad: refused, as in PyTorch.
  CHECK_THROWS_WITH_AS(net->parameters()[0].fill_(0.5), doctest::Contains("leaf that requires grad"), dp::Error);
  dp::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.fill_(0.5);
  for (const auto& [name, t] : net->state_dict()) {
    CAPTURE(name);
    CHECK((t == 0.5).sum().item<std::int64_t>() == t.numel());
  }
  auto params = net->parameters();
  params[0].zero_();
  CHECK((net->state_dict()[0].second == 0.0).sum().item<std::int64_t>() == 6);
}

namespace {

/// An embedding and two heads of the same (V, C) weight shape, a Linear of another
/// shape and a BatchNorm: what weight tying ties, and what it must refuse.
struct TwoUses : nn::Module {
  TwoUses() {
    wte = register_module("wte", std::make_shared<nn::Embedding>(5, 3));
    head = register_module("head", std::make_shared<nn::Linear>(3, 5, false));
    head2 = register_module("head2", std::make_shared<nn::Linear>(3, 5, false));
    other = register_module("other", std::make_shared<nn::Linear>(5, 3, false));
    bn = register_module("bn", std::make_shared<nn::BatchNorm2d>(3));
  }
  std::shared_ptr<nn::Embedding> wte;
  std::shared_ptr<nn::Linear> head, head2, other;
  std::shared_ptr<nn::BatchNorm2d> bn;
};

/// The message of the dp::Error fn throws ("" when it throws none).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const dp::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("share_parameter ties two modules' parameters; parameter() finds one by its dotted name") {
  auto net = std::make_shared<TwoUses>();
  const std::int64_t untied = net->num_parameters();
  net->share_parameter("head.weight", net->parameter("wte.weight"));
  CHECK(net->head->weight().raw_data() == net->wte->weight().raw_data());
  CHECK(net->num_parameters() == untied - 5 * 3);
  net->share_parameter("head.weight", net->parameter("wte.weight"));  // tying again changes nothing
  net->share_parameter("wte.weight", net->parameter("head.weight"));  // nor the other way round
  CHECK(net->num_parameters() == untied - 5 * 3);
  net->share_parameter("head2.weight", net->parameter("head.weight"));  // a third use: wte's parameter again
  CHECK(net->head2->weight().raw_data() == net->wte->weight().raw_data());
  CHECK(net->num_parameters() == untied - 2 * 5 * 3);
  dp::Tensor x = dp::from_vector(std::vector<float>{1, 2, 3}, {1, 3});
  CHECK(net->head->forward(x).shape() == dp::Shape{1, 5});
}

TEST_CASE("share_parameter and parameter() refuse bad input with a dp::Error naming it") {
  auto net = std::make_shared<TwoUses>();
  CHECK(contains(error_of([&] { net->parameter("wte.bias"); }), "expected a parameter 'bias' in Embedding"));
  CHECK(contains(error_of([&] { net->parameter("lm_head.weight"); }), "expected a child module 'lm_head'"));
  CHECK(contains(error_of([&] { net->share_parameter("head.weight", nn::Parameter()); }), "got an empty one"));
  CHECK(contains(error_of([&] { net->share_parameter("head.weight", net->parameter("other.weight")); }),
                 "expected a source of shape [5, 3], got [3, 5]"));
  CHECK(contains(error_of([&] { net->share_parameter("bn.weight", nn::Parameter(net->buffer_slots().at(0))); }),
                 "expected a parameter as the source, got a buffer"));
  net->share_parameter("head.weight", net->parameter("wte.weight"));
  CHECK(contains(error_of([&] { net->share_parameter("wte.weight", net->parameter("head2.weight")); }),
                 "already the source of another tie"));
  auto fresh = std::make_shared<TwoUses>();
  fresh->parameters();  // flattens
  CHECK(contains(error_of([&] { fresh->share_parameter("head.weight", fresh->parameter("wte.weight")); }),
                 "already flattened"));
}
