#include "parallel/worker_pool.h"

#include <deque>
#include <mutex>
#include <optional>
#include <typeinfo>

#include "backend/backend.h"
#include "core/parking.h"
#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/parallel/data_parallel.h"

namespace dp::parallel {

// Note [Hand-over]
// Each worker owns a slot with two counters: `posted`, bumped by the caller to hand
// over a task, and `finished`, set by the worker to the posted value once the task
// is done. Whoever waits for a counter to move first spins briefly (kSpins pause
// instructions: a few microseconds, about the gap between two phases of a small
// step), then parks (Note [Parking] in core/parking.h). A hand-over is one store and,
// only when the other thread is parked, one wake of that thread — no shared mutex, no
// notify_all, and no system call at all between threads that are both spinning. The
// spin is short so that a machine with more devices than cores loses little to it.
namespace {

constexpr int kSpins = 512;  // ~5-30 us of pause instructions, depending on the CPU

}  // namespace

struct WorkerPool::Slot {
  std::thread thread;
  // Written by the caller before `posted` is bumped, read by the worker after it saw
  // the bump (release/acquire on `posted`). run() points at the caller's objects (it
  // waits); launch() points at the slot's own copies.
  const std::function<void(int)>* task = nullptr;
  const ErrorHook* on_error = nullptr;
  std::function<void(int)> owned_task;
  ErrorHook owned_on_error;
  std::exception_ptr error;  // written by the worker before `finished` is set
  detail::ParkingWord posted;
  detail::ParkingWord finished;
};

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

bool is_plain_error(const std::exception_ptr& error) {
  if (!error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return typeid(e) == typeid(Error);
  } catch (...) {
    return false;
  }
}

namespace {

// The failures rethrown lately, for dp::failed_device. Kept process-wide, not per
// thread: a handler may store the exception_ptr and ask from another thread. Holding
// the exception_ptr keeps the object alive, so an address is never reused while it is
// remembered.
constexpr std::size_t kRememberedFailures = 64;  // as documented in data_parallel.h

struct Failure {
  std::exception_ptr error;
  Device device;
};

std::mutex g_failures_mu;
std::deque<Failure> g_failures;  // newest last

}  // namespace

void remember_failure(const std::exception_ptr& error, Device device) noexcept {
  try {
    std::lock_guard<std::mutex> lock(g_failures_mu);
    if (g_failures.size() == kRememberedFailures) g_failures.pop_front();
    g_failures.push_back({error, device});
  } catch (...) {
    // Out of memory here: the root cause must still reach the caller, without its device.
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

WorkerPool::WorkerPool(std::vector<Device> devices, std::string name, bool caller_runs_rank0)
    : devices_(std::move(devices)), name_(std::move(name)), caller_runs_rank0_(caller_runs_rank0) {
  for (int r = 0; r < size(); ++r) slots_.push_back(std::make_unique<Slot>());
  for (int r = caller_runs_rank0_ ? 1 : 0; r < size(); ++r)
    slots_[r]->thread = std::thread([this, r] { loop(r); });
}

WorkerPool::~WorkerPool() {
  for (auto& s : slots_) {
    if (!s->thread.joinable()) continue;
    const std::uint32_t p = s->posted.load(std::memory_order_relaxed);
    for (std::uint32_t f = s->finished.load(); f != p;) f = s->finished.await_change(f, kSpins);
  }
  stop_.store(true, std::memory_order_release);
  for (auto& s : slots_) {
    if (!s->thread.joinable()) continue;
    s->posted.bump();
    s->thread.join();
  }
}

void WorkerPool::loop(int rank) {
  // Thread-local state is set once, explicitly: the device binding and grad mode.
  try {
    backend::get(devices_[rank]).set_current_device(devices_[rank]);
  } catch (const std::exception& e) {
    detail::log_warning(detail::str_cat(name_, " on ", devices_[rank], ": cannot bind device: ", e.what()));
  }
  set_grad_enabled(true);
  Slot& s = *slots_[rank];
  std::uint32_t seen = 0;
  for (;;) {
    seen = s.posted.await_change(seen, kSpins);
    if (stop_.load(std::memory_order_acquire)) return;
    s.error = execute(rank, *s.task, s.on_error);
    s.finished.set(seen);
  }
}

std::exception_ptr WorkerPool::execute(int rank, const std::function<void(int)>& fn,
                                       const ErrorHook* on_error) const {
  std::exception_ptr error;
  try {
    fn(rank);
  } catch (...) {
    error = std::current_exception();
  }
  if (error && on_error && *on_error) {
    try {
      (*on_error)(rank, error);
    } catch (const std::exception& e) {
      detail::log_warning(detail::str_cat(name_, " on ", devices_[rank], ": error hook failed: ", e.what()));
    }
  }
  return error;
}

void WorkerPool::post(int rank, const std::function<void(int)>* fn, const ErrorHook* on_error) {
  Slot& s = *slots_[rank];
  DP_ASSERT(s.finished.load(std::memory_order_acquire) == s.posted.load(std::memory_order_relaxed),
            "a task was handed to ", name_, " ", rank, " while its previous one still runs");
  s.task = fn;
  s.on_error = on_error;
  s.posted.bump();
  handoffs_.fetch_add(1, std::memory_order_relaxed);
}

void WorkerPool::launch(const std::function<void(int)>& fn, const ErrorHook& on_error) {
  DP_ASSERT(!caller_runs_rank0_, "launch() on a pool whose caller runs rank 0");
  for (int r = 0; r < size(); ++r) {
    Slot& s = *slots_[r];
    DP_ASSERT(s.finished.load(std::memory_order_acquire) == s.posted.load(std::memory_order_relaxed),
              "launch while a task is still running");
    s.owned_task = fn;
    s.owned_on_error = on_error;
    post(r, &s.owned_task, &s.owned_on_error);
  }
}

std::exception_ptr WorkerPool::wait(int rank) {
  Slot& s = *slots_[rank];
  const std::uint32_t p = s.posted.load(std::memory_order_relaxed);
  std::uint32_t f = s.finished.load(std::memory_order_acquire);
  while (f != p) f = s.finished.await_change(f, kSpins);
  return std::exchange(s.error, nullptr);
}

void WorkerPool::run(const std::function<void(int)>& fn, const ErrorHook& on_error, int ranks) {
  if (ranks < 0) ranks = size();
  DP_ASSERT(ranks <= size());
  const int first_posted = caller_runs_rank0_ ? 1 : 0;
  for (int r = first_posted; r < ranks; ++r) post(r, &fn, &on_error);
  std::vector<std::exception_ptr> errors(ranks);
  if (caller_runs_rank0_ && ranks > 0) {
    // Note [Rank 0 on the caller]
    // The caller binds device 0 (on CUDA it stays the
    // calling thread's current device afterwards, as torch.cuda.set_device would).
    try {
      backend::get(devices_[0]).set_current_device(devices_[0]);
      errors[0] = execute(0, fn, &on_error);
    } catch (...) {
      errors[0] = std::current_exception();
      if (on_error) on_error(0, errors[0]);
    }
  }
  bool failed = ranks > 0 && errors[0];
  for (int r = first_posted; r < ranks; ++r) {
    errors[r] = wait(r);
    failed = failed || errors[r];
  }
  if (failed) throw_root_cause(errors, ranks);
}

// Note [Root cause]
// When one rank fails, the runtime aborts the communicator so that ranks blocked in
// a collective are released with dp::CollectiveAborted instead of waiting forever.
// Those ranks only failed because another one did, so the error reported is the
// lowest rank whose exception is of another type; only when every failure is an
// abort (the communicator was aborted from outside) is the lowest aborted rank
// reported. What the caller gets is that rank's own exception (Note [Errors keep
// their type] in dp/parallel/data_parallel.h): the same object, whatever its type,
// except a plain dp::Error, which becomes a dp::Error "<name> on <device>: <message>"
// with the original nested (as PyTorch's ExceptionWrapper keeps the worker's
// traceback) — the same type with the device in its message. The rank's device is
// remembered with the exception for dp::failed_device().
void WorkerPool::throw_root_cause(const std::vector<std::exception_ptr>& errors, int ranks) const {
  int root = -1;
  for (int r = 0; r < ranks; ++r) {
    if (!errors[r]) continue;
    if (root < 0 || (is_collective_aborted(errors[root]) && !is_collective_aborted(errors[r]))) root = r;
  }
  DP_ASSERT(root >= 0);
  std::exception_ptr thrown = errors[root];
  if (is_plain_error(errors[root])) {
    try {
      std::rethrow_exception(errors[root]);
    } catch (...) {
      try {
        std::throw_with_nested(Error(detail::str_cat(name_, " on ", devices_[root], ": ", describe(errors[root]))));
      } catch (...) {
        thrown = std::current_exception();
      }
    }
  }
  remember_failure(thrown, devices_[root]);
  std::rethrow_exception(thrown);
}

}  // namespace dp::parallel

namespace dp {

// Matched by identity: std::rethrow_exception throws the stored object itself in
// libstdc++ and libc++, so std::current_exception() inside the caller's handler equals
// the exception_ptr remembered (the standard also allows a copy, which MSVC makes;
// there this would answer std::nullopt).
std::optional<Device> failed_device(const std::exception_ptr& error) {
  if (!error) return std::nullopt;
  std::lock_guard<std::mutex> lock(parallel::g_failures_mu);
  for (auto it = parallel::g_failures.rbegin(); it != parallel::g_failures.rend(); ++it)
    if (it->error == error) return it->device;
  return std::nullopt;
}

std::optional<Device> failed_device() { return failed_device(std::current_exception()); }

}  // namespace dp
