#!/bin/bash
# The overflow check's cost in the training step: bench_step on the two real workloads,
# loopback, P = 2, the tree before the check (commit b68bd81) and after it, in alternating
# rounds of one run. Run from the checkout (its .venv), with the older tree beside it:
#   git worktree add /tmp/before b68bd81
#   bash docs/data/overflow/ab_step.sh /tmp/before "$PWD" /tmp/ab
set -u
before=$1 after=$2 out=$3
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
for round in 1 2 3; do
  for side in before after; do
    dir=$before; [ "$side" = after ] && dir=$after
    (cd "$dir" && PYTHONPATH="$dir" "$after/.venv/bin/python" scripts/bench_step.py --links loopback \
      --models digits_resnet stdlib_lm --compressors dense topk:density=0.01 powersgd --steps 10 --warmup 3 \
      --rounds 1 --no-doc --out "$out/r$round-$side.jsonl" --note "overflow check A/B, $side, round $round")
  done
done
