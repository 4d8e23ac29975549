// tests/parallel/channels_last_designs_test.cpp — channels-last batches (Note
// [Channels-last tensors] in dp/tensor/tensor.h) in DP, DDP and Sharded stages 1-3 on 1-3
// CPU devices: the layout reaches every worker (scatter slices along N, which keeps it),
// the designs stay bitwise alike, and the values are those of one device and of NCHW
// batches to float rounding (the convolutions and batch norms sum in another order);
// one device in any design is the plain net's arithmetic, bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::MemoryFormat;
using dp::Tensor;

constexpr int kSteps = 4;
constexpr std::int64_t kRows = 11;  // uneven on 2 and 3 devices

struct Trained {
  std::vector<float> state;     // parameters and buffers after the steps
  std::vector<double> losses;   // per step
  std::set<int> channels_last;  // devices whose first convolution computed channels-last
  std::set<int> nchw;           // ... and NCHW
};

/// kSteps SGD steps (momentum 0.9) of SmallConvNet on kRows-image batches: on `n` devices
/// in `options`' design (n = 0: the plain net on cpu(0)). Even steps go through
/// model(x) and backward, odd ones through forward_backward. Then one evaluation forward
/// of the last batch, whose logits come back in `eval_logits` when given.
Trained train(bool batch_norm, bool channels_last, int n, const dp::DataParallelOptions& options = {},
              std::vector<float>* eval_logits = nullptr) {
  auto net = std::make_shared<SmallConvNet>(7, batch_norm);
  std::unique_ptr<dp::DataParallel> model;
  if (n > 0) model = std::make_unique<dp::DataParallel>(net, cpus(n), options);
  dp::optim::SGD opt(model ? model->parameters() : net->parameters(), {.lr = 0.05, .momentum = 0.9});
  Trained out;
  Batch b;
  for (int s = 0; s < kSteps; ++s) {
    b = make_image_batch(kRows, 300 + static_cast<std::uint64_t>(s), channels_last);
    opt.zero_grad();
    Tensor loss;
    if (!model) {
      loss = loss_fn(net->forward(b.x), b.y);
      loss.backward();
    } else if (s % 2 == 0) {
      loss = loss_fn((*model)(b.x), b.y);
      loss.backward();
    } else {
      loss = model->forward_backward(b.x, b.y, loss_fn);
    }
    out.losses.push_back(loss.item());
    opt.step();
  }
  if (model) model->eval();
  else net->eval();
  {
    dp::NoGradGuard no_grad;
    Tensor logits = model ? (*model)(b.x) : net->forward(b.x);
    if (eval_logits) *eval_logits = logits.to_vector();
  }
  for (const auto& [device, format] : net->layouts)
    (format == MemoryFormat::ChannelsLast ? out.channels_last : out.nchw).insert(device);
  out.state = flat(net->state_dict());
  return out;
}

std::set<int> first_devices(int n) {
  std::set<int> s;
  for (int i = 0; i < n; ++i) s.insert(i);
  return s;
}

// Gradients are sums over at most kRows images that the designs (and the layouts) group
// differently; four SGD steps with momentum carry that rounding forward (as the MLP
// suites' 2e-5 after ten Adam steps).
constexpr double kTolerance = 2e-5;

}  // namespace

TEST_CASE("channels-last batches train in every design on 1-3 devices as on one device, and as NCHW ones") {
  // Without batch norm every design computes one device's gradient of the global batch.
  std::vector<float> single_logits;
  const Trained single = train(false, true, 0, {}, &single_logits);
  CHECK(single.channels_last == std::set<int>{0});
  CHECK(single.nchw.empty());
  const Trained single_nchw = train(false, false, 0);
  CHECK(single_nchw.channels_last.empty());
  CHECK(max_diff(single.state, single_nchw.state) < kTolerance);
  for (int n = 1; n <= 3; ++n) {
    std::vector<float> first;
    for (const NamedDesign& d : every_design()) {
      CAPTURE(n);
      CAPTURE(d.name);
      std::vector<float> logits;
      const Trained cl = train(false, true, n, d.options, &logits);
      // Every worker computed in the layout: scatter kept it on every device.
      CHECK(cl.channels_last == first_devices(n));
      CHECK(cl.nchw.empty());
      CHECK(max_diff(cl.state, single.state) < kTolerance);
      CHECK(max_diff(logits, single_logits) < kTolerance);
      for (int s = 0; s < kSteps; ++s) CHECK(std::fabs(cl.losses[s] - single.losses[s]) < kTolerance);
      if (n == 1) {  // one device in any design is the plain net's arithmetic
        CHECK(cl.state == single.state);
        CHECK(logits == single_logits);
        CHECK(cl.losses == single.losses);
      }
      // The same design with NCHW batches: the same values to rounding.
      const Trained nchw = train(false, false, n, d.options);
      CHECK(nchw.channels_last.empty());
      CHECK(max_diff(cl.state, nchw.state) < kTolerance);
      // The designs alike bit for bit on the same devices.
      if (first.empty()) first = cl.state;
      else CHECK(cl.state == first);
    }
  }
}

TEST_CASE("channels-last batch norm in every design on 1-3 devices: the designs alike, NCHW's values") {
  // BatchNorm normalises each device's rows by their own statistics (and DP and DDP keep
  // device 0's running statistics), so on several devices the reference is the same
  // design with NCHW batches; on one device, the plain net.
  std::vector<float> single_logits;
  const Trained single = train(true, true, 0, {}, &single_logits);
  CHECK(max_diff(single.state, train(true, false, 0).state) < kTolerance);
  for (int n = 1; n <= 3; ++n) {
    std::vector<float> first, first_logits;
    for (const NamedDesign& d : every_design()) {
      CAPTURE(n);
      CAPTURE(d.name);
      std::vector<float> logits, nchw_logits;
      const Trained cl = train(true, true, n, d.options, &logits);
      CHECK(cl.channels_last == first_devices(n));
      CHECK(cl.nchw.empty());
      const Trained nchw = train(true, false, n, d.options, &nchw_logits);
      CHECK(max_diff(cl.state, nchw.state) < kTolerance);
      CHECK(max_diff(logits, nchw_logits) < kTolerance);
      if (n == 1) {
        CHECK(cl.state == single.state);
        CHECK(logits == single_logits);
      }
      if (first.empty()) {
        first = cl.state;
        first_logits = logits;
      } else {
        CHECK(cl.state == first);  // parameters and running statistics
        CHECK(logits == first_logits);
      }
    }
  }
}
