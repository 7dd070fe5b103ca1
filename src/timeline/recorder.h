#pragma once

// The per-rank timeline behind LOCKSTEP_TIMELINE: spans on named tracks,
// written as Chrome trace events (the JSON array form, which a viewer reads
// even when a crash cut the file short). Recording is off, and costs one
// atomic load per call site, unless the variable is set.

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::detail::timeline {

using Clock = std::chrono::steady_clock;
using Args = std::vector<std::pair<std::string, std::string>>;

/// The track of the training loop: forward, backward, World's collectives
/// and the user's spans.
inline const std::string kLoopTrack = "training loop";

/// Opens `<LOCKSTEP_TIMELINE>.rank<rank>.json` when the variable is set;
/// called by init() once the rank is known. Raises ConfigError when the
/// file cannot be written.
void start(int rank);

bool enabled();

/// Makes sure that `track` exists, so that tracks appear in the viewer in
/// the order they were declared rather than first used.
void declare_track(const std::string& track);

/// Records the span [begin, end] named `name` on `track`. Spans on one
/// track must nest or follow each other.
void record(const std::string& track,
            const std::string& name,
            Clock::time_point begin,
            Clock::time_point end,
            const Args& args = {});

/// Hands what was recorded so far to the file system, so that a rank that
/// dies later leaves a readable trace.
void flush();

} // namespace lockstep::detail::timeline
