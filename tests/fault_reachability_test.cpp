// Telling a network cut from a failure (src/fault/reachability.h): a rank's
// probe listener is reached, and so is a host that refuses (its process
// ended), while an address that never answers is cut, within the probe's
// limit; the ranks that came fall into sides that reach one another; and
// what a member found travels in its record (the decider's choice of a
// side: fault_membership_test.cpp). The cut itself, between
// two network namespaces with the store still in reach, is
// tests/scripts/two-nodes-partial-cut.

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "fault/membership.h"
#include "fault/reachability.h"
#include "support/multiprocess.h"
#include "support/silent_host.h"

namespace lockstep::testing {
namespace {

using namespace std::chrono_literals;
using detail::Member;

Member member(int replica, const std::string& probe = "", std::vector<int> cut_off = {}) {
  Member m;
  m.replica = replica;
  m.probe = probe;
  m.cut_off = std::move(cut_off);
  return m;
}

std::vector<int> replicas(const std::vector<Member>& members) {
  std::vector<int> out;
  for (const auto& m : members) {
    out.push_back(m.replica);
  }
  return out;
}


TEST(Reachability, AListenerIsReachedARefusalIsAnAnswerAndSilenceIsACut) {
  detail::ProbeListener listener("127.0.0.1");
  ASSERT_EQ(listener.endpoint().rfind("127.0.0.1:", 0), 0u) << listener.endpoint();
  Silent silent;
  // This rank on another host than the others, so that they are probed.
  auto me = member(0, "10.0.0.9:1");
  auto members = {me, member(1, listener.endpoint()),
                  // A process that ended: its host refuses, so it is reached.
                  member(2, "127.0.0.2:" + std::to_string(free_port())),
                  member(3, silent.endpoint()), member(4, "")};
  auto start = std::chrono::steady_clock::now();
  auto unreachable = detail::unreachable_members(members, me, 500ms);
  EXPECT_EQ(unreachable, std::vector<int>{3}) << "a member without an endpoint counts as reached";
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1500ms);
}

TEST(Reachability, AHostIsProbedOnceAndItsVerdictIsEveryMembersThere) {
  Silent silent;
  auto me = member(0, "10.0.0.9:1");
  // Ranks 1 and 2 on the silent host (rank 0 tries the first of its
  // members, by its own number), rank 3 on another one that refuses.
  auto unreachable = detail::unreachable_members(
      {member(1, silent.endpoint()), member(2, "127.0.0.4:9"), member(3, "127.0.0.3:9")}, me,
      500ms);
  EXPECT_EQ(unreachable, (std::vector<int>{1, 2}));
  // Members on this rank's own host are not probed.
  EXPECT_TRUE(
      detail::unreachable_members({member(5, silent.endpoint())}, member(0, "127.0.0.4:1"), 500ms)
          .empty());
}

std::vector<std::vector<int>> sides_of(std::vector<Member> candidates) {
  std::vector<std::vector<int>> out;
  for (const auto& side : detail::reachable_sides(std::move(candidates))) {
    out.push_back(replicas(side));
  }
  return out;
}

TEST(Reachability, TheRanksThatCameFallIntoSidesThatReachOneAnother) {
  // Hosts {0, 1} and {2, 3} cut apart: each side says so.
  EXPECT_EQ(sides_of({member(2, "", {0, 1}), member(3, "", {0, 1}), member(0, "", {2, 3}),
                      member(1, "", {2, 3})}),
            (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  // Said by one side only (the other had not looked yet): the same.
  EXPECT_EQ(sides_of({member(0), member(1), member(2, "", {0, 1}), member(3, "", {0, 1})}),
            (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  // Three hosts, only 1 and 2 cut apart: 0 and 3 reach both, and are on
  // both sides.
  EXPECT_EQ(sides_of({member(0), member(1, "", {2}), member(2, "", {1}), member(3)}),
            (std::vector<std::vector<int>>{{0, 1, 3}, {0, 2, 3}}));
  // No cut: one side, everyone.
  EXPECT_EQ(sides_of({member(0), member(1), member(2)}),
            (std::vector<std::vector<int>>{{0, 1, 2}}));
}

TEST(Reachability, WhatAMemberFoundTravelsInItsRecord) {
  auto m = member(3, "192.168.78.2:41234", {0, 1});
  m.incarnation = 2;
  m.step = 40;
  m.trained = 5;
  auto back = Member::from_record(m.to_record());
  EXPECT_EQ(back.replica, 3);
  EXPECT_EQ(back.incarnation, 2);
  EXPECT_EQ(back.step, 40);
  EXPECT_EQ(back.trained, 5);
  EXPECT_EQ(back.probe, "192.168.78.2:41234");
  EXPECT_EQ(back.cut_off, (std::vector<int>{0, 1}));
  auto plain = Member::from_record(member(1, "").to_record());
  EXPECT_TRUE(plain.probe.empty());
  EXPECT_TRUE(plain.cut_off.empty());
  EXPECT_EQ(plain.identity.host, member(1, "").identity.host);
}

} // namespace
} // namespace lockstep::testing
