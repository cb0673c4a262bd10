// What the MLPerf-style binaries (bench/mlperf/mlperf_{resnet,transformer,bert}.cc) share: the flags, the
// time-to-quality loop with its MLPerf log (runtime/mllog.h), the summary, the JSON result file and the
// SVG of quality against time. A binary only says what its recipe is (a Benchmark): the model written
// with the DSL, the optimizer, the data and the quality target.
//
// One run: the submission keys, init_start; the data, the step program and its compilation (the
// Session's first step is not part of init: the JIT compiles when the Session is built); init_stop;
// run_start; blocks of `eval_every` steps, each followed by an evaluation (eval_start, eval_accuracy,
// eval_stop); run_stop with status success as soon as an evaluation reaches the target, aborted when the
// step budget is spent first (exit status 1), SIGTERM or SIGINT arrives (checked between steps; exit status
// 128 + the signal, runtime/stop_signal.h) or anything throws (bad data, non-finite loss: the reason in
// run_stop's metadata "error"). Time to train is run_start to run_stop, as MLPerf measures it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardstep/shardstep.h"
#include "runtime/batch_source.h"

namespace shardstep::mlperf {

// The command line every binary takes.
struct Flags {
  int replicas = 1;
  bool shard_weight_update = true;
  std::string backend = "cpu";
  uint64_t seed = 0;
  int seeds = 1;            // K runs with seeds seed, seed+1, ...
  std::string log;          // MLPerf log file ("" = none); with K > 1, run i writes <stem>_run<i><ext>
  std::string out_dir = ".";  // <name>_result.json and <name>_quality.svg go here ("" = none)
  int64_t max_steps = 0;    // step budget (0 = the recipe's)
  double target = 0;        // quality target (0 = the recipe's)
  double lr = 0;            // base learning rate (0 = the recipe's)
  int64_t eval_every = 0;   // steps between evaluations (0 = the recipe's)
  int64_t eval_batches = -1;  // text: evaluation batches (0 = the whole held-out split; -1 = the recipe's)
  std::string data;         // data directory (images) or text file ("" = the recipe's)
  bool smoke = false;       // a tiny model of the same recipe (tests: seconds, not minutes)
  bool update_timing = true;  // time the weight update alone, sharded and replicated, after the runs
  // --simulate (mlperf_simulate.h): predict the recipe's step time and time to train on a TPU pod slice.
  bool simulate = false;
  std::string mesh;              // XxY chips
  int64_t per_core_batch = 0;
  std::string hardware = "tpu-v3";  // a table name or a .toml path
  std::string precision = "bf16";   // of the simulated matrix units (TPUs train in bf16)
  std::string steps_from;        // a result JSON of a real run: its steps to the target ("" = the budget)
};

// A recipe's pieces for one run, built inside the init interval.
struct Setup {
  std::unique_ptr<dsl::Model> model;
  dsl::Program program;
  std::unique_ptr<runtime::BatchSource> train;
  std::unique_ptr<runtime::EvalSet> eval;
  int64_t batch = 0;           // global batch
  int64_t train_samples = 0;   // examples of the training split (MLPerf's train_samples)
  int64_t eval_samples = 0;    // examples evaluated each time
  std::string data_name;       // for the header line
};

struct Benchmark {
  std::string name;            // "mlperf_resnet"
  std::string mlperf_name;     // submission_benchmark: "resnet", "bert", "gpt3"
  std::string description;
  models::Task task = models::Task::kClassification;
  double target = 0;           // quality target of the task's metric
  bool lower_is_better = false;  // bits per character: lower is better
  int64_t max_steps = 0;       // step budget
  int64_t eval_every = 0;
  int64_t eval_batches = 0;    // text: the recipe's evaluation batches (0 = whole held-out split)
  ir::OptimizerConfig optimizer;  // with its schedule (logged as opt_* keys)
  // Builds the data, the model and the step program for `flags` and `seed` (the optimizer is
  // `optimizer` above, already adjusted to the budget).
  std::function<Setup(const Flags& flags, uint64_t seed, const ir::OptimizerConfig& optimizer)> setup;
  // The recipe's global batch for `flags` (--smoke changes it).
  std::function<int64_t(const Flags& flags)> batch;
  // The vocabulary of a text recipe's data (null for images): --simulate reads no more of the data.
  std::function<int64_t(const Flags& flags)> vocab;
  // The recipe's model on `m` at global batch `batch` (vocab: from the data; 0 for images): the loss.
  // setup builds its model with it; --simulate builds the pod's.
  std::function<dsl::Tensor(dsl::Model& m, const Flags& flags, int64_t batch, int64_t vocab)> define;
};

// Parses the flags (CLI11) and runs flags.seeds runs of `b`; prints the summary, writes the result
// file and the plot. Returns the exit status: 0 when every run reached the target.
int Main(const Benchmark& b, int argc, char** argv);

// The MLPerf result over K runs' times: the mean with the fastest and the slowest dropped when K >= 3
// (as MLPerf scores most benchmarks), else the plain mean.
double OlympicMean(std::vector<double> seconds);

}  // namespace shardstep::mlperf
