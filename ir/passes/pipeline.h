// PassPipeline: runs passes in order, verifying the module before and after each one; can dump the
// IR after any pass and disable passes by name.
#pragma once

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ir/passes/optimizer_lowering.h"
#include "ir/passes/pass.h"

namespace shardstep::ir {

class PassPipeline {
 public:
  PassPipeline& Add(std::unique_ptr<Pass> pass);
  PassPipeline& Disable(const std::string& name) { disabled_.insert(name); return *this; }
  // Stops after the pass with this name (the module is left as that pass produced it).
  PassPipeline& StopAfter(const std::string& name) { stop_after_ = name; return *this; }
  // The module comes from outside (IR text): a pass that turns the verified input into an invalid
  // module throws shardstep::Error naming the pass and the broken invariant, instead of aborting as
  // for a module the DSL built (the pass should have rejected an input it cannot handle; a bug to fix,
  // but the user's run ends with a message, not a crash).
  PassPipeline& ExternalInput(bool on = true) { external_input_ = on; return *this; }
  // Called after each pass that ran, with its name and the module.
  PassPipeline& OnPass(std::function<void(const Pass&, const Module&)> f) { on_pass_ = std::move(f); return *this; }
  std::vector<std::string> Names() const;
  // Returns true when any pass changed the module.
  bool Run(Module& m);

 private:
  std::vector<std::unique_ptr<Pass>> passes_;
  std::set<std::string> disabled_;
  std::string stop_after_;
  bool external_input_ = false;
  std::function<void(const Pass&, const Module&)> on_pass_;
};

// Options of the training pipeline that the CLI and the DSL expose.
struct PipelineOptions {
  OptimizerConfig optimizer;
  int replicas = 1;
  int group_size = 0;              // replicas per data-parallel group (0: all)
  bool shard_weight_update = true; // only matters when the group has more than one replica
  bool gather_at_start = false;    // all-gather placement: end of step (default) or start of the next
  int64_t combine_bytes = 4 << 20; // collective combining thresholds (0 bytes: no combining)
  int64_t combine_count = 64;
  // nonfinite-guard after optimizer-lowering: a step with a non-finite loss or gradient changes no
  // state and outputs "step_finite" = 0 (the CLI's --on-nonfinite stop|skip turn it on; ignore leaves
  // it off).
  bool nonfinite_guard = false;
  // --precision bf16: mixed-precision after autodiff rounds the operands of matmuls and convolutions
  // to bf16 (f32 accumulation; ir/passes/mixed_precision.h). Off (f32) by default.
  bool bf16_contractions = false;
};

// autodiff -> [mixed-precision] -> data-parallel-lowering -> optimizer-lowering -> [nonfinite-guard]
// -> weight-update-sharder (sharded)
// or shard-order-reductions (not sharded: the update's norms in the sharded order, so both give the same bits)
// -> collective-combiner
PassPipeline BuildTrainingPipeline(const PipelineOptions& options);

// Every pass that can be run by name: the training pipeline's, in its order, then elementwise-fuser.
std::vector<std::string> KnownPassNames();
// The pass called `name`, configured from `options` (the optimizer for optimizer-lowering, the group
// size for data-parallel-lowering and weight-update-sharder, ...). Throws shardstep::Error
// "unknown pass 'x' (known passes: autodiff, ...)" for any other name.
std::unique_ptr<Pass> MakePass(const std::string& name, const PipelineOptions& options);
// A pipeline of the passes `names`, in that order; "all" stands for the training pipeline's passes
// (BuildTrainingPipeline: weight-update-sharder only when options.shard_weight_update, shard-order-reductions
// only when not, nonfinite-guard only when options.nonfinite_guard,
// mixed-precision only when options.bf16_contractions). A name given twice runs twice. Throws as
// MakePass for an unknown name.
PassPipeline BuildPipeline(const std::vector<std::string>& names, const PipelineOptions& options);

}  // namespace shardstep::ir
