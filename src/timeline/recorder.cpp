#include "timeline/recorder.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include <lockstep/error.h>
#include <lockstep/timeline.h>

namespace lockstep::detail::timeline {
namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

class Recorder {
 public:
  ~Recorder() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (file_) {
      std::fputs("\n]\n", file_);
      std::fclose(file_);
    }
  }

  void start(int rank) {
    const char* path = std::getenv("LOCKSTEP_TIMELINE");
    if (path == nullptr || *path == '\0') {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (file_) {
      return; // a second World in the same process keeps writing here
    }
    std::string name = str(path, ".rank", rank, ".json");
    file_ = std::fopen(name.c_str(), "w");
    LOCKSTEP_ENFORCE(
        file_ != nullptr, ConfigError, "LOCKSTEP_TIMELINE=", path,
        ": cannot write the timeline ", name, ": ", std::strerror(errno), ".");
    rank_ = rank;
    // Wall-clock microseconds, so that the ranks of several machines line
    // up as well as their clocks do; durations come from the steady clock.
    auto wall = std::chrono::system_clock::now().time_since_epoch();
    epoch_us_ = std::chrono::duration<double, std::micro>(wall).count();
    epoch_ = Clock::now();
    std::fputs("[", file_);
    write_metadata("process_name", -1, str("rank ", rank));
    write_metadata("process_sort_index", -1, std::to_string(rank));
    track_id(kLoopTrack);
    enabled_.store(true, std::memory_order_release);
  }

  bool enabled() const {
    return enabled_.load(std::memory_order_acquire);
  }

  void declare(const std::string& track) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (file_) {
      track_id(track);
    }
  }

  void record(const std::string& track, const std::string& name,
              Clock::time_point begin, Clock::time_point end, const Args& args) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!file_) {
      return;
    }
    int tid = track_id(track);
    std::string fields;
    for (const auto& [key, value] : args) {
      fields += str(fields.empty() ? "" : ",", json_string(key), ":", json_string(value));
    }
    std::fprintf(
        file_, ",\n{\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
        "\"name\":%s,\"args\":{%s}}",
        rank_, tid, micros(begin), std::max(0.0, micros(end) - micros(begin)),
        json_string(name).c_str(), fields.c_str());
  }

  void flush() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (file_) {
      std::fflush(file_);
    }
  }

 private:
  double micros(Clock::time_point at) const {
    return epoch_us_ + std::chrono::duration<double, std::micro>(at - epoch_).count();
  }

  int track_id(const std::string& track) {
    auto found = tracks_.find(track);
    if (found != tracks_.end()) {
      return found->second;
    }
    int tid = static_cast<int>(tracks_.size());
    tracks_[track] = tid;
    write_metadata("thread_name", tid, track);
    write_metadata("thread_sort_index", tid, std::to_string(tid));
    return tid;
  }

  // Metadata events: the names and the order of the rows in the viewer.
  void write_metadata(const std::string& kind, int tid, const std::string& value) {
    bool is_name = kind.find("name") != std::string::npos;
    std::fprintf(
        file_, "%s\n{\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"name\":\"%s\",\"args\":{\"%s\":%s}}",
        first_event_ ? "" : ",", rank_, std::max(tid, 0), kind.c_str(),
        is_name ? "name" : "sort_index",
        is_name ? json_string(value).c_str() : value.c_str());
    first_event_ = false;
  }

  std::mutex mutex_;
  std::atomic<bool> enabled_{false};
  std::FILE* file_ = nullptr;
  bool first_event_ = true;
  int rank_ = 0;
  double epoch_us_ = 0;
  Clock::time_point epoch_;
  std::map<std::string, int> tracks_;
};

Recorder& recorder() {
  static Recorder instance;
  return instance;
}

} // namespace

void start(int rank) {
  recorder().start(rank);
}

bool enabled() {
  return recorder().enabled();
}

void declare_track(const std::string& track) {
  recorder().declare(track);
}

void record(const std::string& track, const std::string& name,
            Clock::time_point begin, Clock::time_point end, const Args& args) {
  recorder().record(track, name, begin, end, args);
}

void flush() {
  recorder().flush();
}

} // namespace lockstep::detail::timeline

namespace lockstep {

bool timeline_enabled() {
  return detail::timeline::enabled();
}

TimelineSpan::TimelineSpan(const char* name)
    : name_(name), active_(detail::timeline::enabled()) {
  if (active_) {
    begin_ = detail::timeline::Clock::now();
  }
}

TimelineSpan::~TimelineSpan() {
  if (active_) {
    detail::timeline::record(detail::timeline::kLoopTrack, name_, begin_,
                             detail::timeline::Clock::now());
  }
}

} // namespace lockstep
