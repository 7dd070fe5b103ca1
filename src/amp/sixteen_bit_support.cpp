// Whether 16-bit work runs on this CPU (sixteen_bit_support.h): a matrix
// product or a convolution of a few elements, forward and backward, tried
// once per kind and dtype. Only when it fails is the cause looked for: the
// same with oneDNN off (does ATen's own kernel have it?), the oneDNN limit
// in the environment, and the CPU's flags.

#include "amp/sixteen_bit_support.h"

#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/version.h>

#include <lockstep/error.h>

#include "compat/autocast.h"

namespace lockstep::detail {
namespace {

bool is_matrix_product(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::LinearImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BilinearImpl*>(&module) != nullptr;
}

bool is_convolution(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::Conv1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::Conv2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::Conv3dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ConvTranspose1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ConvTranspose2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::ConvTranspose3dImpl*>(&module) != nullptr;
}

// Autocast off on CPU while it lives: the trial convolves in the dtype it
// names, not in the one an enclosing autocast would cast it to.
class CpuAutocastOff {
 public:
  CpuAutocastOff() : was_(autocast_enabled(c10::DeviceType::CPU)) {
    set_autocast_enabled(c10::DeviceType::CPU, false);
  }
  ~CpuAutocastOff() {
    set_autocast_enabled(c10::DeviceType::CPU, was_);
  }
  CpuAutocastOff(const CpuAutocastOff&) = delete;
  CpuAutocastOff& operator=(const CpuAutocastOff&) = delete;

 private:
  bool was_;
};

const char* singular(CpuWork work) {
  return work == CpuWork::MatrixProducts ? "matrix product" : "convolution";
}

// What the work said when it failed (its first line), or "" when it ran.
std::string try_work(CpuWork work, c10::ScalarType dtype) {
  try {
    c10::InferenceMode not_inference(false);
    at::AutoGradMode grad(true);
    CpuAutocastOff autocast_off;
    auto options = at::TensorOptions().dtype(dtype);
    // Big enough for LibTorch to choose the kernel a model's layers get
    // (1.13 sends a bfloat16 product to oneDNN above 16 x 16 x 16).
    bool product = work == CpuWork::MatrixProducts;
    auto input = (product ? at::ones({32, 32}, options) : at::ones({1, 2, 5, 5}, options))
                     .requires_grad_();
    auto weight = (product ? at::ones({32, 32}, options) : at::ones({2, 2, 3, 3}, options))
                      .requires_grad_();
    auto output = product ? at::linear(input, weight) : at::conv2d(input, weight);
    torch::autograd::grad({output.sum()}, {input, weight});
    return "";
  } catch (const std::exception& e) {
    std::string words = e.what();
    if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
      words = error->what_without_backtrace();
    }
    words = words.substr(0, words.find('\n'));
    return words.empty() ? "an error without words" : words;
  }
}

// The variable that limits oneDNN's instruction set, as "NAME=VALUE", or "".
std::string onednn_limit() {
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0' && std::string(value) != "ALL") {
      return std::string(name) + "=" + value;
    }
  }
  return "";
}

// Which of the instruction sets that oneDNN's 16-bit convolutions need this
// CPU has, as "avx512bw, avx512_bf16, not amx_bf16".
std::string cpu_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::string flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      flags = line.substr(line.find(':') + 1) + " ";
      break;
    }
  }
  if (flags.empty()) {
    return "its flags unknown";
  }
  std::ostringstream out;
  const char* separator = "";
  for (const char* flag : {"avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16"}) {
    bool has = flags.find(std::string(" ") + flag + " ") != std::string::npos;
    out << separator << (has ? "" : "not ") << flag;
    separator = ", ";
  }
  return out.str();
}

std::string explain(CpuWork work, c10::ScalarType dtype, const std::string& said) {
  auto& context = at::globalContext();
  bool onednn = context.userEnabledMkldnn();
  bool own_kernel_has_it = false;
  if (onednn) {
    context.setUserEnabledMkldnn(false);
    own_kernel_has_it = try_work(work, dtype).empty();
    context.setUserEnabledMkldnn(true);
  }
  std::string limit = onednn_limit();
  std::ostringstream out;
  if (own_kernel_has_it) {
    out << "LibTorch " << TORCH_VERSION << " hands them to oneDNN, which has none";
    if (!limit.empty()) {
      out << " when limited by " << limit << " (this CPU: " << cpu_flags() << ")";
    } else {
      out << " for this CPU (" << cpu_flags() << ")";
    }
    out << ". Choose one: train in float32; ";
    if (!limit.empty()) {
      out << "unset " << limit.substr(0, limit.find('=')) << "; ";
    }
    out << "turn oneDNN off before the first step "
           "(at::globalContext().setUserEnabledMkldnn(false): ATen's own, slower kernel then "
           "computes them in "
        << dtype << "); or a LibTorch whose oneDNN has them on this CPU";
  } else {
    out << "LibTorch " << TORCH_VERSION << " has no " << dtype << " " << singular(work)
        << " on CPU"
        << (onednn ? "" : " (with oneDNN off)") << ". Choose one: train in float32; ";
    if (dtype != c10::kBFloat16) {
      out << "compute in BFloat16; ";
    }
    out << "or a LibTorch that has one";
  }
  out << ". (The " << singular(work) << " said: " << said << ")";
  return out.str();
}

} // namespace

std::vector<CpuWork> cpu_work_of(const torch::nn::Module& module) {
  bool products = is_matrix_product(module);
  bool convolutions = is_convolution(module);
  for (const auto& child : module.modules(/*include_self=*/false)) {
    products = products || is_matrix_product(*child);
    convolutions = convolutions || is_convolution(*child);
  }
  std::vector<CpuWork> work;
  if (products) {
    work.push_back(CpuWork::MatrixProducts);
  }
  if (convolutions) {
    work.push_back(CpuWork::Convolutions);
  }
  return work;
}

std::optional<std::string> cpu_work_unsupported(CpuWork work, c10::ScalarType dtype) {
  static std::mutex mutex;
  static std::map<std::pair<CpuWork, c10::ScalarType>, std::optional<std::string>> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(work, dtype);
  auto found = known.find(key);
  if (found == known.end()) {
    std::string said = try_work(work, dtype);
    found = known
                .emplace(key, said.empty() ? std::nullopt
                                           : std::optional<std::string>(explain(work, dtype, said)))
                .first;
  }
  return found->second;
}

void require_cpu_work_in(const std::vector<CpuWork>& work, c10::ScalarType dtype,
                         const char* who) {
  if (dtype != c10::kBFloat16 && dtype != c10::kHalf) {
    return;
  }
  for (auto kind : work) {
    auto why = cpu_work_unsupported(kind, dtype);
    LOCKSTEP_ENFORCE(!why, ConfigError, who, " computes the model's ", singular(kind), "s in ",
                     dtype, ", and this CPU with this LibTorch cannot: ", why.value_or(""), ".");
  }
}

} // namespace lockstep::detail
