// The metrics file (--metrics-out, JSON Lines) of a resumed run.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/plot.h"

namespace shardstep::runtime {

// Rewrites the JSON Lines file `path` (atomically) keeping only the lines of steps up to `step`:
// lines without a "step" (the memory line) stay, lines with "step" > `step` (steps that the resumed
// run does again) and lines that are not a whole JSON object (the torn last line of a killed run)
// go. Returns false, changing nothing, when `path` does not exist. Throws shardstep::Error naming
// the file when it cannot be read or written. With `curves`, fills it with the kept steps 1..`step`
// (loss, step_ms, comm_ms; NaN for a step without a line, which the plot leaves blank) and
// evaluations, so that a resumed run's --plot-out shows the whole run.
bool KeepMetricsUpTo(const std::string& path, int64_t step, TrainingCurves* curves = nullptr);

}  // namespace shardstep::runtime
