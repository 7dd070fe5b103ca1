// Forms the world from the environment, says which transport carries it,
// and checks every collective against its definition
// (tests/support/collective_checks.h). Exits 1 on any difference. The
// two-host test runs it as 2 hosts x 2 ranks in network namespaces.

#include <iostream>

#include <lockstep/lockstep.h>

#include "support/collective_checks.h"

int main() {
  try {
    lockstep::World world = lockstep::init();
    if (world.rank() == 0) {
      std::cout << "transport: " << world.transport() << std::endl;
    }
    auto failures = lockstep::testing::check_collectives(world, /*large=*/false);
    for (const auto& failure : failures) {
      std::cout << failure << std::endl;
    }
    std::cout << "rank " << world.rank() << ": " << (failures.empty() ? "all" : "not all")
              << " collectives match their definition" << std::endl;
    return failures.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}
