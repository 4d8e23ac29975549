// Evaluation across processes and one device per process, under mpirun -np 2
// (tests/dist/meson.build; as one process too, where every check is trivially local):
//  - a Conv-BatchNorm model trained a few DDP steps, then model(x) under no_grad in eval
//    mode on every process: the same bits on every process (the buffers come from world
//    rank 0 before the forward), equal to process 0's module alone on its device 0; and
//    each process evaluating its own rows gives, after an all-reduce of the counts, the
//    same accuracy everywhere;
//  - a model without buffers evaluated under no_grad by process 0 alone: no collective
//    (docs/multi-node.md, "Evaluation across processes");
//  - one device per process: DP, DDP and Sharded stages 1 and 2 combine gradients across
//    processes: the same parameters on every process, and the same in every design.
// `--eval=rank0` makes process 0 alone evaluate the BatchNorm model while the other
// returns: the job must end naming the missing rank (meson.build runs it expecting that).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "../parallel/mlp_fixture.h"
#include "dp/dp.h"

namespace dist = dp::dist;
using dp::Tensor;

namespace {

std::shared_ptr<dp::nn::Sequential> make_bn_net(std::uint64_t seed) {
  dp::Generator gen(seed);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(1, 4, 3).padding(1), &gen));
  net->push_back(std::make_shared<dp::nn::BatchNorm2d>(4));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Flatten>());
  net->push_back(std::make_shared<dp::nn::Linear>(4 * 4 * 4, 3, true, &gen));
  return net;
}

/// rows images (rows, 1, 4, 4) and labels, the same for a given seed on every process.
Batch image_batch(std::int64_t rows, std::uint64_t seed) {
  Batch b = make_batch(rows, seed, 16, 3);
  b.x = b.x.reshape({rows, 1, 4, 4});
  return b;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool same_as_rank0(const std::vector<float>& v) { return same_bits(dist::broadcast_object(v, 0), v); }

/// A DDP BatchNorm model after 3 steps on each process's own rows.
struct Trained {
  std::shared_ptr<dp::nn::Sequential> net;
  std::unique_ptr<dp::DataParallel> model;
};
Trained train_bn(int steps = 3) {
  Trained t;
  t.net = make_bn_net(11);
  t.model = std::make_unique<dp::DataParallel>(t.net, std::vector<dp::Device>{dp::cpu(0), dp::cpu(1)},
                                               dp::DataParallelOptions{.mode = dp::Mode::DDP});
  dp::optim::SGD opt(t.model->parameters(), {.lr = 0.1});
  for (int s = 0; s < steps; ++s) {
    Batch b = image_batch(8, 50 + 10 * static_cast<std::uint64_t>(dist::rank()) + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    (void)t.model->forward_backward(b.x, b.y, loss_fn);
    opt.step();
  }
  return t;
}

}  // namespace

TEST_CASE("evaluation on every process: the same output everywhere, equal to process 0's module alone") {
  Trained t = train_bn();
  t.model->eval();
  Batch test = image_batch(10, 999);  // the same rows on every process
  std::vector<float> out;
  {
    dp::NoGradGuard no_grad;
    out = (*t.model)(test.x).to_vector();
  }
  CHECK_MESSAGE(same_as_rank0(out), "model(x) in eval mode differs between processes");
  // Process 0's module on its device 0 (its parameters and buffers are world rank 0's):
  // what the replicas computed, row by row.
  std::vector<float> alone;
  {
    dp::NoGradGuard no_grad;
    alone = t.net->forward(test.x.to(dp::cpu(0))).to_vector();
  }
  alone = dist::broadcast_object(alone, 0);
  REQUIRE(alone.size() == out.size());
  double diff = 0;
  for (std::size_t i = 0; i < out.size(); ++i) diff = std::max(diff, std::abs(static_cast<double>(out[i]) - alone[i]));
  CHECK(diff < 1e-5);

  // Each process evaluates its own rows; the counts add up to the same accuracy everywhere.
  Batch mine = image_batch(6, 700 + static_cast<std::uint64_t>(dist::rank()));
  std::int64_t correct = 0;
  {
    dp::NoGradGuard no_grad;
    const std::vector<std::int64_t> pred = dp::argmax((*t.model)(mine.x), 1).to_vector_i64();
    const std::vector<std::int64_t> label = mine.y.to_vector_i64();
    for (std::size_t i = 0; i < pred.size(); ++i) correct += pred[i] == label[i] ? 1 : 0;
  }
  std::int64_t counts[] = {correct, 6};
  dist::all_reduce(std::span<std::int64_t>(counts), dist::Op::Sum);
  const double accuracy = static_cast<double>(counts[0]) / static_cast<double>(counts[1]);
  CHECK(counts[1] == 6 * dist::world_size());
  CHECK(dist::broadcast_object(accuracy, 0) == accuracy);
}

TEST_CASE("a model without buffers: process 0 alone may evaluate it under no_grad") {
  auto net = make_mlp(3);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = dp::Mode::DDP});
  if (dist::is_main()) {
    dp::NoGradGuard no_grad;
    Tensor out = model(make_batch(5, 1).x);  // no float buffers: nothing crosses processes
    CHECK(out.size(0) == 5);
  }
  dist::barrier();
}

TEST_CASE("one device per process: every design combines gradients across processes") {
  struct Case {
    const char* name;
    dp::DataParallelOptions options;
  };
  const Case cases[] = {{"DP", {.mode = dp::Mode::DP}},
                        {"DDP", {.mode = dp::Mode::DDP}},
                        {"Sharded-1", {.mode = dp::Mode::Sharded, .shard_stage = 1}},
                        {"Sharded-2", {.mode = dp::Mode::Sharded, .shard_stage = 2}}};
  std::vector<float> reference;
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto net = make_mlp(5);
    dp::DataParallel model(net, {dp::cpu(0)}, c.options);
    dp::optim::Adam opt(model.parameters(), {.lr = 0.01});
    for (int s = 0; s < 3; ++s) {
      Batch b = make_batch(6, 300 + 10 * static_cast<std::uint64_t>(dist::rank()) + static_cast<std::uint64_t>(s));
      opt.zero_grad();
      (void)model.forward_backward(b.x, b.y, loss_fn);
      opt.step();
    }
    const std::vector<float> p = flat(net->state_dict());
    CHECK_MESSAGE(same_as_rank0(p), c.name, ": parameters differ between processes");
    if (reference.empty()) {
      reference = p;
    } else {
      CHECK_MESSAGE(same_bits(p, reference), c.name, ": parameters differ from DP's");
    }
  }
}

namespace {

/// Process 0 alone evaluates a BatchNorm model (its buffers are broadcast from world rank
/// 0 before the forward, a collective); the other process returns from main.
int run_eval_rank0() {
  Trained t = train_bn(1);
  t.model->eval();
  if (dist::is_main()) {
    dp::NoGradGuard no_grad;
    Tensor out = (*t.model)(image_batch(4, 1).x);
    std::cout << "EVAL-TEST: rank 0 got through an evaluation its peer never joined\n" << std::flush;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--eval=rank0") return run_eval_rank0();
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  if (dist::rank() != 0) ctx.setOption("minimal", true);
  if (dist::is_distributed()) ctx.setOption("no-colors", true);
  return ctx.run();
}
