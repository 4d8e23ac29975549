// dp's bfloat16 autocast against PyTorch's (torch.autocast("cpu", torch.bfloat16)) on a
// small CNN with BatchNorm and an MLP. tests/nn/golden_amp.safetensors holds PyTorch's
// batches, initial states and results, written by scripts/make_golden_amp.py (its
// docstring lists every tensor); meson passes its path in DP_GOLDEN_AMP. Compared: the
// logits, the loss and every gradient of one train-mode forward under autocast, and the
// parameters after 3 Adam steps.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "golden_file.h"

namespace {

namespace nn = dp::nn;
using dp::Tensor;

// Note [bf16 golden tolerances]
// Both libraries round the same operations' results to bfloat16 (unit in the last place
// 2^-8 relative, rounding error up to half of it), but not the same set of them: PyTorch's
// CPU autocast keeps batch_norm, ReLU and max-pool in bfloat16, dp's policy computes
// batch_norm in float32 (Note [Autocast op policy]), and the sums inside convolutions,
// products and reductions run in other orders, so a result near a rounding boundary
// lands on either neighbour. Each rounding contributes up to one ulp of the values it
// touches, and a forward of this depth chains about six (conv, norm, pool, conv, norm,
// linear), the backward as many again. Compared normwise as the float32 golden test is,
//   |dp − torch| ≤ rtol · (|torch| + max |torch| over the tensor),
// rtol = 4 ulps = 4 · 2^-8 ≈ 1.6e-2 for logits, loss and gradients: the roundings on
// each path mostly cancel (observed: under one ulp of each tensor's largest value, see
// the MESSAGE lines), and a bug moves values by 1e-1 to 1 of the tensor's largest (a
// wrong formula, a dropped term, a step in float32 where PyTorch rounds). Adam divides
// each gradient by its own running magnitude, so a component whose gradient lies within
// rounding noise of zero steps by up to lr in the direction the noise picks, in either
// library; the parameters' updates after 3 steps (after − init) must therefore agree
// in the root-mean-square sense, to a fifth of the update's size (observed: below 0.05
// on the MLP, whose hidden weights have the most near-zero gradients), while a wrong lr,
// beta or bias correction changes them by half or more.
constexpr double kUlp = 1.0 / 256.0;
constexpr double kRtol = 4 * kUlp;
constexpr double kUpdateRtol = 0.2;
// float16 keeps 11 significant bits (ulp 2^-11 relative, 8× finer than bfloat16's) and
// this MLP has few gradients near zero: its updates agree to 5e-4 of their size
// (observed); 1e-2 leaves 20× room, while a wrong lr, a step taken that PyTorch skipped
// or a skipped one taken moves them by 0.3 or more.
constexpr double kFp16UpdateRtol = 1e-2;
constexpr int kSteps = 3;
constexpr double kLr = 1e-3;

/// tests/nn/golden_amp.safetensors, whose path meson passes in DP_GOLDEN_AMP.
golden::File golden_amp() {
  return golden::File::from_env("DP_GOLDEN_AMP", "regenerate it with scripts/make_golden_amp.py");
}

/// max |got − want| / (|want| + max |want|) over the tensor, in units of the tolerance.
double normwise(const Tensor& got, const Tensor& want) {
  const std::vector<float> g = got.to(dp::Dtype::Float32).to_vector(), w = want.to_vector();
  REQUIRE(g.size() == w.size());
  double scale = 0, worst = 0;
  for (float v : w) scale = std::max(scale, static_cast<double>(std::fabs(v)));
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(static_cast<double>(g[i]) - w[i]);
    worst = std::max(worst, err / (std::fabs(w[i]) + scale));
  }
  return worst;
}

std::shared_ptr<nn::Sequential> make(const std::string& which) {
  auto s = std::make_shared<nn::Sequential>();
  if (which == "cnn") {
    s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions(1, 4, 3).padding(1).bias(false)));
    s->push_back(std::make_shared<nn::BatchNorm2d>(4));
    s->push_back(std::make_shared<nn::ReLU>());
    s->push_back(std::make_shared<nn::MaxPool2d>(2));
    s->push_back(std::make_shared<nn::Conv2d>(nn::Conv2dOptions(4, 8, 3).padding(1).bias(false)));
    s->push_back(std::make_shared<nn::BatchNorm2d>(8));
    s->push_back(std::make_shared<nn::ReLU>());
    s->push_back(std::make_shared<nn::MaxPool2d>(2));
    s->push_back(std::make_shared<nn::Flatten>());
    s->push_back(std::make_shared<nn::Linear>(72, 10));
  } else {
    s->push_back(std::make_shared<nn::Linear>(20, 32));
    s->push_back(std::make_shared<nn::ReLU>());
    s->push_back(std::make_shared<nn::Linear>(32, 32));
    s->push_back(std::make_shared<nn::ReLU>());
    s->push_back(std::make_shared<nn::Linear>(32, 10));
  }
  return s;
}

/// The updates (after − init) of every parameter of `net` against PyTorch's (`prefix` +
/// name): where a gradient is within rounding noise of zero, Adam's step follows the
/// noise's sign (up to 2·lr apart per step); everywhere else the steps agree. So the
/// updates must agree in the root-mean-square sense, to `rtol` of their size.
void expect_updates_close(const std::string& label, nn::Module& net, const nn::StateDict& init,
                          const golden::File& golden, const std::string& prefix, double rtol) {
  for (const auto& [name, p] : net.named_parameters()) {
    CAPTURE(name);
    const auto start = std::find_if(init.begin(), init.end(), [&](const auto& kv) { return kv.first == name; });
    REQUIRE(start != init.end());
    const std::vector<float> got = p.to_vector(), want = golden[prefix + name].to_vector();
    const std::vector<float> s0 = start->second.to_vector();
    double diff2 = 0, upd2 = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double du = static_cast<double>(got[i]) - want[i], u = static_cast<double>(want[i]) - s0[i];
      diff2 += du * du;
      upd2 += u * u;
    }
    const double ratio = std::sqrt(diff2 / std::max(upd2, 1e-30));
    MESSAGE(label, " after Adam ", name, ": rms(dp update - torch update) / rms(torch update) = ", ratio);
    CHECK(ratio <= rtol);
  }
}

}  // namespace

TEST_CASE("golden bf16: logits, loss, gradients and 3 Adam steps under autocast match PyTorch's") {
  const golden::File golden = golden_amp();
  for (const std::string which : {"cnn", "mlp"}) {
    CAPTURE(which);
    auto net = make(which);
    net->load_state_dict(golden.state(which + ".init"), /*strict=*/false);
    dp::optim::Adam opt(net->parameters(), {.lr = kLr});
    const Tensor& x = golden[which + ".input"];
    const Tensor& y = golden[which + ".target"];
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      Tensor logits, loss;
      {
        dp::amp::autocast guard(dp::Dtype::BFloat16);
        logits = net->forward(x);
        loss = nn::cross_entropy(logits, y);
      }
      CHECK(logits.dtype() == dp::Dtype::BFloat16);
      CHECK(loss.dtype() == dp::Dtype::Float32);
      loss.backward();
      if (step == 0) {
        const double l = normwise(logits, golden[which + ".logits"]);
        const double s = normwise(loss, golden[which + ".loss"]);
        MESSAGE(which, ": logits at ", l / kRtol, " of the tolerance, loss at ", s / kRtol);
        CHECK(l <= kRtol);
        CHECK(s <= kRtol);
        for (const auto& [name, p] : net->named_parameters()) {
          CAPTURE(name);
          REQUIRE(p.grad().defined());
          CHECK(p.grad().dtype() == dp::Dtype::Float32);
          const double g = normwise(p.grad(), golden[which + ".grad." + name]);
          MESSAGE(which, " grad ", name, " at ", g / kRtol, " of the tolerance");
          CHECK(g <= kRtol);
        }
      }
      opt.step();
    }
    expect_updates_close(which, *net, golden.state(which + ".init"), golden, which + ".adam.", kUpdateRtol);
  }
}

TEST_CASE("golden fp16: a GradScaler's scales, skipped steps and 6 Adam steps under float16 autocast match PyTorch's") {
  // scripts/make_golden_amp.py's fp16 case: the scale alternates between 2^10 (stepped,
  // then grown by 2^30) and 2^40 (the float16 gradients overflow: skipped, backed off).
  const golden::File golden = golden_amp();
  auto net = make("mlp");
  net->load_state_dict(golden.state("fp16.init"), /*strict=*/true);
  dp::optim::Adam opt(net->parameters(), {.lr = kLr});
  dp::amp::GradScaler scaler({.init_scale = 1024.0, .growth_factor = std::ldexp(1.0, 30),
                              .backoff_factor = std::ldexp(1.0, -30), .growth_interval = 1});
  const std::vector<float> scales = golden["fp16.scale"].to_vector();
  const std::vector<std::int64_t> skipped = golden["fp16.skipped"].to_vector_i64();
  REQUIRE(scales.size() == 6);
  std::int64_t stepped = 0;
  for (std::int64_t step = 0; step < 6; ++step) {
    CAPTURE(step);
    opt.zero_grad();
    Tensor loss;
    {
      dp::amp::autocast guard(dp::Dtype::Float16);
      const Tensor logits = net->forward(golden["fp16.input"].narrow(0, step, 1).reshape({16, 20}));
      CHECK(logits.dtype() == dp::Dtype::Float16);
      loss = nn::cross_entropy(logits, golden["fp16.target"].narrow(0, step, 1).reshape({16}));
    }
    scaler.scale(loss).backward();
    const double before = scaler.get_scale();
    scaler.step(opt);
    scaler.update();
    CHECK(scaler.get_scale() == static_cast<double>(scales[static_cast<std::size_t>(step)]));
    CHECK((scaler.get_scale() < before) == (skipped[static_cast<std::size_t>(step)] == 1));
    stepped += 1 - skipped[static_cast<std::size_t>(step)];
  }
  CHECK(opt.step_count() == stepped);  // a skipped step is not an optimizer step
  expect_updates_close("fp16", *net, golden.state("fp16.init"), golden, "fp16.adam.", kFp16UpdateRtol);
}
