// DataParallelLowering.
//
// Algorithm: for each recorded gradient g (from autodiff) that is not already all-reduced, add
// ar = all_reduce(g){reduction="mean", groups} and point the module's gradient entry at ar; the
// optimizer lowering that runs next reads the gradient entries. (Uses of g inside the backward
// pass are left alone: a cotangent can be both a weight's gradient and an intermediate.)
// The DSL already lowered the inputs to the per-replica batch and the loss is a per-replica mean,
// so the mean of the replicas' gradients is the gradient of the global-batch loss.
#include "ir/passes/data_parallel_lowering.h"

#include "ir/builder.h"
#include "ir/error.h"

namespace shardstep::ir {

IntLists ContiguousGroups(int num_replicas, int group_size) {
  if (group_size <= 0 || group_size == num_replicas) return {};
  if (num_replicas % group_size != 0)
    throw Error(Str("replica group size ", group_size, " does not divide ", num_replicas, " replicas"));
  IntLists groups;
  for (int g = 0; g < num_replicas / group_size; ++g) {
    groups.emplace_back();
    for (int i = 0; i < group_size; ++i) groups.back().push_back(g * group_size + i);
  }
  return groups;
}

bool DataParallelLowering::Run(Module& m) {
  if (m.num_replicas == 1) return false;
  IntLists groups = ContiguousGroups(m.num_replicas, group_size_);
  Builder b(&m);
  bool changed = false;
  for (auto& entry : m.gradients) {
    ValueId g = entry.second;
    if (m.at(g).op == OpCode::kAllReduce) continue;  // already lowered
    Attrs attrs{{"reduction", std::string("mean")}};
    if (!groups.empty()) attrs["groups"] = groups;
    entry.second = b.Emit(OpCode::kAllReduce, {g}, attrs);
    changed = true;
  }
  if (changed) m.Canonicalize();
  return changed;
}

}  // namespace shardstep::ir
