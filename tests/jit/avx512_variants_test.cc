// jit/avx512_variants.h in the loops that use them (fused kernels with vector math, 16 lanes wide): the
// f32 -> bf16 rounding gives runtime::F32ToBf16's bits on every subnormal, every special value and 2^22
// patterns spread over all f32 inputs, in the vector body and the scalar tail alike; where the host has
// AVX512-BF16 and AVX-512F the optimised code does use vcvtneps2bf16 and vscalefps (and a loop without
// vector math does not). exp's bits with vscalefps: vector_math_test.cc (vector body == scalar tail,
// within 1 ulp of libm) and vector_math_slow_test.cc (every f32 input).
#include <catch2/catch.hpp>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/Support/raw_ostream.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ir/builder.h"
#include "jit/avx512_variants.h"
#include "jit/jit_compiler.h"
#include "jit/kernel_emitter.h"
#include "runtime/tensor.h"

namespace {

using namespace shardstep;
using ir::DType;
using ir::OpCode;

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A fused kernel e = exp(x) (f32), r = convert(x, bf16): vector math makes it a 16-lane loop with the
// variants; `op` kNeg instead of kExp: a memory-bound loop without them.
struct RoundingKernel {
  explicit RoundingKernel(int64_t n, OpCode op = OpCode::kExp) {
    ir::Builder b(&m);
    const ir::ValueId x = b.Input("x", {DType::kF32, {n}});
    const ir::ValueId e = b.Unary(op, x);
    const ir::ValueId r = b.Convert(x, DType::kBF16);
    m.outputs.push_back({"e", e});
    m.outputs.push_back({"r", r});
    kernel = jit::FusedKernel{"k0", {n}, {e, r}, {x}, {e, r}, {}};
  }
  // The optimised LLVM IR, as the JIT compiles it.
  std::string OptimisedIr() const {
    llvm::LLVMContext ctx;
    auto mod = jit::EmitKernels(m, {kernel}, ctx, "avx512_variants");
    jit::JitCompiler::Create(jit::JitOptions{"", false, false})->Optimize(*mod);
    std::string text;
    llvm::raw_string_ostream os(text);
    mod->print(os, nullptr);
    return os.str();
  }
  // The bf16 bits of x[0, n) as the compiled kernel rounds them.
  std::vector<uint16_t> Round(const std::vector<float>& x) {
    if (!fn) {
      jit = jit::JitCompiler::Create(jit::JitOptions{"", false, false});
      auto ctx = std::make_unique<llvm::LLVMContext>();
      auto mod = jit::EmitKernels(m, {kernel}, *ctx, "avx512_variants");
      jit->AddModule(std::move(mod), std::move(ctx), "avx512_variants_test");
      fn = reinterpret_cast<jit::KernelFn>(jit->Lookup("k0"));
    }
    std::vector<float> e(x.size());
    std::vector<uint16_t> r(x.size());
    void* bufs[3] = {const_cast<float*>(x.data()), e.data(), r.data()};
    fn(bufs, 0, static_cast<int64_t>(x.size()));
    return r;
  }
  ir::Module m;
  jit::FusedKernel kernel;
  std::unique_ptr<jit::JitCompiler> jit;
  jit::KernelFn fn = nullptr;
};

// Rounds x in the kernel (whole vectors and a tail of 5) and counts the elements whose bits are not
// F32ToBf16's; the first one is described.
int64_t Mismatches(RoundingKernel& k, std::vector<float> x, std::string* first) {
  x.resize(x.size() + 5, FromBits(0x00000001u));  // the tail: subnormals too
  const std::vector<uint16_t> r = k.Round(x);
  int64_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t want = runtime::F32ToBf16(x[i]);
    if (r[i] == want) continue;
    if (bad++ == 0) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      char buf[120];
      std::snprintf(buf, sizeof buf, "x bits 0x%08x: got 0x%04x, want 0x%04x", u, r[i], want);
      *first = buf;
    }
  }
  return bad;
}

TEST_CASE("a loop with vector math rounds to bf16 with F32ToBf16's bits (vcvtneps2bf16, subnormals shifted)", "[jit][bf16][avx512_variants]") {
  RoundingKernel k(1 << 20);  // (the kernel's shape only names its loop; any n runs)
  std::string first;
  SECTION("every subnormal, both signs") {
    std::vector<float> x;
    x.reserve(1 << 24);
    for (uint32_t m = 0; m < (1u << 23); ++m) {
      x.push_back(FromBits(m));
      x.push_back(FromBits(0x80000000u | m));
    }
    const int64_t bad = Mismatches(k, x, &first);
    INFO(first);
    CHECK(bad == 0);
  }
  SECTION("special values, ties, the largest finite values and the normal range's edges") {
    std::vector<float> x;
    for (uint32_t u : {0x00000000u, 0x7f800000u, 0x7f800001u, 0x7fbfffffu, 0x7fc00000u, 0x7fffffffu, 0x7f7fffffu,
                       0x7f7f8000u, 0x7f7f7fffu, 0x7f7f8001u, 0x00800000u, 0x00807fffu, 0x00808000u, 0x00818000u,
                       0x007fffffu, 0x007f8000u, 0x007f7fffu, 0x00008000u, 0x00018000u, 0x3f808000u, 0x3f818000u,
                       0x3f80ffffu, 0x3f817fffu}) {
      x.push_back(FromBits(u));
      x.push_back(FromBits(u | 0x80000000u));
    }
    const int64_t bad = Mismatches(k, x, &first);
    INFO(first);
    CHECK(bad == 0);
  }
  SECTION("2^22 patterns over every f32 input, and every pattern around the round-half bits") {
    std::vector<float> x;
    std::mt19937 rng(7);
    for (uint64_t block = 0; block < (1u << 22); ++block) x.push_back(FromBits(static_cast<uint32_t>(block << 10 | (rng() & 1023))));
    for (uint32_t hi : {0x3f80u, 0x4b7fu, 0x0080u, 0x7f7fu})
      for (uint32_t lo = 0; lo < 0x10000u; ++lo) x.push_back(FromBits(hi << 16 | lo));
    const int64_t bad = Mismatches(k, x, &first);
    INFO(first);
    CHECK(bad == 0);
  }
}

TEST_CASE("the variants are what the loops with vector math compile to where the host has them", "[jit][avx512_variants]") {
  const std::string text = RoundingKernel(4096).OptimisedIr();
  // Inlined after O3: no call of the scalar functions or their variants is left.
  CHECK(text.find("call i16 @ss_bf16_bits") == std::string::npos);
  CHECK(text.find("@ss_bf16_bits_v16(") == std::string::npos);
  CHECK(text.find("@ss_scale_by_pow2") == std::string::npos);
  if (jit::HostHasAvx512Bf16()) CHECK(text.find("@llvm.x86.avx512bf16.cvtneps2bf16.512") != std::string::npos);
  if (jit::HostHasAvx512F()) CHECK(text.find("@llvm.x86.avx512.mask.scalef.ps.512") != std::string::npos);
  if (!jit::HostHasAvx512Bf16() || !jit::HostHasAvx512F()) WARN("this host lacks AVX512-BF16 or AVX-512F: the generic forms run");
  // A memory-bound loop (no vector math) keeps the integer rounding.
  const std::string plain = RoundingKernel(4096, OpCode::kNeg).OptimisedIr();
  CHECK(plain.find("cvtneps2bf16") == std::string::npos);
  CHECK(plain.find("ss_bf16_bits") == std::string::npos);
}

}  // namespace
