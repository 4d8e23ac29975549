// Printing a tensor's values: operator<<(std::ostream&, const Tensor&) of tensor.h.
//
// Note [Tensor printing]
// The layout is libtorch's (`std::cout << torch::randn({2, 3})`): one line per row of
// the last two dims, a 1-d tensor as a column, a block "(i,j,.,.) = " (1-based, as
// libtorch) per matrix of a tensor of more dims, then "[ CPUFloatType{2,3} ]". Each
// element is right-aligned to the widest magnitude's width plus a sign's place, one
// space apart, so columns line up whatever the signs (" 1  2" for whole numbers).
// libtorch never shortens what it prints; PyTorch's Python print does, and a
// 10^6-element tensor printed in full floods a terminal, so beyond kSummaryThreshold
// elements each dim longer than 2 * kEdgeItems shows its first and last kEdgeItems
// entries around "..." (Python's threshold=1000, edgeitems=3). Numbers: a float tensor
// whose shown values are all whole prints them without decimals (as libtorch);
// otherwise four decimals, or scientific notation with four when the shown magnitudes
// span more than 10^3 or reach 10^8 or fall below 10^-4 (Python's sci_mode rule), so
// that small and large values keep their digits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "dp/tensor/tensor.h"

namespace dp {
namespace {

constexpr std::int64_t kSummaryThreshold = 1000;  // PyTorch's print threshold
constexpr std::int64_t kEdgeItems = 3;            // PyTorch's edgeitems
constexpr std::int64_t kGap = -1;                 // "..." in a list of shown indices

/// The indices shown along a dim of `n` entries; kGap where entries are left out.
std::vector<std::int64_t> shown_indices(std::int64_t n, bool summarise) {
  std::vector<std::int64_t> idx;
  if (!summarise || n <= 2 * kEdgeItems) {
    for (std::int64_t i = 0; i < n; ++i) idx.push_back(i);
    return idx;
  }
  for (std::int64_t i = 0; i < kEdgeItems; ++i) idx.push_back(i);
  idx.push_back(kGap);
  for (std::int64_t i = n - kEdgeItems; i < n; ++i) idx.push_back(i);
  return idx;
}

struct Format {
  bool whole = true;  // no decimals
  bool sci = false;
  int width = 1;
};

std::string format_value(double v, const Format& f) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  if (f.whole)
    std::snprintf(buf, sizeof buf, "%.0f", v);
  else if (f.sci)
    std::snprintf(buf, sizeof buf, "%.4e", v);
  else
    std::snprintf(buf, sizeof buf, "%.4f", v);
  return buf;
}

Format choose_format(const std::vector<double>& shown, bool integer_dtype) {
  Format f;
  double max_abs = 0, min_abs = 0;
  bool any_nonzero = false;
  for (double v : shown) {
    if (!std::isfinite(v)) continue;
    if (!integer_dtype && v != std::nearbyint(v)) f.whole = false;
    const double a = std::fabs(v);
    if (a == 0) continue;
    max_abs = any_nonzero ? std::max(max_abs, a) : a;
    min_abs = any_nonzero ? std::min(min_abs, a) : a;
    any_nonzero = true;
  }
  if (!integer_dtype && f.whole && max_abs >= 1e8) f.whole = false;  // "%.0f" of 1e20: 21 digits
  if (!f.whole && any_nonzero) f.sci = max_abs / min_abs > 1e3 || max_abs >= 1e8 || min_abs < 1e-4;
  // One column more than the widest magnitude: a sign's place, so that columns line
  // up whatever the signs, and a space before every positive value (libtorch's look).
  for (double v : shown) f.width = std::max(f.width, static_cast<int>(format_value(std::fabs(v), f).size()) + 1);
  return f;
}

const char* type_word(Dtype dtype) {
  switch (dtype) {
    case Dtype::Float32: return "Float";
    case Dtype::Int64: return "Long";
    case Dtype::Int32: return "Int";
    case Dtype::BFloat16: return "BFloat16";
    case Dtype::Float16: return "Half";
  }
  return "Unknown";
}

/// "[ CPUFloatType{2,3} ]", naming the device when it is not device 0.
std::string type_line(const Tensor& t, const char* note) {
  std::ostringstream os;
  os << "[ " << (t.device().is_cuda() ? "CUDA" : "CPU") << type_word(t.dtype()) << "Type{";
  for (std::size_t i = 0; i < t.shape().size(); ++i) os << (i ? "," : "") << t.shape()[i];
  os << "}";
  if (t.device().index != 0) os << " on " << t.device();
  os << note << " ]";
  return os.str();
}

std::vector<double> host_values(const Tensor& t) {
  std::vector<double> v;
  if (is_floating_point(t.dtype())) {
    for (float x : t.to_vector()) v.push_back(x);
  } else if (t.dtype() == Dtype::Int64) {
    for (std::int64_t x : t.to_vector_i64()) v.push_back(static_cast<double>(x));
  } else {
    for (std::int32_t x : t.to_vector_i32()) v.push_back(x);
  }
  return v;
}

class Printer {
 public:
  Printer(std::ostream& os, const Shape& shape, const std::vector<double>& values, bool summarise)
      : os_(os), shape_(shape), values_(values) {
    strides_.assign(shape.size(), 1);
    for (std::size_t d = shape.size(); d-- > 1;) strides_[d - 1] = strides_[d] * shape[d];
    for (std::int64_t n : shape) shown_.push_back(shown_indices(n, summarise));
  }

  /// The values that will be shown, for the number format.
  std::vector<double> shown_values() const {
    std::vector<double> out;
    collect(0, 0, out);
    return out;
  }

  void print(const Format& f) {
    f_ = f;
    const std::size_t n = shape_.size();
    if (n == 1) {
      for (std::int64_t i : shown_[0]) os_ << cell(i) << "\n";
    } else if (n == 2) {
      matrix(0);
    } else {
      std::vector<std::int64_t> lead;
      blocks(0, 0, lead);
    }
  }

 private:
  void collect(std::size_t d, std::int64_t offset, std::vector<double>& out) const {
    if (d == shape_.size()) {
      out.push_back(values_[static_cast<std::size_t>(offset)]);
      return;
    }
    for (std::int64_t i : shown_[d])
      if (i != kGap) collect(d + 1, offset + i * strides_[d], out);
  }

  /// The element at `offset` right-aligned to the width; "..." for kGap.
  std::string cell(std::int64_t offset) const {
    std::ostringstream os;
    os << std::setw(f_.width)
       << (offset == kGap ? std::string("...") : format_value(values_[static_cast<std::size_t>(offset)], f_));
    return os.str();
  }

  // The last two dims from `offset`.
  void matrix(std::int64_t offset) {
    const std::size_t r = shape_.size() - 2, c = shape_.size() - 1;
    for (std::int64_t i : shown_[r]) {
      if (i == kGap) {
        os_ << cell(kGap) << "\n";
        continue;
      }
      const char* sep = "";
      for (std::int64_t j : shown_[c]) {
        os_ << sep << cell(j == kGap ? kGap : offset + i * strides_[r] + j * strides_[c]);
        sep = " ";
      }
      os_ << "\n";
    }
  }

  // One "(i,j,.,.) = " block per matrix, blank lines between them.
  void blocks(std::size_t d, std::int64_t offset, std::vector<std::int64_t>& lead) {
    if (d == shape_.size() - 2) {
      if (!first_block_) os_ << "\n";
      first_block_ = false;
      os_ << "(";
      for (std::int64_t i : lead) os_ << i + 1 << ",";
      os_ << ".,.) = \n";
      matrix(offset);
      return;
    }
    for (std::int64_t i : shown_[d]) {
      if (i == kGap) {
        os_ << (first_block_ ? "" : "\n") << "...\n";
        continue;
      }
      lead.push_back(i);
      blocks(d + 1, offset + i * strides_[d], lead);
      lead.pop_back();
    }
  }

  std::ostream& os_;
  const Shape& shape_;
  const std::vector<double>& values_;
  std::vector<std::int64_t> strides_;
  std::vector<std::vector<std::int64_t>> shown_;
  Format f_;
  bool first_block_ = true;
};

}  // namespace

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "[ Tensor (undefined) ]";
  if (t.storage()->released()) return os << type_line(t, " (released)");
  if (t.numel() == 0) return os << type_line(t, "");
  const std::vector<double> values = host_values(t);
  const bool integer_dtype = !is_floating_point(t.dtype());
  if (t.dim() == 0) {
    const Format f = choose_format(values, integer_dtype);
    return os << format_value(values[0], f) << "\n" << type_line(t, "");
  }
  Printer p(os, t.shape(), values, t.numel() > kSummaryThreshold);
  p.print(choose_format(p.shown_values(), integer_dtype));
  return os << type_line(t, "");
}

}  // namespace dp
