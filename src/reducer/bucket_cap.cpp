#include "reducer/bucket_cap.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

namespace lockstep::detail {
namespace {

constexpr int64_t kProbeBytes = 4 << 20;
constexpr double kSmallestCapMb = 1.0;
// How much longer than backward the wire must take to be what bounds an
// iteration, with a wide margin (the first backward is timed cold): the
// 10.5M MLP has a ratio of about 9 on 1 Gbit/s, where 1 MiB buckets win,
// and under 1 on 10 Gbit/s, where they lose.
constexpr double kWireBound = 4.0;

} // namespace

double measure_link(World& world) {
  if (world.size() == world.local_size()) {
    return 0;
  }
  auto probe = at::zeros({kProbeBytes / 4}, at::kFloat);
  world.all_reduce(probe); // the first pays for connections and pages
  double seconds = 1e9;
  for (int round = 0; round < 3; ++round) {
    auto start = std::chrono::steady_clock::now();
    world.all_reduce(probe);
    seconds = std::min(
        seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  auto slowest = at::full({1}, seconds, at::kDouble);
  world.all_reduce(slowest, ReduceOp::Max);
  return kProbeBytes / slowest.item<double>();
}

double automatic_bucket_cap_mb(double gradient_bytes,
                               double link_bytes_per_second,
                               double backward_seconds) {
  if (link_bytes_per_second <= 0) {
    return kDefaultBucketCapMb;
  }
  double wire_seconds = gradient_bytes / link_bytes_per_second;
  return wire_seconds > kWireBound * backward_seconds ? kSmallestCapMb : kDefaultBucketCapMb;
}

} // namespace lockstep::detail
