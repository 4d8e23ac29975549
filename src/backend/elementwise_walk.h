// src/backend/elementwise_walk.h — how an elementwise kernel walks memory: dimensions
// collapsed, 32-bit strided offsets by multiply-shift, elements moved in packs of 16
// bytes. The per-element math is functors.h's; this header only decides addresses.
//
// Internal to the backend layer; plain C++ with DP_HD bodies (no CUDA headers). The CUDA
// kernels (backend/cuda/cuda_elementwise.cu) call the bodies below from their grid-stride
// loops; tests/backend/elementwise_walk_test.cpp runs the same bodies on the host, one
// simulated thread after another, against a plain element-by-element loop.
//
//   const Collapsed c = collapse(ix);                        // (rows, cols) + (0, 1): 2 dims
//   const PackPlan p = plan_packs(c, 8, a, b, out, 2, true);  // 8 bf16 lanes a pack
//   if (p.lanes == 8) ... binary_packed_at<8>(f, fast_indexer(p.ix), a, b, out, v) ...
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backend/functors.h"
#include "backend/kernel_plan.h"
#include "backend/ops.h"
#include "dp/core/error.h"

namespace dp::backend::walk {

// Note [Collapsing strided dimensions]
// An elementwise op over an Indexer first drops size-1 dimensions and merges neighbours
// that are contiguous with each other in both inputs (stride[d] == stride[d+1] *
// size[d+1]). Same-shape contiguous inputs become one dimension, a bias add (rows, cols)
// with b strides (0, 1) stays two, a per-channel op over (N, C, HW) stays three. The CPU
// backend then runs an inner loop specialised for the innermost strides (1/1, 1/0, 0/1,
// general), so the common cases — same shape, scalar, row broadcast, channel broadcast —
// all reach a vectorised loop without a code path each; the CUDA backend moves packs of
// elements where the innermost dimension is dense (Note [Packed elementwise access]) and
// indexes the rest with FastIndexer.

/// An Indexer with size-1 dims dropped and mutually contiguous neighbours merged.
struct Collapsed {
  Indexer ix;
  std::int64_t numel = 1;
  bool contiguous = false;  // a and b both dense in output order: flat indexing
};

inline Collapsed collapse(const Indexer& in) {
  DP_CHECK(in.ndim >= 0 && in.ndim <= kMaxDims, "elementwise: expected at most ", kMaxDims, " dims, got ", in.ndim);
  Collapsed c;
  for (int d = 0; d < in.ndim; ++d) {
    DP_CHECK(in.sizes[d] >= 0, "elementwise: expected non-negative sizes, got ", in.sizes[d], " in dim ", d);
    c.numel *= in.sizes[d];
  }
  if (c.numel == 0) return c;
  Indexer& w = c.ix;
  for (int d = 0; d < in.ndim; ++d) {
    if (in.sizes[d] == 1) continue;
    if (w.ndim > 0) {
      const int last = w.ndim - 1;
      if (w.strides_a[last] == in.strides_a[d] * in.sizes[d] && w.strides_b[last] == in.strides_b[d] * in.sizes[d]) {
        w.sizes[last] *= in.sizes[d];
        w.strides_a[last] = in.strides_a[d];
        w.strides_b[last] = in.strides_b[d];
        continue;
      }
    }
    w.sizes[w.ndim] = in.sizes[d];
    w.strides_a[w.ndim] = in.strides_a[d];
    w.strides_b[w.ndim] = in.strides_b[d];
    ++w.ndim;
  }
  if (w.ndim == 0) {  // all sizes 1: one element at offset 0
    w.ndim = 1;
    w.sizes[0] = 1;
  }
  c.contiguous = w.ndim == 1 && w.strides_a[0] == 1 && w.strides_b[0] == 1;
  return c;
}

// Note [Strided offsets by multiply-shift]
// A strided kernel turns its flat output index into one coordinate per dimension, a
// division and a remainder each. Where kernel_plan::strided_fits_i32 holds, FastIndexer
// does them with kernel_plan::FastDivider (a multiply-high, an add and a shift) over
// 32-bit strides: the same offsets as Indexer's 64-bit divisions, several times fewer
// instructions per element, which is most of what a strided pass over 16-bit data
// spends beside its memory traffic.

/// An Indexer whose index math runs in 32 bits without a division (Note [Strided offsets
/// by multiply-shift]). Built by fast_indexer; passed by value into kernels.
struct FastIndexer {
  int ndim = 0;
  kernel_plan::FastDivider sizes[kMaxDims];
  std::int32_t strides_a[kMaxDims] = {};
  std::int32_t strides_b[kMaxDims] = {};
};

/// ix as a FastIndexer; `n` its element count. Expects kernel_plan::strided_fits_i32(ix,
/// n) and positive sizes (a collapsed, non-empty Indexer).
inline FastIndexer fast_indexer(const Indexer& ix, std::int64_t n) {
  DP_CHECK(kernel_plan::strided_fits_i32(ix, n), "elementwise: a 32-bit indexer over ", n,
           " elements whose offsets do not fit in 32 bits");
  FastIndexer f;
  f.ndim = ix.ndim;
  for (int d = 0; d < ix.ndim; ++d) {
    DP_CHECK(ix.sizes[d] >= 1, "elementwise: expected positive sizes in a 32-bit indexer, got ", ix.sizes[d]);
    f.sizes[d] = kernel_plan::FastDivider(static_cast<std::uint32_t>(ix.sizes[d]));
    f.strides_a[d] = static_cast<std::int32_t>(ix.strides_a[d]);
    f.strides_b[d] = static_cast<std::int32_t>(ix.strides_b[d]);
  }
  return f;
}

/// Offsets into a and b of output element `i` (row-major over the sizes).
DP_HD inline void offsets(const FastIndexer& ix, std::int32_t i, std::int32_t& oa, std::int32_t& ob) {
  oa = 0;
  ob = 0;
  auto rest = static_cast<std::uint32_t>(i);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int d = kMaxDims - 1; d >= 0; --d) {
    if (d >= ix.ndim) continue;  // static indices keep ix in the parameter bank
    const std::uint32_t q = ix.sizes[d].div(rest);
    const auto coord = static_cast<std::int32_t>(rest - q * ix.sizes[d].d);
    oa += coord * ix.strides_a[d];
    ob += coord * ix.strides_b[d];
    rest = q;
  }
}
DP_HD inline void offsets(const Indexer& ix, std::int64_t i, std::int64_t& oa, std::int64_t& ob) {
  oa = 0;
  ob = 0;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int d = kMaxDims - 1; d >= 0; --d) {
    if (d >= ix.ndim) continue;
    const std::int64_t q = i / ix.sizes[d];
    const std::int64_t coord = i - q * ix.sizes[d];
    oa += coord * ix.strides_a[d];
    ob += coord * ix.strides_b[d];
    i = q;
  }
}

/// The index type of an indexer: int32 for FastIndexer, int64 for Indexer.
template <typename Ix>
using index_t = std::conditional_t<std::is_same_v<Ix, FastIndexer>, std::int32_t, std::int64_t>;

// Note [Packed elementwise access]
// One element per thread moves 2 bytes per lane of a 16-bit tensor: a warp's access is
// 64 bytes where the memory system serves 128 at once or more, and a bias add, a cast
// or a head split over bf16 ran at a fraction of the GPU's bandwidth. So an elementwise
// kernel moves L adjacent elements per thread as one Pack of 16 bytes (8 lanes of a
// 16-bit type, 4 of a float; a cast sizes L by its wider side) wherever memory allows:
//  - contiguous kernels (unary, affine, axpy, GELU, casts, same-shape binary ops): every
//    pointer aligned to its pack; the last n % L elements one by one;
//  - strided binary ops and copies: after collapsing, the innermost dimension dense in
//    a and in the output (stride 1) and in b dense too or broadcast (stride 0: one value
//    fills the pack), its size and every other stride of a (and of a dense b) multiples
//    of L, the pointers aligned. The kernel then walks packs: the Indexer with the inner
//    size divided by L and a's (and a dense b's) strides in packs — a broadcast b keeps
//    its strides in elements, its inner stride 0.
// Each lane applies the same functor to the same elements as the one-element kernel,
// so the results are the same bits; only the addresses move together. The plan is a
// pure function of shapes, strides and alignment, so it is the same run to run.

inline constexpr int kPackBytes = 16;

/// Lanes of a pack of kPackBytes over the widest of the types: 8 for 16-bit types, 4
/// for float, 4 for a cast between float and a 16-bit type.
template <typename... Ts>
inline constexpr int pack_lanes = static_cast<int>(kPackBytes / std::max({sizeof(Ts)...}));

/// L adjacent elements of T, aligned to their size (a 16-byte load or store when L *
/// sizeof(T) == 16).
template <typename T, int L>
struct alignas(sizeof(T) * L) Pack {
  T v[L];
};

/// The pack at pack index `i` of p (p aligned to the pack). On the device one vector
/// access; on the host a memcpy, which is the same bytes without aliasing a T as a Pack.
template <int L, typename T>
DP_HD inline Pack<T, L> load_pack(const T* p, std::int64_t i) {
#ifdef __CUDA_ARCH__
  return reinterpret_cast<const Pack<T, L>*>(p)[i];
#else
  Pack<T, L> r;
  std::memcpy(static_cast<void*>(&r), p + i * L, sizeof(r));
  return r;
#endif
}
template <int L, typename T>
DP_HD inline void store_pack(T* p, std::int64_t i, const Pack<T, L>& v) {
#ifdef __CUDA_ARCH__
  reinterpret_cast<Pack<T, L>*>(p)[i] = v;
#else
  std::memcpy(static_cast<void*>(p + i * L), &v, sizeof(v));
#endif
}

/// True when p is aligned to `bytes` (a power of two).
inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// ---- contiguous kernels: y[i] = f(x[i]) and y[i] = f(a[i], b[i]) -------------------------

/// Packs of L a contiguous kernel over these pointers moves: `lanes` where every
/// pointer is aligned to its pack (lanes * its element size), else 1.
template <typename... Ts>
inline int contiguous_lanes(int lanes, const Ts*... p) {
  return (aligned_to(p, sizeof(Ts) * static_cast<std::size_t>(lanes)) && ...) ? lanes : 1;
}

/// y's pack v = f(x's pack v), lane by lane. y may alias x.
template <int L, typename F, typename In, typename Out>
DP_HD inline void map1_at(const F& f, const In* x, Out* y, std::int64_t v) {
  const Pack<In, L> p = load_pack<L>(x, v);
  Pack<Out, L> r;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int l = 0; l < L; ++l) r.v[l] = f(p.v[l]);
  store_pack<L>(y, v, r);
}

/// y's pack v = f(a's pack v, b's pack v), lane by lane. y may alias a or b.
template <int L, typename F, typename A, typename B, typename Out>
DP_HD inline void map2_at(const F& f, const A* a, const B* b, Out* y, std::int64_t v) {
  const Pack<A, L> pa = load_pack<L>(a, v);
  const Pack<B, L> pb = load_pack<L>(b, v);
  Pack<Out, L> r;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int l = 0; l < L; ++l) r.v[l] = f(pa.v[l], pb.v[l]);
  store_pack<L>(y, v, r);
}

/// The share of a contiguous kernel of one thread of a grid-stride loop (`first`, `stride`:
/// its global index and the grid's thread count): packs first, then the last n % L
/// elements one by one.
template <int L, typename F, typename In, typename Out>
DP_HD inline void map1_range(const F& f, const In* x, Out* y, std::int64_t n, std::int64_t first,
                             std::int64_t stride) {
  const std::int64_t packs = n / L;
  for (std::int64_t v = first; v < packs; v += stride) map1_at<L>(f, x, y, v);
  for (std::int64_t i = packs * L + first; i < n; i += stride) y[i] = f(x[i]);
}
template <int L, typename F, typename A, typename B, typename Out>
DP_HD inline void map2_range(const F& f, const A* a, const B* b, Out* y, std::int64_t n, std::int64_t first,
                             std::int64_t stride) {
  const std::int64_t packs = n / L;
  for (std::int64_t v = first; v < packs; v += stride) map2_at<L>(f, a, b, y, v);
  for (std::int64_t i = packs * L + first; i < n; i += stride) y[i] = f(a[i], b[i]);
}

// ---- strided binary ops and copies --------------------------------------------------------

/// How a strided kernel walks a collapsed Indexer: `lanes` elements a pack (1: one by
/// one), over `ix` (in packs where lanes > 1) with `n` packs; `b_broadcast`: b's inner
/// stride is 0, so one element of b fills each pack and b's offsets stay in elements.
struct PackPlan {
  int lanes = 1;
  bool b_broadcast = false;
  Indexer ix;
  std::int64_t n = 0;
};

/// The walk of collapsed `c` (c.numel > 0) with packs of `lanes` where Note [Packed
/// elementwise access] allows: a, b (null or unused when !uses_b) and the dense output
/// `out`, `elem` bytes an element.
inline PackPlan plan_packs(const Collapsed& c, int lanes, const void* a, const void* b, const void* out,
                           std::size_t elem, bool uses_b) {
  PackPlan p;
  p.ix = c.ix;
  p.n = c.numel;
  const Indexer& ix = c.ix;
  const int in = ix.ndim - 1;
  if (lanes <= 1 || in < 0 || ix.strides_a[in] != 1 || ix.sizes[in] % lanes != 0) return p;
  const bool b_dense = uses_b && ix.strides_b[in] == 1;
  if (uses_b && !b_dense && ix.strides_b[in] != 0) return p;
  for (int d = 0; d < in; ++d) {
    if (ix.strides_a[d] % lanes != 0 || (b_dense && ix.strides_b[d] % lanes != 0)) return p;
  }
  const std::size_t bytes = elem * static_cast<std::size_t>(lanes);
  if (!aligned_to(a, bytes) || !aligned_to(out, bytes) || (b_dense && !aligned_to(b, bytes))) return p;
  p.lanes = lanes;
  p.b_broadcast = uses_b && !b_dense;
  p.n = c.numel / lanes;
  p.ix.sizes[in] /= lanes;
  for (int d = 0; d < in; ++d) {
    p.ix.strides_a[d] /= lanes;
    if (b_dense) p.ix.strides_b[d] /= lanes;
  }
  // The inner strides stay: 1 (the next pack) for a and a dense b, 0 for a broadcast b.
  return p;
}

/// Calls f(lanes, b_broadcast) with the plan's kind as compile-time constants
/// (std::integral_constant<int, 1 or L>, std::bool_constant): the three kernels a
/// launcher instantiates per functor.
template <int L, typename F>
void with_pack_kind(const PackPlan& p, F&& f) {
  DP_CHECK(p.lanes == 1 || p.lanes == L, "elementwise: a plan of ", p.lanes, " lanes where 1 or ", L, " were asked");
  if (p.lanes == 1) {
    f(std::integral_constant<int, 1>{}, std::false_type{});
  } else if (p.b_broadcast) {
    f(std::integral_constant<int, L>{}, std::true_type{});
  } else {
    f(std::integral_constant<int, L>{}, std::false_type{});
  }
}

/// out's pack v = f(a, b) over the packed walk `ix` (Ix: FastIndexer or Indexer), lane by
/// lane; BBroadcast: one element of b for the whole pack (PackPlan::b_broadcast).
template <int L, bool BBroadcast, typename F, typename T, typename Ix>
DP_HD inline void binary_strided_at(const F& f, const Ix& ix, const T* a, const T* b, T* out, index_t<Ix> v) {
  index_t<Ix> oa, ob;
  offsets(ix, v, oa, ob);
  const Pack<T, L> pa = load_pack<L>(a, oa);
  Pack<T, L> r;
  if constexpr (BBroadcast) {
    const T s = b[ob];
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int l = 0; l < L; ++l) r.v[l] = f(pa.v[l], s);
  } else {
    const Pack<T, L> pb = load_pack<L>(b, ob);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int l = 0; l < L; ++l) r.v[l] = f(pa.v[l], pb.v[l]);
  }
  store_pack<L>(out, v, r);
}

/// out's pack v = a's pack at its strided offset (b unused).
template <int L, typename T, typename Ix>
DP_HD inline void copy_strided_at(const Ix& ix, const T* a, T* out, index_t<Ix> v) {
  index_t<Ix> oa, ob;
  offsets(ix, v, oa, ob);
  store_pack<L>(out, v, load_pack<L>(a, oa));
}

/// One thread's share of a strided kernel over `n` packs of the walk `ix` (PackPlan).
template <int L, bool BBroadcast, typename F, typename T, typename Ix>
DP_HD inline void binary_strided_range(const F& f, const Ix& ix, const T* a, const T* b, T* out, std::int64_t n,
                                       std::int64_t first, std::int64_t stride) {
  for (std::int64_t v = first; v < n; v += stride)
    binary_strided_at<L, BBroadcast>(f, ix, a, b, out, static_cast<index_t<Ix>>(v));
}
template <int L, typename T, typename Ix>
DP_HD inline void copy_strided_range(const Ix& ix, const T* a, T* out, std::int64_t n, std::int64_t first,
                                     std::int64_t stride) {
  for (std::int64_t v = first; v < n; v += stride) copy_strided_at<L>(ix, a, out, static_cast<index_t<Ix>>(v));
}

}  // namespace dp::backend::walk
