#include "dp/parallel/stats.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "dp/core/error.h"

namespace dp::parallel {

const char* phase_name(Phase p) {
  static const char* names[] = {"scatter", "replicate", "forward", "backward", "reduce",
                                "allreduce_hidden", "allreduce_exposed", "step", "gather",
                                "allgather"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<int>(Phase::kCount), "a name per phase");
  return names[static_cast<int>(p)];
}

void Trace::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
  origin_ = Clock::now();
}

void Trace::record(const std::string& track, const std::string& name, Clock::time_point start,
                   Clock::time_point end, std::string args) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  double s = std::chrono::duration<double, std::micro>(start - origin_).count();
  double d = std::chrono::duration<double, std::micro>(end - start).count();
  events_.push_back(TraceEvent{track, name, s, d, std::move(args)});
}

std::vector<TraceEvent> Trace::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace

void Trace::write_chrome_json(const std::string& path) const {
  auto evs = events();
  std::map<std::string, int> tids;
  for (auto& e : evs) tids.emplace(e.track, 0);
  int next = 1;
  for (auto& [k, v] : tids) v = next++;
  std::ostringstream os;
  os << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  for (auto& [track, tid] : tids) {
    os << (first ? "" : ",\n") << "{\"ph\": \"M\", \"pid\": 1, \"tid\": " << tid
       << ", \"name\": \"thread_name\", \"args\": {\"name\": \"" << json_escape(track) << "\"}}";
    first = false;
  }
  char buf[64];
  for (auto& e : evs) {
    os << (first ? "" : ",\n") << "{\"ph\": \"X\", \"pid\": 1, \"tid\": " << tids[e.track] << ", \"name\": \""
       << json_escape(e.name) << "\", ";
    std::snprintf(buf, sizeof buf, "\"ts\": %.3f, \"dur\": %.3f", e.start_us, e.dur_us);
    os << buf << ", \"args\": {" << e.args << "}}";
    first = false;
  }
  os << "\n]}\n";
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    DP_CHECK(f.good(), "trace: cannot open '", tmp, "' for writing");
    f << os.str();
    f.flush();
    DP_CHECK(f.good(), "trace: writing '", tmp, "' failed");
  }
  DP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "trace: cannot rename '", tmp, "' to '", path, "'");
}

}  // namespace dp::parallel
