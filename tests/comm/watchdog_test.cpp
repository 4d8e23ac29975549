// Tests of the collective watchdog's decisions (src/comm/nccl/watchdog.h) with a fake
// clock and fake probes: the logic that guards every NCCL collective, run on CPU.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/nccl/watchdog.h"

using dp::comm::detail::Watchdog;
using namespace std::chrono_literals;

namespace {

/// A communicator as the watchdog sees it: a clock the test moves, collectives the
/// test completes or fails, asynchronous errors the test raises, and a record of what
/// the watchdog did.
struct FakeComm {
  std::mutex mu;
  Watchdog::TimePoint now{};  // starts at the clock's epoch
  std::map<Watchdog::Token, Watchdog::Probe> state;  // absent: running
  std::map<int, std::string> async;                  // rank → error
  std::vector<std::pair<int, Watchdog::Token>> released;
  std::atomic<int> aborts{0};
  std::vector<int> aborted_ranks;
  Watchdog::Failure failure;

  Watchdog::Hooks hooks() {
    Watchdog::Hooks h;
    h.now = [this] {
      std::lock_guard<std::mutex> lock(mu);
      return now;
    };
    h.query = [this](int, Watchdog::Token t) {
      std::lock_guard<std::mutex> lock(mu);
      auto it = state.find(t);
      return it == state.end() ? Watchdog::Probe{} : it->second;
    };
    h.async_error = [this](int rank) {
      std::lock_guard<std::mutex> lock(mu);
      auto it = async.find(rank);
      return it == async.end() ? std::string() : it->second;
    };
    h.release = [this](int rank, Watchdog::Token t) {
      std::lock_guard<std::mutex> lock(mu);
      released.emplace_back(rank, t);
    };
    h.abort = [this](const std::vector<int>& ranks, const Watchdog::Failure& f) {
      std::lock_guard<std::mutex> lock(mu);
      aborted_ranks = ranks;
      failure = f;
      aborts.fetch_add(1);
    };
    return h;
  }
  void advance(std::chrono::milliseconds d) {
    std::lock_guard<std::mutex> lock(mu);
    now += d;
  }
  void complete(Watchdog::Token t) {
    std::lock_guard<std::mutex> lock(mu);
    state[t] = {Watchdog::Progress::Complete, {}};
  }
};

/// Distinct tokens, as CUDA events would be.
int slots[16];
Watchdog::Token token(int i) { return &slots[i]; }

/// Labels as the NCCL communicator writes them.
void add_ranks(Watchdog& dog, int n) {
  for (int r = 0; r < n; ++r)
    dog.add_rank("cuda:" + std::to_string(r) + " (world rank " + std::to_string(4 + r) + ")");
}

}  // namespace

TEST_CASE("watchdog: a collective past its deadline fires exactly once, naming device and collective") {
  FakeComm fake;
  Watchdog dog(1000ms, fake.hooks());
  add_ranks(dog, 4);
  dog.enqueued(2, token(0), "all_reduce", 1024);

  fake.advance(999ms);
  CHECK_FALSE(dog.poll());
  fake.advance(1ms);  // exactly at the deadline: not yet past it
  CHECK_FALSE(dog.poll());
  CHECK(fake.aborts == 0);

  fake.advance(1ms);
  CHECK(dog.poll());
  CHECK(fake.aborts == 1);
  CHECK(fake.failure.rank == 2);
  CHECK(fake.failure.label == "cuda:2 (world rank 6)");
  CHECK(fake.failure.collective == "all_reduce");
  CHECK(fake.failure.reason.find("cuda:2 (world rank 6)") != std::string::npos);
  CHECK(fake.failure.reason.find("all_reduce of 1024 elements") != std::string::npos);
  CHECK(fake.failure.reason.find("1000 ms") != std::string::npos);
  CHECK(dog.tripped());

  // Still incomplete, later and later: never a second abort.
  for (int i = 0; i < 5; ++i) {
    fake.advance(10s);
    CHECK_FALSE(dog.poll());
  }
  CHECK(fake.aborts == 1);
}

TEST_CASE("watchdog: abort is called for every rank, whichever rank failed") {
  FakeComm fake;
  Watchdog dog(50ms, fake.hooks());
  add_ranks(dog, 5);
  dog.enqueued(4, token(0), "broadcast", 7);
  fake.advance(51ms);
  REQUIRE(dog.poll());
  CHECK(fake.aborted_ranks == std::vector<int>{0, 1, 2, 3, 4});
}

TEST_CASE("watchdog: completed collectives never fire and are released in order") {
  FakeComm fake;
  Watchdog dog(100ms, fake.hooks());
  add_ranks(dog, 2);
  for (int i = 0; i < 3; ++i) {
    dog.enqueued(0, token(i), "all_reduce", 10);
    fake.complete(token(i));
  }
  dog.enqueued(1, token(3), "reduce_scatter", 10);
  fake.complete(token(3));
  fake.advance(1h);
  CHECK_FALSE(dog.poll());
  CHECK(fake.aborts == 0);
  CHECK(dog.pending(0) == 0);
  CHECK(dog.pending(1) == 0);
  const std::vector<std::pair<int, Watchdog::Token>> expected{
      {0, token(0)}, {0, token(1)}, {0, token(2)}, {1, token(3)}};
  CHECK(fake.released == expected);
  CHECK_FALSE(dog.tripped());
}

TEST_CASE("watchdog: each collective's deadline runs from its own enqueue time") {
  FakeComm fake;
  Watchdog dog(100ms, fake.hooks());
  add_ranks(dog, 1);
  dog.enqueued(0, token(0), "all_reduce", 1);
  fake.advance(80ms);
  dog.enqueued(0, token(1), "all_gather", 2);
  fake.advance(80ms);  // the first is 160 ms old but done; the second only 80 ms
  fake.complete(token(0));
  CHECK_FALSE(dog.poll());
  CHECK(dog.pending(0) == 1);
  fake.advance(21ms);  // the second is 101 ms old
  CHECK(dog.poll());
  CHECK(fake.failure.collective == "all_gather");
}

TEST_CASE("watchdog: an asynchronous error fires at once, naming the collective in flight") {
  FakeComm fake;
  Watchdog dog(10min, fake.hooks());
  add_ranks(dog, 3);
  CHECK_FALSE(dog.poll());
  dog.enqueued(1, token(0), "reduce", 64);
  {
    std::lock_guard<std::mutex> lock(fake.mu);
    fake.async[1] = "remote process exited or there was a network error";
  }
  CHECK(dog.poll());  // no time has passed
  CHECK(fake.aborts == 1);
  CHECK(fake.failure.rank == 1);
  CHECK(fake.failure.collective == "reduce");
  CHECK(fake.failure.reason.find("cuda:1 (world rank 5)") != std::string::npos);
  CHECK(fake.failure.reason.find("remote process exited") != std::string::npos);
  CHECK(fake.failure.reason.find("reduce") != std::string::npos);
  CHECK(fake.aborted_ranks == std::vector<int>{0, 1, 2});
  CHECK_FALSE(dog.poll());
  CHECK(fake.aborts == 1);
}

TEST_CASE("watchdog: an asynchronous error with nothing in flight still fires") {
  FakeComm fake;
  Watchdog dog(10min, fake.hooks());
  add_ranks(dog, 2);
  {
    std::lock_guard<std::mutex> lock(fake.mu);
    fake.async[0] = "unhandled system error";
  }
  CHECK(dog.poll());
  CHECK(fake.failure.collective.empty());
  CHECK(fake.failure.reason.find("cuda:0 (world rank 4)") != std::string::npos);
}

TEST_CASE("watchdog: a failed collective fires at once with its error") {
  FakeComm fake;
  Watchdog dog(10min, fake.hooks());
  add_ranks(dog, 2);
  dog.enqueued(1, token(0), "all_gather", 8);
  {
    std::lock_guard<std::mutex> lock(fake.mu);
    fake.state[token(0)] = {Watchdog::Progress::Failed, "an illegal memory access was encountered"};
  }
  CHECK(dog.poll());
  CHECK(fake.failure.collective == "all_gather");
  CHECK(fake.failure.reason.find("illegal memory access") != std::string::npos);
  CHECK(fake.failure.reason.find("cuda:1") != std::string::npos);
}

TEST_CASE("watchdog: a probe that throws is a failure, not a crash") {
  FakeComm fake;
  Watchdog::Hooks hooks = fake.hooks();
  hooks.query = [](int, Watchdog::Token) -> Watchdog::Probe { throw std::runtime_error("device lost"); };
  Watchdog dog(10min, hooks);
  add_ranks(dog, 1);
  dog.enqueued(0, token(0), "all_reduce", 3);
  CHECK(dog.poll());
  CHECK(fake.failure.reason.find("device lost") != std::string::npos);
}

TEST_CASE("watchdog: disarmed it never fires; clear releases everything and re-arms") {
  FakeComm fake;
  Watchdog dog(100ms, fake.hooks());
  add_ranks(dog, 2);
  dog.enqueued(0, token(0), "all_reduce", 1);
  dog.enqueued(1, token(1), "all_reduce", 1);
  dog.disarm();  // the communicator was aborted for another reason
  fake.advance(1h);
  CHECK_FALSE(dog.poll());
  CHECK(fake.aborts == 0);

  dog.clear();
  CHECK(dog.pending(0) == 0);
  CHECK(dog.pending(1) == 0);
  CHECK(fake.released.size() == 2);
  CHECK_FALSE(dog.tripped());

  dog.enqueued(0, token(2), "all_reduce", 1);
  fake.advance(101ms);
  CHECK(dog.poll());
  CHECK(fake.aborts == 1);
}

TEST_CASE("watchdog: its thread fires on its own and stops promptly") {
  FakeComm fake;
  Watchdog dog(100ms, fake.hooks());
  add_ranks(dog, 2);
  dog.start(1ms);
  dog.enqueued(1, token(0), "all_reduce", 5);
  fake.advance(1s);
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  while (fake.aborts == 0 && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(1ms);
  CHECK(fake.aborts == 1);
  std::this_thread::sleep_for(20ms);  // many more polls: still once
  CHECK(fake.aborts == 1);
  dog.stop();
  dog.stop();  // idempotent
}

TEST_CASE("watchdog: stopping never hangs, with nothing pending or with a stuck collective") {
  for (const bool stuck : {false, true}) {
    CAPTURE(stuck);
    FakeComm fake;
    auto stopped = std::async(std::launch::async, [&] {
      Watchdog dog(10min, fake.hooks());
      add_ranks(dog, 8);
      dog.start(1h);  // stop() must not wait for the next poll
      if (stuck) dog.enqueued(3, token(0), "all_reduce", 1);
      std::this_thread::sleep_for(5ms);
      dog.stop();
    });
    REQUIRE(stopped.wait_for(10s) == std::future_status::ready);
    stopped.get();
    CHECK(fake.aborts == 0);
    CHECK(fake.released.size() == (stuck ? 1u : 0u));  // the destructor releases it
  }
}

TEST_CASE("watchdog: a timeout must be positive") {
  FakeComm fake;
  CHECK_THROWS_WITH_AS(Watchdog(0ms, fake.hooks()), doctest::Contains("positive timeout"), std::exception);
}
