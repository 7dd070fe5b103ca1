// lockstep::amp::Autocast (autocast.h): Python's torch.autocast __enter__
// and __exit__, over ATen's thread-local autocast state.

#include <lockstep/autocast.h>

#include <ATen/autocast_mode.h>

#include <lockstep/error.h>

#include "compat/autocast.h"

namespace lockstep::amp {

Autocast::Autocast(c10::DeviceType device_type, std::optional<c10::ScalarType> dtype,
                   bool enabled)
    : device_type_(device_type),
      previous_enabled_(detail::autocast_enabled(device_type)),
      previous_dtype_(detail::autocast_dtype(device_type)) {
  auto fast = dtype.value_or(device_type == c10::DeviceType::CUDA ? c10::kHalf
                                                                  : c10::kBFloat16);
  LOCKSTEP_ENFORCE(detail::autocast_supports(device_type, fast), ConfigError,
                   "lockstep::amp::Autocast: autocast on ", device_type, " runs in ",
                   device_type == c10::DeviceType::CUDA ? "float16 or bfloat16"
                                                        : "bfloat16 (float16 too from LibTorch 2)",
                   " in this LibTorch, not ", fast, ".");
  detail::set_autocast_enabled(device_type, enabled);
  detail::set_autocast_dtype(device_type, fast);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  detail::set_autocast_enabled(device_type_, previous_enabled_);
  detail::set_autocast_dtype(device_type_, previous_dtype_);
}

} // namespace lockstep::amp
