#!/usr/bin/env python3
"""Checks `shardstep train --model resnet20` against an independent PyTorch ResNet-20 (training-mode batch norm,
per-replica statistics, label smoothing; momentum or LARS): per-step losses, final weights, optimizer state and
batch-norm running statistics, replicated or sharded (--replicas N --shard-weight-update on)."""
# The model is written here from the pinned description (/tmp/contract.md "resnet20"), functionally (weights kept in
# shardstep's layout: conv OIHW, dense w [in, out] used as x @ w), never from shardstep's code:
#   conv1 3x3/16 -> bn1 -> relu; stages s = 1, 2, 3 (16, 32, 64 filters) of 3 basic blocks s{s}b{b}:
#   conv1 3x3 (stride 2 if b == 0 and s > 1) -> bn1 -> relu -> conv2 3x3 -> bn2, + shortcut (identity, or
#   proj 1x1 with the block's stride -> proj_bn when the shape changes), relu; global average pool; fc with bias.
#   Loss: mean cross-entropy with label smoothing (F.cross_entropy(..., label_smoothing=ls)).
# Batch norm in training mode, eps 1e-5: per channel, the mean and biased variance over N, H, W of each replica's
# part of the batch (the global batch split into --replicas equal contiguous chunks, as shardstep's replicas hold
# it; --cross-replica-bn: the whole global batch). The loss is the mean over the global batch, which is what
# shardstep's averaged per-replica gradients differentiate. Running statistics: r = 0.9 r + 0.1 s, s = the mean
# over replicas of each replica's batch mean and unbiased (n / (n - 1)) batch variance.
# Optimizers: momentum = torch.optim.SGD(momentum=mu) with two parameter groups (weight decay 0 for biases,
# batch-norm gamma and beta); LARS (You et al. 2017, as tests/parity/numpy_lamb_lars.py and shardstep's
# optimizer_lowering): local_lr = eta ||w|| / (||g|| + wd ||w||) (1 when a norm is 0), v = mu v + lr local_lr
# (g + wd w), w -= v, except that biases, gamma and beta have wd 0 and local_lr 1 (layer_adaptation=0).
# Gradients are clipped to the global norm first (clip_grad_norm_ semantics), lr follows the linear warm-up.
# Batches: the global inputs of every step read back from shardstep's --save-batches file.
import argparse, os, re, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc
import numpy as np
import torch
import torch.nn.functional as F

EPS = 1e-5
BN_MOMENTUM = 0.1
STAGES = ((1, 16), (2, 32), (3, 64))


def no_decay(name):
    """Biases and norm parameters: weight_decay=0 and layer_adaptation=0 (contract)."""
    return name.endswith(".b") or name.endswith(".gamma") or name.endswith(".beta")


def architecture(in_channels, classes):
    """(weight shapes, batch norms) of resnet20 in shardstep's names and layout."""
    shapes, bns = {}, []

    def conv(name, cin, cout, k):
        shapes[name + ".w"] = (cout, cin, k, k)

    def bn(name, c):
        shapes[name + ".gamma"], shapes[name + ".beta"] = (c,), (c,)
        bns.append((name, c))

    conv("conv1", in_channels, 16, 3)
    bn("bn1", 16)
    cin = 16
    for s, filters in STAGES:
        for b in range(3):
            n = f"s{s}b{b}"
            stride = 2 if b == 0 and s > 1 else 1
            conv(n + ".conv1", cin, filters, 3)
            bn(n + ".bn1", filters)
            conv(n + ".conv2", filters, filters, 3)
            bn(n + ".bn2", filters)
            if stride != 1 or cin != filters:
                conv(n + ".proj", cin, filters, 1)
                bn(n + ".proj_bn", filters)
            cin = filters
    shapes["fc.w"], shapes["fc.b"] = (64, classes), (classes,)
    return shapes, bns


class BatchNorm:
    """Training-mode batch norm with `groups` statistics groups (contiguous equal chunks of the batch); collects
    the running-statistics update of every call in `stats` ({name: (mean, unbiased var)}, detached)."""

    def __init__(self, groups, biased_running_var=False):
        self.groups, self.biased_running_var, self.stats = groups, biased_running_var, {}

    def __call__(self, p, name, x):
        chunks, outs, means, vars_ = x.chunk(self.groups, 0), [], [], []
        for c in chunks:
            axes = (0, 2, 3)
            mean = c.mean(axes)
            var = c.var(axes, unbiased=False)
            n = c.numel() // c.shape[1]
            shape = (1, -1, 1, 1)
            xhat = (c - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + EPS)
            outs.append(xhat * p[name + ".gamma"].reshape(shape) + p[name + ".beta"].reshape(shape))
            means.append(mean.detach())
            vars_.append(var.detach() * (1.0 if self.biased_running_var else n / (n - 1)))
        self.stats[name] = (torch.stack(means).mean(0), torch.stack(vars_).mean(0))
        return torch.cat(outs, 0) if len(outs) > 1 else outs[0]


class Relu:
    """F.relu that numbers its calls (0, 1, ... in forward order), can record each call's input (record=True) and
    can take given sign decisions: decisions {call: {flat index: positive?}} overrides x > 0 at those elements (the
    ReLU inputs within float32 rounding of 0 whose sign shardstep's float32 decided the other way; see
    teacher_forced()). The derivative is the mask used, as F.relu's."""

    def __init__(self, decisions=None, record=False):
        self.decisions, self.record, self.inputs, self.calls = decisions or {}, record, [], 0

    def __call__(self, x):
        i, self.calls = self.calls, self.calls + 1
        if self.record: self.inputs.append(x.detach().clone())
        if i not in self.decisions: return F.relu(x)
        mask = (x > 0).reshape(-1).clone()
        if self.decisions[i]:
            index = torch.tensor(list(self.decisions[i].keys()), dtype=torch.int64)
            mask[index] = torch.tensor(list(self.decisions[i].values()), dtype=torch.bool)
        return x * mask.reshape(x.shape).to(x.dtype)


def forward(p, x, bn, relu=F.relu):
    h = relu(bn(p, "bn1", F.conv2d(x, p["conv1.w"], padding=1)))
    cin = 16
    for s, filters in STAGES:
        for b in range(3):
            n = f"s{s}b{b}"
            stride = 2 if b == 0 and s > 1 else 1
            main = relu(bn(p, n + ".bn1", F.conv2d(h, p[n + ".conv1.w"], stride=stride, padding=1)))
            main = bn(p, n + ".bn2", F.conv2d(main, p[n + ".conv2.w"], padding=1))
            if stride != 1 or cin != filters:
                short = bn(p, n + ".proj_bn", F.conv2d(h, p[n + ".proj.w"], stride=stride))
            else:
                short = h
            h = relu(main + short)
            cin = filters
    h = h.mean((2, 3))
    return h @ p["fc.w"] + p["fc.b"]


def train(a, dt, start, running, batches, bn_groups, first_step=0, velocity=None, decisions=None, relus=None):
    """Trains the reference in dtype dt on `batches` (steps first_step, first_step + 1, ...; the optimizer state
    starts from `velocity` {weight: momentum buffer}, or zeros); returns (per-step losses, final {weights,
    optimizer state, running stats}). decisions: {step: ReLU sign decisions of that step} (see Relu); relus: a list
    that gets each step's Relu (with its recorded inputs)."""
    params = {k: torch.tensor(v, dtype=dt, requires_grad=True) for k, v in start.items()}
    run = {k: torch.tensor(v, dtype=dt) for k, v in running.items()}
    names = sorted(params)
    lr_at = lambda i: a.lr * (min(1.0, (i + 1) / a.warmup_steps) if a.warmup_steps > 0 else 1.0)
    vel = {k: torch.tensor(velocity[k], dtype=dt) if velocity else torch.zeros_like(params[k]) for k in names}
    opt = None
    if a.optimizer == "momentum":
        groups = [{"params": [params[k] for k in names if not no_decay(k)], "weight_decay": a.weight_decay},
                  {"params": [params[k] for k in names if no_decay(k)], "weight_decay": 0.0}]
        opt = torch.optim.SGD(groups, lr=a.lr, momentum=a.momentum, nesterov=a.nesterov)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_at(t + first_step) / a.lr)
        if velocity:
            for k in names: opt.state[params[k]]["momentum_buffer"] = vel[k]
    losses = []
    for i, batch in enumerate(batches, first_step):
        x = torch.from_numpy(batch["image"]).to(dt)
        y = torch.from_numpy(batch["label"].astype(np.int64))
        bn = BatchNorm(bn_groups, biased_running_var=a.mutate == "runvar")
        for p in params.values(): p.grad = None
        relu = Relu((decisions or {}).get(i), record=relus is not None)
        if relus is not None: relus.append(relu)
        loss = F.cross_entropy(forward(params, x, bn, relu), y, label_smoothing=a.label_smoothing)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for name, (mean, var) in bn.stats.items():
                run[name + ".running_mean"].mul_(1 - BN_MOMENTUM).add_(BN_MOMENTUM * mean)
                run[name + ".running_var"].mul_(1 - BN_MOMENTUM).add_(BN_MOMENTUM * var)
        if a.clip_norm > 0: torch.nn.utils.clip_grad_norm_([params[k] for k in names], a.clip_norm)
        if opt is not None:
            opt.step()
            sched.step()
            continue
        with torch.no_grad():  # LARS
            lr = lr_at(i)
            for k in names:
                w, g = params[k], params[k].grad
                if no_decay(k):
                    local, d = 1.0, g
                else:
                    wn, gn = float(torch.linalg.norm(w)), float(torch.linalg.norm(g))
                    local = a.trust_coefficient * wn / (gn + a.weight_decay * wn) if wn > 0 and gn > 0 else 1.0
                    d = g + a.weight_decay * w
                vel[k] = a.momentum * vel[k] + lr * local * d
                w.sub_(vel[k])
    ref = {k: p.detach().numpy() for k, p in params.items()}
    ref.update({k: v.numpy() for k, v in run.items()})
    for k in names:
        ref[k + "/momentum"] = (opt.state[params[k]]["momentum_buffer"] if opt is not None else vel[k]).numpy()
    return losses, ref


KINK = 2.0 ** -17    # a ReLU input within KINK x the largest |input| of its call is within float32 rounding of 0
SHADOW = 2.0 ** -10  # the free-running float64 run takes shardstep's signs for the ReLU inputs within SHADOW of 0


def teacher_forced(a, states, batches, bn_groups, ours):
    """Step by step from shardstep's own state: for k = 1 .. steps, torch takes step k in float64 from shardstep's
    state after step k - 1 (weights, momentum buffers, running statistics) on step k's batch, and shardstep's step k
    must agree with it:
      loss                                            |ours - ref| <= tol * max(|ref|, 1)
      weight updates w_k - w_(k-1),                   relative L2 error <= rtol (state_rtol for momentum buffers)
      momentum buffer increments v_k - mu v_(k-1),    + 2^-24 ||ref_k|| / ||ref_k - decay ref_(k-1)||, the one
      running-statistics increments r_k - 0.9 r_(k-1) float32 rounding of storing the new value
    Comparing what the step adds, not the new values, keeps the check sharp: a weight moves by ~1e-3 of itself per
    step, so a 0.1 % error in the learning rate is ~1e-6 of the new weight but 1e-3 of its update.
    A ReLU input within float32 rounding of 0 (|x| <= KINK max|x| of its call, in float64) has no float32-determined
    sign, and where shardstep's float32 put one on the other side, that one element changes every gradient upstream
    by up to ~1e-2 (a beta's gradient is a small difference of large terms). So when a step misses, the inputs
    within KINK of 0 are candidates: up to 3 of them, picked greedily (the one whose flip brings the step closest),
    are flipped in the float64 step, and the step passes if it then agrees; every flip is printed. Returns (failures,
    {step index: sign decisions}): the sign shardstep's step took (float64's from shardstep's state, with the flips)
    for every ReLU input within SHADOW of 0, for the free-running float64 run to take the same branches (see
    check_decisions)."""
    names = sorted(k for k in states[0] if k != "step" and "/" not in k and "running_" not in k)
    failures, all_decisions, worst = 0, {}, {}

    def step_errors(k, decisions, record):
        s0, s1 = states[k], states[k + 1]
        relus = [] if record else None
        (loss,), ref = train(a, torch.float64, {n: s0[n].copy() for n in names},
                             {n: s0[n].copy() for n in s0 if "running_" in n}, [batches[k]], bn_groups, k,
                             {n: s0[n + "/momentum"].copy() for n in names}, {k: decisions} if decisions else None,
                             relus)
        rows = [("loss", "loss", abs(ours[k] - loss) / max(abs(loss), 1.0), a.tol)]
        for n in sorted(ref):
            kind = "increments" if n.endswith("/momentum") or "running_" in n else "weights"
            decay = a.momentum if n.endswith("/momentum") else (1 - BN_MOMENTUM if "running_" in n else 1.0)
            old = decay * np.asarray(s0[n], np.float64)
            step = ref[n] - old
            # shardstep stores the new value in float32: one rounding, <= 2^-24 |new| per element.
            storage = 2.0 ** -24 * float(np.linalg.norm(ref[n])) / max(float(np.linalg.norm(step)), 1e-300)
            rows.append((kind, n, pc.rel_l2(np.asarray(s1[n], np.float64) - old, step),
                         (a.state_rtol if "/" in n else a.rtol) + storage))
        return rows, (relus[0].inputs if record else None)

    ratio = lambda rows: max(err / tol for _, _, err, tol in rows)
    for k in range(a.steps):
        rows, inputs = step_errors(k, {}, True)
        decisions, flips = {}, []
        if ratio(rows) > 1:
            candidates = []
            for i, x in enumerate(inputs):
                x = x.reshape(-1)
                big = float(x.abs().max())
                for j in torch.nonzero(x.abs() <= KINK * big).reshape(-1).tolist():
                    candidates.append((abs(float(x[j])) / big, i, j, float(x[j])))
            candidates = sorted(candidates)[:12]
            for _ in range(3):
                best = None
                for rel, i, j, value in candidates:
                    if j in decisions.get(i, {}): continue
                    trial = {c: dict(d) for c, d in decisions.items()}
                    trial.setdefault(i, {})[j] = not value > 0
                    trial_rows, _ = step_errors(k, trial, False)
                    if best is None or ratio(trial_rows) < ratio(best[1]): best = (trial, trial_rows, (i, j, value, rel))
                if best is None or ratio(best[1]) >= ratio(rows): break
                decisions, rows = best[0], best[1]
                flips.append(best[2])
                if ratio(rows) <= 1: break
            for i, j, value, rel in flips:
                print(f"step {k + 1}: ReLU {i} element {j}: float64 input {value:.3e} ({rel:.1e} of the call's largest "
                      f"|input|) taken as {'positive' if not value > 0 else 'not positive'}, as shardstep's float32 did")
        if ratio(rows) > 1:
            failures += 1
            for kind, n, err, tol in rows:
                if err > tol: print(f"  step {k + 1}: {n} error {err:.2e} > tolerance {tol:.0e}  <-- MISMATCH")
        if decisions: _, inputs = step_errors(k, decisions, True)
        signs = {}
        for i, x in enumerate(inputs):
            x = x.reshape(-1)
            near = torch.nonzero(x.abs() <= SHADOW * float(x.abs().max())).reshape(-1).tolist()
            signs[i] = {j: decisions.get(i, {}).get(j, bool(x[j] > 0)) for j in near}
        all_decisions[k] = signs
        for kind, n, err, tol in rows:
            if err > worst.get(kind, (0.0,))[0]: worst[kind] = (err, k + 1, n)
    print(f"teacher-forced, {a.steps} steps from shardstep's own state against torch float64 (after the flips above): "
          "max error " + ", ".join(f"{kind} {e:.2e} (step {s}, {n})" for kind, (e, s, n) in sorted(worst.items())) +
          f"; tolerance loss {a.tol:g}, weights {a.rtol:g}, increments {a.state_rtol:g}")
    if failures: print(f"FAIL: teacher-forced: {failures} step(s) differ by more than their tolerance")
    return (1 if failures else 0), all_decisions


def check_decisions(decisions, relus):
    """The free-running float64 run took shardstep's signs at the ReLU inputs within SHADOW of 0 (float64 and float32
    trajectories part by ~1e-6, so a kink of shardstep's can come a step apart from the teacher-forced one). Counts
    the inputs where that sign is not float64's own: each must be within SHADOW of 0 in the free-running run too (else
    the trajectories have parted and the decision would be a real change). Returns 0 or 1."""
    forced, largest, bad = 0, 0.0, 0
    for k, by_call in sorted(decisions.items()):
        for i, elements in sorted(by_call.items()):
            x = relus[k].inputs[i].reshape(-1)
            big = float(x.abs().max())
            for j, positive in elements.items():
                if bool(x[j] > 0) == positive: continue
                forced, largest = forced + 1, max(largest, abs(float(x[j])) / big)
                if abs(float(x[j])) > SHADOW * big:
                    print(f"FAIL: step {k + 1}: the free-running float64 ReLU {i} input {j} is {float(x[j]):.3e}, not "
                          f"within SHADOW x {big:.3e} of 0; the sign taken there would be a real change")
                    bad = 1
    print(f"free-running float64 along shardstep's branches: {forced} ReLU input(s) took shardstep's sign against "
          f"float64's own, the largest {largest:.1e} of its call's largest |input|")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    pc.add_model_args(ap, default_batch=16)
    ap.add_argument("--optimizer", choices=["momentum", "lars"], default="momentum")
    ap.add_argument("--lr", type=float, help="default: momentum 0.02, lars 0.1")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", action="store_true")
    ap.add_argument("--trust-coefficient", type=float, default=0.001, help="LARS eta")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dataset", default="synthetic", choices=["synthetic", "fashion-mnist", "synthetic-imagenet"],
                    help="shardstep's --dataset (synthetic: 28x28, no uniform background; synthetic-imagenet: uniform "
                         "random pixels and labels at any --image-size; see tests/CMakeLists.txt)")
    ap.add_argument("--image-size", type=int, help="shardstep's --image-size (synthetic-imagenet only)")
    ap.add_argument("--cross-replica-bn", action="store_true",
                    help="shardstep --cross-replica-bn: statistics over the whole global batch")
    ap.add_argument("--float32-noise", action="store_true",
                    help="with --dtype float64: also train torch in float32; a tensor's tolerance is at least torch "
                         "float32's own relative L2 distance from float64 on it, and a step's loss tolerance at least "
                         "its largest loss distance so far, times --noise-factor")
    ap.add_argument("--noise-factor", type=float, default=3.0)
    ap.add_argument("--noise-tensors", default="",
                    help="with --float32-noise: a regular expression; only the checkpoint tensors whose names it "
                         "matches (re.search) get the raised tolerance, every other tensor keeps --rtol / --state-rtol "
                         "(default: all tensors)")
    ap.add_argument("--strict-losses", action="store_true",
                    help="with --float32-noise: the losses keep --tol at every step (no raised loss tolerance)")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="also check every step from shardstep's own state (shardstep saves it after every step): "
                         "torch float64's step from it must agree, up to the signs of ReLU inputs within float32 "
                         "rounding of 0, which are found and listed; the free-running float64 run then takes "
                         "shardstep's decisions at those inputs (see teacher_forced())")
    ap.add_argument("--mutate", choices=["lr", "lr1pc", "weight", "init", "bnstats", "runvar"],
                    help="test of the test, must make it FAIL: lr / lr1pc = reference lr x 1.001 / x 1.01; weight = "
                         "shardstep's final s3b2.conv2.w (the last weight) scaled by 1 + 2 x its tolerance; init = "
                         "the reference's initial fc.w scaled by 1 + 10 rtol; bnstats = the other statistics groups: the whole "
                         "global batch, or with --cross-replica-bn each replica's part (fails with --replicas > 1); "
                         "runvar = biased variance in the running statistics")
    a = ap.parse_args()
    a.lr = a.lr if a.lr is not None else {"momentum": 0.02, "lars": 0.1}[a.optimizer]
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    extra = ["--model", "resnet20", "--dataset", a.dataset, "--eval-batch", "400", "--optimizer", a.optimizer,
             "--lr", repr(a.lr), "--weight-decay", repr(a.weight_decay), "--momentum", repr(a.momentum)]
    if a.label_smoothing: extra += ["--label-smoothing", repr(a.label_smoothing)]
    if a.nesterov: extra += ["--nesterov"]
    if a.optimizer == "lars": extra += ["--trust-coefficient", repr(a.trust_coefficient)]
    if a.cross_replica_bn: extra += ["--cross-replica-bn"]
    if a.image_size: extra += ["--image-size", str(a.image_size)]
    if a.dataset == "synthetic-imagenet": extra += ["--classes", str(a.classes), "--eval-batches", "1"]
    states = []
    with tempfile.TemporaryDirectory(prefix="parity_resnet20_") as tmp:
        ck = os.path.join(tmp, "ck")
        if a.teacher_forced:
            extra += ["--save-every", "1", "--checkpoint-dir", ck, "--keep", str(a.steps + 1)]
        init, ours, final, batches, secs = pc.run_shardstep_model(a, extra, tmp, ["image", "label"])
        if a.teacher_forced:
            states = [init] + [pc.read_safetensors(os.path.join(ck, f"step-{k:09d}.safetensors"))
                               for k in range(1, a.steps + 1)]
    image = batches[0]["image"]
    if image.ndim != 4 or image.shape[0] != a.batch:
        sys.exit(f"FAIL: step0/image has shape {list(image.shape)}, expected [{a.batch}, C, H, W]")
    shapes, bns = architecture(image.shape[1], a.classes)
    model_state = {}
    for name, c in bns:
        model_state[name + ".running_mean"] = ((c,), 0.0)
        model_state[name + ".running_var"] = ((c,), 1.0)
    pc.check_model_initial_state(init, shapes, {"momentum": 0.0}, model_state)

    t0 = time.time()
    start = {k: init[k].copy() for k in shapes}
    running = {k: init[k].copy() for k in model_state}
    if a.mutate == "init":
        start["fc.w"] = start["fc.w"] * np.float32(1 + 10 * a.rtol)
        print("--mutate init: scaled the reference's initial fc.w by 1 + 10 rtol")
    a.lr = pc.reference_lr(a)
    bn_groups = 1 if a.cross_replica_bn != (a.mutate == "bnstats") else a.replicas
    dt = getattr(torch, a.dtype)
    forced_bad, decisions, relus = 0, None, None
    if a.teacher_forced:
        if a.dtype != "float64": sys.exit("--teacher-forced needs --dtype float64")
        forced_bad, decisions = teacher_forced(a, states, batches, bn_groups, ours)
        relus = []
    theirs, ref = train(a, dt, start, running, batches, bn_groups, decisions=decisions, relus=relus)
    if a.teacher_forced:
        forced_bad += check_decisions(decisions, relus)
    rtols, loss_tols = None, [a.tol] * a.steps
    if a.float32_noise:
        if a.dtype != "float64": sys.exit("--float32-noise needs --dtype float64")
        # Without oneDNN (mkldnn): its float32 convolutions gave resnet20 gradients 1e-2 off float64 (relative L2 per
        # tensor) on some batches at identical weights, where torch's own float32 kernels are within 3e-6; that is
        # a kernel's error, not float32's conditioning, which is what this run measures.
        with torch.backends.mkldnn.flags(enabled=False):
            theirs32, ref32 = train(a, torch.float32, start, running, batches, bn_groups)
        if not a.strict_losses: loss_tols = pc.noise_loss_tols(a.tol, theirs, theirs32, a.noise_factor)
        rtols = {k: a.noise_factor * pc.rel_l2(ref32[k], ref[k]) for k in ref if re.search(a.noise_tensors, k)}
        print(f"torch float32's own relative L2 distance from float64 x {a.noise_factor:g}: max " +
              ", ".join(f"{k} {v:.2e}" for k, v in sorted(rtols.items(), key=lambda kv: -kv[1])[:4]))
    label = (f"resnet20 {a.optimizer} lr={a.lr} wd={a.weight_decay} ls={a.label_smoothing} clip={a.clip_norm} "
             f"warmup={a.warmup_steps} batch={a.batch} image={list(image.shape[1:])} replicas={a.replicas}" +
             (" cross-replica-bn" if a.cross_replica_bn else "") +
             (f" shard={a.shard_weight_update}" if a.shard_weight_update else "") + f" vs torch {a.dtype}")
    pc.mutate_final_weight(a, final, rtols)
    bad = pc.compare_losses(label, ours, theirs, "torch", loss_tols, secs, time.time() - t0)
    bad += pc.compare_state_l2(label, final, ref, "torch", a.rtol, a.state_rtol, rtols)
    return pc.finish(label, bad + forced_bad)


if __name__ == "__main__":
    sys.exit(main())
