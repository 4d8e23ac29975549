#include "dp/tensor/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "backend/backend.h"
#include "dp/autograd/grad_mode.h"
#include "dp/autograd/node.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "tensor/tensor_util.h"

namespace dp {

std::size_t element_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::Float32: return 4;
    case Dtype::Int64: return 8;
    case Dtype::Int32: return 4;
    case Dtype::BFloat16: return 2;
    case Dtype::Float16: return 2;
  }
  DP_FAIL("element_size: unknown dtype code ", static_cast<int>(dtype));
}

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::Float32: return "float32";
    case Dtype::Int64: return "int64";
    case Dtype::Int32: return "int32";
    case Dtype::BFloat16: return "bfloat16";
    case Dtype::Float16: return "float16";
  }
  return "unknown dtype";
}

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

std::int64_t shape_numel(const Shape& shape) {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

// ---- Storage ---------------------------------------------------------------------------

Storage::Storage(Device device, std::size_t nbytes) : device_(device), nbytes_(nbytes) {
  data_ = backend::get(device).allocate(device, nbytes);
}

Storage::Storage(PinnedTag, std::size_t nbytes)
    : device_(cpu(0)), nbytes_(nbytes), pinned_(true) {
  data_ = backend::pinned_host_backend().allocate_pinned(nbytes);
}

Storage::Storage(Device device, void* data, std::size_t nbytes, std::function<void(void*)> deleter)
    : device_(device), nbytes_(nbytes), data_(data), external_(true), deleter_(std::move(deleter)) {}

void Storage::bump_version(std::size_t begin, std::size_t end) {
  const std::uint64_t v = version_.fetch_add(1, std::memory_order_relaxed) + 1;
  // Note [Gradients written over zeros] in src/autograd/node.cpp.
  if (!autograd::GradientWriteScope::active()) write_epoch_.fetch_add(1, std::memory_order_relaxed);
  // Note [Saved tensors and in-place writes] in src/autograd/node.cpp.
  if (autograd::RefreshWriteScope::active()) return;
  std::lock_guard<std::mutex> lock(writes_mutex_);
  constexpr std::size_t kKept = 64;
  if (writes_.size() == kKept) {  // forget the older half
    for (std::size_t i = 0; i < kKept / 2; ++i) forgotten_ = std::max(forgotten_, writes_[i].version);
    writes_.erase(writes_.begin(), writes_.begin() + kKept / 2);
  }
  writes_.push_back({v, begin, end});
}

Storage::WriteSince Storage::find_write_since(std::uint64_t version, std::size_t begin, std::size_t end) const {
  std::vector<Move> moved;  // the moves since `version` of bytes in range, asked below without this lock
  {
    std::lock_guard<std::mutex> lock(writes_mutex_);
    if (forgotten_ > version) return {this, version};
    for (const RangeWrite& w : writes_)
      if (w.version > version && w.begin < end && begin < w.end) return {this, version};
    for (const Move& m : moves_)
      if (m.at > version && m.begin < end && begin < m.end) moved.push_back(m);
  }
  // Note [Saved tensors and moved parameters] in src/autograd/node.cpp.
  for (const Move& m : moved) {
    const std::size_t lo = std::max(begin, m.begin), hi = std::min(end, m.end);
    if (WriteSince w = m.to->find_write_since(m.to_version, m.to_begin + (lo - m.begin), m.to_begin + (hi - m.begin));
        w.storage)
      return w;
  }
  return {};
}

void Storage::note_move(std::size_t begin, std::size_t end, std::shared_ptr<Storage> to, std::size_t to_begin,
                        std::uint64_t to_version) {
  // The move takes a version of its own (no write: nothing here changed), so that a tensor
  // saved from these bytes after it (a view the rebinding left here) is not asked about `to`.
  const std::uint64_t at = version_.fetch_add(1, std::memory_order_relaxed) + 1;
  std::lock_guard<std::mutex> lock(writes_mutex_);
  moves_.push_back({at, begin, end, std::move(to), to_begin, to_version});
}

void Tensor::note_write() const {
  const std::size_t begin = static_cast<std::size_t>(storage_offset()) * element_size(dtype());
  storage()->bump_version(begin, begin + nbytes());
}

void Storage::release() {
  DP_CHECK(!pinned_, "Storage::release: pinned host memory cannot be released");
  DP_CHECK(!external_, "Storage::release: memory wrapped by from_blob belongs to the caller and cannot be released");
  if (released_) return;
  backend::get(device_).deallocate(device_, data_, nbytes_);
  data_ = nullptr;
  released_ = true;
  version_at_release_ = version();
  refill_pending_ = true;
}

void Storage::refilled_unchanged() {
  DP_CHECK(!released_, "Storage::refilled_unchanged: expected a materialised storage, got a released one");
  if (!std::exchange(refill_pending_, false)) return;  // once per release: later writes are real ones
  // Nothing but the refill wrote since the release: a released storage has no memory.
  std::lock_guard<std::mutex> lock(writes_mutex_);
  std::erase_if(writes_, [&](const RangeWrite& w) { return w.version > version_at_release_; });
}

void Storage::materialize() {
  if (!released_) return;
  data_ = backend::get(device_).allocate(device_, nbytes_);
  released_ = false;
  write_epoch_.fetch_add(1, std::memory_order_relaxed);  // contents undefined again
}

Storage::~Storage() {
  if (external_) {
    if (!deleter_) return;  // the caller keeps ownership
    try {
      deleter_(data_);
    } catch (const std::exception& e) {
      detail::log_warning(detail::str_cat("from_blob: the deleter threw (ignored): ", e.what()));
    } catch (...) {
      detail::log_warning("from_blob: the deleter threw a non-standard exception (ignored)");
    }
    return;
  }
  if (released_) return;
  if (pinned_) {
    backend::pinned_host_backend().deallocate_pinned(data_, nbytes_);
  } else {
    backend::get(device_).deallocate(device_, data_, nbytes_);
  }
}

TensorImpl::~TensorImpl() = default;

Generator& default_generator() {
  static Generator gen;
  return gen;
}
void manual_seed(std::uint64_t seed) { default_generator().set_state(seed, 0); }

// ---- accessors -----------------------------------------------------------------------------

namespace {

const TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  DP_CHECK(impl != nullptr, "expected a defined tensor, got an undefined (default-constructed) one");
  return *impl;
}

std::shared_ptr<TensorImpl> new_impl(const Shape& shape, Dtype dtype, Device device) {
  for (auto s : shape) DP_CHECK(s >= 0, "expected non-negative sizes, got shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(
      device, static_cast<std::size_t>(shape_numel(shape)) * element_size(dtype));
  return impl;
}

// A new impl viewing `src`'s storage at element offset `offset` with `shape`, laid out
// as `src` is (a channels-last view keeps src's shape, or narrows its dim 0).
std::shared_ptr<TensorImpl> view_impl(const TensorImpl& src, std::int64_t offset, const Shape& shape) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = src.storage;
  impl->offset = offset;
  impl->shape = shape;
  impl->dtype = src.dtype;
  impl->copied_view = src.copied_view;  // Note [Writes into materialised views]
  impl->memory_format = src.memory_format;
  return impl;
}

bool is_channels_last(const TensorImpl& impl) { return impl.memory_format == MemoryFormat::ChannelsLast; }

// True when a shape's NCHW and NHWC orders are the same bytes (Note [Channels-last
// tensors]): such a tensor is kept Contiguous.
bool layouts_coincide(const Shape& s) { return s.size() != 4 || s[1] == 1 || s[2] * s[3] == 1; }

void check_not_released(const TensorImpl& impl) {
  DP_CHECK(!impl.storage->released(), "Tensor", shape_str(impl.shape), " on ", impl.storage->device(),
           ": its memory was released (Note [Released storage]) — a parameter of a module trained with "
           "DataParallel shard_stage 3 between uses; read parameters through net->state_dict(), "
           "net->parameters() or named_parameters(), which gather them, called again after each step "
           "(a list taken before a step holds views the step released; see dp/parallel/data_parallel.h)");
}

void* bytes_as_they_lie(const TensorImpl& impl) {
  check_not_released(impl);
  return static_cast<char*>(impl.storage->data()) + impl.offset * element_size(impl.dtype);
}

// Copies a 4-d tensor of `shape` (N, C, H, W) between the two layouts on its device:
// NCHW `src` into N x H x W x C `dst` when `to_channels_last`, else back. One strided
// pass that moves bits (exact for every dtype).
void transpose_layout(Device dev, Dtype dtype, const Shape& shape, const void* src, void* dst,
                      bool to_channels_last) {
  if (shape_numel(shape) == 0) return;
  const std::int64_t N = shape[0], C = shape[1], H = shape[2], W = shape[3];
  backend::Indexer ix;
  ix.ndim = 4;
  const std::int64_t sizes_cl[4] = {N, H, W, C}, strides_cl[4] = {C * H * W, W, 1, H * W};
  const std::int64_t sizes_nchw[4] = {N, C, H, W}, strides_nchw[4] = {H * W * C, 1, W * C, C};
  for (int i = 0; i < 4; ++i) {
    ix.sizes[i] = to_channels_last ? sizes_cl[i] : sizes_nchw[i];
    ix.strides_a[i] = to_channels_last ? strides_cl[i] : strides_nchw[i];
    ix.strides_b[i] = ix.strides_a[i];
  }
  // An int32 tensor moves as float32 words, an int64 one through the int64 kernel.
  const backend::DType dt = dtype == Dtype::Int32 ? backend::DType::F32 : detail::kernel_dtype(dtype);
  backend::get(dev).run<backend::Op::StridedCopy>(dev, dt, {ix, src, dst});
}

// The NCHW copy of a channels-last tensor, made on the first read as NCHW and again
// after its bytes are written (the storage version moved).
void* nchw_copy_of(TensorImpl& impl) {
  std::lock_guard<std::mutex> lock(impl.nchw_mutex);
  const std::uint64_t version = impl.storage->version();
  if (impl.nchw_copy == nullptr || impl.nchw_version != version) {
    const auto nbytes = static_cast<std::size_t>(shape_numel(impl.shape)) * element_size(impl.dtype);
    if (impl.nchw_copy == nullptr) impl.nchw_copy = std::make_shared<Storage>(impl.storage->device(), nbytes);
    transpose_layout(impl.storage->device(), impl.dtype, impl.shape, bytes_as_they_lie(impl), impl.nchw_copy->data(),
                     false);
    impl.nchw_version = version;
  }
  return impl.nchw_copy->data();
}

}  // namespace

const char* memory_format_name(MemoryFormat format) {
  return format == MemoryFormat::ChannelsLast ? "channels_last" : "contiguous";
}

const Shape& Tensor::shape() const { return checked(impl_).shape; }
std::int64_t Tensor::dim() const { return static_cast<std::int64_t>(shape().size()); }
std::int64_t Tensor::size(std::int64_t d) const {
  std::int64_t n = dim();
  DP_CHECK(d >= -n && d < n, "size(", d, "): expected a dim in [", -n, ", ", n, ") for shape ",
           shape_str(shape()));
  return shape()[d < 0 ? d + n : d];
}
std::int64_t Tensor::numel() const { return shape_numel(shape()); }
Dtype Tensor::dtype() const { return checked(impl_).dtype; }
Device Tensor::device() const { return checked(impl_).storage->device(); }
const std::shared_ptr<Storage>& Tensor::storage() const { return checked(impl_).storage; }
std::int64_t Tensor::storage_offset() const { return checked(impl_).offset; }

void* Tensor::raw_data() const {
  const auto& impl = checked(impl_);
  if (is_channels_last(impl)) {  // Note [Channels-last tensors]: read as NCHW
    check_not_released(impl);
    return nchw_copy_of(*impl_);
  }
  return bytes_as_they_lie(impl);
}

void Tensor::check_nchw_writable() const {
  const auto& impl = checked(impl_);
  DP_CHECK(!is_channels_last(impl), "an in-place write into a channels_last tensor ", str(),
           " by code that writes NCHW: expected a contiguous tensor (Note [Channels-last tensors]: zero_, fill_, "
           "add_, sub_, mul_, div_, copy_, relu_, clamp_ and masked_fill_ write the layout); call .contiguous() "
           "and write into that copy, or compute the result out of place");
}

void* detail::layout_data(const Tensor& t) { return bytes_as_they_lie(checked(t.impl_ptr())); }

void* detail::mutable_layout_data(const Tensor& t) {
  void* p = bytes_as_they_lie(checked(t.impl_ptr()));
  t.note_write();
  return p;
}

Tensor detail::empty_in(const Shape& shape, TensorOptions opts, MemoryFormat format) {
  Tensor out(new_impl(shape, opts.dtype, opts.device));
  if (format == MemoryFormat::ChannelsLast && !layouts_coincide(shape))
    out.impl()->memory_format = MemoryFormat::ChannelsLast;
  return out;
}

MemoryFormat detail::elementwise_format(const Tensor& t, const Tensor& other) {
  if (!t.defined() || !is_channels_last(*t.impl())) return MemoryFormat::Contiguous;
  if (other.defined() && (!is_channels_last(*other.impl()) || other.shape() != t.shape()))
    return MemoryFormat::Contiguous;
  return MemoryFormat::ChannelsLast;
}

Tensor detail::contiguous_copy(const Tensor& t) {
  const Tensor d = t.detach();
  return is_channels_last(checked(d.impl_ptr())) ? in_format(d, MemoryFormat::Contiguous) : d.clone();
}

Tensor detail::in_format(const Tensor& t, MemoryFormat format) {
  const auto& impl = checked(t.impl_ptr());
  if (format == MemoryFormat::ChannelsLast) {
    DP_CHECK(impl.shape.size() == 4, "contiguous(channels_last): expected a 4-d tensor [N, C, H, W], got ",
             t.str());
  }
  const bool cl = is_channels_last(impl);
  if (cl == (format == MemoryFormat::ChannelsLast)) return t;
  if (format == MemoryFormat::ChannelsLast && layouts_coincide(impl.shape)) return t;  // the same bytes
  Tensor out = empty_in(impl.shape, TensorOptions{impl.dtype, t.device()}, format);
  transpose_layout(t.device(), impl.dtype, impl.shape, bytes_as_they_lie(impl), layout_data(out), !cl);
  return out;
}

template <>
float* Tensor::data<float>() const {
  DP_CHECK(dtype() == Dtype::Float32, "expected a float32 tensor, got ", dtype_name(dtype()));
  return static_cast<float*>(raw_data());
}
template <>
std::int64_t* Tensor::data<std::int64_t>() const {
  DP_CHECK(dtype() == Dtype::Int64, "expected an int64 tensor, got ", dtype_name(dtype()));
  return static_cast<std::int64_t*>(raw_data());
}
template <>
std::int32_t* Tensor::data<std::int32_t>() const {
  DP_CHECK(dtype() == Dtype::Int32, "expected an int32 tensor, got ", dtype_name(dtype()));
  return static_cast<std::int32_t*>(raw_data());
}
template <>
BFloat16* Tensor::data<BFloat16>() const {
  DP_CHECK(dtype() == Dtype::BFloat16, "expected a bfloat16 tensor, got ", dtype_name(dtype()));
  return static_cast<BFloat16*>(raw_data());
}
template <>
Float16* Tensor::data<Float16>() const {
  DP_CHECK(dtype() == Dtype::Float16, "expected a float16 tensor, got ", dtype_name(dtype()));
  return static_cast<Float16*>(raw_data());
}
template <>
const BFloat16* Tensor::data<const BFloat16>() const { return data<BFloat16>(); }
template <>
const Float16* Tensor::data<const Float16>() const { return data<Float16>(); }
template <>
const float* Tensor::data<const float>() const { return data<float>(); }
template <>
const std::int32_t* Tensor::data<const std::int32_t>() const { return data<std::int32_t>(); }
template <>
const std::int64_t* Tensor::data<const std::int64_t>() const { return data<std::int64_t>(); }

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  return detail::str_cat("Tensor", shape_str(shape()), " ", dtype_name(dtype()), " ", device().str());
}

// ---- host access ------------------------------------------------------------------------

namespace detail {

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_dev.type == src_dev.type) {
    backend::get(dst_dev).copy(dst, dst_dev, src, src_dev, nbytes);
  } else if (src_dev.is_cpu()) {
    // CPU virtual-device memory is host memory.
    backend::get(dst_dev).copy_from_host(dst, dst_dev, src, nbytes);
  } else {
    backend::get(src_dev).copy_to_host(dst, src, src_dev, nbytes);
  }
}

}  // namespace detail

std::vector<float> Tensor::to_vector() const {
  if (dtype() == Dtype::BFloat16 || dtype() == Dtype::Float16) return to(Dtype::Float32).to_vector();
  std::vector<float> out(static_cast<std::size_t>(numel()));
  const float* src = data<float>();
  if (!out.empty()) backend::get(device()).copy_to_host(out.data(), src, device(), nbytes());
  return out;
}

std::vector<std::int64_t> Tensor::to_vector_i64() const {
  std::vector<std::int64_t> out(static_cast<std::size_t>(numel()));
  const std::int64_t* src = data<std::int64_t>();
  if (!out.empty()) backend::get(device()).copy_to_host(out.data(), src, device(), nbytes());
  return out;
}

std::vector<std::int32_t> Tensor::to_vector_i32() const {
  std::vector<std::int32_t> out(static_cast<std::size_t>(numel()));
  const std::int32_t* src = data<std::int32_t>();
  if (!out.empty()) backend::get(device()).copy_to_host(out.data(), src, device(), nbytes());
  return out;
}

double Tensor::item() const {
  DP_CHECK(numel() == 1, "item(): expected a tensor with one element, got shape ", shape_str(shape()));
  if (is_floating_point(dtype())) return to_vector()[0];
  if (dtype() == Dtype::Int32) return to_vector_i32()[0];
  return static_cast<double>(to_vector_i64()[0]);
}

namespace {

/// The single element of `t` as an integer type: int64 exactly, a float only when it
/// is finite and inside I's range (static_cast of anything else is undefined).
template <typename I>
I integer_item(const Tensor& t, const char* name) {
  DP_CHECK(t.numel() == 1, "item<", name, ">(): expected a tensor with one element, got shape ",
           shape_str(t.shape()));
  // [lo, hi) bounds as doubles: both powers of two, exact.
  const double lo = static_cast<double>(std::numeric_limits<I>::min());
  const double hi = -lo;
  if (is_floating_point(t.dtype())) {
    const double v = t.to_vector()[0];
    DP_CHECK(std::isfinite(v) && v >= lo && v < hi, "item<", name, ">(): the value ", v,
             " has no ", name, " (NaN, infinite or out of range)");
    return static_cast<I>(v);
  }
  const std::int64_t v = t.dtype() == Dtype::Int64 ? t.to_vector_i64()[0] : t.to_vector_i32()[0];
  DP_CHECK(v >= std::numeric_limits<I>::min() && v <= std::numeric_limits<I>::max(), "item<", name,
           ">(): the value ", v, " is out of ", name, "'s range");
  return static_cast<I>(v);
}

}  // namespace

template <>
double Tensor::item<double>() const {
  return item();
}
template <>
float Tensor::item<float>() const {
  DP_CHECK(numel() == 1, "item<float>(): expected a tensor with one element, got shape ", shape_str(shape()));
  if (is_floating_point(dtype())) return to_vector()[0];
  return static_cast<float>(dtype() == Dtype::Int64 ? static_cast<double>(to_vector_i64()[0]) : to_vector_i32()[0]);
}
template <>
std::int64_t Tensor::item<std::int64_t>() const {
  return integer_item<std::int64_t>(*this, "int64_t");
}
template <>
std::int32_t Tensor::item<std::int32_t>() const {
  return integer_item<std::int32_t>(*this, "int32_t");
}
template <>
bool Tensor::item<bool>() const {
  DP_CHECK(numel() == 1, "item<bool>(): expected a tensor with one element, got shape ", shape_str(shape()));
  return item() != 0.0;  // NaN is true, as a C++ conversion and torch's item<bool>() say
}

// ---- devices, copies, views ------------------------------------------------------------

Tensor Tensor::to(Device target) const {
  if (device() == target) return *this;
  Tensor out = detail::empty_in(shape(), TensorOptions{dtype(), target}, suggest_memory_format());
  detail::copy_bytes(detail::layout_data(out), target, detail::layout_data(*this), device(), nbytes());
  Device src_dev = device();
  autograd::record("ToDeviceBackward", {*this}, out, {}, [src_dev](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].to(src_dev)};
  });
  return out;
}

namespace detail {

Tensor cast_raw(const Tensor& t, Dtype target) {
  if (t.dtype() == target) return t;
  DP_ASSERT(is_floating_point(t.dtype()) && is_floating_point(target), "cast_raw: floating dtypes expected, got ",
            dtype_name(t.dtype()), " to ", dtype_name(target));
  Tensor out = empty_in(t.shape(), TensorOptions{target, t.device()}, t.suggest_memory_format());
  backend::get(t.device()).run<backend::Op::Cast>(
      t.device(), kernel_dtype(target), {layout_data(t), kernel_dtype(t.dtype()), layout_data(out), t.numel()});
  return out;
}

}  // namespace detail

Tensor Tensor::to(Dtype target) const {
  if (dtype() == target) return *this;
  // float32 <-> int32 goes through int64: int32 -> int64 is exact and int64 -> float
  // rounds the same value; float -> int64 truncates, then int64 -> int32 keeps the low
  // bits, which is what a direct cast gives wherever that is defined. A 16-bit float
  // goes to or from an integer through float32 (exact widening; one rounding).
  const bool float_in = is_floating_point(dtype()), float_out = is_floating_point(target);
  if (dtype() == Dtype::Int32 && float_out) return to(Dtype::Int64).to(target);
  if (float_in && target == Dtype::Int32) return to(Dtype::Int64).to(target);
  if (float_in != float_out && dtype() != Dtype::Float32 && target != Dtype::Float32)
    return to(Dtype::Float32).to(target);
  Tensor out = detail::empty_in(shape(), TensorOptions{target, device()}, suggest_memory_format());
  backend::get(device()).run<backend::Op::Cast>(
      device(), detail::kernel_dtype(target),
      {detail::layout_data(*this), detail::kernel_dtype(dtype()), detail::layout_data(out), numel()});
  if (float_in && float_out) {
    const Dtype source = dtype();
    autograd::record("ToDtypeBackward", {*this}, out, {}, [source](const std::vector<Tensor>& g) {
      return std::vector<Tensor>{g[0].to(source)};
    });
  }
  return out;
}

Tensor Tensor::pin_memory() const {
  const auto& impl = checked(impl_);
  DP_CHECK(impl.storage->device().is_cpu(), "pin_memory: expected a tensor in host memory (a cpu "
           "device), got ", str(), "; only host tensors can be pinned");
  if (impl.storage->pinned()) return *this;
  auto out = std::make_shared<TensorImpl>();
  out->shape = impl.shape;
  out->dtype = impl.dtype;
  out->storage = std::make_shared<Storage>(Storage::PinnedTag{}, nbytes());
  if (nbytes() > 0) std::memcpy(out->storage->data(), raw_data(), nbytes());
  return Tensor(std::move(out));
}

bool Tensor::is_pinned() const { return checked(impl_).storage->pinned(); }

Tensor Tensor::clone() const {
  Tensor out = detail::empty_in(shape(), TensorOptions{dtype(), device()}, suggest_memory_format());
  detail::copy_bytes(detail::layout_data(out), device(), detail::layout_data(*this), device(), nbytes());
  autograd::record("CloneBackward", {*this}, out, {},
                   [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; });
  return out;
}

Tensor Tensor::detach() const {
  const auto& impl = checked(impl_);
  return Tensor(view_impl(impl, impl.offset, impl.shape));
}

Tensor Tensor::reshape(Shape new_shape) const {
  const auto& impl = checked(impl_);
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < new_shape.size(); ++i) {
    if (new_shape[i] == -1) {
      DP_CHECK(infer < 0, "reshape: expected at most one -1 in ", shape_str(new_shape));
      infer = static_cast<int>(i);
    } else {
      DP_CHECK(new_shape[i] >= 0, "reshape: expected sizes >= 0 or -1, got ", shape_str(new_shape));
      known *= new_shape[i];
    }
  }
  std::int64_t n = numel();
  if (infer >= 0) {
    DP_CHECK(known > 0 && n % known == 0, "reshape: cannot infer -1 in ", shape_str(new_shape),
             " for ", n, " elements (shape ", shape_str(impl.shape), ")");
    new_shape[infer] = n / known;
  }
  DP_CHECK(shape_numel(new_shape) == n, "reshape: expected a shape with ", n, " elements (from ",
           shape_str(impl.shape), "), got ", shape_str(new_shape));
  // A channels-last tensor's bytes are not its NCHW order: other shapes view its
  // contiguous copy (Note [Channels-last tensors]).
  if (is_channels_last(impl) && new_shape != impl.shape) return contiguous().reshape(new_shape);
  Tensor out(view_impl(impl, impl.offset, new_shape));
  Shape old = impl.shape;
  autograd::record("ReshapeBackward", {*this}, out, {}, [old](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].reshape(old)};
  });
  return out;
}

Tensor Tensor::flatten(std::int64_t start, std::int64_t end) const {
  std::int64_t n = dim();
  if (n == 0) return reshape({1});
  if (start < 0) start += n;
  if (end < 0) end += n;
  DP_CHECK(start >= 0 && start < n && end >= start && end < n, "flatten(", start, ", ", end,
           "): expected 0 <= start <= end < ", n, " for shape ", shape_str(shape()));
  Shape s;
  for (std::int64_t i = 0; i < start; ++i) s.push_back(shape()[i]);
  std::int64_t m = 1;
  for (std::int64_t i = start; i <= end; ++i) m *= shape()[i];
  s.push_back(m);
  for (std::int64_t i = end + 1; i < n; ++i) s.push_back(shape()[i]);
  return reshape(s);
}

namespace {

// Copies `outer` blocks of `block` elements from src (one every `src_stride` elements)
// to dst (one every `dst_stride`), on one device: the slices of a narrow along an inner
// dim. Bytes moved as they are, so exact for every dtype; one backend call for all rows.
void copy_blocks(const Tensor& dst, std::int64_t dst_off, std::int64_t dst_stride, const Tensor& src,
                 std::int64_t src_off, std::int64_t src_stride, std::int64_t outer, std::int64_t block) {
  if (block == 0 || outer == 0) return;
  const std::size_t es = element_size(src.dtype());
  auto* d = static_cast<char*>(dst.raw_data());
  const auto* s = static_cast<const char*>(src.raw_data());
  backend::get(src.device())
      .copy_rows(d + dst_off * es, static_cast<std::size_t>(dst_stride) * es, s + src_off * es,
                 static_cast<std::size_t>(src_stride) * es, static_cast<std::size_t>(block) * es,
                 static_cast<std::size_t>(outer), src.device());
}

}  // namespace

Tensor Tensor::narrow(std::int64_t d, std::int64_t start, std::int64_t length) const {
  const auto& impl = checked(impl_);
  const std::int64_t n = dim();
  DP_CHECK(n >= 1, "narrow: expected a tensor with at least 1 dim, got a scalar");
  DP_CHECK(d >= -n && d < n, "narrow: expected a dim in [", -n, ", ", n, "), got ", d, " for shape ",
           shape_str(impl.shape));
  if (d < 0) d += n;
  const std::int64_t size = impl.shape[d];
  // torch.narrow counts a negative start from the end of the dim.
  DP_CHECK(start >= -size && start <= size, "narrow: expected start in [", -size, ", ", size, "] for dim ", d,
           " of shape ", shape_str(impl.shape), ", got ", start);
  if (start < 0) start += size;
  DP_CHECK(length >= 0 && start + length <= size, "narrow: expected [", start, ", ", start + length,
           ") inside [0, ", size, ") of dim ", d, " of shape ", shape_str(impl.shape));
  // Images are whole blocks in both layouts, so only dim 0 narrows a channels-last
  // tensor in place (Note [Channels-last tensors]).
  if (is_channels_last(impl) && d != 0) return contiguous().narrow(d, start, length);
  std::int64_t outer = 1, inner = 1;
  for (std::int64_t i = 0; i < d; ++i) outer *= impl.shape[i];
  for (std::int64_t i = d + 1; i < n; ++i) inner *= impl.shape[i];
  Shape s = impl.shape;
  s[d] = length;
  Tensor out;
  if (outer == 1) {  // contiguous: a view, as PyTorch's
    out = Tensor(view_impl(impl, impl.offset + start * inner, s));
  } else {
    out = Tensor(new_impl(s, impl.dtype, device()));
    copy_blocks(out, 0, length * inner, *this, start * inner, size * inner, outer, length * inner);
    out.impl()->copied_view = "narrow() along a later dim";  // Note [Writes into materialised views]
  }
  Shape full = impl.shape;
  autograd::record("NarrowBackward", {*this}, out, {}, [full, d, start, outer, inner](const std::vector<Tensor>& g) {
    Tensor gx = zeros(full, TensorOptions{g[0].dtype(), g[0].device()});
    const std::int64_t len = g[0].size(d);
    copy_blocks(gx, start * inner, full[d] * inner, g[0], 0, len * inner, outer, len * inner);
    return std::vector<Tensor>{gx};
  });
  return out;
}

Tensor Tensor::unsqueeze(std::int64_t d) const {
  std::int64_t n = dim();
  if (d < 0) d += n + 1;
  DP_CHECK(d >= 0 && d <= n, "unsqueeze(", d, "): expected a dim in [0, ", n, "]");
  Shape s = shape();
  s.insert(s.begin() + d, 1);
  return reshape(s);
}

Tensor Tensor::squeeze(std::int64_t d) const {
  std::int64_t n = dim();
  if (d < 0) d += n;
  DP_CHECK(d >= 0 && d < n && shape()[d] == 1, "squeeze(", d, "): expected a dim of size 1, got shape ",
           shape_str(shape()));
  Shape s = shape();
  s.erase(s.begin() + d);
  return reshape(s);
}

Tensor Tensor::t() const {
  DP_CHECK(dim() == 2, "t(): expected a 2-d tensor, got shape ", shape_str(shape()));
  detail::check_floating("t()", *this);
  std::int64_t r = shape()[0], c = shape()[1];
  Tensor out(new_impl({c, r}, dtype(), device()));
  backend::Indexer ix;
  ix.ndim = 2;
  ix.sizes[0] = c;
  ix.sizes[1] = r;
  ix.strides_a[0] = 1;
  ix.strides_a[1] = c;
  backend::get(device()).run<backend::Op::StridedCopy>(device(), detail::kernel_dtype(dtype()),
                                                      {ix, raw_data(), out.raw_data()});
  out.impl()->copied_view = "t()";  // Note [Writes into materialised views]
  autograd::record("TransposeBackward", {*this}, out, {},
                   [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0].t()}; });
  return out;
}

Tensor Tensor::permute(const std::vector<std::int64_t>& dims) const {
  const std::int64_t n = dim();
  DP_CHECK(static_cast<std::int64_t>(dims.size()) == n, "permute: expected ", n, " dims for shape ",
           shape_str(shape()), ", got ", dims.size());
  DP_CHECK(n <= backend::kMaxDims, "permute: expected at most ", backend::kMaxDims, " dims, got ", n);
  std::vector<std::int64_t> perm(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    std::int64_t d = dims[i];
    DP_CHECK(d >= -n && d < n, "permute: dim ", d, " at position ", i, " is out of range for shape ",
             shape_str(shape()), "; expected a dim in [", -n, ", ", n, ")");
    if (d < 0) d += n;
    DP_CHECK(!seen[static_cast<std::size_t>(d)], "permute: dim ", d, " appears twice; expected a permutation of 0..",
             n - 1);
    seen[static_cast<std::size_t>(d)] = true;
    perm[i] = d;
  }
  detail::check_floating("permute", *this);
  Shape out_shape(dims.size());
  for (std::size_t i = 0; i < perm.size(); ++i) out_shape[i] = shape()[static_cast<std::size_t>(perm[i])];
  Tensor out(new_impl(out_shape, dtype(), device()));
  out.impl()->copied_view = "permute()";  // Note [Writes into materialised views]
  if (out.numel() > 0) {
    // Row-major strides of the source, read in the result's order; adjacent result dims
    // that stay adjacent in the source merge, so an identity permute is one plain copy.
    std::vector<std::int64_t> in_stride(perm.size(), 1);
    for (std::int64_t i = n - 2; i >= 0; --i) in_stride[i] = in_stride[i + 1] * shape()[i + 1];
    backend::Indexer ix;
    for (std::size_t i = 0; i < perm.size(); ++i) {
      const std::int64_t size = out_shape[i], stride = in_stride[static_cast<std::size_t>(perm[i])];
      if (size == 1) continue;
      if (ix.ndim > 0 && ix.strides_a[ix.ndim - 1] == stride * size) {
        ix.sizes[ix.ndim - 1] *= size;
        ix.strides_a[ix.ndim - 1] = stride;
        continue;
      }
      ix.sizes[ix.ndim] = size;
      ix.strides_a[ix.ndim] = stride;
      ++ix.ndim;
    }
    if (ix.ndim == 0) {
      ix.ndim = 1;
      ix.sizes[0] = 1;
    }
    backend::get(device()).run<backend::Op::StridedCopy>(device(), detail::kernel_dtype(dtype()),
                                                         {ix, raw_data(), out.raw_data()});
  }
  std::vector<std::int64_t> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inverse[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i);
  autograd::record("PermuteBackward", {*this}, out, {}, [inverse](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{g[0].permute(inverse)};
  });
  return out;
}

Tensor Tensor::transpose(std::int64_t d0, std::int64_t d1) const {
  const std::int64_t n = dim();
  DP_CHECK(n >= 1, "transpose: expected a tensor with at least 1 dim, got a scalar");
  DP_CHECK(d0 >= -n && d0 < n && d1 >= -n && d1 < n, "transpose(", d0, ", ", d1, "): expected dims in [", -n, ", ",
           n, ") for shape ", shape_str(shape()));
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) perm[static_cast<std::size_t>(i)] = i;
  std::swap(perm[static_cast<std::size_t>(d0 < 0 ? d0 + n : d0)], perm[static_cast<std::size_t>(d1 < 0 ? d1 + n : d1)]);
  Tensor out = permute(perm);
  out.impl()->copied_view = "transpose()";  // Note [Writes into materialised views]
  return out;
}

Tensor Tensor::contiguous() const {
  const auto& impl = checked(impl_);
  if (is_channels_last(impl)) return contiguous(MemoryFormat::Contiguous);
  if (impl.copied_view == nullptr) return *this;
  // The copy alone, writable (Note [Writes into materialised views]).
  Tensor out(view_impl(impl, impl.offset, impl.shape));
  out.impl()->copied_view = nullptr;
  autograd::record("ContiguousBackward", {*this}, out, {},
                   [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; });
  return out;
}

Tensor Tensor::contiguous(MemoryFormat format) const {
  Tensor out = detail::in_format(*this, format);
  if (out.is_same(*this)) return out;
  autograd::record(format == MemoryFormat::ChannelsLast ? "ToChannelsLastBackward" : "ContiguousBackward", {*this}, out,
                   {}, [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g[0]}; });
  return out;
}

bool Tensor::is_contiguous(MemoryFormat format) const {
  const auto& impl = checked(impl_);
  if (format == MemoryFormat::ChannelsLast && impl.shape.size() != 4) return false;
  return layouts_coincide(impl.shape) || is_channels_last(impl) == (format == MemoryFormat::ChannelsLast);
}

MemoryFormat Tensor::suggest_memory_format() const { return checked(impl_).memory_format; }

// ---- in-place ---------------------------------------------------------------------------

// Each takes its written pointer with mutable_data / mutable_raw_data (Note [Storage
// versions]) after every check that may throw, so a rejected call moves no version.

// Note [In-place writes and autograd]
// An in-place write changes values autograd may need, and what it adds to a tensor's
// history must become part of its gradient. With grad mode on:
//  - into a leaf that requires grad (a parameter) it is a dp::Error, as in PyTorch ("a
//    leaf Variable that requires grad is being used in an in-place operation"): write
//    under a dp::NoGradGuard, as initialisations and hand-written updates do;
//  - into a tensor made by an op (y = x * 3; y.mul_(2)), or of a source that requires
//    grad into any tensor (buf.copy_(x * 2), acc.add_(loss)), it is RECORDED, as PyTorch
//    records it: the tensor's history becomes a node over its old history and the
//    source (record_inplace), so every handle of it sees the new history and the
//    gradient is the out-of-place op's (y = y * 2 gives the same numbers). Before,
//    dp recorded nothing and the write was missing from the gradient, silently:
//    buf.copy_(x * 2); (buf + x).sum().backward() gave x.grad = 1, not 3;
//  - but only into a tensor whose storage no other tensor shares. A view (a narrow,
//    a reshape of it, or the tensor it views) has a history of its own that the write
//    would change behind its back; PyTorch rewrites the views' histories (CopySlices),
//    dp refuses the write with a dp::Error naming the out-of-place build (dp::cat of the
//    pieces, y = y + t, dp::where), or detach() where no gradient should flow. A node
//    whose backward reads a tensor (exp its result, a * a its input) keeps it as
//    another tensor of the same storage: a write into it is refused at once, where
//    PyTorch records it and that backward then throws.
// Under a NoGradGuard every write is allowed and nothing is recorded, as in PyTorch.
// What a write leaves behind is caught where it matters: a node that saved the tensor
// for backward sees its storage's bytes written (Note [Saved tensors and in-place
// writes] in src/autograd/node.cpp): a write under no_grad into what a node saved makes
// that node's backward throw.
bool detail::check_inplace_grad(const char* op, const Tensor& t, const Tensor& source) {
  if (!is_grad_enabled()) return false;
  const bool from_source = source.defined() && source.requires_grad();
  if (!t.requires_grad() && !from_source) return false;
  if (t.requires_grad() && t.is_leaf()) {
    DP_CHECK(false, op, ": expected a tensor that does not require grad, got a leaf that requires grad (",
             t.str(), "), with grad mode on. An in-place write into it would not be part of any gradient; "
             "PyTorch refuses it too. Write under a dp::NoGradGuard (PyTorch's torch.no_grad()), as "
             "initialisations and hand-written parameter updates do (Note [In-place writes and autograd])");
  }
  if (t.impl()->storage.use_count() == 1) return true;  // no view shares it: recorded
  const auto fn = (from_source ? source : t).grad_fn();
  const std::string what = from_source ? detail::str_cat("a source that requires grad (", source.str(), ", ",
                                                         fn ? "made by " + fn->name() : std::string("a leaf"), ")")
                                       : detail::str_cat("a tensor made by ", fn ? fn->name() : std::string("an op"),
                                                         " (", t.str(), ")");
  DP_CHECK(false, op, ": expected a write autograd can record, got ", what, " written into ",
           from_source ? t.str() : std::string("it"), ", whose storage other tensors share (a view, a tensor "
           "with views, or one a backward node saved), with grad mode on. dp records an in-place write only "
           "into a tensor that owns its storage alone: the other tensors' histories would miss it. Build the result out of place (dp::cat of the pieces for a "
           "filled buffer, y = y + t for y.add_(t), y = y * 2 for y.mul_(2), dp::where for a masked write), pass "
           "source.detach() if no gradient should flow, or write under a dp::NoGradGuard to change the values "
           "alone (Note [In-place writes and autograd])");
  return false;
}

void detail::record_inplace(const char* name, Tensor& t, const Tensor& source,
                            std::function<std::vector<Tensor>(const Tensor& g)> fn) {
  auto node = std::make_shared<autograd::LambdaNode>(
      name, [fn = std::move(fn)](const std::vector<Tensor>& g) { return fn(g.at(0)); });
  // The edges are read before t's history is replaced: its old grad_fn (or none) and the
  // source's, then t's new grad_fn is the node.
  autograd::connect(node, {t, source}, {&t});
}

Tensor& Tensor::zero_() {
  detail::check_writable("Tensor::zero_", *this);
  const bool record = detail::check_inplace_grad("Tensor::zero_", *this);
  void* p = detail::mutable_layout_data(*this);  // every element alike: any layout
  if (numel() > 0) backend::get(device()).memset_zero(p, device(), nbytes());
  if (record)  // the old values are gone: their gradient is zero, as PyTorch's
    detail::record_inplace("ZeroBackward", *this, Tensor(), [](const Tensor& g) { return std::vector<Tensor>{zeros_like(g), Tensor()}; });
  return *this;
}

Tensor& Tensor::fill_(double value) {
  detail::check_writable("Tensor::fill_", *this);
  const bool record = detail::check_inplace_grad("Tensor::fill_", *this);
  using backend::DType;
  using backend::Op;
  auto& be = backend::get(device());
  if (is_floating_point(dtype())) {
    be.run<Op::Fill>(device(), detail::kernel_dtype(dtype()),
                     {detail::mutable_layout_data(*this), numel(), static_cast<float>(value)});
  } else if (dtype() == Dtype::Int64) {
    be.run<Op::Fill>(device(), DType::I64,
                     {mutable_data<std::int64_t>(), numel(), static_cast<std::int64_t>(value)});
  } else {
    // int32 has no fill kernel of its own: fill an int64 copy and narrow it.
    Tensor wide = empty(shape(), TensorOptions{Dtype::Int64, device()});
    be.run<Op::Fill>(device(), DType::I64, {wide.data<std::int64_t>(), numel(), static_cast<std::int64_t>(value)});
    be.run<Op::Cast>(device(), DType::I32,
                     {wide.data<std::int64_t>(), DType::I64, mutable_data<std::int32_t>(), numel()});
  }
  if (record)
    detail::record_inplace("FillBackward", *this, Tensor(), [](const Tensor& g) { return std::vector<Tensor>{zeros_like(g), Tensor()}; });
  return *this;
}

Tensor& Tensor::add_(double value) {
  detail::check_writable("Tensor::add_", *this);
  const bool record = detail::check_inplace_grad("Tensor::add_", *this);
  using backend::DType;
  using backend::Op;
  auto& be = backend::get(device());
  if (is_floating_point(dtype())) {
    void* p = detail::mutable_layout_data(*this);  // elementwise: any layout
    be.run<Op::Affine>(device(), detail::kernel_dtype(dtype()), {p, p, numel(), 1.0f, static_cast<float>(value)});
  } else if (dtype() == Dtype::Int64) {
    be.run<Op::AddScalar>(device(), DType::I64,
                          {mutable_data<std::int64_t>(), numel(), static_cast<std::int64_t>(value)});
  } else {
    Tensor wide = to(Dtype::Int64);
    be.run<Op::AddScalar>(device(), DType::I64,
                          {wide.data<std::int64_t>(), numel(), static_cast<std::int64_t>(value)});
    be.run<Op::Cast>(device(), DType::I32,
                     {wide.data<std::int64_t>(), DType::I64, mutable_data<std::int32_t>(), numel()});
  }
  if (record)
    detail::record_inplace("AddScalarBackward", *this, Tensor(), [](const Tensor& g) { return std::vector<Tensor>{g, Tensor()}; });
  return *this;
}

// Note [Sources of in-place writes]
// copy_ and add_ take their source as PyTorch's do. Its shape need only broadcast to the
// destination's (a bias row added into every row, a [1] filling a buffer); the
// destination keeps its shape, so a source that would grow it is a dp::Error. Its dtype
// may differ: copy_ converts it to the destination's (PyTorch's rounding, Note [16-bit
// tensors]; a float into an integer tensor truncates), and add_ sums in PyTorch's common
// dtype, the destination's for an integer source or one of its own dtype, else float32
// (bfloat16 plus float16, or a 16-bit side with a float32 one), rounded once into the
// destination. The conversion and the broadcast are made as ops on the source, so the
// gradient that autograd records for the write (Note [In-place writes and autograd])
// flows back through them: summed over the broadcast, converted to the source's dtype.
// An integer destination takes no gradient, whatever the source.
namespace {

void check_source_broadcasts(const char* op, const char* what, const Tensor& src, const Shape& to) {
  detail::check_defined(op, src, what);
  const Shape& from = src.shape();
  bool ok = from.size() <= to.size();
  for (std::size_t i = 0; ok && i < from.size(); ++i) {
    const std::int64_t f = from[from.size() - 1 - i], t = to[to.size() - 1 - i];
    ok = f == t || f == 1;
  }
  DP_CHECK(ok, op, ": expected ", what, " whose shape broadcasts to the destination's ", shape_str(to),
           ", got ", shape_str(from), " (an in-place write keeps the destination's shape)");
}

}  // namespace

Tensor& Tensor::copy_(const Tensor& src) {
  detail::check_defined("copy_", *this, "destination");
  check_source_broadcasts("copy_", "a source", src, shape());
  detail::check_writable("Tensor::copy_", *this);
  const bool floating = is_floating_point(dtype());
  const bool record = detail::check_inplace_grad("Tensor::copy_", *this, floating ? src : Tensor());
  Tensor from;
  {
    std::optional<NoGradGuard> no_grad;
    if (!record) no_grad.emplace();
    from = detail::broadcast_source(src, shape()).to(dtype());  // the gradient converted, then summed
  }
  // In this tensor's layout (Note [Channels-last tensors]).
  const Tensor bytes = detail::in_format(from, suggest_memory_format());
  detail::copy_bytes(detail::mutable_layout_data(*this), device(), detail::layout_data(bytes), bytes.device(),
                     nbytes());
  if (record) {
    const Device from_device = from.device();
    detail::record_inplace("CopyBackwards", *this, from, [from_device](const Tensor& g) {
      return std::vector<Tensor>{zeros_like(g), g.device() == from_device ? g : g.to(from_device)};
    });
  }
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, float alpha) {
  detail::check_same_device("add_", *this, other);
  detail::check_floating("add_", *this);
  check_source_broadcasts("add_", "a tensor to add", other, shape());
  detail::check_writable("Tensor::add_", *this);
  const bool record = detail::check_inplace_grad("Tensor::add_", *this, other);
  // Note [Sources of in-place writes]: the sum in PyTorch's common dtype.
  const Dtype common = !is_floating_point(other.dtype()) || other.dtype() == dtype() ? dtype() : Dtype::Float32;
  Tensor x;
  {
    std::optional<NoGradGuard> no_grad;
    if (!record) no_grad.emplace();
    x = other.to(common);
  }
  // The source in this tensor's layout, added over the bytes as they lie (Note
  // [Channels-last tensors]).
  const Tensor wide_x = detail::in_format(detail::broadcast_source(x.detach(), shape()), suggest_memory_format());
  auto& be = backend::get(device());
  if (common == dtype()) {
    be.run<backend::Op::Axpy>(device(), detail::kernel_dtype(dtype()),
                              {alpha, detail::layout_data(wide_x), detail::mutable_layout_data(*this), numel()});
  } else {  // a 16-bit destination: the float32 sum, rounded once
    Tensor wide = detail::cast_raw(*this, Dtype::Float32);
    be.run<backend::Op::Axpy>(device(), backend::DType::F32,
                              {alpha, detail::layout_data(wide_x), detail::layout_data(wide), numel()});
    const Tensor back = detail::cast_raw(wide, dtype());
    detail::copy_bytes(detail::mutable_layout_data(*this), device(), detail::layout_data(back), device(), nbytes());
  }
  if (record)  // the source's gradient summed over the broadcast in the output's dtype, then converted
    detail::record_inplace("AddBackward", *this, x, [alpha, to = x.dtype(), from = x.shape()](const Tensor& g) {
      Tensor gx = alpha == 1.0f ? g : mul(g, static_cast<double>(alpha));
      if (gx.shape() != from) gx = sum_to(gx, from);
      return std::vector<Tensor>{g, gx.dtype() == to ? gx : detail::cast_raw(gx, to)};
    });
  return *this;
}

Tensor& Tensor::mul_(float value) {
  detail::check_floating("mul_", *this);
  detail::check_writable("Tensor::mul_", *this);
  const bool record = detail::check_inplace_grad("Tensor::mul_", *this);
  void* p = detail::mutable_layout_data(*this);  // elementwise: any layout
  backend::get(device()).run<backend::Op::Affine>(device(), detail::kernel_dtype(dtype()), {p, p, numel(), value, 0.0f});
  if (record)
    detail::record_inplace("MulScalarBackward", *this, Tensor(), [value](const Tensor& g) {
      return std::vector<Tensor>{mul(g, static_cast<double>(value)), Tensor()};
    });
  return *this;
}

Tensor& Tensor::sub_(const Tensor& other, float alpha) { return add_(other, -alpha); }

Tensor& Tensor::sub_(double value) { return add_(-value); }

// Note [In-place writes as out-of-place ops]
// mul_(tensor), div_, masked_fill_, relu_ and clamp_ compute their out-of-place op and write its
// result over this tensor's bytes. The result is computed in PyTorch's common dtype and
// rounded once into this one's, as PyTorch's in-place ops compute into self. With grad
// mode on and a write autograd records (Note [In-place writes and autograd]), the op
// reads a recorded clone of the old values — PyTorch's "original self": mul_'s gradient
// for its source needs them, and the bytes are about to be overwritten — and this
// tensor's history becomes a node that passes its gradient on to the result's history
// (the op over the clone over the old history, and the source). So every gradient is
// the out-of-place build's, bit for bit (inplace_test), for the cost of the clone while
// the graph lives; every check runs before a byte is written.
namespace {

Tensor& write_op_result(Tensor& t, const char* op, const char* node, const Tensor& source,
                        const std::function<Tensor(const Tensor& old)>& compute) {
  detail::check_writable(op, t);
  const bool record = detail::check_inplace_grad(op, t, source);
  Tensor r;
  {
    std::optional<NoGradGuard> no_grad;
    if (!record) no_grad.emplace();
    r = compute(record ? t.clone() : t);
    if (r.dtype() != t.dtype()) r = r.to(t.dtype());
  }
  DP_CHECK(r.shape() == t.shape(), op, ": internal: the result's shape ", shape_str(r.shape()), " is not the tensor's ",
           shape_str(t.shape()));
  const Tensor bytes = detail::in_format(r, t.suggest_memory_format());  // Note [Channels-last tensors]
  detail::copy_bytes(detail::mutable_layout_data(t), t.device(), detail::layout_data(bytes), bytes.device(),
                     t.nbytes());
  if (record) {
    auto pass = std::make_shared<autograd::LambdaNode>(
        node, [](const std::vector<Tensor>& g) { return std::vector<Tensor>{g.at(0)}; });
    autograd::connect(pass, {r}, {&t});
  }
  return t;
}

void check_destination(const char* op, const Tensor& t) {
  detail::check_defined(op, t, "destination");
  detail::check_floating(op, t);
}

void check_tensor_source(const char* op, const Tensor& t, const Tensor& other, const char* what) {
  check_destination(op, t);
  check_source_broadcasts(op, what, other, t.shape());
  detail::check_same_device(op, t, other);
}

}  // namespace

Tensor& Tensor::mul_(const Tensor& other) {
  check_tensor_source("mul_", *this, other, "a tensor to multiply by");
  return write_op_result(*this, "Tensor::mul_", "MulBackward0", other,
                         [&other](const Tensor& old) { return mul(old, other); });
}

Tensor& Tensor::div_(const Tensor& other) {
  check_tensor_source("div_", *this, other, "a tensor to divide by");
  return write_op_result(*this, "Tensor::div_", "DivBackward0", other,
                         [&other](const Tensor& old) { return div(old, other); });
}

Tensor& Tensor::div_(double value) {
  check_destination("div_", *this);
  return write_op_result(*this, "Tensor::div_", "DivBackward1", Tensor(),
                         [value](const Tensor& old) { return div(old, value); });
}

Tensor& Tensor::masked_fill_(const Tensor& mask, double value) {
  check_destination("masked_fill_", *this);
  check_source_broadcasts("masked_fill_", "a mask", mask, shape());
  detail::check_same_device("masked_fill_", *this, mask);
  return write_op_result(*this, "Tensor::masked_fill_", "MaskedFillBackward0", Tensor(),
                         [&mask, value](const Tensor& old) { return dp::masked_fill(old, mask, value); });
}

Tensor& Tensor::relu_() {
  check_destination("relu_", *this);
  return write_op_result(*this, "Tensor::relu_", "ReluBackward0", Tensor(),
                         [](const Tensor& old) { return old.relu(); });
}

Tensor& Tensor::clamp_(std::optional<double> min, std::optional<double> max) {
  check_destination("clamp_", *this);
  DP_CHECK(min.has_value() || max.has_value(), "clamp_: expected at least one of min and max, got neither");
  return write_op_result(*this, "Tensor::clamp_", "ClampBackward1", Tensor(),
                         [min, max](const Tensor& old) { return dp::clamp(old, min, max); });
}

// ---- autograd ---------------------------------------------------------------------------

bool Tensor::requires_grad() const {
  const auto& impl = checked(impl_);
  return impl.autograd && (impl.autograd->requires_grad || impl.autograd->grad_fn);
}

Tensor& Tensor::set_requires_grad(bool on) {
  auto& impl = const_cast<TensorImpl&>(checked(impl_));
  DP_CHECK(!impl.autograd || !impl.autograd->grad_fn,
           "set_requires_grad: expected a leaf tensor; this one was made by ",
           impl.autograd->grad_fn->name(), " (use detach() first)");
  DP_CHECK(!on || is_floating_point(impl.dtype),
           "set_requires_grad: only floating tensors (float32, bfloat16, float16) can require gradients, got ",
           dtype_name(impl.dtype));
  if (!impl.autograd) impl.autograd = std::make_unique<autograd::AutogradMeta>();
  impl.autograd->requires_grad = on;
  return *this;
}

bool Tensor::is_leaf() const {
  const auto& impl = checked(impl_);
  return !impl.autograd || !impl.autograd->grad_fn;
}

Tensor Tensor::grad() const {
  const auto& impl = checked(impl_);
  return impl.autograd ? impl.autograd->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  auto& impl = const_cast<TensorImpl&>(checked(impl_));
  if (g.defined())
    DP_CHECK(g.shape() == impl.shape && g.device() == device(), "set_grad: expected a gradient of shape ",
             shape_str(impl.shape), " on ", device(), ", got ", shape_str(g.shape()), " on ", g.device());
  if (autograd::assign_pinned_grad(*this, g)) return;  // a parameter of a set: written into its view
  if (!impl.autograd) impl.autograd = std::make_unique<autograd::AutogradMeta>();
  impl.autograd->grad = g;
}

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  const auto& impl = checked(impl_);
  return impl.autograd ? impl.autograd->grad_fn : nullptr;
}

void Tensor::backward(const Tensor& g, bool retain_graph) const {
  autograd::run_backward({*this}, {g}, retain_graph);
}

Tensor Tensor::operator-() const { return dp::neg(*this); }
Tensor Tensor::neg() const { return dp::neg(*this); }
Tensor Tensor::square() const { return dp::square(*this); }
Tensor Tensor::sqrt() const { return dp::sqrt(*this); }
Tensor Tensor::abs() const { return dp::abs(*this); }
Tensor Tensor::reciprocal() const { return dp::reciprocal(*this); }
Tensor Tensor::relu() const { return dp::relu(*this); }
Tensor Tensor::sigmoid() const { return dp::sigmoid(*this); }
Tensor Tensor::tanh() const { return dp::tanh(*this); }
Tensor Tensor::pow(double p) const { return dp::pow(*this, p); }
Tensor Tensor::matmul(const Tensor& other) const { return dp::matmul(*this, other); }
Tensor Tensor::exp() const { return dp::exp(*this); }
Tensor Tensor::log() const { return dp::log(*this); }
Tensor Tensor::sum() const { return dp::sum(*this); }
Tensor Tensor::sum(std::int64_t d, bool keepdim) const { return dp::sum(*this, d, keepdim); }
Tensor Tensor::mean() const { return dp::mean(*this); }
Tensor Tensor::mean(std::int64_t d, bool keepdim) const { return dp::mean(*this, d, keepdim); }
Tensor Tensor::max(std::int64_t d, bool keepdim) const { return dp::max(*this, d, keepdim); }
Tensor Tensor::argmax(std::int64_t d, bool keepdim) const { return dp::argmax(*this, d, keepdim); }
Tensor Tensor::eq(const Tensor& other) const { return dp::eq(*this, other); }
Tensor Tensor::ne(const Tensor& other) const { return dp::ne(*this, other); }
Tensor Tensor::gt(const Tensor& other) const { return dp::gt(*this, other); }
Tensor Tensor::lt(const Tensor& other) const { return dp::lt(*this, other); }
Tensor Tensor::ge(const Tensor& other) const { return dp::ge(*this, other); }
Tensor Tensor::le(const Tensor& other) const { return dp::le(*this, other); }
Tensor Tensor::eq(double value) const { return dp::eq(*this, value); }
Tensor Tensor::ne(double value) const { return dp::ne(*this, value); }
Tensor Tensor::gt(double value) const { return dp::gt(*this, value); }
Tensor Tensor::lt(double value) const { return dp::lt(*this, value); }
Tensor Tensor::ge(double value) const { return dp::ge(*this, value); }
Tensor Tensor::le(double value) const { return dp::le(*this, value); }
Tensor Tensor::masked_fill(const Tensor& mask, double value) const { return dp::masked_fill(*this, mask, value); }
Tensor Tensor::clamp(std::optional<double> min, std::optional<double> max) const { return dp::clamp(*this, min, max); }

// ---- creation -------------------------------------------------------------------------------

Tensor empty(const Shape& shape, TensorOptions opts) { return Tensor(new_impl(shape, opts.dtype, opts.device)); }
Tensor empty(const Shape& shape, Device device) { return empty(shape, TensorOptions{Dtype::Float32, device}); }
Tensor zeros(const Shape& shape, TensorOptions opts) { return empty(shape, opts).zero_(); }
Tensor zeros(const Shape& shape, Device device) { return zeros(shape, TensorOptions{Dtype::Float32, device}); }
Tensor ones(const Shape& shape, TensorOptions opts) { return full(shape, 1.0, opts); }
Tensor ones(const Shape& shape, Device device) { return ones(shape, TensorOptions{Dtype::Float32, device}); }
Tensor full(const Shape& shape, double value, TensorOptions opts) { return empty(shape, opts).fill_(value); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), TensorOptions{t.dtype(), t.device()}); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), TensorOptions{t.dtype(), t.device()}); }
Tensor empty_like(const Tensor& t) { return empty(t.shape(), TensorOptions{t.dtype(), t.device()}); }

Tensor randn(const Shape& shape, Generator& gen, Device device) {
  Tensor t = empty(shape, device);
  std::int64_t n = t.numel();
  backend::get(device).run<backend::Op::FillNormal>(
      device, backend::DType::F32,
      {t.data<float>(), n, 0.0f, 1.0f, gen.seed(), gen.advance(static_cast<std::uint64_t>(n))});
  return t;
}

Tensor uniform(const Shape& shape, double lo, double hi, Generator& gen, Device device) {
  DP_CHECK(lo <= hi, "uniform: expected lo <= hi, got [", lo, ", ", hi, ")");
  Tensor t = empty(shape, device);
  std::int64_t n = t.numel();
  backend::get(device).run<backend::Op::FillUniform>(
      device, backend::DType::F32,
      {t.data<float>(), n, static_cast<float>(lo), static_cast<float>(hi), gen.seed(),
       gen.advance(static_cast<std::uint64_t>(n))});
  return t;
}

Tensor randn(const Shape& shape, Device device) { return randn(shape, default_generator(), device); }

Tensor rand(const Shape& shape, Device device) { return rand(shape, default_generator(), device); }
Tensor rand(const Shape& shape, Generator& gen, Device device) { return uniform(shape, 0.0, 1.0, gen, device); }

Tensor normal(double mean, double std, const Shape& shape, Device device) {
  return normal(mean, std, shape, default_generator(), device);
}
Tensor normal(double mean, double std, const Shape& shape, Generator& gen, Device device) {
  DP_CHECK(std::isfinite(mean) && std::isfinite(std) && std >= 0.0,
           "normal: expected a finite mean and a finite std >= 0, got mean ", mean, ", std ", std);
  Tensor t = empty(shape, device);
  std::int64_t n = t.numel();
  backend::get(device).run<backend::Op::FillNormal>(
      device, backend::DType::F32,
      {t.data<float>(), n, static_cast<float>(mean), static_cast<float>(std), gen.seed(),
       gen.advance(static_cast<std::uint64_t>(n))});
  return t;
}

Tensor randint(std::int64_t low, std::int64_t high, const Shape& shape, Device device) {
  return randint(low, high, shape, default_generator(), device);
}
Tensor randint(std::int64_t high, const Shape& shape, Device device) { return randint(0, high, shape, device); }

// Each value is floor(u * span) for one float32 uniform u = k / 2^24 (k < 2^24), made
// as uniform(0, span) makes it (0 + span * u, one rounding). With span <= 2^24 that
// product rounds to at most span - 1: its distance below span, span * 2^-24, is more
// than half the float spacing just below span (equal to it, exactly representable, when
// span is a power of two). So the values stay in [low, high) on every backend.
Tensor randint(std::int64_t low, std::int64_t high, const Shape& shape, Generator& gen, Device device) {
  constexpr std::int64_t kMaxSpan = std::int64_t{1} << 24;  // a float32 uniform's resolution
  constexpr std::int64_t kExactInDouble = std::int64_t{1} << 53;  // low is added as a double
  DP_CHECK(low < high && static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low) <= kMaxSpan,
           "randint: expected low < high with high - low <= 2^24, got [", low, ", ", high, ")");
  DP_CHECK(low >= -kExactInDouble && low <= kExactInDouble, "randint: expected |low| <= 2^53, got ", low);
  Tensor t = uniform(shape, 0.0, static_cast<double>(high - low), gen, device).to(Dtype::Int64);
  if (low != 0) t.add_(static_cast<double>(low));
  return t;
}

Tensor arange(std::int64_t n, TensorOptions opts) {
  DP_CHECK(n >= 0, "arange: expected n >= 0, got ", n);
  if (opts.dtype == Dtype::Int32) return arange(n, TensorOptions{Dtype::Int64, opts.device}).to(Dtype::Int32);
  Tensor t = empty({n}, opts);
  auto& be = backend::get(opts.device);
  if (opts.dtype == Dtype::Float32)
    be.run<backend::Op::Arange>(opts.device, backend::DType::F32, {t.data<float>(), n, 0.0f, 1.0f});
  else
    be.run<backend::Op::Arange>(opts.device, backend::DType::I64,
                                {t.data<std::int64_t>(), n, std::int64_t{0}, std::int64_t{1}});
  return t;
}

namespace {

template <typename T>
Tensor from_host(const std::vector<T>& data, const Shape& shape, Dtype dtype, Device device) {
  DP_CHECK(shape_numel(shape) == static_cast<std::int64_t>(data.size()), "from_vector: shape ",
           shape_str(shape), " needs ", shape_numel(shape), " elements, got ", data.size());
  Tensor t = empty(shape, TensorOptions{dtype, device});
  if (!data.empty()) backend::get(device).copy_from_host(t.data<T>(), device, data.data(), t.nbytes());
  return t;
}

}  // namespace

Tensor from_vector(const std::vector<float>& data, const Shape& shape, Device device) {
  return from_host(data, shape, Dtype::Float32, device);
}
Tensor from_vector(const std::vector<std::int64_t>& data, const Shape& shape, Device device) {
  return from_host(data, shape, Dtype::Int64, device);
}
Tensor from_vector(const std::vector<std::int32_t>& data, const Shape& shape, Device device) {
  return from_host(data, shape, Dtype::Int32, device);
}
Tensor from_vector(const std::vector<BFloat16>& data, const Shape& shape, Device device) {
  return from_host(data, shape, Dtype::BFloat16, device);
}
Tensor from_vector(const std::vector<Float16>& data, const Shape& shape, Device device) {
  return from_host(data, shape, Dtype::Float16, device);
}

Tensor from_blob(void* data, const Shape& shape, Dtype dtype, Device device, std::function<void(void*)> deleter) {
  DP_CHECK(data != nullptr, "from_blob: expected a non-null data pointer, got nullptr (shape ",
           shape_str(shape), ")");
  for (auto s : shape)
    DP_CHECK(s >= 0, "from_blob: expected non-negative sizes, got shape ", shape_str(shape));
  const std::size_t es = element_size(dtype);
  DP_CHECK(reinterpret_cast<std::uintptr_t>(data) % es == 0, "from_blob: expected data aligned to ", es,
           " bytes for ", dtype_name(dtype), ", got address ", data);
  const int count = device_count(device.type);
  DP_CHECK(device.index >= 0 && device.index < count, "from_blob: expected an existing device, got ",
           device.str(), " (", count, " ", device.is_cpu() ? "CPU virtual" : "CUDA", " device",
           count == 1 ? "" : "s", " here)");
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->dtype = dtype;
  impl->storage = std::make_shared<Storage>(device, data, static_cast<std::size_t>(shape_numel(shape)) * es,
                                            std::move(deleter));
  return Tensor(std::move(impl));
}

Tensor scalar_tensor(double value, Device device) { return full({}, value, TensorOptions{Dtype::Float32, device}); }

}  // namespace dp
