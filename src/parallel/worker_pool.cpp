#include "parallel/worker_pool.h"

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"

namespace dp::parallel {

std::string describe(const std::exception_ptr& error) {
  if (!error) return {};
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

bool is_collective_aborted(const std::exception_ptr& error) {
  if (!error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const CollectiveAborted&) {
    return true;
  } catch (...) {
    return false;
  }
}

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
  Worker& w = workers_[rank];
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_task_.wait(lock, [&] { return stop_ || w.has_task; });
    if (!w.has_task) return;  // stop_ and nothing left to run
    auto task = std::move(w.task);
    auto on_error = std::move(w.on_error);
    w.has_task = false;
    lock.unlock();
    std::exception_ptr error;
    try {
      task(rank);
    } catch (...) {
      error = std::current_exception();
    }
    if (error && on_error) {
      try {
        on_error(rank, error);
      } catch (const std::exception& e) {
        detail::log_warning(detail::str_cat(name_, " on ", devices_[rank], ": error hook failed: ", e.what()));
      }
    }
    lock.lock();
    w.error = std::move(error);
    w.done = true;
    cv_done_.notify_all();
  }
}

void WorkerPool::launch(const std::function<void(int)>& fn, const ErrorHook& on_error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& w : workers_) {
      DP_ASSERT(w.done, "launch while a task is still running");
      w.task = fn;
      w.on_error = on_error;
      w.has_task = true;
      w.done = false;
      w.error = nullptr;
    }
  }
  cv_task_.notify_all();
}

std::exception_ptr WorkerPool::wait(int rank) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return workers_[rank].done; });
  return std::exchange(workers_[rank].error, nullptr);
}

void WorkerPool::run(const std::function<void(int)>& fn, const ErrorHook& on_error) {
  launch(fn, on_error);
  std::vector<std::exception_ptr> errors(size());
  bool failed = false;
  for (int r = 0; r < size(); ++r) {
    errors[r] = wait(r);
    failed = failed || errors[r];
  }
  if (failed) throw_root_cause(errors);
}

// Note [Root cause]
// When one rank fails, the runtime aborts the communicator so that ranks blocked in
// a collective are released with dp::CollectiveAborted instead of waiting forever.
// Those ranks only failed because another one did, so the error reported is the
// lowest rank whose exception is of another type; only when every failure is an
// abort (the communicator was aborted from outside) is the lowest aborted rank
// reported. The original exception is nested inside the dp::Error thrown, as
// PyTorch's ExceptionWrapper keeps the worker's traceback.
void WorkerPool::throw_root_cause(const std::vector<std::exception_ptr>& errors) const {
  int root = -1;
  for (int r = 0; r < size(); ++r) {
    if (!errors[r]) continue;
    if (root < 0 || (is_collective_aborted(errors[root]) && !is_collective_aborted(errors[r]))) root = r;
  }
  DP_ASSERT(root >= 0);
  try {
    std::rethrow_exception(errors[root]);
  } catch (...) {
    std::throw_with_nested(Error(detail::str_cat(name_, " on ", devices_[root], ": ", describe(errors[root]))));
  }
}

}  // namespace dp::parallel
