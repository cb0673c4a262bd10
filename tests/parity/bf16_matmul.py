"""The bf16-autocast-style matmul of shardstep's --precision bf16 (ir/passes/mixed_precision.*), for the torch oracles.

shardstep's MixedPrecision pass runs right after autodiff, so it sees the forward matmuls AND the two matmuls autodiff
made for each of them, z = a @ b  ->  da = dz @ b^T,  db = a^T @ dz (transposes as the rule needs them; leading
dimensions are a batch of independent products). Every f32 operand of every one of these three matmuls becomes
convert(convert(x, bf16), f32) -- x rounded to nearest even, widened back exactly -- and the product is an f32 matmul of
those values. So in the oracle each of the three matmuls rounds ITS operands itself (a, b; dz, b; a, dz); nothing else
(bias adds, layer norm, softmax, GELU, dropout, the loss, the gradient sums, the optimizer) is rounded.

Accumulation: bf16 x bf16 products are exact in float32 (8 + 8 significant bits), so "f32 accumulation" pins only
that the sum of exact products is rounded to float32, in an order the spec leaves open (oneDNN's blocking, the
interpreter's double accumulator, the data-parallel split of a batch sum): every admissible order lies within
gamma_K * sum |a_i b_i| of the exact sum. A float32 oracle would be one arbitrary member of that set (torch's order);
the float64 oracle (torch float64, operands rounded to bf16) computes the exact sum to K 2^-53, the centre of the set,
and a float32 run of the same oracle measures how far one admissible float32 implementation lands from it (the
tolerance; torch_transformer_lm.py bf16_teacher_forced).
torch rounds a float64 tensor to bfloat16 through float32 (1 + 2^-8 + 2^-30 -> 1.0, not 1 + 2^-7): exactly what
rounding the float32 value shardstep holds does.
"""
import torch


def round_bf16(t):
    """t rounded to the nearest bf16 (ties to even: torch's float -> bfloat16 conversion), in t's dtype."""
    return t.to(torch.bfloat16).to(t.dtype)


class Config:
    """What the matmuls do. unrounded: {(site, which)} operands left unrounded (test of the test): which = "fwd" (the
    forward matmul's left operand a), "dgrad" (dz in da = dz @ b^T), "wgrad" (dz in db = a^T @ dz), "a" (a in db),
    "b" (b in the forward and in da). rounding: False = no bf16 at all (plain float training)."""

    def __init__(self, rounding=True, unrounded=()):
        self.rounding, self.unrounded = rounding, set(unrounded)
        self.sites = []  # the site names seen, in call order

    def r(self, t, site, which):
        return t if not self.rounding or (site, which) in self.unrounded else round_bf16(t)


class _Bf16Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, cfg, site):
        ctx.save_for_backward(a, b)  # the unrounded values: each backward matmul rounds its own operands
        ctx.cfg, ctx.site = cfg, site
        return cfg.r(a, site, "fwd") @ cfg.r(b, site, "b")

    @staticmethod
    def backward(ctx, dz):
        a, b = ctx.saved_tensors
        cfg, site = ctx.cfg, ctx.site
        tr = lambda t: t.transpose(-1, -2)
        da = cfg.r(dz, site, "dgrad") @ tr(cfg.r(b, site, "b"))
        db = tr(cfg.r(a, site, "a")) @ cfg.r(dz, site, "wgrad")
        return da, db, None, None


def matmul(cfg):
    """mm(site, a, b) for the models' forward: a @ b (same rank: 2-D, or batched with equal leading dimensions) with
    cfg's rounding in the forward and in both backward matmuls."""
    def mm(site, a, b):
        if a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2]:
            raise ValueError(f"{site}: bf16 matmul needs equal batch dimensions, got {list(a.shape)} @ {list(b.shape)}")
        if site not in cfg.sites: cfg.sites.append(site)
        return _Bf16Matmul.apply(a, b, cfg, site)
    return mm


# --- The teacher-forced comparison of --precision bf16 (torch_parity.py, torch_transformer_lm.py) --------------------
# Free-running bf16 trajectories cannot be compared: an operand within float32 rounding of a bf16 rounding boundary
# rounds to one bf16 neighbour or the other (2^-8 relative apart) depending on how its producer summed, and the flip
# snowballs. So shardstep saves its state after every step (--save-every 1) and the oracle takes each step k from
# shardstep's state before it; per tensor (and for the loss) the lower quartile over the steps of the relative L2
# distance of shardstep's increments from the oracle's must be <= max(floor, noise factor x the same quartile of torch
# float32's own teacher-forced steps). Which steps flip is float32 noise (the quartile sees the steps without a flip
# while fewer than 3/4 flip), a wrong rounding moves every step. The measurements behind the floors and the quantile:
# torch_transformer_lm.py, the comment above bf16_teacher_forced; the MLP's: torch_parity.py bf16_main.

def add_teacher_forced_args(ap):
    """The options of teacher_forced()."""
    ap.add_argument("--noise-factor", type=float, default=3.0,
                    help="with --precision bf16: tolerance = this x torch float32's own error (quantile)")
    ap.add_argument("--bf16-floor", type=float, default=1e-5,
                    help="with --precision bf16: the smallest tolerance of an increment (relative L2)")
    ap.add_argument("--bf16-quantile", type=float, default=0.25,
                    help="with --precision bf16: the quantile over the steps compared")
    ap.add_argument("--bf16-loss-floor", type=float, default=1e-6,
                    help="with --precision bf16: the smallest tolerance of the loss (relative)")


def teacher_forced(a, states, ours, take_step, unrounded=()):
    """states[k]: shardstep's state before step k (k = 0 .. a.steps, {name: float32 array}, "step" ignored); ours: its
    per-step losses; take_step(dt, cfg, k, before) -> (loss, {tensor: value after}): the oracle's step k in torch dtype
    dt with matmul Config cfg from the state `before`; unrounded: the Config's unrounded operands (--mutate bf16-*).
    The oracle is torch float64 (exact accumulation); its new state is rounded to float32 before it is differenced, as
    shardstep's is. Plain float steps from the same states must fall outside the tolerance in at least half of the
    tensors, else the test says nothing. Prints the tables; returns the number of failures."""
    import numpy as np
    import parity_common as pc
    names = sorted(n for n in states[-1] if n != "step")

    def take_steps(dt, make_cfg):
        """[(loss at step k, {tensor: increment})] for k = 0 .. steps - 1, each from states[k]."""
        out = []
        for k in range(a.steps):
            before = states[k]
            loss, after = take_step(dt, make_cfg(), k, before)
            out.append((loss, {n: np.asarray(after[n]).astype(np.float32).astype(np.float64) -
                               before[n].astype(np.float64) for n in names}))
        return out

    # The gradient summary: Adam's / LAMB's m increments ((1 - beta1) x the clipped gradient), else the weights'.
    grad_names = [n for n in names if n.endswith("/m")] or [n for n in names if "/" not in n]

    def dist(run, ref):
        """(per-step relative loss distances, {tensor: per-step relative L2 distances of its increment}, per-step
        relative L2 distance of the gradient summary's increments together)."""
        loss = [abs(x[0] - y[0]) / max(abs(y[0]), 1.0) for x, y in zip(run, ref)]
        grad = lambda inc: np.concatenate([inc[n].ravel() for n in grad_names])
        return (loss, {n: [pc.rel_l2(x[1][n], y[1][n]) for x, y in zip(run, ref)] for n in names},
                [pc.rel_l2(grad(x[1]), grad(y[1])) for x, y in zip(run, ref)])

    med = lambda v: float(np.quantile(v, a.bf16_quantile))  # the statistic over the steps
    per_step = lambda v: " ".join(f"{x:.0e}" for x in v)
    what = "m increments" if grad_names[0].endswith("/m") else "weight increments"
    oracle = take_steps(torch.float64, lambda: Config(unrounded=unrounded))
    noise_loss, noise, noise_grad = dist(take_steps(torch.float32, lambda: Config(unrounded=unrounded)), oracle)
    loss_tol = max(a.bf16_loss_floor, a.noise_factor * med(noise_loss))
    tols = {n: max(a.bf16_floor, a.noise_factor * med(noise[n])) for n in names}
    print(f"torch float32 teacher-forced vs the oracle, gradient ({what}) rel L2 per step: {per_step(noise_grad)}")

    # The test can tell bf16 from float: plain float steps (no rounding) must fall outside these tolerances.
    float_loss, float_d, float_grad = dist(take_steps(torch.float64, lambda: Config(rounding=False)), oracle)
    outside = [n for n in names if med(float_d[n]) > tols[n]]
    print(f"plain float steps vs the oracle, gradient rel L2 per step: {per_step(float_grad)}; {len(outside)} of "
          f"{len(names)} tensors outside their tolerance")
    failures = 0
    if len(outside) < len(names) // 2:
        print("FAIL: float and bf16 steps are too close for this test to tell them apart")
        failures += 1

    mine = [(ours[k], {n: states[k + 1][n].astype(np.float64) - states[k][n].astype(np.float64) for n in names})
            for k in range(a.steps)]
    loss_d, d, grad_d = dist(mine, oracle)
    print(f"shardstep vs the oracle, gradient rel L2 per step:  {per_step(grad_d)}")
    print(f"{'step':>4}  {'shardstep':>12}  {'oracle':>12}  {'rel diff':>9}")
    for k, ((x, _), (y, _)) in enumerate(zip(mine, oracle), 1):
        print(f"{k:>4}  {x:12.8f}  {y:12.8f}  {loss_d[k - 1]:9.2e}")
    print(f"losses: quantile {a.bf16_quantile:g} of the rel diff {med(loss_d):.2e} (tol {loss_tol:.2e}), "
          f"max {max(loss_d):.2e}")
    print(f"{'increment of':<26} {'q' + format(a.bf16_quantile, 'g'):>9} {'tol':>9} {'/ tol':>6} {'max':>9}   "
          f"(relative L2 over the steps)")
    ratio = {n: med(d[n]) / tols[n] for n in names}
    for n in names:
        print(f"{n:<26} {med(d[n]):9.2e} {tols[n]:9.2e} {ratio[n]:6.2f} {max(d[n]):9.2e}" +
              ("  <-- MISMATCH" if ratio[n] > 1 else ""))
    worst = lambda sel: max((med(d[n]) for n in names if sel(n)), default=0.0)
    slots = sorted({n.split("/", 1)[1] for n in names if "/" in n})
    print(f"teacher-forced, {a.steps} steps, quantile {a.bf16_quantile:g} over the steps: loss {med(loss_d):.2e}; "
          f"increments rel L2: weights {worst(lambda n: '/' not in n):.2e}" +
          "".join(f", {s} {worst(lambda n, s=s: n.endswith('/' + s)):.2e}" for s in slots) +
          f"; largest error / tolerance {max(ratio.values()):.2f} ({max(ratio, key=ratio.get)}), "
          f"loss {med(loss_d) / loss_tol:.2f}")
    bad = [n for n in names if ratio[n] > 1]
    if med(loss_d) > loss_tol: print(f"FAIL: the loss's relative difference (quantile) exceeds {loss_tol:.2e}")
    if bad: print(f"FAIL: {len(bad)} tensor(s)' increments differ by more than their tolerance: {bad[:6]}")
    return failures + (med(loss_d) > loss_tol) + bool(bad)
