// tests/tensor/op_fuzz_replay.cpp — runs the differential op fuzzer's programs in dp and
// compares them with PyTorch's results (scripts/op_fuzz.py draws them).
//
//   op_fuzz_replay tests/tensor/op_fuzz_corpus.safetensors            # every program, CPU
//   op_fuzz_replay FILE --device cuda:0                               # on a GPU (77: none)
//   op_fuzz_replay FILE --case c17 --verbose                          # one, with its values
//
// The file holds, per program c<seed>: its text (metadata "program.c<seed>", lines
// separated by "; "), its float32 inputs x<k> and int64 inputs i<k>, the weights w<k> of
// L = sum_k sum(out_k * w_k), and PyTorch's float64 outputs out<k> and gradients
// grad.x<k>, each with the bound its difference must stay within (bound.*). A program
// runs forward and backward once per attention path where it calls attention (Math and
// the fused kernel), once otherwise. Exit status: 0 when every program agrees, 1 when one
// does not (each printed with what differs), 2 on bad usage or an unreadable file, 77
// when --device names a device that is not there.
//
// Note [Op fuzzer]
// The loop fuzzer (tests/parallel/loop_fuzz.cpp) compares dp's designs with each other,
// so an op that computes the wrong thing computes it alike in every design and passes.
// This fuzzer compares the ops themselves with PyTorch, whose semantics dp promises. A
// random program of 1-8 ops over small random tensors — elementwise ops with
// broadcasting, scalars, views and the ops dp materialises (permute, narrow, expand,
// chunk, cat, ...), reductions, matmul with batch broadcasting, linear, conv2d, pools,
// batch_norm, softmax, layer_norm, gelu, where/masked_fill, tril/triu, gather,
// index_select and index_add, attention (additive, learned and 0/1 keep masks), embedding, six losses
// (cross entropy with class weights, smoothing and ignored rows), casts to 16 bits, ops
// under bfloat16 autocast, argmax feeding gather, in-place writes into an op's result
// (add_ and copy_ of broadcast sources of any floating dtype, the tensor itself
// included; add_ of a scalar, mul_, fill_, zero_) that later ops read — is drawn by scripts/op_fuzz.py and run by PyTorch as it is
// drawn (an op whose inputs fall outside its domain or sit on a kink or a tie, or whose
// result is not finite or grows past 1e4, is drawn again), then run here by dp, forward
// and backward of L = sum_i sum(out_i * w_i) for random w_i.
//
// The oracle: PyTorch runs each program twice, in its own dtypes (float32, bfloat16
// where the program casts or autocasts) and in float64 (a cast to bfloat16 rounds there
// too, then computation goes on in float64). The float64 run stands for the exact
// result; the error PyTorch's own run makes against it measures the rounding this
// program allows. dp's output or gradient t passes when
//     max|t_dp - t_64| <= 16 * max|t_pt - t_64| + n_ops * 2^-20 * max(1, max|t_64|)
// (the second term a floor for results PyTorch happens to get exact where dp sums in
// another order: 2^-20 is sixteen float32 roundings per op; 2^-7, a bfloat16 unit in
// the last place per op, in a program that computes in 16 bits anywhere (a cast, or an
// op under autocast), since the float64 run rounds at the casts as PyTorch does, so
// PyTorch's own error there hides where a backward formula rounds an intermediate). A norm over a nearly constant group (variance below
// 1e-3) is not drawn: its output is rounding noise over sqrt(eps). Nor is a row of one
// value, though layer_norm's output is then exactly the bias in both libraries (Note [An
// exact mean for a constant row], tested in sequence_test): such a row comes of a
// broadcast (a value added into every element), whose gradient sums the row's input
// gradients, rstd (g_j - mean g) with rstd = 1/sqrt(eps) ~ 316; they cancel to zero
// exactly (layer_norm ignores a constant added to its row) and to noise 316 times a
// rounding of g in float32 (program 4078: PyTorch 0, dp 1.5e-5). A lost term, a wrong
// broadcast, a transposed index, a wrong dtype or a missing gradient is far outside it;
// an op dp refuses where PyTorch runs it is reported too. CI replays a fixed corpus
// (tests/tensor/op_fuzz_corpus.safetensors, programs 0..N-1, written by the script with
// PyTorch, so the test needs no Python); `scripts/op_fuzz.py --replay BIN --seeds A:B`
// hunts further. Its first hours found a broadcasting walk that had been wrong since
// the first commit, a fused attention that gave a learned mask no gradient, 16-bit
// losses that lost their float32 target's precision, 16-bit gather gradients rounded
// once per repeat, and cat and linear taking fewer shapes and dtypes than PyTorch's.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../fuzz_replay.h"
#include "dp/dp.h"

namespace {

using dp::Tensor;
using fuzz_replay::Outcome;
using fuzz_replay::split_on;
using fuzz_replay::words;

/// One program's run: its values by number, read from the file's tensors.
class Run {
 public:
  /// With `channels_last`, every 4-d floating value is laid out channels-last as it is
  /// made (Note [Channels-last tensors]), so the ops after it read that layout.
  Run(const std::map<std::string, Tensor>& file, std::string prefix, dp::Device device, bool channels_last = false)
      : file_(file), prefix_(std::move(prefix)), device_(device), channels_last_(channels_last) {}

  const Tensor& file_tensor(const std::string& name) const {
    auto it = file_.find(prefix_ + "." + name);
    DP_CHECK(it != file_.end(), "op_fuzz_replay: the file has no tensor ", prefix_, ".", name);
    return it->second;
  }

  const Tensor& value(const std::string& w) const {
    DP_CHECK(w.size() > 1 && w[0] == 'v', "op_fuzz_replay: expected a value v<n>, got '", w, "'");
    const auto i = static_cast<std::size_t>(std::stoll(w.substr(1)));
    DP_CHECK(i < values_.size(), "op_fuzz_replay: value ", w, " is not defined yet");
    return values_[i];
  }
  std::optional<Tensor> maybe(const std::string& w) const {
    if (w == "-") return std::nullopt;
    return value(w);
  }

  static std::int64_t i64(const std::string& w) { return std::stoll(w); }
  static double f64(const std::string& w) { return std::stod(w); }
  /// A clamp bound: "none" is absent.
  static std::optional<double> bound(const std::string& w) {
    return w == "none" ? std::nullopt : std::optional<double>(std::stod(w));
  }

  dp::nn::Reduction reduction(const std::string& w) const {
    if (w == "mean") return dp::nn::Reduction::Mean;
    if (w == "sum") return dp::nn::Reduction::Sum;
    DP_CHECK(w == "none", "op_fuzz_replay: expected a reduction mean|sum|none, got '", w, "'");
    return dp::nn::Reduction::None;
  }

  /// Runs one line "v<n> = op args..." (or "out v<a> ...").
  void line(const std::string& text) {
    const auto w = words(text);
    DP_CHECK(!w.empty(), "op_fuzz_replay: an empty line");
    if (w[0] == "out") {
      for (std::size_t i = 1; i < w.size(); ++i) outs_.push_back(value(w[i]));
      return;
    }
    DP_CHECK(w.size() >= 3 && w[1] == "=" && w[0] == "v" + std::to_string(values_.size()),
             "op_fuzz_replay: expected 'v", values_.size(), " = op ...', got '", text, "'");
    Tensor v = apply(w);
    if (channels_last_ && v.dim() == 4 && dp::is_floating_point(v.dtype()))
      v = v.contiguous(dp::MemoryFormat::ChannelsLast);
    values_.push_back(v);
  }

  Tensor apply(std::vector<std::string> w) {
    if (w[2] == "ac") {  // the op under bfloat16 autocast
      w.erase(w.begin() + 2);
      DP_CHECK(w.size() >= 3, "op_fuzz_replay: 'ac' expects an op");
      dp::amp::autocast cast(dp::Dtype::BFloat16);
      return apply(std::move(w));
    }
    const std::string& op = w[2];
    auto a = [&](std::size_t i) -> const std::string& {
      DP_CHECK(i + 3 < w.size(), "op_fuzz_replay: ", op, " expects more arguments");
      return w[i + 3];
    };
    auto ints_from = [&](std::size_t first) {
      std::vector<std::int64_t> out;
      for (std::size_t i = first + 3; i < w.size(); ++i) out.push_back(i64(w[i]));
      return out;
    };
    if (op == "input") {
      Tensor t = file_tensor(a(0)).to(device_);
      if (t.impl() == file_tensor(a(0)).impl()) t = t.clone();
      t.set_requires_grad(true);
      leaves_.emplace_back(a(0), t);
      return t;
    }
    if (op == "ints") return file_tensor(a(0)).to(device_);
    if (op == "const") return file_tensor(a(0)).to(device_);  // no gradient: class weights, keep masks
    // Unary.
    if (op == "neg") return dp::neg(value(a(0)));
    if (op == "abs") return dp::abs(value(a(0)));
    if (op == "tanh") return dp::tanh(value(a(0)));
    if (op == "sigmoid") return dp::sigmoid(value(a(0)));
    if (op == "relu") return dp::relu(value(a(0)));
    if (op == "square") return dp::square(value(a(0)));
    if (op == "erf") return dp::erf(value(a(0)));
    if (op == "exp") return dp::exp(value(a(0)));
    if (op == "log") return dp::log(value(a(0)));
    if (op == "sqrt") return dp::sqrt(value(a(0)));
    if (op == "reciprocal") return dp::reciprocal(value(a(0)));
    if (op == "contiguous") return value(a(0)).contiguous();
    if (op == "gelu") return dp::nn::gelu(value(a(0)));
    if (op == "gelu_tanh") return dp::nn::gelu(value(a(0)), "tanh");
    if (op == "logsigmoid") return dp::nn::logsigmoid(value(a(0)));
    if (op == "pow") return dp::pow(value(a(0)), f64(a(1)));
    if (op == "bf16") return value(a(0)).to(dp::Dtype::BFloat16);
    if (op == "f32") return value(a(0)).to(dp::Dtype::Float32);
    if (op == "f16") return value(a(0)).to(dp::Dtype::Float16);
    if (op == "argmax") return dp::argmax(value(a(0)), i64(a(1)), i64(a(2)) != 0);
    // Scalars.
    if (op == "add_s") return dp::add(value(a(0)), f64(a(1)));
    if (op == "mul_s") return dp::mul(value(a(0)), f64(a(1)));
    if (op == "rsub_s") return dp::sub(f64(a(1)), value(a(0)));
    if (op == "rdiv_s") return dp::div(f64(a(1)), value(a(0)));
    // Binary, broadcasting.
    if (op == "add") return dp::add(value(a(0)), value(a(1)));
    if (op == "sub") return dp::sub(value(a(0)), value(a(1)));
    if (op == "mul") return dp::mul(value(a(0)), value(a(1)));
    if (op == "div") return dp::div(value(a(0)), value(a(1)));
    if (op == "maximum") return dp::maximum(value(a(0)), value(a(1)));
    if (op == "gt") return value(a(0)).gt(value(a(1)));
    if (op == "where") return dp::where(value(a(0)), value(a(1)), value(a(2)));
    if (op == "masked_fill") return dp::masked_fill(value(a(0)), value(a(1)), f64(a(2)));
    if (op == "clamp") return dp::clamp(value(a(0)), bound(a(1)), bound(a(2)));
    if (op == "tril") return dp::tril(value(a(0)), i64(a(1)));
    if (op == "triu") return dp::triu(value(a(0)), i64(a(1)));
    // Reductions.
    if (op == "sum") return dp::sum(value(a(0)));
    if (op == "mean") return dp::mean(value(a(0)));
    if (op == "sum_d") return dp::sum(value(a(0)), i64(a(1)), i64(a(2)) != 0);
    if (op == "mean_d") return dp::mean(value(a(0)), i64(a(1)), i64(a(2)) != 0);
    if (op == "max_d") return dp::max(value(a(0)), i64(a(1)), i64(a(2)) != 0);
    // Shapes.
    if (op == "reshape") return value(a(0)).reshape(ints_from(1));
    if (op == "permute") return value(a(0)).permute(ints_from(1));
    if (op == "transpose") return value(a(0)).transpose(i64(a(1)), i64(a(2)));
    if (op == "t") return value(a(0)).t();
    if (op == "unsqueeze") return value(a(0)).unsqueeze(i64(a(1)));
    if (op == "squeeze") return value(a(0)).squeeze(i64(a(1)));
    if (op == "flatten") return value(a(0)).flatten(i64(a(1)), i64(a(2)));
    if (op == "narrow") return value(a(0)).narrow(i64(a(1)), i64(a(2)), i64(a(3)));
    if (op == "expand") return value(a(0)).expand(ints_from(1));
    if (op == "chunk") return dp::chunk(value(a(0)), i64(a(1)), i64(a(2))).at(static_cast<std::size_t>(i64(a(3))));
    if (op == "split") return dp::split(value(a(0)), i64(a(1)), i64(a(2))).at(static_cast<std::size_t>(i64(a(3))));
    if (op == "cat") {
      std::vector<Tensor> parts;
      for (std::size_t i = 4; i < w.size(); ++i) parts.push_back(value(w[i]));
      return dp::cat(parts, i64(a(0)));
    }
    // Products, normalisation, attention, lookups, losses.
    if (op == "matmul") return dp::matmul(value(a(0)), value(a(1)));
    if (op == "softmax") return dp::nn::softmax(value(a(0)), i64(a(1)));
    if (op == "log_softmax") return dp::nn::log_softmax(value(a(0)), i64(a(1)));
    if (op == "layer_norm") {
      const Tensor& x = value(a(0));
      const std::int64_t k = i64(a(1));
      dp::Shape norm(x.shape().end() - k, x.shape().end());
      return dp::nn::layer_norm(x, norm, maybe(a(2)).value_or(Tensor()), maybe(a(3)).value_or(Tensor()), 1e-5);
    }
    if (op == "sdpa") {
      std::optional<double> scale;
      if (a(4) != "-") scale = f64(a(4));
      const bool keep = w.size() > 9 && i64(a(6)) != 0;  // a 0/1 keep mask, PyTorch's bool mask
      return dp::nn::scaled_dot_product_attention(value(a(0)), value(a(1)), value(a(2)),
                                                  maybe(a(5)).value_or(Tensor()), 0.0, i64(a(3)) != 0, scale, keep);
    }
    if (op == "embedding") {
      std::optional<std::int64_t> pad;
      if (a(2) != "-") pad = i64(a(2));
      return dp::nn::embedding(value(a(0)), value(a(1)), pad);
    }
    if (op == "cross_entropy") {
      dp::nn::CrossEntropyOptions o;
      o.reduction = reduction(a(2));
      o.label_smoothing = f64(a(3));
      if (w.size() > 7) o.weight = maybe(a(4)).value_or(Tensor());
      return dp::nn::cross_entropy(value(a(0)), value(a(1)), o);
    }
    if (op == "nll_loss") {
      dp::nn::NLLLossOptions o;
      o.reduction = reduction(a(2));
      o.ignore_index = i64(a(3));
      o.weight = maybe(a(4)).value_or(Tensor());
      return dp::nn::nll_loss(value(a(0)), value(a(1)), o);
    }
    if (op == "mse") return dp::nn::mse_loss(value(a(0)), value(a(1)), reduction(a(2)));
    if (op == "bce") {
      dp::nn::BCEWithLogitsOptions o;
      o.reduction = reduction(a(2));
      return dp::nn::binary_cross_entropy_with_logits(value(a(0)), value(a(1)), o);
    }
    if (op == "l1") return dp::nn::l1_loss(value(a(0)), value(a(1)), reduction(a(2)));
    if (op == "smooth_l1") return dp::nn::smooth_l1_loss(value(a(0)), value(a(1)), reduction(a(2)), f64(a(3)));
    // Layers' ops, and autocast's policy on the products.
    if (op == "linear") return dp::linear(value(a(0)), value(a(1)), maybe(a(2)).value_or(Tensor()));
    if (op == "linear_relu") return dp::linear_relu(value(a(0)), value(a(1)), value(a(2)));
    if (op == "ac_linear") {
      dp::amp::autocast cast(dp::Dtype::BFloat16);
      return dp::linear(value(a(0)), value(a(1)), maybe(a(2)).value_or(Tensor()));
    }
    if (op == "ac_matmul") {
      dp::amp::autocast cast(dp::Dtype::BFloat16);
      return dp::matmul(value(a(0)), value(a(1)));
    }
    if (op == "conv2d")
      return dp::nn::conv2d(value(a(0)), value(a(1)), maybe(a(2)).value_or(Tensor()), i64(a(3)), i64(a(4)));
    if (op == "conv2d_relu")
      return dp::nn::conv2d_relu(value(a(0)), value(a(1)), value(a(2)), i64(a(3)), i64(a(4)));
    if (op == "conv2d_relu_max_pool2d")
      return dp::nn::conv2d_relu_max_pool2d(value(a(0)), value(a(1)), value(a(2)), i64(a(3)), i64(a(4)), i64(a(5)),
                                            i64(a(6)), i64(a(7)));
    if (op == "max_pool2d") return dp::nn::max_pool2d(value(a(0)), i64(a(1)), i64(a(2)), i64(a(3)));
    if (op == "avg_pool2d") return dp::nn::avg_pool2d(value(a(0)), i64(a(1)), i64(a(2)), i64(a(3)));
    if (op == "adaptive_avg_pool2d") return dp::nn::adaptive_avg_pool2d(value(a(0)), i64(a(1)), i64(a(2)));
    if (op == "batch_norm")
      return dp::nn::batch_norm(value(a(0)), maybe(a(1)).value_or(Tensor()), maybe(a(2)).value_or(Tensor()), Tensor(),
                                Tensor(), true);
    // In-place writes (Note [In-place writes and autograd]): the line's value is the
    // written tensor itself, another handle of the same tensor.
    if (op == "iadd" || op == "icopy" || op == "iadd_s" || op == "imul" || op == "ifill" || op == "izero" ||
        op == "isub" || op == "isub_s" || op == "imul_t" || op == "idiv_t" || op == "idiv_s" || op == "imask" ||
        op == "irelu" || op == "iclamp") {
      Tensor t = value(a(0));
      if (op == "iadd") t.add_(value(a(1)), static_cast<float>(f64(a(2))));
      if (op == "isub") t.sub_(value(a(1)), static_cast<float>(f64(a(2))));
      if (op == "isub_s") t.sub_(f64(a(1)));
      if (op == "imul_t") t.mul_(value(a(1)));
      if (op == "idiv_t") t.div_(value(a(1)));
      if (op == "idiv_s") t.div_(f64(a(1)));
      if (op == "imask") t.masked_fill_(value(a(1)), f64(a(2)));
      if (op == "irelu") t.relu_();
      if (op == "iclamp") t.clamp_(bound(a(1)), bound(a(2)));
      if (op == "icopy") t.copy_(value(a(1)));
      if (op == "iadd_s") t.add_(f64(a(1)));
      if (op == "imul") t.mul_(static_cast<float>(f64(a(1))));
      if (op == "ifill") t.fill_(f64(a(1)));
      if (op == "izero") t.zero_();
      return t;
    }
    if (op == "index_select") return dp::index_select(value(a(0)), i64(a(1)), value(a(2)));
    if (op == "gather") return dp::gather(value(a(0)), i64(a(1)), value(a(2)));
    if (op == "index_add") return dp::index_add(value(a(0)), i64(a(1)), value(a(2)), value(a(3)));
    DP_FAIL("op_fuzz_replay: unknown op '", op, "'");
  }

  /// L = sum_k sum(out_k * w_k) in float32, then its backward.
  void backward() {
    Tensor loss;
    for (std::size_t k = 0; k < outs_.size(); ++k) {
      Tensor term = dp::sum(dp::mul(outs_[k].to(dp::Dtype::Float32), file_tensor("w" + std::to_string(k)).to(device_)));
      loss = loss.defined() ? dp::add(loss, term) : term;
    }
    if (loss.defined() && loss.requires_grad()) loss.backward();
  }

  const std::vector<Tensor>& outs() const { return outs_; }
  const std::vector<std::pair<std::string, Tensor>>& leaves() const { return leaves_; }

 private:
  const std::map<std::string, Tensor>& file_;
  std::string prefix_;
  dp::Device device_;
  bool channels_last_;
  std::vector<Tensor> values_;
  std::vector<Tensor> outs_;
  std::vector<std::pair<std::string, Tensor>> leaves_;
};

/// "" when `got` (any dtype, any device) is within `bound` of `want` everywhere, else
/// what differs.
std::string compare(const std::string& what, const Tensor& got, const Tensor& want, double bound) {
  std::ostringstream out;
  if (!got.defined()) {
    // An input that reaches no output has no gradient: PyTorch's is zeros.
    const auto v = want.to_vector();
    const bool zero = std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f; });
    if (!zero) out << what << ": dp gives no gradient, PyTorch a nonzero one";
    return out.str();
  }
  if (got.shape() != want.shape()) {
    out << what << ": shape " << dp::shape_str(got.shape()) << ", PyTorch's " << dp::shape_str(want.shape());
    return out.str();
  }
  const std::vector<float> g = got.to(dp::cpu(0)).to(dp::Dtype::Float32).to_vector();
  const std::vector<float> e = want.to_vector();
  double worst = 0.0;
  std::size_t at = 0, beyond = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double d = std::isnan(g[i]) ? INFINITY : std::fabs(static_cast<double>(g[i]) - e[i]);
    beyond += d > bound;
    if (d > worst) {
      worst = d;
      at = i;
    }
  }
  if (worst > bound)
    out << what << ": element " << at << " is " << g[at] << ", PyTorch's " << e[at] << " (difference " << worst
        << ", bound " << bound << "; " << beyond << " of " << g.size() << " elements beyond it)";
  return out.str();
}

/// "" when `got` and `want` (the same program's results) have the same bits, else what
/// differs.
std::string compare_bits(const std::string& what, const Tensor& got, const Tensor& want) {
  if (got.defined() != want.defined()) return what + ": defined in one run only";
  if (!got.defined()) return "";
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) return what + ": another shape or dtype";
  const std::vector<float> g = got.to(dp::cpu(0)).to(dp::Dtype::Float32).to_vector();
  const std::vector<float> e = want.to(dp::cpu(0)).to(dp::Dtype::Float32).to_vector();
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (std::memcmp(&g[i], &e[i], sizeof(float)) != 0) {
      std::ostringstream out;
      out << what << ": element " << i << " is " << g[i] << " with channels-last values, " << e[i] << " without";
      return out.str();
    }
  }
  return "";
}

// Note [Channels-last replay]
// Every program runs a second time with each 4-d floating value laid out channels-last
// as it is made (Run's channels_last), so every op of the program meets that layout as
// an input — those that keep it, those that read NCHW, in-place writes into it, and
// gradients through it. Its outputs and gradients must have the bits of the first run
// (the layout changes where bytes lie, never a value: Note [Channels-last tensors]),
// except in a program with a convolution or a batch norm, which compute in the layout
// and sum in another order there: those must pass PyTorch's bounds as the first run
// does.
Outcome run_case(const std::map<std::string, Tensor>& file, const std::string& name, const std::string& program,
                 dp::Device device, bool verbose) {
  Outcome res;
  const auto lines = split_on(program, "; ");
  const bool attention = program.find(" sdpa ") != std::string::npos;
  std::vector<dp::nn::AttentionPath> paths{dp::nn::AttentionPath::Auto};
  if (attention) paths.push_back(dp::nn::AttentionPath::Math);
  for (const auto path : paths) {
    dp::nn::set_attention_path(path);
    const std::string tag = attention ? (path == dp::nn::AttentionPath::Math ? " [math attention]" : " [fused attention]")
                                      : "";
    Run run(file, name, device);
    std::vector<std::string> problems;
    try {
      for (const auto& l : lines) run.line(l);
      run.backward();
      auto bound = [&](const std::string& n) { return static_cast<double>(run.file_tensor("bound." + n).item()); };
      for (std::size_t k = 0; k < run.outs().size(); ++k) {
        const std::string n = "out" + std::to_string(k);
        if (auto p = compare(n, run.outs()[k], run.file_tensor(n), bound(n)); !p.empty()) problems.push_back(p);
      }
      for (const auto& [leaf, t] : run.leaves()) {
        const std::string n = "grad." + leaf;
        if (auto p = compare(n, t.grad(), run.file_tensor(n), bound(n)); !p.empty()) problems.push_back(p);
      }
    } catch (const std::exception& e) {
      problems.push_back(std::string("dp threw where PyTorch ran: ") + e.what());
    }
    if (problems.empty()) {  // Note [Channels-last replay]
      Run cl(file, name, device, /*channels_last=*/true);
      const bool in_layout = program.find(" conv2d") != std::string::npos ||
                             program.find(" batch_norm") != std::string::npos;
      try {
        for (const auto& l : lines) cl.line(l);
        cl.backward();
        auto bound = [&](const std::string& n) { return static_cast<double>(run.file_tensor("bound." + n).item()); };
        auto check = [&](const std::string& n, const Tensor& got, const Tensor& first) {
          const std::string p = in_layout ? compare(n + " (channels-last)", got, run.file_tensor(n), bound(n))
                                          : compare_bits(n, got, first);
          if (!p.empty()) problems.push_back(p);
        };
        for (std::size_t k = 0; k < run.outs().size(); ++k)
          check("out" + std::to_string(k), cl.outs()[k], run.outs()[k]);
        for (std::size_t k = 0; k < run.leaves().size(); ++k)
          check("grad." + run.leaves()[k].first, cl.leaves()[k].second.grad(), run.leaves()[k].second.grad());
      } catch (const std::exception& e) {
        problems.push_back(std::string("dp threw with channels-last values: ") + e.what());
      }
    }
    if (!problems.empty() || verbose) {
      std::ostringstream out;
      out << (problems.empty() ? "ok   " : "FAIL ") << name << tag << " on " << device.str() << "\n";
      for (const auto& l : lines) out << "    " << l << "\n";
      for (const auto& p : problems) out << "  - " << p << "\n";
      res.report += out.str();
    }
    res.ok = res.ok && problems.empty();
  }
  dp::nn::set_attention_path(dp::nn::AttentionPath::Auto);
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  // float32 products in float32: PyTorch's CPU results are the reference, and TF32
  // convolutions (cuDNN's default, as PyTorch's) round inputs to 10 bits.
  dp::set_allow_tf32_matmul(false);
  dp::set_allow_tf32_conv(false);
  return fuzz_replay::run_corpus(argc, argv, "op_fuzz_replay", run_case);
}
