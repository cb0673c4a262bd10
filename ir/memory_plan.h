// Memory accounting per replica: weights, optimizer state, gradients and peak temporaries from a
// simple buffer plan (each value's buffer lives from its definition to its last use).
#pragma once

#include <cstdint>
#include <string>

#include "ir/module.h"

namespace shardstep::ir {

struct MemoryPlan {
  int64_t weight_bytes = 0;           // weight variables as stored per replica
  int64_t optimizer_state_bytes = 0;  // optimizer state and step counter per replica
  int64_t gradient_bytes = 0;         // per-replica gradient buffers entering collectives
  int64_t peak_temp_bytes = 0;        // peak bytes of live temporaries (activations, gradients, update)
  std::string ToString() const;
};

MemoryPlan PlanMemory(const Module& m);

}  // namespace shardstep::ir
