#pragma once

// An optimizer's state as bytes and back, for sending it to other ranks.

#include <string>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep::detail {

std::string optimizer_bytes(const torch::optim::Optimizer& optimizer);
void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes);

} // namespace lockstep::detail
