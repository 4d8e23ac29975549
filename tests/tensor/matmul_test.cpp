// tests/tensor/matmul_test.cpp — dp::matmul with torch.matmul's rules: vectors, batch
// dims, broadcasting, a batch times one matrix; values against a double-precision loop,
// gradients against central differences, bad shapes.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../autograd/gradcheck.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"
#include "test_errors.h"

namespace {

using dp::Shape;
using dp::Tensor;

Tensor values(const Shape& shape, unsigned seed) {
  return dp::from_vector(dp_test::uniform_values(dp::shape_numel(shape), -1.0f, 1.0f, seed), shape);
}

// The product by its definition, in double: a (A..., m, k), b (B..., k, n) already
// broadcast to the same batch (batch = product of the leading dims of `out_batch`), with
// a_stride/b_stride 0 for an operand that repeats over the batch.
std::vector<double> reference(const std::vector<float>& a, const std::vector<float>& b, std::int64_t batch,
                              std::int64_t m, std::int64_t k, std::int64_t n, bool a_repeats, bool b_repeats) {
  std::vector<double> out(static_cast<std::size_t>(batch * m * n), 0.0);
  for (std::int64_t z = 0; z < batch; ++z)
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::int64_t p = 0; p < k; ++p)
          s += double(a[static_cast<std::size_t>((a_repeats ? 0 : z) * m * k + i * k + p)]) *
               double(b[static_cast<std::size_t>((b_repeats ? 0 : z) * k * n + p * n + j)]);
        out[static_cast<std::size_t>((z * m + i) * n + j)] = s;
      }
  return out;
}

double max_err(const Tensor& got, const std::vector<double>& want) {
  const std::vector<float> g = got.to_vector();
  if (g.size() != want.size()) return INFINITY;
  double e = 0;
  for (std::size_t i = 0; i < g.size(); ++i) e = std::max(e, std::fabs(double(g[i]) - want[i]));
  return e;
}

}  // namespace

TEST_CASE("matmul: batched, broadcast and vector operands against the definition") {
  SUBCASE("(B, H, T, D) x (B, H, D, T): attention's scores") {
    Tensor q = values({2, 3, 5, 4}, 1), kt = values({2, 3, 4, 5}, 2);
    Tensor s = dp::matmul(q, kt);
    CHECK(s.shape() == Shape{2, 3, 5, 5});
    CHECK(max_err(s, reference(q.to_vector(), kt.to_vector(), 6, 5, 4, 5, false, false)) < 1e-5);
  }
  SUBCASE("a batch times one matrix is the same as one GEMM over all rows") {
    Tensor x = values({2, 3, 4}, 3), w = values({4, 6}, 4);
    Tensor y = dp::matmul(x, w);
    CHECK(y.shape() == Shape{2, 3, 6});
    CHECK(max_err(y, reference(x.to_vector(), w.to_vector(), 6, 1, 4, 6, false, true)) < 1e-5);
    CHECK(y.to_vector() == dp::matmul(x.reshape({6, 4}), w).to_vector());
  }
  SUBCASE("one matrix times a batch; batch dims broadcast") {
    Tensor a = values({3, 4}, 5), b = values({2, 4, 5}, 6);
    CHECK(max_err(dp::matmul(a, b), reference(a.to_vector(), b.to_vector(), 2, 3, 4, 5, true, false)) < 1e-5);
    Tensor c = values({1, 3, 4}, 7), d = values({2, 1, 4, 2}, 8);
    Tensor cd = dp::matmul(c, d);
    CHECK(cd.shape() == Shape{2, 1, 3, 2});
    CHECK(max_err(cd, reference(c.to_vector(), d.to_vector(), 2, 3, 4, 2, true, false)) < 1e-5);
  }
  SUBCASE("vectors: dot, row times matrix, matrix times column, batched") {
    Tensor v = values({4}, 9), w = values({4}, 10), m = values({4, 3}, 11), bm = values({2, 4, 3}, 12);
    Tensor dot = dp::matmul(v, w);
    CHECK(dot.dim() == 0);
    double want = 0;
    for (std::size_t i = 0; i < 4; ++i) want += double(v.to_vector()[i]) * w.to_vector()[i];
    CHECK(std::fabs(dot.item() - want) < 1e-6);
    CHECK(dp::matmul(v, m).shape() == Shape{3});
    CHECK(max_err(dp::matmul(v, m), reference(v.to_vector(), m.to_vector(), 1, 1, 4, 3, false, false)) < 1e-6);
    CHECK(dp::matmul(m.t(), v).shape() == Shape{3});
    CHECK(dp::matmul(v, bm).shape() == Shape{2, 3});
    CHECK(dp::matmul(bm.transpose(1, 2), v).shape() == Shape{2, 3});
  }
  SUBCASE("empty dims") {
    CHECK(dp::matmul(dp::zeros({2, 0, 3}), dp::zeros({2, 3, 4})).shape() == Shape{2, 0, 4});
    Tensor z = dp::matmul(dp::ones({2, 3, 0}), dp::ones({2, 0, 4}));
    CHECK(z.shape() == Shape{2, 3, 4});
    CHECK(dp::sum(dp::abs(z)).item() == 0.0f);
  }
}

TEST_CASE("matmul gradients match central differences, broadcast operands summed back") {
  using dp_test::gradcheck_mismatches;
  auto mm = [](const auto& in) { return dp::matmul(in[0], in[1]); };
  CHECK(gradcheck_mismatches(mm, {values({2, 3, 4}, 20), values({2, 4, 2}, 21)}).empty());
  CHECK(gradcheck_mismatches(mm, {values({2, 1, 3, 4}, 22), values({1, 2, 4, 2}, 23)}).empty());
  CHECK(gradcheck_mismatches(mm, {values({3, 2, 4}, 24), values({4, 5}, 25)}).empty());
  CHECK(gradcheck_mismatches(mm, {values({3, 4}, 26), values({2, 4, 5}, 27)}).empty());
  CHECK(gradcheck_mismatches(mm, {values({4}, 28), values({2, 4, 3}, 29)}).empty());
  CHECK(gradcheck_mismatches(mm, {values({4}, 30), values({4}, 31)}).empty());
}

TEST_CASE("matmul: bad shapes name both operands") {
  CHECK(dp_test::throws_with([] { (void)dp::matmul(dp::zeros({2, 3, 4}), dp::zeros({2, 5, 2})); }, {"same k", "[2, 3, 4] x [2, 5, 2]"}));
  CHECK(dp_test::throws_with([] { (void)dp::matmul(dp::zeros({3, 2, 4}), dp::zeros({2, 4, 2})); }, {"batch dims", "do not broadcast"}));
  CHECK(dp_test::throws_with([] { (void)dp::matmul(dp::zeros({}), dp::zeros({2})); }, {"at least 1 dim"}));
  CHECK(dp_test::throws_with([] { (void)dp::matmul(dp::zeros({3}), dp::zeros({2})); }, {"(k 3 vs 2)"}));
}

TEST_CASE("bfloat16 matmul with an odd k: the products oneDNN 2.6's AMX kernel ran into SIGILL, right") {
  // Note [bf16 GEMMs with an odd k on AMX] (src/backend/cpu/cpu_gemm.cpp): on the AMX Xeon
  // these shapes killed the process; every CPU must give the definition's values, within
  // a rounding of the bfloat16 output (the inputs hold bfloat16 values exactly).
  struct Case {
    std::int64_t m, k, n;
  };
  for (const Case c : {Case{8, 63, 336}, Case{1, 63, 80}, Case{24, 63, 1008}, Case{8, 4095, 80}, Case{17, 63, 112},
                       Case{16, 63, 80}, Case{8, 65, 80}}) {
    CAPTURE(c.m);
    CAPTURE(c.k);
    CAPTURE(c.n);
    const Tensor a = values({c.m, c.k}, 31).to(dp::Dtype::BFloat16), b = values({c.k, c.n}, 32).to(dp::Dtype::BFloat16);
    const std::vector<double> want = reference(a.to(dp::Dtype::Float32).to_vector(),
                                               b.to(dp::Dtype::Float32).to_vector(), 1, c.m, c.k, c.n, false, false);
    double scale = 0;
    for (double v : want) scale = std::max(scale, std::fabs(v));
    // One bfloat16 rounding of the result (2^-8 relative) plus float32 sums of k terms.
    const double tol = std::ldexp(scale, -8) + static_cast<double>(c.k) * std::ldexp(1.0, -20);
    CHECK(max_err(dp::matmul(a, b), want) <= tol);
    // The same product with transposed operands (a's and b's transposes made contiguous
    // first, then viewed back).
    const Tensor at = a.transpose(0, 1).contiguous().transpose(0, 1);
    const Tensor bt = b.transpose(0, 1).contiguous().transpose(0, 1);
    CHECK(max_err(dp::matmul(at, bt), want) <= tol);
  }
}
