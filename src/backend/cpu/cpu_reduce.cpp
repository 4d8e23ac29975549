// CPU backend: reductions over (outer, r, inner), argmax, count_nonfinite and
// scale_find_nonfinite.
//
// Note [Deterministic reductions]
// A float sum depends on its order, so the order must never depend on scheduling or on
// the thread count. Work is cut into a grid of tasks fixed by the SHAPE alone: outer
// rows × chunks of the reduced axis × blocks of the inner axis. Each task sums its
// chunk serially in a fixed lane order; when the reduced axis was chunked, the partial
// results are then combined chunk by chunk in index order. TBB only decides which core
// runs which task, never what is added to what — results are bitwise identical run to
// run and for any thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_lanes.h"
#include "dp/core/error.h"

namespace dp::backend::cpu {
namespace {

using i64 = std::int64_t;

struct MaxOp {
  static constexpr float identity() { return -std::numeric_limits<float>::infinity(); }
  // NaN wins and stays (torch.max propagates NaN).
  static float combine(float a, float b) { return (b > a || b != b) ? b : a; }
};
struct MinOp {
  static constexpr float identity() { return std::numeric_limits<float>::infinity(); }
  static float combine(float a, float b) { return (b < a || b != b) ? b : a; }
};

/// Reduces x[0..len) (contiguous) with a fixed lane order.
template <typename Op>
float reduce_contiguous(const float* __restrict x, i64 len) {
  return fold_lanes<Op>(len, [x](i64 i) { return x[i]; });
}

/// acc[i] op= x[k * inner + i] for k in [0, kn), i in [0, ilen). Four rows per pass over
/// acc: the same combines in the same order (row by row, left to right), with a quarter
/// of the loads and stores of acc (figures for a Linear's bias gradient: docs/benchmarks/kernel-notes.md,
///  "Strided reductions").
template <typename Op>
void reduce_strided(const float* __restrict x, i64 kn, i64 inner, i64 ilen, float* __restrict acc) {
  for (i64 i = 0; i < ilen; ++i) acc[i] = Op::identity();
  i64 k = 0;
  for (; k + 4 <= kn; k += 4) {
    const float* __restrict r0 = x + k * inner;
    const float* __restrict r1 = r0 + inner;
    const float* __restrict r2 = r1 + inner;
    const float* __restrict r3 = r2 + inner;
    for (i64 i = 0; i < ilen; ++i)
      acc[i] = Op::combine(Op::combine(Op::combine(Op::combine(acc[i], r0[i]), r1[i]), r2[i]), r3[i]);
  }
  for (; k < kn; ++k) {
    const float* __restrict row = x + k * inner;
    for (i64 i = 0; i < ilen; ++i) acc[i] = Op::combine(acc[i], row[i]);
  }
}

/// Longest run of a row one task of a column reduction reads (floats: 4 KiB).
constexpr i64 kMaxRun = 1024;

/// The fixed task grid of Note [Deterministic reductions].
struct ReduceGrid {
  i64 rchunk = 0, nr = 0;  // reduced-axis chunk length and count
  i64 iblock = 0, ni = 0;  // inner block length and count
};

ReduceGrid make_grid(i64 outer, i64 r, i64 inner) {
  ReduceGrid g;
  // Chunk the reduced axis only when outer × inner alone cannot keep several cores busy
  // (fewer than 64 outputs) and there is enough work to split; the choice depends on
  // the shape only.
  const bool split_r = outer * inner < 64 && r * inner > kSerialGrain;
  g.rchunk = split_r ? std::max<i64>(1, kSerialGrain / inner) : r;
  g.nr = r == 0 ? 1 : (r + g.rchunk - 1) / g.rchunk;
  // Inner blocks hold ~kSerialGrain elements of work each; 16-aligned for the vector loop.
  // A column reduction (inner > 1) reads each row's block as one run: runs of a few
  // cache lines every row stride are where hardware prefetchers give up (docs/benchmarks/kernel-notes.md,
  // "Strided reductions"), so a block is also at least a quarter of
  // the row, up to kMaxRun (Note [Deterministic reductions]: a column's sum is the same
  // whatever the block).
  const i64 want = std::max<i64>(kLanes, kSerialGrain / std::max<i64>(1, g.rchunk) / kLanes * kLanes);
  const i64 run = std::min<i64>(kMaxRun, (inner / 4 + kLanes - 1) / kLanes * kLanes);
  g.iblock = std::min(inner, std::max(want, run));
  g.ni = (inner + g.iblock - 1) / g.iblock;
  return g;
}

template <typename Op>
void reduce_impl(CpuBackend& be, Device dev, const float* x, float* y, i64 outer, i64 r, i64 inner) {
  const ReduceGrid g = make_grid(outer, r, inner);
  // With one chunk, tasks write y directly; otherwise into partial[o][c][i].
  std::vector<float> partial(g.nr > 1 ? static_cast<std::size_t>(outer * g.nr * inner) : 0);
  const i64 tasks = outer * g.nr * g.ni;
  // A task is big enough by construction unless the whole problem is tiny.
  const bool serial = outer * r * inner <= kSerialGrain;
  auto run = [&](i64 t) {
    const i64 ib = t % g.ni, c = (t / g.ni) % g.nr, o = t / (g.ni * g.nr);
    const i64 k0 = c * g.rchunk, kn = std::min(r, k0 + g.rchunk) - k0;
    const i64 i0 = ib * g.iblock, ilen = std::min(inner, i0 + g.iblock) - i0;
    float* dst = g.nr > 1 ? partial.data() + (o * g.nr + c) * inner + i0 : y + o * inner + i0;
    const float* src = x + (o * r + k0) * inner + i0;
    if (inner == 1) {
      dst[0] = reduce_contiguous<Op>(src, kn);
    } else {
      reduce_strided<Op>(src, kn, inner, ilen, dst);
    }
  };
  if (serial) {
    for (i64 t = 0; t < tasks; ++t) run(t);
  } else {
    be.parallel_chunks(dev, tasks, run);
  }
  if (g.nr > 1) {
    // Combine the chunks in index order (few outputs by construction: serial).
    for (i64 o = 0; o < outer; ++o) {
      float* yo = y + o * inner;
      const float* p = partial.data() + o * g.nr * inner;
      for (i64 i = 0; i < inner; ++i) yo[i] = p[i];
      for (i64 c = 1; c < g.nr; ++c)
        for (i64 i = 0; i < inner; ++i) yo[i] = Op::combine(yo[i], p[c * inner + i]);
    }
  }
}

void reduce_f32(CpuBackend& be, Device dev, const ReduceArgs& a) {
  const ReduceOp op = a.op;
  const float* x = static_cast<const float*>(a.x);
  float* y = static_cast<float*>(a.y);
  const i64 outer = a.outer, r = a.r, inner = a.inner;
  DP_CHECK(outer >= 0 && r >= 0 && inner >= 0, "reduce: expected non-negative sizes, got (",
           outer, ", ", r, ", ", inner, ")");
  (void)be.state(dev);
  if (outer == 0 || inner == 0) return;
  DP_CHECK(r > 0 || op == ReduceOp::Sum,
           "reduce: max/min over an empty dimension has no identity; expected r > 0, got r = 0");
  switch (op) {
    case ReduceOp::Sum: reduce_impl<SumOp>(be, dev, x, y, outer, r, inner); return;
    case ReduceOp::Max: reduce_impl<MaxOp>(be, dev, x, y, outer, r, inner); return;
    case ReduceOp::Min: reduce_impl<MinOp>(be, dev, x, y, outer, r, inner); return;
    case ReduceOp::kCount: break;
  }
  DP_FAIL("reduce: expected a ReduceOp below kCount, got ", static_cast<int>(op));
}

void argmax_f32(CpuBackend& be, Device dev, const ArgmaxArgs& a) {
  const float* x = static_cast<const float*>(a.x);
  i64* y = a.y;
  const i64 outer = a.outer, r = a.r, inner = a.inner;
  DP_CHECK(outer >= 0 && r >= 0 && inner >= 0, "argmax: expected non-negative sizes, got (",
           outer, ", ", r, ", ", inner, ")");
  (void)be.state(dev);
  if (outer == 0 || inner == 0) return;
  DP_CHECK(r > 0, "argmax: expected a non-empty reduced dimension, got r = 0");
  // Parallel over outputs only; each output scans its k in order, so "first max wins".
  // A NaN counts as the maximum (torch.argmax); the first NaN wins.
  auto better = [](float v, float best) { return v > best || (v != v && best == best); };
  const i64 iblock = std::min<i64>(inner, 1024);  // bounded stack buffer of running maxima
  const i64 ni = (inner + iblock - 1) / iblock;
  const i64 grain = std::max<i64>(1, kSerialGrain / (r * iblock));
  be.parallel_for(dev, outer * ni, grain, [&](i64 b, i64 e) {
    float best[1024];
    for (i64 t = b; t < e; ++t) {
      const i64 o = t / ni, i0 = (t % ni) * iblock, ilen = std::min(inner, i0 + iblock) - i0;
      const float* base = x + o * r * inner + i0;
      i64* yo = y + o * inner + i0;
      for (i64 i = 0; i < ilen; ++i) {
        best[i] = base[i];
        yo[i] = 0;
      }
      for (i64 k = 1; k < r; ++k) {
        const float* row = base + k * inner;
        for (i64 i = 0; i < ilen; ++i) {
          if (better(row[i], best[i])) {
            best[i] = row[i];
            yo[i] = k;
          }
        }
      }
    }
  });
}

void count_nonfinite_f32(CpuBackend& be, Device dev, const CountNonfiniteArgs& a) {
  const float* x = static_cast<const float*>(a.x);
  const i64 n = a.n;
  *a.count = 0;
  (void)be.state(dev);
  if (n <= 0) return;
  const i64 chunks = (n + kSerialGrain - 1) / kSerialGrain;
  std::vector<i64> counts(static_cast<std::size_t>(chunks), 0);
  be.parallel_chunks(dev, chunks, [&](i64 c) {
    const i64 b = c * kSerialGrain, e = std::min(n, b + kSerialGrain);
    i64 cnt = 0;
    for (i64 i = b; i < e; ++i) {
      // Exponent all ones <=> Inf or NaN; integer test vectorises, std::isfinite may not.
      std::uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      cnt += (bits & 0x7f800000u) == 0x7f800000u;
    }
    counts[static_cast<std::size_t>(c)] = cnt;
  });
  i64 total = 0;
  for (i64 c : counts) total += c;
  *a.count = total;
}

// One pass: each range scales its elements and notes a non-finite one; the flag is set
// once, after the ranges, by the calling thread (never cleared: ScaleFindNonfiniteArgs).
void scale_find_nonfinite(CpuBackend& be, Device dev, const ScaleFindNonfiniteArgs& a) {
  float* x = static_cast<float*>(a.x);
  const float scale = a.scale;
  std::atomic<bool> found{false};
  be.parallel_for(dev, a.n, kSerialGrain, [&](i64 b, i64 e) {
    if (scale_find_nonfinite_f32(x + b, e - b, scale)) found.store(true, std::memory_order_relaxed);
  });
  if (found.load(std::memory_order_relaxed)) *a.found = 1.0f;
}

}  // namespace

void CpuBackend::register_reduce_kernels() {
  register_typed<Op::Reduce, CpuBackend, &reduce_f32>(DType::F32);
  register_typed<Op::Argmax, CpuBackend, &argmax_f32>(DType::F32);
  register_typed<Op::CountNonfinite, CpuBackend, &count_nonfinite_f32>(DType::F32);
  register_typed<Op::ScaleFindNonfinite, CpuBackend, &scale_find_nonfinite>(DType::F32);
}

}  // namespace dp::backend::cpu
