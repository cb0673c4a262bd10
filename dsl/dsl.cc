// The fluent front end: records each step, checks it eagerly, lowers it to IR at build().
#include "dsl/dsl.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "ir/error.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/mixed_precision.h"
#include "ir/passes/pipeline.h"

namespace shardstep::dsl {

using ir::Attrs;
using ir::Builder;
using ir::DType;
using ir::IntList;
using ir::OpCode;
using ir::Shape;
using ir::ValueId;
using ir::kNoValue;

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

int64_t NormAxis(int64_t axis, size_t rank, const char* what) {
  int64_t r = static_cast<int64_t>(rank);
  int64_t a = axis < 0 ? axis + r : axis;
  if (a < 0 || a >= r) throw Error(Str(what, " axis ", axis, " is out of range for rank ", r));
  return a;
}

IntList NormAxes(const IntList& axes, size_t rank, const char* what) {
  IntList out;
  for (int64_t a : axes) out.push_back(NormAxis(a, rank, what));
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end()) throw Error(Str(what, " axes repeat an axis"));
  return out;
}

// Broadcasts `v` to `out` numpy-style (trailing alignment; size-1 dimensions stretch).
ValueId BroadcastValue(Builder& b, ValueId v, const Shape& out) {
  const Shape s = b.shape(v);
  if (s == out) return v;
  const size_t off = out.size() - s.size();
  Shape kept;
  IntList dims;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == out[off + i]) {
      kept.push_back(s[i]);
      dims.push_back(static_cast<int64_t>(off + i));
    } else if (s[i] != 1) {
      throw Error(Str("cannot broadcast ", b.type(v).ToString(), " to ", ir::ShapeToString(out)));
    }
  }
  if (kept.size() != s.size()) v = b.Reshape(v, kept);
  return b.Broadcast(v, out, dims);
}

// The mean of `x` over the replicas of the data-parallel group (identity with one replica).
ValueId GroupMean(const Lowering& L, ValueId x) {
  if (L.group_replicas() <= 1) return x;
  return L.b->AllReduce(x, "mean", L.groups());
}

// Per-position cross-entropy and the per-position weights it implies (ignore_index).
struct CeParts {
  ValueId loss;    // [...]
  ValueId weight;  // [...] f32, or kNoValue
};

CeParts CrossEntropyParts(Builder& b, ValueId z, ValueId y, const CrossEntropyOptions& o) {
  const ir::TensorType zt = b.type(z), yt = b.type(y);  // copies: the builder appends below
  Shape pos(zt.shape.begin(), zt.shape.end() - (zt.rank() > 0 ? 1 : 0));
  if (zt.rank() < 1 || zt.dtype != DType::kF32 || yt.dtype != DType::kS32 || yt.shape != pos)
    throw Error(Str("expects f32 logits [..., C] and s32 labels [...] with the same leading shape, got ",
                    zt.ToString(), " and ", yt.ToString()));
  if (o.label_smoothing < 0 || o.label_smoothing > 1)
    throw Error(Str("label_smoothing ", o.label_smoothing, " is not in [0, 1]"));
  const Shape& s = zt.shape;
  const int64_t c = s.back(), last = static_cast<int64_t>(s.size()) - 1;
  const IntList keep = ir::AllAxes(last);
  // log p = z - max - log sum exp(z - max). The max is held out of autodiff (see LogSoftmax).
  ValueId mx = b.Unary(OpCode::kStopGradient, b.ReduceMax(z, {last}));
  ValueId shifted = b.Sub(z, b.Broadcast(mx, s, keep));
  ValueId lse = b.Unary(OpCode::kLog, b.ReduceSum(b.Unary(OpCode::kExp, shifted), {last}));
  ValueId weight = kNoValue;
  if (o.ignore_index) {
    ValueId ignored = b.Binary(OpCode::kEq, y, b.Constant(static_cast<double>(*o.ignore_index), yt));
    y = b.Select(ignored, b.Constant(0, yt), y);  // any valid class: its loss is multiplied by 0
    weight = b.Sub(b.Constant(1.0, {DType::kF32, pos}), b.Convert(ignored, DType::kF32));
  }
  ValueId onehot = b.Emit(OpCode::kOneHot, {y}, {{"depth", c}});
  ValueId nll = b.Sub(lse, b.ReduceSum(b.Mul(onehot, shifted), {last}));  // -log p[label]
  ValueId loss = nll;
  if (o.label_smoothing > 0) {
    // torch: (1 - ls) nll + ls * mean_c(-log p_c); -log p_c summed = C lse - sum(shifted).
    ValueId smooth = b.Sub(lse, b.MulScalar(b.ReduceSum(shifted, {last}), 1.0 / static_cast<double>(c)));
    loss = b.Add(b.MulScalar(nll, 1 - o.label_smoothing), b.MulScalar(smooth, o.label_smoothing));
  }
  if (weight != kNoValue) loss = b.Mul(loss, weight);
  return {loss, weight};
}

// sum(x w) / global sum(w), as a per-replica loss whose mean over the group is the global value.
ValueId WeightedMean(const Lowering& L, ValueId x, ValueId w) {
  Builder& b = *L.b;
  // Unweighted: every replica has the same count, so the replicas' means average to the global mean.
  if (w == kNoValue) return b.ReduceMean(x, ir::AllAxes(b.type(x).rank()));
  ValueId num = b.SumAll(b.Mul(x, w));
  ValueId den = b.SumAll(w);
  // all_reduce mean of the local sums = global sum / replicas, so local = replicas * num / global sum.
  return b.Div(num, GroupMean(L, den));
}

}  // namespace

ir::IntLists Lowering::groups() const { return ir::ContiguousGroups(replicas(), group_size); }

// ---- Model ----

Model::Model(std::string name, uint64_t seed) : name_(std::move(name)), seed_(seed) {
  eager_.name = name_;
  eager_builder_ = std::make_unique<Builder>(&eager_);
  eager_lowering_ = std::make_unique<Lowering>(Lowering{eager_builder_.get(), 1, {}, Mode::kTrain, 0});
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

bool Model::batched(const Tensor& t) const {
  ValueId v = eager_lowering_->nodes.at(t.node());
  return v != kNoValue && eager_.PerReplicaValues()[v];
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
  return weight(name, std::move(type), init, std::move(init_attrs), WeightOptions{}, loc);
}

Tensor Model::weight(const std::string& name, ir::TensorType type, const std::string& init, Attrs init_attrs,
                     WeightOptions wo, Loc loc) {
  if (!wo.weight_decay) init_attrs["weight_decay"] = int64_t{0};
  if (!wo.layer_adaptation) init_attrs["layer_adaptation"] = int64_t{0};
  init_attrs["init"] = init;
  init_attrs["seed"] = static_cast<int64_t>(SeedFor(name) & 0x7FFFFFFFFFFFFFFFull);
  return Record(Str("weight '", name, "'"), loc, [name, type, init_attrs](Lowering& L) {
    return L.b->Variable(name, type, ir::kRoleWeight, init_attrs);
  });
}

Tensor Model::state(const std::string& name, ir::TensorType type, const std::string& init, Attrs init_attrs, Loc loc) {
  init_attrs["init"] = init;
  return Record(Str("state '", name, "'"), loc, [name, type, init_attrs](Lowering& L) {
    return L.b->Variable(name, type, ir::kRoleModelState, init_attrs);
  });
}

void Model::assign(const Tensor& state, const Tensor& value, Loc loc) {
  Record("assign", loc, [state, value](Lowering& L) {
    ir::Module& m = L.b->module();
    ValueId var = L[state], val = L[value];
    if (m.at(var).op != OpCode::kVariable || m.at(var).GetString("role", "") != ir::kRoleModelState)
      throw Error("assign needs a state variable (Model::state)");
    if (m.type(var) != m.type(val))
      throw Error(Str("value ", m.type(val).ToString(), " does not match the state ", m.type(var).ToString()));
    if (L.training()) {
      if (m.AssignedValue(var) != kNoValue) throw Error(Str("state '", m.at(var).name, "' is assigned twice"));
      m.assigns.push_back({var, val});
    }
    return var;
  });
}

Tensor Model::constant(double value, DType dtype, Loc loc) {
  return Record(Str("constant ", value), loc, [value, dtype](Lowering& L) { return L.b->Scalar(value, dtype); });
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

ir::Module Model::lower(int replicas, Mode mode, int group_size) const {
  CheckError();
  if (replicas < 1) throw Error(Str("replicas must be >= 1, got ", replicas));
  ir::ContiguousGroups(replicas, group_size);  // checks the group size
  ir::Module m;
  m.name = name_;
  m.num_replicas = replicas;
  Builder b(&m);
  Lowering L{&b, replicas, {}, mode, group_size};
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
  if (!precision_.empty()) o_.bf16_contractions = ir::ParsePrecision(precision_, ".precision()");
  p.options = o_;
  p.forward = m_->lower(o_.replicas, Mode::kEval, o_.group_size);
  p.step = m_->lower(o_.replicas, Mode::kTrain, o_.group_size);
  ir::BuildTrainingPipeline(o_).Run(p.step);
  return p;
}

// ---- Tensor ----

const Shape& Tensor::shape() const { return m_->type_of(*this).shape; }
ir::DType Tensor::dtype() const { return m_->type_of(*this).dtype; }

Tensor Tensor::dense(int64_t units, const std::string& name, bool bias, Loc loc) const {
  int64_t in = shape().empty() ? 0 : shape().back();
  Tensor w = m_->weight(name + ".w", f32({in, units}), "glorot_uniform", {{"fan_in", in}, {"fan_out", units}}, loc);
  Tensor b = bias ? m_->weight(name + ".b", f32({units}), "zeros", {}, WeightOptions::NoDecay(), loc) : Tensor();
  Tensor x = *this;
  return m_->Record(Str("dense '", name, "'"), loc, [x, w, b, bias](Lowering& L) {
    ValueId y = DenseMatmul(*L.b, L[x], L[w]);
    if (bias) y = L.b->Add(y, BroadcastLast(*L.b, L[b], L.b->shape(y)));
    return y;
  });
}

Tensor Tensor::conv2d(int64_t filters, int64_t kernel, const std::string& name, int64_t stride, int64_t padding,
                      bool bias, Loc loc) const {
  int64_t in_ch = shape().size() == 4 ? shape()[1] : 0;
  int64_t fan_in = in_ch * kernel * kernel;
  Tensor w = m_->weight(name + ".w", f32({filters, in_ch, kernel, kernel}), "he_normal", {{"fan_in", fan_in}}, loc);
  Tensor b = bias ? m_->weight(name + ".b", f32({filters}), "zeros", {}, WeightOptions::NoDecay(), loc) : Tensor();
  Tensor x = *this;
  return m_->Record(Str("conv2d '", name, "'"), loc, [x, w, b, stride, padding, bias](Lowering& L) {
    if (L.b->type(L[x]).rank() != 4)
      throw Error(Str("input must be NCHW (rank 4), got ", L.b->type(L[x]).ToString()));
    ValueId y = L.b->Emit(OpCode::kConv2d, {L[x], L[w]},
                          {{"stride", IntList{stride, stride}}, {"padding", IntList{padding, padding}}});
    return bias ? L.b->Add(y, L.b->Broadcast(L[b], L.b->shape(y), {1})) : y;
  });
}

Tensor Tensor::max_pool(int64_t window, int64_t stride, int64_t padding, Loc loc) const {
  if (stride == 0) stride = window;
  Tensor x = *this;
  return m_->Record(Str("max_pool ", window, "x", window), loc, [x, window, stride, padding](Lowering& L) {
    return L.b->MaxPool(L[x], {window, window}, {stride, stride}, padding);
  });
}

Tensor Tensor::avg_pool(int64_t window, int64_t stride, Loc loc) const {
  if (stride == 0) stride = window;
  Tensor x = *this;
  return m_->Record(Str("avg_pool ", window, "x", window), loc, [x, window, stride](Lowering& L) {
    return L.b->Emit(OpCode::kAvgPool, {L[x]}, {{"window", IntList{window, window}}, {"stride", IntList{stride, stride}}});
  });
}

Tensor Tensor::global_avg_pool(Loc loc) const {
  Tensor x = *this;
  return m_->Record("global_avg_pool", loc, [x](Lowering& L) {
    if (L.b->type(L[x]).rank() != 4) throw Error(Str("input must be NCHW (rank 4), got ", L.b->type(L[x]).ToString()));
    return L.b->ReduceMean(L[x], {2, 3});
  });
}

Tensor Tensor::layer_norm(const std::string& name, double eps, Loc loc) const {
  int64_t d = shape().empty() ? 0 : shape().back();
  Tensor gamma = m_->weight(name + ".gamma", f32({d}), "ones", {}, WeightOptions::NoDecay(), loc);
  Tensor beta = m_->weight(name + ".beta", f32({d}), "zeros", {}, WeightOptions::NoDecay(), loc);
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
    // 1 / sqrt(var + eps) once per row, then broadcast (per element, the forward and the backward's
    // d/d var = -inv^3 / 2 ran it on every element: an f32 square root and division each).
    ValueId var = b.ReduceMean(b.Mul(centered, centered), last);
    ValueId norm = b.Mul(centered, b.Broadcast(b.Unary(OpCode::kRsqrt, b.AddScalar(var, eps)), s, keep));
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
Tensor Tensor::stop_gradient(Loc loc) const { return UnaryStep(*this, m_, OpCode::kStopGradient, loc); }

Tensor Tensor::gelu(Loc loc) const {
  Tensor x = *this;
  return m_->Record("gelu", loc, [x](Lowering& L) {
    // 0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), computed as x sigmoid(2 z): the same
    // function (0.5 (1 + tanh z) = 1 / (1 + e^-2z)), one exp and a division per element where tanh
    // takes a polynomial, an exp and a division, and no cancellation in 1 + tanh(z) for negative x.
    Builder& b = *L.b;
    ValueId v = L[x];
    ValueId cube = b.Mul(b.Mul(v, v), v);
    ValueId two_z = b.MulScalar(b.Add(v, b.MulScalar(cube, 0.044715)), 2.0 * std::sqrt(2.0 / M_PI));
    return b.Mul(v, b.Unary(OpCode::kSigmoid, two_z));
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

Tensor Tensor::cross_entropy(const Tensor& labels, Loc loc) const { return cross_entropy(labels, {}, loc); }

Tensor Tensor::cross_entropy(const Tensor& labels, const CrossEntropyOptions& o, Loc loc) const {
  Tensor logits = *this;
  return m_->Record("cross_entropy", loc, [logits, labels, o](Lowering& L) {
    return CrossEntropyParts(*L.b, L[logits], L[labels], o).loss;
  });
}

Tensor Tensor::cross_entropy_mean(const Tensor& labels, const CrossEntropyOptions& o, Loc loc) const {
  return cross_entropy_mean(labels, o, Tensor(), loc);
}

Tensor Tensor::cross_entropy_mean(const Tensor& labels, const CrossEntropyOptions& o, const Tensor& weights,
                                  Loc loc) const {
  Tensor logits = *this;
  return m_->Record("cross_entropy_mean", loc, [logits, labels, o, weights](Lowering& L) {
    Builder& b = *L.b;
    CeParts ce = CrossEntropyParts(b, L[logits], L[labels], o);
    ValueId w = ce.weight;
    if (weights.defined()) {
      ValueId given = L[weights];
      if (b.type(given) != ir::TensorType{DType::kF32, b.shape(ce.loss)})
        throw Error(Str("weights ", b.type(given).ToString(), " must be f32 with the labels' shape ",
                        ir::ShapeToString(b.shape(ce.loss))));
      w = w == kNoValue ? given : b.Mul(w, given);
    }
    return WeightedMean(L, ce.loss, w);
  });
}

Tensor Tensor::weighted_mean(const Tensor& weights, Loc loc) const {
  Tensor x = *this;
  return m_->Record("weighted_mean", loc, [x, weights](Lowering& L) {
    if (L.b->type(L[weights]) != L.b->type(L[x]))
      throw Error(Str("weights ", L.b->type(L[weights]).ToString(), " must match the values ", L.b->type(L[x]).ToString()));
    return WeightedMean(L, L[x], L[weights]);
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

static Tensor ReduceStep(const Tensor& x, Model* m, OpCode op, const IntList& axes, Loc loc) {
  return m->Record(Str(ir::OpName(op), " over ", ir::ShapeToString(axes)), loc, [x, op, axes](Lowering& L) {
    IntList a = NormAxes(axes, L.b->type(L[x]).rank(), ir::OpName(op));
    return L.b->Emit(op, {L[x]}, {{"axes", a}});
  });
}
Tensor Tensor::mean(const IntList& axes, Loc loc) const { return ReduceStep(*this, m_, OpCode::kReduceMean, axes, loc); }
Tensor Tensor::sum(const IntList& axes, Loc loc) const { return ReduceStep(*this, m_, OpCode::kReduceSum, axes, loc); }
Tensor Tensor::max(const IntList& axes, Loc loc) const { return ReduceStep(*this, m_, OpCode::kReduceMax, axes, loc); }

// ---- Elementwise arithmetic ----

Shape BroadcastShapes(const Shape& a, const Shape& b) {
  Shape out(std::max(a.size(), b.size()), 1);
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t da = i < a.size() ? a[a.size() - 1 - i] : 1, db = i < b.size() ? b[b.size() - 1 - i] : 1;
    if (da != db && da != 1 && db != 1)
      throw Error(Str("shapes ", ir::ShapeToString(a), " and ", ir::ShapeToString(b), " do not broadcast"));
    out[out.size() - 1 - i] = da == 1 ? db : da;
  }
  return out;
}

static Tensor BinaryStep(const Tensor& a, const Tensor& o, Model* m, OpCode op, Loc loc) {
  return m->Record(ir::OpName(op), loc, [a, o, op](Lowering& L) {
    ValueId x = L[a], y = L[o];
    Shape out;
    try {
      out = BroadcastShapes(L.b->shape(x), L.b->shape(y));
    } catch (const Error&) {
      throw Error(Str("operands ", L.b->type(x).ToString(), " and ", L.b->type(y).ToString(), " do not broadcast"));
    }
    return L.b->Binary(op, BroadcastValue(*L.b, x, out), BroadcastValue(*L.b, y, out));
  });
}
Tensor Tensor::add(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kAdd, loc); }
Tensor Tensor::sub(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kSub, loc); }
Tensor Tensor::mul(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kMul, loc); }
Tensor Tensor::div(const Tensor& o, Loc loc) const { return BinaryStep(*this, o, m_, OpCode::kDiv, loc); }
Tensor Tensor::scale(double c, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str("scale by ", c), loc, [x, c](Lowering& L) { return L.b->MulScalar(L[x], c); });
}
Tensor Tensor::add_scalar(double c, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str("add ", c), loc, [x, c](Lowering& L) { return L.b->AddScalar(L[x], c); });
}
Tensor Tensor::rdiv_scalar(double c, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str(c, " / x"), loc, [x, c](Lowering& L) { return L.b->Div(L.b->ScalarLike(c, L[x]), L[x]); });
}
Tensor Tensor::neg(Loc loc) const { return UnaryStep(*this, m_, OpCode::kNeg, loc); }
Tensor Tensor::exp(Loc loc) const { return UnaryStep(*this, m_, OpCode::kExp, loc); }
Tensor Tensor::log(Loc loc) const { return UnaryStep(*this, m_, OpCode::kLog, loc); }
Tensor Tensor::sqrt(Loc loc) const { return UnaryStep(*this, m_, OpCode::kSqrt, loc); }
Tensor Tensor::rsqrt(Loc loc) const { return UnaryStep(*this, m_, OpCode::kRsqrt, loc); }

Tensor operator+(const Tensor& a, const Operand& b) { return a.add(b.t, b.loc); }
Tensor operator-(const Tensor& a, const Operand& b) { return a.sub(b.t, b.loc); }
Tensor operator*(const Tensor& a, const Operand& b) { return a.mul(b.t, b.loc); }
Tensor operator/(const Tensor& a, const Operand& b) { return a.div(b.t, b.loc); }
Tensor operator+(const Tensor& a, ScalarOperand c) { return a.add_scalar(c.v, c.loc); }
Tensor operator-(const Tensor& a, ScalarOperand c) { return a.add_scalar(-c.v, c.loc); }
Tensor operator*(const Tensor& a, ScalarOperand c) { return a.scale(c.v, c.loc); }
Tensor operator/(const Tensor& a, ScalarOperand c) { return a.scale(1.0 / c.v, c.loc); }
Tensor operator+(ScalarOperand c, const Tensor& a) { return a.add_scalar(c.v, c.loc); }
Tensor operator-(ScalarOperand c, const Tensor& a) { return a.neg(c.loc).add_scalar(c.v, c.loc); }
Tensor operator*(ScalarOperand c, const Tensor& a) { return a.scale(c.v, c.loc); }
Tensor operator/(ScalarOperand c, const Tensor& a) { return a.rdiv_scalar(c.v, c.loc); }
Tensor operator-(const Operand& a) { return a.t.neg(a.loc); }

// ---- Shapes, matmul, softmax ----

Tensor Tensor::reshape_full(const Shape& global_shape, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str("reshape to ", ir::ShapeToString(global_shape)), loc, [x, global_shape](Lowering& L) {
    Shape s = L.b->shape(L[x]), out = global_shape;
    if (s.empty() || out.empty()) throw Error("reshape_full needs a batch dimension on both sides");
    if (out[0] % L.batch_divisor != 0)
      throw Error(Str("batch dimension ", out[0], " is not divisible by ", L.batch_divisor, " replicas"));
    out[0] /= L.batch_divisor;
    if (ir::NumElements(out) != ir::NumElements(s))
      throw Error(Str("cannot reshape ", L.b->type(L[x]).ToString(), " to ", ir::ShapeToString(out)));
    return L.b->Reshape(L[x], out);
  });
}

Tensor Tensor::transpose(const IntList& perm, Loc loc) const {
  Tensor x = *this;
  const bool batched = m_->batched(x);
  return m_->Record(Str("transpose ", ir::ShapeToString(perm)), loc, [x, perm, batched](Lowering& L) {
    if (batched && !perm.empty() && perm[0] != 0)
      throw Error("transpose must keep the batch dimension first (perm[0] == 0)");
    return L.b->Transpose(L[x], perm);
  });
}

Tensor Tensor::slice(int64_t axis, int64_t start, int64_t limit, Loc loc) const {
  Tensor x = *this;
  const bool batched = m_->batched(x);
  return m_->Record(Str("slice axis ", axis, " [", start, ", ", limit, ")"), loc, [=](Lowering& L) {
    Shape s = L.b->shape(L[x]);
    int64_t a = NormAxis(axis, s.size(), "slice");
    if (a == 0 && batched) throw Error("slice cannot cut the batch dimension");
    if (start < 0 || limit > s[a] || start >= limit)
      throw Error(Str("[", start, ", ", limit, ") is not a non-empty range within ", s[a]));
    IntList lo(s.size(), 0), hi(s.begin(), s.end());
    lo[a] = start;
    hi[a] = limit;
    return L.b->Slice(L[x], lo, hi);
  });
}

Tensor Tensor::matmul(const Tensor& o, bool ta, bool tb, Loc loc) const {
  Tensor x = *this;
  return m_->Record("matmul", loc, [x, o, ta, tb](Lowering& L) {
    Builder& b = *L.b;
    const size_t ra = b.type(L[x]).rank(), rb = b.type(L[o]).rank();
    if (ra > 2 && rb == 2 && !ta) {  // x [..., k] @ w [k, n]
      ValueId w = tb ? b.Transpose(L[o], {1, 0}) : L[o];
      return DenseMatmul(b, L[x], w);
    }
    return b.Matmul(L[x], L[o], ta, tb);
  });
}

Tensor concat(const std::vector<Tensor>& parts, int64_t axis, Loc loc) {
  if (parts.empty() || !parts[0].defined()) throw Error(Str(Where(loc), ": error: concat needs at least one tensor"));
  bool batched = false;
  for (const Tensor& t : parts) batched |= t.model()->batched(t);
  return parts[0].model()->Record(Str("concat axis ", axis), loc, [parts, axis, batched](Lowering& L) {
    std::vector<ValueId> vs;
    for (const Tensor& t : parts) vs.push_back(L[t]);
    int64_t a = NormAxis(axis, L.b->type(vs[0]).rank(), "concat");
    if (a == 0 && batched) throw Error("concat cannot join along the batch dimension");
    return L.b->Concat(vs, a);
  });
}

Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal, Loc loc) {
  if (!q.defined() || !k.defined() || !v.defined())
    throw Error(Str(Where(loc), ": error: attention needs q, k and v"));
  return q.model()->Record("attention", loc, [q, k, v, scale, causal](Lowering& L) {
    return L.b->Emit(OpCode::kAttention, {L[q], L[k], L[v]}, {{"scale", scale}, {"causal", int64_t{causal}}});
  });
}

Tensor Tensor::cast(DType to, Loc loc) const {
  Tensor x = *this;
  return m_->Record(Str("cast to ", ir::DTypeName(to)), loc, [x, to](Lowering& L) { return L.b->Convert(L[x], to); });
}

// x - max - log(sum(exp(x - max))) along `a`, and the shifted values and the sum. The max only keeps
// exp in range: the result does not depend on it, so its gradient is zero and the max is held out of
// autodiff (stop_gradient), as PyTorch's softmax backward leaves it out. Through the max, autodiff
// made a [.., T] sum and an argmax mask per softmax that added rounding noise to a zero (transformer_lm:
// two passes over each layer's [32, 4, 128, 128] attention weights).
static ValueId LogSoftmax(Builder& b, ValueId x, int64_t axis, bool want_softmax) {
  Shape s = b.shape(x);
  int64_t a = NormAxis(axis, s.size(), "softmax");
  IntList keep;
  for (int64_t i = 0; i < static_cast<int64_t>(s.size()); ++i)
    if (i != a) keep.push_back(i);
  const ValueId mx = b.Unary(OpCode::kStopGradient, b.ReduceMax(x, {a}));
  ValueId shifted = b.Sub(x, b.Broadcast(mx, s, keep));
  ValueId e = b.Unary(OpCode::kExp, shifted);
  const ValueId total = b.ReduceSum(e, {a});
  // Softmax multiplies by the sum's reciprocal, as PyTorch's CPU kernel does: one division per row,
  // and none per element in the backward either (transformer_lm: four f32 divisions per attention
  // weight and step, in loops that were bound by them).
  if (want_softmax) return b.Mul(e, b.Broadcast(b.Div(b.ScalarLike(1.0, total), total), s, keep));
  return b.Sub(shifted, b.Broadcast(b.Unary(OpCode::kLog, total), s, keep));  // log once per row
}

Tensor Tensor::softmax(int64_t axis, Loc loc) const {
  Tensor x = *this;
  return m_->Record("softmax", loc, [x, axis](Lowering& L) { return LogSoftmax(*L.b, L[x], axis, true); });
}

Tensor Tensor::log_softmax(int64_t axis, Loc loc) const {
  Tensor x = *this;
  return m_->Record("log_softmax", loc, [x, axis](Lowering& L) { return LogSoftmax(*L.b, L[x], axis, false); });
}

// ---- Batch norm and dropout ----

Tensor Tensor::batch_norm(const std::string& name, BatchNormOptions o, Loc loc) const {
  const int64_t c = shape().size() >= 2 ? shape()[1] : 0;
  Tensor gamma = m_->weight(name + ".gamma", f32({c}), "ones", {}, WeightOptions::NoDecay(), loc);
  Tensor beta = m_->weight(name + ".beta", f32({c}), "zeros", {}, WeightOptions::NoDecay(), loc);
  Tensor rmean = m_->state(name + ".running_mean", f32({c}), "zeros", {}, loc);
  Tensor rvar = m_->state(name + ".running_var", f32({c}), "ones", {}, loc);
  Tensor x = *this;
  return m_->Record(Str("batch_norm '", name, "'"), loc, [x, gamma, beta, rmean, rvar, o](Lowering& L) {
    Builder& b = *L.b;
    ir::Module& m = b.module();
    ValueId v = L[x];
    const Shape s = b.shape(v);
    if (s.size() != 2 && s.size() != 4)
      throw Error(Str("input must be [B,C] or NCHW, got ", b.type(v).ToString()));
    if (o.momentum < 0 || o.momentum > 1 || o.eps <= 0)
      throw Error(Str("momentum ", o.momentum, " must be in [0, 1] and eps ", o.eps, " positive"));
    const IntList axes = s.size() == 2 ? IntList{0} : IntList{0, 2, 3};
    auto per_channel = [&](ValueId t) { return b.Broadcast(t, s, {1}); };
    ValueId mean, var, centered = kNoValue, held_mean = kNoValue;
    if (!L.training()) {
      mean = L[rmean];
      var = L[rvar];
    } else {
      // (At most the replica count: the eager, one-replica lowering has no groups.)
      const int64_t bn_group = std::min<int64_t>(o.group_size > 0 ? o.group_size : L.group_replicas(), L.replicas());
      const bool cross = o.cross_replica && bn_group > 1;
      const ir::IntLists bn_groups = ir::ContiguousGroups(L.replicas(), static_cast<int>(bn_group));
      // Equal per-replica counts: the group's mean is the mean of the replicas' means.
      auto reduce = [&](ValueId t) { return cross ? L.b->AllReduce(t, "mean", bn_groups) : t; };
      mean = reduce(b.ReduceMean(v, axes));
      // x - mean is computed once, from a mean held out of autodiff (stop_gradient), and the mean's own
      // gradient comes back through `held_mean - mean` below (0 in value). So the backward pass reads one
      // saved x - mean, and skips the variance's dependence on the mean, d var / d mean = -2 mean(x -
      // mean): exactly zero, but autodiff would spend a pass over x on it (torch's formula leaves it out
      // too). Batch norm's backward is then two passes over x, not three.
      held_mean = b.Unary(OpCode::kStopGradient, mean);
      centered = b.Sub(v, per_channel(held_mean));
      var = reduce(b.ReduceMean(b.Mul(centered, centered), axes));
      // Running statistics (torch): unbiased variance; per-replica statistics are averaged over the
      // group so every replica keeps the same running values.
      int64_t n = ir::NumElements(s) / s[1] * (cross ? bn_group : 1);
      ValueId unbiased = b.MulScalar(var, n > 1 ? static_cast<double>(n) / static_cast<double>(n - 1) : 1.0);
      ValueId smean = mean;
      if (!cross || bn_group != L.group_replicas()) {  // the same running statistics on every replica
        smean = GroupMean(L, smean);
        unbiased = GroupMean(L, unbiased);
      }
      auto update = [&](ValueId r, ValueId stat) {
        ValueId nr = b.Add(b.MulScalar(r, 1 - o.momentum), b.MulScalar(stat, o.momentum));
        if (m.AssignedValue(r) != kNoValue)
          throw Error(Str("state '", m.at(r).name, "' is assigned twice (batch_norm called twice with one name?)"));
        m.assigns.push_back({r, nr});
      };
      update(L[rmean], smean);
      update(L[rvar], unbiased);
    }
    ValueId inv = b.Unary(OpCode::kRsqrt, b.AddScalar(var, o.eps));
    ValueId scale = b.Mul(inv, L[gamma]);
    if (centered == kNoValue) return b.Add(b.Mul(b.Sub(v, per_channel(mean)), per_channel(scale)), per_channel(L[beta]));
    // (x - held_mean) scale + beta + (held_mean - mean) scale: the last term is 0 and carries d/d mean.
    ValueId shift = b.Add(L[beta], b.Mul(b.Sub(held_mean, mean), scale));
    return b.Add(b.Mul(centered, per_channel(scale)), per_channel(shift));
  });
}

Tensor Tensor::dropout(double p, Loc loc) const {
  const int64_t site = m_->NextDropoutSite();  // every call is a site, p == 0 too
  if (p == 0.0) return *this;
  const uint64_t seed = (m_->seed() << 16) + static_cast<uint64_t>(site);
  Tensor x = *this;
  return m_->Record(Str("dropout ", p), loc, [x, p, seed](Lowering& L) {
    if (p < 0 || p >= 1) throw Error(Str("p ", p, " is not in [0, 1)"));
    if (!L.training()) return L[x];
    Builder& b = *L.b;
    ir::Module& m = b.module();
    if (b.type(L[x]).rank() < 1) throw Error("dropout needs a batch dimension");
    ValueId step = m.FindVariable("step");
    if (step == kNoValue) step = b.Variable("step", {DType::kS32, {}}, ir::kRoleStep, {{"init", std::string("zeros")}});
    const Shape s = b.shape(L[x]);  // a copy: the ops below may grow the type table
    ValueId first = b.Mul(b.ReplicaId(), b.Scalar(static_cast<double>(s[0]), DType::kS32));
    ValueId u = b.RandomUniform(step, first, s, seed);
    ValueId keep = b.Binary(OpCode::kGe, u, b.ScalarLike(p, u));
    return b.Select(keep, b.Div(L[x], b.ScalarLike(1.0 - p, L[x])), b.ScalarLike(0.0, L[x]));
  });
}

}  // namespace shardstep::dsl
