// DataParallel across the processes of a job (Note [Across processes] in
// src/parallel/data_parallel.cpp), run under mpirun with 2 and 3 processes of 2 CPU
// virtual devices each (tests/dist/run_mpi.py), and as one process (a world of one).
// Every process trains the same net on its own rows of each global batch; each
// process also trains a plain single-device net on the whole global batch itself —
// the reference every design must match to float rounding. Within one topology the
// designs must agree bit for bit with each other and from run to run, and every
// process must end with the same parameters (so saving on rank 0 alone is safe).
// `dp_mpi_test --fault=MODE` runs one failure scenario instead: the last process
// throws inside a worker or is killed mid-step, and the whole job must end, non-zero,
// in seconds.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <chrono>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../parallel/mlp_fixture.h"
#include "dp/autograd/node.h"
#include "dp/dp.h"
#include "parallel/shard_store.h"

namespace dist = dp::dist;
using dp::Tensor;

namespace {

// A training state at `step` (the other fields default).
dp::TrainingState at_step(std::int64_t step) {
  dp::TrainingState st;
  st.step = step;
  return st;
}

constexpr int kLocal = 2;  // devices per process
constexpr int kSteps = 10;
constexpr std::uint64_t kSeed = 1234;

std::vector<dp::Device> local_devices(int n = kLocal) {
  std::vector<dp::Device> d;
  for (int i = 0; i < n; ++i) d.push_back(dp::cpu(i));
  return d;
}

/// Rows of global batch `step`: varies, and never divides evenly by the devices.
std::int64_t global_rows(int step) { return 4 * dist::world_size() * kLocal + 3 + step % 3; }

/// This process's rows of a batch of `rows`: torch.chunk-like, so processes differ.
std::pair<std::int64_t, std::int64_t> my_rows(std::int64_t rows) {
  const int p = dist::world_size(), r = dist::rank();
  const std::int64_t base = rows / p, extra = rows % p;
  const std::int64_t lo = r * base + std::min<std::int64_t>(r, extra);
  return {lo, base + (r < extra ? 1 : 0)};
}

enum class Path { ForwardBackward, Module };

struct Design {
  const char* name;
  dp::DataParallelOptions options;
};

std::vector<Design> designs() {
  // Tiny buckets: many collectives per backward, pieces cut by the shard boundaries.
  const dp::DataParallelOptions base{.bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
  std::vector<Design> out;
  dp::DataParallelOptions o = base;
  o.mode = dp::Mode::DP;
  out.push_back({"DP", o});
  o.mode = dp::Mode::DDP;
  out.push_back({"DDP", o});
  o.mode = dp::Mode::Sharded;
  o.shard_stage = 1;
  out.push_back({"Sharded stage 1", o});
  o.shard_stage = 2;
  out.push_back({"Sharded stage 2", o});
  o.shard_stage = 3;
  out.push_back({"Sharded stage 3", o});
  return out;
}

struct Run {
  std::vector<float> params;
  std::vector<double> losses;  // the loss of this process's rows, per step
};

/// Trains kSteps Adam steps. `options` null: one plain device on the global batch.
/// The net starts from a seed that differs per process: DataParallel must start every
/// process from process 0's parameters.
Run train(const dp::DataParallelOptions* options, Path path, int accumulate = 1) {
  const bool wrapped = options != nullptr;
  auto net = make_mlp(wrapped ? kSeed + static_cast<std::uint64_t>(dist::rank()) : kSeed);
  std::unique_ptr<dp::DataParallel> model;
  if (wrapped) model = std::make_unique<dp::DataParallel>(net, local_devices(), *options);
  dp::optim::Adam opt(wrapped ? model->parameters() : net->parameters(), {.lr = 1e-2});
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    double loss_sum = 0;
    for (int a = 0; a < accumulate; ++a) {
      const std::int64_t rows = global_rows(s + a);
      Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s * 7 + a));
      if (!wrapped) {
        Tensor loss = loss_fn(net->forward(b.x), b.y);
        loss.backward();
        loss_sum += loss.item();
        continue;
      }
      const auto [lo, n] = my_rows(rows);
      Tensor x = b.x.narrow(0, lo, n), y = b.y.narrow(0, lo, n);
      // Accumulation: every backward but the last under no_sync (DP has nothing to skip).
      const bool skip = a + 1 < accumulate && options->mode == dp::Mode::DDP;
      std::optional<dp::DataParallel::NoSyncGuard> guard;
      if (skip) guard.emplace(*model);
      Tensor loss;
      if (path == Path::Module) {
        loss = loss_fn((*model)(x), y);
        loss.backward();
      } else {
        loss = model->forward_backward(x, y, loss_fn);
      }
      loss_sum += loss.item();
    }
    run.losses.push_back(loss_sum);
    opt.step();
  }
  run.params = flat(net->state_dict());
  return run;
}

/// True when every process holds bitwise the same values as process 0.
bool same_everywhere(const std::vector<float>& v) {
  const std::vector<float> root = dist::broadcast_object(v, 0);
  const std::int64_t differs = (root.size() != v.size() || std::memcmp(root.data(), v.data(), v.size() * 4) != 0) ? 1 : 0;
  return dist::all_reduce(differs, dist::Op::Max) == 0;
}

}  // namespace

namespace {

/// Three SGD steps of `Net` on token batches: every process its rows of each global
/// batch in `options`' design (null: one plain device on the whole batch); with `bf16`
/// the forward and the loss under bfloat16 autocast; with `groups` two parameter groups
/// (matrices at lr 0.1 with momentum, the rest at lr 0.05 without). The parameters after them.
template <class Net>
std::vector<float> train_tokens(const dp::DataParallelOptions* options, bool bf16, bool groups = false) {
  auto net = std::make_shared<Net>(options ? kSeed + static_cast<std::uint64_t>(dist::rank()) : kSeed);
  std::unique_ptr<dp::DataParallel> model;
  if (options) model = std::make_unique<dp::DataParallel>(net, local_devices(), *options);
  const dp::nn::ParameterList params = model ? model->parameters() : net->parameters();
  const auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
  const auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
  dp::optim::SGD opt = groups ? dp::optim::SGD({{matrices, {.momentum = 0.9}}, {others, {.lr = 0.05}}}, {.lr = 0.1})
                              : dp::optim::SGD(params, {.lr = 0.1});
  // Every worker's logits must come in the caller's precision.
  std::atomic<int> wrong_dtype{0};
  auto loss = [&](const Tensor& logits, const Tensor& y) {
    if (logits.dtype() != (bf16 ? dp::Dtype::BFloat16 : dp::Dtype::Float32)) ++wrong_dtype;
    return token_loss(logits, y);
  };
  for (int s = 0; s < 3; ++s) {
    const std::int64_t rows = global_rows(s);
    Batch b = make_token_batch(rows, 500 + static_cast<std::uint64_t>(s));
    opt.zero_grad();
    dp::amp::autocast guard(dp::Dtype::BFloat16, bf16);
    if (!model) {
      loss(net->forward(b.x), b.y).backward();
    } else {
      const auto [lo, n] = my_rows(rows);
      model->forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss);
    }
    opt.step();
  }
  CHECK(wrong_dtype.load() == 0);
  return flat(net->state_dict());
}

/// Whether Net is built of TransformerBlocks (the GPTs), which can be gather units.
template <class Net>
constexpr bool kHasBlocks = std::is_base_of_v<TinyGPT, Net>;

/// train_tokens<Net> in every design across processes against one device (for a GPT,
/// stage 3 also with a gather unit per block): `tol` to one device, the same on every
/// process, and the designs to float rounding.
template <class Net>
void check_tokens_everywhere(bool bf16, double tol, bool groups = false) {
  const std::vector<float> single = train_tokens<Net>(nullptr, bf16, groups);
  std::vector<float> first;
  std::vector<Design> all = designs();
  if constexpr (kHasBlocks<Net>) {
    // FSDP's auto-wrap across processes: each block a stage-3 gather unit.
    Design per_block = all.back();
    per_block.name = "Sharded stage 3, a gather unit per block";
    per_block.options.shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>;
    all.push_back(per_block);
  }
  for (const Design& d : all) {
    CAPTURE(d.name);
    const std::vector<float> got = train_tokens<Net>(&d.options, bf16, groups);
    CHECK(max_diff(got, single) < tol);
    CHECK(same_everywhere(got));
    if (first.empty()) first = got;
    else CHECK(max_diff(got, first) < 1e-6);  // across processes Sharded agrees to float rounding
  }
}

}  // namespace

TEST_CASE("the sequence layers (a tiny causal LM) train the same in every design across processes") {
  // SGD: see tests/parallel/sequence_model_test.cpp.
  check_tokens_everywhere<TinyLM>(false, 2e-5);
}

TEST_CASE("a 2-block GPT (TransformerBlock) trains the same in every design across processes") {
  check_tokens_everywhere<TinyGPT>(false, 2e-5);
}

TEST_CASE("a GPT with tied embedding and head trains the same in every design across processes") {
  check_tokens_everywhere<TiedGPT>(false, 2e-5);
}

TEST_CASE("attention with whole sequences of padding trains the same in every design across processes") {
  // Note [Rows with every key masked]: zeros and no gradient there, on every process.
  check_tokens_everywhere<PaddedMHA>(false, 2e-5);
}

namespace {

/// `rows` rows of make_batch's features with float targets in (0, 1): the elementwise losses'.
Batch soft_batch(std::int64_t rows, std::uint64_t seed) {
  dp::Generator gen(seed);
  const Tensor x = dp::randn({rows, 6}, gen, dp::cpu(0));
  return {x, dp::sigmoid(dp::randn({rows, 3}, gen, dp::cpu(0)))};
}

/// Three SGD steps of `net` with `loss` on batch(global_rows(s), s): every process its
/// rows of each global batch through forward_backward in `options`' design (null: one
/// plain device on the whole batch), under bfloat16 autocast with `bf16`. The
/// parameters after them.
template <class MakeBatch, class Loss>
std::vector<float> train_rows(const std::shared_ptr<dp::nn::Module>& net, const dp::DataParallelOptions* options,
                              const dp::optim::SGDOptions& sgd, MakeBatch batch, const Loss& loss, bool bf16 = false) {
  std::unique_ptr<dp::DataParallel> model;
  if (options) model = std::make_unique<dp::DataParallel>(net, local_devices(), *options);
  dp::optim::SGD opt(model ? model->parameters() : net->parameters(), sgd);
  for (int s = 0; s < 3; ++s) {
    const std::int64_t rows = global_rows(s);
    const Batch b = batch(rows, s);
    opt.zero_grad();
    dp::amp::autocast guard(dp::Dtype::BFloat16, bf16);
    if (!model) {
      loss(net->forward(b.x), b.y).backward();
    } else {
      const auto [lo, n] = my_rows(rows);
      model->forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss);
    }
    opt.step();
  }
  return flat(net->state_dict());
}

/// train_rows of the MLP on soft batches with the descriptor `loss`.
std::vector<float> train_soft(const dp::DataParallelOptions* options, const dp::nn::ShardableLoss& loss) {
  return train_rows(make_mlp(options ? kSeed + static_cast<std::uint64_t>(dist::rank()) : kSeed), options,
                    {.lr = 0.1},
                    [](std::int64_t rows, int s) { return soft_batch(rows, 900 + static_cast<std::uint64_t>(s)); }, loss);
}

}  // namespace

TEST_CASE("the mse, smooth_l1 and BCE-with-logits descriptors train the same in every design across processes") {
  // Their closed-form backwards (PyTorch 2.x's) in every design, as one device's.
  const std::pair<const char*, dp::nn::ShardableLoss> losses[] = {
      {"mse", dp::nn::MSELoss{}},
      {"smooth_l1", dp::nn::SmoothL1Loss{.beta = 0.5}},
      {"bce", dp::nn::BCEWithLogitsLoss{.pos_weight = dp::full({3}, 2.0), .reduction = dp::nn::Reduction::Sum}}};
  for (const auto& [name, loss] : losses) {
    const std::vector<float> single = train_soft(nullptr, loss);
    CHECK(max_diff(single, flat(make_mlp(kSeed)->state_dict())) > 1e-4);  // the steps moved the parameters
    std::vector<float> first;
    for (const Design& d : designs()) {
      CAPTURE(name);
      CAPTURE(d.name);
      const std::vector<float> got = train_soft(&d.options, loss);
      CHECK(max_diff(got, single) < 2e-5);
      CHECK(same_everywhere(got));
      if (first.empty()) first = got;
      else CHECK(max_diff(got, first) < 1e-6);  // across processes Sharded agrees to float rounding
    }
  }
}

TEST_CASE("optimizer parameter groups step the same in every design across processes") {
  check_tokens_everywhere<TiedGPT>(false, 2e-5, /*groups=*/true);
}

namespace {

struct ImageRun {
  std::vector<float> state;   // parameters and buffers
  std::vector<float> params;  // parameters only
  bool every_device_channels_last = false;  // every local device's first convolution computed channels-last
};

/// Three SGD steps (momentum 0.9) of SmallConvNet (mlp_fixture.h), with batch norm when
/// `batch_norm`, on image batches laid out channels-last when `channels_last`: every
/// process its rows of each global batch in `options`' design (null: one plain device
/// on the whole batch).
ImageRun train_images(const dp::DataParallelOptions* options, bool batch_norm, bool channels_last) {
  auto net = std::make_shared<SmallConvNet>(options ? kSeed + static_cast<std::uint64_t>(dist::rank()) : kSeed,
                                            batch_norm);
  std::unique_ptr<dp::DataParallel> model;
  if (options) model = std::make_unique<dp::DataParallel>(net, local_devices(), *options);
  dp::optim::SGD opt(model ? model->parameters() : net->parameters(), {.lr = 0.05, .momentum = 0.9});
  for (int s = 0; s < 3; ++s) {
    const std::int64_t rows = global_rows(s);
    Batch b = make_image_batch(rows, 700 + static_cast<std::uint64_t>(s), channels_last);
    opt.zero_grad();
    if (!model) {
      loss_fn(net->forward(b.x), b.y).backward();
    } else {
      const auto [lo, n] = my_rows(rows);
      model->forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    }
    opt.step();
  }
  ImageRun run{flat(net->state_dict()), {}, true};
  for (const Tensor& p : net->parameters()) {
    const std::vector<float> v = p.to_vector();
    run.params.insert(run.params.end(), v.begin(), v.end());
  }
  std::vector<int> seen(static_cast<std::size_t>(options ? kLocal : 1), 0);
  for (const auto& [device, format] : net->layouts) {
    if (format != dp::MemoryFormat::ChannelsLast) run.every_device_channels_last = false;
    if (device >= 0 && device < static_cast<int>(seen.size())) seen[static_cast<std::size_t>(device)] = 1;
  }
  for (int v : seen) run.every_device_channels_last = run.every_device_channels_last && v == 1;
  return run;
}

}  // namespace

TEST_CASE("channels-last batches train in every design across processes as one device, and as NCHW ones") {
  // Without batch norm: one device's gradient of the global batch, to float rounding.
  const ImageRun single = train_images(nullptr, false, true);
  CHECK(single.every_device_channels_last);
  std::vector<float> first;
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    const ImageRun cl = train_images(&d.options, false, true);
    CHECK(cl.every_device_channels_last);
    CHECK(max_diff(cl.state, single.state) < 2e-5);
    CHECK(max_diff(cl.state, train_images(&d.options, false, false).state) < 2e-5);
    CHECK(same_everywhere(cl.state));
    if (first.empty()) first = cl.state;
    else CHECK(max_diff(cl.state, first) < 1e-6);  // across processes Sharded agrees to float rounding
  }
  // With batch norm each device normalises its own rows: the same design with NCHW
  // batches is the reference. Parameters agree on every process; the running
  // statistics are each process's device 0's (by design), so only parameters compare.
  first.clear();
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    const ImageRun cl = train_images(&d.options, true, true);
    CHECK(cl.every_device_channels_last);
    CHECK(max_diff(cl.params, train_images(&d.options, true, false).params) < 2e-5);
    CHECK(same_everywhere(cl.params));
    if (first.empty()) first = cl.params;
    else CHECK(max_diff(cl.params, first) < 1e-6);
  }
}

TEST_CASE("bfloat16 autocast reaches every worker of every process: a GPT in every design against one device") {
  // The shards' gradients are rounded to bfloat16 before they are summed: one device
  // agrees to bfloat16 rounding (Note [Autocast op policy]).
  check_tokens_everywhere<TinyGPT>(true, 2e-2);
}

namespace {

/// Three SGD steps of InplaceForward (a forward that writes in place, mlp_fixture.h):
/// every process its rows of each global batch in `options`' design (null: one plain
/// device on the whole batch), under bfloat16 autocast with `bf16`. The parameters after.
std::vector<float> train_inplace(const dp::DataParallelOptions* options, bool bf16) {
  return train_rows(std::make_shared<InplaceForward>(options ? kSeed + static_cast<std::uint64_t>(dist::rank()) : kSeed),
                    options, {.lr = 0.1, .momentum = 0.9},
                    [](std::int64_t rows, int s) { return make_batch(rows, 600 + static_cast<std::uint64_t>(s)); },
                    loss_fn, bf16);
}

}  // namespace

TEST_CASE("a forward that writes in place trains the same in every design across processes") {
  // Note [Sources of in-place writes]: a broadcast parameter added into a layer's output
  // (bfloat16 under autocast, the sum in float32 rounded once), a parameter copied into
  // a buffer; each worker of each process records the writes.
  for (const bool bf16 : {false, true}) {
    CAPTURE(bf16);
    const std::vector<float> single = train_inplace(nullptr, bf16);
    std::vector<float> first;
    for (const Design& d : designs()) {
      CAPTURE(d.name);
      const std::vector<float> got = train_inplace(&d.options, bf16);
      CHECK(max_diff(got, single) < (bf16 ? 5e-3 : 2e-5));
      CHECK(same_everywhere(got));
      if (first.empty()) first = got;
      else CHECK(max_diff(got, first) < 1e-6);
    }
  }
}

namespace {

/// Note [Parameters without a gradient]: three AdamW steps (weight decay on) of
/// ThreeLinear whose middle layer is used at step 0 by every process, at step 1 by
/// process 0 only, at step 2 by none. The parameters, and the middle layer's weight
/// after each step.
std::pair<std::vector<float>, std::vector<std::vector<float>>> train_unused(const dp::DataParallelOptions& options) {
  auto net = std::make_shared<ThreeLinear>(kSeed + static_cast<std::uint64_t>(dist::rank()));
  dp::DataParallel model(net, local_devices(), options);
  dp::optim::AdamW opt(model.parameters(), {.lr = 0.05, .weight_decay = 0.1});
  std::vector<std::vector<float>> mid;
  for (int s = 0; s < 3; ++s) {
    net->use_mid = s == 0 || (s == 1 && dist::rank() == 0);
    const std::int64_t rows = global_rows(s);
    const Batch b = make_batch(rows, 700 + static_cast<std::uint64_t>(s));
    const auto [lo, n] = my_rows(rows);
    opt.zero_grad();
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    opt.step();
    mid.push_back(net->mid->parameters()[0].to_vector());
  }
  return {flat(net->state_dict()), mid};
}

}  // namespace

TEST_CASE("a parameter one process reaches is stepped on every process; one that none reaches, on none") {
  std::vector<float> first;
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    const auto [got, mid] = train_unused(d.options);
    CHECK(same_everywhere(got));  // every process stepped the same parameters
    CHECK(mid[1] != mid[0]);      // process 0's gradient alone moves it everywhere
    CHECK(mid[2] == mid[1]);      // no process reached it: not stepped, no weight decay
    if (first.empty()) first = got;
    else CHECK(max_diff(got, first) < 1e-6);
  }
}

TEST_CASE("the job spans every process: world_devices, processes, the shards over every device") {
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::Sharded, .shard_stage = 1});
  CHECK(model.processes() == dist::world_size());
  CHECK(model.world_devices() == dist::world_size() * kLocal);
  // This process's devices own world ranges first_rank .. first_rank + kLocal - 1.
  const auto shards = model.shards();
  REQUIRE(shards.size() == static_cast<std::size_t>(kLocal));
  const std::int64_t len = shards[0].second - shards[0].first;
  for (int i = 0; i < kLocal; ++i) {
    const std::int64_t w = dist::rank() * kLocal + i;
    CHECK(shards[static_cast<std::size_t>(i)].first == len * w);
    CHECK(shards[static_cast<std::size_t>(i)].second == len * (w + 1));
  }
  CHECK(len * model.world_devices() >= net->parameter_set()->numel());
}

// ---- gradients on the wire in 16 bits across processes -----------------------------
// Note [Gradients on the wire] in src/parallel/grad_wire.h: a gradient crosses two hops,
// each summing its 16-bit inputs in float32 in a fixed order and rounding once — the
// devices of a process, then the processes. With one device per process the first hop
// is empty, which is the one hop of one process over P devices: the same run, bit for bit.

namespace {

dp::DataParallelOptions with_wire(dp::DataParallelOptions o, dp::Dtype wire) {
  o.mixed_precision.reduce_dtype = wire;
  return o;
}

/// x rounded to `dtype` and widened back, element by element (Tensor::to's bits).
std::vector<float> rounded(const std::vector<float>& x, dp::Dtype dtype) {
  return dp::from_vector(x, {static_cast<std::int64_t>(x.size())}).to(dtype).to(dp::Dtype::Float32).to_vector();
}

/// Every device's own gradient of one forward_backward on its share of the global batch
/// b (this process's rows, on `l` devices; a DDP backward inside no_sync keeps what each
/// worker computed), in world rank order, on every process.
std::vector<std::vector<float>> world_grads(int l, const Batch& b) {
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(l), {.mode = dp::Mode::DDP});
  {
    auto guard = model.no_sync();
    const auto [lo, n] = my_rows(b.x.size(0));
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
  }
  std::vector<std::vector<float>> all;
  for (int p = 0; p < dist::world_size(); ++p)
    for (int j = 0; j < l; ++j) {
      std::vector<float> g;
      if (p == dist::rank()) g = model.parameters().set()->copy(j).grad.to(dp::cpu(0)).to_vector();
      all.push_back(dist::broadcast_object(g, p));
    }
  return all;
}

/// The sum the note promises over P processes of l devices: within each process the
/// devices' rounded gradients added in float32 in device order and rounded once, then
/// those partial sums added in float32 in process order and rounded once. One device in
/// the whole job puts nothing on a wire.
std::vector<float> wire_sum(const std::vector<std::vector<float>>& g, int l, dp::Dtype wire) {
  if (g.size() == 1) return g[0];
  std::vector<float> total;
  for (std::size_t first = 0; first < g.size(); first += static_cast<std::size_t>(l)) {
    std::vector<float> acc = rounded(g[first], wire);
    for (int j = 1; j < l; ++j) {
      const std::vector<float> gj = rounded(g[first + static_cast<std::size_t>(j)], wire);
      for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += gj[i];
    }
    acc = rounded(acc, wire);
    if (total.empty()) {
      total = acc;
    } else {
      for (std::size_t i = 0; i < acc.size(); ++i) total[i] += acc[i];
    }
  }
  return rounded(total, wire);
}

struct WireStep {
  std::vector<float> params;           // after one SGD step with lr 1: p - g, exactly
  std::int64_t grad_bytes = 0;         // device 0's, for the one backward
  std::int64_t process_bytes = 0;      // between processes, every local rank's, that backward
};

/// One zero_grad, forward_backward (this process's rows of b) and SGD(lr = 1) step in
/// `options` on l devices per process.
WireStep step_once(int l, const dp::DataParallelOptions& options, const Batch& b) {
  auto net = make_mlp(kSeed + static_cast<std::uint64_t>(dist::rank()));
  dp::DataParallel model(net, local_devices(l), options);
  dp::optim::SGD opt(model.parameters(), {.lr = 1.0});
  model.reset_stats();
  opt.zero_grad();
  const auto [lo, n] = my_rows(b.x.size(0));
  model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
  WireStep out;
  out.grad_bytes = model.stats().devices[0].grad_bytes;
  for (int j = 0; j < l; ++j)
    for (std::int64_t bytes : model.communicator().process_times(j).bytes) out.process_bytes += bytes;
  opt.step();
  out.params = flat(net->state_dict());
  return out;
}

constexpr dp::Dtype kWires[] = {dp::Dtype::BFloat16, dp::Dtype::Float16};

/// Rows of the global batch of train_wire: uneven over the processes (5, 4, 4 for 3).
std::int64_t wire_rows() { return 4 * dist::world_size() + 1; }

/// `steps` steps of `net` on global batches of wire_rows() (`batch(rows, step)`): across
/// processes, this process's rows on one device; `alone`, one process trains the whole
/// batch on P devices cut as the processes cut it (chunk_sizes), alone. The parameters
/// after them.
template <class MakeOpt, class MakeBatch, class Loss>
std::vector<float> train_per_process(const std::shared_ptr<dp::nn::Module>& net, dp::DataParallelOptions options,
                                     bool alone, int steps, MakeOpt make_opt, MakeBatch batch, Loss loss) {
  const int p = dist::world_size();
  const std::int64_t rows = wire_rows();
  if (alone) {
    options.span_processes = false;
    for (int r = 0; r < p; ++r) options.chunk_sizes.push_back(rows / p + (r < rows % p ? 1 : 0));
  }
  dp::DataParallel model(net, local_devices(alone ? p : 1), options);
  auto opt = make_opt(model.parameters());
  for (int s = 0; s < steps; ++s) {
    Batch b = batch(rows, s);
    opt->zero_grad();
    const auto [lo, n] = alone ? std::pair<std::int64_t, std::int64_t>{0, rows} : my_rows(rows);
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss);
    opt->step();
  }
  return flat(net->state_dict());
}

/// kSteps Adam steps of the MLP (train_per_process).
std::vector<float> train_wire(const dp::DataParallelOptions& options, bool alone) {
  return train_per_process(
      make_mlp(kSeed), options, alone, kSteps,
      [](const dp::nn::ParameterList& ps) { return std::make_unique<dp::optim::Adam>(ps, dp::optim::AdamOptions{.lr = 1e-2}); },
      [](std::int64_t rows, int s) { return make_batch(rows, 300 + static_cast<std::uint64_t>(s)); }, loss_fn);
}

}  // namespace

TEST_CASE("reduce_dtype bf16 / fp16 across processes: every design sums one rounding per hop, in half the bytes") {
  const Batch b = make_batch(global_rows(0), 11);
  const std::vector<float> p0 = flat(make_mlp(kSeed)->state_dict());
  for (int l : {1, kLocal}) {
    const std::vector<std::vector<float>> grads = world_grads(l, b);
    const bool wired = dist::world_size() * l > 1;
    for (dp::Dtype wire : kWires) {
      // p - 1 * g with g the promised sum: SGD's update with lr 1 is exact.
      const std::vector<float> g = wire_sum(grads, l, wire);
      std::vector<float> expected(p0.size());
      for (std::size_t i = 0; i < p0.size(); ++i) expected[i] = p0[i] - g[i];
      for (const Design& d : designs()) {
        CAPTURE(l);
        const std::string names = std::string(dp::dtype_name(wire)) + " " + d.name;
        CAPTURE(names);
        const WireStep w16 = step_once(l, with_wire(d.options, wire), b);
        CHECK(w16.params == expected);
        CHECK(same_everywhere(w16.params));
        const WireStep w32 = step_once(l, d.options, b);
        if (wired) CHECK(w16.params != w32.params);  // the wire did round
        // Half float32's bytes, on each device and between processes.
        const std::int64_t numel = static_cast<std::int64_t>(p0.size());
        CHECK(w32.grad_bytes == (wired ? numel * 4 : 0));
        CHECK(w16.grad_bytes == (wired ? numel * 2 : 0));
        CHECK(w16.process_bytes * 2 == w32.process_bytes);
        CHECK((w32.process_bytes > 0) == (dist::world_size() > 1));
      }
    }
  }
}

TEST_CASE("reduce_dtype bf16 / fp16 on one device per process: every design is, bit for bit, one process of P devices") {
  // The first hop is empty: the processes' sum is the one process's over its devices.
  for (dp::Dtype wire : kWires) {
    std::vector<float> first;
    for (const Design& d : designs()) {
      const std::string names = std::string(dp::dtype_name(wire)) + " " + d.name;
      CAPTURE(names);
      const std::vector<float> across = train_wire(with_wire(d.options, wire), /*alone=*/false);
      const std::vector<float> alone = train_wire(with_wire(d.options, wire), /*alone=*/true);
      CHECK(across == alone);
      CHECK(same_everywhere(across));
      if (first.empty()) first = across;
      CHECK(across == first);  // the designs agree bit for bit
    }
    if (dist::world_size() > 1) CHECK(first != train_wire(designs()[1].options, false));  // the wire did round
  }
}

TEST_CASE("param_dtype bf16 / fp16 across processes: one device per process is, bit for bit, one process of P devices") {
  // Note [Parameters in low precision]: each device casts its own float32 parameters (stage
  // 3: its own range, which the process's devices gather in param_dtype), and the
  // gradients cross the two hops in param_dtype (reduce_dtype's default).
  for (dp::Dtype dtype : kWires) {
    std::vector<float> first;
    for (const Design& d : designs()) {
      const std::string names = std::string(dp::dtype_name(dtype)) + " " + d.name;
      CAPTURE(names);
      dp::DataParallelOptions o = d.options;
      o.mixed_precision.param_dtype = dtype;
      const std::vector<float> across = train_wire(o, /*alone=*/false);
      CHECK(across == train_wire(o, /*alone=*/true));
      CHECK(same_everywhere(across));
      if (first.empty()) first = across;
      CHECK(across == first);  // the designs agree bit for bit
    }
    CHECK(first != train_wire(with_wire(designs()[1].options, dtype), false));  // the compute was 16-bit
  }
}

TEST_CASE("reduce_dtype bf16 / fp16 across processes of 2 devices: the designs agree bit for bit, and with one device to 16-bit rounding") {
  const Run single = train(nullptr, Path::ForwardBackward);
  for (dp::Dtype wire : kWires) {
    std::vector<float> first;
    for (const Design& d : designs()) {
      const std::string names = std::string(dp::dtype_name(wire)) + " " + d.name;
      CAPTURE(names);
      const dp::DataParallelOptions o = with_wire(d.options, wire);
      const Run run = train(&o, Path::ForwardBackward);
      // Adam's steps of lr 1e-2 on a gradient rounded to 8 (bfloat16) or 11 (float16)
      // significant bits: where an element's gradient is near zero, m / sqrt(v) moves by
      // a good part of lr per step whichever way the rounding tips it.
      CHECK(max_diff(run.params, single.params) < (wire == dp::Dtype::BFloat16 ? 3e-2 : 3e-3));
      CHECK(same_everywhere(run.params));
      if (first.empty()) first = run.params;
      CHECK(max_diff(run.params, first) == 0.0);
      const Run again = train(&o, Path::ForwardBackward);
      CHECK(max_diff(again.params, run.params) == 0.0);  // bitwise reproducible
    }
  }
}

namespace {

/// Three SGD steps of a GPT whose blocks drop attention weights and residuals (fused
/// kernel; train_per_process), each process's net built from a seed of its own
/// (construction takes process 0's parameters and dropout seeds).
std::vector<float> train_dropout(const dp::DataParallelOptions& options, bool alone) {
  return train_per_process(
      std::make_shared<DropoutGPT>(alone ? kSeed : kSeed + static_cast<std::uint64_t>(dist::rank())), options, alone,
      3, [](const dp::nn::ParameterList& ps) { return std::make_unique<dp::optim::SGD>(ps, dp::optim::SGDOptions{.lr = 0.1}); },
      [](std::int64_t rows, int s) { return make_token_batch(rows, 700 + static_cast<std::uint64_t>(s)); }, token_loss);
}

}  // namespace

TEST_CASE("attention dropout across processes: every device of the job draws its own masks, as in one process") {
  // Note [Dropout across processes]: device 0 of process p draws stream p of process
  // 0's seed, so one device per process is, bit for bit, one process of P devices.
  dp::nn::set_attention_path(dp::nn::AttentionPath::Fused);  // a call it does not fit throws
  std::vector<float> first;
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    const std::vector<float> across = train_dropout(d.options, /*alone=*/false);
    CHECK(across == train_dropout(d.options, /*alone=*/true));
    CHECK(same_everywhere(across));
    if (first.empty()) first = across;
    CHECK(across == first);  // the designs agree bit for bit
  }
  dp::nn::set_attention_path(dp::nn::AttentionPath::Auto);
}

TEST_CASE("reset_stats() also resets the time spent between processes") {
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::DDP});
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  auto [x, y] = make_batch(global_rows(0) / dist::world_size() + 1, 7);
  auto step = [&] {
    opt.zero_grad();
    model.forward_backward(x, y, loss_fn);
    opt.step();
  };
  step();
  const auto crossed = [&] {
    double ms = 0;
    std::int64_t calls = 0;
    for (int i = 0; i < kLocal; ++i) {
      const auto t = model.communicator().process_times(i);
      ms += t.total_ms();
      for (std::int64_t c : t.calls) calls += c;
    }
    return std::make_pair(ms, calls);
  };
  // One process: nothing crosses (zeros before and after). Several: the DDP all-reduce did.
  if (dist::world_size() > 1) CHECK(crossed().second > 0);
  model.reset_stats();
  CHECK(crossed().first == 0.0);
  CHECK(crossed().second == 0);
  step();
  if (dist::world_size() > 1) CHECK(crossed().second > 0);
}

TEST_CASE("every process starts from process 0's parameters") {
  auto net = make_mlp(kSeed + static_cast<std::uint64_t>(dist::rank()));
  dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::DDP});
  const std::vector<float> p = flat(net->state_dict());
  CHECK(same_everywhere(p));
  CHECK(max_diff(p, flat(make_mlp(kSeed)->state_dict())) == 0.0);
}

TEST_CASE("DP, DDP and Sharded across processes match one device on the global batch") {
  const Run ref = train(nullptr, Path::ForwardBackward);
  for (Path path : {Path::ForwardBackward, Path::Module}) {
    std::vector<float> first;
    for (const Design& d : designs()) {
      CAPTURE(d.name);
      CAPTURE(path == Path::Module ? "model(x) + backward" : "forward_backward");
      const Run run = train(&d.options, path);
      // Sums group by process here, by device in the reference: float rounding only.
      CHECK(max_diff(run.params, ref.params) < 2e-5);
      // Every process holds the same parameters: rank 0 may save them alone.
      CHECK(same_everywhere(run.params));
      // The designs sum in the same order (devices of a process, then processes).
      if (first.empty()) first = run.params;
      CHECK(max_diff(run.params, first) == 0.0);
      // The loss each process reports is its own rows' mean; weighted by rows they
      // make the global batch's mean.
      for (int s = 0; s < kSteps; ++s) {
        const std::int64_t rows = global_rows(s);
        const double mine = run.losses[static_cast<std::size_t>(s)] * static_cast<double>(my_rows(rows).second);
        const double global = dist::all_reduce(mine, dist::Op::Sum) / static_cast<double>(rows);
        CHECK(std::abs(global - ref.losses[static_cast<std::size_t>(s)]) < 1e-4);
      }
    }
  }
}

TEST_CASE("a run across processes is bitwise reproducible") {
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    const Run a = train(&d.options, Path::ForwardBackward);
    const Run b = train(&d.options, Path::ForwardBackward);
    CHECK(max_diff(a.params, b.params) == 0.0);
  }
}

TEST_CASE("gradient accumulation with no_sync across processes") {
  const Run ref = train(nullptr, Path::ForwardBackward, /*accumulate=*/2);
  for (const Design& d : designs()) {
    if (d.options.mode == dp::Mode::Sharded) continue;  // stage 2 accumulates without no_sync; covered above
    CAPTURE(d.name);
    const Run run = train(&d.options, Path::ForwardBackward, 2);
    CHECK(max_diff(run.params, ref.params) < 2e-5);
    CHECK(same_everywhere(run.params));
  }
}

// Note [Input gradients of forward_backward] across processes: an encoder outside the
// wrapper gets, on each process, the gradient of the job's loss through its own rows;
// summed over the processes that is one device's gradient on the global batch.
TEST_CASE("forward_backward's input gradients reach the layers that made the input, across processes") {
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    dp::Generator gen(21), ref_gen(21);
    auto enc = std::make_shared<dp::nn::Linear>(6, 6, true, &gen);
    auto enc_ref = std::make_shared<dp::nn::Linear>(6, 6, true, &ref_gen);
    auto net = make_mlp(kSeed), ref = make_mlp(kSeed);
    dp::DataParallel model(net, local_devices(), d.options);
    const std::int64_t rows = global_rows(1);
    const Batch b = make_batch(rows, 300);
    const auto [lo, n] = my_rows(rows);
    (void)model.forward_backward(enc->forward(b.x.narrow(0, lo, n)), b.y.narrow(0, lo, n), loss_fn);
    loss_fn(ref->forward(enc_ref->forward(b.x)), b.y).backward();
    for (std::size_t i = 0; i < 2; ++i) {
      CAPTURE(i);
      REQUIRE(enc->parameters()[i].grad().defined());
      std::vector<float> mine = enc->parameters()[i].grad().to_vector();
      std::vector<double> sum(mine.begin(), mine.end());
      dist::all_reduce(std::span<double>(sum), dist::Op::Sum);
      const std::vector<float> want = enc_ref->parameters()[i].grad().to_vector();
      REQUIRE(sum.size() == want.size());
      double worst = 0;
      for (std::size_t j = 0; j < sum.size(); ++j) worst = std::max(worst, std::abs(sum[j] - want[j]));
      CHECK(worst < 1e-6);
    }
  }
}

namespace {

/// Steps [first, last) of the global batches on `model`: across processes each passes
/// its own rows; a model within one process (processes() == 1) takes every row.
void steps(dp::DataParallel& model, dp::optim::Optimizer& opt, int first, int last) {
  for (int s = first; s < last; ++s) {
    const std::int64_t rows = global_rows(s);
    Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s * 7));
    const auto [lo, n] = model.processes() > 1 ? my_rows(rows) : std::pair<std::int64_t, std::int64_t>{0, rows};
    opt.zero_grad();
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    opt.step();
  }
}

std::string checkpoint_path(const char* what) {
  // One file per job: process 0's pid names it, and every process learns it.
  const std::string mine = dp::detail::str_cat("/tmp/dp_mpi_test_", ::getpid(), "_", what, ".ckpt");
  return dist::broadcast_object(mine, 0);
}

}  // namespace

TEST_CASE("a training checkpoint resumes on another topology: P x 2 devices <-> 1 x 2P") {
  if (!dist::is_distributed()) return;
  const int world = dist::world_size() * kLocal;
  const dp::DataParallelOptions ddp{.mode = dp::Mode::DDP};
  dp::DataParallelOptions alone = ddp;
  alone.span_processes = false;
  // The run without a break, across processes.
  std::vector<float> straight;
  {
    auto net = make_mlp(kSeed);
    dp::DataParallel model(net, local_devices(), ddp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    steps(model, opt, 0, kSteps);
    straight = flat(net->state_dict());
  }
  const int half = kSteps / 2;
  SUBCASE("P processes save, one process of 2P devices resumes") {
    const std::string path = checkpoint_path("across");
    auto net = make_mlp(kSeed);
    dp::DataParallel model(net, local_devices(), ddp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    steps(model, opt, 0, half);
    if (dist::is_main()) dp::save_training_checkpoint(path, *net, opt, at_step(half));
    dist::barrier();
    if (dist::is_main()) {
      auto fresh = make_mlp(kSeed + 99);
      dp::DataParallel single(fresh, local_devices(world), alone);
      CHECK(single.processes() == 1);
      dp::optim::Adam opt2(single.parameters(), {.lr = 1e-2});
      dp::TrainingState st;
      dp::load_training_checkpoint(path, *fresh, opt2, st);
      CHECK(st.step == half);
      steps(single, opt2, half, kSteps);
      CHECK(max_diff(flat(fresh->state_dict()), straight) < 2e-5);
      std::remove(path.c_str());
    }
    dist::barrier();
  }
  SUBCASE("one process of 2P devices saves, P processes resume") {
    const std::string path = checkpoint_path("alone");
    if (dist::is_main()) {
      auto net = make_mlp(kSeed);
      dp::DataParallel single(net, local_devices(world), alone);
      dp::optim::Adam opt(single.parameters(), {.lr = 1e-2});
      steps(single, opt, 0, half);
      dp::save_training_checkpoint(path, *net, opt, at_step(half));
    }
    dist::barrier();
    auto fresh = make_mlp(kSeed + 7);
    dp::DataParallel model(fresh, local_devices(), ddp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    dp::TrainingState st;
    dp::load_training_checkpoint(path, *fresh, opt, st);
    CHECK(st.step == half);
    steps(model, opt, half, kSteps);
    const std::vector<float> p = flat(fresh->state_dict());
    CHECK(max_diff(p, straight) < 2e-5);
    CHECK(same_everywhere(p));
    dist::barrier();
    if (dist::is_main()) std::remove(path.c_str());
  }
}

namespace {

/// The MLP with a Dropout after its first ReLU (stream per device of the job).
std::shared_ptr<dp::nn::Sequential> make_dropout_mlp(std::uint64_t seed) {
  dp::Generator gen(seed);
  auto net = std::make_shared<dp::nn::Sequential>();
  net->push_back(std::make_shared<dp::nn::Linear>(6, 16, true, &gen));
  net->push_back(std::make_shared<dp::nn::ReLU>());
  net->push_back(std::make_shared<dp::nn::Dropout>(0.5, seed + 1));
  net->push_back(std::make_shared<dp::nn::Linear>(16, 3, true, &gen));
  return net;
}

/// Steps [first, last) of batches that every topology of the job's devices cuts alike:
/// 3 rows per device, whether P processes of kLocal devices or one process of P * kLocal
/// take them (so device d draws stream d on the same 3 x 16 activations either way).
void even_steps(dp::DataParallel& model, dp::optim::Optimizer& opt, int first, int last) {
  const std::int64_t rows = 3 * dist::world_size() * kLocal;
  for (int s = first; s < last; ++s) {
    Batch b = make_batch(rows, 500 + static_cast<std::uint64_t>(s));
    const auto [lo, n] = model.processes() > 1 ? my_rows(rows) : std::pair<std::int64_t, std::int64_t>{0, rows};
    opt.zero_grad();
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    opt.step();
  }
}

}  // namespace

TEST_CASE("a training checkpoint with Dropout resumes with the uninterrupted run's masks on any topology") {
  // Note [Dropout streams in a checkpoint]: the save gathers every process's streams
  // (collective), the file numbers them by the job's devices, and a load (before or
  // after the DataParallel) aims each process's copies at its own. Every design.
  if (!dist::is_distributed()) return;
  const int world = dist::world_size() * kLocal;
  const int half = kSteps / 2;
  for (const Design& design : designs()) {
    const dp::DataParallelOptions across = design.options;
    dp::DataParallelOptions alone = across;
    alone.span_processes = false;
    CAPTURE(design.name);
    std::vector<float> straight;
    {
      auto net = make_dropout_mlp(kSeed);
      dp::DataParallel model(net, local_devices(), across);
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      even_steps(model, opt, 0, kSteps);
      straight = flat(net->state_dict());
    }
    {
      // The masks matter: devices that draw other masks end elsewhere.
      auto net = make_dropout_mlp(kSeed);
      dp::DataParallel model(net, local_devices(), across);
      dynamic_cast<dp::nn::Dropout&>(*net->named_children()[2].second).set_seed(kSeed + 2);
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      even_steps(model, opt, 0, kSteps);
      CHECK(max_diff(flat(net->state_dict()), straight) > 1e-3);
    }
    // P processes save: every process calls, one writes.
    const std::string across_path = checkpoint_path("dropout_across");
    {
      auto net = make_dropout_mlp(kSeed);
      dp::DataParallel model(net, local_devices(), across);
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      even_steps(model, opt, 0, half);
      dp::save_training_checkpoint(across_path, *net, opt, at_step(half), /*write=*/dist::is_main());
    }
    dist::barrier();
    {
      INFO("P processes resume: bit for bit, the same topology");
      auto fresh = make_dropout_mlp(kSeed + 40 + static_cast<std::uint64_t>(dist::rank()));
      dp::DataParallel model(fresh, local_devices(), across);
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      dp::TrainingState st;
      dp::load_training_checkpoint(across_path, *fresh, opt, st);
      even_steps(model, opt, half, kSteps);
      CHECK(flat(fresh->state_dict()) == straight);
    }
    if (dist::is_main()) {
      INFO("one process of 2P devices resumes: the sums group otherwise");
      auto fresh = make_dropout_mlp(kSeed + 99);
      dp::DataParallel single(fresh, local_devices(world), alone);
      dp::optim::Adam opt(single.parameters(), {.lr = 1e-2});
      dp::TrainingState st;
      dp::load_training_checkpoint(across_path, *fresh, opt, st);
      even_steps(single, opt, half, kSteps);
      CHECK(max_diff(flat(fresh->state_dict()), straight) < 2e-5);
    }
    dist::barrier();
    if (dist::is_main()) std::remove(across_path.c_str());
    // One process of 2P devices saves; P processes resume, loading after the
    // DataParallel is built or before (its construction then hands out the streams).
    const std::string alone_path = checkpoint_path("dropout_alone");
    if (dist::is_main()) {
      auto net = make_dropout_mlp(kSeed);
      dp::DataParallel single(net, local_devices(world), alone);
      dp::optim::Adam opt(single.parameters(), {.lr = 1e-2});
      even_steps(single, opt, 0, half);
      dp::save_training_checkpoint(alone_path, *net, opt, at_step(half));
    }
    dist::barrier();
    for (const bool load_first : {false, true}) {
      CAPTURE(load_first);
      auto fresh = make_dropout_mlp(kSeed + 7 + static_cast<std::uint64_t>(dist::rank()));
      dp::optim::Adam opt(fresh->parameters(), {.lr = 1e-2});
      dp::TrainingState st;
      std::optional<dp::DataParallel> model;
      if (load_first) dp::load_training_checkpoint(alone_path, *fresh, opt, st);
      model.emplace(fresh, local_devices(), across);
      if (!load_first) dp::load_training_checkpoint(alone_path, *fresh, opt, st);
      CHECK(st.step == half);
      even_steps(*model, opt, half, kSteps);
      const std::vector<float> p = flat(fresh->state_dict());
      CHECK(max_diff(p, straight) < 2e-5);
      CHECK(same_everywhere(p));
    }
    dist::barrier();
    if (dist::is_main()) std::remove(alone_path.c_str());
  }
}

namespace {

/// Whether `v` is, bit for bit, what process 0 holds.
bool same_as_process_0(const std::vector<float>& v) {
  const std::vector<float> first = dist::broadcast_object(v, 0);
  const std::int64_t differ = first.size() != v.size() || std::memcmp(first.data(), v.data(), v.size() * sizeof(float)) != 0;
  return dist::all_reduce(differ, dist::Op::Max) == 0;
}

/// What one step of `options` across processes does when `edit` (run on this process
/// after the backward, then `tail`) edits the gradients: the step's error, or "".
/// Then zero_grad and a plain step: every process must hold process 0's parameters.
std::string step_after(const dp::DataParallelOptions& options, const std::function<void(dp::nn::Module&)>& edit,
                       const std::function<void(dp::DataParallel&, const Batch&)>& tail = {}) {
  dp::DataParallelOptions o = options;
  o.collective_timeout = std::chrono::seconds(30);  // a hang ends the test, not the suite's budget
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), o);
  dp::optim::SGD opt(model.parameters(), {.lr = 0.1});
  const std::int64_t global = global_rows(0);
  const Batch b = make_batch(global, 77);
  const auto [lo, n] = my_rows(global);
  const Batch mine{b.x.narrow(0, lo, n), b.y.narrow(0, lo, n)};
  std::string error;
  try {
    opt.zero_grad();
    loss_fn(model(mine.x), mine.y).backward();
    edit(*net);
    if (tail) tail(model, mine);
    opt.step();
  } catch (const dp::Error& e) {
    error = e.what();
  }
  opt.zero_grad();
  loss_fn(model(mine.x), mine.y).backward();
  opt.step();
  CHECK(same_as_process_0(flat(net->state_dict())));
  if (options.mode == dp::Mode::DDP) CHECK_NOTHROW(model.check_replicas());
  return error;
}

void scale_grads(dp::nn::Module& net, float by) {
  dp::NoGradGuard no_grad;
  for (dp::Tensor p : net.parameters()) p.grad().mul_(by);
}

}  // namespace

// Note [Refusals across processes]: an edit of device 0's gradients made in one process
// only used to part DP's processes silently (2.1 apart in a probe) and to hang DDP's
// (one process broadcast the edited gradient, the others waited elsewhere until
// collective_timeout); Sharded refused in that process only, and the others hung.
TEST_CASE("an edit of the gradients in one process only is refused in every process; equal edits pass") {
  if (!dist::is_distributed()) return;
  const bool last = dist::rank() == dist::world_size() - 1;
  for (const Design& d : designs()) {
    if (d.options.shard_stage.value_or(1) > 1) continue;  // stages 2-3 keep no .grad to edit (refused apart)
    CAPTURE(d.name);
    const std::string alone = step_after(d.options, [&](dp::nn::Module& net) {
      if (last) scale_grads(net, 2.0f);
    });
    CAPTURE(alone);
    if (d.options.mode == dp::Mode::Sharded) {
      CHECK(alone.find(last ? "edited through parameters() by hand" : "refused by process") != std::string::npos);
    } else {
      CHECK(alone.find("differ between the processes") != std::string::npos);
      // The same edit everywhere is a legitimate one: the step takes it.
      CHECK(step_after(d.options, [](dp::nn::Module& net) { scale_grads(net, 0.5f); }).empty());
      // An edit in one process, then a second backward without zero_grad: the sums of
      // the first are forgotten on every process but process 0, and its edit with them.
      const std::string carried = step_after(
          d.options, [&](dp::nn::Module& net) { if (last) scale_grads(net, 2.0f); },
          [](dp::DataParallel& model, const Batch& mine) { loss_fn(model(mine.x), mine.y).backward(); });
      CAPTURE(carried);
      CHECK(carried.find("a backward after device 0's gradients were edited") != std::string::npos);
    }
  }
  // A forward through the module itself in one process only, in every design.
  for (const Design& d : designs()) {
    CAPTURE(d.name);
    if (d.options.shard_stage == 3) continue;  // its parameters are released between the wrapper's uses
    const std::int64_t global = global_rows(1);
    const Batch extra = make_batch(global, 78);
    CHECK(step_after(d.options, [](dp::nn::Module&) {}).empty());  // nothing edited: the step runs
    const std::string alone = step_after(d.options, [&](dp::nn::Module& net) {
      if (last) loss_fn(net.forward(extra.x), extra.y).backward();
    });
    CAPTURE(alone);
    const bool sharded = d.options.mode == dp::Mode::Sharded;
    CHECK(alone.find(sharded && !last ? "refused by process" : sharded ? "the module itself" : "differ between the processes") !=
          std::string::npos);
  }
}

TEST_CASE("a different device count on one process fails on every process") {
  if (!dist::is_distributed()) return;
  auto net = make_mlp(kSeed);
  const int n = dist::rank() == dist::world_size() - 1 ? 1 : kLocal;
  std::string what;
  try {
    dp::DataParallel model(net, local_devices(n), {.mode = dp::Mode::DDP});
  } catch (const dp::Error& e) {
    what = e.what();
  }
  CHECK(what.find("same number of devices") != std::string::npos);
  INFO(what);
}

namespace {

dp::DataParallelOptions sharded(int stage) {
  // Tiny buckets: many collectives per backward, pieces cut by the shard boundaries.
  return {.mode = dp::Mode::Sharded, .shard_stage = stage, .bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
}
const dp::DataParallelOptions kDdp{.mode = dp::Mode::DDP, .bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};

struct Trained {
  std::vector<float> params, state;  // the module's and the optimizer's state_dict, flattened
  std::vector<double> norms;         // clip_grad_norm_'s totals, per step
};

/// kSteps Adam steps across processes from process 0's parameters; `clip` > 0 clips
/// each step's gradients to that norm; `rows` > 0 fixes the global batch's rows.
Trained train_opt(const dp::DataParallelOptions& options, double clip = 0, std::int64_t rows = 0) {
  auto net = make_mlp(kSeed + static_cast<std::uint64_t>(dist::rank()));
  dp::DataParallel model(net, local_devices(), options);
  auto params = model.parameters();
  dp::optim::Adam opt(params, {.lr = 1e-2});
  Trained t;
  for (int s = 0; s < kSteps; ++s) {
    const std::int64_t global = rows > 0 ? rows : global_rows(s);
    Batch b = make_batch(global, 100 + static_cast<std::uint64_t>(s * 7));
    const auto [lo, n] = my_rows(global);
    opt.zero_grad();
    model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    if (clip > 0) t.norms.push_back(dp::nn::utils::clip_grad_norm_(params, clip));
    opt.step();
  }
  t.params = flat(net->state_dict());
  t.state = flat(opt.state_dict());  // collective for stages 1 and 2 across processes
  return t;
}

bool bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("stage 3 across processes is hybrid: sharded over the process's devices, replicated across processes") {
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), sharded(3));
  CHECK(model.shard_stage() == 3);
  CHECK(model.shard_world() == kLocal);
  const auto* store = dp::parallel::ShardStore::of(*net->parameter_set());
  REQUIRE(store != nullptr);
  CHECK(store->shard_world() == kLocal);
  CHECK_FALSE(store->sharded_across_processes());
  const auto shards = model.shards();
  REQUIRE(shards.size() == static_cast<std::size_t>(kLocal));
  const std::int64_t len = shards[0].second - shards[0].first;
  for (int i = 0; i < kLocal; ++i) {  // local ranges, the same in every process
    CHECK(shards[static_cast<std::size_t>(i)].first == len * i);
    CHECK(shards[static_cast<std::size_t>(i)].second == len * (i + 1));
  }
  // Uneven shards: the last range ends in padding.
  CHECK(len * kLocal > net->parameter_set()->numel());
  CHECK(len * (kLocal - 1) < net->parameter_set()->numel());
  dp::DataParallel s1(make_mlp(kSeed), local_devices(), sharded(1));
  CHECK(s1.shard_world() == model.world_devices());
  dp::DataParallel ddp(make_mlp(kSeed), local_devices(), kDdp);
  CHECK(ddp.shard_world() == 0);
}

TEST_CASE("stage 3 across processes is bitwise DDP across processes: parameters and optimizer state") {
  // Uneven rows between processes and devices (global_rows), and a batch so small that
  // the last process's second device gets no rows at all.
  for (std::int64_t rows : {std::int64_t{0}, std::int64_t{kLocal} * dist::world_size() - 1}) {
    CAPTURE(rows);
    const Trained ddp = train_opt(kDdp, 0, rows);
    const Trained s3 = train_opt(sharded(3), 0, rows);
    CHECK(bitwise(s3.params, ddp.params));
    CHECK(bitwise(s3.state, ddp.state));
    CHECK(same_everywhere(s3.params));
    CHECK(same_everywhere(s3.state));
  }
}

TEST_CASE("the optimizer state_dict of a Sharded run across processes is the whole state, bitwise DDP's") {
  const Trained ddp = train_opt(kDdp);
  REQUIRE(ddp.state.size() == 2 * ddp.params.size());  // Adam's two moments per parameter
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Trained s = train_opt(sharded(stage));
    CHECK(bitwise(s.params, ddp.params));
    CHECK(bitwise(s.state, ddp.state));  // every process holds the whole state
  }
}

TEST_CASE("a Sharded optimizer whose parameters lie in one device's range: state_dict across processes") {
  // 10 elements lie within the first aligned range (ShardStore::kShardAlign): device 0 of
  // process 0 owns them all and its state is the whole state, while every other copy owns
  // none. state_dict() still exchanges the states on every process; a process that took
  // its own copy 0's state as the whole (process 0) skipped the exchange the others made.
  auto train = [](const dp::DataParallelOptions& options) {
    dp::manual_seed(kSeed);
    auto net = std::make_shared<dp::nn::Linear>(4, 2);
    dp::DataParallel model(net, local_devices(), options);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    for (int s = 0; s < 3; ++s) {
      std::vector<float> x(static_cast<std::size_t>(kLocal) * 4);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7 + s * 3 + dist::rank()) % 5) - 2;
      opt.zero_grad();
      dp::sum(model(dp::from_vector(x, {kLocal, 4}))).backward();
      opt.step();
    }
    return std::make_pair(flat(net->state_dict()), opt.state_dict());
  };
  const auto [ddp_params, ddp_state] = train(kDdp);
  REQUIRE(ddp_state.size() == 5);  // step, and two moments of the weight and the bias
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const auto [params, state] = train(sharded(stage));
    CHECK(bitwise(params, ddp_params));
    CHECK(state.size() == ddp_state.size());
    CHECK(bitwise(flat(state), flat(ddp_state)));
  }
}

TEST_CASE("a full optimizer state loads into a Sharded run across processes: each device keeps its range") {
  const Trained ddp = train_opt(kDdp);
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    // A DDP run's state dict, loaded into a fresh Sharded run, comes back whole.
    auto net = make_mlp(kSeed);
    dp::DataParallel model(net, local_devices(), kDdp);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    steps(model, opt, 0, 3);
    const dp::nn::StateDict saved = opt.state_dict();
    const dp::nn::StateDict saved_net = net->state_dict();
    auto net2 = make_mlp(kSeed + 5);
    dp::DataParallel sharded_model(net2, local_devices(), sharded(stage));
    dp::optim::Adam opt2(sharded_model.parameters(), {.lr = 1e-2});
    net2->load_state_dict(saved_net);
    opt2.load_state_dict(saved);
    CHECK(bitwise(flat(opt2.state_dict()), flat(saved)));
    // And both continue alike, bit for bit.
    steps(model, opt, 3, 6);
    steps(sharded_model, opt2, 3, 6);
    CHECK(bitwise(flat(net2->state_dict()), flat(net->state_dict())));
    CHECK(bitwise(flat(opt2.state_dict()), flat(opt.state_dict())));
  }
}

TEST_CASE("a Sharded training checkpoint resumes on another topology: P x 2 devices <-> 1 x 2P") {
  if (!dist::is_distributed()) return;
  const int world = dist::world_size() * kLocal;
  const int half = kSteps / 2;
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    dp::DataParallelOptions alone = sharded(stage);
    alone.span_processes = false;
    std::vector<float> straight;
    {
      auto net = make_mlp(kSeed);
      dp::DataParallel model(net, local_devices(), sharded(stage));
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      steps(model, opt, 0, kSteps);
      straight = flat(net->state_dict());
    }
    SUBCASE("P processes save (collective), one process of 2P devices resumes") {
      const std::string path = checkpoint_path("sharded_across");
      auto net = make_mlp(kSeed);
      dp::DataParallel model(net, local_devices(), sharded(stage));
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      steps(model, opt, 0, half);
      const std::vector<float> state = flat(opt.state_dict());
      // Every process takes part; process 0 writes.
      dp::save_training_checkpoint(path, *net, opt, at_step(half), /*write=*/dist::is_main());
      dist::barrier();
      if (dist::is_main()) {
        auto fresh = make_mlp(kSeed + 99);
        dp::DataParallel single(fresh, local_devices(world), alone);
        CHECK(single.processes() == 1);
        dp::optim::Adam opt2(single.parameters(), {.lr = 1e-2});
        dp::TrainingState st;
        dp::load_training_checkpoint(path, *fresh, opt2, st);
        CHECK(st.step == half);
        CHECK(bitwise(flat(opt2.state_dict()), state));  // the whole state, every shard's
        steps(single, opt2, half, kSteps);
        CHECK(max_diff(flat(fresh->state_dict()), straight) < 2e-5);
        std::remove(path.c_str());
      }
      dist::barrier();
    }
    SUBCASE("one process of 2P devices saves, P processes resume") {
      const std::string path = checkpoint_path("sharded_alone");
      std::vector<float> state;
      if (dist::is_main()) {
        auto net = make_mlp(kSeed);
        dp::DataParallel single(net, local_devices(world), alone);
        dp::optim::Adam opt(single.parameters(), {.lr = 1e-2});
        steps(single, opt, 0, half);
        state = flat(opt.state_dict());
        dp::save_training_checkpoint(path, *net, opt, at_step(half));
      }
      state = dist::broadcast_object(state, 0);
      dist::barrier();
      auto fresh = make_mlp(kSeed + 7);
      dp::DataParallel model(fresh, local_devices(), sharded(stage));
      dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
      dp::TrainingState st;
      dp::load_training_checkpoint(path, *fresh, opt, st);
      CHECK(st.step == half);
      CHECK(bitwise(flat(opt.state_dict()), state));
      steps(model, opt, half, kSteps);
      const std::vector<float> p = flat(fresh->state_dict());
      CHECK(max_diff(p, straight) < 2e-5);
      CHECK(same_everywhere(p));
      dist::barrier();
      if (dist::is_main()) std::remove(path.c_str());
    }
  }
}

TEST_CASE("clip_grad_norm_ of a Sharded run across processes is bitwise DDP's: the norm and the parameters") {
  // A max norm below the gradients' norm: every step clips.
  const Trained ddp = train_opt(kDdp, 0.05);
  REQUIRE(ddp.norms.size() == static_cast<std::size_t>(kSteps));
  for (double n : ddp.norms) CHECK(n > 0.05);
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    const Trained s = train_opt(sharded(stage), 0.05);
    REQUIRE(s.norms.size() == ddp.norms.size());
    for (std::size_t i = 0; i < s.norms.size(); ++i) CHECK(s.norms[i] == ddp.norms[i]);
    CHECK(bitwise(s.params, ddp.params));
    CHECK(bitwise(s.state, ddp.state));
    CHECK(same_everywhere(s.params));
  }
  // The inf-norm takes the same route.
  auto net = make_mlp(kSeed);
  dp::DataParallel model(net, local_devices(), sharded(2));
  auto params = model.parameters();
  const auto [lo, n] = my_rows(global_rows(0));
  Batch b = make_batch(global_rows(0), 100);
  model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
  const double inf = dp::nn::utils::clip_grad_norm_(params, 1e9, dp::nn::utils::kInfNorm);
  CHECK(inf > 0);
  CHECK(dist::all_reduce(inf, dist::Op::Max) == dist::all_reduce(inf, dist::Op::Min));
}

namespace {

/// make_mlp's network with a last child `tail` added to the output; while `poison`, the
/// gradient of tail on cpu(1) of the last process becomes infinite and every other
/// gradient stays finite (tail's range lies at the end of the flat layout).
struct PoisonedTail : dp::nn::Module {
  struct Tail : dp::nn::Module {
    Tail() { value = register_parameter("value", dp::zeros({3})); }
    dp::nn::Parameter value;
  };
  explicit PoisonedTail(std::uint64_t seed) {
    mlp = register_module("mlp", make_mlp(seed));
    tail = register_module("tail", std::make_shared<Tail>());
  }
  Tensor forward(const Tensor& x) override {
    const Tensor out = mlp->forward(x);
    Tensor t = tail->value;
    if (poison && dist::rank() == dist::world_size() - 1 && t.device() == dp::cpu(1)) {
      Tensor y = dp::mul(t, 1.0).detach();
      dp::autograd::record("Poison", {t}, y, {}, [](const std::vector<Tensor>& g) {
        return std::vector<Tensor>{dp::mul(g[0], static_cast<double>(INFINITY))};
      });
      t = y;
    }
    return dp::add(out, t);
  }
  bool poison = false;
  std::shared_ptr<dp::nn::Sequential> mlp;
  std::shared_ptr<Tail> tail;
};

}  // namespace

TEST_CASE("a float16-style overflow on one device of one process skips the GradScaler step on every process") {
  // Note [One decision everywhere] (dp/optim/grad_scaler.h): each process checks only
  // the gradients it steps (Sharded stages 1 and 2 across processes: its own ranges), so
  // the decision needs every process's answer; a process that decided alone would skip
  // the all-gather its peers make after their step.
  std::vector<float> reference;
  const dp::DataParallelOptions kDp{.mode = dp::Mode::DP, .bucket_cap_mb = 2e-4, .first_bucket_mb = 1e-4};
  for (const auto& [name, options] : {std::pair{"DP", kDp}, {"DDP", kDdp}, {"Sharded 1", sharded(1)},
                                      {"Sharded 2", sharded(2)}, {"Sharded 3", sharded(3)}}) {
    const std::string design = name;
    CAPTURE(design);
    auto net = std::make_shared<PoisonedTail>(kSeed + static_cast<std::uint64_t>(dist::rank()));
    dp::DataParallel model(net, local_devices(), options);
    dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
    dp::amp::GradScaler scaler({.init_scale = 1024.0});
    auto step = [&](int s, bool poison) {
      net->poison = poison;
      const std::int64_t global = global_rows(s);
      Batch b = make_batch(global, 300 + static_cast<std::uint64_t>(s));
      const auto [lo, n] = my_rows(global);
      opt.zero_grad();
      model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n),
                             [&](const Tensor& out, const Tensor& y) { return scaler.scale(loss_fn(out, y)); });
      const bool stepped = scaler.step(opt);
      scaler.update();
      return stepped;
    };
    CHECK(step(0, false));
    const std::vector<float> before = flat(net->state_dict());
    const bool stepped = step(1, true);
    CHECK_FALSE(stepped);
    CHECK(dist::all_reduce(static_cast<std::int64_t>(stepped), dist::Op::Max) == 0);  // skipped everywhere
    CHECK(bitwise(flat(net->state_dict()), before));
    CHECK(scaler.get_scale() == 512.0);
    CHECK(step(2, false));
    CHECK(step(3, false));
    const std::vector<float> after = flat(net->state_dict());
    CHECK(same_everywhere(after));
    if (reference.empty()) reference = after;
    else CHECK(bitwise(after, reference));  // every design, DP's bits
  }
}

TEST_CASE("per-device memory of stage 3 across processes by the allocator: 1/N of the model per device") {
  constexpr std::int64_t F = sizeof(float);
  std::vector<std::size_t> base;
  for (int r = 0; r < kLocal; ++r) base.push_back(dp::memory_allocated(dp::cpu(r)));
  auto since = [&](bool peak) {
    std::vector<std::int64_t> out;
    for (int r = 0; r < kLocal; ++r) {
      const dp::Device d = dp::cpu(r);
      out.push_back(static_cast<std::int64_t>(peak ? dp::max_memory_allocated(d) : dp::memory_allocated(d)) -
                    static_cast<std::int64_t>(base[static_cast<std::size_t>(r)]));
    }
    return out;
  };
  std::vector<std::int64_t> steady, peak;
  std::int64_t P = 0, L = 0;
  {
    // 64-256-256-10: 85,002 parameters; units of 16,640, 65,792 and 2,570.
    dp::Generator gen(3);
    auto net = std::make_shared<dp::nn::Sequential>();
    net->push_back(std::make_shared<dp::nn::Linear>(64, 256, true, &gen));
    net->push_back(std::make_shared<dp::nn::ReLU>());
    net->push_back(std::make_shared<dp::nn::Linear>(256, 256, true, &gen));
    net->push_back(std::make_shared<dp::nn::ReLU>());
    net->push_back(std::make_shared<dp::nn::Linear>(256, 10, true, &gen));
    dp::DataParallel model(net, local_devices(), {.mode = dp::Mode::Sharded, .shard_stage = 3});
    auto params = model.parameters();
    P = params.set()->numel();
    dp::optim::Adam opt(params, {.lr = 1e-3});
    params = {};  // model.parameters() gathered device 0's copy: let it go at the next step
    L = model.shards()[0].second - model.shards()[0].first;
    std::vector<std::int64_t> labels(16);
    for (std::int64_t i = 0; i < 16; ++i) labels[static_cast<std::size_t>(i)] = i % 10;
    dp::Generator data_gen(11);
    auto step = [&] {
      const Tensor x = dp::randn({16, 64}, data_gen, dp::cpu(0));
      const Tensor y = dp::from_vector(labels, {16}, dp::cpu(0));
      opt.zero_grad();
      model.forward_backward(x, y, loss_fn);
      opt.step();
    };
    step();  // allocates the optimizer state
    for (int r = 0; r < kLocal; ++r) dp::reset_peak_memory(dp::cpu(r));
    step();
    peak = since(true);
    steady = since(false);
  }
  REQUIRE(P == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
  CHECK(L == ((P + kLocal - 1) / kLocal + 15) / 16 * 16);  // ceil(P / N) rounded up to kShardAlign
  const std::int64_t U0 = 64 * 256 + 256, U = 256 * 256 + 256;  // the first two units
  for (int r = 0; r < kLocal; ++r) {
    CAPTURE(r);
    const std::int64_t own = std::min(P, (r + 1) * L) - r * L;
    // Between steps: its range of the parameters and of the gradient, Adam's moments of
    // its range — P/N of the model for this process's N devices, whatever the processes.
    CHECK(steady[static_cast<std::size_t>(r)] == (L + L + 2 * own) * F);
    // Peak: one or two units gathered besides (Note [Sharded parameters]); activations
    // of 8 rows and temporaries are a few thousand floats.
    const std::int64_t expected = steady[static_cast<std::size_t>(r)] + std::max(2 * U, U + U0) * F;
    CHECK(peak[static_cast<std::size_t>(r)] >= expected);
    CHECK(peak[static_cast<std::size_t>(r)] <= expected + 32 * 1024 * F);
    MESSAGE("process ", dist::rank(), " cpu:", r, " steady ", steady[static_cast<std::size_t>(r)], " bytes, peak ",
            peak[static_cast<std::size_t>(r)], " bytes, model ", P * F, " bytes");
  }
  CHECK(since(false) == std::vector<std::int64_t>(kLocal, 0));  // all returned with the model
}

// ---- failure scenarios (one per job, see run_mpi.py) --------------------------------

namespace {

/// Throws on cpu(1) of the last process once armed.
struct Bomb : dp::nn::Module {
  bool armed = false;
  Tensor forward(const Tensor& x) override {
    if (armed && dist::rank() == dist::world_size() - 1 && x.device() == dp::cpu(1))
      throw dp::Error("boom: a worker of the last process failed");
    return x;
  }
};

// Modes: "throw" / "kill" (DDP), "throw_stage3" (Sharded stage 3, hybrid), and
// "hang_state_dict" / "hang_clip" (Sharded stage 2: the last process never takes part in
// the optimizer's state_dict or clip_grad_norm_'s exchange; the others must time out).
// "save_alone" / "save_alone_wait" (Sharded stage 2): only process 0 calls the
// collective save_training_checkpoint while the others wait in dp::dist::barrier()
// (which meets its gathering: every process fails at once) or in no collective
// (process 0 times out); the messages must name the save and its rule.
// "save_alone_dropout": the same as "save_alone" for DDP with a Dropout layer, whose
// streams the save gathers.
// "stale_input" (DDP): the last process writes into its input batch between its forward
// and its backward, which throws there (Note [Saved tensors and in-place writes]); the
// others wait for its gradients in the backward's all-reduce. "stale_step" (Sharded
// stage 3): every process steps between a forward and its backward, and every
// backward throws. Across processes a failed worker ends the job (multi-node.md, "Fault
// policy"); in one process training goes on (loop_patterns_test).
int run_fault(const std::string& mode) {
  auto net = make_mlp(kSeed);
  auto bomb = std::make_shared<Bomb>();
  net->push_back(bomb);
  dp::DataParallelOptions options{.mode = dp::Mode::DDP};
  if (mode == "throw_stage3" || mode == "stale_step") options = {.mode = dp::Mode::Sharded, .shard_stage = 3};
  if (mode.rfind("hang_", 0) == 0 || mode == "save_alone" || mode == "save_alone_wait")
    options = {.mode = dp::Mode::Sharded, .shard_stage = 2};
  if (mode == "save_alone_dropout") net->push_back(std::make_shared<dp::nn::Dropout>(0.2, kSeed));
  dp::DataParallel model(net, local_devices(), options);
  dp::optim::Adam opt(model.parameters(), {.lr = 1e-2});
  const bool victim = dist::rank() == dist::world_size() - 1;
  for (int s = 0; s < 6; ++s) {
    if (s == 3) {
      if (mode == "throw" || mode == "throw_stage3") bomb->armed = true;
      if (mode == "kill" && victim) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the others are in the step
        std::raise(SIGKILL);
      }
    }
    const std::int64_t rows = global_rows(s);
    Batch b = make_batch(rows, 100 + static_cast<std::uint64_t>(s));
    const auto [lo, n] = my_rows(rows);
    opt.zero_grad();
    if (s == 3 && mode.rfind("stale_", 0) == 0) {
      Tensor x = b.x.narrow(0, lo, n).clone();
      Tensor loss = loss_fn(model(x), b.y.narrow(0, lo, n));
      if (mode == "stale_input" && victim) x.mul_(2.0f);
      if (mode == "stale_step") opt.step();
      loss.backward();
    } else {
      model.forward_backward(b.x.narrow(0, lo, n), b.y.narrow(0, lo, n), loss_fn);
    }
    if (s == 3 && mode.rfind("save_alone", 0) == 0) {
      if (dist::is_main()) {
        dp::TrainingState st;
        st.step = s;
        // Not checkpoint_path(): its broadcast would be the collective that fails.
        const std::string path = dp::detail::str_cat("/tmp/dp_mpi_test_", ::getpid(), "_save_alone.ckpt");
        dp::save_training_checkpoint(path, *net, opt, st);
      } else if (mode == "save_alone_wait") {
        std::this_thread::sleep_for(std::chrono::seconds(60));  // past process 0's timeout
      } else {
        dist::barrier();  // the usual `if (is_main()) save(...); barrier();`
      }
    }
    if (s == 3 && mode.rfind("hang_", 0) == 0) {
      if (victim) {
        std::this_thread::sleep_for(std::chrono::seconds(60));  // past the others' timeout
      } else if (mode == "hang_state_dict") {
        (void)opt.state_dict();
      } else {
        dp::nn::utils::clip_grad_norm_(model.parameters(), 1.0);
      }
    }
    opt.step();
  }
  std::cout << "FAULT-TEST: rank " << dist::rank() << " got through the steps\n" << std::flush;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--fault=", 0) == 0) return run_fault(arg.substr(8));
  }
  doctest::Context ctx;
  ctx.applyCommandLine(argc, argv);
  if (dist::rank() != 0) ctx.setOption("minimal", true);
  if (dist::is_distributed()) ctx.setOption("no-colors", true);
  return ctx.run();
}
