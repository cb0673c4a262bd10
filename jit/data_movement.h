// Native data movement and reductions of the CPU backend: strided copies (broadcast, transpose,
// slice, pad, concat) and reduce_sum/max/mean in the interpreter's summation order. Moved out of
// jit/compiled_step.cc unchanged.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ir/error.h"
#include "ir/module.h"

namespace shardstep::jit {

// Per-dimension strides or indices of the native data-movement ops, on the stack: a step allocates
// nothing. Ranks above kMaxRank are an error (the IR has no limit; no model here comes close).
class Strides {
 public:
  static constexpr int kMaxRank = 8;
  Strides() = default;
  explicit Strides(size_t size, int64_t fill = 0) : n_(static_cast<int>(size)) {
    if (size > kMaxRank) throw Error(Str("rank ", size, " exceeds the CPU backend's limit of ", kMaxRank, " dimensions"));
    std::fill(v_, v_ + n_, fill);
  }
  size_t size() const { return static_cast<size_t>(n_); }
  bool empty() const { return n_ == 0; }
  int64_t& operator[](size_t i) { return v_[i]; }
  int64_t operator[](size_t i) const { return v_[i]; }
  int64_t back() const { return v_[n_ - 1]; }

 private:
  int64_t v_[kMaxRank] = {};
  int n_ = 0;
};

// Row-major strides of `s`.
Strides RowMajor(const ir::Shape& s);

// dst (row-major over `shape`) = src read through `ss`; elements are 4 bytes (f32 or s32).
void StridedGather(const ir::Shape& shape, const uint32_t* src, const Strides& ss, uint32_t* dst);
// dst viewed through `ds` = src (row-major over `shape`).
void StridedScatter(const ir::Shape& shape, const uint32_t* src, uint32_t* dst, const Strides& ds);

// Reduces `axes` of x (shape `shape`) into out (T = float or int32_t); `acc` holds partial sums.
template <typename T>
void Reduce(ir::OpCode op, const ir::Shape& shape, const ir::IntList& axes, const ir::Shape& out_shape, const T* x,
            T* out, std::vector<double>& acc);

}  // namespace shardstep::jit
