// The job's store (src/store/): its operations over a Unix socket and over
// TCP, the waits it parks, what it refuses, that no client can hold up the
// others, that what is deleted is gone, and the liveness it judges. A real
// server on a real socket, real clients, in one process.

#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "store/client.h"
#include "store/host_folder.h"
#include "world/job_secret.h"
#include "store/server.h"
#include "store/wire.h"
#include "support/scratch_folder.h"

namespace lockstep::testing {
namespace {

using namespace std::chrono_literals;
using store::Endpoint;
using store::SlotState;
using store::StoreClient;
using store::StoreServer;
using Clock = std::chrono::steady_clock;

class StoreOverSocket : public ::testing::TestWithParam<Endpoint::Kind> {
 protected:
  void SetUp() override {
    auto endpoint = GetParam() == Endpoint::Kind::Unix
        ? Endpoint::unix_socket(folder_ / "store")
        : Endpoint::tcp("127.0.0.1", 0);
    server_ = std::make_unique<StoreServer>(store::ServerOptions{endpoint, {}, ""});
    server_->start();
  }
  std::unique_ptr<StoreClient> client(std::chrono::milliseconds timeout = 5s) {
    return std::make_unique<StoreClient>(server_->endpoint(), timeout);
  }
  ScratchFolder folder_{"store"};
  std::unique_ptr<StoreServer> server_;
};

TEST_P(StoreOverSocket, KeysAndValuesAsC10dHasThem) {
  auto c = client();
  EXPECT_EQ(c->ping(), store::kGreeting);
  EXPECT_FALSE(c->get("a").has_value());
  c->set("a", std::string("x\0y", 3));
  EXPECT_EQ(c->get("a"), std::string("x\0y", 3));
  EXPECT_EQ(c->add("n", 2), 2);
  EXPECT_EQ(c->add("n", -5), -3);
  // compareSet: the first proposal stands; a matching one replaces.
  EXPECT_EQ(c->compare_set("c", "", "first"), "first");
  EXPECT_EQ(c->compare_set("c", "", "second"), "first");
  EXPECT_EQ(c->compare_set("c", "first", "third"), "third");
  EXPECT_EQ(c->compare_set("missing", "expected", "new"), "expected");
  EXPECT_FALSE(c->check({"missing"}));
  EXPECT_TRUE(c->check({"a", "c", "n"}));
  EXPECT_EQ(c->num_keys(), 3);
  EXPECT_TRUE(c->erase("a"));
  EXPECT_FALSE(c->erase("a"));
  for (int i = 0; i < 10; ++i) {
    c->set("e3/s" + std::to_string(i) + "/votes", "1");
  }
  c->set("e30/kept", "1");
  EXPECT_EQ(c->get_prefix("e3/").size(), 10u);
  EXPECT_EQ(c->erase_prefix("e3/"), 10);
  EXPECT_TRUE(c->check({"e30/kept"}));
  EXPECT_EQ(c->num_keys(), 3);
}

// A store given the job's secret serves a connection only once it has
// proven the secret over a nonce of its own: a client without the secret
// may ping and nothing else; one with another is refused on connecting;
// a proof that worked on one connection is worth nothing on another.
TEST_P(StoreOverSocket, WithASecretOnlyAConnectionThatProvesItIsServed) {
  auto endpoint = GetParam() == Endpoint::Kind::Unix
      ? Endpoint::unix_socket(folder_ / "secured")
      : Endpoint::tcp("127.0.0.1", 0);
  StoreServer secured(store::ServerOptions{endpoint, {}, "s3cret"});
  secured.start();
  auto at = secured.endpoint();
  at.secret = "s3cret";
  StoreClient member(at, 5s);
  member.set("k", "v");
  EXPECT_EQ(member.get("k"), "v");
  EXPECT_FALSE(member.hello(0, 0, 1s, "member").has_value());

  StoreClient stranger(secured.endpoint(), 5s);
  EXPECT_EQ(stranger.ping(), store::kGreeting);
  EXPECT_THROW(stranger.get("k"), store::UnprovenError);
  EXPECT_THROW(stranger.set("k", "forged"), store::UnprovenError);
  EXPECT_THROW(stranger.erase_prefix(""), store::UnprovenError);
  EXPECT_THROW(stranger.hello(0, 1000000, 1s, "forged"), store::UnprovenError);
  EXPECT_THROW(stranger.report(0, 0, "forged"), store::UnprovenError);
  EXPECT_THROW(stranger.goodbye(0, 0, 0), store::UnprovenError);
  EXPECT_THROW(stranger.note("forged"), store::UnprovenError);
  auto guess = secured.endpoint();
  guess.secret = "guess";
  EXPECT_THROW(StoreClient(guess, 5s), store::UnprovenError);
  // A proof seen on one connection, replayed on another, is refused.
  struct Raw {
    int fd;
    std::string ask(const std::string& request) {
      (void)!::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
      char head[4];
      EXPECT_EQ(::recv(fd, head, 4, MSG_WAITALL), 4);
      std::string body(store::frame_length(head), '\0');
      EXPECT_EQ(::recv(fd, body.data(), body.size(), MSG_WAITALL),
                static_cast<ssize_t>(body.size()));
      return body;
    }
    std::string nonce() {
      auto body = ask(store::Writer(static_cast<uint8_t>(store::Op::Challenge)).finish());
      return store::Reader(body.data() + 1, body.size() - 1).str();
    }
    int prove(const std::string& proof) {
      return ask(store::Writer(static_cast<uint8_t>(store::Op::Prove)).str(proof).finish())[0];
    }
  };
  std::string error;
  Raw seen{store::connect_to(secured.endpoint(), Clock::now() + 5s, error)};
  Raw replaying{store::connect_to(secured.endpoint(), Clock::now() + 5s, error)};
  auto proof = detail::prove("s3cret", "store|" + seen.nonce());
  replaying.nonce();
  EXPECT_EQ(replaying.prove(proof), static_cast<int>(store::Status::Unproven));
  EXPECT_EQ(seen.prove(proof), static_cast<int>(store::Status::Ok));
  ::close(seen.fd);
  ::close(replaying.fd);

  EXPECT_EQ(member.get("k"), "v"); // nothing the others tried changed it
  EXPECT_EQ(member.stats().slots, 1);
  secured.stop();
}

TEST_P(StoreOverSocket, WaitsAreAnsweredWhenTheKeyComesOrAtTheirLimit) {
  auto waiter = client();
  auto writer = client();
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    writer->set("late", "here");
  });
  auto start = Clock::now();
  EXPECT_EQ(waiter->wait_get("late", 5s), "here");
  EXPECT_LT(Clock::now() - start, 3s);
  later.join();
  start = Clock::now();
  EXPECT_FALSE(waiter->wait_get("never", 200ms).has_value());
  EXPECT_FALSE(waiter->wait({"late", "never"}, 200ms));
  EXPECT_GE(Clock::now() - start, 400ms);
  EXPECT_TRUE(waiter->wait({"late"}, 200ms));
  // The waits left nothing behind: the store holds the one key.
  EXPECT_EQ(waiter->stats().keys, 1);
}

// A client that stops in the middle of a request (SIGSTOP, a debugger)
// holds up nobody: the store answers each connection on its own.
TEST_P(StoreOverSocket, AClientStoppedInsideARequestHoldsUpNobody) {
  // Half a Set: its length says 100 bytes, 10 come.
  store::Writer half(static_cast<uint8_t>(store::Op::Set));
  half.str(std::string(200, 'k'));
  std::string bytes = half.finish().substr(0, 10);
  std::string error;
  int fd = store::connect_to(server_->endpoint(), Clock::now() + 5s, error);
  ASSERT_GE(fd, 0) << error;
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  auto other = client(1s);
  auto start = Clock::now();
  for (int i = 0; i < 100; ++i) {
    other->set("k" + std::to_string(i), "v");
  }
  EXPECT_LT(Clock::now() - start, 1s);
  ::close(fd);
}

// What a port scanner or a confused client sends is refused: the sender's
// connection closes, and the store goes on serving.
TEST_P(StoreOverSocket, GarbageClosesItsConnectionAndNothingElse) {
  auto good = client();
  good->set("kept", "1");
  std::mt19937 random(3);
  for (int round = 0; round < 50; ++round) {
    std::string error;
    int fd = store::connect_to(server_->endpoint(), Clock::now() + 5s, error);
    ASSERT_GE(fd, 0) << error;
    std::string noise(64, '\0');
    for (char& c : noise) {
      c = static_cast<char>(random());
    }
    if (round % 3 == 1) {
      noise = std::string("\xff\xff\xff\x7f", 4) + noise; // a length of 2 GiB
    } else if (round % 3 == 2) {
      noise = std::string("\x02\x00\x00\x00\x63\x00", 6); // an unknown operation
    }
    (void)!::send(fd, noise.data(), noise.size(), MSG_NOSIGNAL);
    // Closed (after an Invalid answer), or waiting for the rest of what
    // its length announced: either way, the next round.
    timeval patience{0, 20000};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &patience, sizeof(patience));
    char answer[16];
    (void)!::recv(fd, answer, sizeof(answer), 0);
    ::close(fd);
  }
  EXPECT_EQ(good->get("kept"), "1");
  EXPECT_EQ(good->stats().keys, 1);
}

TEST_P(StoreOverSocket, ARequestThatTimesOutClosesItsConnectionAndTheNextReconnects) {
  store::ServerOptions slow{server_->endpoint(), 300ms, ""};
  if (GetParam() == Endpoint::Kind::Unix) {
    slow.endpoint = Endpoint::unix_socket(folder_ / "slow");
  } else {
    slow.endpoint.port = 0;
  }
  StoreServer server(slow);
  server.start();
  StoreClient c(server.endpoint(), 100ms);
  EXPECT_THROW(c.set("a", "1"), store::StoreError);
  c.set_timeout(2s);
  c.set("b", "2"); // a new connection: the late answer to "a" is not taken for this one's
  EXPECT_EQ(c.get("b"), "2");
}

TEST_P(StoreOverSocket, WhatIsDeletedIsGone) {
  auto c = client();
  auto before = c->stats();
  for (int epoch = 0; epoch < 200; ++epoch) {
    auto prefix = "ft/e" + std::to_string(epoch) + "/";
    for (int i = 0; i < 20; ++i) {
      c->set(prefix + "s" + std::to_string(i), std::string(100, 'x'));
    }
    EXPECT_FALSE(c->wait_get(prefix + "never", 1ms).has_value());
    c->erase_prefix(prefix);
  }
  auto after = c->stats();
  EXPECT_EQ(after.keys, before.keys);
  EXPECT_EQ(after.key_bytes, before.key_bytes);
}

INSTANTIATE_TEST_SUITE_P(Endpoints, StoreOverSocket,
                         ::testing::Values(Endpoint::Kind::Unix, Endpoint::Kind::Tcp),
                         [](const ::testing::TestParamInfo<Endpoint::Kind>& info) {
                           return info.param == Endpoint::Kind::Unix ? "Unix" : "Tcp";
                         });

class StoreLiveness : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<StoreServer>(
        store::ServerOptions{Endpoint::unix_socket(folder_ / "store"), {}, ""});
    server_->start();
  }
  std::unique_ptr<StoreClient> client() {
    return std::make_unique<StoreClient>(server_->endpoint(), 5s);
  }
  // The state of `slot` once the view says it changed, within `limit`.
  store::SlotView await_state(StoreClient& watcher, uint64_t& since, int slot,
                              SlotState state, std::chrono::milliseconds limit) {
    auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
      auto change = watcher.watch(0, since, 100ms, {});
      since = change.version;
      for (const auto& seen : change.slots) {
        if (seen.slot == slot && seen.state == state) {
          return seen;
        }
      }
    }
    ADD_FAILURE() << "slot " << slot << " never reached state " << static_cast<int>(state);
    return {};
  }
  ScratchFolder folder_{"liveness"};
  std::unique_ptr<StoreServer> server_;
};

TEST_F(StoreLiveness, AProcessThatExitsIsSeenAtOnceAndOneThatStopsAfterItsTimeout) {
  auto watcher = client();
  uint64_t since = 0;
  {
    auto beating = client();
    EXPECT_FALSE(beating->hello(4, 0, 10s, "me").has_value());
    beating->watch(1, 0, 1ms, 10s);
    await_state(*watcher, since, 4, SlotState::Alive, 2s);
  } // its connection closes without a goodbye
  auto start = Clock::now();
  auto exited = await_state(*watcher, since, 4, SlotState::Exited, 2s);
  EXPECT_LT(Clock::now() - start, 500ms) << "an exit is seen when the connection closes";
  EXPECT_NE(exited.why.find("exited"), std::string::npos) << exited.why;

  auto silent = client();
  silent->hello(5, 0, 300ms, "stopped");
  silent->watch(1, 0, 1ms, 300ms); // then no beat, as a stopped process
  auto judged = await_state(*watcher, since, 5, SlotState::Silent, 3s);
  EXPECT_NE(judged.why.find("sent no heartbeat for"), std::string::npos) << judged.why;
  silent->watch(1, 0, 1ms, 300ms); // it resumes
  await_state(*watcher, since, 5, SlotState::Alive, 2s);
}

TEST_F(StoreLiveness, ANewerIncarnationReplacesTheOlderOneWhichIsRefused) {
  auto old_one = client();
  auto new_one = client();
  EXPECT_FALSE(old_one->hello(2, 0, 10s, "a").has_value());
  EXPECT_FALSE(new_one->hello(2, 1, 10s, "b").has_value());
  auto late = client();
  EXPECT_EQ(late->hello(2, 0, 10s, "a"), 1) << "a stale incarnation is told the newer one";
}

// Two launchers that gave one incarnation out (a node replaced while its
// old launcher lives on): the process that holds it stays, the other is
// refused as stale; once the holder is gone, a process may take it (a
// whole job restarted says hello as incarnation 0 again).
TEST_F(StoreLiveness, AnotherProcessAsALiveIncarnationIsRefused) {
  auto holder = client();
  EXPECT_FALSE(holder->hello(2, 1, 10s, "replacement").has_value());
  EXPECT_FALSE(holder->hello(2, 1, 10s, "replacement").has_value()) << "its own hello again";
  auto rival = client();
  EXPECT_EQ(rival->hello(2, 1, 10s, "old launcher's"), 1);
  holder.reset(); // its connection closes: it exited
  auto watcher = client();
  uint64_t since = 0;
  EXPECT_EQ(await_state(*watcher, since, 2, SlotState::Exited, 5s).incarnation, 1);
  auto next = client();
  EXPECT_FALSE(next->hello(2, 1, 10s, "restarted job").has_value());
}

TEST_F(StoreLiveness, AReportedProcessStaysFailedUntilItsProgressMoves) {
  auto watcher = client();
  uint64_t since = 0;
  auto hung = client();
  hung->hello(1, 0, 10s, "h");
  hung->watch(7, 0, 1ms, 10s);
  watcher->report(1, 0, "it is hung");
  watcher->report(1, 0, "it is hung"); // many observers report it: one change
  auto seen = await_state(*watcher, since, 1, SlotState::Reported, 2s);
  EXPECT_EQ(seen.why, "it is hung");
  auto progress = watcher->progress();
  ASSERT_EQ(progress.size(), 1u);
  EXPECT_EQ(progress[0].progress, 7);
  hung->watch(7, 0, 1ms, 10s); // its heartbeat goes on: still failed
  EXPECT_EQ(watcher->progress()[0].state, SlotState::Reported);
  hung->watch(8, 0, 1ms, 10s); // its training moves again
  await_state(*watcher, since, 1, SlotState::Alive, 2s);
}

TEST_F(StoreLiveness, AGoodbyeIsNoFailureAndNotesReachEveryWatcher) {
  auto watcher = client();
  auto other_watcher = client();
  uint64_t since = 0;
  {
    auto leaving = client();
    leaving->hello(3, 0, 10s, "l");
    leaving->goodbye(3, 0, 0);
  }
  auto ended = await_state(*watcher, since, 3, SlotState::Ended, 2s);
  EXPECT_EQ(ended.why, "it ended");
  std::thread poster([&] {
    std::this_thread::sleep_for(50ms);
    client()->note("ft abandon 7");
  });
  auto change = other_watcher->watch(0, watcher->watch(0, 0, 1ms, {}).version, 5s, {});
  poster.join();
  ASSERT_EQ(change.notes.size(), 1u);
  EXPECT_EQ(change.notes[0], "ft abandon 7");
}

// A job that clears abandoned folders on its host (rank 0 hosting a store)
// took another job's folder still being made, whose owner it had not yet
// written, for abandoned: the other's folder lost its owner, and its ranks
// waited for one until their timeout.
TEST(JobFolders, AFolderBeingMadeIsNeverTakenForAJobFolder) {
  EXPECT_TRUE(store::is_job_folder_name("port-29500"));
  EXPECT_FALSE(store::is_job_folder_name("port-29500.draft"));
  EXPECT_FALSE(store::is_job_folder_name("port-"));
  EXPECT_FALSE(store::is_job_folder_name("ledger-port-1"));
  ScratchFolder base("job-folders");
  auto folder = store::job_folder(base.path(), 4242);
  ASSERT_EQ(store::create_job_folder(folder, "host 1 2"), "");
  EXPECT_EQ(store::folder_owner(folder), "host 1 2");
  EXPECT_FALSE(std::filesystem::exists(folder + ".draft"));
}

} // namespace
} // namespace lockstep::testing
