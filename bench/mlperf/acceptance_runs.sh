#!/usr/bin/env bash
# Issue 11's acceptance runs of one MLPerf-style binary: --seeds 3 with --replicas 1, then 8 replicas with the
# weight update sharded and replicated, one configuration after the other (run it on an otherwise idle machine:
# times to train are wall-clock). Each configuration's result JSON, quality SVG, MLPerf logs and summary go to
# OUT/<config>/; the logs are then checked with `shardstep check-mllog` and the table printed.
# Usage: bench/mlperf/acceptance_runs.sh resnet|transformer|bert [BUILD_DIR=build] [OUT=docs/results/mlperf/<name>]
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: $0 resnet|transformer|bert [build dir] [out dir]}
build=${2:-build}
out=${3:-docs/results/mlperf/$name}
binary=$build/bench/mlperf_$name
[[ -x $binary ]] || { echo "$0: $binary not built (ninja -C $build bench/mlperf_$name)" >&2; exit 1; }
configs=("r1 --replicas 1" "r8on --replicas 8 --shard-weight-update on" "r8off --replicas 8 --shard-weight-update off")
for cfg in "${configs[@]}"; do
  read -r dir flags <<< "$cfg"
  d=$out/$dir
  mkdir -p "$d"
  echo "== mlperf_$name $flags --seeds 3 ($(date -u +%T))"
  # shellcheck disable=SC2086
  "$binary" $flags --seeds 3 --log "$d/mllog.txt" --out-dir "$d" | tee "$d/stdout.txt" | grep -v '^step '
  grep -v '^step ' "$d/stdout.txt" > "$d/summary.txt" && rm "$d/stdout.txt"
done
"$build/shardstep" check-mllog "$out"/*/mllog_run*.txt
/usr/bin/python3 bench/mlperf/results_table.py "$out"/*/mlperf_"${name}"_result.json
