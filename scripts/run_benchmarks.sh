#!/usr/bin/env bash
# Run the benchmark matrix of docs/results/benchmarks.md and regenerate its tables and plot.
#
#   sudo scripts/run_benchmarks.sh            # full matrix (needs root for the namespaces)
#   N=1000000 PS="2" RATES="1gbit none" scripts/run_benchmarks.sh   # quick smoke run
#
# Every (rate, P) pair is one `scripts/netem.py --rate R -np P -- python
# scripts/bench_exchange.py ...` run over all algorithms; rate "none" is plain loopback.
# Records go to $RESULTS (fresh each time); when the matrix is done they are copied to
# $DATA and docs/results/benchmarks.md / docs/results/benchmarks.png are regenerated from $DATA.
# A failed or timed-out (rate, P) run is reported and skipped, the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
N=${N:-25000000}
DENSITY=${DENSITY:-0.01}
REPEATS=${REPEATS:-10}
WARMUP=${WARMUP:-2}
PS=${PS:-"2 3 4"}
RATES=${RATES:-"1gbit 10gbit none"}
ALGORITHMS=${ALGORITHMS:-dense,allgather,oktopk,gtopk,dsa}
RUN_TIMEOUT=${RUN_TIMEOUT:-900}          # seconds per (rate, P) run
RESULTS=${RESULTS:-results/benchmarks.jsonl}
DATA=${DATA:-docs/results/benchmarks.jsonl}
MD=${MD:-docs/results/benchmarks.md}
PNG=${PNG:-docs/results/benchmarks.png}

mkdir -p "$(dirname "$RESULTS")"
: > "$RESULTS"
failed=()
start=$(date +%s)
for rate in $RATES; do
  for np in $PS; do
    echo "=== rate=$rate P=$np n=$N density=$DENSITY repeats=$REPEATS ($(( $(date +%s) - start )) s so far)"
    # netem.py removes its namespaces on SIGTERM, which is what timeout sends first.
    timeout --kill-after=30 "$RUN_TIMEOUT" \
      "$PY" scripts/netem.py --rate "$rate" -np "$np" -- \
      "$PY" scripts/bench_exchange.py --n "$N" --density "$DENSITY" --repeats "$REPEATS" \
        --warmup "$WARMUP" --algorithms "$ALGORITHMS" --out "$RESULTS" --no-table
    rc=$?
    if [ $rc -ne 0 ]; then echo "!!! rate=$rate P=$np failed (exit $rc)"; failed+=("$rate/P=$np"); fi
  done
done
echo "matrix done in $(( $(date +%s) - start )) s"

if [ -s "$RESULTS" ]; then
  cp "$RESULTS" "$DATA"
  "$PY" scripts/plot_benchmarks.py "$DATA" --png "$PNG" --update-md "$MD"
fi
if [ ${#failed[@]} -ne 0 ]; then echo "failed runs: ${failed[*]}"; exit 1; fi
