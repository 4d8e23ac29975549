// Tests of dp::dist and the mpi communicator, run as one process (a world of one) and
// under mpirun with 2 and 3 processes (tests/dist/run_mpi.py). Every process runs the
// same test cases in the same order — each one is a sequence of collectives — and
// checks its results against values it computes itself; results must also be bitwise
// equal to rank 0's. `dist_test --fault=MODE` runs one failure scenario instead: one
// process dies, throws, hangs or leaves, and the job must end, non-zero, in seconds;
// `dist_test --finalize` checks an explicit, repeated dp::dist::finalize().
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "dp/comm/communicator.h"
#include "dp/comm/mpi_communicator.h"
#include "dp/core/error.h"
#include "dp/core/half.h"
#include "dp/data/sampler.h"
#include "dp/dist/dist.h"
#include "dp/tensor/tensor.h"

namespace dist = dp::dist;
using dp::comm::ReduceOp;

namespace {

/// The world size this run was started with (mpirun says so in the environment).
int expected_world_size() {
  const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
  return n != nullptr && dist::built_with_mpi() ? std::atoi(n) : 1;
}

/// Input element i of rank r: magnitudes from 1e-3 to 1e5 and both signs, so a float
/// sum in another order would differ in its last bits.
float input(int r, std::int64_t i) {
  const std::uint64_t h = (static_cast<std::uint64_t>(r) * 0x9e3779b97f4a7c15ULL) ^
                          (static_cast<std::uint64_t>(i) * 0xbf58476d1ce4e5b9ULL);
  const double u = static_cast<double>((h >> 11) % 1000003) / 1000003.0;  // [0, 1)
  const double mag = std::pow(10.0, -3.0 + 8.0 * u);
  return static_cast<float>(((h >> 3) & 1) ? mag : -mag);
}

std::vector<float> inputs(int r, std::int64_t n, std::int64_t offset = 0) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = input(r, offset + i);
  return v;
}

/// The reduction dp promises: rank order, then * (1 / P) for Average.
std::vector<float> expected_reduce(int p, std::int64_t n, ReduceOp op, std::int64_t offset = 0) {
  std::vector<float> out = inputs(0, n, offset);
  for (int r = 1; r < p; ++r) {
    const std::vector<float> x = inputs(r, n, offset);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] += x[i];
  }
  if (op == ReduceOp::Average)
    for (float& v : out) v *= 1.0f / static_cast<float>(p);
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

/// The same bits on every process: rank 0's copy, broadcast, compared here.
bool same_as_rank0(const std::vector<float>& v) {
  return bitwise_equal(dist::broadcast_object(v, 0), v);
}

/// Runs f, which must throw dp::Error on this process; returns its message.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dp::Error& e) {
    return e.what();
  }
  return "(no exception)";
}

bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

dp::Tensor tensor_of(const std::vector<float>& v) {
  return dp::from_vector(v, {static_cast<std::int64_t>(v.size())}, dp::cpu(0));
}

}  // namespace

TEST_CASE("world: ranks, sizes and nodes") {
  const int p = dist::world_size();
  const int r = dist::rank();
  CHECK(p == expected_world_size());
  CHECK(r >= 0);
  CHECK(r < p);
  CHECK(dist::is_initialized());
  CHECK(dist::is_main() == (r == 0));
  CHECK(dist::is_distributed() == (p > 1));
  // Every test process runs on this machine: one node.
  CHECK(dist::local_size() == p);
  CHECK(dist::local_rank() == r);
  CHECK_FALSE(dist::host_name(p - 1).empty());
  CHECK_THROWS_AS(dist::host_name(p), dp::Error);
  // Ranks are distinct and cover 0..P-1.
  CHECK(dist::all_reduce(std::int64_t{1} << r, dist::Op::Sum) == (std::int64_t{1} << p) - 1);
  dist::init();  // idempotent
  CHECK(dist::world_size() == p);
}

TEST_CASE("barrier: nobody leaves before everyone arrived") {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  if (dist::rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  dist::barrier();
  const auto waited = Clock::now() - start;
  CHECK(waited >= std::chrono::milliseconds(190));  // rank 0 slept 200 ms before arriving
  for (int i = 0; i < 20; ++i) dist::barrier();
}

TEST_CASE("CollectiveScope: nests per thread; a disagreement names the scope of each side's call") {
  CHECK(dist::CollectiveScope::current().empty());
  {
    dist::CollectiveScope outer("outer call");
    CHECK(dist::CollectiveScope::current() == "outer call");
    {
      dist::CollectiveScope inner("inner call");
      CHECK(dist::CollectiveScope::current() == "inner call");
      std::string other_thread = "unset";
      std::thread([&] { other_thread = dist::CollectiveScope::current(); }).join();
      CHECK(other_thread.empty());
    }
    CHECK(dist::CollectiveScope::current() == "outer call");
  }
  CHECK(dist::CollectiveScope::current().empty());
  if (dist::world_size() < 2) return;
  // Rank 0 broadcasts inside a scope while the others enter a barrier: every process
  // throws, naming rank 0's scope; the group stays usable.
  std::string m;
  try {
    if (dist::rank() == 0) {
      dist::CollectiveScope scope("a collective library call");
      (void)dist::broadcast_object(std::int64_t{1}, 0);
    } else {
      dist::barrier();
    }
  } catch (const dp::Error& e) {
    m = e.what();
  }
  CHECK_MESSAGE(m.find("called broadcast(count 8 bytes of 8-byte elements, root 0) inside a collective library call") !=
                    std::string::npos,
                m);
  dist::barrier();
}

TEST_CASE("broadcast_object: scalars, structs, strings and vectors from any root") {
  const int p = dist::world_size();
  const int r = dist::rank();
  for (int root : {0, p - 1}) {
    CAPTURE(root);
    CHECK(dist::broadcast_object(100 + r, root) == 100 + root);
    CHECK(dist::broadcast_object(0.5 * r, root) == 0.5 * root);
    struct Pod {
      std::int64_t a;
      float b;
      char c[5];
    };
    Pod pod{r * 7LL, r * 0.25f, {'x', static_cast<char>('0' + r), 0, 0, 0}};
    const Pod got = dist::broadcast_object(pod, root);
    CHECK(got.a == root * 7LL);
    CHECK(got.b == root * 0.25f);
    CHECK(got.c[1] == static_cast<char>('0' + root));
    // Root's length wins, whatever the others held.
    const std::string s = dist::broadcast_object(std::string(static_cast<std::size_t>(r * 3 + 1), 'a' + static_cast<char>(r)), root);
    CHECK(s == std::string(static_cast<std::size_t>(root * 3 + 1), 'a' + static_cast<char>(root)));
    CHECK(dist::broadcast_object(std::string(r == root ? "" : "not empty"), root).empty());
    const std::vector<float> v = dist::broadcast_object(inputs(r, 1000 + r), root);
    CHECK(bitwise_equal(v, inputs(root, 1000 + root)));
    // Larger than one message of the transport (4 MiB).
    const std::vector<float> big = dist::broadcast_object(
        r == root ? inputs(root, (5 << 20) / 4 + 3) : std::vector<float>{}, root);
    CHECK(bitwise_equal(big, inputs(root, (5 << 20) / 4 + 3)));
  }
}

TEST_CASE("all_reduce of host scalars: sum in rank order, mean, max, min, NaN") {
  const int p = dist::world_size();
  const int r = dist::rank();
  // 1e16 + 1 + 1 ... depends on the order; rank order is the promise.
  const auto value = [](int k) { return k == 0 ? 1e16 : 1.0 + k * 0.1; };
  double sum = value(0);
  for (int k = 1; k < p; ++k) sum += value(k);
  const double got = dist::all_reduce(value(r), dist::Op::Sum);
  CHECK(std::memcmp(&got, &sum, sizeof(double)) == 0);
  CHECK(dist::all_reduce(value(r), dist::Op::Mean) == sum / p);
  CHECK(dist::all_reduce(static_cast<double>(r), dist::Op::Max) == p - 1);
  CHECK(dist::all_reduce(static_cast<double>(r), dist::Op::Min) == 0);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(std::isnan(dist::all_reduce(r == p - 1 ? nan : 1.0, dist::Op::Max)));
  CHECK(std::isnan(dist::all_reduce(r == p - 1 ? nan : 1.0, dist::Op::Min)));

  CHECK(dist::all_reduce(std::int64_t{r + 1}) == std::int64_t{p} * (p + 1) / 2);
  CHECK(dist::all_reduce(std::int64_t{-r}, dist::Op::Min) == -(p - 1));
  CHECK(dist::all_reduce(std::int64_t{-r}, dist::Op::Max) == 0);
  CHECK(dist::all_reduce(3, dist::Op::Sum) == 3 * p);  // int goes through int64
  CHECK(dist::all_reduce(std::numeric_limits<std::int64_t>::max(), dist::Op::Sum) ==
        static_cast<std::int64_t>(static_cast<std::uint64_t>(INT64_MAX) * static_cast<std::uint64_t>(p)));

  std::vector<double> many{1.0 * r, 2.0, -1.0 * r};
  dist::all_reduce(std::span<double>(many), dist::Op::Sum);
  CHECK(many[0] == p * (p - 1) / 2.0);
  CHECK(many[1] == 2.0 * p);
  CHECK(many[2] == -p * (p - 1) / 2.0);
  std::vector<double> none;
  dist::all_reduce(std::span<double>(none), dist::Op::Max);

  // Mean of integers is refused on every process, and the group stays usable.
  const std::string e = error_of([] { dist::all_reduce(std::int64_t{1}, dist::Op::Mean); });
  CHECK_MESSAGE(contains(e, "would round"), e);
  CHECK(dist::all_reduce(1.0) == p);
}

TEST_CASE("mpi communicator: every collective against locally computed values") {
  const int p = dist::world_size();
  const int r = dist::rank();
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  REQUIRE(comm->size() == p);
  CHECK(comm->backend_name() == "mpi");
  for (int k = 0; k < p; ++k) CHECK(comm->devices()[static_cast<std::size_t>(k)] == dp::cpu(0));

  // 0, tiny, not divisible by P, the one-round path's limit, and the two-phase path
  // with uneven slices (> 64 KiB).
  for (std::int64_t n : {0, 1, 7, 16384, 50003}) {
    CAPTURE(n);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
      const std::vector<float> want = expected_reduce(p, n, op);
      // Out of place.
      dp::Tensor send = tensor_of(inputs(r, n));
      dp::Tensor recv = dp::zeros({n}, dp::cpu(0));
      comm->all_reduce(r, send, recv, op);
      CHECK(bitwise_equal(recv.to_vector(), want));
      CHECK(bitwise_equal(send.to_vector(), inputs(r, n)));  // send is left alone
      CHECK(same_as_rank0(recv.to_vector()));
      // In place.
      comm->all_reduce(r, send, send, op);
      CHECK(bitwise_equal(send.to_vector(), want));
      // Reduce onto each end, in place on the root.
      for (int root : {0, p - 1}) {
        dp::Tensor x = tensor_of(inputs(r, n));
        comm->reduce(r, x, r == root ? x : dp::Tensor(), root, op);
        CHECK(bitwise_equal(x.to_vector(), r == root ? want : inputs(r, n)));
      }
    }
    // Broadcast from the last rank.
    dp::Tensor b = tensor_of(inputs(r, n));
    comm->broadcast(r, b, p - 1);
    CHECK(bitwise_equal(b.to_vector(), inputs(p - 1, n)));
  }

  // reduce_scatter: block k of the sum goes to rank k.
  for (std::int64_t m : {0, 1, 5000}) {
    CAPTURE(m);
    dp::Tensor send = tensor_of(inputs(r, m * p));
    dp::Tensor recv = dp::zeros({m}, dp::cpu(0));
    comm->reduce_scatter(r, send, recv, ReduceOp::Sum);
    CHECK(bitwise_equal(recv.to_vector(), expected_reduce(p, m, ReduceOp::Sum, m * r)));
    // all_gather: block k = rank k's, out of place and in place.
    dp::Tensor mine = tensor_of(inputs(r, m));
    dp::Tensor all = dp::zeros({m * p}, dp::cpu(0));
    comm->all_gather(r, mine, all);
    std::vector<float> want;
    for (int k = 0; k < p; ++k) {
      const std::vector<float> x = inputs(k, m);
      want.insert(want.end(), x.begin(), x.end());
    }
    CHECK(bitwise_equal(all.to_vector(), want));
    dp::Tensor all2 = dp::zeros({m * p}, dp::cpu(0));
    all2.narrow(0, m * r, m).copy_(mine);
    comm->all_gather(r, all2.narrow(0, m * r, m), all2);
    CHECK(bitwise_equal(all2.to_vector(), want));
  }
  comm->synchronize(r);
}

// Note [Collective dtypes]: the mpi communicator moves int64 whole (broadcast and
// all_gather) and int32 by broadcast; no process group carries int32 for all_gather.
TEST_CASE("mpi communicator: int64 broadcast and all_gather, int32 broadcast") {
  const int p = dist::world_size();
  const int r = dist::rank();
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  using Kind = dp::comm::Communicator::Collective;
  CHECK(comm->supports(Kind::Broadcast, dp::Dtype::Int32));
  CHECK(comm->supports(Kind::AllGather, dp::Dtype::Int64));
  CHECK_FALSE(comm->supports(Kind::AllGather, dp::Dtype::Int32));
  CHECK_FALSE(comm->supports(Kind::Reduce, dp::Dtype::Int64));
  // Values no float holds exactly: a float path would change them.
  auto big = [](int k, std::int64_t i) { return (std::int64_t{1} << 53) + 1 + k * 1000003 + i * 7; };
  for (std::int64_t n : {0, 1, 9}) {
    CAPTURE(n);
    std::vector<std::int64_t> mine(static_cast<std::size_t>(n)), want_b(static_cast<std::size_t>(n)), want_g;
    std::vector<std::int32_t> mine32(static_cast<std::size_t>(n)), want32(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      mine[static_cast<std::size_t>(i)] = big(r, i);
      want_b[static_cast<std::size_t>(i)] = big(p - 1, i);
      mine32[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(-(r * 1000 + i));
      want32[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(-((p - 1) * 1000 + i));
    }
    for (int k = 0; k < p; ++k)
      for (std::int64_t i = 0; i < n; ++i) want_g.push_back(big(k, i));
    dp::Tensor b = dp::from_vector(mine, {n}, dp::cpu(0));
    comm->broadcast(r, b, p - 1);
    CHECK(b.to_vector_i64() == want_b);
    dp::Tensor b32 = dp::from_vector(mine32, {n}, dp::cpu(0));
    comm->broadcast(r, b32, p - 1);
    CHECK(b32.to_vector_i32() == want32);
    dp::Tensor all = dp::zeros({n * p}, {.dtype = dp::Dtype::Int64, .device = dp::cpu(0)});
    comm->all_gather(r, dp::from_vector(mine, {n}, dp::cpu(0)), all);
    CHECK(all.to_vector_i64() == want_g);
  }
  // int32 all_gather between processes: every process throws, naming what it takes.
  dp::Tensor x32 = dp::zeros({2}, {.dtype = dp::Dtype::Int32, .device = dp::cpu(0)});
  const std::string e = error_of([&] {
    comm->all_gather(r, x32, dp::zeros({2 * p}, {.dtype = dp::Dtype::Int32, .device = dp::cpu(0)}));
  });
  CHECK_MESSAGE(contains(e, "which all_gather does not take on the mpi communicator (it takes float32, int64, "
                            "bfloat16, float16)"), e);
}

TEST_CASE("mpi communicator: the same bits as the local communicator over P devices") {
  // A process-level sum over P processes equals the shared-memory sum over P virtual
  // devices in one process, bit for bit (both add in rank order).
  const int p = dist::world_size();
  const std::int64_t n = 30011;
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  dp::Tensor x = tensor_of(inputs(dist::rank(), n));
  comm->all_reduce(dist::rank(), x, x, ReduceOp::Average);

  std::vector<dp::Device> devs;
  for (int k = 0; k < p; ++k) devs.push_back(dp::cpu(k));
  auto local = dp::comm::make_local_communicator(devs);
  std::vector<dp::Tensor> xs;
  for (int k = 0; k < p; ++k)
    xs.push_back(dp::from_vector(inputs(k, n), {n}, dp::cpu(k)));
  std::vector<std::thread> threads;
  for (int k = 0; k < p; ++k)
    threads.emplace_back([&, k] { local->all_reduce(k, xs[static_cast<std::size_t>(k)], xs[static_cast<std::size_t>(k)], ReduceOp::Average); });
  for (auto& t : threads) t.join();
  CHECK(bitwise_equal(x.to_vector(), xs[0].to_vector()));
}

namespace {

/// Input element i of rank r for a 16-bit sum: magnitudes 1e-2 to 1e2 of both signs
/// (float16 holds 1e5 of them), not 16-bit values yet.
float input16(int r, std::int64_t i) { return input(r, i) * 1e-3f; }

/// x rounded to `dtype` (nearest even) and widened back.
float round_to(dp::Dtype dtype, float x) {
  return dtype == dp::Dtype::BFloat16 ? static_cast<float>(dp::BFloat16(x)) : static_cast<float>(dp::Float16(x));
}

/// Rank r's 16-bit send: input16 rounded to `dtype`.
dp::Tensor send16(dp::Dtype dtype, int r, std::int64_t n, std::int64_t offset = 0, dp::Device dev = dp::cpu(0)) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = input16(r, offset + i);
  return dp::from_vector(v, {n}, dev).to(dtype);
}

/// The 16-bit reduction dp promises (Note [Deterministic process collectives]): every
/// rank's 16-bit input widened, added in float32 in rank order, Average then * (1 / P),
/// and one rounding to `dtype` at the end.
std::vector<float> expected_reduce16(dp::Dtype dtype, int p, std::int64_t n, ReduceOp op, std::int64_t offset = 0) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float acc = round_to(dtype, input16(0, offset + i));
    for (int r = 1; r < p; ++r) acc += round_to(dtype, input16(r, offset + i));
    if (op == ReduceOp::Average) acc *= 1.0f / static_cast<float>(p);
    out[static_cast<std::size_t>(i)] = round_to(dtype, acc);
  }
  return out;
}

}  // namespace

// Note [Collective dtypes]: all_gather moves bfloat16 and float16 between processes as
// 2-byte elements, every bit as sent (DataParallel's 16-bit parameters, for instance).
TEST_CASE("mpi communicator: bfloat16 and float16 all_gather move every bit") {
  const int p = dist::world_size();
  const int r = dist::rank();
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  for (dp::Dtype dtype : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dtype));
    CHECK(comm->supports(dp::comm::Communicator::Collective::AllGather, dtype));
    for (std::int64_t n : {0, 1, 17}) {
      CAPTURE(n);
      dp::Tensor all = dp::zeros({n * p}, {.dtype = dtype, .device = dp::cpu(0)});
      comm->all_gather(r, send16(dtype, r, n), all);
      std::vector<float> want;
      for (int q = 0; q < p; ++q)
        for (std::int64_t i = 0; i < n; ++i) want.push_back(round_to(dtype, input16(q, i)));
      CHECK(bitwise_equal(all.to(dp::Dtype::Float32).to_vector(), want));
    }
  }
}

// Note [Deterministic process collectives]: bfloat16 and float16 cross processes as
// 2-byte elements and are summed in float32 in rank order, rounded once.
TEST_CASE("mpi communicator: bfloat16 and float16 reductions sum in float32 in rank order and round once") {
  const int p = dist::world_size();
  const int r = dist::rank();
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  using Kind = dp::comm::Communicator::Collective;
  for (dp::Dtype dtype : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dtype));
    CHECK(comm->supports(Kind::AllReduce, dtype));
    CHECK(comm->supports(Kind::Reduce, dtype));
    CHECK(comm->supports(Kind::ReduceScatter, dtype));
    CHECK(comm->supports(Kind::Broadcast, dtype));
    // 0, tiny, odd, the one-round path (<= 64 KiB: 32768 2-byte elements) and the
    // two-phase path with uneven slices.
    for (std::int64_t n : {0, 1, 7, 32768, 50003}) {
      CAPTURE(n);
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
        const std::vector<float> want = expected_reduce16(dtype, p, n, op);
        dp::Tensor send = send16(dtype, r, n);
        const std::vector<float> sent = send.to_vector();
        dp::Tensor recv = dp::zeros({n}, {.dtype = dtype, .device = dp::cpu(0)});
        comm->all_reduce(r, send, recv, op);
        CHECK(recv.dtype() == dtype);
        CHECK(bitwise_equal(recv.to_vector(), want));
        CHECK(bitwise_equal(send.to_vector(), sent));  // send is left alone
        CHECK(same_as_rank0(recv.to_vector()));
        comm->all_reduce(r, send, send, op);  // in place
        CHECK(bitwise_equal(send.to_vector(), want));
        for (int root : {0, p - 1}) {
          dp::Tensor x = send16(dtype, r, n);
          comm->reduce(r, x, r == root ? x : dp::Tensor(), root, op);
          CHECK(bitwise_equal(x.to_vector(), r == root ? want : sent));
        }
      }
    }
    for (std::int64_t m : {0, 1, 5000}) {
      CAPTURE(m);
      dp::Tensor recv = dp::zeros({m}, {.dtype = dtype, .device = dp::cpu(0)});
      comm->reduce_scatter(r, send16(dtype, r, m * p), recv, ReduceOp::Sum);
      CHECK(bitwise_equal(recv.to_vector(), expected_reduce16(dtype, p, m, ReduceOp::Sum, m * r)));
    }
  }
}

TEST_CASE("mpi communicator: 16-bit sums are the local communicator's over P devices, in half the bytes") {
  // Both add the widened inputs in float32 in rank order and round once (summation.h).
  const int p = dist::world_size();
  const std::int64_t n = 30011;
  for (dp::Dtype dtype : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    CAPTURE(dp::dtype_name(dtype));
    auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
    dp::Tensor x = send16(dtype, dist::rank(), n);
    comm->all_reduce(dist::rank(), x, x, ReduceOp::Sum);
    dp::Tensor f = tensor_of(inputs(dist::rank(), n));
    comm->all_reduce(dist::rank(), f, f, ReduceOp::Sum);
    // The payload as nccl-tests counts it: 2 bytes an element, float32's 4.
    const auto ar = static_cast<std::size_t>(dp::comm::Communicator::Collective::AllReduce);
    const dp::comm::Communicator::ProcessTimes t = comm->process_times(dist::rank());
    CHECK(t.calls[ar] == 2);
    CHECK(t.bytes[ar] == n * 2 + n * 4);

    std::vector<dp::Device> devs;
    for (int k = 0; k < p; ++k) devs.push_back(dp::cpu(k));
    auto local = dp::comm::make_local_communicator(devs);
    std::vector<dp::Tensor> xs;
    for (int k = 0; k < p; ++k) xs.push_back(send16(dtype, k, n, 0, dp::cpu(k)));
    std::vector<std::thread> threads;
    for (int k = 0; k < p; ++k)
      threads.emplace_back([&, k] { local->all_reduce(k, xs[static_cast<std::size_t>(k)], xs[static_cast<std::size_t>(k)], ReduceOp::Sum); });
    for (auto& t : threads) t.join();
    CHECK(bitwise_equal(x.to_vector(), xs[0].to_vector()));
    if (p > 2) {
      // The inputs tell one rounding from one per addition apart (for 2 they are one).
      const std::vector<float> got = x.to_vector();
      std::int64_t differ = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        float step = round_to(dtype, input16(0, i));
        for (int k = 1; k < p; ++k) step = round_to(dtype, step + round_to(dtype, input16(k, i)));
        differ += step != got[static_cast<std::size_t>(i)];
      }
      CHECK(differ > 0);
    }
  }
}

TEST_CASE("bad input: every process throws dp::Error naming what was expected") {
  const int p = dist::world_size();
  const int r = dist::rank();
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));

  // Different sizes on different processes (in a world of one there is no other).
  if (p > 1) {
    dp::Tensor x = dp::zeros({r == 0 ? 10 : 12}, dp::cpu(0));
    const std::string e = error_of([&] { comm->all_reduce(r, x, x, ReduceOp::Sum); });
    CHECK_MESSAGE(contains(e, "processes disagree"), e);
    CHECK_MESSAGE(contains(e, "all_reduce(count 10, float32, sum)"), e);
    CHECK_MESSAGE(contains(e, "all_reduce(count 12, float32, sum)"), e);
    // Different ops.
    dp::Tensor y = dp::zeros({4}, dp::cpu(0));
    const std::string e2 = error_of(
        [&] { comm->all_reduce(r, y, y, r == 0 ? ReduceOp::Sum : ReduceOp::Average); });
    CHECK_MESSAGE(contains(e2, "processes disagree"), e2);
    // Different collectives.
    const std::string e3 = error_of([&] {
      if (r == 0) comm->broadcast(r, y, 0);
      else comm->all_reduce(r, y, y, ReduceOp::Sum);
    });
    CHECK_MESSAGE(contains(e3, "broadcast"), e3);
    CHECK_MESSAGE(contains(e3, "all_reduce"), e3);
    // Different types broadcast by dp::dist.
    const std::string e4 = error_of([&] {
      if (r == 0) (void)dist::broadcast_object(1.0, 0);
      else (void)dist::broadcast_object(1, 0);
    });
    CHECK_MESSAGE(contains(e4, "processes disagree"), e4);
    // Different scalar counts.
    const std::string e5 = error_of([&] {
      std::vector<double> v(static_cast<std::size_t>(r + 1));
      dist::all_reduce(std::span<double>(v));
    });
    CHECK_MESSAGE(contains(e5, "count 1, float64"), e5);
  }

  // One process's recv has the wrong size: all processes throw, the others naming it.
  {
    dp::Tensor send = dp::zeros({8}, dp::cpu(0));
    dp::Tensor recv = dp::zeros({r == p - 1 ? 9 : 8}, dp::cpu(0));
    const std::string e = error_of([&] { comm->all_reduce(r, send, recv, ReduceOp::Sum); });
    CHECK_MESSAGE(contains(e, "recv has 9 elements but send has 8"), e);
    if (r != p - 1) CHECK_MESSAGE(contains(e, dp::detail::str_cat("rank ", p - 1)), e);
  }
  // Wrong rank, dtype, root, and reduce_scatter / all_gather sizes.
  {
    dp::Tensor x = dp::zeros({4}, dp::cpu(0));
    CHECK(contains(error_of([&] { comm->all_reduce(r + 1, x, x, ReduceOp::Sum); }),
                   "one rank per process"));
    dp::Tensor i64 = dp::from_vector(std::vector<std::int64_t>{1, 2}, {2}, dp::cpu(0));
    CHECK(contains(error_of([&] { comm->all_reduce(r, i64, i64, ReduceOp::Sum); }), "float32"));
    CHECK(contains(error_of([&] { comm->broadcast(r, x, p); }), "out of range"));
    CHECK(contains(error_of([&] { comm->reduce(r, x, x, -1, ReduceOp::Sum); }), "out of range"));
    dp::Tensor small = dp::zeros({3}, dp::cpu(0));
    CHECK(contains(error_of([&] { comm->reduce_scatter(r, x, small, ReduceOp::Sum); }),
                   "reduce_scatter needs send"));
    CHECK(contains(error_of([&] { comm->all_gather(r, x, small); }), "all_gather needs recv"));
  }
  // A non-CPU device on the last process: nobody gets a communicator.
  {
    const dp::Device dev = r == p - 1 ? dp::Device{dp::DeviceType::CUDA, 0} : dp::cpu(0);
    const std::string e = error_of([&] { (void)dp::comm::make_mpi_communicator(dev); });
    CHECK_MESSAGE(contains(e, "is not a CPU device"), e);
  }
  // After all that, the communicator still works.
  dp::Tensor ones = tensor_of(std::vector<float>(5, 1.0f));
  comm->all_reduce(r, ones, ones, ReduceOp::Sum);
  CHECK(ones.to_vector() == std::vector<float>(5, static_cast<float>(p)));
}

TEST_CASE("DistributedSampler: defaults to (world_size, rank)") {
  dp::data::DistributedSampler s(103);
  CHECK(s.num_replicas() == dist::world_size());
  CHECK(s.rank() == dist::rank());
  const dp::data::DistributedSampler explicit_one(103, dist::world_size(), dist::rank());
  CHECK(s.indices() == explicit_one.indices());
  // The shares cover the dataset (with padding) on every process together.
  const std::int64_t total = dist::all_reduce(s.size());
  CHECK(total == s.total_size());
}

// ---- failure scenarios (run one per job, see run_mpi.py) ------------------------------

namespace {

/// Rank `victim` (the last one) fails in the way `mode` names while the other
/// processes are inside a collective; they must not survive it.
int run_fault(const std::string& mode) {
  const int r = dist::rank();
  const int victim = dist::world_size() - 1;
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  dp::Tensor x = tensor_of(inputs(r, 1 << 18));  // 1 MiB: the two-phase path
  comm->all_reduce(r, x, x, ReduceOp::Sum);      // everyone healthy so far
  dist::barrier();
  if (r == victim) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the others are waiting
    if (mode == "abort") std::abort();
    if (mode == "exit") _exit(3);
    if (mode == "throw") throw dp::Error("boom: a failure on the last rank");
    if (mode == "hang") std::this_thread::sleep_for(std::chrono::seconds(60));
    if (mode == "return" || mode == "return_comm") return 0;  // dp::dist finalises at exit
    if (mode == "comm_abort") comm->abort("a worker failed on the last rank");
  }
  if (mode == "return") {
    dist::all_reduce(1.0);  // meets the victim's finalize rendezvous (same group)
  } else {
    comm->all_reduce(r, x, x, ReduceOp::Sum);
  }
  std::cout << "FAULT-TEST: rank " << r << " got through the collective\n" << std::flush;
  return 0;
}

/// Explicit finalize(), twice, then every collective refuses to run and exit is clean
/// (MPI_Finalize ran once). Exit status 0 when every check held.
int run_finalize() {
  auto comm = dp::comm::make_mpi_communicator(dp::cpu(0));
  const int p = dist::world_size();
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    if (!ok) {
      ++failures;
      std::cout << "CHECK FAILED on rank " << dist::rank() << ": " << what << "\n";
    }
  };
  check(dist::all_reduce(1.0) == p, "all_reduce before finalize");
  dist::finalize();
  dist::finalize();  // idempotent
  check(dist::world_size() == p, "world_size() after finalize");
  check(contains(error_of([] { dist::barrier(); }), "finalize() has run"), "barrier refused");
  dp::Tensor x = tensor_of({1.0f});
  check(contains(error_of([&] { comm->all_reduce(dist::rank(), x, x, ReduceOp::Sum); }),
                 "finalize() has run"),
        "the mpi communicator refuses");
  check(contains(error_of([] { dist::init(); }), "after dp::dist::finalize"), "init refused");
  comm.reset();  // its channel outlived MPI: freeing it must be skipped, not crash
  std::cout << "finalize scenario: " << failures << " failed check(s)\n";
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--fault=", 0) == 0) return run_fault(arg.substr(8));
    if (arg == "--finalize") return run_finalize();
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  // Only rank 0 reports successes; every rank reports its failures.
  if (dist::rank() != 0) ctx.setOption("minimal", true);
  // mpirun gives each process a pseudo-terminal; colour codes only clutter the log.
  if (dist::is_distributed()) ctx.setOption("no-colors", true);
  const int rc = ctx.run();
  if (ctx.shouldExit()) return rc;
  return rc;
}
