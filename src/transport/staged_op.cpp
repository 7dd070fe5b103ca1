// Collectives through the staging buffers, in rounds (shm_layout.h): copy
// in, reduce (each rank a slice, or every rank all of a small round),
// copy out; broadcast and all_gather copy in and out.

#include <cstring>

#include <ATen/ATen.h>

#include <lockstep/error.h>

#include "transport/shm_reduce.h"

namespace lockstep::detail {
namespace {

// A staged all-reduce this small is one round in which every rank reduces
// the whole of it (one synchronisation); a larger round is split, each rank
// reducing a slice that the others then copy (two).
constexpr size_t kOneShotBytes = 256 << 10;

class StagedOp : public ShmOp {
 public:
  StagedOp(ShmContext& context,
           StagedKind kind,
           at::Tensor tensor,
           std::vector<at::Tensor> outputs,
           ReduceOp op,
           int root)
      : kind_(kind),
        tensor_(std::move(tensor)),
        outputs_(std::move(outputs)),
        op_(op),
        root_(root),
        type_(tensor_.defined() ? tensor_.scalar_type() : at::kByte),
        element_bytes_(tensor_.defined() ? tensor_.element_size() : 1),
        elements_(tensor_.defined() ? tensor_.numel() : 0),
        chunk_(static_cast<int64_t>(Staging::kStagingBytes / element_bytes_)) {
    rounds_ = kind_ == StagedKind::Barrier ? 1 : static_cast<uint64_t>((elements_ + chunk_ - 1) / chunk_);
    one_shot_ = static_cast<size_t>(elements_) * element_bytes_ <= kOneShotBytes;
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
    switch (stage_[open_]) {
      case 0:
        return waiting_to_reuse_staging(context, g);
      case 1:
        return behind(context, [&](int p) { return staging.arrived(p).get() < g; }) +
            str(" to copy in their part of round ", g, " (shared memory)");
      default:
        return behind(context, [&](int p) { return staging.reduced(p).get() < g; }) +
            str(" to reduce their slice of round ", g, " (shared memory)");
    }
  }

 private:
  static constexpr int kDone = 3;

  char* at_element(const at::Tensor& tensor, int64_t element) const {
    return static_cast<char*>(tensor.data_ptr()) + element * static_cast<int64_t>(element_bytes_);
  }

  void post(ShmContext& context, Counter& counter, uint64_t g) {
    counter.post(g);
    context.posted = true;
  }

  // Takes round i one stage further if its predecessor and the peers'
  // posts allow; returns whether it did. Posts stay in round order.
  bool advance_round(ShmContext& context, uint64_t i) {
    const auto& staging = *context.staging;
    int me = context.me;
    int ranks = context.size();
    uint64_t g = first_ + i;
    uint64_t parity = g & 1;
    int64_t begin = static_cast<int64_t>(i) * chunk_;
    int64_t length = kind_ == StagedKind::Barrier ? 0 : std::min(chunk_, elements_ - begin);
    size_t bytes = static_cast<size_t>(length) * element_bytes_;
    int before = i == 0 ? kDone : stage_[i - 1];
    auto all = [&](auto counter_of) {
      for (int p = 0; p < ranks; ++p) {
        if ((staging.*counter_of)(p).get() < g) {
          return false;
        }
      }
      return true;
    };
    switch (stage_[i]) {
      case 0: {
        if (before < 1) {
          return false;
        }
        for (int p = 0; p < ranks && g > 2; ++p) {
          if (staging.consumed(p).get() < g - 2) {
            return false; // a peer still reads these buffers
          }
        }
        bool copies_in = kind_ == StagedKind::AllReduce || kind_ == StagedKind::AllGather ||
            (kind_ == StagedKind::Broadcast && me == root_);
        if (copies_in && bytes > 0) {
          std::memcpy(staging.input(parity, me), at_element(tensor_, begin), bytes);
        }
        post(context, staging.arrived(me), g);
        stage_[i] = 1;
        return true;
      }
      case 1: {
        bool two_phase = kind_ == StagedKind::AllReduce && !one_shot_;
        if (before < (two_phase ? 2 : kDone)) {
          return false;
        }
        if (kind_ == StagedKind::Broadcast ? staging.arrived(root_).get() < g
                                           : !all(&Staging::arrived)) {
          return false;
        }
        if (kind_ == StagedKind::AllReduce) {
          auto [first, last] = two_phase ? slice_of(length, ranks, me) : std::pair<int64_t, int64_t>{0, length};
          std::vector<at::Tensor> inputs;
          for (int p = 0; p < ranks; ++p) {
            inputs.push_back(view(staging.input(parity, p) + first * static_cast<int64_t>(element_bytes_),
                                  last - first, type_));
          }
          char* out = two_phase ? staging.result(parity) + first * static_cast<int64_t>(element_bytes_)
                                : at_element(tensor_, begin);
          if (last > first) {
            reduce_into(context, view(out, last - first, type_), inputs, op_);
          }
          if (two_phase) {
            post(context, staging.reduced(me), g);
            stage_[i] = 2;
            return true;
          }
        } else if (kind_ == StagedKind::Broadcast && me != root_ && bytes > 0) {
          std::memcpy(at_element(tensor_, begin), staging.input(parity, root_), bytes);
        } else if (kind_ == StagedKind::AllGather && bytes > 0) {
          for (int p = 0; p < ranks; ++p) {
            std::memcpy(at_element(outputs_[p], begin), staging.input(parity, p), bytes);
          }
        }
        post(context, staging.consumed(me), g);
        stage_[i] = kDone;
        return true;
      }
      case 2: {
        if (before < kDone || !all(&Staging::reduced)) {
          return false;
        }
        std::memcpy(at_element(tensor_, begin), staging.result(parity), bytes);
        post(context, staging.consumed(me), g);
        stage_[i] = kDone;
        return true;
      }
      default:
        return false;
    }
  }

  StagedKind kind_;
  at::Tensor tensor_;
  std::vector<at::Tensor> outputs_;
  ReduceOp op_;
  int root_;
  at::ScalarType type_;
  size_t element_bytes_;
  int64_t elements_;
  int64_t chunk_;
  uint64_t rounds_ = 0;
  uint64_t first_ = 0;
  bool one_shot_ = false;
  uint64_t open_ = 0; // the first round not done
  std::vector<int> stage_;
};

} // namespace

std::unique_ptr<ShmOp> make_staged_op(ShmContext& context,
                                      StagedKind kind,
                                      at::Tensor tensor,
                                      std::vector<at::Tensor> outputs,
                                      ReduceOp op,
                                      int root_index) {
  return std::make_unique<StagedOp>(context, kind, std::move(tensor), std::move(outputs), op,
                                    root_index);
}

} // namespace lockstep::detail
