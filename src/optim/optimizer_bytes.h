#pragma once

// An optimizer's state as bytes and back, for sending it to other ranks, and
// the one way lockstep loads a saved optimizer: with its groups' options.

#include <string>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace torch::serialize {
class InputArchive;
class OutputArchive;
} // namespace torch::serialize

namespace lockstep::detail {

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer);
void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes);

/// optimizer.load(archive), then each group's options (learning rate,
/// weight decay, ...) as saved. LibTorch 1.13's load restores the
/// per-parameter state only, so a resumed or restarted rank would train on
/// at the options it was built with, not those a scheduler had set (2.6's
/// restores them too; doing it again changes nothing). Python's
/// load_state_dict restores both.
void load_optimizer(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive);

/// `optimizer`'s groups' options alone, as its save() writes them (no
/// per-parameter state): what load_group_options reads.
void save_group_options(const torch::optim::Optimizer& optimizer,
                        torch::serialize::OutputArchive& archive);

/// The groups' options as saved in `archive` (by any torch::optim
/// optimizer's save), into `optimizer`'s groups. Nothing when the archive
/// holds no groups (a ZeroRedundancyOptimizer's shards).
void load_group_options(torch::optim::Optimizer& optimizer,
                        torch::serialize::InputArchive& archive);

} // namespace lockstep::detail
