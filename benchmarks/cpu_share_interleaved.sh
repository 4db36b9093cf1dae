#!/usr/bin/env bash
# The canary's share of wall time in `kv-canary run` on the CPU, for several commits run interleaved
# (a shared machine's load moves between runs; interleaving spreads it over the versions alike).
#   benchmarks/cpu_share_interleaved.sh ROUNDS "RUN OPTIONS" COMMIT...
# e.g. benchmarks/cpu_share_interleaved.sh 3 "--model small" main HEAD
# Prints one line per run: commit, round, the report's "canary time share" line.
set -euo pipefail
rounds=$1; opts=$2; shift 2
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
        line=$(PYTHONPATH="$tmp/$c/src" python -m kvcanary run $opts 2>/dev/null | grep "canary time share" || true)
        echo "$c round=$r $(echo "$line" | tr -s ' │' ' ')"
    done
done
