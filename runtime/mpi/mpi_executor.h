// MpiExecutor: the CPU backend's Executor for one rank of a run over K ranks x T replica threads
// (HybridCollectives; global replica id = rank * T + t). It gives the bits of the in-process executor
// with K*T replicas: the same JIT'd step, the same chunk of the global batch per replica (read in place),
// the same collectives' folds, the loss averaged over all K*T replicas in replica order.
// Every rank must make the same calls in the same order: Step, LogicalState (an all-gather of the
// shards; cached until the state changes), Forward (which uses the logical state) are collective.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "ir/module.h"
#include "runtime/executor.h"
#include "runtime/mpi/hybrid_collectives.h"

namespace shardstep::jit {
class CompiledStep;
struct StepBinding;
struct Workspace;
}  // namespace shardstep::jit

namespace shardstep::runtime {

class MpiExecutor final : public Executor {
 public:
  // `step` lowered for c.num_replicas() replicas; `logical_state` the same on every rank.
  MpiExecutor(const ir::Module& step, const TensorMap& logical_state, HybridCollectives& c);
  ~MpiExecutor() override;

  using Executor::LoadLogicalState;
  using Executor::Step;
  TensorMap Step(const TensorMap& global_inputs) override;
  TensorMap Forward(const ir::Module& forward, const TensorMap& inputs) override;
  TensorMap LogicalState() const override;
  void LoadLogicalState(const TensorMap& state) override;
  int64_t steps_run() const { return steps_; }

 private:
  ir::Module step_;
  HybridCollectives& c_;
  const int per_rank_, first_, n_;
  std::shared_ptr<const jit::CompiledStep> compiled_;
  std::vector<jit::Workspace> workspaces_;
  std::vector<TensorMap> states_;  // per local replica
  // Per local replica: its state's variables bound to the step's slots at each LoadLogicalState, the
  // global batch's inputs bound once per step (jit::StepBinding).
  std::vector<jit::StepBinding> bindings_;
  std::unique_ptr<ReplicaPool> pool_;
  std::map<std::string, std::shared_ptr<const jit::CompiledStep>> forwards_;
  std::unique_ptr<jit::Workspace> forward_ws_;
  mutable std::unique_ptr<TensorMap> logical_;  // cached LogicalState, reset when the state changes
  int64_t steps_ = 0;
  bool copies_made_ = false;  // the replicas' weight copies hold the weights' bf16 roundings (none after a throw)
};

// A 64-bit FNV-1a hash of the printed module (ir::Print): ranks compare it at start to catch mismatched
// builds or flags.
uint64_t StepModuleHash(const ir::Module& step);

// Every rank calls this with its hash; throws the same clear error on every rank when they differ.
void CheckSameStepModule(uint64_t hash, const char* what);

}  // namespace shardstep::runtime
