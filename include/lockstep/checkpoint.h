#pragma once

// Checkpoints that survive a crash: written by rank 0 alone, atomically
// (temp file in the same folder, fsync, rename), with a checksum and the
// world size; loaded on every rank, with an error that says what is wrong
// with a truncated, corrupted or mismatched file. One file holds any number
// of named modules and optimizers, and every rank's random stream.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <lockstep/world.h>

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep {

class PowerSGD;
namespace amp {
class GradScaler;
} // namespace amp

/// What a checkpoint carries beside the model and the optimizer.
struct CheckpointExtra {
  int64_t epoch = 0;
  int64_t step = 0;
  /// Any numbers of the user's (best accuracy, learning rate, ...).
  std::map<std::string, double> values;
  /// Filled by load_checkpoint: the world size that wrote it.
  int64_t world_size = 0;
};

/// How load_checkpoint reads the file.
enum class CheckpointRead {
  /// Every rank reads the (shared) path itself.
  EveryRank,
  /// Rank 0 reads and broadcasts: for paths only rank 0's machine has.
  RankZeroBroadcasts,
};

/// What one checkpoint holds: any number of named modules and optimizers,
/// written together into one file, as PyTorch users save a dict:
///
///   lockstep::CheckpointItems items;
///   items.module("generator", *generator).module("discriminator", *critic)
///       .optimizer("generator", generator_optimizer)
///       .optimizer("discriminator", critic_optimizer);
///   lockstep::save_checkpoint(world, path, items, extra);
///   ...
///   lockstep::load_checkpoint(world, path, items);
///
/// The items are referred to, not copied: they must outlive the call.
class CheckpointItems {
 public:
  CheckpointItems& module(const std::string& name, torch::nn::Module& module);
  CheckpointItems& optimizer(const std::string& name, torch::optim::Optimizer& optimizer);
  /// A communication hook's state (PowerSGD: its iteration, the warm-start
  /// matrices and each rank's own error feedback, gathered into the file),
  /// so that a resume continues exactly where the run stopped.
  CheckpointItems& hook_state(const std::string& name, PowerSGD& state);
  /// A GradScaler's scale and growth tracker, so that a resumed run scales
  /// as the stopped one would have.
  CheckpointItems& grad_scaler(const std::string& name, amp::GradScaler& scaler);

  const std::vector<std::pair<std::string, torch::nn::Module*>>& modules() const {
    return modules_;
  }
  const std::vector<std::pair<std::string, torch::optim::Optimizer*>>& optimizers() const {
    return optimizers_;
  }
  const std::vector<std::pair<std::string, PowerSGD*>>& hook_states() const {
    return hook_states_;
  }
  const std::vector<std::pair<std::string, amp::GradScaler*>>& grad_scalers() const {
    return grad_scalers_;
  }

 private:
  std::vector<std::pair<std::string, torch::nn::Module*>> modules_;
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers_;
  std::vector<std::pair<std::string, PowerSGD*>> hook_states_;
  std::vector<std::pair<std::string, amp::GradScaler*>> grad_scalers_;
};

/// Collective. Rank 0 writes the items' parameters, buffers and optimizer
/// states, `extra`, and every rank's CPU random generator state to `path`;
/// every rank returns once the file is complete. The previous file at
/// `path` stays intact until the new one is complete.
void save_checkpoint(
    World& world,
    const std::string& path,
    const CheckpointItems& items,
    const CheckpointExtra& extra = {});

/// Collective. Restores what save_checkpoint wrote, on every rank, into the
/// items' own tensors (so a DDP wrapper and the optimizers keep working),
/// each rank's random generator included. Raises lockstep::CheckpointError
/// on every rank if any rank cannot load: a missing or unreadable file, or
/// one that lacks an item or holds another model under its name. Items in
/// the file that `items` does not name are left alone.
CheckpointExtra load_checkpoint(
    World& world,
    const std::string& path,
    const CheckpointItems& items,
    CheckpointRead read = CheckpointRead::EveryRank);

/// The one-model form: `module` as "model" and `optimizer` as "optimizer".
void save_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    const CheckpointExtra& extra = {});
CheckpointExtra load_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    CheckpointRead read = CheckpointRead::EveryRank);

/// Whether a file exists at `path` (a cheap test before resuming).
bool checkpoint_exists(const std::string& path);

} // namespace lockstep
