// The reference interpreter: one kernel per op of ir/ops.def, dispatched by a switch with no default.
// Written on xtensor (tensors adapted in place, data movement and pooling windows as views) with
// plain loops for the contractions, single-threaded: an oracle that shares no kernel with the JIT.
//
// Conventions every later backend must reproduce (to the bit where noted):
//  - s32 arithmetic wraps (two's complement); s32 division truncates and rejects a zero divisor.
//  - max/min propagate NaN; relu(x) = x > 0 ? x : 0 (relu(NaN) = NaN); convert f32 -> s32 truncates
//    toward zero and saturates (NaN -> 0).
//  - reduce_sum/mean accumulate in double in increasing input index order; reduce_max, max_pool take
//    the first maximum (a NaN counts as a maximum; max_pool's padded cells never win).
//  - random_uniform is Philox4x32-10 (runtime/philox.h), bitwise.
//  - bf16: every op with a bf16 operand or result runs as its f32 version on the operands widened
//    (exactly) to f32, and a bf16 result is that f32 result rounded to nearest even (F32ToBf16 in
//    runtime/tensor.h: NaN stays NaN, overflow rounds to inf). So a bf16 collective sums in f32 in the
//    f32 order and rounds once. Bitwise where the f32 op is.
// Backends may round differently (but must stay within rounding of these results) where:
//  - matmul and conv2d (and its gradients) accumulate their products in double, in index order of
//    the contracted dimensions, and round once; avg_pool and its gradient also sum in double.
#include "runtime/interpreter.h"

#include <xtensor/xadapt.hpp>
#include <xtensor/xarray.hpp>
#include <xtensor/xbroadcast.hpp>
#include <xtensor/xbuilder.hpp>
#include <xtensor/xmanipulation.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xnoalias.hpp>
#include <xtensor/xstrided_view.hpp>
#include <xtensor/xtensor.hpp>
#include <xtensor/xvectorize.hpp>
#include <xtensor/xview.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <type_traits>

#include "ir/error.h"
#include "ir/shape_inference.h"
#include "runtime/philox.h"
#include "runtime/xtensor_io.h"

namespace shardstep::runtime {
namespace {

using ir::DType;
using ir::Instr;
using ir::IntList;
using ir::OpCode;
using ir::TensorType;
using Operands = std::vector<const Tensor*>;
using Index = std::ptrdiff_t;
using Matrix = xt::xtensor<double, 2>;
using Image = xt::xtensor<double, 4>;  // NCHW activations, OIHW filters

// ---- Typed dispatch ----

// Calls f(T{}) with T = float for f32 and int32_t for s32.
template <typename F>
Tensor Typed(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(float{});
    case DType::kS32: return f(int32_t{});
    case DType::kBF16: break;  // widened to f32 before it gets here (EvaluateAnyFloat)
  }
  SS_CHECK(false, "bad dtype");
  return {};
}

// Assignments into views and new tensors below never alias their right-hand side, so they skip
// xtensor's temporary (xt::noalias). That also avoids xtensor 0.24's temporary for a strided view,
// which has rank 4 whatever the view's rank.

// A tensor of `type` holding the values of the xtensor expression `e` (of the same shape).
template <typename T, class E>
Tensor Make(const TensorType& type, E&& e) {
  Tensor out(type);
  xt::noalias(View<T>(out)) = std::forward<E>(e);
  return out;
}

// A copy of `a` with the instruction's type (same elements in the same order).
Tensor Reshape(const Instr& in, const Tensor& a) {
  Tensor out = a;
  out.type = in.type;
  return out;
}

// A tensor of `type` with every element `value`.
template <typename T>
Tensor Filled(const TensorType& type, T value) {
  Tensor out(type);
  View<T>(out).fill(value);
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
template <typename T>
T MaxOf(T a, T b) { return a > b || a != a ? a : b; }  // NaN wins
template <typename T>
T MinOf(T a, T b) { return a < b || a != a ? a : b; }

int32_t ToS32(double v) {  // truncation toward zero, saturating
  if (std::isnan(v)) return 0;
  if (v >= 2147483647.0) return std::numeric_limits<int32_t>::max();
  if (v <= -2147483648.0) return std::numeric_limits<int32_t>::min();
  return static_cast<int32_t>(v);
}

// ---- Elementwise ----

// out = f(a, b, ...) element by element, for operands and result of element type T.
template <typename T, typename F, typename... Ts>
Tensor Map(const TensorType& type, F f, const Ts&... operands) {
  auto typed = [f](std::conditional_t<true, T, Ts>... x) -> T { return static_cast<T>(f(x...)); };
  return Make<T>(type, xt::vectorize(typed)(View<T>(operands)...));
}

// The same for f generic over float and int32_t, at the operands' dtype.
template <typename F, typename... Ts>
Tensor MapAny(const Instr& in, F f, const Tensor& a, const Ts&... rest) {
  return Typed(a.dtype(), [&](auto t) { return Map<decltype(t)>(in.type, f, a, rest...); });
}

template <class E>
Tensor F32(const Instr& in, E&& e) { return Make<float>(in.type, std::forward<E>(e)); }

Tensor Divide(const Instr& in, const Tensor& a, const Tensor& b) {
  if (b.dtype() == DType::kS32 && xt::any(xt::equal(View<int32_t>(b), 0))) throw Error("s32 division by zero");
  return MapAny(in, [](auto x, auto y) { return DivOf(x, y); }, a, b);
}

Tensor Convert(const Instr& in, const Tensor& a) {
  if (in.type.dtype == a.dtype()) return Reshape(in, a);  // a copy
  if (in.type.dtype == DType::kF32) return F32(in, xt::cast<float>(View<int32_t>(a)));
  return Make<int32_t>(in.type, xt::vectorize([](float v) { return ToS32(v); })(View<float>(a)));
}

// select(cond != 0, a, b); a NaN condition is true.
Tensor Select(const Instr& in, const Tensor& cond, const Tensor& a, const Tensor& b) {
  const xt::xarray<bool> pick = cond.dtype() == DType::kF32 ? xt::xarray<bool>(xt::not_equal(View<float>(cond), 0.0f))
                                                            : xt::xarray<bool>(xt::not_equal(View<int32_t>(cond), 0));
  return Typed(a.dtype(), [&](auto t) {
    using T = decltype(t);
    return Make<T>(in.type, xt::where(pick, View<T>(a), View<T>(b)));
  });
}

// ---- Data movement ----

// Operand dimension i becomes output dimension dims[i] (dims increasing); the others are repeats.
Tensor Broadcast(const Instr& in, const Tensor& a) {
  const IntList& dims = in.GetInts("dims");
  std::vector<std::size_t> with_ones(in.type.rank(), 1);
  for (size_t i = 0; i < dims.size(); ++i) with_ones[dims[i]] = a.shape()[i];
  return Typed(a.dtype(), [&](auto t) {
    using T = decltype(t);
    if (a.elements() == 1) return Filled<T>(in.type, View<T>(a).data()[0]);  // the common scalar case, fast
    return Make<T>(in.type, xt::broadcast(xt::reshape_view(View<T>(a), with_ones), XShape(in.type.shape)));
  });
}

Tensor Transpose(const Instr& in, const Tensor& a) {  // out dim i = in dim perm[i]
  const IntList& perm = in.GetInts("perm");
  const std::vector<std::size_t> p(perm.begin(), perm.end());
  return Typed(a.dtype(), [&](auto t) { return Make<decltype(t)>(in.type, xt::transpose(View<decltype(t)>(a), p)); });
}

Tensor Slice(const Instr& in, const Tensor& a) {
  const IntList &start = in.GetInts("start"), &limit = in.GetInts("limit");
  xt::xstrided_slice_vector window;
  for (size_t i = 0; i < start.size(); ++i) window.push_back(xt::range(Index{start[i]}, Index{limit[i]}));
  return Typed(a.dtype(), [&](auto t) { return Make<decltype(t)>(in.type, xt::strided_view(View<decltype(t)>(a), window)); });
}

// `a` placed at offset `low` in a zero array of shape a.shape + low + high (the caller's `out`).
template <class O, class E>
void PadInto(O&& out, const E& a, const IntList& low) {
  xt::xstrided_slice_vector inner;
  for (size_t d = 0; d < low.size(); ++d) inner.push_back(xt::range(Index{low[d]}, Index(low[d] + a.shape()[d])));
  xt::noalias(xt::strided_view(out, inner)) = a;
}

Tensor Pad(const Instr& in, const Tensor& a) {
  Tensor out(in.type);
  Typed(a.dtype(), [&](auto t) {
    PadInto(View<decltype(t)>(out), View<decltype(t)>(a), in.GetInts("low"));
    return Tensor();
  });
  return out;
}

Tensor Concat(const Instr& in, const Operands& parts) {
  const int64_t axis = in.GetInt("axis");
  Tensor out(in.type);
  Typed(out.dtype(), [&](auto t) {
    using T = decltype(t);
    auto o = View<T>(out);
    Index at = 0;
    for (const Tensor* p : parts) {
      xt::xstrided_slice_vector place(in.type.rank(), xt::all());
      place[axis] = xt::range(at, at + p->shape()[axis]);
      xt::noalias(xt::strided_view(o, place)) = View<T>(*p);
      at += p->shape()[axis];
    }
    return Tensor();
  });
  return out;
}

// ---- Reductions ----

// Reduces `axes` away. The input is transposed so that each output element's inputs form one
// contiguous row in increasing input index order; each row is folded from left to right.
Tensor Reduce(const Instr& in, const Tensor& a) {
  const IntList& axes = in.GetInts("axes");
  std::vector<std::size_t> kept_then_reduced;
  Index count = 1;
  for (int64_t d = 0; d < a.type.rank(); ++d)
    if (!std::binary_search(axes.begin(), axes.end(), d)) kept_then_reduced.push_back(d);
  for (int64_t d : axes) kept_then_reduced.push_back(d), count *= a.shape()[d];

  return Typed(a.dtype(), [&](auto t) {
    using T = decltype(t);
    const xt::xarray<T> rows = xt::transpose(View<T>(a), kept_then_reduced);
    auto row = [&](Index i) { return rows.data() + i * count; };
    Tensor out(in.type);
    T* o = View<T>(out).data();
    for (Index i = 0; i < out.elements(); ++i) {
      if (in.op == OpCode::kReduceMax) {
        const T lowest = std::is_same_v<T, float> ? -INFINITY : std::numeric_limits<T>::lowest();
        o[i] = std::accumulate(row(i), row(i) + count, lowest, [](T m, T x) { return MaxOf(m, x); });
        continue;
      }
      const double sum = std::accumulate(row(i), row(i) + count, 0.0);
      if (in.op == OpCode::kReduceSum) o[i] = std::is_same_v<T, float> ? static_cast<T>(sum) : Wrap(int64_t(sum));
      else if (count == 0) o[i] = std::is_same_v<T, float> ? NAN : 0;
      else o[i] = static_cast<T>(sum / count);
    }
    return out;
  });
}

// ---- Matmul and convolution: products summed in double, in index order ----

// Matrix `batch` of a matmul operand (its last two dimensions) as doubles, transposed if asked.
Matrix MatrixOf(const Tensor& t, Index batch, bool transpose) {
  const ir::Shape& s = t.shape();
  const std::size_t r = s.size(), rows = s[r - 2], cols = s[r - 1];
  const std::array<std::size_t, 2> shape{rows, cols};
  const Matrix m = xt::cast<double>(xt::adapt(t.f32.data() + batch * rows * cols, shape));
  return transpose ? Matrix(xt::transpose(m)) : m;
}

// out[..., i, j] = sum over l of a[..., i, l] * b[..., l, j], one product per batch element.
Tensor Matmul(const Instr& in, const Tensor& a, const Tensor& b) {
  const bool ta = in.GetInt("transpose_a", 0) != 0, tb = in.GetInt("transpose_b", 0) != 0;
  const ir::Shape& s = in.type.shape;
  const std::size_t m = s[s.size() - 2], n = s[s.size() - 1];
  const Index batches = in.type.elements() / std::max<Index>(1, Index(m * n));
  Tensor out(in.type);
  for (Index bt = 0; bt < (m * n != 0 ? batches : 0); ++bt) {
    const Matrix x = MatrixOf(a, bt, ta), y = MatrixOf(b, bt, tb);
    Matrix acc = xt::zeros<double>({x.shape(0), y.shape(1)});
    for (std::size_t i = 0; i < x.shape(0); ++i)
      for (std::size_t l = 0; l < x.shape(1); ++l)
        for (std::size_t j = 0; j < y.shape(1); ++j) acc(i, j) += x(i, l) * y(l, j);
    std::copy(acc.begin(), acc.end(), out.f32.begin() + bt * Index(m * n));  // each rounded once to f32
  }
  return out;
}

// ---- Attention: per leading index, the decomposed form's steps in order (scores, softmax, product) ----

// One leading index's [T, D] blocks of q, k, v (and dout), and its T x T probabilities.
struct AttentionBlock {
  Index t, d;
  float scale;
  bool causal, bf16;
  explicit AttentionBlock(const Instr& in)
      : t(in.type.shape[in.type.rank() - 2]),
        d(in.type.shape.back()),
        scale(static_cast<float>(in.GetFloat("scale"))),
        causal(in.GetInt("causal", 0) != 0),
        bf16(in.GetInt("bf16", 0) != 0) {}
  // Row i's dot products with the rows of y: x[i] . y[j] in double, rounded once.
  float Dot(const float* x, const float* y) const {
    double acc = 0;
    for (Index l = 0; l < d; ++l) acc += double(x[l]) * double(y[l]);
    return static_cast<float>(acc);
  }
  // p = softmax(scale q k^T, masked above the diagonal when causal): scores rounded from the product,
  // times scale; the row max; exp(s - max) (a masked score gives 0); their sum in double rounded once;
  // p = e * (1 / sum).
  std::vector<float> Probabilities(const float* q, const float* k) const {
    std::vector<float> p(t * t, 0.0f);
    for (Index i = 0; i < t; ++i) {
      const Index last = causal ? i : t - 1;
      float* row = p.data() + i * t;
      float m = -INFINITY;
      for (Index j = 0; j <= last; ++j) {
        row[j] = Dot(q + i * d, k + j * d) * scale;
        m = row[j] > m || row[j] != row[j] ? row[j] : m;
      }
      double total = 0;
      for (Index j = 0; j <= last; ++j) total += row[j] = std::exp(row[j] - m);
      const float r = 1.0f / static_cast<float>(total);
      for (Index j = 0; j <= last; ++j) row[j] *= r;
    }
    return p;
  }
  float Round(float x) const { return bf16 ? runtime::RoundToBf16(x) : x; }
  // out[i] = sum over j of a[i, j] * y[j] (a: T x T, row i; y rows of D), in double, rounded once.
  void Product(const float* a, const float* y, bool transpose_a, float* out) const {
    for (Index i = 0; i < t; ++i)
      for (Index l = 0; l < d; ++l) {
        double acc = 0;
        for (Index j = 0; j < t; ++j) acc += double(transpose_a ? a[j * t + i] : a[i * t + j]) * double(y[j * d + l]);
        out[i * d + l] = static_cast<float>(acc);
      }
  }
};

// With bf16=1 the operands are products' operands: rounded to bf16 (a no-op on the mixed-precision
// pass's rounded values).
Tensor RoundedIf(bool bf16, const Tensor& x) {
  Tensor y = x;
  if (bf16)
    for (float& e : y.f32) e = runtime::RoundToBf16(e);
  return y;
}

Tensor Attention(const Instr& in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in) {
  const AttentionBlock g(in);
  const Tensor q = RoundedIf(g.bf16, q_in), k = RoundedIf(g.bf16, k_in), v = RoundedIf(g.bf16, v_in);
  Tensor out(in.type);
  const Index block = g.t * g.d, blocks = g.t * g.d == 0 ? 0 : in.type.elements() / block;
  for (Index bt = 0; bt < blocks; ++bt) {
    std::vector<float> p = g.Probabilities(q.f32.data() + bt * block, k.f32.data() + bt * block);
    for (float& x : p) x = g.Round(x);
    g.Product(p.data(), v.f32.data() + bt * block, false, out.f32.data() + bt * block);
  }
  return out;
}

// dP = dout v^T; dv = p^T dout (p rounded when bf16); ds = p (dP - rowsum(dP p)) * scale (rounded when
// bf16), 0 where causal masks the score; dq = ds k; dk = ds^T q. Stacked [dq, dk, dv].
Tensor AttentionGrad(const Instr& in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                     const Tensor& dout_in) {
  const AttentionBlock g(in);
  const Tensor q = RoundedIf(g.bf16, q_in), k = RoundedIf(g.bf16, k_in), v = RoundedIf(g.bf16, v_in),
               dout = RoundedIf(g.bf16, dout_in);
  Tensor out(in.type);
  const Index block = g.t * g.d, total = q.type.elements(), blocks = block == 0 ? 0 : total / block;
  for (Index bt = 0; bt < blocks; ++bt) {
    const Index at = bt * block;
    const std::vector<float> p = g.Probabilities(q.f32.data() + at, k.f32.data() + at);
    std::vector<float> pr(p), ds(g.t * g.t);
    for (float& x : pr) x = g.Round(x);
    for (Index i = 0; i < g.t; ++i) {
      // A masked score (causal, key after query) is no function of q or k: its gradient is 0, and it
      // takes no part in the row's sum (an inf or NaN in dp there stays out, as it stays out of p).
      const Index last = g.causal ? i : g.t - 1;
      std::vector<float> dp(g.t);
      double dot = 0;
      for (Index j = 0; j <= last; ++j) {
        dp[j] = g.Dot(dout.f32.data() + at + i * g.d, v.f32.data() + at + j * g.d);
        dot += double(dp[j]) * double(p[i * g.t + j]);
      }
      const float rowdot = static_cast<float>(dot);
      for (Index j = 0; j < g.t; ++j)
        ds[i * g.t + j] = j <= last ? g.Round(p[i * g.t + j] * (dp[j] - rowdot) * g.scale) : 0.0f;
    }
    g.Product(ds.data(), k.f32.data() + at, false, out.f32.data() + at);                // dq
    g.Product(ds.data(), q.f32.data() + at, true, out.f32.data() + total + at);         // dk
    g.Product(pr.data(), dout.f32.data() + at, true, out.f32.data() + 2 * total + at);  // dv
  }
  return out;
}

struct Conv {
  Index sh, sw, ph, pw;
  explicit Conv(const Instr& in) {
    const IntList s = in.GetInts("stride", {1, 1}), p = in.GetInts("padding", {0, 0});
    sh = s[0], sw = s[1], ph = p[0], pw = p[1];
  }
  // The input in double, zero-padded.
  Image Padded(const Tensor& x) const {
    const ir::Shape& s = x.shape();
    Image xp = xt::zeros<double>({s[0], s[1], s[2] + 2 * ph, s[3] + 2 * pw});
    PadInto(xp, xt::cast<double>(View<float>(x)), {0, 0, ph, pw});
    return xp;
  }
};

Image ImageOf(const Tensor& t) { return xt::cast<double>(View<float>(t)); }

// y[n,o,p,q] = sum over (c,i,j) of w[o,c,i,j] * xp[n, c, p*sh + i, q*sw + j]   (xp: x zero-padded)
Tensor Conv2d(const Instr& in, const Tensor& x, const Tensor& w) {
  const Conv g(in);
  const Image xp = g.Padded(x), wd = ImageOf(w);
  Image y = xt::zeros<double>(XShape(in.type.shape));
  const auto [N, O, P, Q] = y.shape();
  const auto [_, C, KH, KW] = wd.shape();
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t o = 0; o < O; ++o)
      for (std::size_t c = 0; c < C; ++c)
        for (std::size_t i = 0; i < KH; ++i)
          for (std::size_t j = 0; j < KW; ++j) {
            const double weight = wd(o, c, i, j);
            for (std::size_t p = 0; p < P; ++p)
              for (std::size_t q = 0; q < Q; ++q) y(n, o, p, q) += weight * xp(n, c, p * g.sh + i, q * g.sw + j);
          }
  return F32(in, xt::cast<float>(y));
}

// The adjoint: dxp[n, c, p*sh + i, q*sw + j] += w[o,c,i,j] * dy[n,o,p,q] in order of (o,i,j); dx is
// dxp without its padding.
Tensor Conv2dInputGrad(const Instr& in, const Tensor& dy, const Tensor& w) {
  const Conv g(in);
  const Image d = ImageOf(dy), wd = ImageOf(w);
  const auto [N, O, P, Q] = d.shape();
  const auto [_, C, KH, KW] = wd.shape();
  const Index H = in.type.shape[2], W = in.type.shape[3];
  Image dxp = xt::zeros<double>({N, C, std::size_t(H + 2 * g.ph), std::size_t(W + 2 * g.pw)});
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t c = 0; c < C; ++c)
      for (std::size_t o = 0; o < O; ++o)
        for (std::size_t i = 0; i < KH; ++i)
          for (std::size_t j = 0; j < KW; ++j) {
            const double weight = wd(o, c, i, j);
            for (std::size_t p = 0; p < P; ++p)
              for (std::size_t q = 0; q < Q; ++q) dxp(n, c, p * g.sh + i, q * g.sw + j) += weight * d(n, o, p, q);
          }
  const auto unpadded = xt::strided_view(dxp, {xt::all(), xt::all(), xt::range(g.ph, g.ph + H), xt::range(g.pw, g.pw + W)});
  return F32(in, xt::cast<float>(unpadded));
}

// dw[o,c,i,j] = sum over (n,p,q) of dy[n,o,p,q] * xp[n, c, p*sh + i, q*sw + j].
Tensor Conv2dFilterGrad(const Instr& in, const Tensor& x, const Tensor& dy) {
  const Conv g(in);
  const Image xp = g.Padded(x), d = ImageOf(dy);
  Image dw = xt::zeros<double>(XShape(in.type.shape));
  const auto [O, C, KH, KW] = dw.shape();
  const auto [N, _, P, Q] = d.shape();
  for (std::size_t o = 0; o < O; ++o)
    for (std::size_t c = 0; c < C; ++c)
      for (std::size_t i = 0; i < KH; ++i)
        for (std::size_t j = 0; j < KW; ++j)
          for (std::size_t n = 0; n < N; ++n)
            for (std::size_t p = 0; p < P; ++p)
              for (std::size_t q = 0; q < Q; ++q) dw(o, c, i, j) += d(n, o, p, q) * xp(n, c, p * g.sh + i, q * g.sw + j);
  return F32(in, xt::cast<float>(dw));
}

// ---- Pooling (max_pool may pad; padded cells never win) ----

struct Window {
  Index kh, kw, sh, sw, oh, ow, pad;
  Window(const ir::Shape& x, const Instr& in) {
    const IntList& k = in.GetInts("window");
    const IntList s = in.Has("stride") ? in.GetInts("stride") : k;
    kh = k[0], kw = k[1], sh = s[0], sw = s[1];
    pad = in.op == OpCode::kAvgPool || in.op == OpCode::kAvgPoolGrad ? 0 : in.GetInt("padding", 0);
    oh = (x[2] + 2 * pad - kh) / sh + 1, ow = (x[3] + 2 * pad - kw) / sw + 1;
  }
  // Tap (a, b) of every window: element (a, b) of each, as an [N, C, oh, ow] strided view of x.
  template <class E>
  auto Tap(E& x, Index a, Index b) const {
    return xt::strided_view(x, {xt::all(), xt::all(), xt::range(a, a + sh * (oh - 1) + 1, sh),
                                xt::range(b, b + sw * (ow - 1) + 1, sw)});
  }
};

// Each window's first maximum among its real (unpadded) cells (a NaN counts as a maximum) and its
// tap a * kw + b, over x zero-padded by g.pad with a mask of its real cells.
struct WindowMax {
  xt::xarray<float> value;
  xt::xarray<Index> tap;
};

xt::xarray<float> PaddedBy(const xt::xarray<float>& x, Index pad) {
  if (pad == 0) return x;
  const auto& s = x.shape();
  xt::xarray<float> out = xt::zeros<float>({s[0], s[1], s[2] + 2 * pad, s[3] + 2 * pad});
  PadInto(out, x, {0, 0, pad, pad});
  return out;
}

WindowMax MaxOfWindows(const Tensor& x, const Window& g) {
  const xt::xarray<float> xp = PaddedBy(View<float>(x), g.pad);
  const xt::xarray<float> real = PaddedBy(xt::ones<float>(XShape(x.shape())), g.pad);
  WindowMax m{g.Tap(xp, 0, 0), xt::zeros<Index>(XShape({x.shape()[0], x.shape()[1], g.oh, g.ow}))};
  xt::xarray<bool> have = xt::not_equal(g.Tap(real, 0, 0), 0.0f);  // a real candidate seen
  auto takes = xt::vectorize([](float c, bool is_real, float best, bool seen) -> bool {
    return is_real && (!seen || c > best || (c != c && best == best));
  });
  for (Index a = 0; a < g.kh; ++a)
    for (Index b = a == 0 ? 1 : 0; b < g.kw; ++b) {
      const xt::xarray<float> c = g.Tap(xp, a, b);
      const xt::xarray<bool> r = xt::not_equal(g.Tap(real, a, b), 0.0f);
      const xt::xarray<bool> take = takes(c, r, m.value, have);
      m.value = xt::where(take, c, m.value);
      m.tap = xt::where(take, a * g.kw + b, m.tap);
      have = have || r;
    }
  return m;
}

Tensor MaxPool(const Instr& in, const Tensor& x) { return F32(in, MaxOfWindows(x, Window(x.shape(), in)).value); }

// dy goes to each window's first maximum (accumulated on the padded grid, whose padding gets none).
Tensor MaxPoolGrad(const Instr& in, const Tensor& x, const Tensor& dy) {
  const Window g(x.shape(), in);
  const WindowMax m = MaxOfWindows(x, g);
  const ir::Shape& s = x.shape();
  xt::xarray<float> dxp = xt::zeros<float>({s[0], s[1], s[2] + 2 * g.pad, s[3] + 2 * g.pad});
  for (Index a = 0; a < g.kh; ++a)
    for (Index b = 0; b < g.kw; ++b)
      xt::noalias(g.Tap(dxp, a, b)) += xt::where(xt::equal(m.tap, a * g.kw + b), View<float>(dy), 0.0f);
  return F32(in, xt::view(dxp, xt::all(), xt::all(), xt::range(g.pad, g.pad + s[2]), xt::range(g.pad, g.pad + s[3])));
}

Tensor AvgPool(const Instr& in, const Tensor& x) {
  const Window g(x.shape(), in);
  const xt::xarray<double> xd = xt::cast<double>(View<float>(x));
  xt::xarray<double> sum = xt::zeros<double>(XShape(in.type.shape));
  for (Index a = 0; a < g.kh; ++a)
    for (Index b = 0; b < g.kw; ++b) sum += g.Tap(xd, a, b);
  return F32(in, xt::cast<float>(sum / double(g.kh * g.kw)));
}

Tensor AvgPoolGrad(const Instr& in, const Tensor& dy) {
  const Window g(in.type.shape, in);
  const xt::xarray<double> share = xt::cast<double>(View<float>(dy)) / double(g.kh * g.kw);
  xt::xarray<double> dx = xt::zeros<double>(XShape(in.type.shape));
  for (Index a = 0; a < g.kh; ++a)
    for (Index b = 0; b < g.kw; ++b) xt::noalias(g.Tap(dx, a, b)) += share;
  return F32(in, xt::cast<float>(dx));
}

// ---- Index and random tensors ----

// Each element's index along `dimension`.
Tensor Iota(const Instr& in) {
  const ir::Shape& s = in.type.shape;
  const int64_t d = in.GetInt("dimension");
  Index inner = 1;
  for (size_t i = d + 1; i < s.size(); ++i) inner *= s[i];
  return Typed(in.type.dtype, [&](auto t) {
    using T = decltype(t);
    Tensor out(in.type);
    T* o = View<T>(out).data();
    for (Index i = 0; i < out.elements(); ++i) o[i] = static_cast<T>((i / inner) % s[d]);
    return out;
  });
}

// Element (i, rest...) = PhiloxUniform(seed, flat index of rest, first_example + i, step).
Tensor RandomUniform(const Instr& in, const Tensor& step, const Tensor& first_example) {
  const uint64_t seed = static_cast<uint64_t>(in.GetInt("seed"));
  const ir::Shape& s = in.type.shape;
  Index per_example = 1;  // elements of one example: the product of dimensions 1...
  for (size_t d = 1; d < s.size(); ++d) per_example *= s[d];
  Tensor out(in.type);
  for (Index i = 0; i < out.elements(); ++i) {
    const uint32_t e = static_cast<uint32_t>(first_example.s32[0]) + static_cast<uint32_t>(i / per_example);
    out.f32[i] = PhiloxUniform(seed, static_cast<uint32_t>(i % per_example), e, static_cast<uint32_t>(step.s32[0]));
  }
  return out;
}

// ---- Labels and embeddings ----

Index CheckedIndex(int32_t i, Index limit, const char* what) {
  if (i < 0 || i >= limit) throw Error(Str(what, " ", i, " out of range [0,", limit, ")"));
  return i;
}

// A tensor seen as `rows` rows of equal width.
template <typename T, class AnyTensor>
auto Rows(AnyTensor& t, Index rows) {
  const std::size_t width = rows ? t.elements() / rows : 0;
  return xt::reshape_view(View<T>(t), std::vector<std::size_t>{std::size_t(rows), width});
}

Tensor OneHot(const Instr& in, const Tensor& labels) {
  const Index depth = in.GetInt("depth");
  Tensor out(in.type);
  auto o = Rows<float>(out, labels.elements());
  for (Index i = 0; i < labels.elements(); ++i) o(i, CheckedIndex(labels.s32[i], depth, "label")) = 1;
  return out;
}

// out[i, ...] = table[idx[i], ...].
Tensor Gather(const Instr& in, const Tensor& table, const Tensor& idx) {
  const Index rows = table.shape()[0];
  for (int32_t i : idx.s32) CheckedIndex(i, rows, "gather index");
  return Typed(table.dtype(), [&](auto t) {
    using T = decltype(t);
    Tensor out(in.type);
    auto o = Rows<T>(out, idx.elements());
    const auto from = Rows<T>(table, rows);
    for (Index i = 0; i < idx.elements(); ++i) xt::noalias(xt::view(o, i)) = xt::view(from, idx.s32[i]);
    return out;
  });
}

// out[idx[i], ...] += updates[i, ...], in increasing i.
Tensor ScatterAdd(const Instr& in, const Tensor& idx, const Tensor& updates) {
  const Index rows = in.GetInt("rows");
  for (int32_t i : idx.s32) CheckedIndex(i, rows, "scatter_add index");
  return Typed(updates.dtype(), [&](auto t) {
    using T = decltype(t);
    Tensor out(in.type);
    auto o = Rows<T>(out, rows);
    const auto u = Rows<T>(updates, idx.elements());
    auto add = xt::vectorize([](T a, T b) -> T { return AddOf(a, b); });
    for (Index i = 0; i < idx.elements(); ++i) {
      auto row = xt::view(o, idx.s32[i]);
      xt::noalias(row) = add(row, xt::view(u, i));  // element by element: no overlap
    }
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

// This replica's target and source in a collective_permute's pairs (-1: none).
std::pair<int, int> PermutePeers(const Instr& in, int replica) {
  int to = -1, from = -1;
  for (const auto& p : in.GetIntLists("pairs")) {
    if (p.at(0) == replica) to = static_cast<int>(p[1]);
    if (p.at(1) == replica) from = static_cast<int>(p[0]);
  }
  return {to, from};
}

Tensor CollectivePermute(const Context& ctx, const Instr& in, const Tensor& x) {
  const auto [to, from] = PermutePeers(in, ctx.replica);
  Tensor out(in.type);  // zeros unless a replica sends here
  if (to < 0 && from < 0) return out;
  if (!ctx.collectives) {
    if (to != ctx.replica || from != ctx.replica)
      throw Error(Str("collective_permute between replicas ", ctx.replica, " and ", to >= 0 ? to : from,
                      " needs a Collectives implementation"));
    return x;
  }
  if (x.dtype() != DType::kF32) throw Error(Str("the Collectives interface carries f32 only, got ", x.type.ToString()));
  ctx.collectives->Permute(ctx.replica, to, x.f32.data(), from, out.f32.data(), x.elements(),
                           static_cast<int>(in.GetInt("direction", 1)));
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
  const size_t held = t.held();
  if (static_cast<int64_t>(held) != t.elements())
    throw Error(Str(what, " @", in.name, ": ", t.type.ToString(), " holds ", held, " values"));
  return t;
}

Tensor Splat(const Instr& in) {
  const double v = in.GetFloat("value");
  if (in.type.dtype == DType::kF32) return Filled(in.type, static_cast<float>(v));
  return Filled(in.type, ToS32(v));
}

// ---- The op switch ----

// Shape inference does not check the dtype of convolution and pooling operands; these kernels read f32.
const Operands& F32Only(const Operands& x) {
  for (const Tensor* t : x)
    if (t->dtype() != DType::kF32) throw Error(Str("operands must be f32, got ", t->type.ToString()));
  return x;
}

Tensor Evaluate(const Context& ctx, const Instr& in, const Operands& x) {
  auto f = [&](int i) { return View<float>(*x[i]); };
  switch (in.op) {
    case OpCode::kVariable: return Lookup(ctx.variables, "variable", in);
    case OpCode::kInput: return Lookup(ctx.inputs, "input", in);
    case OpCode::kConstant: return Splat(in);
    case OpCode::kReplicaId: return Tensor::S32({}, {ctx.replica});
    case OpCode::kIota: return Iota(in);

    case OpCode::kNeg: return MapAny(in, [](auto a) { return NegOf(a); }, *x[0]);
    case OpCode::kExp: return F32(in, xt::exp(f(0)));
    case OpCode::kLog: return F32(in, xt::log(f(0)));
    case OpCode::kSqrt: return F32(in, xt::sqrt(f(0)));
    case OpCode::kRsqrt: return F32(in, 1.0f / xt::sqrt(f(0)));
    case OpCode::kTanh: return F32(in, xt::tanh(f(0)));
    case OpCode::kSin: return F32(in, xt::sin(f(0)));
    case OpCode::kCos: return F32(in, xt::cos(f(0)));
    case OpCode::kSigmoid: return F32(in, 1.0f / (1.0f + xt::exp(-f(0))));
    case OpCode::kRelu: return Map<float>(in.type, [](float a) { return a > 0.0f || a != a ? a : 0.0f; }, *x[0]);
    case OpCode::kAbs: return MapAny(in, [](auto a) { return AbsOf(a); }, *x[0]);
    case OpCode::kConvert: return Convert(in, *x[0]);
    case OpCode::kStopGradient: return *x[0];

    case OpCode::kAdd: return MapAny(in, [](auto a, auto b) { return AddOf(a, b); }, *x[0], *x[1]);
    case OpCode::kSub: return MapAny(in, [](auto a, auto b) { return SubOf(a, b); }, *x[0], *x[1]);
    case OpCode::kMul: return MapAny(in, [](auto a, auto b) { return MulOf(a, b); }, *x[0], *x[1]);
    case OpCode::kDiv: return Divide(in, *x[0], *x[1]);
    case OpCode::kPow: return F32(in, xt::pow(f(0), f(1)));
    case OpCode::kMax: return MapAny(in, [](auto a, auto b) { return MaxOf(a, b); }, *x[0], *x[1]);
    case OpCode::kMin: return MapAny(in, [](auto a, auto b) { return MinOf(a, b); }, *x[0], *x[1]);
    case OpCode::kEq: return MapAny(in, [](auto a, auto b) { return a == b; }, *x[0], *x[1]);
    case OpCode::kNe: return MapAny(in, [](auto a, auto b) { return a != b; }, *x[0], *x[1]);
    case OpCode::kLt: return MapAny(in, [](auto a, auto b) { return a < b; }, *x[0], *x[1]);
    case OpCode::kLe: return MapAny(in, [](auto a, auto b) { return a <= b; }, *x[0], *x[1]);
    case OpCode::kGt: return MapAny(in, [](auto a, auto b) { return a > b; }, *x[0], *x[1]);
    case OpCode::kGe: return MapAny(in, [](auto a, auto b) { return a >= b; }, *x[0], *x[1]);
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
    case OpCode::kAttention: return Attention(in, *x[0], *x[1], *x[2]);
    case OpCode::kAttentionGrad: return AttentionGrad(in, *x[0], *x[1], *x[2], *x[3]);

    case OpCode::kRandomUniform: return RandomUniform(in, *x[0], *x[1]);

    case OpCode::kOneHot: return OneHot(in, *x[0]);
    case OpCode::kGather: return Gather(in, *x[0], *x[1]);
    case OpCode::kScatterAdd: return ScatterAdd(in, *x[0], *x[1]);

    case OpCode::kAllReduce: return AllReduce(ctx, in, *x[0]);
    case OpCode::kReduceScatter: return ReduceScatter(ctx, in, *x[0]);
    case OpCode::kAllGather: return AllGather(ctx, in, *x[0]);
    case OpCode::kCollectivePermute: return CollectivePermute(ctx, in, *x[0]);
  }
  SS_CHECK(false, "unhandled op ", ir::OpName(in.op));
  return {};
}

// bf16 (see the conventions above): widen, evaluate as f32, round the result.
Tensor EvaluateAnyFloat(const Context& ctx, const Instr& in, const Operands& x) {
  bool bf16 = in.type.dtype == DType::kBF16 && in.op != OpCode::kVariable && in.op != OpCode::kInput;
  for (const Tensor* t : x) bf16 |= t->dtype() == DType::kBF16;
  if (!bf16) return Evaluate(ctx, in, x);
  std::vector<Tensor> wide;
  wide.reserve(x.size());
  Operands wx;
  for (const Tensor* t : x) {
    if (t->dtype() != DType::kBF16) {
      wx.push_back(t);
      continue;
    }
    wide.push_back(t->AsFloat(DType::kF32));
    wx.push_back(&wide.back());
  }
  Instr f32 = in;
  if (f32.type.dtype == DType::kBF16) f32.type.dtype = DType::kF32;
  Tensor r = Evaluate(ctx, f32, wx);
  return in.type.dtype == DType::kBF16 ? r.AsFloat(DType::kBF16) : r;
}

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
      values[v] = EvaluateAnyFloat(ctx, in, operands);
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
