// DataParallelOptions::check_finite_grads: off by default; when on, a NaN/Inf gradient
// stops the step with a dp::Error naming the parameter and the device it came from.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <string>

#include "dp/autograd/node.h"
#include "dp/dp.h"

namespace {

using dp::Tensor;

// Identity forward; backward multiplies the gradient by NaN on one chosen device.
struct Poison : dp::nn::Module {
  std::string name() const override { return "Poison"; }
  Tensor forward(const Tensor& x) override {
    Tensor y;
    {
      dp::NoGradGuard no_grad;
      y = x.clone();
    }
    const int dev = x.device().index;
    const int target = device.load();
    dp::autograd::record("PoisonBackward", {x}, y, {}, [dev, target](const std::vector<Tensor>& g) {
      if (dev != target) return std::vector<Tensor>{g[0]};
      return std::vector<Tensor>{dp::mul(g[0], std::numeric_limits<double>::quiet_NaN())};
    });
    return y;
  }
  std::atomic<int> device{-1};  // -1: never poisons
};

// encoder -> poison -> head: a poisoned gradient reaches the encoder's parameters
// only, so the check must name an encoder parameter, never "head.*".
struct Net : dp::nn::Module {
  Net() {
    dp::Generator gen(5);
    encoder = register_module("encoder", std::make_shared<dp::nn::Linear>(4, 6, true, &gen));
    poison = register_module("poison", std::make_shared<Poison>());
    head = register_module("head", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return head->forward(poison->forward(encoder->forward(x))); }
  std::shared_ptr<dp::nn::Linear> encoder, head;
  std::shared_ptr<Poison> poison;
};

struct Batch {
  Tensor x, y;
};
Batch make_batch(std::int64_t rows) {
  dp::Generator gen(17);
  std::vector<std::int64_t> labels(rows);
  for (std::int64_t i = 0; i < rows; ++i) labels[i] = i % 3;
  return {dp::randn({rows, 4}, gen, dp::cpu(0)), dp::from_vector(labels, {rows}, dp::cpu(0))};
}

Tensor ce(const Tensor& out, const Tensor& y) { return dp::nn::cross_entropy(out, y); }

bool has_nonfinite(const Tensor& t) {
  for (float v : t.to_vector())
    if (!std::isfinite(v)) return true;
  return false;
}

}  // namespace

TEST_CASE("check_finite_grads is off by default") {
  CHECK_FALSE(dp::DataParallelOptions{}.check_finite_grads);
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    CAPTURE(static_cast<int>(mode));
    auto net = std::make_shared<Net>();
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
    net->poison->device = 1;
    Batch b = make_batch(9);
    CHECK_NOTHROW(model.forward_backward(b.x, b.y, ce));
    // The NaN went through unchecked: device 0's encoder gradient holds it.
    CHECK(has_nonfinite(net->encoder->weight().grad()));
    CHECK_FALSE(has_nonfinite(net->head->weight().grad()));
  }
}

TEST_CASE("check_finite_grads names the parameter and the device in DP and DDP modes") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    for (bool worker_loss : {true, false}) {
      for (int bad : {0, 2}) {
        CAPTURE(static_cast<int>(mode));
        CAPTURE(worker_loss);
        CAPTURE(bad);
        auto net = std::make_shared<Net>();
        dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)},
                               {.mode = mode, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6,
                                .check_finite_grads = true});
        dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
        Batch b = make_batch(9);
        net->poison->device = bad;
        const std::string device = dp::cpu(bad).str();
        auto step = [&] {
          opt.zero_grad();
          if (worker_loss) {
            model.forward_backward(b.x, b.y, ce);
          } else {
            ce(model(b.x), b.y).backward();
          }
        };
        // DDP checks each bucket before its all-reduce; with one bucket per parameter
        // the encoder's bias (a later bucket: buckets run last layer first) may be
        // the first found.
        const char* param = mode == dp::Mode::DP ? "'encoder.weight'" : "'encoder.";
        CHECK_THROWS_WITH_AS(step(), doctest::Contains(param), dp::Error);
        CHECK_THROWS_WITH_AS(step(), doctest::Contains(("on " + device).c_str()), dp::Error);
        CHECK_THROWS_WITH_AS(step(), doctest::Contains("non-finite"), dp::Error);
        // Clean gradients pass, and the model is usable after the failures.
        net->poison->device = -1;
        CHECK_NOTHROW(step());
        CHECK_NOTHROW(opt.step());
        CHECK_FALSE(has_nonfinite(model.parameters().set()->copy(0).data));
      }
    }
  }
}

TEST_CASE("check_finite_grads catches log(0) in the loss") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    CAPTURE(static_cast<int>(mode));
    auto net = std::make_shared<Net>();
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = mode, .check_finite_grads = true});
    Batch b = make_batch(6);
    // -log(0 · out): the gradient of log at 0 is Inf, times 0 on the way back is NaN.
    auto bad_loss = [](const Tensor& out, const Tensor&) { return dp::mean(dp::neg(dp::log(dp::mul(out, 0.0)))); };
    CHECK_THROWS_WITH_AS(model.forward_backward(b.x, b.y, bad_loss), doctest::Contains("non-finite gradient"),
                         dp::Error);
    model.zero_grad();  // the failed step's NaN stays in the gradient until zeroed
    CHECK_NOTHROW(model.forward_backward(b.x, b.y, ce));
  }
}
