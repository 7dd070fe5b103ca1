#include "optim/optimizer_bytes.h"

#include <sstream>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/error.h>

namespace lockstep::detail {

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  load_optimizer(optimizer, archive);
}

void load_optimizer(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  optimizer.load(archive);
  load_group_options(optimizer, archive);
}

void save_group_options(const torch::optim::Optimizer& optimizer,
                        torch::serialize::OutputArchive& archive) {
  const auto& mine = optimizer.param_groups();
  torch::serialize::OutputArchive groups;
  groups.write("param_groups/size", at::tensor(static_cast<int64_t>(mine.size())));
  for (size_t i = 0; i < mine.size(); ++i) {
    torch::serialize::OutputArchive options;
    mine[i].options().serialize(options);
    torch::serialize::OutputArchive group;
    group.write("options", options);
    groups.write("param_groups/" + std::to_string(i), group);
  }
  archive.write("param_groups", groups);
}

void load_group_options(torch::optim::Optimizer& optimizer,
                        torch::serialize::InputArchive& archive) {
  // The layout that torch/optim/serialize.h writes: param_groups/size, then
  // param_groups/<i>/options, read by the options' own serialize.
  torch::serialize::InputArchive groups;
  if (!archive.try_read("param_groups", groups)) {
    return;
  }
  at::Tensor count;
  groups.read("param_groups/size", count);
  auto& mine = optimizer.param_groups();
  LOCKSTEP_ENFORCE(count.item<int64_t>() == static_cast<int64_t>(mine.size()), CheckpointError,
                   "the saved optimizer has ", count.item<int64_t>(), " parameter groups, this "
                   "one ", mine.size(), ": build it with the same groups as the one saved.");
  for (size_t i = 0; i < mine.size(); ++i) {
    torch::serialize::InputArchive group;
    groups.read("param_groups/" + std::to_string(i), group);
    torch::serialize::InputArchive saved;
    group.read("options", saved);
    auto options = mine[i].options().clone();
    options->serialize(saved);
    mine[i].set_options(std::move(options));
  }
}

} // namespace lockstep::detail
