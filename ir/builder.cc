// Builder: type-checked instruction construction.
#include "ir/builder.h"

#include <numeric>

#include "ir/error.h"
#include "ir/shape_inference.h"

namespace shardstep::ir {

IntList AllAxes(int64_t rank) {
  IntList axes(rank);
  std::iota(axes.begin(), axes.end(), 0);
  return axes;
}

ValueId Builder::Emit(OpCode op, std::vector<ValueId> operands, Attrs attrs) {
  std::vector<TensorType> types;
  types.reserve(operands.size());
  for (ValueId o : operands) types.push_back(m_->type(o));
  Instr in;
  in.op = op;
  in.type = InferType(op, types, attrs);
  in.operands = std::move(operands);
  in.attrs = std::move(attrs);
  return m_->Append(std::move(in));
}

ValueId Builder::Variable(const std::string& name, TensorType type, const std::string& role, Attrs attrs) {
  if (m_->FindVariable(name) != kNoValue) throw Error(Str("variable @", name, " is defined twice"));
  attrs["role"] = role;
  Instr in{OpCode::kVariable, {}, InferType(OpCode::kVariable, {}, attrs, &type), std::move(attrs), name};
  return m_->Append(std::move(in));
}

ValueId Builder::Input(const std::string& name, TensorType type) {
  if (m_->FindInput(name) != kNoValue) throw Error(Str("input @", name, " is defined twice"));
  Instr in{OpCode::kInput, {}, InferType(OpCode::kInput, {}, {}, &type), {}, name};
  return m_->Append(std::move(in));
}

ValueId Builder::Constant(double value, TensorType type) {
  Attrs attrs{{"value", value}};
  Instr in{OpCode::kConstant, {}, InferType(OpCode::kConstant, {}, attrs, &type), std::move(attrs), ""};
  return m_->Append(std::move(in));
}

ValueId Builder::ScalarLike(double value, ValueId like) { return Constant(value, type(like)); }

ValueId Builder::ReplicaId() { return Emit(OpCode::kReplicaId, {}); }

ValueId Builder::Convert(ValueId a, DType to) {
  if (type(a).dtype == to) return a;
  return Emit(OpCode::kConvert, {a}, {{"dtype", std::string(DTypeName(to))}});
}

ValueId Builder::Broadcast(ValueId a, const Shape& shape, const IntList& dims) {
  if (this->shape(a) == shape) return a;
  return Emit(OpCode::kBroadcast, {a}, {{"shape", IntList(shape)}, {"dims", dims}});
}

ValueId Builder::Reshape(ValueId a, const Shape& shape) {
  if (this->shape(a) == shape) return a;
  return Emit(OpCode::kReshape, {a}, {{"shape", IntList(shape)}});
}

ValueId Builder::Transpose(ValueId a, const IntList& perm) { return Emit(OpCode::kTranspose, {a}, {{"perm", perm}}); }

ValueId Builder::Slice(ValueId a, const IntList& start, const IntList& limit) {
  return Emit(OpCode::kSlice, {a}, {{"start", start}, {"limit", limit}});
}

ValueId Builder::Pad(ValueId a, const IntList& low, const IntList& high) {
  return Emit(OpCode::kPad, {a}, {{"low", low}, {"high", high}});
}

ValueId Builder::Concat(const std::vector<ValueId>& parts, int64_t axis) {
  if (parts.size() == 1) return parts[0];
  return Emit(OpCode::kConcat, parts, {{"axis", axis}});
}

ValueId Builder::ReduceSum(ValueId a, const IntList& axes) {
  if (axes.empty()) return a;
  return Emit(OpCode::kReduceSum, {a}, {{"axes", axes}});
}
ValueId Builder::ReduceMax(ValueId a, const IntList& axes) {
  if (axes.empty()) return a;
  return Emit(OpCode::kReduceMax, {a}, {{"axes", axes}});
}
ValueId Builder::ReduceMean(ValueId a, const IntList& axes) {
  if (axes.empty()) return a;
  return Emit(OpCode::kReduceMean, {a}, {{"axes", axes}});
}
ValueId Builder::SumAll(ValueId a) { return ReduceSum(a, AllAxes(type(a).rank())); }

ValueId Builder::Matmul(ValueId a, ValueId b, bool transpose_a, bool transpose_b) {
  return Emit(OpCode::kMatmul, {a, b},
              {{"transpose_a", int64_t{transpose_a}}, {"transpose_b", int64_t{transpose_b}}});
}

ValueId Builder::Iota(TensorType type, int64_t dimension) {
  Attrs attrs{{"dimension", dimension}};
  Instr in{OpCode::kIota, {}, InferType(OpCode::kIota, {}, attrs, &type), std::move(attrs), ""};
  return m_->Append(std::move(in));
}

ValueId Builder::RandomUniform(ValueId step, ValueId first_example, const Shape& shape, uint64_t seed) {
  return Emit(OpCode::kRandomUniform, {step, first_example},
              {{"seed", static_cast<int64_t>(seed)}, {"shape", IntList(shape)}});
}

ValueId Builder::MaxPool(ValueId x, const IntList& window, const IntList& stride, int64_t padding) {
  Attrs attrs{{"window", window}};
  if (!stride.empty()) attrs["stride"] = stride;
  if (padding != 0) attrs["padding"] = padding;
  return Emit(OpCode::kMaxPool, {x}, std::move(attrs));
}

ValueId Builder::AllReduce(ValueId x, const std::string& reduction, const IntLists& groups) {
  Attrs attrs{{"reduction", reduction}};
  if (!groups.empty()) attrs["groups"] = groups;
  return Emit(OpCode::kAllReduce, {x}, std::move(attrs));
}

}  // namespace shardstep::ir
