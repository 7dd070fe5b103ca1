#include "support/documented_error.h"

#include <fstream>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>
#include "support/paths.h"

namespace lockstep::testing {

std::string documented_message(const std::string& name) {
  std::ifstream file(std::string(lockstep::testing::source_dir()) + "/docs/troubleshooting.md");
  std::stringstream text;
  text << file.rdbuf();
  std::string page = text.str();
  std::string marker = "<!-- tested: " + name + " -->\n```text\n";
  auto start = page.find(marker);
  if (start == std::string::npos) {
    ADD_FAILURE() << "docs/troubleshooting.md has no message '" << name << "'";
    return "";
  }
  start += marker.size();
  auto end = page.find("\n```", start);
  return page.substr(start, end - start);
}

bool matches_documented(const std::string& message, const std::string& pattern) {
  const std::string any = "…";
  std::vector<std::string> pieces;
  for (size_t from = 0;;) {
    size_t next = pattern.find(any, from);
    pieces.push_back(pattern.substr(from, next - from));
    if (next == std::string::npos) {
      break;
    }
    from = next + any.size();
  }
  if (pieces.size() == 1) {
    return message == pattern;
  }
  const auto& head = pieces.front();
  const auto& tail = pieces.back();
  if (message.compare(0, head.size(), head) != 0 || message.size() < head.size() + tail.size() ||
      message.compare(message.size() - tail.size(), tail.size(), tail) != 0) {
    return false;
  }
  size_t at = head.size();
  size_t limit = message.size() - tail.size();
  for (size_t i = 1; i + 1 < pieces.size(); ++i) {
    at = message.find(pieces[i], at);
    if (at == std::string::npos || at + pieces[i].size() > limit) {
      return false;
    }
    at += pieces[i].size();
  }
  return true;
}

} // namespace lockstep::testing
