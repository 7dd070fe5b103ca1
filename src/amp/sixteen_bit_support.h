#pragma once

// Whether this CPU and this LibTorch can compute a model's matrix products
// and convolutions in a 16-bit dtype, asked before the first step instead
// of learnt from ATen's or oneDNN's words in the middle of one ("could not
// create a primitive descriptor iterator" names neither bfloat16, the CPU
// nor a fix).
//
// LibTorch sends a CPU bfloat16 convolution to oneDNN when the CPU has
// AVX-512 (bw, vl, dq), and to its own slower kernel otherwise. With
// oneDNN limited below that (ONEDNN_MAX_CPU_ISA=AVX2, as some sites set to
// dodge other oneDNN bugs), LibTorch 1.13 still sends it there, and oneDNN
// has none: every bfloat16 convolution fails. LibTorch 1.13 has no float16
// kernel on CPU for either.

#include <optional>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

namespace torch::nn {
class Module;
}

namespace lockstep::detail {

/// The kinds of 16-bit work a model's modules do that a CPU may lack.
enum class CpuWork { MatrixProducts, Convolutions };

/// Which kinds `module` (and the modules inside it) holds: torch::nn
/// Linear and Bilinear, and the torch::nn convolutions (Conv1d/2d/3d,
/// ConvTranspose1d/2d/3d). What a forward computes functionally is not seen.
std::vector<CpuWork> cpu_work_of(const torch::nn::Module& module);

/// Why `work` (forward and backward) in `dtype` fails on this CPU, in words
/// for the user: what is missing and what to do; nullopt when it runs.
/// Tried once per kind and dtype, on a few elements, and remembered.
std::optional<std::string> cpu_work_unsupported(CpuWork work, c10::ScalarType dtype);

/// Raises ConfigError, on behalf of `who` ("autocast (...)"), where `dtype`
/// is 16-bit and one of `work` cannot run in it on this CPU.
void require_cpu_work_in(const std::vector<CpuWork>& work, c10::ScalarType dtype,
                         const char* who);

} // namespace lockstep::detail
