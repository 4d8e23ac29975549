// How the CUDA elementwise kernels walk memory (src/backend/elementwise_walk.h), tested
// without a GPU: the same DP_HD bodies the kernels call, run here one simulated thread
// after another, against a plain loop over the uncollapsed Indexer.
#include "backend/elementwise_walk.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "backend/functors.h"
#include "dp/core/error.h"
#include "dp/core/half.h"

namespace {

namespace be = dp::backend;
namespace walk = dp::backend::walk;
using i64 = std::int64_t;

be::Indexer make_indexer(std::vector<i64> sizes, std::vector<i64> sa, std::vector<i64> sb) {
  be::Indexer ix;
  ix.ndim = static_cast<int>(sizes.size());
  for (int d = 0; d < ix.ndim; ++d) {
    ix.sizes[d] = sizes[d];
    ix.strides_a[d] = sa[d];
    ix.strides_b[d] = sb[d];
  }
  return ix;
}

i64 numel(const be::Indexer& ix) {
  i64 n = 1;
  for (int d = 0; d < ix.ndim; ++d) n *= ix.sizes[d];
  return n;
}

/// n elements of T at a 64-byte boundary plus `shift` elements (a view's offset).
template <typename T>
struct Buffer {
  explicit Buffer(i64 n, i64 shift = 0)
      : base(static_cast<T*>(std::aligned_alloc(64, (static_cast<std::size_t>(n + shift) * sizeof(T) / 64 + 1) * 64))),
        data(base + shift) {}
  ~Buffer() { std::free(base); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* base;
  T* data;
};

template <typename T>
T value_of(float v) {
  return be::convert<T>(v);
}

template <typename T>
std::uint64_t bits_of(T v) {
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

/// The threads of a grid: `threads` of them, each calling body(first, stride).
template <typename Body>
void run_grid(int threads, Body body) {
  for (int t = 0; t < threads; ++t) body(t, threads);
}

/// out = a (op) b over ix, as the CUDA launcher walks it (collapse, plan, FastIndexer),
/// against the plain loop; `a_off`, `b_off`: the views' offsets into their buffers, in
/// elements (alignment). Returns the plan's lanes.
template <typename T>
int check_binary(const be::Indexer& ix, i64 a_span, i64 b_span, i64 a_off, i64 b_off, int threads = 7) {
  CAPTURE(a_off);
  CAPTURE(b_off);
  const i64 n = numel(ix);
  Buffer<T> a(a_span, a_off), b(b_span, b_off), out(n), want(n);
  for (i64 i = 0; i < a_span; ++i) a.data[i] = value_of<T>(0.37f * static_cast<float>(i % 97) - 11.0f);
  for (i64 i = 0; i < b_span; ++i) b.data[i] = value_of<T>(1.0f / static_cast<float>(i % 13 + 3));
  const be::OnStorage<T, be::Binary<be::BinaryOp::Mul>> f{{}};
  for (i64 i = 0; i < n; ++i) {
    i64 oa, ob;
    walk::offsets(ix, i, oa, ob);
    want.data[i] = f(a.data[oa], b.data[ob]);
  }
  const walk::Collapsed c = walk::collapse(ix);
  constexpr int L = walk::pack_lanes<T>;
  const walk::PackPlan p = walk::plan_packs(c, L, a.data, b.data, out.data, sizeof(T), true);
  const walk::FastIndexer fx = walk::fast_indexer(p.ix, p.n);
  walk::with_pack_kind<L>(p, [&](auto lanes, auto broadcast) {
    run_grid(threads, [&](i64 first, i64 stride) {
      walk::binary_strided_range<decltype(lanes)::value, decltype(broadcast)::value>(f, fx, a.data, b.data, out.data,
                                                                                      p.n, first, stride);
    });
  });
  for (i64 i = 0; i < n; ++i) {
    CAPTURE(i);
    REQUIRE(bits_of(out.data[i]) == bits_of(want.data[i]));
  }
  return p.lanes;
}

}  // namespace

TEST_CASE("collapse: size-1 dims dropped, contiguous neighbours merged") {
  // A same-shape op over (2, 3, 4): one dense dimension.
  walk::Collapsed c = walk::collapse(make_indexer({2, 3, 4}, {12, 4, 1}, {12, 4, 1}));
  CHECK(c.contiguous);
  CHECK(c.ix.ndim == 1);
  CHECK(c.numel == 24);
  // A bias add (rows, 1, cols) + (cols): two dims, b's outer stride 0.
  c = walk::collapse(make_indexer({5, 1, 8}, {8, 8, 1}, {0, 0, 1}));
  CHECK_FALSE(c.contiguous);
  REQUIRE(c.ix.ndim == 2);
  CHECK(c.ix.sizes[0] == 5);
  CHECK(c.ix.strides_b[0] == 0);
  CHECK(c.ix.strides_b[1] == 1);
  // A per-channel op over (N, C, HW): three dims.
  c = walk::collapse(make_indexer({2, 3, 16}, {48, 16, 1}, {0, 1, 0}));
  CHECK(c.ix.ndim == 3);
  // Empty and all-ones.
  CHECK(walk::collapse(make_indexer({3, 0}, {0, 1}, {0, 1})).numel == 0);
  c = walk::collapse(make_indexer({1, 1}, {5, 7}, {0, 0}));
  CHECK(c.ix.ndim == 1);
  CHECK(c.ix.sizes[0] == 1);
}

TEST_CASE("FastIndexer: the offsets of Indexer's divisions, for every element") {
  std::mt19937_64 rng(20261201);
  for (int trial = 0; trial < 300; ++trial) {
    const int nd = static_cast<int>(rng() % dp::backend::kMaxDims) + 1;
    be::Indexer ix;
    ix.ndim = nd;
    for (int d = 0; d < nd; ++d) {
      ix.sizes[d] = static_cast<i64>(rng() % 5) + 1;
      ix.strides_a[d] = static_cast<i64>(rng() % 201) - 100;  // negative and zero strides too
      ix.strides_b[d] = rng() % 3 == 0 ? 0 : static_cast<i64>(rng() % 5000);
    }
    const i64 n = numel(ix);
    const walk::FastIndexer fx = walk::fast_indexer(ix, n);
    for (i64 i = 0; i < n; ++i) {
      i64 oa, ob;
      walk::offsets(ix, i, oa, ob);
      std::int32_t fa, fb;
      walk::offsets(fx, static_cast<std::int32_t>(i), fa, fb);
      CAPTURE(trial);
      CAPTURE(i);
      REQUIRE(fa == oa);
      REQUIRE(fb == ob);
    }
  }
  // Large sizes, near the 32-bit limit of the flat index.
  const be::Indexer big = make_indexer({46341, 46340}, {1, 46341}, {46340, 1});
  const walk::FastIndexer fx = walk::fast_indexer(big, numel(big));
  for (i64 i : {i64{0}, i64{46339}, i64{46340}, i64{1} << 30, numel(big) - 1}) {
    i64 oa, ob;
    walk::offsets(big, i, oa, ob);
    std::int32_t fa, fb;
    walk::offsets(fx, static_cast<std::int32_t>(i), fa, fb);
    CHECK(fa == oa);
    CHECK(fb == ob);
  }
  CHECK_THROWS_AS(walk::fast_indexer(make_indexer({70000, 70000}, {70000, 1}, {0, 1}), i64{70000} * 70000),
                  dp::Error);
}

TEST_CASE("plan_packs: packs only where the innermost dimension is dense and everything lines up") {
  alignas(64) static std::uint16_t mem[4096];
  const void* a = mem;
  const void* b = mem + 1024;
  const void* out = mem + 2048;
  const auto plan = [&](const be::Indexer& ix, const void* pa, const void* pb, bool uses_b = true) {
    return walk::plan_packs(walk::collapse(ix), 8, pa, pb, out, 2, uses_b);
  };
  // A bias add (rows, cols) + (cols): packs of 8, b dense.
  walk::PackPlan p = plan(make_indexer({4, 24}, {24, 1}, {0, 1}), a, b);
  CHECK(p.lanes == 8);
  CHECK_FALSE(p.b_broadcast);
  CHECK(p.n == 12);
  CHECK(p.ix.sizes[1] == 3);
  CHECK(p.ix.strides_a[0] == 3);
  CHECK(p.ix.strides_a[1] == 1);
  CHECK(p.ix.strides_b[1] == 1);
  // A per-channel op with HW = 16: b broadcast along the inner dim, its strides in elements.
  p = plan(make_indexer({2, 3, 16}, {48, 16, 1}, {0, 1, 0}), a, b);
  CHECK(p.lanes == 8);
  CHECK(p.b_broadcast);
  CHECK(p.ix.strides_b[1] == 1);
  CHECK(p.ix.strides_a[1] == 2);
  CHECK(p.ix.strides_a[2] == 1);
  CHECK(p.ix.strides_b[2] == 0);
  // Not packed: HW = 49; an inner dim of 12; a transposed a; an outer stride of 20; a
  // view one element off its pack; b's inner stride 2; b misaligned (dense b only).
  CHECK(plan(make_indexer({2, 3, 49}, {147, 49, 1}, {0, 1, 0}), a, b).lanes == 1);
  CHECK(plan(make_indexer({4, 12}, {12, 1}, {0, 1}), a, b).lanes == 1);
  CHECK(plan(make_indexer({16, 8}, {1, 16}, {0, 1}), a, b).lanes == 1);
  CHECK(plan(make_indexer({4, 16}, {20, 1}, {0, 1}), a, b).lanes == 1);
  CHECK(plan(make_indexer({4, 16}, {16, 1}, {0, 1}), mem + 1, b).lanes == 1);
  CHECK(plan(make_indexer({4, 16}, {16, 1}, {0, 2}), a, b).lanes == 1);
  CHECK(plan(make_indexer({4, 16}, {16, 1}, {0, 1}), a, mem + 1025).lanes == 1);
  CHECK(plan(make_indexer({2, 3, 16}, {48, 16, 1}, {0, 1, 0}), a, mem + 1025).lanes == 8);  // broadcast b: any address
  // A copy ignores b: a head split (B, H, T, D) out of (B, T, H, D), D = 16.
  p = plan(make_indexer({2, 3, 5, 16}, {240, 16, 48, 1}, {0, 0, 0, 0}), a, nullptr, false);
  CHECK(p.lanes == 8);
  CHECK(p.n == 2 * 3 * 5 * 2);
}

TEST_CASE("strided binary ops: the packed walk writes the plain loop's bits") {
  SUBCASE("bias add, bf16 and float") {
    CHECK(check_binary<dp::BFloat16>(make_indexer({5, 24}, {24, 1}, {0, 1}), 120, 24, 0, 0) == 8);
    CHECK(check_binary<float>(make_indexer({5, 24}, {24, 1}, {0, 1}), 120, 24, 0, 0) == 4);
    CHECK(check_binary<dp::Float16>(make_indexer({3, 1, 40}, {40, 40, 1}, {0, 0, 1}), 120, 40, 0, 0) == 8);
  }
  SUBCASE("per-channel, b broadcast along the inner dim") {
    CHECK(check_binary<dp::BFloat16>(make_indexer({2, 3, 16}, {48, 16, 1}, {0, 1, 0}), 96, 3, 0, 1) == 8);
    CHECK(check_binary<float>(make_indexer({2, 3, 8}, {24, 8, 1}, {0, 1, 0}), 48, 3, 0, 0) == 4);
  }
  SUBCASE("views that cannot be packed: one element at a time, the same bits") {
    CHECK(check_binary<dp::BFloat16>(make_indexer({5, 24}, {24, 1}, {0, 1}), 120, 24, 3, 0) == 1);
    CHECK(check_binary<dp::BFloat16>(make_indexer({6, 5}, {1, 6}, {5, 1}), 30, 30, 0, 0) == 1);
    CHECK(check_binary<dp::BFloat16>(make_indexer({2, 3, 7}, {21, 7, 1}, {0, 1, 0}), 42, 3, 0, 0) == 1);
  }
  SUBCASE("a narrowed view: outer stride 32, inner 16, both dense in packs") {
    CHECK(check_binary<dp::BFloat16>(make_indexer({4, 16}, {32, 1}, {16, 1}), 128, 64, 8, 0) == 8);
  }
  SUBCASE("negative outer strides: packs walk backwards") {
    // a's rows read from the last to the first: a starts at its last row.
    be::Indexer ix = make_indexer({4, 16}, {-16, 1}, {0, 1});
    const i64 n = 64;
    Buffer<dp::BFloat16> a(n), b(16), out(n), want(n);
    for (i64 i = 0; i < n; ++i) a.data[i] = value_of<dp::BFloat16>(static_cast<float>(i));
    for (i64 i = 0; i < 16; ++i) b.data[i] = value_of<dp::BFloat16>(0.5f + static_cast<float>(i));
    const dp::BFloat16* a_view = a.data + 48;
    const be::OnStorage<dp::BFloat16, be::Binary<be::BinaryOp::Add>> f{{}};
    const walk::PackPlan p = walk::plan_packs(walk::collapse(ix), 8, a_view, b.data, out.data, 2, true);
    REQUIRE(p.lanes == 8);
    const walk::FastIndexer fx = walk::fast_indexer(p.ix, p.n);
    run_grid(3, [&](i64 first, i64 stride) {
      walk::binary_strided_range<8, false>(f, fx, a_view, b.data, out.data, p.n, first, stride);
    });
    for (i64 r = 0; r < 4; ++r)
      for (i64 k = 0; k < 16; ++k)
        CHECK(bits_of(out.data[r * 16 + k]) == bits_of(f(a.data[(3 - r) * 16 + k], b.data[k])));
  }
}

TEST_CASE("strided copies in packs: a head split and merge") {
  // (B, T, H, D) -> (B, H, T, D) and back, D = 16 and D = 12 (not packed), as uint16 bits.
  for (i64 D : {i64{16}, i64{12}}) {
    CAPTURE(D);
    const i64 B = 2, T = 5, H = 3, n = B * T * H * D;
    Buffer<std::uint16_t> src(n), mid(n), back(n);
    for (i64 i = 0; i < n; ++i) src.data[i] = static_cast<std::uint16_t>(i * 7919 % 65536);
    const auto copy = [&](const be::Indexer& ix, const std::uint16_t* from, std::uint16_t* to) {
      const walk::Collapsed c = walk::collapse(ix);
      const walk::PackPlan p = walk::plan_packs(c, 8, from, nullptr, to, 2, false);
      CHECK(p.lanes == (D % 8 == 0 ? 8 : 1));
      const walk::FastIndexer fx = walk::fast_indexer(p.ix, p.n);
      walk::with_pack_kind<8>(p, [&](auto lanes, auto) {
        run_grid(5, [&](i64 first, i64 stride) {
          walk::copy_strided_range<decltype(lanes)::value>(fx, from, to, p.n, first, stride);
        });
      });
    };
    // out (b, h, t, d) reads in (b, t, h, d).
    copy(make_indexer({B, H, T, D}, {T * H * D, D, H * D, 1}, {0, 0, 0, 0}), src.data, mid.data);
    for (i64 b = 0; b < B; ++b)
      for (i64 h = 0; h < H; ++h)
        for (i64 t = 0; t < T; ++t)
          for (i64 d = 0; d < D; ++d)
            REQUIRE(mid.data[((b * H + h) * T + t) * D + d] == src.data[((b * T + t) * H + h) * D + d]);
    copy(make_indexer({B, T, H, D}, {H * T * D, D, T * D, 1}, {0, 0, 0, 0}), mid.data, back.data);
    CHECK(std::memcmp(back.data, src.data, static_cast<std::size_t>(n) * 2) == 0);
  }
}

TEST_CASE("contiguous kernels: packs, then the tail one by one; misaligned pointers one by one") {
  struct ToBf16 {
    dp::BFloat16 operator()(float x) const { return be::convert<dp::BFloat16>(x); }
  };
  for (i64 n : {i64{0}, i64{3}, i64{8}, i64{37}, i64{1000}}) {
    for (i64 shift : {i64{0}, i64{1}}) {
      CAPTURE(n);
      CAPTURE(shift);
      Buffer<float> x(n, shift);
      Buffer<dp::BFloat16> y(n), z(n);
      for (i64 i = 0; i < n; ++i) x.data[i] = 1.0f / static_cast<float>(i + 3) - 0.1f;
      // The cast float -> bf16: 4 lanes where both sides are aligned.
      constexpr int L = walk::pack_lanes<float, dp::BFloat16>;
      static_assert(L == 4);
      const int lanes = walk::contiguous_lanes(L, static_cast<const float*>(x.data),
                                               static_cast<const dp::BFloat16*>(y.data));
      CHECK(lanes == (shift == 0 ? 4 : 1));
      const auto cast = [&](auto lanes_c) {
        run_grid(6, [&](i64 first, i64 stride) {
          walk::map1_range<decltype(lanes_c)::value>(ToBf16{}, x.data, y.data, n, first, stride);
        });
      };
      if (lanes == 4) {
        cast(std::integral_constant<int, 4>{});
      } else {
        cast(std::integral_constant<int, 1>{});
      }
      for (i64 i = 0; i < n; ++i) REQUIRE(bits_of(y.data[i]) == bits_of(ToBf16{}(x.data[i])));
      // y = y + z in place (an output aliasing an input), 8 lanes.
      for (i64 i = 0; i < n; ++i) z.data[i] = value_of<dp::BFloat16>(static_cast<float>(i));
      std::vector<dp::BFloat16> before(y.data, y.data + n);
      const be::OnStorage<dp::BFloat16, be::Binary<be::BinaryOp::Add>> add{{}};
      run_grid(4, [&](i64 first, i64 stride) {
        walk::map2_range<8>(add, static_cast<const dp::BFloat16*>(y.data), z.data, y.data, n, first, stride);
      });
      for (i64 i = 0; i < n; ++i)
        REQUIRE(bits_of(y.data[i]) == bits_of(add(before[static_cast<std::size_t>(i)], z.data[i])));
    }
  }
}
