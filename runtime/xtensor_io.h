// xtensor in the C++ API: zero-copy xtensor views of runtime::Tensor, and copies between tensors (or
// whole TensorMaps) and xtensor containers, so a C++ user feeds batches and reads weights as xtensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>

#include "ir/error.h"
#include "runtime/interpreter.h"
#include "runtime/tensor.h"

namespace shardstep::runtime {

// Named xtensor arrays: f32 values (outputs, logical state, f32 inputs) and s32 ones (labels, indices).
using XtensorMap = std::map<std::string, xt::xarray<float>>;
using XtensorS32Map = std::map<std::string, xt::xarray<int32_t>>;

// The element type of a dtype's storage, and back.
template <typename T>
constexpr ir::DType DTypeOf() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, int32_t>, "tensors hold float (f32) or int32_t (s32)");
  return std::is_same_v<T, float> ? ir::DType::kF32 : ir::DType::kS32;
}

inline std::vector<std::size_t> XShape(const ir::Shape& s) { return {s.begin(), s.end()}; }

namespace detail {
template <typename T, typename Tensor_>
auto* Buffer(Tensor_& t) {
  if (t.dtype() != DTypeOf<T>())
    throw Error(Str("an xtensor view of ", t.type.ToString(), " needs element type ",
                    t.dtype() == ir::DType::kF32 ? "float" : "int32_t"));
  if constexpr (std::is_same_v<T, float>) return t.f32.data();
  else return t.s32.data();
}
}  // namespace detail

// Zero-copy views of t's buffer with t's shape (row-major); writes through the non-const one change t.
// T must be t's element type (float for f32, int32_t for s32), else shardstep::Error. A view is valid
// while t is alive and not resized.
template <typename T>
auto View(Tensor& t) {
  return xt::adapt(detail::Buffer<T>(t), XShape(t.shape()));
}
template <typename T>
auto View(const Tensor& t) {
  return xt::adapt(detail::Buffer<T>(t), XShape(t.shape()));
}

// A tensor holding a copy of the expression's values: f32 for float, s32 for int32_t elements.
template <class E>
Tensor FromXtensor(const xt::xexpression<E>& e) {
  using T = typename E::value_type;
  const E& x = e.derived_cast();
  Tensor t(ir::TensorType{DTypeOf<T>(), ir::Shape(x.shape().begin(), x.shape().end())});
  View<T>(t) = x;
  return t;
}

// A copy of every tensor as float arrays; s32 tensors (the step counter, labels) are converted
// exactly, and one whose values float cannot hold exactly (|v| > 2^24) is an error naming it.
XtensorMap ToXtensor(const TensorMap& tensors);

// Back: entry `name` becomes a tensor of the dtype `like[name]` has (f32 when `like` has no such
// entry), so FromXtensor(ToXtensor(m), m) == m. Converting to s32 needs integral values in range,
// else an error naming the entry.
TensorMap FromXtensor(const XtensorMap& arrays, const TensorMap& like = {});

// Inputs from f32 and s32 arrays (e.g. images and labels); a name in both is an error.
TensorMap FromXtensor(const XtensorMap& f32, const XtensorS32Map& s32);

}  // namespace shardstep::runtime
