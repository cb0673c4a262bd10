# PyTorch 1.13 reference for bench/step: the same training steps (forward + backward + optimizer) as shardstep's
# models, timed one step at a time: the MLP (784-1024-1024-10) and the CNN at batch 128 with Adam (here), resnet20,
# transformer_lm and bert as bench/torch_models.py defines them (same shapes, FLOPs, loss and optimizer kind).
# Protocol (stdin/stdout, line based): "<mlp|cnn|resnet20|transformer_lm|bert> <k>" -> k per-step times in ms on
# one line; "quit". A model is built (and warmed up by 3 steps) at its first request, outside the timed steps.
# Thread setting: argv[1] (torch.set_num_threads) with OPENBLAS_NUM_THREADS=1, and glibc malloc keeping freed memory
# (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ at 4 GiB: no page faults per step); the parent sets the env.
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_models  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)
BATCH = 128


def classifier(model, shape):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = {"x": torch.randn(*shape), "y": torch.randint(0, 10, (BATCH,))}
    return model, opt, None, data, lambda m, d: F.cross_entropy(m(d["x"]), d["y"]), 0.0


def make_mlp():
    return classifier(nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                    nn.Linear(1024, 10)), (BATCH, 784))


def make_cnn():
    return classifier(nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10)), (BATCH, 1, 28, 28))


MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "resnet20": torch_models.make_resnet20,
          "transformer_lm": torch_models.make_transformer_lm, "bert": torch_models.make_bert}
models = {}


def step(name):
    model, opt, sched, data, loss_fn, clip = models[name]
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, data)
    loss.backward()
    if clip > 0: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    if sched is not None: sched.step()


def get(name):
    if name not in models:
        models[name] = MAKERS[name]()
        models[name][0].train()
        for _ in range(3):  # warm up
            step(name)
    return name


print("ready torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)
for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
        break
    name, k = get(parts[0]), int(parts[1])
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        step(name)
        times.append((time.perf_counter() - t0) * 1e3)
    print(" ".join("%.4f" % t for t in times), flush=True)
