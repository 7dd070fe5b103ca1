#pragma once

// Memory that a freed unit's full tensor gave back, kept for the next unit
// gathered, so that a step neither returns memory to the system nor faults
// it in afresh (the page faults of a new 32 MiB block at every gather cost
// more than the gather itself). A few blocks at most: what FsdpOptions'
// budget of gathered units allows.
//
// Units differ in size (one holds an extra layer, gradients may be wider
// than 16-bit parameters): a request takes the smallest kept block that
// holds it, up to twice its size, and a full pool lets its smallest block
// go. So the kept blocks grow to the largest units', which every unit of
// at least half their size shares: a step holds the two largest units, not
// one block of every size. A unit smaller than that (a BatchNorm unit) is
// allocated afresh at each gather; after a gather in full precision (a
// checkpoint under FsdpOptions::param_dtype) the kept blocks stay that
// size, twice what a 16-bit gather needs.

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>

namespace lockstep::detail {

class BufferPool {
 public:
  explicit BufferPool(size_t keep) : keep_(keep) {}

  struct Block {
    size_t bytes;
    at::DataPtr data;
  };

  /// A kept block of `bytes` to twice that on `device`, else a new one of
  /// `bytes` from `allocator` (that device's). The block's size comes back
  /// with it, for the storage to hold (and give back) as its own.
  Block take(size_t bytes, const c10::Device& device, c10::Allocator& allocator) {
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes >= bytes && it->bytes <= 2 * bytes && it->data.device() == device &&
          (best == kept_.end() || it->bytes < best->bytes)) {
        best = it;
      }
    }
    if (best == kept_.end()) {
      return {bytes, allocator.allocate(bytes)};
    }
    Block block = std::move(*best);
    kept_.erase(best);
    return block;
  }

  /// Keeps `data`, a block of `bytes`; past `keep` blocks, the smallest goes.
  void give(at::DataPtr data, size_t bytes) {
    if (keep_ == 0 || !data) {
      return;
    }
    kept_.push_back({bytes, std::move(data)});
    if (kept_.size() > keep_) {
      kept_.erase(std::min_element(kept_.begin(), kept_.end(), [](const auto& a, const auto& b) {
        return a.bytes < b.bytes;
      }));
    }
  }

 private:
  size_t keep_;
  std::vector<Block> kept_;
};

} // namespace lockstep::detail
