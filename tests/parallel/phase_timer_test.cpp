// Profiler ranges (Note [Profiler ranges], src/backend/backend.h): DP_NVTX's parsing,
// PhaseTimer's ranges seen through a RangeObserver, and a DataParallel step's.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "dp/dp.h"
#include "mlp_fixture.h"
#include "parallel/phase_timer.h"

namespace {

using dp::parallel::Phase;
using dp::parallel::PhaseRecorder;
using dp::parallel::PhaseTimer;

/// Every push and pop, in order, per thread; "-" marks a pop.
class Log final : public dp::backend::RangeObserver {
 public:
  void push(dp::Device dev, const char* name) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_[std::this_thread::get_id()].push_back(dev.str() + " " + name);
  }
  void pop(dp::Device dev) noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    events_[std::this_thread::get_id()].push_back("-" + dev.str());
  }
  std::vector<std::string> of_this_thread() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_[std::this_thread::get_id()];
  }
  std::map<std::thread::id, std::vector<std::string>> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  std::mutex mu_;
  std::map<std::thread::id, std::vector<std::string>> events_;
};

/// Installs `log` with ranges on; restores the process's state on every path out.
class Observing {
 public:
  explicit Observing(Log& log) : was_(dp::backend::ranges_enabled()) {
    dp::backend::set_range_observer(&log);
    dp::backend::set_ranges_enabled(true);
  }
  ~Observing() {
    dp::backend::set_ranges_enabled(was_);
    dp::backend::set_range_observer(nullptr);
  }

 private:
  bool was_;
};

}  // namespace

TEST_CASE("DP_NVTX: unset, empty and 0 are off, 1 is on, anything else is off") {
  CHECK_FALSE(dp::backend::parse_ranges_flag(nullptr));
  CHECK_FALSE(dp::backend::parse_ranges_flag(""));
  CHECK_FALSE(dp::backend::parse_ranges_flag("0"));
  CHECK(dp::backend::parse_ranges_flag("1"));
  CHECK_FALSE(dp::backend::parse_ranges_flag("yes"));  // warns
  CHECK_FALSE(dp::backend::parse_ranges_flag("10"));
}

TEST_CASE("PhaseTimer opens a range named after its phase, nested in scope order") {
  PhaseRecorder recorder({dp::cpu(0), dp::cpu(1)});
  Log log;
  {
    Observing on(log);
    {
      PhaseTimer f(recorder, 1, Phase::Forward);
      PhaseTimer b(recorder, 1, Phase::Backward);
    }
    {
      PhaseTimer s(recorder, 0, Phase::Step);
      s.cancel();  // records no time, still closes its range
    }
  }
  CHECK(log.of_this_thread() ==
        std::vector<std::string>{"cpu:1 forward", "cpu:1 backward", "-cpu:1", "-cpu:1", "cpu:0 step", "-cpu:0"});
  CHECK(recorder.snapshot().devices[0].ms[static_cast<int>(Phase::Step)] == 0.0);
}

TEST_CASE("ranges off: PhaseTimer and ScopedRange report nothing") {
  PhaseRecorder recorder({dp::cpu(0)});
  Log log;
  dp::backend::set_range_observer(&log);
  const bool was = dp::backend::ranges_enabled();
  dp::backend::set_ranges_enabled(false);
  {
    PhaseTimer f(recorder, 0, Phase::Forward);
    dp::backend::ScopedRange r(dp::cpu(0), "nccl", "all_reduce", 4096);
  }
  dp::backend::set_ranges_enabled(was);
  dp::backend::set_range_observer(nullptr);
  CHECK(log.all().empty());
}

TEST_CASE("ScopedRange names a collective with its size") {
  Log log;
  {
    Observing on(log);
    dp::backend::ScopedRange a(dp::cpu(0), "nccl", "all_reduce", 4 * 1024 * 1024);
    dp::backend::ScopedRange b(dp::cpu(0), "nccl", "reduce", 1536);
    dp::backend::ScopedRange c(dp::cpu(0), "cuda-copy", "broadcast", 12);
  }
  CHECK(log.of_this_thread() == std::vector<std::string>{"cpu:0 nccl all_reduce 4.00 MiB",
                                                         "cpu:0 nccl reduce 1.50 KiB",
                                                         "cpu:0 cuda-copy broadcast 12 B", "-cpu:0", "-cpu:0",
                                                         "-cpu:0"});
}

TEST_CASE("a DataParallel step: each worker's ranges are its phases, balanced, forward before backward") {
  auto net = make_mlp(7);
  const std::vector<dp::Device> devs{dp::cpu(0), dp::cpu(1)};
  dp::DataParallel model(net, devs);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  const Batch batch = make_batch(8, 3);
  Log log;
  {
    Observing on(log);
    opt.zero_grad();
    model.forward_backward(batch.x, batch.y, loss_fn);
    opt.step();
  }
  std::map<std::string, std::vector<std::string>> names;  // device → phase names, in order
  for (const auto& [thread, events] : log.all()) {
    int depth = 0;
    for (const std::string& e : events) {
      if (e[0] == '-') {
        --depth;
        REQUIRE(depth >= 0);  // never a pop without its push
        continue;
      }
      ++depth;
      const std::size_t space = e.find(' ');
      names[e.substr(0, space)].push_back(e.substr(space + 1));
    }
    CHECK(depth == 0);  // every range closed on the thread that opened it
  }
  for (const dp::Device& d : devs) {
    const std::vector<std::string>& n = names[d.str()];
    INFO(d.str());
    const auto at = [&](const char* phase) { return std::find(n.begin(), n.end(), phase) - n.begin(); };
    REQUIRE(at("forward") < static_cast<std::ptrdiff_t>(n.size()));
    REQUIRE(at("backward") < static_cast<std::ptrdiff_t>(n.size()));
    CHECK(at("forward") < at("backward"));
  }
}
