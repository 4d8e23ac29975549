// samples/gpt/gpt.h — a GPT-2-shaped language model from dp's layers, nanoGPT's names.
//
//   transformer.wte   Embedding(vocab, C)        tokens          (tied to lm_head.weight)
//   transformer.wpe   Embedding(block_size, C)   positions
//   transformer.drop  Dropout
//   transformer.h.i   TransformerBlock(C, heads) × n_layer  (pre-norm: ln_1, attn, ln_2, mlp)
//   transformer.ln_f  LayerNorm(C)
//   lm_head           Linear(C, vocab, no bias)  logits
//
// The names are nanoGPT's GPT, parameter for parameter, so a state dict moves between
// the two. Initialisation is nanoGPT's: every matrix normal(0, 0.02), the residual
// projections (attn.c_proj, mlp.c_proj) normal(0, 0.02 / sqrt(2 · n_layer)), biases
// zero, LayerNorms one and zero.
//
//   samples::GPT gpt(samples::GPTConfig::named("tiny", vocab), gen);
//   dp::Tensor logits = gpt.forward(ids);                          // (B, T) int64 -> (B, T, vocab)
//   dp::DataParallel model(gpt_ptr, devices, {.mode = dp::Mode::Sharded, .shard_stage = 3,
//                                             .shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>});
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dp/dp.h"

namespace samples {

/// The shape of a GPT (nanoGPT's GPTConfig).
struct GPTConfig {
  std::int64_t block_size = 128;  ///< the longest context
  std::int64_t vocab_size = 0;    ///< set from the tokenizer
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  double dropout = 0.0;
  bool bias = true;  ///< biases in the Linears and LayerNorms (GPT-2's)
  bool tie = true;   ///< lm_head.weight is transformer.wte.weight (GPT-2's)

  /// "tiny" (4 layers, 4 heads, 128 wide, context 128: trains on two CPU cores in
  /// minutes) or "gpt2-124m" (GPT-2 small: 12 layers, 12 heads, 768 wide, context 1024;
  /// for speed runs). Throws dp::Error naming the configurations there are.
  static GPTConfig named(const std::string& name, std::int64_t vocab_size) {
    GPTConfig c;
    c.vocab_size = vocab_size;
    if (name == "gpt2-124m") {
      c.block_size = 1024;
      c.n_layer = c.n_head = 12;
      c.n_embd = 768;
    } else {
      DP_CHECK(name == "tiny", "gpt: expected --config tiny or gpt2-124m, got '", name, "'");
    }
    return c;
  }

  /// Throws dp::Error naming the first setting that cannot make a GPT.
  void check() const {
    DP_CHECK(vocab_size >= 1, "gpt: expected a vocabulary of at least 1 token, got ", vocab_size);
    DP_CHECK(block_size >= 1 && n_layer >= 1 && n_head >= 1 && n_embd >= 1,
             "gpt: expected a context, layers, heads and width >= 1, got block_size ", block_size, ", n_layer ",
             n_layer, ", n_head ", n_head, ", n_embd ", n_embd);
    DP_CHECK(n_embd % n_head == 0, "gpt: expected a width divisible by the heads, got n_embd ", n_embd,
             " and n_head ", n_head);
    DP_CHECK(dropout >= 0.0 && dropout < 1.0, "gpt: expected dropout in [0, 1), got ", dropout);
  }
};

/// nanoGPT's `transformer` ModuleDict: the embeddings, the blocks and the last norm.
struct GPTTrunk : dp::nn::Module {
  GPTTrunk(const GPTConfig& c, dp::Generator& gen) {
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(c.vocab_size, c.n_embd, &gen));
    wpe = register_module("wpe", std::make_shared<dp::nn::Embedding>(c.block_size, c.n_embd, &gen));
    drop = register_module("drop", std::make_shared<dp::nn::Dropout>(c.dropout));
    h = register_module("h", std::make_shared<dp::nn::Sequential>());
    const auto block = dp::nn::TransformerBlockOptions(c.n_embd, c.n_head).dropout(c.dropout).bias(c.bias);
    for (std::int64_t i = 0; i < c.n_layer; ++i) h->push_back(std::make_shared<dp::nn::TransformerBlock>(block, &gen));
    ln_f = register_module("ln_f", std::make_shared<dp::nn::LayerNorm>(
                                       dp::nn::LayerNormOptions({c.n_embd}).bias(c.bias)));
  }
  std::shared_ptr<dp::nn::Embedding> wte, wpe;
  std::shared_ptr<dp::nn::Dropout> drop;
  std::shared_ptr<dp::nn::Sequential> h;
  std::shared_ptr<dp::nn::LayerNorm> ln_f;
};

/// The GPT of the file comment.
class GPT : public dp::nn::Module {
 public:
  GPT(const GPTConfig& config, dp::Generator& gen) : config_(config) {
    config_.check();
    transformer = register_module("transformer", std::make_shared<GPTTrunk>(config_, gen));
    lm_head = register_module("lm_head", std::make_shared<dp::nn::Linear>(config_.n_embd, config_.vocab_size,
                                                                          false, &gen));
    if (config_.tie) share_parameter("lm_head.weight", parameter("transformer.wte.weight"));
    init_weights(gen);
  }

  /// ids (B, T) int64, T <= block_size -> logits (B, T, vocab).
  dp::Tensor forward(const dp::Tensor& ids) override {
    DP_CHECK(ids.dim() == 2 && ids.dtype() == dp::Dtype::Int64, "GPT: expected (batch, time) int64 token ids, got ",
             dp::shape_str(ids.shape()), " ", dp::dtype_name(ids.dtype()));
    const std::int64_t T = ids.size(1);
    DP_CHECK(T >= 1 && T <= config_.block_size, "GPT: expected a context of 1 to ", config_.block_size,
             " tokens (the model's block_size), got ", T);
    const dp::Tensor pos = dp::arange(T, dp::TensorOptions{dp::Dtype::Int64, ids.device()});
    dp::Tensor x = dp::add(transformer->wte->forward(ids), transformer->wpe->forward(pos));
    x = transformer->ln_f->forward(transformer->h->forward(transformer->drop->forward(x)));
    return lm_head->forward(x);
  }

  const GPTConfig& config() const { return config_; }

  /// Parameters without the position embedding (nanoGPT's get_num_params: the token
  /// embedding counts, as the tied head).
  std::int64_t non_embedding_parameters() { return num_parameters() - config_.block_size * config_.n_embd; }

  /// Training FLOPs per token at context T: 6 per parameter (forward 2, backward 4)
  /// plus attention's 12 · n_layer · T · n_embd (PaLM's appendix B, nanoGPT's
  /// estimate_mfu).
  double flops_per_token(std::int64_t T) {
    return 6.0 * static_cast<double>(non_embedding_parameters()) +
           12.0 * static_cast<double>(config_.n_layer * T * config_.n_embd);
  }

  /// Appends `n` tokens to `prompt` (1-d ids), each drawn from the softmax of the last
  /// logits / temperature over the top_k most likely (0: all), the context cropped to
  /// block_size. Runs on the module's device in eval mode.
  std::vector<std::int64_t> generate(std::vector<std::int64_t> prompt, std::int64_t n, double temperature,
                                     std::int64_t top_k, std::uint64_t seed) {
    DP_CHECK(!prompt.empty(), "GPT::generate: expected a prompt of at least one token, got none");
    DP_CHECK(temperature > 0.0, "GPT::generate: expected a temperature > 0, got ", temperature);
    dp::NoGradGuard no_grad;
    const bool was_training = is_training();
    eval();
    std::mt19937_64 rng(seed);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t T = std::min<std::int64_t>(static_cast<std::int64_t>(prompt.size()), config_.block_size);
      std::vector<std::int64_t> ctx(prompt.end() - T, prompt.end());
      const dp::Tensor ids = dp::from_vector(ctx, {1, T}).to(device());
      const dp::Tensor last = forward(ids).narrow(1, T - 1, 1).reshape({config_.vocab_size});
      prompt.push_back(sample(last.to(dp::Dtype::Float32).to_vector(), temperature, top_k, rng));
    }
    train(was_training);
    return prompt;
  }

  std::shared_ptr<GPTTrunk> transformer;
  std::shared_ptr<dp::nn::Linear> lm_head;

 private:
  // nanoGPT's _init_weights and its scaled residual projections.
  void init_weights(dp::Generator& gen) {
    dp::NoGradGuard no_grad;
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
    for (auto& [name, p] : named_parameters()) {
      const bool residual = name.ends_with("c_proj.weight");
      if (p.dim() >= 2) {
        dp::nn::init::normal_(p, 0.0, residual ? residual_std : 0.02, gen);
      } else if (name.ends_with(".bias")) {
        dp::nn::init::zeros_(p);
      }
    }
  }

  static std::int64_t sample(std::vector<float> logits, double temperature, std::int64_t top_k,
                             std::mt19937_64& rng) {
    std::vector<float> sorted = logits;
    float cut = -INFINITY;
    if (top_k > 0 && top_k < static_cast<std::int64_t>(logits.size())) {
      std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<float>());
      cut = sorted[static_cast<std::size_t>(top_k - 1)];
    }
    const float top = *std::max_element(logits.begin(), logits.end());
    std::vector<double> weights(logits.size());
    for (std::size_t i = 0; i < logits.size(); ++i)
      weights[i] = logits[i] < cut ? 0.0 : std::exp((logits[i] - top) / temperature);
    std::discrete_distribution<std::int64_t> pick(weights.begin(), weights.end());
    return pick(rng);
  }

  GPTConfig config_;
};

}  // namespace samples
