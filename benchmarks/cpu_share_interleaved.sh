#!/usr/bin/env bash
# The canary's share of wall time in `kv-canary run` on the CPU, for several commits run interleaved
# (a shared machine's load moves between runs; interleaving spreads it over the versions alike).
#   benchmarks/cpu_share_interleaved.sh ROUNDS "RUN OPTIONS" COMMIT...
# e.g. benchmarks/cpu_share_interleaved.sh 3 "--model small" main HEAD
# Each run is benchmarks/bench_cpu_share.py (this checkout's) over `git archive COMMIT src`; one line
# per run: commit, round, the report's "canary time share", then the canary's share of Engine.step
# by the CPU-time clock of the stepping thread (what the canary itself spent).
set -euo pipefail
rounds=$1; opts=$2; shift 2
bench=$(cd "$(dirname "$0")" && pwd)/bench_cpu_share.py
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for c in "$@"; do
    mkdir -p "$tmp/$c"
    git archive "$c" src | tar -x -C "$tmp/$c"
    PYTHONPATH="$tmp/$c/src" python -c "import kvcanary.ops._cpu as c; c.usable()" 2>/dev/null || true  # compile once
done
for r in $(seq 1 "$rounds"); do
    for c in "$@"; do
        # shellcheck disable=SC2086
        out=$(PYTHONPATH="$tmp/$c/src" python "$bench" $opts 2>&1 || true)
        share=$(echo "$out" | grep "canary time share" | tr -s ' │' ' ')
        cpu=$(echo "$out" | grep "cpu clock" | sed 's/.*cpu clock: //')
        echo "$c round=$r$share | cpu-time share of Engine.step $cpu"
    done
done
