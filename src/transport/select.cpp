#include "transport/select.h"

#include <iostream>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <lockstep/error.h>

#include "transport/process_group_transport.h"
#include "transport/shm_transport.h"

namespace lockstep::detail {
namespace {

bool one_machine(const std::vector<ProcessIdentity>& peers) {
  for (const auto& peer : peers) {
    if (peer.machine.empty() || peer.machine != peers.front().machine) {
      return false;
    }
  }
  return true;
}

} // namespace

std::shared_ptr<Transport> choose_transport(const WorldConfig& config,
                                            const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::vector<ProcessIdentity>& peers,
                                            const c10::intrusive_ptr<c10d::ProcessGroup>& gloo) {
  auto gloo_transport = std::make_shared<ProcessGroupTransport>(gloo, "Gloo");
  if (config.size == 1 || config.transport == TransportKind::Gloo) {
    return gloo_transport;
  }
  std::string failure;
  if (!one_machine(peers)) {
    failure = "the ranks run on more than one machine";
    if (config.transport == TransportKind::Auto) {
      return gloo_transport;
    }
  } else {
    HostGroup group;
    for (int rank = 0; rank < config.size; ++rank) {
      group.ranks.push_back(rank);
    }
    group.index = config.rank;
    group.timeout = config.timeout;
    auto shm = ShmTransport::create(c10::make_intrusive<c10d::PrefixStore>("shm", store), group,
                                    failure);
    if (shm) {
      return shm;
    }
  }
  LOCKSTEP_ENFORCE(
      config.transport != TransportKind::SharedMemory, ConfigError, "rank ", config.rank,
      ": LOCKSTEP_TRANSPORT=shm (or WorldOptions::transport) asks for shared memory, but ",
      failure, ". Run every rank on one host with memory to spare (in a container, also "
      "--ipc=host or a larger --shm-size when LOCKSTEP_SHM_DIR is set), or choose auto or "
      "gloo.");
  if (config.rank == 0) {
    std::cerr << "lockstep: collectives go through Gloo, not shared memory: " << failure
              << ". (LOCKSTEP_TRANSPORT=gloo chooses Gloo without this line.)" << std::endl;
  }
  return gloo_transport;
}

} // namespace lockstep::detail
