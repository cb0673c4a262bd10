// Executor: runs a compiled training step for all replicas of one process and owns the state.
// The caller sees the global batch and the logical (unsharded) variables; how replicas split the
// batch and shard the state is the executor's business.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ir/module.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/interpreter.h"
#include "runtime/replica_runner.h"
#include "runtime/xtensor_io.h"

namespace shardstep::runtime {

class Executor {
 public:
  virtual ~Executor() = default;
  // One training step on the global batch. Returns replica 0's outputs, with the scalar "loss"
  // averaged over replicas.
  virtual TensorMap Step(const TensorMap& global_inputs) = 0;
  // The same step, returning every replica's outputs unchanged (index = replica id), for callers that
  // want the whole global batch of a batched output (api/session.h). Default: one replica, Step's.
  virtual std::vector<TensorMap> StepReplicas(const TensorMap& global_inputs) { return {Step(global_inputs)}; }
  // Runs a forward-only module (no assigns) with the current weights on one replica.
  virtual TensorMap Forward(const ir::Module& forward, const TensorMap& inputs) = 0;
  // The logical state: every variable unsharded and unpadded, as a checkpoint stores it.
  virtual TensorMap LogicalState() const = 0;
  virtual void LoadLogicalState(const TensorMap& state) = 0;
  // Wall seconds spent exchanging data in collectives since construction (from a collective's last
  // arrival to its last exit, so waiting for a slower replica is not counted); 0 for one replica.
  // Step time minus its increase is the step's computation.
  virtual double CommunicationSeconds() const { return 0; }
  // Replicas leave every collective together, so communication and computation do not overlap and
  // step time = communication + computation exactly (for benchmarks; one more rendezvous each).
  virtual void SetPhaseTiming(bool on) {}

  // The same calls with xtensor containers (runtime/xtensor_io.h), built on the ones above: a step
  // on f32 and s32 input arrays (e.g. images and labels) returning the outputs; the logical state as
  // float arrays (the s32 step counter converted exactly), and loaded back with the current dtypes.
  XtensorMap Step(const XtensorMap& inputs, const XtensorS32Map& s32_inputs = {});
  XtensorMap LogicalStateXt() const;
  void LoadLogicalState(const XtensorMap& state);
};

// The collectives a backend's replicas exchange through, made for `num_replicas` replicas (a backend picks
// them: in-process threads for "cpu" and "interp", the emulated torus for "tpu-mesh").
using CollectivesFactory = std::function<std::unique_ptr<Collectives>(int num_replicas)>;
// InProcessCollectives, the default.
CollectivesFactory InProcessCollectivesFactory();

// What every in-process backend shares: one thread per replica (none for a single replica; started at
// the first step and parked between steps), the
// collectives it is given (in-process by default), each replica's state shard, the loss averaged over replicas, and the
// conversion between the logical state and the shards. A backend supplies one replica's step.
class ReplicatedExecutor : public Executor {
 public:
  using Executor::LoadLogicalState;  // the xtensor overloads
  using Executor::Step;
  TensorMap Step(const TensorMap& global_inputs) final;
  std::vector<TensorMap> StepReplicas(const TensorMap& global_inputs) final;
  TensorMap LogicalState() const final;
  void LoadLogicalState(const TensorMap& state) final;
  // The InProcessCollectives' timing; 0 and nothing for other collectives.
  double CommunicationSeconds() const final;
  void SetPhaseTiming(bool on) final;

 protected:
  // `layout`: the step module whose variables (sharded or not) the replicas hold.
  // `make_collectives` (default: in-process) is called once, for layout.num_replicas replicas.
  explicit ReplicatedExecutor(const ir::Module& layout, const CollectivesFactory& make_collectives = {});
  // Replica r's part of one step: its chunk of `global_inputs` along dimension 0, its `state`;
  // `c` is null for a single replica.
  virtual TensorMap RunReplica(int r, const TensorMap& global_inputs, TensorMap& state, Collectives* c) = 0;
  // The same, writing the outputs into `outputs`, replica r's map kept from step to step (with N > 1).
  // Default: RunReplica's. A backend that overwrites the tensors in place makes the step allocate
  // nothing but the outputs Step returns.
  virtual void RunReplicaInto(int r, const TensorMap& global_inputs, TensorMap& state, Collectives* c,
                              TensorMap* outputs) {
    *outputs = RunReplica(r, global_inputs, state, c);
  }
  int num_replicas() const { return n_; }
  Collectives& collectives() { return *collectives_; }
  // Called once per step before any replica runs (on the caller's thread): a backend binds the global
  // batch's tensors here once instead of each replica looking them up by name.
  virtual void BeginStep(const TensorMap& global_inputs) {}
  // Counts LoadLogicalState calls: the replicas' state maps are new after each, so a backend that keeps
  // pointers into them (jit::StepBinding) binds again when this changes.
  uint64_t state_generation() const { return state_generation_; }
  // Replica r's own state (its shards, and the whole of every variable it holds whole), read in place:
  // an evaluation reads the weights from here instead of copying the logical state per batch.
  TensorMap& replica_state(int r) { return states_[r]; }

 private:
  ir::Module layout_;
  int n_;
  std::unique_ptr<Collectives> collectives_;
  std::vector<TensorMap> states_;
  uint64_t state_generation_ = 0;
  // With N > 1: each replica's outputs of the last step (reused), and the body the pool runs, made
  // once (it captures only `this`, so running it allocates nothing); step_inputs_ is the current batch.
  void RunAll(const TensorMap& global_inputs);
  std::vector<TensorMap> outputs_;
  const TensorMap* step_inputs_ = nullptr;
  std::function<void(int)> body_;
  std::unique_ptr<ReplicaPool> pool_;  // last: its threads stop before the rest goes
};

// The reference interpreter, with `step.num_replicas` replica threads exchanging through
// in-process collectives.
std::unique_ptr<Executor> MakeInterpreterExecutor(const ir::Module& step, const TensorMap& logical_state);

// Splits dim 0 of `t` into `parts` equal chunks and returns chunk `i`.
Tensor SliceBatch(const Tensor& t, int parts, int i);

}  // namespace shardstep::runtime
