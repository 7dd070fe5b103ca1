#include "transport/shm_transport.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

namespace lockstep::detail {
namespace {


class ShmWork : public TransportWork {
 public:
  ShmWork(std::shared_ptr<ShmTransport> transport, std::shared_ptr<ShmOp> op)
      : transport_(std::move(transport)), op_(std::move(op)) {}

  bool wait_for(std::chrono::milliseconds slice) override {
    return transport_->wait_for(*op_, slice);
  }

  std::string stall() override {
    return "waiting for " + transport_->waiting_for(*op_);
  }

  int64_t completed_ns() const override {
    return op_->completed_ns;
  }

 private:
  std::shared_ptr<ShmTransport> transport_;
  std::shared_ptr<ShmOp> op_;
};

// How long a waiter sleeps between looks when an operation waits for a
// collective across hosts, which rings no doorbell.
constexpr auto kOutsidePoll = std::chrono::microseconds(100);

} // namespace

class AlongsideWork : public TransportWork {
 public:
  AlongsideWork(std::shared_ptr<ShmTransport> transport, std::unique_ptr<TransportWork> work)
      : transport_(std::move(transport)), work_(std::move(work)) {}

  bool wait_for(std::chrono::milliseconds slice) override {
    auto deadline = std::chrono::steady_clock::now() + slice;
    do {
      {
        std::lock_guard<std::mutex> lock(transport_->mutex_);
        transport_->progress();
      }
      if (work_->wait_for(std::chrono::milliseconds(1))) {
        return true;
      }
    } while (std::chrono::steady_clock::now() < deadline);
    return false;
  }
  std::string stall() override {
    return work_->stall();
  }
  int64_t completed_ns() const override {
    return work_->completed_ns();
  }

 private:
  std::shared_ptr<ShmTransport> transport_;
  std::unique_ptr<TransportWork> work_;
};

ShmTransport::ShmTransport(c10::intrusive_ptr<c10d::Store> store,
                           HostGroup group,
                           Hosts hosts,
                           std::unique_ptr<Staging> staging)
    : store_(std::move(store)),
      group_(std::move(group)),
      hosts_(std::move(hosts)),
      staging_(std::move(staging)) {
  context_.staging = staging_.get();
  context_.me = group_.index;
  context_.ranks = group_.ranks;
}

std::shared_ptr<ShmTransport> ShmTransport::create(c10::intrusive_ptr<c10d::Store> store,
                                                   const HostGroup& group,
                                                   Hosts hosts,
                                                   std::string& failure) {
  int ranks = static_cast<int>(group.ranks.size());
  auto shared = share_mapping(*store, "transport/shm/staging", group, Staging::bytes_for(ranks));
  if (!shared.mapping) {
    failure = shared.failure;
    return nullptr;
  }
  return std::shared_ptr<ShmTransport>(
      new ShmTransport(std::move(store), group, std::move(hosts),
                       std::make_unique<Staging>(std::move(shared.mapping), ranks)));
}

std::string ShmTransport::describe() const {
  if (hosts_.world) {
    return str("shared memory within each host (", group_.ranks.size(), " ranks) and Gloo "
               "across ", hosts_.count, " hosts");
  }
  return str("shared memory (", group_.ranks.size(), " ranks on this host)");
}

std::unique_ptr<TransportWork> ShmTransport::alongside(std::unique_ptr<TransportWork> work) {
  return std::make_unique<AlongsideWork>(shared_from_this(), std::move(work));
}

std::unique_ptr<TransportWork> ShmTransport::begin(
    const std::function<std::unique_ptr<ShmOp>()>& make) {
  std::shared_ptr<ShmOp> op;
  {
    // Made under the lock: an operation numbers its rounds when it is made,
    // and they must follow the queue's order when two threads issue.
    std::lock_guard<std::mutex> lock(mutex_);
    op = make();
    queue_.push_back(op);
    progress();
  }
  return std::make_unique<ShmWork>(shared_from_this(), std::move(op));
}

void ShmTransport::progress() {
  // In queue order, so that every rank starts them, and their collectives
  // across hosts, in one order. One that waits for its crossing lets the
  // next begin: consecutive buckets cross the link together, and may
  // complete out of order.
  for (auto it = queue_.begin(); it != queue_.end() && !(*it)->failure;) {
    ShmOp& op = **it;
    if (op.advance(context_)) {
      op.done = true;
      op.completed_ns = steady_now_ns();
      it = queue_.erase(it);
    } else if (op.waits_outside() && !op.failure) {
      ++it;
    } else {
      break;
    }
  }
  if (context_.posted) {
    context_.posted = false;
    staging_->bell().ring();
  }
}

bool ShmTransport::wait_for(ShmOp& op, std::chrono::milliseconds slice) {
  auto deadline = std::chrono::steady_clock::now() + slice;
  auto& bell = staging_->bell();
  while (true) {
    // Read before looking, so that a post in between wakes the sleep.
    uint32_t seen = bell.now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      progress();
      if (op.done) {
        return true;
      }
      // Nothing at or after a failed operation completes.
      for (const auto& queued : queue_) {
        if (queued->failure) {
          std::rethrow_exception(queued->failure);
        }
        if (queued.get() == &op) {
          break;
        }
      }
    }
    bool outside = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      outside = std::any_of(queue_.begin(), queue_.end(),
                            [](const auto& queued) { return queued->waits_outside(); });
    }
    auto until = outside ? std::min(deadline, std::chrono::steady_clock::now() + kOutsidePoll)
                         : deadline;
    if (!bell.sleep(seen, until) && std::chrono::steady_clock::now() >= deadline) {
      std::lock_guard<std::mutex> lock(mutex_);
      progress();
      return op.done;
    }
  }
}

std::string ShmTransport::waiting_for(const ShmOp& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& queued : queue_) {
    if (queued.get() != &op) {
      return queued->waiting_for(context_) + ", for an earlier collective";
    }
    return op.waiting_for(context_);
  }
  return "nothing (it has completed)";
}

std::unique_ptr<TransportWork> ShmTransport::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous());
  std::shared_ptr<Arena> arena;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = arenas_.find(tensor.data_ptr());
    if (found != arenas_.end()) {
      arena = found->second.lock();
    }
  }
  if (arena && static_cast<size_t>(tensor.nbytes()) <= arena->region_bytes) {
    return begin([&] {
      return make_arena_op(context_, arena, tensor.scalar_type(), tensor.numel(), op,
                           hosts_.across.get());
    });
  }
  if (hosts_.world) {
    return alongside(hosts_.world->all_reduce(tensor, op));
  }
  return begin([&] { return make_staged_op(context_, StagedKind::AllReduce, tensor, {}, op, 0); });
}

std::unique_ptr<TransportWork> ShmTransport::broadcast(const at::Tensor& tensor, int root) {
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous());
  if (hosts_.world) {
    return alongside(hosts_.world->broadcast(tensor, root));
  }
  // The root as an index in this host's group, which is the whole world.
  return begin([&] {
    return make_staged_op(context_, StagedKind::Broadcast, tensor, {}, ReduceOp::Sum, root);
  });
}

std::unique_ptr<TransportWork> ShmTransport::all_gather(const std::vector<at::Tensor>& outputs,
                                                        const at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(input.is_contiguous());
  if (hosts_.world) {
    return alongside(hosts_.world->all_gather(outputs, input));
  }
  return begin([&] {
    return make_staged_op(context_, StagedKind::AllGather, input, outputs, ReduceOp::Sum, 0);
  });
}

std::unique_ptr<TransportWork> ShmTransport::reduce_scatter(const at::Tensor& output,
                                                            const at::Tensor& input,
                                                            ReduceOp op) {
  TORCH_INTERNAL_ASSERT(output.is_contiguous() && input.is_contiguous());
  if (hosts_.world) {
    return nullptr;
  }
  return begin([&] { return make_reduce_scatter_op(context_, output, input, op); });
}

std::unique_ptr<TransportWork> ShmTransport::barrier() {
  if (hosts_.world) {
    return alongside(hosts_.world->barrier());
  }
  return begin([&] {
    return make_staged_op(context_, StagedKind::Barrier, at::Tensor(), {}, ReduceOp::Sum, 0);
  });
}

at::Tensor ShmTransport::allocate(int64_t numel, at::ScalarType dtype) {
  size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  if (bytes == 0) {
    return Transport::allocate(numel, dtype);
  }
  int ranks = static_cast<int>(group_.ranks.size());
  auto shared = share_mapping(*store_, str("transport/shm/arena/", ++arenas_made_), group_,
                              Arena::bytes_for(ranks, bytes));
  if (!shared.mapping) {
    // Every rank learned the same: this tensor goes through the staging
    // buffers instead, which costs a copy in and out.
    return Transport::allocate(numel, dtype);
  }
  auto arena = std::make_shared<Arena>(std::move(shared.mapping), ranks, bytes);
  char* mine = arena->region(group_.index);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = arenas_.begin(); it != arenas_.end();) {
      it = it->second.expired() ? arenas_.erase(it) : std::next(it);
    }
    arenas_[mine] = arena;
  }
  return at::from_blob(
      mine, {numel}, [arena](void*) mutable { arena.reset(); },
      at::TensorOptions().dtype(dtype));
}

} // namespace lockstep::detail
