// Tests of the local (shared-memory) communicator over CPU virtual devices: every
// collective against a host oracle, bitwise determinism, back-to-back generations,
// abort/reset, and errors reported on every rank instead of a hang.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "comm/local/local_communicator.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/tensor/tensor.h"
#include "test_scale.h"

using dp::comm::Communicator;
using dp::comm::ReduceOp;

// Code that catches dp::Error keeps catching an abort.
static_assert(std::is_base_of_v<dp::Error, dp::CollectiveAborted>);

namespace {

std::vector<dp::Device> cpus(int n) {
  std::vector<dp::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(dp::cpu(i));
  return d;
}

/// A communicator over cpu(0..n-1), with each device's share of the cores set as
/// DataParallel sets it (n devices work concurrently).
std::unique_ptr<Communicator> make_comm(int n) {
  dp::backend::get(dp::cpu(0)).set_concurrent_devices(n);
  return dp::comm::make_communicator(cpus(n));
}

/// Runs f(rank) on one thread per rank; returns each rank's exception (or null).
std::vector<std::exception_ptr> run_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// Rethrows the first rank's error so doctest reports it.
void expect_ok(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      FAIL("rank ", r, " threw: ", e.what());
    }
  }
}

/// Checks that every rank threw a dp::Error whose message contains `needle` (a failure
/// of its own, not dp::CollectiveAborted).
void expect_all_threw(const std::vector<std::exception_ptr>& errors, const std::string& needle) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const dp::CollectiveAborted& e) {
      FAIL("rank ", r, " threw dp::CollectiveAborted, expected a plain dp::Error: ", e.what());
    } catch (const dp::Error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    } catch (const std::exception& e) {
      FAIL("rank ", r, " threw a non-dp::Error: ", e.what());
    }
  }
}

/// Checks that every rank threw exactly dp::CollectiveAborted for `reason`, and that its
/// message names the reason, the collective `what` and the rank.
void expect_all_aborted(const std::vector<std::exception_ptr>& errors, const std::string& reason,
                        const std::string& what) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    REQUIRE(errors[r]);
    CHECK_THROWS_AS(std::rethrow_exception(errors[r]), dp::CollectiveAborted);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const dp::CollectiveAborted& e) {
      const std::string msg = e.what();
      CHECK(e.reason() == reason);
      CHECK_MESSAGE(msg.find("collective aborted: " + reason) != std::string::npos, msg);
      CHECK_MESSAGE(msg.find(dp::detail::str_cat(what, " on rank ", r, " (cpu:", r, ")")) !=
                        std::string::npos,
                    msg);
    } catch (...) {  // the type was reported by CHECK_THROWS_AS above
    }
  }
}

/// Small integers in [-6, 6]: every sum over <= 8 ranks is exact in float.
float small_value(int rank, std::int64_t i) {
  return static_cast<float>((i * 7 + rank * 3 + (i >> 5)) % 13) - 6.0f;
}

std::vector<float> rank_data(int rank, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = small_value(rank, i);
  return v;
}

std::vector<float> random_floats(std::uint32_t seed, std::int64_t n) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

/// The fixed-order reduction the communicator promises (Note [Fixed summation order]).
std::vector<float> fixed_order_reduce(const std::vector<std::vector<float>>& in,
                                      std::int64_t off, std::int64_t n, ReduceOp op) {
  std::vector<float> out(static_cast<std::size_t>(n));
  const float inv = 1.0f / static_cast<float>(in.size());
  for (std::int64_t i = 0; i < n; ++i) {
    float s = in[0][static_cast<std::size_t>(off + i)];
    for (std::size_t r = 1; r < in.size(); ++r) s += in[r][static_cast<std::size_t>(off + i)];
    if (op == ReduceOp::Average) s *= inv;
    out[static_cast<std::size_t>(i)] = s;
  }
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

dp::Tensor on(int rank, const std::vector<float>& v) {
  return dp::from_vector(v, {static_cast<std::int64_t>(v.size())}, dp::cpu(rank));
}

// Whole buffers: empty, tiny, and one above kSmallCount (the reduce-scatter path).
const std::int64_t kSizes[] = {0, 1, 7, dp_test::kLargeCount};
// Per-rank blocks (RS/AG): the largest spans several kReduceBlock blocks.
const std::int64_t kBlockSizes[] = {0, 1, 7, dp_test::kLargeCount / 8 + 1};

}  // namespace

TEST_CASE("make_communicator rejects bad device lists and picks local for CPU") {
  CHECK_THROWS_WITH_AS(dp::comm::make_communicator({}), doctest::Contains("empty"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::comm::make_communicator({dp::cpu(0), dp::cpu(1), dp::cpu(0)}),
                       doctest::Contains("cpu:0 appears twice"), dp::Error);
  const dp::Device gpu{dp::DeviceType::CUDA, 0};
  CHECK_THROWS_WITH_AS(dp::comm::make_communicator({dp::cpu(0), gpu}),
                       doctest::Contains("[cpu:0, cuda:0]"), dp::Error);
  // CUDA-only lists go to NCCL: without NCCL (or a GPU) that is a clear dp::Error.
  if (dp::device_count(dp::DeviceType::CUDA) == 0)
    CHECK_THROWS_AS(dp::comm::make_communicator({gpu}), dp::Error);
  auto comm = dp::comm::make_communicator({dp::cpu(2), dp::cpu(5)});
  CHECK(comm->backend_name() == "local");
  CHECK(comm->size() == 2);
  CHECK(comm->devices()[1] == dp::cpu(5));
  CHECK_THROWS_AS(dp::comm::make_local_communicator({dp::Device{dp::DeviceType::CPU, 99}}),
                  dp::Error);
  CHECK_THROWS_WITH_AS(dp::comm::make_communicator({dp::cpu(0)}, {.timeout = std::chrono::milliseconds(0)}),
                       doctest::Contains("expected a positive timeout, got 0 ms"), dp::Error);
}

TEST_CASE("deferred collectives of a host-synchronous communicator finish in the call") {
  // Note [Deferred collectives]: the local communicator has no stream to defer to, so
  // the result is there when the call returns and join() has nothing to do.
  const int n = 3;
  auto comm = make_comm(n);
  CHECK_FALSE(comm->times_on_device());
  std::vector<std::vector<float>> in;
  for (int r = 0; r < n; ++r) in.push_back(rank_data(r, 37));
  const std::vector<float> sum = fixed_order_reduce(in, 0, 37, ReduceOp::Sum);
  std::vector<std::vector<float>> all(n), root(n);
  expect_ok(run_ranks(n, [&](int r) {
    dp::Tensor a = on(r, in[static_cast<std::size_t>(r)]);
    comm->all_reduce_deferred(r, a, a, ReduceOp::Sum);
    all[static_cast<std::size_t>(r)] = a.to_vector();
    dp::Tensor b = on(r, in[static_cast<std::size_t>(r)]);
    comm->reduce_deferred(r, b, b, /*root=*/1, ReduceOp::Sum);
    root[static_cast<std::size_t>(r)] = b.to_vector();
    comm->join(r);
    CHECK(comm->take_times(r).windows == 0);
  }));
  for (int r = 0; r < n; ++r) CHECK(bitwise_equal(all[static_cast<std::size_t>(r)], sum));
  CHECK(bitwise_equal(root[1], sum));
}

TEST_CASE("all_reduce: every size, in and out of place, 1..8 devices, sum and average") {
  for (int n = 1; n <= 8; ++n) {
    auto comm = make_comm(n);
    for (std::int64_t count : kSizes) {
      std::vector<std::vector<float>> in;
      for (int r = 0; r < n; ++r) in.push_back(rank_data(r, count));
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
        const std::vector<float> expect = fixed_order_reduce(in, 0, count, op);
        for (bool in_place : {false, true}) {
          CAPTURE(n);
          CAPTURE(count);
          CAPTURE(in_place);
          CAPTURE(static_cast<int>(op));
          std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
          std::atomic<int> inputs_changed{0};
          expect_ok(run_ranks(n, [&](int r) {
            dp::Tensor send = on(r, in[static_cast<std::size_t>(r)]);
            dp::Tensor recv = in_place ? send : dp::full({count}, 42.0, {.device = dp::cpu(r)});
            comm->all_reduce(r, send, recv, op);
            got[static_cast<std::size_t>(r)] = recv.to_vector();
            // Out of place leaves the input alone.
            if (!in_place && !bitwise_equal(send.to_vector(), in[static_cast<std::size_t>(r)]))
              ++inputs_changed;
          }));
          CHECK(inputs_changed.load() == 0);
          for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], expect));
          }
        }
      }
    }
  }
}

TEST_CASE("broadcast from every root, reduce to every root") {
  for (int n = 1; n <= 8; ++n) {
    auto comm = make_comm(n);
    for (std::int64_t count : kSizes) {
      // Every root at small sizes; first and last root at the large one (time).
      std::vector<int> roots;
      for (int root = 0; root < n; ++root)
        if (count < 1000 || root == 0 || root == n - 1) roots.push_back(root);
      std::vector<std::vector<float>> in;
      for (int r = 0; r < n; ++r) in.push_back(rank_data(r, count));
      for (int root : roots) {
        CAPTURE(n);
        CAPTURE(count);
        CAPTURE(root);
        std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
        expect_ok(run_ranks(n, [&](int r) {
          dp::Tensor data = on(r, in[static_cast<std::size_t>(r)]);
          comm->broadcast(r, data, root);
          got[static_cast<std::size_t>(r)] = data.to_vector();
        }));
        for (int r = 0; r < n; ++r) CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], in[static_cast<std::size_t>(root)]));

        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
          const std::vector<float> expect = fixed_order_reduce(in, 0, count, op);
          for (bool in_place : {false, true}) {
            CAPTURE(in_place);
            std::vector<float> root_got;
            std::vector<std::vector<float>> sends_after(static_cast<std::size_t>(n));
            expect_ok(run_ranks(n, [&](int r) {
              dp::Tensor send = on(r, in[static_cast<std::size_t>(r)]);
              dp::Tensor recv;  // undefined on non-roots: allowed
              if (r == root) recv = in_place ? send : dp::full({count}, 42.0, {.device = dp::cpu(r)});
              comm->reduce(r, send, recv, root, op);
              if (r == root) root_got = recv.to_vector();
              sends_after[static_cast<std::size_t>(r)] = send.to_vector();
            }));
            CHECK(bitwise_equal(root_got, expect));
            for (int r = 0; r < n; ++r) {
              if (r == root && in_place) continue;
              CHECK(bitwise_equal(sends_after[static_cast<std::size_t>(r)], in[static_cast<std::size_t>(r)]));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("reduce_scatter and all_gather: every block size, in and out of place, 1..8 devices") {
  for (int n = 1; n <= 8; ++n) {
    auto comm = make_comm(n);
    for (std::int64_t block : kBlockSizes) {
      const std::int64_t total = block * n;
      std::vector<std::vector<float>> in;
      for (int r = 0; r < n; ++r) in.push_back(rank_data(r, total));
      for (bool in_place : {false, true}) {
        CAPTURE(n);
        CAPTURE(block);
        CAPTURE(in_place);
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
          const std::vector<float> full_sum = fixed_order_reduce(in, 0, total, op);
          std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
          expect_ok(run_ranks(n, [&](int r) {
            dp::Tensor send = on(r, in[static_cast<std::size_t>(r)]);
            dp::Tensor recv = in_place ? send.narrow(0, r * block, block)
                                       : dp::full({block}, 42.0, {.device = dp::cpu(r)});
            comm->reduce_scatter(r, send, recv, op);
            got[static_cast<std::size_t>(r)] = recv.to_vector();
          }));
          for (int r = 0; r < n; ++r) {
            CAPTURE(r);
            std::vector<float> expect(full_sum.begin() + r * block, full_sum.begin() + (r + 1) * block);
            CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], expect));
          }
        }
        // all_gather: rank r contributes block r of its own data.
        std::vector<float> expect(static_cast<std::size_t>(total));
        for (int r = 0; r < n; ++r)
          for (std::int64_t i = 0; i < block; ++i)
            expect[static_cast<std::size_t>(r * block + i)] = in[static_cast<std::size_t>(r)][static_cast<std::size_t>(r * block + i)];
        std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
        expect_ok(run_ranks(n, [&](int r) {
          const auto& mine = in[static_cast<std::size_t>(r)];
          std::vector<float> own(mine.begin() + r * block, mine.begin() + (r + 1) * block);
          dp::Tensor recv, send;
          if (in_place) {
            recv = on(r, mine);  // block r already holds this rank's contribution
            send = recv.narrow(0, r * block, block);
          } else {
            send = on(r, own);
            recv = dp::full({total}, 42.0, {.device = dp::cpu(r)});
          }
          comm->all_gather(r, send, recv);
          got[static_cast<std::size_t>(r)] = recv.to_vector();
        }));
        for (int r = 0; r < n; ++r) CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], expect));
      }
    }
  }
}

TEST_CASE("random floats: every rank gets the fixed-order sum, bit for bit, run after run") {
  for (int n : {2, 3, 5, 8}) {
    auto comm = make_comm(n);
    for (std::int64_t count : {std::int64_t{7}, std::int64_t{5000}, dp_test::kLargeCount}) {
      std::vector<std::vector<float>> in;
      for (int r = 0; r < n; ++r) in.push_back(random_floats(static_cast<std::uint32_t>(1000 * n + r), count));
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
        const std::vector<float> expect = fixed_order_reduce(in, 0, count, op);
        // Sanity: the order matters for these inputs (otherwise the check proves little).
        if (n >= 3 && count > 1000) {
          std::vector<float> reversed = in[static_cast<std::size_t>(n - 1)];
          for (int r = n - 2; r >= 0; --r)
            for (std::size_t i = 0; i < reversed.size(); ++i) reversed[i] += in[static_cast<std::size_t>(r)][i];
          if (op == ReduceOp::Sum) CHECK_FALSE(bitwise_equal(reversed, expect));
        }
        for (int repeat = 0; repeat < 2; ++repeat) {
          for (bool in_place : {false, true}) {
            CAPTURE(n);
            CAPTURE(count);
            CAPTURE(in_place);
            std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
            std::vector<float> root_got;
            expect_ok(run_ranks(n, [&](int r) {
              dp::Tensor send = on(r, in[static_cast<std::size_t>(r)]);
              dp::Tensor recv = in_place ? send : dp::empty({count}, dp::cpu(r));
              comm->all_reduce(r, send, recv, op);
              got[static_cast<std::size_t>(r)] = recv.to_vector();
              dp::Tensor send2 = on(r, in[static_cast<std::size_t>(r)]);
              dp::Tensor recv2;
              if (r == n - 1) recv2 = in_place ? send2 : dp::empty({count}, dp::cpu(r));
              comm->reduce(r, send2, recv2, n - 1, op);
              if (r == n - 1) root_got = recv2.to_vector();
            }));
            for (int r = 0; r < n; ++r) CHECK(bitwise_equal(got[static_cast<std::size_t>(r)], expect));
            CHECK(bitwise_equal(root_got, expect));
          }
        }
      }
    }
  }
}

TEST_CASE("100 back-to-back collectives of changing sizes keep the ranks in step") {
  const int n = 4;
  auto comm = make_comm(n);
  const std::int64_t sizes[] = {1, 0, 17, 16384, 16385, 70001, 3, 250000};
  std::atomic<int> wrong{0};
  expect_ok(run_ranks(n, [&](int r) {
    for (int it = 0; it < 100; ++it) {
      const std::int64_t count = sizes[it % 8];
      // Values depend on the iteration: a rank reading a stale or future buffer shows.
      std::vector<float> v(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>((i + it + r) % 5);
      dp::Tensor t = on(r, v);
      switch (it % 3) {
        case 0: {
          comm->all_reduce(r, t, t, ReduceOp::Sum);
          const auto out = t.to_vector();
          for (std::int64_t i = 0; i < count; ++i) {
            float e = 0;
            for (int q = 0; q < n; ++q) e += static_cast<float>((i + it + q) % 5);
            if (out[static_cast<std::size_t>(i)] != e) { ++wrong; break; }
          }
          break;
        }
        case 1: {
          const int root = it % n;
          comm->broadcast(r, t, root);
          const auto out = t.to_vector();
          for (std::int64_t i = 0; i < count; ++i)
            if (out[static_cast<std::size_t>(i)] != static_cast<float>((i + it + root) % 5)) { ++wrong; break; }
          break;
        }
        default: {
          dp::Tensor recv = dp::empty({count * n}, dp::cpu(r));
          comm->all_gather(r, t, recv);
          const auto out = recv.to_vector();
          for (int q = 0; q < n; ++q)
            for (std::int64_t i = 0; i < count; ++i)
              if (out[static_cast<std::size_t>(q * count + i)] != static_cast<float>((i + it + q) % 5)) { ++wrong; q = n; break; }
          break;
        }
      }
    }
  }));
  CHECK(wrong.load() == 0);
}

TEST_CASE("abort releases ranks blocked in a collective with CollectiveAborted; reset "
          "makes it usable again") {
  const int n = 3;
  auto comm = make_comm(n);
  std::atomic<int> waiting{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {  // rank 2 never calls
    ranks.emplace_back([&, r] {
      dp::Tensor t = dp::ones({1000}, dp::cpu(r));
      ++waiting;
      try {
        comm->all_reduce(r, t, t, ReduceOp::Sum);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  while (waiting.load() < 2) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  comm->abort("worker on cpu:2 failed");
  for (auto& t : ranks) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(secs < 1.0);
  expect_all_aborted(errors, "worker on cpu:2 failed", "all_reduce");

  // Every later call throws at once, naming its own collective and rank; a second
  // abort keeps the first reason.
  comm->abort("a later failure");
  dp::Tensor t0 = dp::ones({6}, dp::cpu(0));
  dp::Tensor r0 = dp::ones({2}, dp::cpu(0));
  dp::Tensor g0 = dp::ones({18}, dp::cpu(0));
  CHECK_THROWS_AS(comm->all_reduce(0, t0, t0, ReduceOp::Sum), dp::CollectiveAborted);
  CHECK_THROWS_AS(comm->broadcast(0, t0, 0), dp::CollectiveAborted);
  CHECK_THROWS_AS(comm->reduce(0, t0, t0, 0, ReduceOp::Sum), dp::CollectiveAborted);
  CHECK_THROWS_AS(comm->reduce_scatter(0, t0, r0, ReduceOp::Sum), dp::CollectiveAborted);
  CHECK_THROWS_AS(comm->all_gather(0, t0, g0), dp::CollectiveAborted);
  CHECK_THROWS_AS(comm->synchronize(0), dp::CollectiveAborted);
  CHECK_THROWS_WITH_AS(comm->broadcast(1, t0, 0),
                       doctest::Contains("broadcast on rank 1 (cpu:1) of the local communicator: "
                                         "collective aborted: worker on cpu:2 failed"),
                       dp::CollectiveAborted);
  // Bad input on an aborted communicator still says aborted (the state explains it).
  CHECK_THROWS_AS(comm->all_reduce(0, t0, r0, ReduceOp::Sum), dp::CollectiveAborted);

  comm->reset();
  comm->synchronize(0);
  std::vector<std::vector<float>> got(n);
  expect_ok(run_ranks(n, [&](int r) {
    dp::Tensor t = dp::full({5}, static_cast<double>(r + 1), {.device = dp::cpu(r)});
    comm->all_reduce(r, t, t, ReduceOp::Sum);
    got[static_cast<std::size_t>(r)] = t.to_vector();
  }));
  for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == std::vector<float>(5, 6.0f));
}

TEST_CASE("a barrier aborted while a rank arrives never parks it for good") {
  // The abort may land at any point of arrive_and_wait (before, between its reads, while
  // it waits): the rank must return false every time. A hang here is the failure (the
  // suite's timeout).
  for (int i = 0; i < 20000; ++i) {
    dp::comm::detail::Barrier barrier(2);
    std::atomic<bool> go{false};
    std::thread aborter([&] {
      while (!go.load(std::memory_order_acquire)) {
      }
      barrier.abort("injected");
    });
    go.store(true, std::memory_order_release);
    const bool released = barrier.arrive_and_wait();
    aborter.join();
    REQUIRE_FALSE(released);
    REQUIRE(barrier.reason() == "injected");
  }
}

TEST_CASE("abort at any point of a stream of collectives releases every rank") {
  const int n = 4;
  auto comm = make_comm(n);
  // Buffers outlive the threads: a rank released by the abort may leave while another
  // still reads its buffers (Communicator::abort).
  std::vector<dp::Tensor> bufs;
  for (int r = 0; r < n; ++r) bufs.push_back(dp::ones({40000}, dp::cpu(r)));  // large path
  std::atomic<int> started{0};
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      dp::Tensor& t = bufs[static_cast<std::size_t>(r)];
      try {
        for (int it = 0;; ++it) {  // ends only by the abort
          ReduceOp op = it % 2 == 0 ? ReduceOp::Sum : ReduceOp::Average;
          comm->all_reduce(r, t, t, op);
          if (it == 0) ++started;
          comm->broadcast(r, t, it % n);
        }
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  while (started.load() < n) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  comm->abort("stop");
  for (auto& t : ranks) t.join();
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    REQUIRE(errors[r]);
    CHECK_THROWS_AS(std::rethrow_exception(errors[r]), dp::CollectiveAborted);
  }
  comm->reset();
  std::vector<std::vector<float>> got(n);
  expect_ok(run_ranks(n, [&](int r) {
    dp::Tensor t = dp::full({7}, 2.0, {.device = dp::cpu(r)});
    comm->all_reduce(r, t, t, ReduceOp::Sum);
    got[static_cast<std::size_t>(r)] = t.to_vector();
  }));
  for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == std::vector<float>(7, 8.0f));
}

TEST_CASE("a rank released by an abort returns only once no rank still reads its buffers") {
  // Note [Leaving an aborted collective]: the root of a broadcast reads nothing, so it
  // waits at the closing barrier while the other rank still copies its data; an abort
  // then releases it. It must not return before the copy is done: its caller would
  // free or overwrite the data under the reader. Here it overwrites it at once.
  const int n = 2;
  auto comm = make_comm(n);
  const std::int64_t count = (dp_test::kSanitized ? std::int64_t{4} : std::int64_t{32}) << 20;  // 128 MiB: a long copy
  dp::Tensor data = dp::full({count}, 1.0, {.device = dp::cpu(0)});
  dp::Tensor recv = dp::zeros({count}, dp::cpu(1));
  std::atomic<int> entered{0};
  std::thread aborter([&] {
    while (entered.load() < n) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the root is at its barrier by now
    comm->abort("stop");
  });
  auto errors = run_ranks(n, [&](int r) {
    entered.fetch_add(1);
    try {
      comm->broadcast(r, r == 0 ? data : recv, 0);
    } catch (const dp::CollectiveAborted&) {
      if (r == 0) std::fill_n(data.mutable_data<float>(), count, -1.0f);  // what a caller may do now
      throw;
    }
  });
  aborter.join();
  // Whether the abort came before or after the copy, rank 1 never saw the root's later writes.
  const float* got = recv.data<float>();
  std::int64_t seen_later = 0;
  for (std::int64_t i = 0; i < count; ++i) seen_later += got[i] == -1.0f ? 1 : 0;
  CHECK(seen_later == 0);
  comm->reset();
}

TEST_CASE("mismatched calls are an error on every rank, never a hang") {
  const int n = 3;
  auto comm = make_comm(n);
  SUBCASE("different counts") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({r == 1 ? 11 : 10}, dp::cpu(r));
      comm->all_reduce(r, t, t, ReduceOp::Sum);
    }), "ranks disagree");
  }
  SUBCASE("different collectives") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({10}, dp::cpu(r));
      if (r == 2) comm->broadcast(r, t, 0);
      else comm->all_reduce(r, t, t, ReduceOp::Sum);
    }), "ranks disagree");
  }
  SUBCASE("different roots") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({10}, dp::cpu(r));
      comm->broadcast(r, t, r == 0 ? 1 : 0);
    }), "ranks disagree");
  }
  SUBCASE("one rank passes a tensor on the wrong device") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({10}, dp::cpu(r == 1 ? 0 : r));
      comm->all_reduce(r, t, t, ReduceOp::Sum);
    }), "cpu:0 but this rank's device is cpu:1");
  }
  SUBCASE("one rank passes int64") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({10}, {.dtype = r == 2 ? dp::Dtype::Int64 : dp::Dtype::Float32,
                                     .device = dp::cpu(r)});
      comm->all_reduce(r, t, t, ReduceOp::Sum);
    }), "int64");
  }
  SUBCASE("reduce_scatter with a wrong recv size") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor send = dp::ones({12}, dp::cpu(r));
      dp::Tensor recv = dp::ones({5}, dp::cpu(r));
      comm->reduce_scatter(r, send, recv, ReduceOp::Sum);
    }), "reduce_scatter needs send = 3 x recv");
  }
  SUBCASE("broadcast root out of range") {
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({10}, dp::cpu(r));
      comm->broadcast(r, t, 3);
    }), "root 3 is out of range");
  }
  // After every failure the communicator still works (the ranks stayed in step).
  std::vector<std::vector<float>> got(n);
  expect_ok(run_ranks(n, [&](int r) {
    dp::Tensor t = dp::ones({33}, dp::cpu(r));
    comm->all_reduce(r, t, t, ReduceOp::Sum);
    got[static_cast<std::size_t>(r)] = t.to_vector();
  }));
  for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == std::vector<float>(33, 3.0f));
}

TEST_CASE("a bad rank is rejected at once") {
  auto comm = make_comm(2);
  dp::Tensor t = dp::ones({4}, dp::cpu(0));
  CHECK_THROWS_WITH_AS(comm->all_reduce(2, t, t, ReduceOp::Sum),
                       doctest::Contains("rank 2 is out of range"), dp::Error);
  CHECK_THROWS_AS(comm->broadcast(-1, t, 0), dp::Error);
  CHECK_THROWS_AS(comm->synchronize(5), dp::Error);
  comm->synchronize(0);
}

// Note [Checked collectives]: every bad argument, one test each, reported on every
// rank (the bad one names its problem, the others name the bad rank), with one message
// shape on every rank: the collective, the rank and its device, the communicator.
TEST_CASE("checked collectives: every bad argument fails every rank with a message naming it") {
  const int n = 3;
  auto comm = make_comm(n);
  // Runs f on every rank; all must throw a plain dp::Error; rank `bad` must name
  // `needle` and the others that rank.
  auto expect = [&](const char* label, int bad, const std::string& needle, const std::function<void(int)>& f) {
    CAPTURE(label);
    const std::vector<std::exception_ptr> errors = run_ranks(n, f);
    expect_all_threw(errors, needle);
    for (int r = 0; r < n; ++r) {
      if (r == bad) continue;
      CAPTURE(r);
      expect_all_threw({errors[static_cast<std::size_t>(r)]},
                       dp::detail::str_cat("rank ", bad, " (cpu:", bad, ") failed"));
    }
  };
  auto dev = [](int r) { return dp::cpu(r); };
  expect("all_reduce: recv size", 1, "recv has 9 elements but send has 8", [&](int r) {
    comm->all_reduce(r, dp::zeros({8}, dev(r)), dp::zeros({r == 1 ? 9 : 8}, dev(r)), ReduceOp::Sum);
  });
  expect("all_reduce: undefined recv", 2, "recv is undefined; pass a tensor on cpu:2", [&](int r) {
    dp::Tensor t = dp::zeros({8}, dev(r));
    comm->all_reduce(r, t, r == 2 ? dp::Tensor() : t, ReduceOp::Sum);
  });
  expect("all_reduce: recv dtype differs from send", 0, "recv has dtype int32", [&](int r) {
    dp::Tensor t = dp::zeros({8}, dev(r));
    comm->all_reduce(r, t, r == 0 ? dp::zeros({8}, {.dtype = dp::Dtype::Int32, .device = dev(r)}) : t,
                     ReduceOp::Sum);
  });
  expect("all_gather: recv dtype differs from send", 1, "recv has dtype int32 but send has float32; they must match",
         [&](int r) {
           comm->all_gather(r, dp::zeros({4}, dev(r)),
                            dp::zeros({12}, {.dtype = r == 1 ? dp::Dtype::Int32 : dp::Dtype::Float32,
                                             .device = dev(r)}));
         });
  expect("reduce_scatter: an integer dtype", 2,
         "send has dtype int32, which reduce_scatter does not take on the local communicator (it takes float32, bfloat16, float16)",
         [&](int r) {
           const dp::Dtype d = r == 2 ? dp::Dtype::Int32 : dp::Dtype::Float32;
           comm->reduce_scatter(r, dp::zeros({6}, {.dtype = d, .device = dev(r)}),
                                dp::zeros({2}, {.dtype = d, .device = dev(r)}), ReduceOp::Sum);
         });
  expect("reduce: root out of range", 1, "root -1 is out of range (expected a world rank 0..2)", [&](int r) {
    dp::Tensor t = dp::zeros({4}, dev(r));
    comm->reduce(r, t, t, r == 1 ? -1 : 0, ReduceOp::Sum);
  });
  expect("reduce: the root's recv size", 0, "recv has 5 elements but send has 4", [&](int r) {
    comm->reduce(r, dp::zeros({4}, dev(r)), r == 0 ? dp::zeros({5}, dev(r)) : dp::Tensor(), 0, ReduceOp::Sum);
  });
  expect("reduce: the root's recv on another device", 0, "recv (on the root) lives on cpu:1", [&](int r) {
    comm->reduce(r, dp::zeros({4}, dev(r)), r == 0 ? dp::zeros({4}, dev(1)) : dp::Tensor(), 0, ReduceOp::Sum);
  });
  expect("all_gather: block sizes", 1, "all_gather needs recv = 3 x send", [&](int r) {
    comm->all_gather(r, dp::zeros({4}, dev(r)), dp::zeros({r == 1 ? 11 : 12}, dev(r)));
  });
  expect("all_gather: send overlaps recv but is not its own block", 2, "is not recv's block 2", [&](int r) {
    dp::Tensor all = dp::zeros({12}, dev(r));
    comm->all_gather(r, all.narrow(0, r == 2 ? 0 : 4 * r, 4), all);
  });
  expect("broadcast: data on another device", 1, "data lives on cpu:2 but this rank's device is cpu:1", [&](int r) {
    comm->broadcast(r, dp::zeros({4}, dev(r == 1 ? 2 : r)), 0);
  });
  // Arguments each fine on their own rank, but the ranks' calls differ in dtype.
  expect_all_threw(run_ranks(n, [&](int r) {
    comm->broadcast(r, dp::zeros({4}, {.dtype = r == 1 ? dp::Dtype::Int64 : dp::Dtype::Float32, .device = dev(r)}), 0);
  }), "ranks disagree: rank 0 (cpu:0) called broadcast(count 4, float32, root 0), rank 1 (cpu:1) called "
      "broadcast(count 4, int64, root 0)");
  // The message starts where the call was made.
  const std::vector<std::exception_ptr> errors = run_ranks(n, [&](int r) {
    comm->all_reduce(r, dp::zeros({8}, dev(r)), dp::zeros({r == 1 ? 9 : 8}, dev(r)), ReduceOp::Sum);
  });
  expect_all_threw({errors[1]}, "all_reduce on rank 1 (cpu:1) of the local communicator: recv has 9 elements");
  // After every refusal the ranks are still in step.
  std::vector<std::vector<float>> got(n);
  expect_ok(run_ranks(n, [&](int r) {
    dp::Tensor t = dp::ones({5}, dev(r));
    comm->all_reduce(r, t, t, ReduceOp::Sum);
    got[static_cast<std::size_t>(r)] = t.to_vector();
  }));
  for (int r = 0; r < n; ++r) CHECK(got[static_cast<std::size_t>(r)] == std::vector<float>(5, 3.0f));
}

TEST_CASE("checked collectives: a bad rank throws at once, naming the collective and the ranks") {
  auto comm = make_comm(2);
  dp::Tensor t = dp::ones({4}, dp::cpu(0));
  CHECK_THROWS_WITH_AS(comm->reduce_scatter(-1, t, dp::ones({2}, dp::cpu(0)), ReduceOp::Sum),
                       doctest::Contains("reduce_scatter: rank -1 is out of range for the local communicator "
                                         "(expected 0..1)"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(comm->all_reduce_deferred(2, t, t, ReduceOp::Sum),
                       doctest::Contains("all_reduce: rank 2 is out of range"), dp::Error);
  CHECK_THROWS_WITH_AS(comm->reduce_deferred(7, t, t, 0, ReduceOp::Sum),
                       doctest::Contains("reduce: rank 7 is out of range"), dp::Error);
  CHECK_THROWS_WITH_AS(comm->all_gather(3, t, t), doctest::Contains("all_gather: rank 3 is out of range"),
                       dp::Error);
}

// The dtype table of Note [Collective dtypes], as the local communicator fills it.
TEST_CASE("collective dtypes: the local communicator moves every dtype and reduces float32") {
  auto comm = make_comm(2);
  for (dp::Dtype d : {dp::Dtype::Float32, dp::Dtype::Int64, dp::Dtype::Int32}) {
    CAPTURE(dp::dtype_name(d));
    CHECK(comm->supports(Communicator::Collective::Broadcast, d));
    CHECK(comm->supports(Communicator::Collective::AllGather, d));
    const bool reduces = d == dp::Dtype::Float32;
    CHECK(comm->supports(Communicator::Collective::AllReduce, d) == reduces);
    CHECK(comm->supports(Communicator::Collective::Reduce, d) == reduces);
    CHECK(comm->supports(Communicator::Collective::ReduceScatter, d) == reduces);
  }
}

TEST_CASE("collective dtypes: int64 and int32 broadcast and all_gather move every bit") {
  const int n = 3;
  auto comm = make_comm(n);
  // Values no float holds exactly: a float path would change them.
  auto big = [](int r, std::int64_t i) { return (std::int64_t{1} << 53) + 1 + r * 1000003 + i * 7; };
  for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{37}, dp_test::kLargeCount / 4 + 3}) {
    CAPTURE(count);
    std::vector<std::vector<std::int64_t>> bcast(n), gathered(n);
    std::vector<std::vector<std::int32_t>> gathered32(n);
    expect_ok(run_ranks(n, [&](int r) {
      std::vector<std::int64_t> mine(static_cast<std::size_t>(count));
      std::vector<std::int32_t> mine32(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) {
        mine[static_cast<std::size_t>(i)] = big(r, i);
        mine32[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(-(r * 100000 + i));
      }
      dp::Tensor data = dp::from_vector(mine, {count}, dp::cpu(r));
      comm->broadcast(r, data, 1);
      bcast[static_cast<std::size_t>(r)] = data.to_vector_i64();
      dp::Tensor all = dp::zeros({count * n}, {.dtype = dp::Dtype::Int64, .device = dp::cpu(r)});
      comm->all_gather(r, dp::from_vector(mine, {count}, dp::cpu(r)), all);
      gathered[static_cast<std::size_t>(r)] = all.to_vector_i64();
      // In place: send is this rank's block of recv.
      dp::Tensor all32 = dp::zeros({count * n}, {.dtype = dp::Dtype::Int32, .device = dp::cpu(r)});
      if (count > 0)
        std::memcpy(all32.mutable_data<std::int32_t>() + count * r, mine32.data(),
                    mine32.size() * sizeof(std::int32_t));
      comm->all_gather(r, all32.narrow(0, count * r, count), all32);
      gathered32[static_cast<std::size_t>(r)] = all32.to_vector_i32();
    }));
    std::vector<std::int64_t> want_bcast(static_cast<std::size_t>(count)), want(static_cast<std::size_t>(count * n));
    std::vector<std::int32_t> want32(static_cast<std::size_t>(count * n));
    for (std::int64_t i = 0; i < count; ++i) {
      want_bcast[static_cast<std::size_t>(i)] = big(1, i);
      for (int q = 0; q < n; ++q) {
        want[static_cast<std::size_t>(q * count + i)] = big(q, i);
        want32[static_cast<std::size_t>(q * count + i)] = static_cast<std::int32_t>(-(q * 100000 + i));
      }
    }
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(bcast[static_cast<std::size_t>(r)] == want_bcast);
      CHECK(gathered[static_cast<std::size_t>(r)] == want);
      CHECK(gathered32[static_cast<std::size_t>(r)] == want32);
    }
  }
}

TEST_CASE("collective dtypes: an integer reduction is a dp::Error naming the dtypes reductions take") {
  const int n = 2;
  auto comm = make_comm(n);
  for (dp::Dtype d : {dp::Dtype::Int64, dp::Dtype::Int32}) {
    CAPTURE(dp::dtype_name(d));
    const std::string taken = dp::detail::str_cat("has dtype ", dp::dtype_name(d), ", which ");
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({4}, {.dtype = d, .device = dp::cpu(r)});
      comm->all_reduce(r, t, t, ReduceOp::Sum);
    }), taken + "all_reduce does not take on the local communicator (it takes float32, bfloat16, float16)");
    expect_all_threw(run_ranks(n, [&](int r) {
      dp::Tensor t = dp::ones({4}, {.dtype = d, .device = dp::cpu(r)});
      comm->reduce(r, t, t, 0, ReduceOp::Average);
    }), taken + "reduce does not take");
  }
}
