#pragma once

// Memory that a freed unit's full tensor gave back, kept for the next unit
// gathered: units of one size take each other's, so that a step neither
// returns memory to the system nor faults it in afresh (the page faults of
// a new 32 MiB block at every gather cost more than the gather itself).
// A few blocks at most: what FsdpOptions' budget of gathered units allows.

#include <cstddef>
#include <utility>
#include <vector>

#include <c10/core/Allocator.h>

namespace lockstep::detail {

class BufferPool {
 public:
  explicit BufferPool(size_t keep) : keep_(keep) {}

  /// A kept block of exactly `bytes` on `device`, else a new one from
  /// `allocator` (that device's).
  at::DataPtr take(size_t bytes, const c10::Device& device, c10::Allocator& allocator) {
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->first == bytes && it->second.device() == device) {
        auto data = std::move(it->second);
        kept_.erase(it);
        return data;
      }
    }
    return allocator.allocate(bytes);
  }

  /// Keeps `data` unless `keep` blocks are kept already (the oldest goes).
  void give(at::DataPtr data, size_t bytes) {
    if (keep_ == 0 || !data) {
      return;
    }
    if (kept_.size() == keep_) {
      kept_.erase(kept_.begin());
    }
    kept_.emplace_back(bytes, std::move(data));
  }

 private:
  size_t keep_;
  std::vector<std::pair<size_t, at::DataPtr>> kept_;
};

} // namespace lockstep::detail
