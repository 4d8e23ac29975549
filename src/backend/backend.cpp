#include "backend/backend.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "dp/core/error.h"

namespace dp::backend {

// Defined by backend/cpu and by backend/cuda (or backend/stub when CUDA is absent).
Backend& cpu_backend();
Backend& cuda_backend();

Backend& get(DeviceType type) {
  return type == DeviceType::CPU ? cpu_backend() : cuda_backend();
}

Backend& pinned_host_backend() {
  // Probed once: the device count of a process does not change.
  static Backend& backend = cuda_backend().device_count() > 0 ? cuda_backend() : cpu_backend();
  return backend;
}

// ---- the op list and the kernel table (Note [The op list] in ops.h) -------------------

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "float32";
    case DType::I64: return "int64";
    case DType::I32: return "int32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::kCount: break;
  }
  return "an unknown dtype";
}

void visit_dtype_failed(DType dt) {
  DP_FAIL("backend: expected a dtype below ", kDTypeCount, ", got ", static_cast<int>(dt));
}

const char* op_name(Op op) {
  switch (op) {
#define DP_OP_NAME(name, str, Args) \
  case Op::name:                    \
    return str;
    DP_BACKEND_OPS(DP_OP_NAME)
#undef DP_OP_NAME
    case Op::kCount: break;
  }
  return "an unknown op";
}

void check_gemm_batch(const GemmArgs& a) {
  DP_CHECK(a.batch >= 0, "gemm: expected a batch of at least 0 products, got ", a.batch);
  if (a.batch <= 1) return;
  DP_CHECK(a.epilogue.empty(), "gemm: a batch of ", a.batch, " products takes no epilogue");
  DP_CHECK(a.stride_a >= 0 && a.stride_b >= 0, "gemm: expected non-negative batch strides, got stride_a=",
           a.stride_a, ", stride_b=", a.stride_b);
  const std::int64_t c_span = a.m == 0 || a.n == 0 ? 0 : (a.m - 1) * a.ldc + a.n;
  DP_CHECK(a.stride_c >= c_span, "gemm: the batch's results overlap: stride_c=", a.stride_c, " for a C of ", a.m,
           " rows ", a.ldc, " apart (", c_span, " elements)");
}

// Note [Concurrent devices of live wrappers]
// A DataParallel tells the backend how many of its devices work at once, and each CPU
// device's arena takes that share of the cores (set_concurrent_devices). The count was
// the last wrapper's word: its destructor set 1 while another wrapper over two devices
// still trained, whose devices then ran with every core each — oversubscribed, and with
// a thread count that picks other GEMM chunks and other convolution layouts (Note [CPU
// convolution: measured choice] keys its choice by it), so other bits. Resuming into
// fresh objects and then dropping the old ones did exactly that: the loop fuzzer's
// program 9005 (DP on 2 devices, a channels-last CNN) differed from the same run
// without the resume in the last bit of a bias. Now each wrapper holds its count for
// its lifetime and the backend runs with the largest count held, 1 when none is.

void Backend::hold_concurrent_devices(int count) {
  DP_CHECK(count >= 1, "hold_concurrent_devices: expected a device count >= 1, got ", count);
  std::lock_guard<std::mutex> lock(holds_mu_);
  holds_.insert(count);
  set_concurrent_devices(*holds_.rbegin());
}

void Backend::release_concurrent_devices(int count) {
  std::lock_guard<std::mutex> lock(holds_mu_);
  const auto it = holds_.find(count);
  DP_CHECK(it != holds_.end(), "release_concurrent_devices: no wrapper holds ", count, " device(s)");
  holds_.erase(it);
  set_concurrent_devices(holds_.empty() ? 1 : *holds_.rbegin());
}

void check_16bit_epilogue(DType dt, const GemmArgs& a) {
  DP_CHECK(!a.epilogue.relu && a.epilogue.relu_y == nullptr, "gemm: a ", dtype_name(dt),
           " product's epilogue is a bias only (ReLU is a separate op for 16-bit dtypes), got",
           a.epilogue.relu ? " a ReLU" : "", a.epilogue.relu_y ? " a ReLU mask" : "");
  DP_CHECK(a.epilogue.bias == nullptr || a.ldc == std::max<std::int64_t>(1, a.n),
           "gemm: an epilogue needs a contiguous C (ldc == n), got ldc=", a.ldc, " for n=", a.n);
  DP_CHECK(a.epilogue.bias == nullptr || a.beta == 0.0f, "gemm: a ", dtype_name(dt),
           " product with a bias writes C (beta 0), got beta=", a.beta);
}

void Backend::gemm_epilogue_by_ops(Device dev, const GemmArgs& a) {
  DP_CHECK(a.epilogue.empty() || a.ldc == std::max<std::int64_t>(1, a.n),
           "gemm: an epilogue needs a contiguous C (ldc == n), got ldc=", a.ldc, " for n=", a.n);
  if (a.m == 0 || a.n == 0) return;
  const std::int64_t mn = a.m * a.n;
  void* c = a.c;
  if (a.k == 0 && a.beta == 0.0f) {
    run<Op::Fill>(dev, DType::F32, {c, mn, 0.0f});
  } else {
    GemmArgs plain = a;
    plain.epilogue = GemmEpilogue{};
    run<Op::Gemm>(dev, DType::F32, plain);
  }
  const GemmEpilogue& ep = a.epilogue;
  if (ep.relu_y)
    run<Op::Binary>(dev, DType::F32, {BinaryOp::ReluBackward, rows_by_cols(a.m, a.n, a.n), c, ep.relu_y, c});
  if (ep.bias) run<Op::Binary>(dev, DType::F32, {BinaryOp::Add, rows_by_cols(a.m, a.n, 0), c, ep.bias, c});
  if (ep.relu) run<Op::Unary>(dev, DType::F32, {UnaryOp::Relu, c, c, mn});
}

bool Backend::max_pool2d_byte_winners(const Pool2dShape&) const { return false; }

std::string Backend::attention_shape_misfit(Device, const AttentionShape&) const { return ""; }

std::array<ConvPass, 3> Backend::conv_passes(Device, const Conv2dShape&, DType) { return {}; }

void check_attention_args(const char* op, DType dt, const AttentionShape& s, const AttentionMask& mask,
                          const AttentionDropout& drop) {
  DP_CHECK(s.B >= 0 && s.H >= 1 && s.L >= 0 && s.S >= 0 && s.E >= 1 && s.Ev >= 1, op,
           ": expected B >= 0, H >= 1, L >= 0, S >= 0, E >= 1 and Ev >= 1, got B=", s.B, " H=", s.H, " L=", s.L,
           " S=", s.S, " E=", s.E, " Ev=", s.Ev);
  DP_CHECK(!mask.p || mask.dtype == DType::F32 || mask.dtype == dt, op, ": expected a float32 or ", dtype_name(dt),
           " mask, got a ", dtype_name(mask.dtype), " one");
  DP_CHECK(drop.p >= 0.0f && drop.p < 1.0f, op, ": expected a dropout probability in [0, 1), got ", drop.p);
}

std::int64_t max_pool2d_winner_bytes(const Backend& be, const Pool2dShape& s) {
  const std::int64_t outputs = s.N * s.C * s.P * s.Q;
  return be.max_pool2d_byte_winners(s) ? outputs : outputs * static_cast<std::int64_t>(sizeof(std::int64_t));
}

namespace {

/// Bytes of one element of a floating dtype.
std::size_t float_size(DType dt) { return dt == DType::F32 ? 4 : 2; }

/// A block of the device's memory for the duration of a by-ops call. On CUDA it is
/// freed once the ops are enqueued: a block freed on a stream is reused only by work
/// enqueued after them (Note [Caching allocator streams]).
class Scratch {
 public:
  Scratch(Backend& be, Device dev, std::size_t nbytes)
      : be_(be), dev_(dev), nbytes_(std::max<std::size_t>(nbytes, 1)), p_(be.allocate(dev, nbytes_)) {}
  ~Scratch() { be_.deallocate(dev_, p_, nbytes_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return p_; }

 private:
  Backend& be_;
  Device dev_;
  std::size_t nbytes_;
  void* p_;
};

}  // namespace

void check_conv_pool_layout(const Conv2dShape& s, bool pool) {
  DP_CHECK(!pool || !s.channels_last, "conv2d: a convolution with its max-pool takes NCHW tensors, got a "
           "channels-last call (nn pools a channels-last output as an op of its own)");
}

void Backend::conv2d_pool_by_ops(Device dev, DType dt, const Conv2dArgs& a) {
  const Conv2dShape& s = a.s;
  check_conv_pool_layout(s, a.pool.on);
  Scratch conv(*this, dev, static_cast<std::size_t>(s.N * s.K * s.P * s.Q) * float_size(dt));
  Conv2dArgs plain = a;
  plain.y = conv.get();
  plain.pool = ConvPool{};
  run<Op::Conv2d>(dev, dt, plain);
  run<Op::MaxPool2d>(dev, dt, {a.pool.s, conv.get(), a.y, a.pool.winners});
}

void Backend::max_pool2d_backward_by_ops(Device dev, DType dt, const MaxPool2dBackwardArgs& a) {
  const Pool2dShape& s = a.s;
  const std::int64_t n = s.N * s.C * s.P * s.Q;
  Scratch masked(*this, dev, static_cast<std::size_t>(n) * float_size(dt));
  Indexer flat;
  flat.ndim = 1;
  flat.sizes[0] = n;
  flat.strides_a[0] = flat.strides_b[0] = 1;
  run<Op::Binary>(dev, dt, {BinaryOp::ReluBackward, flat, a.gy, a.relu_y, masked.get()});
  run<Op::MaxPool2dBackward>(dev, dt, {s, masked.get(), a.winners, nullptr, a.gx});
}

void check_conv2d_backward(const Conv2dBackwardArgs& a) {
  const Conv2dShape& s = a.s;
  DP_CHECK(a.gbias == nullptr || a.gw != nullptr,
           "conv2d_backward: expected the weight gradient with the bias gradient (gbias needs gw), got gw null");
  if (!a.pool.on) return;
  check_conv_pool_layout(s, true);
  const Pool2dShape& p = a.pool.s;
  DP_CHECK(p.N == s.N && p.C == s.K && p.H == s.P && p.W == s.Q, "conv2d_backward: expected a max-pool over the "
           "convolution's output (N, K, P, Q) = (", s.N, ", ", s.K, ", ", s.P, ", ", s.Q, "), got one over (", p.N, ", ",
           p.C, ", ", p.H, ", ", p.W, ")");
  DP_CHECK(a.pool.winners != nullptr, "conv2d_backward: expected the max-pool's winners, got none");
}

void Backend::conv2d_backward_by_ops(Device dev, DType dt, const Conv2dBackwardArgs& a) {
  check_conv2d_backward(a);
  const Conv2dShape& s = a.s;
  const void* gy = a.gy;
  std::optional<Scratch> routed;
  if (a.pool.on) {
    // A backend whose Conv2d pools a 16-bit output in float32 (CUDA) has no 16-bit pool
    // backward; nn runs such a pool as an op of its own, so it never asks for this.
    DP_CHECK(supports(Op::MaxPool2dBackward, dt), "conv2d_backward: a max-pool before a ", dtype_name(dt),
             " convolution's backward needs maxpool2d_backward in ", dtype_name(dt), " on ",
             type() == DeviceType::CPU ? "cpu" : "cuda", ", which has none; run the pool as its own op");
    routed.emplace(*this, dev, static_cast<std::size_t>(s.N * s.K * s.P * s.Q) * float_size(dt));
    run<Op::MaxPool2dBackward>(dev, dt, {a.pool.s, a.gy, a.pool.winners, a.pool.relu_y, routed->get()});
    gy = routed->get();
  }
  if (a.gx != nullptr) run<Op::Conv2dBackwardData>(dev, dt, {s, gy, a.w, a.gx});
  if (a.gw != nullptr) run<Op::Conv2dBackwardWeight>(dev, dt, {s, a.x, gy, a.gw, a.gbias});
}

void Backend::register_kernel(Op op, DType dt, KernelFn fn) {
  DP_ASSERT(op < Op::kCount && dt < DType::kCount, "register_kernel: op ", static_cast<int>(op), " or dtype ",
            static_cast<int>(dt), " out of range");
  kernels_[static_cast<int>(op)][static_cast<int>(dt)] = fn;
}

void Backend::missing_kernel(Op op, DType dt) const {
  std::string have;
  if (op < Op::kCount)
    for (int d = 0; d < kDTypeCount; ++d)
      if (kernels_[static_cast<int>(op)][d] != nullptr)
        have += detail::str_cat(have.empty() ? "" : ", ", dtype_name(static_cast<DType>(d)));
  const char* device_type = type() == DeviceType::CPU ? "cpu" : "cuda";
  DP_FAIL("backend op ", op_name(op), " has no ", dtype_name(dt), " kernel on ", device_type,
          " devices (", have.empty() ? "no dtype has one" : "it has " + have,
          "); convert the tensors to a supported dtype, or register a kernel for the pair");
}

// ---- profiler ranges (Note [Profiler ranges]) ---------------------------------------

bool parse_ranges_flag(const char* value) {
  if (value == nullptr || *value == '\0' || std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  dp::detail::log_warning(dp::detail::str_cat("DP_NVTX=\"", value,
                                              "\" is not 0 or 1: profiler ranges stay off (set DP_NVTX=1 to name "
                                              "dp's phases and collectives in nsys)"));
  return false;
}

// Dynamic initialisation: code running before libdp's initialisers sees ranges off.
std::atomic<bool> profiler_ranges_on{parse_ranges_flag(std::getenv("DP_NVTX"))};

void set_ranges_enabled(bool on) noexcept { profiler_ranges_on.store(on, std::memory_order_relaxed); }

namespace {
std::atomic<RangeObserver*> range_observer{nullptr};
}  // namespace

void set_range_observer(RangeObserver* observer) noexcept {
  range_observer.store(observer, std::memory_order_release);
}

void ScopedRange::open(Device dev, const char* name) {
  if (RangeObserver* o = range_observer.load(std::memory_order_acquire))
    o->push(dev, name);
  else
    get(dev).range_push(dev, name);
  dev_ = dev;
  open_ = true;
}

void ScopedRange::open_sized(Device dev, const char* who, const char* what, std::size_t nbytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double size = static_cast<double>(nbytes);
  int unit = 0;
  while (size >= 1024.0 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    size /= 1024.0;
    ++unit;
  }
  char name[128];  // "<who> <what> <size>": two short literals and a number
  if (unit == 0)
    std::snprintf(name, sizeof name, "%s %s %zu B", who, what, nbytes);
  else
    std::snprintf(name, sizeof name, "%s %s %.2f %s", who, what, size, kUnits[unit]);
  open(dev, name);
}

void ScopedRange::close() noexcept {
  if (RangeObserver* o = range_observer.load(std::memory_order_acquire))
    o->pop(dev_);
  else
    get(dev_).range_pop(dev_);
}

namespace {

// Note [Device runtime registration]
// Core answers dp::device_count(type), dp::memory_allocated(dev) and the other device
// queries through the runtimes registered here (core/device_runtime.h), so core never
// includes a backend: the arrow points from the backends down to core. The registrar
// runs while libdp is loaded, before any user code; nothing in dp asks core about
// devices from a static initialiser, and core's slots are constant-initialised, so the
// order of initialisation between translation units does not matter. The getters
// create a backend only when first asked: loading dp never touches the CUDA driver.
struct Registrar {
  Registrar() {
    dp::detail::register_device_runtime(
        DeviceType::CPU, []() -> dp::detail::DeviceRuntime& { return cpu_backend(); });
    dp::detail::register_device_runtime(
        DeviceType::CUDA, []() -> dp::detail::DeviceRuntime& { return cuda_backend(); });
  }
};
const Registrar registrar;

}  // namespace

// ---- copies ahead (Note [Copies ahead]) --------------------------------------------------

namespace {
/// The default: the bytes as they were when the copy started, in a block of the
/// destination, until they land or the copy is dropped.
struct SnapshotCopy final : PendingCopy {
  Backend* backend = nullptr;
  Device dst_dev;
  void* staging = nullptr;
  std::size_t nbytes = 0;
  bool done = false;
  ~SnapshotCopy() override {
    if (staging != nullptr) backend->deallocate(dst_dev, staging, nbytes);
  }
};
}  // namespace

std::unique_ptr<PendingCopy> Backend::copy_ahead(Device dst_dev, const void* src, Device src_dev, std::size_t nbytes) {
  auto p = std::make_unique<SnapshotCopy>();
  p->backend = this;
  p->dst_dev = dst_dev;
  p->staging = allocate(dst_dev, nbytes);
  p->nbytes = nbytes;
  copy(p->staging, dst_dev, src, src_dev, nbytes);
  return p;
}

void Backend::finish_copy(PendingCopy& pending, void* dst, Device dst_dev) {
  auto* p = dynamic_cast<SnapshotCopy*>(&pending);
  DP_CHECK(p != nullptr && p->backend == this, "finish_copy: the copy was not started by copy_ahead of this backend (",
           dst_dev, ")");
  DP_CHECK(p->dst_dev == dst_dev, "finish_copy: the copy was started towards ", p->dst_dev, ", not ", dst_dev);
  DP_CHECK(!p->done, "finish_copy: the copy to ", dst_dev, " was finished already");
  p->done = true;
  copy(dst, dst_dev, p->staging, dst_dev, p->nbytes);
  deallocate(dst_dev, std::exchange(p->staging, nullptr), p->nbytes);
}

namespace {
std::atomic<bool> poisoned_memory{[] {  // Note [Poisoned memory]
  const char* env = std::getenv("DP_POISON_MEMORY");
  return env != nullptr && std::string_view(env) == "1";
}()};
}  // namespace

void Backend::set_poison_memory(bool on) { poisoned_memory.store(on); }

bool Backend::poison_memory() { return poisoned_memory.load(std::memory_order_relaxed); }

void Backend::check_copy_rows(Device dev, std::size_t dst_pitch, std::size_t src_pitch, std::size_t row_bytes) {
  DP_CHECK(dst_pitch >= row_bytes && src_pitch >= row_bytes, "copy_rows on ", dev, ": expected pitches of at least ",
           row_bytes, " bytes (a row), got ", dst_pitch, " (dst) and ", src_pitch, " (src)");
}

void Backend::copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                        std::size_t row_bytes, std::size_t rows, Device dev) {
  check_copy_rows(dev, dst_pitch, src_pitch, row_bytes);
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  for (std::size_t r = 0; r < rows && row_bytes > 0; ++r) copy(d + r * dst_pitch, dev, s + r * src_pitch, dev, row_bytes);
}


// ---- CopyFences (Note [Copy fences]) ----------------------------------------------------

namespace {
thread_local const CopyFences* tl_fences = nullptr;
}  // namespace

CopyFences::CopyFences(const std::vector<Device>& devices) : devices_(devices) {
  for (const Device& d : devices_) events_.push_back(get(d).create_event(d));
}

CopyFences::~CopyFences() = default;

void CopyFences::record() {
  recorded_ = false;  // a record that fails half way leaves no stale fence in use
  for (std::size_t i = 0; i < devices_.size(); ++i) get(devices_[i]).record_event(*events_[i], devices_[i]);
  recorded_ = true;
}

Event* CopyFences::current(Device dev) {
  const CopyFences* f = tl_fences;
  if (f == nullptr || !f->recorded_) return nullptr;
  for (std::size_t i = 0; i < f->devices_.size(); ++i)
    if (f->devices_[i] == dev) return f->events_[i].get();
  return nullptr;
}

CopyFences::Scope::Scope(const CopyFences& fences) : prev_(tl_fences) { tl_fences = &fences; }
CopyFences::Scope::~Scope() { tl_fences = prev_; }

}  // namespace dp::backend
