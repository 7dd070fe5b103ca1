#pragma once

// Umbrella header: everything a training program needs from lockstep.

#include <lockstep/autocast.h>
#include <lockstep/checkpoint.h>
#include <lockstep/comm_hook.h>
#include <lockstep/ddp.h>
#include <lockstep/ddp_options.h>
#include <lockstep/ddp_stats.h>
#include <lockstep/debug_level.h>
#include <lockstep/distributed_sampler.h>
#include <lockstep/error.h>
#include <lockstep/fault_tolerance.h>
#include <lockstep/grad_scaler.h>
#include <lockstep/join.h>
#include <lockstep/power_sgd.h>
#include <lockstep/rank_zero.h>
#include <lockstep/step_in_backward.h>
#include <lockstep/step_loader.h>
#include <lockstep/step_sampler.h>
#include <lockstep/sync_batch_norm.h>
#include <lockstep/timeline.h>
#include <lockstep/world.h>
#include <lockstep/world_options.h>
#include <lockstep/zero_redundancy_optimizer.h>
