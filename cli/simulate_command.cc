// `shardstep simulate`: the step time, memory and link traffic of a model's training step on a TPU pod
// slice (tpu_backend/simulator.h), from the same per-core step module `train` runs, lowered for one
// replica per core of the --mesh. No numerics: a cost model over the module's ops and ring steps.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <memory>
#include <sstream>

#include "cli/commands.h"
#include "cli/flags.h"
#include "cli/preflight.h"
#include "ir/error.h"
#include "ir/passes/pipeline.h"
#include "runtime/atomic_file.h"
#include "tpu_backend/hardware.h"
#include "tpu_backend/mesh_topology.h"
#include "tpu_backend/simulator.h"
#include "tpu_backend/speedup_plot.h"

namespace shardstep::cli {
namespace {

struct SimulateFlags {
  ProgramFlags program;
  std::string mesh;
  int64_t per_core_batch = 0;
  std::string precision = "bf16";  // = program.precision (the shared --precision flag)
  std::string hardware = "tpu-v3";
  bool json = false;
  std::string sweep;  // CSV path
  std::string sweep_meshes = "4x4,8x8,16x16,32x32";
  std::string sweep_batches = "1,2,4,8,16,32";
  // --global-batch: a fixed global batch (MLPerf-style scaling): per-core batch = G / cores of each mesh.
  std::vector<int64_t> global_batches;
  CLI::Option* replicas = nullptr;
  CLI::Option* batch = nullptr;
};

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// The program flags for `mesh` at the per-core batch: one replica per core, global batch = B * replicas.
ProgramFlags ForMesh(const SimulateFlags& s, const tpu::MeshTopology& mesh, int64_t per_core_batch) {
  ProgramFlags f = s.program;
  f.replicas = mesh.replicas();
  f.batch = per_core_batch * mesh.replicas();
  return f;
}

// The step module every pass has run on (what `train` runs per replica), but shard-order-reductions: it
// computes the replicated update's norms as g shard-shaped partial sums folded in replica order, only so
// that sharded and replicated runs give the same bits; the work is that of the whole-tensor reductions, and
// at 2048 replicas its g partials per norm made building a replicated bert large step take minutes.
ir::Module BuildStep(const ProgramFlags& f) {
  ir::Module m = BuildModule(f);
  ir::PassPipeline pipeline = ir::BuildTrainingPipeline(PipelineFromFlags(f, 1000));
  pipeline.Disable("shard-order-reductions");
  if (std::getenv("SHARDSTEP_SIMULATE_TRACE") != nullptr) {  // each pass's wall time (with its verification)
    auto last = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
    pipeline.OnPass([last](const ir::Pass& p, const ir::Module& mod) {
      const auto now = std::chrono::steady_clock::now();
      std::fprintf(stderr, "pass %s: %.3f s, %d values\n", p.name().c_str(),
                   std::chrono::duration<double>(now - *last).count(), mod.size());
      *last = now;
    });
  }
  pipeline.Run(m);
  return m;
}

std::string Describe(const ProgramFlags& f, int64_t per_core_batch) {
  return Str(f.model, f.size.empty() ? "" : " " + f.size, ", ", f.optimizer, ", per-core batch ", per_core_batch,
             " (global ", f.batch, "), weight update ", f.shard_weight_update == "off" ? "replicated" : "sharded",
             f.shard_weight_update == "off" ? "" : Str(", all-gather at the ", f.gather_weights, " of the step"));
}

// The per-core batch of global batch `g` on `mesh`, or an error naming the flags when it does not divide.
int64_t PerCoreOfGlobal(int64_t g, const tpu::MeshTopology& mesh, const std::string& mesh_flag) {
  if (g % mesh.replicas() != 0)
    throw Error(Str("--global-batch ", g, " does not split evenly over the ", mesh.replicas(), " cores of ", mesh_flag,
                    " ", mesh.x(), "x", mesh.y(), " (", mesh.cores_per_chip(), " per chip)"));
  return g / mesh.replicas();
}

int RunSweep(const SimulateFlags& s, const tpu::HardwareTable& hw, tpu::Precision precision) {
  CheckOutputPath("--sweep", s.sweep);
  std::vector<tpu::MeshTopology> meshes;
  for (const std::string& m : SplitList(s.sweep_meshes))
    meshes.push_back(tpu::MeshTopology::Parse(m, hw.cores_per_chip, "--sweep-meshes"));
  std::vector<int64_t> batches;
  for (const std::string& b : SplitList(s.sweep_batches)) {
    char* end = nullptr;
    const long long v = std::strtoll(b.c_str(), &end, 10);
    if (*end || v < 1) throw Error(Str("--sweep-batches: expected positive integers, got '", b, "'"));
    batches.push_back(v);
  }
  if (meshes.empty() || batches.empty()) throw Error("--sweep-meshes and --sweep-batches need at least one value each");
  // A fixed global batch replaces the per-core batches: each mesh runs at G / its cores.
  const bool fixed_global = !s.global_batches.empty();
  if (fixed_global)
    for (int64_t g : s.global_batches)
      for (const tpu::MeshTopology& mesh : meshes) PerCoreOfGlobal(g, mesh, "--sweep-meshes");
  std::ostringstream csv;
  csv << "model,optimizer,precision,mesh,chips,replicas,per_core_batch,replicated_step_ms,sharded_step_ms,speedup,"
         "replicated_weight_update_ms,sharded_weight_update_ms,replicated_exposed_communication_ms,"
         "sharded_exposed_communication_ms,replicated_optimizer_state_bytes,sharded_optimizer_state_bytes,"
         "global_batch\n";
  std::vector<tpu::SpeedupPoint> points;
  for (const tpu::MeshTopology& mesh : meshes)
    for (int64_t line_key : fixed_global ? s.global_batches : batches) {
      const int64_t b = fixed_global ? PerCoreOfGlobal(line_key, mesh, "--sweep-meshes") : line_key;
      tpu::SimulationResult r[2];
      for (int sharded = 0; sharded < 2; ++sharded) {
        ProgramFlags f = ForMesh(s, mesh, b);
        f.shard_weight_update = sharded ? "on" : "off";
        r[sharded] = tpu::Simulate(BuildStep(f), mesh, hw, precision);
      }
      const double speedup = r[0].step_s / r[1].step_s;
      const std::string name = Str(mesh.x(), "x", mesh.y());
      points.push_back({mesh.chips(), name, b, speedup, fixed_global ? line_key : 0});
      char line[512];
      std::snprintf(line, sizeof line, "%s,%s,%s,%s,%d,%d,%lld,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%lld,%lld,%lld\n",
                    s.program.model.c_str(), s.program.optimizer.c_str(), s.precision.c_str(), name.c_str(),
                    mesh.chips(), mesh.replicas(), static_cast<long long>(b), r[0].step_s * 1e3, r[1].step_s * 1e3,
                    speedup, r[0].weight_update_s * 1e3, r[1].weight_update_s * 1e3, r[0].exposed_communication_s * 1e3,
                    r[1].exposed_communication_s * 1e3, static_cast<long long>(r[0].optimizer_state_bytes),
                    static_cast<long long>(r[1].optimizer_state_bytes), static_cast<long long>(b * mesh.replicas()));
      csv << line;
      std::cerr << "simulate: " << name << " per-core batch " << b << " (global " << b * mesh.replicas()
                << "): speedup " << speedup << "\n";
    }
  const std::string text = csv.str();
  runtime::WriteFileAtomically(s.sweep, {{text.data(), text.size()}}, "--sweep");
  std::string svg_path = s.sweep;
  if (svg_path.size() > 4 && svg_path.substr(svg_path.size() - 4) == ".csv") svg_path.resize(svg_path.size() - 4);
  svg_path += ".svg";
  const std::string svg = tpu::SpeedupPlotSvg(points, Str("weight-update sharding on ", hw.name, ": ", s.program.model,
                                                          ", ", s.program.optimizer, ", ", s.precision));
  runtime::WriteFileAtomically(svg_path, {{svg.data(), svg.size()}}, "--sweep");
  std::cout << "wrote " << s.sweep << " and " << svg_path << " (" << points.size() << " points)\n";
  return 0;
}

int RunSimulate(SimulateFlags s) {
  const auto start = std::chrono::steady_clock::now();
#ifdef __GLIBC__
  // The pipeline and the 2048-core ring schedules allocate and free many multi-megabyte blocks (a module's
  // instructions per pass rewrite, ~10^5 transfers per schedule); glibc maps each one fresh from the
  // kernel and returns it on free, so every reuse page-faults again (a fifth of the run on a VM). Keep them.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
  // A shipped table by name, or a table file by path.
  const bool is_path = s.hardware.size() > 5 && s.hardware.substr(s.hardware.size() - 5) == ".toml";
  const tpu::HardwareTable hw =
      is_path ? tpu::ReadHardwareTable(s.hardware) : tpu::FindHardwareTable(s.hardware, "--hardware");
  const tpu::Precision precision = s.precision == "f32" ? tpu::Precision::kF32 : tpu::Precision::kBf16;
  if (!s.sweep.empty()) {
    if (!s.global_batches.empty() && (s.per_core_batch > 0 || s.batch->count() > 0))
      throw Error("--global-batch fixes the global batch of every --sweep-meshes mesh: drop --per-core-batch and --batch");
    return RunSweep(s, hw, precision);
  }
  if (s.global_batches.size() > 1)
    throw Error("--global-batch takes one value without --sweep (a list only with --sweep)");
  if (s.mesh.empty()) throw Error("--mesh is required (XxY chips, e.g. 32x32), or --sweep FILE.csv");
  const tpu::MeshTopology mesh = tpu::MeshTopology::Parse(s.mesh, hw.cores_per_chip, "--mesh");
  if (s.replicas->count() > 0 && s.program.replicas != mesh.replicas())
    throw Error(Str("--mesh ", s.mesh, " means ", mesh.replicas(), " replicas (", mesh.cores_per_chip(),
                    " cores per chip, one replica each) but --replicas is ", s.program.replicas,
                    "; drop --replicas or make it ", mesh.replicas()));
  int64_t per_core = s.per_core_batch;
  if (!s.global_batches.empty()) {
    if (s.batch->count() > 0) throw Error("--global-batch and --batch both set the global batch: use one");
    const int64_t from_global = PerCoreOfGlobal(s.global_batches[0], mesh, "--mesh");
    if (per_core > 0 && per_core != from_global)
      throw Error(Str("--global-batch ", s.global_batches[0], " is not --per-core-batch ", per_core, " x ",
                      mesh.replicas(), " cores"));
    per_core = from_global;
  }
  if (s.batch->count() > 0) {
    if (s.program.batch % mesh.replicas() != 0)
      throw Error(Str("--batch ", s.program.batch, " does not split evenly over the ", mesh.replicas(),
                      " cores of --mesh ", s.mesh));
    if (per_core > 0 && per_core * mesh.replicas() != s.program.batch)
      throw Error(
          Str("--batch ", s.program.batch, " is not --per-core-batch ", per_core, " x ", mesh.replicas(), " cores"));
    per_core = s.program.batch / mesh.replicas();
  }
  if (per_core <= 0) throw Error("--per-core-batch is required (examples per core and step), or --batch");
  const ProgramFlags f = ForMesh(s, mesh, per_core);
  const ir::Module step = BuildStep(f);
  const auto lowered = std::chrono::steady_clock::now();
  const tpu::SimulationResult r = tpu::Simulate(step, mesh, hw, precision);
  const auto done = std::chrono::steady_clock::now();
  const double wall = std::chrono::duration<double>(done - start).count();
  const double lowering = std::chrono::duration<double>(lowered - start).count();
  const double simulating = std::chrono::duration<double>(done - lowered).count();
  if (s.json) {
    std::string json = r.ToJson();
    json.pop_back();  // add the run's description before the closing brace
    char tail[96];
    std::snprintf(tail, sizeof tail, ",\"wall_s\":%.3f,\"lowering_s\":%.3f,\"simulation_s\":%.3f}", wall, lowering,
                  simulating);
    std::cout << json << ",\"model\":\"" << f.model << "\",\"optimizer\":\"" << f.optimizer
              << "\",\"per_core_batch\":" << per_core << ",\"global_batch\":" << f.batch
              << ",\"shard_weight_update\":" << (f.shard_weight_update == "off" ? "false" : "true")
              << ",\"gather_weights\":\"" << f.gather_weights << "\"" << tail << "\n";
    return 0;
  }
  std::cout << Describe(f, per_core) << "\n" << r.ToText();
  std::fprintf(stdout, "(%.2f s of wall time: %.2f s building the step through the pipeline, %.2f s simulating it)\n",
               wall, lowering, simulating);
  return 0;
}

}  // namespace

Command AddSimulateCommand(CLI::App& app) {
  auto s = std::make_shared<SimulateFlags>();
  CLI::App* cmd = app.add_subcommand(
      "simulate", "simulate a training step on a TPU pod slice: step-time breakdown, memory per core, link traffic");
  std::vector<CLI::Option*> model = AddModelFlags(cmd, &s->program);
  for (CLI::Option* o : model) {
    if (o->check_name("--replicas")) s->replicas = o;
    if (o->check_name("--batch")) s->batch = o;
  }
  // bf16 by default, as TPUs train: --precision (a pipeline flag) adds the mixed-precision pass, and the cost
  // model runs the matrix units at their bf16 peak.
  s->program.precision = "bf16";
  AddPipelineFlags(cmd, &s->program);
  cmd->add_option("--mesh", s->mesh, "XxY chips on a 2D torus, one replica per core (2*X*Y replicas on TPU v3)");
  cmd->add_option("--per-core-batch", s->per_core_batch,
                  "examples per core and step (the global batch is this x cores)")
      ->check(kPositiveInt);
  cmd->add_option("--hardware", s->hardware,
                  "hardware table: a name (tpu_backend/hardware/<name>.toml) or a path to a .toml file")
      ->capture_default_str();
  cmd->add_flag("--json", s->json, "print one JSON object");
  cmd->add_option(
      "--sweep", s->sweep,
      "write FILE.csv and FILE.svg: the sharded/replicated speedup over --sweep-meshes and --sweep-batches");
  cmd->add_option("--sweep-meshes", s->sweep_meshes, "meshes of --sweep, comma-separated")->capture_default_str();
  cmd->add_option("--sweep-batches", s->sweep_batches, "per-core batches of --sweep, comma-separated")
      ->capture_default_str();
  cmd->add_option("--global-batch", s->global_batches,
                  "a fixed global batch G: each mesh runs at per-core batch G / its cores (must divide); with "
                  "--sweep a comma-separated list that replaces --sweep-batches (MLPerf-style scaling)")
      ->delimiter(',')
      ->check(kPositiveInt);
  return {cmd, [s, cmd] {
            SimulateFlags run = *s;
            run.precision = run.program.precision;
            ResolveTextVocab(&run.program);
            return RunSimulate(run);
          }};
}

}  // namespace shardstep::cli
