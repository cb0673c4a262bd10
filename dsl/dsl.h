// The fluent C++ front end. A model is written once; it is lowered to IR at build() time for the
// per-replica batch (global batch / replicas), so the same user code serves any replica count.
//
//   dsl::Model m("mlp");
//   auto x = m.input("image", dsl::f32({batch, 784}));
//   auto y = m.input("label", dsl::s32({batch}));
//   auto logits = x.dense(512, "fc1").relu().dense(10, "fc2");
//   auto program = m.train(logits.cross_entropy(y).mean())
//                      .optimizer(dsl::Adam().lr(1e-3).clip_global_norm(1.0))
//                      .replicas(8)
//                      .build();   // the first DSL error is thrown here, with the user's source line
//
// Every method records its step and runs it at once on the global batch, so shapes are known
// eagerly (shape()), and errors are held until build(), which names the op, the shapes and the line.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "ir/module.h"
#include "ir/passes/optimizer_lowering.h"
#include "ir/passes/pipeline.h"

namespace shardstep::dsl {

inline ir::TensorType f32(ir::Shape s) { return {ir::DType::kF32, std::move(s)}; }
inline ir::TensorType s32(ir::Shape s) { return {ir::DType::kS32, std::move(s)}; }

using Loc = std::source_location;
class Model;

// A value in the model being written. Cheap to copy; methods return new values.
class Tensor {
 public:
  Tensor() = default;
  const ir::Shape& shape() const;  // at the global batch
  ir::DType dtype() const;
  int node() const { return node_; }

  // Layers (weights are created under `name`: name.w, name.b, ...).
  Tensor dense(int64_t units, const std::string& name, bool bias = true, Loc loc = Loc::current()) const;
  Tensor conv2d(int64_t filters, int64_t kernel, const std::string& name, int64_t stride = 1, int64_t padding = 0,
                Loc loc = Loc::current()) const;
  Tensor max_pool(int64_t window, int64_t stride = 0, Loc loc = Loc::current()) const;
  Tensor avg_pool(int64_t window, int64_t stride = 0, Loc loc = Loc::current()) const;
  Tensor layer_norm(const std::string& name, double eps = 1e-5, Loc loc = Loc::current()) const;
  Tensor embedding(int64_t vocab, int64_t dim, const std::string& name, Loc loc = Loc::current()) const;

  // Activations.
  Tensor relu(Loc loc = Loc::current()) const;
  Tensor gelu(Loc loc = Loc::current()) const;  // tanh approximation
  Tensor tanh(Loc loc = Loc::current()) const;
  Tensor sigmoid(Loc loc = Loc::current()) const;

  // Shapes: per-example shapes; the batch dimension is kept.
  Tensor flatten(Loc loc = Loc::current()) const;                              // [B, ...] -> [B, prod]
  Tensor reshape(const ir::Shape& per_example, Loc loc = Loc::current()) const;  // [B, ...] -> [B, per_example]

  // Losses and reductions.
  Tensor cross_entropy(const Tensor& labels, Loc loc = Loc::current()) const;  // logits [B,C], labels s32[B] -> [B]
  Tensor mean(Loc loc = Loc::current()) const;                                  // all elements -> scalar
  Tensor sum(Loc loc = Loc::current()) const;

  // Elementwise arithmetic (shapes must match, or one side a scalar).
  Tensor add(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor sub(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor mul(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor scale(double c, Loc loc = Loc::current()) const;

 private:
  friend class Model;
  Tensor(Model* m, int node) : m_(m), node_(node) {}
  Model* m_ = nullptr;
  int node_ = -1;
};

// Lowering context given to each recorded step.
struct Lowering {
  ir::Builder* b;
  int64_t batch_divisor;          // replicas: the per-replica batch is global / divisor
  std::vector<ir::ValueId> nodes;  // node -> value
  ir::ValueId operator[](const Tensor& t) const { return nodes[t.node()]; }
};

struct Program {
  ir::Module forward;  // inputs -> outputs ("loss" and any m.output), no state update
  ir::Module step;     // the whole training step: forward, backward, all-reduce, optimizer update
  ir::PipelineOptions options;
};

class TrainBuilder {
 public:
  TrainBuilder& optimizer(const ir::OptimizerConfig& c) { o_.optimizer = c; return *this; }
  TrainBuilder& replicas(int n) { o_.replicas = n; return *this; }
  // Data parallel within groups of this many replicas (0: one group of all).
  TrainBuilder& replica_group_size(int n) { o_.group_size = n; return *this; }
  TrainBuilder& shard_weight_update(bool on) { o_.shard_weight_update = on; return *this; }
  TrainBuilder& gather_weights_at_start(bool on) { o_.gather_at_start = on; return *this; }
  // A step with a NaN/inf loss or gradient changes no state and outputs "step_finite" = 0 (ir/passes/nonfinite_guard.h).
  TrainBuilder& nonfinite_guard(bool on) { o_.nonfinite_guard = on; return *this; }
  TrainBuilder& combine_thresholds(int64_t bytes, int64_t count) { o_.combine_bytes = bytes; o_.combine_count = count; return *this; }
  // All pipeline options at once (the CLI uses this).
  TrainBuilder& options(const ir::PipelineOptions& o) { o_ = o; return *this; }
  Program build(Loc loc = Loc::current());

 private:
  friend class Model;
  explicit TrainBuilder(Model* m) : m_(m) {}
  Model* m_;
  ir::PipelineOptions o_;
};

class Model {
 public:
  explicit Model(std::string name, uint64_t seed = 0);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  Tensor input(const std::string& name, ir::TensorType type, Loc loc = Loc::current());
  // A trainable weight with an initializer: init is "glorot_uniform", "he_normal", "zeros", ...
  Tensor weight(const std::string& name, ir::TensorType type, const std::string& init, ir::Attrs init_attrs = {},
                Loc loc = Loc::current());
  // Names a value the forward program returns (e.g. "logits").
  void output(const std::string& name, const Tensor& t, Loc loc = Loc::current());
  // Starts a training program minimising the scalar `loss`.
  TrainBuilder train(const Tensor& loss, Loc loc = Loc::current());

  // The forward module lowered for `replicas` replicas (per-replica batch). Throws the first error.
  ir::Module lower(int replicas = 1) const;
  const std::string& name() const { return name_; }

  // Records one step: `fn` builds IR for it. Runs it now on the global batch to check shapes.
  Tensor Record(const std::string& what, Loc loc, std::function<ir::ValueId(Lowering&)> fn);
  const ir::TensorType& type_of(const Tensor& t) const;
  uint64_t SeedFor(const std::string& weight_name) const;
  void CheckError() const;  // throws the first held error

 private:
  struct Step {
    std::string what;
    Loc loc;
    std::function<ir::ValueId(Lowering&)> fn;
  };
  std::string name_;
  uint64_t seed_;
  std::vector<Step> steps_;
  std::vector<std::pair<std::string, int>> outputs_;
  std::string first_error_;
  ir::Module eager_;  // the global-batch lowering, for shapes
  std::unique_ptr<Lowering> eager_lowering_;
  std::unique_ptr<ir::Builder> eager_builder_;
};

// Optimizer constructors, chained like the math: dsl::Adam().lr(1e-3).clip_global_norm(1.0).
inline ir::OptimizerConfig SGD() { return ir::OptimizerConfig().kind(ir::OptimizerKind::kSgd); }
inline ir::OptimizerConfig Momentum(double mu = 0.9) {
  return ir::OptimizerConfig().kind(ir::OptimizerKind::kMomentum).momentum(mu);
}
inline ir::OptimizerConfig Adam() { return ir::OptimizerConfig().kind(ir::OptimizerKind::kAdam); }
inline ir::OptimizerConfig AdamW() { return ir::OptimizerConfig().kind(ir::OptimizerKind::kAdamW).weight_decay(0.01); }
inline ir::OptimizerConfig Adagrad() { return ir::OptimizerConfig().kind(ir::OptimizerKind::kAdagrad); }
inline ir::OptimizerConfig Lamb() { return ir::OptimizerConfig().kind(ir::OptimizerKind::kLamb); }
inline ir::OptimizerConfig Lars() { return ir::OptimizerConfig().kind(ir::OptimizerKind::kLars).momentum(0.9); }

}  // namespace shardstep::dsl
