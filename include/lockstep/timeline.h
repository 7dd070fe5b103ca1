#pragma once

// The timeline: with LOCKSTEP_TIMELINE=path set, each rank writes
// path.rank<R>.json, a Chrome trace of its forwards, backwards, buckets
// (filling, queued, all-reducing), buffer broadcasts and other collectives,
// and the spans marked here. `lockstep-trace merge` joins the ranks into one
// trace for https://ui.perfetto.dev; docs/timeline.md shows one.

#include <chrono>
#include <string>

namespace lockstep {

/// Whether this process records a timeline: LOCKSTEP_TIMELINE is set and
/// init() has formed the world.
bool timeline_enabled();

/// Marks a span of the training loop, from construction to destruction:
///
///   { lockstep::TimelineSpan span("optimizer step"); optimizer.step(); }
///
/// Costs one atomic load when no timeline is recorded. Spans nest as the
/// scopes that hold them do. `name` must outlive the span (a literal does).
class TimelineSpan {
 public:
  explicit TimelineSpan(const char* name);
  ~TimelineSpan();
  TimelineSpan(const TimelineSpan&) = delete;
  TimelineSpan& operator=(const TimelineSpan&) = delete;

 private:
  const char* name_;
  bool active_;
  std::chrono::steady_clock::time_point begin_;
};

} // namespace lockstep
