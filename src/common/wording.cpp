#include "common/wording.h"

#include <c10/util/StringUtil.h>

namespace lockstep::detail {

std::string rank_list(const std::vector<int>& ranks) {
  // Runs of three or more consecutive ranks as "first–last": a rendezvous
  // of 3000 ranks that one rank reached says "1–2999", not 2999 numbers.
  std::string out;
  for (size_t first = 0; first < ranks.size();) {
    size_t last = first;
    while (last + 1 < ranks.size() && ranks[last + 1] == ranks[last] + 1) {
      ++last;
    }
    out += out.empty() ? "" : ", ";
    if (last - first >= 2) {
      out += std::to_string(ranks[first]) + "–" + std::to_string(ranks[last]);
      first = last + 1;
    } else {
      out += std::to_string(ranks[first]);
      ++first;
    }
  }
  return out.empty() ? "none" : out;
}

std::string seconds(std::chrono::milliseconds duration) {
  return c10::str(static_cast<double>(duration.count()) / 1000.0, " s");
}

} // namespace lockstep::detail
