// The interpreter executor: replicas as threads, the batch split along dimension 0.
#include "runtime/executor.h"

#include <malloc.h>

#include <cstring>

#include "ir/error.h"
#include "runtime/inprocess_collectives.h"
#include "runtime/replica_runner.h"
#include "runtime/sharding.h"

namespace shardstep::runtime {

Tensor SliceBatch(const Tensor& t, int parts, int i) {
  if (parts == 1) return t;
  if (t.shape().empty() || t.shape()[0] % parts != 0)
    throw Error(Str("batch ", t.type.ToString(), " cannot be split across ", parts, " replicas"));
  ir::Shape s = t.shape();
  s[0] /= parts;
  Tensor out(ir::TensorType{t.dtype(), s});
  const int64_t n = out.elements();
  std::memcpy(out.raw(), static_cast<const char*>(t.raw()) + i * n * ir::DTypeBytes(t.dtype()), n * ir::DTypeBytes(t.dtype()));
  return out;
}

namespace {

// Steps allocate and free the same large buffers every time; keep them in the heap instead of
// returning them to the kernel, so a step does not page-fault its way through fresh memory.
void KeepFreedMemory() {
  static const bool once = [] {
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, -1);
    return true;
  }();
  (void)once;
}

class InterpreterExecutor : public ReplicatedExecutor {
 public:
  InterpreterExecutor(const ir::Module& step, const TensorMap& state) : ReplicatedExecutor(step), step_(step) {
    LoadLogicalState(state);
  }

  TensorMap Forward(const ir::Module& forward, const TensorMap& inputs) override {
    TensorMap state = LogicalState();
    return RunStep(forward, state, inputs, 0, nullptr);
  }

 protected:
  TensorMap RunReplica(int r, const TensorMap& global_inputs, TensorMap& state, Collectives* c) override {
    if (num_replicas() == 1) return RunStep(step_, state, global_inputs, r, c);
    TensorMap inputs;
    for (auto& [name, t] : global_inputs) inputs[name] = SliceBatch(t, num_replicas(), r);
    return RunStep(step_, state, inputs, r, c);
  }

 private:
  ir::Module step_;
};

}  // namespace

CollectivesFactory InProcessCollectivesFactory() {
  return [](int n) -> std::unique_ptr<Collectives> { return std::make_unique<InProcessCollectives>(n); };
}

ReplicatedExecutor::ReplicatedExecutor(const ir::Module& layout, const CollectivesFactory& make_collectives)
    : layout_(layout),
      n_(layout.num_replicas),
      collectives_((make_collectives ? make_collectives : InProcessCollectivesFactory())(layout.num_replicas)),
      states_(n_),
      outputs_(n_),
      body_([this](int r) { RunReplicaInto(r, *step_inputs_, states_[r], collectives_.get(), &outputs_[r]); }) {
  if (!collectives_ || collectives_->num_replicas() != n_)
    throw Error(Str("the backend's collectives serve ", collectives_ ? collectives_->num_replicas() : 0,
                    " replicas; the step module \"", layout.name, "\" has ", n_));
  KeepFreedMemory();
}

double ReplicatedExecutor::CommunicationSeconds() const {
  auto* in_process = dynamic_cast<const InProcessCollectives*>(collectives_.get());
  return in_process ? in_process->busy_seconds() : 0;
}

void ReplicatedExecutor::SetPhaseTiming(bool on) {
  if (auto* in_process = dynamic_cast<InProcessCollectives*>(collectives_.get())) in_process->set_phase_timing(on);
}

void ReplicatedExecutor::RunAll(const TensorMap& global_inputs) {
  if (!pool_) pool_ = std::make_unique<ReplicaPool>(n_);
  step_inputs_ = &global_inputs;
  pool_->Run(collectives_.get(), body_);
  step_inputs_ = nullptr;
}

std::vector<TensorMap> ReplicatedExecutor::StepReplicas(const TensorMap& global_inputs) {
  BeginStep(global_inputs);
  if (n_ == 1) return {RunReplica(0, global_inputs, states_[0], nullptr)};  // no thread hop
  RunAll(global_inputs);
  return outputs_;  // copies: the caller's
}

TensorMap ReplicatedExecutor::Step(const TensorMap& global_inputs) {
  BeginStep(global_inputs);
  if (n_ == 1) return RunReplica(0, global_inputs, states_[0], nullptr);  // no thread hop
  RunAll(global_inputs);
  TensorMap out = outputs_[0];  // the one copy a step makes: the caller's outputs
  if (out.count("loss")) {
    double sum = 0;
    for (int r = 0; r < n_; ++r) sum += outputs_[r].at("loss").f32[0];
    out["loss"].f32[0] = static_cast<float>(sum / n_);
  }
  return out;
}

TensorMap ReplicatedExecutor::LogicalState() const { return LogicalStateFrom(layout_, states_); }

void ReplicatedExecutor::LoadLogicalState(const TensorMap& state) {
  for (int r = 0; r < n_; ++r) states_[r] = ReplicaState(layout_, state, r);
  ++state_generation_;
}

XtensorMap Executor::Step(const XtensorMap& inputs, const XtensorS32Map& s32_inputs) {
  return ToXtensor(Step(FromXtensor(inputs, s32_inputs)));
}

XtensorMap Executor::LogicalStateXt() const { return ToXtensor(LogicalState()); }

void Executor::LoadLogicalState(const XtensorMap& state) { LoadLogicalState(FromXtensor(state, LogicalState())); }

std::unique_ptr<Executor> MakeInterpreterExecutor(const ir::Module& step, const TensorMap& logical_state) {
  return std::make_unique<InterpreterExecutor>(step, logical_state);
}

}  // namespace shardstep::runtime
