// src/backend/functors.h — elementwise math written once for every backend.
//
// The CPU backend calls these from TBB loops, the CUDA backend from kernels, so the
// arithmetic of every elementwise op, of the random number generator and of the fused
// optimizer updates is tested on CPU and is the same on both backends. This header
// must stay self-contained: only <cstdint>, <cstring>, <cmath> and backend.h (for the op
// enums); never CUDA headers, never tensors.
//
//   float y = dp::backend::Unary<dp::backend::UnaryOp::Exp>{}(x);
//   dp::backend::dispatch_binary(op, [&](auto f) { for (...) out[i] = f(a[i], b[i]); });
//   float u = dp::backend::uniform_from(seed, i);   // same value on CPU and CUDA
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backend/backend.h"

#ifdef __CUDACC__
#define DP_HD __host__ __device__
#else
#define DP_HD
#endif

namespace dp::backend {

// ---- unary ops ---------------------------------------------------------------------
// One functor per op (rather than a switch inside the loop) so that every loop body
// the compiler sees is branch-free and vectorises. NaN propagates where PyTorch
// propagates it (relu, maximum, minimum).

/// y = op(x) for one element; specialised per UnaryOp below.
// Note [Storage types]
// Elementwise math runs in float whatever a tensor stores: a kernel over storage type T
// widens each value it loads to acc_t<T> (float), applies the float functors below, and
// rounds what it stores back to T. For T = float both steps are the identity, so the
// float32 kernels compile to the plain loops they always were; a 16-bit dtype adds its
// two conversions (AccOf, load_acc, store_acc) and its kernels are instantiations.

/// The type elementwise math of storage type T runs in.
template <typename T>
struct AccOf {
  using type = float;
};
template <typename T>
using acc_t = typename AccOf<T>::type;

template <typename T>
DP_HD inline acc_t<T> load_acc(T v) {
  return static_cast<acc_t<T>>(v);
}
template <typename T>
DP_HD inline T store_acc(acc_t<T> v) {
  return static_cast<T>(v);
}

/// x converted to Dst: as static_cast for built-in types; a 16-bit float (dp/core/half.h)
/// goes through float, exact when widening and rounded once when narrowing to one.
template <typename Dst, typename Src>
DP_HD inline Dst convert(Src x) {
  if constexpr (std::is_arithmetic_v<Dst> && std::is_arithmetic_v<Src>) {
    return static_cast<Dst>(x);
  } else if constexpr (std::is_arithmetic_v<Dst>) {
    return static_cast<Dst>(static_cast<float>(x));
  } else {
    return Dst(static_cast<float>(x));
  }
}

/// A float functor F (a Unary<...> or Binary<...>) over storage type T.
template <typename T, typename F>
struct OnStorage {
  F f;
  DP_HD T operator()(T x) const { return store_acc<T>(f(load_acc(x))); }
  DP_HD T operator()(T a, T b) const { return store_acc<T>(f(load_acc(a), load_acc(b))); }
};

// ---- exp and tanh as branch-free float code ----------------------------------------------
// Note [Vectorisable exp and tanh]
// glibc's expf and tanhf are scalar calls: a loop that calls them runs one element at a
// time, and the GELU, softmax and sigmoid of a transformer spent a sixth of a CPU step
// there. exp_approx and tanh_approx are plain float arithmetic, integer bit moves and
// selects — no branch, no call — so a loop over them vectorises at any width (SSE,
// AVX2, AVX-512) and CUDA runs the same formulas, which keeps the two backends' results
// closer than their two libms did.
//
// exp_approx(x): x = n ln2 + r with n = round(x / ln2) (the 1.5 * 2^23 trick rounds to
// nearest and leaves n in the low bits), r = x - n ln2 in two parts (ln2_hi has 9
// significant bits, so n * ln2_hi is exact for |n| <= 150), |r| <= ln2 / 2, then
// e^r = 1 + r + r^2 Q(r), Q of degree 5 fitted by least squares on Chebyshev nodes
// (relative error of e^r). 2^n is applied as two factors 2^(n/2) 2^(n - n/2), each a
// normal float, so p * 2^(n/2) is exact and results down in the denormals are rounded
// once. x is clamped to [-104, 88.8] first: below, e^x is under half the smallest
// denormal (rounds to +0); above, n = 128 makes it +inf, as expf. NaN passes the clamp
// (comparisons with NaN are false) and propagates through the polynomial.
//
// tanh_approx(x): for |x| < 0.625, x + x^3 P(x^2) with P of degree 5 (same fit), no
// cancellation near 0; above, sign(x) (1 - 2 / (e^(2|x|) + 1)), whose terms are at most
// 1/2 of the result there. Past |x| ~ 44 e^(2|x|) is +inf and the result exactly ±1;
// ±0 stays ±0 and NaN stays NaN.
//
// Measured against double precision on every 61st float (tests/backend/
// cpu_backend_test.cpp checks every 997th and the edges): exp_approx within 1.23 ulp
// (denormal results counted in the denormal spacing), tanh_approx within 1.32 ulp, over
// the whole float range; glibc's tanhf measures 2.16 ulp the same way. The test holds
// them to 1.5 and 2 ulp, and infinities, NaN, ±0 and denormal inputs to the values of
// expf and tanhf. Loops built with FMA contraction (CUDA) may differ in the last bit
// from SSE/AVX loops built without it, inside the same bounds.

/// The bits of a float, and the float of some bits (memcpy: defined on host and device).
DP_HD inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
DP_HD inline float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
/// cond ? a : b as a bit blend. Written as `cond ? a : b`, GCC (under its default
/// -ftrapping-math) keeps a branch around the side that may raise a floating-point
/// exception and the loop stays scalar; the blend evaluates both sides and vectorises.
DP_HD inline float select_float(bool cond, float a, float b) {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(cond);
  return bits_float((float_bits(a) & mask) | (float_bits(b) & ~mask));
}

/// e^x within 1.5 ulp, branch-free (Note [Vectorisable exp and tanh]).
DP_HD inline float exp_approx(float x) {
  constexpr float kHi = 88.8f;     // > log(FLT_MAX) = 88.7228: gives +inf
  constexpr float kLo = -104.0f;   // < log(2^-150) = -103.97: gives +0
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: t - kRound is x / ln2 rounded
  constexpr float kLog2e = 1.44269504f;
  constexpr float kLn2Hi = 0.693359375f;      // 355 / 512: exact products with n
  constexpr float kLn2Lo = -2.12194440e-4f;   // ln2 - kLn2Hi
  x = select_float(x > kHi, kHi, x);
  x = select_float(x < kLo, kLo, x);
  const float t = x * kLog2e + kRound;
  const float n = t - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  const float q =
      0.500000008f +
      r * (0.166666662f + r * (0.0416662703f + r * (0.00833342998f + r * (0.00139460208f + r * 0.000198264962f))));
  const float p = 1.0f + r + r * r * q;
  // n in [-150, 128] as an integer: t's low mantissa bits (kRound has ulp 1).
  const auto ni = static_cast<std::int32_t>(float_bits(t) - float_bits(kRound));
  const std::int32_t n1 = ni >> 1, n2 = ni - n1;  // each in [-75, 64]
  const float s1 = bits_float(static_cast<std::uint32_t>(n1 + 127) << 23);
  const float s2 = bits_float(static_cast<std::uint32_t>(n2 + 127) << 23);
  return (p * s1) * s2;
}

/// tanh(x) within 2 ulp, branch-free (Note [Vectorisable exp and tanh]).
DP_HD inline float tanh_approx(float x) {
  constexpr float kSmall = 0.625f;  // below: the odd polynomial; above: the exp form
  const float a = ::fabsf(x);
  const float u = x * x;
  const float poly =
      -0.333333307f + u * (0.133332013f + u * (-0.0539462528f + u * (0.0216982095f +
                                                                    u * (-0.00817178874f + u * 0.00213822628f))));
  const float small = a + a * u * poly;
  const float big = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);
  return ::copysignf(select_float(a < kSmall, small, big), x);  // tanh is odd; keeps -0
}

template <UnaryOp Op>
struct Unary;

template <> struct Unary<UnaryOp::Neg> { DP_HD float operator()(float x) const { return -x; } };
// Exp, Tanh and Sigmoid: Note [Vectorisable exp and tanh].
template <> struct Unary<UnaryOp::Exp> { DP_HD float operator()(float x) const { return exp_approx(x); } };
template <> struct Unary<UnaryOp::Log> { DP_HD float operator()(float x) const { return ::logf(x); } };
template <> struct Unary<UnaryOp::Sqrt> { DP_HD float operator()(float x) const { return ::sqrtf(x); } };
template <> struct Unary<UnaryOp::Rsqrt> {
  DP_HD float operator()(float x) const { return 1.0f / ::sqrtf(x); }
};
template <> struct Unary<UnaryOp::Abs> { DP_HD float operator()(float x) const { return ::fabsf(x); } };
template <> struct Unary<UnaryOp::Square> { DP_HD float operator()(float x) const { return x * x; } };
template <> struct Unary<UnaryOp::Reciprocal> {
  DP_HD float operator()(float x) const { return 1.0f / x; }
};
template <> struct Unary<UnaryOp::Relu> {
  // `x < 0 ? 0 : x` keeps NaN (PyTorch's relu propagates it).
  DP_HD float operator()(float x) const { return x < 0.0f ? 0.0f : x; }
};
template <> struct Unary<UnaryOp::Sigmoid> {
  DP_HD float operator()(float x) const { return 1.0f / (1.0f + exp_approx(-x)); }
};
template <> struct Unary<UnaryOp::Tanh> { DP_HD float operator()(float x) const { return tanh_approx(x); } };
template <> struct Unary<UnaryOp::Sign> {
  // Returns x itself for ±0 and NaN, like torch.sign.
  DP_HD float operator()(float x) const { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }
};

template <> struct Unary<UnaryOp::Erf> { DP_HD float operator()(float x) const { return ::erff(x); } };
template <> struct Unary<UnaryOp::LogSigmoid> {
  // PyTorch's formula: no overflow either way, and log1p keeps the tail (x = 30: -9.4e-14).
  DP_HD float operator()(float x) const { return ::fminf(x, 0.0f) - ::log1pf(::expf(-::fabsf(x))); }
};

// Note [16-bit exp]
// A 16-bit exp stays libm's expf rounded once to the storage type, which is what the
// 16-bit tensor tests hold every elementwise op to (float32 math, one rounding). exp_approx's last-bit differences from expf would change
// a 16-bit result wherever expf lies next to a 16-bit rounding boundary; the float32
// loops, where the time goes, keep exp_approx (Note [Vectorisable exp and tanh]).

/// Unary<Exp> over a 16-bit storage type: Note [16-bit exp].
template <typename T>
  requires(!std::is_same_v<T, float>)
struct OnStorage<T, Unary<UnaryOp::Exp>> {
  Unary<UnaryOp::Exp> f;  // unused: the same members as the primary template
  DP_HD T operator()(T x) const { return store_acc<T>(::expf(load_acc(x))); }
};

/// Calls f(Unary<op>{}) with the functor of a runtime op: one switch per kernel launch,
/// none per element. Calls nothing for UnaryOp::kCount.
template <typename F>
DP_HD inline void dispatch_unary(UnaryOp op, F&& f) {
  switch (op) {
    case UnaryOp::Neg: f(Unary<UnaryOp::Neg>{}); return;
    case UnaryOp::Exp: f(Unary<UnaryOp::Exp>{}); return;
    case UnaryOp::Log: f(Unary<UnaryOp::Log>{}); return;
    case UnaryOp::Sqrt: f(Unary<UnaryOp::Sqrt>{}); return;
    case UnaryOp::Rsqrt: f(Unary<UnaryOp::Rsqrt>{}); return;
    case UnaryOp::Abs: f(Unary<UnaryOp::Abs>{}); return;
    case UnaryOp::Square: f(Unary<UnaryOp::Square>{}); return;
    case UnaryOp::Reciprocal: f(Unary<UnaryOp::Reciprocal>{}); return;
    case UnaryOp::Relu: f(Unary<UnaryOp::Relu>{}); return;
    case UnaryOp::Sigmoid: f(Unary<UnaryOp::Sigmoid>{}); return;
    case UnaryOp::Tanh: f(Unary<UnaryOp::Tanh>{}); return;
    case UnaryOp::Sign: f(Unary<UnaryOp::Sign>{}); return;
    case UnaryOp::Erf: f(Unary<UnaryOp::Erf>{}); return;
    case UnaryOp::LogSigmoid: f(Unary<UnaryOp::LogSigmoid>{}); return;
    case UnaryOp::kCount: return;  // not an op: callers check (Note [Op enum sentinels])
  }
}

/// y = op(x) for a runtime op (slow path: one switch per element).
DP_HD inline float apply_unary(UnaryOp op, float x) {
  float y = 0.0f;
  dispatch_unary(op, [&](auto f) { y = f(x); });
  return y;
}

// ---- GELU in one pass ----------------------------------------------------------------------
// Note [Fused GELU]
// nn::gelu composed of tensor ops was ten elementwise passes forward (tanh form: x³,
// affine, tanh, ... each a temporary the size of the MLP's hidden layer) and as many
// backward, and the autograd graph kept their intermediates. Op::Gelu and
// Op::GeluBackward are one pass each, in float whatever the storage (Note [Storage
// types]), with PyTorch's formulas (its CPU GeluKernel and GeluBackwardKernel):
//   tanh:  inner = √(2/π) (x + 0.044715 x³), t = tanh(inner), y = 0.5 x (1 + t),
//          gx = gy (0.5 (1 + t) + 0.5 x (1 - t²) √(2/π) (1 + 3 · 0.044715 x²));
//   exact: y = 0.5 x (1 + erf(x / √2)),
//          gx = gy (0.5 (1 + erf(x / √2)) + x e^(-x²/2) / √(2π)),
//          with 1 + erf(x / √2) taken as erfc(-x / √2) for x < 0. PyTorch adds 1 to erf
//          there, and below x ≈ -3 that sum cancels to erf's absolute error: on an H200
//          CUDA's erff and glibc's gave outputs 33 % apart at x ≈ -5 (PyTorch's own CPU
//          and CUDA differ alike). erfc keeps a few ulp relative on both.
// The backward needs only x, so a graph keeps the GELU's input alone. tanh is
// tanh_approx and e^ exp_approx (Note [Vectorisable exp and tanh]): the tanh form, the
// GPT's, vectorises; erf stays libm's erff (erfcf), one scalar call per element. Against the
// composed ops, which round every intermediate to float, the fused results differ by
// an ulp or two in float32 and are closer to PyTorch's in bfloat16 and float16 (one
// rounding instead of ten).

inline constexpr float kGeluBeta = 0.7978845608028654f;    // √(2/π)
inline constexpr float kGeluKappa = 0.044715f;             // GPT-2's cubic coefficient
inline constexpr float kGeluSqrtHalf = 0.7071067811865476f;  // 1/√2
inline constexpr float kGeluPdf = 0.3989422804014327f;     // 1/√(2π)

/// 1 + erf(x / √2), accurate in the left tail: there erf is close to -1 and 1 + erff
/// cancels, keeping only erff's absolute error (an ulp or two of 1, libm's and CUDA's
/// differing) in a result as small as 1e-7. erfc(-x / √2) is the same function with
/// relative accuracy (Note [Fused GELU]).
DP_HD inline float gelu_one_plus_erf(float x) {
  return x < 0.0f ? ::erfcf(-x * kGeluSqrtHalf) : 1.0f + ::erff(x * kGeluSqrtHalf);
}

/// y = gelu(x); Tanh: GPT-2's approximation, else exact (Note [Fused GELU]).
template <bool Tanh>
struct Gelu {
  DP_HD float operator()(float x) const {
    if constexpr (Tanh) {
      const float inner = kGeluBeta * (x + kGeluKappa * (x * x * x));
      return 0.5f * x * (1.0f + tanh_approx(inner));
    } else {
      return 0.5f * x * gelu_one_plus_erf(x);
    }
  }
};

/// gx = gy · gelu'(x) (Note [Fused GELU]).
template <bool Tanh>
struct GeluBackward {
  DP_HD float operator()(float x, float gy) const {
    if constexpr (Tanh) {
      const float x2 = x * x;
      const float t = tanh_approx(kGeluBeta * (x + kGeluKappa * (x2 * x)));
      const float left = 0.5f * (1.0f + t);
      const float right = 0.5f * x * (1.0f - t * t) * kGeluBeta * (1.0f + 3.0f * kGeluKappa * x2);
      return gy * (left + right);
    } else {
      const float cdf = 0.5f * gelu_one_plus_erf(x);
      const float pdf = exp_approx(-0.5f * x * x) * kGeluPdf;
      return gy * (cdf + x * pdf);
    }
  }
};

// ---- binary ops --------------------------------------------------------------------

/// out = op(a, b) for one element; specialised per BinaryOp below.
template <BinaryOp Op>
struct Binary;

template <> struct Binary<BinaryOp::Add> { DP_HD float operator()(float a, float b) const { return a + b; } };
template <> struct Binary<BinaryOp::Sub> { DP_HD float operator()(float a, float b) const { return a - b; } };
template <> struct Binary<BinaryOp::Mul> { DP_HD float operator()(float a, float b) const { return a * b; } };
template <> struct Binary<BinaryOp::Div> { DP_HD float operator()(float a, float b) const { return a / b; } };
template <> struct Binary<BinaryOp::Maximum> {
  // a + b is NaN when either is: torch.maximum propagates NaN.
  DP_HD float operator()(float a, float b) const {
    return (a != a || b != b) ? a + b : (a > b ? a : b);
  }
};
template <> struct Binary<BinaryOp::Minimum> {
  DP_HD float operator()(float a, float b) const {
    return (a != a || b != b) ? a + b : (a < b ? a : b);
  }
};
template <> struct Binary<BinaryOp::Pow> {
  DP_HD float operator()(float a, float b) const { return ::powf(a, b); }
};
template <> struct Binary<BinaryOp::Eq> {
  DP_HD float operator()(float a, float b) const { return a == b ? 1.0f : 0.0f; }
};
template <> struct Binary<BinaryOp::Gt> {
  DP_HD float operator()(float a, float b) const { return a > b ? 1.0f : 0.0f; }
};
template <> struct Binary<BinaryOp::ReluBackward> {
  DP_HD float operator()(float a, float b) const { return b > 0.0f ? a : 0.0f; }
};

/// Calls f(Binary<op>{}) with the functor of a runtime op; nothing for BinaryOp::kCount.
template <typename F>
DP_HD inline void dispatch_binary(BinaryOp op, F&& f) {
  switch (op) {
    case BinaryOp::Add: f(Binary<BinaryOp::Add>{}); return;
    case BinaryOp::Sub: f(Binary<BinaryOp::Sub>{}); return;
    case BinaryOp::Mul: f(Binary<BinaryOp::Mul>{}); return;
    case BinaryOp::Div: f(Binary<BinaryOp::Div>{}); return;
    case BinaryOp::Maximum: f(Binary<BinaryOp::Maximum>{}); return;
    case BinaryOp::Minimum: f(Binary<BinaryOp::Minimum>{}); return;
    case BinaryOp::Pow: f(Binary<BinaryOp::Pow>{}); return;
    case BinaryOp::Eq: f(Binary<BinaryOp::Eq>{}); return;
    case BinaryOp::Gt: f(Binary<BinaryOp::Gt>{}); return;
    case BinaryOp::ReluBackward: f(Binary<BinaryOp::ReluBackward>{}); return;
    case BinaryOp::kCount: return;  // not an op: callers check (Note [Op enum sentinels])
  }
}

/// out = op(a, b) for a runtime op (slow path: one switch per element).
DP_HD inline float apply_binary(BinaryOp op, float a, float b) {
  float y = 0.0f;
  dispatch_binary(op, [&](auto f) { y = f(a, b); });
  return y;
}

// ---- Philox4x32-10 counter-based RNG -----------------------------------------------
// Note [Counter-based random numbers]
// Element i of a random fill is a pure function of (seed, i): Philox4x32-10 (Salmon et
// al., SC'11) with counter = {lo32(i), hi32(i), 0, 0} and key = {lo32(seed),
// hi32(seed)}. No generator state is shared between threads, so any partition of the
// work — TBB chunks on CPU, a CUDA grid — draws the same numbers, and a tensor filled
// on one device equals the same fill on another. Each element uses lanes 0 and 1 of its
// own block; the other lanes are dropped, which costs some speed but keeps the mapping
// trivially identical everywhere.

/// Four 32-bit words: a Philox counter or output block.
struct Philox4 {
  std::uint32_t v[4];
};

// Multipliers and Weyl key increments of Philox4x32 (Random123 reference values).
inline constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr std::uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr std::uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
inline constexpr std::uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1
/// Rounds of Philox4x32-10: the variant Random123 recommends (passes BigCrush with margin).
inline constexpr int kPhiloxRounds = 10;

/// Philox4x32-10 of `counter` under the key {key0, key1}.
DP_HD constexpr Philox4 philox4x32(Philox4 counter, std::uint32_t key0, std::uint32_t key1) {
  std::uint32_t c0 = counter.v[0], c1 = counter.v[1], c2 = counter.v[2], c3 = counter.v[3];
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kPhiloxM0) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(kPhiloxM1) * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c0 = hi1 ^ c1 ^ key0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ key1;
    c3 = lo0;
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

/// The Philox block of element `index` under `seed` (Note [Counter-based random numbers]).
DP_HD constexpr Philox4 philox_block(std::uint64_t seed, std::uint64_t index) {
  return philox4x32(Philox4{{static_cast<std::uint32_t>(index),
                             static_cast<std::uint32_t>(index >> 32), 0u, 0u}},
                    static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
}

/// 2^-24: the spacing of floats in [0.5, 1); 24 random bits fill a float mantissa exactly.
inline constexpr float kTwoPowMinus24 = 1.0f / 16777216.0f;

/// Uniform in [0, 1) from the top 24 bits of a word (exactly representable, never 1).
DP_HD constexpr float uniform_open1(std::uint32_t bits) {
  return static_cast<float>(bits >> 8) * kTwoPowMinus24;
}
/// Uniform in (0, 1] (never 0, so its logarithm is finite).
DP_HD constexpr float uniform_open0(std::uint32_t bits) {
  return static_cast<float>((bits >> 8) + 1u) * kTwoPowMinus24;
}

/// Uniform in [0, 1) for element `index` under `seed`; bitwise identical on every backend.
DP_HD constexpr float uniform_from(std::uint64_t seed, std::uint64_t index) {
  return uniform_open1(philox_block(seed, index).v[0]);
}

inline constexpr float kTwoPi = 6.28318530717958647692f;

/// Box-Muller on two words of a Philox block (lanes 0 and 1): a standard normal.
DP_HD inline float normal_from_words(std::uint32_t w0, std::uint32_t w1) {
  const float u1 = uniform_open0(w0);
  const float u2 = uniform_open1(w1);
  return ::sqrtf(-2.0f * ::logf(u1)) * ::cosf(kTwoPi * u2);
}

/// Standard normal for element `index` under `seed` by Box-Muller on lanes 0 and 1.
/// CPU and CUDA agree to a few ulps (their logf/cosf may round differently).
DP_HD inline float normal_from(std::uint64_t seed, std::uint64_t index) {
  const Philox4 r = philox_block(seed, index);
  return normal_from_words(r.v[0], r.v[1]);
}

// ---- fused optimizer updates ----------------------------------------------------------
// The per-element formulas of torch.optim.SGD and torch.optim.Adam/AdamW (single-tensor
// implementation), as documented in backend.h. Scalars that do not depend on the element
// are computed once on the host by the make_* helpers.
//
// Note [Optimizer scalars in double]
// PyTorch's hyper-parameters are Python floats (doubles): 1 - beta2, 1 - dampening,
// 1 - lr * weight_decay, the bias corrections and lr / (1 - beta1^t) are computed in
// double and reach the float32 kernel rounded once. The make_* helpers take the
// optimizer's double options and do the same. Rounding beta2 = 0.999 to float first
// and subtracting there gives 1 - beta2 = 0.00099998713 (float's 0.999 is
// 0.99900001287), 1.3e-5 away from PyTorch's 0.001: every exp_avg_sq was that far from
// PyTorch's, found by the optimizer fuzzer (Note [Optimizer fuzzer] in
// tests/optim/optim_fuzz_replay.cpp).

/// Per-step scalars of SGD.
struct SgdParams {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_step;
};

/// SgdParams from the optimizer's options (Note [Optimizer scalars in double]).
inline SgdParams make_sgd_params(double lr, double momentum, double dampening, double weight_decay,
                                 bool nesterov, bool first_step) {
  return SgdParams{static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(1.0 - dampening),
                   static_cast<float>(weight_decay), nesterov, first_step};
}

/// One SGD element update: p, and buf when momentum != 0 (buf may be null otherwise).
struct SgdUpdate {
  SgdParams s;
  DP_HD void operator()(float& p, float g, float* buf) const {
    if (s.weight_decay != 0.0f) g += s.weight_decay * p;
    if (s.momentum != 0.0f) {
      float b = s.first_step ? g : s.momentum * *buf + s.one_minus_dampening * g;
      *buf = b;
      g = s.nesterov ? g + s.momentum * b : b;
    }
    p -= s.lr * g;
  }
};

/// Per-step scalars of Adam/AdamW, bias corrections included.
struct AdamParams {
  float one_minus_beta1;  // exp_avg.lerp_(g, 1 - beta1)'s weight
  float beta2, one_minus_beta2;
  float eps;
  float weight_decay;  // coupled (Adam): g += weight_decay * p
  float decay;         // decoupled (AdamW): p *= 1 - lr * weight_decay
  bool decoupled;
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
};

/// The scalars for 1-based `step` from the optimizer's options, computed in double and
/// rounded once, as PyTorch does on the host (Note [Optimizer scalars in double]).
inline AdamParams make_adam_params(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   bool decoupled, std::int64_t step) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return AdamParams{static_cast<float>(1.0 - beta1),
                    static_cast<float>(beta2),
                    static_cast<float>(1.0 - beta2),
                    static_cast<float>(eps),
                    static_cast<float>(weight_decay),
                    static_cast<float>(1.0 - lr * weight_decay),
                    decoupled,
                    static_cast<float>(lr / bc1),
                    static_cast<float>(std::sqrt(bc2))};
}

/// One Adam/AdamW element update of p, m (exp_avg) and v (exp_avg_sq).
struct AdamUpdate {
  AdamParams s;
  DP_HD void operator()(float& p, float g, float& m, float& v) const {
    if (s.decoupled) {
      p *= s.decay;
    } else if (s.weight_decay != 0.0f) {
      g += s.weight_decay * p;
    }
    // m.lerp_(g, 1 - beta1), with PyTorch's two-sided lerp formula (exact at both ends).
    const float w = s.one_minus_beta1;
    m = w < 0.5f ? m + w * (g - m) : g - (g - m) * (1.0f - w);
    v = s.beta2 * v + s.one_minus_beta2 * g * g;
    const float denom = ::sqrtf(v) / s.bc2_sqrt + s.eps;
    p -= s.step_size * (m / denom);
  }
};

}  // namespace dp::backend
