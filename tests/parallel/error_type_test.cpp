// Errors keep their type (Note [Errors keep their type] in dp/parallel/data_parallel.h):
// an exception thrown on one worker reaches the caller as itself, dp::failed_device()
// names the device, and the DataParallel trains on as if the step had not happened.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/autograd/node.h"
#include "dp/dp.h"
#include "parallel/worker_pool.h"

namespace {

using dp::Tensor;

struct MyError : std::runtime_error {
  MyError(const std::string& what, int code) : std::runtime_error(what), code(code) {}
  int code;
};

/// A user type derived from dp::Error: it must not come back as a plain dp::Error.
struct MyDpError : dp::Error {
  using dp::Error::Error;
};

enum class Kind { MyError, BadAlloc, Int, MyDpError, PlainDpError };
enum class Where { Forward, Backward };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::MyError: return "MyError";
    case Kind::BadAlloc: return "std::bad_alloc";
    case Kind::Int: return "int";
    case Kind::MyDpError: return "MyDpError";
    case Kind::PlainDpError: return "dp::Error";
  }
  return "?";
}

[[noreturn]] void throw_kind(Kind k) {
  switch (k) {
    case Kind::MyError: throw MyError("my failure", 7);
    case Kind::BadAlloc: throw std::bad_alloc();
    case Kind::Int: throw 42;
    case Kind::MyDpError: throw MyDpError("my dp failure");
    case Kind::PlainDpError: throw dp::Error("plain dp failure");
  }
  throw 0;
}

/// Linear(6, 3) that throws once, on copy 1 only, in its forward or in its backward.
struct Thrower : dp::nn::Module {
  explicit Thrower(std::uint64_t seed) {
    dp::Generator gen(seed);
    fc = register_module("fc", std::make_shared<dp::nn::Linear>(6, 3, true, &gen));
  }
  Tensor forward(const Tensor& x) override {
    const int copy = dp::nn::ReplicaBinding::current();
    if (armed && where == Where::Forward && copy == 1) {
      armed = false;
      throw_kind(kind);
    }
    Tensor y = fc->forward(x);
    if (!(armed && where == Where::Backward && copy == 1)) return y;
    armed = false;  // the backward node below throws once
    Tensor out = y.detach().clone();
    dp::autograd::record("ThrowerBackward", {y}, out, {}, [k = kind](const std::vector<Tensor>&) -> std::vector<Tensor> {
      throw_kind(k);
    });
    return out;
  }
  std::atomic<bool> armed{false};
  Kind kind = Kind::MyError;
  Where where = Where::Forward;
  std::shared_ptr<dp::nn::Linear> fc;
};

Tensor loss_fn(const Tensor& out, const Tensor& y) { return dp::nn::cross_entropy(out, y); }

struct Setup {
  const char* name;
  dp::DataParallelOptions opts;
};

std::vector<Setup> setups() {
  return {{"DP", {.mode = dp::Mode::DP}},
          {"DDP", {.mode = dp::Mode::DDP}},
          {"Sharded stage 1", {.mode = dp::Mode::Sharded, .shard_stage = 1}},
          {"Sharded stage 3", {.mode = dp::Mode::Sharded, .shard_stage = 3}}};
}

const std::vector<dp::Device> kDevices = {dp::cpu(0), dp::cpu(1), dp::cpu(2)};

struct Batch {
  Tensor x, y;
};

Batch batch() {
  dp::Generator gen(5);
  return {dp::randn({9, 6}, gen, dp::cpu(0)), dp::randint(0, 3, {9}, gen, dp::cpu(0))};
}

/// One step through `how` ("model(x)", "backward()" or "forward_backward").
Tensor step(dp::DataParallel& model, const Batch& b, const std::string& how) {
  if (how == "forward_backward") return model.forward_backward(b.x, b.y, loss_fn);
  Tensor loss = loss_fn(model(b.x), b.y);
  loss.backward();
  return loss;
}

/// What a failed step let the caller see.
struct Caught {
  std::string type;  // which handler fired
  std::string what;
  std::optional<dp::Device> device;  // dp::failed_device() inside the handler
  int code = 0;
  std::exception_ptr error;
};

/// Runs fn, bounded in time (a hang fails the test instead of blocking it), and says
/// which handler caught what it threw.
Caught catch_from(const std::function<void()>& fn) {
  auto fut = std::async(std::launch::async, [&]() -> Caught {
    Caught c;
    try {
      fn();
      c.type = "nothing";
    } catch (const MyError& e) {
      c = {"MyError", e.what(), dp::failed_device(), e.code, std::current_exception()};
    } catch (const MyDpError& e) {
      c = {"MyDpError", e.what(), dp::failed_device(), 0, std::current_exception()};
    } catch (const dp::Error& e) {
      c = {"dp::Error", e.what(), dp::failed_device(), 0, std::current_exception()};
    } catch (const std::bad_alloc& e) {
      c = {"std::bad_alloc", e.what(), dp::failed_device(), 0, std::current_exception()};
    } catch (int v) {
      c = {"int", std::to_string(v), dp::failed_device(), v, std::current_exception()};
    } catch (...) {
      c = {"...", "", dp::failed_device(), 0, std::current_exception()};
    }
    return c;
  });
  REQUIRE(fut.wait_for(std::chrono::seconds(60)) == std::future_status::ready);
  return fut.get();
}

}  // namespace

TEST_CASE("a worker's exception reaches the caller with its own type, in every mode and every path") {
  const Batch b = batch();
  for (const Setup& s : setups()) {
    for (Where where : {Where::Forward, Where::Backward}) {
      for (const char* how : {"model(x)", "backward()", "forward_backward"}) {
        // model(x) alone runs no backward: a failure in backward is for the other two.
        if (where == Where::Backward && std::string(how) == "model(x)") continue;
        for (Kind kind : {Kind::MyError, Kind::BadAlloc, Kind::Int, Kind::MyDpError, Kind::PlainDpError}) {
          const std::string label = std::string(s.name) + ", " + how + ", " +
                                    (where == Where::Forward ? "forward" : "backward") + ", " + kind_name(kind);
          CAPTURE(label);
          auto net = std::make_shared<Thrower>(3);
          auto ref_net = std::make_shared<Thrower>(3);
          dp::DataParallel model(net, kDevices, s.opts);
          dp::DataParallel ref(ref_net, kDevices, s.opts);
          dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
          dp::optim::SGD ref_opt(ref.parameters(), {.lr = 0.1});
          net->kind = kind;
          net->where = where;
          net->armed = true;
          const Caught c = catch_from([&] {
            if (std::string(how) == "model(x)")
              model(b.x);
            else
              step(model, b, how);
          });
          CHECK(c.type == kind_name(kind));
          REQUIRE(c.device.has_value());
          CHECK(*c.device == dp::cpu(1));
          CHECK(dp::failed_device(c.error) == dp::cpu(1));
          switch (kind) {
            case Kind::MyError: CHECK(c.what == "my failure"); CHECK(c.code == 7); break;
            case Kind::Int: CHECK(c.code == 42); break;
            case Kind::MyDpError: CHECK(c.what == "my dp failure"); break;
            case Kind::PlainDpError: CHECK(c.what == "worker on cpu:1: plain dp failure"); break;
            case Kind::BadAlloc: break;
          }
          // Usable after: the next step gives what a model that never failed gives.
          opt.zero_grad();
          ref_opt.zero_grad();
          Tensor loss = step(model, b, "forward_backward");
          Tensor ref_loss = step(ref, b, "forward_backward");
          CHECK(loss.item<float>() == ref_loss.item<float>());
          opt.step();
          ref_opt.step();
          const dp::nn::StateDict got = model.state_dict(), want = ref.state_dict();
          REQUIRE(got.size() == want.size());
          for (std::size_t i = 0; i < got.size(); ++i) CHECK(dp::equal(got[i].second, want[i].second));
        }
      }
    }
  }
}

namespace {

/// SGD whose update throws MyError once on cpu:1 when armed: a failing optimizer step.
class ThrowingSgd final : public dp::optim::Optimizer {
 public:
  explicit ThrowingSgd(dp::nn::ParameterList params) : Optimizer(std::move(params), "ThrowingSgd") {}
  double lr() const override { return 0.1; }
  void set_lr(double) override {}
  std::atomic<bool> armed{false};

 protected:
  std::vector<std::string> state_names() const override { return {}; }
  void update(dp::Device dev, float* p, const float* g, float* const*, std::int64_t n, bool, std::int64_t) override {
    if (dev.index == 1 && armed.exchange(false)) throw MyError("optimizer failure", 9);
    for (std::int64_t i = 0; i < n; ++i) p[i] -= 0.1f * g[i];
  }
};

}  // namespace

TEST_CASE("an optimizer step that throws on one device's copy: the caller gets the type, the next step runs") {
  // DDP and Sharded step every device's copy on its worker (DP steps device 0 only).
  const Batch b = batch();
  for (const Setup& s : setups()) {
    if (s.opts.mode == dp::Mode::DP) continue;
    CAPTURE(std::string(s.name));
    auto net = std::make_shared<Thrower>(3);
    dp::DataParallel model(net, kDevices, s.opts);
    ThrowingSgd opt(model.parameters());
    opt.zero_grad();
    model.forward_backward(b.x, b.y, loss_fn);
    opt.armed = true;
    const Caught c = catch_from([&] { opt.step(); });
    CHECK(c.type == "MyError");
    CHECK(c.code == 9);
    CHECK(c.device == dp::cpu(1));
    opt.zero_grad();
    Tensor loss = model.forward_backward(b.x, b.y, loss_fn);
    CHECK_NOTHROW(opt.step());
    CHECK(std::isfinite(loss.item<float>()));
  }
}

TEST_CASE("a plain dp::Error names the device in its message and keeps the original nested") {
  auto net = std::make_shared<Thrower>(3);
  dp::DataParallel model(net, kDevices, {.mode = dp::Mode::DDP});
  net->kind = Kind::PlainDpError;
  net->armed = true;
  const Batch b = batch();
  bool nested = false;
  try {
    model.forward_backward(b.x, b.y, loss_fn);
  } catch (const dp::Error& e) {
    CHECK(std::string(e.what()) == "worker on cpu:1: plain dp failure");
    try {
      std::rethrow_if_nested(e);
    } catch (const dp::Error& original) {
      nested = std::string(original.what()) == "plain dp failure";
    }
  }
  CHECK(nested);
}

TEST_CASE("failed_device says nothing for exceptions that did not come from a worker") {
  CHECK_FALSE(dp::failed_device().has_value());  // outside a handler
  CHECK_FALSE(dp::failed_device(nullptr).has_value());
  try {
    throw MyError("not from a worker", 1);
  } catch (const MyError&) {
    CHECK_FALSE(dp::failed_device().has_value());
    CHECK_FALSE(dp::failed_device(std::current_exception()).has_value());
  }
}

TEST_CASE("the root cause wins over the ranks an abort released, and keeps its type") {
  // Ranks 0 and 2 fail only because rank 1 did (what a collective abort looks like);
  // the caller must get rank 1's own exception, typed, with rank 1's device.
  dp::parallel::WorkerPool pool(kDevices, "worker");
  const Caught c = catch_from([&] {
    pool.run([](int r) {
      if (r == 1) throw MyError("root", 3);
      throw dp::CollectiveAborted("collective aborted: cpu:1 failed", "cpu:1 failed");
    });
  });
  CHECK(c.type == "MyError");
  CHECK(c.what == "root");
  CHECK(c.device == dp::cpu(1));
  // Only aborts (from outside): the lowest aborted rank, as a CollectiveAborted.
  const Caught a = catch_from([&] {
    pool.run([](int r) {
      if (r > 0) throw dp::CollectiveAborted("collective aborted: from outside", "from outside");
    });
  });
  CHECK(a.type == "dp::Error");
  CHECK(a.what == "collective aborted: from outside");
  CHECK(a.device == dp::cpu(1));
  bool typed = false;
  try {
    std::rethrow_exception(a.error);
  } catch (const dp::CollectiveAborted& e) {
    typed = e.reason() == "from outside";
  } catch (...) {
  }
  CHECK(typed);
}
