#pragma once

// Memory that the ranks of one host map together. By default an anonymous
// memory file (memfd_create): no mount bounds it (Docker's 64 MiB /dev/shm
// does not apply), nothing of it ever appears in /dev/shm, and it vanishes
// with the last process that maps it, whatever way that process ends. With
// LOCKSTEP_SHM_DIR set, a file in that folder instead (checked for room
// first, unlinked the moment it is created). Either way the creating rank
// hands the open file to the processes of the other ranks, and to no one
// else (transport/fd_handover.h): the store, which others may write to,
// only says where to ask. Every page is reserved at creation, so that a
// lack of memory is an error then, never a SIGBUS in a collective.

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

class SharedMapping {
 public:
  SharedMapping(void* data, size_t bytes) : data_(data), bytes_(bytes) {}
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  char* data() const {
    return static_cast<char*>(data_);
  }
  size_t bytes() const {
    return bytes_;
  }

 private:
  void* data_;
  size_t bytes_;
};

/// The ranks of one host that share memory, and this rank's place among
/// them.
struct HostGroup {
  std::vector<int> ranks; // world ranks, ascending; ranks[0] creates
  /// Each rank's process id, as rendezvous learned it: the only processes
  /// that may hand over or receive the group's memory.
  std::vector<int> pids;
  int index = 0; // this rank's position in `ranks`
  std::chrono::milliseconds timeout{0};
  /// Whether the process of the rank at this position is gone.
  std::function<bool(size_t)> gone;
};

/// Collective among `group`: the first rank creates a zero-filled mapping
/// of `bytes` and the others map it, meeting under `key` in `store`. Every
/// rank of the group returns the mapping, or, if any rank could not create
/// or map it in time, the same reason why not: the first rank decides, and
/// the others follow its verdict. A rank of the group whose process is gone
/// is a CollectiveError naming it, on every rank.
struct SharedMappingResult {
  std::unique_ptr<SharedMapping> mapping;
  std::string failure;
};
SharedMappingResult share_mapping(c10d::Store& store,
                                  const std::string& key,
                                  const HostGroup& group,
                                  size_t bytes);

} // namespace lockstep::detail
