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

// dst[cols, rows] = src[rows, cols]^T (4-byte elements moved bit for bit), in 16 x 16 tiles, their whole
// 8 x 8 blocks in AVX registers where the CPU has AVX2 (TurnedSgemmNT's two transposes were 2.8% of the
// CPU time of an N = 8 MLP step as scalar copies).
void TransposeMatrix(const uint32_t* src, int64_t rows, int64_t cols, uint32_t* dst);
void TransposeMatrix(const float* src, int64_t rows, int64_t cols, float* dst);
// A transpose that swaps two groups of trailing dimensions, perm = [0 .. b-1, j .. r-1, b .. j-1]: a batch
// of matrix transposes (NCHW <-> NHWC at the channels-last region's edges; a 2-D transpose). Returns
// false, doing nothing, for another perm or when a side of the matrices is under 8.
bool BatchedTranspose(const ir::Shape& shape, const ir::IntList& perm, const uint32_t* src, uint32_t* dst);

// n images of c channels and p pixels, NCHW -> NHWC and back (the channels-last convolutions' rare
// exact calls, bench/conv).
void NchwToNhwc(const float* x, int64_t n, int64_t c, int64_t p, float* y);
void NhwcToNchw(const float* x, int64_t n, int64_t c, int64_t p, float* y);

// dst (row-major over `shape`) = src read through `ss`; elements are 4 bytes (f32 or s32).
void StridedGather(const ir::Shape& shape, const uint32_t* src, const Strides& ss, uint32_t* dst);
// The same for 2-byte elements (bf16): a transpose of values already rounded (RoundInProducers).
void StridedGather16(const ir::Shape& shape, const uint16_t* src, const Strides& ss, uint16_t* dst);
// The same from f32 to bf16, each element rounded to nearest even (runtime::F32ToBf16's bits): a
// transpose that also rounds a bf16 matmul's operand (step_rewrites.h RoundInTransposes).
void StridedGatherToBf16(const ir::Shape& shape, const float* src, const Strides& ss, uint16_t* dst);
// dst viewed through `ds` = src (row-major over `shape`).
void StridedScatter(const ir::Shape& shape, const uint32_t* src, uint32_t* dst, const Strides& ds);

// A reduction's iteration space, collapsed (size-1 dimensions dropped, neighbouring dimensions both
// reduced or both kept merged): `rows` rows of `n` contiguous elements (the last collapsed dimension,
// reduced when inner == 0, else kept with output stride `inner`), summed in `blocks` blocks of
// `block_rows` rows (about 64K elements: the partition depends on the shape only).
struct ReduceLayout {
  int rank = 0;
  Strides dims, acc_strides;  // collapsed sizes; output strides of the kept ones (0: reduced)
  int64_t count = 1;          // elements summed into each output (a mean divides by it)
  int64_t nout = 0, total = 0, n = 1, inner = 0, rows = 0, block_rows = 1, blocks = 1;
};
ReduceLayout LayoutOf(const ir::Shape& shape, const ir::IntList& axes, const ir::Shape& out_shape);
// Whether Reduce (and FusedSums) sum layout l as columns down rows: rows of n elements, every row's
// element i into output i, each output in f64 from +0 down a block's rows in row order, the blocks'
// sums then added in block order (one chain per block: n is not 16 or 32). A producer that has the
// rows in that order can make the same bits (jit/attention.h AttentionGradParts).
bool ColumnSumsDownRows(const ReduceLayout& l);

// Reduces `axes` of x (shape `shape`) into out (T = float or int32_t); `acc` holds partial sums.
template <typename T>
void Reduce(ir::OpCode op, const ir::Shape& shape, const ir::IntList& axes, const ir::Shape& out_shape, const T* x,
            T* out, std::vector<double>& acc);

// Makes elements [e0, e1) of a fused reduction's operands (called from several threads at once, for
// disjoint ranges) and returns per operand a pointer p with element e at p[e - e0]. A function
// reference: no allocation per call.
class WindowProducer {
 public:
  template <typename F>
  WindowProducer(F& f)  // NOLINT: implicit, from a callable that outlives the call
      : obj_(&f), call_([](void* o, int64_t e0, int64_t e1) { return (*static_cast<F*>(o))(e0, e1); }) {}
  const float* const* operator()(int64_t e0, int64_t e1) const { return call_(obj_, e0, e1); }

 private:
  void* obj_;
  const float* const* (*call_)(void*, int64_t, int64_t);
};

// `count` (<= 8) f32 sums or means over one layout whose operands are produced `window` elements at a
// time (jit/compiled_step.cc: a fused loop writing a small per-thread buffer instead of memory): the
// bits of Reduce's, since every sum adds the same terms in the same order. out[j]: nout elements.
void FusedSums(const ReduceLayout& l, int count, const bool* mean, float* const* out, int64_t window,
               WindowProducer produce, std::vector<double>& acc);

}  // namespace shardstep::jit
