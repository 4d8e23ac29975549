// src/parallel/worker_pool.h — one persistent thread per device (internal to parallel/).
//
// Each worker binds its device once (cudaSetDevice on CUDA; on CPU its kernels run
// in that device's task arena) and sleeps on a condition variable between tasks,
// so an idle pool costs no CPU. run() hands one function to every worker, waits for
// all of them and rethrows the root-cause failure (Note [Root cause]). This header
// knows nothing of modules or collectives beyond the CollectiveAborted type.
//
//   WorkerPool pool({dp::cpu(0), dp::cpu(1)});
//   pool.run([&](int rank) { outputs[rank] = net(inputs[rank]); },
//            [&](int, const std::exception_ptr&) { comm.abort("a worker failed"); });
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
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

/// Persistent worker threads, one per device (see the file comment).
class WorkerPool {
 public:
  /// Starts one thread per device; `name` prefixes error messages ("worker", "comm").
  explicit WorkerPool(std::vector<Device> devices, std::string name = "worker");
  /// Stops and joins every thread (waits for a running task to finish).
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  const std::vector<Device>& devices() const { return devices_; }

  /// Runs fn(rank) on every worker concurrently and waits for all of them. If any
  /// threw, throws dp::Error "<name> on <device>: <message>" for the root cause, with
  /// the original exception nested (std::rethrow_if_nested recovers it).
  void run(const std::function<void(int rank)>& fn, const ErrorHook& on_error = nullptr);

  /// Starts fn(rank) on every worker and returns at once; wait() collects each rank.
  void launch(const std::function<void(int rank)>& fn, const ErrorHook& on_error = nullptr);
  /// Waits for the launched task on `rank`; returns what it threw (null if nothing).
  std::exception_ptr wait(int rank);

 private:
  struct Worker {
    std::thread thread;
    std::function<void(int)> task;
    ErrorHook on_error;
    bool has_task = false;
    bool done = true;
    std::exception_ptr error;
  };
  void loop(int rank);
  [[noreturn]] void throw_root_cause(const std::vector<std::exception_ptr>& errors) const;

  std::vector<Device> devices_;
  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_task_;
  std::condition_variable cv_done_;
  std::vector<Worker> workers_;
  bool stop_ = false;
};

}  // namespace dp::parallel
