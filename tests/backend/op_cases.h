// tests/backend/op_cases.h — the table of backend op cases, one list for the tests and
// the kernel benchmark (ggml's tests/test-backend-ops.cpp is the model).
//
// A case is one call of one Backend kernel on fixed shapes: a name, a shape, a builder
// that creates deterministic inputs on a device and sets up the call, a tolerance
// against the CPU backend (the oracle), and the FLOPs and bytes of one call. The list
// drives
//   tests/backend/op_table_test   every case on cpu(0) and cpu(1): it runs, its outputs
//                                 are written and finite, runs are bitwise repeatable,
//                                 and every kernel and every op enum value has a case;
//   tests/cuda/cuda_backend_test  every case on cuda(0) against cpu(0);
//   bench/kernels_bench           validate against the oracle, warm up, then time.
// Adding a kernel or an op therefore means adding a case here, once (Note [Op enum
// sentinels] in backend.h says how a missing one is caught).
//
//   for (const dp_test::OpCase* c : dp_test::op_cases(dp_test::Suite::Check)) {
//     dp_test::OpRun cpu(*c, dp::cpu(0)), gpu(*c, dp::cuda(0));
//     cpu.run(); gpu.run();
//     const dp_test::Comparison cmp = dp_test::compare(cpu.read(), gpu.read(), c->tol);
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "dp/core/device.h"

namespace dp_test {

/// Every kernel entry point of dp::backend::Backend (memory and stream management
/// aside): the ops of the kernel table, generated from DP_BACKEND_OPS (Note [The op
/// list] in backend/ops.h) so that Kernel::X is Op::X, then the copies. op_table_test checks that each is
/// called by some case, and for the table's ops that every (op, dtype) the CPU backend
/// registers is; its recording backend overrides every Backend method, so a method
/// added to the interface does not compile there until it is forwarded, listed here and
/// given a case.
enum class Kernel : std::uint8_t {
#define DP_TEST_KERNEL(name, str, Args) name,
  DP_BACKEND_OPS(DP_TEST_KERNEL)
#undef DP_TEST_KERNEL
  Copy, CopyFromHost, CopyToHost, MemsetZero,
  kCount  // Note [Op enum sentinels] in ops.h
};

/// The Kernel of a table op: the same name and value.
constexpr Kernel kernel_of(dp::backend::Op op) { return static_cast<Kernel>(op); }
#define DP_TEST_KERNEL_CHECK(name, str, Args) \
  static_assert(kernel_of(dp::backend::Op::name) == Kernel::name, "Kernel must list the ops first, in order");
DP_BACKEND_OPS(DP_TEST_KERNEL_CHECK)
#undef DP_TEST_KERNEL_CHECK

/// The op's name (dp::backend::op_name) or the Backend method's: "conv2d_backward_data".
const char* kernel_name(Kernel k);
/// Lower-case op names: "exp", "relu_backward", "sum".
const char* op_name(dp::backend::UnaryOp op);
const char* op_name(dp::backend::BinaryOp op);
const char* op_name(dp::backend::ReduceOp op);

/// An element passes when |got - want| <= atol + rtol * |want| (want from the oracle);
/// NaN matches NaN and an infinity matches itself. {0, 0} asks for equal values.
struct Tolerance {
  double rtol = 0.0;
  double atol = 0.0;
};
inline constexpr Tolerance kExact{};

/// Which list a case is in. Check: small and odd shapes that reach every code path
/// (edge sizes, above the CPU's parallel grain, broadcasts, strides); the tests run
/// these. Perf: the training workloads' shapes; kernels_bench times these by default.
enum class Suite : std::uint8_t { Check, Perf };

/// One output of a case, read back to the host: f32 or i64 holds the values.
struct Output {
  std::string name;
  std::vector<float> f32;
  std::vector<std::int64_t> i64;
};
using Outputs = std::vector<Output>;

class OpRun;

/// One row of the table.
struct OpCase {
  Kernel kernel = Kernel::kCount;
  dp::backend::DType dtype = dp::backend::DType::F32;  // the element type a table op is called with
  std::string name;   // the kernel, with its op where it has one: "unary exp"
  std::string shape;  // "331x127 op 127", "33x47x29 NT ld+3"
  Suite suite = Suite::Check;
  Tolerance tol;      // against the CPU oracle
  double flops = 0;   // per call: 2·m·n·k (gemm), 2·N·K·P·Q·C·R·S (conv); 0: not counted
  double bytes = 0;   // per call: every input read once, every output written once
  /// Creates the inputs and outputs on the run's device and sets the call.
  std::function<void(OpRun&)> build;

  std::string full_name() const { return name + " " + shape; }
};

/// Whether `be` has the kernel case `c` calls: false only for a table op the backend
/// registers no kernel for (a fusion only some backends offer, Note [Fused ops a backend
/// may offer] in backend/ops.h, or a dtype it lacks).
inline bool runs_on(const OpCase& c, const dp::backend::Backend& be) {
  const int k = static_cast<int>(c.kernel);
  return k >= dp::backend::kOpCount || be.supports(static_cast<dp::backend::Op>(k), c.dtype);
}

/// The whole table, Check cases first; built once.
const std::vector<OpCase>& op_cases();
/// The cases of one suite, in table order.
std::vector<const OpCase*> op_cases(Suite suite);

/// A case built on one device: owns its device (and pinned host) buffers. Inputs are a
/// pure function of the case's name, so every device gets the same bytes.
class OpRun {
 public:
  /// Builds `c` on `dev` through `backend` (a test may pass a wrapping backend).
  OpRun(const OpCase& c, dp::backend::Backend& backend, dp::Device dev);
  OpRun(const OpCase& c, dp::Device dev) : OpRun(c, dp::backend::get(dev), dev) {}
  ~OpRun();
  OpRun(const OpRun&) = delete;
  OpRun& operator=(const OpRun&) = delete;

  /// Makes the case's one kernel call (enqueued on CUDA). Kernels that update in place
  /// (axpy, optimizer steps, running statistics) keep updating when called again.
  void run();
  /// Waits for the device, then copies every output to the host.
  Outputs read();

  // ---- for builders ---------------------------------------------------------------
  dp::backend::Backend& backend() { return backend_; }
  dp::Device device() const { return dev_; }
  /// n values uniform in [lo, hi) from the next input stream of this case; with
  /// `integers`, rounded down to whole numbers (so that ties and equality occur).
  std::vector<float> host_uniform(std::int64_t n, float lo, float hi, bool integers = false);
  /// A device buffer holding host_uniform(n, lo, hi, integers).
  float* uniform(std::int64_t n, float lo, float hi, bool integers = false);
  float* upload(const std::vector<float>& host);
  std::int64_t* upload(const std::vector<std::int64_t>& host);
  std::int32_t* upload(const std::vector<std::int32_t>& host);
  /// 16-bit buffers (dtype BF16 or F16): host values rounded to the dtype, uploaded.
  void* upload16(dp::backend::DType dtype, const std::vector<float>& host);
  void* uniform16(dp::backend::DType dtype, std::int64_t n, float lo, float hi, bool integers = false);
  /// A 16-bit buffer the call overwrites, filled with NaN beforehand.
  void* empty16(dp::backend::DType dtype, std::int64_t n);
  /// A 16-bit output, read back widened (exactly) into Output::f32.
  void output16(std::string name, dp::backend::DType dtype, const void* ptr, std::int64_t n);
  /// A buffer the call overwrites, filled with NaN (i64: kUnwritten) beforehand, so an
  /// element the kernel misses shows up in the output.
  float* empty(std::int64_t n);
  std::int64_t* empty_i64(std::int64_t n);
  /// Page-locked host memory of the run's backend (for host-copy cases).
  void* pinned(std::size_t nbytes);
  /// Marks a device buffer as an output, read back by read().
  void output(std::string name, const float* ptr, std::int64_t n);
  void output(std::string name, const std::int64_t* ptr, std::int64_t n);
  /// An int32 output, read back widened into Output::i64.
  void output(std::string name, const std::int32_t* ptr, std::int64_t n);
  /// An output that lives on the host (a returned count, a copy to host).
  void output(std::function<Output()> read_host);
  /// The kernel call of the case.
  void set_call(std::function<void(dp::backend::Backend&, dp::Device)> call) {
    call_ = std::move(call);
  }

  /// What empty_i64 fills with: never a legitimate output of any case.
  static constexpr std::int64_t kUnwritten = std::numeric_limits<std::int64_t>::min();

 private:
  struct Block {
    void* ptr;
    std::size_t nbytes;
    bool pinned;
  };
  void* allocate(std::size_t nbytes);
  void release() noexcept;

  dp::backend::Backend& backend_;
  dp::Device dev_;
  std::uint64_t seed_;
  std::uint64_t next_stream_ = 0;
  std::vector<Block> blocks_;
  std::vector<std::function<Output()>> readers_;
  std::function<void(dp::backend::Backend&, dp::Device)> call_;
};

/// Result of comparing a case's outputs with the oracle's.
struct Comparison {
  bool ok = true;
  std::size_t bad = 0;      // elements out of tolerance, over all outputs
  double max_abs_err = 0;   // largest |got - want| of finite pairs
  std::string first_bad;    // "y[17]: want 1.5, got 1.7" (empty when ok)
};
/// Elementwise comparison under `tol`; i64 outputs must be equal.
Comparison compare(const Outputs& want, const Outputs& got, Tolerance tol);
/// True when every output has the same bytes.
bool bitwise_equal(const Outputs& a, const Outputs& b);
/// The first NaN/Inf float or kUnwritten integer, as "y[17] = nan"; empty when none.
std::string first_unwritten_or_nonfinite(const Outputs& outs);

}  // namespace dp_test
