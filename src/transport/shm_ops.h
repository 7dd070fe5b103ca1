#pragma once

// The collectives of the shared-memory transport, as steps that never
// block: advance() does whatever its peers' posts allow and returns; the
// transport calls it again when a peer rings. Staged operations move data
// through the staging buffers in rounds; an arena all-reduce works in place
// on the ranks' tensors.

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

#include "transport/shm_layout.h"
#include "transport/transport.h"

namespace lockstep::detail {

/// What every operation of one rank shares.
struct ShmContext {
  Staging* staging = nullptr;
  /// This rank's index in its host group, and the group's world ranks.
  int me = 0;
  std::vector<int> ranks;
  /// Rounds begun so far (the same on every rank of the host).
  uint64_t rounds = 0;
  /// Set when this rank posted something: the transport then rings.
  bool posted = false;
  /// float32 room for reducing float16 and bfloat16 in float32.
  at::Tensor scratch(int64_t elements);
  /// The timeline's lanes for collectives across hosts: one span a lane,
  /// so that crossings in flight together appear side by side.
  int take_crossing_lane();
  void free_crossing_lane(int lane);

  int size() const {
    return static_cast<int>(ranks.size());
  }

 private:
  at::Tensor scratch_;
  std::vector<bool> crossing_lanes_;
};

class ShmOp {
 public:
  virtual ~ShmOp() = default;
  /// Advances as far as the peers' posts allow; true once complete.
  virtual bool advance(ShmContext& context) = 0;
  /// The ranks this operation waits for, and what for.
  virtual std::string waiting_for(const ShmContext& context) const = 0;
  /// Whether it waits for something that rings no doorbell (a collective
  /// across hosts): its waiter then looks often instead of sleeping, and
  /// the operations queued after it may begin meanwhile.
  virtual bool waits_outside() const {
    return false;
  }

  bool done = false;
  int64_t completed_ns = 0;
  /// Set when what it waited for outside failed (a host lost): it will
  /// never complete, and its waiters raise this.
  std::exception_ptr failure;
};

enum class StagedKind { AllReduce, Broadcast, AllGather, Barrier };

/// A collective through the staging buffers. `tensor` is the contiguous
/// data reduced or broadcast in place, or this rank's input of a gather;
/// `outputs` the gather's per-rank results.
std::unique_ptr<ShmOp> make_staged_op(ShmContext& context,
                                      StagedKind kind,
                                      at::Tensor tensor,
                                      std::vector<at::Tensor> outputs,
                                      ReduceOp op,
                                      int root_index);

/// A reduce-scatter through the staging buffers: `input` holds one slice of
/// output.numel() elements per rank of the host, and `output` takes this
/// rank's slice reduced over every rank's input.
std::unique_ptr<ShmOp> make_reduce_scatter_op(ShmContext& context,
                                              at::Tensor output,
                                              at::Tensor input,
                                              ReduceOp op);

/// An in-place all-reduce of the arena's tensors; posts this rank's data as
/// ready at once. With `across` (ranks on several hosts), this rank's slice,
/// once reduced within the host, is all-reduced over `across` with the
/// ranks of the same local index on the other hosts before it is pushed to
/// the host's tensors.
std::unique_ptr<ShmOp> make_arena_op(ShmContext& context,
                                     std::shared_ptr<Arena> arena,
                                     at::ScalarType dtype,
                                     int64_t numel,
                                     ReduceOp op,
                                     Transport* across);

} // namespace lockstep::detail
