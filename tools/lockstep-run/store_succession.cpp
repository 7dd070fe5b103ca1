// The succession of the job's store (lockstep-run --store-successors):
// which launcher serves it once the one that did is gone, what the new one
// starts with, and how the one that serves it ends. The rule and its
// limits are docs/fault-tolerance.md's ("The store moves").

#include <algorithm>
#include <iostream>
#include <sstream>
#include <thread>

#include "launcher_store.h"
#include "store/client.h"
#include "store/server.h"
#include "world/job_keys.h"
#include "world/job_secret.h"

namespace lockstep::run {

bool LauncherStore::served_by_a_successor() {
  auto candidates = store_endpoint().candidates();
  for (size_t k = 1; k < candidates.size(); ++k) {
    if (store::presence(candidates[k], kConnectTry) != store::Presence::Listening) {
      continue;
    }
    try {
      store::StoreClient client(candidates[k], kConnectTry);
      client.set_timeout(kStoreTimeout);
      // The job's record, with its proof of the secret where there is one:
      // a store another process serves there is not the job's.
      std::istringstream fields(client.get(detail::kJobRecordKey).value_or(""));
      std::string job, nonce, proof;
      fields >> job >> nonce >> proof;
      if (job == job_id_ &&
          (secret_.empty() || detail::proven(secret_, "job|" + job + "|" + nonce, proof))) {
        std::cerr << "lockstep-run: node " << k << " serves the job's store at "
                  << candidates[k].describe() << " (it took over from node 0): this launcher "
                  << "joins the job there" << std::endl;
        return true;
      }
    } catch (const std::exception&) {
      // Not this job's store (another secret, or no store).
    }
  }
  return false;
}

void LauncherStore::take_over_if_gone() {
  size_t mine = static_cast<size_t>(options_.node_rank);
  auto candidates = store_endpoint().candidates();
  if (server_ || candidates.size() == 1 || mine >= candidates.size()) {
    return;
  }
  // In the job's order: node k waits k seconds, so that an earlier node
  // that lives takes over first and the later ones find it serving.
  for (size_t waited = 0; waited < mine * 10; ++waited) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> lock(hung_mutex_);
    if (stop_) {
      return;
    }
  }
  if (loop_ended_) {
    return; // a store gone once the job's loop ended is the job ending
  }
  // Only where every other store of the job is known gone: its host
  // answers that nothing listens there. A host that does not answer at
  // all may be cut off rather than dead, with its store serving the ranks
  // on its side: taking over then would split the job in two.
  for (size_t k = 0; k < candidates.size(); ++k) {
    if (k != mine && store::presence(candidates[k], kConnectTry) != store::Presence::Refused) {
      return;
    }
  }
  // It starts with what this launcher held of the gone one: the job's
  // record, and the latest epoch it read (at most a second old), so that
  // no rank that held only an older epoch decides over it before the
  // ranks that hold the latest write it back (membership.cpp).
  std::map<std::string, std::string> held;
  if (!record_.empty()) {
    held[detail::kJobRecordKey] = record_;
  }
  if (latest_epoch_.first == prefix(attempt_) + "/ft/epoch") {
    held[latest_epoch_.first] = latest_epoch_.second;
  }
  try {
    server_ = std::make_unique<store::StoreServer>(store::ServerOptions{
        store::Endpoint::tcp("", candidates[mine].port), {}, secret_});
    server_->preload(std::move(held));
    server_->start();
    serving_ = true;
  } catch (const std::exception& e) {
    std::cerr << "lockstep-run: cannot take over the job's store at "
              << candidates[mine].describe() << ": " << e.what() << std::endl;
    server_.reset();
    return;
  }
  std::cerr << "lockstep-run: the job's store is gone (every other address of it answers "
            << "that nothing listens there); node " << mine << " serves it from now on at "
            << candidates[mine].describe() << ", and the ranks write back what they hold"
            << std::endl;
}

void LauncherStore::linger(std::chrono::seconds limit) {
  if (!serving_ || options_.store_successors.empty()) {
    return;
  }
  // The job's loop ended here, while the other nodes' ranks may still be
  // saying goodbye: a store that left before them would be taken over by
  // a successor for nothing. The others' watchers read that it ended (at
  // least once a second), and it waits for the processes still alive.
  auto now = std::chrono::steady_clock::now();
  auto deadline = now + limit;
  auto read_by_all = now + 2 * std::chrono::seconds(1);
  try {
    store::StoreClient client(store_endpoint(), kConnectTry);
    client.set(kEndedKey, "1");
    while (std::chrono::steady_clock::now() < deadline) {
      auto slots = client.watch(0, 0, std::chrono::milliseconds(0), {}).slots;
      if (std::chrono::steady_clock::now() >= read_by_all &&
          std::none_of(slots.begin(), slots.end(), [](const store::SlotView& slot) {
            return slot.state == store::SlotState::Alive;
          })) {
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // Its own store does not answer: nothing to wait for.
  }
}

void LauncherStore::write_back(store::StoreClient& client) {
  if (!record_.empty()) {
    client.compare_set(detail::kJobRecordKey, "", record_);
  }
  std::string lines;
  for (const auto& [slot, incarnation] : incarnations_) {
    lines += std::to_string(slot) + " " + std::to_string(incarnation) + "\n";
  }
  if (!lines.empty()) {
    client.set(kIncarnationsKey, lines);
  }
  std::lock_guard<std::mutex> lock(finished_mutex_);
  if (!finished_key_.empty()) {
    client.set(finished_key_, finished_value_);
  }
}

} // namespace lockstep::run
