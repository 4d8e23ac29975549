// The collective watchdog (see watchdog.h; Note [NCCL failures] in nccl_communicator.h).
#include "comm/nccl/watchdog.h"

#include <exception>
#include <utility>

#include "dp/core/error.h"

namespace dp::comm::detail {

Watchdog::Watchdog(std::chrono::milliseconds timeout, Hooks hooks)
    : timeout_(timeout), hooks_(std::move(hooks)) {
  DP_CHECK(timeout_.count() > 0, "watchdog: expected a positive timeout, got ", timeout_.count(), " ms");
  DP_ASSERT(hooks_.now && hooks_.query && hooks_.abort, "watchdog: now, query and abort are required");
}

Watchdog::~Watchdog() {
  stop();
  clear();
}

int Watchdog::add_rank(std::string label) {
  DP_ASSERT(!thread_.joinable(), "watchdog: add_rank after start");
  std::lock_guard<std::mutex> lock(mu_);
  labels_.push_back(std::move(label));
  queues_.emplace_back();
  return static_cast<int>(labels_.size()) - 1;
}

void Watchdog::enqueued(int rank, Token token, const char* what, std::size_t count) {
  DP_ASSERT(rank >= 0 && rank < ranks(), "watchdog: unknown rank ", rank);
  std::lock_guard<std::mutex> lock(mu_);
  queues_[static_cast<std::size_t>(rank)].push_back(Entry{token, what, count, hooks_.now()});
}

std::string Watchdog::in_flight(int rank) const {
  const std::deque<Entry>& q = queues_[static_cast<std::size_t>(rank)];
  return q.empty() ? std::string() : std::string(q.front().what);
}

bool Watchdog::poll() {
  std::vector<std::pair<int, Token>> done;  // released once the lock is dropped
  Failure failure;
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (tripped_) return false;
    const TimePoint now = hooks_.now();
    for (int r = 0; r < ranks() && !failed; ++r) {
      std::deque<Entry>& q = queues_[static_cast<std::size_t>(r)];
      // One stream per rank: collectives complete in order, so the front one is the
      // only one whose deadline matters; the ones behind it were enqueued later.
      while (!q.empty()) {
        const Entry& e = q.front();
        Probe probe;
        try {
          probe = hooks_.query(r, e.token);
        } catch (const std::exception& ex) {
          probe = {Progress::Failed, dp::detail::str_cat("the watchdog could not query it: ", ex.what())};
        }
        if (probe.progress == Progress::Complete) {
          done.emplace_back(r, e.token);
          q.pop_front();
          continue;
        }
        if (probe.progress == Progress::Failed) {
          failure = {r, labels_[static_cast<std::size_t>(r)], e.what,
                     dp::detail::str_cat(e.what, " of ", e.count, " elements on ", labels_[static_cast<std::size_t>(r)],
                                         " failed: ", probe.error)};
          failed = true;
        } else if (now - e.enqueued > timeout_) {
          failure = {r, labels_[static_cast<std::size_t>(r)], e.what,
                     dp::detail::str_cat(e.what, " of ", e.count, " elements on ", labels_[static_cast<std::size_t>(r)],
                                         " has not completed ", timeout_.count(),
                                         " ms after it was enqueued: a peer failed or never called it")};
          failed = true;
        }
        break;
      }
    }
  }
  if (hooks_.release)
    for (const auto& [r, token] : done) hooks_.release(r, token);
  if (!failed && hooks_.async_error) {
    for (int r = 0; r < ranks() && !failed; ++r) {
      std::string error;
      try {
        error = hooks_.async_error(r);
      } catch (const std::exception& ex) {
        error = dp::detail::str_cat("the watchdog could not query it: ", ex.what());
      }
      if (error.empty()) continue;
      std::string what;
      {
        std::lock_guard<std::mutex> lock(mu_);
        what = in_flight(r);
      }
      const std::string& label = labels_[static_cast<std::size_t>(r)];
      failure = {r, label, what,
                 what.empty() ? dp::detail::str_cat("asynchronous error on ", label, ": ", error)
                              : dp::detail::str_cat("asynchronous error on ", label, " while ", what,
                                                    " was in flight: ", error)};
      failed = true;
    }
  }
  return failed && fire(std::move(failure));
}

bool Watchdog::fire(Failure failure) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (tripped_) return false;  // disarmed or fired meanwhile: once only
    tripped_ = true;
  }
  std::vector<int> all(static_cast<std::size_t>(ranks()));
  for (int r = 0; r < ranks(); ++r) all[static_cast<std::size_t>(r)] = r;
  hooks_.abort(all, failure);
  return true;
}

void Watchdog::start(std::chrono::milliseconds interval) {
  DP_ASSERT(!thread_.joinable(), "watchdog: started twice");
  DP_ASSERT(interval.count() > 0, "watchdog: the interval must be positive");
  {
    std::lock_guard<std::mutex> lock(thread_mu_);
    stop_ = false;
  }
  thread_ = std::thread([this, interval] {
    std::unique_lock<std::mutex> lock(thread_mu_);
    while (!wake_.wait_for(lock, interval, [this] { return stop_; })) {
      lock.unlock();  // a hook may take long (an abort); stop() must not wait for the lock
      try {
        poll();
      } catch (const std::exception& e) {  // an abort hook that threw: nothing left to do but say so
        dp::detail::log_warning(dp::detail::str_cat("the collective watchdog failed: ", e.what()));
      }
      lock.lock();
    }
  });
}

void Watchdog::stop() {
  DP_ASSERT(!thread_.joinable() || thread_.get_id() != std::this_thread::get_id(),
            "watchdog: stop() called from a hook");
  {
    std::lock_guard<std::mutex> lock(thread_mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  tripped_ = true;
}

bool Watchdog::tripped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tripped_;
}

void Watchdog::clear() {
  std::vector<std::pair<int, Token>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int r = 0; r < ranks(); ++r) {
      for (const Entry& e : queues_[static_cast<std::size_t>(r)]) all.emplace_back(r, e.token);
      queues_[static_cast<std::size_t>(r)].clear();
    }
    tripped_ = false;
  }
  if (hooks_.release)
    for (const auto& [r, token] : all) hooks_.release(r, token);
}

std::size_t Watchdog::pending(int rank) const {
  DP_ASSERT(rank >= 0 && rank < ranks(), "watchdog: unknown rank ", rank);
  std::lock_guard<std::mutex> lock(mu_);
  return queues_[static_cast<std::size_t>(rank)].size();
}

}  // namespace dp::comm::detail
