// Native CPU lowerings (see native_ops.h).
#include "jit/native_ops.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "ir/error.h"
#include "runtime/tensor.h"
#include "jit/dnnl_kernels.h"

namespace shardstep::jit {

void BatchedMatmul(const ir::Instr& in, const ir::Shape& a, const ir::Shape& c, const float* av, const float* cv,
                   float* out) {
  const bool ta = in.GetInt("transpose_a", 0) != 0, tb = in.GetInt("transpose_b", 0) != 0;
  const size_t r = a.size();
  const int64_t m = in.type.shape[r - 2], n = in.type.shape[r - 1], k = ta ? a[r - 2] : a[r - 1];
  const int64_t sa = a[r - 2] * a[r - 1], sc = c[r - 2] * c[r - 1];
  int64_t batches = 1;
  for (size_t d = 0; d + 2 < r; ++d) batches *= a[d];
  // Batch elements are independent products (each one's result does not depend on the threads):
  // run them as TBB tasks, each splitting further only when large (ParallelSgemm's row blocks).
  tbb::parallel_for(int64_t{0}, batches, [&](int64_t bt) {
    ParallelSgemm(ta, tb, m, n, k, av + bt * sa, a[r - 1], cv + bt * sc, c[r - 1], out + bt * m * n);
  });
}

void Iota(const ir::TensorType& type, int64_t dimension, void* out) {
  const ir::Shape& s = type.shape;
  int64_t inner = 1;
  for (size_t d = dimension + 1; d < s.size(); ++d) inner *= s[d];
  const int64_t total = type.elements(), len = s[dimension];
  if (type.dtype == ir::DType::kF32) {
    float* o = static_cast<float*>(out);
    for (int64_t i = 0; i < total; ++i) o[i] = static_cast<float>((i / inner) % len);
  } else if (type.dtype == ir::DType::kBF16) {  // the f32 index rounded to nearest even, as the interpreter
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < total; ++i) o[i] = runtime::F32ToBf16(static_cast<float>((i / inner) % len));
  } else {
    int32_t* o = static_cast<int32_t*>(out);
    for (int64_t i = 0; i < total; ++i) o[i] = static_cast<int32_t>((i / inner) % len);
  }
}

template <typename T>
void ScatterAdd(const int32_t* idx, int64_t count, const T* updates, int64_t rows, int64_t width, T* out) {
  for (int64_t i = 0; i < count; ++i)
    if (idx[i] < 0 || idx[i] >= rows) throw Error(Str("scatter_add index ", idx[i], " out of range [0,", rows, ")"));
  std::fill(out, out + rows * width, T{});
  for (int64_t i = 0; i < count; ++i) {
    T* o = out + idx[i] * width;
    const T* u = updates + i * width;
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t j = 0; j < width; ++j) o[j] += u[j];
    } else {  // two's-complement wrap, without signed overflow
      for (int64_t j = 0; j < width; ++j)
        o[j] = static_cast<int32_t>(static_cast<uint32_t>(o[j]) + static_cast<uint32_t>(u[j]));
    }
  }
}
template void ScatterAdd<float>(const int32_t*, int64_t, const float*, int64_t, int64_t, float*);
template void ScatterAdd<int32_t>(const int32_t*, int64_t, const int32_t*, int64_t, int64_t, int32_t*);

namespace {
template <typename F>
void ForEachPlane(const runtime::PoolWindow& g, F f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(g.h * g.w, 1));
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, g.planes, grain), [&](const tbb::blocked_range<int64_t>& r) {
    for (int64_t p = r.begin(); p < r.end(); ++p) f(p);
  });
}
}  // namespace

void AvgPool(const runtime::PoolWindow& g, const float* x, float* y) {
  const double area = static_cast<double>(g.kh * g.kw);
  ForEachPlane(g, [&](int64_t p) {
    const float* plane = x + p * g.h * g.w;
    for (int64_t oy = 0; oy < g.oh; ++oy)
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        const float* win = plane + oy * g.sh * g.w + ox * g.sw;
        double sum = 0;
        for (int64_t a = 0; a < g.kh; ++a)
          for (int64_t b = 0; b < g.kw; ++b) sum += win[a * g.w + b];
        y[(p * g.oh + oy) * g.ow + ox] = static_cast<float>(sum / area);
      }
  });
}

void AvgPoolGrad(const runtime::PoolWindow& g, const float* dy, float* dx) {
  const double area = static_cast<double>(g.kh * g.kw);
  ForEachPlane(g, [&](int64_t p) {
    const float* d = dy + p * g.oh * g.ow;
    for (int64_t y = 0; y < g.h; ++y)
      for (int64_t x = 0; x < g.w; ++x) {
        double sum = 0;
        for (int64_t a = 0; a < g.kh; ++a) {
          const int64_t ty = y - a;
          if (ty < 0 || ty % g.sh != 0 || ty / g.sh >= g.oh) continue;
          for (int64_t b = 0; b < g.kw; ++b) {
            const int64_t tx = x - b;
            if (tx < 0 || tx % g.sw != 0 || tx / g.sw >= g.ow) continue;
            sum += static_cast<double>(d[(ty / g.sh) * g.ow + tx / g.sw]) / area;
          }
        }
        dx[(p * g.h + y) * g.w + x] = static_cast<float>(sum);
      }
  });
}

void DivS32(const int32_t* a, const int32_t* b, int64_t n, int32_t* out) {
  for (int64_t i = 0; i < n; ++i)
    if (b[i] == 0) throw Error("s32 division by zero");
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<int64_t>(a[i]) / b[i]));
}

}  // namespace shardstep::jit
