#include <iostream>

#include <ATen/ATen.h>
#include <lockstep/lockstep.h>

int main() {
  lockstep::World world = lockstep::init();
  auto tensor = at::full({3}, 2.0);
  world.all_reduce(tensor, lockstep::ReduceOp::Average);
  std::cout << "consumer: rank " << world.rank() << " of " << world.size()
            << ", average " << tensor[0].item<double>() << std::endl;
  return tensor[0].item<double>() == 2.0 ? 0 : 1;
}
