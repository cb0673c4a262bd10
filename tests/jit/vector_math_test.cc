// Vectorised transcendentals (jit/vector_math.h) as the JIT runs them in fused loops: exp and log within
// 1 ulp of libm (what the reference interpreter calls), tanh within 2, sigmoid within 4 of the
// interpreter's formula, on 2^22 inputs spread over every f32 bit pattern, 2^21 more over each function's working range and every special value; libm's special
// results exactly; the same bits from a vector body and a scalar tail; the loops vectorised (and not
// with SHARDSTEP_SCALAR_LIBM=1); and a perturbed exp polynomial caught by the same bound.
// Every f32 input: vector_math_slow_test.cc.
#include <catch2/catch.hpp>
#include <llvm/IR/IRBuilder.h>
#include <llvm/Support/raw_ostream.h>

#include <cfloat>
#include <cstdlib>
#include <limits>
#include <vector>

#include "jit/vector_math.h"
#include "tests/jit/vector_math_check.h"

namespace {

using namespace shardstep;
using ir::OpCode;
using vmcheck::Bits;
using vmcheck::FromBits;
using vmcheck::UlpStats;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Fn {
  const char* name;
  OpCode op;
  float (*ref)(float);
  float lo, hi;  // the working range's magnitudes, sampled densely with both signs
  int64_t bound;  // ulps from the reference
};
// exp and log are within 1 ulp of the exact value and libm's are within 0.5 and 0.82, so within 1 of
// each other; glibc's tanhf is itself 2.1 ulp off at worst. sigmoid = 1 / (1 + exp(-x)) in both: one
// ulp of exp can move 1 + e across a rounding boundary, up to 4 ulp of the result (the conformance
// tolerance, Tolerance::Ulps(4), allows 4-8).
const Fn kFns[] = {{"exp", OpCode::kExp, vmcheck::RefExp, 0, 104, 1},
                   {"log", OpCode::kLog, vmcheck::RefLog, 0.25f, 4, 1},
                   {"tanh", OpCode::kTanh, vmcheck::RefTanh, 0, 10, 2},
                   {"sigmoid", OpCode::kSigmoid, vmcheck::RefSigmoid, 0, 104, 4}};

// Every special value and the thresholds where results change class (overflow, gradual underflow, the
// last non-zero result, saturation, the small-|x| region).
std::vector<float> Specials() {
  std::vector<float> s = {0.f, kInf, kNaN, FromBits(0x7f800001u) /* signalling */, FromBits(0x7fffffffu),
                          std::numeric_limits<float>::denorm_min(), FLT_MIN, FLT_MAX, 1.f, 0.5f, 2.f,
                          std::nextafter(1.f, 0.f), std::nextafter(1.f, 2.f), std::nextafter(FLT_MIN, 0.f),
                          88.72283935546875f, 88.7228394f, std::nextafter(88.72283935546875f, 100.f), 87.33654f,
                          103.972076f, 103.97208f, 104.f, 104.5f, 150.f, 9.010913f, 9.01092f, 20.f,
                          0x1p-12f, 0x1p-13f, 0x1p-24f, 0x1p-126f, 0.55f, 0.625f, 0.347f, 0.3466f};
  const size_t n = s.size();
  for (size_t i = 0; i < n; ++i) s.push_back(-s[i]);
  return s;
}

// 2^22 bit patterns, one per block of 1024 consecutive ones (at a pseudo-random place in it).
std::vector<float> Spread() {
  std::vector<float> v(size_t{1} << 22);
  for (uint32_t i = 0; i < v.size(); ++i) v[i] = FromBits((i << 10) | ((i * 2654435761u) >> 22));
  return v;
}

// n bit patterns evenly between |lo| and |hi|, with both signs.
std::vector<float> Dense(float lo, float hi, uint32_t n) {
  std::vector<float> v;
  const uint32_t a = Bits(lo), b = Bits(hi);
  for (uint32_t i = 0; i < n / 2; ++i) {
    const float x = FromBits(a + static_cast<uint32_t>((static_cast<uint64_t>(b - a) * i) / (n / 2)));
    v.push_back(x);
    v.push_back(-x);
  }
  return v;
}

UlpStats Measure(const vmcheck::UnaryKernel& k, const Fn& fn, const std::vector<float>& x) {
  std::vector<float> y(x.size());
  k.Run(x.data(), y.data(), static_cast<int64_t>(x.size()));
  UlpStats s;
  s.bound = fn.bound;
  for (size_t i = 0; i < x.size(); ++i) s.Add(x[i], y[i], fn.ref(x[i]));
  return s;
}

}  // namespace

TEST_CASE("the ulp distance counts floats between two values, across binades and zero", "[jit][vector_math]") {
  using vmcheck::UlpDistance;
  CHECK(UlpDistance(1.f, 1.f) == 0);
  CHECK(UlpDistance(1.f, std::nextafter(1.f, 2.f)) == 1);
  CHECK(UlpDistance(std::nextafter(2.f, 0.f), std::nextafter(2.f, 3.f)) == 2);  // across the binade at 2
  CHECK(UlpDistance(0.f, -0.f) == 0);
  const float dm = std::numeric_limits<float>::denorm_min();
  CHECK(UlpDistance(dm, -dm) == 2);
  CHECK(UlpDistance(FLT_MAX, std::nextafter(FLT_MAX, 0.f)) == 1);
  UlpStats s;
  s.Add(1.f, std::nextafter(std::nextafter(std::nextafter(1.f, 2.f), 2.f), 2.f), 1.f);  // 3 ulp: over
  s.Add(0.f, -0.f, 0.f);                                                                 // sign of zero
  s.Add(1.f, kInf, FLT_MAX);                                                             // class
  CHECK(s.max_ulp == 3);
  CHECK(s.over == 1);
  CHECK(s.special_mismatch == 2);
  CHECK_FALSE(s.ok());
}

TEST_CASE("exp, log, tanh and sigmoid in fused loops are within 1-2 ulp of libm (sigmoid 4), special values exact", "[jit][vector_math]") {
  const std::vector<float> spread = Spread(), specials = Specials();
  for (const Fn& fn : kFns) {
    vmcheck::UnaryKernel k(fn.op, 1 << 22);
    std::vector<float> x = spread;
    const std::vector<float> dense = Dense(fn.lo, fn.hi, 1 << 21);
    x.insert(x.end(), dense.begin(), dense.end());
    if (fn.op == OpCode::kLog) {  // subnormal inputs (the f64 widening path)
      const std::vector<float> sub = Dense(std::numeric_limits<float>::denorm_min(), FLT_MIN, 1 << 18);
      x.insert(x.end(), sub.begin(), sub.end());
    }
    x.insert(x.end(), specials.begin(), specials.end());
    const UlpStats s = Measure(k, fn, x);
    WARN(s.Summary(fn.name));  // the measured maximum, in the log
    CHECK(s.compared == static_cast<int64_t>(x.size()));
    CHECK(s.ok());

    // The scalar tail computes the same bits as the vector body: one element per call never enters it.
    std::vector<float> in(specials);
    in.insert(in.end(), dense.begin(), dense.begin() + 4096);
    std::vector<float> whole(in.size()), one(in.size());
    k.Run(in.data(), whole.data(), static_cast<int64_t>(in.size()));
    for (size_t i = 0; i < in.size(); ++i) k.Run(in.data() + i, one.data() + i, 1);
    int64_t differ = 0;
    for (size_t i = 0; i < in.size(); ++i) differ += Bits(whole[i]) != Bits(one[i]) && !(std::isnan(whole[i]) && std::isnan(one[i]));
    INFO(fn.name << ": " << differ << " elements differ between the vector body and the scalar loop");
    CHECK(differ == 0);
  }
}

TEST_CASE("special values of the vectorised functions are libm's, bitwise", "[jit][vector_math]") {
  struct Want {
    OpCode op;
    float x, y;
  };
  const float dm = std::numeric_limits<float>::denorm_min();
  const Want wants[] = {
      {OpCode::kExp, -kInf, 0.f},    {OpCode::kExp, kInf, kInf},       {OpCode::kExp, 0.f, 1.f},
      {OpCode::kExp, -0.f, 1.f},     {OpCode::kExp, 89.f, kInf},       {OpCode::kExp, -104.f, 0.f},
      {OpCode::kExp, -200.f, 0.f},   {OpCode::kExp, -103.f, std::exp(-103.f)} /* 1.29 x the least subnormal */,
      {OpCode::kLog, 0.f, -kInf},    {OpCode::kLog, -0.f, -kInf},      {OpCode::kLog, -1.f, kNaN},
      {OpCode::kLog, -kInf, kNaN},   {OpCode::kLog, kInf, kInf},       {OpCode::kLog, 1.f, 0.f},
      {OpCode::kLog, -dm, kNaN},     {OpCode::kTanh, kInf, 1.f},
      {OpCode::kTanh, -kInf, -1.f},  {OpCode::kTanh, 0.f, 0.f},        {OpCode::kTanh, -0.f, -0.f},
      {OpCode::kTanh, 30.f, 1.f},    {OpCode::kTanh, -30.f, -1.f},     {OpCode::kTanh, -dm, -dm},
      {OpCode::kTanh, 0x1p-20f, 0x1p-20f},                             {OpCode::kSigmoid, kInf, 1.f},
      {OpCode::kSigmoid, -kInf, 0.f}, {OpCode::kSigmoid, 0.f, 0.5f},   {OpCode::kSigmoid, -200.f, 0.f},
      {OpCode::kSigmoid, 200.f, 1.f},
  };
  for (OpCode op : {OpCode::kExp, OpCode::kLog, OpCode::kTanh, OpCode::kSigmoid}) {
    vmcheck::UnaryKernel k(op, 64);
    std::vector<float> x, want;
    for (const Want& w : wants)
      if (w.op == op) x.push_back(w.x), want.push_back(w.y);
    for (float nan : {kNaN, -kNaN, FromBits(0x7f800001u)}) x.push_back(nan), want.push_back(kNaN);
    // Tiled past a vector body's width, so both the body and the tail see every value.
    const size_t n = x.size();
    for (size_t i = n; i < 5 * n + 3; ++i) x.push_back(x[i % n]), want.push_back(want[i % n]);
    std::vector<float> y(x.size());
    k.Run(x.data(), y.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < x.size(); ++i) {
      INFO(ir::OpName(op) << "(" << x[i] << " = 0x" << std::hex << Bits(x[i]) << ") = " << y[i] << " = 0x" << Bits(y[i])
                          << ", want " << want[i] << " = 0x" << Bits(want[i]));
      if (std::isnan(want[i]))
        CHECK(std::isnan(y[i]));
      else
        CHECK(Bits(y[i]) == Bits(want[i]));
    }
  }
}

TEST_CASE("fused loops with exp, log, tanh, sigmoid vectorise; with SHARDSTEP_SCALAR_LIBM=1 they call libm", "[jit][vector_math]") {
  auto compile = [](OpCode op, std::vector<std::string>* remarks) {
    ir::Module m;
    ir::Builder b(&m);
    const ir::ValueId x = b.Input("x", {ir::DType::kF32, {1024}});
    const ir::ValueId y = b.Unary(op, x);
    m.outputs.push_back({"y", y});
    llvm::LLVMContext ctx;
    auto mod = jit::EmitKernels(m, {jit::FusedKernel{"k0", {1024}, {y}, {x}, {y}, {}}}, ctx, "v");
    jit::JitCompiler::Create(jit::JitOptions{"", false, false})->Optimize(*mod, remarks);
    std::string text;
    llvm::raw_string_ostream os(text);
    mod->print(os, nullptr);
    return os.str();
  };
  const char* libm[] = {"@expf(", "@logf(", "@tanhf(", "@expf("};
  int i = 0;
  for (OpCode op : {OpCode::kExp, OpCode::kLog, OpCode::kTanh, OpCode::kSigmoid}) {
    const char* call = libm[i++];
    std::vector<std::string> remarks;
    const std::string text = compile(op, &remarks);
    std::string all;
    int width = 0;
    for (const std::string& r : remarks) {
      all += r + "\n";
      if (auto p = r.find("passed: vectorized loop (vectorization width: "); p != std::string::npos)
        width = std::atoi(r.c_str() + p + std::strlen("passed: vectorized loop (vectorization width: "));
    }
    INFO(ir::OpName(op) << " remarks:\n" << all);
    CHECK(width >= 4);
    CHECK(text.find(call) == std::string::npos);
    CHECK(text.find("x float>") != std::string::npos);
    // Compute-bound: vectorised 512 bits wide where the CPU has AVX-512 (LLVM's default is 256).
    CHECK(text.find("\"prefer-vector-width\"=\"512\"") != std::string::npos);

    ::setenv("SHARDSTEP_SCALAR_LIBM", "1", 1);
    std::vector<std::string> libm_remarks;
    const std::string libm_text = compile(op, &libm_remarks);
    ::unsetenv("SHARDSTEP_SCALAR_LIBM");
    bool vectorised = false;
    for (const std::string& r : libm_remarks) vectorised |= r.find("passed: vectorized loop") != std::string::npos;
    CHECK_FALSE(vectorised);
    CHECK(libm_text.find(call) != std::string::npos);
    CHECK(libm_text.find("prefer-vector-width") == std::string::npos);
  }
  // A memory-bound kernel keeps LLVM's default width.
  CHECK(compile(OpCode::kNeg, nullptr).find("prefer-vector-width") == std::string::npos);
}

TEST_CASE("a perturbed exp polynomial breaks the 2-ulp bound (the check can fail)", "[jit][vector_math]") {
  auto jit = jit::JitCompiler::Create(jit::JitOptions{"", false, false});
  auto scalar_exp = [&](const jit::ExpCoefficients& c, const std::string& name) {
    auto ctx = std::make_unique<llvm::LLVMContext>();
    auto mod = std::make_unique<llvm::Module>(name, *ctx);
    llvm::Type* f = llvm::Type::getFloatTy(*ctx);
    auto* fn = llvm::Function::Create(llvm::FunctionType::get(f, {f}, false), llvm::Function::ExternalLinkage, name, *mod);
    llvm::IRBuilder<> b(llvm::BasicBlock::Create(*ctx, "entry", fn));
    b.CreateRet(jit::EmitExp(b, fn->getArg(0), c));
    jit->AddModule(std::move(mod), std::move(ctx), name);
    return reinterpret_cast<float (*)(float)>(jit->Lookup(name));
  };
  jit::ExpCoefficients bad = jit::kExpCoefficients;
  bad[4] *= 1 + 1e-4f;  // the r^3 coefficient, 1/6, off by 1e-4 relative (a typo in its 5th digit)
  float (*good_fn)(float) = scalar_exp(jit::kExpCoefficients, "vm_exp_good");
  float (*bad_fn)(float) = scalar_exp(bad, "vm_exp_bad");
  UlpStats good, perturbed;
  for (float x : Dense(0, 88, 1 << 18)) {
    good.Add(x, good_fn(x), std::exp(x));
    perturbed.Add(x, bad_fn(x), std::exp(x));
  }
  WARN(good.Summary("exp") << "\n" << perturbed.Summary("exp, perturbed polynomial"));
  CHECK(good.ok());
  CHECK_FALSE(perturbed.ok());
  CHECK(perturbed.max_ulp > 2);
}
