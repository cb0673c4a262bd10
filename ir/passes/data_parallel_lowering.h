// DataParallelLowering: every replica computes gradients on its slice of the batch; insert a mean
// all-reduce of each gradient (within each replica group) so every replica sees the global gradient.
#pragma once

#include "ir/passes/pass.h"

namespace shardstep::ir {

// Replica groups as contiguous blocks of `group_size` (0: one group of all replicas), in the form
// the collectives' "groups" attribute takes (empty = all).
IntLists ContiguousGroups(int num_replicas, int group_size);

class DataParallelLowering : public Pass {
 public:
  explicit DataParallelLowering(int group_size = 0) : group_size_(group_size) {}
  std::string name() const override { return "data-parallel-lowering"; }
  bool Run(Module& m) override;

 private:
  int group_size_;
};

}  // namespace shardstep::ir
