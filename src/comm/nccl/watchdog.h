// src/comm/nccl/watchdog.h — when to give up on a stream-ordered collective.
//
// A collective enqueued on a device stream completes later, or never (a peer failed
// before calling it). The Watchdog keeps, per watched rank, the collectives enqueued
// and not yet seen complete, and decides (Note [NCCL failures], nccl_communicator.h):
//   - a collective still running `timeout` after it was enqueued, a collective that
//     failed, or an asynchronous error of a rank's communicator → abort every rank,
//     once, with a reason naming the rank's device and the collective;
//   - a completed collective → handed back to the communicator (release) and forgotten.
// It knows nothing of CUDA or NCCL: the clock, "is this collective complete?", "has
// this rank an asynchronous error?" and the abort are hooks, so the decisions are
// tested on CPU with a fake clock and fake probes (tests/comm/watchdog_test.cpp), and
// the NCCL communicator supplies CUDA events and ncclCommGetAsyncError. Compiled in
// every build. Internal header.
//
//   Watchdog dog(std::chrono::minutes(10), hooks);
//   const int r = dog.add_rank("cuda:0 (world rank 0)");
//   dog.start(std::chrono::milliseconds(100));   // or call dog.poll() yourself
//   dog.enqueued(r, event, "all_reduce", count); // after each collective is enqueued
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dp::comm::detail {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;
  using TimePoint = Clock::time_point;
  /// The communicator's handle of one enqueued collective (the NCCL communicator's
  /// CUDA event); the watchdog only passes it back to the hooks.
  using Token = const void*;

  enum class Progress { Running, Complete, Failed };
  /// What `query` says of one collective; `error` explains Failed.
  struct Probe {
    Progress progress = Progress::Running;
    std::string error;
  };

  /// Why the watchdog fired.
  struct Failure {
    int rank = -1;           // the watched rank where it was found
    std::string label;       // that rank's label (its device, its world rank)
    std::string collective;  // the collective concerned, "" when none was in flight
    std::string reason;      // the whole message, naming label and collective
  };

  /// The communicator's side. Every hook is called from the thread that polls (the
  /// watchdog's own once start()ed) and never with the watchdog's lock held, except
  /// `now` and `query`, which must therefore neither block nor call the watchdog.
  struct Hooks {
    std::function<TimePoint()> now = [] { return Clock::now(); };
    /// State of collective `token` of `rank` (the oldest still pending there).
    std::function<Probe(int rank, Token token)> query;
    /// An asynchronous error of `rank`'s communicator, or "" (may be null: none).
    std::function<std::string(int rank)> async_error;
    /// Collective `token` of `rank` is forgotten: its handle may be reused (may be null).
    std::function<void(int rank, Token token)> release;
    /// Abort `ranks` (every rank watched) because of `failure`. Called at most once
    /// until clear().
    std::function<void(const std::vector<int>& ranks, const Failure& failure)> abort;
  };

  /// `timeout` > 0: how long a collective may stay incomplete after it was enqueued.
  Watchdog(std::chrono::milliseconds timeout, Hooks hooks);
  /// stop()s the thread; pending collectives are released.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// Watches one more rank, labelled for messages ("cuda:1 (world rank 5)"); returns
  /// its id (0, 1, ...). Before start().
  int add_rank(std::string label);
  int ranks() const { return static_cast<int>(labels_.size()); }
  std::chrono::milliseconds timeout() const { return timeout_; }

  /// Rank `rank` enqueued a collective named `what` (a string literal) of `count`
  /// elements, tracked by `token`; its deadline runs from now(). Collectives of one
  /// rank complete in the order they are enqueued (one stream).
  void enqueued(int rank, Token token, const char* what, std::size_t count);

  /// One pass: forgets the completed collectives at the front of every rank's queue,
  /// and fires (abort hook, then true) on the first failure found: a failed or timed-out
  /// collective, or an asynchronous error. False when nothing fired in this pass,
  /// including every pass after the watchdog fired or was disarmed.
  bool poll();

  /// Polls every `interval` on a thread of its own until stop().
  void start(std::chrono::milliseconds interval);
  /// Ends the thread promptly, whatever is pending; idempotent. Not from a hook.
  void stop();

  /// An abort came from elsewhere: stop judging (never fire) until clear().
  void disarm();
  /// True once fired or disarmed, until clear().
  bool tripped() const;
  /// Releases every pending collective and arms the watchdog again (after the
  /// communicator was reset).
  void clear();
  /// Collectives of `rank` not yet seen complete.
  std::size_t pending(int rank) const;

 private:
  struct Entry {
    Token token;
    const char* what;
    std::size_t count;
    TimePoint enqueued;
  };

  /// Fires with `failure` unless already tripped. Outside mu_.
  bool fire(Failure failure);
  std::string in_flight(int rank) const;  // mu_ held

  const std::chrono::milliseconds timeout_;
  const Hooks hooks_;
  std::vector<std::string> labels_;  // fixed once start()ed

  mutable std::mutex mu_;  // guards queues_ and tripped_
  std::vector<std::deque<Entry>> queues_;
  bool tripped_ = false;

  std::mutex thread_mu_;  // guards stop_
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dp::comm::detail
