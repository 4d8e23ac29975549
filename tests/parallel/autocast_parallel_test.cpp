// tests/parallel/autocast_parallel_test.cpp — the caller's autocast reaches every worker
// (Note [Autocast op policy] in dp/tensor/autocast.h), in every design: an inner
// activation computed on device 1 (a worker thread, never the caller's) is bfloat16
// under the caller's scope and float32 outside it; parameters and their gradients stay
// float32; the designs agree bit for bit, and with one device to bfloat16 rounding.
#include <doctest/doctest.h>

#include <array>
#include <mutex>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

constexpr int kDevices = 3;

/// 6-16-3 with ReLU; records, per device, the dtype of its hidden activation and
/// whether autocast was on where the forward ran.
struct Probed : dp::nn::Module {
  explicit Probed(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(16, 3, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor h = fc1->forward(x);
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto d = static_cast<std::size_t>(h.device().index);
      if (d < seen.size()) seen[d] = {true, h.dtype(), dp::amp::is_autocast_enabled()};
    }
    return fc2->forward(h.relu());
  }
  struct Seen {
    bool ran = false;
    dp::Dtype dtype = dp::Dtype::Float32;
    bool autocast = false;
  };
  std::mutex mu;
  std::array<Seen, kDevices> seen{};
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
};

/// Two SGD steps under autocast to `cast`; the parameters after them.
std::vector<float> train(Probed& net, dp::DataParallel* model, bool module_path, dp::Dtype cast) {
  dp::optim::SGD opt(model ? model->parameters() : net.parameters(), {.lr = 0.1});
  for (int s = 0; s < 2; ++s) {
    const Batch b = make_batch(10 + s, 40 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    dp::Tensor loss;
    {
      dp::amp::autocast guard(cast);
      if (!model) {
        loss = loss_fn(net.forward(b.x), b.y);
      } else if (module_path) {
        loss = loss_fn((*model)(b.x), b.y);
      } else {
        loss = model->forward_backward(b.x, b.y, loss_fn);
      }
    }
    CHECK(loss.dtype() == dp::Dtype::Float32);
    if (!model || module_path) loss.backward();
    for (const auto& [name, p] : net.named_parameters()) {
      CAPTURE(name);
      CHECK(p.dtype() == dp::Dtype::Float32);
      if (p.grad().defined()) CHECK(p.grad().dtype() == dp::Dtype::Float32);
    }
    opt.step();
  }
  return flat(net.state_dict());
}

}  // namespace

TEST_CASE("every worker of every design on 1-3 devices computes under the caller's autocast, bfloat16 and float16") {
  for (const dp::Dtype cast : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    CAPTURE(std::string(dp::dtype_name(cast)));
    Probed single_net(5);
    const std::vector<float> single = train(single_net, nullptr, false, cast);
    CHECK(single_net.seen[0].dtype == cast);
    CHECK(max_diff(single, flat(Probed(5).state_dict())) > 1e-3);  // the steps moved the parameters
    for (int devices = 1; devices <= kDevices; ++devices) {
      for (bool module_path : {false, true}) {
        std::vector<float> dp_params;
        for (const NamedDesign& d : every_design()) {
          CAPTURE(d.name);
          CAPTURE(devices);
          CAPTURE(module_path);
          auto net = std::make_shared<Probed>(5);
          dp::DataParallel model(net, cpus(devices), d.options);
          const std::vector<float> params = train(*net, &model, module_path, cast);
          for (int r = 0; r < devices; ++r) {  // device 0 too: its worker is not the caller
            CAPTURE(r);
            const Probed::Seen& seen = net->seen[static_cast<std::size_t>(r)];
            REQUIRE(seen.ran);
            CHECK(seen.dtype == cast);
            CHECK(seen.autocast);
          }
          // Outside a scope the same workers compute in float32.
          {
            std::lock_guard<std::mutex> lock(net->mu);
            net->seen = {};
          }
          (void)model(make_batch(9, 3).x);
          const Probed::Seen& last = net->seen[static_cast<std::size_t>(devices - 1)];
          CHECK(last.dtype == dp::Dtype::Float32);
          CHECK_FALSE(last.autocast);
          // The designs agree bit for bit; one device agrees to bfloat16 rounding (the
          // shards' gradients are rounded to the 16-bit dtype before they are summed).
          if (dp_params.empty()) {
            dp_params = params;
          } else {
            CHECK(max_diff(params, dp_params) == 0.0);
          }
          CHECK(max_diff(params, single) < 2e-2);
        }
      }
    }
  }
}
