#pragma once

// Umbrella header: everything a training program needs from lockstep.

#include <lockstep/error.h>
#include <lockstep/world.h>
#include <lockstep/world_options.h>
