// CPU backend: GEMM (dnnl_sgemm) and 2-d convolution (oneDNN primitives).
//
// Note [CPU convolution: measured choice]
// Measured with bench/kernels_bench on the 2-core AVX-512 host for the Fashion-MNIST
// CNN's convolutions (N=256, 3x3, pad 1), best of >= 3 runs, GFLOP/s at 1 thread. The
// host was shared with parallel compiles (load ~13 on 2 cores), so absolute figures are
// low and 2-thread figures were too noisy to rank; the 1-thread ratios were stable over
// two runs:
//                         fwd   bwd-data  bwd-weight
//   1->32 28x28  nchw     2.7-6.0  5.2-7.0  1.4-1.8
//                blocked  2.6-2.9  1.1      3.6-4.2
//   32->64 14x14 nchw     9-14     8-13     9-11
//                blocked  21-25    22-25    20-25
//   our im2col + one batched dnnl_sgemm (fwd only): 1.6-1.9 and 5.0-6.7
// (`kernels_bench --conv-layouts --filter conv2d` reruns the layout rows; the im2col
// variant has since left the benchmark.)
// So ConvLayout::Auto (the default) takes blocked layouts except forward and backward-
// data with few input channels, where the plain path wins. (At 2 threads the plain
// backward-weight of the 1-channel layer took seconds — a oneDNN gemm-conv reduction
// that collapses under contention — one more reason it is never chosen.)
// `Plain` hands NCHW/KCRS buffers to oneDNN as they are (oneDNN then runs its
// im2col + sgemm implementation, or its direct JIT kernel for the 1-channel input);
// `Blocked` lets oneDNN choose blocked layouts (format_tag::any) and reorders every
// input and output on each call, because our tensors are NCHW. Our own im2col +
// dnnl_sgemm would be what `Plain` already runs inside oneDNN, so it is not kept.
//
// Primitives are cached per device, keyed by shape, kind, layout and thread count
// (oneDNN fixes its blocking for the thread count at creation). Each device's cache
// has its own mutex and stream; different devices never share mutable oneDNN state
// (scratchpads are owned by the cache entry, scratchpad_mode::user).
#include <omp.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/cpu_backend.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

enum class ConvKind : std::uint8_t { Forward, BackwardData, BackwardWeight };

struct ConvKey {
  i64 dims[13];  // N C H W K R S stride_h stride_w pad_h pad_w P Q
  ConvKind kind;
  bool bias;
  int threads;
  ConvLayout layout;
  bool operator==(const ConvKey& o) const {
    return std::memcmp(dims, o.dims, sizeof dims) == 0 && kind == o.kind && bias == o.bias &&
           threads == o.threads && layout == o.layout;
  }
};

struct ConvKeyHash {
  std::size_t operator()(const ConvKey& k) const noexcept {
    std::size_t h = static_cast<std::size_t>(k.kind) * 31 + k.bias + static_cast<std::size_t>(k.threads) * 131 +
                    static_cast<std::size_t>(k.layout) * 7;
    for (i64 d : k.dims) h = h * 1000003u ^ static_cast<std::size_t>(d);
    return h;
  }
};

/// One primitive argument: the user's plain buffer, and when the primitive wants a
/// different layout, an internal buffer with a reorder into it (inputs) or out of it
/// (outputs).
struct ConvArg {
  int id;
  bool output;
  memory user;
  memory internal;  // empty when no reorder is needed
  dnnl::reorder reorder;
};

struct ConvEntry {
  dnnl::primitive prim;
  std::vector<ConvArg> args;
  memory scratchpad;
};

}  // namespace

struct ConvCache {
  std::mutex mu;
  dnnl::stream stream{cpu_engine()};
  std::unordered_map<ConvKey, std::unique_ptr<ConvEntry>, ConvKeyHash> entries;
};

void ConvCacheDeleter::operator()(ConvCache* cache) const noexcept { delete cache; }

namespace {

void add_arg(ConvEntry& e, int id, bool output, const memory::desc& user_md,
             const memory::desc& prim_md) {
  ConvArg a{id, output, memory(user_md, cpu_engine(), DNNL_MEMORY_NONE), memory(), dnnl::reorder()};
  if (prim_md != user_md) {
    a.internal = memory(prim_md, cpu_engine());  // oneDNN-owned buffer, reused every call
    a.reorder = output ? dnnl::reorder(a.internal, a.user) : dnnl::reorder(a.user, a.internal);
  }
  e.args.push_back(std::move(a));
}

std::unique_ptr<ConvEntry> build_entry(const Conv2dShape& s, ConvKind kind, bool bias,
                                       ConvLayout layout) {
  const memory::dims src{s.N, s.C, s.H, s.W}, wei{s.K, s.C, s.R, s.S}, dst{s.N, s.K, s.P, s.Q},
      bia{s.K}, strides{s.stride_h, s.stride_w}, pad{s.pad_h, s.pad_w};
  const auto dt = memory::data_type::f32;
  const memory::desc src_user(src, dt, tag::nchw), wei_user(wei, dt, tag::oihw),
      dst_user(dst, dt, tag::nchw), bias_md(bia, dt, tag::x);
  const bool plain = layout == ConvLayout::Plain;
  const memory::desc src_md = plain ? src_user : memory::desc(src, dt, tag::any);
  const memory::desc wei_md = plain ? wei_user : memory::desc(wei, dt, tag::any);
  const memory::desc dst_md = plain ? dst_user : memory::desc(dst, dt, tag::any);

  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto alg = dnnl::algorithm::convolution_direct;
  auto e = std::make_unique<ConvEntry>();

  // The forward descriptor also serves as the hint backward primitives require.
  const auto fwd_desc =
      bias && kind == ConvKind::Forward
          ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, src_md, wei_md,
                                            bias_md, dst_md, strides, pad, pad)
          : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, src_md, wei_md,
                                            dst_md, strides, pad, pad);
  const dnnl::convolution_forward::primitive_desc fwd_pd(fwd_desc, attr, cpu_engine());

  memory::desc scratch_md;
  switch (kind) {
    case ConvKind::Forward: {
      e->prim = dnnl::convolution_forward(fwd_pd);
      add_arg(*e, DNNL_ARG_SRC, false, src_user, fwd_pd.src_desc());
      add_arg(*e, DNNL_ARG_WEIGHTS, false, wei_user, fwd_pd.weights_desc());
      if (bias) add_arg(*e, DNNL_ARG_BIAS, false, bias_md, fwd_pd.bias_desc());
      add_arg(*e, DNNL_ARG_DST, true, dst_user, fwd_pd.dst_desc());
      scratch_md = fwd_pd.scratchpad_desc();
      break;
    }
    case ConvKind::BackwardData: {
      const dnnl::convolution_backward_data::desc d(alg, src_md, wei_md, dst_md, strides, pad, pad);
      const dnnl::convolution_backward_data::primitive_desc pd(d, attr, cpu_engine(), fwd_pd);
      e->prim = dnnl::convolution_backward_data(pd);
      add_arg(*e, DNNL_ARG_DIFF_DST, false, dst_user, pd.diff_dst_desc());
      add_arg(*e, DNNL_ARG_WEIGHTS, false, wei_user, pd.weights_desc());
      add_arg(*e, DNNL_ARG_DIFF_SRC, true, src_user, pd.diff_src_desc());
      scratch_md = pd.scratchpad_desc();
      break;
    }
    case ConvKind::BackwardWeight: {
      const auto d = bias ? dnnl::convolution_backward_weights::desc(alg, src_md, wei_md, bias_md,
                                                                     dst_md, strides, pad, pad)
                          : dnnl::convolution_backward_weights::desc(alg, src_md, wei_md, dst_md,
                                                                     strides, pad, pad);
      const dnnl::convolution_backward_weights::primitive_desc pd(d, attr, cpu_engine(), fwd_pd);
      e->prim = dnnl::convolution_backward_weights(pd);
      add_arg(*e, DNNL_ARG_SRC, false, src_user, pd.src_desc());
      add_arg(*e, DNNL_ARG_DIFF_DST, false, dst_user, pd.diff_dst_desc());
      add_arg(*e, DNNL_ARG_DIFF_WEIGHTS, true, wei_user, pd.diff_weights_desc());
      if (bias) add_arg(*e, DNNL_ARG_DIFF_BIAS, true, bias_md, pd.diff_bias_desc());
      scratch_md = pd.scratchpad_desc();
      break;
    }
  }
  e->scratchpad = memory(scratch_md, cpu_engine());
  return e;
}

/// Resolves ConvLayout::Auto (Note [CPU convolution: measured choice]): blocked layouts
/// win by ~2x once there are enough input channels to fill a 16-wide channel block; with
/// a handful of input channels (the first layer) plain NCHW wins forward and backward-
/// data, because the reorders of the large activations cost more than oneDNN saves.
ConvLayout resolve_layout(ConvLayout layout, const Conv2dShape& s, ConvKind kind) {
  constexpr i64 kFewChannels = 8;  // below half an AVX-512 channel block
  if (layout != ConvLayout::Auto) return layout;
  return s.C < kFewChannels && kind != ConvKind::BackwardWeight ? ConvLayout::Plain
                                                                : ConvLayout::Blocked;
}

void check_conv_shape(const Conv2dShape& s, const char* op) {
  DP_CHECK(s.N >= 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.K > 0 && s.R > 0 && s.S > 0 &&
               s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0,
           op, ": expected positive sizes and strides and non-negative padding, got N=", s.N,
           " C=", s.C, " H=", s.H, " W=", s.W, " K=", s.K, " R=", s.R, " S=", s.S, " stride=(",
           s.stride_h, ",", s.stride_w, ") pad=(", s.pad_h, ",", s.pad_w, ")");
  const i64 p = (s.H + 2 * s.pad_h - s.R) / s.stride_h + 1;
  const i64 q = (s.W + 2 * s.pad_w - s.S) / s.stride_w + 1;
  DP_CHECK(s.H + 2 * s.pad_h >= s.R && s.W + 2 * s.pad_w >= s.S && s.P == p && s.Q == q, op,
           ": expected output size (P, Q) = (", p, ", ", q, ") for input ", s.H, "x", s.W,
           ", kernel ", s.R, "x", s.S, ", got (", s.P, ", ", s.Q, ")");
}

/// Looks up (or builds) the primitive and runs it on the given buffers, in the order
/// the entry's args were added.
void run_conv(CpuBackend& be, Device dev, const Conv2dShape& s, ConvKind kind, bool bias,
              std::initializer_list<const void*> ptrs) {
  DeviceState& st = be.state(dev);
  const int threads = be.bind_omp_threads(dev);
  ConvKey key{{s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.P, s.Q},
              kind, bias, threads, resolve_layout(be.conv_layout(), s, kind)};
  ConvCache& cache = *st.conv;
  std::lock_guard<std::mutex> lock(cache.mu);  // one thread per device: uncontended
  auto it = cache.entries.find(key);
  if (it == cache.entries.end()) {
    try {
      it = cache.entries.emplace(key, build_entry(s, kind, bias, key.layout)).first;
    } catch (const dnnl::error& err) {
      DP_FAIL("conv2d on ", dev.str(), ": oneDNN could not create a primitive for N=", s.N, " C=",
              s.C, " H=", s.H, " W=", s.W, " K=", s.K, " R=", s.R, " S=", s.S, ": ", err.what());
    }
  }
  ConvEntry& e = *it->second;
  std::unordered_map<int, memory> args;
  auto p = ptrs.begin();
  for (ConvArg& a : e.args) {
    a.user.set_data_handle(const_cast<void*>(*p++));
    args.emplace(a.id, a.internal ? a.internal : a.user);
  }
  args.emplace(DNNL_ARG_SCRATCHPAD, e.scratchpad);
  for (ConvArg& a : e.args)
    if (!a.output && a.internal) a.reorder.execute(cache.stream, a.user, a.internal);
  e.prim.execute(cache.stream, args);
  for (ConvArg& a : e.args)
    if (a.output && a.internal) a.reorder.execute(cache.stream, a.internal, a.user);
  cache.stream.wait();
}

}  // namespace

ConvCache* new_conv_cache() { return new ConvCache(); }

void CpuBackend::set_conv_layout(ConvLayout layout) {
  std::lock_guard<std::mutex> lock(config_mu_);
  conv_layout_.store(layout);
  for (auto& d : devices_) {
    std::lock_guard<std::mutex> cl(d->conv->mu);
    d->conv->entries.clear();
  }
}

// ---- GEMM -----------------------------------------------------------------------------

void CpuBackend::gemm(Device dev, bool trans_a, bool trans_b, i64 m, i64 n, i64 k, float alpha,
                      const float* a, i64 lda, const float* b, i64 ldb, float beta, float* c,
                      i64 ldc) {
  DP_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm: expected non-negative m, n, k, got ", m, ", ", n,
           ", ", k);
  // Row-major storage: A is m×k (or k×m when transposed), so its row length is k (or m).
  DP_CHECK(lda >= std::max<i64>(1, trans_a ? m : k) && ldb >= std::max<i64>(1, trans_b ? k : n) &&
               ldc >= std::max<i64>(1, n),
           "gemm: leading dimensions too small: lda=", lda, " (need >= ", trans_a ? m : k,
           "), ldb=", ldb, " (need >= ", trans_b ? k : n, "), ldc=", ldc, " (need >= ", n, ")");
  (void)state(dev);
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta * C; beta == 0 overwrites (NaN in C must not survive)
    for (i64 i = 0; i < m; ++i)
      for (i64 j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  bind_omp_threads(dev);
  const dnnl_status_t status = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha,
                                          a, lda, b, ldb, beta, c, ldc);
  DP_CHECK(status == dnnl_success, "gemm on ", dev.str(), ": dnnl_sgemm failed with status ",
           static_cast<int>(status), " for m=", m, " n=", n, " k=", k);
}

// ---- convolution ------------------------------------------------------------------------

void CpuBackend::conv2d_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                                const float* bias, float* y) {
  check_conv_shape(s, "conv2d_forward");
  if (s.N == 0) return;
  if (bias) {
    run_conv(*this, dev, s, ConvKind::Forward, true, {x, w, bias, y});
  } else {
    run_conv(*this, dev, s, ConvKind::Forward, false, {x, w, y});
  }
}

void CpuBackend::conv2d_backward_data(Device dev, const Conv2dShape& s, const float* gy,
                                      const float* w, float* gx) {
  check_conv_shape(s, "conv2d_backward_data");
  if (s.N == 0) return;
  run_conv(*this, dev, s, ConvKind::BackwardData, false, {gy, w, gx});
}

void CpuBackend::conv2d_backward_weight(Device dev, const Conv2dShape& s, const float* x,
                                        const float* gy, float* gw, float* gbias) {
  check_conv_shape(s, "conv2d_backward_weight");
  if (s.N == 0) {  // an empty batch contributes nothing: overwrite with zeros
    std::memset(gw, 0, static_cast<std::size_t>(s.K * s.C * s.R * s.S) * sizeof(float));
    if (gbias) std::memset(gbias, 0, static_cast<std::size_t>(s.K) * sizeof(float));
    return;
  }
  if (gbias) {
    run_conv(*this, dev, s, ConvKind::BackwardWeight, true, {x, gy, gw, gbias});
  } else {
    run_conv(*this, dev, s, ConvKind::BackwardWeight, false, {x, gy, gw});
  }
}

}  // namespace dp::backend::cpu
