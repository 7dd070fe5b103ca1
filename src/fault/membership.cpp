#include "fault/membership.h"

#include <sstream>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <lockstep/error.h>

#include "common/wording.h"
#include "compat/c10d.h"

namespace lockstep::detail {

std::string Member::to_record() const {
  return str(replica, " ", incarnation, " ", step, " ", proof, " ", identity.to_record());
}

Member Member::from_record(const std::string& record) {
  Member member;
  std::istringstream in(record);
  in >> member.replica >> member.incarnation >> member.step >> member.proof >> std::ws;
  std::string rest;
  std::getline(in, rest);
  member.identity = ProcessIdentity::from_record(rest);
  return member;
}

std::string Member::describe() const {
  return str("rank ", replica, " (incarnation ", incarnation, ", pid ", identity.pid, " on ",
             identity.host, ")");
}

std::string epoch_key(int64_t epoch, const std::string& key) {
  return str("e", epoch, "/", key);
}

std::string step_key(int64_t epoch, int64_t step, const std::string& key) {
  return str("e", epoch, "/s", step, "/", key);
}

Membership::Membership(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

namespace {

// A store that does not answer within its timeout (its host cut off, or
// gone) leaves this rank unable to agree on anything: it ends, and
// lockstep-run --restart rank restarts it to rejoin once the store answers.
template <typename Operation>
auto guarded(const char* what, Operation operation) {
  try {
    return operation();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    LOCKSTEP_FAIL(FaultToleranceError, "this rank lost the job's store while it ", what,
                  ", so it can no longer agree with the others on who trains; it ends, and "
                  "lockstep-run --restart rank restarts it to rejoin once the store answers.\n"
                  "  cause: ", describe_exception(e));
  }
}

} // namespace

std::optional<std::string> Membership::read(const std::string& key) {
  return guarded("read its state", [&]() -> std::optional<std::string> {
    if (!store_->check({key})) {
      return std::nullopt;
    }
    auto bytes = store_->get(key);
    return std::string(bytes.begin(), bytes.end());
  });
}

std::string Membership::compare_set(const std::string& key, const std::string& value) {
  return guarded("proposed a decision", [&] {
    auto stored = store_->compareSet(key, {}, std::vector<uint8_t>(value.begin(), value.end()));
    return std::string(stored.begin(), stored.end());
  });
}

void Membership::arrive(int64_t epoch, const Member& me) {
  guarded("announced itself", [&] {
    store_set(*store_, epoch_key(epoch, str("arrive/", me.replica)), me.to_record());
    store_->add(epoch_key(epoch, "wanting"), 1);
  });
}

std::vector<Member> Membership::arrivals(int64_t epoch, int slots) {
  std::vector<Member> found;
  for (int replica = 0; replica < slots; ++replica) {
    if (auto record = read(epoch_key(epoch, str("arrive/", replica)))) {
      found.push_back(Member::from_record(*record));
    }
  }
  return found;
}

bool Membership::wanted(int64_t epoch) {
  return guarded("looked for ranks to take in",
                 [&] { return store_->check({epoch_key(epoch, "wanting")}); });
}

namespace {

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

} // namespace

std::optional<std::vector<Member>> Membership::members(int64_t epoch) {
  auto text = read(epoch_key(epoch, "members"));
  if (!text) {
    return std::nullopt;
  }
  return parse_members(*text);
}

std::vector<Member> Membership::decide_members(int64_t epoch,
                                               const std::vector<Member>& members) {
  std::string text;
  for (const auto& member : members) {
    text += member.to_record() + "\n";
  }
  return parse_members(compare_set(epoch_key(epoch, "members"), text));
}

int64_t Membership::latest_epoch() {
  auto text = read("latest");
  int64_t epoch = text ? std::stoll(*text) : 0;
  while (read(epoch_key(epoch + 1, "members"))) {
    ++epoch;
  }
  return epoch;
}

void Membership::note_latest_epoch(int64_t epoch) {
  guarded("noted its world", [&] { store_set(*store_, "latest", std::to_string(epoch)); });
}

int64_t Membership::vote(int64_t epoch, int64_t step) {
  return guarded("voted", [&] { return store_->add(step_key(epoch, step, "votes"), 1); });
}

std::string Membership::decide_step(int64_t epoch, int64_t step, const std::string& decision) {
  return compare_set(step_key(epoch, step, "decision"), decision);
}

std::optional<std::string> Membership::decision(int64_t epoch, int64_t step) {
  return read(step_key(epoch, step, "decision"));
}

void Membership::finish(int64_t step) {
  compare_set("finished", std::to_string(step));
}

std::optional<int64_t> Membership::finished() {
  auto text = read("finished");
  return text ? std::optional<int64_t>(std::stoll(*text)) : std::nullopt;
}

std::string Membership::abandon(int64_t epoch, const std::string& why) {
  return compare_set(epoch_key(epoch, "abandoned"), why);
}

std::optional<std::string> Membership::abandoned(int64_t epoch) {
  return read(epoch_key(epoch, "abandoned"));
}

} // namespace lockstep::detail
