// Flags shared by the `shardstep` commands: the model and training-program flags, their translation
// into pipeline options and DSL programs, and validators whose messages are short and name the value.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include <map>

#include "dsl/dsl.h"
#include "models/models.h"
#include "ir/module.h"
#include "ir/passes/pipeline.h"

namespace shardstep::cli {

// Validators: "--steps: must be a positive integer, got -3" instead of CLI11's range of doubles.
extern const CLI::Validator kPositiveInt;
extern const CLI::Validator kNonNegativeInt;
extern const CLI::Validator kPositiveFloat;
extern const CLI::Validator kNonNegativeFloat;

// Flags that choose the model and its training program (shared by train and compile).
struct ProgramFlags {
  std::string model = "mlp";
  std::vector<int64_t> hidden = {1024, 1024};
  int64_t batch = 64;
  int replicas = 1;
  uint64_t seed = 0;
  std::string optimizer = "adam";
  double lr = 1e-3;
  double momentum = 0.9;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = -1;  // -1: the optimizer's default
  double weight_decay = 0;
  double clip_norm = 0;
  std::string schedule = "constant";
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;
  double end_lr_factor = 0;
  double power = 1.0;
  double trust_coefficient = 0.001;
  double initial_accumulator = 0.0;
  std::string replica_groups;          // "AxB": A groups of B replicas each
  std::string shard_weight_update = "auto";
  std::string gather_weights = "end";
  int64_t combine_bytes = 4 << 20, combine_count = 64;
  std::string on_nonfinite = "stop";   // stop|skip|ignore (stop and skip add the nonfinite-guard pass)
  std::string precision = "f32";       // f32|bf16 (bf16 adds the mixed-precision pass: issue 10)
  // Model options (models::ModelOptions; 0 / "" = the model's default).
  int64_t context = 0, layers = 0, width = 0, heads = 0, mlp_width = 0, image_size = 0;
  int64_t classes = 0;  // 0: 1000 for models whose default data is synthetic-imagenet, else 10
  int64_t vocab = 0;  // --vocab (masked LM word vocabulary); train sets it from the data for text models
  double dropout = 0, label_smoothing = 0;
  std::string size;
  bool cross_replica_bn = false;
};

// The model options the flags set (for `batch` examples per global batch).
models::ModelOptions ModelOptionsFromFlags(const ProgramFlags& f, int64_t batch);
// "--context 256 --layers 4" for the model options that are not at their defaults, as flag -> value
// (identifying a run for --resume).
std::map<std::string, std::string> ModelOptionFlags(const ProgramFlags& f);

// The flags that choose the model (--model, --hidden, --batch, --replicas, --seed and the model options
// --context --layers --width --heads --mlp-width --dropout --size --label-smoothing --cross-replica-bn
// --image-size --vocab), returned so a command can exclude them (compile --ir reads the model from its file).
std::vector<CLI::Option*> AddModelFlags(CLI::App* app, ProgramFlags* f);
// The optimizer, schedule and pass flags.
void AddPipelineFlags(CLI::App* app, ProgramFlags* f);

// Pipeline options from the flags; `steps` is the decay horizon when --decay-steps is not given.
// `replicas` overrides --replicas (compile --ir takes it from the module).
ir::PipelineOptions PipelineFromFlags(const ProgramFlags& f, int64_t steps, int replicas = 0);

// Text models without --vocab: sets f->vocab to the vocabulary of the default corpus (the King James
// Bible), so `compile` builds them as `train` would. No-op for image models or when --vocab is given, and
// for bert --size base/large (their published vocabulary of 30522, so the report gives the published counts).
void ResolveTextVocab(ProgramFlags* f);

// The model's training program (the whole pipeline run), and its forward module for evaluation at `batch`.
dsl::Program BuildProgram(const ProgramFlags& f, int64_t steps);
ir::Module BuildForward(const ProgramFlags& f, int64_t batch);
// The model's step module before any pass, lowered for f.replicas replicas.
ir::Module BuildModule(const ProgramFlags& f);

// The edit distance with neighbour swaps (for "did you mean" suggestions).
int EditDistance(const std::string& a, const std::string& b);
// The closest of `candidates` to `word` when it is close enough to be a likely typo, else "".
std::string ClosestMatch(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace shardstep::cli
