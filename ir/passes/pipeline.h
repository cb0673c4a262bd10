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
  // Called after each pass that ran, with its name and the module.
  PassPipeline& OnPass(std::function<void(const Pass&, const Module&)> f) { on_pass_ = std::move(f); return *this; }
  std::vector<std::string> Names() const;
  // Returns true when any pass changed the module.
  bool Run(Module& m);

 private:
  std::vector<std::unique_ptr<Pass>> passes_;
  std::set<std::string> disabled_;
  std::string stop_after_;
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
};

// autodiff -> data-parallel-lowering -> optimizer-lowering -> weight-update-sharder -> collective-combiner
PassPipeline BuildTrainingPipeline(const PipelineOptions& options);

}  // namespace shardstep::ir
