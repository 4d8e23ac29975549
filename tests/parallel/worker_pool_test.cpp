// WorkerPool alone: one persistent thread per device, failures by type, no hang.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include "dp/core/error.h"
#include "dp/parallel/data_parallel.h"
#include "parallel/worker_pool.h"
#include "mlp_fixture.h"

namespace {

using dp::parallel::WorkerPool;

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs pool.run(fn) and returns what it threw (null if nothing).
std::exception_ptr run_catching(WorkerPool& pool, const std::function<void(int)>& fn,
                                const dp::parallel::ErrorHook& hook = nullptr) {
  try {
    pool.run(fn, hook);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace

TEST_CASE("every rank runs once per run, on its own persistent thread") {
  WorkerPool pool(cpus(3));
  CHECK(pool.size() == 3);
  std::vector<std::thread::id> first(3), second(3);
  pool.run([&](int r) { first[r] = std::this_thread::get_id(); });
  pool.run([&](int r) { second[r] = std::this_thread::get_id(); });
  std::set<std::thread::id> distinct(first.begin(), first.end());
  CHECK(distinct.size() == 3);
  CHECK(distinct.count(std::this_thread::get_id()) == 0);
  CHECK(first == second);
}

TEST_CASE("run returns only once every rank has finished") {
  WorkerPool pool(cpus(2));
  std::atomic<int> finished{0};
  pool.run([&](int r) {
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    finished.fetch_add(1);
  });
  CHECK(finished.load() == 2);
}

TEST_CASE("a dp::Error names the device and keeps the original nested; other types come back as thrown") {
  WorkerPool pool(cpus(3), "worker");
  auto err = run_catching(pool, [](int r) {
    if (r == 1) throw dp::Error("boom");
  });
  REQUIRE(err);
  CHECK(dp::failed_device(err) == dp::cpu(1));
  try {
    std::rethrow_exception(err);
  } catch (const dp::Error& e) {
    CHECK(std::string(e.what()) == "worker on cpu:1: boom");
    CHECK_THROWS_WITH_AS(std::rethrow_if_nested(e), "boom", dp::Error);
  }
  // Note [Errors keep their type]: a user type is rethrown as the object thrown.
  auto user = run_catching(pool, [](int r) {
    if (r == 2) throw UserError("user boom");
  });
  CHECK_THROWS_WITH_AS(std::rethrow_exception(user), "user boom", UserError);
  CHECK(dp::failed_device(user) == dp::cpu(2));
  // The pool is usable again.
  std::atomic<int> ran{0};
  pool.run([&](int) { ran.fetch_add(1); });
  CHECK(ran.load() == 3);
}

TEST_CASE("the root cause wins over ranks released by an aborted collective") {
  WorkerPool pool(cpus(3), "worker");
  SUBCASE("a real failure on a higher rank") {
    auto err = run_catching(pool, [](int r) {
      if (r == 0) throw dp::CollectiveAborted("collective aborted: cpu:2 failed", "cpu:2 failed");
      if (r == 2) throw UserError("out of shapes");
    });
    CHECK_THROWS_WITH_AS(std::rethrow_exception(err), "out of shapes", UserError);
    CHECK(dp::failed_device(err) == dp::cpu(2));
  }
  SUBCASE("only aborts: the lowest aborted rank, as its own dp::CollectiveAborted") {
    auto err = run_catching(pool, [](int r) {
      if (r > 0) throw dp::CollectiveAborted("collective aborted: from outside", "from outside");
    });
    CHECK_THROWS_WITH_AS(std::rethrow_exception(err), "collective aborted: from outside", dp::CollectiveAborted);
    CHECK(dp::failed_device(err) == dp::cpu(1));
  }
  SUBCASE("the lowest of several real failures") {
    auto err = run_catching(pool, [](int r) {
      if (r >= 1) throw dp::Error("rank " + std::to_string(r));
    });
    CHECK_THROWS_WITH_AS(std::rethrow_exception(err), "worker on cpu:1: rank 1", dp::Error);
  }
}

TEST_CASE("the error hook runs on the failing thread before the other ranks finish") {
  // Rank 0 waits until the hook has run; without the hook it would wait forever, so
  // the wait is bounded and checked.
  WorkerPool pool(cpus(2));
  std::promise<void> hooked;
  auto hooked_future = hooked.get_future().share();
  std::atomic<bool> rank0_released{false};
  std::thread::id hook_thread, failing_thread;
  auto err = run_catching(
      pool,
      [&](int r) {
        if (r == 1) {
          failing_thread = std::this_thread::get_id();
          throw UserError("first");
        }
        rank0_released = hooked_future.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
      },
      [&](int r, const std::exception_ptr& e) {
        CHECK(r == 1);
        CHECK(dp::parallel::describe(e) == "first");
        hook_thread = std::this_thread::get_id();
        hooked.set_value();
      });
  CHECK(err);
  CHECK(rank0_released.load());
  CHECK(hook_thread == failing_thread);
}

TEST_CASE("launch and wait collect each rank's outcome") {
  WorkerPool pool(cpus(3), "comm");
  pool.launch([](int r) {
    if (r == 2) throw 42;  // not a std::exception
  });
  CHECK_FALSE(pool.wait(0));
  CHECK_FALSE(pool.wait(1));
  auto e2 = pool.wait(2);
  REQUIRE(e2);
  CHECK(dp::parallel::describe(e2) == "unknown exception");
  CHECK_FALSE(dp::parallel::is_collective_aborted(e2));
  // A second wait on a collected rank returns at once with nothing.
  CHECK_FALSE(pool.wait(2));
  auto err = run_catching(pool, [](int r) {
    if (r == 0) throw 7;
  });
  CHECK_THROWS_AS(std::rethrow_exception(err), int);  // as thrown (Note [Errors keep their type])
  CHECK(dp::failed_device(err) == dp::cpu(0));
}

TEST_CASE("describe and is_collective_aborted read exception_ptrs") {
  CHECK(dp::parallel::describe(nullptr).empty());
  CHECK_FALSE(dp::parallel::is_collective_aborted(nullptr));
  auto aborted = std::make_exception_ptr(dp::CollectiveAborted("collective aborted: x", "x"));
  CHECK(dp::parallel::is_collective_aborted(aborted));
  CHECK(dp::parallel::describe(aborted) == "collective aborted: x");
  CHECK_FALSE(dp::parallel::is_collective_aborted(std::make_exception_ptr(dp::Error("plain"))));
}

TEST_CASE("an idle pool is destroyed promptly, a busy one after its task") {
  auto t0 = std::chrono::steady_clock::now();
  { WorkerPool pool(cpus(4)); }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  std::atomic<bool> done{false};
  {
    WorkerPool pool(cpus(2));
    pool.launch([&](int r) {
      if (r == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        done = true;
      }
    });
  }  // the destructor joins: the launched task has finished
  CHECK(done.load());
}

TEST_CASE("caller_runs_rank0: rank 0 runs on the calling thread and is no hand-over") {
  WorkerPool pool(cpus(3), "worker", /*caller_runs_rank0=*/true);
  std::vector<std::thread::id> ids(3);
  pool.run([&](int r) { ids[r] = std::this_thread::get_id(); });
  CHECK(ids[0] == std::this_thread::get_id());
  CHECK(ids[1] != ids[0]);
  CHECK(ids[2] != ids[0]);
  CHECK(ids[1] != ids[2]);
  CHECK(pool.handoffs() == 2);
  // A subset of ranks: only those run, only they are handed work.
  std::vector<int> ran(3, 0);
  pool.run([&](int r) { ran[r] += 1; }, nullptr, /*ranks=*/1);
  CHECK(ran == std::vector<int>{1, 0, 0});
  CHECK(pool.handoffs() == 2);
  pool.run([&](int r) { ran[r] += 1; }, nullptr, /*ranks=*/2);
  CHECK(ran == std::vector<int>{2, 1, 0});
  CHECK(pool.handoffs() == 3);
  // launch() needs a thread for every rank.
  CHECK_THROWS(pool.launch([](int) {}));
}

TEST_CASE("caller_runs_rank0: a failure on the caller's share releases the others and is reported") {
  WorkerPool pool(cpus(2), "worker", true);
  std::promise<void> hooked;
  auto hooked_future = hooked.get_future().share();
  std::atomic<bool> released{false};
  auto err = run_catching(
      pool,
      [&](int r) {
        if (r == 0) throw dp::Error("caller's share");
        released = hooked_future.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
      },
      [&](int r, const std::exception_ptr&) {
        CHECK(r == 0);
        hooked.set_value();
      });
  CHECK(released.load());
  CHECK_THROWS_WITH_AS(std::rethrow_exception(err), "worker on cpu:0: caller's share", dp::Error);
}

TEST_CASE("hand-overs are counted per task given to a thread") {
  WorkerPool pool(cpus(4), "comm");
  pool.run([](int) {});
  CHECK(pool.handoffs() == 4);
  pool.launch([](int) {});
  for (int r = 0; r < 4; ++r) pool.wait(r);
  CHECK(pool.handoffs() == 8);
}

TEST_CASE("many quick runs in a row: no lost wake-up, no hang") {
  for (bool inline0 : {false, true}) {
    WorkerPool pool(cpus(3), "worker", inline0);
    std::atomic<int> total{0};
    auto fut = std::async(std::launch::async, [&] {
      for (int i = 0; i < 20000; ++i) pool.run([&](int) { total.fetch_add(1, std::memory_order_relaxed); });
    });
    REQUIRE(fut.wait_for(std::chrono::seconds(120)) == std::future_status::ready);
    CHECK(total.load() == 60000);
  }
}
