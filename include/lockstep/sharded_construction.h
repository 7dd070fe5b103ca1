#pragma once

// Building a model larger than one rank. A LibTorch module makes its
// parameters in its constructor, in full; FullyShardedDataParallel then
// keeps each rank's shard. A model whose parameters do not fit one rank
// cannot be built that way. While a ShardedConstruction lives, each
// lockstep::Sharded block keeps only this rank's shard of its parameters as
// soon as its constructor returns, so that a rank holds, besides the
// shards, one unit in full at a time (and what no unit holds, the root):
//
//   torch::manual_seed(0);                        // every rank alike
//   auto model = lockstep::build_sharded<Net>(world);
//   lockstep::FullyShardedDataParallel<Net> fsdp(model, world);
//
// Every rank draws the whole unit's initial values, as a plain build with
// the same seed does, and keeps its part: the wrapper starts from the
// values of `Net()` built in one process after the same seed, without a
// broadcast. It checks that every rank built the same values (a checksum of
// each unit's bytes, taken before sharding) and raises ConfigError on every
// rank where they differ. A module built so is usable only through the
// wrapper: its units' parameters are empty until it gathers them. Build it
// in the dtype and on the device it trains in (torch::set_default_dtype),
// since a conversion after the build reaches only the empty parameters.
// Likewise each unit's initialisation must happen in its own constructor:
// a parent that initialises a unit's parameters after building it (a loop
// over parameters(), module->apply(init)) reaches empty tensors and draws
// no random numbers, so the build no longer matches a plain one (and
// torch::nn::init's xavier_ and kaiming_ raise on an empty tensor).

#include <type_traits>
#include <utility>

#include <lockstep/fsdp_options.h>
#include <lockstep/world.h>

namespace lockstep {

/// See the top of this header. Local: no collective (the wrapper's
/// constructor checks what the ranks built). One at a time on a thread;
/// the units built on other threads meanwhile are built in full.
class ShardedConstruction {
 public:
  /// The units built while it lives are cut as FullyShardedDataParallel
  /// over `world` with `options` will shard them: over the whole world, or
  /// under FsdpOptions::shard_group_size over this rank's group. Raises
  /// UsageError if another lives on this thread, ConfigError for a group
  /// size that does not divide the world.
  explicit ShardedConstruction(const World& world, const FsdpOptions& options = {});
  ~ShardedConstruction();
  ShardedConstruction(const ShardedConstruction&) = delete;
  ShardedConstruction& operator=(const ShardedConstruction&) = delete;
};

namespace detail {
template <typename... Args>
struct FirstIsFsdpOptions : std::false_type {};
template <typename First, typename... Rest>
struct FirstIsFsdpOptions<First, Rest...> : std::is_same<std::decay_t<First>, FsdpOptions> {};
} // namespace detail

/// `ModuleType(args...)` (a module holder such as one TORCH_MODULE makes)
/// built under a ShardedConstruction over `world`.
template <typename ModuleType, typename... Args,
          std::enable_if_t<!detail::FirstIsFsdpOptions<Args...>::value, int> = 0>
ModuleType build_sharded(const World& world, Args&&... args) {
  ShardedConstruction construction(world);
  return ModuleType(std::forward<Args>(args)...);
}

/// The same for a wrapper with `options` (hybrid sharding).
template <typename ModuleType, typename... Args>
ModuleType build_sharded(const World& world, const FsdpOptions& options, Args&&... args) {
  ShardedConstruction construction(world, options);
  return ModuleType(std::forward<Args>(args)...);
}

} // namespace lockstep
