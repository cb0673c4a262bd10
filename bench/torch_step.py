# PyTorch 1.13 reference for bench/step: the same MLP (784-1024-1024-10) and CNN training steps
# (forward + backward + Adam) at batch 128, timed one step at a time.
# Protocol (stdin/stdout, line based): "<mlp|cnn> <k>" -> k per-step times in ms on one line; "quit".
# Thread setting: torch.set_num_threads(2) with OPENBLAS_NUM_THREADS=1 (the parent sets the env),
# PyTorch's best setting on this 2-core machine.
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
torch.manual_seed(0)
BATCH = 128


def mlp():
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


models = {}
for name, make, shape in (("mlp", mlp, (BATCH, 784)), ("cnn", cnn, (BATCH, 1, 28, 28))):
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(*shape)
    y = torch.randint(0, 10, (BATCH,))
    models[name] = (model, opt, x, y)


def step(name):
    model, opt, x, y = models[name]
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


for name in models:  # warm up
    for _ in range(3):
        step(name)

print("ready torch", torch.__version__, "threads", torch.get_num_threads(), flush=True)
for line in sys.stdin:
    parts = line.split()
    if not parts or parts[0] == "quit":
        break
    name, k = parts[0], int(parts[1])
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        step(name)
        times.append((time.perf_counter() - t0) * 1e3)
    print(" ".join("%.4f" % t for t in times), flush=True)
