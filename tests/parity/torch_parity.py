#!/usr/bin/env python3
"""Checks `shardstep train` against PyTorch 1.13: per-step losses and the final weights and optimizer state
(same init, batches, optimizer, clipping, warm-up), replicated or sharded (--replicas N --shard-weight-update on)."""
# Runs shardstep for --steps steps (--no-shuffle, --save-init, --save, --metrics-out, --clip-norm, --schedule warmup,
# --replicas) in a temp dir, checks the initial checkpoint is the logical step-0 state, rebuilds the model
# functionally in torch from it (weights kept in shardstep's layout: dense w is [in, out] and used as x @ w, conv w
# is OIHW, so no transposes), feeds the same Fashion-MNIST batches (read from the IDX .gz files here; the global
# batch, which shardstep splits over its replicas), steps torch.optim + clip_grad_norm_ + LambdaLR, and asserts
# every step's loss and every element of the final weights and optimizer state (torch's momentum_buffer, exp_avg,
# exp_avg_sq, sum = shardstep's <w>/momentum, /m, /v, /sum) agree within the tolerances of parity_common.py.
# Exit 1 on mismatch. torch runs in float32 (1 thread for the MLP, 2 for the CNN) unless --dtype float64; the
# initial weights are shardstep's float32 values either way.
import argparse, os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc
import torch
import torch.nn.functional as F

DEFAULT_LR = {"sgd": 0.1, "momentum": 0.05, "adam": 1e-3, "adamw": 1e-3, "adagrad": 0.01}


# --precision bf16 (issue 10): the bf16-autocast-style oracle of shardstep's mixed-precision pass. Every matmul's
# operands are rounded to bf16 (torch's float32 -> bfloat16 conversion rounds to nearest even, as shardstep's) and
# the products accumulate in float32; the backward matmuls (dx = g @ w^T, dw = x^T @ g) round their operands too.
# Everything else (bias adds, ReLU, softmax, the optimizer) stays float32, as in shardstep.
def round_bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def acc_matmul(x, w, noise):
    """x @ w in float32; with a generator `noise`, each result element moved by one float32 ulp up or down at
    random (another summation order's rounding)."""
    y = x @ w
    if noise is None: return y
    up = torch.rand(y.shape, generator=noise) < 0.5
    return torch.nextafter(y, torch.where(up, torch.tensor(float("inf")), torch.tensor(float("-inf"))))


class Bf16Matmul(torch.autograd.Function):
    NOISE = None  # None: the oracle; a torch.Generator: the noise reference of bf16_tolerances

    @staticmethod
    def forward(ctx, x, w):
        x, w = round_bf16(x), round_bf16(w)
        ctx.save_for_backward(x, w)
        return acc_matmul(x, w, Bf16Matmul.NOISE)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = round_bf16(g)
        return acc_matmul(g, w.t(), Bf16Matmul.NOISE), acc_matmul(x.t(), g, Bf16Matmul.NOISE)


MATMUL = {"f32": lambda x, w: x @ w, "bf16": Bf16Matmul.apply}


def bf16_tolerances(a, start, slots, images, labels, theirs, ref):
    """The tolerance of --precision bf16. Rounding operands to bf16 makes the trajectory sensitive to float32
    noise: an operand within float32 rounding of a bf16 rounding boundary rounds to one bf16 neighbour or the other
    (2^-8 relative apart, 2^16 float32 ulps), depending on the order in which its producer summed; the flip then
    feeds the following steps. Measured here: shardstep's JIT (oneDNN sgemm) and its interpreter (double
    accumulation) agree with the oracle to 2e-7 for 10 steps, then each drifts from it and from the other by
    up to ~5e-4 in the loss (~1e-2 relative in weights, more in the small biases) by step 20, while 1-ulp changes
    of the initial weights change nothing (they round to the same bf16). So the oracle is run a second time with
    every matmul result moved by one float32 ulp at random (what another summation order does); how far that run
    drifts from the oracle, per step and per tensor, is the noise of bf16 mode on this trajectory (pessimistic: a
    real sgemm differs in few elements, this moves all). shardstep must stay within that noise (the largest of
    three seeds), or --tol / --state-rtol where larger. Returns
    (per-step loss tolerances, per-tensor state tolerances)."""
    loss_tols, rtols = [a.tol] * a.steps, {k: a.state_rtol for k in ref}
    for seed in range(3):
        Bf16Matmul.NOISE = torch.Generator().manual_seed(seed)
        noisy, ref_noisy = train(a, torch.float32, start, slots, images, labels)
        Bf16Matmul.NOISE = None
        loss_tols = [max(t, u) for t, u in zip(loss_tols, pc.noise_loss_tols(a.tol, theirs, noisy, 1.0))]
        rtols = {k: max(rtols[k], pc.max_rel_diff(ref_noisy[k], ref[k])) for k in ref}
    print("bf16 noise (the oracle with every matmul result moved by one ulp at random), per tensor:")
    print("  " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(rtols.items())))
    return loss_tols, rtols
PRECISION = "f32"


def forward(model, p, x):
    if model == "mlp":
        h, n = x.reshape(x.shape[0], 784), len([k for k in p if k.endswith(".w")])
        for i in range(1, n + 1):
            h = MATMUL[PRECISION](h, p[f"fc{i}.w"]) + p[f"fc{i}.b"]
            if i < n: h = F.relu(h)
        return h
    h = x.reshape(x.shape[0], 1, 28, 28)
    for c in ("conv1", "conv2"):
        h = F.max_pool2d(F.relu(F.conv2d(h, p[c + ".w"], p[c + ".b"], padding=1)), 2)
    h = F.relu(h.flatten(1) @ p["fc1.w"] + p["fc1.b"])  # flatten in C,H,W order, as shardstep
    return h @ p["fc2.w"] + p["fc2.b"]


def expected_shapes(a):
    """Logical weight shapes in shardstep's layout (dense w [in, out], conv w OIHW)."""
    if a.model == "mlp":
        dims = [784] + [int(h) for h in a.hidden.split(",")] + [10]
        return {n: s for i in range(1, len(dims)) for n, s in ((f"fc{i}.w", (dims[i - 1], dims[i])), (f"fc{i}.b", (dims[i],)))}
    return {"conv1.w": (32, 1, 3, 3), "conv1.b": (32,), "conv2.w": (64, 32, 3, 3), "conv2.b": (64,),
            "fc1.w": (64 * 7 * 7, 128), "fc1.b": (128,), "fc2.w": (128, 10), "fc2.b": (10,)}


def make_optimizer(a, params):
    wd = a.weight_decay
    if a.optimizer == "sgd": return torch.optim.SGD(params, lr=a.lr, weight_decay=wd)
    if a.optimizer == "momentum": return torch.optim.SGD(params, lr=a.lr, momentum=a.momentum, nesterov=a.nesterov, weight_decay=wd)
    if a.optimizer == "adam": return torch.optim.Adam(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    if a.optimizer == "adamw": return torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    if a.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=a.lr, eps=1e-10, weight_decay=wd,
                                   initial_accumulator_value=a.initial_accumulator)
    raise SystemExit(f"unknown optimizer {a.optimizer}")


def train(a, dt, start, slots, images, labels):
    """Trains the torch reference in dtype dt from `start`; returns (per-step losses, final weights and state in
    shardstep's names: torch's momentum_buffer, exp_avg, exp_avg_sq, sum -> <w>/momentum, /m, /v, /sum)."""
    params = {k: torch.tensor(v, dtype=dt, requires_grad=True) for k, v in start.items()}
    # shardstep excludes biases and norm parameters from weight decay (attr weight_decay=0), as the torch recipes do.
    no_decay = lambda k: k.endswith((".b", ".gamma", ".beta"))
    opt = make_optimizer(a, [{"params": [v for k, v in params.items() if not no_decay(k)]},
                             {"params": [v for k, v in params.items() if no_decay(k)], "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / a.warmup_steps) if a.warmup_steps > 0 else 1.0)
    losses = []
    for i in range(a.steps):
        x = torch.from_numpy(images[i * a.batch:(i + 1) * a.batch]).to(dt)
        y = torch.from_numpy(labels[i * a.batch:(i + 1) * a.batch]).long()
        opt.zero_grad()
        loss = F.cross_entropy(forward(a.model, params, x), y)
        loss.backward()
        if a.clip_norm > 0: torch.nn.utils.clip_grad_norm_(list(params.values()), a.clip_norm)
        opt.step()
        sched.step()
        losses.append(loss.item())
    torch_slot = {"momentum": "momentum_buffer", "m": "exp_avg", "v": "exp_avg_sq", "sum": "sum"}
    ref = {k: p.detach().numpy() for k, p in params.items()}
    for k, p in params.items():
        for s in slots: ref[f"{k}/{s}"] = opt.state[p][torch_slot[s]].numpy()
    return losses, ref


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    pc.add_common_args(ap)
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default="adam")
    ap.add_argument("--lr", type=float, help="default: sgd 0.1, momentum 0.05, adam/adamw 1e-3, adagrad 0.01")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--nesterov", action="store_true")
    ap.add_argument("--initial-accumulator", type=float, default=0.0, help="Adagrad's initial accumulator")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="torch precision (float64 where torch's own float32 rounding is amplified past --tol)")
    ap.add_argument("--float32-noise", action="store_true",
                    help="with --dtype float64: also train torch in float32; a tensor's tolerance is at least torch "
                         "float32's own distance from float64 on it (shardstep must be as close as PyTorch float32)")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                    help="bf16: shardstep --precision bf16 against the bf16 matmul oracle above (MLP, torch float32); "
                         "also checks that the oracle's losses differ from float32 training by more than --tol")
    a = ap.parse_args()
    global PRECISION
    PRECISION = a.precision
    if a.precision == "bf16" and (a.model != "mlp" or a.dtype != "float32" or a.float32_noise):
        sys.exit("--precision bf16 needs --model mlp and --dtype float32")
    a.lr = a.lr if a.lr is not None else DEFAULT_LR[a.optimizer]
    pc.check_args(a)
    torch.set_num_threads(2 if a.model == "cnn" else 1)  # the MLP's matrices are too small for threads to pay
    torch.manual_seed(0)

    extra = ["--model", a.model, "--optimizer", a.optimizer, "--lr", repr(a.lr), "--weight-decay", repr(a.weight_decay)]
    if a.model == "mlp": extra += ["--hidden", a.hidden]
    if a.precision != "f32": extra += ["--precision", a.precision]
    if a.optimizer == "adagrad": extra += ["--initial-accumulator", repr(a.initial_accumulator)]
    if a.optimizer == "momentum": extra += ["--momentum", repr(a.momentum)] + (["--nesterov"] if a.nesterov else [])
    with tempfile.TemporaryDirectory(prefix="parity_") as tmp:
        init, ours, final, secs = pc.run_shardstep(a, extra, tmp)
    slots = {"sgd": {}, "momentum": {"momentum": 0.0}, "adam": {"m": 0.0, "v": 0.0}, "adamw": {"m": 0.0, "v": 0.0},
             "adagrad": {"sum": a.initial_accumulator}}[a.optimizer]
    pc.check_initial_state(init, expected_shapes(a), slots)

    t0 = time.time()
    start = {k: v.copy() for k, v in init.items() if k != "step" and "/" not in k}
    pc.perturb_initial(a, start)
    a.lr = pc.reference_lr(a)
    images, labels = pc.load_fashion_mnist(a.data_dir, a.steps * a.batch)
    theirs, ref = train(a, getattr(torch, a.dtype), start, slots, images, labels)
    rtols = None
    if a.float32_noise:
        if a.dtype != "float64": sys.exit("--float32-noise needs --dtype float64")
        _, ref32 = train(a, torch.float32, start, slots, images, labels)
        print("torch float32's own distance from float64, per tensor (the tolerance where it exceeds --state-rtol):")
        rtols = {k: max(a.state_rtol, pc.max_rel_diff(ref32[k], ref[k])) for k in ref}
        print("  " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(rtols.items()) if v > a.state_rtol))
    label = (f"{a.model} {a.optimizer} lr={a.lr} wd={a.weight_decay}" + (" nesterov" if a.nesterov else "") +
             f" clip={a.clip_norm} warmup={a.warmup_steps} batch={a.batch} replicas={a.replicas}" +
             (f" shard={a.shard_weight_update}" if a.shard_weight_update else "") + f" vs torch {a.dtype}")
    if a.precision == "bf16":
        label += " precision=bf16"
        loss_tols, rtols = bf16_tolerances(a, start, slots, images, labels, theirs, ref)
        # The test can fail: float32 training (no rounding) must fall outside these tolerances.
        PRECISION = "f32"
        theirs_f32, _ = train(a, torch.float32, start, slots, images, labels)
        PRECISION = "bf16"
        outside = sum(abs(x - y) / max(abs(y), 1.0) > t for x, y, t in zip(theirs_f32, theirs, loss_tols))
        print(f"float32 training vs the bf16 oracle: {outside} of {a.steps} steps outside the loss tolerance")
        if outside < a.steps // 2:
            print(f"FAIL: {label}: float32 and bf16 losses are too close for the test to tell them apart")
            return pc.finish(label, 1)
        bad = pc.compare_losses(label, ours, theirs, "torch", loss_tols, secs, time.time() - t0)
        bad += pc.compare_state(label, final, ref, "torch", a.state_rtol, rtols)
        return pc.finish(label, bad)
    bad = pc.compare(label, ours, theirs, "torch", a.tol, secs, time.time() - t0)
    bad += pc.compare_state(label, final, ref, "torch", a.state_rtol, rtols)
    return pc.finish(label, bad)


if __name__ == "__main__":
    sys.exit(main())
