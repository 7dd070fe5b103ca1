// Forms the world from the environment and checks Streaming DiLoCo across
// replicas of a host's ranks, DDP within each, against the reference
// (tests/support/diloco_reference.h). Exits 1 on any difference. The
// two-host test runs it as 2 hosts x 2 ranks in network namespaces.

#include <iostream>

#include <lockstep/lockstep.h>

#include "support/diloco_reference.h"

int main() {
  try {
    lockstep::World world = lockstep::init();
    auto failures = lockstep::testing::check_diloco_with_ddp_inside(world, world.local_size());
    for (const auto& failure : failures) {
      std::cout << failure << std::endl;
    }
    std::cout << "rank " << world.rank() << ": DiLoCo across " << world.size() / world.local_size()
              << " hosts " << (failures.empty() ? "equals" : "differs from")
              << " the reference at every step" << std::endl;
    return failures.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
