// The SVG of `shardstep simulate --sweep`: the simulated speedup of weight-update sharding (replicated
// step time / sharded step time) against the mesh size, one line per per-core batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardstep::tpu {

struct SpeedupPoint {
  int chips = 0;     // X*Y
  std::string mesh;  // "8x8"
  int64_t per_core_batch = 0;
  double speedup = 0;
  int64_t global_batch = 0;  // > 0: a fixed-global-batch sweep (lines per global batch, not per-core batch)
};

// A self-contained SVG: x = chips (log scale, points labelled by mesh), y = speedup, a dashed line at 1;
// one line per per-core batch, or per global batch when the points have one.
std::string SpeedupPlotSvg(const std::vector<SpeedupPoint>& points, const std::string& title);

}  // namespace shardstep::tpu
