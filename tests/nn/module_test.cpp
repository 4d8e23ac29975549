// Module's introspection habits from PyTorch (dp/nn/module.h): the module tree printed
// as PyTorch's repr, extra_repr, type_name, num_parameters, and writing into every
// parameter through the list parameters() returns.
#include <doctest/doctest.h>

#include <memory>
#include <sstream>
#include <string>

#include "dp/nn/nn.h"
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
  for (auto& p : net->parameters()) p.fill_(0.5);
  for (const auto& [name, t] : net->state_dict()) {
    CAPTURE(name);
    CHECK((t == 0.5).sum().item<std::int64_t>() == t.numel());
  }
  auto params = net->parameters();
  params[0].zero_();
  CHECK((net->state_dict()[0].second == 0.0).sum().item<std::int64_t>() == 6);
}
