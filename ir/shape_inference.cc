// Shape inference: one case per op of ir/ops.def (no default: a new op without a rule fails to compile).
#include "ir/shape_inference.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "ir/error.h"

namespace shardstep::ir {
namespace {

std::string Signature(OpCode op, const std::vector<TensorType>& operands) {
  std::string s = std::string(OpName(op)) + "(";
  for (size_t i = 0; i < operands.size(); ++i) s += (i ? ", " : "") + operands[i].ToString();
  return s + ")";
}

// Attribute lookups for inference, on the raw map (there is no Instr yet).
const AttrValue* Find(const Attrs& a, const char* key) {
  auto it = a.find(key);
  return it == a.end() ? nullptr : &it->second;
}

struct Checker {
  OpCode op;
  const std::vector<TensorType>& in;
  const Attrs& attrs;

  [[noreturn]] void Fail(const std::string& why) const {
    throw Error(Str(Signature(op, in), ": ", why));
  }
  void Require(bool ok, const std::string& why) const {
    if (!ok) Fail(why);
  }
  int64_t Int(const char* key, std::optional<int64_t> dflt = std::nullopt) const {
    const AttrValue* v = Find(attrs, key);
    if (!v) {
      if (dflt) return *dflt;
      Fail(Str("missing attribute '", key, "'"));
    }
    if (auto* i = std::get_if<int64_t>(v)) return *i;
    Fail(Str("attribute '", key, "' must be an integer"));
  }
  IntList Ints(const char* key, std::optional<IntList> dflt = std::nullopt) const {
    const AttrValue* v = Find(attrs, key);
    if (!v) {
      if (dflt) return *dflt;
      Fail(Str("missing attribute '", key, "'"));
    }
    if (auto* l = std::get_if<IntList>(v)) return *l;
    Fail(Str("attribute '", key, "' must be a list of integers"));
  }
  std::string String(const char* key, std::optional<std::string> dflt = std::nullopt) const {
    const AttrValue* v = Find(attrs, key);
    if (!v) {
      if (dflt) return *dflt;
      Fail(Str("missing attribute '", key, "'"));
    }
    if (auto* s = std::get_if<std::string>(v)) return *s;
    Fail(Str("attribute '", key, "' must be a string"));
  }
  void Float(const char* key) const {
    const AttrValue* v = Find(attrs, key);
    Require(v && (std::holds_alternative<double>(*v) || std::holds_alternative<int64_t>(*v)),
            Str("attribute '", key, "' must be a number"));
  }
  // Axes: unique, in range, sorted.
  IntList Axes(const char* key, int64_t rank) const {
    IntList axes = Ints(key);
    for (size_t i = 0; i < axes.size(); ++i) {
      Require(axes[i] >= 0 && axes[i] < rank, Str(key, " ", ShapeToString(axes), " out of range for rank ", rank));
      Require(i == 0 || axes[i] > axes[i - 1], Str(key, " ", ShapeToString(axes), " must be strictly increasing"));
    }
    return axes;
  }
  IntList Pair(const char* key, std::optional<IntList> dflt = std::nullopt) const {
    IntList p = Ints(key, dflt);
    Require(p.size() == 2, Str("attribute '", key, "' must have 2 entries, got ", ShapeToString(p)));
    return p;
  }
  void RequireRank(size_t i, int64_t rank) const {
    Require(in[i].rank() == rank, Str("operand ", i, " must have rank ", rank, ", got ", in[i].ToString()));
  }
  void RequireF32(size_t i) const {
    Require(in[i].dtype == DType::kF32, Str("operand ", i, " must be f32, got ", in[i].ToString()));
  }
  // Float arithmetic: f32 or bf16 (bf16 is computed in f32 and rounded).
  void RequireFloat(size_t i) const {
    Require(IsFloat(in[i].dtype), Str("operand ", i, " must be f32 or bf16, got ", in[i].ToString()));
  }
  // The result dtype of a convolution or pooling op: bf16 when every operand is bf16, else f32 (the
  // kernels check that their operands are float).
  DType WindowDType() const {
    for (const TensorType& t : in)
      if (t.dtype != DType::kBF16) return DType::kF32;
    return DType::kBF16;
  }
};

// Output spatial size of a window (conv or pool) along one axis; 0 when the window does not fit the
// padded input (plain division would truncate -1 / 2 to 0 and admit a window that reads past the end).
int64_t WindowOut(int64_t in, int64_t k, int64_t stride, int64_t pad) {
  return in + 2 * pad < k ? 0 : (in + 2 * pad - k) / stride + 1;
}

// max_pool's `padding` (default 0, the same on every side): padded cells never win, and every window
// must hold a real cell, hence padding < window.
int64_t MaxPoolPadding(const Checker& c, const IntList& k) {
  const int64_t p = c.Int("padding", 0);
  c.Require(p >= 0 && p < k[0] && p < k[1],
            Str("padding ", p, " must be non-negative and smaller than the window ", ShapeToString(k)));
  return p;
}

}  // namespace

IntLists ReplicaGroups(const Instr& c, int num_replicas) {
  IntLists groups = c.GetIntLists("groups");
  if (groups.empty()) {
    std::vector<int64_t> all(num_replicas);
    std::iota(all.begin(), all.end(), 0);
    groups.push_back(all);
  }
  return groups;
}

int64_t GroupSize(const Instr& c, int num_replicas) {
  if (c.Has("group_size")) return c.GetInt("group_size");
  return static_cast<int64_t>(ReplicaGroups(c, num_replicas)[0].size());
}

TensorType InferType(OpCode op, const std::vector<TensorType>& in, const Attrs& attrs, const TensorType* declared) {
  Checker c{op, in, attrs};
  const int arity = OpArity(op);
  if (arity >= 0) c.Require(static_cast<int>(in.size()) == arity, Str("expects ", arity, " operands"));
  else c.Require(!in.empty(), "expects at least one operand");

  auto same_shapes = [&] {
    for (size_t i = 1; i < in.size(); ++i)
      c.Require(in[i].shape == in[0].shape, "operand shapes differ (elementwise ops need equal shapes; broadcast first)");
  };
  auto same_types = [&] {
    same_shapes();
    for (size_t i = 1; i < in.size(); ++i) c.Require(in[i].dtype == in[0].dtype, "operand dtypes differ");
  };

  switch (op) {
    case OpCode::kVariable:
    case OpCode::kInput:
    case OpCode::kConstant:
      c.Require(declared != nullptr, "a leaf needs a declared type");
      if (op == OpCode::kConstant) c.Float("value");
      for (int64_t d : declared->shape) c.Require(d >= 0, Str("negative dimension in ", declared->ToString()));
      return *declared;
    case OpCode::kReplicaId:
      return {DType::kS32, {}};
    case OpCode::kIota: {
      c.Require(declared != nullptr, "a leaf needs a declared type");
      for (int64_t d : declared->shape) c.Require(d >= 0, Str("negative dimension in ", declared->ToString()));
      const int64_t dim = c.Int("dimension");
      c.Require(dim >= 0 && dim < declared->rank(),
                Str("dimension ", dim, " out of range for ", declared->ToString()));
      return *declared;
    }

    case OpCode::kNeg:
    case OpCode::kAbs:
    case OpCode::kStopGradient:
      return in[0];
    case OpCode::kExp:
    case OpCode::kLog:
    case OpCode::kSqrt:
    case OpCode::kRsqrt:
    case OpCode::kTanh:
    case OpCode::kSin:
    case OpCode::kCos:
    case OpCode::kSigmoid:
    case OpCode::kRelu:
      c.RequireFloat(0);
      return in[0];
    case OpCode::kConvert: {
      DType to;
      c.Require(ParseDType(c.String("dtype"), &to), "attribute 'dtype' must be f32, s32 or bf16");
      return {to, in[0].shape};
    }

    case OpCode::kAdd:
    case OpCode::kSub:
    case OpCode::kMul:
    case OpCode::kDiv:
    case OpCode::kMax:
    case OpCode::kMin:
    case OpCode::kEq:
    case OpCode::kNe:
    case OpCode::kLt:
    case OpCode::kLe:
    case OpCode::kGt:
    case OpCode::kGe:
      same_types();
      return in[0];
    case OpCode::kPow:
      same_types();
      c.RequireFloat(0);
      return in[0];
    case OpCode::kSelect:
      same_shapes();
      c.Require(in[1].dtype == in[2].dtype, "select branches have different dtypes");
      return in[1];

    case OpCode::kBroadcast: {
      Shape shape = c.Ints("shape");
      for (int64_t d : shape) c.Require(d >= 0, Str("negative dimension in ", ShapeToString(shape)));
      IntList dims = c.Ints("dims");
      c.Require(dims.size() == in[0].shape.size(),
                Str("dims ", ShapeToString(dims), " must map each of the operand's ", in[0].rank(), " dimensions"));
      for (size_t i = 0; i < dims.size(); ++i) {
        c.Require(dims[i] >= 0 && dims[i] < static_cast<int64_t>(shape.size()) && (i == 0 || dims[i] > dims[i - 1]),
                  Str("dims ", ShapeToString(dims), " must be increasing and within rank ", shape.size()));
        c.Require(shape[dims[i]] == in[0].shape[i],
                  Str("operand dimension ", i, " (", in[0].shape[i], ") does not match output dimension ", dims[i],
                      " of ", ShapeToString(shape)));
      }
      return {in[0].dtype, shape};
    }
    case OpCode::kReshape: {
      Shape shape = c.Ints("shape");
      for (int64_t d : shape) c.Require(d >= 0, Str("negative dimension in ", ShapeToString(shape)));
      c.Require(NumElements(shape) == in[0].elements(),
                Str("cannot reshape ", in[0].elements(), " elements to ", ShapeToString(shape)));
      return {in[0].dtype, shape};
    }
    case OpCode::kTranspose: {
      IntList perm = c.Ints("perm");
      IntList sorted = perm;
      std::sort(sorted.begin(), sorted.end());
      IntList iota(in[0].rank());
      std::iota(iota.begin(), iota.end(), 0);
      c.Require(sorted == iota, Str("perm ", ShapeToString(perm), " is not a permutation of rank ", in[0].rank()));
      Shape out(perm.size());
      for (size_t i = 0; i < perm.size(); ++i) out[i] = in[0].shape[perm[i]];
      return {in[0].dtype, out};
    }
    case OpCode::kSlice: {
      IntList start = c.Ints("start"), limit = c.Ints("limit");
      c.Require(static_cast<int64_t>(start.size()) == in[0].rank() && limit.size() == start.size(),
                "start and limit must have one entry per dimension");
      Shape out(start.size());
      for (size_t i = 0; i < start.size(); ++i) {
        c.Require(0 <= start[i] && start[i] <= limit[i] && limit[i] <= in[0].shape[i],
                  Str("slice [", start[i], ",", limit[i], ") out of range in dimension ", i));
        out[i] = limit[i] - start[i];
      }
      return {in[0].dtype, out};
    }
    case OpCode::kPad: {
      IntList low = c.Ints("low"), high = c.Ints("high");
      c.Require(static_cast<int64_t>(low.size()) == in[0].rank() && high.size() == low.size(),
                "low and high must have one entry per dimension");
      Shape out(low.size());
      for (size_t i = 0; i < low.size(); ++i) {
        c.Require(low[i] >= 0 && high[i] >= 0, "padding must be non-negative");
        out[i] = in[0].shape[i] + low[i] + high[i];
      }
      return {in[0].dtype, out};
    }
    case OpCode::kConcat: {
      int64_t axis = c.Int("axis");
      c.Require(axis >= 0 && axis < in[0].rank(), Str("axis ", axis, " out of range"));
      Shape out = in[0].shape;
      for (size_t i = 1; i < in.size(); ++i) {
        c.Require(in[i].dtype == in[0].dtype && in[i].rank() == in[0].rank(), "operands differ in dtype or rank");
        for (int64_t d = 0; d < in[0].rank(); ++d)
          if (d != axis) c.Require(in[i].shape[d] == in[0].shape[d], Str("operands differ in dimension ", d));
        out[axis] += in[i].shape[axis];
      }
      return {in[0].dtype, out};
    }

    case OpCode::kReduceSum:
    case OpCode::kReduceMax:
    case OpCode::kReduceMean: {
      IntList axes = c.Axes("axes", in[0].rank());
      Shape out;
      for (int64_t d = 0; d < in[0].rank(); ++d)
        if (!std::binary_search(axes.begin(), axes.end(), d)) out.push_back(in[0].shape[d]);
      return {in[0].dtype, out};
    }

    case OpCode::kMatmul: {  // [batch..., m, k] x [batch..., k, n]; transposes act on the last two dims
      const int64_t r = in[0].rank();
      c.Require(r >= 2, Str("operands must have rank >= 2, got ", in[0].ToString()));
      c.Require(in[1].rank() == r, Str("operands must have the same rank, got ", in[0].ToString(), " and ",
                                       in[1].ToString()));
      c.RequireFloat(0);
      c.RequireFloat(1);
      c.Require(in[0].dtype == in[1].dtype, "operand dtypes differ");
      for (int64_t d = 0; d + 2 < r; ++d)
        c.Require(in[0].shape[d] == in[1].shape[d],
                  Str("batch dimension ", d, " differs: ", in[0].shape[d], " vs ", in[1].shape[d]));
      const Shape &a = in[0].shape, &b = in[1].shape;
      bool ta = c.Int("transpose_a", 0) != 0, tb = c.Int("transpose_b", 0) != 0;
      int64_t m = ta ? a[r - 1] : a[r - 2], k = ta ? a[r - 2] : a[r - 1];
      int64_t k2 = tb ? b[r - 1] : b[r - 2], n = tb ? b[r - 2] : b[r - 1];
      c.Require(k == k2, Str("contracting dimensions differ: ", k, " vs ", k2));
      Shape out(a.begin(), a.end() - 2);
      out.push_back(m);
      out.push_back(n);
      return {in[0].dtype, out};
    }
    case OpCode::kConv2d: {
      c.RequireRank(0, 4);
      c.RequireRank(1, 4);
      IntList s = c.Pair("stride", IntList{1, 1}), p = c.Pair("padding", IntList{0, 0});
      c.Require(s[0] > 0 && s[1] > 0 && p[0] >= 0 && p[1] >= 0, "stride must be positive and padding non-negative");
      const Shape &x = in[0].shape, &w = in[1].shape;
      c.Require(x[1] == w[1], Str("input channels ", x[1], " do not match filter input channels ", w[1]));
      int64_t oh = WindowOut(x[2], w[2], s[0], p[0]), ow = WindowOut(x[3], w[3], s[1], p[1]);
      c.Require(oh > 0 && ow > 0 && s[0] > 0 && s[1] > 0, "filter larger than padded input, or bad stride");
      return {c.WindowDType(), {x[0], w[0], oh, ow}};
    }
    case OpCode::kConv2dInputGrad: {  // (dy, w) -> dx
      c.RequireRank(0, 4);
      c.RequireRank(1, 4);
      Shape x = c.Ints("input_shape");
      IntList s = c.Pair("stride", IntList{1, 1}), p = c.Pair("padding", IntList{0, 0});
      c.Require(s[0] > 0 && s[1] > 0 && p[0] >= 0 && p[1] >= 0, "stride must be positive and padding non-negative");
      const Shape &dy = in[0].shape, &w = in[1].shape;
      c.Require(x.size() == 4 && dy[0] == x[0] && dy[1] == w[0] && x[1] == w[1] &&
                    dy[2] == WindowOut(x[2], w[2], s[0], p[0]) && dy[3] == WindowOut(x[3], w[3], s[1], p[1]),
                "input_shape, dy and filter do not describe one convolution");
      return {c.WindowDType(), x};
    }
    case OpCode::kConv2dFilterGrad: {  // (x, dy) -> dw
      c.RequireRank(0, 4);
      c.RequireRank(1, 4);
      Shape w = c.Ints("filter_shape");
      IntList s = c.Pair("stride", IntList{1, 1}), p = c.Pair("padding", IntList{0, 0});
      c.Require(s[0] > 0 && s[1] > 0 && p[0] >= 0 && p[1] >= 0, "stride must be positive and padding non-negative");
      const Shape &x = in[0].shape, &dy = in[1].shape;
      c.Require(w.size() == 4 && dy[0] == x[0] && dy[1] == w[0] && x[1] == w[1] &&
                    dy[2] == WindowOut(x[2], w[2], s[0], p[0]) && dy[3] == WindowOut(x[3], w[3], s[1], p[1]),
                "filter_shape, x and dy do not describe one convolution");
      return {c.WindowDType(), w};
    }
    case OpCode::kMaxPool:
    case OpCode::kAvgPool: {
      c.RequireRank(0, 4);
      IntList k = c.Pair("window"), s = c.Pair("stride", k);
      c.Require(k[0] > 0 && k[1] > 0 && s[0] > 0 && s[1] > 0, "window and stride must be positive");
      const int64_t p = op == OpCode::kMaxPool ? MaxPoolPadding(c, k) : 0;
      const Shape& x = in[0].shape;
      int64_t oh = WindowOut(x[2], k[0], s[0], p), ow = WindowOut(x[3], k[1], s[1], p);
      c.Require(oh > 0 && ow > 0 && s[0] > 0 && s[1] > 0, "window larger than input, or bad stride");
      return {c.WindowDType(), {x[0], x[1], oh, ow}};
    }
    case OpCode::kMaxPoolGrad: {  // (x, dy) -> dx
      c.RequireRank(0, 4);
      c.RequireRank(1, 4);
      IntList k = c.Pair("window"), s = c.Pair("stride", k);
      c.Require(k[0] > 0 && k[1] > 0 && s[0] > 0 && s[1] > 0, "window and stride must be positive");
      const int64_t p = MaxPoolPadding(c, k);
      const Shape &x = in[0].shape, &dy = in[1].shape;
      c.Require(dy == Shape{x[0], x[1], WindowOut(x[2], k[0], s[0], p), WindowOut(x[3], k[1], s[1], p)},
                Str("dy ", in[1].ToString(), " does not match the pooled shape of x ", in[0].ToString()));
      return in[0];
    }
    case OpCode::kAvgPoolGrad: {  // (dy) -> dx
      c.RequireRank(0, 4);
      IntList k = c.Pair("window"), s = c.Pair("stride", k);
      c.Require(k[0] > 0 && k[1] > 0 && s[0] > 0 && s[1] > 0, "window and stride must be positive");
      Shape x = c.Ints("input_shape");
      const Shape& dy = in[0].shape;
      c.Require(x.size() == 4 && dy == Shape{x[0], x[1], WindowOut(x[2], k[0], s[0], 0), WindowOut(x[3], k[1], s[1], 0)},
                "dy does not match the pooled shape of input_shape");
      return {c.WindowDType(), x};
    }

    case OpCode::kAttention:
    case OpCode::kAttentionGrad: {  // (q, k, v[, dout]) [..., T, D] -> [..., T, D] | [3, ..., T, D]
      c.Require(in[0].rank() >= 3, Str("q must have rank >= 3 ([..., T, D]), got ", in[0].ToString()));
      c.RequireFloat(0);
      for (size_t i = 0; i < in.size(); ++i) {
        c.Require(in[i].dtype == in[0].dtype, "operand dtypes differ");
        c.Require(in[i].shape == in[0].shape,
                  Str("operand ", i, " ", in[i].ToString(), " must have q's shape ", in[0].ToString()));
      }
      c.Float("scale");
      if (op == OpCode::kAttention) return in[0];
      Shape out{3};
      out.insert(out.end(), in[0].shape.begin(), in[0].shape.end());
      return {in[0].dtype, out};
    }

    case OpCode::kRandomUniform: {  // (step s32[], first_example s32[]) {seed, shape} -> f32[shape]
      for (size_t i = 0; i < 2; ++i)
        c.Require(in[i].dtype == DType::kS32 && in[i].rank() == 0,
                  Str(i == 0 ? "step" : "first_example", " must be an s32 scalar, got ", in[i].ToString()));
      c.Int("seed");
      Shape shape = c.Ints("shape");
      for (int64_t d : shape) c.Require(d >= 0, Str("negative dimension in shape ", ShapeToString(shape)));
      return {DType::kF32, shape};
    }

    case OpCode::kOneHot: {
      c.Require(in[0].dtype == DType::kS32, "labels must be s32");
      int64_t depth = c.Int("depth");
      c.Require(depth > 0, "depth must be positive");
      Shape out = in[0].shape;
      out.push_back(depth);
      return {DType::kF32, out};
    }
    case OpCode::kGather: {  // (table [V, D...], indices s32[...]) -> [indices..., D...]
      c.Require(in[1].dtype == DType::kS32, "indices must be s32");
      c.Require(in[0].rank() >= 1, "table must have rank >= 1");
      Shape out = in[1].shape;
      out.insert(out.end(), in[0].shape.begin() + 1, in[0].shape.end());
      return {in[0].dtype, out};
    }
    case OpCode::kScatterAdd: {  // (indices s32[...], updates [indices..., D...]) {rows=V} -> [V, D...]
      c.Require(in[0].dtype == DType::kS32, "indices must be s32");
      int64_t rows = c.Int("rows");
      c.Require(rows >= 0, "rows must be non-negative");
      const Shape &idx = in[0].shape, &up = in[1].shape;
      c.Require(up.size() >= idx.size() && std::equal(idx.begin(), idx.end(), up.begin()),
                "updates must start with the indices' shape");
      Shape out{rows};
      out.insert(out.end(), up.begin() + idx.size(), up.end());
      return {in[1].dtype, out};
    }

    case OpCode::kAllReduce: {
      std::string r = c.String("reduction", "sum");
      c.Require(r == "sum" || r == "mean" || r == "max", Str("unknown reduction '", r, "'"));
      return in[0];
    }
    case OpCode::kReduceScatter: {
      std::string r = c.String("reduction", "sum");
      c.Require(r == "sum" || r == "mean", Str("unknown reduction '", r, "'"));
      int64_t g = c.Int("group_size");
      c.Require(in[0].rank() >= 1 && g > 0 && in[0].shape[0] % g == 0,
                Str("dimension 0 must be divisible by the group size ", g));
      Shape out = in[0].shape;
      out[0] /= g;
      return {in[0].dtype, out};
    }
    case OpCode::kAllGather: {
      int64_t g = c.Int("group_size");
      c.Require(in[0].rank() >= 1 && g > 0, "all_gather needs rank >= 1 and a positive group size");
      Shape out = in[0].shape;
      out[0] *= g;
      return {in[0].dtype, out};
    }
    case OpCode::kCollectivePermute: {  // the pairs are checked against the replica count by the verifier
      const int64_t d = c.Int("direction", 1);
      c.Require(d == 1 || d == -1, Str("direction must be +1 or -1, got ", d));
      return in[0];
    }
  }
  SS_CHECK(false, "unhandled op");
  return {};
}

}  // namespace shardstep::ir
