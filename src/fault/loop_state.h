#pragma once

// What a lockstep::FaultTolerance holds, shared by its two halves: the
// loop (fault_tolerance.cpp: begin_step, commit) and the re-forming of the
// world after a failure or for a rank that joins (reform.cpp).

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <lockstep/fault_tolerance.h>

#include "fault/liveness.h"
#include "fault/membership.h"

namespace lockstep {

namespace detail {

/// The first line of an error's text, for one-line decisions and logs.
std::string first_line(const std::string& text);
/// "rank 2" or "ranks 0, 2" (launcher ranks).
std::string describe(const std::vector<Member>& members);

} // namespace detail

struct FaultTolerance::Impl {
  using Clock = std::chrono::steady_clock;
  std::shared_ptr<detail::Reducer> reducer;
  torch::optim::Optimizer& optimizer;
  FaultToleranceOptions options;
  World base;  // init()'s: the job's store
  World world; // the current epoch's
  detail::Member me;
  int slots = 1;
  std::unique_ptr<detail::Membership> membership;
  std::unique_ptr<detail::Liveness> liveness;
  int64_t epoch = -1;
  std::vector<detail::Member> members;
  int64_t committed = 0;
  bool holds_state = true;
  bool need_reform = false;
  bool in_step = false;
  int64_t backwards_at_begin = 0;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffers_at_begin;
  FaultToleranceStats stats;

  Impl(std::shared_ptr<detail::Reducer> reducer_in,
       torch::optim::Optimizer& optimizer_in,
       FaultToleranceOptions options_in)
      : reducer(std::move(reducer_in)),
        optimizer(optimizer_in),
        options(options_in),
        base(reducer->world()),
        world(base) {}

  /// A connection of its own to the job's store, under "ft".
  c10::intrusive_ptr<c10d::Store> ft_store() const;

  void say(const std::string& line) const {
    if (options.verbose()) {
      std::cerr << "lockstep: rank " << me.replica << ": " << line << std::endl;
    }
  }

  std::string proof_message(int64_t target) const {
    return detail::str("e", target, "|", me.replica, "|", me.incarnation);
  }

  void reform();
  std::vector<detail::Member> await_members(int64_t target, Clock::time_point deadline);
  World form(int64_t target, const std::vector<detail::Member>& decided);
  void bring_up_to_date(World& next, const std::vector<detail::Member>& decided);
  std::string await_decision();
};
} // namespace lockstep
