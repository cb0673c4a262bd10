// AVX-512 variants of generated loops' steps (see avx512_variants.h).
#include "jit/avx512_variants.h"

#include <llvm/ADT/StringMap.h>
#include <llvm/IR/Constants.h>
#include <llvm/IR/Intrinsics.h>
#include <llvm/IR/IntrinsicsX86.h>
#include <llvm/IR/Module.h>
#include <llvm/Support/Host.h>
#include <llvm/Transforms/Utils/ModuleUtils.h>

#include <string>

namespace shardstep::jit {

namespace {

constexpr unsigned kLanes = 16;

// `like`'s shape (scalar or vector) with element type `elem`.
llvm::Type* Shaped(llvm::Type* like, llvm::Type* elem) {
  if (auto* v = llvm::dyn_cast<llvm::VectorType>(like)) return llvm::VectorType::get(elem, v->getElementCount());
  return elem;
}

// A scalar function `name` (ret(args...), body from `scalar`) and its 16-lane variant `name`_v16 (body
// from `vector`), both late-inlined; the variant kept through O3's removal of unused functions (the
// vectoriser looks it up by name).
template <typename Scalar, typename Vector>
llvm::Function* Define(llvm::Module& mod, const std::string& name, llvm::Type* ret, std::vector<llvm::Type*> args,
                       Scalar scalar, Vector vector) {
  if (llvm::Function* f = mod.getFunction(name)) return f;
  llvm::LLVMContext& ctx = mod.getContext();
  auto make = [&](const std::string& fn_name, llvm::Type* r, const std::vector<llvm::Type*>& a) {
    auto* fn = llvm::Function::Create(llvm::FunctionType::get(r, a, false), llvm::Function::InternalLinkage, fn_name, mod);
    fn->addFnAttr(llvm::Attribute::NoInline);
    fn->addFnAttr(llvm::Attribute::ReadNone);
    fn->addFnAttr(llvm::Attribute::NoUnwind);
    fn->addFnAttr(llvm::Attribute::WillReturn);
    fn->addFnAttr(kLateInlineAttr);
    return fn;
  };
  auto widen = [](llvm::Type* t) { return llvm::FixedVectorType::get(t, kLanes); };
  std::vector<llvm::Type*> vargs;
  for (llvm::Type* t : args) vargs.push_back(widen(t));
  llvm::Function* s = make(name, ret, args);
  llvm::Function* v = make(name + "_v16", widen(ret), vargs);
  for (llvm::Function* fn : {s, v}) {
    llvm::IRBuilder<> b(llvm::BasicBlock::Create(ctx, "entry", fn));
    std::vector<llvm::Value*> a;
    for (llvm::Argument& arg : fn->args()) a.push_back(&arg);
    b.CreateRet(fn == s ? scalar(b, a) : vector(b, a));
  }
  llvm::appendToCompilerUsed(mod, {v});
  return s;
}

// A call of `fn`, naming its 16-lane variant: _ZGV, _LLVM_ (LLVM's own vector ABI), N (unmasked), 16
// lanes, one v per (vector) argument, _<scalar>(<variant>).
llvm::Value* CallWithVariant(llvm::IRBuilder<>& b, llvm::Function* fn, std::vector<llvm::Value*> args) {
  llvm::CallInst* call = b.CreateCall(fn, args);
  const std::string name = fn->getName().str();
  call->addFnAttr(llvm::Attribute::get(b.getContext(), "vector-function-abi-variant",
                                       "_ZGV_LLVM_N16" + std::string(args.size(), 'v') + "_" + name + "(" + name + "_v16)"));
  return call;
}

bool HostFeatures(std::initializer_list<const char*> names) {
  llvm::StringMap<bool> features;
  if (!llvm::sys::getHostCPUFeatures(features)) return false;
  for (const char* n : names)
    if (!features.lookup(n)) return false;
  return true;
}

}  // namespace

llvm::Value* EmitBf16Bits(llvm::IRBuilder<>& b, llvm::Value* f) {
  llvm::Type* i32 = Shaped(f->getType(), b.getInt32Ty());
  auto k = [&](uint32_t v) { return llvm::ConstantInt::get(i32, v); };
  llvm::Value* u = b.CreateBitCast(f, i32);
  llvm::Value* hi = b.CreateLShr(u, k(16));
  llvm::Value* bias = b.CreateAdd(k(0x7fff), b.CreateAnd(hi, k(1)));
  llvm::Value* rounded = b.CreateLShr(b.CreateAdd(u, bias), k(16));
  llvm::Value* quiet = b.CreateOr(hi, k(0x40));
  return b.CreateTrunc(b.CreateSelect(b.CreateFCmpUNO(f, f), quiet, rounded), Shaped(f->getType(), b.getInt16Ty()));
}

// vcvtneps2bf16 reads a subnormal as 0. A subnormal lane (vfpclassps, class 0x20) converts
// y = x + copysign(2^-126, x) instead: exact (x is a multiple of 2^-149 and |y| < 2^-125), and y's bf16
// is x's bf16 significand over the smallest normal's exponent field, rounded on the same grid (2^-133)
// with the same parity for ties, a carry into that field included; subtracting the field (0x0080)
// leaves x's bits. No branch: the loop's four vectors in flight stay interleaved (a branch per vector
// made transformer_lm's GELU loops 25% slower).
llvm::Value* EmitBf16BitsVectorised(llvm::IRBuilder<>& b, llvm::Value* f) {
  llvm::Module& mod = *b.GetInsertBlock()->getModule();
  auto vector = [](llvm::IRBuilder<>& v, const std::vector<llvm::Value*>& a) -> llvm::Value* {
    llvm::Value* x = a[0];
    llvm::Type* i32 = Shaped(x->getType(), v.getInt32Ty());
    llvm::Value* sub = v.CreateIntrinsic(llvm::Intrinsic::x86_avx512_fpclass_ps_512, {}, {x, v.getInt32(0x20)});
    llvm::Value* sign = v.CreateAnd(v.CreateBitCast(x, i32), llvm::ConstantInt::get(i32, 0x80000000u));
    llvm::Value* smallest = v.CreateBitCast(v.CreateOr(sign, llvm::ConstantInt::get(i32, 0x00800000u)), x->getType());
    llvm::Value* y = v.CreateSelect(sub, v.CreateFAdd(x, smallest), x);
    llvm::Value* bits = v.CreateIntrinsic(llvm::Intrinsic::x86_avx512bf16_cvtneps2bf16_512, {}, {y});
    return v.CreateSelect(sub, v.CreateSub(bits, llvm::ConstantInt::get(bits->getType(), 0x0080)), bits);
  };
  llvm::Function* fn = Define(
      mod, "ss_bf16_bits", b.getInt16Ty(), {b.getFloatTy()},
      [](llvm::IRBuilder<>& s, const std::vector<llvm::Value*>& a) { return EmitBf16Bits(s, a[0]); }, vector);
  return CallWithVariant(b, fn, {f});
}

llvm::Value* EmitScaleByPow2(llvm::IRBuilder<>& b, llvm::Value* u, llvm::Value* kf) {
  llvm::Type* f = u->getType();
  llvm::Type* i32 = Shaped(f, b.getInt32Ty());
  auto k32 = [&](uint32_t v) { return llvm::ConstantInt::get(i32, v); };
  llvm::Value* k = b.CreateFPToSI(kf, i32);
  llvm::Value* h = b.CreateAShr(k, k32(1));
  auto pow2 = [&](llvm::Value* e) { return b.CreateBitCast(b.CreateShl(b.CreateAdd(e, k32(127)), k32(23)), f); };
  return b.CreateFMul(b.CreateFMul(u, pow2(h)), pow2(b.CreateSub(k, h)));
}

llvm::Value* EmitScaleByPow2Vectorised(llvm::IRBuilder<>& b, llvm::Value* u, llvm::Value* kf) {
  llvm::Module& mod = *b.GetInsertBlock()->getModule();
  auto vector = [](llvm::IRBuilder<>& v, const std::vector<llvm::Value*>& a) -> llvm::Value* {
    // Rounding argument 4: the current direction (nearest even, as every other operation here).
    return v.CreateIntrinsic(llvm::Intrinsic::x86_avx512_mask_scalef_ps_512, {},
                             {a[0], a[1], llvm::UndefValue::get(a[0]->getType()), v.getInt16(0xffff), v.getInt32(4)});
  };
  llvm::Function* fn = Define(
      mod, "ss_scale_by_pow2", b.getFloatTy(), {b.getFloatTy(), b.getFloatTy()},
      [](llvm::IRBuilder<>& s, const std::vector<llvm::Value*>& a) { return EmitScaleByPow2(s, a[0], a[1]); }, vector);
  return CallWithVariant(b, fn, {u, kf});
}

bool HostHasAvx512F() {
  static const bool has = HostFeatures({"avx512f"});
  return has;
}
bool HostHasAvx512Bf16() {
  static const bool has = HostFeatures({"avx512f", "avx512dq", "avx512bf16"});
  return has;
}

}  // namespace shardstep::jit
