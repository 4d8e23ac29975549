// CPU backend: fills, casts, unary/binary elementwise ops, GELU, where, strided copies,
// random fills.
//
// The math of every op comes from backend/functors.h (shared with CUDA); this file only
// decides how to walk memory. Loops are plain counted loops over __restrict pointers so
// GCC vectorises them at -O3 without -march flags.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_inner_loop.h"
#include "backend/elementwise_walk.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

// ---- strided iteration -------------------------------------------------------------------
// Dimensions are collapsed first, then each run of the innermost one is an inner loop
// specialised for its strides (Note [Collapsing strided dimensions] in
// backend/elementwise_walk.h; cpu_inner_loop.h).

using walk::collapse;
using Walk = walk::Collapsed;

/// inner(a, sa, b, sb, out, len) over the rows of flat range [begin, end) of the
/// collapsed walk: each call one run along the innermost dimension.
template <typename T, typename Inner>
void walk_rows(const Walk& w, Inner inner, const T* a, const T* b, T* out, i64 begin, i64 end) {
  const int last = w.ix.ndim - 1;
  i64 coord[kMaxDims] = {};
  i64 oa = 0, ob = 0;
  i64 rem = begin;
  for (int d = last; d >= 0; --d) {
    coord[d] = rem % w.ix.sizes[d];
    rem /= w.ix.sizes[d];
    oa += coord[d] * w.ix.strides_a[d];
    ob += coord[d] * w.ix.strides_b[d];
  }
  i64 pos = begin;
  while (pos < end) {
    const i64 len = std::min(end - pos, w.ix.sizes[last] - coord[last]);
    inner(a + oa, w.ix.strides_a[last], b + ob, w.ix.strides_b[last], out + pos, len);
    pos += len;
    // Advance the odometer by len along the last dim, carrying into outer dims.
    coord[last] += len;
    oa += len * w.ix.strides_a[last];
    ob += len * w.ix.strides_b[last];
    for (int d = last; d > 0 && coord[d] == w.ix.sizes[d]; --d) {
      coord[d] = 0;
      oa -= w.ix.sizes[d] * w.ix.strides_a[d];
      ob -= w.ix.sizes[d] * w.ix.strides_b[d];
      ++coord[d - 1];
      oa += w.ix.strides_a[d - 1];
      ob += w.ix.strides_b[d - 1];
    }
  }
}

/// out[flat] = f(a[...], b[...]) for flat in [begin, end) of the collapsed walk.
template <typename T, typename F>
void walk_range(const Walk& w, F f, const T* a, const T* b, T* out, i64 begin, i64 end) {
  walk_rows(
      w, [f](const T* ra, i64 sa, const T* rb, i64 sb, T* ro, i64 len) { inner_loop(f, ra, sa, rb, sb, ro, len); }, a,
      b, out, begin, end);
}

// ---- fills and casts --------------------------------------------------------------------

template <typename T>
void fill(CpuBackend& be, Device dev, const FillArgs& a) {
  const T value = a.value.as<T>();
  T* y = static_cast<T*>(a.y);
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    T* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = value;
  });
}

template <typename T>
void add_scalar(CpuBackend& be, Device dev, const AddScalarArgs& a) {
  const T value = a.value.as<T>();
  T* y = static_cast<T*>(a.y);
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    T* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] += value;
  });
}

template <typename T>
void arange(CpuBackend& be, Device dev, const ArangeArgs& a) {
  const T start = a.start.as<T>(), step = a.step.as<T>();
  T* y = static_cast<T*>(a.y);
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    T* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = start + static_cast<T>(i) * step;
  });
}

/// y (of type Dst) = x converted: float to integer truncates toward 0, int64 to int32
/// is modulo 2^32 (C++20), a 16-bit float widens exactly and a float rounds to one to
/// nearest even (dp/core/half.h).
template <typename Dst>
void cast(CpuBackend& be, Device dev, const CastArgs& a) {
  visit_dtype(a.x_dtype, [&](auto src_zero) {
    using Src = decltype(src_zero);
    const Src* x = static_cast<const Src*>(a.x);
    Dst* y = static_cast<Dst*>(a.y);
    if constexpr (std::is_same_v<Src, float> && std::is_same_v<Dst, BFloat16>) {  // Note [Binary clones]
      be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { cast_f32_to_bf16(x + b, y + b, e - b); });
      return;
    } else if constexpr (std::is_same_v<Src, BFloat16> && std::is_same_v<Dst, float>) {
      be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { cast_bf16_to_f32(x + b, y + b, e - b); });
      return;
    }
    be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
      const Src* __restrict xx = x;
      Dst* __restrict yy = y;
      for (i64 i = b; i < e; ++i) yy[i] = convert<Dst>(xx[i]);
    });
  });
}

// ---- elementwise ------------------------------------------------------------------------
// y may alias x in unary/affine, so no __restrict there; GCC still vectorises with a
// runtime overlap check. Each kernel is a template over the storage type T, its math in
// float (Note [Storage types] in functors.h).

template <typename T>
void unary(CpuBackend& be, Device dev, const UnaryArgs& a) {
  DP_CHECK(a.op < UnaryOp::kCount, "unary: expected a UnaryOp below kCount, got ",
           static_cast<int>(a.op));
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  if constexpr (std::is_same_v<T, float>) {
    if (has_unary_clone(a.op)) {  // Note [Unary clones]
      const UnaryOp op = a.op;
      be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { unary_clone_f32(op, x + b, y + b, e - b); });
      return;
    }
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    if (has_unary_clone_bf16(a.op)) {  // Note [Unary clones]
      const UnaryOp op = a.op;
      be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { unary_clone_bf16(op, x + b, y + b, e - b); });
      return;
    }
  }
  dispatch_unary(a.op, [&](auto f) {
    const OnStorage<T, decltype(f)> g{f};
    be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
      for (i64 i = b; i < e; ++i) y[i] = g(x[i]);
    });
  });
}

template <typename T>
void affine(CpuBackend& be, Device dev, const AffineArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const float alpha = a.alpha, beta = a.beta;
  if constexpr (std::is_same_v<T, float>) {  // Note [Binary clones]
    be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { affine_f32(x + b, y + b, e - b, alpha, beta); });
    return;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { affine_bf16(x + b, y + b, e - b, alpha, beta); });
    return;
  }
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    for (i64 i = b; i < e; ++i) y[i] = store_acc<T>(alpha * load_acc(x[i]) + beta);
  });
}

template <typename T>
void axpy(CpuBackend& be, Device dev, const AxpyArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const float alpha = a.alpha;
  if constexpr (std::is_same_v<T, float>) {  // Note [Binary clones]
    be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) { axpy_f32(alpha, x + b, y + b, e - b); });
    return;
  }
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    for (i64 i = b; i < e; ++i) y[i] = store_acc<T>(load_acc(y[i]) + alpha * load_acc(x[i]));
  });
}

/// A floating-point storage type: out has the inputs' type (Eq and Gt write 1 or 0).
template <typename T>
void binary(CpuBackend& be, Device dev, const BinaryArgs& a) {
  DP_CHECK(a.op < BinaryOp::kCount, "binary: expected a BinaryOp below kCount, got ",
           static_cast<int>(a.op));
  const Walk w = collapse(a.ix);
  if (w.numel == 0) return;
  const T* pa = static_cast<const T*>(a.a);
  const T* pb = static_cast<const T*>(a.b);
  T* out = static_cast<T*>(a.out);
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16>) {
    if (has_binary_clone(a.op)) {  // Note [Binary clones]
      const BinaryOp op = a.op;
      auto inner = [op](const T* ra, i64 sa, const T* rb, i64 sb, T* ro, i64 len) {
        if constexpr (std::is_same_v<T, float>) {
          binary_clone_f32(op, ra, sa, rb, sb, ro, len);
        } else {
          binary_clone_bf16(op, ra, sa, rb, sb, ro, len);
        }
      };
      be.parallel_for(dev, w.numel, kSerialGrain,
                      [&](i64 begin, i64 end) { walk_rows(w, inner, pa, pb, out, begin, end); });
      return;
    }
  }
  dispatch_binary(a.op, [&](auto f) {
    const OnStorage<T, decltype(f)> g{f};
    be.parallel_for(dev, w.numel, kSerialGrain,
                    [&](i64 begin, i64 end) { walk_range(w, g, pa, pb, out, begin, end); });
  });
}

/// An integer storage type: Eq only, compared exactly, out float32.
template <typename T>
void binary_int(CpuBackend& be, Device dev, const BinaryArgs& a) {
  DP_CHECK(a.op == BinaryOp::Eq, "binary on ", dtype_name(dtype_of<T>), ": only eq is implemented, got op ",
           static_cast<int>(a.op));
  const Indexer& ix = a.ix;
  const T* pa = static_cast<const T*>(a.a);
  const T* pb = static_cast<const T*>(a.b);
  float* out = static_cast<float*>(a.out);
  // Labels against predictions: rarely large, so a plain per-element index walk.
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  be.parallel_for(dev, n, kSerialGrain, [&](i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) {
      i64 rest = i, oa = 0, ob = 0;
      for (int d = ix.ndim - 1; d >= 0; --d) {
        i64 coord = rest % ix.sizes[d];
        rest /= ix.sizes[d];
        oa += coord * ix.strides_a[d];
        ob += coord * ix.strides_b[d];
      }
      out[i] = pa[oa] == pb[ob] ? 1.0f : 0.0f;
    }
  });
}

// ---- GELU (Note [Fused GELU] in functors.h) ------------------------------------------------
// float32 runs the cloned loops on the pointers; a 16-bit type is widened a block at a
// time into float buffers on the stack, run through the same loops and rounded once.

/// Elements a 16-bit GELU task widens at a time: 3 float buffers of 4 KiB stay in L1.
constexpr i64 kGeluBlock = 1024;

template <typename T>
void widen(const T* x, float* out, i64 n) {
  for (i64 i = 0; i < n; ++i) out[i] = load_acc(x[i]);
}

template <typename T>
void gelu(CpuBackend& be, Device dev, const GeluArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const bool tanh = a.tanh;
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    if constexpr (std::is_same_v<T, float>) {
      gelu_f32(tanh, x + b, y + b, e - b);
    } else {
      float buf[kGeluBlock];
      for (i64 lo = b; lo < e; lo += kGeluBlock) {
        const i64 len = std::min(kGeluBlock, e - lo);
        widen(x + lo, buf, len);
        gelu_f32(tanh, buf, buf, len);
        for (i64 i = 0; i < len; ++i) y[lo + i] = store_acc<T>(buf[i]);
      }
    }
  });
}

template <typename T>
void gelu_backward(CpuBackend& be, Device dev, const GeluBackwardArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* gy = static_cast<const T*>(a.gy);
  T* gx = static_cast<T*>(a.gx);
  const bool tanh = a.tanh;
  be.parallel_for(dev, a.n, kSerialGrain, [=](i64 b, i64 e) {
    if constexpr (std::is_same_v<T, float>) {
      gelu_backward_f32(tanh, x + b, gy + b, gx + b, e - b);
    } else {
      float fx[kGeluBlock], fg[kGeluBlock];
      for (i64 lo = b; lo < e; lo += kGeluBlock) {
        const i64 len = std::min(kGeluBlock, e - lo);
        widen(x + lo, fx, len);
        widen(gy + lo, fg, len);
        gelu_backward_f32(tanh, fx, fg, fg, len);
        for (i64 i = 0; i < len; ++i) gx[lo + i] = store_acc<T>(fg[i]);
      }
    }
  });
}

template <typename T>
void strided_copy(CpuBackend& be, Device dev, const StridedCopyArgs& args) {
  Indexer only_a = args.ix;
  for (int d = 0; d < kMaxDims; ++d) only_a.strides_b[d] = 0;  // b unused: never blocks merging
  const Walk w = collapse(only_a);
  if (w.numel == 0) return;
  const T* a = static_cast<const T*>(args.a);
  T* out = static_cast<T*>(args.out);
  be.parallel_for(dev, w.numel, kSerialGrain, [&](i64 begin, i64 end) {
    walk_range(w, [](T x, T) { return x; }, a, a, out, begin, end);
  });
}

}  // namespace

// ---- random (Note [Counter-based random numbers] in functors.h) -----------------------------

void CpuBackend::fill_uniform(Device dev, float* y, i64 n, float lo, float hi,
                              std::uint64_t seed, std::uint64_t offset) {
  // Note [Vectorised random fills]: the loops are in cpu_random.cpp.
  parallel_for(dev, n, kSerialGrain / 8, [=](i64 b, i64 e) {  // ~8x the work per element
    uniform_range(y, b, e, lo, hi, seed, offset);
  });
}

void CpuBackend::fill_normal(Device dev, float* y, i64 n, float mean, float std,
                             std::uint64_t seed, std::uint64_t offset) {
  parallel_for(dev, n, kSerialGrain / 8, [=](i64 b, i64 e) { normal_range(y, b, e, mean, std, seed, offset); });
}

void CpuBackend::dropout(Device dev, const float* x, float* y, float* mask, i64 n, float p,
                         std::uint64_t seed, std::uint64_t offset) {
  DP_CHECK(p >= 0.0f && p <= 1.0f, "dropout: expected a probability p in [0, 1], got ", p);
  // p == 1 drops everything; 1/(1-p) would be inf and 0 * inf NaN.
  const float scale = p < 1.0f ? 1.0f / (1.0f - p) : 0.0f;
  parallel_for(dev, n, kSerialGrain / 8, [=](i64 b, i64 e) {
    dropout_range(x, y, mask, b, e, p, scale, seed, offset);
  });
}

// ---- gather / scatter_add (Note [Gather geometry] in ops.h) ----------------------------

namespace {

// Offsets of element n: `xo` into x without the gathered dim, `io` into the index.
inline void gather_offsets(const Indexer& ix, int dim, i64 n, i64& xo, i64& io) {
  xo = 0;
  io = 0;
  for (int d = ix.ndim - 1; d >= 0; --d) {
    const i64 c = n % ix.sizes[d];
    n /= ix.sizes[d];
    if (d != dim) xo += c * ix.strides_a[d];
    io += c * ix.strides_b[d];
  }
}

i64 indexer_numel(const Indexer& ix) {
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  return n;
}

template <typename T>
void gather(CpuBackend& be, Device dev, const GatherArgs& a) {
  const Indexer& ix = a.ix;
  const int dim = a.dim;
  DP_CHECK(dim >= 0 && dim < ix.ndim, "gather: expected a dim in [0, ", ix.ndim, "), got ", dim);
  const i64 n = indexer_numel(ix);
  const T* x = static_cast<const T*>(a.x);
  const i64* index = a.index;
  T* out = static_cast<T*>(a.out);
  be.parallel_for(dev, n, kSerialGrain, [&](i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) {
      i64 xo, io;
      gather_offsets(ix, dim, i, xo, io);
      out[i] = x[xo + index[io] * ix.strides_a[dim]];
    }
  });
}

template <typename T>
void scatter_add(CpuBackend& be, Device dev, const ScatterAddArgs& a) {
  const Indexer& ix = a.ix;
  const int dim = a.dim;
  DP_CHECK(dim >= 0 && dim < ix.ndim, "scatter_add: expected a dim in [0, ", ix.ndim, "), got ", dim);
  const i64 n = indexer_numel(ix);
  const T* src = static_cast<const T*>(a.src);
  T* y = static_cast<T*>(a.y);
  // One pass in element order on the calling thread: repeated indices add in a fixed
  // order, so the gradients of gather and index_select are bitwise reproducible.
  (void)be.state(dev);  // checks the device
  const int last = ix.ndim - 1;
  if (n > 0 && last != dim && ix.strides_a[last] == 1 && ix.strides_b[last] == 0) {
    // Whole rows (an embedding's gradient: one index a row): the offsets decoded once a
    // row, the row added as a vector. Its elements are distinct, so each still receives
    // its additions in element order.
    const i64 len = ix.sizes[last];
    for (i64 r = 0; r < n / len; ++r) {
      i64 xo, io;
      gather_offsets(ix, dim, r * len, xo, io);
      T* dst = y + xo + a.index[io] * ix.strides_a[dim];
      const T* row = src + r * len;
      for (i64 j = 0; j < len; ++j) dst[j] = store_acc<T>(load_acc(dst[j]) + load_acc(row[j]));
    }
    return;
  }
  for (i64 i = 0; i < n; ++i) {
    i64 xo, io;
    gather_offsets(ix, dim, i, xo, io);
    T& dst = y[xo + a.index[io] * ix.strides_a[dim]];
    dst = store_acc<T>(load_acc(dst) + load_acc(src[i]));
  }
}

/// out = cond != 0 ? a : b (WhereArgs). The dims are not collapsed: one task walks
/// whole rows of the innermost dim, the outer coordinates decoded once per row.
template <typename T>
void where(CpuBackend& be, Device dev, const WhereArgs& a) {
  const Indexer& ix = a.ix;
  DP_CHECK(ix.ndim >= 1 && ix.ndim <= kMaxDims, "where: expected 1 to ", kMaxDims, " dims, got ", ix.ndim);
  const i64 n = indexer_numel(ix);
  if (n == 0) return;
  const int last = ix.ndim - 1;
  const i64 len = ix.sizes[last], rows = n / len;
  const i64 sc = a.strides_cond[last], sa = ix.strides_a[last], sb = ix.strides_b[last];
  const float* cond = a.cond;
  const T* pa = static_cast<const T*>(a.a);
  const T* pb = static_cast<const T*>(a.b);
  T* out = static_cast<T*>(a.out);
  be.parallel_for(dev, rows, std::max<i64>(1, kSerialGrain / len), [&](i64 lo, i64 hi) {
    for (i64 r = lo; r < hi; ++r) {
      i64 oc = 0, oa = 0, ob = 0, rest = r;
      for (int d = last - 1; d >= 0; --d) {
        const i64 c = rest % ix.sizes[d];
        rest /= ix.sizes[d];
        oc += c * a.strides_cond[d];
        oa += c * ix.strides_a[d];
        ob += c * ix.strides_b[d];
      }
      T* __restrict o = out + r * len;
      for (i64 i = 0; i < len; ++i) o[i] = cond[oc + i * sc] != 0.0f ? pa[oa + i * sa] : pb[ob + i * sb];
    }
  });
}

}  // namespace

void CpuBackend::register_elementwise_kernels() {
  register_typed<Op::Fill, CpuBackend, &fill<float>>(DType::F32);
  register_typed<Op::Fill, CpuBackend, &fill<i64>>(DType::I64);
  register_typed<Op::AddScalar, CpuBackend, &add_scalar<i64>>(DType::I64);
  register_typed<Op::Arange, CpuBackend, &arange<float>>(DType::F32);
  register_typed<Op::Arange, CpuBackend, &arange<i64>>(DType::I64);
  register_typed<Op::Cast, CpuBackend, &cast<float>>(DType::F32);
  register_typed<Op::Cast, CpuBackend, &cast<i64>>(DType::I64);
  register_typed<Op::Cast, CpuBackend, &cast<std::int32_t>>(DType::I32);
  register_typed<Op::Unary, CpuBackend, &unary<float>>(DType::F32);
  register_typed<Op::Affine, CpuBackend, &affine<float>>(DType::F32);
  register_typed<Op::Axpy, CpuBackend, &axpy<float>>(DType::F32);
  register_typed<Op::Binary, CpuBackend, &binary<float>>(DType::F32);
  register_typed<Op::Binary, CpuBackend, &binary_int<i64>>(DType::I64);
  register_typed<Op::StridedCopy, CpuBackend, &strided_copy<float>>(DType::F32);
  register_typed<Op::StridedCopy, CpuBackend, &strided_copy<i64>>(DType::I64);  // an integer copy_ broadcast
  register_typed<Op::Gather, CpuBackend, &gather<float>>(DType::F32);
  register_typed<Op::ScatterAdd, CpuBackend, &scatter_add<float>>(DType::F32);
  register_typed<Op::Where, CpuBackend, &where<float>>(DType::F32);
  register_typed<Op::Gelu, CpuBackend, &gelu<float>>(DType::F32);
  register_typed<Op::GeluBackward, CpuBackend, &gelu_backward<float>>(DType::F32);
  // The 16-bit floating dtypes: the same kernels over their storage types (Note [Storage
  // types] in functors.h). Sums and products have no 16-bit kernels here: the tensor
  // layer widens their inputs to float32 (Note [16-bit tensors] in dp/tensor/tensor.h).
  auto register_16bit = [this](auto zero, DType dt) {
    using T = decltype(zero);
    register_typed<Op::Fill, CpuBackend, &fill<T>>(dt);
    register_typed<Op::Cast, CpuBackend, &cast<T>>(dt);
    register_typed<Op::Unary, CpuBackend, &unary<T>>(dt);
    register_typed<Op::Affine, CpuBackend, &affine<T>>(dt);
    register_typed<Op::Axpy, CpuBackend, &axpy<T>>(dt);
    register_typed<Op::Binary, CpuBackend, &binary<T>>(dt);
    register_typed<Op::StridedCopy, CpuBackend, &strided_copy<T>>(dt);
    register_typed<Op::Gather, CpuBackend, &gather<T>>(dt);
    register_typed<Op::ScatterAdd, CpuBackend, &scatter_add<T>>(dt);
    register_typed<Op::Where, CpuBackend, &where<T>>(dt);
    register_typed<Op::Gelu, CpuBackend, &gelu<T>>(dt);
    register_typed<Op::GeluBackward, CpuBackend, &gelu_backward<T>>(dt);
  };
  register_16bit(BFloat16{}, DType::BF16);
  register_16bit(Float16{}, DType::F16);
}

}  // namespace dp::backend::cpu
