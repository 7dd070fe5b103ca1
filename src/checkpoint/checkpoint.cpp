#include <lockstep/checkpoint.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <lockstep/zero_redundancy_optimizer.h>

#include "checkpoint/agree_on_outcome.h"
#include "checkpoint/checkpoint_contents.h"
#include "checkpoint/checkpoint_file.h"
#include "compat/c10d.h"
#include "world/broadcast_bytes.h"

namespace lockstep {
namespace detail {

void agree_on_outcome(World& world, const std::string& my_error, const std::string& what) {
  auto failures = torch::tensor({my_error.empty() ? 0 : 1}, torch::kInt);
  world.all_reduce(failures);
  if (failures.item<int>() == 0) {
    return;
  }
  auto errors = world.all_gather_strings(my_error);
  std::ostringstream message;
  message << what << " failed on " << failures.item<int>() << " rank(s):";
  for (size_t rank = 0; rank < errors.size(); ++rank) {
    if (!errors[rank].empty()) {
      message << "\n  rank " << rank << ": " << errors[rank];
    }
  }
  throw CheckpointError(message.str());
}

} // namespace detail

namespace {

template <typename Item>
void add_item(std::vector<std::pair<std::string, Item*>>& items, const char* kind,
              const std::string& name, Item& item) {
  for (const auto& entry : items) {
    LOCKSTEP_ENFORCE(entry.first != name, CheckpointError, "two ", kind, "s named '", name,
                     "' in one checkpoint; give each its own name.");
  }
  LOCKSTEP_ENFORCE(!name.empty() && name.find('\n') == std::string::npos, CheckpointError,
                   "a checkpoint item needs a name of one line, not '", name, "'.");
  items.emplace_back(name, &item);
}

} // namespace

CheckpointItems& CheckpointItems::module(const std::string& name, torch::nn::Module& module) {
  add_item(modules_, "module", name, module);
  return *this;
}

CheckpointItems& CheckpointItems::optimizer(const std::string& name,
                                            torch::optim::Optimizer& optimizer) {
  add_item(optimizers_, "optimizer", name, optimizer);
  return *this;
}

CheckpointItems& CheckpointItems::hook_state(const std::string& name, PowerSGD& state) {
  add_item(hook_states_, "hook state", name, state);
  return *this;
}

CheckpointItems& CheckpointItems::grad_scaler(const std::string& name,
                                              amp::GradScaler& scaler) {
  add_item(grad_scalers_, "grad scaler", name, scaler);
  return *this;
}

void save_checkpoint(
    World& world,
    const std::string& path,
    const CheckpointItems& items,
    const CheckpointExtra& extra) {
  // Every rank's random stream, so that each resumes its own (dropout
  // masks, noise and augmentations differ by rank), and its hook states.
  auto states = world.all_gather(at::detail::getDefaultCPUGenerator().get_state());
  // A ZeroRedundancyOptimizer's state is spread over the ranks: gathered on
  // rank 0, which writes it, and let go once written (or not), so that
  // rank 0 does not go on holding the whole state.
  struct ShardedStates {
    std::vector<detail::ShardedOptimizer*> optimizers;
    ~ShardedStates() {
      for (auto* sharded : optimizers) {
        sharded->finish_save();
      }
    }
  } sharded_states;
  for (const auto& [name, optimizer] : items.optimizers()) {
    if (auto* sharded = dynamic_cast<detail::ShardedOptimizer*>(optimizer)) {
      sharded_states.optimizers.push_back(sharded);
      sharded->prepare_save();
    }
  }
  std::vector<at::Tensor> hook_states;
  if (!items.hook_states().empty()) {
    hook_states = detail::gather_bytes(world, detail::serialize_hook_states(items));
  }
  std::string error;
  if (world.rank() == 0) {
    try {
      detail::write_checkpoint_file(path, world.size(), [&](std::ostream& out) {
        detail::serialize_checkpoint(items, extra, states, hook_states, out);
      });
    } catch (const std::exception& e) {
      error = detail::describe_exception(e);
    }
  }
  detail::agree_on_outcome(world, error, "lockstep: saving the checkpoint " + path);
}

CheckpointExtra load_checkpoint(
    World& world,
    const std::string& path,
    const CheckpointItems& items,
    CheckpointRead read) {
  // A rank that reads the file streams it from there; one that is sent the
  // file holds its bytes once.
  std::string bytes;
  std::string error;
  bool broadcast = read == CheckpointRead::RankZeroBroadcasts && world.size() > 1;
  if (broadcast && world.rank() == 0) {
    try {
      bytes = detail::read_bytes(path);
    } catch (const std::exception& e) {
      error = detail::describe_exception(e);
    }
  }
  if (broadcast) {
    detail::agree_on_outcome(world, error, "lockstep: reading the checkpoint " + path);
    detail::broadcast_bytes(world, 0, bytes, "");
  }
  detail::RestoredCheckpoint restored;
  if (error.empty()) {
    try {
      auto source = broadcast ? detail::checkpoint_in_bytes(bytes, path)
                              : detail::open_checkpoint_file(path);
      restored = detail::restore_checkpoint(path, source, items, world.rank(), world.size());
      restored.extra.world_size = source.world_size;
    } catch (const std::exception& e) {
      error = detail::describe_exception(e);
    }
  }
  detail::agree_on_outcome(world, error, "lockstep: loading the checkpoint " + path);
  if (restored.generator_state.defined()) {
    auto generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(restored.generator_state);
  }
  if (world.rank() == 0 && restored.generator_ranks != world.size()) {
    std::cerr << "lockstep: " << path << " holds the random streams of "
              << restored.generator_ranks << " rank(s) and this job has " << world.size()
              << ": ranks below " << std::min<int64_t>(restored.generator_ranks, world.size())
              << " resume their own, "
              << (restored.generator_ranks < world.size()
                      ? "the others keep the state their program seeded."
                      : "the other saved streams are not used.")
              << std::endl;
  }
  return restored.extra;
}

void save_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    const CheckpointExtra& extra) {
  save_checkpoint(
      world, path, CheckpointItems().module("model", module).optimizer("optimizer", optimizer),
      extra);
}

CheckpointExtra load_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    CheckpointRead read) {
  return load_checkpoint(
      world, path, CheckpointItems().module("model", module).optimizer("optimizer", optimizer),
      read);
}

bool checkpoint_exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

} // namespace lockstep
