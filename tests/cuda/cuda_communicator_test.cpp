// tests/cuda/cuda_communicator_test.cpp — the CUDA communicators against the CPU local
// communicator on the same inputs.
//
// Over every visible CUDA device (up to 8): with DP_CUDA_DEVICES_PER_GPU=k > 1 the
// devices share GPUs and make_communicator gives the CUDA copy communicator, whose sums
// must be BITWISE the local communicator's (Note [CUDA copy communicator]); with one
// device per GPU it gives NCCL, whose summation order is its own (tolerance). Each rank
// is driven by its own thread, as DataParallel does. Without a CUDA device the binary
// exits 77 (SKIP); with one device (k = 1) the cases that need two are skipped inside.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_test_main.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dp/dp.h"

namespace {

using dp::Tensor;
using dp::comm::ReduceOp;

std::vector<dp::Device> devices_of(dp::DeviceType type, int n) {
  std::vector<dp::Device> out;
  for (int i = 0; i < n; ++i) out.push_back(type == dp::DeviceType::CUDA ? dp::cuda(i) : dp::cpu(i));
  return out;
}

int rank_count() { return std::min(dp::device_count(dp::DeviceType::CUDA), 8); }

/// Runs f(rank) on one thread per rank; rethrows the first failure.
void on_ranks(int n, const std::function<void(int)>& f) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

/// Input of rank r: values of mixed magnitude, so that the summation order shows.
std::vector<float> input(int r, std::int64_t n) {
  std::mt19937 gen(static_cast<unsigned>(1000 + r));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = u(gen) * std::pow(10.0f, static_cast<float>(r % 4) - 2.0f);
  return v;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

/// One collective on every rank of a communicator over `devs`; each rank's result.
using Body = std::function<Tensor(dp::comm::Communicator&, int, dp::Device)>;
std::vector<std::vector<float>> run(const std::vector<dp::Device>& devs, const Body& body) {
  auto comm = dp::comm::make_communicator(devs);
  std::vector<std::vector<float>> out(devs.size());
  on_ranks(static_cast<int>(devs.size()), [&](int r) {
    const Tensor t = body(*comm, r, devs[static_cast<std::size_t>(r)]);
    comm->synchronize(r);
    out[static_cast<std::size_t>(r)] = t.to_vector();
  });
  return out;
}

bool shares_gpu() {
  const char* k = std::getenv("DP_CUDA_DEVICES_PER_GPU");
  return k != nullptr && std::atoi(k) > 1;
}

/// The CUDA run against the CPU one: bitwise for the copy communicator, else close.
void compare(const Body& body) {
  const int n = rank_count();
  const auto got = run(devices_of(dp::DeviceType::CUDA, n), body);
  const auto ref = run(devices_of(dp::DeviceType::CPU, n), body);
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    if (shares_gpu()) {
      CHECK(max_diff(got[static_cast<std::size_t>(r)], ref[static_cast<std::size_t>(r)]) == 0.0);
    } else {
      CHECK(max_diff(got[static_cast<std::size_t>(r)], ref[static_cast<std::size_t>(r)]) < 1e-4);
    }
  }
}

// Sizes: one element, an odd count (scalar tail of the float4 path), and one that
// gives every rank a slice of several 16-float blocks.
constexpr std::int64_t kSizes[] = {1, 1001, 100003};

}  // namespace

TEST_CASE("make_communicator picks the copy communicator for devices sharing a GPU") {
  const int n = rank_count();
  if (n < 2) return;
  auto comm = dp::comm::make_communicator(devices_of(dp::DeviceType::CUDA, n));
  CHECK(comm->backend_name() == (shares_gpu() ? "cuda-copy" : "nccl"));
}

TEST_CASE("all_reduce (sum, average; in place and not; plain and deferred) matches the CPU") {
  if (rank_count() < 2) return;
  for (std::int64_t count : kSizes) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
      for (int variant = 0; variant < 3; ++variant) {  // in place, out of place, deferred
        CAPTURE(count);
        CAPTURE(variant);
        compare([&](dp::comm::Communicator& c, int r, dp::Device d) {
          Tensor x = dp::from_vector(input(r, count), {count}, d);
          if (variant == 1) {
            Tensor y = dp::zeros({count}, d);
            c.all_reduce(r, x, y, op);
            return y;
          }
          if (variant == 2) {
            c.all_reduce_deferred(r, x, x, op);
            c.join(r);
            return x;
          }
          c.all_reduce(r, x, x, op);
          return x;
        });
      }
    }
  }
}

TEST_CASE("reduce, broadcast, reduce_scatter and all_gather match the CPU") {
  const int n = rank_count();
  if (n < 2) return;
  for (std::int64_t count : kSizes) {
    CAPTURE(count);
    const int root = n - 1;
    compare([&](dp::comm::Communicator& c, int r, dp::Device d) {
      Tensor x = dp::from_vector(input(r, count), {count}, d);
      c.reduce(r, x, x, root, ReduceOp::Sum);
      return r == root ? x : dp::zeros({1}, d);
    });
    compare([&](dp::comm::Communicator& c, int r, dp::Device d) {
      Tensor x = dp::from_vector(input(r, count), {count}, d);
      c.broadcast(r, x, 1);
      return x;
    });
    compare([&](dp::comm::Communicator& c, int r, dp::Device d) {
      Tensor x = dp::from_vector(input(r, count * n), {count * n}, d);
      Tensor y = dp::zeros({count}, d);
      c.reduce_scatter(r, x, y, ReduceOp::Average);
      return y;
    });
    compare([&](dp::comm::Communicator& c, int r, dp::Device d) {
      Tensor x = dp::from_vector(input(r, count * n), {count * n}, d);
      Tensor mine = x.narrow(0, r * count, count);
      c.reduce_scatter(r, x, mine, ReduceOp::Sum);  // in place: its own block
      return mine.clone();
    });
    compare([&](dp::comm::Communicator& c, int r, dp::Device d) {
      Tensor x = dp::from_vector(input(r, count), {count}, d);
      Tensor y = dp::zeros({count * n}, d);
      c.all_gather(r, x, y);
      return y;
    });
  }
}

// Note [Collective dtypes]: bfloat16 and float16 reductions sum in float and round once.
// The copy communicator once read 16-bit buffers as float32 (offsets, slice copies and
// sums in floats): its results were garbage and its slice copies ran past recv's end. It
// must now give the local communicator's bits; NCCL rounds at each hop of its own
// order, so it is held to n roundings of the largest partial sum.
TEST_CASE("bfloat16 and float16 all_reduce, reduce and reduce_scatter match the CPU") {
  const int n = rank_count();
  if (n < 2) return;
  for (dp::Dtype dtype : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    // input() is below 10 in magnitude: a partial sum of n ranks is below 10 n.
    const double unit = dtype == dp::Dtype::BFloat16 ? 0x1p-8 : 0x1p-11;
    const double tol = shares_gpu() ? 0.0 : n * unit * 10.0 * n;
    for (std::int64_t count : kSizes) {
      CAPTURE(std::string(dp::dtype_name(dtype)));
      CAPTURE(count);
      auto check = [&](const Body& body) {
        const auto got = run(devices_of(dp::DeviceType::CUDA, n), body);
        const auto ref = run(devices_of(dp::DeviceType::CPU, n), body);
        for (int r = 0; r < n; ++r) {
          CAPTURE(r);
          CHECK(max_diff(got[static_cast<std::size_t>(r)], ref[static_cast<std::size_t>(r)]) <= tol);
        }
      };
      auto in = [&](int r, std::int64_t len, dp::Device d) { return dp::from_vector(input(r, len), {len}, d).to(dtype); };
      check([&](dp::comm::Communicator& c, int r, dp::Device d) {
        Tensor x = in(r, count, d);
        c.all_reduce(r, x, x, ReduceOp::Sum);
        return x.to(dp::Dtype::Float32);
      });
      check([&](dp::comm::Communicator& c, int r, dp::Device d) {
        Tensor x = in(r, count, d);
        Tensor y = dp::zeros({count}, dp::TensorOptions{dtype, d});
        c.all_reduce(r, x, y, ReduceOp::Average);
        return y.to(dp::Dtype::Float32);
      });
      const int root = n - 1;
      check([&](dp::comm::Communicator& c, int r, dp::Device d) {
        Tensor x = in(r, count, d);
        c.reduce(r, x, x, root, ReduceOp::Sum);
        return r == root ? x.to(dp::Dtype::Float32) : dp::zeros({1}, d);
      });
      check([&](dp::comm::Communicator& c, int r, dp::Device d) {
        Tensor x = in(r, count * n, d);
        Tensor y = dp::zeros({count}, dp::TensorOptions{dtype, d});
        c.reduce_scatter(r, x, y, ReduceOp::Sum);
        return y.to(dp::Dtype::Float32);
      });
    }
  }
}

// Note [Collective dtypes]: NCCL and the copy communicator move int64 and int32 bit for
// bit (the same values as the CPU), and refuse an integer reduction with a dp::Error on
// the calling thread (nccl) or on every rank (cuda-copy) before any rank waits.
TEST_CASE("int64 and int32 broadcast and all_gather move every bit; integer reductions are refused") {
  const int n = rank_count();
  if (n < 2) return;
  auto devs = devices_of(dp::DeviceType::CUDA, n);
  auto comm = dp::comm::make_communicator(devs);
  // Values no float holds exactly: a float path would change them.
  auto big = [](int r, std::int64_t i) { return (std::int64_t{1} << 53) + 1 + r * 1000003 + i * 7; };
  for (std::int64_t count : kSizes) {
    CAPTURE(count);
    std::vector<std::vector<std::int64_t>> bcast(static_cast<std::size_t>(n)), gathered(static_cast<std::size_t>(n));
    std::vector<std::vector<std::int32_t>> gathered32(static_cast<std::size_t>(n));
    on_ranks(n, [&](int r) {
      const dp::Device d = devs[static_cast<std::size_t>(r)];
      std::vector<std::int64_t> mine(static_cast<std::size_t>(count));
      std::vector<std::int32_t> mine32(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) {
        mine[static_cast<std::size_t>(i)] = big(r, i);
        mine32[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(-(r * 100000 + i));
      }
      Tensor b = dp::from_vector(mine, {count}, d);
      comm->broadcast(r, b, 1);
      Tensor all = dp::zeros({count * n}, {.dtype = dp::Dtype::Int64, .device = d});
      comm->all_gather(r, dp::from_vector(mine, {count}, d), all);
      Tensor all32 = dp::zeros({count * n}, {.dtype = dp::Dtype::Int32, .device = d});
      comm->all_gather(r, dp::from_vector(mine32, {count}, d), all32);
      comm->synchronize(r);
      bcast[static_cast<std::size_t>(r)] = b.to_vector_i64();
      gathered[static_cast<std::size_t>(r)] = all.to_vector_i64();
      gathered32[static_cast<std::size_t>(r)] = all32.to_vector_i32();
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      for (std::int64_t i = 0; i < count; ++i) {
        REQUIRE(bcast[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] == big(1, i));
        for (int q = 0; q < n; ++q) {
          const auto at = static_cast<std::size_t>(q * count + i);
          REQUIRE(gathered[static_cast<std::size_t>(r)][at] == big(q, i));
          REQUIRE(gathered32[static_cast<std::size_t>(r)][at] == static_cast<std::int32_t>(-(q * 100000 + i)));
        }
      }
    }
  }
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  on_ranks(n, [&](int r) {
    Tensor x = dp::ones({4}, {.dtype = dp::Dtype::Int64, .device = devs[static_cast<std::size_t>(r)]});
    try {
      comm->all_reduce(r, x, x, ReduceOp::Sum);
    } catch (const dp::Error& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (const std::string& e : errors) CHECK_MESSAGE(e.find("all_reduce does not take") != std::string::npos, e);
}

TEST_CASE("ranks that disagree fail alike with a dp::Error, and the communicator stays usable") {
  const int n = rank_count();
  if (n < 2 || !shares_gpu()) return;  // NCCL would hang: mismatches are the caller's contract there
  auto devs = devices_of(dp::DeviceType::CUDA, n);
  auto comm = dp::comm::make_communicator(devs);
  std::vector<int> failed(static_cast<std::size_t>(n), 0);
  on_ranks(n, [&](int r) {
    Tensor x = dp::zeros({r == 0 ? 8 : 9}, devs[static_cast<std::size_t>(r)]);
    try {
      comm->all_reduce(r, x, x, ReduceOp::Sum);
    } catch (const dp::Error& e) {
      failed[static_cast<std::size_t>(r)] = std::string(e.what()).find("ranks disagree") != std::string::npos;
    }
    Tensor ok = dp::ones({5}, devs[static_cast<std::size_t>(r)]);
    comm->all_reduce(r, ok, ok, ReduceOp::Sum);
    comm->synchronize(r);
    CHECK(ok.to_vector()[4] == static_cast<float>(n));
  });
  for (int f : failed) CHECK(f == 1);
}

TEST_CASE("a rank that never calls makes the others time out naming it; reset() makes it usable again") {
  const int n = rank_count();
  if (n < 2 || !shares_gpu()) return;  // the NCCL communicator's watchdog is tested elsewhere
  auto devs = devices_of(dp::DeviceType::CUDA, n);
  auto comm = dp::comm::make_communicator(devs, {.timeout = std::chrono::milliseconds(300)});
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  on_ranks(n, [&](int r) {
    if (r == n - 1) return;  // the missing rank
    Tensor x = dp::ones({16}, devs[static_cast<std::size_t>(r)]);
    try {
      comm->all_reduce(r, x, x, ReduceOp::Sum);
    } catch (const dp::CollectiveAborted& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (int r = 0; r + 1 < n; ++r) {
    CAPTURE(errors[static_cast<std::size_t>(r)]);
    CHECK(errors[static_cast<std::size_t>(r)].find("timed out") != std::string::npos);
    CHECK(errors[static_cast<std::size_t>(r)].find("rank(s) " + std::to_string(n - 1)) != std::string::npos);
  }
  comm->reset();
  on_ranks(n, [&](int r) {
    Tensor ok = dp::ones({5}, devs[static_cast<std::size_t>(r)]);
    comm->all_reduce(r, ok, ok, ReduceOp::Sum);
    comm->synchronize(r);
    CHECK(ok.to_vector()[4] == static_cast<float>(n));
  });
}

TEST_CASE("a device-to-device copy leaves the source stream free of the destination's work") {
  const int n = rank_count();
  if (n < 2) return;
  // Ordering, not timing: a copy to cuda:1 while cuda:1 is busy must still deliver the
  // bytes, and a later write to the source on cuda:0 must not reach the copy.
  Tensor src = dp::from_vector(input(0, 1 << 20), {1 << 20}, dp::cuda(0));
  const std::vector<float> expected = src.to_vector();
  Tensor big = dp::ones({1 << 22}, dp::cuda(1));
  for (int i = 0; i < 20; ++i) big.mul_(1.0001f);  // queue work on cuda:1
  Tensor dst = src.to(dp::cuda(1));
  src.mul_(0.0f);  // after the copy in cuda:0's order
  CHECK(max_diff(dst.to_vector(), expected) == 0.0);
  CHECK(max_diff(src.to_vector(), std::vector<float>(expected.size(), 0.0f)) == 0.0);
}

int main(int argc, char** argv) { return dp_test::run_if_cuda("cuda_communicator_test", argc, argv); }
