// ShardedConstruction (include/lockstep/sharded_construction.h): each unit
// cut to this rank's shard as its constructor returns, and the wrapper's
// check that every rank cut the same values for the same world.

#include <lockstep/sharded_construction.h>

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <lockstep/error.h>
#include <lockstep/fsdp.h>

#include "fsdp/constructed_shard.h"
#include "fsdp/flat_unit.h"
#include "fsdp/unit_registry.h"

namespace lockstep {
namespace {

struct Construction {
  int rank;
  int ranks;
};

thread_local std::optional<Construction> current_construction;

} // namespace

ShardedConstruction::ShardedConstruction(const World& world, const FsdpOptions& options) {
  LOCKSTEP_ENFORCE(!current_construction, UsageError,
                   "a ShardedConstruction lives already on this thread; build the model under "
                   "one.");
  // The wrapper's groups are replica_groups': consecutive ranks, so this
  // rank's place is known without a collective.
  int group = detail::shard_group_size(world, options);
  current_construction = Construction{world.rank() % group, group};
}

ShardedConstruction::~ShardedConstruction() {
  current_construction.reset();
}

namespace detail {
namespace {

bool within(const std::string& module_name, const std::string& unit_name) {
  return module_name == unit_name || module_name.rfind(unit_name + ".", 0) == 0;
}

// The integer type of `tensor`'s element size: its bytes summed as
// integers are exact.
at::ScalarType bits_of(const at::Tensor& tensor) {
  switch (tensor.element_size()) {
    case 1:
      return at::kByte;
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    default:
      return at::kLong;
  }
}

// FlatUnit's parameters of `module` (a declared unit): those of its modules
// that no unit declared inside it holds, each once, in the order of the
// module tree, as the wrapper assigns them.
std::vector<at::Tensor> parameters_of_unit(torch::nn::Module& module) {
  auto modules = module.named_modules("", /*include_self=*/true);
  std::vector<std::string> inner;
  for (const auto& item : modules) {
    if (!item.key().empty() && is_declared_unit(*item.value())) {
      inner.push_back(item.key());
    }
  }
  std::vector<at::Tensor> params;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : modules) {
    if (std::any_of(inner.begin(), inner.end(),
                    [&](const std::string& name) { return within(item.key(), name); })) {
      continue;
    }
    for (const auto& param : item.value()->parameters(/*recurse=*/false)) {
      if (seen.insert(param.unsafeGetTensorImpl()).second) {
        params.push_back(param);
      }
    }
  }
  return params;
}

} // namespace

void shard_at_construction(const std::shared_ptr<torch::nn::Module>& module) {
  if (!current_construction || constructed_shard_of(*module)) {
    return;
  }
  auto params = parameters_of_unit(*module);
  if (params.empty()) {
    return;
  }
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& param : params) {
    named.emplace_back(module->name(), param);
  }
  FlatUnit::check(module->name(), named);
  auto built = std::make_shared<ConstructedShard>();
  built->rank = current_construction->rank;
  built->ranks = current_construction->ranks;
  int64_t total = 0;
  for (const auto& param : params) {
    total += param.numel();
  }
  // FlatUnit's layout: the parameters end to end, padded to a multiple of
  // the world's size.
  const int64_t per_rank = std::max<int64_t>(1, (total + built->ranks - 1) / built->ranks);
  const int64_t mine_first = built->rank * per_rank;
  const int64_t mine_last = mine_first + per_rank;
  at::NoGradGuard no_grad;
  built->shard = at::zeros({per_rank}, params.front().options().requires_grad(false));
  // Everything that can fail comes before any parameter is emptied: a
  // throw leaves the unit whole.
  int64_t offset = 0;
  for (auto& param : params) {
    int64_t first = std::max(offset, mine_first);
    int64_t last = std::min(offset + param.numel(), mine_last);
    if (last > first) {
      built->shard.narrow(0, first - mine_first, last - first)
          .copy_(param.reshape({-1}).narrow(0, first - offset, last - first));
    }
    offset += param.numel();
    // Mixed in order, so that ranks whose parameters hold the same values
    // in another order differ too.
    auto sum = param.reshape({-1}).view(bits_of(param)).sum(at::kLong).item<int64_t>();
    built->checksum = built->checksum * 0x100000001b3ULL ^ static_cast<uint64_t>(sum);
    built->shapes.push_back(param.sizes().vec());
    // Made for a frozen parameter too (a program may unfreeze it before
    // the wrapper, which could then make one only on the empty tensor).
    const bool trainable = param.requires_grad();
    param.requires_grad_(true);
    built->accumulators.push_back(torch::autograd::impl::grad_accumulator(param));
    param.requires_grad_(trainable);
  }
  for (auto& param : params) {
    // The parameter stays (the module and the accumulator hold it); its
    // memory goes.
    param.set_data(at::empty({0}, param.options().requires_grad(false)));
    built->params.push_back(param);
  }
  keep_constructed_shard(*module, std::move(built));
}

int shard_group_size(const World& world, const FsdpOptions& options) {
  if (!options.shard_group_size()) {
    return world.size();
  }
  int group = *options.shard_group_size() == 0 ? world.local_size() : *options.shard_group_size();
  LOCKSTEP_ENFORCE(group > 0 && world.size() % group == 0, ConfigError,
                   "FsdpOptions::shard_group_size: groups of ", group, " ranks do not divide "
                   "the world's ", world.size(), ".");
  return group;
}

std::vector<std::shared_ptr<ConstructedShard>> constructed_shards(
    World& world, const World& shard_world, const std::vector<std::string>& names,
    const std::vector<std::shared_ptr<torch::nn::Module>>& declared,
    const std::vector<std::vector<std::pair<std::string, at::Tensor>>>& params) {
  std::vector<std::shared_ptr<ConstructedShard>> built(names.size());
  // One line per unit that holds parameters: how this rank built it.
  std::ostringstream mine;
  for (size_t u = 1; u < names.size(); ++u) {
    if (params[u].empty()) {
      continue;
    }
    built[u] = constructed_shard_of(*declared[u]);
    if (!built[u]) {
      mine << "in full\n";
      continue;
    }
    const auto& record = *built[u];
    // Still the empty parameters of the build: not replaced, converted, or
    // given values (a checkpoint loaded into them), which the shard, cut
    // from the initial values, would silently undo.
    bool same = record.params.size() == params[u].size();
    for (size_t k = 0; same && k < params[u].size(); ++k) {
      const auto& param = params[u][k].second;
      same = param.unsafeGetTensorImpl() == record.params[k].unsafeGetTensorImpl() &&
          param.numel() == 0 && param.scalar_type() == record.shard.scalar_type() &&
          param.device() == record.shard.device();
    }
    if (!same) {
      mine << "changed\n";
    } else if (record.rank != shard_world.rank() || record.ranks != shard_world.size()) {
      mine << "miscut " << record.ranks << " " << record.rank << " " << shard_world.size() << " "
           << shard_world.rank() << "\n";
    } else {
      mine << "cut " << record.checksum << "\n";
    }
  }
  auto lines_of = [](const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      lines.push_back(line);
    }
    return lines;
  };
  auto every = world.all_gather_strings(mine.str());
  std::vector<std::vector<std::string>> lines;
  for (const auto& text : every) {
    lines.push_back(lines_of(text));
  }
  size_t index = 0;
  for (size_t u = 1; u < names.size(); ++u) {
    if (params[u].empty()) {
      continue;
    }
    // Which ranks built it how (the same units on every rank: the same
    // model).
    std::map<std::string, std::vector<int>> ways;
    for (int rank = 0; rank < world.size(); ++rank) {
      TORCH_INTERNAL_ASSERT(index < lines[rank].size(), "ranks with other units");
      std::string line = lines[rank][index];
      if (line.rfind("miscut ", 0) == 0) {
        std::istringstream in(line.substr(7));
        int cut_ranks = 0, cut_rank = 0, ranks = 0, place = 0;
        in >> cut_ranks >> cut_rank >> ranks >> place;
        LOCKSTEP_FAIL(ConfigError, "FullyShardedDataParallel: ", FlatUnit::describe(names[u]),
                      " was built under a ShardedConstruction for shards of ", cut_ranks,
                      " ranks (as rank ", cut_rank, " of them) and is sharded over ", ranks,
                      " (rank ", rank, " as rank ", place, " of them). Build the model under a "
                      "ShardedConstruction over the wrapper's world, with its FsdpOptions.");
      }
      if (line.rfind("cut ", 0) == 0) {
        line = "with the values of checksum " + line.substr(4);
      }
      ways[line].push_back(rank);
    }
    ++index;
    if (ways.size() == 1) {
      LOCKSTEP_ENFORCE(ways.begin()->first != "changed", ConfigError,
                       "FullyShardedDataParallel: ", FlatUnit::describe(names[u]),
                       " changed after it was built under a ShardedConstruction (its "
                       "parameters replaced, given values such as a checkpoint's, or "
                       "converted to another dtype or device): a module built so keeps only "
                       "empty parameters. Build it in the dtype and on the device it trains "
                       "in (torch::set_default_dtype), and load a checkpoint through the "
                       "wrapper (load_sharded, or summon_full_parameters).");
      continue;
    }
    std::ostringstream how;
    for (const auto& [way, ranks] : ways) {
      how << (how.tellp() > 0 ? "; " : "") << "ranks";
      for (int rank : ranks) {
        how << " " << rank;
      }
      how << ": " << (way == "in full" ? "built in full" : way == "changed" ? "changed since"
                                                                              : way);
    }
    LOCKSTEP_ENFORCE(false, ConfigError, "FullyShardedDataParallel: the ranks built ",
                     FlatUnit::describe(names[u]), " differently (", how.str(), "). Under a "
                     "ShardedConstruction every rank draws the initial values itself: seed "
                     "every rank alike (torch::manual_seed) and build the model on every rank "
                     "under one, in the same order.");
  }
  // The wrapper holds them from here on; the registry lets them go, so
  // that they live no longer than the wrapper, and another wrapper over
  // the module finds none.
  for (size_t u = 1; u < names.size(); ++u) {
    if (built[u]) {
      keep_constructed_shard(*declared[u], nullptr);
    }
  }
  return built;
}

} // namespace detail
} // namespace lockstep
