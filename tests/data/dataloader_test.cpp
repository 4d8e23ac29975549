// Tests for dp/data/dataloader.h: deterministic batches whatever the thread setup, full
// coverage of an epoch, bounded prefetch, prompt early exit, and worker errors.
#include "dp/data/dataloader.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dp/core/error.h"
#include "dp/data/synthetic.h"
#include "dp/data/tensor_dataset.h"

using dp::data::Batch;
using dp::data::DataLoader;
using Idx = std::vector<std::int64_t>;

namespace {

// Example i is a (2) vector (i, -i) with target i.
std::shared_ptr<dp::data::TensorDataset> counting_dataset(std::int64_t n) {
  std::vector<float> data;
  Idx targets;
  for (std::int64_t i = 0; i < n; ++i) {
    data.push_back(static_cast<float>(i));
    data.push_back(static_cast<float>(-i));
    targets.push_back(i);
  }
  return std::make_shared<dp::data::TensorDataset>(dp::from_vector(data, {n, 2}),
                                                   dp::from_vector(targets, {n}));
}

// Wraps a dataset: counts get_batch calls, optionally sleeps in each, and throws when a
// batch holds the index `bad` (a dp::Error or, with `std_error`, a std::runtime_error).
class TestDataset : public dp::data::Dataset {
 public:
  explicit TestDataset(std::shared_ptr<const dp::data::Dataset> inner) : inner_(std::move(inner)) {}
  std::int64_t size() const override { return inner_->size(); }
  dp::Shape example_shape() const override { return inner_->example_shape(); }
  Batch get_batch(std::span<const std::int64_t> indices) const override {
    calls.fetch_add(1);
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (std::find(indices.begin(), indices.end(), bad) != indices.end()) {
      if (std_error) throw std::runtime_error("disk on fire");
      DP_FAIL("corrupt example ", bad);
    }
    return inner_->get_batch(indices);
  }

  std::shared_ptr<const dp::data::Dataset> inner_;
  std::int64_t bad = -1;
  bool std_error = false;
  std::chrono::milliseconds delay{0};
  mutable std::atomic<int> calls{0};
};

struct Flat {
  std::vector<float> data;
  Idx target;
  bool operator==(const Flat&) const = default;
};

std::vector<Flat> collect(DataLoader& loader) {
  std::vector<Flat> out;
  for (auto& [x, y] : loader) out.push_back({x.to_vector(), y.to_vector_i64()});
  return out;
}

}  // namespace

TEST_CASE("batch k depends only on seed and epoch, not on workers or prefetch") {
  auto ds = std::make_shared<dp::data::SyntheticDataset>(
      dp::data::SyntheticOptions{.size = 1000, .example_shape = {3, 4, 4}, .seed = 3});
  const DataLoader::Options base{.batch_size = 32, .shuffle = true, .seed = 11};

  DataLoader::Options sync = base;
  sync.num_workers = 0;
  DataLoader ref_loader(ds, sync);
  ref_loader.set_epoch(4);
  const std::vector<Flat> ref = collect(ref_loader);
  REQUIRE(ref.size() == 32);  // 31 full batches and one of 8
  CHECK(ref.back().target.size() == 8);

  // The reference is exactly get_batch over the epoch's permutation slices.
  const Idx perm = dp::data::random_permutation(1000, 11 + 4);
  for (std::size_t k : {std::size_t{0}, std::size_t{17}, std::size_t{31}}) {
    const auto first = static_cast<std::ptrdiff_t>(k * 32);
    const auto count = std::min<std::ptrdiff_t>(32, 1000 - first);
    const Batch b = ds->get_batch(std::span<const std::int64_t>(perm.data() + first, static_cast<std::size_t>(count)));
    CHECK(ref[k] == Flat{b.data.to_vector(), b.target.to_vector_i64()});
  }

  for (auto [workers, prefetch] : {std::pair{1, 1}, std::pair{2, 2}, std::pair{3, 5}, std::pair{4, 1}}) {
    CAPTURE(workers);
    CAPTURE(prefetch);
    DataLoader::Options o = base;
    o.num_workers = workers;
    o.prefetch = prefetch;
    DataLoader loader(ds, o);
    loader.set_epoch(4);
    CHECK(collect(loader) == ref);
  }

  // Another epoch gives other batches; each begin() advances the epoch.
  DataLoader loader(ds, base);
  loader.set_epoch(4);
  CHECK(collect(loader) == ref);
  CHECK(loader.epoch() == 5);
  CHECK(collect(loader) != ref);
}

TEST_CASE("every example appears once per epoch") {
  auto ds = counting_dataset(103);
  for (bool shuffle : {false, true}) {
    for (bool drop_last : {false, true}) {
      CAPTURE(shuffle);
      CAPTURE(drop_last);
      DataLoader loader(ds, {.batch_size = 10, .shuffle = shuffle, .seed = 1, .drop_last = drop_last});
      CHECK(loader.size() == (drop_last ? 10 : 11));
      for (int epoch = 0; epoch < 3; ++epoch) {
        Idx seen;
        std::int64_t batches = 0;
        for (auto it = loader.begin(); it != loader.end(); ++it) {
          CHECK(it.index() == batches);
          auto& [x, y] = *it;
          CHECK(x.shape() == dp::Shape{y.size(0), 2});
          const std::vector<float> v = x.to_vector();
          const Idx t = y.to_vector_i64();
          for (std::size_t j = 0; j < t.size(); ++j) {
            CHECK(v[2 * j] == static_cast<float>(t[j]));  // data row matches its target
            seen.push_back(t[j]);
          }
          ++batches;
        }
        CHECK(batches == loader.size());
        std::sort(seen.begin(), seen.end());
        CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());  // no repeats
        CHECK(seen.size() == (drop_last ? 100u : 103u));
        if (!shuffle && drop_last) CHECK(seen.back() == 99);
      }
    }
  }
}

TEST_CASE("a DistributedSampler drives the loader") {
  auto ds = counting_dataset(21);
  auto sampler = std::make_shared<dp::data::DistributedSampler>(
      21, 2, 1, dp::data::DistributedSampler::Options{.shuffle = false});
  DataLoader loader(ds, sampler, {.batch_size = 4});
  CHECK(loader.size() == 3);
  Idx got;
  for (auto& [x, y] : loader) {
    const Idx t = y.to_vector_i64();
    got.insert(got.end(), t.begin(), t.end());
  }
  CHECK(got == Idx{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 0});
  CHECK_THROWS_WITH_AS(DataLoader(ds, sampler, {.shuffle = true}), doctest::Contains("sampler"),
                       dp::Error);
}

TEST_CASE("the prefetch window bounds how far workers run ahead") {
  auto inner = counting_dataset(1000);
  auto ds = std::make_shared<TestDataset>(inner);
  DataLoader loader(ds, {.batch_size = 1, .num_workers = 4, .prefetch = 3});
  auto it = loader.begin();
  ++it;  // the consumer holds batch 1; batches 2, 3, 4 may be assembled
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(ds->calls.load() <= 2 + 3);
  CHECK(ds->calls.load() >= 2);
}

TEST_CASE("leaving a loop early is prompt and clean") {
  // 1e7 examples of 784 floats: a full pass would take many minutes. (Each pass
  // materialises its index list, 80 MB here, as PyTorch's samplers do.)
  auto big = std::make_shared<dp::data::SyntheticDataset>(
      dp::data::SyntheticOptions{.size = 10'000'000, .example_shape = {1, 28, 28}});
  const auto start = std::chrono::steady_clock::now();
  for (int rep = 0; rep < 3; ++rep) {
    DataLoader loader(big, {.batch_size = 64, .shuffle = false, .num_workers = 2, .prefetch = 4});
    int n = 0;
    for (auto& [x, y] : loader) {
      CHECK(x.size(0) == 64);
      if (++n == 2) break;
    }
    CHECK(n == 2);
  }
  // Slow batches: the wait on exit is bounded by one batch in flight per worker.
  auto slow = std::make_shared<TestDataset>(counting_dataset(10'000));
  slow->delay = std::chrono::milliseconds(30);
  {
    DataLoader loader(slow, {.batch_size = 10, .num_workers = 3, .prefetch = 3});
    auto it = loader.begin();
    ++it;
  }  // iterator and loader destroyed mid-epoch
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Not a performance assertion: a hang or a full pass would take far longer.
  CHECK(seconds < 20.0);
  CHECK(slow->calls.load() <= 2 + 3 + 3);
}

TEST_CASE("a failing dataset surfaces as dp::Error at its batch") {
  auto inner = counting_dataset(100);
  for (bool std_error : {false, true}) {
    for (int workers : {0, 1, 3}) {
      CAPTURE(std_error);
      CAPTURE(workers);
      auto ds = std::make_shared<TestDataset>(inner);
      ds->bad = 37;  // in batch 3 of 10
      ds->std_error = std_error;
      DataLoader loader(ds, {.batch_size = 10, .num_workers = workers, .prefetch = 2});
      for (int pass = 0; pass < 2; ++pass) {  // the loader stays usable after an error
        Idx seen;
        std::string what;
        try {
          for (auto& [x, y] : loader) {
            const Idx t = y.to_vector_i64();
            seen.insert(seen.end(), t.begin(), t.end());
          }
        } catch (const dp::Error& e) {
          what = e.what();
        }
        CHECK(seen.size() == 30);  // batches 0, 1, 2 arrived first
        CHECK(what.find("batch 3 of 10") != std::string::npos);
        CHECK(what.find(std_error ? "disk on fire" : "corrupt example 37") != std::string::npos);
      }
    }
  }
  // An error in batch 0 is thrown by begin().
  auto ds = std::make_shared<TestDataset>(inner);
  ds->bad = 0;
  DataLoader loader(ds, {.batch_size = 10});
  CHECK_THROWS_WITH_AS(loader.begin(), doctest::Contains("batch 0 of 10"), dp::Error);
}

TEST_CASE("DataLoader validates its options") {
  auto ds = counting_dataset(10);
  CHECK_THROWS_WITH_AS(DataLoader(ds, {.batch_size = 0}), doctest::Contains("batch_size >= 1"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(DataLoader(ds, {.num_workers = -1}), doctest::Contains("num_workers"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(DataLoader(ds, {.prefetch = 0}), doctest::Contains("prefetch >= 1"),
                       dp::Error);
  CHECK_THROWS_AS(DataLoader(nullptr), dp::Error);
  // An empty dataset gives an empty pass.
  DataLoader empty(counting_dataset(0), {.batch_size = 4});
  CHECK(empty.size() == 0);
  CHECK(empty.begin() == empty.end());
}

TEST_CASE("set_position resumes mid-epoch without assembling the skipped batches") {
  auto inner = std::make_shared<dp::data::SyntheticDataset>(
      dp::data::SyntheticOptions{.size = 250, .example_shape = {5}, .seed = 9});
  const DataLoader::Options opts{.batch_size = 16, .shuffle = true, .seed = 4};
  DataLoader ref_loader(inner, opts);
  ref_loader.set_epoch(3);
  const std::vector<Flat> ref = collect(ref_loader);
  REQUIRE(ref.size() == 16);

  for (int workers : {0, 1, 3}) {
    for (std::int64_t start : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, std::int64_t{15}}) {
      CAPTURE(workers);
      CAPTURE(start);
      auto ds = std::make_shared<TestDataset>(inner);
      DataLoader::Options o = opts;
      o.num_workers = workers;
      DataLoader loader(ds, o);
      loader.set_position(3, start);
      CHECK(loader.start_batch() == start);
      std::vector<Flat> got;
      std::int64_t expect_index = start;
      for (auto it = loader.begin(); it != loader.end(); ++it) {
        CHECK(it.index() == expect_index++);
        got.push_back({it->data.to_vector(), it->target.to_vector_i64()});
      }
      // Exactly the uninterrupted epoch's batches from `start` on, and only those were
      // read from the dataset.
      CHECK(got == std::vector<Flat>(ref.begin() + start, ref.end()));
      CHECK(ds->calls.load() == 16 - start);
      // The position applies to one pass: the next pass is epoch 4 from batch 0.
      CHECK(loader.start_batch() == 0);
      CHECK(loader.epoch() == 4);
      ds->calls = 0;
      CHECK(collect(loader).size() == 16);
      CHECK(ds->calls.load() == 16);
    }
  }
}

TEST_CASE("set_position at the end of an epoch gives an empty pass; bad positions throw") {
  auto ds = counting_dataset(10);
  DataLoader loader(ds, {.batch_size = 4});  // 3 batches
  loader.set_position(2, 3);
  CHECK(loader.begin() == loader.end());
  CHECK(loader.epoch() == 3);
  CHECK_THROWS_WITH_AS(loader.set_position(0, 4), doctest::Contains("expected a batch in [0, 3]"),
                       dp::Error);
  CHECK_THROWS_WITH_AS(loader.set_position(0, -1), doctest::Contains("got -1"), dp::Error);
  CHECK(loader.start_batch() == 0);  // a rejected position changes nothing
  CHECK(loader.epoch() == 3);
}

TEST_CASE("pin_memory gives pinned batches with the same content") {
  auto ds = std::make_shared<dp::data::SyntheticDataset>(
      dp::data::SyntheticOptions{.size = 100, .example_shape = {2, 3}, .seed = 1});
  DataLoader plain(ds, {.batch_size = 8, .shuffle = true, .seed = 2});
  const std::vector<Flat> ref = collect(plain);
  for (int workers : {0, 2}) {
    CAPTURE(workers);
    DataLoader pinned(ds, {.batch_size = 8, .shuffle = true, .seed = 2, .num_workers = workers,
                           .pin_memory = true});
    std::vector<Flat> got;
    for (auto& [x, y] : pinned) {
      CHECK(x.is_pinned());
      CHECK(y.is_pinned());
      CHECK(x.device() == dp::cpu(0));
      got.push_back({x.to_vector(), y.to_vector_i64()});
    }
    CHECK(got == ref);
  }
  for (auto& [x, y] : plain) {
    CHECK_FALSE(x.is_pinned());
    CHECK_FALSE(y.is_pinned());
  }
}
