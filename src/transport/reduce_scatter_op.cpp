// A reduce-scatter through the staging buffers. Round i carries, from every
// rank, piece i of each rank's slice of the input, the pieces laid side by
// side in the rank's staging input; rank p then reduces piece i of slice p
// from every rank's input straight into its output. Every rank reduces in
// every round, each element is read once from each rank, and nothing is
// copied out: half the traffic of an all-reduce, whose result each rank
// would keep a slice of.

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>

#include <lockstep/error.h>

#include "transport/shm_reduce.h"

namespace lockstep::detail {
namespace {

class ReduceScatterOp : public ShmOp {
 public:
  ReduceScatterOp(ShmContext& context, at::Tensor output, at::Tensor input, ReduceOp op)
      : output_(std::move(output)),
        input_(std::move(input)),
        op_(op),
        type_(output_.scalar_type()),
        element_bytes_(static_cast<int64_t>(output_.element_size())),
        per_rank_(output_.numel()),
        piece_(std::max<int64_t>(1, static_cast<int64_t>(Staging::kStagingBytes) /
                                        element_bytes_ / context.size())) {
    rounds_ = static_cast<uint64_t>((per_rank_ + piece_ - 1) / piece_);
    first_ = context.rounds + 1;
    context.rounds += rounds_;
    stage_.assign(rounds_, 0);
  }

  bool advance(ShmContext& context) override {
    return advance_rounds(open_, rounds_, stage_, kDone,
                          [&](uint64_t i) { return advance_round(context, i); });
  }

  std::string waiting_for(const ShmContext& context) const override {
    if (open_ == rounds_) {
      return "nothing";
    }
    uint64_t g = first_ + open_;
    const auto& staging = *context.staging;
    if (stage_[open_] == 0) {
      return waiting_to_reuse_staging(context, g);
    }
    return behind(context, [&](int p) { return staging.arrived(p).get() < g; }) +
        str(" to copy in their part of round ", g, " of a reduce-scatter (shared memory)");
  }

 private:
  static constexpr int kDone = 2;

  // Round i's piece of each slice: elements [i piece, i piece + length)
  // of the slice.
  int64_t length_of(uint64_t i) const {
    return std::min(piece_, per_rank_ - static_cast<int64_t>(i) * piece_);
  }

  bool advance_round(ShmContext& context, uint64_t i) {
    const auto& staging = *context.staging;
    int me = context.me;
    int ranks = context.size();
    uint64_t g = first_ + i;
    uint64_t parity = g & 1;
    int64_t begin = static_cast<int64_t>(i) * piece_;
    int64_t length = length_of(i);
    auto bytes = static_cast<size_t>(length * element_bytes_);
    int before = i == 0 ? kDone : stage_[i - 1];
    if (stage_[i] == 0) {
      if (before < 1) {
        return false;
      }
      for (int p = 0; p < ranks && g > 2; ++p) {
        if (staging.consumed(p).get() < g - 2) {
          return false; // a peer still reads these buffers
        }
      }
      auto* in = static_cast<const char*>(input_.data_ptr());
      for (int p = 0; p < ranks; ++p) {
        std::memcpy(staging.input(parity, me) + p * length * element_bytes_,
                    in + (p * per_rank_ + begin) * element_bytes_, bytes);
      }
      staging.arrived(me).post(g);
      context.posted = true;
      stage_[i] = 1;
      return true;
    }
    if (stage_[i] != 1 || before < kDone) {
      return false;
    }
    for (int p = 0; p < ranks; ++p) {
      if (staging.arrived(p).get() < g) {
        return false;
      }
    }
    std::vector<at::Tensor> inputs;
    for (int p = 0; p < ranks; ++p) {
      inputs.push_back(view(staging.input(parity, p) + me * length * element_bytes_, length, type_));
    }
    auto* out = static_cast<char*>(output_.data_ptr()) + begin * element_bytes_;
    reduce_into(context, view(out, length, type_), inputs, op_);
    staging.consumed(me).post(g);
    context.posted = true;
    stage_[i] = kDone;
    return true;
  }

  at::Tensor output_;
  at::Tensor input_;
  ReduceOp op_;
  at::ScalarType type_;
  int64_t element_bytes_;
  int64_t per_rank_;
  int64_t piece_;
  uint64_t rounds_ = 0;
  uint64_t first_ = 0;
  uint64_t open_ = 0; // the first round not done
  std::vector<int> stage_;
};

} // namespace

std::unique_ptr<ShmOp> make_reduce_scatter_op(ShmContext& context,
                                              at::Tensor output,
                                              at::Tensor input,
                                              ReduceOp op) {
  return std::make_unique<ReduceScatterOp>(context, std::move(output), std::move(input), op);
}

} // namespace lockstep::detail
