// dp/parallel/stats.h — phase timers and the timeline of DataParallel.
//
// Every phase of a DP, DDP or Sharded step is timed per device (scatter, replicate or
// broadcast, forward, backward, reduce, all-reduce or reduce-scatter, optimizer step,
// all-gather, gather), and, when tracing is on, recorded as an event on a named track
// ("worker cpu:1", "comm cpu:1", "main") for a Chrome/Perfetto trace. This header
// knows nothing of modules.
//
//   auto s = model.stats();   // per-device milliseconds, summed since reset_stats()
//   model.trace().write_chrome_json("dp.json");
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dp/core/device.h"

namespace dp::parallel {

/// The phases of one DataParallel iteration.
enum class Phase : int {
  Scatter = 0,  // batch split and copied to each device
  Replicate,    // DP: parameters copied to replicas; DDP: buffers broadcast
  Forward,
  Backward,
  Reduce,           // DP: gradients summed onto device 0
  AllReduceHidden,  // DDP: all-reduce time overlapped by backward (Sharded: reduce-scatter)
  AllReduceExposed, // DDP: time backward waited for the all-reduce after finishing (Sharded: reduce-scatter)
  Step,             // optimizer update on this device
  Gather,           // outputs copied to the output device
  AllGather,        // Sharded: the updated ranges gathered after the step (ShardGather::NextForward: pulled per unit in the next forward); stage 3: the gather units
  kCount
};
const char* phase_name(Phase p);

/// Accumulated milliseconds per phase for one device.
struct DeviceStats {
  Device device;
  double ms[static_cast<int>(Phase::kCount)] = {};
  std::size_t peak_memory_bytes = 0;
  /// Bytes of gradient the device handed to the gradient collectives (reduce,
  /// all-reduce, reduce-scatter pieces): synced elements times the size of the dtype
  /// on the wire (float32, or DataParallelOptions::mixed_precision.reduce_dtype).
  std::int64_t grad_bytes = 0;
  /// Bytes of parameters the device received from the other devices' ranges
  /// (Mode::Sharded: the all-gather after the step, ShardGather::NextForward's pulls,
  /// stage 3's unit gathers and prefetches; 0 in DP and DDP): elements times the size of
  /// the dtype they travelled in (stage 3 with mixed_precision.param_dtype gathers the
  /// 16-bit compute copy, half float32's bytes).
  std::int64_t gather_bytes = 0;
  double operator[](Phase p) const { return ms[static_cast<int>(p)]; }
};

/// Stats of a DataParallel since construction or reset_stats().
struct Stats {
  std::int64_t iterations = 0;  // forwards run
  /// Tasks handed to worker and comm threads: each is a possible thread wake-up.
  std::int64_t handoffs = 0;
  std::vector<DeviceStats> devices;
};

/// One timeline event (microseconds since the trace started).
struct TraceEvent {
  std::string track;
  std::string name;
  double start_us = 0;
  double dur_us = 0;
  std::string args;  // a JSON object's body, e.g. "\"bytes\": 4096", or empty
};

/// Thread-safe timeline recorder; disabled (free) by default.
class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  Trace() : origin_(Clock::now()) {}
  void enable(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  void clear();
  void record(const std::string& track, const std::string& name, Clock::time_point start,
              Clock::time_point end, std::string args = {});
  std::vector<TraceEvent> events() const;
  /// Writes the Chrome trace-event JSON (one thread per track) to `path`, via a
  /// temporary file and a rename. Throws dp::Error on I/O failure.
  void write_chrome_json(const std::string& path) const;

 private:
  Clock::time_point origin_;
  bool enabled_ = false;
  mutable std::mutex mu_;
  std::vector<TraceEvent> events_;
};

}  // namespace dp::parallel
