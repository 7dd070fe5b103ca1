// A replica group that comes back as a unit (fault_tolerance.h): a rank of
// it died, the others ended with it, and lockstep-run restarted each of
// them alone, each with a world of its own. They meet again through the
// job's store: each posts its incarnation under its group and place, and
// they form the group's world under a scope named by the incarnations
// that every place posted, so that no two formations of a group share
// keys. A post that changes while they form (its process was restarted
// once more, or it was an earlier incarnation's, which is ending) starts
// the formation again under the new names.

#include <algorithm>
#include <future>
#include <thread>

#include "common/wording.h"
#include "fault/group_rendezvous.h"
#include "fault/loop_state.h"
#include "store/client.h"
#include "world/epoch_world.h"

namespace lockstep::detail {

World rejoin_group(const World& world, int group_size) {
  using Clock = std::chrono::steady_clock;
  const int replica = WorldAccess::replica(world);
  const int incarnation = WorldAccess::incarnation(world);
  const int group = replica / group_size;
  const int place = replica % group_size;
  auto client = WorldAccess::store_client(world);
  Membership membership(WorldAccess::store_client(world), WorldAccess::key_prefix(world),
                        signer_of(world));
  const std::string folder =
      str(WorldAccess::key_prefix(world), "/groups/", group_size, "/", group, "/");
  client->set(folder + std::to_string(place), std::to_string(incarnation));
  auto read_posts = [&] {
    std::vector<std::string> posts;
    for (int p = 0; p < group_size; ++p) {
      posts.push_back(client->get(folder + std::to_string(p)).value_or(""));
    }
    return posts;
  };
  const auto deadline = Clock::now() + world.timeout();
  auto look_for_the_end = Clock::now();
  // A group restarted after the job's loop ended (its rank failed after
  // the loop, or its others ended meanwhile) waits for no one: looked for
  // every second, in either wait.
  auto leave_if_ended = [&] {
    if (Clock::now() >= look_for_the_end) {
      if (membership.finished()) {
        leave_ended_job(membership, replica, incarnation);
      }
      look_for_the_end = Clock::now() + std::chrono::seconds(1);
    }
  };
  while (Clock::now() < deadline) {
    leave_if_ended();
    auto posts = read_posts();
    if (std::any_of(posts.begin(), posts.end(), [](const std::string& p) { return p.empty(); })) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    std::string scope = str("group", group_size, ".", group, ".i");
    for (const auto& post : posts) {
      scope += post + ".";
    }
    // On a thread: the wait is given up when a post changes, and the
    // formation left to its own timeout.
    auto formed = std::make_shared<std::promise<World>>();
    auto result = formed->get_future();
    std::thread([formed, world, place, group_size, scope] {
      try {
        formed->set_value(WorldAccess::form(world, place, group_size, scope));
      } catch (...) {
        formed->set_exception(std::current_exception());
      }
    }).detach();
    while (result.wait_for(std::chrono::milliseconds(50)) != std::future_status::ready &&
           read_posts() == posts && Clock::now() < deadline) {
      leave_if_ended();
    }
    if (result.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      try {
        return result.get();
      } catch (const std::exception&) {
        // A member that did not come: read the posts again, in a while.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    }
  }
  LOCKSTEP_FAIL(RendezvousError, "rank ", replica, " (incarnation ", incarnation,
                ") was restarted with its replica group ", group,
                " (launcher ranks ", group * group_size, " to ", (group + 1) * group_size - 1,
                "), but the group's other ranks did not all come back within the world's "
                "timeout (", seconds(world.timeout()), ").");
}

} // namespace lockstep::detail
