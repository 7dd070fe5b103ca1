// The in-place all-reduce of a tensor that every rank of a host keeps in
// one segment (shm_layout.h's Arena): rank r reduces slice r of all of
// them and writes the sum back into all of them; across hosts, that slice
// is all-reduced with the other hosts' in between.

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>

#include <lockstep/error.h>

#include "timeline/recorder.h"
#include "transport/shm_reduce.h"

namespace lockstep::detail {
namespace {

// An arena slice is reduced and written back in pieces that stay in cache
// between the two.
constexpr size_t kArenaChunkBytes = 128 << 10;

class ArenaOp : public ShmOp {
 public:
  ArenaOp(ShmContext& context,
          std::shared_ptr<Arena> arena,
          at::ScalarType type,
          int64_t elements,
          ReduceOp op,
          Transport* across)
      : arena_(std::move(arena)), type_(type), elements_(elements), op_(op), across_(across) {
    TORCH_INTERNAL_ASSERT(arena_->idle, "an all-reduce of a shared tensor began before the "
                          "previous one on it completed");
    arena_->idle = false;
    number_ = ++arena_->operations;
    arena_->ready(context.me).post(number_);
    context.posted = true;
  }

  bool advance(ShmContext& context) override {
    int ranks = context.size();
    if (phase_ == Phase::Reduce) {
      for (int p = 0; p < ranks; ++p) {
        if (arena_->ready(p).get() < number_) {
          return false;
        }
      }
      reduce_my_slice(context);
      auto [first, last] = slice_of(elements_, ranks, context.me);
      if (across_ != nullptr && last > first) {
        crossing_ = Crossing{timeline::Clock::now(), context.take_crossing_lane(),
                             (last - first) * static_cast<int64_t>(c10::elementSize(type_))};
        across_work_ = across_->all_reduce(slice(0, first, last), op_);
      }
      phase_ = Phase::Across;
    }
    if (phase_ == Phase::Across) {
      try {
        // Only looks: while this slice crosses, the transport goes on with
        // the operations queued after this one.
        if (across_work_ && !across_work_->wait_for(std::chrono::milliseconds(0))) {
          return false;
        }
      } catch (...) {
        failure = std::current_exception();
        return false;
      }
      if (across_work_) {
        crossed(context);
      }
      push_my_slice(context);
      arena_->reduced(context.me).post(number_);
      context.posted = true;
      phase_ = Phase::Complete;
    }
    for (int p = 0; p < ranks; ++p) {
      if (arena_->reduced(p).get() < number_) {
        return false;
      }
    }
    arena_->idle = true;
    return true;
  }

  std::string waiting_for(const ShmContext& context) const override {
    switch (phase_) {
      case Phase::Reduce:
        return behind(context, [&](int p) { return arena_->ready(p).get() < number_; }) +
            " to finish their part of this tensor (shared memory)";
      case Phase::Across:
        return "the ranks of this local index on the other hosts (Gloo): " +
            across_work_->stall();
      default:
        return behind(context, [&](int p) { return arena_->reduced(p).get() < number_; }) +
            " to reduce their slice of this tensor (shared memory)";
    }
  }

  bool waits_outside() const override {
    return phase_ == Phase::Across && across_work_ != nullptr;
  }

 private:
  enum class Phase { Reduce, Across, Complete };

  struct Crossing {
    timeline::Clock::time_point begin;
    int lane = 0;
    int64_t bytes = 0;
  };

  void crossed(ShmContext& context) {
    context.free_crossing_lane(crossing_.lane);
    if (timeline::enabled()) {
      auto end = timeline::Clock::time_point(std::chrono::nanoseconds(across_work_->completed_ns()));
      timeline::record(str("crossing hosts ", crossing_.lane + 1),
                       str("all_reduce of a ", crossing_.bytes >> 10, " KiB slice"),
                       crossing_.begin, std::max(end, crossing_.begin),
                       {{"operation", std::to_string(number_)}});
    }
  }

  at::Tensor slice(int p, int64_t first, int64_t last) const {
    auto element_bytes = static_cast<int64_t>(c10::elementSize(type_));
    return view(arena_->region(p) + first * element_bytes, last - first, type_);
  }

  // Only this rank touches its slice, in every rank's tensor: read all,
  // reduce into rank 0's, in pieces that stay in cache. On one host, each
  // piece is pushed to the others at once, while still in cache.
  void reduce_my_slice(ShmContext& context) {
    int ranks = context.size();
    auto [first, last] = slice_of(elements_, ranks, context.me);
    for (int64_t begin = first; begin < last; begin += chunk()) {
      int64_t end = std::min(last, begin + chunk());
      std::vector<at::Tensor> inputs;
      for (int p = 0; p < ranks; ++p) {
        inputs.push_back(slice(p, begin, end));
      }
      reduce_into(context, inputs[0], inputs, op_);
      if (across_ == nullptr) {
        copy_to_others(context, begin, end);
      }
    }
  }

  // Across hosts the pieces wait for the other hosts' sums first.
  void push_my_slice(ShmContext& context) {
    if (across_ == nullptr) {
      return;
    }
    auto [first, last] = slice_of(elements_, context.size(), context.me);
    copy_to_others(context, first, last);
  }

  void copy_to_others(const ShmContext& context, int64_t first, int64_t last) {
    auto element_bytes = static_cast<int64_t>(c10::elementSize(type_));
    for (int p = 1; p < context.size(); ++p) {
      std::memcpy(arena_->region(p) + first * element_bytes,
                  arena_->region(0) + first * element_bytes,
                  static_cast<size_t>((last - first) * element_bytes));
    }
  }

  int64_t chunk() const {
    return std::max<int64_t>(
        1, static_cast<int64_t>(kArenaChunkBytes / c10::elementSize(type_)));
  }

  std::shared_ptr<Arena> arena_;
  at::ScalarType type_;
  int64_t elements_;
  ReduceOp op_;
  Transport* across_;
  std::unique_ptr<TransportWork> across_work_;
  uint64_t number_ = 0;
  Phase phase_ = Phase::Reduce;
  Crossing crossing_;
};

} // namespace

std::unique_ptr<ShmOp> make_arena_op(ShmContext& context,
                                     std::shared_ptr<Arena> arena,
                                     at::ScalarType dtype,
                                     int64_t numel,
                                     ReduceOp op,
                                     Transport* across) {
  return std::make_unique<ArenaOp>(context, std::move(arena), dtype, numel, op, across);
}

} // namespace lockstep::detail
