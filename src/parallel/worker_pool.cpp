#include "dp/parallel/worker_pool.h"

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"

namespace dp::parallel {

WorkerPool::WorkerPool(std::vector<Device> devices, std::string name)
    : devices_(std::move(devices)), name_(std::move(name)), workers_(devices_.size()) {
  for (int r = 0; r < size(); ++r) workers_[r].thread = std::thread([this, r] { loop(r); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_task_.notify_all();
  for (auto& w : workers_)
    if (w.thread.joinable()) w.thread.join();
}

void WorkerPool::loop(int rank) {
  // Thread-local state is set once, explicitly: the device binding and grad mode.
  try {
    backend::get(devices_[rank]).set_current_device(devices_[rank]);
  } catch (const std::exception& e) {
    detail::log_warning(detail::str_cat(name_, " on ", devices_[rank], ": cannot bind device: ", e.what()));
  }
  set_grad_enabled(true);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_task_.wait(lock, [&] { return stop_ || workers_[rank].has_task; });
    if (workers_[rank].has_task) {
      Worker& w = workers_[rank];
      auto task = std::move(w.task);
      auto on_error = w.on_error;
      w.has_task = false;
      lock.unlock();
      std::string error;
      try {
        task(rank);
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "unknown exception";
      }
      if (!error.empty() && on_error) {
        try {
          on_error(rank, error);
        } catch (...) {
        }
      }
      lock.lock();
      w.error = std::move(error);
      w.done = true;
      cv_done_.notify_all();
      continue;
    }
    if (stop_) return;
  }
}

void WorkerPool::launch(const std::function<void(int)>& fn,
                        const std::function<void(int, const std::string&)>& on_error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : workers_) {
      DP_ASSERT(w.done, "launch while a task is still running");
      w.task = fn;
      w.on_error = on_error;
      w.has_task = true;
      w.done = false;
      w.error.clear();
    }
  }
  cv_task_.notify_all();
}

std::string WorkerPool::wait(int rank) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return workers_[rank].done; });
  return workers_[rank].error;
}

void WorkerPool::run(const std::function<void(int)>& fn,
                     const std::function<void(int, const std::string&)>& on_error) {
  launch(fn, on_error);
  // Report the root cause: a rank released by an aborted collective only failed
  // because another rank did.
  std::string first;
  int first_rank = -1;
  bool first_is_echo = true;
  for (int r = 0; r < size(); ++r) {
    std::string e = wait(r);
    if (e.empty()) continue;
    bool echo = e.find("collective aborted") != std::string::npos;
    if (first_rank < 0 || (first_is_echo && !echo)) {
      first = std::move(e);
      first_rank = r;
      first_is_echo = echo;
    }
  }
  if (first_rank >= 0) throw Error(detail::str_cat(name_, " on ", devices_[first_rank], ": ", first));
}

}  // namespace dp::parallel
