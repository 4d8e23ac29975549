// The fused path of scaled_dot_product_attention: which calls it takes, and the op over
// the backend's AttentionForward / AttentionBackward kernels.
//
// Note [Fused attention paths]
// scaled_dot_product_attention (src/nn/functional_sequence.cpp) runs the fused kernels
// (Note [Fused attention] in src/backend/cpu/cpu_attention.cpp) when the device's
// backend registers them (the CPU's; CUDA runs the math path) and the call fits them:
// float32 q, k, v of 3 dims (B, L, E) or 4 (B, H, L, E) with the same batch dims (no
// broadcasting between them), non-empty, no dropout, and no mask, is_causal, or a
// float32 mask (additive or keep) broadcastable to (batch dims, L, S) — the kernel reads
// it with stride 0 along its broadcast dims, so it is never expanded. Anything else —
// 16-bit inputs (autocast's lower-precision list), dropout, broadcast batch dims — runs
// the math path, which also makes every bad-input error what it was. The two paths
// give the same values up to float32 rounding: the fused one sums the softmax in blocks
// (tests/nn/attention_fused_test.cpp bounds the difference). set_attention_path forces
// either one, for tests and benchmarks.
#include "nn/fused_attention.h"

#include <atomic>
#include <vector>

#include "backend/backend.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/nn/functional.h"

namespace dp::nn {

namespace {
namespace be = dp::backend;

std::atomic<AttentionPath> g_attention_path{AttentionPath::Auto};

float* fptr(const Tensor& t) { return t.data<float>(); }

bool all_float32(std::initializer_list<Tensor> ts) {
  for (const Tensor& t : ts)
    if (t.dtype() != Dtype::Float32) return false;
  return true;
}

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
  m.p = fptr(mask);
  m.keep = keep;
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
                                   double dropout_p) {
  const Device dev = q.device();
  be::Backend& bk = be::get(dev);
  if (!bk.supports(be::Op::AttentionForward, be::DType::F32) || !bk.supports(be::Op::AttentionBackward, be::DType::F32))
    return "the " + dev.str() + " backend has no fused attention kernel";
  if (k.device() != dev || v.device() != dev) return "q, k and v are not on one device";
  if (!all_float32({q, k, v})) return "q, k and v are not all float32";
  if (dropout_p != 0.0) return "dropout_p is not 0";
  if (q.dim() < 3 || q.dim() > 4 || k.dim() != q.dim() || v.dim() != q.dim())
    return "q, k and v do not all have 3 or all 4 dims";
  for (std::int64_t d = 0; d + 2 < q.dim(); ++d)
    if (k.size(d) != q.size(d) || v.size(d) != q.size(d)) return "q, k and v have different batch dims";
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) return "q, k or v is empty";
  if (!attn_mask.defined()) return "";
  if (attn_mask.dtype() != Dtype::Float32 || attn_mask.device() != dev)
    return "attn_mask is not float32 on q's device";
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
                       bool is_causal, float scale) {
  const Device dev = q.device();
  const be::AttentionShape s = attention_shape(q, k, v);
  Shape out_shape = q.shape();
  out_shape.back() = s.Ev;
  Tensor out = empty(out_shape, dev);
  Tensor lse = empty({s.B * s.H * s.L}, dev);  // float32 per query row: all the backward keeps
  Tensor mask = attn_mask.defined() ? attn_mask.detach() : Tensor();
  be::get(dev).run<be::Op::AttentionForward>(
      dev, be::DType::F32,
      {s, fptr(q), fptr(k), fptr(v), attention_mask(mask, q.dim(), mask_is_keep), is_causal, scale, fptr(out),
       fptr(lse)});
  if (autograd::needs_grad({q, k, v})) {
    autograd::record(
        "ScaledDotProductAttentionBackward", {q, k, v}, out,
        [qs = q.detach(), ks = k.detach(), vs = v.detach(), mask, os = out.detach(), lse, s, mask_is_keep, is_causal,
         scale](const std::vector<Tensor>& g) {
          if (!g[0].defined()) return std::vector<Tensor>{Tensor(), Tensor(), Tensor()};
          DP_CHECK(g[0].shape() == os.shape() && g[0].dtype() == Dtype::Float32 && g[0].device() == os.device(),
                   "ScaledDotProductAttentionBackward: expected a float32 gradient of shape ", shape_str(os.shape()),
                   " on ", os.device().str(), ", got ", g[0].str());
          const Device d = os.device();
          Tensor gq = empty(qs.shape(), d), gk = empty(ks.shape(), d), gv = empty(vs.shape(), d);
          be::get(d).run<be::Op::AttentionBackward>(
              d, be::DType::F32,
              {s, fptr(qs), fptr(ks), fptr(vs), attention_mask(mask, qs.dim(), mask_is_keep), is_causal, scale,
               fptr(os), fptr(lse), fptr(g[0]), fptr(gq), fptr(gk), fptr(gv)});
          return std::vector<Tensor>{gq, gk, gv};
        });
  }
  return out;
}

}  // namespace detail
}  // namespace dp::nn
