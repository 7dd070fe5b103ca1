// A thousand ranks, simulated: N members run fault tolerance's real
// agreement (src/fault/agreement.h), membership and liveness code, each on
// threads and connections of its own, against the real job store, in one
// process and with no model. Prints one CSV line:
//
//   members,group_size,secret,latency_ms,heartbeat_ms,idle_ops_per_s,
//   want_seen_ms,exit_detect_ms,exit_to_epoch_ms,stop_detect_ms,
//   false_failures
//
//   ft_scale MEMBERS [LATENCY_MS=0] [HEARTBEAT_MS=2000] [GROUP_SIZE=1]
//            [SECRET=1]
//
// GROUP_SIZE: the members are replica groups of that many (FaultTolerance
// over replica_groups): the exit ends the whole group of the member that
// exits, and the next epoch takes in whole groups only. SECRET=1: every
// decision is signed and checked with a job secret (HMAC), as in a job
// across hosts.
// idle: store operations per second with the members only beating, which
// is also what training costs the store: a steady step makes no store
// operation (its verdict is agreed in the step's own world).
// want_seen: from a rank's note that it asks to join until every member's
// liveness has it (the members then re-form after their next commit).
// exit_detect: from a member's process ending (its connection closes)
// until every other member's liveness shows it; exit_to_epoch: until
// every survivor (every member of the other groups) knows the next
// epoch's members. stop_detect: a member
// that falls silent (stopped), until every member sees it failed.
// false_failures: failures seen of members that were alive. LATENCY_MS
// holds every answer of the store that long (a slow store).

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "fault/agreement.h"
#include "fault/membership.h"
#include "store/client.h"
#include "store/server.h"
#include "world/job_secret.h"
#include "world/liveness.h"

namespace {

using namespace lockstep;
using Clock = std::chrono::steady_clock;

struct Member {
  detail::Member me;
  std::shared_ptr<detail::Liveness> liveness;
  std::unique_ptr<detail::Membership> membership;
  std::unique_ptr<detail::Agreement> agreement;
  Clock::time_point decided{};
  std::atomic<int64_t> saw_exit_ns{0};
  std::atomic<int64_t> saw_stop_ns{0};
  std::atomic<int64_t> saw_want_ns{0};
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: ft_scale MEMBERS [LATENCY_MS] [HEARTBEAT_MS] [GROUP_SIZE] "
                         "[SECRET]\n");
    return 2;
  }
  int n = std::atoi(argv[1]);
  auto latency = std::chrono::milliseconds(argc > 2 ? std::atoi(argv[2]) : 0);
  auto heartbeat = std::chrono::milliseconds(argc > 3 ? std::atoi(argv[3]) : 2000);
  const int group_size = argc > 4 ? std::atoi(argv[4]) : 1;
  const bool secured = argc > 5 ? std::atoi(argv[5]) != 0 : true;
  if (group_size < 1 || n % group_size != 0 || n / group_size < 2) {
    std::fprintf(stderr, "ft_scale: %d members are not two or more groups of %d\n", n,
                 group_size);
    return 2;
  }
  // Three connections a member, and the store's end of each.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);

  auto folder = std::filesystem::temp_directory_path() /
      ("lockstep-ft-scale-" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  const std::string secret = "ft-scale";
  // With the secret, every connection proves it on connecting, as a job's.
  store::StoreServer server(store::ServerOptions{
      store::Endpoint::unix_socket((folder / "store").string()), latency, secured ? secret : ""});
  server.start();
  auto endpoint = server.endpoint();
  endpoint.secret = secured ? secret : "";
  auto store_timeout = std::chrono::seconds(60);
  detail::Signer signer{
      [&](const std::string& claim) {
        return secured ? detail::prove(secret, claim) : std::string("-");
      },
      [&](const std::string& claim, const std::string& proof) {
        return !secured || detail::proven(secret, claim, proof);
      },
      secured};
  detail::AgreementOptions options;
  options.step_timeout = std::chrono::minutes(5);
  options.timeout = std::chrono::minutes(5);
  options.group_size = group_size;

  std::vector<std::unique_ptr<Member>> members(static_cast<size_t>(n));
  std::vector<detail::Member> records;
  std::atomic<int> false_failures{0};
  const int exiting = n - 1; // the member whose process ends, with its group
  const int survivors = n - group_size;
  auto leaves = [&](int slot) { return slot / group_size == exiting / group_size; };
  for (int i = 0; i < n; ++i) {
    auto member = std::make_unique<Member>();
    member->me.replica = i;
    member->me.step = 0;
    member->me.trained = 0;
    member->me.identity.host = "sim";
    member->me.identity.machine = "sim";
    member->me.identity.pid = 100000 + i;
    member->liveness = std::make_shared<detail::Liveness>(
        endpoint, store_timeout,
        detail::Liveness::Process{i, 0, member->me.identity.to_record()}, heartbeat);
    member->membership = std::make_unique<detail::Membership>(
        std::make_unique<store::StoreClient>(endpoint, store_timeout), "lockstep/sim/0", signer);
    member->agreement = std::make_unique<detail::Agreement>(*member->membership,
                                                           *member->liveness, options);
    records.push_back(member->me);
    members[static_cast<size_t>(i)] = std::move(member);
  }
  // What each member's liveness sees: the exit and the stop, and any other
  // failure (a false one: every other member lives).
  const int stopped_slot = n; // a member that only beats, then falls silent
  for (auto& member : members) {
    auto* m = member.get();
    m->liveness->on_change([m, exiting, stopped_slot, &false_failures, n, &leaves](
                               const std::vector<std::string>& notes) {
      for (const auto& note : notes) {
        if (note.rfind(detail::kWantNote, 0) == 0) {
          int64_t zero = 0;
          m->saw_want_ns.compare_exchange_strong(zero, now_ns());
        }
      }
      for (int slot = 0; slot <= n; ++slot) {
        if (!m->liveness->failed(slot, 0)) {
          continue;
        }
        if (slot == exiting) {
          int64_t zero = 0;
          m->saw_exit_ns.compare_exchange_strong(zero, now_ns());
        } else if (slot <= exiting && leaves(slot)) {
          // the exiting member's group, ending with it
        } else if (slot == stopped_slot) {
          int64_t zero = 0;
          m->saw_stop_ns.compare_exchange_strong(zero, now_ns());
        } else {
          ++false_failures;
        }
      }
    });
  }
  members[0]->membership->decide(detail::Epoch{}, records);
  members[0]->membership->mark_formed(0);

  store::StoreClient observer(endpoint, store_timeout);
  auto operations = [&] { return observer.stats().operations; };
  // Idle: only heartbeats.
  std::this_thread::sleep_for(heartbeat);
  auto idle_from = operations();
  auto idle_start = Clock::now();
  std::this_thread::sleep_for(heartbeat);
  double idle_ops = static_cast<double>(operations() - idle_from) /
      std::chrono::duration<double>(Clock::now() - idle_start).count();

  // A steady step makes no store operation (its verdict is agreed in the
  // step's world): what stepping costs the store is the idle rate above.
  // A rank that asks to join tells every member by one note.
  auto want_at = now_ns();
  observer.note(std::string(detail::kWantNote) + "1");
  int64_t want_seen = 0;
  for (auto& member : members) {
    auto limit = Clock::now() + std::chrono::seconds(30);
    while (member->saw_want_ns == 0 && Clock::now() < limit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    want_seen = std::max(want_seen, member->saw_want_ns.load());
  }
  std::vector<std::thread> threads;

  // A member whose process ends: its connections close.
  auto exit_at = now_ns();
  members[static_cast<size_t>(exiting)]->liveness.reset();
  members[static_cast<size_t>(exiting)]->membership.reset();
  // Its group's other ranks see it and end too.
  for (int i = survivors; i < exiting; ++i) {
    auto& m = *members[static_cast<size_t>(i)];
    while (m.saw_exit_ns == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    m.liveness.reset();
    m.membership.reset();
  }
  std::vector<std::pair<int64_t, std::vector<detail::Member>>> epochs(
      static_cast<size_t>(survivors));
  std::vector<int64_t> epoch_ns(static_cast<size_t>(survivors));
  for (int i = 0; i < survivors; ++i) {
    threads.emplace_back([&, i] {
      auto& m = *members[static_cast<size_t>(i)];
      while (m.saw_exit_ns == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      auto me = m.me;
      me.step = 1;
      while (true) {
        auto next = m.agreement->next_epoch(me, Clock::now() + std::chrono::minutes(5));
        if (next) {
          epochs[static_cast<size_t>(i)] = *next;
          epoch_ns[static_cast<size_t>(i)] = now_ns();
          return;
        }
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  int64_t detected = 0, formed = 0;
  for (int i = 0; i < survivors; ++i) {
    detected = std::max(detected, members[static_cast<size_t>(i)]->saw_exit_ns.load());
    formed = std::max(formed, epoch_ns[static_cast<size_t>(i)]);
    if (epochs[static_cast<size_t>(i)].first != 1 ||
        static_cast<int>(epochs[static_cast<size_t>(i)].second.size()) != survivors) {
      std::fprintf(stderr, "ft_scale: member %d formed epoch %lld of %zu members\n", i,
                   static_cast<long long>(epochs[static_cast<size_t>(i)].first),
                   epochs[static_cast<size_t>(i)].second.size());
      return 1;
    }
  }

  // A member that stops: it beats once, then no more.
  store::StoreClient stopped(endpoint, store_timeout);
  stopped.hello(stopped_slot, 0, heartbeat, "stopped");
  stopped.watch(1, 0, std::chrono::milliseconds(1), heartbeat);
  auto stop_at = now_ns();
  int64_t stop_seen = 0;
  for (int i = 0; i < survivors; ++i) {
    auto& m = *members[static_cast<size_t>(i)];
    auto limit = Clock::now() + 4 * heartbeat + std::chrono::seconds(10);
    while (m.saw_stop_ns == 0 && Clock::now() < limit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    stop_seen = std::max(stop_seen, m.saw_stop_ns.load());
  }
  std::printf("%d,%d,%d,%lld,%lld,%.0f,%.1f,%.1f,%.1f,%.0f,%d\n", n, group_size,
              secured ? 1 : 0, static_cast<long long>(latency.count()), static_cast<long long>(heartbeat.count()),
              idle_ops, (want_seen - want_at) / 1e6, (detected - exit_at) / 1e6,
              (formed - exit_at) / 1e6, (stop_seen - stop_at) / 1e6, false_failures.load());
  std::fflush(stdout);
  members.clear();
  server.stop();
  std::filesystem::remove_all(folder);
  return 0;
}
