#include "compat/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {

void require_known(c10::DeviceType device_type) {
  LOCKSTEP_ENFORCE(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
                   ConfigError, "lockstep::amp::Autocast runs on CPU and CUDA, not ",
                   device_type, ".");
}

} // namespace

bool autocast_supports(c10::DeviceType device_type, c10::ScalarType dtype) {
  if (device_type == c10::DeviceType::CUDA) {
    return dtype == c10::kHalf || dtype == c10::kBFloat16;
  }
#if TORCH_VERSION_MAJOR >= 2
  return dtype == c10::kBFloat16 || dtype == c10::kHalf;
#else
  return dtype == c10::kBFloat16; // 1.13's CPU autocast knows bfloat16 only
#endif
}

#if TORCH_VERSION_MAJOR >= 2

bool autocast_enabled(c10::DeviceType device_type) {
  require_known(device_type);
  return at::autocast::is_autocast_enabled(device_type);
}

void set_autocast_enabled(c10::DeviceType device_type, bool enabled) {
  require_known(device_type);
  at::autocast::set_autocast_enabled(device_type, enabled);
}

c10::ScalarType autocast_dtype(c10::DeviceType device_type) {
  require_known(device_type);
  return at::autocast::get_autocast_dtype(device_type);
}

void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype) {
  require_known(device_type);
  at::autocast::set_autocast_dtype(device_type, dtype);
}

#else

bool autocast_enabled(c10::DeviceType device_type) {
  require_known(device_type);
  return device_type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled()
                                             : at::autocast::is_enabled();
}

void set_autocast_enabled(c10::DeviceType device_type, bool enabled) {
  require_known(device_type);
  if (device_type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(enabled);
  } else {
    at::autocast::set_enabled(enabled);
  }
}

c10::ScalarType autocast_dtype(c10::DeviceType device_type) {
  require_known(device_type);
  return device_type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype()
                                             : at::autocast::get_autocast_gpu_dtype();
}

void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype) {
  require_known(device_type);
  if (device_type == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}

#endif

} // namespace lockstep::detail
