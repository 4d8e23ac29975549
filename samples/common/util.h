// samples/common/util.h — small helpers shared by the samples: device lists, synthetic
// batches, aligned tables, byte formatting, checked command-line values.
//
//   auto counts = samples::parse_device_counts("1,2,4", dp::device_count());
//   samples::Table t({"mode", "devices"});  t.add({"DP", "2"});  t.print(std::cout);
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/data/synthetic.h"
#include "dp/dp.h"

namespace samples {

/// "cpu" or "cuda": the kind of device integer ids name here.
inline std::string device_kind() {
  return dp::default_device_type() == dp::DeviceType::CUDA ? "cuda" : "cpu";
}

/// Device counts from "--devices": "N" means 1..N, "a,b,c" exactly those counts
/// (sorted, unique). Each must lie in [1, available]. Throws std::invalid_argument.
inline std::vector<int> parse_device_counts(const std::string& text, int available) {
  std::vector<int> counts;
  std::stringstream ss(text);
  std::string item;
  bool list = text.find(',') != std::string::npos;
  while (std::getline(ss, item, ',')) {
    std::size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size())
      throw std::invalid_argument("--devices: '" + item + "' is not a number (expected N or a list like 1,2,4)");
    if (n < 1 || n > available)
      throw std::invalid_argument("--devices: " + std::to_string(n) + " is out of range; " +
                                  std::to_string(available) + " " + device_kind() +
                                  " device(s) are visible (set DP_CPU_DEVICES for more CPU virtual devices)");
    if (list) {
      counts.push_back(n);
    } else {
      for (int i = 1; i <= n; ++i) counts.push_back(i);
    }
  }
  if (counts.empty()) throw std::invalid_argument("--devices: empty list");
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

/// Devices 0..n-1 of the default type.
inline std::vector<dp::Device> first_devices(int n) {
  std::vector<dp::Device> devs;
  for (int i = 0; i < n; ++i) devs.push_back(dp::device(i));
  return devs;
}

/// `count` distinct synthetic batches of `batch` rows (Gaussian blobs, 10 classes),
/// made once so that data generation stays out of any timing.
inline std::vector<dp::data::Batch> synthetic_batches(const dp::Shape& example_shape, std::int64_t batch,
                                                      int count, std::uint64_t seed) {
  dp::data::SyntheticDataset ds({.size = batch * count, .example_shape = example_shape, .seed = seed});
  std::vector<dp::data::Batch> out;
  for (int k = 0; k < count; ++k) {
    std::vector<std::int64_t> idx(batch);
    // Interleave so every batch holds every class (index % 10 is the label).
    for (std::int64_t i = 0; i < batch; ++i) idx[i] = i * count + k;
    out.push_back(ds.get_batch(idx));
  }
  return out;
}

/// "1.5 KB", "7.3 MB": bytes in powers of 1024.
inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

/// printf-style double formatting.
inline std::string fmt(double v, int decimals = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

/// "[32, 1, 3, 3]".
inline std::string shape_text(const dp::Shape& s) { return dp::shape_str(s); }

/// An aligned text table: left-aligned first column, right-aligned numbers.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& os) const {
    std::vector<std::size_t> w;
    for (auto& r : rows_)
      for (std::size_t i = 0; i < r.size(); ++i) {
        if (w.size() <= i) w.push_back(0);
        w[i] = std::max(w[i], r[i].size());
      }
    for (std::size_t k = 0; k < rows_.size(); ++k) {
      const auto& r = rows_[k];
      std::string line;
      for (std::size_t i = 0; i < r.size(); ++i) {
        std::string pad(w[i] - r[i].size(), ' ');
        line += (i == 0 ? r[i] + pad : "  " + pad + r[i]);
      }
      os << line << "\n";
      if (k == 0) {
        std::size_t total = 0;
        for (auto x : w) total += x + 2;
        os << std::string(total - 2, '-') << "\n";
      }
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

/// True when every value is finite.
inline bool all_finite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

}  // namespace samples
