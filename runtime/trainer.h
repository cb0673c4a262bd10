// The training loop, for every task (models::Task): batches from a BatchSource in (prepared on another
// thread while the step runs), steps run, progress on the terminal, metrics as JSON Lines, evaluation of
// the task's metric on an EvalSet, checkpoints.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "ir/module.h"
#include "runtime/batch_source.h"
#include "runtime/dataset.h"
#include "runtime/executor.h"
#include "runtime/mllog.h"
#include "runtime/plot.h"

// models::Task (models/models.h), declared here: the runtime neither includes nor links the DSL. Its
// values are 0 classification, 1 language model, 2 masked LM (cli/train_command.cc checks this).
namespace shardstep::models {
enum class Task;
}

namespace shardstep::runtime {

inline constexpr models::Task kClassificationTask = static_cast<models::Task>(0);
inline constexpr models::Task kLanguageModelTask = static_cast<models::Task>(1);
inline constexpr models::Task kMaskedLmTask = static_cast<models::Task>(2);

struct TrainOptions {
  int64_t steps = 1000;
  int64_t batch = 64;        // global batch
  ir::Shape example_shape;   // per-example image shape the model takes (the Dataset overload of Train only)
  bool shuffle = true;
  uint64_t seed = 0;
  int64_t log_every = 100;   // progress lines
  int64_t eval_every = 0;    // 0: evaluate once at the end
  int64_t eval_batch = 1000; // must divide the test set size (the Dataset overload of Train only)
  // Prepare the next batch on another thread while the step runs (the same batches in the same order).
  bool prefetch = true;
  // Every step's global inputs into one safetensors file, tensors "step{k}/{input}" (k = step - 1), for
  // oracles that replay exactly the batches trained on ("" = none).
  std::string save_batches;
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
  // The MLPerf log (not owned; null = none). The loop logs run_start, a block (step_num metadata) per
  // evaluation interval, eval_start / eval_accuracy (the task's metric) / eval_stop, and run_stop with
  // status success, or aborted with the error when the run throws (then the error is rethrown). The
  // caller logs the submission keys and the init interval before.
  MlLog* mllog = nullptr;
  // Asked before every step (null: never). A non-zero answer (a signal number: runtime/stop_signal.h's
  // StopSignalReceived) ends the run with shardstep::Error "stopped by SIGTERM after step N" — with the
  // MLPerf log, run_stop aborted with that reason. Nothing is saved.
  std::function<int()> stop_requested;
};

struct TrainResult {
  std::vector<double> losses;  // per step
  double test_accuracy = -1;   // last evaluation's accuracy (classification; -1 when none ran)
  double test_metric = -1;     // last evaluation's task metric (MetricKey(task); -1 when none ran)
  double test_loss = 0;
  double examples_per_second = 0;
  TrainingCurves curves;       // per-step loss, step and communication time; evaluations
  int64_t skipped_steps = 0;   // steps left out for non-finite values (--on-nonfinite skip)
  // The data order after the last step (what a checkpoint at the end would save; the wrapped source
  // itself is a batch ahead when prefetching).
  int64_t data_epoch = 0, data_position = 0;
};

// Fraction of rows of `logits` [B, C] whose arg-max equals `labels` [B].
int64_t CountCorrect(const Tensor& logits, const Tensor& labels);

// The metric of a task, as the metrics file keys it: "accuracy", "bits_per_char", "masked_accuracy".
const char* MetricKey(models::Task task);

// The task's metric accumulated over batches from the forward program's "logits" and the inputs:
// classification: argmax == label per example; language model: -log2 softmax(logits)[target] per
// position; masked LM: argmax == target per position with mask_weights > 0. value() is the mean over
// what was counted.
struct MetricSum {
  double sum = 0;
  int64_t count = 0;
  void Add(models::Task task, const Tensor& logits, const TensorMap& inputs);
  double value() const { return count ? sum / count : 0; }
};

// What the training loop drives. shardstep::Session (api/session.h) implements it: the loop lives in the
// runtime, which must not depend on the API above it, so it sees only this interface. ExecutorTrainable
// adapts a bare executor plus an evaluation forward module (the runtime's own tests).
class Trainable {
 public:
  virtual ~Trainable() = default;
  // One training step on the global batch: "loss" averaged over the replicas and, with the non-finite
  // guard, "step_finite" and the "grad_check/<weight>" outputs (replica 0's, as Executor::Step).
  virtual TensorMap TrainStep(const TensorMap& global_batch) = 0;
  // The evaluation forward on one batch of an EvalSet: "loss" (the batch's mean) and per-example
  // outputs such as "logits" for every example of the batch.
  virtual TensorMap EvaluateBatch(const TensorMap& batch) = 0;
  virtual TensorMap LogicalState() const = 0;
  // Wall seconds in collectives so far (Executor::CommunicationSeconds): the loop logs each step's share.
  virtual double CommunicationSeconds() const = 0;
};

class ExecutorTrainable final : public Trainable {
 public:
  // `forward` (batch = the evaluation batch) must outlive this.
  ExecutorTrainable(Executor& exec, const ir::Module& forward) : exec_(exec), forward_(forward) {}
  TensorMap TrainStep(const TensorMap& global_batch) override { return exec_.Step(global_batch); }
  TensorMap EvaluateBatch(const TensorMap& batch) override { return exec_.Forward(forward_, batch); }
  TensorMap LogicalState() const override { return exec_.LogicalState(); }
  double CommunicationSeconds() const override { return exec_.CommunicationSeconds(); }

 private:
  Executor& exec_;
  const ir::Module& forward_;
};

struct EvalResult {
  double metric = 0;  // MetricSum::value() over the whole set
  double loss = 0;    // mean of the batches' "loss"
  double nsp_accuracy = -1;  // next-sentence accuracy when "nsp_logits" and input "next_sentence" exist (bert)
};
// Runs the evaluation forward (outputs "loss" and "logits") over every batch of `set`.
EvalResult EvaluateSet(Trainable& model, const EvalSet& set, models::Task task);
// The same with `forward` (batch = the set's batch) on `exec`.
EvalResult EvaluateSet(Executor& exec, const ir::Module& forward, const EvalSet& set, models::Task task);

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

// Runs `options.steps` steps of `model` (a shardstep::Session, or an ExecutorTrainable) on batches of
// `train` (which a resume Seeks to (data_epoch, data_position)). `eval` may be null (no evaluation).
// Progress goes to `log`.
TrainResult Train(Trainable& model, BatchSource& train, const EvalSet* eval, models::Task task,
                  const TrainOptions& options, std::ostream& log);
// The same on `exec`, evaluating with `forward_eval` (batch = the eval set's batch).
TrainResult Train(Executor& exec, const ir::Module& forward_eval, BatchSource& train, const EvalSet* eval,
                  models::Task task, const TrainOptions& options, std::ostream& log);

// Classification on in-memory datasets (options.batch, example_shape, shuffle, seed, eval_batch say how
// they are batched). `test` may be null (no evaluation).
TrainResult Train(Executor& exec, const ir::Module& forward_eval, const Dataset& train, const Dataset* test,
                  const TrainOptions& options, std::ostream& log);

}  // namespace shardstep::runtime
