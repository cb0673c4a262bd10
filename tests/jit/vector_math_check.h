// Shared by vector_math_test.cc and vector_math_slow_test.cc: a JIT'd fused kernel applying one unary op
// (the code path every step takes: jit/kernel_emitter.cc calling jit/vector_math.h), libm references,
// and the ulp distance the bounds are stated in.
#pragma once

#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "ir/builder.h"
#include "jit/jit_compiler.h"
#include "jit/kernel_emitter.h"

namespace shardstep::vmcheck {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Distance in ulps between finite a and b: how many floats lie between them in the ordered list of all
// finite floats, counting b (so adjacent floats are 1 apart, across a binade boundary or across zero as
// anywhere else; +0 and -0 are the same point).
inline int64_t UlpDistance(float a, float b) {
  auto ord = [](float f) {
    const uint32_t u = Bits(f);
    return (u >> 31) ? -static_cast<int64_t>(u & 0x7fffffffu) : static_cast<int64_t>(u);
  };
  const int64_t d = ord(a) - ord(b);
  return d < 0 ? -d : d;
}

// What the reference interpreter computes (runtime/interpreter.cc: xt::exp etc. call libm on floats).
inline float RefExp(float x) { return std::exp(x); }
inline float RefLog(float x) { return std::log(x); }
inline float RefTanh(float x) { return std::tanh(x); }
inline float RefSigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// A fused kernel `y = op(x)` over f32, compiled by the JIT as a step compiles its loops.
class UnaryKernel {
 public:
  UnaryKernel(ir::OpCode op, int64_t n) {
    ir::Builder b(&m_);
    const ir::ValueId x = b.Input("x", {ir::DType::kF32, {n}});
    const ir::ValueId y = b.Unary(op, x);
    m_.outputs.push_back({"y", y});
    jit::FusedKernel k{"k0", {n}, {y}, {x}, {y}, {}};
    jit_ = jit::JitCompiler::Create(jit::JitOptions{"", false, false});
    auto ctx = std::make_unique<llvm::LLVMContext>();
    auto mod = jit::EmitKernels(m_, {k}, *ctx, "vector_math_check");
    jit_->AddModule(std::move(mod), std::move(ctx), std::string("vector_math_check_") + ir::OpName(op));
    fn_ = reinterpret_cast<jit::KernelFn>(jit_->Lookup("k0"));
  }
  // y[i] = op(x[i]) for i < n.
  void Run(const float* x, float* y, int64_t n) const {
    void* bufs[2] = {const_cast<float*>(x), y};
    fn_(bufs, 0, n);
  }

 private:
  ir::Module m_;
  std::unique_ptr<jit::JitCompiler> jit_;
  jit::KernelFn fn_ = nullptr;
};

// The largest ulp distance seen, where, and the elements that broke a rule.
struct UlpStats {
  int64_t max_ulp = 0;
  float worst_x = 0, worst_got = 0, worst_ref = 0;
  int64_t compared = 0, over = 0, special_mismatch = 0;
  std::string first_problem;
  int64_t bound = 2;

  void Add(float x, float got, float ref) {
    ++compared;
    auto problem = [&](const char* what) {
      if (first_problem.empty()) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "x = %a (%.9g): got %a, reference %a (%s)", x, x, got, ref, what);
        first_problem = buf;
      }
    };
    if (!std::isfinite(ref) || !std::isfinite(got)) {  // by class and sign
      const bool same = std::isnan(ref) ? std::isnan(got) : got == ref;
      if (!same) {
        ++special_mismatch;
        problem("a special value must match by class and sign");
      }
      return;
    }
    if (ref == 0 && got == 0 && std::signbit(ref) != std::signbit(got)) {
      ++special_mismatch;
      problem("the sign of zero");
    }
    const int64_t d = UlpDistance(got, ref);
    if (d > max_ulp) {
      max_ulp = d;
      worst_x = x;
      worst_got = got;
      worst_ref = ref;
    }
    if (d > bound) {
      ++over;
      problem("ulp distance over the bound");
    }
  }
  bool ok() const { return over == 0 && special_mismatch == 0; }
  std::string Summary(const char* name) const {
    char buf[320];
    std::snprintf(buf, sizeof buf, "%s: max %lld ulp from the reference over %lld inputs (at x = %a: got %a, reference %a); %lld over %lld ulp, %lld special mismatches",
                  name, static_cast<long long>(max_ulp), static_cast<long long>(compared), worst_x, worst_got, worst_ref,
                  static_cast<long long>(over), static_cast<long long>(bound), static_cast<long long>(special_mismatch));
    return std::string(buf) + (first_problem.empty() ? "" : "; first: " + first_problem);
  }
};

}  // namespace shardstep::vmcheck
