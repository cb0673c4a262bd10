// Optimizers as IR: turns the recorded gradients into the weight update, the optimizer's state
// variables, the learning-rate schedule and the step counter, so later passes can transform them.
#pragma once

#include <string>

#include "ir/module.h"
#include "ir/passes/pass.h"

namespace shardstep::ir {

enum class OptimizerKind { kSgd, kMomentum, kAdam, kAdamW, kAdagrad, kLamb, kLars };
enum class ScheduleKind { kConstant, kWarmupConstant, kCosine, kPolynomial };

const char* OptimizerName(OptimizerKind k);
bool ParseOptimizerKind(const std::string& s, OptimizerKind* out);
const char* ScheduleName(ScheduleKind k);
bool ParseScheduleKind(const std::string& s, ScheduleKind* out);

// Hyper-parameters; setters chain. Defaults follow PyTorch 1.13 (and the LAMB/LARS papers).
struct OptimizerConfig {
  OptimizerKind kind_ = OptimizerKind::kSgd;
  double lr_ = 0.01;
  double momentum_ = 0.0;
  bool nesterov_ = false;
  double beta1_ = 0.9, beta2_ = 0.999, eps_ = 1e-8;
  double weight_decay_ = 0.0;
  double clip_norm_ = 0.0;  // 0: no global-norm clipping
  double trust_coefficient_ = 0.001;  // LARS eta
  double initial_accumulator_ = 0.0;  // Adagrad's accumulator starts here (PyTorch's initial_accumulator_value)
  ScheduleKind schedule_ = ScheduleKind::kConstant;
  int64_t warmup_steps_ = 0;
  int64_t total_steps_ = 0;  // decay horizon for cosine / polynomial
  double end_lr_factor_ = 0.0;
  double power_ = 1.0;

  OptimizerConfig& kind(OptimizerKind k) { kind_ = k; return *this; }
  OptimizerConfig& lr(double v) { lr_ = v; return *this; }
  OptimizerConfig& momentum(double v) { momentum_ = v; return *this; }
  OptimizerConfig& nesterov(bool v = true) { nesterov_ = v; return *this; }
  OptimizerConfig& betas(double b1, double b2) { beta1_ = b1; beta2_ = b2; return *this; }
  OptimizerConfig& eps(double v) { eps_ = v; return *this; }
  OptimizerConfig& weight_decay(double v) { weight_decay_ = v; return *this; }
  OptimizerConfig& clip_global_norm(double v) { clip_norm_ = v; return *this; }
  OptimizerConfig& trust_coefficient(double v) { trust_coefficient_ = v; return *this; }
  OptimizerConfig& initial_accumulator(double v) { initial_accumulator_ = v; return *this; }
  OptimizerConfig& warmup(int64_t steps) { warmup_steps_ = steps; if (schedule_ == ScheduleKind::kConstant) schedule_ = ScheduleKind::kWarmupConstant; return *this; }
  OptimizerConfig& cosine_decay(int64_t total, double end_factor = 0.0) { schedule_ = ScheduleKind::kCosine; total_steps_ = total; end_lr_factor_ = end_factor; return *this; }
  OptimizerConfig& polynomial_decay(int64_t total, double power = 1.0, double end_factor = 0.0) { schedule_ = ScheduleKind::kPolynomial; total_steps_ = total; power_ = power; end_lr_factor_ = end_factor; return *this; }
  OptimizerConfig& schedule(ScheduleKind s) { schedule_ = s; return *this; }

  // The learning-rate factor at 0-based step t (what the IR computes; used by tests and oracles).
  double LrFactor(int64_t t) const;
  std::string ToString() const;
};

// Needs module.gradients (from Autodiff). Adds the step counter (@step, s32[]), one state variable
// per weight and per slot (named "<weight>/<slot>", e.g. "fc1.w/m"), the update, and assigns.
class OptimizerLowering : public Pass {
 public:
  explicit OptimizerLowering(OptimizerConfig c) : c_(c) {}
  std::string name() const override { return "optimizer-lowering"; }
  bool Run(Module& m) override;

 private:
  OptimizerConfig c_;
};

}  // namespace shardstep::ir
