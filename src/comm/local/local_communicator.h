// src/comm/local/local_communicator.h — collectives among CPU virtual devices over
// shared memory.
//
// Internal header of the comm layer (users reach it through make_communicator /
// make_local_communicator). Every rank is driven by its own thread; a collective is a
// rendezvous on a lock-free barrier (Note [Local barrier]) after which each rank reads
// the other ranks' buffers directly. All-reduce is reduce-scatter + all-gather: rank r
// reduces slice r of the buffer in the fixed rank order 0..N-1, so results are bitwise
// identical on every rank and from run to run (Note [Fixed summation order]). This header
// knows nothing of modules, optimizers or DataParallel.
//
//   auto comm = std::make_unique<dp::comm::LocalCommunicator>(devices);
//   // on rank r's thread:
//   comm->all_reduce(r, grad, grad, dp::comm::ReduceOp::Sum);
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/argument_checks.h"
#include "core/parking.h"
#include "dp/comm/communicator.h"

namespace dp::comm {

namespace detail {

// Note [Local barrier]
// A sense-less generation barrier: `arrived` counts ranks of the current round; the
// last one resets it and bumps `generation` (release), the others wait for the bump
// (acquire) — first a short spin, then a park (Note [Parking] in core/parking.h), so a
// rank that waits long sleeps in the kernel instead of burning a core that another
// virtual device needs, and the last arriver makes a wake system call only when some
// rank is parked. No mutex is taken. abort() sets `aborted`, bumps `generation` and wakes every
// waiter; a waiter that wakes (or a rank that arrives) with `aborted` set returns false,
// and the communicator throws dp::CollectiveAborted naming its collective and rank.
// Release sequences of the acq_rel fetch_add on `arrived` make everything each rank
// wrote before arriving visible to every rank that leaves the barrier.
class Barrier {
 public:
  explicit Barrier(int parties) : parties_(parties) {}

  /// Waits until all parties arrived; true then. False, at once or as soon as it
  /// happens, when the barrier is (or becomes) aborted.
  [[nodiscard]] bool arrive_and_wait();
  /// Releases every waiter (their arrive_and_wait returns false); sticky until reset().
  /// The first reason is kept.
  void abort(const std::string& reason);
  /// Clears the abort state and the arrival count (call only while no rank is inside).
  void reset();
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  /// The reason given to the first abort() since the last reset() ("" when none).
  std::string reason() const;

 private:
  const int parties_;
  alignas(64) std::atomic<int> arrived_{0};
  dp::detail::ParkingWord generation_;
  alignas(64) std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mu_;  // guards reason_ (abort path only, never the hot path)
  std::string reason_;
};

/// A rank's host scratch: grows geometrically, so buckets of changing sizes settle
/// after a few calls, and frees the old block before allocating the new one (a lower
/// peak). Touched by its rank's thread only, between collectives that no other rank
/// still reads it in.
class ScratchBuffer {
 public:
  /// At least `bytes` bytes (aligned for any element type), kept across calls.
  std::byte* reserve(std::size_t bytes);

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t capacity_ = 0;
};

}  // namespace detail

/// The shared-memory communicator for CPU virtual devices (see the file comment).
class LocalCommunicator final : public Communicator {
 public:
  /// Devices must be distinct, valid CPU devices (checked; throws dp::Error).
  explicit LocalCommunicator(std::vector<Device> devices);
  ~LocalCommunicator() override;

  std::string backend_name() const override { return "local"; }
  /// Waits for nothing: every local collective has finished when it returns. Throws
  /// dp::CollectiveAborted while the communicator is aborted, as every collective does.
  void synchronize(int rank) override;
  void abort(const std::string& reason) override;
  void reset() override;

  /// What one rank publishes for a collective (public only for the .cpp's helpers).
  /// Buffers are bytes: the data path moves element_size(call.dtype) per element and
  /// adds through the dtype's summation (Note [Collective dtypes]).
  using Kind = Collective;
  struct alignas(64) Slot {
    CallShape call;  // count: elements of send (broadcast: data; all_gather: send)
    const std::byte* send = nullptr;
    std::byte* recv = nullptr;
    std::byte* scratch = nullptr;  // this rank's scratch, valid for this collective
    std::string error;             // non-empty: this rank's call was refused, why
  };

 protected:
  void do_all_reduce(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_broadcast(int rank, const Tensor& data, int root) override;
  void do_reduce(int rank, const Tensor& send, const Tensor& recv, int root, ReduceOp op) override;
  void do_reduce_scatter(int rank, const Tensor& send, const Tensor& recv, ReduceOp op) override;
  void do_all_gather(int rank, const Tensor& send, const Tensor& recv) override;
  /// Publishes the problem in rank's slot: every rank throws dp::Error naming it.
  void refuse(int rank, Collective kind, const std::string& problem) override;

 private:
  /// Publishes `slot` as rank's entry, meets the other ranks and checks that every rank
  /// called the same collective with the same count/root/op and valid buffers. Returns
  /// a snapshot of all slots; throws dp::Error on every rank otherwise.
  std::vector<Slot> rendezvous(int rank, Slot slot, const char* what);
  /// Meets the other ranks at the barrier; throws dp::CollectiveAborted for `what` on
  /// `rank` when the communicator is (or becomes) aborted, once no rank can still
  /// touch this rank's buffers (Note [Leaving an aborted collective]).
  void sync(int rank, const char* what);
  /// Counts rank in `inside_` for one collective call (Note [Leaving an aborted
  /// collective]); leave() is idempotent.
  class Inside {
   public:
    Inside(LocalCommunicator& c, int rank);
    ~Inside() { leave(); }
    Inside(const Inside&) = delete;
    Inside& operator=(const Inside&) = delete;
    void leave() noexcept;

   private:
    LocalCommunicator& c_;
    int rank_;
  };
  /// Takes rank out of `inside_` if it is counted there.
  void count_out(int rank) noexcept;
  /// Rank's scratch of at least `bytes` bytes: only rank's thread touches it between
  /// collectives, the previous one having ended with no other rank still reading it
  /// (Note [Local collective protocol]).
  std::byte* scratch(int rank, std::size_t bytes) { return scratch_[static_cast<std::size_t>(rank)].reserve(bytes); }

  detail::Barrier barrier_;
  std::vector<Slot> slots_;
  std::vector<detail::ScratchBuffer> scratch_;  // per rank; written only by its rank's thread
  std::atomic<int> inside_{0};    // ranks inside a collective call
  std::vector<char> in_;          // in_[r]: rank r is counted in inside_ (r's thread only)
};

}  // namespace dp::comm
