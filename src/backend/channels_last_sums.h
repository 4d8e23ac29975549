// src/backend/channels_last_sums.h — the per-channel sums of a channels-last tensor on
// CUDA (Note [Channels-last sums]): the plan of blocks and threads, what one thread
// sums and how a block adds its threads' sums. Batch norm's statistics and input
// gradient over (N, H, W, C) tensors call these bodies from their kernels.
//
// Internal to the backend layer; plain C++ with DP_HD bodies (no CUDA headers). The CUDA
// kernels (backend/cuda/cuda_nn.cu) run them per thread; tests/backend/channels_last_sums_test.cpp
// runs the same bodies on the host, one simulated thread after another, against exact
// column sums.
//
//   const nhwc::Plan p = nhwc::plan(M, C, 8);        // 8 bf16 lanes a thread
//   grid (p.splits, p.tiles), block (p.cols, p.rows): thread_sums, then block_column
#pragma once

#include <cstdint>

#include "backend/elementwise_walk.h"
#include "backend/functors.h"
#include "backend/kernel_plan.h"

namespace dp::backend::nhwc {

// Note [Channels-last sums]
// A channels-last (N, H, W, C) tensor is M = N·H·W rows of C values, a channel a column.
// Reading it as N·H·W images of one value per channel (as_nchw_rows) strides C elements
// between neighbouring threads: a warp's 32 loads touch 32 memory sectors for 64 bytes
// of bfloat16. Here a thread takes V adjacent channels (one 16-byte load: 8 lanes of a
// 16-bit type, 4 of float), `cols` threads side by side span a tile of cols·V channels,
// and `rows` such rows of threads (cols·rows = kThreads) walk down the rows of their part
// of M, so that a warp reads whole rows. The grid is (splits, tiles): block (s, t) sums
// part s of the rows (kernel_plan::part_of) for tile t's channels; each thread keeps V
// float sums in row order, and the block adds its `rows` threads' sums of a channel in
// thread-row order (block_column). The splits' partials are then added in split order
// by the NCHW kernels' finalize passes (Note [Split reductions]). Every choice — cols,
// rows, splits, and V, which is the dtype's pack width even where an unaligned tensor
// loads lane by lane — is a function of (M, C, dtype): the sums' bits are the same run to
// run and GPU to GPU, though not the NCHW kernels' (another order).

inline constexpr int kThreads = 256;                // threads per block
inline constexpr std::int64_t kTargetBlocks = 512;  // ~4 per SM of an H100, each thread 4 rows' loads in flight
inline constexpr int kMaxSplits = 256;              // the finalize passes add a channel's splits one by one

struct Plan {
  std::int64_t M = 0, C = 0;  // rows, channels
  int lanes = 1;              // V: channels per thread
  int cols = 1;               // threads side by side in a row (a power of two, at most 32)
  int rows = kThreads;        // rows of threads: cols * rows == kThreads
  std::int64_t tiles = 1;     // blocks across the channels: tiles * cols * lanes >= C
  int splits = 1;             // blocks down the rows
  /// The first of thread column g's V channels in tile t.
  DP_HD std::int64_t first_channel(std::int64_t t, int g) const { return (t * cols + g) * lanes; }
  /// Channels a tile spans.
  DP_HD int width() const { return cols * lanes; }
};

/// The plan for M rows of C channels, `lanes` channels a thread (a power of two, 1-8:
/// the 32 threads of the widest row then span at most kThreads channels, so that the
/// block's threads can add one column each).
inline Plan plan(std::int64_t M, std::int64_t C, int lanes) {
  DP_CHECK(lanes >= 1 && lanes <= 8 && (lanes & (lanes - 1)) == 0,
           "channels-last sums: expected 1, 2, 4 or 8 channels a thread, got ", lanes);
  Plan p;
  p.M = M;
  p.C = C;
  p.lanes = lanes;
  const std::int64_t groups = (C + lanes - 1) / lanes;
  while (p.cols < groups && p.cols < 32) p.cols *= 2;
  p.rows = kThreads / p.cols;
  p.tiles = groups > 0 ? (groups + p.cols - 1) / p.cols : 1;
  const std::int64_t span = C < p.width() ? C : p.width();
  std::int64_t s = (kTargetBlocks + p.tiles - 1) / p.tiles;
  const std::int64_t by_len = M * span / kernel_plan::kMinPerSplit;
  if (s > by_len) s = by_len;
  if (s > kMaxSplits) s = kMaxSplits;
  p.splits = s < 1 ? 1 : static_cast<int>(s);
  return p;
}

/// What the sums are: Σ x; Σ (x - mean)²; Σ gy and Σ gy·(x - mean)·invstd side by side
/// (the NCHW kernels' expressions, bn_partial_*_kernel and bn_backward_partial_kernel).
enum class Sums { X, Centered, Backward };
template <Sums S>
inline constexpr int kSums = S == Sums::Backward ? 2 : 1;

/// One thread's V channels c0.. of one row's values: loaded as one pack where `packed`
/// (C % V == 0 and the tensor aligned to the pack), else lane by lane up to C. `widen`
/// turns a stored T into float (load_acc on the device).
template <Sums S, int V, typename T, typename Widen>
struct RowTerms {
  const T* x;
  const T* gy;           // Sums::Backward only
  std::int64_t C;
  bool packed;
  float mean[V];         // Sums::Centered and Sums::Backward: the lanes' channel means
  float invstd[V];       // Sums::Backward
  Widen widen;

  DP_HD void operator()(std::int64_t row, std::int64_t c0, float (&acc)[kSums<S>][V]) const {
    const std::int64_t at = row * C + c0;
    T xv[V], gv[V];
    load(x, at, c0, xv);
    if constexpr (S == Sums::Backward) load(gy, at, c0, gv);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
    for (int l = 0; l < V; ++l) {
      if (c0 + l >= C) continue;
      const float a = widen(xv[l]);
      if constexpr (S == Sums::X) {
        acc[0][l] += a;
      } else if constexpr (S == Sums::Centered) {
        const float d = a - mean[l];
        acc[0][l] += d * d;
      } else {
        const float g = widen(gv[l]);
        acc[0][l] += g;
        acc[1][l] += g * (a - mean[l]) * invstd[l];
      }
    }
  }

 private:
  DP_HD void load(const T* p, std::int64_t at, std::int64_t c0, T (&out)[V]) const {
    if (packed) {
      const walk::Pack<T, V> v = walk::load_pack<V>(p + at, 0);
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int l = 0; l < V; ++l) out[l] = v.v[l];
    } else {
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
      for (int l = 0; l < V; ++l) out[l] = c0 + l < C ? p[at + l] : T{};
    }
  }
};

/// Thread (g, r) of block (s, t): its V channels' sums over rows part.begin + r,
/// part.begin + r + rows, ... of split s, in that order (zeros past C).
template <int K, int V, typename Terms>
DP_HD void thread_sums(const Plan& p, int s, std::int64_t t, int g, int r, const Terms& terms, float (&acc)[K][V]) {
  for (int k = 0; k < K; ++k)
    for (int l = 0; l < V; ++l) acc[k][l] = 0.0f;
  const std::int64_t c0 = p.first_channel(t, g);
  if (c0 >= p.C) return;
  const kernel_plan::Part part = kernel_plan::part_of(p.M, p.splits, s);
  // Unrolled on the device so that four rows' loads are in flight before their adds
  // (which stay in row order).
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
  for (std::int64_t row = part.begin + r; row < part.end; row += p.rows) terms(row, c0, acc);
}

/// Where thread (g, r) leaves sum l of a block's shared array of rows x width floats.
DP_HD inline int slot(const Plan& p, int g, int r, int l) { return r * p.width() + g * p.lanes + l; }

/// Column j (0 <= j < width) of a block's shared sums: the rows' sums added in row order.
DP_HD inline float block_column(const Plan& p, const float* shared, int j) {
  float total = shared[j];
  for (int r = 1; r < p.rows; ++r) total += shared[r * p.width() + j];
  return total;
}

}  // namespace dp::backend::nhwc
