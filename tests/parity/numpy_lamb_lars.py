#!/usr/bin/env python3
"""Checks shardstep's LAMB / LARS MLP training (per-step losses, final weights and optimizer state), replicated or
sharded (--replicas N --shard-weight-update on), against an independent NumPy implementation of the papers."""
# LAMB: You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2 with bias correction:
#   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  r = (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + wd w
#   w -= lr * (||w|| / ||r||) * r            (trust ratio per tensor; 1 when either norm is 0)
# LARS: You et al. 2017, "Large Batch Training of Convolutional Networks":
#   local_lr = eta ||w|| / (||g|| + wd ||w||)  (1 when either norm is 0, as for LAMB, so zero-initialised biases move)
#   v = mom v + lr * local_lr * (g + wd w);  w -= v
# g is the gradient after global-norm clipping (torch.nn.utils.clip_grad_norm_ semantics: scale by
# min(1, max_norm / (norm + 1e-6))), lr follows the linear warm-up min(1, (t+1)/warmup) at 0-based step t.
# The MLP (dense w stored [in, out], ReLU, mean softmax cross-entropy) is differentiated by hand. The per-tensor
# norms are of the logical (unpadded) tensors: sharded shardstep must get the same from partial sums over padded
# shards. Final state compared: <w> (weights), <w>/m and <w>/v (LAMB), <w>/momentum (LARS velocity).
# Arithmetic is float64 (this is a float64 parity mode): what is left is shardstep's own float32 rounding, see
# the tolerances in parity_common.py; float64 makes this an oracle for the maths rather than for one rounding order.
import argparse, os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc
import numpy as np

DEFAULT_LR = {"lamb": 0.01, "lars": 1.0}


def loss_and_grads(p, n_layers, x, y):
    """Mean softmax cross-entropy of the MLP and its gradients, by hand."""
    acts, h = [x], x
    for i in range(1, n_layers + 1):
        h = h @ p[f"fc{i}.w"] + p[f"fc{i}.b"]
        if i < n_layers: h = np.maximum(h, 0)
        acts.append(h)
    z = acts[-1]
    zs = z - z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(zs).sum(axis=1))
    loss = np.mean(lse - zs[np.arange(len(y)), y])
    dz = np.exp(zs - lse[:, None])  # softmax
    dz[np.arange(len(y)), y] -= 1
    dz /= len(y)
    grads = {}
    for i in range(n_layers, 0, -1):
        grads[f"fc{i}.w"] = acts[i - 1].T @ dz
        grads[f"fc{i}.b"] = dz.sum(axis=0)
        if i > 1: dz = (dz @ p[f"fc{i}.w"].T) * (acts[i - 1] > 0)  # ReLU'(a) = [a > 0]
    return loss, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    pc.add_common_args(ap)
    ap.add_argument("--optimizer", choices=["lamb", "lars"], required=True)
    ap.add_argument("--lr", type=float, help="default: lamb 0.01, lars 1.0")
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-6, help="LAMB epsilon")
    ap.add_argument("--momentum", type=float, default=0.9, help="LARS momentum")
    ap.add_argument("--trust-coefficient", type=float, default=0.001, help="LARS eta")
    a = ap.parse_args()
    a.lr = a.lr if a.lr is not None else DEFAULT_LR[a.optimizer]
    pc.check_args(a)

    extra = ["--model", "mlp", "--hidden", a.hidden, "--optimizer", a.optimizer, "--lr", repr(a.lr),
             "--weight-decay", repr(a.weight_decay)]
    if a.optimizer == "lamb": extra += ["--beta1", repr(a.beta1), "--beta2", repr(a.beta2), "--eps", repr(a.eps)]
    else: extra += ["--momentum", repr(a.momentum), "--trust-coefficient", repr(a.trust_coefficient)]
    with tempfile.TemporaryDirectory(prefix="parity_") as tmp:
        init, ours, final, secs = pc.run_shardstep(a, extra, tmp)
    dims = [784] + [int(h) for h in a.hidden.split(",")] + [10]
    n_layers = len(dims) - 1
    shapes = {n: s for i in range(1, len(dims)) for n, s in ((f"fc{i}.w", (dims[i - 1], dims[i])), (f"fc{i}.b", (dims[i],)))}
    slot_names = ("m", "v") if a.optimizer == "lamb" else ("momentum",)
    pc.check_initial_state(init, shapes, {s: 0.0 for s in slot_names})

    t0 = time.time()
    p = {k: v.astype(np.float64) for k, v in init.items() if k.startswith("fc") and "/" not in k}
    pc.perturb_initial(a, p)
    lr0 = pc.reference_lr(a)
    s1 = {k: np.zeros_like(v) for k, v in p.items()}  # LAMB m / LARS velocity
    s2 = {k: np.zeros_like(v) for k, v in p.items()}  # LAMB v
    images, labels = pc.load_fashion_mnist(a.data_dir, a.steps * a.batch)
    norm = lambda t: np.sqrt(np.sum(t * t))
    wd, theirs = a.weight_decay, []
    for i in range(a.steps):
        x, y = images[i * a.batch:(i + 1) * a.batch].astype(np.float64), labels[i * a.batch:(i + 1) * a.batch]
        loss, g = loss_and_grads(p, n_layers, x, y)
        theirs.append(loss)
        if a.clip_norm > 0:
            coef = min(1.0, a.clip_norm / (np.sqrt(sum(np.sum(v * v) for v in g.values())) + 1e-6))
            g = {k: v * coef for k, v in g.items()}
        lr = lr0 * (min(1.0, (i + 1) / a.warmup_steps) if a.warmup_steps > 0 else 1.0)
        t = i + 1
        for k in p:
            w = p[k]
            # Biases: no weight decay and no layer adaptation (shardstep's weight_decay=0, layer_adaptation=0).
            adapt, wd = not k.endswith(".b"), (0.0 if k.endswith(".b") else a.weight_decay)
            if a.optimizer == "lamb":
                s1[k] = a.beta1 * s1[k] + (1 - a.beta1) * g[k]
                s2[k] = a.beta2 * s2[k] + (1 - a.beta2) * g[k] ** 2
                r = (s1[k] / (1 - a.beta1 ** t)) / (np.sqrt(s2[k] / (1 - a.beta2 ** t)) + a.eps) + wd * w
                wn, rn = norm(w), norm(r)
                p[k] = w - lr * (wn / rn if adapt and wn > 0 and rn > 0 else 1.0) * r
            else:
                wn, gn = norm(w), norm(g[k])
                local = a.trust_coefficient * wn / (gn + wd * wn) if adapt and wn > 0 and gn > 0 else 1.0
                s1[k] = a.momentum * s1[k] + lr * local * (g[k] + wd * w)
                p[k] = w - s1[k]
    ref = dict(p)
    for k in p:
        if a.optimizer == "lamb": ref[f"{k}/m"], ref[f"{k}/v"] = s1[k], s2[k]
        else: ref[f"{k}/momentum"] = s1[k]
    wd = a.weight_decay
    label = (f"mlp {a.optimizer} lr={a.lr} wd={wd} clip={a.clip_norm} warmup={a.warmup_steps} batch={a.batch} "
             f"replicas={a.replicas}" + (f" shard={a.shard_weight_update}" if a.shard_weight_update else "") + " vs numpy float64")
    bad = pc.compare(label, ours, theirs, "numpy", a.tol, secs, time.time() - t0)
    bad += pc.compare_state(label, final, ref, "numpy", a.state_rtol)
    return pc.finish(label, bad)


if __name__ == "__main__":
    sys.exit(main())
