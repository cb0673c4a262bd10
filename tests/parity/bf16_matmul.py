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
