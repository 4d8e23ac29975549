#include "dp/nn/attention.h"

#include <cmath>
#include <optional>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/nn/init.h"
#include "dp/tensor/ops.h"
#include "nn/attention_heads.h"

namespace dp::nn {

namespace {

constexpr const char* kOp = "MultiheadAttention";

// x (..., in) · w(out, in)ᵀ + b over the rows of x.
Tensor project(const Tensor& x, const Tensor& w, const Tensor& b) {
  Shape shape = x.shape();
  shape.back() = w.size(0);
  return linear(x.reshape({-1, x.size(-1)}), w, b).reshape(shape);
}

// Float32, or 16-bit (DataParallel's param_dtype: Note [16-bit blocks] in
// dp/nn/transformer.h).
void check_input(const char* what, const Tensor& t, std::int64_t E, bool batch_first) {
  DP_CHECK(t.defined(), kOp, ": expected a defined ", what, ", got an undefined tensor");
  DP_CHECK(is_floating_point(t.dtype()) && t.dim() == 3 && t.size(2) == E, kOp, ": expected a floating ", what,
           batch_first ? " (N, L, E=" : " (L, N, E=", E, ") in float32, bfloat16 or float16, got ", t.str(),
           t.dim() == 2 ? "; an unbatched input wants .unsqueeze(batch dim)" : "");
}

}  // namespace

/// What run() gives: the output, and the weights (N, H, L, S) when asked.
struct MultiheadAttention::Result {
  Tensor out, weights;
};

MultiheadAttention::MultiheadAttention(const MultiheadAttentionOptions& o, Generator* gen) : options_(o) {
  const std::int64_t E = o.embed_dim(), H = o.num_heads();
  DP_CHECK(E > 0 && H > 0, kOp, ": expected positive embed_dim and num_heads, got embed_dim=", E,
           ", num_heads=", H);
  DP_CHECK(E % H == 0, kOp, ": expected embed_dim divisible by num_heads, got embed_dim=", E, ", num_heads=", H,
           " (", E, " % ", H, " = ", E % H, ")");
  DP_CHECK(o.dropout() >= 0.0 && o.dropout() <= 1.0, kOp, ": expected dropout in [0, 1], got ", o.dropout());
  Generator& g = gen ? *gen : default_generator();
  // PyTorch's order: out_proj (a Linear's init) is made before _reset_parameters draws
  // in_proj_weight; then every bias is zeroed.
  auto out_proj = std::make_shared<Linear>(E, E, o.bias(), &g);
  Tensor w = empty({3 * E, E});
  init::xavier_uniform_(w, 1.0, g);
  in_proj_weight_ = register_parameter("in_proj_weight", w);
  if (o.bias()) {
    in_proj_bias_ = register_parameter("in_proj_bias", zeros({3 * E}));
    NoGradGuard no_grad;  // an initialisation (Note [In-place writes and autograd] in src/tensor/tensor.cpp)
    out_proj->bias().zero_();
  }
  out_proj_ = register_module("out_proj", out_proj);
  if (o.dropout() > 0.0) dropout_ = register_module("dropout", std::make_shared<Dropout>(o.dropout()));
}

Tensor MultiheadAttention::forward(const Tensor& x) { return forward(x, x, x); }

Tensor MultiheadAttention::forward(const std::vector<Tensor>& in) {
  if (in.size() == 1) return forward(in[0], in[0], in[0]);
  DP_CHECK(in.size() == 3 || in.size() == 4, kOp, ": expected {x}, {query, key, value} or {query, key, value, "
           "key_padding_mask}, got ", in.size(), " inputs");
  return forward(in[0], in[1], in[2], in.size() == 4 ? in[3] : Tensor());
}

Tensor MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const Tensor& key_padding_mask, const Tensor& attn_mask, bool is_causal) {
  return run(query, key, value, key_padding_mask, attn_mask, is_causal, false).out;
}

std::pair<Tensor, Tensor> MultiheadAttention::forward_with_weights(const Tensor& query, const Tensor& key,
                                                                   const Tensor& value,
                                                                   const Tensor& key_padding_mask,
                                                                   const Tensor& attn_mask,
                                                                   bool average_attn_weights, bool is_causal) {
  Result r = run(query, key, value, key_padding_mask, attn_mask, is_causal, true);
  return {r.out, average_attn_weights ? mean(r.weights, 1) : r.weights};
}

MultiheadAttention::Result MultiheadAttention::run(const Tensor& query, const Tensor& key, const Tensor& value,
                                                   const Tensor& key_padding_mask, const Tensor& attn_mask,
                                                   bool is_causal, bool need_weights) {
  const std::int64_t E = options_.embed_dim(), H = options_.num_heads();
  const bool bf = options_.batch_first();
  check_input("query", query, E, bf);
  check_input("key", key, E, bf);
  check_input("value", value, E, bf);
  const bool self = query.is_same(key) && key.is_same(value);
  // Batch first from here on: (N, L, E), (N, S, E).
  const Tensor q_in = bf ? query : query.transpose(0, 1);
  const Tensor k_in = bf ? key : key.transpose(0, 1);
  const Tensor v_in = bf ? value : value.transpose(0, 1);
  const std::int64_t N = q_in.size(0), L = q_in.size(1), S = k_in.size(1);
  DP_CHECK(k_in.size(0) == N && v_in.size(0) == N && v_in.size(1) == S, kOp,
           ": expected key and value with query's batch size and one sequence length, got query ",
           shape_str(query.shape()), ", key ", shape_str(key.shape()), ", value ", shape_str(value.shape()),
           bf ? " (batch_first: (N, L, E), (N, S, E), (N, S, E))" : " ((L, N, E), (S, N, E), (S, N, E))");
  const Tensor w = in_proj_weight(), b = in_proj_bias();
  auto rows = [&](const Tensor& t, std::int64_t i) { return t.defined() ? t.narrow(0, i * E, E) : Tensor(); };
  Tensor q, k, v;
  if (self) {  // one GEMM for the three projections, as PyTorch's self-attention
    std::vector<Tensor> qkv = split(project(q_in, w, b), E, 2);
    q = qkv[0], k = qkv[1], v = qkv[2];
  } else {
    q = project(q_in, rows(w, 0), rows(b, 0));
    k = project(k_in, rows(w, 1), rows(b, 1));
    v = project(v_in, rows(w, 2), rows(b, 2));
  }
  // The additive mask, broadcast to (N, H, L, S) (Note [Attention masks]), in q's dtype:
  // a 16-bit q (param_dtype) takes the float32 masks rounded to it, as autocast casts a
  // mask with q (its 0 and -inf are exact in every dtype).
  const TensorOptions f32{Dtype::Float32, q.device()};
  const auto in_q = [&q](const Tensor& m) { return m.dtype() == q.dtype() ? m : m.to(q.dtype()); };
  Tensor mask;
  if (attn_mask.defined()) {
    const Shape two{L, S}, three{N * H, L, S};
    DP_CHECK(attn_mask.dtype() == Dtype::Float32 && (attn_mask.shape() == two || attn_mask.shape() == three), kOp,
             ": expected a float32 attn_mask of shape (L, S) = ", shape_str(two), " or (N * num_heads, L, S) = ",
             shape_str(three), ", got ", attn_mask.str());
    mask = in_q(attn_mask.dim() == 2 ? attn_mask : attn_mask.reshape({N, H, L, S}));
  }
  if (key_padding_mask.defined()) {
    const Shape ns{N, S};
    DP_CHECK(key_padding_mask.dtype() == Dtype::Float32 && key_padding_mask.shape() == ns, kOp,
             ": expected a float32 key_padding_mask of shape (N, S) = ", shape_str(ns), ", got ",
             key_padding_mask.str(), " (Note [Attention masks]: -inf where a key is padding, 0 elsewhere)");
    Tensor pad = in_q(key_padding_mask.reshape({N, 1, 1, S}));
    mask = mask.defined() ? add(mask, pad) : pad;
  }
  // Causal alone goes to sdpa as is_causal; beside a padding mask, or for the weights,
  // it becomes -inf above the diagonal.
  const bool causal = is_causal && !attn_mask.defined();
  if (causal && (mask.defined() || need_weights)) {
    Tensor future = triu(ones({L, S}, f32), 1);
    Tensor c = in_q(masked_fill(zeros({L, S}, f32), future, -INFINITY));
    mask = mask.defined() ? add(mask, c) : c;
  }
  const double p = is_training() && dropout_ ? options_.dropout() : 0.0;
  Generator* gen = p > 0.0 ? &dropout_->generator(ReplicaBinding::current()) : nullptr;
  q = heads::split(q, H), k = heads::split(k, H), v = heads::split(v, H);
  Result r;
  if (need_weights) {
    // PyTorch's need_weights path: the weights are kept, then multiply v.
    Tensor scores = mul(matmul(q, k.transpose(-2, -1)), 1.0 / std::sqrt(static_cast<double>(E / H)));
    r.weights = softmax(mask.defined() ? add(scores, mask) : scores, -1);
    if (p > 0.0) r.weights = dropout(r.weights, p, true, *gen);
    r.out = matmul(r.weights, v);
  } else {
    r.out = scaled_dot_product_attention(q, k, v, mask, p, causal && !mask.defined(), std::nullopt, false, gen);
  }
  r.out = out_proj_->forward(heads::merge(r.out));
  if (!bf) r.out = r.out.transpose(0, 1);
  return r;
}

std::string MultiheadAttention::extra_repr() const {
  const MultiheadAttentionOptions& o = options_;
  return detail::str_cat("embed_dim=", o.embed_dim(), ", num_heads=", o.num_heads(), ", dropout=", o.dropout(),
                         ", bias=", o.bias() ? "true" : "false", ", batch_first=", o.batch_first() ? "true" : "false");
}

}  // namespace dp::nn
