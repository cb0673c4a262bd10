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
//
// Modes: a model is lowered twice. Program::step starts from the training-mode forward (dropout on,
// batch norm from batch statistics, model-state assignments such as running statistics);
// Program::forward is the evaluation-mode forward (no dropout, running statistics, no assignments).
// Operators broadcast numpy-style: `scores / 8.0 + mask` with scores [B,H,T,T] and mask [T,T].
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
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

// Options of cross_entropy (as torch's F.cross_entropy).
struct CrossEntropyOptions {
  double label_smoothing = 0.0;          // target = (1 - ls) one_hot + ls / C
  std::optional<int64_t> ignore_index;   // positions with this label get loss 0 and weight 0
};

// Options of batch_norm.
struct BatchNormOptions {
  double momentum = 0.1;       // running = (1 - momentum) running + momentum batch
  double eps = 1e-5;
  bool cross_replica = false;  // batch statistics over the replica group's batches (all-reduced)
  int group_size = 0;          // cross_replica: replicas per statistics group (0: the data-parallel group)
  BatchNormOptions& with_momentum(double v) { momentum = v; return *this; }
  BatchNormOptions& with_eps(double v) { eps = v; return *this; }
  BatchNormOptions& with_cross_replica(bool v = true) { cross_replica = v; return *this; }
  BatchNormOptions& with_group_size(int n) { group_size = n; return *this; }
};

// Options of a weight created by Model::weight.
struct WeightOptions {
  bool weight_decay = true;      // false: attr weight_decay=0, the optimizer applies no weight decay
  bool layer_adaptation = true;  // false: attr layer_adaptation=0, LARS/LAMB trust ratio fixed at 1
  static WeightOptions NoDecay() { return {false, false}; }  // biases and norm parameters
};

// A value in the model being written. Cheap to copy; methods return new values.
class Tensor {
 public:
  Tensor() = default;
  const ir::Shape& shape() const;  // at the global batch
  ir::DType dtype() const;
  int node() const { return node_; }
  bool defined() const { return m_ != nullptr; }
  Model* model() const { return m_; }

  // Layers (weights are created under `name`: name.w, name.b, ...). Biases get no weight decay.
  Tensor dense(int64_t units, const std::string& name, bool bias = true, Loc loc = Loc::current()) const;
  // NCHW input, OIHW weight `name.w` (he_normal); bias `name.b` when `bias`.
  Tensor conv2d(int64_t filters, int64_t kernel, const std::string& name, int64_t stride = 1, int64_t padding = 0,
                bool bias = true, Loc loc = Loc::current()) const;
  // stride 0 = window; padding on every side of H and W (padded cells never win).
  Tensor max_pool(int64_t window, int64_t stride = 0, int64_t padding = 0, Loc loc = Loc::current()) const;
  Tensor avg_pool(int64_t window, int64_t stride = 0, Loc loc = Loc::current()) const;
  Tensor global_avg_pool(Loc loc = Loc::current()) const;  // [B,C,H,W] -> [B,C]
  Tensor layer_norm(const std::string& name, double eps = 1e-5, Loc loc = Loc::current()) const;
  // Batch norm over axis 1 (NCHW or [B,C]); training mode: batch statistics and running-statistic
  // updates (name.running_mean / name.running_var, role model_state); evaluation: running statistics.
  Tensor batch_norm(const std::string& name, BatchNormOptions o = {}, Loc loc = Loc::current()) const;
  // Inverted dropout in training mode (contract "Dropout": random_uniform keyed by the model seed, the
  // site index, @step and the global example index); identity in evaluation.
  Tensor dropout(double p, Loc loc = Loc::current()) const;
  Tensor embedding(int64_t vocab, int64_t dim, const std::string& name, Loc loc = Loc::current()) const;

  // Activations.
  Tensor relu(Loc loc = Loc::current()) const;
  Tensor gelu(Loc loc = Loc::current()) const;  // tanh approximation
  Tensor tanh(Loc loc = Loc::current()) const;
  Tensor sigmoid(Loc loc = Loc::current()) const;
  Tensor exp(Loc loc = Loc::current()) const;
  Tensor log(Loc loc = Loc::current()) const;
  Tensor sqrt(Loc loc = Loc::current()) const;
  Tensor rsqrt(Loc loc = Loc::current()) const;
  // The same values; no gradient flows back through it (torch's detach).
  Tensor stop_gradient(Loc loc = Loc::current()) const;
  Tensor softmax(int64_t axis = -1, Loc loc = Loc::current()) const;      // max-subtracted
  Tensor log_softmax(int64_t axis = -1, Loc loc = Loc::current()) const;  // x - max - log sum exp(x - max)

  // Shapes. flatten/reshape keep the batch dimension; reshape_full takes the whole (global) shape
  // whose dim 0 is the batch and is divided by the replica count like the inputs.
  Tensor flatten(Loc loc = Loc::current()) const;                              // [B, ...] -> [B, prod]
  Tensor reshape(const ir::Shape& per_example, Loc loc = Loc::current()) const;  // [B, ...] -> [B, per_example]
  Tensor reshape_full(const ir::Shape& global_shape, Loc loc = Loc::current()) const;
  // A batched tensor (one computed from inputs) keeps its batch dimension first.
  Tensor transpose(const ir::IntList& perm, Loc loc = Loc::current()) const;
  // [start, limit) along `axis`; not the batch axis of a batched tensor (a weight's axis 0 is fine).
  Tensor slice(int64_t axis, int64_t start, int64_t limit, Loc loc = Loc::current()) const;
  // Matrix product over the last two dims (rank >= 2, equal batch dims), or x [..., k] @ w [k, n].
  Tensor matmul(const Tensor& o, bool transpose_a = false, bool transpose_b = false, Loc loc = Loc::current()) const;
  Tensor cast(ir::DType to, Loc loc = Loc::current()) const;

  // Losses and reductions.
  // logits [..., C], s32 labels [...] -> per-position losses [...] (0 at ignored positions).
  Tensor cross_entropy(const Tensor& labels, Loc loc = Loc::current()) const;
  Tensor cross_entropy(const Tensor& labels, const CrossEntropyOptions& o, Loc loc = Loc::current()) const;
  // The mean cross-entropy torch computes (mean over non-ignored positions, or weighted by the f32
  // per-position `weights` when given), equal to the global-batch value for any replica count.
  Tensor cross_entropy_mean(const Tensor& labels, const CrossEntropyOptions& o = {}, Loc loc = Loc::current()) const;
  Tensor cross_entropy_mean(const Tensor& labels, const CrossEntropyOptions& o, const Tensor& weights,
                            Loc loc = Loc::current()) const;
  // sum(x * w) / sum(w) over the global batch: the denominator is all-reduced over the replicas, so
  // the value (and the gradient) equal the global-batch weighted mean whatever the replica count.
  Tensor weighted_mean(const Tensor& weights, Loc loc = Loc::current()) const;
  Tensor mean(Loc loc = Loc::current()) const;                                  // all elements -> scalar
  Tensor sum(Loc loc = Loc::current()) const;
  Tensor mean(const ir::IntList& axes, Loc loc = Loc::current()) const;  // negative axes count from the end
  Tensor sum(const ir::IntList& axes, Loc loc = Loc::current()) const;
  Tensor max(const ir::IntList& axes, Loc loc = Loc::current()) const;

  // Elementwise arithmetic with numpy-style trailing broadcasting ([B,H,T,T] + [T,T]).
  Tensor add(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor sub(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor mul(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor div(const Tensor& o, Loc loc = Loc::current()) const;
  Tensor scale(double c, Loc loc = Loc::current()) const;
  Tensor add_scalar(double c, Loc loc = Loc::current()) const;
  Tensor rdiv_scalar(double c, Loc loc = Loc::current()) const;  // c / x
  Tensor neg(Loc loc = Loc::current()) const;

 private:
  friend class Model;
  Tensor(Model* m, int node) : m_(m), node_(node) {}
  Model* m_ = nullptr;
  int node_ = -1;
};

// Operators. An operand converts to one of these at the user's expression, which records its source
// line (operators cannot take a defaulted location parameter themselves).
struct Operand {
  Operand(const Tensor& t, Loc loc = Loc::current()) : t(t), loc(loc) {}  // NOLINT: implicit on purpose
  Tensor t;
  Loc loc;
};
struct ScalarOperand {
  ScalarOperand(double v, Loc loc = Loc::current()) : v(v), loc(loc) {}  // NOLINT: implicit on purpose
  double v;
  Loc loc;
};
Tensor operator+(const Tensor& a, const Operand& b);
Tensor operator-(const Tensor& a, const Operand& b);
Tensor operator*(const Tensor& a, const Operand& b);
Tensor operator/(const Tensor& a, const Operand& b);
Tensor operator+(const Tensor& a, ScalarOperand c);
Tensor operator-(const Tensor& a, ScalarOperand c);
Tensor operator*(const Tensor& a, ScalarOperand c);
Tensor operator/(const Tensor& a, ScalarOperand c);
Tensor operator+(ScalarOperand c, const Tensor& a);
Tensor operator-(ScalarOperand c, const Tensor& a);
Tensor operator*(ScalarOperand c, const Tensor& a);
Tensor operator/(ScalarOperand c, const Tensor& a);
Tensor operator-(const Operand& a);

// Joins tensors along `axis` (negative counts from the end); not the batch axis of batched tensors.
Tensor concat(const std::vector<Tensor>& parts, int64_t axis, Loc loc = Loc::current());
// Scaled dot-product attention as one op: per leading index of q, k, v (one shape [..., T, D]),
// softmax(scale q k^T, masked above the diagonal when causal) v. The same values as the decomposed
// form (matmul, scale, additive mask, softmax, matmul); the JIT runs it blockwise without the T x T
// scores in memory, and its gradient is one op (the probabilities recomputed).
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal,
                 Loc loc = Loc::current());

// The shape numpy broadcasting gives two shapes (trailing alignment, 1 stretches); throws when incompatible.
ir::Shape BroadcastShapes(const ir::Shape& a, const ir::Shape& b);

// Lowering context given to each recorded step.
enum class Mode { kEval, kTrain };

struct Lowering {
  ir::Builder* b;
  int64_t batch_divisor;          // replicas: the per-replica batch is global / divisor
  std::vector<ir::ValueId> nodes;  // node -> value
  Mode mode = Mode::kTrain;
  int group_size = 0;             // replica group size of the data parallelism (0: all replicas)
  bool training() const { return mode == Mode::kTrain; }
  int replicas() const { return static_cast<int>(batch_divisor); }
  ir::IntLists groups() const;    // replica groups, as the collectives' attribute (empty = all)
  int64_t group_replicas() const { return group_size > 0 ? group_size : batch_divisor; }
  ir::ValueId operator[](const Tensor& t) const { return nodes[t.node()]; }
};

struct Program {
  // Evaluation mode: inputs -> outputs ("loss" and any m.output); no dropout, batch norm from running
  // statistics, no state update.
  ir::Module forward;
  // The whole training step in training mode: forward (with model-state assignments), backward,
  // all-reduce, optimizer update.
  ir::Module step;
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
  // "bf16": matmul and convolution operands rounded to bf16, f32 accumulation (ir/passes/mixed_precision.h);
  // "f32" (default): none. Any other value is an error at build().
  TrainBuilder& precision(const std::string& p) { precision_ = p; return *this; }
  // All pipeline options at once (the CLI uses this).
  TrainBuilder& options(const ir::PipelineOptions& o) { o_ = o; return *this; }
  Program build(Loc loc = Loc::current());

 private:
  friend class Model;
  explicit TrainBuilder(Model* m) : m_(m) {}
  Model* m_;
  ir::PipelineOptions o_;
  std::string precision_;  // empty: keep o_.bf16_contractions
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
  Tensor weight(const std::string& name, ir::TensorType type, const std::string& init, ir::Attrs init_attrs,
                WeightOptions wo, Loc loc = Loc::current());
  // Non-trainable state (role model_state; e.g. running statistics): no gradient, no optimizer, never
  // sharded. Change it with assign().
  Tensor state(const std::string& name, ir::TensorType type, const std::string& init, ir::Attrs init_attrs = {},
               Loc loc = Loc::current());
  // In training mode, the step assigns `value` to the state variable `state` (evaluation: nothing).
  void assign(const Tensor& state, const Tensor& value, Loc loc = Loc::current());
  // A scalar constant.
  Tensor constant(double value, ir::DType dtype = ir::DType::kF32, Loc loc = Loc::current());
  // Names a value the forward program returns (e.g. "logits").
  void output(const std::string& name, const Tensor& t, Loc loc = Loc::current());
  // Starts a training program minimising the scalar `loss`.
  TrainBuilder train(const Tensor& loss, Loc loc = Loc::current());

  // The forward module lowered for `replicas` replicas (per-replica batch) in evaluation mode, or in
  // training mode (model-state assignments, dropout) as the training step starts from. Throws the
  // first error.
  ir::Module lower(int replicas = 1, Mode mode = Mode::kEval, int group_size = 0) const;
  uint64_t seed() const { return seed_; }
  // The index of the next dropout site (contract: seed = (model_seed << 16) + site).
  int64_t NextDropoutSite() { return dropout_sites_++; }
  const std::string& name() const { return name_; }

  // Records one step: `fn` builds IR for it. Runs it now on the global batch to check shapes.
  Tensor Record(const std::string& what, Loc loc, std::function<ir::ValueId(Lowering&)> fn);
  const ir::TensorType& type_of(const Tensor& t) const;
  // Whether `t` depends on an input (so its dim 0 is the batch, divided among the replicas).
  bool batched(const Tensor& t) const;
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
  int64_t dropout_sites_ = 0;
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
