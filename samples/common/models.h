// samples/common/models.h — the networks the samples train, defined once.
//
// Every model takes a seed: its parameters are drawn from a Generator of that seed
// in registration order, so two runs (or the same model built for single-device, DP
// and DDP) start from identical weights. Names follow PyTorch's, so state_dicts
// match torch models written the same way ("0.weight", "layer1.0.conv1.weight").
//
//   auto net = samples::make_model("cnn", /*seed=*/1);   // or fashion_cnn(1)
//   dp::DataParallel model(net, {0, 1});
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/dp.h"
#include "gpt/gpt.h"

namespace samples {

/// The Fashion-MNIST CNN (input (N, 1, 28, 28), 10 classes), a Sequential:
///   0 Conv2d(1, 32, 3, pad 1)  1 ReLU  2 MaxPool2d(2)          → (N, 32, 14, 14)
///   3 Conv2d(32, 64, 3, pad 1) 4 ReLU  5 MaxPool2d(2)          → (N, 64, 7, 7)
///   6 Flatten  7 Linear(3136, 128)  8 ReLU  9 Linear(128, 10)
inline std::shared_ptr<dp::nn::Sequential> fashion_cnn(std::uint64_t seed) {
  using namespace dp::nn;
  dp::Generator gen(seed);
  auto net = std::make_shared<Sequential>();
  net->push_back(std::make_shared<Conv2d>(1, 32, 3, 1, 1, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(2));
  net->push_back(std::make_shared<Conv2d>(32, 64, 3, 1, 1, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(2));
  net->push_back(std::make_shared<Flatten>());
  net->push_back(std::make_shared<Linear>(64 * 7 * 7, 128, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(128, 10, true, &gen));
  return net;
}

/// MLP 784-1024-1024-10 on flattened (N, 1, 28, 28) input: GEMM-bound, 1.9 M parameters
/// (7.5 MB of gradients), so communication weighs more than in the CNN.
inline std::shared_ptr<dp::nn::Sequential> mlp(std::uint64_t seed) {
  using namespace dp::nn;
  dp::Generator gen(seed);
  auto net = std::make_shared<Sequential>();
  net->push_back(std::make_shared<Flatten>());
  net->push_back(std::make_shared<Linear>(784, 1024, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(1024, 1024, true, &gen));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<Linear>(1024, 10, true, &gen));
  return net;
}

/// ResNet's BasicBlock: conv3x3-BN-ReLU-conv3x3-BN, plus the input (through a 1×1
/// conv + BN "downsample" shortcut when stride or width change), then ReLU.
class BasicBlock : public dp::nn::Module {
 public:
  BasicBlock(std::int64_t in, std::int64_t out, std::int64_t stride, dp::Generator& gen) {
    using namespace dp::nn;
    conv1_ = register_module("conv1", std::make_shared<Conv2d>(in, out, 3, stride, 1, false, &gen));
    bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(out));
    conv2_ = register_module("conv2", std::make_shared<Conv2d>(out, out, 3, 1, 1, false, &gen));
    bn2_ = register_module("bn2", std::make_shared<BatchNorm2d>(out));
    if (stride != 1 || in != out) {
      downsample_ = register_module(
          "downsample", std::make_shared<Sequential>(std::make_shared<Conv2d>(in, out, 1, stride, 0, false, &gen),
                                                     std::make_shared<BatchNorm2d>(out)));
    }
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor y = bn1_->forward(conv1_->forward(x)).relu();
    y = bn2_->forward(conv2_->forward(y));
    dp::Tensor shortcut = downsample_ ? downsample_->forward(x) : x;
    return dp::add(y, shortcut).relu();
  }
  std::string name() const override { return "BasicBlock"; }

 private:
  std::shared_ptr<dp::nn::Conv2d> conv1_, conv2_;
  std::shared_ptr<dp::nn::BatchNorm2d> bn1_, bn2_;
  std::shared_ptr<dp::nn::Sequential> downsample_;
};

/// ResNet-18, CIFAR variant (input (N, 3, 32, 32)): 3×3 stem conv 64 + BN + ReLU, no
/// max-pool, four stages of two BasicBlocks (64, 128, 256, 512 channels; stages 2-4
/// start with stride 2), global average pool, Linear(512, 10). 11.2 M parameters.
class ResNet18 : public dp::nn::Module {
 public:
  explicit ResNet18(std::uint64_t seed, std::int64_t num_classes = 10) {
    using namespace dp::nn;
    dp::Generator gen(seed);
    conv1_ = register_module("conv1", std::make_shared<Conv2d>(3, 64, 3, 1, 1, false, &gen));
    bn1_ = register_module("bn1", std::make_shared<BatchNorm2d>(64));
    std::int64_t in = 64;
    const std::int64_t widths[4] = {64, 128, 256, 512};
    for (int s = 0; s < 4; ++s) {
      auto stage = std::make_shared<Sequential>();
      stage->push_back(std::make_shared<BasicBlock>(in, widths[s], s == 0 ? 1 : 2, gen));
      stage->push_back(std::make_shared<BasicBlock>(widths[s], widths[s], 1, gen));
      layers_.push_back(register_module("layer" + std::to_string(s + 1), stage));
      in = widths[s];
    }
    pool_ = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1));
    fc_ = register_module("fc", std::make_shared<Linear>(512, num_classes, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor y = bn1_->forward(conv1_->forward(x)).relu();
    for (auto& stage : layers_) y = stage->forward(y);
    return fc_->forward(pool_->forward(y).flatten(1));
  }
  std::string name() const override { return "ResNet18"; }

 private:
  std::shared_ptr<dp::nn::Conv2d> conv1_;
  std::shared_ptr<dp::nn::BatchNorm2d> bn1_;
  std::vector<std::shared_ptr<dp::nn::Sequential>> layers_;
  std::shared_ptr<dp::nn::AdaptiveAvgPool2d> pool_;
  std::shared_ptr<dp::nn::Linear> fc_;
};

/// The two-layer ToyModel of PyTorch's DDP tutorial: net1 Linear(10, 10), ReLU,
/// net2 Linear(10, 5).
class ToyModel : public dp::nn::Module {
 public:
  explicit ToyModel(std::uint64_t seed) {
    dp::Generator gen(seed);
    net1_ = register_module("net1", std::make_shared<dp::nn::Linear>(10, 10, true, &gen));
    net2_ = register_module("net2", std::make_shared<dp::nn::Linear>(10, 5, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& x) override { return net2_->forward(net1_->forward(x).relu()); }
  std::string name() const override { return "ToyModel"; }

 private:
  std::shared_ptr<dp::nn::Linear> net1_, net2_;
};

/// The benchmarks' GPT (samples::GPT, samples/gpt/gpt.h): 6 blocks of width 256 and 8
/// heads, context 64, a 128-token vocabulary, tied embedding — 4.8 M parameters, a
/// model whose parameters and AdamW state outweigh a small batch's activations, so that
/// the designs' memory differs for real.
inline samples::GPTConfig bench_gpt_config() {
  samples::GPTConfig c;
  c.vocab_size = 128;
  c.block_size = 64;
  c.n_layer = 6;
  c.n_head = 8;
  c.n_embd = 256;
  return c;
}

/// Input shape of one example for a model name ("cnn", "mlp": (1, 28, 28);
/// "resnet18": (3, 32, 32); "gpt": (block_size) token ids).
inline dp::Shape example_shape(const std::string& model) {
  if (model == "resnet18") return {3, 32, 32};
  if (model == "gpt") return {bench_gpt_config().block_size};
  return {1, 28, 28};
}

/// Builds "cnn", "mlp", "resnet18" or "gpt". Throws std::invalid_argument otherwise.
inline std::shared_ptr<dp::nn::Module> make_model(const std::string& model, std::uint64_t seed) {
  if (model == "cnn") return fashion_cnn(seed);
  if (model == "mlp") return mlp(seed);
  if (model == "resnet18") return std::make_shared<ResNet18>(seed);
  if (model == "gpt") {
    dp::Generator gen(seed);
    return std::make_shared<GPT>(bench_gpt_config(), gen);
  }
  throw std::invalid_argument("unknown model '" + model + "' (expected cnn, mlp, resnet18 or gpt)");
}

/// `count` batches of `batch` random token windows for the GPT of bench_gpt_config():
/// data (batch, block_size) and target (batch, block_size) int64, the target being the
/// data shifted by one token.
inline std::vector<dp::data::Batch> token_batches(std::int64_t batch, int count, std::uint64_t seed) {
  const samples::GPTConfig c = bench_gpt_config();
  dp::Generator gen(seed);
  std::vector<dp::data::Batch> out;
  for (int k = 0; k < count; ++k) {
    const dp::Tensor ids = dp::randint(0, c.vocab_size, {batch, c.block_size + 1}, gen, dp::cpu(0));
    out.push_back({ids.narrow(1, 0, c.block_size).contiguous(), ids.narrow(1, 1, c.block_size).contiguous()});
  }
  return out;
}

/// The Sharded gather units a model wants (DataParallelOptions::shard_unit): one per
/// transformer block for "gpt", the top-level children otherwise.
inline std::function<bool(const dp::nn::Module&)> shard_unit(const std::string& model) {
  if (model == "gpt") return dp::nn::is_module<dp::nn::TransformerBlock>;
  return nullptr;
}

}  // namespace samples
