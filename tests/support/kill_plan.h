#pragma once

// The kill plans of the fault-tolerance test programs (elastic_float64,
// groups_float64): LOCKSTEP_TEST_KILLS="R:I:STEP:PHASE,..." names the
// launcher rank R, its incarnation I, the first step at which it may die
// and the place in the step (each program says which places it has).

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep::testing {

struct Kill {
  int replica = 0;
  int incarnation = 0;
  int64_t step = 0;
  std::string phase;
};

inline std::vector<Kill> planned_kills() {
  std::vector<Kill> kills;
  const char* plan = std::getenv("LOCKSTEP_TEST_KILLS");
  std::stringstream in(plan ? plan : "");
  for (std::string item; std::getline(in, item, ',');) {
    Kill kill;
    char phase[32] = {0};
    long long step = 0;
    if (std::sscanf(item.c_str(), "%d:%d:%lld:%31s", &kill.replica, &kill.incarnation, &step,
                    phase) == 4) {
      kill.step = step;
      kill.phase = phase;
      kills.push_back(kill);
    }
  }
  return kills;
}

} // namespace lockstep::testing
