#pragma once

// The replicas' starting point: every rank must hold the same model, and
// then holds rank 0's values.

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <lockstep/world.h>

namespace torch::nn {
class Module;
} // namespace torch::nn

namespace lockstep::detail {

struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

/// One line per entry: kind, name, dtype, shape, requires_grad. Equal
/// descriptions mean the same model.
std::vector<std::string> describe_model(
    const std::vector<NamedTensor>& parameters,
    const std::vector<NamedTensor>& buffers);

/// The model's parameters (each tensor once) and buffers, by name.
void named_state(
    torch::nn::Module& module,
    std::vector<NamedTensor>& parameters,
    std::vector<NamedTensor>& buffers);

/// Compares the parameters and buffers of every rank (count, names, shapes,
/// dtypes, requires_grad) and raises, on every rank, a UsageError naming the
/// first difference and what each rank has there.
void check_same_model(
    World& world,
    const std::vector<NamedTensor>& parameters,
    const std::vector<NamedTensor>& buffers);

/// What check_replicas_agree compares: parameters, and buffers with
/// whether this rank changed them since they were last synchronised.
struct ReplicaEntry {
  NamedTensor entry;
  bool buffer = false;
  bool changed_here = false;
};

/// Raises, on every rank, a UsageError naming the first of `state` whose
/// bytes differ between ranks (two 64-bit checksums per tensor, gathered).
/// A buffer that some rank changed since the last synchronisation is not
/// compared: it differs legitimately until the next forward syncs it.
/// `hint` ends the message of a difference (empty: nothing).
void check_replicas_agree(World& world, const std::vector<ReplicaEntry>& state,
                          const std::string& hint = {});

/// Overwrites `tensors` on every rank with rank `root`'s values, in one
/// broadcast per dtype; `what` names them in errors.
void broadcast_from(
    World& world, int root, const std::vector<at::Tensor>& tensors, const std::string& what);

/// broadcast_from in two halves: rank `root`'s values, received as one flat
/// tensor per dtype and device (in their order of first appearance), and
/// then copied into `tensors` (for a receiver that checks them first).
std::vector<at::Tensor> broadcast_flat(
    World& world, int root, const std::vector<at::Tensor>& tensors, const std::string& what);
void unflatten_into(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& flats);

} // namespace lockstep::detail
