"""Shared helpers for the parity oracles: run shardstep, read safetensors / Fashion-MNIST IDX, compare losses."""
import gzip, json, os, subprocess, sys, time
import numpy as np


def add_common_args(ap):
    ap.add_argument("--shardstep", required=True, help="path to the shardstep binary")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", default="128,64", help="MLP hidden widths")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative loss difference per step")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")


def read_safetensors(path):
    """{name: np.ndarray} from a safetensors file (8-byte LE header length, JSON header, raw data)."""
    dtypes = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64}
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__": continue
        lo, hi = info["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=dtypes[info["dtype"]]).reshape(info["shape"]).copy()
    return out


def load_fashion_mnist(data_dir, count):
    """First `count` training images as float32 [count, 784] scaled to [0,1], and int64 labels."""
    with gzip.open(os.path.join(data_dir, "train-images-idx3-ubyte.gz"), "rb") as f:
        raw = f.read()
    magic, n, rows, cols = (int.from_bytes(raw[i:i + 4], "big") for i in range(0, 16, 4))
    assert magic == 2051 and count <= n, f"bad image file (magic {magic}, {n} images)"
    images = np.frombuffer(raw, np.uint8, count * rows * cols, 16).reshape(count, rows * cols).astype(np.float32) / np.float32(255)
    with gzip.open(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"), "rb") as f:
        raw = f.read()
    assert int.from_bytes(raw[:4], "big") == 2049, "bad label file"
    return images, np.frombuffer(raw, np.uint8, count, 8).astype(np.int64)


def run_shardstep(a, extra, tmp):
    """Trains with shardstep; returns (initial variables, per-step losses, seconds)."""
    init, metrics = os.path.join(tmp, "init.safetensors"), os.path.join(tmp, "m.jsonl")
    cmd = [a.shardstep, "train", "--steps", str(a.steps), "--batch", str(a.batch), "--seed", str(a.seed),
           "--no-shuffle", "--save-init", init, "--metrics-out", metrics, "--data-dir", a.data_dir,
           "--clip-norm", repr(a.clip_norm)] + extra
    if a.warmup_steps > 0: cmd += ["--schedule", "warmup", "--warmup-steps", str(a.warmup_steps)]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    secs = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"FAIL: shardstep exited with {r.returncode}:\n{r.stdout}")
    with open(metrics) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    losses = [row["loss"] for row in rows if "step" in row and "split" not in row]  # skip eval and memory rows
    if len(losses) != a.steps:
        sys.exit(f"FAIL: expected {a.steps} training rows in {metrics}, got {len(losses)}")
    return read_safetensors(init), losses, secs


def compare(label, ours, theirs, name, tol, secs_ours, secs_theirs):
    """Prints the per-step table; returns 0 if every relative difference is <= tol, else 1."""
    print(f"{label}: shardstep {secs_ours:.1f}s, {name} {secs_theirs:.1f}s")
    print(f"{'step':>4}  {'shardstep':>12}  {name:>12}  {'rel diff':>9}")
    worst, bad = 0.0, []
    for i, (x, y) in enumerate(zip(ours, theirs), 1):
        rel = abs(x - y) / max(abs(y), 1e-12)
        worst = max(worst, rel)
        if not rel <= tol: bad.append(i)
        print(f"{i:>4}  {x:12.8f}  {y:12.8f}  {rel:9.2e}{'  <-- MISMATCH' if not rel <= tol else ''}")
    print(f"max rel diff {worst:.3e} (tol {tol:g})")
    if bad:
        print(f"FAIL: {label}: {len(bad)} step(s) differ by more than {tol:g} relative, first at step {bad[0]}")
        return 1
    print(f"PASS: {label}")
    return 0
