// WeightUpdateSharder: automatic cross-replica sharding of the weight update (Xu et al. 2020,
// arXiv 2004.13336; DESIGN §1). Turns "all-reduce the gradient, every replica updates the whole
// tensor" into "reduce-scatter, update 1/N, all-gather", with optimizer state kept as 1/N shards.
#pragma once

#include <string>
#include <vector>

#include "ir/passes/pass.h"
#include "ir/shard_format.h"

namespace shardstep::ir {

struct ShardingOptions {
  // Replicas per group. 0: each update chain is sharded within the replica groups of its own
  // gradient all-reduces (all replicas where it has none); > 0: every gradient all-reduce must use
  // groups of this size (else Run throws); 1: no sharding.
  int group_size = 0;
  bool gather_at_start = false;  // keep weights sharded too; all-gather them at the start of the next step
};

struct VariableShardingRow {
  std::string name;
  std::string role;
  bool sharded = false;   // stored as a 1/N shard across steps
  std::string why;        // why (not)
  std::string format;     // "dim0", "flat" or "-"
  int64_t padding = 0;    // padded elements
  int64_t bytes_before = 0, bytes_after = 0;  // per replica
};

struct ShardingReport {
  int group_size = 1;  // of the first update chain's groups (each row's `why` names its own when they differ)
  std::vector<VariableShardingRow> variables;
  std::vector<std::string> fallbacks;  // update ops that could not be partitioned
  // Each full reduction of the update (norms) and how it was partitioned; not in ToString's table.
  std::vector<std::string> reductions;
  std::string ToString() const;        // the table `shardstep compile --report` prints
};

class WeightUpdateSharder : public Pass {
 public:
  explicit WeightUpdateSharder(ShardingOptions o = {}) : o_(o) {}
  std::string name() const override { return "weight-update-sharder"; }
  bool Run(Module& m) override;
  const ShardingReport& report() const { return report_; }

 private:
  ShardingOptions o_;
  ShardingReport report_;
};

// ShardOrderReductions: the replicated counterpart of the sharder's reductions, so that turning sharding on or off
// changes no bits (DESIGN §5). When the weight update is NOT sharded but its gradients are all-reduced over groups of
// g > 1 replicas, every full reduction the sharder would partition (LAMB/LARS norms, global-norm clipping) is computed
// in the sharded program's order: the operand laid out as ShardFormat lays it out (dim-0 rows, or flattened and
// zero-padded), each of the g shards reduced on its own with the sharded program's op and shard shape, and the g
// scalars folded in replica order as the all-reduce of the partials folds them (f32 ((p0 + p1) + p2) + ..., or max).
// No communication: every replica computes all g partials; the shard copies cost one extra pass over each reduced
// tensor. Nothing else changes. It changes nothing in a module the sharder refuses or leaves alone; the training
// pipeline runs one or the other.
class ShardOrderReductions : public Pass {
 public:
  explicit ShardOrderReductions(ShardingOptions o = {}) : o_(o) {}
  std::string name() const override { return "shard-order-reductions"; }
  bool Run(Module& m) override;
  // The rewritten reductions, as ShardingReport::reductions names them.
  const std::vector<std::string>& reductions() const { return reductions_; }

 private:
  ShardingOptions o_;
  std::vector<std::string> reductions_;
};

}  // namespace shardstep::ir
