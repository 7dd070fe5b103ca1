#pragma once

// What a World holds, for the parts of world/ that make or re-form one
// (world.cpp: init(); epoch_world.cpp: the worlds of fault tolerance).

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <lockstep/world.h>

#include "compat/c10d.h"
#include "transport/transport.h"
#include "world/job_store.h"
#include "world/ledger.h"
#include "world/liveness.h"
#include "world/rendezvous.h"
#include "world/resolve.h"

namespace lockstep {

struct World::Impl : std::enable_shared_from_this<World::Impl> {
  detail::WorldConfig config;
  // The rank the launcher gave this process: the slot that a restart of
  // it refills, whatever its rank in the worlds formed later.
  int replica = 0;
  // How many ranks the launcher started: the slots that restarts refill.
  int slots = 1;
  // How many of them it started on each host (a replica group's size by
  // default), kept where a restarted rank's world is one of its own.
  int slots_per_host = 1;
  // Shared by the worlds that fault tolerance forms from this one; only
  // the world that init() made closes it.
  std::shared_ptr<detail::JobStore> job_store;
  bool owns_job_store = true;
  c10::intrusive_ptr<c10d::Store> store;
  // The world's Gloo: the fallback transport and the one across hosts.
  c10::intrusive_ptr<detail::CollectiveBackend> cpu_backend;
  // What World::process_group() hands out: cpu_backend itself (1.13) or a
  // c10d::ProcessGroup dispatching to it (2.x), made at the first ask.
  c10::intrusive_ptr<c10d::ProcessGroup> cpu_group;
  // What carries the collectives of CPU tensors: cpu_backend, or shared
  // memory between the ranks of a host (world/transport_choice.h), or nothing
  // at all in a world of one.
  std::shared_ptr<detail::Transport> cpu_transport;
  std::string transport_description;
  std::mutex group_mutex;
  c10::intrusive_ptr<detail::CollectiveBackend> cuda_backend;
  c10::intrusive_ptr<c10d::ProcessGroup> cuda_group;
  c10::intrusive_ptr<c10d::Store> gloo_store;
  c10::intrusive_ptr<c10d::Store> nccl_store;
  std::shared_ptr<detail::Transport> cuda_transport;
  // Numbers the collectives issued through World: the same sequence on
  // every rank, since every rank must issue the same collectives.
  std::atomic<uint64_t> collective_count{0};
  // The last collective that completed here (they complete in order): what
  // a closing rank tells the others it took part in. One that it began but
  // gave up on (a timeout) does not count, since its peers wait in vain.
  std::atomic<uint64_t> completed_count{0};
  std::unique_ptr<detail::Ledger> ledger;
  // This process's part in the job's liveness: started where a world spans
  // hosts (the ledger judges the peers there by it) or for fault tolerance;
  // shared by the worlds formed from this one.
  std::shared_ptr<detail::Liveness> liveness;
  // Fault tolerance's judge of hangs: a collective that waits this long
  // names, once, the ranks that never reached it.
  std::chrono::milliseconds hang_timeout{0};
  std::function<void(const std::vector<int>& ranks, const std::string& what)> on_hang;
  uint64_t string_gather_count = 0;
  // Set by the first collective that fails here: its transport may still
  // hold it, and the ranks are out of step, so nothing after it can run.
  std::mutex broken_mutex;
  std::string broken;
  // Held from numbering a collective to handing it to its transport, so
  // that collectives issued by two threads reach the transport (and Gloo's
  // tags) in the order of their numbers.
  std::mutex issue_mutex;

  ~Impl();

  /// Collective among config.size processes: rendezvous in `store`, the
  /// ledger on the job store's board for `scope` ("" for init()'s world),
  /// Gloo and the transport of CPU tensors.
  void connect(const std::string& scope);

  /// Starts this process's liveness if it has none yet.
  std::shared_ptr<detail::Liveness> start_liveness();

  // Tells the others that this rank will reach no further collective, so
  // that one still waiting in one fails at once, naming this rank. The
  // store's host then stays (10 s at most) until the others have closed or
  // gone too: they would otherwise lose the store, and with it the reason.
  void close() {
    if (ledger) {
      // Closed while an exception unwinds the stack, or after a collective
      // failed: the others should say "an error", not "fewer batches".
      bool failed = std::uncaught_exceptions() > 0;
      {
        std::lock_guard<std::mutex> lock(broken_mutex);
        failed = failed || !broken.empty();
      }
      ledger->close(completed_count, failed);
      if (liveness && owns_job_store && !failed) {
        liveness->goodbye(); // this end is no failure
      }
      if (owns_job_store && job_store->hosted_here()) {
        auto limit = std::chrono::steady_clock::now() +
            std::min<std::chrono::milliseconds>(config.timeout, std::chrono::seconds(10));
        while (!ledger->others_finished() && std::chrono::steady_clock::now() < limit) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      }
    }
    if (liveness && owns_job_store) {
      liveness->stop(); // before the store goes, where this process hosts it
    }
    if (job_store && owns_job_store) {
      job_store->close();
    }
  }

  // Set by abandon(): a peer failed, and fault tolerance gives this world
  // up; every wait in it ends at its next slice.
  std::atomic<bool> abandoned{false};

  void abandon(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(broken_mutex);
      if (broken.empty()) {
        broken = why;
      }
    }
    abandoned = true;
  }

  /// Why this world can run no collective, or "".
  std::string broken_because() {
    std::lock_guard<std::mutex> lock(broken_mutex);
    return broken;
  }

  void break_at(uint64_t seq, const std::string& what) {
    std::lock_guard<std::mutex> lock(broken_mutex);
    if (broken.empty()) {
      broken = detail::str("collective #", seq, " (", what, ") failed");
    }
  }

  void completed(uint64_t seq) {
    uint64_t before = completed_count.load();
    while (before < seq && !completed_count.compare_exchange_weak(before, seq)) {
    }
  }

  /// Numbers the next collective and records, in the ledger, that this rank
  /// reached it.
  uint64_t begin(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(broken_mutex);
      LOCKSTEP_ENFORCE(!abandoned, CollectiveError, "rank ", config.rank, ": ", what,
                       " cannot start: this world was given up: ", broken, ".");
      LOCKSTEP_ENFORCE(
          broken.empty(), CollectiveError, "rank ", config.rank, ": ", what,
          " cannot start: ", broken, " on this rank, so this world is unusable (the "
          "transport may still hold that collective, and the ranks are out of step). End "
          "this world, and the job or its attempt (lockstep-run --max-restarts resumes it "
          "from a checkpoint); that first error says why.");
    }
    uint64_t seq = ++collective_count;
    if (ledger) {
      ledger->arrive(seq, what);
    }
    return seq;
  }

  detail::Transport& transport_for(const at::Tensor& tensor);
  // Gloo's backend: at init() where the world has peers, else (a process
  // alone opens no socket) at the first ask for its process group.
  void start_gloo_backend();
  // Under group_mutex: NCCL's backend and transport, made at the first
  // CUDA tensor (or ask for its process group).
  void start_cuda_backend(const at::Device& device);

  detail::GroupOptions group_options() const {
    detail::GroupOptions options;
    options.rank = config.rank;
    options.size = config.size;
    options.timeout = config.timeout;
    options.local_address = config.single_host
        ? "127.0.0.1"
        : detail::local_address_towards(config.master_addr);
    return options;
  }
};

} // namespace lockstep
