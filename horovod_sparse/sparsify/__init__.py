"""Sparsifying compressors' math on numpy, framework-free: one stateful pipeline per buffer.

    grad -> memory (error feedback: acc = grad + residual | DGC momentum correction)
         -> selection rule (top-k | threshold | gaussiank | sampled (DGC) | Ok-Topk local)
         -> SparseAllreduce (allgather | dsa | oktopk | gtopk; dense for warm-up)
         -> residual update (clear what was consumed)

:class:`Sparsifier` is what the frontends drive (``compressor.make_sparsifier(n, comm)``
then ``sparsifier.step(grad, tag=...)`` once per step on every rank). Modules:
:mod:`.selection` (the rules' math and the count guarantee), :mod:`.rules` (rules as
objects), :mod:`.memory` (residual / momentum), :mod:`.sparsifier` (the pipeline).
"""
from horovod_sparse.sparsify.selection import count_bounds, k_for
from horovod_sparse.sparsify.sparsifier import SELECTING_EXCHANGES, Sparsifier, StepInfo

__all__ = ["Sparsifier", "StepInfo", "SELECTING_EXCHANGES", "k_for", "count_bounds"]
