// src/parallel/worker_pool.h — one persistent thread per device (internal to parallel/).
//
// Each worker binds its device once (cudaSetDevice on CUDA; on CPU its kernels run
// in that device's task arena) and waits for work on its own slot: a short spin,
// then a futex wait, so an idle pool costs no CPU and a busy one hands work over
// without waking anyone else (Note [Hand-over]). run() gives one function to every
// rank, waits for all of them and rethrows the root-cause failure with its own
// type (Note [Root cause]). With `caller_runs_rank0` the calling thread runs rank 0's share itself,
// so a one-device step hands nothing over at all. This header knows nothing of
// modules or collectives beyond the CollectiveAborted type.
//
//   WorkerPool pool({dp::cpu(0), dp::cpu(1)}, "worker", /*caller_runs_rank0=*/true);
//   pool.run([&](int rank) { outputs[rank] = net(inputs[rank]); },
//            [&](int, const std::exception_ptr&) { comm.abort("a worker failed"); });
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dp/core/device.h"

namespace dp::parallel {

/// Called on the failing thread as soon as a task throws (e.g. to abort a
/// communicator so that the other ranks stop waiting for this one).
using ErrorHook = std::function<void(int rank, const std::exception_ptr& error)>;

/// The message of an exception_ptr's exception ("unknown exception" for non-std ones).
std::string describe(const std::exception_ptr& error);
/// True when the exception is a dp::CollectiveAborted: an echo of another rank's failure.
bool is_collective_aborted(const std::exception_ptr& error);
/// True when the exception's type is dp::Error itself, not a subclass or another type.
bool is_plain_error(const std::exception_ptr& error);
/// Remembers that `error` was rethrown from a worker on `device` (dp::failed_device).
void remember_failure(const std::exception_ptr& error, Device device) noexcept;

/// Persistent worker threads, one per device (see the file comment).
class WorkerPool {
 public:
  /// Starts one thread per device (none for rank 0 when the caller runs it); `name`
  /// prefixes error messages ("worker", "comm").
  explicit WorkerPool(std::vector<Device> devices, std::string name = "worker", bool caller_runs_rank0 = false);
  /// Waits for any launched task, then stops and joins every thread.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  const std::vector<Device>& devices() const { return devices_; }

  /// Runs fn(rank) for rank in [0, ranks) (default: every rank) concurrently and waits
  /// for all of them. If any threw, rethrows the root cause's exception as it was
  /// thrown, or for a plain dp::Error a dp::Error "<name> on <device>: <message>" with
  /// the original nested (Note [Root cause]); dp::failed_device() names its device.
  void run(const std::function<void(int rank)>& fn, const ErrorHook& on_error = nullptr, int ranks = -1);

  /// Starts fn(rank) on every rank's thread and returns at once; wait() collects each
  /// rank. Not available when the caller runs rank 0.
  void launch(const std::function<void(int rank)>& fn, const ErrorHook& on_error = nullptr);
  /// Waits for the launched task on `rank`; returns what it threw (null if nothing).
  std::exception_ptr wait(int rank);

  /// Tasks handed to the pool's threads since construction (rank 0's share run by the
  /// caller is not a hand-over).
  std::int64_t handoffs() const { return handoffs_.load(std::memory_order_relaxed); }

 private:
  struct Slot;
  void loop(int rank);
  void post(int rank, const std::function<void(int)>* fn, const ErrorHook* on_error);
  std::exception_ptr execute(int rank, const std::function<void(int)>& fn, const ErrorHook* on_error) const;
  [[noreturn]] void throw_root_cause(const std::vector<std::exception_ptr>& errors, int ranks) const;

  std::vector<Device> devices_;
  std::string name_;
  bool caller_runs_rank0_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::atomic<bool> stop_{false};
  std::atomic<std::int64_t> handoffs_{0};
};

}  // namespace dp::parallel
