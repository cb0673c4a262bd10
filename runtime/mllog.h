// MlLog: the MLPerf training log. Every line is ":::MLLOG {json}" with "namespace", "time_ms" (wall
// clock, ms since the Unix epoch), "event_type" (INTERVAL_START, INTERVAL_END or POINT_IN_TIME), "key",
// "value" and "metadata" ("file" and "lineno" of the call, plus what the caller adds: epoch_num,
// samples_count, status...), as MLCommons' mlperf_logging package writes it, so that its compliance
// checker can read our runs. Each line is flushed as it is written: a crash loses no line.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace shardstep::runtime {

// The keys the MLCommons training rules use (names as the rules spell them).
namespace mllog {
inline constexpr const char* kSubmissionBenchmark = "submission_benchmark";
inline constexpr const char* kSubmissionOrg = "submission_org";
inline constexpr const char* kSubmissionDivision = "submission_division";
inline constexpr const char* kSubmissionStatus = "submission_status";
inline constexpr const char* kSubmissionPlatform = "submission_platform";
inline constexpr const char* kCacheClear = "cache_clear";
inline constexpr const char* kInitStart = "init_start";
inline constexpr const char* kInitStop = "init_stop";
inline constexpr const char* kRunStart = "run_start";
inline constexpr const char* kRunStop = "run_stop";
inline constexpr const char* kEpochStart = "epoch_start";
inline constexpr const char* kEpochStop = "epoch_stop";
inline constexpr const char* kBlockStart = "block_start";
inline constexpr const char* kBlockStop = "block_stop";
inline constexpr const char* kEvalStart = "eval_start";
inline constexpr const char* kEvalStop = "eval_stop";
inline constexpr const char* kEvalAccuracy = "eval_accuracy";
inline constexpr const char* kSeed = "seed";
inline constexpr const char* kGlobalBatchSize = "global_batch_size";
inline constexpr const char* kTrainSamples = "train_samples";
inline constexpr const char* kEvalSamples = "eval_samples";
inline constexpr const char* kGradientAccumulationSteps = "gradient_accumulation_steps";
inline constexpr const char* kOptName = "opt_name";
inline constexpr const char* kOptBaseLearningRate = "opt_base_learning_rate";
inline constexpr const char* kOptLearningRateWarmupEpochs = "opt_learning_rate_warmup_epochs";
inline constexpr const char* kOptLearningRateWarmupSteps = "opt_learning_rate_warmup_steps";
inline constexpr const char* kOptWeightDecay = "opt_weight_decay";
}  // namespace mllog

class MlLog {
 public:
  using Json = nlohmann::json;
  // Writes to `out` (not owned; it must outlive the log). `clock_ms` returns time_ms; by default the
  // system clock in ms since the epoch.
  explicit MlLog(std::ostream* out, std::function<int64_t()> clock_ms = {}, std::string name_space = "");
  ~MlLog();
  // Creates (truncates) the file at `path`; throws shardstep::Error naming it when it cannot.
  static std::unique_ptr<MlLog> OpenFile(const std::string& path);

  // POINT_IN_TIME, INTERVAL_START and INTERVAL_END lines. `metadata` must be a JSON object (or null);
  // "file" and "lineno" of the caller are added to it.
  // (file and line default to the caller's: __builtin_FILE/LINE, which GCC and clang 14 both have,
  // unlike std::source_location.)
  void Event(const std::string& key, const Json& value = nullptr, Json metadata = nullptr,
             const char* file = __builtin_FILE(), int line = __builtin_LINE());
  void Start(const std::string& key, const Json& value = nullptr, Json metadata = nullptr,
             const char* file = __builtin_FILE(), int line = __builtin_LINE());
  void End(const std::string& key, const Json& value = nullptr, Json metadata = nullptr,
           const char* file = __builtin_FILE(), int line = __builtin_LINE());

 private:
  void Write(const char* event_type, const std::string& key, const Json& value, Json metadata, const char* file,
             int line);

  std::unique_ptr<std::ostream> owned_;
  std::ostream* out_;
  std::function<int64_t()> clock_ms_;
  std::string namespace_;
};

}  // namespace shardstep::runtime
