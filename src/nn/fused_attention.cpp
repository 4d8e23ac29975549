// The fused path of scaled_dot_product_attention: which calls it takes, and the op over
// the backend's AttentionForward / AttentionBackward kernels.
//
// Note [Fused attention paths]
// scaled_dot_product_attention (src/nn/functional_sequence.cpp) runs the fused kernels
// (Note [Fused attention] in src/backend/cpu/cpu_attention.cpp, Note [Fused attention
// on CUDA] in src/backend/cuda/cuda_attention.cu) when the device's backend registers
// them for the call's dtype (the CPU's and CUDA's: float32, bfloat16, float16) and the
// call fits them: q, k, v of one floating dtype, 3 dims (B, L, E) or 4 (B, H, L, E) with
// the same batch dims (no broadcasting between them), non-empty, of a shape the backend's
// kernels take (Backend::attention_shape_misfit: CUDA's head dims E, Ev <= 128, within
// the GPU's shared memory); dropout_p < 1; and no mask, is_causal, or a mask
// broadcastable to (batch dims, L, S) — the kernel reads it with stride 0 along its
// broadcast dims, so it is never expanded — that is float32 or of q's dtype (a 16-bit
// one, as autocast casts it), except an additive float32 mask over 16-bit q, whose sum
// the math path promotes to a float32 result. Anything else — broadcast batch dims,
// mixed dtypes, head dims above a backend's limit, dropout_p = 1 (the dropout op zeroes
// everything without drawing) — runs the math path, which also makes every bad-input
// error what it was. The two paths give the same values up to
// rounding: the fused one sums the softmax in blocks and keeps every intermediate in
// float32, where the math path in a 16-bit dtype stores its scores and weights in 16 bits
// (tests/nn/attention_fused_test.cpp bounds the differences). With dropout both draw
// the same keep bits from the same generator state and advance it alike (by the number
// of weights), so they drop the same weights and the generator leaves either path in
// one state: a model's later draws, and the DP, DDP and sharded designs, stay alike
// whichever path ran. set_attention_path forces either one, for tests and benchmarks.
#include "nn/fused_attention.h"

#include <atomic>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/nn/functional.h"

namespace dp::nn {

namespace {
namespace be = dp::backend;

std::atomic<AttentionPath> g_attention_path{AttentionPath::Auto};

float* fptr(const Tensor& t) { return t.data<float>(); }

be::DType kernel_dtype(const Tensor& t) { return static_cast<be::DType>(t.dtype()); }

/// The kernels' geometry of a fitting call: a 3-d call is one head.
be::AttentionShape attention_shape(const Tensor& q, const Tensor& k, const Tensor& v) {
  const bool heads = q.dim() == 4;
  return {.B = q.size(0),
          .H = heads ? q.size(1) : 1,
          .L = q.size(-2),
          .S = k.size(-2),
          .E = q.size(-1),
          .Ev = v.size(-1)};
}

/// The mask's strides over (batch dims, L, S) (0 along a broadcast dim), as the kernel's
/// (B, H, L, S); all zero without a mask.
be::AttentionMask attention_mask(const Tensor& mask, std::int64_t q_dims, bool keep) {
  be::AttentionMask m;
  if (!mask.defined()) return m;
  std::vector<std::int64_t> strides(static_cast<std::size_t>(q_dims), 0);
  std::int64_t stride = 1;
  for (std::int64_t d = mask.dim() - 1; d >= 0; --d) {
    const auto at = static_cast<std::size_t>(q_dims - mask.dim() + d);
    strides[at] = mask.size(d) == 1 ? 0 : stride;
    stride *= mask.size(d);
  }
  m.p = mask.raw_data();
  m.keep = keep;
  m.dtype = kernel_dtype(mask);
  m.sb = strides[0];
  m.sh = q_dims == 4 ? strides[1] : 0;
  m.sl = strides[static_cast<std::size_t>(q_dims - 2)];
  m.ss = strides[static_cast<std::size_t>(q_dims - 1)];
  return m;
}

}  // namespace

void set_attention_path(AttentionPath path) { g_attention_path.store(path); }
AttentionPath attention_path() { return g_attention_path.load(); }

namespace detail {

std::string fused_attention_misfit(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                   bool mask_is_keep, double dropout_p) {
  const Device dev = q.device();
  if (k.device() != dev || v.device() != dev) return "q, k and v are not on one device";
  if (k.dtype() != q.dtype() || v.dtype() != q.dtype() || !is_floating_point(q.dtype()))
    return "q, k and v do not have one floating dtype";
  be::Backend& bk = be::get(dev);
  const be::DType dt = kernel_dtype(q);
  if (!bk.supports(be::Op::AttentionForward, dt) || !bk.supports(be::Op::AttentionBackward, dt))
    return std::string("the ") + dev.str() + " backend has no fused " + dtype_name(q.dtype()) + " attention kernel";
  if (dropout_p >= 1.0) return "dropout_p is 1";
  if (q.dim() < 3 || q.dim() > 4 || k.dim() != q.dim() || v.dim() != q.dim())
    return "q, k and v do not all have 3 or all 4 dims";
  for (std::int64_t d = 0; d + 2 < q.dim(); ++d)
    if (k.size(d) != q.size(d) || v.size(d) != q.size(d)) return "q, k and v have different batch dims";
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return "q, k or v is empty";
  if (std::string why = bk.attention_shape_misfit(dev, attention_shape(q, k, v)); !why.empty()) return why;
  if (!attn_mask.defined()) return "";
  // The kernels differentiate q, k and v only. A learned additive mask (a relative
  // position bias, ALiBi's slopes made trainable) needs its gradient, which the math
  // path's add gives: silently none would leave it untrained.
  if (!mask_is_keep && attn_mask.requires_grad() && is_grad_enabled())
    return "attn_mask requires a gradient (the fused kernels give none to the mask; the math path does)";
  if (attn_mask.device() != dev || (attn_mask.dtype() != Dtype::Float32 && attn_mask.dtype() != q.dtype()))
    return "attn_mask is neither float32 nor q's dtype on q's device";
  if (!mask_is_keep && attn_mask.dtype() != q.dtype())
    return "attn_mask is an additive float32 mask over 16-bit q (the math path's result is float32)";
  if (attn_mask.dim() > q.dim()) return "attn_mask has more dims than q";
  Shape target(q.shape().begin(), q.shape().end() - 1);
  target.push_back(k.size(-2));  // (batch dims, L, S)
  for (std::int64_t d = 0; d < attn_mask.dim(); ++d) {
    const std::int64_t want = target[static_cast<std::size_t>(q.dim() - attn_mask.dim() + d)];
    if (attn_mask.size(d) != 1 && attn_mask.size(d) != want) return "attn_mask does not broadcast to (batch, L, S)";
  }
  return "";
}

Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask, bool mask_is_keep,
                       bool is_causal, float scale, double dropout_p, Generator& gen) {
  const Device dev = q.device();
  const be::DType dt = kernel_dtype(q);
  const be::AttentionShape s = attention_shape(q, k, v);
  Shape out_shape = q.shape();
  out_shape.back() = s.Ev;
  Tensor out = empty(out_shape, TensorOptions{q.dtype(), dev});
  Tensor lse = empty({s.B * s.H * s.L}, dev);  // float32 per query row: all the backward keeps
  Tensor mask = attn_mask.defined() ? attn_mask.detach() : Tensor();
  be::AttentionDropout drop;
  if (dropout_p > 0.0) {
    // The dropout op's draws over the (B..., L, S) weights (Note [Fused attention paths]).
    drop = {.p = static_cast<float>(dropout_p), .seed = gen.seed(),
            .offset = gen.advance(static_cast<std::uint64_t>(s.B * s.H * s.L * s.S))};
  }
  be::get(dev).run<be::Op::AttentionForward>(
      dev, dt,
      {s, q.raw_data(), k.raw_data(), v.raw_data(), attention_mask(mask, q.dim(), mask_is_keep), is_causal, scale,
       drop, out.raw_data(), fptr(lse)});
  if (autograd::needs_grad({q, k, v})) {
    autograd::record(
        "ScaledDotProductAttentionBackward", {q, k, v}, out, {q, k, v, mask, out},
        [qs = q.detach(), ks = k.detach(), vs = v.detach(), mask, os = out.detach(), lse, s, dt, mask_is_keep,
         is_causal, scale, drop](const std::vector<Tensor>& g) {
          if (!g[0].defined()) return std::vector<Tensor>{Tensor(), Tensor(), Tensor()};
          DP_CHECK(g[0].shape() == os.shape() && g[0].dtype() == os.dtype() && g[0].device() == os.device(),
                   "ScaledDotProductAttentionBackward: expected a ", dtype_name(os.dtype()), " gradient of shape ",
                   shape_str(os.shape()), " on ", os.device().str(), ", got ", g[0].str());
          const Device d = os.device();
          const TensorOptions like{os.dtype(), d};
          Tensor gq = empty(qs.shape(), like), gk = empty(ks.shape(), like), gv = empty(vs.shape(), like);
          be::get(d).run<be::Op::AttentionBackward>(
              d, dt,
              {s, qs.raw_data(), ks.raw_data(), vs.raw_data(), attention_mask(mask, qs.dim(), mask_is_keep),
               is_causal, scale, drop, os.raw_data(), fptr(lse), g[0].raw_data(), gq.raw_data(), gk.raw_data(),
               gv.raw_data()});
          return std::vector<Tensor>{gq, gk, gv};
        });
  }
  return out;
}

}  // namespace detail
}  // namespace dp::nn
