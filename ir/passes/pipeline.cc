// The pass pipeline and the standard training pipeline.
#include "ir/passes/pipeline.h"

#include "ir/error.h"
#include "ir/passes/autodiff.h"
#include "ir/passes/collective_combiner.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/elementwise_fuser.h"
#include "ir/passes/mixed_precision.h"
#include "ir/passes/nonfinite_guard.h"
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
      if (external_input_)
        throw Error(Str("pass ", p->name(), " cannot handle this module (it produced an invalid one: ", e.what(), ")"));
      SS_CHECK(false, "pass ", p->name(), " produced an invalid module: ", e.what());
    }
    if (on_pass_) on_pass_(*p, m);
    if (p->name() == stop_after_) break;
  }
  return changed;
}

namespace {

// The training pipeline's passes in order.
const char* const kTrainingPasses[] = {"autodiff", "mixed-precision", "data-parallel-lowering", "optimizer-lowering",
                                       "nonfinite-guard",
                                       "weight-update-sharder", "shard-order-reductions", "collective-combiner"};

// Whether the training pipeline built from `o` runs pass `n`.
bool RunsInTraining(const std::string& n, const PipelineOptions& o) {
  if (n == "weight-update-sharder") return o.shard_weight_update;
  if (n == "shard-order-reductions") return !o.shard_weight_update;  // the replicated update, in sharded order
  if (n == "nonfinite-guard") return o.nonfinite_guard;
  if (n == "mixed-precision") return o.bf16_contractions;
  return true;
}

}  // namespace

std::vector<std::string> KnownPassNames() {
  std::vector<std::string> names(std::begin(kTrainingPasses), std::end(kTrainingPasses));
  names.push_back("elementwise-fuser");
  return names;
}

std::unique_ptr<Pass> MakePass(const std::string& name, const PipelineOptions& o) {
  if (name == "autodiff") return std::make_unique<Autodiff>("loss");
  if (name == "data-parallel-lowering") return std::make_unique<DataParallelLowering>(o.group_size);
  if (name == "optimizer-lowering") return std::make_unique<OptimizerLowering>(o.optimizer);
  if (name == "nonfinite-guard") return std::make_unique<NonfiniteGuard>();
  if (name == "mixed-precision") return std::make_unique<MixedPrecision>();
  if (name == "weight-update-sharder")
    return std::make_unique<WeightUpdateSharder>(ShardingOptions{o.group_size, o.gather_at_start});
  if (name == "shard-order-reductions") return std::make_unique<ShardOrderReductions>(ShardingOptions{o.group_size});
  if (name == "collective-combiner") return std::make_unique<CollectiveCombiner>(o.combine_bytes, o.combine_count);
  if (name == "elementwise-fuser") return std::make_unique<ElementwiseFuser>();
  std::string known;
  for (const std::string& n : KnownPassNames()) known += (known.empty() ? "" : ", ") + n;
  throw Error(Str("unknown pass '", name, "' (known passes: ", known, "; 'all' is the training pipeline)"));
}

PassPipeline BuildPipeline(const std::vector<std::string>& names, const PipelineOptions& o) {
  PassPipeline p;
  for (const std::string& name : names) {
    if (name != "all") {
      p.Add(MakePass(name, o));
      continue;
    }
    for (const char* n : kTrainingPasses)
      if (RunsInTraining(n, o)) p.Add(MakePass(n, o));
  }
  return p;
}

PassPipeline BuildTrainingPipeline(const PipelineOptions& o) {
  PassPipeline p;
  for (const char* n : kTrainingPasses) p.Add(MakePass(n, o));
  if (!o.shard_weight_update) p.Disable("weight-update-sharder");
  else p.Disable("shard-order-reductions");
  if (!o.nonfinite_guard) p.Disable("nonfinite-guard");
  if (!o.bf16_contractions) p.Disable("mixed-precision");
  return p;
}

}  // namespace shardstep::ir
