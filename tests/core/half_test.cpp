// tests/core/half_test.cpp — dp::BFloat16 and dp::Float16 conversions.
//
// Three independent witnesses: PyTorch's bits for ~4500 chosen and random floats
// (half_reference.h), a reference rounding written from the definition (the nearest of
// the sorted finite values of the format, ties to the even bit pattern) over a stride
// through every float, and exhaustive round trips of all 65536 patterns.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <vector>

#include "dp/core/half.h"
#include "half_reference.h"

namespace {

bool is_nan16(std::uint16_t bits, int exp_bits) {
  const int mant_bits = 15 - exp_bits;
  const std::uint32_t exp_mask = ((1u << exp_bits) - 1u) << mant_bits;
  return (bits & exp_mask) == exp_mask && (bits & ((1u << mant_bits) - 1u)) != 0;
}

// The reference: every non-negative finite value of a format as a double, in increasing
// order (the bit patterns of non-negative values sort like their values), plus the first
// value past the largest -- where infinity sits for rounding.
struct Format {
  std::vector<double> values;  // values[i] is the value of bits i; the last is "infinity"
  std::uint16_t inf_bits;
};

template <class T>
Format make_format(std::uint16_t inf_bits, double past_max) {
  Format f{{}, inf_bits};
  for (std::uint32_t b = 0; b < inf_bits; ++b)
    f.values.push_back(static_cast<double>(static_cast<float>(T::from_bits(static_cast<std::uint16_t>(b)))));
  f.values.push_back(past_max);
  return f;
}

// Round `x` (finite or infinite, not NaN) to the format by the definition.
std::uint16_t reference_round(const Format& f, float x) {
  const double a = std::fabs(static_cast<double>(x));
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isinf(a) || a >= f.values.back()) return sign | f.inf_bits;
  auto hi = std::upper_bound(f.values.begin(), f.values.end(), a);  // first value > a
  const std::size_t i = static_cast<std::size_t>(hi - f.values.begin()) - 1;  // values[i] <= a
  if (f.values[i] == a) return sign | static_cast<std::uint16_t>(i);
  const double below = a - f.values[i], above = f.values[i + 1] - a;
  std::size_t pick = below < above ? i : above < below ? i + 1 : (i % 2 == 0 ? i : i + 1);
  return sign | static_cast<std::uint16_t>(pick);
}

// bfloat16's largest finite value is (2 - 2^-7) 2^127; the next step would be 2^128.
const Format& bf16_format() {
  static const Format f = make_format<dp::BFloat16>(0x7F80, std::ldexp(1.0, 128));
  return f;
}
// float16's largest is 65504 and its step there 32: infinity sits at 65536.
const Format& fp16_format() {
  static const Format f = make_format<dp::Float16>(0x7C00, 65536.0);
  return f;
}

}  // namespace

TEST_CASE("16-bit conversions give PyTorch's bits") {
  constexpr std::size_t n = std::size(kHalfInputs);
  static_assert(std::size(kTorchBFloat16) == n && std::size(kTorchFloat16) == n);
  int nans = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = std::bit_cast<float>(kHalfInputs[i]);
    CAPTURE(kHalfInputs[i]);
    const std::uint16_t b = dp::BFloat16(x).bits, h = dp::Float16(x).bits;
    if (std::isnan(x)) {  // Note [16-bit NaNs]: a NaN, and PyTorch's pattern for it
      ++nans;
      CHECK(is_nan16(b, 8));
      CHECK(is_nan16(h, 5));
      CHECK(is_nan16(kTorchBFloat16[i], 8));
      CHECK(is_nan16(kTorchFloat16[i], 5));
      CHECK(b == kTorchBFloat16[i]);
      CHECK(h == kTorchFloat16[i]);
      continue;
    }
    CHECK(b == kTorchBFloat16[i]);
    CHECK(h == kTorchFloat16[i]);
  }
  CHECK(nans >= 4);  // the table does hold NaNs
}

TEST_CASE("16-bit conversions round to nearest, ties to even, by the definition") {
  const Format& bf = bf16_format();
  const Format& hf = fp16_format();
  // A stride through every float bit pattern (odd, so every low-bit residue is visited),
  // and the neighbourhood of every tie of both formats at a spread of exponents.
  std::vector<std::uint32_t> patterns;
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull; u += 65521) patterns.push_back(static_cast<std::uint32_t>(u));
  for (std::uint32_t hi = 0; hi < 0x8000; hi += 97)
    for (std::uint32_t lo : {0x7FFFu, 0x8000u, 0x8001u}) patterns.push_back((hi << 16) | lo);
  for (std::uint32_t h = 0; h < 0x7C00; h += 7) {  // float16: midway between h and h + 1
    const double mid = (static_cast<double>(static_cast<float>(dp::Float16::from_bits(static_cast<std::uint16_t>(h)))) +
                        static_cast<double>(static_cast<float>(dp::Float16::from_bits(static_cast<std::uint16_t>(h + 1))))) / 2;
    const float m = static_cast<float>(mid);  // exact: float has 13 more mantissa bits
    patterns.push_back(std::bit_cast<std::uint32_t>(m));
    patterns.push_back(std::bit_cast<std::uint32_t>(std::nextafter(m, 0.0f)));
    patterns.push_back(std::bit_cast<std::uint32_t>(std::nextafter(m, 1e30f)));
  }
  std::size_t checked = 0;
  for (std::uint32_t u : patterns) {
    const float x = std::bit_cast<float>(u);
    if (std::isnan(x)) continue;
    CAPTURE(u);
    REQUIRE(dp::BFloat16(x).bits == reference_round(bf, x));
    REQUIRE(dp::Float16(x).bits == reference_round(hf, x));
    ++checked;
  }
  CHECK(checked > 70000);
}

TEST_CASE("every 16-bit pattern widens exactly and rounds back to itself") {
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    CAPTURE(b);
    const float fb = static_cast<float>(dp::BFloat16::from_bits(bits));
    const float fh = static_cast<float>(dp::Float16::from_bits(bits));
    CHECK(std::isnan(fb) == is_nan16(bits, 8));
    CHECK(std::isnan(fh) == is_nan16(bits, 5));
    if (!is_nan16(bits, 8)) REQUIRE(dp::BFloat16(fb).bits == bits);
    if (!is_nan16(bits, 5)) REQUIRE(dp::Float16(fh).bits == bits);
    // bfloat16 is float32's upper half.
    CHECK(std::bit_cast<std::uint32_t>(fb) == (b << 16));
  }
}

TEST_CASE("16-bit constants: extremes, subnormals, signed zero, infinity") {
  using dp::BFloat16;
  using dp::Float16;
  CHECK(Float16(1.0f).bits == 0x3C00);
  CHECK(Float16(-2.0f).bits == 0xC000);
  CHECK(Float16(65504.0f).bits == 0x7BFF);
  CHECK(Float16(65519.996f).bits == 0x7BFF);
  CHECK(Float16(65520.0f).bits == 0x7C00);  // the tie rounds to the even pattern: infinity
  CHECK(Float16(std::ldexp(1.0f, -24)).bits == 0x0001);
  CHECK(Float16(std::ldexp(1.0f, -25)).bits == 0x0000);  // a tie with zero: even
  CHECK(Float16(std::ldexp(3.0f, -25)).bits == 0x0002);  // 1.5 units: a tie, to even
  CHECK(Float16(-0.0f).bits == 0x8000);
  CHECK(Float16(-std::numeric_limits<float>::infinity()).bits == 0xFC00);
  CHECK(static_cast<float>(Float16::from_bits(0x0001)) == std::ldexp(1.0f, -24));
  CHECK(static_cast<float>(Float16::from_bits(0x03FF)) == std::ldexp(1023.0f, -24));
  CHECK(BFloat16(1.0f).bits == 0x3F80);
  CHECK(BFloat16(3.14159f).bits == 0x4049);
  CHECK(BFloat16(std::numeric_limits<float>::max()).bits == 0x7F80);  // rounds past the largest
  CHECK(BFloat16(std::numeric_limits<float>::denorm_min()).bits == 0x0000);
  CHECK(BFloat16(std::ldexp(1.0f, -133)).bits == 0x0001);  // bfloat16's smallest subnormal
  CHECK(BFloat16(-0.0f).bits == 0x8000);
  static_assert(BFloat16(1.0f).bits == 0x3F80 && Float16(1.0f).bits == 0x3C00, "constexpr");
}
