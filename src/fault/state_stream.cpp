#include "fault/state_stream.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <lockstep/error.h>

#include "common/wording.h"
#include "optim/optimizer_bytes.h"
#include "optim/parameter_state.h"

namespace lockstep::detail {

StateStream::StateStream(World& world, int root, size_t piece_bytes, std::string what)
    : world_(world),
      root_(root),
      sending_(world.rank() == root),
      what_(std::move(what)),
      piece_(at::empty({static_cast<int64_t>(std::max<size_t>(piece_bytes, 64))}, at::kByte)) {}

void StateStream::pass(void* data, size_t size) {
  auto* bytes = static_cast<uint8_t*>(data);
  auto* piece = piece_.data_ptr<uint8_t>();
  auto capacity = static_cast<size_t>(piece_.numel());
  while (size > 0) {
    size_t length = 0;
    if (sending_) {
      if (filled_ == capacity) {
        send_piece();
      }
      length = std::min(size, capacity - filled_);
      std::memcpy(piece + filled_, bytes, length);
      filled_ += length;
    } else {
      if (taken_ == filled_) {
        receive_piece();
      }
      length = std::min(size, filled_ - taken_);
      std::memcpy(bytes, piece + taken_, length);
      taken_ += length;
    }
    bytes += length;
    size -= length;
  }
}

// A piece is its length, then its bytes; a length of 0 ends the stream, so
// that a receiver that expects more or less than was sent fails at once
// rather than in a broadcast that its sender never joins.
void StateStream::send_piece() {
  auto length = at::full({1}, static_cast<int64_t>(filled_), at::kLong);
  world_.broadcast(length, root_, str("the length of piece ", pieces_, " of ", what_));
  if (filled_ == 0) {
    return;
  }
  auto bytes = piece_.narrow(0, 0, static_cast<int64_t>(filled_));
  world_.broadcast(bytes, root_, str("piece ", pieces_, " of ", what_));
  digest_.add(piece_.data_ptr(), filled_);
  bytes_ += filled_;
  ++pieces_;
  filled_ = 0;
}

void StateStream::receive_piece() {
  auto length = at::zeros({1}, at::kLong);
  world_.broadcast(length, root_, str("the length of piece ", pieces_, " of ", what_));
  auto size = length.item<int64_t>();
  LOCKSTEP_ENFORCE(size > 0, CollectiveError, what_, " ended after ", bytes_, " bytes, before "
                   "all that this rank expects: its sender holds another model or optimizer "
                   "(build the same on every rank).");
  LOCKSTEP_ENFORCE(size <= piece_.numel(), CollectiveError, "piece ", pieces_, " of ", what_,
                   " is ", size, " bytes long, more than the ", piece_.numel(), " of this "
                   "rank's pieces: set the same FaultToleranceOptions on every rank.");
  auto bytes = piece_.narrow(0, 0, size);
  world_.broadcast(bytes, root_, str("piece ", pieces_, " of ", what_));
  digest_.add(piece_.data_ptr(), static_cast<size_t>(size));
  bytes_ += static_cast<uint64_t>(size);
  ++pieces_;
  filled_ = static_cast<size_t>(size);
  taken_ = 0;
}

std::string StateStream::finish() {
  if (sending_) {
    if (filled_ > 0) {
      send_piece();
    }
    send_piece(); // empty: the end
  } else {
    LOCKSTEP_ENFORCE(taken_ == filled_, CollectiveError, what_, " brought ",
                     filled_ - taken_, " bytes more than this rank expects: its sender holds "
                     "another model or optimizer (build the same on every rank).");
    auto length = at::zeros({1}, at::kLong);
    world_.broadcast(length, root_, str("the length of piece ", pieces_, " of ", what_));
    LOCKSTEP_ENFORCE(length.item<int64_t>() == 0, CollectiveError, what_, " goes on after "
                     "all that this rank expects: its sender holds another model or optimizer "
                     "(build the same on every rank).");
  }
  return digest_.finish();
}

void stream_tensors(StateStream& stream, const std::vector<at::Tensor>& tensors) {
  at::NoGradGuard no_grad;
  for (const auto& tensor : tensors) {
    auto plain = tensor.detach();
    if (plain.is_contiguous() && plain.device().is_cpu()) {
      stream.pass(plain.data_ptr(), plain.nbytes());
      continue;
    }
    // One tensor's copy at a time (strided, or on a GPU).
    auto host = plain.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    stream.pass(host.data_ptr(), host.nbytes());
    if (!stream.sending()) {
      plain.copy_(host);
    }
  }
}

void stream_archive(StateStream& stream,
                    const std::function<void(torch::serialize::OutputArchive&)>& save,
                    const std::function<void(torch::serialize::InputArchive&)>& load) {
  // Framed as it is written (its length is known only at its end): each
  // write's length and bytes, then a length of 0.
  uint64_t length = 0;
  if (stream.sending()) {
    torch::serialize::OutputArchive archive;
    save(archive);
    archive.save_to([&](const void* data, size_t size) -> size_t {
      if (size > 0) {
        length = size;
        stream.pass(&length, sizeof(length));
        stream.pass(const_cast<void*>(data), size);
      }
      return size;
    });
    length = 0;
    stream.pass(&length, sizeof(length));
    return;
  }
  std::string bytes;
  while (true) {
    stream.pass(&length, sizeof(length));
    if (length == 0) {
      break;
    }
    auto at = bytes.size();
    bytes.resize(at + length);
    stream.pass(bytes.data() + at, length);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  load(archive);
}

void stream_group_options(StateStream& stream, torch::optim::Optimizer& optimizer) {
  stream_archive(
      stream, [&](torch::serialize::OutputArchive& archive) { save_group_options(optimizer, archive); },
      [&](torch::serialize::InputArchive& archive) { load_group_options(optimizer, archive); });
}

void stream_optimizer(StateStream& stream, torch::optim::Optimizer& optimizer) {
  stream_group_options(stream, optimizer);
  // A received state is made of the optimizer's own state type: the first
  // through the optimizer's loading (which knows the type), the others as
  // a clone of it with every field replaced. Only where a state has the
  // same fields as that first one: a field left out (an undefined tensor
  // is not saved) would otherwise keep the first one's.
  const torch::optim::OptimizerParamState* prototype = nullptr;
  std::vector<std::string> prototype_fields;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      uint8_t has_state = stream.sending() && find_state(optimizer, param) != nullptr ? 1 : 0;
      stream.pass(&has_state, sizeof(has_state));
      if (has_state == 0) {
        if (!stream.sending()) {
          take_state(optimizer, param);
        }
        continue;
      }
      stream_archive(
          stream,
          [&](torch::serialize::OutputArchive& archive) {
            find_state(optimizer, param)->serialize(archive);
          },
          [&](torch::serialize::InputArchive& archive) {
            auto fields = archive.keys();
            if (prototype != nullptr && fields == prototype_fields) {
              auto state = prototype->clone();
              state->serialize(archive);
              put_state(optimizer, param, std::move(state));
              return;
            }
            put_state_fields(optimizer, param, fields_in(archive));
            prototype = find_state(optimizer, param);
            prototype_fields = std::move(fields);
          });
    }
  }
}

} // namespace lockstep::detail
