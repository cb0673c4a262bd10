#!/usr/bin/env python3
"""A bf16 safetensors file written by shardstep opens in PyTorch (issue 10).

Runs shardstep's bf16_test "[.torch_export]" case, which writes tensor "x" (bf16) and "y" (the same
values in f32), then loads the file with the `safetensors` package when it is installed, else by
parsing the header (8-byte little-endian length, JSON) and torch.frombuffer(dtype=torch.bfloat16).
Checks: dtype and shape as written; x's bits equal torch's own f32 -> bf16 conversion of y (round to
nearest even: the same rounding) for every finite element and infinity, and x is NaN where y is; and
x widened to f32 is within half a bf16 ulp of y (2^-8 relative: an ulp is 2^-7 of a value with mantissa 1.0). --mutate flips one bit of x in the
loaded copy, which must fail.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import torch


def load(path):
    try:
        from safetensors.torch import load_file  # optional
        return load_file(path), "safetensors"
    except ImportError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    names = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        buf = bytearray(data[base + b:base + end])
        t = torch.frombuffer(buf, dtype=names[e["dtype"]]) if end > b else torch.empty(0, dtype=names[e["dtype"]])
        out[name] = t.reshape(e["shape"])
    return out, "header + torch.frombuffer"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--test-binary", required=True, help="the bf16_test executable")
    ap.add_argument("--mutate", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ss_bf16_torch.") as d:
        path = os.path.join(d, "bf16.safetensors")
        env = dict(os.environ, SS_BF16_EXPORT=path)
        subprocess.run([a.test_binary, "[.torch_export]"], check=True, env=env, stdout=subprocess.DEVNULL)
        tensors, how = load(path)
    x, y = tensors["x"], tensors["y"]
    problems = []
    if x.dtype != torch.bfloat16:
        problems.append(f"x has dtype {x.dtype}")
    if y.dtype != torch.float32 or x.shape != y.shape or list(x.shape) != [4, 251]:
        problems.append(f"shapes/dtypes: x {x.dtype} {list(x.shape)}, y {y.dtype} {list(y.shape)}")
    if a.mutate:
        x = x.clone()
        x.view(torch.int16).view(-1)[17] ^= 1
    xb = x.view(torch.int16).flatten().to(torch.int64) & 0xFFFF
    want = y.to(torch.bfloat16).view(torch.int16).flatten().to(torch.int64) & 0xFFFF
    xf, yf = x.float().flatten(), y.flatten()
    nan = torch.isnan(yf)
    if not torch.equal(torch.isnan(xf), nan):
        problems.append("NaN positions differ")
    bad = ((xb != want) & ~nan).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        problems.append(f"{len(bad)} elements differ from torch's rounding, first {i}: 0x{xb[i]:04x} vs 0x{want[i]:04x}")
    finite = torch.isfinite(yf) & torch.isfinite(xf)
    rel = ((xf[finite].double() - yf[finite].double()).abs() / yf[finite].double().abs().clamp_min(1e-38)).max().item()
    if rel > 2.0 ** -8:
        problems.append(f"max relative rounding error {rel} > 2^-8")
    if not (xf[-4] == float("inf") and xf[-3] == float("-inf") and torch.isnan(xf[-2]) and xf[-1] == float("inf")):
        problems.append(f"specials: {xf[-4:].tolist()}")
    print(f"loaded with {how}: x {x.dtype} {list(x.shape)}, {xb.numel()} elements, max relative error {rel:.3g}")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print("PASS: shardstep's bf16 safetensors file opens in PyTorch with torch's own rounding, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
