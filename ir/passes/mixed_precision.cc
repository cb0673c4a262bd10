// MixedPrecision: bf16-rounded operands for matmuls and convolutions, f32 accumulation.
#include "ir/passes/mixed_precision.h"

#include <map>

#include "ir/builder.h"
#include "ir/error.h"

namespace shardstep::ir {

bool ParsePrecision(const std::string& value, const std::string& flag) {
  if (value == "f32") return false;
  if (value == "bf16") return true;
  throw Error(Str(flag, " must be f32 or bf16, got '", value, "'"));
}

namespace {

bool IsContraction(OpCode op) {
  return op == OpCode::kMatmul || op == OpCode::kConv2d || op == OpCode::kConv2dInputGrad ||
         op == OpCode::kConv2dFilterGrad || op == OpCode::kAttention || op == OpCode::kAttentionGrad;
}

// v = convert(convert(x, bf16), f32): already a bf16 value.
bool IsRounded(const Module& m, ValueId v) {
  const Instr& in = m.at(v);
  if (in.op != OpCode::kConvert || in.type.dtype != DType::kF32) return false;
  return m.type(in.operands[0]).dtype == DType::kBF16;
}

}  // namespace

bool MixedPrecision::Run(Module& m) {
  Builder b(&m);
  std::map<ValueId, ValueId> rounded;  // f32 value -> its bf16-rounded copy
  bool changed = false;
  const int n = m.size();
  for (ValueId v = 0; v < n; ++v) {
    if (!IsContraction(m.at(v).op)) continue;
    // Attention's products inside the op (probabilities and the scores' gradient) round too.
    if ((m.at(v).op == OpCode::kAttention || m.at(v).op == OpCode::kAttentionGrad) && m.at(v).GetInt("bf16", 0) == 0) {
      m.at(v).attrs["bf16"] = int64_t{1};
      changed = true;
    }
    for (size_t i = 0; i < m.at(v).operands.size(); ++i) {
      const ValueId x = m.at(v).operands[i];
      if (m.type(x).dtype != DType::kF32 || IsRounded(m, x)) continue;
      auto it = rounded.find(x);
      if (it == rounded.end()) it = rounded.emplace(x, b.Convert(b.Convert(x, DType::kBF16), DType::kF32)).first;
      m.at(v).operands[i] = it->second;  // m.at(v) re-read: the appends may have moved the instructions
      changed = true;
    }
  }
  if (changed) m.Canonicalize();
  return changed;
}

}  // namespace shardstep::ir
