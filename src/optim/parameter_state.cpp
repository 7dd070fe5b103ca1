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

using Fields = StateFields;

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
  return fields_in(in);
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

StateFields fields_in(torch::serialize::InputArchive& archive) {
  StateFields fields;
  for (const auto& key : archive.keys()) {
    c10::IValue value;
    archive.read(key, value);
    fields.emplace_back(key, value);
  }
  return fields;
}

void put_state_fields(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                      const StateFields& fields) {
  // An archive in the format of torch::optim's own load (version "1.5.0",
  // LibTorch 1.x and 2.x alike): every group with its parameters under the
  // keys "1", "2", ... and its current options, and one state, `param`'s.
  // Loading it makes that state, in its type.
  torch::serialize::OutputArchive state;
  for (const auto& [field, value] : fields) {
    state.write(field, value);
  }
  torch::serialize::OutputArchive states;
  torch::serialize::OutputArchive groups;
  groups.write("param_groups/size",
               at::tensor(static_cast<int64_t>(optimizer.param_groups().size())));
  int64_t number = 0;
  bool found = false;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& params = optimizer.param_groups()[g].params();
    torch::serialize::OutputArchive group;
    group.write("params/size", at::tensor(static_cast<int64_t>(params.size())));
    for (size_t i = 0; i < params.size(); ++i) {
      std::string key = std::to_string(++number);
      group.write("params/" + std::to_string(i), c10::IValue(key));
      if (!found && params[i].is_same(param)) {
        states.write(key, state);
        found = true;
      }
    }
    torch::serialize::OutputArchive options;
    optimizer.param_groups()[g].options().serialize(options);
    group.write("options", options);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  TORCH_INTERNAL_ASSERT(found, "put_state_fields: the parameter is not the optimizer's");
  torch::serialize::OutputArchive whole;
  whole.write("pytorch_version", c10::IValue(std::string("1.5.0")));
  whole.write("state", states);
  whole.write("param_groups", groups);
  torch::serialize::InputArchive reading;
  reopen(whole, reading);
  optimizer.load(reading);
}

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
