// Whoever can write to the store (across hosts, or torchrun's store on one
// host) must not be able to hand the ranks memory of its own, nor take
// theirs: the segment passes from the creating rank's process to the
// processes that rendezvous named, over SCM_RIGHTS, and to no one else
// (transport/fd_handover.h). Three harness processes meet in a FileStore:
// harness ranks 0 and 1 are the host group, harness rank 2 the attacker.

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include "support/multiprocess.h"
#include "support/scratch_folder.h"
#include "transport/fd_handover.h"
#include "transport/shared_mapping.h"

namespace lockstep::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kKey = "transport/shm/staging";
constexpr size_t kBytes = 1 << 20;

std::string text(const std::vector<uint8_t>& bytes) {
  return {bytes.begin(), bytes.end()};
}

void set(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

struct Meeting {
  c10::intrusive_ptr<c10d::FileStore> store;
  detail::HostGroup group;
};

// Every harness process publishes its pid; the group is harness ranks 0
// and 1, as rendezvous would have named them.
Meeting meet(int rank) {
  Meeting meeting;
  meeting.store = c10::make_intrusive<c10d::FileStore>(
      std::string(std::getenv("LOCKSTEP_TEST_FOLDER")) + "/store", 3);
  set(*meeting.store, "pid/" + std::to_string(rank), std::to_string(::getpid()));
  meeting.group.ranks = {0, 1};
  for (int r = 0; r < 2; ++r) {
    meeting.store->wait({"pid/" + std::to_string(r)});
    meeting.group.pids.push_back(std::stoi(text(meeting.store->get("pid/" + std::to_string(r)))));
  }
  meeting.group.index = rank;
  meeting.group.timeout = std::chrono::seconds(5);
  return meeting;
}

LaunchResult run_three(const ScratchFolder& folder,
                       const std::function<void(int rank)>& body,
                       const std::string& shm_dir = "") {
  LaunchOptions options;
  options.world_size = 3;
  options.timeout = std::chrono::seconds(30);
  options.environment = [&](int, RankEnvironment& env) {
    env["LOCKSTEP_TEST_FOLDER"] = folder.path();
    env["LOCKSTEP_SHM_DIR"] = shm_dir;
  };
  return launch_ranks(options, body);
}

TEST(SharedMemoryHandover, AnOfferPlantedInTheStoreIsRefused) {
  ScratchFolder folder("planted-offer");
  auto result = run_three(folder, [](int rank) {
    Meeting meeting = meet(rank);
    auto& store = *meeting.store;
    if (rank == 2) {
      // Offers memory of the right size under the segment's key before
      // the creating rank does, and hands it to anyone who asks.
      std::string failure;
      detail::FdOffer offer(failure);
      ASSERT_EQ(failure, "");
      int fd = ::memfd_create("planted", 0);
      ASSERT_EQ(::ftruncate(fd, kBytes), 0);
      set(store, std::string(kKey) + "/where", "socket " + offer.name());
      set(store, "planted", "1");
      offer.serve(fd, {meeting.group.pids[1]}, Clock::now() + std::chrono::milliseconds(1500), [] { return true; });
      ::close(fd);
      return;
    }
    store.wait({"planted"});
    if (rank == 0) {
      // Late, so that rank 1 reads the planted offer first.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    auto shared = detail::share_mapping(store, kKey, meeting.group, kBytes);
    EXPECT_EQ(shared.mapping, nullptr) << "rank " << rank << " took a planted segment";
    for (const char* fragment : {"rank 1: the shared segment was offered by process ",
                                 "not by the rank that creates it (pid ",
                                 "refused, since whoever writes to the store could offer one"}) {
      EXPECT_NE(shared.failure.find(fragment), std::string::npos)
          << "rank " << rank << ": " << shared.failure;
    }
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

TEST(SharedMemoryHandover, ASymlinkPlantedWhereTheSegmentWouldBeIsNeverFollowed) {
  ScratchFolder folder("planted-link");
  ScratchFolder shm("planted-link-shm");
  {
    std::ofstream victim(folder / "victim");
    victim << "a file of the user's, which the segment must not overwrite";
  }
  auto result = run_three(
      folder,
      [](int rank) {
        if (rank == 2) {
          return;
        }
        std::string dir = std::getenv("LOCKSTEP_SHM_DIR");
        std::string victim = std::string(std::getenv("LOCKSTEP_TEST_FOLDER")) + "/victim";
        if (rank == 0) {
          // The name of this process's first segment, planted beforehand.
          std::string planted = dir + "/lockstep-" + std::to_string(::getpid()) + "-0";
          ASSERT_EQ(::symlink(victim.c_str(), planted.c_str()), 0);
        }
        Meeting meeting = meet(rank);
        auto shared = detail::share_mapping(*meeting.store, kKey, meeting.group, kBytes);
        EXPECT_EQ(shared.mapping, nullptr);
        EXPECT_NE(shared.failure.find("rank 0: cannot create shared memory at " + dir +
                                      "/lockstep-"),
                  std::string::npos)
            << "rank " << rank << ": " << shared.failure;
      },
      shm.path());
  if (!in_rank_process()) {
    EXPECT_TRUE(result.ok()) << result.report();
    std::ifstream victim(folder / "victim");
    std::stringstream contents;
    contents << victim.rdbuf();
    EXPECT_EQ(contents.str(), "a file of the user's, which the segment must not overwrite");
  }
}

TEST(SharedMemoryHandover, AProcessOutsideTheGroupThatAsksGetsNothing) {
  ScratchFolder folder("stranger");
  auto result = run_three(folder, [](int rank) {
    Meeting meeting = meet(rank);
    auto& store = *meeting.store;
    std::string where = std::string(kKey) + "/where";
    if (rank == 2) {
      // Knows where the offer is and whose it is, and asks for it first.
      store.wait({where});
      std::string offer = text(store.get(where));
      ASSERT_EQ(offer.rfind("socket ", 0), 0u) << offer;
      std::string failure;
      int fd = detail::take_fd(offer.substr(7), meeting.group.pids[0],
                               Clock::now() + std::chrono::seconds(3), failure);
      EXPECT_EQ(fd, -1) << "a process outside the group received the segment";
      EXPECT_EQ(failure, "the rank that creates the shared segment did not hand it over in time");
      set(store, "stranger done", "1");
      return;
    }
    if (rank == 1) {
      store.wait({"stranger done"});
    }
    auto shared = detail::share_mapping(store, kKey, meeting.group, kBytes);
    ASSERT_NE(shared.mapping, nullptr) << shared.failure;
    // The group's own ranks still share it.
    if (rank == 0) {
      std::strcpy(shared.mapping->data(), "from rank 0");
      set(store, "written", "1");
    } else {
      store.wait({"written"});
      EXPECT_STREQ(shared.mapping->data(), "from rank 0");
    }
    set(store, "read " + std::to_string(rank), "1");
    store.wait({"read 0", "read 1"});
  });
  EXPECT_TRUE(result.ok()) << result.report();
}

} // namespace
} // namespace lockstep::testing
