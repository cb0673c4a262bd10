// The training loop: batches in, steps run, progress on the terminal, metrics as JSON Lines,
// evaluation on the test split, checkpoints.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <map>
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
  // Periodic checkpoints (checkpoint_dir.h): every `save_every` steps (0 = none) into `checkpoint_dir`,
  // keeping the newest `keep`, with `checkpoint_metadata` (the run's identifying options) besides the
  // loop's own resume state. The directory must have been readied (PrepareCheckpointDirectory).
  int64_t save_every = 0;
  std::string checkpoint_dir;
  int64_t keep = 3;
  std::map<std::string, std::string> checkpoint_metadata;
  // Resume: the executor already holds the state after `start_step` steps; the data order continues
  // from (data_epoch, data_position); metrics_out keeps its lines up to start_step and is appended to.
  int64_t start_step = 0;
  int64_t data_epoch = 0, data_position = 0;
  int64_t start_skipped_steps = 0;
  // Per-replica memory (name -> bytes), written as the first metrics line {"memory": {...}}.
  std::vector<std::pair<std::string, int64_t>> memory;
  // A step whose loss or gradients hold NaN/inf (the step module's "step_finite" output, added by the
  // nonfinite-guard pass, is 0; such a step changed no state): kStop throws shardstep::Error naming the
  // step and the first non-finite tensor (nothing is saved); kSkip counts it and goes on; kIgnore does
  // not look at the flag (a non-finite loss still ends the run, as before the guard existed). Without
  // the guard in the step module, every mode behaves as kIgnore.
  enum class OnNonfinite { kStop, kSkip, kIgnore };
  OnNonfinite on_nonfinite = OnNonfinite::kStop;
};

struct TrainResult {
  std::vector<double> losses;  // per step
  double test_accuracy = -1;   // last evaluation (-1 when none ran)
  double test_loss = 0;
  double examples_per_second = 0;
  TrainingCurves curves;       // per-step loss, step and communication time; evaluations
  int64_t skipped_steps = 0;   // steps left out for non-finite values (--on-nonfinite skip)
};

// Fraction of rows of `logits` [B, C] whose arg-max equals `labels` [B].
int64_t CountCorrect(const Tensor& logits, const Tensor& labels);

// Evaluates `forward` (outputs "loss" and "logits", batch = eval batch) over the whole split; throws
// shardstep::Error when `eval_batch` does not divide the split (no example is left out silently).
void Evaluate(Executor& exec, const ir::Module& forward, const Dataset& data, int64_t eval_batch,
              const ir::Shape& example_shape, double* accuracy, double* loss);

// After a step whose "step_finite" output is 0: "step 7: non-finite loss (nan) and gradients of @fc1.w,
// ...; first non-finite tensor: input @image (...)". Looks at the inputs (by name), then the state at
// the start of the step (the guarded step left it unchanged; by variable name), then the loss, then
// the gradient checks by weight name (the "grad_check/<weight>" outputs), and names the first that
// holds a NaN or inf. The rare path only: it reads the whole state.
std::string DescribeNonfiniteStep(int64_t step, const TensorMap& inputs, const TensorMap& outputs, const TensorMap& state);

// Runs `options.steps` steps. `test` may be null (no evaluation). Progress goes to `log`.
TrainResult Train(Executor& exec, const ir::Module& forward_eval, const Dataset& train, const Dataset* test,
                  const TrainOptions& options, std::ostream& log);

}  // namespace shardstep::runtime
