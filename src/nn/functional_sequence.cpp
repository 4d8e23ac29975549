// The functional ops of sequence models (dp/nn/functional.h): softmax and log_softmax
// along any dim, layer_norm, embedding, gelu. Most compose the tensor layer's
// differentiable ops, so their gradients come from those ops' backward functions; gelu
// is one backend op each way (Note [Fused GELU] in backend/functors.h).
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/nn/functional.h"
#include "dp/tensor/ops.h"
#include "nn/embedding_rows.h"
#include "nn/fused_attention.h"
#include "tensor/autocast_policy.h"
#include "tensor/tensor_util.h"

namespace dp::nn {

namespace {

std::int64_t checked_dim(const char* op, const Tensor& x, std::int64_t dim) {
  DP_CHECK(x.defined(), op, ": expected a defined input, got an undefined tensor");
  const std::int64_t n = x.dim();
  DP_CHECK(n >= 1, op, ": expected an input with at least 1 dim, got a scalar");
  DP_CHECK(dim >= -n && dim < n, op, ": expected a dim in [", -n, ", ", n, "), got ", dim, " for shape ",
           shape_str(x.shape()));
  return dim < 0 ? dim + n : dim;
}

// log_softmax over the last dim of x as rows of the 2-d kernel.
Tensor log_softmax_last(const Tensor& x) {
  const std::int64_t cols = x.size(x.dim() - 1);
  const std::int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  return log_softmax(x.reshape({rows, cols})).reshape(x.shape());
}

/// out = gelu(x), one backend pass (Note [Fused GELU] in backend/functors.h).
void run_gelu(const Tensor& x, const Tensor& out, bool tanh) {
  backend::get(x.device())
      .run<backend::Op::Gelu>(x.device(), dp::detail::kernel_dtype(x.dtype()),
                              {x.raw_data(), out.raw_data(), x.numel(), tanh});
}

/// Whether layer_norm runs as one backend op each way (Note [Fused LayerNorm] in
/// src/backend/cpu/cpu_nn.cpp, Note [Fused LayerNorm on CUDA] in cuda_nn.cu): float32
/// weight and bias (or none) on a backend with the ops (CPU and CUDA); otherwise it
/// composes the tensor ops.
bool fused_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b) {
  auto f32 = [](const Tensor& t) { return !t.defined() || t.dtype() == Dtype::Float32; };
  if (!f32(w) || !f32(b)) return false;
  auto& bk = backend::get(x.device());
  return bk.supports(backend::Op::LayerNorm, backend::DType::F32) &&
         bk.supports(backend::Op::LayerNormBackward, backend::DType::F32);
}

const float* f32_or_null(const Tensor& t) { return t.defined() ? static_cast<const float*>(t.raw_data()) : nullptr; }

/// layer_norm of the float32 (rows, cols) x with weight and bias of (cols) or undefined.
Tensor layer_norm_fused(const Tensor& input, const Tensor& weight, const Tensor& bias, double eps) {
  const Tensor x = input.contiguous();
  const Tensor w = weight.defined() ? weight.contiguous() : weight;
  const Tensor b = bias.defined() ? bias.contiguous() : bias;
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const Device dev = x.device();
  Tensor y = empty_like(x);
  Tensor mean = empty({rows}, dev), rstd = empty({rows}, dev);
  backend::get(dev).run<backend::Op::LayerNorm>(
      dev, backend::DType::F32,
      {x.raw_data(), f32_or_null(w), f32_or_null(b), y.raw_data(), static_cast<float*>(mean.raw_data()),
       static_cast<float*>(rstd.raw_data()), rows, cols, static_cast<float>(eps)});
  std::vector<Tensor> inputs{input};
  if (weight.defined()) inputs.push_back(weight);
  if (bias.defined()) inputs.push_back(bias);
  if (autograd::needs_grad(inputs)) {
    autograd::record("NativeLayerNormBackward", inputs, y, {x, w},
                     [x = x.detach(), w = w.defined() ? w.detach() : w, mean, rstd, has_w = weight.defined(),
                      has_b = bias.defined()](const std::vector<Tensor>& g) {
                       std::vector<Tensor> out(1 + (has_w ? 1 : 0) + (has_b ? 1 : 0));
                       if (!g[0].defined()) return out;
                       DP_CHECK(g[0].shape() == x.shape() && g[0].device() == x.device(),
                                "NativeLayerNormBackward: expected a gradient of shape ", shape_str(x.shape()), " on ",
                                x.device().str(), ", got ", g[0].str());
                       const Tensor gy = (g[0].dtype() == Dtype::Float32 ? g[0] : dp::detail::cast_raw(g[0], Dtype::Float32))
                                             .contiguous();
                       const std::int64_t rows = x.size(0), cols = x.size(1);
                       const Device dev = x.device();
                       Tensor gx = empty_like(x);
                       Tensor gw = has_w ? empty({cols}, dev) : Tensor();
                       Tensor gb = has_b ? empty({cols}, dev) : Tensor();
                       backend::get(dev).run<backend::Op::LayerNormBackward>(
                           dev, backend::DType::F32,
                           {x.raw_data(), f32_or_null(w), static_cast<const float*>(mean.raw_data()),
                            static_cast<const float*>(rstd.raw_data()), gy.raw_data(), gx.raw_data(),
                            gw.defined() ? static_cast<float*>(gw.raw_data()) : nullptr,
                            gb.defined() ? static_cast<float*>(gb.raw_data()) : nullptr, rows, cols});
                       std::size_t i = 0;
                       out[i++] = gx;
                       if (has_w) out[i++] = gw;
                       if (has_b) out[i++] = gb;
                       return out;
                     });
  }
  return y;
}

}  // namespace

Tensor log_softmax(const Tensor& x, std::int64_t dim) {
  if (amp::detail::active() || amp::detail::is_16bit(x))  // Note [Autocast op policy]: float32
    return amp::detail::float32_op([dim](const Tensor& xx) { return log_softmax(xx, dim); }, x);
  const std::int64_t d = checked_dim("log_softmax", x, dim);
  const std::int64_t last = x.dim() - 1;
  if (d == last) return log_softmax_last(x);
  return log_softmax_last(x.transpose(d, last)).transpose(d, last);
}

Tensor softmax(const Tensor& x, std::int64_t dim) {
  if (amp::detail::active() || amp::detail::is_16bit(x))
    return amp::detail::float32_op([dim](const Tensor& xx) { return softmax(xx, dim); }, x);
  (void)checked_dim("softmax", x, dim);
  return exp(log_softmax(x, dim));
}

Tensor gelu(const Tensor& input, const std::string& approximate) {
  DP_CHECK(input.defined(), "gelu: expected a defined input, got an undefined tensor");
  DP_CHECK(approximate == "none" || approximate == "tanh", "gelu: expected approximate \"none\" or \"tanh\", got \"",
           approximate, "\"");
  dp::detail::check_floating("gelu", input);
  const bool tanh = approximate == "tanh";
  Tensor out = empty_like(input);
  run_gelu(input, out, tanh);
  if (autograd::needs_grad({input})) {
    autograd::record("GeluBackward", {input}, out, {input}, [x = input.detach(), tanh](const std::vector<Tensor>& g) {
      if (!g[0].defined()) return std::vector<Tensor>{Tensor()};
      DP_CHECK(g[0].shape() == x.shape() && g[0].device() == x.device(), "GeluBackward: expected a gradient of shape ",
               shape_str(x.shape()), " on ", x.device().str(), ", got ", g[0].str());
      // Mixed floating dtypes compute in float32, as the tensor ops' common dtype does.
      const Dtype dt = g[0].dtype() == x.dtype() ? x.dtype() : Dtype::Float32;
      const Tensor xx = x.dtype() == dt ? x : dp::detail::cast_raw(x, dt);
      const Tensor gy = g[0].dtype() == dt ? g[0] : dp::detail::cast_raw(g[0], dt);
      Tensor gx = empty_like(gy);
      backend::get(x.device())
          .run<backend::Op::GeluBackward>(x.device(), dp::detail::kernel_dtype(dt),
                                          {xx.raw_data(), gy.raw_data(), gx.raw_data(), x.numel(), tanh});
      return std::vector<Tensor>{gx};
    });
  }
  return out;
}

Tensor logsigmoid(const Tensor& input) {
  DP_CHECK(input.defined(), "logsigmoid: expected a defined input, got an undefined tensor");
  dp::detail::check_floating("logsigmoid", input);
  Tensor out = dp::detail::log_sigmoid_raw(input);  // float32 math, one rounding for 16 bits
  autograd::record("LogSigmoidBackward", {input}, out, {input}, [x = input.detach()](const std::vector<Tensor>& g) {
    if (!g[0].defined()) return std::vector<Tensor>{Tensor()};
    const Dtype dt = x.dtype();
    const Tensor xf = dt == Dtype::Float32 ? x : dp::detail::cast_raw(x, Dtype::Float32);
    const Tensor gf = g[0].dtype() == Dtype::Float32 ? g[0] : dp::detail::cast_raw(g[0], Dtype::Float32);
    const Tensor z = exp(neg(abs(xf)));
    const Tensor r = div(z, add(z, 1.0));
    Tensor gx = mul(where(lt(xf, 0.0), sub(1.0, r), r), gf);  // PyTorch's (max_deriv − sign·r)·grad
    return std::vector<Tensor>{dt == Dtype::Float32 ? gx : dp::detail::cast_raw(gx, dt)};
  });
  return out;
}

Tensor layer_norm(const Tensor& input, const Shape& normalized_shape, const Tensor& weight, const Tensor& bias,
                  double eps) {
  if (amp::detail::active() || amp::detail::is_16bit(input))  // statistics in float32
    return amp::detail::float32_op(
        [&](const Tensor& x) { return layer_norm(x, normalized_shape, weight, bias, eps); }, input);
  DP_CHECK(input.defined(), "layer_norm: expected a defined input, got an undefined tensor");
  DP_CHECK(input.dtype() == Dtype::Float32, "layer_norm: expected a float32 input, got ", input.str());
  const auto k = static_cast<std::int64_t>(normalized_shape.size());
  DP_CHECK(k >= 1 && k <= input.dim() &&
               Shape(input.shape().end() - k, input.shape().end()) == normalized_shape,
           "layer_norm: expected an input whose trailing dims are normalized_shape ", shape_str(normalized_shape),
           ", got ", shape_str(input.shape()));
  DP_CHECK(eps >= 0, "layer_norm: expected eps >= 0, got ", eps);
  for (const auto& [name, t] : {std::pair{"weight", weight}, std::pair{"bias", bias}}) {
    DP_CHECK(!t.defined() || (t.shape() == normalized_shape && t.device() == input.device()), "layer_norm: expected ",
             name, " of shape ", shape_str(normalized_shape), " on ", input.device().str(), ", got ", t.str());
  }
  const std::int64_t cols = shape_numel(normalized_shape);
  const std::int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  if (fused_layer_norm(input, weight, bias)) {
    auto flat = [](const Tensor& t, const Shape& shape) { return t.defined() && t.shape() != shape ? t.reshape(shape) : t; };
    return flat(layer_norm_fused(flat(input, {rows, cols}), flat(weight, {cols}), flat(bias, {cols}), eps),
                input.shape());
  }
  Tensor x = input.reshape({rows, cols});
  Tensor centered = sub(x, mean(x, 1, true));
  Tensor var = mean(mul(centered, centered), 1, true);  // biased, as PyTorch's
  Tensor y = div(centered, sqrt(add(var, eps)));
  if (weight.defined()) y = mul(y, weight.reshape({cols}));
  if (bias.defined()) y = add(y, bias.reshape({cols}));
  return y.reshape(input.shape());
}

bool detail::embedding_ids_on_device(const Tensor& ids, std::int64_t rows) {
  // An empty table has no row 0 to gather a bad id from: index_select refuses its ids.
  return !ids.device().is_cpu() && rows > 0 && rows <= (std::int64_t{1} << 24);
}

Tensor detail::embedding_rows_on_device(const Tensor& weight, const Tensor& ids64, Tensor& gathered) {
  NoGradGuard no_grad;
  const std::int64_t V = weight.size(0), n = ids64.numel();
  DP_CHECK(V > 0 && V <= (std::int64_t{1} << 24), "embedding: expected a table of 1 to 2^24 rows to gather ids "
           "on the device (float32 compares larger ones inexactly; an empty one has no row), got ", V,
           " rows; read the ids on the host (index_select)");
  DP_CHECK(ids64.device() == weight.device(), "embedding: expected ids on the weight's device ",
           weight.device().str(), ", got ", ids64.device().str());
  const Tensor f = ids64.to(Dtype::Float32);  // exact below 2^24; larger ids stay >= V
  const Tensor ok = mul(ge(f, 0.0), lt(f, static_cast<double>(V)));  // 1 in range, 0 outside
  gathered = where(ok, f, 0.0).to(Dtype::Int64);
  const Tensor rows = dp::detail::index_select_in_range(weight, 0, gathered);
  // where keeps every in-range row's bits (-0 included), in the weight's dtype.
  return where(ok.reshape({n, 1}), rows, std::nan(""));
}

Tensor embedding(const Tensor& input, const Tensor& weight, std::optional<std::int64_t> padding) {
  DP_CHECK(input.defined() && weight.defined(), "embedding: expected defined input and weight tensors");
  DP_CHECK(input.dtype() == Dtype::Int64 || input.dtype() == Dtype::Int32,
           "embedding: expected int64 or int32 ids, got ", input.str());
  DP_CHECK(weight.dim() == 2 && is_floating_point(weight.dtype()),
           "embedding: expected a floating weight (V, D) (float32, bfloat16 or float16), got ", weight.str());
  DP_CHECK(input.device() == weight.device(), "embedding: expected ids on the weight's device ",
           weight.device().str(), ", got ids on ", input.device().str());
  const std::int64_t V = weight.size(0), D = weight.size(1);
  std::int64_t padding_idx = -1;  // none
  if (padding) {
    DP_CHECK(*padding >= -V && *padding < V, "embedding: expected padding_idx in [", -V, ", ", V, "), got ", *padding);
    padding_idx = *padding < 0 ? *padding + V : *padding;  // PyTorch counts a negative one from the end
  }
  Tensor ids = input.reshape({input.numel()});
  Tensor rows, ids64;
  {
    NoGradGuard no_grad;  // the gradient is EmbeddingBackward's (padding_idx)
    if (detail::embedding_ids_on_device(ids, V)) {  // Note [Embedding ids without a host read]
      rows = detail::embedding_rows_on_device(weight, ids.to(Dtype::Int64), ids64);
    } else {
      rows = index_select(weight, 0, ids);
    }
  }
  Shape out_shape = input.shape();
  out_shape.push_back(D);
  Tensor out = rows.reshape(out_shape);
  if (autograd::needs_grad({weight})) {
    if (!ids64.defined()) ids64 = ids.to(Dtype::Int64);
    // A 16-bit weight (DataParallel's param_dtype) gathers its rows as they are; its
    // gradient adds the rows' gradients up in float32 and rounds once to its dtype.
    const Dtype dtype = weight.dtype();
    autograd::record("EmbeddingBackward", {weight}, out, {ids64}, [ids64, V, D, padding_idx, dtype](const std::vector<Tensor>& g) {
      // The forward checked the ids (index_select on the host, or it gathered in-range
      // ones on the device): no read of them on the host here (a wait on CUDA in the
      // middle of the backward).
      Tensor gw = dp::detail::index_add_in_range(zeros({V, D}, g[0].device()), 0, ids64,
                                                 g[0].reshape({ids64.numel(), D}).to(Dtype::Float32));
      if (padding_idx >= 0) gw.narrow(0, padding_idx, 1).zero_();
      return std::vector<Tensor>{gw.to(dtype)};
    });
  }
  return out;
}

// Note [Rows with every key masked]
// A query whose every key is masked (its row of a 0/1 keep-mask all 0, of an additive
// mask all -inf: a key-padding mask over a sequence that is all padding) has no
// softmax, exp(-inf - -inf) being NaN. PyTorch's scaled_dot_product_attention gives such
// a row weights of 0 — an output row of zeros, and no gradient through it — on every
// backend since 2.5 (the math path's _safe_softmax, the flash kernels). dp gave NaN
// there, and the NaN reached every key's and value's gradient: one padded query row
// made the whole batch's gradients NaN. Now every path gives PyTorch's zeros: the math
// path softmaxes a row of zeros in its place and zeroes its weights (the other rows'
// bits are softmax's own); the fused kernels end such a row with out = 0 and lse =
// +inf, so that the backward's probabilities exp(s - lse) are 0 on it. softmax itself,
// and MultiheadAttention's need_weights path (softmax, as PyTorch's), keep the NaN, as
// PyTorch's do; so does a row with a NaN score.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    double dropout_p, bool is_causal, std::optional<double> scale, bool mask_is_keep,
                                    Generator* gen) {
  if (amp::detail::active())  // Note [Autocast op policy]: the lower-precision list
    return amp::detail::lower_op(
        [&](const Tensor& qq, const Tensor& kk, const Tensor& vv, const Tensor& mm) {
          return scaled_dot_product_attention(qq, kk, vv, mm, dropout_p, is_causal, scale, mask_is_keep, gen);
        },
        q, k, v, attn_mask);
  const char* op = "scaled_dot_product_attention";
  DP_CHECK(q.defined() && k.defined() && v.defined(), op, ": expected defined q, k and v");
  DP_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, op, ": expected q, k, v with at least 2 dims "
           "(..., L, E), (..., S, E), (..., S, Ev), got ", shape_str(q.shape()), ", ", shape_str(k.shape()), ", ",
           shape_str(v.shape()));
  const std::int64_t E = q.size(q.dim() - 1), S = k.size(k.dim() - 2), L = q.size(q.dim() - 2);
  DP_CHECK(k.size(k.dim() - 1) == E, op, ": expected q and k with the same last dim E, got ", shape_str(q.shape()),
           " and ", shape_str(k.shape()));
  DP_CHECK(v.size(v.dim() - 2) == S, op, ": expected k and v with the same number of keys S, got ",
           shape_str(k.shape()), " and ", shape_str(v.shape()));
  DP_CHECK(!(is_causal && attn_mask.defined()), op, ": expected either attn_mask or is_causal, got both");
  DP_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, op, ": expected dropout_p in [0, 1], got ", dropout_p);
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(E));
  if (const AttentionPath path = attention_path(); path != AttentionPath::Math) {  // Note [Fused attention paths]
    const std::string misfit = detail::fused_attention_misfit(q, k, v, attn_mask, mask_is_keep, dropout_p);
    if (misfit.empty())
      return detail::fused_attention(q, k, v, attn_mask, mask_is_keep, is_causal, static_cast<float>(s), dropout_p,
                                     gen ? *gen : default_generator());
    DP_CHECK(path == AttentionPath::Auto, op, ": expected a call the fused kernel fits, as set_attention_path("
             "AttentionPath::Fused) asks, got one where ", misfit);
  }
  Tensor scores = mul(matmul(q, k.transpose(-2, -1)), s);  // (..., L, S)
  // A keep-mask selects: where(keep, scores, -inf) gives the scores that an added
  // log(keep) (0 or -inf) gave, in one pass and with a zero gradient where masked.
  if (is_causal) {
    // Keep key j for query i when j <= i: PyTorch's top-left aligned causal mask, made
    // on the device from two aranges (no host loop, no copy per call).
    const TensorOptions f32{Dtype::Float32, q.device()};
    scores = where(le(arange(S, f32).reshape({1, S}), arange(L, f32).reshape({L, 1})), scores, -INFINITY);
  } else if (attn_mask.defined()) {
    // Float32, or q's dtype: autocast casts the mask with q (PyTorch's rule).
    DP_CHECK((attn_mask.dtype() == Dtype::Float32 || attn_mask.dtype() == q.dtype()) &&
                 attn_mask.device() == q.device(),
             op, ": expected a float32 attn_mask (or one of q's dtype ", dtype_name(q.dtype()), ") on ",
             q.device().str(), ", got ", attn_mask.str());
    scores = mask_is_keep ? where(attn_mask.detach(), scores, -INFINITY) : add(scores, attn_mask);
  }
  Tensor weights;
  if (attn_mask.defined()) {
    // Note [Rows with every key masked]: weights of 0, and no gradient. Softmax runs on a
    // row of zeros there, so that nothing it computes is a NaN, and every other row's
    // bits are softmax's own.
    Tensor dead;
    {
      NoGradGuard no_grad;
      dead = eq(max(scores, -1, /*keepdim=*/true), -INFINITY);
    }
    weights = where(dead, 0.0, softmax(where(dead, 0.0, scores), -1));
  } else {
    weights = softmax(scores, -1);  // causal or unmasked: every row attends to a key
  }
  if (dropout_p > 0.0) weights = dropout(weights, dropout_p, true, gen ? *gen : default_generator());
  return matmul(weights, v);
}

}  // namespace dp::nn
