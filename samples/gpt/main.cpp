// samples/gpt — a character-level GPT trained on a plain-text corpus, on one device or
// by DataParallel's DP, DDP or Sharded (ZeRO 1-3) design, and text sampled from it.
//
//   gpt --steps 200                                        # the fortunes corpus, one device
//   gpt --mode sharded --shard-stage 3 --devices 4 --json  # ZeRO-3 over 4 CPU devices
//   gpt --data corpus.txt --checkpoint run.ckpt            # any text file; save as it goes
//   gpt --checkpoint run.ckpt --resume --steps 400         # continue where it stopped
//   gpt --checkpoint run.ckpt --generate 300 --prompt "Q:" # sample text from it
//
// Recipe (nanoGPT's train.py): random windows of --block-size characters; AdamW
// (betas 0.9, 0.95; weight decay on matrices only — biases, norms and embeddings
// without, as nanoGPT's configure_optimizers groups them), linear warm-up then cosine
// decay to --min-lr, gradient clipping at --clip, --grad-accum micro-batches per step;
// the loss is the mean cross-entropy of every next character. The model is samples::GPT
// (gpt.h): nanoGPT's names and initialisation, embedding tied to the head.
//
// Output: a line per --log-every steps and per evaluation; with --json one object a line
// ({"type":"step"}, {"type":"eval"}, {"type":"summary"}, {"type":"sample"}), each step
// with tokens/s and, given --peak-gflops (bench/fma_peak's figure for the run's threads,
// or the GPU's peak), the model FLOPs utilisation. Exit codes: 0 success, 1 a dp::Error
// (a corpus that is missing, empty or not text, a bad checkpoint, ...), 2 bad flags.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <numbers>
#include <optional>
#include <string>
#include <vector>

#include "common/options.h"
#include "gpt/gpt.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "dp/data/text.h"
#include "dp/dp.h"
#include "dp/io/safetensors.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
namespace fs = std::filesystem;

struct Config {
  std::string data = "/usr/share/games/fortunes";  // a text file, or a folder of them
  std::string model = "tiny";                      // tiny | gpt2-124m
  std::int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0;  // 0: the --config's
  double dropout = 0.0;
  std::int64_t batch = 16;  // sequences per micro-batch, over every device
  std::int64_t grad_accum = 1;
  std::int64_t steps = 200;
  std::int64_t stop_at = 0;  // > 0: end this run at that step (the schedule still spans --steps)
  double lr = 1e-3, min_lr = 1e-4;
  std::int64_t warmup = 20;
  double weight_decay = 0.1;
  double clip = 1.0;  // 0: no clipping
  std::int64_t eval_interval = 100, eval_iters = 10, log_every = 10;
  std::uint64_t seed = 1337;
  std::string devices_spec = "1";
  std::vector<int> devices;
  std::string mode = "single";
  int shard_stage = 3;
  std::string precision = "fp32";
  std::string checkpoint;  // save here at every evaluation and at the end
  bool resume = false;
  std::int64_t generate = 0;  // > 0: sample this many characters from --checkpoint and stop
  std::string prompt = "\n";
  double temperature = 0.8;
  std::int64_t top_k = 0;
  double peak_gflops = 0.0;
  bool json = false;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---- corpus --------------------------------------------------------------------------------

/// The corpus: the file, or every plain file of the folder in name order (files with an
/// extension, such as fortune's .dat indexes, are skipped). Throws dp::Error when there
/// is nothing, or when it is not text (a NUL byte: a binary file).
std::string read_corpus(const std::string& where) {
  DP_CHECK(fs::exists(where), "gpt: --data ", where, ": expected a text file or a folder of them, got nothing there");
  std::vector<fs::path> files;
  if (fs::is_directory(where)) {
    for (const auto& e : fs::directory_iterator(where))
      if (e.is_regular_file() && !e.path().has_extension()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    DP_CHECK(!files.empty(), "gpt: --data ", where, ": expected plain files without an extension in the folder, "
             "got none");
  } else {
    files.push_back(where);
  }
  std::string text;
  for (const auto& f : files) {
    std::string part = dp::data::read_text(f);
    const auto nul = part.find('\0');
    DP_CHECK(nul == std::string::npos, "gpt: expected a plain-text corpus, got a NUL byte at offset ", nul, " of ",
             f.string(), " (a binary file?)");
    text += part;
  }
  return text;
}

/// Train and validation token streams (the first 90% and the rest) of a corpus, and
/// random windows from them.
struct Corpus {
  dp::data::CharTokenizer tokenizer;
  std::shared_ptr<dp::data::TokenDataset> train, val;

  Corpus(const dp::data::CharTokenizer& tok, const std::string& text, std::int64_t block)
      : tokenizer(tok) {
    const dp::Tensor ids = tokenizer.encode_tensor(text);
    const std::int64_t n = ids.size(0), n_train = n * 9 / 10;
    DP_CHECK(n - n_train > block + 1, "gpt: expected a corpus of more than ", (block + 2) * 10,
             " characters for a context of ", block, " (a tenth of it validates), got ", n);
    train = std::make_shared<dp::data::TokenDataset>(ids.narrow(0, 0, n_train), block, tokenizer.vocab_size());
    val = std::make_shared<dp::data::TokenDataset>(ids.narrow(0, n_train, n - n_train), block,
                                                   tokenizer.vocab_size());
  }

  /// `rows` windows at random offsets (nanoGPT's get_batch).
  static dp::data::Batch sample(const dp::data::TokenDataset& split, std::int64_t rows, dp::Generator& gen) {
    return sample(split, rows, gen, 0, rows);
  }
  /// Rows [first, first + count) of a batch of `rows` random windows.
  static dp::data::Batch sample(const dp::data::TokenDataset& split, std::int64_t rows, dp::Generator& gen,
                                std::int64_t first, std::int64_t count) {
    const dp::Tensor at = dp::randint(0, split.size(), {rows}, gen, dp::cpu(0));
    const std::vector<std::int64_t> all = at.to_vector_i64();
    return split.get_batch(std::vector<std::int64_t>(all.begin() + first, all.begin() + first + count));
  }
};

// ---- training --------------------------------------------------------------------------------

/// nanoGPT's get_lr: linear warm-up over `warmup` steps, then a cosine from lr down to
/// min_lr at the last step.
double lr_at(const Config& cfg, std::int64_t step) {
  if (step < cfg.warmup) return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup + 1);
  const double span = static_cast<double>(std::max<std::int64_t>(1, cfg.steps - cfg.warmup));
  const double ratio = std::min(1.0, static_cast<double>(step - cfg.warmup) / span);
  return cfg.min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) * (cfg.lr - cfg.min_lr);
}

dp::Tensor token_loss(const dp::Tensor& logits, const dp::Tensor& targets) {
  return dp::nn::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

/// Everything a run trains with.
struct Session {
  std::vector<dp::Device> devices;
  std::shared_ptr<samples::GPT> gpt;
  std::unique_ptr<dp::DataParallel> model;  // null in single mode
  std::unique_ptr<dp::optim::AdamW> opt;
  dp::Generator data_gen{0};
  dp::TrainingState state;
};

dp::DataParallelOptions design_options(const Config& cfg) {
  dp::DataParallelOptions o = samples::mode_options(cfg.mode, cfg.shard_stage);
  // ZeRO-3 gathers one unit at a time: each transformer block is one (FSDP's
  // transformer auto-wrap), not the whole trunk.
  if (cfg.mode == "sharded") o.shard_unit = dp::nn::is_module<dp::nn::TransformerBlock>;
  return o;
}

/// nanoGPT's configure_optimizers: weight decay on matrices (dim >= 2), not on biases
/// and norms — two parameter groups.
std::unique_ptr<dp::optim::AdamW> make_optimizer(const Config& cfg, const dp::nn::ParameterList& params) {
  auto matrices = params.filter([](const dp::Tensor& p) { return p.dim() >= 2; });
  auto others = params.filter([](const dp::Tensor& p) { return p.dim() < 2; });
  std::vector<dp::optim::AdamParamGroup> groups{{matrices, {.weight_decay = cfg.weight_decay}}};
  if (!others.empty()) groups.push_back({others, {.weight_decay = 0.0}});
  return std::make_unique<dp::optim::AdamW>(std::move(groups), dp::optim::AdamWOptions{.lr = cfg.lr, .betas = {0.9, 0.95}});
}

samples::GPTConfig model_config(const Config& cfg, std::int64_t vocab) {
  samples::GPTConfig c = samples::GPTConfig::named(cfg.model, vocab);
  if (cfg.n_layer) c.n_layer = cfg.n_layer;
  if (cfg.n_head) c.n_head = cfg.n_head;
  if (cfg.n_embd) c.n_embd = cfg.n_embd;
  if (cfg.block_size) c.block_size = cfg.block_size;
  c.dropout = cfg.dropout;
  return c;
}

json config_json(const samples::GPTConfig& c) {
  return {{"block_size", c.block_size}, {"vocab_size", c.vocab_size}, {"n_layer", c.n_layer},
          {"n_head", c.n_head},         {"n_embd", c.n_embd},         {"dropout", c.dropout},
          {"bias", c.bias},             {"tie", c.tie}};
}

samples::GPTConfig config_from_json(const json& j) {
  samples::GPTConfig c;
  c.block_size = j.at("block_size");
  c.vocab_size = j.at("vocab_size");
  c.n_layer = j.at("n_layer");
  c.n_head = j.at("n_head");
  c.n_embd = j.at("n_embd");
  c.dropout = j.at("dropout");
  c.bias = j.at("bias");
  c.tie = j.at("tie");
  return c;
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string from_hex(const std::string& hex) {
  DP_CHECK(hex.size() % 2 == 0, "gpt: the checkpoint's vocabulary is not hex (odd length ", hex.size(), ")");
  auto nibble = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    DP_CHECK(c >= 'a' && c <= 'f', "gpt: the checkpoint's vocabulary is not hex (character '", c, "')");
    return c - 'a' + 10;
  };
  std::string out;
  for (std::size_t i = 0; i < hex.size(); i += 2) out += static_cast<char>(nibble(hex[i]) * 16 + nibble(hex[i + 1]));
  return out;
}

/// The model's shape and tokenizer a checkpoint was saved with (its "user.gpt.*" metadata).
std::pair<samples::GPTConfig, dp::data::CharTokenizer> read_checkpoint_model(const std::string& path) {
  const auto info = dp::io::read_safetensors_info(path);
  const auto cfg = info.metadata.find("user.gpt.config"), vocab = info.metadata.find("user.gpt.vocabulary");
  DP_CHECK(cfg != info.metadata.end() && vocab != info.metadata.end(), "gpt: ", path,
           " is not a checkpoint of this sample (expected 'user.gpt.config' and 'user.gpt.vocabulary' metadata)");
  return {config_from_json(json::parse(cfg->second)),
          dp::data::CharTokenizer::from_vocabulary(from_hex(vocab->second))};
}

Session make_session(const Config& cfg, const samples::GPTConfig& mc) {
  Session s;
  for (int id : cfg.devices) s.devices.push_back(dp::device(id));
  dp::manual_seed(cfg.seed);
  dp::Generator gen(cfg.seed);
  s.gpt = std::make_shared<samples::GPT>(mc, gen);
  s.gpt->to(s.devices.front());
  if (cfg.mode != "single") s.model = std::make_unique<dp::DataParallel>(s.gpt, s.devices, design_options(cfg));
  s.opt = make_optimizer(cfg, s.model ? s.model->parameters() : s.gpt->parameters());
  // One data stream for the whole job: every process draws the global batch's windows
  // and takes its own rows, so the generator is alike on every process and the one a
  // checkpoint saves resumes every process (and the batches do not depend on how the
  // devices are spread over processes).
  s.data_gen = dp::Generator(cfg.seed + 1);
  s.state.generators = {{"data", &s.data_gen}};
  return s;
}

/// One optimizer step over grad_accum micro-batches; returns the mean loss.
double train_step(Session& s, const Config& cfg, const Corpus& corpus) {
  s.opt->zero_grad();
  const double scale = 1.0 / static_cast<double>(cfg.grad_accum);
  const std::int64_t rows = cfg.batch / dp::dist::world_size();
  const std::int64_t first = rows * dp::dist::rank();
  double loss_sum = 0.0;
  for (std::int64_t micro = 0; micro < cfg.grad_accum; ++micro) {
    auto [x, y] = Corpus::sample(*corpus.train, cfg.batch, s.data_gen, first, rows);
    const dp::amp::autocast precision = samples::precision_scope(cfg.precision);
    if (s.model) {
      loss_sum += s.model
                      ->forward_backward(x, y, [&](const dp::Tensor& out, const dp::Tensor& t) {
                        return dp::mul(token_loss(out, t), scale);
                      })
                      .item();
    } else {
      const dp::Device dev = s.devices.front();
      dp::Tensor loss = dp::mul(token_loss(s.gpt->forward(x.to(dev)), y.to(dev)), scale);
      loss.backward();
      loss_sum += loss.item();
    }
  }
  if (cfg.clip > 0) dp::nn::utils::clip_grad_norm_(s.opt->parameters(), cfg.clip);
  s.opt->step();
  return loss_sum;
}

/// Mean loss over eval_iters random batches of each split, on device 0's model.
std::pair<double, double> estimate_loss(Session& s, const Config& cfg, const Corpus& corpus) {
  dp::NoGradGuard no_grad;
  s.gpt->eval();
  dp::Generator gen(cfg.seed + 7);  // the same windows at every evaluation
  const dp::Device dev = s.devices.front();
  auto mean = [&](const dp::data::TokenDataset& split) {
    double sum = 0.0;
    for (std::int64_t i = 0; i < cfg.eval_iters; ++i) {
      auto [x, y] = Corpus::sample(split, cfg.batch, gen);
      const dp::amp::autocast precision = samples::precision_scope(cfg.precision);
      sum += token_loss(s.gpt->forward(x.to(dev)), y.to(dev)).item();
    }
    return sum / static_cast<double>(cfg.eval_iters);
  };
  const double train = mean(*corpus.train), val = mean(*corpus.val);
  s.gpt->train();
  return {train, val};
}

void save(Session& s, const Config& cfg, const Corpus& corpus) {
  if (cfg.checkpoint.empty()) return;
  s.state.metadata["gpt.config"] = config_json(s.gpt->config()).dump();
  s.state.metadata["gpt.vocabulary"] = to_hex(corpus.tokenizer.vocabulary());
  // Every process takes part (a Sharded optimizer's state and the Dropout streams are
  // gathered); process 0 writes.
  dp::save_training_checkpoint(cfg.checkpoint, *s.gpt, *s.opt, s.state, /*write=*/dp::dist::is_main());
}

json tags(const Config& cfg) {
  return {{"mode", cfg.mode}, {"devices", cfg.devices}, {"precision", cfg.precision}};
}

int train(const Config& cfg) {
  const std::string text = read_corpus(cfg.data);
  samples::GPTConfig mc;
  std::optional<dp::data::CharTokenizer> tok;
  if (cfg.resume) {
    auto [saved, saved_tok] = read_checkpoint_model(cfg.checkpoint);
    mc = saved;
    tok = saved_tok;
  } else {
    tok = dp::data::CharTokenizer(text);
    mc = model_config(cfg, tok->vocab_size());
  }
  const Corpus corpus(*tok, text, mc.block_size);
  Session s = make_session(cfg, mc);
  if (cfg.resume) dp::load_training_checkpoint(cfg.checkpoint, *s.gpt, *s.opt, s.state);

  const std::int64_t T = mc.block_size;
  const double tokens_per_step = static_cast<double>(cfg.batch * cfg.grad_accum * T);
  const double flops_per_token = s.gpt->flops_per_token(T);
  if (!cfg.json) {
    std::printf("gpt: %lld characters (vocabulary %lld) from %s; %lld parameters (%lld layers, %lld heads, %lld "
                "wide, context %lld); mode %s on %zu device(s); %.0f tokens/step\n",
                static_cast<long long>(text.size()), static_cast<long long>(mc.vocab_size), cfg.data.c_str(),
                static_cast<long long>(s.gpt->num_parameters()), static_cast<long long>(mc.n_layer),
                static_cast<long long>(mc.n_head), static_cast<long long>(mc.n_embd), static_cast<long long>(T),
                cfg.mode.c_str(), s.devices.size(), tokens_per_step);
  }
  double first_loss = NAN, last_loss = NAN, train_time = 0.0, last_val = NAN;
  std::int64_t trained = 0;
  auto window = Clock::now();
  std::int64_t window_steps = 0;
  const std::int64_t last = cfg.stop_at > 0 ? std::min(cfg.stop_at, cfg.steps) : cfg.steps;
  while (s.state.step < last) {
    const double lr = lr_at(cfg, s.state.step);
    s.opt->set_lr(lr);
    const auto t0 = Clock::now();
    const double loss = train_step(s, cfg, corpus);
    train_time += seconds_since(t0);
    ++s.state.step;
    ++trained;
    ++window_steps;
    if (std::isnan(first_loss)) first_loss = loss;
    last_loss = loss;
    DP_CHECK(std::isfinite(loss), "gpt: the loss is ", loss, " at step ", s.state.step, " (lr ", lr,
             "); lower --lr or raise --warmup");
    if (s.state.step % cfg.log_every == 0 || s.state.step == 1) {
      const double dt = seconds_since(window) / static_cast<double>(window_steps);
      const double tps = tokens_per_step / dt;
      const double mfu = cfg.peak_gflops > 0 ? flops_per_token * tps / (cfg.peak_gflops * 1e9) : NAN;
      if (cfg.json) {
        json rec = {{"type", "step"}, {"step", s.state.step}, {"loss", loss},     {"lr", lr},
                    {"ms", dt * 1e3}, {"tokens_per_sec", tps}, {"flops_per_token", flops_per_token}};
        rec["mfu"] = std::isnan(mfu) ? json(nullptr) : json(mfu);
        rec.update(tags(cfg));
        std::cout << rec.dump() << std::endl;
      } else {
        std::printf("step %lld: loss %.4f, lr %.2e, %.1f ms, %.0f tokens/s%s\n", static_cast<long long>(s.state.step),
                    loss, lr, dt * 1e3, tps,
                    std::isnan(mfu) ? "" : (", MFU " + std::to_string(mfu * 100).substr(0, 5) + "%").c_str());
        std::fflush(stdout);
      }
      window = Clock::now();
      window_steps = 0;
    }
    if (s.state.step % cfg.eval_interval == 0 || s.state.step == last) {
      const auto [tl, vl] = estimate_loss(s, cfg, corpus);
      last_val = vl;
      if (cfg.json) {
        json rec = {{"type", "eval"}, {"step", s.state.step}, {"train_loss", tl}, {"val_loss", vl}};
        rec.update(tags(cfg));
        std::cout << rec.dump() << std::endl;
      } else {
        std::printf("eval at step %lld: train loss %.4f, val loss %.4f\n", static_cast<long long>(s.state.step), tl,
                    vl);
      }
      save(s, cfg, corpus);
      window = Clock::now();  // the evaluation is not training time
      window_steps = 0;
    }
  }
  const double tps = train_time > 0 ? tokens_per_step * static_cast<double>(trained) / train_time : 0.0;
  if (cfg.json) {
    json rec = {{"type", "summary"},     {"steps", s.state.step},        {"trained_steps", trained},
                {"first_loss", first_loss}, {"final_loss", last_loss},   {"val_loss", last_val},
                {"tokens_per_sec", tps},  {"parameters", s.gpt->num_parameters()},
                {"config", config_json(mc)}};
    if (s.model) {
      json peaks = json::array();
      for (const auto& d : s.model->stats().devices) peaks.push_back(d.peak_memory_bytes);
      rec["peak_bytes_per_device"] = peaks;
    }
    rec.update(tags(cfg));
    std::cout << rec.dump() << std::endl;
  } else {
    std::printf("summary: %lld steps (%lld this run), loss %.4f -> %.4f, val loss %.4f, %.0f tokens/s\n",
                static_cast<long long>(s.state.step), static_cast<long long>(trained), first_loss, last_loss, last_val,
                tps);
  }
  return 0;
}

int generate(const Config& cfg) {
  auto [mc, tok] = read_checkpoint_model(cfg.checkpoint);
  dp::Generator gen(cfg.seed);
  samples::GPT gpt(mc, gen);
  gpt.to(dp::device(cfg.devices.front()));
  dp::load(gpt, cfg.checkpoint);
  const std::vector<std::int64_t> prompt = tok.encode(cfg.prompt);
  const std::vector<std::int64_t> out = gpt.generate(prompt, cfg.generate, cfg.temperature, cfg.top_k, cfg.seed);
  const std::string text = tok.decode(out);
  if (cfg.json) {
    std::cout << json{{"type", "sample"}, {"prompt", cfg.prompt}, {"text", text}}.dump() << std::endl;
  } else {
    std::cout << text << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"Train a character-level GPT on a text corpus with dp (one device, DP, DDP or Sharded), or sample "
               "text from a checkpoint."};
  app.add_option("--data", cfg.data, "A text file, or a folder of plain files (default: the fortunes corpus)")
      ->capture_default_str();
  app.add_option("--config", cfg.model, "tiny (4 layers, 4 heads, 128 wide, context 128) or gpt2-124m")
      ->check(CLI::IsMember({"tiny", "gpt2-124m"}))->capture_default_str();
  const auto positive = CLI::Range(std::int64_t{1}, std::int64_t{1} << 20);
  app.add_option("--n-layer", cfg.n_layer, "Transformer blocks (default: the --config's)")->check(positive);
  app.add_option("--n-head", cfg.n_head, "Attention heads (default: the --config's)")->check(positive);
  app.add_option("--n-embd", cfg.n_embd, "Width (default: the --config's)")->check(positive);
  app.add_option("--block-size", cfg.block_size, "Context in characters (default: the --config's)")->check(positive);
  app.add_option("--dropout", cfg.dropout, "Dropout in the blocks")->check(CLI::Range(0.0, 0.99))->capture_default_str();
  samples::add_batch_option(app, cfg.batch);
  app.add_option("--grad-accum", cfg.grad_accum, "Micro-batches per optimizer step")->check(positive)->capture_default_str();
  app.add_option("--steps", cfg.steps, "Optimizer steps to reach (a resumed run counts the saved ones)")
      ->check(positive)->capture_default_str();
  app.add_option("--stop-at", cfg.stop_at, "End this run at that step, checkpointed; --resume continues it")
      ->check(positive);
  app.add_option("--lr", cfg.lr, "Peak learning rate")->check(CLI::Range(1e-9, 10.0))->capture_default_str();
  app.add_option("--min-lr", cfg.min_lr, "Learning rate at the end of the cosine")
      ->check(CLI::Range(0.0, 10.0))->capture_default_str();
  app.add_option("--warmup", cfg.warmup, "Linear warm-up steps")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40))->capture_default_str();
  app.add_option("--weight-decay", cfg.weight_decay, "AdamW weight decay on matrices")
      ->check(CLI::Range(0.0, 10.0))->capture_default_str();
  app.add_option("--clip", cfg.clip, "Gradient clipping max norm (0: none)")->check(CLI::Range(0.0, 1e6))->capture_default_str();
  app.add_option("--eval-interval", cfg.eval_interval, "Evaluate (and checkpoint) every N steps")
      ->check(positive)->capture_default_str();
  app.add_option("--eval-iters", cfg.eval_iters, "Batches per evaluation and split")->check(positive)->capture_default_str();
  app.add_option("--log-every", cfg.log_every, "A step record every N steps (and at step 1)")
      ->check(positive)->capture_default_str();
  app.add_option("--seed", cfg.seed, "Seed of the parameters, the batches and the sampling")->capture_default_str();
  samples::add_devices_option(app, cfg.devices_spec)->default_str("1");
  samples::add_mode_option(app, cfg.mode, {"single", "dp", "ddp", "sharded"});
  app.add_option("--shard-stage", cfg.shard_stage, "ZeRO stage of --mode sharded: 1, 2 or 3 (parameters too)")
      ->check(CLI::Range(1, 3))->capture_default_str();
  samples::add_precision_option(app, cfg.precision);
  app.add_option("--checkpoint", cfg.checkpoint, "Training checkpoint: saved at each evaluation and at the end");
  app.add_flag("--resume", cfg.resume, "Continue the run saved in --checkpoint");
  app.add_option("--generate", cfg.generate, "Sample this many characters from --checkpoint instead of training")
      ->check(positive);
  app.add_option("--prompt", cfg.prompt, "Text that --generate continues")->capture_default_str();
  app.add_option("--temperature", cfg.temperature, "Sampling temperature")->check(CLI::Range(1e-3, 100.0))->capture_default_str();
  app.add_option("--top-k", cfg.top_k, "Sample among the k likeliest characters (0: all)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{256}))->capture_default_str();
  app.add_option("--peak-gflops", cfg.peak_gflops,
                 "The hardware's peak GFLOP/s for the MFU (bench/fma_peak --threads N on a CPU, the spec on a GPU)")
      ->check(CLI::Range(0.0, 1e9));
  samples::add_json_option(app, cfg.json, "Print one JSON object per line instead of text");
  if (!dp::dist::is_main() && std::freopen("/dev/null", "w", stdout) == nullptr) return 1;
  try {
    app.parse(argc, argv);
    cfg.devices = samples::parse_device_ids(cfg.devices_spec, dp::device_count());
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  auto usage = [](const std::string& why) {
    std::cerr << "gpt: " << why << "\n";
    return 2;
  };
  if (cfg.mode == "single" && cfg.devices.size() != 1)
    return usage("--mode single trains on one device, got --devices " + cfg.devices_spec +
                 "; pass 1 or use --mode dp|ddp|sharded");
  if ((cfg.resume || cfg.generate > 0) && cfg.checkpoint.empty())
    return usage(std::string(cfg.resume ? "--resume" : "--generate") + " needs --checkpoint");
  if (cfg.batch % dp::dist::world_size() != 0)
    return usage("--batch " + std::to_string(cfg.batch) + " is the global batch and must be a multiple of the " +
                 std::to_string(dp::dist::world_size()) + " processes");
  if (cfg.min_lr > cfg.lr) return usage("--min-lr must not exceed --lr");
  if (cfg.precision != "fp32" && dp::default_device_type() == dp::DeviceType::CPU) std::cerr << samples::cpu_16bit_note(cfg.precision) << "\n";
  try {
    return cfg.generate > 0 ? generate(cfg) : train(cfg);
  } catch (const dp::Error& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
