// All-reduce time and bandwidth through lockstep::World, one line of CSV per
// message size on rank 0. bench/run-allreduce runs it beside the same
// collective from Python torch.distributed.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>

#include <lockstep/lockstep.h>

namespace {

// Times all-reduces of `tensor` of `bytes`; prints one CSV line on rank 0.
void measure(lockstep::World& world, const char* impl, at::Tensor tensor, int64_t bytes) {
  int iterations = static_cast<int>(std::clamp<int64_t>((256 << 20) / bytes, 10, 200));
  for (int i = 0; i < 3; ++i) {
    world.all_reduce(tensor);
  }
  std::vector<double> micros;
  for (int i = 0; i < iterations; ++i) {
    tensor.fill_(1.0f); // as backward writes a bucket before it leaves
    world.barrier();
    auto start = std::chrono::steady_clock::now();
    world.all_reduce(tensor);
    micros.push_back(std::chrono::duration<double, std::micro>(
                         std::chrono::steady_clock::now() - start)
                         .count());
  }
  std::nth_element(micros.begin(), micros.begin() + micros.size() / 2, micros.end());
  double median = micros[micros.size() / 2];
  // Bus bandwidth as NCCL-tests defines it: comparable across world sizes.
  double n = world.size();
  double busbw = bytes * 2 * (n - 1) / n / (median * 1e-6) / 1e9;
  if (world.rank() == 0) {
    std::printf("%s,%lld,%d,%.1f,%.3f\n", impl, static_cast<long long>(bytes), iterations,
                median, busbw);
    std::fflush(stdout);
  }
}

} // namespace

// LOCKSTEP_TRANSPORT chooses the transport; the label names it. Over shared
// memory, each size is measured twice: a tensor of the program's own (copied
// in and out) and one from World::allocate, where DDP keeps its buckets
// (reduced in place).
int main() {
  lockstep::World world = lockstep::init();
  bool shared = world.transport().rfind("shared memory", 0) == 0;
  if (world.rank() == 0) {
    std::printf("impl,bytes,iterations,median_us,busbw_gbps\n");
  }
  for (int64_t bytes = 4 << 10; bytes <= 64 << 20; bytes *= 4) {
    measure(world, shared ? "lockstep-shm" : "lockstep-gloo", at::ones({bytes / 4}, at::kFloat),
            bytes);
    if (shared) {
      measure(world, "lockstep-shm-in-place", world.allocate(bytes / 4, at::kFloat), bytes);
    }
  }
  return 0;
}
