// CPU backend: pooling, batch norm, log-softmax and NLL loss.
//
// Hand-written loops parallel over independent planes (N*C for pooling, C for batch
// norm, rows for softmax): every output is computed by one task in a fixed order, so
// results are bitwise reproducible (Note [Deterministic reductions] in cpu_reduce.cpp).
// Batch-norm statistics are accumulated in double: a channel of a large batch holds
// 10^5..10^6 values, where a float running sum loses several digits.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_lanes.h"
#include "backend/functors.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

void check_pool_shape(const Pool2dShape& s, const char* op) {
  DP_CHECK(s.N >= 0 && s.C >= 0 && s.H > 0 && s.W > 0 && s.kernel_h > 0 && s.kernel_w > 0 &&
               s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 &&
               2 * s.pad_h <= s.kernel_h && 2 * s.pad_w <= s.kernel_w && s.P >= 0 && s.Q >= 0,
           op, ": expected positive sizes, kernel and stride, and padding at most half the "
           "kernel, got H=", s.H, " W=", s.W, " kernel=(", s.kernel_h, ",", s.kernel_w,
           ") stride=(", s.stride_h, ",", s.stride_w, ") pad=(", s.pad_h, ",", s.pad_w, ")");
  // P, Q come from the caller (floor or ceil mode); every window must start inside the
  // padded input.
  DP_CHECK((s.P - 1) * s.stride_h - s.pad_h < s.H + s.pad_h &&
               (s.Q - 1) * s.stride_w - s.pad_w < s.W + s.pad_w,
           op, ": output size (", s.P, ", ", s.Q, ") has windows outside the padded input ",
           s.H, "x", s.W);
}

// Note [Branch-free 2x2 max-pool]
// The 2x2 window's maximum is picked with selects, not branches: on real activations
// (half of them zeros after a ReLU, the rest noise) "is this one larger?" is a coin
// toss, and the branchy loop mispredicted about one comparison in two (callgrind and
// kernels_bench). Four windows are done at once in 128-bit
// vectors (GCC/Clang vector extensions: SSE2 on x86-64, NEON elsewhere, no -march
// needed): two loads per input row, de-interleaved into the windows' even and odd
// columns. The rule is the scalar one: the first maximum in row-major window order
// wins; a NaN wins over numbers, and the first NaN stays. Backward writes every input
// of a window once (the gradient at the recorded winner, zeros elsewhere) instead of
// a memset of the whole input gradient followed by a scatter. A row whose width is not
// a multiple of four ends with its last four windows done again as one vector (the
// same values written twice), not with a scalar remainder: the CNN's 14- and 7-wide
// outputs are 14 % and 43 % remainder, and their compares mispredicted as above
// (figures: docs/benchmarks/kernel-notes.md, "Max-pool 2x2 in vectors"). On a CPU with
// AVX-512 the pool with byte places and its backward run 16 windows per vector instead,
// with these loops' bits (Note [float32 max-pool in AVX-512] in cpu_pool_avx512.cpp);
// these loops stay for every other CPU and for the int64 indices.
using f32x4 = float __attribute__((vector_size(16)));
using i32x4 = std::int32_t __attribute__((vector_size(16)));
using i64x4 = std::int64_t __attribute__((vector_size(32)));
using u8x4 = std::uint8_t __attribute__((vector_size(4)));

inline f32x4 load4(const float* p) {
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline i32x4 bits(f32x4 v) {
  i32x4 b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline f32x4 select(i32x4 mask, f32x4 yes, f32x4 no) {
  const i32x4 r = (mask & bits(yes)) | (~mask & bits(no));
  f32x4 out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

/// -1 where v replaces best: v is larger, or v is the first NaN.
inline i32x4 take(f32x4 v, f32x4 best) { return (v > best) | ((v != v) & (best == best)); }

/// One output row of a 2x2/stride-2 max-pool: y[q] = max of r0[2q..2q+1], r1[2q..2q+1];
/// when `idx` is set, the winner's flat index row0 + 2q + dh*W + dw in its plane, and
/// when `where` is set, its place 2*dh + dw in the window (Note [Max-pool winners in a
/// byte]). Inlined into each caller, so that a call site's null `idx` or `where` drops
/// its branch from the vector loop (out of line it cost the 2x2 pool ~10 %).
[[gnu::always_inline]] inline void maxpool_2x2_row(const float* __restrict r0, const float* __restrict r1,
                                                   float* __restrict y, std::int64_t* __restrict idx,
                                                   std::uint8_t* __restrict where, i64 Q, i64 W, i64 row0) {
  i64 q = 0;
  const i32x4 lane{0, 2, 4, 6};
  const i32x4 w = {static_cast<std::int32_t>(W), static_cast<std::int32_t>(W),
                   static_cast<std::int32_t>(W), static_cast<std::int32_t>(W)};
  // 32-bit index arithmetic inside the vector: a plane's flat index fits (checked by
  // the caller), the int64 conversion happens at the store.
  auto four = [&](i64 q) {
    const f32x4 a0 = load4(r0 + 2 * q), a1 = load4(r0 + 2 * q + 4);
    const f32x4 b0 = load4(r1 + 2 * q), b1 = load4(r1 + 2 * q + 4);
    const f32x4 a = __builtin_shufflevector(a0, a1, 0, 2, 4, 6);  // top-left
    const f32x4 b = __builtin_shufflevector(a0, a1, 1, 3, 5, 7);  // top-right
    const f32x4 c = __builtin_shufflevector(b0, b1, 0, 2, 4, 6);  // bottom-left
    const f32x4 d = __builtin_shufflevector(b0, b1, 1, 3, 5, 7);  // bottom-right
    f32x4 best = a;
    i32x4 dh = {0, 0, 0, 0}, dw = {0, 0, 0, 0};
    const i32x4 tb = take(b, best);
    best = select(tb, b, best);
    dw = (tb & 1) | (~tb & dw);
    const i32x4 tc = take(c, best);
    best = select(tc, c, best);
    dh = (tc & 1) | (~tc & dh);
    dw = ~tc & dw;
    const i32x4 td = take(d, best);
    best = select(td, d, best);
    dh = (td & 1) | (~td & dh);
    dw = (td & 1) | (~td & dw);
    std::memcpy(y + q, &best, sizeof best);
    if (idx) {
      const std::int32_t base = static_cast<std::int32_t>(row0 + 2 * q);
      const i32x4 flat = base + lane + dh * w + dw;
      const i64x4 wide = __builtin_convertvector(flat, i64x4);
      std::memcpy(idx + q, &wide, sizeof wide);
    }
    if (where) {
      const u8x4 place = __builtin_convertvector(dh * 2 + dw, u8x4);
      std::memcpy(where + q, &place, sizeof place);
    }
  };
  for (; q + 4 <= Q; q += 4) four(q);
  // The last Q % 4 outputs: the last four again, overlapping (the same values written
  // twice), not a scalar loop whose data-dependent compares mispredict; a 14-wide
  // layer's rows are half tail.
  if (q < Q && Q >= 4) {
    four(Q - 4);
    return;
  }
  for (; q < Q; ++q) {
    const float v[4] = {r0[2 * q], r0[2 * q + 1], r1[2 * q], r1[2 * q + 1]};
    float best = v[0];
    int k = 0;
    for (int j = 1; j < 4; ++j) {
      const bool t = v[j] > best || (v[j] != v[j] && best == best);
      best = t ? v[j] : best;
      k = t ? j : k;
    }
    y[q] = best;
    if (idx) idx[q] = row0 + 2 * q + (k >> 1) * W + (k & 1);
    if (where) where[q] = static_cast<std::uint8_t>(k);
  }
}

/// Four windows' input gradients (top-left, top-right, bottom-left, bottom-right of
/// each, one window per lane) interleaved into two rows of eight inputs.
inline void store_windows(f32x4 tl, f32x4 tr, f32x4 bl, f32x4 br, float* __restrict top,
                          float* __restrict bottom) {
  const f32x4 top0 = __builtin_shufflevector(tl, tr, 0, 4, 1, 5);
  const f32x4 top1 = __builtin_shufflevector(tl, tr, 2, 6, 3, 7);
  const f32x4 bot0 = __builtin_shufflevector(bl, br, 0, 4, 1, 5);
  const f32x4 bot1 = __builtin_shufflevector(bl, br, 2, 6, 3, 7);
  std::memcpy(top, &top0, sizeof top0);
  std::memcpy(top + 4, &top1, sizeof top1);
  std::memcpy(bottom, &bot0, sizeof bot0);
  std::memcpy(bottom + 4, &bot1, sizeof bot1);
}

/// One plane of a 2x2/stride-2 max-pool's input gradient, written once: gp gets gy at
/// each window's recorded winner and zero elsewhere (rows and columns no window covers
/// included). Returns false, having written nothing of use, when an index lies outside
/// its own window (indices that maxpool2d_forward did not produce): the caller then
/// takes the general scatter, which reports or accepts them as before.
bool tile_2x2_backward(const Pool2dShape& s, const float* __restrict gyp, const i64* __restrict ip,
                       float* __restrict gp) {
  const i64 W = s.W;
  const f32x4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
  const i32x4 wv = {static_cast<std::int32_t>(W), static_cast<std::int32_t>(W),
                    static_cast<std::int32_t>(W), static_cast<std::int32_t>(W)};
  const i32x4 lane = {0, 2, 4, 6};
  i32x4 outside = {0, 0, 0, 0};  // accumulated, not branched on
  bool inside = true;
  for (i64 p = 0; p < s.P; ++p) {
    float* __restrict g0 = gp + 2 * p * W;
    float* __restrict g1 = g0 + W;
    const i64* __restrict ir = ip + p * s.Q;
    const float* __restrict gr = gyp + p * s.Q;
    const i64 row0 = 2 * p * W;
    i64 q = 0;
    auto four = [&](i64 q) {
      i64x4 wide;
      std::memcpy(&wide, ir + q, sizeof wide);
      // The offset inside the window: 0, 1, W or W + 1 (64-bit first: a bad index
      // must not wrap into a good one).
      const i64x4 off64 = wide - static_cast<std::int64_t>(row0 + 2 * q) -
                          __builtin_convertvector(lane, i64x4);
      const i64x4 bad64 = (off64 < 0) | (off64 > static_cast<std::int64_t>(W + 1));
      outside |= __builtin_convertvector(bad64, i32x4);
      const i32x4 off = __builtin_convertvector(off64, i32x4);
      const f32x4 g = load4(gr + q);
      const f32x4 tl = select(off == 0, g, zero), tr = select(off == 1, g, zero);
      const f32x4 bl = select(off == wv, g, zero), br = select(off == wv + 1, g, zero);
      outside |= ~((off == 0) | (off == 1) | (off == wv) | (off == wv + 1));
      store_windows(tl, tr, bl, br, g0 + 2 * q, g1 + 2 * q);
    };
    for (; q + 4 <= s.Q; q += 4) four(q);
    if (q < s.Q && s.Q >= 4) {  // the last four windows again, as in maxpool_2x2_row
      four(s.Q - 4);
      q = s.Q;
    }
    for (; q < s.Q; ++q) {
      const i64 off = ir[q] - row0 - 2 * q;
      const float g = gr[q];
      g0[2 * q] = off == 0 ? g : 0.0f;
      g0[2 * q + 1] = off == 1 ? g : 0.0f;
      g1[2 * q] = off == W ? g : 0.0f;
      g1[2 * q + 1] = off == W + 1 ? g : 0.0f;
      inside &= off == 0 || off == 1 || off == W || off == W + 1;
    }
    for (i64 w = 2 * s.Q; w < W; ++w) g0[w] = g1[w] = 0.0f;  // an odd last column
  }
  for (i64 i = 2 * s.P * W; i < s.H * W; ++i) gp[i] = 0.0f;  // an odd last row
  for (int l = 0; l < 4; ++l) inside &= outside[l] == 0;
  return inside;
}

/// One plane of the input gradient from byte places (maxpool2d_2x2_backward): gp gets
/// gy at each window's place and zero elsewhere, every element written once. kMask:
/// gy masked by the pool's output yp first, yp > 0 ? gy : 0 (Binary<ReluBackward>).
template <bool kMask>
void tile_2x2_backward_bytes(const Pool2dShape& s, const float* __restrict gyp, const std::uint8_t* __restrict wp,
                             const float* __restrict yp, float* __restrict gp) {
  const Binary<BinaryOp::ReluBackward> relu_backward;
  const i64 W = s.W;
  const f32x4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
  const i32x4 c0 = {0, 0, 0, 0}, c1 = c0 + 1, c2 = c0 + 2, c3 = c0 + 3;
  for (i64 p = 0; p < s.P; ++p) {
    float* __restrict g0 = gp + 2 * p * W;
    float* __restrict g1 = g0 + W;
    const std::uint8_t* __restrict pr = wp + p * s.Q;
    const float* __restrict gr = gyp + p * s.Q;
    const float* __restrict yr = kMask ? yp + p * s.Q : nullptr;
    auto four = [&](i64 q) {
      u8x4 bytes;
      std::memcpy(&bytes, pr + q, sizeof bytes);
      const i32x4 place = __builtin_convertvector(bytes, i32x4);
      f32x4 g = load4(gr + q);
      if constexpr (kMask) g = select(load4(yr + q) > zero, g, zero);  // false for NaN, as y > 0
      const f32x4 tl = select(place == c0, g, zero), tr = select(place == c1, g, zero);
      const f32x4 bl = select(place == c2, g, zero), br = select(place == c3, g, zero);
      store_windows(tl, tr, bl, br, g0 + 2 * q, g1 + 2 * q);
    };
    i64 q = 0;
    for (; q + 4 <= s.Q; q += 4) four(q);
    if (q < s.Q && s.Q >= 4) {  // the last four windows again, as in maxpool_2x2_row
      four(s.Q - 4);
      q = s.Q;
    }
    for (; q < s.Q; ++q) {
      const std::uint8_t k = pr[q];
      const float g = kMask ? relu_backward(gr[q], yr[q]) : gr[q];
      g0[2 * q] = k == 0 ? g : 0.0f;
      g0[2 * q + 1] = k == 1 ? g : 0.0f;
      g1[2 * q] = k == 2 ? g : 0.0f;
      g1[2 * q + 1] = k == 3 ? g : 0.0f;
    }
    for (i64 w = 2 * s.Q; w < W; ++w) g0[w] = g1[w] = 0.0f;  // an odd last column
  }
  for (i64 i = 2 * s.P * W; i < s.H * W; ++i) gp[i] = 0.0f;  // an odd last row
}

/// Throws unless `s` is valid and the window maxpool2d_2x2_forward/backward take (Note
/// [Max-pool winners in a byte]).
void check_2x2_inside(const Pool2dShape& s, const char* op) {
  check_pool_shape(s, op);
  DP_CHECK(is_2x2_tiling(s), op, ": expected a 2x2 window, stride 2, no padding, every window inside the input; got kernel ",
           s.kernel_h, "x", s.kernel_w, ", stride ", s.stride_h, "x", s.stride_w, ", padding ", s.pad_h, "x",
           s.pad_w, ", output ", s.P, "x", s.Q, " of ", s.H, "x", s.W);
}

/// Planes per task so a task holds at least ~kSerialGrain elements of work.
i64 plane_grain(i64 plane_work) { return std::max<i64>(1, kSerialGrain / std::max<i64>(1, plane_work)); }

}  // namespace

// ---- pooling ---------------------------------------------------------------------------

namespace {

/// One plane of a max-pool over any window: yp, and the winners' flat indices in ip
/// when it is not null.
void maxpool_plane(const Pool2dShape& s, const float* __restrict xp, float* __restrict yp, i64* __restrict ip) {
  for (i64 p = 0; p < s.P; ++p) {
    const i64 h0 = p * s.stride_h - s.pad_h;
    const i64 hs = std::max<i64>(h0, 0), he = std::min(h0 + s.kernel_h, s.H);
    for (i64 q = 0; q < s.Q; ++q) {
      const i64 w0 = q * s.stride_w - s.pad_w;
      const i64 ws = std::max<i64>(w0, 0), we = std::min(w0 + s.kernel_w, s.W);
      // Padding never wins: only real elements are candidates. Strict > keeps the
      // first maximum in row-major window order; a NaN wins and stays.
      float best = -std::numeric_limits<float>::infinity();
      i64 best_i = hs * s.W + ws;
      for (i64 h = hs; h < he; ++h)
        for (i64 w = ws; w < we; ++w) {
          const float v = xp[h * s.W + w];
          if (v > best || (v != v && best == best)) {
            best = v;
            best_i = h * s.W + w;
          }
        }
      yp[p * s.Q + q] = best;
      if (ip) ip[p * s.Q + q] = best_i;
    }
  }
}

/// One plane of a 2x2 max-pool with byte places (Note [Max-pool winners in a byte]):
/// yp and wp.
void maxpool_2x2_plane(const Pool2dShape& s, const float* xp, float* yp, std::uint8_t* wp) {
  for (i64 p = 0; p < s.P; ++p) {
    const float* r0 = xp + 2 * p * s.W;
    const i64 o = p * s.Q;
    maxpool_2x2_row(r0, r0 + s.W, yp + o, nullptr, wp + o, s.Q, s.W, 2 * p * s.W);
  }
}

/// One plane of the input gradient from flat indices: zeros, then each window's
/// gradient (masked by the pool's output ryp first when it is not null, as
/// Binary<ReluBackward>) added at its winner, in output order (deterministic).
void maxpool_backward_plane(const Pool2dShape& s, const float* __restrict gyp, const i64* __restrict ip,
                            const float* __restrict ryp, float* __restrict gp) {
  const Binary<BinaryOp::ReluBackward> relu_backward;
  const i64 hw = s.H * s.W, pq = s.P * s.Q;
  std::memset(gp, 0, static_cast<std::size_t>(hw) * sizeof(float));
  for (i64 j = 0; j < pq; ++j) {
    DP_ASSERT(ip[j] >= 0 && ip[j] < hw, "maxpool index ", ip[j], " outside plane of ", hw);
    gp[ip[j]] += ryp ? relu_backward(gyp[j], ryp[j]) : gyp[j];
  }
}

/// One plane of the input gradient from byte places (tile_2x2_backward_bytes), masked
/// by ryp when it is not null.
void maxpool_2x2_backward_plane(const Pool2dShape& s, const float* gyp, const std::uint8_t* wp, const float* ryp,
                                float* gp) {
  if (ryp) {
    tile_2x2_backward_bytes<true>(s, gyp, wp, ryp, gp);
  } else {
    tile_2x2_backward_bytes<false>(s, gyp, wp, nullptr, gp);
  }
}

}  // namespace

/// Planes [begin, end) of the input gradient from byte places, masked by ry when it is
/// not null: in AVX-512 registers where the CPU has them (Note [float32 max-pool in
/// AVX-512] in cpu_pool_avx512.cpp), else plane by plane above, with the same bits.
void maxpool_2x2_backward_planes(const Pool2dShape& s, const float* gy, const std::uint8_t* where, const float* ry,
                                 float* gx, i64 begin, i64 end) {
  const i64 hw = s.H * s.W, pq = s.P * s.Q;
  if (maxpool_2x2_backward_avx512(gy + begin * pq, where + begin * pq, ry ? ry + begin * pq : nullptr, gx + begin * hw,
                                  end - begin, s.H, s.W, s.P, s.Q))
    return;
  for (i64 pl = begin; pl < end; ++pl)
    maxpool_2x2_backward_plane(s, gy + pl * pq, where + pl * pq, ry ? ry + pl * pq : nullptr, gx + pl * hw);
}


void CpuBackend::maxpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y,
                                   i64* indices) {
  check_pool_shape(s, "maxpool2d_forward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  // The 2×2, stride-2, unpadded window (every CNN's downsampling) is specialised: no
  // clipping, four fixed loads, selects instead of branches (Note [Branch-free 2x2
  // max-pool]). Only when every window lies inside the input (ceil mode's last window
  // may hang over the edge) and a plane's flat indices fit in 32 bits.
  const bool two_by_two = is_2x2_tiling(s) && hw < (i64{1} << 31);
  parallel_for(dev, planes, plane_grain(pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      const float* xp = x + pl * hw;
      float* yp = y + pl * pq;
      i64* ip = indices ? indices + pl * pq : nullptr;
      if (two_by_two) {
        for (i64 p = 0; p < s.P; ++p) {
          const float* r0 = xp + 2 * p * s.W;
          maxpool_2x2_row(r0, r0 + s.W, yp + p * s.Q, ip ? ip + p * s.Q : nullptr, nullptr, s.Q, s.W,
                          2 * p * s.W);
        }
      } else {
        maxpool_plane(s, xp, yp, ip);
      }
    }
  });
}

void CpuBackend::maxpool2d_backward(Device dev, const Pool2dShape& s, const float* gy,
                                    const i64* indices, float* gx) {
  check_pool_shape(s, "maxpool2d_backward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  // Non-overlapping 2x2 windows tile the input: each input element gets its window's
  // gradient or zero, written once (Note [Branch-free 2x2 max-pool]).
  const bool two_by_two = is_2x2_tiling(s);
  parallel_for(dev, planes, plane_grain(hw + pq), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      float* gp = gx + pl * hw;
      const float* gyp = gy + pl * pq;
      const i64* ip = indices + pl * pq;
      if (two_by_two && tile_2x2_backward(s, gyp, ip, gp)) continue;
      maxpool_backward_plane(s, gyp, ip, nullptr, gp);
    }
  });
}

// Note [Max-pool winners in a byte]
// A 2x2 window has four places, and max-pool's backward needs only which one won: one
// byte per output instead of the int64 flat index PyTorch's max_pool2d_with_indices
// returns. The winners are the backend's own (Note [Max-pool winners]: nn::max_pool2d
// returns none), so this backend's MaxPool2d keeps bytes for the 2x2 windows every CNN
// uses: for the Fashion-MNIST CNN's first pool, batch 256, 1.6 MB instead of 12.8 MB
// written by forward, kept until backward and read by it — a quarter of the pool's
// memory traffic each way, and that much less memory held between the passes. y and
// the input gradient are those of maxpool2d_forward and maxpool2d_backward bit for bit
// (cpu_backend_test).

void maxpool_2x2_planes(const Pool2dShape& s, const float* x, float* y, std::uint8_t* where, i64 begin, i64 end) {
  const i64 hw = s.H * s.W, pq = s.P * s.Q;
  // Note [float32 max-pool in AVX-512] (cpu_pool_avx512.cpp): the same bits.
  if (maxpool_2x2_avx512(x + begin * hw, y + begin * pq, where + begin * pq, end - begin, s.H, s.W, s.P, s.Q)) return;
  for (i64 pl = begin; pl < end; ++pl) maxpool_2x2_plane(s, x + pl * hw, y + pl * pq, where + pl * pq);
}

void CpuBackend::maxpool2d_2x2_forward(Device dev, const Pool2dShape& s, const float* x, float* y,
                                       std::uint8_t* where) {
  check_2x2_inside(s, "maxpool2d_2x2_forward");
  parallel_for(dev, s.N * s.C, plane_grain(s.P * s.Q * 4),
               [&](i64 b, i64 e) { maxpool_2x2_planes(s, x, y, where, b, e); });
}

void CpuBackend::maxpool2d_2x2_backward(Device dev, const Pool2dShape& s, const float* gy,
                                        const std::uint8_t* where, const float* relu_y, float* gx) {
  check_2x2_inside(s, "maxpool2d_2x2_backward");
  parallel_for(dev, s.N * s.C, plane_grain(s.H * s.W + s.P * s.Q),
               [&](i64 b, i64 e) { maxpool_2x2_backward_planes(s, gy, where, relu_y, gx, b, e); });
}

// Note [16-bit max-pool]
// A bfloat16 or float16 max-pool (the CNN under autocast) reads and writes its
// tensors in their own dtype. Each plane is widened (exactly) into a float32 block
// that stays in cache, pooled there by the float32 plane loops above, and its output
// rounded once: a maximum is one of its inputs, so the rounding gives that input back,
// and the pool is bit for bit the float32 pool of the widened tensor, rounded — what
// the widening path computed, without writing the float32 activation out and reading
// it back. Backward rounds the input gradient once per plane as well (exact unless
// overlapping windows sum). The winners are the float32 kernels' (Note [Max-pool
// winners]). bfloat16's 2x2 windows, the CNN's, skip the float32 block: they are pooled
// on their bits, forward and backward (Note [bfloat16 max-pool on its bits] in
// cpu_pool_clones.cpp), with the same bits.

bool CpuBackend::max_pool2d_byte_winners(const Pool2dShape& s) const { return is_2x2_tiling(s); }

namespace {

/// n values widened to float32 (exactly), or rounded from it (once).
template <typename T>
void widen(const T* __restrict from, float* __restrict to, i64 n) {
  for (i64 i = 0; i < n; ++i) to[i] = static_cast<float>(from[i]);
}
template <typename T>
void round_to(const float* __restrict from, T* __restrict to, i64 n) {
  for (i64 i = 0; i < n; ++i) to[i] = T(from[i]);
}
// bfloat16's as integer loops the compiler vectorises: the bits of the conversions above.
template <>
void widen(const BFloat16* __restrict from, float* __restrict to, i64 n) {
  const auto* u = reinterpret_cast<const std::uint16_t*>(from);
  auto* v = reinterpret_cast<std::uint32_t*>(to);
  for (i64 i = 0; i < n; ++i) v[i] = std::uint32_t{u[i]} << 16;
}
template <>
void round_to(const float* __restrict from, BFloat16* __restrict to, i64 n) {
  const auto* u = reinterpret_cast<const std::uint32_t*>(from);
  auto* r = reinterpret_cast<std::uint16_t*>(to);
  for (i64 i = 0; i < n; ++i) {  // BFloat16::round_bits without its branch
    const std::uint32_t rounded = (u[i] + 0x7FFFu + ((u[i] >> 16) & 1u)) >> 16;
    r[i] = (u[i] & 0x7FFFFFFFu) > 0x7F800000u ? std::uint16_t{0xFFFF} : static_cast<std::uint16_t>(rounded);
  }
}

}  // namespace

void maxpool_2x2_planes(const Pool2dShape& s, const BFloat16* x, BFloat16* y, std::uint8_t* where, i64 begin,
                        i64 end, bool relu) {
  const i64 hw = s.H * s.W, pq = s.P * s.Q;
  maxpool_2x2_bf16(reinterpret_cast<const std::uint16_t*>(x + begin * hw),
                   reinterpret_cast<std::uint16_t*>(y + begin * pq), where + begin * pq, end - begin, s.H, s.W, s.P,
                   s.Q, relu);
}

namespace {

/// The MaxPool2d kernel: the byte places for a 2x2 tiling (Note [Max-pool winners in a
/// byte]), int64 flat indices otherwise; 16-bit dtypes plane by plane in float32 (Note
/// [16-bit max-pool]).
template <typename T>
void maxpool_kernel(CpuBackend& be, Device dev, const MaxPool2dArgs& a) {
  const Pool2dShape& s = a.s;
  const bool bytes = be.max_pool2d_byte_winners(s);
  auto* where = static_cast<std::uint8_t*>(a.winners);
  auto* idx = static_cast<i64*>(a.winners);
  if constexpr (std::is_same_v<T, float>) {
    if (bytes) {
      be.maxpool2d_2x2_forward(dev, s, static_cast<const float*>(a.x), static_cast<float*>(a.y), where);
    } else {
      be.maxpool2d_forward(dev, s, static_cast<const float*>(a.x), static_cast<float*>(a.y), idx);
    }
  } else {
    check_pool_shape(s, "maxpool2d_forward");
    const i64 hw = s.H * s.W, pq = s.P * s.Q;
    const auto* x = static_cast<const T*>(a.x);
    auto* y = static_cast<T*>(a.y);
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (bytes) {  // Note [bfloat16 max-pool on its bits]
        be.parallel_for(dev, s.N * s.C, plane_grain(pq * 4),
                        [&](i64 b, i64 e) { maxpool_2x2_planes(s, x, y, where, b, e); });
        return;
      }
    }
    be.parallel_for(dev, s.N * s.C, plane_grain(pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
      std::vector<float> xf(static_cast<std::size_t>(hw)), yf(static_cast<std::size_t>(pq));
      for (i64 pl = b; pl < e; ++pl) {
        widen(x + pl * hw, xf.data(), hw);
        if (bytes) {
          maxpool_2x2_planes(s, xf.data(), yf.data(), where + pl * pq, 0, 1);
        } else {
          maxpool_plane(s, xf.data(), yf.data(), idx ? idx + pl * pq : nullptr);
        }
        round_to(yf.data(), y + pl * pq, pq);
      }
    });
  }
}

/// The MaxPool2dBackward kernel, with the ReLU mask in the same pass.
template <typename T>
void maxpool_backward_kernel(CpuBackend& be, Device dev, const MaxPool2dBackwardArgs& a) {
  const Pool2dShape& s = a.s;
  const bool bytes = be.max_pool2d_byte_winners(s);
  if (bytes) {
    check_2x2_inside(s, "maxpool2d_backward");
  } else {
    check_pool_shape(s, "maxpool2d_backward");
  }
  const auto* where = static_cast<const std::uint8_t*>(a.winners);
  const auto* idx = static_cast<const i64*>(a.winners);
  const i64 hw = s.H * s.W, pq = s.P * s.Q;
  if constexpr (std::is_same_v<T, float>) {
    if (bytes) {
      be.maxpool2d_2x2_backward(dev, s, static_cast<const float*>(a.gy), where, static_cast<const float*>(a.relu_y),
                                static_cast<float*>(a.gx));
      return;
    }
    const auto* gy = static_cast<const float*>(a.gy);
    const auto* ry = static_cast<const float*>(a.relu_y);
    auto* gx = static_cast<float*>(a.gx);
    be.parallel_for(dev, s.N * s.C, plane_grain(hw + pq), [&](i64 b, i64 e) {
      for (i64 pl = b; pl < e; ++pl)
        maxpool_backward_plane(s, gy + pl * pq, idx + pl * pq, ry ? ry + pl * pq : nullptr, gx + pl * hw);
    });
  } else {
    const auto* gy = static_cast<const T*>(a.gy);
    const auto* ry = static_cast<const T*>(a.relu_y);
    auto* gx = static_cast<T*>(a.gx);
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (bytes) {  // Note [bfloat16 max-pool on its bits]
        auto bits = [](const BFloat16* p) { return reinterpret_cast<const std::uint16_t*>(p); };
        be.parallel_for(dev, s.N * s.C, plane_grain(hw + pq), [&](i64 b, i64 e) {
          maxpool_2x2_backward_bf16(bits(gy + b * pq), where + b * pq, ry ? bits(ry + b * pq) : nullptr,
                                    reinterpret_cast<std::uint16_t*>(gx + b * hw), e - b, s.H, s.W, s.P, s.Q);
        });
        return;
      }
    }
    be.parallel_for(dev, s.N * s.C, plane_grain(hw + pq), [&](i64 b, i64 e) {
      std::vector<float> gyf(static_cast<std::size_t>(pq)), ryf(ry ? static_cast<std::size_t>(pq) : 0),
          gxf(static_cast<std::size_t>(hw));
      for (i64 pl = b; pl < e; ++pl) {
        widen(gy + pl * pq, gyf.data(), pq);
        if (ry) widen(ry + pl * pq, ryf.data(), pq);
        const float* ryp = ry ? ryf.data() : nullptr;
        if (bytes) {
          maxpool_2x2_backward_planes(s, gyf.data(), where + pl * pq, ryp, gxf.data(), 0, 1);
        } else {
          maxpool_backward_plane(s, gyf.data(), idx + pl * pq, ryp, gxf.data());
        }
        round_to(gxf.data(), gx + pl * hw, hw);
      }
    });
  }
}

// Note [Fused LayerNorm]
// nn::layer_norm of a float32 input was nine tensor ops forward (two means, a
// subtraction, a square, a square root, a division, the affine) and their backward
// functions, each a pass over the (rows, cols) activations with its own output kept for
// the graph: 9 LayerNorms of a GPT's 2048 x 128 activations took about a tenth of its
// step. Op::LayerNorm and Op::LayerNormBackward are one pass each over a row at a time,
// as PyTorch's native layer norm: the forward keeps mean and rstd per row, the backward
// forms x̂ = (x - mean) · rstd again and
//     gx = rstd · (g - mean(g) - x̂ · mean(g · x̂)),   g = gy · w,
// with the weight and bias gradients summed over rows. A row's sums run as the
// reductions' (fold_lanes: 16 float32 lanes, then a pairwise tree), so a row's values
// never depend on how rows are split among
// threads; gw and gb are summed per block of kLayerNormRows rows and the blocks added in
// block order: the shape alone fixes every order, so the designs stay bitwise alike. The
// values are the composed ops' to float32 rounding (nn_layer_norm_test compares them).
//
// Note [An exact mean for a constant row]
// The mean sum(x) / cols rounds twice, so for a row of one value c it may land an ulp or
// two off c, and then every x - mean is that small difference times rstd, which for a
// zero variance is 1 / sqrt(eps): about 3e-5 of noise became 0.01 in the output, where
// PyTorch (Welford's update, whose mean stays c) gives exactly the bias. A row of
// padding, or of one repeated embedding, is such a row. A second pass adds the mean of
// the residuals x - mean: for a constant row each residual is the same small float d,
// their sum cols·d is exact (d has a few significant bits), times 1/cols it rounds back
// to d, and mean + d is c exactly, so the output is the bias; for any other row it is
// the classic correction of a two-pass mean, as accurate or more. The CUDA kernel does
// the same (Note [Fused LayerNorm on CUDA]).
//
// Note [Layer norm's input gradient, centred]
// gx = rstd · (g − mean(g) − x̂ · mean(g · x̂)) takes the x̂ of the exact mean, whose sum
// is 0. The x̂ formed from the stored float mean sums to rstd · n · δ instead, δ that
// mean's rounding (up to half an ulp of the mean), and where the two terms nearly cancel
// — a row whose spread is small beside its mean, or of few values, whose output barely
// moves with x — that δ is most of what is left: the op fuzzer's program 45790 (a row of
// two values 1.906 and 1.825) got −0.0124753 and 0.0124692 where the gradient is
// ∓0.0124968 and PyTorch's float32 ∓0.0124969. So the backward subtracts c = mean(x̂)
// from x̂, and mean(g · (x̂ − c)) = mean(g · x̂) − c · mean(g): the row gives ∓0.0124973.
// (A float32 emulation of both formulas over random rows of 768 values, offsets up to
// 100, put the old one's worst error at 1.4e-5 of the row's largest gradient and this
// one's at 7e-7.) The weight's gradient keeps the forward's x̂, which is what the
// output was made of. CUDA's backward does the same. The CPU takes Σ g, Σ x̂ and Σ g x̂ in
// one pass over the row (sum_lanes), so the extra sum costs no extra pass (figures:
// docs/benchmarks/kernel-notes.md, "Layer norm's centred input gradient").
constexpr i64 kLayerNormRows = 64;

/// Σ f(j) over j in [0, n), as the reductions sum (fold_lanes).
template <typename F>
inline float lane_sum(i64 n, F f) {
  return fold_lanes<SumOp>(n, f);
}

void layer_norm_kernel(CpuBackend& be, Device dev, const LayerNormArgs& a) {
  const auto* x = static_cast<const float*>(a.x);
  const auto* w = static_cast<const float*>(a.w);
  const auto* b = static_cast<const float*>(a.b);
  auto* y = static_cast<float*>(a.y);
  const i64 cols = a.cols;
  const float inv_cols = cols > 0 ? 1.0f / static_cast<float>(cols) : 0.0f;
  be.parallel_for(dev, a.rows, std::max<i64>(1, kSerialGrain / std::max<i64>(cols, 1)), [&](i64 r0, i64 r1) {
    for (i64 r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      // Note [An exact mean for a constant row].
      const float mu0 = lane_sum(cols, [&](i64 j) { return xr[j]; }) * inv_cols;
      const float mu = mu0 + lane_sum(cols, [&](i64 j) { return xr[j] - mu0; }) * inv_cols;
      const float var = lane_sum(cols, [&](i64 j) { const float d = xr[j] - mu; return d * d; }) * inv_cols;
      const float rs = 1.0f / std::sqrt(var + a.eps);
      a.mean[r] = mu;
      a.rstd[r] = rs;
      for (i64 j = 0; j < cols; ++j) {
        float v = (xr[j] - mu) * rs;
        if (w) v *= w[j];
        if (b) v += b[j];
        yr[j] = v;
      }
    }
  });
}

void layer_norm_backward_kernel(CpuBackend& be, Device dev, const LayerNormBackwardArgs& a) {
  const auto* x = static_cast<const float*>(a.x);
  const auto* w = static_cast<const float*>(a.w);
  const auto* gy = static_cast<const float*>(a.gy);
  auto* gx = static_cast<float*>(a.gx);
  const i64 rows = a.rows, cols = a.cols;
  const float inv_cols = cols > 0 ? 1.0f / static_cast<float>(cols) : 0.0f;
  const bool params = a.gw || a.gb;
  const i64 blocks = (rows + kLayerNormRows - 1) / kLayerNormRows;
  // Per block: its rows' gw then gb partial sums (Note [Fused LayerNorm]).
  std::vector<float> partial(params ? static_cast<std::size_t>(blocks * 2 * cols) : 0, 0.0f);
  be.parallel_chunks(dev, blocks, [&](i64 blk) {
    float* pw = params ? partial.data() + blk * 2 * cols : nullptr;
    float* pb = params ? pw + cols : nullptr;
    std::vector<float> g(static_cast<std::size_t>(cols));
    for (i64 r = blk * kLayerNormRows; r < std::min(rows, (blk + 1) * kLayerNormRows); ++r) {
      const float* xr = x + r * cols;
      const float* gr = gy + r * cols;
      float* gxr = gx + r * cols;
      const float mu = a.mean[r], rs = a.rstd[r];
      for (i64 j = 0; j < cols; ++j) g[static_cast<std::size_t>(j)] = w ? gr[j] * w[j] : gr[j];
      const float* gp = g.data();
      // Σ g, Σ x̂ and Σ g x̂ in one pass; Note [Layer norm's input gradient, centred]: x̂
      // less its own mean c.
      float sums[3];
      sum_lanes<3>(cols, [&](i64 j) {
        const float xh = (xr[j] - mu) * rs;
        return std::array<float, 3>{gp[j], xh, gp[j] * xh};
      }, sums);
      const float g_mean = sums[0] * inv_cols, c = sums[1] * inv_cols;
      const float gx_mean = sums[2] * inv_cols - c * g_mean;
      if (params) {  // two loops without a branch in them: both vectorise
        for (i64 j = 0; j < cols; ++j) {
          const float xh = (xr[j] - mu) * rs;
          gxr[j] = rs * (gp[j] - g_mean - (xh - c) * gx_mean);
          pw[j] += gr[j] * xh;
          pb[j] += gr[j];
        }
      } else {
        for (i64 j = 0; j < cols; ++j) gxr[j] = rs * (gp[j] - g_mean - ((xr[j] - mu) * rs - c) * gx_mean);
      }
    }
  });
  if (!params) return;
  for (i64 j = 0; j < cols; ++j) {  // the blocks in block order
    float sw = 0.0f, sb = 0.0f;
    for (i64 blk = 0; blk < blocks; ++blk) {
      sw += partial[static_cast<std::size_t>(blk * 2 * cols + j)];
      sb += partial[static_cast<std::size_t>(blk * 2 * cols + cols + j)];
    }
    if (a.gw) a.gw[j] = sw;
    if (a.gb) a.gb[j] = sb;
  }
}

}  // namespace

void CpuBackend::register_layer_norm_kernels() {
  register_typed<Op::LayerNorm, CpuBackend, &layer_norm_kernel>(DType::F32);
  register_typed<Op::LayerNormBackward, CpuBackend, &layer_norm_backward_kernel>(DType::F32);
}

void CpuBackend::register_pool_kernels() {
  register_typed<Op::MaxPool2d, CpuBackend, &maxpool_kernel<float>>(DType::F32);
  register_typed<Op::MaxPool2dBackward, CpuBackend, &maxpool_backward_kernel<float>>(DType::F32);
  register_typed<Op::MaxPool2d, CpuBackend, &maxpool_kernel<BFloat16>>(DType::BF16);
  register_typed<Op::MaxPool2dBackward, CpuBackend, &maxpool_backward_kernel<BFloat16>>(DType::BF16);
  register_typed<Op::MaxPool2d, CpuBackend, &maxpool_kernel<Float16>>(DType::F16);
  register_typed<Op::MaxPool2dBackward, CpuBackend, &maxpool_backward_kernel<Float16>>(DType::F16);
}

// Window [h0, h0 + kernel) clipped to the padded input [-pad, H + pad): PyTorch's divisor
// with count_include_pad=true (equal to kernel_h * kernel_w unless ceil mode clips it).
static inline i64 avg_divisor(const Pool2dShape& s, i64 h0, i64 w0) {
  const i64 he = std::min(h0 + s.kernel_h, s.H + s.pad_h), we = std::min(w0 + s.kernel_w, s.W + s.pad_w);
  return (he - h0) * (we - w0);
}

void CpuBackend::avgpool2d_forward(Device dev, const Pool2dShape& s, const float* x, float* y) {
  check_pool_shape(s, "avgpool2d_forward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  parallel_for(dev, planes, plane_grain(pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      const float* xp = x + pl * hw;
      float* yp = y + pl * pq;
      for (i64 p = 0; p < s.P; ++p) {
        const i64 h0 = p * s.stride_h - s.pad_h;
        const i64 hs = std::max<i64>(h0, 0), he = std::min(h0 + s.kernel_h, s.H);
        for (i64 q = 0; q < s.Q; ++q) {
          const i64 w0 = q * s.stride_w - s.pad_w;
          const i64 ws = std::max<i64>(w0, 0), we = std::min(w0 + s.kernel_w, s.W);
          float sum = 0.0f;
          for (i64 h = hs; h < he; ++h)
            for (i64 w = ws; w < we; ++w) sum += xp[h * s.W + w];
          yp[p * s.Q + q] = sum / static_cast<float>(avg_divisor(s, h0, w0));
        }
      }
    }
  });
}

void CpuBackend::avgpool2d_backward(Device dev, const Pool2dShape& s, const float* gy, float* gx) {
  check_pool_shape(s, "avgpool2d_backward");
  const i64 planes = s.N * s.C, hw = s.H * s.W, pq = s.P * s.Q;
  parallel_for(dev, planes, plane_grain(hw + pq * s.kernel_h * s.kernel_w), [&](i64 b, i64 e) {
    for (i64 pl = b; pl < e; ++pl) {
      float* gp = gx + pl * hw;
      std::memset(gp, 0, static_cast<std::size_t>(hw) * sizeof(float));
      const float* gyp = gy + pl * pq;
      for (i64 p = 0; p < s.P; ++p) {
        const i64 h0 = p * s.stride_h - s.pad_h;
        const i64 hs = std::max<i64>(h0, 0), he = std::min(h0 + s.kernel_h, s.H);
        for (i64 q = 0; q < s.Q; ++q) {
          const i64 w0 = q * s.stride_w - s.pad_w;
          const i64 ws = std::max<i64>(w0, 0), we = std::min(w0 + s.kernel_w, s.W);
          const float g = gyp[p * s.Q + q] / static_cast<float>(avg_divisor(s, h0, w0));
          for (i64 h = hs; h < he; ++h)
            for (i64 w = ws; w < we; ++w) gp[h * s.W + w] += g;
        }
      }
    }
  });
}

// ---- batch norm over (N, C, HW) ------------------------------------------------------------

// Note [Batch norm in 16 bits]
// A bfloat16 or float16 batch norm (what autocast leaves a CNN's activations in: Note
// [Autocast op policy]) reads its 16-bit input and writes its 16-bit output; the
// statistics, the parameters, the running statistics and the saved mean and inverse
// standard deviation stay float32. Each element is widened exactly as it is loaded, goes
// through the float32 kernel's expressions in the float32 kernel's order, and is rounded
// once as it is stored: the bits of the float32 op on the widened input, rounded — what
// batch_norm computed before, as a cast, the float32 op and a cast back. What it saves
// is memory traffic and memory: the two casts' passes (a 16-bit activation read and a
// float32 one written, and back), and the float32 copy of the input that the backward
// kept (twice the 16-bit activation's bytes per batch norm). The backward likewise reads
// a 16-bit gy and x and writes a 16-bit gx. The kernels below are templates over the
// storage type T; CUDA's do the same (cuda_nn.cu).
//
// Note [Batch norm's sums in lanes]
// A channel's statistics (Σ x, then Σ (x − mean)², and the backward's Σ gy and
// Σ gy (x − mean)) are sums over its N planes of HW values, in double, as PyTorch's CPU
// kernel accumulates a float tensor's. sum_lanes_rows (cpu_lanes.h) keeps 16 independent double
// accumulators a sum (element i of every plane into lane i mod 16) and adds them by a
// pairwise tree at the end: an order fixed by (N, HW) alone, so the result is bitwise
// reproducible, and a loop that vectorises. A single running sum cannot vectorise (its
// additions may not be reordered) and is bound by the add's latency: on the AMX Xeon
// those sums (each plane in float, the planes in double) made the statistics passes run
// at a tenth of the memory's speed, and ResNet-18's batch norms a fifth of its bfloat16
// step. The lanes change the last bits of the statistics, float32 and 16-bit alike (the
// 16-bit kernels are the same templates). The sums are cpu_norm_clones.cpp's, with ISA
// clones (the baseline's four SSE lanes could not hold the accumulators in registers).

namespace {

constexpr i64 kBnChunk = 256;  // floats of a 16-bit plane's output computed, then rounded together

/// A task's scratch for bn_store_plane: kBnChunk floats for a 16-bit T, none for float.
template <typename T>
std::vector<float> bn_chunk() {
  return std::vector<float>(std::is_same_v<T, float> ? 0 : kBnChunk);
}

/// y[i] = f(i) for i in [0, HW): float32 stores directly, a 16-bit T through `buf`
/// (bn_chunk's) rounded once each (Note [Batch norm in 16 bits]).
template <typename T, typename F>
void bn_store_plane(T* __restrict y, i64 HW, float* __restrict buf, F f) {
  if constexpr (std::is_same_v<T, float>) {
    for (i64 i = 0; i < HW; ++i) y[i] = f(i);
  } else {
    for (i64 i0 = 0; i0 < HW; i0 += kBnChunk) {
      const i64 n = std::min(kBnChunk, HW - i0);
      for (i64 i = 0; i < n; ++i) buf[i] = f(i0 + i);
      round_to(buf, y + i0, n);
    }
  }
}

template <typename T>
inline float wide(T v) {
  return static_cast<float>(v);
}

// The batch norm kernels' argument checks, NCHW and channels-last alike.
void check_bn_sizes(const char* op, i64 N, i64 C, i64 HW) {
  DP_CHECK(N >= 0 && C >= 0 && HW >= 0, op, ": expected non-negative sizes, got (", N, ", ", C, ", ", HW, ")");
}
void check_bn_train_sizes(i64 N, i64 C, i64 HW) {
  check_bn_sizes("batchnorm_forward_train", N, C, HW);
  DP_CHECK(N * HW > 0 || C == 0, "batchnorm_forward_train: expected at least one value per channel, got N=", N,
           ", HW=", HW);
}
void check_bn_eval_args(i64 N, i64 C, i64 HW, const float* running_mean, const float* running_var) {
  check_bn_sizes("batchnorm_forward_eval", N, C, HW);
  DP_CHECK((running_mean && running_var) || N * HW == 0,
           "batchnorm_forward_eval: expected running_mean and running_var, got null");
}

template <typename T>
void bn_train(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, const T* x, const float* gamma, const float* beta,
              float eps, float momentum, float* running_mean, float* running_var, T* y, float* save_mean,
              float* save_invstd) {
  check_bn_train_sizes(N, C, HW);
  const i64 M = N * HW;  // values per channel
  be.parallel_for(dev, C, plane_grain(3 * M), [&](i64 b, i64 e) {
    std::vector<float> buf = bn_chunk<T>();
    for (i64 c = b; c < e; ++c) {
      // Σ x, then Σ (x - mean)²: two passes, no cancellation for large means (Note [Batch
      // norm's sums in lanes]).
      double sum = 0.0, sq = 0.0;
      batch_norm_stats(dtype_of<T>, x + c * HW, N, HW, C * HW, &sum, &sq);
      const double mean = sum / static_cast<double>(M);
      const double var = sq / static_cast<double>(M);
      const double invstd = 1.0 / std::sqrt(var + static_cast<double>(eps));
      if (save_mean) save_mean[c] = static_cast<float>(mean);
      if (save_invstd) save_invstd[c] = static_cast<float>(invstd);
      if (running_mean) {
        // PyTorch: running stats use the unbiased variance (M - 1 denominator).
        const double unbiased = M > 1 ? sq / static_cast<double>(M - 1) : var;
        running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * mean);
        if (running_var)
          running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
      }
      const float g = gamma ? gamma[c] : 1.0f, bt = beta ? beta[c] : 0.0f;
      const float scale = g * static_cast<float>(invstd);
      const float shift = bt - static_cast<float>(mean) * scale;
      for (i64 n = 0; n < N; ++n) {
        const T* __restrict xp = x + (n * C + c) * HW;
        bn_store_plane(y + (n * C + c) * HW, HW, buf.data(), [&](i64 i) { return wide(xp[i]) * scale + shift; });
      }
    }
  });
}

template <typename T>
void bn_eval(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, const T* x, const float* gamma, const float* beta,
             float eps, const float* running_mean, const float* running_var, T* y) {
  check_bn_eval_args(N, C, HW, running_mean, running_var);
  // Parallel over N*C planes: eval has no reduction, and C alone may be small.
  be.parallel_for(dev, N * C, plane_grain(HW), [&](i64 b, i64 e) {
    std::vector<float> buf = bn_chunk<T>();
    for (i64 pl = b; pl < e; ++pl) {
      const i64 c = pl % C;
      const float invstd = 1.0f / std::sqrt(running_var[c] + eps);
      const float scale = (gamma ? gamma[c] : 1.0f) * invstd;
      const float shift = (beta ? beta[c] : 0.0f) - running_mean[c] * scale;
      const T* __restrict xp = x + pl * HW;
      bn_store_plane(y + pl * HW, HW, buf.data(), [&](i64 i) { return wide(xp[i]) * scale + shift; });
    }
  });
}

template <typename T>
void bn_backward(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, const T* gy, const T* x, const float* gamma,
                 const float* save_mean, const float* save_invstd, T* gx, float* ggamma, float* gbeta) {
  check_bn_sizes("batchnorm_backward", N, C, HW);
  const i64 M = N * HW;
  be.parallel_for(dev, C, plane_grain(3 * M), [&](i64 b, i64 e) {
    std::vector<float> buf = bn_chunk<T>();
    for (i64 c = b; c < e; ++c) {
      const float mean = save_mean[c], invstd = save_invstd[c];
      // Σ gy and Σ gy * (x - mean) (Note [Batch norm's sums in lanes]).
      double sum_gy = 0.0, sum_gy_xc = 0.0;
      batch_norm_grad_sums(dtype_of<T>, gy + c * HW, x + c * HW, N, HW, C * HW, mean, &sum_gy, &sum_gy_xc);
      if (gbeta) gbeta[c] = static_cast<float>(sum_gy);
      if (ggamma) ggamma[c] = static_cast<float>(sum_gy_xc * invstd);
      if (!gx || M == 0) continue;
      // gx = gamma * invstd * (gy - mean(gy) - xhat * mean(gy * xhat)).
      const float g = gamma ? gamma[c] : 1.0f;
      const float k = g * invstd;
      const float mean_gy = static_cast<float>(sum_gy / static_cast<double>(M));
      const float proj = static_cast<float>(sum_gy_xc / static_cast<double>(M)) * invstd * invstd;
      for (i64 n = 0; n < N; ++n) {
        const T* __restrict gp = gy + (n * C + c) * HW;
        const T* __restrict xp = x + (n * C + c) * HW;
        bn_store_plane(gx + (n * C + c) * HW, HW, buf.data(),
                       [&](i64 i) { return k * (wide(gp[i]) - mean_gy - (wide(xp[i]) - mean) * proj); });
      }
    }
  });
}

// Note [Channels-last batch norm]
// A channels-last input (N x HW x C: Note [Channels-last tensors]) is M = N·HW rows of C
// values, a channel a column. Its statistics are column sums: each block of kBnRows rows
// sums its rows into C double accumulators, a row at a time (a loop over the channels,
// contiguous, that vectorises), and the blocks' sums are added in block order — an
// order fixed by (M, C), so the result is reproducible and independent of the thread
// count, but not the NCHW kernel's order: the last bits of the statistics differ from
// the NCHW tensor's. Then the output, a row at a time, through the NCHW kernel's
// expressions (16-bit values widened as loaded and rounded once as stored). The same
// three passes over memory as the NCHW kernel; reading the rows as N·HW images of one
// value per channel (as_nchw_rows) would stride through every row once per channel.
// The row loops are cpu_norm_clones.cpp's batch_norm_rows_sums and batch_norm_rows_apply,
// with ISA clones (the same bits on every CPU): at the baseline's SSE width they took a
// sixth of ResNet-18's channels-last bfloat16 step on the AMX Xeon.

constexpr i64 kBnRows = 64;  // rows per block of a channels-last batch norm's sums

/// Per channel, the sums `what` of batch_norm_rows_sums over the M rows of C values:
/// blocks of kBnRows rows in parallel, then in block order (Note [Channels-last batch
/// norm]). `sums` accumulators a channel.
std::vector<double> bn_column_sums(CpuBackend& be, Device dev, DType dt, int what, const void* x, const void* gy,
                                   i64 M, i64 C, int sums, const double* mean_d, const float* mean_f) {
  const i64 blocks = (M + kBnRows - 1) / kBnRows, width = sums * C;
  std::vector<double> part(static_cast<std::size_t>(std::max<i64>(blocks, 1) * width), 0.0);
  be.parallel_for(dev, blocks, plane_grain(kBnRows * C), [&](i64 b, i64 e) {
    for (i64 k = b; k < e; ++k)
      batch_norm_rows_sums(dt, what, x, gy, k * kBnRows, std::min(M, (k + 1) * kBnRows), C, mean_d, mean_f,
                           part.data() + k * width);
  });
  std::vector<double> total(static_cast<std::size_t>(width), 0.0);
  for (i64 k = 0; k < blocks; ++k)
    for (i64 j = 0; j < width; ++j) total[static_cast<std::size_t>(j)] += part[static_cast<std::size_t>(k * width + j)];
  return total;
}

/// The M rows of batch_norm_rows_apply's output `what`, in parallel.
void bn_apply_rows(CpuBackend& be, Device dev, DType dt, int what, const void* x, const void* gy, i64 M, i64 C,
                   const float* a, const float* b, const float* m, const float* p, void* out) {
  be.parallel_for(dev, M, plane_grain(C), [&](i64 r0, i64 r1) {
    batch_norm_rows_apply(dt, what, x, gy, r0, r1, C, a, b, m, p, out);
  });
}

template <typename T>
void bn_train_nhwc(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, const T* x, const float* gamma, const float* beta,
                   float eps, float momentum, float* running_mean, float* running_var, T* y, float* save_mean,
                   float* save_invstd) {
  check_bn_train_sizes(N, C, HW);
  const i64 M = N * HW;  // rows, and values per channel
  if (C == 0) return;
  const DType dt = dtype_of<T>;
  // Σ x, then Σ (x - mean)², as the NCHW kernel (two passes, no cancellation).
  const std::vector<double> sum = bn_column_sums(be, dev, dt, 0, x, nullptr, M, C, 1, nullptr, nullptr);
  std::vector<double> mean(static_cast<std::size_t>(C));
  for (i64 c = 0; c < C; ++c)
    mean[static_cast<std::size_t>(c)] = sum[static_cast<std::size_t>(c)] / static_cast<double>(M);
  const std::vector<double> sq = bn_column_sums(be, dev, dt, 1, x, nullptr, M, C, 1, mean.data(), nullptr);
  std::vector<float> scale(static_cast<std::size_t>(C)), shift(static_cast<std::size_t>(C));
  for (i64 c = 0; c < C; ++c) {
    const auto u = static_cast<std::size_t>(c);
    const double var = sq[u] / static_cast<double>(M);
    const double invstd = 1.0 / std::sqrt(var + static_cast<double>(eps));
    if (save_mean) save_mean[c] = static_cast<float>(mean[u]);
    if (save_invstd) save_invstd[c] = static_cast<float>(invstd);
    if (running_mean) {
      const double unbiased = M > 1 ? sq[u] / static_cast<double>(M - 1) : var;
      running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * mean[u]);
      if (running_var)
        running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
    }
    const float g = gamma ? gamma[c] : 1.0f, bt = beta ? beta[c] : 0.0f;
    scale[u] = g * static_cast<float>(invstd);
    shift[u] = bt - static_cast<float>(mean[u]) * scale[u];
  }
  bn_apply_rows(be, dev, dt, 0, x, nullptr, M, C, scale.data(), shift.data(), nullptr, nullptr, y);
}

template <typename T>
void bn_eval_nhwc(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, const T* x, const float* gamma, const float* beta,
                  float eps, const float* running_mean, const float* running_var, T* y) {
  check_bn_eval_args(N, C, HW, running_mean, running_var);
  if (N * HW == 0 || C == 0) return;
  std::vector<float> scale(static_cast<std::size_t>(C)), shift(static_cast<std::size_t>(C));
  for (i64 c = 0; c < C; ++c) {  // the NCHW kernel's expressions
    const float invstd = 1.0f / std::sqrt(running_var[c] + eps);
    scale[static_cast<std::size_t>(c)] = (gamma ? gamma[c] : 1.0f) * invstd;
    shift[static_cast<std::size_t>(c)] = (beta ? beta[c] : 0.0f) - running_mean[c] * scale[static_cast<std::size_t>(c)];
  }
  bn_apply_rows(be, dev, dtype_of<T>, 0, x, nullptr, N * HW, C, scale.data(), shift.data(), nullptr, nullptr, y);
}

template <typename T>
void bn_backward_nhwc(CpuBackend& be, Device dev, i64 N, i64 C, i64 HW, const T* gy, const T* x, const float* gamma,
                      const float* save_mean, const float* save_invstd, T* gx, float* ggamma, float* gbeta) {
  check_bn_sizes("batchnorm_backward", N, C, HW);
  const i64 M = N * HW;
  if (C == 0) return;
  // Σ gy and Σ gy * (x - mean) per channel, side by side in one pass.
  const std::vector<double> sums =
      bn_column_sums(be, dev, dtype_of<T>, 2, x, gy, M, C, 2, nullptr, save_mean);
  std::vector<float> k(static_cast<std::size_t>(C)), mean_gy(static_cast<std::size_t>(C)),
      proj(static_cast<std::size_t>(C));
  for (i64 c = 0; c < C; ++c) {
    const auto u = static_cast<std::size_t>(c);
    const double sum_gy = sums[u], sum_gy_xc = sums[static_cast<std::size_t>(C + c)];
    const float invstd = save_invstd[c];
    if (gbeta) gbeta[c] = static_cast<float>(sum_gy);
    if (ggamma) ggamma[c] = static_cast<float>(sum_gy_xc * invstd);
    k[u] = (gamma ? gamma[c] : 1.0f) * invstd;
    mean_gy[u] = M > 0 ? static_cast<float>(sum_gy / static_cast<double>(M)) : 0.0f;
    proj[u] = M > 0 ? static_cast<float>(sum_gy_xc / static_cast<double>(M)) * invstd * invstd : 0.0f;
  }
  if (!gx || M == 0) return;
  // gx = k (gy - mean(gy) - (x - mean) proj), the NCHW kernel's expression.
  bn_apply_rows(be, dev, dtype_of<T>, 1, x, gy, M, C, k.data(), mean_gy.data(), save_mean, proj.data(), gx);
}

/// The kernel table's entries: a BatchNorm op over storage T (float32 statistics and
/// parameters whatever T is; BatchNormTrainArgs in ops.h), channels-last or NCHW.
template <typename T>
void batch_norm_train_kernel(CpuBackend& be, Device dev, const BatchNormTrainArgs& a) {
  const auto f = [](const void* p) { return static_cast<const float*>(p); };
  const auto m = [](void* p) { return static_cast<float*>(p); };
  (a.channels_last ? bn_train_nhwc<T> : bn_train<T>)(be, dev, a.N, a.C, a.HW, static_cast<const T*>(a.x), f(a.gamma),
                                                     f(a.beta), a.eps, a.momentum, m(a.running_mean),
                                                     m(a.running_var), static_cast<T*>(a.y), m(a.save_mean),
                                                     m(a.save_invstd));
}
template <typename T>
void batch_norm_eval_kernel(CpuBackend& be, Device dev, const BatchNormEvalArgs& a) {
  const auto f = [](const void* p) { return static_cast<const float*>(p); };
  (a.channels_last ? bn_eval_nhwc<T> : bn_eval<T>)(be, dev, a.N, a.C, a.HW, static_cast<const T*>(a.x), f(a.gamma),
                                                   f(a.beta), a.eps, f(a.running_mean), f(a.running_var),
                                                   static_cast<T*>(a.y));
}
template <typename T>
void batch_norm_backward_kernel(CpuBackend& be, Device dev, const BatchNormBackwardArgs& a) {
  const auto f = [](const void* p) { return static_cast<const float*>(p); };
  const auto m = [](void* p) { return static_cast<float*>(p); };
  (a.channels_last ? bn_backward_nhwc<T> : bn_backward<T>)(be, dev, a.N, a.C, a.HW, static_cast<const T*>(a.gy),
                                                           static_cast<const T*>(a.x), f(a.gamma), f(a.save_mean),
                                                           f(a.save_invstd), static_cast<T*>(a.gx), m(a.ggamma),
                                                           m(a.gbeta));
}

}  // namespace

void CpuBackend::batchnorm_forward_train(Device dev, i64 N, i64 C, i64 HW, const float* x,
                                         const float* gamma, const float* beta, float eps,
                                         float momentum, float* running_mean, float* running_var,
                                         float* y, float* save_mean, float* save_invstd) {
  bn_train(*this, dev, N, C, HW, x, gamma, beta, eps, momentum, running_mean, running_var, y, save_mean,
           save_invstd);
}

void CpuBackend::batchnorm_forward_eval(Device dev, i64 N, i64 C, i64 HW, const float* x,
                                        const float* gamma, const float* beta, float eps,
                                        const float* running_mean, const float* running_var,
                                        float* y) {
  bn_eval(*this, dev, N, C, HW, x, gamma, beta, eps, running_mean, running_var, y);
}

void CpuBackend::batchnorm_backward(Device dev, i64 N, i64 C, i64 HW, const float* gy,
                                    const float* x, const float* gamma, const float* save_mean,
                                    const float* save_invstd, float* gx, float* ggamma,
                                    float* gbeta) {
  bn_backward(*this, dev, N, C, HW, gy, x, gamma, save_mean, save_invstd, gx, ggamma, gbeta);
}

void CpuBackend::register_batch_norm_kernels() {
  // Every dtype's: these replace float32's method kernels (method_kernels.h), which
  // have no channels-last path (Note [Channels-last batch norm]).
  register_typed<Op::BatchNormTrain, CpuBackend, &batch_norm_train_kernel<float>>(DType::F32);
  register_typed<Op::BatchNormEval, CpuBackend, &batch_norm_eval_kernel<float>>(DType::F32);
  register_typed<Op::BatchNormBackward, CpuBackend, &batch_norm_backward_kernel<float>>(DType::F32);
  register_typed<Op::BatchNormTrain, CpuBackend, &batch_norm_train_kernel<BFloat16>>(DType::BF16);
  register_typed<Op::BatchNormEval, CpuBackend, &batch_norm_eval_kernel<BFloat16>>(DType::BF16);
  register_typed<Op::BatchNormBackward, CpuBackend, &batch_norm_backward_kernel<BFloat16>>(DType::BF16);
  register_typed<Op::BatchNormTrain, CpuBackend, &batch_norm_train_kernel<Float16>>(DType::F16);
  register_typed<Op::BatchNormEval, CpuBackend, &batch_norm_eval_kernel<Float16>>(DType::F16);
  register_typed<Op::BatchNormBackward, CpuBackend, &batch_norm_backward_kernel<Float16>>(DType::F16);
}

// ---- log-softmax and NLL (rows × cols) ---------------------------------------------------

// Note [Log-softmax rows]
// A row of log_softmax is four passes: its max (eight running maxima: max is exact, so
// the order changes nothing; a NaN is skipped by every order, and turns the sum NaN
// below), e^(x - max) by exp_approx into a scratch row (a loop that vectorises; Note
// [Vectorisable exp and tanh]), the sum of those in double (four partial sums in a
// fixed order), and (x - max) - log(sum). Each row is one task's, in a fixed order, so
// the result does not depend on the split. The backward's e^y is exp_approx too.

namespace {

constexpr int kMaxLanes = 8;  // AVX2's float lanes; SSE and AVX-512 split or join them
constexpr int kSumLanes = 4;  // partial double sums: four adds in flight

/// The largest of xr[0..cols), NaN skipped; -inf for an empty or all-NaN row.
float row_max(const float* xr, i64 cols) {
  float m[kMaxLanes];
  for (float& v : m) v = -std::numeric_limits<float>::infinity();
  i64 j = 0;
  for (; j + kMaxLanes <= cols; j += kMaxLanes)
    for (int k = 0; k < kMaxLanes; ++k) m[k] = std::max(m[k], xr[j + k]);
  for (; j < cols; ++j) m[0] = std::max(m[0], xr[j]);
  float mx = m[0];
  for (int k = 1; k < kMaxLanes; ++k) mx = std::max(mx, m[k]);
  return mx;
}

/// The sum of er[0..cols) in double, in kSumLanes partial sums added in a fixed order.
double row_sum(const float* er, i64 cols) {
  double s[kSumLanes] = {};
  i64 j = 0;
  for (; j + kSumLanes <= cols; j += kSumLanes)
    for (int k = 0; k < kSumLanes; ++k) s[k] += er[j + k];
  for (; j < cols; ++j) s[0] += er[j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace

void CpuBackend::log_softmax(Device dev, const float* x, float* y, i64 rows, i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, "log_softmax: expected non-negative sizes, got ", rows, "x", cols);
  if (cols == 0) return;
  const Unary<UnaryOp::Exp> exp_f;
  parallel_for(dev, rows, plane_grain(3 * cols), [&](i64 b, i64 e) {
    std::vector<float> scratch(static_cast<std::size_t>(cols));  // e^(x - max); y may alias x
    float* __restrict er = scratch.data();
    for (i64 r = b; r < e; ++r) {  // Note [Log-softmax rows]
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      float mx = row_max(xr, cols);
      // An all -inf row would give -inf - -inf = NaN; shifting by 0 keeps -inf outputs.
      if (std::isinf(mx) && mx < 0) mx = 0.0f;
      for (i64 j = 0; j < cols; ++j) er[j] = exp_f(xr[j] - mx);
      // (x - max) - log(sum), as PyTorch: x - (max + log(sum)) would round the sum to
      // max's magnitude first, losing log(sum)'s low bits for large logits.
      const float log_sum = static_cast<float>(std::log(row_sum(er, cols)));
      for (i64 j = 0; j < cols; ++j) yr[j] = (xr[j] - mx) - log_sum;
    }
  });
}

void CpuBackend::log_softmax_backward(Device dev, const float* gy, const float* y, float* gx,
                                      i64 rows, i64 cols) {
  DP_CHECK(rows >= 0 && cols >= 0, "log_softmax_backward: expected non-negative sizes, got ", rows,
           "x", cols);
  if (cols == 0) return;
  const Unary<UnaryOp::Exp> exp_f;
  parallel_for(dev, rows, plane_grain(3 * cols), [&](i64 b, i64 e) {
    for (i64 r = b; r < e; ++r) {
      const float* gr = gy + r * cols;
      const float* yr = y + r * cols;
      float* gxr = gx + r * cols;
      double sum = 0.0;
      for (i64 j = 0; j < cols; ++j) sum += gr[j];
      const float s = static_cast<float>(sum);
      for (i64 j = 0; j < cols; ++j) gxr[j] = gr[j] - exp_f(yr[j]) * s;
    }
  });
}

namespace {
void check_targets(const i64* target, i64 rows, i64 cols, i64 ignore_index, const char* op) {
  for (i64 r = 0; r < rows; ++r)
    DP_CHECK(target[r] == ignore_index || (target[r] >= 0 && target[r] < cols), op,
             ": expected class indices in [0, ", cols, "), got target[", r, "] = ", target[r],
             "; check the labels and the model's output size");
}
}  // namespace

void CpuBackend::nll_forward(Device dev, const float* logp, const i64* target, float* loss, i64 rows,
                             i64 cols, i64 ignore_index) {
  DP_CHECK(rows >= 0 && cols >= 0, "nll_forward: expected non-negative sizes, got ", rows, "x", cols);
  (void)state(dev);
  // Validate all targets before writing anything (a CUDA kernel would fault mid-way).
  check_targets(target, rows, cols, ignore_index, "nll_forward");
  for (i64 r = 0; r < rows; ++r) loss[r] = target[r] == ignore_index ? 0.0f : -logp[r * cols + target[r]];
}

void CpuBackend::nll_backward(Device dev, const float* gloss, const i64* target, float* gx, i64 rows,
                              i64 cols, i64 ignore_index) {
  DP_CHECK(rows >= 0 && cols >= 0, "nll_backward: expected non-negative sizes, got ", rows, "x", cols);
  check_targets(target, rows, cols, ignore_index, "nll_backward");
  run<Op::Fill>(dev, DType::F32, {gx, rows * cols, 0.0f});
  for (i64 r = 0; r < rows; ++r)
    if (target[r] != ignore_index) gx[r * cols + target[r]] = -gloss[r];
}

}  // namespace dp::backend::cpu
