// CPU backend: 2-d convolution on oneDNN primitives, with its per-device primitive cache,
// the measured layout choice and the fused forwards (ReLU post-op; ReLU and 2x2 max-pool).
//
// Note [CPU convolution: measured choice]
// oneDNN runs a convolution either on our plain NCHW/KCRS buffers (`Plain`: its
// im2col + sgemm implementation, or a direct JIT kernel for 1-channel inputs) or in
// blocked layouts of its own choosing (`Blocked`: format_tag::any, and we reorder every
// input in and every output out on each call, because our tensors are NCHW). Which is
// faster depends on the CPU, the shape, the pass and the thread count, and no fixed rule
// held up across the machines measured (figures: docs/benchmarks/kernel-notes.md,
// "Convolution layouts"; kernels_bench --conv-layouts times both). So ConvLayout::Auto measures, like cuDNN's
// benchmark mode: on the first call of each (shape, pass, bias, thread count) it builds
// both primitives, runs them in back-to-back pairs on the call's own buffers (kTrials
// pairs; every output is overwritten by the final run), and keeps the old rule's choice
// (blocked, except forward and backward-data with few input channels) unless the other
// layout wins clearly: 10% faster at best and in most pairs.
//
// Reproducibility. The two layouts sum in different orders, so their results differ in
// the last bits; a choice that changed from run to run would change results from run to
// run. Hence:
// - the choice is made once per process for every device (the table below is process-
//   wide; a second device asking for a key being measured adopts the first's result),
//   so DP, DDP and single-device runs in one process run the same kernels, and DP ==
//   DDP stays bitwise;
// - it is recorded in a file, ${XDG_CACHE_HOME:-$HOME/.cache}/dp/conv-layouts-v1.txt,
//   one line per key (CPU model, family, model number and stepping, oneDNN's ISA on
//   it, oneDNN version, threads, shape, pass, bias, dtype) with the
//   choice and both times; every later process on the machine reads the choice instead
//   of measuring, so run N+1 computes bit for bit what run N did. Writers take an flock
//   and read what other processes appended since their last look before appending, so
//   concurrent processes agree on the first record. Only those new bytes are read: a
//   record of many thousand shapes (a fuzzer's) costs each new key its own line, not
//   the whole file again; a file that shrank or was replaced is read again whole;
//   DP_CONV_LAYOUT_CACHE=<file> puts the file elsewhere, DP_CONV_LAYOUT_CACHE=off keeps
//   choices in the process only (then only runs in one process are guaranteed equal);
// - set_conv_layout(Plain | Blocked) (benchmarks, tests) bypasses the choice entirely.
// Delete the file to re-measure (after a oneDNN upgrade the key changes by itself).
//
// Primitives are cached per device, keyed by the chunk's shape, kind, layout and chunk
// index (Note [oneDNN in the device's arena]; every primitive is created and run on one
// thread). Each entry has its own stream, scratchpad (scratchpad_mode::user) and reorder
// buffers, so chunks of one call run concurrently and different devices never share
// mutable oneDNN state.
#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"
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

using ConvKind = ConvPass;

struct ConvKey {
  i64 dims[14];  // N C H W K R S stride_h stride_w pad_h pad_w P Q (of the chunk), channels_last
  ConvKind kind;
  bool bias;
  int slot;  // the chunk's index: every chunk has its own primitive, buffers and stream
  ConvLayout layout;
  bool relu = false;  // forward with the ReLU post-op (Note [Convolution + ReLU])
  DType dtype = DType::F32;  // of x, w, y (Note [bf16 convolutions through oneDNN])
  bool operator==(const ConvKey& o) const {
    return std::memcmp(dims, o.dims, sizeof dims) == 0 && kind == o.kind && bias == o.bias &&
           slot == o.slot && layout == o.layout && relu == o.relu && dtype == o.dtype;
  }
};

struct ConvKeyHash {
  std::size_t operator()(const ConvKey& k) const noexcept {
    std::size_t h = static_cast<std::size_t>(k.kind) * 31 + k.bias + static_cast<std::size_t>(k.slot) * 131 +
                    static_cast<std::size_t>(k.layout) * 7 + (k.relu ? 17u : 0u) +
                    static_cast<std::size_t>(k.dtype) * 257;
    for (i64 d : k.dims) h = h * 1000003u ^ static_cast<std::size_t>(d);
    return h;
  }
};

// Note [bfloat16 blocked reorders]
// oneDNN's blocked convolutions want activations in a layout of their own: nChw16c on
// AVX-512 (each image's channels in blocks of 16, a block's 16 values of one pixel side
// by side), NHWC for the AMX kernels (all of a pixel's channels side by side). Our
// tensors are NCHW, so every blocked call reorders its activation inputs in and its
// outputs out (Note [CPU convolution: measured choice]). oneDNN 2.6 runs float32
// reorders of those shapes in its blocked-reorder kernel but bfloat16 ones in its
// generic one, which moved about 2-4 GB/s and took a ninth of the bfloat16 CNN step, as
// much time per tensor as the float32 reorders of twice the bytes; on an AMX Xeon the
// NCHW <-> NHWC ones took a sixth (figures: docs/benchmarks/kernel-notes.md, "bfloat16
// blocked reorders"). Both are transposes: between NCHW and nChw16c each block of 16
// channels is a 16 x HW matrix transposed, between NCHW and NHWC each image is a C x HW
// one. So a bfloat16 argument with either layout (nChw16c: a multiple of 16 channels) is
// moved by transpose_copy's 16x16 register blocks instead; any other reorder stays
// oneDNN's. A reorder moves bits, so the primitives see the same operands, which
// set_own_conv_reorders(false) (tests) checks against oneDNN's own reorders.

/// An activation argument that transpose_copy can move between NCHW and the
/// primitive's layout (Note [bfloat16 blocked reorders]): N images of C channels of HW
/// pixels, into nChw16c (C a multiple of 16) or NHWC, elements of `esize` bytes (2:
/// bfloat16, 4: float32).
struct OwnReorder {
  enum class Into { None, NChw16c, Nhwc } into = Into::None;
  i64 N = 0, C = 0, HW = 0;
  int esize = 2;
};

/// Whether transpose_copy moves the 16-bit activations (the default) or oneDNN's
/// reorders do (set_own_conv_reorders(false), for tests).
std::atomic<bool> own_reorders{true};

/// One primitive argument: the user's plain buffer, and when the primitive wants a
/// different layout, an internal buffer with a reorder into it (inputs) or out of it
/// (outputs).
struct ConvArg {
  int id;
  bool output;
  memory user;
  memory internal;  // empty when no reorder is needed
  dnnl::reorder reorder;  // oneDNN's reorder
  OwnReorder own;         // the reorder transpose_copy can run, where it applies
  /// internal's buffer, ours rather than oneDNN's: a memory that owns its buffer frees it
  /// when set_data_handle points it elsewhere (Note [Convolution backward in one call]
  /// points one primitive's gy at another's).
  std::unique_ptr<void, void (*)(void*)> buffer{nullptr, std::free};
  /// Whether transpose_copy can move this argument (tests may say no to all).
  bool movable() const { return own.into != OwnReorder::Into::None && own_reorders.load(std::memory_order_relaxed); }
  /// Whether every call moves it by transpose_copy: bfloat16 arguments (oneDNN 2.6 moves
  /// float32 ones with its blocked-reorder kernel already).
  bool by_own() const { return movable() && own.esize == 2; }
};

struct ConvEntry {
  dnnl::primitive prim;
  /// A ReLU entry whose primitive carries the post-op; false when oneDNN would have
  /// run another implementation with it, and the entry is the plain convolution.
  bool relu_fused = false;
  std::vector<ConvArg> args;
  memory scratchpad;
  dnnl::stream stream{cpu_engine()};  // one per entry: chunks run on different threads
};

}  // namespace

struct ConvCache {
  std::mutex mu;  // guards the maps; an entry is used by one chunk task at a time
  std::unordered_map<ConvKey, std::unique_ptr<ConvEntry>, ConvKeyHash> entries;
  /// Backward-weight partial sums of chunks 1.. (chunk 0 writes the output itself).
  std::vector<std::vector<float>> partials;
  /// Per chunk, the convolution output of one group of images before it is pooled
  /// (Note [Convolution, ReLU and max-pool in one pass]).
  std::vector<std::vector<float>> pool_groups;
  /// The forward implementation oneDNN picks per shape (layout in the key; slot 0).
  std::unordered_map<ConvKey, std::string, ConvKeyHash> forward_impls;
  /// ConvLayout::Auto keys (layout Auto) -> the layout chosen for them, so a step looks
  /// the choice up here without touching the process-wide record.
  std::unordered_map<ConvKey, ConvLayout, ConvKeyHash> chosen;
  /// Forward Auto keys -> whether the Blocked layout is refused for them (Note [Blocked
  /// forward with a stride above the kernel]), decided on the first call.
  std::unordered_map<ConvKey, bool, ConvKeyHash> refused;
};

void ConvCacheDeleter::operator()(ConvCache* cache) const noexcept { delete cache; }

namespace {

/// Whether the reorder between user_md and prim_md is a bfloat16 or float32 NCHW <->
/// nChw16c or NCHW <-> NHWC one that transpose_copy can run (Note [bfloat16 blocked
/// reorders]).
OwnReorder own_reorder_of(const memory::desc& user_md, const memory::desc& prim_md) {
  const memory::dims d = user_md.dims();
  const auto dt = user_md.data_type();
  if (d.size() != 4 || (dt != memory::data_type::bf16 && dt != memory::data_type::f32) ||
      user_md != memory::desc(d, dt, tag::nchw))
    return {};
  OwnReorder r{.into = OwnReorder::Into::None, .N = d[0], .C = d[1], .HW = d[2] * d[3],
               .esize = dt == memory::data_type::f32 ? 4 : 2};
  if (d[1] % 16 == 0 && prim_md == memory::desc(d, dt, tag::nChw16c)) {
    r.into = OwnReorder::Into::NChw16c;
  } else if (prim_md == memory::desc(d, dt, tag::nhwc)) {
    r.into = OwnReorder::Into::Nhwc;
  }
  return r.into == OwnReorder::Into::None ? OwnReorder{} : r;
}

/// The reorder of Note [bfloat16 blocked reorders]: NCHW `from` into the primitive's
/// layout `to`, or back when `to_plain`; T is the element's bits.
template <typename T>
void reorder_own_typed(const OwnReorder& r, const void* from, void* to, bool to_plain) {
  const auto* src = static_cast<const T*>(from);
  auto* dst = static_cast<T*>(to);
  for (i64 n = 0; n < r.N; ++n) {
    if (r.into == OwnReorder::Into::Nhwc) {  // C x HW <-> HW x C, at the image's offset either way
      const i64 at = n * r.C * r.HW;
      if (to_plain) {
        transpose_copy(src + at, r.C, r.HW, r.C, dst + at, r.HW);
      } else {
        transpose_copy(src + at, r.HW, r.C, r.HW, dst + at, r.C);
      }
      continue;
    }
    for (i64 c = 0; c < r.C; c += 16) {
      const i64 plain = (n * r.C + c) * r.HW, blocked = plain;  // the same offset: 16 x HW either way
      if (to_plain) {
        transpose_copy(src + blocked, 16, r.HW, 16, dst + plain, r.HW);
      } else {
        transpose_copy(src + plain, r.HW, 16, r.HW, dst + blocked, 16);
      }
    }
  }
}
void reorder_own(const OwnReorder& r, const void* from, void* to, bool to_plain) {
  if (r.esize == 4) {
    reorder_own_typed<float>(r, from, to, to_plain);
  } else {
    reorder_own_typed<std::uint16_t>(r, from, to, to_plain);
  }
}

void add_arg(ConvEntry& e, int id, bool output, const memory::desc& user_md,
             const memory::desc& prim_md) {
  ConvArg a{id, output, memory(user_md, cpu_engine(), DNNL_MEMORY_NONE), memory(), dnnl::reorder(), OwnReorder{}};
  if (prim_md != user_md) {
    // A buffer of the entry's, reused every call; 64-byte aligned, as oneDNN's own.
    const std::size_t bytes = (std::max<std::size_t>(prim_md.get_size(), 1) + 63) / 64 * 64;
    a.buffer.reset(std::aligned_alloc(64, bytes));
    if (!a.buffer) throw std::bad_alloc();
    a.internal = memory(prim_md, cpu_engine(), a.buffer.get());
    a.own = own_reorder_of(user_md, prim_md);
    a.reorder = output ? dnnl::reorder(a.internal, a.user) : dnnl::reorder(a.user, a.internal);
  }
  e.args.push_back(std::move(a));
}

/// Runs argument a's reorder: into the primitive's layout (an input) or out of it.
void run_reorder(ConvArg& a, dnnl::stream& stream) {
  if (a.by_own()) {
    if (a.output) {
      reorder_own(a.own, a.internal.get_data_handle(), a.user.get_data_handle(), true);
    } else {
      reorder_own(a.own, a.user.get_data_handle(), a.internal.get_data_handle(), false);
    }
  } else if (a.output) {
    a.reorder.execute(stream, a.internal, a.user);
  } else {
    a.reorder.execute(stream, a.user, a.internal);
  }
}

/// The memory descriptors of a convolution: the user's plain tensors, and what the
/// primitive is asked for (the same, or format `any` for the blocked layouts).
struct ConvMds {
  memory::dims strides, pad;
  memory::desc src_user, wei_user, dst_user, bias_md, src_md, wei_md, dst_md;
};

ConvMds conv_mds(const Conv2dShape& s, ConvLayout layout, DType dtype) {
  const memory::dims src{s.N, s.C, s.H, s.W}, wei{s.K, s.C, s.R, s.S}, dst{s.N, s.K, s.P, s.Q}, bia{s.K};
  const auto dt = dtype == DType::BF16 ? memory::data_type::bf16 : memory::data_type::f32;
  ConvMds m;
  m.strides = {s.stride_h, s.stride_w};
  m.pad = {s.pad_h, s.pad_w};
  // Activations as they lie: NCHW, or N x H x W x C for a channels-last call (Note
  // [Channels-last tensors]); oneDNN takes either as the user's layout.
  const tag act = s.channels_last ? tag::nhwc : tag::nchw;
  m.src_user = memory::desc(src, dt, act);
  m.wei_user = memory::desc(wei, dt, tag::oihw);
  m.dst_user = memory::desc(dst, dt, act);
  m.bias_md = memory::desc(bia, dt, tag::x);
  const bool plain = layout == ConvLayout::Plain;
  m.src_md = plain ? m.src_user : memory::desc(src, dt, tag::any);
  // A channels-last call's Plain layout is its own N x H x W x C activations with the
  // weights in a layout of oneDNN's choosing: its NHWC kernels take no KCRS weights
  // (with them oneDNN 2.6 runs its reference kernel, a thousand times slower).
  m.wei_md = plain && !s.channels_last ? m.wei_user : memory::desc(wei, dt, tag::any);
  m.dst_md = plain ? m.dst_user : memory::desc(dst, dt, tag::any);
  return m;
}

/// The forward descriptor of a convolution (with a bias input when `bias`).
dnnl::convolution_forward::desc forward_desc(const ConvMds& m, bool bias) {
  const auto alg = dnnl::algorithm::convolution_direct;
  return bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, m.src_md, m.wei_md,
                                                m.bias_md, m.dst_md, m.strides, m.pad, m.pad)
              : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, alg, m.src_md, m.wei_md,
                                                m.dst_md, m.strides, m.pad, m.pad);
}

/// The name of the implementation oneDNN picks for the plain forward convolution `s`.
std::string forward_impl(const Conv2dShape& s, bool bias, ConvLayout layout, DType dtype) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return dnnl::convolution_forward::primitive_desc(forward_desc(conv_mds(s, layout, dtype), bias), attr,
                                                   cpu_engine())
      .impl_info_str();
}

std::unique_ptr<ConvEntry> build_entry(const Conv2dShape& s, ConvKind kind, bool bias,
                                       ConvLayout layout, bool relu, DType dtype) {
  const ConvMds m = conv_mds(s, layout, dtype);
  const memory::desc &src_user = m.src_user, &wei_user = m.wei_user, &dst_user = m.dst_user,
                     &bias_md = m.bias_md, &src_md = m.src_md, &wei_md = m.wei_md, &dst_md = m.dst_md;
  const memory::dims &strides = m.strides, &pad = m.pad;

  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto alg = dnnl::algorithm::convolution_direct;
  auto e = std::make_unique<ConvEntry>();

  // The forward descriptor also serves as the hint backward primitives require.
  const auto fwd_desc = forward_desc(m, bias && kind == ConvKind::Forward);
  dnnl::convolution_forward::primitive_desc fwd_pd(fwd_desc, attr, cpu_engine());
  if (relu) {
    // Note [Convolution + ReLU]: clip to [0, +inf) as the post-op, and only where it
    // leaves oneDNN's choice of implementation (hence the summation order) unchanged.
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_clip, 0.0f, INFINITY);
    dnnl::primitive_attr relu_attr = attr;
    relu_attr.set_post_ops(ops);
    dnnl::convolution_forward::primitive_desc relu_pd(fwd_desc, relu_attr, cpu_engine(), true);
    const std::string impl = fwd_pd.impl_info_str();
    const bool direct_jit = impl.find("gemm") == std::string::npos && impl.rfind("ref", 0) != 0;
    if (direct_jit && relu_pd && std::string(relu_pd.impl_info_str()) == impl &&
        relu_pd.src_desc() == fwd_pd.src_desc() && relu_pd.weights_desc() == fwd_pd.weights_desc() &&
        relu_pd.dst_desc() == fwd_pd.dst_desc()) {
      fwd_pd = relu_pd;
      e->relu_fused = true;
    }
  }

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
      // The weight and bias gradients accumulate and land in float32 whatever the
      // operands' dtype (Note [bf16 convolutions through oneDNN]).
      const ConvMds f = conv_mds(s, layout, DType::F32);
      const auto d = bias ? dnnl::convolution_backward_weights::desc(alg, src_md, f.wei_md, f.bias_md,
                                                                     dst_md, strides, pad, pad)
                          : dnnl::convolution_backward_weights::desc(alg, src_md, f.wei_md, dst_md,
                                                                     strides, pad, pad);
      const dnnl::convolution_backward_weights::primitive_desc pd(d, attr, cpu_engine(), fwd_pd);
      e->prim = dnnl::convolution_backward_weights(pd);
      add_arg(*e, DNNL_ARG_SRC, false, src_user, pd.src_desc());
      add_arg(*e, DNNL_ARG_DIFF_DST, false, dst_user, pd.diff_dst_desc());
      add_arg(*e, DNNL_ARG_DIFF_WEIGHTS, true, f.wei_user, pd.diff_weights_desc());
      if (bias) add_arg(*e, DNNL_ARG_DIFF_BIAS, true, f.bias_md, pd.diff_bias_desc());
      scratch_md = pd.scratchpad_desc();
      break;
    }
  }
  e->scratchpad = memory(scratch_md, cpu_engine());
  return e;
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

/// The cached primitive for `key` on this device, built on first use.
/// The key of convolution `s` (a chunk's or a group's shape) in a ConvCache.
ConvKey conv_key(const Conv2dShape& s, ConvKind kind, bool bias, int slot, ConvLayout layout, bool relu = false,
                 DType dtype = DType::F32) {
  return ConvKey{{s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride_h, s.stride_w, s.pad_h, s.pad_w, s.P, s.Q,
                  s.channels_last ? 1 : 0},
                 kind, bias, slot, layout, relu, dtype};
}

ConvEntry& find_entry(ConvCache& cache, const ConvKey& key, const Conv2dShape& s, Device dev) {
  auto it = cache.entries.find(key);
  if (it == cache.entries.end()) {
    try {
      it = cache.entries.emplace(key, build_entry(s, key.kind, key.bias, key.layout, key.relu, key.dtype)).first;
    } catch (const dnnl::error& err) {
      DP_FAIL("conv2d on ", dev.str(), ": oneDNN could not create a primitive for N=", s.N, " C=",
              s.C, " H=", s.H, " W=", s.W, " K=", s.K, " R=", s.R, " S=", s.S, ": ", err.what());
    }
  }
  return *it->second;
}

/// Runs the entry on the given buffers (in the order its args were added): reorders in,
/// the primitive, reorders out, and waits. `filled`: the id of an input whose internal
/// buffer already holds it in the primitive's layout (Note [Convolution backward in one
/// call]); its reorder is skipped.
void execute_entry(ConvEntry& e, const void* const* ptrs, int filled = -1) {
  dnnl::stream& stream = e.stream;
  std::unordered_map<int, memory> args;
  const void* const* p = ptrs;
  for (ConvArg& a : e.args) {
    a.user.set_data_handle(const_cast<void*>(*p++));
    args.emplace(a.id, a.internal ? a.internal : a.user);
  }
  args.emplace(DNNL_ARG_SCRATCHPAD, e.scratchpad);
  if (Backend::poison_memory()) {  // Note [Poisoned memory]
    auto fill = [](const memory& m) {
      if (const std::size_t bytes = m.get_desc().get_size(); bytes > 0) std::memset(m.get_data_handle(), 0xff, bytes);
    };
    fill(e.scratchpad);
    for (const ConvArg& a : e.args)
      if (a.output) fill(a.internal ? a.internal : a.user);
  }
  for (ConvArg& a : e.args)
    if (!a.output && a.internal && a.id != filled) run_reorder(a, stream);
  e.prim.execute(stream, args);
  if (std::any_of(e.args.begin(), e.args.end(), [](const ConvArg& a) { return a.output && a.by_own(); }))
    stream.wait();  // the primitive's output is complete before transpose_copy reads it
  for (ConvArg& a : e.args)
    if (a.output && a.internal) run_reorder(a, stream);
  stream.wait();
}

// ---- the measured choice (Note [CPU convolution: measured choice]) ----------------------

/// Back-to-back pairs of runs (plain, blocked) when measuring. Five: two pairs disturbed
/// by other processes are outvoted, and measuring the largest layer of the Fashion-MNIST
/// CNN costs about what four training steps do, once per machine.
constexpr int kTrials = 5;
/// How much faster the other layout must run to overrule the prior: 10%, above the
/// spread of best-of-3 times on a quiet machine (a few percent).
constexpr double kClearWin = 1.1;
/// Input channels below which the prior is the plain layout for forward and backward-
/// data: half an AVX-512 channel block; the large activations' reorders cost more than
/// blocking saves.
constexpr i64 kFewChannels = 8;

/// The CPU as the record key names it: its model name, family, model and stepping (a
/// virtual machine may call CPUs of different generations by one generic name, "Intel(R)
/// Xeon(R) Processor"), and the instruction set oneDNN runs on it (AMX or not changes
/// the winner).
std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string name = "unknown-cpu", family = "?", model = "?", stepping = "?";
  auto value = [](const std::string& line) {
    const auto colon = line.find(':');
    std::string v = colon == std::string::npos ? line : line.substr(colon + 1);
    v.erase(0, v.find_first_not_of(" \t"));
    for (char& c : v)
      if (c == ' ' || c == '|') c = '_';
    return v;
  };
  for (std::string line; std::getline(in, line) && !line.empty();) {  // the first processor's block
    if (line.rfind("model name", 0) == 0) name = value(line);
    else if (line.rfind("cpu family", 0) == 0) family = value(line);
    else if (line.rfind("model", 0) == 0 && line.find(':') != std::string::npos) model = value(line);
    else if (line.rfind("stepping", 0) == 0) stepping = value(line);
  }
  std::ostringstream key;  // the ISA as dnnl_cpu_isa_t's bits: 0x3e7 is avx512_core_amx
  key << name << "|f" << family << "m" << model << "s" << stepping << "|isa0x" << std::hex
      << static_cast<unsigned>(dnnl::get_effective_cpu_isa());
  return key.str();
}

// Note [Backward weight as one product]
// oneDNN 2.6's backward-weight kernels for channels-last activations reduce over N·P·Q,
// which at ResNet-18's last stages is a few hundred rows: on the AMX Xeon the
// 512-channel 3x3 layer at 4x4 (32 images a chunk) took 15 ms a call in
// jit:avx512_core_amx_bf16, 80 GFLOP/s against ~700 at 32x32, and those passes were half
// of oneDNN's time in the channels-last bfloat16 ResNet-18 step. The pass is one product:
// with col the N·P·Q x R·S·C matrix of the input's windows (im2col: row (n, p, q) holds
// x[n, p·sh - ph + r, q·sw - pw + s, :] for each (r, s) in order, zeros outside the
// image — runs of C contiguous values of an NHWC input), gW (K x R·S·C) = gyᵀ col, gy
// being the N·P·Q x K matrix a channels-last gradient is: gyᵀ (transpose_copy; an NCHW
// gradient's images are already K x P·Q) times col, bfloat16 through oneDNN's bfloat16
// matmul into a float32 C (gemm_bf16_f32out, no rounding: the caller rounds gW once, as
// for oneDNN's kernels), float32 through the float32 GEMM. Then gW is moved into K x C x
// R x S and the bias gradient is gyᵀ's row sums (in double, in order). The whole batch is
// one product, no chunks; its order of sums is fixed by the shape and the device's
// threads (the GEMM's slabs), so runs and designs stay bitwise alike. The backward-data
// pass of the same layers (7.4 ms a chunk at 4x4, 160 GFLOP/s) is the transposed product
// and an im2col's adjoint: gcol (N·P·Q x R·S·C, float32) = gy W, W moved to K x R x S x C,
// then each input pixel's channels the sum of the taps that read it, in (r, s) order,
// rounded once. An NCHW call's other activations are moved into N x H x W x C copies first
// (and backward-data's gx back), transposes small beside the passes they replace at these
// shapes. Both are a third candidate of the measured choice (Note [CPU convolution:
// measured choice]) for backward passes whose matrix fits kGemmColBytes, kept where
// they win clearly (as Plain must against the prior); elsewhere the two layouts as
// before. The forward as a product (col Wᵀ, W's transpose through the matmul) lost to
// oneDNN's brgconv at every ResNet-18 shape and is not a candidate. set_conv_layout(Gemm)
// forces the product where it applies (tests). Figures: docs/benchmarks/kernel-notes.md,
// "Backward weight as one product" (the 4x4 layer's passes 19.4 -> 4.3 ms and 7.7 -> 5.7
// ms a batch; the step 1.30x).

/// The largest matrix a product pass may take, col or gcol (Note [Backward weight as one
/// product]); larger passes are oneDNN's.
constexpr i64 kGemmColBytes = i64{64} << 20;

/// Whether a pass may run as one product (Note [Backward weight as one product]): a
/// backward-weight pass (its im2col matrix in x's dtype) or backward-data pass (its column
/// gradient in float32) whose matrix fits kGemmColBytes.
bool gemm_pass_eligible(const Conv2dShape& s, ConvKind kind, DType dtype) {
  if (kind == ConvKind::Forward || s.N == 0) return false;
  if (dtype != DType::F32 && !(dtype == DType::BF16 && has_bf16_matmul())) return false;
  const i64 esize = dtype == DType::F32 || kind == ConvKind::BackwardData ? 4 : 2;
  return s.N * s.P * s.Q * s.R * s.S * s.C * esize <= kGemmColBytes;
}

/// The record key of one call: everything that decides which layout is faster.
std::string choice_key(const Conv2dShape& s, ConvKind kind, bool bias, int threads, DType dtype) {
  static const std::string machine = [] {
    const dnnl_version_t* v = dnnl_version();
    return cpu_model() + "|onednn-" + std::to_string(v->major) + "." + std::to_string(v->minor) +
           "." + std::to_string(v->patch);
  }();
  std::ostringstream k;
  k << machine << "|t" << threads << "|N" << s.N << ",C" << s.C << ",H" << s.H << ",W" << s.W
    << ",K" << s.K << ",R" << s.R << ",S" << s.S << ",st" << s.stride_h << "x" << s.stride_w
    << ",pad" << s.pad_h << "x" << s.pad_w << "|"
    << (kind == ConvKind::Forward ? "fwd" : kind == ConvKind::BackwardData ? "bwd-data" : "bwd-weight")
    << (bias ? "+bias" : "") << (dtype == DType::BF16 ? "|bf16" : "")  // float32 keys as before
    << (s.channels_last ? "|nhwc" : "")
    // Passes with a third candidate (Note [Backward weight as one product]): records made
    // before it existed are not theirs.
    << (gemm_pass_eligible(s, kind, dtype) ? "|gemm" : "");
  return k.str();
}

/// Process-wide record of measured choices, mirrored in the cache file.
class LayoutChoices {
 public:
  static LayoutChoices& get() {
    static LayoutChoices choices;
    return choices;
  }

  /// The recorded choice for `key`, or Auto.
  ConvLayout find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    load_once();
    auto it = map_.find(key);
    return it == map_.end() ? ConvLayout::Auto : it->second;
  }

  /// Records `measured` for `key` unless a choice is already recorded (by another device
  /// of this process or another process): returns the choice that stands.
  /// ms_gemm < 0: the product was not a candidate.
  ConvLayout record(const std::string& key, ConvLayout measured, double ms_plain,
                    double ms_blocked, double ms_gemm) {
    std::lock_guard<std::mutex> lock(mu_);
    load_once();
    if (auto it = map_.find(key); it != map_.end()) return it->second;
    ConvLayout chosen = measured;
    if (!path_.empty()) chosen = append_to_file(key, measured, ms_plain, ms_blocked, ms_gemm);
    map_.emplace(key, chosen);
    return chosen;
  }

 private:
  LayoutChoices() {
    const char* env = std::getenv("DP_CONV_LAYOUT_CACHE");
    if (env && std::string(env) == "off") return;
    if (env && *env) {
      path_ = env;
    } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
      path_ = std::string(xdg) + "/dp/conv-layouts-v1.txt";
    } else if (const char* home = std::getenv("HOME"); home && *home) {
      path_ = std::string(home) + "/.cache/dp/conv-layouts-v1.txt";
    }
  }

  static bool parse_line(const std::string& line, std::string& key, ConvLayout& layout) {
    std::istringstream in(line);
    std::string choice;
    if (!(in >> key >> choice)) return false;
    if (choice == "plain") {
      layout = ConvLayout::Plain;
    } else if (choice == "blocked") {
      layout = ConvLayout::Blocked;
    } else if (choice == "gemm") {
      layout = ConvLayout::Gemm;
    } else {
      return false;
    }
    return true;
  }

  /// Takes every whole line of `text`, which starts at byte read_to_ of the file, and
  /// moves read_to_ past the last of them. A line still being written (no newline yet:
  /// load_once reads without the lock) is left for the next look.
  void take_lines(std::string_view text) {
    const std::size_t end = text.rfind('\n');
    if (end == std::string_view::npos) return;
    std::istringstream in{std::string(text.substr(0, end + 1))};
    std::string key;
    ConvLayout layout;
    for (std::string line; std::getline(in, line);)
      if (parse_line(line, key, layout)) map_.emplace(key, layout);  // first record stands
    read_to_ += static_cast<std::int64_t>(end + 1);
  }

  /// Reads `fd` from read_to_ to its end (from 0 when the file is not the one read
  /// before, or shrank) and takes its whole lines.
  void read_new_lines(int fd) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return;
    if (st.st_dev != file_dev_ || st.st_ino != file_ino_ || st.st_size < read_to_) {
      file_dev_ = st.st_dev;
      file_ino_ = st.st_ino;
      read_to_ = 0;
    }
    if (st.st_size == read_to_) return;
    std::string text;
    char buf[1 << 16];
    for (off_t at = static_cast<off_t>(read_to_);;) {
      const ssize_t n = ::pread(fd, buf, sizeof buf, at);
      if (n <= 0) break;
      text.append(buf, static_cast<std::size_t>(n));
      at += n;
    }
    take_lines(text);
  }

  void load_once() {
    if (loaded_ || path_.empty()) return;
    loaded_ = true;
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    read_new_lines(fd);
    ::close(fd);
  }

  /// Under an exclusive flock: reads what was appended since the last look (another
  /// process may have recorded the key since), appends our line if it did not, returns
  /// the choice that stands. Any failure leaves the choice in this process only.
  ConvLayout append_to_file(const std::string& key, ConvLayout measured, double ms_plain,
                            double ms_blocked, double ms_gemm) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path_).parent_path(), ec);
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
      warn_once("cannot open");
      return measured;
    }
    ConvLayout chosen = measured;
    if (::flock(fd, LOCK_EX) == 0) {
      read_new_lines(fd);
      if (auto it = map_.find(key); it != map_.end()) {
        chosen = it->second;
      } else {
        std::ostringstream line;
        line << key << ' '
             << (measured == ConvLayout::Plain ? "plain" : measured == ConvLayout::Gemm ? "gemm" : "blocked")
             << " plain_ms=" << ms_plain << " blocked_ms=" << ms_blocked;
        if (ms_gemm >= 0) line << " gemm_ms=" << ms_gemm;
        line << '\n';
        const std::string l = line.str();
        if (::write(fd, l.data(), l.size()) != static_cast<ssize_t>(l.size())) {
          warn_once("cannot write");
        } else if (struct stat st {}; ::fstat(fd, &st) == 0 && st.st_ino == file_ino_ && st.st_dev == file_dev_ &&
                   st.st_size == read_to_ + static_cast<std::int64_t>(l.size())) {
          read_to_ = st.st_size;  // under the lock nothing else was written: our line is taken
        }
      }
      ::flock(fd, LOCK_UN);
    } else {
      warn_once("cannot lock");
    }
    ::close(fd);
    return chosen;
  }

  void warn_once(const char* what) {
    if (warned_) return;
    warned_ = true;
    dp::detail::log_warning(dp::detail::str_cat(
        "conv2d: ", what, " the convolution layout record ", path_,
        "; layouts measured in this process are used in it only (Note [CPU convolution: "
        "measured choice]); set DP_CONV_LAYOUT_CACHE to a writable file"));
  }

  std::mutex mu_;
  std::string path_;
  bool loaded_ = false;
  bool warned_ = false;
  std::unordered_map<std::string, ConvLayout> map_;
  // How far the file has been read (the end of its last whole line taken), and which
  // file that was.
  std::int64_t read_to_ = 0;
  dev_t file_dev_ = 0;
  ino_t file_ino_ = 0;
};


/// Every buffer of one convolution call; each pass uses its own subset. x, w, b, y, gy
/// and gx hold `dtype`; gw and gb are float32 (a bfloat16 call's are rounded by its caller,
/// Note [bf16 convolutions through oneDNN]).
struct ConvBuffers {
  DType dtype = DType::F32;
  const void* x = nullptr;
  const void* w = nullptr;
  const void* b = nullptr;
  void* y = nullptr;
  const void* gy = nullptr;
  void* gx = nullptr;
  float* gw = nullptr;
  float* gb = nullptr;
  // Forward with a 2x2 max-pool after the ReLU: y is unused, the pooled output (in
  // `dtype`) and the winners' places land here (Note [Convolution, ReLU and max-pool in
  // one pass]).
  void* pooled = nullptr;
  std::uint8_t* where = nullptr;
};

// Note [Convolution + ReLU]
// A Conv2d followed by a ReLU (nn::conv2d_relu; nn::Sequential finds the pair) runs as
// one convolution whose output passes through a post-op before it is stored: no
// second pass over the activation, no second activation. The result must be what
// conv2d_forward followed by Unary<Relu> computes, bit for bit. As found with oneDNN
// 2.6 (AVX2 JIT for blocked layouts, gemm:jit for plain ones):
// - only oneDNN's direct JIT kernels apply the post-op in registers. Its gemm-based
//   convolution (the plain layout) runs it as a scalar reference loop, many times
//   slower than the unfused pair (figures: docs/benchmarks/kernel-notes.md, "Convolution +
//   ReLU"). So only a direct JIT implementation is fused, and only where the post-op
//   leaves the implementation and layouts unchanged (build_entry checks both); any
//   other entry is the plain convolution, and its chunk applies Unary<Relu> in place
//   right after it (vectorised, in the chunk's task; no second activation);
// - eltwise_relu is not exact: the gemm path writes alpha * x = -0.0f for a negative x
//   where Unary<Relu> writes +0.0f. eltwise_clip to [0, +inf) writes +0.0f, and equals
//   Unary<Relu> on every non-NaN float (-0.0f apart: oneDNN's max gives +0.0f, ours
//   keeps -0.0f; a sum that starts from +0.0f never yields -0.0f);
// - both post-ops turn NaN into 0, where Unary<Relu> (and PyTorch) propagate it. So a
//   chunk runs unfused when its input, weight or bias holds a NaN or an infinity, and
//   also when a NaN could be made from finite values: a product overflowing to -inf
//   in a sum that already reached +inf (or the reverse) — possible where a kernel
//   rounds each product before adding it (no FMA; with FMA the chain stays +-inf, but
//   nothing here depends on the ISA oneDNN picks). Every product and every
//   partial sum of an output is bounded by max|b| + C·R·S · max|w| · max|x|; the
//   chunk is fused only when that bound is below FLT_MAX / 2 (room for rounding), so
//   no infinity, hence no NaN, can arise in a fused chunk. The maxima come from the
//   same pass that looks for NaN (the bits of |v| order like |v|), so the fused op
//   equals the unfused pair on every input.
// Backward (nn::conv2d_relu) masks the upstream gradient by the output > 0, as
// ReluBackward does with the same output, then runs the convolution's backward;
// nn::conv2d_relu_max_pool2d masks the pooled gradient instead (Note [ReLU mask
// through max-pool] in src/nn/functional.cpp).

/// |v| from max_abs_bits, as a double (+inf for an infinity or a NaN).
double abs_of_bits(std::uint32_t bits) {
  if (bits >= 0x7f800000u) return std::numeric_limits<double>::infinity();
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}


// Note [Convolution, ReLU and max-pool in one pass]
// Conv2d, ReLU, MaxPool2d(2) — the block of most small CNNs — wrote the convolution's
// output (25.7 MB for the Fashion-MNIST CNN's first layer at batch 256) only for the
// pool to read it back from memory and keep a quarter of it. Backward needs neither
// that output (the ReLU's mask is taken on the pooled output, Note [ReLU mask through
// max-pool]) nor more of the pool than its winners' places (Note [Max-pool winners in
// a byte]). So the Conv2d kernel, given a ReLU and a 2x2 pool (Conv2dArgs::pool; Note
// [Fusions are the backend's] in ops.h), convolves each chunk's images a group at
// a time into a scratch block that fits a core's L2, applies the ReLU there when the
// post-op did not, and pools the group before the next one overwrites it: the
// convolution's output never reaches memory. A group is an ordinary oneDNN call on
// fewer images; within one implementation an image's outputs do not depend on how
// many others share its call, and where a group size would get another
// implementation than the whole chunk (oneDNN picks by shape) the groups double until
// they agree, at worst to the whole chunk. So the pooled values and places are those of
// conv2d_relu_forward followed by maxpool2d_2x2_forward, bit for bit (cpu_backend_test,
// and nn's functional_test against the three ops, gradients included). It shortens the
// CNN's step; groups of 256 KiB to 1 MiB did alike, one group per chunk (no scratch in
// cache) did worse than the separate ops (figures: docs/benchmarks/kernel-notes.md,
// "Convolution, ReLU and max-pool in one pass").

/// Bytes of convolution output per group of images in the pooled forward.
constexpr i64 kPoolGroupBytes = i64{512} << 10;

/// How many batch chunks a call on a device of `threads` threads runs (Note [oneDNN in
/// the device's arena]): a function of the shape and the thread count only.
int conv_chunks(const Conv2dShape& s, int threads) {
  const i64 macs = s.N * s.K * s.P * s.Q * s.C * s.R * s.S;
  if (threads <= 1 || s.N < 2 || macs < 2 * kMinChunkMacs) return 1;
  return static_cast<int>(std::min<i64>({static_cast<i64>(threads), s.N, macs / kMinChunkMacs}));
}

/// y = max(y, 0) in place, Unary<Relu>'s values: a convolution's ReLU that its
/// primitive did not apply (Note [Convolution + ReLU]).
template <typename T>
void relu_in_place(T* __restrict y, i64 n) {
  const Unary<UnaryOp::Relu> f;
  for (i64 j = 0; j < n; ++j) y[j] = T(f(static_cast<float>(y[j])));
}
/// The same on bfloat16 bits, vectorised: a negative number becomes +0, a NaN the NaN
/// that rounding gives (0xFFFF), everything else (-0 included) stays.
void relu_in_place(BFloat16* __restrict y, i64 n) {
  auto* u = reinterpret_cast<std::uint16_t*>(y);
  for (i64 j = 0; j < n; ++j) {
    const std::uint16_t mag = u[j] & 0x7FFFu;
    const std::uint16_t kept = (u[j] & 0x8000u) && mag != 0 ? std::uint16_t{0} : u[j];
    u[j] = mag > 0x7F80u ? std::uint16_t{0xFFFF} : kept;
  }
}

/// Sizes the backward-weight partial sums of `chunks` chunks, the first `first_partial`
/// of which write the output themselves.
void size_partials(ConvCache& cache, const Conv2dShape& s, int chunks, int first_partial) {
  const i64 nw = s.K * s.C * s.R * s.S;
  std::lock_guard<std::mutex> lock(cache.mu);
  const auto n = static_cast<std::size_t>(chunks - first_partial);
  if (cache.partials.size() < n) cache.partials.resize(n);
  for (std::size_t c = 0; c < n; ++c) cache.partials[c].resize(static_cast<std::size_t>(nw + s.K));
}

/// The weight and bias gradients from the chunks' partial sums, added in chunk order, so
/// the sum depends on the chunk count only.
void sum_partials(ConvCache& cache, const Conv2dShape& s, bool bias, int chunks, int first_partial,
                  const ConvBuffers& buf) {
  const i64 nw = s.K * s.C * s.R * s.S;
  if (first_partial == 0) {
    std::memcpy(buf.gw, cache.partials[0].data(), static_cast<std::size_t>(nw) * sizeof(float));
    if (bias) std::memcpy(buf.gb, cache.partials[0].data() + nw, static_cast<std::size_t>(s.K) * sizeof(float));
  }
  for (int c = 1; c < chunks; ++c) {
    const float* __restrict part = cache.partials[static_cast<std::size_t>(c - first_partial)].data();
    float* __restrict gw = buf.gw;
    for (i64 i = 0; i < nw; ++i) gw[i] += part[i];
    if (bias)
      for (i64 i = 0; i < s.K; ++i) buf.gb[i] += part[nw + i];
  }
}

/// Runs one convolution as `chunks` batch slices, one oneDNN primitive each on one
/// thread, in the device's arena. Backward-weight sums the chunks' partial gradients in
/// chunk order, so the result depends on the chunk count, never on scheduling.
void run_chunks(CpuBackend& be, Device dev, ConvCache& cache, const Conv2dShape& s, ConvKind kind,
                bool bias, ConvLayout layout, int chunks, const ConvBuffers& buf, bool relu = false) {
  bool relu_post = relu;  // the ReLU as oneDNN's post-op where it is exact
  const i64 chw = s.C * s.H * s.W, kpq = s.K * s.P * s.Q, nw = s.K * s.C * s.R * s.S;
  const bool f32 = buf.dtype == DType::F32;
  const i64 esize = f32 ? 4 : 2;  // bytes per element of x, w, y, gy, gx
  auto at = [esize](const void* p, i64 i) {
    return static_cast<char*>(const_cast<void*>(p)) + i * esize;
  };
  // Chunks 1.. of a float32 weight gradient, every chunk of a bfloat16 one: partial sums.
  const int first_partial = f32 ? 1 : 0;
  const bool partial = kind == ConvKind::BackwardWeight && (chunks > 1 || !f32);
  if (partial) size_partials(cache, s, chunks, first_partial);
  // Note [Convolution + ReLU]: the weight and bias are bounded once per call, each
  // chunk's input slice in its task; a bound that is not finite never fuses. A bfloat16
  // forward applies the ReLU after the convolution.
  if (!f32) relu_post = false;
  const double max_w = relu_post ? abs_of_bits(max_abs_bits(static_cast<const float*>(buf.w), nw)) : 0.0;
  const double max_b = relu_post && bias ? abs_of_bits(max_abs_bits(static_cast<const float*>(buf.b), s.K)) : 0.0;
  const double terms = static_cast<double>(s.C * s.R * s.S);
  const bool pooled = kind == ConvKind::Forward && buf.pooled != nullptr;
  // A bfloat16 pool applies the ReLU to each element as it loads it (Note [bfloat16
  // max-pool on its bits]): no pass of its own over the group.
  const bool relu_in_pool = pooled && !f32;
  // Images per group of the pooled path: the group's convolution output stays in a
  // core's L2 until it is pooled.
  const i64 group = pooled ? std::clamp<i64>(kPoolGroupBytes / (kpq * esize), 1,
                                             std::max<i64>(1, s.N / chunks))
                           : 0;
  // The fused ReLU's bound for images [n0, n0 + n) (Note [Convolution + ReLU]).
  auto relu_fuses = [&](i64 n0, i64 n) {
    return relu_post &&
           max_b + terms * max_w * abs_of_bits(max_abs_bits(static_cast<const float*>(buf.x) + n0 * chw, n * chw)) <
               static_cast<double>(std::numeric_limits<float>::max()) / 2;
  };
  auto entry_for = [&](const Conv2dShape& sc, i64 c, bool try_fused) -> ConvEntry& {
    const ConvKey key = conv_key(sc, kind, bias, static_cast<int>(c), layout, try_fused, buf.dtype);
    std::lock_guard<std::mutex> lock(cache.mu);
    return find_entry(cache, key, sc, dev);
  };
  // The forward of images [n0, n0 + n) into y, chunk c's primitive for n images, then
  // the ReLU in place where the post-op did not apply it (Note [Convolution + ReLU]).
  auto forward = [&](i64 c, i64 n0, i64 n, void* y) {
    Conv2dShape sc = s;
    sc.N = n;
    ConvEntry& e = entry_for(sc, c, relu_fuses(n0, n));
    const void* ptrs[4] = {};
    int i = 0;
    ptrs[i++] = at(buf.x, n0 * chw);
    ptrs[i++] = buf.w;
    if (bias) ptrs[i++] = buf.b;
    ptrs[i++] = y;
    execute_entry(e, ptrs);
    if (relu && !e.relu_fused && !relu_in_pool) {
      if (f32) {
        relu_in_place(static_cast<float*>(y), n * kpq);
      } else {
        relu_in_place(static_cast<BFloat16*>(y), n * kpq);
      }
    }
  };
  // Whether n images convolve as their groups of g do: the same oneDNN implementation
  // for the call on all n and for the calls on g and on n % g of them.
  auto groups_agree = [&](i64 n, i64 g) {
    auto impl = [&](i64 images) -> const std::string& {
      Conv2dShape sc = s;
      sc.N = images;
      const ConvKey key = conv_key(sc, ConvKind::Forward, bias, 0, layout, false, buf.dtype);
      std::lock_guard<std::mutex> lock(cache.mu);
      auto it = cache.forward_impls.find(key);
      if (it == cache.forward_impls.end())
        it = cache.forward_impls.emplace(key, forward_impl(sc, bias, layout, buf.dtype)).first;
      return it->second;
    };
    const std::string& whole = impl(n);
    return impl(g) == whole && (n % g == 0 || impl(n % g) == whole);
  };
  // Per chunk, the images convolved per call: `group`, or the smallest of 2, 4, ...
  // times it whose groups compute the chunk's bits, or the whole chunk.
  std::vector<i64> steps;
  if (pooled) {
    i64 most = 0;
    for (int c = 0; c < chunks; ++c) {
      const i64 n = s.N * (c + 1) / chunks - s.N * c / chunks;
      i64 g = std::min(group, n);
      while (g < n && !groups_agree(n, g)) g = std::min(2 * g, n);
      steps.push_back(g);
      most = std::max(most, g);
    }
    std::lock_guard<std::mutex> lock(cache.mu);
    if (cache.pool_groups.size() < static_cast<std::size_t>(chunks)) cache.pool_groups.resize(chunks);
    for (int c = 0; c < chunks; ++c) cache.pool_groups[c].resize(static_cast<std::size_t>((most * kpq * esize + 3) / 4));
  }
  be.parallel_chunks(dev, chunks, [&](i64 c) {
    omp_set_num_threads(1);  // per thread: this thread's oneDNN calls make no team
    const i64 n0 = s.N * c / chunks, n1 = s.N * (c + 1) / chunks;
    if (pooled) {
      float* out = cache.pool_groups[static_cast<std::size_t>(c)].data();
      const i64 step = steps[static_cast<std::size_t>(c)];
      const i64 pq = (s.P / 2) * (s.Q / 2);
      const Pool2dShape ps{0, s.K, s.P, s.Q, 2, 2, 2, 2, 0, 0, s.P / 2, s.Q / 2};
      for (i64 g0 = n0; g0 < n1; g0 += step) {
        const i64 n = std::min(step, n1 - g0);
        forward(c, g0, n, out);
        std::uint8_t* where = buf.where + g0 * s.K * pq;
        if (f32) {
          maxpool_2x2_planes(ps, out, static_cast<float*>(buf.pooled) + g0 * s.K * pq, where, 0, n * s.K);
        } else {  // Note [16-bit max-pool]
          maxpool_2x2_planes(ps, reinterpret_cast<const BFloat16*>(out),
                             static_cast<BFloat16*>(buf.pooled) + g0 * s.K * pq, where, 0, n * s.K, relu);
        }
      }
      return;
    }
    if (kind == ConvKind::Forward) {
      forward(c, n0, n1 - n0, at(buf.y, n0 * kpq));
      return;
    }
    Conv2dShape sc = s;
    sc.N = n1 - n0;
    ConvEntry& e = entry_for(sc, c, false);
    const void* ptrs[4] = {};
    switch (kind) {
      case ConvKind::Forward:
        break;  // above
      case ConvKind::BackwardData:
        ptrs[0] = at(buf.gy, n0 * kpq);
        ptrs[1] = buf.w;
        ptrs[2] = at(buf.gx, n0 * chw);
        break;
      case ConvKind::BackwardWeight: {
        const bool own = c < first_partial;  // chunk 0 of a float32 call writes the output
        float* gw = own ? buf.gw : cache.partials[static_cast<std::size_t>(c - first_partial)].data();
        float* gb = own ? buf.gb : gw + nw;
        ptrs[0] = at(buf.x, n0 * chw);
        ptrs[1] = at(buf.gy, n0 * kpq);
        ptrs[2] = gw;
        ptrs[3] = gb;
        break;
      }
    }
    execute_entry(e, ptrs);
  });
  if (partial) sum_partials(cache, s, bias, chunks, first_partial, buf);
}

/// The key of a whole call's layout choice in ConvCache::chosen (`slot` holds the
/// device's thread count).
ConvKey auto_key_of(const Conv2dShape& s, ConvKind kind, bool bias, int threads, DType dtype) {
  return conv_key(s, kind, bias, threads, ConvLayout::Auto, false, dtype);
}

// Note [Blocked forward with a stride above the kernel]
// oneDNN 2.6's brgemm convolution forward (`brgconv:`, which the Blocked layout runs for
// bfloat16 on a Xeon with AMX) sizes its buffer of copied input rows for a vertical stride
// of at most the kernel's height, so with stride_h > R it writes past that buffer: wrong
// outputs, or the heap corrupted and the process aborted (malloc: "invalid size") — found
// on that Xeon (2026-12-01) by a scan with 16 to 128 channels, after the narrow scans of
// Note [bf16 backward-weight on an image narrower than its stride] had run clean. Of 540
// geometries (C = K = 16, 64, 128; R 1-3; stride_h 1-4; S 1, 3, 7; stride_w 1-3; four
// images of 14 x 20), 23 were wrong or crashed, every one with stride_h > R and a
// `brgconv:` primitive; none with stride_h <= R, none in the Plain layout, none in its 1x1
// kernel (`brgconv_1x1:`, a ResNet's strided shortcut). So a forward with stride_h > R
// whose Blocked primitive would be `brgconv:` (for the call's images, its chunks' or one)
// runs in the Plain layout, whatever the layout asked for; oneDNN's own name for the
// kernel decides, so other CPUs and dtypes are covered when they pick it. Such shapes
// skip rows of the input (a kernel shorter than its stride), rare outside strided 1x1
// convolutions. A channels-last call's Plain layout runs that kernel too (its activations
// are the kernel's own NHWC), so such a call convolves NCHW copies of its activations
// instead (run_forward_through_nchw): two transposes, and the NCHW call's Plain kernel.
// cpu_backend_test runs a sweep of them in the Blocked layout, every pass against
// float32, with unwritten memory poisoned, NCHW and channels-last.
bool blocked_forward_refused(CpuBackend& be, Device dev, const Conv2dShape& s, bool bias, DType dtype) {
  if (s.stride_h <= s.R || s.N < 1) return false;
  ConvCache& cache = *be.state(dev).conv;
  const int threads = be.threads_per_device(dev);
  const ConvKey call = auto_key_of(s, ConvKind::Forward, bias, threads, dtype);
  std::lock_guard<std::mutex> lock(cache.mu);
  if (auto known = cache.refused.find(call); known != cache.refused.end()) return known->second;
  bool refused = false;
  const i64 chunks = conv_chunks(s, threads);
  for (const i64 images : {s.N, i64{1}, (s.N + chunks - 1) / chunks, s.N / chunks}) {
    if (images < 1 || refused) continue;
    Conv2dShape sc = s;
    sc.N = images;
    const ConvKey key = conv_key(sc, ConvKind::Forward, bias, 0, ConvLayout::Blocked, false, dtype);
    auto it = cache.forward_impls.find(key);
    if (it == cache.forward_impls.end())
      it = cache.forward_impls.emplace(key, forward_impl(sc, bias, ConvLayout::Blocked, dtype)).first;
    refused = it->second.rfind("brgconv:", 0) == 0;
  }
  cache.refused.emplace(call, refused);
  return refused;
}

/// A block of the device's memory for the duration of a call.
struct DeviceBlock {
  DeviceBlock(CpuBackend& be, Device dev, std::size_t bytes)
      : be_(be), dev_(dev), bytes_(std::max<std::size_t>(bytes, 1)) {
    ptr_ = be.allocate(dev, bytes_);
  }
  ~DeviceBlock() { be_.deallocate(dev_, ptr_, bytes_); }
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  CpuBackend& be_;
  Device dev_;
  std::size_t bytes_;
  void* ptr_ = nullptr;
};

/// col (N·P·Q x R·S·C, elements of esize bytes) of the N x H x W x C input x: each row
/// the windows of one output pixel, taps in (r, s) order, zeros outside the image.
void im2col(CpuBackend& be, Device dev, const Conv2dShape& s, const void* xv, i64 esize, char* col) {
  const i64 PQ = s.P * s.Q, M = s.N * PQ, J = s.R * s.S * s.C;
  const auto* x = static_cast<const char*>(xv);
  const std::size_t run = static_cast<std::size_t>(s.C * esize);  // one pixel's channels
  be.parallel_for(dev, M, std::max<i64>(1, 4096 / std::max<i64>(1, J)), [&](i64 m0, i64 m1) {
    for (i64 m = m0; m < m1; ++m) {
      const i64 n = m / PQ, p = m % PQ / s.Q, q = m % s.Q;
      char* row = col + m * J * esize;
      for (i64 r = 0; r < s.R; ++r) {
        const i64 h = p * s.stride_h - s.pad_h + r;
        for (i64 t = 0; t < s.S; ++t) {
          const i64 w = q * s.stride_w - s.pad_w + t;
          char* dst = row + (r * s.S + t) * s.C * esize;
          if (h < 0 || h >= s.H || w < 0 || w >= s.W) {
            std::memset(dst, 0, run);  // +0 in float32 and bfloat16
          } else {
            std::memcpy(dst, x + ((n * s.H + h) * s.W + w) * s.C * esize, run);
          }
        }
      }
    }
  });
}

/// An N x C x HW tensor moved into N x HW x C (to_nhwc) or back, images in parallel.
void move_nhwc(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, i64 esize, const void* from, void* to,
               bool to_nhwc) {
  be.parallel_for(dev, N, 1, [&](i64 n0, i64 n1) {
    const OwnReorder r{
        .into = OwnReorder::Into::Nhwc, .N = n1 - n0, .C = C, .HW = HW, .esize = static_cast<int>(esize)};
    const i64 at = n0 * C * HW * esize;
    reorder_own(r, static_cast<const char*>(from) + at, static_cast<char*>(to) + at, /*to_plain=*/!to_nhwc);
  });
}

/// The product passes' view of an activation: itself when the call is channels-last, else
/// an N x HW x C copy of the NCHW tensor (moved in when `in`).
class NhwcView {
 public:
  NhwcView(CpuBackend& be, Device dev, const Conv2dShape& s, i64 C, i64 HW, i64 esize, const void* data, bool in)
      : data_(const_cast<void*>(data)) {
    if (s.channels_last) return;
    copy_.emplace(be, dev, static_cast<std::size_t>(s.N * C * HW * esize));
    if (in) move_nhwc(be, dev, s.N, C, HW, esize, data, copy_->as<char>(), true);
    data_ = copy_->as<char>();
  }
  void* get() const { return data_; }

 private:
  std::optional<DeviceBlock> copy_;
  void* data_;
};

/// A backward-weight pass as one product (Note [Backward weight as one product]): buf.x
/// and buf.gy of buf.dtype (channels-last, or NCHW moved into copies that are) into the
/// float32 buf.gw (K x C x R x S) and, with `bias`, buf.gb (K).
void backward_weight_gemm(CpuBackend& be, Device dev, const Conv2dShape& s, bool bias, const ConvBuffers& buf) {
  const bool f32 = buf.dtype == DType::F32;
  const i64 esize = f32 ? 4 : 2;
  const i64 PQ = s.P * s.Q, M = s.N * PQ, RS = s.R * s.S, J = RS * s.C, K = s.K;
  const NhwcView x(be, dev, s, s.C, s.H * s.W, esize, buf.x, true);
  DeviceBlock col(be, dev, static_cast<std::size_t>(M * J * esize));
  im2col(be, dev, s, x.get(), esize, col.as<char>());
  // gyᵀ (K x M): an N x P x Q x K gradient transposed, an NCHW one's images side by side.
  DeviceBlock gyt(be, dev, static_cast<std::size_t>(K * M * esize));
  if (s.channels_last) {
    be.parallel_for(dev, M, std::max<i64>(16, 16384 / std::max<i64>(1, K)), [&](i64 m0, i64 m1) {
      if (f32) {
        transpose_copy(static_cast<const float*>(buf.gy) + m0 * K, K, m1 - m0, K, gyt.as<float>() + m0, M);
      } else {
        transpose_copy(static_cast<const std::uint16_t*>(buf.gy) + m0 * K, K, m1 - m0, K,
                       gyt.as<std::uint16_t>() + m0, M);
      }
    });
  } else {
    be.parallel_for(dev, K, 1, [&](i64 k0, i64 k1) {
      for (i64 k = k0; k < k1; ++k)
        for (i64 n = 0; n < s.N; ++n)
          std::memcpy(gyt.as<char>() + (k * M + n * PQ) * esize,
                      static_cast<const char*>(buf.gy) + ((n * K + k) * PQ) * esize,
                      static_cast<std::size_t>(PQ * esize));
    });
  }
  // out (K x J, float32) = gyᵀ col.
  DeviceBlock out(be, dev, static_cast<std::size_t>(K * J) * sizeof(float));
  if (f32) {
    be.gemm(dev, false, false, K, J, M, 1.0f, gyt.as<const float>(), M, col.as<const float>(), J, 0.0f,
            out.as<float>(), J);
  } else {
    const bool ran = gemm_bf16_f32out(be, dev, K, J, M, gyt.as<const std::uint16_t>(), M,
                                      col.as<const std::uint16_t>(), J, out.as<float>(), J);
    DP_CHECK(ran, "conv2d_backward_weight on ", dev.str(), ": no bfloat16 matmul on this CPU for the product path");
  }
  // gW[k, c, (r, s)] = out[k, (r, s), c]; gb[k] = gyᵀ's row k summed in order, in double.
  be.parallel_for(dev, K, 1, [&](i64 k0, i64 k1) {
    for (i64 k = k0; k < k1; ++k) {
      transpose_copy(out.as<const float>() + k * J, s.C, RS, s.C, buf.gw + k * J, RS);
      if (!bias) continue;
      double acc = 0;
      for (i64 m = 0; m < M; ++m) {
        const i64 i = k * M + m;
        acc += f32 ? static_cast<double>(gyt.as<const float>()[i])
                   : static_cast<double>(static_cast<float>(BFloat16::from_bits(gyt.as<const std::uint16_t>()[i])));
      }
      buf.gb[k] = static_cast<float>(acc);
    }
  });
}

/// The K x C x R x S weight w (elements of esize bytes) as K x R x S x C, into out.
void weight_krsc(CpuBackend& be, Device dev, const Conv2dShape& s, const void* w, i64 esize, char* out) {
  const i64 RS = s.R * s.S, J = RS * s.C;
  be.parallel_for(dev, s.K, 1, [&](i64 k0, i64 k1) {
    for (i64 k = k0; k < k1; ++k) {  // C x RS -> RS x C
      if (esize == 4) {
        transpose_copy(static_cast<const float*>(w) + k * J, RS, s.C, RS, reinterpret_cast<float*>(out) + k * J, s.C);
      } else {
        transpose_copy(static_cast<const std::uint16_t*>(w) + k * J, RS, s.C, RS,
                       reinterpret_cast<std::uint16_t*>(out) + k * J, s.C);
      }
    }
  });
}

/// A backward-data pass as one product (Note [Backward weight as one product]): gcol
/// (N·P·Q x R·S·C, float32) = gy (N·P·Q x K) W (K x R·S·C: the weight's K x C x R x S
/// moved to K x R x S x C), then each input pixel's channels the sum of the taps that read
/// it, in (r, s) order, rounded once into buf.gx (an NCHW call's gx through an N x H x W
/// x C copy).
void backward_data_gemm(CpuBackend& be, Device dev, const Conv2dShape& s, const ConvBuffers& buf) {
  const bool f32 = buf.dtype == DType::F32;
  const i64 esize = f32 ? 4 : 2;
  const i64 PQ = s.P * s.Q, M = s.N * PQ, RS = s.R * s.S, J = RS * s.C, K = s.K;
  const NhwcView gy_view(be, dev, s, K, PQ, esize, buf.gy, true);
  const NhwcView gx_view(be, dev, s, s.C, s.H * s.W, esize, buf.gx, false);
  // W as K x (r, s, c), in the weight's dtype.
  DeviceBlock w(be, dev, static_cast<std::size_t>(K * J * esize));
  weight_krsc(be, dev, s, buf.w, esize, w.as<char>());
  DeviceBlock gcol(be, dev, static_cast<std::size_t>(M * J) * sizeof(float));
  if (f32) {
    be.gemm(dev, false, false, M, J, K, 1.0f, static_cast<const float*>(gy_view.get()), K, w.as<const float>(), J, 0.0f,
            gcol.as<float>(), J);
  } else {
    const bool ran = gemm_bf16_f32out(be, dev, M, J, K, static_cast<const std::uint16_t*>(gy_view.get()), K,
                                      w.as<const std::uint16_t>(), J, gcol.as<float>(), J);
    DP_CHECK(ran, "conv2d_backward_data on ", dev.str(), ": no bfloat16 matmul on this CPU for the product path");
  }
  // col2im as a gather: input pixel (n, h, w) collects tap (r, s) of output pixel (p, q)
  // where p·sh - ph + r = h and q·sw - pw + s = w.
  const i64 HW = s.H * s.W;
  be.parallel_for(dev, s.N * HW, std::max<i64>(1, 2048 / std::max<i64>(1, s.C * RS)), [&](i64 i0, i64 i1) {
    std::vector<float> acc(static_cast<std::size_t>(s.C));
    for (i64 i = i0; i < i1; ++i) {
      const i64 n = i / HW, h = i % HW / s.W, x = i % s.W;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (i64 r = 0; r < s.R; ++r) {
        const i64 ph = h + s.pad_h - r;
        if (ph < 0 || ph % s.stride_h != 0 || ph / s.stride_h >= s.P) continue;
        for (i64 t = 0; t < s.S; ++t) {
          const i64 qw = x + s.pad_w - t;
          if (qw < 0 || qw % s.stride_w != 0 || qw / s.stride_w >= s.Q) continue;
          const float* g = gcol.as<const float>() + ((n * s.P + ph / s.stride_h) * s.Q + qw / s.stride_w) * J +
                           (r * s.S + t) * s.C;
          for (i64 c = 0; c < s.C; ++c) acc[static_cast<std::size_t>(c)] += g[c];
        }
      }
      if (f32) {
        std::memcpy(static_cast<float*>(gx_view.get()) + i * s.C, acc.data(),
                    static_cast<std::size_t>(s.C) * sizeof(float));
      } else {
        auto* gx = static_cast<BFloat16*>(gx_view.get()) + i * s.C;
        for (i64 c = 0; c < s.C; ++c) gx[c] = BFloat16(acc[static_cast<std::size_t>(c)]);
      }
    }
  });
  if (!s.channels_last) move_nhwc(be, dev, s.N, s.C, s.H * s.W, esize, gx_view.get(), buf.gx, false);
}

/// A pass as one product (Note [Backward weight as one product]).
void run_gemm_pass(CpuBackend& be, Device dev, const Conv2dShape& s, ConvKind kind, bool bias, const ConvBuffers& buf) {
  if (kind == ConvKind::BackwardWeight) {
    backward_weight_gemm(be, dev, s, bias, buf);
  } else {
    backward_data_gemm(be, dev, s, buf);
  }
}

/// The layout a pass runs in without measuring: the Plain one where the Blocked one is
/// refused (Note [Blocked forward with a stride above the kernel]), the forced one, the
/// device's cached choice, or the record's (then cached); Auto when the pass has not
/// been measured yet.
ConvLayout known_layout(CpuBackend& be, Device dev, const Conv2dShape& s, ConvKind kind, bool bias, DType dtype) {
  if (kind == ConvKind::Forward && blocked_forward_refused(be, dev, s, bias, dtype)) return ConvLayout::Plain;
  ConvLayout layout = be.conv_layout();
  if (layout == ConvLayout::Gemm && !gemm_pass_eligible(s, kind, dtype)) return ConvLayout::Blocked;
  if (layout != ConvLayout::Auto) return layout;
  const int threads = be.threads_per_device(dev);
  ConvCache& cache = *be.state(dev).conv;
  const ConvKey auto_key = auto_key_of(s, kind, bias, threads, dtype);
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    if (auto known = cache.chosen.find(auto_key); known != cache.chosen.end()) return known->second;
  }
  layout = LayoutChoices::get().find(choice_key(s, kind, bias, threads, dtype));
  if (layout != ConvLayout::Auto) {
    std::lock_guard<std::mutex> lock(cache.mu);
    cache.chosen.emplace(auto_key, layout);
  }
  return layout;
}

/// Runs a convolution pass. ConvLayout::Auto resolves to the recorded choice, or
/// measures both layouts on these buffers first (Note [CPU convolution: measured choice]).
void run_conv(CpuBackend& be, Device dev, const Conv2dShape& s, ConvKind kind, bool bias,
              const ConvBuffers& buf, bool relu = false);

/// A channels-last forward run on NCHW copies of its activations (Note [Blocked forward
/// with a stride above the kernel]): x moved into NCHW, the NCHW forward, its output
/// moved into y's N x H x W x C.
void run_forward_through_nchw(CpuBackend& be, Device dev, const Conv2dShape& s, bool bias, const ConvBuffers& buf,
                              bool relu) {
  Conv2dShape plain = s;
  plain.channels_last = false;
  const int esize = buf.dtype == DType::F32 ? 4 : 2;
  const OwnReorder in{.into = OwnReorder::Into::Nhwc, .N = s.N, .C = s.C, .HW = s.H * s.W, .esize = esize};
  const OwnReorder out{.into = OwnReorder::Into::Nhwc, .N = s.N, .C = s.K, .HW = s.P * s.Q, .esize = esize};
  std::vector<char> x(static_cast<std::size_t>(s.N * s.C * s.H * s.W * esize));
  std::vector<char> y(static_cast<std::size_t>(s.N * s.K * s.P * s.Q * esize));
  reorder_own(in, buf.x, x.data(), /*to_plain=*/true);
  ConvBuffers b = buf;
  b.x = x.data();
  b.y = y.data();
  run_conv(be, dev, plain, ConvKind::Forward, bias, b, relu);
  reorder_own(out, y.data(), buf.y, /*to_plain=*/false);
}

void run_conv(CpuBackend& be, Device dev, const Conv2dShape& s, ConvKind kind, bool bias,
              const ConvBuffers& buf, bool relu) {
  // A channels-last forward whose Blocked kernel is refused has no kernel of its own
  // layout to fall back on: its Plain one is that same kernel (Note [Blocked forward
  // with a stride above the kernel]).
  if (s.channels_last && kind == ConvKind::Forward && buf.pooled == nullptr &&
      blocked_forward_refused(be, dev, s, bias, buf.dtype)) {
    run_forward_through_nchw(be, dev, s, bias, buf, relu);
    return;
  }
  DeviceState& st = be.state(dev);
  const int threads = be.threads_per_device(dev);
  const int chunks = conv_chunks(s, threads);
  ConvCache& cache = *st.conv;
  ConvLayout layout = known_layout(be, dev, s, kind, bias, buf.dtype);
  if (layout == ConvLayout::Auto) {
    const ConvKey auto_key = auto_key_of(s, kind, bias, threads, buf.dtype);
    const std::string record_key = choice_key(s, kind, bias, threads, buf.dtype);
    using clock = std::chrono::steady_clock;
    auto time_one = [&](ConvLayout l) {
      const auto t0 = clock::now();
      if (l == ConvLayout::Gemm) {
        run_gemm_pass(be, dev, s, kind, bias, buf);
      } else {
        run_chunks(be, dev, cache, s, kind, bias, l, chunks, buf, relu);
      }
      return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    };
    // Note [Backward weight as one product]: a third candidate where it applies.
    const bool try_gemm = gemm_pass_eligible(s, kind, buf.dtype);
    (void)time_one(ConvLayout::Plain);  // first runs build primitives and touch buffers
    (void)time_one(ConvLayout::Blocked);
    if (try_gemm) (void)time_one(ConvLayout::Gemm);
    double best_plain = 1e300, best_blocked = 1e300, best_gemm = 1e300;
    int plain_wins = 0, blocked_wins = 0;  // clear wins within a back-to-back pair
    double times[kTrials][3];
    for (int t = 0; t < kTrials; ++t) {
      const double p = time_one(ConvLayout::Plain), b = time_one(ConvLayout::Blocked);
      const double g = try_gemm ? time_one(ConvLayout::Gemm) : 1e300;
      times[t][0] = p;
      times[t][1] = b;
      times[t][2] = g;
      best_plain = std::min(best_plain, p);
      best_blocked = std::min(best_blocked, b);
      best_gemm = std::min(best_gemm, g);
      plain_wins += p * kClearWin < b;
      blocked_wins += b * kClearWin < p;
    }
    // The prior (blocked layouts fill a vector with channels once there are enough
    // of them) yields only to a clear win, in the best times and in most pairs: a
    // time slice lost to another process slows one run of a pair, not most pairs.
    const bool prior_blocked = s.C >= kFewChannels || kind == ConvKind::BackwardWeight;
    const bool plain_clear = best_plain * kClearWin < best_blocked && 2 * plain_wins > kTrials;
    const bool blocked_clear = best_blocked * kClearWin < best_plain && 2 * blocked_wins > kTrials;
    ConvLayout measured = prior_blocked ? (plain_clear ? ConvLayout::Plain : ConvLayout::Blocked)
                                        : (blocked_clear ? ConvLayout::Blocked : ConvLayout::Plain);
    if (try_gemm) {  // the product against the layout chosen so far, by the same rule
      const int other = measured == ConvLayout::Plain ? 0 : 1;
      int gemm_wins = 0;
      for (const auto& pair : times) gemm_wins += pair[2] * kClearWin < pair[other];
      if (best_gemm * kClearWin < (other == 0 ? best_plain : best_blocked) && 2 * gemm_wins > kTrials)
        measured = ConvLayout::Gemm;
    }
    layout = LayoutChoices::get().record(record_key, measured, best_plain, best_blocked, try_gemm ? best_gemm : -1.0);
    // The losers' primitives and their reorder buffers (tens of MB for a large
    // activation) would never run again.
    std::lock_guard<std::mutex> lock(cache.mu);
    std::erase_if(cache.entries, [&](const auto& kv) {
      return kv.first.layout != layout && kv.first.kind == kind && kv.first.bias == bias &&
             kv.first.dtype == buf.dtype && std::memcmp(kv.first.dims + 1, auto_key.dims + 1, sizeof(i64) * 13) == 0;
    });
    cache.chosen.emplace(auto_key, layout);
  }
  if (layout == ConvLayout::Gemm) {
    run_gemm_pass(be, dev, s, kind, bias, buf);
    return;
  }
  run_chunks(be, dev, cache, s, kind, bias, layout, chunks, buf, relu);
}

// Note [Convolution backward in one call]
// A convolution's two backward passes read the same output gradient gy, and under a
// max-pool that gradient is itself computed: the pool's backward routes the pooled
// gradient (masked by the ReLU) to the winners. Run as separate ops (Backend::
// conv2d_backward_by_ops), the routed gradient is written to memory in NCHW, and each
// pass whose primitive wants another layout (NHWC for oneDNN's AMX kernels, nChw16c
// for its AVX-512 ones: Note [bfloat16 blocked reorders]) reads it back and reorders it
// into a buffer of its own: for the Fashion-MNIST CNN's second layer, per 128-image
// chunk, 3.2 MB written, then read and rewritten twice. Conv2dBackward is both passes in
// one call (PyTorch's convolution_backward, with its output mask), so the CPU builds
// the primitive's gy once, in the primitive's layout: the pool's backward runs on a group
// of images at a time into a block that stays in a core's L2 (as the forward's pool,
// Note [Convolution, ReLU and max-pool in one pass]), and each group is reordered from
// there into the backward-data primitive's buffer, which the backward-weight primitive
// then reads too. Nothing else changes: the same primitives (the same cache keys), the
// same pool kernel and the same reorders, which move bits, so the gradients are those of
// the separate ops bit for bit (cpu_backend_test). Where the two primitives want
// different layouts, or a layout transpose_copy does not move, or a pass's layout has not
// been measured yet, the call runs as the separate ops. float32 calls share the same
// way: there transpose_copy moves only the shared gy (the other float32 reorders stay
// oneDNN's), whose reorder from NCHW was a tenth of oneDNN's time in the float32 CNN
// step, run twice for the second layer.

/// Calls that took the shared path (CpuBackend::shared_conv_backwards).
std::atomic<std::uint64_t> shared_backwards{0};

/// The DIFF_DST argument of an entry.
ConvArg& diff_dst_arg(ConvEntry& e) {
  for (ConvArg& a : e.args)
    if (a.id == DNNL_ARG_DIFF_DST) return a;
  DP_FAIL("conv2d_backward: a backward primitive without a DIFF_DST argument");
}

/// Conv2dBackward in one call (Note [Convolution backward in one call]), bfloat16 or
/// float32. Returns false, having done nothing, where the call runs as separate ops.
/// buf: gy (the pooled gradient when pool.on), x, w, gx (or null), gw and gb (float32,
/// or null).
bool run_backward_shared(CpuBackend& be, Device dev, const Conv2dShape& s, bool bias, const ConvBuffers& buf,
                         const ConvPoolBackward& pool) {
  const bool want_gx = buf.gx != nullptr, want_gw = buf.gw != nullptr;
  if (s.N == 0 || (!want_gx && !want_gw)) return false;
  if (pool.on) {
    const Pool2dShape& p = pool.s;
    if (!be.max_pool2d_byte_winners(p) || p.N != s.N || p.C != s.K || p.H != s.P || p.W != s.Q) return false;
  }
  const ConvLayout layout_d = want_gx ? known_layout(be, dev, s, ConvKind::BackwardData, false, buf.dtype)
                                      : ConvLayout::Plain;
  const ConvLayout layout_w = want_gw ? known_layout(be, dev, s, ConvKind::BackwardWeight, bias, buf.dtype)
                                      : ConvLayout::Plain;
  if (layout_d == ConvLayout::Auto || layout_w == ConvLayout::Auto) return false;
  // Note [Backward weight as one product]: no primitive to share gy with.
  if (layout_d == ConvLayout::Gemm || layout_w == ConvLayout::Gemm) return false;
  ConvCache& cache = *be.state(dev).conv;
  const int chunks = conv_chunks(s, be.threads_per_device(dev));
  struct Chunk {
    ConvEntry* data = nullptr;
    ConvEntry* weight = nullptr;
  };
  std::vector<Chunk> parts(static_cast<std::size_t>(chunks));
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    for (int c = 0; c < chunks; ++c) {
      Conv2dShape sc = s;
      sc.N = s.N * (c + 1) / chunks - s.N * c / chunks;
      Chunk& part = parts[static_cast<std::size_t>(c)];
      if (want_gx)
        part.data = &find_entry(cache, conv_key(sc, ConvKind::BackwardData, false, c, layout_d, false, buf.dtype), sc,
                                dev);
      if (want_gw)
        part.weight =
            &find_entry(cache, conv_key(sc, ConvKind::BackwardWeight, bias, c, layout_w, false, buf.dtype), sc, dev);
      // Every chunk's primitives read gy in one layout that transpose_copy moves.
      ConvArg* home = part.data ? &diff_dst_arg(*part.data) : &diff_dst_arg(*part.weight);
      if (!home->internal || !home->movable()) return false;
      if (part.data && part.weight) {
        const ConvArg& other = diff_dst_arg(*part.weight);
        if (!other.internal || other.internal.get_desc() != home->internal.get_desc()) return false;
      }
    }
  }
  const i64 kpq = s.K * s.P * s.Q, chw = s.C * s.H * s.W;
  const bool f32 = buf.dtype == DType::F32;
  const i64 esize = f32 ? 4 : 2;
  auto at = [esize](const void* p, i64 i) { return static_cast<char*>(const_cast<void*>(p)) + i * esize; };
  // Images per group of the pool's backward: the group's routed gradient stays in L2.
  const i64 group = std::clamp<i64>(kPoolGroupBytes / (kpq * esize), 1, std::max<i64>(1, s.N / chunks));
  if (want_gw) size_partials(cache, s, chunks, /*first_partial=*/0);
  if (pool.on) {
    std::lock_guard<std::mutex> lock(cache.mu);
    if (cache.pool_groups.size() < static_cast<std::size_t>(chunks)) cache.pool_groups.resize(chunks);
    for (int c = 0; c < chunks; ++c)
      cache.pool_groups[c].resize(static_cast<std::size_t>((group * kpq * esize + 3) / 4));
  }
  be.parallel_chunks(dev, chunks, [&](i64 c) {
    omp_set_num_threads(1);  // per thread: this thread's oneDNN calls make no team
    const i64 n0 = s.N * c / chunks, n1 = s.N * (c + 1) / chunks;
    const Chunk& part = parts[static_cast<std::size_t>(c)];
    ConvArg& home = part.data ? diff_dst_arg(*part.data) : diff_dst_arg(*part.weight);
    void* routed = home.internal.get_data_handle();
    if (pool.on) {
      // The pool's backward a group at a time, each group reordered from L2 into place.
      const Pool2dShape& p = pool.s;
      const i64 ppq = p.P * p.Q;
      void* block = cache.pool_groups[static_cast<std::size_t>(c)].data();
      for (i64 g0 = n0; g0 < n1; g0 += group) {
        const i64 n = std::min(group, n1 - g0), pooled_at = g0 * s.K * ppq;
        const std::uint8_t* where = static_cast<const std::uint8_t*>(pool.winners) + pooled_at;
        if (f32) {
          const auto* ry = static_cast<const float*>(pool.relu_y);
          maxpool_2x2_backward_planes(p, static_cast<const float*>(buf.gy) + pooled_at, where,
                                      ry ? ry + pooled_at : nullptr, static_cast<float*>(block), 0, n * s.K);
        } else {
          const auto* ry = static_cast<const std::uint16_t*>(pool.relu_y);
          maxpool_2x2_backward_bf16(static_cast<const std::uint16_t*>(buf.gy) + pooled_at, where,
                                    ry ? ry + pooled_at : nullptr, static_cast<std::uint16_t*>(block), n * s.K, p.H,
                                    p.W, p.P, p.Q);
        }
        OwnReorder r = home.own;
        r.N = n;
        reorder_own(r, block, at(routed, (g0 - n0) * kpq), /*to_plain=*/false);
      }
    } else {
      reorder_own(home.own, at(buf.gy, n0 * kpq), routed, /*to_plain=*/false);
    }
    if (part.data) {
      const void* ptrs[3] = {routed, buf.w, at(buf.gx, n0 * chw)};  // DIFF_DST: filled above
      execute_entry(*part.data, ptrs, DNNL_ARG_DIFF_DST);
    }
    if (part.weight) {
      float* gw = cache.partials[static_cast<std::size_t>(c)].data();
      const void* ptrs[4] = {at(buf.x, n0 * chw), routed, gw, gw + s.K * s.C * s.R * s.S};  // DIFF_DST: filled
      // The same layout: the weight pass reads what the data pass read, then its own
      // buffer again (ConvArg::buffer: the memory does not own it).
      ConvArg& dst = diff_dst_arg(*part.weight);
      dst.internal.set_data_handle(routed);
      try {
        execute_entry(*part.weight, ptrs, DNNL_ARG_DIFF_DST);
      } catch (...) {
        dst.internal.set_data_handle(dst.buffer.get());
        throw;
      }
      dst.internal.set_data_handle(dst.buffer.get());
    }
  });
  if (want_gw) sum_partials(cache, s, bias, chunks, /*first_partial=*/0, buf);
  shared_backwards.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace

ConvCache* new_conv_cache() { return new ConvCache(); }

void CpuBackend::set_conv_layout(ConvLayout layout) {
  std::lock_guard<std::mutex> lock(config_mu_);
  conv_layout_.store(layout);
  for (auto& d : devices_) {
    std::lock_guard<std::mutex> cl(d->conv->mu);
    d->conv->entries.clear();
    d->conv->chosen.clear();
  }
}

ConvLayout CpuBackend::chosen_conv_layout(Device dev, const Conv2dShape& s, ConvPass pass,
                                          bool bias) {
  if (conv_layout() != ConvLayout::Auto) return conv_layout();
  return LayoutChoices::get().find(choice_key(s, pass, bias, threads_per_device(dev), DType::F32));
}

// ---- convolution ------------------------------------------------------------------------

namespace {

/// Whether a Conv2d call's pool runs in one pass with the convolution (Note
/// [Convolution, ReLU and max-pool in one pass]): a ReLU, then a 2x2 tiling of an output
/// of at least 2x2 — the pool whose winners this backend keeps in bytes.
bool pools_in_one_pass(const Conv2dArgs& a) {
  const Conv2dShape& s = a.s;
  const Pool2dShape& p = a.pool.s;
  return a.relu && is_2x2_tiling(p) && p.N == s.N && p.C == s.K && p.H == s.P && p.W == s.Q && p.P == s.P / 2 &&
         p.Q == s.Q / 2 && s.P >= 2 && s.Q >= 2;
}

}  // namespace

void CpuBackend::conv2d_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                                const float* bias, float* y) {
  conv_forward(dev, s, x, w, bias, y, /*relu=*/false);
}

void CpuBackend::conv2d_relu_forward(Device dev, const Conv2dShape& s, const float* x,
                                     const float* w, const float* bias, float* y) {
  conv_forward(dev, s, x, w, bias, y, /*relu=*/true);
}

void CpuBackend::conv_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                              const float* bias, float* y, bool relu) {
  check_conv_shape(s, relu ? "conv2d_relu_forward" : "conv2d_forward");
  if (s.N == 0) return;
  run_conv(*this, dev, s, ConvKind::Forward, bias != nullptr, ConvBuffers{.x = x, .w = w, .b = bias, .y = y},
           relu);
}

void CpuBackend::conv2d_relu_maxpool2x2_forward(Device dev, const Conv2dShape& s, const float* x, const float* w,
                                                const float* bias, float* y, std::uint8_t* where) {
  check_conv_shape(s, "conv2d_relu_maxpool2x2_forward");
  DP_CHECK(s.P >= 2 && s.Q >= 2, "conv2d_relu_maxpool2x2_forward: expected a convolution output of at least 2x2 "
           "for the 2x2 max-pool, got ", s.P, "x", s.Q);
  if (s.N == 0) return;
  run_conv(*this, dev, s, ConvKind::Forward, bias != nullptr,
           ConvBuffers{.x = x, .w = w, .b = bias, .pooled = y, .where = where}, /*relu=*/true);
}

void CpuBackend::conv2d_backward_data(Device dev, const Conv2dShape& s, const float* gy,
                                      const float* w, float* gx) {
  check_conv_shape(s, "conv2d_backward_data");
  if (s.N == 0) return;
  ConvBuffers buf;
  buf.gy = gy;
  buf.w = w;
  buf.gx = gx;
  run_conv(*this, dev, s, ConvKind::BackwardData, false, buf);
}

void CpuBackend::conv2d_backward_weight(Device dev, const Conv2dShape& s, const float* x,
                                        const float* gy, float* gw, float* gbias) {
  check_conv_shape(s, "conv2d_backward_weight");
  if (s.N == 0) {  // an empty batch contributes nothing: overwrite with zeros
    std::memset(gw, 0, static_cast<std::size_t>(s.K * s.C * s.R * s.S) * sizeof(float));
    if (gbias) std::memset(gbias, 0, static_cast<std::size_t>(s.K) * sizeof(float));
    return;
  }
  ConvBuffers buf;
  buf.x = x;
  buf.gy = gy;
  buf.gw = gw;
  buf.gb = gbias;
  run_conv(*this, dev, s, ConvKind::BackwardWeight, gbias != nullptr, buf);
}


// ---- bfloat16 convolutions ----------------------------------------------------------------

// Note [bf16 convolutions through oneDNN]
// Under autocast a convolution's input, weight and bias are bfloat16 (Note [Autocast op
// policy]). Where the CPU has bfloat16 instructions (avx512_bf16; AMX implies them, as
// oneDNN's effective ISA reports), the three passes are oneDNN's bfloat16 primitives on
// those operands, accumulating in float32: forward and backward-data round their output
// to bfloat16 once; backward-weight writes float32 partial sums per chunk, adds them in
// chunk order, and rounds the weight and bias gradients once (they are the bfloat16
// gradients of the bfloat16 weight autocast made; its cast's backward widens them to
// the float32 master parameter, as PyTorch's does). Everything else is float32's path:
// the per-device primitive cache, chunks along the batch (Note [oneDNN in the device's
// arena]), and the measured layout choice (Note [CPU convolution: measured choice]),
// keyed by dtype as well, so a bfloat16 call measures its own layouts (oneDNN's blocked
// bfloat16 kernels win by far on the CNN's 32-channel layer; the 1-channel forward is
// close). A bfloat16 forward applies its ReLU after the primitive (the post-op's
// overflow bound of Note [Convolution + ReLU] reads float32 data); ReLU commutes with
// the rounding, so the values are those of conv2d followed by relu. A Conv2d call with
// a 2x2 pool runs in one pass as float32's does (Note [Convolution, ReLU and max-pool in
// one pass]): each group's bfloat16 output pooled in cache, its ReLU applied as the pool
// loads it (Note [bfloat16 max-pool on its bits]), so its bits are those of the
// bfloat16 ops one after another.
// Without bfloat16 instructions (AVX2-only CPUs, or oneDNN told otherwise by
// DNNL_MAX_CPU_ISA), and after set_native_bf16_conv(false) (tests), each pass widens
// its operands to float32 (exact), runs the float32 pass and rounds its outputs once:
// what nn's widening path computes, correct and at float32 speed. float16 convolutions
// always widen, in nn (oneDNN 2.6 has no float16 convolution on CPUs).

namespace {

/// Whether oneDNN runs on a CPU with bfloat16 instructions (avx512_bf16; AMX implies
/// them). DNNL_MAX_CPU_ISA lowers what it sees, and so this answer.
bool cpu_has_bf16_isa() {
  static const bool has = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto bf16 = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_bf16);
    return (isa & bf16) == bf16;  // the ISA values are feature masks
  }();
  return has;
}

/// n values of `from` widened to float32 (exact), into a block of the device's memory.
std::unique_ptr<float, std::function<void(float*)>> widened(CpuBackend& be, Device dev, const void* from, i64 n) {
  const std::size_t bytes = static_cast<std::size_t>(std::max<i64>(n, 1)) * sizeof(float);
  std::unique_ptr<float, std::function<void(float*)>> out{
      static_cast<float*>(be.allocate(dev, bytes)), [&be, dev, bytes](float* p) { be.deallocate(dev, p, bytes); }};
  if (from != nullptr) {
    const auto* src = static_cast<const BFloat16*>(from);
    float* to = out.get();
    be.parallel_for(dev, n, kSerialGrain, [=](i64 lo, i64 hi) {
      for (i64 i = lo; i < hi; ++i) to[i] = static_cast<float>(src[i]);
    });
  }
  return out;
}

/// to[i] = from[i] rounded to bfloat16, once.
void rounded(CpuBackend& be, Device dev, const float* from, void* to, i64 n) {
  auto* dst = static_cast<BFloat16*>(to);
  be.parallel_for(dev, n, kSerialGrain, [=](i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) dst[i] = BFloat16(from[i]);
  });
}

i64 input_numel(const Conv2dShape& s) { return s.N * s.C * s.H * s.W; }
i64 output_numel(const Conv2dShape& s) { return s.N * s.K * s.P * s.Q; }
i64 weight_numel(const Conv2dShape& s) { return s.K * s.C * s.R * s.S; }

// Note [bf16 backward-weight on an image narrower than its stride]
// oneDNN 2.6's bfloat16 backward-weight pass (on a Xeon with AMX, its
// jit:avx512_core_amx_bf16 kernel, which the Blocked layout runs) computes wrong weight
// gradients for a convolution whose input is narrower than its horizontal stride
// (W < stride_w): taps come out NaN or off by up to 1e37, from memory it never wrote, so
// they change with the buffers' history (NaN in the op fuzzer's program 88903: a 1x1
// image, 3x3 kernel, stride 2, padding 1). The rule comes from scans on that Xeon
// (2026-12-01) with the primitives' scratchpads and outputs filled with NaN first
// (Note [Poisoned memory] in backend.h), so every read of unwritten memory shows. Of
// 18,263 random geometries (H and W 1-16, kernels 1-7, strides 1-4 and padding 0-3, each
// way; 1-32 channels), each run in both layouts, 711 weight gradients were wrong, every
// one Blocked with W < stride_w (711 of the 1,167 such); of a grid of 2,292 narrow ones
// (W 1-12, S 1-8, stride_w 1-6, pad_w 0-7), 334, all with W < stride_w (of 369).
// No forward, backward-data or Plain pass was wrong, and no geometry with W >= stride_w.
// An earlier scan without the fill saw only the one-output-column ones (Q = 1; a first
// rule, Q = 1 and stride_w > 1, let the others through). Such shapes take the widening
// path for the weight gradient on every CPU: the float32 pass on the widened operands,
// rounded once, what PyTorch's bfloat16 convolution's gradient is up to the order of its
// sums. Their images are narrower than a stride, so the float32 pass costs nothing that
// matters. The forward and backward-data passes are oneDNN's still; cpu_backend_test
// sweeps such geometries, buffers filled, every pass against float32.
bool bf16_backward_weight_widens(const Conv2dShape& s) { return s.W < s.stride_w; }

}  // namespace

bool CpuBackend::native_bf16_conv() const { return native_bf16_conv_.load() && cpu_has_bf16_isa(); }

void CpuBackend::set_native_bf16_conv(bool on) { native_bf16_conv_.store(on); }

void CpuBackend::set_own_conv_reorders(bool on) { own_reorders.store(on); }

std::uint64_t CpuBackend::shared_conv_backwards() { return shared_backwards.load(std::memory_order_relaxed); }

void CpuBackend::conv2d_bf16(Device dev, const Conv2dArgs& a) {
  const Conv2dShape& s = a.s;
  check_conv_pool_layout(s, a.pool.on);
  if (a.pool.on) {
    if (native_bf16_conv() && pools_in_one_pass(a)) {
      check_conv_shape(s, "conv2d_relu_maxpool2x2_forward");
      if (s.N == 0) return;
      run_conv(*this, dev, s, ConvKind::Forward, a.bias != nullptr,
               ConvBuffers{.dtype = DType::BF16, .x = a.x, .w = a.w, .b = a.bias, .pooled = a.y,
                           .where = static_cast<std::uint8_t*>(a.pool.winners)},
               /*relu=*/true);
    } else {
      conv2d_pool_by_ops(dev, DType::BF16, a);
    }
    return;
  }
  check_conv_shape(s, a.relu ? "conv2d_relu_forward" : "conv2d_forward");
  if (s.N == 0) return;
  if (native_bf16_conv()) {
    run_conv(*this, dev, s, ConvKind::Forward, a.bias != nullptr,
             ConvBuffers{.dtype = DType::BF16, .x = a.x, .w = a.w, .b = a.bias, .y = a.y}, a.relu);
    return;
  }
  auto x = widened(*this, dev, a.x, input_numel(s));
  auto w = widened(*this, dev, a.w, weight_numel(s));
  auto b = widened(*this, dev, a.bias, a.bias ? s.K : 0);
  auto y = widened(*this, dev, nullptr, output_numel(s));
  conv_forward(dev, s, x.get(), w.get(), a.bias ? b.get() : nullptr, y.get(), a.relu);
  rounded(*this, dev, y.get(), a.y, output_numel(s));
}

void CpuBackend::conv2d_backward_data_bf16(Device dev, const Conv2dBackwardDataArgs& a) {
  const Conv2dShape& s = a.s;
  check_conv_shape(s, "conv2d_backward_data");
  if (s.N == 0) return;
  if (native_bf16_conv()) {
    ConvBuffers buf;
    buf.dtype = DType::BF16;
    buf.gy = a.gy;
    buf.w = a.w;
    buf.gx = a.gx;
    run_conv(*this, dev, s, ConvKind::BackwardData, false, buf);
    return;
  }
  auto gy = widened(*this, dev, a.gy, output_numel(s));
  auto w = widened(*this, dev, a.w, weight_numel(s));
  auto gx = widened(*this, dev, nullptr, input_numel(s));
  conv2d_backward_data(dev, s, gy.get(), w.get(), gx.get());
  rounded(*this, dev, gx.get(), a.gx, input_numel(s));
}

void CpuBackend::conv2d_backward_weight_bf16(Device dev, const Conv2dBackwardWeightArgs& a) {
  const Conv2dShape& s = a.s;
  check_conv_shape(s, "conv2d_backward_weight");
  auto gw = widened(*this, dev, nullptr, weight_numel(s));
  auto gb = widened(*this, dev, nullptr, s.K);
  float* gbias = a.gbias ? gb.get() : nullptr;
  if (s.N > 0 && native_bf16_conv() && !bf16_backward_weight_widens(s)) {
    ConvBuffers buf;
    buf.dtype = DType::BF16;
    buf.x = a.x;
    buf.gy = a.gy;
    buf.gw = gw.get();
    buf.gb = gbias;
    run_conv(*this, dev, s, ConvKind::BackwardWeight, gbias != nullptr, buf);
  } else {
    auto x = widened(*this, dev, s.N > 0 ? a.x : nullptr, input_numel(s));
    auto gy = widened(*this, dev, s.N > 0 ? a.gy : nullptr, output_numel(s));
    conv2d_backward_weight(dev, s, x.get(), gy.get(), gw.get(), gbias);
  }
  rounded(*this, dev, gw.get(), a.gw, weight_numel(s));
  if (a.gbias) rounded(*this, dev, gbias, a.gbias, s.K);
}

void CpuBackend::conv2d_backward(Device dev, DType dt, const Conv2dBackwardArgs& a) {
  const Conv2dShape& s = a.s;
  check_conv_shape(s, "conv2d_backward");
  check_conv2d_backward(a);
  const bool f32 = dt == DType::F32;
  // Note [bf16 backward-weight on an image narrower than its stride]: such shapes' passes one by one.
  if (f32 || (native_bf16_conv() && !(a.gw != nullptr && bf16_backward_weight_widens(s)))) {
    // bfloat16 weight and bias gradients sum in float32 and round once (Note [bf16
    // convolutions through oneDNN]).
    std::unique_ptr<float, std::function<void(float*)>> gw, gb;
    if (!f32 && a.gw != nullptr) {
      gw = widened(*this, dev, nullptr, weight_numel(s));
      gb = widened(*this, dev, nullptr, s.K);
    }
    ConvBuffers buf;
    buf.dtype = dt;
    buf.x = a.x;
    buf.w = a.w;
    buf.gy = a.gy;
    buf.gx = a.gx;
    buf.gw = f32 ? static_cast<float*>(a.gw) : gw.get();
    buf.gb = a.gw == nullptr || a.gbias == nullptr ? nullptr : f32 ? static_cast<float*>(a.gbias) : gb.get();
    if (run_backward_shared(*this, dev, s, buf.gb != nullptr, buf, a.pool)) {
      if (!f32 && a.gw != nullptr) {
        rounded(*this, dev, buf.gw, a.gw, weight_numel(s));
        if (a.gbias != nullptr) rounded(*this, dev, buf.gb, a.gbias, s.K);
      }
      return;
    }
  }
  conv2d_backward_by_ops(dev, dt, a);
}

namespace {

/// The float32 Conv2d kernel: with a pool, the one-pass path where it applies (Note
/// [Convolution, ReLU and max-pool in one pass]), else the ops it fuses.
void conv2d_kernel(CpuBackend& be, Device dev, const Conv2dArgs& a) {
  const auto* x = static_cast<const float*>(a.x);
  const auto* w = static_cast<const float*>(a.w);
  const auto* b = static_cast<const float*>(a.bias);
  check_conv_pool_layout(a.s, a.pool.on);
  if (!a.pool.on) {
    if (a.relu) {
      be.conv2d_relu_forward(dev, a.s, x, w, b, static_cast<float*>(a.y));
    } else {
      be.conv2d_forward(dev, a.s, x, w, b, static_cast<float*>(a.y));
    }
  } else if (pools_in_one_pass(a)) {
    be.conv2d_relu_maxpool2x2_forward(dev, a.s, x, w, b, static_cast<float*>(a.y),
                                      static_cast<std::uint8_t*>(a.pool.winners));
  } else {
    be.conv2d_pool_by_ops(dev, DType::F32, a);
  }
}
void conv2d_bf16_kernel(CpuBackend& be, Device dev, const Conv2dArgs& a) { be.conv2d_bf16(dev, a); }
void conv2d_backward_data_bf16_kernel(CpuBackend& be, Device dev, const Conv2dBackwardDataArgs& a) {
  be.conv2d_backward_data_bf16(dev, a);
}
void conv2d_backward_weight_bf16_kernel(CpuBackend& be, Device dev, const Conv2dBackwardWeightArgs& a) {
  be.conv2d_backward_weight_bf16(dev, a);
}
template <DType dt>
void conv2d_backward_kernel(CpuBackend& be, Device dev, const Conv2dBackwardArgs& a) {
  be.conv2d_backward(dev, dt, a);
}

}  // namespace

void CpuBackend::register_conv_kernels() {
  register_typed<Op::Conv2d, CpuBackend, &conv2d_kernel>(DType::F32);
  register_typed<Op::Conv2d, CpuBackend, &conv2d_bf16_kernel>(DType::BF16);
  register_typed<Op::Conv2dBackwardData, CpuBackend, &conv2d_backward_data_bf16_kernel>(DType::BF16);
  register_typed<Op::Conv2dBackwardWeight, CpuBackend, &conv2d_backward_weight_bf16_kernel>(DType::BF16);
  register_typed<Op::Conv2dBackward, CpuBackend, &conv2d_backward_kernel<DType::F32>>(DType::F32);
  register_typed<Op::Conv2dBackward, CpuBackend, &conv2d_backward_kernel<DType::BF16>>(DType::BF16);
}

}  // namespace dp::backend::cpu
