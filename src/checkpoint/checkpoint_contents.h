#pragma once

// What a checkpoint's payload holds, apart from the file around it: the
// named modules (parameters and buffers, with a signature of the model that
// must match on load), the named optimizers, the extra values, and the
// random generator state of each rank that wrote it.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/checkpoint.h>

namespace lockstep::detail {

/// The payload of the items, `extra`, and `generator_states` (one per rank).
std::string serialize_checkpoint(const CheckpointItems& items,
                                 const CheckpointExtra& extra,
                                 const std::vector<at::Tensor>& generator_states);

struct RestoredCheckpoint {
  CheckpointExtra extra;
  /// The random generator state saved for this rank; undefined when the
  /// checkpoint was written by fewer ranks.
  at::Tensor generator_state;
  /// How many ranks' generator states the checkpoint holds.
  int64_t generator_ranks = 0;
};

/// Restores `payload` into the items' own tensors, after checking that it
/// holds every item, saved from the same model. Raises CheckpointError
/// naming the item and the difference.
RestoredCheckpoint restore_checkpoint(const std::string& path,
                                      const std::string& payload,
                                      const CheckpointItems& items,
                                      int rank);

} // namespace lockstep::detail
