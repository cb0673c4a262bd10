// Builder: appends type-checked instructions to a module. Used by the DSL and by every pass.
#pragma once

#include <string>
#include <vector>

#include "ir/module.h"

namespace shardstep::ir {

class Builder {
 public:
  explicit Builder(Module* module) : m_(module) {}
  Module& module() { return *m_; }
  const TensorType& type(ValueId v) const { return m_->type(v); }
  const Shape& shape(ValueId v) const { return m_->type(v).shape; }

  // Generic: infers the result type (throws shardstep::Error on a shape error).
  ValueId Emit(OpCode op, std::vector<ValueId> operands, Attrs attrs = {});

  // Leaves.
  ValueId Variable(const std::string& name, TensorType type, const std::string& role, Attrs attrs = {});
  ValueId Input(const std::string& name, TensorType type);
  ValueId Constant(double value, TensorType type);  // splat
  ValueId Scalar(double value, DType dtype = DType::kF32) { return Constant(value, {dtype, {}}); }
  ValueId ScalarLike(double value, ValueId like);  // splat of `value` with like's type
  ValueId ReplicaId();

  // Elementwise.
  ValueId Unary(OpCode op, ValueId a) { return Emit(op, {a}); }
  ValueId Binary(OpCode op, ValueId a, ValueId b) { return Emit(op, {a, b}); }
  ValueId Add(ValueId a, ValueId b) { return Binary(OpCode::kAdd, a, b); }
  ValueId Sub(ValueId a, ValueId b) { return Binary(OpCode::kSub, a, b); }
  ValueId Mul(ValueId a, ValueId b) { return Binary(OpCode::kMul, a, b); }
  ValueId Div(ValueId a, ValueId b) { return Binary(OpCode::kDiv, a, b); }
  ValueId Neg(ValueId a) { return Unary(OpCode::kNeg, a); }
  ValueId Select(ValueId c, ValueId t, ValueId f) { return Emit(OpCode::kSelect, {c, t, f}); }
  ValueId Convert(ValueId a, DType to);
  // a (op) scalar constant, broadcast to a's shape.
  ValueId AddScalar(ValueId a, double c) { return Add(a, ScalarLike(c, a)); }
  ValueId MulScalar(ValueId a, double c) { return Mul(a, ScalarLike(c, a)); }

  // Shapes.
  ValueId Broadcast(ValueId a, const Shape& shape, const IntList& dims);
  ValueId BroadcastScalar(ValueId scalar, const Shape& shape) { return Broadcast(scalar, shape, {}); }
  ValueId BroadcastTo(ValueId a, ValueId like) { return BroadcastScalar(a, shape(like)); }  // a is a scalar
  ValueId Reshape(ValueId a, const Shape& shape);
  ValueId Transpose(ValueId a, const IntList& perm);
  ValueId Slice(ValueId a, const IntList& start, const IntList& limit);
  ValueId Pad(ValueId a, const IntList& low, const IntList& high);
  ValueId Concat(const std::vector<ValueId>& parts, int64_t axis);

  // Reductions.
  ValueId ReduceSum(ValueId a, const IntList& axes);
  ValueId ReduceMax(ValueId a, const IntList& axes);
  ValueId ReduceMean(ValueId a, const IntList& axes);
  ValueId SumAll(ValueId a);  // to a scalar

  // Rank >= 2, equal leading (batch) dimensions; the transposes act on the last two dimensions.
  ValueId Matmul(ValueId a, ValueId b, bool transpose_a = false, bool transpose_b = false);

  // Each element's index along `dimension`, as `type` (f32 or s32).
  ValueId Iota(TensorType type, int64_t dimension);
  // Uniform [0, 1) from Philox4x32-10 (ir/ops.def): dimension 0 of `shape` counts examples from
  // `first_example`, so an example's values do not depend on how the batch is split.
  ValueId RandomUniform(ValueId step, ValueId first_example, const Shape& shape, uint64_t seed);
  // NCHW max pooling; stride defaults to the window; padded cells never win.
  ValueId MaxPool(ValueId x, const IntList& window, const IntList& stride = {}, int64_t padding = 0);
  // reduction "sum", "mean" or "max" over replica groups (empty: all replicas).
  ValueId AllReduce(ValueId x, const std::string& reduction, const IntLists& groups = {});

 private:
  Module* m_;
};

IntList AllAxes(int64_t rank);

}  // namespace shardstep::ir
