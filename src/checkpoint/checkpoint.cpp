#include <lockstep/checkpoint.h>

#include <sys/stat.h>

#include <cstring>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "checkpoint/checkpoint_file.h"
#include "reducer/model_state.h"
#include "world/torch_compat.h"

namespace lockstep {
namespace {

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& line : lines) {
    out += line + "\n";
  }
  return out;
}

std::string serialize(
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    const CheckpointExtra& extra) {
  std::vector<detail::NamedTensor> params;
  std::vector<detail::NamedTensor> buffers;
  detail::named_state(module, params, buffers);
  torch::serialize::OutputArchive archive;
  archive.write("signature", c10::IValue(join(detail::describe_model(params, buffers))));
  int64_t index = 0;
  for (const auto* group : {&params, &buffers}) {
    for (const auto& entry : *group) {
      archive.write("t" + std::to_string(index++), entry.tensor.detach());
    }
  }
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("epoch", c10::IValue(extra.epoch));
  archive.write("step", c10::IValue(extra.step));
  std::string names;
  std::vector<double> values;
  for (const auto& [name, value] : extra.values) {
    names += name + "\n";
    values.push_back(value);
  }
  archive.write("value_names", c10::IValue(names));
  archive.write("values", torch::tensor(values, torch::kDouble));
  archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

// Restores into the module's own tensors, after checking that the
// checkpoint describes this very model.
CheckpointExtra restore(
    const std::string& path,
    const detail::CheckpointFile& file,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive archive;
  std::istringstream in(file.payload);
  archive.load_from(in);

  std::vector<detail::NamedTensor> params;
  std::vector<detail::NamedTensor> buffers;
  detail::named_state(module, params, buffers);
  auto mine = detail::describe_model(params, buffers);
  c10::IValue signature;
  archive.read("signature", signature);
  std::vector<std::string> theirs;
  std::istringstream lines(signature.toStringRef());
  for (std::string line; std::getline(lines, line);) {
    theirs.push_back(line);
  }
  for (size_t i = 0; i < std::max(mine.size(), theirs.size()); ++i) {
    std::string expected = i < mine.size() ? mine[i] : "nothing";
    std::string found = i < theirs.size() ? theirs[i] : "nothing";
    LOCKSTEP_ENFORCE(
        expected == found, CheckpointError, path, " was saved from another "
        "model: at entry ", i, " the checkpoint has ", found,
        " where this model has ", expected, ".");
  }

  torch::NoGradGuard no_grad;
  int64_t index = 0;
  for (const auto* group : {&params, &buffers}) {
    for (const auto& entry : *group) {
      torch::Tensor saved;
      archive.read("t" + std::to_string(index++), saved);
      entry.tensor.detach().copy_(saved);
    }
  }
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);

  CheckpointExtra extra;
  extra.world_size = file.world_size;
  c10::IValue value;
  archive.read("epoch", value);
  extra.epoch = value.toInt();
  archive.read("step", value);
  extra.step = value.toInt();
  archive.read("value_names", value);
  torch::Tensor values;
  archive.read("values", values);
  std::istringstream names(value.toStringRef());
  int64_t position = 0;
  for (std::string name; std::getline(names, name);) {
    extra.values[name] = values[position++].item<double>();
  }
  torch::Tensor rng;
  archive.read("rng", rng);
  auto generator = at::detail::getDefaultCPUGenerator();
  generator.set_state(rng);
  return extra;
}

// Every rank learns whether every rank succeeded, and raises together.
void agree(World& world, const std::string& my_error, const std::string& what) {
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


} // namespace

void save_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    const CheckpointExtra& extra) {
  std::string error;
  if (world.rank() == 0) {
    try {
      detail::write_checkpoint_file(
          path, {world.size(), serialize(module, optimizer, extra)});
    } catch (const std::exception& e) {
      error = detail::describe_exception(e);
    }
  }
  agree(world, error, "lockstep: saving the checkpoint " + path);
}

CheckpointExtra load_checkpoint(
    World& world,
    const std::string& path,
    torch::nn::Module& module,
    torch::optim::Optimizer& optimizer,
    CheckpointRead read) {
  std::string bytes;
  std::string error;
  if (read == CheckpointRead::EveryRank || world.rank() == 0) {
    try {
      bytes = detail::read_bytes(path);
    } catch (const std::exception& e) {
      error = detail::describe_exception(e);
    }
  }
  if (read == CheckpointRead::RankZeroBroadcasts) {
    agree(world, error, "lockstep: reading the checkpoint " + path);
    auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
    world.broadcast(size, 0);
    auto data = torch::empty({size.item<int64_t>()}, torch::kByte);
    if (world.rank() == 0) {
      std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
    }
    world.broadcast(data, 0);
    bytes.assign(static_cast<const char*>(data.data_ptr()), data.numel());
  }
  CheckpointExtra extra;
  if (error.empty()) {
    try {
      extra = restore(path, detail::parse_checkpoint_bytes(bytes, path), module, optimizer);
    } catch (const std::exception& e) {
      error = detail::describe_exception(e);
    }
  }
  agree(world, error, "lockstep: loading the checkpoint " + path);
  return extra;
}

bool checkpoint_exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode);
}

} // namespace lockstep
