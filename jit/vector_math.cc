// VectorMath: exp, log, tanh of f32 as inline IR that the loop vectoriser can widen.
//
// Everything is straight-line: special inputs are clamped into the ordinary path and the result is
// patched with selects, so the IR is the same per element whether it runs in a vector body or a
// scalar tail. Only llvm.fma is fused (explicitly; the target never contracts), so the bits do not
// depend on the vector width. Integer ops stay within AVX2 (no i64 <-> f64 conversions, no 64-bit
// arithmetic shifts). Error bounds are against the exact value, measured over every f32 input
// (tests/jit/vector_math_slow_test.cc); glibc's own expf / logf / tanhf are 0.50 / 0.82 / 2.13 ulp.
//  exp:  f32 throughout (SLEEF's expf_u10 scheme): k = rint(x log2 e); r = x - k ln2 in two
//        Cody-Waite FMA steps; exp(r) = 1 + r + r^2 P5(r), a minimax polynomial; 2^k is built from
//        the exponent bits as 2^(k/2) * 2^(k - k/2), so that results in the subnormal range are
//        rounded once (gradual underflow as libm) and 2^k itself never overflows. x is clamped to
//        [-104, 104] (exp(-104) rounds to +0, exp(104) to +inf); NaN -> NaN. <= 0.97 ulp.
//  log:  in f64 (the f32 input widens exactly, so subnormals need no special case): x = 2^e m with
//        m in [sqrt(1/2), sqrt(2)) by integer ops on the f64 bits; log(m) = 2 atanh(s),
//        s = (m - 1) / (m + 1), |s| < 0.172, by its series up to s^15 (truncation < 2^-40);
//        e ln2 + log(m) rounded to f32 once. log(+-0) = -inf, log(x < 0) = NaN, log(+inf) = +inf.
//        <= 0.5 ulp + 2^-30.
//  tanh: f32 throughout: |x| < 0.7: |x| + |x|^3 P(|x|^2), a degree-7 polynomial in x^2 (kTanhPoly);
//        else 1 - 2 / (exp(2|x|) + 1) with the exp above, |x| clamped to 9.5 (tanh rounds to 1 from
//        9.01); the sign copied back (tanh(-0) = -0). <= 1.06 ulp. (An f64 expm1 and division before:
//        <= 0.5 ulp, but 1.7x the time of transformer_lm's GELU loops, which tanh dominates.)
// Against glibc, then, exp and log are within 1 ulp and tanh within 2 (measured over every f32 input:
// glibc's own 2.13 ulp decides it).
#include "jit/vector_math.h"

#include <llvm/IR/Constants.h>
#include <llvm/IR/Intrinsics.h>

#include <cstdlib>
#include <cstring>
#include <limits>

#include "jit/avx512_variants.h"

namespace shardstep::jit {

bool ScalarLibm() {
  const char* e = std::getenv("SHARDSTEP_SCALAR_LIBM");
  return e && std::strcmp(e, "1") == 0;
}

// SLEEF 3.x expf_u10's coefficients (minimax on [-ln2/2, ln2/2], with the 1 + r + r^2 form).
const ExpCoefficients kExpCoefficients = {0.000198527617612853646278381f, 0.00139304355252534151077271f,
                                          0.00833336077630519866943359f,  0.0416664853692054748535156f,
                                          0.166666671633720397949219f,    0.5f};

namespace {

// `like`'s shape (scalar or vector) with element type `elem`.
llvm::Type* Shaped(llvm::Type* like, llvm::Type* elem) {
  if (auto* v = llvm::dyn_cast<llvm::VectorType>(like)) return llvm::VectorType::get(elem, v->getElementCount());
  return elem;
}

struct Ops {
  llvm::IRBuilder<>& b;
  llvm::Value* C(llvm::Type* t, double v) const { return llvm::ConstantFP::get(t, v); }
  llvm::Value* I(llvm::Type* t, uint64_t v) const { return llvm::ConstantInt::get(t, v); }
  llvm::Value* Fma(llvm::Value* x, llvm::Value* y, llvm::Value* z) const {
    return b.CreateIntrinsic(llvm::Intrinsic::fma, {x->getType()}, {x, y, z});
  }
  // x > lo ? x : lo, then < hi ? : hi; NaN becomes lo (the caller patches NaN results).
  llvm::Value* Clamp(llvm::Value* x, double lo, double hi) const {
    llvm::Value* l = C(x->getType(), lo);
    llvm::Value* h = C(x->getType(), hi);
    llvm::Value* y = b.CreateSelect(b.CreateFCmpOGT(x, l), x, l);
    return b.CreateSelect(b.CreateFCmpOLT(y, h), y, h);
  }
  // NaN in, NaN out (quieted, as libm's x + x).
  llvm::Value* KeepNaN(llvm::Value* x, llvm::Value* r) const {
    return b.CreateSelect(b.CreateFCmpUNO(x, x), b.CreateFAdd(x, x), r);
  }
};

}  // namespace

llvm::Value* EmitExp(llvm::IRBuilder<>& b, llvm::Value* x, const ExpCoefficients& c, bool avx512_variants) {
  Ops o{b};
  llvm::Type* f = x->getType();
  // At or below -104 the result is +0 (what the clamp below gave too). Such lanes compute from 0
  // instead: an underflowing product costs a microcode assist (~100+ cycles per vector on x86), and
  // causal masks send half of softmax's inputs here (its exp-and-sum loop: 4x faster).
  llvm::Value* underflow = b.CreateFCmpOLE(x, o.C(f, -104.0));
  llvm::Value* xc = b.CreateSelect(underflow, o.C(f, 0.0), o.Clamp(x, -104.0, 104.0));
  llvm::Value* kf = b.CreateUnaryIntrinsic(llvm::Intrinsic::rint, b.CreateFMul(xc, o.C(f, 1.44269504088896341f)));
  // ln2 = L2U + L2L, L2U with 16 significant bits: k L2U is exact.
  llvm::Value* r = o.Fma(kf, o.C(f, -0.693145751953125f), xc);
  r = o.Fma(kf, o.C(f, -1.428606765330187045e-06f), r);
  llvm::Value* p = o.C(f, c[0]);
  for (size_t i = 1; i < c.size(); ++i) p = o.Fma(p, r, o.C(f, c[i]));
  llvm::Value* u = b.CreateFAdd(o.C(f, 1.0), o.Fma(b.CreateFMul(r, r), p, r));
  // u 2^k as (u 2^h) 2^(k-h), h = k >> 1: both factors normal for |k| <= 252 (|k| <= 151 here).
  llvm::Value* y = avx512_variants ? EmitScaleByPow2Vectorised(b, u, kf) : EmitScaleByPow2(b, u, kf);
  return o.KeepNaN(x, b.CreateSelect(underflow, o.C(f, 0.0), y));
}

llvm::Value* EmitLog(llvm::IRBuilder<>& b, llvm::Value* x) {
  Ops o{b};
  llvm::Type* f = x->getType();
  llvm::Type* d = Shaped(f, b.getDoubleTy());
  llvm::Type* i64 = Shaped(f, b.getInt64Ty());
  llvm::Type* i32 = Shaped(f, b.getInt32Ty());
  const uint64_t kSqrtHalf = 0x3fe6a09e667f3bcdull;  // bits of sqrt(1/2) in f64
  // Adding 1.0's bits minus sqrt(1/2)'s carries into the exponent exactly when m >= sqrt(2) / 2.
  llvm::Value* t = b.CreateAdd(b.CreateBitCast(b.CreateFPExt(x, d), i64), o.I(i64, 0x3ff0000000000000ull - kSqrtHalf));
  llvm::Value* e = b.CreateSub(b.CreateTrunc(b.CreateLShr(t, o.I(i64, 52)), i32), o.I(i32, 1023));
  llvm::Value* m = b.CreateBitCast(b.CreateAdd(b.CreateAnd(t, o.I(i64, 0x000fffffffffffffull)), o.I(i64, kSqrtHalf)), d);
  llvm::Value* fm = b.CreateFSub(m, o.C(d, 1.0));
  llvm::Value* s = b.CreateFDiv(fm, b.CreateFAdd(fm, o.C(d, 2.0)));
  llvm::Value* z = b.CreateFMul(s, s);
  llvm::Value* p = o.C(d, 1.0 / 15);
  for (double k : {13.0, 11.0, 9.0, 7.0, 5.0, 3.0}) p = o.Fma(p, z, o.C(d, 1.0 / k));
  llvm::Value* s2 = b.CreateFAdd(s, s);
  llvm::Value* log_m = o.Fma(b.CreateFMul(s2, z), p, s2);
  llvm::Value* y = b.CreateFPTrunc(o.Fma(b.CreateSIToFP(e, d), o.C(d, 0.6931471805599453), log_m), f);
  const double inf = std::numeric_limits<double>::infinity();
  y = b.CreateSelect(b.CreateFCmpOLT(x, o.C(f, 0.0)), o.C(f, std::numeric_limits<double>::quiet_NaN()), y);
  y = b.CreateSelect(b.CreateFCmpOEQ(x, o.C(f, 0.0)), o.C(f, -inf), y);
  y = b.CreateSelect(b.CreateFCmpOEQ(x, o.C(f, inf)), o.C(f, inf), y);
  return o.KeepNaN(x, y);
}

// (tanh(x) - x) / x^3 as a polynomial in s = x^2 on [0, kTanhSmall^2]: degree 7, fitted by reweighted
// least squares on Chebyshev nodes (relative error of x + x^3 P(s) < 2^-40 before f32 rounding).
constexpr float kTanhSmall = 0.7f;
constexpr float kTanhPoly[8] = {-3.333333331e-01f, 1.333333158e-01f,  -5.396784104e-02f, 2.186478764e-02f,
                                -8.833445452e-03f, 3.480436432e-03f, -1.204623801e-03f, 2.597267812e-04f};

llvm::Value* EmitTanh(llvm::IRBuilder<>& b, llvm::Value* x, bool avx512_variants) {
  Ops o{b};
  llvm::Type* f = x->getType();
  llvm::Value* a = b.CreateUnaryIntrinsic(llvm::Intrinsic::fabs, x);
  // |x| < 0.7: a + a^3 P(a^2), the cubic term one FMA onto a.
  llvm::Value* s = b.CreateFMul(a, a);
  llvm::Value* p = o.C(f, kTanhPoly[7]);
  for (int i = 6; i >= 0; --i) p = o.Fma(p, s, o.C(f, kTanhPoly[i]));
  llvm::Value* small = o.Fma(b.CreateFMul(a, s), p, a);
  // Otherwise 1 - 2 / (exp(2|x|) + 1): the result is at least tanh(0.7) = 0.60, so the exp's error
  // (<= 0.97 ulp) reaches it scaled down by 2 / (e + 1) <= 0.4. |x| clamped to 9.5 (tanh rounds to 1
  // from 9.01; NaN goes to 9.5 and is patched below).
  llvm::Value* ac = b.CreateSelect(b.CreateFCmpOLT(a, o.C(f, 9.5)), a, o.C(f, 9.5));
  llvm::Value* e = EmitExp(b, b.CreateFAdd(ac, ac), kExpCoefficients, avx512_variants);
  llvm::Value* big = b.CreateFSub(o.C(f, 1.0), b.CreateFDiv(o.C(f, 2.0), b.CreateFAdd(e, o.C(f, 1.0))));
  llvm::Value* t = b.CreateSelect(b.CreateFCmpOLT(a, o.C(f, kTanhSmall)), small, big);
  return o.KeepNaN(x, b.CreateBinaryIntrinsic(llvm::Intrinsic::copysign, t, x));
}

}  // namespace shardstep::jit
