// bench/step: one-replica training step (forward + backward + Adam) of the MLP 784-1024-1024-10 and
// the CNN at batch 128 on the CPU JIT, against PyTorch 1.13 running the same models in a child
// process (bench/torch_step.py, torch.set_num_threads(2), OPENBLAS_NUM_THREADS=1), measured
// alternately in one run; medians and ratios. Also: the step's achieved GFLOP/s vs oneDNN sgemm
// measured here, and the fused-Adam update's bytes/s vs a STREAM triad measured here.
#include <sys/resource.h>
#include <sys/wait.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "api/session.h"
#include "dsl/dsl.h"
#include "ir/builder.h"
#include "ir/error.h"
#include "ir/passes/collective_combiner.h"
#include "ir/passes/data_parallel_lowering.h"
#include "ir/passes/optimizer_lowering.h"
#include "ir/passes/weight_update_sharder.h"
#include "jit/cpu_executor.h"
#include "jit/dnnl_kernels.h"
#include "models/models.h"
#include "models/transformer.h"
#include "runtime/sharding.h"

using namespace shardstep;
using Clock = std::chrono::steady_clock;

namespace {

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double CpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// The PyTorch child: line protocol over two pipes.
class Torch {
 public:
  Torch(const std::string& script, int threads) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) throw Error("pipe failed");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[1]);
      close(out[0]);
      setenv("OPENBLAS_NUM_THREADS", "1", 1);
      const std::string t = std::to_string(threads);
      execl("/usr/bin/python3", "python3", script.c_str(), t.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
    banner_ = ReadLine();
    if (banner_.rfind("ready", 0) != 0) throw Error("PyTorch child did not start: " + banner_);
  }
  ~Torch() {
    if (to_) {
      std::fputs("quit\n", to_);
      std::fflush(to_);
      std::fclose(to_);
    }
    if (from_) std::fclose(from_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  const std::string& banner() const { return banner_; }
  std::vector<double> Steps(const std::string& model, int k) {
    std::fprintf(to_, "%s %d\n", model.c_str(), k);
    std::fflush(to_);
    std::istringstream is(ReadLine());
    std::vector<double> ms;
    for (double t; is >> t;) ms.push_back(t);
    if (static_cast<int>(ms.size()) != k) throw Error("PyTorch child failed");
    return ms;
  }

 private:
  std::string ReadLine() {
    std::string s;
    for (int c; (c = std::fgetc(from_)) != EOF && c != '\n';) s.push_back(static_cast<char>(c));
    return s;
  }
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  std::string banner_;
};

// Multiply-add FLOPs of the step's matmuls and convolutions (2 per multiply-add).
double StepFlops(const ir::Module& m) {
  double f = 0;
  for (const ir::Instr& in : m.instrs) {
    auto sh = [&](int i) { return m.type(in.operands[i]).shape; };
    switch (in.op) {
      case ir::OpCode::kMatmul: {
        const bool ta = in.GetInt("transpose_a", 0) != 0;
        f += 2.0 * in.type.shape[0] * in.type.shape[1] * (ta ? sh(0)[0] : sh(0)[1]);
        break;
      }
      case ir::OpCode::kConv2d:  // y [N,O,OH,OW], w [O,C,KH,KW]
        f += 2.0 * ir::NumElements(in.type.shape) * sh(1)[1] * sh(1)[2] * sh(1)[3];
        break;
      case ir::OpCode::kConv2dInputGrad:  // dy [N,O,OH,OW], w
        f += 2.0 * ir::NumElements(sh(0)) * sh(1)[1] * sh(1)[2] * sh(1)[3];
        break;
      case ir::OpCode::kConv2dFilterGrad:  // x, dy [N,O,OH,OW] -> w [O,C,KH,KW]
        f += 2.0 * ir::NumElements(sh(1)) * in.type.shape[1] * in.type.shape[2] * in.type.shape[3];
        break;
      default: break;
    }
  }
  return f;
}

// oneDNN sgemm C[m,n] = A[m,k] B[k,n]: with oneDNN's own OpenMP threading (tbb_split = false) or
// as the step runs it (row blocks as TBB tasks, one OpenMP thread each).
double SgemmGflops(int64_t m, int64_t n, int64_t k, bool tbb_split = false) {
  std::vector<float> a(m * k, 0.5f), b(k * n, 0.25f), c(m * n);
  jit::SetOmpThreads(tbb_split ? 1 : jit::NumCores());
  auto run = [&] {
    if (tbb_split) jit::ParallelSgemm(false, false, m, n, k, a.data(), k, b.data(), n, c.data());
    else jit::DnnlSgemm(false, false, m, n, k, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  };
  for (int i = 0; i < 3; ++i) run();
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    auto t0 = Clock::now();
    run();
    t.push_back(Seconds(t0, Clock::now()));
  }
  jit::SetOmpThreads(1);
  return 2.0 * m * n * k / Median(t) / 1e9;
}

// STREAM triad a = b + s * c over n floats, split across the cores with TBB; bytes = 3 * 4 * n.
double TriadBytesPerSecond(int64_t n) {
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  const float s = 3.0f;
  auto run = [&] {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 1 << 16), [&](const tbb::blocked_range<int64_t>& r) {
      float* __restrict pa = a.data();
      const float* __restrict pb = b.data();
      const float* __restrict pc = c.data();
      for (int64_t i = r.begin(); i < r.end(); ++i) pa[i] = pb[i] + s * pc[i];
    });
  };
  run();
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    auto t0 = Clock::now();
    run();
    t.push_back(Seconds(t0, Clock::now()));
  }
  return 3.0 * 4 * n / Median(t);
}

// The JIT'd fused Adam update over n parameters: reads w, g, m, v, writes w, m, v (7 x 4 bytes).
double FusedAdamBytesPerSecond(int64_t n, int* kernels) {
  ir::Module m;
  m.name = "adam";
  ir::Builder b(&m);
  const ir::TensorType t{ir::DType::kF32, {n}};
  auto w = b.Variable("w", t, ir::kRoleWeight), mm = b.Variable("m", t, ir::kRoleOptimizerState),
       v = b.Variable("v", t, ir::kRoleOptimizerState);
  auto g = b.Input("g", t);
  auto lr = b.Input("lr", {ir::DType::kF32, {}});
  auto m2 = b.Add(b.MulScalar(mm, 0.9), b.MulScalar(g, 0.1));
  auto v2 = b.Add(b.MulScalar(v, 0.999), b.Mul(b.MulScalar(g, 0.001), g));
  auto w2 = b.Sub(w, b.Div(b.Mul(b.BroadcastScalar(lr, {n}), m2), b.AddScalar(b.Unary(ir::OpCode::kSqrt, v2), 1e-8)));
  m.assigns = {{w, w2}, {mm, m2}, {v, v2}};
  auto step = jit::CompiledStep::Compile(m);
  *kernels = static_cast<int>(step->kernels().size());
  runtime::TensorMap vars{{"w", runtime::Tensor(t)}, {"m", runtime::Tensor(t)}, {"v", runtime::Tensor(t)}};
  runtime::TensorMap inputs{{"g", runtime::Tensor(t)}, {"lr", runtime::Tensor::Scalar(1e-3f)}};
  std::fill(inputs["g"].f32.begin(), inputs["g"].f32.end(), 0.01f);
  jit::Workspace ws;
  for (int i = 0; i < 2; ++i) step->Run(vars, inputs, 0, nullptr, &ws);
  std::vector<double> ts;
  for (int i = 0; i < 10; ++i) {
    auto t0 = Clock::now();
    step->Run(vars, inputs, 0, nullptr, &ws);
    ts.push_back(Seconds(t0, Clock::now()));
  }
  return 7.0 * 4 * n / Median(ts);
}

struct Row {
  std::string model;
  double jit_ms, torch_ms, gflop, cpu_util;
  std::vector<double> torch_each;  // per thread setting
};

Row BenchModel(const std::string& name, std::vector<Torch*> torches, int rounds, int k) {
  dsl::Model m(name, 1);
  models::ModelOptions mo;
  mo.batch = 128;
  mo.hidden = {1024, 1024};
  dsl::Tensor loss = name == "cnn" ? models::DefineCnn(m, mo) : models::DefineMlp(m, mo);
  dsl::Program p = m.train(loss).optimizer(dsl::Adam().lr(1e-3)).replicas(1).build();
  // The public API's Session on the JIT backend, as a user's program runs it.
  Session session(m, p, "cpu");
  runtime::TensorMap batch;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const ir::TensorType it = p.step.type(p.step.FindInput("image"));
  batch["image"] = runtime::Tensor(it);
  for (float& x : batch["image"].f32) x = nd(rng);
  batch["label"] = runtime::Tensor(p.step.type(p.step.FindInput("label")));
  for (int32_t& l : batch["label"].s32) l = static_cast<int32_t>(rng() % 10);
  for (int i = 0; i < 3; ++i) session.Step(batch);
  std::vector<double> jit_ms;
  std::vector<std::vector<double>> torch_ms(torches.size());
  double cpu = 0, wall = 0;
  // Before each contender's block, a pause: the previous one's idle threads (GNU OpenMP's and TBB's
  // spin-waits after a parallel region) must have gone to sleep, or they take a core from the next.
  auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); };
  for (int r = 0; r < rounds; ++r) {
    settle();
    for (int i = 0; i < k; ++i) {
      const double c0 = CpuSeconds();
      auto t0 = Clock::now();
      session.Step(batch);
      const double s = Seconds(t0, Clock::now());
      cpu += CpuSeconds() - c0;
      wall += s;
      jit_ms.push_back(s * 1e3);
    }
    for (size_t j = 0; j < torches.size(); ++j) {
      settle();
      auto t = torches[j]->Steps(name, k);
      torch_ms[j].insert(torch_ms[j].end(), t.begin(), t.end());
    }
  }
  std::vector<double> each;
  for (auto& t : torch_ms) each.push_back(Median(t));
  // The compile report is the JIT executor's own (behind the Session).
  const jit::CompileInfo& ci = dynamic_cast<jit::CpuExecutor&>(session.executor()).compile_info();
  std::cout << "  " << name << ": jit compile " << ci.source << " " << std::fixed << std::setprecision(3) << ci.seconds
            << " s, " << ci.kernels << " fused kernels\n";
  return {name, Median(jit_ms), *std::min_element(each.begin(), each.end()), StepFlops(p.step) / 1e9, cpu / wall, each};
}

// --bf16: the same binary's steps at --precision f32 and bf16 (MLP 784-1024-1024-10 batch 128 Adam;
// transformer_lm at configs/transformer_lm.toml's shape, batch 32, Adam), measured alternately.
runtime::TensorMap RandomBatch(const ir::Module& step, int32_t classes) {
  runtime::TensorMap batch;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (const ir::Instr& in : step.instrs) {
    if (in.op != ir::OpCode::kInput) continue;
    runtime::Tensor t(in.type);
    for (float& x : t.f32) x = nd(rng);
    for (int32_t& x : t.s32) x = static_cast<int32_t>(rng() % classes);
    batch[in.name] = std::move(t);
  }
  return batch;
}

struct PrecisionPair {
  std::vector<std::unique_ptr<dsl::Model>> models;  // kept alive beside their sessions
  std::unique_ptr<Session> f32, bf16;
  runtime::TensorMap batch;
};

PrecisionPair MakePair(const std::string& name) {
  PrecisionPair pp;
  for (const char* prec : {"f32", "bf16"}) {
    auto m = std::make_unique<dsl::Model>(name, 1);
    models::ModelOptions mo;
    dsl::Tensor loss;
    int32_t classes = 10;
    if (name == "mlp") {
      mo.batch = 128;
      mo.hidden = {1024, 1024};
      loss = models::DefineMlp(*m, mo);
    } else {
      mo.batch = 32;
      mo.context = 128;
      mo.layers = 4;
      mo.width = 128;
      mo.heads = 4;
      mo.mlp_width = 512;
      mo.vocab = classes = 80;
      loss = models::DefineTransformerLm(*m, mo);
    }
    dsl::Program p = m->train(loss).optimizer(dsl::Adam().lr(1e-3)).precision(prec).replicas(1).build();
    auto s = std::make_unique<Session>(*m, p, "cpu");
    if (pp.batch.empty()) pp.batch = RandomBatch(p.step, classes);
    (std::string(prec) == "f32" ? pp.f32 : pp.bf16) = std::move(s);
    pp.models.push_back(std::move(m));
  }
  return pp;
}

// Bare GEMMs at the shapes of the MLP's matmuls (forward, input gradient, weight gradient), 2 OpenMP
// threads: oneDNN sgemm vs oneDNN bf16 matmul on bf16 data; and as a step runs them (TBB row blocks,
// ParallelSgemm vs ParallelBf16Matmul with its f32 -> bf16 conversion). Milliseconds per set.
void GemmCompare() {
  struct G {
    bool ta, tb;
    int64_t m, n, k;
  };
  const std::vector<G> shapes = {{false, false, 128, 1024, 784},  {false, false, 128, 1024, 1024},
                                 {false, false, 128, 10, 1024},   {false, true, 128, 1024, 1024},
                                 {false, true, 128, 1024, 10},    {true, false, 784, 1024, 128},
                                 {true, false, 1024, 1024, 128},  {true, false, 1024, 10, 128}};
  const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream strm(eng);
  double t_sgemm = 0, t_bf16 = 0, t_split = 0, t_split_bf16 = 0;
  auto time = [](const std::function<void()>& f) {
    for (int i = 0; i < 3; ++i) f();
    std::vector<double> t;
    for (int i = 0; i < 20; ++i) {
      auto t0 = Clock::now();
      f();
      t.push_back(Seconds(t0, Clock::now()));
    }
    return Median(t);
  };
  for (const G& g : shapes) {
    const int64_t lda = g.ta ? g.m : g.k, ldb = g.tb ? g.k : g.n;
    std::vector<float> a(g.m * g.k, 0.5f), b(g.k * g.n, 0.25f), c(g.m * g.n);
    std::vector<uint16_t> ha(a.size(), 0x3f00), hb(b.size(), 0x3e80);
    jit::SetOmpThreads(jit::NumCores());
    using dnnl::memory;
    memory::desc ma({g.m, g.k}, memory::data_type::bf16, g.ta ? memory::dims{1, lda} : memory::dims{lda, 1});
    memory::desc mb({g.k, g.n}, memory::data_type::bf16, g.tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
    memory::desc mc({g.m, g.n}, memory::data_type::f32, memory::dims{g.n, 1});
    dnnl::matmul mm(dnnl::matmul::primitive_desc(dnnl::matmul::desc(ma, mb, mc), eng));
    memory xa(ma, eng, ha.data()), xb(mb, eng, hb.data()), xc(mc, eng, c.data());
    t_sgemm += time([&] { jit::DnnlSgemm(g.ta, g.tb, g.m, g.n, g.k, a.data(), lda, b.data(), ldb, 0.0f, c.data(), g.n); });
    t_bf16 += time([&] {
      mm.execute(strm, {{DNNL_ARG_SRC, xa}, {DNNL_ARG_WEIGHTS, xb}, {DNNL_ARG_DST, xc}});
      strm.wait();
    });
    jit::SetOmpThreads(1);
    t_split += time([&] { jit::ParallelSgemm(g.ta, g.tb, g.m, g.n, g.k, a.data(), lda, b.data(), ldb, c.data()); });
    t_split_bf16 += time([&] {
      jit::ParallelBf16Matmul(g.ta, g.tb, 1, g.m, g.n, g.k, a.data(), lda, 0, b.data(), ldb, 0, c.data());
    });
  }
  std::cout << std::fixed << std::setprecision(3) << "the MLP's 8 matmuls, ms per set (medians of 20): oneDNN sgemm "
            << t_sgemm * 1e3 << ", oneDNN bf16 matmul " << t_bf16 * 1e3 << " (ratio " << t_bf16 / t_sgemm
            << "); as the step runs them: ParallelSgemm " << t_split * 1e3 << ", ParallelBf16Matmul (with conversion) "
            << t_split_bf16 * 1e3 << " (ratio " << t_split_bf16 / t_split << ")\n";
}

int PrecisionCompare(int rounds) {
  jit::ConfigureThreadsForReplica(1);
  const int k = 5;
  std::cout << "f32 vs bf16 steps, same binary, alternately, " << rounds << " rounds x " << k << " steps\n";
  for (const char* name : {"mlp", "transformer_lm"}) {
    PrecisionPair pp = MakePair(name);
    for (int i = 0; i < 3; ++i) {
      pp.f32->Step(pp.batch);
      pp.bf16->Step(pp.batch);
    }
    std::vector<double> f, h;
    for (int r = 0; r < rounds; ++r)
      for (auto [s, v] : {std::pair{pp.f32.get(), &f}, std::pair{pp.bf16.get(), &h}}) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        for (int i = 0; i < k; ++i) {
          auto t0 = Clock::now();
          s->Step(pp.batch);
          v->push_back(Seconds(t0, Clock::now()) * 1e3);
        }
      }
    std::cout << std::fixed << std::setprecision(2) << "  " << name << ": f32 " << Median(f) << " ms, bf16 "
              << Median(h) << " ms, ratio " << std::setprecision(3) << Median(h) / Median(f) << " (target <= 0.65)\n";
  }
  GemmCompare();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "--bf16") return PrecisionCompare(argc > 2 ? std::atoi(argv[2]) : 6);
    const int rounds = argc > 1 ? std::atoi(argv[1]) : 8;
    // Optional second argument: cap shardstep's threads (TBB) to measure its best setting on a busy machine.
    const int threads = argc > 2 ? std::atoi(argv[2]) : jit::NumCores();
    tbb::global_control cap(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(std::max(1, threads)));
    const int k = 5;
    std::string here = __FILE__;  // the script sits beside this file
    std::string script = here.substr(0, here.find_last_of('/') + 1) + "torch_step.py";
    if (const char* e = std::getenv("SHARDSTEP_TORCH_SCRIPT")) script = e;
    jit::ConfigureThreadsForReplica(1);
    std::cout << "threads: " << jit::NumCores() << " cores; one replica thread; oneDNN (OpenMP) threads "
              << jit::OmpMaxThreads() << " per call (matmuls split into TBB tasks); TBB max concurrency "
              << tbb::this_task_arena::max_concurrency() << "; OpenBLAS 1 thread\n";
    // PyTorch at both thread settings; the comparison is against whichever is faster in this run
    // (2 threads is best on an idle machine; on a loaded one 1 thread can win).
    Torch torch2(script, 2), torch1(script, 1);
    std::cout << "pytorch children: " << torch2.banner() << " / " << torch1.banner() << ", OPENBLAS_NUM_THREADS=1\n";
    std::cout << "measuring alternately, " << rounds << " rounds x " << k << " steps each, batch 128, Adam\n";
    std::vector<Row> rows;
    for (const char* name : {"mlp", "cnn"}) rows.push_back(BenchModel(name, {&torch2, &torch1}, rounds, k));
    const double sgemm_mlp = SgemmGflops(128, 1024, 1024), sgemm_big = SgemmGflops(1024, 1024, 1024);
    const double split_mlp = SgemmGflops(128, 1024, 1024, true), split_big = SgemmGflops(1024, 1024, 1024, true);
    std::cout << "\n" << std::left << std::setw(6) << "model" << std::right << std::setw(12) << "jit ms" << std::setw(12)
              << "torch ms" << std::setw(18) << "(2 thr / 1 thr)" << std::setw(10) << "ratio" << std::setw(12) << "GFLOP/step" << std::setw(12) << "GFLOP/s"
              << std::setw(16) << "cpu/wall (jit)" << "\n";
    for (const Row& r : rows)
      std::cout << std::left << std::setw(6) << r.model << std::right << std::fixed << std::setprecision(2)
                << std::setw(12) << r.jit_ms << std::setw(12) << r.torch_ms << std::setw(9) << r.torch_each[0] << " / "
                << std::setw(6) << r.torch_each[1] << std::setw(10) << r.jit_ms / r.torch_ms
                << std::setw(12) << std::setprecision(3) << r.gflop << std::setw(12) << std::setprecision(1)
                << r.gflop / (r.jit_ms / 1e3) << std::setw(16) << std::setprecision(2) << r.cpu_util << "\n";
    std::cout << "oneDNN sgemm (same binary, 2 threads): " << std::setprecision(1) << sgemm_mlp
              << " GFLOP/s at 128x1024x1024, " << sgemm_big << " GFLOP/s at 1024^3; as the step runs it (TBB row blocks): "
              << split_mlp << " / " << split_big << " GFLOP/s\n";
    std::cout << "targets: mlp ratio <= 0.70, cnn ratio <= 1.00\n";

    int kernels = 0;
    const int64_t n = 10'000'000;
    const double adam = FusedAdamBytesPerSecond(n, &kernels), triad = TriadBytesPerSecond(n);
    std::cout << "\nfused Adam over " << n << " parameters (" << kernels << " JIT kernel, 7 x 4 bytes/param): "
              << std::setprecision(2) << adam / 1e9 << " GB/s; STREAM triad (3 x 4 bytes/elem): " << triad / 1e9
              << " GB/s; fraction " << adam / triad << " (target >= 0.6)\n";

    std::cout << "\nthe weight-update phase, replicated vs sharded at N = 1, 2, 4, 8: bench/weight_update --backend cpu\n";
  } catch (const std::exception& e) {
    std::cerr << "bench/step: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
