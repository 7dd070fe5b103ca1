#pragma once

// Collectives over a c10d backend: Gloo for CPU tensors (the only
// transport across hosts, and the fallback on one), NCCL for CUDA tensors.

#include <c10/util/intrusive_ptr.h>

#include "compat/c10d.h"
#include "transport/transport.h"

namespace lockstep::detail {

class ProcessGroupTransport : public Transport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<CollectiveBackend> group, std::string name);

  std::string describe() const override {
    return name_;
  }
  std::unique_ptr<TransportWork> all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  std::unique_ptr<TransportWork> broadcast(const at::Tensor& tensor, int root) override;
  std::unique_ptr<TransportWork> all_gather(const std::vector<at::Tensor>& outputs,
                                            const at::Tensor& input) override;
  std::unique_ptr<TransportWork> barrier() override;

  const c10::intrusive_ptr<CollectiveBackend>& group() const {
    return group_;
  }

 private:
  c10::intrusive_ptr<CollectiveBackend> group_;
  std::string name_;
  // 16-bit sums exchanged so far (the same count on every rank).
  uint64_t exchanges_ = 0;
};

} // namespace lockstep::detail
