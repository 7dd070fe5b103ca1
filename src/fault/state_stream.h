#pragma once

// The live state, from the rank that holds it to the ranks that rejoin, in
// pieces of bounded size: what a transfer adds in memory on either side is
// one piece (and, on a receiver, one parameter's optimizer state as it is
// loaded), never a second copy of the model or of the optimizer's state.
// Every call is collective over the stream's world, the sender and the
// receivers calling the same functions in the same order; each side digests
// the bytes that travelled, so that a receiver can check them against the
// sender's signed announcement.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

#include "world/job_secret.h"

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace torch::serialize {
class InputArchive;
class OutputArchive;
} // namespace torch::serialize

namespace lockstep::detail {

class StateStream {
 public:
  /// From rank `root` of `world` to its other ranks, in broadcasts of at
  /// most `piece_bytes`; `what` names them in errors.
  StateStream(World& world, int root, size_t piece_bytes, std::string what);
  StateStream(const StateStream&) = delete;
  StateStream& operator=(const StateStream&) = delete;

  bool sending() const { return sending_; }
  /// The root's `size` bytes at `data`, into each receiver's `data`.
  void pass(void* data, size_t size);
  /// The root sends what it still holds; a receiver checks that it read
  /// every byte sent. Then the digest of the bytes that travelled.
  std::string finish();
  /// The bytes that travelled (sent by the root, received by the others).
  uint64_t bytes() const { return bytes_; }

 private:
  void send_piece();
  void receive_piece();

  World& world_;
  int root_;
  bool sending_;
  std::string what_;
  at::Tensor piece_;
  size_t filled_ = 0; // bytes in piece_: buffered (root) or received
  size_t taken_ = 0;  // of those, read out (receivers)
  uint64_t bytes_ = 0;
  int64_t pieces_ = 0;
  Digest digest_;
};

/// The root's `tensors` into the receivers' (alike in shape and dtype on
/// every rank: the same model), in place.
void stream_tensors(StateStream& stream, const std::vector<at::Tensor>& tensors);

/// An archive that the root writes (`save`) and each receiver reads
/// (`load`), streamed as it is written: the root never holds its bytes.
void stream_archive(StateStream& stream,
                    const std::function<void(torch::serialize::OutputArchive&)>& save,
                    const std::function<void(torch::serialize::InputArchive&)>& load);

/// The root's optimizer state into the receivers' optimizer (the same
/// optimizer over the same parameters): its groups' options, then each
/// parameter's state in turn.
void stream_optimizer(StateStream& stream, torch::optim::Optimizer& optimizer);
/// The options of `optimizer`'s groups alone (a learning rate a scheduler
/// set), as stream_optimizer streams them first.
void stream_group_options(StateStream& stream, torch::optim::Optimizer& optimizer);

} // namespace lockstep::detail
