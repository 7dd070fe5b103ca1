#pragma once

// What a checkpoint's payload holds, apart from the file around it: the
// named modules (parameters and buffers, with a signature of the model that
// must match on load), the named optimizers, the extra values, and the
// random generator state of each rank that wrote it.

#include <iosfwd>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/checkpoint.h>

#include "checkpoint/checkpoint_file.h"

namespace lockstep::detail {

/// Writes to `out` the payload of the items, `extra`, `generator_states`
/// (one per rank) and `hook_states` (one per rank, as serialize_hook_states
/// made them; none when the items hold no hook state), streamed from the
/// items' own tensors.
void serialize_checkpoint(const CheckpointItems& items,
                          const CheckpointExtra& extra,
                          const std::vector<at::Tensor>& generator_states,
                          const std::vector<at::Tensor>& hook_states,
                          std::ostream& out);

/// This rank's hook states, as bytes.
std::string serialize_hook_states(const CheckpointItems& items);

struct RestoredCheckpoint {
  CheckpointExtra extra;
  /// The random generator state saved for this rank; undefined when the
  /// checkpoint was written by fewer ranks.
  at::Tensor generator_state;
  /// How many ranks' generator states the checkpoint holds.
  int64_t generator_ranks = 0;
};

/// Restores the payload of `source` into the items' own tensors, after
/// checking that it holds every item, saved from the same model. Raises
/// CheckpointError naming the item and the difference.
RestoredCheckpoint restore_checkpoint(const std::string& path,
                                      const CheckpointSource& source,
                                      const CheckpointItems& items,
                                      int rank,
                                      int world_size);

} // namespace lockstep::detail
