// src/comm/nccl/nccl_common.h — what the NCCL communicator's files share: NCCL's
// names for dp's types, the polling pace, and aborting or destroying comms.
//
// Internal to src/comm/nccl/ (includes NCCL and CUDA headers). See Note [NCCL failures]
// in nccl_communicator.h for why comms are polled and aborted in groups.
#pragma once

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "comm/nccl/watchdog.h"
#include "dp/comm/communicator.h"

namespace dp::comm::nccl {

using Clock = std::chrono::steady_clock;
using detail::Watchdog;

/// How often the watchdog polls: a hang is reported within timeout + this; frequent
/// enough to be prompt, rare enough that its cudaEventQuery calls cost nothing.
constexpr std::chrono::milliseconds kWatchInterval{100};
/// How long an abort of a family spanning processes waits for busy ranks to abort
/// their own comms before ending the job: their poll loops sleep at most 1 ms
/// (Backoff), so this only matters when a thread is stuck elsewhere.
constexpr std::chrono::milliseconds kAbortGrace{2000};

inline ncclRedOp_t to_nccl(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclAvg; }

/// The NCCL type of a dtype (Note [Collective dtypes]): every dtype dp has. Reductions
/// take only the summable ones, which the front checks before any call comes here.
ncclDataType_t to_nccl(Dtype dtype);

inline backend::CudaBackend& cuda() { return backend::CudaBackend::instance(); }

/// Logs a failed NCCL call on a cleanup path (never throws).
void warn_nccl(ncclResult_t res, const char* what, Device dev);

/// Sleeps a little longer each round, up to 1 ms: polling loops stay cheap when a
/// call is issued at once and never burn a core while waiting for a slow peer.
class Backoff {
 public:
  void pause() {
    if (spins_ < 64) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
    delay_us_ = std::min(delay_us_ * 2, 1000);
  }

 private:
  int spins_ = 0;
  int delay_us_ = 10;
};

using CommList = std::vector<std::pair<ncclComm_t, Device>>;

/// Aborts several comms from one thread: grouped, as NCCL requires. Never throws.
void abort_comms(const CommList& comms);
/// Destroys several comms from one thread, grouped. Never throws.
void destroy_comms(const CommList& comms);

}  // namespace dp::comm::nccl
