// dp/tensor/tensor.h — the n-dimensional array every layer above works with.
//
// A Tensor is a shared handle to a contiguous block of one device's memory with a
// shape, a dtype (float32, int64 or int32) and, when it takes part in autograd, a gradient
// and the function that made it. Every op checks that its inputs live on one device
// and have compatible shapes and dtypes, and throws dp::Error naming both otherwise.
// This header knows nothing about modules, optimizers or DataParallel.
//
//   dp::Tensor x = dp::randn({64, 784}, gen, dp::cpu(1));
//   dp::Tensor w = dp::zeros({784, 10}, dp::cpu(1)).set_requires_grad(true);
//   dp::Tensor loss = dp::matmul(x, w).relu().mean();  loss.backward();  // w.grad()
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "dp/core/device.h"
#include "dp/core/half.h"

namespace dp {

namespace autograd {
class Node;
struct AutogradMeta;
}  // namespace autograd

/// Element types. Float32 for data and parameters, Int64 for labels and indices.
/// Int32 holds labels as many datasets store them: every label consumer (cross_entropy,
/// nll_loss, one_hot, eq, index_select, TensorDataset) takes int32 with the same results
/// as int64; other ops say they expect a floating dtype or int64. BFloat16 and Float16
/// are the 16-bit floating dtypes of mixed precision (Note [16-bit tensors]). `to(Dtype)`
/// converts between all five:
///   dp::Tensor y = dp::from_vector(std::vector<std::int32_t>{3, 0, 1}, {3});
///   dp::Tensor loss = dp::nn::cross_entropy(logits, y);   // same as with y.to(Int64)
///   dp::Tensor h = x.to(dp::Dtype::BFloat16);             // PyTorch's bits
enum class Dtype : std::uint8_t { Float32 = 0, Int64 = 1, Int32 = 2, BFloat16 = 3, Float16 = 4 };
/// True for Float32, BFloat16 and Float16.
constexpr bool is_floating_point(Dtype dtype) {
  return dtype == Dtype::Float32 || dtype == Dtype::BFloat16 || dtype == Dtype::Float16;
}

// Note [16-bit tensors]
// A BFloat16 or Float16 tensor stores dp::BFloat16 / dp::Float16 (dp/core/half.h) and
// computes as PyTorch's CPU tensors of those dtypes do: every elementwise op widens its
// inputs to float32, computes in float32 and rounds its result once to the tensor's dtype
// (round to nearest even), so a single op (+, -, *, /, exp, ...) gives PyTorch's bits.
// Measured over every finite bfloat16 input against PyTorch 2.15 on 2026-11-29
// (scripts/op_fuzz.py --bf16-bits): neg, abs, relu, square, exp, log, sqrt, reciprocal,
// tanh, sigmoid, pow(x, 0.5 | 2 | -1), x * 0.7 and 1.5 - x give its bits at every input.
// Where they differ dp's result is the correctly rounded one (checked against
// double-precision values) and PyTorch rounds an intermediate: erf at 44 % of the inputs,
// 1.5 / x at 31 %, pow(x, 3) at 11 %, x + 0.7 at 1 % (PyTorch rounds the scalar to
// bfloat16 first). Exact gelu differs at 1.1 % (PyTorch computes 1 + erf(x/√2), which
// cancels for negative x; dp takes erfc(-x/√2) there, Note [Fused GELU]; 0.8 % on
// 2026-11-29, when dp cancelled too) and tanh-gelu at 4 inputs (large negative x:
// PyTorch's tanh reaches -1, giving -0). Sums, means and products of matrices accumulate in float32 and round once
// at the end, a Linear's or a convolution's bias inside that rounding: on inputs whose sums are exact in any order,
// means, sums, products, linear, conv2d, softmax, layer and batch norm, mse_loss give PyTorch's bits, and
// log_softmax and cross_entropy the float64 value rounded once where PyTorch rounds the log-softmax first
// (scripts/make_half_ops_reference.py, half_tensor_test).
// An op given float32 and 16-bit operands computes in float32 and returns float32 (the
// wider dtype, as PyTorch promotes); two different 16-bit dtypes promote to float32 too.
// Gradients have their tensor's dtype; to(dtype) between floating dtypes is
// differentiable (its gradient is converted back), which is how autocast's casts reach
// float32 parameters (dp/amp/autocast.h).
std::size_t element_size(Dtype dtype);
const char* dtype_name(Dtype dtype);

/// A shape: sizes per dimension, outermost first.
using Shape = std::vector<std::int64_t>;
std::string shape_str(const Shape& shape);  // "[64, 1, 28, 28]"
std::int64_t shape_numel(const Shape& shape);

// Note [Contiguous tensors]
// Every dp tensor is contiguous in row-major order: shape, dtype and an element offset
// into its storage, no strides (one exception: a 4-d tensor may lie channels-last,
// Note [Channels-last tensors]). Views exist where that layout allows one — reshape/view,
// flatten, unsqueeze/squeeze, and narrow() along dim 0 (or after size-1 dims) — and share
// storage as PyTorch's do. Everything PyTorch returns as a strided view is materialised
// here: permute, transpose, t(), expand and narrow along a later dim each make a new
// contiguous tensor in one strided pass (one read and one write of the result's bytes),
// so writes into the result do not reach the source. What this buys: every kernel reads
// plain arrays, and contiguous() is free. What it costs: attention's head split
// (view + permute) copies q, k and v once per forward, which is what PyTorch's
// .contiguous() after permute costs too.

// Note [Writes into materialised views]
// PyTorch returns views from permute, transpose, t(), expand and narrow, so a write into
// the result changes the tensor they were called on: `out.narrow(1, off, n).copy_(part)`
// is how PyTorch code fills a column slice, `w.t().mul_(2)` scales w. dp materialises those
// results as copies (Note [Contiguous tensors]), where the same write would change only
// the copy and leave the source as it was: a silent wrong result for code written for
// PyTorch. So such a result remembers the op that made it (TensorImpl::copied_view), as
// do the views of it (reshape/view, flatten, unsqueeze/squeeze, detach, narrow along dim
// 0), and every in-place method (zero_, fill_, copy_, add_, mul_) and dp::nn::init
// function refuses to write into it with a dp::Error naming that op and what to do
// instead. contiguous() returns a handle without the mark: the copy alone, writable, as
// PyTorch's contiguous() of a strided view is a copy of its own. A gradient that
// autograd adopts as a .grad (Note [Adopting a gradient]) is dp's own and drops the mark.
// Reads, and every out-of-place op, are unaffected.

// Note [Storage versions]
// A Storage's version counts the writes into memory that other code may already hold:
// in-place ops, init, an optimizer's update, a load. DataParallel compares versions to
// decide when replicas must be refreshed from device 0 (Note [When replicas are
// refreshed] in src/parallel/design.cpp): a write that does not move the
// version leaves the replicas on stale values. Which accessor to write through:
//  - Tensor::data<T>() / raw_data(): for reading, or for filling a tensor this code has
//    just made and nobody else holds yet (an op's output). Never moves the version.
//  - Tensor::mutable_data<T>() / mutable_raw_data(): for writing into an existing
//    tensor in place. Moves the version when called, so take the pointer where the
//    write is made, after the checks that may throw.
//  - Storage::bump_version() by hand: only where the version must move once a write
//    has completed and not before. Optimizer::step_copy is the one case: a copy whose
//    update failed keeps its version, which is how DataParallel sees that the copies
//    were written unequally.

/// A block of memory on one device, shared by every tensor that views it. `version`
/// counts in-place writes through any view (Note [Storage versions]).
class Storage {
 public:
  /// Tag of the pinned-host-memory constructor.
  struct PinnedTag {};
  Storage(Device device, std::size_t nbytes);
  /// Page-locked host memory (device cpu(0)), the source of asynchronous copies to CUDA
  /// devices; from backend::pinned_host_backend().
  Storage(PinnedTag, std::size_t nbytes);
  /// Memory the caller owns (dp::from_blob): never freed by dp and not counted by
  /// memory_allocated; `deleter` (if set) is called with `data` once, when the storage
  /// dies. The caller has checked the arguments.
  Storage(Device device, void* data, std::size_t nbytes, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  /// True for page-locked host memory (Tensor::pin_memory).
  bool pinned() const { return pinned_; }
  /// True for memory wrapped by dp::from_blob.
  bool external() const { return external_; }
  std::uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  /// Moves the version, and the write epoch unless a GradientWriteScope is open on
  /// this thread. Atomic: threads may write disjoint slices of one storage in place at
  /// once (a comm thread editing a gradient bucket while its worker's backward adds
  /// into another parameter's .grad in the same flat buffer); readers compare versions
  /// after the step that made the writes has joined its threads.
  void bump_version() { bump_version(0, nbytes_); }
  /// The same for a write into bytes [begin, end) of the storage (a view's), which is
  /// what saved tensors ask about (written_since).
  void bump_version(std::size_t begin, std::size_t end);
  /// Counts the in-place writes, as the version does, except those the autograd engine
  /// makes into a leaf's .grad under a GradientWriteScope (it tracks those per leaf), and
  /// the reallocations of a released storage: a .grad zeroed at write epoch e still
  /// holds only +0 at epoch e unless its own leaf was written (Note [Gradients written
  /// over zeros] in src/autograd/node.cpp).
  std::uint64_t write_epoch() const { return write_epoch_.load(std::memory_order_relaxed); }
  /// True when a write into bytes [begin, end) moved the version past `version`:
  /// what autograd's saved tensors ask before backward reads them (Note [Saved tensors
  /// and in-place writes] in src/autograd/node.cpp). Exact for the latest writes; of
  /// older ones only that some range was written is kept, so it may say true for a
  /// range that was not. Writes made in an autograd::RefreshWriteScope are not counted.
  bool written_since(std::uint64_t version, std::size_t begin, std::size_t end) const {
    return find_write_since(version, begin, end).storage != nullptr;
  }
  /// Where written_since found its write: the storage written (this one, or one the
  /// bytes were moved to: note_move) and its version the write is counted from; a null
  /// storage when there was none.
  struct WriteSince {
    const Storage* storage = nullptr;
    std::uint64_t since = 0;
  };
  WriteSince find_write_since(std::uint64_t version, std::size_t begin, std::size_t end) const;
  /// Says that bytes [begin, end) of this storage were copied to `to` at byte to_begin,
  /// and that the tensors viewing them here now view them there (a module's parameters
  /// rebound into a flat buffer); `to_version` is to's version once the copies were made.
  /// A tensor saved from these bytes before the move then asks `to` about writes since
  /// (Note [Saved tensors and moved parameters] in src/autograd/node.cpp).
  void note_move(std::size_t begin, std::size_t end, std::shared_ptr<Storage> to, std::size_t to_begin,
                 std::uint64_t to_version);
  /// Says that a released storage was materialised and written again with exactly what
  /// it held when released (a re-gather from shards unwritten since): the writes since
  /// the release no longer count for written_since. Call once the refill is written;
  /// acts once per release.
  void refilled_unchanged();

  /// Note [Released storage]
  /// A storage's memory can be given back to the device's allocator while every
  /// tensor viewing it (autograd's saved tensors included) keeps its handle, and be
  /// allocated again later at the same handles (contents undefined until written):
  /// how DataParallel's sharded parameters (ZeRO stage 3) free a module's gathered
  /// parameters between uses. Reading or writing a released storage through a tensor
  /// is a dp::Error, never a dangling pointer. Not for pinned memory.
  void release();
  /// Allocates the memory of a released storage again; a no-op when it has memory.
  void materialize();
  bool released() const { return released_; }

 private:
  Device device_;
  std::size_t nbytes_;
  void* data_ = nullptr;
  std::atomic<std::uint64_t> version_{0};
  std::atomic<std::uint64_t> write_epoch_{0};
  // Note [Saved tensors and in-place writes]: the latest writes, oldest first, and the
  // newest version of those forgotten.
  struct RangeWrite {
    std::uint64_t version;
    std::size_t begin, end;
  };
  mutable std::mutex writes_mutex_;
  std::vector<RangeWrite> writes_;
  std::uint64_t forgotten_ = 0;
  // note_move's records: at = this storage's version that the move took.
  struct Move {
    std::uint64_t at;
    std::size_t begin, end;
    std::shared_ptr<Storage> to;
    std::size_t to_begin;
    std::uint64_t to_version;
  };
  std::vector<Move> moves_;
  std::uint64_t version_at_release_ = 0;
  bool refill_pending_ = false;
  bool pinned_ = false;
  bool external_ = false;
  std::function<void(void*)> deleter_;
  bool released_ = false;
};

/// How a tensor's elements lie in its storage (Note [Channels-last tensors]).
enum class MemoryFormat : std::uint8_t {
  Contiguous = 0,    // row-major in the order of the shape's dims
  ChannelsLast = 1,  // a 4-d [N, C, H, W] tensor laid out as N x H x W x C
};
const char* memory_format_name(MemoryFormat format);

// Note [Channels-last tensors]
// x.contiguous(dp::MemoryFormat::ChannelsLast) gives a 4-d tensor [N, C, H, W] whose
// elements lie as N x H x W x C: a pixel's channels side by side, the layout that
// oneDNN's AMX and cuDNN's tensor-core convolutions compute in (PyTorch's
// torch.channels_last). Its shape, values, indexing and autograd are those of the
// NCHW tensor it came from: only where the bytes lie differs, and results of every op
// are the same values either way. Which ops keep the layout and which read NCHW:
//  - elementwise ops whose operands all have it (relu, the scalar ops, casts, add and
//    the other binary ops of same-shape operands), clone, detach, to(device) and
//    narrow along dim 0 return channels-last results, computed over the bytes as they
//    lie;
//  - every other op reads the tensor as NCHW: the first such read makes an NCHW copy
//    (one transposing pass) that the tensor keeps until its bytes are written, and the
//    op returns contiguous results as it always does. So any op takes a channels-last
//    tensor and gives the values it gives for the NCHW one, at the cost of that copy;
//    reshape, view, flatten, unsqueeze and squeeze return contiguous tensors;
//  - in-place writes: zero_ and fill_ write the layout; any other in-place op into a
//    channels-last tensor is a dp::Error naming contiguous() (what it would write is
//    NCHW, which the layout would not see).
// contiguous() of a channels-last tensor is its NCHW copy (differentiable);
// is_contiguous(format) and suggest_memory_format() answer as PyTorch's do. A tensor
// whose two layouts are the same bytes (C == 1, or H == W == 1) is kept Contiguous.
// Internally, code that reads or writes the bytes as they lie takes
// detail::layout_data(t) (src/tensor/tensor_util.h); raw_data() and data<T>() give
// the NCHW values of a channels-last tensor, so a kernel that knows nothing of layouts
// reads the right values by construction. What it writes must be a tensor it made
// contiguous — empty(), zeros(), detail::contiguous_copy() — never a clone() or to() of
// its input, which keep the layout: written through data<T>(), such a copy would take
// the writes into its NCHW copy and lose them (index_add did, found by the op fuzzer's
// channels-last replay in its first hunt).

/// The shared state behind a Tensor handle (internal; reached through Tensor).
struct TensorImpl {
  std::shared_ptr<Storage> storage;
  std::int64_t offset = 0;  // in elements
  Shape shape;
  Dtype dtype = Dtype::Float32;
  /// Contiguous, or ChannelsLast for a 4-d tensor (Note [Channels-last tensors]).
  MemoryFormat memory_format = MemoryFormat::Contiguous;
  /// A channels-last tensor's NCHW copy and the storage version it was made at, made
  /// by the first read as NCHW (Tensor::raw_data), under nchw_mutex.
  std::mutex nchw_mutex;
  std::shared_ptr<Storage> nchw_copy;
  std::uint64_t nchw_version = 0;
  /// The op that made this tensor as a copy where PyTorch returns a view ("permute()",
  /// ...), or null: in-place writes into it are refused (Note [Writes into materialised views]).
  const char* copied_view = nullptr;
  std::unique_ptr<autograd::AutogradMeta> autograd;  // null until autograd touches it
  ~TensorImpl();
};

/// A seeded counter-based random generator (Philox): the same seed gives the same
/// numbers on every device and backend. Not thread-safe; give each thread its own.
class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0x5eed) : seed_(seed) {}
  std::uint64_t seed() const { return seed_; }
  std::uint64_t offset() const { return offset_; }
  /// Reserves n random numbers; returns the first counter.
  std::uint64_t advance(std::uint64_t n) {
    std::uint64_t first = offset_;
    offset_ += n;
    return first;
  }
  void set_state(std::uint64_t seed, std::uint64_t offset) { seed_ = seed; offset_ = offset; }

 private:
  std::uint64_t seed_;
  std::uint64_t offset_ = 0;
};

/// The process-wide default generator (seeded by manual_seed; not thread-safe).
Generator& default_generator();
void manual_seed(std::uint64_t seed);

/// A handle to a tensor. Copies share data (like torch.Tensor); use clone() to copy.
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  const Shape& sizes() const { return shape(); }
  std::int64_t dim() const;
  /// Size of dimension d; negative d counts from the end.
  std::int64_t size(std::int64_t d) const;
  std::int64_t numel() const;
  Dtype dtype() const;
  Device device() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype()); }

  /// Raw pointer to the first element on the tensor's device. Checks the dtype. For
  /// reading, or for filling a tensor nobody else holds yet; it does not move the
  /// storage version, so in-place writes use mutable_data (Note [Storage versions]).
  template <typename T>
  T* data() const;
  void* raw_data() const;
  /// The same pointer, for writing into this tensor in place: checks the dtype, then
  /// bumps the storage version, so that copies keyed on it (DataParallel's replicas)
  /// see the write. Take it where the write is made (Note [Storage versions]).
  /// A channels-last tensor is written through detail::mutable_layout_data instead: here
  /// it is a dp::Error (Note [Channels-last tensors]).
  template <typename T>
  T* mutable_data() const {
    static_assert(!std::is_const_v<T>, "mutable_data is for writing; read through data<const T>()");
    check_nchw_writable();
    T* p = data<T>();
    note_write();
    return p;
  }
  void* mutable_raw_data() const {
    check_nchw_writable();
    void* p = raw_data();
    note_write();
    return p;
  }
  /// Throws dp::Error for a channels-last tensor, whose bytes an NCHW write would miss
  /// (Note [Channels-last tensors]); what the mutable accessors check first.
  void check_nchw_writable() const;
  /// Moves the storage version for a write into this tensor's bytes (what mutable_data
  /// does): for writes made through data() where the version must move only once they
  /// are done (Note [Storage versions]).
  void note_write() const;
  const std::shared_ptr<Storage>& storage() const;
  std::int64_t storage_offset() const;
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  /// True when both handles share one TensorImpl.
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  // ---- host access (synchronous) --------------------------------------------------
  /// The values as floats: a float32 tensor's, or a 16-bit one's widened (exactly).
  std::vector<float> to_vector() const;
  std::vector<std::int64_t> to_vector_i64() const;
  std::vector<std::int32_t> to_vector_i32() const;
  /// The single element as a double (any dtype). Throws unless numel() == 1.
  double item() const;
  /// The single element as T, as libtorch's item<T>(): float, double, std::int64_t,
  /// std::int32_t or bool (true when non-zero). An int64 tensor's element reaches
  /// item<std::int64_t>() exactly; a float converts as static_cast would, except that a
  /// NaN, an infinity or a value out of T's range is a dp::Error. Throws dp::Error
  /// unless numel() == 1.
  ///   std::int64_t correct = (out.argmax(1) == y).sum().item<std::int64_t>();
  template <typename T>
  T item() const {
    // Only the specialisations below exist: any other T is a compile error here,
    // not an undefined symbol at link time.
    static_assert(sizeof(T) == 0, "item<T>(): T must be float, double, std::int64_t, std::int32_t or bool");
    return T();
  }

  // ---- devices, copies, views ------------------------------------------------------
  /// A copy on `device` (differentiable); returns *this when already there.
  Tensor to(Device device) const;
  /// A copy converted to `dtype`, between any two of float32, bfloat16, float16, int64
  /// and int32. Floats round to a 16-bit dtype to nearest even with PyTorch's bits
  /// (Note [16-bit tensors]); float to integer truncates toward zero; int64 to int32
  /// keeps the low 32 bits (as PyTorch's .int()). Differentiable between floating
  /// dtypes (the gradient is converted back to this tensor's dtype). Returns *this when
  /// the dtype is already `dtype`.
  Tensor to(Dtype dtype) const;
  /// A copy in pinned (page-locked) host memory, like torch's pin_memory(): copies
  /// from it to a CUDA device do not make the host wait, so a DataLoader can stage the
  /// next batch while the devices compute. Returns *this when already pinned; throws
  /// dp::Error for a tensor that is not on the CPU. Not differentiable.
  Tensor pin_memory() const;
  /// True when the tensor's memory is pinned host memory.
  bool is_pinned() const;
  Tensor clone() const;
  /// Same data, no autograd history.
  Tensor detach() const;
  /// A view with a new shape (one -1 allowed). Differentiable.
  Tensor reshape(Shape shape) const;
  Tensor view(Shape shape) const { return reshape(std::move(shape)); }
  /// Merges dims [start, end] into one.
  Tensor flatten(std::int64_t start = 0, std::int64_t end = -1) const;
  /// Elements [start, start + length) along `dim` (negative dims and a negative start
  /// count from the end, as torch.narrow). Differentiable. Along dim 0, or when every
  /// dim before `dim` has size 1, it is a view sharing storage like PyTorch's; along
  /// any other dim it is a copy, since dp tensors are contiguous (writes into it do not
  /// reach this tensor).
  ///   dp::Tensor cols = x.narrow(1, 2, 3);   // x[:, 2:5]
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  Tensor unsqueeze(std::int64_t dim) const;
  Tensor squeeze(std::int64_t dim) const;
  /// 2-d transpose (materialised). Differentiable.
  Tensor t() const;
  /// Dims reordered: dim i of the result is dim dims[i] of this tensor (torch.permute;
  /// negative dims count from the end). Differentiable. Materialised: dp tensors are
  /// contiguous, so this is a copy (one strided pass over the data), not a view, and
  /// writes into it do not reach this tensor (Note [Contiguous tensors]).
  ///   dp::Tensor heads = qkv.view({B, T, H, D}).permute({0, 2, 1, 3});  // (B, H, T, D)
  Tensor permute(const std::vector<std::int64_t>& dims) const;
  /// Dims d0 and d1 swapped (torch.transpose; materialised as permute). Differentiable.
  Tensor transpose(std::int64_t d0, std::int64_t d1) const;
  /// This tensor's data, which is contiguous (Note [Contiguous tensors]): free, no
  /// copy; of a channels-last tensor, its NCHW copy. On the result of permute, transpose, t(), expand or a later-dim narrow it is a
  /// handle that may be written in place — the copy alone, as PyTorch's contiguous() of a
  /// strided view is (Note [Writes into materialised views]). Differentiable.
  ///   dp::Tensor y = x.t().contiguous();  y.mul_(2);   // x unchanged, as in PyTorch
  Tensor contiguous() const;
  /// This tensor in `format` (Note [Channels-last tensors]): *this when it is already
  /// laid out so, else a copy in that layout (one transposing pass). ChannelsLast takes
  /// a 4-d tensor; Contiguous is contiguous(). Differentiable.
  ///   dp::Tensor x_cl = x.contiguous(dp::MemoryFormat::ChannelsLast);
  Tensor contiguous(MemoryFormat format) const;
  /// True when the bytes lie in `format`'s order (both for a tensor whose two layouts
  /// are the same bytes), as PyTorch's is_contiguous(memory_format).
  bool is_contiguous(MemoryFormat format = MemoryFormat::Contiguous) const;
  /// The layout the bytes lie in: ChannelsLast for a channels-last tensor, else
  /// Contiguous (PyTorch's suggest_memory_format).
  MemoryFormat suggest_memory_format() const;
  /// Broadcast to `shape` (torch.expand: size-1 dims grow, new leading dims are added,
  /// -1 keeps a size). Differentiable: the gradient sums over the broadcast dims.
  /// Materialised (Note [Contiguous tensors]); elementwise ops broadcast by themselves,
  /// without one.
  Tensor expand(const Shape& shape) const;

  // ---- in-place (bump the storage version) ----------------------------------------------
  // With grad mode on, a write into a tensor made by an op, or of a source that requires
  // grad, is recorded as PyTorch records it, when the tensor owns its storage alone; into
  // a leaf that requires grad, or a tensor that shares its storage (a view, a tensor with
  // views, one a backward node saved), it is a dp::Error (Note [In-place writes and
  // autograd] in src/tensor/tensor.cpp).
  //   dp::Tensor h = x * 2;  h.add_(residual);  h.mul_(0.5f);   // gradients as y = (h + r) * 0.5
  Tensor& zero_();
  Tensor& fill_(double value);
  /// Copies src into this tensor, as PyTorch's copy_: src of any device and dtype
  /// (converted as to() converts), its shape broadcasting to this one's (Note
  /// [Sources of in-place writes] in src/tensor/tensor.cpp).
  Tensor& copy_(const Tensor& src);
  /// this += alpha * other for a floating tensor, as PyTorch's add_: other on this
  /// device, its shape broadcasting to this one's, of any dtype (two different floating
  /// dtypes sum in float32, rounded once into this one's).
  Tensor& add_(const Tensor& other, float alpha = 1.0f);
  Tensor& mul_(float value);
  /// this += value, elementwise, for float32 and int64 tensors (counters); enqueued on
  /// the device like any kernel, never read back to the host.
  Tensor& add_(double value);
  /// this -= alpha * other, as PyTorch's sub_ (add_ with -alpha: the same sources).
  Tensor& sub_(const Tensor& other, float alpha = 1.0f);
  /// this -= value (add_(-value)).
  Tensor& sub_(double value);
  /// this *= other and this /= other (true division), as PyTorch's mul_ and div_: other
  /// on this device, its shape broadcasting to this one's, the product or quotient in the
  /// common dtype rounded once into this one's (Note [In-place writes as out-of-place
  /// ops] in src/tensor/tensor.cpp). Gradients as the out-of-place ops', bit for bit.
  Tensor& mul_(const Tensor& other);
  Tensor& div_(const Tensor& other);
  /// this /= value, a true division as dp::div(t, value).
  Tensor& div_(double value);
  /// `value` where `mask` (broadcasting to this shape) is nonzero, as PyTorch's masked_fill_.
  Tensor& masked_fill_(const Tensor& mask, double value);
  /// max(this, 0), as PyTorch's relu_.
  Tensor& relu_();
  /// This tensor clamped to [min, max] in place (dp::clamp), as PyTorch's clamp_.
  Tensor& clamp_(std::optional<double> min, std::optional<double> max = std::nullopt);

  // ---- autograd ------------------------------------------------------------------------
  bool requires_grad() const;
  /// Marks a leaf as requiring a gradient. Returns *this for chaining.
  Tensor& set_requires_grad(bool on);
  /// True when the tensor was not made by a recorded op.
  bool is_leaf() const;
  /// The accumulated gradient (undefined until a backward reaches this leaf).
  Tensor grad() const;
  /// Sets the gradient tensor (backward then accumulates into it in place): PyTorch's
  /// `t.grad = grad`. A module parameter's .grad is its place in the flat gradient
  /// buffer: `grad` is written there and counts as a gradient for the next optimizer
  /// step (Note [Parameters without a gradient] in dp/optim/optimizer.h); an undefined
  /// `grad` is a dp::Error there (zero_grad() sets gradients to none).
  void set_grad(const Tensor& grad) const;
  /// The node that made this tensor, or null for leaves.
  std::shared_ptr<autograd::Node> grad_fn() const;
  /// Runs reverse-mode autodiff from this tensor. A scalar needs no `grad`.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;

  // ---- arithmetic (differentiable; see ops.h for the full list) --------------------------
  // Members forward to the free functions of ops.h, so `x.square().sum()` and
  // `dp::sum(dp::square(x))` are the same op:
  //   dp::Tensor loss = (pred - y).square().mean();
  //   dp::Tensor p = logits.sigmoid();  dp::Tensor h = x.matmul(w).tanh();
  Tensor operator-() const;
  Tensor neg() const;
  Tensor square() const;
  Tensor sqrt() const;
  Tensor abs() const;
  Tensor reciprocal() const;
  Tensor relu() const;
  Tensor sigmoid() const;
  Tensor tanh() const;
  Tensor exp() const;
  Tensor log() const;
  /// this ** p for a scalar exponent.
  Tensor pow(double p) const;
  /// Matrix product of 2-d tensors (dp::matmul).
  Tensor matmul(const Tensor& other) const;
  Tensor sum() const;
  Tensor sum(std::int64_t dim, bool keepdim = false) const;
  Tensor mean() const;
  Tensor mean(std::int64_t dim, bool keepdim = false) const;
  /// Max over a dim (values; differentiable to the first maximum).
  Tensor max(std::int64_t dim, bool keepdim = false) const;
  Tensor argmax(std::int64_t dim, bool keepdim = false) const;

  // ---- comparisons (not differentiable; ops.h: 1.0f where true, else 0.0f) -------------
  // The operators of ops.h as members, like torch's t.eq(u), t.gt(0.5).
  Tensor eq(const Tensor& other) const;
  Tensor ne(const Tensor& other) const;
  Tensor gt(const Tensor& other) const;
  Tensor lt(const Tensor& other) const;
  Tensor ge(const Tensor& other) const;
  Tensor le(const Tensor& other) const;
  Tensor eq(double value) const;
  Tensor ne(double value) const;
  Tensor gt(double value) const;
  Tensor lt(double value) const;
  Tensor ge(double value) const;
  Tensor le(double value) const;
  /// This tensor with `value` where mask is nonzero (dp::masked_fill): x.masked_fill(pad, -INFINITY).
  Tensor masked_fill(const Tensor& mask, double value) const;
  /// dp::clamp(*this, min, max): x.clamp(0.0, 1.0), x.clamp(std::nullopt, 5.0).
  Tensor clamp(std::optional<double> min, std::optional<double> max = std::nullopt) const;

  std::string str() const;  // "Tensor[64, 10] float32 cpu:0"

 private:
  std::shared_ptr<TensorImpl> impl_;
};

template <> float* Tensor::data<float>() const;
template <> std::int64_t* Tensor::data<std::int64_t>() const;
template <> const float* Tensor::data<const float>() const;
template <> const std::int64_t* Tensor::data<const std::int64_t>() const;
template <> std::int32_t* Tensor::data<std::int32_t>() const;
template <> const std::int32_t* Tensor::data<const std::int32_t>() const;
template <> BFloat16* Tensor::data<BFloat16>() const;
template <> const BFloat16* Tensor::data<const BFloat16>() const;
template <> Float16* Tensor::data<Float16>() const;
template <> const Float16* Tensor::data<const Float16>() const;
template <> float Tensor::item<float>() const;
template <> double Tensor::item<double>() const;
template <> std::int64_t Tensor::item<std::int64_t>() const;
template <> std::int32_t Tensor::item<std::int32_t>() const;
template <> bool Tensor::item<bool>() const;

/// Prints the values as libtorch does, then a line naming the type and shape:
///    0.1000  0.2000  0.3000
///    0.4000  0.5000  0.6000
///   [ CPUFloatType{2,3} ]
/// One column for a 1-d tensor, one matrix per leading index "(i,.,.) =" beyond 2-d.
/// A tensor of more than 1000 elements is summarised as PyTorch's print does: the
/// first and last 3 entries of each dim around "...". A device other than cpu:0 or
/// cuda:0 is named in the last line ("[ CPUFloatType{2,3} on cpu:1 ]"). The values
/// are read to the host (a wait on a CUDA device). t.str() is the one-line summary
/// ("Tensor[2, 3] float32 cpu:0") that error messages use.
std::ostream& operator<<(std::ostream& os, const Tensor& t);

/// Dtype and device of a new tensor.
struct TensorOptions {
  Dtype dtype = Dtype::Float32;
  Device device{};
};

// ---- creation ------------------------------------------------------------------------
Tensor empty(const Shape& shape, TensorOptions opts = {});
Tensor empty(const Shape& shape, Device device);
Tensor zeros(const Shape& shape, TensorOptions opts = {});
Tensor zeros(const Shape& shape, Device device);
Tensor ones(const Shape& shape, TensorOptions opts = {});
Tensor ones(const Shape& shape, Device device);
Tensor full(const Shape& shape, double value, TensorOptions opts = {});
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor empty_like(const Tensor& t);
/// Standard normal values from `gen`.
Tensor randn(const Shape& shape, Generator& gen, Device device = {});
/// Uniform values in [lo, hi) from `gen`.
Tensor uniform(const Shape& shape, double lo, double hi, Generator& gen, Device device = {});

// Random tensors as libtorch makes them: each has a form drawing from
// dp::default_generator() (which dp::manual_seed seeds) and one taking a Generator.
// Float32, except randint (int64, as torch.randint).
//   dp::manual_seed(0);
//   dp::Tensor x = dp::randn({20, 10});                    // like torch::randn({20, 10})
//   dp::Tensor y = dp::randint(0, 10, {20}, dp::cpu(1));   // labels in [0, 10) on cpu:1

/// Standard normal values from dp::default_generator().
Tensor randn(const Shape& shape, Device device = {});
/// Uniform values in [0, 1).
Tensor rand(const Shape& shape, Device device = {});
Tensor rand(const Shape& shape, Generator& gen, Device device = {});
/// Normal values of mean `mean` and standard deviation `std` (>= 0 and finite).
Tensor normal(double mean, double std, const Shape& shape, Device device = {});
Tensor normal(double mean, double std, const Shape& shape, Generator& gen, Device device = {});
/// Uniform integers in [low, high), int64. high - low must lie in [1, 2^24]: each value
/// comes from one float32 uniform draw.
Tensor randint(std::int64_t low, std::int64_t high, const Shape& shape, Device device = {});
Tensor randint(std::int64_t low, std::int64_t high, const Shape& shape, Generator& gen, Device device = {});
/// randint(0, high, shape, device).
Tensor randint(std::int64_t high, const Shape& shape, Device device = {});
/// 0, 1, ..., n-1 (any dtype).
Tensor arange(std::int64_t n, TensorOptions opts = {});
/// Copies host data; `shape` must hold data.size() elements.
Tensor from_vector(const std::vector<float>& data, const Shape& shape, Device device = {});
Tensor from_vector(const std::vector<std::int64_t>& data, const Shape& shape, Device device = {});
Tensor from_vector(const std::vector<std::int32_t>& data, const Shape& shape, Device device = {});
Tensor from_vector(const std::vector<BFloat16>& data, const Shape& shape, Device device = {});
Tensor from_vector(const std::vector<Float16>& data, const Shape& shape, Device device = {});
Tensor scalar_tensor(double value, Device device = {});

/// Wraps memory the caller owns as a tensor, without a copy (torch::from_blob): writes
/// through the tensor are seen in `data` and the other way round. The tensor does not
/// own the memory: dp never frees it, and it is not counted by memory_allocated. With
/// a `deleter`, deleter(data) is called exactly once, when the last tensor sharing the
/// memory (views, detach(), copies of the handle) dies; an exception from it is logged,
/// never thrown. `data` must stay valid until then.
///   std::vector<float> buf(6, 1.0f);
///   dp::Tensor t = dp::from_blob(buf.data(), {2, 3});        // t and buf share memory
///   dp::Tensor u = dp::from_blob(p, {n}, dp::Dtype::Int32, dp::cpu(0), [](void* q) { std::free(q); });
/// Devices: every CPU virtual device cpu(k) is host memory, so host memory may be
/// wrapped for any existing cpu(k) (the tensor then counts as cpu(k)'s: ops will not
/// mix it with other devices' tensors). For cuda(k), `data` must be memory of that
/// device (cudaMalloc'ed, or from another library); this is not checked. Throws
/// dp::Error for a null `data`, a negative size, `data` not aligned to the element
/// size, or a device that does not exist (any CUDA device in a build without CUDA).
Tensor from_blob(void* data, const Shape& shape, Dtype dtype = Dtype::Float32, Device device = {},
                 std::function<void(void*)> deleter = {});

}  // namespace dp
