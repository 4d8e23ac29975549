#include "parallel/phase_timer.h"

#include <algorithm>

#include "dp/core/error.h"

namespace dp::parallel {

namespace {
double ms_between(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration<double, std::milli>(end - start).count();
}
}  // namespace

PhaseRecorder::PhaseRecorder(const std::vector<Device>& devices) {
  stats_.devices.resize(devices.size());
  for (std::size_t r = 0; r < devices.size(); ++r) {
    stats_.devices[r].device = devices[r];
    worker_tracks_.push_back("worker " + devices[r].str());
    comm_tracks_.push_back("comm " + devices[r].str());
  }
}

void PhaseRecorder::add(int rank, Phase p, Clock::time_point start, Clock::time_point end, std::string args) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.devices[rank].ms[static_cast<int>(p)] += ms_between(start, end);
  }
  if (trace_.enabled()) trace_.record(worker_tracks_[rank], phase_name(p), start, end, std::move(args));
}

void PhaseRecorder::add_ms(int rank, Phase p, double ms) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.devices[rank].ms[static_cast<int>(p)] += ms;
}

void PhaseRecorder::comm_event(int rank, const std::string& name, Clock::time_point start,
                               Clock::time_point end, std::string args) {
  if (trace_.enabled()) trace_.record(comm_tracks_[rank], name, start, end, std::move(args));
}

void PhaseRecorder::count_iteration() {
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.iterations;
}

Stats PhaseRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void PhaseRecorder::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.iterations = 0;
  for (auto& d : stats_.devices) std::fill(std::begin(d.ms), std::end(d.ms), 0.0);
}

PhaseTimer::~PhaseTimer() {
  if (!recorder_) return;
  try {
    recorder_->add(rank_, phase_, start_, Clock::now(), std::move(args_));
  } catch (const std::exception& e) {  // destructors never throw (out of memory here)
    detail::log_warning(detail::str_cat("phase timer: ", e.what()));
  }
}

double PhaseTimer::elapsed_ms() const { return ms_between(start_, Clock::now()); }

}  // namespace dp::parallel
