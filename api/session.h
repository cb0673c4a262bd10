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
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsl/dsl.h"
#include "ir/error.h"
#include "runtime/executor.h"
#include "runtime/interpreter.h"
#include "runtime/tensor.h"

namespace shardstep {

using runtime::Tensor;
using runtime::TensorMap;

// Backends by name: "cpu" (the LLVM JIT, jit/) and "interp" (the reference interpreter, runtime/).
using BackendFactory =
    std::function<std::unique_ptr<runtime::Executor>(const ir::Module& step, const TensorMap& logical_state)>;
// Adds (or replaces) a backend.
void RegisterBackend(const std::string& name, BackendFactory factory);
// The known backend names, sorted.
std::vector<std::string> BackendNames();
// The factory for `name`; throws shardstep::Error listing the known backends.
BackendFactory FindBackend(const std::string& name);

class Session {
 public:
  // `model` is only read here (it lowers the evaluation program at the global batch); it need not
  // outlive the Session. The state starts from the variables' initialisers (the model's seed).
  Session(const dsl::Model& model, const dsl::Program& program, const std::string& backend = "cpu");
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // One training step on the global batch (every input of the program). Outputs that depend on the
  // batch and have its dimension 0 (the per-replica batch) are returned for the whole global batch
  // (the replicas' rows in order); f32 scalars that depend on the batch (the loss) are averaged over
  // the replicas; anything else (replica-independent values, per-replica reductions) is replica 0's.
  TensorMap Step(const TensorMap& global_batch);
  // The evaluation-mode forward program (no dropout, batch norm from running statistics, no state
  // change) on a global batch of the same shapes: "loss" and the model's outputs.
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

  // Training steps taken (restored by Load).
  int64_t step() const { return step_; }
  int num_replicas() const { return program_.step.num_replicas; }
  const std::string& backend() const { return backend_; }
  // The names of the training step's inputs and of the forward program's outputs.
  std::vector<std::string> InputNames() const;
  std::vector<std::string> OutputNames() const;

 private:
  // Throws unless `batch` holds exactly what `m` reads (shapes scaled by `batch_scale` on dim 0, or
  // with dim 0 = `examples` when >= 0); inputs of `allow_extra` that `m` does not read are tolerated.
  void CheckInputs(const ir::Module& m, int64_t batch_scale, const TensorMap& batch, const char* what,
                   const ir::Module* allow_extra = nullptr, int64_t examples = -1) const;
  const ir::Module& PredictModule(const std::vector<std::string>& outputs);

  std::string backend_;
  dsl::Program program_;
  ir::Module forward_;  // evaluation mode at the global batch (one replica)
  std::vector<char> per_replica_;  // of program_.step's values: depends on the batch
  std::unique_ptr<runtime::Executor> exec_;
  std::map<std::string, ir::Module> predict_;  // by the requested outputs joined with ','
  int64_t step_ = 0;
};

}  // namespace shardstep
