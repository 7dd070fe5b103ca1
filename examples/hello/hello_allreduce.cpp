// The smallest lockstep program: form the world, all-reduce one tensor,
// say what happened. Run it with scripts/demo, or by hand:
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ./hello_allreduce &
//   RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 ./hello_allreduce

#include <chrono>
#include <iostream>

#include <ATen/ATen.h>

#include <lockstep/lockstep.h>

int main() {
  try {
    auto start = std::chrono::steady_clock::now();
    lockstep::World world = lockstep::init();
    auto joined = std::chrono::steady_clock::now();
    std::cout << "[rank " << world.rank() << "] joined a world of "
              << world.size() << " (configured by " << world.source()
              << ") in "
              << std::chrono::duration<double, std::milli>(joined - start).count()
              << " ms" << std::endl;

    auto mine = at::full({4}, static_cast<double>(world.rank() + 1));
    auto sum = mine.clone();
    world.all_reduce(sum);
    auto names = world.all_gather_strings("rank " + std::to_string(world.rank()));
    std::cout << "[rank " << world.rank() << "] contributed "
              << mine[0].item<double>() << ", all_reduce(sum) gave "
              << sum[0].item<double>() << " (expected "
              << world.size() * (world.size() + 1) / 2 << ") from "
              << names.size() << " ranks" << std::endl;
    world.barrier();
    return 0;
  } catch (const lockstep::Error& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
