// Native data movement and reductions of the CPU backend (see data_movement.h).
#include "jit/data_movement.h"

#include "runtime/tensor.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <immintrin.h>

#include <algorithm>
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

namespace {

// Copies of at least this many elements are split into blocks of whole rows of about this size (the
// partition depends on the shape only), run as TBB tasks: a transpose of attention's heads (2 MB) ran
// on one core while the other waited.
constexpr int64_t kCopyBlock = int64_t{1} << 15;

// fn(first_row, end_row, offset of first_row through `strides`) over the rows of `shape` (its last
// dimension is a row), in parallel blocks for large shapes.
template <typename Fn>
void ForRowBlocks(const Shape& shape, const Strides& strides, Fn fn) {
  const int rank = static_cast<int>(shape.size());
  const int64_t n = shape.back(), rows = ir::NumElements(shape) / n;
  auto offset_of = [&](int64_t row) {
    int64_t off = 0;
    for (int dd = rank - 2; dd >= 0; --dd) {
      off += (row % shape[dd]) * strides[dd];
      row /= shape[dd];
    }
    return off;
  };
  const int64_t block_rows = std::max<int64_t>(1, kCopyBlock / std::max<int64_t>(n, 1));
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
  if (blocks <= 1) return fn(int64_t{0}, rows, int64_t{0});
  tbb::parallel_for(int64_t{0}, blocks, [&](int64_t b) {
    const int64_t r0 = b * block_rows;
    fn(r0, std::min(rows, r0 + block_rows), offset_of(r0));
  });
}

// Advances idx (the index of a row, over shape's leading dimensions) to the next row, and off with it.
inline void NextRow(const Shape& shape, const Strides& strides, Strides& idx, int64_t& off) {
  for (int dd = static_cast<int>(shape.size()) - 2; dd >= 0; --dd) {
    off += strides[dd];
    if (++idx[dd] < shape[dd]) break;
    off -= strides[dd] * shape[dd];
    idx[dd] = 0;
  }
}

// The index of row `row` over shape's leading dimensions.
Strides RowIndex(const Shape& shape, int64_t row) {
  Strides idx(shape.size());
  for (int dd = static_cast<int>(shape.size()) - 2; dd >= 0; --dd) {
    idx[dd] = row % shape[dd];
    row /= shape[dd];
  }
  return idx;
}

// fn(row, count, off, step) over rows [r0, r1) (off: row r0's offset through `strides`) in runs along
// the second-to-last dimension: the run's rows are at off, off + step, ... A row of attention's heads
// is 32 elements; a call and an index update per row cost more than its copy.
template <typename Fn>
void ForRowRuns(const Shape& shape, const Strides& strides, int64_t r0, int64_t r1, int64_t off, Fn fn) {
  const int rank = static_cast<int>(shape.size());
  if (rank < 2) return fn(r0, r1 - r0, off, int64_t{0});
  Strides idx = RowIndex(shape, r0);
  const int64_t len = shape[rank - 2], step = strides[rank - 2];
  for (int64_t row = r0; row < r1;) {
    const int64_t count = std::min(r1 - row, len - idx[rank - 2]);
    fn(row, count, off, step);
    row += count;
    off += (count - 1) * step;
    idx[rank - 2] += count - 1;
    NextRow(shape, strides, idx, off);
  }
}

// rows x n elements: row r from s + r * s_step to d + r * d_step (contiguous rows); short rows
// inline, long ones by memcpy. Compiled for AVX-512 too, picked once by the CPU.
template <typename = void>
[[gnu::always_inline]] inline void CopyRowsBody(const uint32_t* s, int64_t s_step, int64_t n, int64_t rows, uint32_t* d,
                                                int64_t d_step) {
  for (int64_t r = 0; r < rows; ++r, s += s_step, d += d_step) {
    if (n >= 256) {
      std::memcpy(d, s, n * 4);
      continue;
    }
    for (int64_t k = 0; k < n; ++k) d[k] = s[k];
  }
}
__attribute__((target("avx512f"))) void CopyRowsAvx512(const uint32_t* s, int64_t s_step, int64_t n, int64_t rows,
                                                       uint32_t* d, int64_t d_step) {
  CopyRowsBody(s, s_step, n, rows, d, d_step);
}
void CopyRowsBase(const uint32_t* s, int64_t s_step, int64_t n, int64_t rows, uint32_t* d, int64_t d_step) {
  CopyRowsBody(s, s_step, n, rows, d, d_step);
}
void CopyRows(const uint32_t* s, int64_t s_step, int64_t n, int64_t rows, uint32_t* d, int64_t d_step) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  avx512 ? CopyRowsAvx512(s, s_step, n, rows, d, d_step) : CopyRowsBase(s, s_step, n, rows, d, d_step);
}

}  // namespace

namespace {
// An 8 x 8 tile in AVX registers: rows src + i * ld_src (i < 8) to rows dst + j * ld_dst. Pairs of rows
// interleaved, then pairs of pairs, then the 128-bit halves exchanged (the usual three stages). Shuffles
// only: every bit pattern (a NaN's payload included) is moved as it is.
__attribute__((target("avx2"))) void Transpose8x8(const float* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ld_dst, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ld_dst, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
  }
}
}  // namespace

void TransposeMatrix(const uint32_t* src, int64_t rows, int64_t cols, uint32_t* dst) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  constexpr int64_t kTile = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kTile)
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t i1 = std::min(rows, i0 + kTile), j1 = std::min(cols, j0 + kTile);
      int64_t i8 = i0, j8 = j0;  // the part done by 8 x 8 blocks: [i0, i8) x [j0, j8)
      if (avx2) {
        i8 = i0 + (i1 - i0) / 8 * 8, j8 = j0 + (j1 - j0) / 8 * 8;
        for (int64_t i = i0; i < i8; i += 8)
          for (int64_t j = j0; j < j8; j += 8)
            Transpose8x8(reinterpret_cast<const float*>(src + i * cols + j), cols,
                         reinterpret_cast<float*>(dst + j * rows + i), rows);
      }
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = i < i8 ? j8 : j0; j < j1; ++j) dst[j * rows + i] = src[i * cols + j];
    }
}
void TransposeMatrix(const float* src, int64_t rows, int64_t cols, float* dst) {
  TransposeMatrix(reinterpret_cast<const uint32_t*>(src), rows, cols, reinterpret_cast<uint32_t*>(dst));
}

bool BatchedTranspose(const Shape& shape, const ir::IntList& perm, const uint32_t* src, uint32_t* dst) {
  const int r = static_cast<int>(perm.size());
  int b = 0;  // leading dimensions kept in place
  while (b < r && perm[b] == b) ++b;
  if (b == r) return false;
  const int64_t j = perm[b];  // perm = [0 .. b-1, j .. r-1, b .. j-1]
  for (int i = b; i < r; ++i)
    if (perm[i] != (i - b < r - j ? j + (i - b) : b + (i - b) - (r - j))) return false;
  int64_t batch = 1, rows = 1, cols = 1;
  for (int d = 0; d < b; ++d) batch *= shape[d];
  for (int64_t d = b; d < j; ++d) rows *= shape[d];
  for (int64_t d = j; d < r; ++d) cols *= shape[d];
  if (rows < 8 || cols < 8) return false;  // a vector of runs: StridedGather's copies do as well
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (rows * cols));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, batch, grain), [&](const tbb::blocked_range<int64_t>& range) {
    for (int64_t i = range.begin(); i < range.end(); ++i)
      TransposeMatrix(src + i * rows * cols, rows, cols, dst + i * rows * cols);
  });
  return true;
}

void NchwToNhwc(const float* x, int64_t n, int64_t c, int64_t p, float* y) {
  for (int64_t i = 0; i < n; ++i) TransposeMatrix(x + i * c * p, c, p, y + i * c * p);
}
void NhwcToNchw(const float* x, int64_t n, int64_t c, int64_t p, float* y) {
  for (int64_t i = 0; i < n; ++i) TransposeMatrix(x + i * c * p, p, c, y + i * c * p);
}

namespace {
// dst (row-major over `shape`) = src read through `ss`, rows of the last dimension in runs:
// copy_rows(s, si, step, n, rows, d) writes rows x n elements, row r's s[r * step + k * si] to
// d[r * n + k] (a scalar is one row of one).
template <typename S, typename D, typename Copy>
void GatherRows(const Shape& shape, const S* src, const Strides& ss, D* dst, Copy copy_rows) {
  if (ir::NumElements(shape) == 0) return;
  if (shape.empty()) return copy_rows(src, int64_t{1}, int64_t{0}, int64_t{1}, int64_t{1}, dst);
  const int64_t n = shape.back(), si = ss.back();
  ForRowBlocks(shape, ss, [&](int64_t r0, int64_t r1, int64_t off) {
    ForRowRuns(shape, ss, r0, r1, off, [&](int64_t row, int64_t count, int64_t at, int64_t step) {
      copy_rows(src + at, si, step, n, count, dst + row * n);
    });
  });
}

// runtime::F32ToBf16 without its branch (NaN quieted by a select), so the contiguous case vectorises.
template <typename = void>
[[gnu::always_inline]] inline void RoundRowBody(const float* s, int64_t n, uint16_t* d) {
  for (int64_t k = 0; k < n; ++k) {
    uint32_t u;
    std::memcpy(&u, s + k, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x0040u;
    d[k] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}
// rows x n: row r of s (at r * step) rounded to d + r * n.
__attribute__((target("avx512f,avx512bw"))) void RoundRowsAvx512(const float* s, int64_t step, int64_t n,
                                                                 int64_t rows, uint16_t* d) {
  for (int64_t r = 0; r < rows; ++r) RoundRowBody(s + r * step, n, d + r * n);
}
void RoundRowsBase(const float* s, int64_t step, int64_t n, int64_t rows, uint16_t* d) {
  for (int64_t r = 0; r < rows; ++r) RoundRowBody(s + r * step, n, d + r * n);
}
void RoundRows(const float* s, int64_t step, int64_t n, int64_t rows, uint16_t* d) {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  avx512 ? RoundRowsAvx512(s, step, n, rows, d) : RoundRowsBase(s, step, n, rows, d);
}
}  // namespace

// Elements are 4 bytes (f32 or s32).
void StridedGather(const Shape& shape, const uint32_t* src, const Strides& ss, uint32_t* dst) {
  GatherRows(shape, src, ss, dst, [](const uint32_t* s, int64_t si, int64_t step, int64_t n, int64_t rows, uint32_t* d) {
    if (si == 1) return CopyRows(s, step, n, rows, d, n);
    for (int64_t r = 0; r < rows; ++r, s += step, d += n) {
      if (si == 0) std::fill(d, d + n, s[0]);
      else for (int64_t k = 0; k < n; ++k) d[k] = s[k * si];
    }
  });
}

// Elements of 2 bytes (bf16): rows of contiguous runs are memcpy'd (the heads' rows of 32 bf16).
void StridedGather16(const Shape& shape, const uint16_t* src, const Strides& ss, uint16_t* dst) {
  GatherRows(shape, src, ss, dst, [](const uint16_t* s, int64_t si, int64_t step, int64_t n, int64_t rows, uint16_t* d) {
    for (int64_t r = 0; r < rows; ++r, s += step, d += n) {
      if (si == 1) std::memcpy(d, s, static_cast<size_t>(n) * sizeof(uint16_t));
      else if (si == 0) std::fill(d, d + n, s[0]);
      else for (int64_t k = 0; k < n; ++k) d[k] = s[k * si];
    }
  });
}

void StridedGatherToBf16(const Shape& shape, const float* src, const Strides& ss, uint16_t* dst) {
  GatherRows(shape, src, ss, dst, [](const float* s, int64_t si, int64_t step, int64_t n, int64_t rows, uint16_t* d) {
    if (si == 1) return RoundRows(s, step, n, rows, d);
    for (int64_t r = 0; r < rows; ++r, s += step, d += n)
      for (int64_t k = 0; k < n; ++k) d[k] = runtime::F32ToBf16(s[k * si]);
  });
}

// dst viewed through `ds` = src (row-major over `shape`).
void StridedScatter(const Shape& shape, const uint32_t* src, uint32_t* dst, const Strides& ds) {
  const int64_t total = ir::NumElements(shape);
  if (total == 0) return;
  if (shape.empty()) {
    dst[0] = src[0];
    return;
  }
  const int64_t n = shape.back(), di = ds.back();
  ForRowBlocks(shape, ds, [&](int64_t r0, int64_t r1, int64_t off) {
    ForRowRuns(shape, ds, r0, r1, off, [&](int64_t row, int64_t count, int64_t at, int64_t step) {
      const uint32_t* s = src + row * n;
      uint32_t* d = dst + at;
      if (di == 1) return CopyRows(s, n, n, count, d, step);
      for (int64_t r = 0; r < count; ++r, s += n, d += step)
        for (int64_t k = 0; k < n; ++k) d[k * di] = s[k];
    });
  });
}

// Reduced last rows longer than kLongRow are cut into segments of at most kRowSegment (see LayoutOf).
constexpr int64_t kLongRow = int64_t{1} << 16, kRowSegment = int64_t{1} << 14;

ReduceLayout LayoutOf(const Shape& shape, const ir::IntList& axes, const Shape& out_shape) {
  // The shape collapsed: size-1 dimensions dropped and neighbours both reduced or both kept merged
  // (the same elements in the same order), so batch norm's reduction of NCHW over (0, 2, 3) reads
  // rows of H*W contiguous elements, not rows of W.
  ReduceLayout l;
  l.dims = Strides(shape.size());
  Strides reduced(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    const bool red = std::binary_search(axes.begin(), axes.end(), static_cast<int64_t>(d));
    if (red) l.count *= shape[d];
    if (shape[d] == 1) continue;
    if (l.rank > 0 && reduced[l.rank - 1] == red) {
      l.dims[l.rank - 1] *= shape[d];
    } else {
      l.dims[l.rank] = shape[d];
      reduced[l.rank++] = red;
    }
  }
  // A long reduced last row (a whole gradient summed to a scalar: the non-finite guard's checks, a
  // global norm) is cut into segments of S elements, S a multiple of 8 dividing the row: a reduced
  // dimension of n / S segments, then the reduced S. Each segment's lanes are summed and added in
  // segment order, so the segments run four at a time (Lanes4) and in parallel blocks instead of
  // one add chain on one core. S depends on the shape only.
  if (l.rank > 0 && l.rank < Strides::kMaxRank && reduced[l.rank - 1] && l.dims[l.rank - 1] > kLongRow) {
    const int64_t n = l.dims[l.rank - 1];
    int64_t seg = 0;
    for (int64_t s = kRowSegment; s >= kRowSegment / 16 && seg == 0; s -= 8)
      if (n % s == 0) seg = s;
    if (seg > 0) {
      l.dims[l.rank - 1] = n / seg;
      l.dims[l.rank] = seg;
      reduced[l.rank++] = true;
    }
  }
  l.acc_strides = Strides(l.rank, 0);
  for (int64_t d = l.rank - 1, stride = 1; d >= 0; --d)
    if (!reduced[d]) l.acc_strides[d] = stride, stride *= l.dims[d];
  l.nout = ir::NumElements(out_shape);
  l.total = ir::NumElements(shape);
  l.n = l.rank == 0 ? 1 : l.dims[l.rank - 1];
  l.inner = l.rank == 0 ? 0 : l.acc_strides[l.rank - 1];
  l.rows = l.n > 0 ? l.total / l.n : 0;
  // Blocks of about 64K elements (whole rows): the partition depends on the shape only.
  l.block_rows = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(l.n, 1));
  // Columns summed over rows of 512 or more (a bias gradient over a vocabulary, [tokens, 4096]): at most
  // 8 blocks, as each keeps a partial array of n doubles that is zeroed, written and read again (bert's
  // [2048, 4096] in 128 blocks: 4 MiB of partials, 3.1-3.4 ms of its step).
  if (l.rank == 2 && l.inner == 1 && l.acc_strides[0] == 0 && l.n >= 512)
    l.block_rows = std::max(l.block_rows, (l.rows + 7) / 8);
  l.blocks = std::max<int64_t>(1, (l.rows + l.block_rows - 1) / l.block_rows);
  return l;
}

namespace {

// row(src offset, dst offset) for rows [begin, end), walking the output index incrementally.
template <typename Row>
void ForRows(const ReduceLayout& l, int64_t begin, int64_t end, Row row) {
  if (l.total == 0 || begin >= end) return;
  const int rank = l.rank;
  Strides idx(std::max(rank, 1));
  int64_t dst = 0;
  for (int64_t dd = rank - 2, rem = begin; dd >= 0; --dd) {
    idx[dd] = rem % l.dims[dd];
    rem /= l.dims[dd];
    dst += idx[dd] * l.acc_strides[dd];
  }
  for (int64_t r = begin; r < end; ++r) {
    row(r * l.n, dst);
    for (int dd = rank - 2; dd >= 0; --dd) {
      dst += l.acc_strides[dd];
      if (++idx[dd] < l.dims[dd]) break;
      dst -= l.acc_strides[dd] * l.dims[dd];
      idx[dd] = 0;
    }
  }
}

// The sums' inner loops, in one obvious form each (Body functions); for f32 also compiled for AVX2
// and AVX-512 and picked once by the CPU (the rest of the build targets baseline x86-64, whose SSE
// registers these loops overflow). Only conversions to double and additions in a fixed order: the
// same bits on every instruction set.
//  - Lanes: elements [a, b) of a row along a reduced last axis (xs points at element a; a is 0 or a
//    multiple of 8) into lanes s: lane j sums elements j, j + 8, ... below the row's last multiple of
//    8 (n8), then lane 0 the tail; the same order however the row is cut.
//  - Lanes4: whole rows x0..x3 (n elements) into s[0..3], as Lanes does: four independent chains of
//    vector adds, where one row's lanes alone would wait on the add latency.
//  - Column: part[k] += xs[k] for k < count (a kept last axis).
template <typename T>
[[gnu::always_inline]] inline void LanesBody(const T* xs, int64_t a, int64_t b, int64_t n8, double* s) {
  int64_t k = a;
  for (; k + 8 <= std::min(b, n8); k += 8)
    for (int j = 0; j < 8; ++j) s[j] += xs[k - a + j];
  for (; k < b; ++k) s[0] += xs[k - a];
}
template <typename T>
[[gnu::always_inline]] inline void Lanes4Body(const T* x0, const T* x1, const T* x2, const T* x3, int64_t n,
                                              double (*s)[8]) {
  const int64_t n8 = n / 8 * 8;
  int64_t k = 0;
  for (; k < n8; k += 8)
    for (int j = 0; j < 8; ++j) {
      s[0][j] += x0[k + j];
      s[1][j] += x1[k + j];
      s[2][j] += x2[k + j];
      s[3][j] += x3[k + j];
    }
  for (; k < n; ++k) {
    s[0][0] += x0[k];
    s[1][0] += x1[k];
    s[2][0] += x2[k];
    s[3][0] += x3[k];
  }
}
template <typename T>
[[gnu::always_inline]] inline void ColumnBody(const T* xs, int64_t count, double* part) {
  for (int64_t k = 0; k < count; ++k) part[k] += xs[k];
}
// Column over `rows` consecutive rows of n elements into the same part[0, n): channels-last batch
// norm's sums (rows of C = 16-64 channels, one call per window instead of one per row).
// For n of 16, 32 or 64 (resnet's channel counts) the n sums stay in registers over the rows; with 16
// or 32 channels the rows are dealt in turn to K chains (ColumnChains: row i of the call to chain
// (chain0 + i) % K, chain c's sums at part[c * n, (c + 1) * n)), so K independent add chains per
// column fill the adder where one would wait on its latency (2.8 ms of resnet20's step here).
template <int64_t N, int K, typename T>
[[gnu::always_inline]] inline void ColumnRowsFixed(const T* xs, int64_t rows, int64_t chain0, double* part) {
  double acc[K][N];
  for (int c = 0; c < K; ++c)
    for (int64_t k = 0; k < N; ++k) acc[c][k] = part[c * N + k];
  int64_t r = 0;
  if constexpr (K > 1)  // up to the next row of chain 0
    for (int c = static_cast<int>(chain0); c != 0 && c < K && r < rows; c = c + 1 == K ? 0 : c + 1, ++r)
      for (int64_t k = 0; k < N; ++k) acc[c][k] += xs[r * N + k];
  for (; r + K <= rows; r += K)
    for (int c = 0; c < K; ++c)
      for (int64_t k = 0; k < N; ++k) acc[c][k] += xs[(r + c) * N + k];
  for (int c = 0; r < rows; ++c, ++r)
    for (int64_t k = 0; k < N; ++k) acc[c][k] += xs[r * N + k];
  for (int c = 0; c < K; ++c)
    for (int64_t k = 0; k < N; ++k) part[c * N + k] = acc[c][k];
}
// Wider rows (transformer_lm's bias gradients: columns of 128 or 512) in strips of S columns, each
// strip's S sums in registers down all the rows: every sum adds the same terms in the same order as
// the loop below, which reloads and stores part[k] at every row (/tmp micro-benchmark, a 64K-element
// window of rows of 128 or 512: 15.8-16.3 -> 3.2 us, the same bits).
template <int64_t S, typename T>
[[gnu::always_inline]] inline void ColumnStrips(const T* xs, int64_t rows, int64_t n, double* part) {
  for (int64_t k0 = 0; k0 < n; k0 += S) {
    double acc[S];
    for (int64_t k = 0; k < S; ++k) acc[k] = part[k0 + k];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < S; ++k) acc[k] += xs[r * n + k0 + k];
    for (int64_t k = 0; k < S; ++k) part[k0 + k] = acc[k];
  }
}
// Rows of 512 columns or more four at a time over the whole width: part[k] read and written once per
// four rows, each row read front to back (the strips above read a few hundred bytes of each row and
// jump to the next, 2 KiB or more ahead, where the prefetchers do not follow). The same adds in the
// same order as row by row. /tmp micro-benchmark, 8 Mi floats in blocks of 64 Ki elements or of half
// the rows, one thread: n = 4096 3.4 / 5.9 -> 1.5 / 1.6 ms (BERT's output bias gradient, 3.1 ms of its
// step), n = 512 5.6 / 9.8 -> 3.4 / 2.5 ms; at n = 128 the strips stay faster (2.4 against 4.1 ms).
template <typename T>
[[gnu::always_inline]] inline void ColumnRowGroups(const T* xs, int64_t rows, int64_t n, double* part) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    const T *x0 = xs + r * n, *x1 = x0 + n, *x2 = x1 + n, *x3 = x2 + n;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)  // a fixed trip count: vectorised at -O2
#pragma GCC unroll 8
      for (int64_t j = k; j < k + 8; ++j) part[j] = (((part[j] + x0[j]) + x1[j]) + x2[j]) + x3[j];
    for (; k < n; ++k) part[k] = (((part[k] + x0[k]) + x1[k]) + x2[k]) + x3[k];
  }
  for (; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k) part[k] += xs[r * n + k];
}
template <typename T>
[[gnu::always_inline]] inline void ColumnRowsBody(const T* xs, int64_t rows, int64_t n, int64_t chain0, double* part) {
  if (n == 16) return ColumnRowsFixed<16, 4>(xs, rows, chain0, part);
  if (n == 32) return ColumnRowsFixed<32, 2>(xs, rows, chain0, part);
  if (n == 64) return ColumnRowsFixed<64, 1>(xs, rows, chain0, part);
  if (n >= 512) return ColumnRowGroups(xs, rows, n, part);
  if (n % 128 == 0) return ColumnStrips<128>(xs, rows, n, part);
  if (n % 64 == 0) return ColumnStrips<64>(xs, rows, n, part);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k) part[k] += xs[r * n + k];
}

#define SS_ISA_VARIANTS(NAME, PARAMS, ARGS)                                      \
  __attribute__((target("avx512f"))) void NAME##Avx512 PARAMS { NAME##Body ARGS; } \
  __attribute__((target("avx2"))) void NAME##Avx2 PARAMS { NAME##Body ARGS; }      \
  void NAME##Base PARAMS { NAME##Body ARGS; }
SS_ISA_VARIANTS(Lanes, (const float* xs, int64_t a, int64_t b, int64_t n8, double* s), (xs, a, b, n8, s))
SS_ISA_VARIANTS(Lanes4, (const float* x0, const float* x1, const float* x2, const float* x3, int64_t n, double (*s)[8]),
                (x0, x1, x2, x3, n, s))
SS_ISA_VARIANTS(Column, (const float* xs, int64_t count, double* part), (xs, count, part))
SS_ISA_VARIANTS(ColumnRows, (const float* xs, int64_t rows, int64_t n, int64_t chain0, double* part),
                (xs, rows, n, chain0, part))
#undef SS_ISA_VARIANTS

int Isa() {
  static const int isa = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
  return isa;
}
template <typename T>
void Lanes(const T* xs, int64_t a, int64_t b, int64_t n8, double* s) {
  if constexpr (std::is_same_v<T, float>) {
    const int isa = Isa();
    if (isa == 2) return LanesAvx512(xs, a, b, n8, s);
    if (isa == 1) return LanesAvx2(xs, a, b, n8, s);
    return LanesBase(xs, a, b, n8, s);
  }
  LanesBody(xs, a, b, n8, s);
}
template <typename T>
void Lanes4(const T* x0, const T* x1, const T* x2, const T* x3, int64_t n, double (*s)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    const int isa = Isa();
    if (isa == 2) return Lanes4Avx512(x0, x1, x2, x3, n, s);
    if (isa == 1) return Lanes4Avx2(x0, x1, x2, x3, n, s);
    return Lanes4Base(x0, x1, x2, x3, n, s);
  }
  Lanes4Body(x0, x1, x2, x3, n, s);
}
template <typename T>
void Column(const T* xs, int64_t count, double* part) {
  if constexpr (std::is_same_v<T, float>) {
    const int isa = Isa();
    if (isa == 2) return ColumnAvx512(xs, count, part);
    if (isa == 1) return ColumnAvx2(xs, count, part);
    return ColumnBase(xs, count, part);
  }
  ColumnBody(xs, count, part);
}

template <typename T>
void ColumnRows(const T* xs, int64_t rows, int64_t n, int64_t chain0, double* part) {
  if constexpr (std::is_same_v<T, float>) {
    const int isa = Isa();
    if (isa == 2) return ColumnRowsAvx512(xs, rows, n, chain0, part);
    if (isa == 1) return ColumnRowsAvx2(xs, rows, n, chain0, part);
    return ColumnRowsBase(xs, rows, n, chain0, part);
  }
  ColumnRowsBody(xs, rows, n, chain0, part);
}
// Whether every row adds into the same outputs, part[0, n): [reduced rows, kept n] after collapsing.
bool OneColumnBlock(const ReduceLayout& l) { return l.inner == 1 && l.rank == 2 && l.acc_strides[0] == 0; }
// How many chains a block's rows are dealt to (ColumnRowsFixed): it depends on the layout only.
int64_t ColumnChains(const ReduceLayout& l) {
  if (!OneColumnBlock(l)) return 1;
  return l.n == 16 ? 4 : l.n == 32 ? 2 : 1;
}

// Elements [a, b) of one row (k counted from the row's start; xs points at element a; a is a
// multiple of 8 or 0) added into the partial sums: along a reduced last axis into lanes s (Lanes),
// else element k into part[k * inner].
template <typename T>
void AddRowPart(const ReduceLayout& l, const T* xs, int64_t a, int64_t b, double* s, double* part) {
  if (l.inner == 0) {
    Lanes(xs, a, b, l.n / 8 * 8, s);
  } else if (l.inner == 1) {
    Column(xs, b - a, part + a);
  } else {
    for (int64_t k = a; k < b; ++k) part[k * l.inner] += xs[k - a];
  }
}
inline double LaneSum(const double* s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

// Rows [r0, r1) of a layout whose last collapsed axis is reduced (inner == 0) summed into part, the
// elements of row src at x + src - origin: four rows at a time (Lanes4), each row's lane sum then
// added to part in row order: the bits of one row at a time.
template <typename T>
void SumRows(const ReduceLayout& l, int64_t r0, int64_t r1, const T* x, int64_t origin, double* part) {
  constexpr int kRows = 4;
  int64_t src[kRows], dst[kRows];
  int count = 0;
  auto flush = [&] {
    double s[kRows][8] = {};
    if (count == kRows) {
      Lanes4(x + (src[0] - origin), x + (src[1] - origin), x + (src[2] - origin), x + (src[3] - origin), l.n, s);
    } else {
      for (int r = 0; r < count; ++r) AddRowPart(l, x + (src[r] - origin), 0, l.n, s[r], nullptr);
    }
    for (int r = 0; r < count; ++r) part[dst[r]] += LaneSum(s[r]);
    count = 0;
  };
  ForRows(l, r0, r1, [&](int64_t s_, int64_t d_) {
    src[count] = s_;
    dst[count] = d_;
    if (++count == kRows) flush();
  });
  flush();
}

// How many arrays of partial sums a reduction keeps: one per block, or one in all when every output
// is one whole row (softmax's sums: rows == nout, the last axis reduced). Then each output is written
// by its row's block alone, and the other blocks' partials would be zeros: adding them changes no bit
// (a partial starts at +0), so they are not kept, zeroed nor added (32 x 16384 doubles per softmax sum).
int64_t PartialArrays(const ReduceLayout& l) { return l.inner == 0 && l.rows == l.nout ? 1 : l.blocks; }
// Doubles per array of partial sums: nout per chain.
int64_t PartialSize(const ReduceLayout& l) { return l.nout * ColumnChains(l); }
double* PartialOf(const ReduceLayout& l, double* acc, int64_t blk) {
  return acc + (PartialArrays(l) == 1 ? 0 : blk * PartialSize(l));
}

// The blocks' partial sums (acc[blk * nout + i]) added in block order, divided for a mean: outputs
// [i0, i1).
template <typename T>
void FinishRange(const ReduceLayout& l, bool mean, double* acc, T* out, int64_t i0, int64_t i1) {
  // Block by block over contiguous outputs (each output still adds its blocks in block order): per
  // output across the blocks, every read was nout doubles away from the last (a cache and TLB miss
  // each for softmax's 16384 rows).
  const int64_t chains = ColumnChains(l), size = PartialSize(l), n = l.nout;
  for (int64_t blk = 0; chains > 1 && blk < PartialArrays(l); ++blk) {  // a block's chains, pairwise
    double* c = acc + blk * size;
    for (int64_t i = i0; i < i1; ++i)
      c[i] = chains == 4 ? (c[i] + c[n + i]) + (c[2 * n + i] + c[3 * n + i]) : c[i] + c[n + i];
  }
  for (int64_t blk = 1; blk < PartialArrays(l); ++blk) {
    const double* part = acc + blk * size;
    for (int64_t i = i0; i < i1; ++i) acc[i] += part[i];
  }
  for (int64_t i = i0; i < i1; ++i) {
    double v = acc[i];
    if (mean) v = l.count ? v / l.count : (std::is_same_v<T, float> ? NAN : 0.0);
    if constexpr (std::is_same_v<T, float>) out[i] = static_cast<float>(v);
    else out[i] = mean ? static_cast<int32_t>(v) : Wrap(static_cast<int64_t>(v));
  }
}
// Outputs in parallel ranges where there are many of them and several blocks to add (a positional
// embedding's gradient, [32, 128, 128] summed over the batch: 16384 outputs x 8 blocks, 0.24 ms on one
// thread after the blocks ran on two): each output's additions are the same, in the same order.
constexpr int64_t kFinishGrain = 4096;
template <typename T>
void Finish(const ReduceLayout& l, bool mean, double* acc, T* out) {
  if (l.nout < 2 * kFinishGrain || PartialArrays(l) * ColumnChains(l) < 4) return FinishRange(l, mean, acc, out, 0, l.nout);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, l.nout, kFinishGrain), [&](const tbb::blocked_range<int64_t>& r) {
    FinishRange(l, mean, acc, out, r.begin(), r.end());
  });
}

// The partial sums start at +0: one array, zeroed before the blocks run (they share it), or each
// block's own, zeroed by the block as it starts (in parallel, where it will be written).
void ZeroPartials(const ReduceLayout& l, std::vector<double>& acc, int64_t arrays) {
  if (PartialArrays(l) == 1) acc.assign(arrays * PartialSize(l), 0.0);
  else acc.resize(arrays * PartialArrays(l) * PartialSize(l));
}
void ZeroBlockPartial(const ReduceLayout& l, double* part) {
  if (PartialArrays(l) > 1) std::fill_n(part, PartialSize(l), 0.0);
}

template <typename Body>
void ForBlocks(int64_t blocks, Body body) {
  if (blocks == 1) return body(0);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks, 1), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) body(blk);
  });
}

// The maximum of a row as the fold in index order (MaxOf from -inf) leaves it: where the row has no NaN
// and its maximum is not zero, every element equal to the maximum has its bits, so the order does not
// matter and four SSE lanes find it; otherwise (the first NaN's bits, or the last of +0 and -0 wins)
// the fold itself.
float RowMax(const float* x, int64_t n) {
  __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, unordered = _mm_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m128 a = _mm_loadu_ps(x + k), b = _mm_loadu_ps(x + k + 4);
    unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(a, b));
    m0 = _mm_max_ps(m0, a);
    m1 = _mm_max_ps(m1, b);
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_max_ps(m0, m1));
  float best = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  bool nan = _mm_movemask_ps(unordered) != 0;
  for (; k < n; ++k) {
    nan |= x[k] != x[k];
    best = x[k] > best ? x[k] : best;
  }
  if (!nan && best != 0.0f) return best;
  float fold = -INFINITY;
  for (k = 0; k < n; ++k) fold = MaxOf(fold, x[k]);
  return fold;
}

}  // namespace

bool ColumnSumsDownRows(const ReduceLayout& l) { return OneColumnBlock(l) && ColumnChains(l) == 1; }

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
  const ReduceLayout l = LayoutOf(shape, axes, out_shape);
  if (op == OpCode::kReduceMax) {
    T init = std::numeric_limits<T>::lowest();
    if constexpr (std::is_same_v<T, float>) init = -INFINITY;
    if constexpr (std::is_same_v<T, float>) {
      if (l.inner == 0 && l.rows == l.nout && l.n >= 8) {  // one row per output (softmax's max): rows in parallel
        const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / l.n);
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, l.rows, grain), [&](const tbb::blocked_range<int64_t>& r) {
          for (int64_t row = r.begin(); row < r.end(); ++row) out[row] = RowMax(x + row * l.n, l.n);
        });
        return;
      }
    }
    std::fill(out, out + l.nout, init);
    ForRows(l, 0, l.rows, [&](int64_t src, int64_t dst) {
      for (int64_t k = 0; k < l.n; ++k) out[dst + k * l.inner] = MaxOf(out[dst + k * l.inner], x[src + k]);
    });
    return;
  }
  ZeroPartials(l, acc, 1);
  ForBlocks(l.blocks, [&](int64_t blk) {
    double* part = PartialOf(l, acc.data(), blk);
    ZeroBlockPartial(l, part);
    const int64_t r0 = blk * l.block_rows, r1 = std::min(l.rows, (blk + 1) * l.block_rows);
    if (l.inner == 0) return SumRows(l, r0, r1, x, 0, part);
    if (OneColumnBlock(l)) return ColumnRows(x + r0 * l.n, r1 - r0, l.n, 0, part);
    ForRows(l, r0, r1, [&](int64_t src, int64_t dst) { AddRowPart(l, x + src, 0, l.n, nullptr, part + dst); });
  });
  Finish(l, op == OpCode::kReduceMean, acc.data(), out);
}

// The same sums as Reduce's, over operands produced a window at a time (see data_movement.h): a
// window holds whole rows of a block, or (rows longer than the window) a multiple of 8 elements of
// one row, whose lanes carry over to the row's next window, so every sum adds the same terms in the
// same order as Reduce's.
void FusedSums(const ReduceLayout& l, int count, const bool* mean, float* const* out, int64_t window,
               WindowProducer produce, std::vector<double>& acc) {
  const int64_t per_sum = PartialArrays(l) * PartialSize(l), chains = ColumnChains(l);
  ZeroPartials(l, acc, count);
  window = std::max<int64_t>(8, window / 8 * 8);
  ForBlocks(l.blocks, [&](int64_t blk) {
    const int64_t r0 = blk * l.block_rows, r1 = std::min(l.rows, (blk + 1) * l.block_rows);
    auto part = [&](int j) { return PartialOf(l, acc.data() + j * per_sum, blk); };
    for (int j = 0; j < count; ++j) ZeroBlockPartial(l, part(j));
    if (l.n <= window) {  // whole rows per window
      const int64_t per = std::max<int64_t>(1, window / std::max<int64_t>(l.n, 1));
      for (int64_t w0 = r0; w0 < r1; w0 += per) {
        const int64_t w1 = std::min(r1, w0 + per), e0 = w0 * l.n;
        const float* const* x = produce(e0, w1 * l.n);
        for (int j = 0; j < count; ++j) {
          double* p = part(j);
          if (l.inner == 0) SumRows(l, w0, w1, x[j], e0, p);
          else if (OneColumnBlock(l)) ColumnRows(x[j], w1 - w0, l.n, (w0 - r0) % chains, p);
          else ForRows(l, w0, w1, [&](int64_t src, int64_t dst) { AddRowPart(l, x[j] + (src - e0), 0, l.n, nullptr, p + dst); });
        }
      }
      return;
    }
    constexpr int kMaxFused = 8;
    double s[kMaxFused][8];
    ForRows(l, r0, r1, [&](int64_t src, int64_t dst) {
      for (int j = 0; j < count; ++j) std::fill_n(s[j], 8, 0.0);
      for (int64_t a = 0; a < l.n; a += window) {
        const int64_t b = std::min(l.n, a + window);
        const float* const* x = produce(src + a, src + b);
        for (int j = 0; j < count; ++j) AddRowPart(l, x[j], a, b, s[j], part(j) + dst + (src / l.n - r0) % chains * l.n);
      }
      if (l.inner == 0)
        for (int j = 0; j < count; ++j) part(j)[dst] += LaneSum(s[j]);
    });
  });
  for (int j = 0; j < count; ++j) Finish(l, mean[j], acc.data() + j * per_sum, out[j]);
}

template void Reduce<float>(OpCode, const Shape&, const ir::IntList&, const Shape&, const float*, float*,
                            std::vector<double>&);
template void Reduce<int32_t>(OpCode, const Shape&, const ir::IntList&, const Shape&, const int32_t*, int32_t*,
                              std::vector<double>&);

}  // namespace shardstep::jit
