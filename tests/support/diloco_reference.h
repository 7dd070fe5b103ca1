#pragma once

// The reference that the DiLoCo tests compare with: torchft's Streaming
// DiLoCo for N replicas simulated in one process, each with its own model
// and inner optimizer, and the global parameters stepped by outer
// optimizers of their own. And the check of DiLoCo across replicas that
// run DDP inside, which tests/diloco_test.cpp runs on one host and
// tests/programs/check_diloco across two (tests/scripts/two-nodes).

#include <optional>
#include <string>
#include <vector>

#include <lockstep/world.h>

#include "support/diloco_setup.h"

namespace lockstep::testing {

struct StreamingCase {
  int fragments;
  int64_t delay;
  double alpha;
  /// One outer optimizer for every fragment, as torchft takes it.
  bool shared_outer = false;
  /// DiLoCoOptions::wire_dtype.
  std::optional<torch::ScalarType> wire = std::nullopt;
};

/// What torchft's Streaming DiLoCo computes, for `replicas` replicas over
/// `steps` inner steps with sync_every `h`: each replica's parameters after
/// each step.
std::vector<std::vector<std::vector<torch::Tensor>>> streaming_reference(
    const StreamingCase& c, int replicas, int64_t h, int64_t steps);

/// Collective over `world`: DDP within replicas of `ranks_per_replica`
/// consecutive ranks (each rank its share of its replica's batch),
/// Streaming DiLoCo (2 fragments, H = 6, delay 1, alpha 0.5) across them,
/// compared after every step with streaming_reference over the replicas'
/// whole batches. Every difference, one line each; empty when none.
std::vector<std::string> check_diloco_with_ddp_inside(World& world, int ranks_per_replica);

} // namespace lockstep::testing
