#pragma once

// Collectives at memory speed between the ranks of one host, through
// memory they share (see shm_layout.h for where things are and shm_ops.h
// for the operations). Operations run in the order they were begun, the
// same on every rank; each advances whenever its rank calls into the
// transport (beginning another operation, or waiting), so no thread of
// its own competes with the model for the cores. All results are
// bit-identical on every rank: each slice of a sum is computed once.

#include <deque>
#include <map>
#include <mutex>

#include "transport/shm_ops.h"
#include "transport/transport.h"

namespace c10d {
class Store;
} // namespace c10d

namespace lockstep::detail {

class ShmTransport : public Transport, public std::enable_shared_from_this<ShmTransport> {
 public:
  /// Beyond one host: `across`, a Gloo group of the ranks of the same local
  /// index on every host, carries each rank's slice of an allocated
  /// tensor's sum between hosts; `world`, the world's Gloo group, carries
  /// every other collective.
  struct Hosts {
    std::shared_ptr<Transport> across;
    std::shared_ptr<Transport> world;
    int count = 1;
  };

  /// Collective among `group` (the whole world, or this host's ranks with
  /// `hosts`): maps the staging segment. On failure (the same on every rank
  /// of the group), returns null and sets `failure` to why.
  static std::shared_ptr<ShmTransport> create(c10::intrusive_ptr<c10d::Store> store,
                                              const HostGroup& group,
                                              Hosts hosts,
                                              std::string& failure);

  std::string describe() const override;
  std::unique_ptr<TransportWork> all_reduce(const at::Tensor& tensor, ReduceOp op) override;
  std::unique_ptr<TransportWork> broadcast(const at::Tensor& tensor, int root) override;
  std::unique_ptr<TransportWork> all_gather(const std::vector<at::Tensor>& outputs,
                                            const at::Tensor& input) override;
  std::unique_ptr<TransportWork> barrier() override;
  /// On one host; across hosts, null (World's fallback).
  std::unique_ptr<TransportWork> reduce_scatter(const at::Tensor& output,
                                                const at::Tensor& input,
                                                ReduceOp op) override;
  /// A tensor in an arena that every rank of the host maps (shm_layout.h).
  at::Tensor allocate(int64_t numel, at::ScalarType dtype) override;

  /// Advances `op` (and every operation before it); returns once it is
  /// complete (true) or `slice` has passed (false).
  bool wait_for(ShmOp& op, std::chrono::milliseconds slice);
  std::string waiting_for(const ShmOp& op);

 private:
  ShmTransport(c10::intrusive_ptr<c10d::Store> store,
               HostGroup group,
               Hosts hosts,
               std::unique_ptr<Staging> staging);

  // Makes an operation and queues it, under the lock.
  std::unique_ptr<TransportWork> begin(const std::function<std::unique_ptr<ShmOp>()>& make);
  // A collective of the world's Gloo group, whose waiter keeps advancing
  // this host's queue (a peer may need this rank's slice first).
  std::unique_ptr<TransportWork> alongside(std::unique_ptr<TransportWork> work);
  // Advances the queue, in order, as far as the peers' posts allow.
  void progress();

  friend class AlongsideWork;

  c10::intrusive_ptr<c10d::Store> store_;
  HostGroup group_;
  Hosts hosts_;
  std::unique_ptr<Staging> staging_;
  std::mutex mutex_;
  ShmContext context_;
  std::deque<std::shared_ptr<ShmOp>> queue_;
  // This rank's tensor of each arena, by its address.
  std::map<const void*, std::weak_ptr<Arena>> arenas_;
  uint64_t arenas_made_ = 0;
};

} // namespace lockstep::detail
