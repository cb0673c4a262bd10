// bench/transcendental: softmax, log-softmax, GELU (tanh form) and sigmoid forward steps on the CPU JIT,
// with the fused loops' exp / log / tanh as inline vectorised IR (jit/vector_math.h) against the scalar
// libm calls they replaced (SHARDSTEP_SCALAR_LIBM=1 at compile time), compiled in one process and
// measured alternately; medians and the ratio. Reductions run the same code in both.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "ir/builder.h"
#include "jit/compiled_step.h"

using namespace shardstep;
using Clock = std::chrono::steady_clock;
using ir::OpCode;

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Workload {
  std::string name;
  ir::Shape shape;
  // y from x ([rows, cols], reductions over cols).
  std::function<ir::ValueId(ir::Builder&, ir::ValueId)> body;
};

ir::Module Build(const Workload& w) {
  ir::Module m;
  ir::Builder b(&m);
  const ir::ValueId x = b.Input("x", {ir::DType::kF32, w.shape});
  m.outputs.push_back({"y", w.body(b, x)});
  return m;
}

std::shared_ptr<const jit::CompiledStep> Compile(const ir::Module& m, bool scalar_libm) {
  if (scalar_libm)
    ::setenv("SHARDSTEP_SCALAR_LIBM", "1", 1);
  else
    ::unsetenv("SHARDSTEP_SCALAR_LIBM");
  auto s = jit::CompiledStep::Compile(m, jit::JitOptions{"", /*disk_cache=*/false, /*memory_cache=*/false});
  ::unsetenv("SHARDSTEP_SCALAR_LIBM");
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("vectorised exp/log/tanh vs scalar libm in the JIT's fused loops");
  int rows = 4096, cols = 512, runs = 15;
  bool remarks = false;
  app.add_option("--rows", rows, "rows (softmax over columns)");
  app.add_option("--cols", cols, "columns");
  app.add_option("--runs", runs, "timed runs per variant (alternating)");
  app.add_flag("--remarks", remarks, "print the loop vectoriser's remarks for each step's kernels");
  CLI11_PARSE(app, argc, argv);

  const ir::Shape shape = {rows, cols};
  auto row_bcast = [shape](ir::Builder& b, ir::ValueId r) { return b.Broadcast(r, shape, {0}); };
  const std::vector<Workload> work = {
      {"softmax", shape,
       [&](ir::Builder& b, ir::ValueId x) {
         const ir::ValueId e = b.Unary(OpCode::kExp, b.Sub(x, row_bcast(b, b.ReduceMax(x, {1}))));
         return b.Div(e, row_bcast(b, b.ReduceSum(e, {1})));
       }},
      {"log_softmax", shape,
       [&](ir::Builder& b, ir::ValueId x) {
         const ir::ValueId z = b.Sub(x, row_bcast(b, b.ReduceMax(x, {1})));
         const ir::ValueId lse = b.Unary(OpCode::kLog, b.ReduceSum(b.Unary(OpCode::kExp, z), {1}));
         return b.Sub(z, row_bcast(b, lse));
       }},
      {"gelu_tanh", shape,
       [](ir::Builder& b, ir::ValueId v) {  // dsl Tensor::gelu
         const ir::ValueId cube = b.Mul(b.Mul(v, v), v);
         const ir::ValueId inner = b.MulScalar(b.Add(v, b.MulScalar(cube, 0.044715)), 0.7978845608028654);
         return b.Mul(b.MulScalar(v, 0.5), b.AddScalar(b.Unary(OpCode::kTanh, inner), 1.0));
       }},
      {"sigmoid", shape, [](ir::Builder& b, ir::ValueId x) { return b.Unary(OpCode::kSigmoid, x); }},
      {"log", shape, [](ir::Builder& b, ir::ValueId x) { return b.Unary(OpCode::kLog, b.Unary(OpCode::kAbs, x)); }},
  };

  std::mt19937 rng(1);
  std::vector<float> data(static_cast<size_t>(rows) * cols);
  for (float& v : data) v = std::normal_distribution<float>(0, 3)(rng);
  runtime::TensorMap inputs;
  inputs.emplace("x", runtime::Tensor::F32(shape, data));

  std::printf("%d x %d f32 (%.1f MB), %d runs each, alternating; times are medians\n", rows, cols,
              4.0 * rows * cols / 1e6, runs);
  std::printf("%-12s %14s %14s %8s\n", "step", "libm (ms)", "vector (ms)", "ratio");
  for (const Workload& w : work) {
    const ir::Module m = Build(w);
    if (remarks) {
      const std::string ir = jit::EmitLlvmIr(m);
      std::printf("%s", ir.substr(0, ir.find("\n\n")).c_str());
      std::printf("\n");
    }
    std::shared_ptr<const jit::CompiledStep> step[2] = {Compile(m, true), Compile(m, false)};
    jit::Workspace ws[2];
    runtime::TensorMap vars;
    float max_diff = 0, max_abs = 0;  // the outputs' largest difference, relative to their largest magnitude
    {
      const runtime::TensorMap a = step[0]->Run(vars, inputs, 0, nullptr, &ws[0]);
      const runtime::TensorMap b = step[1]->Run(vars, inputs, 0, nullptr, &ws[1]);
      const runtime::Tensor &ya = a.at("y"), &yb = b.at("y");
      for (int64_t i = 0; i < ya.elements(); ++i) {
        if (!std::isfinite(ya.f32[i]) && (ya.f32[i] == yb.f32[i] || (std::isnan(ya.f32[i]) && std::isnan(yb.f32[i]))))
          continue;  // the same special value
        max_diff = std::max(max_diff, std::abs(ya.f32[i] - yb.f32[i]));
        max_abs = std::max(max_abs, std::abs(ya.f32[i]));
      }
    }
    std::vector<double> t[2];
    for (int r = 0; r < runs; ++r)
      for (int v = 0; v < 2; ++v) {
        const auto t0 = Clock::now();
        step[v]->Run(vars, inputs, 0, nullptr, &ws[v]);
        t[v].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    const double a = Median(t[0]), b = Median(t[1]);
    std::printf("%-12s %14.3f %14.3f %7.2fx   (outputs: max |difference| / max |y| = %.2g)\n", w.name.c_str(), a, b,
                a / b, static_cast<double>(max_diff / max_abs));
  }
  return 0;
}
