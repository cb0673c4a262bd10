#include "tpu_backend/op_cost.h"

#include <algorithm>

#include "ir/cost.h"
#include "ir/passes/elementwise_fuser.h"

namespace shardstep::tpu {
namespace {

// The fraction of an MXU's cells a K x N weight tile keeps busy.
double MxuUtilization(int64_t k, int64_t n, int dim) {
  auto fill = [dim](int64_t d) {
    if (d <= 0) return 1.0;
    const int64_t padded = (d + dim - 1) / dim * dim;
    return static_cast<double>(d) / static_cast<double>(padded);
  };
  return fill(k) * fill(n);
}

}  // namespace

FusionInfo FusionOf(const ir::Module& m) {
  FusionInfo f;
  const int n = m.size();
  f.group.assign(n, -1);
  f.materialized.assign(n, 1);
  for (ir::ValueId v = 0; v < n; ++v) f.group[v] = m.at(v).GetInt(ir::kFusionAttr, -1);
  std::vector<char> escapes(n, 0);
  for (const auto& [var, val] : m.assigns) escapes[val] = 1;
  for (const auto& [var, g] : m.gradients) escapes[g] = 1;
  for (const auto& [name, val] : m.outputs) escapes[val] = 1;
  for (ir::ValueId v = 0; v < n; ++v)
    for (ir::ValueId o : m.at(v).operands)
      if (f.group[o] < 0 || f.group[o] != f.group[v]) escapes[o] = 1;
  for (ir::ValueId v = 0; v < n; ++v) f.materialized[v] = f.group[v] < 0 || escapes[v];
  return f;
}

OpCost CostOfOp(const ir::Module& m, ir::ValueId v, const HardwareTable& hw, Precision precision,
                const FusionInfo* fusion) {
  using ir::OpCode;
  const ir::Instr& in = m.at(v);
  OpCost c;
  if (ir::HasProperty(in.op, ir::kLeaf) || ir::HasProperty(in.op, ir::kCollective) || in.op == OpCode::kReshape)
    return c;
  c.flops = ir::InstrFlops(m, v);
  const bool attention = in.op == OpCode::kAttention || in.op == OpCode::kAttentionGrad;
  const bool mxu = in.op == OpCode::kMatmul || in.op == OpCode::kConv2d || in.op == OpCode::kConv2dInputGrad ||
                   in.op == OpCode::kConv2dFilterGrad || attention;
  c.matrix_unit = mxu;
  const int64_t input_bytes_per_element = mxu && precision == Precision::kBf16 ? 2 : 4;
  const int64_t group = fusion ? fusion->group[v] : -1;
  if (!fusion || fusion->materialized[v]) c.hbm_bytes += in.type.bytes();
  switch (in.op) {
    case OpCode::kTranspose:
    case OpCode::kSlice:
    case OpCode::kPad:
    case OpCode::kConcat:
    case OpCode::kGather:
    case OpCode::kOneHot:
    case OpCode::kIota:
      c.hbm_bytes += in.type.bytes();  // reads what the result holds
      break;
    default:
      for (ir::ValueId o : in.operands) {
        const ir::Instr& op = m.at(o);
        if (op.op == OpCode::kConstant || (group >= 0 && fusion->group[o] == group)) continue;
        c.hbm_bytes += mxu ? op.type.elements() * input_bytes_per_element : op.type.bytes();
      }
  }
  double rate = hw.VectorFlopsPerCore();
  if (mxu) {
    rate = precision == Precision::kBf16 ? hw.PeakFlopsPerCore() : hw.PeakF32FlopsPerCore();
    int64_t k = 0, n = 0;
    if (attention) {  // its products: [T, D] x [D, T] and [T, T] x [T, D] per head; the narrower counts
      const ir::Shape& q = m.type(in.operands[0]).shape;
      k = q.back(), n = q.back();
    } else if (in.op == OpCode::kMatmul) {
      const ir::Shape& a = m.type(in.operands[0]).shape;
      const size_t r = a.size();
      k = in.GetInt("transpose_a", 0) ? a[r - 2] : a[r - 1];
      n = in.type.shape.empty() ? 1 : in.type.shape.back();
    } else {
      // OIHW filter: the contraction of the im2col form (Cin·kh·kw) x output channels, for all three.
      const ir::Shape& w = in.op == OpCode::kConv2dFilterGrad ? in.type.shape : m.type(in.operands[1]).shape;
      k = w[1] * w[2] * w[3], n = w[0];
    }
    rate *= MxuUtilization(k, n, hw.mxu_dim);
  }
  c.seconds =
      std::max(static_cast<double>(c.flops) / rate, static_cast<double>(c.hbm_bytes) / hw.HbmBytesPerSPerCore());
  return c;
}

}  // namespace shardstep::tpu
