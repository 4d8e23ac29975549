// src/dist/transport.h — the only part of dp::dist that speaks MPI.
//
// Internal header. Two implementations, picked by src/dist/meson.build: mpi_transport.cpp
// (MPI's C API) and stub_transport.cpp (a world of one process, for builds without MPI).
// Everything above — the collectives, their checks, timeouts and messages — is plain C++
// in process_group.cpp and dist.cpp, so it is the same code in both builds. No MPI type
// appears here.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace dp::dist::detail {

/// What the transport learnt about the job at init.
struct WorldInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::vector<std::string> hosts{"localhost"};  ///< node name per rank
  std::vector<long> pids{0};                    ///< process id per rank
  bool owns_mpi = false;        ///< dp called MPI_Init_thread (so it finalises)
  bool thread_multiple = true;  ///< MPI_THREAD_MULTIPLE provided
  bool thread_serialized = true;  ///< at least MPI_THREAD_SERIALIZED provided
  std::string thread_level = "none";  ///< the provided level's MPI name
};

/// True when this build has an MPI transport.
bool transport_available();
/// MPI_Init_thread(MPI_THREAD_MULTIPLE) unless MPI is already initialised (then the
/// program owns it), and the world's facts (ranks, nodes, thread level). Collective.
WorldInfo transport_init();
/// True when MPI_Finalize has been called (by dp or by the program).
bool transport_finalized();
/// Frees every channel still open, then MPI_Finalize when `owns` (and MPI is not
/// finalised yet). Channels freed here are skipped by their deleters.
void transport_finalize(bool owns);
/// MPI_Abort(MPI_COMM_WORLD, code) when MPI is up; std::_Exit(code) otherwise.
[[noreturn]] void transport_abort(int code);

/// A private duplicate of MPI_COMM_WORLD (its messages never meet the program's or
/// another channel's). Opaque here; freed by its deleter (skipped after MPI_Finalize).
struct Channel;
using ChannelPtr = std::shared_ptr<Channel>;

/// One message of an exchange: `bytes` bytes at `data`, to or from `peer`.
struct Transfer {
  int peer;
  void* data;
  std::size_t bytes;
};

/// Opens a channel (MPI_Comm_idup, collective over every process). Returns null when it
/// did not complete within `timeout` (0: no limit).
ChannelPtr open_channel(std::chrono::milliseconds timeout);

/// Posts every receive, then every send, with `tag` on `channel`, and waits until all
/// have completed or `timeout` (0: no limit) has passed since the call. Returns the
/// ranks whose messages had not completed at the timeout — empty on success; the
/// caller then ends the job (nothing can be cancelled safely, Note [Fault policy]).
/// Throws dp::Error when MPI reports an error.
std::vector<int> exchange(Channel& channel, int tag, std::span<const Transfer> sends,
                          std::span<const Transfer> recvs, std::chrono::milliseconds timeout);

}  // namespace dp::dist::detail
