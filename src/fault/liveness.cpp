#include "fault/liveness.h"

#include <sstream>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "compat/c10d.h"
#include "world/epoch_world.h"

namespace lockstep::detail {
namespace {

// How often the thread looks: a process gone on this host is seen within
// it, and the heartbeat goes out at least this often.
constexpr auto kLook = std::chrono::milliseconds(25);

} // namespace

Liveness::Liveness(std::function<c10::intrusive_ptr<c10d::Store>()> connect,
                   const Member& me,
                   int slots,
                   std::chrono::milliseconds heartbeat_timeout)
    : connect_(std::move(connect)),
      membership_(std::make_unique<Membership>(connect_())),
      me_(me),
      slots_(slots),
      timeout_(heartbeat_timeout),
      started_(Clock::now()),
      beats_(slots) {
  listen(); // this rank's first beat is out before it announces itself
  thread_ = std::thread([this] { run(); });
}

Liveness::~Liveness() {
  stop_ = true;
  wake_.notify_all();
  thread_.join();
}

void Liveness::run() {
  std::mutex sleeping;
  while (!stop_) {
    try {
      listen();
      judge();
    } catch (const std::exception&) {
      // The store is unreachable (for good: the main thread's waits say so,
      // with their own limits). A client whose answer timed out would read
      // that late answer as the next one's: connect anew.
      try {
        membership_ = std::make_unique<Membership>(connect_());
      } catch (const std::exception&) {
      }
    }
    std::unique_lock<std::mutex> lock(sleeping);
    wake_.wait_for(lock, kLook, [this] { return stop_.load(); });
  }
}

void Liveness::listen() {
  // Heartbeats go out and are read every eighth of the timeout (each is a
  // record in a file store, a round trip to a TCP one); a process gone on
  // this host is seen every look, without the store.
  auto now = Clock::now();
  if (now < next_listen_) {
    return;
  }
  next_listen_ = now + timeout_ / 8;
  // The store is read outside the lock: failed() must not wait on it.
  auto& store = membership_->store();
  std::vector<std::optional<Beat>> heard(slots_);
  for (int replica = 0; replica < slots_; ++replica) {
    if (!store.check({str("beat/", replica)})) {
      continue;
    }
    auto bytes = store.get(str("beat/", replica));
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    Beat beat;
    in >> beat.incarnation >> beat.count;
    heard[replica] = beat;
  }
  // This rank's own key shows a newer incarnation once its rank was
  // restarted: this process is then stale, and says nothing more.
  auto& mine = heard[me_.replica];
  if (!mine || mine->incarnation <= me_.incarnation) {
    store_set(store, str("beat/", me_.replica), str(me_.incarnation, " ", ++sent_));
    mine.reset();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (int replica = 0; replica < slots_; ++replica) {
    auto& beat = beats_[replica];
    if (heard[replica] &&
        (heard[replica]->incarnation != beat.incarnation || heard[replica]->count != beat.count)) {
      beat = *heard[replica];
      beat.changed = now;
    }
  }
}

std::optional<std::string> Liveness::failed(const Member& member) {
  if (member.replica == me_.replica && member.incarnation == me_.incarnation) {
    return std::nullopt;
  }
  if (process_gone(member.identity)) {
    return str(member.describe(), " exited");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& beat = beats_[member.replica];
  if (beat.incarnation > member.incarnation) {
    return str(member.describe(), " was replaced by its incarnation ", beat.incarnation);
  }
  auto since = beat.count < 0 ? started_ : beat.changed;
  auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - since);
  if (silent > timeout_) {
    return str(member.describe(), " sent no heartbeat for ", silent.count(),
               " ms (the heartbeat timeout is ", timeout_.count(), " ms): it is stopped, "
               "hung or cut off");
  }
  return std::nullopt;
}

int Liveness::incarnation_of(int replica) {
  std::lock_guard<std::mutex> lock(mutex_);
  return beats_[replica].incarnation;
}

void Liveness::watch(int64_t epoch, std::vector<Member> members, World world) {
  std::lock_guard<std::mutex> lock(mutex_);
  watched_epoch_ = epoch;
  watched_ = std::move(members);
  world_ = std::move(world);
  verdict_.clear();
}

std::string Liveness::verdict() {
  std::lock_guard<std::mutex> lock(mutex_);
  return verdict_;
}

void Liveness::judge() {
  int64_t epoch;
  std::vector<Member> members;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!world_ || !verdict_.empty()) {
      return;
    }
    epoch = watched_epoch_;
    members = watched_;
  }
  std::string why;
  for (const auto& member : members) {
    if (auto failure = failed(member)) {
      why = *failure;
      break;
    }
  }
  if (why.empty()) {
    auto reported = membership_->abandoned(epoch);
    if (!reported) {
      return;
    }
    why = *reported;
  } else {
    why = membership_->abandon(epoch, why);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (watched_epoch_ == epoch && verdict_.empty()) {
    verdict_ = why;
    WorldAccess::abandon(*world_, why);
  }
}

} // namespace lockstep::detail
