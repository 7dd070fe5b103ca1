#include "fault/membership.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <thread>

#include <lockstep/error.h>

#include "common/wording.h"
#include "fault/store_guarded.h"
#include "store/client.h"

namespace lockstep::detail {
namespace {

constexpr const char* kProof = "\nproof ";

std::vector<Member> parse_members(const std::string& text) {
  std::vector<Member> members;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) {
      members.push_back(Member::from_record(line));
    }
  }
  return members;
}

std::string members_text(const std::vector<Member>& members) {
  std::string text;
  for (const auto& member : members) {
    text += member.to_record() + "\n";
  }
  return text;
}

} // namespace

std::string Member::to_record() const {
  std::string cut;
  for (int rank : cut_off) {
    cut += str(cut.empty() ? "" : ",", rank);
  }
  return str(replica, " ", incarnation, " ", step, " ", trained, " ",
             probe.empty() ? "-" : probe, " ", cut.empty() ? "-" : cut, " ",
             identity.to_record());
}

Member Member::from_record(const std::string& record) {
  Member member;
  std::istringstream in(record);
  std::string cut;
  in >> member.replica >> member.incarnation >> member.step >> member.trained >> member.probe >>
      cut >> std::ws;
  if (member.probe == "-") {
    member.probe.clear();
  }
  std::istringstream ranks(cut == "-" ? "" : cut);
  for (std::string rank; std::getline(ranks, rank, ',');) {
    member.cut_off.push_back(std::atoi(rank.c_str()));
  }
  std::string rest;
  std::getline(in, rest);
  member.identity = ProcessIdentity::from_record(rest);
  return member;
}

std::string Member::describe() const {
  return str("rank ", replica, " (incarnation ", incarnation, ", pid ", identity.pid, " on ",
             identity.host, ")");
}

std::string describe(const std::vector<Member>& members) {
  std::string ranks;
  for (const auto& member : members) {
    ranks += str(ranks.empty() ? "" : ", ", member.replica);
  }
  return (members.size() == 1 ? "rank " : "ranks ") + ranks;
}

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

int live_state_source(const std::vector<Member>& decided) {
  int source = -1;
  for (int rank = 0; rank < static_cast<int>(decided.size()); ++rank) {
    const auto& member = decided[static_cast<size_t>(rank)];
    if (member.step < 0) {
      continue;
    }
    const Member* best = source < 0 ? nullptr : &decided[static_cast<size_t>(source)];
    if (best == nullptr || member.trained > best->trained ||
        (member.trained == best->trained && member.step > best->step)) {
      source = rank;
    }
  }
  return source;
}

bool behind(const Member& member, const Member& source) {
  return member.step != source.step || member.trained != source.trained;
}

std::string epoch_key(int64_t epoch, const std::string& key) {
  return str("e", epoch, "/", key);
}

Membership::Membership(std::unique_ptr<store::StoreClient> client, const std::string& prefix,
                       Signer signer, std::chrono::milliseconds patience)
    : client_(std::move(client)),
      prefix_(prefix + "/ft/"),
      signer_(std::move(signer)),
      patience_(patience) {}

Membership::~Membership() = default;

std::string Membership::claim(const std::string& what, const std::string& body) const {
  return prefix_ + what + "|" + body;
}

std::string Membership::sign(const std::string& what, const std::string& body) const {
  return body + kProof + signer_.prove(claim(what, body));
}

std::optional<std::string> Membership::proven_body(const std::string& what,
                                                   const std::string& value) const {
  auto at = value.rfind(kProof);
  if (at == std::string::npos) {
    return std::nullopt;
  }
  auto body = value.substr(0, at);
  if (!signer_.proven(claim(what, body), value.substr(at + std::string(kProof).size()))) {
    return std::nullopt;
  }
  return body;
}

namespace {

// Why a value written without the job's secret is ignored.
constexpr const char* kUnproven =
    "without a valid proof of the job secret (a process without the secret wrote it)";

} // namespace

void Membership::note_ignored(const std::string& key, const std::string& value,
                              const std::string& why) {
  if (value != ignored_) {
    ignored_ = value;
    std::cerr << "lockstep WARNING: the job's store holds " << key << " " << why
              << "; it is ignored." << std::endl;
  }
}

std::optional<Epoch> Membership::parse_epoch(const std::string& value) const {
  auto body = proven_body("epoch", value);
  if (!body) {
    return std::nullopt;
  }
  Epoch epoch;
  auto newline = body->find('\n');
  std::istringstream head(body->substr(0, newline));
  LOCKSTEP_ENFORCE(static_cast<bool>(head >> epoch.number >> epoch.lineage) && epoch.number >= 0,
                   FaultToleranceError, "the job's store holds a latest epoch that does not "
                   "read as one (\"", first_line(*body), "\"): this rank refuses to act on it "
                   "and ends.");
  epoch.members = parse_members(newline == std::string::npos ? "" : body->substr(newline + 1));
  epoch.stored = value;
  return epoch;
}

bool Membership::older_than_held(const Epoch& epoch) const {
  return epoch.number < highest_epoch_ ||
      (epoch.number == highest_epoch_ && epoch.lineage < highest_lineage_);
}

std::optional<std::string> Membership::write_back(std::optional<std::string> value,
                                                  const std::string& why, int attempts) {
  // The latest epoch this rank read, signed by its decider, is written
  // back over anything older, unproven, or nothing, by one
  // compare-and-set per try, so that the epochs stay totally ordered. Every
  // rank that finds it so does so; the highest stands.
  for (int attempt = 0; attempt < attempts; ++attempt) {
    if (value) {
      auto there = parse_epoch(*value);
      if (there && !older_than_held(*there)) {
        return value;
      }
    }
    auto stored = client_->compare_set(prefix_ + "epoch", value.value_or(""), held_);
    if (stored == held_) {
      client_->set(prefix_ + epoch_key(highest_epoch_, "members"), held_);
      if (!why.empty()) {
        std::cerr << "lockstep: " << why << "; this rank wrote back the latest epoch it holds ("
                  << highest_epoch_ << ")\n";
      }
    }
    value = stored.empty() ? std::nullopt : std::optional<std::string>(stored);
  }
  return value;
}

Epoch Membership::latest(const std::function<void()>& waiting) {
  constexpr auto kRetry = std::chrono::milliseconds(100);
  const auto give_up_at = std::chrono::steady_clock::now() + patience_;
  for (int retry = 0;; ++retry) {
    auto value = store_guarded("read the latest epoch", [&] {
      auto read = client_->get(prefix_ + "epoch");
      if (client_->moves() != moves_seen_ && !held_.empty()) {
        // A store that took over from one that is gone holds only what was
        // written to it since.
        read = write_back(read, "the job's store moved to " + client_->serving().describe());
      }
      moves_seen_ = client_->moves();
      return read;
    });
    if (!value) {
      LOCKSTEP_ENFORCE(highest_epoch_ < 0, FaultToleranceError, "the job's latest epoch went "
                       "back from ", highest_epoch_, " to none: the job's store was restarted "
                       "where it stood, or emptied. This rank refuses to act on it and ends.");
      return Epoch{};
    }
    auto epoch = parse_epoch(*value);
    std::string wrong;
    if (!epoch) {
      wrong = kUnproven;
    } else if (older_than_held(*epoch)) {
      wrong = str("older than the one this rank read (epoch ", epoch->number, ", lineage ",
                  epoch->lineage, " after epoch ", highest_epoch_, ", lineage ",
                  highest_lineage_, "): an old value put back");
    }
    if (wrong.empty()) {
      LOCKSTEP_ENFORCE(epoch->lineage >= highest_lineage_, FaultToleranceError, "the job's "
                       "lineage went back from epoch ", highest_lineage_, " to ", epoch->lineage,
                       " in a later epoch (", epoch->number, "): the epochs forked. This rank "
                       "refuses to act on it and ends.");
      // One decision per epoch: the same epoch and lineage with other
      // members is a second decision (a store that took over, where a rank
      // that held only an older epoch decided over it before the latest
      // came back).
      LOCKSTEP_ENFORCE(epoch->number != highest_epoch_ || epoch->lineage != highest_lineage_ ||
                           epoch->stored == held_,
                       FaultToleranceError, "the job's store holds another decision for epoch ",
                       epoch->number, " than the one this rank acted on: the epochs forked "
                       "(after the store moved?). This rank refuses to act on it and ends.");
      highest_epoch_ = epoch->number;
      highest_lineage_ = epoch->lineage;
      held_ = epoch->stored;
      return *epoch;
    }
    note_ignored("a latest epoch", *value, wrong);
    LOCKSTEP_ENFORCE(std::chrono::steady_clock::now() < give_up_at, FaultToleranceError,
                     "the job's store has held a latest epoch ", wrong, " for ",
                     seconds(patience_),
                     held_.empty() ? ", and no member wrote the genuine one back: this rank, "
                                     "which has read none, cannot tell who trains, and ends."
                                   : ", though this rank wrote back the latest it read: "
                                     "something writes over it; this rank ends.");
    if (!held_.empty()) {
      // What this rank read, signed by its decider, goes back over it (the
      // warning above said why).
      // One compare-and-set per read: where something keeps writing over
      // the write-back, no faster than one per kRetry.
      store_guarded("wrote the latest epoch back", [&] { return write_back(value, "", 1); });
      if (retry > 0) {
        std::this_thread::sleep_for(kRetry);
      }
      continue;
    }
    if (waiting && retry % 10 == 0) {
      waiting(); // once a second
    }
    std::this_thread::sleep_for(kRetry);
  }
}

std::string Membership::epoch_value(int64_t number, int64_t lineage,
                                    const std::vector<Member>& members) const {
  return sign("epoch", str(number, " ", lineage, "\n", members_text(members)));
}

Epoch Membership::decide(const Epoch& after, const std::vector<Member>& members) {
  int64_t number = after.number + 1;
  auto value = epoch_value(number, after.formed() ? after.number : after.lineage, members);
  store_guarded("proposed a world", [&] {
    auto stored = client_->compare_set(prefix_ + "epoch", after.stored, value);
    if (stored == value) {
      // For those who wait on this epoch's key.
      client_->set(prefix_ + epoch_key(number, "members"), value);
    }
    return stored;
  });
  return latest();
}

std::optional<std::vector<Member>> Membership::await_members(int64_t epoch,
                                                             std::chrono::milliseconds wait) {
  auto key = epoch_key(epoch, "members");
  auto value = store_guarded("waited for a world",
                             [&] { return client_->wait_get(prefix_ + key, wait); });
  if (!value) {
    return std::nullopt;
  }
  auto body = proven_body("epoch", *value);
  if (!body) {
    // The decider's own set comes after its compare-and-set: wait for it.
    note_ignored("epoch " + std::to_string(epoch) + "'s members", *value,
                 kUnproven);
    std::this_thread::sleep_for(std::min(wait, std::chrono::milliseconds(100)));
    return std::nullopt;
  }
  auto newline = body->find('\n');
  LOCKSTEP_ENFORCE(std::stoll(body->substr(0, newline)) == epoch, FaultToleranceError,
                   "the job's store holds another epoch's members under ", key, ".");
  return parse_members(newline == std::string::npos ? "" : body->substr(newline + 1));
}

void Membership::arrive(int64_t epoch, const Member& me) {
  store_guarded("announced itself", [&] {
    client_->set(prefix_ + epoch_key(epoch, str("arrive/", me.replica)),
                 sign(str("arrive|", epoch), me.to_record()));
    return 0;
  });
}

std::vector<Member> Membership::arrivals(int64_t epoch) {
  auto found = store_guarded("looked for the ranks that arrived", [&] {
    return client_->get_prefix(prefix_ + epoch_key(epoch, "arrive/"));
  });
  std::vector<Member> members;
  const std::string under = prefix_ + epoch_key(epoch, "arrive/");
  for (const auto& [key, value] : found) {
    // An arrival without a valid proof is never taken in (but refuses
    // nothing: anyone may write one), nor one copied under another slot's
    // key (the same member twice).
    if (auto body = proven_body(str("arrive|", epoch), value)) {
      auto member = Member::from_record(*body);
      if (key == under + std::to_string(member.replica)) {
        members.push_back(member);
      }
    }
  }
  return members;
}

bool Membership::await_arrivals(int64_t epoch, const std::vector<Member>& members,
                                std::chrono::milliseconds wait) {
  std::vector<std::string> keys;
  for (const auto& member : members) {
    keys.push_back(prefix_ + epoch_key(epoch, str("arrive/", member.replica)));
  }
  return store_guarded("waited for the ranks to come", [&] { return client_->wait(keys, wait); });
}

std::string Membership::abandon(int64_t epoch, const std::string& why, bool* first) {
  const std::string key = prefix_ + epoch_key(epoch, "abandoned");
  auto proposed = sign(str("abandon|", epoch), why);
  std::string expected;
  for (int attempt = 0;; ++attempt) {
    auto stored = store_guarded("gave its world up",
                                [&] { return client_->compare_set(key, expected, proposed); });
    if (first != nullptr) {
      *first = stored == proposed;
    }
    if (auto body = proven_body(str("abandon|", epoch), stored)) {
      return *body;
    }
    // Written without the job's secret: not acted on, and replaced by this
    // rank's reason (a forger could otherwise end every rank that gives
    // its world up after it, or keep the epoch's reason from being told).
    std::cerr << "lockstep WARNING: the job's store held a reason for giving epoch " << epoch
              << " up " << kUnproven << "; it is ignored and replaced." << std::endl;
    LOCKSTEP_ENFORCE(attempt < 3, FaultToleranceError, "the job's store keeps holding a reason "
                     "for giving epoch ", epoch, " up without a valid proof of the job secret: "
                     "a process without the secret keeps writing it; keep the store's port "
                     "closed to others (docs/world.md#security).");
    expected = stored;
  }
}

std::optional<std::string> Membership::abandoned(int64_t epoch) {
  auto stored = store_guarded("read why its world was given up", [&] {
    return client_->get(prefix_ + epoch_key(epoch, "abandoned"));
  });
  if (!stored) {
    return std::nullopt;
  }
  auto body = proven_body(str("abandon|", epoch), *stored);
  if (!body) {
    note_ignored(str("a reason for giving epoch ", epoch, " up"), *stored, kUnproven);
  }
  return body;
}

void Membership::retire(int64_t epoch) {
  if (epoch >= 0) {
    store_guarded("cleaned up",
                  [&] { return client_->erase_prefix(prefix_ + epoch_key(epoch, "")); });
  }
}

std::vector<int64_t> Membership::retire_through(int64_t epoch) {
  // From where the last one stopped: a rank 0 that died before it
  // retired, or an epoch that never formed, leaves nothing behind for long.
  auto value =
      store_guarded("read what was retired", [&] { return client_->get(prefix_ + "retired"); });
  int64_t from = 0;
  if (value) {
    try {
      from = std::stoll(*value) + 1;
    } catch (const std::exception&) {
      from = 0; // not ours: retire from the start
    }
  }
  std::vector<int64_t> retired;
  for (int64_t e = std::max<int64_t>(from, 0); e <= epoch; ++e) {
    retire(e);
    retired.push_back(e);
  }
  if (!retired.empty()) {
    store_guarded("noted what was retired", [&] {
      client_->set(prefix_ + "retired", std::to_string(epoch));
      return 0;
    });
  }
  return retired;
}

std::string Membership::state_claim(int source, int64_t step, const std::string& digest) {
  return str(source, " ", step, " ", digest);
}

void Membership::announce_state(int64_t epoch, int source, int64_t step,
                                const std::string& digest) {
  store_guarded("announced the live state", [&] {
    client_->set(prefix_ + epoch_key(epoch, str("state/", source)),
                 sign(str("state|", epoch), state_claim(source, step, digest)));
    return 0;
  });
}

std::optional<std::string> Membership::announced_state(int64_t epoch, int source,
                                                       std::chrono::milliseconds wait) {
  auto value = store_guarded("waited for the live state's announcement", [&] {
    return client_->wait_get(prefix_ + epoch_key(epoch, str("state/", source)), wait);
  });
  if (!value) {
    return std::nullopt;
  }
  auto body = proven_body(str("state|", epoch), *value);
  if (!body) {
    note_ignored("an announcement of the live state of epoch " + std::to_string(epoch), *value,
                 kUnproven);
  }
  return body;
}

int Membership::store_moves() const {
  return client_->moves();
}

bool Membership::mark_formed(int64_t epoch) {
  // Every member tries: the first compare-and-set wins, the others find
  // it marked. A later epoch decided over the unmarked value means the
  // others gave this world up before it was known to have formed.
  while (true) {
    auto now = latest();
    if (now.number != epoch) {
      return false;
    }
    if (now.formed()) {
      return true;
    }
    auto value = epoch_value(epoch, epoch, now.members);
    store_guarded("marked its world formed", [&] {
      return client_->compare_set(prefix_ + "epoch", now.stored, value);
    });
  }
}

int64_t Membership::lineage() {
  return latest().lineage;
}

bool Membership::finished() {
  auto value = store_guarded("read whether the job ended",
                             [&] { return client_->get(prefix_ + "finished"); });
  if (!value) {
    return false;
  }
  auto body = proven_body("finished", *value);
  if (!body) {
    note_ignored("the job's end", *value,
                 kUnproven);
  }
  return body == std::optional<std::string>(kFinished);
}

void Membership::left(int replica, int incarnation, const char* why) {
  store_guarded("said it leaves", [&] {
    client_->set(prefix_ + str("left/", replica, "/", incarnation),
                 sign(str("left|", replica, "|", incarnation), why));
    return 0;
  });
}

void leave_ended_job(Membership& membership, int replica, int incarnation) {
  // An earlier incarnation of this rank in the last world trained to the
  // end with it: it failed after the loop (a dropped member would have
  // been left out of a later world), and that is the job's failure, not
  // one that a restart covers.
  auto last = membership.latest();
  auto earlier = std::find_if(last.members.begin(), last.members.end(), [&](const Member& m) {
    return m.replica == replica && m.incarnation < incarnation;
  });
  if (earlier != last.members.end()) {
    membership.left(replica, incarnation, kCrashedAfterLoop);
    LOCKSTEP_FAIL(FaultToleranceError, earlier->describe(), " failed after the job's loop: it "
                  "was a member of the last world (epoch ", last.number, "), which trained to "
                  "the end, so its restart has nothing to rejoin and the job fails (a failure "
                  "after the loop is no fault that a restart covers).");
  }
  membership.left(replica, incarnation, kLeft);
  LOCKSTEP_FAIL(FaultToleranceError, "rank ", replica, " was restarted to rejoin, but the "
                "job's other ranks have finished their loop: there is no training left to "
                "rejoin.");
}

} // namespace lockstep::detail
