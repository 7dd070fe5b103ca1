#include "fault/scaler_registry.h"

#include <algorithm>
#include <map>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {

std::mutex& registry_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::map<const torch::optim::Optimizer*, const GuardedOptimizer*>& registry() {
  static std::map<const torch::optim::Optimizer*, const GuardedOptimizer*> guarded;
  return guarded;
}

} // namespace

GuardedOptimizer::GuardedOptimizer(const torch::optim::Optimizer& optimizer)
    : optimizer_(optimizer) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[&optimizer_] = this;
}

GuardedOptimizer::~GuardedOptimizer() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto found = registry().find(&optimizer_);
  if (found != registry().end() && found->second == this) {
    registry().erase(found);
  }
}

void GuardedOptimizer::add(const amp::GradScaler& scaler) {
  std::lock_guard<std::mutex> lock(mutex_);
  scalers_.push_back(&scaler);
}

bool GuardedOptimizer::carries(const amp::GradScaler& scaler) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::find(scalers_.begin(), scalers_.end(), &scaler) != scalers_.end();
}

void require_scaler_carried(const torch::optim::Optimizer& optimizer,
                            const amp::GradScaler& scaler) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto found = registry().find(&optimizer);
  LOCKSTEP_ENFORCE(
      found == registry().end() || found->second->carries(scaler), UsageError,
      "this GradScaler steps an optimizer that a lockstep::FaultTolerance guards, and is not "
      "registered with it: a rank that rejoins would scale its loss by init_scale while the "
      "others scale by what they learned, and the averaged gradients would be unlike on "
      "every rank. Call ft.register_state(\"grad_scaler\", scaler) before the first "
      "begin_step() (in place of register_state(name, save, load) with the scaler's own "
      "save and load, which FaultTolerance cannot tell from other state).");
}

} // namespace lockstep::detail
