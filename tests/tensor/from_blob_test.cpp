// Tests for dp::from_blob (dp/tensor/tensor.h): the tensor shares the caller's memory
// (writes go through both ways, views included), the deleter runs exactly once when
// the last tensor dies, the memory is not counted by memory_allocated, and bad
// pointers, sizes, alignments and devices are refused naming what came.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "dp/core/device.h"
#include "dp/core/error.h"
#include "dp/tensor/ops.h"
#include "dp/tensor/tensor.h"

using F = std::vector<float>;

TEST_CASE("from_blob shares the caller's memory without a copy, both ways") {
  F buf{1, 2, 3, 4, 5, 6};
  dp::Tensor t = dp::from_blob(buf.data(), {2, 3});
  CHECK(t.shape() == dp::Shape{2, 3});
  CHECK(t.dtype() == dp::Dtype::Float32);
  CHECK(t.device() == dp::cpu(0));
  CHECK(t.raw_data() == buf.data());
  CHECK(t.storage()->external());
  CHECK(t.to_vector() == buf);
  buf[4] = 50;  // the caller writes: the tensor sees it
  CHECK(t.to_vector()[4] == 50);
  t.mul_(2.0f);  // the tensor writes: the caller sees it
  CHECK(buf == F{2, 4, 6, 8, 100, 12});
  t.narrow(0, 1, 1).fill_(-1.0);  // through a view
  CHECK(buf == F{2, 4, 6, -1, -1, -1});
  // Ops read it like any tensor; their results are ordinary tensors.
  dp::Tensor s = dp::sum(t);
  CHECK(s.item() == 9.0);
  CHECK_FALSE(s.storage()->external());
}

TEST_CASE("from_blob wraps int64 and int32 memory and any CPU virtual device") {
  std::vector<std::int64_t> l{3, 1, 2};
  dp::Tensor a = dp::from_blob(l.data(), {3}, dp::Dtype::Int64, dp::cpu(3));
  CHECK(a.device() == dp::cpu(3));
  CHECK(a.to_vector_i64() == l);
  std::vector<std::int32_t> m{7, 8};
  dp::Tensor b = dp::from_blob(m.data(), {2}, dp::Dtype::Int32);
  b.add_(1.0);
  CHECK(m == std::vector<std::int32_t>{8, 9});
  // A copy to another device is an ordinary tensor there.
  dp::Tensor c = a.to(dp::cpu(1));
  CHECK(c.device() == dp::cpu(1));
  CHECK_FALSE(c.storage()->external());
  l[0] = 99;
  CHECK(c.to_vector_i64()[0] == 3);
  // Empty shapes are fine with a valid pointer.
  CHECK(dp::from_blob(l.data(), {0, 4}, dp::Dtype::Int64).numel() == 0);
}

TEST_CASE("from_blob's deleter runs exactly once, when the last tensor sharing the memory dies") {
  int calls = 0;
  void* seen = nullptr;
  auto* mem = static_cast<float*>(std::malloc(4 * sizeof(float)));
  REQUIRE(mem != nullptr);
  {
    dp::Tensor t = dp::from_blob(mem, {4}, dp::Dtype::Float32, dp::cpu(0), [&](void* p) {
      ++calls;
      seen = p;
      std::free(p);
    });
    t.fill_(1.0);
    dp::Tensor view = t.reshape({2, 2});
    dp::Tensor det = t.detach();
    dp::Tensor copy = t;
    t = dp::Tensor();
    CHECK(calls == 0);
    view = dp::Tensor();
    det = dp::Tensor();
    CHECK(calls == 0);
    CHECK(copy.to_vector() == F{1, 1, 1, 1});
  }
  CHECK(calls == 1);
  CHECK(seen == mem);
  // Without a deleter dp never frees the memory: the caller still owns it.
  F keep{1, 2};
  { dp::Tensor t = dp::from_blob(keep.data(), {2}); }
  CHECK(keep == F{1, 2});
  // A throwing deleter is logged, not thrown from a destructor.
  F other{3};
  CHECK_NOTHROW({ dp::Tensor t = dp::from_blob(other.data(), {1}, dp::Dtype::Float32, dp::cpu(0), [](void*) {
    throw std::runtime_error("deleter failed");
  }); });
}

TEST_CASE("from_blob memory is not counted by memory_allocated") {
  const dp::Device dev = dp::cpu(5);
  std::vector<float> big(1 << 16);
  const std::size_t before = dp::memory_allocated(dev);
  dp::Tensor t = dp::from_blob(big.data(), {1 << 16}, dp::Dtype::Float32, dev);
  CHECK(dp::memory_allocated(dev) == before);
  dp::Tensor owned = t.clone();  // a copy is the device's own memory
  CHECK(dp::memory_allocated(dev) >= before + big.size() * sizeof(float));
}

TEST_CASE("from_blob refuses null pointers, negative sizes, misalignment and unknown devices") {
  F buf(8);
  CHECK_THROWS_WITH_AS(dp::from_blob(nullptr, {2}), doctest::Contains("expected a non-null data pointer"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::from_blob(buf.data(), {2, -1}),
                       doctest::Contains("expected non-negative sizes, got shape [2, -1]"), dp::Error);
  auto* odd = reinterpret_cast<char*>(buf.data()) + 2;
  CHECK_THROWS_WITH_AS(dp::from_blob(odd, {1}), doctest::Contains("aligned to 4 bytes for float32"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::from_blob(buf.data() + 1, {1}, dp::Dtype::Int64),
                       doctest::Contains("aligned to 8 bytes for int64"), dp::Error);
  // Device values made directly (dp::cpu(i) / dp::cuda(i) already refuse bad ids).
  const int n = dp::device_count(dp::DeviceType::CPU);
  CHECK_THROWS_WITH_AS(dp::from_blob(buf.data(), {2}, dp::Dtype::Float32, dp::Device{dp::DeviceType::CPU, n}),
                       doctest::Contains(("expected an existing device, got cpu:" + std::to_string(n)).c_str()), dp::Error);
  CHECK_THROWS_AS(dp::from_blob(buf.data(), {2}, dp::Dtype::Float32, dp::Device{dp::DeviceType::CPU, -1}),
                  dp::Error);
  if (dp::device_count(dp::DeviceType::CUDA) == 0) {
    CHECK_THROWS_WITH_AS(dp::from_blob(buf.data(), {2}, dp::Dtype::Float32, dp::Device{dp::DeviceType::CUDA, 0}),
                         doctest::Contains("expected an existing device, got cuda:0 (0 CUDA devices here)"),
                         dp::Error);
  }
  // A refused call never runs the deleter (the caller still owns the memory).
  int calls = 0;
  CHECK_THROWS_AS(dp::from_blob(buf.data(), {-1}, dp::Dtype::Float32, dp::cpu(0), [&](void*) { ++calls; }), dp::Error);
  CHECK(calls == 0);
}
