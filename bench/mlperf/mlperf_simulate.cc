#include "bench/mlperf/mlperf_simulate.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ir/passes/pipeline.h"
#include "runtime/atomic_file.h"
#include "tpu_backend/hardware.h"
#include "tpu_backend/mesh_topology.h"
#include "tpu_backend/simulator.h"

namespace shardstep::mlperf {
namespace {

using Json = nlohmann::json;

// Where the steps to the target come from, in examples (steps x global batch), and what that assumes.
struct StepsSource {
  double examples = 0;
  int64_t measured_batch = 0;  // the global batch the examples were counted at
  bool measured = false;       // from a real run (else the recipe's budget)
  std::string what;
};

Json ReadJson(const std::string& path, const std::string& flag) {
  std::ifstream in(path);
  if (!in) throw Error(Str(flag, " ", path, ": cannot open it"));
  try {
    return Json::parse(in);
  } catch (const std::exception& e) {
    throw Error(Str(flag, " ", path, ": not JSON (", e.what(), ")"));
  }
}

StepsSource StepsFrom(const Benchmark& b, const Flags& f) {
  StepsSource s;
  if (f.steps_from.empty()) {
    const int64_t budget = f.max_steps > 0 ? f.max_steps : b.max_steps;
    s.measured_batch = b.batch(f);
    s.examples = static_cast<double>(budget) * s.measured_batch;
    s.what = Str("the recipe's step budget (", budget, " steps at global batch ", s.measured_batch,
                 "): an upper bound at that batch, not a measured run; give --steps-from RESULT.json for a run's steps");
    return s;
  }
  const Json j = ReadJson(f.steps_from, "--steps-from");
  if (!j.is_object() || !j.contains("runs") || !j["runs"].is_array())
    throw Error(Str("--steps-from ", f.steps_from, ": no \"runs\" array (a <binary>_result.json of a training run)"));
  if (j.value("benchmark", std::string()) != b.name)
    throw Error(Str("--steps-from ", f.steps_from, ": a result of '", j.value("benchmark", std::string("?")), "', not ",
                    b.name));
  double examples = 0;
  int n = 0;
  int64_t batch = 0;
  for (const Json& r : j["runs"]) {
    if (r.value("status", std::string()) != "success") continue;
    const int64_t steps = r.value("steps", int64_t{0}), gb = r.value("global_batch", int64_t{0});
    if (steps <= 0 || gb <= 0) throw Error(Str("--steps-from ", f.steps_from, ": a successful run without steps or global_batch"));
    if (batch != 0 && gb != batch)
      throw Error(Str("--steps-from ", f.steps_from, ": runs at different global batches (", batch, ", ", gb, ")"));
    batch = gb;
    examples += static_cast<double>(steps) * gb;
    ++n;
  }
  if (n == 0)
    throw Error(Str("--steps-from ", f.steps_from, ": no run in it reached the target (status success), so it gives no "
                    "steps to train"));
  s.examples = examples / n;
  s.measured_batch = batch;
  s.measured = true;
  s.what = Str("measured: the mean of ", n, " successful run(s) in ", f.steps_from, ", ",
               s.examples / batch, " steps at global batch ", batch);
  return s;
}

// The recipe's training step for the mesh, built as `shardstep simulate` builds it (cli/simulate_command.cc
// BuildStep): lowered for one replica per core in training mode, then the training pipeline without
// shard-order-reductions.
ir::Module SimulationStep(const ir::Module& lowered, ir::PipelineOptions o) {
  ir::Module m = lowered;
  ir::BuildTrainingPipeline(o).Disable("shard-order-reductions").Run(m);
  return m;
}

}  // namespace

int RunSimulation(const Benchmark& b, const Flags& f) {
  if (!b.define || !b.batch) throw Error(Str(b.name, ": this recipe cannot be simulated (no model definition)"));
  const bool is_path = f.hardware.size() > 5 && f.hardware.substr(f.hardware.size() - 5) == ".toml";
  const tpu::HardwareTable hw = is_path ? tpu::ReadHardwareTable(f.hardware) : tpu::FindHardwareTable(f.hardware, "--hardware");
  if (f.mesh.empty()) throw Error("--simulate needs --mesh XxY (chips on the 2D torus, e.g. 8x8)");
  const tpu::MeshTopology mesh = tpu::MeshTopology::Parse(f.mesh, hw.cores_per_chip, "--mesh");
  if (f.per_core_batch <= 0) throw Error("--simulate needs --per-core-batch B (examples per core and step)");
  if (f.precision != "bf16" && f.precision != "f32")
    throw Error(Str("--precision: expected bf16 or f32, got '", f.precision, "'"));
  const tpu::Precision precision = f.precision == "f32" ? tpu::Precision::kF32 : tpu::Precision::kBf16;
  const StepsSource source = StepsFrom(b, f);

  const int replicas = mesh.replicas();
  const int64_t global = f.per_core_batch * replicas;
  const int64_t steps = static_cast<int64_t>(std::ceil(source.examples / static_cast<double>(global) - 1e-9));
  std::string assumption = source.what;
  if (source.measured_batch != global)
    assumption += Str("; converted to ", steps, " steps at the pod's global batch ", global,
                      " assuming the same number of examples (epochs) reaches the target",
                      global > source.measured_batch ? " (optimistic: larger batches usually need more)" : "");

  dsl::Model model(b.name, f.seed);
  const dsl::Tensor loss = b.define(model, f, global, b.vocab ? b.vocab(f) : 0);
  model.train(loss);
  const ir::Module lowered = model.lower(replicas, dsl::Mode::kTrain);
  ir::PipelineOptions o;
  o.optimizer = b.optimizer;
  o.replicas = replicas;
  o.bf16_contractions = f.precision == "bf16";
  tpu::SimulationResult r[2];  // replicated, sharded
  for (int sharded = 0; sharded < 2; ++sharded) {
    o.shard_weight_update = sharded == 1;
    r[sharded] = tpu::Simulate(SimulationStep(lowered, o), mesh, hw, precision);
  }

  std::cout << b.name << " --simulate: " << b.description << "\n  on " << mesh.ToString() << ", " << hw.name << ", "
            << f.precision << " matrix units, per-core batch " << f.per_core_batch << " (global " << global << "), "
            << b.optimizer.ToString() << "\n  steps to the target: " << steps << " (" << assumption << ")\n"
            << "  time to train = steps x simulated step time; evaluation is not modelled (not counted)\n";
  char line[256];
  std::snprintf(line, sizeof line, "  %-12s %12s %18s %18s %20s\n", "weight update", "step ms", "weight-update ms",
                "exposed comm. ms", "time to train s");
  std::cout << line;
  const char* names[2] = {"replicated", "sharded"};
  for (int i = 0; i < 2; ++i) {
    std::snprintf(line, sizeof line, "  %-12s %12.4f %18.4f %18.4f %20.4g\n", names[i], r[i].step_s * 1e3,
                  r[i].weight_update_s * 1e3, r[i].exposed_communication_s * 1e3, steps * r[i].step_s);
    std::cout << line;
  }
  std::snprintf(line, sizeof line, "  speedup of sharding: %.3fx per step; optimizer state per core %lld -> %lld bytes\n",
                r[0].step_s / r[1].step_s, static_cast<long long>(r[0].optimizer_state_bytes),
                static_cast<long long>(r[1].optimizer_state_bytes));
  std::cout << line << std::flush;

  if (f.out_dir.empty()) return 0;
  Json sim = {{"mesh", f.mesh}, {"chips", mesh.chips()}, {"replicas", replicas}, {"hardware", hw.name},
              {"precision", f.precision}, {"per_core_batch", f.per_core_batch}, {"global_batch", global},
              {"steps_to_target", steps}, {"steps_measured", source.measured},
              {"steps_source_global_batch", source.measured_batch}, {"steps_assumption", assumption},
              {"evaluation_modelled", false}};
  for (int i = 0; i < 2; ++i)
    sim[names[i]] = {{"step_ms", r[i].step_s * 1e3}, {"weight_update_ms", r[i].weight_update_s * 1e3},
                     {"time_to_train_s", steps * r[i].step_s}, {"simulation", Json::parse(r[i].ToJson())}};
  sim["speedup"] = r[0].step_s / r[1].step_s;
  // Into the result file: next to a real run's result when there is one (its runs are kept).
  const std::string path = f.out_dir + "/" + b.name + "_result.json";
  Json j = Json::object();
  if (std::filesystem::exists(path)) {
    try {
      j = ReadJson(path, "result file");
    } catch (const std::exception&) {
      j = Json::object();  // not ours to keep: rewritten
    }
    if (!j.is_object()) j = Json::object();
  }
  j["benchmark"] = b.name;
  j["submission_benchmark"] = b.mlperf_name;
  j["simulation"] = sim;
  const std::string text = j.dump(2) + "\n";
  runtime::WriteFileAtomically(path, {{text.data(), text.size()}}, "result");
  std::cout << "wrote the simulation into " << path << "\n";
  return 0;
}

}  // namespace shardstep::mlperf
