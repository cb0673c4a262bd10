#!/usr/bin/env python3
"""Reference of shardstep's random_uniform (ir/ops.def) in numpy with uint64 arithmetic.

Element (i, rest...) of random_uniform(step, first_example){seed, shape} has global example
e = first_example + i and index j = flat index of `rest`; its value is word 0 of Philox4x32-10
(Salmon et al. 2011, Random123) with key (seed & 0xffffffff, seed >> 32) and counter (j, e, step, 0),
mapped to (x0 >> 8) * 2^-24 in [0, 1).

  philox.py --self-test                     Random123's known-answer vectors; exit 1 on a mismatch
  philox.py --seed S --step T --first-example E --shape 4,5
                                            prints each value's f32 bits as 8 hex digits, one a line
"""
import argparse
import sys

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
MASK = np.uint64(0xFFFFFFFF)
SHIFT = np.uint64(32)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of uint64 arrays holding 32-bit counter words, key words k0, k1 (uint64)."""
    x = [np.asarray(w, dtype=np.uint64) & MASK for w in (c0, c1, c2, c3)]
    ka, kb = np.uint64(k0) & MASK, np.uint64(k1) & MASK
    for r in range(10):
        if r:
            ka, kb = (ka + W0) & MASK, (kb + W1) & MASK
        p0, p1 = M0 * x[0], M1 * x[2]  # < 2^64: exact in uint64
        x = [((p1 >> SHIFT) ^ x[1] ^ ka) & MASK, p1 & MASK, ((p0 >> SHIFT) ^ x[3] ^ kb) & MASK, p0 & MASK]
    return x


def random_uniform(seed, step, first_example, shape):
    shape = tuple(shape)
    total = int(np.prod(shape)) if shape else 1
    per_example = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    flat = np.arange(total, dtype=np.uint64)
    j = flat % np.uint64(per_example)
    e = (np.uint64(first_example & 0xFFFFFFFF) + flat // np.uint64(per_example)) & MASK
    st = np.full(total, step & 0xFFFFFFFF, dtype=np.uint64)
    x0 = philox4x32_10(j, e, st, np.zeros(total, dtype=np.uint64), seed & 0xFFFFFFFF, seed >> 32)[0]
    return ((x0 >> np.uint64(8)).astype(np.float64) * 2.0**-24).astype(np.float32).reshape(shape)


KAT = [  # (counter, key, expected) from Random123's kat_vectors
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def self_test():
    ok = True
    for ctr, key, want in KAT:
        got = tuple(int(w) for w in philox4x32_10(*ctr, *key))
        if got != want:
            print(f"KAT mismatch: ctr {ctr} key {key}: got {[hex(w) for w in got]}, want {[hex(w) for w in want]}")
            ok = False
    # Splitting the batch does not change an example's values.
    whole = random_uniform(7, 3, 10, (8, 5))
    halves = np.concatenate([random_uniform(7, 3, 10, (4, 5)), random_uniform(7, 3, 14, (4, 5))])
    if not np.array_equal(whole, halves):
        print("replica split changed the values")
        ok = False
    if not (whole.min() >= 0.0 and whole.max() < 1.0):
        print("values outside [0, 1)")
        ok = False
    print("philox.py self-test:", "ok" if ok else "FAILED")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--first-example", type=int, default=0)
    ap.add_argument("--shape", default="")
    a = ap.parse_args()
    if a.self_test:
        sys.exit(0 if self_test() else 1)
    shape = [int(d) for d in a.shape.split(",") if d]
    values = random_uniform(a.seed % 2**64, a.step, a.first_example, shape)
    sys.stdout.write("".join(f"{int(b):08x}\n" for b in values.reshape(-1).view(np.uint32)))


if __name__ == "__main__":
    main()
