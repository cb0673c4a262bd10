// CollectiveCombiner: packs independent collectives of one kind into one, so many small tensors
// cost one collective latency (DESIGN §1 "Collective combining").
#pragma once

#include <cstdint>
#include <vector>

#include "ir/passes/pass.h"

namespace shardstep::ir {

class CollectiveCombiner : public Pass {
 public:
  // A combined collective moves at most `max_bytes` and combines at most `max_count` originals.
  CollectiveCombiner(int64_t max_bytes, int64_t max_count) : max_bytes_(max_bytes), max_count_(max_count) {}
  std::string name() const override { return "collective-combiner"; }
  bool Run(Module& m) override;

 private:
  std::vector<ValueId> FirstGroup(const Module& m) const;
  int64_t max_bytes_, max_count_;
};

}  // namespace shardstep::ir
