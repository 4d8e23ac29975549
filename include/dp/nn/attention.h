// dp/nn/attention.h — multi-head attention: torch.nn.MultiheadAttention.
//
// Projects query, key and value with one packed (3E, E) weight, splits E into num_heads
// heads of E / num_heads, attends with scaled_dot_product_attention and projects the
// heads' concatenation back with out_proj. Parameter names, shapes and the default
// initialisation are PyTorch's, so state dicts load either way. Knows nothing of
// optimizers or DataParallel.
//
//   auto mha = std::make_shared<dp::nn::MultiheadAttention>(
//       dp::nn::MultiheadAttentionOptions(128, 4).batch_first(true));
//   dp::Tensor y = mha->forward(x, x, x, dp::Tensor(), dp::Tensor(), /*is_causal=*/true);  // x (N, T, 128)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/nn/dropout.h"
#include "dp/nn/linear.h"
#include "dp/nn/module.h"

namespace dp::nn {

/// Options of MultiheadAttention in libtorch's builder style:
/// MultiheadAttentionOptions(128, 4).dropout(0.1).batch_first(true).
class MultiheadAttentionOptions {
 public:
  MultiheadAttentionOptions(std::int64_t embed_dim, std::int64_t num_heads)
      : embed_dim_(embed_dim), num_heads_(num_heads) {}

  /// Dropout on the attention weights while training; default 0.
  MultiheadAttentionOptions& dropout(double v) { dropout_ = v; return *this; }
  /// Biases on the input and output projections; default true.
  MultiheadAttentionOptions& bias(bool v) { bias_ = v; return *this; }
  /// Inputs and output as (N, L, E) when true, (L, N, E) when false — PyTorch's default,
  /// run as (N, L, E) between two transposes. DataParallel splits dim 0, so a model it
  /// runs wants batch_first(true).
  MultiheadAttentionOptions& batch_first(bool v) { batch_first_ = v; return *this; }

  std::int64_t embed_dim() const { return embed_dim_; }
  std::int64_t num_heads() const { return num_heads_; }
  double dropout() const { return dropout_; }
  bool bias() const { return bias_; }
  bool batch_first() const { return batch_first_; }

 private:
  std::int64_t embed_dim_, num_heads_;
  double dropout_ = 0.0;
  bool bias_ = true;
  bool batch_first_ = false;
};

// Note [Attention masks]
// dp has no bool dtype, so MultiheadAttention takes PyTorch's float masks, which are
// added to the scores (-inf masks a key; PyTorch turns its bool masks into exactly
// these): key_padding_mask (N, S), the same for every query and head, and attn_mask
// (L, S) or (N * num_heads, L, S). A 0/1 padding mask (1 = pad, as `ids == pad_id`
// gives) becomes one with masked_fill:
//   dp::Tensor kpm = dp::zeros({N, S}).masked_fill(ids == pad_id, -INFINITY);
// is_causal masks every key after its query (j > i, PyTorch's top-left causal mask);
// with an attn_mask it is PyTorch's hint that the mask is causal, and the mask is used.
// A query whose every key is masked attends to nothing: its attention output is zeros
// and no gradient flows through it (so the layer's output there is out_proj's bias), as
// PyTorch 2.x's training path through scaled_dot_product_attention (Note [Rows with
// every key masked] in src/nn/functional_sequence.cpp). forward_with_weights, like
// PyTorch's need_weights=True path, gives NaN weights and outputs there.

/// Multi-head attention over (N, L, E) queries and (N, S, E) keys and values (each
/// (L, N, E) and (S, N, E) unless batch_first). Parameters: in_proj_weight (3E, E),
/// in_proj_bias (3E), out_proj.weight (E, E), out_proj.bias (E) — PyTorch's names;
/// initialised as PyTorch does: in_proj_weight xavier_uniform, out_proj.weight as a
/// Linear's, biases zero. Keys and values have the embedding size E (PyTorch's kdim and
/// vdim are not offered).
class MultiheadAttention : public Module {
 public:
  /// Draws out_proj.weight, then in_proj_weight, from `gen` (the default generator when
  /// null), in PyTorch's order. A dropout > 0 registers the child "dropout", whose
  /// generators draw the attention weights' masks (Note [Dropout generators]).
  explicit MultiheadAttention(const MultiheadAttentionOptions& options, Generator* gen = nullptr);
  MultiheadAttention(std::int64_t embed_dim, std::int64_t num_heads, Generator* gen = nullptr)
      : MultiheadAttention(MultiheadAttentionOptions(embed_dim, num_heads), gen) {}

  using Module::forward;
  /// Self-attention: forward(x, x, x).
  Tensor forward(const Tensor& x) override;
  /// {x} (self-attention), {query, key, value} or {query, key, value, key_padding_mask}:
  /// what DataParallel and Sequential call with net(q, k, v).
  Tensor forward(const std::vector<Tensor>& inputs) override;
  /// The attention output, (N, L, E) (or (L, N, E)); masks as Note [Attention masks].
  /// PyTorch's forward(query, key, value, key_padding_mask, need_weights=False,
  /// attn_mask, is_causal=is_causal)[0], through scaled_dot_product_attention.
  Tensor forward(const Tensor& query, const Tensor& key, const Tensor& value,
                 const Tensor& key_padding_mask = Tensor(), const Tensor& attn_mask = Tensor(), bool is_causal = false);
  /// The output and the attention weights after softmax (and dropout): (N, L, S) averaged
  /// over the heads, or (N, num_heads, L, S) when !average_attn_weights — PyTorch's
  /// need_weights=True. The weights are held, O(N·H·L·S), and differentiable.
  std::pair<Tensor, Tensor> forward_with_weights(const Tensor& query, const Tensor& key, const Tensor& value,
                                                 const Tensor& key_padding_mask = Tensor(),
                                                 const Tensor& attn_mask = Tensor(), bool average_attn_weights = true,
                                                 bool is_causal = false);
  /// "embed_dim=128, num_heads=4, dropout=0, bias=true, batch_first=true".
  std::string extra_repr() const override;

  /// The bound copy's packed projection (3E, E): rows [0, E) for queries, [E, 2E) keys, [2E, 3E) values.
  const Tensor& in_proj_weight() const { return in_proj_weight_.get(); }
  /// The bound copy's packed bias (3E); undefined without bias.
  Tensor in_proj_bias() const { return in_proj_bias_.defined() ? in_proj_bias_.get() : Tensor(); }
  const std::shared_ptr<Linear>& out_proj() const { return out_proj_; }
  const MultiheadAttentionOptions& options() const { return options_; }

 private:
  struct Result;
  Result run(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_padding_mask,
             const Tensor& attn_mask, bool is_causal, bool need_weights);

  MultiheadAttentionOptions options_;
  Parameter in_proj_weight_, in_proj_bias_;
  std::shared_ptr<Linear> out_proj_;
  std::shared_ptr<Dropout> dropout_;  // null without attention dropout
};

}  // namespace dp::nn
