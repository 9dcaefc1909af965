"""Benchmarks that run the package the way users do.

:mod:`horovod_sparse.bench.step` times the end-to-end training step through the stock
``hvd.DistributedOptimizer`` (PyTorch), or ``hvd.DistributedGradientTape`` with
``--framework tensorflow`` (:mod:`horovod_sparse.bench.step_tf`), for every compressor side by
side with Horovod's dense allreduce; ``scripts/bench_step.py`` runs it over emulated links
and writes ``docs/results/performance.md``.
"""
