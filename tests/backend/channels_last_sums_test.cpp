// The per-channel sums of channels-last tensors on CUDA (src/backend/channels_last_sums.h,
// Note [Channels-last sums]): the plan, and the kernels' per-thread and per-block bodies
// run on the host, one simulated thread after another, against exact column sums.
#include "backend/channels_last_sums.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dp/core/error.h"

namespace nhwc = dp::backend::nhwc;
namespace kp = dp::backend::kernel_plan;

namespace {

bool power_of_two(int v) { return v > 0 && (v & (v - 1)) == 0; }

void check_plan(std::int64_t M, std::int64_t C, int lanes) {
  CAPTURE(M);
  CAPTURE(C);
  CAPTURE(lanes);
  const nhwc::Plan p = nhwc::plan(M, C, lanes);
  CHECK(power_of_two(p.cols));
  CHECK(p.cols <= 32);
  CHECK(p.cols * p.rows == nhwc::kThreads);
  CHECK(p.tiles * p.width() >= C);
  CHECK((p.tiles - 1) * p.width() < std::max<std::int64_t>(C, 1));
  CHECK(p.splits >= 1);
  CHECK(p.splits <= nhwc::kMaxSplits);
  // A split takes at least kMinPerSplit values of its tile, unless there is one.
  if (p.splits > 1) CHECK(M / p.splits * std::min<std::int64_t>(C, p.width()) >= kp::kMinPerSplit / 2);
  // No more blocks than the target asks for (one more split's worth at most).
  CHECK(p.splits * p.tiles < nhwc::kTargetBlocks + p.tiles);
}

/// Element values for the simulation: small integers, so that every sum in float is
/// exact and any order gives the same bits.
template <typename T>
struct Ints {
  float operator()(T v) const { return static_cast<float>(v) - 8.0f; }
};

/// Runs every block and thread of plan(M, C, V) for sums S over x (and gy) stored as T
/// (an integer type: Ints widens it), then adds each channel's splits in order as the
/// finalize kernels do; returns K x C sums.
template <nhwc::Sums S, int V, typename T>
std::vector<std::vector<float>> simulate(std::int64_t M, std::int64_t C, const std::vector<T>& x,
                                         const std::vector<T>& gy, const std::vector<float>& mean,
                                         const std::vector<float>& invstd, bool packed) {
  constexpr int K = nhwc::kSums<S>;
  const nhwc::Plan p = nhwc::plan(M, C, V);
  std::vector<float> part(static_cast<std::size_t>(K * C * p.splits), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> shared(static_cast<std::size_t>(K * nhwc::kThreads * V));
  for (int s = 0; s < p.splits; ++s) {
    for (std::int64_t t = 0; t < p.tiles; ++t) {
      // Unwritten slots stay NaN and poison the sums.
      std::fill(shared.begin(), shared.end(), std::numeric_limits<float>::quiet_NaN());
      for (int r = 0; r < p.rows; ++r) {
        for (int g = 0; g < p.cols; ++g) {
          const std::int64_t c0 = p.first_channel(t, g);
          nhwc::RowTerms<S, V, T, Ints<T>> terms{x.data(), gy.empty() ? nullptr : gy.data(), C, packed, {}, {}, {}};
          for (int l = 0; l < V; ++l) {
            terms.mean[l] = c0 + l < C && !mean.empty() ? mean[static_cast<std::size_t>(c0 + l)] : 0.0f;
            terms.invstd[l] = c0 + l < C && !invstd.empty() ? invstd[static_cast<std::size_t>(c0 + l)] : 0.0f;
          }
          float acc[K][V];
          nhwc::thread_sums(p, s, t, g, r, terms, acc);
          for (int k = 0; k < K; ++k)
            for (int l = 0; l < V; ++l)
              shared[static_cast<std::size_t>(k * nhwc::kThreads * V + nhwc::slot(p, g, r, l))] = acc[k][l];
        }
      }
      // After the barrier: thread (g, r) adds column j = r·cols + g, as the kernel does.
      for (int r = 0; r < p.rows; ++r) {
        for (int g = 0; g < p.cols; ++g) {
          const int j = r * p.cols + g;
          const std::int64_t c = t * p.width() + j;
          if (j >= p.width() || c >= C) continue;
          for (int k = 0; k < K; ++k)
            part[static_cast<std::size_t>(k * C * p.splits + c * p.splits + s)] =
                nhwc::block_column(p, shared.data() + k * nhwc::kThreads * V, j);
        }
      }
    }
  }
  std::vector<std::vector<float>> out(K, std::vector<float>(static_cast<std::size_t>(C)));
  for (int k = 0; k < K; ++k)
    for (std::int64_t c = 0; c < C; ++c) {
      float acc = part[static_cast<std::size_t>(k * C * p.splits + c * p.splits)];
      for (int s = 1; s < p.splits; ++s) acc += part[static_cast<std::size_t>(k * C * p.splits + c * p.splits + s)];
      out[static_cast<std::size_t>(k)][static_cast<std::size_t>(c)] = acc;
    }
  return out;
}

/// Every sum kind over M x C values stored as T with V lanes, packed and lane by lane,
/// against the exact sums.
template <int V, typename T>
void check_sums(std::int64_t M, std::int64_t C) {
  CAPTURE(M);
  CAPTURE(C);
  CAPTURE(V);
  std::vector<T> x(static_cast<std::size_t>(M * C)), gy(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<T>(8 + static_cast<int>((i * 7 + i / 5) % 9) - 4);  // -4..4 once widened
    gy[i] = static_cast<T>(8 + static_cast<int>((i * 3 + i / 11) % 7) - 3);  // -3..3
  }
  std::vector<float> mean(static_cast<std::size_t>(C)), invstd(static_cast<std::size_t>(C));
  for (std::int64_t c = 0; c < C; ++c) {
    mean[static_cast<std::size_t>(c)] = static_cast<float>(c % 3) - 1.0f;
    invstd[static_cast<std::size_t>(c)] = c % 2 == 0 ? 1.0f : 0.5f;
  }
  std::vector<double> sx(static_cast<std::size_t>(C)), sq(sx.size()), sg(sx.size()), sgx(sx.size());
  for (std::int64_t row = 0; row < M; ++row)
    for (std::int64_t c = 0; c < C; ++c) {
      const auto u = static_cast<std::size_t>(c);
      const double a = static_cast<double>(x[static_cast<std::size_t>(row * C + c)]) - 8.0;
      const double g = static_cast<double>(gy[static_cast<std::size_t>(row * C + c)]) - 8.0;
      sx[u] += a;
      sq[u] += (a - mean[u]) * (a - mean[u]);
      sg[u] += g;
      sgx[u] += g * (a - mean[u]) * invstd[u];
    }
  // Packed loads need C % V == 0 (the kernels' condition; the vectors are aligned).
  for (bool packed : {false, true}) {
    if (packed && C % V != 0) continue;
    CAPTURE(packed);
    const auto a = simulate<nhwc::Sums::X, V>(M, C, x, {}, {}, {}, packed);
    const auto b = simulate<nhwc::Sums::Centered, V>(M, C, x, {}, mean, {}, packed);
    const auto d = simulate<nhwc::Sums::Backward, V>(M, C, x, gy, mean, invstd, packed);
    for (std::int64_t c = 0; c < C; ++c) {
      CAPTURE(c);
      const auto u = static_cast<std::size_t>(c);
      CHECK(a[0][u] == sx[u]);
      CHECK(b[0][u] == sq[u]);
      CHECK(d[0][u] == sg[u]);
      CHECK(d[1][u] == sgx[u]);
    }
  }
}

}  // namespace

TEST_CASE("channels-last plan: thread shapes, tiles and splits for batch-norm shapes") {
  for (std::int64_t M : {1, 7, 4096, 32 * 7 * 7, 256 * 56 * 56})
    for (std::int64_t C : {1, 3, 8, 64, 100, 256, 512, 2048, 100000})
      for (int lanes : {4, 8}) check_plan(M, C, lanes);
  // ResNet-18's stem output at batch 256, bfloat16: 8 threads span the 64 channels, 32
  // rows of threads a block, and the rows split into kMaxSplits parts.
  const nhwc::Plan stem = nhwc::plan(256 * 56 * 56, 64, 8);
  CHECK(stem.cols == 8);
  CHECK(stem.rows == 32);
  CHECK(stem.tiles == 1);
  CHECK(stem.splits == nhwc::kMaxSplits);
  // Its last stage at batch 32: two tiles of 256 channels, splits limited by the rows.
  const nhwc::Plan last = nhwc::plan(32 * 7 * 7, 512, 8);
  CHECK(last.cols == 32);
  CHECK(last.tiles == 2);
  CHECK(last.splits == 32 * 7 * 7 * 256 / kp::kMinPerSplit);
  // Float32: 4 lanes a thread.
  CHECK(nhwc::plan(1000, 64, 4).cols == 16);
  // More than 8 lanes would leave a tile's columns past kThreads without a thread.
  CHECK_THROWS_AS(nhwc::plan(100, 64, 16), dp::Error);
  CHECK_THROWS_AS(nhwc::plan(100, 64, 3), dp::Error);
}

TEST_CASE("channels-last sums: every value counted once, in every plan shape, packed or lane by lane") {
  // 16-bit storage, 8 lanes: one tile, several tiles with a ragged last one, channels
  // not a multiple of the lanes, fewer rows than row-threads, splits over many rows.
  check_sums<8, std::uint16_t>(1, 1);
  check_sums<8, std::uint16_t>(5, 3);
  check_sums<8, std::uint16_t>(33, 64);
  check_sums<8, std::uint16_t>(300, 520);
  check_sums<8, std::uint16_t>(9001, 64);
  check_sums<8, std::uint16_t>(1000, 13);
  // Float32 storage, 4 lanes.
  check_sums<4, std::uint32_t>(7, 6);
  check_sums<4, std::uint32_t>(2049, 128);
  check_sums<4, std::uint32_t>(70001, 8);
}
