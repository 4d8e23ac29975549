// tests/optim/optim_fuzz_replay.cpp — runs the differential optimizer fuzzer's programs in
// dp and compares them with PyTorch's results (scripts/optim_fuzz.py draws them).
//
//   optim_fuzz_replay tests/optim/optim_fuzz_corpus.safetensors        # every program, CPU
//   optim_fuzz_replay FILE --device cuda:0                             # on a GPU (77: none)
//   optim_fuzz_replay FILE --case c17 --verbose                        # one, printed
//   optim_fuzz_replay FILE --design all --devices 3                    # in every design
//   mpirun -np 2 optim_fuzz_replay FILE --design DDP,Sharded1          # across processes
//
// The file holds, per program c<seed>: its text (metadata "program.c<seed>", lines
// separated by "; "), the parameters' first values p<i> and the gradients g<k> (float32),
// and at each "check k<n>" line PyTorch's float64 results — tensors compared within a
// bound as float32, scalars compared exactly as the bits of their float64 in int64
// tensors (dp has no float64 dtype): the parameters k<n>.p<i> with their bounds k<n>.bp<i>, the
// optimizer's state k<n>.s<j>.<name> (bounds k<n>.bs<j>.<name>; "step" exact), every
// group's lr and momentum k<n>.lr, k<n>.mom (exact), the GradScaler's scale and growth
// tracker (exact), and the norm of each clip_norm so far k<n>.n<j> (bounds k<n>.bn<j>).
// Exit status: 0 when every program agrees, 1 when one does not (each printed with what
// differs), 2 on bad usage or an unreadable file, 77 when --device names a device that is
// not there. With --design the module programs run in the designs named (DP, DDP,
// Sharded1-3, all) on --devices devices of --device's type, the others are counted as
// not applicable.
//
// Note [Optimizer fuzzer]
// The loop fuzzer (tests/parallel/loop_fuzz.cpp) compares dp's designs with each other
// and the op fuzzer (Note [Op fuzzer]) compares the ops with PyTorch; an optimizer, a
// scheduler or a gradient scaler that does the wrong thing does it alike in every design
// and is not an op. This fuzzer compares what happens between two backwards with
// PyTorch's torch.optim, lr_scheduler, clip_grad_*_ and amp.GradScaler, whose semantics
// dp promises. A random program — 1-4 parameters of a module (one parameter set, flat
// buffers) or loose tensors; SGD (momentum, dampening, Nesterov, weight decay), Adam or
// AdamW with random hyper-parameters, in one group or two with their own; zero, one or
// two schedulers stepped together (StepLR, MultiStepLR, ExponentialLR,
// CosineAnnealingLR, LinearLR, OneCycleLR with its momentum cycle); perhaps a
// GradScaler — then 1-6 steps, each of: zero_grad (to none or to zeros, or not at all,
// so gradients accumulate), parameters frozen and unfrozen, gradients set (`p.grad =
// g`) or added into (`p.grad.add_(g)`) on some parameters and not others (a parameter
// without a gradient is skipped, its own step count kept), of magnitudes 1e-3 to 30
// with zeros among them, an infinity or NaN in one gradient under a scaler, unscale_,
// clip_grad_norm_ (norm 2, 1 or inf) and clip_grad_value_, the step (the scaler's
// step and update), the schedulers' step, an lr or another hyper-parameter of a group
// set by hand (PyTorch's param_groups[g][key] = value), and a resume: a fresh
// optimizer, schedulers and scaler built as at the start and given the state dicts of
// the old ones (every other resume of a module's parameters through a training
// checkpoint file: save_training_checkpoint, load_training_checkpoint). After each step dp's parameters,
// optimizer state (both ways: an entry on one side only differs), lrs, momenta, scale
// and clip norms are compared with PyTorch's.
//
// The oracle is the op fuzzer's: PyTorch runs each program in float32 and in float64;
// the float64 run stands for the exact result, and the float32 run's error measures
// the rounding the program allows. A value t passes when
//     max|t_dp - t_64| <= 16 * max|t_pt - t_64| + steps * 2^-20 * max|t_64|
// (the second term a floor where PyTorch's float32 happens to be exact: sixteen float32
// roundings per step, relative to the tensor's own scale, so a moment of 1e-6 is held to
// 1e-6's precision). Learning rates, momenta, the scale, the growth tracker and step
// counts are exact: they are doubles and integers in both libraries, computed by the
// same formulas. A wrong formula, a parameter stepped that PyTorch skips (or the
// reverse), a lost state entry, a scale that moves at the wrong step is far outside
// the bound; an error that dp throws where PyTorch runs is reported too. CI replays a
// fixed corpus (tests/optim/optim_fuzz_corpus.safetensors, written by the script with
// PyTorch, so the test needs no Python); `scripts/optim_fuzz.py --replay BIN --seeds A:B`
// hunts further. Its first run found Adam's 1 - beta2 taken in float (every exp_avg_sq
// 1.3e-5 from PyTorch's), the parameters' own step counts lost by a state dict saved
// right after a load, a linear decay to zero refused at its last step, a NaN total
// norm that left the gradients unclipped, SGD's momentum buffers dropped from its state
// dict while momentum was 0, frozen parameters' zero gradients poisoned by a NaN clip
// factor, and momentum buffers started per group where PyTorch starts them per parameter.
//
// In the designs (--design). The optimizer does its work on every copy that needs it
// (DDP's replicas, each with its own state) or on every range (Sharded), saves and
// loads states gathered from them, and clips over them: what PyTorch's one tensor
// list does is split over copies, ranges and, under mpirun, processes. So the programs
// of a module's parameters also run wrapped in DataParallel, against the same PyTorch
// results. Half of those programs take their gradients from backward: a line
// "backward 0=g3 2=g4" runs the module on a batch whose last row holds g3 and g4 in
// their parameters' columns and zeros elsewhere (Params::forward), so backward gives
// exactly PyTorch's p.grad = g where there was none and p.grad += g where there was
// one (sums with zeros are exact, in any grouping of rows by device or process), leaves
// the parameters not named unreached, and never touches a frozen one, which the module
// still uses. Across processes only the last process's rows hold the gradients, and
// the loss is P times the sum (DataParallel weighs each process's gradient by its
// share of the rows, 1/P; exact for P a power of two). DP and DDP take gradients set by
// hand through parameters() too (device 0's copy, which DP steps and DDP broadcasts
// before its next update, Note [Gradient edits]); a Sharded step refuses them, so
// Sharded runs only the backward programs. After each check DDP's and Sharded's
// replicas must be bitwise equal (check_replicas). A resume from a file may go on in
// the next design on one device fewer, as a job resumed on other hardware: a fresh
// module and DataParallel given the checkpoint (Run::move), where PyTorch's program
// has no gradient from then on (Run::may_move). Its first run found a Sharded
// optimizer's state_dict across processes skipping the exchange on the process whose
// first device owned the whole state (a set within one aligned range), so the job
// aborted on mismatched collectives; and, resumed into DDP, check_replicas() blaming
// memory written behind dp's back for replicas only waiting for device 0's parameters
// after the load, which led to DDP stepping them from their old parameters (Note [When
// replicas are refreshed] in src/parallel/design.cpp).

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "../fuzz_replay.h"
#include "dp/dp.h"

namespace {

using dp::Tensor;
using fuzz_replay::Outcome;
using fuzz_replay::split_on;
using fuzz_replay::words;

/// "key=value" words from index `from` on.
std::map<std::string, std::string> key_values(const std::vector<std::string>& w, std::size_t from) {
  std::map<std::string, std::string> out;
  for (std::size_t i = from; i < w.size(); ++i) {
    const auto eq = w[i].find('=');
    DP_CHECK(eq != std::string::npos, "optim_fuzz_replay: expected key=value, got '", w[i], "'");
    out[w[i].substr(0, eq)] = w[i].substr(eq + 1);
  }
  return out;
}

std::vector<double> numbers(const std::string& s) {
  std::vector<double> out;
  for (const auto& x : split_on(s, ",")) out.push_back(std::stod(x));
  return out;
}

std::vector<std::int64_t> shape_of(const std::string& s) {
  std::vector<std::int64_t> out;
  for (const auto& x : split_on(s, "x")) out.push_back(std::stoll(x));
  return out;
}

/// A module that holds the program's parameters: one parameter set, flat buffers. Its
/// forward takes x [rows, n] (n: the parameters' elements, in order) and returns, per
/// row, the sum of x's columns times the parameters' elements over the parameters in
/// use, so the gradient backward leaves in a parameter is the sum of its columns over
/// the rows: a backward gives every parameter in use and not frozen exactly the
/// gradient the program names (held in one row, zeros in the others) and leaves the
/// others unreached.
class Params : public dp::nn::Module {
 public:
  explicit Params(const std::vector<Tensor>& values) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      slots_.push_back(register_parameter("p" + std::to_string(i), values[i]));
      offsets_.push_back(columns_);
      columns_ += values[i].numel();
    }
    in_use_.assign(values.size(), true);
  }
  std::string type_name() const override { return "Params"; }
  std::int64_t columns() const { return columns_; }
  std::int64_t offset(std::size_t i) const { return offsets_.at(i); }
  /// Set between forwards, read by every worker's forward.
  void use(std::vector<bool> in_use) { in_use_ = std::move(in_use); }

  Tensor forward(const Tensor& x) override {
    Tensor y;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (!in_use_[i]) continue;
      const Tensor& p = slots_[i].get();  // the worker's copy
      const Tensor term = dp::sum(dp::mul(x.narrow(1, offsets_[i], p.numel()), p.reshape({1, -1})), 1);
      y = y.defined() ? dp::add(y, term) : term;
    }
    return y;
  }

 private:
  std::vector<dp::nn::Parameter> slots_;
  std::vector<std::int64_t> offsets_;
  std::int64_t columns_ = 0;
  std::vector<bool> in_use_;
};

/// A DataParallel design the programs may run in (--design), on --devices devices.
struct Design {
  std::string name;
  dp::DataParallelOptions options;
};

const char* const kDiffersElsewhere = "another process found a difference at this check";

std::vector<Design> all_designs() {
  return {{"DP", {.mode = dp::Mode::DP}},
          {"DDP", {.mode = dp::Mode::DDP}},
          {"Sharded1", {.mode = dp::Mode::Sharded, .shard_stage = 1}},
          {"Sharded2", {.mode = dp::Mode::Sharded, .shard_stage = 2}},
          {"Sharded3", {.mode = dp::Mode::Sharded, .shard_stage = 3}}};
}

/// Whether `design` can run the program of `lines`: a module's parameters, and gradients
/// set by hand only where the design takes edits of .grad (DP and DDP; a Sharded step
/// refuses them, Note [Gradient edits] in src/parallel/designs/ddp.cpp).
bool applies(const Design& design, const std::vector<std::string>& lines) {
  if (lines.empty() || lines[0].rfind("params module", 0) != 0) return false;
  return design.options.mode != dp::Mode::Sharded ||
         std::none_of(lines.begin(), lines.end(), [](const std::string& l) { return l.rfind("grad ", 0) == 0; });
}

/// One program's run in dp.
class Run {
 public:
  /// `lines`: the program. `designs` (with `start`): run the module in designs[start] on
  /// `devices` devices of `device`'s type, resumes from a file moving on through the
  /// others (null: on `device` alone, no wrapper).
  Run(const std::map<std::string, Tensor>& file, std::string prefix, std::vector<std::string> lines, dp::Device device,
      const std::vector<Design>* designs = nullptr, std::size_t start = 0, int devices = 1)
      : file_(file),
        prefix_(std::move(prefix)),
        lines_(std::move(lines)),
        device_(device),
        designs_(designs),
        design_(designs ? &designs->at(start) : nullptr),
        devices_(devices),
        first_devices_(devices) {}

  const Tensor& file_tensor(const std::string& name) const {
    auto it = file_.find(prefix_ + "." + name);
    DP_CHECK(it != file_.end(), "optim_fuzz_replay: the file has no tensor ", prefix_, ".", name);
    return it->second;
  }
  bool has(const std::string& name) const { return file_.count(prefix_ + "." + name) != 0; }
  /// A float64 tensor of the file: float32 values widened, or the bits of float64 values
  /// in an int64 tensor.
  std::vector<double> doubles(const std::string& name) const {
    const Tensor& t = file_tensor(name);
    if (t.dtype() == dp::Dtype::Float32) {
      const auto v = t.to_vector();
      return std::vector<double>(v.begin(), v.end());
    }
    const auto bits = t.to_vector_i64();
    std::vector<double> out(bits.size());
    std::memcpy(out.data(), bits.data(), bits.size() * sizeof(double));
    return out;
  }

  /// Runs line `at` of the program.
  void line(std::size_t at) {
    at_ = at;
    const std::string& text = lines_.at(at);
    const auto w = words(text);
    DP_CHECK(!w.empty(), "optim_fuzz_replay: an empty line");
    const std::string& op = w[0];
    if (op == "params") {
      loose_ = w.at(1) == "loose";
      std::vector<Tensor> values;
      for (std::size_t i = 2; i < w.size(); ++i) {
        const auto k = std::to_string(i - 2);
        values.push_back(file_tensor("p" + k).reshape(shape_of(w[i])).to(device_).clone());
      }
      if (loose_) {
        for (auto& v : values) v.set_requires_grad(true);
        params_ = values;
      } else {
        module_ = std::make_shared<Params>(values);
        if (design_) wrap();
      }
    } else if (op == "opt") {
      opt_kind_ = w.at(1);
      opt_options_ = key_values(w, 2);
    } else if (op == "group") {
      std::vector<std::size_t> idx;
      for (double x : numbers(w.at(1))) idx.push_back(static_cast<std::size_t>(x));
      groups_.emplace_back(idx, key_values(w, 2));
    } else if (op == "sched") {
      sched_specs_.emplace_back(w.at(1), key_values(w, 2));
    } else if (op == "scaler") {
      scaler_spec_ = key_values(w, 1);
    } else if (op == "zero_grad") {
      built();
      opt_->zero_grad(w.at(1) == "none");
    } else if (op == "freeze" || op == "unfreeze") {
      param(w.at(1)).set_requires_grad(op == "unfreeze");
    } else if (op == "grad") {
      const Tensor& p = param(w.at(1));
      const Tensor g = file_tensor(w.at(2)).reshape(p.shape()).to(device_);
      if (w.at(3) == "set") {
        p.set_grad(g.clone());
      } else {
        p.grad().add_(g);
      }
    } else if (op == "backward") {
      backward(w);
    } else if (op == "unscale") {
      scaler_->unscale_(*opt_);
    } else if (op == "clip_norm") {
      norms_.push_back(dp::nn::utils::clip_grad_norm_(with_grad(), std::stod(w.at(1)), std::stod(w.at(2))));
    } else if (op == "clip_value") {
      dp::nn::utils::clip_grad_value_(with_grad(), std::stod(w.at(1)));
    } else if (op == "step") {
      built();
      if (scaler_) {
        scaler_->step(*opt_);
        scaler_->update();
      } else {
        opt_->step();
      }
    } else if (op == "sched_step") {
      for (auto& s : scheds_) s->step();
    } else if (op == "set_lr") {
      opt_->set_group_lr(std::stoul(w.at(1)), std::stod(w.at(2)));
    } else if (op == "set_option") {
      set_option(std::stoul(w.at(1)), w.at(2), w.at(3));
    } else if (op == "resume") {
      resume();
    } else if (op == "check") {
      built();
      check(w.at(1));
      // Across processes every process stops at the first check that differs in any one.
      if (model_ && dp::dist::world_size() > 1 &&
          dp::dist::all_reduce(static_cast<std::int64_t>(problems_.size()), dp::dist::Op::Max) > 0 &&
          problems_.empty())
        problems_.push_back(kDiffersElsewhere);
    } else {
      DP_CHECK(false, "optim_fuzz_replay: unknown line '", text, "'");
    }
  }

  const std::vector<std::string>& problems() const { return problems_; }
  /// The designs a run moved through at its resumes, "" when it stayed in one.
  const std::string& moves() const { return moves_; }

 private:
  /// The parameters, taken afresh at each use: a Sharded stage 3 module gives full
  /// tensors readable until it next runs (Note [Sharded parameters]).
  std::vector<Tensor> params() const { return loose_ ? params_ : module_->parameters().tensors(); }
  Tensor param(const std::string& w) const { return params().at(std::stoul(w)); }

  /// "backward i=g<k> ...": x holds each named gradient in its parameter's columns of
  /// its last row (so in a design the last device's shard carries it; across processes
  /// the last process's), zeros elsewhere; the module uses those parameters and the
  /// frozen ones (which backward must leave alone), and the sum of its output is
  /// backpropagated. Across processes DataParallel scales each process's gradient by
  /// its share of the global batch (the convention for a mean loss), 1/P of it here: the
  /// loss is P times the sum, exact for P a power of two.
  void backward(const std::vector<std::string>& w) {
    DP_CHECK(!loose_, "optim_fuzz_replay: backward needs a module's parameters");
    const int processes = model_ ? dp::dist::world_size() : 1;
    const bool carries = !model_ || dp::dist::rank() == processes - 1;
    const std::int64_t rows = std::max(devices_, 3);
    std::vector<float> x(static_cast<std::size_t>(rows * module_->columns()), 0.0f);
    const auto ps = params();
    std::vector<bool> in_use(ps.size());
    for (std::size_t i = 0; i < ps.size(); ++i) in_use[i] = !ps[i].requires_grad();
    for (std::size_t k = 1; k < w.size(); ++k) {
      const auto pair = split_on(w[k], "=");
      DP_CHECK(pair.size() == 2, "optim_fuzz_replay: expected i=g<k>, got '", w[k], "'");
      const std::size_t i = std::stoul(pair[0]);
      const auto g = file_tensor(pair[1]).to_vector();
      DP_CHECK(g.size() == static_cast<std::size_t>(ps.at(i).numel()), "optim_fuzz_replay: ", pair[1], " has ",
               g.size(), " values for parameter ", i, " of ", ps.at(i).numel());
      if (carries) std::copy(g.begin(), g.end(), x.begin() + (rows - 1) * module_->columns() + module_->offset(i));
      in_use[i] = true;
    }
    module_->use(in_use);
    const Tensor input = dp::from_vector(x, {rows, module_->columns()}).to(device_);
    const Tensor out = model_ ? (*model_)(input) : module_->forward(input);
    const Tensor loss = dp::sum(out);
    (processes > 1 ? dp::mul(loss, static_cast<double>(processes)) : loss).backward();
  }

  /// The parameters clip_grad_*_ gets: PyTorch's program passes those with a .grad.
  dp::nn::ParameterList with_grad() {
    if (!loose_) return module_->parameters();  // a set's .grad is never undefined
    std::vector<Tensor> out;
    for (const auto& p : params_)
      if (p.grad().defined()) out.push_back(p);
    return dp::nn::ParameterList(out, {}, nullptr);
  }

  /// Builds the optimizer, schedulers and scaler at the first line that needs them.
  void built() {
    if (!opt_) build();
  }

  void build() {
    scheds_.clear();  // they refer to the optimizer
    if (groups_.empty()) {
      opt_ = make_optimizer({});
    } else {
      opt_ = make_optimizer(groups_);
    }
    for (const auto& [kind, o] : sched_specs_) scheds_.push_back(make_scheduler(kind, o));
    scaler_.reset();
    if (scaler_spec_) {
      const auto& o = *scaler_spec_;
      scaler_.emplace(dp::amp::GradScalerOptions{.init_scale = std::stod(o.at("init_scale")),
                                                 .growth_factor = std::stod(o.at("growth_factor")),
                                                 .backoff_factor = std::stod(o.at("backoff_factor")),
                                                 .growth_interval = std::stoll(o.at("growth_interval"))});
    }
  }

  dp::nn::ParameterList group_list(const std::vector<std::size_t>& idx) {
    if (loose_) {
      std::vector<Tensor> out;
      for (auto i : idx) out.push_back(params_.at(i));
      return dp::nn::ParameterList(out, {}, nullptr);
    }
    std::size_t at = 0;
    return module_->parameters().filter(
        [&](const Tensor&) { return std::find(idx.begin(), idx.end(), at++) != idx.end(); });
  }

  dp::nn::ParameterList all() { return loose_ ? dp::nn::ParameterList(params_, {}, nullptr) : module_->parameters(); }

  using Options = std::map<std::string, std::string>;
  static std::optional<double> get(const Options& o, const std::string& k) {
    auto it = o.find(k);
    return it == o.end() ? std::nullopt : std::optional<double>(std::stod(it->second));
  }

  std::unique_ptr<dp::optim::Optimizer> make_optimizer(
      const std::vector<std::pair<std::vector<std::size_t>, Options>>& groups) {
    const Options& d = opt_options_;
    if (opt_kind_ == "SGD") {
      dp::optim::SGDOptions o;
      if (auto v = get(d, "lr")) o.lr = *v;
      if (auto v = get(d, "momentum")) o.momentum = *v;
      if (auto v = get(d, "dampening")) o.dampening = *v;
      if (auto v = get(d, "weight_decay")) o.weight_decay = *v;
      if (auto v = get(d, "nesterov")) o.nesterov = *v != 0;
      if (groups.empty()) return std::make_unique<dp::optim::SGD>(all(), o);
      std::vector<dp::optim::SGDParamGroup> gs;
      for (const auto& [idx, g] : groups) {
        dp::optim::SGDGroupOptions go;
        go.lr = get(g, "lr");
        go.momentum = get(g, "momentum");
        go.dampening = get(g, "dampening");
        go.weight_decay = get(g, "weight_decay");
        if (auto v = get(g, "nesterov")) go.nesterov = *v != 0;
        gs.emplace_back(group_list(idx), go);
      }
      return std::make_unique<dp::optim::SGD>(std::move(gs), o);
    }
    DP_CHECK(opt_kind_ == "Adam" || opt_kind_ == "AdamW", "optim_fuzz_replay: unknown optimizer ", opt_kind_);
    const bool decoupled = opt_kind_ == "AdamW";
    dp::optim::AdamOptions o;
    if (decoupled) o.weight_decay = dp::optim::AdamWOptions{}.weight_decay;
    if (auto v = get(d, "lr")) o.lr = *v;
    if (auto it = d.find("betas"); it != d.end()) {
      const auto b = numbers(it->second);
      o.betas = {b.at(0), b.at(1)};
    }
    if (auto v = get(d, "eps")) o.eps = *v;
    if (auto v = get(d, "weight_decay")) o.weight_decay = *v;
    std::vector<dp::optim::AdamParamGroup> gs;
    for (const auto& [idx, g] : groups) {
      dp::optim::AdamGroupOptions go;
      go.lr = get(g, "lr");
      if (auto it = g.find("betas"); it != g.end()) {
        const auto b = numbers(it->second);
        go.betas = dp::optim::AdamBetas{b.at(0), b.at(1)};
      }
      go.eps = get(g, "eps");
      go.weight_decay = get(g, "weight_decay");
      gs.emplace_back(group_list(idx), go);
    }
    if (decoupled) {
      const dp::optim::AdamWOptions ow{.lr = o.lr, .betas = o.betas, .eps = o.eps, .weight_decay = o.weight_decay};
      if (groups.empty()) return std::make_unique<dp::optim::AdamW>(all(), ow);
      return std::make_unique<dp::optim::AdamW>(std::move(gs), ow);
    }
    if (groups.empty()) return std::make_unique<dp::optim::Adam>(all(), o);
    return std::make_unique<dp::optim::Adam>(std::move(gs), o);
  }

  std::unique_ptr<dp::optim::LRScheduler> make_scheduler(const std::string& kind, const Options& o) {
    namespace op = dp::optim;
    auto d = [&](const char* k) { return std::stod(o.at(k)); };
    auto i = [&](const char* k) { return std::stoll(o.at(k)); };
    if (kind == "StepLR") return std::make_unique<op::StepLR>(*opt_, op::StepLROptions{i("step_size"), d("gamma")});
    if (kind == "MultiStepLR") {
      std::vector<std::int64_t> m;
      for (double x : numbers(o.at("milestones"))) m.push_back(static_cast<std::int64_t>(x));
      return std::make_unique<op::MultiStepLR>(*opt_, op::MultiStepLROptions{m, d("gamma")});
    }
    if (kind == "ExponentialLR") return std::make_unique<op::ExponentialLR>(*opt_, op::ExponentialLROptions{d("gamma")});
    if (kind == "CosineAnnealingLR")
      return std::make_unique<op::CosineAnnealingLR>(*opt_, op::CosineAnnealingLROptions{i("T_max"), d("eta_min")});
    if (kind == "LinearLR")
      return std::make_unique<op::LinearLR>(
          *opt_, op::LinearLROptions{d("start_factor"), d("end_factor"), i("total_iters")});
    DP_CHECK(kind == "OneCycleLR", "optim_fuzz_replay: unknown scheduler ", kind);
    op::OneCycleLROptions c;
    c.max_lr = d("max_lr");
    c.total_steps = i("total_steps");
    c.pct_start = d("pct_start");
    c.anneal_strategy = o.at("anneal_strategy") == "cos" ? op::AnnealStrategy::Cos : op::AnnealStrategy::Linear;
    c.cycle_momentum = i("cycle_momentum") != 0;
    c.base_momentum = d("base_momentum");
    c.max_momentum = d("max_momentum");
    c.div_factor = d("div_factor");
    c.final_div_factor = d("final_div_factor");
    c.three_phase = i("three_phase") != 0;
    return std::make_unique<op::OneCycleLR>(*opt_, c);
  }

  /// A fresh optimizer, schedulers and scaler, given the old ones' states (the order of
  /// a resumed training run: build, then load): every other resume of a module's
  /// parameters through a training checkpoint file, the others in memory.
  void resume() {
    built();
    if (!loose_ && resumes_++ % 2 == 1) {
      resume_from_file();
      return;
    }
    const auto state = opt_->state_dict();
    const auto groups = opt_->param_groups_state();
    std::vector<dp::optim::LRSchedulerState> sched_states;
    for (const auto& s : scheds_) sched_states.push_back(s->state_dict());
    const auto scaler_state = scaler_ ? scaler_->state_dict() : dp::nn::StateDict{};
    build();
    opt_->load_state_dict(state);
    opt_->load_param_groups_state(groups);
    for (std::size_t k = 0; k < scheds_.size(); ++k) scheds_[k]->load_state_dict(sched_states[k]);
    if (scaler_) scaler_->load_state_dict(scaler_state);
  }

  /// PyTorch's param_groups[g][key] = value: group g's options with one field changed.
  void set_option(std::size_t g, const std::string& key, const std::string& value) {
    if (auto* sgd = dynamic_cast<dp::optim::SGD*>(opt_.get())) {
      dp::optim::SGDOptions o = sgd->options(g);
      if (key == "momentum") o.momentum = std::stod(value);
      else if (key == "dampening") o.dampening = std::stod(value);
      else if (key == "weight_decay") o.weight_decay = std::stod(value);
      else if (key == "nesterov") o.nesterov = std::stoi(value) != 0;
      else DP_CHECK(false, "optim_fuzz_replay: SGD has no option ", key);
      sgd->set_options(g, o);
      return;
    }
    auto* adam = dynamic_cast<dp::optim::Adam*>(opt_.get());
    DP_CHECK(adam != nullptr, "optim_fuzz_replay: set_option on an optimizer of no known kind");
    dp::optim::AdamOptions o = adam->options(g);
    if (key == "betas") {
      const auto b = numbers(value);
      o.betas = {b.at(0), b.at(1)};
    } else if (key == "eps") {
      o.eps = std::stod(value);
    } else if (key == "weight_decay") {
      o.weight_decay = std::stod(value);
    } else {
      DP_CHECK(false, "optim_fuzz_replay: Adam has no option ", key);
    }
    adam->set_options(g, o);
  }

  void wrap() {
    std::vector<dp::Device> on;
    for (int d = 0; d < devices_; ++d) on.push_back({device_.type, d});
    model_.emplace(module_, on, design_->options);
  }

  /// Whether a resume from a file may go on in another design: PyTorch's program keeps
  /// its module, gradients included, where a job resumed elsewhere starts a fresh one, so
  /// only where the next line that reads or writes gradients is zero_grad(set_to_none),
  /// after which both have none, or where no such line follows.
  bool may_move() const {
    if (!designs_) return false;
    for (std::size_t i = at_ + 1; i < lines_.size(); ++i) {
      const auto w = words(lines_[i]);
      if (w[0] == "zero_grad") return w.at(1) == "none";
      if (w[0] == "grad" || w[0] == "backward" || w[0] == "clip_norm" || w[0] == "clip_value" ||
          w[0] == "unscale" || w[0] == "step")
        return false;
    }
    return true;
  }

  /// A fresh module (zeros: the checkpoint gives its values) with the old one's frozen
  /// parameters, wrapped in the next design that runs the program, on one device fewer or
  /// back on the first count, as a job resumed on other hardware.
  void move() {
    std::vector<Tensor> zeros;
    std::vector<bool> frozen;
    for (const Tensor& p : params()) {
      zeros.push_back(dp::zeros(p.shape(), dp::TensorOptions{dp::Dtype::Float32, device_}));
      frozen.push_back(!p.requires_grad());
    }
    std::size_t at = static_cast<std::size_t>(design_ - designs_->data());
    do at = (at + 1) % designs_->size();
    while (!applies((*designs_)[at], lines_));
    model_.reset();
    design_ = &(*designs_)[at];
    devices_ = devices_ == first_devices_ ? std::max(1, first_devices_ - 1) : first_devices_;
    module_ = std::make_shared<Params>(zeros);
    wrap();
    auto ps = params();
    for (std::size_t i = 0; i < ps.size(); ++i) ps[i].set_requires_grad(!frozen[i]);
    moves_ += (moves_.empty() ? " " : ", then ") + design_->name + " on " + std::to_string(devices_) + " at line " +
              std::to_string(at_ + 1);
  }

  /// Across processes one file, as a job resumes: every process takes part in the save
  /// (a Sharded optimizer's state is gathered), process 0 writes, every process loads.
  /// In the designs a resume may go on in another (may_move, move).
  void resume_from_file() {
    const bool across = model_ && dp::dist::world_size() > 1;
    std::string path =
        (std::filesystem::temp_directory_path() / ("optim_fuzz_" + std::to_string(::getpid()) + ".safetensors")).string();
    if (across) path = dp::dist::broadcast_object(path, 0);
    dp::TrainingState saved;
    for (std::size_t k = 0; k < scheds_.size(); ++k) saved.schedulers.emplace_back("s" + std::to_string(k), scheds_[k].get());
    saved.scaler = scaler_ ? &*scaler_ : nullptr;
    dp::save_training_checkpoint(path, *module_, *opt_, saved, /*write=*/!across || dp::dist::is_main());
    if (across) dp::dist::barrier();
    if (may_move()) move();
    build();
    dp::TrainingState loaded;
    for (std::size_t k = 0; k < scheds_.size(); ++k) loaded.schedulers.emplace_back("s" + std::to_string(k), scheds_[k].get());
    loaded.scaler = scaler_ ? &*scaler_ : nullptr;
    dp::load_training_checkpoint(path, *module_, *opt_, loaded);
    if (across) dp::dist::barrier();
    if (!across || dp::dist::is_main()) std::filesystem::remove(path);
  }

  void compare(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
               double bound) {
    if (got.size() != want.size()) {
      problems_.push_back(what + ": " + std::to_string(got.size()) + " values where PyTorch has " +
                          std::to_string(want.size()));
      return;
    }
    double worst = 0;
    std::size_t at = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double g = got[i], w = want[i];
      if (std::isnan(w) || std::isnan(g)) {
        if (std::isnan(w) != std::isnan(g)) worst = INFINITY, at = i;
        continue;
      }
      const double d = g == w ? 0.0 : std::fabs(g - w);
      if (!(d <= worst)) worst = d, at = i;
    }
    if (!(worst <= bound)) {
      std::ostringstream out;
      out.precision(9);
      out << what << ": |dp - PyTorch| = " << worst << " at " << at << " (dp " << got[at] << ", PyTorch " << want[at]
          << "), bound " << bound;
      problems_.push_back(out.str());
    }
  }

  void exact(const std::string& what, double got, double want) {
    if (got == want || (std::isnan(got) && std::isnan(want))) return;
    std::ostringstream out;
    out.precision(17);
    out << what << ": dp " << got << ", PyTorch " << want;
    problems_.push_back(out.str());
  }

  void check(const std::string& k) {
    const auto ps = params();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto n = std::to_string(i);
      compare(k + " parameter " + n, ps[i].to_vector(), doubles(k + ".p" + n), doubles(k + ".bp" + n).at(0));
    }
    if (model_) model_->check_replicas();  // throws naming a difference (DP has no replicas to compare)
    std::map<std::string, Tensor> state;
    for (auto& [name, t] : opt_->state_dict()) state[name] = t;
    const std::string head = prefix_ + "." + k + ".s";
    // Both ways: a state entry PyTorch does not have (a buffer started where PyTorch's
    // has not) is a difference too. Entries' own step counts aside: dp gives one to any
    // optimizer's entry that skipped steps, PyTorch's SGD keeps none.
    for (const auto& [name, t] : state) {
      if (!name.starts_with("state.") || name.ends_with(".step")) continue;
      const std::string rest = name.substr(6);  // "<j>.<state name>"
      if (!has(k + ".s" + rest))
        problems_.push_back(k + ": dp's state_dict has " + name + " where PyTorch's state has no such entry");
    }
    for (const auto& [name, t] : file_) {
      if (name.rfind(head, 0) != 0 || !std::isdigit(static_cast<unsigned char>(name[head.size()]))) continue;
      const std::string rest = name.substr(head.size());  // "<j>.<state name>"
      const auto dot = rest.find('.');
      const std::string j = rest.substr(0, dot), entry = rest.substr(dot + 1);
      const std::string dp_name = "state." + j + "." + entry;
      auto it = state.find(dp_name);
      // An entry's own step count is saved where it differs from the optimizer's.
      if (it == state.end() && entry == "step") it = state.find("step");
      if (it == state.end()) {
        problems_.push_back(k + ": dp's state_dict has no " + dp_name + " where PyTorch has state[" + j + "]['" +
                            entry + "']");
        continue;
      }
      const auto want = doubles(k + ".s" + rest);
      if (entry == "step") {
        exact(k + " " + dp_name, static_cast<double>(it->second.to_vector_i64().at(0)), want.at(0));
      } else {
        compare(k + " " + dp_name, it->second.to_vector(), want, doubles(k + ".bs" + rest).at(0));
      }
    }
    const auto lrs = doubles(k + ".lr"), moms = doubles(k + ".mom");
    for (std::size_t g = 0; g < lrs.size(); ++g) {
      exact(k + " group " + std::to_string(g) + " lr", opt_->group_lr(g), lrs[g]);
      exact(k + " group " + std::to_string(g) + " momentum", opt_->group_momentum(g).value_or(NAN), moms[g]);
    }
    if (has(k + ".scale")) {
      exact(k + " scale", scaler_->get_scale(), doubles(k + ".scale").at(0));
      exact(k + " growth tracker", static_cast<double>(scaler_->growth_tracker()), doubles(k + ".growth_tracker").at(0));
    }
    for (std::size_t j = 0; has(k + ".n" + std::to_string(j)); ++j) {
      const auto n = std::to_string(j);
      const double want = doubles(k + ".n" + n).at(0);
      if (j >= norms_.size()) {
        problems_.push_back(k + ": clip_norm " + n + " did not run in dp");
        continue;
      }
      if (std::isfinite(want)) {
        compare(k + " clip_norm " + n, {static_cast<float>(norms_[j])}, {want}, doubles(k + ".bn" + n).at(0));
      } else {
        exact(k + " clip_norm " + n, norms_[j], want);
      }
    }
  }

  const std::map<std::string, Tensor>& file_;
  std::string prefix_;
  std::vector<std::string> lines_;
  std::size_t at_ = 0;  // the line running
  dp::Device device_;
  const std::vector<Design>* designs_;
  const Design* design_;
  int devices_, first_devices_;
  std::string moves_;
  bool loose_ = false;
  std::shared_ptr<Params> module_;
  std::optional<dp::DataParallel> model_;
  std::vector<Tensor> params_;  // loose tensors (a module's: params())
  std::string opt_kind_;
  Options opt_options_;
  std::vector<std::pair<std::vector<std::size_t>, Options>> groups_;
  std::vector<std::pair<std::string, Options>> sched_specs_;
  std::optional<Options> scaler_spec_;
  std::unique_ptr<dp::optim::Optimizer> opt_;
  std::vector<std::unique_ptr<dp::optim::LRScheduler>> scheds_;
  std::optional<dp::amp::GradScaler> scaler_;
  std::vector<double> norms_;
  int resumes_ = 0;
  std::vector<std::string> problems_;
};

/// What one run of a program found: the problems (none when it agrees with PyTorch)
/// and the designs it moved through at its resumes.
struct Verdict {
  std::vector<std::string> problems;
  std::string moves;
};

/// Runs one program in designs[start] on `devices` devices (designs null: on `device` alone).
Verdict run_program(const std::map<std::string, Tensor>& file, const std::string& name,
                    const std::vector<std::string>& lines, dp::Device device, const std::vector<Design>* designs,
                    std::size_t start, int devices) {
  std::size_t done = 0;
  std::optional<Run> run;
  auto verdict = [&](std::vector<std::string> problems) {
    return Verdict{std::move(problems), run ? run->moves() : std::string()};
  };
  try {
    run.emplace(file, name, lines, device, designs, start, devices);
    for (; done < lines.size(); ++done) {
      run->line(done);
      if (!run->problems().empty()) return verdict(run->problems());  // the first check that differs
    }
  } catch (const std::exception& e) {
    return verdict({"dp threw where PyTorch ran, at line " + std::to_string(done + 1) + ": " + e.what()});
  }
  return verdict({});
}

/// --design and --devices.
struct Setup {
  std::vector<Design> designs;
  int devices = 2;
};

Outcome run_case(const Setup& setup, const std::map<std::string, Tensor>& file, const std::string& name,
                 const std::string& program, dp::Device device, bool verbose) {
  const auto lines = split_on(program, "; ");
  std::vector<std::pair<std::string, Verdict>> runs;  // where, what it found
  if (setup.designs.empty()) {
    runs.emplace_back(device.str(), run_program(file, name, lines, device, nullptr, 0, 1));
  } else {
    for (std::size_t k = 0; k < setup.designs.size(); ++k) {
      const Design& d = setup.designs[k];
      if (!applies(d, lines)) continue;
      const std::string where =
          d.name + " on " + std::to_string(setup.devices) + (device.is_cuda() ? " CUDA" : " CPU") + " devices";
      runs.emplace_back(where, run_program(file, name, lines, device, &setup.designs, k, setup.devices));
    }
  }
  Outcome res;
  res.skipped = runs.empty();
  for (const auto& [where, v] : runs) res.ok = res.ok && v.problems.empty();
  if (!res.ok || (verbose && !res.skipped)) {
    std::ostringstream out;
    out << (res.ok ? "ok   " : "FAIL ") << name << "\n";
    for (const auto& l : lines) out << "    " << l << "\n";
    for (const auto& [where, v] : runs) {
      out << "  " << (v.problems.empty() ? "agrees" : "differs") << " in " << where;
      if (!v.moves.empty()) out << ", resumed into" << v.moves;
      out << "\n";
      for (const auto& p : v.problems) out << "  - " << p << "\n";
    }
    res.report = out.str();
  }
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  Setup setup;
  fuzz_replay::ExtraOptions extra{
      .usage = "[--design DP|DDP|Sharded1|Sharded2|Sharded3|all[,...]] [--devices N (2)]",
      .take = [&](const std::string& arg, const char* next) -> int {
        if ((arg != "--design" && arg != "--devices") || next == nullptr) return 0;
        if (arg == "--devices") {
          setup.devices = std::atoi(next);
          if (setup.devices < 1)
            throw std::invalid_argument(std::string("--devices: expected a count >= 1, got ") + next);
          return 2;
        }
        for (const auto& want : split_on(next, ",")) {
          bool found = false;
          for (const auto& d : all_designs())
            if (want == "all" || want == d.name) setup.designs.push_back(d), found = true;
          if (!found) throw std::invalid_argument("--design: no design named '" + want + "'");
        }
        return 2;
      },
      .check = [&](dp::Device device) -> std::string {
        const int there = dp::device_count(device.type);
        if (setup.designs.empty() || setup.devices <= there) return "";
        return "--devices " + std::to_string(setup.devices) + ": " + (device.is_cuda() ? "CUDA" : "CPU") +
               " has " + std::to_string(there) + " devices here" +
               (device.is_cuda() ? " (DP_CUDA_DEVICES_PER_GPU makes more)" : " (DP_CPU_DEVICES makes more)");
      }};
  return fuzz_replay::run_corpus(
      argc, argv, "optim_fuzz_replay",
      [&](const auto& file, const auto& name, const auto& program, dp::Device device, bool verbose) {
        return run_case(setup, file, name, program, device, verbose);
      },
      extra);
}
