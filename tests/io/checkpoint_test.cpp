// Module checkpoints (strict and not, errors, DP/DDP interchange) and training
// checkpoints (bitwise-identical resume in single-device, DP, DDP and Sharded modes,
// every module generator restored without the user naming it).
#include "dp/io/checkpoint.h"

#include <doctest/doctest.h>

#include <cstring>
#include <memory>

#include "dp/data/dataloader.h"
#include "dp/data/synthetic.h"
#include "dp/dp.h"
#include "io_test_util.h"

using io_test::contains;
using io_test::error_of;
using io_test::ScratchDir;

namespace {

using dp::Tensor;

// A small CNN on (N, C, 8, 8): conv, batch norm (float and int64 buffers), pooling,
// dropout (its own per-copy generators) and a linear head.
struct SmallCNN : dp::nn::Module {
  explicit SmallCNN(std::int64_t in_channels = 1, std::int64_t width = 4) {
    features = register_module("features", std::make_shared<dp::nn::Sequential>());
    features->push_back(std::make_shared<dp::nn::Conv2d>(in_channels, width, 3, 1, 1));
    features->push_back(std::make_shared<dp::nn::BatchNorm2d>(width));
    features->push_back(std::make_shared<dp::nn::ReLU>());
    features->push_back(std::make_shared<dp::nn::MaxPool2d>(2));
    drop = register_module("drop", std::make_shared<dp::nn::Dropout>(0.25));
    head = register_module("head", std::make_shared<dp::nn::Linear>(width * 16, 10));
  }
  Tensor forward(const Tensor& x) override { return head->forward(drop->forward(features->forward(x)).flatten(1)); }
  std::shared_ptr<dp::nn::Sequential> features;
  std::shared_ptr<dp::nn::Dropout> drop;
  std::shared_ptr<dp::nn::Linear> head;
};

bool bit_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor x = a.to(dp::cpu(0)), y = b.to(dp::cpu(0));
  return x.nbytes() == 0 || std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

bool bit_equal(const dp::nn::StateDict& a, const dp::nn::StateDict& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || !bit_equal(a[i].second, b[i].second)) return false;
  }
  return true;
}

dp::nn::StateDict snapshot(const dp::nn::StateDict& s) {
  dp::nn::StateDict out;
  for (auto& [k, v] : s) out.emplace_back(k, v.clone().detach());
  return out;
}

// ---- a resumable training run -----------------------------------------------------------

enum class Kind { Single, DP, DDP, Sharded2, Sharded3 };

dp::DataParallelOptions options_of(Kind kind) {
  switch (kind) {
    case Kind::DP: return {.mode = dp::Mode::DP};
    case Kind::DDP: return {.mode = dp::Mode::DDP};
    case Kind::Sharded2: return {.mode = dp::Mode::Sharded, .shard_stage = 2};
    default: return {.mode = dp::Mode::Sharded, .shard_stage = 3};
  }
}

constexpr std::int64_t kBatch = 16;
constexpr std::int64_t kExamples = 64;  // 4 batches per epoch: 6 steps cross an epoch

struct Run {
  std::shared_ptr<SmallCNN> net;
  std::unique_ptr<dp::DataParallel> model;
  std::unique_ptr<dp::optim::Adam> opt;
  std::unique_ptr<dp::data::DataLoader> loader;
  dp::TrainingState state;

  explicit Run(Kind kind) {
    net = std::make_shared<SmallCNN>();
    if (kind != Kind::Single) {
      model = std::make_unique<dp::DataParallel>(net, std::vector<dp::Device>{dp::cpu(0), dp::cpu(1)},
                                                 options_of(kind));
    }
    opt = std::make_unique<dp::optim::Adam>(model ? model->parameters() : net->parameters(),
                                            dp::optim::AdamOptions{.lr = 1e-2, .weight_decay = 1e-4});
    auto ds = std::make_shared<dp::data::SyntheticDataset>(
        dp::data::SyntheticOptions{.size = kExamples, .example_shape = {1, 8, 8}, .seed = 5});
    loader = std::make_unique<dp::data::DataLoader>(
        ds, dp::data::DataLoaderOptions{.batch_size = kBatch, .shuffle = true, .seed = 7, .num_workers = 1});
    // No generator is listed: Dropout's per-copy streams travel by themselves.
  }

  void step(const dp::data::Batch& b) {
    // Augmentation noise from the default generator: a resume must restore it too.
    Tensor x = dp::add(b.data, dp::mul(dp::randn(b.data.shape(), dp::default_generator()), 0.05));
    opt->zero_grad();
    Tensor out = model ? (*model)(x) : net->forward(x);
    dp::nn::cross_entropy(out, b.target).backward();
    opt->step();
  }

  // Trains `steps` more steps from state.epoch / state.batch.
  void train(int steps) {
    int done = 0;
    while (done < steps) {
      // Resume where the state says; consumed batches are not even assembled.
      loader->set_position(static_cast<std::uint64_t>(state.epoch), state.batch);
      for (auto it = loader->begin(); it != loader->end() && done < steps; ++it) {
        CHECK(it.index() == state.batch);
        step(*it);
        ++state.batch;
        ++state.step;
        ++done;
      }
      if (state.batch == loader->size()) {
        ++state.epoch;
        state.batch = 0;
      }
    }
  }
};

using GeneratorStates = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

GeneratorStates generator_states(dp::nn::Module& m) {
  GeneratorStates out;
  for (auto& [name, g] : m.named_generators()) out.emplace_back(g->seed(), g->offset());
  return out;
}

struct Outcome {
  dp::nn::StateDict params, opt_state;
  std::uint64_t rng_offset;
  GeneratorStates module_rngs;
  dp::TrainingState state;
};

Outcome outcome(Run& r) {
  return {snapshot(r.net->state_dict()), snapshot(r.opt->state_dict()), dp::default_generator().offset(),
          generator_states(*r.net), r.state};
}

void check_same(const Outcome& a, const Outcome& b) {
  REQUIRE(a.params.size() == b.params.size());
  for (std::size_t i = 0; i < a.params.size(); ++i) {
    CAPTURE(a.params[i].first);
    CHECK(bit_equal(a.params[i].second, b.params[i].second));
  }
  CHECK(bit_equal(a.opt_state, b.opt_state));
  CHECK(a.rng_offset == b.rng_offset);
  CHECK(a.module_rngs == b.module_rngs);
  CHECK(a.state.step == b.state.step);
  CHECK(a.state.epoch == b.state.epoch);
  CHECK(a.state.batch == b.state.batch);
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Single: return "single";
    case Kind::DP: return "DP";
    case Kind::DDP: return "DDP";
    case Kind::Sharded2: return "Sharded stage 2";
    default: return "Sharded stage 3";
  }
}

}  // namespace

TEST_CASE("a resumed run is bitwise identical to an uninterrupted one (single, DP, DDP, Sharded 2 and 3)") {
  for (Kind kind : {Kind::Single, Kind::DP, Kind::DDP, Kind::Sharded2, Kind::Sharded3}) {
    for (int split : {3, 4}) {  // mid-epoch, and exactly at the epoch boundary
      const std::string mode = kind_name(kind);
      CAPTURE(mode);
      CAPTURE(split);
      ScratchDir dir;
      std::string path = dir.file("run.ckpt");

      dp::manual_seed(1);
      Run straight(kind);
      straight.train(6);
      Outcome want = outcome(straight);
      CHECK(want.state.step == 6);
      CHECK(want.state.epoch == 1);

      dp::manual_seed(1);
      Outcome half;
      {
        Run first(kind);
        first.train(split);
        first.state.metadata["run"] = "io-test";
        dp::save_training_checkpoint(path, *first.net, *first.opt, first.state);
        half = outcome(first);
      }
      // A fresh process, in effect: other seed, other initial weights, new optimizer.
      dp::manual_seed(999);
      Run second(kind);
      dp::default_generator().advance(12345);
      CHECK(!bit_equal(second.net->state_dict(), half.params));
      CHECK(generator_states(*second.net) != half.module_rngs);
      dp::load_training_checkpoint(path, *second.net, *second.opt, second.state);
      check_same(outcome(second), half);
      CHECK(second.state.metadata.at("run") == "io-test");
      CHECK(second.opt->step_count() == split);
      second.train(6 - split);
      check_same(outcome(second), want);
      if (kind == Kind::DDP) {  // the replica applied the same updates from the loaded state
        auto set = second.net->parameters().set();
        REQUIRE(set->num_copies() == 2);
        CHECK(bit_equal(set->copy(1).data, set->copy(0).data));
      }
    }
  }
}

TEST_CASE("checkpoints from plain, DP and DDP are the same file and load into each other") {
  ScratchDir dir;
  dp::manual_seed(3);
  Run ddp(Kind::DDP);
  ddp.train(2);
  const std::string a = dir.file("from_net"), b = dir.file("from_model");
  dp::save(*ddp.net, a);
  dp::save(ddp.model->state_dict(), b);
  CHECK(io_test::read_bytes(a) == io_test::read_bytes(b));
  auto names = dp::io::read_safetensors_info(a);
  CHECK(names.entries.front().name == "features.0.weight");  // no "module." prefix

  // DDP → plain.
  auto plain = std::make_shared<SmallCNN>();
  dp::load(plain, a);
  CHECK(bit_equal(plain->state_dict(), ddp.net->state_dict()));

  // plain → DP and DDP: the replicas pick the loaded values up at the next forward.
  dp::Generator gen(11);
  Tensor x = dp::randn({8, 1, 8, 8}, gen);
  plain->eval();
  Tensor want = plain->forward(x);
  dp::save(*plain, a);
  for (dp::Mode mode : {dp::Mode::DP, dp::Mode::DDP}) {
    auto net = std::make_shared<SmallCNN>();
    dp::DataParallel model(net, std::vector<dp::Device>{dp::cpu(0), dp::cpu(1)}, {.mode = mode});
    model.eval();
    model(x);  // replicas exist and hold the old values
    dp::load(*model.module(), a);
    Tensor got = model(x);
    CHECK(dp::max_abs_diff(got, want) < 1e-5);
    auto set = net->parameters().set();
    if (mode == dp::Mode::DDP) CHECK(bit_equal(set->copy(1).data, set->copy(0).data));
    CHECK(bit_equal(net->state_dict(), plain->state_dict()));
  }
}

TEST_CASE("strict loads name what is missing and unexpected; strict=false loads the intersection") {
  ScratchDir dir;
  auto src = std::make_shared<SmallCNN>();
  dp::nn::StateDict partial;
  for (auto& [k, v] : src->state_dict())
    if (k.rfind("head.", 0) != 0) partial.emplace_back(k, v);
  partial.emplace_back("extra.weight", dp::ones({3}));
  std::string path = dir.file("partial");
  dp::save(partial, path);

  auto dst = std::make_shared<SmallCNN>();
  auto before = snapshot(dst->state_dict());
  std::string m = error_of([&] { dp::load(dst, path); });
  CHECK(contains(m, "Missing from the file: 'head.weight', 'head.bias'"));
  CHECK(contains(m, "Unexpected (in the file, not in the module): 'extra.weight'"));
  CHECK(contains(m, path));
  CHECK(bit_equal(dst->state_dict(), before));

  dp::nn::LoadResult r = dp::load(dst, path, /*strict=*/false);
  CHECK(r.missing_keys == std::vector<std::string>{"head.weight", "head.bias"});
  CHECK(r.unexpected_keys == std::vector<std::string>{"extra.weight"});
  auto now = dst->state_dict();
  auto srcd = src->state_dict();
  for (std::size_t i = 0; i < now.size(); ++i) {
    CAPTURE(now[i].first);
    bool from_file = now[i].first.rfind("head.", 0) != 0;
    CHECK(bit_equal(now[i].second, from_file ? srcd[i].second : before[i].second));
  }
}

TEST_CASE("a shape mismatch names the tensor and both shapes, and writes nothing") {
  ScratchDir dir;
  std::string path = dir.file("rgb");
  struct Wide : dp::nn::Module {
    Wide(std::int64_t in) {
      features = register_module("features", std::make_shared<dp::nn::Sequential>());
      features->push_back(std::make_shared<dp::nn::Conv2d>(in, 32, 3));
      fc = register_module("fc", std::make_shared<dp::nn::Linear>(4, 2));
    }
    Tensor forward(const Tensor& x) override { return x; }
    std::shared_ptr<dp::nn::Sequential> features;
    std::shared_ptr<dp::nn::Linear> fc;
  };
  auto rgb = std::make_shared<Wide>(3);
  dp::save(rgb, path);
  auto gray = std::make_shared<Wide>(1);
  auto before = snapshot(gray->state_dict());
  std::string m = error_of([&] { dp::load(gray, path); });
  CHECK(contains(m, "expected [32, 1, 3, 3], got [32, 3, 3, 3] for 'features.0.weight'"));
  CHECK(bit_equal(gray->state_dict(), before));  // fc matched but was not written either
  m = error_of([&] { dp::load(gray, path, /*strict=*/false); });
  CHECK(contains(m, "for 'features.0.weight'"));
  CHECK(bit_equal(gray->state_dict(), before));

  // A dtype mismatch (float file tensor for the int64 counter).
  auto bn = std::make_shared<dp::nn::BatchNorm2d>(2);
  auto sd = bn->state_dict();
  for (auto& [k, v] : sd)
    if (k == "num_batches_tracked") v = dp::zeros({});
  dp::save(sd, path);
  CHECK(contains(error_of([&] { dp::load(bn, path); }), "expected [] int64, got [] float32 for 'num_batches_tracked'"));
}

TEST_CASE("a corrupt or truncated file leaves the module untouched") {
  ScratchDir dir;
  std::string path = dir.file("net");
  auto src = std::make_shared<SmallCNN>();
  dp::save(src, path);
  auto bytes = io_test::read_bytes(path);
  auto dst = std::make_shared<SmallCNN>();
  auto before = snapshot(dst->state_dict());
  for (std::size_t cut : {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{40}, bytes.size() / 2,
                          bytes.size() - 1}) {
    CAPTURE(cut);
    io_test::write_bytes(path, std::vector<std::uint8_t>(bytes.begin(), bytes.begin() + static_cast<long>(cut)));
    CHECK(!error_of([&] { dp::load(dst, path); }).empty());
    CHECK(bit_equal(dst->state_dict(), before));
  }
}

TEST_CASE("load into a StateDict in place, and read a file's tensors") {
  ScratchDir dir;
  std::string path = dir.file("sd");
  auto src = std::make_shared<SmallCNN>();
  dp::save(src, path);
  auto dst = std::make_shared<SmallCNN>();
  dp::load(dst->state_dict(), path);  // views of dst's parameters and buffers
  CHECK(bit_equal(dst->state_dict(), src->state_dict()));
  auto tensors = dp::load(path);
  CHECK(bit_equal(tensors, src->state_dict()));
}

TEST_CASE("training checkpoints: module view, validation, nothing changes on error") {
  ScratchDir dir;
  dp::manual_seed(4);
  Run run(Kind::Single);
  run.train(2);
  std::string path = dir.file("train.ckpt");
  run.state.metadata["config"] = "{\"lr\": 0.01}";
  dp::save_training_checkpoint(path, *run.net, *run.opt, run.state);

  auto info = dp::io::read_safetensors_info(path);
  CHECK(info.metadata.at("dp.checkpoint") == "training");
  CHECK(info.metadata.at("dp.step") == "2");
  CHECK(info.metadata.at("user.config") == "{\"lr\": 0.01}");
  bool has_opt = false;
  for (auto& e : info.entries) has_opt = has_opt || e.name == "optimizer.state.0.exp_avg";
  CHECK(has_opt);

  // The module part alone loads with dp::load (optimizer entries ignored, strict).
  auto plain = std::make_shared<SmallCNN>();
  dp::load(plain, path);
  CHECK(bit_equal(plain->state_dict(), run.net->state_dict()));

  // A module checkpoint is not a training checkpoint.
  std::string mod = dir.file("module");
  dp::save(run.net, mod);
  Run other(Kind::Single);
  CHECK(contains(error_of([&] { dp::load_training_checkpoint(mod, *other.net, *other.opt, other.state); }),
                 "not a training checkpoint"));

  // Errors leave module, optimizer, generators and state untouched.
  auto check_untouched = [&](const std::function<void()>& fn, const std::string& part) {
    auto params = snapshot(other.net->state_dict());
    auto opt = snapshot(other.opt->state_dict());
    auto rng = dp::default_generator().offset();
    auto step = other.state.step;
    std::string m = error_of(fn);
    CHECK_MESSAGE(contains(m, part), m);
    CHECK(bit_equal(other.net->state_dict(), params));
    CHECK(bit_equal(other.opt->state_dict(), opt));
    CHECK(dp::default_generator().offset() == rng);
    CHECK(other.state.step == step);
  };
  other.train(1);  // some optimizer state to protect
  dp::Generator extra(1);
  dp::TrainingState asks = other.state;
  asks.generators.emplace_back("augment", &extra);
  check_untouched([&] { dp::load_training_checkpoint(path, *other.net, *other.opt, asks); },
                  "no generator named 'augment'");
  // Another architecture.
  auto wide = std::make_shared<SmallCNN>(1, 6);
  dp::optim::SGD sgd(wide->parameters(), {.lr = 0.1, .momentum = 0.9});
  CHECK(contains(error_of([&] { dp::load_training_checkpoint(path, *wide, sgd, other.state); }),
                 "expected [6, 1, 3, 3], got [4, 1, 3, 3] for 'features.0.weight'"));
  // Another optimizer type: the optimizer refuses before anything is written.
  dp::optim::SGD sgd2(other.net->parameters(), {.lr = 0.1, .momentum = 0.9});
  other.opt.reset();
  {
    auto params = snapshot(other.net->state_dict());
    CHECK(!error_of([&] { dp::load_training_checkpoint(path, *other.net, sgd2, other.state); }).empty());
    CHECK(bit_equal(other.net->state_dict(), params));
  }
  // Corrupt metadata.
  auto f = dp::io::read_safetensors(path);
  f.metadata["dp.step"] = "12x";
  std::string bad = dir.file("bad.ckpt");
  dp::io::write_safetensors(bad, f.tensors, f.metadata);
  CHECK(contains(error_of([&] { dp::load_training_checkpoint(bad, *other.net, sgd2, other.state); }),
                 "metadata 'dp.step' should be a number, got \"12x\""));
}

TEST_CASE("training checkpoints restore every generator the module registered, and check them both ways") {
  ScratchDir dir;
  // A module with a generator of its own besides a Dropout's.
  struct Noisy : dp::nn::Module {
    Noisy() {
      register_generator("noise", noise);
      drop = register_module("drop", std::make_shared<dp::nn::Dropout>(0.5));
      fc = register_module("fc", std::make_shared<dp::nn::Linear>(4, 2));
    }
    Tensor forward(const Tensor& x) override {
      return fc->forward(drop->forward(dp::add(x, dp::randn(x.shape(), noise))));
    }
    dp::Generator noise{77};
    std::shared_ptr<dp::nn::Dropout> drop;
    std::shared_ptr<dp::nn::Linear> fc;
  };
  dp::manual_seed(5);
  auto src = std::make_shared<Noisy>();
  dp::optim::SGD opt(src->parameters(), {.lr = 0.1});
  src->forward(dp::ones({3, 4}));
  {
    dp::nn::ReplicaBinding bind(1);  // copy 1's stream moves too
    src->forward(dp::ones({5, 4}));
  }
  dp::TrainingState st;
  st.step = 1;
  std::string path = dir.file("noisy.ckpt");
  dp::save_training_checkpoint(path, *src, opt, st);
  auto info = dp::io::read_safetensors_info(path);
  CHECK(info.metadata.at("dp.checkpoint_version") == "2");
  CHECK(info.metadata.at("dp.module_rng.noise") == "77 32");  // 12 + 20 numbers drawn
  CHECK(info.metadata.count("dp.module_rng.drop.generator.1") == 1);
  CHECK(info.metadata.count("dp.module_rng.drop.generator.63") == 1);

  dp::manual_seed(6);  // other Dropout seeds
  auto dst = std::make_shared<Noisy>();
  dst->noise.set_state(1, 2);
  dp::optim::SGD opt2(dst->parameters(), {.lr = 0.1});
  CHECK(generator_states(*dst) != generator_states(*src));
  dp::TrainingState st2;
  dp::load_training_checkpoint(path, *dst, opt2, st2);
  CHECK(generator_states(*dst) == generator_states(*src));
  CHECK(dst->drop->generator(1).offset() == 20);

  // A file lacking a generator the module has, or holding one it lacks: an error
  // naming it, and nothing written.
  auto f = dp::io::read_safetensors(path);
  auto rewrite = [&](const dp::io::Metadata& meta) {
    std::string p = dir.file("edited.ckpt");
    dp::io::write_safetensors(p, f.tensors, meta);
    return p;
  };
  auto untouched = [&](const std::string& p, const std::string& part) {
    dst->noise.set_state(3, 4);
    auto gens = generator_states(*dst);
    auto params = snapshot(dst->state_dict());
    std::string m = error_of([&] { dp::load_training_checkpoint(p, *dst, opt2, st2); });
    CHECK_MESSAGE(contains(m, part), m);
    CHECK(generator_states(*dst) == gens);
    CHECK(bit_equal(dst->state_dict(), params));
  };
  dp::io::Metadata meta = f.metadata;
  meta.erase("dp.module_rng.drop.generator.5");
  untouched(rewrite(meta), "Missing from the file: 'drop.generator.5'");
  meta = f.metadata;
  meta["dp.module_rng.extra.generator.0"] = "1 2";
  untouched(rewrite(meta), "Unexpected (in the file, not in the module): 'extra.generator.0'");
  meta = f.metadata;
  meta["dp.module_rng.noise"] = "77";
  untouched(rewrite(meta), "metadata 'dp.module_rng.noise' should be \"<seed> <offset>\", got \"77\"");
  meta = f.metadata;
  meta["dp.checkpoint_version"] = "3";
  untouched(rewrite(meta), "checkpoint version 3 is not one this dp reads");

  // A file written before module generators were saved (version 1) still loads; the
  // module's generators keep their state (Note [Checkpoints without module generators]).
  meta.clear();
  for (auto& [k, v] : f.metadata)
    if (k != "dp.checkpoint_version" && k.rfind("dp.module_rng.", 0) != 0) meta[k] = v;
  dst->noise.set_state(3, 4);
  auto gens = generator_states(*dst);
  CHECK(error_of([&] { dp::load_training_checkpoint(rewrite(meta), *dst, opt2, st2); }).empty());
  CHECK(generator_states(*dst) == gens);
  CHECK(bit_equal(dst->state_dict(), src->state_dict()));
}

TEST_CASE("a Dropout whose copy 0 draws stream F takes the file's streams F, F+1, ... (Note [Dropout streams in a checkpoint])") {
  ScratchDir dir;
  auto src = std::make_shared<dp::nn::Sequential>();
  src->push_back(std::make_shared<dp::nn::Linear>(4, 4));
  src->push_back(std::make_shared<dp::nn::Dropout>(0.5, 11));
  auto& sd = dynamic_cast<dp::nn::Dropout&>(*src->named_children()[1].second);
  for (int r = 0; r < 4; ++r) {  // copies 0..3 draw different amounts
    dp::nn::ReplicaBinding bind(r);
    src->forward(dp::ones({r + 1, 4}));
  }
  dp::optim::SGD opt(src->parameters(), {.lr = 0.1});
  const std::string path = dir.file("streams.ckpt");
  dp::save_training_checkpoint(path, *src, opt, dp::TrainingState{});

  // A layer of process 1 of a job of 2 devices per process: copy r draws stream 2 + r.
  auto dst = std::make_shared<dp::nn::Sequential>();
  dst->push_back(std::make_shared<dp::nn::Linear>(4, 4));
  dst->push_back(std::make_shared<dp::nn::Dropout>(0.5, 99));
  auto& dd = dynamic_cast<dp::nn::Dropout&>(*dst->named_children()[1].second);
  dd.set_streams(11, 2);
  dd.generator(62).set_state(5, 6);  // stream 64: past the file's 64, keeps its state
  dp::optim::SGD opt2(dst->parameters(), {.lr = 0.1});
  dp::TrainingState st;
  dp::load_training_checkpoint(path, *dst, opt2, st);
  for (int r = 0; r < 62; ++r) {
    CAPTURE(r);
    CHECK(dd.generator(r).seed() == sd.generator(r + 2).seed());
    CHECK(dd.generator(r).offset() == sd.generator(r + 2).offset());
  }
  CHECK(dd.generator(0).offset() == 12);  // stream 2: copy 2 drew 3 rows of 4
  CHECK(dd.generator(62).seed() == 5);
  CHECK(dd.generator(62).offset() == 6);
  CHECK(dd.generator(63).seed() == dd.stream_key(65));

  // A spread the checkpoint cannot hold, and bad spreads.
  dd.set_process_spread(2, 40);
  CHECK(contains(error_of([&] { dp::save_training_checkpoint(path, *dst, opt2, st); }),
                 "Dropout '1' draws 80 streams (2 processes x 40 devices); a checkpoint holds at most 64 per layer"));
  CHECK(contains(error_of([&] { dd.set_process_spread(0, 1); }), "expected processes >= 1, got 0"));
  CHECK(contains(error_of([&] { dd.set_process_spread(2, 0); }), "expected copies in [1, 64], got 0"));
  CHECK(contains(error_of([&] { dd.set_process_spread(2, 65); }), "expected copies in [1, 64], got 65"));
  CHECK(contains(error_of([&] { (void)dd.stream_key(-1); }), "expected a stream >= 0, got -1"));
}

TEST_CASE("a flipped bit in a module or training checkpoint is an error naming the tensor; nothing is loaded") {
  ScratchDir dir;
  dp::manual_seed(8);
  Run run(Kind::Single);
  run.train(1);
  auto flip = [&](const std::string& path, const std::string& tensor) {
    auto info = dp::io::read_safetensors_info(path);
    auto bytes = io_test::read_bytes(path);
    for (const auto& e : info.entries) {
      if (e.name != tensor) continue;
      bytes[8 + info.header_bytes + (e.begin + e.end) / 2] ^= 0x10;
      io_test::write_bytes(path, bytes);
      return;
    }
    FAIL("no tensor " << tensor);
  };
  std::string mod = dir.file("checkpoint.safetensors");
  dp::save(run.net, mod);
  flip(mod, "head.weight");
  auto dst = std::make_shared<SmallCNN>();
  auto before = snapshot(dst->state_dict());
  std::string m = error_of([&] { dp::load(dst, mod); });
  CHECK_MESSAGE(contains(m, mod + ": tensor 'head.weight' fails its checksum (stored "), m);
  CHECK(contains(m, "the file is corrupt"));
  CHECK(bit_equal(dst->state_dict(), before));

  std::string train = dir.file("run.ckpt");
  dp::save_training_checkpoint(train, *run.net, *run.opt, run.state);
  flip(train, "optimizer.state.0.exp_avg_sq");
  Run other(Kind::Single);
  auto opt_before = snapshot(other.opt->state_dict());
  m = error_of([&] { dp::load_training_checkpoint(train, *other.net, *other.opt, other.state); });
  CHECK_MESSAGE(contains(m, train + ": tensor 'optimizer.state.0.exp_avg_sq' fails its checksum"), m);
  CHECK(bit_equal(other.opt->state_dict(), opt_before));
}

namespace {

/// Adam over nanoGPT-style groups: the matrices with weight decay `wd`, the rest at half
/// the lr without.
std::unique_ptr<dp::optim::Adam> grouped_adam(const dp::nn::ParameterList& params, double lr, double wd) {
  auto matrices = params.filter([](const Tensor& p) { return p.dim() >= 2; });
  auto others = params.filter([](const Tensor& p) { return p.dim() < 2; });
  return std::make_unique<dp::optim::Adam>(
      std::vector<dp::optim::AdamParamGroup>{{matrices, {.weight_decay = wd}}, {others, {.lr = lr / 2, .weight_decay = 0.0}}},
      dp::optim::AdamOptions{.lr = lr});
}

}  // namespace

TEST_CASE("training checkpoints keep every param group's hyper-parameters: an exact resume; other groups refused") {
  ScratchDir dir;
  for (Kind kind : {Kind::Single, Kind::Sharded2}) {
    CAPTURE(kind_name(kind));
    const std::string path = dir.file(std::string("groups_") + kind_name(kind));
    dp::manual_seed(9);
    Run a(kind);
    a.opt = grouped_adam(a.model ? a.model->parameters() : a.net->parameters(), 1e-2, 0.1);
    dp::optim::LinearLR warm_a(*a.opt, {.start_factor = 0.5, .total_iters = 4});
    a.state.schedulers = {{"warmup", &warm_a}};
    a.train(3);
    warm_a.step();
    dp::save_training_checkpoint(path, *a.net, *a.opt, a.state);
    const auto saved_groups = a.opt->param_groups_state();
    auto info = dp::io::read_safetensors_info(path);
    CHECK(info.metadata.at("dp.optimizer.param_groups") == "2");
    CHECK(info.metadata.at("dp.optimizer.param_groups.0.weight_decay") == "0.1");
    CHECK(info.metadata.at("dp.optimizer.param_groups.1.weight_decay") == "0");
    CHECK(info.metadata.at("dp.optimizer.lr") == info.metadata.at("dp.optimizer.param_groups.0.lr"));
    a.train(3);
    const Outcome uninterrupted = outcome(a);

    // Built with other hyper-parameters: the file's replace them, every group's.
    Run b(kind);
    b.opt = grouped_adam(b.model ? b.model->parameters() : b.net->parameters(), 0.5, 0.3);
    dp::optim::LinearLR warm_b(*b.opt, {.start_factor = 0.5, .total_iters = 4});
    b.state.schedulers = {{"warmup", &warm_b}};
    dp::load_training_checkpoint(path, *b.net, *b.opt, b.state);
    for (std::size_t g = 0; g < 2; ++g) {
      CAPTURE(g);
      CHECK(b.opt->group_lr(g) == saved_groups[g].options.at("lr")[0]);
      CHECK(b.opt->options(g).weight_decay == saved_groups[g].options.at("weight_decay")[0]);
      CHECK(b.opt->initial_lr(g) == saved_groups[g].options.at("initial_lr")[0]);
    }
    CHECK(b.opt->group_lr(1) == b.opt->group_lr(0) / 2);
    CHECK(warm_b.base_lrs() == warm_a.base_lrs());
    b.train(3);
    const Outcome resumed = outcome(b);
    CHECK(bit_equal(resumed.params, uninterrupted.params));
    CHECK(bit_equal(resumed.opt_state, uninterrupted.opt_state));

    // One group where the file has two: refused, nothing written.
    Run one(kind);
    one.train(1);
    const auto params = snapshot(one.net->state_dict());
    const auto opt_state = snapshot(one.opt->state_dict());
    const double lr = one.opt->lr();
    const std::string m = error_of([&] { dp::load_training_checkpoint(path, *one.net, *one.opt, one.state); });
    CHECK_MESSAGE(contains(m, "expected 1 param group(s) of"), m);
    CHECK_MESSAGE(contains(m, "got 2 param group(s)"), m);
    CHECK(bit_equal(one.net->state_dict(), params));
    CHECK(bit_equal(one.opt->state_dict(), opt_state));
    CHECK(one.opt->lr() == lr);
  }
}

TEST_CASE("a training checkpoint written before param groups loads into one group, and is refused by two") {
  ScratchDir dir;
  dp::manual_seed(3);
  Run a(Kind::Single);
  a.train(2);
  a.opt->set_lr(0.0125);
  const std::string path = dir.file("old.ckpt"), old = dir.file("old_format.ckpt");
  dp::save_training_checkpoint(path, *a.net, *a.opt, a.state);
  // The layout before param groups: the same file without their metadata.
  auto f = dp::io::read_safetensors(path);
  for (auto it = f.metadata.begin(); it != f.metadata.end();)
    it = it->first.rfind("dp.optimizer.param_groups", 0) == 0 ? f.metadata.erase(it) : std::next(it);
  CHECK(f.metadata.count("dp.optimizer.lr") == 1);
  dp::io::write_safetensors(old, f.tensors, f.metadata);

  Run b(Kind::Single);
  dp::load_training_checkpoint(old, *b.net, *b.opt, b.state);
  CHECK(b.opt->lr() == 0.0125);
  CHECK(bit_equal(b.opt->state_dict(), a.opt->state_dict()));

  Run c(Kind::Single);
  c.opt = grouped_adam(c.net->parameters(), 1e-2, 0.1);
  const std::string m = error_of([&] { dp::load_training_checkpoint(old, *c.net, *c.opt, c.state); });
  CHECK_MESSAGE(contains(m, "the file holds one parameter group (written before dp saved param groups), the "
                            "optimizer has 2"), m);
  CHECK(c.opt->group_lr(1) == 5e-3);
}
