// FullyShardedDataParallel's sharded checkpoint: each rank writes its own
// pieces (parameters and optimizer state) to a file of its own, and rank 0
// an index that names the files; a load at any world size reads the files
// one at a time and keeps what falls in this rank's pieces. No rank ever
// holds more than one file's worth beside its own shard, which is the point:
// the consolidated checkpoint needs the whole model on every rank.
//
// A save is a generation: its files carry the generation's number, and the
// index, written last, names it. A crash in the middle of a save leaves the
// index of the previous one, whose files are untouched; the files of the
// generation before are removed once the new index is in place.

#include <cstdio>
#include <map>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/checkpoint.h>
#include <lockstep/error.h>

#include "checkpoint/agree_on_outcome.h"
#include "checkpoint/checkpoint_file.h"
#include "compat/c10d.h"
#include "fsdp/sharded_model_state.h"
#include "optim/parameter_state.h"

namespace lockstep::detail {
namespace {

constexpr const char* kFormat = "lockstep fsdp sharded 1";

using Fields = std::vector<std::pair<std::string, c10::IValue>>;

std::string shard_path(const std::string& path, int64_t generation, int64_t rank,
                       int64_t ranks) {
  return str(path, ".", generation, ".rank", rank, "-of-", ranks);
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toInt();
}

std::string read_string(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  archive.read(key, value);
  return value.toStringRef();
}

// Reads a file that write_checkpoint_file wrote (header and checksum
// verified) into `archive`.
void open_archive(const std::string& path, torch::serialize::InputArchive& archive) {
  auto source = open_checkpoint_file(path);
  archive.load_from(source.read, [&source] { return source.payload_bytes; }, at::kCPU);
}

void write_archive(const std::string& path, int64_t ranks,
                   torch::serialize::OutputArchive& archive) {
  write_checkpoint_file(path, ranks, [&](std::ostream& out) { archive.save_to(out); });
}

Fields fields_of(torch::serialize::InputArchive& archive) {
  Fields fields;
  for (const auto& key : archive.keys()) {
    c10::IValue value;
    archive.read(key, value);
    fields.emplace_back(key, value);
  }
  return fields;
}

// The tensors of a piece's state that hold one value per element of the
// piece (moments, momentum), told from the rest (step counts) by size.
bool per_element(const c10::IValue& value, int64_t piece_numel) {
  return value.isTensor() && value.toTensor().defined() &&
      value.toTensor().numel() == piece_numel;
}

// What a rank gathers, file by file, of one of its pieces' state: the
// overlapping parts of the saved pieces' states, by where each begins in
// this rank's piece, and which of each part's fields hold one value per
// element (cut to the part, and laid end to end when the parts are joined).
struct StatePart {
  int64_t length = 0;
  Fields fields;
  std::vector<bool> per_element;
};
using StateParts = std::map<int64_t, StatePart>;

// Whether the parts cover a piece of `numel` elements, end to end.
bool covers(const StateParts& parts, int64_t numel) {
  int64_t next = 0;
  for (const auto& [start, part] : parts) {
    if (start != next) {
      return false;
    }
    next += part.length;
  }
  return next == numel;
}

// The state of a piece from its parts, which cover it.
Fields joined(const StateParts& parts) {
  Fields fields = parts.begin()->second.fields;
  for (size_t f = 0; f < fields.size(); ++f) {
    std::vector<at::Tensor> pieces;
    for (const auto& [start, part] : parts) {
      if (f >= part.per_element.size() || !part.per_element[f]) {
        pieces.clear();
        break;
      }
      pieces.push_back(part.fields[f].second.toTensor());
    }
    if (pieces.size() > 1) {
      fields[f].second = at::cat(pieces);
    }
  }
  return fields;
}

// The index: which generation, at which world size, and each parameter's
// name in order, to check the loading model against.
struct Index {
  int64_t generation = 0;
  int64_t ranks = 0;
  std::vector<std::string> names;
};

Index read_index(const std::string& path) {
  torch::serialize::InputArchive archive;
  open_archive(path, archive);
  Index index;
  c10::IValue format;
  LOCKSTEP_ENFORCE(archive.try_read("format", format) && format.isString() &&
                       format.toStringRef() == kFormat,
                   CheckpointError, path,
                   " is not the index of a FullyShardedDataParallel sharded checkpoint (a "
                   "file of save_checkpoint is loaded with load_checkpoint).");
  index.generation = read_int(archive, "generation");
  index.ranks = read_int(archive, "ranks");
  int64_t count = read_int(archive, "parameters");
  for (int64_t k = 0; k < count; ++k) {
    index.names.push_back(read_string(archive, str("name/", k)));
  }
  return index;
}

} // namespace

void ShardedModel::save_sharded(const std::string& path, torch::nn::Module& module,
                                const torch::optim::Optimizer& optimizer) {
  LOCKSTEP_ENFORCE(!state_->backward_open, UsageError,
                   "FullyShardedDataParallel: save_sharded inside a backward; call it "
                   "between steps.");
  World& world = state_->world;
  // Rank 0 picks the generation: one past the index's, where it reads.
  std::string error;
  Index previous;
  if (world.rank() == 0 && checkpoint_exists(path)) {
    try {
      previous = read_index(path);
    } catch (const std::exception&) {
      previous = Index{}; // not ours, or damaged: replaced below
    }
  }
  auto generation = at::tensor({previous.generation + 1}, at::kLong);
  world.broadcast(generation, 0, "the generation of the sharded checkpoint " + path);
  int64_t number = generation.item<int64_t>();

  std::vector<std::string> names;
  try {
    torch::serialize::OutputArchive archive;
    archive.write("format", c10::IValue(std::string(kFormat)));
    archive.write("rank", c10::IValue(static_cast<int64_t>(world.rank())));
    int64_t k = 0;
    for (const auto& unit : state_->units) {
      for (const auto& member : unit->members()) {
        names.push_back(member.name);
        if (!member.piece.defined()) {
          ++k;
          continue;
        }
        torch::serialize::OutputArchive piece;
        piece.write("start", c10::IValue(member.piece_offset - member.offset));
        piece.write("data", member.piece.detach().clone()); // not the whole shard
        if (const auto* state = find_state(optimizer, member.piece)) {
          torch::serialize::OutputArchive fields;
          state->serialize(fields);
          piece.write("state", fields);
        }
        archive.write(str("piece/", k++), piece);
      }
    }
    for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      torch::serialize::OutputArchive options;
      optimizer.param_groups()[g].options().serialize(options);
      archive.write(str("group/", g), options);
    }
    for (const auto& buffer : module.named_buffers()) {
      archive.write("buffer/" + buffer.key(), buffer.value(), /*is_buffer=*/true);
    }
    write_archive(shard_path(path, number, world.rank(), world.size()), world.size(), archive);
  } catch (const std::exception& e) {
    error = describe_exception(e);
  }
  agree_on_outcome(world, error, "lockstep: saving the sharded checkpoint " + path);

  // Every file is in place: the index makes them the checkpoint.
  if (world.rank() == 0) {
    try {
      torch::serialize::OutputArchive index;
      index.write("format", c10::IValue(std::string(kFormat)));
      index.write("generation", c10::IValue(number));
      index.write("ranks", c10::IValue(static_cast<int64_t>(world.size())));
      index.write("parameters", c10::IValue(static_cast<int64_t>(names.size())));
      for (size_t k = 0; k < names.size(); ++k) {
        index.write(str("name/", k), c10::IValue(names[k]));
      }
      write_archive(path, world.size(), index);
      for (int64_t r = 0; r < previous.ranks; ++r) {
        std::remove(shard_path(path, previous.generation, r, previous.ranks).c_str());
      }
    } catch (const std::exception& e) {
      error = describe_exception(e);
    }
  }
  agree_on_outcome(world, error, "lockstep: saving the sharded checkpoint " + path);
}

void ShardedModel::load_sharded(const std::string& path, torch::nn::Module& module,
                                torch::optim::Optimizer& optimizer) {
  LOCKSTEP_ENFORCE(!state_->backward_open, UsageError,
                   "FullyShardedDataParallel: load_sharded inside a backward; call it "
                   "between steps.");
  World& world = state_->world;
  std::vector<const FlatUnit::Member*> members;
  for (const auto& unit : state_->units) {
    for (const auto& member : unit->members()) {
      members.push_back(&member);
    }
  }
  std::vector<StateParts> parts(members.size());
  std::string error;
  try {
    Index index = read_index(path);
    LOCKSTEP_ENFORCE(index.names.size() == members.size(), CheckpointError, path, " holds ",
                     index.names.size(), " parameters and this model has ", members.size(),
                     ".");
    for (size_t k = 0; k < members.size(); ++k) {
      LOCKSTEP_ENFORCE(index.names[k] == members[k]->name, CheckpointError, path,
                       " holds parameter ", k, " as '", index.names[k], "' and this model "
                       "has '", members[k]->name, "' there: another model.");
    }
    at::NoGradGuard no_grad;
    // Buffers as rank 0 saved them at another world size (as DDP's are
    // rank 0's), and each rank's own at the same.
    int64_t buffers_from = index.ranks == world.size() ? world.rank() : 0;
    for (int64_t r = 0; r < index.ranks; ++r) {
      torch::serialize::InputArchive archive;
      open_archive(shard_path(path, index.generation, r, index.ranks), archive);
      for (size_t k = 0; k < members.size(); ++k) {
        const auto& member = *members[k];
        torch::serialize::InputArchive saved;
        if (!member.piece.defined() || !archive.try_read(str("piece/", k), saved)) {
          continue;
        }
        int64_t saved_start = read_int(saved, "start");
        at::Tensor data;
        saved.read("data", data);
        int64_t mine_start = member.piece_offset - member.offset;
        int64_t begin = std::max(saved_start, mine_start);
        int64_t end = std::min(saved_start + data.numel(), mine_start + member.piece.numel());
        if (begin >= end) {
          continue;
        }
        member.piece.narrow(0, begin - mine_start, end - begin)
            .copy_(data.narrow(0, begin - saved_start, end - begin));
        torch::serialize::InputArchive state;
        if (!saved.try_read("state", state)) {
          continue;
        }
        StatePart part{end - begin, fields_of(state), {}};
        for (auto& [field, value] : part.fields) {
          part.per_element.push_back(per_element(value, data.numel()));
          if (part.per_element.back()) {
            value = value.toTensor().reshape({-1}).narrow(0, begin - saved_start, end - begin)
                        .clone();
          }
        }
        parts[k][begin - mine_start] = std::move(part);
      }
      if (r == 0) {
        for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
          torch::serialize::InputArchive options;
          if (archive.try_read(str("group/", g), options)) {
            optimizer.param_groups()[g].options().serialize(options);
          }
        }
      }
      if (r == buffers_from) {
        for (auto& buffer : module.named_buffers()) {
          at::Tensor saved;
          if (archive.try_read("buffer/" + buffer.key(), saved, /*is_buffer=*/true)) {
            buffer.value().copy_(saved);
          }
        }
      }
    }
    // Each piece's state, put together from its parts, reaches the
    // optimizer through torch::optim's own load, which knows the state's
    // type: an archive in its format, this optimizer's groups, with states
    // for the pieces that had one.
    torch::serialize::OutputArchive states;
    torch::serialize::OutputArchive groups;
    int64_t key = 0;
    bool any = false;
    groups.write("param_groups/size", at::tensor(static_cast<int64_t>(
                                          optimizer.param_groups().size())));
    for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      const auto& params = optimizer.param_groups()[g].params();
      torch::serialize::OutputArchive group;
      group.write("params/size", at::tensor(static_cast<int64_t>(params.size())));
      for (size_t i = 0; i < params.size(); ++i) {
        std::string name = std::to_string(++key);
        group.write(str("params/", i), c10::IValue(name));
        for (size_t k = 0; k < members.size(); ++k) {
          if (!members[k]->piece.defined() || !members[k]->piece.is_same(params[i]) ||
              parts[k].empty()) {
            continue;
          }
          LOCKSTEP_ENFORCE(covers(parts[k], params[i].numel()), CheckpointError, path,
                           " lacks the optimizer state of part of ", members[k]->name, ".");
          torch::serialize::OutputArchive state;
          for (const auto& [field, value] : joined(parts[k])) {
            state.write(field, value);
          }
          states.write(name, state);
          any = true;
        }
      }
      torch::serialize::OutputArchive options;
      optimizer.param_groups()[g].options().serialize(options);
      group.write("options", options);
      groups.write(str("param_groups/", g), group);
    }
    if (any) {
      torch::serialize::OutputArchive whole;
      whole.write("pytorch_version", c10::IValue(std::string("1.5.0")));
      whole.write("state", states);
      whole.write("param_groups", groups);
      std::ostringstream bytes;
      whole.save_to(bytes);
      std::istringstream in(bytes.str());
      torch::serialize::InputArchive reading;
      reading.load_from(in);
      optimizer.load(reading);
    }
  } catch (const std::exception& e) {
    error = describe_exception(e);
  }
  agree_on_outcome(world, error, "lockstep: loading the sharded checkpoint " + path);
}

} // namespace lockstep::detail
