// Training plots: the loss curve (with test evaluations) and the step-time breakdown (computation vs
// communication in collectives) as one self-contained SVG, for people who would rather look than read
// the JSON Lines metrics.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardstep::runtime {

struct EvalPoint {
  int64_t step = 0;
  double accuracy = 0, loss = 0;  // accuracy: the task's metric (TrainingCurves::metric)
};

struct TrainingCurves {
  std::vector<double> loss;     // per step
  std::vector<double> step_ms;  // per step, wall time
  std::vector<double> comm_ms;  // per step, the part spent in collectives
  std::vector<EvalPoint> evals;
  std::string metric = "accuracy";  // what EvalPoint::accuracy holds: "accuracy", "bits_per_char", ...
};

// The SVG text: two panels sharing the step axis; long runs are averaged into at most ~600 points.
std::string TrainingPlotSvg(const TrainingCurves& curves, const std::string& title);

// Writes TrainingPlotSvg atomically to `path` (an error names the path and the reason).
void WriteTrainingPlot(const std::string& path, const TrainingCurves& curves, const std::string& title);

}  // namespace shardstep::runtime
