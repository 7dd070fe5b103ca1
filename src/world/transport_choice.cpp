#include "world/transport_choice.h"

#include <iostream>
#include <map>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

#include "transport/process_group_transport.h"
#include "transport/shm_transport.h"

namespace lockstep::detail {
namespace {

using Clock = std::chrono::steady_clock;

// The ranks of each machine, machines in the order of their lowest rank.
std::vector<std::vector<int>> hosts_of(const std::vector<ProcessIdentity>& peers) {
  std::map<std::string, size_t> index;
  std::vector<std::vector<int>> hosts;
  for (int rank = 0; rank < static_cast<int>(peers.size()); ++rank) {
    // A rank whose machine is unknown shares memory with no one.
    std::string machine = peers[rank].machine.empty() ? "rank " + std::to_string(rank)
                                                      : peers[rank].machine;
    auto found = index.emplace(machine, hosts.size()).first;
    if (found->second == hosts.size()) {
      hosts.emplace_back();
    }
    hosts[found->second].push_back(rank);
  }
  return hosts;
}

// Every rank says whether its host has shared memory; the first failure
// decides for the whole world, so that every rank chooses alike.
std::string agree(c10d::Store& store, const WorldConfig& config, const std::string& mine) {
  std::string key = "agree/" + std::to_string(config.rank);
  std::string status = mine.empty() ? "ok" : mine;
  store_set(store, key, status);
  auto deadline = Clock::now() + config.timeout;
  for (int rank = 0; rank < config.size; ++rank) {
    std::string theirs_key = "agree/" + std::to_string(rank);
    while (!store.check({theirs_key})) {
      LOCKSTEP_ENFORCE(Clock::now() < deadline, RendezvousError, "rank ", config.rank,
                       ": rank ", rank, " never said whether its host has shared memory.");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    auto bytes = store.get(theirs_key);
    std::string theirs(bytes.begin(), bytes.end());
    if (theirs != "ok") {
      return theirs;
    }
  }
  return "";
}

} // namespace

std::shared_ptr<Transport> choose_transport(const WorldConfig& config,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::vector<ProcessIdentity>& peers,
                                            const c10::intrusive_ptr<CollectiveBackend>& gloo,
                                            const GroupOptions& group_options) {
  auto gloo_transport = std::make_shared<ProcessGroupTransport>(gloo, "Gloo");
  if (config.transport == TransportKind::Gloo) {
    return gloo_transport;
  }
  auto hosts = hosts_of(peers);
  auto transport_store = c10::make_intrusive<c10d::PrefixStore>("transport", store);
  std::string failure;
  bool even = true;
  for (const auto& host : hosts) {
    even = even && host.size() == hosts.front().size();
  }
  if (hosts.front().size() < 2 || !even) {
    // One rank per host, or hosts with different numbers of ranks: nothing
    // to share, or slices that would not line up across hosts.
    failure = hosts.front().size() < 2 && even
        ? "no two ranks share a host"
        : "the hosts run different numbers of ranks, so their slices do not line up";
    if (config.transport == TransportKind::Auto) {
      return gloo_transport;
    }
  } else {
    HostGroup group;
    size_t host_index = 0;
    for (size_t h = 0; h < hosts.size(); ++h) {
      for (size_t i = 0; i < hosts[h].size(); ++i) {
        if (hosts[h][i] == config.rank) {
          host_index = h;
          group.index = static_cast<int>(i);
        }
      }
    }
    group.ranks = hosts[host_index];
    group.timeout = config.timeout;
    std::vector<ProcessIdentity> processes;
    for (int rank : group.ranks) {
      group.pids.push_back(peers[static_cast<size_t>(rank)].pid);
      processes.push_back(peers[static_cast<size_t>(rank)]);
    }
    group.gone = [processes](size_t index) { return process_gone(processes[index]); };
    ShmTransport::Hosts across_hosts;
    if (hosts.size() > 1) {
      // The ranks of this local index on every host: a Gloo group of their
      // own, one per local index, all carrying slices at once.
      GroupOptions column = group_options;
      column.rank = static_cast<int>(host_index);
      column.size = static_cast<int>(hosts.size());
      auto column_store = c10::make_intrusive<c10d::PrefixStore>(
          "gloo/column" + std::to_string(group.index), store);
      across_hosts.across = std::make_shared<ProcessGroupTransport>(
          make_gloo_backend(column_store, column), "Gloo");
      across_hosts.world = gloo_transport;
      across_hosts.count = static_cast<int>(hosts.size());
    }
    auto host_store = c10::make_intrusive<c10d::PrefixStore>(
        "host" + std::to_string(group.ranks.front()), transport_store);
    auto shm = ShmTransport::create(host_store, group, across_hosts, failure);
    failure = agree(*transport_store, config, failure);
    if (failure.empty()) {
      return shm;
    }
  }
  LOCKSTEP_ENFORCE(
      config.transport != TransportKind::SharedMemory, ConfigError, "rank ", config.rank,
      ": LOCKSTEP_TRANSPORT=shm (or WorldOptions::transport) asks for shared memory, but ",
      failure, ". Run two or more ranks on each host, the same number on every host, with "
      "memory to spare (in a container with LOCKSTEP_SHM_DIR set, a larger --shm-size), or "
      "choose auto or gloo.");
  if (config.rank == 0) {
    std::cerr << "lockstep: collectives go through Gloo, not shared memory: " << failure
              << ". (LOCKSTEP_TRANSPORT=gloo chooses Gloo without this line.)" << std::endl;
  }
  return gloo_transport;
}

} // namespace lockstep::detail
