// Native CPU lowerings of the ops that once ran on the interpreter's kernels (avg pooling,
// scatter-add, s32 division) and of batched matmul and iota. Each follows the interpreter's
// semantics and summation order (runtime/interpreter.cc) and allocates nothing.
#pragma once

#include <cstdint>

#include "ir/module.h"
#include "jit/pool_window.h"

namespace shardstep::jit {

// out[b] = op(a[b]) op(c[b]) for every batch element b of a rank >= 3 matmul `in` (a, c: its operands'
// shapes), each through ParallelSgemm.
void BatchedMatmul(const ir::Instr& in, const ir::Shape& a, const ir::Shape& c, const float* av, const float* cv,
                   float* out);

// Each element's index along `dimension` of `type`.
void Iota(const ir::TensorType& type, int64_t dimension, void* out);

// out[idx[i], ...] += updates[i, ...] for increasing i (out zeroed first); T = float or int32_t (wrapping).
// Throws shardstep::Error for an index outside [0, rows).
template <typename T>
void ScatterAdd(const int32_t* idx, int64_t count, const T* updates, int64_t rows, int64_t width, T* out);

// avg_pool: each window's sum in double in row-major order, divided by its area in double.
void AvgPool(const runtime::PoolWindow& g, const float* x, float* y);
// avg_pool_grad: each dx element sums dy / area (in double) over the windows covering it, in the
// interpreter's order (by window tap, row-major), without a scratch buffer.
void AvgPoolGrad(const runtime::PoolWindow& g, const float* dy, float* dx);

// s32 division truncating toward zero and wrapping (INT_MIN / -1 = INT_MIN); a zero divisor throws.
void DivS32(const int32_t* a, const int32_t* b, int64_t n, int32_t* out);

}  // namespace shardstep::jit
