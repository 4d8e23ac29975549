// tests/parallel/mlp_fixture.h — the small MLP, batches and helpers the DataParallel suites share.
//
// 6-16-8-3: 275 parameters in three Linear layers. With tiny bucket caps they span
// several DDP buckets; on 4 devices the Sharded ranges (80 elements, a multiple of
// 16) cut through weights and gather units. Labels are deterministic in (row, seed).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dp/dp.h"

namespace {

/// Three top-level children (three gather units in stage 3), the middle one used only
/// while `use_mid`; `after_forward` (if set) runs on the worker at the end of forward.
struct ThreeLinear : dp::nn::Module {
  explicit ThreeLinear(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 8, true, &gen));
    mid = register_module("mid", std::make_shared<dp::nn::Linear>(8, 8, true, &gen));
    fc3 = register_module("fc3", std::make_shared<dp::nn::Linear>(8, 3, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor h = fc1->forward(x).relu();
    if (use_mid) h = mid->forward(h).relu();
    dp::Tensor y = fc3->forward(h);
    if (after_forward) after_forward();
    return y;
  }
  bool use_mid = true;  // set between steps
  std::function<void()> after_forward;
  std::shared_ptr<dp::nn::Linear> fc1, mid, fc3;
};

inline std::shared_ptr<dp::nn::Sequential> make_mlp(std::uint64_t seed) {
  dp::Generator gen(seed);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(16, 8, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Linear>(8, 3, true, &gen));
  return net;
}

struct Batch {
  dp::Tensor x, y;
};

inline Batch make_batch(std::int64_t rows, std::uint64_t seed, std::int64_t features = 6, std::int64_t classes = 3) {
  dp::Generator gen(seed);
  dp::Tensor x = dp::randn({rows, features}, gen, dp::cpu(0));
  std::vector<std::int64_t> labels(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i)
    labels[static_cast<std::size_t>(i)] = (i * 7 + static_cast<std::int64_t>(seed)) % classes;
  return {x, dp::from_vector(labels, {rows}, dp::cpu(0))};
}

inline dp::Tensor loss_fn(const dp::Tensor& out, const dp::Tensor& y) { return dp::nn::cross_entropy(out, y); }

/// Every float tensor of `sd`, concatenated in the state dict's order.
inline std::vector<float> flat(const dp::nn::StateDict& sd) {
  std::vector<float> out;
  for (auto& [name, t] : sd) {
    if (t.dtype() != dp::Dtype::Float32) continue;
    auto v = t.to_vector();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

/// The largest |a[i] - b[i]| — infinity when a NaN appears on either side (std::max
/// would skip it, and a comparison with a tolerance would pass) or the sizes differ.
inline double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= m)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}

/// cpu(0..n-1).
/// One training step of `model` and of its reference `ref` on the same batch:
/// zero_grad, forward_backward, step — the lockstep comparisons of the suites.
inline void step_both(dp::DataParallel& model, dp::optim::Optimizer& opt, dp::DataParallel& ref,
                      dp::optim::Optimizer& ref_opt, const Batch& b) {
  for (auto [m, o] : {std::pair{&model, &opt}, std::pair{&ref, &ref_opt}}) {
    o->zero_grad();
    m->forward_backward(b.x, b.y, loss_fn);
    o->step();
  }
}

inline std::vector<dp::Device> cpus(int n) {
  std::vector<dp::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(dp::cpu(i));
  return d;
}

/// A design by name, with tiny buckets (several per backward).
struct NamedDesign {
  std::string name;
  dp::DataParallelOptions options;
};

/// DP, DDP and Sharded stages 1-3, each with buckets of a few dozen floats.
inline std::vector<NamedDesign> every_design() {
  std::vector<NamedDesign> out;
  dp::DataParallelOptions o{.bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
  o.mode = dp::Mode::DP;
  out.push_back({"DP", o});
  o.mode = dp::Mode::DDP;
  out.push_back({"DDP", o});
  o.mode = dp::Mode::Sharded;
  for (int stage = 1; stage <= 3; ++stage) {
    o.shard_stage = stage;
    out.push_back({"Sharded stage " + std::to_string(stage), o});
  }
  return out;
}

/// DP, DDP and Sharded stages 1-3 with the default buckets, then DDP and stage 3 with a
/// bucket per parameter, so that backward's collectives interleave with it.
inline std::vector<NamedDesign> designs_and_tiny_buckets() {
  std::vector<NamedDesign> out{{"DP", {.mode = dp::Mode::DP}}, {"DDP", {.mode = dp::Mode::DDP}}};
  for (int stage : {1, 2, 3})
    out.push_back({"Sharded " + std::to_string(stage), {.mode = dp::Mode::Sharded, .shard_stage = stage}});
  out.push_back({"DDP, tiny buckets", {.mode = dp::Mode::DDP, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6}});
  out.push_back({"Sharded 3, tiny buckets",
                 {.mode = dp::Mode::Sharded, .shard_stage = 3, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6}});
  return out;
}

/// SGD whose update throws once on cpu:1, when armed, after updating half its range:
/// a worker failing mid-step.
class FaultySgd final : public dp::optim::Optimizer {
 public:
  explicit FaultySgd(dp::nn::ParameterList params) : Optimizer(std::move(params), "FaultySgd") {}
  double lr() const override { return 0.1; }
  void set_lr(double) override {}
  std::atomic<bool> armed{false};

 protected:
  std::vector<std::string> state_names() const override { return {}; }
  void update(dp::Device dev, float* p, const float* g, float* const*, std::int64_t n, bool, std::int64_t) override {
    for (std::int64_t i = 0; i < n / 2; ++i) p[i] -= 0.1f * g[i];
    if (dev.index == 1 && armed.exchange(false)) throw dp::Error("injected optimizer failure");
    for (std::int64_t i = n / 2; i < n; ++i) p[i] -= 0.1f * g[i];
  }
};

/// A tiny causal language model over every sequence layer: token embedding, pre-norm
/// causal self-attention (2 heads, scaled_dot_product_attention) with a residual, a
/// GELU MLP, and a head over the vocabulary. ids (B, T) int64 -> logits (B, T, V).
/// Five top-level children: five gather units in stage 3.
struct TinyLM : dp::nn::Module {
  static constexpr std::int64_t V = 11, C = 8, H = 2;
  explicit TinyLM(std::uint64_t seed) {
    dp::Generator gen(seed);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    ln = register_module("ln", std::make_shared<dp::nn::LayerNorm>(dp::Shape{C}));
    qkv = register_module("qkv", std::make_shared<dp::nn::Linear>(C, 3 * C, true, &gen));
    fc = register_module("fc", std::make_shared<dp::nn::Linear>(C, 2 * C, true, &gen));
    head = register_module("head", std::make_shared<dp::nn::Linear>(2 * C, V, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    const std::int64_t B = ids.size(0), T = ids.size(1);
    dp::Tensor h = wte->forward(ids);
    std::vector<dp::Tensor> parts = dp::split(qkv->forward(ln->forward(h)), C, 2);
    auto heads = [&](const dp::Tensor& t) { return t.reshape({B, T, H, C / H}).transpose(1, 2); };
    dp::Tensor att = dp::nn::scaled_dot_product_attention(heads(parts[0]), heads(parts[1]), heads(parts[2]),
                                                          dp::Tensor(), 0.0, /*is_causal=*/true);
    h = dp::add(h, att.transpose(1, 2).reshape({B, T, C}));
    return head->forward(dp::nn::gelu(fc->forward(h)));
  }
  std::shared_ptr<dp::nn::Embedding> wte;
  std::shared_ptr<dp::nn::LayerNorm> ln;
  std::shared_ptr<dp::nn::Linear> qkv, fc, head;
};

/// `rows` windows of 5 tokens and their next tokens, deterministic in (rows, seed).
/// A tiny GPT: token and position embeddings, two pre-norm blocks (TransformerBlock:
/// LayerNorm, causal self-attention, LayerNorm, GELU MLP, residuals), a final LayerNorm
/// and a head over TinyLM's vocabulary. Six top-level children: six gather units in
/// stage 3. ids (B, T <= 5) int64 -> logits (B, T, V).
struct TinyGPT : dp::nn::Module {
  static constexpr std::int64_t V = TinyLM::V, C = 8, H = 2, kMaxT = 5;
  explicit TinyGPT(std::uint64_t seed) {
    dp::Generator gen(seed);
    const auto block = dp::nn::TransformerBlockOptions(C, H);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    wpe = register_module("wpe", std::make_shared<dp::nn::Embedding>(kMaxT, C, &gen));
    h0 = register_module("h0", std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    h1 = register_module("h1", std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    ln_f = register_module("ln_f", std::make_shared<dp::nn::LayerNorm>(dp::Shape{C}));
    lm_head = register_module("lm_head", std::make_shared<dp::nn::Linear>(C, V, false, &gen));
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    dp::Tensor pos = dp::arange(ids.size(1), dp::TensorOptions{dp::Dtype::Int64, ids.device()});
    // In registration order (wte, then wpe) unless `positions_first`: the test below
    // runs them the other way round, which stage 3 must survive (Reducer::wait_combined).
    dp::Tensor h;
    if (positions_first) {
      dp::Tensor p = wpe->forward(pos);
      h = dp::add(wte->forward(ids), p);
    } else {
      dp::Tensor tok = wte->forward(ids);
      h = dp::add(tok, wpe->forward(pos));
    }
    return lm_head->forward(ln_f->forward(h1->forward(h0->forward(h))));
  }
  bool positions_first = false;
  std::shared_ptr<dp::nn::Embedding> wte, wpe;
  std::shared_ptr<dp::nn::TransformerBlock> h0, h1;
  std::shared_ptr<dp::nn::LayerNorm> ln_f;
  std::shared_ptr<dp::nn::Linear> lm_head;
};

/// TinyGPT's layout with dropout 0.2 in both blocks (attention weights and residuals).
struct DropoutGPT : dp::nn::Module {
  static constexpr std::int64_t V = TinyLM::V, C = 8, H = 2, kMaxT = 5;
  explicit DropoutGPT(std::uint64_t seed) {
    dp::Generator gen(seed);
    const auto block = dp::nn::TransformerBlockOptions(C, H).dropout(0.2);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    wpe = register_module("wpe", std::make_shared<dp::nn::Embedding>(kMaxT, C, &gen));
    h0 = register_module("h0", std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    h1 = register_module("h1", std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    lm_head = register_module("lm_head", std::make_shared<dp::nn::Linear>(C, V, false, &gen));
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    dp::Tensor pos = dp::arange(ids.size(1), dp::TensorOptions{dp::Dtype::Int64, ids.device()});
    dp::Tensor h = dp::add(wte->forward(ids), wpe->forward(pos));
    return lm_head->forward(h1->forward(h0->forward(h)));
  }
  std::shared_ptr<dp::nn::Embedding> wte, wpe;
  std::shared_ptr<dp::nn::TransformerBlock> h0, h1;
  std::shared_ptr<dp::nn::Linear> lm_head;
};

/// TinyGPT with GPT-2's weight tying: lm_head.weight is wte.weight, one parameter that
/// two modules use (Module::share_parameter).
struct TiedGPT : TinyGPT {
  explicit TiedGPT(std::uint64_t seed) : TinyGPT(seed) { share_parameter("lm_head.weight", parameter("wte.weight")); }
};

/// Token embedding, MultiheadAttention (batch_first) under a key padding mask made from
/// the ids, a residual and a head. A sequence whose first id is below kDeadBelow is all
/// padding, so each of its queries has no key (Note [Rows with every key masked]: the
/// attention gives zeros there and no gradient); in the others every id 0 is padding.
/// The mask is a function of each row alone, so every shard makes its rows' part of it.
struct PaddedMHA : dp::nn::Module {
  static constexpr std::int64_t V = TinyLM::V, C = 8, H = 2, kDeadBelow = 4;
  explicit PaddedMHA(std::uint64_t seed) {
    dp::Generator gen(seed);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(V, C, &gen));
    attn = register_module("attn", std::make_shared<dp::nn::MultiheadAttention>(
                                       dp::nn::MultiheadAttentionOptions(C, H).batch_first(true), &gen));
    head = register_module("head", std::make_shared<dp::nn::Linear>(C, V, true, &gen));
  }
  static dp::Tensor padding(const dp::Tensor& ids) {
    const dp::Tensor f = ids.to(dp::Dtype::Float32);
    const dp::Tensor dead = dp::lt(f.narrow(1, 0, 1), static_cast<double>(kDeadBelow));  // (B, 1)
    const dp::Tensor pad = dp::maximum(dp::eq(f, 0.0), dead.expand(ids.shape()).contiguous());
    return dp::zeros(ids.shape(), dp::TensorOptions{dp::Dtype::Float32, ids.device()}).masked_fill(pad, -INFINITY);
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    const dp::Tensor x = wte->forward(ids);
    return head->forward(dp::add(x, attn->forward(x, x, x, padding(ids))));
  }
  std::shared_ptr<dp::nn::Embedding> wte;
  std::shared_ptr<dp::nn::MultiheadAttention> attn;
  std::shared_ptr<dp::nn::Linear> head;
};

/// A forward that writes in place (Note [In-place writes and autograd], Note [Sources of
/// in-place writes], Note [In-place writes as out-of-place ops] in src/tensor/tensor.cpp):
/// a parameter broadcast and added into a layer's output, the output scaled, a parameter
/// copied (broadcast) into a buffer, an output added into another, then multiplied by a
/// broadcast parameter, clamped and divided in place. Under autocast the first output is bfloat16 and the
/// parameters float32: the mixed sum rounds once.
struct InplaceForward : dp::nn::Module {
  explicit InplaceForward(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc1 = register_module("fc1", std::make_shared<dp::nn::Linear>(6, 8, false, &gen));
    fc2 = register_module("fc2", std::make_shared<dp::nn::Linear>(8, 3, true, &gen));
    bias = register_parameter("bias", dp::randn({8}, gen, dp::cpu(0)));
    scale = register_parameter("scale", dp::randn({1, 8}, gen, dp::cpu(0)));
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor h = fc1->forward(x);
    h.add_(bias, 0.5f);
    h.mul_(2.0f);
    dp::Tensor g = dp::zeros(h.shape(), dp::TensorOptions{dp::Dtype::Float32, h.device()});
    g.copy_(scale);
    dp::Tensor r = dp::mul(h.relu(), g);
    r.add_(h);
    r.mul_(scale);
    r.clamp_(-4.0, 4.0);
    r.div_(1.5);
    return fc2->forward(r);
  }
  std::shared_ptr<dp::nn::Linear> fc1, fc2;
  dp::nn::Parameter bias, scale;
};

/// A small CNN for image batches in either layout: Conv2d(3, 8, 3, padding 1), a
/// BatchNorm2d when `batch_norm`, ReLU, Conv2d(8, 6, 3, stride 2, padding 1), ReLU and a
/// Linear head over the flattened 6 x 4 x 4. Input (B, 3, 8, 8). Records the layout of
/// each device's first convolution output: channels-last batches must reach every
/// worker channels-last (Note [Channels-last tensors]).
struct SmallConvNet : dp::nn::Module {
  SmallConvNet(std::uint64_t seed, bool batch_norm) {
    dp::Generator gen(seed);
    conv1 = register_module("conv1", std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(3, 8, 3).padding(1), &gen));
    if (batch_norm) bn = register_module("bn", std::make_shared<dp::nn::BatchNorm2d>(8));
    conv2 = register_module(
        "conv2", std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(8, 6, 3).stride(2).padding(1), &gen));
    fc = register_module("fc", std::make_shared<dp::nn::Linear>(6 * 4 * 4, 3, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor h = conv1->forward(x);
    {
      std::lock_guard<std::mutex> lock(mu);
      layouts.emplace_back(x.device().index, h.suggest_memory_format());
    }
    if (bn) h = bn->forward(h);
    h = conv2->forward(h.relu()).relu();
    return fc->forward(h.reshape({h.size(0), 6 * 4 * 4}));
  }
  std::mutex mu;
  std::vector<std::pair<int, dp::MemoryFormat>> layouts;  // (device index, conv1's output layout) per forward
  std::shared_ptr<dp::nn::Conv2d> conv1, conv2;
  std::shared_ptr<dp::nn::BatchNorm2d> bn;
  std::shared_ptr<dp::nn::Linear> fc;
};

/// `rows` images (3 x 8 x 8) and labels for SmallConvNet, deterministic in (rows, seed),
/// laid out channels-last when asked.
inline Batch make_image_batch(std::int64_t rows, std::uint64_t seed, bool channels_last) {
  dp::Generator gen(seed);
  dp::Tensor x = dp::randn({rows, 3, 8, 8}, gen, dp::cpu(0));
  if (channels_last) x = x.contiguous(dp::MemoryFormat::ChannelsLast);
  std::vector<std::int64_t> labels(static_cast<std::size_t>(rows));
  for (std::int64_t i = 0; i < rows; ++i)
    labels[static_cast<std::size_t>(i)] = (i * 5 + static_cast<std::int64_t>(seed)) % 3;
  return {x, dp::from_vector(labels, {rows}, dp::cpu(0))};
}

inline Batch make_token_batch(std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  dp::Tensor ids = dp::randint(0, TinyLM::V, {rows, 6}, gen, dp::cpu(0));
  return {ids.narrow(1, 0, 5).clone(), ids.narrow(1, 1, 5).clone()};
}

/// Mean cross entropy over every token of (B, T, V) logits and (B, T) targets.
inline dp::Tensor token_loss(const dp::Tensor& logits, const dp::Tensor& y) {
  return dp::nn::cross_entropy(logits.reshape({-1, TinyLM::V}), y.reshape({-1}));
}

}  // namespace
