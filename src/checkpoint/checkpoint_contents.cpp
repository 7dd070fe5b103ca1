#include "checkpoint/checkpoint_contents.h"

#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <lockstep/grad_scaler.h>
#include <lockstep/power_sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "optim/optimizer_bytes.h"
#include "reducer/model_state.h"

namespace lockstep::detail {
namespace {

// The second layout: items by name. The first (no "format" key) held one
// module and one optimizer under fixed keys; it is still read.
constexpr int64_t kFormat = 2;

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& line : lines) {
    out += line + "\n";
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
  }
  return lines;
}

std::string names_of(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) {
    out += (out.empty() ? "'" : ", '") + name + "'";
  }
  return out.empty() ? "none" : out;
}

void write_module(torch::serialize::OutputArchive& archive, const std::string& prefix,
                  torch::nn::Module& module) {
  std::vector<NamedTensor> params;
  std::vector<NamedTensor> buffers;
  named_state(module, params, buffers);
  archive.write(prefix + "signature", c10::IValue(join(describe_model(params, buffers))));
  int64_t index = 0;
  for (const auto* group : {&params, &buffers}) {
    for (const auto& entry : *group) {
      // From the host: the file does not depend on the device it came from.
      archive.write(prefix + "t" + std::to_string(index++), entry.tensor.detach().to(at::kCPU));
    }
  }
}

void read_module(torch::serialize::InputArchive& archive, const std::string& prefix,
                 torch::nn::Module& module, const std::string& path,
                 const std::string& what) {
  std::vector<NamedTensor> params;
  std::vector<NamedTensor> buffers;
  named_state(module, params, buffers);
  auto mine = describe_model(params, buffers);
  c10::IValue signature;
  archive.read(prefix + "signature", signature);
  auto theirs = lines_of(signature.toStringRef());
  for (size_t i = 0; i < std::max(mine.size(), theirs.size()); ++i) {
    std::string expected = i < mine.size() ? mine[i] : "nothing";
    std::string found = i < theirs.size() ? theirs[i] : "nothing";
    LOCKSTEP_ENFORCE(
        expected == found, CheckpointError, path, " was saved from another model: at entry ",
        i, what, " the checkpoint has ", found, " where this model has ", expected, ".");
  }
  at::NoGradGuard no_grad;
  int64_t index = 0;
  for (const auto* group : {&params, &buffers}) {
    for (const auto& entry : *group) {
      at::Tensor saved;
      archive.read(prefix + "t" + std::to_string(index++), saved);
      entry.tensor.detach().copy_(saved);
    }
  }
}

// Every item present in the file, or an error naming what is missing.
void expect_names(const std::vector<std::string>& saved, const std::vector<std::string>& asked,
                  const char* kind, const std::string& path) {
  std::set<std::string> present(saved.begin(), saved.end());
  std::vector<std::string> missing;
  for (const auto& name : asked) {
    if (present.count(name) == 0) {
      missing.push_back(name);
    }
  }
  LOCKSTEP_ENFORCE(missing.empty(), CheckpointError, path, " holds no ", kind, " named ",
                   names_of(missing), ": its ", kind, "s are ", names_of(saved), ".");
}

template <typename Items>
std::vector<std::string> names(const Items& items) {
  std::vector<std::string> out;
  for (const auto& item : items) {
    out.push_back(item.first);
  }
  return out;
}

} // namespace

std::string serialize_hook_states(const CheckpointItems& items) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, state] : items.hook_states()) {
    torch::serialize::OutputArchive item;
    state->save(item);
    archive.write(name, item);
  }
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

void serialize_checkpoint(const CheckpointItems& items,
                          const CheckpointExtra& extra,
                          const std::vector<at::Tensor>& generator_states,
                          const std::vector<at::Tensor>& hook_states,
                          std::ostream& out) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(kFormat));
  archive.write("modules", c10::IValue(join(names(items.modules()))));
  archive.write("optimizers", c10::IValue(join(names(items.optimizers()))));
  for (const auto& [name, module] : items.modules()) {
    write_module(archive, "module/" + name + "/", *module);
  }
  for (const auto& [name, optimizer] : items.optimizers()) {
    torch::serialize::OutputArchive optimizer_archive;
    optimizer->save(optimizer_archive);
    archive.write("optimizer/" + name, optimizer_archive);
  }
  archive.write("epoch", c10::IValue(extra.epoch));
  archive.write("step", c10::IValue(extra.step));
  std::string value_names;
  std::vector<double> values;
  for (const auto& [name, value] : extra.values) {
    value_names += name + "\n";
    values.push_back(value);
  }
  archive.write("value_names", c10::IValue(value_names));
  archive.write("values", at::tensor(values, at::kDouble));
  archive.write("rng_ranks", c10::IValue(static_cast<int64_t>(generator_states.size())));
  for (size_t rank = 0; rank < generator_states.size(); ++rank) {
    archive.write("rng/" + std::to_string(rank), generator_states[rank]);
  }
  // Every rank's scaler holds the same scale: rank 0's is written.
  archive.write("grad_scalers", c10::IValue(join(names(items.grad_scalers()))));
  for (const auto& [name, scaler] : items.grad_scalers()) {
    torch::serialize::OutputArchive scaler_archive;
    scaler->save(scaler_archive);
    archive.write("grad_scaler/" + name, scaler_archive);
  }
  archive.write("hooks", c10::IValue(join(names(items.hook_states()))));
  for (size_t rank = 0; rank < hook_states.size(); ++rank) {
    archive.write("hooks/" + std::to_string(rank), hook_states[rank]);
  }
  archive.save_to(out);
}

namespace {

at::Device model_device(const CheckpointItems& items) {
  for (const auto& [name, module] : items.modules()) {
    std::vector<NamedTensor> params;
    std::vector<NamedTensor> buffers;
    named_state(*module, params, buffers);
    for (const auto* group : {&params, &buffers}) {
      if (!group->empty()) {
        return group->front().tensor.device();
      }
    }
  }
  return at::kCPU;
}

// Each hook state from this rank's part of the file; at another world size,
// from rank 0's, without its error feedback.
void restore_hook_states(torch::serialize::InputArchive& archive, const std::string& path,
                         const CheckpointItems& items, int rank, int world_size,
                         int64_t saved_ranks, const at::Device& device) {
  c10::IValue value;
  std::vector<std::string> saved;
  if (archive.try_read("hooks", value)) {
    saved = lines_of(value.toStringRef());
  }
  expect_names(saved, names(items.hook_states()), "hook state", path);
  if (items.hook_states().empty()) {
    return;
  }
  bool same_world = saved_ranks == world_size;
  at::Tensor bytes;
  archive.read("hooks/" + std::to_string(same_world ? rank : 0), bytes);
  bytes = bytes.to(at::kCPU);
  torch::serialize::InputArchive states;
  std::istringstream in(std::string(static_cast<const char*>(bytes.data_ptr()),
                                    static_cast<size_t>(bytes.numel())));
  states.load_from(in, device);
  for (const auto& [name, state] : items.hook_states()) {
    torch::serialize::InputArchive item;
    states.read(name, item);
    state->load(item);
    if (!same_world) {
      state->reset_error_feedback();
    }
  }
}

} // namespace

RestoredCheckpoint restore_checkpoint(const std::string& path,
                                      const CheckpointSource& source,
                                      const CheckpointItems& items,
                                      int rank,
                                      int world_size) {
  // Every tensor loads onto the device of the model it returns to, so that
  // a checkpoint saved from a CUDA model loads on a CPU machine, and back
  // (optimizer and hook states included).
  at::Device device = model_device(items);
  torch::serialize::InputArchive archive;
  archive.load_from(source.read, [&source] { return source.payload_bytes; }, device);
  RestoredCheckpoint restored;
  c10::IValue value;
  if (archive.try_read("format", value)) {
    archive.read("modules", value);
    expect_names(lines_of(value.toStringRef()), names(items.modules()), "module", path);
    archive.read("optimizers", value);
    expect_names(lines_of(value.toStringRef()), names(items.optimizers()), "optimizer", path);
    // The scalers' names are checked before anything is loaded.
    std::vector<std::string> saved_scalers;
    if (archive.try_read("grad_scalers", value)) {
      saved_scalers = lines_of(value.toStringRef());
    }
    expect_names(saved_scalers, names(items.grad_scalers()), "grad scaler", path);
    for (const auto& [name, module] : items.modules()) {
      read_module(archive, "module/" + name + "/", *module, path, " of module '" + name + "'");
    }
    for (const auto& [name, optimizer] : items.optimizers()) {
      torch::serialize::InputArchive optimizer_archive;
      archive.read("optimizer/" + name, optimizer_archive);
      load_optimizer(*optimizer, optimizer_archive);
    }
    archive.read("rng_ranks", value);
    restored.generator_ranks = value.toInt();
    if (rank < restored.generator_ranks) {
      archive.read("rng/" + std::to_string(rank), restored.generator_state);
    }
    restore_hook_states(archive, path, items, rank, world_size, restored.generator_ranks,
                        device);
    for (const auto& [name, scaler] : items.grad_scalers()) {
      torch::serialize::InputArchive scaler_archive;
      archive.read("grad_scaler/" + name, scaler_archive);
      scaler->load(scaler_archive);
    }
  } else {
    // The first layout: one module and one optimizer, rank 0's generator.
    LOCKSTEP_ENFORCE(items.grad_scalers().empty(), CheckpointError, path, " is of the first "
                     "layout (one model and one optimizer), which holds no grad scaler.");
    LOCKSTEP_ENFORCE(items.modules().size() == 1 && items.optimizers().size() <= 1,
                     CheckpointError, path, " holds one model and one optimizer, under no "
                     "names; load it with one module and one optimizer.");
    read_module(archive, "", *items.modules()[0].second, path, "");
    if (!items.optimizers().empty()) {
      torch::serialize::InputArchive optimizer_archive;
      archive.read("optimizer", optimizer_archive);
      load_optimizer(*items.optimizers()[0].second, optimizer_archive);
    }
    archive.read("rng", restored.generator_state);
    restored.generator_ranks = 1;
  }
  if (restored.generator_state.defined()) {
    restored.generator_state = restored.generator_state.to(at::kCPU);
  }
  auto& extra = restored.extra;
  archive.read("epoch", value);
  extra.epoch = value.toInt();
  archive.read("step", value);
  extra.step = value.toInt();
  archive.read("value_names", value);
  at::Tensor values;
  archive.read("values", values);
  int64_t position = 0;
  for (const auto& name : lines_of(value.toStringRef())) {
    extra.values[name] = values[position++].item<double>();
  }
  return restored;
}

} // namespace lockstep::detail
