// Tests for dp/optim/optimizer.h: flat-range grouping (whole set, partial lists, loose
// tensors), per-copy state (copies added later start from the primary's state; a
// sharded set's copies step and keep state for their own range), executors,
// zero_grad, state_dict round trips and the errors.
#include <doctest/doctest.h>

#include <thread>

#include "dp/optim/optim.h"
#include "dp/tensor/ops.h"
#include "optim_test_util.h"
#include "parallel/shard_store.h"

using namespace optim_test;
namespace optim = dp::optim;

TEST_CASE("a partial parameter list steps only its ranges") {
  auto net = tiny_net(dp::cpu(0));
  auto all = net->parameters();  // 0.weight, 0.bias, 1.weight, 1.bias
  // 0.weight and 1.weight: two ranges with a gap (0.bias) between them.
  dp::nn::ParameterList part({all[0], all[2]}, {all.slots()[0], all.slots()[2]}, all.set());
  std::vector<std::vector<float>> before;
  for (const auto& t : all) before.push_back(t.to_vector());
  optim::SGD opt(part, {.lr = 0.5, .momentum = 0.9});
  for (int t = 0; t < 2; ++t) {
    opt.zero_grad();
    set_grads(all.tensors(), t);  // every grad written; only the list may move
    opt.step();
  }
  CHECK(all[1].to_vector() == before[1]);
  CHECK(all[3].to_vector() == before[3]);
  CHECK(all[0].to_vector() != before[0]);
  // Reference: the same two tensors under SGD (momentum) by hand.
  SgdRef ref{0.5, 0.9};
  for (std::size_t k : {0u, 2u}) {
    D p = to_double(before[k]), buf(p.size());
    for (int t = 0; t < 2; ++t)
      for (std::size_t i = 0; i < p.size(); ++i) ref.step(p[i], grad_value(k, i, t), buf[i], t == 0);
    CHECK(max_rel_diff(all[k].to_vector(), p) < 2e-6);
  }
  // zero_grad touched only the list's ranges.
  opt.zero_grad();
  for (float g : all[0].grad().to_vector()) CHECK(g == 0);
  CHECK(all[1].grad().to_vector()[0] != 0);
  // state_dict names follow the list's order and shapes.
  auto sd = opt.state_dict();
  REQUIRE(sd.size() == 3);
  CHECK(sd[1].first == "state.0.momentum_buffer");
  CHECK(sd[1].second.shape() == all[0].shape());
  CHECK(sd[2].first == "state.1.momentum_buffer");
  CHECK(sd[2].second.shape() == all[2].shape());
}

TEST_CASE_TEMPLATE("loose tensors are stepped one by one; tensors without a gradient are skipped", Dev,
                   DP_OPTIM_TEST_DEVICES) {
  const dp::Device dev = Dev::device();
  dp::Tensor a = dp::from_vector(std::vector<float>{1, 2, 3}, {3}, dev);
  dp::Tensor b = dp::from_vector(std::vector<float>{4, 5}, {2}, dev);
  a.set_requires_grad(true);
  b.set_requires_grad(true);
  optim::Adam opt(std::vector<dp::Tensor>{a, b}, {.lr = 0.1});
  dp::sum(dp::mul(a, a)).backward();  // b gets no gradient
  opt.step();
  CHECK(b.to_vector() == std::vector<float>{4, 5});
  AdamRef ref{0.1};
  D pa{1, 2, 3};
  for (std::size_t i = 0; i < 3; ++i) {
    double m = 0, v = 0;
    ref.step(pa[i], 2 * (i + 1.0), m, v, 1);
  }
  CHECK(max_rel_diff(a.to_vector(), pa) < 1e-6);
  opt.zero_grad(false);  // PyTorch's set_to_none=False: zeros
  for (float g : a.grad().to_vector()) CHECK(g == 0);
  opt.zero_grad();  // PyTorch's default: none (Note [Parameters without a gradient])
  CHECK(!a.grad().defined());
  auto sd = opt.state_dict();
  REQUIRE(sd.size() == 4);  // step + a's two buffers; b has no state yet and a step count of 0
  CHECK(sd[1].first == "state.0.exp_avg");
  CHECK(sd[2].first == "state.0.exp_avg_sq");
  CHECK(sd[3].first == "state.1.step");
  CHECK(sd[3].second.item() == 0);
}

TEST_CASE("a copy added after some steps starts from the primary's state") {
  for (int which = 0; which < 2; ++which) {
    CAPTURE(which);
    auto net = tiny_net(dp::cpu(0));
    auto params = net->parameters();
    auto set = params.set();
    std::unique_ptr<optim::Optimizer> opt;
    if (which == 0) opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    else opt = std::make_unique<optim::Adam>(params, optim::AdamOptions{.lr = 0.05});
    for (int t = 0; t < 2; ++t) {
      opt->zero_grad();
      set_grads(params.tensors(), t);
      opt->step();
    }
    const int r = set->add_copy(dp::cpu(1), /*transient=*/false);
    CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
    const auto v0 = set->version();
    for (int t = 2; t < 4; ++t) {
      opt->zero_grad();
      set_grads(params.tensors(), t);
      set->copy(r).grad.copy_(set->copy(0).grad);  // what DDP's all-reduce would leave
      opt->step();
      // Same kernel, same gradient, same state: bitwise equal copies.
      CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
    }
    CHECK(set->version() == v0 + 2);
    CHECK(set->copy(r).data.device() == dp::cpu(1));
  }
}

TEST_CASE("transient copies are not stepped, but their gradients are zeroed") {
  auto net = tiny_net(dp::cpu(0));
  auto params = net->parameters();
  auto set = params.set();
  const int r = set->add_copy(dp::cpu(2), /*transient=*/true);
  optim::SGD opt(params, {.lr = 0.1});
  auto before = set->copy(r).data.to_vector();
  set->copy(r).grad.fill_(1.0);
  set_grads(params.tensors(), 0);
  opt.step();
  CHECK(set->copy(r).data.to_vector() == before);
  opt.zero_grad();
  for (float g : set->copy(r).grad.to_vector()) CHECK(g == 0);
  for (float g : set->copy(0).grad.to_vector()) CHECK(g == 0);
}

TEST_CASE("after zero_grad a weight's gradient is written over its zeros; an edit of .grad after zero_grad is kept") {
  // Note [Gradients written over zeros], through the optimizer's zero_grad of a flat set.
  auto net = tiny_net(dp::cpu(0));
  auto params = net->parameters();  // 0.weight, 0.bias, 1.weight, 1.bias: one flat buffer
  optim::SGD opt(params, {.lr = 0.1});
  const dp::Tensor x =
      dp::from_vector(std::vector<float>{0.5f, -1.0f, 2.0f, 1.5f, 0.25f, -0.75f, -2.0f, 1.0f, 0.5f, 3.0f, -1.5f, 0.125f}, {4, 3});
  auto loss = [&] {
    const dp::Tensor y = net->forward(x);
    return dp::sum(y * y);
  };
  opt.zero_grad();
  loss().backward();
  std::vector<std::vector<float>> want;
  for (const auto& t : params) want.push_back(t.grad().to_vector());

  // A value put into the .grad without the API (outside Note [Storage versions]) is
  // written over: the zeros were known, the GEMM did not read them.
  opt.zero_grad();
  params[0].grad().data<float>()[0] = 7.0f;
  loss().backward();
  for (std::size_t k = 0; k < params.size(); ++k) CHECK(params[k].grad().to_vector() == want[k]);

  // An edit through the API after zero_grad: the gradient is added to it.
  opt.zero_grad();
  params[0].grad().add_(dp::ones({2, 3}));
  loss().backward();
  const std::vector<float> got = params[0].grad().to_vector();
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(1.0f + want[0][i]).epsilon(1e-6));

  // An edit of another parameter's .grad on the same buffer: kept, and every other
  // gradient is still exactly the usual one.
  opt.zero_grad();
  params[1].grad().fill_(2.0);
  loss().backward();
  for (std::size_t k : {0u, 2u, 3u}) CHECK(params[k].grad().to_vector() == want[k]);
  const std::vector<float> bias = params[1].grad().to_vector();
  for (std::size_t i = 0; i < bias.size(); ++i) CHECK(bias[i] == 2.0f + want[1][i]);
}

TEST_CASE("an executor runs each copy's step on its own thread") {
  auto net = tiny_net(dp::cpu(0));
  auto params = net->parameters();
  auto set = params.set();
  set->add_copy(dp::cpu(1), false);
  set->add_copy(dp::cpu(2), false);
  int calls = 0, updates = 0;
  struct Threads final : optim::StepExecutor {
    int &calls, &updates;
    Threads(int& c, int& u) : calls(c), updates(u) {}
    static void run(int n, const std::function<void(int)>& fn) {
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
      for (auto& t : threads) t.join();
    }
    void for_each_copy(int n, const std::function<void(int)>& fn, dp::nn::CopyWork) override {
      ++calls;
      run(n, fn);
    }
    void step_copies(int n, const std::function<void(int)>& fn) override {
      ++calls;
      ++updates;
      run(n, fn);
    }
  } executor(calls, updates);
  set->set_executor(&executor);
  optim::Adam opt(params, {.lr = 0.01});
  for (int t = 0; t < 3; ++t) {
    opt.zero_grad();
    set_grads(params.tensors(), t);
    for (int r = 1; r < 3; ++r) set->copy(r).grad.copy_(set->copy(0).grad);
    opt.step();
  }
  CHECK(calls == 6);  // 3 zero_grad + 3 step
  CHECK(updates == 3);
  for (int r = 1; r < 3; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  set->set_executor(nullptr);
}

TEST_CASE("the optimizer refuses parameters that were re-flattened") {
  auto net = tiny_net(dp::cpu(0));
  auto params = net->parameters();
  optim::SGD opt(params, {.lr = 0.1});
  params.set()->invalidate();
  try {
    opt.step();
    FAIL("step did not throw");
  } catch (const dp::Error& e) {
    CHECK(std::string(e.what()).find("re-flattened") != std::string::npos);
    CHECK(std::string(e.what()).find("build the optimizer after wrapping") != std::string::npos);
  }
  CHECK_THROWS_AS(opt.zero_grad(), dp::Error);
  CHECK(opt.step_count() == 0);
}

TEST_CASE("bad parameter lists are rejected") {
  CHECK_THROWS_AS(optim::SGD(dp::nn::ParameterList{}, {.lr = 0.1}), dp::Error);
  CHECK_THROWS_AS(optim::Adam(std::vector<dp::Tensor>{}), dp::Error);
  dp::Tensor i64 = dp::zeros({3}, {dp::Dtype::Int64, dp::cpu(0)});
  CHECK_THROWS_AS(optim::SGD(std::vector<dp::Tensor>{i64}, {.lr = 0.1}), dp::Error);
  dp::Tensor a = dp::zeros({3});
  CHECK_THROWS_AS(optim::SGD(std::vector<dp::Tensor>{a, a}, {.lr = 0.1}), dp::Error);
}

TEST_CASE_TEMPLATE("optimizer state_dict round trip continues identically", Dev, DP_OPTIM_TEST_DEVICES) {
  const dp::Device dev = Dev::device();
  auto a = tiny_net(dev, 1), b = tiny_net(dev, 2);
  auto pa = a->parameters(), pb = b->parameters();
  optim::Adam oa(pa, {.lr = 0.05, .weight_decay = 0.01});
  for (int t = 0; t < 2; ++t) {
    oa.zero_grad();
    set_grads(pa.tensors(), t);
    oa.step();
  }
  auto sd = oa.state_dict();
  REQUIRE(sd.size() == 1 + 2 * 4);
  CHECK(sd[0].first == "step");
  CHECK(sd[0].second.item() == 2);
  CHECK(sd[1].first == "state.0.exp_avg");
  CHECK(sd[2].first == "state.0.exp_avg_sq");
  CHECK(sd[8].first == "state.3.exp_avg_sq");
  CHECK(sd[3].second.shape() == pa[1].shape());

  b->load_state_dict(a->state_dict());
  optim::Adam ob(pb, {.lr = 0.05, .weight_decay = 0.01});
  ob.load_state_dict(sd);
  CHECK(ob.step_count() == 2);
  for (int t = 2; t < 4; ++t) {
    oa.zero_grad();
    ob.zero_grad();
    set_grads(pa.tensors(), t);
    set_grads(pb.tensors(), t);
    oa.step();
    ob.step();
  }
  for (std::size_t k = 0; k < pa.size(); ++k) CHECK(dp::equal(pa[k], pb[k]));

  // Mismatches are named.
  optim::SGD sgd(pb, {.lr = 0.1, .momentum = 0.9});
  try {
    sgd.load_state_dict(sd);
    FAIL("load did not throw");
  } catch (const dp::Error& e) {
    std::string msg = e.what();
    CHECK(msg.find("state.0.exp_avg") != std::string::npos);
    CHECK(msg.find("state.0.momentum_buffer") != std::string::npos);
  }
  auto bad = sd;
  bad[1].second = dp::zeros({7}, dev);
  CHECK_THROWS_AS(ob.load_state_dict(bad), dp::Error);
  CHECK_THROWS_AS(ob.load_state_dict({}), dp::Error);
  // SGD without momentum has only a step count.
  optim::SGD plain(pb, {.lr = 0.1});
  CHECK(plain.state_dict().size() == 1);
}

TEST_CASE("a sharded set: each copy steps only its range, keeping state for it alone") {
  // Linear(8, 6) -> Linear(6, 4): 82 parameters; 3 copies own 32 elements each (28
  // rounded up to 16), so the ranges cut through weights and copy 2 ends in padding.
  auto make = [] {
    dp::Generator gen(5);
    return std::make_shared<dp::nn::Sequential>(std::make_shared<dp::nn::Linear>(8, 6, true, &gen),
                                                std::make_shared<dp::nn::Linear>(6, 4, true, &gen));
  };
  auto make_opt = [](int kind, dp::nn::ParameterList p) -> std::unique_ptr<optim::Optimizer> {
    if (kind == 0) return std::make_unique<optim::SGD>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
    if (kind == 1) return std::make_unique<optim::Adam>(p, optim::AdamOptions{.lr = 0.01});
    return std::make_unique<optim::AdamW>(p, optim::AdamWOptions{.lr = 0.01, .weight_decay = 0.1});
  };
  for (int kind = 0; kind < 3; ++kind) {
    CAPTURE(kind);
    auto net = make(), ref = make();
    auto params = net->parameters();
    auto set = params.set();
    set->add_copy(dp::cpu(1), false);
    set->add_copy(dp::cpu(2), false);
    dp::parallel::ShardStore store(*set, /*processes=*/1, /*process=*/0);  // what Mode::Sharded cuts with
    store.shard(/*shard_grads=*/false);
    REQUIRE(set->numel() == 82);
    REQUIRE(set->buffer_numel() == 96);
    auto opt = make_opt(kind, params);
    auto ref_opt = make_opt(kind, ref->parameters());
    for (int t = 0; t < 3; ++t) {
      opt->zero_grad();
      ref_opt->zero_grad();
      set_grads(params.tensors(), t);
      set_grads(ref->parameters().tensors(), t);
      for (int r = 1; r < 3; ++r) set->copy(r).grad.copy_(set->copy(0).grad);
      std::vector<std::vector<float>> before;
      for (int r = 0; r < 3; ++r) before.push_back(set->copy(r).data.to_vector());
      opt->step();
      ref_opt->step();
      for (int r = 0; r < 3; ++r) {
        const auto c = dp::nn::copy_span(*set, r);
        auto now = set->copy(r).data.to_vector();
        for (std::int64_t i = 0; i < set->buffer_numel(); ++i)
          if (i < c.begin || i >= c.end) CHECK(now[i] == before[r][i]);  // outside its range: untouched
      }
      // What DataParallel's all-gather does: every copy takes every copy's range.
      for (int r = 0; r < 3; ++r)
        for (int o = 0; o < 3; ++o) {
          const auto src = dp::nn::copy_span(*set, o);
          set->copy(r).data.narrow(0, src.begin, src.end - src.begin).copy_(src.data);
        }
      CHECK(dp::equal(set->copy(0).data.narrow(0, 0, 82), ref->parameters().set()->copy(0).data));
    }
    // The state_dict is the full state, assembled from the three ranges.
    auto sd = opt->state_dict(), ref_sd = ref_opt->state_dict();
    REQUIRE(sd.size() == ref_sd.size());
    for (std::size_t i = 0; i < sd.size(); ++i) {
      CHECK(sd[i].first == ref_sd[i].first);
      CHECK(dp::equal(sd[i].second, ref_sd[i].second));
    }
    // A load hands each copy its range: one more step still matches.
    auto again = make_opt(kind, params);
    again->load_state_dict(ref_sd);
    opt.reset();
    again->zero_grad();
    ref_opt->zero_grad();
    set_grads(params.tensors(), 7);
    set_grads(ref->parameters().tensors(), 7);
    for (int r = 1; r < 3; ++r) set->copy(r).grad.copy_(set->copy(0).grad);
    again->step();
    ref_opt->step();
    for (int o = 1; o < 3; ++o) {
      const auto src = dp::nn::copy_span(*set, o);
      set->copy(0).data.narrow(0, src.begin, src.end - src.begin).copy_(src.data);
    }
    CHECK(dp::equal(set->copy(0).data.narrow(0, 0, 82), ref->parameters().set()->copy(0).data));
    store.unshard();
    set->drop_copies();
  }
}
