// DataParallel in DP and DDP modes against plain single-device training.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <thread>

#include "backend/backend.h"
#include "dp/autograd/node.h"
#include "dp/dp.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;

enum class Path { Module, WorkerLoss };

struct RunResult {
  std::vector<float> params;
  std::vector<double> losses;
};

// Trains `steps` Adam steps. devices empty = plain single-device training on cpu(0).
RunResult train(std::vector<int> devices, dp::Mode mode, Path path, std::int64_t rows, int steps = 10,
                dp::DataParallelOptions opts = {}) {
  auto net = make_mlp(42);
  RunResult res;
  std::unique_ptr<dp::DataParallel> model;
  if (!devices.empty()) {
    opts.mode = mode;
    std::vector<dp::Device> devs;
    for (int d : devices) devs.push_back(dp::cpu(d));
    model = std::make_unique<dp::DataParallel>(net, devs, opts);
  }
  dp::optim::Adam opt(model ? model->parameters() : net->parameters(), {.lr = 1e-2});
  for (int s = 0; s < steps; ++s) {
    Batch b = make_batch(rows, 100 + s);
    opt.zero_grad();
    Tensor loss;
    if (!model) {
      loss = loss_fn(net->forward(b.x), b.y);
      loss.backward();
    } else if (path == Path::Module) {
      loss = loss_fn((*model)(b.x), b.y);
      loss.backward();
    } else {
      loss = model->forward_backward(b.x, b.y, loss_fn);
    }
    res.losses.push_back(loss.item());
    opt.step();
  }
  for (auto& [name, t] : net->state_dict()) {
    auto v = t.to_vector();
    res.params.insert(res.params.end(), v.begin(), v.end());
  }
  return res;
}

// Summation order differs between one device (one GEMM over the batch) and several
// (per-shard GEMMs, then a sum over devices), so results agree to float rounding,
// amplified a little by 10 Adam steps.
constexpr double kTolerance = 2e-5;

}  // namespace

TEST_CASE("single, DP and DDP on 1-4 CPU devices reach the same parameters after 10 Adam steps") {
  for (std::int64_t rows : {16, 10, 2}) {  // even, uneven (10 on 4), smaller than 4 devices
    RunResult ref = train({}, dp::Mode::DP, Path::Module, rows);
    for (int n = 1; n <= 4; ++n) {
      std::vector<int> devs;
      for (int i = 0; i < n; ++i) devs.push_back(i);
      for (Path path : {Path::Module, Path::WorkerLoss}) {
        CAPTURE(rows);
        CAPTURE(n);
        CAPTURE(static_cast<int>(path));
        RunResult dp_res = train(devs, dp::Mode::DP, path, rows);
        RunResult ddp_res = train(devs, dp::Mode::DDP, path, rows);
        CHECK(max_diff(dp_res.params, ref.params) < kTolerance);
        CHECK(max_diff(ddp_res.params, ref.params) < kTolerance);
        for (int s = 0; s < 10; ++s) CHECK(std::fabs(dp_res.losses[s] - ref.losses[s]) < kTolerance);
        // The same arithmetic in both designs: bitwise identical on CPU devices.
        CHECK(dp_res.params == ddp_res.params);
      }
    }
  }
}

TEST_CASE("every mode is bitwise reproducible run to run") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    RunResult a = train({0, 1, 2}, mode, Path::WorkerLoss, 13);
    RunResult b = train({0, 1, 2}, mode, Path::WorkerLoss, 13);
    CHECK(a.params == b.params);
    CHECK(a.losses == b.losses);
  }
}

TEST_CASE("DDP with tiny buckets (one per parameter) matches one big bucket bit for bit") {
  dp::DataParallelOptions tiny{.bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6};
  RunResult small = train({0, 1, 2, 3}, dp::Mode::DDP, Path::Module, 12, 5, tiny);
  RunResult big = train({0, 1, 2, 3}, dp::Mode::DDP, Path::Module, 12, 5);
  CHECK(small.params == big.params);
}

TEST_CASE("DDP buckets cover the flat buffer in reverse registration order, first bucket small") {
  auto net = make_mlp(1);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)},
                         {.mode = dp::Mode::DDP, .bucket_cap_mb = 400.0 / (1 << 20), .first_bucket_mb = 40.0 / (1 << 20)});
  auto b = model.buckets();
  REQUIRE(b.size() >= 3);
  std::int64_t total = model.parameters().set()->numel();
  CHECK(b.front().second == total);  // the last parameters come first
  CHECK(b.back().first == 0);
  for (std::size_t i = 1; i < b.size(); ++i) CHECK(b[i].second == b[i - 1].first);  // contiguous
  // The last layer's bias (3 floats) and weight (24) fit the 10-float first bucket
  // only partly: a bucket never splits a parameter.
  CHECK(b.front().second - b.front().first == 3);
}

TEST_CASE("DataParallel keeps state_dict names and device 0 owns the trained parameters") {
  auto net = make_mlp(7);
  auto names_before = net->state_dict();
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)});
  auto names_after = model.state_dict();
  REQUIRE(names_before.size() == names_after.size());
  for (std::size_t i = 0; i < names_after.size(); ++i) CHECK(names_before[i].first == names_after[i].first);
  CHECK(names_after[0].first == "0.weight");
  CHECK(model.module() == net);
  CHECK(net->device() == dp::cpu(0));
}

TEST_CASE("no_sync accumulation equals one big batch") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    auto net_a = make_mlp(5), net_b = make_mlp(5);
    dp::DataParallel a(net_a, {dp::cpu(0), dp::cpu(1)}, {.mode = mode});
    dp::DataParallel b(net_b, {dp::cpu(0), dp::cpu(1)}, {.mode = mode});
    Batch big = make_batch(16, 3);
    // One big batch.
    a.zero_grad();
    a.forward_backward(big.x, big.y, loss_fn);
    // Two halves: the first without sync; each half's loss is halved so the sum of
    // gradients equals the big batch's mean.
    b.zero_grad();
    auto half_loss = [](const Tensor& o, const Tensor& y) { return dp::mul(loss_fn(o, y), 0.5); };
    {
      auto guard = b.no_sync();
      b.forward_backward(big.x.narrow(0, 0, 8), big.y.narrow(0, 0, 8), half_loss);
    }
    b.forward_backward(big.x.narrow(0, 8, 8), big.y.narrow(0, 8, 8), half_loss);
    auto ga = a.parameters().set()->copy(0).grad;
    auto gb = b.parameters().set()->copy(0).grad;
    CHECK(dp::max_abs_diff(ga, gb) < 1e-6);
    if (mode == dp::Mode::DDP) {  // every replica holds the synchronised gradient
      CHECK(dp::equal(b.parameters().set()->copy(1).grad.to(dp::cpu(0)), gb));
    }
  }
}

namespace {

// Throws in forward on one device, once, when armed.
struct Faulty : dp::nn::Module {
  explicit Faulty(int bad_copy) : bad_copy(bad_copy) {
    dp::Generator gen(9);
    fc = register_module("fc", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    if (armed.load() && dp::nn::ReplicaBinding::current() == bad_copy) {
      armed = false;
      throw dp::Error("injected failure");
    }
    return fc->forward(x);
  }
  int bad_copy;
  std::atomic<bool> armed{false};
  std::shared_ptr<dp::nn::Linear> fc;
};

}  // namespace

TEST_CASE("an exception in one worker reaches the caller naming the device; the next step is correct") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    auto net = std::make_shared<Faulty>(2);
    auto ref_net = std::make_shared<Faulty>(2);
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
    dp::DataParallel ref(ref_net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
    dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
    dp::optim::SGD ref_opt(ref.parameters(), {.lr = 0.1});
    Batch b = make_batch(9, 11);
    net->armed = true;
    auto fut = std::async(std::launch::async, [&] {
      CHECK_THROWS_WITH_AS(model.forward_backward(b.x, b.y, loss_fn), doctest::Contains("cpu:2"), dp::Error);
    });
    REQUIRE(fut.wait_for(std::chrono::seconds(30)) == std::future_status::ready);  // no hang
    fut.get();
    // The failed step left no partial gradient behind once zeroed; the next step
    // matches a run that never failed.
    opt.zero_grad();
    ref_opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    ref.forward_backward(b.x, b.y, loss_fn);
    opt.step();
    ref_opt.step();
    CHECK(dp::equal(model.parameters().set()->copy(0).data, ref.parameters().set()->copy(0).data));
    // The module(x) path too.
    net->armed = true;
    CHECK_THROWS_WITH_AS(model(b.x), doctest::Contains("injected failure"), dp::Error);
    Tensor out = model(b.x);
    CHECK(out.size(0) == 9);
  }
}

TEST_CASE("bad device lists and inputs are rejected with dp::Error") {
  auto net = make_mlp(1);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, std::vector<dp::Device>{}), doctest::Contains("empty"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, {dp::cpu(1), dp::cpu(1)}), doctest::Contains("twice"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::DataParallel(net, std::vector<int>{0, 99}), doctest::Contains("out of range"),
                       dp::Error);
  CHECK_THROWS_AS(dp::DataParallel(net, std::vector<int>{-1}), dp::Error);
  CHECK_THROWS_AS(dp::DataParallel(net, {dp::cpu(0)}, {.output_device = 3}), dp::Error);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.chunk_sizes = {3, 2}});
  Batch b = make_batch(4, 1);
  CHECK_THROWS_WITH_AS(model(b.x), doctest::Contains("chunk_sizes sum to 5"), dp::Error);
  CHECK_THROWS_AS(model(Tensor()), dp::Error);
  CHECK_THROWS_AS(model(dp::zeros({0, 6}, dp::cpu(0))), dp::Error);
  CHECK_THROWS_AS(model.forward_backward(b.x, b.y.narrow(0, 0, 3), loss_fn), dp::Error);
  // A wrong feature size fails inside a worker and is reported, not crashed on.
  dp::DataParallel plain(make_mlp(1), {dp::cpu(0), dp::cpu(1)});
  CHECK_THROWS_WITH_AS(plain(dp::zeros({4, 5}, dp::cpu(0))), doctest::Contains("linear"), dp::Error);
  CHECK(plain(b.x).size(0) == 4);  // and it still works
}

TEST_CASE("explicit chunk sizes are honoured and weighted exactly") {
  RunResult ref = train({}, dp::Mode::DP, Path::Module, 12, 3);
  dp::DataParallelOptions opts{.chunk_sizes = {9, 0, 3}};
  RunResult a = train({0, 1, 2}, dp::Mode::DDP, Path::WorkerLoss, 12, 3, opts);
  CHECK(max_diff(a.params, ref.params) < kTolerance);
}

TEST_CASE("BatchNorm: DP keeps device 0's running stats, DDP broadcasts them; eval uses them") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    dp::Generator gen(3);
    auto net = std::make_shared<dp::nn::Sequential>();
    net->push_back(std::make_shared<dp::nn::Conv2d>(1, 2, 3, 1, 1, true, &gen));
    net->push_back(std::make_shared<dp::nn::BatchNorm2d>(2));
    net->push_back(std::make_shared<dp::nn::Flatten>());
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = mode});
    dp::Generator data_gen(8);
    Tensor x = dp::randn({4, 1, 4, 4}, data_gen, dp::cpu(0));
    model(x);
    // Device 0's replica saw rows 0..1: the running mean equals a plain net's after
    // one forward over those rows.
    dp::Generator gen2(3);
    auto plain = std::make_shared<dp::nn::Sequential>();
    plain->push_back(std::make_shared<dp::nn::Conv2d>(1, 2, 3, 1, 1, true, &gen2));
    plain->push_back(std::make_shared<dp::nn::BatchNorm2d>(2));
    plain->push_back(std::make_shared<dp::nn::Flatten>());
    plain->forward(x.narrow(0, 0, 2));
    auto find = [](dp::nn::Module& m, const std::string& key) {
      for (auto& [k, v] : m.state_dict())
        if (k == key) return v;
      FAIL("missing key ", key);
      return Tensor();
    };
    for (const char* key : {"1.running_mean", "1.running_var"})
      CHECK(dp::max_abs_diff(find(*net, key), find(*plain, key)) < 1e-6);

    model.eval();
    plain->eval();
    CHECK(dp::max_abs_diff(model(x), plain->forward(x)) < 1e-5);
  }
}

// Note [Coalesced buffers]: one flat buffer per device, one broadcast per forward,
// and handles taken before wrapping follow device 0's buffers.
TEST_CASE("BatchNorm buffers are coalesced: one storage per device, handles still live") {
  dp::Generator gen(3);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Conv2d>(1, 2, 3, 1, 1, true, &gen));
  net->push_back(std::make_shared<dp::nn::BatchNorm2d>(2));
  net->push_back(std::make_shared<dp::nn::BatchNorm2d>(2));
  net->push_back(std::make_shared<dp::nn::Flatten>());
  Tensor mean_before;
  for (auto& [k, v] : net->named_buffers())
    if (k == "1.running_mean") mean_before = v;
  REQUIRE(mean_before.defined());
  const std::vector<float> initial = mean_before.to_vector();
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = dp::Mode::DDP});
  auto slots = net->buffer_slots();
  for (int r = 0; r < 3; ++r) {
    std::vector<const dp::Storage*> storages;
    for (auto& s : slots)
      if (s->copies[r].dtype() == dp::Dtype::Float32) storages.push_back(s->copies[r].storage().get());
    REQUIRE(storages.size() == 4);  // running_mean and running_var of two BatchNorms
    for (const dp::Storage* st : storages) CHECK(st == storages[0]);
    CHECK(slots[0]->copies[r].device() == dp::cpu(r));
  }
  CHECK(mean_before.to_vector() == initial);  // values kept by the move
  dp::Generator data_gen(8);
  model(dp::randn({6, 1, 4, 4}, data_gen, dp::cpu(0)));
  // Device 0's forward updated its running mean, seen through the old handle ...
  CHECK(mean_before.to_vector() != initial);
  CHECK(mean_before.storage() == slots[0]->copies[0].storage());
  // ... and the next forward's broadcast brings every replica to device 0's values.
  model(dp::randn({6, 1, 4, 4}, data_gen, dp::cpu(0)));
  model.eval();
  model(dp::randn({6, 1, 4, 4}, data_gen, dp::cpu(0)));  // eval: the broadcast only
  for (auto& s : slots)
    for (int r = 1; r < 3; ++r) CHECK(dp::equal(s->copies[r].to(dp::cpu(0)), s->copies[0]));
}

TEST_CASE("Dropout: each device draws its own mask, deterministically") {
  auto make = [] {
    dp::Generator gen(4);
    auto net = std::make_shared<dp::nn::Sequential>();
    net->push_back(std::make_shared<dp::nn::Linear>(6, 6, true, &gen));
    net->push_back(std::make_shared<dp::nn::Dropout>(0.5, 77));
    return net;
  };
  Batch b = make_batch(8, 2);
  auto n1 = make(), n2 = make();
  dp::DataParallel m1(n1, {dp::cpu(0), dp::cpu(1)}), m2(n2, {dp::cpu(0), dp::cpu(1)});
  Tensor o1 = m1(b.x), o2 = m2(b.x);
  CHECK(dp::equal(o1, o2));
  auto v = o1.to_vector();
  int zeros = 0;
  for (float f : v) zeros += f == 0.0f;
  CHECK(zeros > 0);
  CHECK(zeros < static_cast<int>(v.size()));
  m1.eval();
  auto plain = make();
  plain->eval();
  CHECK(dp::max_abs_diff(m1(b.x), plain->forward(b.x)) < 1e-6);
}

TEST_CASE("phase stats and the trace are recorded per device") {
  auto net = make_mlp(1);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = dp::Mode::DDP});
  model.trace().enable(true);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  Batch b = make_batch(8, 1);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    opt.step();
  }
  auto s = model.stats();
  CHECK(s.iterations == 3);
  REQUIRE(s.devices.size() == 2);
  for (auto& d : s.devices) {
    CHECK(d[dp::parallel::Phase::Forward] > 0);
    CHECK(d[dp::parallel::Phase::Backward] > 0);
    CHECK(d[dp::parallel::Phase::Step] > 0);
    CHECK(d.peak_memory_bytes > 0);
  }
  int comm_events = 0;
  for (auto& e : model.trace().events()) comm_events += e.track.rfind("comm ", 0) == 0;
  CHECK(comm_events >= 6);  // at least one bucket per device per step
}

TEST_CASE("the module is a plain single-device module again after DataParallel is destroyed") {
  auto net = make_mlp(2);
  { dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = dp::Mode::DDP}); }
  CHECK(net->parameters().set()->num_copies() == 1);
  Batch b = make_batch(4, 1);
  Tensor loss = loss_fn(net->forward(b.x), b.y);
  loss.backward();
  CHECK(loss.item() > 0);
  dp::DataParallel again(net, {dp::cpu(0), dp::cpu(1)});
  CHECK(again(b.x).size(0) == 4);
}

TEST_CASE("each live DataParallel keeps its devices' share of the cores; one that goes leaves the others theirs") {
  // Note [Concurrent devices of live wrappers]: a training resumed into fresh objects
  // builds its wrapper before the old one goes. The old one's destructor used to give
  // every device all the cores while the new one trained on two.
  dp::backend::Backend& be = dp::backend::get(dp::cpu(0));
  auto threads = [&] { return be.threads_per_device(dp::cpu(0)); };
  // With no wrapper alive one device may use every core (DP_CPU_THREADS may cap them).
  const int all = threads(), half = std::max(1, all / 2), quarter = std::max(1, all / 4);
  const std::vector<dp::Device> two{dp::cpu(0), dp::cpu(1)};
  auto old_model = std::make_unique<dp::DataParallel>(make_mlp(1), two);
  CHECK(threads() == half);
  auto resumed = std::make_unique<dp::DataParallel>(make_mlp(2), two);
  old_model.reset();
  CHECK(threads() == half);
  {
    dp::DataParallel wide(make_mlp(3), {dp::cpu(0), dp::cpu(1), dp::cpu(2), dp::cpu(3)});
    CHECK(threads() == quarter);
  }
  CHECK(threads() == half);
  Batch b = make_batch(4, 1);
  CHECK((*resumed)(b.x).size(0) == 4);
  resumed.reset();
  CHECK(threads() == all);  // no wrapper: one device may use every core
  // A wrapper refused at construction leaves the count as it was.
  CHECK_THROWS_AS(dp::DataParallel(std::make_shared<dp::nn::Sequential>(), two), dp::Error);
  CHECK(threads() == all);
  CHECK_THROWS_AS(be.release_concurrent_devices(2), dp::Error);  // none held
  CHECK_THROWS_AS(be.hold_concurrent_devices(0), dp::Error);
}

TEST_CASE("a user's post-accumulate hook on a parameter outlives a DDP wrapper, whose own hooks go with it") {
  auto net = make_mlp(4);
  const Tensor p = net->parameters()[0];
  int calls = 0;
  dp::autograd::add_post_accumulate_hook(p, [&calls](const Tensor&) { ++calls; });
  Batch b = make_batch(4, 2);
  {
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = dp::Mode::DDP});
    loss_fn(model(b.x), b.y).backward();
    CHECK(calls == 1);  // device 0's accumulation, as PyTorch's DDP runs a user's hook
  }
  // The reducer is gone and so are its hooks; the user's fires on the plain module.
  loss_fn(net->forward(b.x), b.y).backward();
  CHECK(calls == 2);
}

TEST_CASE("a module whose parameters another DataParallel trains is refused before anything moves") {
  // A child wrapped first, then its parent: the parent was moved to its first device and
  // flattened again before any check, so the child's wrapper found its parameters on
  // another device (a confusing error at its next forward) or rebound under its replicas.
  auto child = std::make_shared<dp::nn::Linear>(6, 6);
  auto parent = std::make_shared<dp::nn::Sequential>();
  parent->push_back(child);
  parent->push_back(std::make_shared<dp::nn::Linear>(6, 3));
  dp::DataParallel inner(child, {dp::cpu(2), dp::cpu(3)}, {.mode = dp::Mode::DDP});
  dp::optim::SGD opt(inner.parameters(), {.lr = 0.1});
  const Batch b = make_batch(4, 1);
  const Tensor x = b.x.to(dp::cpu(2));
  const std::vector<float> before = inner(x).to_vector();
  CHECK_THROWS_WITH_AS(dp::DataParallel(parent, {dp::cpu(0), dp::cpu(1)}),
                       doctest::Contains("parameter 'weight' is already trained by another DataParallel"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::DataParallel(child, {dp::cpu(0), dp::cpu(1)}), doctest::Contains("wrap a module once"),
                       dp::Error);
  // The first wrapper is untouched: same device, same outputs, and it still trains.
  CHECK(child->parameters()[0].device() == dp::cpu(2));
  CHECK(inner(x).to_vector() == before);
  opt.zero_grad();
  inner(x).sum().backward();
  opt.step();
  CHECK_NOTHROW(inner.check_replicas());
  // The other way round: the parent wrapped first, then its child.
  auto child2 = std::make_shared<dp::nn::Linear>(6, 6);
  auto parent2 = std::make_shared<dp::nn::Sequential>();
  parent2->push_back(child2);
  dp::DataParallel outer(parent2, {dp::cpu(0), dp::cpu(1)});
  CHECK_THROWS_WITH_AS(dp::DataParallel(child2, {dp::cpu(2), dp::cpu(3)}), doctest::Contains("already trained"),
                       dp::Error);
  CHECK(outer(b.x).size(0) == 4);
}

TEST_CASE("DDP moves no parameters in steady state, but re-broadcasts after a load into device 0") {
  auto net = make_mlp(3);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = dp::Mode::DDP});
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  Batch b = make_batch(9, 4);
  auto step = [&] {
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    opt.step();
  };
  step();
  model.reset_stats();
  for (int i = 0; i < 3; ++i) step();
  for (auto& d : model.stats().devices) CHECK(d[dp::parallel::Phase::Replicate] == 0.0);  // MLP: no buffers
  auto set = model.parameters().set();
  for (int r = 1; r < 3; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  // Loading new values into device 0 reaches every replica at the next forward.
  auto fresh = make_mlp(99);
  model.load_state_dict(fresh->state_dict());
  model(b.x);
  for (int r = 1; r < 3; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
  CHECK(model.stats().devices[1][dp::parallel::Phase::Replicate] > 0.0);
}

TEST_CASE("DP copies parameters to the replicas only when they changed") {
  auto net = make_mlp(3);
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)});
  Batch b = make_batch(8, 4);
  model(b.x);
  model.reset_stats();
  model(b.x);  // nothing changed: no copy
  CHECK(model.stats().devices[1][dp::parallel::Phase::Replicate] == 0.0);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  opt.zero_grad();
  model.forward_backward(b.x, b.y, loss_fn);
  opt.step();
  model(b.x);  // stepped: copied
  CHECK(model.stats().devices[1][dp::parallel::Phase::Replicate] > 0.0);
  CHECK(dp::equal(model.parameters().set()->copy(1).data.to(dp::cpu(0)), model.parameters().set()->copy(0).data));
}

TEST_CASE("backward after the DataParallel is gone is a clear error, not a crash") {
  auto net = make_mlp(3);
  Batch b = make_batch(4, 1);
  Tensor loss;
  {
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)});
    loss = loss_fn(model(b.x), b.y);
  }
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("destroyed"), dp::Error);
}

TEST_CASE("gradients flow back through scatter to the input, as on one device") {
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    auto net = make_mlp(6), ref_net = make_mlp(6);
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
    Batch b = make_batch(7, 2);
    Tensor x = b.x.clone().set_requires_grad(true);
    Tensor x_ref = b.x.clone().set_requires_grad(true);
    loss_fn(model(dp::mul(x, 2.0)), b.y).backward();  // x is an interior node's input
    loss_fn(ref_net->forward(dp::mul(x_ref, 2.0)), b.y).backward();
    REQUIRE(x.grad().defined());
    CHECK(dp::max_abs_diff(x.grad(), x_ref.grad()) < 1e-6);
  }
}

namespace {
// Uses its second head only when asked: DDP must not wait for its gradients.
struct TwoHeads : dp::nn::Module {
  TwoHeads() {
    dp::Generator gen(12);
    a = register_module("a", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
    b = register_module("b", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override { return use_b ? b->forward(x) : a->forward(x); }
  bool use_b = false;
  std::shared_ptr<dp::nn::Linear> a, b;
};
}  // namespace

TEST_CASE("DDP: parameters that get no gradient never block a bucket and stay consistent") {
  auto net = std::make_shared<TwoHeads>(), ref = std::make_shared<TwoHeads>();
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)},
                         {.mode = dp::Mode::DDP, .bucket_cap_mb = 1e-5, .first_bucket_mb = 1e-5});
  REQUIRE(model.buckets().size() >= 2);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1, .momentum = 0.9});
  dp::optim::SGD ref_opt(ref->parameters(), {.lr = 0.1, .momentum = 0.9});
  Batch b = make_batch(9, 5);
  auto run = std::async(std::launch::async, [&] {
    for (int s = 0; s < 4; ++s) {
      net->use_b = ref->use_b = (s % 2 == 1);
      opt.zero_grad();
      ref_opt.zero_grad();
      model.forward_backward(b.x, b.y, loss_fn);
      loss_fn(ref->forward(b.x), b.y).backward();
      opt.step();
      ref_opt.step();
    }
  });
  REQUIRE(run.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
  run.get();
  auto set = model.parameters().set();
  CHECK(dp::max_abs_diff(set->copy(0).data, ref->parameters().set()->copy(0).data) < 1e-6);
  for (int r = 1; r < 3; ++r) CHECK(dp::equal(set->copy(r).data.to(dp::cpu(0)), set->copy(0).data));
}

TEST_CASE("each shard goes from host memory straight to its device, pinned or not") {
  // Devices cpu(1..3) with the batch in host memory: no device may ever hold more than
  // its own shard of the input. A scatter that first moved the whole batch to the
  // first device (a hop through device 0) would show the full batch in its peak.
  for (bool pinned : {false, true}) {
    for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
      CAPTURE(pinned);
      CAPTURE(static_cast<int>(mode));
      dp::Generator gen(5);
      auto net = std::make_shared<dp::nn::Sequential>();
      net->push_back(std::make_shared<dp::nn::Flatten>());
      net->push_back(std::make_shared<dp::nn::Linear>(4096, 2, true, &gen));
      std::vector<dp::Device> devs{dp::cpu(1), dp::cpu(2), dp::cpu(3)};
      dp::DataParallel model(net, devs, {.mode = mode});
      const std::int64_t rows = 96;  // 32 rows (512 KiB) per device
      Tensor x = dp::randn({rows, 4096}, gen, dp::cpu(0));
      Tensor y = dp::zeros({rows}, dp::TensorOptions{dp::Dtype::Int64, dp::cpu(0)});
      if (pinned) {
        x = x.pin_memory();
        y = y.pin_memory();
      }
      const std::size_t shard_bytes = static_cast<std::size_t>(rows / 3) * 4096 * sizeof(float);
      model.forward_backward(x, y, loss_fn);  // first step: replicas, buffers, caches
      for (const dp::Device& d : devs) dp::reset_peak_memory(d);
      std::vector<std::size_t> base;
      for (const dp::Device& d : devs) base.push_back(dp::memory_allocated(d));
      model.forward_backward(x, y, loss_fn);
      for (std::size_t r = 0; r < devs.size(); ++r) {
        CAPTURE(r);
        const std::size_t peak = dp::max_memory_allocated(devs[r]) - base[r];
        CHECK(peak >= shard_bytes);      // the shard was copied to this device...
        CHECK(peak < 2 * shard_bytes);   // ...and nothing like the whole batch was
      }
      if (pinned) {
        CHECK(x.is_pinned());  // the scatter read the pinned batch in place
      }
    }
  }
}

namespace {

// SGD with momentum whose update on an armed device does half its range, then throws
// once: a failure that leaves that replica's parameters AND state half stepped.
class FlakyMomentum final : public dp::optim::Optimizer {
 public:
  explicit FlakyMomentum(dp::nn::ParameterList params)
      : Optimizer(std::move(params), "FlakyMomentum") {}
  double lr() const override { return 0.05; }
  void set_lr(double) override {}
  std::atomic<int> fail_device{-1};

 protected:
  std::vector<std::string> state_names() const override { return {"momentum_buffer"}; }
  void update(dp::Device dev, float* p, const float* g, float* const* state, std::int64_t n, bool,
              std::int64_t) override {
    float* buf = state[0];
    auto one = [&](std::int64_t i) {
      buf[i] = 0.9f * buf[i] + g[i];
      p[i] -= 0.05f * buf[i];
    };
    const std::int64_t half = n / 2;
    for (std::int64_t i = 0; i < half; ++i) one(i);
    int armed = dev.index;
    if (fail_device.compare_exchange_strong(armed, -1)) throw dp::Error("injected");
    for (std::int64_t i = half; i < n; ++i) one(i);
  }
};

}  // namespace

TEST_CASE("after a failed optimizer step every DDP replica continues with device 0's state") {
  // The failing replica's momentum is half stepped, the others' fully: unless every
  // replica takes device 0's optimizer state with its parameters, the replicas apply
  // different updates from then on and drift apart.
  for (int failing : {0, 1, 2}) {
    CAPTURE(failing);
    auto net = make_mlp(7);
    dp::DataParallel model(net, std::vector<dp::Device>{dp::cpu(0), dp::cpu(1), dp::cpu(2)},
                           {.mode = dp::Mode::DDP});
    FlakyMomentum opt(model.parameters());
    const auto set = model.parameters().set();
    for (int s = 0; s < 6; ++s) {
      Batch b = make_batch(12, 300 + static_cast<std::uint64_t>(s));
      opt.zero_grad();
      model.forward_backward(b.x, b.y, loss_fn);
      if (s == 2) {
        opt.fail_device = failing;
        CHECK_THROWS_WITH(opt.step(), doctest::Contains("injected"));
      } else {
        opt.step();
      }
    }
    const std::vector<float> primary = set->copy(0).data.to_vector();
    for (int r = 1; r < 3; ++r) {
      CAPTURE(r);
      CHECK(set->copy(r).data.to_vector() == primary);
    }
  }
}

TEST_CASE("the root cause reaches the caller with its device, the original exception nested") {
  // In DDP the healthy ranks are blocked in an all-reduce when cpu:2 throws in its
  // forward; they are released with dp::CollectiveAborted, which must not be what
  // the caller sees. A plain dp::Error comes back naming its device, the original
  // nested (Note [Errors keep their type]; tests/parallel/error_type_test.cpp has the
  // other types).
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    auto net = std::make_shared<Faulty>(2);
    dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1), dp::cpu(2)}, {.mode = mode});
    Batch b = make_batch(9, 11);
    net->armed = true;
    bool caught = false;
    try {
      model.forward_backward(b.x, b.y, loss_fn);
    } catch (const dp::Error& e) {
      caught = true;
      CHECK(std::string(e.what()) == "worker on cpu:2: injected failure");
      CHECK(dp::failed_device() == dp::cpu(2));
      try {
        std::rethrow_if_nested(e);
        FAIL("the original exception is not nested");
      } catch (const dp::CollectiveAborted&) {
        FAIL("the nested exception should be the module's own, not an abort");
      } catch (const dp::Error& original) {
        CHECK(std::string(original.what()) == "injected failure");
      }
    }
    CHECK(caught);
  }
}

TEST_CASE("a step started from inside a worker is an error, not a deadlock") {
  struct Reentrant : dp::nn::Module {
    Reentrant() {
      dp::Generator gen(3);
      fc = register_module("fc", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
    }
    Tensor forward(const Tensor& x) override {
      if (outer && dp::nn::ReplicaBinding::current() == 1) (*outer)(x);
      return fc->forward(x);
    }
    dp::DataParallel* outer = nullptr;
    std::shared_ptr<dp::nn::Linear> fc;
  };
  auto net = std::make_shared<Reentrant>();
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)});
  net->outer = &model;
  Batch b = make_batch(4, 5);
  auto fut = std::async(std::launch::async, [&] {
    CHECK_THROWS_WITH_AS(model(b.x), doctest::Contains("while another step runs"), dp::Error);
  });
  REQUIRE(fut.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  fut.get();
  net->outer = nullptr;
  CHECK(model(b.x).size(0) == 4);  // usable again
}

TEST_CASE("zero_grad of a small model zeroes every copy on the calling thread; a large one on the workers") {
  // Note [Small work inline].
  for (const bool small : {true, false}) {
    CAPTURE(small);
    dp::Generator gen(4);
    auto net = std::make_shared<dp::nn::Sequential>();
    const std::int64_t width = small ? 8 : 2048;  // 83 parameters (332 B a copy); 20,483 (80 KiB a copy)
    net->push_back(std::make_shared<dp::nn::Linear>(6, width, true, &gen));
    net->push_back(std::make_shared<dp::nn::ReLU>());
    net->push_back(std::make_shared<dp::nn::Linear>(width, 3, true, &gen));
    for (dp::Mode mode : {dp::Mode::DDP, dp::Mode::Sharded}) {
      CAPTURE(static_cast<int>(mode));
      dp::DataParallel model(net, cpus(3), {.mode = mode});
      dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
      Batch b = make_batch(6, 2);
      model.forward_backward(b.x, b.y, loss_fn);
      auto set = net->parameters().set();
      bool any_nonzero = false;
      for (int r = 0; r < 3; ++r)
        for (float g : dp::nn::copy_span(*set, r).owned_grad().to_vector()) any_nonzero |= g != 0.0f;
      REQUIRE(any_nonzero);
      model.reset_stats();
      opt.zero_grad();
      const std::int64_t handoffs = model.stats().handoffs;
      CAPTURE(handoffs);
      CHECK((handoffs == 0) == small);
      for (int r = 0; r < 3; ++r)
        for (float g : dp::nn::copy_span(*set, r).owned_grad().to_vector()) CHECK(g == 0.0f);
      // The step after it is the usual one: gradients the same as a fresh model's.
      opt.step();
      model.forward_backward(b.x, b.y, loss_fn);
    }
  }
}

TEST_CASE("zero_grad from inside a worker is an error, also for a small model") {
  struct ZeroesInForward : dp::nn::Module {
    ZeroesInForward() {
      dp::Generator gen(3);
      fc = register_module("fc", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
    }
    Tensor forward(const Tensor& x) override {
      if (opt && dp::nn::ReplicaBinding::current() == 1) opt->zero_grad();
      return fc->forward(x);
    }
    dp::optim::SGD* opt = nullptr;
    std::shared_ptr<dp::nn::Linear> fc;
  };
  auto net = std::make_shared<ZeroesInForward>();
  dp::DataParallel model(net, {dp::cpu(0), dp::cpu(1)}, {.mode = dp::Mode::DDP});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  net->opt = &opt;
  Batch b = make_batch(4, 5);
  CHECK_THROWS_WITH_AS(model(b.x), doctest::Contains("while another step runs"), dp::Error);
  net->opt = nullptr;
  CHECK(model(b.x).size(0) == 4);  // usable again
}
