#pragma once

// One parameter's optimizer state, apart from the optimizer that holds it:
// moved between optimizers over the same tensors, joined from the states of
// a parameter's slices, and sliced. Field by field through the state's own
// serialization, so that it serves every optimizer of torch::optim alike.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

namespace torch::optim {
class Optimizer;
class OptimizerParamState;
} // namespace torch::optim

namespace torch::serialize {
class InputArchive;
} // namespace torch::serialize

namespace lockstep::detail {

using ParamState = std::unique_ptr<torch::optim::OptimizerParamState>;

/// Removes `tensor`'s state from `optimizer` and returns it (null if none).
ParamState take_state(torch::optim::Optimizer& optimizer, const at::Tensor& tensor);
/// Makes `state` (unless null) `tensor`'s state in `optimizer`.
void put_state(torch::optim::Optimizer& optimizer, const at::Tensor& tensor, ParamState state);
/// `tensor`'s state in `optimizer`, or null.
const torch::optim::OptimizerParamState* find_state(const torch::optim::Optimizer& optimizer,
                                                    const at::Tensor& tensor);

/// The state of `param` from the states of consecutive slices of it, the
/// first `first_length` elements long: the tensors of a slice's size laid
/// end to end in `param`'s shape, the rest (step counts) the first slice's.
ParamState joined_state(const std::vector<ParamState>& slices, int64_t first_length,
                        const at::Tensor& param);
/// The state of elements [offset, offset + length) of `param`, from its
/// whole state.
ParamState state_slice(const torch::optim::OptimizerParamState& whole, const at::Tensor& param,
                       int64_t offset, int64_t length);

/// A state's fields, by name, as its serialize() writes them: what a state
/// is apart from its type.
using StateFields = std::vector<std::pair<std::string, c10::IValue>>;
/// The fields that a state's serialize() wrote into `archive`.
StateFields fields_in(torch::serialize::InputArchive& archive);
/// Makes `fields` `param`'s state in `optimizer`, of the optimizer's own
/// state type (which a caller without a state at hand cannot name), leaving
/// the other states and the options as they were.
void put_state_fields(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                      const StateFields& fields);

} // namespace lockstep::detail
