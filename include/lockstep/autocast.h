#pragma once

// Mixed precision in forward: while a lockstep::amp::Autocast lives, the ops
// that autocast's lists name run in 16 bits on its device (matrix products,
// convolutions) and the ones that need the range in float32, as under
// Python's `with torch.autocast(device_type, dtype):`.
//
//   {
//     lockstep::amp::Autocast autocast(at::kCPU);           // bfloat16 on CPU
//     loss = torch::nll_loss(ddp(x), y);
//   }
//   loss.backward();                                         // outside, as in Python

#include <optional>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace lockstep::amp {

class Autocast {
 public:
  /// `dtype`: by default float16 on CUDA, bfloat16 on CPU (float16 on CPU
  /// needs LibTorch 2.x: ConfigError on 1.13). `enabled` false turns
  /// autocast off inside an enclosing one (as Python's enabled=False).
  explicit Autocast(c10::DeviceType device_type,
                    std::optional<c10::ScalarType> dtype = std::nullopt, bool enabled = true);
  /// Restores the state it found; the outermost clears the cache of casts
  /// (the 16-bit copies of the weights made inside it).
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
};

} // namespace lockstep::amp
