// Tensor storage helpers.
#include "runtime/tensor.h"

#include <cstring>

#include "ir/error.h"

namespace shardstep::runtime {

Tensor::Tensor(ir::TensorType t) : type(std::move(t)) {
  if (type.dtype == ir::DType::kF32) f32.assign(type.elements(), 0.0f);
  else if (type.dtype == ir::DType::kBF16) bf16.assign(type.elements(), 0);
  else s32.assign(type.elements(), 0);
}

Tensor Tensor::F32(ir::Shape shape, std::vector<float> data) {
  Tensor t;
  t.type = {ir::DType::kF32, std::move(shape)};
  // A user's mistake (the shape and the data disagree), so an error, not an abort.
  if (static_cast<int64_t>(data.size()) != t.elements())
    throw Error(Str("Tensor::F32: ", data.size(), " values for shape ", ir::ShapeToString(t.shape()), " (",
                    t.elements(), " elements)"));
  t.f32 = std::move(data);
  return t;
}

Tensor Tensor::S32(ir::Shape shape, std::vector<int32_t> data) {
  Tensor t;
  t.type = {ir::DType::kS32, std::move(shape)};
  if (static_cast<int64_t>(data.size()) != t.elements())
    throw Error(Str("Tensor::S32: ", data.size(), " values for shape ", ir::ShapeToString(t.shape()), " (",
                    t.elements(), " elements)"));
  t.s32 = std::move(data);
  return t;
}

Tensor Tensor::BF16(ir::Shape shape, const std::vector<float>& data) {
  Tensor t;
  t.type = {ir::DType::kBF16, std::move(shape)};
  if (static_cast<int64_t>(data.size()) != t.elements())
    throw Error(Str("Tensor::BF16: ", data.size(), " values for shape ", ir::ShapeToString(t.shape()), " (",
                    t.elements(), " elements)"));
  t.bf16.resize(data.size());
  for (size_t i = 0; i < data.size(); ++i) t.bf16[i] = F32ToBf16(data[i]);
  return t;
}

Tensor Tensor::AsFloat(ir::DType to) const {
  if (!ir::IsFloat(dtype()) || !ir::IsFloat(to))
    throw Error(Str("AsFloat: ", type.ToString(), " to ", ir::DTypeName(to), " (float dtypes only)"));
  if (dtype() == to) return *this;
  Tensor out(ir::TensorType{to, shape()});
  const int64_t n = elements();
  if (to == ir::DType::kF32)
    for (int64_t i = 0; i < n; ++i) out.f32[i] = Bf16ToF32(bf16[i]);
  else
    for (int64_t i = 0; i < n; ++i) out.bf16[i] = F32ToBf16(f32[i]);
  return out;
}

size_t Tensor::held() const {
  switch (type.dtype) {
    case ir::DType::kF32: return f32.size();
    case ir::DType::kS32: return s32.size();
    case ir::DType::kBF16: return bf16.size();
  }
  return 0;
}

void* Tensor::raw() {
  return const_cast<void*>(static_cast<const Tensor*>(this)->raw());
}
const void* Tensor::raw() const {
  switch (type.dtype) {
    case ir::DType::kF32: return f32.data();
    case ir::DType::kS32: return s32.data();
    case ir::DType::kBF16: return bf16.data();
  }
  return nullptr;
}

bool Tensor::operator==(const Tensor& o) const {
  return type == o.type && (bytes() == 0 || std::memcmp(raw(), o.raw(), bytes()) == 0);
}

}  // namespace shardstep::runtime
