// tests/parallel/attention_dropout_designs_test.cpp — a GPT whose attention drops weights
// (TransformerBlock dropout > 0, through the fused kernel: Note [Fused attention]) trains
// bit for bit alike in DP, DDP and Sharded stages 1-3 on 2 CPU devices, float32 and
// under bfloat16 autocast: the kernel's keep bits depend only on each device's generator
// state and the weight's index, never on the design or the schedule.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

std::vector<float> train(const dp::DataParallelOptions& options, bool bf16) {
  auto net = std::make_shared<DropoutGPT>(5);
  dp::DataParallel model(net, cpus(2), options);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  for (int s = 0; s < 3; ++s) {
    Batch b = make_token_batch(7 + s, 500 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    dp::amp::autocast cast(dp::Dtype::BFloat16, bf16);
    model.forward_backward(b.x, b.y, token_loss);
    opt.step();
  }
  return flat(net->state_dict());
}

}  // namespace

TEST_CASE("a GPT with attention dropout trains bitwise alike in every design on 2 devices (fused kernel)") {
  dp::nn::set_attention_path(dp::nn::AttentionPath::Fused);  // a call it does not fit throws
  for (bool bf16 : {false, true}) {
    std::vector<float> dp_params;
    for (const NamedDesign& d : every_design()) {
      CAPTURE(d.name);
      CAPTURE(bf16);
      const std::vector<float> got = train(d.options, bf16);
      CHECK(max_diff(got, flat(DropoutGPT(5).state_dict())) > 1e-3);  // the steps moved the parameters
      if (dp_params.empty()) dp_params = got;
      else CHECK(max_diff(got, dp_params) == 0);
    }
  }
  // The math path draws the same keep bits (Note [Fused attention paths]): the same
  // training to float rounding.
  const std::vector<float> fused = train(every_design()[1].options, false);
  dp::nn::set_attention_path(dp::nn::AttentionPath::Math);
  const std::vector<float> math = train(every_design()[1].options, false);
  dp::nn::set_attention_path(dp::nn::AttentionPath::Auto);
  CHECK(max_diff(fused, math) < 2e-5);
}
