// OptimizerLowering: the optimizer update as IR.
//
// Algorithm:
//  1. Add the step counter @step (s32, 0-based; reused when the model made it for dropout) and
//     compute t = step as f32, the schedule's learning-rate factor at t, and lr = base_lr * factor.
//  2. Optionally clip: scale every gradient by min(1, max_norm / (global_norm + 1e-6)).
//  3. For each weight (in module order): create its state variables "<weight>/<slot>" (role
//     optimizer_state, zero-initialised) and emit the update in the order PyTorch 1.13 computes it,
//     so per-step losses can be compared with it.
//  4. Assign the new weights, the new state and step + 1; canonicalise.
// Why IR and not a runtime call: the weight-update sharder later partitions exactly these ops.
#include "ir/passes/optimizer_lowering.h"

#include <algorithm>
#include <cmath>

#include "ir/builder.h"
#include "ir/error.h"

namespace shardstep::ir {
namespace {

struct Names {
  OptimizerKind kind;
  const char* name;
};
constexpr Names kOptimizers[] = {{OptimizerKind::kSgd, "sgd"},         {OptimizerKind::kMomentum, "momentum"},
                                 {OptimizerKind::kAdam, "adam"},       {OptimizerKind::kAdamW, "adamw"},
                                 {OptimizerKind::kAdagrad, "adagrad"}, {OptimizerKind::kLamb, "lamb"},
                                 {OptimizerKind::kLars, "lars"}};
struct SNames {
  ScheduleKind kind;
  const char* name;
};
constexpr SNames kSchedules[] = {{ScheduleKind::kConstant, "constant"},
                                 {ScheduleKind::kWarmupConstant, "warmup"},
                                 {ScheduleKind::kCosine, "cosine"},
                                 {ScheduleKind::kPolynomial, "polynomial"}};

// Scalar f32 helpers over one builder.
struct Scalars {
  Builder& b;
  ValueId c(double v) { return b.Scalar(v); }
  ValueId add(ValueId x, ValueId y) { return b.Add(x, y); }
  ValueId sub(ValueId x, ValueId y) { return b.Sub(x, y); }
  ValueId mul(ValueId x, ValueId y) { return b.Mul(x, y); }
  ValueId div(ValueId x, ValueId y) { return b.Div(x, y); }
  ValueId min(ValueId x, ValueId y) { return b.Binary(OpCode::kMin, x, y); }
  ValueId max(ValueId x, ValueId y) { return b.Binary(OpCode::kMax, x, y); }
  ValueId clamp01(ValueId x) { return min(max(x, c(0.0)), c(1.0)); }
};

}  // namespace

const char* OptimizerName(OptimizerKind k) {
  for (auto& n : kOptimizers)
    if (n.kind == k) return n.name;
  return "?";
}
bool ParseOptimizerKind(const std::string& s, OptimizerKind* out) {
  for (auto& n : kOptimizers)
    if (s == n.name) { *out = n.kind; return true; }
  return false;
}
const char* ScheduleName(ScheduleKind k) {
  for (auto& n : kSchedules)
    if (n.kind == k) return n.name;
  return "?";
}
bool ParseScheduleKind(const std::string& s, ScheduleKind* out) {
  for (auto& n : kSchedules)
    if (s == n.name) { *out = n.kind; return true; }
  return false;
}

double OptimizerConfig::LrFactor(int64_t t) const {
  double warm = warmup_steps_ > 0 ? std::min(1.0, (t + 1.0) / warmup_steps_) : 1.0;
  double span = std::max<double>(1.0, static_cast<double>(total_steps_ - warmup_steps_));
  double progress = std::clamp((t - static_cast<double>(warmup_steps_)) / span, 0.0, 1.0);
  switch (schedule_) {
    case ScheduleKind::kConstant: return 1.0;
    case ScheduleKind::kWarmupConstant: return warm;
    case ScheduleKind::kCosine: return warm * (end_lr_factor_ + (1 - end_lr_factor_) * 0.5 * (1 + std::cos(M_PI * progress)));
    case ScheduleKind::kPolynomial: return warm * (end_lr_factor_ + (1 - end_lr_factor_) * std::pow(1 - progress, power_));
  }
  return 1.0;
}

std::string OptimizerConfig::ToString() const {
  std::string s = Str(OptimizerName(kind_), " lr=", lr_);
  if (kind_ == OptimizerKind::kMomentum || kind_ == OptimizerKind::kLars) s += Str(" momentum=", momentum_, nesterov_ ? " nesterov" : "");
  if (kind_ == OptimizerKind::kAdam || kind_ == OptimizerKind::kAdamW || kind_ == OptimizerKind::kLamb)
    s += Str(" betas=(", beta1_, ",", beta2_, ")");
  if (weight_decay_ != 0) s += Str(" weight_decay=", weight_decay_);
  if (clip_norm_ > 0) s += Str(" clip_norm=", clip_norm_);
  if (schedule_ != ScheduleKind::kConstant) s += Str(" schedule=", ScheduleName(schedule_), " warmup=", warmup_steps_, " total=", total_steps_);
  return s;
}

bool OptimizerLowering::Run(Module& m) {
  if (m.gradients.empty()) throw Error("optimizer-lowering: the module has no gradients (run autodiff first)");
  // Already lowered when @step is assigned (an unassigned @step comes from the model: dropout reads it).
  if (ValueId st = m.FindVariable("step"); st != kNoValue && m.AssignedValue(st) != kNoValue) return false;
  const OptimizerConfig& c = c_;
  Builder b(&m);
  Scalars s{b};

  // 1. Step counter and learning rate.
  ValueId step = m.FindVariable("step");
  if (step == kNoValue) step = b.Variable("step", {DType::kS32, {}}, kRoleStep, {{"init", std::string("zeros")}});
  else if (m.type(step) != TensorType{DType::kS32, {}} || m.at(step).GetString("role", "") != kRoleStep)
    throw Error(Str("optimizer-lowering: @step is ", m.type(step).ToString(), " role '",
                    m.at(step).GetString("role", ""), "'; the step counter must be an s32[] with role step"));
  ValueId t = b.Convert(step, DType::kF32);
  ValueId one = s.c(1.0);
  ValueId warm = c.warmup_steps_ > 0 ? s.min(one, s.div(s.add(t, one), s.c(static_cast<double>(c.warmup_steps_)))) : one;
  double span = std::max<double>(1.0, static_cast<double>(c.total_steps_ - c.warmup_steps_));
  ValueId progress = s.clamp01(s.div(s.sub(t, s.c(static_cast<double>(c.warmup_steps_))), s.c(span)));
  ValueId factor = one;
  switch (c.schedule_) {
    case ScheduleKind::kConstant: break;
    case ScheduleKind::kWarmupConstant: factor = warm; break;
    case ScheduleKind::kCosine: {
      ValueId cosine = b.Unary(OpCode::kCos, s.mul(s.c(M_PI), progress));
      ValueId decay = s.add(s.c(c.end_lr_factor_), s.mul(s.c((1 - c.end_lr_factor_) * 0.5), s.add(one, cosine)));
      factor = s.mul(warm, decay);
      break;
    }
    case ScheduleKind::kPolynomial: {
      ValueId p = b.Binary(OpCode::kPow, s.sub(one, progress), s.c(c.power_));
      factor = s.mul(warm, s.add(s.c(c.end_lr_factor_), s.mul(s.c(1 - c.end_lr_factor_), p)));
      break;
    }
  }
  ValueId lr = s.mul(s.c(c.lr_), factor);

  // 2. Global-norm clipping (as torch.nn.utils.clip_grad_norm_).
  std::vector<std::pair<ValueId, ValueId>> grads = m.gradients;  // (weight, gradient)
  if (c.clip_norm_ > 0) {
    ValueId total = kNoValue;
    for (auto& [w, g] : grads) {
      ValueId sq = b.SumAll(b.Mul(g, g));
      total = total == kNoValue ? sq : b.Add(total, sq);
    }
    ValueId norm = b.Unary(OpCode::kSqrt, total);
    ValueId coef = s.min(s.div(s.c(c.clip_norm_), s.add(norm, s.c(1e-6))), one);
    for (auto& [w, g] : grads) g = b.Mul(g, b.BroadcastTo(coef, g));
  }

  // Per-step scalars shared by every weight.
  ValueId t1 = s.add(t, one);  // 1-based step for bias correction
  // Bias corrections 1 - beta^t. In f32, 1 - pow(0.999f, t) loses most digits (0.999 itself rounds),
  // off by 1e-5 relative; PyTorch computes it in double. -expm1(t ln beta) keeps them, and
  // expm1(x) = 2 tanh(x/2) / (1 - tanh(x/2)) with ln beta taken in double at build time.
  auto one_minus_pow = [&](double beta) {
    ValueId th = b.Unary(OpCode::kTanh, s.mul(t1, s.c(0.5 * std::log(beta))));
    return s.div(s.mul(s.c(-2.0), th), s.sub(one, th));
  };
  ValueId bc1 = one_minus_pow(c.beta1_);
  ValueId bc2 = one_minus_pow(c.beta2_);

  // 3. Updates.
  for (auto [w_, g] : grads) {
    const ValueId w = w_;  // a variable, not a structured binding: clang 14 cannot capture bindings in lambdas
    const std::string wname = m.at(w).name;  // a copy: slot() appends to m.instrs
    TensorType wt = m.type(w);
    auto slot = [&](const std::string& name, double init = 0.0) {
      Attrs a{{"init", std::string("zeros")}};
      if (init != 0.0) a = {{"init", std::string("constant")}, {"value", init}};
      return b.Variable(wname + "/" + name, wt, kRoleOptimizerState, a);
    };
    auto S = [&](ValueId scalar) { return b.BroadcastTo(scalar, w); };
    auto C = [&](double v) { return b.ScalarLike(v, w); };
    auto norm = [&](ValueId x) { return b.Unary(OpCode::kSqrt, b.SumAll(b.Mul(x, x))); };
    // Per-weight attrs (biases, norm parameters): weight_decay=0 drops the decay, layer_adaptation=0
    // fixes the LARS/LAMB trust ratio at 1, as the torch/MLPerf recipes exclude them.
    const double wd = m.at(w).GetInt("weight_decay", 1) != 0 ? c.weight_decay_ : 0.0;
    const bool adapt = m.at(w).GetInt("layer_adaptation", 1) != 0;
    auto with_decay = [&](ValueId grad) { return wd != 0 ? b.Add(grad, b.Mul(C(wd), w)) : grad; };
    ValueId new_w = kNoValue;
    switch (c.kind_) {
      case OptimizerKind::kSgd:
        new_w = b.Sub(w, b.Mul(S(lr), with_decay(g)));
        break;
      case OptimizerKind::kMomentum: {
        ValueId buf = slot("momentum");
        ValueId d = with_decay(g);
        ValueId nb = b.Add(b.Mul(C(c.momentum_), buf), d);
        ValueId upd = c.nesterov_ ? b.Add(d, b.Mul(C(c.momentum_), nb)) : nb;
        new_w = b.Sub(w, b.Mul(S(lr), upd));
        m.assigns.push_back({buf, nb});
        break;
      }
      case OptimizerKind::kAdam:
      case OptimizerKind::kAdamW: {
        ValueId mm = slot("m"), vv = slot("v");
        ValueId base = w, d = g;
        if (c.kind_ == OptimizerKind::kAdamW) {
          if (wd != 0) base = b.Mul(w, S(s.sub(one, s.mul(lr, s.c(wd)))));
        } else {
          d = with_decay(g);
        }
        ValueId nm = b.Add(b.Mul(C(c.beta1_), mm), b.Mul(C(1 - c.beta1_), d));
        ValueId nv = b.Add(b.Mul(C(c.beta2_), vv), b.Mul(C(1 - c.beta2_), b.Mul(d, d)));
        ValueId step_size = s.div(lr, bc1);
        ValueId denom = b.Add(b.Div(b.Unary(OpCode::kSqrt, nv), S(b.Unary(OpCode::kSqrt, bc2))), C(c.eps_));
        new_w = b.Sub(base, b.Mul(S(step_size), b.Div(nm, denom)));
        m.assigns.push_back({mm, nm});
        m.assigns.push_back({vv, nv});
        break;
      }
      case OptimizerKind::kAdagrad: {
        ValueId acc = slot("sum", c.initial_accumulator_);
        ValueId d = with_decay(g);
        ValueId na = b.Add(acc, b.Mul(d, d));
        ValueId std_ = b.Add(b.Unary(OpCode::kSqrt, na), C(c.eps_));
        new_w = b.Sub(w, b.Mul(S(lr), b.Div(d, std_)));
        m.assigns.push_back({acc, na});
        break;
      }
      case OptimizerKind::kLamb: {
        // You et al. 2019: r = m^/(sqrt(v^)+eps) + wd w; w -= lr * (||w|| / ||r||) r.
        ValueId mm = slot("m"), vv = slot("v");
        ValueId nm = b.Add(b.Mul(C(c.beta1_), mm), b.Mul(C(1 - c.beta1_), g));
        ValueId nv = b.Add(b.Mul(C(c.beta2_), vv), b.Mul(C(1 - c.beta2_), b.Mul(g, g)));
        ValueId mhat = b.Div(nm, S(bc1)), vhat = b.Div(nv, S(bc2));
        ValueId r = b.Div(mhat, b.Add(b.Unary(OpCode::kSqrt, vhat), C(c.eps_)));
        if (wd != 0) r = b.Add(r, b.Mul(C(wd), w));
        ValueId trust = one;
        if (adapt) {
          ValueId wn = norm(w), rn = norm(r);
          ValueId both = s.mul(b.Binary(OpCode::kGt, wn, s.c(0.0)), b.Binary(OpCode::kGt, rn, s.c(0.0)));
          trust = b.Select(both, s.div(wn, rn), one);
        }
        new_w = b.Sub(w, b.Mul(S(s.mul(lr, trust)), r));
        m.assigns.push_back({mm, nm});
        m.assigns.push_back({vv, nv});
        break;
      }
      case OptimizerKind::kLars: {
        // You et al. 2017: local_lr = eta ||w|| / (||g|| + wd ||w||); v = mu v + lr local_lr (g + wd w); w -= v.
        ValueId vel = slot("momentum");
        ValueId local = one;
        if (adapt) {
          ValueId wn = norm(w), gn = norm(g);
          ValueId both = s.mul(b.Binary(OpCode::kGt, wn, s.c(0.0)), b.Binary(OpCode::kGt, gn, s.c(0.0)));
          local = b.Select(both, s.div(s.mul(s.c(c.trust_coefficient_), wn), s.add(gn, s.mul(s.c(wd), wn))), one);
        }
        ValueId nvel = b.Add(b.Mul(C(c.momentum_), vel), b.Mul(S(s.mul(lr, local)), with_decay(g)));
        new_w = b.Sub(w, nvel);
        m.assigns.push_back({vel, nvel});
        break;
      }
    }
    m.assigns.push_back({w, new_w});
  }

  // 4. Step counter.
  m.assigns.push_back({step, b.Add(step, b.Scalar(1.0, DType::kS32))});
  m.Canonicalize();
  return true;
}

}  // namespace shardstep::ir
