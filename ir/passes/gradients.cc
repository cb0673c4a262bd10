// Gradient rules: every op's vector-Jacobian product, one case per row of ir/ops.def (no default).
//
// Each case carries a one-line "forward / backward" comment; x, y, ... are the operands, z the output,
// dz its cotangent. Ties and kinks use one documented subgradient:
//   relu, abs: 0 at x == 0;  max / min: ties go to the first operand;
//   reduce_max: every maximum of a reduced row gets the full dz (ties are not split);
//   max_pool: max_pool_grad decides (the first maximum of a window, row-major, gets it).
#include "ir/passes/gradients.h"

#include <cmath>
#include <numeric>

#include "ir/error.h"

namespace shardstep::ir {
namespace {

// The attributes of `in` named in `keys` that are present (window / stride / padding defaults stay
// implicit so that the emitted op reads like the one it differentiates).
Attrs Pick(const Instr& in, std::initializer_list<const char*> keys) {
  Attrs out;
  for (const char* k : keys)
    if (auto it = in.attrs.find(k); it != in.attrs.end()) out.insert(*it);
  return out;
}

ValueId Zero(Builder& b, ValueId like) { return b.ScalarLike(0.0, like); }
ValueId Cmp(Builder& b, OpCode op, ValueId a, ValueId c) { return b.Binary(op, a, c); }
ValueId CmpZero(Builder& b, OpCode op, ValueId a) { return Cmp(b, op, a, Zero(b, a)); }

// The axes of a rank-`rank` shape that are not in the sorted list `axes`.
IntList OtherAxes(int64_t rank, const IntList& axes) {
  IntList out;
  for (int64_t d = 0, j = 0; d < rank; ++d) {
    if (j < static_cast<int64_t>(axes.size()) && axes[j] == d) ++j;
    else out.push_back(d);
  }
  return out;
}

// v[n, c, oh * s0 + a0, ow * s1 + a1] for oh < OH, ow < OW: one tap of every pooling window, as an
// [N, C, OH, OW] tensor. Strided access from slice + pad + reshape (slice has no stride).
ValueId WindowTap(Builder& b, ValueId v, int64_t a0, int64_t a1, const IntList& s, int64_t oh, int64_t ow) {
  const Shape x = b.shape(v);
  const int64_t n = x[0], c = x[1];
  // Rows a0, a0 + s0, ..., rounded up to whole strides (padding the tail where the input ends).
  const int64_t want0 = s[0] * oh, want1 = s[1] * ow;
  const int64_t hi0 = std::min(x[2], a0 + want0), hi1 = std::min(x[3], a1 + want1);
  ValueId t = b.Slice(v, {0, 0, a0, a1}, {n, c, hi0, hi1});
  if (s[0] == 1 && s[1] == 1) return t;
  if (hi0 - a0 < want0 || hi1 - a1 < want1) t = b.Pad(t, {0, 0, 0, 0}, {0, 0, want0 - (hi0 - a0), want1 - (hi1 - a1)});
  t = b.Reshape(t, {n, c, oh, s[0], ow, s[1]});
  t = b.Slice(t, {0, 0, 0, 0, 0, 0}, {n, c, oh, 1, ow, 1});
  return b.Reshape(t, {n, c, oh, ow});
}

}  // namespace

std::vector<ValueId> GradientRule(Builder& b, ValueId instr, ValueId dz) {
  // A copy: emitting appends to the module, which may move the instruction.
  const Instr in = b.module().at(instr);
  const std::vector<ValueId>& o = in.operands;
  const ValueId z = instr;
  std::vector<ValueId> none(o.size(), kNoValue);
  SS_CHECK(b.type(dz) == in.type, "cotangent ", b.type(dz).ToString(), " for ", OpName(in.op), " ",
           in.type.ToString());

  switch (in.op) {
    // Leaves / none.
    case OpCode::kVariable:
    case OpCode::kInput:
    case OpCode::kConstant:
    case OpCode::kReplicaId:
    case OpCode::kIota:
      return none;

    // z = -x / dx = -dz
    case OpCode::kNeg:
      return {b.Neg(dz)};
    // z = exp(x) / dx = dz * z
    case OpCode::kExp:
      return {b.Mul(dz, z)};
    // z = log(x) / dx = dz / x
    case OpCode::kLog:
      return {b.Div(dz, o[0])};
    // z = sqrt(x) / dx = dz * 0.5 / z
    case OpCode::kSqrt:
      return {b.Div(b.MulScalar(dz, 0.5), z)};
    // z = x^-1/2 / dx = dz * -0.5 * z^3
    case OpCode::kRsqrt:
      return {b.Mul(b.MulScalar(dz, -0.5), b.Mul(b.Mul(z, z), z))};
    // z = tanh(x) / dx = dz * (1 - z^2)
    case OpCode::kTanh:
      return {b.Mul(dz, b.Sub(b.ScalarLike(1.0, z), b.Mul(z, z)))};
    // z = sigmoid(x) / dx = dz * z * (1 - z)
    case OpCode::kSigmoid:
      return {b.Mul(b.Mul(dz, z), b.Sub(b.ScalarLike(1.0, z), z))};
    // z = max(x, 0) / dx = select(z > 0, dz, 0): z > 0 exactly when x > 0 (NaN: both false). From the
    // output, which the next layer reads anyway, so the forward pass need not keep a mask (as PyTorch).
    case OpCode::kRelu:
      return {b.Select(CmpZero(b, OpCode::kGt, z), dz, Zero(b, dz))};
    // z = sin(x) / dx = dz * cos(x)
    case OpCode::kSin:
      return {b.Mul(dz, b.Unary(OpCode::kCos, o[0]))};
    // z = cos(x) / dx = -dz * sin(x)
    case OpCode::kCos:
      return {b.Neg(b.Mul(dz, b.Unary(OpCode::kSin, o[0])))};
    // z = |x| / dx = select(x > 0, dz, select(x < 0, -dz, 0))
    case OpCode::kAbs:
      return {b.Select(CmpZero(b, OpCode::kGt, o[0]), dz,
                       b.Select(CmpZero(b, OpCode::kLt, o[0]), b.Neg(dz), Zero(b, dz)))};
    // z = convert(x) / dx = dz for f32 -> f32; none across dtypes (s32 carries no gradient)
    case OpCode::kConvert:
      if (b.type(o[0]).dtype == DType::kF32 && in.type.dtype == DType::kF32) return {dz};
      return none;
    // z = x / none: the point of the op
    case OpCode::kStopGradient:
      return none;

    // z = x + y / dx = dz, dy = dz
    case OpCode::kAdd:
      return {dz, dz};
    // z = x - y / dx = dz, dy = -dz
    case OpCode::kSub:
      return {dz, b.Neg(dz)};
    // z = x * y / dx = dz * y, dy = dz * x
    case OpCode::kMul:
      return {b.Mul(dz, o[1]), b.Mul(dz, o[0])};
    // z = x / y / dx = dz / y, dy = -dz * z / y
    case OpCode::kDiv:
      return {b.Div(dz, o[1]), b.Neg(b.Div(b.Mul(dz, z), o[1]))};
    // z = x^y / dx = dz * y * x^(y-1), dy = select(x > 0, dz * log(x) * z, 0)
    case OpCode::kPow: {
      ValueId xm1 = b.Binary(OpCode::kPow, o[0], b.Sub(o[1], b.ScalarLike(1.0, o[1])));
      ValueId dx = b.Mul(b.Mul(dz, o[1]), xm1);
      ValueId dy = b.Select(CmpZero(b, OpCode::kGt, o[0]), b.Mul(b.Mul(dz, b.Unary(OpCode::kLog, o[0])), z),
                            Zero(b, dz));
      return {dx, dy};
    }
    // z = max(x, y) / dx = select(x >= y, dz, 0), dy = select(x >= y, 0, dz)   (ties to x)
    case OpCode::kMax: {
      ValueId first = Cmp(b, OpCode::kGe, o[0], o[1]);
      return {b.Select(first, dz, Zero(b, dz)), b.Select(first, Zero(b, dz), dz)};
    }
    // z = min(x, y) / dx = select(x <= y, dz, 0), dy = select(x <= y, 0, dz)   (ties to x)
    case OpCode::kMin: {
      ValueId first = Cmp(b, OpCode::kLe, o[0], o[1]);
      return {b.Select(first, dz, Zero(b, dz)), b.Select(first, Zero(b, dz), dz)};
    }
    // z = (x cmp y) in {0, 1} / none (piecewise constant)
    case OpCode::kEq:
    case OpCode::kNe:
    case OpCode::kLt:
    case OpCode::kLe:
    case OpCode::kGt:
    case OpCode::kGe:
      return none;

    // z = select(c, x, y) / dc = none, dx = select(c, dz, 0), dy = select(c, 0, dz)
    case OpCode::kSelect:
      return {kNoValue, b.Select(o[0], dz, Zero(b, dz)), b.Select(o[0], Zero(b, dz), dz)};

    // z = broadcast(x){shape, dims} / dx = reduce_sum(dz, axes not in dims)
    case OpCode::kBroadcast: {
      IntList axes = OtherAxes(in.type.rank(), in.GetInts("dims"));
      return {b.ReduceSum(dz, axes)};
    }
    // z = reshape(x) / dx = reshape(dz, shape(x))
    case OpCode::kReshape:
      return {b.Reshape(dz, Shape(b.shape(o[0])))};
    // z = transpose(x, perm) / dx = transpose(dz, inverse(perm))
    case OpCode::kTranspose: {
      const IntList& perm = in.GetInts("perm");
      IntList inv(perm.size());
      for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
      return {b.Transpose(dz, inv)};
    }
    // z = slice(x, start, limit) / dx = pad(dz, low = start, high = shape(x) - limit)
    case OpCode::kSlice: {
      const IntList &start = in.GetInts("start"), &limit = in.GetInts("limit");
      const Shape x = b.shape(o[0]);  // a copy: emitting moves the module's instructions
      IntList high(x.size());
      for (size_t i = 0; i < x.size(); ++i) high[i] = x[i] - limit[i];
      return {b.Pad(dz, start, high)};
    }
    // z = pad(x, low, high) (zeros) / dx = slice(dz, low, low + shape(x))
    case OpCode::kPad: {
      const IntList& low = in.GetInts("low");
      const Shape x = b.shape(o[0]);
      IntList limit(x.size());
      for (size_t i = 0; i < x.size(); ++i) limit[i] = low[i] + x[i];
      return {b.Slice(dz, low, limit)};
    }
    // z = concat(x0, x1, ...; axis) / dxi = slice(dz) at xi's offset along axis
    case OpCode::kConcat: {
      const int64_t axis = in.GetInt("axis");
      std::vector<ValueId> out;
      int64_t offset = 0;
      for (ValueId part : o) {
        const Shape p = b.shape(part);
        IntList start(p.size(), 0), limit(in.type.shape.begin(), in.type.shape.end());
        start[axis] = offset;
        limit[axis] = offset + p[axis];
        offset += p[axis];
        out.push_back(b.Slice(dz, start, limit));
      }
      return out;
    }

    // z = reduce_sum(x, axes) / dx = broadcast(dz) over axes
    case OpCode::kReduceSum: {
      const Shape x = b.shape(o[0]);
      return {b.Broadcast(dz, x, OtherAxes(x.size(), in.GetInts("axes")))};
    }
    // z = reduce_mean(x, axes) / dx = broadcast(dz) over axes / count
    case OpCode::kReduceMean: {
      const Shape x = b.shape(o[0]);
      const IntList& axes = in.GetInts("axes");
      int64_t count = 1;
      for (int64_t a : axes) count *= x[a];
      ValueId g = b.Broadcast(dz, x, OtherAxes(x.size(), axes));
      return {count > 1 ? b.MulScalar(g, 1.0 / static_cast<double>(count)) : g};
    }
    // z = reduce_max(x, axes) / dx = select(x == broadcast(z), broadcast(dz), 0)   (every maximum gets dz)
    case OpCode::kReduceMax: {
      const Shape x = b.shape(o[0]);
      IntList kept = OtherAxes(x.size(), in.GetInts("axes"));
      ValueId mask = Cmp(b, OpCode::kEq, o[0], b.Broadcast(z, x, kept));
      ValueId g = b.Broadcast(dz, x, kept);
      return {b.Select(mask, g, Zero(b, g))};
    }

    // z = op(a) op(b) (op = optional transpose of the last two dims; leading dims are a batch of
    //   independent products, so each rule below holds per batch element) / da, db: the four combinations
    case OpCode::kMatmul: {
      const bool ta = in.GetInt("transpose_a", 0) != 0, tb = in.GetInt("transpose_b", 0) != 0;
      const ValueId a = o[0], c = o[1];
      if (!ta && !tb) return {b.Matmul(dz, c, false, true), b.Matmul(a, dz, true, false)};  // z = a c
      if (!ta && tb) return {b.Matmul(dz, c, false, false), b.Matmul(dz, a, true, false)};  // z = a c^T
      if (ta && !tb) return {b.Matmul(c, dz, false, true), b.Matmul(a, dz, false, false)};  // z = a^T c
      return {b.Matmul(c, dz, true, true), b.Matmul(dz, a, true, true)};                    // z = a^T c^T
    }
    // z = conv2d(x, w) / dx = conv2d_input_grad(dz, w), dw = conv2d_filter_grad(x, dz)
    case OpCode::kConv2d: {
      Attrs ai = Pick(in, {"stride", "padding"}), af = ai;
      ai["input_shape"] = IntList(b.shape(o[0]));
      af["filter_shape"] = IntList(b.shape(o[1]));
      return {b.Emit(OpCode::kConv2dInputGrad, {dz, o[1]}, ai), b.Emit(OpCode::kConv2dFilterGrad, {o[0], dz}, af)};
    }
    // z = conv2d_input_grad(g, w) (= conv2d's adjoint in x; bilinear)
    //   / dg = conv2d(dz, w), dw = conv2d_filter_grad(dz, g)
    case OpCode::kConv2dInputGrad: {
      Attrs ac = Pick(in, {"stride", "padding"}), af = ac;
      af["filter_shape"] = IntList(b.shape(o[1]));
      return {b.Emit(OpCode::kConv2d, {dz, o[1]}, ac), b.Emit(OpCode::kConv2dFilterGrad, {dz, o[0]}, af)};
    }
    // z = conv2d_filter_grad(x, g) (= conv2d's adjoint in w; bilinear)
    //   / dx = conv2d_input_grad(g, dz), dg = conv2d(x, dz)
    case OpCode::kConv2dFilterGrad: {
      Attrs ac = Pick(in, {"stride", "padding"}), ai = ac;
      ai["input_shape"] = IntList(b.shape(o[0]));
      return {b.Emit(OpCode::kConv2dInputGrad, {o[1], dz}, ai), b.Emit(OpCode::kConv2d, {o[0], dz}, ac)};
    }
    // z = max_pool(x) / dx = max_pool_grad(x, dz)
    case OpCode::kMaxPool:
      return {b.Emit(OpCode::kMaxPoolGrad, {o[0], dz}, Pick(in, {"window", "stride", "padding"}))};
    // z = max_pool_grad(x, g) (routes g to each window's argmax; linear in g)
    //   / dx = none (piecewise constant), dg = dz gathered at each window's argmax (first maximum,
    //   row-major), built from one strided tap per window offset and a select chain. With padding,
    //   x is padded with -inf (dz with 0) first, and a padded cell is never selected: the chain takes
    //   a tap only where x equals the window maximum and the tap is a real cell.
    case OpCode::kMaxPoolGrad: {
      const IntList k = in.GetInts("window"), s = in.GetInts("stride", k);
      const int64_t p = in.GetInt("padding", 0);
      const Shape g = b.shape(o[1]);
      const int64_t oh = g[2], ow = g[3];
      ValueId x = o[0], d = dz, real = kNoValue;
      if (p > 0) {
        const IntList lo{0, 0, p, p};
        real = b.Pad(b.ScalarLike(1.0, x), lo, lo);  // 1 on real cells, 0 on padding
        ValueId padded = b.Pad(x, lo, lo);
        x = b.Select(real, padded, b.ScalarLike(-INFINITY, padded));
        d = b.Pad(dz, lo, lo);
      }
      ValueId m = b.Emit(OpCode::kMaxPool, {x}, Pick(in, {"window", "stride"}));
      ValueId acc = kNoValue;
      for (int64_t a0 = k[0] - 1; a0 >= 0; --a0) {
        for (int64_t a1 = k[1] - 1; a1 >= 0; --a1) {
          ValueId tap = WindowTap(b, d, a0, a1, s, oh, ow);
          if (acc == kNoValue) {  // the last offset: taken when no earlier one is the maximum
            acc = p > 0 ? b.Select(WindowTap(b, real, a0, a1, s, oh, ow), tap, Zero(b, tap)) : tap;
            continue;
          }
          ValueId wins = Cmp(b, OpCode::kEq, WindowTap(b, x, a0, a1, s, oh, ow), m);
          if (p > 0) wins = b.Mul(wins, WindowTap(b, real, a0, a1, s, oh, ow));
          acc = b.Select(wins, tap, acc);
        }
      }
      return {kNoValue, acc};
    }
    // z = avg_pool(x) / dx = avg_pool_grad(dz){input_shape = shape(x)}
    case OpCode::kAvgPool: {
      Attrs a = Pick(in, {"window", "stride"});
      a["input_shape"] = IntList(b.shape(o[0]));
      return {b.Emit(OpCode::kAvgPoolGrad, {dz}, a)};
    }
    // z = avg_pool_grad(g) (avg_pool's adjoint; linear) / dg = avg_pool(dz)
    case OpCode::kAvgPoolGrad:
      return {b.Emit(OpCode::kAvgPool, {dz}, Pick(in, {"window", "stride"}))};

    // z = attention(q, k, v) / (dq, dk, dv) = attention_grad(q, k, v, dz), stacked on a new first axis
    case OpCode::kAttention: {
      const ValueId g = b.Emit(OpCode::kAttentionGrad, {o[0], o[1], o[2], dz}, Pick(in, {"scale", "causal", "bf16"}));
      const Shape x = b.shape(o[0]);
      std::vector<ValueId> parts;
      for (int64_t i = 0; i < 3; ++i) {
        IntList start(x.size() + 1, 0), limit{i + 1};
        start[0] = i;
        limit.insert(limit.end(), x.begin(), x.end());
        parts.push_back(b.Reshape(b.Slice(g, start, limit), x));
      }
      return parts;
    }
    case OpCode::kAttentionGrad:
      throw Error(Str("no gradient of attention_grad (second derivatives of attention are not supported), at %", instr));

    // z = one_hot(labels) / none (integer operand)
    case OpCode::kOneHot:
      return none;
    // z = gather(table, idx) / dtable = scatter_add(idx, dz){rows = V}, didx = none
    case OpCode::kGather:
      return {b.Emit(OpCode::kScatterAdd, {o[1], dz}, {{"rows", b.shape(o[0])[0]}}), kNoValue};
    // z = scatter_add(idx, upd){rows} / didx = none, dupd = gather(dz, idx)
    case OpCode::kScatterAdd:
      return {kNoValue, b.Emit(OpCode::kGather, {dz, o[0]})};

    // z = random_uniform(step, first_example) / none (integer operands)
    case OpCode::kRandomUniform:
      return none;

    // z = all_reduce(x){reduction, groups} (sum or mean) / dx = all_reduce(dz) with the same reduction
    //   and groups: every replica's z depends on every x of its group with weight 1 (sum) or 1/n (mean),
    //   so each x gets the sum (mean) of its group's cotangents. max has no rule (Autodiff refuses it).
    case OpCode::kAllReduce: {
      const std::string r = in.GetString("reduction", "sum");
      if (r != "sum" && r != "mean")
        throw Error(Str("autodiff: all_reduce {reduction=\"", r, "\"} (%", instr, ") has no gradient rule"));
      return {b.Emit(OpCode::kAllReduce, {dz}, Pick(in, {"reduction", "groups", "group_size"}))};
    }
    // reduce_scatter / all_gather are inserted after autodiff; Autodiff rejects them on a differentiable path.
    case OpCode::kReduceScatter:
    case OpCode::kAllGather:
    case OpCode::kCollectivePermute:
      return none;
  }
  SS_CHECK(false, "unhandled op ", OpName(in.op));
  return none;
}

}  // namespace shardstep::ir
