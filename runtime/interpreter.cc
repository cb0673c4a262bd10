// The reference interpreter: one kernel per op of ir/ops.def, dispatched by a switch with no default.
//
// Conventions every later backend must reproduce (to the bit where noted):
//  - s32 arithmetic wraps (two's complement); s32 division truncates and rejects a zero divisor.
//  - max/min propagate NaN; relu(x) = x > 0 ? x : 0 (relu(NaN) = NaN); convert f32 -> s32 truncates
//    toward zero and saturates (NaN -> 0).
//  - reduce_sum/mean accumulate in double in increasing input index order; reduce_max, max_pool take
//    the first maximum (a NaN counts as a maximum).
//  - conv2d = im2col + sgemm per image; the filter gradient sums fixed groups of images, then adds the
//    groups in order.
#include "runtime/interpreter.h"
#include "runtime/pool_window.h"

#include <dnnl.h>
#include <omp.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "ir/error.h"
#include "ir/shape_inference.h"

namespace shardstep::runtime {
namespace {

using ir::DType;
using ir::Instr;
using ir::IntList;
using ir::OpCode;
using ir::Shape;
using ir::TensorType;
using Strides = std::vector<int64_t>;
using Operands = std::vector<const Tensor*>;

constexpr int64_t kGrain = 1 << 14;  // elements per parallel task

// ---- Typed access and parallel loops ----

template <typename T>
const T* Data(const Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.f32.data();
  else return t.s32.data();
}
template <typename T>
T* Data(Tensor& t) {
  if constexpr (std::is_same_v<T, float>) return t.f32.data();
  else return t.s32.data();
}

// Calls f(T{}) with T = float for f32 and int32_t for s32.
template <typename F>
Tensor WithType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(float{});
    case DType::kS32: return f(int32_t{});
  }
  SS_CHECK(false, "bad dtype");
  return {};
}

// body(lo, hi) over [0, n) in chunks; the chunks write disjoint outputs, so the result is deterministic.
template <typename F>
void ParallelRange(int64_t n, int64_t grain, F body) {
  if (n <= grain) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, grain),
                    [&](const tbb::blocked_range<int64_t>& r) { body(r.begin(), r.end()); });
}

// o[i] = f(i) for i in [lo, hi). The fixed-length inner loop over a __restrict output lets -O2
// vectorise it (branch-free selects matter: relu on random data is 10x faster).
template <typename T, typename F>
void Fill(T* __restrict o, int64_t lo, int64_t hi, F& f) {
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16)
    for (int k = 0; k < 16; ++k) o[i + k] = f(i + k);
  for (; i < hi; ++i) o[i] = f(i);
}

// A tensor of `type` whose element i is f(i).
template <typename T, typename F>
Tensor Generate(const TensorType& type, F f) {
  Tensor out(type);
  T* o = Data<T>(out);
  ParallelRange(out.elements(), kGrain, [&](int64_t lo, int64_t hi) { Fill(o, lo, hi, f); });
  return out;
}

// ---- Scalar semantics ----

int32_t Wrap(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v)); }

float AddOf(float a, float b) { return a + b; }
int32_t AddOf(int32_t a, int32_t b) { return Wrap(int64_t{a} + b); }
float SubOf(float a, float b) { return a - b; }
int32_t SubOf(int32_t a, int32_t b) { return Wrap(int64_t{a} - b); }
float MulOf(float a, float b) { return a * b; }
int32_t MulOf(int32_t a, int32_t b) { return Wrap(int64_t{a} * b); }
float DivOf(float a, float b) { return a / b; }
int32_t DivOf(int32_t a, int32_t b) { return Wrap(int64_t{a} / b); }  // b != 0 checked by the caller
float NegOf(float a) { return -a; }
int32_t NegOf(int32_t a) { return Wrap(-int64_t{a}); }
float AbsOf(float a) { return std::fabs(a); }
int32_t AbsOf(int32_t a) { return Wrap(a < 0 ? -int64_t{a} : a); }
// NaN wins. Non-short-circuit | keeps these branch-free.
template <typename T>
T MaxOf(T a, T b) { return (a > b) | (a != a) ? a : b; }
template <typename T>
T MinOf(T a, T b) { return (a < b) | (a != a) ? a : b; }

int32_t ToS32(double v) {  // truncation toward zero, saturating
  if (std::isnan(v)) return 0;
  if (v >= 2147483647.0) return std::numeric_limits<int32_t>::max();
  if (v <= -2147483648.0) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(v);
}

// ---- Elementwise kernels ----

template <typename F>
Tensor UnaryF32(const Instr& in, const Tensor& a, F f) {
  const float* x = a.f32.data();
  return Generate<float>(in.type, [&](int64_t i) { return f(x[i]); });
}

// f is generic over float and int32_t and returns the same type.
template <typename F>
Tensor Unary(const Instr& in, const Tensor& a, F f) {
  return WithType(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const T* x = Data<T>(a);
    return Generate<T>(in.type, [&](int64_t i) { return static_cast<T>(f(x[i])); });
  });
}

template <typename F>
Tensor Binary(const Instr& in, const Tensor& a, const Tensor& b, F f) {
  return WithType(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const T *x = Data<T>(a), *y = Data<T>(b);
    return Generate<T>(in.type, [&](int64_t i) { return static_cast<T>(f(x[i], y[i])); });
  });
}

Tensor Divide(const Instr& in, const Tensor& a, const Tensor& b) {
  if (b.dtype() == DType::kS32 && std::find(b.s32.begin(), b.s32.end(), 0) != b.s32.end())
    throw Error("s32 division by zero");
  return Binary(in, a, b, [](auto x, auto y) { return DivOf(x, y); });
}

Tensor Convert(const Instr& in, const Tensor& a) {
  return WithType(in.type.dtype, [&](auto t) {
    using T = decltype(t);
    return Generate<T>(in.type, [&](int64_t i) -> T {
      if constexpr (std::is_same_v<T, float>) return static_cast<float>(a.at(i));
      else return a.dtype() == DType::kS32 ? a.s32[i] : ToS32(a.f32[i]);
    });
  });
}

Tensor Select(const Instr& in, const Tensor& cond, const Tensor& a, const Tensor& b) {
  std::vector<uint8_t> pick(cond.elements());
  for (int64_t i = 0; i < cond.elements(); ++i) pick[i] = cond.at(i) != 0;
  return WithType(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const T *x = Data<T>(a), *y = Data<T>(b);
    return Generate<T>(in.type, [&](int64_t i) { return pick[i] ? x[i] : y[i]; });
  });
}

// ---- Data movement: every op is a strided copy ----

Strides RowMajor(const Shape& s) {
  Strides st(s.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(s.size()) - 1; i >= 0; --i) st[i] = acc, acc *= s[i];
  return st;
}

// Walks the index space `shape` in row-major order, calling row(a, b) with the offsets of each
// innermost row in two strided layouts; the caller loops over the last dimension itself.
template <typename F>
void ForEachRow(Shape shape, Strides a, Strides b, F row) {
  if (ir::NumElements(shape) == 0) return;
  if (shape.empty()) {  // a scalar is one row of one element
    shape = {1};
    a = b = {0};
  }
  const int64_t rank = static_cast<int64_t>(shape.size());
  std::vector<int64_t> idx(rank, 0);
  int64_t oa = 0, ob = 0;
  for (;;) {
    row(oa, ob);
    int64_t d = rank - 2;
    for (; d >= 0; --d) {
      oa += a[d], ob += b[d];
      if (++idx[d] < shape[d]) break;
      oa -= a[d] * shape[d], ob -= b[d] * shape[d], idx[d] = 0;
    }
    if (d < 0) return;
  }
}

// dst viewed with strides ds = src viewed with strides ss, over `shape`.
template <typename T>
void StridedCopy(const Shape& shape, const T* src, const Strides& ss, T* dst, const Strides& ds) {
  const int64_t n = shape.empty() ? 1 : shape.back();
  const int64_t si = ss.empty() ? 0 : ss.back(), di = ds.empty() ? 0 : ds.back();
  ForEachRow(shape, ss, ds, [&](int64_t a, int64_t b) {
    for (int64_t k = 0; k < n; ++k) dst[b + k * di] = src[a + k * si];
  });
}

// out = a copy of `a` read through (offset, strides) into out's row-major layout.
Tensor Gather(const TensorType& type, const Tensor& a, int64_t offset, const Strides& strides) {
  Tensor out(type);
  WithType(a.dtype(), [&](auto t) {
    using T = decltype(t);
    StridedCopy(type.shape, Data<T>(a) + offset, strides, Data<T>(out), RowMajor(type.shape));
    return Tensor();
  });
  return out;
}

// Writes all of `a` into `out` at element offset `offset` with out's row-major strides.
void Place(Tensor& out, int64_t offset, const Tensor& a) {
  WithType(a.dtype(), [&](auto t) {
    using T = decltype(t);
    StridedCopy(a.shape(), Data<T>(a), RowMajor(a.shape()), Data<T>(out) + offset, RowMajor(out.shape()));
    return Tensor();
  });
}

Tensor Broadcast(const Instr& in, const Tensor& a) {  // operand dim i -> output dim dims[i]
  const IntList& dims = in.GetInts("dims");
  Strides is = RowMajor(a.shape()), ss(in.type.rank(), 0);
  for (size_t i = 0; i < dims.size(); ++i) ss[dims[i]] = is[i];
  return Gather(in.type, a, 0, ss);
}

Tensor Transpose(const Instr& in, const Tensor& a) {  // out dim i = in dim perm[i]
  const IntList& perm = in.GetInts("perm");
  Strides is = RowMajor(a.shape()), ss(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) ss[i] = is[perm[i]];
  return Gather(in.type, a, 0, ss);
}

Tensor Slice(const Instr& in, const Tensor& a) {
  const IntList& start = in.GetInts("start");
  Strides is = RowMajor(a.shape());
  int64_t offset = 0;
  for (size_t i = 0; i < start.size(); ++i) offset += start[i] * is[i];
  return Gather(in.type, a, offset, is);
}

Tensor Pad(const Instr& in, const Tensor& a) {
  const IntList& low = in.GetInts("low");
  Tensor out(in.type);
  Strides os = RowMajor(in.type.shape);
  int64_t offset = 0;
  for (size_t i = 0; i < low.size(); ++i) offset += low[i] * os[i];
  Place(out, offset, a);
  return out;
}

Tensor Concat(const Instr& in, const Operands& parts) {
  const int64_t axis = in.GetInt("axis");
  Tensor out(in.type);
  const int64_t stride = RowMajor(in.type.shape)[axis];
  int64_t at = 0;
  for (const Tensor* p : parts) {
    Place(out, at * stride, *p);
    at += p->shape()[axis];
  }
  return out;
}

Tensor Reshape(const Instr& in, const Tensor& a) {
  Tensor out = a;
  out.type = in.type;
  return out;
}

// ---- Reductions ----

// Reduces `axes` away. Each output element folds its inputs in increasing input index order.
Tensor Reduce(const Instr& in, const Tensor& a) {
  const IntList& axes = in.GetInts("axes");
  const Shape& shape = a.shape();
  Strides is = RowMajor(shape), os = RowMajor(in.type.shape), acc_strides(shape.size(), 0);
  int64_t count = 1;
  for (size_t d = 0, j = 0; d < shape.size(); ++d) {
    if (std::binary_search(axes.begin(), axes.end(), static_cast<int64_t>(d))) count *= shape[d];
    else acc_strides[d] = os[j++];
  }
  const int64_t n = shape.empty() ? 1 : shape.back(), inner = acc_strides.empty() ? 0 : acc_strides.back();

  return WithType(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const T* x = Data<T>(a);
    if (in.op == OpCode::kReduceMax) {
      std::vector<T> acc(in.type.elements(), std::numeric_limits<T>::lowest());
      if constexpr (std::is_same_v<T, float>) std::fill(acc.begin(), acc.end(), -INFINITY);
      ForEachRow(shape, is, acc_strides, [&](int64_t src, int64_t dst) {
        for (int64_t k = 0; k < n; ++k) acc[dst + k * inner] = MaxOf(acc[dst + k * inner], x[src + k]);
      });
      Tensor out(in.type);
      std::copy(acc.begin(), acc.end(), Data<T>(out));
      return out;
    }
    std::vector<double> acc(in.type.elements(), 0.0);
    ForEachRow(shape, is, acc_strides, [&](int64_t src, int64_t dst) {
      if (inner == 0) {
        double s = acc[dst];
        for (int64_t k = 0; k < n; ++k) s += x[src + k];
        acc[dst] = s;
      } else {
        for (int64_t k = 0; k < n; ++k) acc[dst + k * inner] += x[src + k];
      }
    });
    const bool mean = in.op == OpCode::kReduceMean;
    return Generate<T>(in.type, [&](int64_t i) -> T {
      double v = mean ? (count ? acc[i] / count : (std::is_same_v<T, float> ? NAN : 0.0)) : acc[i];
      if constexpr (std::is_same_v<T, float>) return static_cast<float>(v);
      else return mean ? static_cast<int32_t>(v) : Wrap(static_cast<int64_t>(v));
    });
  });
}

// ---- Matmul and convolution (BLAS) ----
//
// BLAS runs single-threaded (set once, process-wide): OpenBLAS's own workers busy-wait between calls
// and would fight TBB's workers and the replica threads for the cores. We parallelise instead over
// independent blocks (rows of a matmul, images of a convolution) whose boundaries depend only on the
// shapes, so results do not depend on the number of threads.

// Row-major C[m,n] = op(A)[m,k] * op(B)[k,n] + beta * C.
void Sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc) {
  // oneDNN's sgemm (about 4x Debian's OpenBLAS on this CPU, which falls back to generic kernels).
  // It runs on OpenMP; one OpenMP thread per calling thread, since TBB and the replicas own the cores.
  thread_local const bool single_threaded = (omp_set_num_threads(1), true);
  (void)single_threaded;
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0) std::fill(c, c + m * ldc, 0.0f);
    return;
  }
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, 1.0f, a, std::max<int64_t>(lda, 1), b,
                                std::max<int64_t>(ldb, 1), beta, c, std::max<int64_t>(ldc, 1));
  SS_CHECK(st == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(st));
}

Tensor Matmul(const Instr& in, const Tensor& a, const Tensor& b) {
  const bool ta = in.GetInt("transpose_a", 0) != 0, tb = in.GetInt("transpose_b", 0) != 0;
  Tensor out(in.type);
  const int64_t m = in.type.shape[0], n = in.type.shape[1], k = ta ? a.shape()[0] : a.shape()[1];
  const int64_t lda = a.shape()[1];
  // Blocks of rows of C, each one sgemm: about 4M multiply-adds per block.
  const int64_t rows = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(n * k, 1));
  ParallelRange((m + rows - 1) / rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t r0 = blk * rows, mb = std::min(rows, m - r0);
      const float* a0 = a.f32.data() + (ta ? r0 : r0 * lda);  // row r0 of op(A)
      Sgemm(ta, tb, mb, n, k, a0, lda, b.f32.data(), b.shape()[1], 0.0f, out.f32.data() + r0 * n, n);
    }
  });
  return out;
}

struct ConvGeometry {
  int64_t n, c, h, w;      // input NCHW
  int64_t o, kh, kw;       // filter OIHW (I = c)
  int64_t sh, sw, ph, pw;  // stride, padding
  int64_t oh, ow;          // output spatial size
  int64_t k() const { return c * kh * kw; }  // im2col rows
  int64_t p() const { return oh * ow; }      // output positions per image
};

ConvGeometry Geometry(const Shape& x, const Shape& w, const Instr& in) {
  IntList s = in.GetInts("stride", {1, 1}), p = in.GetInts("padding", {0, 0});
  ConvGeometry g{x[0], x[1], x[2], x[3], w[0], w[2], w[3], s[0], s[1], p[0], p[1], 0, 0};
  g.oh = (g.h + 2 * g.ph - g.kh) / g.sh + 1;
  g.ow = (g.w + 2 * g.pw - g.kw) / g.sw + 1;
  return g;
}

// One image at a time, so the im2col matrix stays in cache and the sgemm result [O, P] is already the
// image's slice of an NCHW tensor.

// col[(c,i,j), p] = zero-padded x[c, oh*sh - ph + i, ow*sw - pw + j] for one image x [C, H, W].
void Im2Col(const float* x, const ConvGeometry& g, float* col) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        float* row = col + ((c * g.kh + i) * g.kw + j) * g.p();
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          float* dst = row + y * g.ow;
          for (int64_t xx = 0; xx < g.ow; ++xx) {
            const int64_t ix = xx * g.sw - g.pw + j;
            dst[xx] = (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) ? x[(c * g.h + iy) * g.w + ix] : 0.0f;
          }
        }
      }
}

// The adjoint of Im2Col: dx += col2im(col), in a fixed order.
void Col2Im(const float* col, const ConvGeometry& g, float* dx) {
  for (int64_t c = 0; c < g.c; ++c)
    for (int64_t i = 0; i < g.kh; ++i)
      for (int64_t j = 0; j < g.kw; ++j) {
        const float* row = col + ((c * g.kh + i) * g.kw + j) * g.p();
        for (int64_t y = 0; y < g.oh; ++y) {
          const int64_t iy = y * g.sh - g.ph + i;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t xx = 0; xx < g.ow; ++xx) {
            const int64_t ix = xx * g.sw - g.pw + j;
            if (ix >= 0 && ix < g.w) dx[(c * g.h + iy) * g.w + ix] += row[y * g.ow + xx];
          }
        }
      }
}

// y[n,o] = sum_{c,i,j} w[o,c,i,j] * x[n, c, oh*sh - ph + i, ow*sw - pw + j]   (x zero-padded)
Tensor Conv2d(const Instr& in, const Tensor& x, const Tensor& w) {
  const ConvGeometry g = Geometry(x.shape(), w.shape(), in);
  Tensor y(in.type);
  ParallelRange(g.n, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> col(g.k() * g.p());
    for (int64_t n = lo; n < hi; ++n) {
      Im2Col(x.f32.data() + n * g.c * g.h * g.w, g, col.data());
      Sgemm(false, false, g.o, g.p(), g.k(), w.f32.data(), g.k(), col.data(), g.p(), 0.0f,
            y.f32.data() + n * g.o * g.p(), g.p());
    }
  });
  return y;
}

// dx[n] = col2im(w^T dy[n]).
Tensor Conv2dInputGrad(const Instr& in, const Tensor& dy, const Tensor& w) {
  const ConvGeometry g = Geometry(in.type.shape, w.shape(), in);
  Tensor dx(in.type);
  ParallelRange(g.n, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> dcol(g.k() * g.p());
    for (int64_t n = lo; n < hi; ++n) {
      Sgemm(true, false, g.k(), g.p(), g.o, w.f32.data(), g.k(), dy.f32.data() + n * g.o * g.p(), g.p(), 0.0f,
            dcol.data(), g.p());
      Col2Im(dcol.data(), g, dx.f32.data() + n * g.c * g.h * g.w);
    }
  });
  return dx;
}

// dw = sum_n dy[n] im2col(x[n])^T. The images are split into kFilterGradGroups fixed groups (summed
// in parallel, each in image order), then the groups' sums are added in group order.
constexpr int64_t kFilterGradGroups = 8;

Tensor Conv2dFilterGrad(const Instr& in, const Tensor& x, const Tensor& dy) {
  const ConvGeometry g = Geometry(x.shape(), in.type.shape, in);
  Tensor dw(in.type);
  const int64_t per_group = (g.n + kFilterGradGroups - 1) / kFilterGradGroups;
  std::vector<std::vector<float>> partial(kFilterGradGroups, std::vector<float>(dw.elements()));
  ParallelRange(kFilterGradGroups, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> col(g.k() * g.p());
    for (int64_t group = lo; group < hi; ++group)
      for (int64_t n = group * per_group; n < std::min(g.n, (group + 1) * per_group); ++n) {
        Im2Col(x.f32.data() + n * g.c * g.h * g.w, g, col.data());
        Sgemm(false, true, g.o, g.k(), g.p(), dy.f32.data() + n * g.o * g.p(), g.p(), col.data(), g.p(),
              n == group * per_group ? 0.0f : 1.0f, partial[group].data(), g.k());
      }
  });
  for (const auto& p : partial)
    for (int64_t j = 0; j < dw.elements(); ++j) dw.f32[j] += p[j];
  return dw;
}

// ---- Pooling (no padding) ----

using PoolGeometry = PoolWindow;
PoolGeometry PoolGeom(const Shape& x, const Instr& in) { return PoolWindowOf(x, in); }

// Calls f(window origin in x, output offset) for every output position; planes run in parallel, the
// positions of one plane in order.
template <typename F>
void ForEachWindow(const PoolGeometry& g, F f) {
  ParallelRange(g.planes, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t y = 0; y < g.oh; ++y)
        for (int64_t x = 0; x < g.ow; ++x)
          f(p * g.h * g.w + y * g.sh * g.w + x * g.sw, (p * g.oh + y) * g.ow + x);
  });
}


Tensor MaxPool(const Instr& in, const Tensor& x) {
  const PoolGeometry g = PoolGeom(x.shape(), in);
  Tensor y(in.type);
  const float* xs = x.f32.data();
  ForEachWindow(g, [&](int64_t i, int64_t o) { y.f32[o] = xs[i + WindowArgMax(xs + i, g)]; });
  return y;
}

Tensor MaxPoolGrad(const Instr& in, const Tensor& x, const Tensor& dy) {
  const PoolGeometry g = PoolGeom(x.shape(), in);
  Tensor dx(in.type);
  const float* xs = x.f32.data();
  ForEachWindow(g, [&](int64_t i, int64_t o) { dx.f32[i + WindowArgMax(xs + i, g)] += dy.f32[o]; });
  return dx;
}

Tensor AvgPool(const Instr& in, const Tensor& x) {
  const PoolGeometry g = PoolGeom(x.shape(), in);
  Tensor y(in.type);
  const float area = static_cast<float>(g.kh * g.kw);
  ForEachWindow(g, [&](int64_t i, int64_t o) {
    float s = 0;
    for (int64_t a = 0; a < g.kh; ++a)
      for (int64_t b = 0; b < g.kw; ++b) s += x.f32[i + a * g.w + b];
    y.f32[o] = s / area;
  });
  return y;
}

Tensor AvgPoolGrad(const Instr& in, const Tensor& dy) {
  const PoolGeometry g = PoolGeom(in.type.shape, in);
  Tensor dx(in.type);
  const float area = static_cast<float>(g.kh * g.kw);
  ForEachWindow(g, [&](int64_t i, int64_t o) {
    const float d = dy.f32[o] / area;
    for (int64_t a = 0; a < g.kh; ++a)
      for (int64_t b = 0; b < g.kw; ++b) dx.f32[i + a * g.w + b] += d;
  });
  return dx;
}

// ---- Labels and embeddings ----

int64_t CheckedIndex(int32_t i, int64_t limit, const char* what) {
  if (i < 0 || i >= limit) throw Error(Str(what, " ", i, " out of range [0,", limit, ")"));
  return i;
}

Tensor OneHot(const Instr& in, const Tensor& labels) {
  const int64_t depth = in.GetInt("depth");
  Tensor out(in.type);
  for (int64_t i = 0; i < labels.elements(); ++i) out.f32[i * depth + CheckedIndex(labels.s32[i], depth, "label")] = 1;
  return out;
}

// out[i, ...] = table[idx[i], ...].
Tensor GatherRows(const Instr& in, const Tensor& table, const Tensor& idx) {
  const int64_t rows = table.shape()[0], width = ir::NumElements(Shape(table.shape().begin() + 1, table.shape().end()));
  for (int32_t i : idx.s32) CheckedIndex(i, rows, "gather index");
  return WithType(table.dtype(), [&](auto t) {
    using T = decltype(t);
    Tensor out(in.type);
    for (int64_t i = 0; i < idx.elements(); ++i)
      std::copy_n(Data<T>(table) + idx.s32[i] * width, width, Data<T>(out) + i * width);
    return out;
  });
}

// out[idx[i], ...] += updates[i, ...], in increasing i.
Tensor ScatterAdd(const Instr& in, const Tensor& idx, const Tensor& updates) {
  const int64_t rows = in.GetInt("rows"), n = idx.elements();
  const int64_t width = n ? updates.elements() / n : 0;
  for (int32_t i : idx.s32) CheckedIndex(i, rows, "scatter_add index");
  return WithType(updates.dtype(), [&](auto t) {
    using T = decltype(t);
    Tensor out(in.type);
    const T* u = Data<T>(updates);
    T* o = Data<T>(out);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < width; ++k) o[idx.s32[i] * width + k] = AddOf(o[idx.s32[i] * width + k], u[i * width + k]);
    return out;
  });
}

// ---- Collectives ----

struct Context {
  const ir::Module& m;
  const TensorMap& variables;
  const TensorMap& inputs;
  int replica;
  Collectives* collectives;
};

Reduction ReductionOf(const Instr& in) {
  const std::string r = in.GetString("reduction", "sum");
  if (r == "sum") return Reduction::kSum;
  if (r == "mean") return Reduction::kMean;
  if (r == "max") return Reduction::kMax;
  throw Error(Str("unknown reduction '", r, "'"));
}

// The group containing this replica. Without a Collectives it must be the replica alone.
ReplicaGroup GroupOf(const Context& ctx, const Instr& in, const Tensor& x) {
  for (const auto& group : ir::ReplicaGroups(in, ctx.m.num_replicas)) {
    if (std::find(group.begin(), group.end(), ctx.replica) == group.end()) continue;
    if (in.Has("group_size") && in.GetInt("group_size") != static_cast<int64_t>(group.size()))
      throw Error(Str("group_size ", in.GetInt("group_size"), " but replica ", ctx.replica, "'s group has ",
                      group.size(), " members"));
    if (!ctx.collectives && group.size() != 1)
      throw Error(Str("a group of ", group.size(), " replicas needs a Collectives implementation"));
    if (ctx.collectives && x.dtype() != DType::kF32)
      throw Error(Str("the Collectives interface carries f32 only, got ", x.type.ToString()));
    return group;
  }
  throw Error(Str("replica ", ctx.replica, " is in none of the replica groups"));
}

Tensor AllReduce(const Context& ctx, const Instr& in, const Tensor& x) {
  const ReplicaGroup group = GroupOf(ctx, in, x);
  const Reduction op = ReductionOf(in);
  Tensor out = x;  // a group of one: sum, mean (x / 1) and max are the identity
  if (ctx.collectives) ctx.collectives->AllReduce(ctx.replica, group, out.f32.data(), out.elements(), op);
  return out;
}

Tensor ReduceScatter(const Context& ctx, const Instr& in, const Tensor& x) {
  const ReplicaGroup group = GroupOf(ctx, in, x);
  const Reduction op = ReductionOf(in);
  if (!ctx.collectives) return Reshape(in, x);
  Tensor out(in.type);
  ctx.collectives->ReduceScatter(ctx.replica, group, x.f32.data(), out.f32.data(), out.elements(), op);
  return out;
}

Tensor AllGather(const Context& ctx, const Instr& in, const Tensor& x) {
  const ReplicaGroup group = GroupOf(ctx, in, x);
  if (!ctx.collectives) return Reshape(in, x);
  Tensor out(in.type);
  ctx.collectives->AllGather(ctx.replica, group, x.f32.data(), out.f32.data(), x.elements());
  return out;
}

// ---- Leaves ----

const Tensor& Lookup(const TensorMap& map, const char* what, const Instr& in) {
  auto it = map.find(in.name);
  if (it == map.end()) throw Error(Str(what, " @", in.name, ": missing (expected ", in.type.ToString(), ")"));
  const Tensor& t = it->second;
  if (t.type != in.type)
    throw Error(Str(what, " @", in.name, ": expected ", in.type.ToString(), ", got ", t.type.ToString()));
  const size_t held = t.dtype() == DType::kF32 ? t.f32.size() : t.s32.size();
  if (static_cast<int64_t>(held) != t.elements())
    throw Error(Str(what, " @", in.name, ": ", t.type.ToString(), " holds ", held, " values"));
  return t;
}

Tensor Splat(const Instr& in) {
  const double v = in.GetFloat("value");
  Tensor out(in.type);
  if (in.type.dtype == DType::kF32) std::fill(out.f32.begin(), out.f32.end(), static_cast<float>(v));
  else std::fill(out.s32.begin(), out.s32.end(), ToS32(v));
  return out;
}

// ---- The op switch ----

// Shape inference does not check the dtype of convolution and pooling operands; these kernels read f32.
const Operands& F32Only(const Operands& x) {
  for (const Tensor* t : x)
    if (t->dtype() != DType::kF32) throw Error(Str("operands must be f32, got ", t->type.ToString()));
  return x;
}

Tensor Evaluate(const Context& ctx, const Instr& in, const Operands& x) {
  switch (in.op) {
    case OpCode::kVariable: return Lookup(ctx.variables, "variable", in);
    case OpCode::kInput: return Lookup(ctx.inputs, "input", in);
    case OpCode::kConstant: return Splat(in);
    case OpCode::kReplicaId: return Tensor::S32({}, {ctx.replica});

    case OpCode::kNeg: return Unary(in, *x[0], [](auto a) { return NegOf(a); });
    case OpCode::kExp: return UnaryF32(in, *x[0], [](float a) { return std::exp(a); });
    case OpCode::kLog: return UnaryF32(in, *x[0], [](float a) { return std::log(a); });
    case OpCode::kSqrt: return UnaryF32(in, *x[0], [](float a) { return std::sqrt(a); });
    case OpCode::kRsqrt: return UnaryF32(in, *x[0], [](float a) { return 1.0f / std::sqrt(a); });
    case OpCode::kTanh: return UnaryF32(in, *x[0], [](float a) { return std::tanh(a); });
    case OpCode::kSin: return UnaryF32(in, *x[0], [](float a) { return std::sin(a); });
    case OpCode::kCos: return UnaryF32(in, *x[0], [](float a) { return std::cos(a); });
    case OpCode::kSigmoid: return UnaryF32(in, *x[0], [](float a) { return 1.0f / (1.0f + std::exp(-a)); });
    case OpCode::kRelu: return UnaryF32(in, *x[0], [](float a) { return (a > 0.0f) | (a != a) ? a : 0.0f; });
    case OpCode::kAbs: return Unary(in, *x[0], [](auto a) { return AbsOf(a); });
    case OpCode::kConvert: return Convert(in, *x[0]);

    case OpCode::kAdd: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return AddOf(a, b); });
    case OpCode::kSub: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return SubOf(a, b); });
    case OpCode::kMul: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return MulOf(a, b); });
    case OpCode::kDiv: return Divide(in, *x[0], *x[1]);
    case OpCode::kPow: {
      const float *a = x[0]->f32.data(), *b = x[1]->f32.data();
      return Generate<float>(in.type, [&](int64_t i) { return std::pow(a[i], b[i]); });
    }
    case OpCode::kMax: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return MaxOf(a, b); });
    case OpCode::kMin: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return MinOf(a, b); });
    case OpCode::kEq: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return a == b; });
    case OpCode::kNe: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return a != b; });
    case OpCode::kLt: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return a < b; });
    case OpCode::kLe: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return a <= b; });
    case OpCode::kGt: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return a > b; });
    case OpCode::kGe: return Binary(in, *x[0], *x[1], [](auto a, auto b) { return a >= b; });
    case OpCode::kSelect: return Select(in, *x[0], *x[1], *x[2]);

    case OpCode::kBroadcast: return Broadcast(in, *x[0]);
    case OpCode::kReshape: return Reshape(in, *x[0]);
    case OpCode::kTranspose: return Transpose(in, *x[0]);
    case OpCode::kSlice: return Slice(in, *x[0]);
    case OpCode::kPad: return Pad(in, *x[0]);
    case OpCode::kConcat: return Concat(in, x);

    case OpCode::kReduceSum:
    case OpCode::kReduceMax:
    case OpCode::kReduceMean: return Reduce(in, *x[0]);

    case OpCode::kMatmul: return Matmul(in, *x[0], *x[1]);
    case OpCode::kConv2d: return Conv2d(in, *F32Only(x)[0], *x[1]);
    case OpCode::kConv2dInputGrad: return Conv2dInputGrad(in, *F32Only(x)[0], *x[1]);
    case OpCode::kConv2dFilterGrad: return Conv2dFilterGrad(in, *F32Only(x)[0], *x[1]);
    case OpCode::kMaxPool: return MaxPool(in, *F32Only(x)[0]);
    case OpCode::kMaxPoolGrad: return MaxPoolGrad(in, *F32Only(x)[0], *x[1]);
    case OpCode::kAvgPool: return AvgPool(in, *F32Only(x)[0]);
    case OpCode::kAvgPoolGrad: return AvgPoolGrad(in, *F32Only(x)[0]);

    case OpCode::kOneHot: return OneHot(in, *x[0]);
    case OpCode::kGather: return GatherRows(in, *x[0], *x[1]);
    case OpCode::kScatterAdd: return ScatterAdd(in, *x[0], *x[1]);

    case OpCode::kAllReduce: return AllReduce(ctx, in, *x[0]);
    case OpCode::kReduceScatter: return ReduceScatter(ctx, in, *x[0]);
    case OpCode::kAllGather: return AllGather(ctx, in, *x[0]);
  }
  SS_CHECK(false, "unhandled op ", ir::OpName(in.op));
  return {};
}

}  // namespace

namespace {

// Evaluates every instruction in order. With `keep` given, a value is released after its last use
// unless keep[v] is set, so a step holds only its live buffers.
std::vector<Tensor> Run(const ir::Module& m, const TensorMap& variables, const TensorMap& inputs, int replica,
                        Collectives* collectives, const std::vector<char>* keep) {
  if (replica < 0 || replica >= m.num_replicas)
    throw Error(Str("replica ", replica, " out of range [0,", m.num_replicas, ")"));
  if (collectives && collectives->num_replicas() != m.num_replicas)
    throw Error(Str("module '", m.name, "' runs on ", m.num_replicas, " replicas but the collectives connect ",
                    collectives->num_replicas()));
  const Context ctx{m, variables, inputs, replica, collectives};
  std::vector<Tensor> values(m.size());
  std::vector<ir::ValueId> last_use(m.size(), -1);
  if (keep)
    for (ir::ValueId v = 0; v < m.size(); ++v)
      for (ir::ValueId o : m.at(v).operands) last_use[o] = v;
  Operands operands;
  for (ir::ValueId v = 0; v < m.size(); ++v) {
    const Instr& in = m.at(v);
    operands.clear();
    for (ir::ValueId o : in.operands) {
      SS_CHECK(o >= 0 && o < v, "%", v, " uses %", o, " before it is defined");
      operands.push_back(&values[o]);
    }
    try {
      values[v] = Evaluate(ctx, in, operands);
    } catch (const Error& e) {
      if (ir::HasProperty(in.op, ir::kLeaf)) throw;
      throw Error(Str("%", v, " = ", ir::OpName(in.op), ": ", e.what()));
    }
    SS_CHECK(values[v].type == in.type, "%", v, " = ", ir::OpName(in.op), " computed ", values[v].type.ToString(),
             ", declared ", in.type.ToString());
    if (keep)
      for (ir::ValueId o : in.operands)
        if (last_use[o] == v && !(*keep)[o]) values[o] = Tensor();
  }
  return values;
}

}  // namespace

std::vector<Tensor> EvaluateAll(const ir::Module& m, const TensorMap& variables, const TensorMap& inputs,
                                int replica, Collectives* collectives) {
  return Run(m, variables, inputs, replica, collectives, nullptr);
}

TensorMap RunStep(const ir::Module& m, TensorMap& variables, const TensorMap& inputs, int replica,
                  Collectives* collectives) {
  std::vector<char> keep(m.size(), 0);
  for (const auto& [name, v] : m.outputs) keep[v] = 1;
  for (const auto& [var, v] : m.assigns) keep[v] = 1;
  std::vector<Tensor> values = Run(m, variables, inputs, replica, collectives, &keep);
  TensorMap outputs;
  for (const auto& [name, v] : m.outputs) outputs[name] = values.at(v);
  for (const auto& [var, v] : m.assigns) {
    SS_CHECK(values.at(v).type == m.at(var).type, "assign to @", m.at(var).name, " changes its type");
    variables[m.at(var).name] = values[v];
  }
  return outputs;
}

}  // namespace shardstep::runtime
