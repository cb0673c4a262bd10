// The training loop: batches in, steps run, progress on the terminal, metrics as JSON Lines,
// evaluation on the test split, checkpoints.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "ir/module.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/plot.h"

namespace shardstep::runtime {

struct TrainOptions {
  int64_t steps = 1000;
  int64_t batch = 64;        // global batch
  ir::Shape example_shape;   // per-example image shape the model takes
  bool shuffle = true;
  uint64_t seed = 0;
  int64_t log_every = 100;   // progress lines
  int64_t eval_every = 0;    // 0: evaluate once at the end
  int64_t eval_batch = 1000; // must divide the test set size (Evaluate throws otherwise)
  std::string metrics_out;   // JSON Lines file ("" = none)
  std::string plot_out;      // SVG of the loss curve and step-time breakdown ("" = none)
  std::string plot_title;
  std::string save;          // checkpoint written at the end ("" = none)
  // Per-replica memory (name -> bytes), written as the first metrics line {"memory": {...}}.
  std::vector<std::pair<std::string, int64_t>> memory;
};

struct TrainResult {
  std::vector<double> losses;  // per step
  double test_accuracy = -1;   // last evaluation (-1 when none ran)
  double test_loss = 0;
  double examples_per_second = 0;
  TrainingCurves curves;       // per-step loss, step and communication time; evaluations
};

// Fraction of rows of `logits` [B, C] whose arg-max equals `labels` [B].
int64_t CountCorrect(const Tensor& logits, const Tensor& labels);

// Evaluates `forward` (outputs "loss" and "logits", batch = eval batch) over the whole split; throws
// shardstep::Error when `eval_batch` does not divide the split (no example is left out silently).
void Evaluate(Executor& exec, const ir::Module& forward, const Dataset& data, int64_t eval_batch,
              const ir::Shape& example_shape, double* accuracy, double* loss);

// Runs `options.steps` steps. `test` may be null (no evaluation). Progress goes to `log`.
TrainResult Train(Executor& exec, const ir::Module& forward_eval, const Dataset& train, const Dataset* test,
                  const TrainOptions& options, std::ostream& log);

}  // namespace shardstep::runtime
