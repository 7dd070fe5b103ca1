#pragma once

namespace lockstep {

/// How much lockstep checks and tells on stderr. Set with LOCKSTEP_DEBUG
/// (OFF, INFO, DETAIL), WorldOptions::debug or DdpOptions::debug.
enum class DebugLevel {
  Off,
  /// DistributedDataParallel logs its bucket layout at construction and
  /// after the rebuild, and the parameters unused on this rank in each
  /// iteration where they change.
  Info,
  /// Info, and before every collective the ranks compare, through the
  /// store, what each is about to do: a mismatch is a CollectiveError naming
  /// both sides, instead of a hang or silently mixed tensors.
  Detail,
};

} // namespace lockstep
