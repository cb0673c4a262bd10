// Flags shared by the `shardstep` commands: the model and training-program flags, their translation
// into pipeline options and DSL programs, and validators whose messages are short and name the value.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "dsl/dsl.h"
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
};

// The flags that choose the model (--model, --hidden, --batch, --replicas, --seed), returned so a
// command can exclude them (compile --ir reads the model from its file).
std::vector<CLI::Option*> AddModelFlags(CLI::App* app, ProgramFlags* f);
// The optimizer, schedule and pass flags.
void AddPipelineFlags(CLI::App* app, ProgramFlags* f);

// Pipeline options from the flags; `steps` is the decay horizon when --decay-steps is not given.
// `replicas` overrides --replicas (compile --ir takes it from the module).
ir::PipelineOptions PipelineFromFlags(const ProgramFlags& f, int64_t steps, int replicas = 0);

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
