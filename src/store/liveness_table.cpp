#include "store/liveness_table.h"

namespace lockstep::store {
namespace {

// Notes kept for watchers that look late; an epoch given up is also a key
// of the store, so a watcher that misses one learns it there.
constexpr size_t kNotesKept = 256;

} // namespace

void LivenessTable::change(Entry& entry, SlotState state, std::string why) {
  entry.state = state;
  entry.why = std::move(why);
  entry.changed = ++version_;
}

std::optional<int> LivenessTable::hello(int slot, int incarnation,
                                        std::chrono::milliseconds timeout,
                                        const std::string& identity, uint64_t owner,
                                        Clock::time_point now) {
  auto& entry = entries_[slot];
  if (entry.incarnation > incarnation) {
    return entry.incarnation;
  }
  // Another process as the same incarnation while the one that holds it
  // lives: two launchers gave one incarnation out (a node replaced while
  // its old launcher lives on). The one that holds it stays; the other is
  // refused as stale, so that no two processes act as one member.
  if (entry.incarnation == incarnation && !entry.identity.empty() &&
      entry.identity != identity && entry.state == SlotState::Alive) {
    return entry.incarnation;
  }
  bool same = entry.incarnation == incarnation && entry.identity == identity;
  entry.incarnation = incarnation;
  entry.identity = identity;
  entry.owner = owner;
  entry.timeout = timeout;
  entry.last_beat = now;
  if (!same) {
    entry.progress = 0;
    entry.progress_since = now;
  }
  if (!same || entry.state != SlotState::Alive) {
    change(entry, SlotState::Alive, "");
  }
  return std::nullopt;
}

void LivenessTable::beat(int slot, int incarnation, int64_t progress,
                         std::chrono::milliseconds timeout, Clock::time_point now) {
  auto found = entries_.find(slot);
  if (found == entries_.end() || found->second.incarnation != incarnation) {
    return;
  }
  auto& entry = found->second;
  entry.last_beat = now;
  entry.timeout = timeout;
  if (progress != entry.progress) {
    entry.progress = progress;
    entry.progress_since = now;
  }
  // Back from a stop, or moving again after a report: alive, though the
  // epochs it was failed from stay given up.
  bool resumed = entry.state == SlotState::Silent ||
      (entry.state == SlotState::Reported && entry.progress != entry.progress_at_report);
  if (resumed) {
    change(entry, SlotState::Alive, "");
  }
}

void LivenessTable::lost(int slot, int incarnation, uint64_t owner) {
  auto found = entries_.find(slot);
  if (found == entries_.end() || found->second.incarnation != incarnation ||
      found->second.owner != owner || found->second.state == SlotState::Ended) {
    return;
  }
  change(found->second, SlotState::Exited,
         "it exited, or lost its connection to the job's store");
}

void LivenessTable::end(int slot, int incarnation, int64_t progress) {
  auto found = entries_.find(slot);
  if (found == entries_.end() || found->second.incarnation != incarnation ||
      found->second.state == SlotState::Ended) {
    return;
  }
  found->second.progress = progress;
  change(found->second, SlotState::Ended, "it ended");
}

bool LivenessTable::report(int slot, int incarnation, const std::string& why) {
  auto found = entries_.find(slot);
  if (found == entries_.end() || found->second.incarnation != incarnation ||
      found->second.state != SlotState::Alive) {
    return false;
  }
  found->second.progress_at_report = found->second.progress;
  change(found->second, SlotState::Reported, why);
  return true;
}

void LivenessTable::note(const std::string& text) {
  notes_.push_back({++version_, text});
  if (notes_.size() > kNotesKept) {
    notes_.pop_front();
  }
}

void LivenessTable::expire(Clock::time_point now) {
  for (auto& [slot, entry] : entries_) {
    if (entry.state != SlotState::Alive || now - entry.last_beat <= entry.timeout) {
      continue;
    }
    auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - entry.last_beat);
    change(entry, SlotState::Silent,
           "it sent no heartbeat for " + std::to_string(silent.count()) +
               " ms (the heartbeat timeout is " + std::to_string(entry.timeout.count()) +
               " ms): it is stopped, hung or cut off");
  }
}

void LivenessTable::write_view(uint64_t since, Writer& out) const {
  out.i64(static_cast<int64_t>(version_));
  uint32_t changed = 0;
  for (const auto& [slot, entry] : entries_) {
    changed += entry.changed > since;
  }
  out.u32(changed);
  for (const auto& [slot, entry] : entries_) {
    if (entry.changed > since) {
      out.u32(static_cast<uint32_t>(slot))
          .u32(static_cast<uint32_t>(entry.incarnation))
          .u8(static_cast<uint8_t>(entry.state))
          .str(entry.why)
          .str(entry.identity);
    }
  }
  uint32_t notes = 0;
  for (const auto& posted : notes_) {
    notes += posted.seq > since;
  }
  out.u32(notes);
  for (const auto& posted : notes_) {
    if (posted.seq > since) {
      out.str(posted.text);
    }
  }
}

void LivenessTable::write_progress(Clock::time_point now, Writer& out) const {
  out.u32(static_cast<uint32_t>(entries_.size()));
  for (const auto& [slot, entry] : entries_) {
    auto still = std::chrono::duration_cast<std::chrono::milliseconds>(now - entry.progress_since);
    out.u32(static_cast<uint32_t>(slot))
        .u32(static_cast<uint32_t>(entry.incarnation))
        .i64(entry.progress)
        .i64(still.count())
        .u8(static_cast<uint8_t>(entry.state));
  }
}

ViewChange ViewChange::read(Reader& in) {
  ViewChange change;
  change.version = static_cast<uint64_t>(in.i64());
  uint32_t slots = in.count(17);
  for (uint32_t i = 0; i < slots; ++i) {
    SlotView view;
    view.slot = static_cast<int>(in.u32());
    view.incarnation = static_cast<int>(in.u32());
    view.state = static_cast<SlotState>(in.u8());
    view.why = in.str();
    view.identity = in.str();
    change.slots.push_back(std::move(view));
  }
  uint32_t notes = in.count(4);
  for (uint32_t i = 0; i < notes; ++i) {
    change.notes.push_back(in.str());
  }
  return change;
}

std::vector<SlotProgress> read_progress(Reader& in) {
  std::vector<SlotProgress> all;
  uint32_t slots = in.count(25);
  for (uint32_t i = 0; i < slots; ++i) {
    SlotProgress progress;
    progress.slot = static_cast<int>(in.u32());
    progress.incarnation = static_cast<int>(in.u32());
    progress.progress = in.i64();
    progress.still_for = std::chrono::milliseconds(in.i64());
    progress.state = static_cast<SlotState>(in.u8());
    all.push_back(progress);
  }
  return all;
}

} // namespace lockstep::store
