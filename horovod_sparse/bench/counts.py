"""One training step's device work, counted: aten ops, host synchronisations and
host transfers of an out-of-band compressor's ``compress`` + exchange + ``decompress``, through
the stock ``hvd.DistributedOptimizer`` at whatever world size (at least 2) was launched.

The step runs under the device path (:func:`horovod_sparse.ops.cpu.device_path`), so CPU
tensors run exactly the torch ops a CUDA tensor runs and the counts are the GPU's. Only what
Horovod's calls of ``compress`` and ``decompress`` run is counted (the pipeline's exchange
runs inside the step's first ``decompress``); backward, Horovod's own allreduce of the
probes and the optimizer's update are not. Counted with
:class:`~horovod_sparse.ops.counting.DeviceCounts`; ``scripts/bench_codecs.py --count`` prints
them, ``tests/parallel/torch/test_device_counts.py`` holds them to ceilings.

Example (after ``hvd.init()``, with ``HOROVOD_SPARSE_WARMUP_STEPS=0``)::

    count_step("topk:density=0.01", tensors=30)   # {"ops": ..., "syncs": ..., "transfers_out": ...}
"""
import torch
import horovod.torch as hvd

import horovod_sparse.torch as hvds
from horovod_sparse.ops import cpu
from horovod_sparse.ops.counting import DeviceCounts

#: each gradient's shape: a matrix, so PowerSGD compresses every one; fixed, so the growth
#: between two gradient counts is per tensor of this size
SHAPE = (32, 32)


def count_step(spec, tensors, shape=SHAPE, warmup=1, seed=0):
    """The counts (:meth:`~horovod_sparse.ops.counting.DeviceCounts.summary`, this rank's) of
    the step after ``warmup`` steps of a model of ``tensors`` parameters of ``shape``, trained
    with ``spec`` (every gradient compressed: ``dense_below=0``). Each step's gradients are
    random (drawn per rank and step), the loss being sum(p * w) for random w."""
    if hvd.size() < 2:  # Horovod's optimizer registers no hooks then: nothing would be compressed
        raise RuntimeError("count_step needs at least 2 ranks (mpirun -np 2)")
    params = [torch.nn.Parameter(torch.zeros(shape)) for _ in range(tensors)]
    compression = hvds.Compression.from_spec(spec, dense_below=0)
    counts, counting = DeviceCounts(), [False]
    for name in ("compress", "decompress"):  # Horovod calls them on this object, per gradient
        setattr(compression, name, _counted(getattr(compression, name), counts, counting))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01), compression=compression,
                                   named_parameters=[(f"p{i:04d}", p) for i, p in enumerate(params)])
    generator = torch.Generator().manual_seed(seed * 1000 + hvd.rank())
    try:
        with cpu.device_path():
            for step in range(warmup + 1):
                weights = [torch.randn(shape, generator=generator) for _ in params]
                opt.zero_grad()
                counting[0] = step == warmup  # compress runs in backward's hooks
                regime = compression.regime()  # {}: no compressed step yet
                if counting[0] and not (regime and all(r.startswith("steady") for r in regime.values())):
                    raise RuntimeError(f"{spec}: step {step} is not steady ({regime}): "
                                       "set HOROVOD_SPARSE_WARMUP_STEPS=0 or more warm-up steps")
                sum((p * w).sum() for p, w in zip(params, weights)).backward()
                opt.step()
    finally:
        compression.close()
    return counts.summary()


def _counted(method, counts, counting):
    def run(*args, **kwargs):
        if not counting[0]:
            return method(*args, **kwargs)
        with counts:
            return method(*args, **kwargs)
    return run


def growth(low, high, low_tensors, high_tensors):
    """Per additional tensor, each count's growth from ``low_tensors`` to ``high_tensors``."""
    return {key: (high[key] - low[key]) / (high_tensors - low_tensors) for key in low}
