#pragma once

// Where things are in the shared memory of a host's ranks. Every counter
// is monotonic (a round or operation number, never reset) and sits on a
// cache line of its own, written by one rank only: a rank posts by storing
// a larger number, the others read it, and nothing is ever cleared.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "transport/doorbell.h"
#include "transport/shared_mapping.h"

namespace lockstep::detail {

struct alignas(64) Counter {
  std::atomic<uint64_t> value;

  uint64_t get() const {
    return value.load(std::memory_order_acquire);
  }
  void post(uint64_t number) {
    value.store(number, std::memory_order_release);
  }
};

constexpr size_t kPage = 4096;

inline size_t round_up(size_t bytes, size_t to) {
  return (bytes + to - 1) / to * to;
}

/// The segment of World's own collectives: each is copied in, reduced and
/// copied out through staging buffers, in rounds of at most kStagingBytes.
/// Two sets of buffers, by the parity of the round, so that round g + 1
/// can be copied in while round g is still being read.
struct Staging {
  static constexpr size_t kStagingBytes = size_t{2} << 20;

  static size_t bytes_for(int ranks) {
    return data_offset(ranks) + (2 * static_cast<size_t>(ranks) + 2) * kStagingBytes;
  }
  static size_t data_offset(int ranks) {
    return round_up(sizeof(Doorbell) + 3 * sizeof(Counter) * static_cast<size_t>(ranks), kPage);
  }

  Staging(std::unique_ptr<SharedMapping> mapping_in, int ranks_in)
      : mapping(std::move(mapping_in)), ranks(ranks_in) {}

  Doorbell& bell() const {
    return *reinterpret_cast<Doorbell*>(mapping->data());
  }
  /// Rank r has copied in its part of round g.
  Counter& arrived(int r) const {
    return counter(3 * r);
  }
  /// Rank r has reduced its slice of round g.
  Counter& reduced(int r) const {
    return counter(3 * r + 1);
  }
  /// Rank r has read all it needs of round g: its buffers may be reused.
  Counter& consumed(int r) const {
    return counter(3 * r + 2);
  }
  /// Rank r's input buffer for the rounds of parity `parity`.
  char* input(uint64_t parity, int r) const {
    return data() + (parity * static_cast<size_t>(ranks) + static_cast<size_t>(r)) * kStagingBytes;
  }
  /// The reduced result of the rounds of parity `parity`.
  char* result(uint64_t parity) const {
    return data() + (2 * static_cast<size_t>(ranks) + parity) * kStagingBytes;
  }

  std::unique_ptr<SharedMapping> mapping;
  int ranks;

 private:
  Counter& counter(int index) const {
    return reinterpret_cast<Counter*>(mapping->data() + sizeof(Doorbell))[index];
  }
  char* data() const {
    return mapping->data() + data_offset(ranks);
  }
};

/// A tensor of every rank of the host, side by side in one segment
/// (World::allocate): an all-reduce of it reads and writes the ranks'
/// memory in place. Rank r reduces slice r of every rank's tensor and
/// writes the result into all of them; only rank r ever touches slice r.
struct Arena {
  static size_t bytes_for(int ranks, size_t region_bytes) {
    return header_bytes(ranks) + static_cast<size_t>(ranks) * round_up(region_bytes, kPage);
  }
  static size_t header_bytes(int ranks) {
    return round_up(2 * sizeof(Counter) * static_cast<size_t>(ranks), kPage);
  }

  Arena(std::unique_ptr<SharedMapping> mapping_in, int ranks_in, size_t region_bytes_in)
      : mapping(std::move(mapping_in)),
        ranks(ranks_in),
        region_bytes(round_up(region_bytes_in, kPage)) {}

  /// Rank r's tensor holds its data of operation a.
  Counter& ready(int r) const {
    return reinterpret_cast<Counter*>(mapping->data())[2 * r];
  }
  /// Rank r has written the result of operation a into its slice everywhere.
  Counter& reduced(int r) const {
    return reinterpret_cast<Counter*>(mapping->data())[2 * r + 1];
  }
  char* region(int r) const {
    return mapping->data() + header_bytes(ranks) + static_cast<size_t>(r) * region_bytes;
  }

  std::unique_ptr<SharedMapping> mapping;
  int ranks;
  size_t region_bytes;
  /// Operations begun on this arena, the same count on every rank.
  uint64_t operations = 0;
  /// Whether this rank's last operation on it has completed.
  bool idle = true;
};

} // namespace lockstep::detail
