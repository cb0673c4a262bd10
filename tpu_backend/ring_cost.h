// The α–β time of a ring schedule: every step's transfers run at once, each directed link (or, on
// chip, each ordered pair of cores) moving what the step puts on it in latency + bytes / bandwidth;
// a step lasts as long as its busiest link, and steps follow each other. This is the interconnect
// half of the step-time simulator (DESIGN §4); the link numbers come from the hardware tables.
#pragma once

#include "tpu_backend/ring_schedule.h"

namespace shardstep::tpu {

struct LinkModel {
  double latency_s = 0;     // α: per message
  double bytes_per_s = 0;   // β: one direction of one link
};

struct ScheduleTime {
  double seconds = 0;
  int64_t steps = 0;
  int64_t max_link_bytes_per_step = 0;  // the busiest link of the busiest step
};

// Throws shardstep::Error if a link model has a non-positive bandwidth or a negative latency.
ScheduleTime TimeOf(const MeshTopology& mesh, const RingSchedule& schedule, const LinkModel& ici,
                    const LinkModel& on_chip);

}  // namespace shardstep::tpu
