// tests/cuda/cuda_transformer_test.cpp — the transformer path end to end on CUDA devices.
//
// tests/parallel and tests/nn check the GPT's layers, weight tying, parameter groups,
// mixed precision and gradients on the wire in 16 bits on CPU virtual devices, where
// every design is bitwise alike. This binary runs the same small GPT on every visible
// GPU (up to 8; DP_CUDA_DEVICES_PER_GPU=4 gives one GPU four dp devices) and compares
// it with the CPU runtime on as many virtual devices: the transformer ops' CUDA kernels
// (embedding and its scatter-add, layer norm, GELU, softmax, attention's batched
// matmuls), a tied parameter reduced and stepped once, parameter groups, bfloat16
// autocast on every worker with cuBLAS's bf16 GEMMs, and bf16 gradients through NCCL
// (or the copy communicator). Without a CUDA device the binary exits 77 (SKIP).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../parallel/mlp_fixture.h"  // TiedGPT, token batches, max_diff
#include "dp/dp.h"

namespace {

using dp::Tensor;

using dp_test::cpu_devices;
using dp_test::cuda_devices;

std::vector<float> flat_params(dp::nn::Module& net) {
  std::vector<float> out;
  for (auto& [name, t] : net.state_dict()) {
    const auto v = t.to(dp::Dtype::Float32).to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

struct Design {
  std::string name;
  dp::DataParallelOptions options;
};

/// Every design, with small buckets (several collectives per backward), and stage 3
/// both with a gather unit per top-level child and with one per block (shard_unit).
std::vector<Design> designs(std::optional<dp::Dtype> reduce_dtype) {
  dp::DataParallelOptions base{.bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
  base.mixed_precision.reduce_dtype = reduce_dtype;
  std::vector<Design> out;
  for (const auto& [name, mode, stage] : {std::tuple{"DP", dp::Mode::DP, 0}, std::tuple{"DDP", dp::Mode::DDP, 0},
                                          std::tuple{"Sharded 1", dp::Mode::Sharded, 1},
                                          std::tuple{"Sharded 2", dp::Mode::Sharded, 2},
                                          std::tuple{"Sharded 3", dp::Mode::Sharded, 3}}) {
    dp::DataParallelOptions o = base;
    o.mode = mode;
    if (stage > 0) o.shard_stage = stage;
    out.push_back({name, o});
  }
  Design per_block = out.back();
  per_block.name = "Sharded 3, a unit per block";
  per_block.options.shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>;
  out.push_back(per_block);
  return out;
}

struct Run {
  std::vector<float> params;
  std::vector<double> losses;
  int wrong_dtype = 0;               // workers whose logits came in another dtype
  std::int64_t grad_bytes = 0;       // device 0's gradient bytes on the wire
};

/// Four SGD steps of the tied GPT on `devs` in `options`' design: two parameter groups
/// (matrices at lr 0.1 with momentum, the rest at lr 0.05 without; SGD's update is
/// continuous in the gradient, so CPU and CUDA runs, whose sums differ in order, stay
/// close), under bfloat16 autocast when `bf16`.
Run train(const std::vector<dp::Device>& devs, const dp::DataParallelOptions& options, bool bf16) {
  auto net = std::make_shared<TiedGPT>(17);
  dp::DataParallel model(net, devs, options);
  const dp::nn::ParameterList params = model.parameters();
  const auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
  const auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
  dp::optim::SGD opt({{matrices, {.momentum = 0.9}}, {others, {.lr = 0.05}}}, {.lr = 0.1});
  Run run;
  std::atomic<int> wrong{0};
  auto loss = [&](const Tensor& logits, const Tensor& y) {
    if (logits.dtype() != (bf16 ? dp::Dtype::BFloat16 : dp::Dtype::Float32)) ++wrong;
    return token_loss(logits, y);
  };
  const std::int64_t rows = 3 * static_cast<std::int64_t>(devs.size()) + 1;  // uneven shards
  for (int s = 0; s < 4; ++s) {
    Batch b = make_token_batch(rows, 700 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    dp::amp::autocast guard(dp::Dtype::BFloat16, bf16);
    run.losses.push_back(model.forward_backward(b.x, b.y, loss).item());
    opt.step();
  }
  run.wrong_dtype = wrong.load();
  run.grad_bytes = model.stats().devices[0].grad_bytes;
  run.params = flat_params(*net);
  return run;
}

}  // namespace

TEST_CASE("a tied GPT with parameter groups trains on every GPU as on CPU virtual devices, in every design") {
  // FP32 throughout (no TF32): the CUDA and CPU runs differ only in summation order.
  const auto gpus = cuda_devices();
  const auto cpus = cpu_devices(gpus.size());
  const bool matmul = dp::allow_tf32_matmul();
  dp::set_allow_tf32_matmul(false);
  std::vector<float> first;
  for (const Design& d : designs(std::nullopt)) {
    CAPTURE(d.name);
    const Run ref = train(cpus, d.options, false);
    const Run got = train(gpus, d.options, false);
    CHECK(got.wrong_dtype == 0);
    CHECK(max_diff(got.params, ref.params) < 1e-4);
    for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(std::fabs(got.losses[s] - ref.losses[s]) < 1e-4);
    // The designs on the GPUs agree with one another to float rounding.
    if (first.empty()) first = got.params;
    else CHECK(max_diff(got.params, first) < 1e-5);
  }
  dp::set_allow_tf32_matmul(matmul);
}

TEST_CASE("a tied GPT trained twice on the GPUs gives the same bits: no order left to timing") {
  // The embedding's gradient adds repeated tokens' rows in position order (Note [Row
  // scatter-add in position order]), the attention and LayerNorm backward sum in fixed
  // orders, the loss counts on the device: a run repeats bit for bit, in DP and DDP.
  const auto gpus = cuda_devices();
  const bool matmul = dp::allow_tf32_matmul();
  dp::set_allow_tf32_matmul(false);
  for (const Design& d : designs(std::nullopt)) {
    if (d.name != "DP" && d.name != "DDP") continue;
    CAPTURE(d.name);
    const Run a = train(gpus, d.options, false), b = train(gpus, d.options, false);
    CHECK(a.params == b.params);
    CHECK(a.losses == b.losses);
  }
  dp::set_allow_tf32_matmul(matmul);
}

TEST_CASE("bfloat16 autocast and bfloat16 gradients on the wire: every GPU's worker in bf16, near the CPU run") {
  // cuBLAS's and oneDNN's bf16 GEMMs both accumulate in float32 but round their
  // operands and outputs at different points: the runs agree to bf16's resolution
  // (2^-8 relative) over four small steps, not bitwise. 2e-2 on parameters of size ~1
  // is ~5 units of bf16's last place; an op left in float32 or a lost step is far
  // outside it.
  const auto gpus = cuda_devices();
  const auto cpus = cpu_devices(gpus.size());
  for (const Design& d : designs(dp::Dtype::BFloat16)) {
    CAPTURE(d.name);
    const Run ref = train(cpus, d.options, true);
    const Run got = train(gpus, d.options, true);
    CHECK(got.wrong_dtype == 0);
    CHECK(max_diff(got.params, ref.params) < 2e-2);
    for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(std::fabs(got.losses[s] - ref.losses[s]) < 5e-2);
    // The same elements go on the wire as on the CPU devices, two bytes each.
    CHECK(got.grad_bytes == ref.grad_bytes);
    if (gpus.size() > 1) {
      dp::DataParallelOptions fp32 = d.options;
      fp32.mixed_precision.reduce_dtype = std::nullopt;
      CHECK(2 * got.grad_bytes == train(gpus, fp32, true).grad_bytes);
    }
  }
}

TEST_CASE("log_softmax and softmax on the GPU: rows with infinities and NaN give the CPU's values") {
  // A +inf maximum shifts by itself on both backends (inf - inf = NaN: the whole row is
  // NaN, as PyTorch's); an all -inf row is NaN; a NaN anywhere makes its row NaN. The GPU
  // kernel once shifted a +inf row by 0, giving -inf for its finite entries.
  const float inf = INFINITY, nan = NAN;
  const std::vector<float> x = {inf, 1.0f, 2.0f, -1.0f,  -inf, -inf, -inf, -inf,  nan, 0.0f, 1.0f, 2.0f,
                                -inf, 3.0f, 1.0f, 2.0f,  0.5f, -0.5f, 4.0f, 1.0f};
  const Tensor on_cpu = dp::from_vector(x, {5, 4}, dp::cpu(0));
  const Tensor on_gpu = on_cpu.to(dp::cuda(0));
  auto same = [](const std::vector<float>& want, const std::vector<float>& got) {
    REQUIRE(want.size() == got.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      CAPTURE(i);
      if (std::isnan(want[i])) {
        CHECK(std::isnan(got[i]));
      } else if (std::isinf(want[i])) {
        CHECK(got[i] == want[i]);
      } else {
        CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-6));
      }
    }
  };
  const std::vector<float> want = dp::nn::log_softmax(on_cpu, 1).to_vector();
  for (std::size_t i = 0; i < 12; ++i) CHECK(std::isnan(want[i]));  // rows 0-2: the oracle's premise
  same(want, dp::nn::log_softmax(on_gpu, 1).to(dp::cpu(0)).to_vector());
  same(dp::nn::softmax(on_cpu, 1).to_vector(), dp::nn::softmax(on_gpu, 1).to(dp::cpu(0)).to_vector());
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_transformer_test", argc, argv); }
