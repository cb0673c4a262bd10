// Element types and shapes.
#include "ir/types.h"

namespace shardstep::ir {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kS32: return "s32";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

bool ParseDType(const std::string& s, DType* out) {
  if (s == "f32") { *out = DType::kF32; return true; }
  if (s == "s32") { *out = DType::kS32; return true; }
  if (s == "bf16") { *out = DType::kBF16; return true; }
  return false;
}

int64_t DTypeBytes(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kS32: return 4;
    case DType::kBF16: return 2;
  }
  return 0;
}

int64_t NumElements(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string ShapeToString(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(s[i]);
  }
  return out + "]";
}

std::string TensorType::ToString() const { return std::string(DTypeName(dtype)) + ShapeToString(shape); }

}  // namespace shardstep::ir
