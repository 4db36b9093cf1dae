#!/usr/bin/env bash
# One GPU sitting for the reference engine's cost (CUDA): the GPU tests of the engine and the new
# scheduling, the fault and zoo demo on CUDA, the on/off of the current engine against the
# engine without each scheduling change (bench_engine.py's /readback and /late suffixes) and with
# the eager forwards' HEAD and TAIL replayed from graphs (/graphs, and eager_graphs_host.py's host
# and device µs of HEAD and TAIL alone), and the canary's calls inside its launches. Every step writes its output under OUT; a failing step does
# not stop the next. The last lines printed are the on/off table. Each step has a time limit; with
# the default deadline (90 s of timed repeats) the whole script stays under 600 s.
#   benchmarks/device_engine_window.sh OUT [DEADLINE_S]
# e.g. benchmarks/device_engine_window.sh "$OUT" 90
set -uo pipefail
out=${1:?usage: device_engine_window.sh OUT [DEADLINE_S]}
deadline=${2:-90}
mkdir -p "$out"
export PYTHONPATH=src
step() {  # name, seconds allowed, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/status.txt"
}
step gpu_tests 140 python3 -m pytest -q -m "not slow" -n 8 tests/engine tests/e2e/test_cuda.py \
    tests/bench/test_bench_engine.py tests/runtime/test_sweep_prefetch.py tests/runtime/test_sweep_prefetch_engine.py \
    tests/runtime/test_sweep_cuda.py tests/faults/test_delivery.py tests/faults/test_replayed_verdicts.py \
    tests/runtime/test_eager_graphs.py tests/runtime/test_held.py
step eager_verdicts 80 python3 -m pytest -q -m "not slow" -n 8 tests/faults/test_eager_graph_verdicts.py
step eager_host 40 python3 benchmarks/eager_graphs_host.py --device cuda --iters 300 --json "$out/eager_host.json"
step demo 70 python3 -m kvcanary demo --device cuda --json "$out/demo.json"
step window $((deadline + 80)) python3 benchmarks/bench_engine.py --device cuda --cuda-graph --requests 384 \
    --repeats 30 --deadline-s "$deadline" --lockstep \
    --modes off/readback,partial,partial/graphs,partial/readback,partial/late,partial/readback/late \
    --json "$out/window.json"
step phases 90 python3 benchmarks/engine_phases.py --device cuda --lockstep --runs 3 --inner \
    --modes off/readback,partial,partial/graphs,partial/readback/late
tail -n 3 "$out/gpu_tests.txt" "$out/eager_verdicts.txt"
tail -n 7 "$out/eager_host.txt"
tail -n 16 "$out/window.txt"
