// The agreement of fault tolerance (src/fault/membership.h) over a real job
// store: epochs totally ordered by one compare-and-set, steps decided once,
// keys deleted once read, and, with a job secret, nothing acted on that a
// process without the secret wrote.

#include <thread>

#include <gtest/gtest.h>

#include <lockstep/error.h>

#include "fault/membership.h"
#include "store/client.h"
#include "store/server.h"
#include "support/expect_error.h"
#include "support/scratch_folder.h"
#include "world/job_secret.h"

namespace lockstep::testing {
namespace {

using namespace std::chrono_literals;
using detail::Member;
using detail::Membership;

class MembershipOverAStore : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<store::StoreServer>(
        store::ServerOptions{store::Endpoint::unix_socket(folder_ / "store"), {}});
    server_->start();
  }
  std::unique_ptr<store::StoreClient> client() {
    return std::make_unique<store::StoreClient>(server_->endpoint(), 5s);
  }
  // A rank's view of the protocol, with `secret` ("" for none).
  std::unique_ptr<Membership> membership(const std::string& secret,
                                         const std::string& prefix = "lockstep/job/0") {
    detail::Signer signer;
    signer.prove = [secret](const std::string& claim) {
      return secret.empty() ? std::string("-") : detail::prove(secret, "ft|job|" + claim + "|n");
    };
    signer.proven = [secret](const std::string& claim, const std::string& proof) {
      return secret.empty() || detail::proven(secret, "ft|job|" + claim + "|n", proof);
    };
    signer.secured = !secret.empty();
    return std::make_unique<Membership>(client(), prefix, signer);
  }
  static Member member(int replica, int64_t step, int64_t trained) {
    Member m;
    m.replica = replica;
    m.step = step;
    m.trained = trained;
    return m;
  }
  ScratchFolder folder_{"membership"};
  std::unique_ptr<store::StoreServer> server_;
};

TEST_F(MembershipOverAStore, EpochsAreTotallyOrderedAndAStaleProposalDecidesNothing) {
  auto a = membership("");
  auto b = membership("");
  auto zero = a->decide(detail::Epoch{}, {member(0, 0, 0), member(1, 0, 0), member(2, 0, 0)});
  ASSERT_EQ(zero.number, 0);
  auto one = a->decide(zero, {member(0, 5, 0), member(1, 5, 0)});
  ASSERT_EQ(one.number, 1);
  // A rank that slept through epoch 1 proposes epoch 1 of its own over
  // epoch 0: the store answers with the epoch that stands.
  auto stale = b->decide(zero, {member(2, 5, 0)});
  EXPECT_EQ(stale.number, 1);
  ASSERT_EQ(stale.members.size(), 2u);
  EXPECT_EQ(stale.members[1].replica, 1);
  EXPECT_EQ(b->await_members(1, 10ms)->size(), 2u);
  EXPECT_FALSE(b->await_members(2, 10ms).has_value());
}

TEST_F(MembershipOverAStore, AStepIsDecidedOnceAndItsKeysGoOnceTheNextIsDecided) {
  auto a = membership("");
  auto b = membership("");
  EXPECT_EQ(a->vote(0, 7, member(0, 7, 0)), 1);
  EXPECT_EQ(b->vote(0, 7, member(1, 7, 0)), 2);
  std::thread waiter([&] { EXPECT_EQ(b->await_decision(0, 7, 5s), "commit"); });
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(a->decide_step(0, 7, "commit"), "commit");
  EXPECT_EQ(b->decide_step(0, 7, "abort late"), "commit") << "the first proposal stands";
  waiter.join();
  auto keys = client()->num_keys();
  a->forget_step(0, 7);
  EXPECT_EQ(client()->num_keys(), keys - 2);
  a->arrive(3, member(0, 9, 2));
  a->retire(3);
  EXPECT_EQ(client()->num_keys(), keys - 2);
}

TEST_F(MembershipOverAStore, WithASecretWhatAStoreWriterForgesIsRefusedNotActedOn) {
  auto rank = membership("s3cret");
  auto forger = membership("a-guess");
  // An arrival that does not verify is never taken in.
  forger->arrive(1, member(9, 1000000, 0));
  rank->arrive(1, member(0, 5, 0));
  auto arrivals = rank->arrivals(1);
  ASSERT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(arrivals[0].replica, 0);
  // A member list with a huge step, a pre-written commit, a reason to give
  // a world up, a lineage: each is refused by name.
  forger->decide(detail::Epoch{}, {member(9, 1000000, 0)});
  expect_error<FaultToleranceError>([&] { rank->latest(); },
                                            {"the latest epoch without a valid proof of the job "
                                             "secret: a process without the secret wrote it"});
  forger->decide_step(4, 12, "commit");
  expect_error<FaultToleranceError>([&] { rank->decide_step(4, 12, "abort mine"); },
                                            {"the decision of step 12 without a valid proof"});
  forger->abandon(4, "forged");
  expect_error<FaultToleranceError>([&] { rank->abandon(4, "real"); },
                                            {"without a valid proof"});
  forger->note_lineage(99);
  expect_error<FaultToleranceError>([&] { rank->lineage(); }, {"the lineage"});
  // The state's announcement: a digest that does not match, or one signed
  // without the secret, is not the sender's.
  rank->announce_state(5, 0, 10, "abc");
  EXPECT_TRUE(rank->state_matches(5, 0, 10, "abc", 1s));
  EXPECT_FALSE(rank->state_matches(5, 0, 10, "abd", 1s));
  forger->announce_state(6, 0, 10, "abc");
  EXPECT_FALSE(rank->state_matches(6, 0, 10, "abc", 1s));
}

TEST_F(MembershipOverAStore, WithASecretAVoteCountedByAWriterCommitsNothing) {
  auto rank0 = membership("s3cret");
  auto rank1 = membership("s3cret");
  auto forger = membership("a-guess");
  std::vector<Member> members{member(0, 3, 0), member(1, 3, 0)};
  // The forger counts a vote for rank 1, whose reduction failed: the
  // count reaches 2 when rank 0 votes, but rank 1's signed vote is not there.
  forger->vote(0, 3, members[1]);
  EXPECT_FALSE(rank0->all_voted(0, 3, members, rank0->vote(0, 3, members[0])));
  // Once rank 1 really votes, every vote verifies.
  EXPECT_TRUE(rank1->all_voted(0, 3, members, rank1->vote(0, 3, members[1])));
}

TEST_F(MembershipOverAStore, WithASecretAnOldOrAnotherAttemptsValueIsRefused) {
  auto rank = membership("s3cret");
  auto epoch0 = rank->decide(detail::Epoch{}, {member(0, 0, -1)});
  auto epoch1 = rank->decide(epoch0, {member(0, 5, 0)});
  ASSERT_EQ(rank->latest().number, 1);
  // The signed value of epoch 0, put back: it goes back, and is refused.
  client()->set("lockstep/job/0/ft/epoch", epoch0.stored);
  expect_error<FaultToleranceError>([&] { rank->latest(); },
                                    {"the job's latest epoch went back from 1 to 0"});
  // A decision signed in attempt 0, copied into attempt 1's keys.
  auto attempt1 = membership("s3cret", "lockstep/job/1");
  rank->decide_step(0, 5, "commit");
  auto decision = client()->get("lockstep/job/0/ft/" + detail::step_key(0, 5, "decision"));
  ASSERT_TRUE(decision.has_value());
  client()->set("lockstep/job/1/ft/" + detail::step_key(0, 5, "decision"), *decision);
  expect_error<FaultToleranceError>([&] { attempt1->decide_step(0, 5, "abort mine"); },
                                    {"the decision of step 5 without a valid proof"});
}

TEST(LiveState, TheLatestLineageAtItsMostStepsAndAnOlderWorldIsBehindAtTheSameStep) {
  auto m = [](int replica, int64_t step, int64_t trained) {
    Member member;
    member.replica = replica;
    member.step = step;
    member.trained = trained;
    return member;
  };
  // Rank 2 was stopped in epoch 3 at step 40, while ranks 0 and 1 went on
  // in epochs 4 and 5 and came back to step 40 (their steps were dropped).
  std::vector<Member> decided{m(0, 40, 5), m(1, 40, 5), m(2, 40, 3), m(3, -1, -1)};
  int source = detail::live_state_source(decided);
  EXPECT_EQ(source, 0);
  EXPECT_FALSE(detail::behind(decided[1], decided[source]));
  EXPECT_TRUE(detail::behind(decided[2], decided[source])) << "the same step, an older world";
  EXPECT_TRUE(detail::behind(decided[3], decided[source]));
  EXPECT_EQ(detail::live_state_source({m(0, -1, -1)}), -1);
}

} // namespace
} // namespace lockstep::testing
