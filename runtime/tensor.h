// Tensor: a dense host buffer with an IR tensor type (row-major). f32 and s32 storage.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ir/types.h"

namespace shardstep::runtime {

struct Tensor {
  ir::TensorType type;
  std::vector<float> f32;    // used when type.dtype == kF32
  std::vector<int32_t> s32;  // used when type.dtype == kS32

  Tensor() = default;
  explicit Tensor(ir::TensorType t);  // zero-filled

  // Throw shardstep::Error when `data` does not hold exactly the shape's element count.
  static Tensor F32(ir::Shape shape, std::vector<float> data);
  static Tensor S32(ir::Shape shape, std::vector<int32_t> data);
  static Tensor Scalar(float v) { return F32({}, {v}); }

  const ir::Shape& shape() const { return type.shape; }
  ir::DType dtype() const { return type.dtype; }
  int64_t elements() const { return type.elements(); }
  int64_t bytes() const { return type.bytes(); }
  void* raw();
  const void* raw() const;
  // Value of element i as a double, whatever the dtype.
  double at(int64_t i) const { return type.dtype == ir::DType::kF32 ? f32[i] : s32[i]; }
  // Bitwise equality of type and contents.
  bool operator==(const Tensor& o) const;
};

}  // namespace shardstep::runtime
