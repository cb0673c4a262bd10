// The fluent front end: records each step, checks it eagerly, lowers it to IR at build().
#include "dsl/dsl.h"

#include <cmath>
#include <filesystem>

#include "ir/error.h"
#include "ir/passes/pipeline.h"

namespace shardstep::dsl {

using ir::Attrs;
using ir::Builder;
using ir::DType;
using ir::IntList;
using ir::OpCode;
using ir::Shape;
using ir::ValueId;

namespace {

std::string Where(const Loc& loc) {
  return Str(std::filesystem::path(loc.file_name()).filename().string(), ":", loc.line());
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Broadcasts `v` ([n] over the last dim) to `shape`.
ValueId BroadcastLast(Builder& b, ValueId v, const Shape& shape) {
  return b.Broadcast(v, shape, {static_cast<int64_t>(shape.size()) - 1});
}

// x [..., k] @ w [k, n] for any leading dims (flattened to 2-D around the matmul).
ValueId DenseMatmul(Builder& b, ValueId x, ValueId w) {
  Shape xs = b.shape(x);
  if (xs.size() < 2) throw Error(Str("dense needs an input of rank >= 2, got ", b.type(x).ToString()));
  Shape ws = b.shape(w);
  if (xs.back() != ws[0])
    throw Error(Str("input ", b.type(x).ToString(), " has ", xs.back(), " features but the weight ",
                    b.type(w).ToString(), " expects ", ws[0]));
  int64_t rows = ir::NumElements(xs) / xs.back();
  ValueId y = b.Matmul(b.Reshape(x, {rows, xs.back()}), w);
  Shape ys = xs;
  ys.back() = ws[1];
  return b.Reshape(y, ys);
}

}  // namespace

// ---- Model ----

Model::Model(std::string name, uint64_t seed) : name_(std::move(name)), seed_(seed) {
  eager_.name = name_;
  eager_builder_ = std::make_unique<Builder>(&eager_);
  eager_lowering_ = std::make_unique<Lowering>(Lowering{eager_builder_.get(), 1, {}});
}

Model::~Model() = default;

Tensor Model::Record(const std::string& what, Loc loc, std::function<ValueId(Lowering&)> fn) {
  int node = static_cast<int>(steps_.size());
  steps_.push_back({what, loc, fn});
  ValueId v = ir::kNoValue;
  if (first_error_.empty()) {
    try {
      v = fn(*eager_lowering_);
    } catch (const Error& e) {
      first_error_ = Str(Where(loc), ": error: ", what, ": ", e.what());
    }
  }
  eager_lowering_->nodes.push_back(v);
  return Tensor(this, node);
}

const ir::TensorType& Model::type_of(const Tensor& t) const {
  static const ir::TensorType kPoisoned{DType::kF32, {}};
  ValueId v = eager_lowering_->nodes.at(t.node());
  return v == ir::kNoValue ? kPoisoned : eager_.type(v);
}

uint64_t Model::SeedFor(const std::string& weight_name) const { return Fnv1a(weight_name) ^ (seed_ * 0x9E3779B97F4A7C15ull); }

void Model::CheckError() const {
  if (!first_error_.empty()) throw Error(first_error_);
}

Tensor Model::input(const std::string& name, ir::TensorType type, Loc loc) {
  return Record(Str("input '", name, "'"), loc, [name, type](Lowering& L) {
    ir::TensorType t = type;
    if (L.batch_divisor > 1) {
      if (t.shape.empty() || t.shape[0] % L.batch_divisor != 0)
        throw Error(Str("batch dimension of ", type.ToString(), " is not divisible by ", L.batch_divisor,
                        " replicas"));
      t.shape[0] /= L.batch_divisor;
    }
    return L.b->Input(name, t);
  });
}

Tensor Model::weight(const std::string& name, ir::TensorType type, const std::string& init, Attrs init_attrs, Loc loc) {
  init_attrs["init"] = init;
  init_attrs["seed"] = static_cast<int64_t>(SeedFor(name) & 0x7FFFFFFFFFFFFFFFull);
  return Record(Str("weight '", name, "'"), loc, [name, type, init_attrs](Lowering& L) {
    return L.b->Variable(name, type, ir::kRoleWeight, init_attrs);
  });
}

void Model::output(const std::string& name, const Tensor& t, Loc loc) {
  for (auto& [n, node] : outputs_)
    if (n == name && first_error_.empty()) first_error_ = Str(Where(loc), ": error: output '", name, "' defined twice");
  outputs_.push_back({name, t.node()});
}

TrainBuilder Model::train(const Tensor& loss, Loc loc) {
  if (first_error_.empty() && !(type_of(loss).shape.empty() && type_of(loss).dtype == DType::kF32))
    first_error_ = Str(Where(loc), ": error: train: the loss must be an f32 scalar, got ", type_of(loss).ToString(),
                       " (take .mean())");
  output("loss", loss, loc);
  return TrainBuilder(this);
}

ir::Module Model::lower(int replicas) const {
  CheckError();
  if (replicas < 1) throw Error(Str("replicas must be >= 1, got ", replicas));
  ir::Module m;
  m.name = name_;
  m.num_replicas = replicas;
  Builder b(&m);
  Lowering L{&b, replicas, {}};
  for (const Step& s : steps_) {
    try {
      L.nodes.push_back(s.fn(L));
    } catch (const Error& e) {
      throw Error(Str(Where(s.loc), ": error: ", s.what, ": ", e.what()));
    }
  }
  for (auto& [name, node] : outputs_) m.outputs.push_back({name, L.nodes[node]});
  return m;
}

// ---- TrainBuilder ----

Program TrainBuilder::build(Loc loc) {
  Program p;
  p.options = o_;
  p.forward = m_->lower(o_.replicas);
  p.step = p.forward;
  ir::BuildTrainingPipeline(o_).Run(p.step);
  return p;
}

// ---- Tensor ----

const Shape& Tensor::shape() const { return m_->type_of(*this).shape; }
ir::DType Tensor::dtype() const { return m_->type_of(*this).dtype; }

Tensor Tensor::dense(int64_t units, const std::string& name, bool bias, Loc loc) const {
  int64_t in = shape().empty() ? 0 : shape().back();
  Tensor w = m_->weight(name + ".w", f32({in, units}), "glorot_uniform", {{"fan_in", in}, {"fan_out", units}}, loc);
  Tensor b = bias ? m_->weight(name + ".b", f32({units}), "zeros", {}, loc) : Tensor();
  Tensor x = *this;
  return m_->Record(Str("dense '", name, "'"), loc, [x, w, b, bias](Lowering& L) {
    ValueId y = DenseMatmul(*L.b, L[x], L[w]);
    if (bias) y = L.b->Add(y, BroadcastLast(*L.b, L[b], L.b->shape(y)));
    return y;
  });
}

Tensor Tensor::conv2d(int64_t filters, int64_t kernel, const std::string& name, int64_t stride, int64_t padding,
                      Loc loc) const {
  int64_t in_ch = shape().size() == 4 ? shape()[1] : 0;
  int64_t fan_in = in_ch * kernel * kernel;
  Tensor w = m_->weight(name + ".w", f32({filters, in_ch, kernel, kernel}), "he_normal", {{"fan_in", fan_in}}, loc);
  Tensor b = m_->weight(name + ".b", f32({filters}), "zeros", {}, loc);
  Tensor x = *this;
  return m_->Record(Str("conv2d '", name, "'"), loc, [x, w, b, stride, padding](Lowering& L) {
    if (L.b->type(L[x]).rank() != 4)
      throw Error(Str("input must be NCHW (rank 4), got ", L.b->type(L[x]).ToString()));
    ValueId y = L.b->Emit(OpCode::kConv2d, {L[x], L[w]},
                          {{"stride", IntList{stride, stride}}, {"padding", IntList{padding, padding}}});
    return L.b->Add(y, L.b->Broadcast(L[b], L.b->shape(y), {1}));
  });
}

static Tensor Pool(const Tensor& x, Model* m, OpCode op, int64_t window, int64_t stride, Loc loc) {
  if (stride == 0) stride = window;
  return m->Record(Str(ir::OpName(op), " ", window, "x", window), loc, [x, op, window, stride](Lowering& L) {
    return L.b->Emit(op, {L[x]}, {{"window", IntList{window, window}}, {"stride", IntList{stride, stride}}});
  });
}
Tensor Tensor::max_pool(int64_t window, int64_t stride, Loc loc) const { return Pool(*this, m_, OpCode::kMaxPool, window, stride, loc); }
Tensor Tensor::avg_pool(int64_t window, int64_t stride, Loc loc) const { return Pool(*this, m_, OpCode::kAvgPool, window, stride, loc); }

Tensor Tensor::layer_norm(const std::string& name, double eps, Loc loc) const {
  int64_t d = shape().empty() ? 0 : shape().back();
  Tensor gamma = m_->weight(name + ".gamma", f32({d}), "ones", {}, loc);
  Tensor beta = m_->weight(name + ".beta", f32({d}), "zeros", {}, loc);
  Tensor x = *this;
  return m_->Record(Str("layer_norm '", name, "'"), loc, [x, gamma, beta, eps](Lowering& L) {
    Builder& b = *L.b;
    ValueId v = L[x];
    Shape s = b.shape(v);
    if (s.empty()) throw Error("layer_norm needs rank >= 1");
    IntList last{static_cast<int64_t>(s.size()) - 1};
    IntList keep = ir::AllAxes(s.size() - 1);
    ValueId mean = b.Broadcast(b.ReduceMean(v, last), s, keep);
    ValueId centered = b.Sub(v, mean);
    ValueId var = b.Broadcast(b.ReduceMean(b.Mul(centered, centered), last), s, keep);
    ValueId norm = b.Mul(centered, b.Unary(OpCode::kRsqrt, b.AddScalar(var, eps)));
    return b.Add(b.Mul(norm, BroadcastLast(b, L[gamma], s)), BroadcastLast(b, L[beta], s));
  });
}

Tensor Tensor::embedding(int64_t vocab, int64_t dim, const std::string& name, Loc loc) const {
  Tensor table = m_->weight(name + ".table", f32({vocab, dim}), "normal", {{"stddev", 1.0}}, loc);
  Tensor ids = *this;
  return m_->Record(Str("embedding '", name, "'"), loc, [ids, table](Lowering& L) {
    return L.b->Emit(OpCode::kGather, {L[table], L[ids]});
  });
}

static Tensor UnaryStep(const Tensor& x, Model* m, OpCode op, Loc loc) {
  return m->Record(ir::OpName(op), loc, [x, op](Lowering& L) { return L.b->Unary(op, L[x]); });
}
Tensor Tensor::relu(Loc loc) const { return UnaryStep(*this, m_, OpCode::kRelu, loc); }
Tensor Tensor::tanh(Loc loc) const { return UnaryStep(*this, m_, OpCode::kTanh, loc); }
Tensor Tensor::sigmoid(Loc loc) const { return UnaryStep(*this, m_, OpCode::kSigmoid, loc); }

Tensor Tensor::gelu(Loc loc) const {
  Tensor x = *this;
  return m_->Record("gelu", loc, [x](Lowering& L) {
    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    Builder& b = *L.b;
    ValueId v = L[x];
    ValueId cube = b.Mul(b.Mul(v, v), v);
    ValueId inner = b.MulScalar(b.Add(v, b.MulScalar(cube, 0.044715)), std::sqrt(2.0 / M_PI));
    return b.Mul(b.MulScalar(v, 0.5), b.AddScalar(b.Unary(OpCode::kTanh, inner), 1.0));
  });
}

Tensor Tensor::flatten(Loc loc) const {
  Tensor x = *this;
  return m_->Record("flatten", loc, [x](Lowering& L) {
    Shape s = L.b->shape(L[x]);
    if (s.empty()) throw Error("flatten needs a batch dimension");
    return L.b->Reshape(L[x], {s[0], ir::NumElements(s) / std::max<int64_t>(s[0], 1)});
  });
}

Tensor Tensor::reshape(const Shape& per_example, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str("reshape to [B]+", ir::ShapeToString(per_example)), loc, [x, per_example](Lowering& L) {
    Shape s = L.b->shape(L[x]);
    if (s.empty()) throw Error("reshape needs a batch dimension");
    Shape out{s[0]};
    out.insert(out.end(), per_example.begin(), per_example.end());
    if (ir::NumElements(out) != ir::NumElements(s))
      throw Error(Str("cannot reshape ", L.b->type(L[x]).ToString(), " to ", ir::ShapeToString(out)));
    return L.b->Reshape(L[x], out);
  });
}

Tensor Tensor::cross_entropy(const Tensor& labels, Loc loc) const {
  Tensor logits = *this;
  return m_->Record("cross_entropy", loc, [logits, labels](Lowering& L) {
    // loss_i = logsumexp(z_i) - z_i[label_i], with the max subtracted for stability.
    Builder& b = *L.b;
    ValueId z = L[logits], y = L[labels];
    const ir::TensorType &zt = b.type(z), &yt = b.type(y);
    if (zt.rank() != 2 || yt.rank() != 1 || yt.dtype != DType::kS32 || yt.shape[0] != zt.shape[0])
      throw Error(Str("expects logits [B,C] and s32 labels [B], got ", zt.ToString(), " and ", yt.ToString()));
    Shape s = zt.shape;
    ValueId mx = b.ReduceMax(z, {1});
    ValueId shifted = b.Sub(z, b.Broadcast(mx, s, {0}));
    ValueId lse = b.Add(b.Unary(OpCode::kLog, b.ReduceSum(b.Unary(OpCode::kExp, shifted), {1})), mx);
    ValueId onehot = b.Emit(OpCode::kOneHot, {y}, {{"depth", s[1]}});
    ValueId picked = b.ReduceSum(b.Mul(onehot, z), {1});
    return b.Sub(lse, picked);
  });
}

Tensor Tensor::mean(Loc loc) const {
  Tensor x = *this;
  return m_->Record("mean", loc, [x](Lowering& L) { return L.b->ReduceMean(L[x], ir::AllAxes(L.b->type(L[x]).rank())); });
}

Tensor Tensor::sum(Loc loc) const {
  Tensor x = *this;
  return m_->Record("sum", loc, [x](Lowering& L) { return L.b->SumAll(L[x]); });
}

static Tensor BinaryStep(const Tensor& a, const Tensor& o, Model* m, OpCode op, Loc loc) {
  return m->Record(ir::OpName(op), loc, [a, o, op](Lowering& L) {
    ValueId x = L[a], y = L[o];
    if (L.b->shape(x).empty() && !L.b->shape(y).empty()) x = L.b->BroadcastScalar(x, L.b->shape(y));
    if (L.b->shape(y).empty() && !L.b->shape(x).empty()) y = L.b->BroadcastScalar(y, L.b->shape(x));
    return L.b->Binary(op, x, y);
  });
}
Tensor Tensor::add(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kAdd, loc); }
Tensor Tensor::sub(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kSub, loc); }
Tensor Tensor::mul(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kMul, loc); }
Tensor Tensor::scale(double c, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str("scale by ", c), loc, [x, c](Lowering& L) { return L.b->MulScalar(L[x], c); });
}

}  // namespace shardstep::dsl
