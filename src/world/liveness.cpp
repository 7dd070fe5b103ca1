#include "world/liveness.h"

#include <lockstep/error.h>

#include "common/wording.h"
#include "store/client.h"

namespace lockstep::detail {
namespace {

// After a failed beat (the store's host briefly unreachable), the next try.
constexpr auto kRetryPause = std::chrono::milliseconds(100);
// How long one try to reconnect may take: the thread looks at stop_
// between tries.
constexpr auto kConnectTry = std::chrono::milliseconds(500);

} // namespace

Liveness::Liveness(store::Endpoint endpoint, std::chrono::milliseconds store_timeout,
                   Process me, std::chrono::milliseconds heartbeat_timeout)
    : endpoint_(std::move(endpoint)),
      store_timeout_(store_timeout),
      me_(std::move(me)),
      heartbeat_ms_(heartbeat_timeout.count()) {
  calls_ = std::make_unique<store::StoreClient>(endpoint_, store_timeout_);
  beating_ = std::make_unique<store::StoreClient>(endpoint_, store_timeout_);
  serving_ = beating_->serving().to_string();
  say_hello(*beating_);
  thread_ = std::thread([this] { run(); });
}

Liveness::~Liveness() {
  stop();
}

void Liveness::stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    if (stop_) {
      return;
    }
    stop_ = true;
    if (goodbye_) {
      try {
        std::lock_guard<std::mutex> calls(calls_mutex_);
        // A last word, not worth waiting for a successor of a store that
        // left at the job's end.
        calls_->set_move_wait(kConnectTry);
        calls_->goodbye(me_.slot, me_.incarnation, progress_.load());
      } catch (const std::exception&) {
        // The store is gone: nobody is left to tell.
      }
    }
    if (beating_) {
      beating_->interrupt();
    }
  }
  thread_.join();
}

bool Liveness::connect() {
  std::unique_ptr<store::StoreClient> client;
  try {
    client = std::make_unique<store::StoreClient>(endpoint_, kConnectTry);
    client->set_timeout(store_timeout_);
    say_hello(*client);
    note_serving(*client);
  } catch (const std::exception&) {
    return false;
  }
  std::lock_guard<std::mutex> lock(stop_mutex_);
  if (stop_) {
    return false;
  }
  beating_ = std::move(client);
  return true;
}

void Liveness::run() {
  while (!stop_) {
    try {
      auto timeout = std::chrono::milliseconds(heartbeat_ms_.load());
      uint64_t since;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        since = version_;
      }
      auto change = beating_->watch(progress_.load(), since,
                                    std::max(timeout / 8, std::chrono::milliseconds(1)), timeout);
      if (note_serving(*beating_)) {
        // The beat went to a store that took over (StoreClient asks the
        // successor again): this process says hello there.
        say_hello(*beating_);
        continue;
      }
      apply(change);
    } catch (const std::exception&) {
      if (stop_) {
        return;
      }
      // A client whose answer failed would read a late answer as the next
      // one's: connect anew (and say hello again) once the store answers.
      // Meanwhile the others judge this process by its silence.
      while (!stop_ && !connect()) {
        std::this_thread::sleep_for(kRetryPause);
      }
    }
  }
}

void Liveness::say_hello(store::StoreClient& client) {
  auto newer = client.hello(me_.slot, me_.incarnation,
                            std::chrono::milliseconds(heartbeat_ms_.load()), me_.identity);
  if (newer) {
    std::lock_guard<std::mutex> lock(mutex_);
    replaced_by_ = *newer;
  }
}

bool Liveness::note_serving(const store::StoreClient& client) {
  auto where = client.serving().to_string();
  std::lock_guard<std::mutex> lock(mutex_);
  if (where == serving_) {
    return false;
  }
  // A store that took over knows only the processes that said hello to it
  // since: a process of the view it had that does not say hello there
  // within this process's heartbeat timeout counts as silent (apply()), as
  // the store would have judged it.
  serving_ = where;
  unconfirmed_.clear();
  for (const auto& [slot, seen] : view_) {
    if (seen.state == store::SlotState::Alive) {
      unconfirmed_.insert(slot);
    }
  }
  version_ = 0;
  moved_ = Moved{std::chrono::steady_clock::now(), client.serving().describe()};
  return true;
}

void Liveness::apply(const store::ViewChange& change) {
  // Held while the callback runs and its copy goes: on_change(nullptr)
  // returns only after both, so that what the callback holds (a fault
  // tolerance's watch, and through its world this very Liveness) is never
  // released on this thread, whose join would then wait for itself.
  std::lock_guard<std::mutex> calling(callback_mutex_);
  std::function<void(const std::vector<std::string>&)> callback;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    changed = change.version != version_ || !change.notes.empty();
    version_ = change.version;
    for (const auto& slot : change.slots) {
      unconfirmed_.erase(slot.slot);
      view_[slot.slot] = slot;
      slot_of_identity_[slot.identity] = slot.slot;
      if (slot.slot == me_.slot && slot.incarnation > me_.incarnation) {
        replaced_by_ = slot.incarnation;
      }
    }
    if (!unconfirmed_.empty() && std::chrono::steady_clock::now() - moved_->when >
                                     std::chrono::milliseconds(heartbeat_ms_.load())) {
      for (int slot : unconfirmed_) {
        auto& seen = view_[slot];
        seen.state = store::SlotState::Silent;
        seen.why = str("it has not said hello to the job's store since the store moved to ",
                       moved_->to);
      }
      unconfirmed_.clear();
      changed = true;
    }
    callback = callback_;
  }
  if (changed && callback) {
    callback(change.notes);
  }
}

void Liveness::set_heartbeat_timeout(std::chrono::milliseconds timeout) {
  heartbeat_ms_ = timeout.count(); // declared with the next beat
}

std::chrono::milliseconds Liveness::heartbeat_timeout() const {
  return std::chrono::milliseconds(heartbeat_ms_.load());
}

std::optional<std::string> Liveness::failed(int slot, int incarnation) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = view_.find(slot);
  if (found == view_.end() || found->second.incarnation < incarnation) {
    return std::nullopt; // not heard yet
  }
  const auto& seen = found->second;
  if (seen.incarnation > incarnation) {
    return str("it was replaced by its incarnation ", seen.incarnation);
  }
  if (seen.state == store::SlotState::Alive) {
    return std::nullopt;
  }
  return seen.why;
}

std::optional<std::string> Liveness::failed(const std::string& identity) const {
  int slot = -1;
  int incarnation = -1;
  {
    // By an index, not a scan: a ledger asks this of every peer while it
    // waits, and a scan of a thousand slots per peer was a million steps.
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = slot_of_identity_.find(identity);
    if (found == slot_of_identity_.end()) {
      return std::nullopt;
    }
    const auto& seen = view_.at(found->second);
    if (seen.identity != identity) {
      return std::nullopt; // its slot holds a later process now
    }
    slot = found->second;
    incarnation = seen.incarnation;
  }
  return failed(slot, incarnation);
}

bool Liveness::ended(int slot, int incarnation) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = view_.find(slot);
  return found != view_.end() && found->second.incarnation == incarnation &&
      found->second.state == store::SlotState::Ended;
}

int Liveness::incarnation_of(int slot) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = view_.find(slot);
  return found == view_.end() ? -1 : found->second.incarnation;
}

std::optional<int> Liveness::replaced_by() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return replaced_by_;
}

void Liveness::on_change(std::function<void(const std::vector<std::string>&)> callback) {
  std::lock_guard<std::mutex> calling(callback_mutex_);
  std::lock_guard<std::mutex> lock(mutex_);
  callback_ = std::move(callback);
}

void Liveness::note(const std::string& text) {
  std::lock_guard<std::mutex> lock(calls_mutex_);
  calls_->note(text);
}

void Liveness::report(int slot, int incarnation, const std::string& why) {
  std::lock_guard<std::mutex> lock(calls_mutex_);
  calls_->report(slot, incarnation, why);
}

std::vector<store::SlotProgress> Liveness::progress() {
  std::lock_guard<std::mutex> lock(calls_mutex_);
  return calls_->progress();
}

void Liveness::goodbye() {
  goodbye_ = true;
}

} // namespace lockstep::detail
