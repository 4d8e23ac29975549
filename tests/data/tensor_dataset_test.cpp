// Tests for dp/data/tensor_dataset.h.
#include "dp/data/tensor_dataset.h"

#include <doctest/doctest.h>

#include <vector>

#include "dp/core/error.h"

TEST_CASE("TensorDataset gathers rows and targets") {
  std::vector<float> data(4 * 2 * 3);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(i);
  const dp::data::TensorDataset ds(dp::from_vector(data, {4, 2, 3}),
                                   dp::from_vector(std::vector<std::int64_t>{7, 8, 9, 6}, {4}));
  CHECK(ds.size() == 4);
  CHECK(ds.example_shape() == dp::Shape{2, 3});
  const std::vector<std::int64_t> idx = {3, 0, 3};
  auto [x, y] = ds.get_batch(idx);
  CHECK(x.shape() == dp::Shape{3, 2, 3});
  CHECK(x.device() == dp::cpu(0));
  CHECK(y.to_vector_i64() == std::vector<std::int64_t>{6, 7, 6});
  const std::vector<float> v = x.to_vector();
  CHECK(v[0] == 18.0f);
  CHECK(v[6] == 0.0f);
  CHECK(v[17] == 23.0f);
  // The batch is a copy: writing it leaves the dataset alone.
  x.fill_(-1.0);
  CHECK(ds.get_batch(idx).data.to_vector()[0] == 18.0f);
  const std::vector<std::int64_t> bad = {4};
  CHECK_THROWS_WITH_AS(ds.get_batch(bad), doctest::Contains("index 4"), dp::Error);
  const std::vector<std::int64_t> none;
  CHECK(ds.get_batch(none).data.shape() == dp::Shape{0, 2, 3});
}

TEST_CASE("TensorDataset copies tensors from other devices to cpu(0)") {
  if (dp::device_count(dp::DeviceType::CPU) < 2) return;
  const dp::data::TensorDataset ds(dp::ones({3, 2}, dp::cpu(1)),
                                   dp::from_vector(std::vector<std::int64_t>{0, 1, 2}, {3}, dp::cpu(1)));
  CHECK(ds.data().device() == dp::cpu(0));
  CHECK(ds.targets().device() == dp::cpu(0));
}

TEST_CASE("TensorDataset rejects mismatched tensors") {
  const dp::Tensor x = dp::zeros({4, 3});
  CHECK_THROWS_WITH_AS(dp::data::TensorDataset(x, dp::zeros({4})), doctest::Contains("int64 or int32 targets"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(dp::data::TensorDataset(x, dp::zeros({5}, {dp::Dtype::Int64})),
                       doctest::Contains("4 examples but targets holds 5"), dp::Error);
  CHECK_THROWS_WITH_AS(dp::data::TensorDataset(dp::zeros({4}, {dp::Dtype::Int64}), dp::zeros({4}, {dp::Dtype::Int64})),
                       doctest::Contains("float32 data"), dp::Error);
  CHECK_THROWS_AS(dp::data::TensorDataset(dp::Tensor(), dp::Tensor()), dp::Error);
}
