// Tests for dp/nn/dropout.h: masks deterministic per seed, one stream per bound copy,
// 1/(1-p) scaling, identity in eval mode.
#include <doctest/doctest.h>

#include <memory>

#include "dp/nn/dropout.h"
#include "dp/nn/parameter_set.h"
#include "dp/tensor/ops.h"
#include "nn_test_util.h"

using nn_test::F;
namespace nn = dp::nn;

TEST_CASE_TEMPLATE("Dropout: deterministic per seed, scaled, identity in eval", D, DP_NN_TEST_DEVICES) {
  const dp::Device dev = D::device();
  dp::Tensor x = dp::ones({50, 40}, dev);
  auto ap = std::make_shared<nn::Dropout>(0.25, 7);  // train()/eval() need a shared_ptr
  nn::Dropout& a = *ap;
  nn::Dropout b(0.25, 7), c(0.25, 8);
  F ya = a(x).to_vector();
  CHECK(ya == b(x).to_vector());
  CHECK(ya != c(x).to_vector());
  CHECK(a(x).to_vector() != ya);  // the stream advances
  int zeros = 0;
  for (float v : ya) {
    if (v == 0) ++zeros;
    else CHECK(v == doctest::Approx(1 / 0.75));
  }
  CHECK(zeros / 2000.0 == doctest::Approx(0.25).epsilon(0.15));
  a.eval();
  CHECK(a(x).is_same(x));
  CHECK(a.name() == "Dropout(p=0.25)");
  CHECK_THROWS_AS(nn::Dropout(1.5), dp::Error);
  a.set_seed(7);
  a.train();
  nn::Dropout fresh(0.25, 7);
  CHECK(a(x).to_vector() == fresh(x).to_vector());  // set_seed restarts the streams
}

TEST_CASE("Dropout draws from a separate stream per bound copy") {
  nn::Dropout d(0.5, 11), ref(0.5, 11);
  dp::Tensor x = dp::ones({1000});
  F c0 = d(x).to_vector();
  F c1;
  {
    nn::ReplicaBinding bind(1);
    c1 = d(x).to_vector();
  }
  CHECK(c0 != c1);
  CHECK(c0 == ref(x).to_vector());  // copy 1's draw did not advance copy 0's stream
  CHECK(d.generator(1).offset() == 1000);
  CHECK_THROWS_AS(d.generator(nn::Dropout::kMaxCopies), dp::Error);
  dp::manual_seed(3);
  nn::Dropout s1(0.5);
  dp::manual_seed(3);
  nn::Dropout s2(0.5);
  nn::Dropout s3(0.5);
  CHECK(s1.seed() == s2.seed());
  CHECK(s2.seed() != s3.seed());
}

TEST_CASE("Dropout::set_streams moves the copies' streams: copy 0 of first 2 draws copy 2's masks") {
  nn::Dropout moved(0.5, 11), ref(0.5, 11);
  moved.set_streams(11, 2);
  CHECK(moved.first_stream() == 2);
  dp::Tensor x = dp::ones({1000});
  F m0 = moved(x).to_vector();
  F r2;
  {
    nn::ReplicaBinding bind(2);
    r2 = ref(x).to_vector();
  }
  CHECK(m0 == r2);
  CHECK(m0 != ref(x).to_vector());  // not copy 0's stream any more
  moved.set_seed(11);               // keeps the first stream
  CHECK(moved.first_stream() == 2);
  CHECK(moved(x).to_vector() == m0);
  CHECK_THROWS_WITH_AS(moved.set_streams(11, -1), doctest::Contains("expected a first stream >= 0, got -1"),
                       dp::Error);
}

TEST_CASE("a module tree names every generator it owns: Dropout's copies, a member, shared children once") {
  struct Noisy : nn::Module {
    Noisy() {
      register_generator("noise", noise);
      drop = register_module("drop", std::make_shared<nn::Dropout>(0.5, 3));
    }
    dp::Generator noise{42};
    std::shared_ptr<nn::Dropout> drop;
  };
  struct Net : nn::Module {
    Net() {
      auto shared = std::make_shared<Noisy>();
      a = register_module("a", shared);
      b = register_module("b", shared);  // the same module twice: listed under "a" only
      head = register_module("head", std::make_shared<nn::Dropout>(0.1, 4));
    }
    std::shared_ptr<Noisy> a, b;
    std::shared_ptr<nn::Dropout> head;
  };
  Net net;
  auto gens = net.named_generators();
  REQUIRE(gens.size() == 1 + 2 * nn::Dropout::kMaxCopies);
  CHECK(gens[0].first == "a.noise");
  CHECK(gens[0].second == &net.a->noise);
  CHECK(gens[1].first == "a.drop.generator.0");
  CHECK(gens[2].first == "a.drop.generator.1");
  CHECK(gens[2].second == &net.a->drop->generator(1));
  CHECK(gens[1 + nn::Dropout::kMaxCopies].first == "head.generator.0");
  CHECK(gens.back().first == "head.generator.63");
  CHECK(gens.back().second == &net.head->generator(nn::Dropout::kMaxCopies - 1));

  // Names follow register_buffer's rules; a generator registers once.
  nn::Module m;
  dp::Generator g1, g2;
  m.register_generator("g", g1);
  CHECK_THROWS_WITH_AS(m.register_generator("g", g2), doctest::Contains("'g' is already registered"), dp::Error);
  CHECK_THROWS_WITH_AS(m.register_generator("h", g1), doctest::Contains("already registered as 'g'"), dp::Error);
  CHECK_THROWS_WITH_AS(m.register_generator("a.b", g2), doctest::Contains("without '.'"), dp::Error);
  CHECK_THROWS_WITH_AS(m.register_generators("g", std::span<dp::Generator>(&g2, 1)),
                       doctest::Contains("'g' is already registered"), dp::Error);
}
