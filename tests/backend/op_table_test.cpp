// Every case of the backend op table (op_cases.h) on CPU virtual devices, and the
// table's coverage: each Backend kernel and each value of the op enums is called by
// some case. CI has no GPU, so this is where a broken case or a missing one shows; the
// CUDA comparison of the same cases is tests/cuda/cuda_backend_test.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "dp/core/device.h"
#include "dp/core/error.h"
#include "op_cases.h"
#include "test_scale.h"

namespace {

using dp::Device;
using dp::backend::Backend;
using dp::backend::BinaryOp;
using dp::backend::Conv2dShape;
using dp::backend::DType;
using dp::backend::Op;
using dp::backend::OpArgs;
using dp::backend::Event;
using dp::backend::Indexer;
using dp::backend::Pool2dShape;
using dp::backend::ReduceOp;
using dp::backend::UnaryOp;
using dp_test::Kernel;
using dp_test::OpCase;
using dp_test::OpRun;
using dp_test::Outputs;
using dp_test::Suite;
using i64 = std::int64_t;

/// A call seen by RecordingBackend: the kernel, its op for unary/binary/reduce (-1
/// otherwise), and the dtype a table op was called with (float32 for the others).
using Call = std::tuple<Kernel, int, DType>;

/// Forwards every call to another backend and, while recording, notes each kernel
/// call. It overrides every method of Backend, so a method added to the interface
/// makes this class abstract and this file fail to compile until the method is
/// forwarded here — and, if it is a kernel, named in dp_test::Kernel, which the
/// coverage test below then requires a case for.
class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(Backend& inner) : in_(inner) { wrap_every_op(); }

  void start() {
    calls_.clear();
    recording_ = true;
  }
  std::set<Call> stop() {
    recording_ = false;
    return std::move(calls_);
  }

  dp::DeviceType type() const override { return in_.type(); }
  int device_count() override { return in_.device_count(); }
  void set_current_device(Device dev) override { in_.set_current_device(dev); }
  void set_concurrent_devices(int count) override { in_.set_concurrent_devices(count); }
  int threads_per_device(Device dev) override { return in_.threads_per_device(dev); }
  void synchronize(Device dev) override { in_.synchronize(dev); }
  std::unique_ptr<Event> create_event(Device dev) override { return in_.create_event(dev); }
  void record_event(Event& ev, Device dev) override { in_.record_event(ev, dev); }
  void wait_event(Event& ev, Device dev) override { in_.wait_event(ev, dev); }
  void range_push(Device dev, const char* name) override { in_.range_push(dev, name); }
  void range_pop(Device dev) noexcept override { in_.range_pop(dev); }
  // A host loop over a device's share of the cores (used by the local communicator),
  // not a device kernel: forwarded, not recorded.
  void host_parallel_for(Device dev, std::int64_t n, dp::backend::RangeFn f) override {
    in_.host_parallel_for(dev, n, std::move(f));
  }

  void* allocate(Device dev, std::size_t nbytes) override { return in_.allocate(dev, nbytes); }
  void deallocate(Device dev, void* ptr, std::size_t nbytes) noexcept override {
    in_.deallocate(dev, ptr, nbytes);
  }
  std::size_t memory_allocated(Device dev) override { return in_.memory_allocated(dev); }
  std::size_t max_memory_allocated(Device dev) override { return in_.max_memory_allocated(dev); }
  void reset_peak_memory(Device dev) override { in_.reset_peak_memory(dev); }
  void* allocate_pinned(std::size_t nbytes) override { return in_.allocate_pinned(nbytes); }
  void deallocate_pinned(void* ptr, std::size_t nbytes) noexcept override {
    in_.deallocate_pinned(ptr, nbytes);
  }
  std::size_t pinned_memory_allocated() override { return in_.pinned_memory_allocated(); }
  bool max_pool2d_byte_winners(const Pool2dShape& s) const override { return in_.max_pool2d_byte_winners(s); }
  std::string attention_shape_misfit(Device dev, const dp::backend::AttentionShape& s) const override {
    return in_.attention_shape_misfit(dev, s);
  }
  std::array<dp::backend::ConvPass, 3> conv_passes(Device dev, const Conv2dShape& s, DType dt) override {
    return in_.conv_passes(dev, s, dt);
  }

  void copy(void* dst, Device dst_dev, const void* src, Device src_dev,
            std::size_t nbytes) override {
    hit(Kernel::Copy);
    in_.copy(dst, dst_dev, src, src_dev, nbytes);
  }
  void copy_from_host(void* dst, Device dev, const void* host_src, std::size_t nbytes) override {
    hit(Kernel::CopyFromHost);
    in_.copy_from_host(dst, dev, host_src, nbytes);
  }
  void copy_to_host(void* host_dst, const void* src, Device dev, std::size_t nbytes) override {
    hit(Kernel::CopyToHost);
    in_.copy_to_host(host_dst, src, dev, nbytes);
  }
  void memset_zero(void* ptr, Device dev, std::size_t nbytes) override {
    hit(Kernel::MemsetZero);
    in_.memset_zero(ptr, dev, nbytes);
  }

 private:
  void hit(Kernel k, int op = -1, DType dtype = DType::F32) {
    if (recording_) calls_.insert({k, op, dtype});
  }

  /// The kernel this backend registers for `op`: notes the call (with the sub-op of
  /// unary, binary and reduce), then runs the inner backend's kernel.
  template <Op op>
  static void record(Backend& self, Device dev, DType dt, const void* args) {
    auto& rec = static_cast<RecordingBackend&>(self);
    int sub = -1;
    if constexpr (op == Op::Unary || op == Op::Binary || op == Op::Reduce)
      sub = static_cast<int>(static_cast<const OpArgs<op>*>(args)->op);
    rec.hit(dp_test::kernel_of(op), sub, dt);
    rec.in_.launch(op, dt, dev, args);
  }
  /// Registers record<op> for every dtype the inner backend has a kernel for.
  template <Op op>
  void wrap() {
    for (int d = 0; d < dp::backend::kDTypeCount; ++d)
      if (in_.supports(op, static_cast<DType>(d))) register_kernel(op, static_cast<DType>(d), &record<op>);
  }
  void wrap_every_op() {
#define DP_WRAP_OP(name, str, Args) wrap<Op::name>();
    DP_BACKEND_OPS(DP_WRAP_OP)
#undef DP_WRAP_OP
  }

  Backend& in_;
  bool recording_ = false;
  std::set<Call> calls_;
};

Backend& cpu_backend() { return dp::backend::get(dp::DeviceType::CPU); }

/// Builds `c` on `dev`, runs it once and reads its outputs.
Outputs run_once(const OpCase& c, Device dev) {
  OpRun run(c, dev);
  run.run();
  return run.read();
}

}  // namespace

TEST_CASE("every Check case runs on cpu(0) and cpu(1): written, finite, bitwise repeatable") {
  const auto cases = dp_test::op_cases(Suite::Check);
  REQUIRE(!cases.empty());
  for (const OpCase* c : cases) {
    INFO(c->full_name());
    const Outputs first = run_once(*c, dp::cpu(0));
    REQUIRE(!first.empty());
    // Outputs start as NaN (i64: kUnwritten), so this also finds elements not written.
    CHECK(dp_test::first_unwritten_or_nonfinite(first) == "");
    CHECK(dp_test::bitwise_equal(first, run_once(*c, dp::cpu(0))));
    // A virtual device is a faithful copy: same arena size, same bits.
    CHECK(dp_test::bitwise_equal(first, run_once(*c, dp::cpu(1))));
  }
}

TEST_CASE("one thread per device agrees with all cores within each case's tolerance") {
  // The CPU's parallel paths split sums differently from its serial ones, much as CUDA
  // does: the case tolerances must hold here already.
  Backend& be = cpu_backend();
  std::vector<Outputs> all_cores;
  const auto cases = dp_test::op_cases(Suite::Check);
  for (const OpCase* c : cases) all_cores.push_back(run_once(*c, dp::cpu(0)));
  be.set_concurrent_devices(dp::hardware_concurrency());  // one thread each
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const dp_test::Comparison cmp =
        dp_test::compare(all_cores[i], run_once(*cases[i], dp::cpu(1)), cases[i]->tol);
    INFO(cases[i]->full_name(), ": ", cmp.bad, " elements out of tolerance; first ", cmp.first_bad);
    CHECK(cmp.ok);
  }
  be.set_concurrent_devices(1);
}

TEST_CASE("every Backend kernel and every op enum value has a case that calls it") {
  RecordingBackend rec(cpu_backend());
  std::set<Call> covered;
  for (const OpCase* c : dp_test::op_cases(Suite::Check)) {
    INFO(c->full_name());
    OpRun run(*c, rec, dp::cpu(0));
    rec.start();
    run.run();
    const std::set<Call> calls = rec.stop();
    // The case calls the kernel it is filed under, and nothing else.
    REQUIRE(calls.size() == 1);
    CHECK(std::get<0>(*calls.begin()) == c->kernel);
    CHECK(std::get<2>(*calls.begin()) == c->dtype);
    covered.insert(calls.begin(), calls.end());
  }
  auto has = [&covered](Kernel k, int op) {
    for (const Call& c : covered)
      if (std::get<0>(c) == k && std::get<1>(c) == op) return true;
    return false;
  };
  auto has_dtype = [&covered](Kernel k, DType dt) {
    for (const Call& c : covered)
      if (std::get<0>(c) == k && std::get<2>(c) == dt) return true;
    return false;
  };
  // Every (op, dtype) of the kernel table has a case (Note [The op list] in ops.h).
  for (int o = 0; o < dp::backend::kOpCount; ++o)
    for (int d = 0; d < dp::backend::kDTypeCount; ++d) {
      const auto op = static_cast<Op>(o);
      const auto dt = static_cast<DType>(d);
      if (!cpu_backend().supports(op, dt)) continue;
      CHECK_MESSAGE(has_dtype(dp_test::kernel_of(op), dt), "no Check case calls op ",
                    std::string(dp::backend::op_name(op)), " with dtype ", std::string(dp::backend::dtype_name(dt)),
                    " (add one to tests/backend/op_cases.cpp)");
    }
  for (int k = 0; k < static_cast<int>(Kernel::kCount); ++k) {
    const auto kernel = static_cast<Kernel>(k);
    if (kernel == Kernel::Unary || kernel == Kernel::Binary || kernel == Kernel::Reduce) continue;
    const std::string name = dp_test::kernel_name(kernel);  // doctest prints a char* as a pointer
    CHECK_MESSAGE(has(kernel, -1), "no Check case calls Backend::", name,
                  " (add one to tests/backend/op_cases.cpp)");
  }
  for (int op = 0; op < static_cast<int>(UnaryOp::kCount); ++op)
    CHECK_MESSAGE(has(Kernel::Unary, op), "no Check case for unary ",
                  std::string(dp_test::op_name(static_cast<UnaryOp>(op))));
  for (int op = 0; op < static_cast<int>(BinaryOp::kCount); ++op)
    CHECK_MESSAGE(has(Kernel::Binary, op), "no Check case for binary ",
                  std::string(dp_test::op_name(static_cast<BinaryOp>(op))));
  for (int op = 0; op < static_cast<int>(ReduceOp::kCount); ++op)
    CHECK_MESSAGE(has(Kernel::Reduce, op), "no Check case for reduce ",
                  std::string(dp_test::op_name(static_cast<ReduceOp>(op))));
}

TEST_CASE("an (op, dtype) with no kernel is a dp::Error naming the op, the dtype and the device type") {
  Backend& be = cpu_backend();
  REQUIRE_FALSE(be.supports(Op::Unary, DType::I32));
  std::vector<std::int32_t> x(4, 1), y(4, 0);
  std::string what;
  try {
    be.run<Op::Unary>(dp::cpu(0), DType::I32, {UnaryOp::Neg, x.data(), y.data(), 4});
  } catch (const dp::Error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(what.find("unary") != std::string::npos);
  CHECK(what.find("int32") != std::string::npos);
  CHECK(what.find("cpu") != std::string::npos);
  CHECK(what.find("float32") != std::string::npos);  // the dtype it does have
  CHECK(y == std::vector<std::int32_t>(4, 0));
}

TEST_CASE("case names are unique, so --filter and the input seeds tell cases apart") {
  std::set<std::string> names;
  for (const OpCase& c : dp_test::op_cases()) {
    CHECK_MESSAGE(names.insert(c.full_name()).second, "duplicate case ", c.full_name());
    CHECK(c.kernel < Kernel::kCount);
    CHECK(c.bytes > 0);
  }
}

TEST_CASE("every Perf case builds, runs and writes finite outputs on cpu(0)") {
  // kernels_bench validates these against the oracle; here they must at least run, so
  // that a broken benchmark row is found without running the benchmark. Under a
  // sanitizer their 64 MiB buffers take minutes; the Check cases run the same builders.
  if (dp_test::kSanitized) {
    MESSAGE("Perf cases not run under a sanitizer");
    return;
  }
  for (const OpCase* c : dp_test::op_cases(Suite::Perf)) {
    INFO(c->full_name());
    CHECK(dp_test::first_unwritten_or_nonfinite(run_once(*c, dp::cpu(0))) == "");
  }
}

TEST_CASE("compare honours the tolerance and reports the first bad element") {
  const Outputs want{{"y", {1.0f, 2.0f, NAN}, {}}, {"i", {}, {7}}};
  Outputs got = want;
  CHECK(dp_test::compare(want, got, dp_test::kExact).ok);
  got[0].f32[1] = 2.001f;
  const dp_test::Comparison strict = dp_test::compare(want, got, {1e-6, 0});
  CHECK_FALSE(strict.ok);
  CHECK(strict.bad == 1);
  CHECK(strict.first_bad.rfind("y[1]", 0) == 0);
  CHECK(dp_test::compare(want, got, {1e-3, 0}).ok);
  got[1].i64[0] = 8;
  CHECK_FALSE(dp_test::compare(want, got, {1.0, 1.0}).ok);  // integers are exact
  got = want;
  got[0].f32[2] = 0.0f;  // NaN must stay NaN
  CHECK_FALSE(dp_test::compare(want, got, {1.0, 1.0}).ok);
}
