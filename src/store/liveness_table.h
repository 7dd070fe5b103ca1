#pragma once

// Who is alive, as the job store judges it: the one liveness system of a
// job. Each process beats for its slot (its launcher rank) on a connection
// of its own; the store, which every process reaches, judges from its own
// clock, so a verdict never rests on an observer's stale read:
//   - a connection that closes without a goodbye: the process exited (or
//     lost the store), seen at once;
//   - no beat for the timeout the process declared: stopped, hung or cut
//     off;
//   - a newer incarnation of the slot says hello: the old one was
//     replaced (a restart);
//   - an observer reports it (its progress stalled while the others went
//     on): it stays failed until its progress moves again.
// Every change bumps one version; a watcher that knows version V receives
// the entries changed since V and the notes (short lines that every
// watcher must hear, such as an epoch given up) posted since. Each beat is
// a request, each change one answer per watcher: O(N) in all per interval.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include "store/wire.h"

namespace lockstep::store {

enum class SlotState : uint8_t {
  Alive = 0,
  Silent = 1,   // no beat for its timeout
  Exited = 2,   // its connection closed without a goodbye
  Ended = 3,    // it said goodbye: it ended cleanly
  Reported = 4, // an observer judged it failed (why says how)
};

class LivenessTable {
 public:
  using Clock = std::chrono::steady_clock;

  /// Registers `incarnation` of `slot`. Returns the newer incarnation that
  /// holds the slot already (the caller is then refused), or nullopt.
  /// `owner` names the connection that beats for it from now on.
  std::optional<int> hello(int slot, int incarnation, std::chrono::milliseconds timeout,
                           const std::string& identity, uint64_t owner, Clock::time_point now);
  /// A beat, carrying the process's progress and the timeout it declares.
  void beat(int slot, int incarnation, int64_t progress, std::chrono::milliseconds timeout,
            Clock::time_point now);
  /// Connection `owner` closed: Exited, unless it said goodbye first or
  /// another connection beats for it since.
  void lost(int slot, int incarnation, uint64_t owner);
  /// It said goodbye: its end is no failure.
  void end(int slot, int incarnation, int64_t progress);
  /// Returns whether it changed anything (a process already failed stays
  /// as it is, so that many observers reporting one hang bump once).
  bool report(int slot, int incarnation, const std::string& why);
  void note(const std::string& text);
  /// Marks the processes silent past their timeout.
  void expire(Clock::time_point now);

  uint64_t version() const {
    return version_;
  }
  /// Appends the entries changed and the notes posted since `since`.
  void write_view(uint64_t since, Writer& out) const;
  /// Appends every slot's progress and for how long it has not moved.
  void write_progress(Clock::time_point now, Writer& out) const;
  size_t slots() const {
    return entries_.size();
  }

 private:
  struct Entry {
    int incarnation = -1;
    std::string identity;
    uint64_t owner = 0;
    std::chrono::milliseconds timeout{0};
    Clock::time_point last_beat{};
    int64_t progress = 0;
    Clock::time_point progress_since{};
    int64_t progress_at_report = 0;
    SlotState state = SlotState::Alive;
    std::string why;
    uint64_t changed = 0;
  };
  void change(Entry& entry, SlotState state, std::string why);

  std::map<int, Entry> entries_;
  struct Posted {
    uint64_t seq;
    std::string text;
  };
  std::deque<Posted> notes_;
  uint64_t version_ = 1;
};

/// What a watcher learns of one slot (client side).
struct SlotView {
  int slot = -1;
  int incarnation = -1;
  SlotState state = SlotState::Alive;
  std::string why;
  std::string identity;
};

/// A Watch answer, parsed.
struct ViewChange {
  uint64_t version = 0;
  std::vector<SlotView> slots;
  std::vector<std::string> notes;
  static ViewChange read(Reader& in);
};

/// One slot's progress (a Progress answer).
struct SlotProgress {
  int slot = -1;
  int incarnation = -1;
  int64_t progress = 0;
  std::chrono::milliseconds still_for{0};
  SlotState state = SlotState::Alive;
};
std::vector<SlotProgress> read_progress(Reader& in);

} // namespace lockstep::store
