// The pass pipeline and the standard training pipeline.
#include "ir/passes/pipeline.h"

#include "ir/error.h"
#include "ir/passes/autodiff.h"
#include "ir/passes/collective_combiner.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/weight_update_sharder.h"
#include "ir/verifier.h"

namespace shardstep::ir {

PassPipeline& PassPipeline::Add(std::unique_ptr<Pass> pass) {
  passes_.push_back(std::move(pass));
  return *this;
}

std::vector<std::string> PassPipeline::Names() const {
  std::vector<std::string> names;
  for (auto& p : passes_) names.push_back(p->name());
  return names;
}

bool PassPipeline::Run(Module& m) {
  bool changed = false;
  Verify(m);
  for (auto& p : passes_) {
    if (disabled_.count(p->name())) continue;
    changed |= p->Run(m);
    try {
      Verify(m);
    } catch (const Error& e) {
      SS_CHECK(false, "pass ", p->name(), " produced an invalid module: ", e.what());
    }
    if (on_pass_) on_pass_(*p, m);
    if (p->name() == stop_after_) break;
  }
  return changed;
}

PassPipeline BuildTrainingPipeline(const PipelineOptions& o) {
  PassPipeline p;
  p.Add(std::make_unique<Autodiff>("loss"));
  p.Add(std::make_unique<DataParallelLowering>(o.group_size));
  p.Add(std::make_unique<OptimizerLowering>(o.optimizer));
  p.Add(std::make_unique<WeightUpdateSharder>(ShardingOptions{o.group_size, o.gather_at_start}));
  p.Add(std::make_unique<CollectiveCombiner>(o.combine_bytes, o.combine_count));
  if (!o.shard_weight_update) p.Disable("weight-update-sharder");
  return p;
}

}  // namespace shardstep::ir
