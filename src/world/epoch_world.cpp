#include "world/epoch_world.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "store/client.h"
#include "world/job_keys.h"
#include "world/job_secret.h"
#include "world/world_impl.h"

namespace lockstep::detail {

int WorldAccess::replica(const World& world) {
  return world.impl_->replica;
}

int WorldAccess::incarnation(const World& world) {
  return world.impl_->config.incarnation;
}

int WorldAccess::slots(const World& world) {
  return world.impl_->slots;
}

int WorldAccess::slots_per_host(const World& world) {
  return world.impl_->slots_per_host;
}

bool WorldAccess::formed_by_init(const World& world) {
  return world.impl_->owns_job_store;
}

std::string WorldAccess::prove(const World& world, const std::string& message) {
  const auto& impl = *world.impl_;
  if (impl.config.secret.empty()) {
    return "-";
  }
  return detail::prove(impl.config.secret, detail::fault_tolerance_claim(
                                               impl.config.job_id, message,
                                               impl.job_store->nonce()));
}

bool WorldAccess::proven(const World& world, const std::string& message,
                         const std::string& proof) {
  const auto& impl = *world.impl_;
  if (impl.config.secret.empty()) {
    return true;
  }
  return detail::proven(impl.config.secret,
                        detail::fault_tolerance_claim(impl.config.job_id, message,
                                                      impl.job_store->nonce()),
                        proof);
}

bool WorldAccess::standby(const World& world) {
  return world.impl_->config.standby;
}

bool WorldAccess::across_hosts(const World& world) {
  return !world.impl_->config.single_host;
}

std::string WorldAccess::local_address(const World& world) {
  return world.impl_->group_options().local_address;
}

bool WorldAccess::has_secret(const World& world) {
  return !world.impl_->config.secret.empty();
}

std::shared_ptr<Liveness> WorldAccess::liveness(const World& world,
                                                std::chrono::milliseconds heartbeat_timeout) {
  auto liveness = world.impl_->start_liveness();
  liveness->set_heartbeat_timeout(heartbeat_timeout);
  return liveness;
}

std::unique_ptr<store::StoreClient> WorldAccess::store_client(const World& world) {
  return world.impl_->job_store->client();
}

bool WorldAccess::same(const World& a, const World& b) {
  return a.impl_ == b.impl_;
}

const std::string& WorldAccess::key_prefix(const World& world) {
  return world.impl_->job_store->key_prefix();
}

void WorldAccess::retire(const World& world, const std::string& scope) {
  world.impl_->job_store->retire(scope);
}

void WorldAccess::watch_hangs(
    const World& world, std::chrono::milliseconds timeout,
    std::function<void(const std::vector<int>&, const std::string&)> report) {
  world.impl_->hang_timeout = timeout;
  world.impl_->on_hang = std::move(report);
}

World WorldAccess::form(const World& base, int rank, int size, const std::string& scope) {
  const auto& from = *base.impl_;
  auto impl = std::make_shared<World::Impl>();
  impl->config = from.config;
  impl->config.rank = rank;
  impl->config.size = size;
  // The rendezvous proofs name the world's own keys: a proof from an
  // earlier world's rendezvous does not pass in this one.
  impl->config.key_prefix = from.config.key_prefix + "/" + scope;
  // On one host every rank is local; across hosts the transport groups the
  // ranks by machine from their identities, whatever these say.
  impl->config.local_rank = from.config.single_host ? rank : 0;
  impl->config.local_size = from.config.single_host ? size : 1;
  impl->replica = from.replica;
  impl->slots = from.slots;
  impl->slots_per_host = from.slots_per_host;
  impl->job_store = from.job_store;
  impl->owns_job_store = false;
  impl->liveness = from.liveness;
  impl->store = c10::make_intrusive<c10d::PrefixStore>(scope, from.job_store->another_connection());
  impl->connect(scope);
  return World(std::move(impl));
}

void WorldAccess::abandon(const World& world, const std::string& why) {
  world.impl_->abandon(why);
}

std::string WorldAccess::broken(const World& world) {
  return world.impl_->broken_because();
}

} // namespace lockstep::detail
