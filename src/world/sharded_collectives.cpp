#include <lockstep/sharded_collectives.h>

#include <ATen/ATen.h>

#include <lockstep/error.h>

#include "world/epoch_world.h"

namespace lockstep {
namespace {

// The sizes are checked on each rank before it starts: a rank whose sizes
// differ would pair its slices with the wrong elements of the others'.
void check(const char* operation, const at::Tensor& whole, const at::Tensor& part,
           const World& world) {
  LOCKSTEP_ENFORCE(whole.numel() == part.numel() * world.size(), UsageError, "rank ",
                   world.rank(), ": ", operation, " needs a tensor of ", world.size(),
                   " x ", part.numel(), " elements beside the tensor of ", part.numel(),
                   ", and got ", whole.numel(), ".");
  LOCKSTEP_ENFORCE(whole.scalar_type() == part.scalar_type() && whole.device() == part.device(),
                   UsageError, "rank ", world.rank(), ": ", operation,
                   " moves one dtype on one device, and got ", whole.scalar_type(), " on ",
                   whole.device(), " beside ", part.scalar_type(), " on ", part.device(), ".");
}

} // namespace

void all_gather_into(World& world, at::Tensor& output, const at::Tensor& input,
                     const std::string& description) {
  check("all_gather_into", output, input, world);
  LOCKSTEP_ENFORCE(output.is_contiguous(), UsageError, "rank ", world.rank(),
                   ": all_gather_into writes a contiguous output; pass a contiguous tensor.");
  detail::WorldAccess::all_gather_into(world, output.view({-1}), input.contiguous().view({-1}),
                                       description);
}

void reduce_scatter(World& world, at::Tensor& output, const at::Tensor& input, ReduceOp op,
                    const std::string& description) {
  check("reduce_scatter", input, output, world);
  LOCKSTEP_ENFORCE(output.is_contiguous(), UsageError, "rank ", world.rank(),
                   ": reduce_scatter writes a contiguous output; pass a contiguous tensor.");
  detail::WorldAccess::reduce_scatter(world, output.view({-1}), input.contiguous().view({-1}),
                                      op, description);
}

} // namespace lockstep
