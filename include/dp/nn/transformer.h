// dp/nn/transformer.h — the pre-norm GPT block: nanoGPT's Block, CausalSelfAttention and MLP.
//
//   x = x + attn(ln_1(x))        attn: causal multi-head self-attention
//   x = x + mlp(ln_2(x))         mlp:  Linear(C, 4C) → GELU → Linear(4C, C)
//
// Submodules and parameters carry nanoGPT's names (ln_1, attn.c_attn, attn.c_proj, ln_2,
// mlp.c_fc, mlp.c_proj), so a block's state dict is nanoGPT's Block's, name for name and
// shape for shape. Layers start as PyTorch's defaults (a GPT's own initialisation, such as
// nanoGPT's normal(0, 0.02), is the model's to apply). Knows nothing of optimizers or
// DataParallel.
//
//   auto block = std::make_shared<dp::nn::TransformerBlock>(dp::nn::TransformerBlockOptions(128, 4));
//   dp::Tensor h = (*block)(x);                        // x (B, T, 128) -> (B, T, 128)
//
// Note [16-bit blocks]
// A block (and MultiheadAttention) takes a float32 input, or a bfloat16 or float16 one
// with parameters of that dtype — DataParallel's mixed_precision.param_dtype, where the
// residual stream is 16-bit (FSDP's param_dtype). Then the Linears, the attention (the
// fused CPU kernel accumulates in float32 and rounds once) and the residual adds run in
// the 16-bit dtype, and each LayerNorm computes its statistics and its affine in float32
// and rounds its output once (layer_norm's Note [16-bit tensors]), so the stream stays
// 16-bit from block to block. A float32 mask given to MultiheadAttention is rounded to
// the input's dtype (its 0 and -inf are exact), as autocast casts a mask with the query.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dp/nn/activation.h"
#include "dp/nn/dropout.h"
#include "dp/nn/linear.h"
#include "dp/nn/module.h"
#include "dp/nn/normalization.h"

namespace dp::nn {

/// Options of TransformerBlock (nanoGPT's GPTConfig, per block):
/// TransformerBlockOptions(768, 12).dropout(0.1).bias(false).
class TransformerBlockOptions {
 public:
  TransformerBlockOptions(std::int64_t n_embd, std::int64_t n_head) : n_embd_(n_embd), n_head_(n_head) {}

  /// Biases in the Linears and LayerNorms; default true (GPT-2's).
  TransformerBlockOptions& bias(bool v) { bias_ = v; return *this; }
  /// Dropout on the attention weights, after attn.c_proj and after mlp.c_proj while
  /// training; default 0.
  TransformerBlockOptions& dropout(double v) { dropout_ = v; return *this; }
  /// The MLP's GELU: "tanh" (GPT-2's approximation, the default) or "none" (exact erf, what
  /// nanoGPT's nn.GELU() computes).
  TransformerBlockOptions& gelu_approximate(std::string v) { gelu_ = std::move(v); return *this; }
  /// The LayerNorms' eps; default 1e-5.
  TransformerBlockOptions& layer_norm_eps(double v) { eps_ = v; return *this; }

  std::int64_t n_embd() const { return n_embd_; }
  std::int64_t n_head() const { return n_head_; }
  bool bias() const { return bias_; }
  double dropout() const { return dropout_; }
  const std::string& gelu_approximate() const { return gelu_; }
  double layer_norm_eps() const { return eps_; }

 private:
  std::int64_t n_embd_, n_head_;
  bool bias_ = true;
  double dropout_ = 0.0;
  std::string gelu_ = "tanh";
  double eps_ = 1e-5;
};

/// nanoGPT's CausalSelfAttention: c_attn (C -> 3C, queries, keys, values side by side),
/// n_head heads through scaled_dot_product_attention with is_causal, c_proj (C -> C).
/// x (B, T, C) -> (B, T, C).
///
/// Why not MultiheadAttention: the same computation (c_attn.weight is in_proj_weight's
/// packed (3C, C) layout), but its names (in_proj_weight, out_proj) would not load the
/// state dict of a nanoGPT block, nor a GPT-2 checkpoint converted by nanoGPT.
class CausalSelfAttention : public Module {
 public:
  explicit CausalSelfAttention(const TransformerBlockOptions& options, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;
  /// "n_embd=128, n_head=4".
  std::string extra_repr() const override;

  std::shared_ptr<Linear> c_attn, c_proj;
  std::shared_ptr<Dropout> attn_dropout, resid_dropout;

 private:
  std::int64_t n_embd_, n_head_;
};

/// nanoGPT's MLP: c_fc (C -> 4C), gelu, c_proj (4C -> C), dropout.
class TransformerMLP : public Module {
 public:
  explicit TransformerMLP(const TransformerBlockOptions& options, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<Linear> c_fc;
  std::shared_ptr<GELU> gelu;
  std::shared_ptr<Linear> c_proj;
  std::shared_ptr<Dropout> dropout;
};

/// nanoGPT's Block, pre-norm: x + attn(ln_1(x)), then + mlp(ln_2(x)). x (B, T, C) -> (B, T, C).
class TransformerBlock : public Module {
 public:
  /// The Linears draw their initial values from `gen` (the default generator when null)
  /// in registration order: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj.
  explicit TransformerBlock(const TransformerBlockOptions& options, Generator* gen = nullptr);
  Tensor forward(const Tensor& x) override;

  std::shared_ptr<LayerNorm> ln_1;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<LayerNorm> ln_2;
  std::shared_ptr<TransformerMLP> mlp;
};

}  // namespace dp::nn
