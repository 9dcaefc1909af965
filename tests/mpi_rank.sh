#!/bin/sh
# Per-rank wrapper used by scripts/run_tests.py under mpirun (or horovodrun --gloo): rank 0 prints to the
# terminal, the other ranks to a log file; every rank writes its own JUnit XML.
# Usage: mpi_rank.sh LOGDIR COMMAND...
logdir=$1; shift
rank=${OMPI_COMM_WORLD_RANK:-${HOROVOD_RANK:-0}}
if [ "$rank" = 0 ]; then
    exec "$@" --junitxml="$logdir/rank$rank.xml"
else
    exec "$@" --junitxml="$logdir/rank$rank.xml" >"$logdir/rank$rank.log" 2>&1
fi
