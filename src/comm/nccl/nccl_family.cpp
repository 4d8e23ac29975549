// The NCCL communicator's failure path: abort, reset, and the watchdog's probes and
// abort over a family of communicators (Note [NCCL failures], nccl_communicator.h).
#include "comm/nccl/nccl_communicator.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "backend/cuda/cuda_check.h"
#include "comm/nccl/nccl_bootstrap.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"

namespace dp::comm::nccl {

void NcclCommunicator::abort(const std::string& reason) {
  // Every rank of the family: in one process the family is this communicator alone;
  // across processes nothing short of the whole family (and the job) can go.
  std::vector<int> all(family_->watched.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  abort_family(*family_, all, reason);
}

void NcclCommunicator::reset() {
  if (!aborted_.load(std::memory_order_acquire)) return;
  // Unreachable across processes (an abort ended the job), but say so if it happens.
  DP_CHECK(!family_->spans_processes, "reset: ", family_->description, " was aborted (",
           abort_reason(), "); a communicator spanning processes cannot be rebuilt by one process");
  // Every rank has left its collective (the contract of reset), so every comm was
  // aborted by abort() or by its own rank; what remains are events to recycle.
  for (int s = 0; s < layout_.slots; ++s) {
    Rank& rk = ranks_[static_cast<std::size_t>(s)];
    std::lock_guard<std::mutex> lock(rk.mu);
    DP_CHECK(!rk.busy && rk.comm == nullptr, "reset: rank ", layout_.first_arg + s, " (", slot_device(s),
             ") is still inside a collective; call reset() once every rank has left it");
  }
  family_->watchdog->clear();  // pending events back to their ranks; armed again
  for (Rank& rk : ranks_) {
    std::lock_guard<std::mutex> lock(rk.mu);
    rk.deferred = false;
    for (const Window& w : rk.closed) recycle(rk, w);
    recycle(rk, rk.open);
    rk.closed.clear();
    rk.open = Window{};
  }
  std::vector<Device> local(devices_.begin() + layout_.first_arg,
                            devices_.begin() + layout_.first_arg + layout_.slots);
  ncclUniqueId id;
  DP_NCCL_CHECK(ncclGetUniqueId(&id));
  const Made made = init_ranks(local, layout_.world_size, layout_.first_nccl, id, options_.timeout);
  DP_CHECK(made.error.empty(), "reset of the nccl communicator over ", layout_.slots, " devices: ",
           made.error);
  install(made.comms);
  std::lock_guard<std::mutex> lock(reason_mu_);
  reason_.clear();
  aborted_.store(false, std::memory_order_release);
}

void NcclCommunicator::mark_aborted(const std::string& reason) {
  std::lock_guard<std::mutex> lock(reason_mu_);
  if (!aborted_.load(std::memory_order_relaxed)) reason_ = reason;
  aborted_.store(true, std::memory_order_release);
}

ncclComm_t NcclCommunicator::take_idle(int s) {
  Rank& rk = ranks_[static_cast<std::size_t>(s)];
  std::lock_guard<std::mutex> lock(rk.mu);
  if (rk.comm == nullptr || rk.busy) return nullptr;
  return std::exchange(rk.comm, nullptr);
}

bool NcclCommunicator::released(int s) {
  Rank& rk = ranks_[static_cast<std::size_t>(s)];
  std::lock_guard<std::mutex> lock(rk.mu);
  return rk.comm == nullptr;
}

Watchdog::Probe NcclCommunicator::query(int s, Watchdog::Token token) {
  cuda().set_device(slot_device(s).index);
  const cudaError_t state = cudaEventQuery(static_cast<cudaEvent_t>(const_cast<void*>(token)));
  if (state == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return {Watchdog::Progress::Running, {}};
  }
  if (state == cudaSuccess) return {Watchdog::Progress::Complete, {}};
  (void)cudaGetLastError();
  return {Watchdog::Progress::Failed, cudaGetErrorString(state)};
}

std::string NcclCommunicator::async_error(int s) {
  Rank& rk = ranks_[static_cast<std::size_t>(s)];
  std::lock_guard<std::mutex> lock(rk.mu);
  // A busy rank's thread polls its own comm (wait_issued); an aborted one has none.
  if (rk.comm == nullptr || rk.busy) return {};
  ncclResult_t async = ncclSuccess;
  const ncclResult_t res = ncclCommGetAsyncError(rk.comm, &async);
  const ncclResult_t bad = res != ncclSuccess ? res : async;
  if (bad == ncclSuccess || bad == ncclInProgress) return {};
  return dp::detail::str_cat("NCCL reported ", ncclGetErrorString(bad), " (NCCL_DEBUG=WARN prints NCCL's reason)");
}

void NcclCommunicator::release(int s, Watchdog::Token token) {
  Rank& rk = ranks_[static_cast<std::size_t>(s)];
  std::lock_guard<std::mutex> lock(rk.mu);
  rk.free_events.push_back(static_cast<cudaEvent_t>(const_cast<void*>(token)));
}

bool NcclCommunicator::drain(int s) {
  Rank& rk = ranks_[static_cast<std::size_t>(s)];
  try {
    cuda().set_device(slot_device(s).index);
  } catch (const std::exception&) {
    return false;
  }
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  Backoff backoff;
  cudaError_t state = cudaStreamQuery(rk.stream);
  while (state == cudaErrorNotReady && Clock::now() < deadline) {
    backoff.pause();
    state = cudaStreamQuery(rk.stream);
  }
  if (state != cudaSuccess) (void)cudaGetLastError();
  return state == cudaSuccess;
}

std::string NcclCommunicator::abort_reason() const {
  std::lock_guard<std::mutex> lock(reason_mu_);
  return reason_;
}

void NcclCommunicator::throw_if_aborted(const char* what, int rank) const {
  if (!aborted_.load(std::memory_order_acquire)) return;
  throw_aborted(what, rank, abort_reason());  // dp::CollectiveAborted
}

void abort_family(Family& family, const std::vector<int>& ids, const std::string& reason) {
  family.watchdog->disarm();  // an abort came: nothing more to judge until reset()
  std::vector<NcclCommunicator*> marked;
  CommList idle;
  for (int id : ids) {
    auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    if (std::find(marked.begin(), marked.end(), member) == marked.end()) {
      member->mark_aborted(reason);
      marked.push_back(member);
    }
    // Idle ranks' comms are aborted here, together; a busy rank aborts its own when
    // its poll loop sees the flag (Note [NCCL failures]). ncclCommAbort stops the
    // kernels of its rank, so a stream waiting for a peer that never came is released.
    if (ncclComm_t c = member->take_idle(s)) idle.emplace_back(c, member->slot_device(s));
  }
  abort_comms(idle);
  if (!family.spans_processes) return;

  // Note [NCCL failures]: the other processes cannot be released from here.
  const Clock::time_point grace = Clock::now() + kAbortGrace;
  for (int id : ids) {
    auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    while (!member->released(s) && Clock::now() < grace) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::call_once(family.ended, [&] {
    try {
      dist::abort(dp::detail::str_cat(family.description, " was aborted: ", reason,
                                      "; ending the job, since the ranks of the other processes cannot be "
                                      "released otherwise"));
    } catch (...) {  // dist could not end the job: ending this process makes the launcher do it
    }
    std::abort();
  });
  std::abort();  // another thread is ending the job (call_once returned only by an exception)
}

/// The family's watchdog: its probes and its abort go to the members' ranks.
std::unique_ptr<Watchdog> make_watchdog(Family& family, std::chrono::milliseconds timeout) {
  Watchdog::Hooks hooks;
  // family.watched is complete before the watchdog starts, and fixed from then on.
  hooks.query = [&family](int id, Watchdog::Token token) {
    const auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    return member->query(s, token);
  };
  hooks.async_error = [&family](int id) {
    const auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    return member->async_error(s);
  };
  hooks.release = [&family](int id, Watchdog::Token token) {
    const auto [member, s] = family.watched[static_cast<std::size_t>(id)];
    member->release(s, token);
  };
  hooks.abort = [&family](const std::vector<int>& ids, const Watchdog::Failure& failure) {
    abort_family(family, ids, failure.reason);
  };
  return std::make_unique<Watchdog>(timeout, std::move(hooks));
}

/// Aborts every comm the family has made so far, grouped, without ending the job: a
/// failed construction, agreed by every process. Never throws.
void discard(Family& family) {
  family.watchdog->disarm();
  CommList comms;
  for (const auto& [member, s] : family.watched)
    if (ncclComm_t c = member->take_idle(s)) comms.emplace_back(c, member->slot_device(s));
  abort_comms(comms);
}

}  // namespace dp::comm::nccl
