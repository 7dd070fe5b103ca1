#pragma once

// The checkpoint file itself, apart from what it holds: a header (magic,
// world size, payload length, checksum) and the payload, written atomically.

#include <cstdint>
#include <functional>
#include <string>

namespace lockstep::detail {

struct CheckpointFile {
  int64_t world_size = 0;
  std::string payload;
};

/// Writes `file` to `path` through a temp file in the same folder: write,
/// fsync, rename, fsync the folder. Whatever happens before the rename, the
/// previous file at `path` is untouched. Raises CheckpointError.
void write_checkpoint_file(const std::string& path, const CheckpointFile& file);

/// Reads and verifies `path`. Raises CheckpointError saying what is wrong:
/// missing, not a checkpoint, truncated, corrupted.
CheckpointFile read_checkpoint_file(const std::string& path);

/// Verifies bytes already read (by rank 0, for a broadcast).
CheckpointFile parse_checkpoint_bytes(const std::string& bytes, const std::string& path);

/// The whole file as bytes, unverified. Raises CheckpointError if unreadable.
std::string read_bytes(const std::string& path);

/// For tests: called after each chunk written to the temp file, with the
/// bytes written so far and the total; a test can end the process there to
/// play a crash in the middle of a save.
void set_checkpoint_write_observer(std::function<void(size_t, size_t)> observer);

} // namespace lockstep::detail
