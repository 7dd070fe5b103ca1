#pragma once

// What the shared-memory operations share: views of shared memory as
// tensors, the reduction itself (ATen's kernels, in rank order, so that
// every rank that reduces the same inputs gets the same bits; Gloo's
// 16-bit sums use it as well), and which slice of a tensor each rank owns.

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "transport/shm_ops.h"

namespace lockstep::detail {

/// `elements` of `type` at `data`, as a tensor that does not own them.
at::Tensor view(char* data, int64_t elements, at::ScalarType type);

/// Reduces `inputs` element by element, in rank order, into `out`, which
/// may be inputs[0]'s memory. Float16 and bfloat16 accumulate in float32,
/// in `float_room` (out's size), and round once. Gloo's 16-bit sum
/// (process_group_transport.cpp) reduces the parts it receives here too,
/// so that both transports give the same bits.
void reduce_into(const at::Tensor& out,
                 const std::vector<at::Tensor>& inputs,
                 ReduceOp op,
                 const at::Tensor& float_room);
/// The same, with the context's scratch as the float32 room.
void reduce_into(ShmContext& context,
                 const at::Tensor& out,
                 const std::vector<at::Tensor>& inputs,
                 ReduceOp op);

/// [first, last) of `elements` that rank `index` of `ranks` reduces.
std::pair<int64_t, int64_t> slice_of(int64_t elements, int ranks, int index);

/// "rank(s) 1, 3": the ranks of `context` for which `is_behind` holds.
std::string behind(const ShmContext& context, const std::function<bool(int)>& is_behind);

/// The rounds of a staged operation: takes the open round and the one after
/// it further (`advance_round(i)`, true when round i moved) as long as any
/// moves, `open` passing the rounds whose stage is `done`. True once all
/// `rounds` are done.
template <typename AdvanceRound>
bool advance_rounds(uint64_t& open, uint64_t rounds, const std::vector<int>& stage, int done,
                    AdvanceRound&& advance_round) {
  for (bool moved = true; moved;) {
    moved = false;
    for (uint64_t i = open; i < std::min(open + 2, rounds); ++i) {
      moved |= advance_round(i);
    }
    while (open < rounds && stage[open] == done) {
      ++open;
      moved = true;
    }
  }
  return open == rounds;
}

/// Why round `g` cannot begin: the ranks still reading round g - 2's
/// staging buffers, which it would reuse.
std::string waiting_to_reuse_staging(const ShmContext& context, uint64_t g);

} // namespace lockstep::detail
