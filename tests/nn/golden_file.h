// tests/nn/golden_file.h — reading a file of PyTorch's results (scripts/make_golden*.py)
// and comparing dp's tensors with them normwise (Note [Golden tolerances] in
// tests/nn/golden_test.cpp): what golden_test, golden_amp_test and gpt_golden_test share.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/dp.h"

namespace golden {

/// A golden file: tensors by name and the header's metadata. Its path comes from the
/// environment variable meson sets; every lookup of an absent name throws
/// std::runtime_error naming it, the file and how to regenerate it (doctest reports the
/// test case as failed with that message).
class File {
 public:
  /// The file at `path`; `regenerate` says how to write it again (in every message).
  explicit File(std::string path, std::string regenerate = "regenerate it with scripts/make_golden*.py")
      : path_(std::move(path)), regenerate_(std::move(regenerate)) {
    if (!std::filesystem::exists(path_)) throw std::runtime_error("golden file " + path_ + " is missing; " + regenerate_);
    try {
      file_ = dp::io::read_safetensors(path_);
    } catch (const dp::Error& e) {
      throw std::runtime_error("golden file " + path_ + " cannot be read (" + e.what() + "); " + regenerate_);
    }
    for (auto& [name, t] : file_.tensors) by_name_[name] = t;
  }

  /// The file at the path the environment variable `env_var` holds (meson sets it).
  static File from_env(const char* env_var, std::string regenerate) {
    const char* env = std::getenv(env_var);
    if (env == nullptr || *env == '\0')
      throw std::runtime_error(std::string(env_var) + " is not set: run the test through `meson test`, or set it to "
                               "the golden file's path");
    return File(env, std::move(regenerate));
  }

  const dp::Tensor& tensor(const std::string& name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) throw std::runtime_error(missing("tensor '" + name + "'"));
    return it->second;
  }
  const dp::Tensor& operator[](const std::string& name) const { return tensor(name); }

  /// Every tensor named "<prefix>.<name>", as (name, tensor) in file order.
  dp::nn::StateDict state(const std::string& prefix) const {
    dp::nn::StateDict out;
    for (auto& [name, t] : file_.tensors)
      if (name.rfind(prefix + ".", 0) == 0) out.emplace_back(name.substr(prefix.size() + 1), t);
    if (out.empty()) throw std::runtime_error(missing("tensors named '" + prefix + ".*'"));
    return out;
  }

  const std::string& meta(const std::string& key) const {
    auto it = file_.metadata.find(key);
    if (it == file_.metadata.end()) throw std::runtime_error(missing("metadata '" + key + "'"));
    return it->second;
  }

  /// Checks that the script's setting `key` is `value`, the one the test uses.
  void expect_meta(const std::string& key, double value) const {
    const double file_value = std::stod(meta(key));
    CHECK_MESSAGE(file_value == value, "the golden file was made with ", key, " = ", meta(key),
                  " but the test uses ", value, "; update one to match the other");
  }

  const std::string& path() const { return path_; }

 private:
  std::string missing(const std::string& what) const {
    return "golden file " + path_ + " has no " + what + "; " + regenerate_;
  }

  std::string path_, regenerate_;
  dp::io::SafetensorsFile file_;
  std::map<std::string, dp::Tensor> by_name_;
};

/// The worst agreement seen over a group of comparisons, reported in the log.
struct Worst {
  double diff = 0;   // max |dp − torch|
  double ratio = 0;  // max |dp − torch| / its tolerance; ≤ 1 passes
  std::string diff_at, ratio_at;
};

inline void report(const std::string& group, const Worst& w) {
  MESSAGE(group, ": max |dp - torch| = ", w.diff, " (", w.diff_at, "); at most ", w.ratio, " of the tolerance (",
          w.ratio_at, ")");
}

/// Checks dp's `got` against PyTorch's `want` elementwise, normwise:
/// |dp − torch| ≤ rtol · (|torch| + max |torch| over the tensor); int64 tensors must be
/// equal. Folds the differences into `worst`.
inline void expect_close(const std::string& name, const dp::Tensor& got, const dp::Tensor& want, double rtol,
                         Worst& worst) {
  INFO("comparing '", name, "'");
  REQUIRE_MESSAGE(got.defined(), "dp has no value for '", name, "'");
  REQUIRE_MESSAGE(got.shape() == want.shape(), "'", name, "': dp ", got.str(), ", PyTorch ", want.str());
  REQUIRE_MESSAGE(got.dtype() == want.dtype(), "'", name, "': dp ", got.str(), ", PyTorch ", want.str());
  if (want.dtype() == dp::Dtype::Int64) {
    CHECK_MESSAGE(got.to_vector_i64() == want.to_vector_i64(), "'", name, "' differs from PyTorch");
    return;
  }
  const std::vector<float> g = got.to_vector(), w = want.to_vector();
  double scale = 0;
  for (float v : w) scale = std::max(scale, std::fabs(double(v)));
  std::size_t bad = 0, worst_i = 0;
  double worst_ratio = -1;
  for (std::size_t i = 0; i < g.size(); ++i) {
    double diff = std::fabs(double(g[i]) - double(w[i]));
    double ratio = diff == 0 ? 0 : diff / (rtol * (std::fabs(double(w[i])) + scale));
    if (!(ratio <= 1)) ++bad;  // NaN counts as bad
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst_i = i;
    }
    if (!(diff <= worst.diff)) worst.diff = diff, worst.diff_at = name;
  }
  if (!(worst_ratio <= worst.ratio)) worst.ratio = worst_ratio, worst.ratio_at = name;
  CHECK_MESSAGE(bad == 0, "'", name, "': ", bad, " of ", g.size(), " values differ from PyTorch by more than ",
                rtol, " * (|torch| + ", scale, "); worst at flat index ", worst_i, ": dp ", g[worst_i],
                ", torch ", w[worst_i]);
}

}  // namespace golden
