// The Reducer alone: bucket assignment, the gradient cycle with a recording strategy,
// overlap with backward, no_sync, unused parameters, failures without a hang, and the
// three real strategies over the local communicator.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

#include "dp/autograd/grad_mode.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "parallel/reducer.h"
#include "mlp_fixture.h"

namespace {

using dp::Tensor;
using dp::parallel::assign_buckets;
using dp::parallel::Bucket;
using dp::parallel::Reducer;

// A strategy that records every call (rank, range, thread) and can be told to fail.
class RecordingSync final : public dp::parallel::GradSync {
 public:
  struct Call {
    int rank;
    std::int64_t lo, hi;
    std::thread::id thread;
  };
  RecordingSync(bool overlaps, std::vector<Tensor> grads) : overlaps_(overlaps), grads_(std::move(grads)) {}
  const char* name() const override { return "recording"; }
  bool overlaps_backward() const override { return overlaps_; }
  int world_ranks() const override { return static_cast<int>(grads_.size()); }
  void sync(int rank, const Tensor& grad, std::int64_t offset) override {
    std::int64_t lo = (grad.data<float>() - grads_[rank].data<float>());
    CHECK(lo == offset);
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back({rank, lo, lo + grad.numel(), std::this_thread::get_id()});
    }
    count_.fetch_add(1);
    count_.notify_all();
    if (rank == fail_rank_) throw std::out_of_range("injected collective failure");
  }
  Held held(int rank, const Tensor& buffer) const override {
    return rank == 0 || overlaps_ ? Held{0, buffer} : Held{};
  }
  // join is recorded as a call with lo = hi = -1; finish as lo = hi = -2.
  void join(int rank) override { record(rank, -1); }
  void finish(int rank) override { record(rank, -2); }
  std::optional<std::pair<double, double>> device_times(int) override { return device_times_; }
  std::optional<std::pair<double, double>> device_times_;

  void record(int rank, std::int64_t marker) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back({rank, marker, marker, std::this_thread::get_id()});
  }
  // The collectives only, without join and finish markers.
  std::vector<Call> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Call> out;
    for (const Call& c : calls_)
      if (c.lo >= 0) out.push_back(c);
    return out;
  }
  std::vector<Call> all_calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::vector<Call> calls_of(int rank) const {
    std::vector<Call> out;
    for (auto& c : calls())
      if (c.rank == rank) out.push_back(c);
    return out;
  }
  // Waits (bounded) until at least n calls were made; false on time-out.
  bool wait_for_calls(int n) const {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (count_.load() < n)
      if (std::chrono::steady_clock::now() > deadline) return false;
      else std::this_thread::sleep_for(std::chrono::microseconds(200));
    return true;
  }
  int fail_rank_ = -1;

 private:
  bool overlaps_;
  std::vector<Tensor> grads_;
  mutable std::mutex mu_;
  std::vector<Call> calls_;
  std::atomic<int> count_{0};
};

// Three parameters of 4, 2 and 3 elements; caps of 3 elements give buckets
// {param 2}, {param 1}, {param 0}.
const std::vector<std::int64_t> kSizes = {4, 2, 3};

struct Fixture {
  int n;
  std::vector<dp::Device> devices;
  std::vector<Tensor> grads;
  dp::parallel::PhaseRecorder recorder;
  RecordingSync* sync = nullptr;
  std::unique_ptr<Reducer> reducer;
  std::vector<std::thread::id> workers;

  Fixture(int ranks, bool overlaps, std::int64_t cap = 3)
      : n(ranks), devices(cpus(ranks)), recorder(devices), workers(ranks) {
    for (int r = 0; r < n; ++r) grads.push_back(dp::zeros({9}, devices[r]));
    auto s = std::make_unique<RecordingSync>(overlaps, grads);
    sync = s.get();
    auto buckets = overlaps ? assign_buckets(kSizes, cap, cap) : std::vector<Bucket>{Bucket{0, 9, 0, 3}};
    reducer = std::make_unique<Reducer>(devices, std::move(buckets), std::move(s),
                                        [this](int r) { return grads[r]; }, recorder);
  }
  // Runs body(rank) on one thread per rank, as workers do, and joins them.
  void on_workers(const std::function<void(int)>& body) {
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        workers[r] = std::this_thread::get_id();
        body(r);
      });
    for (auto& t : ts) t.join();
  }
};

}  // namespace

TEST_CASE("assign_buckets: reverse order, a small first bucket, whole parameters") {
  // Parameters in registration order; backward produces the last ones first.
  std::vector<std::int64_t> sizes = {100, 10, 10, 10, 50, 5};
  auto b = assign_buckets(sizes, /*first_cap=*/20, /*cap=*/60);
  REQUIRE(b.size() == 4);
  // First bucket: param 5 (5); param 4 (50) would push it past 20.
  CHECK(b[0] == Bucket{180, 185, 5, 1});
  // Then the cap is 60: param 4 (50) + param 3 (10) = 60 fits, param 2 would not.
  CHECK(b[1] == Bucket{120, 180, 3, 2});
  CHECK(b[2] == Bucket{100, 120, 1, 2});
  // Param 0 (100) is over the cap: a bucket of its own.
  CHECK(b[3] == Bucket{0, 100, 0, 1});
}

TEST_CASE("assign_buckets: a parameter over the cap gets a bucket of its own") {
  auto b = assign_buckets({10, 100, 10}, 15, 15);
  REQUIRE(b.size() == 3);
  CHECK(b[0] == Bucket{110, 120, 2, 1});
  CHECK(b[1] == Bucket{10, 110, 1, 1});
  CHECK(b[2] == Bucket{0, 10, 0, 1});
  auto one = assign_buckets({3, 4, 5}, 1000, 1000);
  REQUIRE(one.size() == 1);
  CHECK(one[0] == Bucket{0, 12, 0, 3});
  CHECK(assign_buckets({}, 1, 1).empty());
}

TEST_CASE("assign_buckets: random sizes are partitioned into contiguous capped runs") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    int n = 1 + static_cast<int>(rng() % 30);
    std::vector<std::int64_t> sizes(n);
    for (auto& s : sizes) s = static_cast<std::int64_t>(rng() % 500);
    std::int64_t first = 1 + rng() % 400, cap = 1 + rng() % 2000;
    auto b = assign_buckets(sizes, first, cap);
    std::int64_t total = std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0});
    std::int64_t hi = total;
    int next_param = n;
    for (std::size_t k = 0; k < b.size(); ++k) {
      CHECK(b[k].hi == hi);  // contiguous, from the end of the buffer down
      CHECK(b[k].first_param + b[k].num_params == next_param);
      std::int64_t sum = 0;
      for (int i = b[k].first_param; i < next_param; ++i) sum += sizes[i];
      CHECK(b[k].hi - b[k].lo == sum);
      std::int64_t limit = k == 0 ? first : cap;
      CHECK((sum <= limit || b[k].num_params == 1));
      hi = b[k].lo;
      next_param = b[k].first_param;
    }
    CHECK(hi == 0);
    CHECK(next_param == 0);
  }
}

TEST_CASE("assign_buckets and mib_to_floats reject what cannot be a cap") {
  CHECK_THROWS_WITH_AS(assign_buckets({1}, 0, 10), doctest::Contains("caps > 0"), dp::Error);
  CHECK_THROWS_WITH_AS(assign_buckets({1}, 10, -1), doctest::Contains("caps > 0"), dp::Error);
  CHECK_THROWS_WITH_AS(assign_buckets({1, -2}, 10, 10), doctest::Contains("parameter 1 has -2"), dp::Error);
  CHECK(dp::parallel::mib_to_floats(1.0) == 262144);
  CHECK(dp::parallel::mib_to_floats(1e-12) == 1);
}

TEST_CASE("overlapping strategy: every bucket once per rank, in order, on the comm thread") {
  Fixture f(3, /*overlaps=*/true);
  REQUIRE(f.reducer->buckets().size() == 3);
  for (int step = 0; step < 2; ++step) {  // the cycle re-arms
    f.reducer->prepare(true);
    f.on_workers([&](int r) {
      for (int i = 2; i >= 0; --i) f.reducer->mark_ready(r, i);  // backward order
      f.reducer->finalize(r);
    });
    f.reducer->end();
  }
  for (int r = 0; r < 3; ++r) {
    auto calls = f.sync->calls_of(r);
    REQUIRE(calls.size() == 6);
    for (int k = 0; k < 6; ++k) {
      const Bucket& b = f.reducer->buckets()[k % 3];
      CHECK(calls[k].lo == b.lo);
      CHECK(calls[k].hi == b.hi);
      CHECK(calls[k].thread != f.workers[r]);
    }
  }
}

TEST_CASE("overlapping strategy: join once per rank after its last bucket, before finish") {
  Fixture f(3, /*overlaps=*/true);
  f.reducer->prepare(true);
  f.on_workers([&](int r) {
    for (int i = 2; i >= 0; --i) f.reducer->mark_ready(r, i);
    f.reducer->finalize(r);
  });
  f.reducer->end();
  for (int r = 0; r < 3; ++r) {
    std::vector<std::int64_t> seq;
    for (const auto& c : f.sync->all_calls())
      if (c.rank == r) seq.push_back(c.lo < 0 ? c.lo : 0);
    // three buckets, then the join (on the worker), then finish
    CHECK(seq == std::vector<std::int64_t>{0, 0, 0, -1, -2});
  }
  // no_sync: no collective, so nothing to join
  f.reducer->prepare(false);
  f.on_workers([&](int r) { f.reducer->finalize(r); });
  f.reducer->end();
  CHECK(f.sync->all_calls().size() == 15);
}

TEST_CASE("device-timed collectives replace the host's enqueue time in the stats") {
  Fixture f(2, /*overlaps=*/true);
  f.sync->device_times_ = std::make_pair(5.0, 2.0);  // busy 5 ms, of which 2 exposed
  f.reducer->prepare(true);
  f.on_workers([&](int r) {
    for (int i = 2; i >= 0; --i) f.reducer->mark_ready(r, i);
    f.reducer->finalize(r);
  });
  f.reducer->end();
  const dp::parallel::Stats s = f.recorder.snapshot();
  for (int r = 0; r < 2; ++r) {
    CHECK(s.devices[r][dp::parallel::Phase::AllReduceExposed] == doctest::Approx(2.0));
    CHECK(s.devices[r][dp::parallel::Phase::AllReduceHidden] == doctest::Approx(3.0));
  }
}

TEST_CASE("a complete bucket is combined while backward still runs") {
  Fixture f(2, true);
  f.reducer->prepare(true);
  std::atomic<bool> overlapped[2] = {false, false};
  f.on_workers([&](int r) {
    f.reducer->mark_ready(r, 2);  // bucket 0 is complete on this rank
    // "Backward" goes on only once both ranks' bucket 0 was combined: the comm
    // threads ran it before finalize (bounded wait, checked below).
    overlapped[r] = f.sync->wait_for_calls(2);
    f.reducer->mark_ready(r, 1);
    f.reducer->mark_ready(r, 0);
    f.reducer->finalize(r);
  });
  f.reducer->end();
  CHECK(overlapped[0].load());
  CHECK(overlapped[1].load());
  CHECK(f.sync->calls().size() == 6);
}

TEST_CASE("parameters that got no gradient are released by finalize") {
  Fixture f(2, true);
  f.reducer->prepare(true);
  f.on_workers([&](int r) {
    f.reducer->mark_ready(r, 2);  // params 1 and 0 unused this step
    f.reducer->finalize(r);
  });
  f.reducer->end();
  CHECK(f.sync->calls_of(0).size() == 3);
  CHECK(f.sync->calls_of(1).size() == 3);
}

TEST_CASE("no_sync: hooks count nothing and finalize combines nothing") {
  Fixture f(2, true);
  f.reducer->prepare(false);
  f.on_workers([&](int r) {
    for (int i = 2; i >= 0; --i) f.reducer->mark_ready(r, i);
    f.reducer->finalize(r);
  });
  f.reducer->end();
  CHECK(f.sync->calls().empty());
}

TEST_CASE("non-overlapping strategy: one collective over the whole buffer on the worker") {
  Fixture f(3, /*overlaps=*/false);
  std::vector<std::pair<int, std::int64_t>> checks;
  std::mutex mu;
  f.reducer->set_check([&](int r, const Tensor& g, std::int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    checks.push_back({r, g.numel()});
  });
  f.reducer->prepare(true);
  f.on_workers([&](int r) { f.reducer->finalize(r); });
  f.reducer->end();
  for (int r = 0; r < 3; ++r) {
    auto calls = f.sync->calls_of(r);
    REQUIRE(calls.size() == 1);
    CHECK(calls[0].lo == 0);
    CHECK(calls[0].hi == 9);
    CHECK(calls[0].thread == f.workers[r]);
  }
  // Every rank's own gradient is checked before, and the root's result after.
  CHECK(checks.size() == 4);
  CHECK(std::count(checks.begin(), checks.end(), std::pair<int, std::int64_t>{0, 9}) == 2);
  auto stats = f.recorder.snapshot();
  CHECK(stats.devices[1][dp::parallel::Phase::Reduce] > 0.0);
}

TEST_CASE("one rank: no comm thread and no collective, but the check still runs") {
  Fixture f(1, true);
  int checked = 0;
  f.reducer->set_check([&](int, const Tensor&, std::int64_t) { ++checked; });
  f.reducer->prepare(true);
  for (int i = 2; i >= 0; --i) f.reducer->mark_ready(0, i);
  f.reducer->finalize(0);
  f.reducer->end();
  CHECK(f.sync->calls().empty());
  CHECK(checked == 4);  // three buckets, then the whole buffer
  CHECK(f.recorder.snapshot().devices[0][dp::parallel::Phase::AllReduceExposed] == 0.0);
}

TEST_CASE("a failed collective reaches its worker typed; abort releases the others; no hang") {
  Fixture f(2, true);
  f.sync->fail_rank_ = 1;
  std::atomic<int> hook_calls{0};
  f.reducer->set_failure_hook([&](int r, const std::exception_ptr&) {
    CHECK(r == 1);
    hook_calls.fetch_add(1);
    f.reducer->abort();  // what DataParallel does (it aborts the communicator too)
  });
  f.reducer->prepare(true);
  std::exception_ptr errors[2];
  f.on_workers([&](int r) {
    try {
      f.reducer->mark_ready(r, 2);
      if (r == 1) f.sync->wait_for_calls(1);
      f.reducer->mark_ready(r, 1);
      f.reducer->mark_ready(r, 0);
      f.reducer->finalize(r);
    } catch (...) {
      errors[r] = std::current_exception();
    }
  });
  f.reducer->end();
  CHECK(hook_calls.load() == 1);
  CHECK_FALSE(errors[0]);
  REQUIRE(errors[1]);
  CHECK_THROWS_AS(std::rethrow_exception(errors[1]), std::out_of_range);
  // Rank 1's comm thread stopped at its first bucket.
  CHECK(f.sync->calls_of(1).size() == 1);
  // Usable again.
  f.sync->fail_rank_ = -1;
  f.reducer->prepare(true);
  f.on_workers([&](int r) { f.reducer->finalize(r); });
  f.reducer->end();
  CHECK(f.sync->calls_of(1).size() == 4);
}

TEST_CASE("a worker that fails before finalize: abort and end leave no thread behind") {
  Fixture f(3, true);
  for (int trial = 0; trial < 20; ++trial) {
    f.reducer->prepare(true);
    f.on_workers([&](int r) {
      f.reducer->mark_ready(r, 2);
      if (r == trial % 3) f.reducer->abort();  // this worker "threw" in backward
      else f.reducer->finalize(r);
    });
    f.reducer->end();  // bounded: would hang here if a comm thread were left waiting
  }
  CHECK(f.sync->calls().size() <= 20 * 9);
}

TEST_CASE("the real strategies over the local communicator") {
  auto devices = cpus(3);
  auto comm = dp::comm::make_communicator(devices);
  dp::parallel::PhaseRecorder recorder(devices);
  std::vector<Tensor> grads;
  for (int r = 0; r < 3; ++r)
    grads.push_back(dp::full({9}, static_cast<double>(r + 1), {.device = devices[r]}));
  SUBCASE("all-reduce: every rank holds the sum") {
    Reducer red(devices, assign_buckets(kSizes, 3, 3), dp::parallel::make_all_reduce_sync(*comm),
                [&](int r) { return grads[r]; }, recorder);
    CHECK(std::string(red.strategy().name()) == "allreduce");
    red.prepare(true);
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r)
      ts.emplace_back([&, r] {
        for (int i = 2; i >= 0; --i) red.mark_ready(r, i);
        red.finalize(r);
      });
    for (auto& t : ts) t.join();
    red.end();
    for (int r = 0; r < 3; ++r) CHECK(grads[r].to_vector() == std::vector<float>(9, 6.0f));
  }
  SUBCASE("reduce to root: the root holds the sum, the others are unchanged") {
    Reducer red(devices, {Bucket{0, 9, 0, 3}}, dp::parallel::make_reduce_to_root_sync(*comm, 0),
                [&](int r) { return grads[r]; }, recorder);
    red.prepare(true);
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r) ts.emplace_back([&, r] { red.finalize(r); });
    for (auto& t : ts) t.join();
    red.end();
    CHECK(grads[0].to_vector() == std::vector<float>(9, 6.0f));
    CHECK(grads[1].to_vector() == std::vector<float>(9, 2.0f));
    CHECK(grads[2].to_vector() == std::vector<float>(9, 3.0f));
  }
  for (bool zero_sent : {true, false}) {
    SUBCASE(zero_sent ? "reduce-scatter, stage 1: each rank holds its range's sum, zeros elsewhere"
                      : "reduce-scatter, stage 2: each rank holds its range's sum; the hooks run") {
      // Shards of 3 elements; bucket {param 0} = [0, 4) crosses the first boundary.
      dp::parallel::ShardedGrads g;
      g.shards = {{0, 3}, {3, 6}, {6, 9}};
      g.zero_sent = zero_sent;
      std::atomic<int> begun{0}, finished{0};
      g.before_backward = [&](int) { begun.fetch_add(1); };
      g.after_sync = [&](int r) {
        CHECK(grads[r].to_vector()[3 * r] == 6.0f);  // after the collectives and the check
        finished.fetch_add(1);
      };
      Reducer red(devices, assign_buckets(kSizes, 3, 3), dp::parallel::make_reduce_scatter_sync(*comm, g),
                  [&](int r) { return grads[r]; }, recorder);
      CHECK(std::string(red.strategy().name()) == "reduce_scatter");
      std::mutex mu;
      std::vector<std::tuple<int, std::int64_t, std::int64_t>> checks;  // rank, offset, numel
      red.set_check([&](int r, const Tensor& t, std::int64_t off) {
        std::lock_guard<std::mutex> lock(mu);
        checks.emplace_back(r, off, t.numel());
      });
      red.prepare(true);
      std::vector<std::thread> ts;
      for (int r = 0; r < 3; ++r)
        ts.emplace_back([&, r] {
          red.begin(r);
          for (int i = 2; i >= 0; --i) red.mark_ready(r, i);
          red.finalize(r);
        });
      for (auto& t : ts) t.join();
      red.end();
      CHECK(begun.load() == 3);
      CHECK(finished.load() == 3);
      for (int r = 0; r < 3; ++r) {
        auto v = grads[r].to_vector();
        for (int i = 0; i < 9; ++i) {
          const bool own = i / 3 == r;
          CHECK(v[i] == (own ? 6.0f : zero_sent ? 0.0f : static_cast<float>(r + 1)));
        }
        // Three buckets checked before their collectives, then the rank's own range.
        std::vector<std::pair<std::int64_t, std::int64_t>> mine;
        for (auto& [cr, off, n] : checks)
          if (cr == r) mine.emplace_back(off, n);
        REQUIRE(mine.size() == 4);
        CHECK(mine.back() == std::pair<std::int64_t, std::int64_t>{3 * r, 3});
      }
    }
  }
  CHECK_THROWS_AS(dp::parallel::make_reduce_to_root_sync(*comm, 3), dp::Error);
  dp::parallel::ShardedGrads two, overlapping;
  two.shards = {{0, 3}, {3, 9}};
  overlapping.shards = {{0, 4}, {3, 6}, {6, 9}};
  CHECK_THROWS_AS(dp::parallel::make_reduce_scatter_sync(*comm, two), dp::Error);
  CHECK_THROWS_AS(dp::parallel::make_reduce_scatter_sync(*comm, overlapping), dp::Error);
}

namespace {

// The local communicator seen as a stream-ordered one would be used (Note [Deferred
// collectives], Note [Work after deferred collectives]): it records which reduces were
// deferred, when the work that follows them runs, and the joins.
class StreamOrderedRecorder final : public dp::comm::Communicator {
 public:
  explicit StreamOrderedRecorder(std::vector<dp::Device> devices)
      : Communicator(devices), inner_(dp::comm::make_communicator(devices)), ranks_(devices.size()) {}
  std::string backend_name() const override { return "recorder"; }
  void do_all_reduce(int rank, const Tensor& s, const Tensor& r, dp::comm::ReduceOp op) override {
    inner_->all_reduce(rank, s, r, op);
  }
  void do_broadcast(int rank, const Tensor& d, int root) override { inner_->broadcast(rank, d, root); }
  void do_reduce(int rank, const Tensor& s, const Tensor& r, int root, dp::comm::ReduceOp op) override {
    ++ranks_[rank].plain;
    inner_->reduce(rank, s, r, root, op);
  }
  void do_reduce_deferred(int rank, const Tensor& s, const Tensor& r, int root, dp::comm::ReduceOp op) override {
    PerRank& me = ranks_[rank];
    ++me.deferred;
    inner_->reduce(rank, s, r, root, op);
    if (root != rank) me.sent.push_back(s);
  }
  void do_reduce_scatter(int rank, const Tensor& s, const Tensor& r, dp::comm::ReduceOp op) override {
    inner_->reduce_scatter(rank, s, r, op);
  }
  void do_all_gather(int rank, const Tensor& s, const Tensor& r) override { inner_->all_gather(rank, s, r); }
  void synchronize(int rank) override { inner_->synchronize(rank); }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  void reset() override { inner_->reset(); }
  void group_start(int rank) override { ++ranks_[rank].depth; }
  void group_end(int rank) override { --ranks_[rank].depth; }
  void join(int rank) override {
    PerRank& me = ranks_[rank];
    CHECK(me.depth == 0);
    ++me.joins;
    me.joined_after_work = me.works;
  }
  void after_deferred(int rank, const std::function<void()>& work) override {
    PerRank& me = ranks_[rank];
    CHECK(me.depth == 0);  // after the group that launched the reduces
    me.work_joins.push_back(me.joins);  // joins before this work: it must precede the cycle's join
    ++me.works;
    for (const Tensor& t : me.sent) me.sent_before.push_back(t.to_vector());
    t_in_work = true;
    work();
    t_in_work = false;
    for (const Tensor& t : me.sent) me.sent_after.push_back(t.to_vector());
    me.sent.clear();
  }

  struct PerRank {
    int plain = 0, deferred = 0, works = 0, joins = 0, joined_after_work = -1, depth = 0;
    std::vector<int> work_joins;
    std::vector<Tensor> sent;  // pieces sent since the last work
    std::vector<std::vector<float>> sent_before, sent_after;
  };
  const PerRank& of(int rank) const { return ranks_[rank]; }
  static thread_local bool t_in_work;

 private:
  std::unique_ptr<dp::comm::Communicator> inner_;
  std::vector<PerRank> ranks_;  // each touched by its rank's threads only, one at a time
};
thread_local bool StreamOrderedRecorder::t_in_work = false;

}  // namespace

TEST_CASE("reduce-scatter on a stream-ordered communicator: deferred reduces, follow-up after them, one join") {
  auto devices = cpus(3);
  StreamOrderedRecorder comm(devices);
  dp::parallel::PhaseRecorder recorder(devices);
  for (bool detached : {false, true}) {
    CAPTURE(detached);
    std::vector<Tensor> grads, owned;
    for (int r = 0; r < 3; ++r) {
      grads.push_back(dp::full({9}, static_cast<double>(r + 1), {.device = devices[r]}));
      owned.push_back(dp::zeros({3}, devices[r]));
    }
    dp::parallel::ShardedGrads g;
    g.shards = {{0, 3}, {3, 6}, {6, 9}};
    g.zero_sent = !detached;
    std::atomic<int> delivered{0}, outside{0};
    g.deliver = [&](int r, const Tensor& piece, std::int64_t offset) {
      if (!StreamOrderedRecorder::t_in_work) outside.fetch_add(1);
      dp::NoGradGuard no_grad;
      owned[r].narrow(0, offset - 3 * r, piece.numel()).add_(piece);
      delivered.fetch_add(1);
    };
    g.owned = [&](int r) { return owned[r]; };
    Reducer red(devices, assign_buckets(kSizes, 3, 3), dp::parallel::make_reduce_scatter_sync(comm, g),
                [&](int r) { return detached ? Tensor() : grads[r]; }, recorder);
    std::vector<std::pair<std::int64_t, std::int64_t>> layout = {{0, 4}, {4, 2}, {6, 3}};
    red.set_param_layout(layout);
    const int joins_before = comm.of(0).joins;
    const std::size_t works_before = comm.of(0).work_joins.size();
    red.prepare(true);
    std::vector<std::thread> ts;
    for (int r = 0; r < 3; ++r)
      ts.emplace_back([&, r] {
        red.begin(r);
        for (int i = 2; i >= 0; --i) {
          if (detached) {
            Tensor leaf = dp::zeros({layout[static_cast<std::size_t>(i)].second}, devices[r]).set_requires_grad(true);
            leaf.set_grad(dp::full({layout[static_cast<std::size_t>(i)].second}, static_cast<double>(r + 1),
                                   {.device = devices[r]}));
            red.grad_ready(r, i, leaf);
          } else {
            red.mark_ready(r, i);
          }
        }
        red.finalize(r);
      });
    for (auto& t : ts) t.join();
    red.end();
    for (int r = 0; r < 3; ++r) {
      const auto& st = comm.of(r);
      CHECK(st.plain == 0);
      CHECK(st.deferred > 0);
      CHECK(st.joins == joins_before + 1);  // one wait, at the end of the cycle
      CHECK(st.joined_after_work == st.works);
      REQUIRE(st.work_joins.size() > works_before);
      for (std::size_t w = works_before; w < st.work_joins.size(); ++w) CHECK(st.work_joins[w] == joins_before);
      if (!detached) {
        // Each sent piece held the rank's gradient until the work after its reduce zeroed it.
        REQUIRE(st.sent_before.size() == st.sent_after.size());
        for (std::size_t p = 0; p < st.sent_before.size(); ++p) {
          CHECK(std::all_of(st.sent_before[p].begin(), st.sent_before[p].end(), [&](float x) { return x == r + 1; }));
          CHECK(std::all_of(st.sent_after[p].begin(), st.sent_after[p].end(), [](float x) { return x == 0; }));
        }
        auto v = grads[r].to_vector();
        for (int i = 0; i < 9; ++i) CHECK(v[i] == (i / 3 == r ? 6.0f : 0.0f));
      } else {
        CHECK(owned[r].to_vector() == std::vector<float>(3, 6.0f));
      }
    }
    if (detached) CHECK(delivered.load() > 0);
    CHECK(outside.load() == 0);  // every delivery ran as work after the deferred reduces
  }
}
