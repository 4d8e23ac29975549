// The MPI transport of dp::dist (see transport.h): init, finalise, abort, private
// communicators, and point-to-point exchanges waited on with a deadline.
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>
#include <thread>

#include "dist/transport.h"
#include "dp/core/error.h"

namespace dp::dist::detail {

struct Channel {
  MPI_Comm comm = MPI_COMM_NULL;
};

namespace {

// With MPI_THREAD_SERIALIZED, dp's MPI calls from different threads take turns on this
// mutex (call by call, so two exchanges in flight still interleave); with
// MPI_THREAD_MULTIPLE it is never taken. Note [Thread level] in dist.cpp says why.
std::mutex g_mpi_mu;
bool g_serialize = false;

std::unique_lock<std::mutex> mpi_lock() {
  return g_serialize ? std::unique_lock<std::mutex>(g_mpi_mu)
                     : std::unique_lock<std::mutex>(g_mpi_mu, std::defer_lock);
}

// Every channel dp has open, so that finalisation can free them before MPI_Finalize
// (MPI does not free communicators itself; one still owned by, say, a communicator
// object the program keeps past finalize() would leak).
std::mutex g_channels_mu;
std::unordered_set<Channel*> g_channels;

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// Throws dp::Error naming the MPI call, MPI's message and the rank.
#define DP_MPI_CHECK(stmt)                                                               \
  do {                                                                                   \
    const int dp_mpi_rc_ = (stmt);                                                       \
    if (dp_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                                          \
      DP_FAIL("MPI call `" #stmt "` failed: ", mpi_error_string(dp_mpi_rc_));          \
  } while (0)

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "an unknown MPI thread level";
}

bool mpi_initialized() {
  int flag = 0;
  MPI_Initialized(&flag);  // callable before MPI_Init and after MPI_Finalize
  return flag != 0;
}

bool mpi_finalized() {
  int flag = 0;
  MPI_Finalized(&flag);
  return flag != 0;
}

/// Bytes of one message: a larger transfer is sent as several messages (of one tag, so
/// MPI's non-overtaking rule keeps them in order). Small enough that each completion
/// shows progress to the wait loop (Note [Waiting with a deadline]) and far below MPI's
/// int count limit; large enough that per-message overhead is noise (4 MiB at 10 GB/s
/// is 0.4 ms).
constexpr std::size_t kMessageBytes = std::size_t{4} << 20;
/// Wall time the wait loop polls with sched_yield after the last completion before it
/// starts sleeping: covers the gaps between the messages of a transfer in flight.
constexpr std::chrono::milliseconds kSpinWindow{20};
/// Sleep between polls once idle: a process that waits long (for a rank that writes a
/// checkpoint) costs ~0.1 % of a core, at the price of < 0.3 ms extra latency for the
/// first message after the wait.
constexpr std::chrono::microseconds kIdleSleep{200};

// Note [Waiting with a deadline]
// MPI cannot cancel a blocking collective, so dp never blocks inside MPI: an exchange
// posts non-blocking receives and sends and polls MPI_Testsome, which also drives MPI's
// progress engine. It yields the core while messages complete, sleeps briefly once
// nothing has completed for kSpinWindow (so waiting processes leave the cores to the
// ones still computing — CI runs several processes on 2 cores), and gives up when
// nothing has completed for `timeout`: then it returns the peers whose messages are
// still open. The clock restarts at every completion, so a long transfer that makes
// progress never times out; a peer that died, hangs, or waits in another collective
// does.
std::vector<int> wait_all(std::vector<MPI_Request>& reqs, const std::vector<int>& peer_of,
                          std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  std::vector<int> done(reqs.size());
  Clock::time_point last_progress = Clock::now();
  for (;;) {
    int outcount = 0;
    {
      auto lock = mpi_lock();
      DP_MPI_CHECK(MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &outcount,
                                done.data(), MPI_STATUSES_IGNORE));
    }
    if (outcount == MPI_UNDEFINED) return {};  // every request completed (all null)
    const Clock::time_point now = Clock::now();
    if (outcount > 0) {
      last_progress = now;
      continue;
    }
    if (timeout.count() > 0 && now - last_progress >= timeout) {
      std::vector<int> missing;
      for (std::size_t i = 0; i < reqs.size(); ++i)
        if (reqs[i] != MPI_REQUEST_NULL) missing.push_back(peer_of[i]);
      std::sort(missing.begin(), missing.end());
      missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
      return missing;
    }
    if (now - last_progress < kSpinWindow) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(kIdleSleep);
    }
  }
}

}  // namespace

bool transport_available() { return true; }

WorldInfo transport_init() {
  WorldInfo info;
  int provided = MPI_THREAD_SINGLE;
  if (!mpi_initialized()) {
    DP_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
    info.owns_mpi = true;
  } else {
    DP_CHECK(!mpi_finalized(), "dp::dist::init: MPI was already finalised by the program; "
             "call dp::dist::init() (or any dp::dist function) before MPI_Finalize");
    DP_MPI_CHECK(MPI_Query_thread(&provided));
  }
  info.thread_multiple = provided >= MPI_THREAD_MULTIPLE;
  info.thread_serialized = provided >= MPI_THREAD_SERIALIZED;
  info.thread_level = thread_level_name(provided);
  g_serialize = !info.thread_multiple;

  DP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &info.rank));
  DP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &info.size));
  MPI_Comm node = MPI_COMM_NULL;
  DP_MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, info.rank,
                                   MPI_INFO_NULL, &node));
  DP_MPI_CHECK(MPI_Comm_rank(node, &info.local_rank));
  DP_MPI_CHECK(MPI_Comm_size(node, &info.local_size));
  DP_MPI_CHECK(MPI_Comm_free(&node));

  // Every rank's node name and pid, so that messages can say where a missing rank ran.
  struct Who {
    char host[MPI_MAX_PROCESSOR_NAME];
    long pid;
  };
  Who me{};
  int len = 0;
  DP_MPI_CHECK(MPI_Get_processor_name(me.host, &len));
  me.pid = static_cast<long>(::getpid());
  std::vector<Who> all(static_cast<std::size_t>(info.size));
  DP_MPI_CHECK(MPI_Allgather(&me, sizeof(Who), MPI_BYTE, all.data(), sizeof(Who), MPI_BYTE,
                             MPI_COMM_WORLD));
  info.hosts.clear();
  info.pids.clear();
  for (const Who& w : all) {
    info.hosts.emplace_back(w.host, strnlen(w.host, sizeof(w.host)));
    info.pids.push_back(w.pid);
  }
  return info;
}

bool transport_finalized() { return mpi_finalized(); }

void transport_finalize(bool owns) {
  if (!mpi_initialized() || mpi_finalized()) return;
  {
    std::lock_guard<std::mutex> guard(g_channels_mu);
    auto lock = mpi_lock();
    for (Channel* c : g_channels) {
      if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);  // sets it to MPI_COMM_NULL
    }
  }
  if (!owns) return;
  const int rc = MPI_Finalize();
  if (rc != MPI_SUCCESS) dp::detail::log_warning("MPI_Finalize failed: " + mpi_error_string(rc));
}

void transport_abort(int code) {
  // One caller ends the process. Several threads of one process can time out in the
  // same collective at once (each local rank of a hierarchical communicator waits for
  // its peer), and two concurrent MPI_Abort calls corrupted Open MPI's heap ("double
  // free or corruption" in CI, the job then hanging): later callers wait for the end.
  static std::atomic<bool> ending{false};
  if (ending.exchange(true, std::memory_order_acq_rel)) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (mpi_initialized() && !mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort should not return; if it does, still end this process
}

ChannelPtr open_channel(std::chrono::milliseconds timeout) {
  auto channel = std::shared_ptr<Channel>(new Channel, [](Channel* c) {
    {
      std::lock_guard<std::mutex> guard(g_channels_mu);
      g_channels.erase(c);
      // transport_finalize freed it already when MPI is finalised (by dp); freeing
      // after MPI_Finalize (by the program) is not allowed.
      if (c->comm != MPI_COMM_NULL && mpi_initialized() && !mpi_finalized()) {
        auto lock = mpi_lock();
        MPI_Comm_free(&c->comm);
      }
    }
    delete c;
  });
  std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
  {
    auto lock = mpi_lock();
    DP_MPI_CHECK(MPI_Comm_idup(MPI_COMM_WORLD, &channel->comm, req.data()));
  }
  if (!wait_all(req, {-1}, timeout).empty()) {
    channel->comm = MPI_COMM_NULL;  // the duplicate never completed: nothing to free
    return nullptr;
  }
  {
    // dp turns MPI's errors into dp::Error (then ends the job, Note [Fault policy])
    // instead of MPI's default of aborting without saying which dp call failed.
    auto lock = mpi_lock();
    DP_MPI_CHECK(MPI_Comm_set_errhandler(channel->comm, MPI_ERRORS_RETURN));
  }
  std::lock_guard<std::mutex> guard(g_channels_mu);
  g_channels.insert(channel.get());
  return channel;
}

std::vector<int> exchange(Channel& channel, int tag, std::span<const Transfer> sends,
                          std::span<const Transfer> recvs, std::chrono::milliseconds timeout) {
  std::vector<MPI_Request> reqs;
  std::vector<int> peer_of;
  auto post = [&](const Transfer& t, bool is_send) {
    auto* p = static_cast<unsigned char*>(t.data);
    std::size_t left = t.bytes;
    do {  // an empty transfer is still one (empty) message: the peer expects it
      const std::size_t n = std::min(left, kMessageBytes);
      MPI_Request r = MPI_REQUEST_NULL;
      if (is_send) {
        DP_MPI_CHECK(MPI_Isend(p, static_cast<int>(n), MPI_BYTE, t.peer, tag, channel.comm, &r));
      } else {
        DP_MPI_CHECK(MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, t.peer, tag, channel.comm, &r));
      }
      reqs.push_back(r);
      peer_of.push_back(t.peer);
      p += n;
      left -= n;
    } while (left > 0);
  };
  {
    auto lock = mpi_lock();
    // Receives first: a message that arrives finds its buffer posted (no unexpected-
    // message copy).
    for (const Transfer& t : recvs) post(t, false);
    for (const Transfer& t : sends) post(t, true);
  }
  if (reqs.empty()) return {};
  return wait_all(reqs, peer_of, timeout);
}

}  // namespace dp::dist::detail
