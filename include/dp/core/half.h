// dp/core/half.h — the 16-bit floating storage types: dp::BFloat16 and dp::Float16.
//
// Both are storage only: arithmetic converts to float, works in float and rounds back,
// as PyTorch's c10::BFloat16 and c10::Half do. Conversions from float round to nearest,
// ties to even, keep subnormals (no flush to zero), overflow to infinity, and keep
// infinities; a NaN becomes the format's quiet NaN (Note [16-bit NaNs]). Every
// conversion is bitwise what PyTorch's scalar conversion gives (tests/core/half_test.cpp
// checks it against values PyTorch wrote). Conversions to float are exact.
//
//   dp::BFloat16 b(3.14159f);          // 0x4049: 3.140625
//   float f = static_cast<float>(b);
//   std::uint16_t bits = dp::Float16(1.0f).bits;  // 0x3C00
//
// No CPU instruction is needed: the conversions are integer arithmetic, so they give the
// same bits on CPUs with and without a bf16 or f16c ISA (vectorised kernels in the
// backends must give these bits too).
#pragma once

#include <bit>
#include <cstdint>

namespace dp {

// Note [16-bit NaNs]
// A float NaN stays a NaN, with the bits PyTorch's CPU tensor conversion writes, so that a
// NaN saved by either library reads back as the same pattern: float16 keeps the sign and
// the payload's top 9 bits and sets the quiet bit (sign | 0x7E00 | mantissa >> 13, as an
// x86 vcvtps2ph does); bfloat16 writes 0xFFFF whatever came (x.to(torch.bfloat16);
// c10::BFloat16's scalar constructor writes 0x7FC0 instead and CUDA's __float2bfloat16
// 0x7FFF: no library makes bfloat16 payloads a contract). 16-bit NaNs widen to float
// with their payload shifted into place, so a quiet NaN stays quiet.

/// bfloat16: 1 sign, 8 exponent, 7 mantissa bits — float32's range at 8 bits of precision.
struct BFloat16 {
  std::uint16_t bits = 0;

  constexpr BFloat16() = default;
  /// Rounds `f` to nearest, ties to even (Note [16-bit NaNs] for a NaN).
  constexpr explicit BFloat16(float f) : bits(round_bits(f)) {}
  constexpr explicit operator float() const { return std::bit_cast<float>(std::uint32_t{bits} << 16); }
  static constexpr BFloat16 from_bits(std::uint16_t b) {
    BFloat16 x;
    x.bits = b;
    return x;
  }
  friend constexpr bool operator==(BFloat16 a, BFloat16 b) { return float(a) == float(b); }

  static constexpr std::uint16_t round_bits(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;  // NaN
    // Adding 0x7FFF rounds up from just above half an ulp; the kept LSB makes a tie round
    // to even. An overflow carries into the exponent and lands on infinity exactly.
    const std::uint32_t bias = 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>((u + bias) >> 16);
  }
};

/// IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits; largest finite 65504.
struct Float16 {
  std::uint16_t bits = 0;

  constexpr Float16() = default;
  /// Rounds `f` to nearest, ties to even; 65520 and above become infinity; values below
  /// 2^-14 become subnormals (Note [16-bit NaNs] for a NaN).
  constexpr explicit Float16(float f) : bits(round_bits(f)) {}
  constexpr explicit operator float() const { return to_float(bits); }
  static constexpr Float16 from_bits(std::uint16_t b) {
    Float16 x;
    x.bits = b;
    return x;
  }
  friend constexpr bool operator==(Float16 a, Float16 b) { return float(a) == float(b); }

  static constexpr std::uint16_t round_bits(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const std::uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00 | static_cast<std::uint16_t>((a >> 13) & 0x3FFu);  // NaN
    if (a >= 0x477FF000u) return sign | 0x7C00;      // >= 65520 (and infinity): infinity
    if (a < 0x38800000u) {                           // below 2^-14: a subnormal or zero
      // Scale so that the subnormal's integer mantissa (units of 2^-24) is the integer
      // part, with the rest as the fraction: m * 2^-24 = a. Work in 32-bit fixed point.
      if (a < 0x33000000u) return sign;              // below 2^-25: rounds to zero
      const int exp = static_cast<int>(a >> 23);    // biased float exponent, 102..112
      const std::uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;  // 24 significant bits
      const int shift = 126 - exp;                   // mant >> shift = units of 2^-24
      const std::uint32_t q = mant >> shift;
      const std::uint32_t rest = mant & ((1u << shift) - 1u);
      const std::uint32_t half = 1u << (shift - 1);
      const std::uint32_t r = q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
      return sign | static_cast<std::uint16_t>(r);   // r == 0x400 is 2^-14, the smallest normal
    }
    // Normal: rebias the exponent (127 -> 15) and round 23 mantissa bits to 10.
    const std::uint32_t rebased = a - (112u << 23);
    const std::uint32_t bias = 0xFFFu + ((rebased >> 13) & 1u);
    return sign | static_cast<std::uint16_t>((rebased + bias) >> 13);
  }

  static constexpr float to_float(std::uint16_t h) {
    const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
    const std::uint32_t exp = (h >> 10) & 0x1Fu;
    const std::uint32_t mant = h & 0x3FFu;
    if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));  // inf, NaN
    if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return std::bit_cast<float>(sign);
    // Subnormal: mant * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
};

}  // namespace dp
