// DataParallel::forward_backward with loss descriptors (dp/nn/loss.h): every reduction
// gives the unwrapped model's loss and gradients — Mean, Sum, class weights,
// ignore_index (inside and outside the class range), label smoothing, elementwise
// losses — on 2 and 3 devices with uneven shards, in DP, DDP and Sharded modes;
// Reduction::None and unsplittable options are refused; a plain LossFn keeps its
// documented mean-by-rows weighting.
#include <doctest/doctest.h>

#include <cmath>

#include "dp/dp.h"

namespace {

using dp::Tensor;
namespace nn = dp::nn;

std::shared_ptr<nn::Sequential> make_net(std::uint64_t seed, std::int64_t out = 4) {
  dp::Generator gen(seed);
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(5, 12, true, &gen));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(12, out, true, &gen));
  return net;
}

// Labels in [0, 4); rows r with r % 4 == 1 get `ignore` when it is not -100.
Tensor make_labels(std::int64_t rows, std::int64_t ignore) {
  std::vector<std::int64_t> y(rows);
  for (std::int64_t i = 0; i < rows; ++i) y[i] = (i * 3 + 1) % 4;
  if (ignore != -100)
    for (std::int64_t i = 1; i < rows; i += 4) y[i] = ignore;
  return dp::from_vector(y, {rows}, dp::cpu(0));
}

std::vector<float> grads(nn::Module& net) {
  std::vector<float> out;
  for (const Tensor& p : net.parameters()) {
    auto v = p.grad().to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

std::vector<float> params(nn::Module& net) {
  std::vector<float> out;
  for (auto& [name, t] : net.state_dict()) {
    auto v = t.to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs(double(a[i]) - b[i]) / std::max(1.0, std::fabs(double(b[i]))));
  return m;
}

// The shard sums and the sum over devices add in another order than one device's
// reduction: float rounding of a few ulps of the largest term.
constexpr double kTolerance = 1e-5;

template <typename Loss>
void check_exact(const char* what, const Loss& loss, Tensor x, Tensor y) {
  const std::int64_t rows = x.size(0);
  auto ref = make_net(9, 4);
  dp::optim::SGD ref_opt(ref->parameters(), {.lr = 0.5});  // flattens the parameters before backward
  const Tensor ref_loss = loss((*ref)(x), y);
  ref_loss.backward();
  const std::vector<float> ref_grads = grads(*ref);
  ref_opt.step();
  const std::vector<float> ref_params = params(*ref);
  for (int n : {2, 3}) {
    std::vector<float> dp_params;
    for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP, dp::Mode::Sharded}) {
      CAPTURE(std::string(what));
      CAPTURE(rows);
      CAPTURE(n);
      CAPTURE(std::string(mode_name(mode)));
      auto net = make_net(9, 4);
      std::vector<dp::Device> devs;
      for (int d = 0; d < n; ++d) devs.push_back(dp::cpu(d));
      dp::DataParallel model(net, devs, {.mode = mode});
      dp::optim::SGD opt(model.parameters(), {.lr = 0.5});
      opt.zero_grad();
      const Tensor l = model.forward_backward(x, y, loss);
      CHECK(std::fabs(l.item() - ref_loss.item()) <= kTolerance * std::max(1.0, std::fabs(ref_loss.item())));
      if (mode != dp::Mode::Sharded) CHECK(max_rel_diff(grads(*net), ref_grads) < kTolerance);
      opt.step();
      const std::vector<float> p = params(*net);
      CHECK(max_rel_diff(p, ref_params) < kTolerance);
      if (dp_params.empty()) dp_params = p;
      else CHECK(p == dp_params);  // the three designs bitwise alike
    }
  }
}

}  // namespace

TEST_CASE("forward_backward with a CrossEntropyLoss descriptor is exact for every reduction and option") {
  dp::Generator gen(3);
  const Tensor w = dp::from_vector(std::vector<float>{0.5f, 2.0f, 1.0f, 3.0f}, {4});
  for (std::int64_t rows : {11, 7}) {  // uneven on 2 and 3 devices
    const Tensor x = dp::randn({rows, 5}, gen, dp::cpu(0));
    const Tensor y = make_labels(rows, -100);
    const Tensor y_ign = make_labels(rows, -1);  // ignored rows, index outside [0, C)
    const Tensor y_ign0 = make_labels(rows, 0);   // ignore_index inside the class range
    using R = nn::Reduction;
    check_exact("mean", nn::CrossEntropyLoss{}, x, y);
    check_exact("sum", nn::CrossEntropyLoss{.reduction = R::Sum}, x, y);
    check_exact("weighted mean", nn::CrossEntropyLoss{.weight = w}, x, y);
    check_exact("weighted sum", nn::CrossEntropyLoss{.weight = w, .reduction = R::Sum}, x, y);
    check_exact("ignore mean", nn::CrossEntropyLoss{.ignore_index = -1}, x, y_ign);
    check_exact("ignore 0, weighted mean", nn::CrossEntropyLoss{.weight = w, .ignore_index = 0}, x, y_ign0);
    check_exact("smoothing, weighted, ignore",
                nn::CrossEntropyLoss{.weight = w, .ignore_index = -1, .label_smoothing = 0.2}, x, y_ign);
    check_exact("nll weighted ignore mean", nn::NLLLoss{.weight = w, .ignore_index = -1}, x, y_ign);
    check_exact("nll sum", nn::NLLLoss{.reduction = R::Sum}, x, y);
  }
}

TEST_CASE("forward_backward with elementwise loss descriptors is exact for Mean and Sum") {
  dp::Generator gen(4);
  using R = nn::Reduction;
  for (std::int64_t rows : {11, 7}) {
    const Tensor x = dp::randn({rows, 5}, gen, dp::cpu(0));
    const Tensor t = dp::randn({rows, 4}, gen, dp::cpu(0));
    const Tensor p = dp::sigmoid(dp::randn({rows, 4}, gen, dp::cpu(0)));  // targets in (0, 1)
    check_exact("mse mean", nn::MSELoss{}, x, t);
    check_exact("mse sum", nn::MSELoss{.reduction = R::Sum}, x, t);
    check_exact("l1 mean", nn::L1Loss{}, x, t);
    check_exact("smooth l1 mean", nn::SmoothL1Loss{.beta = 0.5}, x, t);
    check_exact("smooth l1 sum", nn::SmoothL1Loss{.reduction = R::Sum}, x, t);
    const Tensor pw = dp::from_vector(std::vector<float>{1.0f, 2.0f, 0.5f, 3.0f}, {4});
    const Tensor ew = dp::from_vector(std::vector<float>{0.2f, 1.0f, 1.5f, 0.7f}, {1, 4});
    check_exact("bce mean", nn::BCEWithLogitsLoss{}, x, p);
    check_exact("bce weighted mean", nn::BCEWithLogitsLoss{.weight = ew, .pos_weight = pw}, x, p);
    check_exact("bce sum", nn::BCEWithLogitsLoss{.pos_weight = pw, .reduction = R::Sum}, x, p);
  }
}

TEST_CASE("a Sum loss returns the batch's sum, where a plain LossFn is weighted as a mean") {
  dp::Generator gen(5);
  const Tensor x = dp::randn({7, 5}, gen, dp::cpu(0));
  const Tensor y = make_labels(7, -100);
  auto ref = make_net(9);
  const double sum = nn::cross_entropy((*ref)(x), y, nn::Reduction::Sum).item();
  auto net = make_net(9);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)});
  const double exact = model.forward_backward(x, y, nn::CrossEntropyLoss{.reduction = nn::Reduction::Sum}).item();
  CHECK(std::fabs(exact - sum) < 1e-5 * std::fabs(sum));
  // A LossFn is taken to return its shard's mean (documented): a Sum comes back as
  // Σ_shards (rows_s / N)·sum_s, which is not the batch's sum.
  auto sum_fn = [](const Tensor& o, const Tensor& t) { return nn::cross_entropy(o, t, nn::Reduction::Sum); };
  const double weighted = model.forward_backward(x, y, sum_fn).item();
  CHECK(std::fabs(weighted - sum) > 0.1 * std::fabs(sum));
  // The descriptor alone computes the whole batch's loss like the functional op.
  CHECK(nn::CrossEntropyLoss{.reduction = nn::Reduction::Sum}((*ref)(x), y).item() == sum);
}

TEST_CASE("forward_backward with a descriptor: several inputs, and the bad cases") {
  auto net = make_net(9);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)});
  dp::Generator gen(6);
  const Tensor x = dp::randn({7, 5}, gen, dp::cpu(0));
  const Tensor y = make_labels(7, -100);
  auto throws_with = [](auto&& fn, std::initializer_list<std::string> parts) {
    try {
      fn();
    } catch (const dp::Error& e) {
      const std::string msg = e.what();
      for (const auto& p : parts)
        if (msg.find(p) == std::string::npos) {
          MESSAGE("message lacks '", p, "': ", msg);
          return false;
        }
      return true;
    }
    return false;
  };
  CHECK(throws_with([&] { model.forward_backward(x, y, nn::CrossEntropyLoss{.reduction = nn::Reduction::None}); },
                    {"CrossEntropyLoss", "Reduction::None", "Reduction::Sum or Reduction::Mean"}));
  const Tensor t = dp::zeros({7, 4});
  CHECK(throws_with([&] { model.forward_backward(x, t, nn::BCEWithLogitsLoss{.weight = dp::ones({7, 4})}); },
                    {"BCEWithLogitsLoss", "spans the batch", "[7, 4]"}));
  CHECK(throws_with([&] { model.forward_backward(x, y.narrow(0, 0, 5), nn::CrossEntropyLoss{}); },
                    {"target with 7 rows"}));
  CHECK(throws_with([&] { model.forward_backward(x, Tensor(), nn::MSELoss{}); }, {"target"}));
  // Every target ignored: NaN, as PyTorch's mean of nothing.
  const Tensor all_ignored = dp::full({7}, -100.0, dp::TensorOptions{dp::Dtype::Int64, dp::cpu(0)});
  CHECK(std::isnan(model.forward_backward(x, all_ignored, nn::CrossEntropyLoss{}).item()));
  // Several inputs: a module that adds its two inputs first.
  struct Sum2 : nn::Module {
    explicit Sum2(std::shared_ptr<nn::Module> inner) : net(register_module("net", std::move(inner))) {}
    using Module::forward;
    Tensor forward(const std::vector<Tensor>& in) override { return net->forward(dp::add(in[0], in[1])); }
    std::shared_ptr<nn::Module> net;
  };
  auto two = std::make_shared<Sum2>(make_net(9)), two_ref = std::make_shared<Sum2>(make_net(9));
  dp::DataParallel model2(two, {dp::cpu(0), dp::cpu(1)});
  const Tensor x2 = dp::randn({7, 5}, gen, dp::cpu(0));
  const nn::CrossEntropyLoss ce{.weight = dp::from_vector(std::vector<float>{1, 2, 3, 4}, {4}), .ignore_index = 2};
  const double got = model2.forward_backward({x, x2}, y, ce).item();
  const double want = ce((*two_ref)(x, x2), y).item();
  CHECK(std::fabs(got - want) < 1e-5 * std::max(1.0, std::fabs(want)));
}
