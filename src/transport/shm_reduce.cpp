#include "transport/shm_reduce.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "common/wording.h"

namespace lockstep::detail {
namespace {

// Slices start on a multiple of this many elements (a cache line of
// float32), so that the vectorised kernels see aligned runs.
constexpr int64_t kSliceAlignment = 16;

bool reduced_in_float(at::ScalarType type) {
  return type == at::kHalf || type == at::kBFloat16;
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

} // namespace

at::Tensor ShmContext::scratch(int64_t elements) {
  if (!scratch_.defined() || scratch_.numel() < elements) {
    scratch_ = at::empty({elements}, at::kFloat);
  }
  return scratch_.narrow(0, 0, elements);
}

int ShmContext::take_crossing_lane() {
  auto free = std::find(crossing_lanes_.begin(), crossing_lanes_.end(), false);
  if (free == crossing_lanes_.end()) {
    free = crossing_lanes_.insert(free, false);
  }
  *free = true;
  return static_cast<int>(free - crossing_lanes_.begin());
}

void ShmContext::free_crossing_lane(int lane) {
  crossing_lanes_.at(static_cast<size_t>(lane)) = false;
}

at::Tensor view(char* data, int64_t elements, at::ScalarType type) {
  return at::from_blob(data, {elements}, at::TensorOptions().dtype(type));
}

void reduce_into(ShmContext& context,
                 const at::Tensor& out,
                 const std::vector<at::Tensor>& inputs,
                 ReduceOp op) {
  bool needs_room = inputs.size() > 1 && reduced_in_float(out.scalar_type());
  reduce_into(out, inputs, op, needs_room ? context.scratch(out.numel()) : at::Tensor());
}

void reduce_into(const at::Tensor& out,
                 const std::vector<at::Tensor>& inputs,
                 ReduceOp op,
                 const at::Tensor& float_room) {
  if (inputs.size() == 1) {
    if (out.data_ptr() != inputs[0].data_ptr()) {
      out.copy_(inputs[0]);
    }
    return;
  }
  if (reduced_in_float(out.scalar_type())) {
    auto sum = float_room;
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

std::string waiting_to_reuse_staging(const ShmContext& context, uint64_t g) {
  const auto& staging = *context.staging;
  return behind(context, [&](int p) { return g > 2 && staging.consumed(p).get() < g - 2; }) +
      str(" to finish with round ", g - 2, " of the shared-memory staging buffers");
}

} // namespace lockstep::detail
