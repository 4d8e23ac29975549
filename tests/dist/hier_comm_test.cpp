// Tests of the world communicator over CPU virtual devices: under mpirun with 2 and 3
// processes (tests/dist/run_mpi.py; the hierarchical communicator) and as one process
// (make_world_communicator is then the local communicator). Each process drives L = 1,
// 2 and 3 devices, one thread per local rank, and checks every collective against
// values it computes itself (Note [World ranks]: roots and blocks are world ranks
// p * L + j). Integer-valued inputs make sums exact where only the layout is tested;
// inputs of mixed magnitudes make the order of the sums visible where the order rule
// (Note [Hierarchical collectives]) is tested. `hier_comm_test --fault=abort` ends the
// job from one local rank while the others wait in a collective.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "dp/comm/communicator.h"
#include "dp/core/error.h"
#include "dp/core/half.h"
#include "dp/dist/dist.h"
#include "dp/tensor/tensor.h"

namespace dist = dp::dist;
using dp::comm::Communicator;
using dp::comm::ReduceOp;

namespace {

/// Local device counts every case runs with.
constexpr int kLocalCounts[] = {1, 2, 3};

std::vector<dp::Device> cpus(int n) {
  std::vector<dp::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(dp::cpu(i));
  return d;
}

std::unique_ptr<Communicator> world_comm(int l) {
  dp::backend::get(dp::cpu(0)).set_concurrent_devices(l);
  return dp::comm::make_world_communicator(cpus(l));
}

/// Runs f(local rank) on one thread per local rank; returns each one's error message
/// ("" when it returned).
std::vector<std::string> run_ranks(int l, const std::function<void(int)>& f) {
  std::vector<std::string> errors(static_cast<std::size_t>(l));
  std::vector<std::thread> threads;
  for (int j = 0; j < l; ++j) {
    threads.emplace_back([&, j] {
      try {
        f(j);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(j)] = std::string("threw: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// run_ranks that must succeed on every local rank.
void on_ranks(int l, const std::function<void(int)>& f) {
  const std::vector<std::string> errors = run_ranks(l, f);
  for (int j = 0; j < l; ++j) REQUIRE_MESSAGE(errors[static_cast<std::size_t>(j)].empty(),
                                              "local rank ", j, ": ", errors[static_cast<std::size_t>(j)]);
}

/// Small integers: sums over up to 9 world ranks are exact in float, in any order.
float ival(int w, std::int64_t i) { return static_cast<float>((w * 7 + i * 3 + (i >> 4)) % 11) - 5.0f; }

/// Magnitudes from 1e-3 to 1e5 of both signs: sums in another order differ in their
/// last bits.
float fval(int w, std::int64_t i) {
  const std::uint64_t h = (static_cast<std::uint64_t>(w + 1) * 0x9e3779b97f4a7c15ULL) ^
                          (static_cast<std::uint64_t>(i) * 0xbf58476d1ce4e5b9ULL);
  const double u = static_cast<double>((h >> 11) % 1000003) / 1000003.0;
  const double mag = std::pow(10.0, -3.0 + 8.0 * u);
  return static_cast<float>(((h >> 3) & 1) ? mag : -mag);
}

using ValueFn = float (*)(int, std::int64_t);

std::vector<float> values(ValueFn f, int w, std::int64_t n, std::int64_t offset = 0) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = f(w, offset + i);
  return v;
}

/// The promised reduction of element `offset + i`: over the local ranks of each process
/// in order, then over the processes in order; Average then * (1 / W).
std::vector<float> expected(ValueFn f, int procs, int l, std::int64_t n, ReduceOp op,
                            std::int64_t offset = 0) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float total = 0;
    for (int p = 0; p < procs; ++p) {
      float s = f(p * l, offset + i);
      for (int j = 1; j < l; ++j) s += f(p * l + j, offset + i);
      total = p == 0 ? s : total + s;
    }
    if (op == ReduceOp::Average) total *= 1.0f / static_cast<float>(procs * l);
    out[static_cast<std::size_t>(i)] = total;
  }
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

dp::Tensor tensor_of(const std::vector<float>& v, dp::Device dev) {
  return dp::from_vector(v, {static_cast<std::int64_t>(v.size())}, dev);
}

bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

/// The same bits on every process: rank 0's copy, broadcast, compared here.
bool same_as_rank0(const std::vector<float>& v) {
  return bitwise_equal(dist::broadcast_object(v, 0), v);
}

const char* op_str(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

/// World rank w's own piece of a per-piece reduce (elements [off, off + len)) and its
/// block of a reduce_scatter (m elements) hold all-reduce a's bits there.
void check_pieces(const std::vector<float>& a, const std::vector<float>& piece, std::pair<std::int64_t, std::int64_t> where,
                  const std::vector<float>& block, int w, std::int64_t m) {
  const auto [off, len] = where;
  CHECK(bitwise_equal(piece, std::vector<float>(a.begin() + off, a.begin() + off + len)));
  CHECK(bitwise_equal(block, std::vector<float>(a.begin() + w * m, a.begin() + (w + 1) * m)));
}

/// In-place all-reduces of k = 1..kmax elements (rank w's input(w, k, offset 100 k, its
/// device)) on every local rank of `comm`: each local rank's results, by k.
std::vector<std::vector<std::vector<float>>> small_all_reduces(
    Communicator& comm, int l, std::int64_t kmax, ReduceOp op,
    const std::function<dp::Tensor(int, std::int64_t, std::int64_t, dp::Device)>& input) {
  std::vector<std::vector<std::vector<float>>> out(static_cast<std::size_t>(l));
  on_ranks(l, [&](int j) {
    for (std::int64_t k = 1; k <= kmax; ++k) {
      dp::Tensor s = input(dist::rank() * l + j, k, 100 * k, dp::cpu(j));
      comm.all_reduce(j, s, s, op);
      out[static_cast<std::size_t>(j)].push_back(s.to_vector());
    }
  });
  return out;
}

}  // namespace

TEST_CASE("world communicator: sizes, ranks, local() and peers()") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  for (int l : kLocalCounts) {
    CAPTURE(l);
    auto comm = world_comm(l);
    CHECK(comm->size() == l);
    CHECK(comm->devices() == cpus(l));
    CHECK(comm->world_size() == procs * l);
    CHECK(comm->first_rank() == p * l);
    Communicator& local = comm->local();
    CHECK(local.size() == l);
    CHECK(local.world_size() == l);
    CHECK(local.first_rank() == 0);
    CHECK(local.backend_name() == "local");
    if (procs == 1) {
      CHECK(comm->backend_name() == "local");
      CHECK(&local == comm.get());
      CHECK(comm->peers(0) == nullptr);
      continue;
    }
    CHECK(comm->backend_name() == "hierarchical");
    CHECK(&local != comm.get());
    CHECK_THROWS_AS(comm->peers(l), dp::Error);
    CHECK_THROWS_AS(comm->peers(-1), dp::Error);
    for (int j = 0; j < l; ++j) {
      Communicator* peers = comm->peers(j);
      REQUIRE(peers != nullptr);
      CHECK(peers->backend_name() == "mpi");
      CHECK(peers->size() == procs);
      for (int q = 0; q < procs; ++q) CHECK(peers->devices()[static_cast<std::size_t>(q)] == dp::cpu(j));
    }
    // local() sums this process's ranks only; peers(j) sums local rank j of every
    // process, ranked by process — each driven by its own rank's thread, concurrently.
    std::vector<std::vector<float>> got_local(static_cast<std::size_t>(l)), got_peers(static_cast<std::size_t>(l));
    on_ranks(l, [&](int j) {
      const dp::Device dev = dp::cpu(j);
      dp::Tensor x = tensor_of(values(ival, p * l + j, 33), dev);
      comm->local().all_reduce(j, x, x, ReduceOp::Sum);
      got_local[static_cast<std::size_t>(j)] = x.to_vector();
      dp::Tensor y = tensor_of(values(ival, p * l + j, 33), dev);
      comm->peers(j)->all_reduce(dist::rank(), y, y, ReduceOp::Sum);
      got_peers[static_cast<std::size_t>(j)] = y.to_vector();
    });
    for (int j = 0; j < l; ++j) {
      std::vector<float> want_local(33, 0.0f), want_peers(33, 0.0f);
      for (std::int64_t i = 0; i < 33; ++i) {
        for (int k = 0; k < l; ++k) want_local[static_cast<std::size_t>(i)] += ival(p * l + k, i);
        for (int q = 0; q < procs; ++q) want_peers[static_cast<std::size_t>(i)] += ival(q * l + j, i);
      }
      CHECK(got_local[static_cast<std::size_t>(j)] == want_local);
      CHECK(got_peers[static_cast<std::size_t>(j)] == want_peers);
    }
  }
}

TEST_CASE("all_reduce: sum and average over every world rank, uneven sizes, in and out of place") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  for (int l : kLocalCounts) {
    auto comm = world_comm(l);
    // 0, fewer than L, not divisible by L, and past the local (16K) and process-level
    // (64 KiB) small-size paths.
    for (std::int64_t n : {0, 1, 2, 5, 7, 1000, 40003}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
        CAPTURE(l);
        CAPTURE(n);
        CAPTURE(op_str(op));
        const std::vector<float> want = expected(ival, procs, l, n, op);
        std::vector<std::vector<float>> out(static_cast<std::size_t>(l)), in_place(static_cast<std::size_t>(l)),
            sent(static_cast<std::size_t>(l));
        on_ranks(l, [&](int j) {
          const dp::Device dev = dp::cpu(j);
          dp::Tensor send = tensor_of(values(ival, p * l + j, n), dev);
          dp::Tensor recv = dp::full({n}, 99.0, {dp::Dtype::Float32, dev});
          comm->all_reduce(j, send, recv, op);
          out[static_cast<std::size_t>(j)] = recv.to_vector();
          sent[static_cast<std::size_t>(j)] = send.to_vector();
          comm->all_reduce(j, send, send, op);
          in_place[static_cast<std::size_t>(j)] = send.to_vector();
        });
        for (int j = 0; j < l; ++j) {
          CAPTURE(j);
          CHECK(bitwise_equal(out[static_cast<std::size_t>(j)], want));
          CHECK(bitwise_equal(in_place[static_cast<std::size_t>(j)], want));
          CHECK(bitwise_equal(sent[static_cast<std::size_t>(j)], values(ival, p * l + j, n)));
        }
      }
    }
  }
}

TEST_CASE("broadcast: from every world root") {
  const int p = dist::rank();
  for (int l : kLocalCounts) {
    auto comm = world_comm(l);
    for (int root = 0; root < comm->world_size(); ++root) {
      for (std::int64_t n : {0, 3, 1001}) {
        CAPTURE(l);
        CAPTURE(root);
        CAPTURE(n);
        std::vector<std::vector<float>> got(static_cast<std::size_t>(l));
        on_ranks(l, [&](int j) {
          dp::Tensor x = tensor_of(values(ival, p * l + j, n), dp::cpu(j));
          comm->broadcast(j, x, root);
          got[static_cast<std::size_t>(j)] = x.to_vector();
        });
        for (int j = 0; j < l; ++j) CHECK(bitwise_equal(got[static_cast<std::size_t>(j)], values(ival, root, n)));
      }
    }
  }
}

TEST_CASE("reduce: to every world root, recv ignored elsewhere, send left alone") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  for (int l : kLocalCounts) {
    auto comm = world_comm(l);
    for (int root = 0; root < comm->world_size(); ++root) {
      for (std::int64_t n : {1, 7, 5003}) {
        for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
          CAPTURE(l);
          CAPTURE(root);
          CAPTURE(n);
          CAPTURE(op_str(op));
          const bool in_place = (root + n) % 2 == 0;  // both ways over the roots
          std::vector<std::vector<float>> sent(static_cast<std::size_t>(l)), got(static_cast<std::size_t>(l));
          on_ranks(l, [&](int j) {
            const dp::Device dev = dp::cpu(j);
            const bool is_root = p * l + j == root;
            dp::Tensor send = tensor_of(values(ival, p * l + j, n), dev);
            dp::Tensor recv = !is_root ? dp::Tensor() : in_place ? send : dp::zeros({n}, dev);
            comm->reduce(j, send, recv, root, op);
            sent[static_cast<std::size_t>(j)] = send.to_vector();
            if (is_root) got[static_cast<std::size_t>(j)] = recv.to_vector();
          });
          for (int j = 0; j < l; ++j) {
            CAPTURE(j);
            if (p * l + j == root) {
              CHECK(bitwise_equal(got[static_cast<std::size_t>(j)], expected(ival, procs, l, n, op)));
              if (!in_place) CHECK(bitwise_equal(sent[static_cast<std::size_t>(j)], values(ival, root, n)));
            } else {
              CHECK(bitwise_equal(sent[static_cast<std::size_t>(j)], values(ival, p * l + j, n)));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("reduce_scatter and all_gather: block w belongs to world rank w") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  for (int l : kLocalCounts) {
    auto comm = world_comm(l);
    const int w_all = comm->world_size();
    for (std::int64_t m : {0, 1, 3, 2000}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
        CAPTURE(l);
        CAPTURE(m);
        CAPTURE(op_str(op));
        std::vector<std::vector<float>> out(static_cast<std::size_t>(l)), in_place(static_cast<std::size_t>(l));
        on_ranks(l, [&](int j) {
          const dp::Device dev = dp::cpu(j);
          const int w = p * l + j;
          dp::Tensor send = tensor_of(values(ival, w, m * w_all), dev);
          dp::Tensor recv = dp::zeros({m}, dev);
          comm->reduce_scatter(j, send, recv, op);
          out[static_cast<std::size_t>(j)] = recv.to_vector();
          comm->reduce_scatter(j, send, send.narrow(0, w * m, m), op);
          in_place[static_cast<std::size_t>(j)] = send.narrow(0, w * m, m).to_vector();
        });
        for (int j = 0; j < l; ++j) {
          CAPTURE(j);
          const int w = p * l + j;
          const std::vector<float> want = expected(ival, procs, l, m, op, w * m);
          CHECK(bitwise_equal(out[static_cast<std::size_t>(j)], want));
          CHECK(bitwise_equal(in_place[static_cast<std::size_t>(j)], want));
        }
      }
      // all_gather: block v of recv is world rank v's send, out of place and in place.
      std::vector<float> want;
      for (int v = 0; v < w_all; ++v) {
        const std::vector<float> x = values(ival, v, m, 1000 * v);
        want.insert(want.end(), x.begin(), x.end());
      }
      std::vector<std::vector<float>> out(static_cast<std::size_t>(l)), in_place(static_cast<std::size_t>(l));
      on_ranks(l, [&](int j) {
        const dp::Device dev = dp::cpu(j);
        const int w = p * l + j;
        dp::Tensor mine = tensor_of(values(ival, w, m, 1000 * w), dev);
        dp::Tensor all = dp::full({m * w_all}, 99.0, {dp::Dtype::Float32, dev});
        comm->all_gather(j, mine, all);
        out[static_cast<std::size_t>(j)] = all.to_vector();
        dp::Tensor all2 = dp::full({m * w_all}, 99.0, {dp::Dtype::Float32, dev});
        all2.narrow(0, w * m, m).copy_(mine);
        comm->all_gather(j, all2.narrow(0, w * m, m), all2);
        in_place[static_cast<std::size_t>(j)] = all2.to_vector();
      });
      for (int j = 0; j < l; ++j) {
        CAPTURE(l);
        CAPTURE(m);
        CAPTURE(j);
        CHECK(bitwise_equal(out[static_cast<std::size_t>(j)], want));
        CHECK(bitwise_equal(in_place[static_cast<std::size_t>(j)], want));
      }
    }
  }
}

TEST_CASE("order of sums: all_reduce, per-piece reduce and reduce_scatter give the same bits") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  for (int l : kLocalCounts) {
    auto comm = world_comm(l);
    const int w_all = comm->world_size();
    const std::int64_t m = 1237;
    const std::int64_t n = m * w_all + 5;  // uneven for every L and W
    auto piece = [&](int v) {  // world rank v's piece of n: the sharded design's split
      const std::int64_t chunk = (n + w_all - 1) / w_all;
      const std::int64_t off = std::min<std::int64_t>(n, chunk * v);
      return std::pair<std::int64_t, std::int64_t>{off, std::min<std::int64_t>(chunk, n - off)};
    };
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Average}) {
      CAPTURE(l);
      CAPTURE(op_str(op));
      std::vector<std::vector<float>> ar(static_cast<std::size_t>(l)), ar2(static_cast<std::size_t>(l)),
          pieces(static_cast<std::size_t>(l)), rs(static_cast<std::size_t>(l));
      on_ranks(l, [&](int j) {
        const dp::Device dev = dp::cpu(j);
        const int w = p * l + j;
        dp::Tensor x = tensor_of(values(fval, w, n), dev);
        dp::Tensor y = dp::zeros({n}, dev);
        comm->all_reduce(j, x, y, op);
        ar[static_cast<std::size_t>(j)] = y.to_vector();
        comm->all_reduce(j, x, y, op);  // run to run
        ar2[static_cast<std::size_t>(j)] = y.to_vector();
        // One reduce per piece onto its owner (the sharded design), in place on the owner.
        dp::Tensor z = tensor_of(values(fval, w, n), dev);
        for (int v = 0; v < w_all; ++v) {
          const auto [off, len] = piece(v);
          dp::Tensor part = z.narrow(0, off, len);
          comm->reduce(j, part, v == w ? part : dp::Tensor(), v, op);
        }
        const auto [off, len] = piece(w);
        pieces[static_cast<std::size_t>(j)] = z.narrow(0, off, len).to_vector();
        // reduce_scatter of the first m * W elements.
        dp::Tensor r = dp::zeros({m}, dev);
        comm->reduce_scatter(j, x.narrow(0, 0, m * w_all), r, op);
        rs[static_cast<std::size_t>(j)] = r.to_vector();
      });
      const std::vector<float> want = expected(fval, procs, l, n, op);
      for (int j = 0; j < l; ++j) {
        CAPTURE(j);
        const int w = p * l + j;
        const std::vector<float>& a = ar[static_cast<std::size_t>(j)];
        CHECK(bitwise_equal(a, want));
        CHECK(bitwise_equal(ar2[static_cast<std::size_t>(j)], a));
        CHECK(same_as_rank0(a));
        check_pieces(a, pieces[static_cast<std::size_t>(j)], piece(w), rs[static_cast<std::size_t>(j)], w, m);
      }
      // Small uneven sizes: the trailing n mod L elements, which the last local rank
      // sums by hand, follow the same order.
      const auto small = small_all_reduces(*comm, l, 24, op, [](int w, std::int64_t k, std::int64_t off, dp::Device dev) {
        return tensor_of(values(fval, w, k, off), dev);
      });
      for (std::int64_t k = 1; k <= 24; ++k)
        for (int j = 0; j < l; ++j)
          CHECK(bitwise_equal(small[static_cast<std::size_t>(j)][static_cast<std::size_t>(k - 1)],
                              expected(fval, procs, l, k, op, 100 * k)));
      if (procs > 1 && l > 1) {
        // The inputs do tell the orders apart: one flat sum over the world ranks differs.
        std::int64_t differ = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          float flat = fval(0, i);
          for (int v = 1; v < w_all; ++v) flat += fval(v, i);
          if (op == ReduceOp::Average) flat *= 1.0f / static_cast<float>(w_all);
          differ += flat != want[static_cast<std::size_t>(i)];
        }
        CHECK(differ > 0);
      }
    }
  }
}

TEST_CASE("bad arguments: every rank of every process throws dp::Error naming the problem") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  const int l = 2;
  auto comm = world_comm(l);
  const int last = procs - 1;  // the process whose last local rank misbehaves
  const int w_all = comm->world_size();

  // Runs f on every local rank; every one must throw dp::Error with `needle`, or one of
  // `others` on the ranks that did not cause it.
  auto expect_all_fail = [&](const std::string& label, const std::function<void(int)>& f,
                             const std::string& needle) {
    CAPTURE(label);
    const std::vector<std::string> errors = run_ranks(l, f);
    for (int j = 0; j < l; ++j) {
      CAPTURE(j);
      const std::string& e = errors[static_cast<std::size_t>(j)];
      CHECK_MESSAGE(contains(e, "threw:"), e);
      CHECK_MESSAGE(contains(e, needle), e);
    }
  };

  expect_all_fail("recv size on one rank", [&](int j) {
    const dp::Device dev = dp::cpu(j);
    dp::Tensor send = dp::zeros({8}, dev);
    dp::Tensor recv = dp::zeros({p == last && j == l - 1 ? 9 : 8}, dev);
    comm->all_reduce(j, send, recv, ReduceOp::Sum);
  }, "recv has 9 elements but send has 8");

  expect_all_fail("dtype on one rank", [&](int j) {
    const dp::Device dev = dp::cpu(j);
    dp::Tensor x = p == last && j == 0 ? dp::from_vector(std::vector<std::int64_t>{1, 2}, {2}, dev)
                                       : dp::zeros({2}, dev);
    comm->broadcast(j, x, 0);
  }, "float32");

  expect_all_fail("device on one rank", [&](int j) {
    const dp::Device dev = dp::cpu(p == last && j == 1 ? 0 : j);
    dp::Tensor x = dp::zeros({4}, dev);
    comm->reduce(j, x, x, 0, ReduceOp::Sum);
  }, "lives on cpu:0");

  expect_all_fail("root out of range", [&](int j) {
    dp::Tensor x = dp::zeros({4}, dp::cpu(j));
    comm->reduce(j, x, x, w_all, ReduceOp::Sum);
  }, "out of range");

  expect_all_fail("reduce_scatter sizes", [&](int j) {
    dp::Tensor x = dp::zeros({4 * w_all + 1}, dp::cpu(j));
    dp::Tensor y = dp::zeros({4}, dp::cpu(j));
    comm->reduce_scatter(j, x, y, ReduceOp::Sum);
  }, "reduce_scatter needs send");

  expect_all_fail("all_gather overlap", [&](int j) {
    dp::Tensor all = dp::zeros({4 * w_all}, dp::cpu(j));
    const int wrong_block = (p * l + j + 1) % w_all;
    comm->all_gather(j, all.narrow(0, 4 * wrong_block, 4), all);
  }, "is not recv's block");

  expect_all_fail("local ranks disagree on the size", [&](int j) {
    dp::Tensor x = dp::zeros({p == last && j == 1 ? 10 : 8}, dp::cpu(j));
    comm->all_reduce(j, x, x, ReduceOp::Sum);
  }, "ranks disagree");

  if (procs > 1) {
    // Processes disagree; on every group (11 vs 12 elements split over 2 ranks: 5+6 vs
    // 6+6) ...
    expect_all_fail("processes disagree on every group", [&](int j) {
      dp::Tensor x = dp::zeros({p == 0 ? 11 : 12}, dp::cpu(j));
      comm->all_reduce(j, x, x, ReduceOp::Sum);
    }, "disagree");
    // ... or on one group only (12 vs 13: 6+6 vs 6+7): local rank 0's group agrees, and
    // it must still throw with local rank 1.
    const std::vector<std::string> errors = run_ranks(l, [&](int j) {
      dp::Tensor x = dp::zeros({p == 0 ? 12 : 13}, dp::cpu(j));
      comm->all_reduce(j, x, x, ReduceOp::Sum);
    });
    CHECK_MESSAGE(contains(errors[1], "processes disagree"), errors[1]);
    CHECK_MESSAGE(contains(errors[0], "local rank 1 (cpu:1) failed between processes"), errors[0]);
    CHECK_MESSAGE(contains(errors[0], "processes disagree"), errors[0]);
    // Different roots.
    expect_all_fail("processes disagree on the root", [&](int j) {
      dp::Tensor x = dp::zeros({4}, dp::cpu(j));
      comm->broadcast(j, x, p == 0 ? 0 : 1);
    }, "disagree");
  }

  // A rank out of range throws on the calling thread, before any collective.
  dp::Tensor x = dp::zeros({4}, dp::cpu(0));
  CHECK(contains([&] {
    try {
      comm->all_reduce(l, x, x, ReduceOp::Sum);
    } catch (const dp::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no exception)");
  }(), "out of range"));

  // After all that, the communicator still works.
  std::vector<std::vector<float>> got(static_cast<std::size_t>(l));
  on_ranks(l, [&](int j) {
    dp::Tensor ones = dp::ones({5}, dp::cpu(j));
    comm->all_reduce(j, ones, ones, ReduceOp::Sum);
    got[static_cast<std::size_t>(j)] = ones.to_vector();
  });
  for (int j = 0; j < l; ++j)
    CHECK(got[static_cast<std::size_t>(j)] == std::vector<float>(5, static_cast<float>(w_all)));
}

TEST_CASE("make_world_communicator: a mismatched device count fails on every process") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  if (procs == 1) return;  // one process cannot disagree with itself
  std::string e = "(no exception)";
  try {
    (void)world_comm(p == procs - 1 ? 1 : 2);
  } catch (const dp::Error& err) {
    e = err.what();
  }
  CHECK_MESSAGE(contains(e, "every process must use the same number of devices"), e);
  // Then a good one works.
  auto comm = world_comm(2);
  CHECK(comm->world_size() == 2 * procs);
}

namespace {

/// fval scaled into float16's range (magnitudes 1e-5 to 1e2), not rounded yet.
float fval16(int w, std::int64_t i) { return fval(w, i) * 1e-3f; }

/// x rounded to `dtype` (nearest even), widened back.
float round_to(dp::Dtype dtype, float x) {
  return dtype == dp::Dtype::BFloat16 ? static_cast<float>(dp::BFloat16(x)) : static_cast<float>(dp::Float16(x));
}

/// The promised 16-bit sum of element `offset + i`, one rounding per hop (Note
/// [Hierarchical collectives]): within process p, the local ranks' 16-bit inputs in
/// float32 in order, rounded once; then those partial sums in float32 in process order,
/// rounded once. `hops` false: one flat sum over every world rank, rounded once.
std::vector<float> expected16(dp::Dtype dtype, int procs, int l, std::int64_t n, bool hops = true,
                              std::int64_t offset = 0) {
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float total = 0;
    for (int p = 0; p < procs; ++p) {
      float s = round_to(dtype, fval16(p * l, offset + i));
      for (int j = 1; j < l; ++j) s += round_to(dtype, fval16(p * l + j, offset + i));
      if (hops) s = round_to(dtype, s);
      total = p == 0 ? s : total + s;
    }
    out[static_cast<std::size_t>(i)] = round_to(dtype, total);
  }
  return out;
}

}  // namespace

TEST_CASE("16-bit sums across processes: one rounding per hop, the same bits in every collective, half the bytes") {
  using C = Communicator::Collective;
  const int procs = dist::world_size();
  const int p = dist::rank();
  for (dp::Dtype dtype : {dp::Dtype::BFloat16, dp::Dtype::Float16}) {
    for (int l : kLocalCounts) {
      CAPTURE(dp::dtype_name(dtype));
      CAPTURE(l);
      auto comm = world_comm(l);
      const int w_all = comm->world_size();
      const std::int64_t m = 1237;
      const std::int64_t n = m * w_all + 5;  // uneven for every L and W: a tail
      auto piece = [&](int v) {
        const std::int64_t chunk = (n + w_all - 1) / w_all;
        const std::int64_t off = std::min<std::int64_t>(n, chunk * v);
        return std::pair<std::int64_t, std::int64_t>{off, std::min<std::int64_t>(chunk, n - off)};
      };
      auto input = [&](int w, std::int64_t k, std::int64_t offset, dp::Device dev) {
        return tensor_of(values(fval16, w, k, offset), dev).to(dtype);
      };
      comm->reset_process_times();
      std::vector<std::vector<float>> ar(static_cast<std::size_t>(l)), pieces(static_cast<std::size_t>(l)),
          rs(static_cast<std::size_t>(l));
      std::vector<std::int64_t> ar_bytes(static_cast<std::size_t>(l));
      on_ranks(l, [&](int j) {
        const dp::Device dev = dp::cpu(j);
        const int w = p * l + j;
        dp::Tensor x = input(w, n, 0, dev);
        comm->all_reduce(j, x, x, ReduceOp::Sum);
        REQUIRE(x.dtype() == dtype);
        ar[static_cast<std::size_t>(j)] = x.to_vector();
        ar_bytes[static_cast<std::size_t>(j)] = comm->process_times(j).bytes[static_cast<std::size_t>(C::AllReduce)];
        dp::Tensor z = input(w, n, 0, dev);
        for (int v = 0; v < w_all; ++v) {
          const auto [off, len] = piece(v);
          dp::Tensor part = z.narrow(0, off, len);
          comm->reduce(j, part, v == w ? part : dp::Tensor(), v, ReduceOp::Sum);
        }
        const auto [off, len] = piece(w);
        pieces[static_cast<std::size_t>(j)] = z.narrow(0, off, len).to_vector();
        dp::Tensor r = dp::zeros({m}, {.dtype = dtype, .device = dev});
        comm->reduce_scatter(j, input(w, m * w_all, 0, dev), r, ReduceOp::Sum);
        rs[static_cast<std::size_t>(j)] = r.to_vector();
      });
      const std::vector<float> want = expected16(dtype, procs, l, n);
      for (int j = 0; j < l; ++j) {
        CAPTURE(j);
        const int w = p * l + j;
        const std::vector<float>& a = ar[static_cast<std::size_t>(j)];
        CHECK(bitwise_equal(a, want));
        CHECK(same_as_rank0(a));
        check_pieces(a, pieces[static_cast<std::size_t>(j)], piece(w), rs[static_cast<std::size_t>(j)], w, m);
        // Between processes local rank j carries its block of n / L (the last rank the
        // tail too), 2 bytes an element.
        const std::int64_t block = n / l + (j == l - 1 ? n % l : 0);
        CHECK(ar_bytes[static_cast<std::size_t>(j)] == (procs > 1 ? 2 * block : 0));
      }
      // Small sizes: the tail the last local rank sums by hand rounds as the body.
      const auto small = small_all_reduces(*comm, l, 8, ReduceOp::Sum, input);
      for (std::int64_t k = 1; k <= 8; ++k)
        for (int j = 0; j < l; ++j)
          CHECK(bitwise_equal(small[static_cast<std::size_t>(j)][static_cast<std::size_t>(k - 1)],
                              expected16(dtype, procs, l, k, true, 100 * k)));
      if (procs > 1 && l > 1) {
        // The inputs tell a rounding per hop from one flat rounding apart.
        const std::vector<float> flat = expected16(dtype, procs, l, n, /*hops=*/false);
        std::int64_t differ = 0;
        for (std::int64_t i = 0; i < n; ++i) differ += flat[static_cast<std::size_t>(i)] != want[static_cast<std::size_t>(i)];
        CHECK(differ > 0);
      }
    }
  }
}

TEST_CASE("process_times: each local rank's time between processes, per collective") {
  using C = Communicator::Collective;
  const int procs = dist::world_size();
  const int l = 2;
  auto comm = world_comm(l);
  const std::int64_t n = 1001;  // local rank 1 carries the tail: 500 and 501 elements
  on_ranks(l, [&](int j) {
    dp::Tensor x = dp::ones({n}, dp::cpu(j));
    comm->all_reduce(j, x, x, ReduceOp::Sum);
  });
  comm->reset_process_times();
  for (int j = 0; j < l; ++j) CHECK(comm->process_times(j).total_ms() == 0);
  on_ranks(l, [&](int j) {
    dp::Tensor x = dp::ones({n}, dp::cpu(j));
    comm->all_reduce(j, x, x, ReduceOp::Sum);
    comm->all_reduce(j, x, x, ReduceOp::Sum);
    comm->broadcast(j, x, 1);  // world rank 1: process 0's local rank 1 carries it
  });
  for (int j = 0; j < l; ++j) {
    const Communicator::ProcessTimes t = comm->process_times(j);
    const auto ar = static_cast<std::size_t>(C::AllReduce);
    const auto bc = static_cast<std::size_t>(C::Broadcast);
    if (procs == 1) {  // the local communicator: nothing crosses a process
      CHECK(t.total_ms() == 0);
      CHECK(t.calls[ar] == 0);
      continue;
    }
    CHECK(t.calls[ar] == 2);
    CHECK(t.bytes[ar] == 2 * 4 * (j == 0 ? 500 : 501));
    CHECK(t.calls[bc] == 1);  // the index that does not carry it still makes the call
    CHECK(t.bytes[bc] == (j == 1 ? 4 * n : 0));
    CHECK(t.ms[ar] > 0);
    CHECK(t.calls[static_cast<std::size_t>(C::ReduceScatter)] == 0);
    CHECK(t.total_ms() >= t.ms[ar] + t.ms[bc]);
  }
  if (procs > 1) CHECK_THROWS_AS((void)comm->process_times(l), dp::Error);
  CHECK(std::string(Communicator::collective_name(C::ReduceScatter)) == "reduce_scatter");
}

TEST_CASE("CommOptions::timeout: a short one does not fire while every process takes part") {
  dp::backend::get(dp::cpu(0)).set_concurrent_devices(2);
  auto comm = dp::comm::make_world_communicator(cpus(2), {.timeout = std::chrono::milliseconds(2000)});
  on_ranks(2, [&](int j) {
    dp::Tensor x = dp::ones({4096}, dp::cpu(j));
    for (int k = 0; k < 5; ++k) comm->all_reduce(j, x, x, ReduceOp::Average);
    CHECK(x.to_vector()[0] == 1.0f);
  });
}

// ---- the failure scenarios (one per job, see meson.build) ------------------------------

namespace {

/// Local rank 1 of the last process aborts the communicator while every other rank
/// waits in an all_reduce: the job must end, naming the reason, and nobody gets through.
int run_fault_abort() {
  const int l = 2;
  auto comm = world_comm(l);
  const bool victim_process = dist::rank() == dist::world_size() - 1;
  run_ranks(l, [&](int j) {
    dp::Tensor x = dp::ones({1000}, dp::cpu(j));
    comm->all_reduce(j, x, x, ReduceOp::Sum);  // everyone healthy so far
    if (victim_process && j == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the others wait
      comm->abort("a worker failed on local rank 1");
    }
    comm->all_reduce(j, x, x, ReduceOp::Sum);
    std::cout << "FAULT-TEST: rank " << dist::rank() << " local rank " << j
              << " got through the collective\n" << std::flush;
  });
  return 0;
}

/// The world communicator is made with CommOptions::timeout = 1 s while DP_DIST_TIMEOUT
/// is far longer (meson.build sets 60 s): the last process sleeps instead of joining
/// the second all_reduce, and the others must give up after 1 s, naming it and the
/// communicator's limit (Note [Communicator timeouts]).
int run_fault_comm_timeout() {
  const int l = 2;
  dp::backend::get(dp::cpu(0)).set_concurrent_devices(l);
  auto comm = dp::comm::make_world_communicator(cpus(l), {.timeout = std::chrono::milliseconds(1000)});
  const bool victim = dist::rank() == dist::world_size() - 1;
  run_ranks(l, [&](int j) {
    dp::Tensor x = dp::ones({1000}, dp::cpu(j));
    comm->all_reduce(j, x, x, ReduceOp::Sum);
    if (victim) std::this_thread::sleep_for(std::chrono::seconds(40));
    comm->all_reduce(j, x, x, ReduceOp::Sum);
    std::cout << "FAULT-TEST: rank " << dist::rank() << " local rank " << j
              << " got through the collective\n" << std::flush;
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--fault=abort") return run_fault_abort();
    if (arg == "--fault=comm_timeout") return run_fault_comm_timeout();
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  // Only rank 0 reports successes; every rank reports its failures.
  if (dist::rank() != 0) ctx.setOption("minimal", true);
  if (dist::is_distributed()) ctx.setOption("no-colors", true);
  return ctx.run();
}

// Note [Collective dtypes] across processes: int64 crosses whole (broadcast and
// all_gather), int32 is broadcast but not all-gathered between processes (no process
// group type carries it), and no integer dtype is reduced.
TEST_CASE("world communicator dtypes: int64 broadcast and all_gather, integer reductions refused") {
  const int procs = dist::world_size();
  const int p = dist::rank();
  // Values no float holds exactly: a float path would change them.
  auto big = [](int w, std::int64_t i) { return (std::int64_t{1} << 53) + 1 + w * 1000003 + i * 7; };
  for (int l : kLocalCounts) {
    CAPTURE(l);
    auto comm = world_comm(l);
    const int w_all = procs * l;
    using Kind = Communicator::Collective;
    CHECK(comm->supports(Kind::Broadcast, dp::Dtype::Int32));
    CHECK(comm->supports(Kind::AllGather, dp::Dtype::Int64));
    CHECK(comm->supports(Kind::AllGather, dp::Dtype::Int32) == (procs == 1));
    CHECK_FALSE(comm->supports(Kind::AllReduce, dp::Dtype::Int64));
    CHECK(comm->supports(Kind::ReduceScatter, dp::Dtype::Float32));
    for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{13}}) {
      CAPTURE(count);
      const int root = w_all - 1;
      std::vector<std::vector<std::int64_t>> bcast(static_cast<std::size_t>(l)), gathered(static_cast<std::size_t>(l));
      std::vector<std::vector<std::int32_t>> bcast32(static_cast<std::size_t>(l));
      on_ranks(l, [&](int j) {
        const int me = p * l + j;
        std::vector<std::int64_t> mine(static_cast<std::size_t>(count));
        std::vector<std::int32_t> mine32(static_cast<std::size_t>(count));
        for (std::int64_t i = 0; i < count; ++i) {
          mine[static_cast<std::size_t>(i)] = big(me, i);
          mine32[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(-(me * 1000 + i));
        }
        dp::Tensor data = dp::from_vector(mine, {count}, dp::cpu(j));
        comm->broadcast(j, data, root);
        bcast[static_cast<std::size_t>(j)] = data.to_vector_i64();
        dp::Tensor data32 = dp::from_vector(mine32, {count}, dp::cpu(j));
        comm->broadcast(j, data32, root);
        bcast32[static_cast<std::size_t>(j)] = data32.to_vector_i32();
        dp::Tensor all = dp::zeros({count * w_all}, {.dtype = dp::Dtype::Int64, .device = dp::cpu(j)});
        comm->all_gather(j, dp::from_vector(mine, {count}, dp::cpu(j)), all);
        gathered[static_cast<std::size_t>(j)] = all.to_vector_i64();
      });
      std::vector<std::int64_t> want_bcast(static_cast<std::size_t>(count));
      std::vector<std::int64_t> want(static_cast<std::size_t>(count * w_all));
      std::vector<std::int32_t> want32(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) {
        want_bcast[static_cast<std::size_t>(i)] = big(root, i);
        want32[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(-(root * 1000 + i));
        for (int q = 0; q < w_all; ++q) want[static_cast<std::size_t>(q * count + i)] = big(q, i);
      }
      for (int j = 0; j < l; ++j) {
        CAPTURE(j);
        CHECK(bcast[static_cast<std::size_t>(j)] == want_bcast);
        CHECK(bcast32[static_cast<std::size_t>(j)] == want32);
        CHECK(gathered[static_cast<std::size_t>(j)] == want);
      }
    }
    // An int64 all-reduce: a dp::Error on every rank naming the dtype reductions take.
    const std::vector<std::string> errors = run_ranks(l, [&](int j) {
      dp::Tensor t = dp::ones({4}, {.dtype = dp::Dtype::Int64, .device = dp::cpu(j)});
      comm->all_reduce(j, t, t, ReduceOp::Sum);
    });
    for (const std::string& e : errors) {
      CHECK_MESSAGE(contains(e, "threw:"), e);
      CHECK_MESSAGE(contains(e, "has dtype int64, which all_reduce does not take"), e);
      // 16-bit floats are summed within a process and between processes alike.
      CHECK_MESSAGE(contains(e, "(it takes float32, bfloat16, float16)"), e);
    }
    if (procs > 1) {
      // int32 between processes: all_gather refuses it on every rank of every process.
      const std::vector<std::string> e32 = run_ranks(l, [&](int j) {
        dp::Tensor t = dp::ones({2}, {.dtype = dp::Dtype::Int32, .device = dp::cpu(j)});
        comm->all_gather(j, t, dp::zeros({2 * w_all}, {.dtype = dp::Dtype::Int32, .device = dp::cpu(j)}));
      });
      for (const std::string& e : e32) {
        CHECK_MESSAGE(contains(e, "threw:"), e);
        CHECK_MESSAGE(contains(e, "which all_gather does not take on the hierarchical communicator "
                                  "(it takes float32, int64, bfloat16, float16)"), e);
      }
    }
    // Still in step after the refusals.
    std::vector<std::vector<float>> sums(static_cast<std::size_t>(l));
    on_ranks(l, [&](int j) {
      dp::Tensor t = dp::ones({3}, dp::cpu(j));
      comm->all_reduce(j, t, t, ReduceOp::Sum);
      sums[static_cast<std::size_t>(j)] = t.to_vector();
    });
    for (const auto& v : sums) CHECK(v == std::vector<float>(3, static_cast<float>(w_all)));
  }
}
