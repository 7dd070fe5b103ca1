// FullyShardedDataParallel's sharded checkpoint: each rank writes its own
// pieces (parameters and optimizer state) to a file of its own, and rank 0
// an index that names the files and says where each parameter's pieces
// lie; a load at any world size reads, one at a time, the files that hold
// part of this rank's pieces, and keeps that part. No rank holds more than
// its own shard's worth and one file, which is the point: the consolidated
// checkpoint needs the whole model on every rank.
//
// A load changes nothing until every rank has read what it needs: a
// missing, damaged or foreign file is an error on every rank and leaves the
// model as it was.
//
// A save is a generation: its files carry the generation's number, and the
// index, written last, names it. A crash in the middle of a save leaves the
// index of the previous one, whose files are untouched; once the new index
// is in place, the files of every other generation are removed.

#include <filesystem>
#include <map>
#include <regex>
#include <set>
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

// A sanity bound on the world size an index may name.
constexpr int64_t kMostRanks = int64_t{1} << 20;

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
  StateFields fields;
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
StateFields joined(const StateParts& parts) {
  StateFields fields = parts.begin()->second.fields;
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

// The index: which generation, at which world size, each parameter's name,
// shape and dtype (to check the loading model against), and where its
// pieces lie: its offset in its unit's flat tensor and the elements of that
// tensor each rank held, so that a rank opens only the files it needs.
struct Index {
  int64_t generation = 0;
  int64_t ranks = 0;
  struct Parameter {
    std::string name;
    std::vector<int64_t> shape;
    int64_t dtype = 0;
    int64_t unit_offset = 0;
    int64_t per_rank = 0;
  };
  std::vector<Parameter> parameters;
};

Index read_index(const std::string& path, torch::serialize::InputArchive& archive) {
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
  LOCKSTEP_ENFORCE(index.ranks > 0 && index.ranks <= kMostRanks, CheckpointError, path,
                   " names a world of ", index.ranks, " ranks.");
  int64_t count = read_int(archive, "parameters");
  for (int64_t k = 0; k < count; ++k) {
    Index::Parameter parameter;
    parameter.name = read_string(archive, str("name/", k));
    at::Tensor shape;
    archive.read(str("shape/", k), shape);
    parameter.shape.assign(shape.data_ptr<int64_t>(), shape.data_ptr<int64_t>() + shape.numel());
    parameter.dtype = read_int(archive, str("dtype/", k));
    parameter.unit_offset = read_int(archive, str("unit_offset/", k));
    parameter.per_rank = read_int(archive, str("per_rank/", k));
    LOCKSTEP_ENFORCE(parameter.per_rank > 0, CheckpointError, path, " is damaged.");
    index.parameters.push_back(std::move(parameter));
  }
  return index;
}

// Once the index names generation `keep` of `ranks` files, the files beside
// `path` of every other save (the one it replaces, and any that failed or
// crashed, at any world size) and the temp files of crashed writes (the
// index's own too) are no checkpoint's. Best effort: what cannot be
// removed stays, harmless, and the save it follows stands.
void remove_other_generations(const std::string& path, int64_t keep, int64_t ranks) {
  namespace fs = std::filesystem;
  static const std::regex kShardFile(
      R"((?:(\d{1,18})\.rank\d+-of-(\d{1,18})(\.tmp-\d+-\d+)?)|tmp-\d+-\d+)");
  fs::path index(path);
  fs::path folder = index.has_parent_path() ? index.parent_path() : fs::path(".");
  std::string prefix = index.filename().string() + ".";
  std::error_code failed;
  for (fs::directory_iterator it(folder, failed), end; !failed && it != end;
       it.increment(failed)) {
    std::string name = it->path().filename().string();
    std::smatch match;
    std::string rest = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : "";
    if (!std::regex_match(rest, match, kShardFile)) {
      continue;
    }
    bool kept = match[1].matched && !match[3].matched &&
        std::stoll(match[1].str()) == keep && std::stoll(match[2].str()) == ranks;
    if (!kept) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
}

// This rank's file: its pieces, their optimizer state, and the buffers.
void write_pieces(const std::string& path, int64_t number, int shard, int shards,
                  const std::vector<ShardedModel::State::NumberedMember>& members,
                  const torch::optim::Optimizer& optimizer, torch::nn::Module& module) {
  torch::serialize::OutputArchive archive;
  archive.write("format", c10::IValue(std::string(kFormat)));
  archive.write("rank", c10::IValue(static_cast<int64_t>(shard)));
  for (size_t k = 0; k < members.size(); ++k) {
    const auto& member = *members[k].member;
    if (!member.piece.defined()) {
      continue;
    }
    torch::serialize::OutputArchive piece;
    piece.write("start", c10::IValue(member.piece_offset - member.offset));
    // A copy of its own: a view would save the whole shard's storage.
    piece.write("data", member.piece.detach().to(at::kCPU, /*non_blocking=*/false,
                                                 /*copy=*/true));
    if (const auto* state = find_state(optimizer, member.piece)) {
      torch::serialize::OutputArchive fields;
      state->serialize(fields);
      piece.write("state", fields);
    }
    archive.write(str("piece/", k), piece);
  }
  for (const auto& buffer : module.named_buffers()) {
    archive.write("buffer/" + buffer.key(), buffer.value().to(at::kCPU), /*is_buffer=*/true);
  }
  write_archive(shard_path(path, number, shard, shards), shards, archive);
}

} // namespace

void ShardedModel::save_sharded(const std::string& path, torch::nn::Module& module,
                                const torch::optim::Optimizer& optimizer) {
  LOCKSTEP_ENFORCE(!state_->backward_open, UsageError,
                   "FullyShardedDataParallel: save_sharded inside a backward; call it "
                   "between steps.");
  World& world = state_->world;
  // A file per rank of one group (under hybrid sharding every group holds
  // the same pieces; the first group writes them).
  const int shard = state_->shard_world.rank();
  const int shards = state_->shard_world.size();
  const bool writes = !state_->replicas || state_->replicas->rank() == 0;
  auto members = state_->members_in_order();
  // Rank 0 picks the generation: one past the index's, and past any files
  // already there (of a save that failed, or beside an index it cannot
  // read), so that no file of a checkpoint is ever written over.
  Index previous;
  if (world.rank() == 0 && checkpoint_exists(path)) {
    try {
      torch::serialize::InputArchive archive;
      previous = read_index(path, archive);
    } catch (const std::exception&) {
      previous = Index{};
    }
  }
  int64_t number = previous.generation + 1;
  while (world.rank() == 0 && checkpoint_exists(shard_path(path, number, 0, shards))) {
    ++number;
  }
  auto generation = at::tensor({number}, at::kLong);
  world.broadcast(generation, 0, "the generation of the sharded checkpoint " + path);
  number = generation.item<int64_t>();

  std::string error;
  try {
    if (writes) {
      write_pieces(path, number, shard, shards, members, optimizer, module);
    }
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
      index.write("ranks", c10::IValue(static_cast<int64_t>(shards)));
      for (size_t k = 0; k < members.size(); ++k) {
        const auto& member = *members[k].member;
        index.write(str("name/", k), c10::IValue(member.name));
        index.write(str("shape/", k), at::tensor(member.shape, at::kLong));
        index.write(str("dtype/", k),
                    c10::IValue(static_cast<int64_t>(member.param.scalar_type())));
        index.write(str("unit_offset/", k), c10::IValue(member.offset));
        index.write(str("per_rank/", k), c10::IValue(members[k].unit->per_rank()));
      }
      index.write("parameters", c10::IValue(static_cast<int64_t>(members.size())));
      for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
        torch::serialize::OutputArchive options;
        optimizer.param_groups()[g].options().serialize(options);
        index.write(str("group/", g), options);
      }
      write_archive(path, shards, index);
      try {
        remove_other_generations(path, number, shards);
      } catch (const std::exception&) {
        // the checkpoint is complete: files left over are only files
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
  auto members = state_->members_in_order();
  // What is read, kept aside until every rank has read all it needs.
  std::vector<at::Tensor> data(members.size());
  std::vector<int64_t> covered(members.size(), 0);
  std::vector<StateParts> parts(members.size());
  std::map<std::string, at::Tensor> buffers;
  torch::serialize::InputArchive index_archive;
  std::string error;
  try {
    Index index = read_index(path, index_archive);
    LOCKSTEP_ENFORCE(index.parameters.size() == members.size(), CheckpointError, path,
                     " holds ", index.parameters.size(), " parameters and this model has ",
                     members.size(), ": another model.");
    // The old ranks whose files hold part of this rank's pieces.
    std::set<int64_t> needed;
    for (size_t k = 0; k < members.size(); ++k) {
      const auto& member = *members[k].member;
      const auto& saved = index.parameters[k];
      LOCKSTEP_ENFORCE(saved.name == member.name && saved.shape == member.shape &&
                           saved.dtype == static_cast<int64_t>(member.param.scalar_type()),
                       CheckpointError, path, " holds parameter ", k, " as '", saved.name,
                       "' of shape ", c10::IntArrayRef(saved.shape), " and this model has '",
                       member.name, "' of shape ", c10::IntArrayRef(member.shape),
                       " there, or another dtype: another model.");
      if (!member.piece.defined()) {
        continue;
      }
      data[k] = at::empty({member.piece.numel()}, member.piece.options().device(at::kCPU));
      int64_t first = saved.unit_offset + member.piece_offset - member.offset;
      int64_t last = first + member.piece.numel() - 1;
      for (int64_t r = first / saved.per_rank;
           r <= std::min(last / saved.per_rank, index.ranks - 1); ++r) {
        needed.insert(r);
      }
    }
    // Buffers: this rank's own at the same number of shards, rank 0's at
    // another (as DDP's are rank 0's).
    const World& shard_world = state_->shard_world;
    int64_t buffers_from = index.ranks == shard_world.size() ? shard_world.rank() : 0;
    if (!module.named_buffers().is_empty()) {
      needed.insert(buffers_from);
    }
    for (int64_t r : needed) {
      torch::serialize::InputArchive archive;
      open_archive(shard_path(path, index.generation, r, index.ranks), archive);
      for (size_t k = 0; k < members.size(); ++k) {
        const auto& member = *members[k].member;
        torch::serialize::InputArchive saved;
        if (!member.piece.defined() || !archive.try_read(str("piece/", k), saved)) {
          continue;
        }
        int64_t saved_start = read_int(saved, "start");
        at::Tensor values;
        saved.read("data", values);
        int64_t mine_start = member.piece_offset - member.offset;
        int64_t begin = std::max(saved_start, mine_start);
        int64_t end = std::min(saved_start + values.numel(), mine_start + member.piece.numel());
        if (begin >= end) {
          continue;
        }
        data[k].narrow(0, begin - mine_start, end - begin)
            .copy_(values.reshape({-1}).narrow(0, begin - saved_start, end - begin));
        covered[k] += end - begin;
        torch::serialize::InputArchive state;
        if (!saved.try_read("state", state)) {
          continue;
        }
        StatePart part{end - begin, fields_in(state), {}};
        for (auto& [field, value] : part.fields) {
          part.per_element.push_back(per_element(value, values.numel()));
          if (part.per_element.back()) {
            // The saved tensor itself where this part is all of it (each
            // has a storage of its own); a copy of the cut otherwise, lest
            // the state keep (and save again) a larger shard's storage.
            auto cut = value.toTensor().reshape({-1}).narrow(0, begin - saved_start, end - begin);
            bool whole = end - begin == values.numel();
            value = whole ? cut.to(member.piece.device())
                          : cut.to(member.piece.device(), /*non_blocking=*/false, /*copy=*/true);
          }
        }
        parts[k][begin - mine_start] = std::move(part);
      }
      if (r == buffers_from) {
        for (const auto& buffer : module.named_buffers()) {
          at::Tensor saved;
          LOCKSTEP_ENFORCE(archive.try_read("buffer/" + buffer.key(), saved, true),
                           CheckpointError, path, " lacks the buffer '", buffer.key(), "'.");
          LOCKSTEP_ENFORCE(saved.sizes() == buffer.value().sizes(), CheckpointError, path,
                           " holds the buffer '", buffer.key(), "' in another shape.");
          buffers[buffer.key()] = saved;
        }
      }
    }
    for (size_t k = 0; k < members.size(); ++k) {
      const auto& member = *members[k].member;
      LOCKSTEP_ENFORCE(!member.piece.defined() || covered[k] == member.piece.numel(),
                       CheckpointError, path, ": its files lack part of '", member.name,
                       "' (a file of another save in their place?).");
      LOCKSTEP_ENFORCE(parts[k].empty() || covers(parts[k], member.piece.numel()),
                       CheckpointError, path, " lacks the optimizer state of part of '",
                       member.name, "'.");
    }
  } catch (const std::exception& e) {
    error = describe_exception(e);
  }
  agree_on_outcome(world, error, "lockstep: loading the sharded checkpoint " + path);

  // The optimizer: the groups' options (rank 0's, from the index), then each
  // piece's state, one at a time. A piece saved without state starts
  // afresh.
  try {
    for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
      torch::serialize::InputArchive options;
      if (index_archive.try_read(str("group/", g), options)) {
        optimizer.param_groups()[g].options().serialize(options);
      }
    }
    for (auto& group : optimizer.param_groups()) {
      for (const auto& param : group.params()) {
        for (size_t k = 0; k < members.size(); ++k) {
          const auto& piece = members[k].member->piece;
          if (!piece.defined() || !piece.is_same(param)) {
            continue;
          }
          take_state(optimizer, param);
          if (!parts[k].empty()) {
            put_state_fields(optimizer, param, joined(parts[k]));
          }
          parts[k].clear();
        }
      }
    }
  } catch (const std::exception& e) {
    error = describe_exception(e);
  }
  agree_on_outcome(world, error,
                   "lockstep: loading the optimizer state of the sharded checkpoint " + path);

  at::NoGradGuard no_grad;
  for (size_t k = 0; k < members.size(); ++k) {
    if (data[k].defined()) { // read for each piece this rank holds
      members[k].member->piece.copy_(data[k]);
    }
  }
  for (auto& buffer : module.named_buffers()) {
    buffer.value().copy_(buffers.at(buffer.key()));
  }
}

} // namespace lockstep::detail
