#include "dp/nn/transformer.h"

#include <optional>

#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"
#include "nn/attention_heads.h"

namespace dp::nn {

namespace {

void check_options(const TransformerBlockOptions& o) {
  const std::int64_t C = o.n_embd(), H = o.n_head();
  DP_CHECK(C > 0 && H > 0, "TransformerBlock: expected positive n_embd and n_head, got n_embd=", C, ", n_head=", H);
  DP_CHECK(C % H == 0, "TransformerBlock: expected n_embd divisible by n_head, got n_embd=", C, ", n_head=", H,
           " (", C, " % ", H, " = ", C % H, ")");
  DP_CHECK(o.dropout() >= 0.0 && o.dropout() <= 1.0, "TransformerBlock: expected dropout in [0, 1], got ",
           o.dropout());
}

// Float32, or a 16-bit residual stream (DataParallel's param_dtype: Note [16-bit
// blocks] in dp/nn/transformer.h).
void check_input(const char* op, const Tensor& x, std::int64_t C) {
  DP_CHECK(x.defined() && x.dim() == 3 && x.size(2) == C && is_floating_point(x.dtype()), op,
           ": expected a floating input (B, T, C=", C, ") in float32, bfloat16 or float16, got ",
           x.defined() ? x.str() : std::string("an undefined tensor"));
}

// A Dropout seeded from `gen` when given (a block built from one generator is then the
// same run to run), else from the default generator as Dropout does by itself.
std::shared_ptr<Dropout> make_dropout(double p, Generator* gen) {
  if (!gen) return std::make_shared<Dropout>(p);
  return std::make_shared<Dropout>(p, gen->seed() ^ (gen->advance(1) * 0x9e3779b97f4a7c15ULL));
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(const TransformerBlockOptions& o, Generator* gen)
    : n_embd_(o.n_embd()), n_head_(o.n_head()) {
  check_options(o);
  c_attn = register_module("c_attn", std::make_shared<Linear>(n_embd_, 3 * n_embd_, o.bias(), gen));
  c_proj = register_module("c_proj", std::make_shared<Linear>(n_embd_, n_embd_, o.bias(), gen));
  attn_dropout = register_module("attn_dropout", make_dropout(o.dropout(), gen));
  resid_dropout = register_module("resid_dropout", make_dropout(o.dropout(), gen));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  check_input("CausalSelfAttention", x, n_embd_);
  const std::vector<Tensor> qkv = split(c_attn->forward(x), n_embd_, 2);
  const double p = is_training() ? attn_dropout->p() : 0.0;
  Generator* gen = p > 0.0 ? &attn_dropout->generator(ReplicaBinding::current()) : nullptr;
  Tensor y = scaled_dot_product_attention(heads::split(qkv[0], n_head_), heads::split(qkv[1], n_head_),
                                          heads::split(qkv[2], n_head_), Tensor(), p, /*is_causal=*/true,
                                          std::nullopt, false, gen);
  return resid_dropout->forward(c_proj->forward(heads::merge(y)));
}

std::string CausalSelfAttention::extra_repr() const {
  return detail::str_cat("n_embd=", n_embd_, ", n_head=", n_head_);
}

TransformerMLP::TransformerMLP(const TransformerBlockOptions& o, Generator* gen) {
  check_options(o);
  const std::int64_t C = o.n_embd();
  c_fc = register_module("c_fc", std::make_shared<Linear>(C, 4 * C, o.bias(), gen));
  gelu = register_module("gelu", std::make_shared<GELU>(o.gelu_approximate()));
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * C, C, o.bias(), gen));
  dropout = register_module("dropout", make_dropout(o.dropout(), gen));
}

Tensor TransformerMLP::forward(const Tensor& x) {
  return dropout->forward(c_proj->forward(gelu->forward(c_fc->forward(x))));
}

TransformerBlock::TransformerBlock(const TransformerBlockOptions& o, Generator* gen) {
  check_options(o);
  const LayerNormOptions ln = LayerNormOptions({o.n_embd()}).bias(o.bias()).eps(o.layer_norm_eps());
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(ln));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(o, gen));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(ln));
  mlp = register_module("mlp", std::make_shared<TransformerMLP>(o, gen));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  check_input("TransformerBlock", x, ln_1->options().normalized_shape()[0]);
  Tensor h = add(x, attn->forward(ln_1->forward(x)));
  return add(h, mlp->forward(ln_2->forward(h)));
}

}  // namespace dp::nn
