#include "optim/parameter_state.h"

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace lockstep::detail {
namespace {

// The key of `tensor` in an optimizer's state: its TensorImpl, as a string
// in LibTorch 1.x and as a pointer in 2.x.
template <typename Map>
typename Map::key_type state_key(const Map&, const at::Tensor& tensor) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << tensor.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(tensor.unsafeGetTensorImpl());
  }
}

using Fields = std::vector<std::pair<std::string, c10::IValue>>;

// What `out` holds, readable.
void reopen(torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream source(bytes.str());
  in.load_from(source);
}

Fields fields_of(const torch::optim::OptimizerParamState& state) {
  torch::serialize::OutputArchive out;
  state.serialize(out);
  torch::serialize::InputArchive in;
  reopen(out, in);
  Fields fields;
  for (const auto& key : in.keys()) {
    c10::IValue value;
    in.read(key, value);
    fields.emplace_back(key, value);
  }
  return fields;
}

ParamState state_with(const torch::optim::OptimizerParamState& like, const Fields& fields) {
  torch::serialize::OutputArchive out;
  for (const auto& [key, value] : fields) {
    out.write(key, value);
  }
  torch::serialize::InputArchive in;
  reopen(out, in);
  auto state = like.clone();
  state->serialize(in);
  return state;
}

} // namespace

ParamState take_state(torch::optim::Optimizer& optimizer, const at::Tensor& tensor) {
  auto found = optimizer.state().find(state_key(optimizer.state(), tensor));
  if (found == optimizer.state().end()) {
    return nullptr;
  }
  auto state = std::move(found->second);
  optimizer.state().erase(found);
  return state;
}

void put_state(torch::optim::Optimizer& optimizer, const at::Tensor& tensor, ParamState state) {
  if (state) {
    optimizer.state()[state_key(optimizer.state(), tensor)] = std::move(state);
  }
}

const torch::optim::OptimizerParamState* find_state(const torch::optim::Optimizer& optimizer,
                                                    const at::Tensor& tensor) {
  auto found = optimizer.state().find(state_key(optimizer.state(), tensor));
  return found == optimizer.state().end() ? nullptr : found->second.get();
}

ParamState joined_state(const std::vector<ParamState>& slices, int64_t first_length,
                        const at::Tensor& param) {
  std::vector<Fields> each;
  for (const auto& slice : slices) {
    each.push_back(fields_of(*slice));
  }
  Fields joined = each.front();
  for (size_t f = 0; f < joined.size(); ++f) {
    auto& value = joined[f].second;
    if (!value.isTensor() || value.toTensor().numel() != first_length) {
      continue;
    }
    std::vector<at::Tensor> parts;
    for (const auto& fields : each) {
      parts.push_back(fields[f].second.toTensor().reshape({-1}));
    }
    value = at::cat(parts).reshape(param.sizes());
  }
  return state_with(*slices.front(), joined);
}

ParamState state_slice(const torch::optim::OptimizerParamState& whole, const at::Tensor& param,
                       int64_t offset, int64_t length) {
  Fields fields = fields_of(whole);
  for (auto& [key, value] : fields) {
    if (value.isTensor() && value.toTensor().numel() == param.numel()) {
      value = value.toTensor().reshape({-1}).narrow(0, offset, length).clone();
    }
  }
  return state_with(whole, fields);
}

} // namespace lockstep::detail
