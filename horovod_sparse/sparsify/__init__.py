"""Sparsifying compressors' step, on numpy or torch (any device): one stateful pipeline per buffer.

    grad -> memory (error feedback: acc = grad + residual | DGC momentum correction)
         -> selection rule (top-k | threshold | gaussiank | sampled (DGC) | Ok-Topk local)
         -> SparseAllreduce (allgather | dsa | oktopk | gtopk; dense for warm-up)
         -> residual update (clear what was consumed)

:class:`Sparsifier` is what the frontends drive (``compressor.make_pipeline(n, comm)``
then ``sparsifier.step_sparse(grad, tag=...)`` once per step on every rank). Modules:
:mod:`.selection` (the rules, their carried thresholds and the count guarantee),
:mod:`.sparsifier` (the pipeline); the memory is :mod:`horovod_sparse.memory`.
"""
from horovod_sparse.sparsify.selection import count_bounds, k_for

__all__ = ["Sparsifier", "StepInfo", "SELECTING_EXCHANGES", "k_for", "count_bounds"]
_PIPELINE_NAMES = ("Sparsifier", "StepInfo", "SELECTING_EXCHANGES")


def __getattr__(name):
    """The pipeline's names, imported when first asked for: so the rules and :func:`k_for`
    (random-k's count too) import without the exchange, whose mpi4py would start MPI."""
    if name in _PIPELINE_NAMES:
        from horovod_sparse.sparsify import sparsifier
        return getattr(sparsifier, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
