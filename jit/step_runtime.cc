// The step driver's entry points: each runs one schedule step, times it under SHARDSTEP_JIT_PROFILE=1,
// and turns an exception into a status (see step_runtime.h).
#include "jit/step_runtime.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>

#include "ir/error.h"
#include "jit/compiled_step.h"
#include "jit/dnnl_kernels.h"
#include "jit/kernel_emitter.h"
#include "jit/shared_weight_packs.h"

namespace shardstep::jit {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per parallel chunk of a fused loop

// SHARDSTEP_JIT_PROFILE=1: wall time per op kind (and for fused loops), printed at exit; =2: per
// instruction ("<op> %<id> <type>") and per fused loop length ("fused loops n=<elements>"). Each
// entry's first call is kept apart: it carries one-time costs (oneDNN building its kernels, first
// touches of memory), which at 30 steps made a 0.03 ms matmul read as 1.3 ms per call.
struct Profile {
  struct Entry {
    double first = 0, rest = 0;  // seconds: the first call, and the calls after it
    int64_t calls = 0;
  };
  std::mutex mu;
  std::map<std::string, Entry> time;
  ~Profile() {
    if (time.empty()) return;
    std::fprintf(stderr, "jit profile (wall seconds and calls after each entry's first call; the first call; ms per later call):\n");
    for (auto& [k, e] : time)
      std::fprintf(stderr, "  %-22s %9.4f %8lld   first %9.4f   %8.3f ms\n", k.c_str(), e.rest,
                   static_cast<long long>(e.calls - 1), e.first, e.calls > 1 ? e.rest * 1e3 / (e.calls - 1) : 0.0);
  }
  void Add(const std::string& k, double s) {
    std::lock_guard<std::mutex> l(mu);
    Entry& e = time[k];
    (e.calls++ == 0 ? e.first : e.rest) += s;
  }
};
int ProfileLevel() {
  static const int level = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_PROFILE");
    const std::string v = e ? e : "";
    return v == "1" ? 1 : v == "2" ? 2 : 0;
  }();
  return level;
}
// SHARDSTEP_JIT_PROFILE_CLOCK=thread: the calling thread's CPU time instead of wall time (replicas
// time-sliced on fewer cores: an op's wall time also holds the other replicas' slices). Work a TBB
// worker takes from the op is not counted then.
double ProfileNow() {
  static const bool thread_clock = [] {
    const char* e = std::getenv("SHARDSTEP_JIT_PROFILE_CLOCK");
    return e && std::string(e) == "thread";
  }();
  if (!thread_clock) return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
Profile* Profiler() {
  static Profile p;
  return ProfileLevel() > 0 ? &p : nullptr;
}
// The profile's key for instruction v: its op, or at level 2 the instruction itself.
std::string InstrKey(const CompiledStep& step, int64_t v) {
  const ir::Instr& in = step.module().at(static_cast<ir::ValueId>(v));
  if (ProfileLevel() < 2) return std::string(ir::OpName(in.op));
  return Str(ir::OpName(in.op), " %", v, " ", in.type.ToString());
}

// A fused loop's level-2 key: its length, name and first member ("fused loops n=<elements> ss_k<i> %<v>").
std::string KernelKey(const CompiledStep& step, void* fn, int64_t n) {
  const auto& fns = step.kernel_fns();
  for (size_t i = 0; i < fns.size(); ++i)
    if (fns[i] == fn) return Str("fused loops n=", n, " ", step.kernels()[i].name, " %", step.kernels()[i].members[0]);
  return Str("fused loops n=", n);
}

// Runs `body`, timed as `what` (a callable giving the name, so no string is built when not
// profiling); an exception becomes status 1 with the exception kept in ctx.
template <typename Name, typename Body>
int32_t Guarded(StepContext* ctx, Name what, Body body) noexcept {
  try {
    Profile* prof = Profiler();
    const double t0 = prof ? ProfileNow() : 0.0;
    body();
    if (prof) prof->Add(what(), ProfileNow() - t0);
    return 0;
  } catch (...) {
    ctx->error = std::current_exception();
    return 1;
  }
}

// Instruction errors carry "%<id> = <op>: " (leaf errors already name the variable or input).
template <typename Body>
void Prefixed(const CompiledStep& step, int64_t value, Body body) {
  try {
    body();
  } catch (const Error& e) {
    const ir::Instr& in = step.module().at(static_cast<ir::ValueId>(value));
    if (ir::HasProperty(in.op, ir::kLeaf)) throw;
    throw Error(Str("%", value, " = ", ir::OpName(in.op), ": ", e.what()));
  }
}

}  // namespace

std::vector<std::pair<std::string, void*>> StepRuntimeSymbols() {
  return {{"ss_rt_kernel", reinterpret_cast<void*>(&ss_rt_kernel)},
          {"ss_rt_sgemm", reinterpret_cast<void*>(&ss_rt_sgemm)},
          {"ss_rt_collective", reinterpret_cast<void*>(&ss_rt_collective)},
          {"ss_rt_instr", reinterpret_cast<void*>(&ss_rt_instr)}};
}

}  // namespace shardstep::jit

using shardstep::jit::Guarded;
using shardstep::jit::StepContext;

extern "C" int32_t ss_rt_kernel(StepContext* ctx, void* kernel, void* const* bufs, int64_t n) {
  return Guarded(ctx, [&] { return shardstep::jit::ProfileLevel() < 2 ? std::string("fused loops") : shardstep::jit::KernelKey(*ctx->step, kernel, n); }, [&] {
    const auto fn = reinterpret_cast<shardstep::jit::KernelFn>(kernel);
    if (n >= 2 * shardstep::jit::kGrain) {
      tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, shardstep::jit::kGrain),
                        [&](const tbb::blocked_range<int64_t>& r) { fn(bufs, r.begin(), r.end()); });
    } else {
      fn(bufs, 0, n);
    }
  });
}

extern "C" int32_t ss_rt_sgemm(StepContext* ctx, int64_t value, int32_t ta, int32_t tb, int64_t m, int64_t n,
                               int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* out) {
  return Guarded(ctx, [&] { return shardstep::jit::InstrKey(*ctx->step, value); }, [&] {
    shardstep::jit::Prefixed(*ctx->step, value, [&] {
      if (ctx->packs && !ta && !tb && ctx->packs->Multiply(value, ctx->run, m, n, k, a, lda, b, ldb, out)) return;
      shardstep::jit::StepSgemm(ta, tb, m, n, k, a, lda, b, ldb, out);
    });
  });
}

extern "C" int32_t ss_rt_collective(StepContext* ctx, int64_t value) { return ss_rt_instr(ctx, value); }

extern "C" int32_t ss_rt_instr(StepContext* ctx, int64_t value) {
  const auto v = static_cast<shardstep::ir::ValueId>(value);
  return Guarded(ctx, [&] { return shardstep::jit::InstrKey(*ctx->step, value); }, [&] {
    shardstep::jit::Prefixed(*ctx->step, value, [&] {
      ctx->step->RunInstr(v, *ctx->binding, ctx->replica, ctx->collectives, ctx->ws, ctx->batch_parts);
    });
  });
}
