// tests/cuda/cuda_attention_test.cpp — the CUDA fused attention (Note [Fused attention on
// CUDA] in src/backend/cuda/cuda_attention.cu) against the CPU fused kernel on the same
// inputs and against the math path on the GPU: out, lse and the three input gradients in
// float32, bfloat16 and float16; causal and not; every mask form the op takes (additive
// and keep, float32 and the call's dtype, broadcast and strided); T = 1, 63, 129, 300
// (partial tiles) and cross-attention; head dims 32, 64, 128 and odd ones; dropout (the
// dropout op's keep bits, which the CPU kernel draws too); a row with every key masked (zeros);
// reproducible gradients; O(T) memory; and the calls left to the math path (head dims
// above 128). Without a CUDA device the binary exits 77 (SKIP).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "../test_errors.h"
#include "backend/backend.h"
#include "dp/dp.h"

namespace {

using dp::Shape;
using dp::Tensor;
using dp::nn::AttentionPath;
namespace be = dp::backend;
using be::DType;
using i64 = std::int64_t;

/// The device under test.
dp::Device gpu() { return dp::cuda(0); }

/// For a scope: an attention path, and TF32 off, so that the math path's GEMMs are
/// float32 (Note [TF32 policy]).
class Setting {
 public:
  explicit Setting(AttentionPath path) : tf32_(dp::allow_tf32_matmul()) {
    dp::nn::set_attention_path(path);
    dp::set_allow_tf32_matmul(false);
  }
  ~Setting() {
    dp::nn::set_attention_path(AttentionPath::Auto);
    dp::set_allow_tf32_matmul(tf32_);
  }
  Setting(const Setting&) = delete;
  Setting& operator=(const Setting&) = delete;

 private:
  bool tf32_;
};

/// max |a - b| / max(max |b|, 1): the error normwise, relative to the values' scale
/// (inputs are O(1), and so are the results; the floor keeps a result that should be 0,
/// as gq and gk with one key, from dividing rounding noise by itself). Infinite where a
/// NaN or an infinity is not on both sides alike.
double error(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0, scale = 1;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      if (!(std::isnan(a[i]) && std::isnan(b[i])) && a[i] != b[i]) return INFINITY;
      continue;
    }
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return worst / scale;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

/// The unit roundoff of a dtype: half the spacing of its values in [1, 2).
double unit_roundoff(dp::Dtype dtype) {
  return dtype == dp::Dtype::BFloat16 ? 0x1p-8 : dtype == dp::Dtype::Float16 ? 0x1p-11 : 0x1p-24;
}

// ---- the op against the CPU kernel ----------------------------------------------------------

/// The masks of the op cases: additive or keep; float32 or the call's dtype; (L, S)
/// broadcast, (B, 1, L, S), the whole (B, H, L, S), or an (S, L) buffer read transposed
/// (sl = 1, ss = L); the last with row 2 wholly masked.
enum class Mask { None, AddF32, AddOwn, KeepF32, KeepOwnStrided, KeepRowMasked };

struct Case {
  i64 B, H, L, S, E, Ev;
  bool causal;
  Mask mask;
  float p;  // dropout
  std::optional<float> scale;

  float softmax_scale() const { return scale ? *scale : 1.0f / std::sqrt(static_cast<float>(E)); }
  std::string name() const {
    return dp::detail::str_cat("B", B, " H", H, " L", L, " S", S, " E", E, " Ev", Ev, causal ? " causal" : "",
                               " mask ", static_cast<int>(mask), " p ", p);
  }
};

std::vector<Case> op_cases() {
  return {
      {1, 2, 1, 1, 32, 32, false, Mask::None, 0.0f, std::nullopt},                 // T = 1
      {2, 2, 63, 63, 64, 64, true, Mask::None, 0.0f, std::nullopt},                // a tile less one
      {2, 1, 129, 129, 128, 128, false, Mask::KeepF32, 0.0f, std::nullopt},        // 4 tiles + 1
      {1, 2, 300, 300, 32, 32, true, Mask::None, 0.2f, std::nullopt},              // dropout
      {1, 1, 300, 300, 128, 128, false, Mask::AddOwn, 0.0f, 0.05f},                // -inf in the mask
      {2, 3, 70, 45, 5, 7, false, Mask::AddF32, 0.0f, std::nullopt},               // odd head dims
      {1, 2, 50, 130, 6, 3, true, Mask::None, 0.0f, std::nullopt},                 // fewer queries
      {1, 2, 130, 50, 64, 32, true, Mask::None, 0.3f, std::nullopt},               // more queries
      {2, 2, 67, 90, 100, 70, false, Mask::KeepOwnStrided, 0.1f, std::nullopt},   // kD = 128, E != Ev
      {1, 1, 129, 63, 128, 1, true, Mask::KeepOwnStrided, 0.0f, std::nullopt},    // causal and a mask
      {1, 1, 5, 4, 2, 2, false, Mask::KeepRowMasked, 0.0f, std::nullopt},          // a row attending none
      // bfloat16 without a mask or dropout takes the tensor cores (Note [Attention on
      // tensor cores]), as do the unmasked cases above with head dims up to 64:
      {1, 3, 257, 257, 64, 64, true, Mask::None, 0.0f, std::nullopt},  // a GPT's: 5 tiles of 64
      {2, 2, 100, 70, 40, 24, false, Mask::None, 0.0f, 0.3f},          // padded head dims, a scale
      {1, 2, 130, 50, 64, 32, true, Mask::None, 0.0f, std::nullopt},  // causal with more queries than keys
  };
}

/// A case's inputs on cpu:0, in one dtype: q, k, v, gout, and its mask.
struct OpInputs {
  Tensor q, k, v, gout, mask;
};

Tensor randn(const Shape& shape, dp::Generator& gen, dp::Dtype dtype) {
  return dp::randn(shape, gen, dp::cpu(0)).to(dtype);
}

Tensor mask_tensor(const Case& c, dp::Dtype dtype, dp::Generator& gen) {
  const dp::Device cpu = dp::cpu(0);
  switch (c.mask) {
    case Mask::None:
      return Tensor();
    case Mask::AddF32:
      return dp::mul(dp::rand({c.L, c.S}, gen, cpu), -3.0);
    case Mask::AddOwn: {
      std::vector<float> m = dp::mul(dp::rand({c.B, 1, c.L, c.S}, gen, cpu), -3.0).to_vector();
      for (std::size_t i = 0; i < m.size(); ++i) {
        if (i % 7 == 3) m[i] = -INFINITY;
        if (i % static_cast<std::size_t>(c.S) == 0) m[i] = 0.0f;  // key 0 stays attended
      }
      return dp::from_vector(m, {c.B, 1, c.L, c.S}, cpu).to(dtype);
    }
    case Mask::KeepF32: {
      std::vector<float> m = dp::rand({c.B, c.H, c.L, c.S}, gen, cpu).to_vector();
      for (std::size_t i = 0; i < m.size(); ++i) m[i] = m[i] > 0.4f ? 1.0f : 0.0f;
      for (i64 r = 0; r < c.B * c.H * c.L; ++r) m[static_cast<std::size_t>(r * c.S + r % c.S)] = 1.0f;
      return dp::from_vector(m, {c.B, c.H, c.L, c.S}, cpu);
    }
    case Mask::KeepOwnStrided:
    case Mask::KeepRowMasked: {
      std::vector<float> m = dp::rand({c.S, c.L}, gen, cpu).to_vector();  // (S, L): key j, query i at j·L + i
      const auto L = static_cast<std::size_t>(c.L);
      for (std::size_t at = 0; at < m.size(); ++at) m[at] = m[at] > 0.3f || at < L ? 1.0f : 0.0f;  // key 0 kept
      if (c.mask == Mask::KeepRowMasked)
        for (i64 j = 0; j < c.S; ++j) m[static_cast<std::size_t>(j * c.L + 2)] = 0.0f;
      return dp::from_vector(m, {c.S, c.L}, cpu).to(dtype);
    }
  }
  return Tensor();
}

OpInputs op_inputs(const Case& c, dp::Dtype dtype, std::uint64_t seed) {
  dp::Generator gen(seed);
  OpInputs in;
  in.q = randn({c.B, c.H, c.L, c.E}, gen, dtype);
  in.k = randn({c.B, c.H, c.S, c.E}, gen, dtype);
  in.v = randn({c.B, c.H, c.S, c.Ev}, gen, dtype);
  in.gout = randn({c.B, c.H, c.L, c.Ev}, gen, dtype);
  in.mask = mask_tensor(c, dtype, gen);
  return in;
}

/// The op's view of a case's mask tensor `m` (on the call's device).
be::AttentionMask mask_args(const Case& c, const Tensor& m) {
  if (!m.defined()) return {};
  const bool keep = c.mask == Mask::KeepF32 || c.mask == Mask::KeepOwnStrided || c.mask == Mask::KeepRowMasked;
  i64 sb = 0, sh = 0, sl = c.S, ss = 1;
  if (c.mask == Mask::AddOwn) sb = c.L * c.S;
  if (c.mask == Mask::KeepF32) {
    sb = c.H * c.L * c.S;
    sh = c.L * c.S;
  }
  if (c.mask == Mask::KeepOwnStrided || c.mask == Mask::KeepRowMasked) {
    sl = 1;
    ss = c.L;
  }
  return {.p = m.raw_data(), .sb = sb, .sh = sh, .sl = sl, .ss = ss, .keep = keep,
          .dtype = static_cast<DType>(m.dtype())};
}

be::AttentionShape shape_of(const Case& c) {
  return {.B = c.B, .H = c.H, .L = c.L, .S = c.S, .E = c.E, .Ev = c.Ev};
}

be::AttentionDropout dropout_of(const Case& c) {
  be::AttentionDropout d;
  if (c.p > 0.0f) d = {.p = c.p, .seed = 77, .offset = 12345};
  return d;
}

/// What a device's kernels give for a case: the forward's out and lse, and the
/// backward's gradients from `saved_out` and `saved_lse` (cpu:0's, so that both devices'
/// backwards read the same inputs).
struct OpOutputs {
  Tensor out, lse, gq, gk, gv;
};

OpOutputs run_op(dp::Device dev, const Case& c, const OpInputs& in, const Tensor& saved_out,
                 const Tensor& saved_lse) {
  const DType dt = static_cast<DType>(in.q.dtype());
  const dp::TensorOptions like{in.q.dtype(), dev};
  const Tensor q = in.q.to(dev), k = in.k.to(dev), v = in.v.to(dev), gout = in.gout.to(dev);
  const Tensor mask = in.mask.defined() ? in.mask.to(dev) : Tensor();
  const be::AttentionMask m = mask_args(c, mask);
  OpOutputs r;
  r.out = dp::empty({c.B, c.H, c.L, c.Ev}, like);
  r.lse = dp::empty({c.B * c.H * c.L}, dev);
  be::Backend& b = be::get(dev);
  b.run<be::Op::AttentionForward>(dev, dt, {shape_of(c), q.raw_data(), k.raw_data(), v.raw_data(), m, c.causal,
                                            c.softmax_scale(), dropout_of(c), r.out.raw_data(), r.lse.data<float>()});
  if (!saved_out.defined()) return r;  // the forward only
  const Tensor out = saved_out.to(dev), lse = saved_lse.to(dev);
  r.gq = dp::empty(q.shape(), like);
  r.gk = dp::empty(k.shape(), like);
  r.gv = dp::empty(v.shape(), like);
  b.run<be::Op::AttentionBackward>(dev, dt, {shape_of(c), q.raw_data(), k.raw_data(), v.raw_data(), m, c.causal,
                                             c.softmax_scale(), dropout_of(c), out.raw_data(), lse.data<float>(),
                                             gout.raw_data(), r.gq.raw_data(), r.gk.raw_data(), r.gv.raw_data()});
  return r;
}

/// The forward and backward of a case on cpu:0 (the oracle) and on the GPU.
struct Pair {
  OpOutputs cpu, cuda;
};
Pair run_both(const Case& c, const OpInputs& in) {
  const OpOutputs fwd = run_op(dp::cpu(0), c, in, Tensor(), Tensor());
  return {run_op(dp::cpu(0), c, in, fwd.out, fwd.lse), run_op(gpu(), c, in, fwd.out, fwd.lse)};
}

// Note [CUDA attention tolerances]
// On the same inputs the CUDA kernel computes the CPU kernel's float32 operations in
// other orders (warp trees, tiles of 32 where the CPU's are 64, FMAs, expf and logf
// within 2 ulp of the CPU's exponential and logf). Each result is a sum over at most
// n = L + S + E + Ev products and partial sums of O(1) terms, so the two differ by at
// most about n·2^-24 of the values' scale (the worst case; rounding errors that add up
// like a random walk give √n·2^-24, what the CPU kernel measured against the math path).
// A 16-bit result is then rounded once on each side: two float32 values that close
// round to the same 16-bit value or to neighbours one unit in the last place apart, 2u
// of the scale at most (u: the unit roundoff). lse stays float32 in every dtype. The
// tensor-core kernels (bfloat16, Note [Attention on tensor cores]) add an error of
// 2^-17 of each term where P or dS is split into two bfloat16 operands, far below the
// 2u = 2^-7 a bfloat16 result is allowed. A wrong mask, tile, keep bit or gradient term
// is off by ~1 of the scale, far outside.
double f32_tol(const Case& c) { return static_cast<double>(c.L + c.S + c.E + c.Ev) * 0x1p-24; }
double tol(const Case& c, dp::Dtype dtype) {
  return f32_tol(c) + (dtype == dp::Dtype::Float32 ? 0.0 : 2 * unit_roundoff(dtype));
}

std::vector<float> values(const Tensor& t) { return t.to(dp::Dtype::Float32).to_vector(); }

}  // namespace

TEST_CASE("the CUDA fused attention equals the CPU fused kernel: out, lse and every gradient, in each dtype") {
  std::uint64_t seed = 1;
  for (const Case& c : op_cases()) {
    for (dp::Dtype dtype : {dp::Dtype::Float32, dp::Dtype::BFloat16, dp::Dtype::Float16}) {
      const std::string name = c.name() + " " + dp::dtype_name(dtype);
      CAPTURE(name);
      const OpInputs in = op_inputs(c, dtype, seed++);
      const Pair r = run_both(c, in);
      const double t = tol(c, dtype);
      auto err = [](const Tensor& a, const Tensor& b) { return error(values(a), values(b)); };
      const double e_out = err(r.cuda.out, r.cpu.out), e_lse = err(r.cuda.lse, r.cpu.lse),
                   e_gq = err(r.cuda.gq, r.cpu.gq), e_gk = err(r.cuda.gk, r.cpu.gk), e_gv = err(r.cuda.gv, r.cpu.gv);
      MESSAGE(name, ": out ", e_out, ", lse ", e_lse, ", gq ", e_gq, ", gk ", e_gk, ", gv ", e_gv, " (tolerance ", t,
              ")");
      CHECK(e_out <= t);
      CHECK(e_lse <= f32_tol(c));
      CHECK(e_gq <= t);
      CHECK(e_gk <= t);
      CHECK(e_gv <= t);
    }
  }
}

namespace {

/// t with row `row` of its (B·H·rows, width) view set to `value` (B = H = 1 here).
Tensor with_row(const Tensor& t, i64 row, float value) {
  std::vector<float> v = values(t);
  const i64 width = t.shape()[3];
  for (i64 c = 0; c < width; ++c) v[static_cast<std::size_t>(row * width + c)] = value;
  return dp::from_vector(v, t.shape(), t.device()).to(t.dtype());
}

bool all_nan(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isnan(x); });
}
bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

}  // namespace

TEST_CASE("the CUDA fused attention: a row whose every key is masked gives zeros, lse = +inf and no gradient, as on the CPU") {
  // Note [Rows with every key masked] (PyTorch 2.5+'s zeros; NaN before).
  const Case c{1, 1, 5, 4, 2, 2, false, Mask::KeepRowMasked, 0.0f, std::nullopt};
  const OpInputs in = op_inputs(c, dp::Dtype::Float32, 99);
  const OpOutputs fwd = run_op(gpu(), c, in, Tensor(), Tensor());
  const OpOutputs r = run_op(gpu(), c, in, fwd.out, fwd.lse);  // the forward again, then the backward
  const std::vector<float> out = values(r.out), lse = values(r.lse), gq = values(r.gq);
  CHECK(out[4] == 0.0f);  // row 2, Ev = 2
  CHECK(out[5] == 0.0f);
  CHECK(std::isinf(lse[2]));
  CHECK(lse[2] > 0);
  CHECK(gq[4] == 0.0f);  // row 2, E = 2
  CHECK(gq[5] == 0.0f);
  CHECK(std::isfinite(out[0]));
  CHECK(std::isfinite(lse[3]));
  CHECK(all_finite(gq));
  CHECK(all_finite(values(r.gk)));
  CHECK(all_finite(values(r.gv)));
}

TEST_CASE("the CUDA fused attention: a NaN key reaches every row that attends it, as on the CPU") {
  // Key 5 lies in the first key tile: before the row's maximum kept NaN, a NaN score in
  // the first tile a row attends was dropped and the row's softmax ran over the other
  // keys, finite and wrong.
  const Case c{1, 1, 4, 64, 8, 8, false, Mask::None, 0.0f, std::nullopt};
  for (dp::Dtype dtype : {dp::Dtype::Float32, dp::Dtype::BFloat16}) {  // CUDA cores, tensor cores
    CAPTURE(std::string(dp::dtype_name(dtype)));
    OpInputs in = op_inputs(c, dtype, 123);
    in.k = with_row(in.k, 5, NAN);
    const OpOutputs cpu = run_op(dp::cpu(0), c, in, Tensor(), Tensor());
    const OpOutputs cuda = run_op(gpu(), c, in, Tensor(), Tensor());
    REQUIRE(all_nan(values(cpu.out)));  // the CPU kernel, the oracle
    REQUIRE(all_nan(values(cpu.lse)));
    CHECK(all_nan(values(cuda.out)));
    CHECK(all_nan(values(cuda.lse)));
  }
}

TEST_CASE("the CUDA fused attention: causal, keys past every query's window never reach a result") {
  // L = 33 < S = 64: the block of query 32 attends keys 0..32, and the tile it reads
  // holds keys 32..63. Keys 33.. are infinite here; a weight of 0 times one of them was a
  // NaN in out (the forward) and in dQ (the backward) before those rows were zeros.
  const Case c{1, 1, 33, 64, 8, 8, true, Mask::None, 0.0f, std::nullopt};
  for (dp::Dtype dtype : {dp::Dtype::Float32, dp::Dtype::BFloat16}) {
    CAPTURE(std::string(dp::dtype_name(dtype)));
    OpInputs in = op_inputs(c, dtype, 321);
    for (i64 j = 33; j < 36; ++j) {
      in.k = with_row(in.k, j, INFINITY);
      in.v = with_row(in.v, j, INFINITY);
    }
    const Pair r = run_both(c, in);
    REQUIRE(all_finite(values(r.cpu.out)));
    REQUIRE(all_finite(values(r.cpu.gq)));
    CHECK(all_finite(values(r.cuda.out)));
    CHECK(all_finite(values(r.cuda.lse)));
    CHECK(all_finite(values(r.cuda.gq)));
    const double t = tol(c, dtype);
    CHECK(error(values(r.cuda.out), values(r.cpu.out)) <= t);
    CHECK(error(values(r.cuda.gq), values(r.cpu.gq)) <= t);
    CHECK(error(values(r.cuda.gk), values(r.cpu.gk)) <= t);
    CHECK(error(values(r.cuda.gv), values(r.cpu.gv)) <= t);
  }
}

TEST_CASE("the CUDA fused attention is reproducible: the same bits on every run, gradients included") {
  // float32 with dropout on the CUDA cores; bfloat16 without on the tensor cores.
  for (const auto& [c, dtype] : {std::pair{Case{2, 2, 130, 129, 64, 64, true, Mask::None, 0.25f, std::nullopt},
                                           dp::Dtype::Float32},
                                 std::pair{Case{2, 2, 130, 129, 64, 64, true, Mask::None, 0.0f, std::nullopt},
                                           dp::Dtype::BFloat16}}) {
    CAPTURE(std::string(dp::dtype_name(dtype)));
    const OpInputs in = op_inputs(c, dtype, 5);
    const OpOutputs fwd = run_op(gpu(), c, in, Tensor(), Tensor());
    const OpOutputs a = run_op(gpu(), c, in, fwd.out, fwd.lse), b = run_op(gpu(), c, in, fwd.out, fwd.lse);
    CHECK(bitwise_equal(values(a.out), values(b.out)));
    CHECK(bitwise_equal(values(a.lse), values(b.lse)));
    CHECK(bitwise_equal(values(a.gq), values(b.gq)));
    CHECK(bitwise_equal(values(a.gk), values(b.gk)));
    CHECK(bitwise_equal(values(a.gv), values(b.gv)));
  }
}

// ---- scaled_dot_product_attention on the GPU -------------------------------------------------

namespace {

/// q, k, v, the upstream gradient and an optional mask on cpu:0, float32.
struct Inputs {
  Tensor q, k, v, up, mask;
  bool keep = false;
  bool causal = false;
};

Inputs make_inputs(i64 B, i64 H, i64 L, i64 S, i64 E, i64 Ev, bool causal, std::uint64_t seed) {
  dp::Generator gen(seed);
  const dp::Device cpu = dp::cpu(0);
  Inputs in;
  in.q = dp::randn({B, H, L, E}, gen, cpu);
  in.k = dp::randn({B, H, S, E}, gen, cpu);
  in.v = dp::randn({B, H, S, Ev}, gen, cpu);
  in.up = dp::randn({B, H, L, Ev}, gen, cpu);
  in.causal = causal;
  return in;
}

struct Result {
  std::vector<float> out, gq, gk, gv;
};

/// The output and the gradients of q, k, v for the loss sum(out * up) on `dev` in
/// `dtype` (a float32 keep-mask stays float32, an additive one takes the dtype), by
/// `path`, dropout_p drawn from a generator seeded `seed`; every result widened.
Result attend(AttentionPath path, dp::Device dev, const Inputs& in, dp::Dtype dtype, double dropout_p = 0.0,
              std::uint64_t seed = 0) {
  Setting setting(path);
  auto leaf = [&](const Tensor& t) { return t.to(dtype).to(dev).clone().detach().set_requires_grad(true); };
  Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  Tensor mask;
  if (in.mask.defined()) mask = (in.keep ? in.mask : in.mask.to(dtype)).to(dev);
  dp::Generator gen(seed);
  Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, mask, dropout_p, in.causal, std::nullopt, in.keep, &gen);
  REQUIRE(y.dtype() == dtype);
  REQUIRE(y.device() == dev);
  dp::sum(dp::mul(y, in.up.to(dtype).to(dev))).backward();
  return {values(y), values(q.grad()), values(k.grad()), values(v.grad())};
}

double inputs_tol(const Inputs& in) {
  return static_cast<double>(in.q.size(-2) + in.k.size(-2) + in.q.size(-1) + in.v.size(-1)) * 0x1p-24;
}

}  // namespace

TEST_CASE("scaled_dot_product_attention on the GPU: the fused kernel equals the math path, float32") {
  // Note [CUDA attention tolerances]: the math path's cuBLAS GEMMs and softmax sum in
  // yet other orders, by the same bound.
  for (const Inputs& in : {make_inputs(2, 3, 129, 129, 32, 32, true, 1), make_inputs(2, 2, 70, 45, 5, 7, false, 2),
                           make_inputs(1, 2, 300, 300, 128, 128, true, 3),
                           make_inputs(3, 1, 1, 63, 64, 64, false, 4)}) {
    const Result math = attend(AttentionPath::Math, gpu(), in, dp::Dtype::Float32);
    const Result fused = attend(AttentionPath::Fused, gpu(), in, dp::Dtype::Float32);
    const double t = inputs_tol(in);
    MESSAGE("fused vs math on the GPU: out ", error(fused.out, math.out), ", gq ", error(fused.gq, math.gq), ", gk ",
            error(fused.gk, math.gk), ", gv ", error(fused.gv, math.gv), " (tolerance ", t, ")");
    CHECK(error(fused.out, math.out) <= t);
    CHECK(error(fused.gq, math.gq) <= t);
    CHECK(error(fused.gk, math.gk) <= t);
    CHECK(error(fused.gv, math.gv) <= t);
    // Auto takes the fused kernel (it fits): the same bits.
    const Result chosen = attend(AttentionPath::Auto, gpu(), in, dp::Dtype::Float32);
    CHECK(bitwise_equal(chosen.out, fused.out));
    CHECK(bitwise_equal(chosen.gq, fused.gq));
  }
}

TEST_CASE("scaled_dot_product_attention on the GPU in bfloat16 and float16: near the math path and the CPU") {
  // The math path in 16 bits stores its scores, weights and dP in 16 bits: the bounds
  // of Note [16-bit attention tolerances] (tests/nn/attention_fused_test.cpp), 16u for
  // out and gv and 32u for gq and gk, hold between it and the fused kernel. Against the
  // CPU fused kernel: one rounding apart (Note [CUDA attention tolerances]).
  Inputs masked = make_inputs(2, 2, 67, 90, 64, 64, false, 6);
  dp::Generator mask_gen(7);
  masked.mask = dp::mul(dp::rand({67, 90}, mask_gen, dp::cpu(0)), -3.0);
  for (const Inputs& in : {make_inputs(2, 3, 130, 130, 32, 32, true, 5), masked}) {
    for (dp::Dtype dtype : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
      const std::string name = dp::dtype_name(dtype);
      CAPTURE(name);
      const double u = unit_roundoff(dtype);
      const Result math = attend(AttentionPath::Math, gpu(), in, dtype);
      const Result fused = attend(AttentionPath::Fused, gpu(), in, dtype);
      const Result cpu = attend(AttentionPath::Fused, dp::cpu(0), in, dtype);
      CHECK(error(fused.out, math.out) < 16 * u);
      CHECK(error(fused.gq, math.gq) < 32 * u);
      CHECK(error(fused.gk, math.gk) < 32 * u);
      CHECK(error(fused.gv, math.gv) < 16 * u);
      const double t = inputs_tol(in) + 2 * u;
      CHECK(error(fused.out, cpu.out) <= t);
      CHECK(error(fused.gq, cpu.gq) <= t);
      CHECK(error(fused.gk, cpu.gk) <= t);
      CHECK(error(fused.gv, cpu.gv) <= t);
    }
  }
}

TEST_CASE("the CUDA fused attention with dropout: the dropout op's keep bits, the CPU's, the math path's values") {
  const double p = 0.3;
  SUBCASE("each weight kept with probability 1 - p: the bits the dropout op draws on the GPU and the CPU") {
    // q = 0 gives every key the weight 1/S, and v = I (Ev = S) copies the weights out:
    // out[i, j] = Z_ij / S with Z_ij = keep_ij / (1 - p).
    const i64 B = 2, H = 2, L = 100, S = 70;
    dp::Generator key_gen(3);
    const Tensor q = dp::zeros({B, H, L, 4}, gpu()), k = dp::randn({B, H, S, 4}, key_gen, gpu());
    std::vector<float> eye(static_cast<std::size_t>(S * S), 0.0f);
    for (i64 j = 0; j < S; ++j) eye[static_cast<std::size_t>(j * S + j)] = 1.0f;
    const Tensor v = dp::add(dp::zeros({B, H, S, S}, gpu()), dp::from_vector(eye, {S, S}, gpu()));
    Setting setting(AttentionPath::Fused);
    dp::Generator gen(41);
    gen.advance(12345);  // a generator in the middle of its stream
    dp::Generator same = gen, on_cpu = gen;
    const std::vector<float> out =
        dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), p, false, std::nullopt, false, &gen).to_vector();
    const std::vector<float> drop = dp::nn::dropout(dp::ones({B, H, L, S}, gpu()), p, true, same).to_vector();
    const std::vector<float> cpu_out =
        dp::nn::scaled_dot_product_attention(q.to(dp::cpu(0)), k.to(dp::cpu(0)), v.to(dp::cpu(0)), Tensor(), p, false,
                                             std::nullopt, false, &on_cpu)
            .to_vector();
    CHECK(gen.offset() == same.offset());  // advanced by B·H·L·S, as the dropout op
    CHECK(gen.offset() == on_cpu.offset());
    std::size_t kept = 0, wrong = 0, unlike_cpu = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const bool keep = out[i] != 0.0f;
      kept += keep;
      wrong += keep != (drop[i] != 0.0f);
      unlike_cpu += keep != (cpu_out[i] != 0.0f);
      if (keep) CHECK(std::fabs(out[i] * S * (1 - p) - 1.0) < 1e-5);
    }
    CHECK(wrong == 0);
    CHECK(unlike_cpu == 0);
    // Binomial(n, 1 - p): the kept fraction within 5 standard deviations of 1 - p.
    const double n = static_cast<double>(out.size()), rate = static_cast<double>(kept) / n;
    CHECK(std::fabs(rate - (1 - p)) < 5 * std::sqrt(p * (1 - p) / n));
  }
  SUBCASE("the math path and the CPU given the same generator drop the same weights: values and gradients agree") {
    for (const Inputs& in :
         {make_inputs(2, 3, 130, 130, 64, 64, true, 31), make_inputs(2, 2, 70, 45, 5, 7, false, 32)}) {
      for (dp::Dtype dtype : {dp::Dtype::Float32, dp::Dtype::BFloat16}) {
        const std::string name = dp::dtype_name(dtype);
        CAPTURE(name);
        const Result math = attend(AttentionPath::Math, gpu(), in, dtype, p, 99);
        const Result fused = attend(AttentionPath::Fused, gpu(), in, dtype, p, 99);
        const Result cpu = attend(AttentionPath::Fused, dp::cpu(0), in, dtype, p, 99);
        const Result plain = attend(AttentionPath::Fused, gpu(), in, dtype, 0.0, 99);
        // float32: reassociation only; bfloat16: the math path's roundings as above.
        const double u = unit_roundoff(dtype);
        const double to_math = dtype == dp::Dtype::Float32 ? inputs_tol(in) : 32 * u;
        const double to_cpu = inputs_tol(in) + (dtype == dp::Dtype::Float32 ? 0.0 : 2 * u);
        CHECK(error(fused.out, math.out) < to_math);
        CHECK(error(fused.gq, math.gq) < to_math);
        CHECK(error(fused.gk, math.gk) < to_math);
        CHECK(error(fused.gv, math.gv) < to_math);
        CHECK(error(fused.out, cpu.out) <= to_cpu);
        CHECK(error(fused.gq, cpu.gq) <= to_cpu);
        CHECK(error(fused.gk, cpu.gk) <= to_cpu);
        CHECK(error(fused.gv, cpu.gv) <= to_cpu);
        CHECK(error(fused.out, plain.out) > 0.05);  // dropout did drop
      }
    }
  }
}

TEST_CASE("the CUDA fused attention holds O(T) memory: T = 2048 stays far below the (B, H, T, T) weights") {
  const dp::Device dev = gpu();
  const i64 B = 1, H = 2, T = 2048, E = 8;
  const Inputs in = make_inputs(B, H, T, T, E, E, true, 12);
  const double weights_bytes = static_cast<double>(B * H * T * T) * sizeof(float);  // 32 MiB
  auto peak_bytes = [&](AttentionPath path) {
    Setting setting(path);
    Tensor q = in.q.to(dev).detach().set_requires_grad(true), k = in.k.to(dev).detach().set_requires_grad(true),
           v = in.v.to(dev).detach().set_requires_grad(true);
    const Tensor up = in.up.to(dev);
    const std::size_t before = dp::memory_allocated(dev);
    dp::reset_peak_memory(dev);
    Tensor y = dp::nn::scaled_dot_product_attention(q, k, v, Tensor(), 0.0, true);
    dp::sum(dp::mul(y, up)).backward();
    return static_cast<double>(dp::max_memory_allocated(dev) - before);
  };
  const double math = peak_bytes(AttentionPath::Math);
  const double fused = peak_bytes(AttentionPath::Fused);
  MESSAGE("peak bytes above the inputs: math path ", math, ", fused ", fused, ", (B, H, T, T) weights ", weights_bytes);
  CHECK(math >= weights_bytes);  // the measure sees the math path's weights
  // The fused path's own: out, lse, Δ, the upstream gradient and gq, gk, gv, all O(T).
  CHECK(fused < weights_bytes / 8);
}

TEST_CASE("the CUDA fused attention refuses head dims above 128: the math path runs, Fused says why") {
  for (const std::vector<i64>& dims : {std::vector<i64>{256, 256}, std::vector<i64>{64, 200}}) {
    const i64 E = dims[0], Ev = dims[1];
    CAPTURE(E);
    CAPTURE(Ev);
    const Inputs in = make_inputs(1, 2, 40, 33, E, Ev, true, 13);
    const Result math = attend(AttentionPath::Math, gpu(), in, dp::Dtype::Float32);
    const Result chosen = attend(AttentionPath::Auto, gpu(), in, dp::Dtype::Float32);
    CHECK(bitwise_equal(chosen.out, math.out));  // Auto fell back to the math path
    CHECK(bitwise_equal(chosen.gq, math.gq));
    CHECK(dp_test::throws_with([&] { (void)attend(AttentionPath::Fused, gpu(), in, dp::Dtype::Float32); },
                               {"set_attention_path", "exceed the CUDA kernel's 128"}));
  }
  // The op itself refuses clearly, and checks its arguments as every backend does.
  const Case wide{1, 1, 8, 8, 256, 8, false, Mask::None, 0.0f, std::nullopt};
  const OpInputs in = op_inputs(wide, dp::Dtype::Float32, 14);
  CHECK(dp_test::throws_with([&] { (void)run_op(gpu(), wide, in, Tensor(), Tensor()); },
                             {"attention_forward", "head dims E = 256", "math path"}));
  const Case half_mask{1, 1, 8, 8, 16, 16, false, Mask::AddOwn, 0.0f, std::nullopt};
  OpInputs bf = op_inputs(half_mask, dp::Dtype::BFloat16, 15);
  bf.mask = bf.mask.to(dp::Dtype::Float16);
  CHECK(dp_test::throws_with([&] { (void)run_op(gpu(), half_mask, bf, Tensor(), Tensor()); },
                             {"attention_forward", "expected a float32 or bfloat16 mask, got a float16 one"}));
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_attention_test", argc, argv); }
