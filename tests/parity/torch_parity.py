#!/usr/bin/env python3
"""Checks that `shardstep train` per-step losses match PyTorch 1.13 (same init, batches, optimizer, clipping, warm-up)."""
# Runs shardstep for N steps (--no-shuffle, --save-init, --metrics-out, --clip-norm, --schedule warmup) in a temp dir,
# rebuilds the model functionally in torch (weights kept in shardstep's layout: dense w is [in, out], conv w is OIHW),
# feeds the same Fashion-MNIST batches (read from the IDX .gz files here), steps torch.optim + clip_grad_norm_ +
# LambdaLR, and asserts every step's loss agrees within --tol relative. Exit 1 on mismatch. Needs /usr/bin/python3.
# torch runs in float32 (2 threads) unless --dtype float64; the initial weights are shardstep's float32 values.
import argparse, os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc
import torch
import torch.nn.functional as F

DEFAULT_LR = {"sgd": 0.1, "momentum": 0.05, "adam": 1e-3, "adamw": 1e-3, "adagrad": 0.01}


def forward(model, p, x):
    if model == "mlp":
        h, n = x.reshape(x.shape[0], 784), len([k for k in p if k.endswith(".w")])
        for i in range(1, n + 1):
            h = h @ p[f"fc{i}.w"] + p[f"fc{i}.b"]
            if i < n: h = F.relu(h)
        return h
    h = x.reshape(x.shape[0], 1, 28, 28)
    for c in ("conv1", "conv2"):
        h = F.max_pool2d(F.relu(F.conv2d(h, p[c + ".w"], p[c + ".b"], padding=1)), 2)
    h = F.relu(h.flatten(1) @ p["fc1.w"] + p["fc1.b"])  # flatten in C,H,W order, as shardstep
    return h @ p["fc2.w"] + p["fc2.b"]


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
    a = ap.parse_args()
    a.lr = a.lr if a.lr is not None else DEFAULT_LR[a.optimizer]
    torch.set_num_threads(2)
    torch.manual_seed(0)

    extra = ["--model", a.model, "--optimizer", a.optimizer, "--lr", repr(a.lr), "--weight-decay", repr(a.weight_decay)]
    if a.model == "mlp": extra += ["--hidden", a.hidden]
    if a.optimizer == "adagrad": extra += ["--initial-accumulator", repr(a.initial_accumulator)]
    if a.optimizer == "momentum": extra += ["--momentum", repr(a.momentum)] + (["--nesterov"] if a.nesterov else [])
    with tempfile.TemporaryDirectory(prefix="parity_") as tmp:
        init, ours, secs = pc.run_shardstep(a, extra, tmp)

    t0 = time.time()
    dt = getattr(torch, a.dtype)
    params = {k: torch.tensor(v, dtype=dt, requires_grad=True) for k, v in init.items() if k != "step" and "/" not in k}
    opt = make_optimizer(a, list(params.values()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / a.warmup_steps) if a.warmup_steps > 0 else 1.0)
    images, labels = pc.load_fashion_mnist(a.data_dir, a.steps * a.batch)
    theirs = []
    for i in range(a.steps):
        x = torch.from_numpy(images[i * a.batch:(i + 1) * a.batch]).to(dt)
        y = torch.from_numpy(labels[i * a.batch:(i + 1) * a.batch]).long()
        opt.zero_grad()
        loss = F.cross_entropy(forward(a.model, params, x), y)
        loss.backward()
        if a.clip_norm > 0: torch.nn.utils.clip_grad_norm_(list(params.values()), a.clip_norm)
        opt.step()
        sched.step()
        theirs.append(loss.item())
    label = f"{a.model} {a.optimizer} lr={a.lr} wd={a.weight_decay}" + (" nesterov" if a.nesterov else "") + f" torch {a.dtype}"
    return pc.compare(label, ours, theirs, "torch", a.tol, secs, time.time() - t0)


if __name__ == "__main__":
    sys.exit(main())
