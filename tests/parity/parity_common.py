"""Shared helpers for the parity oracles: run shardstep, read safetensors / Fashion-MNIST IDX, compare losses and state.

Tolerances (the defaults below; tests/CMakeLists.txt says which cases override them and why):
  Losses, per step:  |ours - ref| <= tol * max(|ref|, 1), tol = 1e-4.  The losses here are 0.3 .. 2.5, so this is
    relative; the floor of 1 (absolute 1e-4) only matters for a loss near 0, where relative error is meaningless.
    Observed over 20 steps: <= 4e-7 (a few float32 ulps of the loss; u = 2^-24 = 6e-8), Adagrad <= 8e-6. 1e-4 is
    kept from the original oracles: the weights below are the tight check.
  Weights and optimizer state, per element:  |ours - ref| <= rtol * max(|ref|, rms(ref tensor)), rtol = 5e-5.
    Relative to the element, with an absolute floor of its tensor's RMS: float32 error in an element comes from
    sums over terms of the tensor's typical size (a gradient entry that cancels to ~0 still carries the absolute
    error of its terms, and 20 steps of lr * g add up the same way), so it scales with the tensor, not with the
    element. One fixed floor could not serve weights (RMS ~5e-2) and Adam's v (~2e-7) at once.
    5e-5 = gamma_784 = 784 u: the worst-case relative error of a float32 dot product of the longest reduction
    here (784 inputs) [Higham, Accuracy and Stability of Numerical Algorithms, 3.1], relative to the scale of its
    terms; a weight moves by a few % of its size in 20 steps, so the per-step errors of its updates stay below
    that. Observed <= 4.2e-6 (weights <= 1.4e-6 except LAMB without clipping, 1.4e-5) for SGD, momentum, Nesterov,
    Adagrad (accumulator 0.1), LAMB, LARS on the MLP at N = 1, 3, 4, against float32 and float64 references.
    Adam/AdamW amplify rounding where a gradient entry is ~eps and need 1e-3, and the CNN's float32 is dominated
    by ReLUs that flip together in uniform background regions and needs 1e-2 or torch float32's own distance from
    float64 (torch_parity.py --float32-noise); tests/CMakeLists.txt has the measurements.
  --mutate checks that a test can fail: a 0.1 % (1 % for Adam) lr change, one initial weight moved by 10 times the
  tolerance, or one final element moved by twice the tolerance must exceed these.
"""
import gzip, json, os, shutil, subprocess, sys, time
import numpy as np


def add_common_args(ap, extra_mutations=()):
    """extra_mutations: further --mutate choices of the calling script (its own tests of the test)."""
    ap.add_argument("--shardstep", required=True, help="path to the shardstep binary")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="global batch (split evenly over --replicas)")
    ap.add_argument("--replicas", type=int, default=1, help="shardstep data-parallel replicas")
    ap.add_argument("--shard-weight-update", choices=["on", "off", "auto"],
                    help="shardstep's --shard-weight-update (not passed when unset)")
    ap.add_argument("--combine-threshold-bytes", type=int,
                    help="shardstep's collective combining threshold (not passed when unset: its default combines)")
    ap.add_argument("--hidden", default="128,64", help="MLP hidden widths")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip-norm", type=float, default=1.0, help="global-norm clipping (0: off)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps (0: constant lr)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="loss: max |diff| / max(|ref|, 1) per step")
    ap.add_argument("--state-rtol", type=float, default=5e-5,
                    help="final weights and optimizer state: max |diff| / max(|ref|, rms(ref tensor)) per element")
    ap.add_argument("--mutate", choices=["lr", "lr1pc", "weight", "init"] + list(extra_mutations),
                    help="test of the test, must make it FAIL: lr / lr1pc = reference lr x 1.001 / x 1.01; weight = the last "
                         "element of shardstep's last final weight moved by twice the tolerance; init = one initial reference "
                         "weight moved by 10 times the tolerance" + ("; see --mutate-site for the others" if extra_mutations else ""))
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")


def check_args(a):
    if a.replicas < 1 or a.batch % a.replicas:
        sys.exit(f"FAIL: --batch {a.batch} must be a positive multiple of --replicas {a.replicas}")


def reference_lr(a):
    """The learning rate the reference uses: a.lr, unless --mutate lr."""
    return a.lr * {"lr": 1.001, "lr1pc": 1.01}.get(a.mutate, 1.0)


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
        dt = np.dtype(dtypes[info["dtype"]])
        count = int(np.prod(info["shape"], dtype=np.int64))
        if hi - lo != count * dt.itemsize:
            sys.exit(f"FAIL: {path}: {name} has {hi - lo} bytes for shape {info['shape']} {info['dtype']}")
        out[name] = np.frombuffer(data[lo:hi], dtype=dt).reshape(info["shape"]).copy()
    return out


def load_fashion_mnist(data_dir, count):
    """First `count` training images as float32 [count, 784] scaled to [0,1], and int64 labels."""
    with gzip.open(os.path.join(data_dir, "train-images-idx3-ubyte.gz"), "rb") as f:
        raw = f.read(16)
        magic, n, rows, cols = (int.from_bytes(raw[i:i + 4], "big") for i in range(0, 16, 4))
        assert magic == 2051 and count <= n, f"bad image file (magic {magic}, {n} images)"
        raw += f.read(count * rows * cols)  # only what is used: inflating all 60000 images takes ~0.5 s
    images = np.frombuffer(raw, np.uint8, count * rows * cols, 16).reshape(count, rows * cols).astype(np.float32) / np.float32(255)
    with gzip.open(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"), "rb") as f:
        raw = f.read(8 + count)
    assert int.from_bytes(raw[:4], "big") == 2049, "bad label file"
    return images, np.frombuffer(raw, np.uint8, count, 8).astype(np.int64)


def check_initial_state(init, expected_shapes, state_init):
    """The --save-init checkpoint is the logical (unsharded, unpadded) state at step 0, whatever --replicas.

    expected_shapes: {weight name: shape in shardstep's layout (dense w [in, out])};
    state_init: {slot suffix: initial value} of the optimizer's state variables ("<weight>/<slot>")."""
    want = set(expected_shapes) | {f"{w}/{s}" for w in expected_shapes for s in state_init} | {"step"}
    if set(init) != want:
        sys.exit(f"FAIL: initial checkpoint holds {sorted(init)}, expected {sorted(want)}")
    if int(init["step"]) != 0:
        sys.exit(f"FAIL: initial step counter is {int(init['step'])}")
    for name, v in init.items():
        if name == "step": continue
        w, _, slot = name.partition("/")
        if tuple(v.shape) != tuple(expected_shapes[w]):
            sys.exit(f"FAIL: initial {name} has shape {list(v.shape)}, expected {list(expected_shapes[w])} (logical, unpadded)")
        if not np.all(np.isfinite(v)):
            sys.exit(f"FAIL: initial {name} is not finite")
        if slot and not np.all(v == np.float32(state_init[slot])):
            sys.exit(f"FAIL: initial {name} is not {state_init[slot]} everywhere")
    print(f"initial state: {len(init)} logical tensors, step 0, optimizer state initialised, shapes as the model")


def run_shardstep(a, extra, tmp):
    """Trains with shardstep; returns (initial state, per-step losses, final state, seconds)."""
    check_args(a)
    init, final, metrics = (os.path.join(tmp, f) for f in ("init.safetensors", "final.safetensors", "m.jsonl"))
    cmd = [a.shardstep, "train", "--steps", str(a.steps), "--batch", str(a.batch), "--seed", str(a.seed),
           "--no-shuffle", "--save-init", init, "--save", final, "--metrics-out", metrics, "--data-dir", a.data_dir,
           "--clip-norm", repr(a.clip_norm), "--replicas", str(a.replicas)] + extra
    if a.shard_weight_update: cmd += ["--shard-weight-update", a.shard_weight_update]
    if a.combine_threshold_bytes is not None: cmd += ["--combine-threshold-bytes", str(a.combine_threshold_bytes)]
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
    if any(l is None for l in losses):
        sys.exit(f"FAIL: non-finite loss in {metrics}")
    init_state, final_state = read_safetensors(init), read_safetensors(final)
    if set(final_state) != set(init_state):
        sys.exit(f"FAIL: final checkpoint holds {sorted(final_state)}, initial {sorted(init_state)}")
    if int(final_state["step"]) != a.steps:
        sys.exit(f"FAIL: final step counter is {int(final_state['step'])}, expected {a.steps}")
    if a.mutate == "weight":  # test of the test: the last element of the last weight (in N = 3's padded last shard)
        name = sorted(k for k in final_state if k != "step" and "/" not in k)[-1]
        v = final_state[name].reshape(-1)
        rms = np.sqrt(np.mean(v.astype(np.float64) ** 2))
        v[-1] += np.float32(2 * a.state_rtol * max(abs(float(v[-1])), rms))  # twice the tolerance
        print(f"--mutate weight: moved the last element of shardstep's final {name} by twice the tolerance")
    return init_state, losses, final_state, secs


def perturb_initial(a, params):
    """--mutate init: moves one initial reference weight (fc1.w[400, 0]) by 10 times the tolerance, in place."""
    if a.mutate != "init": return
    v = params["fc1.w"]
    rms = float(np.sqrt(np.mean(np.asarray(v, dtype=np.float64) ** 2)))
    v[400, 0] += 10 * a.state_rtol * max(abs(float(v[400, 0])), rms)
    print("--mutate init: moved the reference's initial fc1.w[400, 0] by 10 times the tolerance")


def compare(label, ours, theirs, name, tol, secs_ours, secs_theirs):
    """Prints the per-step loss table; returns 0 if every |diff| / max(|ref|, 1) is <= tol, else 1."""
    print(f"{label}: shardstep {secs_ours:.1f}s, {name} {secs_theirs:.1f}s")
    print(f"{'step':>4}  {'shardstep':>12}  {name:>12}  {'rel diff':>9}")
    worst, bad = 0.0, []
    for i, (x, y) in enumerate(zip(ours, theirs), 1):
        rel = abs(x - y) / max(abs(y), 1.0)
        worst = max(worst, rel)
        if not rel <= tol: bad.append(i)
        print(f"{i:>4}  {x:12.8f}  {y:12.8f}  {rel:9.2e}{'  <-- MISMATCH' if not rel <= tol else ''}")
    print(f"losses: max rel diff {worst:.3e} (tol {tol:g})")
    if bad:
        print(f"FAIL: {label}: {len(bad)} step(s) differ by more than {tol:g} relative, first at step {bad[0]}")
        return 1
    return 0


def rel_diffs(ours, ref):
    """|ours - ref| / max(|ref|, rms(ref)) per element (the tolerance's measure), as float64."""
    o, t = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    rms = float(np.sqrt(np.mean(t * t))) if t.size else 0.0
    rel = np.abs(o - t) / np.maximum(np.maximum(np.abs(t), rms), 1e-30)
    rel[~np.isfinite(o)] = np.inf
    return rel


def max_rel_diff(ours, ref):
    return float(rel_diffs(ours, ref).max()) if np.size(ref) else 0.0


def compare_state(label, ours, theirs, name, rtol, rtols=None):
    """Final weights and optimizer state, per element: |ours - ref| <= rtol * max(|ref|, rms(ref tensor)).

    ours: shardstep's final checkpoint; theirs: {name: array} in shardstep's names and layout. Every tensor of
    the checkpoint must have a reference. rtols: optional per-tensor tolerances instead of rtol. Prints a
    per-tensor table; returns 0 if all pass, else 1."""
    missing = sorted(set(ours) - set(theirs) - {"step"})
    if missing:
        print(f"FAIL: {label}: no {name} value for checkpoint tensors {missing}")
        return 1
    print(f"{'tensor':<14} {'shape':<11} {'rms(ref)':>9} {'max|diff|':>9} {'max rel':>9}  worst element (ours / {name})")
    worst, bad = {"weights": 0.0, "state": 0.0}, []
    for k in sorted(set(ours) - {"step"}):
        o, t = ours[k].astype(np.float64), np.asarray(theirs[k], dtype=np.float64)
        if o.shape != t.shape:
            print(f"FAIL: {label}: {k} has shape {list(o.shape)}, {name} {list(t.shape)}")
            return 1
        rms = float(np.sqrt(np.mean(t * t))) if t.size else 0.0
        diff = np.abs(o - t)
        rel = rel_diffs(o, t)
        i = np.unravel_index(int(np.argmax(rel)), rel.shape)
        r = float(rel[i])
        tol = rtols[k] if rtols else rtol
        kind = "state" if "/" in k else "weights"
        worst[kind] = max(worst[kind], r)
        flag = "  <-- MISMATCH" if not r <= tol else ""
        if flag: bad.append(k)
        print(f"{k:<14} {str(list(o.shape)):<11} {rms:9.2e} {float(diff.max()):9.2e} {r:9.2e}  "
              f"{list(map(int, i))} {o[i]:.9g} / {t[i]:.9g}" + (f"  (tol {tol:.2e})" if tol != rtol else "") + flag)
    print(f"weights: max rel diff {worst['weights']:.3e}; optimizer state: max rel diff {worst['state']:.3e} "
          f"(rtol {rtol:g}, floor rms of the tensor)")
    if bad:
        print(f"FAIL: {label}: {len(bad)} tensor(s) differ by more than their tolerance: {bad}")
        return 1
    return 0


def finish(label, failures):
    if failures:
        print(f"FAIL: {label}")
        return 1
    print(f"PASS: {label}")
    return 0


# --- Helpers for the model oracles (torch_resnet20.py, torch_transformer_lm.py) --------------------------------------
# These read the batches shardstep trained on from `shardstep train --save-batches FILE` (tensors "step{k}/{input}")
# instead of re-reading a dataset, and compare each final tensor as a whole: relative L2 error
# ||ours - ref||_2 / ||ref||_2 per tensor (the usual measure for a deep model, where single elements near a ReLU
# or softmax kink may move more than the tensor as a whole).

def add_model_args(ap, default_batch=32, default_steps=20):
    """The options shared by the model oracles (the MLP/CNN oracles use add_common_args)."""
    ap.add_argument("--shardstep", required=True, help="path to the shardstep binary")
    ap.add_argument("--steps", type=int, default=default_steps)
    ap.add_argument("--batch", type=int, default=default_batch, help="global batch (split evenly over --replicas)")
    ap.add_argument("--replicas", type=int, default=1, help="shardstep data-parallel replicas")
    ap.add_argument("--shard-weight-update", choices=["on", "off", "auto"],
                    help="shardstep's --shard-weight-update (not passed when unset)")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip-norm", type=float, default=1.0, help="global-norm clipping (0: off)")
    ap.add_argument("--warmup-steps", type=int, default=5, help="linear warm-up steps (0: constant lr)")
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4, help="loss: max |diff| / max(|ref|, 1) per step")
    ap.add_argument("--rtol", type=float, default=1e-4,
                    help="final weights and model state (batch-norm running statistics): relative L2 error per tensor")
    ap.add_argument("--state-rtol", type=float, default=1e-4,
                    help="final optimizer state: relative L2 error per tensor")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float64", help="torch precision")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--shardstep-arg", action="append", default=[],
                    help="extra argument passed to shardstep train as is (repeatable)")
    ap.add_argument("--keep-dir", help="keep shardstep's files (init, final, batches, metrics) in this directory")


def read_batches(path, steps, names):
    """[{input: array}] for steps 0 .. steps-1 from a --save-batches file (tensors "step{k}/{input}")."""
    t = read_safetensors(path)
    want = {f"step{k}/{n}" for k in range(steps) for n in names}
    missing = sorted(want - set(t))
    if missing:
        sys.exit(f"FAIL: {path} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} (holds {sorted(t)[:6]} ...)")
    return [{n: t[f"step{k}/{n}"] for n in names} for k in range(steps)]


def run_shardstep_model(a, extra, tmp, input_names):
    """Trains with shardstep (--save-init, --save, --save-batches, --metrics-out); returns
    (initial state, per-step losses, final state, batches, seconds)."""
    if a.replicas < 1 or a.batch % a.replicas:
        sys.exit(f"FAIL: --batch {a.batch} must be a positive multiple of --replicas {a.replicas}")
    init, final, metrics, batches = (os.path.join(tmp, f) for f in
                                     ("init.safetensors", "final.safetensors", "m.jsonl", "batches.safetensors"))
    cmd = [a.shardstep, "train", "--steps", str(a.steps), "--batch", str(a.batch), "--seed", str(a.seed),
           "--save-init", init, "--save", final, "--metrics-out", metrics, "--save-batches", batches,
           "--clip-norm", repr(a.clip_norm), "--replicas", str(a.replicas)] + extra
    if a.shard_weight_update: cmd += ["--shard-weight-update", a.shard_weight_update]
    if a.warmup_steps > 0: cmd += ["--schedule", "warmup", "--warmup-steps", str(a.warmup_steps)]
    cmd += a.shardstep_arg
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    secs = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"FAIL: shardstep exited with {r.returncode}:\n{r.stdout}")
    with open(metrics) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    losses = [row["loss"] for row in rows if "step" in row and "split" not in row and "loss" in row]
    if len(losses) != a.steps:
        sys.exit(f"FAIL: expected {a.steps} training rows in {metrics}, got {len(losses)}")
    if any(l is None for l in losses):
        sys.exit(f"FAIL: non-finite loss in {metrics}")
    init_state, final_state = read_safetensors(init), read_safetensors(final)
    if set(final_state) != set(init_state):
        sys.exit(f"FAIL: final checkpoint holds {sorted(final_state)}, initial {sorted(init_state)}")
    if int(final_state["step"]) != a.steps:
        sys.exit(f"FAIL: final step counter is {int(final_state['step'])}, expected {a.steps}")
    data = read_batches(batches, a.steps, input_names)
    if a.keep_dir:
        os.makedirs(a.keep_dir, exist_ok=True)
        for f in (init, final, metrics, batches): shutil.copy(f, a.keep_dir)
    return init_state, losses, final_state, data, secs


def mutate_final_weight(a, final_state, rtols=None):
    """--mutate weight (test of the test): scales shardstep's final value of the alphabetically last weight by
    1 + 2 * its tolerance (a relative L2 error of twice the tolerance; rtols: raised per-tensor tolerances)."""
    if getattr(a, "mutate", None) != "weight": return
    name = sorted(k for k in final_state if k != "step" and "/" not in k and "running_" not in k)[-1]
    tol = max(a.rtol, (rtols or {}).get(name, 0.0))
    final_state[name] = (final_state[name].astype(np.float64) * (1 + 2 * tol)).astype(np.float32)
    print(f"--mutate weight: scaled shardstep's final {name} by 1 + 2 * {tol:.2e} (twice its tolerance)")


def check_model_initial_state(init, weight_shapes, state_init, model_state):
    """The --save-init checkpoint: the logical step-0 state. weight_shapes: {weight: shape}; state_init: {optimizer
    slot: initial value} of "<weight>/<slot>"; model_state: {name: (shape, initial value)} (batch-norm running
    statistics). Exits on any difference."""
    want = (set(weight_shapes) | {f"{w}/{s}" for w in weight_shapes for s in state_init} | set(model_state) | {"step"})
    if set(init) != want:
        sys.exit(f"FAIL: initial checkpoint: unexpected {sorted(set(init) - want)}, missing {sorted(want - set(init))}")
    if int(init["step"]) != 0:
        sys.exit(f"FAIL: initial step counter is {int(init['step'])}")
    for name, v in init.items():
        if name == "step": continue
        w, _, slot = name.partition("/")
        shape = model_state[name][0] if name in model_state else weight_shapes[w]
        if tuple(v.shape) != tuple(shape):
            sys.exit(f"FAIL: initial {name} has shape {list(v.shape)}, expected {list(shape)} (logical, unpadded)")
        if not np.all(np.isfinite(v)):
            sys.exit(f"FAIL: initial {name} is not finite")
        value = model_state[name][1] if name in model_state else (state_init[slot] if slot else None)
        if value is not None and not np.all(v == np.float32(value)):
            sys.exit(f"FAIL: initial {name} is not {value} everywhere")
    print(f"initial state: {len(init)} logical tensors ({len(weight_shapes)} weights, {len(model_state)} model state), "
          f"step 0, state initialised, shapes as the model")


def rel_l2(ours, ref):
    """||ours - ref||_2 / ||ref||_2 (the absolute L2 norm when ref is all zeros), in float64."""
    o, t = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(o)): return float("inf")
    d, n = float(np.linalg.norm((o - t).ravel())), float(np.linalg.norm(t.ravel()))
    return d / n if n > 0 else d


def compare_state_l2(label, ours, theirs, name, rtol, state_rtol, rtols=None, absolute=None):
    """Every tensor of shardstep's final checkpoint (but "step") against the reference's: relative L2 error per tensor
    <= rtol (weights, model state) or state_rtol (optimizer state "<weight>/<slot>"); rtols: optional per-tensor
    tolerances that raise these. absolute: {tensor: bound} for tensors that are mathematically 0 (a gradient that
    is exactly 0, so both sides hold only rounding noise): passes when max |ours| and max |ref| are <= bound.
    Prints a table; returns 0 if all pass, else 1."""
    missing = sorted(set(ours) - set(theirs) - {"step"})
    if missing:
        print(f"FAIL: {label}: no {name} value for checkpoint tensors {missing}")
        return 1
    print(f"{'tensor':<26} {'shape':<16} {'norm(ref)':>9} {'rel L2':>9} {'max rel el':>10}")
    worst, bad, raised = {}, [], {}
    for k in sorted(set(ours) - {"step"}):
        o, t = ours[k].astype(np.float64), np.asarray(theirs[k], dtype=np.float64)
        if o.shape != t.shape:
            print(f"FAIL: {label}: {k} has shape {list(o.shape)}, {name} {list(t.shape)}")
            return 1
        if absolute and k in absolute:
            big = max(float(np.abs(o).max()), float(np.abs(t).max()))
            flag = "  <-- MISMATCH" if not big <= absolute[k] else ""
            if flag: bad.append(k)
            print(f"{k:<26} {str(list(o.shape)):<16} max |ours|, |ref| {big:9.2e} (mathematically 0: bound "
                  f"{absolute[k]:.0e})" + flag)
            continue
        kind = "optimizer state" if "/" in k else ("model state" if "running_" in k else "weights")
        tol = state_rtol if kind == "optimizer state" else rtol
        if rtols and k in rtols: tol = max(tol, rtols[k])
        r = rel_l2(o, t)
        worst[kind] = max(worst.get(kind, 0.0), r)
        if r > (state_rtol if kind == "optimizer state" else rtol) and r <= tol: raised[k] = r / tol
        flag = "  <-- MISMATCH" if not r <= tol else ""
        if flag: bad.append(k)
        print(f"{k:<26} {str(list(o.shape)):<16} {np.linalg.norm(t.ravel()):9.2e} {r:9.2e} {max_rel_diff(o, t):10.2e}"
              + (f"  (tol {tol:.2e})" if tol not in (rtol, state_rtol) else "") + flag)
    print("max relative L2 error: " + ", ".join(f"{k} {v:.3e}" for k, v in sorted(worst.items())) +
          f" (rtol {rtol:g}, optimizer state {state_rtol:g})")
    if raised:
        print(f"{len(raised)} tensor(s) over rtol / state_rtol passed only by their raised (--float32-noise) "
              f"tolerance; largest error / tolerance {max(raised.values()):.2f} ({max(raised, key=raised.get)})")
    if bad:
        print(f"FAIL: {label}: {len(bad)} tensor(s) differ by more than their tolerance: {bad}")
        return 1
    return 0


def noise_loss_tols(tol, theirs, theirs32, factor):
    """Per-step loss tolerances with --float32-noise: max(tol, factor x the largest relative distance of torch
    float32's loss from float64's at this step or before). Where float32 rounding grows along the trajectory (a
    chaotic one, as ResNet-20's with 4 examples per batch norm), it bounds how far any float32 run can stay."""
    out, worst = [], 0.0
    for x, y in zip(theirs32, theirs):
        worst = max(worst, abs(x - y) / max(abs(y), 1.0))
        out.append(max(tol, factor * worst))
    return out


def compare_losses(label, ours, theirs, name, tols, secs_ours, secs_theirs):
    """compare() with a tolerance per step (tols[i] for step i + 1). Returns 0 if all pass, else 1."""
    print(f"{label}: shardstep {secs_ours:.1f}s, {name} {secs_theirs:.1f}s")
    print(f"{'step':>4}  {'shardstep':>12}  {name:>12}  {'rel diff':>9}  {'tol':>8}")
    worst, ratio, bad = 0.0, 0.0, []
    for i, (x, y, tol) in enumerate(zip(ours, theirs, tols), 1):
        rel = abs(x - y) / max(abs(y), 1.0)
        worst, ratio = max(worst, rel), max(ratio, rel / tol)
        if not rel <= tol: bad.append(i)
        print(f"{i:>4}  {x:12.8f}  {y:12.8f}  {rel:9.2e}  {tol:8.1e}{'  <-- MISMATCH' if not rel <= tol else ''}")
    print(f"losses: max rel diff {worst:.3e}, largest diff / tolerance {ratio:.2f} (tol {min(tols):g} .. {max(tols):.2g})")
    if bad:
        print(f"FAIL: {label}: {len(bad)} step(s) differ by more than their tolerance, first at step {bad[0]}")
        return 1
    return 0
