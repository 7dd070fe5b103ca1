#pragma once

// The checkpoint file itself, apart from what it holds: a header (magic,
// world size, payload length, checksum) and the payload, written atomically.
// Both ways stream: a save writes the payload as it is serialised, a load
// reads it where it lies, so that neither holds the file in memory.

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>

namespace lockstep::detail {

/// Writes a checkpoint of `world_size` ranks to `path`, its payload
/// streamed by `write_payload`, through a temp file in the same folder
/// (created afresh, never through a link, with the user's umask): write,
/// fsync, rename, fsync the folder. Whatever happens before the rename,
/// the previous file at `path` is untouched. Raises CheckpointError.
void write_checkpoint_file(const std::string& path,
                           int64_t world_size,
                           const std::function<void(std::ostream&)>& write_payload);

/// A verified checkpoint: its world size and its payload, read in place.
struct CheckpointSource {
  int64_t world_size = 0;
  size_t payload_bytes = 0;
  /// Copies up to `bytes` of the payload from `position` into `into`.
  std::function<size_t(uint64_t position, void* into, size_t bytes)> read;
};

/// Opens and verifies `path` (header, length, checksum), reading it in
/// pieces. Raises CheckpointError saying what is wrong: missing, not a
/// checkpoint, truncated, corrupted.
CheckpointSource open_checkpoint_file(const std::string& path);

/// Verifies bytes already read (by rank 0, for a broadcast); the source
/// reads from `bytes`, which must outlive it.
CheckpointSource checkpoint_in_bytes(const std::string& bytes, const std::string& path);

/// The whole file as bytes, unverified. Raises CheckpointError if unreadable.
std::string read_bytes(const std::string& path);

/// For tests: called after each piece written to the temp file, with the
/// bytes written so far; a test can end the process there to play a crash
/// in the middle of a save.
void set_checkpoint_write_observer(std::function<void(size_t)> observer);

} // namespace lockstep::detail
