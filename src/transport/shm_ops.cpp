#include "transport/shm_ops.h"

#include <cstring>

#include <ATen/ATen.h>

#include <lockstep/error.h>

#include "world/rendezvous.h"

namespace lockstep::detail {
namespace {

// A staged all-reduce this small is one round in which every rank reduces
// the whole of it (one synchronisation); a larger round is split, each rank
// reducing a slice that the others then copy (two).
constexpr size_t kOneShotBytes = 256 << 10;
// An arena slice is reduced and written back in pieces that stay in cache
// between the two.
constexpr size_t kArenaChunkBytes = 128 << 10;
// Slices start on a multiple of this many elements (a cache line of
// float32), so that the vectorised kernels see aligned runs.
constexpr int64_t kSliceAlignment = 16;

bool reduced_in_float(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16;
}

at::Tensor view(char* data, int64_t elements, at::ScalarType type) {
  return at::from_blob(data, {elements}, at::TensorOptions().dtype(type));
}

void combine_out(at::Tensor out, const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Average:
      at::add_out(out, a, b);
      return;
    case ReduceOp::Product:
      at::mul_out(out, a, b);
      return;
    case ReduceOp::Min:
      at::minimum_out(out, a, b);
      return;
    case ReduceOp::Max:
      at::maximum_out(out, a, b);
      return;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

// Reduces `inputs` element by element, in rank order, into `out`, which may
// be inputs[0]'s memory. Every rank that reduces the same inputs gets the
// same bits. Float16 and bfloat16 accumulate in float32 and round once.
void reduce_into(ShmContext& context,
                 const at::Tensor& out,
                 const std::vector<at::Tensor>& inputs,
                 ReduceOp op) {
  if (inputs.size() == 1) {
    if (out.data_ptr() != inputs[0].data_ptr()) {
      out.copy_(inputs[0]);
    }
    return;
  }
  if (reduced_in_float(out.scalar_type())) {
    auto sum = context.scratch(out.numel());
    sum.copy_(inputs[0]);
    for (size_t p = 1; p < inputs.size(); ++p) {
      combine_out(sum, sum, inputs[p], op);
    }
    out.copy_(sum);
    return;
  }
  combine_out(out, inputs[0], inputs[1], op);
  for (size_t p = 2; p < inputs.size(); ++p) {
    combine_out(out, out, inputs[p], op);
  }
}

// [first, last) of `elements` that rank `index` of `ranks` reduces.
std::pair<int64_t, int64_t> slice_of(int64_t elements, int ranks, int index) {
  int64_t share = (elements + ranks - 1) / ranks;
  share = (share + kSliceAlignment - 1) / kSliceAlignment * kSliceAlignment;
  int64_t first = std::min(elements, share * index);
  return {first, std::min(elements, first + share)};
}

std::string behind(const ShmContext& context, const std::function<bool(int)>& is_behind) {
  std::vector<int> ranks;
  for (int p = 0; p < context.size(); ++p) {
    if (is_behind(p)) {
      ranks.push_back(context.ranks[p]);
    }
  }
  return "rank(s) " + rank_list(ranks);
}

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
    for (bool moved = true; moved;) {
      moved = false;
      for (uint64_t i = open_; i < std::min(open_ + 2, rounds_); ++i) {
        moved |= advance_round(context, i);
      }
      while (open_ < rounds_ && stage_[open_] == kDone) {
        ++open_;
        moved = true;
      }
    }
    return open_ == rounds_;
  }

  std::string waiting_for(const ShmContext& context) const override {
    if (open_ == rounds_) {
      return "nothing";
    }
    uint64_t g = first_ + open_;
    const auto& staging = *context.staging;
    switch (stage_[open_]) {
      case 0:
        return behind(context, [&](int p) { return g > 2 && staging.consumed(p).get() < g - 2; }) +
            str(" to finish with round ", g - 2, " of the shared-memory staging buffers");
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
        across_work_ = across_->all_reduce(slice(0, first, last), op_);
      }
      phase_ = Phase::Across;
    }
    if (phase_ == Phase::Across) {
      try {
        if (across_work_ && !across_work_->wait_for(std::chrono::milliseconds(0))) {
          return false;
        }
      } catch (...) {
        failure = std::current_exception();
        return false;
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
};

} // namespace

at::Tensor ShmContext::scratch(int64_t elements) {
  if (!scratch_.defined() || scratch_.numel() < elements) {
    scratch_ = at::empty({elements}, at::kFloat);
  }
  return scratch_.narrow(0, 0, elements);
}

std::unique_ptr<ShmOp> make_staged_op(ShmContext& context,
                                      StagedKind kind,
                                      at::Tensor tensor,
                                      std::vector<at::Tensor> outputs,
                                      ReduceOp op,
                                      int root_index) {
  return std::make_unique<StagedOp>(context, kind, std::move(tensor), std::move(outputs), op,
                                    root_index);
}

std::unique_ptr<ShmOp> make_arena_op(ShmContext& context,
                                     std::shared_ptr<Arena> arena,
                                     at::ScalarType dtype,
                                     int64_t numel,
                                     ReduceOp op,
                                     Transport* across) {
  return std::make_unique<ArenaOp>(context, std::move(arena), dtype, numel, op, across);
}

} // namespace lockstep::detail
