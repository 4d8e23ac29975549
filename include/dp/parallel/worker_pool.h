// dp/parallel/worker_pool.h — one persistent thread per device.
//
// Each worker binds its device once (cudaSetDevice on CUDA; on CPU its kernels run
// in that device's task arena) and sleeps on a condition variable between tasks,
// so an idle pool costs no CPU. run() hands one function to every worker, waits for
// all of them and rethrows the first failure as a dp::Error naming the device.
// This header knows nothing of modules or collectives.
//
//   dp::parallel::WorkerPool pool({dp::cpu(0), dp::cpu(1)});
//   pool.run([&](int rank) { outputs[rank] = net(inputs[rank]); });
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

  /// Runs fn(rank) on every worker concurrently and waits. If any throws, waits for
  /// the others, then throws dp::Error "<name> on <device>: <what>" for the lowest
  /// failing rank. `on_error(rank, what)` is called as soon as a worker fails (e.g.
  /// to abort a communicator so the other workers do not wait forever).
  void run(const std::function<void(int rank)>& fn,
           const std::function<void(int rank, const std::string& what)>& on_error = nullptr);

  /// Starts fn(rank) on every worker and returns at once; wait() collects it.
  void launch(const std::function<void(int rank)>& fn,
              const std::function<void(int rank, const std::string& what)>& on_error = nullptr);
  /// Waits for the launched task on `rank` and returns its error text ("" if none).
  std::string wait(int rank);

 private:
  struct Worker {
    std::thread thread;
    std::function<void(int)> task;
    std::function<void(int, const std::string&)> on_error;
    bool has_task = false;
    bool done = true;
    std::string error;
  };
  void loop(int rank);

  std::vector<Device> devices_;
  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_task_;
  std::condition_variable cv_done_;
  std::vector<Worker> workers_;
  bool stop_ = false;
};

}  // namespace dp::parallel
