// Session: a backend's executor behind checked, global-batch calls.
#include "api/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "jit/cpu_executor.h"
#include "runtime/checkpoint.h"
#include "runtime/sharding.h"
#include "tpu_backend/mesh_backend.h"

namespace shardstep {

namespace {

// The checkpoint metadata entry holding Session::step().
constexpr const char* kStepKey = "step";

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendFactory> factories;
};

Registry& Backends() {
  static Registry* r = [] {
    auto* reg = new Registry;
    reg->factories["cpu"] = [](const ir::Module& step, const TensorMap& state) {
      return jit::MakeCpuExecutor(step, state);
    };
    reg->factories["interp"] = [](const ir::Module& step, const TensorMap& state) {
      return runtime::MakeInterpreterExecutor(step, state);
    };
    // The emulated TPU mesh on its default mesh for the replica count (the CLI's --mesh re-registers it).
    reg->factories["tpu-mesh"] = tpu::MeshBackendFactory();
    return reg;
  }();
  return *r;
}

std::string Join(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

std::vector<std::string> InputNamesOf(const ir::Module& m) {
  std::vector<std::string> names;
  for (ir::ValueId v : m.Inputs()) names.push_back(m.at(v).name);
  return names;
}

// The replicas' tensors joined along dimension 0, in replica order.
Tensor ConcatBatch(const std::vector<const Tensor*>& parts) {
  ir::TensorType type = parts[0]->type;
  type.shape[0] *= static_cast<int64_t>(parts.size());
  Tensor out(type);
  const int64_t bytes = parts[0]->bytes();
  for (size_t r = 0; r < parts.size(); ++r) {
    if (parts[r]->type != parts[0]->type)
      throw Error(
          Str("replica ", r, " returned ", parts[r]->type.ToString(), ", replica 0 ", parts[0]->type.ToString()));
    if (bytes > 0) std::memcpy(static_cast<char*>(out.raw()) + r * bytes, parts[r]->raw(), bytes);
  }
  return out;
}

// The batch of a one-replica module: dim 0 of its first input of rank >= 1 (-1: none).
int64_t BatchOf(const ir::Module& m) {
  for (ir::ValueId v : m.Inputs())
    if (!m.type(v).shape.empty()) return m.type(v).shape[0];
  return -1;
}

// The number of examples in `inputs`: dim 0 of those `m` reads (-1: none given); they must agree.
int64_t ExamplesOf(const ir::Module& m, const TensorMap& inputs, const char* what) {
  int64_t n = -1;
  std::string seen;
  bool disagree = false;
  for (ir::ValueId v : m.Inputs()) {
    auto it = inputs.find(m.at(v).name);
    if (m.type(v).shape.empty() || it == inputs.end() || it->second.shape().empty()) continue;
    const int64_t d = it->second.shape()[0];
    disagree |= n >= 0 && d != n;
    if (n < 0) n = d;
    seen += Str(seen.empty() ? "" : ", ", "\"", m.at(v).name, "\" ", it->second.type.ToString());
  }
  if (disagree) throw Error(Str(what, ": the inputs disagree on the number of examples (dimension 0): ", seen));
  return n;
}

}  // namespace

void RegisterBackend(const std::string& name, BackendFactory factory) {
  Registry& r = Backends();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[name] = std::move(factory);
}

std::vector<std::string> BackendNames() {
  Registry& r = Backends();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (auto& [name, f] : r.factories) names.push_back(name);
  return names;
}

BackendFactory FindBackend(const std::string& name) {
  Registry& r = Backends();
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(name);
    if (it != r.factories.end()) return it->second;
  }
  throw Error(Str("unknown backend \"", name, "\"; known backends: ", Join(BackendNames())));
}

Session::Session(const dsl::Model& model, const dsl::Program& program, const std::string& backend)
    : step_module_(program.step) {
  // Program::forward is lowered for the per-replica batch; evaluation takes the global batch.
  forward_ = model.lower(1, dsl::Mode::kEval);
  has_forward_ = true;
  Init(backend);
}

Session::Session(const ir::Module& step, std::optional<ir::Module> forward, const std::string& backend)
    : step_module_(step) {
  if (forward) {
    if (forward->num_replicas != 1)
      throw Error(Str("Session: the forward module \"", forward->name, "\" is lowered for ", forward->num_replicas,
                      " replicas; it must run on one (the evaluation batch whole)"));
    if (!forward->assigns.empty())
      throw Error(Str("Session: the forward module \"", forward->name, "\" assigns ", forward->assigns.size(),
                      " variable(s); lower it in evaluation mode"));
    const std::map<std::string, ir::TensorType> logical = runtime::LogicalTypes(step);
    for (ir::ValueId v : forward->Variables()) {
      const ir::Instr& var = forward->at(v);
      auto it = logical.find(var.name);
      if (it == logical.end())
        throw Error(Str("Session: forward variable \"", var.name, "\" is not a variable of the step module"));
      if (it->second != var.type)
        throw Error(Str("Session: forward variable \"", var.name, "\" is ", var.type.ToString(),
                        ", the step's (unsharded) ", it->second.ToString()));
    }
    forward_ = std::move(*forward);
    has_forward_ = true;
  }
  Init(backend);
}

void Session::Init(const std::string& backend) {
  const BackendFactory factory = FindBackend(backend);
  backend_ = backend;
  per_replica_ = step_module_.PerReplicaValues();
  exec_ = factory(step_module_, runtime::InitLogicalState(step_module_));
}

Session::~Session() = default;

const ir::Module& Session::forward_module() const {
  if (!has_forward_)
    throw Error("this Session has no forward module (built from a step module alone): Evaluate and Predict need one");
  return forward_;
}

double Session::CommunicationSeconds() const { return exec_->CommunicationSeconds(); }

void Session::SetPhaseTiming(bool on) { exec_->SetPhaseTiming(on); }

std::vector<std::string> Session::InputNames() const { return InputNamesOf(step_module_); }

std::vector<std::string> Session::OutputNames() const {
  std::vector<std::string> names;
  for (auto& [name, v] : forward_module().outputs) names.push_back(name);
  return names;
}

void Session::CheckInputs(const ir::Module& m, int64_t batch_scale, const TensorMap& batch, const char* what,
                          const ir::Module* allow_extra, int64_t examples, bool extra_ok) const {
  for (ir::ValueId v : m.Inputs()) {
    const ir::Instr& in = m.at(v);
    ir::TensorType want = in.type;
    if (!want.shape.empty()) want.shape[0] = examples >= 0 ? examples : want.shape[0] * batch_scale;
    auto it = batch.find(in.name);
    if (it == batch.end())
      throw Error(Str(what, ": missing input \"", in.name, "\" (", want.ToString(), "); the inputs are ",
                      Join(InputNamesOf(m))));
    const Tensor& t = it->second;
    if (t.type != want)
      throw Error(Str(what, ": input \"", in.name, "\" is ", t.type.ToString(), ", expected ", want.ToString(),
                      batch_scale > 1 ? Str(" (the global batch, for ", batch_scale, " replicas)") : std::string()));
    const size_t held = t.held();
    if (static_cast<int64_t>(held) != t.elements())
      throw Error(Str(what, ": input \"", in.name, "\" holds ", held, " values for ", t.type.ToString()));
  }
  for (auto& [name, t] : batch) {
    if (extra_ok || m.FindInput(name) != ir::kNoValue) continue;
    if (allow_extra && allow_extra->FindInput(name) != ir::kNoValue) continue;
    const ir::Module& known = allow_extra ? *allow_extra : m;
    throw Error(Str(what, ": unknown input \"", name, "\"; the inputs are ", Join(InputNamesOf(known))));
  }
}

TensorMap Session::Step(const TensorMap& global_batch) {
  const ir::Module& m = step_module_;
  const int n = m.num_replicas;
  CheckInputs(m, n, global_batch, "Step");
  std::vector<TensorMap> replicas = exec_->StepReplicas(global_batch);
  ++step_;
  // The per-replica batch: dim 0 of the inputs. A per-replica output with that dim 0 is batched.
  int64_t replica_batch = -1;
  for (ir::ValueId v : m.Inputs())
    if (!m.type(v).shape.empty()) { replica_batch = m.type(v).shape[0]; break; }
  TensorMap out;
  for (auto& [name, v] : m.outputs) {
    auto it = replicas[0].find(name);
    if (it == replicas[0].end()) continue;
    const Tensor& t0 = it->second;
    if (n == 1 || !per_replica_[v]) {
      out[name] = t0;
      continue;
    }
    std::vector<const Tensor*> parts;
    for (const TensorMap& r : replicas) parts.push_back(&r.at(name));
    if (!t0.shape().empty() && t0.shape()[0] == replica_batch) {
      out[name] = ConcatBatch(parts);
    } else if (t0.shape().empty() && t0.dtype() == ir::DType::kF32) {
      double sum = 0;
      for (const Tensor* p : parts) sum += p->f32[0];
      out[name] = Tensor::Scalar(static_cast<float>(sum / n));
    } else {
      out[name] = t0;
    }
  }
  return out;
}

TensorMap Session::TrainStep(const TensorMap& global_batch) {
  CheckInputs(step_module_, step_module_.num_replicas, global_batch, "Step", nullptr, -1, /*extra_ok=*/true);
  TensorMap out = exec_->Step(global_batch);
  ++step_;
  return out;
}

TensorMap Session::Evaluate(const TensorMap& batch) { return Evaluate(batch, false); }

TensorMap Session::Evaluate(const TensorMap& batch, bool extra_ok) {
  const ir::Module& f = forward_module();
  const int64_t b = BatchOf(f);
  const int64_t n = ExamplesOf(f, batch, "Evaluate");
  if (b < 0 || n < 1 || n == b) {
    CheckInputs(f, 1, batch, "Evaluate", nullptr, -1, extra_ok);
    return exec_->Forward(f, batch);
  }
  CheckInputs(f, 1, batch, "Evaluate", nullptr, n, extra_ok);
  std::vector<float> losses;
  TensorMap out = RunChunks(f, b, batch, n, &losses);
  if (static_cast<int64_t>(losses.size()) != (n + b - 1) / b) return out;  // no scalar f32 "loss"
  // The mean over the examples: B per full chunk; the padded chunk of r rows holds r real losses and
  // B - r losses of a zero row, each the loss of a chunk of zero rows (evaluation mixes no examples).
  const int64_t r = n % b, full = n / b;
  double sum = 0;
  for (int64_t c = 0; c < full; ++c) sum += static_cast<double>(losses[c]) * b;
  if (r > 0) {
    TensorMap zeros;
    for (ir::ValueId v : f.Inputs()) zeros[f.at(v).name] = Tensor(f.type(v));
    const double pad = exec_->Forward(f, zeros).at("loss").f32[0];
    const double last = losses.back();
    // A loss weighted by an input that is zero on zero rows has no value on them (0 / 0): the padded
    // chunk's loss is then its real rows' already.
    sum += std::isfinite(pad) ? last * b - pad * (b - r) : last * r;
  }
  out["loss"] = Tensor::Scalar(static_cast<float>(sum / n));
  return out;
}

const ir::Module& Session::PredictModule(const std::vector<std::string>& outputs) {
  if (outputs.empty()) throw Error(Str("Predict: no output requested; the outputs are ", Join(OutputNames())));
  std::string key;
  for (const std::string& o : outputs) {
    if (forward_module().FindOutput(o) == ir::kNoValue)
      throw Error(Str("Predict: unknown output \"", o, "\"; the outputs are ", Join(OutputNames())));
    key += o + ",";
  }
  auto it = predict_.find(key);
  if (it != predict_.end()) return it->second;
  ir::Module m = forward_;
  m.name = "predict";
  std::vector<std::pair<std::string, ir::ValueId>> kept;
  for (auto& [name, v] : m.outputs)
    if (std::find(outputs.begin(), outputs.end(), name) != outputs.end()) kept.emplace_back(name, v);
  m.outputs = kept;
  m.Canonicalize();  // drops what only the other outputs (the loss) needed
  // Canonicalize keeps every input; turn the now-unused ones into dead constants so the next one drops them.
  const auto users = m.Users();
  for (ir::ValueId v : m.Inputs()) {
    if (!users[v].empty()) continue;
    ir::Instr& in = m.at(v);
    in.op = ir::OpCode::kConstant;
    in.name.clear();
    in.attrs = {{"value", 0.0}};
  }
  m.Canonicalize();
  return predict_.emplace(key, std::move(m)).first->second;
}

TensorMap Session::Predict(const TensorMap& inputs, const std::vector<std::string>& outputs) {
  const ir::Module& m = PredictModule(outputs);
  // Any number of examples n: the program's batch B is fixed, so run ceil(n / B) chunks, the last padded
  // with zero rows, and keep the first n rows of the batched outputs. Safe because evaluation mode
  // mixes no examples (batch norm uses the running statistics).
  const int64_t batch = BatchOf(m);
  const int64_t n = ExamplesOf(m, inputs, "Predict");
  if (batch < 0 || n == batch || n < 1) {
    CheckInputs(m, 1, inputs, "Predict", &forward_);
    TensorMap feed;
    for (ir::ValueId v : m.Inputs()) feed[m.at(v).name] = inputs.at(m.at(v).name);
    return exec_->Forward(m, feed);
  }
  CheckInputs(m, 1, inputs, "Predict", &forward_, n);
  return RunChunks(m, batch, inputs, n, nullptr);
}

TensorMap Session::RunChunks(const ir::Module& m, int64_t batch, const TensorMap& inputs, int64_t n,
                             std::vector<float>* losses) {
  const std::vector<char> batched = m.PerReplicaValues();
  TensorMap out;
  for (int64_t begin = 0; begin < n; begin += batch) {
    const int64_t rows = std::min(batch, n - begin);
    TensorMap feed;
    for (ir::ValueId v : m.Inputs()) {
      const Tensor& t = inputs.at(m.at(v).name);
      if (t.shape().empty()) { feed[m.at(v).name] = t; continue; }
      Tensor chunk(m.type(v));  // zero rows after the last example
      const int64_t row_bytes = t.bytes() / n;
      std::memcpy(chunk.raw(), static_cast<const char*>(t.raw()) + begin * row_bytes, rows * row_bytes);
      feed[m.at(v).name] = std::move(chunk);
    }
    TensorMap got = exec_->Forward(m, feed);
    if (losses) {
      auto loss = got.find("loss");
      if (loss != got.end() && loss->second.dtype() == ir::DType::kF32 && loss->second.elements() == 1)
        losses->push_back(loss->second.f32[0]);
    }
    for (auto& [name, v] : m.outputs) {
      auto g = got.find(name);
      if (g == got.end()) continue;
      const Tensor& t = g->second;
      if (!batched[v] || t.shape().empty() || t.shape()[0] != batch) {
        if (begin == 0) out[name] = t;  // not per example: the first chunk's
        continue;
      }
      if (begin == 0) {
        ir::TensorType type = t.type;
        type.shape[0] = n;
        out[name] = Tensor(type);
      }
      const int64_t row_bytes = t.bytes() / batch;
      std::memcpy(static_cast<char*>(out[name].raw()) + begin * row_bytes, t.raw(), rows * row_bytes);
    }
  }
  return out;
}

TensorMap Session::State() const { return exec_->LogicalState(); }

void Session::Save(const std::string& path) const {
  runtime::SaveCheckpoint(path, exec_->LogicalState(), {{kStepKey, std::to_string(step_)}});
}

void Session::LoadState(const TensorMap& state, int64_t step) {
  runtime::CheckCheckpointMatches(state, runtime::LogicalTypes(step_module_), "Session::LoadState");
  exec_->LoadLogicalState(state);
  step_ = step;
}

void Session::Load(const std::string& path) {
  std::map<std::string, std::string> metadata;
  TensorMap state = runtime::LoadCheckpoint(path, &metadata);
  runtime::CheckCheckpointMatches(state, runtime::LogicalTypes(step_module_), path);
  exec_->LoadLogicalState(state);
  // The counter: ours from the metadata, else the program's step variable (a `shardstep train` checkpoint).
  step_ = 0;
  if (auto it = metadata.find(kStepKey); it != metadata.end()) {
    try {
      step_ = std::stoll(it->second);
    } catch (const std::exception&) {
      throw Error(Str(path, ": metadata \"", kStepKey, "\" is \"", it->second, "\", not a step count"));
    }
  } else {
    for (ir::ValueId v : step_module_.VariablesWithRole(ir::kRoleStep)) {
      const Tensor& t = state.at(step_module_.at(v).name);
      if (t.elements() == 1) step_ = static_cast<int64_t>(t.at(0));
    }
  }
}

}  // namespace shardstep
