// dp/io/checkpoint.h — module checkpoints and resumable training checkpoints.
//
// A module checkpoint is a safetensors file (see dp/io/safetensors.h) holding the
// module's state_dict under PyTorch's dotted names, without any wrapper prefix: what
// a plain net, DataParallel in DP mode and in DDP mode save is the same file, and it
// loads into any of them (and into PyTorch with safetensors.torch.load_file).
// A training checkpoint adds the optimizer's state (tensors under "optimizer."), the
// loop position and random generator states (strings in "__metadata__"): the default
// generator, every generator the module tree registered (each Dropout's per-copy
// streams; Module::named_generators) and any the user lists. A resumed run is then
// bitwise identical to an uninterrupted one with nothing named by hand. A DataLoader
// holds no generator: its order is a pure function of (seed, epoch), so the epoch and
// batch in TrainingState are its whole state. Writes are atomic (Note [Atomic
// checkpoint writes]); loads validate everything before writing anything.
// This header knows nothing of DataParallel: pass the wrapped module (*model.module())
// or model.state_dict(); DataParallel's replicas pick loaded values up at the next
// forward because a load bumps the parameter set's version.
//
//   dp::save(*net, "net.safetensors");
//   dp::load(*net, "net.safetensors");                        // strict: names and shapes
//   dp::TrainingState st{.step = 100, .epoch = 2, .batch = 17};
//   dp::save_training_checkpoint("run.ckpt", *net, opt, st);
//   dp::load_training_checkpoint("run.ckpt", *net, opt, st);  // st.step == 100 again
//   // with a scheduler: st.schedulers = {{"lr", &sched}} on both sides
//   loader.set_position(st.epoch, st.batch);                  // continue at batch 17
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dp/io/safetensors.h"
#include "dp/nn/module.h"
#include "dp/optim/grad_scaler.h"
#include "dp/optim/lr_scheduler.h"
#include "dp/optim/optimizer.h"
#include "dp/tensor/tensor.h"

namespace dp {

// ---- module checkpoints ------------------------------------------------------------------

/// Saves module.state_dict() (copy 0, any device) to `path` atomically, with `metadata`
/// in the header ("format": "pt" is always set) and each tensor's CRC-32
/// ("dp.crc32.<name>").
void save(nn::Module& module, const std::string& path, const io::Metadata& metadata = {});
void save(const std::shared_ptr<nn::Module>& module, const std::string& path,
          const io::Metadata& metadata = {});
/// Saves named tensors (e.g. DataParallel::state_dict()) to `path` atomically.
void save(const nn::StateDict& state, const std::string& path, const io::Metadata& metadata = {});

/// Loads `path` into the module's parameters and buffers (copied to their devices).
/// strict: the file's names must equal the module's state_dict names, else dp::Error
/// listing the missing and the unexpected ones. strict = false loads the names both
/// sides have and returns the rest. Every dtype and shape is checked ("expected
/// [32, 1, 3, 3], got [32, 3, 3, 3] for 'features.0.weight'") and the file fully
/// validated before any value is written, every tensor's checksum included (a file
/// without checksums, such as PyTorch's, loads unverified): a failed load leaves the
/// module untouched.
/// The "optimizer." entries of a training checkpoint are ignored (not unexpected).
nn::LoadResult load(nn::Module& module, const std::string& path, bool strict = true);
nn::LoadResult load(const std::shared_ptr<nn::Module>& module, const std::string& path,
                    bool strict = true);
/// Loads `path` into the given tensors in place (by name, as for a module): e.g. a
/// state_dict() whose tensors are views of a module's parameters.
nn::LoadResult load(const nn::StateDict& into, const std::string& path, bool strict = true);
/// Reads the tensors of `path` (host tensors on cpu(0), file order).
nn::StateDict load(const std::string& path);

// ---- training checkpoints ----------------------------------------------------------------

/// Where a training loop is, and what else must be restored for an exact resume.
struct TrainingState {
  /// Optimizer steps taken so far (the loop's global step).
  std::int64_t step = 0;
  /// The epoch in progress (pass it to DataLoader::set_position when resuming).
  std::int64_t epoch = 0;
  /// Batches of `epoch` already consumed: resume with
  /// loader.set_position(state.epoch, state.batch).
  std::int64_t batch = 0;
  /// Generators outside the module (augmentation, …) saved and restored by name, in
  /// place. dp::default_generator() and every generator the module registered
  /// (Dropout's included) are always saved and restored: do not list those.
  std::vector<std::pair<std::string, Generator*>> generators;
  /// Learning-rate schedulers saved and restored by name, in place (optional): their
  /// position and base lrs, so that the resumed run continues the lr sequence exactly.
  /// Build them as in the saved run before loading; dp::Error when the file has no
  /// scheduler of that name or one of another kind.
  std::vector<std::pair<std::string, optim::LRScheduler*>> schedulers;
  /// A float16 run's loss scaler (optional): its scale and growth tracker saved as
  /// "grad_scaler.*" tensors and restored in place, so that the resumed run scales as
  /// the uninterrupted one would. dp::Error on load when the file has none.
  amp::GradScaler* scaler = nullptr;
  /// Free-form strings (run id, config hash, …), saved as "user.<key>" metadata.
  std::map<std::string, std::string> metadata;
};

/// Saves module state (unprefixed names), optimizer.state_dict() (prefixed
/// "optimizer."), its learning rate and momentum, every parameter group's parameters and
/// hyper-parameters (optimizer.param_groups_state()), `state` (with its schedulers and
/// generators), dp::default_generator()'s state and the state of every generator of
/// module.named_generators() to one safetensors file at `path`, atomically, with a
/// CRC-32 per tensor (Note [Tensor checksums], safetensors.cpp). Under mpirun the default
/// generator and the generators `state` names are the writing process's; a Dropout
/// layer's streams are the whole job's, gathered from every process and numbered by
/// device (Note [Dropout streams in a checkpoint], checkpoint.cpp).
/// The optimizer of a Sharded run across processes (stages 1 and 2 under mpirun) holds
/// only its process's shards and optimizer.state_dict() gathers the others, and a
/// Dropout layer a DataParallel spread over processes holds only its process's streams:
/// the save is then COLLECTIVE — every process calls it, with `write` true on one of
/// them (dp::dist::is_main()), false on the others, which take part in the gathering
/// and write nothing. The file holds the whole state and loads into any mode and
/// topology; a load gives each process's Dropout copies their own streams.
void save_training_checkpoint(const std::string& path, nn::Module& module, optim::Optimizer& optimizer,
                              const TrainingState& state, bool write = true);

/// Restores what save_training_checkpoint wrote: the module (strict), the optimizer
/// (state and every group's hyper-parameters: dp::Error for an optimizer with other
/// param groups; a file written before param groups holds one group and restores its
/// learning rate and, when saved, momentum), dp::default_generator(), every
/// generator the module registered, and fills state.step, .epoch, .batch and
/// .metadata; every generator and scheduler listed in state.generators and
/// state.schedulers is restored by name (dp::Error when the file has none of that
/// name). The module's generators must match the file's both ways (dp::Error naming
/// the missing and unexpected ones); a file written before dp saved them (no
/// "dp.checkpoint_version") loads with a warning and leaves them as they are (Note
/// [Checkpoints without module generators], checkpoint.cpp). Every tensor's checksum
/// is verified (dp::Error naming the tensor and the file when one fails). Everything
/// is validated first: on error, module, optimizer, generators, schedulers and
/// `state` are unchanged.
void load_training_checkpoint(const std::string& path, nn::Module& module, optim::Optimizer& optimizer,
                              TrainingState& state);

}  // namespace dp
