// dp/nn/state_dict.h — named tensors, and the one way a load matches them by name.
//
// A StateDict is (name, tensor) pairs in registration order, PyTorch's dotted names.
// Every load — Module::load_state_dict, dp::load of a checkpoint file, and
// Optimizer::load_state_dict — matches what it is given against what it holds with
// match_state_dict, so their errors read alike and every one says how to fix it.
//
//   auto m = dp::nn::match_state_dict(net->state_dict(), given, /*strict=*/true,
//                                     {.what = "load_state_dict"});
//   for (auto& [name, src] : m.matched) ...  // validated: copy src into `name`
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dp/tensor/tensor.h"

namespace dp::nn {

/// Ordered (name, tensor) pairs: the order of registration, depth first.
using StateDict = std::vector<std::pair<std::string, Tensor>>;

/// What load_state_dict(strict = false) could not match.
struct LoadResult {
  /// Names the target has and the given state lacks, in the target's order.
  std::vector<std::string> missing_keys;
  /// Names the given state has and the target lacks, in the given state's order.
  std::vector<std::string> unexpected_keys;
};

/// How a load names itself and its two sides in its error messages.
struct MatchContext {
  /// The operation, first in every message: "load_state_dict", "load 'net.safetensors'".
  std::string what = "load_state_dict";
  /// The side loaded into, as the messages name it: "the module", "this optimizer".
  std::string target = "the module";
  /// The side loaded from: "the state dict", "the file".
  std::string source = "the state dict";
  /// How to fix a name mismatch, the last sentence of that message.
  std::string fix_names = "Pass strict=false to load the names both have.";
  /// How to fix a shape or dtype mismatch, the last sentence of that message.
  std::string fix_shapes = "Was it saved from another architecture?";
};

/// The outcome of a successful match.
struct StateDictMatch {
  /// For every name both sides have, in the target's order: (name, the given tensor).
  /// Its shape and dtype equal the target's.
  StateDict matched;
  /// What strict = false left out (both empty after a strict match).
  LoadResult keys;
};

/// Matches `given` against `target` by name; reads only the names, shapes and dtypes
/// of `target`'s tensors and writes nothing. Throws dp::Error (and so writes nothing
/// for the caller to undo) when
///  - a name appears twice on either side, or a target tensor is undefined;
///  - strict and the names differ: "<what>: the names in <source> do not match
///    <target>'s. Missing from <source>: 'a', 'b'. Unexpected (in <source>, not in
///    <target>): 'c'. <fix_names>";
///  - strict or not, a name both have differs in shape or dtype (or the given tensor is
///    undefined): "<what>: 1 tensor does not fit <target>: expected [4, 1, 3, 3], got
///    [4, 3, 3, 3] for 'conv.weight'; … <fix_shapes>" (dtypes are named when they differ).
StateDictMatch match_state_dict(const StateDict& target, const StateDict& given, bool strict,
                                const MatchContext& ctx = {});

}  // namespace dp::nn
