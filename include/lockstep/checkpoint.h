#pragma once

// Checkpoints that survive a crash: written by rank 0 alone, atomically
// (temp file in the same folder, fsync, rename), with a checksum and the
// world size; loaded on every rank, with an error that says what is wrong
// with a truncated, corrupted or mismatched file.

#include <cstdint>
#include <map>
#include <string>

#include <lockstep/world.h>

namespace torch::nn {
class Module;
} // namespace torch::nn
namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep {

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

/// Collective. Rank 0 writes `module`'s parameters and buffers, the
/// optimizer's state, `extra` and the CPU random generator's state to
/// `path`; every rank returns once the file is complete. The previous file
/// at `path` stays intact until the new one is complete.
void save_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    const CheckpointExtra& extra = {});

/// Collective. Restores what save_checkpoint wrote, on every rank, into the
/// module's own tensors (so a DDP wrapper and the optimizer keep working).
/// Raises lockstep::CheckpointError on every rank if any rank cannot load.
CheckpointExtra load_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    CheckpointRead read = CheckpointRead::EveryRank);

/// Whether a file exists at `path` (a cheap test before resuming).
bool checkpoint_exists(const std::string& path);

} // namespace lockstep
