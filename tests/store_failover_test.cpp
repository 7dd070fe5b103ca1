// A store that takes over (lockstep-run --store-successors): a client whose
// store closed its connection asks the next address of the job's list, and
// asks its request again there, never twice of the same store; what the
// gone store held comes back from the ranks (the latest epoch, the highest
// standing) and the liveness view is confirmed by the new store, a process
// that never says hello there counting as silent. The launchers' part, a
// whole node lost in turn, is fault_store_failover_test.cpp.

#include <chrono>
#include <future>
#include <memory>
#include <thread>

#include <gtest/gtest.h>

#include <lockstep/error.h>

#include "fault/membership.h"
#include "store/client.h"
#include "store/server.h"
#include "support/expect_error.h"
#include "support/members.h"
#include "support/multiprocess.h"
#include "support/silent_host.h"
#include "world/job_secret.h"
#include "world/liveness.h"

namespace lockstep::testing {
namespace {

using namespace std::chrono_literals;
using detail::Member;
using detail::Membership;

// Two addresses of one job's store on this host: node 0's, where it is
// served first, and its successor's, where it is served once node 0's is
// gone.
class TwoAddresses : public ::testing::Test {
 protected:
  void serve(int which) {
    servers_[which] = std::make_unique<store::StoreServer>(
        store::ServerOptions{store::Endpoint::tcp("127.0.0.1", ports_[which]), {}, ""});
    servers_[which]->start();
  }
  void stop(int which) {
    servers_[which]->stop();
    servers_[which].reset();
  }
  store::Endpoint endpoint() const {
    auto endpoint = store::Endpoint::tcp("127.0.0.1", ports_[0]);
    endpoint.successors.push_back(store::Endpoint::tcp("127.0.0.1", ports_[1]));
    return endpoint;
  }
  std::unique_ptr<store::StoreClient> client() {
    return std::make_unique<store::StoreClient>(endpoint(), 5s);
  }
  std::unique_ptr<Membership> membership() {
    detail::Signer signer;
    signer.prove = [](const std::string& claim) {
      return detail::prove("s3cret", "ft|job|" + claim + "|n");
    };
    signer.proven = [](const std::string& claim, const std::string& proof) {
      return detail::proven("s3cret", "ft|job|" + claim + "|n", proof);
    };
    signer.secured = true;
    return std::make_unique<Membership>(client(), "lockstep/job/0", signer);
  }
  int ports_[2] = {free_port(), free_port()};
  std::unique_ptr<store::StoreServer> servers_[2];
};

TEST(StorePresence, ListeningRefusedOrSilent) {
  store::StoreServer server(
      store::ServerOptions{store::Endpoint::tcp("127.0.0.1", 0), {}, ""});
  server.start();
  EXPECT_EQ(store::presence(server.endpoint(), 1s), store::Presence::Listening);
  EXPECT_EQ(store::presence(store::Endpoint::tcp("127.0.0.1", free_port()), 1s),
            store::Presence::Refused);
  Silent silent;
  EXPECT_EQ(store::presence(store::Endpoint::parse("tcp:" + silent.endpoint()), 300ms),
            store::Presence::Silent);
}

TEST(StoreEndpoint, SuccessorsTravelInItsText) {
  auto endpoint = store::Endpoint::parse("tcp:10.0.0.1:29500,tcp:10.0.0.2:29501");
  EXPECT_EQ(endpoint.describe(), "10.0.0.1:29500");
  ASSERT_EQ(endpoint.successors.size(), 1u);
  EXPECT_EQ(endpoint.successors[0].describe(), "10.0.0.2:29501");
  EXPECT_EQ(endpoint.to_string(), "tcp:10.0.0.1:29500,tcp:10.0.0.2:29501");
  endpoint.secret = "s";
  auto candidates = endpoint.candidates();
  ASSERT_EQ(candidates.size(), 2u);
  EXPECT_EQ(candidates[1].secret, "s") << "every address proves the job's secret";
  EXPECT_THROW(store::Endpoint::parse("tcp:10.0.0.1:29500,10.0.0.2"), std::invalid_argument);
}

TEST_F(TwoAddresses, AClientWhoseStoreIsGoneAsksTheSuccessorAgain) {
  serve(0);
  auto waiting = client();
  waiting->set("held", "by node 0");
  // A wait under way when node 0's store goes is asked again of the store
  // that takes over, and answered there.
  auto answer = std::async(std::launch::async, [&] { return waiting->wait_get("key", 10s); });
  std::this_thread::sleep_for(100ms);
  stop(0);
  std::this_thread::sleep_for(300ms);
  serve(1);
  client()->set("key", "from node 1");
  ASSERT_EQ(answer.get(), std::optional<std::string>("from node 1"));
  EXPECT_EQ(waiting->moves(), 1);
  EXPECT_EQ(waiting->serving().port, ports_[1]);
  EXPECT_FALSE(waiting->get("held").has_value()) << "what the gone store held went with it";
}

TEST_F(TwoAddresses, AStoreRestartedWhereItStoodIsNoMoveAndTheCallFails) {
  serve(0);
  auto rank = client();
  EXPECT_EQ(rank->add("counter", 1), 1);
  stop(0);
  serve(0);
  // The request may have been served before the store went: asked again
  // of a store at the same address, an add could count twice.
  EXPECT_THROW(rank->add("counter", 1), store::StoreError);
  EXPECT_EQ(rank->add("counter", 1), 1) << "the next call connects afresh";
  EXPECT_EQ(rank->moves(), 0);
}

TEST_F(TwoAddresses, TheLatestEpochComesBackFromTheRanksAndTheHighestStands) {
  serve(0);
  auto ahead = membership();
  auto behind = membership();
  auto zero = ahead->decide(detail::Epoch{}, {member(0, 0, -1), member(1, 0, -1)});
  ASSERT_EQ(behind->latest().number, 0);
  ASSERT_TRUE(ahead->mark_formed(0));
  auto one = ahead->decide(ahead->latest(), {member(0, 3, 0)});
  ASSERT_EQ(one.number, 1);
  stop(0);
  serve(1);
  // The one that read epoch 0 only writes it back; the one that holds
  // epoch 1 writes it over that; epoch 0 never goes back over 1.
  EXPECT_EQ(behind->latest().number, 0);
  auto after = ahead->latest();
  EXPECT_EQ(after.number, 1);
  EXPECT_EQ(after.lineage, 0);
  EXPECT_EQ(after.stored, one.stored) << "the decider's signed value, as it was";
  EXPECT_EQ(behind->latest().number, 1);
  EXPECT_EQ(behind->await_members(1, 1s)->size(), 1u);
  EXPECT_EQ(membership()->latest().number, 1) << "a rank that comes later reads it too";
}

TEST_F(TwoAddresses, ASecondDecisionForAnEpochIsRefusedNotActedOn) {
  serve(0);
  auto holder = membership();
  auto zero = holder->decide(detail::Epoch{}, {member(0, 0, -1), member(1, 0, -1)});
  ASSERT_EQ(zero.number, 0);
  stop(0);
  serve(1);
  // Before the holder writes epoch 0 back, a rank that held nothing decides
  // an epoch 0 of its own on the store that took over.
  auto other = membership();
  other->decide(detail::Epoch{}, {member(1, 0, -1)});
  expect_error<FaultToleranceError>([&] { holder->latest(); },
                                    {"another decision for epoch 0"});
}

TEST_F(TwoAddresses, AStoreEmptiedWhereItStoodIsRefusedAsARollback) {
  serve(0);
  auto rank = membership();
  rank->decide(detail::Epoch{}, {member(0, 0, -1)});
  ASSERT_EQ(rank->latest().number, 0);
  stop(0);
  serve(0);
  expect_error<FaultToleranceError>(
      [&] {
        rank->latest(); // the call that found its connection closed
        rank->latest();
      },
      {"lost the job's store"});
  expect_error<FaultToleranceError>([&] { rank->latest(); },
                                    {"the job's latest epoch went back from 0 to none"});
}

TEST_F(TwoAddresses, AProcessThatNeverSaysHelloToTheStoreThatTookOverIsSilent) {
  serve(0);
  using detail::Liveness;
  // A heartbeat timeout of 2 s: on a loaded machine, a beat late by less
  // must not have the old store judge slot 1 silent on its own.
  auto stays = std::make_unique<Liveness>(endpoint(), 5s, Liveness::Process{0, 0, "stays"}, 2s);
  auto lost = std::make_unique<Liveness>(endpoint(), 5s, Liveness::Process{1, 0, "lost"}, 2s);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (stays->incarnation_of(1) < 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(stays->incarnation_of(1), 0);
  stop(0); // node 0 is gone, and with it the process of slot 1
  lost.reset();
  serve(1);
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(stays->failed(1, 0).has_value()) << "not judged before its timeout";
  deadline = std::chrono::steady_clock::now() + 15s;
  while (!stays->failed(1, 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(stays->failed(1, 0).has_value());
  EXPECT_EQ(*stays->failed(1, 0), "it has not said hello to the job's store since the store "
                                  "moved to 127.0.0.1:" + std::to_string(ports_[1]));
  EXPECT_FALSE(stays->failed(0, 0).has_value()) << "it said hello there itself";
}

} // namespace
} // namespace lockstep::testing
