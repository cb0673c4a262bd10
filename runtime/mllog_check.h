// CheckMlLog: checks an MLPerf training log against the MLCommons training logging rules that apply
// to our runs (mlcommons/logging, compliance_checker/training_4.0.0: common.yaml and
// open_common.yaml; the same rules as code, not a copy of the checker):
//  - every line holding ":::MLLOG" is that prefix and one JSON object with "namespace", "time_ms",
//    "event_type" (INTERVAL_START | INTERVAL_END | POINT_IN_TIME), "key", "value" and a "metadata"
//    object carrying "file" and "lineno"; time_ms never decreases;
//  - exactly one submission_org, submission_platform (non-empty), submission_division (closed | open),
//    submission_status (cloud | onprem | preview | research), submission_benchmark (an MLPerf training
//    benchmark), init_stop, run_start, run_stop, train_samples, eval_samples, seed and
//    global_batch_size; at least one cache_clear, init_start and eval_accuracy; epoch_start/stop or
//    block_start/stop;
//  - order: init_start before init_stop before run_start before run_stop; blocks, epochs and evals
//    inside the run;
//  - intervals (x_start / x_stop) nest like parentheses and are all closed by run_stop, which is the
//    last line and carries metadata "status" success or aborted;
//  - metadata: epoch_* have epoch_num; block_start has epoch_count > 0 with first_epoch_num, or
//    step_num >= 0; eval_* and eval_accuracy have epoch_num or step_num.
#pragma once

#include <string>
#include <vector>

namespace shardstep::runtime {

// The problems found in `text` (the log's contents), each "line N: what"; empty when it complies.
std::vector<std::string> CheckMlLog(const std::string& text);

}  // namespace shardstep::runtime
