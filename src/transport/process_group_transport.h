#pragma once

// Collectives over a c10d process group: Gloo for CPU tensors (the only
// transport across hosts, and the fallback on one), NCCL for CUDA tensors.

#include <c10/util/intrusive_ptr.h>

#include "transport/transport.h"

namespace c10d {
class ProcessGroup;
} // namespace c10d

namespace lockstep::detail {

class ProcessGroupTransport : public Transport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string name);

  std::string describe() const override {
    return name_;
  }
  std::unique_ptr<TransportWork> all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  std::unique_ptr<TransportWork> broadcast(const at::Tensor& tensor, int root) override;
  std::unique_ptr<TransportWork> all_gather(const std::vector<at::Tensor>& outputs,
                                            const at::Tensor& input) override;
  std::unique_ptr<TransportWork> barrier() override;

  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const {
    return group_;
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string name_;
};

} // namespace lockstep::detail
