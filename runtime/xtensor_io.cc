// Copies between TensorMaps and maps of xtensor arrays.
#include "runtime/xtensor_io.h"

#include <cmath>

namespace shardstep::runtime {

namespace {

constexpr float kExactInFloat = 16777216.0f;  // 2^24: every integer up to it is a float

}  // namespace

XtensorMap ToXtensor(const TensorMap& tensors) {
  XtensorMap out;
  for (const auto& [name, t] : tensors) {
    if (t.dtype() == ir::DType::kF32) {
      out[name] = View<float>(t);
      continue;
    }
    const auto v = View<int32_t>(t);
    if (xt::any(xt::abs(xt::cast<double>(v)) > kExactInFloat))
      throw Error(Str("@", name, ": ", t.type.ToString(), " holds integers beyond 2^24 that float cannot hold exactly"));
    out[name] = xt::cast<float>(v);
  }
  return out;
}

TensorMap FromXtensor(const XtensorMap& arrays, const TensorMap& like) {
  TensorMap out;
  for (const auto& [name, a] : arrays) {
    auto it = like.find(name);
    if (it == like.end() || it->second.dtype() == ir::DType::kF32) {
      out[name] = FromXtensor(a);
      continue;
    }
    const bool integral = xt::all(xt::equal(xt::trunc(a), a) && xt::abs(a) <= 2147483647.0f);
    if (!integral) throw Error(Str("@", name, ": s32 values must be integers in range"));
    out[name] = FromXtensor(xt::xarray<int32_t>(xt::cast<int32_t>(a)));
  }
  return out;
}

TensorMap FromXtensor(const XtensorMap& f32, const XtensorS32Map& s32) {
  TensorMap out;
  for (const auto& [name, a] : f32) out[name] = FromXtensor(a);
  for (const auto& [name, a] : s32) {
    if (out.count(name)) throw Error(Str("input @", name, " given both as f32 and as s32"));
    out[name] = FromXtensor(a);
  }
  return out;
}

}  // namespace shardstep::runtime
