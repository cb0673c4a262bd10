# PyTorch 1.13 equivalents of shardstep's resnet20, transformer_lm and bert training steps for bench/step
# (torch_step.py): the same shapes, FLOPs, loss and optimizer kind, written the idiomatic PyTorch way (nn.Module,
# nn.BatchNorm2d, torch.optim) so that PyTorch runs at its best. Architectures as the parity references pin them
# (tests/parity/torch_resnet20.py, tests/parity/torch_transformer_lm.py) and as models/transformer.cc defines bert.
# Each make_*() returns (model, optimizer, scheduler or None, batch dict, loss function(model, batch), clip norm).
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def param_groups(model, wd):
    """Biases and norm parameters (the 1-D ones) without weight decay (and with LAMB trust ratio 1), as shardstep's
    NoDecay weights; matrices, convolutions and embedding tables with decay."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": wd},
            {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0}]


def warmup_cosine(warmup, total, end_factor):
    def f(t):
        if t < warmup: return (t + 1) / warmup
        frac = min(1.0, (t - warmup) / max(1, total - warmup))
        return end_factor + (1 - end_factor) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


# --- resnet20 (configs/resnet20.toml): conv1 3x3/16 -> bn -> relu; 3 stages x 3 basic blocks (16/32/64), projection
# shortcuts (1x1 conv + bn) where the shape changes; global average pool; fc. Batch norm eps 1e-5, momentum 0.1.

class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.proj = None
        if stride != 1 or cin != cout:
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (self.proj(x) if self.proj is not None else x))


class ResNet20(nn.Module):
    def __init__(self, channels=1, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks, cin = [], 16
        for s, filters in ((1, 16), (2, 32), (3, 64)):
            for b in range(3):
                blocks.append(Block(cin, filters, 2 if b == 0 and s > 1 else 1))
                cin = filters
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        h = self.blocks(F.relu(self.bn1(self.conv1(x))))
        return self.fc(h.mean((2, 3)))


def make_resnet20(batch=128):
    model = ResNet20()
    opt = torch.optim.SGD(param_groups(model, 5e-4), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(469, 3752, 0.0))
    data = {"x": torch.randn(batch, 1, 28, 28), "y": torch.randint(0, 10, (batch,))}
    loss = lambda m, d: F.cross_entropy(m(d["x"]), d["y"], label_smoothing=0.1)
    return model, opt, sched, data, loss, 0.0


# --- transformers: multi-head self-attention as models/transformer.cc (q, k, v, o dense with bias; scores / sqrt(Dh)
# (+ causal mask), softmax, dropout on the probabilities).

class Attention(nn.Module):
    def __init__(self, d, heads, p):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.p = heads, p

    def forward(self, x, mask=None):
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads).permute(0, 2, 1, 3)
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if mask is not None: scores = scores + mask
        probs = F.dropout(torch.softmax(scores, -1), self.p, self.training)
        return self.o((probs @ v).permute(0, 2, 1, 3).reshape(b, t, d))


class LmBlock(nn.Module):  # pre-LN
    def __init__(self, d, heads, mlp, p):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, p)
        self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)
        self.p = p

    def forward(self, x, mask):
        a = x + F.dropout(self.attn(self.ln1(x), mask), self.p, self.training)
        m = self.fc2(F.gelu(self.fc1(self.ln2(a)), approximate="tanh"))
        return a + F.dropout(m, self.p, self.training)


class TransformerLm(nn.Module):
    def __init__(self, vocab, context, layers, width, heads, mlp, p):
        super().__init__()
        self.tok_emb = nn.Parameter(torch.randn(vocab, width) * 0.02)
        self.pos_emb = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(LmBlock(width, heads, mlp, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.register_buffer("mask", torch.zeros(context, context).masked_fill(
            torch.triu(torch.ones(context, context, dtype=torch.bool), 1), -1e9))
        self.p = p

    def forward(self, tokens):
        t = tokens.shape[1]
        x = F.dropout(self.tok_emb[tokens] + self.pos_emb[:t], self.p, self.training)
        for blk in self.blocks: x = blk(x, self.mask)
        return self.ln_f(x) @ self.tok_emb.t()  # tied output embedding


def make_transformer_lm(batch=32, vocab=63, context=128, layers=4, width=128, heads=4, mlp=512, p=0.0):
    """configs/transformer_lm.toml: AdamW lr 0.003 betas (0.9, 0.99) wd 0.01, clip 1.0, warm-up 50, cosine."""
    model = TransformerLm(vocab, context, layers, width, heads, mlp, p)
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=0.003, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(50, 1200, 0.1))
    data = {"tokens": torch.randint(0, vocab, (batch, context)), "targets": torch.randint(0, vocab, (batch, context))}
    loss = lambda m, d: F.cross_entropy(m(d["tokens"]).reshape(-1, vocab), d["targets"].reshape(-1))
    return model, opt, sched, data, loss, 1.0


# --- bert (models/transformer.cc DefineBert): post-LN encoder, eps 1e-12, GELU (tanh), masked-LM head tied to the
# token embedding plus an output bias, tanh pooler on position 0 and the next-sentence classifier.

class BertBlock(nn.Module):  # post-LN
    def __init__(self, d, heads, mlp, p):
        super().__init__()
        self.attn = Attention(d, heads, p)
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)
        self.p = p

    def forward(self, x):
        a = self.ln1(x + F.dropout(self.attn(x), self.p, self.training))
        m = self.fc2(F.gelu(self.fc1(a), approximate="tanh"))
        return self.ln2(a + F.dropout(m, self.p, self.training))


class Bert(nn.Module):
    def __init__(self, vocab, context, layers, width, heads, mlp, p, positions=512):
        super().__init__()
        self.tok_emb = nn.Parameter(torch.randn(vocab, width) * 0.02)
        self.pos_emb = nn.Parameter(torch.randn(positions, width) * 0.02)
        self.type_emb = nn.Parameter(torch.randn(2, width) * 0.02)
        self.emb_ln = nn.LayerNorm(width, eps=1e-12)
        self.blocks = nn.ModuleList(BertBlock(width, heads, mlp, p) for _ in range(layers))
        self.mlm_dense = nn.Linear(width, width)
        self.mlm_ln = nn.LayerNorm(width, eps=1e-12)
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.pooler, self.nsp = nn.Linear(width, width), nn.Linear(width, 2)
        self.p = p

    def forward(self, tokens, segments):
        t = tokens.shape[1]
        x = self.tok_emb[tokens] + self.pos_emb[:t] + self.type_emb[segments]
        x = F.dropout(self.emb_ln(x), self.p, self.training)
        for blk in self.blocks: x = blk(x)
        h = self.mlm_ln(F.gelu(self.mlm_dense(x), approximate="tanh"))
        logits = h @ self.tok_emb.t() + self.mlm_bias
        return logits, self.nsp(torch.tanh(self.pooler(x[:, 0])))


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019) as shardstep's optimizer_lowering: bias-corrected Adam moments, r = m^ / (sqrt(v^) +
    eps) + wd w, w -= lr (||w|| / ||r||) r; groups with weight_decay 0 take trust ratio 1 (layer_adaptation=0)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            adapt = g["weight_decay"] != 0
            for p in g["params"]:
                if p.grad is None: continue
                st = self.state[p]
                if not st:
                    st["step"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                m, v, t = st["m"], st["v"], st["step"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                r = (m / (1 - b1 ** t)).div_((v / (1 - b2 ** t)).sqrt_().add_(g["eps"]))
                if adapt: r.add_(p, alpha=g["weight_decay"])
                trust = 1.0
                if adapt:
                    wn, rn = float(p.norm()), float(r.norm())
                    trust = wn / rn if wn > 0 and rn > 0 else 1.0
                p.add_(r, alpha=-g["lr"] * trust)


def make_bert(batch=32, vocab=4096, context=64, layers=2, width=128, heads=2, mlp=512, p=0.1):
    """bench/mlperf/mlperf_bert.cc's size and recipe: LAMB lr 0.004 wd 0.01, warm-up 200, polynomial decay."""
    model = Bert(vocab, context, layers, width, heads, mlp, p)
    opt = Lamb(param_groups(model, 0.01), lr=0.004)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 200) * max(0.0, 1 - t / 3000))
    data = {"tokens": torch.randint(0, vocab, (batch, context)), "segments": torch.randint(0, 2, (batch, context)),
            "targets": torch.randint(0, vocab, (batch, context)),
            "weights": (torch.rand(batch, context) < 0.15).float(), "next": torch.randint(0, 2, (batch,))}
    data["weights"][:, 1] = 1.0  # at least one predicted position per example

    def loss(m, d):
        logits, nsp = m(d["tokens"], d["segments"])
        ce = F.cross_entropy(logits.reshape(-1, vocab), d["targets"].reshape(-1), reduction="none")
        w = d["weights"].reshape(-1)
        return (ce * w).sum() / w.sum() + F.cross_entropy(nsp, d["next"])
    return model, opt, sched, data, loss, 0.0
