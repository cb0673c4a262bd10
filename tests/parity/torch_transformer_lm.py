#!/usr/bin/env python3
"""Checks `shardstep train --model transformer_lm` against an independent PyTorch GPT-style language model (pre-LN,
causal attention, tied output embedding, dropout masks reproduced from the pinned Philox rule; Adam or LAMB):
per-step losses and the final weights and optimizer state, replicated or sharded (--replicas N
--shard-weight-update on). With --precision bf16: shardstep's mixed precision against a bf16 matmul oracle, step by
step from shardstep's own states (see bf16_teacher_forced)."""
# The model is written here from the pinned description (/tmp/contract.md "transformer_lm"), functionally, weights
# in shardstep's layout (dense w [in, out] used as x @ w, embeddings [rows, D]), never from shardstep's code:
#   x = tok_emb.w[tokens] + pos_emb.w[0:T] -> dropout; block h{i}: a = x + dropout(attn(ln1(x))),
#   x = a + dropout(mlp(ln2(a))); attn: q, k, v dense(D) with bias, H heads of D/H, scores q k^T / sqrt(D/H),
#   -1e9 added where s > t, softmax over s, dropout on the probabilities [B, H, T, T], probs v -> o dense(D);
#   mlp: fc1 dense(mlp_width) -> GELU (tanh) -> fc2 dense(D); ln_f; logits = x @ tok_emb.w^T; loss = mean over all
#   B*T positions of the cross-entropy with label smoothing. Layer norms: eps 1e-5, biased variance.
# Dropout (p > 0): keep = u >= p, y = keep ? x / (1 - p) : 0, u = Philox4x32-10 uniform of the pinned rule
# (tests/parity/philox.py): key = seed (low, high word), counter = (j, e, step, 0), word 0 -> (x0 >> 8) 2^-24, where
# e = the element's example index in the GLOBAL batch (dimension 0; replicas start at replica_id * per-replica
# batch, so the masks do not depend on --replicas), j = its flat index within the example, step = the step counter
# before the update (0 first), seed = (model seed << 16) + k for the k-th dropout site in definition order:
# k = 0 the embedding dropout, then per block 3 sites: attention probabilities, attention output, MLP output.
# Optimizers: Adam = torch.optim.Adam with two parameter groups (weight decay 0 for biases and layer-norm gamma /
# beta); LAMB (You et al. 2019, as tests/parity/numpy_lamb_lars.py): r = m^ / (sqrt(v^) + eps) + wd w,
# w -= lr (||w|| / ||r||) r, with wd 0 and trust ratio 1 for biases, gamma and beta (layer_adaptation=0).
# Gradients clipped to the global norm first, linear warm-up. Batches ("tokens", "targets") read back from
# shardstep's --save-batches file.
import argparse, math, os, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc
import bf16_matmul
import numpy as np
import torch
import torch.nn.functional as F

LN_EPS = 1e-5


def no_decay(name):
    return name.endswith(".b") or name.endswith(".gamma") or name.endswith(".beta")


def philox_uniform(seed, step, first_example, shape):
    """The pinned random_uniform, vectorised: float32 array of `shape` (dimension 0 = examples)."""
    import philox  # tests/parity/philox.py (the reference of the random_uniform op)
    return np.asarray(philox.random_uniform(seed, step, first_example, tuple(shape)), dtype=np.float32).reshape(shape)


class Dropout:
    """Dropout sites numbered in call order; the masks of step `step` from the pinned Philox rule."""

    def __init__(self, p, model_seed, step, mutate=None, replicas=1):
        self.p, self.model_seed, self.step, self.k = p, model_seed, step, 0
        self.mutate, self.replicas = mutate, replicas

    def __call__(self, x):
        k, self.k = self.k, self.k + 1
        if self.p == 0: return x
        seed = (self.model_seed << 16) + k + (1 if self.mutate == "dropout" else 0)
        shape = tuple(x.shape)
        if self.mutate == "mask-local":  # each replica numbering its examples from 0 (wrong with --replicas > 1)
            per = shape[0] // self.replicas
            u = np.concatenate([philox_uniform(seed, self.step, 0, (per,) + shape[1:]) for _ in range(self.replicas)])
        else:
            u = philox_uniform(seed, self.step, 0, shape)
        keep = torch.from_numpy(u >= np.float32(self.p)).to(x.dtype)
        return x * keep / (1 - self.p)


def layer_norm(p, name, x):
    return F.layer_norm(x, (x.shape[-1],), p[name + ".gamma"], p[name + ".beta"], eps=LN_EPS)


def f32_mm(site, a, b):
    return a @ b


def dense(p, name, x, mm=f32_mm):
    y = mm(name, x.reshape(-1, x.shape[-1]), p[name + ".w"])  # [B*T, in] @ [in, out], as shardstep's dense
    return y.reshape(x.shape[:-1] + (y.shape[-1],)) + p[name + ".b"]


def forward(p, tokens, layers, heads, drop, mm=f32_mm):
    B, T = tokens.shape
    D = p["tok_emb.w"].shape[1]
    Dh = D // heads
    x = drop(p["tok_emb.w"][tokens] + p["pos_emb.w"][:T])
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # s > t
    neg = torch.zeros(T, T, dtype=x.dtype).masked_fill(causal, -1e9)
    for i in range(layers):
        n = f"h{i}"
        h = layer_norm(p, n + ".ln1", x)
        split = lambda t: t.reshape(B, T, heads, Dh).permute(0, 2, 1, 3)  # [B, H, T, Dh]
        q, k, v = (split(dense(p, f"{n}.{w}", h, mm)) for w in "qkv")
        scores = mm(n + ".scores", q, k.transpose(-1, -2)) / math.sqrt(Dh) + neg
        probs = drop(torch.softmax(scores, -1))
        att = mm(n + ".pv", probs, v).permute(0, 2, 1, 3).reshape(B, T, D)
        a = x + drop(dense(p, n + ".o", att, mm))
        m = dense(p, n + ".fc2", F.gelu(dense(p, n + ".fc1", layer_norm(p, n + ".ln2", a), mm), approximate="tanh"), mm)
        x = a + drop(m)
    x = layer_norm(p, "ln_f", x)
    return mm("logits", x.reshape(B * T, D), p["tok_emb.w"].T).reshape(B, T, -1)


def expected_shapes(vocab, context, layers, width, mlp_width):
    s = {"tok_emb.w": (vocab, width), "pos_emb.w": (context, width), "ln_f.gamma": (width,), "ln_f.beta": (width,)}
    for i in range(layers):
        n = f"h{i}"
        for ln in ("ln1", "ln2"): s[f"{n}.{ln}.gamma"], s[f"{n}.{ln}.beta"] = (width,), (width,)
        for d in "qkvo": s[f"{n}.{d}.w"], s[f"{n}.{d}.b"] = (width, width), (width,)
        s[f"{n}.fc1.w"], s[f"{n}.fc1.b"] = (width, mlp_width), (mlp_width,)
        s[f"{n}.fc2.w"], s[f"{n}.fc2.b"] = (mlp_width, width), (width,)
    return s


def train(a, dt, start, batches, mm_cfg=None, first_step=0, state=None):
    """Trains the reference in dtype dt on batches (the steps first_step, first_step + 1, ...) from weights `start` and
    optimizer state `state` ({"<weight>/m", "<weight>/v"}: the state before first_step; None: zeros, first_step 0);
    mm_cfg: a bf16_matmul.Config for --precision bf16 (None: plain matmuls). Returns (losses, final state)."""
    mm = f32_mm if mm_cfg is None else bf16_matmul.matmul(mm_cfg)
    params = {k: torch.tensor(v, dtype=dt, requires_grad=True) for k, v in start.items()}
    names = sorted(params)
    lr_at = lambda i: a.lr * (min(1.0, (i + 1) / a.warmup_steps) if a.warmup_steps > 0 else 1.0)
    opt = None
    if a.optimizer == "adam":
        groups = [{"params": [params[k] for k in names if not no_decay(k)], "weight_decay": a.weight_decay},
                  {"params": [params[k] for k in names if no_decay(k)], "weight_decay": 0.0}]
        opt = torch.optim.Adam(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_at(t + first_step) / a.lr)
    m1 = {k: torch.zeros_like(params[k]) for k in names}
    m2 = {k: torch.zeros_like(params[k]) for k in names}
    if state is not None:
        m1 = {k: torch.tensor(state[k + "/m"], dtype=dt) for k in names}
        m2 = {k: torch.tensor(state[k + "/v"], dtype=dt) for k in names}
        if opt is not None:  # torch.optim.Adam's state after first_step steps
            for k in names:
                opt.state[params[k]] = {"step": torch.tensor(float(first_step)), "exp_avg": m1[k], "exp_avg_sq": m2[k]}
    losses = []
    for i, batch in enumerate(batches, first_step):
        tokens = torch.from_numpy(batch["tokens"].astype(np.int64))
        targets = torch.from_numpy(batch["targets"].astype(np.int64))
        drop = Dropout(a.dropout, a.seed, i, a.mutate, a.replicas)
        for p in params.values(): p.grad = None
        logits = forward(params, tokens, a.layers, a.heads, drop, mm)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               label_smoothing=a.label_smoothing)
        loss.backward()
        losses.append(loss.item())
        if a.clip_norm > 0: torch.nn.utils.clip_grad_norm_([params[k] for k in names], a.clip_norm)
        if opt is not None:
            opt.step()
            sched.step()
            continue
        with torch.no_grad():  # LAMB
            lr, t = lr_at(i), i + 1
            for k in names:
                w, g = params[k], params[k].grad
                m1[k] = a.beta1 * m1[k] + (1 - a.beta1) * g
                m2[k] = a.beta2 * m2[k] + (1 - a.beta2) * g * g
                r = (m1[k] / (1 - a.beta1 ** t)) / (torch.sqrt(m2[k] / (1 - a.beta2 ** t)) + a.eps)
                if no_decay(k):
                    trust = 1.0
                else:
                    r = r + a.weight_decay * w
                    wn, rn = float(torch.linalg.norm(w)), float(torch.linalg.norm(r))
                    trust = wn / rn if wn > 0 and rn > 0 else 1.0
                w.sub_(lr * trust * r)
    ref = {k: p.detach().numpy() for k, p in params.items()}
    for k in names:
        if opt is not None:
            ref[k + "/m"], ref[k + "/v"] = (opt.state[params[k]][s].numpy() for s in ("exp_avg", "exp_avg_sq"))
        else:
            ref[k + "/m"], ref[k + "/v"] = m1[k].numpy(), m2[k].numpy()
    return losses, ref


# --precision bf16 (issue 10): shardstep --precision bf16 against the oracle of tests/parity/bf16_matmul.py: every
# matmul of the model (q, k, v, o, fc1, fc2 and the tied logits; per head q k^T and probs v) and both backward matmuls
# of each round their operands to bf16, accumulating exactly (torch float64, see there); nothing else is rounded.
#
# The tolerance. Rounding operands to bf16 makes training sensitive to float32 noise: an operand within float32
# rounding of a bf16 rounding boundary rounds to one bf16 neighbour or the other (2^-8 relative apart, 2^16 float32
# ulps) depending on how its producer rounded. Such a flip moves the next matmul's outputs in that row by ~2^-8 /
# sqrt(K), far more than float32 noise, so they flip more operands downstream (within one step: through the layers,
# across the example's positions in attention, back through the backward pass), and across steps everything.
# Measured (Adam, dropout 0.1, KJV, 20 steps free running, batch 16 x context 32 x width 64 as the float32 cases):
# shardstep and torch float32 runs of this same oracle end 4.0e-3 / 3.8e-3 (largest relative L2 over the weights)
# from the float64 oracle, plain float training without any rounding 7.8e-3, and the oracle with h0.q's input
# gradient or the logits' weight gradient left unrounded 3.5e-3 / 2.9e-3 -- closer than the correct implementations:
# a free-running comparison cannot tell right from wrong. Hence:
# 1. Teacher-forced: shardstep saves its state after every step (--save-every 1), and for each step k the oracle takes
#    step k from shardstep's state before it (same batch, dropout masks, lr): shardstep's loss at step k and its
#    increments (new - old) of every weight and optimizer state tensor (for Adam's m: (1 - beta1) x the clipped
#    gradient) must match the oracle's. Flips then cannot compound across steps.
# 2. A low quantile over the steps (--bf16-quantile, the lower quartile): a step with a flip differs by up to ~2e-3
#    (relative L2 of the gradient), a step without one by float32 accumulation error only (~2e-7), and which steps
#    flip is float32 noise: at batch 4 x context 8 x width 32 (Adam, dropout 0.1, seeds 0 .. 3, N = 1 and 4) torch
#    float32 and shardstep each flip in 5 .. 11 of 20 steps (the layer-0 tensors see every flip of the step); at
#    batch 16 x context 32 x width 64 in every step. A wrong rounding (an operand unrounded, or rounded where
#    shardstep does not) moves EVERY step: the gradient by 2e-4 .. 7e-4 per step (h0.q's input gradient unrounded;
#    5e-5 on random tokens) .. 4e-3 (h1.pv's probabilities unrounded in the forward), float training by 4e-3 .. 1e-2.
#    So per tensor (and for the loss), the lower quartile over the steps of shardstep's relative L2 distance from the
#    oracle -- its distance in the steps without a flip, while fewer than 3/4 of the steps flip -- must be <=
#    max(--bf16-floor, --noise-factor x the same quartile of torch float32's own teacher-forced steps: another float32
#    implementation of this spec). The floor 1e-5 is ~50x the float32 error of a step's increments and 5x below the
#    smallest wrong-rounding effect seen; the loss's floor 1e-6 is ~10 float32 ulps of it (the loss moves little:
#    h1.pv's probabilities unrounded, 3e-6). Flips grow with the element count: keep the bf16 cases small.
# The oracle's new float64 state is rounded to float32 before it is differenced, as shardstep's is. Plain float steps
# (no rounding) from the same states must fail this test in at least half of the tensors, else the test says nothing.
def bf16_teacher_forced(a, states, batches, unrounded, ours):
    """states[k]: shardstep's state before step k (k = 0 .. steps); ours: its losses. Returns the number of failures."""
    def take_step(dt, cfg, k, before):
        weights = {n: before[n] for n in before if n != "step" and "/" not in n}
        opt_state = {n: before[n] for n in before if "/" in n}
        losses, after = train(a, dt, weights, [batches[k]], cfg, first_step=k, state=opt_state)
        return losses[0], after
    return bf16_matmul.teacher_forced(a, states, ours, take_step, unrounded)


def run_label(a, vocab):
    return (f"transformer_lm {a.optimizer} lr={a.lr} wd={a.weight_decay} dropout={a.dropout} ls={a.label_smoothing} "
            f"clip={a.clip_norm} warmup={a.warmup_steps} L={a.layers} D={a.width} H={a.heads} T={a.context} "
            f"vocab={vocab} batch={a.batch} replicas={a.replicas}" +
            (f" shard={a.shard_weight_update}" if a.shard_weight_update else "") + f" vs torch {a.dtype}" +
            (f" precision={a.precision}" if a.precision != "f32" else ""))


def bf16_main(a, states, batches, ours, vocab, secs, t0):
    """--precision bf16: the teacher-forced comparison of bf16_teacher_forced(). Returns the exit status."""
    unrounded = set()
    if (a.mutate or "").startswith("bf16-"):
        probe = bf16_matmul.Config()  # the site names, from one forward
        forward({k: torch.tensor(v) for k, v in states[0].items() if k != "step" and "/" not in k},
                torch.from_numpy(batches[0]["tokens"].astype(np.int64)), a.layers, a.heads,
                Dropout(0.0, a.seed, 0), bf16_matmul.matmul(probe))
        if a.mutate_site not in probe.sites: sys.exit(f"--mutate-site {a.mutate_site} is not one of {probe.sites}")
        unrounded = {(a.mutate_site, a.mutate[len("bf16-"):])}
        print(f"--mutate {a.mutate}: the oracle leaves {a.mutate[len('bf16-'):]} of {a.mutate_site}'s matmuls unrounded")
    label = run_label(a, vocab)
    print(f"{label}: shardstep {secs:.1f}s")
    bad = bf16_teacher_forced(a, states, batches, unrounded, ours)
    print(f"torch {time.time() - t0:.1f}s")
    return pc.finish(label, bad)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    pc.add_model_args(ap, default_batch=16)
    ap.add_argument("--optimizer", choices=["adam", "lamb"], default="adam")
    ap.add_argument("--lr", type=float, help="default: adam 1e-3, lamb 1e-2")
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, help="default: adam 1e-8, lamb 1e-6")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--mlp-width", type=int, default=0, help="0: 4 * width")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--text-file", help="shardstep's --text-file (default: its default corpus)")
    ap.add_argument("--float32-noise", action="store_true",
                    help="with --dtype float64: also train torch in float32; a tensor's tolerance is at least torch "
                         "float32's own relative L2 distance from float64 on it, times --noise-factor")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                    help="bf16: shardstep --precision bf16 against the bf16 matmul oracle (bf16_matmul.py; torch "
                         "float64 accumulating, teacher-forced, tolerance from torch float32's own steps, see bf16_teacher_forced); "
                         "also checks that plain float steps fall outside that tolerance")
    bf16_matmul.add_teacher_forced_args(ap)
    ap.add_argument("--mutate-site", default="h0.q",
                    help="the matmul site of --mutate bf16-*: h{i}.q|k|v|o|fc1|fc2|scores|pv or logits")
    ap.add_argument("--mutate", choices=["lr", "lr1pc", "weight", "init", "dropout", "mask-local", "bf16-fwd",
                                         "bf16-dgrad", "bf16-wgrad"],
                    help="test of the test, must make it FAIL: lr / lr1pc = reference lr x 1.001 / x 1.01; weight = "
                         "shardstep's final tok_emb.w scaled by 1 + 2 x its tolerance; init = the reference's initial "
                         "tok_emb.w scaled by 1 + 10 rtol; dropout = every site's seed + 1 (with --dropout > 0); "
                         "mask-local = each replica's masks from example 0 (with --dropout > 0 and --replicas > 1); with "
                         "--precision bf16, one operand of --mutate-site's matmuls left unrounded in the oracle (and "
                         "its float32 noise run): bf16-fwd = the left operand of the forward matmul, bf16-dgrad / bf16-wgrad "
                         "= the incoming gradient dz in da = dz b^T / db = a^T dz")
    a = ap.parse_args()
    a.lr = a.lr if a.lr is not None else {"adam": 1e-3, "lamb": 1e-2}[a.optimizer]
    a.eps = a.eps if a.eps is not None else {"adam": 1e-8, "lamb": 1e-6}[a.optimizer]
    a.mlp_width = a.mlp_width or 4 * a.width
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    extra = ["--model", "transformer_lm", "--optimizer", a.optimizer, "--lr", repr(a.lr),
             "--weight-decay", repr(a.weight_decay), "--beta1", repr(a.beta1), "--beta2", repr(a.beta2),
             "--eps", repr(a.eps), "--context", str(a.context), "--layers", str(a.layers), "--width", str(a.width),
             "--heads", str(a.heads), "--mlp-width", str(a.mlp_width), "--dropout", repr(a.dropout)]
    if a.label_smoothing: extra += ["--label-smoothing", repr(a.label_smoothing)]
    if a.precision != "f32": extra += ["--precision", a.precision]
    if a.precision == "bf16" and (a.dtype != "float64" or a.float32_noise):
        sys.exit("--precision bf16 needs --dtype float64 (its float32 noise runs are built in)")
    if (a.mutate or "").startswith("bf16-") and a.precision != "bf16": sys.exit(f"--mutate {a.mutate} needs --precision bf16")
    if a.mutate in ("init", "weight") and a.precision == "bf16":
        sys.exit(f"--mutate {a.mutate} is for --precision f32 (bf16 compares teacher-forced steps: use lr, bf16-*)")
    if a.text_file: extra += ["--text-file", a.text_file]
    states = []
    with tempfile.TemporaryDirectory(prefix="parity_transformer_") as tmp:
        ck = os.path.join(tmp, "ck")
        if a.precision == "bf16": extra += ["--save-every", "1", "--checkpoint-dir", ck, "--keep", str(a.steps + 1)]
        init, ours, final, batches, secs = pc.run_shardstep_model(a, extra, tmp, ["tokens", "targets"])
        if a.precision == "bf16":
            states = [init] + [pc.read_safetensors(os.path.join(ck, f"step-{k:09d}.safetensors"))
                               for k in range(1, a.steps + 1)]
    tok = batches[0]["tokens"]
    if tok.shape != (a.batch, a.context):
        sys.exit(f"FAIL: step0/tokens has shape {list(tok.shape)}, expected [{a.batch}, {a.context}]")
    if "tok_emb.w" not in init: sys.exit(f"FAIL: no tok_emb.w in the initial checkpoint ({sorted(init)[:8]} ...)")
    vocab = init["tok_emb.w"].shape[0]
    for b in batches:
        for n in ("tokens", "targets"):
            if b[n].min() < 0 or b[n].max() >= vocab: sys.exit(f"FAIL: {n} outside [0, {vocab})")
    shapes = expected_shapes(vocab, init["pos_emb.w"].shape[0], a.layers, a.width, a.mlp_width)
    pc.check_model_initial_state(init, shapes, {"m": 0.0, "v": 0.0}, {})
    if shapes["pos_emb.w"][0] < a.context: sys.exit(f"FAIL: pos_emb.w has {shapes['pos_emb.w'][0]} rows < context")

    t0 = time.time()
    start = {k: init[k].copy() for k in shapes}
    if a.mutate == "init":
        start["tok_emb.w"] = start["tok_emb.w"] * np.float32(1 + 10 * a.rtol)
        print("--mutate init: scaled the reference's initial tok_emb.w by 1 + 10 rtol")
    a.lr = pc.reference_lr(a)
    if a.precision == "bf16":
        return bf16_main(a, states, batches, ours, vocab, secs, t0)
    theirs, ref = train(a, getattr(torch, a.dtype), start, batches)
    rtols = None
    if a.float32_noise:
        if a.dtype != "float64": sys.exit("--float32-noise needs --dtype float64")
        _, ref32 = train(a, torch.float32, start, batches)
        rtols = {k: a.noise_factor * pc.rel_l2(ref32[k], ref[k]) for k in ref}
        print(f"torch float32's own relative L2 distance from float64 x {a.noise_factor:g}: max " +
              ", ".join(f"{k} {v:.2e}" for k, v in sorted(rtols.items(), key=lambda kv: -kv[1])[:4]))
    label = run_label(a, vocab)
    pc.mutate_final_weight(a, final, rtols)
    bad = pc.compare(label, ours, theirs, "torch", a.tol, secs, time.time() - t0)
    # h{i}.k.b: softmax over s is invariant to q . k.b, the same for every key position s, so its gradient is exactly
    # 0 and both sides hold rounding noise (torch float64 ~1e-17, float32 ~1e-12): bounded absolutely instead, the
    # weight by what Adam / LAMB (trust ratio 1) can move it on noise, lr per step.
    zero = {}
    for i in range(a.layers):
        zero.update({f"h{i}.k.b": a.lr * a.steps, f"h{i}.k.b/m": 1e-6, f"h{i}.k.b/v": 1e-12})
    bad += pc.compare_state_l2(label, final, ref, "torch", a.rtol, a.state_rtol, rtols, absolute=zero)
    return pc.finish(label, bad)


if __name__ == "__main__":
    sys.exit(main())
