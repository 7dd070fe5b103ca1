#pragma once

// ATen's autocast state, whose calls changed between LibTorch 1.13 (one
// function per device: is_cpu_enabled, set_autocast_gpu_dtype, ...) and
// 2.x (by device type: is_autocast_enabled(device), the old ones
// deprecated). Checked by TORCH_VERSION_MAJOR in the .cpp.

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace lockstep::detail {

/// Whether autocast can run `device_type` in `dtype` in this LibTorch
/// (CPU: bfloat16, and float16 from 2.x; CUDA: both).
bool autocast_supports(c10::DeviceType device_type, c10::ScalarType dtype);
bool autocast_enabled(c10::DeviceType device_type);
void set_autocast_enabled(c10::DeviceType device_type, bool enabled);
c10::ScalarType autocast_dtype(c10::DeviceType device_type);
void set_autocast_dtype(c10::DeviceType device_type, c10::ScalarType dtype);

} // namespace lockstep::detail
