// Session: the public C++ API for training a model written with the DSL (include "shardstep/shardstep.h").
//
//   dsl::Model m("mlp", /*seed=*/1);
//   auto x = m.input("image", dsl::f32({64, 2}));
//   auto y = m.input("label", dsl::s32({64}));
//   auto logits = x.dense(32, "fc1").relu().dense(3, "fc2");
//   m.output("logits", logits);
//   auto program = m.train(logits.cross_entropy_mean(y)).optimizer(dsl::Adam().lr(1e-2)).replicas(2).build();
//   shardstep::Session s(m, program, "cpu");
//   TensorMap out = s.Step(batch);                 // out["loss"], out["logits"] for the whole batch
//   TensorMap p = s.Predict({{"image", images}});  // no labels needed
//
// The Session owns the backend's executor and the state; the caller always sees the global batch and
// the logical (unsharded) state, whatever the replica count. Misuse (a missing or unknown input, a
// wrong shape or dtype, an unknown output or backend) throws shardstep::Error naming it.
// runtime::Train (runtime/trainer.h) runs the training loop (progress, metrics, evaluation, checkpoints)
// on a Session: that is how `shardstep train` trains; bench/step measures its steps through one too.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "runtime/executor.h"
#include "runtime/interpreter.h"
#include "runtime/tensor.h"
#include "runtime/trainer.h"

namespace shardstep {

using runtime::Tensor;
using runtime::TensorMap;

// Backends by name: "cpu" (the LLVM JIT, jit/), "interp" (the reference interpreter, runtime/) and "tpu-mesh"
// (the emulated TPU 2D torus, tpu_backend/mesh_backend.h).
using BackendFactory =
    std::function<std::unique_ptr<runtime::Executor>(const ir::Module& step, const TensorMap& logical_state)>;
// Adds (or replaces) a backend.
void RegisterBackend(const std::string& name, BackendFactory factory);
// The known backend names, sorted.
std::vector<std::string> BackendNames();
// The factory for `name`; throws shardstep::Error listing the known backends.
BackendFactory FindBackend(const std::string& name);

// Session is a runtime::Trainable: runtime::Train (runtime/trainer.h) runs the training loop on it.
class Session : public runtime::Trainable {
 public:
  // `model` is only read here (it lowers the evaluation program at the global batch); it need not
  // outlive the Session. The state starts from the variables' initialisers (the model's seed).
  Session(const dsl::Model& model, const dsl::Program& program, const std::string& backend = "cpu");
  // From modules already lowered: `step`, the training step after the passes (any replica count, e.g.
  // dsl::Program::step or a module read from an IR file), and `forward`, the evaluation-mode forward on
  // one replica over the step's logical variables, at any batch (the evaluation batch); without it,
  // Evaluate and Predict throw. The state starts from the variables' init attributes.
  Session(const ir::Module& step, std::optional<ir::Module> forward, const std::string& backend = "cpu");
  ~Session() override;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // One training step on the global batch (every input of the program). Outputs that depend on the
  // batch and have its dimension 0 (the per-replica batch) are returned for the whole global batch
  // (the replicas' rows in order); f32 scalars that depend on the batch (the loss) are averaged over
  // the replicas; anything else (replica-independent values, per-replica reductions) is replica 0's.
  TensorMap Step(const TensorMap& global_batch);
  // The evaluation-mode forward program (no dropout, batch norm from running statistics, no state
  // change): "loss" and the model's outputs, for any number of examples (dim 0, the same for every
  // input). At the forward's batch B it is one run. Otherwise the examples run in chunks of B, the last
  // zero-padded: per-example outputs hold every example's rows, other outputs are the first chunk's,
  // and "loss" is the mean over the examples: a full chunk weighs B, the padded one its r real rows,
  // its loss with the pad rows' share (measured on a chunk of zero rows) taken out. That is exact for a
  // loss that is a mean over examples (or over their positions); for a mean weighted by an input that
  // is zero on the pad rows (masked LM's mask_weights), whose all-zero chunk has no defined loss, the
  // padded chunk's loss is used as it is and weighs r.
  TensorMap Evaluate(const TensorMap& batch);
  // The requested outputs of the evaluation-mode forward, fed only the inputs they depend on (e.g.
  // "image" but not "label" for "logits"). Inputs the forward program has but these outputs do not
  // need are ignored; names the program does not have are an error. Any number of examples (dim 0,
  // the same for every input): they run in chunks of the program's batch, the last one zero-padded.
  TensorMap Predict(const TensorMap& inputs, const std::vector<std::string>& outputs = {"logits"});

  // The logical state (every variable unsharded), as a checkpoint holds it.
  TensorMap State() const;
  // Checkpoints the logical state (safetensors, runtime/checkpoint.h) with the step counter; a
  // checkpoint loads into a Session of the same model with any replica count.
  void Save(const std::string& path) const;
  void Load(const std::string& path);
  // Replaces the state by `state` (logical, every variable with its type; else an Error naming the
  // differences) and sets the step counter, e.g. from a checkpoint read and checked elsewhere.
  void LoadState(const TensorMap& state, int64_t step = 0);

  // Training steps taken (restored by Load).
  int64_t step() const { return step_; }
  int num_replicas() const { return step_module_.num_replicas; }
  const std::string& backend() const { return backend_; }
  // The names of the training step's inputs and of the forward program's outputs.
  std::vector<std::string> InputNames() const;
  std::vector<std::string> OutputNames() const;
  const ir::Module& step_module() const { return step_module_; }
  bool has_forward() const { return has_forward_; }
  const ir::Module& forward_module() const;  // throws without one

  // Wall seconds the replicas spent exchanging data in collectives so far (0 for one replica), and
  // phase timing (runtime::Executor::SetPhaseTiming: step time = communication + computation exactly).
  double CommunicationSeconds() const override;
  void SetPhaseTiming(bool on);
  // The backend's executor, for what the Session does not wrap (e.g. jit::CpuExecutor::compile_info()
  // through a dynamic_cast). Calling it bypasses the Session's checks and step counter.
  runtime::Executor& executor() { return *exec_; }

  // runtime::Trainable, for runtime::Train: Step with the executor's outputs (replica 0's, the loss
  // averaged; no global-batch assembly), Evaluate, State. Inputs the modules do not read (a data
  // source's extras) are ignored here, not an error.
  TensorMap TrainStep(const TensorMap& global_batch) override;
  TensorMap EvaluateBatch(const TensorMap& batch) override { return Evaluate(batch, /*extra_ok=*/true); }
  TensorMap LogicalState() const override { return State(); }

 private:
  void Init(const std::string& backend);
  // Throws unless `batch` holds exactly what `m` reads (shapes scaled by `batch_scale` on dim 0, or
  // with dim 0 = `examples` when >= 0); inputs of `allow_extra` that `m` does not read (any, with
  // `extra_ok`) are tolerated.
  void CheckInputs(const ir::Module& m, int64_t batch_scale, const TensorMap& batch, const char* what,
                   const ir::Module* allow_extra = nullptr, int64_t examples = -1, bool extra_ok = false) const;
  TensorMap Evaluate(const TensorMap& batch, bool extra_ok);
  const ir::Module& PredictModule(const std::vector<std::string>& outputs);
  // `m` (one replica, batch `batch`) on `n` examples in chunks of `batch`, the last zero-padded; the
  // per-example outputs concatenated, the others the first chunk's. `losses`: each chunk's "loss".
  TensorMap RunChunks(const ir::Module& m, int64_t batch, const TensorMap& inputs, int64_t n,
                      std::vector<float>* losses);

  std::string backend_;
  ir::Module step_module_;
  ir::Module forward_;  // evaluation mode, one replica (at the global batch when built from a dsl::Model)
  bool has_forward_ = false;
  std::vector<char> per_replica_;  // of step_module_'s values: depends on the batch
  std::unique_ptr<runtime::Executor> exec_;
  std::map<std::string, ir::Module> predict_;  // by the requested outputs joined with ','
  int64_t step_ = 0;
};

}  // namespace shardstep
