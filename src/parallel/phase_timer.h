// src/parallel/phase_timer.h — where DataParallel's phase times go (internal).
//
// PhaseRecorder accumulates per-device milliseconds for each Phase and, when the
// trace is enabled, records each interval on the device's track. PhaseTimer is the
// RAII way to time one phase on one rank: it records from construction to
// destruction, on every path out of the scope, and, when profiler ranges are on, opens
// a range named after the phase on the calling thread for as long (Note [Profiler
// ranges] in backend/backend.h). Thread-safe: workers and comm threads record
// concurrently. Knows nothing of modules or collectives.
//
//   { PhaseTimer t(recorder, rank, Phase::Forward); out = net->forward(x); }
#pragma once

#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "dp/parallel/stats.h"

namespace dp::parallel {

using Clock = Trace::Clock;

/// Per-device phase totals and the timeline of one DataParallel.
class PhaseRecorder {
 public:
  explicit PhaseRecorder(const std::vector<Device>& devices);

  /// Adds [start, end) to rank's total of `p` and traces it on "worker <device>".
  void add(int rank, Phase p, Clock::time_point start, Clock::time_point end, std::string args = {});
  /// Adds a derived figure (no interval of its own, so nothing is traced).
  void add_ms(int rank, Phase p, double ms);
  /// Traces an interval on "comm <device>" without adding to any phase.
  void comm_event(int rank, const std::string& name, Clock::time_point start, Clock::time_point end,
                  std::string args = {});
  void count_iteration();

  /// The totals (peak memory left for the caller to fill in).
  Stats snapshot() const;
  void reset();
  Trace& trace() { return trace_; }
  /// rank's device (where its phases' profiler ranges are opened).
  Device device(int rank) const { return stats_.devices[static_cast<std::size_t>(rank)].device; }

 private:
  mutable std::mutex mu_;
  Stats stats_;
  std::vector<std::string> worker_tracks_, comm_tracks_;
  Trace trace_;
};

/// Times one phase on one rank from construction to destruction (see the file comment).
class PhaseTimer {
 public:
  PhaseTimer(PhaseRecorder& recorder, int rank, Phase phase)
      : recorder_(&recorder), rank_(rank), phase_(phase), start_(Clock::now()) {
    if (backend::ranges_enabled()) range_.emplace(recorder.device(rank), phase_name(phase));
  }
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  /// A JSON object body for the trace event, e.g. "\"bytes\": 4096".
  void set_args(std::string args) { args_ = std::move(args); }
  /// Records nothing (the phase turned out to have done no work); its profiler range,
  /// if any, still closes at destruction.
  void cancel() { recorder_ = nullptr; }
  double elapsed_ms() const;

 private:
  PhaseRecorder* recorder_;
  int rank_;
  Phase phase_;
  Clock::time_point start_;
  std::string args_;
  std::optional<backend::ScopedRange> range_;  // closed after the time is recorded
};

}  // namespace dp::parallel
