// Launch decisions of the CUDA kernels (src/backend/kernel_plan.h): split counts and
// 32-bit index dispatch, tested without a GPU.
#include "backend/kernel_plan.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

namespace kp = dp::backend::kernel_plan;

TEST_CASE("splits: few long items are spread over about kTargetBlocks blocks") {
  CHECK(kp::row_splits(1, 100'000'000) == kp::kMaxSplits);  // a whole-tensor sum
  CHECK(kp::row_splits(8, 1 << 20) == 32);                  // 256 / 8
  CHECK(kp::bn_splits(256, 64, 56 * 56) == 4);              // ResNet stem: 256 / 64 channels
  CHECK(kp::row_splits(1, 3 * kp::kMinPerSplit) == 3);      // limited by kMinPerSplit
}

TEST_CASE("splits: one block per item when the items fill the GPU or are short") {
  CHECK(kp::row_splits(256, 1 << 20) == 1);
  CHECK(kp::bn_splits(32, 512, 7 * 7) == 1);
  CHECK(kp::row_splits(4, kp::kMinPerSplit + 1) == 1);
  CHECK(kp::row_splits(1, 100) == 1);
  CHECK(kp::row_splits(0, 100) == 1);
  CHECK(kp::row_splits(3, 0) == 1);
}

TEST_CASE("part_of: parts tile the row in order, none empty when len >= splits") {
  for (std::int64_t len : {1, 7, 64, 4096, 100'003}) {
    for (int s : {1, 2, 3, 7, 64}) {
      if (len < s) continue;
      CAPTURE(len);
      CAPTURE(s);
      std::int64_t at = 0;
      for (int i = 0; i < s; ++i) {
        const kp::Part p = kp::part_of(len, s, i);
        CHECK(p.begin == at);
        CHECK(p.end > p.begin);
        at = p.end;
      }
      CHECK(at == len);
    }
  }
}

TEST_CASE("32-bit index dispatch") {
  CHECK(kp::fits_i32(0));
  CHECK(kp::fits_i32(std::int64_t{1} << 31));  // indices 0 .. 2^31 - 1
  CHECK_FALSE(kp::fits_i32((std::int64_t{1} << 31) + 1));

  dp::backend::Indexer ix;
  ix.ndim = 2;
  ix.sizes[0] = 1000;
  ix.sizes[1] = 1000;
  ix.strides_a[0] = 1000;
  ix.strides_a[1] = 1;
  ix.strides_b[0] = 0;  // broadcast
  ix.strides_b[1] = 1;
  CHECK(kp::strided_fits_i32(ix, 1'000'000));
  ix.strides_a[0] = std::int64_t{1} << 22;  // a transposed view of a large tensor: 999 * 2^22 > 2^31
  CHECK_FALSE(kp::strided_fits_i32(ix, 1'000'000));
  ix.strides_a[0] = -1000;  // negative strides count by magnitude
  CHECK(kp::strided_fits_i32(ix, 1'000'000));

  dp::backend::Pool2dShape s;
  s.N = 256;
  s.C = 64;
  s.H = s.W = 112;
  s.kernel_h = s.kernel_w = 3;
  s.stride_h = s.stride_w = 2;
  s.pad_h = s.pad_w = 1;
  s.P = s.Q = 56;
  CHECK(kp::pool_fits_i32(s));  // 205 M input elements
  s.N = 4096;                   // 3.3 G input elements
  CHECK_FALSE(kp::pool_fits_i32(s));
}

TEST_CASE("FastDivider: n / d and n % d as the division gives them, over the whole int32 range") {
  // Divisors: small ones, the CNN's and ResNet's planes and channel counts, powers of two
  // and their neighbours, and the largest.
  std::vector<std::uint32_t> divisors;
  for (std::uint32_t d = 1; d <= 300; ++d) divisors.push_back(d);
  for (std::uint32_t d : {784u, 196u, 1024u, 3136u, 12544u, 50176u, 65535u, 65536u, 65537u, 1000003u, 0x40000000u,
                          0x40000001u, 0x7ffffffeu, 0x7fffffffu})
    divisors.push_back(d);
  for (int b = 1; b < 31; ++b) {
    divisors.push_back((1u << b) - 1);
    divisors.push_back((1u << b) + 1);
  }
  // Dividends: the edges of every quotient near 0 and near INT32_MAX, and a stride
  // through the range.
  std::uint64_t checked = 0, wrong = 0;
  for (std::uint32_t d : divisors) {
    const kp::FastDivider f(d);
    auto check = [&](std::uint64_t n) {
      if (n > 0x7fffffffu) return;
      const auto n32 = static_cast<std::uint32_t>(n);
      ++checked;
      if (f.div(n32) != n32 / d || f.mod(n32) != n32 % d) {
        if (++wrong <= 5) FAIL_CHECK("d=" << d << " n=" << n32 << ": got " << f.div(n32) << ", " << f.mod(n32));
      }
    };
    for (std::uint64_t n = 0; n < 4096; ++n) check(n);
    for (std::uint64_t q = 1; q < 4096; ++q) {  // around the first multiples of d
      check(q * d - 1);
      check(q * d);
    }
    for (std::uint64_t n = 0x7fffffffu - 4096; n <= 0x7fffffffu; ++n) check(n);
    const std::uint64_t top = 0x7fffffffu / d * d;  // around the last multiples of d
    for (std::uint64_t k = 0; k < 64 && top >= k * d + 1; ++k) {
      check(top - k * d);
      check(top - k * d - 1);
    }
    for (std::uint64_t n = 12345; n <= 0x7fffffffu; n += 1'000'003) check(n);
  }
  CHECK(wrong == 0);
  CHECK(checked > 1'000'000);
}

TEST_CASE("FastDivider: fast_divisible names the ranges it holds for") {
  CHECK(kp::fast_divisible(0x80000000LL, 784));  // dividends up to INT32_MAX
  CHECK_FALSE(kp::fast_divisible(0x80000001LL, 784));
  CHECK_FALSE(kp::fast_divisible(100, 0));
  CHECK_FALSE(kp::fast_divisible(100, 0x80000000LL));
  CHECK(kp::fast_divisible(0, 1));
}
