// The agreement of fault tolerance (src/fault/membership.h) over a real job
// store: epochs totally ordered by one compare-and-set, steps decided once,
// keys deleted once read, and, with a job secret, nothing acted on that a
// process without the secret wrote.

#include <thread>

#include <gtest/gtest.h>

#include <lockstep/error.h>

#include "fault/agreement.h"
#include "fault/membership.h"
#include "store/client.h"
#include "store/server.h"
#include "world/liveness.h"
#include "support/expect_error.h"
#include "support/members.h"
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
        store::ServerOptions{store::Endpoint::unix_socket(folder_ / "store"), {}, ""});
    server_->start();
  }
  std::unique_ptr<store::StoreClient> client() {
    return std::make_unique<store::StoreClient>(server_->endpoint(), 5s);
  }
  // A rank's view of the protocol, with `secret` ("" for none).
  std::unique_ptr<Membership> membership(const std::string& secret,
                                         const std::string& prefix = "lockstep/job/0",
                                         std::chrono::milliseconds patience = 60s) {
    detail::Signer signer;
    signer.prove = [secret](const std::string& claim) {
      return secret.empty() ? std::string("-") : detail::prove(secret, "ft|job|" + claim + "|n");
    };
    signer.proven = [secret](const std::string& claim, const std::string& proof) {
      return secret.empty() || detail::proven(secret, "ft|job|" + claim + "|n", proof);
    };
    signer.secured = !secret.empty();
    return std::make_unique<Membership>(client(), prefix, signer, patience);
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

TEST_F(MembershipOverAStore, TheFirstReasonToGiveAnEpochUpStandsAndItsKeysGoWhenRetired) {
  auto a = membership("");
  auto b = membership("");
  auto keys = client()->num_keys();
  EXPECT_EQ(a->abandon(3, "rank 2 failed"), "rank 2 failed");
  EXPECT_EQ(b->abandon(3, "given up"), "rank 2 failed") << "the first reason stands";
  a->arrive(3, member(0, 9, 2));
  b->arrive(3, member(1, 9, 2));
  EXPECT_EQ(a->arrivals(3).size(), 2u);
  a->retire(3);
  EXPECT_EQ(client()->num_keys(), keys);
}

TEST_F(MembershipOverAStore, WithASecretWhatAStoreWriterForgesIsRefusedOrIgnoredNotActedOn) {
  auto rank = membership("s3cret");
  auto forger = membership("a-guess");
  // An arrival that does not verify is never taken in.
  forger->arrive(1, member(9, 1000000, 0));
  rank->arrive(1, member(0, 5, 0));
  // Nor a valid one copied under another slot's key.
  auto signed_arrival = client()->get("lockstep/job/0/ft/" + detail::epoch_key(1, "arrive/0"));
  ASSERT_TRUE(signed_arrival.has_value());
  client()->set("lockstep/job/0/ft/" + detail::epoch_key(1, "arrive/7"), *signed_arrival);
  auto arrivals = rank->arrivals(1);
  ASSERT_EQ(arrivals.size(), 1u);
  EXPECT_EQ(arrivals[0].replica, 0);
  // A latest epoch without a valid proof (a member list with a huge step)
  // is ignored, never acted on: a rank that read none waits for a member
  // to write the genuine one back, and ends only if none does...
  forger->decide(detail::Epoch{}, {member(9, 1000000, 0)});
  auto fresh = membership("s3cret", "lockstep/job/0", 300ms);
  int asked = 0; // the members to come, so that one writes the genuine one back
  expect_error<FaultToleranceError>(
      [&] { fresh->latest([&] { ++asked; }); },
      {"has held a latest epoch without a valid proof of the job secret", "for 0.3 s",
       "no member wrote the genuine one back"});
  EXPECT_GE(asked, 1);
  // ...and a rank that has read one writes it back over the forged one,
  // which the others then read.
  const std::string latest_key = "lockstep/job/0/ft/epoch";
  auto forged = client()->get(latest_key);
  ASSERT_TRUE(forged.has_value());
  client()->erase_prefix(latest_key);
  auto genuine = rank->decide(detail::Epoch{}, {member(0, 0, -1)});
  client()->set(latest_key, *forged);
  EXPECT_EQ(rank->latest().stored, genuine.stored);
  EXPECT_EQ(client()->get(latest_key), genuine.stored) << "written back";
  EXPECT_EQ(fresh->latest().stored, genuine.stored);
  // A forged reason to give a world up is ignored, never acted on nor
  // fatal: the genuine one replaces it, and is what the others read.
  forger->abandon(4, "forged");
  EXPECT_FALSE(rank->abandoned(4).has_value());
  bool first = false;
  EXPECT_EQ(rank->abandon(4, "real", &first), "real");
  EXPECT_TRUE(first);
  EXPECT_EQ(rank->abandoned(4), std::optional<std::string>("real"));
  EXPECT_EQ(rank->abandon(4, "later", &first), "real");
  EXPECT_FALSE(first) << "the first valid reason stands";
  // The state's announcement: what the sender signed reads back; one
  // signed without the secret is ignored, never fatal, and the sender's
  // own replaces it.
  rank->announce_state(5, 0, 10, "abc");
  EXPECT_EQ(rank->announced_state(5, 0, 1s), detail::Membership::state_claim(0, 10, "abc"));
  EXPECT_NE(rank->announced_state(5, 0, 1s), detail::Membership::state_claim(0, 10, "abd"));
  forger->announce_state(6, 0, 10, "abc");
  EXPECT_FALSE(rank->announced_state(6, 0, 1s).has_value());
  rank->announce_state(6, 0, 10, "abc");
  EXPECT_EQ(rank->announced_state(6, 0, 1s), detail::Membership::state_claim(0, 10, "abc"));
  EXPECT_FALSE(rank->announced_state(7, 0, 50ms).has_value()) << "none announced yet";
}

TEST_F(MembershipOverAStore, WithASecretAnOldOrAnotherAttemptsValueIsRefusedOrIgnored) {
  auto rank = membership("s3cret");
  auto epoch0 = rank->decide(detail::Epoch{}, {member(0, 0, -1)});
  auto epoch1 = rank->decide(epoch0, {member(0, 5, 0)});
  ASSERT_EQ(rank->latest().number, 1);
  // The signed value of epoch 0, put back: it goes back, so it is ignored,
  // and the latest this rank read goes back over it.
  client()->set("lockstep/job/0/ft/epoch", epoch0.stored);
  EXPECT_EQ(rank->latest().stored, epoch1.stored);
  EXPECT_EQ(client()->get("lockstep/job/0/ft/epoch"), epoch1.stored);
  // A reason signed in attempt 0, copied into attempt 1's keys.
  auto attempt1 = membership("s3cret", "lockstep/job/1");
  rank->abandon(0, "rank 1 failed");
  auto reason = client()->get("lockstep/job/0/ft/" + detail::epoch_key(0, "abandoned"));
  ASSERT_TRUE(reason.has_value());
  client()->set("lockstep/job/1/ft/" + detail::epoch_key(0, "abandoned"), *reason);
  EXPECT_FALSE(attempt1->abandoned(0).has_value()) << "another attempt's reason is not this one's";
  EXPECT_EQ(attempt1->abandon(0, "mine"), "mine");
}

TEST_F(MembershipOverAStore, AnyMemberMarksItsWorldFormedAndTheLineageGoesWithTheEpoch) {
  auto rank0 = membership("s3cret");
  auto rank1 = membership("s3cret");
  auto zero = rank0->decide(detail::Epoch{}, {member(0, 0, -1), member(1, 0, -1)});
  EXPECT_EQ(zero.lineage, -1);
  EXPECT_TRUE(rank0->mark_formed(0));
  EXPECT_EQ(rank1->lineage(), 0);
  // Epoch 1 is decided: the lineage stays 0 until one of its members (not
  // necessarily its rank 0, which may die first) marks it formed.
  auto one = rank0->decide(rank0->latest(), {member(0, 5, 0), member(1, 5, 0)});
  ASSERT_EQ(one.number, 1);
  EXPECT_EQ(one.lineage, 0);
  EXPECT_TRUE(rank1->mark_formed(1));
  EXPECT_TRUE(rank0->mark_formed(1)) << "marked already: no second write";
  EXPECT_EQ(rank0->lineage(), 1);
  // Epoch 2 is decided over it, then given up before it formed: epoch 3,
  // decided over the unmarked 2, keeps lineage 1, and a member of epoch 2
  // that formed late finds it must not train.
  auto two = rank0->decide(rank0->latest(), {member(0, 9, 1), member(1, 9, 1)});
  auto three = rank1->decide(two, {member(1, 9, 1)});
  ASSERT_EQ(three.number, 3);
  EXPECT_EQ(three.lineage, 1);
  EXPECT_FALSE(rank0->mark_formed(2));
  EXPECT_EQ(rank0->lineage(), 1);
  // Epoch 3's unmarked value put back over its mark: the lineage goes
  // back, so a rank that read the mark ignores it and writes the mark back.
  auto unmarked = client()->get("lockstep/job/0/ft/epoch");
  EXPECT_TRUE(rank1->mark_formed(3));
  auto marked = client()->get("lockstep/job/0/ft/epoch");
  client()->set("lockstep/job/0/ft/epoch", *unmarked);
  EXPECT_EQ(rank1->latest().lineage, 3);
  EXPECT_EQ(client()->get("lockstep/job/0/ft/epoch"), marked);
}

// Agreement (src/fault/agreement.h) among simulated members in this
// process, each with its own liveness and connections to a real store.
class AgreementOverAStore : public MembershipOverAStore {
 protected:
  struct Simulated {
    Member me;
    std::unique_ptr<detail::Liveness> liveness;
    std::unique_ptr<Membership> membership;
    std::unique_ptr<detail::Agreement> agreement;
  };
  static constexpr auto kHeartbeat = std::chrono::milliseconds(400);
  Simulated& add(int replica, int64_t step, int64_t trained) {
    auto& sim = *members_.emplace_back(std::make_unique<Simulated>());
    sim.me = member(replica, step, trained);
    sim.me.identity.host = "sim";
    sim.me.identity.pid = 100000 + replica;
    sim.liveness = std::make_unique<detail::Liveness>(
        server_->endpoint(), 5s,
        detail::Liveness::Process{replica, 0, sim.me.identity.to_record()}, kHeartbeat);
    sim.membership = membership("s3cret");
    detail::AgreementOptions options;
    options.step_timeout = 2s;
    options.timeout = 10s;
    sim.agreement = std::make_unique<detail::Agreement>(*sim.membership, *sim.liveness, options);
    return sim;
  }
  // `ranks` members, in epoch 0 (decided and formed).
  std::vector<Simulated*> in_epoch_zero(int ranks) {
    std::vector<Simulated*> sims;
    std::vector<Member> records;
    for (int rank = 0; rank < ranks; ++rank) {
      sims.push_back(&add(rank, 0, 0));
      records.push_back(sims.back()->me);
    }
    sims[0]->membership->decide(detail::Epoch{}, records);
    sims[0]->membership->mark_formed(0);
    return sims;
  }
  // The next epoch as `sims` decide it together, each on a thread.
  std::vector<std::optional<std::pair<int64_t, std::vector<Member>>>> next_epoch(
      const std::vector<Simulated*>& sims) {
    std::vector<std::optional<std::pair<int64_t, std::vector<Member>>>> decided(sims.size());
    std::vector<std::exception_ptr> errors(sims.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < sims.size(); ++i) {
      threads.emplace_back([&, i] {
        try {
          decided[i] = sims[i]->agreement->next_epoch(sims[i]->me, Clock::now() + 10s);
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
    }
    for (auto& thread : threads) {
      thread.join();
    }
    for (const auto& error : errors) {
      if (error) {
        std::rethrow_exception(error);
      }
    }
    return decided;
  }
  using Clock = std::chrono::steady_clock;
  std::vector<std::unique_ptr<Simulated>> members_;
};

TEST_F(AgreementOverAStore, TheLiveStateOutlivesTheDeathOfAnyMemberOnceItsWorldFormed) {
  auto sims = in_epoch_zero(3);
  auto& rank0 = *sims[0];
  auto& rank1 = *sims[1];
  auto& rank2 = *sims[2];
  auto one = rank0.membership->decide(rank0.membership->latest(), {rank0.me, rank1.me, rank2.me});
  ASSERT_EQ(one.number, 1);
  // Epoch 1 formed; rank 0, its old only writer of the lineage, dies
  // before it writes anything; ranks 1 and 2 mark it and train on.
  rank0.liveness->stop();
  ASSERT_TRUE(rank1.membership->mark_formed(1));
  for (auto* sim : {&rank1, &rank2}) {
    sim->me.step = 7;
    sim->me.trained = 1;
  }
  std::this_thread::sleep_for(2 * kHeartbeat); // rank 0 is seen failed
  auto decided = next_epoch({&rank1, &rank2});
  for (const auto& epoch : decided) {
    ASSERT_TRUE(epoch.has_value());
    EXPECT_EQ(epoch->first, 2);
    ASSERT_EQ(epoch->second.size(), 2u);
    EXPECT_EQ(epoch->second[0].replica, 1);
  }
}

TEST_F(AgreementOverAStore, ACutBetweenHostsLeavesTheSideWithoutTheLowerRanksOut) {
  // Ranks 0, 1 on one host and 2, 3 on another; the world of all four did
  // not form, and each side came back saying whom it could not reach. All
  // four beat (the store is in reach): none is failed.
  auto sims = in_epoch_zero(4);
  for (auto* sim : sims) {
    sim->me.cut_off = sim->me.replica < 2 ? std::vector<int>{2, 3} : std::vector<int>{0, 1};
  }
  auto decided = next_epoch(sims);
  for (const auto& epoch : decided) {
    ASSERT_TRUE(epoch.has_value());
    EXPECT_EQ(epoch->first, 1);
    ASSERT_EQ(epoch->second.size(), 2u);
    EXPECT_EQ(epoch->second[0].replica, 0);
    EXPECT_EQ(epoch->second[1].replica, 1);
  }
}

TEST_F(AgreementOverAStore, ACutLeavesTheSmallerSideOutThoughItHoldsTheLowestRank) {
  // Rank 0 alone on one host, ranks 1-3 on another; all hold the state.
  auto sims = in_epoch_zero(4);
  for (auto* sim : sims) {
    sim->me.cut_off = sim->me.replica == 0 ? std::vector<int>{1, 2, 3} : std::vector<int>{0};
  }
  for (const auto& epoch : next_epoch(sims)) {
    ASSERT_TRUE(epoch.has_value());
    ASSERT_EQ(epoch->second.size(), 3u);
    EXPECT_EQ(epoch->second[0].replica, 1);
  }
}

TEST_F(AgreementOverAStore, AStaleRankIsNeverTakenForTheLiveState) {
  auto sims = in_epoch_zero(3);
  auto& rank0 = *sims[0];
  auto& rank1 = *sims[1];
  auto& rank2 = *sims[2];
  // Rank 2 was stopped at step 5 of epoch 0; ranks 0 and 1 formed epoch 1
  // without it, trained, and both died. Rank 2's state is older than the
  // job's: it must not become the live state.
  rank2.me.step = 5;
  rank0.membership->decide(rank0.membership->latest(), {rank0.me, rank1.me});
  ASSERT_TRUE(rank1.membership->mark_formed(1));
  rank0.liveness->stop();
  rank1.liveness->stop();
  std::this_thread::sleep_for(2 * kHeartbeat);
  expect_error<FaultToleranceError>([&] { next_epoch({&rank2}); },
                                    {"every rank that held the trained state has failed"});
}

TEST_F(AgreementOverAStore, ARankThatDroppedAStepOthersCommittedNeverTrainsOnAlone) {
  auto sims = in_epoch_zero(2);
  auto& rank0 = *sims[0];
  auto& rank1 = *sims[1];
  // The verdict of step 29 completed on rank 0 and failed on rank 1 alone:
  // rank 0 committed 30 steps and trains on (or ends), rank 1 holds 29.
  rank0.liveness->set_progress(detail::progress_of(30, detail::Phase::Between));
  rank1.me.step = 29;
  std::this_thread::sleep_for(kHeartbeat); // a beat carries rank 0's progress
  std::exception_ptr error;
  std::thread waiting([&] {
    try {
      next_epoch({&rank1});
    } catch (...) {
      error = std::current_exception();
    }
  });
  // Rank 0 is alive and never comes: rank 1 neither decides a world of its
  // own nor judges rank 0 hung (its step_timeout, 2 s, passes).
  std::this_thread::sleep_for(3s);
  EXPECT_FALSE(error) << "rank 1 gave up while rank 0, ahead of it, lived";
  EXPECT_EQ(rank0.membership->latest().number, 0) << "rank 1 decided a world without rank 0";
  // Rank 0 ends its loop cleanly: rank 1 leaves, and says so.
  rank0.liveness->goodbye();
  rank0.liveness->stop();
  waiting.join();
  ASSERT_TRUE(error);
  expect_error<FaultToleranceError>([&] { std::rethrow_exception(error); },
                                    {"rank 1 dropped step 29 while rank 0 committed it and ended "
                                     "its loop"});
  auto left = client()->get("lockstep/job/0/ft/left/1/0");
  ASSERT_TRUE(left.has_value());
  EXPECT_EQ(left->substr(0, left->find('\n')), detail::kLeft);
  EXPECT_EQ(rank0.membership->latest().number, 0);
}

TEST_F(AgreementOverAStore, ABehindRankDecidesAsSoonAsTheRankAheadOfItComes) {
  auto sims = in_epoch_zero(2);
  auto& rank0 = *sims[0];
  auto& rank1 = *sims[1];
  // Rank 0 (the one that decides) dropped step 29; rank 1 committed it,
  // then its next step failed, and it comes back: rank 0 decides at once
  // (not at its timeout), and will receive rank 1's state.
  rank1.liveness->set_progress(detail::progress_of(30, detail::Phase::Dropped));
  rank0.me.step = 29;
  rank1.me.step = 30;
  std::this_thread::sleep_for(kHeartbeat);
  auto start = std::chrono::steady_clock::now();
  auto decided = next_epoch({&rank0, &rank1});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s) << "waited past the step timeout";
  for (const auto& epoch : decided) {
    ASSERT_TRUE(epoch.has_value());
    EXPECT_EQ(epoch->first, 1);
    ASSERT_EQ(epoch->second.size(), 2u);
    EXPECT_EQ(detail::live_state_source(epoch->second), 1);
  }
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
