// Element types, shapes and tensor types of the IR.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardstep::ir {

// kBF16: bfloat16 (1 sign, 8 exponent, 7 mantissa bits), the upper half of an f32; computed as f32
// and rounded to nearest even (runtime/tensor.h has the conversions).
enum class DType { kF32, kS32, kBF16 };

using Shape = std::vector<int64_t>;

const char* DTypeName(DType t);          // "f32", "s32", "bf16"
// f32 or bf16: the dtypes of float arithmetic.
inline bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16; }
bool ParseDType(const std::string& s, DType* out);
int64_t DTypeBytes(DType t);
int64_t NumElements(const Shape& s);
std::string ShapeToString(const Shape& s);  // "[64,784]"

struct TensorType {
  DType dtype = DType::kF32;
  Shape shape;

  int64_t elements() const { return NumElements(shape); }
  int64_t bytes() const { return elements() * DTypeBytes(dtype); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  std::string ToString() const;  // "f32[64,784]"
  bool operator==(const TensorType& o) const { return dtype == o.dtype && shape == o.shape; }
  bool operator!=(const TensorType& o) const { return !(*this == o); }
};

}  // namespace shardstep::ir
