// Tensor storage helpers.
#include "runtime/tensor.h"

#include <cstring>

#include "ir/error.h"

namespace shardstep::runtime {

Tensor::Tensor(ir::TensorType t) : type(std::move(t)) {
  if (type.dtype == ir::DType::kF32) f32.assign(type.elements(), 0.0f);
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

void* Tensor::raw() {
  return type.dtype == ir::DType::kF32 ? static_cast<void*>(f32.data()) : static_cast<void*>(s32.data());
}
const void* Tensor::raw() const {
  return type.dtype == ir::DType::kF32 ? static_cast<const void*>(f32.data())
                                       : static_cast<const void*>(s32.data());
}

bool Tensor::operator==(const Tensor& o) const {
  return type == o.type && (bytes() == 0 || std::memcmp(raw(), o.raw(), bytes()) == 0);
}

}  // namespace shardstep::runtime
