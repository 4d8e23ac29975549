// Tests for the per-thread grad mode (src/autograd/grad_mode.cpp) and its effect on
// recording.
#include <doctest/doctest.h>

#include <atomic>
#include <latch>
#include <thread>
#include <vector>

#include "dp/autograd/grad_mode.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

namespace {

dp::Tensor leaf(std::vector<float> v, dp::Device dev = dp::cpu(0)) {
  dp::Tensor t = dp::from_vector(v, {static_cast<std::int64_t>(v.size())}, dev);
  t.set_requires_grad(true);
  return t;
}

}  // namespace

TEST_CASE("no_grad records nothing and restores the previous mode") {
  dp::Tensor x = leaf({1, 2});
  CHECK(dp::is_grad_enabled());
  {
    dp::NoGradGuard no_grad;
    CHECK_FALSE(dp::is_grad_enabled());
    dp::Tensor y = dp::exp(x * 2.0 + x);
    CHECK_FALSE(y.requires_grad());
    CHECK(y.grad_fn() == nullptr);
    CHECK(y.is_leaf());
    CHECK_FALSE(dp::matmul(x.reshape({1, 2}), x.reshape({2, 1})).requires_grad());
    CHECK_FALSE(dp::cat({x, x}).requires_grad());
    CHECK_FALSE(x.to(dp::cpu(1)).requires_grad());
    CHECK_FALSE(x.narrow(0, 0, 1).requires_grad());
    CHECK_THROWS_AS(dp::sum(y).backward(), dp::Error);  // nothing to run backward through
    {
      dp::GradModeGuard enable(true);
      CHECK(dp::is_grad_enabled());
      CHECK((x * 2.0).requires_grad());
      {
        dp::NoGradGuard nested;
        CHECK_FALSE(dp::is_grad_enabled());
      }
      CHECK(dp::is_grad_enabled());
    }
    CHECK_FALSE(dp::is_grad_enabled());
  }
  CHECK(dp::is_grad_enabled());
  CHECK((x * 2.0).requires_grad());
  {
    dp::GradModeGuard off(false);
    CHECK_FALSE((x * 2.0).requires_grad());
  }
  dp::set_grad_enabled(false);
  CHECK_FALSE(dp::is_grad_enabled());
  dp::set_grad_enabled(true);
  CHECK(dp::is_grad_enabled());
  CHECK_FALSE(x.grad().defined());  // nothing above ran backward into x
}

TEST_CASE("backward itself is not recorded and leaves grad mode on") {
  dp::Tensor x = leaf({1, 2});
  dp::sum(dp::square(x)).backward();
  CHECK(dp::is_grad_enabled());
  CHECK_FALSE(x.grad().requires_grad());
  CHECK(x.grad().grad_fn() == nullptr);
}

TEST_CASE("grad mode is per thread: one thread's no_grad does not affect another") {
  // Thread A turns grad mode off and holds it off while thread B records a graph and runs
  // backward; then the roles swap. The latches make the two phases overlap for certain.
  for (int round = 0; round < 20; ++round) {
    std::latch a_disabled(2), b_done(2);
    std::atomic<bool> a_saw_off{false}, b_recorded{false}, a_recorded{true};
    std::thread a([&] {
      dp::NoGradGuard no_grad;
      a_saw_off = !dp::is_grad_enabled();
      a_disabled.arrive_and_wait();
      dp::Tensor x = leaf({1, 2}, dp::cpu(1));
      a_recorded = (x * 3.0).requires_grad();
      b_done.arrive_and_wait();
    });
    std::thread b([&] {
      a_disabled.arrive_and_wait();  // A is inside its no_grad scope now
      CHECK(dp::is_grad_enabled());
      dp::Tensor x = leaf({1, 2}, dp::cpu(2));
      dp::Tensor y = dp::sum(x * 3.0);
      b_recorded = y.requires_grad();
      y.backward();
      CHECK(x.grad().to_vector() == std::vector<float>{3, 3});
      b_done.arrive_and_wait();
    });
    a.join();
    b.join();
    CHECK(a_saw_off);
    CHECK(b_recorded);
    CHECK_FALSE(a_recorded);
  }
  CHECK(dp::is_grad_enabled());  // the main thread was never affected
}

TEST_CASE("a new thread starts with grad mode on, whatever its parent's mode") {
  dp::NoGradGuard no_grad;
  bool enabled_in_child = false;
  std::thread t([&] { enabled_in_child = dp::is_grad_enabled(); });
  t.join();
  CHECK(enabled_in_child);
  CHECK_FALSE(dp::is_grad_enabled());
}

TEST_CASE("concurrent backwards on separate graphs and devices give independent gradients") {
  // What DataParallel does: one worker per device, each with its own graph.
  constexpr int kWorkers = 4;
  std::vector<dp::Tensor> xs;
  for (int i = 0; i < kWorkers; ++i) xs.push_back(leaf({1, 2, 3}, dp::cpu(i)));
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 50; ++rep) dp::sum(xs[i] * static_cast<double>(i + 1)).backward();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kWorkers; ++i) {
    CAPTURE(i);
    float want = 50.0f * static_cast<float>(i + 1);
    CHECK(xs[i].grad().to_vector() == std::vector<float>{want, want, want});
  }
}
