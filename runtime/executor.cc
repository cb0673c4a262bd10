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

class InterpreterExecutor : public Executor {
 public:
  InterpreterExecutor(const ir::Module& step, const TensorMap& state)
      : step_(step), n_(step.num_replicas), collectives_(step.num_replicas), states_(n_) {
    KeepFreedMemory();
    LoadLogicalState(state);
  }

  TensorMap Step(const TensorMap& global_inputs) override {
    std::vector<TensorMap> outputs(n_);
    RunReplicas(n_, &collectives_, [&](int r) {
      TensorMap inputs;
      for (auto& [name, t] : global_inputs) inputs[name] = SliceBatch(t, n_, r);
      outputs[r] = RunStep(step_, states_[r], inputs, r, &collectives_);
    });
    TensorMap out = outputs[0];
    if (n_ > 1 && out.count("loss")) {
      double sum = 0;
      for (auto& o : outputs) sum += o.at("loss").f32[0];
      out["loss"].f32[0] = static_cast<float>(sum / n_);
    }
    return out;
  }

  TensorMap Forward(const ir::Module& forward, const TensorMap& inputs) override {
    TensorMap state = LogicalState();
    return RunStep(forward, state, inputs, 0, nullptr);
  }

  TensorMap LogicalState() const override { return LogicalStateFrom(step_, states_); }
  void LoadLogicalState(const TensorMap& state) override {
    for (int r = 0; r < n_; ++r) states_[r] = ReplicaState(step_, state, r);
  }
  double CommunicationSeconds() const override { return collectives_.busy_seconds(); }
  void SetPhaseTiming(bool on) override { collectives_.set_phase_timing(on); }

 private:
  ir::Module step_;
  int n_;
  InProcessCollectives collectives_;
  std::vector<TensorMap> states_;
};

}  // namespace

std::unique_ptr<Executor> MakeInterpreterExecutor(const ir::Module& step, const TensorMap& logical_state) {
  return std::make_unique<InterpreterExecutor>(step, logical_state);
}

}  // namespace shardstep::runtime
