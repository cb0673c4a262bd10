// Tensor: a dense host buffer with an IR tensor type (row-major). f32, s32 and bf16 storage, and the
// f32 <-> bf16 conversions every backend uses (round to nearest even; NaN stays NaN).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ir/types.h"

namespace shardstep::runtime {

// bf16 is the upper 16 bits of an f32. To bf16: round to nearest, ties to even (a carry out of the
// mantissa rounds up the exponent, so values beyond the largest bf16 become +-inf); a NaN keeps its
// sign and top payload bits and is made quiet, so it never rounds to inf. Subnormals round like any
// other value (bf16 has the f32 exponent range). From bf16: exact.
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToF32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// f rounded to the nearest bf16, as an f32 (the value a bf16 store keeps).
inline float RoundToBf16(float f) { return Bf16ToF32(F32ToBf16(f)); }

struct Tensor {
  ir::TensorType type;
  std::vector<float> f32;    // used when type.dtype == kF32
  std::vector<int32_t> s32;  // used when type.dtype == kS32
  std::vector<uint16_t> bf16;  // used when type.dtype == kBF16: the bits (Bf16ToF32 reads one)

  Tensor() = default;
  explicit Tensor(ir::TensorType t);  // zero-filled

  // Throw shardstep::Error when `data` does not hold exactly the shape's element count.
  static Tensor F32(ir::Shape shape, std::vector<float> data);
  static Tensor S32(ir::Shape shape, std::vector<int32_t> data);
  // A bf16 tensor holding `data` rounded to nearest even.
  static Tensor BF16(ir::Shape shape, const std::vector<float>& data);
  // The same values in `to` (f32 or bf16; a no-op copy when already `to`): widening is exact,
  // narrowing rounds to nearest even. s32 tensors are an error.
  Tensor AsFloat(ir::DType to) const;
  static Tensor Scalar(float v) { return F32({}, {v}); }

  const ir::Shape& shape() const { return type.shape; }
  ir::DType dtype() const { return type.dtype; }
  int64_t elements() const { return type.elements(); }
  int64_t bytes() const { return type.bytes(); }
  void* raw();
  const void* raw() const;
  // Value of element i as a double, whatever the dtype.
  double at(int64_t i) const {
    return type.dtype == ir::DType::kF32 ? f32[i] : type.dtype == ir::DType::kBF16 ? Bf16ToF32(bf16[i]) : s32[i];
  }
  // Values held by the storage of the tensor's dtype (== elements() for a well-formed tensor).
  size_t held() const;
  // Bitwise equality of type and contents.
  bool operator==(const Tensor& o) const;
};

}  // namespace shardstep::runtime
