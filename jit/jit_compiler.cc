// JitCompiler: LLJIT for the host CPU, an O3 new-pass-manager pipeline, and a checksummed disk cache.
//
// Numerics: the target is built with AllowFPOpFusion = Strict and no unsafe/fast-math options, and
// the emitted IR carries no fast-math flags, so LLVM neither contracts a*b+c into an FMA nor
// reassociates: an element gets the same bits in a vector body, a scalar tail, a whole tensor or a
// shard. Cache entries are "SSJITOBJ" + size + FNV-1a checksum + object; anything that does not
// check out is deleted and recompiled, never loaded.
#include "jit/jit_compiler.h"

#include <llvm/ExecutionEngine/ObjectCache.h>
#include <llvm/ExecutionEngine/Orc/CompileUtils.h>
#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/IR/DiagnosticHandler.h>
#include <llvm/IR/DiagnosticInfo.h>
#include <llvm/IR/Function.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Transforms/IPO/AlwaysInliner.h>
#include <llvm/Transforms/IPO/GlobalDCE.h>
#include <llvm/Support/MemoryBuffer.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Target/TargetMachine.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "ir/error.h"
#include "jit/avx512_variants.h"
#include "jit/vector_math.h"

namespace shardstep::jit {

namespace fs = std::filesystem;

std::string HashHex(const std::string& data) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : data) h = (h ^ c) * 1099511628211ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string CacheDirectory(const JitOptions& o) {
  if (!o.cache_dir.empty()) return o.cache_dir;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/shardstep";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/shardstep";
  return "/tmp/shardstep-cache";
}

namespace {

constexpr char kMagic[8] = {'S', 'S', 'J', 'I', 'T', 'O', 'B', 'J'};

std::string ToString(llvm::Error e) {
  std::string s;
  llvm::raw_string_ostream os(s);
  os << e;
  return os.str();
}

template <typename T>
T Unwrap(llvm::Expected<T> v, const char* what) {
  if (!v) throw Error(Str("JIT: ", what, ": ", ToString(v.takeError())));
  return std::move(*v);
}

uint64_t Checksum(const char* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 1099511628211ull;
  return h;
}

// Objects on disk, one file per key; the module identifier is the key.
class DiskObjectCache : public llvm::ObjectCache {
 public:
  explicit DiskObjectCache(std::string dir) : dir_(std::move(dir)) {}

  void notifyObjectCompiled(const llvm::Module* m, llvm::MemoryBufferRef obj) override {
    if (dir_.empty()) return;
    std::error_code ec;
    fs::create_directories(dir_, ec);
    const std::string path = Path(m->getModuleIdentifier());
    // Unique per process and cache object, so concurrent writers never share a temporary file.
    const std::string tmp = path + ".tmp" + std::to_string(::getpid()) + "." + std::to_string(reinterpret_cast<uintptr_t>(this));
    {
      std::ofstream f(tmp, std::ios::binary);
      if (!f) return;  // an unwritable cache only costs a recompile
      const uint64_t size = obj.getBufferSize(), sum = Checksum(obj.getBufferStart(), size);
      f.write(kMagic, 8);
      f.write(reinterpret_cast<const char*>(&size), 8);
      f.write(reinterpret_cast<const char*>(&sum), 8);
      f.write(obj.getBufferStart(), static_cast<std::streamsize>(size));
      if (!f) return;
    }
    fs::rename(tmp, path, ec);  // atomic: readers see the old entry or the whole new one
    if (!ec) ++writes;
  }

  std::unique_ptr<llvm::MemoryBuffer> getObject(const llvm::Module* m) override {
    return Load(m->getModuleIdentifier());
  }

  // The verified object, or null (missing or corrupt; a corrupt entry is removed).
  std::unique_ptr<llvm::MemoryBuffer> Load(const std::string& key) {
    if (dir_.empty()) return nullptr;
    const std::string path = Path(key);
    std::ifstream f(path, std::ios::binary);
    if (!f) return nullptr;
    std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    uint64_t size = 0, sum = 0;
    bool ok = data.size() >= 24 && std::memcmp(data.data(), kMagic, 8) == 0;
    if (ok) {
      std::memcpy(&size, data.data() + 8, 8);
      std::memcpy(&sum, data.data() + 16, 8);
      ok = data.size() - 24 == size && Checksum(data.data() + 24, size) == sum;
    }
    if (!ok) {
      ++rejects;
      std::error_code ec;
      fs::remove(path, ec);
      return nullptr;
    }
    ++hits;
    return llvm::MemoryBuffer::getMemBufferCopy(llvm::StringRef(data.data() + 24, size), key);
  }

  int hits = 0, writes = 0, rejects = 0;

 private:
  std::string Path(const std::string& key) const { return dir_ + "/" + key + ".o"; }
  std::string dir_;
};

void InitLlvmOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
    llvm::InitializeNativeTargetAsmParser();
  });
}

}  // namespace

struct JitCompiler::Impl {
  std::unique_ptr<DiskObjectCache> cache;
  std::unique_ptr<llvm::TargetMachine> tm;  // for the optimisation pipeline
  std::unique_ptr<llvm::orc::LLJIT> jit;
  std::string target_key;
};

JitCompiler::JitCompiler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JitCompiler::~JitCompiler() = default;

std::unique_ptr<JitCompiler> JitCompiler::Create(const JitOptions& options) {
  InitLlvmOnce();
  auto impl = std::make_unique<Impl>();
  const char* env = std::getenv("SHARDSTEP_JIT_CACHE");
  const bool disk = options.disk_cache && !(env && std::string(env) == "0");
  impl->cache = std::make_unique<DiskObjectCache>(disk ? CacheDirectory(options) : "");

  auto jtmb = Unwrap(llvm::orc::JITTargetMachineBuilder::detectHost(), "detecting the host");
  jtmb.setCodeGenOptLevel(llvm::CodeGenOpt::Aggressive);
  llvm::TargetOptions& to = jtmb.getOptions();
  to.AllowFPOpFusion = llvm::FPOpFusion::Strict;  // never contract a*b+c into an FMA
  to.UnsafeFPMath = false;
  to.NoInfsFPMath = false;
  to.NoNaNsFPMath = false;
  to.NoSignedZerosFPMath = false;

  std::string features;
  for (const std::string& f : jtmb.getFeatures().getFeatures()) features += f;
  impl->target_key = jtmb.getTargetTriple().str() + "/" + jtmb.getCPU() + "/" + HashHex(features);
  if (ScalarLibm()) impl->target_key += "/scalar-libm";  // the kernels' code differs (jit/vector_math.h)
  impl->tm = Unwrap(jtmb.createTargetMachine(), "creating the target machine");

  DiskObjectCache* cache = impl->cache.get();
  impl->jit = Unwrap(
      llvm::orc::LLJITBuilder()
          .setJITTargetMachineBuilder(jtmb)
          .setCompileFunctionCreator([cache](llvm::orc::JITTargetMachineBuilder b)
                                         -> llvm::Expected<std::unique_ptr<llvm::orc::IRCompileLayer::IRCompiler>> {
            auto tm = b.createTargetMachine();
            if (!tm) return tm.takeError();
            return std::make_unique<llvm::orc::TMOwningSimpleCompiler>(std::move(*tm), cache);
          })
          .create(),
      "creating LLJIT");
  // Kernels call libm (expf, tanhf, powf, ...) from the process, the same functions the interpreter uses.
  impl->jit->getMainJITDylib().addGenerator(
      Unwrap(llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(
                 impl->jit->getDataLayout().getGlobalPrefix()),
             "process symbols"));
  return std::unique_ptr<JitCompiler>(new JitCompiler(std::move(impl)));
}

const std::string& JitCompiler::target_key() const { return impl_->target_key; }
int JitCompiler::cache_hits() const { return impl_->cache->hits; }
int JitCompiler::cache_writes() const { return impl_->cache->writes; }
int JitCompiler::cache_rejects() const { return impl_->cache->rejects; }

bool JitCompiler::AddCachedObject(const std::string& key) {
  std::unique_ptr<llvm::MemoryBuffer> obj = impl_->cache->Load(key);
  if (!obj) return false;
  if (llvm::Error e = impl_->jit->addObjectFile(std::move(obj))) {
    throw Error(Str("JIT: loading cached object ", key, ": ", ToString(std::move(e))));
  }
  return true;
}

namespace {
// Collects the loop vectoriser's remarks (the ones -Rpass=loop-vectorize would print).
struct VectorizeRemarks : llvm::DiagnosticHandler {
  explicit VectorizeRemarks(std::vector<std::string>* out) : out(out) {}
  bool handleDiagnostics(const llvm::DiagnosticInfo& di) override {
    const auto* r = llvm::dyn_cast<llvm::DiagnosticInfoOptimizationBase>(&di);
    if (!r || r->getPassName() != "loop-vectorize") return false;
    const char* kind = di.getKind() == llvm::DK_OptimizationRemark ? "passed" : "missed";
    out->push_back(r->getFunction().getName().str() + ": " + kind + ": " + r->getMsg());
    return true;
  }
  bool isAnalysisRemarkEnabled(llvm::StringRef pass) const override { return false; }
  bool isAnyRemarkEnabled() const override { return true; }
  bool isMissedOptRemarkEnabled(llvm::StringRef pass) const override { return pass == "loop-vectorize"; }
  bool isPassedOptRemarkEnabled(llvm::StringRef pass) const override { return pass == "loop-vectorize"; }
  std::vector<std::string>* out;
};
}  // namespace

namespace {
// Functions marked kLateInlineAttr (jit/avx512_variants.h) were noinline through O3, so that the loop
// vectoriser could map their calls to their vector variants: now inlined everywhere and removed.
void InlineLate(llvm::Module& m, llvm::ModuleAnalysisManager& mam) {
  bool any = false;
  for (llvm::Function& f : m) {
    if (!f.hasFnAttribute(kLateInlineAttr)) continue;
    f.removeFnAttr(llvm::Attribute::NoInline);
    f.addFnAttr(llvm::Attribute::AlwaysInline);
    any = true;
  }
  if (!any) return;
  // Only the late-inlined functions are in llvm.compiler.used (kept there through O3).
  if (llvm::GlobalVariable* used = m.getNamedGlobal("llvm.compiler.used")) used->eraseFromParent();
  llvm::ModulePassManager late;
  late.addPass(llvm::AlwaysInlinerPass());
  late.addPass(llvm::GlobalDCEPass());
  late.run(m, mam);
}
}  // namespace

void JitCompiler::Optimize(llvm::Module& m, std::vector<std::string>* vectorize_remarks) {
  std::unique_ptr<llvm::DiagnosticHandler> saved;
  if (vectorize_remarks) {
    saved = m.getContext().getDiagnosticHandler();
    m.getContext().setDiagnosticHandler(std::make_unique<VectorizeRemarks>(vectorize_remarks));
  }
  m.setDataLayout(impl_->tm->createDataLayout());
  m.setTargetTriple(impl_->tm->getTargetTriple().str());
  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PipelineTuningOptions pto;
  pto.LoopVectorization = true;
  pto.SLPVectorization = true;
  llvm::PassBuilder pb(impl_->tm.get(), pto);
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  llvm::ModulePassManager mpm = pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O3);
  mpm.run(m, mam);
  InlineLate(m, mam);
  if (vectorize_remarks) m.getContext().setDiagnosticHandler(std::move(saved));
}

void JitCompiler::AddModule(std::unique_ptr<llvm::Module> module, std::unique_ptr<llvm::LLVMContext> context,
                            const std::string& key) {
  std::string err;
  llvm::raw_string_ostream es(err);
  SS_CHECK(!llvm::verifyModule(*module, &es), "JIT: emitted LLVM IR is invalid: ", es.str());
  module->setModuleIdentifier(key);
  Optimize(*module);
  if (llvm::Error e = impl_->jit->addIRModule(llvm::orc::ThreadSafeModule(std::move(module), std::move(context))))
    throw Error(Str("JIT: adding module: ", ToString(std::move(e))));
}

void JitCompiler::DefineSymbols(const std::vector<std::pair<std::string, void*>>& symbols) {
  llvm::orc::SymbolMap map;
  for (const auto& [name, address] : symbols)
    map[impl_->jit->mangleAndIntern(name)] =
        llvm::JITEvaluatedSymbol(llvm::pointerToJITTargetAddress(address), llvm::JITSymbolFlags::Exported | llvm::JITSymbolFlags::Callable);
  if (llvm::Error e = impl_->jit->getMainJITDylib().define(llvm::orc::absoluteSymbols(std::move(map))))
    throw Error(Str("JIT: defining runtime symbols: ", ToString(std::move(e))));
}

void* JitCompiler::Lookup(const std::string& name) {
  auto sym = impl_->jit->lookup(name);
  if (!sym) throw Error(Str("JIT: symbol ", name, ": ", ToString(sym.takeError())));
  return reinterpret_cast<void*>(static_cast<uintptr_t>(sym->getAddress()));
}

}  // namespace shardstep::jit
