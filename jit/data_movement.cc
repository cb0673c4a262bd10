// Native data movement and reductions of the CPU backend (see data_movement.h).
#include "jit/data_movement.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace shardstep::jit {

using ir::OpCode;
using ir::Shape;

namespace {
int32_t Wrap(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v)); }
template <typename T>
T MaxOf(T a, T b) { return (a > b) | (a != a) ? a : b; }
}  // namespace

Strides RowMajor(const Shape& s) {
  Strides st(s.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(s.size()) - 1; i >= 0; --i) st[i] = acc, acc *= s[i];
  return st;
}

// dst (row-major over `shape`) = src read through `ss`; elements are 4 bytes (f32 or s32).
void StridedGather(const Shape& shape, const uint32_t* src, const Strides& ss, uint32_t* dst) {
  const int64_t total = ir::NumElements(shape);
  if (total == 0) return;
  if (shape.empty()) {
    dst[0] = src[0];
    return;
  }
  const int rank = static_cast<int>(shape.size());
  const int64_t n = shape.back(), si = ss.back();
  Strides idx(rank);
  int64_t off = 0;
  for (int64_t row = 0, rows = total / n; row < rows; ++row) {
    const uint32_t* s = src + off;
    uint32_t* d = dst + row * n;
    if (si == 1) std::memcpy(d, s, n * 4);
    else if (si == 0) std::fill(d, d + n, s[0]);
    else for (int64_t k = 0; k < n; ++k) d[k] = s[k * si];
    for (int dd = rank - 2; dd >= 0; --dd) {
      off += ss[dd];
      if (++idx[dd] < shape[dd]) break;
      off -= ss[dd] * shape[dd];
      idx[dd] = 0;
    }
  }
}

// dst viewed through `ds` = src (row-major over `shape`).
void StridedScatter(const Shape& shape, const uint32_t* src, uint32_t* dst, const Strides& ds) {
  const int64_t total = ir::NumElements(shape);
  if (total == 0) return;
  if (shape.empty()) {
    dst[0] = src[0];
    return;
  }
  const int rank = static_cast<int>(shape.size());
  const int64_t n = shape.back(), di = ds.back();
  Strides idx(rank);
  int64_t off = 0;
  for (int64_t row = 0, rows = total / n; row < rows; ++row) {
    const uint32_t* s = src + row * n;
    uint32_t* d = dst + off;
    if (di == 1) std::memcpy(d, s, n * 4);
    else for (int64_t k = 0; k < n; ++k) d[k * di] = s[k];
    for (int dd = rank - 2; dd >= 0; --dd) {
      off += ds[dd];
      if (++idx[dd] < shape[dd]) break;
      off -= ds[dd] * shape[dd];
      idx[dd] = 0;
    }
  }
}

// Reduces `axes` of x (shape `shape`) into out. Max folds in increasing input index order (the
// interpreter's order). Sums accumulate in double over fixed blocks of rows, run in parallel, whose
// partial sums are then added in block order; within a row along a reduced last axis (after
// collapsing neighbouring dimensions), eight interleaved partial sums break the add-latency chain and
// vectorise. The order depends only on the shape, so
// results are deterministic (whatever the thread count), within float rounding of the
// interpreter's serial order. `acc` holds the blocks' partial sums.
template <typename T>
void Reduce(OpCode op, const Shape& shape, const ir::IntList& axes, const Shape& out_shape, const T* x, T* out,
            std::vector<double>& acc) {
  // The shape collapsed: size-1 dimensions dropped and neighbours both reduced or both kept merged
  // (the same elements in the same order), so batch norm's reduction of NCHW over (0, 2, 3) reads
  // rows of H*W contiguous elements, not rows of W.
  Strides dims(shape.size()), reduced(shape.size());
  int rank = 0;
  int64_t count = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    const bool red = std::binary_search(axes.begin(), axes.end(), static_cast<int64_t>(d));
    if (red) count *= shape[d];
    if (shape[d] == 1) continue;
    if (rank > 0 && reduced[rank - 1] == red) {
      dims[rank - 1] *= shape[d];
    } else {
      dims[rank] = shape[d];
      reduced[rank++] = red;
    }
  }
  Strides acc_strides(rank, 0);
  for (int64_t d = rank - 1, stride = 1; d >= 0; --d)
    if (!reduced[d]) acc_strides[d] = stride, stride *= dims[d];
  const int64_t nout = ir::NumElements(out_shape), total = ir::NumElements(shape);
  const int64_t n = rank == 0 ? 1 : dims[rank - 1], inner = rank == 0 ? 0 : acc_strides[rank - 1];
  const int64_t rows = n > 0 ? total / n : 0;
  // row(src offset, dst offset) for rows [begin, end), walking the output index incrementally.
  auto for_rows = [&](int64_t begin, int64_t end, auto row) {
    if (total == 0 || begin >= end) return;
    Strides idx(std::max(rank, 1));
    int64_t dst = 0;
    for (int64_t dd = rank - 2, rem = begin; dd >= 0; --dd) {
      idx[dd] = rem % dims[dd];
      rem /= dims[dd];
      dst += idx[dd] * acc_strides[dd];
    }
    for (int64_t r = begin; r < end; ++r) {
      row(r * n, dst);
      for (int dd = rank - 2; dd >= 0; --dd) {
        dst += acc_strides[dd];
        if (++idx[dd] < dims[dd]) break;
        dst -= acc_strides[dd] * dims[dd];
        idx[dd] = 0;
      }
    }
  };
  if (op == OpCode::kReduceMax) {
    T init = std::numeric_limits<T>::lowest();
    if constexpr (std::is_same_v<T, float>) init = -INFINITY;
    std::fill(out, out + nout, init);
    for_rows(0, rows, [&](int64_t src, int64_t dst) {
      for (int64_t k = 0; k < n; ++k) out[dst + k * inner] = MaxOf(out[dst + k * inner], x[src + k]);
    });
    return;
  }
  // Blocks of about 64K elements (whole rows): the partition depends on the shape only.
  const int64_t block_rows = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(n, 1));
  const int64_t blocks = std::max<int64_t>(1, (rows + block_rows - 1) / block_rows);
  acc.assign(blocks * nout, 0.0);
  auto run_block = [&](int64_t blk) {
    double* part = acc.data() + blk * nout;
    for_rows(blk * block_rows, std::min(rows, (blk + 1) * block_rows), [&](int64_t src, int64_t dst) {
      const T* xs = x + src;
      if (inner == 0) {
        double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // lane j sums elements j, j + 8, ... (a vector)
        int64_t k = 0;
        for (; k + 8 <= n; k += 8)
          for (int j = 0; j < 8; ++j) s[j] += xs[k + j];
        for (; k < n; ++k) s[0] += xs[k];
        part[dst] += ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      } else if (inner == 1) {
        double* a = part + dst;
        for (int64_t k = 0; k < n; ++k) a[k] += xs[k];
      } else {
        double* a = part + dst;
        for (int64_t k = 0; k < n; ++k) a[k * inner] += xs[k];
      }
    });
  };
  if (blocks == 1) {
    run_block(0);
  } else {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1), [&](const tbb::blocked_range<int64_t>& r) {
      for (int64_t blk = r.begin(); blk < r.end(); ++blk) run_block(blk);
    });
  }
  const bool mean = op == OpCode::kReduceMean;
  for (int64_t i = 0; i < nout; ++i) {
    double v = acc[i];
    for (int64_t blk = 1; blk < blocks; ++blk) v += acc[blk * nout + i];
    if (mean) v = count ? v / count : (std::is_same_v<T, float> ? NAN : 0.0);
    if constexpr (std::is_same_v<T, float>) out[i] = static_cast<float>(v);
    else out[i] = mean ? static_cast<int32_t>(v) : Wrap(static_cast<int64_t>(v));
  }
}

template void Reduce<float>(OpCode, const Shape&, const ir::IntList&, const Shape&, const float*, float*,
                            std::vector<double>&);
template void Reduce<int32_t>(OpCode, const Shape&, const ir::IntList&, const Shape&, const int32_t*, int32_t*,
                              std::vector<double>&);

}  // namespace shardstep::jit
