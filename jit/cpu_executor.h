// The CPU backend's Executor: replicas as threads running the JIT-compiled step (jit/compiled_step.h).
#pragma once

#include <memory>
#include <vector>

#include "jit/compiled_step.h"
#include "runtime/executor.h"

namespace shardstep::jit {

struct CpuExecutorOptions {
  JitOptions jit;
  // What the replicas exchange through (runtime::ReplicatedExecutor); empty: in-process. The same
  // compiled step runs on any collectives (the tpu-mesh backend passes the emulated torus's).
  runtime::CollectivesFactory collectives;
  // In-process replicas share one copy of each replicated weight that the sharded weight update's
  // all-gather writes straight into (CompiledStep::GatheredVariableSlots): the replicas read the same
  // bytes, and the all-gather writes each byte once instead of once per replica. Same bits either way.
  // SHARDSTEP_JIT_SHARE_WEIGHTS=0 in the environment turns it off (to compare).
  bool share_weights = true;
  // And the products of such a weight that SmallGemm computes (a replica's few rows times the weight)
  // read one packed copy of it, packed once a step by the replicas together (jit/shared_weight_packs.h),
  // instead of each replica packing it itself. Same bits either way. SHARDSTEP_JIT_SHARE_PACKS=0 in the
  // environment turns it off (to compare).
  bool share_packs = true;
  // In-process replicas compute the weight gradients their reduce-scatter folds inside it: each its
  // row block of every replica's product (CompiledStep::PlanProductParts). Same bits either way.
  // SHARDSTEP_JIT_FOLD_PRODUCTS=0 in the environment turns it off (runtime::InProcessCollectives).
  bool fold_products = true;
  // The optimizer's loop writes each weight's bf16 rounding for the next step's products into a copy
  // this executor keeps per replica (JitOptions::bf16_weight_copies), instead of a loop rounding the
  // weight every step. Same bits either way (tests compare). SHARDSTEP_JIT_BF16_COPIES=0 in the
  // environment turns it off (to compare).
  bool bf16_weight_copies = true;
};

class CpuExecutor : public runtime::ReplicatedExecutor {
 public:
  CpuExecutor(const ir::Module& step, const runtime::TensorMap& logical_state, const CpuExecutorOptions& options = {});
  ~CpuExecutor() override;

  runtime::TensorMap Forward(const ir::Module& forward, const runtime::TensorMap& inputs) override;

  // How the training step was obtained (compiled, or from the disk / memory cache) and how long it took.
  const CompileInfo& compile_info() const { return step_->info(); }
  const CompiledStep& compiled() const { return *step_; }
  // The weights the replicas share (one copy for all; CpuExecutorOptions::share_weights): how many, and
  // their bytes (each replica but the first saves that much).
  int shared_weights() const { return static_cast<int>(shared_slots_.size()); }
  // The weight gradients their reduce-scatter computes (CompiledStep::PlanProductParts), when this
  // executor's collectives fold products (in-process replicas), else 0.
  int folded_products();
  int64_t shared_weight_bytes() const;
  // The products of a shared weight whose packed form the replicas also share (jit/shared_weight_packs.h;
  // SHARDSTEP_JIT_SHARE_PACKS=0 turns it off): how many, and the packed copies' bytes.
  int shared_packed_products() const;
  int64_t shared_packed_bytes() const;
  // The weights' bf16 copies each replica keeps (CpuExecutorOptions::bf16_weight_copies): their bytes.
  int64_t bf16_copy_bytes() const;

 protected:
  runtime::TensorMap RunReplica(int r, const runtime::TensorMap& global_inputs, runtime::TensorMap& state,
                                runtime::Collectives* c) override;
  // Overwrites the replica's output tensors in place (CompiledStep::Run into a kept map).
  void RunReplicaInto(int r, const runtime::TensorMap& global_inputs, runtime::TensorMap& state,
                      runtime::Collectives* c, runtime::TensorMap* outputs) override;
  // Binds the global batch's tensors to the step's input slots, once for all replicas.
  void BeginStep(const runtime::TensorMap& global_inputs) override;

 private:
  struct State;
  // Replica r's binding: its variables bound again only after LoadLogicalState, the inputs per step.
  jit::StepBinding& BindingFor(int r, runtime::TensorMap& state);
  void RunBound(int r, const jit::StepBinding& b, runtime::Collectives* c);
  std::unique_ptr<State> s_;
  std::vector<int> shared_slots_;  // variable slots bound to replica 0's tensor on every replica
  std::shared_ptr<const CompiledStep> step_;
  CpuExecutorOptions options_;
};

// The CPU JIT executor, with `step.num_replicas` replica threads exchanging through in-process
// collectives (as runtime::MakeInterpreterExecutor).
std::unique_ptr<runtime::Executor> MakeCpuExecutor(const ir::Module& step, const runtime::TensorMap& logical_state);

// One step of `m` as replica `replica` on the JIT, with runtime::RunStep's contract (conformance tests).
runtime::TensorMap JitRunStep(const ir::Module& m, runtime::TensorMap& variables, const runtime::TensorMap& inputs,
                              int replica = 0, runtime::Collectives* collectives = nullptr);

}  // namespace shardstep::jit
