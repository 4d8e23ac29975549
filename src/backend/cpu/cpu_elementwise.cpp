// CPU backend: fills, casts, unary/binary elementwise ops, strided copies, random fills.
//
// The math of every op comes from backend/functors.h (shared with CUDA); this file only
// decides how to walk memory. Loops are plain counted loops over __restrict pointers so
// GCC vectorises them at -O3 without -march flags.
#include <algorithm>
#include <cstdint>

#include "backend/cpu/cpu_backend.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

// ---- strided iteration -------------------------------------------------------------------
// Note [Collapsing strided dimensions]
// A binary op over an Indexer first drops size-1 dimensions and merges neighbours that
// are contiguous with each other in both inputs (stride[d] == stride[d+1] * size[d+1]).
// Same-shape contiguous inputs become one dimension, a bias add (rows, cols) with b
// strides (0, 1) stays two, a per-channel op over (N, C, HW) stays three. The innermost
// dimension then runs a loop specialised for its strides (1/1, 1/0, 0/1, general), so
// the common cases — same shape, scalar, row broadcast, channel broadcast — all reach a
// vectorised inner loop without a dedicated code path each.

struct Walk {
  int ndim = 0;
  i64 sizes[kMaxDims] = {};
  i64 sa[kMaxDims] = {};
  i64 sb[kMaxDims] = {};
  i64 numel = 1;
};

Walk collapse(const Indexer& ix) {
  DP_CHECK(ix.ndim >= 0 && ix.ndim <= kMaxDims, "elementwise: expected at most ", kMaxDims,
           " dims, got ", ix.ndim);
  Walk w;
  for (int d = 0; d < ix.ndim; ++d) {
    DP_CHECK(ix.sizes[d] >= 0, "elementwise: expected non-negative sizes, got ", ix.sizes[d],
             " in dim ", d);
    w.numel *= ix.sizes[d];
  }
  if (w.numel == 0) return w;
  for (int d = 0; d < ix.ndim; ++d) {
    if (ix.sizes[d] == 1) continue;
    if (w.ndim > 0) {
      const int last = w.ndim - 1;
      if (w.sa[last] == ix.strides_a[d] * ix.sizes[d] && w.sb[last] == ix.strides_b[d] * ix.sizes[d]) {
        w.sizes[last] *= ix.sizes[d];
        w.sa[last] = ix.strides_a[d];
        w.sb[last] = ix.strides_b[d];
        continue;
      }
    }
    w.sizes[w.ndim] = ix.sizes[d];
    w.sa[w.ndim] = ix.strides_a[d];
    w.sb[w.ndim] = ix.strides_b[d];
    ++w.ndim;
  }
  if (w.ndim == 0) {  // a scalar (all sizes 1)
    w.ndim = 1;
    w.sizes[0] = 1;
  }
  return w;
}

/// The innermost loop, specialised on the common stride patterns.
template <typename F>
inline void inner_loop(F f, const float* a, i64 sa, const float* b, i64 sb, float* out, i64 len) {
  if (sa == 1 && sb == 1) {
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i], b[i]);
  } else if (sa == 1 && sb == 0) {
    const float bv = *b;
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i], bv);
  } else if (sa == 0 && sb == 1) {
    const float av = *a;
    for (i64 i = 0; i < len; ++i) out[i] = f(av, b[i]);
  } else {
    for (i64 i = 0; i < len; ++i) out[i] = f(a[i * sa], b[i * sb]);
  }
}

/// out[flat] = f(a[...], b[...]) for flat in [begin, end) of the collapsed walk.
template <typename F>
void walk_range(const Walk& w, F f, const float* a, const float* b, float* out, i64 begin, i64 end) {
  const int last = w.ndim - 1;
  i64 coord[kMaxDims] = {};
  i64 oa = 0, ob = 0;
  i64 rem = begin;
  for (int d = last; d >= 0; --d) {
    coord[d] = rem % w.sizes[d];
    rem /= w.sizes[d];
    oa += coord[d] * w.sa[d];
    ob += coord[d] * w.sb[d];
  }
  i64 pos = begin;
  while (pos < end) {
    const i64 len = std::min(end - pos, w.sizes[last] - coord[last]);
    inner_loop(f, a + oa, w.sa[last], b + ob, w.sb[last], out + pos, len);
    pos += len;
    // Advance the odometer by len along the last dim, carrying into outer dims.
    coord[last] += len;
    oa += len * w.sa[last];
    ob += len * w.sb[last];
    for (int d = last; d > 0 && coord[d] == w.sizes[d]; --d) {
      coord[d] = 0;
      oa -= w.sizes[d] * w.sa[d];
      ob -= w.sizes[d] * w.sb[d];
      ++coord[d - 1];
      oa += w.sa[d - 1];
      ob += w.sb[d - 1];
    }
  }
}

}  // namespace

// ---- fills and casts --------------------------------------------------------------------

void CpuBackend::fill(Device dev, float* y, i64 n, float value) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    float* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = value;
  });
}

void CpuBackend::fill_i64(Device dev, i64* y, i64 n, i64 value) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    i64* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = value;
  });
}

void CpuBackend::add_i64(Device dev, i64* y, i64 n, i64 value) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    i64* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] += value;
  });
}

void CpuBackend::arange(Device dev, float* y, i64 n, float start, float step) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    float* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = start + static_cast<float>(i) * step;
  });
}

void CpuBackend::arange_i64(Device dev, i64* y, i64 n, i64 start, i64 step) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    i64* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = start + i * step;
  });
}

void CpuBackend::cast_i64_to_f32(Device dev, const i64* x, float* y, i64 n) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    const i64* __restrict xx = x;
    float* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = static_cast<float>(xx[i]);
  });
}

void CpuBackend::cast_i32_to_i64(Device dev, const std::int32_t* x, i64* y, i64 n) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    const std::int32_t* __restrict xx = x;
    i64* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = xx[i];
  });
}

void CpuBackend::cast_i64_to_i32(Device dev, const i64* x, std::int32_t* y, i64 n) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    const i64* __restrict xx = x;
    std::int32_t* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = static_cast<std::int32_t>(xx[i]);  // modulo 2^32 (C++20)
  });
}

void CpuBackend::eq_i64(Device dev, const Indexer& ix, const i64* a, const i64* b, float* out) {
  // Labels against predictions: rarely large, so a plain per-element index walk.
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  parallel_for(dev, n, kSerialGrain, [&](i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) {
      i64 rest = i, oa = 0, ob = 0;
      for (int d = ix.ndim - 1; d >= 0; --d) {
        i64 coord = rest % ix.sizes[d];
        rest /= ix.sizes[d];
        oa += coord * ix.strides_a[d];
        ob += coord * ix.strides_b[d];
      }
      out[i] = a[oa] == b[ob] ? 1.0f : 0.0f;
    }
  });
}

void CpuBackend::cast_f32_to_i64(Device dev, const float* x, i64* y, i64 n) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    const float* __restrict xx = x;
    i64* __restrict yy = y;
    for (i64 i = b; i < e; ++i) yy[i] = static_cast<i64>(xx[i]);  // truncates toward 0
  });
}

// ---- elementwise ------------------------------------------------------------------------
// y may alias x in unary/affine, so no __restrict there; GCC still vectorises with a
// runtime overlap check.

void CpuBackend::unary(Device dev, UnaryOp op, const float* x, float* y, i64 n) {
  DP_CHECK(op < UnaryOp::kCount, "unary: expected a UnaryOp below kCount, got ",
           static_cast<int>(op));
  dispatch_unary(op, [&](auto f) {
    parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
      for (i64 i = b; i < e; ++i) y[i] = f(x[i]);
    });
  });
}

void CpuBackend::affine(Device dev, const float* x, float* y, i64 n, float alpha, float beta) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    for (i64 i = b; i < e; ++i) y[i] = alpha * x[i] + beta;
  });
}

void CpuBackend::axpy(Device dev, float alpha, const float* x, float* y, i64 n) {
  parallel_for(dev, n, kSerialGrain, [=](i64 b, i64 e) {
    for (i64 i = b; i < e; ++i) y[i] += alpha * x[i];
  });
}

void CpuBackend::binary(Device dev, BinaryOp op, const Indexer& ix, const float* a,
                        const float* b, float* out) {
  DP_CHECK(op < BinaryOp::kCount, "binary: expected a BinaryOp below kCount, got ",
           static_cast<int>(op));
  const Walk w = collapse(ix);
  if (w.numel == 0) return;
  dispatch_binary(op, [&](auto f) {
    parallel_for(dev, w.numel, kSerialGrain,
                 [&](i64 begin, i64 end) { walk_range(w, f, a, b, out, begin, end); });
  });
}

void CpuBackend::strided_copy(Device dev, const Indexer& ix, const float* a, float* out) {
  Indexer only_a = ix;
  for (int d = 0; d < kMaxDims; ++d) only_a.strides_b[d] = 0;  // b unused: never blocks merging
  const Walk w = collapse(only_a);
  if (w.numel == 0) return;
  parallel_for(dev, w.numel, kSerialGrain, [&](i64 begin, i64 end) {
    walk_range(w, [](float x, float) { return x; }, a, a, out, begin, end);
  });
}

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

// ---- gather / scatter_add (Note [Gather geometry] in backend.h) ----------------------------

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

}  // namespace

void CpuBackend::gather(Device dev, const Indexer& ix, int dim, const float* x, const i64* index,
                        float* out) {
  DP_CHECK(dim >= 0 && dim < ix.ndim, "gather: expected a dim in [0, ", ix.ndim, "), got ", dim);
  const i64 n = indexer_numel(ix);
  parallel_for(dev, n, kSerialGrain, [&](i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) {
      i64 xo, io;
      gather_offsets(ix, dim, i, xo, io);
      out[i] = x[xo + index[io] * ix.strides_a[dim]];
    }
  });
}

void CpuBackend::scatter_add(Device dev, const Indexer& ix, int dim, const float* src,
                             const i64* index, float* y) {
  DP_CHECK(dim >= 0 && dim < ix.ndim, "scatter_add: expected a dim in [0, ", ix.ndim, "), got ", dim);
  const i64 n = indexer_numel(ix);
  // One pass in element order on the calling thread: repeated indices add in a fixed
  // order, so the gradients of gather and index_select are bitwise reproducible.
  (void)state(dev);  // checks the device
  for (i64 i = 0; i < n; ++i) {
    i64 xo, io;
    gather_offsets(ix, dim, i, xo, io);
    y[xo + index[io] * ix.strides_a[dim]] += src[i];
  }
}

}  // namespace dp::backend::cpu
