// Sparse gradients: the weights of embeddings built with sparse(true) get
// gradients that name a few rows of a table that may be huge. They stay out
// of the dense buckets: at the end of backward each rank's rows (indices
// and values) are gathered, not summed in place, and every rank builds the
// same average from them. A functional sparse embedding that construction
// could not see is averaged dense, in its bucket (backward.cpp's mark_ready).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>

#include "reducer/reducer_state.h"

namespace lockstep::detail {
namespace {

bool sparse_embedding(const torch::nn::Module& module) {
  if (const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(&module)) {
    return embedding->options.sparse();
  }
  if (const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&module)) {
    return bag->options.sparse();
  }
  return false;
}

// `tensor`'s first `rows` rows, padded with zeros to `padded` rows, so that
// every rank gathers the same shape.
at::Tensor padded_rows(const at::Tensor& tensor, int64_t padded, int64_t dim) {
  auto sizes = tensor.sizes().vec();
  sizes[dim] = padded;
  auto out = at::zeros(sizes, tensor.options());
  out.narrow(dim, 0, tensor.size(dim)).copy_(tensor);
  return out;
}

} // namespace

void Reducer::State::find_sparse_parameters(torch::nn::Module& module) {
  sparse.assign(params.size(), 0);
  for (const auto& item : module.named_modules()) {
    if (!sparse_embedding(*item.value())) {
      continue;
    }
    for (const auto& weight : item.value()->parameters(/*recurse=*/false)) {
      for (size_t index = 0; index < params.size(); ++index) {
        if (params[index].is_same(weight)) {
          sparse[index] = 1;
        }
      }
    }
  }
}

void Reducer::State::reduce_sparse_gradients() {
  at::NoGradGuard no_grad;
  int n = world.size();
  for (size_t index = 0; index < params.size(); ++index) {
    if (!sparse[index]) {
      continue;
    }
    const auto& param = params[index];
    auto grad = param.grad();
    bool contributes =
        !backward.shadowing && grad.defined() &&
        (backward.used_now[index] || used_since_sync[index]);
    at::Tensor mine;
    if (contributes) {
      mine = (grad.is_sparse() ? grad : grad.to_sparse(/*sparse_dim=*/1)).coalesce();
    } else {
      mine = at::zeros(param.sizes(), param.options()).to_sparse(/*sparse_dim=*/1);
    }
    auto indices = mine.indices();
    auto values = mine.values();
    auto counts = world.all_gather(
        at::tensor({indices.size(1), static_cast<int64_t>(contributes)}, at::kLong));
    int64_t widest = 0;
    int64_t contributors = 0;
    std::vector<int64_t> rows;
    for (const auto& count : counts) {
      rows.push_back(count[0].item<int64_t>());
      widest = std::max(widest, rows.back());
      contributors += count[1].item<int64_t>();
    }
    backward.used_now[index] = backward.used_now[index] || contributors > 0;
    if (contributors == 0) {
      continue; // no rank has a gradient: it stays as it was
    }
    auto all_indices = world.all_gather(padded_rows(indices, widest, 1));
    auto all_values = world.all_gather(padded_rows(values, widest, 0));
    std::vector<at::Tensor> index_parts;
    std::vector<at::Tensor> value_parts;
    for (int rank = 0; rank < n; ++rank) {
      index_parts.push_back(all_indices[rank].narrow(1, 0, rows[rank]));
      value_parts.push_back(all_values[rank].narrow(0, 0, rows[rank]));
    }
    // The same concatenation on every rank, coalesced the same way: the
    // same bits everywhere.
    auto sum = at::sparse_coo_tensor(at::cat(index_parts, 1), at::cat(value_parts, 0),
                                     param.sizes(), values.options().layout(at::kSparse))
                   .coalesce();
    param.mutable_grad() = sum / gradient_divisor();
    stats.last.bytes_reduced += (all_indices[0].nbytes() + all_values[0].nbytes()) * n;
  }
}

} // namespace lockstep::detail
