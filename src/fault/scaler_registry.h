#pragma once

// Which GradScalers a FaultTolerance carries to a rank that rejoins. A
// scaler that steps a guarded optimizer without being registered would
// leave a rejoined rank at init_scale while the others scale by what they
// learned: DDP would then average unlike gradients, silently. So while a
// FaultTolerance lives, its optimizer is known here, with the scalers
// registered with it, and GradScaler::step asks before it steps.

#include <mutex>
#include <vector>

namespace torch::optim {
class Optimizer;
} // namespace torch::optim

namespace lockstep::amp {
class GradScaler;
} // namespace lockstep::amp

namespace lockstep::detail {

/// While it lives, `optimizer` is guarded by a FaultTolerance, which
/// carries the scalers add()ed.
class GuardedOptimizer {
 public:
  explicit GuardedOptimizer(const torch::optim::Optimizer& optimizer);
  ~GuardedOptimizer();
  GuardedOptimizer(const GuardedOptimizer&) = delete;
  GuardedOptimizer& operator=(const GuardedOptimizer&) = delete;

  void add(const amp::GradScaler& scaler);
  bool carries(const amp::GradScaler& scaler) const;

 private:
  const torch::optim::Optimizer& optimizer_;
  mutable std::mutex mutex_;
  std::vector<const amp::GradScaler*> scalers_;
};

/// UsageError where a FaultTolerance guards `optimizer` and does not carry
/// `scaler`.
void require_scaler_carried(const torch::optim::Optimizer& optimizer,
                            const amp::GradScaler& scaler);

} // namespace lockstep::detail
