// src/comm/nccl/nccl_bootstrap.h — making NCCL comms: a grouped initialisation of this
// process's ranks, and a grouped split of them, each polled to the end.
//
// Internal to src/comm/nccl/. Comms are non-blocking (Note [NCCL failures] in
// nccl_communicator.h): creation returns at once and is polled until ready, bounded by
// the timeout; on any failure every comm made is aborted and the reason returned.
#pragma once

#include <nccl.h>

#include <chrono>
#include <string>
#include <vector>

#include "dp/core/device.h"

namespace dp::comm::nccl {

/// Comms being made by one grouped call: the comms, or why they could not be made.
struct Made {
  std::vector<ncclComm_t> comms;  // empty when `error` is set
  std::string error;
};

/// Makes ranks first .. first + devices.size() - 1 of `nranks`, one per device, from
/// `id` — one group, as one thread creates them all (the calls would otherwise wait
/// for peers that the same thread has not created yet). Never throws.
Made init_ranks(const std::vector<Device>& devices, int nranks, int first, const ncclUniqueId& id,
                std::chrono::milliseconds timeout);

/// Splits every parent (parents[i] on devices[i]) with colors[i] and keys[i], grouped.
/// Every rank of the parents' communicator must call it. Never throws.
Made split_ranks(const std::vector<ncclComm_t>& parents, const std::vector<Device>& devices,
                 const std::vector<int>& colors, const std::vector<int>& keys,
                 std::chrono::milliseconds timeout);

}  // namespace dp::comm::nccl
