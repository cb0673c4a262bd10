// Element types, shapes and tensor types of the IR.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardstep::ir {

enum class DType { kF32, kS32 };

using Shape = std::vector<int64_t>;

const char* DTypeName(DType t);          // "f32", "s32"
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
