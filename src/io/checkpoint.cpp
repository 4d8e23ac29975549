// Module and training checkpoints on top of the safetensors format.
#include "dp/io/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>

#include "dp/autograd/grad_mode.h"
#include "dp/core/error.h"
#include "dp/dist/dist.h"
#include "dp/nn/dropout.h"

namespace dp {

namespace {

// Note [Training checkpoint layout]
// One safetensors file: the module's state_dict under its own names (so the file is
// also a plain module checkpoint, readable by PyTorch), the optimizer's state_dict
// under "optimizer.", and in "__metadata__" (strings, decimal):
//   dp.checkpoint = "training"           marks the layout
//   dp.step / dp.epoch / dp.batch        the loop position
//   dp.optimizer.lr                      shortest round-trip decimal of the double
//   dp.optimizer.momentum                the same for Optimizer::momentum(), when it has one
//                                        (both group 0's, as files before param groups had them)
//   dp.optimizer.param_groups            the number of parameter groups, and per group g
//   dp.optimizer.param_groups.<g>.params its parameters' indices; .<g>.<option> each
//                                        hyper-parameter (Optimizer::param_groups_state,
//                                        PyTorch's names: lr, betas, weight_decay, ...;
//                                        lists space-separated). Absent in files written
//                                        before param groups: those load into an optimizer
//                                        with one group only, taking lr and momentum.
//   dp.scheduler.<name>.kind, .last_epoch, .base_lrs, .last_lrs
//                                        optim::LRSchedulerState of TrainingState::schedulers
//                                        (lists: space-separated decimals, one per group)
//   dp.rng.default, dp.rng.<name>        "<seed> <offset>" of each Generator (Philox:
//                                        seed and counter are its whole state)
//   dp.module_rng.<dotted name>          the same for every generator the module tree
//                                        registered (Module::named_generators, Note
//                                        [Module generators]): "drop.generator.1"
//   dp.checkpoint_version = "2"          files with module generators; version 1 (the
//                                        key absent) came before them
//   user.<key>                           TrainingState::metadata
//   dp.grad_scaler = "1"                 the "grad_scaler.*" tensors hold TrainingState::scaler's
//                                        state_dict (scale, growth tracker, ...)
//
// Note [Checkpoints without module generators]
// A version-2 file must hold exactly the module's generators: one missing or one the
// module lacks is a dp::Error naming them, as a missing or unexpected tensor is (it
// means another architecture: a Dropout has no tensors, so only its generators tell).
// A version-1 file, written before dp saved them, still loads: the module's
// generators keep their state and a warning says that the resumed random masks then
// differ from the uninterrupted run's (unless TrainingState::generators named them
// when saving and loading, the only way it had). That is what a PyTorch user expects
// of an older checkpoint: torch.load keeps reading it, and PyTorch never restored
// random state the file does not hold.
constexpr const char* kOptPrefix = "optimizer.";
constexpr const char* kKindKey = "dp.checkpoint";
constexpr const char* kKindTraining = "training";
constexpr const char* kRngPrefix = "dp.rng.";
constexpr const char* kModuleRngPrefix = "dp.module_rng.";
constexpr const char* kVersionKey = "dp.checkpoint_version";
constexpr std::int64_t kVersion = 2;
constexpr const char* kSchedPrefix = "dp.scheduler.";
constexpr const char* kUserPrefix = "user.";
constexpr const char* kScalerPrefix = "grad_scaler.";
constexpr const char* kScalerKey = "dp.grad_scaler";  // "1" when grad_scaler.* tensors are the scaler's

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

bool is_training(const io::Metadata& m) {
  auto it = m.find(kKindKey);
  return it != m.end() && it->second == kKindTraining;
}

// Matches a file's tensors against `own` by name (nn::match_state_dict): validates
// names (strict), dtypes and shapes before anything is written.
nn::StateDictMatch match(const nn::StateDict& own, const nn::StateDict& file, bool strict,
                         const std::string& path, const char* target = "the module") {
  return nn::match_state_dict(
      own, file, strict, {.what = detail::str_cat("load '", path, "'"), .target = target, .source = "the file"});
}

// The tensors a module load considers: a training checkpoint's optimizer entries are
// not the module's business.
nn::StateDict module_part(io::SafetensorsFile& f) {
  if (!is_training(f.metadata)) return std::move(f.tensors);
  const bool has_scaler = f.metadata.count(kScalerKey) > 0;
  nn::StateDict out;
  for (auto& [k, v] : f.tensors)
    if (!starts_with(k, kOptPrefix) && !(has_scaler && starts_with(k, kScalerPrefix))) out.emplace_back(k, std::move(v));
  return out;
}

nn::LoadResult load_into_module(nn::Module& module, io::SafetensorsFile& f, bool strict, const std::string& path) {
  nn::StateDictMatch m = match(module.state_dict(), module_part(f), strict, path);
  module.load_state_dict(m.matched, /*strict=*/false);  // copies and bumps the set's version
  return m.keys;
}

// ---- metadata numbers ------------------------------------------------------------------

const std::string& meta_get(const io::Metadata& m, const std::string& key, const std::string& path) {
  auto it = m.find(key);
  DP_CHECK(it != m.end(), "load_training_checkpoint '", path, "': the metadata has no '", key,
           "' entry: a corrupt or foreign checkpoint");
  return it->second;
}

template <typename T>
T parse_number(const std::string& s, const std::string& key, const std::string& path) {
  T v{};
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  DP_CHECK(ec == std::errc() && end == s.data() + s.size() && !s.empty(), "load_training_checkpoint '", path,
           "': metadata '", key, "' should be a number, got \"", s, "\"");
  return v;
}

template <typename T>
std::string format_number(T v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest round trip for doubles
  DP_ASSERT(ec == std::errc());
  return std::string(buf, end);
}

std::string generator_state(const Generator& g) {
  return format_number(g.seed()) + " " + format_number(g.offset());
}

std::pair<std::uint64_t, std::uint64_t> parse_generator(const std::string& s, const std::string& key,
                                                        const std::string& path) {
  auto sp = s.find(' ');
  DP_CHECK(sp != std::string::npos, "load_training_checkpoint '", path, "': metadata '", key,
           "' should be \"<seed> <offset>\", got \"", s, "\"");
  return {parse_number<std::uint64_t>(s.substr(0, sp), key, path),
          parse_number<std::uint64_t>(s.substr(sp + 1), key, path)};
}

std::string format_list(const std::vector<double>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ' ';
    s += format_number(v[i]);
  }
  return s;
}

std::vector<double> parse_list(const std::string& s, const std::string& key, const std::string& path) {
  std::vector<double> v;
  std::size_t begin = 0;
  while (begin <= s.size()) {
    const std::size_t end = std::min(s.find(' ', begin), s.size());
    v.push_back(parse_number<double>(s.substr(begin, end - begin), key, path));
    begin = end + 1;
  }
  return v;
}

constexpr const char* kGroupsKey = "dp.optimizer.param_groups";

void save_param_groups(io::Metadata& meta, const optim::Optimizer& optimizer) {
  const auto groups = optimizer.param_groups_state();
  meta[kGroupsKey] = format_number(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::string key = detail::str_cat(kGroupsKey, ".", g, ".");
    std::vector<double> params(groups[g].params.begin(), groups[g].params.end());
    meta[key + "params"] = format_list(params);
    for (const auto& [name, values] : groups[g].options) meta[key + name] = format_list(values);
  }
}

// The param groups a file holds, or nullopt for a file written before them.
std::optional<std::vector<optim::ParamGroupState>> parse_param_groups(const io::Metadata& m, const std::string& path) {
  if (!m.count(kGroupsKey)) return std::nullopt;
  const auto count = parse_number<std::size_t>(m.at(kGroupsKey), kGroupsKey, path);
  std::vector<optim::ParamGroupState> groups(count);
  for (std::size_t g = 0; g < count; ++g) {
    const std::string prefix = detail::str_cat(kGroupsKey, ".", g, ".");
    for (auto it = m.lower_bound(prefix); it != m.end() && starts_with(it->first, prefix); ++it) {
      const std::string name = it->first.substr(prefix.size());
      if (name == "params") {
        const std::string& s = it->second;
        std::size_t begin = 0;
        while (begin < s.size()) {
          const std::size_t end = std::min(s.find(' ', begin), s.size());
          groups[g].params.push_back(parse_number<std::int64_t>(s.substr(begin, end - begin), it->first, path));
          begin = end + 1;
        }
      } else {
        groups[g].options[name] = parse_list(it->second, it->first, path);
      }
    }
    DP_CHECK(m.count(prefix + "params"), "load_training_checkpoint '", path, "': the metadata has no '", prefix,
             "params' entry: a corrupt checkpoint");
  }
  return groups;
}

void save_scheduler(io::Metadata& meta, const std::string& name, const optim::LRScheduler* sched) {
  DP_CHECK(sched != nullptr, "save_training_checkpoint: scheduler '", name, "' is null");
  const std::string key = kSchedPrefix + name;
  DP_CHECK(!meta.count(key + ".kind"), "save_training_checkpoint: two schedulers are named '", name, "'");
  const optim::LRSchedulerState st = sched->state_dict();
  meta[key + ".kind"] = st.kind;
  meta[key + ".last_epoch"] = format_number(st.last_epoch);
  meta[key + ".base_lrs"] = format_list(st.base_lrs);
  meta[key + ".last_lrs"] = format_list(st.last_lrs);
}

optim::LRSchedulerState parse_scheduler(const io::Metadata& m, const std::string& name, const std::string& path) {
  const std::string key = kSchedPrefix + name;
  DP_CHECK(m.count(key + ".kind"), "load_training_checkpoint '", path, "': the checkpoint has no scheduler named '",
           name, "' (was it saved with TrainingState::schedulers naming it?)");
  optim::LRSchedulerState st;
  st.kind = m.at(key + ".kind");
  st.last_epoch = parse_number<std::int64_t>(meta_get(m, key + ".last_epoch", path), key + ".last_epoch", path);
  st.base_lrs = parse_list(meta_get(m, key + ".base_lrs", path), key + ".base_lrs", path);
  st.last_lrs = parse_list(meta_get(m, key + ".last_lrs", path), key + ".last_lrs", path);
  return st;
}

using GeneratorStates = std::vector<std::pair<Generator*, std::pair<std::uint64_t, std::uint64_t>>>;

std::string name_list(const std::vector<std::string>& names) {
  constexpr std::size_t kShown = 8;  // enough to recognise the layer; the count says the rest
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) s += detail::str_cat(i ? ", " : "", "'", names[i], "'");
  if (names.size() > kShown) s += detail::str_cat(" and ", names.size() - kShown, " more");
  return s;
}

// The states of the module's generators in the file, checked both ways (Note
// [Checkpoints without module generators]); nothing is written here.
GeneratorStates parse_module_generators(const io::Metadata& m, nn::Module& module, const std::string& path) {
  const auto own = module.named_generators();
  std::int64_t version = 1;
  if (m.count(kVersionKey)) version = parse_number<std::int64_t>(m.at(kVersionKey), kVersionKey, path);
  DP_CHECK(version >= 1 && version <= kVersion, "load_training_checkpoint '", path, "': checkpoint version ", version,
           " is not one this dp reads (1 to ", kVersion, "): written by a newer dp?");
  GeneratorStates out;
  if (version < 2) {
    if (!own.empty()) {
      detail::log_warning(detail::str_cat(
          "load_training_checkpoint '", path, "': the file predates saved module generators (checkpoint version 1); ",
          own.size(), " generator(s) of the module, '", own.front().first,
          "' first, keep their current state, so the resumed run's random masks differ from the uninterrupted "
          "run's unless TrainingState::generators names them. Save again to store them."));
    }
    return out;
  }
  std::vector<std::string> missing, unexpected;
  std::set<std::string> names;
  for (const auto& [name, gen] : own) {
    names.insert(name);
    const std::string key = kModuleRngPrefix + name;
    auto it = m.find(key);
    if (it == m.end()) {
      missing.push_back(name);
      continue;
    }
    out.emplace_back(gen, parse_generator(it->second, key, path));
  }
  const std::string prefix = kModuleRngPrefix;
  for (auto it = m.lower_bound(prefix); it != m.end() && starts_with(it->first, prefix); ++it) {
    if (!names.count(it->first.substr(prefix.size()))) unexpected.push_back(it->first.substr(prefix.size()));
  }
  std::string problem;
  if (!missing.empty()) problem += detail::str_cat(" Missing from the file: ", name_list(missing), ".");
  if (!unexpected.empty())
    problem += detail::str_cat(" Unexpected (in the file, not in the module): ", name_list(unexpected), ".");
  DP_CHECK(problem.empty(), "load_training_checkpoint '", path,
           "': the module's random generators do not match the file's (another architecture?).", problem);
  return out;
}

// Note [Dropout streams in a checkpoint]
// A Dropout layer's generators are registered as "<layer>.generator.0" … ".63" (Note
// [Dropout generators]), and the file holds one entry per name. In one process, copy r
// draws stream r, so entry s is stream s of the job. Across processes (Note [Dropout
// across processes] in src/parallel/data_parallel.cpp) process p's copy r draws stream
// p * n + r, and the saving process alone holds only its own streams' positions.
// save_training_checkpoint therefore gathers them — one integer all-reduce, in the
// collective part of the save — and writes entry s as stream s of the job, whoever
// drew it (a stream nobody drew: counter 0): the file a single process of the job's
// P * n devices would write. Loading maps back: a layer whose copy 0 draws stream
// first_stream() takes entry first + r for copy r (a stream past the file's 64 keeps
// its state; no saved run drew it). So a run resumed on any topology — P processes ×
// n devices, one process of P * n, or the other way round — draws the masks of the
// uninterrupted run, and the save is collective whenever a Dropout layer is spread
// over processes (every process calls it, as for a Sharded optimizer). A job of more
// than 64 devices with Dropout cannot be saved this way: the save says so on every
// process rather than write a file that loses streams.

// The Dropout layers of `module` (itself included) and the prefix of their generators'
// names ("drop.generator."), in module order.
std::vector<std::pair<nn::Dropout*, std::string>> dropout_layers(nn::Module& module) {
  std::map<const Generator*, std::string> names;
  for (const auto& [name, gen] : module.named_generators()) names.emplace(gen, name);
  std::vector<nn::Dropout*> found;
  if (auto* d = dynamic_cast<nn::Dropout*>(&module)) found.push_back(d);
  for (const auto& m : module.modules())
    if (auto* d = dynamic_cast<nn::Dropout*>(m.get())) found.push_back(d);
  std::vector<std::pair<nn::Dropout*, std::string>> out;
  std::set<const nn::Dropout*> seen;
  for (nn::Dropout* d : found) {
    if (!seen.insert(d).second) continue;
    auto it = names.find(&d->generator(0));
    DP_ASSERT(it != names.end());
    out.emplace_back(d, it->second.substr(0, it->second.size() - 1));  // "<prefix>0"
  }
  return out;
}

// "drop" of "drop.generator.", for messages.
std::string layer_of(const std::string& prefix) {
  const std::string tail = "generator.";
  std::string layer = prefix.substr(0, prefix.size() - std::min(prefix.size(), tail.size()));
  if (!layer.empty() && layer.back() == '.') layer.pop_back();
  return layer.empty() ? "(the module itself)" : layer;
}

// Every stream of every Dropout layer spread over processes, in the job's numbering,
// under its generator name (Note [Dropout streams in a checkpoint]). Collective when
// any layer is spread; every process decides alike (the spread is set by a collective
// construction).
std::map<std::string, std::string> gather_dropout_streams(nn::Module& module) {
  constexpr int kCopies = nn::Dropout::kMaxCopies;
  std::vector<std::pair<nn::Dropout*, std::string>> spread;
  for (auto& [d, prefix] : dropout_layers(module))
    if (d->spread_processes() > 1) spread.emplace_back(d, prefix);
  std::map<std::string, std::string> out;
  if (spread.empty()) return out;
  // Per stream: how many processes drew it, its key, its counter.
  std::vector<std::int64_t> table(spread.size() * kCopies * 3, 0);
  for (std::size_t i = 0; i < spread.size(); ++i) {
    nn::Dropout& d = *spread[i].first;
    const std::int64_t streams = static_cast<std::int64_t>(d.spread_processes()) * d.spread_copies();
    DP_CHECK(streams <= kCopies, "save_training_checkpoint: Dropout '", layer_of(spread[i].second), "' draws ",
             streams, " streams (", d.spread_processes(), " processes x ", d.spread_copies(),
             " devices); a checkpoint holds at most ", kCopies, " per layer, as one process serves");
    for (int r = 0; r < d.spread_copies(); ++r) {
      const std::int64_t s = d.first_stream() + r;
      DP_ASSERT(s < kCopies);
      std::int64_t* at = table.data() + (i * kCopies + static_cast<std::size_t>(s)) * 3;
      at[0] = 1;
      at[1] = static_cast<std::int64_t>(d.generator(r).seed());
      at[2] = static_cast<std::int64_t>(d.generator(r).offset());
    }
  }
  dist::all_reduce(std::span<std::int64_t>(table), dist::Op::Sum);
  for (std::size_t i = 0; i < spread.size(); ++i) {
    nn::Dropout& d = *spread[i].first;
    for (int s = 0; s < kCopies; ++s) {
      const std::int64_t* at = table.data() + (i * kCopies + static_cast<std::size_t>(s)) * 3;
      DP_CHECK(at[0] <= 1, "save_training_checkpoint: stream ", s, " of Dropout '", layer_of(spread[i].second),
               "' is drawn by ", at[0], " processes; the processes' layers disagree on their streams");
      Generator g;  // a stream nobody drew: its key at counter 0
      if (at[0] == 1) {
        g.set_state(static_cast<std::uint64_t>(at[1]), static_cast<std::uint64_t>(at[2]));
      } else {
        g.set_state(d.stream_key(s), 0);
      }
      out.emplace(spread[i].second + std::to_string(s), generator_state(g));
    }
  }
  return out;
}

// The file's states re-aimed at the copies that draw them: a layer whose copy 0 draws
// stream first takes entry first + r for copy r (Note [Dropout streams in a
// checkpoint]); other generators keep their own entry.
GeneratorStates aim_dropout_streams(nn::Module& module, const GeneratorStates& parsed) {
  constexpr int kCopies = nn::Dropout::kMaxCopies;
  const std::map<Generator*, std::pair<std::uint64_t, std::uint64_t>> file(parsed.begin(), parsed.end());
  std::map<Generator*, std::pair<std::uint64_t, std::uint64_t>> aimed = file;
  for (auto& [d, prefix] : dropout_layers(module)) {
    const std::int64_t first = d->first_stream();
    if (first == 0) continue;
    for (int r = 0; r < kCopies; ++r) {
      Generator* to = &d->generator(r);
      auto from = first + r < kCopies ? file.find(&d->generator(static_cast<int>(first + r))) : file.end();
      if (from != file.end()) {
        aimed[to] = from->second;
      } else {
        aimed.erase(to);  // a stream past the file's: no saved run drew it
      }
    }
  }
  GeneratorStates out;
  for (const auto& [gen, st] : parsed)
    if (auto it = aimed.find(gen); it != aimed.end()) out.emplace_back(gen, it->second);
  return out;
}

}  // namespace

// ---- module checkpoints ------------------------------------------------------------------

void save(nn::Module& module, const std::string& path, const io::Metadata& metadata) {
  io::write_safetensors(path, module.state_dict(), metadata);
}

void save(const std::shared_ptr<nn::Module>& module, const std::string& path, const io::Metadata& metadata) {
  DP_CHECK(module != nullptr, "save: null module");
  save(*module, path, metadata);
}

void save(const nn::StateDict& state, const std::string& path, const io::Metadata& metadata) {
  io::write_safetensors(path, state, metadata);
}

nn::LoadResult load(nn::Module& module, const std::string& path, bool strict) {
  io::SafetensorsFile f = io::read_safetensors(path);
  return load_into_module(module, f, strict, path);
}

nn::LoadResult load(const std::shared_ptr<nn::Module>& module, const std::string& path, bool strict) {
  DP_CHECK(module != nullptr, "load: null module");
  return load(*module, path, strict);
}

nn::LoadResult load(const nn::StateDict& into, const std::string& path, bool strict) {
  io::SafetensorsFile f = io::read_safetensors(path);
  // Also rejects a target that names a tensor twice or holds an undefined one.
  nn::StateDictMatch m = match(into, module_part(f), strict, path, "the target");
  std::map<std::string, Tensor> dst(into.begin(), into.end());
  NoGradGuard no_grad;
  for (const auto& [k, src] : m.matched) dst.at(k).copy_(src);
  return m.keys;
}

nn::StateDict load(const std::string& path) { return io::read_safetensors(path).tensors; }

// ---- training checkpoints ----------------------------------------------------------------

void save_training_checkpoint(const std::string& path, nn::Module& module, optim::Optimizer& optimizer,
                              const TrainingState& state, bool write) {
  nn::StateDict tensors;
  std::map<std::string, std::string> dropout_streams;  // Note [Dropout streams in a checkpoint]
  {
    // Across processes a Sharded optimizer's state_dict gathers every process's
    // shards (and the module's may finish a deferred gather of the parameters), and a
    // Dropout layer spread over processes gathers its streams (Note [Dropout streams in
    // a checkpoint]): a
    // process calling this alone meets the others in another collective, or times
    // out. Whatever fails there names the save and its rule.
    dist::CollectiveScope scope(
        "save_training_checkpoint (collective for a Sharded optimizer or a Dropout layer across processes: "
        "every process must call it, write = true on one, false on the others)");
    tensors = module.state_dict();
    for (const auto& [k, v] : tensors) {
      DP_CHECK(!starts_with(k, kOptPrefix), "save_training_checkpoint: the module's state name '", k,
               "' starts with '", kOptPrefix, "', which the checkpoint reserves for the optimizer; rename that child");
    }
    for (auto& [k, v] : optimizer.state_dict()) tensors.emplace_back(kOptPrefix + k, v);
    if (state.scaler != nullptr) {
      for (const auto& [k, v] : tensors)
        DP_CHECK(!starts_with(k, kScalerPrefix), "save_training_checkpoint: the module's state name '", k,
                 "' starts with '", kScalerPrefix, "', which the checkpoint reserves for the GradScaler; rename that child");
      for (auto& [k, v] : state.scaler->state_dict()) tensors.emplace_back(kScalerPrefix + k, v);
    }
    dropout_streams = gather_dropout_streams(module);
  }
  if (!write) return;

  io::Metadata meta;
  meta[kKindKey] = kKindTraining;
  meta["dp.step"] = format_number(state.step);
  meta["dp.epoch"] = format_number(state.epoch);
  meta["dp.batch"] = format_number(state.batch);
  meta["dp.optimizer.lr"] = format_number(optimizer.lr());
  if (const auto m = optimizer.momentum()) meta["dp.optimizer.momentum"] = format_number(*m);
  save_param_groups(meta, optimizer);
  meta[std::string(kRngPrefix) + "default"] = generator_state(default_generator());
  for (const auto& [name, gen] : state.generators) {
    DP_CHECK(gen != nullptr, "save_training_checkpoint: generator '", name, "' is null");
    DP_CHECK(name != "default", "save_training_checkpoint: the generator name 'default' is reserved for "
             "dp::default_generator(), which is always saved");
    auto [it, fresh] = meta.emplace(kRngPrefix + name, generator_state(*gen));
    DP_CHECK(fresh, "save_training_checkpoint: two generators are named '", name, "'");
  }
  meta[kVersionKey] = format_number(kVersion);
  for (const auto& [name, gen] : module.named_generators()) {
    auto spread = dropout_streams.find(name);
    meta[kModuleRngPrefix + name] = spread != dropout_streams.end() ? spread->second : generator_state(*gen);
  }
  for (const auto& [name, sched] : state.schedulers) save_scheduler(meta, name, sched);
  for (const auto& [k, v] : state.metadata) meta[kUserPrefix + k] = v;
  if (state.scaler != nullptr) meta[kScalerKey] = "1";
  io::write_safetensors(path, tensors, meta);
}

void load_training_checkpoint(const std::string& path, nn::Module& module, optim::Optimizer& optimizer,
                              TrainingState& state) {
  io::SafetensorsFile f = io::read_safetensors(path);
  DP_CHECK(is_training(f.metadata), "load_training_checkpoint '", path,
           "': not a training checkpoint (no \"dp.checkpoint\": \"training\" metadata); a module "
           "checkpoint written by dp::save loads with dp::load");
  const io::Metadata& m = f.metadata;
  // Parse every scalar first: nothing is written until all of it is known good.
  const auto step = parse_number<std::int64_t>(meta_get(m, "dp.step", path), "dp.step", path);
  const auto epoch = parse_number<std::int64_t>(meta_get(m, "dp.epoch", path), "dp.epoch", path);
  const auto batch = parse_number<std::int64_t>(meta_get(m, "dp.batch", path), "dp.batch", path);
  const auto lr = parse_number<double>(meta_get(m, "dp.optimizer.lr", path), "dp.optimizer.lr", path);
  const std::string rng_default = std::string(kRngPrefix) + "default";
  const auto def_rng = parse_generator(meta_get(m, rng_default, path), rng_default, path);
  std::vector<std::pair<Generator*, std::pair<std::uint64_t, std::uint64_t>>> gens;
  for (const auto& [name, gen] : state.generators) {
    DP_CHECK(gen != nullptr, "load_training_checkpoint: generator '", name, "' is null");
    const std::string key = kRngPrefix + name;
    DP_CHECK(m.count(key), "load_training_checkpoint '", path, "': the checkpoint has no generator named '",
             name, "' (was it saved with TrainingState::generators naming it?)");
    gens.emplace_back(gen, parse_generator(m.at(key), key, path));
  }
  const auto module_gens = aim_dropout_streams(module, parse_module_generators(m, module, path));
  std::optional<double> momentum;
  if (m.count("dp.optimizer.momentum") && optimizer.momentum()) {
    momentum = parse_number<double>(m.at("dp.optimizer.momentum"), "dp.optimizer.momentum", path);
  }
  const auto groups = parse_param_groups(m, path);
  DP_CHECK(groups || optimizer.num_param_groups() == 1, "load_training_checkpoint '", path,
           "': the file holds one parameter group (written before dp saved param groups), the optimizer has ",
           optimizer.num_param_groups(), "; build the optimizer with one group, as the saved run did");
  std::vector<std::pair<optim::LRScheduler*, optim::LRSchedulerState>> scheds;
  for (const auto& [name, sched] : state.schedulers) {
    DP_CHECK(sched != nullptr, "load_training_checkpoint: scheduler '", name, "' is null");
    scheds.emplace_back(sched, parse_scheduler(m, name, path));
  }
  std::map<std::string, std::string> user;
  for (const auto& [k, v] : m)
    if (starts_with(k, kUserPrefix)) user[k.substr(std::string(kUserPrefix).size())] = v;

  nn::StateDict opt_state, scaler_state;
  for (const auto& [k, v] : f.tensors) {
    if (starts_with(k, kOptPrefix)) opt_state.emplace_back(k.substr(std::string(kOptPrefix).size()), v);
    if (m.count(kScalerKey) && starts_with(k, kScalerPrefix)) scaler_state.emplace_back(k.substr(std::string(kScalerPrefix).size()), v);
  }
  if (state.scaler != nullptr) {
    DP_CHECK(!scaler_state.empty() || !state.scaler->is_enabled(), "load_training_checkpoint '", path,
             "': the checkpoint has no GradScaler state (was it saved with TrainingState::scaler set?)");
    amp::GradScaler probe;  // validates before anything is written
    if (state.scaler->is_enabled()) probe.load_state_dict(scaler_state);
  }
  nn::StateDict to_copy = match(module.state_dict(), module_part(f), /*strict=*/true, path).matched;

  // The optimizer validates its whole state before writing any of it; the module part
  // is validated above. Keep the optimizer's old state in case the module copy fails.
  nn::StateDict old_opt;
  for (auto& [k, v] : optimizer.state_dict()) old_opt.emplace_back(k, v.clone());
  // Every group's lr, momentum and other hyper-parameters.
  const std::vector<optim::ParamGroupState> old_groups = optimizer.param_groups_state();
  std::vector<optim::LRSchedulerState> old_scheds;
  for (auto& [sched, st] : scheds) old_scheds.push_back(sched->state_dict());
  // The hyper-parameters first: whether SGD keeps a momentum buffer depends on them.
  // Param groups load all or nothing, their structure checked first.
  if (groups) {
    optimizer.load_param_groups_state(*groups);
  } else if (momentum) {
    optimizer.set_momentum(*momentum);
  }
  try {
    optimizer.load_state_dict(opt_state);
  } catch (...) {
    optimizer.load_param_groups_state(old_groups);
    throw;
  }
  try {
    if (!groups) optimizer.set_lr(lr);
    for (auto& [sched, st] : scheds) sched->load_state_dict(st);
    module.load_state_dict(to_copy, /*strict=*/false);
  } catch (...) {
    optimizer.load_param_groups_state(old_groups);
    optimizer.load_state_dict(old_opt);
    for (std::size_t i = 0; i < old_scheds.size(); ++i) scheds[i].first->load_state_dict(old_scheds[i]);
    throw;
  }
  if (state.scaler != nullptr) state.scaler->load_state_dict(scaler_state);  // validated above
  default_generator().set_state(def_rng.first, def_rng.second);
  for (auto& [gen, st] : gens) gen->set_state(st.first, st.second);
  for (auto& [gen, st] : module_gens) gen->set_state(st.first, st.second);
  state.step = step;
  state.epoch = epoch;
  state.batch = batch;
  state.metadata = std::move(user);
}

}  // namespace dp
