// src/backend/backend.h — the one narrow interface every backend implements.
//
// The tensor, autograd, nn, optim, comm and parallel layers reach memory and compute
// only through this interface, so the DP/DDP runtime is written once and runs on CPU
// virtual devices and on CUDA devices alike. Kernels take raw pointers that live on
// `dev` plus explicit element counts (never byte counts, except in the memory calls
// whose names say `nbytes`). All float kernels are float32; indices are int64.
//
// Ordering: on CPU every call has finished when it returns. On CUDA every call is
// enqueued on the calling thread's current stream of `dev` (the device's default
// compute stream unless a CudaStreamGuard says otherwise; Note [CUDA streams of dp] in
// cuda/cuda_backend.h) and returns at once; copy_to_host and synchronize wait.
//
// This header is internal: public headers never include it and it never includes
// CUDA headers.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/ops.h"
#include "core/device_runtime.h"
#include "dp/core/device.h"

namespace dp::backend {

/// A 2x2, stride-2, unpadded pool whose windows all lie inside the input (2P <= H,
/// 2Q <= W): non-overlapping windows that tile the input but for an odd last row or
/// column — what the 2x2 max-pool kernels take.
inline bool is_2x2_tiling(const Pool2dShape& s) {
  return s.kernel_h == 2 && s.kernel_w == 2 && s.stride_h == 2 && s.stride_w == 2 && s.pad_h == 0 &&
         s.pad_w == 0 && 2 * s.P <= s.H && 2 * s.Q <= s.W;
}

class Backend;
/// Bytes of MaxPool2d's winners for shape `s` on backend `be` (Note [Max-pool winners]).
std::int64_t max_pool2d_winner_bytes(const Backend& be, const Pool2dShape& s);
/// Throws dp::Error unless a's pool (when on) is over the convolution's output and has
/// winners, and a bias gradient comes with the weight's: what every Conv2dBackward
/// kernel checks first.
void check_conv2d_backward(const Conv2dBackwardArgs& a);
/// Throws dp::Error for a channels-last convolution with its max-pool (`pool`): the
/// fused pool walks NCHW planes, so such a call is never made.
void check_conv_pool_layout(const Conv2dShape& s, bool pool);

/// Throws dp::Error unless a's batch fields are valid (GemmArgs in ops.h): batch >= 0,
/// non-negative strides, the Cs apart by at least one C, no epilogue on a batch.
void check_gemm_batch(const GemmArgs& a);
/// Throws dp::Error unless a 16-bit product's epilogue is a bias alone, written over a
/// contiguous C (beta 0; Note [16-bit Linear: the bias in the one rounding] in src/tensor/ops.cpp: its ReLU
/// is a separate op, which commutes with the rounding).
void check_16bit_epilogue(DType dt, const GemmArgs& a);
/// Matrix i of a batched `a` as a GemmArgs of its own (batch 1; GemmArgs in ops.h);
/// `elem` is the dtype's size in bytes.
inline GemmArgs gemm_matrix(const GemmArgs& a, std::size_t elem, std::int64_t i) {
  const auto e = static_cast<std::int64_t>(elem);
  GemmArgs m = a;
  m.batch = 1;
  m.a = static_cast<const char*>(a.a) + i * a.stride_a * e;
  m.b = static_cast<const char*>(a.b) + i * a.stride_b * e;
  m.c = static_cast<char*>(a.c) + i * a.stride_c * e;
  return m;
}

/// What every backend's AttentionForward / AttentionBackward kernel requires of its
/// arguments (AttentionForwardArgs in ops.h): a valid shape, no mask or a float32 one or
/// one of the call's dtype `dt`, a dropout probability in [0, 1). Throws dp::Error naming
/// `op` otherwise.
void check_attention_args(const char* op, DType dt, const AttentionShape& s, const AttentionMask& mask,
                          const AttentionDropout& drop);

/// How a backend runs one pass of a convolution, as far as it has chosen
/// (Backend::conv_passes): for diagnostics and tests.
struct ConvPass {
  enum class Path : std::uint8_t {
    Unknown,  // not run yet, or a backend that does not say
    Native,   // in the call's dtype (CUDA: a cuDNN algorithm for it)
    Widened,  // its operands widened to float32, the float32 pass, the outputs rounded
  };
  Path path = Path::Unknown;
  std::string detail;  // for people: "cuDNN bfloat16 algorithm 1, tensor-op math"
};

/// A non-owning reference to a callable f(begin, end): lets a virtual call take any
/// lambda without copying it or allocating (std::function may). Valid only during the
/// call it is passed to.
class RangeFn {
 public:
  template <typename F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, RangeFn>)
  RangeFn(F&& f)  // NOLINT(google-explicit-constructor): passed as a plain lambda
      : obj_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* obj, std::int64_t begin, std::int64_t end) {
          (*static_cast<std::remove_reference_t<F>*>(obj))(begin, end);
        }) {}
  void operator()(std::int64_t begin, std::int64_t end) const { call_(obj_, begin, end); }

 private:
  void* obj_;
  void (*call_)(void*, std::int64_t, std::int64_t);
};

/// Opaque event used to order work across streams (CUDA) — a no-op on CPU.
class Event {
 public:
  virtual ~Event() = default;
};

/// A copy started by Backend::copy_ahead, to be finished by Backend::finish_copy or
/// dropped (Note [Copies ahead]). Destroying it never throws.
class PendingCopy {
 public:
  virtual ~PendingCopy() = default;
};

/// The backend interface. One instance per DeviceType, shared by all threads:
/// implementations are thread-safe for calls on different devices and for calls on
/// one device from one thread at a time. A backend is also the DeviceRuntime through
/// which core answers dp::device_count(type) and the memory queries (Note [Device
/// runtime registration] in backend.cpp).
///
/// Compute goes through the kernel table: run<Op::X>(dev, dtype, args) with the ops of
/// DP_BACKEND_OPS (Note [The op list] in ops.h); the virtual methods are devices,
/// memory, streams, events and copies, and the compute entries not yet in the list.
/// Every kernel has cases in the backend op table (tests/backend/op_cases.cpp), which
/// compare it with the CPU backend and benchmark it: op_table_test fails for a
/// registered (op, dtype) without a case. A new method does not compile in
/// tests/backend/op_table_test.cpp until it is forwarded there; a new kernel then needs
/// a dp_test::Kernel value and a case, or op_table_test fails.
class Backend : public dp::detail::DeviceRuntime {
 public:
  ~Backend() override = default;

  virtual DeviceType type() const = 0;
  /// Devices of this type; 0 when none can be used (never throws).
  int device_count() override = 0;

  // ---- threads and streams -------------------------------------------------------
  /// Binds the calling thread to `dev` (cudaSetDevice; a no-op on CPU).
  virtual void set_current_device(Device dev) = 0;
  /// Tells the backend which devices work concurrently, so each gets a fair share of
  /// the cores (CPU: sizes each device's task arena to max(1, cores / count)). Must
  /// not be called while a kernel runs on any of them.
  virtual void set_concurrent_devices(int count) = 0;
  /// A wrapper over `count` devices of this type comes (hold) or goes (release): the
  /// devices get set_concurrent_devices(the largest count held), or 1 once none is
  /// held (Note [Concurrent devices of live wrappers]). Throws dp::Error for a count
  /// below 1 or a release of a count not held.
  void hold_concurrent_devices(int count);
  void release_concurrent_devices(int count);
  /// Threads one kernel on `dev` may use now (CPU arena size; 0 = not meaningful).
  virtual int threads_per_device(Device dev) = 0;
  /// Runs host code f(begin, end) over disjoint ranges covering [0, n) with the host
  /// threads that work for `dev` may use, for layers above that do host-side work on a
  /// device's behalf (the local communicator's reductions and copies). CPU: inside the
  /// device's task arena, so N devices never oversubscribe the cores, and serially on
  /// the calling thread for small n. CUDA: f(0, n) on the calling thread. The split
  /// depends on scheduling: use it only where every element is computed independently
  /// of it. Returns when every range has run; rethrows what f throws.
  virtual void host_parallel_for(Device dev, std::int64_t n, RangeFn f) = 0;
  /// Waits until all work enqueued on `dev` by any thread has finished.
  virtual void synchronize(Device dev) = 0;
  virtual std::unique_ptr<Event> create_event(Device dev) = 0;
  /// Records `ev` on the calling thread's current stream of `dev`.
  virtual void record_event(Event& ev, Device dev) = 0;
  /// Makes the calling thread's current stream of `dev` wait for `ev` (no host wait).
  virtual void wait_event(Event& ev, Device dev) = 0;

  // ---- profiler ranges (Note [Profiler ranges]) -------------------------------------
  /// Opens a named range on the calling thread (CUDA: nvtxRangePushA; CPU: nothing).
  /// `name` is copied. Called through ScopedRange, which skips it when ranges are off.
  virtual void range_push(Device dev, const char* name) = 0;
  /// Closes the calling thread's innermost range. Never throws.
  virtual void range_pop(Device dev) noexcept = 0;

  // ---- memory --------------------------------------------------------------------
  /// Allocates `nbytes` (aligned to 64 bytes at least) on `dev`. CUDA: from the
  /// device's caching allocator. Throws dp::Error on out-of-memory naming the device.
  virtual void* allocate(Device dev, std::size_t nbytes) = 0;
  virtual void deallocate(Device dev, void* ptr, std::size_t nbytes) noexcept = 0;
  /// Bytes currently allocated to tensors on `dev`, and the peak since reset.
  std::size_t memory_allocated(Device dev) override = 0;
  std::size_t max_memory_allocated(Device dev) override = 0;
  void reset_peak_memory(Device dev) override = 0;

  // ---- pinned host memory -----------------------------------------------------------
  /// Allocates `nbytes` (64-byte aligned at least) of page-locked host memory that this
  /// backend's devices copy from asynchronously. CUDA: from a caching allocator of
  /// cudaHostAlloc'ed blocks shared by every device; CPU: host memory, which virtual
  /// devices read directly. Throws dp::Error when the memory cannot be had.
  virtual void* allocate_pinned(std::size_t nbytes) = 0;
  /// Returns memory from allocate_pinned. Safe right after enqueueing copies that read
  /// it: CUDA reuses the block only once those copies have finished (Note [Pinned
  /// block reuse] in backend/cuda/host_allocator.h). Never throws.
  virtual void deallocate_pinned(void* ptr, std::size_t nbytes) noexcept = 0;
  /// Bytes of pinned host memory handed out now.
  std::size_t pinned_memory_allocated() override = 0;

  /// Copies between two devices of this backend (peer copy), or within one device.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev,
                    std::size_t nbytes) = 0;
  /// Within one device: `rows` rows of `row_bytes` bytes, row r from src + r * src_pitch
  /// to dst + r * dst_pitch (pitches in bytes, each at least row_bytes; the rows must not
  /// overlap) — a narrow along an inner dim and its backward. The default is one copy()
  /// per row; the CPU spreads the rows over the device's threads, CUDA makes it one
  /// cudaMemcpy2DAsync (a copy per row was a runtime call per token in a GPT's split).
  virtual void copy_rows(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                         std::size_t row_bytes, std::size_t rows, Device dev);
  /// copy_rows' argument check, shared by every backend's: a dp::Error naming the pitches
  /// when either is shorter than a row.
  static void check_copy_rows(Device dev, std::size_t dst_pitch, std::size_t src_pitch, std::size_t row_bytes);
  /// Note [Poisoned memory]
  /// true: memory nothing has written yet reads as NaN, process-wide. Every backend fills
  /// each allocation of a device's memory with 0xFF bytes (NaN in float32 and the 16-bit
  /// types; -1 in the integer ones); the CPU fills each oneDNN convolution's and bfloat16
  /// matmul's scratchpad and outputs (a matmul's C where beta is 0) just before it runs.
  /// A kernel that reads what it never wrote then gives NaN on every run, where otherwise
  /// it gives whatever the memory held, right most of the time (Note [bf16 backward-weight
  /// on an image narrower than its stride] in cpu_conv.cpp: a bug that a scan without the
  /// fill saw in part). For tests and fuzzers; DP_POISON_MEMORY=1 starts a process with it
  /// on. Costs a fill per allocation and per primitive call.
  static void set_poison_memory(bool on);
  static bool poison_memory();
  /// Note [Copies ahead]
  /// copy() makes the destination's stream wait for the bytes at once: what the
  /// destination enqueues next runs after the transfer. A prefetch (ZeRO stage 3's
  /// next unit, Note [Sharded parameters]) must not: the destination computes the
  /// current unit while the next one arrives. copy_ahead() starts the transfer of
  /// `nbytes` from `src` (on `src_dev`) towards `dst_dev` and returns at once;
  /// finish_copy(p, dst) later puts the bytes into `dst` (on `dst_dev`, allocated by
  /// then), ordered after them on the destination's current stream. Dropping `p`
  /// unfinished cancels nothing already started and leaks nothing. The source bytes
  /// must not change until then (the source's stream is ordered after the transfer).
  /// The bytes landed are those `src` held when the copy started, on every backend:
  /// the default (CPU) copies them into a staging block of `dst_dev` at once (counted
  /// as the destination's memory until they land or the copy is dropped) and from
  /// there into `dst` at finish_copy — so the CPU tests see what a GPU would land,
  /// stale bytes included. CUDA transfers into a staging block on the destination's
  /// inbound stream at once (Note [Peer copies]) and copies staging → dst on the
  /// destination's stream at finish_copy; within one device it copies at finish_copy.
  virtual std::unique_ptr<PendingCopy> copy_ahead(Device dst_dev, const void* src, Device src_dev,
                                                  std::size_t nbytes);
  virtual void finish_copy(PendingCopy& p, void* dst, Device dst_dev);
  /// Host memory → `dev`. On CUDA enqueued on the current stream; from pinned memory
  /// (allocate_pinned, any offset) the host does not wait and the pinned block is kept
  /// from reuse until the copy has finished; from pageable memory the runtime stages
  /// the data before returning, so `host_src` may be reused at once.
  virtual void copy_from_host(void* dst, Device dev, const void* host_src, std::size_t nbytes) = 0;
  /// `dev` → host memory; returns when the data is on the host.
  virtual void copy_to_host(void* host_dst, const void* src, Device dev, std::size_t nbytes) = 0;
  virtual void memset_zero(void* ptr, Device dev, std::size_t nbytes) = 0;

  /// The Indexer of a binary op over a contiguous (m, n) `a` and a `b` whose rows lie
  /// b_row_stride apart (0: one row broadcast over all of a's).
  static Indexer rows_by_cols(std::int64_t m, std::int64_t n, std::int64_t b_row_stride) {
    Indexer ix;
    ix.ndim = 2;
    ix.sizes[0] = m;
    ix.sizes[1] = n;
    ix.strides_a[0] = n;
    ix.strides_a[1] = 1;
    ix.strides_b[0] = b_row_stride;
    ix.strides_b[1] = 1;
    return ix;
  }

  /// The Gemm op as separate ops: the GEMM without its epilogue (through the table),
  /// then Binary<ReluBackward> by relu_y, Binary<Add> of the bias and Unary<Relu>, each
  /// over all of C (ldc == n). What a backend without a fused epilogue runs, and what
  /// the fused ones are tested against, bit for bit.
  void gemm_epilogue_by_ops(Device dev, const GemmArgs& a);

  /// Whether MaxPool2d records the winners of shape `s` as one byte per output (the
  /// place in a 2x2 window) rather than int64 flat indices (Note [Max-pool winners]).
  /// False here; a backend with the byte kernels says where it uses them.
  virtual bool max_pool2d_byte_winners(const Pool2dShape& s) const;

  /// Why this backend's AttentionForward / AttentionBackward kernels do not take a call
  /// of shape `s` on `dev` (a limit of the kernels': head dims, shared memory), or ""
  /// when they do; scaled_dot_product_attention then runs the math path (Note [Fused
  /// attention paths]). "" here: a backend whose kernels have limits says which.
  virtual std::string attention_shape_misfit(Device dev, const AttentionShape& s) const;

  /// How this backend has run the passes of a convolution of shape `s` in dtype `dt` on
  /// `dev` — forward, backward data, backward weight, in that order — under the current
  /// TF32 and benchmark settings (CUDA: the cuDNN algorithm chosen, or the widening of
  /// Note [16-bit convolutions on CUDA]). Unknown for a pass not run yet; all three here.
  virtual std::array<ConvPass, 3> conv_passes(Device dev, const Conv2dShape& s, DType dt);

  /// The Conv2d op with a pool (Conv2dArgs::pool) as separate ops: the convolution
  /// (with its ReLU) through the table into a block of the device, then MaxPool2d from
  /// it. What a backend without the fused path runs (Note [Fusions are the backend's]).
  void conv2d_pool_by_ops(Device dev, DType dt, const Conv2dArgs& a);
  /// MaxPool2dBackward with relu_y as separate ops: Binary<ReluBackward>(gy, relu_y)
  /// into a block of the device, then the backward without the mask.
  void max_pool2d_backward_by_ops(Device dev, DType dt, const MaxPool2dBackwardArgs& a);
  /// The Conv2dBackward op as the ops it stands for: MaxPool2dBackward (with the mask)
  /// into a block of the device when pool.on, then Conv2dBackwardData when gx is set and
  /// Conv2dBackwardWeight when gw is. What a backend without a shared path runs.
  void conv2d_backward_by_ops(Device dev, DType dt, const Conv2dBackwardArgs& a);

  /// Counts non-finite values of x (for the opt-in NaN/Inf check). Synchronous.
  std::int64_t count_nonfinite(Device dev, const float* x, std::int64_t n) {
    std::int64_t count = 0;
    run<Op::CountNonfinite>(dev, DType::F32, {x, n, &count});
    return count;
  }

  // ---- the kernel table (Note [The op list] in ops.h) --------------------------------
  /// A registered kernel: `args` points to the OpArgs of its op; `dt` is the dtype it
  /// was called with (a kernel registered for several dtypes may read it).
  using KernelFn = void (*)(Backend& be, Device dev, DType dt, const void* args);

  /// Runs op on `dev` with element type `dt`: one table lookup and one indirect call.
  /// Throws dp::Error naming the op, the dtype and the device type when this backend
  /// has no kernel for the pair.
  template <Op op>
  void run(Device dev, DType dt, const OpArgs<op>& args) {
    launch(op, dt, dev, &args);
  }
  /// run() with the op known only at run time; `args` points to its OpArgs.
  void launch(Op op, DType dt, Device dev, const void* args) {
    const KernelFn fn = kernel(op, dt);
    if (fn == nullptr) missing_kernel(op, dt);
    fn(*this, dev, dt, args);
  }
  /// The kernel registered for (op, dt), or null.
  KernelFn kernel(Op op, DType dt) const {
    const auto o = static_cast<unsigned>(op), d = static_cast<unsigned>(dt);
    return o < static_cast<unsigned>(kOpCount) && d < static_cast<unsigned>(kDTypeCount) ? kernels_[o][d]
                                                                                          : nullptr;
  }
  /// Whether (op, dt) has a kernel here.
  bool supports(Op op, DType dt) const { return kernel(op, dt) != nullptr; }

 protected:
  /// Registers fn for (op, dt), replacing what was there (backends call this from their
  /// constructors; a test's wrapping backend may install its own).
  void register_kernel(Op op, DType dt, KernelFn fn);
  /// Registers the typed kernel F(B&, Device, const OpArgs<op>&) of backend type B for
  /// (op, dt):
  ///   register_typed<Op::Unary, CpuBackend, &cpu::unary<float>>(DType::F32);
  template <Op op, typename B, void (*F)(B&, Device, const OpArgs<op>&)>
  void register_typed(DType dt) {
    register_kernel(op, dt, [](Backend& be, Device dev, DType, const void* args) {
      F(static_cast<B&>(be), dev, *static_cast<const OpArgs<op>*>(args));
    });
  }
  /// Throws the error of a call with no kernel: op, dtype, device type and the dtypes
  /// that op has here. A backend may say more (the stub: how to get CUDA).
  [[noreturn]] virtual void missing_kernel(Op op, DType dt) const;

 private:
  KernelFn kernels_[kOpCount][kDTypeCount] = {};
  std::mutex holds_mu_;
  std::multiset<int> holds_;  // the device counts of the live wrappers
};

// Note [Profiler ranges]
// dp names its phases and collectives for a profiler's timeline: with DP_NVTX=1 in the
// environment (read once, when libdp is loaded) or after set_ranges_enabled(true),
// every PhaseTimer (forward, backward, reduce, step, ...: src/parallel/phase_timer.h)
// opens a range named after its phase on the worker's thread, and the NCCL and CUDA
// copy communicators open one around each collective, named with the collective and
// its size ("nccl all_reduce 4.00 MiB", "cuda-copy reduce 512.00 KiB"). On CUDA a
// range is an NVTX range (nvtx3, header-only in the toolkit) in the domain "dp", so
//   DP_NVTX=1 nsys profile -t cuda,nvtx,osrt -o dp_step ./train ...
// shows them as rows of each worker thread above its kernels; `nsys stats -r
// nvtx_sum dp_step.nsys-rep` totals them. Without a profiler attached the NVTX calls
// return at once. On CPU ranges do nothing (the Chrome trace, DataParallel's
// enable_trace, shows CPU phases). When ranges are off, which is the default, a range
// costs one relaxed load of a flag and one branch that is never taken (no string is
// built, no virtual call made): cheap enough to leave in every collective.
// A range is opened and closed on one thread (NVTX ranges are per thread), which
// ScopedRange's scope guarantees.

/// The switch of Note [Profiler ranges]; false until libdp's initialisation reads DP_NVTX.
extern std::atomic<bool> profiler_ranges_on;

/// Whether ranges are on (Note [Profiler ranges]).
inline bool ranges_enabled() noexcept { return profiler_ranges_on.load(std::memory_order_relaxed); }
/// Turns ranges on or off for the whole process; ranges open at the call still close.
void set_ranges_enabled(bool on) noexcept;
/// DP_NVTX's meaning: unset, "" or "0" off, "1" on; anything else is off with a warning
/// naming the value.
bool parse_ranges_flag(const char* value);

/// Receives ranges instead of the backends while installed (tests): push(dev, name),
/// pop(dev), on the thread that opened the range.
class RangeObserver {
 public:
  virtual ~RangeObserver() = default;
  virtual void push(Device dev, const char* name) = 0;
  virtual void pop(Device dev) noexcept = 0;
};
/// Installs `observer` (null: the backends again). Not while a range is open.
void set_range_observer(RangeObserver* observer) noexcept;

/// One range on the calling thread, from construction to destruction, when ranges are
/// on (Note [Profiler ranges]); nothing otherwise.
///   { backend::ScopedRange r(dev, "nccl", "all_reduce", nbytes); enqueue(...); }
class ScopedRange {
 public:
  /// A range called `name` (a string that outlives the push: it is copied there).
  ScopedRange(Device dev, const char* name) {
    if (ranges_enabled()) open(dev, name);
  }
  /// A range called "<who> <what> <size>", the size in B, KiB, MiB or GiB.
  ScopedRange(Device dev, const char* who, const char* what, std::size_t nbytes) {
    if (ranges_enabled()) open_sized(dev, who, what, nbytes);
  }
  ~ScopedRange() {
    if (open_) close();
  }
  ScopedRange(const ScopedRange&) = delete;
  ScopedRange& operator=(const ScopedRange&) = delete;

 private:
  void open(Device dev, const char* name);
  void open_sized(Device dev, const char* who, const char* what, std::size_t nbytes);
  void close() noexcept;

  Device dev_{};
  bool open_ = false;
};

// Note [Copy fences]
// A copy between two CUDA devices orders itself after the source's producer by an
// event recorded on the source's current stream when the copy is called (Note [Peer
// copies] in cuda/cuda_backend.cpp). Inside a step that is too late a point: by then
// the source's stream may also hold a wait for a collective — a plain one, or join()
// of deferred ones, or a Sharded bucket's reduce — whose completion needs the
// destination's own collective, which the destination issues only after the work
// that follows the copy. The copy then waits for the collective, the collective for
// the destination's stream, and that stream for the copy: every GPU involved hangs
// until the NCCL watchdog aborts the step. It happens whenever one worker is ahead of
// another, e.g. device 0 has enqueued its whole forward, backward and join() before
// worker r copies its shard of a batch that lies on device 0, or pulls (ZeRO stage 3,
// Note [Sharded parameters]) a unit from owner 0.
// The data that workers copy between devices during a step — the batch, the gradient
// pieces of the gathered output, the owners' parameter ranges — were all written
// before the step began. So DataParallel records a CopyFences at the start of each
// step's run, on the calling thread (every worker idle, everything that wrote those
// data enqueued), and wraps those copies in a CopyFences::Scope: a copy from a
// fenced device then orders after the source's fence instead of after the source's
// current position, which holds no work of this step and hence no wait for any of
// its collectives. Copies outside a scope (a user's module moving its own tensors,
// gathers on the calling thread after the workers returned) keep the current-position
// rule. On CPU copies are synchronous and fences are never consulted.

/// Per-device points after which the sources of scoped copies are not written (Note
/// [Copy fences]). One thread records; any thread may read inside a Scope.
///   CopyFences fences(devices);   // once
///   fences.record();              // calling thread, at the start of every step
///   { CopyFences::Scope s(fences); dst.copy_(src_on_other_device); }   // a worker
class CopyFences {
 public:
  /// One event per device (created now), none recorded yet.
  explicit CopyFences(const std::vector<Device>& devices);
  ~CopyFences();
  CopyFences(const CopyFences&) = delete;
  CopyFences& operator=(const CopyFences&) = delete;
  /// Records every device's fence on the calling thread's current stream of it.
  void record();
  /// The fence of `dev` in the calling thread's innermost Scope: null when there is
  /// no scope, `dev` is not fenced, or its fence was never recorded.
  static Event* current(Device dev);

  /// Makes `fences` the calling thread's for the scope's lifetime (nests).
  class Scope {
   public:
    explicit Scope(const CopyFences& fences);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const CopyFences* prev_;
  };

 private:
  std::vector<Device> devices_;
  std::vector<std::unique_ptr<Event>> events_;
  bool recorded_ = false;
};

/// The backend of a device type. CUDA without the toolkit, or without a device,
/// returns a backend whose device_count() is 0 and whose other calls throw dp::Error.
Backend& get(DeviceType type);
inline Backend& get(Device dev) { return get(dev.type); }
/// The backend that pins host memory for this process: CUDA when a device is
/// visible (so CUDA copies from it are asynchronous), else the CPU backend.
Backend& pinned_host_backend();

}  // namespace dp::backend
