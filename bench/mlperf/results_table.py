#!/usr/bin/env python3
"""Markdown tables of MLPerf-style runs from the binaries' result files (<binary>_result.json).

Usage: results_table.py RESULT.json...   (one file per configuration: replicas x sharding, --seeds K)
Per configuration: each seed's steps and time to train, the MLPerf-style result (mean with the fastest
and slowest dropped when K >= 3), the median step, the weight update's share of it and the optimizer
state per replica. Then, per seed, whether sharded and replicated runs at the same replica count took
the same number of steps (they must: the math is the same).
"""
import json
import sys


def config_name(r):
    return f"{r['replicas']} replica(s), update {'sharded' if r['shard_weight_update'] else 'replicated'}"


def main(paths):
    results = [json.load(open(p)) for p in paths]
    rows = []
    print("| configuration | seed: steps, time to train (s) | result (s) | median step (ms) | weight update share "
          "| optimizer state / replica (bytes) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        seeds = "; ".join(
            f"{run['seed']}: {run['steps']}, {run['seconds']:.1f}" + ("" if run["status"] == "success" else " ABORTED")
            for run in r["runs"])
        steps = sorted(run["median_step_ms"] for run in r["runs"])
        median_step = steps[len(steps) // 2]
        ttt = r.get("time_to_train_s")
        share = r.get("weight_update", {}).get("share_of_step")
        print(f"| {config_name(r)} | {seeds} | {ttt:.1f} |" if ttt is not None else f"| {config_name(r)} | {seeds} | - |",
              f"{median_step:.1f} | {share * 100:.1f}% |" if share is not None else f"{median_step:.1f} | - |",
              f"{r['optimizer_state_bytes_per_replica']:,} |")
        rows.append(r)
    # Same steps for the same seed, sharded vs replicated, at each replica count.
    by_replicas = {}
    for r in rows:
        by_replicas.setdefault(r["replicas"], {})[r["shard_weight_update"]] = {run["seed"]: run["steps"] for run in r["runs"]}
    for n, pair in sorted(by_replicas.items()):
        if len(pair) == 2:
            same = pair[True] == pair[False]
            print(f"\n{n} replicas, steps per seed sharded {pair[True]} vs replicated {pair[False]}: "
                  f"{'identical' if same else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
