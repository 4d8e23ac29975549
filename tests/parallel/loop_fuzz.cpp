// tests/parallel/loop_fuzz.cpp — the differential loop fuzzer (Note [Loop fuzzer]).
//
//   loop_fuzz --seeds 0:200              # programs 0..199, one process (CI: a fixed range)
//   loop_fuzz --seed 17 --verbose        # one program, printed, with every comparison
//   mpirun -np 2 loop_fuzz --seeds 0:20  # the same programs across processes
//
// Exit status 0 when every program ran alike in every design, 1 on the first
// divergence (printed as a C++ reproduction, shrunk in one process), 2 on bad usage.
//
// Note [Loop fuzzer]
// A random training program is drawn from a small grammar — the steps of a loop, each
// a few micro-batches of 1-3 forwards through the wrapper (some under NoGradGuard, an
// output detached or used in two losses, losses summed or backpropagated one by one,
// or forward_backward), no_sync around a micro-batch, zero_grad skipped (gradients
// accumulate across steps), parameters scaled in place and .grad halved by hand (in
// place or by set_grad), clip_grad_norm_, a scheduler step, an eval()/train() evaluation, a group's momentum
// changed between steps (SGD's buffer then starts, from none or from zeros), the state_dict
// scaled and loaded back, a training checkpoint saved and resumed into fresh objects
// (under mpirun one file that every process saves and loads), five cross entropies (mean, sum, ignore_index, label smoothing,
// class weights), uneven batches, SGD (momentum, Nesterov, weight decay),
// Adam or AdamW, each with one parameter group or two (the matrices, and the rest at
// half the lr without weight decay, SGD's without momentum until a step gives them
// some, dampened), one of six models (an MLP; with Dropout; with two
// layers sharing one weight; a CNN with BatchNorm; a GPT of one TransformerBlock whose
// head is its token embedding, with and without dropout) on 1-4 devices, the forwards under
// bfloat16 autocast (float16, the GradScaler's use, from a seventh stream) or not,
// gradients on the wire in float32, bfloat16 or float16, the
// parameters computed in a 16-bit copy (mixed_precision.param_dtype) or not, the
// losses scaled by a GradScaler or not (unscale_ before clipping or alone; its state
// in the checkpoints; forward_backward given the scaler beside its loss descriptor) with,
// in one step, an infinite gradient on one device of one process only (Poison), which
// must skip the step and halve the scale in every design; the first parameter frozen
// (set_requires_grad(false)) in some steps, from a fourth stream; a Side layer on the
// logits (not the GPT's) that the forwards of some steps skip, so that no backward reaches it (Note [Parameters without
// a gradient] in dp/optim/optimizer.h: not stepped after zero_grad), from a fifth;
// .grad edits spelt set_grad and zero_grad(false) (set_to_none=False), from a sixth;
// clip_grad_value_ from an eighth, parameters written in place between backward and
// the step from a ninth, the CNN turned into one of two convolutions whose batches are
// channels-last (2 channels; Note [Channels-last tensors]) from a tenth, and from an
// eleventh where the wrapper puts rows and outputs: explicit chunk_sizes (any device,
// device 0 too, may get no rows, and a list may stop before the empty devices at its
// end; every batch then has their sum) and an output_device
// other than 0; from a twelfth, an MLP of two inputs whose second, a gate on the
// features that the loop trains by hand, every device receives whole
// (dp::replicated: its gradient is the sum of the devices'); from a thirteenth, a
// forward through the module itself (net->forward, device 0's parameters) whose loss
// joins the micro-batch's, which DP and DDP add to device 0's gradient as PyTorch's
// DataParallel does and Sharded must refuse (in one process); from a fourteenth, the
// state_dict scaled and loaded back through the module itself rather than the wrapper;
// from a fifteenth, the optimizer built on the module's own parameters() before the
// wrapper exists; and under mpirun, from a sixteenth, the .grad edits made by the last
// process alone, which every design must refuse in every process (Note [Refusals across
// processes]: the job must neither hang nor part) —
// and run on one device and in DP, DDP and Sharded stages 1-3 (1 and 2 with the
// deferred gather too, 2 and 3 with every Linear a gather unit). The features added
// after the first grammar (groups, the tied
// model, autocast, the wire dtype, param_dtype) are drawn from a second random stream
// and the GPT and the scaler from a third, each after the ones before it, so a program
// number keeps the rest of its program. After every step each design's state_dict (and
// the scaler's scale and growth tracker) is compared:
//  - with one device's, to float rounding, where the model and optimizer allow it
//    (Dropout draws per device and BatchNorm normalises per shard, so on several
//    devices those two compare with DP only; Adam amplifies rounding, and bfloat16
//    compute or a 16-bit wire rounds far above float32's, see single_comparable); the
//    tolerance: each step's gradient is a sum over at most
//    a few dozen rows that the designs group differently, so it differs by at most
//    ~R·2^-24 relative (R = rows summed, ≤ 40: ≤ 2.4e-6); the update moves it by lr ≤
//    0.1 and momentum (≤ 0.9) carries it ~10 steps: kStepTolerance = 4e-6 per step
//    taken, relative to max(1, |value|) — kContext times that for the GPT, whose sums
//    run over every position of every row (program 3369: 1.4e-5 relative after three
//    steps of summed losses);
//  - with the same design run without the resumes, bit for bit (a resumed run is the
//    uninterrupted one, Dropout's per-device streams included);
//  - with DP's on the same devices, bit for bit where the README promises it (no
//    no_sync so far, and Sharded only while every step had one backward; bfloat16
//    autocast and 16-bit wires included), else to the same tolerance — or, with a
//    16-bit wire, where the designs round different sums onto it (DDP's no_sync
//    accumulation is rounded once, DP's backwards one by one), to that dtype's unit
//    roundoff per step (2^-8 bfloat16, 2^-11 float16, relative to max(1, |value|):
//    SGD's update lr·g with lr ≤ 0.1 and |g| a few units), or, where more, to
//    kWireEffects times the wire's own effect on the program: the largest difference
//    between DP's run with the 16-bit wire and with float32's at that step (gradients
//    are not always a few units: in program 2699, BatchNorm over 1-2 rows per device,
//    DDP and DP differed by 0.005 and so did DP with and without the wire). Only the
//    first such step is compared: after it the designs start from states that differ
//    by that rounding, and the program amplifies it by whatever factor its own
//    dynamics give — program 4307 took a 0.0012 difference after step 0 to 0.016 after
//    step 1, while DDP and DP, started from one state, took step 1 bit for bit alike.
//    Over programs 0..3999 the first such step's difference was 0.8 times the wire's
//    effect at the median and 3.5 at most, and the wire's effect 0.3 % of the step's
//    largest update at the median, so a design that lost or doubled a micro-batch's
//    gradient still stands far outside it. Adam normalises each
//    gradient by its own size, so a rounding that turns a near-cancelling sum into
//    another tiny value moves its update by up to lr: Adam programs with a 16-bit wire
//    compare with DP only where bit for bit is promised. Programs with param_dtype
//    compare with DP to the float32 tolerance at the first step that is not bitwise
//    promised (it starts from equal masters, so equal 16-bit weights) and not after it
//    (a last-bit difference of a float32 master can round to another 16-bit weight);
//    they are not compared with one device's float32 run.
// A design that refuses a program (stage 3 refuses no_sync) must refuse it with a
// dp::Error that says why; anything else it throws is a finding. Across processes
// each process passes its own rows of a global batch and its reference trains one
// device on the whole global batch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "dp/autograd/node.h"
#include "dp/dp.h"

namespace {

constexpr double kStepTolerance = 4e-6;

/// Note [Loop fuzzer]: how many times DP's own wire effect two designs' 16-bit roundings
/// of different sums may differ by.
constexpr double kWireEffects = 8.0;

/// The unit roundoff of a gradient wire dtype (0 for float32: kStepTolerance rules).
double wire_roundoff(dp::Dtype d) {
  return d == dp::Dtype::BFloat16 ? 0x1p-8 : d == dp::Dtype::Float16 ? 0x1p-11 : 0.0;
}
constexpr int kClasses = 3;

// The cross entropies a micro-batch's losses use (PyTorch's keywords). Across processes
// the wrapper's forward path scales each process's gradient by its share of the global
// rows, the convention for a mean loss (as DDP's averaging), so a sum there is not one
// device's sum: the module path uses the first entry then, forward_backward any (its
// loss descriptors are exact in every topology).
struct LossKind {
  const char* spelling;  // the options in C++
  dp::nn::Reduction reduction = dp::nn::Reduction::Mean;
  std::int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  bool weighted = false;  // class weights {1, 2, 0.5}
};
const LossKind kLosses[] = {
    {"{}"},
    {"{.reduction = dp::nn::Reduction::Sum}", dp::nn::Reduction::Sum},
    {"{.ignore_index = 1}", dp::nn::Reduction::Mean, 1},
    {"{.label_smoothing = 0.1}", dp::nn::Reduction::Mean, -100, 0.1},
    {"{.weight = class_weights()}", dp::nn::Reduction::Mean, -100, 0.0, true},
};
constexpr int kLossKinds = 5;

dp::Tensor class_weights() { return dp::from_vector(std::vector<float>{1.0f, 2.0f, 0.5f}, {kClasses}, dp::cpu(0)); }

// ---- the grammar ----------------------------------------------------------------------------

enum class Model { Mlp, MlpDropout, CnnBatchNorm, TiedMlp, Gpt, GptDropout, CnnChannelsLast };
const char* model_name(Model m) {
  switch (m) {
    case Model::Mlp: return "Model::Mlp";
    case Model::MlpDropout: return "Model::MlpDropout";
    case Model::CnnBatchNorm: return "Model::CnnBatchNorm";
    case Model::TiedMlp: return "Model::TiedMlp";
    case Model::Gpt: return "Model::Gpt";
    case Model::GptDropout: return "Model::GptDropout";
    case Model::CnnChannelsLast: return "Model::CnnChannelsLast";
  }
  return "?";
}

/// The GPT models' tokens per row (their vocabulary is the kClasses labels).
constexpr std::int64_t kContext = 4;
bool is_gpt(Model m) { return m == Model::Gpt || m == Model::GptDropout; }

struct Micro {
  int forwards = 1;           // through the wrapper, with grad (1-3)
  int eval_after = -1;        // >= 0: a forward under NoGradGuard after that forward
  bool detach_last = false;   // the last output's loss is computed on output.detach()
  bool reuse_first = false;   // the first output also enters a second loss
  bool separate = false;      // one backward per loss instead of one over their sum
  bool forward_backward = false;  // model.forward_backward instead (one forward)
  bool no_sync = false;       // the micro-batch runs inside model.no_sync()
  int loss = 0;               // kLosses[loss]: the reduction, class weights, ignore_index, smoothing
  int rows = 4;               // per process
  int batch = 0;              // the first batch id; forward k uses batch + k
  bool bare = false;          // a forward through the module itself joins the losses (the thirteenth stream)
};

struct StepSpec {
  bool edit_params = false;   // parameters scaled in place through parameters() first
  bool zero_grad = true;
  std::vector<Micro> micros;
  bool edit_grads = false;    // every .grad halved by hand before clipping and the step
  bool edit_params_late = false;  // parameters scaled in place between backward and the step (the ninth stream)
  bool set_grads = false;     // ... spelt p.set_grad(p.grad() * 0.5), PyTorch's p.grad = ..., not in place
  bool edit_one_process = false;  // ... by the last process alone (the sixteenth stream, under mpirun)
  bool keep_zeros = false;    // zero_grad(false): PyTorch's set_to_none=False
  double clip = 0;            // > 0: clip_grad_norm_(params, clip) before the step
  double clip_value = 0;      // > 0: clip_grad_value_(params, clip_value) after it (the eighth stream)
  bool scheduler = false;     // StepLR(step_size 1, gamma 0.5) steps after opt.step()
  bool evaluate = false;      // eval(), a no_grad forward, train() after the step
  bool reload = false;        // state_dict() scaled by 0.99, loaded back, after the step
  bool reload_net = false;    // ... through the module (net->state_dict()) rather than the wrapper (the fourteenth stream)
  bool resume = false;        // a training checkpoint saved, loaded into fresh objects
  bool momentum_to_half = false;  // the last group's momentum (Adam: beta1) set to 0.5 first
  bool unscale = false;       // with a scaler: scaler.unscale_(opt) before the step even without clipping
  bool freeze_first = false;  // parameters()[0] frozen (set_requires_grad(false)) during the step
  bool skip_side = false;     // the program's Side layer is not run by this step's forwards
};

enum class Optim { Sgd, Adam, AdamW };

struct Program {
  std::uint64_t seed = 0;
  Model model = Model::Mlp;
  int devices = 1;
  Optim optim = Optim::Sgd;
  double lr = 0.05, momentum = 0, weight_decay = 0;
  bool nesterov = false;
  bool groups = false;     // two parameter groups: matrices; the rest at lr / 2, no weight decay
  bool autocast = false;   // every micro-batch's forwards and losses under autocast ...
  dp::Dtype cast = dp::Dtype::BFloat16;  // ... to this dtype (Float16 from the seventh stream)
  dp::Dtype wire = dp::Dtype::Float32;  // mixed_precision.reduce_dtype of every design
  dp::Dtype param = dp::Dtype::Float32;  // mixed_precision.param_dtype of every design (Float32: unset)
  bool scaler = false;     // losses scaled by a GradScaler, which steps and updates (Note [Loop fuzzer])
  bool side = false;       // a Side layer before the logits, skipped in the steps that say so
  double init_scale = 65536.0;
  std::int64_t growth_interval = 2;
  int poison_step = -1;    // >= 0: one device's Poison gradient is infinite in that step
  int output_device = 0;   // DataParallelOptions::output_device (the eleventh stream)
  std::vector<std::int64_t> chunk_sizes;  // DataParallelOptions::chunk_sizes; every batch has their sum of rows
  int eval_rows = 5;       // the rows of an evaluation's forward
  bool gate = false;       // the MLPs' second input, a replicated gate trained by hand (the twelfth stream)
  bool optimizer_first = false;  // the optimizer built on net->parameters() before the wrapper (the fifteenth)
  std::vector<StepSpec> steps;
};

const char* wire_spelling(dp::Dtype d) {
  return d == dp::Dtype::BFloat16 ? "dp::Dtype::BFloat16" : d == dp::Dtype::Float16 ? "dp::Dtype::Float16" : "";
}

// A checkpoint keeps no gradients (as PyTorch's): the step after a resume starts with
// zero_grad, as a resumed loop does; so does the first step.
void normalize(Program& p) {
  bool resumed = false;
  for (std::size_t s = 0; s < p.steps.size(); ++s) {
    if (s == 0 || p.steps[s - 1].resume) p.steps[s].zero_grad = true;
    // A resumed run's parameters have had no gradient yet, as PyTorch's (.grad is not in
    // a checkpoint), so zero_grad(false) leaves alone one that the uninterrupted run
    // steps with zeros: the two runs differ by design (program 1082).
    resumed = resumed || (s > 0 && p.steps[s - 1].resume);
    if (resumed) p.steps[s].keep_zeros = false;
  }
}

Program generate(std::uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 1);
  auto pick = [&](int lo, int hi) { return static_cast<int>(std::uniform_int_distribution<int>(lo, hi)(rng)); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  Program p;
  p.seed = seed;
  p.model = static_cast<Model>(pick(0, 2));
  p.devices = pick(1, 4);
  p.optim = static_cast<Optim>(pick(0, 2) == 0 ? 0 : pick(0, 2));
  p.lr = p.optim == Optim::Sgd ? (chance(0.5) ? 0.05 : 0.1) : 0.01;
  p.momentum = chance(0.5) ? 0.9 : 0.0;
  p.nesterov = p.momentum > 0 && chance(0.3);
  p.weight_decay = chance(0.3) ? 1e-2 : 0.0;
  int batch = 0;
  const int steps = pick(2, 4);
  for (int s = 0; s < steps; ++s) {
    StepSpec st;
    st.edit_params = chance(0.1);
    st.zero_grad = s == 0 || chance(0.85);
    const int micros = pick(1, 3);
    for (int m = 0; m < micros; ++m) {
      Micro mi;
      mi.rows = pick(1, 13);
      mi.batch = batch;
      if (chance(0.2)) {
        mi.forward_backward = true;
        if (chance(0.5)) mi.loss = pick(1, kLossKinds - 1);
      } else {
        if (chance(0.3) && dp::dist::world_size() == 1) mi.loss = pick(1, kLossKinds - 1);
        mi.forwards = pick(1, 3);
        if (chance(0.2)) mi.eval_after = pick(0, mi.forwards - 1);
        mi.detach_last = mi.forwards > 1 && chance(0.2);
        mi.reuse_first = chance(0.15);
        mi.separate = !mi.reuse_first && chance(0.4);
      }
      mi.no_sync = m + 1 < micros && chance(0.3);  // the last micro-batch synchronises
      batch += 4;
      st.micros.push_back(mi);
    }
    st.edit_grads = chance(0.1);
    if (chance(0.25)) st.clip = chance(0.5) ? 0.5 : 5.0;
    st.scheduler = chance(0.2);
    st.evaluate = chance(0.2);
    st.reload = chance(0.1);
    st.resume = dp::dist::world_size() == 1 && s + 1 < steps && chance(0.15);
    p.steps.push_back(st);
  }
  // The later features, from their own stream (Note [Loop fuzzer]).
  std::mt19937_64 more(seed * 0xD1B54A32D192ED03ull + 7);
  auto more_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(more) < q; };
  if (p.model == Model::Mlp && more_chance(0.3)) p.model = Model::TiedMlp;
  p.groups = more_chance(0.3);
  p.autocast = more_chance(0.15);
  if (more_chance(0.2)) p.wire = more_chance(0.5) ? dp::Dtype::BFloat16 : dp::Dtype::Float16;
  for (StepSpec& st : p.steps) st.momentum_to_half = more_chance(0.1);
  if (more_chance(0.2)) p.param = more_chance(0.5) ? dp::Dtype::BFloat16 : dp::Dtype::Float16;
  // Resumes across processes: one file, saved by every process (process 0 writes) and
  // loaded by every process (Note [Dropout streams in a checkpoint]).
  if (dp::dist::world_size() > 1)
    for (std::size_t s = 0; s + 1 < p.steps.size(); ++s) p.steps[s].resume = more_chance(0.15);
  // The third stream: the GPT models and the loss scaler.
  std::mt19937_64 third(seed * 0x94D049BB133111EBull + 11);
  auto third_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(third) < q; };
  if (third_chance(0.2)) p.model = third_chance(0.25) ? Model::GptDropout : Model::Gpt;
  if (third_chance(0.2)) {
    p.scaler = true;
    // A float16 wire or compute copy holds at most 65504: small scales there, so that
    // whether a step overflows never hangs on how the designs group a sum (a 16-bit
    // backward under a large scale overflows per device, alike in every design).
    const bool half = p.wire == dp::Dtype::Float16 || p.param == dp::Dtype::Float16;
    p.init_scale = half ? (third_chance(0.5) ? 4.0 : 16.0) : (third_chance(0.5) ? 1024.0 : 65536.0);
    p.growth_interval = third_chance(0.5) ? 1 : 2;
    if (third_chance(0.5))
      p.poison_step = std::uniform_int_distribution<int>(0, static_cast<int>(p.steps.size()) - 1)(third);
    for (StepSpec& st : p.steps) st.unscale = third_chance(0.3);
  }
  // The fourth stream: the first parameter frozen in some steps (Note [Frozen parameters]).
  std::mt19937_64 fourth(seed * 0xBF58476D1CE4E5B9ull + 13);
  auto fourth_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(fourth) < q; };
  if (fourth_chance(0.25))
    for (StepSpec& st : p.steps) st.freeze_first = fourth_chance(0.5);
  // The fifth stream: a layer that some steps do not reach (Note [Parameters without a
  // gradient]). Not on the GPT: its comparison with one device sits at the edge of its
  // tolerance already (program 3369), and a layer on its logits amplifies the designs'
  // rounding past it (3369 with Side never skipped: 9e-5 off at step 2, tolerance 5.6e-5).
  std::mt19937_64 fifth(seed * 0x94D049BB133111EBull + 17);
  auto fifth_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(fifth) < q; };
  if (!is_gpt(p.model) && fifth_chance(0.25)) {
    p.side = true;
    for (StepSpec& st : p.steps) st.skip_side = fifth_chance(0.5);
  }
  // The sixth stream: how gradients are set and cleared. .grad edits spelt set_grad
  // (PyTorch's p.grad = ...), and zero_grad(false) (set_to_none=False: zeros that a step
  // takes once a parameter had a gradient; Note [Parameters without a gradient]).
  std::mt19937_64 sixth(seed * 0xD6E8FEB86659FD93ull + 19);
  auto sixth_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(sixth) < q; };
  for (StepSpec& st : p.steps) {
    st.set_grads = st.edit_grads && sixth_chance(0.5);
    st.keep_zeros = st.zero_grad && sixth_chance(0.2);
  }
  // The seventh stream: float16 autocast, the GradScaler's own use. Its forwards and
  // backwards hold at most 65504, so a scaler starts small (as with a float16 wire).
  std::mt19937_64 seventh(seed * 0x9E3779B97F4A7C15ull + 23);
  auto seventh_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(seventh) < q; };
  if (p.autocast && seventh_chance(0.4)) {
    p.cast = dp::Dtype::Float16;
    if (p.scaler) p.init_scale = std::min(p.init_scale, seventh_chance(0.5) ? 4.0 : 16.0);
  }
  // The eighth stream: clip_grad_value_ (each element clamped; on the owners' ranges in
  // Sharded), after clip_grad_norm_ where both are drawn.
  std::mt19937_64 eighth(seed * 0xC2B2AE3D27D4EB4Full + 29);
  auto eighth_chance = [&](double q) { return std::uniform_real_distribution<double>(0, 1)(eighth) < q; };
  for (StepSpec& st : p.steps)
    if (eighth_chance(0.15)) st.clip_value = eighth_chance(0.5) ? 0.01 : 0.1;
  // The ninth stream: parameters written in place between backward and the step (a
  // projection or a decay by hand), which the step must read on every copy.
  std::mt19937_64 ninth(seed * 0xE7037ED1A0B428DBull + 31);
  for (StepSpec& st : p.steps) st.edit_params_late = std::uniform_real_distribution<double>(0, 1)(ninth) < 0.1;
  // The tenth stream: channels-last batches through two convolutions and a batch norm
  // (each design's scatter, replicas and gradients must carry the layout's values).
  std::mt19937_64 tenth(seed * 0x2545F4914F6CDD1Dull + 37);
  if (p.model == Model::CnnBatchNorm && std::uniform_real_distribution<double>(0, 1)(tenth) < 0.5)
    p.model = Model::CnnChannelsLast;
  // The eleventh stream: where the wrapper puts rows and outputs. The gathered outputs
  // (so the losses, and the start of backward) on another device than the one that
  // reduces and steps; and explicit chunk_sizes, one row count per device, zeros
  // allowed anywhere (device 0 included: it still reduces, steps and keeps the
  // statistics), which fixes every batch's rows at their sum.
  std::mt19937_64 eleventh(seed * 0x8CB92BA72F3D8DD7ull + 41);
  auto eleventh_pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(eleventh); };
  if (p.devices > 1 && eleventh_pick(0, 9) < 3) p.output_device = eleventh_pick(1, p.devices - 1);
  if (p.devices > 1 && eleventh_pick(0, 3) == 0) {
    const int rows = eleventh_pick(1, 13);
    const bool empty_first = eleventh_pick(0, 2) == 0;  // device 0 gets no rows
    p.chunk_sizes.assign(static_cast<std::size_t>(p.devices), 0);
    for (int r = 0; r < rows; ++r) ++p.chunk_sizes[static_cast<std::size_t>(eleventh_pick(empty_first ? 1 : 0, p.devices - 1))];
    // A list may stop before the devices it leaves empty ("at most one per device").
    if (eleventh_pick(0, 1) == 0)
      while (p.chunk_sizes.size() > 1 && p.chunk_sizes.back() == 0) p.chunk_sizes.pop_back();
    for (StepSpec& st : p.steps)
      for (Micro& mi : st.micros) mi.rows = rows;
    p.eval_rows = rows;
  }
  // The twelfth stream: a replicated input that needs a gradient, the MLPs' gate (Gated).
  // In one process (each process would sum its own devices' part: DDP leaves an input's
  // gradient where it is) and without a scaler (the gate's gradient is not the
  // optimizer's to unscale).
  std::mt19937_64 twelfth(seed * 0xA0761D6478BD642Full + 43);
  const bool mlp = p.model == Model::Mlp || p.model == Model::MlpDropout || p.model == Model::TiedMlp;
  p.gate = mlp && !p.scaler && dp::dist::world_size() == 1 && std::uniform_int_distribution<int>(0, 3)(twelfth) == 0;
  // The thirteenth stream: a forward through the module itself beside the wrapper's. In
  // one process: across processes each process's module loss is over its own rows, which
  // one device on the global batch cannot compute (dp_mpi_test checks the refusals).
  std::mt19937_64 thirteenth(seed * 0xE220A8397B1DCDAFull + 47);
  for (StepSpec& st : p.steps)
    for (Micro& mi : st.micros)
      mi.bare = !mi.forward_backward && dp::dist::world_size() == 1 &&
                std::uniform_real_distribution<double>(0, 1)(thirteenth) < 0.08;
  // The fourteenth stream: a reload through the module itself.
  std::mt19937_64 fourteenth(seed * 0x9FB21C651E98DF25ull + 53);
  for (StepSpec& st : p.steps) st.reload_net = std::uniform_int_distribution<int>(0, 1)(fourteenth) == 1;
  // The fifteenth stream: the optimizer made before the wrapper, on the module's list.
  std::mt19937_64 fifteenth(seed * 0xC4CEB9FE1A85EC53ull + 59);
  p.optimizer_first = std::uniform_int_distribution<int>(0, 3)(fifteenth) == 0;
  // The sixteenth stream: across processes, .grad edited in place by the last process only.
  std::mt19937_64 sixteenth(seed * 0xD2B74407B1CE6E93ull + 61);
  for (StepSpec& st : p.steps)
    if (st.edit_grads && dp::dist::world_size() > 1 && std::uniform_int_distribution<int>(0, 1)(sixteenth) == 1) {
      st.edit_one_process = true;
      st.set_grads = false;  // set_grad refuses on stages 2-3 where it runs: in place, checked everywhere
    }
  normalize(p);
  return p;
}

// ---- the models and data --------------------------------------------------------------------

/// The device whose copy of Poison gives back an infinite gradient during the step in
/// progress (-1: none): set by run() around a program's poison_step, read by the
/// workers' forwards (which the step's submission orders after the write; atomic all
/// the same, so that no checker needs to know that).
std::atomic<int> g_poison_device{-1};

/// Adds its parameter `value` (zeros) to the logits. On g_poison_device its gradient
/// comes back infinite (NaN where the logits' gradient is 0): the overflow of one
/// device that GradScaler must turn into a skipped step on every device of every design
/// (Note [One decision everywhere] in dp/optim/grad_scaler.h). The last child, so that
/// in stage 3 it is a gather unit of its own.
struct Poison : dp::nn::Module {
  Poison() { value = register_parameter("value", dp::zeros({kClasses})); }
  dp::Tensor forward(const dp::Tensor& x) override {
    dp::Tensor t = value;
    if (t.device().index == g_poison_device) {
      dp::Tensor y = dp::mul(t, 1.0).detach();
      dp::autograd::record("Poison", {t}, y, {}, [](const std::vector<dp::Tensor>& g) {
        return std::vector<dp::Tensor>{dp::mul(g[0], static_cast<double>(INFINITY))};
      });
      t = y;
    }
    return dp::add(x, t);
  }
  dp::nn::Parameter value;
};

/// Whether the step in progress skips Side (set by run() before the step's forwards).
std::atomic<bool> g_skip_side{false};

/// logits + Linear(logits), or the logits alone while g_skip_side: a head of a
/// multi-task model that some batches do not use. Its parameters then get no gradient
/// on any device, and a step after zero_grad() leaves them alone (no weight decay, no
/// momentum, no Adam step).
struct Side : dp::nn::Module {
  explicit Side(std::uint64_t seed) {
    dp::Generator gen(seed * 31 + 5);
    lin = register_module("lin", std::make_shared<dp::nn::Linear>(kClasses, kClasses, true, &gen));
  }
  dp::Tensor forward(const dp::Tensor& x) override { return g_skip_side ? x : dp::add(x, lin->forward(x)); }
  std::shared_ptr<dp::nn::Linear> lin;
};

/// A GPT over the kClasses tokens: token and position embeddings, one pre-norm
/// TransformerBlock (LayerNorm, causal attention through the fused kernel, GELU MLP),
/// a final LayerNorm and a head tied to the token embedding, read at the last position.
/// ids (B, kContext) int64 -> logits (B, kClasses) of the next token. Without biases
/// (nanoGPT's bias=False): a key's bias shifts all of a query's scores alike, which
/// softmax ignores, so its gradient is 0 in exact arithmetic and rounding noise in
/// floats, which Adam scales up to ±lr in a direction the designs' grouping picks.
struct Gpt : dp::nn::Module {
  static constexpr std::int64_t C = 8, H = 2;
  Gpt(std::uint64_t seed, double dropout, bool poisoned, bool with_side) {
    dp::Generator gen(seed);
    wte = register_module("wte", std::make_shared<dp::nn::Embedding>(kClasses, C, &gen));
    wpe = register_module("wpe", std::make_shared<dp::nn::Embedding>(kContext, C, &gen));
    h = register_module("h", std::make_shared<dp::nn::TransformerBlock>(
                                 dp::nn::TransformerBlockOptions(C, H).bias(false).dropout(dropout), &gen));
    ln_f = register_module("ln_f", std::make_shared<dp::nn::LayerNorm>(
                                       dp::nn::LayerNormOptions(dp::Shape{C}).bias(false)));
    head = register_module("head", std::make_shared<dp::nn::Linear>(C, kClasses, false, &gen));
    share_parameter("head.weight", parameter("wte.weight"));
    if (with_side) side = register_module("side", std::make_shared<Side>(seed));
    if (poisoned) poison = register_module("poison", std::make_shared<Poison>());
  }
  dp::Tensor forward(const dp::Tensor& ids) override {
    const std::int64_t B = ids.size(0), T = ids.size(1);
    const dp::Tensor pos = dp::arange(T, dp::TensorOptions{dp::Dtype::Int64, ids.device()});
    const dp::Tensor x = ln_f->forward(h->forward(dp::add(wte->forward(ids), wpe->forward(pos))));
    dp::Tensor logits = head->forward(x.narrow(1, T - 1, 1).reshape({B, C}));
    if (side) logits = side->forward(logits);
    return poison ? poison->forward(logits) : logits;
  }
  std::shared_ptr<dp::nn::Embedding> wte, wpe;
  std::shared_ptr<dp::nn::TransformerBlock> h;
  std::shared_ptr<dp::nn::LayerNorm> ln_f;
  std::shared_ptr<dp::nn::Linear> head;
  std::shared_ptr<Poison> poison;
  std::shared_ptr<Side> side;
};

/// A Sequential of two inputs, (x, gate): its layers run on x * gate, a (6) gate that
/// DataParallel gives every device whole (dp::replicated). Called with x alone
/// (forward_backward's path) it runs on x.
struct Gated : dp::nn::Sequential {
  using Sequential::forward;
  dp::Tensor forward(const std::vector<dp::Tensor>& in) override {
    if (in.size() == 1) return Sequential::forward(in[0]);
    if (in.size() != 2) throw dp::Error("Gated takes (x) or (x, gate)");
    return Sequential::forward(dp::mul(in[0], in[1]));
  }
};

/// The gate's first values.
dp::Tensor initial_gate(std::uint64_t seed) {
  dp::Generator gen(seed * 977 + 3);
  return dp::add(dp::mul(dp::randn({6}, gen, dp::cpu(0)), 0.1), 1.0);
}

std::shared_ptr<dp::nn::Module> make_model(Model kind, std::uint64_t seed, bool poisoned = false, bool side = false,
                                           bool gated = false) {
  if (is_gpt(kind))
    return std::make_shared<Gpt>(seed, kind == Model::GptDropout ? 0.2 : 0.0, poisoned, side);
  dp::Generator gen(seed);
  std::shared_ptr<dp::nn::Sequential> net =
      gated ? std::make_shared<Gated>() : std::make_shared<dp::nn::Sequential>();
  switch (kind) {
    case Model::Mlp:
    case Model::MlpDropout:
      net->push_back(std::make_shared<dp::nn::Linear>(6, 12, true, &gen));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      if (kind == Model::MlpDropout) net->push_back(std::make_shared<dp::nn::Dropout>(0.3, seed + 7));
      net->push_back(std::make_shared<dp::nn::Linear>(12, 8, true, &gen));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Linear>(8, kClasses, true, &gen));
      break;
    case Model::TiedMlp:
      // Two 8x8 layers with one weight (Module::share_parameter), their own biases.
      net->push_back(std::make_shared<dp::nn::Linear>(6, 8, true, &gen));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Linear>(8, 8, true, &gen));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Linear>(8, 8, true, &gen));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Linear>(8, kClasses, true, &gen));
      net->share_parameter("4.weight", net->parameter("2.weight"));
      break;
    case Model::CnnBatchNorm:
      // No bias before BatchNorm (as usual): its gradient would be rounding noise around
      // an exact 0, which Adam scales up to ±lr and no tolerance could compare.
      net->push_back(std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(1, 3, 3).bias(false), &gen));
      net->push_back(std::make_shared<dp::nn::BatchNorm2d>(3));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Flatten>());
      net->push_back(std::make_shared<dp::nn::Linear>(3 * 4 * 4, kClasses, true, &gen));
      break;
    case Model::CnnChannelsLast:
      // Its batches are channels-last (make_batch): the convolutions, the batch norm and
      // the ReLUs compute N x H x W x C, Flatten reads NCHW.
      net->push_back(std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(2, 4, 3).bias(false), &gen));
      net->push_back(std::make_shared<dp::nn::BatchNorm2d>(4));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Conv2d>(dp::nn::Conv2dOptions(4, 3, 3), &gen));
      net->push_back(std::make_shared<dp::nn::ReLU>());
      net->push_back(std::make_shared<dp::nn::Flatten>());
      net->push_back(std::make_shared<dp::nn::Linear>(3 * 2 * 2, kClasses, true, &gen));
      break;
    case Model::Gpt:
    case Model::GptDropout: break;
  }
  if (side) net->push_back(std::make_shared<Side>(seed));
  if (poisoned) net->push_back(std::make_shared<Poison>());
  return net;
}

struct Batch {
  dp::Tensor x, y;
};

// Batch `id` of the program: `rows` rows of each of `processes` processes; the part of
// process `part` (or the whole global batch when part < 0).
Batch make_batch(const Program& p, int id, int rows, int processes, int part) {
  const std::int64_t global = static_cast<std::int64_t>(rows) * processes;
  dp::Generator gen(p.seed * 1000003 + static_cast<std::uint64_t>(id));
  const bool gpt = is_gpt(p.model);
  dp::Tensor x = p.model == Model::CnnBatchNorm ? dp::randn({global, 1, 6, 6}, gen, dp::cpu(0))
                 : p.model == Model::CnnChannelsLast
                     ? dp::randn({global, 2, 6, 6}, gen, dp::cpu(0)).contiguous(dp::MemoryFormat::ChannelsLast)
                 : gpt ? dp::randint(0, kClasses, {global, kContext}, gen, dp::cpu(0))
                       : dp::randn({global, 6}, gen, dp::cpu(0));
  std::vector<std::int64_t> labels(static_cast<std::size_t>(global));
  for (std::int64_t i = 0; i < global; ++i)
    labels[static_cast<std::size_t>(i)] = static_cast<std::int64_t>((p.seed + 13 * id + 7 * i) % kClasses);
  dp::Tensor y = dp::from_vector(labels, {global}, dp::cpu(0));
  if (part < 0) return {x, y};
  return {x.narrow(0, part * rows, rows).clone(), y.narrow(0, part * rows, rows).clone()};
}

// ---- the designs ----------------------------------------------------------------------------

struct Design {
  std::string name, spelling;  // spelling: the options as C++
  dp::DataParallelOptions options;
};

std::vector<Design> designs() {
  std::vector<Design> out{
      {"DP", "{.mode = dp::Mode::DP}", {.mode = dp::Mode::DP}},
      {"DDP", "{.mode = dp::Mode::DDP}", {.mode = dp::Mode::DDP}},
      {"DDP (a bucket per parameter)", "{.mode = dp::Mode::DDP, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6}",
       {.mode = dp::Mode::DDP, .bucket_cap_mb = 1e-6, .first_bucket_mb = 1e-6}}};
  // Each replica keeps its own BatchNorm statistics; training normalises by the batch's,
  // so the parameters are still DP's, and device 0's statistics too in one process
  // (across processes each process's device 0 keeps its own, by design).
  if (dp::dist::world_size() == 1)
    out.push_back({"DDP (broadcast_buffers = false)", "{.mode = dp::Mode::DDP, .broadcast_buffers = false}",
                   {.mode = dp::Mode::DDP, .broadcast_buffers = false}});
  for (int stage : {1, 2, 3})
    out.push_back({"Sharded stage " + std::to_string(stage),
                   "{.mode = dp::Mode::Sharded, .shard_stage = " + std::to_string(stage) + "}",
                   {.mode = dp::Mode::Sharded, .shard_stage = stage}});
  // Units of their own (FSDP's auto-wrap): every Linear, the outermost where they nest —
  // the GPT's projections inside its block, the MLPs' layers, the CNN's head — so that a
  // top-level child splits into several units and runs of parameters between them.
  for (int stage : {2, 3})
    out.push_back({"Sharded stage " + std::to_string(stage) + ", a unit per Linear",
                   "{.mode = dp::Mode::Sharded, .shard_stage = " + std::to_string(stage) +
                       ", .shard_unit = dp::nn::is_module<dp::nn::Linear>}",
                   {.mode = dp::Mode::Sharded, .shard_stage = stage, .shard_unit = dp::nn::is_module<dp::nn::Linear>}});
  // The deferred gather exists in one process only (refused across processes).
  if (dp::dist::world_size() == 1)
    for (int stage : {1, 2})
      out.push_back({"Sharded stage " + std::to_string(stage) + ", NextForward",
                     "{.mode = dp::Mode::Sharded, .shard_stage = " + std::to_string(stage) +
                         ", .shard_gather = dp::ShardGather::NextForward}",
                     {.mode = dp::Mode::Sharded, .shard_stage = stage, .shard_gather = dp::ShardGather::NextForward}});
  return out;
}

// ---- running a program ----------------------------------------------------------------------

struct Trace {
  std::vector<std::vector<float>> states;  // the state_dict after each step
  std::vector<std::string> names;          // "name[i]" for each element
  std::string refused;                     // a dp::Error's message when the design refused
};

std::vector<float> flat_state(dp::nn::Module& net, std::vector<std::string>* names) {
  std::vector<float> out;
  for (auto& [name, t] : net.state_dict()) {
    if (t.dtype() != dp::Dtype::Float32) continue;
    auto v = t.to_vector();
    for (std::size_t i = 0; names && i < v.size(); ++i) names->push_back(name + "[" + std::to_string(i) + "]");
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// The targets go where the outputs were gathered (output_device).
dp::Tensor loss_of(const dp::Tensor& out, const dp::Tensor& y, int kind = 0) {
  const LossKind& k = kLosses[kind];
  return dp::nn::cross_entropy(out, y.to(out.device()),
                               dp::nn::CrossEntropyOptions{.weight = k.weighted ? class_weights().to(out.device()) : dp::Tensor(),
                                                           .ignore_index = k.ignore_index,
                                                           .reduction = k.reduction,
                                                           .label_smoothing = k.label_smoothing});
}

dp::nn::CrossEntropyLoss descriptor(int kind) {
  const LossKind& k = kLosses[kind];
  return dp::nn::CrossEntropyLoss{.weight = k.weighted ? class_weights() : dp::Tensor(),
                                  .ignore_index = k.ignore_index,
                                  .reduction = k.reduction,
                                  .label_smoothing = k.label_smoothing};
}

// Runs `p` with `design` (nullptr: one device, no wrapper, on the global batch).
// What a run trains with; a resume builds a fresh one and loads the checkpoint into it.
struct Objects {
  std::shared_ptr<dp::nn::Module> net;
  std::optional<dp::DataParallel> model;
  std::unique_ptr<dp::optim::Optimizer> optimizer;
  std::unique_ptr<dp::optim::StepLR> sched;
  std::optional<dp::amp::GradScaler> scaler;
};

/// The program's optimizer over `params`: one group, or (p.groups) the matrices with the
/// program's options and the rest at half the lr without weight decay.
std::unique_ptr<dp::optim::Optimizer> make_optimizer(const Program& p, const dp::nn::ParameterList& params) {
  const auto matrices = params.filter([](const dp::Tensor& t) { return t.dim() >= 2; });
  const auto rest = params.filter([](const dp::Tensor& t) { return t.dim() < 2; });
  const bool groups = p.groups && !rest.empty();
  switch (p.optim) {
    case Optim::Sgd: {
      const dp::optim::SGDOptions o{.lr = p.lr, .momentum = p.momentum, .weight_decay = p.weight_decay,
                                    .nesterov = p.nesterov};
      if (!groups) return std::make_unique<dp::optim::SGD>(params, o);
      // The rest without momentum, dampened once a step sets one (momentum_to_half).
      const dp::optim::SGDGroupOptions others{.lr = p.lr / 2, .momentum = 0.0, .dampening = 0.25,
                                              .weight_decay = 0.0, .nesterov = false};
      return std::make_unique<dp::optim::SGD>(std::vector<dp::optim::SGDParamGroup>{{matrices}, {rest, others}}, o);
    }
    case Optim::Adam: {
      const dp::optim::AdamOptions o{.lr = p.lr, .weight_decay = p.weight_decay};
      if (!groups) return std::make_unique<dp::optim::Adam>(params, o);
      return std::make_unique<dp::optim::Adam>(
          std::vector<dp::optim::AdamParamGroup>{{matrices}, {rest, {.lr = p.lr / 2, .weight_decay = 0.0}}}, o);
    }
    case Optim::AdamW: {
      const dp::optim::AdamWOptions o{.lr = p.lr};
      if (!groups) return std::make_unique<dp::optim::AdamW>(params, o);
      return std::make_unique<dp::optim::AdamW>(
          std::vector<dp::optim::AdamParamGroup>{{matrices}, {rest, {.lr = p.lr / 2, .weight_decay = 0.0}}}, o);
    }
  }
  return nullptr;
}

std::unique_ptr<Objects> build(const Program& p, const Design* design) {
  auto o = std::make_unique<Objects>();
  o->net = make_model(p.model, p.seed, p.poison_step >= 0, p.side, p.gate);
  std::vector<dp::Device> devices;
  for (int i = 0; i < p.devices; ++i) devices.push_back(dp::cpu(i));
  if (design && p.optimizer_first) o->optimizer = make_optimizer(p, o->net->parameters());
  if (design) {
    dp::DataParallelOptions options = design->options;
    options.output_device = p.output_device;
    options.chunk_sizes = p.chunk_sizes;
    if (p.wire != dp::Dtype::Float32) options.mixed_precision.reduce_dtype = p.wire;
    if (p.param != dp::Dtype::Float32) {  // the wire as drawn, not param_dtype's default
      options.mixed_precision.param_dtype = p.param;
      options.mixed_precision.reduce_dtype = p.wire;
    }
    o->model.emplace(o->net, devices, options);
  }
  if (!o->optimizer) o->optimizer = make_optimizer(p, o->model ? o->model->parameters() : o->net->parameters());
  o->sched = std::make_unique<dp::optim::StepLR>(*o->optimizer, dp::optim::StepLROptions{.step_size = 1, .gamma = 0.5});
  if (p.scaler) o->scaler.emplace(dp::amp::GradScalerOptions{.init_scale = p.init_scale, .growth_interval = p.growth_interval});
  return o;
}

// A training checkpoint of `o` after `step` steps, loaded into fresh objects. Across
// processes one file: every process takes part in the save (a Sharded optimizer's
// state and the Dropout streams are gathered), process 0 writes, and every process
// loads it, as a job resumes.
std::unique_ptr<Objects> resume(const Program& p, const Design* design, Objects& o, std::int64_t step) {
  const bool across = design != nullptr && dp::dist::world_size() > 1;
  std::string path = (std::filesystem::temp_directory_path() /
                      ("dp_loop_fuzz_" + std::to_string(::getpid()) + ".ckpt")).string();
  if (across) path = dp::dist::broadcast_object(path, 0);
  dp::TrainingState saved;
  saved.step = step;
  saved.schedulers = {{"lr", o.sched.get()}};
  saved.scaler = o.scaler ? &*o.scaler : nullptr;
  dp::save_training_checkpoint(path, *o.net, *o.optimizer, saved, /*write=*/!across || dp::dist::is_main());
  if (across) dp::dist::barrier();
  std::unique_ptr<Objects> fresh = build(p, design);
  dp::TrainingState loaded;
  loaded.schedulers = {{"lr", fresh->sched.get()}};
  loaded.scaler = fresh->scaler ? &*fresh->scaler : nullptr;
  dp::load_training_checkpoint(path, *fresh->net, *fresh->optimizer, loaded);
  if (across) dp::dist::barrier();
  if (!across || dp::dist::is_main()) std::filesystem::remove(path);
  if (loaded.step != step) throw std::runtime_error("the checkpoint's step did not come back");
  return fresh;
}

// The device whose Poison overflows in a poisoned step: device 1 of the last process
// where a micro-batch gives it rows (torch.chunk's ceil-sized shards: a device past the
// last shard runs no forward), else that process's device 0, which always has rows;
// one device alone (the reference) is device 0. Other processes poison none.
int poisoned_device(const Program& p, const StepSpec& st, bool wrapped) {
  if (!wrapped) return 0;
  if (dp::dist::rank() != dp::dist::world_size() - 1) return -1;
  if (!p.chunk_sizes.empty()) {  // device 1 or the first after it with rows, else device 0
    for (std::size_t d = 1; d < p.chunk_sizes.size(); ++d)
      if (p.chunk_sizes[d] > 0) return static_cast<int>(d);
    return 0;
  }
  for (const Micro& mi : st.micros)
    if (p.devices > 1 && mi.rows > (mi.rows + p.devices - 1) / p.devices) return 1;
  return 0;
}

// Runs `p` with `design` (nullptr: one device, no wrapper, on the global batch);
// `resumes`: whether the steps that ask for it save and resume from a checkpoint.
Trace run(const Program& p, const Design* design, bool resumes = true) {
  const int processes = design ? dp::dist::world_size() : 1;
  const int part = design && processes > 1 ? dp::dist::rank() : -1;
  Trace trace;
  std::unique_ptr<Objects> cur = build(p, design);
  auto batch = [&](int id, int rows) { return make_batch(p, id, rows, dp::dist::world_size(), part); };
  // The gate (p.gate): outside the objects a resume rebuilds, as a user's own tensor.
  dp::Tensor gate;
  if (p.gate) gate = initial_gate(p.seed).set_requires_grad(true);
  try {
    for (std::size_t step = 0; step < p.steps.size(); ++step) {
      const StepSpec& st = p.steps[step];
      auto& net = cur->net;
      auto& model = cur->model;
      dp::optim::Optimizer& opt = *cur->optimizer;
      dp::optim::StepLR& sched = *cur->sched;
      dp::nn::ParameterList params = model ? model->parameters() : net->parameters();
      auto forward = [&](const dp::Tensor& x) {
        if (gate.defined()) return model ? (*model)(x, dp::replicated(gate)) : (*net)(x, gate);
        return model ? (*model)(x) : net->forward(x);
      };
      auto scale_params = [&] {  // in place, through parameters() (edit_params, edit_params_late)
        dp::NoGradGuard no_grad;
        for (dp::Tensor t : (model ? model->parameters() : net->parameters())) t.mul_(0.98f);
      };
      if (st.momentum_to_half) opt.set_group_momentum(opt.num_param_groups() - 1, 0.5);
      params[0].set_requires_grad(!st.freeze_first);
      g_skip_side = p.side && st.skip_side;
      if (st.edit_params) scale_params();
      if (st.zero_grad) opt.zero_grad(/*set_to_none=*/!st.keep_zeros);
      if (st.zero_grad && gate.defined()) gate.set_grad(dp::Tensor());
      auto* scaler = cur->scaler ? &*cur->scaler : nullptr;
      auto scaled = [&](const dp::Tensor& loss) { return scaler ? scaler->scale(loss) : loss; };
      g_poison_device = static_cast<int>(step) == p.poison_step ? poisoned_device(p, st, design != nullptr) : -1;
      for (const Micro& mi : st.micros) {
        std::optional<dp::DataParallel::NoSyncGuard> guard;
        if (mi.no_sync && model) guard.emplace(*model);
        dp::amp::autocast cast(p.cast, p.autocast);
        if (mi.forward_backward) {
          const Batch b = batch(mi.batch, mi.rows);
          if (model && scaler) {
            model->forward_backward(b.x, b.y, descriptor(mi.loss), *scaler);
          } else if (model) {
            model->forward_backward(b.x, b.y, descriptor(mi.loss));
          } else {
            scaled(loss_of(net->forward(b.x), b.y, mi.loss)).backward();
          }
          continue;
        }
        std::vector<dp::Tensor> losses;
        dp::Tensor first_out;
        for (int k = 0; k < mi.forwards; ++k) {
          const Batch b = batch(mi.batch + k, mi.rows);
          dp::Tensor out = forward(b.x);
          if (k == 0) first_out = out;
          if (k == mi.eval_after) {
            dp::NoGradGuard no_grad;
            (void)forward(batch(mi.batch + 3, mi.rows).x);
          }
          if (k + 1 == mi.forwards && mi.detach_last) out = out.detach();
          losses.push_back(loss_of(out, b.y, mi.loss));
        }
        if (mi.reuse_first) losses.push_back(loss_of(first_out, batch(mi.batch + 1, mi.rows).y, mi.loss));
        if (mi.bare) {  // the module itself, on device 0's parameters
          const Batch b = batch(mi.batch + 5, mi.rows);
          losses.push_back(loss_of(net->forward(b.x), b.y, mi.loss).to(losses.front().device()));
        }
        if (mi.separate) {
          for (auto& l : losses)
            if (l.requires_grad()) scaled(l).backward();
        } else {
          dp::Tensor total = losses[0];
          for (std::size_t i = 1; i < losses.size(); ++i) total = total + losses[i];
          if (total.requires_grad()) scaled(total).backward();
        }
      }
      g_poison_device = -1;
      if (st.edit_params_late) scale_params();
      if (st.edit_grads) {
        dp::NoGradGuard no_grad;
        // The edit itself by this process? Every process when not edit_one_process; the
        // reference (no wrapper) always.
        const bool here = !design || !st.edit_one_process || dp::dist::rank() == dp::dist::world_size() - 1;
        for (dp::Tensor t : (model ? model->parameters() : net->parameters())) {
          dp::Tensor g = t.grad();
          // Stages 2 and 3 keep no .grad between backward and step (documented): a
          // program that edits gradients by hand cannot be written for them, and set_grad
          // must refuse rather than be ignored by the step.
          if (st.set_grads) {
            t.set_grad(g.defined() ? dp::mul(g, 0.5) : dp::zeros(t.shape(), t.device()));
            continue;
          }
          if (!g.defined()) throw dp::Error("no .grad to edit by hand (Sharded stage 2 and 3 keep none)");
          if (here) g.mul_(0.5f);
        }
      }
      if (scaler && (st.clip > 0 || st.clip_value > 0 || st.unscale)) scaler->unscale_(opt);
      if (st.clip > 0) dp::nn::utils::clip_grad_norm_(params, st.clip);
      if (st.clip_value > 0) dp::nn::utils::clip_grad_value_(params, st.clip_value);
      if (scaler) {
        scaler->step(opt);
        scaler->update();
      } else {
        opt.step();
      }
      if (st.scheduler) sched.step();
      if (gate.defined() && gate.grad().defined()) {  // SGD by hand
        dp::NoGradGuard no_grad;
        gate.sub_(gate.grad(), 0.05);
      }
      if (st.evaluate) {
        net->train(false);
        {
          dp::NoGradGuard no_grad;
          (void)forward(batch(900, p.eval_rows).x);
        }
        net->train(true);
      }
      if (st.reload) {
        const bool wrapper = model && !st.reload_net;
        dp::nn::StateDict sd = wrapper ? model->state_dict() : net->state_dict();
        dp::nn::StateDict scaled;
        for (auto& [name, t] : sd) scaled.emplace_back(name, t.dtype() == dp::Dtype::Float32 ? dp::mul(t, 0.99) : t.clone());
        if (wrapper) {
          model->load_state_dict(scaled);
        } else {
          net->load_state_dict(scaled);
        }
      }
      const bool first = trace.names.empty();
      trace.states.push_back(flat_state(*net, first ? &trace.names : nullptr));
      if (gate.defined()) {
        const std::vector<float> g = gate.to_vector();
        trace.states.back().insert(trace.states.back().end(), g.begin(), g.end());
        for (std::size_t i = 0; first && i < g.size(); ++i) trace.names.push_back("gate[" + std::to_string(i) + "]");
      }
      if (scaler) {  // the decisions: every design must skip and grow alike
        trace.states.back().push_back(static_cast<float>(scaler->get_scale()));
        trace.states.back().push_back(static_cast<float>(scaler->growth_tracker()));
        if (first) trace.names.insert(trace.names.end(), {"GradScaler scale", "GradScaler growth_tracker"});
      }
      if (st.resume && resumes) cur = resume(p, design, *cur, static_cast<std::int64_t>(step) + 1);
    }
  } catch (const dp::Error& e) {
    g_poison_device = -1;
    if (!design) throw;  // one device refuses nothing
    trace.refused = e.what();
  }
  return trace;
}

// ---- judging --------------------------------------------------------------------------------

// Whether `design` must equal DP bit for bit after step s (the README's promise).
bool bitwise_promised(const Program& p, const Design& d, std::size_t s) {
  for (std::size_t i = 0; i <= s; ++i) {
    int cycles = 0;
    for (const Micro& mi : p.steps[i].micros) {
      if (mi.no_sync && p.devices * dp::dist::world_size() > 1) return false;
      cycles += mi.forward_backward ? 1 : mi.forwards - (mi.detach_last ? 1 : 0);
    }
    if (!p.steps[i].zero_grad && i > 0) ++cycles;  // the last step's sum is accumulated onto
    // Across processes Sharded adds an earlier pass's sum at the owner (Note
    // [Accumulating after a combined backward]); in one process where DP does.
    if (d.options.mode == dp::Mode::Sharded && cycles > 1 && dp::dist::world_size() > 1) return false;
  }
  return true;
}

// Whether one device's run is comparable: Dropout draws per device and BatchNorm
// normalises per shard.
// Nor with Adam or AdamW: they divide by the gradient's own magnitude, so where a
// gradient is a near-cancelling sum, its rounding (which the designs group
// differently) is amplified without bound — 6e-6 after one step of lr 0.01 in program
// 10550 — while a wrong gradient scale does not show at all. Those programs compare
// the designs with DP; SGD programs carry the comparison with one device.
bool single_comparable(const Program& p) {
  if (p.optim != Optim::Sgd || p.autocast || p.wire != dp::Dtype::Float32 || p.param != dp::Dtype::Float32)
    return false;
  return p.model == Model::Mlp || p.model == Model::TiedMlp || p.model == Model::Gpt ||
         p.devices * dp::dist::world_size() == 1;
}

bool edits_one_process(const Program& p) {
  return std::any_of(p.steps.begin(), p.steps.end(), [](const StepSpec& st) { return st.edit_one_process; });
}

bool uses_bare(const Program& p) {
  for (const StepSpec& st : p.steps)
    for (const Micro& mi : st.micros)
      if (mi.bare) return true;
  return false;
}

bool uses_no_sync(const Program& p) {
  for (const StepSpec& st : p.steps)
    for (const Micro& mi : st.micros)
      if (mi.no_sync) return true;
  return false;
}

// An expected refusal: its message must say what was refused and why.
bool expected_refusal(const Program& p, const Design& d, const std::string& what) {
  const bool stage3 = d.options.mode == dp::Mode::Sharded && d.options.shard_stage == 3 && p.devices > 1;
  if (stage3 && uses_no_sync(p) && what.find("no_sync() with shard_stage 3") != std::string::npos) return true;
  // Sharded keeps no whole gradient on device 0: stages 2 and 3 no .grad at all, stage 1
  // its own range's; an edit by hand is refused (Note [Gradient edits]).
  const bool sharded = d.options.mode == dp::Mode::Sharded && p.devices * dp::dist::world_size() > 1;
  // A forward through the module itself: Sharded keeps no gradient it could add to (stage
  // 3 may not even hold the module's parameters then).
  // .grad edited by one process only: refused in every process, by the process that
  // saw it and by the others naming it (Note [Refusals across processes]).
  if (edits_one_process(p) && (what.find("differ between the processes") != std::string::npos ||
                               what.find("refused by process") != std::string::npos))
    return true;
  if (uses_bare(p) && sharded &&
      (what.find("the module itself") != std::string::npos || what.find("memory was released") != std::string::npos))
    return true;
  return sharded && (what.find("no .grad to edit by hand") != std::string::npos ||
                     what.find("edited through parameters() by hand") != std::string::npos ||
                     what.find("gradient is sharded over the devices") != std::string::npos);
}

struct Finding {
  std::string design, spelling, what;
  std::size_t step = 0;
};

/// The largest difference between two traces' states after step s (the wire's own
/// effect on DP: its run with the 16-bit wire against the same run with float32's).
double max_gap(const Trace& a, const Trace& b, std::size_t s) {
  double gap = 0.0;
  if (s >= a.states.size() || s >= b.states.size()) return gap;
  for (std::size_t i = 0; i < a.states[s].size(); ++i) {
    const double d = std::fabs(double(a.states[s][i]) - double(b.states[s][i]));
    if (!std::isnan(d)) gap = std::max(gap, d);
  }
  return gap;
}

/// DP's run of a program with a float32 wire, made on first use (Note [Loop fuzzer]).
using WireEffect = std::function<const Trace&()>;

/// `wire_effect`: where p has a 16-bit wire and the comparison is against DP.
std::optional<Finding> compare(const Program& p, const Trace& want, const Trace& got, const Design& d,
                               const char* against, bool bitwise, const WireEffect& wire_effect = {}) {
  bool rounded_apart = false;  // a 16-bit wire's first step that is not bitwise promised was compared
  for (std::size_t s = 0; s < got.states.size(); ++s) {
    const auto& a = got.states[s];
    const auto& b = want.states[s];
    const bool exact = bitwise && bitwise_promised(p, d, s);
    const bool wide_wire = bitwise && p.wire != dp::Dtype::Float32;  // against DP, see Note [Loop fuzzer]
    if (wide_wire && !exact && (p.optim != Optim::Sgd || rounded_apart)) continue;
    // 16-bit compute copies (param_dtype, or autocast's cast of every weight in every
    // forward): a float32 master that differs in its last bit can round to another
    // 16-bit weight (2^-8 of it apart in bfloat16, 2^-11 in float16: float16's finer grid
    // has 8 times the boundaries to fall across), so once the designs' sums have differed
    // the runs part by more than any float32 tolerance (program 496 under mpirun -np 2,
    // float16 autocast: 1e-3 relative one step after its first no_sync). The first such
    // step still starts from bitwise equal masters, hence equal 16-bit weights, equal
    // 16-bit gradients per backward and float32 sums grouped differently: it is
    // compared to the float32 tolerance (a lost or doubled micro-batch shows there).
    const bool half_params = bitwise && (p.param != dp::Dtype::Float32 || p.autocast);
    if (half_params && !exact && rounded_apart) continue;
    rounded_apart = rounded_apart || ((wide_wire || half_params) && !exact);
    const double step_tol = kStepTolerance * (is_gpt(p.model) ? kContext : 1);
    const double tol = (wide_wire ? std::max(step_tol, wire_roundoff(p.wire)) : step_tol) *
                       static_cast<double>(s + 1);
    // Two roundings of the same sums differ by a few times what rounding them changes.
    const double wire_tol = wide_wire && !exact && wire_effect ? kWireEffects * max_gap(want, wire_effect(), s) : 0.0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double diff = std::fabs(double(a[i]) - double(b[i]));
      const bool both_nan = std::isnan(a[i]) && std::isnan(b[i]);  // a mean over no rows, on both sides
      const double allowed = std::max(tol * std::max(1.0, std::fabs(double(b[i]))), wire_tol);
      const bool bad = !both_nan && (exact ? a[i] != b[i] : !(diff <= allowed));
      if (!bad) continue;
      std::ostringstream os;
      os.precision(9);
      os << d.name << " on " << p.devices << " device(s) differs from " << against << " after step " << s << " in "
         << got.names[i] << ": " << a[i] << " vs " << b[i] << " (" << (exact ? "bitwise promised" : "tolerance ")
         << (exact ? "" : std::to_string(allowed)) << ")";
      return Finding{d.name, d.spelling, os.str(), s};
    }
  }
  return std::nullopt;
}

bool resumes(const Program& p) {
  return std::any_of(p.steps.begin(), p.steps.end(), [](const StepSpec& st) { return st.resume; });
}

std::optional<Finding> compare_exact(const Trace& got, const Trace& want, const Design& d, const Program& p,
                                     const char* against) {
  for (std::size_t s = 0; s < got.states.size() && s < want.states.size(); ++s)
    for (std::size_t i = 0; i < got.states[s].size(); ++i) {
      const float a = got.states[s][i], b = want.states[s][i];
      if (a == b || (std::isnan(a) && std::isnan(b))) continue;
      std::ostringstream os;
      os.precision(9);
      os << d.name << " on " << p.devices << " device(s) differs from " << against << " after step " << s << " in "
         << got.names[i] << ": " << a << " vs " << b << " (bitwise promised)";
      return Finding{d.name, d.spelling, os.str(), s};
    }
  return std::nullopt;
}

// Runs every design of `p`; the first finding, if any. `only`: that design alone.
std::optional<Finding> check(const Program& p, const std::string& only = "", bool verbose = false) {
  std::optional<Trace> single;
  if (single_comparable(p)) single = run(p, nullptr);
  std::optional<Trace> dp_trace, wide_dp;
  WireEffect wire_effect;
  if (p.wire != dp::Dtype::Float32)
    wire_effect = [&]() -> const Trace& {
      if (!wide_dp) {
        Program wide = p;
        wide.wire = dp::Dtype::Float32;
        const Design dp_design = designs().front();  // DP
        wide_dp = run(wide, &dp_design);
      }
      return *wide_dp;
    };
  for (const Design& d : designs()) {
    if (!only.empty() && d.name != only && d.name != "DP") continue;
    Trace t;
    try {
      t = run(p, &d);
    } catch (const std::exception& e) {
      return Finding{d.name, d.spelling, d.name + " threw something other than a dp::Error: " + e.what()};
    }
    if (!t.refused.empty()) {
      if (verbose) std::printf("  %s refused: %s\n", d.name.c_str(), t.refused.c_str());
      if (expected_refusal(p, d, t.refused)) continue;
      return Finding{d.name, d.spelling, d.name + " refused the program: " + t.refused};
    }
    if (expected_refusal(p, d, "no_sync() with shard_stage 3") && uses_no_sync(p))
      return Finding{d.name, d.spelling, d.name + " ran no_sync with stage 3 instead of refusing it clearly"};
    if (single)
      if (auto f = compare(p, *single, t, d, "one device", false)) return f;
    if (resumes(p)) {  // the README: a resumed run is bitwise the uninterrupted one
      const Trace straight = run(p, &d, /*resumes=*/false);
      if (auto f = compare_exact(t, straight, d, p, "the same run without the resumes")) return f;
    }
    if (d.name == "DP") {
      dp_trace = t;
    } else if (dp_trace) {
      if (auto f = compare(p, *dp_trace, t, d, "DP", true, wire_effect)) return f;
    }
    if (verbose) std::printf("  %s: alike\n", d.name.c_str());
  }
  return std::nullopt;
}

// ---- the reproduction -----------------------------------------------------------------------

std::string cpp(const Program& p, const std::string& spelling) {
  std::ostringstream os;
  os << "// Helpers (make_model, batch) as in tests/parallel/loop_fuzz.cpp; program seed " << p.seed << ".\n";
  if (p.model == Model::CnnChannelsLast) os << "// batch(...).x is channels-last (dp::MemoryFormat::ChannelsLast).\n";
  os << "auto net = make_model(" << model_name(p.model) << ", " << p.seed
     << (p.poison_step >= 0 || p.side ? (p.poison_step >= 0 ? ", /*poisoned=*/true" : ", /*poisoned=*/false") : "")
     << (p.side ? ", /*side=*/true" : "") << ");\n";
  os << "dp::DataParallelOptions options = " << spelling << ";\n";
  if (p.output_device != 0) os << "options.output_device = " << p.output_device << ";\n";
  if (!p.chunk_sizes.empty()) {
    os << "options.chunk_sizes = {";
    for (std::size_t i = 0; i < p.chunk_sizes.size(); ++i) os << (i ? ", " : "") << p.chunk_sizes[i];
    os << "};\n";
  }
  if (p.wire != dp::Dtype::Float32) os << "options.mixed_precision.reduce_dtype = " << wire_spelling(p.wire) << ";\n";
  if (p.param != dp::Dtype::Float32) {
    os << "options.mixed_precision.param_dtype = " << wire_spelling(p.param) << ";\n";
    if (p.wire == dp::Dtype::Float32) os << "options.mixed_precision.reduce_dtype = dp::Dtype::Float32;\n";
  }
  if (p.gate) os << "dp::Tensor gate = initial_gate(" << p.seed << ").set_requires_grad(true);  // net is Gated\n";
  os << "dp::DataParallel model(net, {";
  for (int i = 0; i < p.devices; ++i) os << (i ? ", " : "") << "dp::cpu(" << i << ")";
  os << "}, options);\n";
  std::string params = p.optimizer_first ? "net->parameters()" : "model.parameters()";
  if (p.optimizer_first) os << "// the optimizer below is built before `model`, on net->parameters()\n";
  if (p.groups) {
    os << "auto matrices = " << params << ".filter([](const dp::Tensor& t) { return t.dim() >= 2; });\n"
       << "auto rest = " << params << ".filter([](const dp::Tensor& t) { return t.dim() < 2; });\n";
    params = "{{matrices}, {rest, {.lr = " + std::to_string(p.lr / 2) +
             (p.optim == Optim::Sgd ? ", .momentum = 0.0, .dampening = 0.25" : "") + ", .weight_decay = 0.0" +
             (p.optim == Optim::Sgd ? ", .nesterov = false" : "") + "}}}";
  }
  switch (p.optim) {
    case Optim::Sgd:
      os << "dp::optim::SGD opt(" << params << ", {.lr = " << p.lr << ", .momentum = " << p.momentum
         << ", .weight_decay = " << p.weight_decay << ", .nesterov = " << (p.nesterov ? "true" : "false") << "});\n";
      break;
    case Optim::Adam:
      os << "dp::optim::Adam opt(" << params << ", {.lr = " << p.lr << ", .weight_decay = " << p.weight_decay
         << "});\n";
      break;
    case Optim::AdamW: os << "dp::optim::AdamW opt(" << params << ", {.lr = " << p.lr << "});\n"; break;
  }
  os << "dp::optim::StepLR sched(opt, {.step_size = 1, .gamma = 0.5});\n";
  if (p.scaler)
    os << "dp::amp::GradScaler scaler({.init_scale = " << p.init_scale << ", .growth_interval = " << p.growth_interval
       << "});\n";
  // Targets follow the outputs to output_device.
  const std::string to_out = p.output_device != 0 ? ".to(model.output_device())" : "";
  const std::string gate_in = p.gate ? ", dp::replicated(gate)" : "";
  // The module path's losses, scaled when the program has a scaler.
  auto scaled = [&](const std::string& loss) { return p.scaler ? "scaler.scale(" + loss + ")" : loss; };
  const bool freezes = std::any_of(p.steps.begin(), p.steps.end(), [](const StepSpec& t) { return t.freeze_first; });
  for (std::size_t s = 0; s < p.steps.size(); ++s) {
    const StepSpec& st = p.steps[s];
    os << "// step " << s << "\n";
    if (st.momentum_to_half) os << "opt.set_group_momentum(opt.num_param_groups() - 1, 0.5);\n";
    if (freezes) os << "model.parameters()[0].set_requires_grad(" << (st.freeze_first ? "false" : "true") << ");\n";
    if (p.side) os << "g_skip_side = " << (st.skip_side ? "true" : "false") << ";  // Side runs in this step's forwards?\n";
    if (st.edit_params)
      os << "{ dp::NoGradGuard g; for (dp::Tensor t : model.parameters()) t.mul_(0.98f); }\n";
    if (st.zero_grad) os << (st.keep_zeros ? "opt.zero_grad(false);\n" : "opt.zero_grad();\n");
    if (st.zero_grad && p.gate) os << "gate.set_grad(dp::Tensor());\n";
    if (static_cast<int>(s) == p.poison_step)
      os << "g_poison_device = " << poisoned_device(p, st, true) << ";  // Poison's gradient infinite there (this "
            "process) until the step's last backward\n";
    for (const Micro& mi : st.micros) {
      os << "{\n";
      if (mi.no_sync) os << "  auto guard = model.no_sync();\n";
      if (p.autocast) os << "  dp::amp::autocast cast(" << wire_spelling(p.cast) << ");\n";
      if (mi.forward_backward) {
        os << "  auto b = batch(" << mi.batch << ", " << mi.rows << ");\n";
        os << "  model.forward_backward(b.x, b.y, dp::nn::CrossEntropyLoss" << kLosses[mi.loss].spelling
           << (p.scaler ? ", scaler" : "") << ");\n}\n";
        continue;
      }
      std::vector<std::string> losses;
      const std::string opts = mi.loss == 0 ? "" : std::string(", dp::nn::CrossEntropyOptions") + kLosses[mi.loss].spelling;
      for (int k = 0; k < mi.forwards; ++k) {
        os << "  auto b" << k << " = batch(" << mi.batch + k << ", " << mi.rows << ");\n";
        os << "  auto o" << k << " = model(b" << k << ".x" << gate_in << ")" << (k + 1 == mi.forwards && mi.detach_last ? ".detach()" : "")
           << ";\n";
        if (k == mi.eval_after)
          os << "  { dp::NoGradGuard g; (void)model(batch(" << mi.batch + 3 << ", " << mi.rows << ").x" << gate_in
             << "); }\n";
        losses.push_back("dp::nn::cross_entropy(o" + std::to_string(k) + ", b" + std::to_string(k) + ".y" + to_out +
                         opts + ")");
      }
      if (mi.reuse_first)
        losses.push_back("dp::nn::cross_entropy(o0, batch(" + std::to_string(mi.batch + 1) + ", " +
                         std::to_string(mi.rows) + ").y" + to_out + opts + ")");
      if (mi.bare) {
        os << "  auto bare = batch(" << mi.batch + 5 << ", " << mi.rows << ");  // through the module itself\n";
        losses.push_back("dp::nn::cross_entropy(net->forward(bare.x), bare.y" + opts + ")" +
                         (p.output_device != 0 ? ".to(model.output_device())" : ""));
      }
      const bool last_detached = mi.detach_last;
      if (mi.separate) {
        for (std::size_t i = 0; i < losses.size(); ++i)
          if (!(last_detached && static_cast<int>(i) == mi.forwards - 1))
            os << "  " << scaled(losses[i]) << ".backward();\n";
      } else {
        std::string sum;
        for (std::size_t i = 0; i < losses.size(); ++i) sum += (i ? " + " : "") + losses[i];
        os << "  " << (p.scaler ? scaled(sum) : "(" + sum + ")") << ".backward();\n";
      }
      os << "}\n";
    }
    if (st.edit_params_late)
      os << "{ dp::NoGradGuard g; for (dp::Tensor t : model.parameters()) t.mul_(0.98f); }  // after backward\n";
    if (st.edit_one_process) os << "// the edit below: by the last process only\n";
    if (st.edit_grads)
      os << (st.set_grads ? "{ dp::NoGradGuard g; for (dp::Tensor t : model.parameters()) t.set_grad(t.grad() * 0.5); }\n"
                          : "{ dp::NoGradGuard g; for (dp::Tensor t : model.parameters()) t.grad().mul_(0.5f); }\n");
    if (static_cast<int>(s) == p.poison_step) os << "g_poison_device = -1;\n";
    if (p.scaler && (st.clip > 0 || st.clip_value > 0 || st.unscale)) os << "scaler.unscale_(opt);\n";
    if (st.clip > 0) os << "dp::nn::utils::clip_grad_norm_(model.parameters(), " << st.clip << ");\n";
    if (st.clip_value > 0)
      os << "dp::nn::utils::clip_grad_value_(model.parameters(), " << st.clip_value << ");\n";
    os << (p.scaler ? "scaler.step(opt);\nscaler.update();\n" : "opt.step();\n");
    if (st.scheduler) os << "sched.step();\n";
    if (p.gate) os << "if (gate.grad().defined()) { dp::NoGradGuard g; gate.sub_(gate.grad(), 0.05); }\n";
    if (st.evaluate)
      os << "model.eval(); { dp::NoGradGuard g; (void)model(batch(900, " << p.eval_rows << ").x" << gate_in
         << "); } model.train();\n";
    if (st.resume)
      os << "// save_training_checkpoint (with the scheduler), then a fresh net, DataParallel, optimizer and "
            "scheduler built as above and load_training_checkpoint into them\n";
    if (st.reload) {
      const std::string who = st.reload_net ? "net->" : "model.";
      os << "{ dp::nn::StateDict sd; for (auto& [n, t] : " << who << "state_dict()) sd.emplace_back(n, t.dtype() == "
         << "dp::Dtype::Float32 ? dp::mul(t, 0.99) : t.clone()); " << who << "load_state_dict(sd); }\n";
    }
  }
  return os.str();
}

// Greedy shrinking: drop steps, micro-batches, forwards and features while the same
// design still diverges.
Program shrink(Program p, const std::string& design) {
  auto still = [&](const Program& q) { return check(q, design).has_value(); };
  bool progress = true;
  while (progress) {
    progress = false;
    std::vector<Program> candidates;
    for (std::size_t s = 0; s < p.steps.size() && p.steps.size() > 1; ++s) {
      Program q = p;
      q.steps.erase(q.steps.begin() + static_cast<std::ptrdiff_t>(s));
      if (q.poison_step >= static_cast<int>(s)) q.poison_step = q.poison_step == static_cast<int>(s) ? -1 : q.poison_step - 1;
      q.steps[0].zero_grad = true;
      candidates.push_back(q);
    }
    for (std::size_t s = 0; s < p.steps.size(); ++s) {
      const StepSpec& st = p.steps[s];
      for (std::size_t m = 0; m < st.micros.size() && st.micros.size() > 1; ++m) {
        Program q = p;
        q.steps[s].micros.erase(q.steps[s].micros.begin() + static_cast<std::ptrdiff_t>(m));
        q.steps[s].micros.back().no_sync = false;
        candidates.push_back(q);
      }
      auto with = [&](auto edit) {
        Program q = p;
        if (edit(q.steps[s])) candidates.push_back(q);
      };
      with([](StepSpec& t) { return std::exchange(t.clip, 0.0) > 0; });
      with([](StepSpec& t) { return std::exchange(t.clip_value, 0.0) > 0; });
      with([](StepSpec& t) { return std::exchange(t.scheduler, false); });
      with([](StepSpec& t) { return std::exchange(t.evaluate, false); });
      with([](StepSpec& t) { return std::exchange(t.edit_params, false); });
      with([](StepSpec& t) { return std::exchange(t.edit_params_late, false); });
      with([](StepSpec& t) { return std::exchange(t.edit_grads, false); });
      with([](StepSpec& t) { return std::exchange(t.set_grads, false); });
      with([](StepSpec& t) { return std::exchange(t.keep_zeros, false); });
      with([](StepSpec& t) { return std::exchange(t.reload, false); });
      with([](StepSpec& t) { return std::exchange(t.resume, false); });
      with([](StepSpec& t) { return std::exchange(t.momentum_to_half, false); });
      with([](StepSpec& t) { return std::exchange(t.unscale, false); });
      with([](StepSpec& t) { return std::exchange(t.freeze_first, false); });
      with([](StepSpec& t) { return std::exchange(t.skip_side, false); });
      with([&](StepSpec& t) { return s > 0 && !std::exchange(t.zero_grad, true); });
      for (std::size_t m = 0; m < st.micros.size(); ++m) {
        auto micro = [&](auto edit) {
          Program q = p;
          if (edit(q.steps[s].micros[m])) candidates.push_back(q);
        };
        micro([](Micro& mi) { return mi.forwards > 1 && (mi.detach_last = false, mi.eval_after = -1, --mi.forwards, true); });
        micro([](Micro& mi) { return std::exchange(mi.no_sync, false); });
        micro([](Micro& mi) { return std::exchange(mi.reuse_first, false); });
        micro([](Micro& mi) { return std::exchange(mi.detach_last, false); });
        micro([](Micro& mi) { return std::exchange(mi.eval_after, -1) >= 0; });
        micro([](Micro& mi) { return std::exchange(mi.separate, false); });
        micro([](Micro& mi) { return std::exchange(mi.bare, false); });
        micro([](Micro& mi) { return std::exchange(mi.loss, 0) != 0; });
        if (p.chunk_sizes.empty())  // else every batch has their sum
          micro([](Micro& mi) { return mi.rows > 1 && (mi.rows = std::max(1, mi.rows / 2), true); });
      }
    }
    if (p.devices > 2 && p.chunk_sizes.empty()) {
      Program q = p;
      --q.devices;
      q.output_device = std::min(q.output_device, q.devices - 1);
      candidates.push_back(q);
    }
    auto whole = [&](auto edit) {
      Program q = p;
      if (edit(q)) candidates.push_back(q);
    };
    whole([](Program& q) { return std::exchange(q.groups, false); });
    whole([](Program& q) { return std::exchange(q.autocast, false); });
    whole([](Program& q) { return std::exchange(q.cast, dp::Dtype::BFloat16) != dp::Dtype::BFloat16; });
    whole([](Program& q) { return std::exchange(q.wire, dp::Dtype::Float32) != dp::Dtype::Float32; });
    whole([](Program& q) { return q.model == Model::TiedMlp && (q.model = Model::Mlp, true); });
    whole([](Program& q) { return q.model == Model::GptDropout && (q.model = Model::Gpt, true); });
    whole([](Program& q) { return std::exchange(q.poison_step, -1) >= 0; });
    whole([](Program& q) { return std::exchange(q.side, false); });
    whole([](Program& q) { return std::exchange(q.output_device, 0) != 0; });
    whole([](Program& q) { return !std::exchange(q.chunk_sizes, {}).empty(); });
    whole([](Program& q) { return std::exchange(q.gate, false); });
    whole([](Program& q) { return std::exchange(q.optimizer_first, false); });
    whole([](Program& q) { return q.poison_step < 0 && std::exchange(q.scaler, false); });
    for (Program& q : candidates) normalize(q);
    for (const Program& q : candidates)
      if (still(q)) {
        p = q;
        progress = true;
        break;
      }
  }
  return p;
}

int usage(const char* argv0, const std::string& why) {
  std::fprintf(stderr, "%s: %s\nusage: %s [--seeds A:B (A < B) | --seed N] [--verbose] [--no-shrink]\n", argv0,
               why.c_str(), argv0);
  return 2;
}

// A program number: digits only (std::stoull would take "-1", "+3" or "7x").
std::optional<std::uint64_t> parse_seed(const std::string& s) {
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoull(s);
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t first = 0, last = 50;
  bool verbose = false, shrink_it = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seeds" && i + 1 < argc) {
      const std::string r = argv[++i];
      const auto colon = r.find(':');
      const auto a_seed = colon == std::string::npos ? std::nullopt : parse_seed(r.substr(0, colon));
      const auto b_seed = colon == std::string::npos ? std::nullopt : parse_seed(r.substr(colon + 1));
      if (!a_seed || !b_seed || *a_seed >= *b_seed)
        return usage(argv[0], "--seeds expects A:B, two program numbers with A < B, got '" + r + "'");
      first = *a_seed;
      last = *b_seed;
    } else if (a == "--seed" && i + 1 < argc) {
      const auto n = parse_seed(argv[++i]);
      if (!n) return usage(argv[0], std::string("--seed expects a program number, got '") + argv[i] + "'");
      first = *n;
      last = first + 1;
    } else if (a == "--verbose") {
      verbose = true;
    } else if (a == "--no-shrink") {
      shrink_it = false;
    } else {
      return usage(argv[0], "unknown or incomplete argument '" + a + "'");
    }
  }
  dp::dist::init();
  const bool multi = dp::dist::world_size() > 1;
  const bool main_process = dp::dist::is_main();
  for (std::uint64_t seed = first; seed < last; ++seed) {
    Program p = generate(seed);
    if (verbose && main_process) std::printf("program %llu:\n%s", static_cast<unsigned long long>(seed), cpp(p, "{...}").c_str());
    std::optional<Finding> f = check(p, "", verbose && main_process);
    if (!f) continue;
    // Across processes every process must make the same collectives: no shrinking there.
    if (shrink_it && !multi) {
      p = shrink(p, f->design);
      if (auto again = check(p, f->design)) f = again;
    }
    std::fprintf(stderr, "loop_fuzz: program %llu%s: %s\n\n%s\n", static_cast<unsigned long long>(seed),
                 multi ? (" (process " + std::to_string(dp::dist::rank()) + ")").c_str() : "",
                 f->what.c_str(), cpp(p, f->spelling).c_str());
    return 1;
  }
  if (main_process)
    std::printf("loop_fuzz: programs %llu..%llu ran alike in every design (%d process%s)\n",
                static_cast<unsigned long long>(first), static_cast<unsigned long long>(last - 1),
                dp::dist::world_size(), multi ? "es" : "");
  return 0;
}
